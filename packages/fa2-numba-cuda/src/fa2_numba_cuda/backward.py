"""FlashAttention-2's backward in fa2-numba-cuda: ``flash_attn_backward`` picks the kernels for the inputs.

- ``backward_tc``: tensor cores (``mma.sync`` through inline PTX), for fp16 and bf16 with head_dim <= 128, dense
  or packed batches with any scale, window (causal included), softcap, ALiBi slopes and sink, on a CUDA device
  of compute capability 8.0 or newer or under numba's simulator (``backward_tc.uses_tensor_cores``);
- ``backward_simt``: CUDA cores, fp32 arithmetic, for everything else: fp32, head_dim up to 256, older GPUs;
- ``backward_wgmma``: the dK/dV kernel on Hopper's wgmma, and at head_dim 128 the dQ kernel too (at 64,
  ``backward_tc``'s), in place of ``backward_tc`` where ``backward_wgmma.uses_wgmma`` holds (on unless
  FA2_NUMBA_WGMMA_BWD=0; fp16/bf16, head_dim 64 or 128, dense or packed, any window, on compute capability 9.0;
  a softcap, ALiBi, a window other than none and causal, a packed batch or a sink only where
  ``backward_wgmma.FEATURES`` names it, all by default) and no kernels or config were asked for.

The choice is made from the inputs' dtype, head_dim and device and the spec alone, before any launch; an
error in the chosen kernels is raised, never answered by the other ones.
"""

from __future__ import annotations

import torch

from fa2.spec import AttentionSpec
from fa2_numba_cuda import backward_simt, backward_tc, backward_wgmma
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
    config: tuple[DkDvConfig, BlockConfig] | backward_tc.TensorCoreBwdConfig | None = None,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, ...]:
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
        config: the kernels' blocks, for tuning: for the SIMT kernels a (DkDvConfig, BlockConfig) pair,
            default ``backward_simt.bwd_block_config(common.padded_head_dim(head_dim))``; for the tensor-core
            kernels a ``backward_tc.TensorCoreBwdConfig``, default ``backward_tc.tc_bwd_config(...)``.
        tensor_cores: which kernels. None: the tensor-core ones (``backward_tc``) for fp16 and bf16 with
            head_dim <= 128 on compute capability 8.0+ or the simulator (``backward_tc.uses_tensor_cores``),
            the SIMT ones (``backward_simt``) otherwise; True or False forces one (an input the forced kernels
            cannot take is an error). With tensor_cores and config None, ``backward_wgmma`` runs where
            ``backward_wgmma.uses_wgmma`` holds (unless FA2_NUMBA_WGMMA_BWD=0; Hopper, the inputs it takes).

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v (dk, dv: (batch, heads_k, seqlen_k, head_dim), each
        key/value head's gradient summed over its group's query heads), contiguous; rows that see no key
        get dq = 0, keys that no row sees dk = dv = 0. Packed: (1, heads, total_q, head_dim) and (1, heads_k,
        total_k, head_dim); three kernel launches (preprocess, dK/dV, dQ) whatever the number of sequences,
        no host sync. With spec.sink (attention sinks, (heads,) fp32): (dq, dk, dv, dsink), dsink (heads,)
        fp32 = -Σ_{b, i} exp(sink[h] - L[b, h, i]) · rowsum(dO ∘ O)[b, h, i] over the batch (every sequence of a
        packed one) and the rows, each preprocess block's share summed per head by torch in a fixed order
        (``backward_simt.sink_gradient``); dq, dk, dv come from the kernels without a sink, L (which includes
        it) carrying it into P = exp(S - L).
    """
    if tensor_cores is None and config is None and backward_wgmma.uses_wgmma(q, k, v, dO, spec):
        return backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec)
    if tensor_cores is None:
        tensor_cores = backward_tc.uses_tensor_cores(q)
    if tensor_cores:
        return backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    return backward_simt.flash_attn_backward(q, k, v, O, L, dO, spec, config)


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every backward kernel
    compiled so far in this process: the SIMT kernels' rows, then the tensor-core ones' ("kernel": "tensor-core
    dkdv" or "tensor-core dq"; their preprocess is the SIMT one's), then the wgmma dK/dV kernel's ("kernel":
    "wgmma dkdv"); empty under the simulator."""
    return backward_simt.kernel_resources() + backward_tc.kernel_resources() + backward_wgmma.kernel_resources()
