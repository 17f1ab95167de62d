"""FlashAttention-2's backward in fa2-triton: ``flash_attn_backward`` checks the inputs, allocates the
gradients and launches the backward kernels of ``backward_tl`` (``triton.language``; its docstring says how
they compute and what they take): the preprocess (delta = rowsum(dO ∘ O)), then the dQ kernel and the dK/dV
kernel, or with ``deterministic=False`` the dK/dV kernel alone, adding dQ into an fp32 accumulator with
atomics.

Where ``backward_gluon.uses_gluon`` says so (a Hopper GPU, inputs it takes, a head_dim of
``backward_gluon.ENABLED``: 64 and 128 unless FA2_TRITON_GLUON_BACKWARD=0; default tiles; not a short call,
``tiles.short_call``), the dK/dV step
runs ``backward_gluon``'s warp-specialised kernel instead of the tl one, beside the tl preprocess and a dQ
kernel, in both modes (with ``deterministic=False`` too: the Gluon kernel adds no dQ). Where
``backward_gluon.uses_gluon_dq`` says so (the same, with a head_dim of ``backward_gluon.DQ_ENABLED``: 64 and
128 unless FA2_TRITON_GLUON_DQ=0; causal only with seqlen_k >= seqlen_q), dq comes from ``backward_gluon``'s
dQ kernel instead of the tl one, in both modes too (the dK/dV step then adds no dQ, whichever kernel runs
it). An error in a Gluon kernel is
raised, never retried on tl.

A short call (``tiles.short_call``: its time is the host's) at the default tiles, deterministic and without a
sink, runs all of it in one launch instead (``launch_short``): the dK/dV and dQ kernels' programs in one grid,
each computing its delta from O.

Each launcher (``launch_preprocess``, ``launch_dq``, ``launch_dkdv``) runs one kernel, so that the tuner
(``python -m fa2_triton.tuning.backward``) can time them apart; each kernel's tiles come from
``tiles.bwd_tiles_for``, the spec as the kernels' arguments from ``common.score_args``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fa2.spec import AttentionSpec
from fa2_triton import backward_gluon
from fa2_triton.backward_tl import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, _attn_bwd_short
from fa2_triton.common import MAX_HEAD_DIM, cdiv, check_device, group_size, packed, padded_head_dim, score_args
from fa2_triton.launch import Plans, arg_classes, launch_planned, on_device
from fa2_triton.tiles import PREPROCESS_ELEMENTS, BwdTiles, KernelTiles, bwd_tiles_for, short_call


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    tiles: BwdTiles | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to
            key/value head h // (heads // heads_k). Any strides.
        O, dO: (batch, heads, seqlen_q, head_dim); L: (batch, heads, seqlen_q), float32, natural log,
            from the forward (+inf on rows that see no key).
        spec: what the forward computed (``fa2.spec.AttentionSpec``: scale, window, softcap, ALiBi, sink), as
            in ``flash_attn_forward``. The softcap's gradient multiplies dS by 1 - tanh² of the scaled score
            over softcap; ALiBi adds nothing to it, and the slopes get no gradient. A sink changes nothing in
            dq, dk, dv (P = exp(S - L) with the L that includes it) and gets its own gradient.
        tiles: each kernel's tiles (powers of two >= 16), num_warps, num_stages, maxnreg; default
            ``bwd_tiles_for``. Given tiles always run the tl kernels (the tuner times them).
        deterministic: True (the default) computes dq in its own kernel, every element written once, so
            that the same inputs give the same bits. False adds dq into a zeroed fp32 accumulator from the
            dK/dV kernel with atomics instead (as FA2's CUDA kernel): S and dP are computed once instead of
            twice, but the order of the additions, and so the last bits of dq, vary from run to run. Where
            the Gluon dK/dV kernel or the Gluon dQ kernel runs (``backward_gluon.uses_gluon``,
            ``uses_gluon_dq``), dq comes from a dQ kernel in both modes.

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v (dk, dv: (batch, heads_k, seqlen_k, head_dim), each
        key/value head's the sum over the query heads of its group), contiguous; rows that see no key get
        dq = 0, keys that no row sees dk = dv = 0. Query tiles that see no key of a key tile, and key tiles
        that a query tile's window misses, are skipped, not loaded. With spec.sink, a fourth: dsink =
        -Σ_{batch, rows i} exp(sink[h] - L_i) · rowsum(dO_i ∘ O_i), (heads,) float32, from the preprocess
        beside delta (a packed batch: every sequence's rows).

    Raises:
        NotImplementedError: head_dim not a multiple of 8 from 8 to 256; bfloat16 under the interpreter.
        RuntimeError: tensors on a device this build of the kernels cannot run on.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    check_device(q)
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-triton supports head_dim a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}"
        )

    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    default_tiles = tiles is None
    tiles = tiles or bwd_tiles_for(
        head_dim, q.dtype, spec.masked, spec.max_seqlen_k if spec.varlen else seqlen_k, spec.varlen
    )
    if default_tiles and deterministic and spec.sink is None and q.shape[1] and short_call(q, k):
        # A short call's time is the host's: one launch (``launch_short``) instead of three.
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        with on_device(q.device):
            launch_short(q, k, v, O, dO, L, dq, dk, dv, spec, tiles)
        return dq, dk, dv
    gluon = default_tiles and backward_gluon.uses_gluon(q, k, v, spec)
    gluon_dq = default_tiles and backward_gluon.uses_gluon_dq(q, k, v, spec)
    if gluon or gluon_dq:
        # The Gluon kernels' copies read whole rows of (batch·heads·seqlen, head_dim): q, k, v with the heads
        # interleaved (a transformers model's, which ``takes`` accepts) are copied once for both kernels.
        q, k, v = (t.contiguous() for t in (q, k, v))
    with on_device(q.device):
        delta, dsink = launch_preprocess(O, dO, L, spec.sink)
        if deterministic or gluon or gluon_dq:
            dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
            if gluon_dq:
                backward_gluon.flash_attn_dq(q, k, v, dO, L, delta, dq, spec)
            else:
                launch_dq(q, k, v, dO, L, delta, dq, spec, tiles.dq)
            if gluon:
                backward_gluon.flash_attn_dkdv(q, k, v, dO, L, delta, dk, dv, spec)
            else:
                launch_dkdv(q, k, v, dO, L, delta, dk, dv, None, spec, tiles.dkdv)
        else:
            # Padded to whole query tiles and to HEAD_DIM, so the atomic adds need no mask (a packed batch's
            # last tile of a sequence adds zeros into the next one's rows, its last one into the padding).
            HEAD_DIM = padded_head_dim(head_dim)
            if spec.varlen:
                padded_q = seqlen_q + tiles.dkdv.block_m
            else:
                padded_q = cdiv(seqlen_q, tiles.dkdv.block_m) * tiles.dkdv.block_m
            dq_acc = torch.zeros(batch, heads, padded_q, HEAD_DIM, device=q.device, dtype=torch.float32)
            launch_dkdv(q, k, v, dO, L, delta, dk, dv, dq_acc, spec, tiles.dkdv)
            dq = (dq_acc[:, :, :seqlen_q, :head_dim] * spec.scale).to(q.dtype)
    if dsink is not None:
        return dq, dk, dv, dsink
    return dq, dk, dv


# The launchers below run one kernel each, on the current CUDA device (the tuner times them apart), and
# return what the launch returns: on a GPU the compiled kernel, whose n_regs and n_spills the tuner
# records; None if there is nothing to launch. One program per tile and batch·head, on one grid axis each
# (CUDA caps the other two at 65535). Each keeps its launch but for the tensors per class of inputs
# (``_PLANS``): a training step's backward classified its three launches' ~130 arguments on every call.


class _Launch(NamedTuple):
    """One kernel's launch but for its tensor arguments, which come first."""

    grid: int
    # The arguments after the tensors, and their classes (``fa2_triton.launch.arg_classes``).
    scalars: tuple
    scalar_classes: tuple
    constexprs: dict
    options: dict


