"""FlashAttention-2's backward in fa2-numba-cuda: ``flash_attn_backward`` picks the kernels for the inputs.

Every input runs the SIMT kernels today (``backward_simt``: CUDA cores, fp32 arithmetic; fp32, fp16, bf16,
head_dim up to 256, in numba's simulator too). This module is where a tensor-core backward (issue 23) is to
be chosen, as ``forward`` chooses between ``forward_tc`` and ``forward_simt``.
"""

from __future__ import annotations

import torch
from fa2.spec import AttentionSpec

from fa2_numba_cuda import backward_simt
from fa2_numba_cuda.backward_simt import DkDvConfig
from fa2_numba_cuda.common import BlockConfig


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    config: tuple[DkDvConfig, BlockConfig] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to key/value
            head h // (heads // heads_k); any strides; fp32, fp16 or bf16; CUDA tensors, or CPU tensors under
            numba's simulator.
        O, dO: (batch, heads, seqlen_q, head_dim), q's dtype; L: (batch, heads, seqlen_q), float32, natural
            log, from the forward (+inf on rows that see no key); any strides.
        spec: what the forward computed (``fa2.spec.AttentionSpec``: scale, window, softcap, ALiBi slopes,
            and for a packed batch cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), as in
            ``fa2_numba_cuda.forward.flash_attn_forward``; the slopes get no gradient. Packed (spec.varlen):
            q, O, dO (1, heads, total_q, head_dim), L (1, heads, total_q), k, v (1, heads_k, total_k,
            head_dim), each sequence's rows given by the offsets, its gradients its own.
        config: the two kernels' blocks, for tuning; default
            ``backward_simt.bwd_block_config(padded_head_dim(head_dim))``.

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v (dk, dv: (batch, heads_k, seqlen_k, head_dim), each
        key/value head's gradient summed over its group's query heads), contiguous; rows that see no key
        get dq = 0, keys that no row sees dk = dv = 0. Packed: (1, heads, total_q, head_dim) and (1, heads_k,
        total_k, head_dim); three kernel launches (preprocess, dK/dV, dQ) whatever the number of sequences,
        no host sync.
    """
    return backward_simt.flash_attn_backward(q, k, v, O, L, dO, spec, config)


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every backward kernel
    compiled so far in this process (one row per compiled specialisation); empty under the simulator."""
    return backward_simt.kernel_resources()
