"""``python -m fa2_triton.tuning.forward``: times launch configurations of the forward kernel on this GPU and
proposes the tile table (``tiles.TILES``) entries for the benchmark's shapes.

Shapes: the benchmark's (16k tokens, hidden 2048: B = 16384 / N, H = 2048 / D), contiguous (B, H, N, D).
Candidates: every BLOCK_M ∈ {64, 128}, BLOCK_N ∈ {32, 64, 128}, num_warps ∈ {4, 8}, num_stages ∈ {2, 3, 4}
with tensor descriptors and with pointer loads (``--loads``: which of the two go with the tiles decides
the registers, and so how many programs share an SM) and, under causal, the longest query tiles first;
each also with ``maxnreg`` lowered so that one more program fits on an SM by registers (where shared
memory allows it), and with ``warp_specialize`` where ``tiles.ws_tiles`` allows it. Then the levers one
at a time on the two fastest of those per shape: the other loads, ``fused_exp2`` off, ``lazy_rescale`` on,
the other grid orders (causal), warp specialisation off, and the winner is the fastest of everything
measured.

Every candidate is compiled first, in parallel worker processes (one CUDA context each) that also run it
once on a small input: one that fails to compile, runs out of shared memory or crashes there is
recorded with the reason and never run here. Before it is timed, each candidate's output on the real
shape (O and L poisoned with NaN first) must pass the benchmark's own check (``fa2.bench.check``: a
sample of rows against the fp64 reference): a wrong configuration is recorded as wrong, never timed.
Timing: ``triton.testing.do_bench`` median, warm-up/rep 10/40 ms while searching; the final table re-times
each shape's winner, the current table's choice, sdpa-flash and sdpa-cudnn with the benchmark's own clock
(``fa2.bench.timing``: do_bench median, 25/100 ms).
``--budget-s`` bounds compiling and searching (the final table adds ~15 s): once a stage's share is
spent, its remaining compiles are left to this process and its remaining timings are skipped (and
recorded as such); candidates go in the order of the list above, each on every shape before the next.
Candidates whose tiles need more shared memory than an SM has are recorded as such, not compiled.

Writes every measurement to ``<gpu>-tune.csv`` in ``--out`` (default: the checkout's docs/benchmarks, as
``python -m fa2.bench``), or to ``--csv``, and prints, compactly:
the failures by reason, each lever's effect, the per-shape table and the ``TILES`` entries to paste into
tiles.py. Without a GPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``) on tiny shapes, timed
with ``time.perf_counter``: a check of this tool, not a measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import functools
import math
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from fa2.bench import check, timing
from fa2.bench.output import default_name, default_out
from fa2.bench.providers import PROVIDERS, Shape
from fa2.bench.report import seqlen_label
from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_triton import forward
from fa2_triton.common import INTERPRETED
from fa2_triton.tiles import Tiles, tiles_for, ws_tiles

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS, HIDDEN = 16384, 2048
# do_bench while searching on a GPU; the final table uses the benchmark's own clock (fa2.bench.timing).
SEARCH_WARMUP_MS, SEARCH_REP_MS = 10, 40
# Where in --budget-s each stage must end: compiling the tiles, their maxnreg variants, the tile search,
# compiling and timing the levers; the final table comes after.
COMPILE_SHARE, MAXNREG_SHARE, SEARCH_SHARE, LEVER_COMPILE_SHARE, LEVER_SHARE = 0.25, 0.35, 0.72, 0.8, 0.9
# Hopper: 64K 32-bit registers and 228 KiB of shared memory per SM (1 KiB of it reserved per program).
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED = 65536, 233472, 1024
# The small input each worker runs a candidate on: the benchmark's H (a multiple of 16, as Triton
# specialises on divisibility by 16) and N a multiple of 16, so the compiled kernel is the one timed.
WARM_SEQLEN = 256
MAX_REASONS = 8  # failure reasons printed; the CSV has them all


def shape_spec(causal: bool, scale: float) -> AttentionSpec:
    """The AttentionSpec of a benchmark shape: causal or full attention, no softcap or ALiBi (the tile
    tables are keyed by masked or not, and causal's entries serve every window)."""
    return AttentionSpec(scale, (UNBOUNDED, 0) if causal else (UNBOUNDED, UNBOUNDED))


CSV_COLUMNS = (
    "dtype",
    "head_dim",
    "causal",
    "seqlen",
    "batch",
    "heads",
    "stage",
    "config",
    "status",
    "reason",
    "ms",
    "tflops",
    "n_regs",
    "n_spills",
    "shared",
    "gpu",
    "triton",
    "torch",
)


@dataclass(frozen=True)
class Point:
    """One shape of the sweep."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int

    @property
    def flops(self) -> float:
        return 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim / (2 if self.causal else 1)

    @property
    def label(self) -> str:
        return f"D{self.head_dim} {'causal' if self.causal else 'full'} {seqlen_label(self.seqlen)}"


@dataclass
class Result:
    status: str  # ok, wrong, failed, skipped
    reason: str = ""
    ms: float = math.nan
    n_regs: int | None = None
    n_spills: int | None = None
    shared: int | None = None


@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    start: float = field(default_factory=time.monotonic)
    rows: list[dict] = field(default_factory=list)
    # (dtype, head_dim, causal, Tiles) -> what compiling and running it on the small input gave.
    compiled: dict = field(default_factory=dict)
    pool: cf.ProcessPoolExecutor | None = None
    compiled_here: int = 0  # candidates whose first call here took over a second (a compile)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self, share: float) -> bool:
        return self.elapsed() < share * self.args.budget_s


def describe(t: Tiles) -> str:
    """Tiles as Python: the four tile numbers positional, the levers that differ from the defaults by name."""
    levers = [
        f"{name}={getattr(t, name)!r}" for name in Tiles._fields[4:] if getattr(t, name) != Tiles._field_defaults[name]
    ]
    return f"Tiles({', '.join([str(x) for x in t[:4]] + levers)})"


def _short(t: Tiles) -> str:
    """Tiles for the printed table: 128x64 w8 s3 + lever flags."""
    flags = [("tma" if t.tma else "ptr"), f"g{t.grid_order}"]
    flags += ["lazy"] if t.lazy_rescale else []
    flags += [] if t.fused_exp2 else ["nofma"]
    flags += [f"r{t.maxnreg}"] if t.maxnreg else []
    flags += ["ws"] if t.warp_specialize else []
    return f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages} {' '.join(flags)}"


def failure_reason(e: BaseException) -> str:
    """An exception in one line: its type and the last line of its message (a Triton compile error's
    first lines are the source location; fa2.bench.sweep keeps the first line of the benchmark's)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return re.sub(r"\s+", " ", text)[:200]


def points(args: argparse.Namespace, point: type[Point] = Point) -> list[Point]:
    """The sweep's shapes as ``point`` (the backward tuner passes its own, which counts the backward's
    FLOPs)."""
    out = []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for causal in args.causal:
                for n in args.seqlens:
                    batch, heads = max(1, args.tokens // n), max(1, args.hidden // head_dim)
                    out.append(point(dtype, head_dim, causal, n, batch, heads))
    return out


def base_candidates(args: argparse.Namespace, causal: bool) -> list[Tiles]:
    tiles = [
        Tiles(bm, bn, w, s, tma=loads == "tma", grid_order=1 if causal else 0)
        for bm in args.block_m
        for bn in args.block_n
        for w in args.warps
        for s in args.stages
        for loads in args.loads
    ]
    # The warp-specialised loop builds its own descriptors whatever ``tma`` says: one such variant per tiling.
    out = [v for t in tiles for v in (t, t._replace(tma=True, warp_specialize=True)) if v is t or ws_tiles(v, causal)]
    return list(dict.fromkeys(out))


def smem_estimate(t: Tiles, head_dim: int, elem_bytes: int = 2) -> int:
    """Shared memory of the descriptor path: the q tile and num_stages buffers of k and v tiles."""
    return (t.block_m + 2 * t.num_stages * t.block_n) * head_dim * elem_bytes


def lever_variants(t: Tiles, causal: bool) -> list[Tiles]:
    if t.warp_specialize:
        # On the tuner's shapes it builds its own descriptors (tma changes nothing) and takes no lazy
        # rescale (tiles.ws_tiles): of those levers only turning it off gives another kernel.
        out = [t._replace(warp_specialize=False), t._replace(fused_exp2=not t.fused_exp2)]
    else:
        out = [
            t._replace(tma=not t.tma),
            t._replace(fused_exp2=not t.fused_exp2),
            t._replace(lazy_rescale=not t.lazy_rescale),
        ]
    if causal:
        out += [t._replace(grid_order=g) for g in (0, 1, 2) if g != t.grid_order]
    if t.maxnreg is not None:
        out.append(t._replace(maxnreg=None))
    return out


def one_more_program(t: Tiles, n_regs: int, shared: int) -> int | None:
    """The maxnreg that fits one more program of t on an SM by registers, if shared memory and the 2048
    threads of an SM allow it; None otherwise. Registers go by 8 per thread (256 per warp)."""
    threads = 32 * t.num_warps
    by_regs = REGS_PER_SM // (math.ceil(n_regs / 8) * 8 * threads)
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED)
    target = by_regs + 1
    if target > by_smem or target * threads > 2048:
        return None
    maxnreg = REGS_PER_SM // (target * threads) // 8 * 8
    return maxnreg if maxnreg >= 64 else None


# ---------------------------------------------------------------------------------------------------------
# Compiling in worker processes


def _warm_inputs(dtype: torch.dtype, head_dim: int, heads: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, heads, WARM_SEQLEN, head_dim)
    return [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]


# Set in a worker once a kernel has broken its CUDA context: its later jobs are left to the main process.
_BROKEN_CONTEXT = []


def _compile_job(job):
    """In a worker: compile one candidate and run it on the small input. A Result, or None if this
    worker's CUDA context is no longer usable."""
    if _BROKEN_CONTEXT:
        return None
    dtype, head_dim, heads, causal, tiles = job
    device = torch.device("cuda")
    try:
        q, k, v = _warm_inputs(DTYPES[dtype], head_dim, heads, device)
        O = torch.full_like(q, math.nan)
        L = torch.full(q.shape[:-1], math.nan, device=device)
        kernel = forward.launch_kernel(q, k, v, O, L, shape_spec(causal, head_dim**-0.5), tiles)
        torch.cuda.synchronize()
    except Exception as e:
        if context_lost(e):
            _BROKEN_CONTEXT.append(job)
        return Result("failed", failure_reason(e))
    if torch.isnan(O).any() or torch.isnan(L).any():
        return Result("wrong", "NaN left in O or L on the small input")
    return Result("ok", n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared)


def context_lost(e: BaseException) -> bool:
    """Whether exception e says the CUDA context is lost (an illegal address, a launch failure, a misaligned
    or unspecified error): every later launch in this process would fail too."""
    text = str(e)
    return "CUDA" in text and any(s in text for s in ("illegal", "launch failure", "misaligned", "unspecified"))


def precompile(run: Run, jobs: list[tuple], until_s: float, compile_job=None, ckey=None) -> None:
    """Compiles jobs (dtype, head_dim, heads, causal, Tiles) in parallel worker processes into Triton's
    cache and records each outcome in run.compiled. Jobs not started ``until_s`` seconds into the run are
    cancelled and stay unrecorded: the main process compiles those itself if the budget allows. No job
    is left running on return (its kernel would disturb the timings). ``compile_job`` (a module-level
    function, run in the workers) and ``ckey`` (a job's key in run.compiled) default to this module's;
    ``fa2_triton.tuning.backward`` passes its own."""
    compile_job = compile_job or _compile_job
    ckey = ckey or _ckey
    jobs = [j for j in jobs if ckey(j) not in run.compiled]
    if not jobs or run.device.type != "cuda":
        return
    if run.pool is None:
        run.pool = cf.ProcessPoolExecutor(max_workers=run.args.workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {run.pool.submit(compile_job, j): j for j in jobs}
    cf.wait(futures, timeout=max(1.0, until_s - run.elapsed()))
    for f in futures:
        f.cancel()
    cf.wait(futures)
    broken = False
    for f, job in futures.items():
        if f.cancelled():
            continue
        try:
            result = f.result()
        except cf.process.BrokenProcessPool:
            result = None  # some worker died: which job killed it is unknown; the next stage starts a new pool
            broken = True
        if result is not None:
            run.compiled[ckey(job)] = result
    if broken:
        run.pool.shutdown()
        run.pool = None


def _jobs(pts: list[Point], per_point: dict) -> list[tuple]:
    """The compile jobs for per_point's candidates, candidate-major (so that a budget cut leaves every
    shape the same first candidates compiled), each (dtype, head_dim, causal, Tiles) once."""
    jobs = {}
    for i in range(max((len(c) for c in per_point.values()), default=0)):
        for p in pts:
            if i < len(per_point[p]):
                t = per_point[p][i]
                jobs.setdefault((p.dtype, p.head_dim, p.causal, t), (p.dtype, p.head_dim, p.heads, p.causal, t))
    return list(jobs.values())


def _ckey(job) -> tuple:
    dtype, head_dim, _heads, causal, tiles = job
    return dtype, head_dim, causal, tiles


# ---------------------------------------------------------------------------------------------------------
# Checking and timing in this process


class Bench:
    """One point's inputs, the reference sample and the timer."""

    def __init__(self, run: Run, p: Point):
        self.run, self.p = run, p
        g = torch.Generator(device=run.device).manual_seed(p.seqlen * 7 + p.head_dim)
        shape = (p.batch, p.heads, p.seqlen, p.head_dim)
        self.q, self.k, self.v = (
            torch.randn(shape, generator=g, device=run.device).to(DTYPES[p.dtype]) for _ in range(3)
        )
        self.scale = p.head_dim**-0.5
        self.sample = check.reference_sample(self.q, self.k, self.v, p.causal)
        self.results: dict[Tiles, Result] = {}

    def measure(self, tiles: Tiles, search: bool) -> Result:
        compiled = self.run.compiled.get((self.p.dtype, self.p.head_dim, self.p.causal, tiles))
        if compiled is not None and compiled.status != "ok":
            return compiled
        try:
            O = torch.full_like(self.q, math.nan)
            L = torch.full(self.q.shape[:-1], math.nan, device=self.q.device)
            t0 = time.monotonic()
            forward.launch_kernel(self.q, self.k, self.v, O, L, shape_spec(self.p.causal, self.scale), tiles)
            if self.run.device.type == "cuda":
                torch.cuda.synchronize()
                if time.monotonic() - t0 > 1.0:
                    self.run.compiled_here += 1  # not precompiled, or the workers' kernel was not this one
            problem = check.problem(O, L, self.q, self.sample)
            if problem is None and (torch.isnan(O).any() or torch.isnan(L).any()):
                problem = "NaN left in O or L (rows never written)"
            if problem is not None:
                return Result("wrong", problem)
            q, k, v, spec = self.q, self.k, self.v, shape_spec(self.p.causal, self.scale)
            ms = median_ms(self.run.device, lambda: forward.flash_attn_forward(q, k, v, spec, tiles), search)
        except Exception as e:
            if context_lost(e):
                raise  # the CUDA context is gone: nothing after this can be trusted
            return Result("failed", failure_reason(e))
        result = Result("ok", ms=ms)
        if compiled is not None:
            result.n_regs, result.n_spills, result.shared = compiled.n_regs, compiled.n_spills, compiled.shared
        return result


def median_ms(device: torch.device, fn, search: bool) -> float:
    """Median milliseconds: the benchmark's clock, with a shorter do_bench while searching on a GPU."""
    if search and device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=SEARCH_WARMUP_MS, rep=SEARCH_REP_MS, return_mode="median")
    _, first_s = timing.timed_once(fn, device)
    return timing.median_ms(fn, device, first_s)


def record(run: Run, p: Point, stage: str, config: str, r: Result) -> None:
    tflops = p.flops / (r.ms * 1e-3) / 1e12 if r.status == "ok" else math.nan
    run.rows.append(
        {
            "dtype": p.dtype,
            "head_dim": p.head_dim,
            "causal": p.causal,
            "seqlen": p.seqlen,
            "batch": p.batch,
            "heads": p.heads,
            "stage": stage,
            "config": config,
            "status": r.status,
            "reason": r.reason,
            "ms": f"{r.ms:.6g}",
            "tflops": f"{tflops:.1f}",
            "n_regs": r.n_regs,
            "n_spills": r.n_spills,
            "shared": r.shared,
            "gpu": gpu_name(run.device),
            "triton": triton.__version__,
            "torch": torch.__version__,
        }
    )


def gpu_name(device: torch.device) -> str:
    """The name the records give the device: the CUDA device's, or "cpu (interpreted)" off the GPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"


def search(run: Run, pts: list[Point], benches: dict, per_point: dict, stage: str, share: float) -> None:
    """Times per_point[p] (lists of Tiles) for every point, candidate-major, within the budget's share."""
    longest = max(len(c) for c in per_point.values())
    for i in range(longest):
        for p in pts:
            cands = per_point[p]
            if i >= len(cands) or cands[i] in benches[p].results:
                continue
            t = cands[i]
            if not run.left(share):
                r = Result("skipped", f"budget: {stage} share of --budget-s {run.args.budget_s:g} s spent")
            else:
                r = benches[p].measure(t, search=True)
            benches[p].results[t] = r
            record(run, p, stage, describe(t), r)


def best(results: dict, k: int = 1) -> list[Tiles]:
    ok = sorted((r.ms, i, t) for i, (t, r) in enumerate(results.items()) if r.status == "ok")
    return [t for _, _, t in ok[:k]]


# ---------------------------------------------------------------------------------------------------------
# The proposal


def proposal(pts: list[Point], benches: dict) -> dict:
    """(head_dim, causal) -> [(seqlen, Tiles, ...)]: per seqlen the configuration with the smallest geometric
    mean of time / best time over the dtypes measured there (all one dtype class, 16-bit); after a
    warp-specialised one, the best of those without it (its fallback in tiles.TILES)."""
    groups: dict = {}
    for p in pts:
        groups.setdefault((p.head_dim, p.causal, p.seqlen), []).append(p)
    out: dict = {}
    for (d, causal, n), ps in sorted(groups.items()):
        scores: dict = {}
        for p in ps:
            res = benches[p].results
            ok = {t: r.ms for t, r in res.items() if r.status == "ok"}
            if not ok:
                continue
            fastest = min(ok.values())
            for t, ms in ok.items():
                scores.setdefault(t, []).append(ms / fastest)
        full = {t: s for t, s in scores.items() if len(s) == len(ps)}
        if full:
            score = {t: math.prod(s) for t, s in full.items()}
            winner = min(full, key=score.get)
            fallbacks = [t for t in full if not t.warp_specialize]
            chosen = (winner, min(fallbacks, key=score.get)) if winner.warp_specialize and fallbacks else (winner,)
            out.setdefault((d, causal), []).append((n, *chosen))
    return out


def table_entries(prop: dict, show=None) -> list[str]:
    """tiles.TILES entries from ``proposal``'s (seqlen, configuration, [fallback]): bounds halfway
    (geometrically) between the tuned seqlens, equal neighbours merged, a fallback after its entry with the
    same bound. ``show`` writes a configuration as Python (default ``describe``; the backward tuner's own
    for BWD_TILES)."""
    show = show or describe
    lines = []
    for (d, causal), tuned in sorted(prop.items()):
        entries = []
        for i, (n, *configs) in enumerate(tuned):
            bound = None if i == len(tuned) - 1 else int(math.sqrt(n * tuned[i + 1][0]))
            if entries and entries[-1][1] == configs:
                entries[-1] = (bound, configs)
            else:
                entries.append((bound, configs))
        body = ", ".join(f"({b}, {show(t)})" for b, configs in entries for t in configs)
        lines.append(f'    ({d}, "16-bit", {causal}): ({body},),')
    return lines


# ---------------------------------------------------------------------------------------------------------
# What both tuners (this one and fa2_triton.tuning.backward) share: the shape arguments, the run's arguments
# and the device.


def add_shape_arguments(parser: argparse.ArgumentParser, ints) -> None:
    parser.add_argument("--seqlens", type=ints, default=(1024, 4096, 16384), help="default 1024,4096,16384")
    parser.add_argument("--head-dims", type=ints, default=(64, 128), help="default 64,128")
    parser.add_argument(
        "--causal",
        type=lambda s: tuple(x == "yes" for x in s.split(",")),
        default=(False, True),
        help="no,yes (default both)",
    )
    parser.add_argument(
        "--dtypes", type=lambda s: tuple(s.split(",")), default=("bf16",), help="bf16,fp16 (default bf16)"
    )


def parse_with_run_arguments(
    parser: argparse.ArgumentParser, argv: list[str], budget_s: float, final_s: int, csv_suffix: str
) -> argparse.Namespace:
    """Adds the budget, workers, tokens, hidden, out and csv arguments, parses argv and checks --dtypes."""
    parser.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help=f"seconds for compiling and searching; the final table adds ~{final_s} s (default {budget_s:g})",
    )
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"B = tokens / N (default {TOKENS})")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"H = hidden / D (default {HIDDEN})")
    out = default_out()
    parser.add_argument(
        "--out",
        type=Path,
        default=out,
        help=f"folder of the CSV, <gpu>-{csv_suffix}.csv (default {out}, python -m fa2.bench's)",
    )
    parser.add_argument("--csv", type=Path, help=f"the CSV's path, instead of <out>/<gpu>-{csv_suffix}.csv")
    args = parser.parse_args(argv)
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {unknown}; choose from {list(DTYPES)}")
    return args


