"""Each backend's forward and backward as ``torch.library`` custom ops, so that ``torch.compile`` sees one
opaque node per attention call instead of tracing into (or breaking on) a backend's Python.

A backend named ``name`` gets, on its first use (``load(name)``, or fa2.attention through ``forward_op``):

    fa2::<name>_fwd(q, k, v, alibi_slopes, scale, window_left, window_right, softcap,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink=None) -> (O, L)
    fa2::<name>_bwd(q, k, v, O, L, dO, <the same options>) -> (dq, dk, dv, dsink), only if it has
                    flash_attn_backward

(name with "-" as "_", e.g. fa2::numba_cuda_fwd) on (batch, heads, seqlen, head_dim) tensors of any strides:
an ``fa2.spec.AttentionSpec`` spelled out as the op schema's plain types, and rebuilt inside the op for the
backend. Fake implementations (O: q's shape and dtype, L: (batch, heads, seqlen_q) float32, dq, dk, dv: the
shapes and dtype of q, k, v; dsink: the sink's (heads,) float32, or (0,) without a sink, as a schema's
output cannot be None; all contiguous) and autograd through the backward op, the sink's gradient included.
A backend without a backward still gets autograd, which raises NotImplementedError on the backward pass. L
is not differentiable, as in the backends' FlashAttention2; neither are the ALiBi slopes.

A backend with a ``kvcache_forward`` also gets, on first use (``load_kvcache(name)``, or fa2.kvcache_attention
under torch.compile through ``kvcache_op``), a forward-only op:

    fa2::<name>_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                            num_splits, <the same options>) -> (O, L)

the KV-cache fields of the spec as optional tensors and an int, the caches contiguous (batch_cache, heads_k,
seqlen_cache, head_dim) or paged (num_pages, heads_k, page_size, head_dim), read and never written (the
append happens before, in fa2.kvcache). Its fake implementation is the forward's; the index tensors' values
are inputs, not constants, so a compiled decode step is traced once for every cache_seqlens. Its autograd
raises NotImplementedError on the backward pass, as fa2.kvcache_attention's eager path does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from fa2 import registry
from fa2.spec import AttentionSpec

NAMESPACE = "fa2"


class BackendOps(NamedTuple):
    """One backend's custom ops: ``forward`` (fa2::<name>_fwd) and ``backward`` (fa2::<name>_bwd, or None)."""

    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload | None


_LOADED: dict[str, BackendOps] = {}
_KVCACHE_LOADED: dict[str, torch._ops.OpOverload] = {}


def forward_op(backend: str | None, device: torch.device) -> torch._ops.OpOverload:
    """fa2::<name>_fwd of ``backend``, or of ``fa2.registry.default_backend(device)`` for None; errors as
    ``fa2.registry.load``. torch.compile traces through this without a graph break (see ``_forward_op_name``)."""
    return getattr(getattr(torch.ops, NAMESPACE), _forward_op_name(backend, device)).default


@torch.compiler.assume_constant_result
def _forward_op_name(backend: str | None, device: torch.device) -> str:
    """Looking backends up and registering their ops is Python that torch.compile cannot trace: marked
    constant, this runs once while tracing, and the graph holds the op named by the string it returns."""
    name = backend if backend is not None else registry.default_backend(device)
    load(name)
    return op_names(name)[0]


def kvcache_op(backend: str | None, device: torch.device) -> torch._ops.OpOverload:
    """fa2::<name>_kvcache_fwd of ``backend``, or of ``fa2.registry.default_backend(device)`` for None; errors as
    ``load_kvcache``. torch.compile traces through this without a graph break, as through ``forward_op``."""
    return _overload(_kvcache_op_name(backend, device))


@torch.compiler.assume_constant_result
def _kvcache_op_name(backend: str | None, device: torch.device) -> str:
    name = backend if backend is not None else registry.default_backend(device)
    load_kvcache(name)
    return kvcache_op_name(name)


