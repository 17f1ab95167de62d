"""fa2-numba-cuda's backward on Hopper's wgmma (``fa2_numba_cuda.backward_wgmma``), on unless FA2_NUMBA_WGMMA_BWD=0.

- dq, dk, dv against the fp64 reference with the suite's FlashAttention-2 rule (``test_gradients.assert_grads_match``;
  O and L from the fp64 reference, so that only the backward is under test; outputs NaN-poisoned by the suite's
  conftest), on numba's simulator (``wgmma.py``'s and ``mma.py``'s emulations, fp16, a few tiles) or, with
  --device cuda, on a GPU of compute capability 9.0 (fp16 and bf16, head_dim 64 and 128): whole tiles, ragged
  seqlen_q and seqlen_k, seqlen_q below and above seqlen_k under causal (rows that see no key, keys no row sees),
  GQA; the tile configurations (``WgmmaBwdConfig``: 32- and 96-query dK/dV steps, 32-, 96- and 128-key dQ tiles,
  dV early, SPLIT_MASK, backward_tc's dQ kernel), each also with the features below;
- softcap and ALiBi (the kernels' SOFTCAP and ALIBI): against the reference on the simulator (4 cases, both
  kernels, causal and full, GQA over 32-row tiles of two heads' slopes, D128), and on the GPU also against
  backward_tc's gradients;
- windows (the kernels' LEFT and RIGHT, and CAUSAL with a left side): against the reference on the simulator (3
  cases: left and right with seqlen_q < seqlen_k, ALiBi and DV_EARLY; (left, 0) with GQA, a softcap and 32-row
  tiles; (0, right) at D128), and on the GPU also against backward_tc's gradients;
- packed batches (VARLEN): the whole batch's dq, dk, dv against the fp64 reference's
  (``reference.varlen_attention``, test_varlen's rule) on the simulator (3 cases: Nq != Nk per sequence both
  ways, a one-token sequence, a sequence without queries, GQA, softcap,
  ALiBi per sequence, DV_EARLY, D128; and one with a window, bounded by each sequence's own lengths), and on
  the GPU (bf16, an empty sequence; with windows too) also against backward_tc's;
- an attention sink (the kernels as they are, dsink the preprocess's shares): dq, dk, dv and dsink against the
  reference on the simulator (1 case, GQA, causal, D64's default tiles), and on the GPU also against
  backward_tc's gradients;
- ``refusal``/``takes`` refusing what the kernels do not compute, ``uses_wgmma`` off without the switch or a
  Hopper GPU, and ``fa2_numba_cuda.backward`` running them only where ``uses_wgmma`` holds (``ENABLED``
  monkeypatched), the switch read from the environment at import; softcap, ALiBi, windows, packed batches and
  sinks taken by them only where ``FEATURES`` names them (its environment variable read at import; on the GPU, the
  dispatch with it off and on).

The simulator checks the index math against the ISA's tables as ``wgmma.py`` reads them, and the ordering of
cp.async, the wgmma waits and the fences as its emulation models them (not the async proxy); only the GPU run
shows the hardware agrees. On the GPU: pytest --device cuda with NUMBA_ENABLE_CUDASIM unset.
"""

from __future__ import annotations

import pytest
import torch

from checks import build_group, heads_first, max_err, offsets, packed_grad_tolerances, random_qkv, values_at_import
from fa2 import reference
from fa2.spec import AttentionSpec
from fa2_numba_cuda import backward, backward_tc, backward_wgmma, common, launch, tensor_cores
from test_gradients import assert_grads_match, grad_tolerances
from test_sinks import assert_dsink_matches, make_sink

SIMULATED = common.simulated()


@pytest.fixture
def wgmma_device(kernel_device):
    """Where the kernels run: the simulator on the CPU, or a GPU of compute capability 9.0 (sm_90a)."""
    if kernel_device.type == "cuda" and tensor_cores.capability(kernel_device) != backward_wgmma.COMPUTE_CAPABILITY:
        pytest.skip(f"wgmma needs compute capability 9.0, got {tensor_cores.capability(kernel_device)}")
    return kernel_device


def _spec(q, k, causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return AttentionSpec(scale, (-1, 0) if causal else (-1, -1), group=q.shape[1] // k.shape[1])


def _inputs(dtype, shape, device):
    """Standard-normal q, k, v, dO for shape (B, H, H_k, seqlen_q, seqlen_k, D)."""
    b, h, h_k, n_q, n_k, d = shape
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=n_q + n_k + d)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(d)).to(device=device, dtype=dtype)
    return q, k, v, dO


def _forward(q, k, v, causal):
    """O (in q's dtype) and L (fp32) from the fp64 reference."""
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), causal)
    return O64.to(q.dtype), L64.float()


def _shape_id(shape):
    b, h, h_k, n_q, n_k, d = shape
    return f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else "") + f"-{n_q}x{n_k}-D{d}"


def _config_id(config):
    """A test id's part for a ``WgmmaBwdConfig``: empty for None (``bwd_config``'s)."""
    if config is None:
        return ""
    name = f"-M{config.BLOCK_M}" + ("-dv-early" if config.DV_EARLY else "")
    name += f"-dqN{config.DQ_BLOCK_N}" if config.DQ_WGMMA else "-tc-dq"
    return name + ("-split" if config.SPLIT_MASK else "")


