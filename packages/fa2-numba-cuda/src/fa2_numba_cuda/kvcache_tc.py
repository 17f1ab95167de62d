"""The KV-cache split kernel on tensor cores: fp16 and bf16, head_dim <= 128, ``mma.sync`` from numba-cuda
through inline PTX; what ``fa2_numba_cuda.kvcache.kvcache_forward`` runs for those on compute capability 8.0+
and under numba's simulator (``kvcache.uses_tensor_cores``).

It computes what ``kvcache_simt``'s kernel computes, with the same arguments and block layout (one block per
(query tile, split, batch, key/value head)), with both products on ``mma.sync`` m16n8k16 (``mma.py``; fragment
layouts as in ``forward_tc``):

- The block's 16 query rows (the group · seqlen_q rows in tiles of 16, padding rows masked) are the M side, in
  every warp; each warp owns its own 16 keys of each BLOCK_N = 16 · NUM_WARPS-key tile
  (``TensorCoreDecodeConfig``, ``tc_decode_config``), with its own m_i, l_i and acc.
- The tiles are the SIMT kernel's (``common.kv_loader``: cp.async or plain loads, contiguous or paged,
  16-bit pairs a word, 16 B of padding a row); Q is copied once into the last stage's rows and taken as A fragments
  by ``ldmatrix``.
- S = Q Kᵀ is one ``ldmatrix.x4`` and two mma per 16 head dims; scores, masks, softcap and ALiBi as
  ``kvcache``'s docstring gives them, in fp32 on the accumulators (lane 4 g + t: rows g and g + 8, keys 2 t,
  2 t + 1 of each 8), the row max over each quad (``shfl_xor``), ``exp2_approx``.
- P V with P's A fragment straight from S's accumulators (rounded to 16 bits) and V's B fragments by
  ``ldmatrix.x4.trans``.
- After the last tile the warps' states are merged as the combine merges splits (warps 1 .. hand their
  rescaled acc to warp 0 through the tiles' rows), and warp 0 writes O and L in the SIMT kernel's layouts
  (partial fp32 O and base-2 L per split for ``kvcache_combine``, or O and natural L).

Compiled once per (padded head dim: 32, 64 or 128, ``TensorCoreDecodeConfig``, ``common.Features``, cache
kind, split or not, bf16 or fp16, head_dim == padded, cp.async or plain loads, page size) and cached (``kernel``). Under
numba's simulator it runs on ``mma.py``'s Python emulation of the instructions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from numba import cuda

from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    SHARED_ALIGN,
    alibi,
    float32,
    float_as_int,
    float_to_bf16,
    identity,
    int32,
    int_as_float,
    jit_kernel,
    kv_loader,
    sequence,
    simulated,
    softcap,
    uint32,
    uint64,
    with_sink,
)
from fa2_numba_cuda.launch import PORTABLE_SHARED_BYTES
from fa2_numba_cuda.mma import (
    cp_async_commit,
    cp_async_wait_group,
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


class TensorCoreDecodeConfig(NamedTuple):
    """The tensor-core split kernel's block: NUM_WARPS warps, each with the same BLOCK_M = 16 query rows (the
    M side of ``mma.m16n8k16``) and its own 16 keys of every BLOCK_N = 16 · NUM_WARPS-key tile; MAX_REGISTERS
    caps ptxas (it bounds the blocks an SM holds, which ``num_splits_heuristic`` counts on); STAGES key tiles
    of K and V in shared memory, STAGES - 1 of them in flight while the block computes one (in dynamic shared
    memory where the stages pass static shared memory's 48 KB: ``dynamic_shared_bytes``)."""

    NUM_WARPS: int
    MAX_REGISTERS: int
    STAGES: int = 2


def tc_decode_config(HEAD_DIM: int) -> TensorCoreDecodeConfig:
    """The tensor-core block for a padded head dim (32, 64 or 128): two stages (STAGES) of K and V tiles and
    their 16 B row padding, Q and the warps' final merge reusing them::

        HEAD_DIM   warps   keys a tile   shared memory
        32, 64     4       64            20,992, 37,376 B (static, as ptxas reports it)
        128        4       64            70,144 B (dynamic: over the 48 KB a block may have statically)

    Registers per thread (fragments: fp32 O HEAD_DIM / 2, Q HEAD_DIM / 4, S 8): capped at 128 up to HEAD_DIM
    64 and at 176 at 128, where ptxas (CUDA 13.0, sm_90, offline) needs no spill. At 128, four warps against
    two (32-key tiles in 35,072 B of static shared memory, the default until then) ran three of the decode
    benchmark's points on the H200 (bf16, 32/8 heads, one query token, contiguous; .whl probe
    numba_cfg_probe.py, numba's code at 02a29c6) at 0.87-0.90x fa2-triton's rate instead of 0.61-0.71x: 8 x 8k
    keys 90.9 µs against 131.6, 1 x 128k 167.0 against 213.5, 8 x 32k 285.3 against 360.3; three or four stages
    of two warps 0.69-0.87x, a cap of 128 registers 0.47-0.54x. The whole decode benchmark at 6643533 (one and
    four query tokens, contiguous and paged caches, 8 x 8k to 64 x 4k): 0.81-1.10x fa2-triton's rate.
    """
    if HEAD_DIM <= 64:
        return TensorCoreDecodeConfig(4, 128)
    return TensorCoreDecodeConfig(4, 176)


def shared_bytes(HEAD_DIM: int, config: TensorCoreDecodeConfig) -> int:
    """Shared memory of a tensor-core decode block, static and dynamic (``_build_kernel``'s arrays)."""
    return 4 * (2 * config.STAGES * 16 * config.NUM_WARPS * (HEAD_DIM // 2 + 4) + 2 * 16 * config.NUM_WARPS)


def dynamic_shared_bytes(HEAD_DIM: int, config: TensorCoreDecodeConfig) -> int:
    """The launch's dynamic shared memory: the stages' K and V tiles where all the block's arrays pass the 48 KB
    of static shared memory a block may have, else 0 (the tiles static too)."""
    if shared_bytes(HEAD_DIM, config) <= PORTABLE_SHARED_BYTES:
        return 0
    return 4 * 2 * config.STAGES * 16 * config.NUM_WARPS * (HEAD_DIM // 2 + 4)


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
    IS_BF16,
    EVEN_HEAD_DIM,
    ASYNC_LOADS,
    PAGE_SIZE,
):
    """The split-KV kernel on tensor cores, for fp16 / bf16 and a padded head dim of 32, 64 or 128, with the
    switches of ``kvcache_simt._build_kernel`` (PAGE_SIZE too) and its arguments (q as 16-bit patterns);
    ``TensorCoreDecodeConfig``."""
    NUM_WARPS, MAX_REGISTERS, STAGES = config
    NUM_THREADS = 32 * NUM_WARPS
    BLOCK_M = 16  # query rows of a block: the group · seqlen_q rows of a (batch, key/value head), in tiles of 16
    BLOCK_N = 16 * NUM_WARPS  # keys a tile, 16 a warp
    LDW = HEAD_DIM // 2 + 4  # words a shared row: 16 B of padding, so that ldmatrix's 8 row addresses miss banks
    CH = HEAD_DIM // 8  # 16 B chunks a row
    ROW_STEP = NUM_THREADS // CH  # tile rows one pass of the loader covers
    D_STEPS = HEAD_DIM // 16  # k steps of S = Q Kᵀ; pairs of 8-column tiles of O
    O_TILES = HEAD_DIM // 8  # 8-column C tiles of O
    Q_ROW = (STAGES - 1) * 2 * BLOCK_N  # Q's 16 rows, before the loop, in the last stage's K rows
    KV_ROWS = 2 * STAGES * BLOCK_N  # STAGES stages of K then V
    KV_WORDS = KV_ROWS * LDW
    IN_FLIGHT = STAGES - 1  # groups of copies left in flight by a tile's wait (a constant of the instruction)
    DYNAMIC = dynamic_shared_bytes(HEAD_DIM, config) > 0
    WARP_ROWS = BLOCK_M * NUM_WARPS
    assert HEAD_DIM % 16 == 0 and NUM_THREADS % CH == 0 and BLOCK_N % ROW_STEP == 0
    assert (NUM_WARPS - 1) * 32 <= KV_ROWS and 4 * O_TILES <= LDW  # the warps' merge fits the tiles' rows
    kind = "bf16" if IS_BF16 else "f16"
    mma = mma_bf16 if IS_BF16 else mma_f16
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    from_float = float_to_bf16 if IS_BF16 else identity
    assert PAGED == (PAGE_SIZE > 0)
    PAGE_READS, page_ids, load_kv = kv_loader(BLOCK_N, ROW_STEP, LDW, kind, PAGE_SIZE, EVEN_HEAD_DIM, ASYNC_LOADS, True)

    def _kvcache_fwd_tc(
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
        """One block: 16 of the group · seqlen_q query rows of one (split, batch, key/value head), as
        ``_kvcache_fwd`` of ``kvcache_simt`` (the same arguments, q, k and v as 16-bit patterns)."""
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

        # The key range, as the SIMT kernel's (``kvcache``'s docstring).
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

        # [STAGES, K V, BLOCK_N, HEAD_DIM] as rows of LDW words, row r at word r · LDW
        if DYNAMIC:
            kv_tile = cuda.shared.array(0, int32, alignment=SHARED_ALIGN)  # the launch's dynamic size
        else:
            kv_tile = cuda.shared.array(KV_WORDS, int32, alignment=SHARED_ALIGN)
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
                slope_i[h] = slopes[
                    uint64(off_b * stride_ab + (off_hk * group + row // seqlen_q) * stride_ah)
                ] * float32(LOG2E)

        # Q: 16 rows of 16-bit pairs into the last stage's K rows (zeros past the rows and head_dim), then every warp's
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
                kv_tile[uint64((Q_ROW + r) * LDW + c // 2)] = word
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
        # The last stage is written only after the first tile's first barrier, by which every warp has its fragments.

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

        # STAGES stages, tile t + STAGES - 1's copies issued before tile t's are waited for, so that a block waits
        # with STAGES tiles' copies in flight (the SIMT kernel issues tile t + 1's after tile t's wait: one). A
        # group of copies is committed for every tile, empty past the last, so that waiting for all but the
        # STAGES - 1 newest groups is waiting for tile t. The first barrier of a tile frees the stage tile t - 1
        # was read from (and, at the first tile, the last stage's Q rows: every warp has its fragments); the
        # second, after the wait, shows tile t's copies to every warp. A paged cache's page ids for the next
        # tile to copy are read once a tile's copies are issued, and land while the block waits and computes,
        # so that no copy waits on the block table.
        pages = cuda.local.array(PAGE_READS, int32)
        if n_tiles > 0:
            page_ids(pages, lo, block_table, off_b, ld_r, stride_tb, stride_tp, capacity, cache_rows)
        for stage in range(STAGES - 1):
            if stage < n_tiles:
                load_kv(
                    kv_tile,
                    stage * 2 * BLOCK_N,
                    lo + stage * BLOCK_N,
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
                if stage + 1 < n_tiles:
                    page_ids(
                        pages,
                        lo + (stage + 1) * BLOCK_N,
                        block_table,
                        off_b,
                        ld_r,
                        stride_tb,
                        stride_tp,
                        capacity,
                        cache_rows,
                    )
            elif ASYNC_LOADS:
                cp_async_commit()
        for tile in range(n_tiles):
            start_n = lo + tile * BLOCK_N
            k_row = (tile % STAGES) * 2 * BLOCK_N
            ahead = tile + STAGES - 1  # the tile whose copies this one issues
            cuda.syncthreads()
            if ahead < n_tiles:
                load_kv(
                    kv_tile,
                    (ahead % STAGES) * 2 * BLOCK_N,
                    lo + ahead * BLOCK_N,
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
                if ahead + 1 < n_tiles:
                    page_ids(
                        pages,
                        lo + (ahead + 1) * BLOCK_N,
                        block_table,
                        off_b,
                        ld_r,
                        stride_tb,
                        stride_tp,
                        capacity,
                        cache_rows,
                    )
            elif ASYNC_LOADS:
                cp_async_commit()
            if ASYNC_LOADS:
                cp_async_wait_group(IN_FLIGHT)
            cuda.syncthreads()

            # S = Q Kᵀ on the warp's 16 keys: per 16 head dims one ldmatrix (two 8-key B fragments), two mma.
            for j in range(2):
                for e in range(4):
                    s[j, e] = 0.0
            k_lane = tile_base + uint32(4 * (k_row + 16 * warp + b_row) * LDW + 2 * b_col)
            for kk in range(D_STEPS):
                b0, b1, b2, b3 = ldmatrix_x4(k_lane + uint32(32 * kk))
                d0, d1, d2, d3 = mma(
                    q_frag[kk, 0],
                    q_frag[kk, 1],
                    q_frag[kk, 2],
                    q_frag[kk, 3],
                    b0,
                    b1,
                    s[0, 0],
                    s[0, 1],
                    s[0, 2],
                    s[0, 3],
                )
                s[0, 0] = d0
                s[0, 1] = d1
                s[0, 2] = d2
                s[0, 3] = d3
                d0, d1, d2, d3 = mma(
                    q_frag[kk, 0],
                    q_frag[kk, 1],
                    q_frag[kk, 2],
                    q_frag[kk, 3],
                    b2,
                    b3,
                    s[1, 0],
                    s[1, 1],
                    s[1, 2],
                    s[1, 3],
                )
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
                            score = softcap(score, softcap_log2)
                        if ALIBI:
                            score = alibi(score, slope_i[h], tok_i[h], key, diag)
                        # The mask written out, the row's validity tested second: through common.key_mask, with the
                        # validity tested before or after it, ptxas gives these kernels other code (offline, sm_90:
                        # other instruction counts, and at D64 on tensor cores up to 144 B more spills).
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
                    word = float_as_int(acc[c, e] * alpha[e // 2])
                    kv_tile[uint64(((warp - 1) * 32 + lane) * LDW + 4 * c + e)] = word
        cuda.syncthreads()
        if warp == 0:
            for c in range(O_TILES):
                for e in range(4):
                    value = acc[c, e] * alpha[e // 2]
                    for w in range(1, NUM_WARPS):
                        value += int_as_float(kv_tile[uint64(((w - 1) * 32 + lane) * LDW + 4 * c + e)])
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
                    m_row = m_safe[h]
                    if SINK:
                        # The sink joins the denominator: O = acc · alpha / l, L = m + log2 l (l >= 1). A row
                        # that saw no key has m_safe = 0, l = 0 and acc = 0: O = 0, L = sink.
                        m_row, l_sum, alpha_row = with_sink(m_row, l_sum, sink[off_h] * float32(LOG2E))
                        inv_l = alpha_row / l_sum
                    else:
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
                            L = (m_row + math.log2(l_sum)) * float32(LN2) if l_sum != 0.0 else float32(math.inf)
                            lse[uint64(o_row)] = L

    return jit_kernel(_kvcache_fwd_tc, MAX_REGISTERS)


# Compiled kernels by (HEAD_DIM, TensorCoreDecodeConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX,
# LEFTPAD, SPLIT, SINK, IS_BF16, EVEN_HEAD_DIM, ASYNC_LOADS, PAGE_SIZE).
_KERNELS: dict[tuple, object] = {}


def kernel(*key):
    """The split kernel for ``_build_kernel``'s arguments, compiled once."""
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _build_kernel(*key)
    return found


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every tensor-core split
    kernel compiled so far in this process (one row per specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (HEAD_DIM, config, *switches), compiled in _KERNELS.items():
        regs = compiled.get_regs_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": "kvcache-tensor-core",
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    "switches": switches,
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": compiled.get_shared_mem_per_block()[signature],
                    "local_bytes_per_thread": compiled.get_local_mem_per_thread()[signature],
                }
            )
    return rows
