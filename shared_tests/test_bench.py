"""The benchmark's harness, on the CPU. Its clock in rounds (``fa2.bench.sweep.time_rounds``), with a
scripted clock: on a GPU every provider of a shape is timed three times, every other round in reverse
order, and keeps the median of its rounds, so that one slow stretch of the machine cannot decide a ratio;
a provider whose timing raises is reported failed with the reason while the others keep their times. And
the report's matmul ceilings for rows of a sweep run in --append parts: those of the part that measured
them. And the command line: what it does by default, where it writes, and that a run which measures
nothing leaves the earlier results as they were."""

from __future__ import annotations

import pytest
import torch

from fa2 import registry
from fa2.bench import __main__ as cli
from fa2.bench import report, sweep, timing

CUDA = torch.device("cuda")


@pytest.fixture
def scripted_clock(monkeypatch):
    """Replaces timing.median_ms by the next of a provider's scripted times (an exception is raised); the
    order of the calls lands in the returned list."""
    order: list[str] = []
    script: dict[str, list] = {}

    def median_ms(call, device, first_s):
        name = call()
        order.append(name)
        value = script[name].pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(timing, "median_ms", median_ms)
    return order, script


def calls(*names):
    return {name: (lambda name=name: name, 0.001) for name in names}


def test_rounds_alternate_order_and_take_the_median(scripted_clock):
    order, script = scripted_clock
    # One slow round each: the median ignores it, a mean or the first round would not.
    script.update(a=[1.0, 9.0, 1.2], b=[2.0, 2.1, 30.0], c=[5.0, 4.0, 4.5])
    result = sweep.time_rounds(calls("a", "b", "c"), CUDA)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert result == {"a": ("ok", 1.2), "b": ("ok", 2.1), "c": ("ok", 4.5)}


def test_a_provider_that_raises_fails_alone(scripted_clock):
    order, script = scripted_clock
    script.update(a=[1.0, 1.0, 1.0], b=[2.0, RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")])
    result = sweep.time_rounds(calls("a", "b"), CUDA)
    assert result["a"] == ("ok", 1.0)
    assert result["b"] == ("failed", "RuntimeError: CUDA out of memory.")
    assert order == ["a", "b", "b", "a", "a"]  # not timed again after it failed


def test_cpu_times_once(scripted_clock):
    order, script = scripted_clock
    script.update(a=[3.0], b=[4.0])
    assert timing.rounds(torch.device("cpu")) == 1
    assert sweep.time_rounds(calls("a", "b"), torch.device("cpu")) == {"a": ("ok", 3.0), "b": ("ok", 4.0)}
    assert order == ["a", "b"]


def test_rows_get_the_ceilings_of_the_part_that_measured_them():
    parts = [{"started": "2026-11-30T06:38:47+00:00", "ceilings": {"bf16_matmul_tflops": 799.0}},
             {"started": "2026-11-30T06:46:27+00:00", "ceilings": {"bf16_matmul_tflops": 770.0}}]
    run = report.Run([], [], parts)
    first = [{"timestamp": "2026-11-30T06:39:04+00:00"}, {"timestamp": "2026-11-30T06:44:10+00:00"}]
    last = [{"timestamp": "2026-11-30T06:47:00+00:00"}]
    assert run.ceilings_of(first) == {"bf16_matmul_tflops": 799.0}
    assert run.ceilings_of(last) == {"bf16_matmul_tflops": 770.0}
    assert run.ceilings_of(first + last) == {"bf16_matmul_tflops": 799.0}


def test_cli_defaults_are_said_and_the_results_land_in_the_checkout(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    args = cli.parse_args([])
    assert args.out == registry.checkout() / "docs" / "benchmarks"
    assert args.modes == ("fwd", "bwd") and args.causal == ("no", "yes")
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "By default both modes" in text and "(default: fwd,bwd)" in text
    assert "default on a GPU 512,1024,2048,4096,8192,16384, emulated 16,32,64,128,256,512,1024" in text
    assert "dtypes on a GPU bf16, emulated fp32" in text


@pytest.mark.parametrize("append", [False, True], ids=["fresh", "append"])
def test_a_run_that_measures_nothing_keeps_the_earlier_results(tmp_path, append):
    row = "fa2-triton,fwd,bf16,64,False,4096,4,32,1.0,500,0.1,NVIDIA H200,2.11,3.6,0.30,f3a8288,2026-11-30"
    earlier = {".csv": ",".join(sweep.COLUMNS) + "\n" + row + "\n",
               "-skipped.csv": ",".join(sweep.ISSUE_COLUMNS) + "\n", "-run.json": '{"runs": []}\n'}
    for suffix, text in earlier.items():
        (tmp_path / f"h200{suffix}").write_text(text)
    # sdpa-flash needs CUDA: on the CPU every shape is skipped.
    cfg = sweep.Config(providers=("sdpa-flash",), seqlens=(16,), head_dims=(16,), causals=(False,),
                       dtypes=("fp32",), device=torch.device("cpu"), out_dir=tmp_path, name="h200", append=append)
    with pytest.raises(SystemExit, match=r"nothing was measured; .*h200\.csv and the files beside it are kept"):
        sweep.run(cfg, lambda total: cli._PlainProgress(total))
    for suffix, text in earlier.items():
        assert (tmp_path / f"h200{suffix}").read_text() == text
    assert "a CUDA kernel" in (tmp_path / "h200.partial-skipped.csv").read_text()


def test_a_run_that_measures_replaces_the_earlier_results(tmp_path):
    (tmp_path / "cpu.csv").write_text("stale\n")
    cfg = sweep.Config(providers=("sdpa-math",), seqlens=(16,), head_dims=(16,), causals=(False,),
                       dtypes=("fp32",), device=torch.device("cpu"), out_dir=tmp_path, name="cpu")
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu.csv")
    assert [(r["provider"], r["seqlen"]) for r in rows] == [("sdpa-math", "16")]
    assert not list(tmp_path.glob("*.partial*"))


def test_grouped_query_shapes_give_k_and_v_fewer_heads(tmp_path):
    """--group 2: k and v with half the heads, the check's reference on each query head's key/value head."""
    cfg = sweep.Config(providers=("sdpa-math",), seqlens=(16,), head_dims=(16,), causals=(False, True),
                       dtypes=("fp32",), device=torch.device("cpu"), out_dir=tmp_path, name="cpu-gqa2", group=2)
    assert [(s.heads, s.heads_k) for s in cfg.shapes()] == [(2, 1), (2, 1)]
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu-gqa2.csv")
    assert [(r["provider"], r["causal"]) for r in rows] == [("sdpa-math", "False"), ("sdpa-math", "True")]
    with pytest.raises(ValueError, match="--group 3 does not divide the 2 query heads"):
        sweep.Config(providers=(), seqlens=(16,), head_dims=(16,), causals=(False,), dtypes=("fp32",),
                     device=torch.device("cpu"), out_dir=tmp_path, name="x", group=3).shapes()