def _build_group(d, window, softcap, alibi, config, varlen=False, dtype=torch.bfloat16):
    """The xdist group of a case: its kernels' build (head dim, mask, features, tiles), so that under ``--dist
    loadgroup`` one worker compiles them (10-40 s each on the GPU) for all the cases that use them."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    return build_group(f"wgmma-bwd-{kind}{_config_id(config)}", d, window, softcap=softcap, alibi=alibi, varlen=varlen)


def _case(dtype, b, h, h_k, n_q, n_k, d, causal, config=None):
    """config: None (``bwd_config``'s) or a ``WgmmaBwdConfig``."""
    shape = (b, h, h_k, n_q, n_k, d)
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    name = f"{kind}-{_shape_id(shape)}-{'causal' if causal else 'full'}{_config_id(config)}"
    group = _build_group(d, (-1, 0) if causal else (-1, -1), 0.0, False, config, dtype=dtype)
    return pytest.param(dtype, shape, causal, config, id=name, marks=group)


def _cases(dtype, shapes, config=None, masks=(False, True)):
    return [_case(dtype, *shape, causal, config) for shape in shapes for causal in masks]


# (B, H, H_k, seqlen_q, seqlen_k, D). The simulator's: a few 128-key (dK/dV) and 128-row (dQ) blocks, 64-row steps.
SIM_SHAPES = [
    (1, 1, 1, 128, 128, 64),  # whole tiles: one block, two query tiles
    (1, 1, 1, 100, 150, 64),  # ragged: two blocks (the second's upper warpgroup past seqlen_k), rows past the end
    (1, 2, 1, 40, 100, 64),  # GQA 2:1: the block's steps over both query heads
    (1, 1, 1, 70, 90, 128),  # head_dim 128: tiles of two 64-column panels
]
# Causal only: what they add is where the diagonal falls (without a mask they are ragged tiles as above).
SIM_CAUSAL_SHAPES = [
    (1, 1, 1, 150, 60, 64),  # seqlen_q > seqlen_k: the first 90 rows see no key
]
CAUSAL = (True,)
GPU_SHAPES = [
    *[(1, 2, 2, 512, 512, d) for d in (64, 128)],
    *[(2, 4, 2, 1000, 1500, d) for d in (64, 128)],
    *[(1, 4, 1, 1500, 700, d) for d in (64, 128)],
    # three keys (with one, the suite's rule allows dq no error at all: its reference is exactly 0), one query
    *[(3, 2, 2, 129, 3, d) for d in (64, 128)],
    *[(2, 2, 2, 1, 300, d) for d in (64, 128)],
]
EARLY = backward_wgmma.WgmmaBwdConfig(64, True)
SMALL = backward_wgmma.WgmmaBwdConfig(32, DQ_BLOCK_N=32)
TC_DQ = backward_wgmma.WgmmaBwdConfig(64, DQ_WGMMA=False)
# The masked copy of the probabilities' loop only on tiles that cross an edge; the dQ kernel on wgmma at D64 too.
SPLIT = backward_wgmma.WgmmaBwdConfig(64, SPLIT_MASK=True)
# 128-key dQ tiles (the dQ kernel's loops written out, ``mma.unrolled``), on wgmma at D64 too.
WIDE_DQ = backward_wgmma.WgmmaBwdConfig(64, DQ_BLOCK_N=128, SPLIT_MASK=True)
# 96-query dK/dV steps and 96-key dQ tiles (both kernels' loops written out, ``mma.unrolled``).
TALL = backward_wgmma.WgmmaBwdConfig(96, DQ_BLOCK_N=96, SPLIT_MASK=True)
if SIMULATED:
    KERNEL_CASES = [
        *_cases(torch.float16, SIM_SHAPES),
        *_cases(torch.float16, SIM_CAUSAL_SHAPES, masks=CAUSAL),
        # bf16; seqlen_q < seqlen_k: causal's diagonal inside the second block
        _case(torch.bfloat16, 1, 1, 1, 70, 150, 64, True),
        # dV issued before dSᵀ (wait_group 1 between the updates)
        *_cases(torch.float16, [(1, 1, 1, 100, 150, 64)], EARLY, CAUSAL),
        # 32-query dK/dV steps (several a head) and 32-key dQ tiles (several a block, causal ones skipped)
        *_cases(torch.float16, [(1, 2, 1, 70, 90, 64)], SMALL, CAUSAL),
        # backward_tc's dQ kernel
        _case(torch.float16, 1, 2, 1, 70, 90, 64, True, TC_DQ),
        # causal's diagonal inside the second block, the keys' end inside the dQ kernel's second tile: both copies
        _case(torch.float16, 1, 1, 1, 100, 150, 64, True, SPLIT),
        # a dQ key tile of 128 cut by the keys' end (140 keys: the second tile 12), the diagonal inside both
        _case(torch.float16, 1, 2, 1, 40, 140, 64, True, WIDE_DQ),
        # GQA 2:1, a ragged 96-row step a head, 96-key dQ tiles (the causal case with a softcap and ALiBi is below)
        _case(torch.float16, 1, 2, 1, 70, 150, 64, False, TALL),
    ]
else:
    KERNEL_CASES = [
        *_cases(torch.float16, GPU_SHAPES),
        *_cases(torch.bfloat16, GPU_SHAPES),
        *_cases(torch.bfloat16, GPU_SHAPES[:6], EARLY),
        *_cases(torch.bfloat16, GPU_SHAPES[:6], SMALL),
        *_cases(torch.bfloat16, GPU_SHAPES[:6], TC_DQ),
        *_cases(torch.bfloat16, GPU_SHAPES, SPLIT),
        *_cases(torch.bfloat16, GPU_SHAPES, WIDE_DQ),
        *_cases(torch.bfloat16, GPU_SHAPES, TALL),
    ]


@pytest.mark.parametrize("dtype, shape, causal, config", KERNEL_CASES)
def test_kernels_match_reference(wgmma_device, dtype, shape, causal, config):
    q, k, v, dO = _inputs(dtype, shape, wgmma_device)
    O, L = _forward(q, k, v, causal)
    dq, dk, dv = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, _spec(q, k, causal), config)
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


# Softcap and ALiBi: (B, H, H_k, seqlen_q, seqlen_k, D), causal, softcap, ALiBi, config. A softcap of 2 saturates the
# larger scores (1 - tanh² well below 1); the slopes are per (batch, head), in [0, 1).
WGMMA_DQ = backward_wgmma.WgmmaBwdConfig(64)  # the dQ kernel on wgmma at D64 too
if SIMULATED:
    SCORE_CASES = [
        ((1, 1, 1, 100, 150, 64), True, 2.0, False, WGMMA_DQ),  # causal's diagonal inside the second block
        ((2, 1, 1, 70, 90, 64), False, 0.0, True, WGMMA_DQ),  # two batches' slopes, ragged tiles
        ((1, 2, 1, 70, 60, 64), True, 2.0, True, SMALL),  # GQA 2:1 over 32-row tiles, the first 10 rows see no key
        ((1, 1, 1, 70, 90, 128), True, 2.0, True, None),  # the default tiles at D128 (both kernels on wgmma)
        ((1, 1, 1, 100, 150, 64), True, 2.0, True, SPLIT),  # the masked copy is the dK/dV kernel's softcap loop
        ((1, 1, 1, 40, 140, 64), True, 2.0, True, WIDE_DQ),  # the written-out loops with the cap and the bias
        ((1, 1, 1, 100, 150, 64), True, 2.0, True, TALL),  # the dK/dV kernel's, both copies
    ]
else:
    SCORE_CASES = [
        (shape, causal, softcap, alibi, None)
        for shape in GPU_SHAPES[:6]
        for causal in (False, True)
        for softcap, alibi in ((50.0, False), (0.0, True), (50.0, True))
    ] + [
        (shape, causal, 50.0, True, config)
        for shape in GPU_SHAPES[:6]
        for causal in (False, True)
        for config in (SPLIT, WIDE_DQ, TALL)
    ]


