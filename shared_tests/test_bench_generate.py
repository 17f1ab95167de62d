"""``python -m fa2.bench.generate`` (issue 39's end-to-end transformers benchmark), emulated on the CPU: a tiny
random Llama with fa2-pytorch and transformers' sdpa writes its CSVs, the run's JSON, the report and the plot,
every one of them labelled EMULATED; fa2's greedy tokens agree with sdpa's, and the training step's packed
loss equals its padded one. A provider that runs out of memory is recorded as skipped, with the reason, and the
run goes on. Skipped, with the reason, where transformers or fa2-pytorch is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types

import pytest
import torch

from fa2 import registry

pytest.importorskip("transformers", reason=f"transformers is not installed: {registry.install_command('transformers')}")
pytestmark = pytest.mark.skipif(
    "pytorch" not in registry.installed(), reason="fa2-pytorch is not installed here (nox's pytorch session runs it)"
)

from fa2.bench import generate  # noqa: E402 - needs transformers, checked above


def test_an_emulated_generate_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    generate.main(["--providers", "fa2-pytorch,sdpa", "--batches", "1,2", "--new-tokens", "8", "--out", str(tmp_path)])
    name = "cpu-emulated-generate"
    plotted = importlib.util.find_spec("matplotlib") is not None  # the plot needs it; CI's venv has none
    for suffix in (".csv", "-skipped.csv", "-run.json", ".md", *((".png",) if plotted else ())):
        assert (tmp_path / f"{name}{suffix}").is_file(), suffix
    rows = generate.read_csv(tmp_path / f"{name}.csv")
    measured = {(r["part"], r["provider"], r["layout"], r["batch"]) for r in rows}
    for provider in ("fa2-pytorch", "sdpa"):
        for layout in ("unpadded", "left-padded"):
            assert {("generate", provider, layout, "1"), ("generate", provider, layout, "2")} <= measured
        assert {("train", provider, "padded", "4"), ("train", provider, "packed", "1")} <= measured
    assert {r["gpu"] for r in rows} == {"cpu (emulated, not GPU speed)"}
    assert all(float(r["tokens_per_s"]) > 0 for r in rows if r["part"] == "generate")
    # fp32 on the CPU: fa2's greedy tokens are sdpa's, checked at batch 1 on the unpadded prompt only.
    agree = {(r["provider"], r["batch"], r["layout"]): r["agree"] for r in rows if r["agree"]}
    assert agree == {("fa2-pytorch", "1", "unpadded"): str(generate.CHECK_TOKENS)}
    losses = {(r["provider"], r["layout"]): float(r["loss"]) for r in rows if r["part"] == "train"}
    for provider in ("fa2-pytorch", "sdpa"):
        assert losses[provider, "packed"] == pytest.approx(losses[provider, "padded"], rel=1e-4)
    run = json.loads((tmp_path / f"{name}-run.json").read_text())["runs"]
    assert len(run) == 1 and run[0]["emulated"] and run[0]["model"]["num_hidden_layers"] == 2
    md = (tmp_path / f"{name}.md").read_text()
    assert md.startswith("# fa2 end to end in transformers: EMULATED on the CPU")
    tables = md.count("\n|---|")
    assert tables == 6 and md.count("**EMULATED, not GPU speed.**") == tables  # every table but the last, none
    assert "Nothing: every point ran." in md
    assert "wrote " in capsys.readouterr().out


def test_sdpa_without_cudnn_is_sdpa_with_cudnn_left_out():
    """sdpa-no-cudnn sets transformers' sdpa and runs inside an SDPA context without cuDNN's kernel (the
    flash and math kernels stay on); every other provider is itself, outside any context."""
    assert generate.attn_implementation("sdpa-no-cudnn") == "sdpa"
    assert generate.attn_implementation("fa2-triton") == "fa2-triton"
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with generate.provider_context("sdpa-no-cudnn"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with generate.provider_context("sdpa"):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert "sdpa-no-cudnn" in generate.default_providers(emulated=False)


def _tiny_config(tmp_path, name: str, providers: tuple[str, ...], batch: int) -> generate.Config:
    """A CPU run's Config of one generate point (batch, 8-token prompt, unpadded, 2 new tokens)."""
    return generate.Config(
        providers=providers,
        batches=(batch,),
        prompts=(8,),
        new_tokens=2,
        padding=("unpadded",),
        parts=("generate",),
        repeats=1,
        seed=0,
        defaults=generate.DEFAULTS[True, False],
        device=torch.device("cpu"),
        out_dir=tmp_path,
        name=name,
        append=False,
        command="",
    )