# (kernel, the shapes and strides of its tensors, dtype, device, the spec's scale, window and softcap, the
# ALiBi slopes' strides, a packed batch's sequences and longest lengths, the tiles) -> _Launch, or None where
# there is nothing to launch: everything a launch's scalars, constexprs and their classes depend on. The
# tensors' classes (dtype, 16-byte alignment) are taken on every call (``launch_planned``).
_PLANS = Plans()


def _plan(key: tuple, build, *args) -> _Launch | None:
    """``build(*args)``, kept under ``key`` (see ``_PLANS``)."""
    try:
        return _PLANS[key]
    except KeyError:
        pass
    return _PLANS.keep(key, build(*args))


def _run(kernel, plan: _Launch, tensors: tuple):
    """Launches ``kernel`` on ``tensors`` and the plan's scalars."""
    return launch_planned(kernel, plan.grid, tensors, plan.scalars, plan.scalar_classes, plan.constexprs, plan.options)


def _spec_key(spec: AttentionSpec) -> tuple:
    """What the backward's launches read of the spec, but for its tensors."""
    slopes = spec.alibi_slopes
    return (
        spec.scale,
        spec.window,
        spec.softcap,
        None if slopes is None else slopes.stride(),
        None if not spec.varlen else (spec.cu_seqlens_q.numel(), spec.max_seqlen_q, spec.max_seqlen_k),
    )


