"""FlashAttention-2 forward in plain PyTorch.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1: visit the key/value tiles in order, keep a
running row max ``m_i``, a running row sum ``l_i`` and an unnormalised accumulator ``acc``, rescale both
by ``alpha = exp(m_old - m_new)`` when the max moves, divide once at the end and write L = m + log(l).

Unlike the kernels, which give every query tile its own program, this loop handles all query tiles (and
all batch and head entries) at once: one step of the loop is one key tile for every query row. That keeps
the Python loop to seqlen_k / BLOCK_N iterations and the extra memory to O(seqlen_q · BLOCK_N), never the
(seqlen_q, seqlen_k) score matrix. Under ``causal``, the query rows that cannot see any key of a tile
(whole BLOCK_M-row tiles above the diagonal) are sliced away before the tile's matmul, and the mask is
built only for tiles that straddle the diagonal.

Eager PyTorch cannot fuse ``exp(S - m)`` into one pass, and each pass over a (rows, BLOCK_N) fp32 tile
costs as much as the tile's matmuls. So a tile's softmax statistics come from two fused kernels:
``torch.softmax`` gives p normalised within the tile, ``torch.logsumexp`` the tile's own logsumexp
``lse_j``; the tile then enters the running state exactly as in FA2 with the row max taken as ``lse_j``
(any value >= the max keeps exp() from overflowing): ``m_new = max(m_i, lse_j)``, ``alpha = exp(m_i -
m_new)``, ``beta = exp(lse_j - m_new)``, ``l_i = alpha l_i + beta``, ``acc = alpha acc + beta (p V_j)``.
Two fused passes over the tile replace the five (max, subtract, exp, sum, cast) done one by one.

Precision: scores are computed from fp32 copies of q and k, in TF32 on CUDA when the inputs are fp16 or
bf16 (exact there: TF32 holds every fp16 and bf16 value, products accumulate in fp32) and in full fp32 for
fp32 inputs; p V runs on the fp32 p (TF32 on CUDA for fp16/bf16 inputs). Any head_dim, any strides, CPU
or CUDA.
"""

from __future__ import annotations

import contextlib
import math

import torch

BLOCK_M = 64
BLOCK_N = 128


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); any strides.
        causal: bottom-right aligned, key j visible to query i iff j <= i + seqlen_k - seqlen_q::

            seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                          1 1 1 1 1
        block_m: query-tile height, the granularity at which causal skips rows above the diagonal.
        block_n: key-tile width, the step of the loop.

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype. L: (batch, heads, seqlen_q), float32; rows that
        see no key get O = 0 and L = +inf.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    # Key j is visible to query i iff j <= i + diag.
    diag = seqlen_k - seqlen_q

    acc = torch.zeros(batch, heads, seqlen_q, head_dim, device=q.device, dtype=torch.float32)
    m_i = torch.full((batch, heads, seqlen_q, 1), -math.inf, device=q.device, dtype=torch.float32)
    l_i = torch.zeros(batch, heads, seqlen_q, 1, device=q.device, dtype=torch.float32)
    q32 = q.float()

    with _tf32_matmul(q.dtype != torch.float32):
        for start_n in range(0, seqlen_k, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            # Causal: query tiles wholly above this key tile's first key see none of it; skip them.
            start_m = (max(start_n - diag, 0) // block_m) * block_m if causal else 0
            if start_m >= seqlen_q:
                break
            q_i = q32[:, :, start_m:]
            k_j = k[:, :, start_n:end_n].float()
            v_j = v[:, :, start_n:end_n].float()

            S = torch.matmul(q_i, k_j.transpose(-2, -1)).mul_(scale)  # [B, H, M, BLOCK_N]
            masked = causal and end_n - 1 > start_m + diag
            if masked:
                rows = torch.arange(start_m, seqlen_q, device=q.device)[:, None]
                cols = torch.arange(start_n, end_n, device=q.device)[None, :]
                S.masked_fill_(cols > rows + diag, -math.inf)

            lse_j = torch.logsumexp(S, dim=-1, keepdim=True)  # [B, H, M, 1]
            p = torch.softmax(S, dim=-1)
            pv = torch.matmul(p, v_j)  # [B, H, M, HEAD_DIM], normalised within the tile
            if masked:
                # A row with no visible key in this tile: softmax gives NaN, lse_j = -inf; it adds nothing.
                pv.masked_fill_(lse_j == -math.inf, 0.0)

            m_old = m_i[:, :, start_m:]
            m_new = torch.maximum(m_old, lse_j)
            # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp() at 0, not NaN.
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp(m_old - m_safe)
            beta = torch.exp(lse_j - m_safe)

            l_i[:, :, start_m:] = alpha * l_i[:, :, start_m:] + beta
            acc[:, :, start_m:] = alpha * acc[:, :, start_m:] + beta * pv
            m_i[:, :, start_m:] = m_new

    # Rows that saw no key have l_i = 0: O = 0 and L = +inf (see fa2.attention).
    empty = l_i == 0
    O = (acc / l_i.masked_fill(empty, 1.0)).to(q.dtype)
    L = (m_i + torch.log(l_i)).masked_fill(empty, math.inf).squeeze(-1)
    return O, L


@contextlib.contextmanager
def _tf32_matmul(enabled: bool):
    """TF32 for CUDA fp32 matmuls inside the block only (exact for fp16/bf16-valued operands), then the
    caller's setting back."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = previous
