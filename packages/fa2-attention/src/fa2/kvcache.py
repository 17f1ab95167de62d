"""``fa2.kvcache_attention``: attention of a few new queries against a KV cache, with the append of the new
keys and values and their rotary embedding, for decoding.

    O, L = fa2.kvcache_attention(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new, causal=True)

Layouts are fa2's (batch, heads, seqlen, head_dim), any strides: a cache stored as flash-attn stores it,
(batch, seqlen, heads_k, head_dim), is passed as ``k_cache.transpose(1, 2)``. The steps, in order:

1. rotary (``rotary_cos`` given): q and the new k rotated, in float32, at their positions in the cache;
2. append (``k``, ``v`` given): the new keys and values written into the caches, in place, at
   ``cache_seqlens`` (a contiguous cache's row ``cache_batch_idx[b]``, or a paged cache's pages);
3. attention of q against keys [0, cache_seqlens + seqlen_new) of each row's cache, by the backend's
   ``kvcache_forward``: split-KV kernels whose partial results are merged by their logsumexp (``fa2.combine``'s
   merge, in the backend's own kernel), every query head of a group read from one pass over its K/V.

Steps 1 and 2 are a handful of PyTorch ops here, the same for every backend; step 3 is each backend's own.
None of them synchronises with the device or allocates outside torch's caching allocator, so a call can be
captured in a CUDA graph; the range checks that need the device's values run outside a capture only, once
per combination of index tensors (``_check_ranges``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from fa2 import ops, registry
from fa2.spec import AttentionOutput, AttentionSpec
from fa2.validation import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    check_causal,
    check_index,
    check_max_seqlens,
    check_offsets,
    check_varlen_alibi,
    is_integer,
    make_spec,
)

__all__ = ["CacheRangeError", "kvcache_attention"]


class CacheRangeError(ValueError, RuntimeError):
    """Key counts outside what a KV cache holds: cache_seqlens + seqlen_new (or a packed batch's cu_seqlens_k
    steps) below 0 or past the capacity, which for a paged cache is what its block_table addresses. A
    ValueError, as fa2's other range checks; a RuntimeError too, as flash-attn's (its
    test_flash_attn_kvcache_paged_block_table_bounds expects one whose message names block_table)."""


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int | None = None,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
    block_table: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    num_splits: int = 0,
    backend: str | None = None,
) -> AttentionOutput:
    """Attention of q against a KV cache, after appending the new keys and values to it.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim): the new queries (one token a row when decoding).
        k_cache, v_cache: the cache, modified in place when k and v are given. Either contiguous,
            (batch_cache, heads_k, seqlen_cache, head_dim), row b of q reading cache row
            cache_batch_idx[b] (default b, batch_cache = batch); or paged, with block_table,
            (num_pages, heads_k, page_size, head_dim), any page_size >= 1. heads a multiple of heads_k
            (grouped-query attention). q's dtype and device, any strides.
        cache_seqlens: the keys already in each row's cache, before the new ones: an int, or (batch,) int32
            on q's device; None: the whole capacity (seqlen_cache, or pages_per_seq · page_size).
        k, v: None, or (batch, heads_k, seqlen_new, head_dim): written at positions
            [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of row b's cache, then attended to.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2), q's dtype: the rotary embedding of
            the first rotary_dim channels of q and of the new k (only with k), at position
            cache_seqlens[b] + t for token t of the new k, and for q at cache_seqlens[b] + t when causal or
            windowed, cache_seqlens[b] for every token otherwise (flash-attn's rule). Positions past
            seqlen_ro read its last row.
        rotary_interleaved: rotate channel pairs (0, 1), (2, 3), ... (GPT-J) instead of the two halves of
            the rotary channels (GPT-NeoX).
        block_table: None, or (batch, pages_per_seq) int32 on q's device: key j of row b is row
            j % page_size of page block_table[b, j // page_size]. Not with cache_batch_idx.
        cache_batch_idx: None, or (batch,) int32: which contiguous-cache row each row of q uses.
        cache_leftpad: None, or (batch,) int32: each row's first key; the keys before it are padding.
        causal, scale, window, softcap, alibi_slopes: as ``fa2.attention``, aligned on each row's key
            count K_b = cache_seqlens[b] + seqlen_new: query i sees key j iff leftpad_b <= j < K_b and
            i + K_b - Nq - left <= j <= i + K_b - Nq + right. With Nq = 2, K_b = 5 and causal::

                1 1 1 1 0
                1 1 1 1 1

            alibi_slopes: (heads,) or (batch, heads) float32, distance |i + K_b - Nq - j|.
        sink: None, or float32 (heads,) on q's device: attention sinks, as ``fa2.attention``: sink[h] joins
            every row's softmax denominator and L, once (not once per split); a row that sees no key gets
            O = 0, L = sink[h].
        num_splits: each (row, key/value head) is split into this many key ranges of the capacity, attended
            to in parallel and merged by their logsumexp; 0: the backend picks (more splits when batch ·
            heads_k is small against the GPU's SMs); 1: no split.
        backend: as fa2.attention; the backend must have a ``kvcache_forward``.

    Returns:
        AttentionOutput(O (batch, heads, seqlen_q, head_dim), q's dtype; L (batch, heads, seqlen_q),
        float32). Rows that see no key: O = 0, L = +inf (L = sink[h] with a sink). No gradient flows through a
        KV cache: the backward of O raises NotImplementedError.

    Checked when the call is not being captured in a CUDA graph, at the cost of one device sync, once for
    each combination of the index tensors given (a tensor modified in place counts as new): cache_seqlens
    + seqlen_new within the capacity and >= 0, block_table's page ids within [0, num_pages),
    cache_batch_idx within [0, batch_cache), cache_leftpad within [0, cache_seqlens + seqlen_new]. Not
    checked under a capture; the kernels then clamp every index into its tensor (wrong values give wrong
    rows, never accesses outside the tensors), and new keys past a contiguous cache's end land in its
    last slot.

    Raises:
        ValueError / TypeError: as fa2.attention; caches of the wrong rank, shape, dtype or device; index
            tensors of the wrong dtype, shape or device, or out of range (above); k without v or without
            cache_seqlens; rotary without k, or of the wrong shape; block_table with cache_batch_idx.
        CacheRangeError (ValueError and RuntimeError): cache_seqlens + seqlen_new below 0 or past the
            capacity; for a paged cache the message names block_table, whose pages_per_seq · page_size keys
            are all a row can address (flash-attn raises RuntimeError there).
        NotImplementedError: the backend has no KV-cache path, or cannot run this input.
    """
    batch, heads, seqlen_q, head_dim = _check_caches(q, k_cache, v_cache, block_table)
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    seqlen_new = _check_new(q, k_cache, k, v)
    check_causal(causal)
    seqlens = _cache_seqlens(cache_seqlens, batch, capacity, seqlen_new, q.device, block_table)
    for name, t, size in (("cache_batch_idx", cache_batch_idx, batch), ("cache_leftpad", cache_leftpad, batch)):
        check_index(name, t, (size,), q.device)
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx is for a contiguous cache: a paged cache's rows are its block_table's")
    if cache_batch_idx is None and not paged and k_cache.shape[0] != batch:
        raise ValueError(
            f"a contiguous cache without cache_batch_idx has q's batch {batch} rows, got k_cache {tuple(k_cache.shape)}"
        )
    rotary = _check_rotary(rotary_cos, rotary_sin, q, k, head_dim)
    if not (torch.compiler.is_compiling() or _capturing(q)):
        _check_ranges(
            cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
            seqlens,
            seqlen_new,
            capacity,
            k_cache.shape[0],
            block_table,
            cache_batch_idx,
            cache_leftpad,
        )
    # The keys each row attends to, the new ones included (a tensor op: the append below reads seqlens).
    spec = make_spec(
        q,
        k_cache,
        causal,
        scale,
        window,
        softcap,
        alibi_slopes,
        sink,
        cache_seqlens=seqlens + seqlen_new if seqlen_new else seqlens,
        cache_leftpad=cache_leftpad,
        cache_batch_idx=cache_batch_idx,
        block_table=block_table,
        num_splits=_num_splits(num_splits),
    )

    if rotary is not None:
        cos, sin = rotary
        # flash-attn's rule: with a mask, query t sits at cache_seqlens + t; without one, every query at
        # cache_seqlens.
        offset = (
            torch.arange(seqlen_q, device=q.device)
            if spec.masked
            else torch.zeros(seqlen_q, device=q.device, dtype=torch.int64)
        )
        q = _rotate(q, cos, sin, seqlens[:, None] + offset, rotary_interleaved)
        k = _rotate(k, cos, sin, seqlens[:, None] + torch.arange(seqlen_new, device=q.device), rotary_interleaved)
    if k is not None:
        _append(k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx)
    O, L = run(q, k_cache, v_cache, spec, backend)
    return AttentionOutput(O, L)


def varlen_paged(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale,
    window,
    softcap,
    alibi_slopes,
    sink,
    block_table,
    backend,
) -> AttentionOutput:
    """``fa2.varlen_attention`` with a block table: packed queries q (total_q, heads, head_dim) against
    each sequence's pages of k_cache, v_cache (num_pages, page_size, heads_k, head_dim), by the backend's
    kvcache_forward with spec.cu_seqlens_q; sequence s has cu_seqlens_k[s + 1] - cu_seqlens_k[s] keys."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must have shape (total_q, heads, head_dim), got {shape}")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"with block_table, {name} must have shape (num_pages, page_size, heads_k, head_dim), got {shape}"
            )
    q4 = q.transpose(0, 1).unsqueeze(0)
    k_pages, v_pages = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    _check_caches(q4, k_pages, v_pages, None)
    check_causal(causal)
    # cu_seqlens_k's total is the keys of every sequence, not a size of k: only cu_seqlens_q's is checked.
    num_seqs = check_offsets(q, None, cu_seqlens_q, cu_seqlens_k)
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    check_index("block_table", block_table, (num_seqs, None), q.device)
    capacity = block_table.shape[1] * k_pages.shape[2]
    seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    if not (torch.compiler.is_compiling() or _capturing(q)):
        _check_ranges(cu_seqlens_k, seqlens, 0, capacity, k_pages.shape[0], block_table, None, None)
    spec = make_spec(q4, k_pages, causal, scale, window, softcap, sink=sink)
    slopes = None if alibi_slopes is None else check_varlen_alibi(alibi_slopes, q, num_seqs)
    spec = dataclasses.replace(
        spec,
        alibi_slopes=slopes,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        cache_seqlens=seqlens.to(torch.int32),
        block_table=block_table,
    )
    O, L = run(q4, k_pages, v_pages, spec, backend)
    return AttentionOutput(O[0].transpose(0, 1), L[0])


def dense_forward(forward, q, k, v, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense or packed problem on (B, H, N, D) views (``fa2.attention``'s, ``fa2.varlen_attention``'s) run by
    a backend's ``kvcache_forward``, as fa2.api routes decode shapes: dense k and v (batch, heads_k, seqlen_k,
    head_dim) are a contiguous cache full to seqlen_k in every row; packed, (1, heads_k, total_k, head_dim) is
    one cache row that every sequence reads (a stride-0 view over the sequences, no copy), sequence s's keys
    [cu_seqlens_k[s], cu_seqlens_k[s + 1]) its cache_leftpad and cache_seqlens. The masks and ALiBi, aligned
    on each row's K_b, then fall where the dense kernels put them: K_b - Nq_b is the same shift from a
    sequence's first key. Offsets that decrease give an empty sequence, as in the dense kernels."""
    if spec.varlen:
        num_seqs = spec.cu_seqlens_q.numel() - 1
        k, v = (t.expand(num_seqs, *t.shape[1:]) for t in (k, v))
        seqlens, leftpad = spec.cu_seqlens_k[1:], spec.cu_seqlens_k[:-1]
    else:
        seqlens = _key_counts(q.shape[0], k.shape[2], q.device)
        leftpad = None
    return forward(q, k, v, spec.replace(cache_seqlens=seqlens, cache_leftpad=leftpad))


# (device, stream, batch, seqlen_k) -> (batch,) int32 filled with seqlen_k, for ``dense_forward``. Read only:
# the kernels never write cache_seqlens, and the tensor leaves this module only inside a spec.
_KEY_COUNTS: dict[tuple, torch.Tensor] = {}


def _key_counts(batch: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """(batch,) int32 seqlen_k on device, made once per (device, stream, batch, seqlen_k) and kept, so that the
    layers of a decode step share one instead of each paying an allocation and a fill kernel. Kept per
    stream: its fill was queued on the stream that first asked, and a launch on that stream runs after it
    (another stream gets its own). Under a CUDA-graph capture, a new one each call, never a kept one: the
    graph's memory pool keeps it alive as long as the graph (a kept one may be dropped before a replay) and
    the replay fills it. At most 64 kept; emptied past that (a generate loop meets a new seqlen_k every step;
    the allocator orders a dropped tensor's reuse after the launches of its stream)."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
        key = (device, torch.cuda.current_stream(device).cuda_stream, batch, seqlen_k)
    else:
        key = (device, None, batch, seqlen_k)
    counts = _KEY_COUNTS.get(key)
    if counts is None:
        if len(_KEY_COUNTS) >= 64:
            _KEY_COUNTS.clear()
        counts = _KEY_COUNTS[key] = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    return counts


def run(q, k_cache, v_cache, spec: AttentionSpec, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's kvcache_forward on validated inputs; O without a gradient path (``_NoBackward``). Under
    torch.compile, its custom op (``fa2.ops.kvcache_op``): one opaque node, whose backward raises too."""
    if torch.compiler.is_compiling():
        return ops.call_kvcache(ops.kvcache_op(backend, q.device), q, k_cache, v_cache, spec)
    impl = registry.load(backend if backend is not None else registry.default_backend(q.device))
    forward = getattr(impl, "kvcache_forward", None)
    if forward is None:
        raise NotImplementedError(f"fa2 backend {impl.NAME!r} has no KV-cache path (kvcache_forward)")
    sink = spec.sink
    if torch.is_grad_enabled() and (q.requires_grad or (sink is not None and sink.requires_grad)):
        return _NoBackward.apply(q, k_cache, v_cache, sink, spec, forward)
    return forward(q, k_cache, v_cache, spec)


class _NoBackward(torch.autograd.Function):
    """A KV-cache forward whose output refuses a backward, instead of silently carrying no gradient (to q,
    or to a learned sink)."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, sink, spec, forward):
        O, L = forward(q, k_cache, v_cache, spec)
        ctx.mark_non_differentiable(L)
        return O, L

    @staticmethod
    def backward(ctx, dO, dL):
        raise NotImplementedError("fa2 has no backward through a KV cache (inference only, as flash-attn's)")


def _check_caches(q, k_cache, v_cache, block_table) -> tuple[int, int, int, int]:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = (
                "(batch, heads, seqlen_q, head_dim)"
                if name == "q"
                else (
                    "(num_pages, heads_k, page_size, head_dim)"
                    if block_table is not None
                    else "(batch_cache, heads_k, seqlen_cache, head_dim)"
                )
            )
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_table is not None and (k_cache.shape[0] == 0 or k_cache.shape[2] == 0):
        raise ValueError(f"a paged cache needs at least one page of at least one row, got {tuple(k_cache.shape)}")
    if k_cache.shape[0] == 0:
        raise ValueError(f"a contiguous cache needs at least one row, got k_cache {tuple(k_cache.shape)}")
    # fa2.attention's checks (fa2.validation.validate), written out for the cache's shapes.
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must have one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(
            f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}"
        )
    if q.shape[3] != k_cache.shape[3] or not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(
            f"q and the caches must have one head_dim, from 1 to {MAX_HEAD_DIM}, got q "
            f"{tuple(q.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if k_cache.shape[1] == 0 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"q's heads must be a multiple of the caches' (grouped-query attention), got q "
            f"{tuple(q.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if block_table is not None:
        check_index("block_table", block_table, (q.shape[0], None), q.device)
    return tuple(q.shape)


def _check_new(q, k_cache, k, v) -> int:
    """seqlen_new of the new k and v (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values), or neither")
    if k is None:
        return 0
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype {q.dtype} and device {q.device}, got {t.dtype} on {t.device}")
    want = (q.shape[0], k_cache.shape[1], k.shape[2] if k.dim() == 4 else -1, q.shape[3])
    if k.dim() != 4 or tuple(k.shape) != want or v.shape != k.shape:
        raise ValueError(
            f"k and v must have shape (batch, heads_k, seqlen_new, head_dim) = ({q.shape[0]}, {k_cache.shape[1]}, "
            f"seqlen_new, {q.shape[3]}), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    return k.shape[2]


def _cache_seqlens(cache_seqlens, batch: int, capacity: int, seqlen_new: int, device, block_table) -> torch.Tensor:
    """(batch,) int32 on device: the keys in each row's cache before the append (the caller's tensor as it
    is: no conversion kernel in a decode step)."""
    if cache_seqlens is None:
        if seqlen_new:
            raise ValueError("new k and v need cache_seqlens: where to write them in the cache")
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, torch.Tensor):
        check_index("cache_seqlens", cache_seqlens, (batch,), device)
        return cache_seqlens
    if isinstance(cache_seqlens, bool) or not is_integer(cache_seqlens):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    n = int(cache_seqlens)
    if not 0 <= n <= capacity - seqlen_new:
        raise CacheRangeError(
            f"cache_seqlens {n} + seqlen_new {seqlen_new} must be within [0, {capacity}], {_capacity(block_table)}"
        )
    return torch.full((batch,), n, dtype=torch.int32, device=device)


def _num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not is_integer(num_splits) or int(num_splits) < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the backend picks), got {num_splits!r}")
    return int(num_splits)


def _check_rotary(cos, sin, q, k, head_dim: int):
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new k and q: they need k and v")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point() or t.device != q.device:
            raise TypeError(f"{name} must be floating point on q's device {q.device}, got {t.dtype} on {t.device}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] == 0 or not 1 <= 2 * cos.shape[1] <= head_dim:
        raise ValueError(
            f"rotary_cos and rotary_sin must both have shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
            f"head_dim {head_dim}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    return cos, sin


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x (batch, heads, n, head_dim) with its first rotary_dim channels rotated by the angles of
    ``positions`` (batch, n), in float32, returned in x's dtype (a new tensor)."""
    half = cos.shape[1]
    positions = positions.long().clamp(0, cos.shape[0] - 1)
    c = cos[positions].float()[:, None]  # (batch, 1, n, rotary_dim / 2)
    s = sin[positions].float()[:, None]
    rot = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half :]], dim=-1)


def _append(k_cache, v_cache, k, v, seqlens: torch.Tensor, block_table, cache_batch_idx) -> None:
    """Writes k, v (batch, heads_k, seqlen_new, head_dim) at positions seqlens[b] + t of each row's cache."""
    positions = seqlens.long()[:, None] + torch.arange(k.shape[2], device=k.device)  # (batch, seqlen_new)
    if block_table is None:
        rows = (
            torch.arange(k.shape[0], device=k.device)
            if cache_batch_idx is None
            else cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)
        )[:, None].expand_as(positions)
        slots = positions.clamp(0, k_cache.shape[2] - 1)
    else:
        page_size = k_cache.shape[2]
        pages = positions.div(page_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
        rows = block_table.long().gather(1, pages).clamp(0, k_cache.shape[0] - 1)
        slots = positions.remainder(page_size)
    # Advanced indices around a slice: the indexed view is (batch, seqlen_new, heads_k, head_dim).
    k_cache[rows, :, slots] = k.transpose(1, 2)
    v_cache[rows, :, slots] = v.transpose(1, 2)


def _capacity(block_table) -> str:
    """What a cache's capacity is, for CacheRangeError's message."""
    if block_table is None:
        return "the cache's capacity (seqlen_cache)"
    return f"what block_table addresses (its {block_table.shape[1]} pages a row · page_size)"


def _capturing(q: torch.Tensor) -> bool:
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


# The index tensors' ids and what they were checked against -> (weak references to them, their version
# counters then). Weak references, so that a new tensor that reuses a freed one's id is not taken for it.
_CHECKED: dict[tuple, tuple] = {}


def _check_ranges(
    user_seqlens, seqlens, seqlen_new: int, capacity: int, num_rows: int, block_table, cache_batch_idx, cache_leftpad
) -> None:
    """The range checks that read the index tensors' values: one sync, skipped when the same tensors,
    unmodified, passed them before (a decode loop's block table; a benchmark's cache_seqlens)."""
    tensors = [t for t in (user_seqlens, block_table, cache_batch_idx, cache_leftpad) if t is not None]
    if not tensors:
        return
    key = tuple(id(t) for t in (user_seqlens, block_table, cache_batch_idx, cache_leftpad)) + (
        seqlen_new,
        capacity,
        num_rows,
    )
    versions = tuple(t._version for t in tensors) if not any(t.is_inference() for t in tensors) else None
    hit = _CHECKED.get(key)
    if (
        versions is not None
        and hit is not None
        and hit[1] == versions
        and all(r() is t for r, t in zip(hit[0], tensors))
    ):
        return
    seqlens = seqlens.long()
    zero = seqlens.new_zeros(())
    total = seqlens + seqlen_new
    low = torch.stack(
        [
            seqlens.min() if seqlens.numel() else zero,
            block_table.min().long() if block_table is not None and block_table.numel() else zero,
            cache_batch_idx.min().long() if cache_batch_idx is not None and cache_batch_idx.numel() else zero,
            cache_leftpad.min().long() if cache_leftpad is not None and cache_leftpad.numel() else zero,
            (total - cache_leftpad.long()).min() if cache_leftpad is not None and cache_leftpad.numel() else zero,
            total.max() if total.numel() else zero,
            block_table.max().long() if block_table is not None and block_table.numel() else zero,
            cache_batch_idx.max().long() if cache_batch_idx is not None and cache_batch_idx.numel() else zero,
        ]
    ).tolist()
    min_len, min_page, min_row, min_pad, min_room, max_total, max_page, max_row = low
    if min_len < 0 or max_total > capacity:
        raise CacheRangeError(
            f"the key counts (cache_seqlens + seqlen_new {seqlen_new}, or cu_seqlens_k's steps) must be within "
            f"[0, {capacity}], {_capacity(block_table)}, got {min_len} ... {max_total}"
        )
    if block_table is not None and (min_page < 0 or max_page >= num_rows):
        raise ValueError(
            f"block_table's page ids must be within [0, {num_rows}) (num_pages), got {min_page} ... {max_page}"
        )
    if cache_batch_idx is not None and (min_row < 0 or max_row >= num_rows):
        raise ValueError(f"cache_batch_idx must be within [0, {num_rows}) (batch_cache), got {min_row} ... {max_row}")
    if cache_leftpad is not None and (min_pad < 0 or min_room < 0):
        raise ValueError("cache_leftpad must be within [0, cache_seqlens + seqlen_new] for every row")
    if versions is not None:
        refs = tuple(weakref.ref(t, lambda _, key=key: _CHECKED.pop(key, None)) for t in tensors)
        _CHECKED[key] = (refs, versions)
