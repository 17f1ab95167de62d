"""``FlashAttention2``, the torch.autograd.Function of the CS336 contract, defined once for every backend:
each backend's ``autograd.py`` builds its own around its forward and backward,

    FlashAttention2 = make_flash_attention2(flash_attn_forward, flash_attn_backward, __name__)
"""

from __future__ import annotations

import torch

from fa2.layout import Backward, Forward, backward_any_rank, forward_any_rank, spec_for


def make_flash_attention2(
    flash_attn_forward: Forward, flash_attn_backward: Backward, module: str
) -> type[torch.autograd.Function]:
    """The ``FlashAttention2`` class of a backend whose (B, H, N, D) kernels are ``flash_attn_forward`` and
    ``flash_attn_backward``; ``module``: the module it is defined in, as its ``__module__`` (so that it
    shows and pickles as ``<module>.FlashAttention2``)."""

    class FlashAttention2(torch.autograd.Function):
        """``FlashAttention2.apply(q, k, v, is_causal=False, scale=None, return_lse=False, spec=None)``.

        q: (..., seqlen_q, head_dim); k, v: (..., seqlen_k, head_dim), whose heads (dim -3) may be a divisor of
        q's (grouped-query attention; dk and dv then sum over each group). Returns O, or (O, L) with
        ``return_lse``; saves (q, k, v, O, L) for the backward, L: q.shape[:-1], float32. ``spec``: an
        ``fa2.spec.AttentionSpec`` (windows, softcap, ALiBi, packed batches), which then stands for ``is_causal``
        and ``scale``; fa2.attention and fa2.varlen_attention pass one. The ALiBi slopes get no gradient.
        """

        @staticmethod
        def forward(ctx, q, k, v, is_causal=False, scale=None, return_lse=False, spec=None):
            if spec is None:
                spec = spec_for(q, k, is_causal, scale)
            O, L = forward_any_rank(flash_attn_forward, q, k, v, spec)
            ctx.save_for_backward(q, k, v, O, L)
            ctx.spec = spec
            if return_lse:
                ctx.mark_non_differentiable(L)
                return O, L
            return O

        @staticmethod
        def backward(ctx, dO, *unused):
            q, k, v, O, L = ctx.saved_tensors
            dq, dk, dv = backward_any_rank(flash_attn_backward, q, k, v, O, L, dO, ctx.spec)
            return dq, dk, dv, None, None, None, None

    FlashAttention2.__module__ = module
    FlashAttention2.__qualname__ = "FlashAttention2"
    return FlashAttention2
