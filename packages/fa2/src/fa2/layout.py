"""The one canonical layout every backend kernel sees: (batch, heads, seqlen, head_dim), any strides."""

from __future__ import annotations

import math
from typing import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], "tuple[torch.Tensor, torch.Tensor]"]


def as_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(..., N, D) as (B, H, N, D): a view for ranks 2 to 4; ranks above 4 merge the leading dims, which
    copies only where they cannot be merged as a view."""
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    return x.reshape(-1, *x.shape[-3:])


def forward_any_rank(
    forward: Forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a backend's (B, H, N, D) forward on (..., N, D) inputs; O comes back in q's shape and
    L: q.shape[:-1], float32."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    O, L = forward(as_bhnd(q), as_bhnd(k), as_bhnd(v), bool(causal), float(scale))
    return O.reshape(q.shape), L.reshape(q.shape[:-1])
