"""The benchmark's harness, on the CPU. Its clock in rounds (``fa2.bench.sweep.time_rounds``), with a
scripted clock: on a GPU every provider of a shape is timed three times, every other round in reverse
order, and keeps the median of its rounds, so that one slow stretch of the machine cannot decide a ratio;
a provider whose timing raises is reported failed with the reason while the others keep their times. And
the report's matmul ceilings for rows of a sweep run in --append parts: those of the part that measured
them. And the command line: what it does by default, where it writes, and that a run which measures
nothing leaves the earlier results as they were. And issue 20's options (--group, --window, --softcap,
--heads, --fa2-entry): the visible pairs a window's TFLOP/s is counted over, against a brute-force count;
the file names; the providers skipped for an option they lack, with the reason; the check against the
reference with the same options; FlexAttention's mask and score modifiers (eager, on the CPU). And issue
21's --varlen mode: the lengths drawn from a seed, the real pairs counted, the per-sequence check (a
provider that attends across sequences is wrong), an emulated run's rows, and the providers that cannot run
recorded as skipped with their reasons. And issue 22's --decode mode: the K/V bytes a step reads, the layouts
of a point grouped (timed together), the paged cache holding the contiguous one's keys through its block
table, an emulated run (SDPA skipped on paged caches, a provider that ignores the block table wrong), issue
22's ratios from hand-made rows, the copy ceiling and the command line. And what a run without a GPU shows a
newcomer: every table it prints and writes says EMULATED (and its CSV rows), the progress bar names the provider
it checks or times, the help names what an option does rather than an issue, and each dtype's plot is drawn
against its own matmul's ceiling."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from fa2 import reference, registry
from fa2.bench import __main__ as cli
from fa2.bench import check, providers, report, sweep, timing
from fa2.bench.providers import Shape, cu_seqlens, visible_pairs

CUDA = torch.device("cuda")
# Sweeps that time fa2-pytorch on the CPU: nox's other test sessions install one other backend only.
needs_fa2_pytorch = pytest.mark.skipif(
    "pytorch" not in registry.installed(), reason="fa2-pytorch is not installed here (nox's pytorch session runs it)"
)


@pytest.fixture(autouse=True)
def small_cpu_ceilings(monkeypatch):
    """The CPU's ceilings from 64³ matmuls and a 1 MiB copy: the sweeps here check rows and files, not the
    CPU's peak, and the default 1024³ bf16 and fp16 matmuls took 7 s a sweep on CI's two cores."""
    monkeypatch.setitem(timing.CEILING_SIZE, "cpu", 64)
    monkeypatch.setitem(timing.COPY_BYTES, "cpu", 2**20)


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
    parts = [
        {"started": "2026-11-30T06:38:47+00:00", "ceilings": {"bf16_matmul_tflops": 799.0}},
        {"started": "2026-11-30T06:46:27+00:00", "ceilings": {"bf16_matmul_tflops": 770.0}},
    ]
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
    assert "issue" not in text.lower()  # the help says what an option does, not where it was asked for


def _unlabelled_tables(text: str) -> list[str]:
    """The header row of each markdown table in ``text`` whose caption or heading (the line before it, blank
    lines aside) does not say EMULATED."""
    lines = [line for line in text.splitlines() if line.strip()]
    return [
        line
        for before, line in zip(["", *lines], lines)
        if line.startswith("|") and not before.startswith("|") and "EMULATED" not in before
    ]


@needs_fa2_pytorch
def test_an_emulated_run_says_so_in_every_table_it_prints_and_writes(monkeypatch, tmp_path, capsys):
    """python -m fa2.bench without a GPU: the tables printed at the end open with report.EMULATED_NOTE and each
    one's caption or heading says EMULATED (a ratio such as 0.002x SDPA math must not read as a GPU's), as do
    the .md's tables and every row of the CSV; a GPU run's tables say nothing of it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key, value in cli.EMULATION.items():
        monkeypatch.setenv(key, value)  # as main sets them before it runs again: no second interpreter here
    cli.main(
        [
            "--providers",
            "fa2-pytorch,sdpa-math",
            "--seqlens",
            "16,32",
            "--head-dims",
            "16",
            "--dtypes",
            "fp32",
            "--causal",
            "no",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    tables = printed[printed.index("**EMULATED") : printed.index("\nwrote ")]
    assert tables.startswith(f"**{report.EMULATED_NOTE}**")
    assert "| fa2-pytorch | fp32 | 16 | no | H2 |" in tables  # the ratio table itself
    assert tables.count("\n|---") == 4 and not _unlabelled_tables(tables)  # fwd and bwd: summary, per shape
    md = (tmp_path / "cpu-emulated.md").read_text()
    assert md.count("\n|---") == 6 and not _unlabelled_tables(md.split("## Not measured")[0])  # + TFLOP/s
    assert {r["gpu"] for r in sweep.read_csv(tmp_path / "cpu-emulated.csv")} == {"cpu (emulated, not GPU speed)"}

    run = report.load(tmp_path, "cpu-emulated")
    on_a_gpu = report.Run(run.results, run.issues, [{**run.info, "emulated": False}])
    text = "\n".join(report.ratio_tables(on_a_gpu))
    assert "EMULATED" not in text and "\nRatio of TFLOP/s (above 1: the fa2 backend is faster)" in text


class _RecordingBar(cli._PlainProgress):
    """A progress bar that keeps every postfix it is given."""

    def __init__(self, total: int):
        super().__init__(total)
        self.postfixes: list[str] = []

    def set_postfix_str(self, text: str) -> None:
        self.postfixes.append(text)


@needs_fa2_pytorch
def test_the_progress_bar_names_the_provider_it_checks_and_times(tmp_path):
    """While a shape's providers are timed the bar shows which one (it showed "timing <shape>", read as a
    provider named timing)."""
    cfg = sweep.Config(
        providers=("fa2-pytorch", "sdpa-math"),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
    )
    bars = []
    sweep.run(cfg, lambda total: bars.append(_RecordingBar(total)) or bars[-1])
    [shape] = cfg.shapes()
    assert bars[0].postfixes == [
        f"fa2-pytorch {shape}: checking",
        f"sdpa-math {shape}: checking",
        f"fa2-pytorch {shape}: timing",
        f"sdpa-math {shape}: timing",
    ]


def test_each_dtype_is_drawn_against_its_own_matmul(monkeypatch):
    """The plots' ceiling line is the panel dtype's matmul; runs recorded before fp16 matmuls were timed draw
    bf16's on fp16 panels and say so. A run times all three."""
    from fa2.bench.plot import matmul_ceiling

    ceilings = {
        "matmul_size": 8192,
        "bf16_matmul_tflops": 800.0,
        "fp16_matmul_tflops": 700.0,
        "fp32_matmul_tflops": 50.0,
    }
    assert [matmul_ceiling(ceilings, d) for d in ("bf16", "fp16", "fp32")] == [
        ("bf16 matmul 8192³: 800 TFLOP/s", 800.0),
        ("fp16 matmul 8192³: 700 TFLOP/s", 700.0),
        ("fp32 matmul 8192³: 50 TFLOP/s", 50.0),
    ]
    earlier = {"matmul_size": 8192, "bf16_matmul_tflops": 800.0}
    assert matmul_ceiling(earlier, "fp16") == (
        "bf16 matmul 8192³: 800 TFLOP/s (no fp16 matmul timed in this run)",
        800.0,
    )
    assert matmul_ceiling(earlier, "fp32") is None
    measured = timing.matmul_ceilings(torch.device("cpu"))
    assert set(measured) == {"matmul_size", "bf16_matmul_tflops", "fp16_matmul_tflops", "fp32_matmul_tflops"}
    assert all(measured[k] > 0 for k in measured)


@pytest.mark.parametrize("append", [False, True], ids=["fresh", "append"])
def test_a_run_that_measures_nothing_keeps_the_earlier_results(tmp_path, append):
    row = "fa2-triton,fwd,bf16,64,False,4096,4,32,1.0,500,0.1,NVIDIA H200,2.11,3.6,0.30,f3a8288,2026-11-30"
    earlier = {
        ".csv": ",".join(sweep.COLUMNS) + "\n" + row + "\n",
        "-skipped.csv": ",".join(sweep.ISSUE_COLUMNS) + "\n",
        "-run.json": '{"runs": []}\n',
    }
    for suffix, text in earlier.items():
        (tmp_path / f"h200{suffix}").write_text(text)
    # sdpa-flash needs CUDA: on the CPU every shape is skipped.
    cfg = sweep.Config(
        providers=("sdpa-flash",),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="h200",
        append=append,
    )
    with pytest.raises(SystemExit, match=r"nothing was measured; .*h200\.csv and the files beside it are kept"):
        sweep.run(cfg, lambda total: cli._PlainProgress(total))
    for suffix, text in earlier.items():
        assert (tmp_path / f"h200{suffix}").read_text() == text
    assert "a CUDA kernel" in (tmp_path / "h200.partial-skipped.csv").read_text()


def test_append_keeps_the_other_providers_skipped_rows(tmp_path):
    """--append with an earlier skipped row of a provider this run does not measure: the row stays as it was
    (no results-only column such as tbps added to it)."""
    skipped = "sdpa,fwd,fp32,16,False,16,1,2,2,-1,0,,0,0,skipped,no reason,2026-12-01"
    (tmp_path / "cpu-skipped.csv").write_text(",".join(sweep.ISSUE_COLUMNS) + "\n" + skipped + "\n")
    cfg = sweep.Config(
        providers=("sdpa-math",),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
        append=True,
    )
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    assert [r["provider"] for r in sweep.read_csv(tmp_path / "cpu.csv")] == ["sdpa-math"]
    assert (tmp_path / "cpu-skipped.csv").read_text().splitlines()[1:] == [skipped]


def test_a_run_that_measures_replaces_the_earlier_results(tmp_path):
    (tmp_path / "cpu.csv").write_text("stale\n")
    cfg = sweep.Config(
        providers=("sdpa-math",),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
    )
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu.csv")
    assert [(r["provider"], r["seqlen"]) for r in rows] == [("sdpa-math", "16")]
    assert not list(tmp_path.glob("*.partial*"))


def test_grouped_query_shapes_give_k_and_v_fewer_heads(tmp_path):
    """--group 2: k and v with half the heads, the check's reference on each query head's key/value head."""
    cfg = sweep.Config(
        providers=("sdpa-math",),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False, True),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu-gqa2",
        groups=(2,),
    )
    assert [(s.heads, s.heads_k) for s in cfg.shapes()] == [(2, 1), (2, 1)]
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu-gqa2.csv")
    assert [(r["provider"], r["causal"]) for r in rows] == [("sdpa-math", "False"), ("sdpa-math", "True")]
    with pytest.raises(ValueError, match="--group 3 does not divide the 2 query heads"):
        sweep.Config(
            providers=(),
            seqlens=(16,),
            head_dims=(16,),
            causals=(False,),
            dtypes=("fp32",),
            device=torch.device("cpu"),
            out_dir=tmp_path,
            name="x",
            groups=(3,),
        ).shapes()


def _brute_force_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """The visible pairs one by one, from the contract's rule (bottom-right, -1 unbounded)."""
    shift = seqlen_k - seqlen_q
    return sum(
        (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)
        for i in range(seqlen_q)
        for j in range(seqlen_k)
    )


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k", [(1, 1), (17, 17), (113, 113), (5, 23), (23, 5), (64, 0)], ids=lambda n: str(n)
)
@pytest.mark.parametrize(
    "window",
    [(-1, -1), (-1, 0), (0, 0), (4, 0), (16, 0), (200, 0), (3, 5), (-1, 2), (7, -1)],
    ids=lambda w: f"w{w[0]}_{w[1]}",
)
def test_visible_pairs_count_exactly(seqlen_q, seqlen_k, window):
    assert visible_pairs(seqlen_q, seqlen_k, window) == _brute_force_pairs(seqlen_q, seqlen_k, *window)


