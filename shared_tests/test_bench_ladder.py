"""``python -m fa2.bench --ladder`` (fa2.bench.ladder): the runner in emulation on a tiny shape, with the
PyTorch backend's ladder (its rungs run in milliseconds on the CPU): one checked, timed row per rung and
direction, the speedups against the first and previous rungs, the rows of other backends kept, a plot per
backend; and the command line's refusals."""

from __future__ import annotations

import csv

import pytest
import torch

from fa2 import registry
from fa2.bench import __main__ as cli
from fa2.bench import ladder

# nox's other test sessions install one other backend only.
needs_fa2_pytorch = pytest.mark.skipif(
    "pytorch" not in registry.installed(), reason="fa2-pytorch is not installed here (nox's pytorch session runs it)"
)


@needs_fa2_pytorch
def test_ladder_run_writes_rows_and_keeps_other_backends(tmp_path, monkeypatch):
    lad = ladder.ladder_module("pytorch")
    # Without the compiled rung, whose torch.compile takes about a minute on the CPU (its own test covers it).
    monkeypatch.setattr(lad, "RUNGS", tuple(r for r in lad.RUNGS if r.name != "compiled"))
    other = {c: "" for c in ladder.COLUMNS} | dict(
        backend="elsewhere", rung="r0", direction="fwd", head_dim=16, causal=True, ms=1.0, tflops=1.0
    )
    other |= dict(dtype="float16", batch=1, heads=2, seqlen=64)
    ladder.write_rows(tmp_path / "t-ladder.csv", [other])
    csv_path, plots = ladder.run(["pytorch"], torch.device("cpu"), tmp_path, "t", head_dims=(16,), causals=(True,))
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ladder.COLUMNS
    mine = [r for r in rows if r["backend"] == "pytorch"]
    assert [(r["rung"], r["direction"]) for r in mine] == [(r.name, d) for r in lad.RUNGS for d in ("fwd", "bwd")]
    for r in mine:
        assert r["problem"] == "" and float(r["ms"]) > 0 and float(r["tflops"]) > 0, r
        assert (r["head_dim"], r["causal"], r["seqlen"], r["dtype"]) == ("16", "True", "64", "float16"), r
    first = {r["direction"]: float(r["ms"]) for r in mine if r["rung"] == lad.RUNGS[0].name}
    for r in mine:
        assert float(r["speedup_vs_first"]) == pytest.approx(first[r["direction"]] / float(r["ms"]), rel=1e-3)
    assert [r["backend"] for r in rows].count("elsewhere") == 1, "a run keeps the rows of backends it does not measure"
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in plots) == ["t-ladder-elsewhere.png", "t-ladder-pytorch.png"]


def test_ladder_flags():
    assert cli.parse_args(["--ladder", "--backends", "pytorch,triton"]).backends == ("pytorch", "triton")
    for argv in (["--backends", "pytorch"], ["--ladder", "--quick"], ["--ladder", "--decode"]):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)


def test_a_backend_without_a_ladder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ladder, "ladder_module", lambda backend: None)
    with pytest.raises(ValueError, match="no ladder module"):
        ladder.run(["pytorch"], torch.device("cpu"), tmp_path, "t")
