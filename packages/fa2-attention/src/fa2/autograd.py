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
        """``FlashAttention2.apply(q, k, v, is_causal=False, scale=None, return_lse=False, spec=None, sink=None)``.

        q: (..., seqlen_q, head_dim); k, v: (..., seqlen_k, head_dim), whose heads (dim -3) may be a divisor of
        q's (grouped-query attention; dk and dv then sum over each group). Returns O, or (O, L) with
        ``return_lse``; saves (q, k, v, O, L) for the backward, L: q.shape[:-1], float32. ``spec``: an
        ``fa2.spec.AttentionSpec`` (windows, softcap, ALiBi, packed batches), which then stands for ``is_causal``
        and ``scale``; fa2.attention and fa2.varlen_attention pass one. The ALiBi slopes get no gradient.
        ``sink``: None, or the attention sinks, (heads,) float32 contiguous on q's device (``AttentionSpec.sink``):
        an autograd input, which gets its gradient dsink; it stands for ``spec.sink`` (fa2.attention passes
        that tensor here). A sink given only inside ``spec`` is computed with but gets no gradient.
        """

        @staticmethod
        def forward(ctx, q, k, v, is_causal=False, scale=None, return_lse=False, spec=None, sink=None):
            if spec is None:
                spec = spec_for(q, k, is_causal, scale)
            if sink is not None:
                spec = spec.replace(sink=sink)
            O, L = forward_any_rank(flash_attn_forward, q, k, v, spec)
            # The sink is saved as a tensor, not inside ctx.spec, so that an in-place change before the backward
            # (an optimizer step) raises instead of giving a wrong gradient; without one, the saved tensors
            # are the CS336 contract's (q, k, v, O, L).
            ctx.save_for_backward(q, k, v, O, L, *(() if spec.sink is None else (spec.sink,)))
            ctx.spec = spec if spec.sink is None else spec.replace(sink=None)
            # L's gradient (L is non-differentiable) would otherwise be a zeros tensor made on every backward:
            # a fill kernel and ~10 µs of host time a step (torch.profiler on the H200).
            ctx.set_materialize_grads(False)
            if return_lse:
                ctx.mark_non_differentiable(L)
                return O, L
            return O

        @staticmethod
        def backward(ctx, dO, *unused):
            if dO is None:  # O reached no loss: every gradient is zero, which None stands for
                return None, None, None, None, None, None, None, None
            q, k, v, O, L, *sink = ctx.saved_tensors
            spec = ctx.spec.replace(sink=sink[0]) if sink else ctx.spec
            dq, dk, dv, *dsink = backward_any_rank(flash_attn_backward, q, k, v, O, L, dO, spec)
            dsink = dsink[0] if dsink and ctx.needs_input_grad[7] else None
            return dq, dk, dv, None, None, None, None, dsink

    FlashAttention2.__module__ = module
    FlashAttention2.__qualname__ = "FlashAttention2"
    return FlashAttention2
