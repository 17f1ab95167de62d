"""FlashAttention-2's backward as ``triton.language`` kernels: what ``backward.flash_attn_backward``
launches, on a GPU or in Triton's interpreter.

The FA2 paper's Algorithm 2 in FA2's two-kernel split. From L, each tile's probabilities are recomputed
instead of stored, P = exp(S - L), and

    delta  = rowsum(dO ∘ O)              _attn_bwd_preprocess: once, fp32
    dV_j  += Pᵀ dO_i                     dP = dO_i V_jᵀ
    dS     = P ∘ (dP - delta_i)
    dK_j  += scale · dSᵀ Q_i             _attn_bwd_dkdv: one program per (key tile, batch·heads_k),
                                         looping over the group's query heads and, for each, the query
                                         tiles that see the key tile
    dQ_i  += scale · dS K_j              _attn_bwd_dq: one program per (query tile, batch·head), looping
                                         over the key tiles the query tile sees

Grouped-query attention (heads a multiple of heads_k; heads_k = 1 is multi-query): query head h reads
key/value head ``off_hk = h // group``, group = heads // heads_k, by index arithmetic on the head, as the
forward. The dK/dV of a key/value head sum over its group's query heads: the dK/dV kernel has one program
per (key tile, batch·heads_k), which loops over the group's query heads (and each one's query tiles) with
dk and dv in registers, so no per-query-head dK or dV is ever written. delta and dQ stay per query head.

Every program writes its own rows of dK, dV or dQ once: no atomics, so the result is deterministic. The
price is computing S, P and dP twice (once per kernel). ``deterministic=False`` skips the dQ kernel and
adds each tile's dS K into a zeroed fp32 dQ from the dK/dV kernel with atomics instead, as FA2's CUDA
kernel does: five matmuls per tile instead of seven, but dq's last bits depend on the order of the adds.

Scores live in the log2 domain as in the forward: P = exp2(qk · scale · log2(e) - L · log2(e)). A row that
saw no key has L = +inf, so P = exp2(finite - inf) = 0 there and it gets zero gradients; query rows past
seqlen_q are loaded with L = +inf for the same effect. The dK/dV kernel works transposed (Sᵀ, Pᵀ, dPᵀ,
dSᵀ: [BLOCK_N, BLOCK_M]) so that Pᵀ and dSᵀ are the left operands of their matmuls, as in the tutorial.

Windows, softcap and ALiBi as in the forward (``fa2_triton.forward_tl``: the same compile-time switches from the
same ``AttentionSpec``). Each loop visits only the tiles inside the window and runs in parts like the
forward's: the tiles across a window edge (under causal, the diagonal band) are masked; the rest are
loaded and used without masks; a last partial tile is loaded with row masks. The dK/dV loop visits only
the query tiles that see some key of its tile (the window read the other way round), the dQ loop only the
key tiles its tile sees. Key rows past seqlen_k need no mask in the dK/dV kernel (their gradient rows are
never stored and feed no other row). The softcap's chain rule: dS times 1 - tanh², from the tanh the scores
were recomputed with; ALiBi adds nothing to dS.

Credits: the structure (a preprocess kernel for delta, the transposed dK/dV loop, the dQ loop) follows
Triton's tutorial ``06-fused-attention.py`` (Tillet et al.), itself after FA2's backward (Dao, 2023).

Limits: as the forward (``fa2_triton.forward_tl``): head_dim a multiple of 8 from 8 to 256, padded to a power
of two and masked; float32, float16, bfloat16; CUDA, or CPU tensors under Triton's interpreter; plain
pointer loads. Matmuls ask for ``input_precision="ieee"``: fp32 gets no TF32; fp16 and bf16 run on
tensor cores with fp32 accumulation, P and dS rounded to the input dtype before their matmuls (as FA2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fa2_triton.common import load_tile, sequence, tanh, tiles_in_window


@triton.jit
def _attn_bwd_preprocess(
    O,
    dO,
    Delta,
    L,
    Sink,
    DSink,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_lm,
    H,
    N_Q,
    head_dim,
    HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    # delta = rowsum(dO ∘ O) in fp32, one program per (query tile, batch·head); Delta is (B·H, N_Q).
    # HAS_SINK: also this tile's share of dsink[h], -Σ_i exp(sink[h] - L_i) · delta_i, into DSink (H, B ·
    # tiles) at [h, b · tiles + tile], for a fixed-order sum over each head's row afterwards.
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(N_Q, BLOCK_M)
    off_bh = (pid // num_m_tiles).to(tl.int64)
    off_b = off_bh // H
    off_h = off_bh % H
    tile_m = pid % num_m_tiles
    start_m = tile_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m64 = offs_m.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m64[:, None] * stride_om + offs_d64[None, :] * stride_od
    do_ptrs = (
        dO + off_b * stride_dob + off_h * stride_doh + offs_m64[:, None] * stride_dom + offs_d64[None, :] * stride_dod
    )
    o = load_tile(o_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]
    do = load_tile(do_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + off_bh * N_Q + offs_m, delta, mask=offs_m < N_Q)
    # side-by-side: dsink
    if HAS_SINK:
        # exp(sink[h] - L_i) is the weight the sink took in row i; rows past N_Q (delta 0, L +inf) add 0.
        lse = tl.load(
            L + off_b * stride_lb + off_h * stride_lh + offs_m64 * stride_lm, mask=offs_m < N_Q, other=float("inf")
        )
        p_sink = tl.math.exp(tl.load(Sink + off_h) - lse)
        tl.store(DSink + off_h * (tl.num_programs(0) // H) + off_b * num_m_tiles + tile_m, -tl.sum(p_sink * delta, 0))
    # side-by-side: end


@triton.jit
def _attn_bwd_dkdv_tile(
    dk,
    dv,
    k,
    v,
    start_m,
    g64,
    q_ptrs,
    do_ptrs,
    o_ptrs,
    l_ptrs,
    delta_ptrs,
    dq_acc_ptrs,
    slope_ptr,
    stride_qm,
    stride_dom,
    stride_om,
    stride_lm,
    stride_qh,
    stride_doh,
    stride_oh,
    stride_lh,
    stride_delta,
    stride_dq_acc,
    stride_sh,
    offs_m,
    offs_n,
    offs_d,
    head_dim,
    N_Q,
    diag,
    diag_left,
    diag_right,
    qk_scale,
    cap_scale,
    IN_BAND: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DELTA_FROM_O: tl.constexpr,
):
    """One key tile's dK and dV updated with query tile start_m of the group's query head g64 (pointers of
    the group's first head, and head strides). Loads row-masked and scores masked to the window (query i
    sees key j iff i + diag_left <= j <= i + diag_right, the bounded sides) iff IN_BAND. SOFTCAP as in the
    forward; ALIBI: the head's slope (slope_ptr at head stride stride_sh) · log2(e). With ATOMIC_DQ, also
    adds this tile's dS K into the fp32 dQ accumulator. DELTA_FROM_O: delta = rowsum(dO ∘ O) of the tile computed
    here from O (o_ptrs, strides stride_om and stride_oh) instead of loaded from the preprocess's."""
    rows = start_m + offs_m
    start_m64 = tl.cast(start_m, tl.int64)
    q = load_tile(
        q_ptrs + g64 * stride_qh + start_m64 * stride_qm, rows, N_Q, offs_d, head_dim, IN_BAND, EVEN_D
    )  # [BLOCK_M, HEAD_DIM]
    if IN_BAND:
        # Rows past seqlen_q: L = +inf makes their P zero.
        lse = tl.load(l_ptrs + g64 * stride_lh + start_m64 * stride_lm, mask=rows < N_Q, other=float("inf"))
        if not DELTA_FROM_O:
            delta = tl.load(delta_ptrs + g64 * stride_delta + start_m, mask=rows < N_Q, other=0.0)
    else:
        lse = tl.load(l_ptrs + g64 * stride_lh + start_m64 * stride_lm)
        if not DELTA_FROM_O:
            delta = tl.load(delta_ptrs + g64 * stride_delta + start_m)
    qkT = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
    if SOFTCAP:
        qkT = tanh(qkT * cap_scale, SOFTCAP)  # the capped score over softcap, as in the forward
    # exp(S - L) in log2 units; a row with L = +inf gets exp2(-inf) = 0.
    sT = qkT * qk_scale - (lse * 1.4426950408889634)[None, :]
    if ALIBI:
        alibi = tl.load(slope_ptr + g64 * stride_sh) * 1.4426950408889634
        sT = sT - alibi * tl.abs(rows[None, :] + diag - offs_n[:, None]).to(tl.float32)
    pT = tl.math.exp2(sT)
    # Key j is visible to query i iff i + diag_left <= j <= i + diag_right (the bounded sides); zeroing
    # after exp2 keeps -inf out of it. Keys past seqlen_k need no mask here (see _attn_bwd_dkdv).
    if IN_BAND and WINDOW_RIGHT:
        pT = tl.where(offs_n[:, None] <= rows[None, :] + diag_right, pT, 0.0)
    if IN_BAND and WINDOW_LEFT:
        pT = tl.where(offs_n[:, None] >= rows[None, :] + diag_left, pT, 0.0)
    do = load_tile(
        do_ptrs + g64 * stride_doh + start_m64 * stride_dom, rows, N_Q, offs_d, head_dim, IN_BAND, EVEN_D
    )  # [BLOCK_M, HEAD_DIM]
    if DELTA_FROM_O:
        o = load_tile(
            o_ptrs + g64 * stride_oh + start_m64 * stride_om, rows, N_Q, offs_d, head_dim, IN_BAND, EVEN_D
        )  # [BLOCK_M, HEAD_DIM]; rows past seqlen_q are zeros: delta 0
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision="ieee")
    if SOFTCAP:
        # d(softcap · tanh(s / softcap)) / ds = 1 - tanh², folded into P once dV has it, so the tanh tile dies
        # before dP's product instead of living through it (a [BLOCK_N, BLOCK_M] fp32 tile fewer).
        pT = pT * (1.0 - qkT * qkT)
    dpT = tl.dot(v, tl.trans(do), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision="ieee")
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision="ieee")  # [BLOCK_M, HEAD_DIM]
        # The accumulator is padded to whole tiles: no mask.
        tl.atomic_add(dq_acc_ptrs + g64 * stride_dq_acc + start_m64 * HEAD_DIM, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    o_ptrs,
    l_ptrs,
    delta_ptrs,
    dq_acc_ptrs,
    slope_ptr,
    stride_qm,
    stride_dom,
    stride_om,
    stride_lm,
    stride_qh,
    stride_doh,
    stride_oh,
    stride_lh,
    stride_delta,
    stride_dq_acc,
    stride_sh,
    GROUP,
    offs_m,
    offs_n,
    offs_d,
    head_dim,
    N_Q,
    diag,
    diag_left,
    diag_right,
    qk_scale,
    cap_scale,
    lo,
    hi,
    IN_BAND: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    GQA: tl.constexpr,
    DELTA_FROM_O: tl.constexpr,
):
    """dK and dV of one key tile over query tiles [lo, hi) of each of the GROUP query heads of its key/value
    head (GQA: GROUP > 1), the heads one after another in a fixed order. With GQA one loop walks (head,
    query tile) rather than a loop over the heads around the loop over tiles, whose nesting made Triton
    3.9 spill 350-720 bytes a thread at HEAD_DIM = 128 (offline sm_90a compile), against 80-290 this way;
    one head keeps the plain loop over tiles (0-210 bytes; the (head, tile) loop's index arithmetic
    costs it 40-64 more)."""
    if GQA:
        num_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
        for it in tl.range(0, GROUP * num_tiles):
            g = it // num_tiles
            start_m = tl.multiple_of(lo + (it - g * num_tiles) * BLOCK_M, BLOCK_M)
            dk, dv = _attn_bwd_dkdv_tile(
                dk,
                dv,
                k,
                v,
                start_m,
                tl.cast(g, tl.int64),
                q_ptrs,
                do_ptrs,
                o_ptrs,
                l_ptrs,
                delta_ptrs,
                dq_acc_ptrs,
                slope_ptr,
                stride_qm,
                stride_dom,
                stride_om,
                stride_lm,
                stride_qh,
                stride_doh,
                stride_oh,
                stride_lh,
                stride_delta,
                stride_dq_acc,
                stride_sh,
                offs_m,
                offs_n,
                offs_d,
                head_dim,
                N_Q,
                diag,
                diag_left,
                diag_right,
                qk_scale,
                cap_scale,
                IN_BAND,
                WINDOW_LEFT,
                WINDOW_RIGHT,
                SOFTCAP,
                ALIBI,
                BLOCK_M,
                HEAD_DIM,
                EVEN_D,
                ATOMIC_DQ,
                DELTA_FROM_O,
            )
    else:
        for start_m in tl.range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _attn_bwd_dkdv_tile(
                dk,
                dv,
                k,
                v,
                start_m,
                0,
                q_ptrs,
                do_ptrs,
                o_ptrs,
                l_ptrs,
                delta_ptrs,
                dq_acc_ptrs,
                slope_ptr,
                stride_qm,
                stride_dom,
                stride_om,
                stride_lm,
                stride_qh,
                stride_doh,
                stride_oh,
                stride_lh,
                stride_delta,
                stride_dq_acc,
                stride_sh,
                offs_m,
                offs_n,
                offs_d,
                head_dim,
                N_Q,
                diag,
                diag_left,
                diag_right,
                qk_scale,
                cap_scale,
                IN_BAND,
                WINDOW_LEFT,
                WINDOW_RIGHT,
                SOFTCAP,
                ALIBI,
                BLOCK_M,
                HEAD_DIM,
                EVEN_D,
                ATOMIC_DQ,
                DELTA_FROM_O,
            )
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_program(
    pid,
    Q,
    K,
    V,
    dO,
    O,
    L,
    Delta,
    dK,
    dV,
    dQ_acc,
    Slopes,
    Cu_q,
    Cu_k,
    scale,
    qk_scale,
    cap_scale,
    window_left,
    window_right,
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
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_sb,
    stride_sh,
    stride_delta,
    stride_dq_acc,
    H,
    GROUP,
    N_Q,
    N_K,
    TOTAL_Q,
    TOTAL_K,
    head_dim,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    VARLEN: tl.constexpr,
    GQA: tl.constexpr,
    DELTA_FROM_O: tl.constexpr,
):
    """Program pid of the dK/dV kernel. Q, dO, O: (B, H, N_Q, D); K, V, dK, dV: (B, H // GROUP, N_K, D); L: (B,
    H, N_Q); Delta: (B·H, N_Q) at row stride stride_delta. dQ_acc: with ATOMIC_DQ, a zeroed fp32 (B·H, cdiv(N_Q,
    BLOCK_M) · BLOCK_M, HEAD_DIM) accumulator (stride_dq_acc elements a row of B·H). GROUP: query heads per
    key/value head, a runtime int as in the forward. The window, softcap and ALiBi arguments as the forward's
    (``_attn_fwd``), Slopes (B, H) per query head. VARLEN: a packed batch as in the forward (B = 1 in the
    tensors, the sequences' rows from Cu_q and Cu_k; N_Q and N_K the longest lengths), dQ_acc then (H, total_q
    + BLOCK_M, HEAD_DIM). DELTA_FROM_O: each step computes its delta from O and dO (Delta unread), else O is
    unread."""
    # One program per (key tile, batch·key/value head), flattened to one grid axis, key tiles fastest; under
    # causal the first key tiles are seen by the most query rows, so the longest programs start first.
    num_n_tiles = tl.cdiv(N_K, BLOCK_N)
    H_K = H // GROUP
    off_bhk = (pid // num_n_tiles).to(tl.int64)
    off_b = off_bhk // H_K
    off_hk = off_bhk % H_K
    start_n = (pid % num_n_tiles) * BLOCK_N
    # A packed batch: off_b is a sequence, and every length below is that sequence's own.
    off_bt, q_start, k_start, N_Q, N_K = sequence(Cu_q, Cu_k, off_b, N_Q, N_K, TOTAL_Q, TOTAL_K, VARLEN)
    if VARLEN:
        if start_n >= N_K:
            return
        Q += q_start * stride_qm
        dO += q_start * stride_dom
        O += q_start * stride_om
        L += q_start * stride_lm
        Delta += q_start
        dQ_acc += q_start * HEAD_DIM
        K += k_start * stride_kn
        V += k_start * stride_vn
        dK += k_start * stride_dkn
        dV += k_start * stride_dvn
    # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
    diag = N_K - N_Q
    diag_left = diag - window_left
    diag_right = diag + window_right

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit offsets, as B·H·N·D can pass 2^31 elements; the query loop adds start_m · stride in 64 bits.
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    k_ptrs = K + off_bt * stride_kb + off_hk * stride_kh + offs_n64[:, None] * stride_kn + offs_d64[None, :] * stride_kd
    v_ptrs = V + off_bt * stride_vb + off_hk * stride_vh + offs_n64[:, None] * stride_vn + offs_d64[None, :] * stride_vd

    k = load_tile(k_ptrs, offs_n, N_K, offs_d, head_dim, True, EVEN_D)  # [BLOCK_N, HEAD_DIM]
    v = load_tile(v_ptrs, offs_n, N_K, offs_d, head_dim, True, EVEN_D)  # [BLOCK_N, HEAD_DIM]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Only the query tiles that see a key of this tile: key j is seen by query i iff j - diag - window_right
    # <= i <= j - diag + window_left, the window read the other way round. [lo, full_lo) across the right
    # edge (under causal, the band) and [full_hi, hi) across the left edge or the end of the queries (the
    # last partial tile, row-masked) are masked; [full_lo, full_hi), every key of the tile seen by every
    # row, unmasked. Keys past seqlen_k count as seen: their gradient rows are never stored.
    lo, full_lo, full_hi, hi = tiles_in_window(
        start_n,
        tl.minimum(start_n + BLOCK_N, N_K),
        N_Q,
        -diag,
        window_right,
        window_left,
        BLOCK_M,
        WINDOW_RIGHT,
        WINDOW_LEFT,
    )
    # The group's query heads, one after another in a fixed order (deterministic), all accumulating into
    # this key tile's dk and dv in registers: dK and dV of a key/value head are sums over its query heads.
    # Pointers of the group's first query head; each part's loop walks (head, query tile).
    off_h = off_hk * GROUP
    off_bh = off_bt * H + off_h
    q_ptrs = Q + off_bt * stride_qb + off_h * stride_qh + offs_m64[:, None] * stride_qm + offs_d64[None, :] * stride_qd
    do_ptrs = (
        dO + off_bt * stride_dob + off_h * stride_doh + offs_m64[:, None] * stride_dom + offs_d64[None, :] * stride_dod
    )
    o_ptrs = O + off_bt * stride_ob + off_h * stride_oh + offs_m64[:, None] * stride_om + offs_d64[None, :] * stride_od
    l_ptrs = L + off_bt * stride_lb + off_h * stride_lh + offs_m64 * stride_lm
    delta_ptrs = Delta + off_bh * stride_delta + offs_m
    dq_acc_ptrs = dQ_acc + off_bh * stride_dq_acc + offs_m64[:, None] * HEAD_DIM + offs_d64[None, :]
    slope_ptr = Slopes + off_b * stride_sb + off_h * stride_sh
    dk, dv = _attn_bwd_dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_ptrs,
        do_ptrs,
        o_ptrs,
        l_ptrs,
        delta_ptrs,
        dq_acc_ptrs,
        slope_ptr,
        stride_qm,
        stride_dom,
        stride_om,
        stride_lm,
        stride_qh,
        stride_doh,
        stride_oh,
        stride_lh,
        stride_delta,
        stride_dq_acc,
        stride_sh,
        GROUP,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_Q,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        lo,
        full_lo,
        True,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_M,
        HEAD_DIM,
        EVEN_D,
        ATOMIC_DQ,
        GQA,
        DELTA_FROM_O,
    )
    dk, dv = _attn_bwd_dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_ptrs,
        do_ptrs,
        o_ptrs,
        l_ptrs,
        delta_ptrs,
        dq_acc_ptrs,
        slope_ptr,
        stride_qm,
        stride_dom,
        stride_om,
        stride_lm,
        stride_qh,
        stride_doh,
        stride_oh,
        stride_lh,
        stride_delta,
        stride_dq_acc,
        stride_sh,
        GROUP,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_Q,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        full_lo,
        full_hi,
        False,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_M,
        HEAD_DIM,
        EVEN_D,
        ATOMIC_DQ,
        GQA,
        DELTA_FROM_O,
    )
    dk, dv = _attn_bwd_dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_ptrs,
        do_ptrs,
        o_ptrs,
        l_ptrs,
        delta_ptrs,
        dq_acc_ptrs,
        slope_ptr,
        stride_qm,
        stride_dom,
        stride_om,
        stride_lm,
        stride_qh,
        stride_doh,
        stride_oh,
        stride_lh,
        stride_delta,
        stride_dq_acc,
        stride_sh,
        GROUP,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_Q,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        full_hi,
        hi,
        True,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_M,
        HEAD_DIM,
        EVEN_D,
        ATOMIC_DQ,
        GQA,
        DELTA_FROM_O,
    )
    dk = dk * scale

    # A key tile that no query sees keeps dk = dv = 0, and stores them.
    mask = offs_n[:, None] < N_K
    if not EVEN_D:
        mask = mask & (offs_d[None, :] < head_dim)
    dk_ptrs = (
        dK + off_bt * stride_dkb + off_hk * stride_dkh + offs_n64[:, None] * stride_dkn + offs_d64[None, :] * stride_dkd
    )
    dv_ptrs = (
        dV + off_bt * stride_dvb + off_hk * stride_dvh + offs_n64[:, None] * stride_dvn + offs_d64[None, :] * stride_dvd
    )
    tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    dO,
    L,
    Delta,
    dK,
    dV,
    dQ_acc,
    Slopes,
    Cu_q,
    Cu_k,
    scale,
    qk_scale,
    cap_scale,
    window_left,
    window_right,
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
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_sb,
    stride_sh,
    stride_delta,
    stride_dq_acc,
    H,
    GROUP,
    N_Q,
    N_K,
    TOTAL_Q,
    TOTAL_K,
    head_dim,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    VARLEN: tl.constexpr,
    GQA: tl.constexpr,
):
    """The dK/dV kernel: ``_attn_bwd_dkdv_program`` for each program, delta from the preprocess."""
    _attn_bwd_dkdv_program(
        tl.program_id(0),
        Q,
        K,
        V,
        dO,
        Delta,
        L,
        Delta,
        dK,
        dV,
        dQ_acc,
        Slopes,
        Cu_q,
        Cu_k,
        scale,
        qk_scale,
        cap_scale,
        window_left,
        window_right,
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
        0,
        0,
        0,
        0,
        stride_lb,
        stride_lh,
        stride_lm,
        stride_dkb,
        stride_dkh,
        stride_dkn,
        stride_dkd,
        stride_dvb,
        stride_dvh,
        stride_dvn,
        stride_dvd,
        stride_sb,
        stride_sh,
        stride_delta,
        stride_dq_acc,
        H,
        GROUP,
        N_Q,
        N_K,
        TOTAL_Q,
        TOTAL_K,
        head_dim,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        EVEN_D,
        ATOMIC_DQ,
        VARLEN,
        GQA,
        False,
    )


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_ptrs,
    v_ptrs,
    stride_kn,
    stride_vn,
    offs_m,
    offs_n,
    offs_d,
    head_dim,
    N_K,
    diag,
    diag_left,
    diag_right,
    qk_scale,
    cap_scale,
    alibi,
    lo,
    hi,
    IN_BAND: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dQ of one query tile over key tiles [lo, hi): masked iff IN_BAND, as in the forward."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        start_n64 = tl.cast(start_n, tl.int64)
        k = load_tile(
            k_ptrs + start_n64 * stride_kn, cols, N_K, offs_d, head_dim, IN_BAND, EVEN_D
        )  # [BLOCK_N, HEAD_DIM]
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            qk = tanh(qk * cap_scale, SOFTCAP)  # the capped score over softcap, as in the forward
        s = qk * qk_scale - lse[:, None]
        if ALIBI:
            s = s - alibi * tl.abs(offs_m[:, None] + diag - cols[None, :]).to(tl.float32)
        p = tl.math.exp2(s)
        if IN_BAND:
            # Key j is visible to query i iff j < seqlen_k and i + diag_left <= j <= i + diag_right (the
            # bounded sides); zeroing after exp2 keeps -inf out of it.
            visible = cols[None, :] < N_K
            if WINDOW_RIGHT:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_right)
            if WINDOW_LEFT:
                visible = visible & (cols[None, :] >= offs_m[:, None] + diag_left)
            p = tl.where(visible, p, 0.0)
        if SOFTCAP:
            # d(softcap · tanh(s / softcap)) / ds = 1 - tanh², folded into P before dP's product, as in the
            # dK/dV kernel.
            p = p * (1.0 - qk * qk)
        v = load_tile(
            v_ptrs + start_n64 * stride_vn, cols, N_K, offs_d, head_dim, IN_BAND, EVEN_D
        )  # [BLOCK_N, HEAD_DIM]
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    return dq


