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

The variable-length functions (``flash_attn_varlen_func``, ``flash_attn_varlen_qkvpacked_func``,
``flash_attn_varlen_kvpacked_func``) take sequences packed along one dim, (total, nheads, headdim), with
their int32 offsets ``cu_seqlens``; each call is one ``fa2.varlen_attention`` on the caller's tensors (the
packed ones unbound along dim 1), and softmax_lse is flash-attn's unpadded (nheads, total_q)::

    from fa2.flash_attn import flash_attn_varlen_func
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)                    # two sequences: 5 and 7 tokens
    out = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)    # q, k, v: (12, nheads, headdim)

Every function also takes flash-attn 4's keyword ``learnable_sink`` (attention sinks, gpt-oss: a logit per
head in every row's softmax denominator, ``fa2.attention``'s ``sink``), on every backend and with its
gradient; flash-attn 2 has none.

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

The KV-cache function ``flash_attn_with_kvcache`` is one ``fa2.kvcache_attention`` on (batch, nheads,
seqlen, headdim) views of the caller's tensors and caches (the caches written in place through those
views); ``flash_attn_varlen_func`` with a ``block_table`` (paged KV) runs the same KV-cache kernels on its
packed queries::

    from fa2.flash_attn import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True)

Beyond flash-attn there: any page size (flash-attn: a multiple of 256), a paged cache with
``cache_leftpad``, any head dim up to 256 without padding (flash-attn copies a cache whose head dim is not a
multiple of 8, twice), any rotary_dim up to headdim (flash-attn: a multiple of 16), and caches of any
strides (flash-attn asserts a contiguous last dim).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fa2 import kvcache
from fa2.api import attention, varlen_attention
from fa2.validation import MAX_HEAD_DIM, check_index, check_sink, check_softcap, check_window, is_integer

