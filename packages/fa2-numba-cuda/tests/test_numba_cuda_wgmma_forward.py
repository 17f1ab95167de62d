"""fa2-numba-cuda's forward on Hopper's wgmma (``fa2_numba_cuda.forward_wgmma``), on unless FA2_NUMBA_WGMMA=0.

- the kernel against the fp64 reference (``checks.assert_matches_reference``, outputs NaN-poisoned by the suite's
  conftest), on numba's simulator (``wgmma.py``'s and ``mma.py``'s emulations, fp16, head_dim 64, a few tiles) or,
  with --device cuda, on a GPU of compute capability 9.0 (fp16 and bf16, head_dim 64 and 128): whole tiles,
  ragged seqlen_q and seqlen_k, seqlen_q below and above seqlen_k under causal (rows that see no key), GQA;
- ``refusal``/``takes`` refusing what the kernel does not compute, ``uses_wgmma`` off without the switch or a
  Hopper GPU, and ``fa2_numba_cuda.forward`` running it only where ``uses_wgmma`` holds (``ENABLED``
  monkeypatched).

The simulator checks the index math against the ISA's tables as ``wgmma.py`` reads them, and the ordering of
cp.async, the wgmma waits and the fences as its emulation models them (not the async proxy); only the GPU run
shows the hardware agrees. On the GPU: pytest --device cuda with NUMBA_ENABLE_CUDASIM unset.
"""

from __future__ import annotations

import pytest
import torch

import fa2
from checks import assert_matches_reference, random_qkv, values_at_import
from fa2.spec import AttentionSpec
from fa2_numba_cuda import common, forward, forward_wgmma, tensor_cores

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
    """config: None (``wgmma_config``'s) or a ``WgmmaConfig``."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    name = f"{kind}-B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else "") + f"-{n_q}x{n_k}-D{d}"
    name += "-causal" if causal else "-full"
    if config is not None:
        name += f"-N{config.BLOCK_N}" + ("-ahead" if config.S_AHEAD else "")
        name += f"-maxreg{config.MAX_REGISTERS}" if config.MAX_REGISTERS else ""
        name += f"-stages{config.STAGES}" if config.STAGES != 2 else ""
        name += "-overlap" if config.OVERLAP_PV else ""
    return pytest.param(dtype, (b, h, h_k, n_q, n_k, d), causal, config, id=name)


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


@pytest.mark.parametrize(
    "change, reason",
    [
        pytest.param(lambda q, k, v, s: ((q.float(), k.float(), v.float()), s), "fp16 or bf16", id="fp32"),
        pytest.param(lambda q, k, v, s: ((q, k.bfloat16(), v), s), "one dtype", id="mixed-dtypes"),
        pytest.param(lambda q, k, v, s: ((q[..., :32], k[..., :32], v[..., :32]), s), "head_dim", id="head-dim-32"),
        pytest.param(lambda q, k, v, s: ((q, k, v[..., :32]), s), "head_dim", id="v-head-dim"),
        pytest.param(lambda q, k, v, s: ((q, k, v), s.replace(window=(8, 0))), "window", id="window"),
        pytest.param(lambda q, k, v, s: ((q, k, v), s.replace(softcap=5.0)), "softcap", id="softcap"),
        pytest.param(lambda q, k, v, s: ((q, k, v), s.replace(alibi_slopes=torch.ones(1, 2))), "ALiBi", id="alibi"),
        pytest.param(lambda q, k, v, s: ((q, k, v), s.replace(sink=torch.zeros(2))), "sink", id="sink"),
        pytest.param(
            lambda q, k, v, s: (
                (q, k, v),
                s.replace(cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 16])),
            ),
            "packed",
            id="varlen",
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
