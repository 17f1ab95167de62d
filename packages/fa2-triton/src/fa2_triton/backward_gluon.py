"""fa2-triton's Hopper dK/dV and dQ kernels in Gluon (``triton.experimental.gluon``): warp-specialised, on warpgroup
MMA.

The backward's dK/dV step (``backward_tl._attn_bwd_dkdv``'s work) written down as FlashAttention-3's
backward does it, where the tl kernel leaves the schedule to Triton's compiler. One CTA per 128 keys of a
(batch, key/value head) has three partitions:

- a loader warp that issues every copy by TMA: K's and V's two 64-row halves once, then Q with its rows of L
  and dO with its rows of delta (the preprocess's rowsum(dO ∘ O)), tile after tile (``BLOCK_M`` query rows:
  128 at head_dim 64, 64 at 128), into a
  ring of ``STAGES`` shared-memory buffers, each with a ready mbarrier the copies complete (one for Q and L,
  one for dO and delta, so that Sᵀ can start before dO lands) and an empty one that both consumers arrive
  at once they have read the buffer;
- two consumer warpgroups, 64 keys each, with their dK and dV in registers. A step, for query tile i::

      Sᵀ  = K Q_iᵀ,  dPᵀ = V dO_iᵀ                    warpgroup MMAs, K, V, Q, dO from shared memory
      Pᵀ  = exp2(Sᵀ · scale · log2(e) - L_i · log2(e))  (L in natural log, as the forward writes it)
      dV += Pᵀ dO_i                                    Pᵀ from registers, as the forward feeds P
      dSᵀ = Pᵀ ∘ (dPᵀ - delta_i)
      dK += dSᵀ Q_i                                    dSᵀ from registers

  L and delta are read from shared memory when needed (as plain global loads, their addresses kept across
  the loop made the consumers spill). At the end dK is multiplied by the softmax scale; dK and dV are
  staged in the consumer's K and V buffers (free once its last Sᵀ and dPᵀ have completed) and stored by
  TMA.

Grouped-query attention as in the tl kernel: the CTA of key/value head h_k walks the query heads
h_k · group ... h_k · group + group - 1 one after another (a fixed order: deterministic), summing into one
dK and dV. Under causal (bottom-right, as everywhere in fa2) the query tiles that see no key of the CTA's
tile are skipped, not loaded; the tiles across its diagonal are masked (a compare and select a score) by a
copy of the step, the rest run the step without the mask.

The dQ step (``backward_tl._attn_bwd_dq``'s work) is the second kernel here, the forward's schedule
(``forward_gluon``) with the backward's step. One CTA per 128 query rows of a (batch, query head):

- a loader warp copies Q and dO (two 64-row halves each, one per consumer) with their rows of L and delta
  once, then the K and V tiles (``DQ_BLOCK_N`` keys) of key/value head h // group, tile after tile, into a
  ring of ``DQ_STAGES`` buffers (ready mbarriers for K and for V, an empty one both consumers release);
- two consumer warpgroups, 64 query rows each, with their dQ in registers. A step, for key tile j::

      S  = Q K_jᵀ,  dP = dO V_jᵀ                 warpgroup MMAs, Q, dO, K, V from shared memory
      P  = exp2(S · scale · log2(e) - L · log2(e))
      dS = P ∘ (dP - delta)
      dQ += dS K_j                               dS from registers, K_j as it lies (no transpose)

  At the end dQ is multiplied by the softmax scale, staged in the consumer's Q buffer and stored by TMA:
  each element written once, so dq is the same bits run after run. Under causal (bottom-right; seqlen_k >=
  seqlen_q, ``takes_dq``) a query tile loads the key tiles up to its diagonal one and masks that one
  alone, and the query tiles run last first (the longest first), as in the forward.

``backward.flash_attn_backward`` runs the dK/dV kernel (this one or tl's) beside a dQ kernel (this one or
tl's) in both of its modes (with ``deterministic=False`` too, where the tl dK/dV kernel alone would add dQ
by atomics), so dq, dk and dv are the same bits run after run.

Which inputs take it (``takes``): fp16 or bf16; head_dim 64 or 128; no window other than causal, no softcap,
no ALiBi, no packed batch, no KV cache (a sink is fine: it changes nothing here, the preprocess makes its
gradient); seqlen_q and seqlen_k multiples of 128 (the copies are 2-D, over all heads' rows: a tile past a
head's end would read the next head's rows); q, k, v 16-byte aligned and contiguous (batch, heads, seqlen,
head_dim), or with the heads interleaved, (batch, seqlen, heads, head_dim) contiguous as a transformers
model's are, which ``backward.flash_attn_backward`` copies to the first layout once;
batch·heads_k at most 65,535 (the grid's second axis). dO, L and delta are copied where they are not
contiguous and 16-byte aligned. ``uses_gluon`` adds the device (a Hopper GPU, compute capability 9.0,
with Gluon's Hopper API, not the interpreter) and ``ENABLED``, the head dims it is on for: 64 and 128
(measured on the H200), none with FA2_TRITON_GLUON_BACKWARD=0. The dQ kernel's switch is its own,
``uses_gluon_dq`` with ``DQ_ENABLED``: 64 and 128 (measured on the H200), none with FA2_TRITON_GLUON_DQ=0; it
takes what ``takes`` does less causal inputs with fewer keys than queries and
batch·heads over 65,535, its grid's second axis (``takes_dq``). An error in these kernels is raised, never
retried on the tl kernels.

Gluon's API moves between Triton releases; the names used here are the ones ``forward_gluon`` uses, bound
for Triton 3.6 and 3.7+ alike; packages/fa2-triton/tests/test_triton_gluon_backward.py compiles the kernels
for sm_90a wherever Gluon is importable.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fa2.spec import AttentionSpec
from fa2_triton.common import LOG2_E, group_size, on_hopper
from fa2_triton.forward_gluon import GLUON
from fa2_triton.launch import Plans, arg_classes, copy_descriptor, launch, on_device
from fa2_triton.tiles import short_call

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from fa2_triton.forward_gluon import async_load, async_store, key_tiles

# Query rows a step, by head_dim. At 64, tiles of 128 rows: Sᵀ's and dPᵀ's MMAs 128 wide (64-wide ones, both
# operands from shared memory, run below the tensor cores' rate) and half the barriers and waits a query row,
# as FlashAttention-3 tiles its head_dim 64 backward; at 128 the registers (dK and dV alone 128 a thread) leave
# room for 64-row tiles only.
BLOCK_M = {64: 128, 128: 64}
BLOCK_N = 128  # keys a CTA: two consumer warpgroups of 64
HEAD_DIMS = (64, 128)
# The head dims fa2-triton's backward sends to this kernel (where ``takes`` and the device allow): 64 and 128,
# as measured on the H200 (docs/notes/gluon-backward.md: at 128 the dK/dV kernel 1.32-1.48x the tl one; at 64
# the whole backward with both Gluon kernels 1.09-1.37x the tl pair); FA2_TRITON_GLUON_BACKWARD=0 sends none.
# Read once; tests set the attribute.
ENABLED = () if os.environ.get("FA2_TRITON_GLUON_BACKWARD") == "0" else HEAD_DIMS
# The head dims fa2-triton's backward sends to the dQ kernel (``uses_gluon_dq``): 64 and 128, as measured on
# the H200 (docs/notes/gluon-backward.md: at 128 1.45-1.66x the tl dQ kernel, its dq bits); FA2_TRITON_GLUON_DQ=0
# sends none. Read once; tests set the attribute.
DQ_ENABLED = () if os.environ.get("FA2_TRITON_GLUON_DQ") == "0" else HEAD_DIMS
DQ_BLOCK_M = 128  # query rows a dQ CTA: two consumer warpgroups of 64
DQ_BLOCK_N = 128  # keys a K/V tile of the dQ kernel
# The dQ kernel's K/V buffers by head_dim: a stage (a K and a V tile) 64 KB at 128, with Q's and dO's 64 KB
# two stages take 192 KB of the H200's 227 KB a CTA; at 64, 32 KB a stage, three with Q's and dO's 32 KB.
DQ_STAGES = {64: 3, 128: 2}
MAX_GRID_Y = 65535
MAX_ROWS = 2**31 - 1  # TMA coordinates are 32-bit
# Q and dO buffers: at head_dim 128, K and V take 64 KB and each stage 32 KB (160 KB with three).
STAGES = 3
# Registers: 12 warps (two consumer warpgroups, the loader's) x 168 at launch fill the 64K; the partitions
# then set 240 (consumers: dK and dV alone are 128 a thread at head_dim 128) and 24 (loader).
MAXNREG = 168
CONSUMER_REGS = 240
LOADER_REGS = 24


def uses_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether fa2-triton's backward runs this module's dK/dV kernel on these inputs: a head_dim it is on for
    (``ENABLED``), a device that can run it, inputs it takes (the module docstring says which) and a call that is
    not short (``tiles.short_call``: there the tl kernels' pointer loads cost less host time than its
    descriptors)."""
    return q.shape[-1] in ENABLED and _on_hopper(q.device) and not short_call(q, k) and takes(q, k, v, spec)


