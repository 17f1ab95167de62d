"""KV-cache attention (decoding) in plain PyTorch: split-KV over the cache's capacity, paged or contiguous.

Flash-decoding (Dao et al., 2023) on top of FlashAttention-2's online softmax: a decode step has one or a few
query tokens against a long cache, too few query rows to keep a GPU busy, so the keys are split instead.
Each (batch, key/value head) is cut into ``num_splits`` key ranges [s·chunk, (s + 1)·chunk) of the cache's
CAPACITY (seqlen_cache, or pages_per_seq · page_size), each range's partial (O, L) is computed on its own,
and the partials are merged by their logsumexp (``fa2.combine``): L = logsumexp_s L_s, O = Σ_s exp(L_s - L)
O_s. A range that holds no key a row sees (beyond K_b, before leftpad_b, outside the window) has L_s = +inf
and weighs nothing. Attention sinks (``spec.sink``) join that merge once, as one more range of mass
exp(sink[h]) and no value (``fa2.combine``'s ``sink``), never a split's own L_s.

Here the splits are one more matmul batch dim, not a loop: one step of the loop is one BLOCK_N-key tile of
EVERY split at once, [B·H_K·SPLITS, M·GROUP, BLOCK_N] scores from one bmm, and the loop runs
chunk / BLOCK_N times with the online softmax of ``fa2_pytorch.forward`` (same names, same two-kernel
statistics: ``torch.softmax`` within the tile, its row max giving the tile's own logsumexp ``lse_j``) per
split. With num_splits = 0 the backend picks as many splits as keep one step's fp32 tiles (the scores and
the gathered K and V) within ``STEP_BUDGET`` elements, at most one split per BLOCK_N keys of capacity: a
decode step over a long cache then takes one or a few loop steps.

The cache is read by gather, never copied whole: a tile's key positions j (per split) index the contiguous
cache row ``cache_batch_idx[b]`` (or b) directly, or the page ``block_table[b, j // page_size]`` at row
j % page_size; page size any int >= 1. Key positions past the capacity, page ids and cache_batch_idx
outside the cache are clamped into it before indexing (garbage rows, never an access outside the tensors;
fa2's interface checks what it can), and masked; the values of keys outside [leftpad_b, K_b) are zeroed
after the gather, so that whatever an unused slot holds (NaN included) never reaches O.

No device sync: cache_seqlens, cache_leftpad, block_table and cu_seqlens_q stay on the device and enter
only as tensors (the masks, ALiBi's distances and the packed queries' positions are computed from them),
and the loop's trip count comes from the capacity and max_seqlen_q, host ints. So every tile of the capacity
is visited whatever K_b is (the kernels skip tiles past K_b; an eager loop could only by reading K_b). The
mask per query i of row b and key j: leftpad_b <= j < K_b and the window aligned on K_b, i + K_b - Nq_b -
left <= j <= i + K_b - Nq_b + right; ALiBi adds -slope[b, h] · |i + K_b - Nq_b - j| after the softcap.

Grouped-query attention as in the forward: the group's query heads (and all seqlen_q tokens) are folded into
the rows of one matmul against the un-expanded key/value head, [B·H_K, N·GROUP, HEAD_DIM], row n·group + g,
so each gathered key serves its whole group in one pass.

Packed queries (``spec.cu_seqlens_q``, flash-attn's varlen function with a block table): q is (1, heads,
total_q, head_dim); row b's queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) are gathered into a padded
(batch, heads, max_seqlen_q, head_dim) block (rows past Nq_b masked), and each packed position t reads its
row back from it (t's sequence by ``torch.searchsorted``). A sequence longer than max_seqlen_q, and any
position outside every sequence, gets O = 0 and L = +inf.

Forward only (inference): no autograd. Precision as the forward: fp32 scores and accumulators (TF32 on CUDA
for fp16/bf16 inputs, exact there), O rounded to q's dtype once, after the combine.
"""

from __future__ import annotations

import math

import torch

from fa2.combine import combine
from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_pytorch.forward import tf32_matmul

BLOCK_N = 256
# num_splits = 0: the most fp32 elements one loop step's tiles (scores, gathered K and V) may hold, 128 MiB.
STEP_BUDGET = 2**25


