"""The public entry point: validate once, pick a backend, dispatch.

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

import math
from typing import NamedTuple

import torch

from fa2 import ops, registry
from fa2.layout import forward_any_rank

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class AttentionOutput(NamedTuple):
    """O: q's shape, dtype and device. L: q.shape[:-1], float32, natural-log logsumexp of the scaled scores."""

    O: torch.Tensor
    L: torch.Tensor


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
) -> AttentionOutput:
    """FlashAttention-2 forward: softmax(q kᵀ · scale) v, and its logsumexp.

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
        backend: "pytorch", "triton", "numba-cuda" or None. None picks, for CUDA tensors, the fastest
            installed backend that runs natively on CUDA (triton, then numba-cuda, then pytorch); for CPU
            tensors, pytorch. An explicit backend is used or fails: fa2 never falls back to another.

    Returns:
        AttentionOutput(O, L):
        O: (..., seqlen_q, head_dim), q's dtype and device.
        L: (..., seqlen_q), float32, L = m + log(l), the natural-log logsumexp of the scaled scores of each
            query row. A row that sees no key (causal with seqlen_q > seqlen_k) gets O = 0 and L = +inf.
            +inf, not the -inf of an empty logsumexp, so that the backward's P = exp(S - L) is exactly 0
            on such rows instead of NaN (FlashAttention-2's convention).

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
            unknown backend.
        TypeError: non-floating or mismatched dtypes, a causal that is not a bool.
        fa2.BackendNotInstalledError: a known backend whose package is not installed.
        NotImplementedError: the chosen backend does not support this input (its message names the limit).
    """
    _validate(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if torch.compiler.is_compiling():
        return AttentionOutput(*forward_any_rank(ops.forward_op(backend, q.device), q, k, v, causal, scale))
    impl = registry.load(backend if backend is not None else registry.default_backend(q.device))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return AttentionOutput(*impl.FlashAttention2.apply(q, k, v, causal, scale, True))
    return AttentionOutput(*forward_any_rank(impl.flash_attn_forward, q, k, v, causal, scale))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., seqlen, head_dim), got {tuple(t.shape)}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"q, k and v must have the same rank, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "q, k and v must have the same leading dims, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.dim() > 2 and q.shape[-3] != k.shape[-3]:
        if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            raise ValueError(
                "q's heads (dim -3) must be a multiple of k's and v's (grouped-query attention), got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(
            f"q, k and v must have the same head_dim, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be from 1 to {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")