def _score_id(shape, causal, softcap, alibi, config):
    name = f"{_shape_id(shape)}-{'causal' if causal else 'full'}"
    name += f"-softcap{softcap:g}" if softcap else ""
    return name + ("-alibi" if alibi else "") + _config_id(config)


@pytest.mark.parametrize(
    "shape, causal, softcap, alibi, config",
    [
        pytest.param(*c, id=_score_id(*c), marks=_build_group(c[0][-1], (-1, 0) if c[1] else (-1, -1), *c[2:]))
        for c in SCORE_CASES
    ],
)
def test_softcap_and_alibi_match_reference(wgmma_device, shape, causal, softcap, alibi, config):
    """dq, dk, dv against the fp64 reference (fp16 on the simulator, bf16 on the GPU, where they are also checked
    against backward_tc's within the same tolerance: the same rounding points, other orders of summation)."""
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    q, k, v, dO = _inputs(dtype, shape, wgmma_device)
    b, h = shape[:2]
    slopes = torch.rand(b, h, generator=torch.Generator().manual_seed(shape[3])).to(wgmma_device) if alibi else None
    features = dict(softcap=softcap, alibi_slopes=slopes)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), causal, **features)
    O, L = O64.to(dtype), L64.float()
    spec = AttentionSpec(shape[-1] ** -0.5, (-1, 0) if causal else (-1, -1), softcap, slopes, h // shape[2])
    grads = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    assert {key[6:8] for key in backward_wgmma._KERNELS} >= {(softcap > 0, alibi)}
    assert_grads_match(*grads, q, k, v, dO, causal, **features)
    if not SIMULATED:
        _, tols = grad_tolerances(q, k, v, dO, causal, **features)
        for name, x, y, tol in zip(
            ("dq", "dk", "dv"), grads, backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec), tols
        ):
            err = (x.float() - y.float()).abs().max().item()
            assert err <= tol, f"max |{name} - backward_tc's| = {err:.3g} > tolerance {tol:.3g}"


# Windows: (B, H, H_k, seqlen_q, seqlen_k, D), (left, right), softcap, ALiBi, config. Each simulator case has
# query (dK/dV) and key (dQ) tiles outside the window that the walks skip, steps where a warpgroup sees none of the
# tile (skipped) and where the tile crosses an edge (masked).
if SIMULATED:
    WINDOW_CASES = [
        # a band of 16 keys a row: both kernels' walks cut at both ends; the dQ kernel on wgmma at D64, dV issued
        # before dSᵀ
        ((1, 1, 1, 140, 150, 64), (10, 5), 0.0, True, EARLY),
        # a sliding window on a causal layer (CAUSAL and LEFT): GQA 2:1, the second block's walk over 32-row tiles
        # of both heads
        ((1, 2, 1, 150, 200, 64), (40, 0), 2.0, False, SMALL),
        ((1, 1, 1, 70, 90, 128), (0, 40), 0.0, False, None),  # left 0, right above 0; the default tiles at D128
        ((1, 1, 1, 140, 150, 64), (10, 5), 0.0, False, SPLIT),  # a tile inside the band: both copies
        ((1, 1, 1, 60, 200, 64), (30, 10), 0.0, False, WIDE_DQ),  # both edges across 128-key dQ tiles
    ]
else:
    WINDOWS = [(256, 0), (1, 0), (100, 100), (0, 64), (-1, 37), (300, -1)]
    WINDOW_CASES = [
        # where some row sees two keys or more (with one at most, the suite's rule allows dq no error at all: its
        # reference is exactly 0; (0, 64) with one query)
        *[
            (shape, window, 0.0, False, None)
            for shape in GPU_SHAPES
            for window in WINDOWS
            if reference.window_mask(shape[3], shape[4], window, "cpu").sum(-1).max() > 1
        ],
        *[(shape, window, 50.0, True, None) for shape in GPU_SHAPES[:6] for window in ((256, 0), (100, 100))],
        *[
            (shape, window, 0.0, False, config)
            for shape in GPU_SHAPES[:6]
            for window in ((256, 0), (100, 100))
            for config in (EARLY, SMALL, SPLIT, WIDE_DQ, TALL)
        ],
    ]


def _window_id(shape, window, softcap, alibi, config):
    name = f"{_shape_id(shape)}-window{window[0]}_{window[1]}"
    name += f"-softcap{softcap:g}" if softcap else ""
    return name + ("-alibi" if alibi else "") + _config_id(config)


def _window_inputs(device, shape, window, softcap, alibi):
    """(q, k, v, dO, O, L, spec, features) for a window, softcap and ALiBi: fp16 on the simulator, bf16 on the GPU;
    O and L the fp64 reference's in that precision; the slopes per (batch, head) in [0, 1), seeded by seqlen_q;
    features as fa2.reference.attention takes them."""
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    q, k, v, dO = _inputs(dtype, shape, device)
    b, h = shape[:2]
    slopes = torch.rand(b, h, generator=torch.Generator().manual_seed(shape[3])).to(device) if alibi else None
    features = dict(window=window, softcap=softcap, alibi_slopes=slopes)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), **features)
    spec = AttentionSpec(shape[-1] ** -0.5, window, softcap, slopes, h // shape[2])
    return q, k, v, dO, O64.to(dtype), L64.float(), spec, features


@pytest.mark.parametrize(
    "shape, window, softcap, alibi, config",
    [pytest.param(*c, id=_window_id(*c), marks=_build_group(c[0][-1], *c[1:])) for c in WINDOW_CASES],
)
def test_windows_match_reference(wgmma_device, shape, window, softcap, alibi, config):
    """dq, dk, dv against the fp64 reference (fp16 on the simulator, bf16 on the GPU, where they are also checked
    against backward_tc's within the same tolerance)."""
    q, k, v, dO, O, L, spec, features = _window_inputs(wgmma_device, shape, window, softcap, alibi)
    grads = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    assert {key[3:6] for key in backward_wgmma._KERNELS} >= {backward_wgmma._window_flags(spec)}
    assert_grads_match(*grads, q, k, v, dO, False, **features)
    if not SIMULATED:
        _, tols = grad_tolerances(q, k, v, dO, False, **features)
        for name, x, y, tol in zip(
            ("dq", "dk", "dv"), grads, backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec), tols
        ):
            err = (x.float() - y.float()).abs().max().item()
            assert err <= tol, f"max |{name} - backward_tc's| = {err:.3g} > tolerance {tol:.3g}"


# SPLIT_MASK on against off: (B, H, H_k, seqlen_q, seqlen_k, D), window, softcap, ALiBi.
if SIMULATED:
    SPLIT_CASES = [
        ((1, 1, 1, 100, 150, 64), (-1, 0), 2.0, True),  # causal: the dK/dV kernel's softcap loop split
        ((1, 1, 1, 140, 150, 64), (10, 5), 0.0, True),  # a band: its scores loop split, tiles on both sides
    ]
