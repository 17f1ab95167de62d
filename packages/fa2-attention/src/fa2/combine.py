"""``combine``: attention over the union of key ranges, from each range's (O, L).

Attention over keys split into ranges (split-KV decoding, a sequence sharded across GPUs) computes each
range's output O_s and logsumexp L_s on its own; the softmax over all keys is then the ranges' outputs
weighted by how much of the total probability mass each holds, exp(L_s - L), with L = log Σ_s exp(L_s):

    L = logsumexp_s(L_s)        O = Σ_s exp(L_s - L) · O_s

exactly, for any split of the keys, because O_s is its range's softmax-weighted sum of values and
exp(L_s) its range's sum of exp(scores). fa2's L is the natural log (L = m + log l), and a row that sees no
key of a range has L_s = +inf and O_s = 0 there (``fa2.attention``'s convention): such a range weighs
nothing here, and a row that sees no key in any range comes out O = 0, L = +inf again.

Attention sinks (``fa2.attention(..., sink=)``) belong to the whole row, not to a range: counted in each
range's L, they would be counted once per range. So the ranges are computed without the sink and the merge
adds it once, as one more range with L_s = sink[h] and O_s = 0 (``combine(..., sink=sink)``):

    L = log(exp(sink[h]) + Σ_s exp(L_s))        O = Σ_s exp(L_s - L) · O_s

which is exactly attention with the sink over all the keys (a row that sees no key: O = 0, L = sink[h]).
"""

from __future__ import annotations

import math

import torch

from fa2.spec import AttentionOutput


def combine(
    O: torch.Tensor, L: torch.Tensor, *, sink: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> AttentionOutput:
    """Merges the partial results of attention over S disjoint key ranges into the result over their union.

    Arguments:
        O: (S, ..., seqlen_q, head_dim): range s's output for every query row, any float dtype.
        L: (S, ..., seqlen_q): range s's natural-log logsumexp of the scaled scores, float32 (or wider);
            +inf where a row sees no key of the range (its O row is then ignored).
        sink: None, or float32 (heads,) on O's device: attention sinks, counted once in the merge (module
            docstring). The ranges' O and L must then be computed WITHOUT the sink. The heads are L's dim -2:
            O (S, ..., heads, seqlen_q, head_dim), L (S, ..., heads, seqlen_q).
        dtype: the merged O's dtype (default O's).

    Returns:
        AttentionOutput(O (..., seqlen_q, head_dim), L (..., seqlen_q)): what attention over all the ranges'
        keys at once gives (with the sink, if given); rows that see no key in any range: O = 0, L = +inf
        (L = sink[h] with a sink). Computed, and L returned, in float32 (float64 where O, L or the sink is
        float64). Differentiable in O, L and the sink by autograd; note that ``fa2.attention``'s L carries no
        gradient, so gradients through a combine of its outputs miss the terms through L.

    Raises:
        ValueError: O and L of mismatched shapes, S = 0, a sink that is not (heads,), or tensors on different
            devices.
        TypeError: O, L or the sink not floating point.
    """
    if not isinstance(O, torch.Tensor) or not isinstance(L, torch.Tensor):
        raise TypeError(f"O and L must be tensors, got {type(O).__name__} and {type(L).__name__}")
    if not (O.is_floating_point() and L.is_floating_point()):
        raise TypeError(f"O and L must be floating point, got {O.dtype} and {L.dtype}")
    if O.dim() < 3 or O.shape[:-1] != L.shape:
        raise ValueError(
            f"O must be (splits, ..., seqlen_q, head_dim) and L (splits, ..., seqlen_q), got O {tuple(O.shape)} "
            f"and L {tuple(L.shape)}"
        )
    if O.shape[0] == 0:
        raise ValueError(f"combine needs at least one split, got O {tuple(O.shape)}")
    if O.device != L.device:
        raise ValueError(f"O and L must be on one device, got {O.device} and {L.device}")
    if sink is not None:
        _check_sink(sink, L)
    acc = torch.float64 if torch.float64 in (O.dtype, L.dtype, getattr(sink, "dtype", None)) else torch.float32
    # A range where the row sees no key (L = +inf by fa2's convention) adds no probability mass: -inf.
    lse = L.to(acc).masked_fill(L == math.inf, -math.inf)
    if sink is not None:
        # The sink, once: one more range of mass exp(sink[h]) and no value, which only the total sees.
        lse_sink = sink.to(acc)[:, None].expand(L.shape[1:])
        total = torch.logsumexp(torch.cat([lse, lse_sink[None]]), dim=0)
    else:
        total = torch.logsumexp(lse, dim=0)
    empty = total == -math.inf
    # Rows with no key anywhere: weights 0 (not exp(-inf + inf) = NaN), then O = 0 and L = +inf.
    weights = torch.exp(lse - total.masked_fill(empty, 0.0))  # (S, ..., seqlen_q)
    # An ignored row is ignored even if it holds NaN (0 · NaN would not be).
    parts = O.to(acc).masked_fill((L == math.inf)[..., None], 0.0)
    out = torch.einsum("s...m,s...md->...md", weights, parts)
    return AttentionOutput(out.to(O.dtype if dtype is None else dtype), total.masked_fill(empty, math.inf))


def _check_sink(sink, L: torch.Tensor) -> None:
    if not isinstance(sink, torch.Tensor) or not sink.is_floating_point():
        got = sink.dtype if isinstance(sink, torch.Tensor) else type(sink).__name__
        raise TypeError(f"sink must be a floating-point tensor (float32, one logit per head), got {got}")
    if L.dim() < 3 or sink.shape != L.shape[-2:-1]:
        raise ValueError(
            f"sink must have shape (heads,), L's dim -2 (L: (splits, ..., heads, seqlen_q)), got sink "
            f"{tuple(sink.shape)} and L {tuple(L.shape)}"
        )
    if sink.device != L.device:
        raise ValueError(f"sink must be on L's device {L.device}, got {sink.device}")