@triton.jit
def _attn_bwd_dq_program(
    pid,
    Q,
    K,
    V,
    dO,
    O,
    L,
    Delta,
    dQ,
    Slopes,
    Cu_q,
    Cu_k,
    scale,
    qk_scale,
    cap_scale,
    window_left,
    window_right,
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
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_sb,
    stride_sh,
    stride_delta,
    H,
    GROUP,
    N_Q,
    N_K,
    TOTAL_Q,
    TOTAL_K,
    head_dim,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    VARLEN: tl.constexpr,
    DELTA_FROM_O: tl.constexpr,
):
    """Program pid of the dQ kernel. Q, dO, O, dQ: (B, H, N_Q, D); K, V: (B, H // GROUP, N_K, D); L: (B, H,
    N_Q); Delta: (B·H, N_Q) at row stride stride_delta. The window, softcap, ALiBi and VARLEN arguments as the
    forward's (``_attn_fwd``). DELTA_FROM_O: delta computed from O and dO (Delta unread), else O is unread."""
    # One program per (query tile, batch·head), flattened to one grid axis, query tiles fastest and last
    # first: under causal the last query tiles see the most keys, so the longest programs start first.
    num_m_tiles = tl.cdiv(N_Q, BLOCK_M)
    off_bh = (pid // num_m_tiles).to(tl.int64)
    off_b = off_bh // H
    off_h = off_bh % H
    # Grouped-query attention: the query heads h of one group share key/value head h // GROUP.
    off_hk = off_h // GROUP
    start_m = (num_m_tiles - 1 - pid % num_m_tiles) * BLOCK_M
    # A packed batch: off_b is a sequence, and every length below is that sequence's own.
    off_bt, q_start, k_start, N_Q, N_K = sequence(Cu_q, Cu_k, off_b, N_Q, N_K, TOTAL_Q, TOTAL_K, VARLEN)
    if VARLEN:
        if start_m >= N_Q:
            return
        Q += q_start * stride_qm
        dO += q_start * stride_dom
        O += q_start * stride_om
        dQ += q_start * stride_dqm
        L += q_start * stride_lm
        Delta += q_start
        K += k_start * stride_kn
        V += k_start * stride_vn
    off_bh = off_bt * H + off_h
    # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
    diag = N_K - N_Q
    diag_left = diag - window_left
    diag_right = diag + window_right

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit offsets, as B·H·N·D can pass 2^31 elements; the key loop adds start_n · stride in 64 bits.
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    q_ptrs = Q + off_bt * stride_qb + off_h * stride_qh + offs_m64[:, None] * stride_qm + offs_d64[None, :] * stride_qd
    do_ptrs = (
        dO + off_bt * stride_dob + off_h * stride_doh + offs_m64[:, None] * stride_dom + offs_d64[None, :] * stride_dod
    )
    k_ptrs = K + off_bt * stride_kb + off_hk * stride_kh + offs_n64[:, None] * stride_kn + offs_d64[None, :] * stride_kd
    v_ptrs = V + off_bt * stride_vb + off_hk * stride_vh + offs_n64[:, None] * stride_vn + offs_d64[None, :] * stride_vd

    q = load_tile(q_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]
    do = load_tile(do_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]
    # Rows past seqlen_q: L = +inf makes their P zero. L in log2 units, as the scores.
    lse = (
        tl.load(
            L + off_bt * stride_lb + off_h * stride_lh + offs_m64 * stride_lm, mask=offs_m < N_Q, other=float("inf")
        )
        * 1.4426950408889634
    )
    if DELTA_FROM_O:
        o_ptrs = (
            O + off_bt * stride_ob + off_h * stride_oh + offs_m64[:, None] * stride_om + offs_d64[None, :] * stride_od
        )
        o = load_tile(o_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    else:
        delta = tl.load(Delta + off_bh * stride_delta + offs_m, mask=offs_m < N_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    alibi = 0.0
    if ALIBI:
        alibi = tl.load(Slopes + off_b * stride_sb + off_h * stride_sh) * 1.4426950408889634
    # The key tiles [lo, hi) that some row of this tile sees, as in the forward: [full_lo, full_hi)
    # unmasked, the tiles across the window's edges or the end of the keys masked.
    lo, full_lo, full_hi, hi = tiles_in_window(
        start_m,
        tl.minimum(start_m + BLOCK_M, N_Q),
        N_K,
        diag,
        window_left,
        window_right,
        BLOCK_N,
        WINDOW_LEFT,
        WINDOW_RIGHT,
    )
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_K,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        alibi,
        lo,
        full_lo,
        True,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_N,
        EVEN_D,
    )
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_K,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        alibi,
        full_lo,
        full_hi,
        False,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_N,
        EVEN_D,
    )
    dq = _attn_bwd_dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_ptrs,
        v_ptrs,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        offs_d,
        head_dim,
        N_K,
        diag,
        diag_left,
        diag_right,
        qk_scale,
        cap_scale,
        alibi,
        full_hi,
        hi,
        True,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_N,
        EVEN_D,
    )
    dq = dq * scale

    # Rows that see no key keep dq = 0, and store it.
    mask = offs_m[:, None] < N_Q
    if not EVEN_D:
        mask = mask & (offs_d[None, :] < head_dim)
    dq_ptrs = (
        dQ + off_bt * stride_dqb + off_h * stride_dqh + offs_m64[:, None] * stride_dqm + offs_d64[None, :] * stride_dqd
    )
    tl.store(dq_ptrs, dq.to(dQ.dtype.element_ty), mask=mask)


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    dO,
    L,
    Delta,
    dQ,
    Slopes,
    Cu_q,
    Cu_k,
    scale,
    qk_scale,
    cap_scale,
    window_left,
    window_right,
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
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_sb,
    stride_sh,
    stride_delta,
    H,
    GROUP,
    N_Q,
    N_K,
    TOTAL_Q,
    TOTAL_K,
    head_dim,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The dQ kernel: ``_attn_bwd_dq_program`` for each program, delta from the preprocess."""
    _attn_bwd_dq_program(
        tl.program_id(0),
        Q,
        K,
        V,
        dO,
        Delta,
        L,
        Delta,
        dQ,
        Slopes,
        Cu_q,
        Cu_k,
        scale,
        qk_scale,
        cap_scale,
        window_left,
        window_right,
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
        0,
        0,
        0,
        0,
        stride_lb,
        stride_lh,
        stride_lm,
        stride_dqb,
        stride_dqh,
        stride_dqm,
        stride_dqd,
        stride_sb,
        stride_sh,
        stride_delta,
        H,
        GROUP,
        N_Q,
        N_K,
        TOTAL_Q,
        TOTAL_K,
        head_dim,
        WINDOW_LEFT,
        WINDOW_RIGHT,
        SOFTCAP,
        ALIBI,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        EVEN_D,
        VARLEN,
        False,
    )


@triton.jit
def _attn_bwd_short(
    Q,
    K,
    V,
    O,
    dO,
    L,
    dQ,
    dK,
    dV,
    Slopes,
    Cu_q,
    Cu_k,
    scale,
    qk_scale,
    cap_scale,
    window_left,
    window_right,
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
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_sb,
    stride_sh,
    H,
    GROUP,
    N_Q,
    N_K,
    TOTAL_Q,
    TOTAL_K,
    head_dim,
    num_dkdv_programs,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr,
    DKDV_BLOCK_N: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr,
    DQ_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    VARLEN: tl.constexpr,
    GQA: tl.constexpr,
):
    """The whole backward in one launch, for short calls (``tiles.short_call``), whose time is the host's: the
    first num_dkdv_programs programs run the dK/dV kernel's (``_attn_bwd_dkdv_program``), the others the dQ
    kernel's (``_attn_bwd_dq_program``), each with its own tiles (DKDV_BLOCK_M/N, DQ_BLOCK_M/N), and each
    computes delta = rowsum(dO ∘ O) of its query tiles from O instead of a preprocess writing it: one launch
    where there were three, and no delta tensor. Arguments as the two kernels'; O: (B, H, N_Q, D)."""
    pid = tl.program_id(0)
    if pid < num_dkdv_programs:
        # L stands in for Delta and dQ_acc, which these programs do not read.
        _attn_bwd_dkdv_program(
            pid,
            Q,
            K,
            V,
            dO,
            O,
            L,
            L,
            dK,
            dV,
            L,
            Slopes,
            Cu_q,
            Cu_k,
            scale,
            qk_scale,
            cap_scale,
            window_left,
            window_right,
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
            stride_ob,
            stride_oh,
            stride_om,
            stride_od,
            stride_lb,
            stride_lh,
            stride_lm,
            stride_dkb,
            stride_dkh,
            stride_dkn,
            stride_dkd,
            stride_dvb,
            stride_dvh,
            stride_dvn,
            stride_dvd,
            stride_sb,
            stride_sh,
            0,
            0,
            H,
            GROUP,
            N_Q,
            N_K,
            TOTAL_Q,
            TOTAL_K,
            head_dim,
            WINDOW_LEFT,
            WINDOW_RIGHT,
            SOFTCAP,
            ALIBI,
            DKDV_BLOCK_M,
            DKDV_BLOCK_N,
            HEAD_DIM,
            EVEN_D,
            False,
            VARLEN,
            GQA,
            True,
        )
    else:
        _attn_bwd_dq_program(
            pid - num_dkdv_programs,
            Q,
            K,
            V,
            dO,
            O,
            L,
            L,
            dQ,
            Slopes,
            Cu_q,
            Cu_k,
            scale,
            qk_scale,
            cap_scale,
            window_left,
            window_right,
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
            stride_ob,
            stride_oh,
            stride_om,
            stride_od,
            stride_lb,
            stride_lh,
            stride_lm,
            stride_dqb,
            stride_dqh,
            stride_dqm,
            stride_dqd,
            stride_sb,
            stride_sh,
            0,
            H,
            GROUP,
            N_Q,
            N_K,
            TOTAL_Q,
            TOTAL_K,
            head_dim,
            WINDOW_LEFT,
            WINDOW_RIGHT,
            SOFTCAP,
            ALIBI,
            DQ_BLOCK_M,
            DQ_BLOCK_N,
            HEAD_DIM,
            EVEN_D,
            VARLEN,
            True,
        )
