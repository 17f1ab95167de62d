"""FlashAttention-2 decoding from a KV cache as numba-cuda kernels: split-KV on CUDA cores or tensor cores, then
an LSE combine.

Flash-decoding (Dao, Haziza, Massa, Sizov, 2023) in the terms of ``fa2_numba_cuda.forward_simt``: the keys of
one (batch, key/value head) are split into ranges of the cache's capacity, one block per (query tile, split,
batch, key/value head) runs the online softmax (running max ``m_i``, running sum ``l_i``, unnormalised
``acc``, rescaled by ``alpha`` per key tile; scores in base 2) over its range and writes a partial O (fp32)
and L, and ``_combine`` merges the splits by their logsumexp (``fa2.combine``'s formula: L = log Σ_s exp(L_s),
O = Σ_s exp(L_s - L) O_s; a split a row sees no key of has L_s = +inf and weighs nothing). With one split
the first kernel writes O and L itself and there is no second launch.

Decoding is bound by the bandwidth of reading the cache, not by arithmetic, so the kernel is built around
its loads:

- The query rows of a block are the group · seqlen_q rows (query head of the group, query token) of one
  key/value head: row r is head ``off_hk · group + r // seqlen_q``, token ``r % seqlen_q``. One pass over the
  head's K and V serves them all, so each cached key is read once per key/value head and call (BLOCK_M
  rows a block, ``decode_config``; beyond BLOCK_M rows, tiles of rows are more blocks of the grid, each
  reading the range again, mostly from L2).
- K and V tiles of BLOCK_N keys are copied into shared memory by ``cp.async`` (16 B a copy, straight from
  global to shared, zero-filled past the keys and head_dim) where the cache is contiguous along head_dim
  with 16 B aligned rows, else by plain loads (any strides). Two stages: the copies of tile t + 1 are in
  flight while tile t is computed. The tiles hold the cache's own bits (fp32, or fp16 / bf16 pairs in 32-bit
  words, widened to fp32 as they are read); Q is in shared memory once, fp32, pre-scaled by ``qk_scale``.
- S = Q Kᵀ: warp w owns rows w, w + NUM_WARPS, ...; its lanes own the tile's keys, 32 / BLOCK_N lanes a key
  splitting head_dim (DS), reduced by ``shfl_xor``; the row max and (once, at the end) the row sum are
  ``shfl_xor`` reductions over the key lanes. P goes through shared memory (``p_tile``) with each row's
  ``alpha``.
- acc += P V: thread t owns 16 B of O's columns (chunk ``t % CH``) for TMO rows and every GN-th key of the
  tile; with fewer rows than thread groups (decoding one token of MHA: one row), the GN key subsets' partial
  accumulators are added through shared memory once, after the last tile.
- All arithmetic is fp32, whatever the cache's dtype.

The tensor-core split kernel (``_build_tc_kernel``, fp16 and bf16, head_dim <= 128: ``uses_tensor_cores``)
computes the same thing with both products on ``mma.sync`` m16n8k16 (``mma.py``; fragment layouts as in
``forward_tc``): the block's 16 query rows (the group · seqlen_q rows in tiles of 16, padding rows masked) are
the M side, in every warp; each warp owns its own 16 keys of each BLOCK_N = 16 · NUM_WARPS-key tile
(``TensorCoreDecodeConfig``, ``tc_decode_config``), with its own m_i, l_i and acc. The tiles are the SIMT
kernel's (the same ``_kv_loader``, cp.async or plain loads, contiguous or paged, 16-bit pairs a word, 16 B of
padding a row); Q is copied once into stage 1's rows and taken as A fragments by ``ldmatrix``; S = Q Kᵀ is one
``ldmatrix.x4`` and two mma per 16 head dims; scores, masks, softcap and ALiBi as above, in fp32 on the
accumulators (lane 4 g + t: rows g and g + 8, keys 2 t, 2 t + 1 of each 8), the row max over each quad
(``shfl_xor``), ``exp2_approx``; P V with P's A fragment straight from S's accumulators (rounded to 16 bits)
and V's B fragments by ``ldmatrix.x4.trans``. After the last tile the warps' states are merged as the combine
merges splits (warps 1 .. hand their rescaled acc to warp 0 through the tiles' rows), and warp 0 writes O and
L in the SIMT kernel's layouts (partial fp32 O and base-2 L per split for ``_combine``, or O and natural L).
fp32 inputs and head_dim above 128 run the SIMT kernel; the choice is by dtype, head_dim and the device's
compute capability only (8.0+; under the simulator fp16 and bf16 always take the tensor-core kernel), never a
fallback after an error.

Per query row i (token i of its head, Nq_b = seqlen_q or the sequence's own count) and key j of row b's
cache, with K_b = cache_seqlens[b] (clamped to the capacity) and diag = K_b - Nq_b, in this order:
softcap c (Q pre-scaled by scale / c, score tanh(s) · c · log2 e, ``common._tanh``); ALiBi (minus
slope[b, h] · log2 e · |i + diag - j|); the mask: key j is visible iff leftpad_b <= j < K_b and
i + diag - left <= j <= i + diag + right (window (left, right), -1 unbounded; causal is (-1, 0)). With
Nq_b = 2, K_b = 5, leftpad_b = 1 and causal::

    0 1 1 1 0
    0 1 1 1 1

A row that sees no key gets O = 0 and L = +inf. A block visits only the tiles of its split's range that
hold a key some row sees: [max(leftpad_b, split start, diag - left), min(K_b, split end, Nq_b + diag +
right)).

Caches: contiguous (batch_cache, heads_k, seqlen_cache, head_dim), row b reading cache row
cache_batch_idx[b] (or b); or paged (num_pages, heads_k, page_size, head_dim), key j of row b at row
j % page_size of page block_table[b, j // page_size]; any page size, any strides. Indices that nobody
checked (the interface checks them outside a CUDA-graph capture) are clamped: cache_seqlens into [0,
capacity], cache_leftpad into [0, K_b], cache_batch_idx and page ids into the cache, cu_seqlens_q as in
``common.sequence``: wrong indices give wrong rows, never an access outside a tensor.

Splits (``num_splits``; 0 picks, ``num_splits_heuristic``): ranges of ``split_keys`` keys (a multiple of
BLOCK_N) of the capacity, never of cache_seqlens (which stays on the device). A split past K_b finds an
empty range and writes only L = +inf.

Inputs: fp32, fp16 or bf16 (bf16 as int16 bit patterns, numba having no bf16); head_dim up to 256 (tensor
cores: 128), padded to a power of two (at least 32) inside the block. Launch: on torch's current stream, no
host synchronisation, allocation by torch only (capturable in a CUDA graph); kernels compiled once per
(padded head dim, ``DecodeConfig`` or ``TensorCoreDecodeConfig``, ``common.Features``, cache kind, split or
not, input kind, head_dim == padded, cp.async or plain loads) and cached; launched through ``launch.prepare``
(numba's own launch cost 0.8-1.6 ms of host time a call of both kernels on the H200's host): a class of calls
(``_class_key``: shapes, strides, dtypes, device, the caches' alignment, the spec's values and its index
tensors' layouts, the config, the kernel asked for) is launched by numba once, then its packed parameters are
kept and each later call writes its tensors' data pointers and calls cuLaunchKernel (``_PREPARED``: the split
kernel's launch and the combine's). Under
numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same kernels run on CPU tensors, ``cp.async`` and
``shfl_xor`` emulated by ``mma.py``: use tiny shapes there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, float32, int32, uint32, uint64

from fa2.spec import AttentionSpec
from fa2_numba_cuda import launch
from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    MAX_HEAD_DIM,
    SHARED_ALIGN,
    _bf16_to_float,
    _check_device,
    _float_as_int,
    _float_to_bf16,
    _identity,
    _int_as_float,
    _tanh,
    _to_float,
    feature_args,
    features,
    rows_16b_aligned,
    sequence,
    simulated,
    spec_class,
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
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    shfl_xor,
)
from fa2_numba_cuda.tensor_cores import MAX_HEAD_DIM as TC_MAX_HEAD_DIM
from fa2_numba_cuda.tensor_cores import MIN_COMPUTE_CAPABILITY, capability

NUM_THREADS = 128  # 4 warps a block
NUM_WARPS = NUM_THREADS // 32
STAGE_BYTES = 16384  # K and V tiles of one stage, before padding: 2 · BLOCK_N · HEAD_DIM · element size
MAX_SPLITS = 128
MIN_SPLIT_TILES = 4  # the heuristic's splits hold at least this many key tiles
COMBINE_ROWS = NUM_WARPS  # rows a combine block merges, one a warp

if simulated():
    # As in common.py: numba's scalar types are slow to call in the simulator; numpy's round alike.
    from fa2_numba_cuda.common import float32, uint64  # noqa: F811 (numpy's float32; uint64 the identity)

    int32, uint32 = np.int32, np.uint32

    def _f16x2_to_float(word):
        """The two fp16 of a 32-bit word (low half first) as fp32."""
        bits = np.array([word], dtype=np.int32).view(np.float16)
        return np.float32(bits[0]), np.float32(bits[1])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _f16x2_to_float(typingctx, word):
        """The two fp16 of a 32-bit word (low half first) as fp32: mov.b32 into halves, two cvt.f32.f16."""

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.int32)
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(32)])
            text = "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi;}"
            result = builder.call(ir.InlineAsm(fnty, text, "=f,=f,r"), [word])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(result, 0), builder.extract_value(result, 1)])

        return types.UniTuple(types.float32, 2)(word), codegen


class DecodeConfig(NamedTuple):
    """One decode block's shape (NUM_THREADS threads): BLOCK_M query rows (a power of two), BLOCK_N keys a
    tile (8, 16 or 32, so that a row's keys are lanes of one warp); MAX_REGISTERS caps ptxas (it bounds the
    blocks an SM holds, which ``num_splits_heuristic`` counts on)."""

    BLOCK_M: int
    BLOCK_N: int
    MAX_REGISTERS: int


def padded_head_dim(head_dim: int) -> int:
    """The head dim the block computes with: a power of two, at least 32 (16 B chunks of a row then divide the
    block's threads evenly), the extra columns zero-filled."""
    return max(32, 1 << (head_dim - 1).bit_length())


def decode_config(HEAD_DIM: int, element_size: int, rows: int) -> DecodeConfig:
    """The block for a padded head dim, the cache's element size (2 or 4 bytes) and the query rows of a
    (batch, key/value head), group · seqlen_q: BLOCK_N keys so that a stage's K and V tiles are 16 KB;
    BLOCK_M the rows rounded up to a power of two, at most 2048 / HEAD_DIM (Q's fp32 tile <= 8 KB), so that
    everything fits the 48 KB of static shared memory:

        HEAD_DIM   fp16 / bf16          fp32                 shared memory (2 stages, Q, P)
        32, 64     BLOCK_N 32, M <= 32  BLOCK_N 32, M <= 32  19-32 KB
        128        BLOCK_N 32, M <= 16  BLOCK_N 16, M <= 16  35-45 KB
        256        BLOCK_N 16, M <= 8   BLOCK_N 8, M <= 8    35-44 KB
    """
    block_n = 32
    while 2 * block_n * HEAD_DIM * element_size > STAGE_BYTES:
        block_n //= 2
    block_m = min(1 << max(rows - 1, 0).bit_length(), 2048 // HEAD_DIM, 32)
    return DecodeConfig(block_m, block_n, 128)


def shared_bytes(HEAD_DIM: int, element_size: int, config: DecodeConfig) -> int:
    """Static shared memory of a decode block (the kernel's arrays, as ``_build_kernel`` sizes them)."""
    BLOCK_M, BLOCK_N, _ = config
    vec = 16 // element_size
    ds = 32 // BLOCK_N
    ldw = HEAD_DIM * element_size // 4 + 4 * ds
    g = NUM_THREADS // (HEAD_DIM // vec)
    red = NUM_THREADS * vec if BLOCK_M < g else 1
    return 4 * (4 * BLOCK_N * ldw + BLOCK_M * (HEAD_DIM + 4) + BLOCK_M * BLOCK_N + 3 * BLOCK_M + red)


def num_splits_heuristic(blocks: int, slots: int, n_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """How many key ranges to split each (query tile, batch, key/value head) into, flash-attn's rule
    (``num_splits_heuristic`` of flash_api.cpp): ``blocks`` unsplit blocks, ``slots`` blocks the GPU holds
    at once (SMs x blocks an SM holds), ``n_tiles`` groups of MIN_SPLIT_TILES key tiles in the capacity. No
    split where the blocks nearly fill the GPU (>= 80% of the slots); else the fewest splits whose waves are
    at least 85% as full as the best count's, among counts that change the keys a split holds."""
    if blocks >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, n_tiles))

    def eligible(s):
        return s == 1 or -(-n_tiles // s) != -(-n_tiles // (s - 1))

    efficiency = []
    for s in range(1, max_splits + 1):
        waves = blocks * s / slots
        efficiency.append(waves / math.ceil(waves) if eligible(s) else 0.0)
    best = max(efficiency)
    for s in range(1, max_splits + 1):
        if eligible(s) and efficiency[s - 1] >= 0.85 * best:
            return s
    return 1


_SLOTS: dict[tuple, int] = {}
_SPLITS: dict[tuple, int] = {}  # num_splits_heuristic's answers by its arguments


def block_slots(device: torch.device, threads: int, max_registers: int, shared: int) -> int:
    """Decode blocks the device holds at once, for blocks of ``threads`` threads, registers capped at
    ``max_registers`` and ``shared`` bytes of static shared memory: SMs x min(by threads, by registers, by
    shared memory). From torch's device properties (no sync); under the simulator, 2 SMs of 4 blocks."""
    key = (device, threads, max_registers, shared)
    slots = _SLOTS.get(key)
    if slots is None:
        if simulated():
            slots = 8
        else:
            props = torch.cuda.get_device_properties(device)
            sm_threads = getattr(props, "max_threads_per_multi_processor", 2048)
            registers = getattr(props, "regs_per_multiprocessor", 65536)
            sm_shared = getattr(props, "shared_memory_per_multiprocessor", 100 * 1024)
            per_sm = min(sm_threads // threads, registers // (threads * max_registers), sm_shared // (shared + 1024),
                         32)
            slots = props.multi_processor_count * max(per_sm, 1)
        _SLOTS[key] = slots
    return slots


def _kv_loader(BLOCK_N, ROW_STEP, LDW, KIND, PAGED, EVEN_HEAD_DIM, ASYNC_LOADS):
    """``load_kv``, the copy of one stage's K and V tiles (BLOCK_N keys each) into a shared array of 32-bit
    words, LDW a row, for both split kernels: a thread copies one 16 B chunk of tile rows ld_r, ld_r +
    ROW_STEP, ... (BLOCK_N / ROW_STEP rows of K and as many of V); KIND "f32", "f16" or "bf16" (16-bit elements
    two a word, the lower index in the low half: ``ldmatrix``'s layout)."""
    ES = 4 if KIND == "f32" else 2  # bytes an element
    VEC = 16 // ES  # elements in a 16 B chunk (4 words)
    LOADS = BLOCK_N // ROW_STEP

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
                tile[uint64(tile_row), uint64(4 * chunk + w)] = value
        else:
            for w in range(4):
                lo = int32(0)
                hi = int32(0)
                if visible and (EVEN_HEAD_DIM or col + 2 * w < head_dim):
                    lo = int32(x[uint64(offset + (col + 2 * w) * stride_d)]) & int32(0xFFFF)
                if visible and (EVEN_HEAD_DIM or col + 2 * w + 1 < head_dim):
                    hi = int32(x[uint64(offset + (col + 2 * w + 1) * stride_d)]) << int32(16)
                tile[uint64(tile_row), uint64(4 * chunk + w)] = lo | hi

    @device_function
    def load_kv(kv_tile, stage_row, start_n, hi, k, v, k_base, v_base, k_head, v_head, block_table, off_b, ld_r,
                ld_c, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tb, stride_tp,
                capacity, cache_rows, page_size, head_dim):
        """Keys start_n .. start_n + BLOCK_N of K and V into the stage at shared row stage_row (K, then V
        BLOCK_N rows on), zeros from key hi on: chunk ld_c of tile rows ld_r, ld_r + ROW_STEP, ... A paged
        cache's page ids are read from the block table and clamped into the cache (a key past hi reads the
        table at the last key of the capacity, and nothing of the cache). One division a tile: the thread's
        next rows step (page, row in page) on by ROW_STEP keys."""
        if PAGED:
            page_idx = (start_n + ld_r) // page_size
            in_page = (start_n + ld_r) - page_idx * page_size
        for it in range(LOADS):
            r = ld_r + ROW_STEP * it
            key = start_n + r
            visible = key < hi
            # side-by-side: pages
            if PAGED:
                if it > 0:
                    in_page += ROW_STEP
                    while in_page >= page_size:
                        in_page -= page_size
                        page_idx += 1
                last = capacity - 1  # keys past the capacity (only invisible ones) read the last page id
                if key > last:
                    page_idx, in_page = last // page_size, last % page_size
                page = int(block_table[uint64(off_b * stride_tb + page_idx * stride_tp)])
                page = min(max(page, 0), cache_rows - 1)
                k_off = k_head + page * stride_kb + in_page * stride_kn
                v_off = v_head + page * stride_vb + in_page * stride_vn
            else:
                k_off = k_head + key * stride_kn
                v_off = v_head + key * stride_vn
            # side-by-side: end
            load_row(kv_tile, stage_row + r, k, k_base, k_off, stride_kd, ld_c, head_dim, visible)
            load_row(kv_tile, stage_row + BLOCK_N + r, v, v_base, v_off, stride_vd, ld_c, head_dim, visible)
        if ASYNC_LOADS:
            cp_async_commit()

    return load_kv


def _build_kernel(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX, LEFTPAD, SPLIT, KIND,
                  EVEN_HEAD_DIM, ASYNC_LOADS):
    """The split-KV kernel for one padded head dim, ``DecodeConfig``, ``Features`` (LEFT, RIGHT, SOFTCAP,
    ALIBI, VARLEN: cu_seqlens_q), cache kind (PAGED, BATCH_IDX, LEFTPAD), SPLIT (partial fp32 O and base-2 L
    per split, for ``_combine``; else O in q's dtype and natural L), input kind KIND ("f32", "f16", "bf16"),
    head_dim == HEAD_DIM and cp.async loads (ASYNC_LOADS), all compile-time constants."""
    BLOCK_M, BLOCK_N, MAX_REGISTERS = config
    ES = 4 if KIND == "f32" else 2  # bytes an element
    VEC = 16 // ES  # elements in a 16 B chunk (4 words)
    CH = HEAD_DIM // VEC  # chunks a row
    DS = 32 // BLOCK_N  # lanes sharing one key's dot product in S = Q K^T
    LOG_DS = DS.bit_length() - 1
    LDW = HEAD_DIM * ES // 4 + 4 * DS  # words a shared K/V row; the padding keeps a quarter warp's 16 B loads apart
    LD_Q = HEAD_DIM + 4
    TMS = max(1, BLOCK_M // NUM_WARPS)  # rows of S a warp owns
    G = NUM_THREADS // CH  # thread groups of P V, each covering every chunk of a row
    GM = min(G, BLOCK_M)  # ... split over rows
    GN = G // GM  # ... and over the tile's keys
    TMO = BLOCK_M // GM  # rows of O a thread owns
    KEYS_PV = BLOCK_N // GN
    ROW_STEP = NUM_THREADS // CH  # tile rows one pass of the loader covers
    KV_ROWS = 4 * BLOCK_N  # 2 stages of K then V
    RED = NUM_THREADS * VEC if GN > 1 else 1
    WORD = float32 if KIND == "f32" else int32
    assert CH * G == NUM_THREADS and BLOCK_N % GN == 0 and BLOCK_N % ROW_STEP == 0 and BLOCK_M % GM == 0
    assert BLOCK_M >= NUM_WARPS or TMS == 1

    if KIND == "bf16":
        to_float, from_float = _bf16_to_float, _float_to_bf16
    else:
        to_float, from_float = _to_float, _identity

    @device_function
    def load_chunk(tile, row, chunk, out):
        """out[0 .. VEC) = the 16 B chunk ``chunk`` of shared row ``row``, as fp32 (4 words, one 16 B load)."""
        for w in range(4):
            x = tile[uint64(row), uint64(4 * chunk + w)]
            if KIND == "f32":
                out[w] = x
            elif KIND == "bf16":
                out[2 * w] = _int_as_float(x << int32(16))
                out[2 * w + 1] = _int_as_float(x & int32(-65536))
            else:
                lo, hi = _f16x2_to_float(x)
                out[2 * w] = lo
                out[2 * w + 1] = hi

    load_kv = _kv_loader(BLOCK_N, ROW_STEP, LDW, KIND, PAGED, EVEN_HEAD_DIM, ASYNC_LOADS)

    def _kvcache_fwd(
        q, k, v, o, lse, block_table, cache_seqlens, cache_leftpad, cache_batch_idx, cu_seqlens_q,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_tb, stride_tp,
        heads, heads_k, group, seqlen_q, total_q, capacity, cache_rows, page_size, head_dim, qk_scale,
        num_m_tiles, num_splits, split_keys, rows_total,
        window_left, window_right, softcap_log2, slopes, stride_ab, stride_ah,
    ):
        """One block: BLOCK_M of the group · seqlen_q query rows of one (split, batch, key/value head). q: a
        flat view of (batch, heads, seqlen_q, head_dim) (VARLEN: (1, heads, total_q, head_dim)), k and v of
        the cache ((batch_cache or num_pages, heads_k, seqlen_cache or page_size, head_dim)), with their
        element strides; o, lse: O and L flat and contiguous (SPLIT: (num_splits, rows_total, head_dim) fp32
        and (num_splits, rows_total) fp32 base 2). capacity: the keys a row's cache holds; cache_rows: its
        first dimension (clamps cache_batch_idx and page ids)."""
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bid = cuda.blockIdx.x
        start_m = (bid % num_m_tiles) * BLOCK_M
        bid //= num_m_tiles
        split = bid % num_splits
        bid //= num_splits
        off_hk = bid % heads_k
        off_b = bid // heads_k
        rows = group * seqlen_q  # the query rows of this (batch, key/value head)

        # side-by-side: varlen
        if VARLEN:
            q_start, seqlen_q_b = sequence(cu_seqlens_q, off_b, total_q)
        else:
            q_start, seqlen_q_b = 0, seqlen_q
        # side-by-side: end

        # side-by-side: cache
        # Row b's keys: [leftpad_b, K_b) of its cache, clamped (see the module docstring); the window aligned
        # on K_b. This split's share: [split · split_keys, (split + 1) · split_keys).
        seqlen_k = min(max(int(cache_seqlens[off_b]), 0), capacity)
        leftpad = min(max(int(cache_leftpad[off_b]), 0), seqlen_k) if LEFTPAD else 0
        if PAGED:
            cache_b = 0
        elif BATCH_IDX:
            cache_b = min(max(int(cache_batch_idx[off_b]), 0), cache_rows - 1)
        else:
            cache_b = min(off_b, cache_rows - 1)
        diag = seqlen_k - seqlen_q_b
        lo = max(leftpad, split * split_keys)
        hi = min(seqlen_k, (split + 1) * split_keys)
        if LEFT:
            lo = max(lo, diag - window_left)
        if RIGHT:
            hi = min(hi, seqlen_q_b + diag + window_right)
        n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N if hi > lo else 0
        # side-by-side: end

        q_tile = cuda.shared.array((BLOCK_M, LD_Q), float32, alignment=SHARED_ALIGN)  # [BLOCK_M, HEAD_DIM]
        kv_tile = cuda.shared.array((KV_ROWS, LDW), WORD, alignment=SHARED_ALIGN)  # [2, K V, BLOCK_N, HEAD_DIM]
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), float32, alignment=SHARED_ALIGN)  # [BLOCK_M, BLOCK_N]
        alpha_tile = cuda.shared.array(BLOCK_M, float32)
        m_tile = cuda.shared.array(BLOCK_M, float32)
        l_tile = cuda.shared.array(BLOCK_M, float32)
        red = cuda.shared.array(RED, float32, alignment=SHARED_ALIGN)  # the GN key subsets' accumulators

        # Q, pre-scaled by qk_scale = scale · log2 e (softcap c: scale / c), fp32; rows past the group's or
        # the sequence's are zeros.
        for it in range(-(-BLOCK_M * HEAD_DIM // NUM_THREADS)):
            idx = tid + NUM_THREADS * it
            r = idx // HEAD_DIM
            c = idx % HEAD_DIM
            row = start_m + r
            tok = row % seqlen_q
            value = float32(0.0)
            if r < BLOCK_M and row < rows and tok < seqlen_q_b and (EVEN_HEAD_DIM or c < head_dim):
                off_h = off_hk * group + row // seqlen_q
                if VARLEN:
                    offset = off_h * stride_qh + (q_start + tok) * stride_qm
                else:
                    offset = off_b * stride_qb + off_h * stride_qh + tok * stride_qm
                value = qk_scale * to_float(q[uint64(offset + c * stride_qd)])
            if r < BLOCK_M:
                q_tile[uint64(r), uint64(c)] = value

        # side-by-side: state
        # S's rows of this warp (warp + NUM_WARPS · i): running max and the lanes' partial sums; their tokens,
        # whether they exist, their ALiBi slopes in base 2.
        m_i = cuda.local.array(TMS, float32)
        l_i = cuda.local.array(TMS, float32)
        s = cuda.local.array(TMS, float32)
        tok_i = cuda.local.array(TMS, int32)
        valid_i = cuda.local.array(TMS, int32)
        slope_i = cuda.local.array(TMS, float32)
        acc = cuda.local.array((TMO, VEC), float32)  # [TMO, VEC] of O's [BLOCK_M, HEAD_DIM]
        k_frag = cuda.local.array(VEC, float32)
        v_frag = cuda.local.array(VEC, float32)
        for i in range(TMS):
            row = start_m + warp + NUM_WARPS * i
            m_i[i] = -math.inf
            l_i[i] = 0.0
            tok_i[i] = row % seqlen_q
            valid_i[i] = 1 if row < rows and row % seqlen_q < seqlen_q_b else 0
            slope_i[i] = float32(0.0)
            if ALIBI and valid_i[i] == 1:
                off_h = off_hk * group + row // seqlen_q
                slope_i[i] = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E)
        for i in range(TMO):
            for e in range(VEC):
                acc[i, e] = 0.0
        # side-by-side: end

        # S = Q K^T: key n = lane // DS of the tile, head-dim chunks dp, dp + DS, ... of it (dp = lane % DS).
        n_s = lane // DS
        dp = lane % DS
        # P V: chunk dc of O's columns for rows gm, gm + GM, ... and keys gn, gn + GN, ... of the tile.
        dc = tid % CH
        gm = tid // CH % GM
        gn = tid // CH // GM
        s_warp = BLOCK_M >= NUM_WARPS or warp < BLOCK_M  # this warp owns rows of S (warp-uniform)
        # The loader: chunk tid % CH of tile rows tid // CH, + ROW_STEP, ...
        ld_c = tid % CH
        ld_r = tid // CH
        k_base = global_address(k) if ASYNC_LOADS else uint64(0)
        v_base = global_address(v) if ASYNC_LOADS else uint64(0)
        k_head = off_hk * stride_kh + (0 if PAGED else cache_b * stride_kb)
        v_head = off_hk * stride_vh + (0 if PAGED else cache_b * stride_vb)

        # side-by-side: loop
        # Two stages: tile t + 1's copies are issued once tile t has landed, and fly during its compute.
        if n_tiles > 0:
            load_kv(kv_tile, 0, lo, hi, k, v, k_base, v_base, k_head, v_head, block_table, off_b, ld_r, ld_c,
                    stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tb, stride_tp,
                    capacity, cache_rows, page_size, head_dim)
        for t in range(n_tiles):
            if ASYNC_LOADS:
                cp_async_wait_all()  # this thread's copies of tile t; the barrier makes every thread's visible
            cuda.syncthreads()  # and every thread is done with tile t - 1's stage and p_tile
            start_n = lo + t * BLOCK_N
            k_row = (t % 2) * 2 * BLOCK_N
            v_row = k_row + BLOCK_N
            if t + 1 < n_tiles:
                load_kv(kv_tile, ((t + 1) % 2) * 2 * BLOCK_N, start_n + BLOCK_N, hi, k, v, k_base, v_base, k_head,
                        v_head, block_table, off_b, ld_r, ld_c, stride_kb, stride_kn, stride_kd, stride_vb,
                        stride_vn, stride_vd, stride_tb, stride_tp, capacity, cache_rows, page_size, head_dim)
        # side-by-side: end

            # side-by-side: scores
            if s_warp:
                for i in range(TMS):
                    s[i] = 0.0
                for kk in range(CH // DS):
                    c = dp + DS * kk
                    load_chunk(kv_tile, k_row + n_s, c, k_frag)
                    for i in range(TMS):
                        for e in range(VEC):
                            s[i] += q_tile[uint64(warp + NUM_WARPS * i), uint64(VEC * c + e)] * k_frag[e]
                key = start_n + n_s
                for i in range(TMS):
                    for b in range(LOG_DS):  # the DS lanes of one key: each gets the whole dot product
                        s[i] += shfl_xor(s[i], 1 << b)
                    score = s[i]
                    # Softcap c: Q was pre-scaled by scale / c, so c · log2 e · tanh(s) is the capped score.
                    if SOFTCAP:
                        score = _tanh(score) * softcap_log2
                    # ALiBi: minus slope · log2 e times the key's distance from the query's diagonal.
                    if ALIBI:
                        score -= slope_i[i] * float32(abs(tok_i[i] + diag - key))
                    visible = key < hi and valid_i[i] == 1
                    if RIGHT:
                        visible = visible and key <= tok_i[i] + diag + window_right
                    if LEFT:
                        visible = visible and key >= tok_i[i] + diag - window_left
                    if not visible:
                        score = float32(-math.inf)  # a float32 -inf: a float64 one would make score float64
                    # side-by-side: softmax
                    m_new = score  # the row max over the tile's keys: the other key lanes of the warp
                    for b in range(LOG_DS, 5):
                        m_new = max(m_new, shfl_xor(m_new, 1 << b))
                    m_new = max(m_new, m_i[i])
                    # Nothing visible yet: m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
                    m_safe = m_new if m_new != -math.inf else float32(0.0)
                    alpha = math.exp2(m_i[i] - m_safe)
                    p = math.exp2(score - m_safe)
                    l_i[i] = alpha * l_i[i] + p
                    m_i[i] = m_new
                    if dp == 0:
                        p_tile[uint64(warp + NUM_WARPS * i), uint64(n_s)] = p
                    if lane == 0:
                        alpha_tile[warp + NUM_WARPS * i] = alpha
            cuda.syncthreads()

            # acc += P V: the thread's TMO rows x VEC columns, its KEYS_PV keys.
            for i in range(TMO):
                alpha = alpha_tile[gm + GM * i]
                for e in range(VEC):
                    acc[i, e] *= alpha
            for kk in range(KEYS_PV):
                n = gn + GN * kk
                load_chunk(kv_tile, v_row + n, dc, v_frag)
                for i in range(TMO):
                    p = p_tile[uint64(gm + GM * i), uint64(n)]
                    for e in range(VEC):
                        acc[i, e] += p * v_frag[e]
            # side-by-side: end

        # side-by-side: epilogue
        # The row sums over the key lanes, the GN key subsets' accumulators added, then O = acc / l and
        # L = m + log l (base 2 for the combine, natural without splits), each once. Rows that saw no key
        # have l = 0: O = 0 and L = +inf (with splits, only L: the combine reads no O of such a split).
        if s_warp:
            for i in range(TMS):
                l_sum = l_i[i]
                for b in range(LOG_DS, 5):
                    l_sum += shfl_xor(l_sum, 1 << b)
                if lane == 0:
                    l_tile[warp + NUM_WARPS * i] = l_sum
                    m_tile[warp + NUM_WARPS * i] = m_i[i]
        if GN > 1:
            for e in range(VEC):
                red[uint64(VEC * tid + e)] = acc[0, e]
        cuda.syncthreads()
        if gn == 0:
            if GN > 1:
                for j in range(1, GN):
                    for e in range(VEC):
                        acc[0, e] += red[uint64(VEC * (tid + CH * GM * j) + e)]
            for i in range(TMO):
                r = gm + GM * i
                row = start_m + r
                tok = row % seqlen_q
                if row < rows and tok < seqlen_q_b:
                    off_h = off_hk * group + row // seqlen_q
                    if VARLEN:
                        o_row = off_h * total_q + q_start + tok
                    else:
                        o_row = (off_b * heads + off_h) * seqlen_q + tok
                    l_sum = l_tile[r]
                    # A NaN score makes l NaN, and O and L must then be NaN, not the no-key marker: != 0.
                    inv_l = float32(1.0) / l_sum if l_sum != 0.0 else float32(0.0)
                    if SPLIT:
                        o_row += split * rows_total
                        if l_sum != 0.0:
                            for e in range(VEC):
                                col = VEC * dc + e
                                if EVEN_HEAD_DIM or col < head_dim:
                                    o[uint64(o_row * head_dim + col)] = acc[i, e] * inv_l
                        if dc == 0:
                            lse[uint64(o_row)] = m_tile[r] + math.log2(l_sum) if l_sum != 0.0 else float32(math.inf)
                    else:
                        for e in range(VEC):
                            col = VEC * dc + e
                            if EVEN_HEAD_DIM or col < head_dim:
                                o[uint64(o_row * head_dim + col)] = from_float(acc[i, e] * inv_l)
                        if dc == 0:
                            L = (m_tile[r] + math.log2(l_sum)) * float32(LN2) if l_sum != 0.0 else float32(math.inf)
                            lse[uint64(o_row)] = L
        # side-by-side: end

    # The simulator's jit takes no max_registers.
    return cuda.jit(_kvcache_fwd) if simulated() else cuda.jit(max_registers=MAX_REGISTERS)(_kvcache_fwd)


class TensorCoreDecodeConfig(NamedTuple):
    """The tensor-core split kernel's block: NUM_WARPS warps, each with the same BLOCK_M = 16 query rows (the
    M side of ``mma.m16n8k16``) and its own 16 keys of every BLOCK_N = 16 · NUM_WARPS-key tile; MAX_REGISTERS
    caps ptxas (it bounds the blocks an SM holds, which ``num_splits_heuristic`` counts on)."""

    NUM_WARPS: int
    MAX_REGISTERS: int


def tc_decode_config(HEAD_DIM: int) -> TensorCoreDecodeConfig:
    """The tensor-core block for a padded head dim (32, 64 or 128): two stages of K and V tiles and their
    16 B row padding in the 48 KB of static shared memory, Q and the warps' final merge reusing them::

        HEAD_DIM   warps   keys a tile   shared memory (as ptxas reports it)
        32, 64     4       64            20,992, 37,376 B
        128        2       32            35,072 B

    Registers per thread (fragments: fp32 O HEAD_DIM / 2, Q HEAD_DIM / 4, S 8): capped at 128 up to HEAD_DIM
    64 and at 176 at 128, where ptxas (CUDA 13.0, sm_90, offline) needs no spill; at 128 that is five blocks an
    SM by registers (six by shared memory). Not yet measured on a GPU."""
    if HEAD_DIM <= 64:
        return TensorCoreDecodeConfig(4, 128)
    return TensorCoreDecodeConfig(2, 176)


def tc_shared_bytes(HEAD_DIM: int, config: TensorCoreDecodeConfig) -> int:
    """Static shared memory of a tensor-core decode block (``_build_tc_kernel``'s arrays)."""
    return 4 * (4 * 16 * config.NUM_WARPS * (HEAD_DIM // 2 + 4) + 2 * 16 * config.NUM_WARPS)


def uses_tensor_cores(q: torch.Tensor) -> bool:
    """Whether ``kvcache_forward`` runs the tensor-core split kernel for q: fp16 or bf16 with head_dim <= 128,
    on a CUDA device of compute capability 8.0 or newer or under numba's simulator (where ``mma.py`` emulates
    the instructions); the SIMT kernel otherwise (fp32, head_dim > 128, older GPUs). A capability and shape
    rule only: neither kernel stands in for the other after an error."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > TC_MAX_HEAD_DIM:
        return False
    return simulated() or (q.device.type == "cuda" and capability(q.device) >= MIN_COMPUTE_CAPABILITY)


def _build_tc_kernel(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX, LEFTPAD, SPLIT,
                     IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS):
    """The split-KV kernel on tensor cores, for fp16 / bf16 and a padded head dim of 32, 64 or 128, with the
    switches of ``_build_kernel`` and its arguments (q as 16-bit patterns); ``TensorCoreDecodeConfig``."""
    NUM_WARPS, MAX_REGISTERS = config
    NUM_THREADS = 32 * NUM_WARPS
    BLOCK_M = 16  # query rows of a block: the group · seqlen_q rows of a (batch, key/value head), in tiles of 16
    BLOCK_N = 16 * NUM_WARPS  # keys a tile, 16 a warp
    LDW = HEAD_DIM // 2 + 4  # words a shared row: 16 B of padding, so that ldmatrix's 8 row addresses miss banks
    CH = HEAD_DIM // 8  # 16 B chunks a row
    ROW_STEP = NUM_THREADS // CH  # tile rows one pass of the loader covers
    D_STEPS = HEAD_DIM // 16  # k steps of S = Q Kᵀ; pairs of 8-column tiles of O
    O_TILES = HEAD_DIM // 8  # 8-column C tiles of O
    Q_ROW = 2 * BLOCK_N  # Q's 16 rows, before the loop, in stage 1's K rows
    KV_ROWS = 4 * BLOCK_N  # 2 stages of K then V
    WARP_ROWS = BLOCK_M * NUM_WARPS
    assert HEAD_DIM % 16 == 0 and NUM_THREADS % CH == 0 and BLOCK_N % ROW_STEP == 0
    assert (NUM_WARPS - 1) * 32 <= KV_ROWS and 4 * O_TILES <= LDW  # the warps' merge fits the tiles' rows
    kind = "bf16" if IS_BF16 else "f16"
    mma = mma_bf16 if IS_BF16 else mma_f16
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    from_float = _float_to_bf16 if IS_BF16 else _identity
    load_kv = _kv_loader(BLOCK_N, ROW_STEP, LDW, kind, PAGED, EVEN_HEAD_DIM, ASYNC_LOADS)

    def _kvcache_fwd_tc(
        q, k, v, o, lse, block_table, cache_seqlens, cache_leftpad, cache_batch_idx, cu_seqlens_q,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_tb, stride_tp,
        heads, heads_k, group, seqlen_q, total_q, capacity, cache_rows, page_size, head_dim, qk_scale,
        num_m_tiles, num_splits, split_keys, rows_total,
        window_left, window_right, softcap_log2, slopes, stride_ab, stride_ah,
    ):
        """One block: 16 of the group · seqlen_q query rows of one (split, batch, key/value head), as
        ``_kvcache_fwd`` of ``_build_kernel`` (the same arguments, q, k and v as 16-bit patterns)."""
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # the lane holds rows g and g + 8 of the tile, keys (columns) 2 t and 2 t + 1 of each 8
        t = lane % 4
        bid = cuda.blockIdx.x
        start_m = (bid % num_m_tiles) * BLOCK_M
        bid //= num_m_tiles
        split = bid % num_splits
        bid //= num_splits
        off_hk = bid % heads_k
        off_b = bid // heads_k
        rows = group * seqlen_q

        # The key range, as the SIMT kernel's (module docstring).
        if VARLEN:
            q_start, seqlen_q_b = sequence(cu_seqlens_q, off_b, total_q)
        else:
            q_start, seqlen_q_b = 0, seqlen_q
        seqlen_k = min(max(int(cache_seqlens[off_b]), 0), capacity)
        leftpad = min(max(int(cache_leftpad[off_b]), 0), seqlen_k) if LEFTPAD else 0
        if PAGED:
            cache_b = 0
        elif BATCH_IDX:
            cache_b = min(max(int(cache_batch_idx[off_b]), 0), cache_rows - 1)
        else:
            cache_b = min(off_b, cache_rows - 1)
        diag = seqlen_k - seqlen_q_b
        lo = max(leftpad, split * split_keys)
        hi = min(seqlen_k, (split + 1) * split_keys)
        if LEFT:
            lo = max(lo, diag - window_left)
        if RIGHT:
            hi = min(hi, seqlen_q_b + diag + window_right)
        n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N if hi > lo else 0

        kv_tile = cuda.shared.array((KV_ROWS, LDW), int32, alignment=SHARED_ALIGN)  # [2, K V, BLOCK_N, HEAD_DIM]
        m_warps = cuda.shared.array(WARP_ROWS, float32)  # each warp's row maxima and sums, merged
        l_warps = cuda.shared.array(WARP_ROWS, float32)
        tile_base = shared_address(kv_tile)  # first (the simulator fills a shared array at its first address)

        # The lane's two rows r = g + 8 h: their tokens, whether they exist, their ALiBi slopes in base 2.
        tok_i = cuda.local.array(2, int32)
        valid_i = cuda.local.array(2, int32)
        slope_i = cuda.local.array(2, float32)
        for h in range(2):
            row = start_m + g + 8 * h
            tok_i[h] = row % seqlen_q
            valid_i[h] = 1 if row < rows and row % seqlen_q < seqlen_q_b else 0
            slope_i[h] = float32(0.0)
            if ALIBI and valid_i[h] == 1:
                slope_i[h] = slopes[uint64(off_b * stride_ab + (off_hk * group + row // seqlen_q) * stride_ah)] * \
                    float32(LOG2E)

        # Q: 16 rows of 16-bit pairs into stage 1's K rows (zeros past the rows and head_dim), then every warp's
        # A fragments (the same 16 rows for each warp), one per 16 head dims.
        for it in range(-(-BLOCK_M * (HEAD_DIM // 2) // NUM_THREADS)):
            idx = tid + NUM_THREADS * it
            r = idx // (HEAD_DIM // 2)
            c = 2 * (idx % (HEAD_DIM // 2))
            row = start_m + r
            tok = row % seqlen_q
            word = int32(0)
            if r < BLOCK_M and row < rows and tok < seqlen_q_b:
                off_h = off_hk * group + row // seqlen_q
                if VARLEN:
                    offset = off_h * stride_qh + (q_start + tok) * stride_qm
                else:
                    offset = off_b * stride_qb + off_h * stride_qh + tok * stride_qm
                if EVEN_HEAD_DIM or c < head_dim:
                    word = int32(q[uint64(offset + c * stride_qd)]) & int32(0xFFFF)
                if EVEN_HEAD_DIM or c + 1 < head_dim:
                    word |= int32(q[uint64(offset + (c + 1) * stride_qd)]) << int32(16)
            if r < BLOCK_M:
                kv_tile[uint64(Q_ROW + r), uint64(c // 2)] = word
        cuda.syncthreads()
        a_row, a_col = ldmatrix_a_row_col(lane)
        b_row, b_col = ldmatrix_b_row_col(lane)
        q_frag = cuda.local.array((D_STEPS, 4), int32)  # [16 rows, HEAD_DIM] as D_STEPS A fragments
        for kk in range(D_STEPS):
            a0, a1, a2, a3 = ldmatrix_x4(tile_base + uint32(4 * (Q_ROW + a_row) * LDW + 2 * a_col + 32 * kk))
            q_frag[kk, 0] = a0
            q_frag[kk, 1] = a1
            q_frag[kk, 2] = a2
            q_frag[kk, 3] = a3
        # Stage 1 is written only after the first tile's barrier, by which every warp has its fragments.

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        m_safe = cuda.local.array(2, float32)
        s = cuda.local.array((2, 4), float32)  # [16 rows, the warp's 16 keys] as two 8-key C tiles
        acc = cuda.local.array((O_TILES, 4), float32)  # [16 rows, HEAD_DIM] as 8-column C tiles
        for h in range(2):
            m_i[h] = -math.inf
            l_i[h] = 0.0
        for c in range(O_TILES):
            for e in range(4):
                acc[c, e] = 0.0

        ld_c = tid % CH
        ld_r = tid // CH
        k_base = global_address(k) if ASYNC_LOADS else uint64(0)
        v_base = global_address(v) if ASYNC_LOADS else uint64(0)
        k_head = off_hk * stride_kh + (0 if PAGED else cache_b * stride_kb)
        v_head = off_hk * stride_vh + (0 if PAGED else cache_b * stride_vb)

        # Two stages, as the SIMT kernel: tile t + 1's copies fly during tile t's compute.
        if n_tiles > 0:
            load_kv(kv_tile, 0, lo, hi, k, v, k_base, v_base, k_head, v_head, block_table, off_b, ld_r, ld_c,
                    stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tb, stride_tp,
                    capacity, cache_rows, page_size, head_dim)
        for tile in range(n_tiles):
            if ASYNC_LOADS:
                cp_async_wait_all()
            cuda.syncthreads()
            start_n = lo + tile * BLOCK_N
            k_row = (tile % 2) * 2 * BLOCK_N
            if tile + 1 < n_tiles:
                load_kv(kv_tile, ((tile + 1) % 2) * 2 * BLOCK_N, start_n + BLOCK_N, hi, k, v, k_base, v_base, k_head,
                        v_head, block_table, off_b, ld_r, ld_c, stride_kb, stride_kn, stride_kd, stride_vb,
                        stride_vn, stride_vd, stride_tb, stride_tp, capacity, cache_rows, page_size, head_dim)

            # S = Q Kᵀ on the warp's 16 keys: per 16 head dims one ldmatrix (two 8-key B fragments), two mma.
            for j in range(2):
                for e in range(4):
                    s[j, e] = 0.0
            k_lane = tile_base + uint32(4 * (k_row + 16 * warp + b_row) * LDW + 2 * b_col)
            for kk in range(D_STEPS):
                b0, b1, b2, b3 = ldmatrix_x4(k_lane + uint32(32 * kk))
                d0, d1, d2, d3 = mma(q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b0, b1,
                                     s[0, 0], s[0, 1], s[0, 2], s[0, 3])
                s[0, 0] = d0
                s[0, 1] = d1
                s[0, 2] = d2
                s[0, 3] = d3
                d0, d1, d2, d3 = mma(q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b2, b3,
                                     s[1, 0], s[1, 1], s[1, 2], s[1, 3])
                s[1, 0] = d0
                s[1, 1] = d1
                s[1, 2] = d2
                s[1, 3] = d3

            # The scores in base 2, as the SIMT kernel's: softcap, ALiBi, the mask; then the online softmax of
            # the lane's two rows, the row max over the lane's keys and its quad (two shfl_xor).
            key0 = start_n + 16 * warp + 2 * t
            for h in range(2):
                m_tile = float32(-math.inf)
                for j in range(2):
                    for e in range(2 * h, 2 * h + 2):
                        key = key0 + 8 * j + e % 2
                        score = s[j, e] * qk_scale
                        if SOFTCAP:  # qk_scale = scale / c: c · log2 e · tanh(s · scale / c)
                            score = _tanh(score) * softcap_log2
                        if ALIBI:
                            score -= slope_i[h] * float32(abs(tok_i[h] + diag - key))
                        visible = key < hi and valid_i[h] == 1
                        if RIGHT:
                            visible = visible and key <= tok_i[h] + diag + window_right
                        if LEFT:
                            visible = visible and key >= tok_i[h] + diag - window_left
                        if not visible:
                            score = float32(-math.inf)
                        s[j, e] = score
                        m_tile = max(m_tile, score)
                m_tile = max(m_tile, shfl_xor(m_tile, 1))
                m_tile = max(m_tile, shfl_xor(m_tile, 2))
                m_new = max(m_i[h], m_tile)
                # Nothing visible yet: m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
                m_safe[h] = m_new if m_new != -math.inf else float32(0.0)
                alpha[h] = exp2_approx(m_i[h] - m_safe[h])
                m_i[h] = m_new
                l_part = float32(0.0)
                for j in range(2):
                    for e in range(2 * h, 2 * h + 2):
                        p = exp2_approx(s[j, e] - m_safe[h])
                        s[j, e] = p
                        l_part += p
                l_i[h] = alpha[h] * l_i[h] + l_part

            # acc = alpha · acc + P V: S's two C tiles are P's A fragment (16 keys), rounded to 16 bits in
            # pairs; V's B fragments by ldmatrix.trans, two 8-column tiles of O a load.
            for c in range(O_TILES):
                for e in range(4):
                    acc[c, e] *= alpha[e // 2]
            a0 = pack(s[0, 0], s[0, 1])
            a1 = pack(s[0, 2], s[0, 3])
            a2 = pack(s[1, 0], s[1, 1])
            a3 = pack(s[1, 2], s[1, 3])
            v_lane = tile_base + uint32(4 * (k_row + BLOCK_N + 16 * warp + a_row) * LDW + 2 * a_col)
            for dd in range(D_STEPS):
                b0, b1, b2, b3 = ldmatrix_x4_trans(v_lane + uint32(32 * dd))
                d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1,
                                     acc[2 * dd, 0], acc[2 * dd, 1], acc[2 * dd, 2], acc[2 * dd, 3])
                acc[2 * dd, 0] = d0
                acc[2 * dd, 1] = d1
                acc[2 * dd, 2] = d2
                acc[2 * dd, 3] = d3
                d0, d1, d2, d3 = mma(a0, a1, a2, a3, b2, b3,
                                     acc[2 * dd + 1, 0], acc[2 * dd + 1, 1], acc[2 * dd + 1, 2], acc[2 * dd + 1, 3])
                acc[2 * dd + 1, 0] = d0
                acc[2 * dd + 1, 1] = d1
                acc[2 * dd + 1, 2] = d2
                acc[2 * dd + 1, 3] = d3

        # Epilogue: each warp's row sums over its quads; the warps' (m, l, acc) merged as the combine merges
        # splits (rescaled to the rows' overall max), warps 1.. handing their rescaled acc to warp 0 through the
        # tiles' words (the last tile's barrier passed, no copy in flight); then O = acc / l and L = m + log l
        # (base 2 for the combine, natural without splits), each once. Rows that saw no key have l = 0: O = 0 and
        # L = +inf (with splits, only L: the combine reads no O of such a split).
        for h in range(2):
            l_sum = l_i[h] + shfl_xor(l_i[h], 1)
            l_sum += shfl_xor(l_sum, 2)
            l_i[h] = l_sum
            if t == 0:
                m_warps[warp * BLOCK_M + g + 8 * h] = m_i[h]
                l_warps[warp * BLOCK_M + g + 8 * h] = l_sum
        cuda.syncthreads()
        for h in range(2):
            r = g + 8 * h
            m_all = m_warps[r]
            for w in range(1, NUM_WARPS):
                m_all = max(m_all, m_warps[w * BLOCK_M + r])
            m_safe[h] = m_all if m_all != -math.inf else float32(0.0)
            l_all = float32(0.0)
            for w in range(NUM_WARPS):
                l_all += l_warps[w * BLOCK_M + r] * exp2_approx(m_warps[w * BLOCK_M + r] - m_safe[h])
            alpha[h] = exp2_approx(m_i[h] - m_safe[h])  # this warp's share
            l_i[h] = l_all
        if warp > 0:  # a lane's HEAD_DIM / 2 accumulators: one tile row, (warp - 1) · 32 + lane
            for c in range(O_TILES):
                for e in range(4):
                    word = _float_as_int(acc[c, e] * alpha[e // 2])
                    kv_tile[uint64((warp - 1) * 32 + lane), uint64(4 * c + e)] = word
        cuda.syncthreads()
        if warp == 0:
            for c in range(O_TILES):
                for e in range(4):
                    value = acc[c, e] * alpha[e // 2]
                    for w in range(1, NUM_WARPS):
                        value += _int_as_float(kv_tile[uint64((w - 1) * 32 + lane), uint64(4 * c + e)])
                    acc[c, e] = value
            for h in range(2):
                r = g + 8 * h
                row = start_m + r
                tok = row % seqlen_q
                if valid_i[h] == 1:
                    off_h = off_hk * group + row // seqlen_q
                    if VARLEN:
                        o_row = off_h * total_q + q_start + tok
                    else:
                        o_row = (off_b * heads + off_h) * seqlen_q + tok
                    l_sum = l_i[h]
                    # A NaN score makes l NaN, and O and L must then be NaN, not the no-key marker: != 0.
                    inv_l = float32(1.0) / l_sum if l_sum != 0.0 else float32(0.0)
                    if SPLIT:
                        o_row += split * rows_total
                    for c in range(O_TILES):
                        for e in range(2 * h, 2 * h + 2):
                            col = 8 * c + 2 * t + e % 2
                            if EVEN_HEAD_DIM or col < head_dim:
                                if SPLIT:
                                    if l_sum != 0.0:
                                        o[uint64(o_row * head_dim + col)] = acc[c, e] * inv_l
                                else:
                                    o[uint64(o_row * head_dim + col)] = from_float(acc[c, e] * inv_l)
                    if t == 0:
                        if SPLIT:
                            lse[uint64(o_row)] = m_safe[h] + math.log2(l_sum) if l_sum != 0.0 else float32(math.inf)
                        else:
                            L = (m_safe[h] + math.log2(l_sum)) * float32(LN2) if l_sum != 0.0 else float32(math.inf)
                            lse[uint64(o_row)] = L

    if simulated():
        return cuda.jit(_kvcache_fwd_tc)
    return cuda.jit(max_registers=MAX_REGISTERS)(_kvcache_fwd_tc)


def _build_combine(IS_BF16):
    """The LSE combine: one warp a row of O. o_part (num_splits, rows_total, head_dim) fp32 and lse_part
    (num_splits, rows_total) fp32, base 2 (+inf: the split saw no key of the row, its O row unwritten);
    writes o (rows_total, head_dim) in q's dtype and lse (rows_total,) natural log."""
    from_float = _float_to_bf16 if IS_BF16 else _identity

    def _combine(o_part, lse_part, o, lse, num_splits, rows_total, head_dim):
        row = cuda.blockIdx.x * COMBINE_ROWS + cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        if row >= rows_total:
            return
        # side-by-side: combine
        # L = log2 Σ_s 2^(L_s), over the splits that saw a key (L_s != +inf), around their max.
        m = float32(-math.inf)
        for sp in range(num_splits):
            ls = lse_part[uint64(sp * rows_total + row)]
            if ls != math.inf and ls > m:
                m = ls
        total = float32(0.0)
        for sp in range(num_splits):
            ls = lse_part[uint64(sp * rows_total + row)]
            if ls != math.inf:
                total += math.exp2(ls - m)
        # No key in any split (m = -inf, total = 0): O = 0, L = +inf. A NaN L_s makes total and L NaN.
        empty = m == -math.inf
        lse2 = m + math.log2(total) if not empty else float32(0.0)
        for c in range(lane, head_dim, 32):
            value = float32(0.0)
            for sp in range(num_splits):
                ls = lse_part[uint64(sp * rows_total + row)]
                if ls != math.inf:
                    value += math.exp2(ls - lse2) * o_part[uint64((sp * rows_total + row) * head_dim + c)]
            o[uint64(row * head_dim + c)] = from_float(value)
        if lane == 0:
            lse[uint64(row)] = lse2 * float32(LN2) if not empty else float32(math.inf)
        # side-by-side: end

    return cuda.jit(_combine)


# Compiled kernels by (HEAD_DIM, DecodeConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX, LEFTPAD,
# SPLIT, KIND, EVEN_HEAD_DIM, ASYNC_LOADS); the combines by IS_BF16.
_KERNELS: dict[tuple, object] = {}
# The tensor-core kernels by (HEAD_DIM, TensorCoreDecodeConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED,
# BATCH_IDX, LEFTPAD, SPLIT, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS).
_TC_KERNELS: dict[tuple, object] = {}
_COMBINES: dict[bool, object] = {}


def _kernel(*key):
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _build_kernel(*key)
    return kernel


def _tc_kernel(*key):
    kernel = _TC_KERNELS.get(key)
    if kernel is None:
        kernel = _TC_KERNELS[key] = _build_tc_kernel(*key)
    return kernel


def _combine_kernel(is_bf16: bool):
    kernel = _COMBINES.get(is_bf16)
    if kernel is None:
        kernel = _COMBINES[is_bf16] = _build_combine(is_bf16)
    return kernel


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _no_index(device: torch.device) -> torch.Tensor:
    """The argument of an index tensor a kernel does not read: one int32 zero on ``device``, made once."""
    zero = _ZEROS.get(device)
    if zero is None:
        zero = _ZEROS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return zero


def _index(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if t is None:
        return _no_index(device)
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _cache_view(t: torch.Tensor) -> torch.Tensor:
    """The kernel's view of a K or V cache (``launch`` passes it as ``_flat`` of it): fp16 as its int16 bit
    patterns (the plain loads move bits into the 32-bit words of the shared tiles), bf16 too (``_flat``)."""
    return t.view(torch.int16) if t.dtype == torch.float16 else t


def _index_tensors(spec: AttentionSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The split kernel's index arguments 5 .. 9 (block table, cache_seqlens, cache_leftpad, cache_batch_idx,
    cu_seqlens_q), each as the kernel reads it (int32, contiguous) or ``_no_index`` where absent."""
    return (spec.block_table if spec.paged else _no_index(device), _index(spec.cache_seqlens, device),
            _index(spec.cache_leftpad, device), _index(spec.cache_batch_idx, device),
            _index(spec.cu_seqlens_q, device))


def _varying(spec: AttentionSpec, slopes_at: int) -> tuple[int, ...]:
    """The split kernel's arguments that change within a ``launch.prepare`` class: q, k, v, the outputs, the
    index tensors the spec has (``_index_tensors``' positions 5 .. 9) and the slopes (at ``slopes_at``)."""
    present = (spec.paged, True, spec.cache_leftpad is not None, spec.cache_batch_idx is not None, spec.varlen)
    indices = tuple(5 + i for i, there in enumerate(present) if there)
    return (0, 1, 2, 3, 4, *indices, *((slopes_at,) if spec.alibi_slopes is not None else ()))


def _varying_tensors(spec: AttentionSpec, index_tensors: tuple) -> tuple[torch.Tensor, ...]:
    """The tensors of a call at ``_varying``'s positions after the five of q, k, v and the outputs."""
    present = (spec.paged, True, spec.cache_leftpad is not None, spec.cache_batch_idx is not None, spec.varlen)
    slopes = (spec.alibi_slopes,) if spec.alibi_slopes is not None else ()
    return (*(t for t, there in zip(index_tensors, present) if there), *slopes)


def _class_key(q, k_cache, v_cache, spec, config) -> tuple:
    """A ``launch.prepare`` class of kvcache_forward calls: everything the kernels, their grids and their
    arguments other than the tensors' memory are functions of (shapes, strides, dtypes, the device, the caches'
    16 B alignment for cp.async, the spec's values and its index tensors' layouts, the config)."""
    def layout(t):
        return None if t is None else (t.shape, t.stride(), t.dtype)

    return (layout(q), layout(k_cache), layout(v_cache), q.device, (k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0,
            spec_class(spec), spec.num_splits, layout(spec.block_table), layout(spec.cache_seqlens),
            layout(spec.cache_leftpad), layout(spec.cache_batch_idx), layout(spec.cu_seqlens_q),
            None if config is None else tuple(config))


class _Plan(NamedTuple):
    """A class's prepared launches: the split kernel's, and with splits the combine's and the partial
    results' shape (num_splits, rows_total, head_dim)."""

    split: object
    combine: object | None
    parts: tuple[int, int, int] | None


# Prepared launches by class of call (``_class_key``).
_PREPARED: dict[tuple, _Plan] = {}


def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spec: AttentionSpec,
    config: DecodeConfig | TensorCoreDecodeConfig | None = None,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim), any strides; with spec.cu_seqlens_q (packed queries) (1, heads,
            total_q, head_dim), sequence b's queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (at most
            spec.max_seqlen_q). fp32, fp16 or bf16; CUDA tensors, or CPU tensors under numba's simulator.
        k_cache, v_cache: q's dtype, any strides. Contiguous (spec.block_table None): (batch_cache, heads_k,
            seqlen_cache, head_dim), row b of q reading cache row spec.cache_batch_idx[b] (default b). Paged:
            (num_pages, heads_k, page_size, head_dim), key j of row b at row j % page_size of page
            spec.block_table[b, j // page_size]. heads a multiple of heads_k (GQA; 1 is MQA).
        spec: ``fa2.spec.AttentionSpec`` with cache_seqlens ((batch,) int32, K_b: row b attends to keys
            [cache_leftpad[b] or 0, K_b) of its cache); scale, window (aligned on K_b: query i of Nq_b sees
            key j iff i + K_b - Nq_b - left <= j <= i + K_b - Nq_b + right, -1 unbounded), softcap,
            alibi_slopes ((batch, heads) fp32, -slope · |i + K_b - Nq_b - j|), group, num_splits (0: picked
            by ``num_splits_heuristic``; 1: one pass, no combine). Causal, Nq_b = 2, K_b = 5, leftpad 1::

                0 1 1 1 0
                0 1 1 1 1

        config: the block shape, for tuning; default ``decode_config(...)`` (a ``DecodeConfig``), or for the
            tensor-core kernel ``tc_decode_config(...)`` (a ``TensorCoreDecodeConfig``).
        tensor_cores: which split kernel. None: the tensor-core kernel for fp16 and bf16 with head_dim <= 128
            on compute capability 8.0+ or under numba's simulator (``uses_tensor_cores``), the SIMT kernel
            otherwise (fp32, head_dim > 128, older GPUs); True or False forces one (an input the forced kernel
            cannot take is an error). Neither falls back to the other.

    Returns:
        O: q's shape and dtype. L: (batch, heads, seqlen_q) (packed: (1, heads, total_q)), float32, natural
        log of the sum of exp of the final (capped, biased) scores; rows that see no key: O = 0, L = +inf.
        One launch of the split-KV kernel, one of the combine when there are splits; no host sync.

    Raises:
        NotImplementedError: head_dim above 256; with tensor_cores=True, an fp32 q, head_dim above 128 or a GPU
            older than compute capability 8.0.
        ValueError: q and the caches of different dtypes, or tensors on the wrong device for the mode.
    """
    key = None
    if launch.FAST:  # a call of a class met before: the kernels' parameters are packed, only pointers change
        key = (_class_key(q, k_cache, v_cache, spec, config), tensor_cores)
        plan = _PREPARED.get(key)
        if plan is not None:
            O = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            L = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            varying = _varying_tensors(spec, _index_tensors(spec, q.device))
            if plan.combine is None:
                plan.split(q, k_cache, v_cache, O, L, *varying)
            else:
                o_out = torch.empty(plan.parts, dtype=torch.float32, device=q.device)
                lse_out = torch.empty(plan.parts[:2], dtype=torch.float32, device=q.device)
                plan.split(q, k_cache, v_cache, o_out, lse_out, *varying)
                plan.combine(o_out, lse_out, O, L)
            return O, L
    batch_q, heads, seqlen_rows, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(f"fa2-numba-cuda's KV-cache path supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float32, torch.float16,
                                                                          torch.bfloat16):
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype of float32, float16, bfloat16, got {q.dtype}, "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    _check_device(q)
    device = q.device
    if tensor_cores is None:
        tensor_cores = uses_tensor_cores(q)
    elif tensor_cores:
        if q.dtype not in (torch.float16, torch.bfloat16) or head_dim > TC_MAX_HEAD_DIM:
            raise NotImplementedError(f"fa2-numba-cuda's tensor-core KV-cache kernel takes fp16 or bf16 with head_dim "
                                      f"up to {TC_MAX_HEAD_DIM}, got {q.dtype} with head_dim {head_dim}")
        if not simulated() and capability(device) < MIN_COMPUTE_CAPABILITY:
            raise NotImplementedError(f"fa2-numba-cuda's tensor-core KV-cache kernel needs compute capability 8.0 or "
                                      f"newer, got {capability(device)} on {device}")
    O = torch.empty(q.shape, dtype=q.dtype, device=device)
    L = torch.empty(q.shape[:3], dtype=torch.float32, device=device)
    heads_k = k_cache.shape[1]
    group = heads // heads_k
    if spec.varlen:
        batch, seqlen_q = spec.cu_seqlens_q.numel() - 1, spec.max_seqlen_q
    else:
        batch, seqlen_q = batch_q, seqlen_rows
    page_size = k_cache.shape[2]
    capacity = spec.block_table.shape[1] * page_size if spec.paged else k_cache.shape[2]
    if O.numel() == 0 or batch * seqlen_q == 0:
        return O, L
    if k_cache.numel() == 0:  # nothing to attend to: every row sees no key
        return O.zero_(), L.fill_(math.inf)

    kind = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype]
    element_size = q.element_size()
    HEAD_DIM = padded_head_dim(head_dim)
    rows = group * seqlen_q
    if tensor_cores:
        config = TensorCoreDecodeConfig(*config) if config is not None else tc_decode_config(HEAD_DIM)
        block_m, block_n, threads = 16, 16 * config.NUM_WARPS, 32 * config.NUM_WARPS
        shared = tc_shared_bytes(HEAD_DIM, config)
    else:
        config = DecodeConfig(*config) if config is not None else decode_config(HEAD_DIM, element_size, rows)
        block_m, block_n, threads = config.BLOCK_M, config.BLOCK_N, NUM_THREADS
        shared = shared_bytes(HEAD_DIM, element_size, config)
    num_m_tiles = -(-rows // block_m)
    blocks = num_m_tiles * batch * heads_k
    tiles = -(-capacity // block_n)
    num_splits = spec.num_splits
    if num_splits == 0:
        slots = block_slots(device, threads, config.MAX_REGISTERS, shared)
        shape = (blocks, slots, -(-tiles // MIN_SPLIT_TILES))
        num_splits = _SPLITS.get(shape)
        if num_splits is None:  # a loop over up to MAX_SPLITS counts: computed once per shape
            num_splits = _SPLITS[shape] = num_splits_heuristic(*shape)
    # Ranges of whole tiles; as many splits as hold a key of the capacity (at least one).
    split_keys = -(-max(tiles, 1) // num_splits) * block_n
    num_splits = max(1, -(-capacity // split_keys))
    split = num_splits > 1
    rows_total = L.numel()

    async_loads = rows_16b_aligned(k_cache) and rows_16b_aligned(v_cache)
    switches = (*features(spec), spec.paged, spec.cache_batch_idx is not None, spec.cache_leftpad is not None, split)
    if tensor_cores:
        kernel = _tc_kernel(HEAD_DIM, config, *switches, kind == "bf16", head_dim == HEAD_DIM, async_loads)
    else:
        kernel = _kernel(HEAD_DIM, config, *switches, kind, head_dim == HEAD_DIM, async_loads)
    if split:
        o_out = torch.empty(num_splits, rows_total, head_dim, dtype=torch.float32, device=device)
        lse_out = torch.empty(num_splits, rows_total, dtype=torch.float32, device=device)
    else:
        o_out, lse_out = O, L
    table_strides = spec.block_table.stride() if spec.paged else (0, 0)
    head = (
        _cache_view(q) if tensor_cores else q, _cache_view(k_cache), _cache_view(v_cache), o_out, lse_out,
        *_index_tensors(spec, device),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *table_strides,
        heads, heads_k, group, seqlen_q, seqlen_rows, capacity, k_cache.shape[0], page_size, head_dim,
        np.float32(score_scale(spec)), num_m_tiles, num_splits, split_keys, rows_total,
    )
    args = (*head, *feature_args(spec, seqlen_q, capacity, device))
    # Each launch is numba's the first time a class is met, then prepared (``launch.prepare``).
    split_launch = launch.prepare(kernel, blocks * num_splits, threads, device, args,
                                  _varying(spec, len(head) + 3))
    combine_launch = None
    if split:
        combine_launch = launch.prepare(_combine_kernel(q.dtype == torch.bfloat16), -(-rows_total // COMBINE_ROWS),
                                        NUM_THREADS, device, (o_out, lse_out, O, L, num_splits, rows_total, head_dim),
                                        (0, 1, 2, 3))
    if key is not None and split_launch is not None and (combine_launch is not None or not split):
        _PREPARED[key] = _Plan(split_launch, combine_launch, tuple(o_out.shape) if split else None)
    return O, L


def score_scale(spec: AttentionSpec) -> float:
    """What Q is pre-scaled by (``common.score_scale``): scale · log2 e, or with a softcap c, scale / c."""
    return spec.scale / spec.softcap if spec.softcap > 0 else spec.scale * LOG2E


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every decode kernel compiled
    so far in this process (one row per specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    kernels = [("kvcache", key, kernel) for key, kernel in _KERNELS.items()]
    kernels += [("kvcache-tensor-core", key, kernel) for key, kernel in _TC_KERNELS.items()]
    for name, key, kernel in kernels:
        HEAD_DIM, config, *switches = key
        regs = kernel.get_regs_per_thread()
        for signature in regs:
            rows.append({
                "kernel": name, "HEAD_DIM": HEAD_DIM, **config._asdict(),
                "switches": switches, "registers_per_thread": regs[signature],
                "shared_bytes_per_block": kernel.get_shared_mem_per_block()[signature],
                "local_bytes_per_thread": kernel.get_local_mem_per_thread()[signature],
            })
    return rows
