"""Plain attention that materialises the (seqlen_q, seqlen_k) score matrix, for tests and benchmarks.

No backend imports this module: a kernel is checked against it, never built from it.
"""

from __future__ import annotations

import math

import torch

from fa2.spec import AttentionSpec


def causal_mask(
    seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu", rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where key j is visible to query i: j <= i + seqlen_k - seqlen_q
    (bottom-right alignment, as FlashAttention-2). With ``rows`` (1-D query indices): only those rows,
    (len(rows), seqlen_k)."""
    return window_mask(seqlen_q, seqlen_k, (-1, 0), device, rows)


def window_mask(
    seqlen_q: int,
    seqlen_k: int,
    window: tuple[int, int],
    device: torch.device | str = "cpu",
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i sees key j under window (left, right), -1 unbounded:
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. ``rows`` as in causal_mask."""
    i = (torch.arange(seqlen_q, device=device) if rows is None else rows.to(device))[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    left, right = window
    visible = torch.ones(i.shape[0], seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return visible


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """-slope · |i + seqlen_k - seqlen_q - j|: slopes (..., heads) -> (..., heads, seqlen_q, seqlen_k) in
    slopes' dtype (or len(rows) query rows)."""
    i = (torch.arange(seqlen_q, device=slopes.device) if rows is None else rows.to(slopes.device))[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (i + (seqlen_k - seqlen_q) - j).abs().to(slopes.dtype)
    return -slopes[..., None, None] * distance


def repeat_kv_heads(q: torch.Tensor, *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Grouped-query attention the plain way: k and v (..., heads_k, seqlen_k, head_dim) with each head
    repeated heads // heads_k times, so that query head h meets key/value head h // (heads // heads_k).
    A copy, which is what the kernels never make; unchanged where the heads already agree."""
    if q.dim() < 3 or all(t.shape[-3] == q.shape[-3] for t in kv):
        return kv
    return tuple(t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in kv)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    upcast: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(mask(bias(cap(q kᵀ · scale)))) v and its natural-log logsumexp, the contract of
    ``fa2.attention``, step by step on the whole (seqlen_q, seqlen_k) score matrix.

    Arguments:
        q: (..., heads, seqlen_q, head_dim); k, v: (..., heads_k, seqlen_k, head_dim), heads a multiple of
            heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to key/value
            head h // (heads // heads_k). Rank 2 inputs have no heads dim.
        causal, window: the mask, as fa2.attention: causal makes the window's right side 0.
        softcap: > 0: scores s -> softcap · tanh(s / softcap), before the bias and the mask.
        alibi_slopes: None, or (heads,) or q.shape[:-2]: adds -slope · |i + seqlen_k - seqlen_q - j|.
        sink: None, or (heads,): a logit per head appended to every row's scores as one more column that
            no value follows (attention sinks): it joins L and the softmax's denominator only. Gradients
            flow to it through autograd when it requires them.
        upcast: True computes in float64 and returns float64 O and L (the ground truth). False computes
            every step in the inputs' own dtype, as a naive low-precision attention would: its error is
            the yardstick of FlashAttention-2's accuracy rule.
        rows: None, or a 1-D integer tensor of query indices: only those rows of O and L are computed,
            as the matching rows of the full result (same mask alignment), at (len(rows), seqlen_k)
            memory instead of (seqlen_q, seqlen_k). For checking long sequences on a sample of rows.

    Returns:
        O: (..., seqlen_q, head_dim), float64 or q's dtype. L: (..., seqlen_q), float64 or float32.
        With ``rows``, seqlen_q is len(rows). Rows that see no key: O = 0, L = +inf (L = sink[h] with a
        sink).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    if rows is not None:
        rows = rows.to(q.device)
        q = q[..., rows, :]
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = repeat_kv_heads(q, k, v)
    S = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0:
        S = softcap * torch.tanh(S / softcap)
    if alibi_slopes is not None:
        S = S + alibi_bias(alibi_slopes.to(dtype), seqlen_q, seqlen_k, rows)
    left, right = window[0], 0 if causal else window[1]
    if (left, right) != (-1, -1):
        visible = window_mask(seqlen_q, seqlen_k, (left, right), q.device, rows)
        S = S.masked_fill(~visible, -math.inf)
        empty = ~visible.any(dim=-1)
    else:
        empty = torch.full((q.shape[-2],), seqlen_k == 0, dtype=torch.bool, device=q.device)
    if sink is not None:
        column = sink.to(dtype)[:, None, None].expand(*S.shape[:-1], 1)
        S = torch.cat([S, column], dim=-1)
        L = torch.logsumexp(S, dim=-1)
        O = torch.softmax(S, dim=-1)[..., :-1] @ v
        return O, L if upcast else L.float()
    L = torch.logsumexp(S, dim=-1).masked_fill(empty, math.inf)
    P = torch.softmax(S, dim=-1).masked_fill(empty[:, None], 0.0)
    O = P @ v
    return O, L if upcast else L.float()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` on each sequence of a packed batch, the contract of ``fa2.varlen_attention``.

    q: (total_q, heads, head_dim); k, v: (total_k, heads_k, head_dim); cu_seqlens_q, cu_seqlens_k:
    (num_seqs + 1,) offsets; alibi_slopes: None, (heads,) or (num_seqs, heads); sink: None or (heads,), every
    sequence's rows (rows outside every sequence: O = 0, L = +inf). Returns O (total_q, heads,
    head_dim) and L (heads, total_q), float64 (or q's dtype and float32 without upcast)."""
    dtype = torch.float64 if upcast else q.dtype
    O = q.new_zeros(q.shape, dtype=dtype)
    L = q.new_full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64 if upcast else torch.float32)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        rows, keys = slice(bounds_q[s], bounds_q[s + 1]), slice(bounds_k[s], bounds_k[s + 1])
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[s]
        O_s, L_s = attention(
            q[rows].transpose(0, 1),
            k[keys].transpose(0, 1),
            v[keys].transpose(0, 1),
            causal,
            scale,
            window=window,
            softcap=softcap,
            alibi_slopes=slopes,
            sink=sink,
            upcast=upcast,
        )
        O[rows] = O_s.transpose(0, 1)
        L[:, rows] = L_s
    return O, L


def kvcache_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec: AttentionSpec):
    """Row b of a KV-cache attention as the dense problem it is, for each b: (rows, k_b, v_b, slopes_b).

    ``rows``: the index of row b's queries along q's dim 2, a slice (q[:, :, rows] with batch b, or the packed
    slice [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q[0]); k_b, v_b: (heads_k, K_b - leftpad_b, head_dim),
    keys [leftpad_b, K_b) of row b's cache (its contiguous row cache_batch_idx[b], or gathered through its
    block table); slopes_b: row b's (heads,) ALiBi slopes or None. Attention of row b's queries over exactly
    these keys with spec's window, softcap and slopes is row b's KV-cache attention: relative to the slice, key
    j' = j - leftpad_b and Nk = K_b - leftpad_b, so i + Nk - Nq - j' = i + K_b - Nq - j, the distance the
    contract aligns the window and ALiBi on. Reads spec's tensors on the host (a sync per call).

    Raises:
        ValueError: a cache length beyond the cache's capacity, or a page id or cache_batch_idx outside the
            cache.
    """
    batch = spec.cache_seqlens.shape[0]
    seqlens = spec.cache_seqlens.tolist()
    leftpad = [0] * batch if spec.cache_leftpad is None else spec.cache_leftpad.tolist()
    if spec.paged:
        page_size = k_cache.shape[2]
        capacity = spec.block_table.shape[1] * page_size
        pages = spec.block_table.tolist()
        if any(not 0 <= p < k_cache.shape[0] for row in pages for p in row):
            raise ValueError(f"block_table holds page ids outside [0, {k_cache.shape[0]}): {pages}")
    else:
        capacity = k_cache.shape[2]
        cache_rows = list(range(batch)) if spec.cache_batch_idx is None else spec.cache_batch_idx.tolist()
        if any(not 0 <= r < k_cache.shape[0] for r in cache_rows):
            raise ValueError(f"cache_batch_idx must lie in [0, {k_cache.shape[0]}), got {cache_rows}")
    if any(not 0 <= n <= capacity for n in seqlens):
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (the cache's capacity), got {seqlens}")
    bounds = None if spec.cu_seqlens_q is None else spec.cu_seqlens_q.tolist()
    for b in range(batch):
        lo, hi = leftpad[b], seqlens[b]
        if spec.paged:
            j = torch.arange(lo, max(lo, hi), device=k_cache.device)
            page = spec.block_table[b].to(k_cache.device)[j // page_size]
            k_b, v_b = (c[page, :, j % page_size].transpose(0, 1) for c in (k_cache, v_cache))
        else:
            k_b, v_b = k_cache[cache_rows[b], :, lo:hi], v_cache[cache_rows[b], :, lo:hi]
        slopes = spec.alibi_slopes
        slopes = None if slopes is None else slopes.expand(batch, q.shape[1])[b]
        rows = slice(b, b + 1) if bounds is None else slice(bounds[b], bounds[b + 1])
        yield rows, k_b, v_b, slopes


def kvcache_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec: AttentionSpec, *, upcast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` over each row's cached keys, the contract of a backend's ``kvcache_forward``.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim), or with spec.cu_seqlens_q (1, heads, total_q, head_dim), row b
            the queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
        k_cache, v_cache: (batch_cache, heads_k, seqlen_cache, head_dim), row b reading cache row
            spec.cache_batch_idx[b] (or b); or, with spec.block_table, (num_pages, heads_k, page_size,
            head_dim), key j of row b at row j % page_size of page block_table[b, j // page_size].
        spec: an AttentionSpec with cache_seqlens (batch,) (K_b), and cache_leftpad, cache_batch_idx,
            block_table as they apply; scale, window, softcap, alibi_slopes ((batch, heads), any strides), sink
            as for attention. num_splits changes nothing here.
        upcast: as ``attention``: True for float64 ground truth, False for the naive same-precision yardstick.

    Returns:
        O: q's shape, float64 (or q's dtype); L: q.shape[:-1], float64 (or float32). Query i of row b sees key
        j iff leftpad_b <= j < K_b and i + K_b - Nq - left <= j <= i + K_b - Nq + right, ALiBi adds -slope ·
        |i + K_b - Nq - j|; rows that see no key (and, packed, rows outside every sequence): O = 0, L = +inf.
        Each row is ``attention`` on its keys [leftpad_b, K_b) (``kvcache_rows``).
    """
    dtype = torch.float64 if upcast else q.dtype
    O = torch.zeros(q.shape, dtype=dtype, device=q.device)
    L = torch.full(q.shape[:-1], math.inf, dtype=torch.float64 if upcast else torch.float32, device=q.device)
    for rows, k_b, v_b, slopes in kvcache_rows(q, k_cache, v_cache, spec):
        q_b = q[rows] if spec.cu_seqlens_q is None else q[:, :, rows]
        O_b, L_b = attention(
            q_b,
            k_b[None],
            v_b[None],
            False,
            spec.scale,
            window=spec.window,
            softcap=spec.softcap,
            alibi_slopes=None if slopes is None else slopes[None],
            sink=spec.sink,
            upcast=upcast,
        )
        if spec.cu_seqlens_q is None:
            O[rows], L[rows] = O_b, L_b
        else:
            O[:, :, rows], L[:, :, rows] = O_b, L_b
    return O, L