def test_tflops_count_the_visible_pairs():
    """A window's FLOPs: 4·B·H·D·pairs with the pairs counted exactly, the backward 2.5 times; full N², causal
    N²/2 as before (the FlashAttention-2 paper's count)."""
    n, w, d, b, h = 113, 16, 64, 2, 3
    base = Shape("bf16", d, True, n, b, h)
    windowed = dataclasses.replace(base, window=w)
    assert windowed.window_pair == (w, 0) and base.window_pair == (-1, -1)
    assert windowed.pairs == _brute_force_pairs(n, n, w, 0) == (w + 1) * n - w * (w + 1) // 2
    assert windowed.flops == 4 * b * h * d * windowed.pairs
    assert dataclasses.replace(windowed, mode="bwd").flops == 4 * b * h * d * windowed.pairs * 5 // 2
    assert base.pairs == n * n // 2 and dataclasses.replace(base, causal=False).pairs == n * n
    # A window over every key is causal, counted exactly: n (n + 1) / 2, n / 2 pairs more than causal's count.
    assert dataclasses.replace(base, window=n).pairs == n * (n + 1) // 2
    # issue 20's window: 4096 keys at N = 16k.
    assert dataclasses.replace(base, seqlen=16384, window=4096).pairs == 4097 * 16384 - 4096 * 4097 // 2


