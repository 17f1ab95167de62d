"""FlashAttention-2's forward as a ``triton.language`` kernel, ``_attn_fwd``: what
``forward.flash_attn_forward`` launches, on a GPU or in Triton's interpreter.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1: one program per (query tile, batch·head) loads
its BLOCK_M query rows once, visits the key/value tiles in order keeping a running row max ``m_i``, a
running row sum ``l_i`` and an unnormalised accumulator ``acc`` (all fp32), rescales both by
``alpha = exp(m_old - m_new)`` when the max moves, divides once at the end and writes O and L once.

Grouped-query attention (multi-query at heads_k = 1): k and v have heads_k heads, heads a multiple of it,
and query head h reads key/value head ``off_hk = h // group``, group = heads // heads_k, by index
arithmetic on the head as FlashAttention-2 does: K and V are never repeated or copied per query head.

Scores live in the log2 domain: ``qk_scale = scale · log2(e)`` so that ``exp2`` replaces ``exp``; the
epilogue converts back, L = (m_i + log2(l_i)) · ln(2) = m + log(l) in natural log. With scale > 0 (decided
on the host: FUSED_EXP2) the max is taken over the unscaled scores and scaled once per row, and the scale
and the subtraction of the max meet in one FMA, ``exp2(fma(qk, qk_scale, -m))``.

What to compute arrives as one ``fa2.spec.AttentionSpec`` and becomes compile-time switches: WINDOW_LEFT and
WINDOW_RIGHT (whether the window bounds that side; the sizes are runtime ints, so windows of every size
share a compilation; causal is WINDOW_RIGHT with right = 0), SOFTCAP (the softcap a runtime float) and
ALIBI (a (batch, heads) slope tensor of any strides, one slope loaded per program) and HAS_SINK (attention
sinks: a (heads,) float32 logit per head, loaded once per program, that joins every row's sum in the
epilogue as one more score with no value, so L includes it). Query i sees key j iff
i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q (bottom-right aligned, as
FlashAttention-2). With seqlen_q = 4, seqlen_k = 6 and window (1, 0)::

    0 1 1 0 0 0
    0 0 1 1 0 0
    0 0 0 1 1 0
    0 0 0 0 1 1

The key loop visits only the key tiles [lo, hi) that some row of the query tile sees (``tiles_in_window``):
tiles outside the window are never loaded, so the cost follows the window, not seqlen_q · seqlen_k. It runs
in three parts: the tiles across the window's left edge (only with WINDOW_LEFT), masked; whole key tiles
that every query row of the tile sees, loaded and used without masks; the tiles across the right edge
(under causal, the diagonal band) or past seqlen_k, masked. A row that sees no key keeps m_i = -inf; the
softmax subtracts 0 for it instead of m_i, so p and alpha stay 0 (not NaN) and the epilogue writes O = 0,
L = +inf (with a sink: O = 0, L = sink[h]).

The softcap is applied to the natural-scale score s = scale · q·k in fp32, softcap · tanh(s / softcap)
(``tanh``: from exp2 for fp32 inputs and in the interpreter, the GPU's tanh.approx for 16-bit ones), then
log2(e) is folded in: qk_scale = softcap · log2(e) plays the part scale · log2(e) plays without it. ALiBi
subtracts slope · |i + diag - j| (times log2(e)) from the capped score before the mask.

Packed batches (``spec.varlen``: flash-attn's varlen layout) run in the same kernel, one launch: VARLEN makes
the batch axis of the grid the sequences and the query-tile axis cdiv(max_seqlen_q, BLOCK_M) long; each
program reads its sequence's offsets from cu_seqlens_q and cu_seqlens_k, moves its base pointers to the
sequence's first rows and from there runs exactly the dense program with that sequence's seqlen_q and
seqlen_k (``sequence``), so windows, causal alignment, ALiBi and the tile skipping are each sequence's own;
programs whose tile starts past their sequence's end return at once. Nothing is padded and nothing syncs.
Where the tile table asks for descriptors, a packed batch gets 2-D ones built in the kernel (DEVICE_DESC)
over its sequence's rows of its head, so rows past the sequence read as zeros and are not written (a host
descriptor's bounds would be the packed tensor's); never the warp-specialised loop, which needs whole tiles.

Three ways to reach memory, one kernel (chosen on the host: ``forward.launch_kernel``). USE_TMA: tensor descriptors
(TMA on Hopper) over q's and O's (B, H, N, D) and k's and v's (B, H_K, N, D) with blocks [1, 1, BLOCK,
HEAD_DIM], where ``tiles.tma_layout`` holds (unit stride along head_dim, 16-byte aligned strides and data,
head_dim a power of two >= 16) and the tile table asks for them; a descriptor block never crosses into another
head: rows past seqlen read as zeros and are not written. WARP_SPECIALIZE: one key loop that Triton splits
into a producer warp group issuing the loads and two consumer warp groups of BLOCK_M / 2 rows, so that one
group's softmax runs while the other's matmuls do (FlashAttention-3's overlap, left to Triton's Hopper warp
specialisation); it needs descriptors built in the kernel, 2-D over the rows of contiguous inputs (q's (B·H·N,
D), k's and v's (B·H_K·N, D)), so it is taken where ``tiles.ws_layout`` holds (no window, causal included,
whole tiles; softcap and ALiBi are fine; the tile table asks for it at D = 128 from N = 2k). Otherwise pointer
loads with masks.

Two switches undo levers, for the optimisation ladder (``fa2_triton.ladder``, docs/ladder/triton.md),
and are on everywhere else: without EXP2 the scores stay in natural units (qk_scale = scale, or softcap
under a softcap) and the softmax calls ``exp`` (which Triton lowers to a multiply by log2(e) and the same
ex2.approx), the epilogue's L = m + log(l) directly (no sink: the host refuses one); without SPLIT_LOOP the
key loop is the seed's single loop, every visited tile masked (the tiles every row sees whole are visited
by the masked loop too, and the unmasked loop is not compiled).

Credits: the structure and names follow Triton's tutorial ``06-fused-attention.py`` (Tillet et al.); the
log2-domain softmax, the fused max subtraction, the unmasked/masked split of the key loop and the host-side
tensor descriptors are from there too. Masking on padded head dims as in Tri Dao's ``flash_attn_triton.py``.
The lazy rescale (threshold 8 in log2 units) is FlashAttention-4's. Warp specialisation with descriptors
built in the kernel follows what Triton's Hopper warp specialisation supports (triton-lang/triton#7658).

Limits: ALiBi distances are exact in fp32 up to 2^24 keys; the softcap's tanh has an absolute error of a
few fp32 ulps of 1 for fp32 inputs, a relative error up to 2^-10.99 for fp16 and bf16 ones on a GPU.
head_dim a multiple of 8 from 8 to 256 (HEAD_DIM, the tile width, is padded to a power of two >= 16 and
masked); float32, float16, bfloat16. CUDA tensors, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment when this module is imported; the interpreter runs both
descriptor paths too, the warp-specialised loop unspecialised). The warp-specialised loop asks Triton's
allocator for its descriptors' global memory (``launch.scratch_allocator``: torch's, during the launch).
No ``tl.make_block_ptr`` (removed in Triton 3.9): the kernel compiles on Triton 3.6 and later. Both
matmuls ask for ``input_precision="ieee"``: fp32 inputs get no TF32 (FMA matmuls); fp16 and bf16 products
are exact in fp32, so those still run on tensor cores (wgmma on Hopper) with fp32 accumulation, p rounded
to v's dtype for the second.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fa2_triton.common import load_tile, sequence, tanh, tiles_in_window

# LAZY_RESCALE keeps a row's max until a tile's is this much larger (log2 units): p <= 2^8 (FA4's choice).
RESCALE_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    stride_kn,
    stride_vn,
    off_b,
    off_hk,
    kv_row,
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
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    FUSED_EXP2: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
    EXP2: tl.constexpr,
):
    """The online softmax over key tiles [lo, hi): masked iff IN_BAND. k_src, v_src: 4-D tensor descriptors
    read at key/value head off_hk (USE_TMA), 2-D ones built in the kernel whose rows of this batch and
    key/value head start at kv_row (DEVICE_DESC), or [BLOCK_N, HEAD_DIM] pointers to the first key tile of
    that head. Key j is visible to query i iff j < seqlen_k, j >= i + diag_left (WINDOW_LEFT) and
    j <= i + diag_right (WINDOW_RIGHT). SOFTCAP: tanh of the scores times cap_scale (scale / softcap, for
    ``tanh``), qk_scale then softcap · log2(e). ALIBI: alibi (slope · log2(e), over qk_scale with FUSED_EXP2) times
    |i + diag - j| comes off the scores. EXP2: log2 units and exp2; else natural units and exp (then
    never FUSED_EXP2)."""
    # side-by-side: scores
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if DEVICE_DESC:
            k = k_src.load([kv_row + start_n, 0])
        elif USE_TMA:
            # Rows past seqlen_k come back as zeros (the descriptor's bounds); the band masks their scores.
            k = k_src.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = load_tile(
                k_src + tl.cast(start_n, tl.int64) * stride_kn, cols, N_K, offs_d, head_dim, IN_BAND, EVEN_D
            )  # [BLOCK_N, HEAD_DIM]
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        # side-by-side: end
        # side-by-side: softcap
        if SOFTCAP:
            # softcap · tanh(scale · q·k / softcap) in fp32: tanh here, its factor softcap (times log2(e)) is
            # qk_scale, applied below or inside exp2 as without a cap.
            qk = tanh(qk * cap_scale, SOFTCAP)
        # side-by-side: end
        if not FUSED_EXP2:
            qk = qk * qk_scale  # log2 units (natural units without EXP2)
        # side-by-side: alibi
        if ALIBI:
            # -slope · |i + diag - j|, in the units qk is in here (log2, or log2 over qk_scale when fused).
            distance = tl.abs(offs_m[:, None] + diag - cols[None, :]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
            qk = qk - alibi * distance
        # side-by-side: end
        # side-by-side: mask
        if IN_BAND:
            # Key j is visible to query i iff j < seqlen_k and i + diag_left <= j <= i + diag_right (the
            # bounded sides only).
            visible = cols[None, :] < N_K
            if WINDOW_RIGHT:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_right)
            if WINDOW_LEFT:
                visible = visible & (cols[None, :] >= offs_m[:, None] + diag_left)
            qk = tl.where(visible, qk, float("-inf"))
        # side-by-side: end

        # side-by-side: softmax
        if FUSED_EXP2:
            # qk_scale > 0, so the max commutes with it (and -inf stays -inf): the scaled max, then scale
            # and subtract in one FMA.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        if LAZY_RESCALE:
            # Keep a row's old max unless the new one is more than RESCALE_THRESHOLD above it: p stays
            # <= 2^RESCALE_THRESHOLD (no overflow in fp32 or in v's dtype; O and L are unchanged, as l_i,
            # acc and L all use the same m_i), and most tiles skip the rescale.
            m_new = tl.where(m_new - m_i > RESCALE_THRESHOLD, m_new, m_i)
        # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2() at 0, not
        # NaN. Off the band too: a key tile that the causal mask leaves whole can still hold only -inf
        # scores (keys of -inf in the input).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if FUSED_EXP2:
            p = tl.math.exp2(tl.math.fma(qk, qk_scale, -m_safe[:, None]))
            alpha = tl.math.exp2(m_i - m_safe)
        elif EXP2:
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        else:
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)

        if LAZY_RESCALE:
            # One branch for the whole tile: rescale acc only if some row's max moved.
            if tl.max((m_new != m_i).to(tl.int32), 0) != 0:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        if DEVICE_DESC:
            v = v_src.load([kv_row + start_n, 0])
        elif USE_TMA:
            v = v_src.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            v = load_tile(
                v_src + tl.cast(start_n, tl.int64) * stride_vn, cols, N_K, offs_d, head_dim, IN_BAND, EVEN_D
            )  # [BLOCK_N, HEAD_DIM]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        # side-by-side: end
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    O,
    L,
    Slopes,
    Sink,
    Cu_q,
    Cu_k,
    qk_scale,
    cap_scale,
    alibi_scale,
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
    stride_lb,
    stride_lh,
    stride_lm,
    stride_sb,
    stride_sh,
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
    HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    FUSED_EXP2: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    GRID_ORDER: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    VARLEN: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
    EXP2: tl.constexpr,
    SPLIT_LOOP: tl.constexpr,
):
    """Q, K, V, O: pointers, or with USE_TMA tensor descriptors of blocks [1, 1, BLOCK, HEAD_DIM], Q's and O's
    over (B, H, N_Q, D), K's and V's over (B, H // GROUP, N_K, D) (their strides are then unused).
    WARP_SPECIALIZE (never with a window): contiguous pointers of those shapes with seqlen_q a multiple of
    BLOCK_M and seqlen_k of BLOCK_N, read and written through descriptors built here. GROUP: query heads
    per key/value head, a runtime int so that group sizes share compilations (Triton still specialises on
    GROUP = 1, where the divisions by it fold away). window_left, window_right: runtime ints, read only
    where WINDOW_LEFT, WINDOW_RIGHT bound that side (causal: WINDOW_RIGHT with window_right = 0). SOFTCAP
    (SOFTCAP_EXP2 or SOFTCAP_APPROX, see ``tanh``): cap_scale = scale / softcap (· 2·log2(e) for
    SOFTCAP_EXP2), qk_scale = softcap · log2(e). ALIBI: Slopes (B, H) float32 at
    strides (stride_sb, stride_sh), each program's slope times alibi_scale (log2(e), over qk_scale with
    FUSED_EXP2). VARLEN (pointer loads only): a packed batch, Q, O (1, H, total_q, D), K, V (1, H // GROUP,
    total_k, D), L (1, H, total_q), sequence b's rows [Cu_q[b], Cu_q[b + 1]) and [Cu_k[b], Cu_k[b + 1]),
    int32 offsets; N_Q and N_K are then the longest sequence's lengths, the batch the sequences, Slopes
    (num_seqs, H); programs whose query tile starts past their sequence's end return at once. HAS_SINK: Sink
    (H,) float32, sink[h] added to each row's sum of exp(scores) before the division and L. DEVICE_DESC:
    q, k, v and O read and written through 2-D descriptors built here (with WARP_SPECIALIZE, or for a
    packed batch: over one sequence's rows of one head, unit stride along D, the other strides multiples
    of 16 bytes). EXP2 (else natural units and exp, no sink) and SPLIT_LOOP (else one masked loop, never
    with WARP_SPECIALIZE): see the module's docstring."""
    # One program per (query tile, batch·head), flattened to one grid axis; GRID_ORDER picks the order.
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(N_Q, BLOCK_M)
    if GRID_ORDER == 2:
        # Batch·heads fastest, the last (under causal the longest) query tiles of every head first.
        num_bh = tl.num_programs(0) // num_m_tiles
        off_bh = pid % num_bh
        tile_m = num_m_tiles - 1 - pid // num_bh
    else:
        # Query tiles fastest (the programs running together share K and V in L2); GRID_ORDER 1: last first.
        off_bh = pid // num_m_tiles
        tile_m = pid % num_m_tiles
        if GRID_ORDER == 1:
            tile_m = num_m_tiles - 1 - tile_m
    off_b = off_bh // H
    off_h = off_bh % H
    start_m = tile_m * BLOCK_M
    # side-by-side: varlen
    # A packed batch: off_b is a sequence, and every length below is that sequence's own.
    off_bt, q_start, k_start, N_Q, N_K = sequence(Cu_q, Cu_k, off_b, N_Q, N_K, TOTAL_Q, TOTAL_K, VARLEN)
    if VARLEN:
        if start_m >= N_Q:
            return
        Q += q_start * stride_qm
        O += q_start * stride_om
        L += q_start * stride_lm
        K += k_start * stride_kn
        V += k_start * stride_vn
    # side-by-side: end
    # side-by-side: group
    # Grouped-query attention: the query heads h of one group share key/value head h // GROUP.
    off_hk = off_h // GROUP
    kv_row = (off_b * (H // GROUP) + off_hk) * N_K
    # side-by-side: end
    # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right.
    diag = N_K - N_Q

    # side-by-side: state
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if WARP_SPECIALIZE:
        # Triton's Hopper warp specialisation splits the query rows over two consumer warp groups only for
        # descriptors built on the device and one key loop. 2-D over the (B·H·N_Q, D) rows of q and the
        # (B·H_K·N_K, D) rows of k and v: no tile crosses into another head, as BLOCK_M divides seqlen_q and
        # BLOCK_N seqlen_k.
        num_bh = tl.num_programs(0) // num_m_tiles
        num_bhk = num_bh // GROUP
        q_desc = tl.make_tensor_descriptor(Q, [num_bh * N_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(K, [num_bhk * N_K, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(V, [num_bhk * N_K, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        q = q_desc.load([off_bh * N_Q + start_m, 0])
    elif DEVICE_DESC:
        # A packed batch through descriptors bounded by this sequence's rows of this head: rows past the
        # sequence read as zeros and are not written, so no tile reaches into the next sequence. A
        # sequence without keys gets a one-row bound, never read.
        q_desc = tl.make_tensor_descriptor(
            Q + off_h.to(tl.int64) * stride_qh, [N_Q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM]
        )
        k_src = tl.make_tensor_descriptor(
            K + off_hk.to(tl.int64) * stride_kh, [tl.maximum(N_K, 1), HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM]
        )
        v_src = tl.make_tensor_descriptor(
            V + off_hk.to(tl.int64) * stride_vh, [tl.maximum(N_K, 1), HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM]
        )
        kv_row = 0
        q = q_desc.load([start_m, 0])
    elif USE_TMA:
        q = Q.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        k_src = K
        v_src = V
    else:
        # 64-bit offsets, as B·H·N·D can pass 2^31 elements; the key loop adds start_n · stride in 64 bits.
        off_b64 = tl.cast(off_bt, tl.int64)
        off_h64 = off_h.to(tl.int64)
        off_hk64 = off_hk.to(tl.int64)
        offs_m64 = offs_m.to(tl.int64)
        offs_n64 = offs_n.to(tl.int64)
        offs_d64 = offs_d.to(tl.int64)
        q_ptrs = (
            Q
            + off_b64 * stride_qb
            + off_h64 * stride_qh
            + offs_m64[:, None] * stride_qm
            + offs_d64[None, :] * stride_qd
        )
        k_src = (
            K
            + off_b64 * stride_kb
            + off_hk64 * stride_kh
            + offs_n64[:, None] * stride_kn
            + offs_d64[None, :] * stride_kd
        )
        v_src = (
            V
            + off_b64 * stride_vb
            + off_hk64 * stride_vh
            + offs_n64[:, None] * stride_vn
            + offs_d64[None, :] * stride_vd
        )
        q = load_tile(q_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # side-by-side: end
    alibi = 0.0
    if ALIBI:
        # One slope per (batch, head), loaded once per program.
        alibi = tl.load(Slopes + off_b.to(tl.int64) * stride_sb + off_h.to(tl.int64) * stride_sh) * alibi_scale

    # side-by-side: window
    # Only the key tiles [lo, hi) that some row of this tile sees are visited: the window's two edges
    # become the loop's bounds, and tiles outside them are never loaded. Between them, the tiles
    # [full_lo, full_hi) that every row sees whole run unmasked; the ones across the left edge
    # [lo, full_lo) and across the right edge or the end of the keys [full_hi, hi) are masked. Causal
    # is the case lo = full_lo = 0 (no left edge) with window_right = 0.
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
    diag_left = diag - window_left
    diag_right = diag + window_right
    if not SPLIT_LOOP:
        # The seed's one loop: every tile from lo to hi masked, the whole ones too.
        full_lo = lo
        full_hi = lo
    # side-by-side: end

    # side-by-side: loop
    if WINDOW_LEFT:  # never warp-specialised (one key loop only)
        acc, l_i, m_i = _attn_fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            stride_kn,
            stride_vn,
            off_b,
            off_hk,
            kv_row,
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
            HEAD_DIM,
            EVEN_D,
            USE_TMA,
            FUSED_EXP2,
            LAZY_RESCALE,
            False,
            DEVICE_DESC,
            EXP2,
        )
    if SPLIT_LOOP:  # the tiles every row sees whole, unmasked
        acc, l_i, m_i = _attn_fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            stride_kn,
            stride_vn,
            off_b,
            off_hk,
            kv_row,
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
            HEAD_DIM,
            EVEN_D,
            USE_TMA,
            FUSED_EXP2,
            LAZY_RESCALE,
            WARP_SPECIALIZE,
            DEVICE_DESC,
            EXP2,
        )
    if not WARP_SPECIALIZE:  # no band then (BLOCK_N divides seqlen_k), and a second loop would not compile
        acc, l_i, m_i = _attn_fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            stride_kn,
            stride_vn,
            off_b,
            off_hk,
            kv_row,
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
            HEAD_DIM,
            EVEN_D,
            USE_TMA,
            FUSED_EXP2,
            LAZY_RESCALE,
            False,
            DEVICE_DESC,
            EXP2,
        )
    # side-by-side: end

    # side-by-side: sink
    if HAS_SINK:
        # The sink joins the row's sum as one more score, sink[h] · log2(e) in log2 units, that no value
        # follows: one more step of the online softmax, with a single column and nothing added to acc.
        # acc stays in the old max's units and alpha joins the epilogue's scale, so acc is read once there
        # (one pass over the tile fewer than rescaling it here).
        # l_i > 0 after it, so a row that saw no key (m_i = -inf, l_i = 0) gets O = 0 and L = sink[h].
        sink = tl.load(Sink + off_h) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        m_i = m_new
    # side-by-side: end

    # side-by-side: epilogue
    # Rows that saw no key have l_i = 0: O = 0 and L = +inf (see fa2.attention).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if HAS_SINK:
        acc = acc * (alpha / l_safe)[:, None]
    else:
        acc = acc / l_safe[:, None]
    if EXP2:
        # m_i + log2(l_i) is the log2-domain logsumexp; times ln(2) it is the natural-log one.
        lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    else:
        lse = tl.where(empty, float("inf"), m_i + tl.log(l_safe))

    l_ptrs = L + tl.cast(off_bt, tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_lm
    tl.store(l_ptrs, lse, mask=offs_m < N_Q)
    if WARP_SPECIALIZE:
        o_desc = tl.make_tensor_descriptor(O, [num_bh * N_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
        o_desc.store([off_bh * N_Q + start_m, 0], acc.to(O.dtype.element_ty))
    elif DEVICE_DESC:
        o_desc = tl.make_tensor_descriptor(
            O + off_h.to(tl.int64) * stride_oh, [N_Q, HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM]
        )
        o_desc.store([start_m, 0], acc.to(O.dtype.element_ty))
    elif USE_TMA:
        # Rows past seqlen_q fall outside the descriptor's bounds and are not written.
        O.store([off_b, off_h, start_m, 0], acc.to(O.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    else:
        o_ptrs = (
            O
            + off_b64 * stride_ob
            + off_h64 * stride_oh
            + offs_m64[:, None] * stride_om
            + offs_d64[None, :] * stride_od
        )
        o_mask = offs_m[:, None] < N_Q
        if not EVEN_D:
            o_mask = o_mask & (offs_d[None, :] < head_dim)
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)
    # side-by-side: end
