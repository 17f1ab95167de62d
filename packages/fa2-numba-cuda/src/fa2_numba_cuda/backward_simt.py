"""FlashAttention-2 backward as numba-cuda kernels on CUDA cores (SIMT, fp32 arithmetic), for every input.

The FA2 paper's Algorithm 2 in FA2's two-kernel split, as ``fa2_triton.backward_tl``. From L, each tile's
probabilities are recomputed instead of stored, P = exp(S - L), and

    delta  = rowsum(dO ∘ O)              _attn_bwd_preprocess: once, fp32
    dsink  = -Σ exp(sink - L) ∘ delta    with an attention sink (SINK): each preprocess block's share
                                         over its rows, then each head's shares summed by torch in a
                                         fixed order (``sink_gradient``); L includes the sink, so the
                                         kernels below are those without one
    dV_j  += Pᵀ dO_i                     dP = dO_i V_jᵀ
    dS     = P ∘ (dP - delta_i)
    dK_j  += scale · dSᵀ Q_i             _attn_bwd_dkdv: one block per (key tile, batch·key/value head),
                                         looping over its group's query heads and the query tiles that
                                         see the key tile
    dQ_i  += scale · dS K_j              _attn_bwd_dq: one block per (query tile, batch·head), looping
                                         over the key tiles the query tile sees

Every block writes its own rows of dK, dV or dQ once: no atomics, so the result is deterministic. The
price is computing S, P and dP twice (once per kernel), as FA2's own split does.

Grouped-query attention (GQA; MQA with one key/value head): k and v have heads_k heads, heads a multiple of
heads_k, group = heads // heads_k. Query head h reads key/value head ``off_hk = h // group`` in place (K and
V are never repeated). dK and dV of head off_hk are the sums over its group's query heads: the dK/dV block
of (key tile, batch·off_hk) runs its query loop once per query head of the group, accumulating into the
same registers, so that dk and dv are still written once per element and have k's and v's shapes. delta
stays per query head. ``group`` is a runtime argument: one compiled kernel serves every group size.

Scores live in the log2 domain as in the forward (the operand used only for S is pre-scaled by ``qk_scale
= scale · log2 e``, L is read as L · log2 e): P = exp2(S' - L'). A row that saw no key has L = +inf, so P =
exp2(finite - inf) = 0 there and it gets zero gradients; query rows past seqlen_q are read with L = +inf
for the same effect. The scores are recomputed as the forward computes them (``common.Features``, the same
compile-time switches): softcap c (the operand pre-scaled by scale / c, then
tanh · c · log2 e), ALiBi's bias, then the window's mask (keys past seqlen_k, and keys outside the window)
set to -inf before exp2, only on the tiles that cross the end of the keys or a window edge. With a
softcap, dS is multiplied by the cap's derivative, 1 - tanh², before dq = scale · dS K and dk = scale · dSᵀ
Q; ALiBi adds nothing to dS, and the slopes get no gradient.

The window skips whole tiles (causal is the window (-1, 0)): the dK/dV loop visits only the query tiles
[begin_m, end_m) that see some key of its tile (query i sees key j iff j - diag - right <= i <= j - diag +
left), the dQ loop only the key tiles its tile sees, as the forward's.

Packed (variable-length) batches (``spec.varlen``), as ``fa2_numba_cuda.forward_simt``: q, O, dO (1, heads,
total_q, head_dim), L (1, heads, total_q), k, v (1, heads_k, total_k, head_dim), sequence s the rows
[cu_seqlens_q[s], cu_seqlens_q[s + 1]) of the first and [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of k and v.
Still three launches, each one grid over all sequences, sized by max_seqlen_q / max_seqlen_k, with no host
sync: delta is per row, so the preprocess runs on the packed rows as on one sequence of total_q; a dK/dV
block takes one key tile of one sequence (its key/value head's group of query heads, over that sequence's
query tiles that see it), a dQ block one query tile of one sequence (over its key tiles); each reads its
sequence's offsets, exits where its tile starts past the sequence's end, and runs with the sequence's own
lengths, so that the window (its skipped tiles), ALiBi (slopes[s, h]) and rows or keys that nothing sees (zero
gradients) are per sequence. A key tile of a sequence without queries writes dk = dv = 0. VARLEN is a
compile-time switch of the same ``Features``: the dense kernels never read the offsets.

Both main kernels are the forward's block (``fa2_numba_cuda.forward_simt``) with other operands: padded
fp32 shared tiles loaded by the forward's ``load_tile`` (``common.tile_loader``), register micro-tiles
indexed only by loops over constants, 4-float shared loads through uint64 indices, row statistics in
registers.

- ``_attn_bwd_dkdv`` works transposed (Sᵀ, Pᵀ, dPᵀ, dSᵀ: [BLOCK_N, BLOCK_M]), so that Pᵀ and dSᵀ are the
  left operands of their products: THREADS_N x THREADS_M threads, thread (ty, tx) owns keys ``ty +
  THREADS_N·i`` (i < TN) of every tile and of dk, dv; queries ``tx + THREADS_M·j`` (j < TM) of Sᵀ and dPᵀ;
  dk's and dv's columns ``4·tx + 4·THREADS_M·jj + f``. Shared: ``k_tile`` (pre-scaled) and ``v_tile`` for
  the whole block; ``q_tile`` and ``do_tile`` a step (with SHARE_QDO one buffer: Q, then dO, then Q again
  for dK); ``pT_tile`` and ``dsT_tile``.
- ``_attn_bwd_dq`` is the forward's layout (``BlockConfig``): ``q_tile`` (pre-scaled) and ``do_tile`` for
  the whole block; ``v_tile`` and ``k_tile`` a step (with SHARE_KV one buffer: V for dP, then K for S and
  dQ, with no reload); ``ds_tile``.

Inputs as the forward's: fp32, fp16, or bf16 (as int16 bit patterns); any strides; head_dim up to 256; kernels
compiled once per specialisation and launched on torch's current CUDA stream, through ``launch.prepare``: a
class of calls (shapes, strides, dtypes, device, the spec's values, the config) is launched by numba once,
then its packed parameters are kept and each later call of the class writes its tensors' data pointers and
calls cuLaunchKernel (``_PREPARED``); numba's CUDA simulator runs them on CPU tensors (use tiny shapes there).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda

from fa2.spec import AttentionSpec
from fa2_numba_cuda import launch
from fa2_numba_cuda.common import (
    LOG2E,
    MAX_HEAD_DIM,
    SHARED_ALIGN,
    BlockConfig,
    alibi,
    bf16_to_float,
    check_device,
    dsink_arg,
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
    spec_class,
    spec_positions,
    spec_tensors,
    tanh,
    tile_loader,
    to_float32,
    uint64,
)
from fa2_numba_cuda.mma import shfl_xor

# The preprocess kernel: PRE_BLOCK_M rows a block, one warp per row at a time, lanes along head_dim.
PRE_BLOCK_M = 32
PRE_WARPS = 4


class DkDvConfig(NamedTuple):
    """The dK/dV kernel's block: THREADS_N x THREADS_M threads; BLOCK_N keys held for the whole block,
    BLOCK_M queries a step. Each thread owns BLOCK_N / THREADS_N keys, BLOCK_M / THREADS_M queries of Sᵀ
    and HEAD_DIM / THREADS_M columns of dk and dv. SHARE_QDO: Q and dO take turns in one shared buffer (Q
    loaded twice a step) where two would not fit in the 48 KB of static shared memory. MAX_REGISTERS caps
    ptxas, as in the forward's ``BlockConfig``."""

    BLOCK_N: int
    BLOCK_M: int
    THREADS_N: int
    THREADS_M: int
    SHARE_QDO: bool
    MAX_REGISTERS: int


