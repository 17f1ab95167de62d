"""FlashAttention-2 forward on tensor cores: fp16 and bf16, ``mma.sync`` from numba-cuda through inline PTX.

The algorithm of ``fa2_numba_cuda.forward_simt`` (FA2, Algorithm 1: running max ``m_i``, running sum ``l_i``,
unnormalised ``acc``, rescaled by ``alpha`` per key tile; scores in base 2; O and L written once), with
both matrix products on tensor cores, as FlashAttention-2's own CUDA kernel does (``mma.py`` has the
instructions and their register layouts):

- A block of NUM_WARPS warps owns BLOCK_M = 16 · NUM_WARPS query rows of one (batch, head); warp w owns rows
  16 w .. 16 w + 15 and never exchanges data with another warp. Q's fragments (A operands, one per 16 head
  dims) are loaded once with ``ldmatrix`` and stay in registers.
- S = Q Kᵀ: per 16 keys and 16 head dims one ``ldmatrix.x4`` of K gives the B fragments of two 8-key tiles,
  each an ``mma.m16n8k16`` into fp32 accumulators ``s[buf]`` [BLOCK_N / 8, 4]. Lane 4 g + t holds rows g
  and g + 8 of the warp's slice (``s[buf, j, 0:2]`` and ``s[buf, j, 2:4]``), keys 8 j + 2 t and 8 j + 2 t + 1.
- Online softmax in fp32, per lane on its two rows: mask, the tile's row max over the lane's keys then over
  its quad (two ``shfl_xor``), ``p = exp2(s · qk_scale - m)`` (qk_scale = |scale| · log2 e > 0, so the max
  of raw scores gives the max of scaled ones; a negative scale flips the sign bits of Q's fragments; one
  FFMA and one ex2.approx). ``l_i`` is the lane's partial sum, added over the quad once, after the last
  tile; ``acc`` is rescaled only when some row of the warp got a new max (a warp vote).
- O += P V: the accumulator layout of S is the A operand's, so P is rounded to fp16/bf16 in registers (two
  values per .b32) and fed straight to ``mma`` against V's B fragments (``ldmatrix.x4.trans``: V is stored
  keys x head dims, B wants head dims as columns). ``acc`` [HEAD_DIM / 8, 4] is fp32.
- Shared memory: one buffer of max(BLOCK_M, 2 BLOCK_N) rows of HEAD_DIM + 8 16-bit elements (16 B of
  padding per row: the 8 row addresses of an ``ldmatrix`` fall in distinct banks); it holds Q until every
  warp has its fragments, then K (rows 0 .. BLOCK_N) and V (rows BLOCK_N .. 2 BLOCK_N). Under 48 KB, static.
- Loads overlap compute as in FA2's kernel (one K and one V buffer, two barriers per key tile): V's tile is
  copied while S = Q Kᵀ runs, the next K tile while the softmax and P V run (with S_AHEAD: V's during the
  softmax and the next S, K's during P V), with ``cp.async`` (16 B per thread, zero-filled past the keys or
  head_dim) where q, k and v are contiguous along head_dim with 16 B aligned rows, else with plain loads
  (any strides).
- S_AHEAD (``TensorCoreConfig``): each warp computes S of the next key tile while it exponentiates this
  one, one ldmatrix and two mma then a few exp2 and so on, in that order in the source (ptxas keeps it), so
  that tensor-core and FP32 instructions issue side by side within the warp; s[0] and s[1] take turns.
  Without it the same happens only between warps of different blocks, where two fit on an SM.

Grouped-query attention (GQA; MQA with one key/value head), as ``fa2_numba_cuda.forward_simt``: query head h
reads key/value head ``off_hk = h // group`` (group = heads // heads_k, a runtime argument) in place.

Windows, softcap and ALiBi as ``fa2_numba_cuda.forward_simt`` (the same ``common.Features``, compile-time
switches; window sizes, softcap and slopes runtime arguments): the window (left, right) is bottom-right
aligned, key j visible to query i iff i + diag - left <= j <= i + diag + right with diag = seqlen_k - seqlen_q
(causal is (-1, 0)). A block visits only the key tiles [begin_n, end_n) that hold a key some row of it sees;
with a left bound, a warp computes only on those its own 16 rows see (on the others it takes part in the loads
and barriers alone); a warp masks only the tiles that cross a window edge of its rows or the end of the keys,
and on each only the edges it crosses. Blocks with a right bound are launched longest-first. With ALiBi,
``row_max`` turns the raw scores into the final ones in base 2 before the mask: x = s · qk_scale, or with a
softcap c, x = c · log2 e · tanh(s · qk_scale), qk_scale = |scale| / c (``_softcap_log2``: one tanh.approx,
relative error at most 2^-10.99, about fp16's unit roundoff: this kernel takes only 16-bit inputs); then x -=
slope · log2 e · |i + diag - j|, and the exponentials take x with a scale of 1. With a softcap alone it leaves
tanh(s · qk_scale), and the exponentials' FFMA scales by c · log2 e. Rows that see no key get O = 0 and L =
+inf. Attention sinks (``spec.sink``) as ``fa2_numba_cuda.forward_simt``: SINK, a switch of its own, adds
sink[h] · log2 e to each row's m_i and l_i in the epilogue (``common.with_sink``; m_i is in the base-2 units of
the final scores whatever exp_scale is), nothing in the loop (a row that sees no key: O = 0, L = sink[h]).
seqlen_q and seqlen_k need not be multiples of anything (tiles are zero-padded, padded keys masked), head_dim
is padded to a multiple of 16 with zeros.

Packed (variable-length) batches as ``fa2_numba_cuda.forward_simt`` (``spec.varlen``; the VARLEN switch of
``Features``): q (1, heads, total_q, head_dim), k, v (1, heads_k, total_k, head_dim), O and L in q's
layout; one launch over (query tile of max_seqlen_q, sequence·head), each block reading its sequence's
offsets, exiting before its first load where its tile starts past the sequence's end (the whole block:
no barrier or warp-wide instruction is left waiting), and otherwise running on the sequence's rows with its
own lengths (the window, its skipped tiles, ALiBi's slopes[s, h] and distance, rows that see no key, per
sequence). cp.async needs the packed rows 16 B aligned, as a dense batch's (``common.rows_16b_aligned``): a
sequence's start only moves the rows, not their alignment.

Which kernel runs: ``fa2_numba_cuda.forward.flash_attn_forward`` calls this one for fp16 and bf16 inputs
with head_dim <= 128 on a CUDA device of compute capability 8.0 or newer (``uses_tensor_cores``), and its
SIMT kernel otherwise (fp32, head_dim > 128, older GPUs, numba's simulator). An error in this kernel is
raised, never answered by the other. Under numba's simulator this kernel runs only when asked for
(``tensor_cores=True``), on ``mma.py``'s Python emulation of the instructions: slow, for tests.

Launch: on torch's current CUDA stream, no host synchronisation; one compiled kernel per (padded head dim,
TensorCoreConfig, Features, bf16 or fp16, head_dim == padded, cp.async or plain loads, head_dim even: O stored
in pairs), cached; ``kernel_resources`` reports registers, shared and local memory of each. Launched
through ``launch.prepare``: a class of calls (shapes, strides, dtypes, device, the spec's values, the
config) is launched by numba once, then its packed parameters are kept and each later call of the class
writes its tensors' data pointers and calls cuLaunchKernel (``_PREPARED``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, float32, int16, int32, uint32, uint64

from fa2.spec import AttentionSpec
from fa2_numba_cuda import launch
from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    SHARED_ALIGN,
    check_device,
    feature_args,
    feature_columns,
    features,
    grid_extent,
    offset_args,
    rows_16b_aligned,
    sequence,
    simulated,
    sink_arg,
    sink_positions,
    sink_tensors,
    spec_class,
    spec_positions,
    spec_tensors,
    with_sink,
)
from fa2_numba_cuda.mma import (
    all_lanes,
    cp_async_16,
    cp_async_commit,
    cp_async_wait_all,
    device_function,
    exp2_approx,
    global_address,
    ldmatrix_a_row_col,
    ldmatrix_b_row_col,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    lds_x4,
    lds_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    shfl_xor,
    tanh_approx,
)
from fa2_numba_cuda.tensor_cores import MAX_HEAD_DIM, MIN_COMPUTE_CAPABILITY, capability, padded_head_dim


class TensorCoreConfig(NamedTuple):
    """One block's shape: NUM_WARPS warps of 16 query rows each (BLOCK_M = 16 · NUM_WARPS), BLOCK_N keys per
    tile (a multiple of 16). MAX_REGISTERS caps ptxas (0: no cap; cp.async kernels only). S_AHEAD: each warp
    computes S = Q Kᵀ of the next key tile during the softmax of the current one, their instructions
    interleaved, so that its mma and FP32 work overlap (two S tiles in registers: BLOCK_N / 2 more each).

    Two switches for the optimisation ladder (``fa2_numba_cuda.ladder``), on in every configuration the kernel
    chooses: LDMATRIX, the fragments of Q, K and V from shared memory by ``ldmatrix`` (off: ``mma.lds_x4``, the
    same registers from plain shared loads); CP_ASYNC, the tiles copied by ``cp.async`` where the inputs allow
    it (off: plain loads always)."""

    NUM_WARPS: int
    BLOCK_N: int
    MAX_REGISTERS: int
    S_AHEAD: bool = False
    LDMATRIX: bool = True
    CP_ASYNC: bool = True


def tc_config(HEAD_DIM: int) -> TensorCoreConfig:
    """The block shape for a padded head dim: 128 query rows (8 warps) against 64-key tiles, the static
    shared memory 2 · max(128, 2 · 64) · (HEAD_DIM + 8) bytes. Per thread, one warp's slice holds Q's
    fragments (HEAD_DIM / 4 registers), S's accumulators (32, or 64 with S_AHEAD) and O's (HEAD_DIM / 2).
    Up to HEAD_DIM 64, registers are capped at 128 so that two blocks share an SM (their barriers and
    softmax phases then interleave); above, one block fills an SM's registers and S_AHEAD overlaps each
    warp's softmax with the next tile's Q Kᵀ instead (not at 112, where ptxas keeps S_AHEAD's two S tiles in
    local memory). As ptxas (sm_90) reports them:

        HEAD_DIM   registers          local memory            shared     blocks per SM
        16         111                0                       6 KB       2
        32-64      128 (capped)       16-32 B (spills, set    10-18 KB   2
                                      outside the key loop)
        80, 96     234, 246           0                       22, 26 KB  1
        112        249                0                       30 KB      1
        128        244                0                       34 KB      1

    On the H200 (numba's get_regs_per_thread, get_shared_mem_per_block, get_local_mem_per_thread; bf16):
    HEAD_DIM 64, 128 registers, 18,432 B shared, 48-56 B local (two blocks, 16 warps, per SM); HEAD_DIM 128,
    242-244 registers, 34,816 B shared, no local memory (one block, 8 warps, per SM). Against these
    defaults, at N = 4k, bf16, full (TFLOP/s, default first): HEAD_DIM 64: 270; 4 warps 269; BLOCK_N 128
    246 (288 B local); S_AHEAD uncapped 215 (167 registers: one block per SM); 4 warps, BLOCK_N 32,
    uncapped 232. HEAD_DIM 128: 270; without S_AHEAD 253; 4 warps 271, 4 warps without S_AHEAD 273;
    BLOCK_N 32 230. (One run; the 4-warp variants are within 1% of the default, inside run-to-run noise.)
    """
    # side-by-side: ladder-tiles
    if HEAD_DIM <= 64:
        return TensorCoreConfig(8, 64, 128, False)
    return TensorCoreConfig(8, 64, 0, HEAD_DIM != 112)
    # side-by-side: end


def uses_tensor_cores(q: torch.Tensor) -> bool:
    """Whether ``fa2_numba_cuda.forward.flash_attn_forward`` runs this kernel for q: fp16 or bf16, head_dim
    <= 128, a CUDA tensor on a device of compute capability 8.0 or newer, numba not simulating."""
    return (
        not simulated()
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.device.type == "cuda"
        and capability(q.device) >= MIN_COMPUTE_CAPABILITY
    )


@device_function
def _softcap_log2(s, qk_scale, softcap_log2):
    """The capped score in base 2, softcap_log2 · tanh(s · qk_scale) with softcap_log2 = c · log2 e, of a raw
    score s, qk_scale = |scale| / c: one MUFU instruction (tanh.approx.f32) between two multiplies, as
    fa2-triton's 16-bit path. Its relative error, at most 2^-10.99, is about fp16's unit roundoff and 8x below
    bf16's: the naive 16-bit attention of the precision rule rounds the scores that much anyway (the SIMT
    kernels, which take fp32, keep ``common.tanh``). Saturates at ±c · log2 e; NaN stays NaN."""
    return tanh_approx(s * qk_scale) * softcap_log2


def _build_kernel(
    HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, O_PAIRS
):
    """The kernel for one padded head dim, block shape, ``Features`` (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN), SINK
    (the epilogue adds the attention sink) and input type; EVEN_HEAD_DIM: head_dim is
    HEAD_DIM (no column checks); ASYNC_LOADS: cp.async copies 16 B chunks (q, k, v contiguous along
    head_dim, rows 16 B aligned); O_PAIRS: head_dim is even and o is an int32 view (two elements a store)."""
    NUM_WARPS, BLOCK_N, S_AHEAD = config.NUM_WARPS, config.BLOCK_N, config.S_AHEAD
    BLOCK_M = 16 * NUM_WARPS
    NUM_THREADS = 32 * NUM_WARPS
    LD = HEAD_DIM + 8  # shared row length in 16-bit elements
    SMEM_SIZE = max(BLOCK_M, 2 * BLOCK_N) * LD
    V_ROW = BLOCK_N  # K at rows 0 .. BLOCK_N, V at BLOCK_N .. 2 BLOCK_N (Q at 0 .. BLOCK_M before them)
    D_STEPS = HEAD_DIM // 16  # k steps of S = Q Kᵀ; pairs of 8-column tiles of O
    N_TILES = BLOCK_N // 8  # 8-key tiles of S
    S_BUFFERS = 2 if S_AHEAD else 1  # S tiles held at once
    O_TILES = HEAD_DIM // 8  # 8-column tiles of O
    SIGN_BITS = -0x7FFF8000  # 0x80008000 as an int32: the sign bits of a pair of 16-bit floats
    CHUNKS = HEAD_DIM // 8  # 16 B chunks per row
    # What row_max leaves in s, and the exponentials' scale: with ALiBi the final scores in base 2 (scale 1);
    # with a softcap alone tanh(s · |scale| / c), scaled by c · log2 e in the exponentials' FFMA (one multiply
    # a score fewer: the max commutes with a positive scale); else the raw scores, scaled by qk_scale.
    SCALED = SOFTCAP or ALIBI
    # row_max's mask in two forms of one test, each where ptxas makes less of it (offline, sm_90, bf16): per row,
    # the bounds as offsets into the tile against the constant 8 j + e % 2 (D128 causal: 244 registers, 3226
    # SASS instructions, against 246 and 3521 per element), and per element at D128 with a left bound
    # (window + softcap: 254 registers and no spills, against 255 and 56 B of spill stores per row).
    PER_ELEMENT_MASK = LEFT and HEAD_DIM > 112
    assert BLOCK_N % 16 == 0 and HEAD_DIM % 16 == 0
    mma = mma_bf16 if IS_BF16 else mma_f16
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    # side-by-side: ladder-ldmatrix
    ldsm, ldsm_trans = (ldmatrix_x4, ldmatrix_x4_trans) if config.LDMATRIX else (lds_x4, lds_x4_trans)
    # side-by-side: end

    def tile_loader(ROWS):
        """load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim): rows
        start .. start + ROWS of x (element offset + n · stride_n + c · stride_d) into shared rows row0 ..,
        zeros past seqlen and head_dim. ASYNC_LOADS: issued with cp.async, complete at wait_tiles."""
        if ASYNC_LOADS and NUM_THREADS % CHUNKS == 0:
            # Thread i copies chunk i % CHUNKS of rows i // CHUNKS, + ROW_STEP, + 2 ROW_STEP, ...
            ROW_STEP = NUM_THREADS // CHUNKS

            @device_function
            def load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim):
                r = cuda.threadIdx.x // CHUNKS
                c = cuda.threadIdx.x % CHUNKS * 8
                nbytes = 16 if EVEN_HEAD_DIM else 2 * min(max(head_dim - c, 0), 8)
                src = x_base + uint64(2 * (offset + (start + r) * stride_n + c))
                nowhere = x_base + uint64(2 * offset)  # a valid address for copies that read nothing
                dst = smem_base + uint32(2 * ((row0 + r) * LD + c))
                for it in range(-(-ROWS // ROW_STEP)):
                    if ROWS % ROW_STEP == 0 or r + it * ROW_STEP < ROWS:
                        if start + r + it * ROW_STEP < seqlen and nbytes > 0:
                            cp_async_16(dst + uint32(2 * it * ROW_STEP * LD), src, int32(nbytes))
                        else:
                            cp_async_16(dst + uint32(2 * it * ROW_STEP * LD), nowhere, int32(0))
                    src += uint64(2 * ROW_STEP * stride_n)
                cp_async_commit()

        elif ASYNC_LOADS:
            ITEMS = ROWS * CHUNKS

            @device_function
            def load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim):
                for it in range(-(-ITEMS // NUM_THREADS)):
                    item = cuda.threadIdx.x + it * NUM_THREADS
                    if ITEMS % NUM_THREADS == 0 or item < ITEMS:
                        r = item // CHUNKS
                        c = item % CHUNKS * 8
                        n = start + r
                        nbytes = 0
                        element = offset  # a valid address for copies that read nothing
                        if n < seqlen:
                            nbytes = 16 if EVEN_HEAD_DIM else 2 * min(max(head_dim - c, 0), 8)
                            if nbytes > 0:
                                element = offset + n * stride_n + c
                        dst = smem_base + uint32(2 * ((row0 + r) * LD + c))
                        cp_async_16(dst, x_base + uint64(2 * element), int32(nbytes))
                cp_async_commit()

        else:
            ITEMS = ROWS * HEAD_DIM

            @device_function
            def load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim):
                for it in range(-(-ITEMS // NUM_THREADS)):
                    item = cuda.threadIdx.x + it * NUM_THREADS
                    if ITEMS % NUM_THREADS == 0 or item < ITEMS:
                        r = item // HEAD_DIM
                        c = item % HEAD_DIM
                        n = start + r
                        value = int16(0)
                        if n < seqlen and (EVEN_HEAD_DIM or c < head_dim):
                            value = x[offset + n * stride_n + c * stride_d]
                        smem[(row0 + r) * LD + c] = value

        return load

    load_q = tile_loader(BLOCK_M)
    load_kv = tile_loader(BLOCK_N)

    @device_function
    def wait_tiles():
        """This thread's tile copies have landed (a barrier after it makes the whole tile visible)."""
        if ASYNC_LOADS:
            cp_async_wait_all()

    def qk(BUF):
        @device_function
        def s_from_qk(s, q_frag, k_lane):
            """s[BUF] = Q Kᵀ for the K tile in shared memory: per 16 keys and 16 head dims, one ldmatrix (the
            B fragments of two 8-key tiles) and two mma."""
            for j in range(N_TILES):
                for e in range(4):
                    s[BUF, j, e] = 0.0
            for jj in range(N_TILES // 2):
                for kk in range(D_STEPS):
                    b0, b1, b2, b3 = ldsm(k_lane + uint32(2 * (16 * jj * LD + 16 * kk)))
                    d0, d1, d2, d3 = mma(
                        q_frag[kk, 0],
                        q_frag[kk, 1],
                        q_frag[kk, 2],
                        q_frag[kk, 3],
                        b0,
                        b1,
                        s[BUF, 2 * jj, 0],
                        s[BUF, 2 * jj, 1],
                        s[BUF, 2 * jj, 2],
                        s[BUF, 2 * jj, 3],
                    )
                    s[BUF, 2 * jj, 0] = d0
                    s[BUF, 2 * jj, 1] = d1
                    s[BUF, 2 * jj, 2] = d2
                    s[BUF, 2 * jj, 3] = d3
                    d0, d1, d2, d3 = mma(
                        q_frag[kk, 0],
                        q_frag[kk, 1],
                        q_frag[kk, 2],
                        q_frag[kk, 3],
                        b2,
                        b3,
                        s[BUF, 2 * jj + 1, 0],
                        s[BUF, 2 * jj + 1, 1],
                        s[BUF, 2 * jj + 1, 2],
                        s[BUF, 2 * jj + 1, 3],
                    )
                    s[BUF, 2 * jj + 1, 0] = d0
                    s[BUF, 2 * jj + 1, 1] = d1
                    s[BUF, 2 * jj + 1, 2] = d2
                    s[BUF, 2 * jj + 1, 3] = d3

        return s_from_qk

    def softmax_max(BUF):
        @device_function
        def row_max(
            s,
            m_i,
            alpha,
            m_safe,
            start_n,
            seqlen_k,
            warp_diag,
            lane_diag,
            t,
            qk_scale,
            window_left,
            window_right,
            softcap_log2,
            slope,
            exp_scale,
        ):
            """The first half of the online softmax of s[BUF] (the key tile at start_n), for rows g (h = 0:
            s[BUF, :, 0:2]) and g + 8 (h = 1: s[BUF, :, 2:4]) of the warp's 16: with a softcap or ALiBi the
            final scores in base 2 (with a softcap alone, their tanh: exp_scale = c · log2 e), the mask, the
            new row max m_i, alpha and m_safe, the max to subtract. In base 2: the max of s times exp_scale > 0
            is the max of the scaled scores. Returns whether acc must be rescaled: some row of the warp has a
            new max (alpha != 1).

            Element (j, e) is key start_n + 2 t + 8 j + e % 2 of row row0 + 8 (e // 2), row0 = warp_m + g; the
            kernel computes once the warp's diagonal warp_diag = warp_m + diag and the lane's, lane_diag = row0 +
            diag - 2 t, counted from the lane's first key column: the mask's bounds and ALiBi's distance
            (lane_diag - start_n + 8 (e // 2) - 8 j - e % 2) are then a subtraction a tile from them."""
            if SCALED:
                if ALIBI:
                    # One conversion a tile, then an add and an FMA a score (exact in fp32 below 2^24 keys).
                    distance = float32(lane_diag - start_n)
                for j in range(N_TILES):
                    for e in range(4):
                        if SOFTCAP and ALIBI:  # softcap c: qk_scale = |scale| / c
                            x = _softcap_log2(s[BUF, j, e], qk_scale, softcap_log2)
                        elif SOFTCAP:
                            x = tanh_approx(s[BUF, j, e] * qk_scale)
                        else:
                            x = s[BUF, j, e] * qk_scale
                        if ALIBI:
                            x = cuda.fma(-slope, abs(distance + float32(8 * (e // 2) - 8 * j - e % 2)), x)
                        s[BUF, j, e] = x
            # The mask, each edge only on the tiles that cross it: the end of the keys or a right window edge of
            # the warp's rows, and a left edge (with window (1024, 0), each warp's tile on the diagonal and the
            # one at its rows' left edge: two of its 17 tiles, each testing one edge).
            if start_n + BLOCK_N > seqlen_k or (RIGHT and start_n + BLOCK_N - 1 > warp_diag + window_right):
                if PER_ELEMENT_MASK:
                    for j in range(N_TILES):
                        for e in range(4):
                            key = start_n + 8 * j + e % 2  # from the lane's first column
                            if key >= seqlen_k - 2 * t or (RIGHT and key > lane_diag + 8 * (e // 2) + window_right):
                                s[BUF, j, e] = -math.inf
                else:
                    for h in range(2):  # keys from column hi of the lane's row on
                        hi = seqlen_k - 2 * t - start_n
                        if RIGHT:
                            hi = min(hi, lane_diag + 8 * h + window_right + 1 - start_n)
                        for j in range(N_TILES):
                            for e in range(2 * h, 2 * h + 2):
                                if 8 * j + e % 2 >= hi:
                                    s[BUF, j, e] = -math.inf
            if LEFT and start_n < warp_diag + 15 - window_left:
                if PER_ELEMENT_MASK:
                    for j in range(N_TILES):
                        for e in range(4):
                            if start_n + 8 * j + e % 2 < lane_diag + 8 * (e // 2) - window_left:
                                s[BUF, j, e] = -math.inf
                else:
                    for h in range(2):  # keys before column lo of the lane's row
                        lo = lane_diag + 8 * h - window_left - start_n
                        for j in range(N_TILES):
                            for e in range(2 * h, 2 * h + 2):
                                if 8 * j + e % 2 < lo:
                                    s[BUF, j, e] = -math.inf
            unchanged = True
            for h in range(2):
                m_tile = s[BUF, 0, 2 * h]
                for j in range(N_TILES):
                    m_tile = max(m_tile, max(s[BUF, j, 2 * h], s[BUF, j, 2 * h + 1]))
                m_tile = max(m_tile, shfl_xor(m_tile, 1))
                m_tile = max(m_tile, shfl_xor(m_tile, 2))
                m_new = max(m_i[h], m_tile if ALIBI else m_tile * exp_scale)
                unchanged = unchanged and m_new == m_i[h]
                # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
                m_safe[h] = m_new if m_new != -math.inf else float32(0.0)
                alpha[h] = exp2_approx(m_i[h] - m_safe[h])
                m_i[h] = m_new
            return not all_lanes(unchanged)

        return row_max

    def softmax_exp(BUF, H):
        @device_function
        def row_exp(s, l_i, alpha, m_safe, qk_scale):
            """The second half for row H: p = exp2(s · qk_scale - m_safe) in place (one FFMA and one MUFU),
            l_i = alpha l_i + the lane's sum of p."""
            l_part = float32(0.0)
            for j in range(N_TILES):
                for e in range(2 * H, 2 * H + 2):
                    p = exp2_approx(s[BUF, j, e] * qk_scale - m_safe[H])
                    s[BUF, j, e] = p
                    l_part += p
            l_i[H] = alpha[H] * l_i[H] + l_part

        return row_exp

    def qk_with_exp(CUR):
        NXT = 1 - CUR
        STEPS = N_TILES // 2 * D_STEPS  # ldmatrix + two mma each
        PER_STEP = -(-4 * N_TILES // STEPS)  # elements of s[CUR] exponentiated after each

        @device_function
        def s_ahead(s, q_frag, k_lane, l_i, alpha, m_safe, qk_scale):
            """s[NXT] = Q Kᵀ for the K tile in shared memory (as s_from_qk), with the second half of s[CUR]'s
            softmax (as row_exp, both rows) spread between its mma, PER_STEP elements after each, so that each
            warp issues tensor-core and FP32 instructions side by side."""
            l_part = cuda.local.array(2, float32)
            l_part[0] = 0.0
            l_part[1] = 0.0
            for j in range(N_TILES):
                for e in range(4):
                    s[NXT, j, e] = 0.0
            for jj in range(N_TILES // 2):
                for kk in range(D_STEPS):
                    b0, b1, b2, b3 = ldsm(k_lane + uint32(2 * (16 * jj * LD + 16 * kk)))
                    d0, d1, d2, d3 = mma(
                        q_frag[kk, 0],
                        q_frag[kk, 1],
                        q_frag[kk, 2],
                        q_frag[kk, 3],
                        b0,
                        b1,
                        s[NXT, 2 * jj, 0],
                        s[NXT, 2 * jj, 1],
                        s[NXT, 2 * jj, 2],
                        s[NXT, 2 * jj, 3],
                    )
                    s[NXT, 2 * jj, 0] = d0
                    s[NXT, 2 * jj, 1] = d1
                    s[NXT, 2 * jj, 2] = d2
                    s[NXT, 2 * jj, 3] = d3
                    d0, d1, d2, d3 = mma(
                        q_frag[kk, 0],
                        q_frag[kk, 1],
                        q_frag[kk, 2],
                        q_frag[kk, 3],
                        b2,
                        b3,
                        s[NXT, 2 * jj + 1, 0],
                        s[NXT, 2 * jj + 1, 1],
                        s[NXT, 2 * jj + 1, 2],
                        s[NXT, 2 * jj + 1, 3],
                    )
                    s[NXT, 2 * jj + 1, 0] = d0
                    s[NXT, 2 * jj + 1, 1] = d1
                    s[NXT, 2 * jj + 1, 2] = d2
                    s[NXT, 2 * jj + 1, 3] = d3
                    for i in range(PER_STEP):
                        x = (jj * D_STEPS + kk) * PER_STEP + i  # element x % 4 of s[CUR]'s tile x // 4
                        if x < 4 * N_TILES:
                            p = exp2_approx(s[CUR, x // 4, x % 4] * qk_scale - m_safe[x % 4 // 2])
                            s[CUR, x // 4, x % 4] = p
                            l_part[x % 4 // 2] += p
            for h in range(2):
                l_i[h] = alpha[h] * l_i[h] + l_part[h]

        return s_ahead

    def pv(BUF):
        @device_function
        def acc_plus_pv(s, acc, alpha, rescale, v_lane):
            """acc = alpha · acc (if rescale) + P V for the V tile in shared memory, P = s[BUF]: P's A fragment
            for 16 keys is two of S's C tiles, rounded to 16 bits in pairs."""
            if rescale:  # late tiles rarely move any row's max: a warp-uniform skip
                for c in range(O_TILES):
                    for e in range(4):
                        acc[c, e] *= alpha[e // 2]
            # side-by-side: ladder-mma
            for kk in range(N_TILES // 2):
                a0 = pack(s[BUF, 2 * kk, 0], s[BUF, 2 * kk, 1])
                a1 = pack(s[BUF, 2 * kk, 2], s[BUF, 2 * kk, 3])
                a2 = pack(s[BUF, 2 * kk + 1, 0], s[BUF, 2 * kk + 1, 1])
                a3 = pack(s[BUF, 2 * kk + 1, 2], s[BUF, 2 * kk + 1, 3])
                for dd in range(D_STEPS):
                    b0, b1, b2, b3 = ldsm_trans(v_lane + uint32(2 * (16 * kk * LD + 16 * dd)))
                    d0, d1, d2, d3 = mma(
                        a0, a1, a2, a3, b0, b1, acc[2 * dd, 0], acc[2 * dd, 1], acc[2 * dd, 2], acc[2 * dd, 3]
                    )
                    acc[2 * dd, 0] = d0
                    acc[2 * dd, 1] = d1
                    acc[2 * dd, 2] = d2
                    acc[2 * dd, 3] = d3
                    # side-by-side: end
                    d0, d1, d2, d3 = mma(
                        a0,
                        a1,
                        a2,
                        a3,
                        b2,
                        b3,
                        acc[2 * dd + 1, 0],
                        acc[2 * dd + 1, 1],
                        acc[2 * dd + 1, 2],
                        acc[2 * dd + 1, 3],
                    )
                    acc[2 * dd + 1, 0] = d0
                    acc[2 * dd + 1, 1] = d1
                    acc[2 * dd + 1, 2] = d2
                    acc[2 * dd + 1, 3] = d3

        return acc_plus_pv

    @device_function
    def warp_sees(n0, warp_lo, warp_hi):
        """Whether some row of the warp sees a key of the tile at n0 (the same for all its lanes, so that its
        ldmatrix and mma stay whole-warp): the rows' windows span keys warp_lo .. warp_hi - 1. Only kernels
        with a left bound skip: causal alone would skip at most the diagonal tile (~1.5% of its tiles at 4k
        keys), and the extra code paths cost it 10 registers (244 -> 254 at HEAD_DIM 128, ptxas sm_90)."""
        if not LEFT:
            return True
        return n0 + BLOCK_N > warp_lo and (not RIGHT or n0 < warp_hi)

    qk_0, qk_1 = qk(0), qk(1)
    ahead_0, ahead_1 = qk_with_exp(0), qk_with_exp(1)
    max_0, max_1 = softmax_max(0), softmax_max(1)
    exp_0_row_g, exp_0_row_g8 = softmax_exp(0, 0), softmax_exp(0, 1)
    exp_1_row_g, exp_1_row_g8 = softmax_exp(1, 0), softmax_exp(1, 1)
    pv_0, pv_1 = pv(0), pv(1)

    def _attn_fwd_tc(
        q,
        k,
        v,
        o,
        lse,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        head_dim,
        qk_scale,
        negate_q,
        num_m_tiles,
        window_left,
        window_right,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        cu_seqlens_q,
        cu_seqlens_k,
        sink,
    ):
        """One block: BLOCK_M query rows of one (batch, head). q, k, v: flat int16 views (fp16 or bf16 bit
        patterns) of (B, H, N, D) tensors, k and v with H // group heads, with the given element strides;
        o: (B, H, seqlen_q, head_dim), flat, contiguous, int32 pairs (O_PAIRS) or int16; lse: (B, H,
        seqlen_q) fp32, flat. The window, softcap and slopes arguments as ``common.feature_args`` gives
        them, read only where the kernel's Features say so. VARLEN: B = 1, N the packed totals, and the
        block's (tile, sequence·head) reads its sequence's rows from cu_seqlens_q and cu_seqlens_k
        (``common.offset_args``); num_m_tiles covers max_seqlen_q. sink: (heads,) fp32, natural log, read with
        SINK only (``common.sink_arg``)."""
        # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
        diag = seqlen_k - seqlen_q
        m_block = cuda.blockIdx.x % num_m_tiles
        if RIGHT:
            m_block = num_m_tiles - 1 - m_block  # the longest rows first
        start_m = m_block * BLOCK_M
        off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        # GQA: the group's query heads share key/value head off_hk, read in place (no repeated K, V).
        off_hk = off_h // group
        if VARLEN:
            # Sequence off_b: queries q_start .. q_start + seqlen_q of the packed q (and O, L), keys k_start ..
            # k_start + seqlen_k of k and v; its own lengths (and their diag) stand for seqlen_q and seqlen_k
            # from here on. A tile past its end exits (the whole block, before any barrier or warp-wide
            # instruction).
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            o_start = off_h * seqlen_q + q_start  # O's and L's row of the sequence's query 0
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                return
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane // 4  # the lane holds rows g and g + 8 of the warp's 16, columns 2 t and 2 t + 1 of each 8
        t = lane % 4

        smem = cuda.shared.array(SMEM_SIZE, int16, alignment=SHARED_ALIGN)
        smem_base = shared_address(smem)
        q_base, k_base, v_base = global_address(q), global_address(k), global_address(v)
        if VARLEN:  # the sequence's first rows
            q_offset = off_h * stride_qh + q_start * stride_qm
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            q_offset = off_b * stride_qb + off_h * stride_qh
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh

        # The byte addresses this lane gives ldmatrix: Q's rows (A), K's (B, keys as rows), V's (B, .trans).
        a_row, a_col = ldmatrix_a_row_col(lane)
        b_row, b_col = ldmatrix_b_row_col(lane)
        q_lane = smem_base + uint32(2 * ((16 * warp + a_row) * LD + a_col))
        k_lane = smem_base + uint32(2 * (b_row * LD + b_col))
        v_lane = smem_base + uint32(2 * ((V_ROW + a_row) * LD + a_col))

        # Q: global -> shared -> the warp's A fragments, one per 16 head dims.
        load_q(smem, smem_base, 0, q, q_base, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim)
        wait_tiles()
        cuda.syncthreads()
        q_frag = cuda.local.array((D_STEPS, 4), int32)  # [16 rows, HEAD_DIM] as D_STEPS A fragments
        for kk in range(D_STEPS):
            a0, a1, a2, a3 = ldsm(q_lane + uint32(32 * kk))
            q_frag[kk, 0] = a0
            q_frag[kk, 1] = a1
            q_frag[kk, 2] = a2
            q_frag[kk, 3] = a3
            if negate_q:  # scale < 0 runs as -q against |scale| (flipping a sign bit is exact)
                for e in range(4):
                    q_frag[kk, e] ^= SIGN_BITS
        cuda.syncthreads()  # every warp has its fragments: the buffer now takes K and V

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        m_safe = cuda.local.array(2, float32)
        acc = cuda.local.array((O_TILES, 4), float32)  # [16 rows, HEAD_DIM] as 8-column C tiles
        s = cuda.local.array((S_BUFFERS, N_TILES, 4), float32)  # [16 rows, BLOCK_N] as 8-key C tiles
        for h in range(2):
            m_i[h] = -math.inf
            l_i[h] = 0.0
        for c in range(O_TILES):
            for e in range(4):
                acc[c, e] = 0.0

        # The key tiles that hold a key some row of the block sees: from the first row's left edge to the last
        # row's right edge, clipped to [0, seqlen_k); the others are skipped (causal: window_right = 0).
        begin_n = max(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N if LEFT else 0
        end_n = min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag + window_right) if RIGHT else seqlen_k
        warp_m = start_m + 16 * warp
        row0 = warp_m + g
        # Within them, the tiles this warp's rows see: from its first row's left edge to its last row's right
        # edge (warp_sees; with a left bound). On the block's other tiles (its first or last few) the warp only
        # takes part in the loads and barriers: its S, softmax and P V are skipped, which leaves m_i, l_i and
        # acc as a wholly masked tile would. With window (1024, 0), 128 x 64 tiles, each warp skips one of a
        # block's 18 tiles.
        warp_lo = warp_m + diag - window_left if LEFT else 0
        warp_hi = min(warp_m + 16, seqlen_q) + diag + window_right if RIGHT else seqlen_k
        # ALiBi's slope for this (batch or sequence, head), in base 2; with ALiBi, the exponentials take final
        # scores.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        exp_scale = float32(1.0) if ALIBI else softcap_log2 if SOFTCAP else qk_scale
        warp_diag = warp_m + diag  # row_max's diagonals, of the warp's first row and of the lane's row g
        lane_diag = row0 + diag - 2 * t
        if begin_n < end_n:
            load_kv(smem, smem_base, 0, k, k_base, k_offset, stride_kn, stride_kd, begin_n, seqlen_k, head_dim)
        if S_AHEAD:
            # S of the next key tile is computed while the softmax of this one runs, their instructions
            # interleaved in the source (ptxas keeps that order), so that each warp has mma and FP32 work to
            # issue at once: s[0] and s[1] take turns.
            if begin_n < end_n:
                wait_tiles()
                cuda.syncthreads()
                if warp_sees(begin_n, warp_lo, warp_hi):
                    qk_0(s, q_frag, k_lane)
                cuda.syncthreads()  # every warp is done with K's first tile
                if begin_n + BLOCK_N < end_n:
                    load_kv(
                        smem,
                        smem_base,
                        0,
                        k,
                        k_base,
                        k_offset,
                        stride_kn,
                        stride_kd,
                        begin_n + BLOCK_N,
                        seqlen_k,
                        head_dim,
                    )
            for start_n in range(begin_n, end_n, 2 * BLOCK_N):
                for half in range(2):  # the tiles at start_n (S in s[0]) and start_n + BLOCK_N (in s[1])
                    n0 = start_n + half * BLOCK_N
                    if n0 < end_n:
                        wait_tiles()
                        cuda.syncthreads()  # K's next tile has landed; every warp is done with V's tile
                        load_kv(
                            smem, smem_base, V_ROW, v, v_base, v_offset, stride_vn, stride_vd, n0, seqlen_k, head_dim
                        )
                        # The warp's S of this tile is in s[half] if it sees the tile; that of the next tile,
                        # in K's buffer now, goes to s[1 - half] if it sees that one.
                        sees = warp_sees(n0, warp_lo, warp_hi)
                        sees_next = n0 + BLOCK_N < end_n and warp_sees(n0 + BLOCK_N, warp_lo, warp_hi)
                        rescale = False
                        if half == 0:
                            if sees:
                                rescale = max_0(
                                    s,
                                    m_i,
                                    alpha,
                                    m_safe,
                                    n0,
                                    seqlen_k,
                                    warp_diag,
                                    lane_diag,
                                    t,
                                    qk_scale,
                                    window_left,
                                    window_right,
                                    softcap_log2,
                                    slope,
                                    exp_scale,
                                )
                                # side-by-side: ladder-s-ahead
                                if sees_next:
                                    ahead_0(s, q_frag, k_lane, l_i, alpha, m_safe, exp_scale)
                                else:
                                    exp_0_row_g(s, l_i, alpha, m_safe, exp_scale)
                                    exp_0_row_g8(s, l_i, alpha, m_safe, exp_scale)
                                # side-by-side: end
                            elif sees_next:
                                qk_1(s, q_frag, k_lane)
                        else:
                            if sees:
                                rescale = max_1(
                                    s,
                                    m_i,
                                    alpha,
                                    m_safe,
                                    n0,
                                    seqlen_k,
                                    warp_diag,
                                    lane_diag,
                                    t,
                                    qk_scale,
                                    window_left,
                                    window_right,
                                    softcap_log2,
                                    slope,
                                    exp_scale,
                                )
                                if sees_next:
                                    ahead_1(s, q_frag, k_lane, l_i, alpha, m_safe, exp_scale)
                                else:
                                    exp_1_row_g(s, l_i, alpha, m_safe, exp_scale)
                                    exp_1_row_g8(s, l_i, alpha, m_safe, exp_scale)
                            elif sees_next:
                                qk_0(s, q_frag, k_lane)
                        wait_tiles()
                        cuda.syncthreads()  # V's tile has landed; every warp is done with K's
                        if n0 + 2 * BLOCK_N < end_n:
                            load_kv(
                                smem,
                                smem_base,
                                0,
                                k,
                                k_base,
                                k_offset,
                                stride_kn,
                                stride_kd,
                                n0 + 2 * BLOCK_N,
                                seqlen_k,
                                head_dim,
                            )
                        if sees:
                            if half == 0:
                                pv_0(s, acc, alpha, rescale, v_lane)
                            else:
                                pv_1(s, acc, alpha, rescale, v_lane)
        else:
            # side-by-side: ladder-double-buffer
            for start_n in range(begin_n, end_n, BLOCK_N):
                wait_tiles()
                cuda.syncthreads()  # K's tile has landed; every warp is done with the previous V tile
                load_kv(smem, smem_base, V_ROW, v, v_base, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim)
                sees = warp_sees(start_n, warp_lo, warp_hi)
                if sees:
                    qk_0(s, q_frag, k_lane)
                wait_tiles()
                # side-by-side: end
                cuda.syncthreads()  # V's tile has landed; every warp is done with K's
                if start_n + BLOCK_N < end_n:
                    load_kv(
                        smem,
                        smem_base,
                        0,
                        k,
                        k_base,
                        k_offset,
                        stride_kn,
                        stride_kd,
                        start_n + BLOCK_N,
                        seqlen_k,
                        head_dim,
                    )
                if sees:
                    rescale = max_0(
                        s,
                        m_i,
                        alpha,
                        m_safe,
                        start_n,
                        seqlen_k,
                        warp_diag,
                        lane_diag,
                        t,
                        qk_scale,
                        window_left,
                        window_right,
                        softcap_log2,
                        slope,
                        exp_scale,
                    )
                    exp_0_row_g(s, l_i, alpha, m_safe, exp_scale)
                    exp_0_row_g8(s, l_i, alpha, m_safe, exp_scale)
                    pv_0(s, acc, alpha, rescale, v_lane)

        # Epilogue: the row sums over each quad, then O = acc / l and L = m + log(l), each once.
        if SINK:  # the head's sink, in base 2 as m_i
            sink_log2 = sink[off_h] * float32(LOG2E)
        if not VARLEN:
            o_start = off_bh * seqlen_q  # O's and L's row of query 0 of this (batch, head)
        for h in range(2):
            l_sum = l_i[h] + shfl_xor(l_i[h], 1)
            l_sum += shfl_xor(l_sum, 2)
            row = row0 + 8 * h
            if row < seqlen_q:
                if SINK:
                    # The sink joins the denominator: O = acc · alpha / l, L = m + log2 l (l >= 1).
                    m_row, l_sum, alpha_row = with_sink(m_i[h], l_sum, sink_log2)
                    inv_l = alpha_row / l_sum
                else:
                    # Rows that saw no key have l = 0: O = 0 and L = +inf (see fa2.attention). A NaN score
                    # makes l NaN, and O and L must then be NaN, not the no-key marker: != 0, not > 0.
                    m_row = m_i[h]
                    inv_l = float32(1.0) / l_sum if l_sum != 0.0 else float32(0.0)
                o_row = (o_start + row) * head_dim
                for c in range(O_TILES):
                    col = 8 * c + 2 * t
                    pair = pack(acc[c, 2 * h] * inv_l, acc[c, 2 * h + 1] * inv_l)
                    if O_PAIRS:
                        if EVEN_HEAD_DIM or col < head_dim:
                            o[uint64((o_row + col) // 2)] = pair
                    else:
                        if col < head_dim:
                            o[uint64(o_row + col)] = int16(pair & 0xFFFF)
                        if col + 1 < head_dim:
                            o[uint64(o_row + col + 1)] = int16(pair >> 16)
                if t == 0:
                    L = (m_row + math.log2(l_sum)) * LN2 if l_sum != 0.0 else math.inf
                    lse[uint64(o_start + row)] = L

    if simulated():
        return cuda.jit(_attn_fwd_tc)
    # The cap is for the cp.async kernels: with plain loads, whose unrolled 16-bit loads ptxas hoists for
    # latency, 128 registers spill hundreds of bytes (offline, sm_90).
    # side-by-side: ladder-maxnreg
    if config.MAX_REGISTERS and ASYNC_LOADS:
        return cuda.jit(max_registers=config.MAX_REGISTERS)(_attn_fwd_tc)
    return cuda.jit(_attn_fwd_tc)
    # side-by-side: end


# Compiled kernels by (HEAD_DIM, TensorCoreConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16,
# EVEN_HEAD_DIM, ASYNC_LOADS, O_PAIRS).
_KERNELS: dict[tuple, object] = {}
# Prepared launches (``launch.prepare``) by class of call: q's, k's and v's shapes, strides and dtypes, the
# device, whether their data is 16 B aligned (cp.async), the spec's values (``spec_class``), the config:
# everything the kernel, its grid and its arguments other than the tensors' memory are functions of.
_PREPARED: dict[tuple, object] = {}


def _kernel(*key):
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _build_kernel(*key)
    return kernel


def shared_bytes(HEAD_DIM: int, config: TensorCoreConfig) -> int:
    """The block's static shared memory: max(BLOCK_M, 2 BLOCK_N) rows of HEAD_DIM + 8 16-bit elements."""
    return 2 * max(16 * config.NUM_WARPS, 2 * config.BLOCK_N) * (HEAD_DIM + 8)


def _check_config(HEAD_DIM: int, config: TensorCoreConfig) -> None:
    if config.NUM_WARPS < 1 or config.BLOCK_N < 16 or config.BLOCK_N % 16:
        raise ValueError(f"TensorCoreConfig needs NUM_WARPS >= 1 and BLOCK_N a multiple of 16, got {config}")
    if shared_bytes(HEAD_DIM, config) > 48 * 1024:
        raise ValueError(
            f"{config} at head dim {HEAD_DIM} needs {shared_bytes(HEAD_DIM, config)} B of shared memory, over "
            "the 48 KB a block may have statically"
        )


def _qk_scale(scale: float) -> np.float32:
    """The kernel's qk_scale: |scale| · log2 e (a negative scale flips q's sign in the kernel), at least the
    smallest normal fp32 (1.2e-38) so that it is > 0: for scale = 0, scaled scores are then below 1e-26 in
    magnitude (|q kᵀ| < 1e12 for fp16 inputs), and exp2 of them is 1.0 in fp32, as it is for 0."""
    return np.float32(max(abs(scale) * LOG2E, float(np.finfo(np.float32).tiny)))


def _score_scale(spec: AttentionSpec) -> np.float32:
    """What the kernel multiplies raw scores (of q's sign-flipped fragments) by: ``_qk_scale``, or with a
    softcap c, |scale| / c, the argument of tanh (``_softcap_log2``)."""
    if spec.softcap > 0:
        return np.float32(abs(spec.scale) / spec.softcap)
    return _qk_scale(spec.scale)


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    config: TensorCoreConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to key/value
            head h // (heads // heads_k); any strides; fp16 or bf16, head_dim <= 128; CUDA tensors on compute
            capability 8.0+, or CPU tensors under numba's simulator (emulated instructions, tiny shapes).
        spec: what to compute (``fa2.spec.AttentionSpec``): scale, window (left, right) bottom-right
            aligned (key j visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
            seqlen_q + right, -1 unbounded; causal is (-1, 0)), softcap, ALiBi slopes; as
            ``fa2_numba_cuda.forward.flash_attn_forward`` draws them::

                causal, seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                                      1 1 1 1 1

            With cu_seqlens_q and cu_seqlens_k (spec.varlen, a packed batch): q (1, heads, total_q,
            head_dim), k, v (1, heads_k, total_k, head_dim), each sequence with its own lengths, as
            ``fa2_numba_cuda.forward.flash_attn_forward`` describes.
        config: the block shape, for tuning; default ``tc_config(padded_head_dim(head_dim))``.

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype. L: (batch, heads, seqlen_q), float32, natural log;
        rows that see no key get O = 0 and L = +inf. Packed: O (1, heads, total_q, head_dim), L (1, heads,
        total_q); one kernel launch.
    """
    key = None
    if launch.FAST:  # a call of a class met before: the kernel's parameters are packed, only pointers change
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
        key = (
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            v.shape,
            v.stride(),
            q.dtype,
            k.dtype,
            v.dtype,
            q.device,
            aligned,
            spec_class(spec),
            None if config is None else tuple(config),
        )
        # side-by-side: ladder-prepared
        prepared = _PREPARED.get(key)
        if prepared is not None:
            O = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            L = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            prepared(q, k, v, O, L, *spec_tensors(spec), *sink_tensors(spec))
            return O, L
        # side-by-side: end
    batch, heads, seqlen_q, head_dim = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"fa2-numba-cuda's tensor-core kernel takes fp16 or bf16, got {q.dtype}")
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-numba-cuda's tensor-core kernel supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    check_device(q)
    if not simulated() and capability(q.device) < MIN_COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"fa2-numba-cuda's tensor-core kernel needs compute capability 8.0 or newer (mma.sync m16n8k16 with "
            f"bf16, ldmatrix, cp.async), got {capability(q.device)} on {q.device}"
        )
    O = torch.empty(batch, heads, seqlen_q, head_dim, dtype=q.dtype, device=q.device)
    L = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if O.numel() == 0:
        return O, L

    HEAD_DIM = padded_head_dim(head_dim)
    config = TensorCoreConfig(*config) if config is not None else tc_config(HEAD_DIM)
    _check_config(HEAD_DIM, config)
    # side-by-side: ladder-cp-async
    async_loads = config.CP_ASYNC and all(rows_16b_aligned(t) for t in (q, k, v))
    # side-by-side: end
    o_pairs = head_dim % 2 == 0
    kernel = _kernel(
        HEAD_DIM,
        config,
        *features(spec),
        spec.sink is not None,
        q.dtype == torch.bfloat16,
        head_dim == HEAD_DIM,
        async_loads,
        o_pairs,
    )
    # Packed: one block per (query tile of the longest sequence, sequence·head); the others' extra tiles exit.
    grid_batch, grid_seqlen_q, _ = grid_extent(spec, q, k)
    num_m_tiles = -(-grid_seqlen_q // (16 * config.NUM_WARPS))
    group = heads // k.shape[1]  # query heads per key/value head (the interface checked the division)
    grid, block = num_m_tiles * grid_batch * heads, 32 * config.NUM_WARPS
    if grid == 0:
        return O, L
    o_view = O.view(torch.int32) if o_pairs else O.view(torch.int16)
    head = (
        *(t.view(torch.int16) for t in (q, k, v)),
        o_view,
        L,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        heads,
        group,
        seqlen_q,
        k.shape[2],
        head_dim,
        _score_scale(spec),
        spec.scale < 0,
        num_m_tiles,
    )
    feats = feature_args(spec, seqlen_q, k.shape[2], q.device)
    args = (*head, *feats, *offset_args(spec, q.device), sink_arg(spec, q.device))
    # What changes within a class: q, k, v, O, L and the spec's tensors.
    varying = (0, 1, 2, 3, 4, *spec_positions(spec, len(head), len(args) - 3), *sink_positions(spec, len(args) - 1))
    prepared = launch.prepare(kernel, grid, block, q.device, args, varying)
    if prepared is not None and key is not None:
        _PREPARED[key] = prepared
    return O, L


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every tensor-core kernel
    compiled so far in this process (one row per specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (HEAD_DIM, config, *switches, SINK, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, O_PAIRS), kernel in _KERNELS.items():
        regs = kernel.get_regs_per_thread()
        shared = kernel.get_shared_mem_per_block()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": "tensor-core",
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    **feature_columns(switches),
                    "sink": SINK,
                    "bf16": IS_BF16,
                    "even_head_dim": EVEN_HEAD_DIM,
                    "async_loads": ASYNC_LOADS,
                    "o_pairs": O_PAIRS,
                    "signature": ", ".join(str(t) for t in signature),
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": shared[signature],
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
