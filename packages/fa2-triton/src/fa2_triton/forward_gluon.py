"""fa2-triton's Hopper forward in Gluon (``triton.experimental.gluon``): warp-specialised, on warpgroup MMA.

Where ``forward_tl.py``'s kernel leaves the schedule to Triton's compiler, this one writes it down, as
FlashAttention-3 does: one CTA per query tile of a (batch, head), 64 rows a consumer warpgroup, has these
partitions,

- a loader warp that issues every copy: the consumers' 64-row blocks of Q once, then K and V tile after tile
  (128 keys) through TMA into a ring of ``STAGES`` shared-memory buffers, each with a ready mbarrier the copy
  completes and an empty one every consumer arrives at when its MMAs have read the buffer;
- the consumer warpgroups, 64 query rows each. A step of one issues P V of the previous key tile and
  S = Q K^T of this one as asynchronous warpgroup MMAs (``warpgroup_mma``, P from registers), waits for
  both, then runs the online softmax. They take turns to issue (``turn`` mbarriers, warpgroup w waiting for
  its own and arriving at (w + 1)'s), so one's softmax runs while another's MMAs keep the tensor cores busy.

The build is a head_dim's (``CONFIGS``, the kernel's constexprs after CAUSAL):

- head_dim 128: two consumers (128-row query tiles: ping-pong), three K/V stages; Q and O copied through 2-D
  views of all heads' rows, so seqlen_q a multiple of 128 (a tile past a head's end would read, or write, the
  next head's rows);
- head_dim 64 (FlashAttention-3's tile there: at 64 a step's MMAs take half as long while its softmax does
  not, and two warpgroups no longer cover each other's): three consumers (192-row query tiles), six stages;
  Q and O copied through 3-D views bounded per head (``_rows_3d``), so seqlen_q is any length: the last
  query tile reads zeros past seqlen_q, its O rows there are not stored (TMA drops them) and its L rows are
  masked. Measured on an H100 (docs/notes/gluon-forward.md), it runs where it was faster than the tl
  kernel: seqlen_k >= ``D64_MIN_KEYS`` without a mask, seqlen_q >= ``D64_MIN_CAUSAL_QUERIES`` causal
  (FA2_TRITON_GLUON_D64=0 turns it off).

The kernel's outputs are the tl kernel's: O (batch, heads, seqlen_q, head_dim) contiguous, staged in the
consumer's Q buffer and stored by TMA, and L = m + log(l) in natural log. It is launched through
``fa2_triton.launch`` as the tl kernels are: Triton's dispatch once per class of inputs, not every call
(on the H200 its host time had made fa2.attention's calls at N = 512 wait on the host).

Which inputs take it (``uses_gluon``), as measured on the H200 (docs/notes/gluon-forward.md): a Hopper GPU
(compute capability 9.0) with Gluon's Hopper API importable, not the interpreter; fp16 or bf16; head_dim in
``HEAD_DIMS`` (128 and 64, the latter on long enough calls: ``pays``); no window, no softcap, no ALiBi, no
packed batch, no KV cache (a sink is fine: ``_attn_fwd_gluon_sink``, the same body with HAS_SINK, adds it in
the consumers' epilogue); causal only where ``CAUSAL`` is on (the default; FA2_TRITON_GLUON_CAUSAL=0 turns it off) and
seqlen_k >= seqlen_q. At head_dim 128 each query tile t then reads the key tiles up to its diagonal one and
masks that one alone (bottom-right aligned, here with seqlen_q = 256, seqlen_k = 384, tiles of 128 as
blocks)::

    query tile 0:  [ whole ][ diag  ][ -     ]
    query tile 1:  [ whole ][ whole ][ diag  ]

At head_dim 64 a query tile of 192 rows spans a band of 192 diagonal keys, across up to three key tiles
(``_band``): every consumer runs the same tiles, up to the one holding the last row's diagonal key; the
tiles before the first row's diagonal key run unmasked and the band's masked, for every row (a row that sees
none of a masked tile's keys keeps its m: ``m_safe``). With seqlen_q = seqlen_k = 512::

    query tile 0 (rows 0-191):    [ band  ][ band  ][ -     ][ -     ]
    query tile 1 (rows 192-383):  [ whole ][ band  ][ band  ][ -     ]
    query tile 2 (rows 384-511):  [ whole ][ whole ][ whole ][ band  ]

seqlen_k a multiple of 128 (K and V are copied through 2-D views of all heads' rows); seqlen_q a multiple of
128 at head_dim 128, any at 64; each of q, k, v with its heads' rows contiguous, (batch, heads, seqlen,
head_dim), or interleaved, (batch, seqlen, heads, head_dim) as flash-attn's layout, 16-byte aligned;
batch·heads at most 65,535 (the grid's second axis); not a short call (``tiles.short_call``: a call bound by
the host, where the four descriptors' host time outweighs what the kernel saves). Grouped-query attention is
in the kernel (query head h reads key/value head h // group). Everything else runs ``forward_tl.py``'s kernel;
the choice depends on the inputs alone, and an error in this kernel is raised, never retried on the other one.

A persistent variant of the same body (``PERSISTENT``, FA2_TRITON_GLUON_PERSISTENT=1; built offline, not yet
measured on a GPU, so off by default), FlashAttention-3's grid: a CTA an SM (``PERSISTENT_CTAS``), CTA p
taking work tiles p, p + P, ... (``work_tile``: without a mask a head's query tiles one after another; causal,
the longest first across a section of heads whose K and V fit L2 together). Every partition walks the same
work tiles, and the barriers' phases run on across them: the K/V ring's position counts the CTA's steps over
all its tiles (a tile's last buffer released after its last P V), Q's ready barrier completes once a tile, and
the turns go round a tile's steps and its last P V. The loader fetches a tile's first K/V tiles (as many as the
ring holds) while the consumers finish the previous tile, then waits on ``q_free`` (every consumer arrives once
its O store, staged in its Q buffer, has read it) before that tile's Q.

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
import triton

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

BLOCK_N = 128  # keys a K/V tile
MAX_GRID_Y = 65535
ROWS = 64  # query rows of one consumer warpgroup


class Config(NamedTuple):
    """The kernel's build for one head_dim (``CONFIGS``)."""

    # Consumer warpgroups of ROWS query rows: a CTA's query tile is consumers · ROWS rows.
    consumers: int
    # K/V buffers: as many as a CTA's 227 KB of shared memory holds beside Q's.
    stages: int
    # Registers a thread at launch (``maxnreg``). Triton pads the worker partitions to whole warpgroups (the
    # loader's one warp takes a warpgroup of four), so 4 · (consumers + 1) warps must fit the 64K.
    maxnreg: int
    # Registers a thread the worker consumers ask for (``gl.warp_specialize``); the loader asks for
    # LOADER_REGS, and the first consumer (the default partition) gets what is left: 64K less the others'.
    consumer_regs: int
    # Q and O copied through 3-D views bounded per head, (batch·heads, seqlen_q, head_dim) or (batch,
    # seqlen_q, heads·head_dim): TMA reads zeros past seqlen_q and drops stores there, so seqlen_q need not be
    # a multiple of the query tile (L's store is masked). Without it, 2-D views of all heads' rows.
    q_tail: bool