def bwd_block_config(HEAD_DIM: int) -> tuple[DkDvConfig, BlockConfig]:
    """The blocks of the dK/dV kernel and of the dQ kernel for a padded head dim: fp32 shared tiles under
    48 KB, 128 threads. Per thread, the score micro-tiles (rows x columns) and the accumulators' (rows x
    columns, dk and dv alike), and static shared memory per block:

        HEAD_DIM   dK/dV kernel                          dQ kernel
        32, 64     2x4, 2x4 to 2x8          27, 43 KB    2x4, 2x4 to 2x8          22.5, 38.5 KB
        96         2x4, 2x12, Q/dO sharing  46.5 KB      2x4, 2x12, K/V sharing   42 KB
        128        2x2, 2x16, Q/dO sharing  46.3 KB      2x2, 2x8, K/V sharing    35.3 KB
        160-256    1x1, 1x20 to 1x32, Q/dO  27-42 KB     1x1, 1x20 to 1x32, K/V   26-41 KB

    ptxas for sm_90, 128 registers at most (4 blocks per SM, as many as shared memory allows at HEAD_DIM
    96 and 128): no spills, except 12 to 44 bytes in the dK/dV kernel at HEAD_DIM 96, 128 and 256 (a few
    hundred where head_dim is padded and q, k, v, dO are not contiguous along it).
    """
    if HEAD_DIM <= 64:
        return DkDvConfig(32, 32, 16, 8, False, 128), BlockConfig(32, 32, 16, 8, False, 128)
    if HEAD_DIM == 96:
        return DkDvConfig(32, 32, 16, 8, True, 128), BlockConfig(32, 32, 16, 8, True, 128)
    if HEAD_DIM == 128:
        return DkDvConfig(32, 16, 16, 8, True, 128), BlockConfig(16, 32, 8, 16, True, 128)
    return DkDvConfig(16, 8, 16, 8, True, 128), BlockConfig(16, 8, 16, 8, True, 128)


def _converters(IS_BF16):
    """(to_float, from_float): bf16 as int16 bit patterns, fp16 and fp32 as themselves."""
    return (bf16_to_float, float_to_bf16) if IS_BF16 else (to_float32, identity)