def test_out_of_memory_is_skipped_with_the_reason(tmp_path):
    """A point that runs out of memory is recorded as skipped (any other exception as failed) and None is
    returned, so that the run goes on."""
    cfg = _tiny_config(tmp_path, "oom", ("eager",), batch=1)
    records = generate.Records(cfg, {})
    key = dict(part="generate", provider="eager", layout="unpadded", batch=32, prompt=8192, new_tokens=2)

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB\nmore text")

    def broken():
        raise NotImplementedError("no such path")

    assert generate._attempt(records, key, cfg.device, oom) is None
    assert generate._attempt(records, {**key, "batch": 8}, cfg.device, broken) is None
    issues = generate.read_csv(tmp_path / "oom.partial-skipped.csv")
    assert [(i["batch"], i["status"], i["reason"]) for i in issues] == [
        ("32", "skipped", "out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 GiB"),
        ("8", "failed", "NotImplementedError: no such path"),
    ]


def test_a_run_stopped_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """Rows are written as they are measured (but the check point's, which wait for sdpa's tokens): a run that
    a time-limited device call stops in the middle of a point keeps that point's rows measured so far."""
    cfg = _tiny_config(tmp_path, "stopped", ("sdpa", "eager"), batch=2)
    records = generate.Records(cfg, {})
    model = types.SimpleNamespace(config=types.SimpleNamespace(pad_token_id=255, vocab_size=256))
    model.set_attn_implementation = lambda name: setattr(model, "attn", name)

    def timed(cfg, model, input_ids, mask):
        if model.attn == "eager":
            raise KeyboardInterrupt  # the call's timeout, mid-point
        return 0.1, ""

    monkeypatch.setattr(generate, "_warm_up", lambda *a: (torch.zeros(2, 2, dtype=torch.long), 0.01))
    monkeypatch.setattr(generate, "_timed_generate", timed)
    with pytest.raises(KeyboardInterrupt):
        generate.run_generate(cfg, model, list(cfg.providers), records)
    rows = generate.read_csv(tmp_path / "stopped.partial.csv")
    assert [(r["provider"], r["batch"], r["tokens_per_s"]) for r in rows] == [("sdpa", "2", "40")]


def test_timed_rounds_interleave_the_providers(tmp_path, monkeypatch):
    """Every provider is warmed up first; then each round times every provider once, the order reversed every
    other round, and a row is each provider's median: a drift of the host's speed falls on all alike. A
    provider that fails a round is recorded and leaves the later rounds."""
    cfg = dataclasses.replace(_tiny_config(tmp_path, "rounds", ("sdpa", "eager", "fa2-pytorch"), batch=2), repeats=3)
    records = generate.Records(cfg, {})
    model = types.SimpleNamespace(config=types.SimpleNamespace(pad_token_id=255, vocab_size=256))
    model.set_attn_implementation = lambda name: setattr(model, "attn", name)
    calls = []

    def warm_up(cfg, model, input_ids, mask):
        calls.append(("warm", model.attn))
        return torch.zeros(2, 2, dtype=torch.long), 0.01

    seconds = {"sdpa": [0.1, 0.3, 0.2], "eager": [0.4, 0.5, 0.6], "fa2-pytorch": [0.2]}

    def timed(cfg, model, input_ids, mask):
        calls.append(("timed", model.attn))
        if model.attn == "fa2-pytorch" and len(seconds["fa2-pytorch"]) == 0:
            raise RuntimeError("broken in round 2")
        return seconds[model.attn].pop(0), ""

    monkeypatch.setattr(generate, "_warm_up", warm_up)
    monkeypatch.setattr(generate, "_timed_generate", timed)
    generate.run_generate(cfg, model, list(cfg.providers), records)
    assert calls == [
        ("warm", "sdpa"),
        ("warm", "eager"),
        ("warm", "fa2-pytorch"),
        ("timed", "sdpa"),
        ("timed", "eager"),
        ("timed", "fa2-pytorch"),
        ("timed", "fa2-pytorch"),
        ("timed", "eager"),
        ("timed", "sdpa"),
        ("timed", "sdpa"),
        ("timed", "eager"),
    ]
    rows = generate.read_csv(tmp_path / "rounds.partial.csv")
    assert {r["provider"]: r["seconds"] for r in rows} == {"sdpa": "0.2", "eager": "0.5"}
    issues = generate.read_csv(tmp_path / "rounds.partial-skipped.csv")
    assert [(i["provider"], i["status"], i["reason"]) for i in issues] == [
        ("fa2-pytorch", "failed", "RuntimeError: broken in round 2")
    ]