else:
    SPLIT_CASES = [
        (shape, window, softcap, alibi)
        for shape in GPU_SHAPES[:6]
        for window in ((-1, 0), (-1, -1), (256, 0), (100, 100))
        for softcap, alibi in ((0.0, False), (50.0, True))
    ]


@pytest.mark.parametrize(
    "shape, window, softcap, alibi",
    [pytest.param(*c, id=_window_id(*c, None), marks=_build_group(c[0][-1], *c[1:], SPLIT)) for c in SPLIT_CASES],
)
def test_split_mask_gives_the_same_bits(wgmma_device, shape, window, softcap, alibi):
    """SPLIT_MASK on against off (the dQ kernel on wgmma both times): dq, dk, dv bit for bit (the masked copy and
    the unmasked one compute each element as the single loop does, and masking a tile inside the mask zeroes
    nothing), but with a softcap on the GPU, within the suite's tolerance."""
    q, k, v, dO, O, L, spec, features = _window_inputs(wgmma_device, shape, window, softcap, alibi)
    off = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, SPLIT._replace(SPLIT_MASK=False))
    on = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, SPLIT)
    if softcap and not SIMULATED:
        # The H200's builds with a softcap at D128 gave other bits (split_probe); the suite's tolerance then.
        _, tols = grad_tolerances(q, k, v, dO, False, **features)
    else:
        tols = (0.0, 0.0, 0.0)
    for name, x, y, tol in zip(("dq", "dk", "dv"), off, on, tols):
        err = (x.float() - y.float()).abs().max().item()
        assert err <= tol, f"{name}: max |split - single loop| = {err:.3g} > {tol:.3g}"


def test_default_config_splits_the_mask_but_with_a_softcap_at_head_dim_128():
    """``bwd_config``: SPLIT_MASK on (faster or level on the H200) but with a softcap at head_dim 128, whose split
    build gave other bits than the single loop's there and waits for the GPU tests against the reference."""
    got = {(d, softcap): backward_wgmma.bwd_config(d, softcap).SPLIT_MASK for d in (64, 128) for softcap in (0, 1)}
    assert got == {(64, 0): True, (64, 1): True, (128, 0): True, (128, 1): False}


@pytest.mark.parametrize("softcap", [False, True], ids=["nocap", "softcap"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_tiles_are_the_tuners_choice(head_dim, masked, softcap):
    """``bwd_config``'s tiles (docs/benchmarks/h100-tune-numba-bwd.csv): the dQ kernel on wgmma, 128-key tiles at
    D64 (96 with a softcap: 128 spill there) and 96 at D128; 96-query dK/dV steps at D64 where no key is masked."""
    config = backward_wgmma.bwd_config(head_dim, softcap, masked)
    assert config.DQ_WGMMA and not config.DV_EARLY
    assert config.BLOCK_M == (96 if head_dim == 64 and not masked else 64)
    assert config.DQ_BLOCK_N == (128 if head_dim == 64 and not softcap else 96)


# An attention sink: (B, H, H_k, seqlen_q, seqlen_k, D), causal, config. The kernels are the sink's as they are
# (L carries it); what is under test is the host's: the preprocess's dsink shares, and with TC_DQ backward_tc's dQ
# kernel built without its own shares.
if SIMULATED:
    SINK_CASES = [((1, 2, 1, 70, 90, 64), True, TC_DQ)]  # GQA 2:1
else:
    SINK_CASES = [
        *[(shape, causal, None) for shape in GPU_SHAPES[:6] for causal in (False, True)],
        *[(shape, True, WGMMA_DQ) for shape in GPU_SHAPES[:6:2]],
        *[(shape, True, TC_DQ) for shape in GPU_SHAPES[1:6:2]],
    ]


def _sink_id(shape, causal, config):
    return f"{_shape_id(shape)}-{'causal' if causal else 'full'}{_config_id(config)}"


@pytest.mark.parametrize(
    "shape, causal, config",
    [
        pytest.param(*c, id=_sink_id(*c), marks=_build_group(c[0][-1], (-1, 0) if c[1] else (-1, -1), 0.0, False, c[2]))
        for c in SINK_CASES
    ],
)
def test_sink_matches_reference(wgmma_device, shape, causal, config):
    """dq, dk, dv and dsink against the fp64 reference's (fp16 on the simulator, bf16 on the GPU, where they are
    also checked against backward_tc's, which takes dsink's shares in its dQ kernel instead)."""
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    q, k, v, dO = _inputs(dtype, shape, wgmma_device)
    sink = make_sink(shape[1], wgmma_device, seed=shape[3])
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), causal, sink=sink.double())
    O, L = O64.to(dtype), L64.float()
    spec = _spec(q, k, causal).replace(sink=sink)
    dq, dk, dv, dsink = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, config)
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal, sink=sink)
    assert_dsink_matches(dsink, q, k, v, dO, causal, sink)
    if not SIMULATED:
        _, tols = grad_tolerances(q, k, v, dO, causal, sink=sink)
        expected = backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec)
        for name, x, y, tol in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, tols):
            err = (x.float() - y.float()).abs().max().item()
            assert err <= tol, f"max |{name} - backward_tc's| = {err:.3g} > tolerance {tol:.3g}"


def test_features_on_takes_a_sink_only_where_features_names_it(monkeypatch):
    q, k, _, _ = _small()
    spec = _spec(q, k, True).replace(sink=torch.zeros(2))
    monkeypatch.setattr(backward_wgmma, "FEATURES", frozenset({"softcap", "alibi", "window", "varlen"}))
    assert not backward_wgmma.features_on(spec)
    monkeypatch.setattr(backward_wgmma, "FEATURES", frozenset({"sink"}))
    assert backward_wgmma.features_on(spec)
    assert not backward_wgmma.features_on(spec.replace(softcap=5.0)), "each feature must be named"


def test_dv_early_takes_no_softcap(wgmma_device):
    q, k, v, dO = (t.to(wgmma_device) for t in _small())
    spec = _spec(q, k, True).replace(softcap=5.0)
    L = torch.zeros(q.shape[:3], device=wgmma_device)
    with pytest.raises(ValueError, match="DV_EARLY takes no softcap"):
        backward_wgmma.flash_attn_backward(q, k, v, torch.zeros_like(q), L, dO, spec, EARLY)


