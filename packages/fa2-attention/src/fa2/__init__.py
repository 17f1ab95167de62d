"""fa2: FlashAttention-2 written in PyTorch, Triton and numba-cuda behind one interface.

import fa2
O, L = fa2.attention(q, k, v, causal=True)          # picks a backend
O, L = fa2.attention(q, k, v, backend="triton")     # or names one; never falls back
O, L = fa2.attention(q, k, v, causal=True, window=(4096, 0), softcap=50.0)   # sliding window, softcap
O, L = fa2.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=True)  # packed
fa2.backends()                                      # what is installed and where it runs
O = fa2.scaled_dot_product_attention(q, k, v, is_causal=True)   # SDPA's signature and causal mask
out = fa2.flash_attn.flash_attn_func(q, k, v, causal=True)        # flash-attn 2.8's API, (b, s, h, d)
O, L = fa2.combine(torch.stack([O1, O2]), torch.stack([L1, L2]))  # attention over two key ranges' union
O, L = fa2.kvcache_attention(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new, causal=True)  # decode
"""

from fa2 import flash_attn  # the module of flash-attn 2.8's API: fa2.flash_attn.flash_attn_func, ...
from fa2.api import attention, varlen_attention
from fa2.combine import combine
from fa2.kvcache import kvcache_attention
from fa2.registry import BackendInfo, BackendNotInstalledError, backends
from fa2.sdpa import scaled_dot_product_attention
from fa2.spec import AttentionOutput

__all__ = [
    "AttentionOutput",
    "BackendInfo",
    "BackendNotInstalledError",
    "attention",
    "backends",
    "combine",
    "flash_attn",
    "kvcache_attention",
    "scaled_dot_product_attention",
    "varlen_attention",
]
__version__ = "0.1.0"
