"""Attention sinks (gpt-oss, issue 40) in fa2-triton's kernels, called directly with ``spec.sink``: the
forward (``flash_attn_forward``, dense and packed, and its speed levers), the backward (``flash_attn_backward``:
dq, dk, dv and dsink) and the KV-cache kernel (``kvcache_forward``: contiguous and paged, one split and
several), each against the fp64 reference (``fa2.reference``, its gradients from autograd with the sink
requiring grad) by the suite's precision rule, into NaN-poisoned outputs; rows that see no key get O = 0 and
L = sink[h]. And the Gluon Hopper kernel with a sink compiled offline for sm_90a, as test_triton_gluon.py
compiles it without. Tiny shapes: the CPU runs them in Triton's interpreter (no bf16 there)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import fa2_triton
from checks import assert_matches_reference, max_err, random_qkv, run_python, tolerances
from fa2 import reference
from fa2.spec import AttentionSpec
from fa2_triton import backward, flash_attn_backward, flash_attn_forward, forward, forward_gluon, kvcache_forward
from fa2_triton.common import INTERPRETED
from fa2_triton.tiles import Tiles
from test_kvcache import CASES as KV_CASES
from test_kvcache import _make as make_kvcache

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
FP32_GRAD_ATOL = 1e-4  # test_gradients.py's


@pytest.fixture
def runnable(device):
    mode = fa2_triton.availability()[0]
    if device.type == "cuda" and mode != "native":
        pytest.skip(f"fa2-triton does not run natively here ({mode})")
    if device.type == "cpu" and not INTERPRETED:
        pytest.skip("fa2-triton was imported without TRITON_INTERPRET=1: its kernels need a GPU")


def _skip_bf16_interpreted(device, dtype):
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; bf16 is tested on the GPU")


def _sink(heads, device, seed=7):
    """Logits of either sign and of the scores' size, so that the sink takes a real share of some rows, and
    most of the rows that see few keys."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=g) * 2).to(device)


def _case(b, h, hk, n_q, n_k, d, window=(-1, -1), softcap=0.0, alibi=False):
    parts = [f"B{b}-H{h}.{hk}-{n_q}x{n_k}-D{d}"]
    parts += ["causal" if window == (-1, 0) else f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"softcap{softcap:g}"] if softcap else []
    parts += ["alibi"] if alibi else []
    return pytest.param(
        dict(b=b, h=h, hk=hk, n_q=n_q, n_k=n_k, d=d, window=window, softcap=softcap, alibi=alibi), id="-".join(parts)
    )


CASES = [
    # no mask, MHA
    _case(1, 2, 2, 19, 37, 32),
    # causal with more queries than keys: the first 18 rows see no key (O = 0, L = sink[h]); GQA
    _case(2, 4, 2, 37, 19, 16, window=(-1, 0)),
    # gpt-oss's sliding layers: a causal window narrower than a tile, MQA
    _case(1, 4, 1, 70, 70, 16, window=(8, 0)),
    # softcap and ALiBi with a two-sided window
    _case(2, 2, 1, 33, 45, 32, window=(12, 5), softcap=5.0, alibi=True),
]


