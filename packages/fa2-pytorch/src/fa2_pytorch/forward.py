"""FlashAttention-2 forward in plain PyTorch.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1: visit the key/value tiles in order, keep a
running row max ``m_i``, a running row sum ``l_i`` and an unnormalised accumulator ``acc``, rescale both
by ``alpha = exp(m_old - m_new)`` when the max moves, divide once at the end and write L = m + log(l).

Unlike the kernels, which give every query tile its own program, this loop handles all query tiles (and
all batch and head entries) at once: one step of the loop is one key tile for every query row that sees
it. That keeps the Python loop to seqlen_k / BLOCK_N iterations and the extra memory to
O(seqlen_q · BLOCK_N), never the (seqlen_q, seqlen_k) score matrix.

Windows (causal is the window (-1, 0)): the loop visits only the key tiles that hold a key some query's
window reaches (``AttentionSpec.key_range`` over all the rows), and for each key tile only the whole
BLOCK_M-row query tiles that hold a row seeing one of its keys: the rows [start_m, end_m), sliced away
before the tile's matmul. The cost follows the window, not seqlen_q · seqlen_k, and keys no window
reaches are never read. The mask is built only for tiles that straddle a window edge (the last key tile
is sliced short, never padded, so the end of the keys needs none).

Each tile's scores go through the steps of fa2.spec in order: S = scale · q kᵀ, then the softcap
``softcap · tanh(S / softcap)`` (1 / softcap rides in the matmul's alpha with the scale), then ALiBi's
``-slope · |i + seqlen_k - seqlen_q - j|``, then the window's -inf, then the online softmax.

Grouped-query attention (heads a multiple of heads_k; heads_k = 1 is multi-query): query head h uses
key/value head h // group, group = heads // heads_k, and K/V are never repeated. The ``group`` query heads
that share a key/value head are folded into the matmul's rows: q is held as [B·H_K, N·GROUP, HEAD_DIM] with
row n·group + g for position n of the group's head g, so one bmm against the un-expanded K tile
[B·H_K, BLOCK_N, HEAD_DIM] serves the whole group (torch.matmul's broadcast of a size-1 group dim would
copy the K tile group times inside the call), and slicing the query rows [start_m, end_m) keeps the rows
one contiguous block. ALiBi's slope is per query head, so folded row n·group + g takes the slope of query
head h_k·group + g: the slopes are held as (B, H_K, 1, GROUP, 1) against the group's (M, 1, BLOCK_N)
distances. With group = 1 this is exactly the layout and the arithmetic of plain attention.

Eager PyTorch cannot fuse ``exp(S - m)`` into one pass, and each pass over a (rows, BLOCK_N) fp32 tile
costs as much as the tile's matmuls. So a tile's softmax statistics come from two fused kernels:
``torch.softmax`` gives p normalised within the tile, and the row max of p, which sits at the row's
largest score ``m_j`` and equals ``exp(m_j - lse_j)``, gives the tile's own logsumexp ``lse_j``; the tile
then enters the running state exactly as in FA2 with the row max taken as ``lse_j``
(any value >= the max keeps exp() from overflowing): ``m_new = max(m_i, lse_j)``, ``alpha = exp(m_i -
m_new)``, ``beta = exp(lse_j - m_new)``, ``l_i = alpha l_i + beta``, ``acc = alpha acc + beta (p V_j)``.
The scale rides in the score matmul's epilogue, and the tile is read or written five times in all (the
softcap adds two passes, ALiBi one, the mask of a tile on a window edge one).

Attention sinks (``spec.sink``, gpt-oss): after the loop, each row's sink[h] enters the running state as one
more tile of one score with no value (an ``lse_j`` of sink[h] and a ``p V`` of 0), so that l_i and L include
it and acc is rescaled to the new max; a row that saw no key comes out O = 0, L = sink[h].

Packed (variable-length) batches, ``spec.varlen``: q is (1, heads, total_q, head_dim) and k, v (1, heads_k,
total_k, head_dim), sequence s the rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q and [cu_seqlens_k[s],
cu_seqlens_k[s + 1]) of k and v. The simplest correct route: the offsets are read to the host once (one
device sync per call, ``.tolist()``), and each sequence runs the dense loop above on its own (1, heads, Nq_s,
head_dim) and (1, heads_k, Nk_s, head_dim) views, with its own spec (its ALiBi row, no offsets), so the
window, ALiBi and rows that see no key are the sequence's own; its O and L go into their slices of the
packed outputs. A Python loop over sequences, not one launch: fine for CPU tests and short batches of long
sequences, a host-bound crawl for many short ones. ``sequences`` says what it checks once the offsets are
on the host.

Precision: scores are computed from fp32 copies of q and k, in TF32 on CUDA when the inputs are fp16 or
bf16 (exact there: TF32 holds every fp16 and bf16 value, products accumulate in fp32) and in full fp32 for
fp32 inputs; p V runs on the fp32 p (TF32 on CUDA for fp16/bf16 inputs). Any head_dim, any strides, CPU
or CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from fa2.spec import UNBOUNDED, AttentionSpec

# Measured on the H200 (bf16, 16k tokens, N = 1k and 4k; docs/notes/pytorch-forward.md): against SDPA
# math, 64x128 ran at 0.8-1.7x its speed, 128x256 at 1.3-2.4x (1/7.0-1/8.7 of its memory at N = 4k),
# 256x512 at 1.8-3.0x (1/4.5-1/5.1). The middle keeps memory near the 1/8 target.
BLOCK_M = 128
BLOCK_N = 256


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k: query head h attends to key/value head h // (heads // heads_k); any strides.
        spec: an ``fa2.spec.AttentionSpec``: the scale, the window (causal is (-1, 0)), the softcap and the
            ALiBi slopes, (batch, heads) float32 on q's device, any strides. The window is aligned
            bottom-right, key j visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k
            - seqlen_q + right (-1: that side unbounded). Causal, and the window (1, 1)::

            seqlen_q = 2, seqlen_k = 5:   causal:  1 1 1 1 0     window (1, 1):  0 0 1 1 1
                                                   1 1 1 1 1                     0 0 0 1 1
        block_m: query-tile height, the granularity at which the window skips query rows.
        block_n: key-tile width, the step of the loop.

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype. L: (batch, heads, seqlen_q), float32, natural
        log; rows that see no key get O = 0 and L = +inf.

    Packed batches (``spec.varlen``, cu_seqlens_q and cu_seqlens_k given): q: (1, heads, total_q, head_dim),
    k, v: (1, heads_k, total_k, head_dim), spec.alibi_slopes (num_seqs, heads); O: (1, heads, total_q,
    head_dim), L: (1, heads, total_q), each sequence computed as its own dense batch (see
    ``_varlen_forward``). Reads the offsets with one device sync.

    Limits: none of its own; the scores' intermediate tile is (batch · heads, block_m-rounded rows of the
    window, block_n) fp32, and ALiBi's distances are exact in fp32 up to 2**24 keys.
    """
    if spec.varlen:
        return _varlen_forward(q, k, v, spec, block_m, block_n)
    batch, heads, seqlen_q, head_dim = q.shape
    # side-by-side: group
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    # heads_k = 0 only with heads = 0 (the interface checks the rest); group 1 keeps the shapes valid.
    group = heads // heads_k if heads_k else 1
    bh_k = batch * heads_k
    # side-by-side: end
    # Key j is visible to query i iff i + diag - left <= j <= i + diag + right.
    diag = seqlen_k - seqlen_q
    softcap = spec.softcap
    # The scale, and 1 / softcap when capping (tanh's argument), ride in the score matmul's epilogue.
    qk_scale = spec.scale / softcap if softcap else spec.scale

    # side-by-side: state
    # Batch and key/value heads merged into one matmul batch dim, each group's query heads folded into the
    # rows (row n·group + g): [BH_K, N·GROUP, HEAD_DIM]. A view when group = 1, one copy of q otherwise.
    acc = torch.zeros(bh_k, seqlen_q * group, head_dim, device=q.device, dtype=torch.float32)
    m_i = torch.full((bh_k, seqlen_q * group, 1), -math.inf, device=q.device, dtype=torch.float32)
    l_i = torch.zeros(bh_k, seqlen_q * group, 1, device=q.device, dtype=torch.float32)
    q32 = q.float().unflatten(1, (heads_k, group)).transpose(2, 3).reshape(bh_k, seqlen_q * group, head_dim)
    # side-by-side: end
    slopes = None
    if spec.alibi_slopes is not None:
        # Folded row n·group + g of key/value head h_k is query head h_k·group + g: [B, H_K, 1, GROUP, 1].
        slopes = spec.alibi_slopes.expand(batch, heads).reshape(batch, heads_k, group)[:, :, None, :, None]

    # side-by-side: window
    # Only the key tiles that hold a key some query's window reaches, [lo, hi) over all the rows; the
    # query tiles of each key tile below are the window read the other way round.
    left, right = spec.window
    lo, hi = spec.key_range(0, seqlen_q, seqlen_q, seqlen_k)
    # side-by-side: end

    with tf32_matmul(q.dtype != torch.float32):
        # side-by-side: loop
        for start_n in range(lo // block_n * block_n, hi, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            # Query row i sees a key of [start_n, end_n) iff start_n - right <= i + diag <= end_n - 1 + left:
            # the whole query tiles [start_m, end_m) that hold such a row; the others skip this key tile.
            start_m = 0 if right == UNBOUNDED else max(start_n - diag - right, 0) // block_m * block_m
            end_m = seqlen_q if left == UNBOUNDED else min(-(-(end_n - diag + left) // block_m) * block_m, seqlen_q)
            if start_m >= end_m:
                continue
            # Rows [start_m, end_m), all of the group: one contiguous block of the folded rows.
            row_m, rows_m = start_m * group, (end_m - start_m) * group
            q_i = q32[:, row_m : row_m + rows_m]
            k_j = k[:, :, start_n:end_n].float().reshape(bh_k, end_n - start_n, head_dim)
            v_j = v[:, :, start_n:end_n].float().reshape(bh_k, end_n - start_n, head_dim)
            # side-by-side: end

            # side-by-side: scores
            # The scale (over softcap when capping) rides in the matmul's epilogue (beta = 0: S's initial
            # contents are ignored).
            S = torch.empty(bh_k, rows_m, end_n - start_n, device=q.device, dtype=torch.float32)
            torch.baddbmm(S, q_i, k_j.transpose(1, 2), beta=0.0, alpha=qk_scale, out=S)  # [BH_K, M·GROUP, BLOCK_N]
            # side-by-side: end
            # side-by-side: softcap
            if softcap:
                # softcap · tanh(s / softcap), in fp32: the matmul's alpha already divided by softcap.
                S.tanh_().mul_(softcap)
            # side-by-side: end
            # side-by-side: alibi
            if slopes is not None:
                # -slope · |i + diag - j|: the (M, 1, BLOCK_N) distances are the group's, the slopes each
                # folded row's own; one fused pass over the tile. Distances in fp32 (exact below 2**24).
                rows = torch.arange(start_m + diag, end_m + diag, device=q.device, dtype=torch.float32)
                cols = torch.arange(start_n, end_n, device=q.device, dtype=torch.float32)
                distance = (rows[:, None, None] - cols).abs_()  # [M, 1, BLOCK_N]
                S_g = S.view(batch, heads_k, end_m - start_m, group, end_n - start_n)
                S_g.addcmul_(slopes, distance, value=-1.0)
            # side-by-side: end
            # side-by-side: mask
            # Only a tile that straddles a window edge: its first row misses its last key (right side) or
            # its last row its first key (left side).
            masked = (right != UNBOUNDED and end_n - 1 > start_m + diag + right) or (
                left != UNBOUNDED and start_n < end_m - 1 + diag - left
            )
            if masked:
                # The mask depends on the query position only: one (M, 1, BLOCK_N) mask for the whole group.
                rows = torch.arange(start_m, end_m, device=q.device)
                cols = torch.arange(start_n, end_n, device=q.device)
                hidden = ~spec.visible(rows, cols, seqlen_q, seqlen_k)[:, None, :]
                S.view(bh_k, end_m - start_m, group, end_n - start_n).masked_fill_(hidden, -math.inf)
            # side-by-side: end

            # side-by-side: softmax
            p = torch.softmax(S, dim=-1)  # exp(S - lse_j), normalised within the tile
            # At the row's max score m_j, p = exp(m_j - lse_j). The max of S, not of p: where softmax gives
            # NaN (scores all -inf, or one +inf or NaN), only S's max tells the first case from the others.
            m_j, argmax = S.max(dim=-1, keepdim=True)
            lse_j = m_j - torch.log(p.gather(-1, argmax))  # [BH_K, M·GROUP, 1]
            pv = torch.bmm(p, v_j)  # [BH_K, M·GROUP, HEAD_DIM]
            # A row that sees no key of this tile (masked, or every score -inf): softmax gives NaN and
            # m_j = -inf; it adds nothing. A +inf or NaN score keeps its NaN, as in the reference.
            nothing = m_j == -math.inf
            lse_j.masked_fill_(nothing, -math.inf)
            pv.masked_fill_(nothing, 0.0)

            m_old = m_i[:, row_m : row_m + rows_m]
            m_new = torch.maximum(m_old, lse_j)
            # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp() at 0, not NaN.
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp(m_old - m_safe)
            beta = torch.exp(lse_j - m_safe)

            l_i[:, row_m : row_m + rows_m].mul_(alpha).add_(beta)
            acc[:, row_m : row_m + rows_m].mul_(alpha).add_(pv.mul_(beta))
            m_i[:, row_m : row_m + rows_m] = m_new
            # side-by-side: end

    if spec.sink is not None:
        # side-by-side: sink
        # Attention sinks: sink[h] joins each row's denominator as one more score, with no value behind it:
        # one last online-softmax step, M = max(m_i, sink), l_i = l_i·exp(m_i - M) + exp(sink - M), acc
        # rescaled alike. Folded row n·group + g is query head h_k·group + g: [1, H_K, N·GROUP, 1].
        rows = seqlen_q * group
        sink = spec.sink.view(1, heads_k, 1, group).expand(1, heads_k, seqlen_q, group).reshape(1, heads_k, rows, 1)
        m_i, l_i = m_i.view(batch, heads_k, rows, 1), l_i.view(batch, heads_k, rows, 1)
        acc = acc.view(batch, heads_k, rows, head_dim)
        m_new = torch.maximum(m_i, sink)
        alpha = torch.exp(m_i - m_new)
        l_i = l_i.mul_(alpha).add_(torch.exp(sink - m_new))
        acc = acc.mul_(alpha)
        m_i = m_new
        # side-by-side: end

    # side-by-side: epilogue
    # Rows that saw no key have l_i = 0: O = 0 and L = +inf (see fa2.attention); with a sink l_i >= exp(sink - M)
    # > 0 and such a row gets O = 0, L = sink.
    empty = l_i == 0
    # Unfold the group from the rows back into the heads, contiguous as always: views when group = 1, one
    # copy each otherwise.
    O = (acc / l_i.masked_fill(empty, 1.0)).to(q.dtype).view(batch, heads_k, seqlen_q, group, head_dim)
    O = O.transpose(2, 3).contiguous().view(batch, heads, seqlen_q, head_dim)
    L = (m_i + torch.log(l_i)).masked_fill(empty, math.inf).view(batch, heads_k, seqlen_q, group)
    L = L.transpose(2, 3).contiguous().view(batch, heads, seqlen_q)
    return O, L
    # side-by-side: end


def _varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_forward`` of a packed batch: one dense ``flash_attn_forward`` per sequence.

    Arguments:
        q: (1, heads, total_q, head_dim); k, v: (1, heads_k, total_k, head_dim); any strides.
        spec: with cu_seqlens_q, cu_seqlens_k (num_seqs + 1,) int32 and alibi_slopes None or (num_seqs,
            heads); block_m, block_n as in ``flash_attn_forward``.

    Returns:
        O: (1, heads, total_q, head_dim), q's dtype; L: (1, heads, total_q), float32, natural log. Sequence
        s's rows are its own attention: (1, heads, Nq_s, head_dim) queries against its (1, heads_k, Nk_s,
        head_dim) keys. A sequence with Nk_s = 0, and any row outside every sequence, gets O = 0 and
        L = +inf; one with Nq_s = 0 has nothing to write.
    """
    heads, total_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    # Rows outside every sequence (before cu_seqlens_q[0], after cu_seqlens_q[-1]) see no key.
    O = torch.zeros(1, heads, total_q, head_dim, device=q.device, dtype=q.dtype)
    L = torch.full((1, heads, total_q), math.inf, device=q.device, dtype=torch.float32)
    # side-by-side: varlen
    # The offsets come to the host once; each sequence is then a dense problem on views of its rows.
    for s, (q_start, q_end, k_start, k_end) in enumerate(sequences(spec, total_q, k.shape[2])):
        if q_start == q_end:
            continue
        O_s, L_s = flash_attn_forward(
            q[:, :, q_start:q_end],
            k[:, :, k_start:k_end],
            v[:, :, k_start:k_end],
            sequence_spec(spec, s),
            block_m,
            block_n,
        )
        O[:, :, q_start:q_end] = O_s
        L[:, :, q_start:q_end] = L_s
    # side-by-side: end
    return O, L


def sequences(spec: AttentionSpec, total_q: int, total_k: int) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) of each sequence of a packed batch, from its offsets: one device
    sync (both offset tensors read together).

    What fa2.varlen_attention cannot check without a sync is checked here, where the offsets are on the host
    anyway: each offset tensor non-decreasing and within [0, total], else ValueError. max_seqlen_q/k are not
    used (each sequence's own length is), so one smaller than a sequence changes nothing here.
    """
    cu_q, cu_k = spec.cu_seqlens_q, spec.cu_seqlens_k
    offsets = torch.cat((cu_q, cu_k)).tolist()
    offsets_q, offsets_k = offsets[: len(cu_q)], offsets[len(cu_q) :]
    for name, cu, total in (("cu_seqlens_q", offsets_q, total_q), ("cu_seqlens_k", offsets_k, total_k)):
        bad = [i for i, (a, b) in enumerate(zip([0, *cu], [*cu, total])) if a > b]
        if bad:
            i = bad[0]
            got = (
                f"{name}[0] = {cu[0]}"
                if i == 0
                else f"{name}[{i - 1}] = {cu[i - 1]}" + (f", {name}[{i}] = {cu[i]}" if i < len(cu) else "")
            )
            raise ValueError(f"{name} must be non-decreasing offsets within [0, {total}], got {got}")
    return list(zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:]))


def sequence_spec(spec: AttentionSpec, s: int) -> AttentionSpec:
    """Sequence s's dense spec: no offsets, and its own (1, heads) row of the ALiBi slopes."""
    slopes = spec.alibi_slopes
    return dataclasses.replace(
        spec,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=0,
        max_seqlen_k=0,
        alibi_slopes=None if slopes is None else slopes[s : s + 1],
    )


@contextlib.contextmanager
def tf32_matmul(enabled: bool):
    """TF32 for CUDA fp32 matmuls inside the block only (exact for fp16/bf16-valued operands), then the
    caller's setting back."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = previous
