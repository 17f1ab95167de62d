"""``fa2.flash_attn``, flash-attn 2.8's API, for every backend: its signatures, layouts ((b, s, h, d) and the
packed (b, s, 3, h, d) / (b, s, 2, h_k, d)), return values, gradients (one tensor for a packed input), the
window normalisation flash-attn applies, window / softcap / ALiBi passed through to the kernels, bit-equal
repeated gradients, and the refusals (dropout; flash-attn's RuntimeErrors, here also ValueError/TypeError).
The varlen functions the same way, on sequences packed as (total, h, d) (and (total, 3, h, d) /
(total_k, 2, h_k, d)) with int32 offsets, against a loop of the reference over the sequences; a backend
without varlen kernels (its NotImplementedError) skips them with its message.

Every comparison is against the fp64 reference (fa2.reference through checks.py and test_gradients.py), on
(batch, heads, seqlen, head_dim) transposes of the results; flash-attn's own tests/test_flash_attn.py runs
against this module on the GPU (shared_tests/flash_attn_suite/).
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, max_err, offsets, random_qkv
from fa2 import reference, registry
from fa2.flash_attn import (
    FlashAttnTypeError,
    FlashAttnValueError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from test_conformance import DTYPES, require_runnable, simulated_subset
from test_gradients import FP32_GRAD_ATOL, assert_grads_match

# flash-attn 2.8.3's signatures (flash_attn/flash_attn_interface.py), parameter by parameter.
_OPTIONS = [
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
]
_VARLEN = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
FLASH_ATTN_SIGNATURES = {
    flash_attn_func: (["q", "k", "v"], []),
    flash_attn_qkvpacked_func: (["qkv"], []),
    flash_attn_kvpacked_func: (["q", "kv"], []),
    flash_attn_varlen_func: (["q", "k", "v", *_VARLEN], [("block_table", None)]),
    flash_attn_varlen_qkvpacked_func: (["qkv", "cu_seqlens", "max_seqlen"], []),
    flash_attn_varlen_kvpacked_func: (["q", "kv", *_VARLEN], []),
}


@pytest.mark.parametrize("func", list(FLASH_ATTN_SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_are_flash_attns(func):
    """flash-attn's positional-or-keyword parameters in its order with its defaults, then flash-attn 4's
    learnable_sink=None and fa2's backend=None, keyword-only."""
    params = list(inspect.signature(func).parameters.values())
    inputs, extra = FLASH_ATTN_SIGNATURES[func]
    want = [(name, inspect.Parameter.empty) for name in inputs] + _OPTIONS + extra
    got = [(p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert got == want
    assert [(p.name, p.default, p.kind) for p in params[len(want) :]] == [
        ("learnable_sink", None, inspect.Parameter.KEYWORD_ONLY),
        ("backend", None, inspect.Parameter.KEYWORD_ONLY),
    ]


def test_kvcache_signature_is_flash_attns():
    """flash_attn_with_kvcache's parameters in flash-attn 2.8.3's order with its defaults (rotary
    interleaved by default), then the keyword-only learnable_sink=None and backend=None."""
    params = list(inspect.signature(flash_attn_with_kvcache).parameters.values())
    want = [
        ("q", inspect.Parameter.empty),
        ("k_cache", inspect.Parameter.empty),
        ("v_cache", inspect.Parameter.empty),
        ("k", None),
        ("v", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("block_table", None),
        ("softmax_scale", None),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("softcap", 0.0),
        ("rotary_interleaved", True),
        ("alibi_slopes", None),
        ("num_splits", 0),
        ("return_softmax_lse", False),
    ]
    assert [(p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == want
    assert [(p.name, p.default, p.kind) for p in params[len(want) :]] == [
        ("learnable_sink", None, inspect.Parameter.KEYWORD_ONLY),
        ("backend", None, inspect.Parameter.KEYWORD_ONLY),
    ]


def test_exported_from_fa2():
    assert fa2.flash_attn.flash_attn_func is flash_attn_func
    assert fa2.flash_attn.flash_attn_varlen_func is flash_attn_varlen_func
    assert {f.__name__ for f in FLASH_ATTN_SIGNATURES} | {"flash_attn_with_kvcache"} <= set(fa2.flash_attn.__all__)
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
# kvpacked and qkvpacked stack their inputs and call func's kernels on the views (strided inputs, which
# test_gradients.py's test_strided_gradients covers in each kernel path): numba's simulator runs kvpacked on
# one GQA case and qkvpacked on one multi-head case.
KVPACKED_SIMULATED = "B1-H4-Hk2-19x37-D16-causal"
QKVPACKED_SIMULATED = "B2-H3-17x17-D32"


def _simulated_api_dtype(backend, status, dtype):
    """The simulator runs the API's tests of outputs and gradients in fp32 alone: what they check is the
    interface (packing, the options' translation, the shapes and slices of what it returns), and the
    conformance files (test_conformance.py, test_gradients.py, test_features.py, test_varlen.py) run numba's
    kernels in both dtypes; fp16 on the tensor cores' emulation takes ~2x fp32's time there."""
    simulated_subset(backend, status, dtype == torch.float32, "the flash-attn API's outputs and gradients in fp32 only")


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


def _simulated_packed(backend, status, variant, shape, causal):
    case = _case(*shape, causal=causal).id
    keep = {"func": True, "kvpacked": case == KVPACKED_SIMULATED, "qkvpacked": case == QKVPACKED_SIMULATED}[variant]
    simulated_subset(
        backend, status, keep, f"kvpacked on {KVPACKED_SIMULATED} and qkvpacked on {QKVPACKED_SIMULATED} only"
    )


def _bhsd(*xs):
    return tuple(x.transpose(1, 2) for x in xs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape, causal", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(backend, status, device, dtype, shape, causal, variant):
    """out (b, s_q, h, d) in q's dtype, softmax_lse (b, h, s_q) float32, None for S_dmask, against the
    reference on the (b, h, s, d) transposes."""
    _skip_variant(variant, shape)
    _simulated_packed(backend, status, variant, shape, causal)
    _simulated_api_dtype(backend, status, dtype)
    b, h, h_k, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v = _bshd(*shape, dtype, device, seed=sum(shape))
    (out, lse, S_dmask), _ = _call(variant, q, k, v, backend, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, n_q) and lse.dtype == torch.float32
    assert S_dmask is None
    assert_matches_reference(*_bhsd(out), lse, *_bhsd(q, k, v), causal)
    plain = {
        "func": lambda: flash_attn_func(q, k, v, causal=causal, backend=backend),
        "kvpacked": lambda: flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=causal, backend=backend),
        "qkvpacked": lambda: flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=causal, backend=backend),
    }
    assert torch.equal(plain[variant](), out), "return_attn_probs=False must return the same out alone"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape, causal", CASES[:4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients(backend, status, device, dtype, shape, causal, variant):
    """Gradients to q, k, v, or to the packed tensor: one gradient shaped like the packed input, whose
    slices match the reference's dq, dk, dv."""
    _skip_variant(variant, shape)
    _simulated_packed(backend, status, variant, shape, causal)
    _simulated_api_dtype(backend, status, dtype)
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
    dq, dk, dv = (
        grads if variant == "func" else (grads[0], *grads[1].unbind(2)) if variant == "kvpacked" else grads[0].unbind(2)
    )
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
        (
            q.data_ptr(),
            kv.data_ptr(),
            kv.data_ptr() + kv.stride(2) * size,
            q.transpose(1, 2).stride(),
            kv[:, :, 0].transpose(1, 2).stride(),
        ),
    ]


def _feature(name, shape, window=(-1, -1), causal=False, softcap=0.0, alibi=None, gain=1.0, ref_window=None):
    """ref_window: the window flash-attn's normalisation gives (sides >= seqlen_k -> -1, causal -> right 0),
    which the reference gets; default: ``window``, with right = 0 if causal."""
    if ref_window is None:
        ref_window = (window[0], 0) if causal else window
    return pytest.param(
        dict(shape=shape, window=window, causal=causal, softcap=softcap, alibi=alibi, gain=gain, ref_window=ref_window),
        id=name,
    )


FEATURES = [
    _feature("window-3.5", (1, 2, 2, 17, 29, 16), window=(3, 5)),
    _feature("causal-window-4.4-is-4.0", (1, 2, 2, 19, 19, 16), window=(4, 4), causal=True, ref_window=(4, 0)),
    # seqlen_q > seqlen_k: a right side >= seqlen_k becomes -1, which shows (rows 0.. see keys again).
    _feature("window-right-past-seqlen_k", (1, 2, 2, 37, 19, 16), window=(2, 25), ref_window=(2, -1)),
    _feature(
        "window-left-past-seqlen_k-causal", (1, 2, 1, 21, 17, 16), window=(40, 3), causal=True, ref_window=(-1, 0)
    ),
    _feature("softcap-5-x4", (1, 2, 2, 17, 29, 16), softcap=5.0, gain=4.0),
    _feature("alibi-heads", (1, 2, 2, 17, 29, 16), alibi="head"),
    _feature("alibi-batch-heads-causal-gqa", (2, 4, 2, 23, 19, 16), causal=True, alibi="batch"),
    _feature(
        "all-together",
        (1, 4, 2, 33, 47, 16),
        window=(9, 9),
        causal=True,
        softcap=8.0,
        gain=3.0,
        alibi="batch",
        ref_window=(9, 0),
    ),
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
    _simulated_api_dtype(backend, status, dtype)
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v, slopes = _feature_inputs(case, dtype, device, seed=sum(case["shape"]))
    window = tuple(torch.tensor(w) for w in case["window"])
    (out, lse, _), _ = _call(
        "func",
        q,
        k,
        v,
        backend,
        causal=case["causal"],
        window_size=window,
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )
    assert_matches_reference(
        *_bhsd(out),
        lse,
        *_bhsd(q, k, v),
        False,
        window=case["ref_window"],
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize("case", [FEATURES[1], FEATURES[7]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_gradients(backend, status, device, dtype, case):
    b, h, h_k, n_q, n_k, d = case["shape"]
    _simulated_api_dtype(backend, status, dtype)
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v, slopes = _feature_inputs(case, dtype, device, seed=sum(case["shape"]) + 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, _, _), leaves = _call(
        "func",
        q,
        k,
        v,
        backend,
        causal=case["causal"],
        window_size=case["window"],
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    try:
        grads = torch.autograd.grad(out, leaves, dO)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    assert_grads_match(
        *_bhsd(*grads),
        *_bhsd(q.detach(), k.detach(), v.detach()),
        *_bhsd(dO),
        False,
        window=case["ref_window"],
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_are_bit_identical_run_after_run(backend, status, device, dtype, deterministic):
    """flash-attn's test_flash_attn_deterministic: repeated autograd.grad(..., retain_graph=True) give the
    same bits. fa2's backwards are deterministic whatever the flag (no atomics)."""
    require_runnable(backend, status, device, dtype, (1, 4, 29, 37, 16))
    simulated_subset(
        backend,
        status,
        deterministic,
        "deterministic=True only (fa2-numba-cuda's backward reads no flag: one code path)",
    )
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
    # numba's simulator, one repeat: its kernels' order of arithmetic is the GPU's, which repeats them three times.
    for _ in range(1 if backend == "numba-cuda" and status == "emulated" else 3):
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
    assert_matches_reference(*_bhsd(out), lse, *_bhsd(q, k, v), False, 59**-0.5)


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
    _bad(
        "heads-not-divisible",
        lambda: flash_attn_func(_q(1, 5, 6, 16), _q(1, 5, 4, 16), _q(1, 5, 4, 16)),
        FlashAttnValueError,
        "heads in key/value must divide",
    ),
    _bad("head-dim-over-256", lambda: flash_attn_func(*[_q(1, 3, 1, 264)] * 3), FlashAttnValueError, "headdim"),
    _bad("rank-3", lambda: flash_attn_func(*[_q(5, 2, 16)] * 3), FlashAttnValueError, r"\(batch_size, seqlen"),
    _bad("batch-0", lambda: flash_attn_func(*[_q(0, 5, 2, 16)] * 3), FlashAttnValueError, "batch size"),
    _bad(
        "k-v-shapes",
        lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16), _q(1, 6, 2, 16)),
        FlashAttnValueError,
        "k and v",
    ),
    _bad(
        "head-dims-differ",
        lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 32), _q(1, 5, 2, 32)),
        FlashAttnValueError,
        "headdim",
    ),
    _bad(
        "int-dtype",
        lambda: flash_attn_func(*[torch.ones(1, 5, 2, 16, dtype=torch.int32)] * 3),
        FlashAttnTypeError,
        "float16, bfloat16 or float32",
    ),
    _bad(
        "mixed-dtypes",
        lambda: flash_attn_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16, dtype=torch.bfloat16), _q(1, 5, 2, 16)),
        FlashAttnTypeError,
        "same dtype",
    ),
    _bad(
        "alibi-fp16",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=torch.ones(2).half()),
        FlashAttnTypeError,
        "float32",
    ),
    _bad(
        "alibi-shape",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=torch.ones(3)),
        FlashAttnValueError,
        r"\(2,\)",
    ),
    _bad(
        "alibi-list",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, alibi_slopes=[0.1, 0.2]),
        FlashAttnTypeError,
        "alibi_slopes",
    ),
    _bad(
        "dropout-with-softcap",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, 0.1, softcap=5.0),
        FlashAttnValueError,
        "softcap",
    ),
    _bad("dropout-1", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, 1.0), FlashAttnValueError, r"\[0, 1\)"),
    _bad(
        "window-float",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=(1.5, 0)),
        FlashAttnTypeError,
        "window_size left",
    ),
    _bad(
        "window-not-a-pair",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=3),
        FlashAttnTypeError,
        "window_size",
    ),
    _bad(
        "window-below-minus-1",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, window_size=(0, -2)),
        FlashAttnValueError,
        "window_size right",
    ),
    _bad(
        "softcap-negative",
        lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, softcap=-1.0),
        FlashAttnValueError,
        "softcap",
    ),
    _bad("causal-not-bool", lambda: flash_attn_func(*[_q(1, 5, 2, 16)] * 3, causal=None), FlashAttnTypeError, "causal"),
    _bad(
        "qkv-not-packed-by-3",
        lambda: flash_attn_qkvpacked_func(_q(1, 5, 2, 2, 16)),
        FlashAttnValueError,
        r"\(batch_size, seqlen, 3",
    ),
    _bad(
        "kv-rank-4",
        lambda: flash_attn_kvpacked_func(_q(1, 5, 2, 16), _q(1, 5, 2, 16)),
        FlashAttnValueError,
        r"\(batch_size, seqlen_k, 2",
    ),
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