def _problem(case, dtype, device, seed=0):
    """q, k, v, the spec with a sink, and the features the reference takes."""
    c = case
    q, k, v = random_qkv((c["b"], c["h"], c["n_q"], c["d"]), (c["b"], c["hk"], c["n_k"], c["d"]), dtype, device, seed)
    slopes = None
    if c["alibi"]:
        slopes = (torch.rand(c["b"], c["h"], generator=torch.Generator().manual_seed(seed)) * 0.3).to(device)
    sink = _sink(c["h"], device, seed)
    spec = AttentionSpec(c["d"] ** -0.5, c["window"], c["softcap"], slopes, c["h"] // c["hk"], sink=sink)
    features = dict(window=c["window"], softcap=c["softcap"], alibi_slopes=slopes, sink=sink)
    return q, k, v, spec, features


def _assert_empty_rows(O, L, empty, sink):
    """Rows that see no key (``empty``, L's shape (batch, heads, seqlen_q)): O = 0 exactly, L = sink[h] (to
    fp32 rounding: the kernel's log of exp, in log2 units)."""
    assert (O[empty] == 0).all(), "rows that see no key must have O = 0"
    expected = sink[None, :, None].expand(L.shape)
    assert torch.allclose(L[empty], expected[empty], rtol=0, atol=1e-6), "rows that see no key must have L = sink[h]"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_with_a_sink(runnable, device, dtype, case):
    _skip_bf16_interpreted(device, dtype)
    q, k, v, spec, features = _problem(case, dtype, device)
    O, L = flash_attn_forward(q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, False, spec.scale, **features)
    # Which rows see no key: the same inputs without a sink give them L = +inf.
    empty = torch.isinf(reference.attention(q, k, v, False, spec.scale, **(features | dict(sink=None)))[1])
    if empty.any():
        _assert_empty_rows(O, L, empty, spec.sink)


# The forward's levers on a sink: each one's path (descriptors, the warp-specialised loop, the lazy rescale,
# exp2 without the fused FMA) reaches the same epilogue, where the sink joins.
LEVERS = {
    "pointers": Tiles(32, 16, 4, 1),
    "descriptors": Tiles(32, 16, 4, 1, tma=True),
    "lazy_rescale": Tiles(32, 16, 4, 1, lazy_rescale=True),
    "no_fused_exp2": Tiles(32, 16, 4, 1, fused_exp2=False),
    "warp_specialize": Tiles(128, 64, 4, 2, tma=True, warp_specialize=True),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lever", list(LEVERS))
@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_forward_levers_with_a_sink(runnable, device, dtype, lever, causal):
    _skip_bf16_interpreted(device, dtype)
    q, k, v = random_qkv((1, 2, 128, 16), (1, 2, 64, 16), dtype, device, seed=3)
    sink = _sink(2, device)
    spec = AttentionSpec(0.25, (-1, 0) if causal else (-1, -1), sink=sink)
    O = torch.full_like(q, math.nan)
    L = torch.full(q.shape[:-1], math.nan, device=device)
    forward.launch_kernel(q, k, v, O, L, spec, LEVERS[lever])
    assert_matches_reference(O, L, q, k, v, causal, 0.25, sink=sink)


def _packed(dtype, device, seqlens_q=(5, 0, 23, 17), seqlens_k=(9, 4, 23, 0), heads=(4, 2), d=16, seed=1):
    """A packed batch: q (1, H, total_q, d), k, v (1, H_K, total_k, d), the offsets, a sink. Sequences with
    no queries and with no keys among them."""
    h, hk = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sum(seqlens_q), h, d, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(1, sum(seqlens_k), hk, d, generator=g).to(device, dtype).transpose(1, 2)
    v = torch.randn(1, sum(seqlens_k), hk, d, generator=g).to(device, dtype).transpose(1, 2)
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), _sink(h, device, seed)


def _sequences(cu_q, cu_k):
    return [(slice(a, b), slice(c, e)) for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_forward_with_a_sink(runnable, device, dtype, causal):
    """Each sequence as its own dense problem with the same sink: a sequence without keys gets O = 0 and
    L = sink[h] on every row."""
    _skip_bf16_interpreted(device, dtype)
    q, k, v, cu_q, cu_k, max_q, max_k, sink = _packed(dtype, device)
    spec = AttentionSpec(
        0.25, (-1, 0) if causal else (-1, -1), group=2, sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    spec = dataclasses.replace(spec, max_seqlen_q=max_q, max_seqlen_k=max_k)
    O, L = flash_attn_forward(q, k, v, spec)
    for rows, keys in _sequences(cu_q.tolist(), cu_k.tolist()):
        q_s, k_s, v_s = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        assert_matches_reference(O[:, :, rows], L[:, :, rows], q_s, k_s, v_s, causal, 0.25, sink=sink)


def _grad_reference(q, k, v, sink, dO, causal, scale, **features):
    """(the fp64 reference's dq, dk, dv, dsink; each one's tolerance): fp32 test_gradients' fixed bound,
    16-bit three times a same-precision naive attention's error plus twice the fp64 gradient's rounding to
    the dtype (dsink's to fp32)."""
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    O64 = reference.attention(*x64[:3], causal, scale, sink=x64[3], **features)[0]
    ref = torch.autograd.grad(O64, x64, dO.double())
    if q.dtype == torch.float32:
        return ref, [FP32_GRAD_ATOL] * 4
    xl = [t.detach().requires_grad_() for t in (q, k, v, sink)]
    O_naive = reference.attention(*xl[:3], causal, scale, sink=xl[3], upcast=False, **features)[0]
    naive = torch.autograd.grad(O_naive, xl, dO)
    return ref, [3 * max_err(n, r) + 2 * max_err(r.to(x.dtype), r) for n, r, x in zip(naive, ref, xl)]


def _assert_grads(got, ref, tols, inputs):
    for name, g, r, tol, x in zip(("dq", "dk", "dv", "dsink"), got, ref, tols, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
        assert not torch.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g} ({inputs[0].dtype})"


# The dQ kernel on every case; dq added from the dK/dV kernel with atomics on the case with empty rows.
BACKWARD = [
    *(pytest.param(case.values[0], True, id=f"{case.id}-deterministic") for case in CASES[1:]),
    pytest.param(CASES[1].values[0], False, id=f"{CASES[1].id}-atomic-dq"),
]


@pytest.mark.parametrize("case, deterministic", BACKWARD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_a_sink(runnable, device, dtype, case, deterministic):
    """dq, dk, dv as without a sink but with its L; dsink = -Σ exp(sink - L) · rowsum(dO ∘ O) over the batch
    and the rows, against autograd of the reference."""
    _skip_bf16_interpreted(device, dtype)
    q, k, v, spec, features = _problem(case, dtype, device, seed=2)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    O, L = flash_attn_forward(q, k, v, spec)
    got = flash_attn_backward(q, k, v, O, L, dO, spec, deterministic=deterministic)
    assert len(got) == 4, "with a sink the backward returns dq, dk, dv, dsink"
    sink = features.pop("sink")
    ref, tols = _grad_reference(q, k, v, sink, dO, False, spec.scale, **features)
    _assert_grads(got, ref, tols, (q, k, v, sink))


def test_backward_without_a_sink_returns_three(runnable, device):
    q, k, v = random_qkv((1, 2, 17, 16), (1, 2, 17, 16), torch.float32, device)
    spec = AttentionSpec(0.25)
    O, L = flash_attn_forward(q, k, v, spec)
    assert len(flash_attn_backward(q, k, v, O, L, torch.ones_like(O), spec)) == 3


def test_dsink_is_the_same_bits_every_call(runnable, device):
    """The preprocess's partial sums are added in a fixed order."""
    q, k, v, spec, _ = _problem(CASES[0].values[0], torch.float32, device, seed=4)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(device)
    O, L = flash_attn_forward(q, k, v, spec)
    first = flash_attn_backward(q, k, v, O, L, dO, spec)[3]
    assert torch.equal(first, flash_attn_backward(q, k, v, O, L, dO, spec)[3])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_backward_with_a_sink(runnable, device, dtype, causal):
    """A packed batch: each sequence's dq, dk, dv its own, dsink the sum over every sequence's rows."""
    _skip_bf16_interpreted(device, dtype)
    q, k, v, cu_q, cu_k, max_q, max_k, sink = _packed(dtype, device, seed=3)
    spec = AttentionSpec(
        0.25,
        (-1, 0) if causal else (-1, -1),
        group=2,
        sink=sink,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    O, L = flash_attn_forward(q, k, v, spec)
    dq, dk, dv, dsink = flash_attn_backward(q, k, v, O, L, dO, spec)
    dsink_ref, dsink_tol = torch.zeros_like(sink, dtype=torch.float64), 0.0
    for rows, keys in _sequences(cu_q.tolist(), cu_k.tolist()):
        x = (q[:, :, rows], k[:, :, keys], v[:, :, keys], sink)
        ref, tols = _grad_reference(*x, dO[:, :, rows], causal, 0.25)
        _assert_grads((dq[:, :, rows], dk[:, :, keys], dv[:, :, keys]), ref[:3], tols[:3], x[:3])
        dsink_ref += ref[3]
        dsink_tol += tols[3]
    assert dsink.shape == sink.shape and dsink.dtype == torch.float32
    err = max_err(dsink, dsink_ref)
    assert err <= dsink_tol, f"max |dsink - ref| = {err:.3g} > tolerance {dsink_tol:.3g} ({dtype})"


# test_kvcache's problems: one token and several, MHA, GQA, MQA, rows with no key, leftpad, cache_batch_idx,
# pages of 16 and 48 rows, windows with softcap, ALiBi, packed queries on pages; one split and several.
KV = {
    "q1-unsplit": KV_CASES[0],
    "q4-gqa-empty-row-splits": KV_CASES[1],
    "q20-mqa-split3": KV_CASES[2],
    "leftpad-split3": KV_CASES[4],
    "paged16-splits": KV_CASES[5],
    "paged48-leftpad-split2": KV_CASES[6],
    "window-softcap-split3": KV_CASES[8],
    "paged-alibi-softcap-empty-row": KV_CASES[11],
    "packed-paged-window-alibi": KV_CASES[13],
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(KV))
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_with_a_sink(runnable, device, dtype, case, causal):
    """Each row's own dense problem with the sink (``reference.kvcache_rows``); split caches count the sink
    once, in the merge; rows with no key get O = 0, L = sink[h]. In the interpreter, fp32 without a mask and
    fp16 causal only (the mask and the dtype are independent switches of the kernel)."""
    _skip_bf16_interpreted(device, dtype)
    if device.type == "cpu" and causal != (dtype == torch.float16):
        pytest.skip("the interpreter runs fp32 without a mask and fp16 causal: the CPU suite's time")
    kv_case = KV[case].values[0]
    q, k_cache, v_cache, spec = make_kvcache(kv_case, causal, dtype, device, seed=11)
    spec = dataclasses.replace(spec, sink=_sink(q.shape[1], device))
    O, L = kvcache_forward(q, k_cache, v_cache, spec)
    assert not torch.isnan(O).any() and not torch.isnan(L).any(), "an unwritten or 0/0 output"
    O_ref, L_ref = reference.kvcache_attention(q, k_cache, v_cache, spec)
    packed = spec.cu_seqlens_q is not None
    for b, (rows, k_b, v_b, slopes) in enumerate(reference.kvcache_rows(q, k_cache, v_cache, spec)):
        at = (slice(None), slice(None), rows) if packed else (rows,)
        features = dict(window=spec.window, softcap=spec.softcap, sink=spec.sink)
        features["alibi_slopes"] = None if slopes is None else slopes[None]
        tol_O, tol_L = tolerances(
            q[at], k_b[None], v_b[None], False, spec.scale, ref=(O_ref[at], L_ref[at]), **features
        )
        err_O, err_L = max_err(O[at], O_ref[at]), max_err(L[at], L_ref[at])
        assert err_O <= tol_O, f"row {b}: max |O - O_ref| = {err_O:.3g} > tolerance {tol_O:.3g} ({dtype})"
        assert err_L <= tol_L, f"row {b}: max |L - L_ref| = {err_L:.3g} > tolerance {tol_L:.3g} ({dtype})"


@pytest.mark.skipif(not forward_gluon.GLUON, reason="this Triton has no Gluon Hopper API")
def test_the_gluon_sink_kernel_compiles_for_sm90a():
    """ptxas's sm_90a build of the kernel with a sink, as test_triton_gluon checks the one without:
    warpgroup MMAs in the SASS, no local memory, the shared memory within a CTA's 227 KB."""
    code = "import json, test_triton_gluon as t; print(json.dumps(t._sm90a_build('fp16', True, True, sink=True)))"
    run = run_python(code, without="TRITON_INTERPRET", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    build = json.loads(run.stdout.strip().splitlines()[-1])
    assert build["hgmma"] > 0, "no warpgroup MMA in the SASS"
    assert build["stack"] == 0, f"{build['stack']} B of local memory a thread"
    assert build["shared"] <= 227 * 1024, f"{build['shared']} B of shared memory"


def test_the_gluon_kernel_takes_a_sink():
    q, k, v = random_qkv((2, 4, 256, 128), (2, 4, 256, 128), torch.bfloat16, "cpu")
    assert forward_gluon.takes(q, k, v, AttentionSpec(128**-0.5, sink=torch.zeros(4)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_gluon_kernel_with_a_sink_matches_the_reference(device, dtype, long_calls):
    """On a Hopper GPU: the warp-specialised kernel's epilogue adds the sink (skipped elsewhere)."""
    if device.type != "cuda" or not forward_gluon._on_hopper(device):
        pytest.skip("needs a Hopper GPU with Gluon (--device cuda)")
    q, k, v = random_qkv((2, 8, 256, 128), (2, 2, 384, 128), dtype, device)
    sink = _sink(8, device)
    spec = AttentionSpec(128**-0.5, group=4, sink=sink)
    assert forward_gluon.uses_gluon(q, k, v, spec)
    O, L = flash_attn_forward(q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, False, 128**-0.5, sink=sink)


def test_backward_preprocess_alone_has_no_dsink(runnable, device):
    """The tuner's call: delta only."""
    O = torch.randn(1, 2, 17, 16, device=device)
    delta, dsink = backward.launch_preprocess(O, O)
    assert dsink is None and torch.allclose(delta, (O * O).sum(-1))
