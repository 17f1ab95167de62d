"""FlashAttention-2 forward as a Triton kernel.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1: one program per (query tile, batch·head) loads
its BLOCK_M query rows once, visits the key/value tiles in order keeping a running row max ``m_i``, a
running row sum ``l_i`` and an unnormalised accumulator ``acc`` (all fp32), rescales both by
``alpha = exp(m_old - m_new)`` when the max moves, divides once at the end and writes O and L once.

Scores live in the log2 domain: ``qk_scale = scale · log2(e)`` so that ``exp2`` replaces ``exp``; the
epilogue converts back, L = (m_i + log2(l_i)) · ln(2) = m + log(l) in natural log.

The key loop runs in two parts. Off the band: whole key tiles that every query row of the tile sees
(under causal, the tiles left of the diagonal; otherwise all full tiles), loaded and used without masks.
The band: the tiles that straddle the causal diagonal or run past seqlen_k, masked. Under causal, tiles
wholly above the diagonal are never visited. A row that sees no key keeps m_i = -inf; the band subtracts
0 for it instead of m_i, so p and alpha stay 0 (not NaN) and the epilogue writes O = 0, L = +inf.

Credits: the structure and names follow Triton's tutorial ``06-fused-attention.py`` (Tillet et al.); the
log2-domain softmax and the unmasked/masked split of the key loop are from there too. Masking on padded
head dims as in Tri Dao's ``flash_attn_triton.py``.

Limits: head_dim a multiple of 8 from 8 to 256 (HEAD_DIM, the tile width, is padded to a power of two
>= 16 and masked); float32, float16, bfloat16. CUDA tensors, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment when this module is imported). Plain pointer loads, no
``tl.make_block_ptr`` (removed in Triton 3.9) and no tensor descriptors: the kernel compiles on Triton
3.6 and later. Both matmuls ask for ``input_precision="ieee"``: fp32 inputs get no TF32 (FMA matmuls);
fp16 and bf16 products are exact in fp32, so those still run on tensor cores (wgmma on Hopper) with fp32
accumulation, p rounded to v's dtype for the second.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The kernel below was decorated for Triton's CPU interpreter iff TRITON_INTERPRET was set at import.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

MAX_HEAD_DIM = 256
LOG2_E = math.log2(math.e)


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, head_dim, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, HEAD_DIM] tile, zero where a row is >= n_rows (only if MASK_ROWS) or a column >= head_dim
    (only if HEAD_DIM pads it: not EVEN_D)."""
    if MASK_ROWS:
        mask = rows[:, None] < n_rows
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < head_dim)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return tile


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, offs_d, head_dim, N_K, diag, qk_scale, lo, hi,
    IN_BAND: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    """The online softmax over key tiles [lo, hi): masked iff IN_BAND."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_ptrs + tl.cast(start_n, tl.int64) * stride_kn, cols, N_K, offs_d, head_dim,
                       IN_BAND, EVEN_D)  # [BLOCK_N, HEAD_DIM]
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if IN_BAND:
            # Key j is visible to query i iff j < seqlen_k and, under causal, j <= i + diag.
            visible = cols[None, :] < N_K
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if IN_BAND:
            # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2() at 0,
            # not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)

        l_i = alpha * l_i + tl.sum(p, 1)
        v = _load_tile(v_ptrs + tl.cast(start_n, tl.int64) * stride_vn, cols, N_K, offs_d, head_dim,
                       IN_BAND, EVEN_D)  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, L, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, N_Q, N_K, head_dim,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    # One program per (query tile, batch·head), flattened to one grid axis, query tiles fastest.
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(N_Q, BLOCK_M)
    off_bh = (pid // num_m_tiles).to(tl.int64)
    off_b = off_bh // H
    off_h = off_bh % H
    start_m = (pid % num_m_tiles) * BLOCK_M
    # Key j is visible to query i iff j <= i + diag.
    diag = N_K - N_Q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit offsets, as B·H·N·D can pass 2^31 elements; the key loop adds start_n · stride in 64 bits too.
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    offs_d64 = offs_d.to(tl.int64)
    q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
              + offs_m64[:, None] * stride_qm + offs_d64[None, :] * stride_qd)
    k_ptrs = (K + off_b * stride_kb + off_h * stride_kh
              + offs_n64[:, None] * stride_kn + offs_d64[None, :] * stride_kd)
    v_ptrs = (V + off_b * stride_vb + off_h * stride_vh
              + offs_n64[:, None] * stride_vn + offs_d64[None, :] * stride_vd)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = _load_tile(q_ptrs, offs_m, N_Q, offs_d, head_dim, True, EVEN_D)  # [BLOCK_M, HEAD_DIM]

    if IS_CAUSAL:
        # Every row of the tile sees keys < start_m + diag + 1; some row sees keys < start_m + BLOCK_M + diag.
        lo_band = tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + diag, 0), N_K)
    else:
        lo_band = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, head_dim, N_K, diag, qk_scale, 0, lo_band,
        False, IS_CAUSAL, BLOCK_N, EVEN_D,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, head_dim, N_K, diag, qk_scale, lo_band, hi,
        True, IS_CAUSAL, BLOCK_N, EVEN_D,
    )

    # Rows that saw no key have l_i = 0: O = 0 and L = +inf (see fa2.attention).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    # m_i + log2(l_i) is the log2-domain logsumexp; times ln(2) it is the natural-log one.
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)

    l_ptrs = L + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm
    tl.store(l_ptrs, lse, mask=offs_m < N_Q)
    o_ptrs = (O + off_b * stride_ob + off_h * stride_oh
              + offs_m64[:, None] * stride_om + offs_d64[None, :] * stride_od)
    o_mask = offs_m[:, None] < N_Q
    if not EVEN_D:
        o_mask = o_mask & (offs_d[None, :] < head_dim)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Defaults for Hopper (H100/H200) with pointer loads, by HEAD_DIM (head_dim padded to a power of two);
# each compiles for sm_90a on Triton 3.6 and 3.9 without register spills (contiguous inputs).
# 16-bit inputs, wgmma: D = 256 halves BLOCK_M and keeps two stages (160 KiB of shared memory).
TILES_16BIT = {
    16: Tiles(128, 64, 4, 3),
    32: Tiles(128, 64, 4, 3),
    64: Tiles(128, 64, 4, 3),
    128: Tiles(128, 64, 8, 3),
    256: Tiles(64, 64, 8, 2),
}
# fp32, FMA matmuls (no TF32): each thread holds whole rows of the operands, so small tiles from D = 64.
TILES_FP32 = {
    16: Tiles(64, 32, 4, 2),
    32: Tiles(64, 32, 4, 2),
    64: Tiles(32, 32, 8, 2),
    128: Tiles(32, 32, 8, 2),
    256: Tiles(32, 32, 8, 2),
}


def tiles_for(head_dim_padded: int, dtype: torch.dtype) -> Tiles:
    """The launch configuration for a padded head_dim and an input dtype. The interpreter gets the same
    tiles as the GPU (it ignores num_warps and num_stages), so CPU tests cover the GPU's tiling."""
    return (TILES_FP32 if dtype == torch.float32 else TILES_16BIT)[head_dim_padded]


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); any strides.
            CUDA tensors, or CPU tensors when this module was imported with TRITON_INTERPRET=1.
            head_dim: a multiple of 8 from 8 to 256.
        causal: bottom-right aligned, key j visible to query i iff j <= i + seqlen_k - seqlen_q::

            seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                          1 1 1 1 1
        scale: multiplies q kᵀ before the softmax.
        tiles: BLOCK_M, BLOCK_N (powers of two >= 16), num_warps, num_stages; default ``tiles_for``.

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype, contiguous. L: (batch, heads, seqlen_q), float32,
        natural log; rows that see no key get O = 0 and L = +inf.

    Raises:
        NotImplementedError: head_dim not a multiple of 8 from 8 to 256.
        RuntimeError: tensors on a device this build of the kernel cannot run on.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    _check_device(q.device)
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-triton supports head_dim a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}"
        )

    O = torch.empty(batch, heads, seqlen_q, head_dim, device=q.device, dtype=q.dtype)
    L = torch.empty(batch, heads, seqlen_q, device=q.device, dtype=torch.float32)
    if O.numel() == 0:
        return O, L

    HEAD_DIM = max(16, triton.next_power_of_2(head_dim))
    tiles = tiles or tiles_for(HEAD_DIM, q.dtype)
    # One program per (query tile, batch·head), on one grid axis: CUDA caps the other two at 65535, and
    # (batch, seqlen, head_dim) inputs arrive with the batch as heads.
    grid = (triton.cdiv(seqlen_q, tiles.block_m) * batch * heads,)
    on_device = contextlib.nullcontext() if INTERPRETED else torch.cuda.device(q.device)
    with on_device:
        _attn_fwd[grid](
            q, k, v, O, L, scale * LOG2_E,
            *q.stride(), *k.stride(), *v.stride(), *O.stride(), *L.stride(),
            heads, seqlen_q, seqlen_k, head_dim,
            IS_CAUSAL=causal, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HEAD_DIM=HEAD_DIM,
            EVEN_D=HEAD_DIM == head_dim,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return O, L


def _check_device(device: torch.device) -> None:
    if INTERPRETED and device.type != "cpu":
        raise RuntimeError(
            f"fa2-triton was imported with TRITON_INTERPRET=1, so its kernel runs in Triton's CPU interpreter "
            f"and takes CPU tensors, got tensors on {device}; run without TRITON_INTERPRET to use the GPU"
        )
    if not INTERPRETED and device.type != "cuda":
        raise RuntimeError(
            f"fa2-triton's kernel runs on CUDA tensors, got tensors on {device}; without a GPU, set "
            "TRITON_INTERPRET=1 in the environment before fa2_triton is imported to run it in Triton's CPU "
            "interpreter (slow; for tests)"
        )
