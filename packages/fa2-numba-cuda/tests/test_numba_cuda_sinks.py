"""fa2-numba-cuda's attention sinks (issue 40, ``AttentionSpec.sink``) in its kernels, called directly: the SIMT
and tensor-core forwards (dense and packed), the backward with dsink, the KV-cache split kernels with and
without splits (the combine adding the sink), against ``fa2.reference`` in fp64 (the gradients, the sink's
included, from autograd of it). Under numba's simulator the tensor-core kernels run on ``mma.py``'s emulated
instructions: tiny shapes (D 16, at most 40 keys); with --device cuda the same cases run on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checks import assert_matches_reference, max_err, random_qkv
from fa2 import reference
from fa2.spec import AttentionSpec
from fa2_numba_cuda import backward, backward_simt, backward_tc, forward, kvcache, kvcache_tc
from test_gradients import FP32_GRAD_ATOL, assert_grads_match


def _sink(heads, device, seed=7):
    """Sinks around the scores' size, one large (a head that mostly attends to nothing)."""
    g = torch.Generator().manual_seed(seed)
    sink = torch.randn(heads, generator=g)
    sink[-1] = 4.0
    return sink.to(device)


# (kernel, dtype): the SIMT kernels compute in fp32, the tensor-core ones take fp16.
KERNELS = [
    pytest.param(False, torch.float32, id="simt-fp32"),
    pytest.param(True, torch.float16, id="tc-fp16"),
]


@pytest.mark.parametrize("tensor_cores, dtype", KERNELS)
@pytest.mark.parametrize(
    "shape, window, extra",
    [
        # GQA 4:2, seqlen_q > seqlen_k causal: the first rows see no key (O = 0, L = sink)
        pytest.param((1, 4, 2, 29, 17), (-1, 0), {}, id="H4-Hk2-29x17-causal"),
        # a window inside the keys, with a softcap and ALiBi before the sink joins
        pytest.param((2, 2, 2, 13, 31), (5, 3), {"softcap": 3.0, "alibi": True}, id="B2-13x31-w5.3-softcap-alibi"),
    ],
)
def test_forward_matches_reference(kernel_device, tensor_cores, dtype, shape, window, extra):
    b, h, h_k, n_q, n_k = shape
    q, k, v = random_qkv((b, h, n_q, 16), (b, h_k, n_k, 16), dtype, kernel_device, seed=n_q)
    sink = _sink(h, kernel_device)
    slopes = torch.rand(b, h, generator=torch.Generator().manual_seed(1)).to(kernel_device) if extra else None
    softcap = extra.get("softcap", 0.0)
    spec = AttentionSpec(0.25, window, softcap, slopes, h // h_k, sink=sink)
    O, L = forward.flash_attn_forward(q, k, v, spec, tensor_cores=tensor_cores)
    features = dict(window=window, softcap=softcap, alibi_slopes=slopes, sink=sink)
    assert_matches_reference(O, L, q, k, v, False, 0.25, **features)
    _, L_ref = reference.attention(q, k, v, False, 0.25, **features)
    empty = L_ref == sink[:, None].double()
    if window == (-1, 0):
        assert empty.any(), "the case must have rows that see no key"
    assert (O[empty] == 0).all(), "rows that see no key: O = 0"


@pytest.mark.parametrize("tensor_cores, dtype", KERNELS)
def test_varlen_forward_matches_reference(kernel_device, tensor_cores, dtype):
    """Each sequence's rows get the sink of their head; causal with a sequence whose first rows see no key."""
    lens_q, lens_k = [9, 14], [5, 20]
    cu_q = torch.tensor([0, 9, 23], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 5, 25], dtype=torch.int32, device=kernel_device)
    q, k, v = random_qkv((1, 2, sum(lens_q), 16), (1, 1, sum(lens_k), 16), dtype, kernel_device, seed=3)
    sink = _sink(2, kernel_device)
    spec = AttentionSpec(
        0.25, (-1, 0), group=2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=14, max_seqlen_k=20, sink=sink
    )
    O, L = forward.flash_attn_forward(q, k, v, spec, tensor_cores=tensor_cores)
    tq, tk = (t[0].transpose(0, 1) for t in (q, k))  # (total, heads, d)
    tv = v[0].transpose(0, 1)
    O_ref, L_ref = reference.varlen_attention(tq, tk, tv, cu_q, cu_k, True, 0.25, sink=sink)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    assert max_err(O[0].transpose(0, 1), O_ref) <= tol
    assert max_err(L[0], L_ref) <= 2e-5


