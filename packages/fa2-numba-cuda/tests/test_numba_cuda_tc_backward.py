"""fa2-numba-cuda's tensor-core backward (``fa2_numba_cuda.backward_tc``): the kernels chosen, their gradients.

``fa2_numba_cuda.backward.flash_attn_backward`` runs the tensor-core kernels for fp16 and bf16 with head_dim
<= 128, dense or packed (varlen), with any window (causal included), softcap, ALiBi and sink, on compute
capability 8.0+ or under numba's simulator (``mma.py``'s emulated instructions), and the SIMT kernels for
fp32 and head_dim > 128, chosen by the inputs alone. Each case here checks that the kernels it expects were
the ones called and built, and the gradients against the fp64 reference with the suite's FlashAttention-2 rule
(``test_gradients.assert_grads_match``; packed batches as shared_tests/test_varlen.py applies it, to the
whole batch); outputs start as NaN (conftest's ``poison_empty``). O and L come from the fp64 reference (O
rounded to the dtype), so that only the backward is under test. Tiny shapes: the simulator is slow. With
--device cuda the same cases run the real instructions on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from checks import heads_first, max_err, offsets, packed_grad_tolerances, random_qkv
from fa2 import reference
from fa2.spec import AttentionSpec
from fa2_numba_cuda import backward, backward_simt, backward_tc, backward_wgmma, common, tensor_cores
from test_gradients import assert_grads_match


@pytest.fixture
def calls(monkeypatch):
    """Which of backward_tc's and backward_simt's flash_attn_backward ``backward`` called, in order."""
    made = []
    for module, name in ((backward_tc, "tc"), (backward_simt, "simt")):
        real = module.flash_attn_backward

        def spy(*args, _real=real, _name=name, **kwargs):
            made.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "flash_attn_backward", spy)
    return made


# 16-query dK/dV tiles and 16-key dQ tiles: several tiles, and tiles skipped, at shapes the simulator runs
# quickly (the default tiles at head dims up to 64 are 64 queries and 32 keys).
SMALL_TILES = ("small-tiles", backward_tc.TensorCoreBwdConfig(4, 16, 4, 16, 0, True))
# The same with K (dK/dV) and Q, dO (dQ) read from shared memory for each product, not held in registers.
SHARED_OPERANDS = ("shared-operands", backward_tc.TensorCoreBwdConfig(4, 16, 4, 16, 0, True, True, True))
# Tiles past the 48 KB a block may have without raising its limit: at D128 139,264 B (dK/dV: 128 keys, 8
# warps, 64-query tiles) and 104,448 B (dQ: 64 rows against 64-key tiles), in dynamic shared memory.
LARGE_TILES = ("large-tiles", backward_tc.TensorCoreBwdConfig(8, 64, 4, 64, 0, True, True, True))


def _case(
    dtype,
    b,
    h,
    h_k,
    n_q,
    n_k,
    d,
    causal,
    window=(-1, -1),
    scale=None,
    layout="contiguous",
    tiles=None,
    softcap=0.0,
    alibi=False,
):
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    parts = [
        kind,
        f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else ""),
        f"{n_q}x{n_k}-D{d}",
        "causal" if causal else "full",
    ]
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"scale{scale}"] if scale is not None else []
    parts += [f"softcap{softcap:g}"] if softcap else []
    parts += ["alibi"] if alibi else []
    parts += [layout] if layout != "contiguous" else []
    parts += [tiles[0]] if tiles is not None else []
    case = dict(
        shape=(b, h, h_k, n_q, n_k, d),
        causal=causal,
        window=window,
        scale=scale,
        layout=layout,
        config=tiles[1] if tiles is not None else None,
        softcap=softcap,
        alibi=alibi,
    )
    return pytest.param(dtype, case, id="-".join(parts))


CASES = [
    case
    for dtype in (torch.float16, torch.bfloat16)
    for causal in (False, True)
    for case in (
        # GQA (group 2), seqlen_q != seqlen_k, neither a multiple of a tile: the dK/dV kernel's steps over the
        # group's heads (one 64-query tile each), two 32-key tiles in the dQ kernel
        _case(dtype, 1, 2, 1, 21, 36, 64, causal),
        # seqlen_q > seqlen_k (causal rows that see no key: zero dq), head_dim padded 40 -> 48
        _case(dtype, 1, 1, 1, 45, 29, 40, causal),
        # head_dim 128: the GPU's largest block
        _case(dtype, 1, 1, 1, 17, 20, 128, causal),
    )
] + [
    # two dK/dV blocks (64 keys each), three 32-key dQ tiles; with small tiles, causal tiles skipped in both
    # kernels and several query tiles a head in the dK/dV kernel
    _case(torch.float16, 1, 2, 1, 37, 70, 16, True),
    _case(torch.float16, 1, 2, 1, 37, 70, 16, True, tiles=SMALL_TILES),
    _case(torch.float16, 1, 2, 1, 37, 70, 16, True, tiles=SHARED_OPERANDS),
    # a window with both edges inside the keys: tiles skipped on both sides, edge tiles masked
    _case(torch.float16, 1, 1, 1, 37, 53, 16, False, window=(5, 3), tiles=SMALL_TILES),
    # head_dim 128 with tiles over 48 KB of shared memory (on the GPU: the raised limit, the launch's size)
    _case(torch.bfloat16, 1, 1, 1, 17, 20, 128, True, tiles=LARGE_TILES),
    # odd head_dim (outputs stored element by element; rows not 16 B apart: plain loads), a negative scale
    _case(torch.float16, 1, 2, 2, 21, 30, 13, True, scale=-0.7),
    # q as (B, N, H, D) memory (cp.async with strides), k with a head_dim stride of 2 (plain loads)
    _case(torch.bfloat16, 1, 2, 1, 19, 24, 32, True, layout="strided"),
]

# Softcap and ALiBi, fp16 and bf16. A softcap of 2 saturates the larger scores
# (1 - tanh² well below 1); the slopes are per (batch, head).
SCORE_CASES = [
    case
    for dtype in (torch.float16, torch.bfloat16)
    for case in (
        # GQA over several query tiles a head, causal tiles skipped and masked, in both kernels
        _case(dtype, 1, 2, 1, 37, 45, 16, True, tiles=SMALL_TILES, softcap=2.0),
        # two batches' slopes, a window with both edges inside the keys
        _case(dtype, 2, 2, 1, 21, 30, 16, False, window=(5, 3), tiles=SMALL_TILES, alibi=True),
        # both, causal with a left edge, the default tiles (64-query dK/dV tiles, 32-key dQ tiles)
        _case(dtype, 1, 2, 1, 29, 40, 16, True, window=(9, 0), softcap=2.0, alibi=True),
    )
]


def _inputs(dtype, case, device):
    b, h, h_k, n_q, n_k, d = case["shape"]
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=n_q + n_k + d)
    if case["layout"] == "strided":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = torch.stack([k, torch.zeros_like(k)], dim=-1).flatten(-2)[..., ::2]
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(d)).to(device=device, dtype=dtype)
    return q, k, v, dO


@pytest.fixture(autouse=True)
def mma_sync_backward(monkeypatch):
    """These tests are backward_tc's: on a Hopper GPU the default dispatch would run backward_wgmma's kernels on
    dense fp16 and bf16 inputs at head_dim 64 and 128, so its switch is off here."""
    monkeypatch.setattr(backward_wgmma, "ENABLED", False)


def _forward(q, k, v, causal, window, scale, **features):
    """O (in q's dtype) and L (fp32) from the fp64 reference; ``features``: softcap, alibi_slopes."""
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), causal, scale, window=window, **features)
    return O64.to(q.dtype), L64.float()


