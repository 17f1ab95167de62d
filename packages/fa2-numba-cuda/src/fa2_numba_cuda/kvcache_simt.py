"""The KV-cache split kernel on CUDA cores (SIMT, fp32 arithmetic): what ``fa2_numba_cuda.kvcache.kvcache_forward``
runs for fp32 caches, head_dim above 128 and GPUs older than compute capability 8.0.

One block of NUM_THREADS threads per (query tile, split, batch, key/value head), laid out as ``kvcache``
describes, runs the online softmax of ``fa2_numba_cuda.forward_simt`` (running max ``m_i``, running sum
``l_i``, unnormalised ``acc``, rescaled by ``alpha`` per key tile; scores in base 2) over the key tiles of its
split that some row sees, and writes a partial O (fp32) and base-2 L for ``kvcache_combine``, or with one split
O in q's dtype and natural L. Decoding is bound by the bandwidth of reading the cache, not by arithmetic, so
the kernel is built around its loads:

- A block takes BLOCK_M of the group · seqlen_q query rows of its (batch, key/value head) (``DecodeConfig``,
  ``decode_config``); beyond BLOCK_M rows, tiles of rows are more blocks of the grid, each reading the range
  again, mostly from L2.
- K and V tiles of BLOCK_N keys are copied into shared memory by ``cp.async`` (16 B a copy, straight from
  global to shared, zero-filled past the keys and head_dim) where the cache is contiguous along head_dim
  with 16 B aligned rows, else by plain loads (any strides): ``common.kv_loader``, which the tensor-core
  kernel shares. Two stages: the copies of tile t + 1 are in flight while tile t is computed. The tiles hold
  the cache's own bits (fp32, or fp16 / bf16 pairs in 32-bit words, widened to fp32 as they are read); Q is
  in shared memory once, fp32, pre-scaled by ``qk_scale``.
- S = Q Kᵀ: warp w owns rows w, w + NUM_WARPS, ...; its lanes own the tile's keys, 32 / BLOCK_N lanes a key
  splitting head_dim (DS), reduced by ``shfl_xor``; the row max and (once, at the end) the row sum are
  ``shfl_xor`` reductions over the key lanes. P goes through shared memory (``p_tile``) with each row's
  ``alpha``.
- acc += P V: thread t owns 16 B of O's columns (chunk ``t % CH``) for TMO rows and every GN-th key of the
  tile; with fewer rows than thread groups (decoding one token of MHA: one row), the GN key subsets' partial
  accumulators are added through shared memory once, after the last tile.
- All arithmetic is fp32, whatever the cache's dtype; the softcap's tanh is ``common.tanh``.

Scores, masks, softcap and ALiBi as ``kvcache``'s docstring gives them. Compiled once per (padded head dim,
``DecodeConfig``, ``common.Features``, cache kind, split or not, input kind, head_dim == padded, cp.async or
plain loads) and cached (``kernel``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    SHARED_ALIGN,
    alibi,
    bf16_to_float,
    float32,
    float_to_bf16,
    identity,
    int32,
    int_as_float,
    jit_kernel,
    kv_loader,
    sequence,
    simulated,
    softcap,
    to_float32,
    uint64,
    with_sink,
)
from fa2_numba_cuda.mma import cp_async_wait_all, device_function, global_address, shfl_xor

NUM_THREADS = 128  # 4 warps a block
NUM_WARPS = NUM_THREADS // 32
STAGE_BYTES = 16384  # K and V tiles of one stage, before padding: 2 · BLOCK_N · HEAD_DIM · element size

if simulated():

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
            return context.make_tuple(
                builder, sig.return_type, [builder.extract_value(result, 0), builder.extract_value(result, 1)]
            )

        return types.UniTuple(types.float32, 2)(word), codegen


class DecodeConfig(NamedTuple):
    """One decode block's shape (NUM_THREADS threads): BLOCK_M query rows (a power of two), BLOCK_N keys a
    tile (8, 16 or 32, so that a row's keys are lanes of one warp); MAX_REGISTERS caps ptxas (it bounds the
    blocks an SM holds, which ``num_splits_heuristic`` counts on)."""

    BLOCK_M: int
    BLOCK_N: int
    MAX_REGISTERS: int


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


def _build_kernel(
    HEAD_DIM,
    config,
    LEFT,
    RIGHT,
    SOFTCAP,
    ALIBI,
    VARLEN,
    PAGED,
    BATCH_IDX,
    LEFTPAD,
    SPLIT,
    SINK,
    KIND,
    EVEN_HEAD_DIM,
    ASYNC_LOADS,
    PAGE_SIZE,
):
    """The split-KV kernel for one padded head dim, ``DecodeConfig``, ``Features`` (LEFT, RIGHT, SOFTCAP,
    ALIBI, VARLEN: cu_seqlens_q), cache kind (PAGED, BATCH_IDX, LEFTPAD), SPLIT (partial fp32 O and base-2 L
    per split, for ``kvcache_combine``; else O in q's dtype and natural L), SINK (the epilogue adds the
    attention sink: only without SPLIT, the combine adding it once otherwise), input kind KIND ("f32", "f16", "bf16"),
    head_dim == HEAD_DIM, cp.async loads (ASYNC_LOADS) and a paged cache's page size (PAGE_SIZE, 0 for a
    contiguous cache), all compile-time constants."""
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
        to_float, from_float = bf16_to_float, float_to_bf16
    else:
        to_float, from_float = to_float32, identity

    @device_function
    def load_chunk(tile, row, chunk, out):
        """out[0 .. VEC) = the 16 B chunk ``chunk`` of shared row ``row``, as fp32 (4 words, one 16 B load)."""
        for w in range(4):
            x = tile[uint64(row), uint64(4 * chunk + w)]
            if KIND == "f32":
                out[w] = x
            elif KIND == "bf16":
                out[2 * w] = int_as_float(x << int32(16))
                out[2 * w + 1] = int_as_float(x & int32(-65536))
            else:
                lo, hi = _f16x2_to_float(x)
                out[2 * w] = lo
                out[2 * w + 1] = hi

    assert PAGED == (PAGE_SIZE > 0)
    PAGE_READS, page_ids, load_kv = kv_loader(BLOCK_N, ROW_STEP, LDW, KIND, PAGE_SIZE, EVEN_HEAD_DIM, ASYNC_LOADS)

    def _kvcache_fwd(
        q,
        k,
        v,
        o,
        lse,
        block_table,
        cache_seqlens,
        cache_leftpad,
        cache_batch_idx,
        cu_seqlens_q,
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
        stride_tb,
        stride_tp,
        heads,
        heads_k,
        group,
        seqlen_q,
        total_q,
        capacity,
        cache_rows,
        head_dim,
        qk_scale,
        num_m_tiles,
        num_splits,
        split_keys,
        rows_total,
        window_left,
        window_right,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        sink,
    ):
        """One block: BLOCK_M of the group · seqlen_q query rows of one (split, batch, key/value head). q: a
        flat view of (batch, heads, seqlen_q, head_dim) (VARLEN: (1, heads, total_q, head_dim)), k and v of
        the cache ((batch_cache or num_pages, heads_k, seqlen_cache or page_size, head_dim)), with their
        element strides; o, lse: O and L flat and contiguous (SPLIT: (num_splits, rows_total, head_dim) fp32
        and (num_splits, rows_total) fp32 base 2). capacity: the keys a row's cache holds; cache_rows: its
        first dimension (clamps cache_batch_idx and page ids). sink: (heads,) fp32, natural log, read with SINK
        only (``common.sink_arg``)."""
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
        pages = cuda.local.array(PAGE_READS, int32)  # a paged cache's page ids of the thread's rows of a tile
        if n_tiles > 0:
            page_ids(pages, lo, block_table, off_b, ld_r, stride_tb, stride_tp, capacity, cache_rows)
            load_kv(
                kv_tile,
                0,
                lo,
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
            )
        for t in range(n_tiles):
            if ASYNC_LOADS:
                cp_async_wait_all()  # this thread's copies of tile t; the barrier makes every thread's visible
            cuda.syncthreads()  # and every thread is done with tile t - 1's stage and p_tile
            start_n = lo + t * BLOCK_N
            k_row = (t % 2) * 2 * BLOCK_N
            v_row = k_row + BLOCK_N
            if t + 1 < n_tiles:
                page_ids(pages, start_n + BLOCK_N, block_table, off_b, ld_r, stride_tb, stride_tp, capacity, cache_rows)
                load_kv(
                    kv_tile,
                    ((t + 1) % 2) * 2 * BLOCK_N,
                    start_n + BLOCK_N,
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
                )
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
                        score = softcap(score, softcap_log2)
                    # ALiBi: minus slope · log2 e times the key's distance from the query's diagonal.
                    if ALIBI:
                        score = alibi(score, slope_i[i], tok_i[i], key, diag)
                    # The mask written out, the row's validity tested second: through common.key_mask, with the
                    # validity tested before or after it, ptxas gives these kernels other code (offline, sm_90: other
                    # instruction counts, and at D64 on tensor cores up to 144 B more spills).
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
                    m_row = m_tile[r]
                    if SINK:
                        # The sink joins the denominator: O = acc · alpha / l, L = m + log2 l (l >= 1).
                        m_row, l_sum, alpha = with_sink(m_row, l_sum, sink[off_h] * float32(LOG2E))
                        inv_l = alpha / l_sum
                    else:
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
                            L = (m_row + math.log2(l_sum)) * float32(LN2) if l_sum != 0.0 else float32(math.inf)
                            lse[uint64(o_row)] = L
        # side-by-side: end

    return jit_kernel(_kvcache_fwd, MAX_REGISTERS)


# Compiled kernels by (HEAD_DIM, DecodeConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX, LEFTPAD,
# SPLIT, SINK, KIND, EVEN_HEAD_DIM, ASYNC_LOADS, PAGE_SIZE).
_KERNELS: dict[tuple, object] = {}


def kernel(*key):
    """The split kernel for ``_build_kernel``'s arguments, compiled once."""
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _build_kernel(*key)
    return found


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every SIMT split kernel
    compiled so far in this process (one row per specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (HEAD_DIM, config, *switches), compiled in _KERNELS.items():
        regs = compiled.get_regs_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": "kvcache",
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    "switches": switches,
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": compiled.get_shared_mem_per_block()[signature],
                    "local_bytes_per_thread": compiled.get_local_mem_per_thread()[signature],
                }
            )
    return rows
