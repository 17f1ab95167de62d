"""Decode shapes through fa2.attention and fa2.varlen_attention (issue 39): few queries against many keys run
by the backend's split-KV KV-cache kernels on the GPU backends (``fa2.api.DECODE_BACKENDS``), when no
gradient is wanted and outside torch.compile.

The routed calls are checked against the fp64 reference by the suite's rule (checks.assert_matches_reference),
each with a spy on the backend's kvcache_forward that proves the KV-cache kernels ran and the dense forward
did not: one query and a few, MHA, GQA and MQA, causal, a two-sided window, softcap, ALiBi per head and per
(batch, head), a rank-3 input, exactly at the shape rule's edge; packed batches whose sequences have 0 queries
or 0 keys. Where the call must stay on the dense kernels (a gradient wanted, a shape that is not decode-like,
fa2-pytorch, torch.compile), stubs record which path ran, without running a kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fa2
from checks import assert_matches_reference, offsets
from fa2 import api, kvcache, registry
from test_conformance import DTYPES, require_runnable, simulated_subset

MAX_Q, PER_QUERY = api.DECODE_MAX_SEQLEN_Q, api.DECODE_MIN_KEYS_PER_QUERY
MEASURED_MIN_KEYS = dict(api.DECODE_MIN_KEYS)


@pytest.fixture(autouse=True)
def _no_minimum_keys(monkeypatch):
    """The route's results do not depend on the shape: the tests take it on shapes small enough for the CPU
    emulators, below the backends' measured DECODE_MIN_KEYS (test_the_measured_thresholds checks those)."""
    monkeypatch.setattr(api, "DECODE_MIN_KEYS", {name: 0 for name in MEASURED_MIN_KEYS})


@pytest.mark.parametrize(
    "backend_name, nq, nk, routes",
    [
        pytest.param("triton", 1, 256, True, id="triton-1x256"),
        pytest.param("triton", 16, 255, False, id="triton-16x255"),
        pytest.param("numba-cuda", 1, 4096, True, id="numba-cuda-1x4096"),
        pytest.param("numba-cuda", 4, 1024, False, id="numba-cuda-4x1024"),
    ],
)
def test_the_measured_thresholds(monkeypatch, backend_name, nq, nk, routes):
    """The H200's break-even points (docs/benchmarks/h200-decode-routing.md): fa2-triton's KV-cache kernels
    from 256 keys, fa2-numba-cuda's from 4096."""
    monkeypatch.setattr(api, "DECODE_MIN_KEYS", MEASURED_MIN_KEYS)
    q, k = torch.empty(1, 4, nq, 16), torch.empty(1, 2, nk, 16)
    assert api.decodes(backend_name, q, k, api.make_spec(q, k, True, None)) == routes