# The varlen functions: sequences packed along dim 0 with int32 offsets, checked one sequence at a time
# against the reference (the dense reference on that sequence's slices: every mask, ALiBi distance and empty
# row is the sequence's own). Lengths 0 and 1, seqlen_q != seqlen_k both ways within one batch, lengths
# either side of 16, 32 and 64 (tile edges), a batch of one.


def _varlen_case(
    name,
    lens_q,
    lens_k=None,
    h=2,
    h_k=None,
    d=16,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
    gain=1.0,
    ref_window=None,
    max_seqlen=None,
):
    """ref_window: the window after flash-attn's varlen normalisation (sides >= max_seqlen_k -> -1, causal
    -> right 0), which the reference gets per sequence; max_seqlen: (max_seqlen_q, max_seqlen_k) if not the
    longest lengths (an upper bound)."""
    lens_k = lens_q if lens_k is None else lens_k
    if ref_window is None:
        ref_window = (window[0], 0) if causal else window
    case = dict(
        name=name,
        lens_q=lens_q,
        lens_k=lens_k,
        h=h,
        h_k=h if h_k is None else h_k,
        d=d,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi=alibi,
        gain=gain,
        ref_window=ref_window,
        max_seqlen=max_seqlen or (max(lens_q), max(lens_k)),
    )
    return pytest.param(case, id=name)