# bf16 differs from fp16 in its conversions only: the simulator runs bf16 on the cases that name more than
# dtype, mask and shape (D40's padding, the large tiles, the strided layout), fp16 on all.
SIMULATED_BF16 = {"B1-H1-45x29-D40"}


@pytest.mark.parametrize("dtype, case", CASES + SCORE_CASES)
def test_tensor_core_backward_matches_reference(tc_device, calls, dtype, case):
    b, h, h_k, n_q, n_k, d = case["shape"]
    softcap, alibi = case["softcap"], case["alibi"]
    plain = case["config"] is None and case["layout"] == "contiguous"
    if common.simulated() and dtype == torch.bfloat16:
        if softcap or alibi:
            pytest.skip("the simulator runs softcap and ALiBi in fp16 (bf16 differs in its conversions only)")
        if plain and f"B{b}-H{h}-{n_q}x{n_k}-D{d}" not in SIMULATED_BF16:
            pytest.skip("the simulator runs this case in fp16 (bf16 on D40, the large tiles and the strided layout)")
    causal, window, scale = case["causal"], case["window"], case["scale"]
    q, k, v, dO = _inputs(dtype, case, tc_device)
    slopes = torch.rand(b, h, generator=torch.Generator().manual_seed(n_q)).to(tc_device) if alibi else None
    features = dict(softcap=softcap, alibi_slopes=slopes) if softcap or alibi else {}
    O, L = _forward(q, k, v, causal, window, scale, **features)
    spec_window = (window[0], 0) if causal else window
    spec = AttentionSpec(d**-0.5 if scale is None else scale, spec_window, softcap, slopes, h // h_k)
    dq, dk, dv = backward.flash_attn_backward(q, k, v, O, L, dO, spec, case["config"])
    assert calls == ["tc"], f"expected the tensor-core backward alone, got {calls}"
    HEAD_DIM = tensor_cores.padded_head_dim(d)
    # Keys: (name, HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, ...).
    built = {(key[0], key[1], key[5], key[6]) for key in backward_tc._KERNELS}
    expected = {("dkdv", HEAD_DIM, softcap > 0, alibi), ("dq", HEAD_DIM, softcap > 0, alibi)}
    assert expected <= built, f"tensor-core kernels built: {sorted(built)}"
    if scale is not None:
        features["scale"] = scale
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal, window=window, **features)


