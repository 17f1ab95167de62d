"""fa2-numba-cuda's tuners (``python -m fa2_numba_cuda.tuning.forward`` and ``.backward``), on the CPU: their
candidate grids, and one tiny run of each in which candidates with a wrong output (O; dq; dk) and one the kernels
refuse are recorded as such and never proposed.

The runs' forward and backward are the fp64 reference's, rounded to the inputs' type: the tuners' logic is under
test, not the kernels (numba's simulator takes ~20 s a call of the wgmma backward even on 64 x 64; their own tests
check them, ``test_numba_cuda_wgmma.py`` and ``test_numba_cuda_wgmma_backward.py``)."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from fa2 import reference
from fa2_numba_cuda import backward_wgmma, forward, forward_wgmma
from fa2_numba_cuda.backward_wgmma import WgmmaBwdConfig, bwd_config
from fa2_numba_cuda.common import simulated
from fa2_numba_cuda.forward_wgmma import WgmmaConfig, wgmma_config
from fa2_numba_cuda.tuning import backward as tune_backward
from fa2_numba_cuda.tuning import forward as tune_forward


def test_candidates_start_with_the_default_and_drop_duplicates():
    args = tune_backward.parse_args(["--block-m", "64,96", "--dq-block-n", "64,128", "--dq", "wgmma,tc"])
    for head_dim in (64, 128):
        for causal in (False, True):
            configs = tune_backward.candidates(args, head_dim, causal)
            assert configs[0] == bwd_config(head_dim, masked=causal)
            assert len(configs) == len(set(configs))
            # backward_tc's dQ kernel has its own tiles: one candidate per BLOCK_M, not one per DQ_BLOCK_N.
            assert {c.BLOCK_M for c in configs if not c.DQ_WGMMA} == {64, 96}
            assert len([c for c in configs if not c.DQ_WGMMA]) == 2
    # The defaults at head_dim 64 are in the grid: no extra candidate.
    assert len(tune_backward.candidates(args, 64, True)) == len(tune_backward.candidates(args, 64, False)) == 6


def test_forward_candidates_keep_the_kernels_bounds():
    args = tune_forward.parse_args(["--block-n", "64,128", "--max-registers", "0,128", "--stages", "2,3"])
    args.s_ahead, args.overlap_pv = (False, True), (False, True)
    for head_dim in (64, 128):
        configs = tune_forward.candidates(args, head_dim)
        assert configs[0] == wgmma_config(head_dim) and len(configs) == len(set(configs))
        # OVERLAP_PV takes 3 stages or more and no S_AHEAD.
        assert all(c.STAGES >= 3 and not c.S_AHEAD for c in configs if c.OVERLAP_PV)
        assert WgmmaConfig(128, False, 128, 3, True) in configs and WgmmaConfig(64, True, None, 2) in configs


def _reference_forward(q, k, v, spec, config=None):
    """The fp64 reference's O and L, but wrong or refused for some tiles (see the module docstring)."""
    if config is not None and config.BLOCK_N == 48:
        raise ValueError(f"WgmmaConfig ... got {config}")
    O, L = reference.attention(q.double(), k.double(), v.double(), spec.causal, spec.scale)
    if config is not None and config.BLOCK_N == 128:
        O = O * 1.1
    return O.to(q.dtype), L.float()


def _reference_backward(q, k, v, O, L, dO, spec, config):
    """The fp64 reference's gradients, but wrong or refused for some tiles (see the module docstring)."""
    if config.BLOCK_M == 48:
        raise ValueError(f"WgmmaBwdConfig needs ... whole copies, got {config}")
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = reference.attention(*inputs, spec.causal, spec.scale)
    dq, dk, dv = (g.to(q.dtype) for g in torch.autograd.grad(out, inputs, dO.double()))
    if config.BLOCK_M == 32:
        dk = dk * 1.1
    if config.DQ_WGMMA and config.DQ_BLOCK_N == 96:
        dq = dq * 1.1
    return dq, dk, dv


DEFAULTS = {causal: tune_backward.describe(bwd_config(64, masked=causal == "True")) for causal in ("True", "False")}
WGMMA_DQ = tune_backward.describe(WgmmaBwdConfig(64, SPLIT_MASK=True))  # the dQ kernel on wgmma, 64-key tiles