def uses_gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether fa2-triton's backward runs this module's dQ kernel on these inputs: a head_dim it is on for
    (``DQ_ENABLED``), a device that can run it, inputs it takes (``takes_dq``) and a call that is not short."""
    return q.shape[-1] in DQ_ENABLED and _on_hopper(q.device) and not short_call(q, k) and takes_dq(q, k, v, spec)


def _on_hopper(device: torch.device) -> bool:
    return GLUON and on_hopper(device)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the kernel takes these inputs, whatever the device."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in HEAD_DIMS:
        return False
    if (spec.masked and not spec.causal) or spec.softcap or spec.alibi_slopes is not None:
        return False
    if spec.varlen or spec.paged:
        return False
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    if q.numel() == 0 or k.numel() == 0 or seqlen_q % 128 or seqlen_k % BLOCK_N:
        return False
    if batch * k.shape[1] > MAX_GRID_Y or max(q.numel(), k.numel()) // q.shape[-1] > MAX_ROWS:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.is_contiguous() or t.transpose(1, 2).is_contiguous()) for t in (q, k, v))


def takes_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the dQ kernel takes these inputs, whatever the device: those ``takes`` accepts, batch·heads at
    most 65,535 (its grid's second axis) and, causal, seqlen_k >= seqlen_q (every query tile then sees its
    diagonal key tile, as in ``forward_gluon``)."""
    if not takes(q, k, v, spec) or q.shape[0] * q.shape[1] > MAX_GRID_Y:
        return False
    return not spec.causal or k.shape[2] >= q.shape[2]


