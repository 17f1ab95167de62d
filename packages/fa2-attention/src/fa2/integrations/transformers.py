"""fa2 as a transformers attention implementation.

    from fa2.integrations import transformers as fa2_transformers
    fa2_transformers.register()                     # or register(backend="triton")
    model = AutoModel.from_pretrained(path, attn_implementation="fa2")

transformers is an optional dependency: ``pip install "fa2-attention[transformers]"``.

``register`` adds one name to two of transformers' global registries:
- ``AttentionInterface``: ``attention_forward``, which every attention layer of a model then calls.
- ``AttentionMaskInterface``: transformers' own FlashAttention-2 mask function, which hands the layers None
  when every key is visible and the 2-D (batch, seqlen_k) padding mask otherwise. Without a mask function
  transformers gives a custom attention no mask at all, and padding tokens would be attended silently.

What ``attention_forward`` does with the mask it is given:
- None: one fa2.attention call, causal as the layer says (the ``is_causal`` keyword, else
  ``module.is_causal``), aligned bottom-right, which also places new queries after a KV cache correctly.
- A 2-D padding mask for a non-causal layer (encoders such as BERT): each batch row attends to its own
  visible keys, one fa2.attention call per row (data-dependent shapes: eager mode only, not
  torch.compile(fullgraph=True)). Every query row gets what transformers' eager attention gives it,
  padding rows included (they attend to the visible keys); a row with no visible key at all gets zeros.
- Anything else (padding with a causal layer, a 4-D mask that hides a key, attention dropout, sliding
  windows, softcapping, attention sinks, packed sequences, attention weights): NotImplementedError naming it.
"""

from __future__ import annotations

import functools

import torch

from fa2.api import attention
from fa2.registry import install_command

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as e:
    raise ImportError(f"fa2.integrations.transformers needs transformers: {install_command('transformers')} ({e})") from e

NAME = "fa2"
# Keywords transformers passes for features fa2 does not have; any of them not None is refused.
UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")


def register(backend: str | None = None, name: str = NAME) -> None:
    """Makes ``attn_implementation=name`` run fa2 with ``backend`` (None: as fa2.attention picks) in every
    transformers model that supports the attention interface. Calling it again re-points ``name``."""
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, flash_attention_mask)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on fa2.

    Arguments:
        module: the attention layer; ``module.is_causal`` unless an ``is_causal`` keyword is given.
        query: (batch, heads_q, seqlen_q, head_dim).
        key, value: (batch, heads_kv, seqlen_k, head_dim); heads_q a multiple of heads_kv (grouped-query
            attention, which fa2's kernels compute on key and value as they are).
        attention_mask: None, or the (batch, seqlen_k) padding mask of the mask function ``register`` sets
            (True: visible), or a 4-D mask that hides nothing (see the module docstring).
        scaling: multiplies q kᵀ; default 1 / sqrt(head_dim).
        dropout: must be 0 (the model in eval mode, or its attention dropout probability 0).
        backend: as fa2.attention.

    Returns:
        (attn_output, None): attn_output (batch, seqlen_q, heads_q, head_dim), query's dtype, contiguous;
        no attention weights.
    """
    if dropout:
        raise NotImplementedError(
            f"fa2 has no attention dropout, got dropout={dropout}: call model.eval() for inference, or set "
            "the model's attention dropout probability to 0 to train with fa2"
        )
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"fa2 does not support {name} (got {name}={kwargs[name]!r})")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("fa2 does not compute attention weights: use output_attentions=False")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", None)
        if is_causal is None:
            raise ValueError(f"{type(module).__name__} has no is_causal attribute and none was passed")

    keep = _visible_keys(attention_mask, key)
    if keep is None:
        O = attention(query, key, value, causal=bool(is_causal), scale=scaling, backend=backend).O
    elif is_causal:
        raise NotImplementedError(
            f"fa2 does not support a padding mask with a causal layer ({type(module).__name__}): "
            "run unpadded batches (one sequence, or sequences of one length)"
        )
    else:
        O = torch.stack([
            attention(query[b], key[b][..., keep[b], :], value[b][..., keep[b], :], scale=scaling,
                      backend=backend).O
            for b in range(query.shape[0])
        ])
    return O.transpose(1, 2).contiguous(), None


def _visible_keys(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """None when every key is visible to every query, else the (batch, seqlen_k) bool padding mask."""
    if attention_mask is None:
        return None
    batch, seqlen_k = key.shape[0], key.shape[-2]
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, seqlen_k):
            raise NotImplementedError(
                f"fa2 needs a (batch, seqlen_k) = {(batch, seqlen_k)} padding mask, got "
                f"{tuple(attention_mask.shape)} (a static cache longer than the keys is not supported)"
            )
        keep = attention_mask.bool()
        return None if keep.all() else keep
    if attention_mask.dim() == 4:
        hides_nothing = attention_mask.all() if attention_mask.dtype == torch.bool else (attention_mask == 0).all()
        if hides_nothing:
            return None
    raise NotImplementedError(
        f"fa2 supports no attention mask but a (batch, seqlen_k) padding mask, got a {attention_mask.dtype} "
        f"mask of shape {tuple(attention_mask.shape)} that hides keys"
    )