# Packed batches: (lens_q, lens_k, H, H_k, D), window ((-1, 0) causal, (-1, -1) full), softcap, ALiBi, config.
FULL, CAUSAL_WINDOW = (-1, -1), (-1, 0)
if SIMULATED:
    VARLEN_CASES = [
        # Nq != Nk both ways, a one-token sequence: three blocks a kernel of which two exit at once; the dQ kernel
        # on wgmma too
        (([70, 1, 130], [100, 3, 60], 1, 1, 64), CAUSAL_WINDOW, 0.0, False, WGMMA_DQ),
        # GQA 2:1 (the walks over both heads), a sequence without queries (its keys: dk = dv = 0), softcap and
        # ALiBi per (sequence, head); D64's default tiles
        (([40, 0, 75], [50, 20, 64], 2, 1, 64), CAUSAL_WINDOW, 2.0, True, None),
        # D128, dV issued early, full: the first sequence's second key block, the second's second dQ block
        (([50, 130], [130, 40], 1, 1, 128), FULL, 0.0, True, EARLY),
        # a 29-key band on each sequence's own diagonal (40, -3, -50; the totals' would be -13), GQA 2:1, the dQ
        # kernel on wgmma: tiles cut from both kernels' walks at either end, the last sequence's first 42 rows
        # see no key, the short one's rows all see both its keys
        (([90, 5, 150], [130, 2, 100], 2, 1, 64), (20, 8), 0.0, False, WGMMA_DQ),
        # each sequence's own diagonal and end of keys, both kernels' copies
        (([70, 1, 130], [100, 3, 60], 1, 1, 64), CAUSAL_WINDOW, 0.0, False, SPLIT),
    ]
else:
    LENGTHS = (([300, 0, 1000, 77, 1], [500, 40, 1000, 0, 129]), ([2048, 129, 640], [2048, 129, 640]))
    VARLEN_CASES = [
        *[
            ((lens_q, lens_k, 4, 2, d), window, softcap, alibi, config)
            for lens_q, lens_k in LENGTHS
            for d in (64, 128)
            for window in (FULL, CAUSAL_WINDOW)
            for softcap, alibi, config in (
                (0.0, False, None),
                (50.0, True, None),
                (0.0, False, SMALL),
                (50.0, True, SPLIT),
                (50.0, True, TALL),
            )
        ],
        # windows, each sequence's own
        *[
            ((lens_q, lens_k, 4, 2, d), window, 0.0, False, None)
            for lens_q, lens_k in LENGTHS
            for d in (64, 128)
            for window in ((256, 0), (100, 100), (-1, 37))
        ],
        *[
            ((lens_q, lens_k, 4, 2, 128), (256, 0), softcap, alibi, config)
            for lens_q, lens_k in LENGTHS
            for softcap, alibi, config in ((50.0, True, None), (0.0, False, SMALL))
        ],
    ]


def _varlen_id(lens, window, softcap, alibi, config):
    lens_q, lens_k, h, h_k, d = lens
    name = f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}-H{h}-Hk{h_k}-D{d}-"
    name += {FULL: "full", CAUSAL_WINDOW: "causal"}.get(window, f"window{window[0]}_{window[1]}")
    name += (f"-softcap{softcap:g}" if softcap else "") + ("-alibi" if alibi else "")
    return name + _config_id(config)


@pytest.mark.parametrize(
    "lens, window, softcap, alibi, config",
    [pytest.param(*c, id=_varlen_id(*c), marks=_build_group(c[0][-1], *c[1:], varlen=True)) for c in VARLEN_CASES],
)
def test_packed_batches_match_reference(wgmma_device, lens, window, softcap, alibi, config):
    """dq, dk, dv ((1, heads, total, D)) of the whole packed batch against the fp64 reference's by test_varlen's
    rule (three times a same-precision naive attention's error plus twice the reference's rounding to the dtype);
    fp16 on the simulator, bf16 on the GPU, where they are also checked against backward_tc's within the same
    tolerance. Keys of a sequence without queries get dk = dv = 0, rows of one without keys dq = 0. A window is
    each sequence's own (bottom-right aligned on its lengths)."""
    lens_q, lens_k, h, h_k, d = lens
    dtype = torch.float16 if SIMULATED else torch.bfloat16
    g = torch.Generator().manual_seed(sum(lens_q) + d)
    q, k, v, dO = (
        torch.randn(sum(n), heads, d, generator=g).to(device=wgmma_device, dtype=dtype)
        for n, heads in ((lens_q, h), (lens_k, h_k), (lens_k, h_k), (lens_q, h))
    )
    slopes = torch.rand(len(lens_q), h, generator=g).to(wgmma_device) if alibi else None
    options = dict(window=window, softcap=softcap, alibi_slopes=slopes)
    cu_q, cu_k = offsets(lens_q, wgmma_device), offsets(lens_k, wgmma_device)
    O64, L64 = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, **options)
    spec = AttentionSpec(d**-0.5, window, softcap, slopes, h // h_k, cu_q, cu_k, max(lens_q), max(lens_k))
    args = (*(heads_first(t) for t in (q, k, v, O64.to(dtype))), L64.float()[None], heads_first(dO))
    got = backward_wgmma.flash_attn_backward(*args, spec, config)
    flags = backward_wgmma._window_flags(spec)
    assert any(key[8] and key[3:6] == flags for key in backward_wgmma._KERNELS), "built with VARLEN and the window"
    ref, tols = packed_grad_tolerances(q, k, v, dO, cu_q, cu_k, False, **options)
    tc = None if SIMULATED else backward_tc.flash_attn_backward(*args, spec)
    for i, (name, x, r, tol) in enumerate(zip(("dq", "dk", "dv"), got, ref, tols)):
        x = x[0].transpose(0, 1)
        assert not torch.isnan(x).any(), f"NaN in {name}"
        assert max_err(x, r) <= tol, f"max |{name} - ref| = {max_err(x, r):.3g} > tolerance {tol:.3g}"
        if tc is not None:
            err = max_err(x, tc[i][0].transpose(0, 1).double())
            assert err <= tol, f"max |{name} - backward_tc's| = {err:.3g} > tolerance {tol:.3g}"
    for s, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        if n_q == 0:
            assert (got[1][0, :, cu_k[s] : cu_k[s + 1]] == 0).all(), "keys of a sequence without queries: dk = 0"
            assert (got[2][0, :, cu_k[s] : cu_k[s + 1]] == 0).all(), "keys of a sequence without queries: dv = 0"
        if n_k == 0:
            assert (got[0][0, :, cu_q[s] : cu_q[s + 1]] == 0).all(), "rows of a sequence without keys: dq = 0"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs_match_reference(wgmma_device, causal):
    """q and k as (B, N, H, D) memory (rows a head apart), v and dO contiguous: each tensor's own strides."""
    q, k, v, dO = _inputs(torch.float16, (1, 2, 1, 40, 60, 64), wgmma_device)
    q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    O, L = _forward(q, k, v, causal)
    dq, dk, dv = backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, _spec(q, k, causal))
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