@pytest.mark.parametrize(
    "dtype, d, expected",
    [
        pytest.param(torch.float16, 16, "tc", id="fp16-D16-tc"),
        pytest.param(torch.bfloat16, 128, "tc", id="bf16-D128-tc"),
        pytest.param(torch.float32, 16, "simt", id="fp32-simt"),
        pytest.param(torch.float16, 160, "simt", id="fp16-D160-simt"),
    ],
)
def test_dispatch_by_dtype_and_head_dim(tc_device, dtype, d, expected):
    """backward_tc.uses_tensor_cores: dtype and head_dim alone decide (no launch), whatever the spec: the
    softcap, ALiBi and packed-batch tests below check that those 16-bit inputs reach the tensor cores."""
    q = torch.zeros(1, 2, 4, d, dtype=dtype, device=tc_device)
    assert backward_tc.uses_tensor_cores(q) == (expected == "tc")


@pytest.mark.parametrize(
    "asked, expected",
    [pytest.param(None, "tc", id="automatic-tensor-cores"), pytest.param(False, "simt", id="asked-simt")],
)
def test_softcap_alibi_take_tensor_cores_unasked(tc_device, calls, asked, expected):
    """Softcap and ALiBi: the automatic choice sends fp16 to the tensor-core kernels (built with SOFTCAP and
    ALIBI), never to the SIMT backward; tensor_cores=False to the SIMT one; both match the reference."""
    dtype = torch.float16
    q, k, v = random_qkv((1, 1, 17, 16), (1, 1, 29, 16), dtype, tc_device, seed=5)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device=tc_device, dtype=dtype)
    slopes = torch.full((1, 1), 0.3, device=tc_device)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), True, softcap=5.0, alibi_slopes=slopes)
    spec = AttentionSpec(0.25, (-1, 0), 5.0, slopes, 1)
    built = set(backward_tc._KERNELS)
    dq, dk, dv = backward.flash_attn_backward(q, k, v, O64.to(dtype), L64.float(), dO, spec, tensor_cores=asked)
    assert calls == [expected], f"expected the {expected} backward alone, got {calls}"
    if expected == "tc":
        new = {(key[0], key[5], key[6]) for key in set(backward_tc._KERNELS) - built}
        assert new <= {("dkdv", True, True), ("dq", True, True)}, f"tensor-core kernels built: {sorted(new)}"
        assert any(key[:1] + key[5:7] == ("dq", True, True) for key in backward_tc._KERNELS)
    assert_grads_match(dq, dk, dv, q, k, v, dO, True, softcap=5.0, alibi_slopes=slopes)


# One warp a block in both kernels: 16 keys (dK/dV) and 16 query rows (dQ) a tile, so that sequences of 5 to
# 40 tokens make several tiles, and the shorter sequences' tiles past their end exit.
ONE_WARP = ("one-warp", backward_tc.TensorCoreBwdConfig(1, 16, 1, 16, 0, True))


