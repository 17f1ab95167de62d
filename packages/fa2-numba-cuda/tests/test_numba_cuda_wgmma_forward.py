"""fa2-numba-cuda's forward on Hopper's wgmma (``fa2_numba_cuda.forward_wgmma``), on unless FA2_NUMBA_WGMMA=0.

- the kernel against the fp64 reference (``checks.assert_matches_reference``, outputs NaN-poisoned by the suite's
  conftest), on numba's simulator (``wgmma.py``'s and ``mma.py``'s emulations, fp16, head_dim 64, a few tiles) or,
  with --device cuda, on a GPU of compute capability 9.0 (fp16 and bf16, head_dim 64 and 128): whole tiles,
  ragged seqlen_q and seqlen_k, seqlen_q below and above seqlen_k under causal (rows that see no key), GQA;
- softcap, ALiBi, windows, packed batches and sinks (the kernel's LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK): O
  and L against the reference on the simulator (4 cases: softcap and ALiBi GQA causal D64; a (left, right)
  window with seqlen_q != seqlen_k and ALiBi; a packed batch of three sequences, one empty, causal with a left
  bound, ALiBi per sequence and a sink; D128 with a softcap and a sink), and on the GPU (bf16) also against
  forward_tc's;
- ``refusal``/``takes`` refusing what the kernel does not compute, ``uses_wgmma`` off without the switch or a
  Hopper GPU, and ``fa2_numba_cuda.forward`` running it only where ``uses_wgmma`` holds (``ENABLED``
  monkeypatched); the features taken by it only where ``FEATURES`` names them (its environment variable read at
  import; on the GPU, the dispatch with it off and on, the prepared launches).

The simulator checks the index math against the ISA's tables as ``wgmma.py`` reads them, and the ordering of
cp.async, the wgmma waits and the fences as its emulation models them (not the async proxy); only the GPU run
shows the hardware agrees. On the GPU: pytest --device cuda with NUMBA_ENABLE_CUDASIM unset.
"""

from __future__ import annotations

import pytest
import torch

import fa2
from checks import (
    assert_matches_reference,
    build_group,
    heads_first,
    max_err,
    offsets,
    random_qkv,
    tolerances,
    values_at_import,
)
from fa2.spec import AttentionSpec
from fa2_numba_cuda import common, forward, forward_tc, forward_wgmma, launch, tensor_cores

SIMULATED = common.simulated()


@pytest.fixture
def wgmma_device(kernel_device):
    """Where the kernel runs: the simulator on the CPU, or a GPU of compute capability 9.0 (sm_90a)."""
    if kernel_device.type == "cuda" and tensor_cores.capability(kernel_device) != forward_wgmma.COMPUTE_CAPABILITY:
        pytest.skip(f"wgmma needs compute capability 9.0, got {tensor_cores.capability(kernel_device)}")
    return kernel_device


