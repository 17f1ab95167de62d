"""fa2-triton: FlashAttention-2's forward and backward as Triton kernels, on CUDA or in Triton's CPU
interpreter."""

import torch
import triton

from fa2_triton.autograd import FlashAttention2
from fa2_triton.backward import flash_attn_backward
from fa2_triton.common import INTERPRETED
from fa2_triton.forward import flash_attn_forward
from fa2_triton.kvcache import kvcache_forward

NAME = "triton"


def availability() -> tuple[str, str]:
    """("emulated", why) under Triton's interpreter (TRITON_INTERPRET=1 when fa2_triton was imported),
    ("native", why) with a CUDA device, else ("unavailable", why)."""
    if INTERPRETED:
        return "emulated", f"Triton {triton.__version__}'s interpreter on CPU tensors (TRITON_INTERPRET=1)"
    if torch.cuda.is_available():
        return "native", f"Triton {triton.__version__} on {torch.cuda.get_device_name()}"
    return "unavailable", (
        "no CUDA device; set TRITON_INTERPRET=1 in the environment before fa2_triton is imported to run "
        "Triton's CPU interpreter on CPU tensors"
    )


__all__ = ["NAME", "FlashAttention2", "availability", "flash_attn_backward", "flash_attn_forward", "kvcache_forward"]
