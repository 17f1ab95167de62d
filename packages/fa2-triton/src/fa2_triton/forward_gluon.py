"""fa2-triton's Hopper forward in Gluon (``triton.experimental.gluon``): warp-specialised, on warpgroup MMA.

Where ``forward_tl.py``'s kernel leaves the schedule to Triton's compiler, this one writes it down, as
FlashAttention-3 does: one CTA per 128 query rows of a (batch, head) has three partitions,

- a loader warp that issues every copy: the two 64-row halves of Q once, then K and V tile after tile
  through TMA into a ring of ``STAGES`` shared-memory buffers, each with a ready mbarrier the copy
  completes and an empty one both consumers arrive at when their MMAs have read the buffer;
- two consumer warpgroups, 64 query rows each. A step of one issues P V of the previous key tile and
  S = Q K^T of this one as asynchronous warpgroup MMAs (``warpgroup_mma``, P from registers), waits for
  both, then runs the online softmax. The two take turns to issue (``turn`` mbarriers: ping-pong), so one's
  softmax runs while the other's MMAs keep the tensor cores busy.

The kernel's outputs are the tl kernel's: O (batch, heads, seqlen_q, head_dim) contiguous, staged in the
consumer's Q buffer and stored by TMA, and L = m + log(l) in natural log. It is launched through
``fa2_triton.launch`` as the tl kernels are: Triton's dispatch once per class of inputs, not every call
(on the H200 its host time had made fa2.attention's calls at N = 512 wait on the host).

Which inputs take it (``uses_gluon``), as measured on the H200 (docs/notes/gluon-forward.md): a Hopper GPU
(compute capability 9.0) with Gluon's Hopper API importable, not the interpreter; fp16 or bf16;
head_dim 128; no window, no softcap, no ALiBi, no packed batch, no KV cache (a sink is fine:
``_attn_fwd_gluon_sink``, the same body with HAS_SINK, adds it in the consumers' epilogue); causal only where
``CAUSAL`` is on (the default; FA2_TRITON_GLUON_CAUSAL=0 turns it off) and seqlen_k >= seqlen_q: each query tile
t then reads the key tiles up to its diagonal one and masks that one alone (bottom-right aligned, here with
seqlen_q = 256, seqlen_k = 384, tiles of 128 as blocks)::

    query tile 0:  [ whole ][ diag  ][ -     ]
    query tile 1:  [ whole ][ whole ][ diag  ]

seqlen_q and seqlen_k multiples of 128 (the copies are 2-D, over all heads' rows: a tile past a head's end
would read, or write, the next head's rows); each of q, k, v with its heads' rows contiguous, (batch, heads,
seqlen, head_dim), or interleaved, (batch, seqlen, heads, head_dim) as flash-attn's layout, 16-byte aligned;
batch·heads at most 65,535 (the grid's second axis); not a short call (``tiles.short_call``: a call bound by
the host, where the four descriptors' host time outweighs what the kernel saves). Grouped-query attention is
in the kernel (query head h reads key/value head h // group). Everything else runs ``forward_tl.py``'s kernel;
the choice depends on the inputs alone, and an error in this kernel is raised, never retried on the other one.

Gluon is experimental and its API moves between Triton releases: Triton 3.6 (the H200's) names the TMA
copies ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global``, later releases
``tma.async_load`` / ``async_store`` (the module binds whichever exists as ``async_load``,
``async_store``); packages/fa2-triton/tests/test_triton_gluon.py compiles the kernel for sm_90a wherever Gluon is
importable, a GPU or not.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fa2.spec import AttentionSpec
from fa2_triton.common import LOG2_E, group_size, on_hopper
from fa2_triton.launch import Plans, arg_classes, copy_descriptor, launch, on_device
from fa2_triton.tiles import short_call

try:
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

    GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # a Triton without Gluon's Hopper API: the tl kernel runs everywhere
    GLUON = False

BLOCK_M = 128  # query rows a CTA: two consumer warpgroups of 64
BLOCK_N = 128  # keys a K/V tile
HEAD_DIM = 128
MAX_GRID_Y = 65535
STAGES = 3  # K/V buffers: 3 x 2 x 32 KB, with Q's 32 KB 224 KB of the H200's 227 KB a CTA
# Registers: 12 warps (two consumer warpgroups, the loader's) x 168 at launch fill the 64K; the partitions
# then set 240 (consumers) and 24 (loader).
MAXNREG = 168
# Causal attention on this kernel (the diagonal tile masked, the tiles past it never loaded): on the H200 at
# 0a7f704 (16k tokens, H 16, D 128, N 2k-16k) 452-578 TFLOP/s bf16 against the tl kernel's 430-490 and
# cuDNN's 491-567 (docs/notes/gluon-forward.md). FA2_TRITON_GLUON_CAUSAL=0 sends causal inputs to the tl
# kernel. Read once; tests set the attribute.
CAUSAL = os.environ.get("FA2_TRITON_GLUON_CAUSAL", "1") != "0"
CONSUMER_REGS = 240
LOADER_REGS = 24


def uses_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether fa2-triton's forward runs this module's kernel on these inputs (the module docstring says
    which, and why): a device that can run it, inputs it takes, and a call long enough that its four
    descriptors' host time pays (not ``tiles.short_call``)."""
    return _on_hopper(q.device) and not short_call(q, k) and takes(q, k, v, spec)


