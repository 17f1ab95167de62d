"""``fa2.flash_attn``, flash-attn 2.8's API, for every backend: its signatures, layouts ((b, s, h, d) and the
packed (b, s, 3, h, d) / (b, s, 2, h_k, d)), return values, gradients (one tensor for a packed input), the
window normalisation flash-attn applies, window / softcap / ALiBi passed through to the kernels, bit-equal
repeated gradients, and the refusals (dropout; flash-attn's RuntimeErrors, here also ValueError/TypeError).

Every comparison is against the fp64 reference (fa2.reference through checks.py and test_gradients.py), on
(batch, heads, seqlen, head_dim) transposes of the results; flash-attn's own tests/test_flash_attn.py runs
against this module on the GPU (shared_tests/flash_attn_suite/).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, random_qkv
from fa2 import registry
from fa2.flash_attn import (
    FlashAttnTypeError,
    FlashAttnValueError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)
from test_conformance import DTYPES, require_runnable
from test_gradients import assert_grads_match

# flash-attn 2.8.3's signatures (flash_attn/flash_attn_interface.py), parameter by parameter.
_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FLASH_ATTN_SIGNATURES = {
    flash_attn_func: ["q", "k", "v"],
    flash_attn_qkvpacked_func: ["qkv"],
    flash_attn_kvpacked_func: ["q", "kv"],
}


@pytest.mark.parametrize("func", list(FLASH_ATTN_SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_are_flash_attns(func):
    """flash-attn's positional-or-keyword parameters in its order with its defaults, then fa2's
    keyword-only backend=None."""
    params = list(inspect.signature(func).parameters.values())
    want = [(name, inspect.Parameter.empty) for name in FLASH_ATTN_SIGNATURES[func]] + _OPTIONS
    got = [(p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert got == want
    assert [(p.name, p.default, p.kind) for p in params[len(want):]] == [
        ("backend", None, inspect.Parameter.KEYWORD_ONLY)
    ]


def test_exported_from_fa2():
    assert fa2.flash_attn.flash_attn_func is flash_attn_func
    assert issubclass(FlashAttnValueError, RuntimeError) and issubclass(FlashAttnValueError, ValueError)
    assert issubclass(FlashAttnTypeError, RuntimeError) and issubclass(FlashAttnTypeError, TypeError)


def _case(b, h, h_k, n_q, n_k, d, causal=False):
    name = f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else "") + f"-{n_q}x{n_k}-D{d}" + ("-causal" if causal else "")
    return pytest.param((b, h, h_k, n_q, n_k, d), causal, id=name)


# Chosen cases: MHA, GQA and MQA, seqlen_q != seqlen_k both ways (causal rows that see no key), head dims
# that are not multiples of 8 (zero-padded to one, as flash-attn pads them). Small enough for numba's simulator.
CASES = [
    _case(2, 3, 3, 17, 17, 32),
    _case(1, 4, 2, 19, 37, 16, causal=True),
    _case(1, 4, 1, 37, 19, 16, causal=True),
    _case(1, 2, 2, 23, 23, 59, causal=True),
    _case(1, 2, 1, 13, 29, 40),
]
VARIANTS = ["func", "kvpacked", "qkvpacked"]


def _bshd(b, h, h_k, n_q, n_k, d, dtype, device, seed):
    """q (b, n_q, h, d), k and v (b, n_k, h_k, d), contiguous in flash-attn's layout."""
    q, k, v = random_qkv((b, n_q, h, d), (b, n_k, h_k, d), dtype, device, seed=seed)
    return q, k, v


def _call(variant, q, k, v, backend, **options):
    """The variant's function on q, k, v (packed first where it packs): (out, lse, None), and the leaf
    tensors the gradients are taken for."""
    try:
        if variant == "func":
            leaves = (q, k, v)
            return flash_attn_func(q, k, v, return_attn_probs=True, backend=backend, **options), leaves
        if variant == "kvpacked":
            kv = torch.stack([k, v], dim=2).detach().requires_grad_(k.requires_grad)
            leaves = (q, kv)
            return flash_attn_kvpacked_func(q, kv, return_attn_probs=True, backend=backend, **options), leaves
        qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_(q.requires_grad)
        return flash_attn_qkvpacked_func(qkv, return_attn_probs=True, backend=backend, **options), (qkv,)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


def _skip_variant(variant, shape):
    b, h, h_k, n_q, n_k, d = shape
    if variant == "qkvpacked" and (h != h_k or n_q != n_k):
        pytest.skip("qkvpacked: one seqlen and one head count for q, k and v")