LOADER_REGS = 24
CONFIGS = {
    # Two consumers, 128 query rows, three stages (3 x 2 x 32 KB, with Q's 32 KB 224 KB); 12 warps x 168 at
    # launch fill the 64K, then 240 a consumer and 24 the loader.
    128: Config(consumers=2, stages=3, maxnreg=168, consumer_regs=240, q_tail=False),
    # Three consumers, 192 query rows (FlashAttention-3's head_dim 64 tile), six stages (6 x 2 x 16 KB, with
    # Q's 24 KB 216 KB); 16 warps x 128 at launch, then 160 the two worker consumers, 24 the loader's
    # warpgroup and 168 the first consumer (65,536 - 2 x 128 x 160 - 128 x 24 = 128 x 168).
    64: Config(consumers=3, stages=6, maxnreg=128, consumer_regs=160, q_tail=True),
}
# The head dims fa2-triton's forward sends to this kernel (``takes``); FA2_TRITON_GLUON_D64=0 leaves head dim 64
# to the tl kernel. Read once; tests set the attribute.
HEAD_DIMS = (128,) if os.environ.get("FA2_TRITON_GLUON_D64") == "0" else (64, 128)
# Head dim 64's three-consumer build against the tl kernel on an H100 (bf16, 16k tokens, H 32,
# docs/notes/gluon-forward.md): without a mask 0.99x at N = 2k, 1.06-1.10x from 4k; causal 0.64x / 0.87x at 2k / 4k
# (a query tile's band of masked key tiles is then a large share of its steps), 1.05x / 1.08x at 8k / 16k. So it
# takes calls of at least these many keys (no mask) or queries (causal).
D64_MIN_KEYS = 4096
D64_MIN_CAUSAL_QUERIES = 8192
# Causal attention on this kernel (the diagonal tile masked, the tiles past it never loaded): on the H200 at
# 0a7f704 (16k tokens, H 16, D 128, N 2k-16k) 452-578 TFLOP/s bf16 against the tl kernel's 430-490 and
# cuDNN's 491-567 (docs/notes/gluon-forward.md). FA2_TRITON_GLUON_CAUSAL=0 sends causal inputs to the tl
# kernel. Read once; tests set the attribute.
CAUSAL = os.environ.get("FA2_TRITON_GLUON_CAUSAL", "1") != "0"
# A persistent grid (FlashAttention-3's): a CTA an SM, each walking work tiles (query tile, batch·head) in the
# order ``work_tile`` gives, so that its loader fetches a tile's first K/V tiles while the consumers finish the
# previous tile. Built offline, not yet measured on a GPU: off unless FA2_TRITON_GLUON_PERSISTENT=1. Read once;
# tests set the attribute (plans are kept per setting).
PERSISTENT = os.environ.get("FA2_TRITON_GLUON_PERSISTENT") == "1"
# The persistent grid's CTAs: None, the GPU's SMs (never more than the work tiles); tests set a few, so that
# every CTA walks several work tiles at small sizes.
PERSISTENT_CTAS: int | None = None
# Causal, the persistent order walks the heads in sections whose K and V fit this much of L2 together
# (FlashAttention-3's 32 MB of the H100's 50 MB): ``section_heads``. 0: one section, the longest tiles first
# across all heads. A constexpr of the persistent build; tests and probes set the attribute.
L2_BYTES = 32 * 1024 * 1024