__all__ = [
    "FlashAttnTypeError",
    "FlashAttnValueError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
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
    learnable_sink=None,
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
        learnable_sink: keyword-only, None or (nheads,) float16, bfloat16 or float32 on q's device: flash-attn
            4's attention sinks, ``fa2.attention``'s ``sink`` (cast to float32, differentiably): a logit per
            head joins every row's softmax denominator, out_i = Σ_j exp(s_ij - lse_i) v_j with lse_i =
            log(exp(learnable_sink[h]) + Σ_j exp(s_ij)), the softmax_lse returned; a row that sees no key gets
            out = 0 and softmax_lse = learnable_sink[h]. Its gradient flows through autograd.
        backend: keyword-only, "pytorch", "triton", "numba-cuda" or None, as ``fa2.attention``.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype (a transposed view of fa2's
            (batch, nheads, seqlen_q, headdim) result: call .contiguous() before .view()).
        With return_attn_probs=True, the tuple (out, softmax_lse, None):
        softmax_lse: (batch_size, nheads, seqlen_q), float32, the natural-log logsumexp of each row of the
            final scores (+inf on rows that see no key; learnable_sink[h] with a sink).

    Raises:
        NotImplementedError: dropout_p > 0; a backend that cannot run this input (its message says why).
        FlashAttnValueError (RuntimeError, ValueError): wrong ranks or shapes, nheads not a multiple of
            nheads_k, headdim > 256, batch_size 0, dropout_p with softcap, window sides below -1, a negative
            or non-finite softcap, alibi_slopes or learnable_sink of the wrong shape or device, tensors on
            different devices.
        FlashAttnTypeError (RuntimeError, TypeError): non-tensors, a dtype other than fp16/bf16/fp32,
            mismatched dtypes, alibi_slopes that are not float32, window entries that are not integers.
    """
    return _flash_attn(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


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
    learnable_sink=None,
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
        return_attn_probs, learnable_sink, backend: as in ``flash_attn_func``; softmax_scale defaults to
        1 / sqrt(headdim).

    Returns:
        out: (batch_size, seqlen, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (batch_size, nheads, seqlen), float32.

    Raises:
        As ``flash_attn_func``; FlashAttnValueError for a qkv that is not (batch_size, seqlen, 3, nheads,
        headdim).
    """
    _check_packed("qkv", qkv, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return _flash_attn(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


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
    learnable_sink=None,
    backend=None,
):
    """``flash_attn_func`` with k and v stacked into one tensor: flash-attn's ``flash_attn_kvpacked_func``.

    k and v are read in place as kv[:, :, 0] and kv[:, :, 1]; their gradient is one tensor shaped like kv.
    MQA/GQA, masks, window, softcap and ALiBi as in ``flash_attn_func``.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink, backend: as in ``flash_attn_func``.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (batch_size, nheads, seqlen_q), float32.

    Raises:
        As ``flash_attn_func``; FlashAttnValueError for a kv that is not (batch_size, seqlen_k, 2,
        nheads_k, headdim).
    """
    _check_packed("kv", kv, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return _flash_attn(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    learnable_sink=None,
    backend=None,
):
    """``flash_attn_func`` on a batch of sequences packed without padding: flash-attn's
    ``flash_attn_varlen_func``.

    Sequence s has the queries q[cu_seqlens_q[s] : cu_seqlens_q[s + 1]] and the keys and values
    k, v[cu_seqlens_k[s] : cu_seqlens_k[s + 1]]; it attends to its own keys only. Every mask is each
    sequence's own, with its own seqlen_q = cu_seqlens_q[s + 1] - cu_seqlens_q[s] and seqlen_k: causal and
    the window aligned to the bottom-right corner of that sequence's attention matrix, the ALiBi distance
    |i + seqlen_k - seqlen_q - j| counted within it, rows that see no key (seqlen_k = 0, or a causal
    seqlen_q > seqlen_k) giving out = 0 and softmax_lse = +inf. Sequences of length 0 (repeated offsets)
    are allowed, queries and keys alike. MQA/GQA, causal, window, softcap and ALiBi otherwise as in
    ``flash_attn_func``; a window side >= max_seqlen_k becomes -1 (unbounded), as flash-attn compares it.
    With 2 sequences of 2 and 3 tokens, causal (1 = keep)::

        1 0 . . .
        1 1 . . .
        . . 1 0 0
        . . 1 1 0
        . . 1 1 1

    Arguments:
        q: (total_q, nheads, headdim), total_q = the sum of the sequences' query lengths.
        k: (total_k, nheads_k, headdim).
        v: (total_k, nheads_k, headdim).
            float16, bfloat16 or float32, one dtype, one device, any strides; headdim from 1 to 256;
            nheads a multiple of nheads_k.
        cu_seqlens_q: (batch_size + 1,) int32, contiguous, on q's device: the offsets of the sequences'
            queries in q (cu_seqlens_q[0] = 0, cu_seqlens_q[-1] = total_q, non-decreasing).
        cu_seqlens_k: (batch_size + 1,) int32, the same for k and v.
        max_seqlen_q: int, the longest query sequence (its length or more).
        max_seqlen_k: int, the longest key sequence (its length or more); the window sides are compared
            against it.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
        learnable_sink, backend: as in ``flash_attn_func`` (a sink in every sequence's rows).
        alibi_slopes: None or float32 (nheads,) or (batch_size, nheads), on q's device.
        block_table: None, or (batch_size, max_num_blocks_per_seq) int32 on q's device: a paged KV cache.
            k and v are then (num_blocks, page_block_size, nheads_k, headdim) pages, any page size, and
            sequence s's keys are keys [0, cu_seqlens_k[s + 1] - cu_seqlens_k[s]) of its pages (key j at
            row j % page_block_size of page block_table[s, j // page_block_size]); forward only (a
            backward raises NotImplementedError), as flash-attn's. Run by the backend's KV-cache kernels
            (``fa2.kvcache_attention``'s); cu_seqlens_k's totals are then not checked against k.

    Returns:
        out: (total_q, nheads, headdim), q's dtype (a transposed view of fa2's (nheads, total_q, headdim)
            result: call .contiguous() before .view()).
        With return_attn_probs=True, the tuple (out, softmax_lse, None):
        softmax_lse: (nheads, total_q), float32 (flash-attn's unpadded LSE): the natural-log logsumexp of
            each query row of the final scores, +inf on rows that see no key.

    What is checked, and what is not: the offsets' dtype, rank, length, contiguity and device, and
    max_seqlen_* being ints, as flash-attn checks them; and, beyond flash-attn, at the cost of one device
    synchronisation (``fa2.varlen_attention``'s), that cu_seqlens_q and cu_seqlens_k start at 0 and end at
    total_q and total_k. Not checked (it would take a sync over every entry): that the offsets never
    decrease, and that no sequence is longer than max_seqlen_q / max_seqlen_k. Those are the caller's to
    get right, as with flash-attn, and what then happens is backend-defined: fa2-pytorch reads every
    offset anyway (it runs each sequence) and refuses decreasing ones (FlashAttnValueError), and computes a
    sequence longer than max_seqlen_* in full; fa2-triton's and fa2-numba-cuda's kernels size their grids
    by max_seqlen_* and leave the rows of a longer sequence past it unwritten, with no error.

    Raises:
        NotImplementedError: dropout_p > 0; a backend that cannot run this input (its message says why).
        FlashAttnValueError (RuntimeError, ValueError): q, k, v not of rank 3 or of disagreeing shapes;
            cu_seqlens_* not 1-D, empty, of different lengths, not contiguous, not on q's device, or not
            from 0 to total_q / total_k; a negative max_seqlen_*; alibi_slopes not (nheads,) or
            (batch_size, nheads); and as ``flash_attn_func``.
        FlashAttnTypeError (RuntimeError, TypeError): cu_seqlens_* not int32 tensors; max_seqlen_* not
            ints; and as ``flash_attn_func``.
    """
    if block_table is not None:
        return _flash_attn_varlen_paged(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            learnable_sink,
            return_attn_probs,
            block_table,
            backend,
        )
    return _flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    backend=None,
):
    """``flash_attn_varlen_func`` on q, k, v stacked into one tensor: flash-attn's
    ``flash_attn_varlen_qkvpacked_func``.

    q, k and v are read in place as qkv[:, 0], qkv[:, 1], qkv[:, 2], with one set of offsets for all three
    (each sequence's seqlen_q = seqlen_k); the gradient is one tensor shaped like qkv. No MQA/GQA here.

    Arguments:
        qkv: (total, 3, nheads, headdim).
        cu_seqlens: (batch_size + 1,) int32, the offsets of the sequences in qkv.
        max_seqlen: int, the longest sequence.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink, backend: as in ``flash_attn_varlen_func``.

    Returns:
        out: (total, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (nheads, total), float32.

    Raises:
        As ``flash_attn_varlen_func``; FlashAttnValueError for a qkv that is not (total, 3, nheads, headdim).
    """
    _check_packed("qkv", qkv, 3, "(total, 3, nheads, headdim)", dim=1)
    q, k, v = qkv.unbind(1)
    return _flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    backend=None,
):
    """``flash_attn_varlen_func`` with k and v stacked into one tensor: flash-attn's
    ``flash_attn_varlen_kvpacked_func``.

    k and v are read in place as kv[:, 0] and kv[:, 1]; their gradient is one tensor shaped like kv.

    Arguments:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink, backend: as in
        ``flash_attn_varlen_func``.

    Returns:
        out: (total_q, nheads, headdim); with return_attn_probs=True, (out, softmax_lse, None),
        softmax_lse: (nheads, total_q), float32.

    Raises:
        As ``flash_attn_varlen_func``; FlashAttnValueError for a kv that is not (total_k, 2, nheads_k,
        headdim).
    """
    _check_packed("kv", kv, 2, "(total_k, 2, nheads_k, headdim)", dim=1)
    k, v = kv.unbind(1)
    return _flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        learnable_sink,
        return_attn_probs,
        backend,
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
    backend=None,
):
    """Attention of q against a KV cache, after writing the new k and v into it: flash-attn's
    ``flash_attn_with_kvcache`` (inference: no backward).

    If k and v are given, they are written into k_cache and v_cache in place, at positions
    [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of row b's cache, and with rotary_cos and rotary_sin
    k is rotated first (and q: at positions cache_seqlens[b] + t if causal or windowed, cache_seqlens[b]
    for every token otherwise). q then attends to keys [0, cache_seqlens[b] + seqlen_new) of its cache (from
    cache_leftpad[b] on, if given), with causal and the window aligned to the bottom-right corner of that
    (seqlen_q, K_b) matrix, K_b = cache_seqlens[b] + seqlen_new. With seqlen_q = 2 and K_b = 5, causal::

        1 1 1 1 0
        1 1 1 1 1

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_block_size, nheads_k, headdim). q's dtype (fp16, bf16 or fp32) and device, any
            strides; nheads a multiple of nheads_k; headdim up to 256.
        k, v: None, or (batch_size, seqlen_new, nheads_k, headdim): the new keys and values.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): rotary embedding of the first
            rotary_dim channels of q and the new k; rotary_interleaved: pairs (0, 1), (2, 3), ... (GPT-J,
            the default, as flash-attn) or the two halves (GPT-NeoX).
        cache_seqlens: int, or (batch_size,) int32: the keys in each row's cache before the new ones;
            None: the whole cache.
        cache_batch_idx: None, or (batch_size,) int32: the cache row of each batch row (contiguous cache).
        cache_leftpad: None, or (batch_size,) int32: the first key of each row's cache.
        block_table: None, or (batch_size, max_num_blocks_per_seq) int32: a paged cache; key j of row b is
            row j % page_block_size of block block_table[b, j // page_block_size]. Any page size.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func`` (a window side
            >= the cache's capacity becomes -1).
        num_splits: the key ranges each (batch, key/value head) is split into; 0: fa2 picks; 1: no split.
        return_softmax_lse: also return softmax_lse.
        learnable_sink: keyword-only, as ``flash_attn_func`` (no gradient here: inference only).
        backend: keyword-only, as ``fa2.attention``; a backend without a KV-cache path raises
            NotImplementedError.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype (a transposed view of fa2's
            (batch, nheads, seqlen_q, headdim) result). With return_softmax_lse=True, (out, softmax_lse),
            softmax_lse (batch_size, nheads, seqlen_q) float32, +inf on rows that see no key (learnable_sink[h]
            with a sink).

    What is checked (one device sync, once per combination of index tensors, never inside a CUDA-graph
    capture): cache_seqlens + seqlen_new within the capacity, block_table's ids within num_blocks,
    cache_batch_idx within batch_size_cache, cache_leftpad within [0, cache_seqlens + seqlen_new]; under a
    capture the kernels clamp each index instead (``fa2.kvcache_attention``).

    Raises:
        FlashAttnValueError (RuntimeError, ValueError) / FlashAttnTypeError (RuntimeError, TypeError): bad
            shapes, dtypes, devices or index ranges (above); cache_batch_idx with block_table; k without v
            or cache_seqlens; rotary without k.
        NotImplementedError: the backend cannot run this input.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None and name in ("k", "v"):
            continue
        if not isinstance(t, torch.Tensor):
            raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise FlashAttnValueError(f"{name} must have rank 4 (batch, seqlen, nheads, headdim), got {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise FlashAttnTypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if q.shape[0] == 0:
        raise FlashAttnValueError(f"batch size must be positive, got q {tuple(q.shape)}")
    softcap = _softcap(softcap)
    if not isinstance(causal, bool):
        raise FlashAttnTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    _check_alibi(alibi_slopes, q, q.shape[0])
    sink = _learnable_sink(learnable_sink, q)
    with _flash_attn_errors():
        if block_table is not None:
            check_index("block_table", block_table, (q.shape[0], None), q.device)
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        window = _window(window_size, capacity, causal)
        scale = q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale
        O, L = kvcache.kvcache_attention(
            q.transpose(1, 2),
            k_cache.transpose(1, 2),
            v_cache.transpose(1, 2),
            cache_seqlens,
            k=None if k is None else k.transpose(1, 2),
            v=None if v is None else v.transpose(1, 2),
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved,
            block_table=block_table,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            scale=scale,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sink=sink,
            num_splits=num_splits,
            backend=backend,
        )
    out = O.transpose(1, 2)
    return (out, L) if return_softmax_lse else out


def _flash_attn_varlen_paged(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    learnable_sink,
    return_attn_probs,
    block_table,
    backend,
):
    """flash_attn_varlen_func with a block table: the packed queries against each sequence's pages, by the
    backend's KV-cache kernels; sequence s has cu_seqlens_k[s + 1] - cu_seqlens_k[s] keys."""
    _check_tensors(q, q, q, varlen=True)
    sink = _learnable_sink(learnable_sink, q)
    for name, t in (("k", k_cache), ("v", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise FlashAttnValueError(
                f"with block_table, {name} must have shape (num_blocks, page_block_size, nheads_k, headdim), got "
                f"{tuple(t.shape)}"
            )
    batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    softcap = _softcap(softcap)
    _check_dropout(dropout_p, softcap)
    _check_alibi(alibi_slopes, q, batch)
    if not isinstance(causal, bool):
        raise FlashAttnTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    window = _window(window_size, max_seqlen_k, causal)
    scale = q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale
    with _flash_attn_errors():
        O, L = varlen_attention(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=scale,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sink=sink,
            block_table=block_table,
            backend=backend,
        )
    return (O, L, None) if return_attn_probs else O


def _flash_attn(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    learnable_sink,
    return_attn_probs,
    backend,
):
    _check_tensors(q, k, v)
    sink = _learnable_sink(learnable_sink, q)
    head_dim = q.shape[-1]
    q, k, v, scale, window, softcap = _options(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, q.shape[0], k.shape[1]
    )
    O, L = attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sink=sink,
        backend=backend,
    )
    out = O.transpose(1, 2)[..., :head_dim]
    return (out, L, None) if return_attn_probs else out


def _flash_attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    learnable_sink,
    return_attn_probs,
    backend,
):
    _check_tensors(q, k, v, varlen=True)
    sink = _learnable_sink(learnable_sink, q)
    batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    head_dim = q.shape[-1]
    q, k, v, scale, window, softcap = _options(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch, max_seqlen_k
    )
    try:
        out, lse = varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=scale,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sink=sink,
            backend=backend,
        )
    except ValueError as e:
        # Past the checks above, fa2.varlen_attention's own (the offsets' totals) and a backend's (fa2-pytorch:
        # decreasing offsets), which flash-attn does not make.
        if isinstance(e, FlashAttnValueError):
            raise
        raise FlashAttnValueError(str(e)) from e
    out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def _options(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, batch: int, seqlen_k: int):
    """The checks and normalisations the dense and varlen functions share, in flash-attn's order: (q, k, v
    padded along headdim to a multiple of 8 (the kernels' unit; the output is cut back), scale, window,
    softcap). batch: the batch size (varlen: the number of sequences), for the ALiBi slopes' shape;
    seqlen_k: what a window side is compared against (varlen: max_seqlen_k)."""
    softcap = _softcap(softcap)
    _check_dropout(dropout_p, softcap)
    _check_alibi(alibi_slopes, q, batch)
    if not isinstance(causal, bool):
        raise FlashAttnTypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    window = _window(window_size, seqlen_k, causal)
    head_dim = q.shape[-1]
    # flash-attn's default, head_dim ** -0.5 of the unpadded head dim (1 / sqrt(d) can differ in the last bit).
    scale = head_dim ** (-0.5) if softmax_scale is None else softmax_scale
    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    return q, k, v, scale, window, softcap


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q: torch.Tensor) -> int:
    """flash-attn's mha_varlen_fwd checks (int32, contiguous, (batch_size + 1,), on q's device); returns
    batch_size."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise FlashAttnTypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise FlashAttnTypeError(f"{name} must have dtype int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise FlashAttnValueError(f"{name} must have shape (batch_size + 1,), got {tuple(cu.shape)}")
        if not cu.is_contiguous():
            raise FlashAttnValueError(f"{name} must be contiguous, got stride {cu.stride()}")
        if cu.device != q.device:
            raise FlashAttnValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise FlashAttnValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have shape (batch_size + 1,), got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    return cu_seqlens_q.numel() - 1


def _max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        raise FlashAttnTypeError(
            f"{name} must be a Python int, got a tensor (flash-attn takes an int; reading a device tensor "
            f"would synchronise): pass int({name})"
        )
    if isinstance(value, bool) or not is_integer(value):
        raise FlashAttnTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise FlashAttnValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_tensors(q, k, v, varlen: bool = False) -> None:
    """The dense layout (batch_size, seqlen, nheads, headdim), or varlen's (total, nheads, headdim)."""
    layout = "(total, nheads, headdim)" if varlen else "(batch_size, seqlen, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != (3 if varlen else 4):
            raise FlashAttnValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dtype not in _DTYPES:
        raise FlashAttnTypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FlashAttnTypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise FlashAttnValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    heads, head_dim = q.shape[-2:]
    if varlen:
        if k.shape != v.shape or k.shape[2] != head_dim:
            raise FlashAttnValueError(
                f"k and v must have shape (total_k, nheads_k, headdim) with q's headdim, got {shapes}"
            )
    else:
        batch = q.shape[0]
        if batch == 0:
            raise FlashAttnValueError(f"batch size must be positive, got {shapes}")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
            raise FlashAttnValueError(
                f"k and v must have shape (batch_size, seqlen_k, nheads_k, headdim) with q's batch_size and "
                f"headdim, got {shapes}"
            )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise FlashAttnValueError(f"headdim must be from 1 to {MAX_HEAD_DIM}, got {head_dim} ({shapes})")
    if k.shape[-2] == 0 or heads % k.shape[-2]:
        raise FlashAttnValueError(
            f"the number of heads in key/value must divide the number of heads in query, got {shapes}"
        )


