"""Attention sinks (gpt-oss's ``s_aux``, flash-attn 4's ``learnable_sink``) for every backend: a logit per head
that joins every row's softmax denominator, O_i = Σ_j exp(s_ij - L_i) v_j with L_i = log(exp(sink[h]) +
Σ_j exp(s_ij)), and a row that sees no key gets O = 0, L = sink[h].

The forward against ``fa2.reference`` with the same sink (causal; a sliding window, gpt-oss's 128 tokens
scaled down to the tiny shapes; GQA; softcap; ALiBi; packed batches; the KV-cache kernels, contiguous and
paged, split and not); dq, dk, dv and dsink against autograd of the fp64 reference, by the suite's precision
rules (checks.py, test_gradients.py); the same through fa2.flash_attn's ``learnable_sink``, FlashAttention2's
autograd function and torch.compile's custom ops; ``fa2.combine`` counting the sink once; and the refusals
of a bad sink. numba's CUDA simulator runs the fp32 cases named by ``_simulated`` (each kernel path once).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fa2
from checks import assert_matches_reference, max_err, offsets, random_qkv
from fa2 import reference, registry
from fa2.flash_attn import FlashAttnTypeError, FlashAttnValueError, flash_attn_func, flash_attn_varlen_func
from fa2.validation import make_spec
from test_conformance import DTYPES, emulated_subset, require_runnable, simulated_subset
from test_gradients import FP32_GRAD_ATOL, assert_grads_match, grads
from test_kvcache import _case as _kv_case
from test_kvcache import _kvcache_forward, _make, assert_matches_kvcache_reference


def _case(b, h, h_k, n_q, n_k, d, causal=False, window=(-1, -1), softcap=0.0, alibi=None, gain=1.0, sim=False):
    """alibi: None, "head" or "batch"; gain multiplies q and k (scores large enough for the softcap); sim: the
    numba simulator runs it (fp32)."""
    parts = [f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else ""), f"{n_q}x{n_k}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}-x{gain:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    case = dict(
        shape=(b, h, h_k, n_q, n_k, d), causal=causal, window=window, softcap=softcap, alibi=alibi, gain=gain, sim=sim
    )
    return pytest.param(case, id="-".join(parts))


CASES = [
    # causal GQA, as gpt-oss's full layers (64 query heads on 8 key/value heads there)
    _case(2, 4, 2, 17, 29, 16, causal=True, sim=True),
    # seqlen_q > seqlen_k, causal: the first 18 rows see no key (O = 0, L = sink)
    _case(1, 2, 2, 37, 19, 16, causal=True),
    # gpt-oss's sliding layers: a causal window, 128 tokens there, 8 here against 40 keys
    _case(1, 2, 1, 40, 40, 32, causal=True, window=(8, 0), sim=True),
    # no mask, unequal lengths, softcap on large scores
    _case(1, 2, 2, 17, 29, 16, softcap=5.0, gain=4.0),
    # everything at once: GQA, a causal window, softcap, ALiBi per (batch, head)
    _case(2, 4, 2, 33, 47, 16, causal=True, window=(9, 0), softcap=8.0, gain=3.0, alibi="batch"),
    # several key and query tiles in every backend; a wider window, ALiBi per head
    _case(1, 4, 2, 130, 257, 64, causal=True, window=(64, 0), alibi="head"),
    _case(1, 2, 2, 203, 113, 128, window=(40, 40)),
]
GRAD_CASES = [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5]]


def _work(case):
    b, h, _, n_q, n_k, d = case["shape"]
    return (b, h, n_q, n_k, d)


def _simulated(backend, status, dtype, case, grad=False):
    """numba's simulator: the fp32 forward of the cases marked sim; the sink's backward in
    test_rows_that_see_no_key_get_the_sink and test_sink_varlen, on smaller shapes than these."""
    why = "the sink's backward on the smaller shapes of two other tests" if grad else "the fp32 cases marked sim"
    simulated_subset(backend, status, case["sim"] and dtype == torch.float32 and not grad, why)


# Cases whose kernels the others run, or whose code is the shared interface's, which numba's simulator leaves
# to the GPU (it runs each kernel path once: the sink's epilogue, its dsink, varlen, a split KV cache).
SHARED_CODE = "the kernels' sink cases; this one adds only interface code over kernels they run"


def make_sink(heads, device, seed=0):
    """A sink per head spread around the scores' logsumexp (log of a few keys' weight), so that it takes from
    a tenth to most of a row's mass: large enough that a kernel which drops it, or adds it twice, fails."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(heads, generator=g) * 4.0 - 0.5).to(device)