# numba's simulator runs varlen qkvpacked on this case only (as QKVPACKED_SIMULATED).
VARLEN_QKVPACKED_SIMULATED = "one-sequence"
VARLEN_CASES = [
    _varlen_case("one-sequence", [23]),
    _varlen_case("three-H3", [17, 33, 5], h=3),
    _varlen_case("three-H3-causal", [31, 65, 16], h=3, causal=True),
    _varlen_case("lengths-0-and-1-causal", [0, 1, 17, 1, 0], [3, 1, 17, 0, 0], causal=True),
    _varlen_case("gqa-causal-nq-ne-nk", [19, 7, 30], [37, 29, 11], h=4, h_k=2, causal=True),
    _varlen_case("mqa-D59", [13, 21], [29, 9], h=4, h_k=1, d=59),
    _varlen_case("max-seqlen-an-upper-bound-causal", [9, 14], [3, 20], causal=True, max_seqlen=(64, 64)),
]
VARLEN_FEATURES = [
    _varlen_case("window-3.5", [17, 29], [29, 17], window=(3, 5)),
    _varlen_case("causal-window-4.4-is-4.0", [19, 7], [19, 12], window=(4, 4), causal=True, ref_window=(4, 0)),
    # Sides are compared against max_seqlen_k (19), not each sequence's seqlen_k (5): 10 stays 10, where
    # flash_attn_func on the first sequence alone would make it -1 (its rows 0..21 see keys again).
    _varlen_case("window-right-between-seqlen_k-and-max", [37, 3], [5, 19], window=(2, 10)),
    _varlen_case("window-right-past-max_seqlen_k", [37, 3], [5, 19], window=(2, 19), ref_window=(2, -1)),
    _varlen_case(
        "window-left-past-max_seqlen_k-causal",
        [21, 4],
        [17, 6],
        h=2,
        h_k=1,
        window=(40, 3),
        causal=True,
        ref_window=(-1, 0),
    ),
    _varlen_case("softcap-5-x4", [17, 29], [29, 17], softcap=5.0, gain=4.0),
    _varlen_case("alibi-heads", [17, 29], [29, 17], alibi="head"),
    _varlen_case("alibi-sequences-heads-causal-gqa", [23, 0, 9], [19, 4, 9], h=4, h_k=2, causal=True, alibi="batch"),
    _varlen_case(
        "all-together",
        [33, 1, 20],
        [47, 5, 20],
        h=4,
        h_k=2,
        window=(9, 9),
        causal=True,
        softcap=8.0,
        gain=3.0,
        alibi="batch",
        ref_window=(9, 0),
    ),
]