def _check_packed(name: str, x, n: int, layout: str, dim: int = 2) -> None:
    """x packs n tensors along ``dim`` (2 for the dense layouts, 1 for varlen's), of rank dim + 3."""
    if not isinstance(x, torch.Tensor):
        raise FlashAttnTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim + 3 or x.shape[dim] != n:
        raise FlashAttnValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")


def _check_dropout(dropout_p, softcap: float) -> None:
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise FlashAttnTypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}") from None
    if not 0.0 <= p < 1.0:
        raise FlashAttnValueError(f"dropout_p must be in [0, 1), got {p}")
    if p > 0.0 and softcap > 0.0:
        raise FlashAttnValueError(
            f"softcapping does not support dropout (as flash-attn), got dropout_p={p} and softcap={softcap}"
        )
    if p > 0.0:
        raise NotImplementedError(
            f"fa2.flash_attn does not support dropout_p={p}: fa2 has no attention dropout; pass dropout_p=0.0"
        )


def _softcap(softcap) -> float:
    with _flash_attn_errors():
        return check_softcap(softcap)


def _check_alibi(slopes, q: torch.Tensor, batch: int) -> None:
    """batch: the batch size (varlen: the number of sequences)."""
    if slopes is None:
        return
    if not isinstance(slopes, torch.Tensor):
        raise FlashAttnTypeError(f"alibi_slopes must be a float32 torch.Tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise FlashAttnTypeError(f"alibi_slopes must have dtype float32, got {slopes.dtype}")
    if slopes.device != q.device:
        raise FlashAttnValueError(f"alibi_slopes must be on q's device {q.device}, got {slopes.device}")
    heads = q.shape[-2]
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise FlashAttnValueError(
            f"alibi_slopes must have shape (nheads,) = ({heads},) or (batch_size, nheads) = ({batch}, {heads}), "
            f"got {tuple(slopes.shape)}"
        )


def _learnable_sink(sink, q: torch.Tensor) -> torch.Tensor | None:
    """flash-attn 4's learnable_sink, (nheads,) float16, bfloat16 or float32 (flash-attn 4's dtypes), as fa2's
    float32 sink: a differentiable cast, so that its gradient comes back in its own dtype. q: in flash-attn's
    layout, its heads at dim -2."""
    if sink is None:
        return None
    if isinstance(sink, torch.Tensor) and sink.dtype not in _DTYPES:
        raise FlashAttnTypeError(f"learnable_sink must be float16, bfloat16 or float32, got {sink.dtype}")
    with _flash_attn_errors():
        return check_sink(
            sink.float() if isinstance(sink, torch.Tensor) else sink, q.transpose(-3, -2), "learnable_sink"
        )


def _window(window_size, seqlen_k: int, causal: bool) -> tuple[int, int]:
    """flash-attn's normalisation (mha_fwd): ints (0-d integer tensors int()'d), a side >= seqlen_k becomes
    -1, then causal sets the right side to 0. Varlen (mha_varlen_fwd) compares against max_seqlen_k, and
    sets the right side to 0 first: the same pair, but where max_seqlen_k = 0 (no key anywhere)."""
    with _flash_attn_errors():
        left, right = (-1 if side >= seqlen_k else side for side in check_window(window_size, "window_size"))
    return (left, 0) if causal else (left, right)


@contextlib.contextmanager
def _flash_attn_errors():
    """fa2.validation's checks, their TypeError and ValueError raised as this module's RuntimeError-compatible ones
    (the same message)."""
    try:
        yield
    except TypeError as e:
        raise FlashAttnTypeError(str(e)) from None
    except ValueError as e:
        raise FlashAttnValueError(str(e)) from None