def _on_hopper(device: torch.device) -> bool:
    return GLUON and on_hopper(device)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the kernel takes these inputs, whatever the device."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != HEAD_DIM:
        return False
    if spec.softcap or spec.alibi_slopes is not None or spec.varlen:
        return False
    # Causal with at least as many keys as queries: every query tile then sees its diagonal tile.
    if spec.masked and not (CAUSAL and spec.causal and k.shape[2] >= q.shape[2]):
        return False
    if q.numel() == 0 or k.numel() == 0 or q.shape[2] % BLOCK_M or k.shape[2] % BLOCK_N:
        return False
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:  # the grid's second axis is batch·heads
        return False
    layouts = [_rows_layout(t) for t in (q, k, v)]
    return None not in layouts and layouts[1] == layouts[2] and all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def _rows_layout(t: torch.Tensor) -> bool | None:
    """False: (batch, heads, seqlen, head_dim) contiguous; True: (batch, seqlen, heads, head_dim)
    contiguous (the heads interleaved within a row of the 2-D view); None: neither."""
    if t.is_contiguous():
        return False
    if t.transpose(1, 2).is_contiguous():
        return True
    return None


def flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, 128); k, v: (batch, heads_k, seqlen_k, 128), heads a multiple of
            heads_k; fp16 or bf16 on a Hopper GPU; inputs that ``uses_gluon`` accepts.
        spec: the scale and the sink (no mask, softcap, bias or packing: ``uses_gluon``).

    Returns:
        O: (batch, heads, seqlen_q, 128), q's dtype, contiguous. L: (batch, heads, seqlen_q), float32,
        natural log of the scores' sum (and exp(sink[h]) with a sink).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    O = torch.empty(batch, heads, seqlen_q, head_dim, device=q.device, dtype=q.dtype)
    L = torch.empty(batch, heads, seqlen_q, device=q.device, dtype=torch.float32)
    sink = spec.sink
    key = (
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.stride(),
        q.dtype,
        q.device,
        O.data_ptr() % 16,
        L.data_ptr() % 16,
        spec.scale,
        spec.causal,
        None if sink is None else sink.data_ptr() % 16,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, O, spec)
    bases = (_rows_2d(q, plan.q_cols), _rows_2d(k, plan.kv_cols), _rows_2d(v, plan.kv_cols), O.view(-1, head_dim))
    q_desc, k_desc, v_desc, o_desc = (
        copy_descriptor(GluonTensorDescriptor, d, t) for d, t in zip(plan.descriptors, bases)
    )
    if sink is None:
        kernel, args = _attn_fwd_gluon, (q_desc, k_desc, v_desc, o_desc, L, *plan.scalars)
    else:
        kernel, args = _attn_fwd_gluon_sink, (q_desc, k_desc, v_desc, o_desc, L, sink, *plan.scalars)
    if plan.classes is None:
        plan = _PLANS.keep(key, plan._replace(classes=arg_classes(args)))
    with on_device(q.device):
        launch(kernel, plan.grid, args, plan.constexprs, dict(num_warps=4, maxnreg=MAXNREG), plan.classes)
    return O, L


