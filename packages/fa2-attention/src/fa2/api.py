"""The public entry point: validate once (``fa2.validation``), pick a backend, dispatch.

Every backend is reached the same way, with the caller's tensors as (batch, heads, seqlen, head_dim) views
(``fa2.layout.as_bhnd``), a bool ``causal`` and a float ``scale``. Under torch.compile, through the backend's
custom op ``fa2::<name>_fwd`` (``fa2.ops``), which the graph holds as one node and whose autograd runs the
backend's backward op. Eagerly, straight to the backend: its ``flash_attn_forward``, or its ``FlashAttention2``
autograd function when a gradient is wanted. The two compute the same thing with the same kernels; the eager
path skips the custom op's Python dispatch, which costs ~60 µs a call on the H200's host (measured there,
fa2-triton, 227 µs a call through the op against 163 µs direct) and shows in the time of a short call.
Nothing below this module validates again.
"""

from __future__ import annotations

import dataclasses

import torch

from fa2 import kvcache, ops, registry
from fa2.layout import forward_any_rank
from fa2.spec import AttentionOutput, AttentionSpec
from fa2.validation import (
    MAX_HEAD_DIM,
    check_causal,
    check_max_seqlens,
    check_offsets,
    check_varlen_alibi,
    make_spec,
    validate,
)

# MAX_HEAD_DIM and make_spec live in fa2.validation, AttentionOutput in fa2.spec; fa2.api names them too.
__all__ = ["MAX_HEAD_DIM", "AttentionOutput", "attention", "decodes", "make_spec", "varlen_attention"]

