"""FlashAttention-2's forward in fa2-triton: ``flash_attn_forward`` checks the inputs, allocates O and L and
launches a forward kernel: ``forward_gluon``'s warp-specialised Hopper kernel (Gluon) where
``forward_gluon.uses_gluon`` says it takes the inputs and the GPU can run it, by the inputs and the device
alone; everywhere else ``forward_tl._attn_fwd`` (``triton.language``; its docstring says how it computes and
what it takes). An error in one kernel is raised, never retried on the other.

``launch_kernel`` makes the launch: the tiles and levers from ``tiles.tiles_for`` (an entry that asks for warp
specialisation is passed over where ``tiles.ws_layout`` says the inputs cannot take it); how the kernel
reaches memory, through host tensor descriptors where ``tiles.tma_layout`` allows them and the tiles ask for
them (``_descriptor``), through descriptors built in the kernel for the warp-specialised loop and for a packed
batch, or by pointer loads (a short call, ``tiles.short_call``, at the default tiles: it is bound by the host,
which a descriptor costs more time than the kernel saves); the spec as the kernel's arguments
(``common.score_args``); one program per (query tile, batch·head), on one grid axis. Launches go through
``fa2_triton.launch``, which reuses the compiled kernel for arguments of one class and so spends less host
time per call than ``kernel[grid](...)``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fa2.spec import AttentionSpec
from fa2_triton import forward_gluon
from fa2_triton.common import LOG2_E, MAX_HEAD_DIM, check_device, group_size, packed, score_args
from fa2_triton.forward_tl import _attn_fwd
from fa2_triton.launch import Plans, arg_classes, copy_descriptor, launch, on_device, scratch_allocator
from fa2_triton.tiles import Tiles, short_call, tiles_for, tma_layout, ws_layout


def _descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A (B, H, N, D) descriptor of blocks [1, 1, block_rows, D]. A dimension of length one gets the stride
    it would have if t were contiguous there: any stride reaches the same elements, and this one is valid."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    return TensorDescriptor(t, list(t.shape), strides, [1, 1, block_rows, t.shape[-1]])


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to
            key/value head h // (heads // heads_k). Any strides. CUDA tensors, or CPU tensors when this
            module was imported with TRITON_INTERPRET=1. head_dim: a multiple of 8 from 8 to 256.
        spec: what to compute (``fa2.spec.AttentionSpec``): the scale; the window (left, right), -1
            unbounded, bottom-right aligned, key j visible to query i iff i + seqlen_k - seqlen_q - left <= j
            <= i + seqlen_k - seqlen_q + right; causal is (-1, 0), and with seqlen_q = 2, seqlen_k = 5::

                causal (-1, 0):   1 1 1 1 0        window (1, 0):   0 0 1 1 0
                                  1 1 1 1 1                         0 0 0 1 1

            the softcap (scores become softcap · tanh(scores / softcap), in fp32), ALiBi slopes ((batch,
            heads) float32 on q's device, any strides: -slope · |i + seqlen_k - seqlen_q - j| is added to
            the capped scores), the sink ((heads,) float32 on q's device: sink[h] joins every row's softmax
            denominator and L, no numerator). Each becomes a compile-time switch of the kernel; the window's
            sizes and the softcap stay runtime values, so windows of any size share a compilation. A packed batch
            (spec.cu_seqlens_q, cu_seqlens_k: (num_seqs + 1,) int32 offsets on q's device, max_seqlen_q,
            max_seqlen_k): q (1, heads, total_q, head_dim), k, v (1, heads_k, total_k, head_dim), sequence s
            the rows [cu_seqlens[s], cu_seqlens[s + 1]), every mask and bias aligned per sequence, slopes
            (num_seqs, heads). The offsets are read by the kernel, never by the host, so nothing checks
            the ones fa2.varlen_attention does not; each program clamps its sequence's offsets into
            [0, total], so wrong ones give wrong rows, never accesses outside the tensors: a sequence whose
            offsets decrease is empty, rows that two sequences claim are written twice, and rows past
            max_seqlen_q in a sequence are not written.
        tiles: BLOCK_M, BLOCK_N (powers of two >= 16), num_warps, num_stages and the levers of the tl
            kernel; default ``tiles_for`` (for a packed batch at max_seqlen_k, passing over warp
            specialisation), or the Gluon kernel where it takes the inputs. Given tiles always run the tl
            kernel (the tuners time it).

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype, contiguous. L: (batch, heads, seqlen_q), float32,
        natural log of the final scores' sum (and exp(sink[h])); rows that see no key get O = 0 and L = +inf
        (L = sink[h] with a sink). A packed batch:
        (1, heads, total_q, head_dim) and (1, heads, total_q).

    Raises:
        NotImplementedError: head_dim not a multiple of 8 from 8 to 256; bfloat16 under the interpreter.
        RuntimeError: tensors on a device this build of the kernel cannot run on.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    check_device(q)
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-triton supports head_dim a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}"
        )

    # side-by-side: dispatch
    if tiles is None and forward_gluon.uses_gluon(q, k, v, spec):
        return forward_gluon.flash_attn_forward(q, k, v, spec)
    # side-by-side: end
    O = torch.empty(batch, heads, seqlen_q, head_dim, device=q.device, dtype=q.dtype)
    L = torch.empty(batch, heads, seqlen_q, device=q.device, dtype=torch.float32)
    if O.numel() == 0:
        return O, L
    launch_kernel(q, k, v, O, L, spec, tiles)
    return O, L


class _Plan(NamedTuple):
    """Everything ``launch_kernel`` works out from the inputs' shapes, strides, dtypes, alignment and the spec,
    but for the tensors themselves: kept per class of inputs (``_PLANS``)."""

    use_tma: bool
    device_desc: bool
    # Q's, K's, V's and O's descriptors but for their base (TensorDescriptor's fields), with use_tma.
    descriptors: tuple[dict, ...] | None
    grid: int
    scalars: tuple
    constexprs: dict
    options: dict
    # The launch's argument classes (``fa2_triton.launch.arg_classes``), once a launch has met them.
    classes: tuple | None = None


# (shapes, strides, dtype, device, 16-byte alignment of every tensor argument, the spec's scale, window,
# softcap and sink) -> _Plan, for the inputs the plans serve (``launch_kernel``).
_PLANS = Plans()


def launch_kernel(q, k, v, O, L, spec: AttentionSpec, tiles: Tiles | None = None):
    """Runs the tl kernel into O and L (both written in full); returns what the launch returns (on a GPU the
    compiled kernel, whose n_regs and n_spills the tuner records; None if there is nothing to launch).
    q, k, v, spec and tiles as ``flash_attn_forward``'s (q (batch, heads, seqlen_q, head_dim), k and v
    (batch, heads_k, seqlen_k, head_dim); packed, batch 1 and total rows); O: q's shape and dtype, L:
    (batch, heads, seqlen_q) float32, both allocated by the caller.

    Dense inputs without ALiBi at the default tiles (what training and prefill calls are) keep their
    ``_plan`` per class of inputs, keyed on everything it reads, tensor descriptors included: a short
    call's host time is mostly this planning and the launch's classification of its 28 arguments.
    """
    sink = spec.sink
    key = None
    if tiles is None and not spec.varlen and spec.alibi_slopes is None:
        key = (
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            v.shape,
            v.stride(),
            q.dtype,
            q.device,
            q.data_ptr() % 16,
            k.data_ptr() % 16,
            v.data_ptr() % 16,
            O.data_ptr() % 16,
            L.data_ptr() % 16,
            spec.scale,
            spec.window,
            spec.softcap,
            None if sink is None else sink.data_ptr() % 16,
        )
        plan = _PLANS.get(key)
    if key is None or plan is None:
        plan = _plan(q, k, v, O, L, spec, tiles)
        if plan is None:
            return None
    if plan.use_tma:
        q_arg, k_arg, v_arg, o_arg = (
            copy_descriptor(TensorDescriptor, d, t) for d, t in zip(plan.descriptors, (q, k, v, O))
        )
    else:
        q_arg, k_arg, v_arg, o_arg = q, k, v, O
    cu_q, cu_k = (spec.cu_seqlens_q, spec.cu_seqlens_k) if spec.varlen else (L, L)
    slopes = spec.alibi_slopes
    args = (
        q_arg,
        k_arg,
        v_arg,
        o_arg,
        L,
        L if slopes is None else slopes,
        L if sink is None else sink,
        cu_q,
        cu_k,
        *plan.scalars,
    )
    if key is not None and plan.classes is None:
        plan = _PLANS.keep(key, plan._replace(classes=arg_classes(args)))
    # The kernel's own descriptors live in global memory that Triton asks its allocator for.
    with on_device(q.device), scratch_allocator() if plan.device_desc else contextlib.nullcontext():
        return launch(_attn_fwd, plan.grid, args, plan.constexprs, plan.options, plan.classes)


def _plan(q, k, v, O, L, spec: AttentionSpec, tiles: Tiles | None) -> _Plan | None:
    """The launch of ``launch_kernel``'s inputs: None if there is nothing to launch (a packed batch of no query)."""
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    group = group_size(q, k)
    HEAD_DIM = max(16, triton.next_power_of_2(head_dim))
    masked = spec.masked
    batch, seqlen_q, seqlen_k, _, _ = packed(spec, batch, seqlen_q, seqlen_k, L)
    # A short call at the default tiles reads through pointers: its kernel takes less time than the host
    # spends on descriptors (``tiles.short_call``), the warp-specialised loop's (built in the kernel) too.
    short = tiles is None and not spec.varlen and short_call(q, k)
    if spec.varlen and not seqlen_q:
        return None
    if spec.varlen or short:
        # A packed batch: one key loop over whole tiles, which warp specialisation needs, is not what
        # sequences of any length have.
        def can_specialize(tiles):
            return False

    else:
        can_specialize = functools.partial(ws_layout, q, k, v, masked, HEAD_DIM)
    if tiles is None:
        tiles = tiles_for(HEAD_DIM, q.dtype, masked, seqlen_k, can_specialize)
        # tiles_for has passed over every warp-specialised entry that these inputs cannot take.
        warp_specialize = tiles.warp_specialize
    else:
        warp_specialize = can_specialize(tiles)
    s = score_args(spec, q.dtype)
    fused_exp2 = tiles.exp2 and tiles.fused_exp2 and s.qk_scale > 0
    # The ALiBi bias is subtracted in qk's units: log2 units, or with the fused exp2 before qk_scale.
    alibi_scale = LOG2_E / s.qk_scale if fused_exp2 else LOG2_E
    qk_scale = s.qk_scale
    if not tiles.exp2:
        # Natural units: qk_scale and ALiBi without log2(e).
        if spec.sink is not None:
            raise NotImplementedError("fa2-triton's forward without exp2 (tiles.exp2=False) takes no sink")
        qk_scale, alibi_scale = qk_scale / LOG2_E, 1.0
    # A packed batch reads through descriptors built in the kernel, bounded by each sequence (a host
    # descriptor's bounds are the packed tensor's, and its tiles would cross into the next sequence).
    # side-by-side: descriptors
    device_desc = warp_specialize or (spec.varlen and tiles.tma and tma_layout(q, k, v, HEAD_DIM))
    if not device_desc and tiles.tma and not short and tma_layout(q, k, v, HEAD_DIM):
        use_tma = True
        descriptors = tuple(
            {**_descriptor(t, rows).__dict__, "base": None}
            for t, rows in ((q, tiles.block_m), (k, tiles.block_n), (v, tiles.block_n), (O, tiles.block_m))
        )
    else:
        use_tma = False
        descriptors = None
    # side-by-side: end
    # One program per (query tile, batch·head), on one grid axis: CUDA caps the other two at 65535, and
    # (batch, seqlen, head_dim) inputs arrive with the batch as heads.
    grid = triton.cdiv(seqlen_q, tiles.block_m) * batch * heads
    scalars = (
        qk_scale,
        s.cap_scale,
        alibi_scale,
        s.window_left,
        s.window_right,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *O.stride(),
        *L.stride(),
        *s.slope_strides,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        q.shape[2],
        k.shape[2],
        head_dim,
    )
    constexprs = dict(
        WINDOW_LEFT=s.WINDOW_LEFT,
        WINDOW_RIGHT=s.WINDOW_RIGHT,
        SOFTCAP=s.SOFTCAP,
        ALIBI=s.ALIBI,
        HAS_SINK=spec.sink is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        HEAD_DIM=HEAD_DIM,
        EVEN_D=HEAD_DIM == head_dim,
        USE_TMA=use_tma,
        FUSED_EXP2=fused_exp2,
        LAZY_RESCALE=tiles.lazy_rescale,
        GRID_ORDER=tiles.grid_order,
        WARP_SPECIALIZE=warp_specialize,
        VARLEN=spec.varlen,
        DEVICE_DESC=device_desc,
        EXP2=tiles.exp2,
        SPLIT_LOOP=tiles.split_loop,
    )
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.maxnreg)
    return _Plan(use_tma, bool(device_desc), descriptors, grid, scalars, constexprs, options)
