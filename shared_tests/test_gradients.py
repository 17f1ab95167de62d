"""Gradients through fa2.attention and FlashAttention2.apply, for every backend that has a backward.

fp32 against fp64 autograd of the reference within a fixed tolerance; fp16 and bf16 within 3× the error
of a naive attention differentiated in the same precision (FlashAttention-2's backward test rule), plus
twice the error of rounding the fp64 gradient to that dtype. A backend without a backward is skipped
with its own NotImplementedError message.
"""

from __future__ import annotations

import pytest
import torch

import fa2
from checks import max_err, random_qkv
from fa2 import reference, registry
from test_conformance import CAUSAL, DTYPES, _gqa, require_runnable

FP32_GRAD_ATOL = 1e-4

GRAD_SHAPES = [
    pytest.param((2, 3, 17, 17, 32), id="B2-H3-17x17-D32"),
    pytest.param((1, 1, 19, 37, 16), id="B1-H1-19x37-D16"),
    pytest.param((1, 1, 37, 19, 16), id="B1-H1-37x19-D16"),
    pytest.param((1, 2, 113, 203, 64), id="B1-H2-113x203-D64"),
    pytest.param((1, 2, 203, 113, 128), id="B1-H2-203x113-D128"),
    pytest.param((1, 2, 1023, 1024, 64), id="B1-H2-1023x1024-D64"),
]


def grads(O, inputs, dO):
    try:
        return torch.autograd.grad(O, inputs, dO)
    except NotImplementedError as e:
        assert "backward" in str(e), f"a missing backward must say so, got: {e}"
        pytest.skip(str(e))


def grad_tolerances(q, k, v, dO, causal, **features):
    """(the fp64 reference's dq, dk, dv; the tolerance of each): fp32 a fixed bound, fp16/bf16 three times
    a same-precision naive attention's error plus twice the reference's rounding to the dtype."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    O64 = reference.attention(q64, k64, v64, causal, **features)[0]
    ref = torch.autograd.grad(O64, (q64, k64, v64), dO.double())
    if q.dtype == torch.float32:
        return ref, [FP32_GRAD_ATOL] * 3
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    O_naive = reference.attention(ql, kl, vl, causal, upcast=False, **features)[0]
    naive = torch.autograd.grad(O_naive, (ql, kl, vl), dO)
    return ref, [3 * max_err(n, r) + 2 * max_err(r.to(q.dtype), r) for n, r in zip(naive, ref)]


def assert_grads_match(dq, dk, dv, q, k, v, dO, causal, **features):
    """``features``: window, softcap, alibi_slopes, as fa2.reference.attention takes them."""
    ref, tols = grad_tolerances(q, k, v, dO, causal, **features)
    for name, g, r, tol, x in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, tols, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
        assert not torch.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g} ({q.dtype})"


@pytest.mark.parametrize("shape", GRAD_SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_reference(backend, status, device, dtype, causal, shape):
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, shape)
    q, k, v = (t.requires_grad_() for t in random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q))
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    O, _ = fa2.attention(q, k, v, causal=causal, backend=backend)
    assert_grads_match(*grads(O, (q, k, v), dO), q, k, v, dO, causal)


@pytest.mark.parametrize(
    "heads, shape", [_gqa(4, 2, 1, 17, 29, 16), _gqa(3, 1, 1, 37, 19, 16), _gqa(16, 2, 1, 203, 113, 64)]
)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_query_gradients(backend, status, device, dtype, causal, heads, shape):
    """dk and dv of a key/value head: the sum over the query heads of its group."""
    (h, h_k), (b, n_q, n_k, d) = heads, shape
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v = (t.requires_grad_() for t in random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=h))
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    O, _ = fa2.attention(q, k, v, causal=causal, backend=backend)
    assert_grads_match(*grads(O, (q, k, v), dO), q, k, v, dO, causal)


def test_autograd_apply_fills_grads(backend, status, device):
    """CS336: FlashAttention2.apply(q, k, v, is_causal).backward(dO) fills q.grad, k.grad, v.grad."""
    require_runnable(backend, status, device, torch.float32, (3, 1, 17, 29, 32))
    q, k, v = (t.requires_grad_() for t in random_qkv((3, 17, 32), (3, 29, 32), torch.float32, device))
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device)
    O = registry.load(backend).FlashAttention2.apply(q, k, v, True)
    try:
        O.backward(dO)
    except NotImplementedError as e:
        assert "backward" in str(e), f"a missing backward must say so, got: {e}"
        pytest.skip(str(e))
    assert_grads_match(q.grad, k.grad, v.grad, q, k, v, dO, True)


def test_strided_gradients(backend, status, device):
    """Transposed (B, N, H, D) views in, gradients in the same (non-contiguous-view) shapes out."""
    require_runnable(backend, status, device, torch.float32, (2, 3, 33, 41, 16))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 3, 16, generator=g).to(device).transpose(1, 2).requires_grad_() for n in (33, 41, 41))
    dO = torch.randn(2, 3, 33, 16, generator=g).to(device)
    O, _ = fa2.attention(q, k, v, causal=True, backend=backend)
    assert_grads_match(*grads(O, (q, k, v), dO), q, k, v, dO, True)


def test_rows_that_see_no_key_get_zero_gradient(backend, status, device):
    require_runnable(backend, status, device, torch.float32, (1, 2, 37, 19, 16))
    q, k, v = (t.requires_grad_() for t in random_qkv((1, 2, 37, 16), (1, 2, 19, 16), torch.float32, device))
    O, _ = fa2.attention(q, k, v, causal=True, backend=backend)
    dq, dk, dv = grads(O, (q, k, v), torch.ones_like(O))
    assert (dq[:, :, :18] == 0).all() and not any(torch.isnan(t).any() for t in (dq, dk, dv))