def launch_preprocess(
    O: torch.Tensor, dO: torch.Tensor, L: torch.Tensor | None = None, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(delta, dsink): delta = rowsum(dO ∘ O), (batch, heads, seqlen_q), float32; with sink ((heads,)
    float32) and L (the forward's, (batch, heads, seqlen_q)), dsink = -Σ_{b, i} exp(sink[h] - L[b, h, i]) ·
    delta[b, h, i], (heads,) float32, else None. The kernel writes one partial sum per program; a torch sum
    over each head's adds them in a fixed order, so dsink is deterministic."""
    batch, heads, seqlen_q, head_dim = O.shape
    delta = torch.empty(batch, heads, seqlen_q, device=O.device, dtype=torch.float32)
    key = ("preprocess", O.shape, O.stride(), dO.stride(), None if L is None else L.stride(), sink is None)
    plan = _plan(key, _preprocess_plan, O, dO, L, sink, delta)
    if sink is None:
        parts = None
    else:
        parts = torch.empty(heads, plan.grid // heads if plan else 0, device=O.device, dtype=torch.float32)
    if plan is not None:
        _run(
            _attn_bwd_preprocess,
            plan,
            (
                O,
                dO,
                delta,
                delta if L is None else L,
                delta if sink is None else sink,
                delta if parts is None else parts,
            ),
        )
    return delta, None if parts is None else parts.sum(dim=1)


def _preprocess_plan(O, dO, L, sink, delta) -> _Launch | None:
    batch, heads, seqlen_q, head_dim = O.shape
    if not (batch * heads and seqlen_q):
        return None
    HEAD_DIM = padded_head_dim(head_dim)
    pre_block_m = PREPROCESS_ELEMENTS // HEAD_DIM
    scalars = (*O.stride(), *dO.stride(), *(delta if L is None else L).stride(), heads, seqlen_q, head_dim)
    return _Launch(
        cdiv(seqlen_q, pre_block_m) * batch * heads,
        scalars,
        arg_classes(scalars),
        dict(HAS_SINK=sink is not None, BLOCK_M=pre_block_m, HEAD_DIM=HEAD_DIM, EVEN_D=HEAD_DIM == head_dim),
        dict(num_warps=8),
    )


def launch_dq(q, k, v, dO, L, delta, dq, spec: AttentionSpec, t: KernelTiles):
    """The dQ kernel into dq (written in full)."""
    key = (
        "dq",
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        dO.stride(),
        L.stride(),
        delta.stride(1),
        dq.stride(),
        q.dtype,
        _spec_key(spec),
        t,
    )
    plan = _plan(key, _dq_plan, q, k, v, dO, L, delta, dq, spec, t)
    if plan is None:
        return None
    slopes = spec.alibi_slopes
    cu_q, cu_k = (spec.cu_seqlens_q, spec.cu_seqlens_k) if spec.varlen else (L, L)
    return _run(_attn_bwd_dq, plan, (q, k, v, dO, L, delta, dq, L if slopes is None else slopes, cu_q, cu_k))


def _dq_plan(q, k, v, dO, L, delta, dq, spec: AttentionSpec, t: KernelTiles) -> _Launch | None:
    batch, heads, seqlen_q, head_dim = q.shape
    HEAD_DIM = padded_head_dim(head_dim)
    batch, seqlen_q, seqlen_k, _, _ = packed(spec, batch, seqlen_q, k.shape[2], L)
    if not (batch * heads and seqlen_q):
        return None
    a = score_args(spec, q.dtype)
    scalars = (
        spec.scale,
        a.qk_scale,
        a.cap_scale,
        a.window_left,
        a.window_right,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dO.stride(),
        *L.stride(),
        *dq.stride(),
        *a.slope_strides,
        delta.stride(1),
        heads,
        group_size(q, k),
        seqlen_q,
        seqlen_k,
        q.shape[2],
        k.shape[2],
        head_dim,
    )
    return _Launch(
        cdiv(seqlen_q, t.block_m) * batch * heads,
        scalars,
        arg_classes(scalars),
        dict(
            WINDOW_LEFT=a.WINDOW_LEFT,
            WINDOW_RIGHT=a.WINDOW_RIGHT,
            SOFTCAP=a.SOFTCAP,
            ALIBI=a.ALIBI,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            HEAD_DIM=HEAD_DIM,
            EVEN_D=HEAD_DIM == head_dim,
            VARLEN=spec.varlen,
        ),
        dict(num_warps=t.num_warps, num_stages=t.num_stages, maxnreg=t.maxnreg),
    )


def launch_dkdv(q, k, v, dO, L, delta, dk, dv, dq_acc, spec: AttentionSpec, t: KernelTiles):
    """The dK/dV kernel into dk and dv (written in full); with dq_acc (a zeroed fp32 (batch, heads,
    cdiv(seqlen_q, t.block_m) · t.block_m, HEAD_DIM) tensor), also dq / scale added into it atomically.
    One program per key tile and batch·heads_k: each sums its group's query heads into dk and dv."""
    if not q.shape[1]:
        # Key/value heads with no query head (group 0): nothing sees any key, and the kernel divides by GROUP.
        batch, _, seqlen_k, _, _ = packed(spec, q.shape[0], 0, k.shape[2], L)
        if batch * k.shape[1] and seqlen_k:
            dk.zero_()
            dv.zero_()
        return None
    key = (
        "dkdv",
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        dO.stride(),
        L.stride(),
        delta.stride(1),
        dk.stride(),
        dv.stride(),
        None if dq_acc is None else dq_acc.stride(1),
        q.dtype,
        _spec_key(spec),
        t,
    )
    plan = _plan(key, _dkdv_plan, q, k, v, dO, L, delta, dk, dv, dq_acc, spec, t)
    if plan is None:
        return None
    slopes = spec.alibi_slopes
    cu_q, cu_k = (spec.cu_seqlens_q, spec.cu_seqlens_k) if spec.varlen else (L, L)
    return _run(
        _attn_bwd_dkdv,
        plan,
        (
            q,
            k,
            v,
            dO,
            L,
            delta,
            dk,
            dv,
            delta if dq_acc is None else dq_acc,
            L if slopes is None else slopes,
            cu_q,
            cu_k,
        ),
    )


def _dkdv_plan(q, k, v, dO, L, delta, dk, dv, dq_acc, spec: AttentionSpec, t: KernelTiles) -> _Launch | None:
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    group = group_size(q, k)
    HEAD_DIM = padded_head_dim(head_dim)
    batch, seqlen_q, seqlen_k, _, _ = packed(spec, batch, seqlen_q, seqlen_k, L)
    if not (batch * heads_k and seqlen_k):
        return None
    a = score_args(spec, q.dtype)
    scalars = (
        spec.scale,
        a.qk_scale,
        a.cap_scale,
        a.window_left,
        a.window_right,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dO.stride(),
        *L.stride(),
        *dk.stride(),
        *dv.stride(),
        *a.slope_strides,
        delta.stride(1),
        0 if dq_acc is None else dq_acc.stride(1),
        heads,
        group,
        seqlen_q,
        seqlen_k,
        q.shape[2],
        k.shape[2],
        head_dim,
    )
    return _Launch(
        cdiv(seqlen_k, t.block_n) * batch * heads_k,
        scalars,
        arg_classes(scalars),
        dict(
            WINDOW_LEFT=a.WINDOW_LEFT,
            WINDOW_RIGHT=a.WINDOW_RIGHT,
            SOFTCAP=a.SOFTCAP,
            ALIBI=a.ALIBI,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            HEAD_DIM=HEAD_DIM,
            EVEN_D=HEAD_DIM == head_dim,
            ATOMIC_DQ=dq_acc is not None,
            VARLEN=spec.varlen,
            GQA=group > 1,
        ),
        dict(num_warps=t.num_warps, num_stages=t.num_stages, maxnreg=t.maxnreg),
    )


def launch_short(q, k, v, O, dO, L, dq, dk, dv, spec: AttentionSpec, t: BwdTiles):
    """The whole backward in one launch (``backward_tl._attn_bwd_short``) into dq, dk and dv (written in full):
    the dK/dV kernel's programs and the dQ kernel's, each with its own tiles of ``t`` (both at the larger
    num_warps, the dK/dV tiles' num_stages and maxnreg), each computing delta from O and dO. For short calls
    (``tiles.short_call``), whose time is the host's: each launch costs tens of µs of it, the kernels a few µs
    more for reading O once per key tile. Deterministic, no sink (``flash_attn_backward`` sends the rest to
    the three launches)."""
    key = (
        "short",
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        O.stride(),
        dO.stride(),
        L.stride(),
        dq.stride(),
        dk.stride(),
        dv.stride(),
        q.dtype,
        _spec_key(spec),
        t,
    )
    plan = _plan(key, _short_plan, q, k, v, O, dO, L, dq, dk, dv, spec, t)
    if plan is None:
        return None
    slopes = spec.alibi_slopes
    cu_q, cu_k = (spec.cu_seqlens_q, spec.cu_seqlens_k) if spec.varlen else (L, L)
    return _run(_attn_bwd_short, plan, (q, k, v, O, dO, L, dq, dk, dv, L if slopes is None else slopes, cu_q, cu_k))


def _short_plan(q, k, v, O, dO, L, dq, dk, dv, spec: AttentionSpec, t: BwdTiles) -> _Launch | None:
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k = k.shape[1]
    group = group_size(q, k)
    HEAD_DIM = padded_head_dim(head_dim)
    batch, seqlen_q, seqlen_k, _, _ = packed(spec, batch, seqlen_q, k.shape[2], L)
    num_dkdv = cdiv(seqlen_k, t.dkdv.block_n) * batch * heads_k
    num_dq = cdiv(seqlen_q, t.dq.block_m) * batch * heads
    if not num_dkdv + num_dq:
        return None
    a = score_args(spec, q.dtype)
    scalars = (
        spec.scale,
        a.qk_scale,
        a.cap_scale,
        a.window_left,
        a.window_right,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *O.stride(),
        *dO.stride(),
        *L.stride(),
        *dq.stride(),
        *dk.stride(),
        *dv.stride(),
        *a.slope_strides,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        q.shape[2],
        k.shape[2],
        head_dim,
        num_dkdv,
    )
    return _Launch(
        num_dkdv + num_dq,
        scalars,
        arg_classes(scalars),
        dict(
            WINDOW_LEFT=a.WINDOW_LEFT,
            WINDOW_RIGHT=a.WINDOW_RIGHT,
            SOFTCAP=a.SOFTCAP,
            ALIBI=a.ALIBI,
            DKDV_BLOCK_M=t.dkdv.block_m,
            DKDV_BLOCK_N=t.dkdv.block_n,
            DQ_BLOCK_M=t.dq.block_m,
            DQ_BLOCK_N=t.dq.block_n,
            HEAD_DIM=HEAD_DIM,
            EVEN_D=HEAD_DIM == head_dim,
            VARLEN=spec.varlen,
            GQA=group > 1,
        ),
        dict(
            num_warps=max(t.dkdv.num_warps, t.dq.num_warps),
            num_stages=t.dkdv.num_stages,
            maxnreg=t.dkdv.maxnreg,
        ),
    )