def test_kernels_are_kept_by_the_fields_they_read():
    """A configuration's dK/dV kernel is the one of every configuration with its BLOCK_M, DV_EARLY and SPLIT_MASK,
    its dQ kernel the one of every configuration with its DQ_BLOCK_N and SPLIT_MASK (``kernel_config``: a tuner's
    candidates share them); a field the kernel reads makes another one. (numba compiles on the first launch: these
    builds are only the dispatchers.)"""
    flags = (True, False, False, False, False, False, True)  # causal, bf16
    config = backward_wgmma.WgmmaBwdConfig(64, SPLIT_MASK=True)
    other_dq = config._replace(DQ_BLOCK_N=128, DQ_WGMMA=False)
    other_dkdv = config._replace(BLOCK_M=96, DV_EARLY=True)
    kernel = backward_wgmma._kernel
    assert kernel("dkdv", 64, config, *flags) is kernel("dkdv", 64, other_dq, *flags)
    assert kernel("dq", 64, config, *flags) is kernel("dq", 64, other_dkdv, *flags)
    assert kernel("dkdv", 64, config, *flags) is not kernel("dkdv", 64, other_dkdv, *flags)
    assert kernel("dq", 64, config, *flags) is not kernel("dq", 64, config._replace(DQ_BLOCK_N=128), *flags)
    for name in ("dkdv", "dq"):
        assert kernel(name, 64, config, *flags) is not kernel(name, 64, config._replace(SPLIT_MASK=False), *flags)


def test_backward_runs_them_with_the_switch_on_hopper(wgmma_device, monkeypatch):
    """On a Hopper GPU with ``ENABLED`` (unless FA2_NUMBA_WGMMA_BWD=0), backward.flash_attn_backward's fp16/bf16
    D64/D128 backward is these kernels': the dK/dV and dQ kernels are compiled, their resources are reported
    with at most 16 B of local memory, the gradients match the reference; a class's second call takes the
    prepared launches and gives the same gradients bit for bit (no atomics: deterministic)."""
    if wgmma_device.type != "cuda":
        pytest.skip("the default dispatch needs a Hopper GPU (--device cuda)")
    monkeypatch.setattr(backward_wgmma, "ENABLED", True)
    q, k, v, dO = _inputs(torch.bfloat16, (2, 4, 2, 300, 333, 128), wgmma_device)
    O, L = _forward(q, k, v, True)
    spec = _spec(q, k, True)
    backward_wgmma._KERNELS.clear()
    first = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    assert {key[:2] for key in backward_wgmma._KERNELS} == {("dkdv", 128), ("dq", 128)}, "the wgmma kernels ran"
    prepares = []
    real = backward_wgmma.launch.prepare
    monkeypatch.setattr(backward_wgmma.launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    second = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    assert not prepares, "the second call of a class must take the prepared launches"
    torch.cuda.synchronize()
    for name, x, y in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(x, y), f"{name}: max |prepared - numba| = {(x.float() - y.float()).abs().max():.3g}"
    assert_grads_match(*second, q, k, v, dO, True)
    rows = [r for r in backward.kernel_resources() if r["kernel"] in ("wgmma dkdv", "wgmma dq")]
    # SPLIT_MASK's two copies of the loop: 8 B of local memory in the causal D128 dK/dV kernel on the H200.
    assert len(rows) == 2 and all(r["local_bytes_per_thread"] <= 16 for r in rows), rows


# --- what they take, and when they run ----------------------------------------------------------------


def _small(dtype=torch.float16, d=64, h=2, h_k=2, n_q=16, n_k=16):
    q, k, v = random_qkv((1, h, n_q, d), (1, h_k, n_k, d), dtype, "cpu")
    return q, k, v, torch.ones_like(q)


def test_takes_dense_16_bit_head_dim_64_and_128():
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            q, k, v, dO = _small(dtype, d, h=4, h_k=2)
            for causal in (False, True):
                assert backward_wgmma.takes(q, k, v, dO, _spec(q, k, causal)), (dtype, d, causal)
            assert backward_wgmma.takes(q, k, v, dO, _spec(q, k, False, scale=-0.3)), "any scale"
            for features in (
                dict(softcap=5.0),
                dict(alibi_slopes=torch.ones(1, 4)),
                dict(softcap=5.0, alibi_slopes=torch.ones(1, 4)),
                *[dict(window=window) for window in ((8, 0), (0, 0), (3, 5), (0, 7), (-1, 2), (4, -1))],
            ):
                assert backward_wgmma.takes(q, k, v, dO, _spec(q, k, True).replace(**features)), features


def test_takes_packed_batches():
    """A packed batch ((1, heads, total, head_dim), its offsets in the spec), with GQA, causal or not, a softcap and
    ALiBi per sequence."""
    q, k, v, dO = _small(h=4, h_k=2, n_q=24, n_k=40)
    offsets = dict(
        cu_seqlens_q=torch.tensor([0, 10, 24], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 30, 40], dtype=torch.int32),
        max_seqlen_q=14,
        max_seqlen_k=30,
    )
    for causal in (False, True):
        spec = _spec(q, k, causal).replace(**offsets)
        assert spec.varlen and backward_wgmma.takes(q, k, v, dO, spec), causal
        assert backward_wgmma.takes(q, k, v, dO, spec.replace(softcap=5.0, alibi_slopes=torch.ones(2, 4)))


@pytest.mark.parametrize(
    "change, reason",
    [
        pytest.param(
            lambda q, k, v, o, s: ((q.float(), k.float(), v.float(), o.float()), s), "fp16 or bf16", id="fp32"
        ),
        pytest.param(lambda q, k, v, o, s: ((q, k.bfloat16(), v, o), s), "one dtype", id="mixed-dtypes"),
        pytest.param(lambda q, k, v, o, s: ((q, k, v, o.bfloat16()), s), "one dtype", id="dO-dtype"),
        pytest.param(
            lambda q, k, v, o, s: ((q[..., :32], k[..., :32], v[..., :32], o[..., :32]), s), "head_dim", id="D32"
        ),
        pytest.param(lambda q, k, v, o, s: ((q, k, v[..., :32], o), s), "head_dim", id="v-head-dim"),
        pytest.param(
            lambda q, k, v, o, s: ((q, k, v, o), s.replace(cache_seqlens=torch.tensor([16], dtype=torch.int32))),
            "KV cache",
            id="kv-cache",
        ),
        pytest.param(
            lambda q, k, v, o, s: ((q, torch.cat([k, k], -1)[..., ::2], v, o), s),
            "16 B aligned",
            id="k-strided-head-dim",
        ),
        pytest.param(
            lambda q, k, v, o, s: ((q, k, v, torch.randn(o.numel() + 1).half()[1:].view(o.shape)), s),
            "16 B aligned",
            id="dO-unaligned",
        ),
    ],
)
def test_refuses_what_it_does_not_compute(change, reason):
    q, k, v, dO = _small()
    (q, k, v, dO), spec = change(q, k, v, dO, _spec(q, k, False))
    assert reason in backward_wgmma.refusal(q, k, v, dO, spec)
    assert not backward_wgmma.takes(q, k, v, dO, spec)
    O, L = torch.zeros_like(q), torch.zeros(q.shape[:3])
    with pytest.raises(NotImplementedError, match="wgmma backward"):
        backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec)


