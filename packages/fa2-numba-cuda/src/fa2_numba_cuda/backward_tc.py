"""FlashAttention-2 backward on tensor cores: fp16 and bf16, ``mma.sync`` from numba-cuda through inline PTX.

The algorithm of ``fa2_numba_cuda.backward_simt`` (FA2, Algorithm 2, in its two-kernel split: delta =
rowsum(dO ∘ O) by the SIMT preprocess, then one kernel for dK and dV, one for dQ (with an attention sink,
dsink's shares too: each warp's from the L and delta its rows already hold); every element of dq, dk, dv
written once, no atomics: deterministic), with every matrix product on tensor cores (``mma.py``'s m16n8k16
instructions and layouts; fp32 accumulators; P and dS rounded to the inputs' 16-bit type as operands, as
FlashAttention-2's own kernel does):

- ``_attn_bwd_dkdv_tc``: one block per (key tile of BLOCK_N = 16 · DKDV_WARPS keys, batch·key/value head);
  warp w owns keys 16 w .. 16 w + 15 of the tile and never exchanges data with another warp. Its K and V
  rows are loaded once (through shared memory, ``ldmatrix``) into A fragments that stay in registers. For
  each query head of the group (GQA) and each query tile of DKDV_BLOCK_M rows that sees the key tile, Q and
  dO go to shared memory (with L · log2 e and delta of its rows), and per warp, in the accumulator layout of
  ``mma.py`` (lane 4 g + t: keys g and g + 8, queries 8 j + 2 t and 8 j + 2 t + 1)::

      Sᵀ = K Qᵀ         B = Qᵀ: Q's rows are B's columns, ``ldmatrix`` as K's in the forward
      Pᵀ = exp2(Sᵀ · scale · log2 e - L · log2 e)   (masked elements 0)
      dPᵀ = V dOᵀ       B = dOᵀ, as Qᵀ
      dSᵀ = Pᵀ ∘ (dPᵀ - delta)
      dV += Pᵀ dO       A = Pᵀ repacked from its accumulators (the forward's P V), B = dO by ``ldmatrix.trans``
      dK += dSᵀ Q       A = dSᵀ repacked, B = Q by ``ldmatrix.trans``

  then dk = scale · dK and dv = dV are written once. Per thread: K's and V's fragments (HEAD_DIM / 4
  registers each), dK's and dV's accumulators (HEAD_DIM / 2 each), Sᵀ and dPᵀ (DKDV_BLOCK_M / 2 each).
- ``_attn_bwd_dq_tc``: one block per (query tile of BLOCK_M = 16 · DQ_WARPS rows, batch·head); warp w owns
  rows 16 w .. 16 w + 15 with their Q and dO fragments in registers, L and delta of its two rows per lane;
  per key tile of DQ_BLOCK_N keys that its rows see (K and V in shared memory): S = Q Kᵀ and dP = dO Vᵀ (B
  fragments as the forward's Kᵀ), P, dS = P ∘ (dP - delta), dQ += dS K (K by ``ldmatrix.trans``, as the
  forward's V); dq = scale · dQ written once. With SINK, after the loop, each warp also writes its rows'
  share of the sink's gradient, -Σ exp(sink[h] - L) · delta, summed per head afterwards (``sink_gradient``).

Shared memory: rows of HEAD_DIM + 8 16-bit elements (the forward's padding: an ``ldmatrix``'s 8 row
addresses in distinct banks), loaded with ``cp.async`` (16 B a thread, zero-filled past the rows or
head_dim) where q, k, v and dO are contiguous along head_dim with 16 B aligned rows, else with plain loads
(any strides). Both loops are double-buffered with one barrier a step: step i waits for its tiles, passes
the barrier (every warp is then done with the other buffer), issues step i + 1's copies into the other
buffer and computes, so that the copies overlap the mma work. The dK/dV kernel's steps run over (query head
of the group, query tile); its two Q/dO buffers take the rows K's tile used before its fragments were in
registers, or follow K's and V's tiles where these stay in shared memory (``K_IN_SHARED``; the dQ kernel's
Q and dO likewise, ``QDO_IN_SHARED``). The tiles are dynamic shared memory (``tile_bytes``, passed by the
launch), so that a block may have more than the 48 KB of static shared memory: ``launch`` raises the
kernel's limit past 48 KB (up to 227 KB on sm_90); L and delta of the dK/dV kernel's query tiles are
static.

Scores, masks and L as ``backward_simt``: base 2 (P = exp2(S · scale · log2 e - L · log2 e)), rows with L =
+inf (they see no key) and query rows past seqlen_q (read with L = +inf) get P = 0, so zero gradients;
keys past seqlen_k are masked in the dQ kernel (their zero-filled K and V rows are never written back by
the dK/dV kernel). Windows (LEFT, RIGHT of ``common.Features``; causal is (-1, 0)), bottom-right aligned,
key j visible to query i iff i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q: masked
per element where a tile crosses a window edge, and whole tiles skipped as ``backward_simt`` skips them.
seqlen_q, seqlen_k need not be multiples of anything; head_dim is padded to a multiple of 16 with zeros.
Softcap and ALiBi (SOFTCAP, ALIBI of ``common.Features``, compile-time; softcap_log2 and the slopes runtime
arguments after the tile count, unread without them) as ``backward_simt`` computes them, in the base-2 form of
``forward_tc``: with a softcap c the raw score s gives x = c · log2 e · tanh(s · scale / c) (``tanh_approx``:
relative error at most 2^-10.99, the forward's) and dS (dSᵀ) is multiplied by 1 - tanh², the cap's
derivative; ALiBi subtracts slope · log2 e · |i + diag - j| from x (one FMA, the distance from a per-step value
and a constant per element); then P = exp2(x - L · log2 e), the mask as above. The slopes get no gradient.

Packed (variable-length) batches as ``backward_simt`` and ``forward_tc`` take them (``spec.varlen``; the VARLEN
switch of ``Features``): q, O, dO (1, heads, total_q, head_dim), L (1, heads, total_q), k, v (1, heads_k,
total_k, head_dim). Still one launch per kernel, with no host sync: the preprocess runs on the packed rows as on
one sequence of total_q (delta is per row); the dK/dV grid is (key tile of max_seqlen_k, sequence·key/value
head), the dQ grid (query tile of max_seqlen_q, sequence·head) (``common.grid_extent``). Each block reads its
sequence's offsets (``common.offset_args``, the kernels' last two arguments, so that the kernels without VARLEN
keep every other parameter where it was and compile to the same instructions), exits before its first load
where its tile starts past the sequence's end (the whole block: no barrier or ``mma`` left waiting), and
otherwise runs on the sequence's rows with its own lengths: the window and its skipped tiles, ALiBi's
slopes[s, h] and distance, keys past the sequence masked, query rows past it read with L = +inf, per sequence. A
key tile of a sequence without queries writes dk = dv = 0. With SINK, a dQ block that exits writes its warps'
shares as zeros, so that every share of the (heads, sequences · num_m_tiles · DQ_WARPS) parts is written
(``backward_simt.dsink_parts`` with per_sequence), and dsink sums every sequence's rows per head. cp.async needs
the packed rows 16 B aligned, as a dense batch's.

Not here: fp32, head_dim > 128 (``backward_simt`` computes them). ``fa2_numba_cuda.backward.flash_attn_backward``
picks these kernels for every fp16 and bf16 input with head_dim <= 128 (``uses_tensor_cores``), whatever the
spec: on the H200 (B1 H16 N16k D128 causal bf16) a softcap of 50 runs at 0.95× the dense kernels' TFLOP/s and
ALiBi at 0.99×, where ``backward_simt`` gave both 15 TFLOP/s (docs/notes/numba-tc-backward.md).

Launch: on torch's current CUDA stream, no host synchronisation; one compiled kernel per (kernel, padded
head dim, TensorCoreBwdConfig, Features, bf16 or fp16, head_dim == padded, cp.async or plain loads, head_dim
even: outputs stored in pairs), cached; ``kernel_resources`` reports registers, shared and local memory of
each. Launched through ``launch.prepare``, classes of calls keyed as ``backward_simt``'s (``_PREPARED``).
Under numba's CUDA simulator the instructions are ``mma.py``'s Python emulations (slow: tiny shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, float32, int16, int32, uint32, uint64

from fa2.spec import AttentionSpec
from fa2_numba_cuda import launch
from fa2_numba_cuda.backward_simt import dsink_parts, launch_preprocess, preprocess_tensors, sink_gradient
from fa2_numba_cuda.common import (
    LOG2E,
    SHARED_ALIGN,
    check_device,
    dsink_arg,
    feature_args,
    feature_columns,
    features,
    grid_extent,
    jit_kernel,
    offset_args,
    rows_16b_aligned,
    score_scale,
    sequence,
    simulated,
    sink_arg,
    spec_class,
    spec_tensors,
)
from fa2_numba_cuda.mma import (
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


class TensorCoreBwdConfig(NamedTuple):
    """The two kernels' blocks: the dK/dV kernel's DKDV_WARPS warps of 16 keys each (BLOCK_N = 16 ·
    DKDV_WARPS) against query tiles of DKDV_BLOCK_M rows (a multiple of 16); the dQ kernel's DQ_WARPS warps of
    16 query rows each against key tiles of DQ_BLOCK_N keys (a multiple of 16). MAX_REGISTERS caps ptxas (0:
    no cap). V_IN_SHARED: the dK/dV kernel keeps V's tile in shared memory, its A fragments loaded by
    ``ldmatrix`` for each dPᵀ, instead of in registers (HEAD_DIM / 4 fewer per thread); K_IN_SHARED: the
    same for K's tile and each Sᵀ. QDO_IN_SHARED: the dQ kernel keeps its Q and dO rows in shared memory
    (their A fragments loaded for each S and dP) instead of in registers (HEAD_DIM / 2 fewer).

    Two switches for the optimisation ladder (``fa2_numba_cuda.ladder``), on in every configuration the kernels
    choose: LDMATRIX, every fragment from shared memory by ``ldmatrix`` (off: ``mma.lds_x4``, the same
    registers from plain shared loads); CP_ASYNC, the tiles copied by ``cp.async`` where the inputs allow it
    (off: plain loads always)."""

    DKDV_WARPS: int
    DKDV_BLOCK_M: int
    DQ_WARPS: int
    DQ_BLOCK_N: int
    MAX_REGISTERS: int
    V_IN_SHARED: bool = False
    K_IN_SHARED: bool = False
    QDO_IN_SHARED: bool = False
    LDMATRIX: bool = True
    CP_ASYNC: bool = True


# The blocks by padded head dim (up to 112 chosen when the tiles had to fit 48 KB of static shared memory:
# the largest that did and whose registers do not spill, offline; at D64 the dQ kernel's 32-key tiles,
# faster on the H200 than 64): up to 64, 64-query tiles in the dK/dV kernel and 32-key tiles in the dQ
# kernel; 80 and 96, 32 and 48; 112, 16 and 32 (8 warps x 64 queries spill 36 B there). 128: 8 dK/dV warps
# (128 keys) against 64-query tiles with K and V read from shared memory (139,264 B of dynamic shared memory
# and 1,024 static a block): the fastest of six dK/dV and four dQ candidates on the H200
# (.whl/scripts/bench_tc_bwd_dyn.py, bf16, B 4, H 16, N 2k / 4k, full / causal: 201 / 166 / 213 / 195 TFLOP/s
# against 177 / 152 / 188 / 176 with the 16-query tiles of 4 warps; the dQ candidates with Q and dO in
# shared memory were slower).
# side-by-side: ladder-tiles
TC_BWD_CONFIGS = {
    64: TensorCoreBwdConfig(4, 64, 4, 32, 0, True),
    96: TensorCoreBwdConfig(4, 32, 4, 48, 0, True),
    112: TensorCoreBwdConfig(4, 16, 4, 32, 0, True),
    128: TensorCoreBwdConfig(8, 64, 4, 32, 0, True, True),
}
# side-by-side: end
# Where a device allows a block less shared memory than an entry needs (sm_86 and sm_89: 99 KB, against
# D128's 140,288 B): the tiles that fit 48 KB, D128's before the dynamic shared memory.
TC_BWD_CONFIGS_48KB = {
    128: TensorCoreBwdConfig(4, 16, 4, 32, 0, True),
}


def tc_bwd_config(HEAD_DIM: int, max_shared: int | None = None) -> TensorCoreBwdConfig:
    """The blocks for a padded head dim (``TC_BWD_CONFIGS``' entry for the least head dim >= HEAD_DIM; where
    it needs more shared memory a block than ``max_shared``, the device's limit, ``TC_BWD_CONFIGS_48KB``'s):
    the dK/dV kernel's 16 · DKDV_WARPS keys (V's tile in shared memory, K's too with K_IN_SHARED) against
    DKDV_BLOCK_M-query tiles, the dQ kernel's 64 query rows (4 warps) against DQ_BLOCK_N-key tiles. Per
    dK/dV thread: K's fragments (but with K_IN_SHARED), dK's and dV's accumulators, HEAD_DIM / 4 + HEAD_DIM
    registers, and Sᵀ, dPᵀ DKDV_BLOCK_M / 2 each; per dQ thread:
    Q's and dO's fragments, dQ's accumulator, HEAD_DIM registers, and S, dP DQ_BLOCK_N / 2 each. No cap.
    Offline (numba's PTX, ptxas -v, sm_90, bf16, cp.async, even head_dim), registers per thread (no spills
    in any), shared memory per block, full / causal:

        HEAD_DIM   dK/dV                                dQ
        32         162 / 154, 26,624 B (64 queries)     127 / 164, 20,480 B (measured with 64 keys)
        48         179 / 239, 36,864 B (64)             169 / 166, 28,672 B (measured with 64 keys)
        64         239 / 243, 47,104 B (64)             126 / 128 (32 keys; 166 / 236 with 64)
        96         246 / 246, 40,448 B (32)             250 / 254, 39,936 B (48)
        112        - / 245, 30,976 B (16)               - / 244, 30,720 B (32)
        128        255 / 255, 140,288 B (8 warps, 64)   240 / 240, 34,816 B (32)

    Plain loads (rows not 16 B aligned) at D48, D64 and D128 causal: at most 248 registers, no spills.
    Instructions in the dK/dV kernel's loop body a step (nvdisasm of the same cubin), full: D64 696 for
    128 mma (was 350 for 32), D128 366 for 64 (was 445).
    (Before these tiles, 16-query dK/dV tiles and 32-key dQ tiles at every head dim: D64 dK/dV 172 / 168,
    dQ 158 / 156 registers; D128 dK/dV 255 / 254 with 0 / 12 B spilled, dQ 246 / 238. 64-query tiles at D64
    spilled 52 B causal before the masks became one compare with a constant per element.) Larger tiles at
    D128 need more than 48 KB of shared memory (32-query dK/dV tiles with K in registers: 52,736 B, 40 B
    spilled full), in dynamic shared memory; offline, no spills, registers full / causal and shared memory a
    block: dK/dV with 8 warps (128 keys) x 16 queries 254 / 242, 69,888 B; with K and V in shared memory
    (K_IN_SHARED) 4 warps x 32 queries 250 / 254, 70,144 B, 8 x 32 248 / 246, 104,960 B, 8 x 64 255 / 255,
    140,288 B (4 x 64: 28 B spilled full); dQ with Q and dO in shared memory (QDO_IN_SHARED) 4 warps x 32
    keys 164 / 162, 69,632 B, 4 x 64 240 / 242, 104,448 B, 8 x 32 160 / 158, 104,448 B.
    On the H200 (.whl/scripts/bench_tc_bwd_tiles.py at 1d3e465: bf16, B 4, H 16, dK/dV + dQ + preprocess,
    TFLOP/s as 2.5x the forward's over the visible pairs), N 2048 / 4096, full and causal: D64 with 32-key dQ
    tiles 197 / 212 and 159 / 191 (64-key: 193 / 211 and 154 / 183; the old 16/32 tiles 157 / 178 and
    132 / 157), 0.79-0.90 of SDPA flash's backward. D128 (.whl/scripts/bench_tc_bwd_dyn.py at 64e2ca3, the
    same measure): 8 warps x 64 queries with K in shared memory 201 / 213 and 166 / 195, 0.73-0.81 of SDPA
    flash's (16-query tiles: 177 / 188 and 152 / 176).
    """
    d = min(d for d in TC_BWD_CONFIGS if d >= HEAD_DIM)
    config = TC_BWD_CONFIGS[d]
    if max_shared is not None and max(shared_bytes(n, HEAD_DIM, config) for n in ("dkdv", "dq")) > max_shared:
        return TC_BWD_CONFIGS_48KB.get(d, config)
    return config


def max_shared_bytes(device: torch.device) -> int:
    """The most shared memory a block may have on ``device``: its opt-in limit as torch reports it, else
    (under the simulator, or a torch without the field) the kernels' own bound, ``MAX_SHARED_BYTES``."""
    if simulated():
        return MAX_SHARED_BYTES
    return _optin_shared(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _optin_shared(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", MAX_SHARED_BYTES)


# The most shared memory a block may have, static and dynamic together, on any GPU these kernels run on
# (sm_90's 227 KB; sm_80 allows 163 KB, sm_86 and sm_89 99 KB: the launch fails there, naming the limit).
MAX_SHARED_BYTES = 227 * 1024


def _dkdv_rows(config: TensorCoreBwdConfig) -> tuple[int, int, int]:
    """The dK/dV kernel's tile rows: (QDO_ROW, V_ROW, ROWS), its two Q/dO buffers from row QDO_ROW on, V's
    tile at V_ROW, ROWS in all (K's tile at row 0). K_IN_SHARED: K, V, then the buffers. Else the buffers
    take K's rows once its fragments are in registers, and V stays past them (V_IN_SHARED) or shares them
    too."""
    BLOCK_N, BLOCK_M = 16 * config.DKDV_WARPS, config.DKDV_BLOCK_M
    if config.K_IN_SHARED:
        return 2 * BLOCK_N, BLOCK_N, 2 * BLOCK_N + 4 * BLOCK_M
    if config.V_IN_SHARED:
        v_row = max(BLOCK_N, 4 * BLOCK_M)
        return 0, v_row, v_row + BLOCK_N
    return 0, BLOCK_N, max(2 * BLOCK_N, 4 * BLOCK_M)


def _dq_rows(config: TensorCoreBwdConfig) -> tuple[int, int]:
    """The dQ kernel's tile rows: (KV_ROW, ROWS), its two K/V buffers from row KV_ROW on, ROWS in all (Q's
    rows at 0, dO's at BLOCK_M). QDO_IN_SHARED: Q, dO, then the buffers; else the buffers take Q's and
    dO's rows once their fragments are in registers."""
    BLOCK_M, BLOCK_N = 16 * config.DQ_WARPS, config.DQ_BLOCK_N
    if config.QDO_IN_SHARED:
        return 2 * BLOCK_M, 2 * BLOCK_M + 4 * BLOCK_N
    return 0, max(2 * BLOCK_M, 4 * BLOCK_N)


def tile_bytes(name: str, HEAD_DIM: int, config: TensorCoreBwdConfig) -> int:
    """The dynamic shared memory of kernel ``name`` ("dkdv" or "dq") per block: its tiles, rows of HEAD_DIM
    + 8 16-bit elements as ``_dkdv_rows`` and ``_dq_rows`` lay them out (the launch's shared size)."""
    rows = _dkdv_rows(config)[2] if name == "dkdv" else _dq_rows(config)[1]
    return 2 * rows * (HEAD_DIM + 8)


def shared_bytes(name: str, HEAD_DIM: int, config: TensorCoreBwdConfig) -> int:
    """All the shared memory of kernel ``name`` per block: ``tile_bytes`` (dynamic) and the dK/dV kernel's
    static L and delta of two query tiles (fp32)."""
    stats = 4 * 2 * (2 * config.DKDV_BLOCK_M) if name == "dkdv" else 0
    return tile_bytes(name, HEAD_DIM, config) + stats


def uses_tensor_cores(q: torch.Tensor) -> bool:
    """Whether ``fa2_numba_cuda.backward.flash_attn_backward`` runs these kernels unasked: fp16 or bf16,
    head_dim <= 128, on a CUDA device of compute capability 8.0 or newer or under numba's simulator (the
    instructions' emulations), with any spec (dense or packed, any window, softcap, ALiBi and sink), as
    ``forward_tc.uses_tensor_cores``."""
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= MAX_HEAD_DIM
        and (simulated() or (q.device.type == "cuda" and capability(q.device) >= MIN_COMPUTE_CAPABILITY))
    )


def _tile_loader(ROWS, NUM_THREADS, HEAD_DIM, EVEN_HEAD_DIM, ASYNC_LOADS):
    """load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim): rows start
    .. start + ROWS of x (element offset + n · stride_n + c · stride_d) into shared rows row0 .. (of HEAD_DIM
    + 8 elements), zeros past seqlen and head_dim. ASYNC_LOADS: 16 B chunks with cp.async, complete after
    ``cp_async_wait_all``; else plain 16-bit loads (any strides). As ``forward_tc``'s loader."""
    LD = HEAD_DIM + 8
    CHUNKS = HEAD_DIM // 8
    if ASYNC_LOADS:
        ITEMS = ROWS * CHUNKS

        # Where the block's threads cover whole rows at a time (NUM_THREADS a multiple of CHUNKS), a thread's
        # chunk column is the same on every pass and its row steps by ROW_STEP: no division per pass.
        ROW_STEP = NUM_THREADS // CHUNKS if NUM_THREADS % CHUNKS == 0 else 0

        @device_function
        def load(smem, smem_base, row0, x, x_base, offset, stride_n, stride_d, start, seqlen, head_dim):
            for it in range(-(-ITEMS // NUM_THREADS)):
                item = cuda.threadIdx.x + it * NUM_THREADS
                if ITEMS % NUM_THREADS == 0 or item < ITEMS:
                    if ROW_STEP:
                        r = cuda.threadIdx.x // CHUNKS + it * ROW_STEP
                        c = cuda.threadIdx.x % CHUNKS * 8
                    else:
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

        return load

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
                    value = x[uint64(offset + n * stride_n + c * stride_d)]
                smem[(row0 + r) * LD + c] = value

    return load


def _helpers(HEAD_DIM, IS_BF16, ASYNC_LOADS, OUT_PAIRS, EVEN_HEAD_DIM, LDMATRIX):
    """The device functions both kernels use: wait_tiles, the fragment products (``products``), and the
    epilogue's store of a warp's 16 rows of an fp32 accumulator. LDMATRIX: fragments by ``ldmatrix``, else
    by ``mma.lds_x4`` (plain shared loads)."""
    D_STEPS = HEAD_DIM // 16
    O_TILES = HEAD_DIM // 8
    LD = HEAD_DIM + 8
    mma = mma_bf16 if IS_BF16 else mma_f16
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    ldsm, ldsm_trans = (ldmatrix_x4, ldmatrix_x4_trans) if LDMATRIX else (lds_x4, lds_x4_trans)

    @device_function
    def wait_tiles():
        """This thread's tile copies have landed (a barrier after it makes the whole tile visible)."""
        if ASYNC_LOADS:
            cp_async_wait_all()

    @device_function
    def load_frag(frag, lane_address):
        """frag[kk] = the A fragment of the warp's 16 shared rows, head dims 16 kk .. 16 kk + 15."""
        for kk in range(D_STEPS):
            a0, a1, a2, a3 = ldsm(lane_address + uint32(32 * kk))
            frag[kk, 0] = a0
            frag[kk, 1] = a1
            frag[kk, 2] = a2
            frag[kk, 3] = a3

    def products(N_TILES):
        @device_function
        def rows_dot(s, frag, b_lane):
            """s = A Bᵀ for the warp's 16 rows A (frag, D_STEPS A fragments) and the N_TILES · 8 shared rows B
            (head dims as columns) at b_lane: per 16 rows and 16 head dims one ldmatrix (two B fragments)
            and two mma, into s [N_TILES, 4] (8-column C tiles)."""
            for j in range(N_TILES):
                for e in range(4):
                    s[j, e] = 0.0
            for jj in range(N_TILES // 2):
                for kk in range(D_STEPS):
                    b0, b1, b2, b3 = ldsm(b_lane + uint32(2 * (16 * jj * LD + 16 * kk)))
                    d0, d1, d2, d3 = mma(
                        frag[kk, 0],
                        frag[kk, 1],
                        frag[kk, 2],
                        frag[kk, 3],
                        b0,
                        b1,
                        s[2 * jj, 0],
                        s[2 * jj, 1],
                        s[2 * jj, 2],
                        s[2 * jj, 3],
                    )
                    s[2 * jj, 0] = d0
                    s[2 * jj, 1] = d1
                    s[2 * jj, 2] = d2
                    s[2 * jj, 3] = d3
                    d0, d1, d2, d3 = mma(
                        frag[kk, 0],
                        frag[kk, 1],
                        frag[kk, 2],
                        frag[kk, 3],
                        b2,
                        b3,
                        s[2 * jj + 1, 0],
                        s[2 * jj + 1, 1],
                        s[2 * jj + 1, 2],
                        s[2 * jj + 1, 3],
                    )
                    s[2 * jj + 1, 0] = d0
                    s[2 * jj + 1, 1] = d1
                    s[2 * jj + 1, 2] = d2
                    s[2 * jj + 1, 3] = d3

        @device_function
        def acc_plus(acc, p, x_lane):
            """acc += P X for P = p [N_TILES, 4] (the warp's 16 rows of N_TILES · 8 columns, C tiles repacked
            two at a time as A fragments, rounded to 16 bits) and X the N_TILES · 8 shared rows at x_lane
            (``ldmatrix.trans``: rows are P's columns, head dims X's columns); acc [HEAD_DIM / 8, 4]."""
            for kk in range(N_TILES // 2):
                a0 = pack(p[2 * kk, 0], p[2 * kk, 1])
                a1 = pack(p[2 * kk, 2], p[2 * kk, 3])
                a2 = pack(p[2 * kk + 1, 0], p[2 * kk + 1, 1])
                a3 = pack(p[2 * kk + 1, 2], p[2 * kk + 1, 3])
                for dd in range(D_STEPS):
                    b0, b1, b2, b3 = ldsm_trans(x_lane + uint32(2 * (16 * kk * LD + 16 * dd)))
                    d0, d1, d2, d3 = mma(
                        a0, a1, a2, a3, b0, b1, acc[2 * dd, 0], acc[2 * dd, 1], acc[2 * dd, 2], acc[2 * dd, 3]
                    )
                    acc[2 * dd, 0] = d0
                    acc[2 * dd, 1] = d1
                    acc[2 * dd, 2] = d2
                    acc[2 * dd, 3] = d3
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

        @device_function
        def rows_dot_shared(s, a_lane, b_lane):
            """rows_dot with the warp's 16 rows A in shared memory at a_lane: per 16 head dims one ldmatrix of
            A, then per 16 rows of B one ldmatrix and two mma."""
            for j in range(N_TILES):
                for e in range(4):
                    s[j, e] = 0.0
            for kk in range(D_STEPS):
                a0, a1, a2, a3 = ldsm(a_lane + uint32(32 * kk))
                for jj in range(N_TILES // 2):
                    b0, b1, b2, b3 = ldsm(b_lane + uint32(2 * (16 * jj * LD + 16 * kk)))
                    d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, s[2 * jj, 0], s[2 * jj, 1], s[2 * jj, 2], s[2 * jj, 3])
                    s[2 * jj, 0] = d0
                    s[2 * jj, 1] = d1
                    s[2 * jj, 2] = d2
                    s[2 * jj, 3] = d3
                    d0, d1, d2, d3 = mma(
                        a0, a1, a2, a3, b2, b3, s[2 * jj + 1, 0], s[2 * jj + 1, 1], s[2 * jj + 1, 2], s[2 * jj + 1, 3]
                    )
                    s[2 * jj + 1, 0] = d0
                    s[2 * jj + 1, 1] = d1
                    s[2 * jj + 1, 2] = d2
                    s[2 * jj + 1, 3] = d3

        return rows_dot, rows_dot_shared, acc_plus

    @device_function
    def store_rows(out, acc, factor, row0, rows, head_dim, g, t):
        """out's rows row0 + g and row0 + g + 8 (those below ``rows``; out flat, rows of head_dim, int32
        pairs with OUT_PAIRS, else int16) = factor · acc, rounded to 16 bits; each element once."""
        for h in range(2):
            row = row0 + g + 8 * h
            if row < rows:
                base = row * head_dim
                for c in range(O_TILES):
                    col = 8 * c + 2 * t
                    pair = pack(acc[c, 2 * h] * factor, acc[c, 2 * h + 1] * factor)
                    if OUT_PAIRS:
                        if EVEN_HEAD_DIM or col < head_dim:
                            out[uint64((base + col) // 2)] = pair
                    else:
                        if col < head_dim:
                            out[uint64(base + col)] = int16(pair & 0xFFFF)
                        if col + 1 < head_dim:
                            out[uint64(base + col + 1)] = int16(pair >> 16)

    return wait_tiles, load_frag, products, store_rows


def _build_dkdv(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, OUT_PAIRS):
    """The dK/dV kernel for one padded head dim, block shape, ``Features`` (LEFT, RIGHT, SOFTCAP, ALIBI,
    VARLEN) and input kind (compile-time)."""
    NUM_WARPS, BLOCK_M = config.DKDV_WARPS, config.DKDV_BLOCK_M
    BLOCK_N = 16 * NUM_WARPS
    NUM_THREADS = 32 * NUM_WARPS
    LD = HEAD_DIM + 8
    D_STEPS = HEAD_DIM // 16
    O_TILES = HEAD_DIM // 8
    M_TILES = BLOCK_M // 8  # 8-query tiles of Sᵀ
    V_IN_SHARED, K_IN_SHARED = config.V_IN_SHARED, config.K_IN_SHARED
    # K at rows 0 .., V at V_ROW .., two buffers of a Q tile and its dO tile from QDO_ROW on (buffer b: Q at
    # rows QDO_ROW + 2 BLOCK_M b .., dO BLOCK_M rows on), in dynamic shared memory (``tile_bytes``).
    QDO_ROW, V_ROW, _ = _dkdv_rows(config)
    ROW_STATS = 2 * BLOCK_M  # L · log2 e and delta of both buffers' queries
    assert BLOCK_M % 16 == 0 and HEAD_DIM % 16 == 0 and BLOCK_M <= NUM_THREADS
    wait_tiles, load_frag, products, store_rows = _helpers(
        HEAD_DIM, IS_BF16, ASYNC_LOADS, OUT_PAIRS, EVEN_HEAD_DIM, config.LDMATRIX
    )
    rows_dot, rows_dot_shared, acc_plus = products(M_TILES)
    load_kv = _tile_loader(BLOCK_N, NUM_THREADS, HEAD_DIM, EVEN_HEAD_DIM, ASYNC_LOADS)
    load_qdo = _tile_loader(BLOCK_M, NUM_THREADS, HEAD_DIM, EVEN_HEAD_DIM, ASYNC_LOADS)

    @device_function
    def load_step(
        smem,
        smem_base,
        lse_tile,
        delta_tile,
        buf,
        start_m,
        q,
        q_base,
        q_offset,
        stride_qm,
        stride_qd,
        do,
        do_base,
        do_offset,
        stride_dom,
        stride_dod,
        lse,
        l_offset,
        stride_lm,
        delta,
        delta_offset,
        seqlen_q,
        head_dim,
    ):
        """Buffer buf := the query tile at start_m of one head: its Q and dO rows (cp.async: landed after
        wait_tiles), L · log2 e and delta (+inf and 0 past seqlen_q: their P is zero)."""
        load_qdo(
            smem,
            smem_base,
            QDO_ROW + 2 * BLOCK_M * buf,
            q,
            q_base,
            q_offset,
            stride_qm,
            stride_qd,
            start_m,
            seqlen_q,
            head_dim,
        )
        load_qdo(
            smem,
            smem_base,
            QDO_ROW + 2 * BLOCK_M * buf + BLOCK_M,
            do,
            do_base,
            do_offset,
            stride_dom,
            stride_dod,
            start_m,
            seqlen_q,
            head_dim,
        )
        if cuda.threadIdx.x < BLOCK_M:
            r = cuda.threadIdx.x
            row = start_m + r
            lse_tile[BLOCK_M * buf + r] = float32(math.inf)
            delta_tile[BLOCK_M * buf + r] = 0.0
            if row < seqlen_q:
                lse_tile[BLOCK_M * buf + r] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                delta_tile[BLOCK_M * buf + r] = delta[uint64(delta_offset + row)]

    def _attn_bwd_dkdv_tc(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
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
        stride_dob,
        stride_doh,
        stride_dom,
        stride_dod,
        stride_lb,
        stride_lh,
        stride_lm,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        head_dim,
        scale,
        qk_scale,
        window_left,
        window_right,
        num_n_tiles,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        cu_seqlens_q,
        cu_seqlens_k,
    ):
        """One block: BLOCK_N keys of one (batch, key/value head), for the group's query heads. q, k, v, do:
        flat int16 views (fp16 or bf16 bit patterns) of (B, H, N, D) tensors, k and v with H // group heads,
        with the given element strides; lse: (B, H, seqlen_q) fp32; delta: (B·H, seqlen_q) fp32; dk, dv:
        (B, H // group, seqlen_k, head_dim), flat, contiguous, int32 pairs (OUT_PAIRS) or int16. qk_scale =
        scale · log2 e, with a softcap c scale / c (``common.score_scale``); softcap_log2 = c · log2 e and the
        slopes (B, H) with their strides as ``common.feature_args`` gives them, read only with SOFTCAP and
        ALIBI. VARLEN: B = 1, N the packed totals, and the block's (key tile, sequence·key/value head) reads
        its sequence's rows from cu_seqlens_q and cu_seqlens_k (``common.offset_args``, the last arguments:
        without VARLEN unread); num_n_tiles covers max_seqlen_k."""
        diag = seqlen_k - seqlen_q
        start_n = (cuda.blockIdx.x % num_n_tiles) * BLOCK_N
        heads_k = heads // group
        off_bhk = cuda.blockIdx.x // num_n_tiles
        off_b = off_bhk // heads_k  # the batch; with VARLEN the sequence
        off_hk = off_bhk % heads_k
        if VARLEN:
            # Sequence off_b: keys k_start .. k_start + seqlen_k of the packed k, v (and dk, dv), queries
            # q_start .. q_start + seqlen_q of q, dO, L and delta; its own lengths (and their diag) stand for
            # seqlen_q and seqlen_k from here on. A key tile past its end exits (the whole block, before any
            # barrier or warp-wide instruction).
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k_s = sequence(cu_seqlens_k, off_b, seqlen_k)
            dkv_start = off_hk * seqlen_k + k_start  # dk's and dv's row of the sequence's key 0
            total_q = seqlen_q
            seqlen_q, seqlen_k = seqlen_q_s, seqlen_k_s
            diag = seqlen_k - seqlen_q
            if start_n >= seqlen_k:
                return
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4

        smem = cuda.shared.array(0, int16, alignment=SHARED_ALIGN)  # the tiles: the launch's dynamic size
        # L · log2 e and delta of each buffer's queries.
        lse_tile = cuda.shared.array(ROW_STATS, float32)
        delta_tile = cuda.shared.array(ROW_STATS, float32)
        smem_base = shared_address(smem)
        q_base, k_base, v_base, do_base = global_address(q), global_address(k), global_address(v), global_address(do)
        a_row, a_col = ldmatrix_a_row_col(lane)
        b_row, b_col = ldmatrix_b_row_col(lane)
        own_lane = smem_base + uint32(2 * ((16 * warp + a_row) * LD + a_col))  # the warp's K rows (A)
        # Buffer 0's Q and dO (buffer 1's: 2 BLOCK_M rows on): B fragments of Qᵀ and dOᵀ (rows as columns),
        # and with .trans of Q and dO (queries as k).
        q_b_lane = smem_base + uint32(2 * ((QDO_ROW + b_row) * LD + b_col))
        do_b_lane = q_b_lane + uint32(2 * BLOCK_M * LD)
        q_t_lane = smem_base + uint32(2 * ((QDO_ROW + a_row) * LD + a_col))
        do_t_lane = q_t_lane + uint32(2 * BLOCK_M * LD)

        # K and V of the tile: global -> shared (-> the warp's A fragments), held for the whole block.
        if VARLEN:  # the sequence's first rows
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        load_kv(smem, smem_base, 0, k, k_base, k_offset, stride_kn, stride_kd, start_n, seqlen_k, head_dim)
        load_kv(smem, smem_base, V_ROW, v, v_base, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim)
        wait_tiles()
        cuda.syncthreads()
        v_lane = own_lane + uint32(2 * V_ROW * LD)
        k_frag = cuda.local.array((D_STEPS, 4), int32)  # [16 keys, HEAD_DIM] as D_STEPS A fragments
        v_frag = cuda.local.array((D_STEPS, 4), int32)
        if not K_IN_SHARED:
            load_frag(k_frag, own_lane)
        if not V_IN_SHARED:
            load_frag(v_frag, v_lane)
        if not K_IN_SHARED:
            cuda.syncthreads()  # every warp has its fragments: K's rows (the first buffer's) are free

        dk_acc = cuda.local.array((O_TILES, 4), float32)  # [16 keys, HEAD_DIM] as 8-column C tiles
        dv_acc = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((M_TILES, 4), float32)  # Sᵀ, then Pᵀ: [16 keys, BLOCK_M]
        dp = cuda.local.array((M_TILES, 4), float32)  # dPᵀ, then dSᵀ
        for c in range(O_TILES):
            for e in range(4):
                dk_acc[c, e] = 0.0
                dv_acc[c, e] = 0.0

        # The query tiles that see a key of this tile, as backward_simt's: query i sees key j iff j - diag -
        # window_right <= i <= j - diag + window_left (causal: window_right = 0).
        last_key = min(start_n + BLOCK_N, seqlen_k) - 1
        begin_m = max(start_n - diag - window_right, 0) // BLOCK_M * BLOCK_M if RIGHT else 0
        end_m = min(seqlen_q, last_key - diag + window_left + 1) if LEFT else seqlen_q
        key0 = start_n + 16 * warp + g  # the lane's keys: key0 and key0 + 8
        # GQA: dK and dV of off_hk sum over the group's query heads, accumulated in the same registers: steps
        # it = 0 .. group · m_steps over (query head off_hk · group + it // m_steps, query tile it % m_steps),
        # each step's (head, tile) the previous one's next tile, wrapping to the next head (no division in the
        # loop: 64-bit ones). Step it computes on buffer it % 2 while step it + 1's tiles load into the
        # other.
        m_steps = (end_m - begin_m + BLOCK_M - 1) // BLOCK_M if end_m > begin_m else 0
        steps = group * m_steps
        head0 = off_hk * group
        # Query head h's first row in q, dO and L is these plus h times the head's stride; in delta, delta_rows
        # plus h · delta_head.
        if VARLEN:  # the sequence's first rows; delta is per query head, (1·H, total_q)
            q_rows, do_rows, l_rows = q_start * stride_qm, q_start * stride_dom, q_start * stride_lm
            delta_rows, delta_head = q_start, total_q
        else:
            q_rows, do_rows, l_rows = off_b * stride_qb, off_b * stride_dob, off_b * stride_lb
            delta_rows, delta_head = off_b * heads * seqlen_q, seqlen_q
        if steps > 0:
            load_step(
                smem,
                smem_base,
                lse_tile,
                delta_tile,
                0,
                begin_m,
                q,
                q_base,
                q_rows + head0 * stride_qh,
                stride_qm,
                stride_qd,
                do,
                do_base,
                do_rows + head0 * stride_doh,
                stride_dom,
                stride_dod,
                lse,
                l_rows + head0 * stride_lh,
                stride_lm,
                delta,
                delta_rows + head0 * delta_head,
                seqlen_q,
                head_dim,
            )
        start_m = begin_m
        next_h = head0
        for it in range(steps):
            buf = it % 2
            # ALiBi's slope of the step's query head (next_h until the step's successor is found), in base 2.
            slope = slopes[uint64(off_b * stride_ab + next_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
            wait_tiles()
            cuda.syncthreads()  # step it's tiles have landed; every warp is done with the other buffer
            next_m = start_m + BLOCK_M
            if next_m >= end_m:
                next_m = begin_m
                next_h += 1
            if it + 1 < steps:
                load_step(
                    smem,
                    smem_base,
                    lse_tile,
                    delta_tile,
                    1 - buf,
                    next_m,
                    q,
                    q_base,
                    q_rows + next_h * stride_qh,
                    stride_qm,
                    stride_qd,
                    do,
                    do_base,
                    do_rows + next_h * stride_doh,
                    stride_dom,
                    stride_dod,
                    lse,
                    l_rows + next_h * stride_lh,
                    stride_lm,
                    delta,
                    delta_rows + next_h * delta_head,
                    seqlen_q,
                    head_dim,
                )
            buf_bytes = uint32(2 * 2 * BLOCK_M * LD * buf)
            lse_row = BLOCK_M * buf
            if K_IN_SHARED:
                rows_dot_shared(s, own_lane, q_b_lane + buf_bytes)  # Sᵀ = K Qᵀ
            else:
                rows_dot(s, k_frag, q_b_lane + buf_bytes)
            if V_IN_SHARED:
                rows_dot_shared(dp, v_lane, do_b_lane + buf_bytes)  # dPᵀ = V dOᵀ
            else:
                rows_dot(dp, v_frag, do_b_lane + buf_bytes)
            # Only tiles that cross a window edge are masked: the causal diagonal (key > query + diag +
            # right) or a left edge.
            crosses = (RIGHT and start_n + BLOCK_N - 1 > start_m + diag + window_right) or (
                LEFT and start_n < start_m + BLOCK_M - 1 + diag - window_left
            )
            # Element (j, e) is key key0 + 8 (e // 2) against query start_m + 2 t + 8 j + e % 2: masked iff
            # rel - window_right > 8 j + e % 2 - 8 (e // 2) (right) or rel + window_left < the same (left),
            # rel = key0 - start_m - 2 t - diag. So a compare with a constant each, from two values a step.
            rel = key0 - start_m - 2 * t - diag
            rel_right = rel - window_right
            rel_left = rel + window_left
            # ALiBi's distance |query + diag - key| of element (j, e) is |8 j + e % 2 - 8 (e // 2) - rel|: one
            # conversion a step, then an add and an FMA a score.
            distance = float32(-rel) if ALIBI else float32(0.0)
            for j in range(M_TILES):
                for e in range(4):
                    col = 8 * j + 2 * t + e % 2
                    if SOFTCAP or ALIBI:
                        # The forward's scores in base 2 (``forward_tc``'s): softcap c (qk_scale = scale / c),
                        # keeping tanh's derivative 1 - tanh² for dSᵀ, then ALiBi's bias.
                        if SOFTCAP:
                            tanh_s = tanh_approx(s[j, e] * qk_scale)
                            x = tanh_s * softcap_log2
                        else:
                            x = s[j, e] * qk_scale
                        if ALIBI:
                            x = cuda.fma(-slope, abs(distance + float32(8 * j + e % 2 - 8 * (e // 2))), x)
                        p = exp2_approx(x - lse_tile[lse_row + col])
                    else:
                        p = exp2_approx(s[j, e] * qk_scale - lse_tile[lse_row + col])
                    if crosses:
                        offset = 8 * j + e % 2 - 8 * (e // 2)
                        if (RIGHT and rel_right > offset) or (LEFT and rel_left < offset):
                            p = float32(0.0)
                    s[j, e] = p
                    dp[j, e] = p * (dp[j, e] - delta_tile[lse_row + col])
                    if SOFTCAP:
                        dp[j, e] *= float32(1.0) - tanh_s * tanh_s
            acc_plus(dv_acc, s, do_t_lane + buf_bytes)  # dV += Pᵀ dO
            acc_plus(dk_acc, dp, q_t_lane + buf_bytes)  # dK += dSᵀ Q
            start_m = next_m

        # Epilogue: dk = scale · dK, dv = dV, each element once (keys that no row sees: zeros).
        if not VARLEN:
            dkv_start = off_bhk * seqlen_k  # dk's and dv's row of key 0 of this (batch, key/value head)
        store_rows(dk, dk_acc, scale, dkv_start + start_n + 16 * warp, dkv_start + seqlen_k, head_dim, g, t)
        store_rows(dv, dv_acc, float32(1.0), dkv_start + start_n + 16 * warp, dkv_start + seqlen_k, head_dim, g, t)

    return jit_kernel(_attn_bwd_dkdv_tc, config.MAX_REGISTERS)


def _build_dq(
    HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, OUT_PAIRS, SINK
):
    """The dQ kernel for one padded head dim, block shape, ``Features`` (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN),
    input kind and whether it writes the attention sink's gradient shares (SINK), all compile-time."""
    NUM_WARPS, BLOCK_N = config.DQ_WARPS, config.DQ_BLOCK_N
    BLOCK_M = 16 * NUM_WARPS
    NUM_THREADS = 32 * NUM_WARPS
    LD = HEAD_DIM + 8
    D_STEPS = HEAD_DIM // 16
    O_TILES = HEAD_DIM // 8
    N_TILES = BLOCK_N // 8  # 8-key tiles of S
    QDO_IN_SHARED = config.QDO_IN_SHARED
    # Q and dO at rows 0 and BLOCK_M, two buffers of a K tile and its V tile from KV_ROW on (buffer b: K at
    # rows KV_ROW + 2 BLOCK_N b .., V BLOCK_N rows on), in dynamic shared memory (``tile_bytes``).
    KV_ROW = _dq_rows(config)[0]
    assert BLOCK_N % 16 == 0 and HEAD_DIM % 16 == 0
    wait_tiles, load_frag, products, store_rows = _helpers(
        HEAD_DIM, IS_BF16, ASYNC_LOADS, OUT_PAIRS, EVEN_HEAD_DIM, config.LDMATRIX
    )
    rows_dot, rows_dot_shared, acc_plus = products(N_TILES)
    load_qdo = _tile_loader(BLOCK_M, NUM_THREADS, HEAD_DIM, EVEN_HEAD_DIM, ASYNC_LOADS)
    load_kv = _tile_loader(BLOCK_N, NUM_THREADS, HEAD_DIM, EVEN_HEAD_DIM, ASYNC_LOADS)

    def _attn_bwd_dq_tc(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
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
        stride_dob,
        stride_doh,
        stride_dom,
        stride_dod,
        stride_lb,
        stride_lh,
        stride_lm,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        head_dim,
        scale,
        qk_scale,
        window_left,
        window_right,
        num_m_tiles,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        dsink,
        sink,
        cu_seqlens_q,
        cu_seqlens_k,
    ):
        """One block: BLOCK_M query rows of one (batch, head); arguments as ``_attn_bwd_dkdv_tc``'s, dq: (B, H,
        seqlen_q, head_dim), flat, contiguous, int32 pairs (OUT_PAIRS) or int16. SINK: sink (H,) fp32 is read
        and warp w writes its rows' share of the sink's gradient to dsink (H, B · num_m_tiles · NUM_WARPS),
        flat, at [h, (b · num_m_tiles + tile) · NUM_WARPS + w]; without SINK both are unread. VARLEN: as
        ``_attn_bwd_dkdv_tc``'s, b the sequence, num_m_tiles covering max_seqlen_q."""
        diag = seqlen_k - seqlen_q
        tile_m = cuda.blockIdx.x % num_m_tiles
        start_m = tile_m * BLOCK_M
        off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        off_hk = off_h // group
        if VARLEN:
            # Sequence off_b: queries q_start .. q_start + seqlen_q of the packed q, dO, L, delta (and dq),
            # keys k_start .. k_start + seqlen_k of k and v; its own lengths (and their diag) stand for
            # seqlen_q and seqlen_k from here on. A query tile past its end exits (the whole block, before any
            # barrier or warp-wide instruction); with SINK its warps' shares are zeros, so that every share
            # is written.
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            dq_start = off_h * seqlen_q + q_start  # dq's and delta's row of the sequence's query 0
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                if SINK and cuda.threadIdx.x % 32 == 0:
                    at = (off_h * (cuda.gridDim.x // heads) + off_b * num_m_tiles + tile_m) * NUM_WARPS
                    dsink[uint64(at + cuda.threadIdx.x // 32)] = float32(0.0)
                return
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4

        smem = cuda.shared.array(0, int16, alignment=SHARED_ALIGN)  # the tiles: the launch's dynamic size
        smem_base = shared_address(smem)
        q_base, k_base, v_base, do_base = global_address(q), global_address(k), global_address(v), global_address(do)
        a_row, a_col = ldmatrix_a_row_col(lane)
        b_row, b_col = ldmatrix_b_row_col(lane)
        own_lane = smem_base + uint32(2 * ((16 * warp + a_row) * LD + a_col))  # the warp's Q rows (A)
        do_lane = own_lane + uint32(2 * BLOCK_M * LD)  # the warp's dO rows
        # Buffer 0's K and V (buffer 1's: 2 BLOCK_N rows on).
        k_b_lane = smem_base + uint32(2 * ((KV_ROW + b_row) * LD + b_col))  # Kᵀ, Vᵀ as B (keys as columns)
        v_b_lane = k_b_lane + uint32(2 * BLOCK_N * LD)
        k_t_lane = smem_base + uint32(2 * ((KV_ROW + a_row) * LD + a_col))  # K as B with .trans (keys as k)

        # Q and dO: global -> shared (-> the warp's A fragments).
        if VARLEN:  # the sequence's first rows
            q_offset = off_h * stride_qh + q_start * stride_qm
            do_offset = off_h * stride_doh + q_start * stride_dom
        else:
            q_offset = off_b * stride_qb + off_h * stride_qh
            do_offset = off_b * stride_dob + off_h * stride_doh
        load_qdo(smem, smem_base, 0, q, q_base, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim)
        load_qdo(smem, smem_base, BLOCK_M, do, do_base, do_offset, stride_dom, stride_dod, start_m, seqlen_q, head_dim)
        wait_tiles()
        cuda.syncthreads()
        q_frag = cuda.local.array((D_STEPS, 4), int32)
        do_frag = cuda.local.array((D_STEPS, 4), int32)
        if not QDO_IN_SHARED:
            load_frag(q_frag, own_lane)
            load_frag(do_frag, do_lane)

        # L · log2 e and delta of the lane's rows row0 and row0 + 8; rows past seqlen_q: L = +inf, P = 0.
        row0 = start_m + 16 * warp + g
        lse_r = cuda.local.array(2, float32)
        delta_r = cuda.local.array(2, float32)
        if VARLEN:
            l_offset = off_h * stride_lh + q_start * stride_lm
        else:
            l_offset = off_b * stride_lb + off_h * stride_lh
            dq_start = off_bh * seqlen_q  # dq's and delta's row of query 0 of this (batch, head)
        for h in range(2):
            row = row0 + 8 * h
            lse_r[h] = float32(math.inf)
            delta_r[h] = 0.0
            if row < seqlen_q:
                lse_r[h] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                delta_r[h] = delta[uint64(dq_start + row)]

        acc = cuda.local.array((O_TILES, 4), float32)  # [16 rows, HEAD_DIM] as 8-column C tiles
        s = cuda.local.array((N_TILES, 4), float32)  # S, then P: [16 rows, BLOCK_N]
        dp = cuda.local.array((N_TILES, 4), float32)  # dP, then dS
        for c in range(O_TILES):
            for e in range(4):
                acc[c, e] = 0.0

        if VARLEN:
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        # The key tiles the tile's rows see, as the forward's; the others are skipped.
        begin_n = max(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N if LEFT else 0
        end_n = min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag + window_right) if RIGHT else seqlen_k
        # ALiBi's slope for this (batch, head), in base 2.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        # Step it computes on buffer it % 2 while step it + 1's K and V load into the other.
        steps = (end_n - begin_n + BLOCK_N - 1) // BLOCK_N if end_n > begin_n else 0
        if not QDO_IN_SHARED:
            cuda.syncthreads()  # every warp has its fragments: Q's and dO's rows (the first buffer's) are free
        if steps > 0:
            load_kv(smem, smem_base, KV_ROW, k, k_base, k_offset, stride_kn, stride_kd, begin_n, seqlen_k, head_dim)
            load_kv(
                smem,
                smem_base,
                KV_ROW + BLOCK_N,
                v,
                v_base,
                v_offset,
                stride_vn,
                stride_vd,
                begin_n,
                seqlen_k,
                head_dim,
            )
        for it in range(steps):
            buf = it % 2
            start_n = begin_n + it * BLOCK_N
            wait_tiles()
            cuda.syncthreads()  # step it's tiles have landed; every warp is done with the other buffer
            if it + 1 < steps:
                load_kv(
                    smem,
                    smem_base,
                    KV_ROW + 2 * BLOCK_N * (1 - buf),
                    k,
                    k_base,
                    k_offset,
                    stride_kn,
                    stride_kd,
                    start_n + BLOCK_N,
                    seqlen_k,
                    head_dim,
                )
                load_kv(
                    smem,
                    smem_base,
                    KV_ROW + 2 * BLOCK_N * (1 - buf) + BLOCK_N,
                    v,
                    v_base,
                    v_offset,
                    stride_vn,
                    stride_vd,
                    start_n + BLOCK_N,
                    seqlen_k,
                    head_dim,
                )
            buf_bytes = uint32(2 * 2 * BLOCK_N * LD * buf)

            if QDO_IN_SHARED:
                rows_dot_shared(s, own_lane, k_b_lane + buf_bytes)  # S = Q Kᵀ
                rows_dot_shared(dp, do_lane, v_b_lane + buf_bytes)  # dP = dO Vᵀ
            else:
                rows_dot(s, q_frag, k_b_lane + buf_bytes)
                rows_dot(dp, do_frag, v_b_lane + buf_bytes)
            # Masked: the tiles that cross the end of the keys or a window edge of the block's rows.
            crosses = (
                start_n + BLOCK_N > seqlen_k
                or (RIGHT and start_n + BLOCK_N - 1 > start_m + diag + window_right)
                or (LEFT and start_n < start_m + BLOCK_M - 1 + diag - window_left)
            )
            # Element (j, e) is key start_n + 2 t + 8 j + e % 2 against row row0 + 8 (e // 2): masked iff 8 j + e %
            # 2 >= key_end, or offset = 8 j + e % 2 - 8 (e // 2) > rel_right (right), or < rel_left (left), with
            # rel = row0 + diag - start_n - 2 t. So a compare with a constant each, from three values a step.
            key_end = seqlen_k - start_n - 2 * t
            rel = row0 + diag - start_n - 2 * t
            rel_right = rel + window_right
            rel_left = rel - window_left
            # ALiBi's distance |row + diag - key| of element (j, e) is |rel - (8 j + e % 2 - 8 (e // 2))|: one
            # conversion a step, then an add and an FMA a score.
            distance = float32(rel) if ALIBI else float32(0.0)
            for j in range(N_TILES):
                for e in range(4):
                    h = e // 2
                    if SOFTCAP or ALIBI:
                        # The forward's scores in base 2 (``forward_tc``'s): softcap c (qk_scale = scale / c),
                        # keeping tanh's derivative 1 - tanh² for dS, then ALiBi's bias.
                        if SOFTCAP:
                            tanh_s = tanh_approx(s[j, e] * qk_scale)
                            x = tanh_s * softcap_log2
                        else:
                            x = s[j, e] * qk_scale
                        if ALIBI:
                            x = cuda.fma(-slope, abs(distance + float32(8 * h - 8 * j - e % 2)), x)
                        p = exp2_approx(x - lse_r[h])
                    else:
                        p = exp2_approx(s[j, e] * qk_scale - lse_r[h])
                    if crosses:
                        offset = 8 * j + e % 2 - 8 * h
                        if 8 * j + e % 2 >= key_end or (RIGHT and offset > rel_right) or (LEFT and offset < rel_left):
                            p = float32(0.0)
                    s[j, e] = p
                    dp[j, e] = p * (dp[j, e] - delta_r[h])
                    if SOFTCAP:
                        dp[j, e] *= float32(1.0) - tanh_s * tanh_s
            acc_plus(acc, dp, k_t_lane + buf_bytes)  # dQ += dS K

        # Epilogue: dq = scale · dQ, each element once (rows that see no key: zeros).
        store_rows(dq, acc, scale, dq_start + start_m + 16 * warp, dq_start + seqlen_q, head_dim, g, t)
        # side-by-side: dsink-tc
        if SINK:
            # The sink's weight in a row is exp(sink[h] - L), here in base 2 (0 past seqlen_q, where L = +inf).
            # After the loop: before it, this would wait on L's and delta's loads ahead of the first K/V copies.
            # A quad's four lanes hold the same two rows: lane t = 0 adds them, shuffles add the warp's eight
            # quads in a fixed order, and one value per warp goes out, for a fixed-order sum over each head.
            share = float32(0.0)
            if t == 0:
                sink_2 = sink[off_h] * float32(LOG2E)
                for h in range(2):
                    share += exp2_approx(sink_2 - lse_r[h]) * delta_r[h]
            for b in range(5):
                share += shfl_xor(share, 1 << b)
            if lane == 0:
                at = (off_h * (cuda.gridDim.x // heads) + off_b * num_m_tiles + tile_m) * NUM_WARPS + warp
                dsink[uint64(at)] = -share
        # side-by-side: end

    return jit_kernel(_attn_bwd_dq_tc, config.MAX_REGISTERS)


# Compiled kernels by (name, *the builder's arguments): ("dkdv" or "dq", HEAD_DIM, config, LEFT, RIGHT, SOFTCAP,
# ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, OUT_PAIRS), the dQ kernel's with SINK last, config holding
# only the fields of that kernel (``_own_fields``): configurations that differ in the other kernel's tiles share it.
_KERNELS: dict[tuple, object] = {}
_BUILDERS = {"dkdv": _build_dkdv, "dq": _build_dq}
_FIELDS = {
    "dkdv": ("DKDV_WARPS", "DKDV_BLOCK_M", "MAX_REGISTERS", "V_IN_SHARED", "K_IN_SHARED", "LDMATRIX"),
    "dq": ("DQ_WARPS", "DQ_BLOCK_N", "MAX_REGISTERS", "QDO_IN_SHARED", "LDMATRIX"),
}


def _own_fields(name: str, config: TensorCoreBwdConfig) -> TensorCoreBwdConfig:
    """config with the fields kernel ``name`` does not read set to None."""
    return config._replace(**{f: None for f in config._fields if f not in _FIELDS[name]})


# Prepared launches (preprocess, dK/dV, dQ; ``launch.prepare``) and the dQ kernel's warps (the layout of the
# sink's shares) by class of call, keyed as backward_simt's plus whether the tensors' data is 16 B aligned
# (cp.async).
_PREPARED: dict[tuple, tuple] = {}


def _kernel(name, HEAD_DIM, config, *flags):
    key = (name, HEAD_DIM, _own_fields(name, config), *flags)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _BUILDERS[name](*key[1:])
    return kernel


def _spec_positions(spec: AttentionSpec, slopes_at: int, offsets_at: int) -> tuple[int, ...]:
    """Where the kernels take ``common.spec_tensors``' tensors, in its order: the slopes at ``slopes_at`` with
    ALiBi, a packed batch's cu_seqlens_q and cu_seqlens_k at ``offsets_at`` and the next."""
    slopes = () if spec.alibi_slopes is None else (slopes_at,)
    return (*slopes, offsets_at, offsets_at + 1) if spec.varlen else slopes


def _sink_tensors(parts: torch.Tensor | None, spec: AttentionSpec) -> tuple:
    """The dQ kernel's sink tensors in a prepared call: (parts, spec.sink) with a sink, else ()."""
    return () if parts is None else (parts, spec.sink)


def _check_config(HEAD_DIM: int, config: TensorCoreBwdConfig) -> None:
    if (
        config.DKDV_WARPS < 1
        or config.DQ_WARPS < 1
        or config.DKDV_BLOCK_M < 16
        or config.DKDV_BLOCK_M % 16
        or config.DKDV_BLOCK_M > 32 * config.DKDV_WARPS
        or config.DQ_BLOCK_N < 16
        or config.DQ_BLOCK_N % 16
    ):
        raise ValueError(
            f"TensorCoreBwdConfig needs warps >= 1, tiles multiples of 16 and DKDV_BLOCK_M <= 32 · "
            f"DKDV_WARPS, got {config}"
        )
    for name in ("dkdv", "dq"):
        if shared_bytes(name, HEAD_DIM, config) > MAX_SHARED_BYTES:
            raise ValueError(
                f"{config} at head dim {HEAD_DIM} needs {shared_bytes(name, HEAD_DIM, config)} B of shared memory "
                f"in the {name} kernel, over the {MAX_SHARED_BYTES} B a block may have"
            )


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    config: TensorCoreBwdConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """The tensor-core launches (the SIMT preprocess, dK/dV, dQ): arguments and returns as
    ``fa2_numba_cuda.backward.flash_attn_backward``, for fp16 and bf16 with head_dim <= 128 and any spec
    (``supports``: dense or packed, any window, softcap, ALiBi, sink); CUDA tensors on compute capability
    8.0+, or CPU tensors under numba's simulator. config: the blocks, for tuning; default
    ``tc_bwd_config(padded_head_dim(head_dim))``."""
    key = None
    if launch.FAST:  # a call of a class met before: the kernels' parameters are packed, only pointers change
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | dO.data_ptr()) % 16 == 0
        key = (
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            v.shape,
            v.stride(),
            O.shape,
            O.stride(),
            L.shape,
            L.stride(),
            dO.shape,
            dO.stride(),
            q.dtype,
            k.dtype,
            v.dtype,
            O.dtype,
            L.dtype,
            dO.dtype,
            q.device,
            aligned,
            spec_class(spec),
            None if config is None else tuple(config),
        )
        plan = _PREPARED.get(key)
        if plan is not None:
            preprocess, dkdv, dq_kernel, dq_warps = plan
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            dO = dO.to(q.dtype)
            delta = torch.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
            if preprocess is not None:
                preprocess(*preprocess_tensors(O, dO, L, delta, None, spec))
            extra = spec_tensors(spec)
            if dkdv is not None:
                dkdv(q, k, v, dO, L, delta, dk, dv, *extra)
            # Made after the first launches: the host's time for it passes while the GPU works.
            parts = dsink_parts(spec, O, 16 * dq_warps, dq_warps, per_sequence=True)
            if dq_kernel is not None:
                dq_kernel(q, k, v, dO, L, delta, dq, *extra, *_sink_tensors(parts, spec))
            return dq, dk, dv, *sink_gradient(spec, parts)
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"fa2-numba-cuda's tensor-core backward takes fp16 or bf16, got {q.dtype}")
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-numba-cuda's tensor-core backward supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    check_device(q)
    if not simulated() and capability(q.device) < MIN_COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"fa2-numba-cuda's tensor-core backward needs compute capability 8.0 or newer, got "
            f"{capability(q.device)} on {q.device}"
        )
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if head_dim == 0 or batch * heads == 0:
        return dq, dk, dv, *sink_gradient(spec, None)
    dO = dO.to(q.dtype)
    delta = torch.empty(batch * heads * seqlen_q, dtype=torch.float32, device=q.device)

    HEAD_DIM = padded_head_dim(head_dim)
    config = TensorCoreBwdConfig(*config) if config is not None else tc_bwd_config(HEAD_DIM, max_shared_bytes(q.device))
    _check_config(HEAD_DIM, config)
    parts = dsink_parts(spec, O, 16 * config.DQ_WARPS, config.DQ_WARPS, per_sequence=True)
    plan = [None, None, None]
    prepared = True
    if seqlen_q:
        # delta = rowsum(dO ∘ O): the SIMT preprocess (fp32 sums, its own head-dim padding), without the sink's
        # shares, which the dQ kernel takes. delta is per row: the preprocess runs on a packed batch as on one
        # sequence of total_q rows.
        plan[0] = launch_preprocess(O, dO, L, delta, None, dataclasses.replace(spec, sink=None))
        prepared = prepared and plan[0] is not None
    flags, out_dtype, head, offsets = _launch_args(q, k, v, dO, L, delta, spec, config)
    # The main kernels' grids: per (sequence, head), the tiles of the longest sequence; the others' extra
    # tiles exit.
    grid_batch, grid_seqlen_q, grid_seqlen_k = grid_extent(spec, q, k)
    num_n_tiles = -(-grid_seqlen_k // (16 * config.DKDV_WARPS))
    if seqlen_k and num_n_tiles * grid_batch:
        inputs, tail, score_args = head
        head = (*inputs, dk.view(out_dtype), dv.view(out_dtype), *tail, num_n_tiles, *score_args)
        # The offsets come last (the kernels without VARLEN keep every other parameter where it was).
        args = (*head, *offsets)
        plan[1] = launch.prepare(
            _kernel("dkdv", HEAD_DIM, config, *flags),
            num_n_tiles * grid_batch * heads_k,
            32 * config.DKDV_WARPS,
            q.device,
            args,
            (*range(8), *_spec_positions(spec, len(head) - 3, len(head))),
            tile_bytes("dkdv", HEAD_DIM, config),
        )
        prepared = prepared and plan[1] is not None
    if seqlen_q and grid_seqlen_q * grid_batch:
        plan[2] = launch_dq(q, k, v, dO, L, delta, dq, parts, spec, config)
        prepared = prepared and plan[2] is not None
    if prepared and key is not None:
        _PREPARED[key] = (*plan, config.DQ_WARPS)
    return dq, dk, dv, *sink_gradient(spec, parts)


def _launch_args(q, k, v, dO, L, delta, spec: AttentionSpec, config: TensorCoreBwdConfig) -> tuple:
    """What both kernels' launches share: (flags, the outputs' element type, (inputs, tail, score_args),
    offsets): the kernels' compile-time flags after the head dim and config (``Features``, bf16, head_dim ==
    padded, cp.async, pairs), their arguments before the outputs, the sizes after them, the softcap's and
    slopes' after the tile count, and a packed batch's offsets, last."""
    head_dim = q.shape[3]
    HEAD_DIM = padded_head_dim(head_dim)
    is_bf16 = q.dtype == torch.bfloat16
    async_loads = config.CP_ASYNC and all(rows_16b_aligned(t) for t in (q, k, v, dO))
    out_pairs = head_dim % 2 == 0
    flags = (*features(spec), is_bf16, head_dim == HEAD_DIM, async_loads, out_pairs)
    out_dtype = torch.int32 if out_pairs else torch.int16
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    # The window's sizes among the other sizes; the softcap and the slopes after the tile count (the kernels
    # without SOFTCAP and ALIBI read none of them).
    window_left, window_right, *score_args = feature_args(spec, seqlen_q, seqlen_k, q.device)
    inputs = (*(t.view(torch.int16) for t in (q, k, v, dO)), L, delta)
    tail = (
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dO.stride(),
        *L.stride(),
        q.shape[1],
        q.shape[1] // k.shape[1],  # query heads per key/value head (the interface checked the division)
        seqlen_q,
        seqlen_k,
        head_dim,
        np.float32(spec.scale),
        np.float32(score_scale(spec)),
        window_left,
        window_right,
    )
    return flags, out_dtype, (inputs, tail, score_args), offset_args(spec, q.device)


def launch_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dO: torch.Tensor,
    L: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    parts: torch.Tensor | None,
    spec: AttentionSpec,
    config: TensorCoreBwdConfig,
) -> launch.Prepared | None:
    """The dQ kernel (``_attn_bwd_dq_tc``) alone: dq from q, k, v, dO (q's dtype, as ``flash_attn_backward``
    takes them), L, delta (``backward_simt.launch_preprocess``'s, (batch · heads · seqlen_q,) fp32), and with
    spec.sink each warp's share of dsink into parts (``backward_simt.dsink_parts`` with 16 · DQ_WARPS rows and
    DQ_WARPS shares a tile, per_sequence), else parts None. dq: q's shape and dtype, contiguous; at least one
    query row (``common.grid_extent``'s batch and seqlen_q); config complete (``tc_bwd_config``'s, or one
    ``flash_attn_backward`` takes). Returns the prepared launch (``launch.prepare``), called with q, k, v, dO,
    L, delta, dq, ``common.spec_tensors(spec)``, then parts and spec.sink with a sink; or None where numba
    launches every call."""
    HEAD_DIM = padded_head_dim(q.shape[3])
    flags, out_dtype, (inputs, tail, score_args), offsets = _launch_args(q, k, v, dO, L, delta, spec, config)
    grid_batch, grid_seqlen_q, _ = grid_extent(spec, q, k)
    num_m_tiles = -(-grid_seqlen_q // (16 * config.DQ_WARPS))
    head = (*inputs, dq.view(out_dtype), *tail, num_m_tiles, *score_args)
    args = (*head, dsink_arg(parts, q.device), sink_arg(spec, q.device), *offsets)
    return launch.prepare(
        _kernel("dq", HEAD_DIM, config, *flags, parts is not None),
        num_m_tiles * grid_batch * q.shape[1],
        32 * config.DQ_WARPS,
        q.device,
        args,
        (
            *range(7),
            *_spec_positions(spec, len(head) - 3, len(head) + 2),
            *(() if parts is None else (len(head), len(head) + 1)),
        ),
        tile_bytes("dq", HEAD_DIM, config),
    )


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static and dynamic shared memory per block, of every
    tensor-core backward kernel compiled so far in this process (one row per specialisation); empty under
    the simulator."""
    if simulated():
        return []
    rows = []
    for (
        name,
        HEAD_DIM,
        config,
        LEFT,
        RIGHT,
        SOFTCAP,
        ALIBI,
        VARLEN,
        IS_BF16,
        EVEN_HEAD_DIM,
        ASYNC_LOADS,
        OUT_PAIRS,
        *sink,
    ), kernel in _KERNELS.items():
        regs = kernel.get_regs_per_thread()
        shared = kernel.get_shared_mem_per_block()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": f"tensor-core {name}",
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    **feature_columns((LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN)),
                    "bf16": IS_BF16,
                    "even_head_dim": EVEN_HEAD_DIM,
                    "async_loads": ASYNC_LOADS,
                    "out_pairs": OUT_PAIRS,
                    "sink": bool(sink and sink[0]),
                    "signature": ", ".join(str(t) for t in signature),
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": shared[signature],
                    "dynamic_shared_bytes_per_block": tile_bytes(name, HEAD_DIM, config),
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
