"""fa2-pytorch's optimisation ladder (``fa2_pytorch.ladder``): every rung's forward and backward against the
fp64 reference, causal and not (including fewer queries than keys, where the causal diagonal is bottom-right),
in each dtype; the ``tiled`` rung is the default path, bit for bit; the naive rung refuses what it does not
compute. The ``compiled`` rung (torch.compile: about a minute to compile on the CPU CI) is checked on one
case."""

from __future__ import annotations

import pytest
import torch

from checks import assert_matches_reference, random_qkv
from fa2.spec import AttentionSpec
from fa2_pytorch import flash_attn_backward, flash_attn_forward, ladder
from test_gradients import assert_grads_match

SHAPES = {"B2-H2-64x64-D32": (2, 2, 64, 64, 32), "B1-H2-33x77-D16": (1, 2, 33, 77, 16)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _inputs(dtype, shape, causal, device):
    batch, heads, n_q, n_k, head_dim = SHAPES[shape]
    q, k, v = random_qkv((batch, heads, n_q, head_dim), (batch, heads, n_k, head_dim), dtype, device, seed=n_k)
    dO = random_qkv(q.shape, q.shape, dtype, device, seed=n_k + 1)[0]
    return q, k, v, dO, AttentionSpec(head_dim**-0.5, (-1, 0) if causal else (-1, -1))


def test_the_rungs():
    assert [r.name for r in ladder.RUNGS] == ["naive", "tiled", "compiled"]
    assert ladder.DEFAULT == "tiled"
    assert all(r.title and r.lever.endswith(".") for r in ladder.RUNGS)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("rung", ["naive", "tiled"])
def test_rung_matches_reference(device, rung, dtype, shape, causal):
    q, k, v, dO, spec = _inputs(dtype, shape, causal, device)
    O, L = ladder.forward(rung, q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, causal)
    dq, dk, dv = ladder.backward(rung, q, k, v, O, L, dO, spec)
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


def test_compiled_rung_matches_reference(device, monkeypatch):
    q, k, v, dO, spec = _inputs(torch.float32, "B1-H2-33x77-D16", True, device)
    # The root conftest's NaN-poisoning torch.empty is Python that Dynamo would trace into the graph (and,
    # with several conftest modules under xdist, fail to resolve); the compiled rung's outputs are its
    # graph's own allocations, checked against the reference below.
    monkeypatch.undo()
    O, L = ladder.forward("compiled", q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, True)
    dq, dk, dv = ladder.backward("compiled", q, k, v, O, L, dO, spec)
    assert_grads_match(dq, dk, dv, q, k, v, dO, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiled_rung_is_the_default_path(device, causal):
    q, k, v, dO, spec = _inputs(torch.float16, "B1-H2-33x77-D16", causal, device)
    O, L = flash_attn_forward(q, k, v, spec)
    O_r, L_r = ladder.forward(ladder.DEFAULT, q, k, v, spec)
    assert torch.equal(O_r, O) and torch.equal(L_r, L)
    for g_r, g in zip(
        ladder.backward(ladder.DEFAULT, q, k, v, O, L, dO, spec), flash_attn_backward(q, k, v, O, L, dO, spec)
    ):
        assert torch.equal(g_r, g)


def test_resources_and_unknown_rung():
    assert ladder.resources("naive") == []
    with pytest.raises(ValueError, match="no rung 'fused'.*naive, tiled, compiled"):
        ladder.resources("fused")


def test_naive_rung_refuses_what_it_does_not_compute(device):
    q, k, v, dO, _ = _inputs(torch.float32, "B2-H2-64x64-D32", False, device)
    with pytest.raises(NotImplementedError, match="window"):
        ladder.forward("naive", q, k, v, AttentionSpec(0.1, (8, 0)))
    with pytest.raises(NotImplementedError, match="heads_k 1"):
        ladder.forward("naive", q, k[:, :1], v[:, :1], AttentionSpec(0.1, group=2))
