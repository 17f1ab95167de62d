"""The sweep: which shapes, which provider may run each, and the loop that checks, times and records.

GPU (the FlashAttention-2 paper's sweep): 16k tokens per batch (B = 16384 / N) and hidden 2048
(H = 2048 / D), N = 512 … 16384, D = 64 and 128, causal and not, bf16 and fp16, plus fp32 for the
providers of the fp32 comparison. Without a GPU (emulated): B = 1, H = 2, N = 16 … 1024, D = 16 and 64,
Triton's interpreter and numba's simulator only on the smallest shapes (their budgets below). ``--heads``
sets H everywhere. Issue 20's options are further points of the sweep of each (dtype, D, causal, N), all
on the same inputs: each group (k and v with H / group heads), each window of the causal shapes (fa2's
window (W, 0) with causal) and each softcap, so that e.g. ``--window none,4096`` times the window beside
plain causal in one process. The CSVs' heads_k, window (-1: none) and softcap (0: none) columns say which.

For each shape: fresh standard-normal inputs, the reference on a sample of rows (check.py), then per
provider: one call, checked (status "wrong" if it fails: not timed), peak memory; then the providers that
passed are timed together in rounds (timing.py: on a GPU the median of 3, every other round reversed). A
provider that cannot run a shape is "skipped", one that raises is "failed"; both with the reason, and the
sweep goes on. Rows are written as they come into ``<name>.partial*``, which replace the earlier files
only at the end of a run that measured something: an interrupted run keeps what it measured there, and a
run that measured nothing leaves the earlier results as they were.

Mode "bwd" (in the default ``--modes fwd,bwd``; fewer seqlens and dtypes: BWD_DEFAULTS) times the backward
alone: the forward runs once on inputs that require grad (its O and L checked), then
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` is checked (dq on the sampled rows, dk and dv
finite) and timed like a forward call.

``--varlen`` (issue 21; ``Packing``, VARLEN_DEFAULTS) sweeps packed batches instead: per (mode, dtype, D,
causal) one packed batch, GPU: 16384 tokens in sequences of lengths drawn uniformly from [256, 4096] (the
last one what is left), hidden 2048 (H = 2048 / D); emulated: 256 tokens, lengths 16 to 64, H = 2. The
lengths come from ``random.Random(seed)``: the same seed, the same batch; the CSV's lengths column and the
run's JSON record them. Its providers are ``VARLEN_PROVIDERS`` on inputs (total, H, D), checked per sequence
(check.py), TFLOP/s over the real (query, key) pairs (Shape.pairs). Beside each packed batch, each fa2
backend's own dense shape at N = 2048 (emulated 32), B = tokens / N, through fa2.attention as the dense
sweep times it: the reference of issue 21's 0.95x target (``--seqlens`` chooses those N).

``--decode`` (issue 22; ``Decode``, DECODE_DEFAULTS) sweeps KV-cache decoding instead: per (dtype, D, query
tokens, (batch, cached keys)) one contiguous cache and the same keys in a paged cache per page size, GPU:
bf16, 32 query heads / 8 key/value heads, D 128, 1 and 4 query tokens at (8, 8k), (8, 32k), (1, 128k),
(64, 4k), pages of 16 and 256; emulated: fp16, 4 / 2 heads, D 16, (2, 40) and (1, 64), pages of 16 and 32.
The layouts of one point share their keys and are timed in the same rounds, so that a paged cache is
compared with its contiguous one under the same clock (``decode_inputs``). Its providers are
``DECODE_PROVIDERS``, checked on the sample against the fp64 reference over the whole cache, timed in µs and
K/V bytes read per second (``Shape.kv_bytes``; the CSV's tbps), against a device-to-device copy
(``timing.copy_ceiling``, in the run's JSON).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import torch

from fa2.bench import check, output, timing
from fa2.bench.output import exception_reason, now_utc, read_runs
from fa2.bench.providers import DECODE_PROVIDERS, DTYPES, PROVIDERS, VARLEN_PROVIDERS, Provider, Shape, fa2_provider

# lengths: a packed batch's sequence lengths, space-separated (seqlen their total, batch their number); empty
# for a dense shape. seqlen_q: a decode shape's query tokens (seqlen its cached keys), 0 otherwise; page_size:
# its paged cache's page size, 0 contiguous. tbps: a decode row's K/V bytes read per second, TB/s (empty
# otherwise).
SHAPE_COLUMNS = (
    "provider",
    "mode",
    "dtype",
    "head_dim",
    "causal",
    "seqlen",
    "batch",
    "heads",
    "heads_k",
    "window",
    "softcap",
    "lengths",
    "seqlen_q",
    "page_size",
)
COLUMNS = (
    *SHAPE_COLUMNS,
    "ms",
    "tflops",
    "tbps",
    "peak_mem_gb",
    "gpu",
    "torch",
    "triton",
    "numba_cuda",
    "commit",
    "timestamp",
)
ISSUE_COLUMNS = (*SHAPE_COLUMNS, "status", "reason", "timestamp")
KEY = (
    "provider",
    "mode",
    "dtype",
    "head_dim",
    "causal",
    "seqlen",
    "batch",
    "heads_k",
    "window",
    "softcap",
    "lengths",
    "seqlen_q",
    "page_size",
)
MODES = ("fwd", "bwd")
# The gpu column of an emulated run's rows: every row of its CSV says its time is no GPU's.
EMULATED_GPU = "cpu (emulated, not GPU speed)"

GPU_TOKENS, GPU_HIDDEN = 16384, 2048
EMULATED_BATCH, EMULATED_HEADS = 1, 2
DEFAULTS = {
    # (emulated, quick): seqlens, head_dims, dtypes
    (False, False): ((512, 1024, 2048, 4096, 8192, 16384), (64, 128), ("bf16", "fp16", "fp32")),
    (False, True): ((1024, 4096), (64, 128), ("bf16",)),
    (True, False): ((16, 32, 64, 128, 256, 512, 1024), (16, 64), ("fp32", "fp16", "bf16")),
    (True, True): ((16, 32, 64, 128), (16,), ("fp32", "fp16")),
}
# Mode "bwd", (emulated, quick): seqlens, dtypes (the head dims are the forward's). Fewer points than the
# forward: a backward call takes ~2.5 times as long, and the slower providers (fa2-pytorch, fa2-numba-cuda)
# far longer at N = 16k.
BWD_DEFAULTS = {
    (False, False): ((1024, 4096, 16384), ("bf16",)),
    (False, True): ((1024, 4096), ("bf16",)),
    (True, False): ((16, 64, 256), ("fp32",)),
    (True, True): ((16, 64), ("fp32",)),
}
# SDPA math materialises B·H·N² scores: at N = 16k that is tens of GB (anchors.md: 39.5 GB at D = 128).
MATH_MAX_SEQLEN = 4096
# What the emulators lack, and the most work (B·H·N²·D) one emulated call may take: the conformance suite's
# (shared_tests/test_conformance.py) EMULATOR_GAPS and CPU_BUDGET. Emulators run a GPU's threads one at a
# time in Python; within these budgets the whole emulated run takes a minute or two on two cores.
EMULATOR_GAPS = {
    ("fa2-triton", "bf16"): "Triton's interpreter computes bf16 tl.dot wrongly; fa2-triton refuses it there",
    ("fa2-numba-cuda", "bf16"): "numba's CUDA simulator has no bfloat16 (shared_tests: EMULATOR_GAPS)",
}
EMULATED_BUDGET = {"fa2-triton": 1e7, "fa2-numba-cuda": 6e4}
# --varlen, (emulated, quick): tokens, the range of the lengths, head_dims, dtypes, the dense reference N. The
# emulated run is fp16: Triton's interpreter refuses bf16 and fa2-triton is not in the fp32 comparison.
VARLEN_DEFAULTS = {
    (False, False): (GPU_TOKENS, (256, 4096), (64, 128), ("bf16",), (2048,)),
    (False, True): (GPU_TOKENS, (256, 4096), (128,), ("bf16",), (2048,)),
    (True, False): (256, (16, 64), (16, 32), ("fp16",), (32,)),
    (True, True): (256, (16, 64), (16,), ("fp16",), (32,)),
}


@dataclass(frozen=True)
class Decode:
    """--decode's sweep: ``queries`` query tokens per sequence at each (batch, cached keys) of ``points``,
    the cache contiguous and paged in pages of each of ``page_sizes``; ``heads`` query heads, heads / group
    key/value heads (Config.heads overrides the heads)."""

    points: tuple[tuple[int, int], ...]
    queries: tuple[int, ...]
    page_sizes: tuple[int, ...]
    heads: int
    group: int

    def describe(self) -> dict:
        """What run.json records of it."""
        return {
            "points": [list(p) for p in self.points],
            "queries": list(self.queries),
            "page_sizes": list(self.page_sizes),
            "heads": self.heads,
            "group": self.group,
        }


# --decode, (emulated, quick): the sweep, head_dims, dtypes. GPU: issue 22's shapes (32 query heads / 8 key-value
# heads, D 128, bf16). Emulated: within numba's simulator's budget (EMULATED_BUDGET; <= 64 keys, D 16), fp16 (the
# interpreter and the simulator have no bf16); 40 keys are not a whole number of pages of 16 or 32.
DECODE_DEFAULTS = {
    (False, False): (
        Decode(((8, 8192), (8, 32768), (1, 131072), (64, 4096)), (1, 4), (16, 256), 32, 4),
        (128,),
        ("bf16",),
    ),
    (False, True): (Decode(((8, 32768),), (1, 4), (16, 256), 32, 4), (128,), ("bf16",)),
    (True, False): (Decode(((2, 40), (1, 64)), (1, 4), (16, 32), 4, 2), (16,), ("fp16",)),
    (True, True): (Decode(((2, 40),), (1,), (16,), 4, 2), (16,), ("fp16",)),
}


@dataclass(frozen=True)
class Packing:
    """--varlen's packed batch: ``tokens`` tokens in sequences whose lengths ``random.Random(seed)`` draws
    uniformly from [low, high], each draw leaving at least ``low`` tokens; the last sequence is what is left
    once that is at most ``high``, so every length lies in [low, high] and they sum to ``tokens``."""

    tokens: int
    low: int
    high: int
    seed: int = 0

    def lengths(self) -> tuple[int, ...]:
        # high >= 2 low - 1: what is left above high can always be split into two lengths of at least low.
        if (
            not 1 <= self.low <= self.high
            or self.tokens < self.low
            or (self.tokens > self.high and self.high < 2 * self.low - 1)
        ):
            raise ValueError(
                f"a packed batch needs 1 <= low <= high, tokens >= low and, for more than one sequence, "
                f"high >= 2 low - 1; got {self.tokens} tokens in lengths {self.low} to {self.high}"
            )
        rng, out, left = random.Random(self.seed), [], self.tokens
        while left > self.high:
            out.append(rng.randint(self.low, min(self.high, left - self.low)))
            left -= out[-1]
        return (*out, left)

    def describe(self) -> dict:
        """What run.json records of it."""
        return {
            "tokens": self.tokens,
            "low": self.low,
            "high": self.high,
            "seed": self.seed,
            "lengths": list(self.lengths()),
        }


@dataclass
class Config:
    providers: tuple[str, ...]
    seqlens: tuple[int, ...]
    head_dims: tuple[int, ...]
    causals: tuple[bool, ...]
    dtypes: tuple[str, ...]
    device: torch.device
    out_dir: Path
    name: str
    math_max_seqlen: int = MATH_MAX_SEQLEN
    append: bool = False
    command: str = ""
    modes: tuple[str, ...] = ("fwd",)
    # Query heads per key/value head (grouped-query attention), each a point of the sweep; 1: every head its own.
    groups: tuple[int, ...] = (1,)
    # Sliding windows, each a point of the sweep of the causal shapes: -1 none, W >= 0 window (W, 0) with causal.
    windows: tuple[int, ...] = (-1,)
    # Softcaps, each a point of the sweep: 0 none.
    softcaps: tuple[float, ...] = (0.0,)
    # Query heads; None: the default (GPU: GPU_HIDDEN / D, emulated: EMULATED_HEADS).
    heads: int | None = None
    # How the fa2 providers are called (providers.FA2_ENTRIES).
    fa2_entry: str = "attention"
    # Mode "bwd"'s seqlens and dtypes; None: the forward's.
    bwd_seqlens: tuple[int, ...] | None = None
    bwd_dtypes: tuple[str, ...] | None = None
    # --varlen: the packed batch of every shape; seqlens are then the N of the fa2 backends' dense reference.
    varlen: Packing | None = None
    # --decode: the decode sweep (seqlens and causals are then not read).
    decode: Decode | None = None

    @property
    def emulated(self) -> bool:
        return self.device.type != "cuda"

    def shapes(self) -> list[Shape]:
        """Every point of the sweep, the backward's after the forward's; a window only on causal shapes.
        --varlen: per (mode, dtype, D, causal) the packed batch, then the dense reference shapes."""
        if self.varlen:
            return self._varlen_shapes()
        if self.decode:
            return self._decode_shapes()
        if any(w >= 0 for w in self.windows) and True not in self.causals:
            raise ValueError(
                f"--window {','.join(map(str, self.windows))} is fa2's window (W, 0) with causal=True: "
                "give --causal yes"
            )
        out = []
        for mode in self.modes:
            bwd = mode == "bwd"
            dtypes = self.bwd_dtypes if bwd and self.bwd_dtypes else self.dtypes
            seqlens = self.bwd_seqlens if bwd and self.bwd_seqlens else self.seqlens
            for dtype in dtypes:
                for head_dim in self.head_dims:
                    for causal in self.causals:
                        for n in seqlens:
                            if self.emulated:
                                batch, heads = EMULATED_BATCH, EMULATED_HEADS
                            else:
                                batch, heads = max(1, GPU_TOKENS // n), max(1, GPU_HIDDEN // head_dim)
                            heads = self.heads or heads
                            for group in self.groups:
                                if group < 1 or heads % group:
                                    raise ValueError(
                                        f"--group {group} does not divide the {heads} query heads of D = {head_dim}"
                                    )
                                # A window belongs to the causal shapes; the others run without one, if asked.
                                windows = self.windows if causal else [w for w in self.windows if w < 0]
                                for window in windows:
                                    for softcap in self.softcaps:
                                        out.append(
                                            Shape(
                                                dtype, head_dim, causal, n, batch, heads, mode, group, window, softcap
                                            )
                                        )
        return out

    def _varlen_shapes(self) -> list[Shape]:
        if self.groups != (1,) or self.windows != (-1,) or self.softcaps != (0.0,):
            raise ValueError("--varlen times plain attention: no --group, --window or --softcap")
        lengths = self.varlen.lengths()
        out = []
        for mode in self.modes:
            bwd = mode == "bwd"
            dtypes = self.bwd_dtypes if bwd and self.bwd_dtypes else self.dtypes
            seqlens = self.bwd_seqlens if bwd and self.bwd_seqlens else self.seqlens
            for dtype in dtypes:
                for head_dim in self.head_dims:
                    heads = self.heads or (EMULATED_HEADS if self.emulated else max(1, GPU_HIDDEN // head_dim))
                    for causal in self.causals:
                        out.append(
                            Shape(dtype, head_dim, causal, sum(lengths), len(lengths), heads, mode, lengths=lengths)
                        )
                        out += [
                            Shape(dtype, head_dim, causal, n, max(1, self.varlen.tokens // n), heads, mode)
                            for n in seqlens
                        ]
        return out

    def _decode_shapes(self) -> list[Shape]:
        if self.windows != (-1,) or self.softcaps != (0.0,) or self.modes != ("fwd",):
            raise ValueError("--decode times the forward of plain attention: no --window, --softcap or backward")
        d = self.decode
        heads = self.heads or d.heads
        if heads % d.group:
            raise ValueError(f"--group {d.group} does not divide the {heads} query heads")
        return [
            Shape(dtype, head_dim, False, seqlen, batch, heads, group=d.group, seqlen_q=n_q, page_size=page)
            for dtype in self.dtypes
            for head_dim in self.head_dims
            for n_q in d.queries
            for batch, seqlen in d.points
            for page in (0, *d.page_sizes)
        ]

    def path(self, suffix: str) -> Path:
        return self.out_dir / f"{self.name}{suffix}"

    def partial_path(self, suffix: str) -> Path:
        """Where a run writes ``path(suffix)`` until it ends (``Records.commit``)."""
        return self.out_dir / f"{self.name}.partial{suffix}"


def skip_reason(p: Provider, shape: Shape, cfg: Config) -> str | None:
    """Why ``p`` does not run ``shape`` in this sweep (it can run on this machine at all: checked before)."""
    if cfg.varlen and not shape.varlen and p.backend is None:
        return (
            "--varlen: the dense shapes are the fa2 backends' own reference (issue 21: packed at least 0.95x "
            "the backend's dense TFLOP/s at N = 2k)"
        )
    if shape.page_size and not p.paged:
        return f"paged cache: {_NO_PAGES.get(p.name, f'{p.name} reads no block table')}"
    if shape.mode not in p.modes:
        return f"{shape.mode}: {p.name} is timed in {', '.join(p.modes)} only"
    if shape.dtype not in p.dtypes:
        return f"{shape.dtype}: {p.dtype_reason}"
    if cfg.emulated and (p.name, shape.dtype) in EMULATOR_GAPS:
        return EMULATOR_GAPS[p.name, shape.dtype]
    if cfg.emulated and shape.work > EMULATED_BUDGET.get(p.name, float("inf")):
        work = "H·D·Σ n²" if shape.varlen else "B·H·N²·D"
        return f"emulated: {work} over {p.name}'s budget of {EMULATED_BUDGET[p.name]:.0e} for the CPU run"
    if shape.window >= 0 and not p.windows:
        return f"window {shape.window}: {_no_option(p, 'sliding window')}"
    if shape.softcap and not p.softcaps:
        return f"softcap {shape.softcap:g}: {_no_option(p, 'softcap')}"
    if p.name == "sdpa-math" and shape.seqlen > cfg.math_max_seqlen:
        return (
            f"N > --math-max-seqlen {cfg.math_max_seqlen}: SDPA math materialises B·H·N² scores (tens of GB at N = 16k)"
        )
    return None


_NO_PAGES = {
    name: "SDPA has no paged cache (the paged rows are each fa2 backend's, against its contiguous rows)"
    for name in ("sdpa", "sdpa-flash")
} | {"flex": "fa2.bench gives FlexAttention no paged cache"}


def _no_option(p: Provider, option: str) -> str:
    if p.backend is not None:
        return (
            f"--fa2-entry sdpa: fa2.scaled_dot_product_attention has SDPA's signature, no {option} "
            "(--fa2-entry attention has)"
        )
    return f"{p.name}: SDPA has no {option} (only an explicit attn_mask, which would not be a {option} kernel)"


def environment(device: torch.device) -> dict[str, str]:
    """The CSV's environment columns."""
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else EMULATED_GPU,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba_cuda": _version("numba-cuda"),
        "commit": _commit(),
    }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _commit() -> str:
    """HEAD of the checkout this package lives in, "+dirty" with uncommitted changes to tracked files; or
    $FA2_BENCH_COMMIT, for a copy of the tree without its .git (an offline GPU machine)."""
    if os.environ.get("FA2_BENCH_COMMIT"):
        return os.environ["FA2_BENCH_COMMIT"]
    here = Path(__file__).parent
    try:

        def git(*a):
            return subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, check=True).stdout

        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
        return git("rev-parse", "--short=12", "HEAD").strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Records:
    """The CSV of measurements, the CSV of everything not measured and the runs' JSON, written row by row
    into their ``partial_path`` and moved over the earlier files by ``commit``. ``append`` keeps the earlier
    rows of both CSVs except those this run measures again."""

    SUFFIXES = (".csv", "-skipped.csv", "-run.json")

    def __init__(self, cfg: Config, shapes: list[Shape]):
        self.cfg, self.measured = cfg, 0
        self.results, self.issues = cfg.partial_path(".csv"), cfg.partial_path("-skipped.csv")
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        planned = {_key(p, s) for s in shapes for p in cfg.providers}
        for suffix, path, columns in ((".csv", self.results, COLUMNS), ("-skipped.csv", self.issues, ISSUE_COLUMNS)):
            earlier = read_csv(cfg.path(suffix)) if cfg.append else []
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, columns)
                writer.writeheader()
                writer.writerows(r for r in earlier if tuple(r[c] for c in KEY) not in planned)

    def commit(self) -> None:
        """The run's files replace the earlier ones, if it measured anything; otherwise the earlier ones stay
        and SystemExit says where the reasons are."""
        if not self.measured:
            raise SystemExit(
                f"fa2.bench: nothing was measured; {self.cfg.path('.csv')} and the files beside it are kept as "
                f"they were, and {self.issues} says why each (provider, shape) was not measured"
            )
        for suffix in self.SUFFIXES:
            os.replace(self.cfg.partial_path(suffix), self.cfg.path(suffix))

    def result(self, row: dict) -> None:
        self.measured += 1
        self._append(self.results, COLUMNS, row)

    def issue(self, p: str, shape: Shape, status: str, reason: str) -> None:
        self._append(
            self.issues,
            ISSUE_COLUMNS,
            {**_shape_columns(p, shape), "status": status, "reason": reason, "timestamp": now_utc()},
        )

    @staticmethod
    def _append(path: Path, columns: tuple[str, ...], row: dict) -> None:
        with path.open("a", newline="") as f:
            csv.DictWriter(f, columns).writerow(row)


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a results or skipped CSV; those written before the heads_k, window, softcap, lengths,
    seqlen_q, page_size and tbps columns existed get their values (heads_k = heads, no window, no softcap,
    dense, not decode, contiguous, no rate); tbps only in a results CSV, whose rows have ms."""
    rows = output.read_csv(path)
    for r in rows:
        if "heads" in r:
            defaults = [
                ("heads_k", r["heads"]),
                ("window", "-1"),
                ("softcap", "0"),
                ("lengths", ""),
                ("seqlen_q", "0"),
                ("page_size", "0"),
            ] + [("tbps", "")] * ("ms" in r)
            for column, default in defaults:
                if not r.get(column):
                    r[column] = default
    return rows


def _shape_columns(provider: str, s: Shape) -> dict:
    return {
        "provider": provider,
        "mode": s.mode,
        "dtype": s.dtype,
        "head_dim": s.head_dim,
        "causal": s.causal,
        "seqlen": s.seqlen,
        "batch": s.batch,
        "heads": s.heads,
        "heads_k": s.heads_k,
        "window": s.window,
        "softcap": f"{s.softcap:g}",
        "lengths": " ".join(map(str, s.lengths)),
        "seqlen_q": s.seqlen_q,
        "page_size": s.page_size,
    }


def _key(provider: str, s: Shape) -> tuple[str, ...]:
    columns = _shape_columns(provider, s)
    return tuple(str(columns[c]) for c in KEY)


def heads_first(shape: Shape, x: torch.Tensor | None) -> torch.Tensor | None:
    """What the check reads: a packed shape's (total, heads, ...) tensor as a (1, heads, total, ...) view, its
    L (heads, total) as (1, heads, total); a dense shape's tensors as they are."""
    if x is None or not shape.varlen:
        return x
    return x.unsqueeze(0) if x.dim() == 2 else x.transpose(0, 1).unsqueeze(0)


