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

The keywords a layer passes become fa2.attention's arguments, computed in its kernels:
- key and value with fewer heads than the query (grouped-query and multi-query attention: Llama, Mistral,
  Qwen2, Gemma 2) go in as they are, never repeated per query head.
- ``scaling`` is fa2's ``scale`` (Gemma 2: query_pre_attn_scalar ** -0.5).
- ``sliding_window=W`` (Mistral, Qwen2's and Gemma 2's sliding layers; None on full-attention layers) is
  fa2's ``window=(W - 1, W - 1)``, with causal making it (W - 1, 0): a query sees itself and the W - 1 keys
  before it, W keys in all, as transformers' eager mask (``masking_utils.sliding_window_overlay``:
  ``kv_idx > q_idx - W``, with ``kv_idx <= q_idx``) and its FlashAttention-2 path
  (``modeling_flash_attention_utils._process_flash_attention_kwargs``: ``window_size=(W - 1, W - 1)``) give.
  A non-causal layer sees the keys within W - 1 on either side, as that same FlashAttention-2 path (the
  encoders that pass a window, such as ModernBERT, pass their half-width plus one for it).
- ``softcap`` (Gemma 2's attn_logit_softcapping) is fa2's ``softcap``: scores become
  softcap · tanh(scores / softcap) before the mask, as in transformers' eager attention.

What ``attention_forward`` does with the mask it is given:
- None: one fa2.attention call, causal as the layer says (the ``is_causal`` keyword, else
  ``module.is_causal``), aligned bottom-right, which also places new queries after a KV cache correctly
  (with a sliding window too: the window ends at each query's own position).
- A 2-D padding mask for a non-causal layer without a sliding window (encoders such as BERT): each batch
  row attends to its own visible keys, one fa2.attention call per row (data-dependent shapes: eager mode
  only, not torch.compile(fullgraph=True)). Every query row gets what transformers' eager attention gives
  it, padding rows included (they attend to the visible keys); a row with no visible key at all gets zeros.
- Anything else (padding with a causal layer or with a sliding window, a 4-D mask that hides a key,
  attention dropout, attention sinks, position biases, packed sequences, paged caches, attention weights):
  NotImplementedError naming it. Packed sequences come as ``cu_seq_lens_q``/``cu_seq_lens_k`` keywords, or
  (padding-free training) only as a batch of one whose ``position_ids`` restart; the second is found as
  transformers' FlashAttention-2 path finds it (``_is_packed_sequence``), in eager mode only: under
  torch.compile that data-dependent check is not made.
"""

from __future__ import annotations

import functools
import operator

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
UNSUPPORTED = ("s_aux", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k",  # sinks, T5 biases, packing
               "block_table", "cache_seqlens")  # paged caches


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
    sliding_window: int | None = None,
    softcap: float | None = None,
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
        sliding_window: None, or W >= 1: a causal layer's query sees the W most recent keys, itself
            included (fa2 window (W - 1, 0)); a non-causal layer's the keys within W - 1 on either side
            (window (W - 1, W - 1)). See the module docstring for the transformers source it follows.
        softcap: None, or > 0: scores become softcap · tanh(scores / softcap) before the mask.
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
    window = _window(sliding_window)
    options = dict(scale=scaling, softcap=_softcap(softcap), backend=backend)

    keep = _visible_keys(attention_mask, key)
    if keep is None:
        _refuse_packed(kwargs.get("position_ids"), query)
        O = attention(query, key, value, causal=bool(is_causal), window=window, **options).O
    elif is_causal:
        raise NotImplementedError(
            f"fa2 does not support a padding mask with a causal layer ({type(module).__name__}): "
            "run unpadded batches (one sequence, or sequences of one length)"
        )
    elif sliding_window is not None:
        raise NotImplementedError(
            f"fa2 does not support a padding mask with a sliding window (sliding_window={sliding_window}, "
            f"{type(module).__name__}): dropping the padded keys would move the window; run unpadded batches"
        )
    else:
        O = torch.stack([
            attention(query[b], key[b][..., keep[b], :], value[b][..., keep[b], :], **options).O
            for b in range(query.shape[0])
        ])
    return O.transpose(1, 2).contiguous(), None


def _window(sliding_window) -> tuple[int, int]:
    """transformers' ``sliding_window`` keyword W as fa2's window: (W - 1, W - 1), which fa2.attention's
    causal turns into (W - 1, 0); None: no window (-1, -1). W = 0 would read as fa2's unbounded -1 and is
    refused rather than silently dropped."""
    if sliding_window is None:
        return (-1, -1)
    try:
        size = operator.index(sliding_window)
    except TypeError:
        raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__} "
                        f"{sliding_window!r}") from None
    if isinstance(sliding_window, bool) or size < 1:
        raise ValueError(f"sliding_window must be >= 1 (the keys a query sees, itself included) or None, "
                         f"got {sliding_window!r}")
    return (size - 1, size - 1)


def _softcap(softcap) -> float:
    """transformers' ``softcap`` keyword as fa2's: None is off (0.0). transformers' eager attention divides
    by any softcap it is given, so 0 (fa2's "off") is refused rather than read as off."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    return softcap


def _refuse_packed(position_ids: torch.Tensor | None, query: torch.Tensor) -> None:
    """NotImplementedError for packed sequences given only by position_ids: a (1, seqlen_q) batch whose
    positions are not one increasing run (transformers' eager attention masks each sequence to itself, and
    its FlashAttention-2 path runs them as separate sequences; fa2 would attend across them)."""
    if position_ids is None or torch.compiler.is_compiling():
        return
    if position_ids.dim() != 2 or tuple(position_ids.shape) != (1, query.shape[-2]) or query.shape[0] != 1:
        return
    if query.shape[-2] > 1 and bool((position_ids[0] - position_ids[0, 0] != torch.arange(
            query.shape[-2], device=position_ids.device)).any()):
        raise NotImplementedError(
            "fa2 does not support packed sequences (position_ids that restart within one batch row, "
            f"{position_ids[0, :8].tolist()}...): run the sequences as separate rows of one length"
        )


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
