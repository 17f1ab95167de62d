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

Grouped-query attention: as in the forward, the ``group`` query heads of each key/value head are folded
into the rows, [B, H_K, N·GROUP, HEAD_DIM] with row n·group + g, and K/V are never repeated. A key/value
head's gradient is the sum over its group, and with the group in the rows ``Pᵀ dO`` and ``dSᵀ Q`` contract
the group and the query rows together in one matmul per key tile: dK_j and dV_j come out in k's shape, with
no per-query-head [B, H, BLOCK_N, HEAD_DIM] partials to sum.
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
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k: query head h attends to key/value head h // (heads // heads_k); any strides.
        O, dO: (batch, heads, seqlen_q, head_dim); L: (batch, heads, seqlen_q), float32, from the forward.
        causal, scale, block_m, block_n: as in ``flash_attn_forward``.

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v: dk and dv (batch, heads_k, seqlen_k, head_dim), each
        key/value head's gradient summed over the query heads of its group.
    """
    heads, seqlen_q = q.shape[1], q.shape[2]
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    # heads_k = 0 only with heads = 0 (the interface checks the rest); group 1 keeps the shapes valid.
    group = heads // heads_k if heads_k else 1
    diag = seqlen_k - seqlen_q

    def fold(x: torch.Tensor) -> torch.Tensor:
        """(B, H, N_q, ...) as (B, H_K, N_q·GROUP, ...), row n·group + g: a view when group = 1."""
        return x.unflatten(1, (heads_k, group)).transpose(2, 3).flatten(2, 3)

    q32, dO32 = q.float(), dO.float()
    delta = fold((dO32 * O.float()).sum(dim=-1, keepdim=True))  # [B, H_K, N_q·GROUP, 1]
    dq = torch.zeros_like(q32)
    # dq accumulates in q's own layout through a [B, H_K, N_q, GROUP, HEAD_DIM] view: no unfolding copy.
    dq_g = dq.unflatten(1, (heads_k, group)).transpose(2, 3)
    q32, dO32 = fold(q32), fold(dO32)
    lse = fold(L.unsqueeze(-1))
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)

    with _tf32_matmul(q.dtype != torch.float32):
        for start_n in range(0, seqlen_k, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            start_m = (max(start_n - diag, 0) // block_m) * block_m if causal else 0
            if start_m >= seqlen_q:
                break
            # Rows from position start_m on, all of the group: one contiguous block of the folded rows.
            row_m = start_m * group
            q_i, dO_i = q32[:, :, row_m:], dO32[:, :, row_m:]
            k_j = k[:, :, start_n:end_n].float()
            v_j = v[:, :, start_n:end_n].float()

            S = torch.matmul(q_i, k_j.transpose(-2, -1)).mul_(scale)  # [B, H_K, M·GROUP, BLOCK_N]
            if causal and end_n - 1 > start_m + diag:
                # The mask depends on the query position only: one (M, 1, BLOCK_N) mask for the whole group.
                rows = torch.arange(start_m, seqlen_q, device=q.device)[:, None, None]
                cols = torch.arange(start_n, end_n, device=q.device)[None, None, :]
                S.unflatten(2, (seqlen_q - start_m, group)).masked_fill_(cols > rows + diag, -math.inf)
            p = S.sub_(lse[:, :, row_m:]).exp_()

            # The sum over the group rides in the contraction over the folded rows: [B, H_K, BLOCK_N, HEAD_DIM].
            dv[:, :, start_n:end_n] = torch.matmul(p.transpose(-2, -1), dO_i)
            dp = torch.matmul(dO_i, v_j.transpose(-2, -1))
            ds = p.mul_(dp.sub_(delta[:, :, row_m:]))
            dq_g[:, :, start_m:] += torch.matmul(ds, k_j).mul_(scale).unflatten(2, (seqlen_q - start_m, group))
            dk[:, :, start_n:end_n] = torch.matmul(ds.transpose(-2, -1), q_i).mul_(scale)

    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