def _backward_case(dtype, device, shape):
    b, h, h_k, n_q, n_k = shape
    q, k, v = random_qkv((b, h, n_q, 16), (b, h_k, n_k, 16), dtype, device, seed=n_q + n_k)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    return q, k, v, dO, _sink(h, device)


def _reference_grads(q, k, v, dO, sink, **features):
    """fp64 autograd of the reference: (dq, dk, dv, dsink)."""
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sink))
    O64 = reference.attention(q64, k64, v64, sink=s64, **features)[0]
    return torch.autograd.grad(O64, (q64, k64, v64, s64), dO.double())


def _dsink_tolerance(q, k, v, dO, sink, ref, **features):
    """fp32: FP32_GRAD_ATOL times the rows a head sums over; fp16: three times a naive fp16 attention's error
    plus twice rounding the reference to fp16 (test_gradients' rule)."""
    if q.dtype == torch.float32:
        return FP32_GRAD_ATOL * q.shape[0] * q.shape[2]
    ql, kl, vl, sl = (t.detach().requires_grad_() for t in (q, k, v, sink))
    O_naive = reference.attention(ql, kl, vl, sink=sl, upcast=False, **features)[0]
    (naive,) = torch.autograd.grad(O_naive, (sl,), dO)
    return 3 * max_err(naive, ref) + 2 * max_err(ref.half(), ref)


@pytest.mark.parametrize(
    "tensor_cores, dtype, scores",
    [
        *(pytest.param(*p.values, {}, id=p.id) for p in KERNELS),
        # the tensor-core kernels asked for a softcap and ALiBi (SOFTCAP, ALIBI beside SINK in the dQ kernel)
        pytest.param(True, torch.float16, {"softcap": 3.0, "alibi": True}, id="tc-fp16-softcap-alibi"),
    ],
)
def test_backward_matches_reference(kernel_device, tensor_cores, dtype, scores):
    """dq, dk, dv from the kernels without a sink (L carries it), dsink from delta; GQA, causal with rows that
    see no key."""
    q, k, v, dO, sink = _backward_case(dtype, kernel_device, (2, 2, 1, 21, 15))
    slopes = torch.rand(2, 2, generator=torch.Generator().manual_seed(1)).to(kernel_device) if scores else None
    softcap = scores.get("softcap", 0.0)
    features = dict(causal=True, scale=0.25, softcap=softcap, alibi_slopes=slopes)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), sink=sink, **features)
    spec = AttentionSpec(0.25, (-1, 0), softcap, slopes, group=2, sink=sink)
    grads = backward.flash_attn_backward(q, k, v, O64.to(dtype), L64.float(), dO, spec, tensor_cores=tensor_cores)
    assert len(grads) == 4, "with a sink the backward returns (dq, dk, dv, dsink)"
    dq, dk, dv, dsink = grads
    assert_grads_match(dq, dk, dv, q, k, v, dO, True, scale=0.25, softcap=softcap, alibi_slopes=slopes, sink=sink)
    ref = _reference_grads(q, k, v, dO, sink, **features)[3]
    assert dsink.shape == sink.shape and dsink.dtype == torch.float32
    tol = _dsink_tolerance(q, k, v, dO, sink, ref, **features)
    assert max_err(dsink, ref) <= tol, f"max |dsink - ref| = {max_err(dsink, ref):.3g} > {tol:.3g}"
    # Without a sink the same call returns three gradients, as before.
    plain = dataclasses.replace(spec, sink=None)
    without = backward.flash_attn_backward(q, k, v, O64.to(dtype), L64.float(), dO, plain, tensor_cores=tensor_cores)
    assert len(without) == 3