def _inputs(case, dtype, device, seed):
    b, h, h_k, n_q, n_k, d = case["shape"]
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=seed)
    q, k = q * case["gain"], k * case["gain"]
    slopes = None
    if case["alibi"] is not None:
        g = torch.Generator().manual_seed(seed + 1)
        slopes = (torch.rand((h,) if case["alibi"] == "head" else (b, h), generator=g) * 0.3).to(device)
    options = dict(window=case["window"], softcap=case["softcap"], alibi_slopes=slopes, sink=make_sink(h, device, seed))
    return q, k, v, options


def _refusal_is_a_skip(fn, *args, **kwargs):
    """fn(*args, **kwargs), with a backend's documented refusal (NotImplementedError) turned into a skip."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.skip(f"the backend refuses: {e}")


def dsink_tolerance(q, k, v, dO, causal, sink, **features):
    """(the fp64 reference's dsink, its tolerance): test_gradients' rule for dq, dk, dv applied to the sink's
    gradient: fp32 a fixed bound, fp16/bf16 three times a same-precision naive attention's error plus twice
    the reference's rounding to the dtype (dsink comes from O, which is rounded to it)."""
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    sink64 = sink.detach().double().requires_grad_()
    O64 = reference.attention(q64, k64, v64, causal, sink=sink64, **features)[0]
    (ref,) = torch.autograd.grad(O64, sink64, dO.double())
    if q.dtype == torch.float32:
        return ref, FP32_GRAD_ATOL * max(1.0, ref.abs().max().item())
    sink_l = sink.detach().clone().requires_grad_()
    O_naive = reference.attention(q.detach(), k.detach(), v.detach(), causal, upcast=False, sink=sink_l, **features)[0]
    (naive,) = torch.autograd.grad(O_naive, sink_l, dO)
    return ref, 3 * max_err(naive, ref) + 2 * max_err(ref.to(q.dtype), ref)


def assert_dsink_matches(dsink, q, k, v, dO, causal, sink, **features):
    assert dsink.shape == sink.shape and dsink.dtype == sink.dtype, f"dsink: {tuple(dsink.shape)} {dsink.dtype}"
    assert not torch.isnan(dsink).any(), "NaN in dsink"
    ref, tol = dsink_tolerance(q, k, v, dO, causal, sink, **features)
    err = max_err(dsink, ref)
    assert err <= tol, f"max |dsink - ref| = {err:.3g} > tolerance {tol:.3g} ({q.dtype})"


# --- fa2.attention ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_forward_matches_reference(backend, status, device, dtype, case):
    require_runnable(backend, status, device, dtype, _work(case))
    _simulated(backend, status, dtype, case)
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["shape"]))
    O, L = _refusal_is_a_skip(lambda: fa2.attention(q, k, v, causal=case["causal"], backend=backend, **options))
    assert_matches_reference(O, L, q, k, v, case["causal"], **options)


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_gradients_match_reference(backend, status, device, dtype, case):
    """dq, dk, dv (as without a sink, through the sink-including L) and dsink, against fp64 autograd."""
    require_runnable(backend, status, device, dtype, _work(case))
    _simulated(backend, status, dtype, case, grad=True)
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["shape"]) + 5)
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, options.pop("sink")))
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    O, _ = _refusal_is_a_skip(
        lambda: fa2.attention(q, k, v, causal=case["causal"], sink=sink, backend=backend, **options)
    )
    dq, dk, dv, dsink = grads(O, (q, k, v, sink), dO)
    assert_grads_match(dq, dk, dv, q, k, v, dO, case["causal"], sink=sink.detach(), **options)
    assert_dsink_matches(dsink, q, k, v, dO, case["causal"], sink, **options)


