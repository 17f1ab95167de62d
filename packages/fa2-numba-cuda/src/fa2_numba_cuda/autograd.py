"""``FlashAttention2``: the torch.autograd.Function of the CS336 contract around this backend's forward and
backward, built by ``fa2.autograd.make_flash_attention2``, which defines it once for every backend."""

from fa2.autograd import make_flash_attention2
from fa2_numba_cuda.backward import flash_attn_backward
from fa2_numba_cuda.forward import flash_attn_forward

FlashAttention2 = make_flash_attention2(flash_attn_forward, flash_attn_backward, __name__)
