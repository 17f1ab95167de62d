"""``python -m fa2.bench.ring`` (issue 25 item 4's multi-GPU benchmark), emulated on the CPU: worlds of 1 and 2
processes on gloo with fa2-pytorch, tiny shapes, write the CSVs, the run's JSON and the report, labelled EMULATED;
every point is checked against one device before it is timed; torch-cp, whose ring runs CUDA SDPA kernels only,
is recorded as skipped with PyTorch's message; a ring that gives wrong numbers is recorded as failed, not timed.

Runs once, in the pytorch session (``--backend pytorch``, or no --backend): the benchmark's CPU mode uses
fa2-pytorch whatever backend the session tests. NCCL, several GPUs and torch-cp's real ring are not tested here:
they need a multi-GPU machine (docs/notes/context-parallel.md, "The multi-GPU benchmark")."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from fa2 import registry
from fa2.bench import ring


@pytest.fixture
def pytorch_session(request):
    chosen = request.config.getoption("--backend")
    if chosen is not None and "pytorch" not in chosen:
        pytest.skip("the benchmark's emulated run uses fa2-pytorch: it runs once, with --backend pytorch")
    if "pytorch" not in registry.installed():
        pytest.skip("fa2-pytorch is not installed here (nox's pytorch session runs it)")


def test_an_emulated_ring_run(pytorch_session, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ring.main(
        ["--worlds", "1,2", "--tokens-per-gpu", "16,32", "--heads", "2", "--head-dim", "16", "--out", str(tmp_path)]
    )
    name = "cpu-emulated-ring"
    plotted = importlib.util.find_spec("matplotlib") is not None  # the plot needs it; CI's venv has none
    for suffix in (".csv", "-skipped.csv", "-run.json", ".md", *((".png",) if plotted else ())):
        assert (tmp_path / f"{name}{suffix}").is_file(), suffix
    rows = ring.read_csv(tmp_path / f"{name}.csv")
    measured = {(r["world"], r["tokens_per_gpu"], r["provider"], r["mode"]) for r in rows}
    for world in ("1", "2"):
        for tokens in ("16", "32"):
            for mode in ("fwd", "bwd"):
                assert (world, tokens, "fa2-pytorch", mode) in measured
                assert (world == "2") == ((world, tokens, "comm", mode) in measured)
    for r in rows:
        assert r["gpu"] == "cpu (emulated, not GPU speed)" and r["layout"] == "zigzag" and r["dtype"] == "fp32"
        assert int(r["seqlen"]) == int(r["world"]) * int(r["tokens_per_gpu"])
        assert float(r["ms"]) > 0 and float(r["ms_fastest_rank"]) <= float(r["ms"])
        if r["provider"] == "comm":
            assert float(r["gbps"]) > 0 and not r["tflops_per_gpu"]
        else:
            assert r["checked"] == "yes" and float(r["tflops_per_gpu"]) > 0
            flops = ring.flops_per_gpu(1, 2, int(r["seqlen"]), 16, int(r["world"]), r["mode"])
            assert float(r["tflops_per_gpu"]) == pytest.approx(flops / float(r["ms"]) / 1e9, rel=1e-3)
    issues = ring.read_csv(tmp_path / f"{name}-skipped.csv")
    torch_cp = [i for i in issues if i["provider"] == "torch-cp"]
    assert len(torch_cp) == 8 and {i["status"] for i in torch_cp} == {"skipped"}
    assert all("NotImplementedError" in i["reason"] for i in torch_cp)
    assert {(i["world"], i["provider"]) for i in issues} - {(i["world"], "torch-cp") for i in torch_cp} == {
        ("1", "comm")
    }
    runs = json.loads((tmp_path / f"{name}-run.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["emulated"] and runs[0]["worlds"] == [1, 2]
    assert runs[0]["distributed_backend"] == "gloo"
    md = (tmp_path / f"{name}.md").read_text()
    assert md.startswith("# fa2.distributed.ring_attention on several GPUs: EMULATED on the CPU")
    tables = md.count("\n|---|")
    assert tables == 4 and md.count("**EMULATED, not GPU speed.**") == tables - 1  # all but "Not measured"
    assert "| 16 | " in md and "(1.00)" in md
    assert "wrote " in capsys.readouterr().out

    # --append: world 2 again replaces its rows and keeps world 1's.
    ring.main(
        ["--worlds", "2", "--tokens-per-gpu", "16", "--heads", "2", "--head-dim", "16", "--append"]
        + ["--out", str(tmp_path)]
    )
    again = ring.read_csv(tmp_path / f"{name}.csv")
    assert {(r["world"], r["tokens_per_gpu"]) for r in again} == {("1", "16"), ("1", "32"), ("2", "16"), ("2", "32")}
    assert len(again) == len(rows)
    assert len(json.loads((tmp_path / f"{name}-run.json").read_text())["runs"]) == 2


def test_a_wrong_ring_is_recorded_and_not_timed(pytorch_session, tmp_path, monkeypatch):
    """A group of one in this process (gloo): a ring whose O is off by 1% fails the check against the fp64
    reference and gets a failed row per mode, no timing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    right = ring.fa2_ring

    def wrong(backend):
        attention = right(backend)

        def off(q, k, v):
            O, L = attention(q, k, v)
            return O * 1.01, L

        return off

    monkeypatch.setattr(ring, "fa2_ring", wrong)
    cfg = ring.Config(
        worlds=(1,),
        tokens_per_gpu=(16,),
        batch=1,
        heads=2,
        head_dim=16,
        dtype="fp32",
        backends=("pytorch",),
        providers=("fa2",),
        modes=ring.MODES,
        rotate="alltoall",
        warmups=0,
        repeats=1,
        check_limit=ring.CHECK_LIMIT,
        device_type="cpu",
        out_dir=tmp_path,
        name="wrong",
        append=False,
        command="",
    )
    records = ring.Records(cfg, {})
    records.start()
    ring.worker(0, 1, cfg, {}, str(tmp_path / "store"))
    assert ring.read_csv(tmp_path / "wrong.partial.csv") == []
    issues = ring.read_csv(tmp_path / "wrong.partial-skipped.csv")
    failed = [(i["provider"], i["mode"], i["status"]) for i in issues if i["provider"] != "comm"]
    assert failed == [("fa2-pytorch", "fwd", "failed"), ("fa2-pytorch", "bwd", "failed")]
    assert all("against the fp64 reference: max |O - O_ref|" in i["reason"] for i in issues if i["provider"] != "comm")
