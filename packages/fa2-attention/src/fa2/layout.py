"""The one canonical layout every backend kernel sees: (batch, heads, seqlen, head_dim), any strides, with
an ``fa2.spec.AttentionSpec`` saying what to compute."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fa2.spec import AttentionSpec

Forward = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dq, dk, dv), and dsink (heads,) after them when the spec has a sink.
Backward = Callable[..., "tuple[torch.Tensor, ...]"]


def as_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(..., N, D) as (B, H, N, D): a view for ranks 2 to 4; ranks above 4 merge the leading dims, which
    copies only where they cannot be merged as a view."""
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    # The merged size spelled out, not -1: with a 0 anywhere in the shape, -1 is ambiguous to reshape.
    return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])


def forward_any_rank(
    forward: Forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a backend's (B, H, N, D) forward on (..., N, D) inputs; O comes back in q's shape and
    L: q.shape[:-1], float32. ``spec`` is already in the (B, H, N, D) view's terms
    (``fa2.validation.make_spec``)."""
    O, L = forward(as_bhnd(q), as_bhnd(k), as_bhnd(v), spec)
    if q.dim() == 4:
        # Already in q's shape; two reshapes cost ~6-10 µs of host time a call on the H200's host.
        return O, L
    return O.reshape(q.shape), L.reshape(q.shape[:-1])


def backward_any_rank(
    backward: Backward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
) -> tuple[torch.Tensor, ...]:
    """Runs a backend's (B, H, N, D) backward on (..., N, D) tensors; L: q.shape[:-1]. dq, dk, dv come
    back in the shapes of q, k, v; with ``spec.sink``, dsink (heads,) float32 after them, as the backend
    returns it (the heads are q's dim -3 in every rank)."""
    if q.dim() == 4:
        # Already (B, H, N, D), and the gradients come back in those shapes: nine views and reshapes cost
        # ~5 µs of host time a step on this project's CPU.
        return backward(q, k, v, O, L, dO, spec)
    dq, dk, dv, *dsink = backward(
        as_bhnd(q), as_bhnd(k), as_bhnd(v), as_bhnd(O), as_bhnd(L.unsqueeze(-1)).squeeze(-1), as_bhnd(dO), spec
    )
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), *dsink


def spec_for(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float | None) -> AttentionSpec:
    """The AttentionSpec of the CS336 call ``FlashAttention2.apply(q, k, v, is_causal, scale)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    group = q.shape[-3] // k.shape[-3] if q.dim() > 2 and k.shape[-3] else 1
    return AttentionSpec(scale, (-1, 0) if is_causal else (-1, -1), group=group)