def _bhsd(*xs):
    return tuple(x.transpose(1, 2) for x in xs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape, causal", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(backend, status, device, dtype, shape, causal, variant):
    """out (b, s_q, h, d) in q's dtype, softmax_lse (b, h, s_q) float32, None for S_dmask, against the
    reference on the (b, h, s, d) transposes."""
    _skip_variant(variant, shape)
    b, h, h_k, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v = _bshd(*shape, dtype, device, seed=sum(shape))
    (out, lse, S_dmask), _ = _call(variant, q, k, v, backend, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, n_q) and lse.dtype == torch.float32
    assert S_dmask is None
    assert_matches_reference(*_bhsd(out), lse, *_bhsd(q, k, v), causal)
    plain = {"func": lambda: flash_attn_func(q, k, v, causal=causal, backend=backend),
             "kvpacked": lambda: flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=causal, backend=backend),
             "qkvpacked": lambda: flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=causal, backend=backend)}
    assert torch.equal(plain[variant](), out), "return_attn_probs=False must return the same out alone"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape, causal", CASES[:4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients(backend, status, device, dtype, shape, causal, variant):
    """Gradients to q, k, v, or to the packed tensor: one gradient shaped like the packed input, whose
    slices match the reference's dq, dk, dv."""
    _skip_variant(variant, shape)
    b, h, h_k, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v = (t.requires_grad_() for t in _bshd(*shape, dtype, device, seed=sum(shape) + 1))
    (out, _, _), leaves = _call(variant, q, k, v, backend, causal=causal)
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    try:
        grads = torch.autograd.grad(out, leaves, dO)
    except NotImplementedError as e:
        pytest.skip(f"{backend} has no backward: {e}")
    for g, x in zip(grads, leaves):
        assert g.shape == x.shape and g.dtype == x.dtype
    dq, dk, dv = grads if variant == "func" else (grads[0], *grads[1].unbind(2)) if variant == "kvpacked" else grads[0].unbind(2)
    assert_grads_match(*_bhsd(dq, dk, dv), *_bhsd(q.detach(), k.detach(), v.detach()), *_bhsd(dO), causal)


def test_inputs_reach_the_backend_as_views(backend, status, device, monkeypatch):
    """q, k, v go to the backend as (b, h, s, d) transposes of the caller's storage, packed inputs too:
    no copy on the way (the head dim here is a multiple of 8, so nothing is padded)."""
    require_runnable(backend, status, device, torch.float32, (1, 4, 9, 11, 16))
    impl = registry.load(backend)
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(), k.stride()))
        return real(q, k, v, *args, **kwargs)

    real = impl.flash_attn_forward
    monkeypatch.setattr(impl, "flash_attn_forward", spy)
    q, k, v = _bshd(1, 4, 2, 9, 11, 16, torch.float32, device, seed=3)
    kv = torch.stack([k, v], dim=2)
    flash_attn_func(q, k, v, backend=backend)
    flash_attn_kvpacked_func(q, kv, backend=backend)
    size = kv.element_size()
    assert seen == [
        (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.transpose(1, 2).stride(), k.transpose(1, 2).stride()),
        (q.data_ptr(), kv.data_ptr(), kv.data_ptr() + kv.stride(2) * size, q.transpose(1, 2).stride(),
         kv[:, :, 0].transpose(1, 2).stride()),
    ]


def _feature(name, shape, window=(-1, -1), causal=False, softcap=0.0, alibi=None, gain=1.0, ref_window=None):
    """ref_window: the window flash-attn's normalisation gives (sides >= seqlen_k -> -1, causal -> right 0),
    which the reference gets; default: ``window``, with right = 0 if causal."""
    if ref_window is None:
        ref_window = (window[0], 0) if causal else window
    return pytest.param(dict(shape=shape, window=window, causal=causal, softcap=softcap, alibi=alibi, gain=gain,
                             ref_window=ref_window), id=name)