def _varlen_case(dtype, lens_q, lens_k, h, h_k, causal=False, window=(-1, -1), softcap=0.0, alibi=False, tiles=None):
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    parts = [kind, f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}", f"H{h}-Hk{h_k}-D16"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"softcap{softcap:g}"] if softcap else []
    parts += ["alibi"] if alibi else []
    parts += [tiles[0]] if tiles is not None else []
    case = dict(
        lens_q=lens_q,
        lens_k=lens_k,
        h=h,
        h_k=h_k,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi=alibi,
        config=tiles[1] if tiles is not None else None,
    )
    return pytest.param(dtype, case, id="-".join(parts))


# Packed batches of three sequences, GQA 2:1, D16.
VARLEN_CASES = [
    case
    for dtype in (torch.float16, torch.bfloat16)
    for case in (
        # causal; a sequence without keys (its rows: zero dq), one shorter than a tile, Nq != Nk both ways; key
        # and query tiles of the shorter sequences past their end exit
        _varlen_case(dtype, [5, 23, 12], [9, 0, 30], 2, 1, causal=True, tiles=ONE_WARP),
        # a window with both edges inside the keys, softcap and ALiBi per (sequence, head); the default tiles
        # (64-query dK/dV tiles, 32-key dQ tiles): one tile a sequence
        _varlen_case(dtype, [17, 6, 29], [24, 11, 40], 2, 1, window=(5, 3), softcap=2.0, alibi=True),
    )
]


def _assert_packed_grads_match(got, q, k, v, dO, cu_q, cu_k, causal, **options):
    """The kernels' dq, dk, dv ((1, heads, total, head_dim)) of the whole packed batch against the fp64
    reference's, by test_varlen's rule: three times a same-precision naive attention's error plus twice the
    reference's rounding to the dtype, over the batch."""
    ref, tols = packed_grad_tolerances(q, k, v, dO, cu_q, cu_k, causal, **options)
    for name, x, r, tol in zip(("dq", "dk", "dv"), got, ref, tols):
        x = x[0].transpose(0, 1)
        assert not torch.isnan(x).any(), f"NaN in {name}"
        assert max_err(x, r) <= tol, f"max |{name} - ref| = {max_err(x, r):.3g} > tolerance {tol:.3g} ({q.dtype})"


@pytest.mark.parametrize("dtype, case", VARLEN_CASES)
def test_tensor_core_backward_matches_reference_on_packed_batches(tc_device, calls, dtype, case):
    """dq, dk, dv of the whole packed batch against the fp64 reference's (``reference.varlen_attention``); a
    sequence without keys gets dq = 0."""
    if common.simulated() and dtype == torch.bfloat16:
        pytest.skip("the simulator runs packed batches in fp16 (bf16 differs in its conversions only)")
    lens_q, lens_k, h, h_k = case["lens_q"], case["lens_k"], case["h"], case["h_k"]
    causal, window = case["causal"], case["window"]
    g = torch.Generator().manual_seed(sum(lens_q))
    q, k, v, dO = (
        torch.randn(sum(n), heads, 16, generator=g).to(device=tc_device, dtype=dtype)
        for n, heads in ((lens_q, h), (lens_k, h_k), (lens_k, h_k), (lens_q, h))
    )
    slopes = (torch.rand(len(lens_q), h, generator=g) * 0.3).to(tc_device) if case["alibi"] else None
    options = dict(window=window, softcap=case["softcap"], alibi_slopes=slopes)
    cu_q, cu_k = offsets(lens_q, tc_device), offsets(lens_k, tc_device)
    O64, L64 = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, **options)
    spec = AttentionSpec(
        16**-0.5,
        (window[0], 0) if causal else window,
        case["softcap"],
        slopes,
        h // h_k,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
    )
    got = backward.flash_attn_backward(
        *(heads_first(t) for t in (q, k, v, O64.to(dtype))),
        L64.float()[None],
        heads_first(dO),
        spec,
        case["config"],
        tensor_cores=True,
    )
    assert calls == ["tc"], f"expected the tensor-core backward alone, got {calls}"
    # Keys: (name, HEAD_DIM, config, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, ...).
    built = {(key[0], key[7]) for key in backward_tc._KERNELS}
    assert {("dkdv", True), ("dq", True)} <= built, f"tensor-core kernels built: {sorted(built)}"
    _assert_packed_grads_match(got, q, k, v, dO, cu_q, cu_k, causal, **options)
    if 0 in lens_k:
        s = lens_k.index(0)
        assert (got[0][0, :, cu_q[s] : cu_q[s + 1]] == 0).all(), "rows of a sequence without keys: dq = 0"