def _spec(q, k, causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return AttentionSpec(scale, (-1, 0) if causal else (-1, -1), group=q.shape[1] // k.shape[1])


def _case(dtype, b, h, h_k, n_q, n_k, d, causal, config=None):
    """config: None (``wgmma_config``'s) or a ``WgmmaConfig``. The cases of one build share an xdist group, so that
    under ``--dist loadgroup`` one worker compiles its kernel (10-40 s on the GPU) for all its shapes."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    build = f"{kind}-D{d}" + ("-causal" if causal else "-full")
    if config is not None:
        build += f"-N{config.BLOCK_N}" + ("-ahead" if config.S_AHEAD else "")
        build += f"-maxreg{config.MAX_REGISTERS}" if config.MAX_REGISTERS else ""
        build += f"-stages{config.STAGES}" if config.STAGES != 2 else ""
        build += "-overlap" if config.OVERLAP_PV else ""
    name = f"{kind}-B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else "") + f"-{n_q}x{n_k}-{build.removeprefix(kind + '-')}"
    group = pytest.mark.xdist_group(f"wgmma-fwd-{build}")
    return pytest.param(dtype, (b, h, h_k, n_q, n_k, d), causal, config, id=name, marks=group)


def _cases(dtype, shapes, config=None, masks=(False, True)):
    return [_case(dtype, *shape, causal, config) for shape in shapes for causal in masks]


# (B, H, H_k, seqlen_q, seqlen_k, D). The simulator's: a few 64-key tiles and 128-row blocks (a few seconds each).
SIM_SHAPES = [
    (1, 1, 1, 128, 128, 64),  # whole tiles: one block, two key tiles
    (1, 1, 1, 150, 200, 64),  # ragged: two blocks, the last rows and keys past the tiles' ends
    (2, 2, 1, 40, 100, 64),  # GQA, two batches
    (1, 1, 1, 70, 90, 128),  # head_dim 128 (S_AHEAD by default): Q, K and V tiles of two 64-column panels
]
GPU_SHAPES = [
    *[(1, 2, 2, 512, 512, d) for d in (64, 128)],
    *[(2, 4, 2, 1000, 1500, d) for d in (64, 128)],
    *[(1, 4, 1, 1500, 700, d) for d in (64, 128)],
    *[(3, 2, 2, 129, 1, d) for d in (64, 128)],
]
# Causal only: what they add is where the diagonal falls (without a mask they are ragged tiles as above).
SIM_CAUSAL_SHAPES = [
    (1, 1, 1, 70, 150, 64),  # seqlen_q < seqlen_k: the diagonal inside the third key tile
    (1, 1, 1, 150, 60, 64),  # seqlen_q > seqlen_k: the first 90 rows see no key
]
AHEAD, PLAIN = forward_wgmma.WgmmaConfig(64, True), forward_wgmma.WgmmaConfig(64, False)
# The short key loop's configurations: two blocks an SM by registers, a three-stage K/V ring, both.
CAPPED = forward_wgmma.WgmmaConfig(64, MAX_REGISTERS=128)
THREE = forward_wgmma.WgmmaConfig(64, STAGES=3)
CAPPED_THREE = forward_wgmma.WgmmaConfig(64, MAX_REGISTERS=128, STAGES=3)
OVERLAP = forward_wgmma.WgmmaConfig(64, STAGES=3, OVERLAP_PV=True)  # P V of a tile during the next one's softmax
OVERLAP_FOUR = forward_wgmma.WgmmaConfig(64, STAGES=4, OVERLAP_PV=True)
if SIMULATED:
    KERNEL_CASES = [
        *_cases(torch.float16, SIM_SHAPES),
        *_cases(torch.float16, SIM_CAUSAL_SHAPES, masks=(True,)),
        # S_AHEAD at head_dim 64: one key tile, four (causal: one to four a block), a block that sees none
        _case(torch.float16, 1, 1, 1, 70, 60, 64, False, AHEAD),
        *_cases(torch.float16, [(1, 1, 1, 150, 200, 64)], AHEAD),
        _case(torch.float16, 1, 1, 1, 150, 60, 64, True, AHEAD),
        _case(torch.float16, 1, 1, 1, 70, 90, 128, True, PLAIN),
        _case(torch.float16, 1, 1, 1, 150, 300, 64, True, forward_wgmma.WgmmaConfig(128)),  # the probe's 128 keys
        # Three stages (off by default, measured slower): one key tile (the prologue's second group empty), four
        # (the ring wraps), a block that sees none, head_dim 128. The register cap is not a case of its own here:
        # the simulator ignores it (the default at head_dim 128 is capped).
        _case(torch.float16, 1, 1, 1, 70, 60, 64, False, THREE),
        _case(torch.float16, 1, 1, 1, 70, 250, 64, False, THREE),
        _case(torch.float16, 1, 1, 1, 150, 60, 64, True, THREE),
        _case(torch.float16, 1, 1, 1, 70, 90, 128, True, CAPPED_THREE),
        # OVERLAP_PV (off by default, measured slower): one key tile (only the P V after the loop), four (the ring
        # wraps), none, head_dim 128; four stages.
        _case(torch.float16, 1, 1, 1, 70, 60, 64, True, OVERLAP),
        _case(torch.float16, 1, 1, 1, 70, 250, 64, False, OVERLAP),
        _case(torch.float16, 1, 1, 1, 150, 60, 64, True, OVERLAP),
        _case(torch.float16, 1, 1, 1, 70, 90, 128, True, OVERLAP),
        _case(torch.float16, 1, 1, 1, 70, 250, 64, True, OVERLAP_FOUR),
    ]
else:
    KERNEL_CASES = [
        *_cases(torch.float16, GPU_SHAPES),
        *_cases(torch.bfloat16, GPU_SHAPES),
        *_cases(torch.bfloat16, GPU_SHAPES, AHEAD),
        *_cases(torch.bfloat16, GPU_SHAPES, PLAIN),
        *_cases(torch.bfloat16, GPU_SHAPES[2:4], forward_wgmma.WgmmaConfig(128)),
        *[
            case
            for config in (CAPPED, THREE, CAPPED_THREE, OVERLAP, OVERLAP_FOUR)
            for case in _cases(torch.bfloat16, GPU_SHAPES, config)
        ],
        *[case for config in (CAPPED, THREE, OVERLAP) for case in _cases(torch.float16, GPU_SHAPES, config)],
    ]


@pytest.mark.parametrize("dtype, shape, causal, config", KERNEL_CASES)
def test_kernel_matches_reference(wgmma_device, dtype, shape, causal, config):
    b, h, h_k, n_q, n_k, d = shape
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, wgmma_device, seed=n_q + n_k + d)
    O, L = forward_wgmma.flash_attn_forward(q, k, v, _spec(q, k, causal), config)
    assert_matches_reference(O, L, q, k, v, causal)


# Softcap, ALiBi, windows, sinks on dense inputs: (B, H, H_k, seqlen_q, seqlen_k, D), window, softcap, ALiBi, sink.
if SIMULATED:
    FEATURE_CASES = [
        ((1, 2, 1, 100, 150, 64), (-1, 0), 2.0, True, False),  # softcap and ALiBi, GQA, causal
        # both bounds, seqlen_q < seqlen_k: blocks from their first row's left edge's tile (64, 192), each edge
        # masked where a warpgroup's rows cross it; ALiBi
        ((1, 1, 1, 150, 300, 64), (70, 20), 0.0, True, False),
        ((1, 1, 1, 70, 90, 128), (-1, -1), 2.0, False, True),  # D128: softcap and a sink
    ]
else:
    FEATURE_CASES = [
        (shape, window, softcap, alibi, sink)
        for shape in GPU_SHAPES[2:6]
        for window, softcap, alibi, sink in (
            ((-1, 0), 50.0, True, False),
            ((256, 64), 0.0, True, False),
            ((300, 0), 0.0, False, True),
            ((-1, 100), 50.0, False, False),
            ((-1, -1), 0.0, False, True),
        )
    ]


def _feature_id(shape, window, softcap, alibi, sink):
    b, h, h_k, n_q, n_k, d = shape
    name = f"B{b}-H{h}-Hk{h_k}-{n_q}x{n_k}-D{d}-w{window[0]}.{window[1]}"
    return name + (f"-softcap{softcap:g}" if softcap else "") + ("-alibi" if alibi else "") + ("-sink" if sink else "")


def _feature_group(d, window, softcap, alibi, sink, varlen=False):
    """The xdist group of a features case: its kernel's build, as ``_case``'s."""
    return build_group("wgmma-fwd", d, window, softcap=softcap, alibi=alibi, sink=sink, varlen=varlen)


def _feature_inputs(shape, alibi, sink, device):
    """Inputs in fp16 (the simulator) or bf16 (the GPU); ALiBi's slopes (B, H) up to 0.05 (small enough that keys
    a window's width away still weigh: a wrong window edge shows), sinks (H,) around the scores' size, one
    large."""
    b, h, h_k, n_q, n_k, d = shape
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=n_q + n_k + d)
    g = torch.Generator().manual_seed(n_q + d)
    slopes = (torch.rand(b, h, generator=g) * 0.05).to(device) if alibi else None
    sinks = None
    if sink:
        sinks = torch.randn(h, generator=g)
        sinks[-1] = 4.0
        sinks = sinks.to(device)
    return q, k, v, slopes, sinks


def _assert_matches_tc(O, L, O_tc, L_tc, q, k, v, scale, **features):
    """O and L against forward_tc's (O_tc, L_tc) for the same inputs, within the reference check's tolerance."""
    tol_O, tol_L = tolerances(q, k, v, False, scale, **features)
    finite = torch.isfinite(L_tc)
    assert torch.equal(finite, torch.isfinite(L)), "the same rows see no key"
    assert max_err(O, O_tc) <= tol_O, f"max |O - forward_tc's| = {max_err(O, O_tc):.3g} > {tol_O:.3g}"
    assert max_err(L[finite], L_tc[finite]) <= tol_L, f"max |L - forward_tc's| > {tol_L:.3g}"


@pytest.mark.parametrize(
    "shape, window, softcap, alibi, sink",
    [pytest.param(*c, id=_feature_id(*c), marks=_feature_group(c[0][-1], *c[1:])) for c in FEATURE_CASES],
)
def test_features_match_reference(wgmma_device, shape, window, softcap, alibi, sink):
    """O and L with a softcap, ALiBi, a window or a sink against the fp64 reference (on the GPU also against
    forward_tc's), the kernel built with the features' switches (a causal window stays CAUSAL)."""
    q, k, v, slopes, sinks = _feature_inputs(shape, alibi, sink, wgmma_device)
    scale = shape[-1] ** -0.5
    spec = AttentionSpec(scale, window, softcap, slopes, q.shape[1] // k.shape[1], sink=sinks)
    forward_wgmma._KERNELS.clear()
    O, L = forward_wgmma.flash_attn_forward(q, k, v, spec)
    causal = window == (-1, 0)
    want = (causal, not causal and window[0] != -1, not causal and window[1] != -1, softcap > 0, alibi, False, sink)
    assert [key[2:9] for key in forward_wgmma._KERNELS] == [want]
    features = dict(window=window, softcap=softcap, alibi_slopes=slopes, sink=sinks)
    assert_matches_reference(O, L, q, k, v, False, scale, **features)
    if not SIMULATED:
        _assert_matches_tc(O, L, *forward_tc.flash_attn_forward(q, k, v, spec), q, k, v, scale, **features)


# Packed batches: (lens_q, lens_k, H, H_k, D), window, softcap, ALiBi, sink.
if SIMULATED:
    VARLEN_CASES = [
        # three sequences, the second empty (its blocks exit), Nq != Nk both ways; causal with a left bound; ALiBi
        # per (sequence, head) and a sink; the third sequence's second block
        (([90, 0, 140], [100, 30, 150], 1, 1, 64), (80, 0), 0.0, True, True),
    ]
else:
    VARLEN_CASES = [
        ((lens_q, lens_k, 4, 2, d), window, softcap, alibi, sink)
        for lens_q, lens_k in (([300, 0, 1000, 77, 1], [500, 40, 1000, 0, 129]), ([2048, 129, 640], [2048, 129, 640]))
        for d in (64, 128)
        for window, softcap, alibi, sink in (
            ((-1, -1), 0.0, False, False),
            ((-1, 0), 50.0, True, True),
            ((256, 0), 0.0, False, False),
        )
    ]


def _varlen_id(lens, window, softcap, alibi, sink):
    lens_q, lens_k, h, h_k, d = lens
    name = f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}-H{h}-Hk{h_k}-D{d}-w{window[0]}.{window[1]}"
    return name + (f"-softcap{softcap:g}" if softcap else "") + ("-alibi" if alibi else "") + ("-sink" if sink else "")


def _packed_inputs(lens, alibi, sink, device):
    """q (1, H, total_q, D), k, v (1, H_k, total_k, D) as fa2.varlen_attention passes them, slopes (sequences,
    H), sinks (H,)."""
    lens_q, lens_k, h, h_k, d = lens
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    g = torch.Generator().manual_seed(sum(lens_q) + d)
    q, k, v = (
        heads_first(torch.randn(sum(n), heads, d, generator=g).to(device=device, dtype=dtype))
        for n, heads in ((lens_q, h), (lens_k, h_k), (lens_k, h_k))
    )
    slopes = (torch.rand(len(lens_q), h, generator=g) * 0.3).to(device) if alibi else None
    sinks = torch.randn(h, generator=g).to(device) if sink else None
    return q, k, v, slopes, sinks


@pytest.mark.parametrize(
    "lens, window, softcap, alibi, sink",
    [pytest.param(*c, id=_varlen_id(*c), marks=_feature_group(c[0][-1], *c[1:], varlen=True)) for c in VARLEN_CASES],
)
def test_packed_batches_match_reference(wgmma_device, lens, window, softcap, alibi, sink):
    """Each sequence's O and L ((1, H, total, D) and (1, H, total)) against the fp64 reference of that sequence
    alone (on the GPU the whole batch also against forward_tc's), the kernel built with VARLEN."""
    lens_q, lens_k, h, h_k, d = lens
    q, k, v, slopes, sinks = _packed_inputs(lens, alibi, sink, wgmma_device)
    cu_q, cu_k = offsets(lens_q, wgmma_device), offsets(lens_k, wgmma_device)
    spec = AttentionSpec(d**-0.5, window, softcap, slopes, h // h_k, cu_q, cu_k, max(lens_q), max(lens_k), sink=sinks)
    forward_wgmma._KERNELS.clear()
    O, L = forward_wgmma.flash_attn_forward(q, k, v, spec)
    assert [key[7] for key in forward_wgmma._KERNELS] == [True], "built with VARLEN"
    O_tc, L_tc = (None, None) if SIMULATED else forward_tc.flash_attn_forward(q, k, v, spec)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(lens_q)):
        rows, keys = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        own = None if slopes is None else slopes[s : s + 1]
        features = dict(window=window, softcap=softcap, alibi_slopes=own, sink=sinks)
        x = [t[:, :, rows] for t in (O, L, q)] + [t[:, :, keys] for t in (k, v)]
        assert_matches_reference(*x, False, d**-0.5, **features)
        if O_tc is not None:
            _assert_matches_tc(*x[:2], O_tc[:, :, rows], L_tc[:, :, rows], *x[2:], d**-0.5, **features)


def test_fa2_attention_runs_it_by_default_on_hopper(wgmma_device):
    """On a Hopper GPU fa2.attention's fp16/bf16 D64/D128 forward is this kernel's, switch untouched (on by
    default): its compiled kernel appears, its resources are reported (at most the cap's spill), and the output
    matches the reference."""
    if wgmma_device.type != "cuda":
        pytest.skip("the default dispatch needs a Hopper GPU (--device cuda)")
    q, k, v = random_qkv((2, 4, 300, 128), (2, 2, 333, 128), torch.bfloat16, wgmma_device, seed=7)
    forward_wgmma._KERNELS.clear()
    O, L = fa2.attention(q, k, v, causal=True, backend="numba-cuda")
    assert_matches_reference(O, L, q, k, v, True)
    assert [key[0] for key in forward_wgmma._KERNELS] == [128], "the wgmma kernel ran"
    rows = [r for r in forward.kernel_resources() if r.get("kernel") == "wgmma"]
    # At head_dim 128 the default caps registers at 128 (two blocks an SM): ptxas spills 80 B a thread there,
    # which the H200 measured faster than no spill at one block an SM (``wgmma_config``).
    assert rows and all(r["local_bytes_per_thread"] <= 96 for r in rows), rows


# --- what it takes, and when it runs ------------------------------------------------------------------


def _inputs(dtype=torch.float16, d=64, h=2, h_k=2, n_q=16, n_k=16):
    return random_qkv((1, h, n_q, d), (1, h_k, n_k, d), dtype, "cpu")


def test_takes_dense_16_bit_head_dim_64_and_128():
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            q, k, v = _inputs(dtype, d, h=4, h_k=2)
            for causal in (False, True):
                assert forward_wgmma.takes(q, k, v, _spec(q, k, causal)), (dtype, d, causal)


def test_takes_softcap_alibi_windows_packed_batches_and_sinks():
    """Each feature and all at once, on dense inputs and on a packed batch ((1, heads, total, head_dim), its
    offsets in the spec)."""
    q, k, v = _inputs(h=4, h_k=2, n_q=24, n_k=40)
    spec = _spec(q, k, False)
    for change in (
        dict(softcap=5.0),
        dict(alibi_slopes=torch.ones(1, 4)),
        dict(window=(8, 0)),
        dict(window=(-1, 3)),
        dict(window=(5, 7)),
        dict(sink=torch.zeros(4)),
        dict(softcap=5.0, alibi_slopes=torch.ones(1, 4), window=(8, 2), sink=torch.zeros(4)),
    ):
        assert forward_wgmma.takes(q, k, v, spec.replace(**change)), change
    offsets = dict(
        cu_seqlens_q=torch.tensor([0, 10, 24], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 30, 40], dtype=torch.int32),
        max_seqlen_q=14,
        max_seqlen_k=30,
    )
    packed = spec.replace(**offsets)
    assert packed.varlen and forward_wgmma.takes(q, k, v, packed)
    assert forward_wgmma.takes(q, k, v, packed.replace(window=(-1, 0), alibi_slopes=torch.ones(2, 4)))


@pytest.mark.parametrize(
    "change, reason",
    [
        pytest.param(lambda q, k, v, s: ((q.float(), k.float(), v.float()), s), "fp16 or bf16", id="fp32"),
        pytest.param(lambda q, k, v, s: ((q, k.bfloat16(), v), s), "one dtype", id="mixed-dtypes"),
        pytest.param(lambda q, k, v, s: ((q[..., :32], k[..., :32], v[..., :32]), s), "head_dim", id="head-dim-32"),
        pytest.param(lambda q, k, v, s: ((q, k, v[..., :32]), s), "head_dim", id="v-head-dim"),
        pytest.param(
            lambda q, k, v, s: ((q, k, v), s.replace(cache_seqlens=torch.tensor([16], dtype=torch.int32))),
            "KV cache",
            id="kv-cache",
        ),
        pytest.param(lambda q, k, v, s: ((q, k, v), s.replace(scale=-0.1)), "scale", id="negative-scale"),
        pytest.param(
            lambda q, k, v, s: ((q, torch.cat([k, k], -1)[..., ::2], v), s), "16 B aligned", id="k-strided-head-dim"
        ),
        pytest.param(
            lambda q, k, v, s: ((q, k, torch.randn(v.numel() + 1).half()[1:].view(v.shape)), s),
            "16 B aligned",
            id="v-unaligned",
        ),
    ],
)
def test_refuses_what_it_does_not_compute(change, reason):
    q, k, v = _inputs()
    (q, k, v), spec = change(q, k, v, _spec(q, k, False))
    assert reason in forward_wgmma.refusal(q, k, v, spec)
    assert not forward_wgmma.takes(q, k, v, spec)
    with pytest.raises(NotImplementedError, match="wgmma kernel"):
        forward_wgmma.flash_attn_forward(q, k, v, spec)


def test_uses_wgmma_needs_the_switch_and_a_hopper_gpu(monkeypatch):
    q, k, v = _inputs()
    spec = _spec(q, k, True)
    monkeypatch.setattr(forward_wgmma, "ENABLED", False)
    assert not forward_wgmma.uses_wgmma(q, k, v, spec)
    monkeypatch.setattr(forward_wgmma, "ENABLED", True)
    assert not forward_wgmma.uses_wgmma(q, k, v, spec), "CPU tensors (the simulator's) never take it by default"


@pytest.mark.parametrize("enabled", [False, True])
def test_forward_runs_it_only_where_uses_wgmma_holds(monkeypatch, enabled):
    """forward.flash_attn_forward calls forward_wgmma where uses_wgmma holds (here: forced, as on a Hopper GPU
    by default), with neither a kernel nor a config asked for; else the kernel it ran before."""
    calls = []

    def wgmma_kernel(q, k, v, spec, config=None):
        calls.append("wgmma")
        return "wgmma"

    monkeypatch.setattr(forward_wgmma, "uses_wgmma", lambda q, k, v, spec: enabled)
    monkeypatch.setattr(forward_wgmma, "flash_attn_forward", wgmma_kernel)
    monkeypatch.setattr(forward.forward_tc, "flash_attn_forward", lambda *a: "tc")
    monkeypatch.setattr(forward.forward_simt, "flash_attn_forward", lambda *a: "simt")
    q, k, v = _inputs()
    spec = _spec(q, k, False)
    # CPU tensors: without wgmma, forward_tc.uses_tensor_cores is False and the SIMT kernel runs.
    assert forward.flash_attn_forward(q, k, v, spec) == ("wgmma" if enabled else "simt")
    assert forward.flash_attn_forward(q, k, v, spec, tensor_cores=True) == "tc"
    assert forward.flash_attn_forward(q, k, v, spec, tensor_cores=False) == "simt"
    assert forward.flash_attn_forward(q, k, v, spec, config=forward.forward_tc.tc_config(64)) in ("tc", "simt")
    assert calls == (["wgmma"] if enabled else [])


@pytest.mark.parametrize("named", [frozenset(), *map(frozenset, common.FEATURE_NAMES), common.FEATURE_NAMES])
def test_features_on_needs_features_to_name_them(monkeypatch, named):
    """``features_on`` (part of ``uses_wgmma``): a dense spec, causal or not, always; a softcap, ALiBi, a window
    other than causal, a packed batch, a sink only where ``FEATURES`` names each (several only where it names
    all)."""
    monkeypatch.setattr(forward_wgmma, "FEATURES", named)
    q, k, _ = _inputs()
    spec = _spec(q, k, False)
    offsets = torch.tensor([0, 16], dtype=torch.int32)
    changes = {
        "softcap": dict(softcap=5.0),
        "alibi": dict(alibi_slopes=torch.ones(1, 2)),
        "window": dict(window=(8, 0)),
        "varlen": dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=16, max_seqlen_k=16),
        "sink": dict(sink=torch.zeros(2)),
    }
    assert forward_wgmma.features_on(spec) and forward_wgmma.features_on(_spec(q, k, True))
    for name, change in changes.items():
        assert forward_wgmma.features_on(spec.replace(**change)) == (name in named), name
    everything = {key: value for change in changes.values() for key, value in change.items()}
    assert forward_wgmma.features_on(spec.replace(**everything)) == (named == common.FEATURE_NAMES)


def test_features_read_the_environment_at_import():
    """FA2_NUMBA_WGMMA_FEATURES unset, "none", "softcap", "alibi,window", "varlen,sink": all, none, softcap, both,
    both."""
    values = [None, "none", "softcap", "alibi,window", "varlen,sink"]
    got = values_at_import("fa2_numba_cuda.forward_wgmma", "FEATURES", "FA2_NUMBA_WGMMA_FEATURES", values)
    assert [eval(r) for r in got] == [
        {"softcap", "alibi", "window", "varlen", "sink"},
        frozenset(),
        {"softcap"},
        {"alibi", "window"},
        {"varlen", "sink"},
    ]


@pytest.mark.parametrize("on", [False, True], ids=["features-off", "features-on"])
def test_forward_runs_features_where_features_names_them(wgmma_device, monkeypatch, on):
    """On a Hopper GPU with ``ENABLED``: inputs with a softcap, ALiBi, a window and a sink, and a packed batch
    (bf16, D128, GQA 2:1) run forward_tc with ``FEATURES`` empty, this kernel (built with the
    features' switches) with all named; both match the reference. The class's first call takes other offsets
    and slopes (the same shapes): the second call takes the prepared launch, which must read its own tensors,
    and gives numba's launch's O and L bit for bit."""
    if wgmma_device.type != "cuda":
        pytest.skip("the default dispatch needs a Hopper GPU (--device cuda)")
    monkeypatch.setattr(forward_wgmma, "ENABLED", True)
    monkeypatch.setattr(forward_wgmma, "FEATURES", common.FEATURE_NAMES if on else frozenset())
    lens = [300, 77, 512]
    lens_q, lens_k, h, h_k, d = lens, lens, 4, 2, 128
    q, k, v, slopes, sinks = _packed_inputs((lens_q, lens_k, h, h_k, d), True, True, wgmma_device)
    first_slopes = torch.rand_like(slopes)
    cu, first_cu = offsets(lens, wgmma_device), offsets([512, 300, 77], wgmma_device)

    def spec(offsets, slopes):
        return AttentionSpec(d**-0.5, (256, 0), 30.0, slopes, h // h_k, offsets, offsets, 512, 512, sink=sinks)

    for cache in (forward_wgmma._KERNELS, forward_wgmma._PREPARED, forward_tc._KERNELS, forward_tc._PREPARED):
        cache.clear()  # so that the first call builds the kernel it runs
    monkeypatch.setattr(launch, "FAST", False)
    expected = forward.flash_attn_forward(q, k, v, spec(cu, slopes))
    if on:
        assert [key[2:9] for key in forward_wgmma._KERNELS] == [(False, True, True, True, True, True, True)]
    else:
        assert not forward_wgmma._KERNELS and forward_tc._KERNELS, "forward_tc ran"
    monkeypatch.setattr(launch, "FAST", True)
    forward.flash_attn_forward(q, k, v, spec(first_cu, first_slopes))
    prepares = []
    real = launch.prepare
    monkeypatch.setattr(launch, "prepare", lambda *a, **kw: prepares.append(a) or real(*a, **kw))
    got = forward.flash_attn_forward(q, k, v, spec(cu, slopes))
    assert not prepares, "the second call of a class must take the prepared launch"
    torch.cuda.synchronize()
    for name, x, y in zip(("O", "L"), expected, got):
        assert torch.equal(x, y), f"{name}: max |prepared - numba| = {(x.float() - y.float()).abs().max():.3g}"
    O, L = got
    for s in range(len(lens)):
        rows = slice(cu[s].item(), cu[s + 1].item())
        assert_matches_reference(
            O[:, :, rows],
            L[:, :, rows],
            q[:, :, rows],
            k[:, :, rows],
            v[:, :, rows],
            False,
            d**-0.5,
            window=(256, 0),
            softcap=30.0,
            alibi_slopes=slopes[s : s + 1],
            sink=sinks,
        )


def test_enabled_reads_the_environment_at_import():
    """FA2_NUMBA_WGMMA unset, 1, 0: on, on, off."""
    got = values_at_import("fa2_numba_cuda.forward_wgmma", "ENABLED", "FA2_NUMBA_WGMMA", [None, "1", "0"])
    assert got == ["True", "True", "False"]


@pytest.mark.parametrize(
    "config, match",
    [
        pytest.param(forward_wgmma.WgmmaConfig(64, STAGES=1), "STAGES >= 2", id="one-stage"),
        pytest.param(forward_wgmma.WgmmaConfig(64, True, STAGES=3), "2 with S_AHEAD", id="ahead-three-stages"),
        pytest.param(forward_wgmma.WgmmaConfig(64, OVERLAP_PV=True), "STAGES >= 3", id="overlap-two-stages"),
        pytest.param(forward_wgmma.WgmmaConfig(64, STAGES=7), "shared memory", id="seven-stages-over-227KB"),
    ],
)
def test_refuses_configurations_it_cannot_build(wgmma_device, config, match):
    """Before compiling: at head_dim 128 a stage is 32 KB, and seven (257 KB with Q's) exceed a block's 227 KB."""
    q, k, v = random_qkv((1, 1, 64, 128), (1, 1, 64, 128), torch.float16, wgmma_device)
    with pytest.raises(ValueError, match=match):
        forward_wgmma.flash_attn_forward(q, k, v, _spec(q, k, False), config)
