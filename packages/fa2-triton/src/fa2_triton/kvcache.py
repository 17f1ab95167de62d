"""Attention against a KV cache as Triton kernels: split-KV (flash-decoding) over contiguous or paged caches.

Decoding asks a few query tokens against a long cache: the forward's grid, one program per (query tile,
batch·head), would have batch·heads programs each reading its whole cache, too few to keep the GPU's memory
busy, and the query heads of one group would each read the same keys again. Here one program owns a
(key range, batch row, key/value head) and takes every query of the group, all seqlen_q tokens of the
GROUP query heads that share the key/value head, as the rows of its tile, row r being token r // GROUP of
query head hk · GROUP + r % GROUP: each cached key is read once per key/value head, and the key ranges
(splits) make batch · heads_k · splits programs, enough to fill the GPU when batch · heads_k alone is not.

``_kvcache_fwd`` runs the FA2 online softmax of ``forward_tl.py`` (log2 domain, the same softcap, ALiBi and
mask arithmetic) over the key tiles of its range that some row sees, and writes either the final O and L
(one split) or its range's O (normalised, fp32) and L into a workspace, one allocation for every split. The
last program of a (batch row, key/value head, row tile) to finish its split, told by an atomic count, then
merges the splits' results in the same launch, and zeroes its count again for the next launch:
L = log Σ_s exp(L_s), O = Σ_s exp(L_s - L) · O_s (``fa2.combine``'s merge), ranges a row sees no key of
(L_s = +inf) weighing nothing; a sink (HAS_SINK) joins there once, as one more part with L_s = sink[h] and
O_s = 0 (with one split, in the program's own epilogue, as ``forward_tl``'s). One launch, not a split kernel
and a combine kernel: a Triton launch is the largest item of a decode step's host time (an H200 probe at
10d37e2, calls back to back: 54.5 µs for the split kernel's launch, 30.8 for the combine's).

Row b of q attends to keys [0, K_b) of its cache, K_b = cache_seqlens[b], and query i sees key j iff
leftpad_b <= j < K_b and i + K_b - Nq - left <= j <= i + K_b - Nq + right (the bounded sides only). With
Nq = 2, K_b = 6, leftpad_b = 1 and window (2, 0)::

    0 1 1 1 0 0
    0 0 1 1 1 0        (K_b = 6: the last key is 5; query 1 sees 3, 4, 5 ... and 5 only if right >= 0)

Key j of row b lives, in a contiguous cache, at row j of cache entry cache_batch_idx[b] (or b); in a paged
one (PAGED), at row j % PAGE_SIZE of page block_table[b, j // PAGE_SIZE]: looked up once per key tile
where the page size is a multiple of the tile's BLOCK_N, else per key row, so any page size works.
PAGE_SIZE is a compile-time constant (a compilation per page size met, the divisions by it shifts for
powers of two). Every index read from the device (cache_seqlens,
cache_leftpad, cache_batch_idx, the block table, cu_seqlens_q) is clamped into its tensor: wrong values
give wrong rows, never accesses outside the tensors. Nothing is read on the host and nothing but torch's
allocator allocates, so a call can be captured in a CUDA graph.

Limits: head_dim from 1 to 256 (HEAD_DIM pads it to a power of two >= 16, masked); float32, float16,
bfloat16 (not bfloat16 in the interpreter, as the forward); forward only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fa2.spec import AttentionSpec
from fa2_triton.common import INTERPRETED, LOG2_E, MAX_HEAD_DIM, check_device, score_args, sequence_rows, tanh
from fa2_triton.launch import Plans, arg_classes, launch_planned, on_device
from fa2_triton.tiles import Tiles


@triton.jit
def _kvcache_fwd(
    Q,
    K,
    V,
    O,
    L,
    Work,
    Counter,
    Slopes,
    Sink,
    Seqlens,
    Leftpad,
    BatchIdx,
    BlockTable,
    Cu_q,
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
    stride_tb,
    stride_tp,
    H,
    GROUP,
    N_Q,
    TOTAL_Q,
    CAPACITY,
    NUM_ROWS,
    CHUNK,
    NUM_SPLITS,
    ROWS,
    head_dim,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    HAS_SINK: tl.constexpr,
    LEFTPAD: tl.constexpr,
    BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr,
    FENCE: tl.constexpr,
):
    """One program per (split, batch row, key/value head, tile of GROUP · seqlen_q query rows).

    Q: (B, H, N_Q, D) (VARLEN: (1, H, TOTAL_Q, D), row b's queries [Cu_q[b], Cu_q[b + 1]), N_Q the
    longest). K, V: (NUM_ROWS, H // GROUP, CAPACITY, D) contiguous-cache entries, or PAGED (NUM_ROWS pages,
    H // GROUP, PAGE_SIZE, D) with BlockTable (B, CAPACITY // PAGE_SIZE). Seqlens (B,) int32: K_b; Leftpad,
    BatchIdx (B,) int32 where LEFTPAD, BATCH_IDX. O (q's shape and dtype) and L (q's shape but the last
    dim), L contiguous. Split s visits keys [s · CHUNK, (s + 1) · CHUNK), CHUNK a multiple of BLOCK_N.
    SPLIT (NUM_SPLITS > 1): each split writes its own softmax's result into Work, fp32, laid out as L's
    rows (R = L's numel): L_s of row r at Work[s · R + r], O_s at Work[NUM_SPLITS · R + (s · R + r) ·
    head_dim + d]; the last split of a (batch row, key/value head, row tile) to finish, counted by an atomic
    on its int32 Counter entry (zero before the launch), merges them all into O and L and sets its Counter
    entry back to zero, so that the next launch can use the same counters. Otherwise each program writes O
    and L itself. FENCE (on a GPU): each thread fences its partial stores before the count.
    The score arguments and HAS_SINK (Sink (H,) float32) as ``_attn_fwd``'s (FUSED_EXP2 always off here:
    the scale is applied before the max); with SPLIT the sink joins in the merge only."""
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    rest = pid // NUM_SPLITS
    HK = H // GROUP
    off_hk = rest % HK
    rest = rest // HK
    num_b = tl.num_programs(0) // (NUM_SPLITS * HK * tl.cdiv(GROUP * N_Q, BLOCK_M))
    off_b = rest % num_b
    tile_m = rest // num_b

    # side-by-side: rows
    # This row's queries (a packed batch: its sequence's) and keys, every index clamped into its tensor.
    if VARLEN:
        q_start, n_q = sequence_rows(Cu_q, off_b, TOTAL_Q)
        off_bt = 0
    else:
        q_start = 0
        n_q = N_Q
        off_bt = off_b
    n_rows = GROUP * n_q
    start_r = tile_m * BLOCK_M
    if start_r >= n_rows:
        return
    seqlen_k = tl.minimum(tl.maximum(tl.load(Seqlens + off_b), 0), CAPACITY)
    first_k = 0
    if LEFTPAD:
        first_k = tl.minimum(tl.maximum(tl.load(Leftpad + off_b), 0), seqlen_k)
    if PAGED:
        cache_row = 0
    elif BATCH_IDX:
        cache_row = tl.minimum(tl.maximum(tl.load(BatchIdx + off_b), 0), NUM_ROWS - 1).to(tl.int64)
    else:
        cache_row = off_b.to(tl.int64)
    # side-by-side: end

    # side-by-side: group
    # Row r of the tile: token r // GROUP of query head off_hk · GROUP + r % GROUP.
    offs_r = start_r + tl.arange(0, BLOCK_M)
    offs_i = offs_r // GROUP
    offs_h = off_hk * GROUP + offs_r % GROUP
    row_ok = offs_r < n_rows
    # side-by-side: end
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < head_dim
    diag = seqlen_k - n_q

    q_ptrs = (
        Q
        + tl.cast(off_bt, tl.int64) * stride_qb
        + offs_h.to(tl.int64)[:, None] * stride_qh
        + (q_start + offs_i).to(tl.int64)[:, None] * stride_qm
        + offs_d.to(tl.int64)[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    alibi = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        alibi = (
            tl.load(Slopes + off_b.to(tl.int64) * stride_sb + offs_h.to(tl.int64) * stride_sh, mask=row_ok, other=0.0)
            * alibi_scale
        )

    # side-by-side: range
    # The keys some row of the tile sees, cut to this split's range: whole tiles of the split, skipped
    # entirely outside the window.
    first_i = start_r // GROUP
    last_i = (tl.minimum(start_r + BLOCK_M, n_rows) - 1) // GROUP
    lo = first_k
    hi = seqlen_k
    if WINDOW_LEFT:
        lo = tl.maximum(lo, first_i + diag - window_left)
    if WINDOW_RIGHT:
        hi = tl.minimum(hi, last_i + diag + window_right + 1)
    lo = tl.maximum(lo, split * CHUNK) // BLOCK_N * BLOCK_N
    hi = tl.minimum(hi, (split + 1) * CHUNK)
    # side-by-side: end

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kv_head = off_hk.to(tl.int64)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # Keys outside [first_k, hi) are not loaded: unused cache slots may hold anything (NaN from
        # torch.empty), and 0 · NaN in P·V would reach O.
        load_ok = (cols >= first_k) & (cols < hi)
        # side-by-side: pages
        if PAGED and PAGE_SIZE % BLOCK_N == 0:
            # The tile lies in one page: one lookup, and the tile's rows are consecutive rows of the page.
            page = tl.load(BlockTable + off_b.to(tl.int64) * stride_tb + (start_n // PAGE_SIZE) * stride_tp)
            page = tl.minimum(tl.maximum(page, 0), NUM_ROWS - 1).to(tl.int64)
            slots = (start_n % PAGE_SIZE + offs_n).to(tl.int64)
            k_rows = page * stride_kb + slots * stride_kn
            v_rows = page * stride_vb + slots * stride_vn
        elif PAGED:
            # Pages smaller than a tile, or not dividing it: each key row's page from the block table (a
            # vector of one id per page, reshaped to the rows, ran at a third of this speed on the H200).
            page = tl.load(
                BlockTable + off_b.to(tl.int64) * stride_tb + (cols // PAGE_SIZE) * stride_tp, mask=load_ok, other=0
            )
            page = tl.minimum(tl.maximum(page, 0), NUM_ROWS - 1).to(tl.int64)
            k_rows = page * stride_kb + (cols % PAGE_SIZE).to(tl.int64) * stride_kn
            v_rows = page * stride_vb + (cols % PAGE_SIZE).to(tl.int64) * stride_vn
        else:
            k_rows = cache_row * stride_kb + cols.to(tl.int64) * stride_kn
            v_rows = cache_row * stride_vb + cols.to(tl.int64) * stride_vn
        # side-by-side: end
        kv_mask = load_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + kv_head * stride_kh + k_rows[:, None] + offs_d.to(tl.int64)[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            qk = tanh(qk * cap_scale, SOFTCAP)
        qk = qk * qk_scale  # log2 units
        if ALIBI:
            distance = tl.abs(offs_i[:, None] + diag - cols[None, :]).to(tl.float32)
            qk = qk - alibi[:, None] * distance
        # side-by-side: mask
        visible = (cols[None, :] >= first_k) & (cols[None, :] < seqlen_k) & row_ok[:, None]
        if WINDOW_RIGHT:
            visible = visible & (cols[None, :] <= offs_i[:, None] + diag + window_right)
        if WINDOW_LEFT:
            visible = visible & (cols[None, :] >= offs_i[:, None] + diag - window_left)
        qk = tl.where(visible, qk, float("-inf"))
        # side-by-side: end
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        v = tl.load(
            V + kv_head * stride_vh + v_rows[:, None] + offs_d.to(tl.int64)[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # side-by-side: kv-sink
    if HAS_SINK and not SPLIT:
        # The sink, one more score per row (its query head's, log2 units) with no value, as in
        # forward_tl._attn_fwd. Splits leave it to the merge, which counts it once.
        sink = tl.load(Sink + offs_h, mask=row_ok, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        m_i = m_new
    # side-by-side: end
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    rows64 = (q_start + offs_i).to(tl.int64)
    heads64 = offs_h.to(tl.int64)
    d64 = offs_d.to(tl.int64)[None, :]
    l_rows = tl.cast(off_bt, tl.int64) * stride_lb + heads64 * stride_lh + rows64 * stride_lm
    o_rows = (
        tl.cast(off_bt, tl.int64) * stride_ob
        + heads64[:, None] * stride_oh
        + rows64[:, None] * stride_om
        + d64 * stride_od
    )
    O_parts = Work + tl.cast(NUM_SPLITS, tl.int64) * ROWS
    if SPLIT:
        # This split's result, at its rows of L's order in Work (fp32): R L_s rows, then R O_s rows.
        l_part = split.to(tl.int64) * ROWS + l_rows
        tl.store(Work + l_part, lse, mask=row_ok)
        tl.store(O_parts + l_part[:, None] * head_dim + d64, acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(L + l_rows, lse, mask=row_ok)
        tl.store(O + o_rows, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    # side-by-side: combine
    if SPLIT:
        # The last of this tile's splits to finish merges them all: the partial stores of every thread
        # made visible, then one atomic count per program.
        if FENCE:
            _fence(offs_r)
        tl.debug_barrier()
        tile = (off_b * HK + off_hk) * tl.cdiv(GROUP * N_Q, BLOCK_M) + tile_m
        if tl.atomic_add(Counter + tile, 1, sem="acq_rel") == NUM_SPLITS - 1:
            # L = logsumexp_s L_s, O = sum_s exp(L_s - L) O_s; a split that saw no key (L_s = +inf) weighs 0.
            m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for s in range(0, NUM_SPLITS):
                l_s = tl.load(Work + s * ROWS + l_rows, mask=row_ok, other=float("inf"), cache_modifier=".cg")
                m = tl.maximum(m, tl.where(l_s == float("inf"), float("-inf"), l_s))
            if HAS_SINK:
                # The sink joins once, here, as one more part with L_s = sink[h] and O_s = 0.
                sink = tl.load(Sink + offs_h, mask=row_ok, other=0.0)
                m = tl.maximum(m, sink)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            out = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for s in range(0, NUM_SPLITS):
                l_s = tl.load(Work + s * ROWS + l_rows, mask=row_ok, other=float("inf"), cache_modifier=".cg")
                w = tl.where(l_s == float("inf"), 0.0, tl.exp(l_s - m_safe))
                o_s = tl.load(
                    O_parts + (s * ROWS + l_rows)[:, None] * head_dim + d64,
                    mask=(w > 0.0)[:, None] & d_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                out += w[:, None] * o_s
                total += w
            if HAS_SINK:
                total += tl.exp(sink - m_safe)
            none = total == 0.0
            out = out / tl.where(none, 1.0, total)[:, None]
            lse = tl.where(none, float("inf"), m_safe + tl.log(tl.where(none, 1.0, total)))
            tl.store(L + l_rows, lse, mask=row_ok)
            tl.store(O + o_rows, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            # Every split of the tile has counted: the entry is this program's to reset.
            tl.store(Counter + tile, 0)
    # side-by-side: end


@triton.jit
def _fence(x):
    """A GPU-scope acquire-release fence in every thread (PTX fence.acq_rel.gpu): its stores before it are
    seen before anything after it, the release half of the split count. x only carries the call."""
    tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n mov.b32 $0, $1;", "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1
    )


def kvcache_forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim), any strides; with spec.cu_seqlens_q, (1, heads, total_q,
            head_dim), batch being the sequences.
        k_cache, v_cache: (batch_cache, heads_k, seqlen_cache, head_dim), or with spec.block_table
            (num_pages, heads_k, page_size, head_dim); any strides; heads a multiple of heads_k.
        spec: the scale, window, softcap, ALiBi slopes ((batch, heads)) and sink as ``flash_attn_forward``'s, and
            the cache fields (``fa2.spec.AttentionSpec``): cache_seqlens (batch,) int32 (K_b, always
            given), cache_leftpad, cache_batch_idx, block_table, num_splits (0: ``num_splits``).

    Returns:
        O: q's shape and dtype, contiguous; L: q.shape[:-1], float32. Rows that see no key: O = 0, L = +inf
        (L = sink[h] with a sink).

    Raises:
        NotImplementedError: head_dim above 256; bfloat16 under the interpreter.
        RuntimeError: tensors on a device this build of the kernels cannot run on.
    """
    seqlen_t, head_dim = q.shape[2:]
    check_device(q)
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-triton's KV-cache kernel supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    O = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    L = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    batch = spec.cache_seqlens.numel()
    seqlen_q = spec.max_seqlen_q if spec.varlen else seqlen_t
    heads_k = k_cache.shape[1]
    if O.numel() == 0 or batch == 0 or seqlen_q == 0 or heads_k == 0:
        if O.numel():
            O.zero_()
            L.fill_(float("inf"))
        return O, L
    slopes, sink, table = spec.alibi_slopes, spec.sink, spec.block_table
    leftpad, batch_idx, cu_q = spec.cache_leftpad, spec.cache_batch_idx, spec.cu_seqlens_q
    key = (
        q.shape,
        q.stride(),
        k_cache.shape,
        k_cache.stride(),
        v_cache.stride(),
        q.dtype,
        q.device,
        batch,
        seqlen_q,
        spec.scale,
        spec.window,
        spec.softcap,
        spec.num_splits,
        None if slopes is None else slopes.stride(),
        sink is None,
        leftpad is None,
        batch_idx is None,
        None if table is None else (table.shape, table.stride()),
        cu_q is None,
    )
    plan = _LAUNCHES.get(key)
    if plan is None:
        plan = _LAUNCHES.keep(key, _launch_plan(q, k_cache, v_cache, O, L, spec, batch, seqlen_q))
    stand_in = spec.cache_seqlens
    if plan.splits > 1:
        # One allocation for the splits' results, and counters that the kernel leaves at zero.
        work = torch.empty(plan.work, device=q.device, dtype=torch.float32)
        counter = _counters(q.device, plan.grid // plan.splits)
    else:
        work, counter = L, stand_in
    tensors = (
        q,
        k_cache,
        v_cache,
        O,
        L,
        work,
        counter,
        stand_in if slopes is None else slopes,
        stand_in if sink is None else sink,
        stand_in,
        stand_in if leftpad is None else leftpad,
        stand_in if batch_idx is None else batch_idx,
        stand_in if table is None else table,
        stand_in if cu_q is None else cu_q,
    )
    with on_device(q.device):
        launch_planned(
            _kvcache_fwd, plan.grid, tensors, plan.scalars, plan.scalar_classes, plan.constexprs, plan.options
        )
    return O, L


# (device, stream) -> int32 counters, zero between launches: the split kernel's last program of a tile
# resets the entry it counted on. A launch on one stream runs after the previous one, so the stream's
# counters are free again when it starts; launches on other streams have their own. Not under a CUDA-graph
# capture: there each call allocates (and the graph zeroes) its own, so that graphs replayed side by side
# never share counters.
_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros for the split kernel's counts, on device and for its current stream. Saves a
    zero fill per call (torch.zeros: 8.6 µs of host time a call on the H200, behind a busy GPU)."""
    if device.type != "cuda":
        key = (device, 0)
    elif torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, device=device, dtype=torch.int32)
    else:
        key = (device, triton.runtime.driver.active.get_current_stream(device.index))
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < n:
        counters = _COUNTERS[key] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return counters


class _Launch(NamedTuple):
    """A ``kvcache_forward`` launch but for its tensors, kept per class of inputs (``_LAUNCHES``)."""

    splits: int
    grid: int
    # The workspace's fp32 elements (splits > 1).
    work: int
    # The launch's arguments after its tensors, and their classes (``fa2_triton.launch.arg_classes``).
    scalars: tuple
    scalar_classes: tuple
    constexprs: dict
    options: dict


# (q's shape and strides, the caches' shape and strides, dtype, device, batch, seqlen_q, the spec's scale,
# window, softcap and num_splits, the ALiBi slopes' strides, the block table's shape and strides, which
# optional tensors are given) -> _Launch: everything its scalars, constexprs and their classes depend on.
# The tensors' classes (dtype, alignment) are taken on every call (``launch_planned``).
_LAUNCHES = Plans()


def _launch_plan(q, k_cache, v_cache, O, L, spec: AttentionSpec, batch: int, seqlen_q: int) -> _Launch:
    """The launch of ``kvcache_forward``'s inputs (not empty), but for the tensors: a decode step's host time
    was mostly this and the launch's classification of its 43 arguments."""
    heads, seqlen_t, head_dim = q.shape[1:]
    heads_k = k_cache.shape[1]
    paged = spec.paged
    page_size = k_cache.shape[2] if paged else 1
    capacity = page_size * spec.block_table.shape[1] if paged else k_cache.shape[2]
    plan = _plan(
        heads // heads_k,
        seqlen_q,
        head_dim,
        q.dtype,
        batch * heads_k,
        capacity,
        page_size if paged else 0,
        spec.num_splits,
        q.device,
    )
    s = score_args(spec, q.dtype)
    rows = L.numel()
    scalars = (
        s.qk_scale,
        s.cap_scale,
        LOG2_E,
        s.window_left,
        s.window_right,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *O.stride(),
        *L.stride(),
        *s.slope_strides,
        *(spec.block_table.stride() if paged else (0, 0)),
        heads,
        heads // heads_k,
        seqlen_q,
        seqlen_t,
        capacity,
        k_cache.shape[0],
        plan.chunk,
        plan.splits,
        rows,
        head_dim,
    )
    constexprs = dict(
        WINDOW_LEFT=s.WINDOW_LEFT,
        WINDOW_RIGHT=s.WINDOW_RIGHT,
        SOFTCAP=s.SOFTCAP,
        ALIBI=s.ALIBI,
        HAS_SINK=spec.sink is not None,
        LEFTPAD=spec.cache_leftpad is not None,
        BATCH_IDX=spec.cache_batch_idx is not None,
        PAGED=paged,
        PAGE_SIZE=page_size,
        VARLEN=spec.varlen,
        **plan.constexprs,
    )
    return _Launch(
        plan.splits,
        plan.grid,
        plan.splits * rows * (head_dim + 1),
        scalars,
        arg_classes(scalars),
        constexprs,
        plan.options,
    )


class Plan(NamedTuple):
    """One launch of the split kernel, for a class of inputs."""

    splits: int
    chunk: int
    grid: int
    constexprs: dict
    options: dict


@functools.lru_cache(maxsize=4096)
def _plan(
    group: int,
    seqlen_q: int,
    head_dim: int,
    dtype: torch.dtype,
    batch_heads_k: int,
    capacity: int,
    page_size: int,
    num_splits_asked: int,
    device: torch.device,
) -> Plan:
    """The tiles, the split count and the grid, worked out once per class of inputs (page_size 0: a
    contiguous cache): a decode loop asks the same question every step, and the answer cost ~30 µs of
    host time a call on the H200 before it was cached (Triton's cdiv, the split search)."""
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    tiles = _tiles(head_dim_padded, dtype, group, seqlen_q)
    programs = batch_heads_k * -(-group * seqlen_q // tiles.block_m)
    unsplit = programs >= slots(tiles, head_dim_padded, dtype.itemsize, True, device)
    if page_size and not unsplit and head_dim_padded == 128:
        # A paged cache on a split grid: 64-key tiles and 5 stages. The page lookup before each tile's loads
        # takes stages of Triton's pipeline (at D 128, 3 or 4 stages buffer one K and one V tile, the 2 of a
        # contiguous cache's 3 only from 5; sm_90a builds), and the smaller tiles keep more of them in flight.
        # On the H200 (.whl probe paged_probe2.py, D 128, 32/8 heads, bf16) pages of 16 went from 0.79-0.87 of
        # the contiguous cache's rate to 0.86-0.96 at 8 x 32k and 1 x 128k keys, pages of 256 from 0.91-0.97
        # to 0.93-0.98.
        tiles = tiles._replace(block_n=min(tiles.block_n, 64), num_stages=5)
    elif 0 < page_size < tiles.block_n and unsplit:
        # Pages smaller than a tile, and a grid that fills the GPU unsplit: half-size key tiles, so that twice
        # the programs wait on their page lookups at once (64 x 4k keys, pages of 16, on the H200 at f416d0c:
        # 258 µs against 278 with 128-key tiles; the contiguous cache 259).
        tiles = tiles._replace(block_n=tiles.block_n // 2)
    key_tiles = max(1, -(-capacity // tiles.block_n))
    splits = num_splits_asked or num_splits(
        programs, key_tiles, slots(tiles, head_dim_padded, dtype.itemsize, page_size > 0, device)
    )
    splits = max(1, min(splits, key_tiles))
    chunk = -(-key_tiles // splits) * tiles.block_n
    return Plan(
        splits,
        chunk,
        splits * programs,
        dict(
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            HEAD_DIM=head_dim_padded,
            EVEN_D=head_dim_padded == head_dim,
            SPLIT=splits > 1,
            FENCE=not INTERPRETED,
        ),
        dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
    )


def _tiles(head_dim_padded: int, dtype: torch.dtype, group: int, seqlen_q: int) -> Tiles:
    """The split kernel's launch: BLOCK_M covers the group's query rows (at least tl.dot's 16), BLOCK_N
    makes a key tile of about 32 KB (at most 128 rows): on the H200, 128-key tiles at D = 128 beat 64-key
    ones at every decode shape of issue 22 (.whl probe at feab801: 8 x 32k keys 264 against 306 µs, 64 x 4k
    261 against 294), a fourth stage did not help; 8 warps from D = 256."""
    block_n = max(16, min(128, 32768 // (head_dim_padded * dtype.itemsize)))
    block_m = max(16, min(64 if head_dim_padded <= 128 else 32, triton.next_power_of_2(group * seqlen_q)))
    # Pages smaller than a tile take 4 warps too: 8 for one query token, once measured faster (7d48f83),
    # ran 8 x 32k keys in pages of 16 at 404 µs against 284 with 4 on the H200 at f416d0c (1 x 128k: 243
    # against 177; .whl probe paged_probe.py).
    return Tiles(block_m, block_n, 8 if head_dim_padded >= 256 else 4, 3)


@functools.lru_cache(maxsize=1024)
def num_splits(programs: int, key_tiles: int, slots: int) -> int:
    """How many key ranges to split each (batch row, key/value head) into: the fewest whose grid fills the
    GPU's program slots nearly as well as the best count up to 128 does (within 95% of the best wave
    efficiency), keeping at least 4 key tiles a split. flash-attn's rule takes 85%: on the H200 (1 x 128k
    keys, 32/8 heads, D 128, bf16, pages of 16; .whl probe decode_probe.py at a8e3b8f) its 29 splits ran
    166.9 µs, 0.86 of the contiguous cache's rate, where 32 (this rule's) ran 157.6, 0.92; 16, 48 and 64
    splits ran 201, 212 and 178. Cached: a decode loop asks the same question every step, and the search is
    ~250 Python calls at 128k keys."""
    if programs >= slots:
        return 1
    most = max(1, min(128, key_tiles // 4))

    def efficiency(s):
        n = programs * s
        return n / (triton.cdiv(n, slots) * slots)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.95 * best)


def slots(tiles: Tiles, head_dim_padded: int, width: int, paged: bool, device: torch.device) -> int:
    """Programs of the split kernel to aim the grid at: the SMs times the programs whose pipelined K and V
    tiles (num_stages of each) fit in one SM's shared memory; twice that for a paged cache, whose loads
    wait on the block table and need more programs in flight (8 x 32k keys in pages of 256, on the H200
    probe: 4 splits 259 µs, the 2 that one wave gives 368; the contiguous cache 253 with 2). The
    interpreter: 8."""
    if INTERPRETED or device.type != "cuda":
        return 8
    sms, shared = _sm_resources(device)
    per_program = tiles.num_stages * 2 * tiles.block_n * head_dim_padded * width
    return sms * max(1, min(4, shared // per_program)) * (2 if paged else 1)


@functools.cache
def _sm_resources(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    # The H200's 228 KB where this torch does not report it.
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 233472)