def uses_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether fa2-triton's forward runs this module's kernel on these inputs (the module docstring says
    which, and why): a device that can run it, inputs it takes, and a call long enough that its four
    descriptors' host time pays (not ``tiles.short_call``)."""
    return _on_hopper(q.device) and not short_call(q, k) and takes(q, k, v, spec) and pays(q, k, spec)


def pays(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the kernel is measured faster than the tl one on inputs it takes: always at head dim 128; at 64
    from ``D64_MIN_KEYS`` keys without a mask, ``D64_MIN_CAUSAL_QUERIES`` queries causal."""
    if q.shape[-1] != 64:
        return True
    return q.shape[2] >= D64_MIN_CAUSAL_QUERIES if spec.causal else k.shape[2] >= D64_MIN_KEYS


def _on_hopper(device: torch.device) -> bool:
    return GLUON and on_hopper(device)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the kernel takes these inputs, whatever the device."""
    head_dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or head_dim not in HEAD_DIMS:
        return False
    if spec.softcap or spec.alibi_slopes is not None or spec.varlen:
        return False
    # Causal with at least as many keys as queries: every query tile then sees its diagonal tile.
    if spec.masked and not (CAUSAL and spec.causal and k.shape[2] >= q.shape[2]):
        return False
    if q.numel() == 0 or k.numel() == 0 or k.shape[2] % BLOCK_N:
        return False
    if q.shape[2] % (CONFIGS[head_dim].consumers * ROWS) and not CONFIGS[head_dim].q_tail:
        return False
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:  # the grid's second axis is batch·heads
        return False
    layouts = [_rows_layout(t) for t in (q, k, v)]
    return None not in layouts and layouts[1] == layouts[2] and all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def section_heads(batch_heads: int, seqlen_k: int, head_dim: int, group: int, l2_bytes: int) -> int:
    """Causal, the persistent order's heads a section: as many as have their K and V (2-byte elements, a
    key/value head shared by ``group`` query heads) within ``l2_bytes`` (``L2_BYTES``) together; at least 1, at
    most all; all with ``l2_bytes`` 0."""
    if not l2_bytes:
        return batch_heads
    return min(max(l2_bytes // (4 * head_dim) // seqlen_k * group, 1), batch_heads)


def work_tile(w: int, query_tiles: int, batch_heads: int, section: int, causal: bool) -> tuple[int, int]:
    """Work tile w of the persistent grid: (query tile t, batch·head bh), as the kernel's ``_work`` computes
    it; CTA p of P takes w = p, p + P, p + 2P, ... Without a mask a head's query tiles one after another (the
    CTAs at work at once share a few heads' K and V); causal, the heads in sections of ``section`` heads
    (``section_heads``: their K and V in L2 together), within a section the query tiles last first across its
    heads: the tiles that see the most keys start first and the shortest end the section (the
    longest-processing-time order), the last section's shortest ending the call."""
    if causal:
        first = w // (section * query_tiles) * section
        heads = min(section, batch_heads - first)
        r = w - first * query_tiles
        return query_tiles - 1 - r // heads, first + r % heads
    return w % query_tiles, w // query_tiles


def persistent_ctas(work_tiles: int, device: torch.device) -> int:
    """The persistent grid: ``PERSISTENT_CTAS`` or the device's SMs, at most ``work_tiles``."""
    return min(PERSISTENT_CTAS or _sm_count(device), work_tiles)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple of
            heads_k, head_dim a key of ``CONFIGS``; fp16 or bf16 on a Hopper GPU; inputs that ``uses_gluon``
            accepts.
        spec: the scale, causal and the sink (no window, softcap, bias or packing: ``uses_gluon``).

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype, contiguous. L: (batch, heads, seqlen_q), float32,
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
        PERSISTENT,
        PERSISTENT_CTAS,
        L2_BYTES,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, O, spec)
    q_desc, k_desc, v_desc, o_desc = (
        copy_descriptor(GluonTensorDescriptor, d, t)
        for d, t in zip(plan.descriptors, _views(q, k, v, O, plan.q_cols, plan.kv_cols, plan.config.q_tail))
    )
    if sink is None:
        kernel, args = _attn_fwd_gluon, (q_desc, k_desc, v_desc, o_desc, L, *plan.scalars)
    else:
        kernel, args = _attn_fwd_gluon_sink, (q_desc, k_desc, v_desc, o_desc, L, sink, *plan.scalars)
    if plan.classes is None:
        plan = _PLANS.keep(key, plan._replace(classes=arg_classes(args)))
    options = dict(num_warps=4, maxnreg=plan.config.maxnreg)
    with on_device(q.device):
        launch(kernel, plan.grid, args, plan.constexprs, options, plan.classes)
    return O, L


class _Plan(NamedTuple):
    """What ``flash_attn_forward`` works out from the inputs' shapes, strides, dtype, alignment and the spec,
    but for the tensors: kept per class of inputs (``_PLANS``)."""

    config: Config
    q_cols: bool
    kv_cols: bool
    # Q's, K's, V's and O's descriptors but for their base (GluonTensorDescriptor's fields).
    descriptors: tuple[dict, ...]
    # (query tiles, batch·heads), or with PERSISTENT (CTAs,).
    grid: tuple[int, ...]
    scalars: tuple
    constexprs: dict
    # The launch's argument classes (``fa2_triton.launch.arg_classes``), once a launch has met them.
    classes: tuple | None = None


# (shapes, strides, dtype, device, the 16-byte alignment of O, L and the sink, the spec's scale and causal,
# PERSISTENT, PERSISTENT_CTAS and L2_BYTES) -> _Plan.
# q, k and v are 16-byte aligned here (``takes``).
_PLANS = Plans()


def _plan(q, k, v, O, spec: AttentionSpec) -> _Plan:
    """The launch of ``flash_attn_forward``'s inputs: the four descriptors built and checked by Gluon once a
    class (~3 µs each of host time on the H200), then copied (``launch.copy_descriptor``)."""
    batch, heads, seqlen_q, head_dim = q.shape
    config = CONFIGS[head_dim]
    q_layout, kv_layout = _smem_layouts(q.dtype, head_dim)
    q_cols, kv_cols = _rows_layout(q), _rows_layout(k)
    q_view, k_view, v_view, o_view = _views(q, k, v, O, q_cols, kv_cols, config.q_tail)
    q_block = [1, ROWS, head_dim] if config.q_tail else [ROWS, head_dim]
    descriptors = (
        GluonTensorDescriptor.from_tensor(q_view, q_block, q_layout),
        GluonTensorDescriptor.from_tensor(k_view, [BLOCK_N, head_dim], kv_layout),
        GluonTensorDescriptor.from_tensor(v_view, [BLOCK_N, head_dim], kv_layout),
        GluonTensorDescriptor.from_tensor(o_view, q_block, q_layout),
    )
    query_tiles = triton.cdiv(seqlen_q, config.consumers * ROWS)
    if PERSISTENT:
        grid = (persistent_ctas(query_tiles * batch * heads, q.device),)
    else:
        grid = (query_tiles, batch * heads)
    return _Plan(
        config,
        q_cols,
        kv_cols,
        tuple({**d.__dict__, "base": None} for d in descriptors),
        grid,
        (spec.scale * LOG2_E, seqlen_q, k.shape[2], heads, group_size(q, k)),
        _constexprs(config, q_cols, kv_cols, head_dim, spec.causal, PERSISTENT, L2_BYTES if PERSISTENT else 0),
    )


def _constexprs(
    config: Config,
    q_cols: bool,
    kv_cols: bool,
    head_dim: int,
    causal: bool,
    persistent: bool = False,
    l2_bytes: int = 0,
) -> dict:
    """The kernel's constexprs, in the order of its parameters (``l2_bytes``: ``L2_BYTES`` of a persistent build,
    else 0)."""
    return dict(
        Q_COLS=q_cols,
        KV_COLS=kv_cols,
        HEAD_DIM=head_dim,
        CAUSAL=causal,
        NUM_CONSUMERS=config.consumers,
        STAGES=config.stages,
        Q_TAIL=config.q_tail,
        CONSUMER_REGS=config.consumer_regs,
        PERSISTENT=persistent,
        L2_BYTES=l2_bytes,
    )


def _views(q, k, v, O, q_cols: bool, kv_cols: bool, q_tail: bool) -> tuple[torch.Tensor, ...]:
    """The tensors the copies read and write: K's and V's rows in 2-D (``_rows_2d``); Q's and O's the same, or
    with ``q_tail`` in 3-D, a plane a head (``_rows_3d``)."""
    if q_tail:
        return _rows_3d(q, q_cols), _rows_2d(k, kv_cols), _rows_2d(v, kv_cols), _rows_3d(O, False)
    return _rows_2d(q, q_cols), _rows_2d(k, kv_cols), _rows_2d(v, kv_cols), O.view(-1, O.shape[3])


def _rows_2d(t: torch.Tensor, heads_in_cols: bool) -> torch.Tensor:
    """t's rows as the 2-D tensor the copies read: (batch·heads·seqlen, head_dim) or
    (batch·seqlen, heads·head_dim)."""
    if heads_in_cols:
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1] * t.shape[3])
    return t.reshape(-1, t.shape[3])