def flash_attn_dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dO: torch.Tensor,
    L: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    spec: AttentionSpec,
):
    """dK and dV into dk and dv (written in full).

    Arguments:
        q, dO: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a
            multiple of heads_k; inputs that ``takes`` accepts, q, k and v contiguous (dO any strides).
        L: (batch, heads, seqlen_q), float32, natural log, from the forward; delta: the preprocess's
            rowsum(dO ∘ O), (batch, heads, seqlen_q) float32.
        dk, dv: contiguous, k's shape and dtype.
        spec: the scale and whether causal (``takes``).

    Returns:
        the compiled kernel (Triton's, on a GPU).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    dO, L, delta = (_tma_ready(t) for t in (dO, L, delta))
    key = (q.shape, k.shape, q.dtype, q.device, spec.scale, spec.causal)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, dO, L, delta, dk, dv, spec)
    bases = (*(t.view(-1, head_dim) for t in (q, k, v, dO, dk, dv)), L.view(-1), delta.view(-1))
    args = (*(copy_descriptor(GluonTensorDescriptor, d, t) for d, t in zip(plan.descriptors, bases)), *plan.scalars)
    if plan.classes is None:
        plan = _PLANS.keep(key, plan._replace(classes=arg_classes(args)))
    with on_device(q.device):
        return launch(
            _attn_bwd_dkdv_gluon, plan.grid, args, plan.constexprs, dict(num_warps=4, maxnreg=MAXNREG), plan.classes
        )


def flash_attn_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dO: torch.Tensor,
    L: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    spec: AttentionSpec,
):
    """dQ into dq (written in full, each element once).

    Arguments:
        q, dO: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a
            multiple of heads_k; inputs that ``takes_dq`` accepts, q, k and v contiguous (dO any strides).
        L: (batch, heads, seqlen_q), float32, natural log, from the forward; delta: the preprocess's
            rowsum(dO ∘ O), (batch, heads, seqlen_q) float32.
        dq: contiguous, q's shape and dtype.
        spec: the scale and whether causal (``takes_dq``).

    Returns:
        the compiled kernel (Triton's, on a GPU).
    """
    head_dim = q.shape[-1]
    dO, L, delta = (_tma_ready(t) for t in (dO, L, delta))
    key = (q.shape, k.shape, q.dtype, q.device, spec.scale, spec.causal)
    plan = _DQ_PLANS.get(key)
    if plan is None:
        plan = _dq_plan(q, k, v, dO, L, delta, dq, spec)
    bases = (*(t.view(-1, head_dim) for t in (q, k, v, dO, dq)), L.view(-1), delta.view(-1))
    args = (*(copy_descriptor(GluonTensorDescriptor, d, t) for d, t in zip(plan.descriptors, bases)), *plan.scalars)
    if plan.classes is None:
        plan = _DQ_PLANS.keep(key, plan._replace(classes=arg_classes(args)))
    with on_device(q.device):
        return launch(
            _attn_bwd_dq_gluon, plan.grid, args, plan.constexprs, dict(num_warps=4, maxnreg=MAXNREG), plan.classes
        )


class _Plan(NamedTuple):
    """What ``flash_attn_dkdv`` or ``flash_attn_dq`` works out from the inputs' shapes, dtype, alignment and
    the spec, but for the tensors: kept per class of inputs (``_PLANS``, ``_DQ_PLANS``)."""

    # The kernel's descriptors but for their base (GluonTensorDescriptor's fields): Q's, K's, V's, dO's, dK's,
    # dV's, L's and delta's (dK/dV); Q's, K's, V's, dO's, dQ's, L's and delta's (dQ).
    descriptors: tuple[dict, ...]
    grid: tuple[int, int]
    scalars: tuple
    constexprs: dict
    # The launch's argument classes (``fa2_triton.launch.arg_classes``), once a launch has met them.
    classes: tuple | None = None


# (shapes, dtype, device, the scale, causal) -> _Plan. Every tensor is contiguous and 16-byte aligned here
# (``takes``, ``flash_attn_dkdv``).
_PLANS = Plans()
# The same for ``flash_attn_dq``.
_DQ_PLANS = Plans()


def _plan(q, k, v, dO, L, delta, dk, dv, spec: AttentionSpec) -> _Plan:
    """The launch of ``flash_attn_dkdv``'s inputs: the eight descriptors built and checked by Gluon once a
    class, then copied (``launch.copy_descriptor``)."""
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    rows, keys = BLOCK_M[head_dim], BLOCK_N // 2
    descriptors = tuple(
        GluonTensorDescriptor.from_tensor(
            t.view(-1, head_dim), [block, head_dim], _smem_layout(q.dtype, head_dim, block)
        )
        for t, block in ((q, rows), (k, keys), (v, keys), (dO, rows), (dk, keys), (dv, keys))
    ) + tuple(GluonTensorDescriptor.from_tensor(t.view(-1), [rows], _ROWS_LAYOUT) for t in (L, delta))
    return _Plan(
        tuple({**d.__dict__, "base": None} for d in descriptors),
        (seqlen_k // BLOCK_N, batch * heads_k),
        (spec.scale * LOG2_E, spec.scale, seqlen_q, seqlen_k, group_size(q, k)),
        dict(CAUSAL=spec.causal, HEAD_DIM=head_dim, STAGES=STAGES, BLOCK_M=rows),
    )


def _dq_plan(q, k, v, dO, L, delta, dq, spec: AttentionSpec) -> _Plan:
    """The launch of ``flash_attn_dq``'s inputs: the seven descriptors built and checked by Gluon once a class,
    then copied (``launch.copy_descriptor``)."""
    batch, heads, seqlen_q, head_dim = q.shape
    rows_layout = _smem_layout(q.dtype, head_dim, DQ_BLOCK_M // 2)
    keys_layout = _smem_layout(q.dtype, head_dim, DQ_BLOCK_N)
    descriptors = tuple(
        GluonTensorDescriptor.from_tensor(t.view(-1, head_dim), [block, head_dim], layout)
        for t, block, layout in (
            (q, DQ_BLOCK_M // 2, rows_layout),
            (k, DQ_BLOCK_N, keys_layout),
            (v, DQ_BLOCK_N, keys_layout),
            (dO, DQ_BLOCK_M // 2, rows_layout),
            (dq, DQ_BLOCK_M // 2, rows_layout),
        )
    ) + tuple(GluonTensorDescriptor.from_tensor(t.view(-1), [DQ_BLOCK_M // 2], _ROWS_LAYOUT) for t in (L, delta))
    return _Plan(
        tuple({**d.__dict__, "base": None} for d in descriptors),
        (seqlen_q // DQ_BLOCK_M, batch * heads),
        (spec.scale * LOG2_E, spec.scale, seqlen_q, k.shape[2], heads, group_size(q, k)),
        dict(CAUSAL=spec.causal, HEAD_DIM=head_dim, STAGES=DQ_STAGES[head_dim]),
    )


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where it is not contiguous and 16-byte aligned (what the copies need)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.cache
def _smem_layout(dtype: torch.dtype, head_dim: int, rows: int):
    """The shared-memory layout of a [rows, head_dim] tile."""
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gdtype)


if GLUON:
    # L's and delta's rows of a query tile in shared memory: 64 float32, unswizzled.
    _ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    _ROWS = gl.constexpr(BLOCK_N // 2)  # keys of one consumer warpgroup
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _LOADER_REGS = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _query_tiles(N_Q, N_K, CAUSAL: gl.constexpr):
        """This CTA's key tile's first key and its key/value rows in the 2-D views; the first query row that
        sees some of its keys, lo (query i sees key j iff j <= i + N_K - N_Q under causal). The lengths are
        multiples of 128, so lo is a multiple of 64."""
        start_n = gl.program_id(0) * _BLOCK_N
        kv_row = gl.program_id(1) * N_K + start_n
        if CAUSAL:
            lo = gl.minimum(gl.maximum(start_n - (N_K - N_Q), 0), N_Q)
        else:
            lo = 0
        return start_n, kv_row, lo

    @gluon.jit
    def _loader(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
        dv_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        kv_ready,
        q_ready,
        do_ready,
        empty,
        l_desc,
        delta_desc,
        lse_smem,
        delta_smem,
        qk_scale,
        scale,
        N_Q,
        N_K,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        start_n, kv_row, lo = _query_tiles(N_Q, N_K, CAUSAL)
        mbarrier.expect(kv_ready, 4 * k_desc.block_type.nbytes)
        async_load(k_desc, [kv_row, 0], kv_ready, k_smem.index(0))
        async_load(k_desc, [kv_row + _ROWS, 0], kv_ready, k_smem.index(1))
        async_load(v_desc, [kv_row, 0], kv_ready, v_smem.index(0))
        async_load(v_desc, [kv_row + _ROWS, 0], kv_ready, v_smem.index(1))
        n_tiles = (N_Q - lo) // BLOCK_M
        for g in range(GROUP):
            q_row = (gl.program_id(1) * GROUP + g) * N_Q
            for t in range(n_tiles):
                it = g * n_tiles + t
                s = it % STAGES
                # A fresh barrier counts its phase before the first as complete: the first pass does not wait.
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                row = q_row + lo + t * BLOCK_M
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + l_desc.block_type.nbytes)
                async_load(q_desc, [row, 0], q_ready.index(s), q_smem.index(s))
                async_load(l_desc, [row], q_ready.index(s), lse_smem.index(s))
                mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                async_load(do_desc, [row, 0], do_ready.index(s), do_smem.index(s))
                async_load(delta_desc, [row], do_ready.index(s), delta_smem.index(s))

    @gluon.jit
    def _step(
        it,
        start_m,
        first,
        k,
        v,
        q_smem,
        do_smem,
        q_ready,
        do_ready,
        empty,
        dk,
        dv,
        lse_smem,
        delta_smem,
        qk_scale,
        s_layout: gl.constexpr,
        a_layout: gl.constexpr,
        STAGES: gl.constexpr,
        MASKED: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """The query tile in stage ``it`` of the ring, rows [start_m, start_m + BLOCK_M) of its head: dK and
        dV of this warpgroup's keys updated. MASKED (a tile across the causal diagonal): Pᵀ is zeroed where a
        query comes before the first that sees the key (``first``, [64]: key - (N_K - N_Q))."""
        s = it % STAGES
        phase = (it // STAGES) & 1
        q = q_smem.index(s)
        do = do_smem.index(s)
        mbarrier.wait(q_ready.index(s), phase)
        sT = warpgroup_mma(
            k, q.permute((1, 0)), gl.zeros([_ROWS, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True
        )
        mbarrier.wait(do_ready.index(s), phase)
        dpT = warpgroup_mma(
            v, do.permute((1, 0)), gl.zeros([_ROWS, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True
        )
        # L in log2 units, as the scores.
        lse = lse_smem.index(s).load(gl.SliceLayout(0, s_layout)) * 1.4426950408889634
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
        # exp(S - L); a row with L = +inf (it sees no key) gets exp2(-inf) = 0.
        pT = gl.exp2(sT * qk_scale - lse[None, :])  # [64 keys, BLOCK_M queries]
        if MASKED:
            # Zeroing after exp2 keeps -inf out of it. Compared as offsets from start_m, so that no
            # [64, BLOCK_M] tile of indices is loop-invariant (kept in registers).
            offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            pT = gl.where(offs[None, :] >= (first - start_m)[:, None], pT, 0.0)
        if BLOCK_M == 128:
            # dSᵀ formed before either MMA is issued: Pᵀ's 16-bit copy is not live beside dPᵀ's [64, 128]
            # accumulator (with it there the consumers spilled); dV's and dK's MMAs then run together.
            dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dpT,))
            delta = delta_smem.index(s).load(gl.SliceLayout(0, s_layout))
            dsT = pT * (dpT - delta[None, :])
            p16 = gl.convert_layout(pT.to(q_smem.dtype), a_layout)
            ds16 = gl.convert_layout(dsT.to(q_smem.dtype), a_layout)
            dv = warpgroup_mma(p16, do, dv, is_async=True)
            dk = warpgroup_mma(ds16, q, dk, is_async=True)
        else:
            p16 = gl.convert_layout(pT.to(q_smem.dtype), a_layout)
            dv = warpgroup_mma(p16, do, dv, is_async=True)
            # dV's MMA completes before dSᵀ is formed, freeing Pᵀ's 16-bit copy (with it live there the
            # consumers spilled); the other warpgroup's MMAs keep the tensor cores busy meanwhile.
            dpT, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dpT, dv))
            delta = delta_smem.index(s).load(gl.SliceLayout(0, s_layout))
            dsT = pT * (dpT - delta[None, :])
            ds16 = gl.convert_layout(dsT.to(q_smem.dtype), a_layout)
            dk = warpgroup_mma(ds16, q, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s), count=1)
        return dk, dv

    @gluon.jit
    def _consumer(
        WG: gl.constexpr,
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
        dv_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        kv_ready,
        q_ready,
        do_ready,
        empty,
        l_desc,
        delta_desc,
        lse_smem,
        delta_smem,
        qk_scale,
        scale,
        N_Q,
        N_K,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """Consumer warpgroup WG: keys [64 · WG, 64 · WG + 64) of the CTA's tile."""
        start_n, kv_row, lo = _query_tiles(N_Q, N_K, CAUSAL)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        k = k_smem.index(WG)
        v = v_smem.index(WG)
        # The first query position that sees each of this warpgroup's keys (causal).
        first = start_n + WG * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout)) - (N_K - N_Q)
        dk = gl.zeros([_ROWS, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([_ROWS, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_ready, 0)
        n_tiles = (N_Q - lo) // BLOCK_M
        # Under causal the first BLOCK_N // BLOCK_M tiles from lo cross the diagonal of the CTA's keys and are
        # masked; the rest pass whole and skip the mask (a copy of the step without it: the mask's indices
        # made the consumers spill).
        masked = 0
        if CAUSAL:
            masked = gl.minimum(n_tiles, _BLOCK_N // BLOCK_M)
        # The group's query heads one after another, each's query tiles from lo: the loader's order.
        for g in range(GROUP):
            if CAUSAL:
                for t in range(masked):
                    dk, dv = _step(
                        g * n_tiles + t,
                        lo + t * BLOCK_M,
                        first,
                        k,
                        v,
                        q_smem,
                        do_smem,
                        q_ready,
                        do_ready,
                        empty,
                        dk,
                        dv,
                        lse_smem,
                        delta_smem,
                        qk_scale,
                        s_layout,
                        a_layout,
                        STAGES,
                        True,
                        BLOCK_M,
                    )
            for t in range(masked, n_tiles):
                dk, dv = _step(
                    g * n_tiles + t,
                    lo + t * BLOCK_M,
                    first,
                    k,
                    v,
                    q_smem,
                    do_smem,
                    q_ready,
                    do_ready,
                    empty,
                    dk,
                    dv,
                    lse_smem,
                    delta_smem,
                    qk_scale,
                    s_layout,
                    a_layout,
                    STAGES,
                    False,
                    BLOCK_M,
                )
        dk = dk * scale
        # The K and V buffers are free: this warpgroup's last MMAs that read them have completed. A key tile
        # that no query sees stores dk = dv = 0.
        k.store(dk.to(q_desc.dtype))
        v.store(dv.to(q_desc.dtype))
        fence_async_shared()
        async_store(dk_desc, [kv_row + WG * _ROWS, 0], k)
        async_store(dv_desc, [kv_row + WG * _ROWS, 0], v)
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
        dv_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        kv_ready,
        q_ready,
        do_ready,
        empty,
        l_desc,
        delta_desc,
        lse_smem,
        delta_smem,
        qk_scale,
        scale,
        N_Q,
        N_K,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        _consumer(
            0,
            q_desc,
            k_desc,
            v_desc,
            do_desc,
            dk_desc,
            dv_desc,
            q_smem,
            do_smem,
            k_smem,
            v_smem,
            kv_ready,
            q_ready,
            do_ready,
            empty,
            l_desc,
            delta_desc,
            lse_smem,
            delta_smem,
            qk_scale,
            scale,
            N_Q,
            N_K,
            GROUP,
            CAUSAL,
            HEAD_DIM,
            STAGES,
            BLOCK_M,
        )

    @gluon.jit
    def _consumer1(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
        dv_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        kv_ready,
        q_ready,
        do_ready,
        empty,
        l_desc,
        delta_desc,
        lse_smem,
        delta_smem,
        qk_scale,
        scale,
        N_Q,
        N_K,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        _consumer(
            1,
            q_desc,
            k_desc,
            v_desc,
            do_desc,
            dk_desc,
            dv_desc,
            q_smem,
            do_smem,
            k_smem,
            v_smem,
            kv_ready,
            q_ready,
            do_ready,
            empty,
            l_desc,
            delta_desc,
            lse_smem,
            delta_smem,
            qk_scale,
            scale,
            N_Q,
            N_K,
            GROUP,
            CAUSAL,
            HEAD_DIM,
            STAGES,
            BLOCK_M,
        )

    @gluon.jit
    def _attn_bwd_dkdv_gluon(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dk_desc,
        dv_desc,
        l_desc,
        delta_desc,
        qk_scale,
        scale,
        N_Q,
        N_K,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """q_desc, do_desc: (B·H·N_Q, D) rows, blocks [64, D]; k_desc, v_desc, dk_desc, dv_desc: (B·H_K·N_K,
        D), blocks [64, D]; L, Delta: (B·H·N_Q,) float32. qk_scale: the softmax scale · log2(e); scale: the
        softmax scale; GROUP: query heads per key/value head. One CTA per (key tile, batch·H_K)."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], l_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
        # Every partition gets the whole list, spelled out here: a tuple bound to a name first loses its
        # constexprs (as in forward_gluon).
        gl.warp_specialize(
            [
                (
                    _consumer0,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dk_desc,
                        dv_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        kv_ready,
                        q_ready,
                        do_ready,
                        empty,
                        l_desc,
                        delta_desc,
                        lse_smem,
                        delta_smem,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                        BLOCK_M,
                    ),
                ),
                (
                    _consumer1,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dk_desc,
                        dv_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        kv_ready,
                        q_ready,
                        do_ready,
                        empty,
                        l_desc,
                        delta_desc,
                        lse_smem,
                        delta_smem,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                        BLOCK_M,
                    ),
                ),
                (
                    _loader,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dk_desc,
                        dv_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        kv_ready,
                        q_ready,
                        do_ready,
                        empty,
                        l_desc,
                        delta_desc,
                        lse_smem,
                        delta_smem,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                        BLOCK_M,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _LOADER_REGS],
        )

    # The dQ kernel.

    _DQ_ROWS = gl.constexpr(DQ_BLOCK_M // 2)  # query rows of one consumer warpgroup
    _DQ_BLOCK_N = gl.constexpr(DQ_BLOCK_N)

    @gluon.jit
    def _dq_coords(N_Q, N_K, H, GROUP, CAUSAL: gl.constexpr):
        """This CTA's query tile t, its first Q (and dQ) row and its key/value head's first row in the 2-D
        views. Causal, the tiles run last first: the last sees the most keys, and the short ones then fill
        the GPU's last wave (as in ``forward_gluon``)."""
        t = gl.program_id(0)
        if CAUSAL:
            t = gl.num_programs(0) - 1 - t
        bh = gl.program_id(1)
        q_row = bh * N_Q + t * (2 * _DQ_ROWS)
        kv_row = ((bh // H) * (H // GROUP) + (bh % H) // GROUP) * N_K
        return t, q_row, kv_row

    @gluon.jit
    def _dq_loader(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        l_desc,
        delta_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        k_ready,
        v_ready,
        kv_empty,
        qk_scale,
        scale,
        N_Q,
        N_K,
        H,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        t, q_row, kv_row = _dq_coords(N_Q, N_K, H, GROUP, CAUSAL)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes)
        for wg in gl.static_range(2):
            async_load(q_desc, [q_row + wg * _DQ_ROWS, 0], q_ready, q_smem.index(wg))
            async_load(l_desc, [q_row + wg * _DQ_ROWS], q_ready, lse_smem.index(wg))
        mbarrier.expect(do_ready, 2 * do_desc.block_type.nbytes + 2 * delta_desc.block_type.nbytes)
        for wg in gl.static_range(2):
            async_load(do_desc, [q_row + wg * _DQ_ROWS, 0], do_ready, do_smem.index(wg))
            async_load(delta_desc, [q_row + wg * _DQ_ROWS], do_ready, delta_smem.index(wg))
        for j in range(key_tiles(t, N_Q, N_K, _DQ_BLOCK_N, CAUSAL)):
            s = j % STAGES
            # A fresh barrier counts its phase before the first as complete: the first pass does not wait.
            mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            async_load(k_desc, [kv_row + j * _DQ_BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            async_load(v_desc, [kv_row + j * _DQ_BLOCK_N, 0], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _dq_step(
        j,
        q,
        do,
        k_smem,
        v_smem,
        k_ready,
        v_ready,
        kv_empty,
        dq,
        lse,
        delta,
        qk_scale,
        last_key,
        s_layout: gl.constexpr,
        a_layout: gl.constexpr,
        STAGES: gl.constexpr,
        MASK: gl.constexpr,
    ):
        """Key tile j: dQ of this warpgroup's rows updated. MASK (the causal diagonal tile): P zeroed where
        key > last_key + r for the warpgroup's row r. lse: L · log2(e); delta: rowsum(dO ∘ O), [64] each."""
        s = j % STAGES
        phase = (j // STAGES) & 1
        k = k_smem.index(s)
        mbarrier.wait(k_ready.index(s), phase)
        S = warpgroup_mma(
            q,
            k.permute((1, 0)),
            gl.zeros([_DQ_ROWS, _DQ_BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        mbarrier.wait(v_ready.index(s), phase)
        dp = warpgroup_mma(
            do,
            v_smem.index(s).permute((1, 0)),
            gl.zeros([_DQ_ROWS, _DQ_BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        S = warpgroup_mma_wait(num_outstanding=1, deps=(S,))
        # exp(S - L) in log2 units, as the dK/dV kernel's Pᵀ.
        p = gl.exp2(S * qk_scale - lse[:, None])  # [64 queries, DQ_BLOCK_N keys]
        if MASK:
            # Zeroing after exp2 keeps -inf out of it.
            rows = last_key + gl.arange(0, _DQ_ROWS, layout=gl.SliceLayout(1, s_layout))
            cols = j * _DQ_BLOCK_N + gl.arange(0, _DQ_BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - delta[:, None])
        ds16 = gl.convert_layout(ds.to(q.dtype), a_layout)
        # K as the B operand, [DQ_BLOCK_N, HEAD_DIM] as it lies: no transpose.
        dq = warpgroup_mma(ds16, k, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(kv_empty.index(s), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(
        WG: gl.constexpr,
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        l_desc,
        delta_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        k_ready,
        v_ready,
        kv_empty,
        qk_scale,
        scale,
        N_Q,
        N_K,
        H,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """Consumer warpgroup WG: query rows [64 · WG, 64 · WG + 64) of the CTA's tile."""
        t, q_row, kv_row = _dq_coords(N_Q, N_K, H, GROUP, CAUSAL)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _DQ_BLOCK_N, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        q = q_smem.index(WG)
        do = do_smem.index(WG)
        mbarrier.wait(q_ready, 0)
        # L in log2 units, as the scores.
        lse = lse_smem.index(WG).load(gl.SliceLayout(1, s_layout)) * 1.4426950408889634
        mbarrier.wait(do_ready, 0)
        delta = delta_smem.index(WG).load(gl.SliceLayout(1, s_layout))
        dq = gl.zeros([_DQ_ROWS, HEAD_DIM], gl.float32, acc_layout)
        n = key_tiles(t, N_Q, N_K, _DQ_BLOCK_N, CAUSAL)
        # The key on the diagonal of this warpgroup's first row (causal): the last it sees.
        last_key = t * (2 * _DQ_ROWS) + WG * _DQ_ROWS + N_K - N_Q
        if CAUSAL:
            # Only the last tile, the diagonal one, is masked; the tiles before it are whole.
            for j in range(n - 1):
                dq = _dq_step(
                    j,
                    q,
                    do,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    dq,
                    lse,
                    delta,
                    qk_scale,
                    last_key,
                    s_layout,
                    a_layout,
                    STAGES,
                    False,
                )
            dq = _dq_step(
                n - 1,
                q,
                do,
                k_smem,
                v_smem,
                k_ready,
                v_ready,
                kv_empty,
                dq,
                lse,
                delta,
                qk_scale,
                last_key,
                s_layout,
                a_layout,
                STAGES,
                True,
            )
        else:
            for j in range(n):
                dq = _dq_step(
                    j,
                    q,
                    do,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    dq,
                    lse,
                    delta,
                    qk_scale,
                    last_key,
                    s_layout,
                    a_layout,
                    STAGES,
                    False,
                )
        dq = dq * scale
        q.store(dq.to(q_desc.dtype))  # Q's buffer is free: this warpgroup's last S = Q Kᵀ has completed
        fence_async_shared()
        async_store(dq_desc, [q_row + WG * _DQ_ROWS, 0], q)
        tma.store_wait(0)

    @gluon.jit
    def _dq_consumer0(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        l_desc,
        delta_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        k_ready,
        v_ready,
        kv_empty,
        qk_scale,
        scale,
        N_Q,
        N_K,
        H,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        _dq_consumer(
            0,
            q_desc,
            k_desc,
            v_desc,
            do_desc,
            dq_desc,
            l_desc,
            delta_desc,
            q_smem,
            do_smem,
            k_smem,
            v_smem,
            lse_smem,
            delta_smem,
            q_ready,
            do_ready,
            k_ready,
            v_ready,
            kv_empty,
            qk_scale,
            scale,
            N_Q,
            N_K,
            H,
            GROUP,
            CAUSAL,
            HEAD_DIM,
            STAGES,
        )

    @gluon.jit
    def _dq_consumer1(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        l_desc,
        delta_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        q_ready,
        do_ready,
        k_ready,
        v_ready,
        kv_empty,
        qk_scale,
        scale,
        N_Q,
        N_K,
        H,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        _dq_consumer(
            1,
            q_desc,
            k_desc,
            v_desc,
            do_desc,
            dq_desc,
            l_desc,
            delta_desc,
            q_smem,
            do_smem,
            k_smem,
            v_smem,
            lse_smem,
            delta_smem,
            q_ready,
            do_ready,
            k_ready,
            v_ready,
            kv_empty,
            qk_scale,
            scale,
            N_Q,
            N_K,
            H,
            GROUP,
            CAUSAL,
            HEAD_DIM,
            STAGES,
        )

    @gluon.jit
    def _attn_bwd_dq_gluon(
        q_desc,
        k_desc,
        v_desc,
        do_desc,
        dq_desc,
        l_desc,
        delta_desc,
        qk_scale,
        scale,
        N_Q,
        N_K,
        H,
        GROUP,
        CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """q_desc, do_desc, dq_desc: (B·H·N_Q, D) rows, blocks [64, D]; k_desc, v_desc: (B·H_K·N_K, D), blocks
        [DQ_BLOCK_N, D]; L, Delta: (B·H·N_Q,) float32, blocks [64]. qk_scale: the softmax scale · log2(e);
        scale: the softmax scale; H: query heads; GROUP: query heads per key/value head. One CTA per (query
        tile of 128 rows, batch·H)."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, _DQ_ROWS, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, _DQ_ROWS, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, _DQ_BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, _DQ_BLOCK_N, HEAD_DIM], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [2, _DQ_ROWS], l_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [2, _DQ_ROWS], delta_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(do_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a buffer
        # Every partition gets the whole list, spelled out here: a tuple bound to a name first loses its
        # constexprs (as in forward_gluon).
        gl.warp_specialize(
            [
                (
                    _dq_consumer0,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dq_desc,
                        l_desc,
                        delta_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        q_ready,
                        do_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                    ),
                ),
                (
                    _dq_consumer1,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dq_desc,
                        l_desc,
                        delta_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        q_ready,
                        do_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                    ),
                ),
                (
                    _dq_loader,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        do_desc,
                        dq_desc,
                        l_desc,
                        delta_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        q_ready,
                        do_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        qk_scale,
                        scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        CAUSAL,
                        HEAD_DIM,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _LOADER_REGS],
        )