def test_varlen_backward_sums_dsink_over_sequences(kernel_device):
    """A packed batch (the SIMT kernels): dsink sums every sequence's rows of each head; the preprocess takes
    the 34 packed rows as one sequence, two blocks, the second sequence in both."""
    cu = torch.tensor([0, 7, 34], dtype=torch.int32, device=kernel_device)
    q, k, v = random_qkv((1, 2, 34, 16), (1, 2, 34, 16), torch.float32, kernel_device, seed=11)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(kernel_device)
    sink = _sink(2, kernel_device)
    spec = AttentionSpec(0.25, (-1, 0), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=27, max_seqlen_k=27, sink=sink)
    tq, tk, tv, tdO = (t[0].transpose(0, 1).detach().double().requires_grad_() for t in (q, k, v, dO))
    s64 = sink.double().requires_grad_()
    O_ref, L_ref = reference.varlen_attention(tq, tk, tv, cu, cu, True, 0.25, sink=s64)
    ref = torch.autograd.grad(O_ref, (tq, tk, tv, s64), tdO.detach())
    O = O_ref.detach().float().transpose(0, 1)[None]
    dq, dk, dv, dsink = backward.flash_attn_backward(q, k, v, O, L_ref.detach().float()[None], dO, spec)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[:3]):
        assert max_err(g[0].transpose(0, 1), r) <= FP32_GRAD_ATOL, name
    assert max_err(dsink, ref[3]) <= FP32_GRAD_ATOL * 34


def test_tensor_core_varlen_backward_sums_dsink_over_sequences(kernel_device, monkeypatch):
    """A packed batch on the tensor-core kernels (asked for): the dQ kernel's grid is (query tile of
    max_seqlen_q, sequence·head), one share a warp; a tile past its sequence's end exits and writes zero shares
    (the parts start as NaN: an unwritten share would make dsink NaN). 16-row tiles of one warp: sequences of
    7, 27 and 0 queries make two tiles each, three of the six past their sequence. GQA 2:1, causal, fp16; dq, dk,
    dv and dsink against autograd of ``reference.varlen_attention``."""
    lens_q, lens_k = [7, 27, 0], [12, 20, 5]
    cu_q = torch.tensor([0, 7, 34, 34], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 12, 32, 37], dtype=torch.int32, device=kernel_device)
    q, k, v = random_qkv((1, 2, sum(lens_q), 16), (1, 1, sum(lens_k), 16), torch.float16, kernel_device, seed=12)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(device=kernel_device, dtype=q.dtype)
    sink = _sink(2, kernel_device)
    spec = AttentionSpec(
        0.25, (-1, 0), group=2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=27, max_seqlen_k=20, sink=sink
    )

    def packed(x):  # the kernels' (1, heads, total, ...) as the reference's (total, heads, ...)
        return x[0].transpose(0, 1)

    def reference_grads(upcast):
        x = [t.detach().double() if upcast else t.detach() for t in (packed(q), packed(k), packed(v), sink)]
        x = [t.requires_grad_() for t in x]
        O, L = reference.varlen_attention(*x[:3], cu_q, cu_k, True, 0.25, sink=x[3], upcast=upcast)
        return O.detach(), L.detach(), torch.autograd.grad(O, x, packed(dO).double() if upcast else packed(dO))

    O64, L64, ref = reference_grads(True)
    shares = []
    real_gradient = backward_tc.sink_gradient
    monkeypatch.setattr(
        backward_tc, "sink_gradient", lambda spec, parts: shares.append(parts) or real_gradient(spec, parts)
    )
    config = backward_tc.TensorCoreBwdConfig(1, 16, 1, 16, 0)
    O, L = O64.half().transpose(0, 1)[None], L64.float()[None]
    dq, dk, dv, dsink = backward.flash_attn_backward(q, k, v, O, L, dO, spec, config=config, tensor_cores=True)
    assert any(key[0] == "dq" and key[7] and key[-1] for key in backward_tc._KERNELS), (
        "no dQ kernel with VARLEN and SINK"
    )
    (parts,) = shares
    assert parts.shape == (2, 3 * 2), "one share per (sequence, tile of max_seqlen_q) and head"
    assert (parts.view(2, 3, 2)[:, [0, 2, 2], [1, 0, 1]] == 0).all(), "tiles past their sequence: zero shares"
    naive = reference_grads(False)[2]
    for name, g, r, n in zip(("dq", "dk", "dv", "dsink"), (packed(dq), packed(dk), packed(dv), dsink), ref, naive):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        tol = 3 * max_err(n, r) + 2 * max_err(r.half(), r)
        assert max_err(g, r) <= tol, f"max |{name} - ref| = {max_err(g, r):.3g} > {tol:.3g}"


