"""FlashAttention-2 backward in plain PyTorch.

The FA2 paper's Algorithm 2, vectorised like the forward: one step of the loop is one key tile for every
query row. From L, each tile's probabilities are recomputed instead of stored, P = exp(S - L), and

    D   = rowsum(dO ∘ O)           (once, before the loop)
    dV_j = Pᵀ dO                   dP = dO V_jᵀ
    dS  = P ∘ (dP - D)
    dQ += scale · dS K_j           dK_j = scale · dSᵀ Q

Each key tile's dK_j and dV_j are complete after its step (every query row is in the step), so only dQ
accumulates across the loop. Extra memory is O(seqlen_q · BLOCK_N). Rows that saw no key have L = +inf,
so P = exp(S - inf) = 0 there and they get zero gradients without a special case. Precision as in the
forward: fp32 throughout, TF32 matmuls on CUDA for fp16/bf16 inputs.
"""

from __future__ import annotations

import math

import torch

from fa2_pytorch.forward import BLOCK_M, BLOCK_N, _tf32_matmul


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); any strides.
        O, dO: (batch, heads, seqlen_q, head_dim); L: (batch, heads, seqlen_q), float32, from the forward.
        causal, scale, block_m, block_n: as in ``flash_attn_forward``.

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v.
    """
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    diag = seqlen_k - seqlen_q

    q32, dO32 = q.float(), dO.float()
    delta = (dO32 * O.float()).sum(dim=-1, keepdim=True)  # [B, H, N_q, 1]
    lse = L.unsqueeze(-1)
    dq = torch.zeros_like(q32)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)

    with _tf32_matmul(q.dtype != torch.float32):
        for start_n in range(0, seqlen_k, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            start_m = (max(start_n - diag, 0) // block_m) * block_m if causal else 0
            if start_m >= seqlen_q:
                break
            q_i, dO_i = q32[:, :, start_m:], dO32[:, :, start_m:]
            k_j = k[:, :, start_n:end_n].float()
            v_j = v[:, :, start_n:end_n].float()

            S = torch.matmul(q_i, k_j.transpose(-2, -1)).mul_(scale)  # [B, H, M, BLOCK_N]
            if causal and end_n - 1 > start_m + diag:
                rows = torch.arange(start_m, seqlen_q, device=q.device)[:, None]
                cols = torch.arange(start_n, end_n, device=q.device)[None, :]
                S.masked_fill_(cols > rows + diag, -math.inf)
            p = S.sub_(lse[:, :, start_m:]).exp_()

            dv[:, :, start_n:end_n] = torch.matmul(p.transpose(-2, -1), dO_i)
            dp = torch.matmul(dO_i, v_j.transpose(-2, -1))
            ds = p.mul_(dp.sub_(delta[:, :, start_m:]))
            dq[:, :, start_m:] += torch.matmul(ds, k_j).mul_(scale)
            dk[:, :, start_n:end_n] = torch.matmul(ds.transpose(-2, -1), q_i).mul_(scale)

    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
