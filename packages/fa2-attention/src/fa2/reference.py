"""Plain attention that materialises the (seqlen_q, seqlen_k) score matrix, for tests and benchmarks.

No backend imports this module: a kernel is checked against it, never built from it.
"""

from __future__ import annotations

import math

import torch


def causal_mask(
    seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu", rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where key j is visible to query i: j <= i + seqlen_k - seqlen_q
    (bottom-right alignment, as FlashAttention-2). With ``rows`` (1-D query indices): only those rows,
    (len(rows), seqlen_k)."""
    i = (torch.arange(seqlen_q, device=device) if rows is None else rows.to(device))[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


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
    upcast: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale) v and its natural-log logsumexp, the contract of ``fa2.attention``.

    Arguments:
        q: (..., heads, seqlen_q, head_dim); k, v: (..., heads_k, seqlen_k, head_dim), heads a multiple of
            heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to key/value
            head h // (heads // heads_k). Rank 2 inputs have no heads dim.
        upcast: True computes in float64 and returns float64 O and L (the ground truth). False computes
            every step in the inputs' own dtype, as a naive low-precision attention would: its error is
            the yardstick of FlashAttention-2's accuracy rule.
        rows: None, or a 1-D integer tensor of query indices: only those rows of O and L are computed,
            as the matching rows of the full result (same causal alignment), at (len(rows), seqlen_k)
            memory instead of (seqlen_q, seqlen_k). For checking long sequences on a sample of rows.

    Returns:
        O: (..., seqlen_q, head_dim), float64 or q's dtype. L: (..., seqlen_q), float64 or float32.
        With ``rows``, seqlen_q is len(rows). Rows that see no key: O = 0, L = +inf.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    seqlen_q = q.shape[-2]
    if rows is not None:
        rows = rows.to(q.device)
        q = q[..., rows, :]
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = repeat_kv_heads(q, k, v)
    S = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = causal_mask(seqlen_q, k.shape[-2], q.device, rows)
        S = S.masked_fill(~visible, -math.inf)
        empty = ~visible.any(dim=-1)
    else:
        empty = torch.full((q.shape[-2],), k.shape[-2] == 0, dtype=torch.bool, device=q.device)
    L = torch.logsumexp(S, dim=-1).masked_fill(empty, math.inf)
    P = torch.softmax(S, dim=-1).masked_fill(empty[:, None], 0.0)
    O = P @ v
    return O, L if upcast else L.float()