def _varlen_inputs(case, dtype, device, seed):
    """q (total_q, h, d), k and v (total_k, h_k, d), the offsets, the slopes ((h,) or (num_seqs, h))."""
    h, h_k, d = case["h"], case["h_k"], case["d"]
    q, k, v = random_qkv((sum(case["lens_q"]), h, d), (sum(case["lens_k"]), h_k, d), dtype, device, seed=seed)
    q, k = q * case["gain"], k * case["gain"]
    slopes = None
    if case["alibi"] is not None:
        g = torch.Generator().manual_seed(seed)
        shape = (h,) if case["alibi"] == "head" else (len(case["lens_q"]), h)
        slopes = (torch.rand(shape, generator=g) * 0.3).to(device)
    return q, k, v, offsets(case["lens_q"], device), offsets(case["lens_k"], device), slopes


def _varlen_call(variant, case, q, k, v, cu_q, cu_k, backend, **options):
    """The variant's varlen function (packing first where it packs): (out, lse, None), and the leaves."""
    max_q, max_k = case["max_seqlen"]
    try:
        if variant == "func":
            return flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, backend=backend, **options
            ), (q, k, v)
        if variant == "kvpacked":
            kv = torch.stack([k, v], dim=1).detach().requires_grad_(k.requires_grad)
            return flash_attn_varlen_kvpacked_func(
                q, kv, cu_q, cu_k, max_q, max_k, return_attn_probs=True, backend=backend, **options
            ), (q, kv)
        qkv = torch.stack([q, k, v], dim=1).detach().requires_grad_(q.requires_grad)
        return flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, return_attn_probs=True, backend=backend, **options), (
            qkv,
        )
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


