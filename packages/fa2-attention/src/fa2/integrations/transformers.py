"""fa2 as a transformers attention implementation.

    from fa2.integrations import transformers as fa2_transformers
    fa2_transformers.register()                     # or register(backend="triton")
    model = AutoModel.from_pretrained(path, attn_implementation="fa2")

transformers is an optional dependency: ``pip install "fa2-attention[transformers]"``.

``register`` adds one name to two of transformers' global registries:
- ``AttentionInterface``: ``attention_forward``, which every attention layer of a model then calls.
- ``AttentionMaskInterface``: ``padding_mask``, transformers' own FlashAttention-2 mask function, which hands
  the layers None when every key is visible and the 2-D (batch, seqlen_k) padding mask otherwise, plus the
  mask of a static cache's written slots (``cache_implementation="static"``) where that function gives
  None. Without a mask function transformers gives a custom attention no mask at all, and padding tokens
  would be attended silently.

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
- ``s_aux`` (gpt-oss's ``sinks``, one logit per query head) is fa2's ``sink``, cast to float32: it joins
  every row's softmax denominator, as gpt-oss's eager attention appends it as one more column, and its
  gradient flows back to the parameter.

What ``attention_forward`` does with the mask it is given:
- None: one fa2.attention call, causal as the layer says (the ``is_causal`` keyword, else
  ``module.is_causal``), aligned bottom-right, which also places new queries after a KV cache correctly
  (with a sliding window too: the window ends at each query's own position). Packed sequences instead go to
  one fa2.varlen_attention call (below).
- A 2-D (batch, seqlen_k) padding mask (batched ``generate`` with left padding, fine-tuning that pads,
  padded encoders): as transformers' FlashAttention-2 path (``modeling_flash_attention_utils._upad_input``),
  the batch is unpadded into one fa2.varlen_attention call, each row a sequence of its real tokens, and the
  output padded back; padded query rows get zeros. Fewer queries than keys (a decode step against a KV
  cache) with every row's padding on its left and no gradient wanted: one fa2.kvcache_attention call on
  the keys in place, each row's padding its ``cache_leftpad``, nothing copied. A mask shorter than the keys
  (a static cache, whose slots past the tokens so far are unwritten) covers the keys it has, and the rest
  are dropped. Reading the mask costs two device syncs (two more for the query rows where they are fewer
  than the keys and unpadded), made once per mask tensor (every layer of a forward gets the same one):
  data-dependent, so eager mode only, but for the decode steps (fewer queries than keys, no gradient
  wanted), which under torch.compile(fullgraph=True) take each row's visible keys to be one run,
  found by tensor ops, and call fa2.kvcache_attention on the whole cache (a static cache: one graph). Causal and
  window alignment are each row's own, on its real tokens; padding between a row's real tokens is refused
  with a causal layer, a window or a KV cache (NotImplementedError), and taken by an encoder's layer.
- A 4-D mask that hides nothing: as None.
- Anything else (a 4-D mask that hides a key, packed sequences together with a padding mask, attention
  dropout, position biases, paged caches, attention weights): NotImplementedError naming it.

Packed sequences (padding-free training: transformers' ``DataCollatorWithFlattening`` concatenates the
examples into one batch row) run as one fa2.varlen_attention call over the flattened tokens, each sequence
attending only to itself, with the layer's causal, window, softcap and scale applied per sequence; the
output is (batch, seqlen, heads, head_dim) as for any other batch. They are found as transformers'
FlashAttention-2 path (``modeling_flash_attention_utils._flash_attention_forward``, transformers 5.x)
finds them, when the mask is None:
1. ``cu_seq_lens_q`` and ``cu_seq_lens_k`` keywords (``DataCollatorWithFlattening(
   return_flash_attn_kwargs=True)``, or a model that computes them): those offsets over the batch's
   tokens flattened in order (batch * seqlen of them), cast to int32 on the query's device, with
   ``max_length_q`` / ``max_length_k`` as max_seqlen. No device sync here when the maxima are ints (as
   the collator gives them); a tensor maximum is read (one sync), a missing one is the offsets' longest
   sequence (one sync, made once per offsets tensor as below).
2. Else a batch of one whose ``position_ids`` (1, seqlen_q) restart: a sequence starts at the first token
   and wherever the position equals the row's minimum (``prepare_fa_kwargs_from_position_ids``: 0, or a
   RoBERTa-like model's padding_idx + 1), key and query lengths equal. Positions that jump without
   restarting (0 1 2 7 8) stay one sequence, as in that path; transformers' eager and SDPA masks
   (``masking_utils.find_packed_sequence_indices``) would split them. A row that does not start at its
   minimum (3 4 0 1 2) is two sequences here, as in those masks (that path would leave its first tokens
   out of every sequence). Finding the offsets costs two device syncs (the number of restarts, then the
   longest sequence), made once per position_ids tensor: every layer of a forward is handed the same one,
   and later layers reuse the offsets while its version counter is unchanged (inference-mode tensors have
   none: every layer pays).
   Under torch.compile position_ids are not read (the check is data-dependent) and a packed row would run
   as one sequence: pass the cu_seq_lens keywords there. A batch of more than one row is never read as
   packed from its position_ids (as in that path).
fa2.varlen_attention then checks the offsets' first and last entries with one sync the first time it meets
an offsets tensor (every layer gets the same one; inference-mode tensors are checked every call); a backend
without a packed path (``NotImplementedError``) refuses the call.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import NamedTuple

import torch

from fa2.api import attention, varlen_attention
from fa2.kvcache import kvcache_attention
from fa2.registry import install_command

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as e:
    raise ImportError(
        f"fa2.integrations.transformers needs transformers: {install_command('transformers')} ({e})"
    ) from e

NAME = "fa2"
# Keywords transformers passes for features fa2 does not have; any of them not None is refused.
UNSUPPORTED = (
    "position_bias",  # T5 biases
    "block_table",
    "cache_seqlens",
)  # paged caches


def register(backend: str | None = None, name: str = NAME) -> None:
    """Makes ``attn_implementation=name`` run fa2 with ``backend`` (None: as fa2.attention picks) in every
    transformers model that supports the attention interface. Calling it again re-points ``name``."""
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, **kwargs):
    """transformers' FlashAttention-2 mask function (None when every key is visible, else the (batch,
    seqlen_k) padding mask), and for a static cache without padding, whose kv_length slots outrun the
    q_offset + q_length tokens written so far, the (batch_size, kv_length) mask of the written ones (that
    function returns None there, and the unwritten slots would be attended to). Under torch.compile a given
    mask is returned as that function slices it, without its check that every key is visible (data-dependent:
    a graph break), for ``_padded_forward``'s compiled path."""
    attention_mask = kwargs.get("attention_mask")
    if torch.compiler.is_compiling() and attention_mask is not None:
        # sym_max, not [-kv_length:]: a slice's clamp would guard the mask's growing length against kv_length.
        # Plain ints (a static length) take max: torch 2.11's dynamo refuses a sym_max that returns an int.
        start = attention_mask.shape[1] - kv_length
        return attention_mask[:, torch.sym_max(start, 0) if isinstance(start, torch.SymInt) else max(start, 0) :]
    mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, **kwargs)
    if mask is not None or attention_mask is not None:
        return mask
    written = q_offset + q_length - kv_offset  # a tensor while decoding (cache_position)
    if not isinstance(written, torch.Tensor) and written >= kv_length:
        return None
    return (torch.arange(kv_length, device=kwargs.get("device")) < written).expand(batch_size, kv_length)


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
        kwargs: what else the layer passes; read are ``is_causal``, ``output_attentions``, ``s_aux`` (attention
            sinks), the refused
            UNSUPPORTED, and the packed-sequence keywords ``cu_seq_lens_q``, ``cu_seq_lens_k``,
            ``max_length_q``, ``max_length_k`` and ``position_ids`` (see the module docstring).

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
    s_aux = kwargs.get("s_aux")
    if s_aux is not None:
        # gpt-oss's sinks are a parameter in the model's dtype; fa2 takes float32 (the cast carries dsink back).
        options["sink"] = s_aux.float() if isinstance(s_aux, torch.Tensor) else s_aux

    if attention_mask is None or attention_mask.dim() == 4:
        _check_4d_mask(attention_mask)
        packed = _packed_offsets(query, key, kwargs)
        if packed is not None:
            return _varlen_forward(query, key, value, packed, causal=bool(is_causal), window=window, **options), None
        O = attention(query, key, value, causal=bool(is_causal), window=window, **options).O
        return O.transpose(1, 2).contiguous(), None
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise NotImplementedError(
            f"fa2 does not support packed sequences (cu_seq_lens_q/k) together with a padding mask "
            f"({type(module).__name__}): drop the padding, the offsets already delimit the sequences"
        )
    return _padded_forward(query, key, value, attention_mask, causal=bool(is_causal), window=window, **options), None


