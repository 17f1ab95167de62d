"""The ``flash_attn`` package that flash-attn's tests/test_flash_attn.py imports, made of fa2.

``install(backend)`` puts modules into ``sys.modules`` under flash-attn's names:

- ``flash_attn``: fa2.flash_attn's seven functions (dense, varlen and KV-cache) with ``backend=`` bound;
- ``flash_attn.flash_attn_interface``: the same, plus ``_get_block_size_n``, which the test imports at
  module level but calls only in its dropout checks (deselected here): it raises;
- ``flash_attn.bert_padding``: ``pad_input`` and ``unpad_input`` (2.7+'s 5-tuple), written here in plain,
  differentiable torch indexing;
- ``flash_attn.layers.rotary``: ``apply_rotary_emb``, written here in plain torch (upstream: a Triton kernel),
  for the KV-cache test's reference.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F

from fa2 import flash_attn as fa2_flash_attn

FUNCTIONS = (
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
)


def install(backend: str) -> None:
    """flash-attn's module names, computed by fa2's ``backend``."""
    package = types.ModuleType("flash_attn")
    package.__path__ = []  # a package, so that "import flash_attn.bert_padding" resolves through sys.modules
    package.__version__ = "2.8.3"  # the API this stands in for
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for name in FUNCTIONS:
        func = functools.partial(getattr(fa2_flash_attn, name), backend=backend)
        setattr(package, name, func)
        setattr(interface, name, func)
    interface._get_block_size_n = _get_block_size_n

    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = pad_input, unpad_input
    layers = types.ModuleType("flash_attn.layers")
    layers.__path__ = []
    rotary = types.ModuleType("flash_attn.layers.rotary")
    rotary.apply_rotary_emb = apply_rotary_emb
    package.flash_attn_interface, package.bert_padding, package.layers = interface, padding, layers
    layers.rotary = rotary
    for module in (package, interface, padding, layers, rotary):
        sys.modules[module.__name__] = module


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    raise NotImplementedError(
        "_get_block_size_n describes flash-attn's CUDA kernel tiles for decoding its dropout mask (S_dmask); "
        "fa2 has no dropout, and the dropout cases are deselected"
    )


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(batch, seqlen, ...) and a (batch, seqlen) bool mask -> (the kept rows (total, ...), their flat
    indices (int64), cu_seqlens (batch + 1,) int32, max_seqlen (int), the used seqlens (batch,) int32).
    ``unused_mask``: rows kept in the output but not counted as used (flash-attn 2.7's fifth return)."""
    kept = attention_mask if unused_mask is None else attention_mask | unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu_seqlens, int(seqlens.max().item()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """(total, ...) rows at flat ``indices`` -> (batch, seqlen, ...), zeros elsewhere; differentiable."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """Rotary embedding of the first 2 · cos.shape[-1] channels of x (batch, seqlen, heads, head_dim), the
    rest passed through; cos, sin: (seqlen_ro, rotary_dim / 2); position of token t of batch b:
    t + seqlen_offsets (an int or a (batch,) tensor). interleaved: rotate pairs (0, 1), (2, 3), ... (GPT-J);
    otherwise the two halves (GPT-NeoX). Computed in fp32, returned in x's dtype (into x if inplace)."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb with cu_seqlens (varlen) is not in fa2's shim (issue #21)")
    batch, seqlen = x.shape[:2]
    rotary_dim = 2 * cos.shape[-1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1, 1)
    positions = (torch.arange(seqlen, device=x.device)[None, :] + offsets).expand(batch, seqlen)
    c = cos[positions].float()[:, :, None, :]  # [batch, seqlen, 1, rotary_dim / 2]
    s = sin[positions].float()[:, :, None, :]
    x_ro = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = x_ro[..., 0::2], x_ro[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x_ro.chunk(2, dim=-1)
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