def load_kvcache(name: str) -> torch._ops.OpOverload:
    """fa2::<name>_kvcache_fwd, registered on first use; errors as ``fa2.registry.load``, and
    NotImplementedError for a backend without a ``kvcache_forward``."""
    op = _KVCACHE_LOADED.get(name)
    if op is None:
        impl = registry.load(name)
        forward = getattr(impl, "kvcache_forward", None)
        if forward is None:
            raise NotImplementedError(f"fa2 backend {impl.NAME!r} has no KV-cache path (kvcache_forward)")
        op = _KVCACHE_LOADED[name] = _register_kvcache(name, forward)
    return op


def kvcache_op_name(name: str) -> str:
    """The KV-cache forward op's name of backend ``name``: "numba-cuda" -> "numba_cuda_kvcache_fwd"."""
    return f"{name.replace('-', '_')}_kvcache_fwd"


def call_kvcache(op: torch._ops.OpOverload, q, k_cache, v_cache, spec: AttentionSpec):
    """``op`` (a fa2::<name>_kvcache_fwd) on (B, H, N, D) q, the caches and a spec: kvcache_forward's signature."""
    return op(
        q,
        k_cache,
        v_cache,
        spec.cache_seqlens,
        spec.cache_leftpad,
        spec.cache_batch_idx,
        spec.block_table,
        spec.num_splits,
        *_options(spec),
    )


def load(name: str) -> BackendOps:
    """The custom ops of backend ``name``, registered on first use; errors as ``fa2.registry.load``."""
    ops = _LOADED.get(name)
    if ops is None:
        ops = _LOADED[name] = _register(name, registry.load(name))
    return ops


def op_names(name: str) -> tuple[str, str]:
    """The forward and backward op names of backend ``name`` in the fa2 namespace, identifiers:
    "numba-cuda" -> ("numba_cuda_fwd", "numba_cuda_bwd")."""
    ident = name.replace("-", "_")
    return f"{ident}_fwd", f"{ident}_bwd"


def call_forward(op: torch._ops.OpOverload, q, k, v, spec: AttentionSpec):
    """``op`` (a fa2::<name>_fwd) on (B, H, N, D) tensors and a spec: the layout's Forward signature."""
    return op(q, k, v, *_options(spec))


# What every op (fa2::<name>_fwd, _bwd, _kvcache_fwd) takes after its own tensors: an AttentionSpec spelled out
# in a schema's plain types, the sink last (it came last) and optional. _options and _spec convert to and from it.
_OPTIONS = (
    "Tensor? alibi_slopes",
    "float scale",
    "SymInt window_left",
    "SymInt window_right",
    "float softcap",
    "Tensor? cu_seqlens_q",
    "Tensor? cu_seqlens_k",
    "SymInt max_seqlen_q",
    "SymInt max_seqlen_k",
    "Tensor? sink=None",
)
# Which options are tensors: autograd saves those with save_for_backward, and keeps the others on its context.
_TENSOR_OPTIONS = tuple(option.startswith("Tensor") for option in _OPTIONS)


def _schema(tensors: str, returns: str) -> str:
    """An op's schema: its own arguments (e.g. "Tensor q, Tensor k, Tensor v"), then _OPTIONS, then returns."""
    return f"({tensors}, {', '.join(_OPTIONS)}) -> {returns}"


def _options(spec: AttentionSpec) -> tuple:
    return (
        spec.alibi_slopes,
        spec.scale,
        spec.window[0],
        spec.window[1],
        spec.softcap,
        spec.cu_seqlens_q,
        spec.cu_seqlens_k,
        spec.max_seqlen_q,
        spec.max_seqlen_k,
        spec.sink,
    )


def _spec(
    q,
    k,
    alibi_slopes,
    scale,
    window_left,
    window_right,
    softcap,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sink=None,
) -> AttentionSpec:
    """The AttentionSpec of ``_options``' values for q and k; the dispatcher leaves out a trailing sink=None."""
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1
    return AttentionSpec(
        scale,
        (window_left, window_right),
        softcap,
        alibi_slopes,
        group,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sink,
    )