def _varlen_forward(query, key, value, packed, **options) -> torch.Tensor:
    """fa2.varlen_attention on the batch's tokens flattened in order: query (batch, heads_q, seqlen_q,
    head_dim) as (batch * seqlen_q, heads_q, head_dim) (a view for a batch of one), key and value likewise;
    the output (batch, seqlen_q, heads_q, head_dim), contiguous."""
    cu_q, cu_k, max_q, max_k = packed
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1]) for t in (query, key, value))
    O = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **options).O  # (batch * seqlen_q, heads_q, head_dim)
    return O.reshape(query.shape[0], query.shape[2], *O.shape[1:]).contiguous()


def _window(sliding_window) -> tuple[int, int]:
    """transformers' ``sliding_window`` keyword W as fa2's window: (W - 1, W - 1), which fa2.attention's
    causal turns into (W - 1, 0); None: no window (-1, -1). W = 0 would read as fa2's unbounded -1 and is
    refused rather than silently dropped."""
    if sliding_window is None:
        return (-1, -1)
    try:
        size = operator.index(sliding_window)
    except TypeError:
        raise TypeError(
            f"sliding_window must be an int or None, got {type(sliding_window).__name__} {sliding_window!r}"
        ) from None
    if isinstance(sliding_window, bool) or size < 1:
        raise ValueError(
            f"sliding_window must be >= 1 (the keys a query sees, itself included) or None, got {sliding_window!r}"
        )
    return (size - 1, size - 1)