def _varlen_unpack(variant, grads):
    if variant == "func":
        return grads
    if variant == "kvpacked":
        return (grads[0], *grads[1].unbind(1))
    return grads[0].unbind(1)


def _skip_varlen_variant(variant, case):
    if variant == "qkvpacked" and (case["lens_q"] != case["lens_k"] or case["h"] != case["h_k"]):
        pytest.skip("qkvpacked: one set of offsets and one head count for q, k and v")


def _simulated_varlen_packed(backend, status, variant, case):
    keep = {"func": True, "kvpacked": case["h"] != case["h_k"], "qkvpacked": case["name"] == VARLEN_QKVPACKED_SIMULATED}
    simulated_subset(
        backend,
        status,
        keep[variant],
        f"varlen kvpacked on the GQA and MQA cases and varlen qkvpacked on {VARLEN_QKVPACKED_SIMULATED} only",
    )


def _require_varlen(backend, status, device, dtype, case):
    require_runnable(
        backend, status, device, dtype, (1, case["h"], sum(case["lens_q"]), max(1, sum(case["lens_k"])), case["d"])
    )


def _sequences(case):
    """(s, its query rows, its key rows) for every sequence."""
    bq, bk = [0, *itertools.accumulate(case["lens_q"])], [0, *itertools.accumulate(case["lens_k"])]
    for s in range(len(case["lens_q"])):
        yield s, slice(bq[s], bq[s + 1]), slice(bk[s], bk[s + 1])


def _seq(x, rows):
    """Sequence rows of a packed (total, h, d) tensor as the reference's (1, h, n, d)."""
    return x[rows].transpose(0, 1)[None]


def _seq_features(case, slopes, s):
    alibi = None if slopes is None else slopes if slopes.dim() == 1 else slopes[s : s + 1]
    return dict(window=case["ref_window"], softcap=case["softcap"], alibi_slopes=alibi)


def _assert_varlen_matches(out, lse, q, k, v, case, slopes):
    total_q, h, d = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (h, total_q) and lse.dtype == torch.float32, "softmax_lse must be (nheads, total_q) fp32"
    for s, rows, keys in _sequences(case):
        if rows.start == rows.stop:
            continue
        assert_matches_reference(
            _seq(out, rows),
            lse[:, rows][None],
            _seq(q, rows),
            _seq(k, keys),
            _seq(v, keys),
            False,
            **_seq_features(case, slopes, s),
        )


def _reference_varlen(q, k, v, case, slopes, upcast=True):
    """The reference on each sequence's slices, its outputs concatenated: (total_q, h, d), differentiable."""
    outs = [
        reference.attention(
            _seq(q, rows), _seq(k, keys), _seq(v, keys), False, upcast=upcast, **_seq_features(case, slopes, s)
        )[0][0].transpose(0, 1)
        for s, rows, keys in _sequences(case)
    ]
    return torch.cat(outs)


def _assert_varlen_grads(dq, dk, dv, q, k, v, dO, case, slopes):
    """test_gradients.assert_grads_match's rule on the packed batch as one, as the dense tests take a
    (b, h, s, d) batch as one: a sequence alone can have a zero tolerance (one row that sees one key has
    dq = 0 exactly in the reference and in the naive attention, and rounding noise in a kernel)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(_reference_varlen(q64, k64, v64, case, slopes), (q64, k64, v64), dO.double())
    if q.dtype == torch.float32:
        tols = [FP32_GRAD_ATOL] * 3
    else:
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        naive = torch.autograd.grad(_reference_varlen(ql, kl, vl, case, slopes, upcast=False), (ql, kl, vl), dO)
        tols = [3 * max_err(n, r) + 2 * max_err(r.to(q.dtype), r) for n, r in zip(naive, ref)]
    for name, g, r, tol, x in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, tols, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
        assert not torch.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g} ({q.dtype})"
    for s, rows, keys in _sequences(case):
        if rows.start == rows.stop or keys.start == keys.stop:
            for name, g in (("dq", dq[rows]), ("dk", dk[keys]), ("dv", dv[keys])):
                assert (g == 0).all(), f"sequence {s} ({rows}, {keys}): {name} must be 0 where no query meets a key"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", VARLEN_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_matches_reference(backend, status, device, dtype, case, variant):
    """out (total_q, h, d) in q's dtype, softmax_lse (h, total_q) float32 (flash-attn's unpadded LSE), None
    for S_dmask; each sequence against the reference on its own slices."""
    _skip_varlen_variant(variant, case)
    _simulated_varlen_packed(backend, status, variant, case)
    _simulated_api_dtype(backend, status, dtype)
    _require_varlen(backend, status, device, dtype, case)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case, dtype, device, seed=len(case["lens_q"]) + sum(case["lens_k"]))
    (out, lse, S_dmask), _ = _varlen_call(variant, case, q, k, v, cu_q, cu_k, backend, causal=case["causal"])
    assert S_dmask is None
    _assert_varlen_matches(out, lse, q, k, v, case, None)
    max_q, max_k = case["max_seqlen"]
    plain = {
        "func": lambda: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=case["causal"], backend=backend
        ),
        "kvpacked": lambda: flash_attn_varlen_kvpacked_func(
            q, torch.stack([k, v], 1), cu_q, cu_k, max_q, max_k, causal=case["causal"], backend=backend
        ),
        "qkvpacked": lambda: flash_attn_varlen_qkvpacked_func(
            torch.stack([q, k, v], 1), cu_q, max_q, causal=case["causal"], backend=backend
        ),
    }
    assert torch.equal(plain[variant](), out), "return_attn_probs=False must return the same out alone"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", VARLEN_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_gradients(backend, status, device, dtype, case, variant):
    """Gradients to q, k, v, or one gradient shaped like the packed input; each sequence's slices against
    the reference's; zero where a sequence has no query or no key."""
    _skip_varlen_variant(variant, case)
    _simulated_varlen_packed(backend, status, variant, case)
    _simulated_api_dtype(backend, status, dtype)
    _require_varlen(backend, status, device, dtype, case)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case, dtype, device, seed=sum(case["lens_q"]) + 1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, _, _), leaves = _varlen_call(variant, case, q, k, v, cu_q, cu_k, backend, causal=case["causal"])
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    try:
        grads = torch.autograd.grad(out, leaves, dO)
    except NotImplementedError as e:
        pytest.skip(f"{backend} has no backward: {e}")
    for g, x in zip(grads, leaves):
        assert g.shape == x.shape and g.dtype == x.dtype
    _assert_varlen_grads(*_varlen_unpack(variant, grads), q.detach(), k.detach(), v.detach(), dO, case, None)


