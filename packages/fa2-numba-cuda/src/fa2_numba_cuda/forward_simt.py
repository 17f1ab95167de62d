"""FlashAttention-2 forward as a numba-cuda kernel on CUDA cores (SIMT, fp32 arithmetic): what
``fa2_numba_cuda.forward.flash_attn_forward`` runs for fp32, head_dim > 128, older GPUs and the simulator.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1, as in ``fa2_pytorch.forward``: one block per
(query tile, batch·head) keeps, for each of its BLOCK_M query rows, a running max ``m_i``, a running sum
``l_i`` and an unnormalised accumulator ``acc``; for each BLOCK_N-key tile it rescales both by
``alpha = exp(m_old - m_new)``, adds ``p = exp(S - m_new)`` and ``p V``; at the end it divides once and
writes O and L = m + log(l), each once. Scores are kept in base 2 (Q is pre-scaled by ``qk_scale = scale ·
log2 e``, then ``exp2``, a single MUFU instruction) and L is converted back to the natural log on the way out.

The block, THREADS_M x THREADS_N threads (``common.BlockConfig``, chosen per head dim by ``block_config``):

- shared memory, fp32, every row padded by 4 floats (16 B aligned rows; with THREADS_N = 8 or 16 the
  4-float loads of a warp hit distinct banks): ``q_tile`` [BLOCK_M, HEAD_DIM] once per block; ``k_tile``
  and ``v_tile`` [BLOCK_N, HEAD_DIM] per key tile (with SHARE_KV one buffer, V loaded once S is done);
  ``p_tile`` [BLOCK_M, BLOCK_N]; ``row_part`` [BLOCK_M, THREADS_N], the partial row max (per tile) and row
  sum (at the end) of the THREADS_N threads that share a row, reduced through shared memory (numba's
  simulator has no warp shuffles). All of it fits the 48 KB of static shared memory.
- registers (``cuda.local.array`` of compile-time sizes, indexed only by loops over constants, which LLVM
  unrolls, so that they live in registers): thread (ty, tx) owns rows ``ty + THREADS_M·i`` (i < TM) of S,
  P and O; S's keys ``tx + THREADS_N·j`` (j < TN); O's columns ``4·tx + 4·THREADS_N·jj + e`` (jj < TD / 4,
  e < 4). S's micro-tile is fed S_STEP head-dim columns a step, O's 4 keys a step, by 16 B shared loads.
- ``l_i`` is a per-thread partial sum over the thread's own keys (all threads of a row share ``m_i``, so the
  partials rescale alike); the row's THREADS_N partials are added once, after the last tile.
- shared-memory indices are cast to uint64: numba wraps negative signed indices, a select per access that
  would keep LLVM from merging the 4-float loads into one ``ld.shared.v4.f32``.

Grouped-query attention (GQA; MQA with one key/value head): k and v may have heads_k heads, heads a multiple
of heads_k; query head h reads key/value head ``off_hk = h // group``, group = heads // heads_k, by index
arithmetic on the head as FlashAttention-2 does (K and V are never repeated or copied). ``group`` is a
runtime argument: one compiled kernel serves every group size.

What is computed comes as an ``fa2.spec.AttentionSpec``; its features are compile-time switches of the kernel
(``common.Features``: window bounded on the left, on the right, softcap, ALiBi; a packed batch, below), their
values runtime arguments (one kernel serves every window size, softcap and slope). Per query row i and key j, with
diag = seqlen_k - seqlen_q, in this order:

- softcap c > 0: Q is pre-scaled by scale / c instead of scale · log2 e, and the score becomes
  tanh(s) · c · log2 e (``tanh``: fp32, from exp2, which runs in the simulator as on the GPU);
- ALiBi: minus slope[b, h] · log2 e · |i + diag - j|, slopes a (batch, heads) fp32 tensor of any strides;
- window (left, right), bottom-right aligned like causal (causal is (-1, 0)): key j is visible iff
  i + diag - left <= j <= i + diag + right. With seqlen_q = 4, seqlen_k = 6 and window (1, 0)::

      0 1 1 0 0 0
      0 0 1 1 0 0
      0 0 0 1 1 0
      0 0 0 0 1 1

  A block visits only the key tiles that hold some key its rows see (``[begin_n, end_n)``), so that the
  cost follows the window; only tiles that cross a window edge or the end of the keys are masked.

A row that sees no key gets O = 0 and L = +inf.

Attention sinks (``spec.sink``, gpt-oss): a logit sink[h] per query head joins every row's softmax denominator
and no numerator, O_i = Σ_j exp(s_ij - L_i) v_j with L_i = log(exp(sink[h]) + Σ_j exp(s_ij)). It changes
nothing in the loop: the epilogue joins it to the row's m_i and l_i (``common.with_sink``, in base 2), so that
a row that sees no key gets O = 0 and L = sink[h]. SINK is a compile-time switch of its own (the score step's
``Features`` are unchanged by it) and the sink the kernel's last argument, read once per row: without SINK
the kernel is the one it was, its other parameters at their offsets.

Packed (variable-length) batches (``spec.varlen``, from ``fa2.varlen_attention``): q is (1, heads, total_q,
head_dim) and k, v (1, heads_k, total_k, head_dim), any strides (views of flash-attn's (total, heads,
head_dim) tensors); sequence s has the queries [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and the keys
[cu_seqlens_k[s], cu_seqlens_k[s + 1]) (int32 offsets on q's device); O is (1, heads, total_q, head_dim), L
(1, heads, total_q). One launch: the grid is that of a dense batch of num_seqs sequences of max_seqlen_q
queries, one block per (query tile, sequence·head). A block reads its sequence's offsets, exits at once if its
tile starts past the sequence's end, and otherwise is the dense block on the sequence's rows with the
sequence's own lengths Nq_s, Nk_s in place of seqlen_q and seqlen_k: the window bottom-right aligned per
sequence (diag = Nk_s - Nq_s), the key tiles it skips, ALiBi's distance, slopes[s, h] (slopes (num_seqs,
heads)), rows that see no key. Nothing is padded, and nothing is read back to the host. VARLEN is one more
compile-time switch (``Features``): without it the offsets are never read and the dense kernel is unchanged
(its PTX differs by two unread parameters). Not checked, as it would need a sync: offsets that decrease (each
block clamps its sequence's rows into the tensor, so that they are wrong, never out of bounds) and sequences
longer than max_seqlen_q (their rows past the grid's tiles are left unwritten).

Inputs: fp32, fp16, or bf16 (passed as its raw 16-bit patterns, an int16 view, and widened in-kernel by a
shift: numba has no bf16 arrays); any strides, nothing copied: the kernel gets flat views of the memory each
tensor spans and its element strides (``stride_qb, stride_qh, stride_qm, stride_qd``, ...). head_dim up
to 256, padded to a multiple of 32 inside the block.

Launch: on torch's current CUDA stream, no host synchronisation; one compiled kernel per (padded head dim,
block shape, Features, bf16 or not, head_dim == padded, unit head-dim strides), built once by
``_build_kernel`` and cached; ``kernel_resources`` reports registers, shared and local memory of each.
Launched through ``launch.prepare``: a class of calls (shapes, strides, dtypes, device, the spec's values, the
config) is launched by numba once, then its packed parameters are kept and each later call of the class writes
its tensors' data pointers and calls cuLaunchKernel (``_PREPARED``). Under numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1) the same kernel runs on CPU tensors, one Python thread per CUDA thread: use tiny
shapes there.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda

from fa2.spec import AttentionSpec
from fa2_numba_cuda import launch
from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    MAX_HEAD_DIM,
    SHARED_ALIGN,
    BlockConfig,
    alibi,
    bf16_to_float,
    check_device,
    feature_args,
    feature_columns,
    features,
    float32,
    float_to_bf16,
    grid_extent,
    identity,
    jit_kernel,
    key_mask,
    offset_args,
    padded_head_dim,
    score_scale,
    sequence,
    simulated,
    sink_arg,
    sink_positions,
    sink_tensors,
    softcap,
    spec_class,
    spec_positions,
    spec_tensors,
    tile_loader,
    to_float32,
    uint64,
    with_sink,
)


def block_config(HEAD_DIM: int) -> BlockConfig:
    """The block shape for a padded head dim: fp32 shared tiles under 48 KB, at least 64 threads. Per thread,
    S's micro-tile (rows x keys) and O's (rows x columns):

        HEAD_DIM   threads   S     O              shared memory
        32, 64     128       4x4   4x4, 4x8       29, 45 KB
        96         64        4x4   4x12           43 KB
        128        128       4x2   4x8            39.5 KB, K and V sharing a buffer
        160-256    64        2x2   2x20 to 2x32   22-34 KB, K and V sharing a buffer
    """
    if HEAD_DIM <= 64:
        return BlockConfig(64, 32, 16, 8, False, 128)
    if HEAD_DIM == 96:
        return BlockConfig(32, 32, 8, 8, False, 128)
    if HEAD_DIM == 128:
        return BlockConfig(32, 32, 8, 16, True, 128)
    return BlockConfig(16, 16, 8, 8, True, 168)


def _build_kernel(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D):
    """The kernel for one padded head dim, block shape, ``Features`` (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN), SINK
    (the epilogue adds the attention sink), input kind, whether head_dim is HEAD_DIM (EVEN_HEAD_DIM: no column
    checks) and whether q, k and v are contiguous along head_dim (UNIT_STRIDE_D: column addresses are constant
    offsets), all compile-time constants."""
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N, SHARE_KV, MAX_REGISTERS = config
    NUM_WARPS = THREADS_M * THREADS_N // 32
    TM = BLOCK_M // THREADS_M  # rows of S, P and O per thread
    TN = BLOCK_N // THREADS_N  # keys of S per thread
    TD = HEAD_DIM // THREADS_N  # head-dim columns of O per thread, in TD // 4 groups of 4
    LD_D = HEAD_DIM + 4  # padded row lengths of the shared tiles
    LD_N = BLOCK_N + 4
    KV_ROWS = BLOCK_N if SHARE_KV else 2 * BLOCK_N
    S_STEP = 32 // TN  # head-dim columns a step of the S loop: 32 x TN fused multiply-adds per row
    assert THREADS_M * THREADS_N % 32 == 0 and BLOCK_M % NUM_WARPS == 0 and BLOCK_N % NUM_WARPS == 0
    assert BLOCK_M % THREADS_M == 0 and BLOCK_N % THREADS_N == 0 and BLOCK_N % 4 == 0 and 32 % TN == 0
    assert HEAD_DIM % (4 * THREADS_N) == 0 and HEAD_DIM % S_STEP == 0

    if IS_BF16:
        to_float, from_float = bf16_to_float, float_to_bf16
    else:
        to_float, from_float = to_float32, identity

    load_tile = tile_loader(HEAD_DIM, NUM_WARPS, EVEN_HEAD_DIM, UNIT_STRIDE_D, to_float)
    masked = key_mask(LEFT, RIGHT)

    def _attn_fwd(
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
        """One block: BLOCK_M query rows of one (batch, head). q: a flat view of a (B, H, N, D) tensor, k, v
        of (B, H // group, N, D) tensors, with the given element strides; o: (B, H, seqlen_q, head_dim) and
        lse: (B, H, seqlen_q), flat, contiguous; o in q's dtype, lse fp32. qk_scale: Q's pre-scale
        (``score_scale``); window_left, window_right, softcap_log2, slopes and their strides: as
        ``feature_args`` gives them, read only where the kernel's Features say so. VARLEN: B = 1, N the
        packed totals, and the block's (tile, sequence·head) reads its sequence's rows from cu_seqlens_q
        and cu_seqlens_k (``offset_args``); num_m_tiles covers max_seqlen_q. sink: (heads,) fp32, natural log,
        read with SINK only (``sink_arg``)."""
        # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
        diag = seqlen_k - seqlen_q
        start_m = (cuda.blockIdx.x % num_m_tiles) * BLOCK_M
        off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        # side-by-side: group
        # GQA: the group's query heads share key/value head off_hk, read in place (no repeated K, V).
        off_hk = off_h // group
        # side-by-side: end
        # side-by-side: varlen
        if VARLEN:
            # Sequence off_b: queries q_start .. q_start + seqlen_q of the packed q (and O, L), keys k_start ..
            # k_start + seqlen_k of k and v; its own lengths (and their diag) stand for seqlen_q and seqlen_k
            # from here on: the window's alignment, ALiBi's distance, the ends of the tiles. A tile past its
            # end exits.
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            o_start = off_h * seqlen_q + q_start  # O's and L's row of the sequence's query 0
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                return
        # side-by-side: end
        tx = cuda.threadIdx.x % THREADS_N
        ty = cuda.threadIdx.x // THREADS_N

        q_tile = cuda.shared.array((BLOCK_M, LD_D), float32, alignment=SHARED_ALIGN)  # [BLOCK_M, HEAD_DIM]
        # K and V tiles: two buffers, or with SHARE_KV one that holds K until S is computed, then V.
        kv_tile = cuda.shared.array((KV_ROWS, LD_D), float32, alignment=SHARED_ALIGN)
        k_tile = kv_tile[:BLOCK_N]  # [BLOCK_N, HEAD_DIM]
        v_tile = kv_tile[KV_ROWS - BLOCK_N :]  # [BLOCK_N, HEAD_DIM]
        p_tile = cuda.shared.array((BLOCK_M, LD_N), float32, alignment=SHARED_ALIGN)  # [BLOCK_M, BLOCK_N]
        row_part = cuda.shared.array((BLOCK_M, THREADS_N), float32, alignment=SHARED_ALIGN)

        # side-by-side: state
        m_i = cuda.local.array(TM, float32)
        l_i = cuda.local.array(TM, float32)
        acc = cuda.local.array((TM, TD), float32)  # [TM, TD] of O's [BLOCK_M, HEAD_DIM]
        s = cuda.local.array((TM, TN), float32)  # [TM, TN] of S's [BLOCK_M, BLOCK_N]
        q_frag = cuda.local.array((TM, S_STEP), float32)
        k_frag = cuda.local.array((TN, S_STEP), float32)
        p_frag = cuda.local.array((TM, 4), float32)
        v_frag = cuda.local.array(TD, float32)
        for i in range(TM):
            m_i[i] = -math.inf
            l_i[i] = 0.0
            for c in range(TD):
                acc[i, c] = 0.0

        if VARLEN:  # the sequence's first rows
            q_offset = off_h * stride_qh + q_start * stride_qm
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
            q_offset = off_b * stride_qb + off_h * stride_qh
        # Q pre-scaled by qk_scale = scale · log2 e (with a softcap c: scale / c): S comes out of the loop
        # ready for exp2 (for tanh).
        load_tile(q_tile, q, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim, qk_scale)
        # ALiBi's slope for this (batch or sequence, head), in base 2.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        # side-by-side: end

        # side-by-side: window
        # The key tiles that hold a key some row of the tile sees: from the first row's left edge to the last
        # row's right edge, clipped to [0, seqlen_k); the others are skipped (causal: window_right = 0).
        begin_n = max(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N if LEFT else 0
        end_n = min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag + window_right) if RIGHT else seqlen_k
        # side-by-side: end

        # side-by-side: loop
        for start_n in range(begin_n, end_n, BLOCK_N):
            cuda.syncthreads()  # the previous tile's k_tile, v_tile and p_tile have been read
            load_tile(k_tile, k, k_offset, stride_kn, stride_kd, start_n, seqlen_k, head_dim, float32(1.0))
            if not SHARE_KV:
                load_tile(v_tile, v, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim, float32(1.0))
            cuda.syncthreads()
            # side-by-side: end

            # side-by-side: scores
            # S = Q K^T: the thread's TM x TN micro-tile, S_STEP head-dim columns a step.
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = 0.0
            for dd in range(HEAD_DIM // S_STEP):
                for i in range(TM):
                    for e in range(S_STEP):
                        q_frag[i, e] = q_tile[uint64(ty + THREADS_M * i), uint64(S_STEP * dd + e)]
                for j in range(TN):
                    for e in range(S_STEP):
                        k_frag[j, e] = k_tile[uint64(tx + THREADS_N * j), uint64(S_STEP * dd + e)]
                for i in range(TM):
                    for j in range(TN):
                        for e in range(S_STEP):
                            s[i, j] += q_frag[i, e] * k_frag[j, e]
            # side-by-side: end

            # side-by-side: softcap
            # Softcap c: Q was pre-scaled by scale / c, so c · log2 e · tanh(s) is the capped score in base 2.
            if SOFTCAP:
                for i in range(TM):
                    for j in range(TN):
                        s[i, j] = softcap(s[i, j], softcap_log2)
            # side-by-side: end

            # side-by-side: alibi
            # ALiBi: minus slope · log2 e times the key's distance from the query's diagonal, |i + diag - j|.
            if ALIBI:
                for i in range(TM):
                    for j in range(TN):
                        row = start_m + ty + THREADS_M * i
                        key = start_n + tx + THREADS_N * j
                        s[i, j] = alibi(s[i, j], slope, row, key, diag)
            # side-by-side: end

            # side-by-side: mask
            # Mask only the tiles that cross the end of the keys or a window edge: the tile's last key past the
            # first row's right edge, or its first key before the last row's left edge.
            if (
                start_n + BLOCK_N > seqlen_k
                or (RIGHT and start_n + BLOCK_N - 1 > start_m + diag + window_right)
                or (LEFT and start_n < start_m + BLOCK_M - 1 + diag - window_left)
            ):
                for i in range(TM):
                    for j in range(TN):
                        row = start_m + ty + THREADS_M * i
                        key = start_n + tx + THREADS_N * j
                        if masked(row, key, diag, seqlen_k, window_left, window_right):
                            s[i, j] = -math.inf
            # side-by-side: end

            # side-by-side: softmax
            # The row max over the tile: the thread's own keys, then the row's THREADS_N threads.
            for i in range(TM):
                m_part = s[i, 0]
                for j in range(1, TN):
                    m_part = max(m_part, s[i, j])
                row_part[ty + THREADS_M * i, tx] = m_part
            cuda.syncthreads()  # and k_tile has been read
            if SHARE_KV:
                load_tile(v_tile, v, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim, float32(1.0))

            for i in range(TM):
                m_new = m_i[i]
                for t in range(THREADS_N):
                    m_new = max(m_new, row_part[uint64(ty + THREADS_M * i), uint64(t)])
                # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
                m_safe = m_new if m_new != -math.inf else float32(0.0)
                alpha = math.exp2(m_i[i] - m_safe)
                l_part = float32(0.0)
                for j in range(TN):
                    p = math.exp2(s[i, j] - m_safe)
                    l_part += p
                    p_tile[ty + THREADS_M * i, tx + THREADS_N * j] = p
                l_i[i] = alpha * l_i[i] + l_part
                for c in range(TD):
                    acc[i, c] *= alpha
                m_i[i] = m_new
            cuda.syncthreads()

            # acc += P V: the thread's TM x TD micro-tile, 4 keys a step.
            for nn in range(BLOCK_N // 4):
                for i in range(TM):
                    for e in range(4):
                        p_frag[i, e] = p_tile[uint64(ty + THREADS_M * i), uint64(4 * nn + e)]
                for e in range(4):
                    for jj in range(TD // 4):
                        for f in range(4):
                            col = 4 * tx + 4 * THREADS_N * jj + f
                            v_frag[4 * jj + f] = v_tile[uint64(4 * nn + e), uint64(col)]
                    for i in range(TM):
                        for c in range(TD):
                            acc[i, c] += p_frag[i, e] * v_frag[c]
            # side-by-side: end

        # side-by-side: epilogue
        # Epilogue: the row sum of the THREADS_N partials, then O = acc / l and L = m + log(l), each once.
        if SINK:  # the head's sink, in base 2 as m_i
            sink_log2 = sink[off_h] * float32(LOG2E)
        if not VARLEN:
            o_start = off_bh * seqlen_q  # O's and L's row of query 0 of this (batch, head)
        cuda.syncthreads()
        for i in range(TM):
            row_part[ty + THREADS_M * i, tx] = l_i[i]
        cuda.syncthreads()
        for i in range(TM):
            row = start_m + ty + THREADS_M * i
            l_sum = float32(0.0)
            for t in range(THREADS_N):
                l_sum += row_part[uint64(ty + THREADS_M * i), uint64(t)]
            if row < seqlen_q:
                if SINK:
                    # The sink joins the denominator: O = acc · alpha / l, L = m + log2 l (l >= 1).
                    m_row, l_sum, alpha = with_sink(m_i[i], l_sum, sink_log2)
                    inv_l = alpha / l_sum
                else:
                    # Rows that saw no key have l = 0: O = 0 and L = +inf (see fa2.attention). A NaN score
                    # makes l NaN, and O and L must then be NaN, not the no-key marker: != 0, not > 0.
                    m_row = m_i[i]
                    inv_l = float32(1.0) / l_sum if l_sum != 0.0 else float32(0.0)
                o_row = (o_start + row) * head_dim
                for jj in range(TD // 4):
                    for f in range(4):
                        col = 4 * tx + 4 * THREADS_N * jj + f
                        if EVEN_HEAD_DIM or col < head_dim:
                            o[uint64(o_row + col)] = from_float(acc[i, 4 * jj + f] * inv_l)
                if tx == 0:
                    L = (m_row + math.log2(l_sum)) * LN2 if l_sum != 0.0 else math.inf
                    lse[uint64(o_start + row)] = L
        # side-by-side: end

    return jit_kernel(_attn_fwd, MAX_REGISTERS)


# Compiled kernels by (HEAD_DIM, BlockConfig, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16, EVEN_HEAD_DIM,
# UNIT_STRIDE_D).
_KERNELS: dict[tuple, object] = {}
# Prepared launches (``launch.prepare``) by class of call: q's, k's and v's shapes, strides and dtypes, the
# device, the spec's values (``spec_class``), the config: everything the kernel, its grid and its arguments
# other than the tensors' memory are functions of.
_PREPARED: dict[tuple, object] = {}


def _kernel(*key):
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _build_kernel(*key)
    return kernel


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    config: BlockConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SIMT kernel's launch: arguments and returns as ``fa2_numba_cuda.forward.flash_attn_forward``
    (fp32, fp16 or bf16, head_dim up to 256); config: the block shape, for tuning; default
    ``block_config(padded_head_dim(head_dim))``."""
    key = None
    if launch.FAST:  # a call of a class met before: the kernel's parameters are packed, only pointers change
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
            spec_class(spec),
            None if config is None else tuple(config),
        )
        prepared = _PREPARED.get(key)
        if prepared is not None:
            O = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            L = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            prepared(q, k, v, O, L, *spec_tensors(spec), *sink_tensors(spec))
            return O, L
    batch, heads, seqlen_q, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(f"fa2-numba-cuda supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}")
    check_device(q)
    O = torch.empty(batch, heads, seqlen_q, head_dim, dtype=q.dtype, device=q.device)
    L = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if O.numel() == 0:
        return O, L

    HEAD_DIM = padded_head_dim(head_dim)
    config = BlockConfig(*config) if config is not None else block_config(HEAD_DIM)
    unit_stride_d = q.stride(3) == k.stride(3) == v.stride(3) == 1
    is_bf16, even_head_dim = q.dtype == torch.bfloat16, head_dim == HEAD_DIM
    kernel = _kernel(HEAD_DIM, config, *features(spec), spec.sink is not None, is_bf16, even_head_dim, unit_stride_d)
    # Packed: one block per (query tile of the longest sequence, sequence·head); the others' extra tiles exit.
    grid_batch, grid_seqlen_q, _ = grid_extent(spec, q, k)
    num_m_tiles = -(-grid_seqlen_q // config.BLOCK_M)
    group = heads // k.shape[1]  # query heads per key/value head (the interface checked the division)
    grid, block = num_m_tiles * grid_batch * heads, config.THREADS_M * config.THREADS_N
    if grid == 0:
        return O, L
    head = (
        q,
        k,
        v,
        O,
        L,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        heads,
        group,
        seqlen_q,
        k.shape[2],
        head_dim,
        np.float32(score_scale(spec)),
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
    """Registers and local memory per thread, static shared memory per block, of every kernel compiled so
    far in this process (one row per compiled specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (HEAD_DIM, config, *switches, SINK, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D), kernel in _KERNELS.items():
        regs = kernel.get_regs_per_thread()
        shared = kernel.get_shared_mem_per_block()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    **feature_columns(switches),
                    "sink": SINK,
                    "bf16": IS_BF16,
                    "even_head_dim": EVEN_HEAD_DIM,
                    "unit_stride_d": UNIT_STRIDE_D,
                    "signature": ", ".join(str(t) for t in signature),
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": shared[signature],
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
