"""What fa2-numba-cuda's kernels and their launchers share: the SIMT forward's and backward's (``forward_simt``,
``backward_simt``), the tensor-core ones' (``forward_tc``, ``backward_tc``) and the KV-cache kernels'
(``kvcache_simt``, ``kvcache_tc``, ``kvcache_combine``, launched by ``kvcache``).

- the simulator switch (``simulated``) and what differs under it: no libdevice, no aligned shared arrays,
  numpy's float32, int32 and uint32 and plain ints for numba's slow scalar casts, and the simulator's
  ``cuda.shared.array`` made safe for the block's threads (``_shared_array``);
- bf16 as int16 bit patterns (``bf16_to_float``, ``float_to_bf16``) and the fp32 ``tanh`` of the softcap;
- ``Features``: an ``AttentionSpec``'s compile-time switches, with their runtime arguments (``feature_args``),
  the grid's extent and the packed batch's offsets (``grid_extent``, ``offset_args``, ``sequence``); the
  attention sink of the kernels that normalise (``with_sink``, ``sink_arg``), and its gradient's shares from
  the backward's preprocess (``dsink_arg``);
- the SIMT kernels' block (``BlockConfig``, ``padded_head_dim``, ``tile_loader``) and pre-scale
  (``score_scale``); the KV-cache split kernels' copy of a stage's K and V tiles from a contiguous or paged
  cache (``kv_loader``);
- the kernels' views of tensors (``flat_view``), whether cp.async can copy a tensor's rows (``rows_16b_aligned``)
  and the device check (``check_device``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import cuda, float32, int16, int32, int64, uint32, uint64

from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_numba_cuda.mma import cp_async_16, cp_async_commit, device_function, shared_address

MAX_HEAD_DIM = 256  # of the SIMT kernels and the KV-cache path (tensor cores: tensor_cores.MAX_HEAD_DIM)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def simulated() -> bool:
    """True when numba runs its CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before numba was imported)."""
    return bool(numba.config.ENABLE_CUDASIM)


def jit_kernel(kernel, max_registers: int | None):
    """``kernel`` compiled by numba, ptxas capped at max_registers a thread (None or 0: no cap); the simulator's
    jit takes no cap."""
    if simulated() or not max_registers:
        return cuda.jit(kernel)
    return cuda.jit(max_registers=max_registers)(kernel)


if simulated():
    # The simulator runs kernels as Python: it has no libdevice (numpy reinterprets the bits instead) and
    # refuses an alignment for shared arrays. On the GPU, 16 B aligned tiles let the 4-float shared loads
    # be single vector loads (ld.shared.v4.f32).
    SHARED_ALIGN = None

    def int_as_float(bits):
        """The fp32 whose bit pattern is the int32 ``bits`` (on the GPU, libdevice's int_as_float)."""
        return np.int32(bits).view(np.float32)

    def float_as_int(x):
        """The bit pattern of fp32 ``x`` as an int32 (on the GPU, libdevice's float_as_int)."""
        return np.float32(x).view(np.int32)

    # numba's scalar types are slow to call in the simulator, a type-system call each: uint64(i) takes about
    # 4 µs (and indexing with its result 8 µs), float32(x) about 10 µs, most of a simulated kernel's time.
    # The kernels' uint64 index casts (see forward_simt's module docstring) stay Python ints there, as the
    # indices are never negative; float32, int32 and uint32 are numpy's, which numba's call anyway (the same
    # rounding and wrapping; and dtypes for the shared and local arrays).
    def uint64(i):
        return i

    int64 = int

    float32 = np.float32
    int32, uint32 = np.int32, np.uint32

    # numba-cuda's simulator (0.30.4; unchanged on its main branch in July 2026) keeps one numpy array per
    # cuda.shared.array line of a launch, in a dict by (file, line), and declares it by a check, then a store.
    # The block's threads are Python threads: when the GIL passes from a thread between its check and its store
    # to another that declares the same line, each makes an array, and one thread is left with a "shared" array
    # of its own (its writes unseen by the block, np.empty's garbage read): now and then in CI, dq off by 0.9 or
    # a forward's first rows changing between identical calls. Here the store is a dict.setdefault, atomic under
    # the GIL, so that every thread gets the array stored first; keys and semantics are the simulator's.
    # The caller is named by its frame, cheaper than traceback.extract_stack, which looks up every frame's line.
    from numba.cuda.simulator import kernelapi as _kernelapi

    _simulator_shared_array = _kernelapi.FakeCUDAShared.array

    def _shared_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (one buffer), or the simulator's refusal
            if not isinstance(dtype, _kernelapi.types.Type):
                dtype = np.dtype(dtype)  # a numpy scalar type (int32 here is numpy's): the simulator wants a dtype
            return _simulator_shared_array(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        array = self._allocations.get(key)
        if array is None:
            if isinstance(dtype, _kernelapi.types.Type):
                dtype = _kernelapi.numpy_support.as_dtype(dtype)
            array = self._allocations.setdefault(key, np.empty(shape, dtype))
        return array

    _kernelapi.FakeCUDAShared.array = _shared_array

else:
    SHARED_ALIGN = 16
    int_as_float = cuda.libdevice.int_as_float
    float_as_int = cuda.libdevice.float_as_int


@cuda.jit(device=True)
def bf16_to_float(bits):
    """The bf16 whose bit pattern is the int16 ``bits``, as fp32 (exact: bf16 is fp32's top half)."""
    return int_as_float(int32(bits) << int32(16))


@cuda.jit(device=True)
def float_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as that bf16's int16 bit pattern."""
    bits = float_as_int(x)
    bits += int32(0x7FFF) + ((bits >> int32(16)) & int32(1))
    return int16(bits >> int32(16))


@cuda.jit(device=True)
def to_float32(x):
    """An fp16 or fp32 element ``x`` as fp32: the kernels' ``to_float`` for inputs that are not bf16."""
    return float32(x)


@cuda.jit(device=True)
def identity(x):
    """``x`` unchanged: the kernels' ``from_float`` for fp16 and fp32 outputs (the store converts)."""
    return x


@cuda.jit(device=True)
def tanh(x):
    """tanh(x) in fp32 from exp2, for the softcap: sign(x) · (1 - e) / (1 + e) with e = exp(-2|x|) in [0, 1],
    so that nothing overflows: exactly ±1 once e is below fp32's resolution at 1 (|x| > 9), NaN for NaN;
    absolute error about 1e-7 (the rounding of 1 - e). numba's simulator may give math.tanh as a libdevice
    stub; this runs the same in the simulator and on the GPU."""
    e = math.exp2(float32(-2.0 * LOG2E) * abs(x))
    t = (float32(1.0) - e) / (float32(1.0) + e)
    return t if x >= float32(0.0) else -t


# The score step of the kernels whose scores are fp32 with an exact tanh: the SIMT forward and backward, and
# both KV-cache split kernels (the tensor-core one's scores are fp32 accumulators treated as the SIMT one's).
# Each step is a function the kernels call in their own loops and passes, inlined (offline, sm_90: the same
# registers, spills and instruction counts as the code each kernel wrote out). The backward takes tanh itself
# (it keeps the derivative); the KV-cache kernels keep their own mask, with the row's validity in it.
# forward_tc and backward_tc have their own forms, shaped for their fragments (tanh.approx, per-lane bounds).


@device_function
def softcap(s, softcap_log2):
    """The capped score in base 2 of a score s pre-scaled by scale / c: c · log2 e · tanh(s) (``tanh``, fp32),
    softcap_log2 = c · log2 e."""
    return tanh(s) * softcap_log2


@device_function
def alibi(s, slope, row, key, diag):
    """s with ALiBi's bias for query row ``row`` and key ``key``: minus the slope (in base 2) times the key's
    distance from the row's diagonal, |row + diag - key|, diag = seqlen_k - seqlen_q."""
    return s - slope * float32(abs(row + diag - key))


@device_function
def with_sink(m_i, l_i, sink):
    """A row's softmax statistics with the attention sink joined, all in base 2: the sink (sink[h] · log2 e)
    is one more logit in the denominator and none in the numerator. Returns (m, l, alpha): m = max(m_i, sink),
    l = l_i · alpha + exp2(sink - m) and alpha = exp2(m_i - m), by which the row's acc is rescaled; then O =
    acc · alpha / l and L = m + log2 l. A row that saw no key (m_i = -inf, l_i = 0, acc = 0) gets O = 0 and L =
    sink; l >= 1 always, so the no-key marker l = 0 never arises."""
    # side-by-side: sink
    m = max(m_i, sink)
    alpha = math.exp2(m_i - m)
    return m, l_i * alpha + math.exp2(sink - m), alpha
    # side-by-side: end


def key_mask(LEFT, RIGHT):
    """``masked(row, key, diag, end, window_left, window_right)``: whether key ``key`` is hidden from query row
    ``row``: at or past ``end`` or outside the row's window, bottom-right aligned (diag = seqlen_k - seqlen_q),
    LEFT and RIGHT saying which sides bound it (compile-time, ``Features``)."""

    @device_function
    def masked(row, key, diag, end, window_left, window_right):
        return key >= end or (RIGHT and key > row + diag + window_right) or (LEFT and key < row + diag - window_left)

    return masked


class Features(NamedTuple):
    """The compile-time switches an ``AttentionSpec`` becomes, part of every kernel's key (the forward's,
    the tensor-core forward's and the backward's): LEFT, RIGHT: the window bounds keys on that side (causal:
    RIGHT with window_right = 0); SOFTCAP: scores are capped; ALIBI: scores get the ALiBi bias; VARLEN: a
    packed batch, each block reading its sequence's offsets (``offset_args``). The window sizes, the softcap
    and the slopes are runtime arguments (``feature_args``). Without VARLEN the offsets are never read and
    the kernels are those of a dense batch."""

    LEFT: bool
    RIGHT: bool
    SOFTCAP: bool
    ALIBI: bool
    VARLEN: bool


def features(spec: AttentionSpec) -> Features:
    left, right = spec.window
    return Features(left != UNBOUNDED, right != UNBOUNDED, spec.softcap > 0, spec.alibi_slopes is not None, spec.varlen)


# The features the wgmma kernels take where their switch (``forward_wgmma.FEATURES``, ``backward_wgmma.FEATURES``)
# names them, all by default: "window" is a window other than none and causal.
FEATURE_NAMES = frozenset({"softcap", "alibi", "window", "varlen", "sink"})


def named_features(variable: str) -> frozenset[str]:
    """The features the environment variable names: every one of FEATURE_NAMES where it is unset, none where it
    says "none" (or nothing), else those it names (comma-separated), all of FEATURE_NAMES."""
    value = os.environ.get(variable)
    if value is None:
        return FEATURE_NAMES
    named = frozenset(name for name in value.split(",") if name and name != "none")
    if not named <= FEATURE_NAMES:
        raise ValueError(f"{variable} names {', '.join(sorted(FEATURE_NAMES))}, got {sorted(named)}")
    return named


def spec_features(spec: AttentionSpec) -> frozenset[str]:
    """The FEATURE_NAMES of the spec's features (none for a dense spec, causal or not)."""
    return frozenset(
        name
        for name, present in (
            ("softcap", spec.softcap != 0),
            ("alibi", spec.alibi_slopes is not None),
            ("window", spec.window not in ((UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0))),
            ("varlen", spec.varlen),
            ("sink", spec.sink is not None),
        )
        if present
    )


def feature_args(spec: AttentionSpec, seqlen_q: int, seqlen_k: int, device: torch.device) -> tuple:
    """The kernels' runtime arguments for the spec's features: window_left, window_right (each clamped to
    seqlen_q + seqlen_k, past which a bound excludes nothing more; 0 where unbounded, unread), softcap_log2 =
    softcap · log2 e (0 without), and the slopes as a flat fp32 array with their batch and head strides
    (without ALiBi, one fp32 zero on ``device`` with strides 0, unread)."""
    far = seqlen_q + seqlen_k
    left, right = (min(w, far) if w != UNBOUNDED else 0 for w in spec.window)
    slopes = spec.alibi_slopes
    if slopes is None:
        slopes_args = (_placeholder("slopes", device), 0, 0)
    else:
        slopes_args = (flat_view(slopes), *slopes.stride())
    return (left, right, np.float32(spec.softcap * LOG2E), *slopes_args)


# (role, device) -> a flat array of one zero: what a kernel gets for a tensor argument it does not read.
_PLACEHOLDERS: dict[tuple[str, torch.device], object] = {}


def _placeholder(role: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A flat array of one zero on ``device`` for the unread argument ``role`` ("slopes", "sink", "dsink" in
    fp32, "offsets" in int32), made once; each role its own array, not an alias of another role's (the
    simulator copies each array argument back after the launch)."""
    flat = _PLACEHOLDERS.get((role, device))
    if flat is None:
        flat = _PLACEHOLDERS[role, device] = flat_view(torch.zeros(1, dtype=dtype, device=device))
    return flat


def sink_arg(spec: AttentionSpec, device: torch.device):
    """The sink argument of the kernels that normalise (the forwards, the KV-cache split kernels and combine,
    the backward's preprocess), always their last: spec.sink ((heads,) fp32, natural log) as a flat array, or
    without a sink one fp32 zero on ``device``, made once, unread (its own array, not the slopes' placeholder:
    the simulator copies each array argument back after the launch). Kernels compiled without SINK read
    nothing more than before: the argument comes last, so the others keep their parameter offsets."""
    if spec.sink is not None:
        return flat_view(spec.sink)
    return _placeholder("sink", device)


def dsink_arg(parts: torch.Tensor | None, device: torch.device):
    """The backward preprocess's argument before its sink (``sink_arg``): ``parts``, where it writes its blocks'
    shares of the sink's gradient (``backward_simt.dsink_parts``), or without a sink one fp32 zero on
    ``device``, made once, unread (its own array, as ``sink_arg``'s)."""
    if parts is not None:
        return parts
    return _placeholder("dsink", device)


def sink_tensors(spec: AttentionSpec) -> tuple:
    """spec.sink where a kernel takes it (``sink_arg``), for a ``launch.prepare`` class's calls: (sink,) or ()."""
    return () if spec.sink is None else (spec.sink,)


def sink_positions(spec: AttentionSpec, at: int) -> tuple[int, ...]:
    """``sink_tensors``' position among a kernel's arguments, ``sink_arg`` at ``at``: (at,) or ()."""
    return () if spec.sink is None else (at,)


def grid_extent(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seqlen_q, seqlen_k) that a kernel's grid spans: q's batch and lengths; for a packed batch
    (spec.varlen), the number of sequences and max_seqlen_q, max_seqlen_k, the longest sequence's (tiles of a
    shorter sequence past its end exit at once). Read from the spec, never from the offsets: no sync."""
    if spec.varlen:
        return spec.cu_seqlens_q.numel() - 1, spec.max_seqlen_q, spec.max_seqlen_k
    return q.shape[0], q.shape[2], k.shape[2]


def offset_args(spec: AttentionSpec, device: torch.device) -> tuple:
    """The kernels' last two arguments: cu_seqlens_q and cu_seqlens_k as flat int32 arrays (a packed batch),
    or without VARLEN one int32 zero on ``device`` twice, unread."""
    if spec.varlen:
        return flat_view(spec.cu_seqlens_q.contiguous()), flat_view(spec.cu_seqlens_k.contiguous())
    flat = _placeholder("offsets", device, torch.int32)
    return flat, flat


def spec_class(spec: AttentionSpec) -> tuple:
    """What the dense kernels' launches read of ``spec`` other than its tensors' memory, for a class key
    (``launch.prepare``): scale, window, softcap, the slopes' shape, strides and dtype, a packed batch's
    number of offsets and max lengths (a KV cache's packed queries have no cu_seqlens_k), whether it has a sink.
    A spec's tensors make it unhashable, hence this tuple."""
    slopes = spec.alibi_slopes
    return (
        spec.scale,
        spec.window,
        spec.softcap,
        None if slopes is None else (slopes.shape, slopes.stride(), slopes.dtype),
        (
            spec.cu_seqlens_q.numel(),
            None if spec.cu_seqlens_k is None else spec.cu_seqlens_k.numel(),
            spec.max_seqlen_q,
            spec.max_seqlen_k,
        )
        if spec.varlen
        else None,
        spec.sink is not None,
    )


def spec_tensors(spec: AttentionSpec) -> tuple:
    """The spec's tensors a dense kernel reads, as ``feature_args`` and ``offset_args`` pass them (the
    slopes with ALiBi; cu_seqlens_q and cu_seqlens_k, contiguous, for a packed batch): what a call of a
    ``launch.prepare`` class passes besides q, k, v and the outputs."""
    slopes = () if spec.alibi_slopes is None else (spec.alibi_slopes,)
    if spec.varlen:
        return (*slopes, spec.cu_seqlens_q.contiguous(), spec.cu_seqlens_k.contiguous())
    return slopes


def spec_positions(spec: AttentionSpec, features_at: int, offsets_at: int) -> tuple[int, ...]:
    """Where ``spec_tensors``' tensors are among a kernel's arguments, ``feature_args`` starting at
    ``features_at`` (the slopes are its fourth) and ``offset_args`` at ``offsets_at``."""
    slopes = () if spec.alibi_slopes is None else (features_at + 3,)
    return (*slopes, offsets_at, offsets_at + 1) if spec.varlen else slopes


@cuda.jit(device=True)
def sequence(cu_seqlens, s, total):
    """Sequence s of a packed batch of ``total`` rows: (its first row, its length), as ints. The offsets are
    clamped into [0, total] (a length below 0 becomes 0), so that offsets nobody checked (that would need a
    sync) never take a block outside the tensors: wrong offsets give wrong rows, not wild accesses."""
    start = min(max(int(cu_seqlens[s]), 0), total)
    end = min(max(int(cu_seqlens[s + 1]), start), total)
    return start, end - start


def score_scale(spec: AttentionSpec) -> float:
    """What the SIMT kernels pre-scale Q (or K) by: scale · log2 e, so that S comes out ready for exp2; with
    a softcap c, scale / c, the argument of tanh (the kernel then multiplies tanh by c · log2 e)."""
    return spec.scale / spec.softcap if spec.softcap > 0 else spec.scale * LOG2E


class BlockConfig(NamedTuple):
    """One block's shape. THREADS_M x THREADS_N threads; each owns BLOCK_M / THREADS_M rows, BLOCK_N /
    THREADS_N keys of S and HEAD_DIM / THREADS_N columns of O. SHARE_KV: K and V take turns in one shared
    buffer (V is loaded once S is computed) where two would not fit in the 48 KB of static shared memory.
    MAX_REGISTERS caps ptxas, which otherwise hoists loads for latency, so that registers allow as many
    blocks per SM as shared memory does."""

    BLOCK_M: int
    BLOCK_N: int
    THREADS_M: int
    THREADS_N: int
    SHARE_KV: bool
    MAX_REGISTERS: int


def padded_head_dim(head_dim: int) -> int:
    """The head dim the block computes with: a multiple of 32 (4 columns x THREADS_N = 8 thread columns),
    the extra columns zero-filled."""
    return max(32, -(-head_dim // 32) * 32)


def tile_loader(HEAD_DIM, NUM_WARPS, EVEN_HEAD_DIM, UNIT_STRIDE_D, to_float):
    """The device function ``load_tile`` of a block of NUM_WARPS warps, for one padded head dim and input
    kind (``to_float`` widens an element to fp32); the forward's and the backward's kernels share it."""

    @cuda.jit(device=True)
    def load_tile(tile, x, offset, stride_n, stride_d, start, seqlen, head_dim, scale):
        """tile[r, c] = scale · x[offset + (start + r)·stride_n + c·stride_d] as fp32, zeros past seqlen and
        head_dim: warp w loads rows w, w + NUM_WARPS, ...; lane l loads columns l, l + 32, ... (coalesced
        when stride_d = 1, conflict-free)."""
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        row_offset = offset + (start + warp) * stride_n
        for rr in range(tile.shape[0] // NUM_WARPS):
            r = warp + NUM_WARPS * rr
            row_visible = start + r < seqlen
            for cc in range(HEAD_DIM // 32):
                c = lane + 32 * cc
                value = float32(0.0)
                if row_visible and (EVEN_HEAD_DIM or c < head_dim):
                    value = scale * to_float(x[uint64(row_offset + (c if UNIT_STRIDE_D else c * stride_d))])
                tile[uint64(r), uint64(c)] = value
            row_offset += NUM_WARPS * stride_n

    return load_tile


def kv_loader(BLOCK_N, ROW_STEP, LDW, KIND, PAGE_SIZE, EVEN_HEAD_DIM, ASYNC_LOADS, FLAT=False):
    """(PAGE_READS, ``page_ids``, ``load_kv``): the page ids a thread's rows of a tile need (PAGE_READS of them,
    read by ``page_ids`` into a local int32 array, before the copies that use them, which may be a tile later),
    and ``load_kv``, the copy of one stage's K and V tiles (BLOCK_N keys each) into a shared array of 32-bit
    words, LDW a row, for both KV-cache split kernels (``kvcache_simt``, ``kvcache_tc``): a thread copies one
    16 B chunk of tile rows ld_r, ld_r + ROW_STEP, ... (BLOCK_N / ROW_STEP rows of K and as many of V); KIND
    "f32", "f16" or "bf16" (16-bit elements two a word, the lower index in the low half: ``ldmatrix``'s
    layout); PAGE_SIZE the paged cache's page size, a compile-time constant (the divisions by it shifts or
    multiplies), 0 for a contiguous cache; FLAT: the shared array is one-dimensional (row r at word r · LDW, as
    a dynamic shared array is), else (rows, LDW)."""
    ES = 4 if KIND == "f32" else 2  # bytes an element
    VEC = 16 // ES  # elements in a 16 B chunk (4 words)
    LOADS = BLOCK_N // ROW_STEP
    PAGED = PAGE_SIZE > 0
    # Pages from a thread's first row's to its last's (LOADS rows, ROW_STEP apart): read each, or where that is
    # more reads than rows, each row's.
    PAGES_SPANNED = -(-ROW_STEP * (LOADS - 1) // PAGE_SIZE) + 1 if PAGED else 1
    PAGE_A_ROW = PAGES_SPANNED > LOADS
    PAGE_READS = LOADS if PAGE_A_ROW else PAGES_SPANNED

    @device_function
    def load_row(tile, tile_row, x, x_base, offset, stride_d, chunk, head_dim, visible):
        """Chunk ``chunk`` of the cache row at element ``offset`` (stride_d apart) into shared row tile_row;
        zeros where not ``visible`` and past head_dim. cp.async (issued, lands at the wait) or plain loads."""
        col = chunk * VEC
        if ASYNC_LOADS:
            nbytes = 0
            src = x_base
            if visible and (EVEN_HEAD_DIM or col < head_dim):
                nbytes = 16 if EVEN_HEAD_DIM else ES * min(head_dim - col, VEC)
                src = x_base + uint64(ES * (offset + col))
            cp_async_16(shared_address(tile) + uint32(4 * (tile_row * LDW + 4 * chunk)), src, int32(nbytes))
        elif KIND == "f32":
            for w in range(4):
                value = float32(0.0)
                if visible and (EVEN_HEAD_DIM or col + w < head_dim):
                    value = x[uint64(offset + (col + w) * stride_d)]
                if FLAT:
                    tile[uint64(tile_row * LDW + 4 * chunk + w)] = value
                else:
                    tile[uint64(tile_row), uint64(4 * chunk + w)] = value
        else:
            for w in range(4):
                lo = int32(0)
                hi = int32(0)
                if visible and (EVEN_HEAD_DIM or col + 2 * w < head_dim):
                    lo = int32(x[uint64(offset + (col + 2 * w) * stride_d)]) & int32(0xFFFF)
                if visible and (EVEN_HEAD_DIM or col + 2 * w + 1 < head_dim):
                    hi = int32(x[uint64(offset + (col + 2 * w + 1) * stride_d)]) << int32(16)
                if FLAT:
                    tile[uint64(tile_row * LDW + 4 * chunk + w)] = lo | hi
                else:
                    tile[uint64(tile_row), uint64(4 * chunk + w)] = lo | hi

    @device_function
    def page_ids(pages, start_n, block_table, off_b, ld_r, stride_tb, stride_tp, capacity, cache_rows):
        """A paged cache's block-table ids for the thread's rows of the tile from key start_n (``load_kv``'s
        rows), into ``pages`` (PAGE_READS int32), clamped into the cache; a contiguous cache's: nothing. The
        PAGES_SPANNED pages from its first row's on, each read once, or (PAGE_A_ROW) one a row's. Keys and page
        indices as 32-bit unsigned values (below the capacity, an int32; truncated again where numba widens their
        arithmetic to 64 bits), widened unsigned for the table's offsets: numba's signed 64-bit floor division
        and modulo cost a sign fix-up each, a sign-extended index a longer multiply."""
        if PAGED:
            last_key = uint32(capacity - 1)
            last_page = uint32(last_key // uint32(PAGE_SIZE))
            first_page = uint32(uint32(min(start_n + ld_r, capacity - 1)) // uint32(PAGE_SIZE))
            table_row = off_b * stride_tb
            for j in range(PAGE_READS):
                if PAGE_A_ROW:
                    page_idx = uint32(min(uint32(start_n + ld_r + ROW_STEP * j), last_key) // uint32(PAGE_SIZE))
                else:
                    page_idx = min(uint32(first_page + uint32(j)), last_page)
                page = block_table[uint64(table_row + int64(page_idx) * stride_tp)]
                pages[j] = min(max(page, int32(0)), int32(cache_rows - 1))

    @device_function
    def load_kv(
        kv_tile,
        stage_row,
        start_n,
        hi,
        k,
        v,
        k_base,
        v_base,
        k_head,
        v_head,
        pages,
        ld_r,
        ld_c,
        stride_kb,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vn,
        stride_vd,
        head_dim,
    ):
        """Keys start_n .. start_n + BLOCK_N of K and V into the stage at shared row stage_row (K, then V
        BLOCK_N rows on), zeros from key hi on (hi > start_n): chunk ld_c of tile rows ld_r, ld_r + ROW_STEP, ...
        A paged cache's rows from the page ids ``page_ids`` read for start_n; a row from hi on (so every row past
        the capacity) reads nothing of the cache, whatever page and slot it is given."""
        visible_rows = int32(min(hi - start_n, BLOCK_N))  # a 32-bit compare a row, not the key's 64-bit one
        if PAGED:
            # Row it (key key0 + ROW_STEP · it, key0 = start_n + ld_r) lies ROW_STEP · it past slot o of the first
            # page ``page_ids`` read: in page (o + ROW_STEP · it) // PAGE_SIZE of those, at slot (o + ROW_STEP · it)
            # % PAGE_SIZE. With ROW_STEP · it a constant of the unrolled row, that is one of two pages by one
            # compare of o (or one page, where PAGE_SIZE divides ROW_STEP · it) and a constant added to o: no
            # division or search among the PAGE_READS ids a row. Pages and slots as unsigned 32-bit values (below
            # the cache's pages, the page size), widened unsigned: each offset one 32 x 64-bit multiply-add.
            o = uint32(uint32(start_n + ld_r) % uint32(PAGE_SIZE))
        for it in range(LOADS):
            r = ld_r + ROW_STEP * it
            visible = int32(r) < visible_rows
            # side-by-side: pages
            if PAGED:
                if PAGE_A_ROW:
                    page = pages[it]
                    slot = uint32(o + uint32(ROW_STEP * it % PAGE_SIZE)) % uint32(PAGE_SIZE)
                else:
                    nth = ROW_STEP * it // PAGE_SIZE  # the row's page with o = 0
                    past = ROW_STEP * it % PAGE_SIZE
                    page = pages[nth]
                    slot = uint32(o + uint32(past))
                    if past > 0 and o >= uint32(PAGE_SIZE - past):  # the next page
                        page = pages[nth + 1]
                        slot = uint32(slot - uint32(PAGE_SIZE))
                page_at = int64(uint32(page))
                k_off = k_head + page_at * stride_kb + int64(slot) * stride_kn
                v_off = v_head + page_at * stride_vb + int64(slot) * stride_vn
            else:
                key = start_n + r
                k_off = k_head + key * stride_kn
                v_off = v_head + key * stride_vn
            # side-by-side: end
            load_row(kv_tile, stage_row + r, k, k_base, k_off, stride_kd, ld_c, head_dim, visible)
            load_row(kv_tile, stage_row + BLOCK_N + r, v, v_base, v_off, stride_vd, ld_c, head_dim, visible)
        if ASYNC_LOADS:
            cp_async_commit()

    return PAGE_READS, page_ids, load_kv


def feature_columns(switches) -> dict:
    """kernel_resources' columns for a kernel's Features."""
    return {name.lower(): bool(on) for name, on in zip(Features._fields, switches)}


def check_device(q: torch.Tensor) -> None:
    """Refuses inputs on a device this build cannot run on: q (any input tensor, e.g. (batch, heads, seqlen_q,
    head_dim)) must be on the CPU under numba's simulator, on a CUDA device otherwise."""
    if simulated() and q.device.type != "cpu":
        raise ValueError(
            f"numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs fa2-numba-cuda on CPU tensors, got {q.device}; "
            "for CUDA tensors start Python without NUMBA_ENABLE_CUDASIM"
        )
    if not simulated() and q.device.type != "cuda":
        raise ValueError(
            f"fa2-numba-cuda runs on CUDA tensors, got {q.device}; to run it on the CPU, in numba's CUDA "
            "simulator, set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
        )


def rows_16b_aligned(t: torch.Tensor) -> bool:
    """Whether cp.async can copy the rows of t (batch, heads, rows, head_dim) in 16 B chunks: contiguous along
    head_dim, its first element and every row, head and batch start 16 B aligned (each stride a multiple of
    the 16 B chunk's elements). The tensor-core kernels' q, k, v and dO, the KV-cache kernels' caches."""
    vec = 16 // t.element_size()
    return t.stride(3) == 1 and t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:3])


def flat_view(t: torch.Tensor):
    """The kernel's view of ``t``: a flat array over the memory ``t`` spans (element i at ``t.stride()``
    offsets from the first), without a copy; bf16 as its int16 bit patterns. A CUDA array through
    __cuda_array_interface__, or under the simulator a numpy view of the same memory."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.numel() == 0:
        # Nothing is read (seqlen_k = 0 means no key tile); the kernel still needs an array to index.
        t = torch.zeros(1, dtype=t.dtype, device=t.device)
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,))
    return flat.numpy() if simulated() else flat