def _build_preprocess(HEAD_DIM, IS_BF16, EVEN_HEAD_DIM, SINK):
    """delta = rowsum(dO ∘ O), fp32, for one padded head dim and input kind; SINK: also each block's share of
    the attention sink's gradient (``launch_preprocess``)."""
    to_float, _ = _converters(IS_BF16)
    assert PRE_BLOCK_M == 32  # the rows' totals are one warp's lanes (SINK adds them up by shuffles)

    def _attn_bwd_preprocess(
        o,
        do,
        delta,
        stride_ob,
        stride_oh,
        stride_om,
        stride_od,
        stride_dob,
        stride_doh,
        stride_dom,
        stride_dod,
        heads,
        seqlen_q,
        head_dim,
        num_m_tiles,
        lse,
        stride_lb,
        stride_lh,
        stride_lm,
        dsink,
        sink,
    ):
        """One block: PRE_BLOCK_M query rows of one (batch, head); delta: (B·H, seqlen_q), flat. Warp w
        takes rows w, w + PRE_WARPS, ...; lane l the columns l, l + 32, ...; the 32 partial sums of a row
        are added through shared memory. SINK: lse (B, H, seqlen_q) fp32, natural log, with its element
        strides, and sink (H,) fp32 are read, and the block writes -Σ_rows exp(sink[h] - L_row) · delta_row
        to dsink (H, B · num_m_tiles), flat, at [h, b · num_m_tiles + tile]; without SINK the last six
        arguments are unread (``launch_preprocess``)."""
        tile_m = cuda.blockIdx.x % num_m_tiles
        start_m = tile_m * PRE_BLOCK_M
        off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads
        off_h = off_bh % heads
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        # 33 columns: the thread that adds up a row reads it without bank conflicts.
        row_part = cuda.shared.array((PRE_BLOCK_M, 33), float32)

        o_offset = off_b * stride_ob + off_h * stride_oh
        do_offset = off_b * stride_dob + off_h * stride_doh
        for rr in range(PRE_BLOCK_M // PRE_WARPS):
            r = warp + PRE_WARPS * rr
            row = start_m + r
            part = float32(0.0)
            if row < seqlen_q:
                for cc in range(HEAD_DIM // 32):
                    c = lane + 32 * cc
                    if EVEN_HEAD_DIM or c < head_dim:
                        o_c = to_float(o[uint64(o_offset + row * stride_om + c * stride_od)])
                        do_c = to_float(do[uint64(do_offset + row * stride_dom + c * stride_dod)])
                        part += o_c * do_c
            row_part[r, lane] = part
        cuda.syncthreads()
        if cuda.threadIdx.x < PRE_BLOCK_M:
            r = cuda.threadIdx.x
            total = float32(0.0)
            if start_m + r < seqlen_q:
                for t in range(32):
                    total += row_part[r, t]
                delta[uint64(off_bh * seqlen_q + start_m + r)] = total
            # side-by-side: dsink
            if SINK:
                # exp(sink[h] - L) is the weight the sink took in the row (0 where L = +inf); rows past
                # seqlen_q add 0.
                share = float32(0.0)
                if start_m + r < seqlen_q:
                    lse_r = lse[uint64(off_b * stride_lb + off_h * stride_lh + (start_m + r) * stride_lm)]
                    share = math.exp(sink[off_h] - lse_r) * total
                # The block's rows are warp 0's lanes: shuffles add their shares in a fixed order, and one value
                # per block goes out, at [h, b · tiles + tile] for a fixed-order sum over each head's row.
                for b in range(5):
                    share += shfl_xor(share, 1 << b)
                if r == 0:
                    dsink[uint64(off_h * (cuda.gridDim.x // heads) + off_b * num_m_tiles + tile_m)] = -share
            # side-by-side: end

    return jit_kernel(_attn_bwd_preprocess, 128)


def _build_dkdv(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D):
    """The dK/dV kernel for one padded head dim, block shape, ``Features`` (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN),
    input kind, whether head_dim is HEAD_DIM and whether q, k, v and dO are contiguous along head_dim, all
    compile-time constants."""
    BLOCK_N, BLOCK_M, THREADS_N, THREADS_M, SHARE_QDO, MAX_REGISTERS = config
    NUM_WARPS = THREADS_N * THREADS_M // 32
    TN = BLOCK_N // THREADS_N  # keys of Sᵀ, dPᵀ, dk and dv per thread
    TM = BLOCK_M // THREADS_M  # queries of Sᵀ and dPᵀ per thread
    TD = HEAD_DIM // THREADS_M  # head-dim columns of dk and dv per thread, in TD // 4 groups of 4
    LD_D = HEAD_DIM + 4  # padded row lengths of the shared tiles
    LD_M = BLOCK_M + 4
    QDO_ROWS = BLOCK_M if SHARE_QDO else 2 * BLOCK_M
    D_ROWS = 2 * BLOCK_N + QDO_ROWS  # rows of the head-dim tiles: K, V, Q and dO
    PDS_ROWS = 2 * BLOCK_N  # rows of the query-wide tiles: Pᵀ and dSᵀ
    S_STEP = 32 // TM  # head-dim columns a step of the Sᵀ and dPᵀ loops
    assert THREADS_N * THREADS_M % 32 == 0 and BLOCK_M % NUM_WARPS == 0 and BLOCK_N % NUM_WARPS == 0
    assert BLOCK_N % THREADS_N == 0 and BLOCK_M % THREADS_M == 0 and BLOCK_M % 4 == 0 and 32 % TM == 0
    assert HEAD_DIM % (4 * THREADS_M) == 0 and HEAD_DIM % S_STEP == 0

    to_float, from_float = _converters(IS_BF16)
    load_tile = tile_loader(HEAD_DIM, NUM_WARPS, EVEN_HEAD_DIM, UNIT_STRIDE_D, to_float)
    masked = key_mask(LEFT, RIGHT)

    def _attn_bwd_dkdv(
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
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        num_n_tiles,
        cu_seqlens_q,
        cu_seqlens_k,
    ):
        """One block: BLOCK_N keys of one (batch, key/value head), for the group's query heads. q, do: flat
        views of (B, H, N, D) tensors, k, v of (B, H // group, N, D) tensors, lse of (B, H, seqlen_q), with
        the given element strides; delta: (B·H, seqlen_q), fp32; dk, dv: (B, H // group, seqlen_k,
        head_dim), flat, contiguous, in k's dtype. qk_scale: K's pre-scale (``score_scale``); the window,
        softcap and slopes arguments as ``feature_args`` gives them. VARLEN: B = 1, N the packed totals, and
        the block's (key tile, sequence·key/value head) reads its sequence's rows from cu_seqlens_q and
        cu_seqlens_k (``offset_args``); num_n_tiles covers max_seqlen_k."""
        # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
        diag = seqlen_k - seqlen_q
        # Key tiles fastest: under causal the first key tiles are seen by the most query rows, so the
        # longest blocks start first.
        start_n = (cuda.blockIdx.x % num_n_tiles) * BLOCK_N
        # One block per (key tile, batch·key/value head): off_hk's group of query heads is looped over below.
        heads_k = heads // group
        off_bhk = cuda.blockIdx.x // num_n_tiles
        off_b = off_bhk // heads_k  # the batch; with VARLEN the sequence
        off_hk = off_bhk % heads_k
        if VARLEN:
            # Sequence off_b: keys k_start .. k_start + seqlen_k of the packed k, v (and dk, dv), queries
            # q_start .. q_start + seqlen_q of q, dO, L and delta; its own lengths (and their diag) stand for
            # seqlen_q and seqlen_k from here on. A key tile past its end exits.
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k_s = sequence(cu_seqlens_k, off_b, seqlen_k)
            dkv_start = off_hk * seqlen_k + k_start  # dk's and dv's row of the sequence's key 0
            total_q = seqlen_q
            seqlen_q, seqlen_k = seqlen_q_s, seqlen_k_s
            diag = seqlen_k - seqlen_q
            if start_n >= seqlen_k:
                return
        tx = cuda.threadIdx.x % THREADS_M
        ty = cuda.threadIdx.x // THREADS_M

        # The tiles are row ranges of two shared arrays (one per row length: the simulator pays for each
        # shared array a thread declares). Q and dO: two tiles, or with SHARE_QDO one that holds Q, then dO,
        # then Q again.
        d_tiles = cuda.shared.array((D_ROWS, LD_D), float32, alignment=SHARED_ALIGN)
        k_tile = d_tiles[:BLOCK_N]  # [BLOCK_N, HEAD_DIM]
        v_tile = d_tiles[BLOCK_N : 2 * BLOCK_N]  # [BLOCK_N, HEAD_DIM]
        q_tile = d_tiles[2 * BLOCK_N : 2 * BLOCK_N + BLOCK_M]  # [BLOCK_M, HEAD_DIM]
        do_tile = d_tiles[D_ROWS - BLOCK_M :]  # [BLOCK_M, HEAD_DIM]
        m_tiles = cuda.shared.array((PDS_ROWS, LD_M), float32, alignment=SHARED_ALIGN)
        pT_tile = m_tiles[:BLOCK_N]  # [BLOCK_N, BLOCK_M]
        dsT_tile = m_tiles[BLOCK_N:]  # [BLOCK_N, BLOCK_M]

        dk_acc = cuda.local.array((TN, TD), float32)  # [TN, TD] of dK's [BLOCK_N, HEAD_DIM]
        dv_acc = cuda.local.array((TN, TD), float32)  # [TN, TD] of dV's [BLOCK_N, HEAD_DIM]
        sT = cuda.local.array((TN, TM), float32)  # [TN, TM] of Sᵀ's [BLOCK_N, BLOCK_M]
        dpT = cuda.local.array((TN, TM), float32)  # [TN, TM] of dPᵀ's [BLOCK_N, BLOCK_M]
        dcapT = cuda.local.array((TN, TM), float32)  # softcap: 1 - tanh² of Sᵀ's raw scores
        lse_m = cuda.local.array(TM, float32)  # L · log2 e of the thread's queries
        delta_m = cuda.local.array(TM, float32)
        kv_frag = cuda.local.array((TN, S_STEP), float32)
        qdo_frag = cuda.local.array((TM, S_STEP), float32)
        p_frag = cuda.local.array((TN, 4), float32)
        x_frag = cuda.local.array(TD, float32)
        for i in range(TN):
            for c in range(TD):
                dk_acc[i, c] = 0.0
                dv_acc[i, c] = 0.0

        # K pre-scaled by qk_scale = scale · log2 e (with a softcap c: scale / c): Sᵀ comes out of its loop
        # ready for exp2 (for tanh).
        if VARLEN:  # the sequence's first rows
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        load_tile(k_tile, k, k_offset, stride_kn, stride_kd, start_n, seqlen_k, head_dim, qk_scale)
        load_tile(v_tile, v, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim, float32(1.0))

        # The query tiles that see a key of this tile: query i sees key j iff j - diag - window_right <= i <=
        # j - diag + window_left; the others are skipped (causal: window_right = 0).
        last_key = min(start_n + BLOCK_N, seqlen_k) - 1
        begin_m = max(start_n - diag - window_right, 0) // BLOCK_M * BLOCK_M if RIGHT else 0
        end_m = min(seqlen_q, last_key - diag + window_left + 1) if LEFT else seqlen_q
        # GQA: dK and dV of key/value head off_hk are sums over the group's query heads. The block loops over
        # them with its K and V tiles held and dk_acc, dv_acc accumulating in registers, so that dk and dv
        # are still written once per element (no atomics, no per-query-head dk, dv summed afterwards).
        for off_h in range(off_hk * group, off_hk * group + group):
            if VARLEN:
                q_offset = off_h * stride_qh + q_start * stride_qm
                do_offset = off_h * stride_doh + q_start * stride_dom
                l_offset = off_h * stride_lh + q_start * stride_lm
                delta_offset = off_h * total_q + q_start  # delta is per query head, (1·H, total_q)
            else:
                q_offset = off_b * stride_qb + off_h * stride_qh
                do_offset = off_b * stride_dob + off_h * stride_doh
                l_offset = off_b * stride_lb + off_h * stride_lh
                delta_offset = (off_b * heads + off_h) * seqlen_q  # delta is per query head
            # ALiBi's slope of this query head, in base 2.
            slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
            for start_m in range(begin_m, end_m, BLOCK_M):
                cuda.syncthreads()  # the previous step's q_tile, do_tile, pT_tile and dsT_tile have been read
                load_tile(q_tile, q, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim, float32(1.0))
                if not SHARE_QDO:
                    load_tile(do_tile, do, do_offset, stride_dom, stride_dod, start_m, seqlen_q, head_dim, float32(1.0))
                for j in range(TM):
                    row = start_m + tx + THREADS_M * j
                    # Rows past seqlen_q: L = +inf makes their P zero.
                    lse_m[j] = float32(math.inf)
                    delta_m[j] = 0.0
                    if row < seqlen_q:
                        lse_m[j] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                        delta_m[j] = delta[uint64(delta_offset + row)]
                cuda.syncthreads()

                # Sᵀ = K Qᵀ: the thread's TN x TM micro-tile, S_STEP head-dim columns a step.
                for i in range(TN):
                    for j in range(TM):
                        sT[i, j] = 0.0
                for dd in range(HEAD_DIM // S_STEP):
                    for i in range(TN):
                        for e in range(S_STEP):
                            kv_frag[i, e] = k_tile[uint64(ty + THREADS_N * i), uint64(S_STEP * dd + e)]
                    for j in range(TM):
                        for e in range(S_STEP):
                            qdo_frag[j, e] = q_tile[uint64(tx + THREADS_M * j), uint64(S_STEP * dd + e)]
                    for i in range(TN):
                        for j in range(TM):
                            for e in range(S_STEP):
                                sT[i, j] += kv_frag[i, e] * qdo_frag[j, e]

                if SHARE_QDO:
                    cuda.syncthreads()  # q_tile has been read
                    load_tile(do_tile, do, do_offset, stride_dom, stride_dod, start_m, seqlen_q, head_dim, float32(1.0))
                    cuda.syncthreads()

                # dPᵀ = V dOᵀ, as Sᵀ.
                for i in range(TN):
                    for j in range(TM):
                        dpT[i, j] = 0.0
                for dd in range(HEAD_DIM // S_STEP):
                    for i in range(TN):
                        for e in range(S_STEP):
                            kv_frag[i, e] = v_tile[uint64(ty + THREADS_N * i), uint64(S_STEP * dd + e)]
                    for j in range(TM):
                        for e in range(S_STEP):
                            qdo_frag[j, e] = do_tile[uint64(tx + THREADS_M * j), uint64(S_STEP * dd + e)]
                    for i in range(TN):
                        for j in range(TM):
                            for e in range(S_STEP):
                                dpT[i, j] += kv_frag[i, e] * qdo_frag[j, e]

                # The forward's scores: softcap (keeping tanh's derivative), ALiBi, then the mask.
                if SOFTCAP:
                    for i in range(TN):
                        for j in range(TM):
                            t = tanh(sT[i, j])
                            dcapT[i, j] = float32(1.0) - t * t
                            sT[i, j] = t * softcap_log2
                if ALIBI:
                    for i in range(TN):
                        for j in range(TM):
                            key = start_n + ty + THREADS_N * i
                            row = start_m + tx + THREADS_M * j
                            sT[i, j] = alibi(sT[i, j], slope, row, key, diag)
                # Mask only the tiles that cross the end of the keys or a window edge.
                if (
                    start_n + BLOCK_N > seqlen_k
                    or (RIGHT and start_n + BLOCK_N - 1 > start_m + diag + window_right)
                    or (LEFT and start_n < start_m + BLOCK_M - 1 + diag - window_left)
                ):
                    for i in range(TN):
                        for j in range(TM):
                            key = start_n + ty + THREADS_N * i
                            row = start_m + tx + THREADS_M * j
                            if masked(row, key, diag, seqlen_k, window_left, window_right):
                                sT[i, j] = -math.inf

                # Pᵀ = exp2(Sᵀ - L) and dSᵀ = Pᵀ ∘ (dPᵀ - delta) (softcap: times 1 - tanh²), to shared memory
                # for the two products.
                for i in range(TN):
                    for j in range(TM):
                        pT = math.exp2(sT[i, j] - lse_m[j])
                        dsT = pT * (dpT[i, j] - delta_m[j])
                        if SOFTCAP:
                            dsT *= dcapT[i, j]
                        pT_tile[ty + THREADS_N * i, tx + THREADS_M * j] = pT
                        dsT_tile[ty + THREADS_N * i, tx + THREADS_M * j] = dsT
                cuda.syncthreads()

                # dv += Pᵀ dO: the thread's TN x TD micro-tile, 4 queries a step.
                for mm in range(BLOCK_M // 4):
                    for i in range(TN):
                        for e in range(4):
                            p_frag[i, e] = pT_tile[uint64(ty + THREADS_N * i), uint64(4 * mm + e)]
                    for e in range(4):
                        for jj in range(TD // 4):
                            for f in range(4):
                                col = 4 * tx + 4 * THREADS_M * jj + f
                                x_frag[4 * jj + f] = do_tile[uint64(4 * mm + e), uint64(col)]
                        for i in range(TN):
                            for c in range(TD):
                                dv_acc[i, c] += p_frag[i, e] * x_frag[c]

                if SHARE_QDO:
                    cuda.syncthreads()  # do_tile has been read
                    load_tile(q_tile, q, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim, float32(1.0))
                    cuda.syncthreads()

                # dk += dSᵀ Q, as dv.
                for mm in range(BLOCK_M // 4):
                    for i in range(TN):
                        for e in range(4):
                            p_frag[i, e] = dsT_tile[uint64(ty + THREADS_N * i), uint64(4 * mm + e)]
                    for e in range(4):
                        for jj in range(TD // 4):
                            for f in range(4):
                                col = 4 * tx + 4 * THREADS_M * jj + f
                                x_frag[4 * jj + f] = q_tile[uint64(4 * mm + e), uint64(col)]
                        for i in range(TN):
                            for c in range(TD):
                                dk_acc[i, c] += p_frag[i, e] * x_frag[c]

        # Epilogue: dk · scale and dv, each once; a key tile that no query sees stores zeros.
        if not VARLEN:
            dkv_start = off_bhk * seqlen_k  # dk's and dv's row of key 0 of this (batch, key/value head)
        for i in range(TN):
            key = start_n + ty + THREADS_N * i
            if key < seqlen_k:
                kv_row = (dkv_start + key) * head_dim
                for jj in range(TD // 4):
                    for f in range(4):
                        col = 4 * tx + 4 * THREADS_M * jj + f
                        if EVEN_HEAD_DIM or col < head_dim:
                            dk[uint64(kv_row + col)] = from_float(dk_acc[i, 4 * jj + f] * scale)
                            dv[uint64(kv_row + col)] = from_float(dv_acc[i, 4 * jj + f])

    return jit_kernel(_attn_bwd_dkdv, MAX_REGISTERS)


def _build_dq(HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D):
    """The dQ kernel for one padded head dim, block shape (the forward's ``BlockConfig``), ``Features``,
    input kind, whether head_dim is HEAD_DIM and whether q, k, v and dO are contiguous along head_dim."""
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N, SHARE_KV, MAX_REGISTERS = config
    NUM_WARPS = THREADS_M * THREADS_N // 32
    TM = BLOCK_M // THREADS_M  # rows of S, dP and dq per thread
    TN = BLOCK_N // THREADS_N  # keys of S and dP per thread
    TD = HEAD_DIM // THREADS_N  # head-dim columns of dq per thread, in TD // 4 groups of 4
    LD_D = HEAD_DIM + 4  # padded row lengths of the shared tiles
    LD_N = BLOCK_N + 4
    KV_ROWS = BLOCK_N if SHARE_KV else 2 * BLOCK_N
    D_ROWS = 2 * BLOCK_M + KV_ROWS  # rows of the head-dim tiles: Q, dO, K and V
    S_STEP = 32 // TN  # head-dim columns a step of the S and dP loops
    assert THREADS_M * THREADS_N % 32 == 0 and BLOCK_M % NUM_WARPS == 0 and BLOCK_N % NUM_WARPS == 0
    assert BLOCK_M % THREADS_M == 0 and BLOCK_N % THREADS_N == 0 and BLOCK_N % 4 == 0 and 32 % TN == 0
    assert HEAD_DIM % (4 * THREADS_N) == 0 and HEAD_DIM % S_STEP == 0

    to_float, from_float = _converters(IS_BF16)
    load_tile = tile_loader(HEAD_DIM, NUM_WARPS, EVEN_HEAD_DIM, UNIT_STRIDE_D, to_float)
    masked = key_mask(LEFT, RIGHT)

    def _attn_bwd_dq(
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
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        num_m_tiles,
        cu_seqlens_q,
        cu_seqlens_k,
    ):
        """One block: BLOCK_M query rows of one (batch, head). Arguments as ``_attn_bwd_dkdv``'s (qk_scale
        pre-scales Q here); dq: (B, H, seqlen_q, head_dim), flat, contiguous, in q's dtype; num_m_tiles
        covers max_seqlen_q with VARLEN."""
        # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
        diag = seqlen_k - seqlen_q
        # Query tiles fastest and last first: under causal the last query tiles see the most keys, so the
        # longest blocks start first.
        start_m = (num_m_tiles - 1 - cuda.blockIdx.x % num_m_tiles) * BLOCK_M
        off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        # GQA: the group's query heads share key/value head off_hk, read in place (no repeated K, V).
        off_hk = off_h // group
        if VARLEN:
            # Sequence off_b: queries q_start .. q_start + seqlen_q of the packed q, dO, L, delta (and dq),
            # keys k_start .. k_start + seqlen_k of k and v; its own lengths (and their diag) stand for
            # seqlen_q and seqlen_k from here on. A query tile past its end exits.
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            dq_start = off_h * seqlen_q + q_start  # dq's and delta's row of the sequence's query 0
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                return
        tx = cuda.threadIdx.x % THREADS_N
        ty = cuda.threadIdx.x // THREADS_N

        # The tiles of head-dim rows are row ranges of one shared array (the simulator pays for each shared
        # array a thread declares). V and K: two tiles, or with SHARE_KV one that holds V until dP is
        # computed, then K.
        d_tiles = cuda.shared.array((D_ROWS, LD_D), float32, alignment=SHARED_ALIGN)
        q_tile = d_tiles[:BLOCK_M]  # [BLOCK_M, HEAD_DIM]
        do_tile = d_tiles[BLOCK_M : 2 * BLOCK_M]  # [BLOCK_M, HEAD_DIM]
        k_tile = d_tiles[2 * BLOCK_M : 2 * BLOCK_M + BLOCK_N]  # [BLOCK_N, HEAD_DIM]
        v_tile = d_tiles[D_ROWS - BLOCK_N :]  # [BLOCK_N, HEAD_DIM]
        ds_tile = cuda.shared.array((BLOCK_M, LD_N), float32, alignment=SHARED_ALIGN)  # [BLOCK_M, BLOCK_N]

        acc = cuda.local.array((TM, TD), float32)  # [TM, TD] of dQ's [BLOCK_M, HEAD_DIM]
        s = cuda.local.array((TM, TN), float32)  # [TM, TN] of S's [BLOCK_M, BLOCK_N]
        dp = cuda.local.array((TM, TN), float32)  # [TM, TN] of dP's [BLOCK_M, BLOCK_N]
        dcap = cuda.local.array((TM, TN), float32)  # softcap: 1 - tanh² of S's raw scores
        lse_m = cuda.local.array(TM, float32)  # L · log2 e of the thread's rows
        delta_m = cuda.local.array(TM, float32)
        qdo_frag = cuda.local.array((TM, S_STEP), float32)
        kv_frag = cuda.local.array((TN, S_STEP), float32)
        ds_frag = cuda.local.array((TM, 4), float32)
        k_frag = cuda.local.array(TD, float32)
        if VARLEN:  # the sequence's first rows
            l_offset = off_h * stride_lh + q_start * stride_lm
        else:
            l_offset = off_b * stride_lb + off_h * stride_lh
            dq_start = off_bh * seqlen_q  # dq's and delta's row of query 0 of this (batch, head)
        for i in range(TM):
            for c in range(TD):
                acc[i, c] = 0.0
            row = start_m + ty + THREADS_M * i
            # Rows past seqlen_q: L = +inf makes their P zero.
            lse_m[i] = float32(math.inf)
            delta_m[i] = 0.0
            if row < seqlen_q:
                lse_m[i] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                delta_m[i] = delta[uint64(dq_start + row)]

        if VARLEN:
            q_offset = off_h * stride_qh + q_start * stride_qm
            do_offset = off_h * stride_doh + q_start * stride_dom
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            q_offset = off_b * stride_qb + off_h * stride_qh
            do_offset = off_b * stride_dob + off_h * stride_doh
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        # Q pre-scaled by qk_scale = scale · log2 e (with a softcap c: scale / c): S comes out of its loop
        # ready for exp2 (for tanh).
        load_tile(q_tile, q, q_offset, stride_qm, stride_qd, start_m, seqlen_q, head_dim, qk_scale)
        # ALiBi's slope for this (batch or sequence, head), in base 2.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        load_tile(do_tile, do, do_offset, stride_dom, stride_dod, start_m, seqlen_q, head_dim, float32(1.0))

        # The key tiles the tile's rows see, as the forward's; the others are skipped.
        begin_n = max(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N if LEFT else 0
        end_n = min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag + window_right) if RIGHT else seqlen_k
        for start_n in range(begin_n, end_n, BLOCK_N):
            cuda.syncthreads()  # the previous tile's k_tile, v_tile and ds_tile have been read
            load_tile(v_tile, v, v_offset, stride_vn, stride_vd, start_n, seqlen_k, head_dim, float32(1.0))
            if not SHARE_KV:
                load_tile(k_tile, k, k_offset, stride_kn, stride_kd, start_n, seqlen_k, head_dim, float32(1.0))
            cuda.syncthreads()

            # dP = dO Vᵀ: the thread's TM x TN micro-tile, S_STEP head-dim columns a step.
            for i in range(TM):
                for j in range(TN):
                    dp[i, j] = 0.0
            for dd in range(HEAD_DIM // S_STEP):
                for i in range(TM):
                    for e in range(S_STEP):
                        qdo_frag[i, e] = do_tile[uint64(ty + THREADS_M * i), uint64(S_STEP * dd + e)]
                for j in range(TN):
                    for e in range(S_STEP):
                        kv_frag[j, e] = v_tile[uint64(tx + THREADS_N * j), uint64(S_STEP * dd + e)]
                for i in range(TM):
                    for j in range(TN):
                        for e in range(S_STEP):
                            dp[i, j] += qdo_frag[i, e] * kv_frag[j, e]

            if SHARE_KV:
                cuda.syncthreads()  # v_tile has been read
                load_tile(k_tile, k, k_offset, stride_kn, stride_kd, start_n, seqlen_k, head_dim, float32(1.0))
                cuda.syncthreads()

            # S = Q Kᵀ, as dP.
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = 0.0
            for dd in range(HEAD_DIM // S_STEP):
                for i in range(TM):
                    for e in range(S_STEP):
                        qdo_frag[i, e] = q_tile[uint64(ty + THREADS_M * i), uint64(S_STEP * dd + e)]
                for j in range(TN):
                    for e in range(S_STEP):
                        kv_frag[j, e] = k_tile[uint64(tx + THREADS_N * j), uint64(S_STEP * dd + e)]
                for i in range(TM):
                    for j in range(TN):
                        for e in range(S_STEP):
                            s[i, j] += qdo_frag[i, e] * kv_frag[j, e]

            # The forward's scores: softcap (keeping tanh's derivative), ALiBi, then the mask.
            if SOFTCAP:
                for i in range(TM):
                    for j in range(TN):
                        t = tanh(s[i, j])
                        dcap[i, j] = float32(1.0) - t * t
                        s[i, j] = t * softcap_log2
            if ALIBI:
                for i in range(TM):
                    for j in range(TN):
                        row = start_m + ty + THREADS_M * i
                        key = start_n + tx + THREADS_N * j
                        s[i, j] = alibi(s[i, j], slope, row, key, diag)
            # Mask only the tiles that cross the end of the keys or a window edge.
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

            # P = exp2(S - L) and dS = P ∘ (dP - delta) (softcap: times 1 - tanh²), to shared memory for dS K.
            for i in range(TM):
                for j in range(TN):
                    p = math.exp2(s[i, j] - lse_m[i])
                    ds = p * (dp[i, j] - delta_m[i])
                    if SOFTCAP:
                        ds *= dcap[i, j]
                    ds_tile[ty + THREADS_M * i, tx + THREADS_N * j] = ds
            cuda.syncthreads()

            # acc += dS K: the thread's TM x TD micro-tile, 4 keys a step.
            for nn in range(BLOCK_N // 4):
                for i in range(TM):
                    for e in range(4):
                        ds_frag[i, e] = ds_tile[uint64(ty + THREADS_M * i), uint64(4 * nn + e)]
                for e in range(4):
                    for jj in range(TD // 4):
                        for f in range(4):
                            col = 4 * tx + 4 * THREADS_N * jj + f
                            k_frag[4 * jj + f] = k_tile[uint64(4 * nn + e), uint64(col)]
                    for i in range(TM):
                        for c in range(TD):
                            acc[i, c] += ds_frag[i, e] * k_frag[c]

        # Epilogue: dq = acc · scale, once; rows that see no key store zeros.
        for i in range(TM):
            row = start_m + ty + THREADS_M * i
            if row < seqlen_q:
                q_row = (dq_start + row) * head_dim
                for jj in range(TD // 4):
                    for f in range(4):
                        col = 4 * tx + 4 * THREADS_N * jj + f
                        if EVEN_HEAD_DIM or col < head_dim:
                            dq[uint64(q_row + col)] = from_float(acc[i, 4 * jj + f] * scale)

    return jit_kernel(_attn_bwd_dq, MAX_REGISTERS)


# Compiled kernels by (name, *the builder's arguments): ("preprocess", HEAD_DIM, IS_BF16, EVEN_HEAD_DIM, SINK),
# ("dkdv" or "dq", HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D).
_KERNELS: dict[tuple, object] = {}
_BUILDERS = {"preprocess": _build_preprocess, "dkdv": _build_dkdv, "dq": _build_dq}
# Prepared launches (preprocess, dK/dV, dQ; ``launch.prepare``) by class of call: the shapes, strides and dtypes
# of q, k, v, O, L and dO, the device, the spec's values (``spec_class``), the config: everything the kernels,
# their grids and their arguments other than the tensors' memory are functions of.
_PREPARED: dict[tuple, tuple] = {}


def _kernel(name, *key):
    kernel = _KERNELS.get((name, *key))
    if kernel is None:
        kernel = _KERNELS[(name, *key)] = _BUILDERS[name](*key)
    return kernel


def dsink_parts(
    spec: AttentionSpec, O: torch.Tensor, rows: int = PRE_BLOCK_M, shares: int = 1, per_sequence: bool = False
) -> torch.Tensor | None:
    """With spec.sink, where a kernel writes the shares of dsink: (heads, batch · tiles · shares) fp32, tiles of
    ``rows`` query rows (the preprocess's blocks: one share each, a packed batch's rows as one sequence; the
    tensor-core dQ kernel's: one per warp, with per_sequence a packed batch's tiles per sequence, as many as
    max_seqlen_q's, as its grid: ``common.grid_extent``), uninitialised (every share is written; no column
    where O has no row); else None."""
    if spec.sink is None:
        return None
    batch, heads, seqlen_q = O.shape[:3]
    if per_sequence:
        batch, seqlen_q, _ = grid_extent(spec, O, O)
    return torch.empty(heads, batch * -(-seqlen_q // rows) * shares, dtype=torch.float32, device=O.device)


def sink_gradient(spec: AttentionSpec, parts: torch.Tensor | None) -> tuple:
    """The backward's gradient of the attention sink: () without one; else (dsink,), (heads,) fp32, dsink[h] =
    -Σ_{b, i} exp(sink[h] - L[b, h, i]) · delta[b, h, i] over the batch (every sequence of a packed one) and the
    rows: each head's row of the preprocess's shares (``dsink_parts``) summed by torch in a fixed order,
    deterministic, no atomics; parts None (no row): zeros."""
    if spec.sink is None:
        return ()
    if parts is None:
        return (torch.zeros_like(spec.sink),)
    return (parts.sum(dim=1),)


def preprocess_tensors(O, dO, L, delta, parts, spec: AttentionSpec) -> tuple:
    """The tensors of a prepared preprocess call (``launch_preprocess``), in order: O, dO, delta, L, and with a
    sink parts and spec.sink."""
    return (O, dO, delta, L) if parts is None else (O, dO, delta, L, parts, spec.sink)


def launch_preprocess(O, dO, L, delta, parts, spec: AttentionSpec) -> launch.Prepared | None:
    """The preprocess (SIMT; the tensor-core backward's too): delta = rowsum(dO ∘ O) into ``delta``, (batch ·
    heads · seqlen_q,) fp32, and with spec.sink each block's share of dsink into ``parts`` (``dsink_parts``).
    O, dO: (batch, heads, seqlen_q, head_dim), seqlen_q >= 1, one dtype; L: the forward's (batch, heads,
    seqlen_q) fp32; any strides. A packed batch is one sequence of total_q rows here: delta is per row, the
    sink per head. Returns the prepared launch (``launch.prepare``), called with ``preprocess_tensors``, or
    None where numba launches every call."""
    batch, heads, seqlen_q, head_dim = O.shape
    HEAD_DIM = padded_head_dim(head_dim)
    num_m_tiles = -(-seqlen_q // PRE_BLOCK_M)
    head = (O, dO, delta, *O.stride(), *dO.stride(), heads, seqlen_q, head_dim, num_m_tiles)
    args = (*head, L, *L.stride(), dsink_arg(parts, O.device), sink_arg(spec, O.device))
    varying = (0, 1, 2, len(head)) + (() if parts is None else (len(args) - 2, len(args) - 1))
    return launch.prepare(
        _kernel("preprocess", HEAD_DIM, O.dtype == torch.bfloat16, head_dim == HEAD_DIM, parts is not None),
        num_m_tiles * batch * heads,
        32 * PRE_WARPS,
        O.device,
        args,
        varying,
    )


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    config: tuple[DkDvConfig, BlockConfig] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The SIMT kernels' launches (preprocess, dK/dV, dQ): arguments and returns as
    ``fa2_numba_cuda.backward.flash_attn_backward`` (fp32, fp16 or bf16, head_dim up to 256); config: the two
    kernels' blocks, for tuning; default ``bwd_block_config(padded_head_dim(head_dim))``."""
    key = None
    if launch.FAST:  # a call of a class met before: the kernels' parameters are packed, only pointers change
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
            spec_class(spec),
            None if config is None else tuple(map(tuple, config)),
        )
        plan = _PREPARED.get(key)
        if plan is not None:
            preprocess, dkdv, dq_kernel = plan
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            dO = dO.to(q.dtype)
            delta = torch.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
            parts = dsink_parts(spec, O)
            extra = spec_tensors(spec)
            if preprocess is not None:
                preprocess(*preprocess_tensors(O, dO, L, delta, parts, spec))
            if dkdv is not None:
                dkdv(q, k, v, dO, L, delta, dk, dv, *extra)
            if dq_kernel is not None:
                dq_kernel(q, k, v, dO, L, delta, dq, *extra)
            return dq, dk, dv, *sink_gradient(spec, parts)
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(f"fa2-numba-cuda supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}")
    check_device(q)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if head_dim == 0 or batch * heads == 0:
        return dq, dk, dv, *sink_gradient(spec, None)
    dO = dO.to(q.dtype)
    delta = torch.empty(batch * heads * seqlen_q, dtype=torch.float32, device=q.device)
    parts = dsink_parts(spec, O)

    HEAD_DIM = padded_head_dim(head_dim)
    dkdv_config, dq_config = config if config is not None else bwd_block_config(HEAD_DIM)
    dkdv_config, dq_config = DkDvConfig(*dkdv_config), BlockConfig(*dq_config)
    is_bf16, even_head_dim = q.dtype == torch.bfloat16, head_dim == HEAD_DIM
    unit_stride_d = q.stride(3) == k.stride(3) == v.stride(3) == dO.stride(3) == 1
    flags = (*features(spec), is_bf16, even_head_dim, unit_stride_d)
    # The kernels' tensors (``launch`` passes each as a flat array over its memory, indexed with its element
    # strides), their strides and sizes.
    inputs = (q, k, v, dO, L, delta)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dO.stride(), *L.stride())
    group = heads // heads_k  # query heads per key/value head (the interface checked the division)
    sizes = (heads, group, seqlen_q, seqlen_k, head_dim, np.float32(spec.scale), np.float32(score_scale(spec)))
    feats = feature_args(spec, seqlen_q, seqlen_k, q.device)
    offsets = offset_args(spec, q.device)
    # delta is per row: the preprocess runs on a packed batch as on one sequence of total_q rows. The main
    # kernels' grids: per (sequence, head), the tiles of the longest sequence; the others' extra tiles exit.
    grid_batch, grid_seqlen_q, grid_seqlen_k = grid_extent(spec, q, k)
    num_n_tiles = -(-grid_seqlen_k // dkdv_config.BLOCK_N)
    num_m_tiles = -(-grid_seqlen_q // dq_config.BLOCK_M)

    # The preprocess, dK/dV and dQ launches in order, each prepared (``launch.prepare``: launched, and kept
    # for the later calls of the class) or None where it has no rows to write. What changes within a class:
    # the tensors, and the spec's.
    plan = [None, None, None]
    prepared = True
    if seqlen_q:
        plan[0] = launch_preprocess(O, dO, L, delta, parts, spec)
        prepared = prepared and plan[0] is not None
    if seqlen_k and num_n_tiles * grid_batch:
        head = (*inputs, dk, dv, *strides, *sizes)
        args = (*head, *feats, num_n_tiles, *offsets)
        varying = (*range(8), *spec_positions(spec, len(head), len(args) - 2))
        plan[1] = launch.prepare(
            _kernel("dkdv", HEAD_DIM, dkdv_config, *flags),
            num_n_tiles * grid_batch * heads_k,
            dkdv_config.THREADS_N * dkdv_config.THREADS_M,
            q.device,
            args,
            varying,
        )
        prepared = prepared and plan[1] is not None
    if seqlen_q and num_m_tiles * grid_batch:
        head = (*inputs, dq, *strides, *sizes)
        args = (*head, *feats, num_m_tiles, *offsets)
        varying = (*range(7), *spec_positions(spec, len(head), len(args) - 2))
        plan[2] = launch.prepare(
            _kernel("dq", HEAD_DIM, dq_config, *flags),
            num_m_tiles * grid_batch * heads,
            dq_config.THREADS_M * dq_config.THREADS_N,
            q.device,
            args,
            varying,
        )
        prepared = prepared and plan[2] is not None
    if prepared and key is not None:
        _PREPARED[key] = tuple(plan)
    return dq, dk, dv, *sink_gradient(spec, parts)


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every backward kernel
    compiled so far in this process (one row per compiled specialisation); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (name, *key), kernel in _KERNELS.items():
        if name == "preprocess":
            HEAD_DIM, IS_BF16, EVEN_HEAD_DIM, SINK = key
            spec = {"HEAD_DIM": HEAD_DIM, "sink": SINK, "bf16": IS_BF16, "even_head_dim": EVEN_HEAD_DIM}
        else:
            HEAD_DIM, config, *switches, IS_BF16, EVEN_HEAD_DIM, UNIT_STRIDE_D = key
            spec = {
                "HEAD_DIM": HEAD_DIM,
                **config._asdict(),
                **feature_columns(switches),
                "bf16": IS_BF16,
                "even_head_dim": EVEN_HEAD_DIM,
                "unit_stride_d": UNIT_STRIDE_D,
            }
        regs = kernel.get_regs_per_thread()
        shared = kernel.get_shared_mem_per_block()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": name,
                    **spec,
                    "signature": ", ".join(str(t) for t in signature),
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": shared[signature],
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