def test_rows_that_see_no_key_get_the_sink(backend, status, device):
    """Causal with seqlen_q > seqlen_k, and a window that misses every key: those rows get O = 0 and
    L = sink[h] (not +inf), and give no gradient to q nor to the sink (their O is 0, so is rowsum(dO ∘ O)).
    GQA: each query head's own sink, two query heads on a key/value head."""
    # test_numba_cuda_sinks checks O = 0, L = sink on rows that see no key, forward and backward (12 s here)
    simulated_subset(backend, status, False, "its own no-key sink tests (test_numba_cuda_sinks.py)")
    require_runnable(backend, status, device, torch.float32, (1, 4, 24, 8, 16))
    q, k, v = (t.requires_grad_() for t in random_qkv((1, 4, 24, 16), (1, 2, 8, 16), torch.float32, device, seed=3))
    sink = make_sink(4, device, seed=3).requires_grad_()
    # Nq - Nk = 16. Causal: rows 0..15 see no key. Window (2, 1): query i sees [i - 18, i - 15], rows 0..14 none.
    for causal, window, blind in [(True, (-1, -1), 16), (False, (2, 1), 15)]:
        O, L = _refusal_is_a_skip(fa2.attention, q, k, v, causal=causal, window=window, sink=sink, backend=backend)
        assert (O[:, :, :blind] == 0).all(), "rows that see no key must have O = 0"
        torch.testing.assert_close(L[:, :, :blind], sink.detach()[:, None].expand(1, 4, blind), rtol=1e-6, atol=1e-6)
        assert_matches_reference(O.detach(), L, q.detach(), k.detach(), v.detach(), causal, window=window, sink=sink)
        dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(4)).to(device)
        dq, _, _, dsink = grads(O, (q, k, v, sink), dO)
        assert (dq[:, :, :blind] == 0).all(), "rows that see no key must get dq = 0"
        assert_dsink_matches(dsink, q, k, v, dO, causal, sink, window=window)


def test_a_sink_of_minus_inf_gives_no_key_rows_nan(backend, status, device):
    """The documented limit of a non-finite sink: with sink[h] = -inf (no sink for head h), a row of h that sees
    no key gets O = NaN (as the fp64 reference) and L = NaN; its other rows are those of attention without a
    sink, and the other head's rows are untouched."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 5, 3, 16))
    q, k, v = random_qkv((1, 2, 5, 16), (1, 2, 3, 16), torch.float32, device, seed=5)
    sink = torch.tensor([float("-inf"), 0.5], device=device)
    O, L = _refusal_is_a_skip(fa2.attention, q, k, v, causal=True, sink=sink, backend=backend)
    assert O[0, 0, :2].isnan().all() and L[0, 0, :2].isnan().all(), "rows 0 and 1 see no key"
    O_plain, L_plain = fa2.attention(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(O[0, 0, 2:], O_plain[0, 0, 2:])
    torch.testing.assert_close(L[0, 0, 2:], L_plain[0, 0, 2:])
    assert (O[0, 1, :2] == 0).all() and not O[0, 1].isnan().any()


def test_sink_backward_is_deterministic(backend, status, device):
    """Two backward passes give bit-identical dq, dk, dv and dsink (no atomics in the sink's sum)."""
    require_runnable(backend, status, device, torch.float32, (2, 4, 33, 47, 16))
    emulated_subset(backend, status, False, "no determinism case (an emulator's order of work is not a GPU's)")
    q, k, v = (t.requires_grad_() for t in random_qkv((2, 4, 33, 16), (2, 2, 47, 16), torch.float32, device, seed=5))
    sink = make_sink(4, device, seed=5).requires_grad_()
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device)
    runs = []
    for _ in range(2):
        O, _ = _refusal_is_a_skip(lambda: fa2.attention(q, k, v, causal=True, sink=sink, backend=backend))
        runs.append(grads(O, (q, k, v, sink), dO))
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), *runs):
        assert torch.equal(a, b), f"{name} differs between two runs"


def test_flash_attention2_apply_takes_the_sink(backend, status, device):
    """FlashAttention2.apply(q, k, v, is_causal, scale, return_lse, spec, sink): the sink is an autograd
    input whose .grad backward() fills; without it the call is the CS336 one, unchanged."""
    require_runnable(backend, status, device, torch.float32, (3, 1, 17, 29, 32))
    simulated_subset(backend, status, False, SHARED_CODE)
    q, k, v = (t.requires_grad_() for t in random_qkv((3, 2, 17, 32), (3, 2, 29, 32), torch.float32, device))
    sink = make_sink(2, device, seed=1).requires_grad_()
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device)
    apply = registry.load(backend).FlashAttention2.apply
    O = _refusal_is_a_skip(lambda: apply(q, k, v, True, None, False, None, sink))
    O.backward(dO)
    assert_grads_match(q.grad, k.grad, v.grad, q, k, v, dO, True, sink=sink.detach())
    assert_dsink_matches(sink.grad, q, k, v, dO, True, sink)


