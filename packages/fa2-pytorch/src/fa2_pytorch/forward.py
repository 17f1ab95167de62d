"""FlashAttention-2 forward in plain PyTorch.

The algorithm of the FA2 paper (Dao, 2023), Algorithm 1: for each query tile, visit the key/value tiles
in order, keep a running row max ``m_i``, a running row sum ``l_i`` and an unnormalised accumulator
``acc``, rescale both by ``alpha = exp(m_old - m_new)`` when the max moves, divide once at the end and
write L = m + log(l).

Unlike the kernels, which give every query tile its own program, this loop handles all query tiles (and
all batch and head entries) at once: one step of the loop is one key tile for every query row. That keeps
the Python loop to seqlen_k / BLOCK_N iterations and the extra memory to O(seqlen_q · BLOCK_N), never the
(seqlen_q, seqlen_k) score matrix. Under ``causal``, the query rows that cannot see any key of a tile
(whole BLOCK_M-row tiles above the diagonal) are sliced away before the tile's matmul, and the mask is
built only for tiles that straddle the diagonal.

Limits: none beyond PyTorch's own; any head_dim, any strides, CPU or CUDA. The two matmuls of a tile run
in the input dtype (on CUDA: tensor cores, fp32 accumulation, the result rounded to the input dtype); the
softmax statistics and the accumulator are fp32.
"""

from __future__ import annotations

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

    for start_n in range(0, seqlen_k, block_n):
        end_n = min(start_n + block_n, seqlen_k)
        # Causal: query tiles wholly above this key tile's first key see none of it; skip them.
        start_m = (max(start_n - diag, 0) // block_m) * block_m if causal else 0
        if start_m >= seqlen_q:
            break
        q_i = q[:, :, start_m:]
        k_j = k[:, :, start_n:end_n]
        v_j = v[:, :, start_n:end_n]

        S = (q_i @ k_j.transpose(-2, -1)).float().mul_(scale)  # [B, H, M, BLOCK_N]
        if causal and end_n - 1 > start_m + diag:
            rows = torch.arange(start_m, seqlen_q, device=q.device)[:, None]
            cols = torch.arange(start_n, end_n, device=q.device)[None, :]
            S.masked_fill_(cols > rows + diag, -math.inf)

        m_old = m_i[:, :, start_m:]
        m_new = torch.maximum(m_old, S.amax(dim=-1, keepdim=True))
        # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp() at 0, not NaN.
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = S.sub_(m_safe).exp_()
        alpha = (m_old - m_safe).exp_()

        l_i[:, :, start_m:] = alpha * l_i[:, :, start_m:] + p.sum(dim=-1, keepdim=True)
        acc_i = acc[:, :, start_m:]
        acc_i.mul_(alpha).add_((p.to(v.dtype) @ v_j).float())
        m_i[:, :, start_m:] = m_new

    # Rows that saw no key have l_i = 0: O = 0 and L = +inf (see fa2.attention).
    empty = l_i == 0
    O = (acc / l_i.masked_fill(empty, 1.0)).to(q.dtype)
    L = (m_i + torch.log(l_i)).masked_fill(empty, math.inf).squeeze(-1)
    return O, L