def _dense(b, h, hk, nq, nk, d=16, causal=False, window=(-1, -1), softcap=0.0, alibi=None, rank=4):
    parts = [f"B{b}-H{h}.{hk}-{nq}x{nk}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    parts += [f"rank{rank}"] if rank != 4 else []
    case = dict(b=b, h=h, hk=hk, nq=nq, nk=nk, d=d, causal=causal, window=window, softcap=softcap, alibi=alibi)
    return pytest.param(dict(case, rank=rank), id="-".join(parts))


DENSE = [
    # one token (a generate step), GQA
    _dense(2, 4, 2, 1, 40),
    # speculative decoding: a few causal tokens, MQA, a two-sided window (causal makes it (9, 0)) and softcap
    _dense(2, 4, 1, 4, 40, causal=True, window=(9, 2), softcap=5.0),
    # the rule's edge, seqlen_q = 16 against 8 · 16 keys: ALiBi per (batch, head), causal
    _dense(2, 1, 1, MAX_Q, PER_QUERY * MAX_Q, causal=True, alibi="row"),
    # (heads, seqlen, head_dim) inputs, ALiBi per head
    _dense(1, 4, 2, 2, 33, alibi="head", rank=3),
]


def _packed(lens_q, lens_k, h, hk, d=16, causal=False, window=(-1, -1), softcap=0.0, alibi=None):
    parts = [f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}-H{h}.{hk}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    case = dict(lens_q=lens_q, lens_k=lens_k, h=h, hk=hk, d=d, causal=causal, window=window, softcap=softcap)
    return pytest.param(dict(case, alibi=alibi), id="-".join(parts))


PACKED = [
    # a sequence with 0 queries, one with 2 queries and 0 keys (O = 0, L = +inf), causal, GQA
    _packed((1, 3, 0, 2), (20, 33, 9, 0), 4, 2, causal=True),
    # a window with softcap and ALiBi per sequence, MQA
    _packed((4, 1), (40, 37), 2, 1, window=(5, 1), softcap=4.0, alibi="seq"),
]


class _Spy:
    """Replaces a backend's kvcache_forward (counting its calls, then running it) and its flash_attn_forward
    (which must not run) for one test."""

    def __init__(self, monkeypatch, backend):
        impl = registry.load(backend)
        self.calls = 0
        real = impl.kvcache_forward

        def kvcache_forward(*args):
            self.calls += 1
            return real(*args)

        def flash_attn_forward(*args):
            raise AssertionError("a decode shape ran the dense forward")

        monkeypatch.setattr(impl, "kvcache_forward", kvcache_forward)
        monkeypatch.setattr(impl, "flash_attn_forward", flash_attn_forward)


def _routed(backend):
    if backend not in api.DECODE_BACKENDS:
        pytest.skip(f"{backend} keeps its dense path on decode shapes (fa2.api.DECODE_BACKENDS)")


def _keep_simulated(backend, status, dtype, first: bool):
    # The simulator runs the tensor-core KV-cache kernel (fp16) on every case and the SIMT one (fp32) on the
    # first: the routing's index math is the same for both.
    simulated_subset(backend, status, dtype == torch.float16 or first, "fp16 and the first case's fp32")


@pytest.mark.parametrize("case", DENSE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_shapes_run_by_the_kvcache_kernels_match_the_reference(
    backend, status, device, dtype, case, monkeypatch
):
    _routed(backend)
    _keep_simulated(backend, status, dtype, case is DENSE[0].values[0])
    b, h, hk, nq, nk, d = (case[n] for n in ("b", "h", "hk", "nq", "nk", "d"))
    require_runnable(backend, status, device, dtype, (b, h, nq, nk, d))
    g = torch.Generator().manual_seed(nq * nk)

    def make(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    # (batch, seqlen, heads, head_dim) tensors seen as (batch, heads, seqlen, head_dim): not contiguous.
    q, k, v = (make(b, n, heads, d).transpose(1, 2) for n, heads in ((nq, h), (nk, hk), (nk, hk)))
    if case["rank"] == 3:
        q, k, v = q[0], k[0], v[0]
    slopes = {"head": lambda: torch.rand(h, generator=g), "row": lambda: torch.rand(b, h, generator=g)}
    options = dict(window=case["window"], softcap=case["softcap"])
    options["alibi_slopes"] = None if case["alibi"] is None else (slopes[case["alibi"]]() * 0.3).to(device)
    spy = _Spy(monkeypatch, backend)
    O, L = fa2.attention(q, k, v, causal=case["causal"], backend=backend, **options)
    assert spy.calls == 1, f"kvcache_forward ran {spy.calls} times, want once"
    assert_matches_reference(O, L, q, k, v, case["causal"], **options)


@pytest.mark.parametrize("case", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_decode_shapes_run_by_the_kvcache_kernels_match_the_reference(
    backend, status, device, dtype, case, monkeypatch
):
    _routed(backend)
    _keep_simulated(backend, status, dtype, case is PACKED[0].values[0])
    lens_q, lens_k, h, hk, d = (case[n] for n in ("lens_q", "lens_k", "h", "hk", "d"))
    require_runnable(backend, status, device, dtype, (1, h, sum(lens_q), max(lens_k), d))
    g = torch.Generator().manual_seed(sum(lens_k))

    def make(n, heads):
        return torch.randn(n, heads, d, generator=g).to(device=device, dtype=dtype)

    q, k, v = make(sum(lens_q), h), make(sum(lens_k), hk), make(sum(lens_k), hk)
    slopes = None if case["alibi"] is None else (torch.rand(len(lens_q), h, generator=g) * 0.3).to(device)
    cu_q, cu_k = offsets(lens_q, device), offsets(lens_k, device)
    options = dict(window=case["window"], softcap=case["softcap"])
    spy = _Spy(monkeypatch, backend)
    O, L = fa2.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        causal=case["causal"],
        alibi_slopes=slopes,
        backend=backend,
        **options,
    )
    assert spy.calls == 1, f"kvcache_forward ran {spy.calls} times, want once"
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(lens_q)):
        rows, keys = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        own = dict(options, alibi_slopes=None if slopes is None else slopes[s])
        t = [x.transpose(0, 1) for x in (O[rows], q[rows], k[keys], v[keys])]
        assert_matches_reference(t[0], L[:, rows], t[1], t[2], t[3], case["causal"], **own)


class _Paths:
    """Stubs for a backend's three forward paths, recording which one a call took (no kernel runs)."""

    def __init__(self, monkeypatch, backend):
        impl = registry.load(backend)
        self.taken = []
        paths = self

        def outputs(name, q):
            paths.taken.append(name)
            return torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[:-1])

        class FlashAttention2:
            @staticmethod
            def apply(q, *args):
                return outputs("dense autograd", q)

        monkeypatch.setattr(impl, "flash_attn_forward", lambda q, *args: outputs("dense", q))
        monkeypatch.setattr(impl, "kvcache_forward", lambda q, *args: outputs("kvcache", q))
        monkeypatch.setattr(impl, "FlashAttention2", FlashAttention2)


# (id, seqlen_q, seqlen_k, q requires grad, whether it routes on a DECODE_BACKENDS backend)
DENSE_PATHS = [
    pytest.param(1, PER_QUERY, False, True, id="1x8-routed"),
    pytest.param(MAX_Q, PER_QUERY * MAX_Q, False, True, id="16x128-routed"),
    pytest.param(1, 4096, True, False, id="1x4096-grad"),
    pytest.param(MAX_Q + 1, 4096, False, False, id="17x4096-too-many-queries"),
    pytest.param(4, PER_QUERY * 4 - 1, False, False, id="4x31-too-few-keys"),
    pytest.param(0, 64, False, False, id="0x64-no-query"),
]


@pytest.mark.parametrize("nq, nk, grad, routes", DENSE_PATHS)
def test_which_path_a_dense_call_takes(backend, nq, nk, grad, routes, monkeypatch):
    """The KV-cache kernels for decode shapes on the GPU backends without a gradient; the dense forward for
    every other call, the dense autograd function when q requires grad."""
    paths = _Paths(monkeypatch, backend)
    q, k = torch.randn(2, 4, nq, 16, requires_grad=grad), torch.randn(2, 2, nk, 16)
    fa2.attention(q, k, k, causal=True, backend=backend)
    want = "dense autograd" if grad else "kvcache" if routes and backend in api.DECODE_BACKENDS else "dense"
    assert paths.taken == [want]


@pytest.mark.parametrize(
    "lens_q, lens_k, routes",
    [
        pytest.param((1, 3, 0), (24, 9, 2), True, id="q1.3.0-k24.9.2-routed"),
        pytest.param((17, 1), (400, 9), False, id="q17.1-k400.9-too-many-queries"),
    ],
)
def test_which_path_a_packed_call_takes(backend, lens_q, lens_k, routes, monkeypatch):
    """The packed rule reads max_seqlen_q and max_seqlen_k: 3 queries against 24 keys route, 17 do not."""
    paths = _Paths(monkeypatch, backend)
    q, k = torch.randn(sum(lens_q), 4, 16), torch.randn(sum(lens_k), 2, 16)
    fa2.varlen_attention(
        q, k, k, offsets(lens_q, "cpu"), offsets(lens_k, "cpu"), max(lens_q), max(lens_k), backend=backend
    )
    assert paths.taken == ["kvcache" if routes and backend in api.DECODE_BACKENDS else "dense"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_shapes_with_a_sink_match_the_reference(backend, status, device, dtype, monkeypatch):
    """An attention sink rides along: the KV-cache kernels add it (once, in the merge, when split), GQA 4/2,
    causal, 2 queries against 37 keys, one row's queries seeing no key past a window (O = 0, L = sink)."""
    _routed(backend)
    simulated_subset(backend, status, dtype == torch.float16, "fp16 (the tensor-core KV-cache kernel)")
    require_runnable(backend, status, device, dtype, (2, 4, 2, 37, 16))
    g = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(2, heads, n, 16, generator=g).to(device, dtype) for heads, n in ((4, 2), (2, 37), (2, 37)))
    sink = torch.randn(4, generator=g).to(device)
    spy = _Spy(monkeypatch, backend)
    O, L = fa2.attention(q, k, v, causal=True, sink=sink, backend=backend)
    assert spy.calls == 1, f"kvcache_forward ran {spy.calls} times, want once"
    assert_matches_reference(O, L, q, k, v, True, sink=sink)


def test_torch_compile_keeps_the_dense_op(backend, status, device, monkeypatch):
    """Under torch.compile (fullgraph) a decode shape runs the backend's dense custom op (fa2.ops), the same
    op for every seqlen_k: kvcache_forward would specialise the graph on it."""
    simulated_subset(backend, status, False, "none of it: the compiled path is the same for every backend")
    require_runnable(backend, status, device, torch.float32, (1, 2, 1, 16, 16))

    def kvcache_forward(*args):
        raise AssertionError("a compiled call ran kvcache_forward")

    monkeypatch.setattr(registry.load(backend), "kvcache_forward", kvcache_forward)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: fa2.attention(q, k, v, backend=backend), backend="eager", fullgraph=True)
    for nk in (PER_QUERY, 2 * PER_QUERY):
        q, k, v = (torch.randn(1, 2, n, 16, device=device) for n in (1, nk, nk))
        O, L = step(q, k, v)
        assert_matches_reference(O, L, q, k, v, False)


