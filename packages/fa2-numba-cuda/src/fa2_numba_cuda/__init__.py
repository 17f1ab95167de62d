"""fa2-numba-cuda: FlashAttention-2's forward and backward as numba-cuda kernels on CUDA cores, or in numba's
CUDA simulator on the CPU (NUMBA_ENABLE_CUDASIM=1, set before numba is imported)."""

from fa2_numba_cuda.autograd import FlashAttention2
from fa2_numba_cuda.backward import flash_attn_backward
from fa2_numba_cuda.common import simulated
from fa2_numba_cuda.forward import flash_attn_forward, kernel_resources
from fa2_numba_cuda.kvcache import kvcache_forward

NAME = "numba-cuda"


def availability() -> tuple[str, str]:
    """("emulated", why) under numba's CUDA simulator (CPU tensors); ("native", why) where numba and torch
    both see a CUDA device (CUDA tensors); else ("unavailable", why)."""
    import torch
    from numba import cuda

    if simulated():
        return "emulated", "numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), on CPU tensors"
    if not torch.cuda.is_available():
        return "unavailable", "torch sees no CUDA device (set NUMBA_ENABLE_CUDASIM=1 to run in numba's simulator)"
    if not cuda.is_available():
        return "unavailable", "numba-cuda finds no usable CUDA driver or device"
    return "native", f"numba-cuda {_version()} on {torch.cuda.get_device_name()}"


def _version() -> str:
    from importlib.metadata import version

    return version("numba-cuda")


__all__ = [
    "NAME",
    "FlashAttention2",
    "availability",
    "flash_attn_backward",
    "flash_attn_forward",
    "kernel_resources",
    "kvcache_forward",
]