class _Plan(NamedTuple):
    """What ``flash_attn_forward`` works out from the inputs' shapes, strides, dtype, alignment and the spec,
    but for the tensors: kept per class of inputs (``_PLANS``)."""

    q_cols: bool
    kv_cols: bool
    # Q's, K's, V's and O's descriptors but for their base (GluonTensorDescriptor's fields).
    descriptors: tuple[dict, ...]
    grid: tuple[int, int]
    scalars: tuple
    constexprs: dict
    # The launch's argument classes (``fa2_triton.launch.arg_classes``), once a launch has met them.
    classes: tuple | None = None


# (shapes, strides, dtype, device, the 16-byte alignment of O, L and the sink, the spec's scale and causal)
# -> _Plan.
# q, k and v are 16-byte aligned here (``takes``).
_PLANS = Plans()


def _plan(q, k, v, O, spec: AttentionSpec) -> _Plan:
    """The launch of ``flash_attn_forward``'s inputs: the four descriptors built and checked by Gluon once a
    class (~3 µs each of host time on the H200), then copied (``launch.copy_descriptor``)."""
    batch, heads, seqlen_q, head_dim = q.shape
    q_layout, kv_layout = _smem_layouts(q.dtype)
    q_cols, kv_cols = _rows_layout(q), _rows_layout(k)
    descriptors = (
        GluonTensorDescriptor.from_tensor(_rows_2d(q, q_cols), [BLOCK_M // 2, head_dim], q_layout),
        GluonTensorDescriptor.from_tensor(_rows_2d(k, kv_cols), [BLOCK_N, head_dim], kv_layout),
        GluonTensorDescriptor.from_tensor(_rows_2d(v, kv_cols), [BLOCK_N, head_dim], kv_layout),
        GluonTensorDescriptor.from_tensor(O.view(-1, head_dim), [BLOCK_M // 2, head_dim], q_layout),
    )
    return _Plan(
        q_cols,
        kv_cols,
        tuple({**d.__dict__, "base": None} for d in descriptors),
        (seqlen_q // BLOCK_M, batch * heads),
        (spec.scale * LOG2_E, seqlen_q, k.shape[2], heads, group_size(q, k)),
        dict(Q_COLS=q_cols, KV_COLS=kv_cols, HEAD_DIM=head_dim, CAUSAL=spec.causal),
    )


def _rows_2d(t: torch.Tensor, heads_in_cols: bool) -> torch.Tensor:
    """t's rows as the 2-D tensor the copies read: (batch·heads·seqlen, head_dim) or
    (batch·seqlen, heads·head_dim)."""
    if heads_in_cols:
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1] * t.shape[3])
    return t.reshape(-1, t.shape[3])


@functools.cache
def _smem_layouts(dtype: torch.dtype):
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (
        gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, HEAD_DIM], gdtype),
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gdtype),
    )


