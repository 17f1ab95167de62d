"""fa2-numba-cuda's optimisation ladder (``fa2_numba_cuda.ladder``): every rung's forward and backward against
the fp64 reference under the suite's FlashAttention-2 rule, causal and not, and the last rung the default path
bit for bit. Tiny shapes: under numba's simulator the tensor-core rungs run on ``mma.py``'s emulated
instructions (the rung before ``ldmatrix`` on its plain-load stand-in, a warp barrier per shuffle), which is
slow. 17 queries against 20 keys (causal: the bottom-right diagonal 3 keys in), head_dim 16, bf16, the dtype
the ladder is measured in. With --device cuda the same cases run the real instructions on the GPU, and the
default-path check also at head_dim 64 and 128, where Hopper's default path (and the ``wgmma`` rung) runs the
wgmma kernels. The simulator's default path never does: one causal head_dim 64 case runs the ``wgmma`` rung
with ``uses_wgmma`` forced on, on ``wgmma.py``'s emulation (3–6 s on a 2-core CPU).
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
    tensor_cores,
)
from test_gradients import assert_grads_match

SHAPE_Q, SHAPE_K = (1, 1, 17, 16), (1, 1, 20, 16)
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _inputs(device, head_dim=SHAPE_Q[-1]):
    shape_q, shape_k = (*SHAPE_Q[:-1], head_dim), (*SHAPE_K[:-1], head_dim)
    q, k, v = random_qkv(shape_q, shape_k, torch.bfloat16, device, seed=3)
    dO = torch.randn(shape_q, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=torch.bfloat16)
    return q, k, v, dO


def _spec(causal: bool, head_dim=SHAPE_Q[-1]) -> AttentionSpec:
    return AttentionSpec(head_dim**-0.5, (-1, 0) if causal else (-1, -1))


def test_rungs_are_named_once_and_end_at_the_default():
    names = [r.name for r in ladder.RUNGS]
    assert len(set(names)) == len(names), names
    assert names[0] == "simt" and names[-2:] == ["prepared", "wgmma"], names
    assert all(r.title and r.lever for r in ladder.RUNGS)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("rung", [pytest.param(r.name, id=r.name) for r in ladder.RUNGS])
def test_rung_matches_reference(tc_device, rung, causal):
    q, k, v, dO = _inputs(tc_device)
    O, L = ladder.forward(rung, q, k, v, _spec(causal))
    assert_matches_reference(O, L, q, k, v, causal)
    dq, dk, dv = ladder.backward(rung, q, k, v, O, L, dO, _spec(causal))
    assert_grads_match(dq, dk, dv, q, k, v, dO, causal)


def _is_hopper(device) -> bool:
    return device.type == "cuda" and tensor_cores.capability(device) == forward_wgmma.COMPUTE_CAPABILITY


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("head_dim", [pytest.param(d, id=f"D{d}") for d in (16, 64, 128)])
def test_last_rung_is_the_default_path(tc_device, head_dim, causal):
    """RUNGS[-1] gives what fa2_numba_cuda's public forward and backward give, bit for bit. On a GPU that is
    their own choice (the tensor-core kernels; on Hopper at head_dim 64 and 128 the wgmma ones); the simulator's
    forward runs the SIMT kernel unless asked for the tensor-core one, as the GPU's choice is asked for here, and
    its last rung is the ``prepared`` rung's kernels (head_dim 16 only there: 64 and 128 would add nothing but
    emulation time)."""
    if common.simulated() and head_dim != SHAPE_Q[-1]:
        pytest.skip("the simulator's default path takes no wgmma kernel: head_dim 64 and 128 are for the GPU")
    q, k, v, dO = _inputs(tc_device, head_dim)
    spec = _spec(causal, head_dim)
    if tc_device.type == "cuda":
        assert forward_tc.uses_tensor_cores(q)
    wgmma = forward_wgmma.uses_wgmma(q, k, v, spec)
    assert wgmma == (_is_hopper(tc_device) and head_dim in forward_wgmma.HEAD_DIMS and forward_wgmma.ENABLED)
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
        mine = {r["kernel"] for r in rows if r["HEAD_DIM"] == head_dim}
        if wgmma:
            assert "wgmma" in mine, mine
        if backward_wgmma.uses_wgmma(q, k, v, dO, spec):
            assert "wgmma dkdv" in mine and "preprocess" in mine, mine
            assert ("wgmma dq" if head_dim == 128 else "tensor-core dq") in mine, mine


def test_wgmma_rung_runs_the_wgmma_kernels(tc_device, monkeypatch):
    """The ``wgmma`` rung where ``uses_wgmma`` holds: forward_wgmma's and backward_wgmma's kernels (spied on),
    against the fp64 reference; causal, head_dim 64. In the simulator ``uses_wgmma`` is forced on (it never holds
    there), on wgmma.py's emulated instructions; on a GPU only on Hopper, where it holds."""
    if tc_device.type == "cuda" and not _is_hopper(tc_device):
        pytest.skip(f"wgmma needs compute capability 9.0, got {tensor_cores.capability(tc_device)}")
    monkeypatch.setattr(forward_wgmma, "uses_wgmma", lambda q, k, v, spec: True)
    monkeypatch.setattr(backward_wgmma, "uses_wgmma", lambda q, k, v, dO, spec: True)
    called = []
    for module in (forward_wgmma, backward_wgmma):
        name = "flash_attn_forward" if module is forward_wgmma else "flash_attn_backward"
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: called.append(name) or real(*a))
    q, k, v, dO = _inputs(tc_device, 64)
    O, L = ladder.forward("wgmma", q, k, v, _spec(True, 64))
    assert_matches_reference(O, L, q, k, v, True)
    dq, dk, dv = ladder.backward("wgmma", q, k, v, O, L, dO, _spec(True, 64))
    assert_grads_match(dq, dk, dv, q, k, v, dO, True)
    assert called == ["flash_attn_forward", "flash_attn_backward"]


def test_unknown_rung_and_features_are_refused():
    q = torch.zeros(SHAPE_Q, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rungs simt, mma"):
        ladder.forward("tma", q, q, q, _spec(False))
    with pytest.raises(NotImplementedError, match="softcap 2.0"):
        ladder.forward("mma", q, q, q, AttentionSpec(0.25, softcap=2.0))