def _softcap(softcap) -> float:
    """transformers' ``softcap`` keyword as fa2's: None is off (0.0). transformers' eager attention divides
    by any softcap it is given, so 0 (fa2's "off") is refused rather than read as off."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    return softcap


def _packed_offsets(query: torch.Tensor, key: torch.Tensor, kwargs: dict):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed sequences, or None: from the
    cu_seq_lens_q/k and max_length_q/k keywords, else from a batch of one's restarting position_ids (the
    module docstring says when each is read and what it costs)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            missing = "cu_seq_lens_k" if cu_k is None else "cu_seq_lens_q"
            raise ValueError(f"packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got no {missing}")
        same = cu_k is cu_q
        cu_q = _as_offsets(cu_q, query.device)
        cu_k = cu_q if same else _as_offsets(cu_k, query.device)
        given_q, given_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = _max_length(given_q, cu_q)
        max_k = max_q if same and given_k is given_q else _max_length(given_k, cu_k)
        return cu_q, cu_k, max_q, max_k
    position_ids = kwargs.get("position_ids")
    n = query.shape[-2]
    if (
        position_ids is None
        or torch.compiler.is_compiling()
        or query.shape[0] != 1
        or n <= 1
        or position_ids.dim() != 2
        or tuple(position_ids.shape) != (1, n)
    ):
        return None
    cu, max_len = _memo(position_ids, _restarts)
    if cu is None:
        return None
    cu = cu.to(query.device)  # the same tensor unless a model spread over devices handed position_ids over
    if key.shape[-2] != n:
        raise NotImplementedError(
            f"fa2 does not support packed sequences (position_ids that restart, "
            f"{position_ids[0, :8].tolist()}...) with {key.shape[-2]} keys for {n} queries (a KV cache): the "
            "keys' offsets are unknown; pass cu_seq_lens_q and cu_seq_lens_k"
        )
    return cu, cu, max_len, max_len


def _restarts(position_ids: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """(cu_seqlens int32 on position_ids' device, the longest sequence) of a (1, n) position_ids whose
    sequences start at its first token and wherever it equals its minimum; (None, 0) for one sequence.
    Two device syncs: nonzero's count, and the maximum."""
    pos = position_ids[0]
    starts = pos == pos.min()
    starts[0] = True
    first = starts.nonzero().view(-1)  # device sync: the number of sequences
    if first.numel() == 1:
        return None, 0
    cu = torch.cat([first, first.new_full((1,), pos.numel())]).to(torch.int32)
    return cu, int(cu.diff().max())  # device sync


def _as_offsets(cu, device: torch.device):
    """A cu_seq_lens keyword as fa2.varlen_attention's int32 offsets on the query's device (the same tensor
    when it already is one: transformers' collator makes int32); anything else goes on to its TypeError."""
    if isinstance(cu, torch.Tensor):
        return cu.to(device=device, dtype=torch.int32)
    return cu


def _max_length(given, cu) -> int:
    """A max_length keyword as an int: as given, a tensor read (one sync), or None: the offsets' longest
    sequence (one sync, made once per offsets tensor)."""
    if isinstance(given, torch.Tensor):
        return int(given)
    if given is None and isinstance(cu, torch.Tensor):
        return _memo(cu, _longest)
    return given


def _longest(cu: torch.Tensor) -> int:
    return int(cu.diff().max()) if cu.numel() > 1 else 0


# (id(tensor), fn, args) -> (weak reference to the tensor, its version counter, fn(tensor, *args)); an entry
# leaves when its tensor is freed.
_MEMO: dict = {}


def _memo(t: torch.Tensor, fn, *args):
    """fn(t, *args), computed once while t lives and is not modified in place (its version counter): a model
    hands every layer the same position_ids, cu_seq_lens and attention_mask tensors, so only its first layer
    pays fn's device syncs. Inference-mode tensors have no version counter, and under torch.compile nothing
    is kept: fn runs every call."""
    if torch.compiler.is_compiling() or t.is_inference():
        return fn(t, *args)
    key = (id(t), fn, args)
    hit = _MEMO.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = fn(t, *args)
    _MEMO[key] = (weakref.ref(t, lambda _, key=key, memo=_MEMO: memo.pop(key, None)), t._version, value)
    return value


def _check_4d_mask(attention_mask: torch.Tensor | None) -> None:
    """A 4-D mask (what a model built without ``register``'s mask function passes) is taken only when it
    hides nothing: fa2 has no arbitrary masks."""
    if attention_mask is None:
        return
    hides_nothing = attention_mask.all() if attention_mask.dtype == torch.bool else (attention_mask == 0).all()
    if not hides_nothing:
        raise NotImplementedError(
            f"fa2 supports no attention mask but a (batch, seqlen_k) padding mask, got a {attention_mask.dtype} "
            f"mask of shape {tuple(attention_mask.shape)} that hides keys"
        )


class _Padding(NamedTuple):
    """What a (batch, seqlen) padding mask says, read from the device once per mask tensor (``_memo``).

    keep: the bool mask. all_visible: no padding at all. indices: the flat positions (b * seqlen + t) of
    the visible tokens, in order; cu_seqlens: (batch + 1,) int32 offsets of each row's visible tokens;
    longest: the most visible tokens in a row. contiguous: every row's visible tokens are one run (padding
    at either end or both), [start, end) (batch,) int32 (0, 0 for a row with none)."""

    keep: torch.Tensor
    all_visible: bool
    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int
    contiguous: bool
    start: torch.Tensor
    end: torch.Tensor


def _padding(mask: torch.Tensor) -> _Padding:
    """The facts of a (batch, seqlen) padding mask: two device syncs (one read of three numbers, then the
    count of visible tokens)."""
    keep = mask.bool()
    batch, n = keep.shape
    counts, start, end = _extent(keep)
    facts = torch.stack(
        [
            (counts == n).all().long(),
            (end - start == counts).all().long(),
            counts.max().long() if batch else counts.new_zeros((), dtype=torch.long),
        ]
    ).tolist()  # device sync
    indices = keep.flatten().nonzero().view(-1)  # device sync: how many
    cu_seqlens = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    return _Padding(keep, bool(facts[0]), indices, cu_seqlens, facts[2], bool(facts[1]), start, end)


def _last_padding(mask: torch.Tensor, n: int) -> _Padding:
    """The facts of a (batch, seqlen) padding mask's last n positions: the query rows' where the n queries
    are the keys' last (after a KV cache)."""
    return _padding(mask[:, -n:])


def _extent(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch,) int32 each, of a (batch, seqlen) bool mask, by tensor ops only (no device sync): each row's
    count of visible tokens, and the [start, end) from its first to its last (0, 0 for a row with none)."""
    n = keep.shape[1]
    counts = keep.sum(1, dtype=torch.int32)
    if not n:
        return counts, counts, counts
    positions = torch.arange(n, device=keep.device, dtype=torch.int32)
    some = counts > 0
    start = torch.where(keep, positions, n).amin(1).where(some, 0)
    end = (torch.where(keep, positions, -1).amax(1) + 1).where(some, 0)
    return counts, start, end


def _padded_forward(query, key, value, attention_mask, *, causal: bool, window, **options) -> torch.Tensor:
    """Attention of a padded batch, as transformers' FlashAttention-2 path computes it: (batch, seqlen_q,
    heads_q, head_dim), zeros on padded query rows.

    - Query rows as many as keys (prefill, training, encoders): the visible tokens are packed (unpadded)
      into one fa2.varlen_attention call, each row a sequence, and its output scattered back.
    - Fewer queries than keys (decode steps, a chunk after a KV cache), each row's visible keys one run
      (left padding from batched ``generate``; a static cache's unwritten slots after them) and no
      gradient wanted: one fa2.kvcache_attention call on the keys in place, each row's run
      [cache_leftpad, cache_seqlens), its queries the run's last ones; nothing is copied.
    - Otherwise fewer queries than keys: the keys are unpacked as above and the queries are the last
      seqlen_q positions of the mask (as that path assumes: padding on the left).
    A mask shorter than the keys (a static cache, whose slots past the tokens so far are unwritten) covers
    the keys it has; the rest are dropped. Causal and window alignment per row is on the row's visible
    tokens, which is its own positions when the padding is at the ends of the row; a mask with padding
    between visible tokens is taken only by a non-causal layer without a window (an encoder), where
    positions do not matter."""
    batch, heads, seqlen_q, head_dim = query.shape
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > key.shape[-2]:
        raise ValueError(
            f"attention_mask must be a (batch, seqlen_k) padding mask, batch {batch} and seqlen_k at most the "
            f"keys' {key.shape[-2]}, got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool and (attention_mask.is_floating_point() or attention_mask.is_complex()):
        raise TypeError(f"attention_mask must be bool or integer (1: visible, 0: padding), got {attention_mask.dtype}")
    sink = options.get("sink")
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sink))
    if torch.compiler.is_compiling() and seqlen_q < key.shape[-2] and not wants_grad:
        # Reading the mask's facts is data-dependent (a graph break): each row's visible keys are taken to be
        # one run, as left padding and a static cache's unwritten slots leave them, and not checked. The keys
        # are not cut to the mask's length, which grows by a token a step: the graph keeps the cache's shape.
        _, start, end = _extent(attention_mask.bool())
        O = kvcache_attention(query, key, value, end, cache_leftpad=start, causal=causal, window=window, **options).O
        return O.transpose(1, 2).contiguous()
    seqlen_k = attention_mask.shape[1]
    if seqlen_k != key.shape[-2]:  # a static cache's unwritten slots (two slices cost ~4 µs a decode step)
        key, value = key.narrow(-2, 0, seqlen_k), value.narrow(-2, 0, seqlen_k)
    pad = _memo(attention_mask, _padding)
    if pad.all_visible:
        O = attention(query, key, value, causal=causal, window=window, **options).O
        return O.transpose(1, 2).contiguous()
    if not pad.contiguous and (causal or window != (-1, -1) or seqlen_q != seqlen_k):
        raise NotImplementedError(
            "fa2 supports padding at the ends of each row (left or right) with a causal layer, a sliding window "
            "or a KV cache, got a mask with padding between visible tokens"
        )
    if seqlen_q < seqlen_k and pad.contiguous and not wants_grad:
        O = kvcache_attention(
            query, key, value, pad.end, cache_leftpad=pad.start, causal=causal, window=window, **options
        ).O
        return O.transpose(1, 2).contiguous()
    heads_k = key.shape[1]
    k, v = (t.transpose(1, 2).reshape(batch * seqlen_k, heads_k, head_dim)[pad.indices] for t in (key, value))
    q_pad = pad if seqlen_q == seqlen_k else _memo(attention_mask, _last_padding, seqlen_q)
    q = query.transpose(1, 2).reshape(batch * seqlen_q, heads, head_dim)[q_pad.indices]
    O = varlen_attention(
        q, k, v, q_pad.cu_seqlens, pad.cu_seqlens, q_pad.longest, pad.longest, causal=causal, window=window, **options
    ).O
    out = O.new_zeros(batch * seqlen_q, heads, head_dim).index_copy(0, q_pad.indices, O)
    return out.view(batch, seqlen_q, heads, head_dim)
