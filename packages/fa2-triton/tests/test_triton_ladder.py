"""fa2-triton's optimisation ladder (``fa2_triton.ladder``): every rung's forward and backward against the
fp64 reference, causal and not, on tiny shapes (a whole-tile one and a ragged one, which the seed's one
masked loop and the split loops mask differently); the last rung is the default path, bit for bit, and the
rung before it the tile table's entry; resources come from the compiler on a GPU, none in the interpreter.
The Gluon rung's own kernel runs only on a Hopper GPU: elsewhere its case is skipped with the reason (the
default path it runs there is checked by test_last_rung_is_the_default_path)."""

from __future__ import annotations

import pytest
import torch

import fa2_triton
from checks import assert_matches_reference, random_qkv
from fa2.spec import AttentionSpec
from fa2_triton import forward_gluon, ladder
from fa2_triton.backward import flash_attn_backward
from fa2_triton.common import INTERPRETED
from fa2_triton.forward import flash_attn_forward
from fa2_triton.tiles import Tiles
from test_gradients import assert_grads_match

# Every rung on small inputs as on long ones: short calls pass over the descriptors and the Gluon rung
# (conftest.long_calls).
pytestmark = pytest.mark.usefixtures("long_calls")

# (batch, heads, seqlen, head_dim): whole tiles at D = 128 (the Gluon kernel's shape on a Hopper GPU), and a
# ragged length whose last key tile is partial.
SHAPES = {"B1-H2-128-D128": (1, 2, 128, 128), "B2-H1-77-D32": (2, 1, 77, 32)}
CASES = [
    pytest.param(torch.float16, "B1-H2-128-D128", id="fp16-B1-H2-128-D128"),
    pytest.param(torch.float16, "B2-H1-77-D32", id="fp16-B2-H1-77-D32"),
    pytest.param(torch.float32, "B2-H1-77-D32", id="fp32-B2-H1-77-D32"),
    pytest.param(torch.bfloat16, "B1-H2-128-D128", id="bf16-B1-H2-128-D128"),
]


@pytest.fixture
def native_or_interpreted(device):
    mode = fa2_triton.availability()[0]
    if device.type == "cuda" and mode != "native":
        pytest.skip(f"fa2-triton does not run natively here ({mode})")
    if device.type == "cpu" and not INTERPRETED:
        pytest.skip("fa2-triton was imported without TRITON_INTERPRET=1: its kernels need a GPU")


def _inputs(dtype, shape, causal, device):
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; bf16 is tested on the GPU")
    batch, heads, seqlen, head_dim = SHAPES[shape]
    q, k, v = random_qkv((batch, heads, seqlen, head_dim), (batch, heads, seqlen, head_dim), dtype, device, seed=seqlen)
    dO = random_qkv(q.shape, q.shape, dtype, device, seed=seqlen + 1)[0]
    return q, k, v, dO, AttentionSpec(head_dim**-0.5, (-1, 0) if causal else (-1, -1))


def test_the_rungs():
    names = [r.name for r in ladder.RUNGS]
    assert names[0] == "minimal" and names[-1] == "gluon", names
    assert len(set(names)) == len(names), names
    for r in ladder.RUNGS:
        assert r.title and r.lever.endswith("."), r
        if r.name in ("tma", "warp-specialize", "gluon"):
            assert "Hopper" in r.title, f"{r.name}: a rung that needs Hopper says so"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape", CASES)
@pytest.mark.parametrize("rung", [r.name for r in ladder.RUNGS])
def test_rung_matches_reference(native_or_interpreted, device, rung, dtype, shape, causal):
    q, k, v, dO, spec = _inputs(dtype, shape, causal, device)
    if rung == "gluon" and not forward_gluon.uses_gluon(q, k, v, spec):
        pytest.skip(
            "the Gluon kernel does not take these inputs here (it needs a Hopper GPU with Gluon, not the "
            "interpreter; 16-bit, D = 128, no mask, N a multiple of 128): this rung runs the default tl path, "
            "checked by test_last_rung_is_the_default_path"
        )
    O, L = ladder.forward(rung, q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, causal)
    dq, dk, dv = ladder.backward(rung, q, k, v, O, L, dO, spec)
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape", CASES)
def test_last_rung_is_the_default_path(native_or_interpreted, device, dtype, shape, causal):
    """RUNGS[-1] is flash_attn_forward / flash_attn_backward as fa2 calls them, bit for bit; where the Gluon
    kernel does not take the inputs, the rung before it is the same path too (the table's entry, every
    lever of it climbed)."""
    q, k, v, dO, spec = _inputs(dtype, shape, causal, device)
    O, L = flash_attn_forward(q, k, v, spec)
    grads = flash_attn_backward(q, k, v, O, L, dO, spec)
    rungs = [ladder.RUNGS[-1].name]
    if not forward_gluon.uses_gluon(q, k, v, spec):
        rungs.append(ladder.RUNGS[-2].name)
    for rung in rungs:
        O_r, L_r = ladder.forward(rung, q, k, v, spec)
        assert torch.equal(O_r, O) and torch.equal(L_r, L), rung
        for g_r, g in zip(ladder.backward(rung, q, k, v, O, L, dO, spec), grads):
            assert torch.equal(g_r, g), rung


def test_resources(native_or_interpreted, device):
    q, k, v, dO, spec = _inputs(torch.float16, "B2-H1-77-D32", True, device)
    O, L = ladder.forward("minimal", q, k, v, spec)
    ladder.backward("minimal", q, k, v, O, L, dO, spec)
    found = ladder.resources("minimal")
    if INTERPRETED:
        assert found == [], "the interpreter compiles nothing"
        return
    names = {r["kernel"] for r in found}
    assert {"_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dq", "_attn_bwd_dkdv"} <= names, names
    for r in found:
        assert r["registers_per_thread"] > 0 and r["spilled_bytes"] >= 0 and r["shared_bytes"] >= 0, r


def test_unknown_rung():
    with pytest.raises(ValueError, match="no rung 'fast'.*minimal"):
        ladder.resources("fast")


def test_natural_units_take_no_sink(native_or_interpreted, device):
    """The minimal rung's natural-unit softmax (Tiles.exp2=False) refuses a sink rather than misplace it."""
    q, k, v, _, _ = _inputs(torch.float16, "B2-H1-77-D32", False, device)
    spec = AttentionSpec(32**-0.5, sink=torch.zeros(1, device=device))
    with pytest.raises(NotImplementedError, match="sink"):
        flash_attn_forward(q, k, v, spec, Tiles(64, 64, 4, 1, exp2=False))
