"""``fa2.scaled_dot_product_attention``: the signature, layout and causal alignment of
``torch.nn.functional.scaled_dot_product_attention``, computed by fa2, for code written against SDPA.

What SDPA has and fa2 does not (an arbitrary ``attn_mask``, ``dropout_p``) is refused with
NotImplementedError, never approximated.
"""

from __future__ import annotations

import torch

from fa2.api import attention
from fa2.validation import validate


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """softmax(query keyᵀ · scale) value, as SDPA: the same argument order, layout and causal mask.

    Arguments:
        query: (batch, heads_q, seqlen_q, head_dim), or any (..., seqlen_q, head_dim) that fa2.attention takes.
        key: (batch, heads_kv, seqlen_k, head_dim); heads_kv = heads_q unless ``enable_gqa``.
        value: (batch, heads_kv, seqlen_k, head_dim), key's shape (fa2 has one head_dim for q, k and v).
        attn_mask: must be None: fa2 has no mask but the causal one (NotImplementedError otherwise).
        dropout_p: must be 0.0: fa2 has no attention dropout (NotImplementedError otherwise).
        is_causal: SDPA's causal mask, aligned top-left: key j is visible to query i iff j <= i. With
            seqlen_q = 2 and seqlen_k = 5::

                1 0 0 0 0
                1 1 0 0 0

            fa2.attention aligns bottom-right; the two agree when seqlen_q = seqlen_k. Otherwise the result
            is still SDPA's: with seqlen_q < seqlen_k no query sees a key from seqlen_q on, so those keys are
            sliced away (a view); with seqlen_q > seqlen_k the queries from seqlen_k on see every key and run
            without the mask, in a second call whose output is concatenated.
        scale: multiplies query keyᵀ; default 1 / sqrt(head_dim).
        enable_gqa: grouped-query attention: heads_q a multiple of heads_kv, query head h attends with
            key/value head h // (heads_q // heads_kv), as SDPA. key and value go to fa2.attention as they
            are: the kernels read each query head's key/value head in place, with no expanded copy.
            Without it, heads_q and heads_kv must be equal (ValueError otherwise, as SDPA).
        backend: "pytorch", "triton", "numba-cuda" or None, as fa2.attention.

    Returns:
        O: query's shape, dtype and device (SDPA returns no logsumexp; fa2.attention does).

    Raises:
        NotImplementedError: a non-None ``attn_mask`` or a nonzero ``dropout_p``.
        ValueError: ``enable_gqa`` with inputs of rank < 3 or heads_q not a multiple of heads_kv; heads_q
            and heads_kv that differ without ``enable_gqa``; and everything fa2.attention raises.
    """
    if attn_mask is not None:
        raise NotImplementedError(
            f"fa2.scaled_dot_product_attention does not support attn_mask (got a {attn_mask.dtype} tensor of "
            f"shape {tuple(attn_mask.shape)}): fa2 computes full or causal attention only; pass attn_mask=None, "
            "with is_causal=True for a causal mask"
        )
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"fa2.scaled_dot_product_attention does not support dropout_p={dropout_p}: fa2 has no attention "
            "dropout; pass dropout_p=0.0"
        )
    _check_heads(query, key, value, enable_gqa)
    if is_causal:
        validate(query, key, value)
        return _top_left_causal(query, key, value, scale, backend)
    return attention(query, key, value, scale=scale, backend=backend).O


def _check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> None:
    """SDPA's rule for the heads (dim -3): equal, or with ``enable_gqa`` heads_q a multiple of heads_kv."""
    if enable_gqa:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() < 3:
                raise ValueError(
                    f"enable_gqa needs {name} of shape (..., heads, seqlen, head_dim), got {tuple(t.shape)}"
                )
        heads_q, heads_kv = query.shape[-3], key.shape[-3]
        if heads_kv == 0 or heads_q % heads_kv or value.shape[-3] != heads_kv:
            raise ValueError(
                "enable_gqa needs query heads a multiple of key heads and value heads equal to key heads, got "
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
    elif query.dim() > 2 and not query.shape[-3] == key.shape[-3] == value.shape[-3]:
        raise ValueError(
            "query, key and value must have the same heads (dim -3) unless enable_gqa=True, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )


def _top_left_causal(q, k, v, scale, backend) -> torch.Tensor:
    """SDPA's top-left causal mask through fa2's bottom-right one (see ``is_causal`` above)."""
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    if seqlen_q <= seqlen_k:
        return attention(q, k[..., :seqlen_q, :], v[..., :seqlen_q, :], causal=True, scale=scale, backend=backend).O
    top = attention(q[..., :seqlen_k, :], k, v, causal=True, scale=scale, backend=backend).O
    rest = attention(q[..., seqlen_k:, :], k, v, causal=False, scale=scale, backend=backend).O
    return torch.cat([top, rest], dim=-2)