def kvcache_forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec: AttentionSpec, block_n: int = BLOCK_N
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over each row's cached keys, split over key ranges and merged by logsumexp.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim), any strides; with spec.cu_seqlens_q (1, heads, total_q,
            head_dim), row b the queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (at most spec.max_seqlen_q).
        k_cache, v_cache: contiguous (batch_cache, heads_k, seqlen_cache, head_dim), row b reading cache row
            spec.cache_batch_idx[b] (or b); or, with spec.block_table, paged (num_pages, heads_k, page_size,
            head_dim), key j of row b at row j % page_size of page block_table[b, j // page_size]. Any strides;
            heads a multiple of heads_k.
        spec: an ``fa2.spec.AttentionSpec`` with cache_seqlens (batch,) int32 (K_b), and cache_leftpad,
            cache_batch_idx, block_table, num_splits; scale, window, softcap, alibi_slopes ((batch, heads)
            float32, any strides) as for the forward. Query i of row b sees key j iff leftpad_b <= j < K_b and
            i + K_b - Nq - left <= j <= i + K_b - Nq + right. With Nq = 2, K_b = 5, leftpad_b = 1, causal::

                0 1 1 1 0
                0 1 1 1 1

            num_splits: n key ranges of ceil(capacity / n) keys each (ranges past the capacity are empty and
            weigh nothing); 0: as many as keep one step's fp32 tiles within STEP_BUDGET elements, from 1 to
            one per block_n keys of capacity; 1: no split.
        block_n: key-tile width within a split, the loop's step.

    Returns:
        O: (batch, heads, seqlen_q, head_dim) (packed: (1, heads, total_q, head_dim)), q's dtype, contiguous.
        L: (batch, heads, seqlen_q) (packed: (1, heads, total_q)), float32, natural log. Rows that see no key:
        O = 0, L = +inf (L = sink[h] with ``spec.sink``: the sink joins every row's denominator).

    No device sync and no allocation outside torch: capturable in a CUDA graph. Cost: every key tile of the
    capacity, whatever K_b (see the module docstring).
    """
    batch = spec.cache_seqlens.shape[0]
    heads, head_dim = q.shape[1], q.shape[3]
    heads_k = k_cache.shape[1]
    group = heads // heads_k if heads_k else 1
    paged = spec.paged
    page_size = k_cache.shape[2]
    capacity = spec.block_table.shape[1] * page_size if paged else k_cache.shape[2]
    seqlen_q = spec.max_seqlen_q if spec.varlen else q.shape[2]
    device = q.device

    # side-by-side: rows
    # Per row b: K_b, leftpad_b, Nq_b, as (batch,) int64 on the device; query i of row b sits at key position
    # i + diag_b, diag_b = K_b - Nq_b.
    seqlens = spec.cache_seqlens.long().clamp(0, capacity)
    leftpad = torch.zeros_like(seqlens) if spec.cache_leftpad is None else spec.cache_leftpad.long()
    if spec.varlen:
        q_rows, len_q = _padded_queries(q, spec.cu_seqlens_q.long(), seqlen_q)
    else:
        q_rows, len_q = q, torch.full_like(seqlens, seqlen_q)
    diag = seqlens - len_q
    # side-by-side: end

    if batch * heads * seqlen_q == 0 or capacity == 0:
        O = torch.zeros(batch, heads, seqlen_q, head_dim, device=device, dtype=q.dtype)
        L = torch.full((batch, heads, seqlen_q), math.inf, device=device, dtype=torch.float32)
        if spec.sink is not None:
            L.copy_(spec.sink[:, None].expand(L.shape))
        return _packed(O, L, spec, q) if spec.varlen else (O, L)

    # side-by-side: splits
    # Split s holds keys [s·chunk, (s + 1)·chunk) of the capacity; one step takes a tile of n keys of each.
    num_splits = spec.num_splits or _pick_splits(batch, heads, heads_k, seqlen_q, head_dim, capacity, block_n)
    chunk = -(-capacity // num_splits)
    n = min(block_n, chunk)
    split_start = torch.arange(num_splits, device=device)[:, None] * chunk  # [SPLITS, 1]
    # side-by-side: end

    # side-by-side: state
    # [B·H_K·SPLITS, M·GROUP, ...]: the group folded into the rows as in the forward, the splits into the
    # matmul's batch (q repeated once per split: it is the small operand of a decode step).
    rows = seqlen_q * group
    bhs = batch * heads_k * num_splits
    acc = torch.zeros(bhs, rows, head_dim, device=device, dtype=torch.float32)
    m_i = torch.full((bhs, rows, 1), -math.inf, device=device, dtype=torch.float32)
    l_i = torch.zeros(bhs, rows, 1, device=device, dtype=torch.float32)
    q32 = q_rows.float().unflatten(1, (heads_k, group)).transpose(2, 3).reshape(batch, heads_k, 1, rows, head_dim)
    q32 = q32.expand(batch, heads_k, num_splits, rows, head_dim).reshape(bhs, rows, head_dim)
    # side-by-side: end
    softcap = spec.softcap
    qk_scale = spec.scale / softcap if softcap else spec.scale
    slopes = None
    if spec.alibi_slopes is not None:
        # Folded row n·group + g of key/value head h_k is query head h_k·group + g: [B, H_K, 1, 1, GROUP, 1].
        slopes = spec.alibi_slopes.expand(batch, heads).reshape(batch, heads_k, 1, 1, group, 1)
    # Query positions i + diag_b and the rows that are queries at all (packed: i < Nq_b): [B, 1, M, 1].
    i = torch.arange(seqlen_q, device=device)
    pos_q = (i + diag[:, None])[:, None, :, None]
    is_query = (i < len_q[:, None])[:, None, :, None]
    left, right = spec.window
    cache_row = None
    if not paged:
        cache_row = torch.arange(batch, device=device) if spec.cache_batch_idx is None else spec.cache_batch_idx
        cache_row = cache_row.long().clamp(0, k_cache.shape[0] - 1)[:, None, None]  # [B, 1, 1]

    with tf32_matmul(q.dtype != torch.float32):
        for start_n in range(0, chunk, n):
            # side-by-side: gather
            # Key positions of this step's tile in every split, [SPLITS, BLOCK_N]; past the split's end or the
            # capacity they are clamped (read, then masked).
            offs = start_n + torch.arange(n, device=device)
            j = split_start + offs  # [SPLITS, BLOCK_N]
            in_range = (offs < chunk) & (j < capacity)
            j_safe = j.clamp(max=capacity - 1)
            if paged:
                page = spec.block_table.long()[:, j_safe // page_size].clamp(0, k_cache.shape[0] - 1)  # [B, S, N]
                index = (page, slice(None), j_safe % page_size)
            else:
                index = (cache_row, slice(None), j_safe)
            # The keys row b holds, [leftpad_b, K_b) within the split and the cache: [B, SPLITS, BLOCK_N]. The
            # values of the others are zeroed (a weight of 0 times a NaN left in an unused slot is NaN).
            stored = in_range & (j >= leftpad[:, None, None]) & (j < seqlens[:, None, None])
            # Advanced indices around a slice put their dims first: [B, SPLITS, BLOCK_N, H_K, HEAD_DIM].
            k_j = k_cache[index].float().permute(0, 3, 1, 2, 4).reshape(bhs, n, head_dim)
            v_j = v_cache[index].float().masked_fill_(~stored[..., None, None], 0.0)
            v_j = v_j.permute(0, 3, 1, 2, 4).reshape(bhs, n, head_dim)
            # side-by-side: end

            S = torch.empty(bhs, rows, n, device=device, dtype=torch.float32)
            torch.baddbmm(S, q32, k_j.transpose(1, 2), beta=0.0, alpha=qk_scale, out=S)  # [B·H_K·S, M·GROUP, N]
            if softcap:
                S.tanh_().mul_(softcap)
            S_g = S.view(batch, heads_k, num_splits, seqlen_q, group, n)
            # side-by-side: mask
            # [B, SPLITS, M, BLOCK_N] from the per-row tensors: a key row b holds, a query row, and in the
            # window aligned on K_b.
            j_b = j[None, :, None, :]
            visible = stored[:, :, None, :] & is_query
            if right != UNBOUNDED:
                visible &= j_b <= pos_q + right
            if left != UNBOUNDED:
                visible &= j_b >= pos_q - left
            if slopes is not None:
                distance = (pos_q - j_b).abs_().float()  # exact in fp32 below 2**24 keys
                S_g.addcmul_(slopes, distance[:, None, :, :, None, :], value=-1.0)
            S_g.masked_fill_(~visible[:, None, :, :, None, :], -math.inf)
            # side-by-side: end

            # side-by-side: softmax
            # As fa2_pytorch.forward: the tile's own logsumexp from its softmax's row max, one online step.
            p = torch.softmax(S, dim=-1)
            m_j, argmax = S.max(dim=-1, keepdim=True)
            lse_j = m_j - torch.log(p.gather(-1, argmax))  # [B·H_K·S, M·GROUP, 1]
            pv = torch.bmm(p, v_j)  # [B·H_K·S, M·GROUP, HEAD_DIM]
            nothing = m_j == -math.inf
            lse_j.masked_fill_(nothing, -math.inf)
            pv.masked_fill_(nothing, 0.0)

            m_new = torch.maximum(m_i, lse_j)
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp(m_i - m_safe)
            beta = torch.exp(lse_j - m_safe)
            l_i.mul_(alpha).add_(beta)
            acc.mul_(alpha).add_(pv.mul_(beta))
            m_i = m_new
            # side-by-side: end

    # side-by-side: combine
    # Each split's (O_s, L_s) in fp32, a split that saw no key L_s = +inf, the group unfolded from the rows
    # back into the heads, [SPLITS, B, H, M, ...]; merged by logsumexp, the sink (if any) counted once there.
    empty = l_i == 0
    O_s = (acc / l_i.masked_fill(empty, 1.0)).view(batch, heads_k, num_splits, seqlen_q, group, head_dim)
    O_s = O_s.permute(2, 0, 1, 4, 3, 5).reshape(num_splits, batch, heads, seqlen_q, head_dim)
    L_s = (m_i + torch.log(l_i)).masked_fill(empty, math.inf).view(batch, heads_k, num_splits, seqlen_q, group)
    L_s = L_s.permute(2, 0, 1, 4, 3).reshape(num_splits, batch, heads, seqlen_q)
    O, L = combine(O_s, L_s, sink=spec.sink, dtype=q.dtype)  # [B, H, M, HEAD_DIM], [B, H, M]
    # side-by-side: end
    return _packed(O, L, spec, q) if spec.varlen else (O.contiguous(), L.contiguous())


def _pick_splits(batch, heads, heads_k, seqlen_q, head_dim, capacity, block_n) -> int:
    """num_splits = 0: per key of a step, the scores take batch·heads·seqlen_q fp32 elements and the gathered
    K and V 2·batch·heads_k·head_dim; as many splits as keep a step of block_n keys per split within
    STEP_BUDGET, from 1 to one split per block_n keys of capacity (more would only add empty ranges)."""
    per_key = batch * (heads * seqlen_q + 2 * heads_k * head_dim)
    return max(1, min(STEP_BUDGET // (per_key * block_n), -(-capacity // block_n)))


def _padded_queries(q: torch.Tensor, cu: torch.Tensor, seqlen_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q (1, heads, total_q, head_dim) as (batch, heads, seqlen_q, head_dim): row b's queries
    [cu[b], cu[b + 1]) first (positions clamped into q, the rows past Nq_b masked later), and Nq_b (batch,)."""
    total_q = q.shape[2]
    index = (cu[:-1, None] + torch.arange(seqlen_q, device=q.device)).clamp(0, max(total_q - 1, 0))
    rows = q[0][:, index] if total_q else q.new_zeros(q.shape[1], *index.shape, q.shape[3])
    return rows.transpose(0, 1), cu[1:] - cu[:-1]


def _packed(O: torch.Tensor, L: torch.Tensor, spec: AttentionSpec, q: torch.Tensor):
    """O (batch, heads, seqlen_q, head_dim) and L of padded rows back to the packed (1, heads, total_q, ...):
    position t reads row t - cu[b] of its sequence b; positions outside every sequence, or past
    max_seqlen_q in theirs, get O = 0 and L = +inf."""
    batch, seqlen_q = O.shape[0], O.shape[2]
    cu = spec.cu_seqlens_q.long()
    t = torch.arange(q.shape[2], device=q.device)
    b = torch.searchsorted(cu[1:], t, right=True)  # cu[b] <= t < cu[b + 1] where t is inside a sequence
    b_safe = b.clamp(max=max(batch - 1, 0))
    i = t - cu[b_safe]
    inside = (t >= cu[0]) & (b < batch) & (i >= 0) & (i < seqlen_q)
    if batch == 0 or seqlen_q == 0:
        O_t = O.new_zeros(q.shape[2], O.shape[1], O.shape[3])
        L_t = L.new_full((q.shape[2], L.shape[1]), math.inf)
    else:
        i_safe = i.clamp(0, seqlen_q - 1)
        O_t = O[b_safe, :, i_safe].masked_fill(~inside[:, None, None], 0.0)  # [TOTAL_Q, H, HEAD_DIM]
        L_t = L[b_safe, :, i_safe].masked_fill(~inside[:, None], math.inf)
    return O_t.transpose(0, 1)[None].contiguous(), L_t.transpose(0, 1)[None].contiguous()