def test_uses_wgmma_needs_the_switch_and_a_hopper_gpu(monkeypatch):
    q, k, v, dO = _small()
    spec = _spec(q, k, True)
    monkeypatch.setattr(backward_wgmma, "ENABLED", False)
    assert not backward_wgmma.uses_wgmma(q, k, v, dO, spec)
    monkeypatch.setattr(backward_wgmma, "ENABLED", True)
    assert not backward_wgmma.uses_wgmma(q, k, v, dO, spec), "CPU tensors (the simulator's) never take it by default"


@pytest.mark.parametrize("enabled", [False, True])
def test_backward_runs_them_only_where_uses_wgmma_holds(monkeypatch, enabled):
    """backward.flash_attn_backward calls backward_wgmma where uses_wgmma holds (here: forced, as on a Hopper GPU
    with the switch on), with neither kernels nor a config asked for; else the kernels it ran before."""
    calls = []

    def wgmma_kernels(q, k, v, O, L, dO, spec, config=None):
        calls.append("wgmma")
        return "wgmma"

    monkeypatch.setattr(backward_wgmma, "uses_wgmma", lambda q, k, v, dO, spec: enabled)
    monkeypatch.setattr(backward_wgmma, "flash_attn_backward", wgmma_kernels)
    monkeypatch.setattr(backward.backward_tc, "flash_attn_backward", lambda *a: "tc")
    monkeypatch.setattr(backward.backward_simt, "flash_attn_backward", lambda *a: "simt")
    q, k, v, dO = _small()
    O, L = torch.zeros_like(q), torch.zeros(q.shape[:3])
    spec = _spec(q, k, False)
    # CPU tensors under the simulator: backward_tc.uses_tensor_cores holds, so the tensor-core kernels run.
    unasked = "tc" if SIMULATED else "simt"
    assert backward.flash_attn_backward(q, k, v, O, L, dO, spec) == ("wgmma" if enabled else unasked)
    assert backward.flash_attn_backward(q, k, v, O, L, dO, spec, tensor_cores=True) == "tc"
    assert backward.flash_attn_backward(q, k, v, O, L, dO, spec, tensor_cores=False) == "simt"
    assert backward.flash_attn_backward(q, k, v, O, L, dO, spec, config=backward_tc.tc_bwd_config(64)) == unasked
    assert calls == (["wgmma"] if enabled else [])


@pytest.mark.parametrize(
    "features, softcap, alibi, both, window, varlen",
    [
        pytest.param(frozenset(), False, False, False, False, False, id="none"),
        pytest.param(frozenset({"softcap"}), True, False, False, False, False, id="softcap"),
        pytest.param(frozenset({"alibi"}), False, True, False, False, False, id="alibi"),
        pytest.param(frozenset({"softcap", "alibi"}), True, True, True, False, False, id="both"),
        pytest.param(frozenset({"window"}), False, False, False, True, False, id="window"),
        pytest.param(frozenset({"varlen"}), False, False, False, False, True, id="varlen"),
        pytest.param(frozenset({"window", "varlen"}), False, False, False, True, True, id="window-varlen"),
    ],
)
def test_features_on_needs_features_to_name_them(monkeypatch, features, softcap, alibi, both, window, varlen):
    """``features_on`` (part of ``uses_wgmma``): a dense or causal spec always; a softcap, ALiBi or both, a window
    other than none and causal, a packed batch, only where ``FEATURES`` names each (a packed batch with ALiBi or
    a window needs both names)."""
    monkeypatch.setattr(backward_wgmma, "FEATURES", features)
    q, k, _, _ = _small()
    spec = _spec(q, k, True)
    slopes = torch.ones(1, 2)
    offsets = torch.tensor([0, 16], dtype=torch.int32)
    packed = spec.replace(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=16, max_seqlen_k=16)
    assert backward_wgmma.features_on(spec) and backward_wgmma.features_on(_spec(q, k, False))
    assert backward_wgmma.features_on(spec.replace(softcap=5.0)) == softcap
    assert backward_wgmma.features_on(spec.replace(alibi_slopes=slopes)) == alibi
    assert backward_wgmma.features_on(spec.replace(softcap=5.0, alibi_slopes=slopes)) == both
    for sides in ((8, 0), (0, 0), (3, 5), (-1, 2), (4, -1)):
        assert backward_wgmma.features_on(spec.replace(window=sides)) == window, sides
    assert not backward_wgmma.features_on(spec.replace(window=(8, 0), alibi_slopes=slopes)), "each must be named"
    assert backward_wgmma.features_on(packed) == varlen
    assert backward_wgmma.features_on(packed.replace(alibi_slopes=slopes)) == (varlen and alibi)
    assert backward_wgmma.features_on(packed.replace(window=(8, 0))) == (varlen and window)