@pytest.mark.parametrize(
    "argv, suffix",
    [
        ([], ""),
        (["--group", "4"], "-gqa4"),
        (["--group", "1,4", "--heads", "32"], "-gqa4-h32"),
        (["--group", "2,4"], "-gqa2+4"),
        (["--window", "4096"], "-w4096"),
        (["--window", "none,4096"], "-w4096"),
        (["--softcap", "0,50"], "-cap50"),
        (["--softcap", "30,50"], "-cap30+50"),
        (["--quick", "--group", "4", "--window", "none,64", "--softcap", "0,2.5"], "-quick-gqa4-w64-cap2.5"),
        (["--group", "4", "--fa2-entry", "attention"], "-gqa4-attention"),
        (["--fa2-entry", "sdpa"], "-sdpa"),
        (["--group", "4", "--window", "none,64"], "-gqa4-w64"),
        (["--varlen"], "-varlen"),
        (["--varlen", "--varlen-seed", "3", "--quick"], "-varlen-seed3-quick"),
        (["--varlen", "--heads", "32"], "-varlen-h32"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_file_names_encode_the_options(argv, suffix):
    assert cli.options_suffix(cli.parse_args(argv)) == suffix


def test_options_parse_and_default():
    args = cli.parse_args(["--group", "1,4", "--window", "none,4096", "--softcap", "0,50"])
    assert args.group == (1, 4) and args.window == (-1, 4096) and args.softcap == (0.0, 50.0)
    assert args.causal == ("yes",)  # a window is causal
    assert args.fa2_entry == "attention"  # SDPA's signature has no window or softcap
    assert cli.parse_args(["--group", "4"]).fa2_entry == "sdpa"  # issue 20 measures GQA through SDPA
    assert cli.parse_args([]).fa2_entry == "attention"
    assert cli.parse_args(["--window", "none"]).causal == ("no", "yes")
    for bad in (["--window", "-2"], ["--window", "x"], ["--softcap", "-1"], ["--softcap", "inf"], ["--group", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_shapes_put_windows_on_causal_shapes_only(tmp_path):
    cfg = sweep.Config(
        providers=(),
        seqlens=(16,),
        head_dims=(16,),
        causals=(False, True),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="x",
        windows=(-1, 4),
        softcaps=(0.0, 2.0),
        groups=(1, 2),
        heads=4,
    )
    shapes = cfg.shapes()
    assert {(s.causal, s.window) for s in shapes} == {(False, -1), (True, -1), (True, 4)}
    assert len(shapes) == 2 * 3 * 2 and {s.heads for s in shapes} == {4} and {s.heads_k for s in shapes} == {4, 2}
    with pytest.raises(ValueError, match="window \\(W, 0\\) with causal=True: give --causal yes"):
        dataclasses.replace(cfg, causals=(False,)).shapes()
    assert {s.window for s in dataclasses.replace(cfg, windows=(4,)).shapes()} == {4}  # no windowless shapes


def _issues(path):
    return {(r["provider"], r["window"], r["softcap"]): r["reason"] for r in sweep.read_csv(path)}


@needs_fa2_pytorch
def test_providers_without_an_option_are_skipped_with_the_reason(tmp_path):
    """SDPA has no window or softcap: sdpa-math is skipped there, saying so, and measured on the plain shape;
    fa2-pytorch (through fa2.attention) is measured on all of them, checked against the reference with the
    same options."""
    cfg = sweep.Config(
        providers=("fa2-pytorch", "sdpa-math"),
        seqlens=(32,),
        head_dims=(16,),
        causals=(True,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
        windows=(-1, 4),
        softcaps=(0.0, 2.0),
        groups=(2,),
    )
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu.csv")
    measured = {(r["provider"], r["window"], r["softcap"]) for r in rows}
    assert measured == {("fa2-pytorch", w, c) for w in ("-1", "4") for c in ("0", "2")} | {("sdpa-math", "-1", "0")}
    assert {r["heads_k"] for r in rows} == {"1"}
    issues = _issues(tmp_path / "cpu-skipped.csv")
    assert issues[("sdpa-math", "4", "0")] == (
        "window 4: sdpa-math: SDPA has no sliding window (only an explicit "
        "attn_mask, which would not be a sliding window kernel)"
    )
    assert issues[("sdpa-math", "-1", "2")].startswith("softcap 2: sdpa-math: SDPA has no softcap")
    assert issues[("sdpa-math", "4", "2")].startswith("window 4: ")
    assert not any(p == "fa2-pytorch" for p, _, _ in issues)
    windowed = next(r for r in rows if (r["provider"], r["window"], r["softcap"]) == ("fa2-pytorch", "4", "0"))
    shape = Shape("fp32", 16, True, 32, 1, 2, "fwd", 2, 4)
    assert float(windowed["tflops"]) == pytest.approx(shape.flops / (float(windowed["ms"]) * 1e-3) / 1e12, rel=1e-4)
    summary = "\n".join(report.ratio_tables(report.load(tmp_path, "cpu")))
    assert "| window | fa2-pytorch | fp32 | 16 | yes | H2/1 w4 / H2/1 |" in summary
    assert "| softcap | fa2-pytorch | fp32 | 16 | yes | H2/1 w4 cap2 / H2/1 w4 |" in summary


@needs_fa2_pytorch
def test_fa2_through_sdpa_skips_what_sdpa_cannot_say(tmp_path):
    """--fa2-entry sdpa: fa2.scaled_dot_product_attention(enable_gqa=True) is what is timed (its O checked);
    a window has no place in SDPA's signature, so that shape is skipped with the reason."""
    calls = []
    real = providers.fa2.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    cfg = sweep.Config(
        providers=("fa2-pytorch",),
        seqlens=(16,),
        head_dims=(16,),
        causals=(True,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
        windows=(-1, 4),
        groups=(1, 2),
        fa2_entry="sdpa",
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(providers.fa2, "scaled_dot_product_attention", spy)
        sweep.run(cfg, lambda total: cli._PlainProgress(total))
    assert calls and all(c == {"is_causal": True, "enable_gqa": True, "backend": "pytorch"} for c in calls)
    rows = sweep.read_csv(tmp_path / "cpu.csv")
    assert {(r["heads_k"], r["window"]) for r in rows} == {("2", "-1"), ("1", "-1")}
    issues = _issues(tmp_path / "cpu-skipped.csv")
    assert issues[("fa2-pytorch", "4", "0")] == (
        "window 4: --fa2-entry sdpa: fa2.scaled_dot_product_attention has SDPA's signature, no sliding window "
        "(--fa2-entry attention has)"
    )


def test_the_check_uses_the_options(tmp_path, monkeypatch):
    """A provider that ignores the window or the softcap it was given fails the check ("wrong", not timed):
    the reference computes what was asked for."""

    def ignores(option):
        def build(shape, device):
            kept = dataclasses.replace(shape, **{option: providers.Shape.__dataclass_fields__[option].default})
            return lambda q, k, v: tuple(
                t.to(q.dtype if t.dim() == 4 else torch.float32)
                for t in reference.attention(q, k, v, kept.causal, window=kept.window_pair, softcap=kept.softcap)
            )

        return build

    fakes = {
        f"ignores-{o}": providers.Provider(f"ignores-{o}", ignores(o), cuda_only=False, windows=True, softcaps=True)
        for o in ("window", "softcap")
    }
    monkeypatch.setattr(sweep, "PROVIDERS", {**providers.PROVIDERS, **fakes})
    cfg = sweep.Config(
        providers=("sdpa-math", *fakes),
        seqlens=(64,),
        head_dims=(16,),
        causals=(True,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu",
        windows=(-1, 4),
        softcaps=(0.0, 1.0),
    )
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    measured = {(r["provider"], r["window"], r["softcap"]) for r in sweep.read_csv(tmp_path / "cpu.csv")}
    assert ("ignores-window", "-1", "1") in measured and ("ignores-softcap", "4", "0") in measured
    wrong = {
        (r["provider"], r["window"], r["softcap"])
        for r in sweep.read_csv(tmp_path / "cpu-skipped.csv")
        if r["status"] == "wrong"
    }
    assert wrong == {
        ("ignores-window", "4", "0"),
        ("ignores-window", "4", "1"),
        ("ignores-softcap", "-1", "1"),
        ("ignores-softcap", "4", "1"),
    }


@pytest.mark.parametrize(
    "window, softcap, group",
    [(-1, 0.0, 1), (5, 0.0, 2), (-1, 1.5, 1), (5, 1.5, 2)],
    ids=["causal", "w5-gqa2", "cap1.5", "w5-cap1.5-gqa2"],
)
def test_flex_mods_compute_the_reference(window, softcap, group):
    """flex's mask_mod and score_mod for a shape, run eagerly on the CPU (the benchmark compiles them on a GPU),
    against the reference with the same options."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    shape = Shape("fp32", 16, True, 40, 1, 4, group=group, window=window, softcap=softcap)
    mask_mod, score_mod = providers.flex_mods(shape)
    block_mask = create_block_mask(mask_mod, None, None, 40, 40, device="cpu")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16) for h in (4, shape.heads_k, shape.heads_k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's eager mode warns that it is not compiled
        O, L = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, enable_gqa=group > 1
        )
    O_ref, L_ref = reference.attention(q, k, v, True, window=shape.window_pair, softcap=softcap)
    assert (O.double() - O_ref).abs().max() < 1e-5 and (L.double() - L_ref).abs().max() < 1e-5


# Issue 21: packed batches (--varlen).


def test_packed_lengths_are_drawn_from_the_seed():
    """The lengths lie in [low, high] and sum to the tokens; the same seed gives the same batch."""
    for tokens, low, high in ((16384, 256, 4096), (256, 16, 64), (100, 1, 7), (300, 300, 300)):
        for seed in range(5):
            lengths = sweep.Packing(tokens, low, high, seed).lengths()
            assert sum(lengths) == tokens and all(low <= n <= high for n in lengths), (tokens, seed, lengths)
            assert lengths == sweep.Packing(tokens, low, high, seed).lengths()
    assert sweep.Packing(16384, 256, 4096, 0).lengths() != sweep.Packing(16384, 256, 4096, 1).lengths()
    assert sweep.Packing(200, 16, 4096).lengths() == (200,)  # at most high: one sequence
    for bad in ((10, 16, 64), (256, 0, 64), (256, 64, 16), (300, 200, 200)):
        with pytest.raises(ValueError, match="a packed batch needs"):
            sweep.Packing(*bad).lengths()


def test_packed_flops_count_the_real_pairs():
    """Σ n² full, Σ n (n + 1) / 2 causal (each sequence's own pairs, brute-force counted), 4·H·D·pairs, the
    backward 2.5 times; batch and seqlen must be the sequences' number and total."""
    lengths, d, h = (1, 17, 113, 256), 64, 3
    full = Shape("bf16", d, False, sum(lengths), len(lengths), h, lengths=lengths)
    causal = dataclasses.replace(full, causal=True)
    assert full.varlen and not Shape("bf16", d, False, 16, 1, h).varlen
    assert full.pairs == sum(n * n for n in lengths) == 1 + 289 + 12769 + 65536
    assert (
        causal.pairs == sum(_brute_force_pairs(n, n, -1, 0) for n in lengths) == sum(n * (n + 1) // 2 for n in lengths)
    )
    assert causal.flops == 4 * h * d * causal.pairs
    assert dataclasses.replace(causal, mode="bwd").flops == 4 * h * d * causal.pairs * 5 // 2
    assert full.work == h * d * sum(n * n for n in lengths)
    assert "packed B4 H3 N387 D64 causal" in str(causal)
    with pytest.raises(ValueError, match="a packed shape has batch = the number of sequences"):
        Shape("bf16", d, False, 400, len(lengths), h, lengths=lengths)


def test_packed_reference_is_each_sequences_own():
    """The check's sample of a packed batch holds every sequence's first and last row, and its reference is
    fa2.reference.varlen_attention's there."""
    lengths, heads = (5, 1, 30, 12), 3
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, 16) for _ in range(3))
    cu = cu_seqlens(lengths, torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 36, 48]

    def view(t):
        return t.transpose(0, 1).unsqueeze(0)

    sample = check.reference_sample(view(q), view(k), view(v), True, lengths=lengths)
    assert set(cu[:-1].tolist()) | set((cu[1:] - 1).tolist()) <= set(sample.rows.tolist())
    O, L = reference.varlen_attention(q, k, v, cu, cu, True)
    rows, head_idx = sample.rows, sample.head_idx
    assert torch.equal(sample.O_ref[0], O[rows][:, head_idx].transpose(0, 1))
    assert torch.equal(sample.L_ref[0], L[head_idx][:, rows])


def _across_sequences(shape, device):
    """A wrong packed provider: one attention over the whole batch, as if it were one sequence."""

    def call(q, k, v):
        O, L = reference.attention(*(t.transpose(0, 1) for t in (q, k, v)), shape.causal)
        return O.transpose(0, 1).to(q.dtype), L.float()

    return call


def _refuses(shape, device):
    def call(q, k, v):
        raise NotImplementedError("fa2-example refuses packed batches (issue 21)")

    return call


@needs_fa2_pytorch
def test_an_emulated_varlen_run(tmp_path, monkeypatch):
    """--varlen on the CPU: a row per (mode, causal) for each provider that runs, TFLOP/s over the real pairs
    of the recorded lengths, the dense reference rows of the fa2 backends, and every (provider, shape) not
    measured in the skipped CSV with its reason: SDPA-NJT's math path has no is_causal, flex is not compiled
    on the CPU, a backend's NotImplementedError, the providers without a packed or a dense path. A provider
    that attends across sequences fails the check."""
    fakes = {
        "across-sequences": providers.Provider(
            "across-sequences", _across_sequences, cuda_only=False, modes=("fwd", "bwd")
        ),
        "fa2-example": providers.Provider("fa2-example", _refuses, cuda_only=False, modes=("fwd", "bwd")),
    }
    monkeypatch.setattr(sweep, "VARLEN_PROVIDERS", {**providers.VARLEN_PROVIDERS, **fakes})
    packing = sweep.Packing(96, 8, 40, seed=1)
    lengths = packing.lengths()
    cfg = sweep.Config(
        providers=("fa2-pytorch", "sdpa-njt", "flex", "sdpa-math", *fakes),
        seqlens=(32,),
        head_dims=(16,),
        causals=(False, True),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu-varlen",
        modes=("fwd", "bwd"),
        varlen=packing,
    )
    sweep.run(cfg, lambda total: cli._PlainProgress(total))
    rows = sweep.read_csv(tmp_path / "cpu-varlen.csv")
    recorded = " ".join(map(str, lengths))
    measured = {(r["provider"], r["mode"], r["causal"], r["lengths"]) for r in rows}
    assert measured == (
        {
            ("fa2-pytorch", m, c, lengths)
            for m in ("fwd", "bwd")
            for c in ("False", "True")
            for lengths in (recorded, "")
        }
        | {("sdpa-njt", m, "False", recorded) for m in ("fwd", "bwd")}
    )
    for r in rows:
        if r["lengths"]:
            assert (int(r["seqlen"]), int(r["batch"])) == (96, len(lengths))
            shape = Shape(
                "fp32",
                16,
                r["causal"] == "True",
                96,
                len(lengths),
                2,
                r["mode"],
                lengths=tuple(map(int, r["lengths"].split())),
            )
            pairs = sum(n * (n + 1) // 2 if shape.causal else n * n for n in lengths)
            assert shape.flops == 4 * 2 * 16 * pairs * (5 / 2 if r["mode"] == "bwd" else 1)
        else:
            assert (r["seqlen"], r["batch"]) == ("32", "3")
            shape = Shape("fp32", 16, r["causal"] == "True", 32, 3, 2, r["mode"])
        assert float(r["tflops"]) == pytest.approx(shape.flops / (float(r["ms"]) * 1e-3) / 1e12, rel=1e-4)

    issues = {
        (r["provider"], r["mode"], r["causal"], bool(r["lengths"])): (r["status"], r["reason"])
        for r in sweep.read_csv(tmp_path / "cpu-varlen-skipped.csv")
    }
    for mode in ("fwd", "bwd"):
        status, reason = issues["sdpa-njt", mode, "True", True]
        assert status == "skipped" and "has no MATH kernel for is_causal=True" in reason
        assert "not supported when is_causal=True" in reason  # torch's own words, from its log
        for causal in ("False", "True"):
            assert issues["flex", mode, causal, True] == ("skipped", providers._FLEX_ON_CPU)
            assert issues["fa2-example", mode, causal, True] == (
                "skipped",
                "NotImplementedError: fa2-example refuses packed batches (issue 21)",
            )
            assert issues["across-sequences", mode, causal, True][0] == "wrong"
            assert issues["sdpa-math", mode, causal, True][1].startswith("packed: sdpa-math has no packed-batch path")
            assert (
                issues["sdpa-njt", mode, causal, False][1] == "dense: sdpa-njt is timed on packed batches only "
                "(--varlen)"
            )
            assert issues["sdpa-math", mode, causal, False][1].startswith(
                "--varlen: the dense shapes are the fa2 backends' own reference"
            )
    assert ("fa2-pytorch", "fwd", "False", True) not in issues
    assert sweep.read_runs(tmp_path / "cpu-varlen-run.json")[0]["varlen"] == {
        "tokens": 96,
        "low": 8,
        "high": 40,
        "seed": 1,
        "lengths": list(lengths),
    }

    run = report.load(tmp_path, "cpu-varlen")
    assert run.varlen
    summary = "\n".join(report.ratio_tables(run))
    assert summary.startswith(f"**{report.EMULATED_NOTE}**") and not _unlabelled_tables(summary)
    assert "| fa2 backend | mode | / dense 32 (target 0.95) | / sdpa-njt (target 1) | / flex (target 1) |" in summary
    assert "| fa2-pytorch | backward | fp32 | 16 | 2 | yes |" in summary
    text = report.markdown(run, "cpu-varlen", [])
    assert f"96 tokens in {len(lengths)} sequences of lengths {', '.join(map(str, lengths))}" in text
    assert "random.Random(1)" in text and "| sdpa-njt | skipped | NotImplementedError: SDPA on nested" in text


def test_varlen_refuses_the_dense_options():
    for argv in (
        ["--varlen", "--window", "64"],
        ["--varlen", "--group", "2"],
        ["--varlen", "--softcap", "30"],
        ["--varlen", "--fa2-entry", "sdpa"],
    ):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
    args = cli.parse_args(["--varlen"])
    assert args.varlen and args.varlen_seed == 0 and args.providers is None and args.fa2_entry == "attention"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_document_mask_computes_the_reference(causal):
    """flex's document mask (eager, on the CPU; the benchmark compiles it on a GPU) on a packed batch of
    (1, H, total, D) views of (total, H, D) tensors, against the per-sequence reference."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths = (7, 1, 40, 16)
    total = sum(lengths)
    mask_mod = providers.document_mask_mod(providers.document_ids(lengths, torch.device("cpu")), causal)
    block_mask = create_block_mask(mask_mod, None, None, total, total, device="cpu")
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, 2, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's eager mode warns that it is not compiled
        O, L = flex_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask, return_lse=True
        )
    cu = cu_seqlens(lengths, torch.device("cpu"))
    O_ref, L_ref = reference.varlen_attention(q, k, v, cu, cu, causal)
    assert (O[0].transpose(0, 1).double() - O_ref).abs().max() < 1e-5 and (L[0].double() - L_ref).abs().max() < 1e-5


# Issue 22: KV-cache decoding (--decode).


def _decode_shape(page_size=0, **kw):
    return Shape(
        **{
            "dtype": "fp16",
            "head_dim": 16,
            "causal": False,
            "seqlen": 40,
            "batch": 2,
            "heads": 4,
            "group": 2,
            "seqlen_q": 4,
            "page_size": page_size,
            **kw,
        }
    )


def test_decode_shapes_count_the_cache_they_read():
    """A decode step reads K and V once: 2·B·H_k·K·D elements; every query sees every cached key."""
    s = _decode_shape()
    assert s.decode and not s.varlen and s.heads_k == 2 and s.queries == 4
    assert s.kv_bytes == 2 * 2 * 2 * 40 * 16 * 2
    assert Shape("bf16", 128, False, 131072, 1, 32, group=4, seqlen_q=1).kv_bytes == 2 * 8 * 131072 * 128 * 2
    assert s.pairs == 4 * 40 and s.flops == 4 * 2 * 4 * 16 * 4 * 40 and s.work == 2 * 4 * 4 * 40 * 16
    assert str(_decode_shape(16)) == "decode fp16 B2 H4/2 q4 K40 D16 paged16"
    with pytest.raises(ValueError, match="a decode shape is the forward of plain attention"):
        _decode_shape(causal=True)
    with pytest.raises(ValueError, match="only a decode shape"):
        Shape("fp16", 16, False, 40, 2, 4, page_size=16)


def test_decode_shapes_group_their_layouts(tmp_path):
    """Per point the contiguous cache, then each page size, measured (and timed) together."""
    cfg = sweep.Config(
        providers=(),
        seqlens=(),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp16",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="x",
        decode=sweep.Decode(((2, 40), (1, 64)), (1, 4), (16, 32), 4, 2),
    )
    shapes = cfg.shapes()
    assert len(shapes) == 2 * 2 * 3
    groups = sweep.timing_groups(shapes)
    assert [[s.page_size for s in g] for g in groups] == [[0, 16, 32]] * 4
    assert [(g[0].seqlen_q, g[0].batch, g[0].seqlen) for g in groups] == [
        (1, 2, 40),
        (1, 1, 64),
        (4, 2, 40),
        (4, 1, 64),
    ]
    assert {(s.heads, s.heads_k) for s in shapes} == {(4, 2)}
    assert {(s.heads, s.heads_k) for s in dataclasses.replace(cfg, heads=8).shapes()} == {(8, 4)}
    with pytest.raises(ValueError, match="--decode times the forward"):
        dataclasses.replace(cfg, modes=("fwd", "bwd")).shapes()
    dense = [Shape("fp16", 16, False, 32, 1, 2), Shape("fp16", 16, True, 32, 1, 2)]
    assert sweep.timing_groups(dense) == [[dense[0]], [dense[1]]]


@pytest.mark.parametrize("page_size", [16, 32, 7], ids=lambda p: f"page{p}")
def test_decode_inputs_hold_the_same_keys_in_every_layout(page_size):
    """The caches are transposed views of flash-attn's layouts; the paged one, read through its block table (a
    permutation of the pages), holds the contiguous one's keys."""
    group = [_decode_shape(), _decode_shape(page_size)]
    torch.manual_seed(0)
    (q, k, v), cache_seqlens, layouts = sweep.decode_inputs(group, torch.device("cpu"))
    assert q.shape == (2, 4, 4, 16) and q.transpose(1, 2).is_contiguous()
    assert k.shape == v.shape == (2, 2, 40, 16) and k.transpose(1, 2).is_contiguous()
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.tolist() == [40, 40]
    k0, v0, table0 = layouts[0]
    assert table0 is None and torch.equal(k0, k) and torch.equal(v0, v)
    k_pages, v_pages, table = layouts[page_size]
    pages_per_seq = -(-40 // page_size)
    assert table.dtype == torch.int32 and table.shape == (2, pages_per_seq)
    assert sorted(table.flatten().tolist()) == list(range(2 * pages_per_seq))
    assert k_pages.shape == (2 * pages_per_seq, 2, page_size, 16) and k_pages.transpose(1, 2).is_contiguous()
    for pages, logical in ((k_pages, k), (v_pages, v)):
        gathered = pages[table.flatten().long()].transpose(1, 2).reshape(2, pages_per_seq * page_size, 2, 16)
        assert torch.equal(gathered[:, :40].transpose(1, 2), logical)


def _ignores_block_table(shape, device):
    """A wrong decode provider: reads the pages in storage order, as if the block table were the identity."""

    def call(q, k, v, cache_seqlens, block_table):
        if block_table is not None:
            k, v = (
                t.transpose(1, 2)
                .reshape(shape.batch, -1, shape.heads_k, shape.head_dim)[:, : shape.seqlen]
                .transpose(1, 2)
                for t in (k, v)
            )
        O, L = reference.attention(q, k, v)
        return O.to(q.dtype), L.float()

    return call


def _refuses_decode(shape, device):
    def call(q, k, v, cache_seqlens, block_table):
        raise NotImplementedError("fa2-example has no KV-cache path")

    return call


@needs_fa2_pytorch
def test_an_emulated_decode_run(tmp_path, monkeypatch):
    """--decode on the CPU: a row per (provider, layout) that runs, K/V TB/s from the recorded shape, the copy
    ceiling and the sweep in the run's JSON; SDPA skipped on the paged caches with the reason, a backend's
    NotImplementedError skipped, a provider that ignores the block table wrong on the paged caches alone."""
    fakes = {
        "ignores-block-table": providers.Provider(
            "ignores-block-table", _ignores_block_table, cuda_only=False, paged=True
        ),
        "fa2-example": providers.Provider("fa2-example", _refuses_decode, cuda_only=False, paged=True),
    }
    monkeypatch.setattr(sweep, "DECODE_PROVIDERS", {**providers.DECODE_PROVIDERS, **fakes})
    decode = sweep.Decode(((2, 40),), (1, 4), (16,), 4, 2)
    cfg = sweep.Config(
        providers=("fa2-pytorch", "sdpa", "sdpa-flash", "flex", "sdpa-math", *fakes),
        seqlens=(40,),
        head_dims=(16,),
        causals=(False,),
        dtypes=("fp32",),
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name="cpu-decode",
        decode=decode,
    )
    bars = []
    sweep.run(cfg, lambda total: bars.append(_RecordingBar(total)) or bars[-1])
    # The bar names each (provider, layout) as it is timed, the layouts of a point in the same rounds.
    contiguous, paged = cfg.shapes()[:2]
    assert {f"fa2-pytorch {contiguous}: timing", f"fa2-pytorch {paged}: timing", f"sdpa {contiguous}: timing"} <= set(
        bars[0].postfixes
    )
    rows = sweep.read_csv(tmp_path / "cpu-decode.csv")
    measured = {(r["provider"], r["seqlen_q"], r["page_size"]) for r in rows}
    assert measured == (
        {(p, q, page) for p in ("fa2-pytorch", "ignores-block-table") for q in ("1", "4") for page in ("0", "16")}
        - {("ignores-block-table", q, "16") for q in ("1", "4")}
        | {("sdpa", q, "0") for q in ("1", "4")}
    )  # sdpa-flash: fp16/bf16 only
    for r in rows:
        shape = Shape("fp32", 16, False, 40, 2, 4, group=2, seqlen_q=int(r["seqlen_q"]), page_size=int(r["page_size"]))
        assert (r["heads_k"], r["batch"], r["seqlen"]) == ("2", "2", "40")
        assert float(r["tbps"]) == pytest.approx(shape.kv_bytes / (float(r["ms"]) * 1e-3) / 1e12, rel=1e-4)

    issues = {
        (r["provider"], r["seqlen_q"], r["page_size"]): (r["status"], r["reason"])
        for r in sweep.read_csv(tmp_path / "cpu-decode-skipped.csv")
    }
    for q in ("1", "4"):
        assert issues["ignores-block-table", q, "16"][0] == "wrong"
        assert issues["fa2-example", q, "0"] == ("skipped", "NotImplementedError: fa2-example has no KV-cache path")
        assert issues["sdpa", q, "16"] == (
            "skipped",
            "paged cache: SDPA has no paged cache (the paged rows are each fa2 backend's, against its contiguous rows)",
        )
        assert issues["sdpa-flash", q, "0"] == ("skipped", "fp32: SDPA's FlashAttention-2 kernel takes fp16/bf16 only")
        assert issues["flex", q, "0"] == ("skipped", providers._FLEX_ON_CPU)
        assert issues["sdpa-math", q, "0"][1].startswith("decode: sdpa-math has no KV-cache path here")
    info = sweep.read_runs(tmp_path / "cpu-decode-run.json")[0]
    assert info["decode"] == {"points": [[2, 40]], "queries": [1, 4], "page_sizes": [16], "heads": 4, "group": 2}
    assert info["ceilings"]["copy_tbps"] > 0 and info["ceilings"]["copy_bytes"] == timing.COPY_BYTES["cpu"]

    run = report.load(tmp_path, "cpu-decode")
    assert run.decode and not run.varlen
    summary = "\n".join(report.ratio_tables(run))
    assert summary.startswith(f"**{report.EMULATED_NOTE}**") and not _unlabelled_tables(summary)
    assert "| fa2 backend | sdpa time / its (target 1) | sdpa-flash time / its (target 1) |" in summary
    assert "| provider | cache | q1 B2 K40 | q4 B2 K40 |" in summary
    text = report.markdown(run, "cpu-decode", [])
    assert "1, 4 query tokens at (batch, cached keys) (2, 40), the cache contiguous and in pages of 16" in text
    assert "| ignores-block-table | wrong | max |O - O_ref|" in text


def _decode_row(provider, ms, page_size=0, seqlen=32768, seqlen_q=1, batch=8):
    shape = Shape("bf16", 128, False, seqlen, batch, 32, group=4, seqlen_q=seqlen_q, page_size=page_size)
    return {
        "provider": provider,
        "mode": "fwd",
        "dtype": "bf16",
        "head_dim": 128,
        "causal": False,
        "seqlen": seqlen,
        "batch": batch,
        "heads": 32,
        "heads_k": 8,
        "window": -1,
        "softcap": 0.0,
        "lengths": (),
        "seqlen_q": seqlen_q,
        "page_size": page_size,
        "ms": ms,
        "tflops": 0.0,
        "tbps": shape.kv_bytes / (ms * 1e-3) / 1e12,
        "peak_mem_gb": None,
        "gpu": "NVIDIA H200",
        "timestamp": "2026-12-01T00:00:01+00:00",
    }


def test_decode_ratios_are_issue_22s():
    """SDPA's time over the backend's on the contiguous cache, the backend's rate over the copy ceiling (the
    target from 32k keys only), paged over contiguous, fa2-numba-cuda's rate over fa2-triton's."""
    copy = _decode_row("x", 0.1)["tbps"] * 1.25  # 0.1 ms is 80% of the copy ceiling at 32k
    rows = [
        _decode_row("fa2-triton", 0.1),
        _decode_row("fa2-triton", 0.125, page_size=16),
        _decode_row("fa2-numba-cuda", 0.4),
        _decode_row("sdpa", 0.2),
        _decode_row("sdpa-flash", 0.05),
        _decode_row("fa2-triton", 0.02, seqlen=8192),
        _decode_row("sdpa", 0.02, seqlen=8192),
    ]
    run = report.Run(rows, [], [{"started": "2026-12-01T00:00:00+00:00", "ceilings": {"copy_tbps": copy}}])
    got = {(x["row"]["provider"], x["row"]["page_size"], x["row"]["seqlen"]): x for x in report.decode_ratios(run)}
    triton = got["fa2-triton", 0, 32768]
    assert triton["sdpa"] == pytest.approx(2.0) and triton["sdpa-flash"] == pytest.approx(0.5)
    assert triton["copy"] == pytest.approx(0.8) and triton["paged"] is None and triton["fa2-triton"] is None
    assert got["fa2-triton", 16, 32768]["paged"] == pytest.approx(0.8) and got["fa2-triton", 16, 32768]["sdpa"] is None
    assert got["fa2-numba-cuda", 0, 32768]["fa2-triton"] == pytest.approx(0.25)
    assert got["sdpa", 0, 32768]["sdpa"] is None and got["sdpa", 0, 32768]["sdpa-flash"] == pytest.approx(0.25)
    assert got["fa2-triton", 0, 8192]["sdpa"] == pytest.approx(1.0)
    summary = "\n".join(report.decode_tables(run))
    # The copy column counts the 32k row alone (8k's fraction is far lower), the paged one the paged row.
    assert "| fa2-triton | 1.00 (2) | 0.50 (1) | 0.80 (1) | 0.80 (1) | — |" in summary
    assert "| fa2-numba-cuda | 0.50 (1) | 0.12 (1) | 0.20 (1) | — | 0.25 (1) |" in summary


def test_the_copy_ceiling_counts_read_and_written():
    got = timing.copy_ceiling(torch.device("cpu"))
    assert got["copy_bytes"] == timing.COPY_BYTES["cpu"] and got["copy_tbps"] > 0


@pytest.mark.parametrize(
    "argv, suffix",
    [
        (["--decode"], "-decode"),
        (["--decode", "--quick"], "-decode-quick"),
        (["--decode", "--group", "8"], "-decode-gqa8"),
        (["--decode", "--heads", "64"], "-decode-h64"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_decode_file_names(argv, suffix):
    assert cli.options_suffix(cli.parse_args(argv)) == suffix


def test_decode_options_parse_and_refuse_the_others():
    args = cli.parse_args(
        ["--decode", "--decode-points", "8x32768,1X131072", "--decode-queries", "1,4", "--page-sizes", "none"]
    )
    assert args.decode_points == ((8, 32768), (1, 131072)) and args.decode_queries == (1, 4) and args.page_sizes == ()
    assert args.causal == ("no",) and args.group is None
    assert cli.parse_args(["--decode", "--page-sizes", "16,256"]).page_sizes == (16, 256)
    assert cli.parse_args([]).group == (1,)
    for bad in (
        ["--decode", "--varlen"],
        ["--decode", "--window", "64"],
        ["--decode", "--softcap", "30"],
        ["--decode", "--causal", "yes"],
        ["--decode", "--group", "2,4"],
        ["--decode", "--fa2-entry", "sdpa"],
        ["--decode-points", "8x32768"],
        ["--page-sizes", "16"],
        ["--decode", "--decode-points", "8"],
        ["--decode", "--decode-points", "0x16"],
        ["--decode", "--page-sizes", "0"],
    ):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