@pytest.mark.skipif(not simulated(), reason="the simulated self-check (NUMBA_ENABLE_CUDASIM=1); a GPU's is run by hand")
def test_tuner_records_wrong_and_failed_candidates(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(forward, "flash_attn_forward", _reference_forward)
    monkeypatch.setattr(backward_wgmma, "flash_attn_backward", _reference_backward)
    path = tmp_path / "tune.csv"
    argv = ["--dtypes", "fp16", "--head-dims", "64", "--seqlens", "48", "--causal", "yes,no"]
    argv += ["--tokens", "48", "--hidden", "128", "--block-m", "64,32,48", "--dq-block-n", "64,96"]
    argv += ["--rounds", "2", "--csv", str(path)]
    assert tune_backward.main(argv) == 0
    rows = list(csv.DictReader(path.open()))
    assert {(r["seqlen"], r["batch"], r["heads"]) for r in rows} == {("48", "1", "2")}
    for causal in ("True", "False"):
        status = {r["config"]: (r["status"], r["reason"]) for r in rows if r["causal"] == causal}
        assert status[DEFAULTS[causal]][0] == status[WGMMA_DQ][0] == "ok"
        wrong_dq, wrong_dk = (
            status["WgmmaBwdConfig(64, DQ_BLOCK_N=96, SPLIT_MASK=True)"],
            status["WgmmaBwdConfig(32, SPLIT_MASK=True)"],
        )
        assert wrong_dq[0] == "wrong" and wrong_dq[1].startswith("max |dq - dq_ref|")
        assert wrong_dk[0] == "wrong" and wrong_dk[1].startswith("max |dk - the default's|")
        assert status["WgmmaBwdConfig(48, SPLIT_MASK=True)"][0] == "failed"
        assert status["sdpa-flash"][0] == status["sdpa-cudnn"][0] == "skipped"
        ok = [r for r in rows if r["causal"] == causal and r["status"] == "ok"]
        assert all(float(r["ms"]) > 0 and float(r["vs_default"]) > 0 for r in ok)
    # Proposed: a candidate right on every shape (overall), on every shape of its mask (per mask).
    out = capsys.readouterr().out
    right = {c: {r["config"] for r in rows if r["causal"] == c and r["status"] == "ok"} for c in ("True", "False")}
    assert {DEFAULTS["True"], DEFAULTS["False"], WGMMA_DQ} <= right["True"] | right["False"]
    proposed = re.search(r"^head_dim 64: (WgmmaBwdConfig\(.*?\)), ", out, re.M)
    assert proposed is not None and proposed.group(1) in right["True"] & right["False"]
    for causal, mask in (("True", "causal"), ("False", "full")):
        proposed = re.search(rf"^head_dim 64, {mask}: (WgmmaBwdConfig\(.*?\)), ", out, re.M)
        assert proposed is not None and proposed.group(1) in right[causal]


@pytest.mark.skipif(not simulated(), reason="the simulated self-check (NUMBA_ENABLE_CUDASIM=1); a GPU's is run by hand")
def test_forward_tuner_records_wrong_and_failed_candidates(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(forward_wgmma, "flash_attn_forward", _reference_forward)
    path = tmp_path / "tune.csv"
    argv = ["--dtypes", "fp16", "--head-dims", "64", "--seqlens", "48", "--tokens", "48", "--hidden", "128"]
    argv += ["--block-n", "64,128,48", "--max-registers", "0,128", "--rounds", "2", "--csv", str(path)]
    assert tune_forward.main(argv) == 0
    rows = list(csv.DictReader(path.open()))
    for causal in ("True", "False"):
        status = {r["config"]: (r["status"], r["reason"]) for r in rows if r["causal"] == causal}
        assert status["WgmmaConfig(64)"][0] == status["WgmmaConfig(64, MAX_REGISTERS=128)"][0] == "ok"
        assert status[tune_forward.describe(wgmma_config(64))][0] == "ok"
        assert status["WgmmaConfig(128)"][0] == "wrong" and status["WgmmaConfig(128)"][1].startswith("max |O - O_ref|")
        assert status["WgmmaConfig(48, MAX_REGISTERS=128)"][0] == "failed"
        assert status["sdpa-flash"][0] == "skipped"
    proposed = re.search(r"^head_dim 64: (WgmmaConfig\(.*?\)), ", capsys.readouterr().out, re.M)
    right = ("WgmmaConfig(64)", "WgmmaConfig(64, MAX_REGISTERS=128)", tune_forward.describe(wgmma_config(64)))
    assert proposed is not None and proposed.group(1) in right