def test_compiled_sink_gradients_are_eagers(backend, status, device):
    """torch.compile: the sink rides in the backend's custom ops as a tensor input, and its gradient comes
    back through the backward op, bit-identical to eager."""
    require_runnable(backend, status, device, torch.float32, (2, 4, 17, 29, 16))
    emulated_subset(backend, status, False, SHARED_CODE)
    q, k, v = (t.requires_grad_() for t in random_qkv((2, 4, 17, 16), (2, 2, 29, 16), torch.float32, device, seed=6))
    sink = make_sink(4, device, seed=6).requires_grad_()

    def fn(q, k, v, sink):
        return fa2.attention(q, k, v, causal=True, sink=sink, backend=backend).O

    O_eager = _refusal_is_a_skip(lambda: fn(q, k, v, sink))
    dO = torch.randn(O_eager.shape, generator=torch.Generator().manual_seed(6)).to(device)
    expected = grads(O_eager, (q, k, v, sink), dO)
    torch._dynamo.reset()
    O = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, sink)
    assert torch.equal(O, O_eager)
    for name, g, e in zip(("dq", "dk", "dv", "dsink"), grads(O, (q, k, v, sink), dO), expected):
        assert torch.equal(g, e), f"{name} compiled != eager"


# --- packed batches and KV caches ---------------------------------------------------------------------------


