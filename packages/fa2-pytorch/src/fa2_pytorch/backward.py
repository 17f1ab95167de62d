"""FlashAttention-2 backward in plain PyTorch.

The FA2 paper's Algorithm 2, vectorised like the forward: one step of the loop is one key tile for every
query row that sees it. From L, each tile's probabilities are recomputed instead of stored, P = exp(S - L),
S the final scores (capped, biased, masked, exactly as in the forward), and

    D   = rowsum(dO ∘ O)           (once, before the loop)
    dV_j = Pᵀ dO                   dP = dO V_jᵀ
    dS  = P ∘ (dP - D)             dS_raw = dS ∘ (1 - tanh²)   (softcap only, else dS_raw = dS)
    dQ += scale · dS_raw K_j       dK_j = scale · dS_rawᵀ Q

The softcap's chain rule: S = softcap · tanh(scale · q kᵀ / softcap) has derivative scale · (1 - tanh²) in
q kᵀ, with tanh the tile's own (kept from the recomputation, one extra tile). ALiBi's bias does not depend
on q or k and adds nothing to the gradients; the slopes get none.

Windows skip as in the forward: only the key tiles [lo, hi) that some query's window reaches are visited
(dk and dv stay zero elsewhere), and each with only the query tiles [start_m, end_m) that hold a row seeing
one of its keys. Every row that sees a key tile is in its step, so the tile's dK_j and dV_j are complete
after it, and only dQ accumulates across the loop. Extra memory is O(seqlen_q · BLOCK_N). Rows that saw no
key have L = +inf, so P = exp(S - inf) = 0 there and they get zero gradients without a special case.

Attention sinks (``spec.sink``): L includes the sink, so P = exp(S - L) is already each key's share of the
sink-including softmax and dq, dk, dv are computed as without one. The sink's own gradient is its column of
dS summed: its probability exp(sink[h] - L_i) times (0 - D_i), as it has no value (dP = 0),

    dsink[h] = -Σ_{b, i} exp(sink[h] - L_bhi) · D_bhi

from D, before the loop; a sum over the batch and rows in a fixed order (deterministic).
Precision as in the forward: fp32 throughout, TF32 matmuls on CUDA for fp16/bf16 inputs.

Packed (variable-length) batches, ``spec.varlen``: as in the forward, the offsets are read once (one
device sync) and each sequence runs the dense backward above on its own views and spec, its dq, dk and dv
written into their slices of the packed gradients.

Grouped-query attention: as in the forward, the ``group`` query heads of each key/value head are folded
into the rows, [B, H_K, N·GROUP, HEAD_DIM] with row n·group + g, and K/V are never repeated. A key/value
head's gradient is the sum over its group, and with the group in the rows ``Pᵀ dO`` and ``dSᵀ Q`` contract
the group and the query rows together in one matmul per key tile: dK_j and dV_j come out in k's shape, with
no per-query-head [B, H, BLOCK_N, HEAD_DIM] partials to sum.
"""

from __future__ import annotations

import math

import torch

