"""FlashAttention-2's forward in fa2-numba-cuda: ``flash_attn_forward`` picks the kernel for the inputs.

- ``forward_tc``: tensor cores (``mma.sync`` through inline PTX), for fp16 and bf16 with head_dim <= 128 on
  a CUDA device of compute capability 8.0 or newer (``forward_tc.uses_tensor_cores``);
- ``forward_simt``: CUDA cores, fp32 arithmetic, for everything else (fp32, head_dim up to 256, older GPUs,
  numba's CUDA simulator);
- ``forward_wgmma``: Hopper's wgmma, in place of ``forward_tc`` only where ``forward_wgmma.uses_wgmma`` holds
  (off with FA2_NUMBA_WGMMA=0; fp16/bf16, head_dim 64 or 128, causal or not, on compute capability 9.0; a
  softcap, ALiBi, a window other than causal, a packed batch or a sink only where ``forward_wgmma.FEATURES``
  names each, all by default: FA2_NUMBA_WGMMA_FEATURES="none" or a shorter list turns some off) and no kernel
  or config was asked for.

They compute the same thing from the same ``AttentionSpec`` (``common.Features``); none falls back to
another: an input the chosen kernel cannot take is an error.
"""

from __future__ import annotations

import torch

from fa2.spec import AttentionSpec
from fa2_numba_cuda import forward_simt, forward_tc, forward_wgmma
from fa2_numba_cuda.common import BlockConfig


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    config: BlockConfig | forward_tc.TensorCoreConfig | None = None,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention; heads_k = 1 is multi-query): query head h attends to key/value
            head h // (heads // heads_k); any strides; fp32, fp16 or bf16; CUDA tensors, or CPU tensors under
            numba's simulator.
        spec: what to compute (``fa2.spec.AttentionSpec``): scale; window (left, right), bottom-right aligned,
            key j visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
            (-1: no bound on that side; causal is (-1, 0))::

                causal, seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                                      1 1 1 1 1

                window (1, 0), seqlen_q = 4, seqlen_k = 6:   0 1 1 0 0 0
                                                             0 0 1 1 0 0
                                                             0 0 0 1 1 0
                                                             0 0 0 0 1 1
            softcap (scores become softcap · tanh(scores / softcap), fp32); alibi_slopes ((batch, heads)
            float32 on q's device, any strides: scores get -slope · |i + seqlen_k - seqlen_q - j|). Every
            combination runs in both kernels. With cu_seqlens_q and cu_seqlens_k (spec.varlen, a packed
            batch): q is (1, heads, total_q, head_dim) and k, v (1, heads_k, total_k, head_dim), sequence s
            the rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q and [cu_seqlens_k[s], cu_seqlens_k[s + 1])
            of k and v ((num_seqs + 1,) int32 on q's device, from 0 to the totals, non-decreasing: not
            checked here), every feature above per sequence with its own seqlen_q and seqlen_k, alibi_slopes
            (num_seqs, heads); the grid is sized by max_seqlen_q (a sequence longer than it leaves rows
            unwritten).
        config: the block shape, for tuning; default ``forward_simt.block_config(padded_head_dim(head_dim))``
            (a ``common.BlockConfig``), or for the tensor-core kernel ``forward_tc.tc_config(...)`` (a
            ``forward_tc.TensorCoreConfig``).
        tensor_cores: which kernel. None: the tensor-core kernel (``forward_tc``) for fp16 and bf16 with
            head_dim <= 128 on compute capability 8.0+ (``forward_tc.uses_tensor_cores``), the SIMT kernel
            (``forward_simt``) otherwise (fp32, head_dim > 128, older GPUs, the simulator); True or False
            forces one (an input the forced kernel cannot take is an error). No kernel falls back to another.
            With tensor_cores and config None, ``forward_wgmma`` runs where ``forward_wgmma.uses_wgmma`` holds
            (not FA2_NUMBA_WGMMA=0, Hopper, the inputs it takes; their softcap, ALiBi, window other than
            causal, packed batch or sink only where ``forward_wgmma.FEATURES`` names each).

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype. L: (batch, heads, seqlen_q), float32, natural log
        of the sum of exp of the final (capped, biased) scores; rows that see no key get O = 0 and L = +inf.
        Packed: O (1, heads, total_q, head_dim), L (1, heads, total_q); one kernel launch, no host sync.
    """
    if tensor_cores is None and config is None and forward_wgmma.uses_wgmma(q, k, v, spec):
        return forward_wgmma.flash_attn_forward(q, k, v, spec)
    if tensor_cores is None:
        tensor_cores = forward_tc.uses_tensor_cores(q)
    if tensor_cores:
        return forward_tc.flash_attn_forward(q, k, v, spec, config)
    return forward_simt.flash_attn_forward(q, k, v, spec, config)


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every forward kernel
    compiled so far in this process: one row per compiled specialisation of the SIMT kernel, then the
    tensor-core kernel's (with "kernel": "tensor-core"), then the wgmma kernel's ("kernel": "wgmma"); empty
    under the simulator."""
    return forward_simt.kernel_resources() + forward_tc.kernel_resources() + forward_wgmma.kernel_resources()