# A sequence with no key (its rows: O = 0, L = sink), one query, Nq != Nk both ways; GQA, a causal window.
VARLEN_LENS = ([5, 3, 1, 9], [5, 0, 4, 6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_varlen(backend, status, device, dtype):
    """Every sequence's rows take the sink, each sequence against its own reference; the gradients of the
    whole batch, dsink summed over every sequence, against the fp64 reference's (test_varlen's rule)."""
    lens_q, lens_k = VARLEN_LENS
    require_runnable(backend, status, device, dtype, (1, 4, sum(lens_q), max(lens_k), 16))
    # fa2-numba-cuda's own test_numba_cuda_sinks runs its packed forward and backward with a sink
    simulated_subset(backend, status, False, "its own varlen sink tests (test_numba_cuda_sinks.py)")
    q, k, v = random_qkv((sum(lens_q), 4, 16), (sum(lens_k), 2, 16), dtype, device, seed=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = make_sink(4, device, seed=8).requires_grad_()
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    options = dict(causal=True, window=(3, 0))
    O, L = _refusal_is_a_skip(
        lambda: fa2.varlen_attention(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink, backend=backend, **options
        ),
    )
    starts_q, starts_k = offsets(lens_q, "cpu").tolist(), offsets(lens_k, "cpu").tolist()
    for s in range(len(lens_q)):
        rows, keys = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        t = [x.detach()[i].transpose(0, 1) for x, i in zip((O, q, k, v), (rows, rows, keys, keys))]
        assert_matches_reference(t[0], L[:, rows], *t[1:], sink=sink.detach(), **options)

    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(device=device, dtype=dtype)
    got = grads(O, (q, k, v, sink), dO)

    def reference_grads(upcast):
        x = [t.detach().double() if upcast else t.detach() for t in (q, k, v, sink)]
        x = [t.requires_grad_() for t in x]
        O_ref, _ = reference.varlen_attention(*x[:3], cu_q, cu_k, upcast=upcast, sink=x[3], **options)
        return torch.autograd.grad(O_ref, x, dO.double() if upcast else dO)

    ref = reference_grads(True)
    if dtype == torch.float32:
        tols = [FP32_GRAD_ATOL] * 4
    else:
        naive = reference_grads(False)
        tols = [3 * max_err(n, r) + 2 * max_err(r.to(dtype), r) for n, r in zip(naive, ref)]
    for name, g, r, tol in zip(("dq", "dk", "dv", "dsink"), got, ref, tols):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g} ({dtype})"


KV_CASES = [
    # one token, GQA, a row with no key (O = 0, L = sink) and one at full capacity; three splits: the sink
    # must be counted once, not once per split
    _kv_case(q=1, b=3, h=4, hk=2, cap=40, seqlens=(40, 0, 17), splits=3),
    # paged (16-row pages), a few tokens, a causal window, the backend's split count
    _kv_case(q=4, b=2, h=4, hk=2, cap=64, seqlens=(64, 23), page=16, window=(8, 0), splits=0),
    # packed queries with a block table, softcap; a sequence of 0 keys
    _kv_case(varlen=(1, 4, 3), b=3, h=2, hk=1, cap=48, seqlens=(10, 48, 0), page=16, softcap=5.0, splits=2),
]


@pytest.mark.parametrize("case", KV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_kvcache(backend, status, device, dtype, case):
    forward = _kvcache_forward(backend)
    require_runnable(backend, status, device, dtype, (case["b"], case["h"], 4, case["cap"], case["d"]))
    simulated_subset(backend, status, dtype == torch.float32 and case == KV_CASES[0].values[0], "the first case, fp32")
    q, k_cache, v_cache, spec = _make(case, False, dtype, device, seed=sum(case["seqlens"]))
    spec = dataclasses.replace(spec, sink=make_sink(case["h"], device, seed=9))
    O, L = _refusal_is_a_skip(lambda: forward(q, k_cache, v_cache, spec))
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


def test_kvcache_attention_takes_the_sink(backend, status, device):
    """fa2.kvcache_attention's sink= reaches the kernels, after the append of the new keys."""
    _kvcache_forward(backend)
    require_runnable(backend, status, device, torch.float32, (2, 4, 2, 24, 16))
    simulated_subset(backend, status, False, SHARED_CODE)
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 4, 2, 16, generator=g).to(device)
    k_cache, v_cache = (torch.randn(2, 2, 24, 16, generator=g).to(device) for _ in range(2))
    k_new, v_new = (torch.randn(2, 2, 2, 16, generator=g).to(device) for _ in range(2))
    lens = torch.tensor([0, 13], dtype=torch.int32, device=device)
    sink = make_sink(4, device, seed=10)
    O, L = _refusal_is_a_skip(
        lambda: fa2.kvcache_attention(
            q, k_cache, v_cache, lens, k=k_new, v=v_new, causal=True, sink=sink, num_splits=2, backend=backend
        ),
    )
    spec = make_spec(q, k_cache, True, None, sink=sink, cache_seqlens=lens + 2)
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


# --- fa2.flash_attn's learnable_sink ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sink_dtype", [pytest.param(torch.float32, id="sink-fp32"), pytest.param(torch.bfloat16, id="sink-bf16")]
)
def test_flash_attn_learnable_sink(backend, status, device, sink_dtype):
    """flash-attn 4's learnable_sink in flash_attn_func and flash_attn_varlen_func: out and softmax_lse as
    fa2.attention's sink gives them, and its gradient through autograd in its own dtype."""
    require_runnable(backend, status, device, torch.float32, (2, 4, 17, 29, 16))
    simulated_subset(backend, status, False, SHARED_CODE)
    q, k, v = (t.requires_grad_() for t in random_qkv((2, 17, 4, 16), (2, 29, 2, 16), torch.float32, device, seed=11))
    sink = make_sink(4, device, seed=11).to(sink_dtype).requires_grad_()
    out, lse, _ = _refusal_is_a_skip(
        lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink, backend=backend),
    )
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    assert_matches_reference(out.transpose(1, 2), lse, qt, kt, vt, True, sink=sink.detach().float())
    dO = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(device)
    dq, dk, dv, dsink = grads(out, (q, k, v, sink), dO)
    assert dsink.dtype == sink_dtype
    dOt = dO.transpose(1, 2)
    assert_grads_match(*(g.transpose(1, 2) for g in (dq, dk, dv)), qt, kt, vt, dOt, True, sink=sink.detach().float())
    ref, tol = dsink_tolerance(qt, kt, vt, dOt, True, sink.detach().float())
    rounding = 2 * max_err(ref.to(sink_dtype), ref)
    assert max_err(dsink, ref) <= tol + rounding, f"max |dsink - ref| = {max_err(dsink, ref):.3g}"

    # The packed batch of the same rows: two sequences of the batch's 17 queries and 29 keys each.
    cu_q, cu_k = offsets([17, 17], device), offsets([29, 29], device)
    out_p = flash_attn_varlen_func(
        q.detach().flatten(0, 1),
        k.detach().flatten(0, 1),
        v.detach().flatten(0, 1),
        cu_q,
        cu_k,
        17,
        29,
        causal=True,
        learnable_sink=sink.detach(),
        backend=backend,
    )
    torch.testing.assert_close(out_p, out.detach().flatten(0, 1), rtol=0, atol=1e-5)