from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_pytorch.forward import BLOCK_M, BLOCK_N, sequence_spec, sequences, tf32_matmul


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, ...]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k: query head h attends to key/value head h // (heads // heads_k); any strides.
        O, dO: (batch, heads, seqlen_q, head_dim); L: (batch, heads, seqlen_q), float32, from the forward.
        spec, block_m, block_n: as in ``flash_attn_forward``, and the same spec as the forward's.

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v: dk and dv (batch, heads_k, seqlen_k, head_dim), each
        key/value head's gradient summed over the query heads of its group; zero for keys no query sees
        and for query rows that see no key. No gradient for the ALiBi slopes. With ``spec.sink``, a fourth:
        dsink (heads,) float32, summed over the batch and every row (packed: every sequence's).

    Packed batches (``spec.varlen``): q, O, dO: (1, heads, total_q, head_dim), L: (1, heads, total_q),
    k, v: (1, heads_k, total_k, head_dim); each sequence's gradients are its own dense backward's (see
    ``_varlen_backward``). Reads the offsets with one device sync.
    """
    if spec.varlen:
        return _varlen_backward(q, k, v, O, L, dO, spec, block_m, block_n)
    batch, heads, seqlen_q = q.shape[0], q.shape[1], q.shape[2]
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    # heads_k = 0 only with heads = 0 (the interface checks the rest); group 1 keeps the shapes valid.
    group = heads // heads_k if heads_k else 1
    diag = seqlen_k - seqlen_q
    scale, softcap = spec.scale, spec.softcap
    # As in the forward: the scale, and 1 / softcap when capping, in the score matmul's epilogue.
    qk_scale = scale / softcap if softcap else scale

    def fold(x: torch.Tensor) -> torch.Tensor:
        """(B, H, N_q, ...) as (B, H_K, N_q·GROUP, ...), row n·group + g: a view when group = 1."""
        return x.unflatten(1, (heads_k, group)).transpose(2, 3).flatten(2, 3)

    q32, dO32 = q.float(), dO.float()
    delta = (dO32 * O.float()).sum(dim=-1)  # [B, H, N_q]
    dsink = None
    if spec.sink is not None:
        # The sink's column of dS: exp(sink - L) · (0 - D), summed over the batch and the rows.
        dsink = torch.exp(spec.sink[:, None] - L).mul_(delta).sum(dim=(0, 2)).neg_()
    delta = fold(delta.unsqueeze(-1))  # [B, H_K, N_q·GROUP, 1]
    dq = torch.zeros_like(q32)
    # dq accumulates in q's own layout through a [B, H_K, N_q, GROUP, HEAD_DIM] view: no unfolding copy.
    dq_g = dq.unflatten(1, (heads_k, group)).transpose(2, 3)
    q32, dO32 = fold(q32), fold(dO32)
    lse = fold(L.unsqueeze(-1))
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    slopes = None
    if spec.alibi_slopes is not None:
        # Folded row n·group + g of key/value head h_k is query head h_k·group + g: [B, H_K, 1, GROUP, 1].
        slopes = spec.alibi_slopes.expand(batch, heads).reshape(batch, heads_k, group)[:, :, None, :, None]

    # The forward's tile skipping: key tiles in [lo, hi), each with the query tiles [start_m, end_m).
    left, right = spec.window
    lo, hi = spec.key_range(0, seqlen_q, seqlen_q, seqlen_k)

    with tf32_matmul(q.dtype != torch.float32):
        for start_n in range(lo // block_n * block_n, hi, block_n):
            end_n = min(start_n + block_n, seqlen_k)
            start_m = 0 if right == UNBOUNDED else max(start_n - diag - right, 0) // block_m * block_m
            end_m = seqlen_q if left == UNBOUNDED else min(-(-(end_n - diag + left) // block_m) * block_m, seqlen_q)
            if start_m >= end_m:
                continue
            # Rows [start_m, end_m), all of the group: one contiguous block of the folded rows.
            row_m, rows_m = start_m * group, (end_m - start_m) * group
            q_i, dO_i = q32[:, :, row_m : row_m + rows_m], dO32[:, :, row_m : row_m + rows_m]
            k_j = k[:, :, start_n:end_n].float()
            v_j = v[:, :, start_n:end_n].float()

            S = torch.matmul(q_i, k_j.transpose(-2, -1)).mul_(qk_scale)  # [B, H_K, M·GROUP, BLOCK_N]
            if softcap:
                t = S.tanh_()
                # 1 - tanh², the softcap's derivative (over the scale), in one pass: 1 + (-1) · t · t.
                dcap = torch.addcmul(t.new_ones(()), t, t, value=-1.0)
                S = t.mul_(softcap)
            if slopes is not None:
                # In fp32 from the start (exact below 2**24): i + diag for the rows, j for the keys.
                rows = torch.arange(start_m + diag, end_m + diag, device=q.device, dtype=torch.float32)
                cols = torch.arange(start_n, end_n, device=q.device, dtype=torch.float32)
                distance = (rows[:, None, None] - cols).abs_()  # [M, 1, BLOCK_N]
                S.unflatten(2, (end_m - start_m, group)).addcmul_(slopes, distance, value=-1.0)
            if (right != UNBOUNDED and end_n - 1 > start_m + diag + right) or (
                left != UNBOUNDED and start_n < end_m - 1 + diag - left
            ):
                # The mask depends on the query position only: one (M, 1, BLOCK_N) mask for the whole group.
                rows = torch.arange(start_m, end_m, device=q.device)
                cols = torch.arange(start_n, end_n, device=q.device)
                hidden = ~spec.visible(rows, cols, seqlen_q, seqlen_k)[:, None, :]
                S.unflatten(2, (end_m - start_m, group)).masked_fill_(hidden, -math.inf)
            p = S.sub_(lse[:, :, row_m : row_m + rows_m]).exp_()

            # The sum over the group rides in the contraction over the folded rows: [B, H_K, BLOCK_N, HEAD_DIM].
            dv[:, :, start_n:end_n] = torch.matmul(p.transpose(-2, -1), dO_i)
            dp = torch.matmul(dO_i, v_j.transpose(-2, -1))
            ds = p.mul_(dp.sub_(delta[:, :, row_m : row_m + rows_m]))
            if softcap:
                ds.mul_(dcap)
            dq_g[:, :, start_m:end_m] += torch.matmul(ds, k_j).mul_(scale).unflatten(2, (end_m - start_m, group))
            dk[:, :, start_n:end_n] = torch.matmul(ds.transpose(-2, -1), q_i).mul_(scale)

    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)


def _varlen_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    block_m: int,
    block_n: int,
) -> tuple[torch.Tensor, ...]:
    """``flash_attn_backward`` of a packed batch: one dense ``flash_attn_backward`` per sequence.

    Arguments:
        q, O, dO: (1, heads, total_q, head_dim); L: (1, heads, total_q); k, v: (1, heads_k, total_k,
        head_dim); spec as in ``fa2_pytorch.forward._varlen_forward``.

    Returns:
        dq (1, heads, total_q, head_dim), dk, dv (1, heads_k, total_k, head_dim), in q's, k's and v's
        dtypes: each sequence's slices its own gradients; zero for a sequence with Nq_s = 0 or Nk_s = 0 and
        for rows and keys outside every sequence. With a sink, dsink (heads,) float32: the sum of the
        sequences' own, in order (a sequence with no key adds none: its O, and so its D, is 0).
    """
    dq = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.zeros(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.zeros(v.shape, device=v.device, dtype=v.dtype)
    dsink = None if spec.sink is None else torch.zeros(q.shape[1], device=q.device, dtype=torch.float32)
    for s, (q_start, q_end, k_start, k_end) in enumerate(sequences(spec, q.shape[2], k.shape[2])):
        if q_start == q_end or k_start == k_end:
            continue
        rows, keys = slice(q_start, q_end), slice(k_start, k_end)
        dq_s, dk_s, dv_s, *dsink_s = flash_attn_backward(
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            O[:, :, rows],
            L[:, :, rows],
            dO[:, :, rows],
            sequence_spec(spec, s),
            block_m,
            block_n,
        )
        dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = dq_s, dk_s, dv_s
        if dsink is not None:
            dsink += dsink_s[0]
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)