def _rows_3d(t: torch.Tensor, heads_in_cols: bool) -> torch.Tensor:
    """t's rows as a 3-D tensor whose middle axis is one head's seqlen, so that a copy past a head's last row
    stays in that head (zeros read, nothing written): (batch·heads, seqlen, head_dim) or (batch, seqlen,
    heads·head_dim)."""
    if heads_in_cols:
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], t.shape[1] * t.shape[3])
    return t.reshape(-1, t.shape[2], t.shape[3])


@functools.cache
def _smem_layouts(dtype: torch.dtype, head_dim: int):
    """Q's (and O's) and K's (and V's) shared-memory layouts at ``head_dim``: the copies' blocks."""
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    q_block = [1, ROWS, head_dim] if CONFIGS[head_dim].q_tail else [ROWS, head_dim]
    return (
        gl.NVMMASharedLayout.get_default_for(q_block, gdtype),
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], gdtype),
    )


if GLUON:
    _ROWS = gl.constexpr(ROWS)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    # The copies' names since Triton 3.7 (async_load, async_store), else 3.6's; the backward's kernels take
    # them from here.
    async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    async_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _LOADER_REGS = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _tile(CAUSAL: gl.constexpr):
        """The query tile t and batch·head bh of this CTA's one work tile (the grid without PERSISTENT). Causal,
        the tiles run last first: the last sees the most keys, and the short ones then fill the GPU's last
        wave."""
        t = gl.program_id(0)
        if CAUSAL:
            t = gl.num_programs(0) - 1 - t
        bh = gl.program_id(1)
        return t, bh

    @gluon.jit
    def _work_tiles(
        o_desc,
        N_Q,
        N_K,
        GROUP,
        HEAD_DIM: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
        Q_TAIL: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        """The persistent grid's work: query tiles a head, batch·heads (O's rows over N_Q, or with Q_TAIL its
        planes) and the causal order's heads a section (``section_heads``)."""
        n_tiles = gl.cdiv(N_Q, NUM_CONSUMERS * _ROWS)
        if Q_TAIL:
            bh_count = o_desc.shape[0]
        else:
            bh_count = o_desc.shape[0] // N_Q
        if L2_BYTES == 0:
            section = bh_count
        else:
            section = gl.minimum(gl.maximum((L2_BYTES // (4 * HEAD_DIM)) // N_K * GROUP, 1), bh_count)
        return n_tiles, bh_count, section

    @gluon.jit
    def _work(w, n_tiles, bh_count, section, CAUSAL: gl.constexpr):
        """Work tile w's query tile t and batch·head bh, as ``work_tile`` gives them: without a mask a head's
        tiles one after another; causal, heads in sections whose K and V fit L2 together, within a section the
        tiles last first across its heads (the longest first: LPT)."""
        if CAUSAL:
            first = w // (section * n_tiles) * section
            heads = gl.minimum(section, bh_count - first)
            r = w - first * n_tiles
            t = n_tiles - 1 - r // heads
            bh = first + r % heads
        else:
            t = w % n_tiles
            bh = w // n_tiles
        return t, bh

    @gluon.jit
    def _coords(
        t,
        bh,
        N_Q,
        N_K,
        H,
        GROUP,
        Q_COLS: gl.constexpr,
        KV_COLS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
        Q_TAIL: gl.constexpr,
    ):
        """Where the copies of query tile t of batch·head bh start: Q's (q_plane, q_row, q_col), K's and V's
        (kv_row, kv_col, in the 2-D views) and O's (o_row). Q and O are 2-D views of every head's rows (q_plane
        unused), or with Q_TAIL 3-D views (``_rows_3d``) whose planes are heads (O's: plane bh) or, in
        flash-attn's layout, batches (Q's: plane b), the rows then counted within the head."""
        b = bh // H
        h = bh % H
        h_k = h // GROUP
        if Q_TAIL:
            o_row = t * (NUM_CONSUMERS * _ROWS)
            q_row = o_row
            if Q_COLS:
                q_plane = b
                q_col = h * HEAD_DIM
            else:
                q_plane = bh
                q_col = 0
        else:
            q_plane = bh
            o_row = bh * N_Q + t * (NUM_CONSUMERS * _ROWS)
            if Q_COLS:
                q_row = b * N_Q + t * (NUM_CONSUMERS * _ROWS)
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
        return q_plane, q_row, q_col, kv_row, kv_col, o_row

    @gluon.jit
    def key_tiles(t, N_Q, N_K, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """The key tiles of BLOCK_N keys query tile t sees: every one, or causal (N_K >= N_Q, both multiples
        of the tiles, query tiles of BLOCK_N rows), those up to its diagonal tile, which holds key
        i + N_K - N_Q of each row i. Also the dQ kernel's (``backward_gluon``)."""
        if CAUSAL:
            return t + 1 + (N_K - N_Q) // BLOCK_N
        return N_K // BLOCK_N

    @gluon.jit
    def _band(t, N_Q, N_K, BLOCK_M: gl.constexpr):
        """Causal, query tiles of BLOCK_M rows, more than a key tile's (N_K >= N_Q, N_K a multiple of the key
        tiles, N_Q any): the key tiles query tile t reads, n, up to the one holding the diagonal key of its last
        row below N_Q; and n_whole, how many of them every row of the tile sees whole, up to the diagonal key
        of its first row. The n - n_whole after those (up to three at BLOCK_M = 192) are the band, which some row
        masks."""
        first = t * BLOCK_M + N_K - N_Q
        last = gl.minimum(t * BLOCK_M + BLOCK_M, N_Q) - 1 + N_K - N_Q
        return (first + 1) // _BLOCK_N, last // _BLOCK_N + 1

    @gluon.jit
    def _key_tiles(t, N_Q, N_K, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr):
        """The key tiles query tile t reads: ``key_tiles``, or causal with query tiles taller than a key tile,
        ``_band``'s n."""
        if CAUSAL:
            if NUM_CONSUMERS * _ROWS == _BLOCK_N:
                n = key_tiles(t, N_Q, N_K, _BLOCK_N, CAUSAL)
            else:
                n_whole, n = _band(t, N_Q, N_K, NUM_CONSUMERS * _ROWS)
        else:
            n = key_tiles(t, N_Q, N_K, _BLOCK_N, CAUSAL)
        return n

    @gluon.jit
    def _load_q(q_desc, q_smem, q_ready, q_plane, q_row, q_col, NUM_CONSUMERS: gl.constexpr, Q_TAIL: gl.constexpr):
        """The consumers' blocks of Q, one arrival on q_ready with their bytes."""
        mbarrier.expect(q_ready, NUM_CONSUMERS * q_desc.block_type.nbytes)
        for wg in gl.static_range(NUM_CONSUMERS):
            if Q_TAIL:
                async_load(q_desc, [q_plane, q_row + wg * _ROWS, q_col], q_ready, q_smem.index(wg))
            else:
                async_load(q_desc, [q_row + wg * _ROWS, q_col], q_ready, q_smem.index(wg))

    @gluon.jit
    def _load_kv(
        r, j, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, STAGES: gl.constexpr
    ):
        """Key tile j of a work tile into the ring's buffer of step r, the CTA's steps counted over its work
        tiles (j itself without PERSISTENT)."""
        s = r % STAGES
        # A fresh barrier counts its phase before the first as complete: the first pass does not wait.
        mbarrier.wait(kv_empty.index(s), ((r // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        async_load(k_desc, [kv_row + j * _BLOCK_N, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        async_load(v_desc, [kv_row + j * _BLOCK_N, kv_col], v_ready.index(s), v_smem.index(s))

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
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        if PERSISTENT:
            n_tiles, bh_count, section = _work_tiles(o_desc, N_Q, N_K, GROUP, HEAD_DIM, NUM_CONSUMERS, Q_TAIL, L2_BYTES)
            c = 0  # the CTA's K/V steps so far, over its work tiles: the ring's position
            i = 0  # the CTA's work tiles so far
            for w in range(gl.program_id(0), n_tiles * bh_count, gl.num_programs(0)):
                t, bh = _work(w, n_tiles, bh_count, section, CAUSAL)
                q_plane, q_row, q_col, kv_row, kv_col, o_row = _coords(
                    t, bh, N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, NUM_CONSUMERS, Q_TAIL
                )
                n = _key_tiles(t, N_Q, N_K, NUM_CONSUMERS, CAUSAL)
                # The first key tiles before Q, while the consumers finish the previous work tile: as many as the
                # ring has buffers, which that tile's steps release (more would wait on this tile's own steps,
                # which wait for Q: a deadlock).
                ahead = gl.minimum(n, STAGES)
                for j in range(ahead):
                    _load_kv(
                        c + j, j, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, STAGES
                    )
                # Q's buffers hold the previous work tile's O until every consumer's store has read them.
                mbarrier.wait(q_free, (i & 1) ^ 1)
                _load_q(q_desc, q_smem, q_ready, q_plane, q_row, q_col, NUM_CONSUMERS, Q_TAIL)
                for j in range(ahead, n):
                    _load_kv(
                        c + j, j, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, STAGES
                    )
                c += n
                i += 1
        else:
            t, bh = _tile(CAUSAL)
            q_plane, q_row, q_col, kv_row, kv_col, o_row = _coords(
                t, bh, N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, NUM_CONSUMERS, Q_TAIL
            )
            _load_q(q_desc, q_smem, q_ready, q_plane, q_row, q_col, NUM_CONSUMERS, Q_TAIL)
            for j in range(_key_tiles(t, N_Q, N_K, NUM_CONSUMERS, CAUSAL)):
                _load_kv(j, j, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, kv_row, kv_col, STAGES)

    @gluon.jit
    def _turn_wait(turn, k, WG: gl.constexpr):
        # The consumers issue in turn, 0, 1, (2,) 0, ...: warpgroup WG's turn k is the k-th completion of
        # turn[WG] (the previous warpgroup's arrival), warpgroup 0's the (k - 1)-th, so that its first wait is
        # on the phase a fresh barrier counts as complete.
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 if WG == 0 else 0))

    @gluon.jit
    def _step(
        j,
        c,
        i,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        HAS_PREV: gl.constexpr,
        MASK: gl.constexpr,
    ):
        """Key tile j: P V of tile j - 1 (HAS_PREV) and S = Q K_j^T issued in this warpgroup's turn (then the
        next warpgroup's, (WG + 1) % NUM_CONSUMERS), then the online softmax of S, with MASK (a causal
        diagonal tile) the keys past last_key + r hidden from the warpgroup's row r. Returns P (as the next
        MMA's register operand), O, m, l. With PERSISTENT the CTA's earlier work tiles took c steps of the K/V
        ring and c + i turns (i tiles, each its steps and its last P V); without, c = i = 0."""
        # side-by-side: gluon-step
        r = c + j  # the step's place in the K/V ring
        s = r % STAGES
        mbarrier.wait(k_ready.index(s), (r // STAGES) & 1)
        sp = (r + STAGES - 1) % STAGES
        if HAS_PREV:
            mbarrier.wait(v_ready.index(sp), ((r - 1) // STAGES) & 1)
        _turn_wait(turn, r + i, WG)
        if HAS_PREV:
            acc = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        S = warpgroup_mma(
            q,
            k_smem.index(s).permute((1, 0)),
            gl.zeros([_ROWS, _BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        mbarrier.arrive(turn.index((WG + 1) % NUM_CONSUMERS), count=1)
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
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        """Consumer warpgroup WG: its one work tile, or with PERSISTENT the CTA's (``_work``), one after another."""
        if PERSISTENT:
            n_tiles, bh_count, section = _work_tiles(o_desc, N_Q, N_K, GROUP, HEAD_DIM, NUM_CONSUMERS, Q_TAIL, L2_BYTES)
            c = 0  # the CTA's K/V steps so far, over its work tiles: the ring's position
            i = 0  # the CTA's work tiles so far; turns so far c + i (a tile takes its steps and its last P V)
            for w in range(gl.program_id(0), n_tiles * bh_count, gl.num_programs(0)):
                t, bh = _work(w, n_tiles, bh_count, section, CAUSAL)
                n = _consumer_tile(
                    WG,
                    t,
                    bh,
                    c,
                    i,
                    q_desc,
                    k_desc,
                    v_desc,
                    o_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_free,
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
                    NUM_CONSUMERS,
                    STAGES,
                    Q_TAIL,
                    PERSISTENT,
                    L2_BYTES,
                )
                c += n
                i += 1
        else:
            t, bh = _tile(CAUSAL)
            _consumer_tile(
                WG,
                t,
                bh,
                0,
                0,
                q_desc,
                k_desc,
                v_desc,
                o_desc,
                q_smem,
                k_smem,
                v_smem,
                q_ready,
                q_free,
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
                NUM_CONSUMERS,
                STAGES,
                Q_TAIL,
                PERSISTENT,
                L2_BYTES,
            )

    @gluon.jit
    def _consumer_tile(
        WG: gl.constexpr,
        t,
        bh,
        c,
        i,
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        """Work tile (t, bh) of consumer warpgroup WG, after c steps of the K/V ring and i work tiles of the CTA
        (both 0 without PERSISTENT): its Q, its steps, O and L stored. Returns its steps."""
        q_plane, q_row, q_col, kv_row, kv_col, o_row = _coords(
            t, bh, N_Q, N_K, H, GROUP, Q_COLS, KV_COLS, HEAD_DIM, NUM_CONSUMERS, Q_TAIL
        )
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        if Q_TAIL:
            q = q_smem.index(WG).reshape([_ROWS, HEAD_DIM])  # the 3-D copies' [1, ROWS, HEAD_DIM] block
        else:
            q = q_smem.index(WG)
        mbarrier.wait(q_ready, i & 1)
        m_i = gl.full([_ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
        p = gl.zeros([_ROWS, _BLOCK_N], q_desc.dtype, p_layout)
        n = _key_tiles(t, N_Q, N_K, NUM_CONSUMERS, CAUSAL)
        # The key on the diagonal of this warpgroup's first row (causal): the last it sees.
        last_key = t * (NUM_CONSUMERS * _ROWS) + WG * _ROWS + N_K - N_Q
        if CAUSAL:
            if NUM_CONSUMERS * _ROWS == _BLOCK_N:
                # Only the last tile, the diagonal one, is masked; the tiles before it are whole.
                if n == 1:
                    p, acc, m_i, l_i = _step(
                        0,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        False,
                        True,
                    )
                else:
                    p, acc, m_i, l_i = _step(
                        0,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        False,
                        False,
                    )
                    for j in range(1, n - 1):
                        p, acc, m_i, l_i = _step(
                            j,
                            c,
                            i,
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
                            NUM_CONSUMERS,
                            STAGES,
                            True,
                            False,
                        )
                    p, acc, m_i, l_i = _step(
                        n - 1,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        True,
                        True,
                    )
            else:
                # Query tiles taller than a key tile: the diagonal band crosses up to three key tiles. Every
                # consumer runs the same tiles (the turns go round once a tile), and the tiles that any row of
                # the CTA masks are masked for all (a row may see none of one: m_safe keeps it NaN-free).
                n_whole, n = _band(t, N_Q, N_K, NUM_CONSUMERS * _ROWS)
                # The most key tiles a band covers: its keys, the first row's diagonal key + 1 to the last
                # row's, are BLOCK_M - 1 at most (3 tiles at BLOCK_M = 192).
                BAND: gl.constexpr = (NUM_CONSUMERS * _ROWS - 2) // _BLOCK_N + 2
                if n_whole == 0:
                    p, acc, m_i, l_i = _step(
                        0,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        False,
                        True,
                    )
                else:
                    p, acc, m_i, l_i = _step(
                        0,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        False,
                        False,
                    )
                for j in range(1, n_whole):
                    p, acc, m_i, l_i = _step(
                        j,
                        c,
                        i,
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
                        NUM_CONSUMERS,
                        STAGES,
                        True,
                        False,
                    )
                # The band, at most BAND tiles: unrolled, as a loop would keep the mask's column indices live
                # across the MMAs (hoisted out of it), which spills at 160 registers.
                j0 = gl.maximum(n_whole, 1)
                for u in gl.static_range(BAND):
                    if j0 + u < n:
                        p, acc, m_i, l_i = _step(
                            j0 + u,
                            c,
                            i,
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
                            NUM_CONSUMERS,
                            STAGES,
                            True,
                            True,
                        )
        else:
            p, acc, m_i, l_i = _step(
                0,
                c,
                i,
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
                NUM_CONSUMERS,
                STAGES,
                False,
                False,
            )
            for j in range(1, n):
                p, acc, m_i, l_i = _step(
                    j,
                    c,
                    i,
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
                    NUM_CONSUMERS,
                    STAGES,
                    True,
                    False,
                )
        last = (c + n - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((c + n - 1) // STAGES) & 1)
        _turn_wait(turn, c + i + n, WG)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        mbarrier.arrive(turn.index((WG + 1) % NUM_CONSUMERS), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if PERSISTENT:
            # The ring runs on into the next work tile: its last buffer is released too.
            mbarrier.arrive(kv_empty.index(last), count=1)

        # side-by-side: gluon-sink
        if HAS_SINK:
            # The sink joins the row's sum as one more score (log2 units) with no value: one more online
            # softmax step, a single column. l > 0 after it: a row with no finite score gets O = 0, L = sink.
            sink = gl.load(Sink + bh % H) * 1.4426950408889634
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
        # m is in log2 units of the scaled scores; L in natural log.
        if Q_TAIL:
            # The store drops O's rows past N_Q; L's are masked.
            async_store(o_desc, [bh, o_row + WG * _ROWS, 0], q_smem.index(WG))
            rows = o_row + WG * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
            lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
            gl.store(L + bh * N_Q + rows, lse, mask=rows < N_Q)
        else:
            async_store(o_desc, [o_row + WG * _ROWS, 0], q)
            rows = o_row + WG * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
            gl.store(L + rows, gl.where(empty, float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453))
        tma.store_wait(0)
        if PERSISTENT:
            # The store has read Q's buffer: the loader may fill it with the next work tile's Q.
            mbarrier.arrive(q_free, count=1)
        return n

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
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
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
            q_free,
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
            NUM_CONSUMERS,
            STAGES,
            Q_TAIL,
            PERSISTENT,
            L2_BYTES,
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
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
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
            q_free,
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
            NUM_CONSUMERS,
            STAGES,
            Q_TAIL,
            PERSISTENT,
            L2_BYTES,
        )

    @gluon.jit
    def _consumer2(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_free,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        _consumer(
            2,
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            q_smem,
            k_smem,
            v_smem,
            q_ready,
            q_free,
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
            NUM_CONSUMERS,
            STAGES,
            Q_TAIL,
            PERSISTENT,
            L2_BYTES,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        """The kernel without a sink. Two entry points over one body (``_attn_fwd``, HAS_SINK a constexpr) so
        that this one keeps its arguments: no pointer it never reads, the same build as before sinks. The
        constexprs after CAUSAL are a head_dim's ``Config``."""
        _attn_fwd(
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            L,
            L,
            qk_scale,
            N_Q,
            N_K,
            H,
            GROUP,
            Q_COLS,
            KV_COLS,
            HEAD_DIM,
            False,
            CAUSAL,
            NUM_CONSUMERS,
            STAGES,
            Q_TAIL,
            CONSUMER_REGS,
            PERSISTENT,
            L2_BYTES,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
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
            NUM_CONSUMERS,
            STAGES,
            Q_TAIL,
            CONSUMER_REGS,
            PERSISTENT,
            L2_BYTES,
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
        NUM_CONSUMERS: gl.constexpr,
        STAGES: gl.constexpr,
        Q_TAIL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PERSISTENT: gl.constexpr,
        L2_BYTES: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        if Q_TAIL:
            # A consumer's Q block as the 3-D copies write it, [1, ROWS, HEAD_DIM].
            q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, _ROWS, HEAD_DIM], q_desc.layout)
        else:
            q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, _ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        if PERSISTENT:
            # Every consumer's O store has read its Q buffer (the loader's wait before the next Q).
            q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_free, count=NUM_CONSUMERS)
        else:
            q_free = q_ready  # not waited on or arrived at: one work tile a CTA
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)  # every consumer releases a buffer
        for i in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(turn.index(i), count=1)
        # The worker partitions take one signature, so every partition gets the whole list; it is spelled
        # out here because a tuple bound to a name first loses its constexprs. The first partition (the
        # default) runs in the launch's four warps; the others' warps and registers follow.
        if NUM_CONSUMERS == 3:
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
                        ),
                    ),
                    (
                        _consumer2,
                        (
                            q_desc,
                            k_desc,
                            v_desc,
                            o_desc,
                            q_smem,
                            k_smem,
                            v_smem,
                            q_ready,
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
                        ),
                    ),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, _LOADER_REGS],
            )
        else:
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
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
                            q_free,
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
                            NUM_CONSUMERS,
                            STAGES,
                            Q_TAIL,
                            PERSISTENT,
                            L2_BYTES,
                        ),
                    ),
                ],
                [4, 1],
                [CONSUMER_REGS, _LOADER_REGS],
            )
            # side-by-side: end