if GLUON:
    _ROWS = gl.constexpr(BLOCK_M // 2)  # query rows of one consumer warpgroup
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _STAGES = gl.constexpr(STAGES)
    # The copies' names since Triton 3.7 (async_load, async_store), else 3.6's; the backward's kernels take
    # them from here.
    async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    async_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _LOADER_REGS = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _coords(
        N_Q, N_K, H, GROUP, Q_COLS: gl.constexpr, KV_COLS: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr
    ):
        """This CTA's query tile t, its first Q row and column, its key/value head's first row and column in
        the 2-D views, and its first O row. Causal, the tiles run last first: the last sees the most keys, and
        the short ones then fill the GPU's last wave."""
        t = gl.program_id(0)
        if CAUSAL:
            t = gl.num_programs(0) - 1 - t
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        h_k = h // GROUP
        o_row = bh * N_Q + t * (2 * _ROWS)
        if Q_COLS:
            q_row = b * N_Q + t * (2 * _ROWS)
            q_col = h * HEAD_DIM
        else:
            q_row = o_row
            q_col = 0
        if KV_COLS:
            kv_row = b * N_K
            kv_col = h_k * HEAD_DIM
        else:
            kv_row = (b * (H // GROUP) + h_k) * N_K
            kv_col = 0
        return t, q_row, q_col, kv_row, kv_col, o_row

    @gluon.jit
    def key_tiles(t, N_Q, N_K, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """The key tiles of BLOCK_N keys query tile t sees: every one, or causal (N_K >= N_Q, both multiples
        of the tiles, query tiles of BLOCK_N rows), those up to its diagonal tile, which holds key
        i + N_K - N_Q of each row i. Also the dQ kernel's (``backward_gluon``)."""
        if CAUSAL:
            return t + 1 + (N_K - N_Q) // BLOCK_N
        return N_K // BLOCK_N

    @gluon.jit
    def _loader(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        kv_empty,
        turn,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HAS_SINK: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        t, q_row, q_col, kv_row, kv_col, o_row = _coords(N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, CAUSAL)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        async_load(q_desc, [q_row, q_col], q_ready, q_smem.index(0))
        async_load(q_desc, [q_row + _ROWS, q_col], q_ready, q_smem.index(1))
        for j in range(key_tiles(t, N_Q, N_K, _BLOCK_N, CAUSAL)):
            s = j % _STAGES
            # A fresh barrier counts its phase before the first as complete: the first pass does not wait.
            mbarrier.wait(kv_empty.index(s), ((j // _STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            async_load(k_desc, [kv_row + j * _BLOCK_N, kv_col], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            async_load(v_desc, [kv_row + j * _BLOCK_N, kv_col], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _turn_wait(turn, k, WG: gl.constexpr):
        # Warpgroup 0 issues first: its first wait is on the phase a fresh barrier counts as complete.
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))

    @gluon.jit
    def _step(
        j,
        q,
        k_smem,
        v_smem,
        k_ready,
        v_ready,
        kv_empty,
        turn,
        p_prev,
        acc,
        m_i,
        l_i,
        qk_scale,
        last_key,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        p_layout: gl.constexpr,
        WG: gl.constexpr,
        HAS_PREV: gl.constexpr,
        MASK: gl.constexpr,
    ):
        """Key tile j: P V of tile j - 1 (HAS_PREV) and S = Q K_j^T issued in this warpgroup's turn, then
        the online softmax of S, with MASK (a causal diagonal tile) the keys past last_key + r hidden from
        the warpgroup's row r. Returns P (as the next MMA's register operand), O, m, l."""
        # side-by-side: gluon-step
        s = j % _STAGES
        mbarrier.wait(k_ready.index(s), (j // _STAGES) & 1)
        sp = (j + _STAGES - 1) % _STAGES
        if HAS_PREV:
            mbarrier.wait(v_ready.index(sp), ((j - 1) // _STAGES) & 1)
        _turn_wait(turn, j, WG)
        if HAS_PREV:
            acc = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        S = warpgroup_mma(
            q,
            k_smem.index(s).permute((1, 0)),
            gl.zeros([_ROWS, _BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        mbarrier.arrive(turn.index(1 - WG), count=1)
        S, acc = warpgroup_mma_wait(num_outstanding=0, deps=(S, acc))
        if HAS_PREV:
            mbarrier.arrive(kv_empty.index(sp), count=1)
        s2 = S * qk_scale
        if MASK:
            rows = last_key + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
            cols = j * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s2 = gl.where(cols[None, :] <= rows[:, None], s2, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s2, axis=1))
        # A row whose scores so far are all -inf (keys of -inf) keeps m = -inf: exponents from 0 then, so
        # that -inf - -inf never makes a NaN.
        m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s2 - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        # side-by-side: end
        return gl.convert_layout(p.to(q.dtype), p_layout), acc, m_new, l_i

    @gluon.jit
    def _consumer(
        WG: gl.constexpr,
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        kv_empty,
        turn,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HAS_SINK: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        t, q_row, q_col, kv_row, kv_col, o_row = _coords(N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, CAUSAL)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q = q_smem.index(WG)
        mbarrier.wait(q_ready, 0)
        m_i = gl.full([_ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
        p = gl.zeros([_ROWS, _BLOCK_N], q_desc.dtype, p_layout)
        n = key_tiles(t, N_Q, N_K, _BLOCK_N, CAUSAL)
        # The key on the diagonal of this warpgroup's first row (causal): the last it sees.
        last_key = t * (2 * _ROWS) + WG * _ROWS + N_K - N_Q
        if CAUSAL:
            # Only the last tile, the diagonal one, is masked; the tiles before it are whole.
            if n == 1:
                p, acc, m_i, l_i = _step(
                    0,
                    q,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    turn,
                    p,
                    acc,
                    m_i,
                    l_i,
                    qk_scale,
                    last_key,
                    s_layout,
                    o_layout,
                    p_layout,
                    WG,
                    False,
                    True,
                )
            else:
                p, acc, m_i, l_i = _step(
                    0,
                    q,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    turn,
                    p,
                    acc,
                    m_i,
                    l_i,
                    qk_scale,
                    last_key,
                    s_layout,
                    o_layout,
                    p_layout,
                    WG,
                    False,
                    False,
                )
                for j in range(1, n - 1):
                    p, acc, m_i, l_i = _step(
                        j,
                        q,
                        k_smem,
                        v_smem,
                        k_ready,
                        v_ready,
                        kv_empty,
                        turn,
                        p,
                        acc,
                        m_i,
                        l_i,
                        qk_scale,
                        last_key,
                        s_layout,
                        o_layout,
                        p_layout,
                        WG,
                        True,
                        False,
                    )
                p, acc, m_i, l_i = _step(
                    n - 1,
                    q,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    turn,
                    p,
                    acc,
                    m_i,
                    l_i,
                    qk_scale,
                    last_key,
                    s_layout,
                    o_layout,
                    p_layout,
                    WG,
                    True,
                    True,
                )
        else:
            p, acc, m_i, l_i = _step(
                0,
                q,
                k_smem,
                v_smem,
                k_ready,
                v_ready,
                kv_empty,
                turn,
                p,
                acc,
                m_i,
                l_i,
                qk_scale,
                last_key,
                s_layout,
                o_layout,
                p_layout,
                WG,
                False,
                False,
            )
            for j in range(1, n):
                p, acc, m_i, l_i = _step(
                    j,
                    q,
                    k_smem,
                    v_smem,
                    k_ready,
                    v_ready,
                    kv_empty,
                    turn,
                    p,
                    acc,
                    m_i,
                    l_i,
                    qk_scale,
                    last_key,
                    s_layout,
                    o_layout,
                    p_layout,
                    WG,
                    True,
                    False,
                )
        last = (n - 1) % _STAGES
        mbarrier.wait(v_ready.index(last), ((n - 1) // _STAGES) & 1)
        _turn_wait(turn, n, WG)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # side-by-side: gluon-sink
        if HAS_SINK:
            # The sink joins the row's sum as one more score (log2 units) with no value: one more online
            # softmax step, a single column. l > 0 after it: a row with no finite score gets O = 0, L = sink.
            sink = gl.load(Sink + gl.program_id(1) % H) * 1.4426950408889634
            m_new = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_new)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            l_i = l_i * alpha + gl.exp2(sink - m_new)
            m_i = m_new
        # side-by-side: end

        # A row with no finite score (l = 0) gets O = 0 and L = +inf, the convention of rows that see no key.
        empty = l_i == 0.0
        l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))
        o = (acc / l_o[:, None]).to(q_desc.dtype)
        q.store(o)  # Q's buffer is free: this warpgroup's last Q K^T has completed
        fence_async_shared()
        async_store(o_desc, [o_row + WG * _ROWS, 0], q)
        # m is in log2 units of the scaled scores; L in natural log.
        rows = o_row + WG * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
        gl.store(L + rows, gl.where(empty, float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453))
        tma.store_wait(0)

    @gluon.jit
    def _consumer0(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        kv_empty,
        turn,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HAS_SINK: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        _consumer(
            0,
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            q_smem,
            k_smem,
            v_smem,
            q_ready,
            k_ready,
            v_ready,
            kv_empty,
            turn,
            L,
            Sink,
            qk_scale,
            N_Q,
            N_K,
            H,
            GROUP,
            Q_COLS,
            KV_COLS,
            HEAD_DIM,
            HAS_SINK,
            CAUSAL,
        )

    @gluon.jit
    def _consumer1(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        kv_empty,
        turn,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HAS_SINK: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        _consumer(
            1,
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            q_smem,
            k_smem,
            v_smem,
            q_ready,
            k_ready,
            v_ready,
            kv_empty,
            turn,
            L,
            Sink,
            qk_scale,
            N_Q,
            N_K,
            H,
            GROUP,
            Q_COLS,
            KV_COLS,
            HEAD_DIM,
            HAS_SINK,
            CAUSAL,
        )

    @gluon.jit
    def _attn_fwd_gluon(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        L,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """The kernel without a sink. Two entry points over one body (``_attn_fwd``, HAS_SINK a constexpr) so
        that this one keeps its arguments: no pointer it never reads, the same build as before sinks."""
        _attn_fwd(
            q_desc, k_desc, v_desc, o_desc, L, L, qk_scale, N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, False, CAUSAL
        )

    @gluon.jit
    def _attn_fwd_gluon_sink(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """The kernel with attention sinks: Sink (H,) float32."""
        _attn_fwd(
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            L,
            Sink,
            qk_scale,
            N_Q,
            N_K,
            H,
            GROUP,
            Q_COLS,
            KV_COLS,
            HEAD_DIM,
            True,
            CAUSAL,
        )

    @gluon.jit
    def _attn_fwd(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        L,
        Sink,
        qk_scale,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HAS_SINK: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a buffer
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # The worker partitions take one signature, so every partition gets the whole list; it is spelled
        # out here because a tuple bound to a name first loses its constexprs.
        # side-by-side: gluon-partitions
        gl.warp_specialize(
            [
                (
                    _consumer0,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        o_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        turn,
                        L,
                        Sink,
                        qk_scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        Q_COLS,
                        KV_COLS,
                        HEAD_DIM,
                        HAS_SINK,
                        CAUSAL,
                    ),
                ),
                (
                    _consumer1,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        o_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        turn,
                        L,
                        Sink,
                        qk_scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        Q_COLS,
                        KV_COLS,
                        HEAD_DIM,
                        HAS_SINK,
                        CAUSAL,
                    ),
                ),
                (
                    _loader,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        o_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        k_ready,
                        v_ready,
                        kv_empty,
                        turn,
                        L,
                        Sink,
                        qk_scale,
                        N_Q,
                        N_K,
                        H,
                        GROUP,
                        Q_COLS,
                        KV_COLS,
                        HEAD_DIM,
                        HAS_SINK,
                        CAUSAL,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _LOADER_REGS],
        )
        # side-by-side: end