FEATURES = [
    _feature("window-3.5", (1, 2, 2, 17, 29, 16), window=(3, 5)),
    _feature("causal-window-4.4-is-4.0", (1, 2, 2, 19, 19, 16), window=(4, 4), causal=True, ref_window=(4, 0)),
    # seqlen_q > seqlen_k: a right side >= seqlen_k becomes -1, which shows (rows 0.. see keys again).
    _feature("window-right-past-seqlen_k", (1, 2, 2, 37, 19, 16), window=(2, 25), ref_window=(2, -1)),
    _feature("window-left-past-seqlen_k-causal", (1, 2, 1, 21, 17, 16), window=(40, 3), causal=True,
             ref_window=(-1, 0)),
    _feature("softcap-5-x4", (1, 2, 2, 17, 29, 16), softcap=5.0, gain=4.0),
    _feature("alibi-heads", (1, 2, 2, 17, 29, 16), alibi="head"),
    _feature("alibi-batch-heads-causal-gqa", (2, 4, 2, 23, 19, 16), causal=True, alibi="batch"),
    _feature("all-together", (1, 4, 2, 33, 47, 16), window=(9, 9), causal=True, softcap=8.0, gain=3.0,
             alibi="batch", ref_window=(9, 0)),
]


def _feature_inputs(case, dtype, device, seed):
    b, h, h_k, n_q, n_k, d = case["shape"]
    q, k, v = _bshd(*case["shape"], dtype, device, seed=seed)
    q, k = q * case["gain"], k * case["gain"]
    slopes = None
    if case["alibi"] is not None:
        g = torch.Generator().manual_seed(seed)
        slopes = (torch.rand((h,) if case["alibi"] == "head" else (b, h), generator=g) * 0.3).to(device)
    return q, k, v, slopes


