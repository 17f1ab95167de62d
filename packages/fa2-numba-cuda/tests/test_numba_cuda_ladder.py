"""fa2-numba-cuda's optimisation ladder (``fa2_numba_cuda.ladder``): every rung's forward and backward against
the fp64 reference under the suite's FlashAttention-2 rule, causal and not, and the last rung the default path
bit for bit. Tiny shapes: under numba's simulator the tensor-core rungs run on ``mma.py``'s emulated
instructions (the rung before ``ldmatrix`` on its plain-load stand-in, a warp barrier per shuffle), which is
slow. 17 queries against 20 keys (causal: the bottom-right diagonal 3 keys in), head_dim 16, bf16, the dtype
the ladder is measured in. With --device cuda the same cases run the real instructions on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from checks import assert_matches_reference, random_qkv
from fa2.spec import AttentionSpec
from fa2_numba_cuda import (
    backward_wgmma,
    common,
    flash_attn_backward,
    flash_attn_forward,
    forward_tc,
    forward_wgmma,
    ladder,
)
from test_gradients import assert_grads_match

SHAPE_Q, SHAPE_K = (1, 1, 17, 16), (1, 1, 20, 16)
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _inputs(device):
    q, k, v = random_qkv(SHAPE_Q, SHAPE_K, torch.bfloat16, device, seed=3)
    dO = torch.randn(SHAPE_Q, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=torch.bfloat16)
    return q, k, v, dO


def _spec(causal: bool) -> AttentionSpec:
    return AttentionSpec(SHAPE_Q[-1] ** -0.5, (-1, 0) if causal else (-1, -1))


def test_rungs_are_named_once_and_end_at_the_default():
    names = [r.name for r in ladder.RUNGS]
    assert len(set(names)) == len(names), names
    assert names[0] == "simt" and names[-1] == "prepared", names
    assert all(r.title and r.lever for r in ladder.RUNGS)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("rung", [pytest.param(r.name, id=r.name) for r in ladder.RUNGS])
def test_rung_matches_reference(tc_device, rung, causal):
    q, k, v, dO = _inputs(tc_device)
    O, L = ladder.forward(rung, q, k, v, _spec(causal))
    assert_matches_reference(O, L, q, k, v, causal)
    dq, dk, dv = ladder.backward(rung, q, k, v, O, L, dO, _spec(causal))
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


@pytest.mark.parametrize("causal", CAUSAL)
def test_last_rung_is_the_default_path(tc_device, causal, monkeypatch):
    """RUNGS[-1] gives what fa2_numba_cuda's public forward and backward give, bit for bit. On a GPU that is
    their own choice (the tensor-core kernels; on Hopper with the wgmma forward and backward switched off, which
    are not rungs yet); the simulator's forward runs the SIMT kernel unless asked for the tensor-core one, as the GPU's
    choice is asked for here."""
    monkeypatch.setattr(forward_wgmma, "ENABLED", False)
    monkeypatch.setattr(backward_wgmma, "ENABLED", False)
    q, k, v, dO = _inputs(tc_device)
    spec = _spec(causal)
    if tc_device.type == "cuda":
        assert forward_tc.uses_tensor_cores(q)
    O, L = ladder.forward(ladder.RUNGS[-1].name, q, k, v, spec)
    O_default, L_default = flash_attn_forward(q, k, v, spec, tensor_cores=True if common.simulated() else None)
    assert torch.equal(O, O_default) and torch.equal(L, L_default)
    grads = ladder.backward(ladder.RUNGS[-1].name, q, k, v, O, L, dO, spec)
    for name, g, g_default in zip(("dq", "dk", "dv"), grads, flash_attn_backward(q, k, v, O, L, dO, spec)):
        assert torch.equal(g, g_default), name
    rows = ladder.resources(ladder.RUNGS[-1].name)
    if common.simulated():
        assert rows == []
    else:
        assert {r["direction"] for r in rows} == {"forward", "backward"}
        for r in rows:
            assert {"kernel", "registers_per_thread", "spilled_bytes", "shared_bytes"} <= r.keys(), r


def test_unknown_rung_and_features_are_refused():
    q = torch.zeros(SHAPE_Q, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rungs simt, mma"):
        ladder.forward("tma", q, q, q, _spec(False))
    with pytest.raises(NotImplementedError, match="softcap 2.0"):
        ladder.forward("mma", q, q, q, AttentionSpec(0.25, softcap=2.0))