@pytest.mark.parametrize("on", [False, True], ids=["features-off", "features-on"])
@pytest.mark.parametrize(
    "window, softcap, alibi, sink, names",
    [
        pytest.param((-1, 0), 50.0, True, False, {"softcap", "alibi"}, id="softcap-alibi"),
        pytest.param((200, 30), 0.0, False, False, {"window"}, id="window"),
        pytest.param((-1, 0), 0.0, False, True, {"sink"}, id="sink"),
    ],
)
def test_backward_runs_features_where_features_names_them(
    wgmma_device, monkeypatch, on, window, softcap, alibi, sink, names
):
    """On a Hopper GPU with ``ENABLED``: a softcap and ALiBi input (causal), a windowed one and one with a sink
    run backward_tc's kernels with ``FEATURES`` empty, these kernels' (built with SOFTCAP and
    ALIBI, LEFT and RIGHT, or as the dense ones) with the features named; both match the reference; a class's
    second call takes the prepared launches (the slopes, the sink and dsink's shares varying tensors) and gives
    the same gradients (dsink too) bit for bit."""
    if wgmma_device.type != "cuda":
        pytest.skip("the default dispatch needs a Hopper GPU (--device cuda)")
    monkeypatch.setattr(backward_wgmma, "ENABLED", True)
    monkeypatch.setattr(backward_wgmma, "FEATURES", frozenset(names) if on else frozenset())
    q, k, v, dO = _inputs(torch.bfloat16, (2, 4, 2, 300, 333, 128), wgmma_device)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)).to(wgmma_device) if alibi else None
    features = dict(window=window, softcap=softcap, alibi_slopes=slopes)
    if sink:
        features["sink"] = make_sink(4, wgmma_device)
    O64, L64 = reference.attention(q.double(), k.double(), v.double(), **features)
    O, L = O64.to(q.dtype), L64.float()
    spec = AttentionSpec(128**-0.5, window, softcap, slopes, 2, sink=features.get("sink"))
    for cache in (backward_wgmma._KERNELS, backward_wgmma._PREPARED, backward_tc._KERNELS, backward_tc._PREPARED):
        cache.clear()  # so that the first call builds the kernels it runs
    first = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    wgmma_built = {key[:2] + key[3:8] for key in backward_wgmma._KERNELS}
    if on:
        flags = (*backward_wgmma._window_flags(spec), softcap > 0, alibi)
        assert wgmma_built == {("dkdv", 128, *flags), ("dq", 128, *flags)}, wgmma_built
    else:
        assert not wgmma_built and backward_tc._KERNELS, "backward_tc's kernels ran"
    prepares = []
    real = launch.prepare
    monkeypatch.setattr(launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    second = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    assert not prepares, "the second call of a class must take the prepared launches"
    torch.cuda.synchronize()
    assert len(first) == len(second) == (4 if sink else 3)
    for name, x, y in zip(("dq", "dk", "dv", "dsink"), first, second):
        assert torch.equal(x, y), f"{name}: max |prepared - numba| = {(x.float() - y.float()).abs().max():.3g}"
    assert_grads_match(*second[:3], q, k, v, dO, False, **features)
    if sink:
        assert_dsink_matches(second[3], q, k, v, dO, False, **features)


@pytest.mark.parametrize("on", [False, True], ids=["features-off", "features-on"])
@pytest.mark.parametrize(
    "window, names",
    [
        pytest.param((-1, 0), {"varlen"}, id="causal"),
        pytest.param((200, 30), {"varlen", "window"}, id="window"),
    ],
)
def test_backward_runs_packed_batches_where_features_names_them(wgmma_device, monkeypatch, on, window, names):
    """On a Hopper GPU with ``ENABLED``: a packed batch (bf16, D128, causal or a window, GQA 2:1) runs
    backward_tc's kernels with ``FEATURES`` empty, these kernels' (built with VARLEN, and LEFT and
    RIGHT for the window) with the features named; both match the reference. The class's first call takes other
    offsets (the same count and longest lengths): the second call takes the prepared launches, which must read
    its own cu_seqlens_q and cu_seqlens_k (the window's sizes after them), and gives numba's launches' gradients
    bit for bit."""
    if wgmma_device.type != "cuda":
        pytest.skip("the default dispatch needs a Hopper GPU (--device cuda)")
    monkeypatch.setattr(backward_wgmma, "ENABLED", True)
    monkeypatch.setattr(backward_wgmma, "FEATURES", frozenset(names) if on else frozenset())
    d, h, h_k = 128, 4, 2
    lens, first_lens = [300, 77, 512], [512, 300, 77]
    cu, first_cu = offsets(lens, wgmma_device), offsets(first_lens, wgmma_device)
    g = torch.Generator().manual_seed(3)
    q, k, v, dO = (
        torch.randn(sum(lens), heads, d, generator=g).to(device=wgmma_device, dtype=torch.bfloat16)
        for heads in (h, h_k, h_k, h)
    )
    O64, L64 = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, window=window)
    args = (*(heads_first(t) for t in (q, k, v, O64.to(q.dtype))), L64.float()[None], heads_first(dO))

    def spec(offsets):
        return AttentionSpec(d**-0.5, window, 0.0, None, h // h_k, offsets, offsets, 512, 512)

    for cache in (backward_wgmma._KERNELS, backward_wgmma._PREPARED, backward_tc._KERNELS, backward_tc._PREPARED):
        cache.clear()  # so that the first call builds the kernels it runs
    monkeypatch.setattr(launch, "FAST", False)
    expected = backward.flash_attn_backward(*args, spec(cu))
    wgmma_built = {key[:2] + key[3:6] + key[8:9] for key in backward_wgmma._KERNELS}
    if on:
        flags = (*backward_wgmma._window_flags(spec(cu)), True)
        assert wgmma_built == {("dkdv", 128, *flags), ("dq", 128, *flags)}, wgmma_built
    else:
        assert not wgmma_built and backward_tc._KERNELS, "backward_tc's kernels ran"
    monkeypatch.setattr(launch, "FAST", True)
    backward.flash_attn_backward(*args, spec(first_cu))
    prepares = []
    real = launch.prepare
    monkeypatch.setattr(launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    got = backward.flash_attn_backward(*args, spec(cu))
    assert not prepares, "the second call of a class must take the prepared launches"
    torch.cuda.synchronize()
    for name, x, y in zip(("dq", "dk", "dv"), expected, got):
        assert torch.equal(x, y), f"{name}: max |prepared - numba| = {(x.float() - y.float()).abs().max():.3g}"
    ref, tols = packed_grad_tolerances(q, k, v, dO, cu, cu, False, window=window)
    for name, x, r, tol in zip(("dq", "dk", "dv"), got, ref, tols):
        x = x[0].transpose(0, 1)
        assert max_err(x, r) <= tol, f"max |{name} - ref| = {max_err(x, r):.3g} > tolerance {tol:.3g}"


def test_features_read_the_environment_at_import():
    """FA2_NUMBA_WGMMA_BWD_FEATURES unset, "none", "", "softcap", "alibi,softcap", "window,alibi,softcap",
    "varlen", "sink,varlen": all, none, none, softcap, both, those three, packed batches, sinks and packed
    batches."""
    values = [None, "none", "", "softcap", "alibi,softcap", "window,alibi,softcap", "varlen", "sink,varlen"]
    got = values_at_import("fa2_numba_cuda.backward_wgmma", "FEATURES", "FA2_NUMBA_WGMMA_BWD_FEATURES", values)
    assert [eval(r) for r in got] == [
        {"softcap", "alibi", "window", "varlen", "sink"},
        frozenset(),
        frozenset(),
        {"softcap"},
        {"softcap", "alibi"},
        {"softcap", "alibi", "window"},
        {"varlen"},
        {"sink", "varlen"},
    ]


def test_enabled_reads_the_environment_at_import():
    """FA2_NUMBA_WGMMA_BWD unset, 1, 0: on, on, off."""
    got = values_at_import("fa2_numba_cuda.backward_wgmma", "ENABLED", "FA2_NUMBA_WGMMA_BWD", [None, "1", "0"])
    assert got == ["True", "True", "False"]