# Decode shapes, few queries against many keys (a generate step; speculative decoding's few draft tokens),
# run by the backend's split-KV KV-cache kernels (``kvcache_forward``, ``fa2.kvcache``) when no gradient is
# wanted: the dense grid has one program per (query tile, batch, head), batch · heads programs that leave
# most of a GPU idle and each read their key/value head again, while the split-KV grid splits the keys over
# the GPU and reads each key/value head once for its whole group. The GPU backends only: fa2-pytorch's
# KV-cache path did not measurably beat its dense one on the CPU (issue 39, at e0ed649 on a shared 2-core
# machine: faster at some decode shapes, slower at others, 8 × 2k keys 27× slower).
DECODE_BACKENDS = ("triton", "numba-cuda")
# The shape rule (``decodes``): seqlen_q <= DECODE_MAX_SEQLEN_Q and seqlen_k >= DECODE_MIN_KEYS[backend] and
# >= DECODE_MIN_KEYS_PER_QUERY · seqlen_q. From the H200 (docs/benchmarks/h200-decode-routing.md: bf16, 32/8
# heads, D 128, causal, batch 1 and 8, 1 / 4 / 16 queries against 256 to 16k keys): fa2-triton's KV-cache
# kernels won at every point, 1.04-7.1x (so from 256 keys, the fewest measured); fa2-numba-cuda's lost below
# 1024 keys (0.20-0.70x) and won at every point from 4096 (1.22-5.0x), 1024 being a loss at batch 1.
DECODE_MAX_SEQLEN_Q = 16
DECODE_MIN_KEYS = {"triton": 256, "numba-cuda": 4096}
DECODE_MIN_KEYS_PER_QUERY = 8


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    backend: str | None = None,
) -> AttentionOutput:
    """FlashAttention-2 forward: softmax(mask(bias(cap(q kᵀ · scale)))) v, and its logsumexp.

    Arguments:
        q: (..., seqlen_q, head_dim), e.g. (batch, seqlen_q, head_dim) or (batch, heads, seqlen_q, head_dim).
        k: (..., seqlen_k, head_dim), the same leading dims as q, but for dim -3 (the heads of rank 3 and
            up), which may be a divisor of q's: grouped-query attention (heads_k = 1: multi-query), query
            head h attends to key/value head h // (heads // heads_k). The kernels read that head in place:
            k and v are never repeated or copied per query head.
        v: (..., seqlen_k, head_dim), the same shape as k.
            q, k and v: float32, float16 or bfloat16, all the same dtype, on one device, any strides.
            head_dim from 1 to 256; a backend may support fewer and then raises NotImplementedError.
        causal: mask keys after the query, aligned bottom-right as in FlashAttention-2: key j is visible to
            query i iff j <= i + seqlen_k - seqlen_q. With seqlen_q = 2 and seqlen_k = 5::

                1 1 1 1 0
                1 1 1 1 1

            With seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see no key at all.
        scale: multiplies q kᵀ before the softmax; default 1 / sqrt(head_dim).
        window: (left, right) sliding window, each an int >= 0 or -1 for no bound on that side, aligned
            bottom-right like causal: query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right
            (Nq, Nk: seqlen_q, seqlen_k). With causal, right becomes 0 (FlashAttention-2's rule): causal is
            window (-1, 0), and causal with window (w, w) is (w, 0). With Nq = Nk = 5 and window (1, 1)::

                1 1 0 0 0
                1 1 1 0 0
                0 1 1 1 0
                0 0 1 1 1
                0 0 0 1 1

            Key tiles wholly outside the window are skipped: the cost follows the window, not Nq · Nk.
        softcap: 0.0 (off), or > 0: logit softcapping (Gemma 2), the scaled scores s become
            softcap · tanh(s / softcap) before the ALiBi bias and the mask; its gradient flows through tanh.
        alibi_slopes: None, or float32 slopes on q's device, shape (heads,) or q.shape[:-2] (e.g.
            (batch, heads)): adds -slope · |i + Nk - Nq - j| to the (capped) scores of each head, as
            flash-attn (which, under causal, adds slope · j instead: the same softmax and O, an L shifted
            per row). No gradient flows to the slopes. Needs q of rank 3 or more (a heads dim).
        sink: None, or float32 (heads,) on q's device: attention sinks (gpt-oss), a learned logit per query
            head that joins every row's softmax denominator as one more score with no value behind it:

                O_i = Σ_j exp(s_ij - L_i) v_j,   L_i = log(exp(sink[h]) + Σ_j exp(s_ij))

            (s: the final scores above). A row's weights then sum to less than 1: the head can attend to
            nothing. The L returned includes the sink, and a row that sees no key gets O = 0 and L = sink[h]
            (not +inf). Differentiable: dsink[h] = -Σ_i exp(sink[h] - L_i) · rowsum(dO_i ∘ O_i), summed over
            every leading index and row of head h. Needs q of rank 3 or more (a heads dim). Finite values: a
            sink of -inf (no sink for that head) gives a row that sees no key O = NaN, as the fp64 reference
            does, and L = NaN (the reference's -inf); not checked, which would need a device sync.
        backend: "pytorch", "triton", "numba-cuda" or None. None picks, for CUDA tensors, the fastest
            installed backend that runs natively on CUDA (triton, then numba-cuda, then pytorch); for CPU
            tensors, pytorch. An explicit backend is used or fails: fa2 never falls back to another.

    Returns:
        AttentionOutput(O, L):
        O: (..., seqlen_q, head_dim), q's dtype and device.
        L: (..., seqlen_q), float32, L = m + log(l), the natural-log logsumexp of the scaled scores of each
            query row. A row that sees no key (causal with seqlen_q > seqlen_k, a window that misses every
            key) gets O = 0 and L = +inf (L = sink[h] with a sink).
            +inf, not the -inf of an empty logsumexp, so that the backward's P = exp(S - L) is exactly 0
            on such rows instead of NaN (FlashAttention-2's convention).

    Decode shapes:
        1 <= seqlen_q <= DECODE_MAX_SEQLEN_Q (16) and seqlen_k >= DECODE_MIN_KEYS_PER_QUERY (8) · seqlen_q and
        >= the backend's DECODE_MIN_KEYS (triton 256, numba-cuda 4096: where the H200 measured the KV-cache
        kernels faster), on a backend of DECODE_BACKENDS (triton, numba-cuda), with no gradient wanted (grad
        mode off, or no input that requires grad) and outside torch.compile: the backend's split-KV KV-cache
        kernels run the call (``fa2.kvcache_attention``'s, k and v read in place as a cache full to seqlen_k
        in every row), every option above included, instead of the dense kernel, whose batch · heads query
        tiles leave most of a GPU idle there. The same O and L, within the dense kernel's tolerances.
        Otherwise, and always under torch.compile or when a gradient is wanted, the dense kernel.

    Empty inputs:
        seqlen_q = 0, or any leading dim 0: O and L are empty; in the backward dk = dv = 0.
        seqlen_k = 0: every row sees no key: O = 0 and L = +inf; in the backward dq = 0.

    NaN and inf inputs are computed through, as the fp64 reference (``fa2.reference.attention``) does,
    never refused: the outputs a bad value reaches are NaN or inf, every other output is what it would be
    without it. A NaN in q row i makes O row i and L_i NaN; a NaN in k row j does that to every row that
    sees key j; a NaN in v[j, c] makes O[i, c] NaN for every row i that sees key j, and may do so for the
    rows of key j's tile that do not see it (0 · NaN in P·V, which the reference's P @ V does for every
    row). An inf gives scores of ±inf: a +inf makes the row's O NaN and its L NaN or +inf; a -inf just
    drops that key from the row (a row whose every score is -inf counts as seeing no key).

    Raises:
        ValueError: wrong rank, mismatched shapes or devices, q's heads not a multiple of k's, bad scale,
            window entries below -1, a negative or non-finite softcap, alibi_slopes or sink of the wrong shape
            or device, unknown backend.
        TypeError: non-floating or mismatched dtypes, a causal that is not a bool, window entries that are
            not integers, alibi_slopes or sink that are not a float32 tensor.
        fa2.BackendNotInstalledError: a known backend whose package is not installed.
        NotImplementedError: the chosen backend does not support this input (its message names the limit).
    """
    validate(q, k, v)
    check_causal(causal)
    spec = make_spec(q, k, causal, scale, window, softcap, alibi_slopes, sink)
    return AttentionOutput(*_dispatch(q, k, v, spec, backend))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> AttentionOutput:
    """FlashAttention-2 on a packed batch of sequences of different lengths, without padding.

    Arguments:
        q: (total_q, heads, head_dim): the queries of every sequence, one after the other.
        k, v: (total_k, heads_k, head_dim), heads a multiple of heads_k (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: (num_seqs + 1,) int32 on q's device, the offsets: sequence s has the
            queries q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]] and the keys k[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]
            (cu_seqlens[0] = 0, cu_seqlens[-1] = total). A sequence may have 0 queries or 0 keys.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence's lengths (an upper bound is fine).
        causal, scale, window, softcap: as fa2.attention, each sequence aligned bottom-right on its own
            lengths: with sequences of 2 and 3 queries against 3 and 2 keys, causal::

                1 1 0 . .        . : not the same sequence, never visible
                1 1 1 . .
                . . . 0 0        (3 queries, 2 keys: the first sees no key)
                . . . 1 0
                . . . 1 1
        alibi_slopes: None, or float32 (heads,) or (num_seqs, heads) on q's device; the distance is each
            sequence's own, |i + Nk_s - Nq_s - j|.
        sink: None, or float32 (heads,) on q's device: attention sinks, as fa2.attention, in every sequence's
            rows (a row of a sequence with no key: O = 0, L = sink[h]; rows outside every sequence stay
            O = 0, L = +inf); its gradient sums over every sequence's rows.
        block_table: None, or (num_seqs, pages_per_seq) int32 on q's device: the keys and values are in a
            paged KV cache, k and v (num_pages, page_size, heads_k, head_dim), sequence s's keys
            [0, cu_seqlens_k[s + 1] - cu_seqlens_k[s]) at row j % page_size of page
            block_table[s, j // page_size]. Run by the backend's KV-cache kernels (``fa2.kvcache_attention``:
            split-KV, forward only); the totals of cu_seqlens_k are then not checked against k.
        backend: as fa2.attention. fa2-pytorch reads the offsets (one device sync a call) and runs each
            sequence; fa2-triton runs the whole batch in one launch of each kernel, the offsets read on the
            device; a backend without a packed path raises NotImplementedError.

    Decode shapes: as fa2.attention's, on max_seqlen_q and max_seqlen_k (1 <= max_seqlen_q <= 16, max_seqlen_k
    >= 8 · max_seqlen_q and >= DECODE_MIN_KEYS (triton 256, numba-cuda 4096), triton or numba-cuda, no
    gradient wanted, not under torch.compile): the backend's KV-cache kernels run the call, the packed k and v
    read in place as one cache row that every sequence shares, sequence s's keys [cu_seqlens_k[s],
    cu_seqlens_k[s + 1]) of it (its cache_leftpad and cache_seqlens).

    Returns:
        AttentionOutput(O, L): O (total_q, heads, head_dim), q's dtype (a view of a (heads, total_q,
        head_dim) tensor); L (heads, total_q), float32, flash-attn's varlen logsumexp layout. Rows that see
        no key: O = 0, L = +inf (L = sink[h] with a sink). O is differentiable in q, k, v and the sink.

    Checked, at the cost of one device sync (the offsets' first and last entries) the first time an offsets
    tensor is met (again after it is modified in place; every call for inference-mode tensors and under
    torch.compile): that cu_seqlens_q and cu_seqlens_k start at 0 and end at total_q and total_k. Not
    checked (a sync over every entry): that the offsets never decrease and that no sequence is longer than
    max_seqlen_q / max_seqlen_k. fa2-pytorch, which reads every offset anyway, refuses decreasing ones
    (ValueError); the GPU backends' kernels, sized by max_seqlen and reading the offsets themselves, clamp
    each sequence's offsets into [0, total] (wrong offsets give wrong rows, never accesses outside the
    tensors): a sequence whose offsets decrease is empty, rows that two sequences claim are written twice,
    and a sequence's rows past max_seqlen_q are not written.

    Raises:
        ValueError / TypeError: as fa2.attention, and for offsets of the wrong dtype, rank, device, length
            or totals, and max_seqlen that is not a non-negative int.
        fa2.kvcache.CacheRangeError (ValueError and RuntimeError): with block_table, a sequence with more
            keys (cu_seqlens_k's steps) than block_table addresses (pages_per_seq · page_size); its message
            names block_table.
    """
    if block_table is not None:
        return kvcache.varlen_paged(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            scale,
            window,
            softcap,
            alibi_slopes,
            sink,
            block_table,
            backend,
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape (total, heads, head_dim), got {shape}")
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    validate(q4, k4, v4)
    check_causal(causal)
    num_seqs = check_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    spec = make_spec(q4, k4, causal, scale, window, softcap, sink=sink)
    slopes = None if alibi_slopes is None else check_varlen_alibi(alibi_slopes, q, num_seqs)
    spec = dataclasses.replace(
        spec,
        alibi_slopes=slopes,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    O, L = _dispatch(q4, k4, v4, spec, backend)
    return AttentionOutput(O[0].transpose(0, 1), L[0])


def _dispatch(q, k, v, spec: AttentionSpec, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():
        # Never routed to the KV-cache kernels: kvcache_forward has no custom op, and traced it would
        # specialise on seqlen_k (its launch plan is cached per capacity), a recompilation per decode step.
        op = ops.forward_op(backend, q.device)
        return forward_any_rank(lambda *a: ops.call_forward(op, *a), q, k, v, spec)
    impl = registry.load(backend if backend is not None else registry.default_backend(q.device))
    sink = spec.sink
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    ):
        return impl.FlashAttention2.apply(q, k, v, spec.causal, spec.scale, True, spec, sink)
    if decodes(impl.NAME, q, k, spec):
        return forward_any_rank(lambda *a: kvcache.dense_forward(impl.kvcache_forward, *a), q, k, v, spec)
    return forward_any_rank(impl.flash_attn_forward, q, k, v, spec)


def decodes(backend: str, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether fa2.attention / fa2.varlen_attention run this forward by ``backend``'s KV-cache kernels (see
    DECODE_BACKENDS): a backend of DECODE_BACKENDS, at most DECODE_MAX_SEQLEN_Q queries (packed: max_seqlen_q),
    at least one, and at least DECODE_MIN_KEYS_PER_QUERY times as many keys (packed: max_seqlen_k), and at
    least the backend's DECODE_MIN_KEYS. Asked only when no gradient is wanted and outside torch.compile."""
    seqlen_q, seqlen_k = (spec.max_seqlen_q, spec.max_seqlen_k) if spec.varlen else (q.shape[-2], k.shape[-2])
    return (
        backend in DECODE_BACKENDS
        and 1 <= seqlen_q <= DECODE_MAX_SEQLEN_Q
        and seqlen_k >= max(DECODE_MIN_KEYS[backend], DECODE_MIN_KEYS_PER_QUERY * seqlen_q)
    )