def tuning_device() -> torch.device | None:
    """The CPU under the interpreter, else the GPU; None (having said why) without either."""
    if INTERPRETED:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    print("no CUDA device: run on a GPU, or with TRITON_INTERPRET=1 on tiny shapes to check this tool")
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text):
        return tuple(int(x) for x in text.split(",") if x)

    parser = argparse.ArgumentParser(prog="python -m fa2_triton.tuning.forward", description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, ints)
    parser.add_argument("--block-m", type=ints, default=(128, 64))
    parser.add_argument("--block-n", type=ints, default=(64, 128, 32))
    parser.add_argument("--warps", type=ints, default=(8, 4))
    parser.add_argument("--stages", type=ints, default=(2, 3, 4))
    parser.add_argument(
        "--loads",
        type=lambda s: tuple(s.split(",")),
        default=("tma", "ptr"),
        help="tma,ptr (default both): tensor descriptors, pointer loads",
    )
    parser.add_argument("--no-maxnreg", action="store_true", help="skip the maxnreg (one more program per SM) variants")
    parser.add_argument("--top", type=int, default=2, help="how many of the fastest per shape get the lever variants")
    args = parse_with_run_arguments(parser, argv, budget_s=270.0, final_s=15, csv_suffix="tune")
    if not args.loads or set(args.loads) - {"tma", "ptr"}:
        parser.error(f"--loads: {','.join(args.loads)}; choose from tma, ptr")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = tuning_device()
    if device is None:
        return 2
    run = Run(args, device)
    pts = points(args)
    gpu = gpu_name(device)
    print(
        f"{gpu} | triton {triton.__version__} | torch {torch.__version__} | {len(pts)} shapes | "
        f"budget {args.budget_s:g} s",
        flush=True,
    )

    # Stage 1: the tiles, with and without maxnreg lowered to fit one more program.
    base = {p: base_candidates(args, p.causal) for p in pts}
    for p in pts:  # not worth compiling: more shared memory than an SM has
        for t in base[p]:
            if smem_estimate(t, p.head_dim) > SMEM_PER_SM - SMEM_RESERVED:
                run.compiled[p.dtype, p.head_dim, p.causal, t] = Result(
                    "failed",
                    f"needs ~{smem_estimate(t, p.head_dim) // 1024} KiB of shared memory, over "
                    f"{(SMEM_PER_SM - SMEM_RESERVED) // 1024} KiB",
                )
    precompile(run, _jobs(pts, base), COMPILE_SHARE * args.budget_s)
    per_point = {}
    for p in pts:
        cands = []
        for t in base[p]:
            cands.append(t)
            c = run.compiled.get((p.dtype, p.head_dim, p.causal, t))
            if not args.no_maxnreg and not t.warp_specialize and c is not None and c.status == "ok" and c.n_regs:
                maxnreg = one_more_program(t, c.n_regs, c.shared)
                if maxnreg is not None:
                    cands.append(t._replace(maxnreg=maxnreg))
        per_point[p] = cands
    precompile(
        run,
        _jobs(pts, {p: [t for t in per_point[p] if t.maxnreg is not None] for p in pts}),
        MAXNREG_SHARE * args.budget_s,
    )
    print(
        f"compiled {sum(r.status == 'ok' for r in run.compiled.values())}/{len(run.compiled)} in {run.elapsed():.0f} s",
        flush=True,
    )

    benches = {p: Bench(run, p) for p in pts}
    search(run, pts, benches, per_point, "tiles", SEARCH_SHARE)
    print(f"tiles searched: {run.elapsed():.0f} s", flush=True)

    # Stage 2: the levers on the fastest few.
    levers = {p: [v for t in best(benches[p].results, args.top) for v in lever_variants(t, p.causal)] for p in pts}
    precompile(run, _jobs(pts, levers), LEVER_COMPILE_SHARE * args.budget_s)
    if run.pool is not None:
        run.pool.shutdown()
    search(run, pts, benches, levers, "levers", LEVER_SHARE)

    # Stage 3: the final table at the benchmark's timing.
    table = []
    for p in pts:
        b = benches[p]
        winners = best(b.results, 1)
        current = tiles_for(max(16, triton.next_power_of_2(p.head_dim)), DTYPES[p.dtype], p.causal, p.seqlen)
        row = {"p": p, "tiles": winners[0] if winners else None, "ms": {}}
        for name, t in (("winner", row["tiles"]), ("current", current)):
            r = b.measure(t, search=False) if t is not None else Result("failed", "no configuration passed")
            record(run, p, f"final-{name}", describe(t) if t else "", r)
            row["ms"][name] = r.ms if r.status == "ok" else math.nan
        for provider in ("sdpa-flash", "sdpa-cudnn"):
            ms = math.nan
            if device.type == "cuda":
                shape = Shape(
                    dtype=p.dtype, head_dim=p.head_dim, causal=p.causal, seqlen=p.seqlen, batch=p.batch, heads=p.heads
                )
                fn = PROVIDERS[provider].build(shape, device)
                try:
                    ms = median_ms(run.device, functools.partial(fn, b.q, b.k, b.v), search=False)
                except Exception as e:
                    record(run, p, "final", provider, Result("failed", failure_reason(e)))
            if not math.isnan(ms):
                record(run, p, "final", provider, Result("ok", ms=ms))
            row["ms"][provider] = ms
        table.append(row)

    path = args.csv or args.out / f"{default_name(device)}-tune.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS)
        w.writeheader()
        w.writerows(run.rows)

    print_summary(run, pts, benches, table)
    print(f"{len(run.rows)} rows -> {path} | {run.compiled_here} compiled in this process | {run.elapsed():.0f} s")
    return 0


