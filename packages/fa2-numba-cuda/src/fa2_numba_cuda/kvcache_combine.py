"""The LSE combine of fa2-numba-cuda's KV-cache path: after a split kernel (``kvcache_simt``, ``kvcache_tc``)
wrote each split's partial O (fp32) and base-2 L, one warp a row of O merges the splits by their logsumexp,
``fa2.combine``'s formula in base 2: L = log2 Σ_s 2^(L_s), O = Σ_s 2^(L_s - L) O_s, a split that saw no key of
the row (L_s = +inf) weighing nothing; a row no split saw gets O = 0 and L = +inf. ``fa2_numba_cuda.kvcache``
launches it only where there are splits. With an attention sink (SINK) the sink is one more split of L_s =
sink[h] · log2 e and O_s = 0, counted once, here (the split kernels leave it out): a row no split saw then gets
O = 0 and L = sink[h].
"""

from __future__ import annotations

import math

from numba import cuda

from fa2_numba_cuda.common import LN2, LOG2E, float32, float_to_bf16, identity, uint64
from fa2_numba_cuda.mma import shfl_xor

NUM_THREADS = 128  # 4 warps a block
ROWS = NUM_THREADS // 32  # rows a block merges, one a warp
UNROLL = 4  # splits whose partial O rows a lane loads before it adds them


def _build_kernel(IS_BF16, SINK, COLS):
    """The LSE combine: one warp a row of O. o_part (num_splits, rows_total, head_dim) fp32 and lse_part
    (num_splits, rows_total) fp32, base 2 (+inf: the split saw no key of the row, its O row unwritten);
    writes o (rows_total, head_dim) in q's dtype and lse (rows_total,) natural log. SINK: sink (heads,) fp32,
    natural log, joins each row's sum, the row's head (row // seqlen_rows) % heads, rows_total being (batch,
    heads, seqlen_rows) flat; without SINK the last three arguments are unread. COLS: ceil(head_dim / 32), the
    columns of a lane (lane, lane + 32, ...).

    The row's L from every lane's share of the splits (lane, lane + 32, ...), reduced over the warp; then O
    with the splits in groups of UNROLL, each group's O rows loaded before any is added, so that a lane waits
    on memory once a group, not once a split (one split an iteration, each lane of the 32 warps of a 1 x 128k
    decode, 32 rows of 69 splits, made about 700 loads in loops of one load before its use)."""
    from_float = float_to_bf16 if IS_BF16 else identity

    def _combine(o_part, lse_part, o, lse, num_splits, rows_total, head_dim, sink, heads, seqlen_rows):
        row = cuda.blockIdx.x * ROWS + cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        if row >= rows_total:  # the whole warp: its shuffles below see every lane
            return
        # side-by-side: combine
        # L = log2 Σ_s 2^(L_s), over the splits that saw a key (L_s != +inf), around their max; the sink is
        # one more term, of no O. Each lane's splits, then the warp's (a NaN L_s is never a max, and makes
        # its lane's sum, so the row's, NaN).
        m = float32(-math.inf)
        if SINK:
            sink_log2 = sink[(row // seqlen_rows) % heads] * float32(LOG2E)
            m = sink_log2
        for sp in range(lane, num_splits, 32):
            ls = lse_part[uint64(sp * rows_total + row)]
            if ls != math.inf and ls > m:
                m = ls
        for step in (16, 8, 4, 2, 1):
            other = shfl_xor(m, step)
            if other > m:
                m = other
        total = float32(0.0)
        for sp in range(lane, num_splits, 32):
            ls = lse_part[uint64(sp * rows_total + row)]
            if ls != math.inf:
                total += math.exp2(ls - m)
        for step in (16, 8, 4, 2, 1):
            total += shfl_xor(total, step)
        if SINK:
            total += math.exp2(sink_log2 - m)
        # No key in any split (m = -inf, total = 0): O = 0, L = +inf. A NaN L_s makes total and L NaN.
        empty = m == -math.inf
        lse2 = m + math.log2(total) if not empty else float32(0.0)
        acc = cuda.local.array(COLS, float32)
        parts = cuda.local.array((UNROLL, COLS), float32)
        weights = cuda.local.array(UNROLL, float32)
        for j in range(COLS):
            acc[j] = float32(0.0)
        for first in range(0, num_splits, UNROLL):
            # The group's O rows first (a split that saw no key has an unwritten row: loaded, never added).
            for u in range(UNROLL):
                sp = first + u
                weights[u] = float32(math.inf)
                if sp < num_splits:
                    weights[u] = lse_part[uint64(sp * rows_total + row)]
                    for j in range(COLS):
                        c = lane + 32 * j
                        if c < head_dim:
                            parts[u, j] = o_part[uint64((sp * rows_total + row) * head_dim + c)]
            for u in range(UNROLL):
                if weights[u] != math.inf:
                    w = math.exp2(weights[u] - lse2)
                    for j in range(COLS):
                        acc[j] += w * parts[u, j]
        for j in range(COLS):
            c = lane + 32 * j
            if c < head_dim:
                o[uint64(row * head_dim + c)] = from_float(acc[j])
        if lane == 0:
            lse[uint64(row)] = lse2 * float32(LN2) if not empty else float32(math.inf)
        # side-by-side: end

    return cuda.jit(_combine)


_KERNELS: dict[tuple[bool, bool, int], object] = {}  # by (IS_BF16, SINK, COLS)


def kernel(is_bf16: bool, sink: bool, head_dim: int):
    """The combine writing O in bf16 (``is_bf16``) or in q's own dtype, adding the sink (``sink``) or not, for
    rows of ``head_dim`` columns, compiled once per (is_bf16, sink, ceil(head_dim / 32))."""
    key = (is_bf16, sink, -(-head_dim // 32))
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _build_kernel(*key)
    return found