def test_preprocess_writes_each_blocks_share(kernel_device):
    """The preprocess with SINK alone: 70 rows a (batch, head) are three blocks (32, 32, 6 rows), each block's
    share -Σ exp(sink[h] - L) · delta at [h, b · 3 + tile]; O, dO and L strided, rows with L = +inf (weight
    0), head_dim 24 (padded to 32); delta, the shares and dsink against fp64 sums of the same O, dO, L."""
    b, h, n, d = 2, 3, 70, 24
    g = torch.Generator().manual_seed(4)
    O, dO = (torch.randn(b, n, h, d, generator=g).to(kernel_device).transpose(1, 2) for _ in "od")
    L = (torch.randn(b, n, h, generator=g) + 2).to(kernel_device).transpose(1, 2)
    L[0, 1, 5] = L[1, 2, 69] = float("inf")
    spec = AttentionSpec(0.25, (-1, 0), sink=_sink(h, kernel_device))
    delta = torch.empty(b * h * n, dtype=torch.float32, device=kernel_device)
    parts = backward_simt.dsink_parts(spec, O)
    backward_simt.launch_preprocess(O, dO, L, delta, parts, spec)
    delta_ref = (O.double() * dO.double()).sum(-1)
    rows_ref = -torch.exp(spec.sink.double()[:, None] - L.double()) * delta_ref  # (b, h, n)
    shares_ref = torch.nn.functional.pad(rows_ref, (0, 96 - n)).view(b, h, 3, 32).sum(-1)
    assert max_err(delta.view(b, h, n), delta_ref) <= 1e-5
    assert parts.shape == (h, b * 3)
    # fp32 sums, as _dsink_tolerance's: FP32_GRAD_ATOL times the rows summed.
    assert max_err(parts, shares_ref.permute(1, 0, 2).reshape(h, b * 3)) <= FP32_GRAD_ATOL * 32
    (dsink,) = backward_simt.sink_gradient(spec, parts)
    assert max_err(dsink, rows_ref.sum(dim=(0, 2))) <= FP32_GRAD_ATOL * b * n


def test_tensor_core_dq_kernel_writes_each_warps_share(kernel_device, monkeypatch):
    """The tensor-core backward: the preprocess runs without the sink's shares, and the dQ kernel's warps write
    them, one per warp of 16 rows at [h, (b · tiles + tile) · warps + w]: 37 rows in tiles of 32 (two warps),
    the last tile's second warp past seqlen_q (its share 0); against fp64 sums of the same O, dO and L."""
    b, h, n, d = 2, 3, 37, 16
    q, k, v = random_qkv((b, h, n, d), (b, h, n, d), torch.float16, kernel_device, seed=9)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(device=kernel_device, dtype=q.dtype)
    sink = _sink(h, kernel_device)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), sink=sink, scale=0.25)
    O, L = O64.half(), L64.float()
    spec = AttentionSpec(0.25, (-1, -1), sink=sink)
    preprocess_parts, shares = [], []
    real_preprocess, real_gradient = backward_tc.launch_preprocess, backward_tc.sink_gradient
    monkeypatch.setattr(
        backward_tc,
        "launch_preprocess",
        lambda O, dO, L, delta, parts, spec: (
            preprocess_parts.append(parts) or real_preprocess(O, dO, L, delta, parts, spec)
        ),
    )
    monkeypatch.setattr(
        backward_tc, "sink_gradient", lambda spec, parts: shares.append(parts) or real_gradient(spec, parts)
    )
    config = backward_tc.TensorCoreBwdConfig(1, 16, 2, 16, 0)
    (dsink,) = backward.flash_attn_backward(q, k, v, O, L, dO, spec, config=config, tensor_cores=True)[3:]
    assert preprocess_parts == [None], "the tensor-core backward's preprocess took the sink's shares"
    rows_ref = -torch.exp(sink.double()[:, None] - L.double()) * (O.double() * dO.double()).sum(-1)  # (b, h, n)
    shares_ref = torch.nn.functional.pad(rows_ref, (0, 64 - n)).view(b, h, 4, 16).sum(-1)  # two tiles of two warps
    (parts,) = shares
    assert parts.shape == (h, b * 4)
    assert max_err(parts, shares_ref.permute(1, 0, 2).reshape(h, b * 4)) <= FP32_GRAD_ATOL * 16
    assert (parts.view(h, b, 4)[:, :, 3] == 0).all(), "a warp past seqlen_q wrote a share"
    assert max_err(dsink, rows_ref.sum(dim=(0, 2))) <= FP32_GRAD_ATOL * b * n


