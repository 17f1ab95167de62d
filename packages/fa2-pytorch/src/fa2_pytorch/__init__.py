"""fa2-pytorch: FlashAttention-2's tiled forward in plain PyTorch, on any device PyTorch runs on."""

from fa2_pytorch.autograd import FlashAttention2
from fa2_pytorch.backward import flash_attn_backward
from fa2_pytorch.forward import flash_attn_forward
from fa2_pytorch.kvcache import kvcache_forward

NAME = "pytorch"


def availability() -> tuple[str, str]:
    """("native", why): plain PyTorch runs wherever torch does, CPU and CUDA alike."""
    return "native", "plain PyTorch ops on CPU or CUDA tensors"


__all__ = ["NAME", "FlashAttention2", "availability", "flash_attn_backward", "flash_attn_forward", "kvcache_forward"]
