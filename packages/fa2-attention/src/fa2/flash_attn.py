"""``fa2.flash_attn``: flash-attn 2.8's Python API (``flash_attn_func``, ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``) computed by fa2, for code written against flash-attn.

    from fa2.flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)                         # q, k, v: (batch, seqlen, nheads, headdim)
    out, lse, _ = flash_attn_func(q, k, v, window_size=(256, 0), return_attn_probs=True, backend="triton")

The same argument names, order and defaults, layouts, return values and gradients as flash-attn 2.8.3's
``flash_attn_interface.py`` (docs/notes/flash-attn-contract.md), plus a keyword-only ``backend=`` (as
``fa2.attention``: None picks one, a named one is used or fails). Each call is one ``fa2.attention`` on
(batch, nheads, seqlen, headdim) views of the caller's tensors: transposes, and for the packed inputs
``unbind`` along the packing dim, never a copy. The backward of ``unbind`` stacks the three (two) gradients
into one fresh tensor shaped like the packed input, as flash-attn's ``dqkv`` / ``dkv``.

Where this module differs from flash-attn, on purpose:

- ``dropout_p > 0`` raises NotImplementedError (fa2 has no attention dropout; a subclass of RuntimeError,
  the type flash-attn's own checks raise). The third element of the ``return_attn_probs`` tuple, flash-attn's
  ``S_dmask``, is only ever real with dropout: here it is None.
- float32 inputs are computed (flash-attn refuses them): fa2's backends all have an fp32 path, with the
  fp32 tolerances of shared_tests/checks.py.
- CPU tensors are computed (by fa2-pytorch), and every stride is taken as it is, the last dim's included
  (flash-attn copies a tensor whose last dim is not contiguous).
- ``deterministic`` is accepted and changes nothing: every fa2 backend's backward writes each element of
  dq, dk and dv once, with no atomics (fa2-triton's atomic-dq variant is never reached from fa2.attention),
  so gradients are bit-identical run after run whatever the flag (shared_tests/test_flash_attn_api.py
  checks it).
- Window entries below -1 and negative or non-finite softcaps are refused with a clear error (flash-attn
  reads any negative window side as unbounded and any softcap <= 0 as off).
- With ALiBi and causal, flash-attn's kernel adds ``slope * j`` instead of ``-slope * |i + Nk - Nq - j|``:
  the same softmax and output, a softmax_lse shifted per row. fa2 returns the logsumexp of the scores with
  the documented bias.
- Head dims that are not a multiple of 8 are zero-padded to the next one, as flash-attn pads them, for
  every backend alike (fa2-triton's kernels take multiples of 8 only; zeros change no score): the scale
  stays that of the unpadded head dim, the output and gradients are sliced back.

Errors: where flash-attn's C++ checks raise (RuntimeError), this module raises ``FlashAttnValueError`` or
``FlashAttnTypeError``, subclasses of RuntimeError and of ValueError / TypeError, so that code catching
either flash-attn's type or fa2's convention catches them.

The varlen and KV-cache functions (``flash_attn_varlen_*``, ``flash_attn_with_kvcache``) are not here yet
(issues #21 and #22).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from fa2.api import MAX_HEAD_DIM, attention

__all__ = [
    "FlashAttnTypeError", "FlashAttnValueError", "flash_attn_func", "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FlashAttnValueError(RuntimeError, ValueError):
    """A bad value or shape where flash-attn raises RuntimeError (its C++ TORCH_CHECKs)."""


class FlashAttnTypeError(RuntimeError, TypeError):
    """A bad type or dtype where flash-attn raises RuntimeError (its C++ TORCH_CHECKs)."""


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """softmax(softmax_scale · q kᵀ, capped, biased and masked) v, flash-attn's ``flash_attn_func``.

    Supports multi-query and grouped-query attention (MQA/GQA) by passing k, v with fewer heads than q:
    nheads must be a multiple of nheads_k, and query head h attends to key/value head
    h // (nheads // nheads_k). With 6 query heads and 2 key/value heads, query heads 0, 1, 2 use key/value
    head 0 and query heads 3, 4, 5 key/value head 1.

    With causal=True the causal mask is aligned to the bottom-right corner of the attention matrix. With
    seqlen_q = 2 and seqlen_k = 5 (1 = keep, 0 = masked out)::

        1 1 1 1 0
        1 1 1 1 1

    With seqlen_q = 5 and seqlen_k = 2::

        0 0
        0 0
        0 0
        1 0
        1 1

    A row of the mask that is all zero gives an output row of zeros (and softmax_lse = +inf).

    With window_size != (-1, -1), sliding-window (local) attention: query i attends to the keys j with
    i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1], inclusive.
    With seqlen_q = seqlen_k = 5 and window_size = (1, 1)::

        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1
        0 0 0 1 1

    As in flash-attn, a side >= seqlen_k becomes -1 (unbounded), and causal=True sets the right side to 0:
    causal with window_size (w, w) is window (w, 0).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        k: (batch_size, seqlen_k, nheads_k, headdim).
        v: (batch_size, seqlen_k, nheads_k, headdim).
            float16, bfloat16 or float32 (flash-attn: float16 and bfloat16 only), all one dtype, on one
            device; any strides; headdim from 1 to 256.
        dropout_p: float, must be 0.0: fa2 has no attention dropout (NotImplementedError otherwise).
        softmax_scale: float, the scaling of q kᵀ before the softmax; default 1 / sqrt(headdim).
        causal: bool, the bottom-right causal mask above.
        window_size: (left, right), ints (or 0-d integer tensors) >= 0, -1 for no bound on that side.
        softcap: float, 0.0 (off) or > 0: scores s become softcap · tanh(s / softcap) before the bias and
            the mask.
        alibi_slopes: None or float32 (nheads,) or (batch_size, nheads) on q's device: a bias of
            -alibi_slope · |i + seqlen_k - seqlen_q - j| is added to the score of query i and key j. No
            gradient flows to it.
        deterministic: bool, accepted for flash-attn's sake; fa2's backward is always deterministic.
        return_attn_probs: bool: also return softmax_lse (and None where flash-attn returns S_dmask).
        backend: keyword-only, "pytorch", "triton", "numba-cuda" or None, as ``fa2.attention``.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype (a transposed view of fa2's
            (batch, nheads, seqlen_q, headdim) result: call .contiguous() before .view()).
        With return_attn_probs=True, the tuple (out, softmax_lse, None):
        softmax_lse: (batch_size, nheads, seqlen_q), float32, the natural-log logsumexp of each row of the
            final scores (+inf on rows that see no key).

    Raises:
        NotImplementedError: dropout_p > 0; a backend that cannot run this input (its message says why).
        FlashAttnValueError (RuntimeError, ValueError): wrong ranks or shapes, nheads not a multiple of
            nheads_k, headdim > 256, batch_size 0, dropout_p with softcap, window sides below -1, a negative
            or non-finite softcap, alibi_slopes of the wrong shape or device, tensors on different devices.
        FlashAttnTypeError (RuntimeError, TypeError): non-tensors, a dtype other than fp16/bf16/fp32,
            mismatched dtypes, alibi_slopes that are not float32, window entries that are not integers.
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       return_attn_probs, backend)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """``flash_attn_func`` on q, k, v stacked into one tensor: flash-attn's ``flash_attn_qkvpacked_func``.

    q, k and v are read in place as qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]; the gradient is one tensor
    shaped like qkv. No MQA/GQA here (use ``flash_attn_kvpacked_func`` or ``flash_attn_func``). Masks,
    window, softcap and ALiBi as in ``flash_attn_func`` (seqlen_q = seqlen_k, so the window is
    [i - window_size[0], i + window_size[1]]).

    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, backend: as in ``flash_attn_func``; softmax_scale defaults to 1 / sqrt(headdim).

    Returns:
        out: (batch_size, seqlen, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (batch_size, nheads, seqlen), float32.

    Raises:
        As ``flash_attn_func``; FlashAttnValueError for a qkv that is not (batch_size, seqlen, 3, nheads,
        headdim).
    """
    _check_packed("qkv", qkv, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       return_attn_probs, backend)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend=None,
):
    """``flash_attn_func`` with k and v stacked into one tensor: flash-attn's ``flash_attn_kvpacked_func``.

    k and v are read in place as kv[:, :, 0] and kv[:, :, 1]; their gradient is one tensor shaped like kv.
    MQA/GQA, masks, window, softcap and ALiBi as in ``flash_attn_func``.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, backend: as in ``flash_attn_func``.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (batch_size, nheads, seqlen_q), float32.

    Raises:
        As ``flash_attn_func``; FlashAttnValueError for a kv that is not (batch_size, seqlen_k, 2,
        nheads_k, headdim).
    """
    _check_packed("kv", kv, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       return_attn_probs, backend)


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                return_attn_probs, backend):
    _check_tensors(q, k, v)
    softcap = _softcap(softcap)
    _check_dropout(dropout_p, softcap)
    _check_alibi(alibi_slopes, q)
    if not isinstance(causal, bool):
        raise FlashAttnTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    window = _window(window_size, k.shape[1], causal)
    head_dim = q.shape[-1]
    # flash-attn's default, head_dim ** -0.5 of the unpadded head dim (1 / sqrt(d) can differ in the last bit).
    scale = head_dim ** (-0.5) if softmax_scale is None else softmax_scale

    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    O, L = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, window=window,
                     softcap=softcap, alibi_slopes=alibi_slopes, backend=backend)
    out = O.transpose(1, 2)
    if pad:
        out = out[..., :head_dim]
    return (out, L, None) if return_attn_probs else out


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise FlashAttnValueError(
                f"{name} must have shape (batch_size, seqlen, nheads, headdim), got {tuple(t.shape)}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dtype not in _DTYPES:
        raise FlashAttnTypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FlashAttnTypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise FlashAttnValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    batch, _, heads, head_dim = q.shape
    if batch == 0:
        raise FlashAttnValueError(f"batch size must be positive, got {shapes}")
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise FlashAttnValueError(
            f"k and v must have shape (batch_size, seqlen_k, nheads_k, headdim) with q's batch_size and "
            f"headdim, got {shapes}"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise FlashAttnValueError(f"headdim must be from 1 to {MAX_HEAD_DIM}, got {head_dim} ({shapes})")
    if k.shape[2] == 0 or heads % k.shape[2]:
        raise FlashAttnValueError(
            f"the number of heads in key/value must divide the number of heads in query, got {shapes}"
        )


def _check_packed(name: str, x, n: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 5 or x.shape[2] != n:
        raise FlashAttnValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")


def _check_dropout(dropout_p, softcap: float) -> None:
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise FlashAttnTypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}") from None
    if not 0.0 <= p < 1.0:
        raise FlashAttnValueError(f"dropout_p must be in [0, 1), got {p}")
    if p > 0.0 and softcap > 0.0:
        raise FlashAttnValueError(f"softcapping does not support dropout (as flash-attn), got dropout_p={p} "
                                  f"and softcap={softcap}")
    if p > 0.0:
        raise NotImplementedError(
            f"fa2.flash_attn does not support dropout_p={p}: fa2 has no attention dropout; pass dropout_p=0.0"
        )


def _softcap(softcap) -> float:
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise FlashAttnTypeError(f"softcap must be a float, got {type(softcap).__name__} {softcap!r}") from None
    if not math.isfinite(value) or value < 0:
        raise FlashAttnValueError(f"softcap must be finite and >= 0 (0 turns it off), got {value}")
    return value


def _check_alibi(slopes, q: torch.Tensor) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, torch.Tensor):
        raise FlashAttnTypeError(f"alibi_slopes must be a float32 torch.Tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise FlashAttnTypeError(f"alibi_slopes must have dtype float32, got {slopes.dtype}")
    if slopes.device != q.device:
        raise FlashAttnValueError(f"alibi_slopes must be on q's device {q.device}, got {slopes.device}")
    batch, heads = q.shape[0], q.shape[2]
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise FlashAttnValueError(
            f"alibi_slopes must have shape (nheads,) = ({heads},) or (batch_size, nheads) = ({batch}, {heads}), "
            f"got {tuple(slopes.shape)}"
        )


def _window(window_size, seqlen_k: int, causal: bool) -> tuple[int, int]:
    """flash-attn's normalisation (mha_fwd): ints (0-d integer tensors int()'d), a side >= seqlen_k becomes
    -1, then causal sets the right side to 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise FlashAttnTypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if not _is_integer(side):
            raise FlashAttnTypeError(
                f"window_size {name} must be an int (-1 for unbounded), got {type(side).__name__} {side!r}"
            )
        side = int(side)
        if side < -1:
            raise FlashAttnValueError(
                f"window_size {name} must be >= 0, or -1 for unbounded, got {side} (window_size {window_size!r})"
            )
        sides.append(-1 if side >= seqlen_k else side)
    left, right = sides
    return (left, 0) if causal else (left, right)


def _is_integer(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