# --- fa2.combine ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_counts_the_sink_once(backend, status, device, dtype):
    """Three key ranges attended WITHOUT the sink, merged with it: attention with the sink over all the keys
    (a sink in each range's L would count it three times)."""
    require_runnable(backend, status, device, dtype, (1, 4, 9, 40, 16))
    simulated_subset(backend, status, False, SHARED_CODE)
    q, k, v = random_qkv((1, 4, 9, 16), (1, 4, 40, 16), dtype, device, seed=12)
    sink = make_sink(4, device, seed=12)
    ranges = ((0, 13), (13, 35), (35, 40))
    parts = [_refusal_is_a_skip(fa2.attention, q, k[..., a:b, :], v[..., a:b, :], backend=backend) for a, b in ranges]
    O, L = fa2.combine(torch.stack([p.O for p in parts]), torch.stack([p.L for p in parts]), sink=sink)
    assert_matches_reference(O, L, q, k, v, False, sink=sink)


def test_combine_without_a_key_gives_the_sink():
    """A row that sees no key in any range: O = 0 and L = sink[h]."""
    O = torch.randn(2, 1, 3, 4, 8)
    L = torch.full((2, 1, 3, 4), float("inf"))
    sink = torch.tensor([0.5, -1.0, 2.0])
    out, lse = fa2.combine(O, L, sink=sink)
    assert (out == 0).all()
    assert torch.equal(lse, sink[None, :, None].expand(1, 3, 4))


# --- bad input ------------------------------------------------------------------------------------------------

BAD_SINKS = [
    pytest.param(lambda: torch.zeros(3), ValueError, r"sink must have shape \(heads,\) = \(4,\)", id="wrong-heads"),
    pytest.param(lambda: torch.zeros(1, 4), ValueError, r"sink must have shape", id="wrong-rank"),
    pytest.param(lambda: torch.zeros(4, dtype=torch.float64), TypeError, "sink must be float32", id="fp64"),
    pytest.param(lambda: torch.zeros(4, dtype=torch.bfloat16), TypeError, "sink must be float32", id="bf16"),
    pytest.param(lambda: torch.zeros(4, dtype=torch.int32), TypeError, "sink must be float32", id="int32"),
    pytest.param(lambda: [0.0] * 4, TypeError, "sink must be a float32 torch.Tensor", id="list"),
    pytest.param(lambda: torch.zeros(4, device="meta"), ValueError, "sink must be on q's device", id="device"),
]


@pytest.mark.parametrize("make, error, match", BAD_SINKS)
def test_bad_sink_is_refused(make, error, match):
    q = torch.randn(2, 4, 5, 16)
    with pytest.raises(error, match=match):
        fa2.attention(q, q, q, sink=make(), backend="pytorch")
    packed = q[0].transpose(0, 1)  # (5, 4, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(error, match=match):
        fa2.varlen_attention(packed, packed, packed, cu, cu, 3, 3, sink=make(), backend="pytorch")
    with pytest.raises(error, match=match):
        fa2.kvcache_attention(q, q, q, 5, sink=make(), backend="pytorch")


def test_sink_needs_a_heads_dim():
    q = torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"sink needs q with a heads dim \(rank >= 3\), got q \(5, 16\)"):
        fa2.attention(q, q, q, sink=torch.zeros(5), backend="pytorch")


@pytest.mark.parametrize(
    "sink, error, match",
    [
        pytest.param(torch.zeros(3), FlashAttnValueError, r"learnable_sink must have shape", id="wrong-heads"),
        pytest.param(torch.zeros(4, dtype=torch.float64), FlashAttnTypeError, "learnable_sink must be", id="fp64"),
        pytest.param(torch.zeros(4, device="meta"), FlashAttnValueError, "learnable_sink must be on", id="device"),
    ],
)
def test_bad_learnable_sink_is_refused(sink, error, match):
    q = torch.randn(2, 5, 4, 16)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, learnable_sink=sink, backend="pytorch")


def test_combine_refuses_a_bad_sink():
    O, L = torch.zeros(2, 1, 3, 4, 8), torch.zeros(2, 1, 3, 4)
    with pytest.raises(ValueError, match=r"sink must have shape \(heads,\), L's dim -2"):
        fa2.combine(O, L, sink=torch.zeros(4))
    with pytest.raises(TypeError, match="sink must be a floating-point tensor"):
        fa2.combine(O, L, sink=torch.zeros(3, dtype=torch.int64))