def test_key_counts_are_kept_per_stream_and_shape(device):
    """The routed dense call's cache_seqlens (``fa2.kvcache._key_counts``): one (batch,) int32 tensor of
    seqlen_k per (device, stream, batch, seqlen_k), shared by the calls that ask again; another shape, or
    another stream, its own; under a CUDA-graph capture a new one each call, none kept."""
    kvcache._KEY_COUNTS.clear()
    counts = kvcache._key_counts(3, 257, torch.device(device))
    assert counts.dtype == torch.int32 and counts.tolist() == [257] * 3
    assert kvcache._key_counts(3, 257, torch.device(device)) is counts
    assert kvcache._key_counts(3, 258, torch.device(device)) is not counts
    assert kvcache._key_counts(2, 257, torch.device(device)).tolist() == [257] * 2
    if device != "cuda":
        return
    with torch.cuda.stream(torch.cuda.Stream()):
        other = kvcache._key_counts(3, 257, torch.device(device))
    assert other is not counts and other.tolist() == [257] * 3
    kept = dict(kvcache._KEY_COUNTS)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = [kvcache._key_counts(3, 257, torch.device(device)) for _ in range(2)]
    graph.replay()
    torch.cuda.synchronize()
    assert captured[0] is not captured[1] and kvcache._KEY_COUNTS == kept
    assert captured[0].tolist() == [257] * 3


def test_spec_replace_is_dataclasses_replace():
    """``AttentionSpec.replace`` (the decode route's, without dataclasses.replace's host time) gives what
    dataclasses.replace gives, and refuses a field the spec does not have."""
    spec = api.make_spec(torch.empty(1, 4, 1, 16), torch.empty(1, 2, 8, 16), True, 0.5, softcap=2.0)
    seqlens = torch.full((1,), 8, dtype=torch.int32)
    got = spec.replace(cache_seqlens=seqlens, cache_leftpad=None)
    assert got == dataclasses.replace(spec, cache_seqlens=seqlens, cache_leftpad=None) and got.cache_seqlens is seqlens
    assert spec.cache_seqlens is None and got.causal and got.softcap == 2.0
    with pytest.raises(TypeError, match=r"AttentionSpec has no field \['seqlens'\]"):
        spec.replace(seqlens=seqlens)
