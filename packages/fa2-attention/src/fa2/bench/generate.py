"""``python -m fa2.bench.generate``: fa2 end to end in transformers, against the attention implementations
transformers ships (issue 39 item 5). A random Llama (transformers' ``LlamaForCausalLM``) of about 1.1B
parameters (``GPU_MODEL``: hidden 2048, 16 layers, 32 query heads / 8 key-value heads, head_dim 64,
intermediate 8192, vocab 32000), bf16, random weights from ``torch.manual_seed(--seed)`` (no download), one
model whose attention is switched per provider (``set_attn_implementation``), so every provider runs the
same weights.

Providers: ``fa2-<backend>`` for each fa2 backend, registered through
``fa2.integrations.transformers.register(backend=..., name="fa2-<backend>")`` (default: every installed
backend that runs natively on the GPU, fa2-pytorch aside), and transformers' ``sdpa``, ``flex_attention``
and ``eager``; and ``sdpa-no-cudnn``, transformers' sdpa with PyTorch's cuDNN attention left out (on the H200
SDPA's default picks cuDNN for decode steps, which builds a plan per new key length: sdpa at its best is the
faster of the two).

1. Greedy ``generate``, ``--new-tokens`` (256) new tokens every run (``min_new_tokens = max_new_tokens``,
   no eos token) at each batch of ``--batches`` (1, 8, 32) from prompts of ``--prompts`` tokens (1k, 8k):
   unpadded, and left-padded (each row's prompt a random length between half and all of the prompt, the
   rest padding; the same rows for every provider, from ``--seed``). The prompt tokens are random, the pad
   token never among them. Per (point, provider): a warm-up ``generate`` of ``CHECK_TOKENS`` new tokens,
   then the prefill alone (a ``generate`` of one new token); then ``--repeats`` rounds of one timed
   ``generate`` per provider, the providers' order reversed every other round (the median of each
   provider's), ``torch.cuda.synchronize`` before and after each. Tokens per second = batch · new
   tokens / seconds; decode tokens per second = batch · (new tokens - 1) / (seconds - prefill). Before it is
   timed, each fa2 provider's warm-up tokens at batch 1, the first prompt, unpadded, are compared with
   sdpa's: the CSV's ``agree`` is how many of the first ``CHECK_TOKENS`` equal sdpa's before the first that
   differs (bf16 greedy decoding can break a near-tie either way: a mismatch is reported, not fatal).
2. A training step (forward, loss from the labels, backward; no optimizer step) on ``TRAIN_SEQUENCES``
   sequences of random lengths between 1.5k and 2k tokens (``DEFAULTS``: ~7k real tokens), ``padded``
   to the longest (right padding, labels -100 there) and ``packed`` into one row as
   ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` packs them (position_ids restarting,
   cu_seq_lens_q/k: fa2's varlen path; transformers' sdpa, eager and flex_attention read the restarting
   position_ids as a block-diagonal mask over the whole row, ``use_cache=False``). The median of
   ``TRAIN_STEPS`` steps after ``TRAIN_WARMUP``; the loss of each layout (equal in exact arithmetic).
   The report gives padded over packed per provider (issue 39's target for fa2: within 5%).

A point a provider cannot run (CUDA out of memory: eager's materialised scores at 8k) is recorded as
skipped with the reason, its memory freed, and the run goes on; any other exception as failed.

Without a GPU: an EMULATED run on the CPU, labelled so in every file, of a tiny Llama (``EMULATED_MODEL``:
2 layers, hidden 64) in fp32 with fa2-pytorch, sdpa and eager, a few tokens: it shows the harness runs,
not GPU speed.

    python -m fa2.bench.generate --parts generate --prompts 1024              # a part per 10-minute call
    python -m fa2.bench.generate --parts generate --prompts 8192 --append
    python -m fa2.bench.generate --parts train --append
    python -m fa2.bench.generate --quick                                      # batch 1, 8; 1k; 64 tokens

Files, under ``--out`` (default the checkout's docs/benchmarks), named ``<gpu>-generate`` (``h200-generate``,
``cpu-emulated-generate``; ``-quick`` with --quick):

    <name>.csv           a row per measured (part, provider, layout, batch, prompt, new tokens): COLUMNS
    <name>-skipped.csv   every one not measured, with the reason
    <name>-run.json      per run (several with --append): environment, command, model, wall time
    <name>.md            tokens per second, against sdpa, prefill, the check, the training step
    <name>.png           bars: tokens per second per (prompt, layout) and batch; training ms per step
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from fa2 import registry
from fa2.bench import timing
from fa2.bench.__main__ import EMULATION
from fa2.bench.output import (
    comma_list,
    default_name,
    default_out,
    exception_reason,
    markdown_table,
    now_utc,
    positive_int,
    read_csv,
    read_runs,
    write_report,
)
from fa2.bench.report import EMULATED_TAG, seqlen_label
from fa2.bench.sweep import environment

# transformers' LlamaConfig arguments: ~1.1B parameters on a GPU, a tiny model for the emulated run.
GPU_MODEL = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=32000,
)
EMULATED_MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)
DTYPES = {False: torch.bfloat16, True: torch.float32}  # emulated: fp32, where the CPU is quick and exact enough
# sdpa-no-cudnn: transformers' sdpa with PyTorch's cuDNN attention left out (``sdpa_kernel`` over the flash,
# efficient and math kernels). On the H200 with torch 2.11 SDPA picks cuDNN for decode steps, and cuDNN builds
# a plan for each new key length, which each decode step is (docs/notes/kvcache.md): sdpa at its best is the
# faster of the two.
TRANSFORMERS_PROVIDERS = ("sdpa", "sdpa-no-cudnn", "flex_attention", "eager")
NO_CUDNN = "sdpa-no-cudnn"
# fa2 backends a GPU run takes by default, where installed and native: fa2-pytorch is the readable loop.
GPU_FA2_BACKENDS = ("triton", "numba-cuda")
EMULATED_PROVIDERS = ("fa2-pytorch", "sdpa", "eager")
PARTS = ("generate", "train")
LAYOUTS = {"generate": ("unpadded", "left-padded"), "train": ("padded", "packed")}


@dataclass(frozen=True)
class Defaults:
    batches: tuple[int, ...]
    prompts: tuple[int, ...]
    new_tokens: int
    train_lengths: tuple[int, int]  # each sequence's length drawn from [low, high]
    train_warmup: int
    train_steps: int


DEFAULTS = {
    # (emulated, quick)
    (False, False): Defaults((1, 8, 32), (1024, 8192), 256, (1536, 2048), 2, 5),
    (False, True): Defaults((1, 8), (1024,), 64, (1536, 2048), 2, 5),
    (True, False): Defaults((1, 2), (32,), 8, (8, 16), 1, 2),
    (True, True): Defaults((1, 2), (32,), 8, (8, 16), 1, 2),
}
CHECK_TOKENS = 8  # the warm-up's new tokens, and those compared with sdpa's
TRAIN_SEQUENCES = 4

KEY = ("part", "provider", "layout", "batch", "prompt", "new_tokens")
COLUMNS = (
    *KEY,
    "lengths",
    "tokens",
    "seconds",
    "tokens_per_s",
    "prefill_ms",
    "decode_tokens_per_s",
    "step_ms",
    "loss",
    "agree",
    "peak_mem_gb",
    "dtype",
    "gpu",
    "torch",
    "transformers",
    "triton",
    "numba_cuda",
    "commit",
    "timestamp",
)
ISSUE_COLUMNS = (*KEY, "status", "reason", "timestamp")
EMULATED_NOTE = (
    "EMULATED on the CPU: no GPU; a tiny random Llama (2 layers, hidden 64) in fp32, fa2-pytorch against "
    "transformers' sdpa and eager on the CPU. These numbers show that the harness runs and the providers agree; "
    "they say nothing about GPU speed."
)


def _provider(text: str) -> str:
    if text in TRANSFORMERS_PROVIDERS or (text.startswith("fa2-") and text[4:] in registry.KNOWN):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown provider {text!r}; choose from {', '.join(f'fa2-{b}' for b in registry.KNOWN)}, "
        f"{', '.join(TRANSFORMERS_PROVIDERS)}"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    gpu, emulated = DEFAULTS[False, False], DEFAULTS[True, False]
    parser = argparse.ArgumentParser(
        prog="python -m fa2.bench.generate",
        description="fa2 end to end in transformers: greedy generate tokens per second and a training step of a "
        "random ~1B Llama (bf16) with each fa2 backend against transformers' sdpa, flex_attention and eager. "
        "Without a GPU an emulated run of a tiny Llama on the CPU.",
    )
    parser.add_argument(
        "--providers",
        type=comma_list(_provider),
        help="comma-separated; default on a GPU fa2-<backend> for each installed native backend of "
        f"{', '.join(GPU_FA2_BACKENDS)}, then {','.join(TRANSFORMERS_PROVIDERS)}; "
        f"emulated {','.join(EMULATED_PROVIDERS)}",
    )
    parser.add_argument(
        "--batches",
        type=comma_list(int),
        help=f"generate's batch sizes; default on a GPU {','.join(map(str, gpu.batches))}, "
        f"emulated {','.join(map(str, emulated.batches))}",
    )
    parser.add_argument(
        "--prompts",
        type=comma_list(int),
        help=f"generate's prompt lengths in tokens; default on a GPU {','.join(map(str, gpu.prompts))}, "
        f"emulated {','.join(map(str, emulated.prompts))}",
    )
    parser.add_argument(
        "--new-tokens",
        type=positive_int,
        help=f"tokens each generate makes; default on a GPU {gpu.new_tokens}, emulated {emulated.new_tokens}",
    )
    parser.add_argument(
        "--padding",
        type=comma_list(str, LAYOUTS["generate"]),
        default=LAYOUTS["generate"],
        help=f"generate's prompts: comma-separated of {', '.join(LAYOUTS['generate'])} (default both)",
    )
    parser.add_argument(
        "--parts",
        type=comma_list(str, PARTS),
        default=PARTS,
        help="generate (tokens per second), train (a training step, padded and packed); default both",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="rounds of timed generate calls per point, the providers' order reversed every other round (each "
        "provider's median)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the weights', prompts' and lengths' seed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"on a GPU batches {','.join(map(str, DEFAULTS[False, True].batches))}, prompt "
        f"{','.join(map(str, DEFAULTS[False, True].prompts))}, {DEFAULTS[False, True].new_tokens} new tokens, and "
        "the training step; files <name>-quick",
    )
    parser.add_argument("--out", type=Path, default=default_out(), help="folder of the results")
    parser.add_argument("--name", help="file stem; default <gpu>-generate (h200-generate), or cpu-emulated-generate")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the earlier rows of <name>.csv, replacing those measured again (a run in parts)",
    )
    return parser.parse_args(argv)


@dataclass
class Config:
    providers: tuple[str, ...]
    batches: tuple[int, ...]
    prompts: tuple[int, ...]
    new_tokens: int
    padding: tuple[str, ...]
    parts: tuple[str, ...]
    repeats: int
    seed: int
    defaults: Defaults
    device: torch.device
    out_dir: Path
    name: str
    append: bool
    command: str

    @property
    def emulated(self) -> bool:
        return self.device.type != "cuda"

    def path(self, suffix: str) -> Path:
        return self.out_dir / f"{self.name}{suffix}"

    def generate_points(self) -> list[tuple[int, int, str]]:
        """(batch, prompt, layout), the prompts outermost: a --prompts part is one stretch of the run."""
        return [(b, p, layout) for p in self.prompts for layout in self.padding for b in self.batches]

    def train_lengths(self) -> list[int]:
        low, high = self.defaults.train_lengths
        rng = random.Random(self.seed)
        return [rng.randint(low, high) for _ in range(TRAIN_SEQUENCES)]

    def planned(self) -> set[tuple[str, ...]]:
        """The KEY of every row this run may write (as the CSV's strings): what --append replaces."""
        keys = set()
        for p in self.providers:
            if "generate" in self.parts:
                keys |= {
                    ("generate", p, lay, str(b), str(n), str(self.new_tokens)) for b, n, lay in self.generate_points()
                }
            if "train" in self.parts:
                keys |= {tuple(str(v) for v in key.values()) for key in _keys(self, "train", p)}
        return keys


def default_providers(emulated: bool) -> tuple[str, ...]:
    if emulated:
        return EMULATED_PROVIDERS
    infos = registry.backends()
    fa2s = [f"fa2-{b}" for b in GPU_FA2_BACKENDS if b in infos and infos[b].status == "native"]
    return (*fa2s, *TRANSFORMERS_PROVIDERS)


def unavailable(provider: str, emulated: bool) -> str | None:
    """Why ``provider`` cannot run here, or None."""
    if not provider.startswith("fa2-"):
        return None
    backend = provider[4:]
    info = registry.backends().get(backend)
    if info is None:
        return f"fa2 backend {backend} is not installed: {registry.install_command(backend)}"
    if info.status == "unavailable" or (info.status == "emulated" and not emulated):
        return f"fa2 backend {backend} does not run natively here ({info.status}: {info.detail})"
    return None


def attn_implementation(provider: str) -> str:
    """The ``attn_implementation`` a provider sets on the model."""
    return "sdpa" if provider == NO_CUDNN else provider


def provider_context(provider: str):
    """What a provider's measurements run inside: for sdpa-no-cudnn, SDPA's kernels without cuDNN's."""
    if provider != NO_CUDNN:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


class Records:
    """The two CSVs, written row by row into ``<name>.partial*`` and moved over the earlier files by
    ``commit`` once anything was measured (as ``python -m fa2.bench`` does); --append keeps the earlier rows
    that this run does not measure again."""

    SUFFIXES = (".csv", "-skipped.csv")

    def __init__(self, cfg: Config, env: dict):
        self.cfg, self.env, self.measured = cfg, env, 0
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        planned = cfg.planned()
        for suffix, columns in zip(self.SUFFIXES, (COLUMNS, ISSUE_COLUMNS)):
            earlier = read_csv(cfg.path(suffix)) if cfg.append else []
            with self._partial(suffix).open("w", newline="") as f:
                writer = csv.DictWriter(f, columns)
                writer.writeheader()
                writer.writerows(r for r in earlier if tuple(r[c] for c in KEY) not in planned)

    def _partial(self, suffix: str) -> Path:
        return self.cfg.path(f".partial{suffix}")

    def result(self, row: dict) -> None:
        self.measured += 1
        self._append(".csv", COLUMNS, {**row, **self.env, "timestamp": now_utc()})

    def issue(self, key: dict, status: str, reason: str) -> None:
        print(f"  {key['provider']} {_point_text(key)}: {status}: {reason}", flush=True)
        self._append("-skipped.csv", ISSUE_COLUMNS, {**key, "status": status, "reason": reason, "timestamp": now_utc()})

    def _append(self, suffix: str, columns: tuple[str, ...], row: dict) -> None:
        with self._partial(suffix).open("a", newline="") as f:
            csv.DictWriter(f, columns, extrasaction="ignore").writerow(row)

    def commit(self) -> None:
        if not self.measured:
            raise SystemExit(
                f"fa2.bench.generate: nothing was measured; {self.cfg.path('.csv')} is kept as it was, and "
                f"{self._partial('-skipped.csv')} says why"
            )
        for suffix in self.SUFFIXES:
            os.replace(self._partial(suffix), self.cfg.path(suffix))


def _point_text(key: dict) -> str:
    if key["part"] == "train":
        return f"train {key['layout']}"
    return f"B{key['batch']} prompt {key['prompt']} {key['layout']}"


def build_model(cfg: Config):
    """The random Llama, on the device in the run's dtype, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = EMULATED_MODEL if cfg.emulated else GPU_MODEL
    longest = max([*(p + cfg.new_tokens for p in cfg.prompts), TRAIN_SEQUENCES * cfg.defaults.train_lengths[1]])
    config = LlamaConfig(
        **spec,
        max_position_embeddings=longest,
        eos_token_id=None,  # every generate makes all its tokens
        pad_token_id=spec["vocab_size"] - 1,  # never in a prompt: the prompts draw from the other tokens
    )
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        model = LlamaForCausalLM(config)
    return model.to(DTYPES[cfg.emulated]).eval()


def prompt_batch(cfg: Config, batch: int, prompt: int, layout: str, vocab: int, pad: int):
    """(input_ids, attention_mask) of one generate point, the same for every provider: random tokens,
    left-padded rows each of a length drawn from [prompt // 2, prompt]."""
    seed = cfg.seed * 1_000_003 + batch * 100_003 + prompt
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab - 1, (batch, prompt), generator=generator)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    if layout == "left-padded":
        rng = random.Random(seed)
        for row in range(batch):
            pads = prompt - rng.randint(max(1, prompt // 2), prompt)
            input_ids[row, :pads], mask[row, :pads] = pad, 0
    return input_ids.to(cfg.device), mask.to(cfg.device)


def _generate(model, input_ids, mask, new_tokens: int, pad: int):
    return model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=None,
    )


def _timed(fn, device: torch.device):
    """fn's result and its wall time in seconds, synchronised before and after."""
    timing.sync(device)
    return timing.timed_once(fn, device)


def _peak_start(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    timing.sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gb(device: torch.device, before: int) -> str:
    return f"{(torch.cuda.max_memory_allocated(device) - before) / 1e9:.3g}" if device.type == "cuda" else ""


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _attempt(records: Records, key: dict, device: torch.device, fn):
    """fn(), or None with the (provider, point) recorded: skipped when out of memory, failed otherwise."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError as e:
        status, reason = "skipped", f"out of memory: {exception_reason(e)}"
    except Exception as e:  # noqa: BLE001 - any provider's failure is recorded and the run goes on
        status, reason = "failed", exception_reason(e)
    # Here, past the except blocks, the exception and the frames it held are gone: their tensors can be freed.
    _free(device)
    records.issue(key, status, reason)
    return None


def run_generate(cfg: Config, model, providers: list[str], records: Records) -> None:
    """Every generate point: each provider's warm-up and prefill, then ``cfg.repeats`` rounds of one timed
    ``generate`` per provider, the order reversed every other round, so that a drift of the host's speed
    (the H200's host moved up to 2x within one run: docs/notes/kvcache.md) falls on every provider alike."""
    pad = model.config.pad_token_id
    check_point = (1, cfg.prompts[0], "unpadded")
    for batch, prompt, layout in cfg.generate_points():
        input_ids, mask = prompt_batch(cfg, batch, prompt, layout, model.config.vocab_size, pad)
        tokens = int(mask.sum())
        keys = {
            provider: dict(
                part="generate",
                provider=provider,
                layout=layout,
                batch=batch,
                prompt=prompt,
                new_tokens=cfg.new_tokens,
            )
            for provider in providers
        }

        warm = {}  # provider -> (the warm-up's new tokens, the prefill's seconds)
        for provider in providers:
            measured = _in_provider(cfg, model, records, keys[provider], _warm_up, input_ids, mask)
            if measured is not None:
                warm[provider] = measured
        # The check point's rows wait for sdpa's tokens (their ``agree``); every other row is written when its
        # provider's last round is measured, so that a run stopped midway (a time-limited device call) keeps
        # what it measured.
        checked = (batch, prompt, layout) == check_point
        times: dict[str, list[float]] = {provider: [] for provider in warm}
        peaks: dict[str, str] = {}
        rows = []
        for round_ in range(cfg.repeats):
            for provider in list(times)[:: -1 if round_ % 2 else 1]:
                measured = _in_provider(cfg, model, records, keys[provider], _timed_generate, input_ids, mask)
                if measured is None:
                    del times[provider]  # recorded as skipped or failed: no row
                    continue
                seconds, peak = measured
                times[provider].append(seconds)
                peaks.setdefault(provider, peak)
                if round_ == cfg.repeats - 1:
                    row = _generate_row(
                        cfg, keys[provider], tokens, warm[provider][1], times[provider], peaks[provider]
                    )
                    print(f"  {provider} {_point_text(keys[provider])}: {row['tokens_per_s']} tokens/s", flush=True)
                    if checked:
                        rows.append(row)
                    else:
                        records.result(row)
        if checked:
            _check_against_sdpa(rows, {row["provider"]: warm[row["provider"]][0] for row in rows})
            for row in rows:
                records.result(row)


def _in_provider(cfg: Config, model, records: Records, key: dict, measure, input_ids, mask):
    """measure(cfg, model, input_ids, mask) with the model's attention switched to key's provider, or None
    with the point recorded (``_attempt``)."""
    provider = key["provider"]
    model.set_attn_implementation(attn_implementation(provider))
    with provider_context(provider):
        return _attempt(records, key, cfg.device, functools.partial(measure, cfg, model, input_ids, mask))


def _generate_row(cfg: Config, key: dict, tokens: int, prefill_s: float, times: list[float], peak: str) -> dict:
    """A generate point's CSV row: the median of its timed calls."""
    batch = key["batch"]
    seconds = statistics.median(times)
    decode_s = seconds - prefill_s
    return {
        **key,
        "tokens": tokens,
        "seconds": f"{seconds:.4g}",
        "tokens_per_s": f"{batch * cfg.new_tokens / seconds:.4g}",
        "prefill_ms": f"{1e3 * prefill_s:.4g}",
        "decode_tokens_per_s": (
            f"{batch * (cfg.new_tokens - 1) / decode_s:.4g}" if cfg.new_tokens > 1 and decode_s > 0 else ""
        ),
        "peak_mem_gb": peak,
        "dtype": str(DTYPES[cfg.emulated]).removeprefix("torch."),
    }


def _warm_up(cfg: Config, model, input_ids: torch.Tensor, mask: torch.Tensor):
    """(the warm-up's new tokens on the CPU, the prefill's seconds: a generate of one new token)."""
    pad = model.config.pad_token_id
    warm = _generate(model, input_ids, mask, min(CHECK_TOKENS, cfg.new_tokens), pad)
    _, prefill_s = _timed(lambda: _generate(model, input_ids, mask, 1, pad), cfg.device)
    return warm[:, input_ids.shape[1] :].cpu(), prefill_s


def _timed_generate(cfg: Config, model, input_ids: torch.Tensor, mask: torch.Tensor):
    """(one timed generate's seconds, its peak memory in GB as text)."""
    before = _peak_start(cfg.device)
    _, seconds = _timed(
        lambda: _generate(model, input_ids, mask, cfg.new_tokens, model.config.pad_token_id), cfg.device
    )
    return seconds, _peak_gb(cfg.device, before)


def _check_against_sdpa(rows: list[dict], first_tokens: dict) -> None:
    """Each fa2 row's ``agree``: its leading warm-up tokens equal to sdpa's (empty without sdpa's)."""
    ref = first_tokens.get("sdpa")
    for row in rows:
        mine = first_tokens[row["provider"]]
        if ref is None or not row["provider"].startswith("fa2-"):
            continue
        differs = (mine[0] != ref[0]).nonzero()
        agree = int(differs[0]) if len(differs) else ref.shape[1]
        row["agree"] = agree
        if agree < ref.shape[1]:
            print(
                f"  {row['provider']}: greedy tokens differ from sdpa's at new token {agree} of {ref.shape[1]} "
                f"({mine[0].tolist()} against {ref[0].tolist()})",
                flush=True,
            )


def train_batches(cfg: Config, lengths: list[int], vocab: int, pad: int) -> dict[str, dict]:
    """The training step's inputs per layout: ``padded`` (right padding, labels -100 there) and ``packed``
    (DataCollatorWithFlattening's one row: labels, position_ids restarting, cu_seq_lens_q/k)."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(cfg.seed + 1)
    seqs = [torch.randint(0, vocab - 1, (n,), generator=generator) for n in lengths]
    longest = max(lengths)
    input_ids = torch.full((len(seqs), longest), pad)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        input_ids[row, : len(s)], mask[row, : len(s)] = s, 1
    padded = dict(input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100))
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs])

    def on_device(batch):
        return {k: v.to(cfg.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    return {"padded": on_device(padded), "packed": on_device(dict(packed))}


def run_train(cfg: Config, model, providers: list[str], records: Records) -> None:
    lengths = cfg.train_lengths()
    batches = train_batches(cfg, lengths, model.config.vocab_size, model.config.pad_token_id)
    model.train()
    for provider in providers:
        model.set_attn_implementation(attn_implementation(provider))
        for layout, batch in batches.items():
            key = train_key(provider, layout)
            if layout == "packed" and not provider.startswith("fa2-") and not _masks_packed_rows():
                records.issue(
                    key,
                    "skipped",
                    f"transformers {_version('transformers')}: {provider} would attend "
                    "across the packed sequences (no masking_utils.find_packed_sequence_indices)",
                )
                continue

            measure = functools.partial(_measure_train, cfg, model, batch)
            with provider_context(provider):
                measured = _attempt(records, key, cfg.device, measure)
            model.zero_grad(set_to_none=True)
            if measured is None:
                continue
            seconds, loss, peak = measured
            records.result(
                {
                    **key,
                    "lengths": " ".join(map(str, lengths)),
                    "tokens": sum(lengths),
                    "step_ms": f"{1e3 * seconds:.4g}",
                    "loss": f"{loss:.6g}",
                    "peak_mem_gb": peak,
                    "dtype": str(DTYPES[cfg.emulated]).removeprefix("torch."),
                }
            )
            print(f"  {provider} {_point_text(key)}: {1e3 * seconds:.4g} ms per step", flush=True)
    model.eval()


def _masks_packed_rows() -> bool:
    """Whether transformers' sdpa, eager and flex_attention masks read restarting position_ids as packed
    sequences (a block-diagonal mask), as transformers releases with masking_utils.find_packed_sequence_indices do."""
    from transformers import masking_utils

    return hasattr(masking_utils, "find_packed_sequence_indices")


def _train_step(model, batch: dict) -> float:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def _measure_train(cfg: Config, model, batch: dict):
    """(the median step's seconds, the first timed step's loss, the peak memory in GB as text)."""
    for _ in range(cfg.defaults.train_warmup):
        _train_step(model, batch)
    before = _peak_start(cfg.device)
    times, losses = [], []
    for _ in range(cfg.defaults.train_steps):
        loss, seconds = _timed(lambda: _train_step(model, batch), cfg.device)
        times.append(seconds)
        losses.append(loss)
    return statistics.median(times), losses[0], _peak_gb(cfg.device, before)


def run(cfg: Config) -> None:
    """Measures ``cfg`` into ``<name>.csv``, ``<name>-skipped.csv`` and ``<name>-run.json``."""
    from fa2.integrations import transformers as fa2_transformers

    started = time.perf_counter()
    env = {**environment(cfg.device), "transformers": _version("transformers")}
    records = Records(cfg, env)
    providers = []
    for provider in cfg.providers:
        reason = unavailable(provider, cfg.emulated)
        if reason is None:
            providers.append(provider)
            if provider.startswith("fa2-"):
                fa2_transformers.register(backend=provider[4:], name=provider)
            continue
        for part in cfg.parts:
            for key in _keys(cfg, part, provider):
                records.issue(key, "skipped", reason)
    threads = torch.get_num_threads()
    if cfg.emulated:
        # On a few shared cores torch's thread pool makes CPU times swing a hundredfold; one thread is steady.
        torch.set_num_threads(1)
    try:
        _run(cfg, env, records, providers, started)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Config, env: dict, records: Records, providers: list[str], started: float) -> None:
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        **env,
        "device": str(cfg.device),
        "emulated": cfg.emulated,
        "command": cfg.command,
        "started": now_utc(),
        "model": {
            **(EMULATED_MODEL if cfg.emulated else GPU_MODEL),
            "parameters": n_params,
            "dtype": str(DTYPES[cfg.emulated]).removeprefix("torch."),
            "seed": cfg.seed,
        },
        "repeats": cfg.repeats,
        "train": {
            "lengths": cfg.train_lengths(),
            "warmup": cfg.defaults.train_warmup,
            "steps": cfg.defaults.train_steps,
        },
    }
    print(
        f"fa2.bench.generate: random Llama of {n_params / 1e9:.3g}B parameters, {info['model']['dtype']}, "
        f"{'EMULATED on the CPU' if cfg.emulated else env['gpu']}; {', '.join(providers)}; writing {cfg.path('.csv')}",
        flush=True,
    )
    if "generate" in cfg.parts:
        run_generate(cfg, model, providers, records)
    if "train" in cfg.parts:
        run_train(cfg, model, providers, records)
    info["wall_s"] = round(time.perf_counter() - started, 1)
    earlier = read_runs(cfg.path("-run.json")) if cfg.append else []
    records.commit()
    cfg.path("-run.json").write_text(json.dumps({"runs": [*earlier, info]}, indent=2) + "\n")


def _keys(cfg: Config, part: str, provider: str) -> list[dict]:
    if part == "train":
        return [train_key(provider, layout) for layout in LAYOUTS[part]]
    return [
        dict(part=part, provider=provider, layout=lay, batch=b, prompt=p, new_tokens=cfg.new_tokens)
        for b, p, lay in cfg.generate_points()
    ]


def train_key(provider: str, layout: str) -> dict:
    """A training row's KEY: the padded batch's rows, or the packed batch's one."""
    batch = TRAIN_SEQUENCES if layout == "padded" else 1
    return dict(part="train", provider=provider, layout=layout, batch=batch, prompt="", new_tokens="")


# The report, from the files alone.


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _point_label(batch: str, prompt: str, layout: str) -> str:
    return f"B{batch} {seqlen_label(int(prompt))}" + (" padded" if layout == "left-padded" else "")


class Report:
    """``<name>.md`` and the plot from ``<name>.csv``, ``<name>-skipped.csv`` and ``<name>-run.json``."""

    def __init__(self, out_dir: Path, name: str):
        self.name = name
        self.rows = read_csv(out_dir / f"{name}.csv")
        self.issues = read_csv(out_dir / f"{name}-skipped.csv")
        self.runs = read_runs(out_dir / f"{name}-run.json")
        self.info = self.runs[-1] if self.runs else {}
        self.emulated = bool(self.info.get("emulated"))
        self.generate = [r for r in self.rows if r["part"] == "generate"]
        self.train = [r for r in self.rows if r["part"] == "train"]
        self.providers = list(dict.fromkeys(r["provider"] for r in self.rows))
        points = {
            (int(r["prompt"]), r["layout"] != "unpadded", int(r["batch"]), r["new_tokens"]) for r in self.generate
        }
        self.points = [(str(b), str(p), "left-padded" if pad else "unpadded", n) for p, pad, b, n in sorted(points)]

    def caption(self, text: str) -> str:
        return f"**{EMULATED_TAG}.** {text}" if self.emulated else text

    def _generate_value(self, column: str, provider: str, point: tuple) -> float | None:
        for r in self.generate:
            if (r["provider"], r["batch"], r["prompt"], r["layout"], r["new_tokens"]) == (provider, *point) and r[
                column
            ]:
                return float(r[column])
        return None

    def _point_header(self) -> list[str]:
        many = len({p[3] for p in self.points}) > 1
        return [_point_label(*p[:3]) + (f" +{p[3]}" if many else "") for p in self.points]

    def generate_tables(self) -> list[str]:
        if not self.generate:
            return []
        out = []
        for title, column, caption in (
            ("tokens per second", "tokens_per_s", "Greedy generate, batch · new tokens / seconds (prefill included)."),
            ("decode tokens per second", "decode_tokens_per_s", "batch · (new tokens - 1) / (seconds - prefill)."),
            ("prefill (ms)", "prefill_ms", "A generate of one new token: the prompt's forward and one step."),
        ):
            rows = []
            for p in self.providers:
                cells = [self._generate_value(column, p, pt) for pt in self.points]
                if any(c is not None for c in cells):
                    rows.append([p, *("—" if c is None else _num(c) for c in cells)])
            out += ["", f"## Generate: {title}", "", self.caption(caption), ""]
            out += markdown_table(["provider", *self._point_header()], rows)
        for ref_provider, target in (("sdpa", " (issue 39's target for fa2-triton: >= 1)"), (NO_CUDNN, "")):
            if ref_provider == NO_CUDNN and ref_provider not in self.providers:
                continue
            out += ["", f"## Generate: against {ref_provider}", ""]
            rows = []
            for p in self.providers:
                if p == ref_provider:
                    continue
                cells = []
                for pt in self.points:
                    mine, ref = (
                        self._generate_value("tokens_per_s", p, pt),
                        self._generate_value("tokens_per_s", ref_provider, pt),
                    )
                    cells.append(mine / ref if mine and ref else None)
                present = [c for c in cells if c is not None]
                if present:
                    rows.append([p, *("—" if c is None else f"{c:.2f}" for c in cells), f"{min(present):.2f}"])
            out += [self.caption(f"Tokens per second over {ref_provider}'s at the same point{target}."), ""]
            header = ["provider", *self._point_header(), "min"]
            out += markdown_table(header, rows) if rows else [f"{ref_provider} was not measured."]
        agree = [r for r in self.generate if r["agree"]]
        out += ["", "## Generate: the check against sdpa", ""]
        if agree:
            out += [
                self.caption(
                    f"Each fa2 provider's first {CHECK_TOKENS} greedy tokens (the warm-up's) at batch 1, unpadded, "
                    "against sdpa's: how many agree before the first that differs (bf16 near-ties can break "
                    "either way)."
                ),
                "",
                *markdown_table(
                    ["provider", "point", "tokens agreeing"],
                    [
                        [
                            r["provider"],
                            _point_label(r["batch"], r["prompt"], r["layout"]),
                            f"{r['agree']}/{CHECK_TOKENS}",
                        ]
                        for r in agree
                    ],
                ),
            ]
        else:
            out += [
                "Not made: no run measured sdpa and an fa2 provider together at batch 1, unpadded, on its first prompt."
            ]
        return out

    def train_tables(self) -> list[str]:
        if not self.train:
            return []
        by = {(r["provider"], r["layout"]): r for r in self.train}
        rows = []
        for p in self.providers:
            padded, packed = by.get((p, "padded")), by.get((p, "packed"))
            if not padded and not packed:
                continue
            ratio = f"{float(padded['step_ms']) / float(packed['step_ms']):.2f}" if padded and packed else "—"
            rows.append(
                [
                    p,
                    padded["step_ms"] if padded else "—",
                    packed["step_ms"] if packed else "—",
                    ratio,
                    padded["loss"] if padded else "—",
                    packed["loss"] if packed else "—",
                    padded["peak_mem_gb"] if padded and padded["peak_mem_gb"] else "—",
                    packed["peak_mem_gb"] if packed and packed["peak_mem_gb"] else "—",
                ]
            )
        r0 = self.train[0]
        lengths = r0["lengths"].split()
        return [
            "",
            "## Training step",
            "",
            self.caption(
                f"Forward (loss from the labels) and backward, no optimizer step, median ms per step; "
                f"{len(lengths)} sequences of {', '.join(lengths)} tokens ({r0['tokens']} real): padded to the "
                "longest (right padding, labels -100 there), and packed into one row (DataCollatorWithFlattening: "
                "position_ids restarting, cu_seq_lens_q/k; sdpa, eager and flex_attention mask the row "
                "block-diagonally). Issue 39's target for fa2: padded / packed <= 1.05. The losses are equal in "
                "exact arithmetic."
            ),
            "",
            *markdown_table(
                [
                    "provider",
                    "padded ms",
                    "packed ms",
                    "padded / packed",
                    "loss padded",
                    "loss packed",
                    "peak GB padded",
                    "peak GB packed",
                ],
                rows,
            ),
        ]

    def not_measured(self) -> list[str]:
        rows = [
            [
                i["provider"],
                i["part"],
                i["layout"] if i["part"] == "train" else _point_label(i["batch"], i["prompt"], i["layout"]),
                i["status"],
                i["reason"],
            ]
            for i in self.issues
        ]
        return (
            markdown_table(["provider", "part", "point", "status", "reason"], rows)
            if rows
            else ["Nothing: every point ran."]
        )

    def markdown(self, plots: list[Path]) -> str:
        info = self.info
        model = info.get("model", {})
        where = "EMULATED on the CPU" if self.emulated else info.get("gpu", "?")
        lines = [f"# fa2 end to end in transformers: {where}", ""]
        if self.emulated:
            lines += [f"> **{EMULATED_NOTE}**", ""]
        lines += [
            f"- Model: random LlamaForCausalLM, hidden {model.get('hidden_size')}, {model.get('num_hidden_layers')} "
            f"layers, {model.get('num_attention_heads')} query / {model.get('num_key_value_heads')} key-value heads, "
            f"intermediate {model.get('intermediate_size')}, vocab {model.get('vocab_size')}, "
            f"{model.get('parameters', 0) / 1e9:.3g}B parameters, {model.get('dtype')}, seed {model.get('seed')}; "
            "one model, its attention switched per provider.",
            f"- Environment: commit `{info.get('commit', '?')}`, torch {info.get('torch', '?')}, transformers "
            f"{info.get('transformers') or '?'}, triton {info.get('triton') or '—'}, numba-cuda "
            f"{info.get('numba_cuda') or '—'}.",
            f"- Wall time {sum(r.get('wall_s', 0) for r in self.runs):.0f} s, from:",
            *(
                f"  - `{r.get('command', '?')}`, started {r.get('started', '?')}, {r.get('wall_s', '?')} s"
                for r in self.runs
            ),
            f"- Generate: greedy, every run makes all its new tokens (min_new_tokens = max_new_tokens, no eos); "
            f"per (point, provider) a warm-up of {CHECK_TOKENS} new tokens, a generate of one new token (the "
            f"prefill), then {info.get('repeats', '?')} round(s) of one timed generate per provider, the order "
            "reversed every other round, and each provider's median, the device synchronised around each. "
            "Left-padded rows: each a prompt of a random length between half and all of the prompt, the same "
            "for every provider.",
        ]
        lines += self.generate_tables() + self.train_tables()
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots] or ["None drawn (no matplotlib here)."]
        lines += ["", "## Not measured", "", *self.not_measured()]
        return "\n".join(lines) + "\n"

    def plot(self, out_dir: Path) -> Path:
        """Bars of tokens per second, a panel per (prompt, layout), batches on x; and the training step's
        ms per provider, padded and packed (hatched)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = dict(zip(self.providers, plt.get_cmap("tab10").colors))
        panels = list(dict.fromkeys((p[1], p[2]) for p in self.points))
        n = len(panels) + bool(self.train)
        fig, axes = plt.subplots(1, n, figsize=(4.8 * n, 4.2), squeeze=False)
        width = 0.8 / max(1, len(self.providers))
        for ax, (prompt, layout) in zip(axes[0], panels):
            mine = [pt for pt in self.points if (pt[1], pt[2]) == (prompt, layout)]
            for i, p in enumerate(self.providers):
                for x, pt in enumerate(mine):
                    value = self._generate_value("tokens_per_s", p, pt)
                    if value:
                        ax.bar(
                            x + (i - (len(self.providers) - 1) / 2) * width,
                            value,
                            width,
                            color=colors[p],
                            label=p,  # one legend entry per provider: the handles are merged by label below
                        )
            ax.set_xticks(range(len(mine)), [f"B{pt[0]}" for pt in mine])
            ax.set_title(f"generate, prompt {seqlen_label(int(prompt))}, {layout}")
            ax.set_ylabel("tokens / s")
            ax.grid(True, axis="y", alpha=0.3)
        if self.train:
            ax = axes[0][-1]
            for i, p in enumerate(self.providers):
                for j, layout in enumerate(LAYOUTS["train"]):
                    ms = [float(r["step_ms"]) for r in self.train if (r["provider"], r["layout"]) == (p, layout)]
                    if ms:
                        ax.bar(
                            i + (j - 0.5) * 0.4,
                            ms[0],
                            0.4,
                            color=colors[p],
                            hatch="//" if layout == "packed" else None,
                            edgecolor="white" if layout == "packed" else None,
                        )
            ax.set_xticks(range(len(self.providers)), self.providers, rotation=30, ha="right", fontsize=8)
            ax.set_title("training step: padded, packed (hatched)")
            ax.set_ylabel("ms per step")
            ax.grid(True, axis="y", alpha=0.3)
        handles = {label: h for a in axes[0] for h, label in zip(*a.get_legend_handles_labels())}
        if handles:
            axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
        where = (
            "EMULATED on the CPU (tiny model): these times say nothing about GPU speed"
            if self.emulated
            else self.info.get("gpu", "")
        )
        fig.suptitle(f"fa2 end to end in transformers, {where}")
        fig.tight_layout()
        path = out_dir / f"{self.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emulated = device.type != "cuda"
    providers = args.providers or default_providers(emulated)
    unset = {key: value for key, value in EMULATION.items() if key not in os.environ}
    if emulated and unset and any(p in ("fa2-triton", "fa2-numba-cuda") for p in providers):
        # Triton and numba read these when imported: a fresh interpreter, as python -m fa2.bench does.
        print(f"fa2.bench.generate: no GPU; running again with {' '.join(f'{k}={v}' for k, v in unset.items())}")
        os.execve(sys.executable, [sys.executable, "-m", "fa2.bench.generate", *argv], {**os.environ, **unset})
    defaults = DEFAULTS[emulated, args.quick]
    cfg = Config(
        providers=providers,
        batches=args.batches or defaults.batches,
        prompts=args.prompts or defaults.prompts,
        new_tokens=args.new_tokens or defaults.new_tokens,
        padding=args.padding,
        parts=args.parts,
        repeats=args.repeats,
        seed=args.seed,
        defaults=defaults,
        device=device,
        out_dir=args.out,
        name=args.name or f"{default_name(device)}-generate" + ("-quick" if args.quick else ""),
        append=args.append,
        command=shlex.join(["python", "-m", "fa2.bench.generate", *argv]),
    )
    run(cfg)
    written = write_report(Report(cfg.out_dir, cfg.name), cfg.out_dir, cfg.name)
    print(f"wrote {', '.join(map(str, [cfg.path('.csv'), cfg.path('-skipped.csv'), cfg.path('-run.json'), *written]))}")


if __name__ == "__main__":
    main()