@pytest.mark.parametrize(
    "asked, expected",
    [pytest.param(None, "tc", id="automatic-tensor-cores"), pytest.param(False, "simt", id="asked-simt")],
)
def test_packed_batches_take_tensor_cores_unasked(tc_device, calls, asked, expected):
    """A packed batch: the automatic choice sends fp16 to the tensor-core kernels (built with VARLEN), one
    launch each for every sequence, never to the SIMT backward; tensor_cores=False to the SIMT one; both
    match the reference."""
    dtype = torch.float16
    lens_q, lens_k = [3, 9], [6, 4]
    cu_q, cu_k = offsets(lens_q, tc_device), offsets(lens_k, tc_device)
    g = torch.Generator().manual_seed(8)
    q, k, v, dO = (
        torch.randn(n, 1, 16, generator=g).to(device=tc_device, dtype=dtype)
        for n in (sum(lens_q), sum(lens_k), sum(lens_k), sum(lens_q))
    )
    O64, L64 = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, True)
    spec = AttentionSpec(0.25, (-1, 0), 0.0, None, 1, cu_q, cu_k, 9, 6)
    built = set(backward_tc._KERNELS)
    got = backward.flash_attn_backward(
        *(heads_first(t) for t in (q, k, v, O64.to(dtype))),
        L64.float()[None],
        heads_first(dO),
        spec,
        tensor_cores=asked,
    )
    assert calls == [expected], f"expected the {expected} backward alone, got {calls}"
    if expected == "tc":
        new = {(key[0], key[7]) for key in set(backward_tc._KERNELS) - built}
        assert new <= {("dkdv", True), ("dq", True)}, f"tensor-core kernels built: {sorted(new)}"
        assert any(key[0] == "dq" and key[7] for key in backward_tc._KERNELS)
    _assert_packed_grads_match(got, q, k, v, dO, cu_q, cu_k, True, scale=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, d, causal, layout, config, softcap",
    [
        pytest.param(torch.bfloat16, 128, True, "contiguous", None, 0.0, id="bf16-D128-causal-cp.async"),
        pytest.param(torch.bfloat16, 128, False, "contiguous", LARGE_TILES[1], 0.0, id="bf16-D128-full-large-tiles"),
        pytest.param(torch.float16, 40, False, "strided", None, 0.0, id="fp16-D40-full-plain-loads"),
        # softcap and ALiBi: the slopes are a varying tensor of the class, as q, k, v
        pytest.param(torch.bfloat16, 64, True, "contiguous", None, 5.0, id="bf16-D64-causal-softcap-alibi"),
    ],
)
def test_prepared_launch_equals_numbas_bit_for_bit(device, monkeypatch, dtype, d, causal, layout, config, softcap):
    """On the GPU: a class's second call takes the prepared launches (``launch.prepare`` not called again)
    and gives the gradients of numba's own launches bit for bit (no atomics: deterministic), tiles over
    48 KB of shared memory included (the prepared launch passes their dynamic size); the kernels keep local
    memory (spills) at most 64 B a thread. With ALiBi the class's first call takes other slopes than the
    second: the prepared launch must read the second call's."""
    if device.type != "cuda":
        pytest.skip("prepared launches are the GPU's (the simulator launches through numba); --device cuda")
    q, k, v, dO = _inputs(dtype, dict(shape=(2, 4, 2, 300, 333, d), layout=layout), device)
    window = (-1, 0) if causal else (-1, -1)
    slopes, first_slopes = (
        (torch.rand(2, 4, generator=torch.Generator().manual_seed(s)).to(device) for s in (1, 2))
        if softcap
        else (None, None)
    )
    features = dict(softcap=softcap, alibi_slopes=slopes) if softcap else {}
    O, L = _forward(q, k, v, causal, (-1, -1), None, **features)
    spec = AttentionSpec(d**-0.5, window, softcap, slopes, 2)
    monkeypatch.setattr(backward_tc.launch, "FAST", False)
    expected = backward.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    monkeypatch.setattr(backward_tc.launch, "FAST", True)
    real = backward_tc.launch.prepare
    sizes = []  # the dynamic shared memory each prepared launch asks for

    def recording(*a):
        sizes.append(a[6] if len(a) > 6 else 0)
        return real(*a)

    monkeypatch.setattr(backward_tc.launch, "prepare", recording)
    # A class's first call: numba's, then prepared.
    first = spec if slopes is None else AttentionSpec(d**-0.5, window, softcap, first_slopes, 2)
    backward.flash_attn_backward(q, k, v, O, L, dO, first, config)
    prepares = []
    monkeypatch.setattr(backward_tc.launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    got = backward.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    assert not prepares, "the second call of a class must take the prepared launches"
    torch.cuda.synchronize()
    for name, x, ref in zip(("dq", "dk", "dv"), got, expected):
        assert torch.equal(x, ref), f"{name}: max |fast - numba| = {(x.float() - ref.float()).abs().max():.3g}"
    assert_grads_match(*got, q, k, v, dO, causal, **features)
    if config is not None:
        assert max(sizes) > 48 * 1024, f"the large tiles' launches asked for {sizes} B of dynamic shared memory"
    rows = [r for r in backward_tc.kernel_resources() if r["HEAD_DIM"] == tensor_cores.padded_head_dim(d)]
    assert rows and all(r["local_bytes_per_thread"] <= 64 for r in rows), f"local memory: {rows}"


@pytest.mark.gpu
def test_prepared_varlen_launch_equals_numbas_bit_for_bit(device, monkeypatch):
    """On the GPU, a packed batch with a sink: a class's second call takes the
    prepared launches and gives numba's launches' dq, dk, dv and dsink bit for bit. The class's first call
    takes other offsets (the same count and longest lengths): the prepared launches must read the second
    call's cu_seqlens_q and cu_seqlens_k, and their sink and slopes."""
    if device.type != "cuda":
        pytest.skip("prepared launches are the GPU's (the simulator launches through numba); --device cuda")
    dtype, d, h, h_k = torch.bfloat16, 64, 4, 2
    lens, first_lens = [300, 77, 512], [512, 300, 77]
    cu, first_cu = offsets(lens, device), offsets(first_lens, device)
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (
        torch.randn(sum(lens), heads, d, generator=g).to(device=device, dtype=dtype) for heads in (h, h_k, h_k, h)
    )
    slopes = torch.rand(len(lens), h, generator=g).to(device)
    sink = torch.randn(h, generator=g).to(device)
    options = dict(window=(-1, -1), softcap=5.0, alibi_slopes=slopes, sink=sink)
    O64, L64 = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, True, **options)

    def spec(offsets, slopes):
        return AttentionSpec(d**-0.5, (-1, 0), 5.0, slopes, h // h_k, offsets, offsets, 512, 512, sink=sink)

    args = (*(heads_first(t) for t in (q, k, v, O64.to(dtype))), L64.float()[None], heads_first(dO))
    monkeypatch.setattr(backward_tc.launch, "FAST", False)
    expected = backward.flash_attn_backward(*args, spec(cu, slopes))
    monkeypatch.setattr(backward_tc.launch, "FAST", True)
    backward.flash_attn_backward(*args, spec(first_cu, torch.rand_like(slopes)))
    prepares = []
    real = backward_tc.launch.prepare
    monkeypatch.setattr(backward_tc.launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    got = backward.flash_attn_backward(*args, spec(cu, slopes))
    assert not prepares, "the second call of a class must take the prepared launches"
    torch.cuda.synchronize()
    for name, x, ref in zip(("dq", "dk", "dv", "dsink"), got, expected):
        assert torch.equal(x, ref), f"{name}: max |fast - numba| = {(x.float() - ref.float()).abs().max():.3g}"
    _assert_packed_grads_match(got[:3], q, k, v, dO, cu, cu, True, **options)


def test_d128_tiles_fall_back_where_the_device_allows_less_shared_memory():
    """D128's default tiles need 140,288 B a block; a device that allows less (sm_86 and sm_89: 99 KB) gets
    the tiles that fit 48 KB, and head dims whose tiles fit keep them."""
    big = backward_tc.TC_BWD_CONFIGS[128]
    assert max(backward_tc.shared_bytes(n, 128, big) for n in ("dkdv", "dq")) > 99 * 1024
    assert backward_tc.tc_bwd_config(128) == big
    assert backward_tc.tc_bwd_config(128, 227 * 1024) == big
    small = backward_tc.tc_bwd_config(128, 99 * 1024)
    assert small == backward_tc.TC_BWD_CONFIGS_48KB[128]
    assert max(backward_tc.shared_bytes(n, 128, small) for n in ("dkdv", "dq")) <= 48 * 1024
    assert backward_tc.tc_bwd_config(64, 99 * 1024) == backward_tc.TC_BWD_CONFIGS[64]