@pytest.mark.parametrize("case", VARLEN_FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_features_pass_through(backend, status, device, dtype, case):
    """window_size (as 0-d int64 tensors, normalised against max_seqlen_k), softcap and alibi_slopes ((h,)
    or (num_seqs, h)), each sequence on its own lengths."""
    _simulated_api_dtype(backend, status, dtype)
    _require_varlen(backend, status, device, dtype, case)
    q, k, v, cu_q, cu_k, slopes = _varlen_inputs(case, dtype, device, seed=sum(case["lens_q"]))
    window = tuple(torch.tensor(w) for w in case["window"])
    (out, lse, _), _ = _varlen_call(
        "func",
        case,
        q,
        k,
        v,
        cu_q,
        cu_k,
        backend,
        causal=case["causal"],
        window_size=window,
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )
    _assert_varlen_matches(out, lse, q, k, v, case, slopes)


@pytest.mark.parametrize("case", [VARLEN_FEATURES[1], VARLEN_FEATURES[2], VARLEN_FEATURES[-1]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_feature_gradients(backend, status, device, dtype, case):
    _simulated_api_dtype(backend, status, dtype)
    _require_varlen(backend, status, device, dtype, case)
    q, k, v, cu_q, cu_k, slopes = _varlen_inputs(case, dtype, device, seed=sum(case["lens_q"]) + 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, _, _), leaves = _varlen_call(
        "func",
        case,
        q,
        k,
        v,
        cu_q,
        cu_k,
        backend,
        causal=case["causal"],
        window_size=case["window"],
        softcap=case["softcap"],
        alibi_slopes=slopes,
    )
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    try:
        grads = torch.autograd.grad(out, leaves, dO)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    _assert_varlen_grads(*grads, q.detach(), k.detach(), v.detach(), dO, case, slopes)


def test_varlen_rows_that_see_no_key(backend, status, device):
    """flash-attn's test_flash_attn_bwd_varlen_overflow, small: one key per sequence against many queries,
    causal: out = 0 and softmax_lse = +inf on the rows before each sequence's last, no NaN in any
    gradient; a sequence with no key at all (its every row) and one with no query."""
    case = VARLEN_CASES[0].values[0] | dict(lens_q=[7, 1, 9, 0], lens_k=[1, 1, 0, 2], h=2, h_k=2)
    _require_varlen(backend, status, device, torch.float32, case)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case, torch.float32, device, seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, lse, _), _ = _varlen_call("func", case, q, k, v, cu_q, cu_k, backend, causal=True)
    blind = torch.tensor([1] * 6 + [0] + [0] + [1] * 9, dtype=torch.bool, device=device)
    assert (out[blind] == 0).all() and torch.isposinf(lse[:, blind]).all()
    assert torch.isfinite(lse[:, ~blind]).all()
    try:
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    except NotImplementedError as e:
        pytest.skip(f"{backend} has no backward: {e}")
    assert not any(torch.isnan(g).any() for g in grads)
    assert (grads[0][blind] == 0).all() and (grads[1][-2:] == 0).all() and (grads[2][-2:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_gradients_are_bit_identical_run_after_run(backend, status, device, dtype):
    """flash-attn's test_flash_attn_varlen_deterministic: repeated backward calls give the same bits."""
    case = VARLEN_CASES[4].values[0]
    _require_varlen(backend, status, device, dtype, case)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case, dtype, device, seed=21)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        out = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, *case["max_seqlen"], 0.0, causal=True, deterministic=True, backend=backend
        )
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between two backward calls"


def test_varlen_inputs_reach_the_backend_as_views(backend, status, device, monkeypatch):
    """q, k, v (and kv's halves) go to the backend as (1, h, total, d) views of the caller's storage, with
    the caller's offsets in the spec: no copy, no padding to the longest sequence."""
    case = VARLEN_CASES[5].values[0] | dict(d=16)
    _require_varlen(backend, status, device, torch.float32, case)
    impl = registry.load(backend)
    seen = []

    def spy(q, k, v, spec, *args, **kwargs):
        seen.append(
            (
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                tuple(q.shape),
                q.stride(),
                k.stride(),
                spec.cu_seqlens_q,
                spec.cu_seqlens_k,
                spec.max_seqlen_q,
                spec.max_seqlen_k,
            )
        )
        return real(q, k, v, spec, *args, **kwargs)

    real = impl.flash_attn_forward
    monkeypatch.setattr(impl, "flash_attn_forward", spy)
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case, torch.float32, device, seed=3)
    kv = torch.stack([k, v], dim=1)
    max_q, max_k = case["max_seqlen"]
    _varlen_call("func", case, q, k, v, cu_q, cu_k, backend)
    _varlen_call("kvpacked", case, q, k, v, cu_q, cu_k, backend)  # stacks its own kv like this one
    size = kv.element_size()

    def view(x):
        return x.transpose(0, 1)[None]

    common = (tuple(view(q).shape), view(q).stride())
    assert [s[:3] + s[3:5] for s in seen][:1] == [(q.data_ptr(), k.data_ptr(), v.data_ptr(), *common)]
    assert seen[0][5] == view(k).stride() and seen[1][5] == view(kv[:, 0]).stride()
    assert seen[1][2] - seen[1][1] == kv.stride(1) * size
    for s in seen:
        assert s[6] is cu_q and s[7] is cu_k and s[8:] == (max_q, max_k)


@pytest.mark.parametrize("page_size", [16, 5], ids=["page16", "page5"])
def test_varlen_block_table_equals_contiguous_keys(backend, status, device, page_size):
    """flash_attn_varlen_func with a block table: each sequence's keys read from its pages give what the
    same keys packed contiguously give (GQA, causal, a sequence without queries and one without keys);
    its output refuses a backward (forward only, as flash-attn's)."""
    dtype = torch.float16 if status == "emulated" else torch.bfloat16
    lens_q, lens_k, heads, heads_k, d = [3, 0, 4], [9, 6, 0], 4, 2, 16
    require_runnable(backend, status, device, dtype, (len(lens_q), heads, max(lens_q), max(lens_k), d))
    g = torch.Generator().manual_seed(0)
    per_seq = -(-max(lens_k) // page_size)
    k_pages = torch.randn(3 * per_seq + 2, page_size, heads_k, d, generator=g).to(device, dtype)
    v_pages = torch.randn(k_pages.shape, generator=g).to(device, dtype)
    table = torch.randperm(k_pages.shape[0], generator=g)[: 3 * per_seq].reshape(3, per_seq).to(device, torch.int32)
    keys = [k_pages[table[s].long()].flatten(0, 1)[:n] for s, n in enumerate(lens_k)]
    values = [v_pages[table[s].long()].flatten(0, 1)[:n] for s, n in enumerate(lens_k)]

    q = torch.randn(sum(lens_q), heads, d, generator=g).to(device, dtype).requires_grad_()
    args = (offsets(lens_q, device), offsets(lens_k, device), max(lens_q), max(lens_k))
    out, lse, _ = flash_attn_varlen_func(
        q, k_pages, v_pages, *args, causal=True, block_table=table, return_attn_probs=True, backend=backend
    )
    want, want_lse, _ = flash_attn_varlen_func(
        q.detach(), torch.cat(keys), torch.cat(values), *args, causal=True, return_attn_probs=True, backend=backend
    )
    assert max_err(out, want) <= 2e-3 * want.abs().max().item() + 1e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert max_err(lse[finite], want_lse[finite]) <= 1e-3
    with pytest.raises(NotImplementedError, match="no backward through a KV cache"):
        out.sum().backward()


def test_varlen_dropout_is_refused():
    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, 0.1, backend="pytorch")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_qkvpacked_func(torch.randn(5, 3, 2, 16), cu, 3, dropout_p=0.5, backend="pytorch")


def _vq(total=5, h=2, d=16):
    return _q(total, h, d)


def _cu(*offsets, dtype=torch.int32):
    return torch.tensor(offsets, dtype=dtype)


def _varlen(q=None, k=None, v=None, cu_q=None, cu_k=None, max_q=3, max_k=3, **options):
    q = _vq() if q is None else q
    k = q if k is None else k
    cu_q = _cu(0, 2, 5) if cu_q is None else cu_q
    return lambda: flash_attn_varlen_func(
        q, k, k if v is None else v, cu_q, cu_q if cu_k is None else cu_k, max_q, max_k, **options
    )


VARLEN_BAD_INPUTS = [
    _bad("varlen-cu-int64", _varlen(cu_q=_cu(0, 2, 5, dtype=torch.int64)), FlashAttnTypeError, "int32"),
    _bad("varlen-cu-list", _varlen(cu_q=[0, 2, 5]), FlashAttnTypeError, "cu_seqlens_q"),
    _bad("varlen-cu-rank-2", _varlen(cu_q=_cu(0, 2, 5)[None]), FlashAttnValueError, r"\(batch_size \+ 1,\)"),
    _bad("varlen-cu-empty", _varlen(cu_q=_cu()), FlashAttnValueError, r"\(batch_size \+ 1,\)"),
    _bad("varlen-cu-not-contiguous", _varlen(cu_q=_cu(0, 9, 2, 9, 5, 9)[::2]), FlashAttnValueError, "contiguous"),
    _bad("varlen-cu-another-device", _varlen(cu_q=_cu(0, 2, 5).to("meta")), FlashAttnValueError, "device"),
    _bad("varlen-cu-lengths-differ", _varlen(cu_k=_cu(0, 1, 2, 5)), FlashAttnValueError, "batch_size"),
    _bad("varlen-cu-q-total", _varlen(cu_q=_cu(0, 2, 4)), FlashAttnValueError, "total length 5"),
    _bad("varlen-cu-k-total", _varlen(k=_vq(7), cu_k=_cu(0, 2, 5)), FlashAttnValueError, "total length 7"),
    _bad("varlen-cu-not-from-0", _varlen(cu_q=_cu(1, 2, 5)), FlashAttnValueError, "from 0"),
    _bad("varlen-max-seqlen-float", _varlen(max_q=3.0), FlashAttnTypeError, "max_seqlen_q must be an int"),
    _bad("varlen-max-seqlen-tensor", _varlen(max_k=torch.tensor(3)), FlashAttnTypeError, "max_seqlen_k"),
    _bad("varlen-max-seqlen-none", _varlen(max_k=None), FlashAttnTypeError, "max_seqlen_k"),
    _bad("varlen-max-seqlen-negative", _varlen(max_q=-1), FlashAttnValueError, "max_seqlen_q must be >= 0"),
    _bad("varlen-q-rank-4", _varlen(q=_q(1, 5, 2, 16)), FlashAttnValueError, r"\(total, nheads, headdim\)"),
    _bad("varlen-k-v-shapes", _varlen(v=_vq(6)), FlashAttnValueError, "k and v"),
    _bad(
        "varlen-heads-not-divisible",
        _varlen(k=_vq(h=3), q=_vq(h=4)),
        FlashAttnValueError,
        "heads in key/value must divide",
    ),
    _bad("varlen-mixed-dtypes", _varlen(k=_vq().to(torch.bfloat16)), FlashAttnTypeError, "same dtype"),
    _bad("varlen-head-dim-over-256", _varlen(q=_vq(d=264)), FlashAttnValueError, "headdim"),
    _bad("varlen-alibi-batch-is-sequences", _varlen(alibi_slopes=torch.ones(3, 2)), FlashAttnValueError, r"\(2, 2\)"),
    _bad("varlen-window-below-minus-1", _varlen(window_size=(-2, 0)), FlashAttnValueError, "window_size left"),
    _bad("varlen-causal-not-bool", _varlen(causal=1), FlashAttnTypeError, "causal"),
    _bad(
        "varlen-qkv-rank-5",
        lambda: flash_attn_varlen_qkvpacked_func(_q(1, 5, 3, 2, 16), _cu(0, 5), 5),
        FlashAttnValueError,
        r"\(total, 3, nheads",
    ),
    _bad(
        "varlen-kv-not-packed-by-2",
        lambda: flash_attn_varlen_kvpacked_func(_vq(), _q(5, 3, 2, 16), _cu(0, 5), _cu(0, 5), 5, 5),
        FlashAttnValueError,
        r"\(total_k, 2, nheads_k",
    ),
]


@pytest.mark.parametrize("make, error, match", VARLEN_BAD_INPUTS)
def test_varlen_bad_inputs_raise_runtime_error(make, error, match):
    """flash-attn's mha_varlen_fwd checks (cu_seqlens int32, contiguous, (batch_size + 1,); q (total_q, h, d);
    k, v (total_k, h_k, d)), and fa2's own on the totals and max_seqlen, as RuntimeErrors that are also
    ValueError / TypeError."""
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, RuntimeError)


def test_varlen_decreasing_offsets_are_refused_by_pytorch():
    """fa2-pytorch reads every offset (it runs each sequence): decreasing ones are a RuntimeError too."""
    if "pytorch" not in fa2.backends():
        pytest.skip("fa2-pytorch is not installed here")
    q = torch.randn(5, 2, 16)
    with pytest.raises(FlashAttnValueError, match="non-decreasing") as info:
        flash_attn_varlen_func(q, q, q, _cu(0, 4, 2, 5), _cu(0, 1, 2, 5), 4, 3, backend="pytorch")
    assert isinstance(info.value, RuntimeError)