@pytest.mark.parametrize("case", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_features_pass_through(backend, status, device, dtype, case):
    """window_size, softcap and alibi_slopes reach fa2.attention, the window normalised as flash-attn does
    (and given as 0-d int64 tensors, as flash-attn's tests draw it with torch.randint)."""
    b, h, h_k, n_q, n_k, d = case["shape"]
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v, slopes = _feature_inputs(case, dtype, device, seed=sum(case["shape"]))
    window = tuple(torch.tensor(w) for w in case["window"])
    (out, lse, _), _ = _call("func", q, k, v, backend, causal=case["causal"], window_size=window,
                             softcap=case["softcap"], alibi_slopes=slopes)
    assert_matches_reference(*_bhsd(out), lse, *_bhsd(q, k, v), False, window=case["ref_window"],
                             softcap=case["softcap"], alibi_slopes=slopes)


@pytest.mark.parametrize("case", [FEATURES[1], FEATURES[7]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_gradients(backend, status, device, dtype, case):
    b, h, h_k, n_q, n_k, d = case["shape"]
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v, slopes = _feature_inputs(case, dtype, device, seed=sum(case["shape"]) + 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, _, _), leaves = _call("func", q, k, v, backend, causal=case["causal"], window_size=case["window"],
                                softcap=case["softcap"], alibi_slopes=slopes)
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    try:
        grads = torch.autograd.grad(out, leaves, dO)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    assert_grads_match(*_bhsd(*grads), *_bhsd(q.detach(), k.detach(), v.detach()), *_bhsd(dO), False,
                       window=case["ref_window"], softcap=case["softcap"], alibi_slopes=slopes)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_are_bit_identical_run_after_run(backend, status, device, dtype, deterministic):
    """flash-attn's test_flash_attn_deterministic: repeated autograd.grad(..., retain_graph=True) give the
    same bits. fa2's backwards are deterministic whatever the flag (no atomics)."""
    require_runnable(backend, status, device, dtype, (1, 4, 29, 37, 16))
    q, k, v = (t.requires_grad_() for t in _bshd(1, 4, 2, 29, 37, 16, dtype, device, seed=21))
    try:
        out = flash_attn_func(q, k, v, 0.0, causal=True, deterministic=deterministic, backend=backend)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    try:
        first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    except NotImplementedError as e:
        pytest.skip(f"{backend} has no backward: {e}")
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between two backward calls"


def test_head_dim_default_scale_is_unpadded(backend, status, device):
    """softmax_scale=None is head_dim ** -0.5 of the caller's head dim (59), also where the backend gets
    the zero-padded one (64)."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 9, 11, 59))
    q, k, v = _bshd(1, 2, 2, 9, 11, 59, torch.float32, device, seed=4)
    (out, lse, _), _ = _call("func", q, k, v, backend)
    assert out.shape == q.shape
    assert_matches_reference(*_bhsd(out), lse, *_bhsd(q, k, v), False, 59 ** -0.5)


def test_dropout_is_refused():
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        flash_attn_func(q, q, q, 0.1, backend="pytorch")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_qkvpacked_func(torch.randn(1, 5, 3, 2, 16), dropout_p=0.5, backend="pytorch")
    assert issubclass(NotImplementedError, RuntimeError)  # flash-attn's checks raise RuntimeError


def _bad(name, make, error, match):
    return pytest.param(make, error, match, id=name)


def _q(*s, dtype=torch.float16):
    return torch.randn(*s).to(dtype)


BAD_INPUTS = [
    _bad("heads-not-divisible", lambda: flash_attn_func(_q(1, 5, 6, 16), _q(1, 5, 4, 16), _q(1, 5, 4, 16)),
         FlashAttnValueError, "heads in key/value must divide"),
    _bad("head-dim-over-256", lambda: flash_attn_func(*[_q(1, 3, 1, 264)] * 3), FlashAttnValueError, "headdim"),
    _bad("rank-3", lambda: flash_attn_func(*[_q(5, 2, 16)] * 3), FlashAttnValueError, r"\(batch_size, seqlen"),
    _bad("batch-0", lambda: flash_attn_func(*[_q(0, 5, 2, 16)] * 3), FlashAttnValueError, "batch size"),
    _bad("k-v-shapes", lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16), _q(1, 6, 2, 16)),
         FlashAttnValueError, "k and v"),
    _bad("head-dims-differ", lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 32), _q(1, 5, 2, 32)),
         FlashAttnValueError, "headdim"),
    _bad("int-dtype", lambda: flash_attn_func(*[torch.ones(1, 5, 2, 16, dtype=torch.int32)] * 3),
         FlashAttnTypeError, "float16, bfloat16 or float32"),
    _bad("mixed-dtypes", lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16, dtype=torch.bfloat16),
                                                 _q(1, 5, 2, 16)), FlashAttnTypeError, "same dtype"),
    _bad("alibi-fp16", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=torch.ones(2).half()),
         FlashAttnTypeError, "float32"),
    _bad("alibi-shape", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=torch.ones(3)),
         FlashAttnValueError, r"\(2,\)"),
    _bad("alibi-list", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=[0.1, 0.2]),
         FlashAttnTypeError, "alibi_slopes"),
    _bad("dropout-with-softcap", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, 0.1, softcap=5.0),
         FlashAttnValueError, "softcap"),
    _bad("dropout-1", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, 1.0), FlashAttnValueError, r"\[0, 1\)"),
    _bad("window-float", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=(1.5, 0)),
         FlashAttnTypeError, "window_size left"),
    _bad("window-not-a-pair", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=3),
         FlashAttnTypeError, "window_size"),
    _bad("window-below-minus-1", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=(0, -2)),
         FlashAttnValueError, "window_size right"),
    _bad("softcap-negative", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, softcap=-1.0),
         FlashAttnValueError, "softcap"),
    _bad("causal-not-bool", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, causal=None),
         FlashAttnTypeError, "causal"),
    _bad("qkv-not-packed-by-3", lambda: flash_attn_qkvpacked_func(_q(1, 5, 2, 2, 16)), FlashAttnValueError,
         r"\(batch_size, seqlen, 3"),
    _bad("kv-rank-4", lambda: flash_attn_kvpacked_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16)), FlashAttnValueError,
         r"\(batch_size, seqlen_k, 2"),
]


@pytest.mark.parametrize("make, error, match", BAD_INPUTS)
def test_bad_inputs_raise_runtime_error(make, error, match):
    """Where flash-attn's C++ checks raise RuntimeError, so does this module, with a subclass that is
    also fa2's ValueError or TypeError."""
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, RuntimeError)


def test_alibi_on_another_device_is_refused():
    q = torch.randn(1, 5, 2, 16, device="meta")
    with pytest.raises(FlashAttnValueError, match="alibi_slopes must be on q's device"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(2), backend="pytorch")


def test_rows_that_see_no_key(backend, status, device):
    """Causal with seqlen_q > seqlen_k: the first rows get out = 0, softmax_lse = +inf, zero dq."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 21, 8, 16))
    q, k, v = (t.requires_grad_() for t in _bshd(1, 2, 2, 21, 8, 16, torch.float32, device, seed=8))
    (out, lse, _), _ = _call("func", q, k, v, backend, causal=True)
    assert (out[:, :13] == 0).all() and torch.isposinf(lse[:, :, :13]).all()
    try:
        (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    except NotImplementedError as e:
        pytest.skip(f"{backend} has no backward: {e}")
    assert (dq[:, :13] == 0).all() and not torch.isnan(dq).any()
    assert not math.isnan(lse[:, :, 13:].sum().item())