def measure(p: Provider, shape: Shape, q, k, v, sample: check.Sample, device: torch.device, dO=None, extra: tuple = ()):
    """("ok", (call, first_s, peak_mem_gb)) or (status, reason) with status "wrong", "skipped" or "failed":
    ``call`` runs what is timed, its first run took ``first_s``. Mode "bwd" times the backward alone, given dO.
    A packed shape's q, k, v, dO and what the provider returns are (total, heads, ...) (``heads_first``). The
    provider is called with (q, k, v, *extra), or with what its ``prepare`` makes of them (untimed)."""

    def checked(*xs):
        return [heads_first(shape, x) for x in xs]

    try:
        fn = p.build(shape, device)
        args = p.prepare(q, k, v, *extra) if p.prepare else (q, k, v, *extra)
        call = functools.partial(fn, *args)
        if shape.mode == "bwd":
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            with torch.enable_grad():
                O, L = fn(*inputs)
            problem = check.problem(*checked(O.detach(), L if p.returns_lse else None, q), sample)
            if problem:
                return "wrong", f"forward: {problem}"
            call = functools.partial(torch.autograd.grad, O, inputs, dO, retain_graph=True)
            grads, first_s = timing.timed_once(call, device)
            problem = check.grad_problem(checked(*grads), *checked(q, k, v), sample)
            del grads, L
        else:
            (O, L), first_s = timing.timed_once(call, device)
            problem = check.problem(*checked(O, L if p.returns_lse else None, q), sample)
            del O, L
        if problem:
            return "wrong", problem
        return "ok", (call, first_s, timing.peak_mem_gb(call, device))
    except NotImplementedError as e:  # a backend's documented refusal of this input
        return "skipped", exception_reason(e)
    except Exception as e:
        return "failed", exception_reason(e)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def time_rounds(
    calls: dict[str, tuple], device: torch.device, started: Callable[[str], None] = lambda name: None
) -> dict[str, tuple[str, object]]:
    """name -> ("ok", ms) or ("failed", reason) for ``calls`` (name -> (call, first_s)): each timed in
    ``timing.rounds(device)`` rounds, every other round in reverse order; ms is the median of its rounds.
    ``started(name)`` before each timing, for the progress bar."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    failed: dict[str, str] = {}
    for r in range(timing.rounds(device)):
        for name in list(calls)[:: -1 if r % 2 else 1]:
            if name in failed:
                continue
            call, first_s = calls[name]
            started(name)
            try:
                times[name].append(timing.median_ms(call, device, first_s))
            except Exception as e:
                failed[name] = exception_reason(e)
    return {
        name: ("failed", failed[name]) if name in failed else ("ok", statistics.median(times[name])) for name in calls
    }


def run(cfg: Config, progress) -> None:
    """Measures every (shape, provider) of ``cfg`` into ``<name>.csv``, ``<name>-skipped.csv`` and
    ``<name>-run.json`` (the environment, the command, the matmul ceilings or with --decode the copy ceiling,
    the wall time) under ``cfg.out_dir``, through ``Records`` (nothing measured: the earlier files stay, and
    SystemExit says so). ``progress(total)``: a tqdm-like bar."""
    started = time.perf_counter()
    if cfg.emulated:
        # On a few shared cores torch's thread pool makes CPU times swing a hundredfold; one thread is steady.
        torch.set_num_threads(1)
    env = environment(cfg.device)
    shapes = cfg.shapes()
    records = Records(cfg, shapes)
    # Each provider's dense, packed (--varlen) and decode (--decode) path; a name may have only some of them.
    dense = {
        name: fa2_provider(PROVIDERS[name], cfg.fa2_entry) if PROVIDERS[name].backend else PROVIDERS[name]
        for name in cfg.providers
        if name in PROVIDERS
    }
    packed = {name: VARLEN_PROVIDERS[name] for name in cfg.providers if name in VARLEN_PROVIDERS}
    decoding = {name: DECODE_PROVIDERS[name] for name in cfg.providers if name in DECODE_PROVIDERS}
    paths = {"dense": dense, "packed": packed, "decode": decoding}
    # Per path: a name's paths can differ in what they need (sdpa-flash: an aten op, or the dispatcher on the CPU).
    unavailable = {
        (path, name): p.unavailable(cfg.device) for path, table in paths.items() for name, p in table.items()
    }
    earlier = read_runs(cfg.path("-run.json")) if cfg.append else []
    info = {
        **env,
        "device": str(cfg.device),
        "emulated": cfg.emulated,
        "command": cfg.command,
        "started": now_utc(),
        "timing": timing.describe(cfg.device),
        "ceilings": timing.copy_ceiling(cfg.device) if cfg.decode else timing.matmul_ceilings(cfg.device),
    }
    if cfg.varlen:
        info["varlen"] = cfg.varlen.describe()
    if cfg.decode:
        info["decode"] = cfg.decode.describe()
    write_runs(cfg, earlier + [info])

    bar = progress(len(shapes) * len(cfg.providers))
    with torch.no_grad():
        for group in timing_groups(shapes):
            runnable = []
            for shape in group:
                for name in cfg.providers:
                    path = "decode" if shape.decode else "packed" if shape.varlen else "dense"
                    p = paths[path].get(name)
                    reason = (
                        _no_path(name, shape) if p is None else (unavailable[path, name] or skip_reason(p, shape, cfg))
                    )
                    if reason:
                        records.issue(name, shape, "skipped", reason)
                        bar.update()
                    else:
                        runnable.append((p, shape))
            if runnable and group[0].decode:
                _measure_decode(group, runnable, cfg, env, records, bar)
            elif runnable:
                _measure_shape(group[0], [p for p, _ in runnable], cfg, env, records, bar)
    bar.close()
    info["wall_s"] = round(time.perf_counter() - started, 1)
    write_runs(cfg, earlier + [info])
    records.commit()


def timing_groups(shapes: list[Shape]) -> list[list[Shape]]:
    """The shapes measured together, their providers timed in the same rounds: a decode point's layouts
    (contiguous and each page size, one after the other in ``Config.shapes``), every other shape alone."""
    groups: list[list[Shape]] = []
    for shape in shapes:
        if (
            shape.decode
            and groups
            and groups[-1][0].decode
            and replace(groups[-1][0], page_size=0) == replace(shape, page_size=0)
        ):
            groups[-1].append(shape)
        else:
            groups.append([shape])
    return groups


def _no_path(name: str, shape: Shape) -> str:
    if shape.decode:
        return f"decode: {name} has no KV-cache path here (--decode times {', '.join(DECODE_PROVIDERS)})"
    if shape.varlen:
        return f"packed: {name} has no packed-batch path here (--varlen times {', '.join(VARLEN_PROVIDERS)})"
    if name in VARLEN_PROVIDERS:
        return f"dense: {name} is timed on packed batches only (--varlen)"
    return f"dense: {name} is timed on decode shapes only (--decode)"


def _measure_shape(shape: Shape, providers: list[Provider], cfg: Config, env: dict, records: Records, bar):
    seed = shape.seqlen * 7 + shape.head_dim
    torch.manual_seed(seed)
    # Dense: (batch, heads, seqlen, head_dim). Packed: (total, heads, head_dim), the check on views.
    dims = (
        (lambda heads: (shape.seqlen, heads, shape.head_dim))
        if shape.varlen
        else (lambda heads: (shape.batch, heads, shape.seqlen, shape.head_dim))
    )
    q, k, v = (
        torch.randn(*dims(heads), device=cfg.device, dtype=DTYPES[shape.dtype])
        for heads in (shape.heads, shape.heads_k, shape.heads_k)
    )
    dO = torch.randn_like(q) if shape.mode == "bwd" else None
    try:
        sample = check.reference_sample(
            *(heads_first(shape, x) for x in (q, k, v)),
            shape.causal,
            seed,
            heads_first(shape, dO),
            window=shape.window_pair,
            softcap=shape.softcap,
            lengths=shape.lengths,
        )
    except Exception as e:
        for p in providers:
            records.issue(p.name, shape, "failed", f"the reference check could not run: {exception_reason(e)}")
            bar.update()
        return
    checked = {}
    for p in providers:
        bar.set_postfix_str(f"{p.name} {shape}: checking")
        status, outcome = measure(p, shape, q, k, v, sample, cfg.device, dO)
        if status == "ok":
            checked[p.name] = outcome
        else:
            records.issue(p.name, shape, status, outcome)
            if status != "skipped":
                bar.write(f"{p.name} {shape}: {status}: {outcome}")
        bar.update()
    timed = time_rounds(
        {name: (call, first_s) for name, (call, first_s, _) in checked.items()},
        cfg.device,
        lambda name: bar.set_postfix_str(f"{name} {shape}: timing"),
    )
    for name, (status, outcome) in timed.items():
        if status == "ok":
            mem = checked[name][2]
            records.result(
                {
                    **_shape_columns(name, shape),
                    "ms": f"{outcome:.6g}",
                    "tflops": f"{shape.flops / (outcome * 1e-3) / 1e12:.6g}",
                    "peak_mem_gb": "" if mem is None else f"{mem:.4g}",
                    **env,
                    "timestamp": now_utc(),
                }
            )
        else:
            records.issue(name, shape, status, outcome)
            bar.write(f"{name} {shape}: {status}: {outcome}")


def decode_inputs(group: list[Shape], device: torch.device):
    """The tensors of a decode point's layouts (``group``: its shapes, the contiguous one first): the logical
    (q, k, v) (batch, heads[_k], seqlen[_q], head_dim) the reference reads, cache_seqlens (batch,) int32 all
    seqlen, and per page size P (0: contiguous) the cache as the providers get it, (k, v, block_table):

    - q: a transposed view of flash-attn's (batch, seqlen_q, heads, head_dim), standard normal;
    - contiguous: k, v transposed views of flash-attn's (batch, seqlen, heads_k, head_dim), capacity seqlen;
    - paged: the same keys in (num_pages, P, heads_k, head_dim) pages, num_pages = batch · ⌈seqlen / P⌉, as
      transposed views (num_pages, heads_k, P, head_dim); block_table (batch, pages_per_seq) int32 is a random
      permutation of the pages (as flash-attn's tests build it), key j of row b at page block_table[b, j // P],
      row j % P; a last page's rows past seqlen (P not dividing seqlen) standard normal.
    The same keys in every layout, so that each layout is checked against the same reference."""
    s = group[0]
    dtype = DTYPES[s.dtype]

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    q = randn(s.batch, s.seqlen_q, s.heads, s.head_dim).transpose(1, 2)
    k_flash, v_flash = (randn(s.batch, s.seqlen, s.heads_k, s.head_dim) for _ in range(2))
    cache_seqlens = torch.full((s.batch,), s.seqlen, dtype=torch.int32, device=device)
    layouts = {}
    for page in sorted({shape.page_size for shape in group}):
        if not page:
            layouts[0] = (k_flash.transpose(1, 2), v_flash.transpose(1, 2), None)
            continue
        pages_per_seq = -(-s.seqlen // page)
        num_pages = s.batch * pages_per_seq
        block_table = torch.randperm(num_pages, device=device).to(torch.int32).reshape(s.batch, pages_per_seq)
        caches = []
        for flash in (k_flash, v_flash):
            tail = pages_per_seq * page - s.seqlen
            keys = torch.cat([flash, randn(s.batch, tail, s.heads_k, s.head_dim)], dim=1) if tail else flash
            pages = torch.empty(num_pages, page, s.heads_k, s.head_dim, device=device, dtype=dtype)
            pages[block_table.flatten().long()] = keys.reshape(num_pages, page, s.heads_k, s.head_dim)
            caches.append(pages.transpose(1, 2))
        layouts[page] = (*caches, block_table)
    return (q, k_flash.transpose(1, 2), v_flash.transpose(1, 2)), cache_seqlens, layouts


def _measure_decode(
    group: list[Shape], runnable: list[tuple[Provider, Shape]], cfg: Config, env: dict, records: Records, bar
):
    """A decode point: its layouts' inputs (``decode_inputs``), one reference on the sample for all of them,
    each (provider, layout) checked, then all timed in the same rounds."""
    s = group[0]
    seed = s.seqlen * 7 + s.head_dim + 1009 * s.seqlen_q + 31 * s.batch
    torch.manual_seed(seed)
    try:
        (q, k, v), cache_seqlens, layouts = decode_inputs(group, cfg.device)
        sample = check.reference_sample(q, k, v, False, seed)
        del k, v
    except Exception as e:
        for p, shape in runnable:
            records.issue(
                p.name, shape, "failed", f"the inputs or the reference check could not be made: {exception_reason(e)}"
            )
            bar.update()
        return
    checked = {}
    for p, shape in runnable:
        bar.set_postfix_str(f"{p.name} {shape}: checking")
        k_cache, v_cache, block_table = layouts[shape.page_size]
        status, outcome = measure(p, shape, q, k_cache, v_cache, sample, cfg.device, extra=(cache_seqlens, block_table))
        if status == "ok":
            checked[p.name, shape] = outcome
        else:
            records.issue(p.name, shape, status, outcome)
            if status != "skipped":
                bar.write(f"{p.name} {shape}: {status}: {outcome}")
        bar.update()
    timed = time_rounds(
        {key: (call, first_s) for key, (call, first_s, _) in checked.items()},
        cfg.device,
        lambda key: bar.set_postfix_str(f"{key[0]} {key[1]}: timing"),
    )
    for (name, shape), (status, outcome) in timed.items():
        if status == "ok":
            mem = checked[name, shape][2]
            seconds = outcome * 1e-3
            records.result(
                {
                    **_shape_columns(name, shape),
                    "ms": f"{outcome:.6g}",
                    "tflops": f"{shape.flops / seconds / 1e12:.6g}",
                    "tbps": f"{shape.kv_bytes / seconds / 1e12:.6g}",
                    "peak_mem_gb": "" if mem is None else f"{mem:.4g}",
                    **env,
                    "timestamp": now_utc(),
                }
            )
        else:
            records.issue(name, shape, status, outcome)
            bar.write(f"{name} {shape}: {status}: {outcome}")


def write_runs(cfg: Config, runs: list[dict]) -> None:
    cfg.partial_path("-run.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