def _point_tag(p: Point) -> str:
    return f"{p.head_dim}{'c' if p.causal else 'f'}{seqlen_label(p.seqlen)}"


def print_summary(run: Run, pts: list[Point], benches: dict, table: list[dict]) -> None:
    statuses: dict = {}
    for row in run.rows:
        if row["status"] != "ok":
            key = (row["status"], re.sub(r"\d+", "#", row["reason"])[:90])
            statuses.setdefault(key, []).append(row["config"])
    ranked = sorted(statuses.items(), key=lambda item: -len(item[1]))
    for (status, reason), configs in ranked[:MAX_REASONS]:
        print(f"{status} x{len(configs)}: {reason} (e.g. {configs[0]})")
    if len(ranked) > MAX_REASONS:
        print(f"... {len(ranked) - MAX_REASONS} more reasons in the CSV")

    # Each lever: t(off) / t(on) for the fastest configuration measured with it on whose twin with it off
    # was measured too (> 1: the lever helps).
    levers = {
        "tma": (lambda t: t.tma, lambda t: t._replace(tma=False)),
        "fused_exp2": (lambda t: t.fused_exp2, lambda t: t._replace(fused_exp2=False)),
        "lazy_rescale": (lambda t: t.lazy_rescale, lambda t: t._replace(lazy_rescale=False)),
        "maxnreg": (lambda t: t.maxnreg is not None, lambda t: t._replace(maxnreg=None)),
        "warp_spec.": (lambda t: t.warp_specialize, lambda t: t._replace(warp_specialize=False)),
        "grid_order 1": (lambda t: t.grid_order == 1, lambda t: t._replace(grid_order=0)),
        "grid_order 2": (lambda t: t.grid_order == 2, lambda t: t._replace(grid_order=0)),
    }
    print("lever effect, t(off) / t(on), > 1 helps:")
    print(f"  {'':13} " + " ".join(f"{_point_tag(p):>7}" for p in pts))
    for name, (on, off) in levers.items():
        cells = []
        for p in pts:
            ok = {t: r.ms for t, r in benches[p].results.items() if r.status == "ok"}
            pairs = sorted((ms, ok[off(t)] / ms) for t, ms in ok.items() if on(t) and off(t) in ok)
            cells.append(f"{pairs[0][1]:.2f}" if pairs else "-")
        print(f"  {name:13} " + " ".join(f"{c:>7}" for c in cells))

    print(
        f"{'shape':18} {'dtype':5} {'winner':36} {'TF/s':>5} {'table':>5} {'flash':>5} {'cudnn':>5} "
        f"{'x tbl':>5} {'x fa2':>5} {'x cdn':>5}"
    )

    def tf(p, ms):
        return p.flops / (ms * 1e-3) / 1e12 if ms == ms else math.nan

    for row in table:
        p = row["p"]
        ms = row["ms"]
        cells = [tf(p, ms[x]) for x in ("winner", "current", "sdpa-flash", "sdpa-cudnn")]
        ratios = [ms[x] / ms["winner"] for x in ("current", "sdpa-flash", "sdpa-cudnn")]
        winner = _short(row["tiles"]) if row["tiles"] else "-"
        print(
            f"{p.label:18} {p.dtype:5} {winner:36} "
            + " ".join(f"{c:5.0f}" for c in cells)
            + " "
            + " ".join(f"{r:5.2f}" for r in ratios)
        )
    print("TILES entries for tiles.py (16-bit; replace the ones with the same keys):")
    for line in table_entries(proposal(pts, benches)):
        print(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