KV_KERNELS = [
    pytest.param(False, torch.float32, False, id="simt-fp32-contiguous"),
    pytest.param(True, torch.float16, True, id="tc-fp16-paged"),
]


@pytest.mark.parametrize("splits", [1, 3], ids=["unsplit", "split3"])
@pytest.mark.parametrize("tensor_cores, dtype, paged", KV_KERNELS)
def test_kvcache_forward_matches_reference(kernel_device, tensor_cores, dtype, paged, splits):
    """The split kernel adds the sink without splits, the combine with them; a row with an empty cache (O = 0,
    L = sink) and causal rows that see no key (K_b < seqlen_q)."""
    g = torch.Generator().manual_seed(splits)
    b, h, h_k, n_q, cap, page = 3, 4, 2, 3, 40, 8
    q = torch.randn(b, h, n_q, 16, generator=g).to(kernel_device, dtype)
    if paged:
        pages = b * cap // page
        k_cache, v_cache = (torch.randn(pages, h_k, page, 16, generator=g).to(kernel_device, dtype) for _ in "kv")
        block_table = torch.randperm(pages, generator=g).view(b, cap // page).to(kernel_device, torch.int32)
    else:
        k_cache, v_cache = (torch.randn(b, h_k, cap, 16, generator=g).to(kernel_device, dtype) for _ in "kv")
        block_table = None
    spec = AttentionSpec(
        0.25,
        (-1, 0),
        group=h // h_k,
        sink=_sink(h, kernel_device),
        cache_seqlens=torch.tensor([37, 0, 2], dtype=torch.int32, device=kernel_device),
        block_table=block_table,
        num_splits=splits,
    )
    # One-warp tensor-core blocks: 16-key tiles, so that the 40 slots make three splits (two 32-key SIMT tiles).
    config = kvcache_tc.TensorCoreDecodeConfig(1, 128) if tensor_cores else None
    O, L = kvcache.kvcache_forward(q, k_cache, v_cache, spec, config, tensor_cores=tensor_cores)
    O_ref, L_ref = reference.kvcache_attention(q, k_cache, v_cache, spec)
    assert not torch.isnan(O).any() and not torch.isnan(L).any()
    sink_rows = L_ref == spec.sink[:, None].double()
    assert sink_rows[1].all() and sink_rows[2, :, 0].all(), "rows that see no key: L = sink"
    assert (O[1] == 0).all() and (O[2, :, 0] == 0).all(), "rows that see no key: O = 0"
    if dtype == torch.float32:
        tol_O = 5e-5
    else:
        O_naive, _ = reference.kvcache_attention(q, k_cache, v_cache, spec, upcast=False)
        tol_O = 2 * max_err(O_naive, O_ref) + 2 * max_err(O_ref.to(dtype), O_ref) + 1e-3
    assert max_err(O, O_ref) <= tol_O
    assert max_err(L, L_ref) <= 5e-5
