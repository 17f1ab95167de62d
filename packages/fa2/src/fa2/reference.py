"""Plain attention that materialises the (seqlen_q, seqlen_k) score matrix, for tests and benchmarks.

No backend imports this module: a kernel is checked against it, never built from it.
"""

from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where key j is visible to query i: j <= i + seqlen_k - seqlen_q
    (bottom-right alignment, as FlashAttention-2)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale) v and its natural-log logsumexp, the contract of ``fa2.attention``.

    Arguments:
        q: (..., seqlen_q, head_dim); k, v: (..., seqlen_k, head_dim).
        upcast: True computes in float64 and returns float64 O and L (the ground truth). False computes
            every step in the inputs' own dtype, as a naive low-precision attention would: its error is
            the yardstick of FlashAttention-2's accuracy rule.

    Returns:
        O: (..., seqlen_q, head_dim), float64 or q's dtype. L: (..., seqlen_q), float64 or float32.
        Rows that see no key: O = 0, L = +inf.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    S = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = causal_mask(q.shape[-2], k.shape[-2], q.device)
        S = S.masked_fill(~visible, -math.inf)
        empty = ~visible.any(dim=-1)
    else:
        empty = torch.zeros(q.shape[-2], dtype=torch.bool, device=q.device)
    L = torch.logsumexp(S, dim=-1).masked_fill(empty, math.inf)
    P = torch.softmax(S, dim=-1).masked_fill(empty[:, None], 0.0)
    O = P @ v
    return O, L if upcast else L.float()