def _overload(op_name: str) -> torch._ops.OpOverload:
    return getattr(getattr(torch.ops, NAMESPACE), op_name).default


def _register(name: str, impl) -> BackendOps:
    forward = impl.flash_attn_forward
    backward = getattr(impl, "flash_attn_backward", None)
    fwd_name, bwd_name = op_names(name)

    @torch.library.custom_op(
        f"{NAMESPACE}::{fwd_name}", mutates_args=(), schema=_schema("Tensor q, Tensor k, Tensor v", "(Tensor, Tensor)")
    )
    def fwd(q, k, v, *options):
        O, L = forward(q, k, v, _spec(q, k, *options))
        return O.contiguous(), L.contiguous()

    @fwd.register_fake
    def _(q, k, v, *options):
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        q, k, v, *options = inputs
        O, L = output
        ctx.mark_non_differentiable(L)
        ctx.save_for_backward(q, k, v, O, L, *(o if t else None for o, t in zip(options, _TENSOR_OPTIONS)))
        ctx.options = [None if t else o for o, t in zip(options, _TENSOR_OPTIONS)]

    if backward is None:

        def fwd_backward(ctx, dO, dL):
            raise NotImplementedError(f"fa2 backend {name!r} has no backward: it computes the forward only")

        fwd.register_autograd(fwd_backward, setup_context=setup_context)
        return BackendOps(_overload(fwd_name), None)

    @torch.library.custom_op(
        f"{NAMESPACE}::{bwd_name}",
        mutates_args=(),
        schema=_schema(
            "Tensor q, Tensor k, Tensor v, Tensor O, Tensor L, Tensor dO", "(Tensor, Tensor, Tensor, Tensor)"
        ),
    )
    def bwd(q, k, v, O, L, dO, *options):
        spec = _spec(q, k, *options)
        dq, dk, dv, *dsink = backward(q, k, v, O, L, dO, spec)
        dsink = dsink[0] if spec.sink is not None else q.new_empty((0,), dtype=torch.float32)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsink.contiguous()

    @bwd.register_fake
    def _(q, k, v, O, L, dO, *options):
        sink = _spec(q, k, *options).sink
        dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink

    def fwd_backward(ctx, dO, dL):
        q, k, v, O, L, *tensors = ctx.saved_tensors
        options = [saved if t else o for saved, o, t in zip(tensors, ctx.options, _TENSOR_OPTIONS)]
        dq, dk, dv, dsink = bwd(q, k, v, O, L, dO, *options)
        # no gradient for an option but the sink, the last
        return dq, dk, dv, *([None] * (len(options) - 1)), dsink if options[-1] is not None else None

    fwd.register_autograd(fwd_backward, setup_context=setup_context)
    return BackendOps(_overload(fwd_name), _overload(bwd_name))


def _register_kvcache(name: str, forward) -> torch._ops.OpOverload:
    op_name = kvcache_op_name(name)
    tensors = (
        "Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor cache_seqlens, Tensor? cache_leftpad, Tensor? cache_batch_idx, Tensor? block_table, SymInt num_splits"
    )

    @torch.library.custom_op(f"{NAMESPACE}::{op_name}", mutates_args=(), schema=_schema(tensors, "(Tensor, Tensor)"))
    def fwd(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, block_table, num_splits, *options):
        spec = dataclasses.replace(
            _spec(q, k_cache, *options),
            cache_seqlens=cache_seqlens,
            cache_leftpad=cache_leftpad,
            cache_batch_idx=cache_batch_idx,
            block_table=block_table,
            num_splits=num_splits,
        )
        O, L = forward(q, k_cache, v_cache, spec)
        return O.contiguous(), L.contiguous()

    @fwd.register_fake
    def _(q, k_cache, v_cache, *fields):
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])

    def fwd_backward(ctx, dO, dL):
        raise NotImplementedError("fa2 has no backward through a KV cache (inference only, as flash-attn's)")

    fwd.register_autograd(fwd_backward, setup_context=setup_context)
    return _overload(op_name)
