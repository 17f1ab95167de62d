"""``python -m fa2_triton.tuning.backward``: times launch configurations of the backward's two kernels on
this GPU and proposes the tile table (``tiles.BWD_TILES``) entries for the benchmark's shapes.

Shapes: the benchmark's (16k tokens, hidden 2048: B = 16384 / N, H = 2048 / D), contiguous (B, H, N, D).
The dK/dV kernel and the dQ kernel are tuned apart, each timed alone on the same inputs (O and L from
SDPA flash's forward, delta from the preprocess kernel, computed once per shape). Candidates, the current
table's choice first: dK/dV (block_m, block_n) ∈ {32x64, 32x128, 64x64, 64x128}, dQ (block_m, block_n) ∈
{64x32, 64x64, 128x32, 128x64}, each with num_warps ∈ {8, 4} and num_stages ∈ {3, 2, 4}. The winner of a
shape is the fastest dK/dV configuration with the fastest dQ one.

Every candidate is compiled first, in parallel worker processes (one CUDA context each) that also run it
once on a small input: one that fails to compile, runs out of shared memory or crashes there is recorded
with the reason and never run here; one whose shared memory estimate is over an SM's is not compiled.
Before it is timed, each candidate runs on the real shape into outputs poisoned with NaN and is checked:
dq on the benchmark's sample of rows against the fp64 reference (``fa2.bench.check``), dk and dv against
the current table's (every element within ``CROSS_ULPS`` units of the dtype's epsilon times the largest
magnitude: tiles change the order of the fp32 sums, not the result). A wrong one is recorded, not timed.
Search timing: ``triton.testing.do_bench`` median, warm-up/rep 10/40 ms.

The final table re-times per shape, with the benchmark's clock (``fa2.bench.timing``: do_bench median,
25/100 ms) and each through ``torch.autograd.grad`` as the benchmark's backward mode does: the assembled
winner (its dq, dk, dv checked first as above), the current table's choice, the winner's dK/dV tiles with
``deterministic=False`` (atomic dQ: reported, never proposed), and sdpa-flash's and sdpa-cudnn's backward
(fa2.bench.providers). TFLOP/s count the backward as 2.5 times the forward's FLOPs, as the benchmark.

``--budget-s`` bounds compiling and searching (the final table adds ~20 s on the benchmark's 12 shapes):
once a stage's share is spent, its remaining compiles are left to this process and its remaining timings
are skipped (and recorded as such); candidates go in list order, each on every shape before the next.
Writes every measurement to ``<gpu>-tune-bwd.csv`` in ``--out`` (default: the checkout's docs/benchmarks, as
``python -m fa2.bench``), or to ``--csv``, and prints, compactly,
the failures by reason, the per-shape table and the ``BWD_TILES`` entries to paste into tiles.py.
Without a GPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``) on tiny shapes, fp16, timed with
``time.perf_counter``: a check of this tool, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
from typing import NamedTuple

import torch
import triton

from fa2.bench import check, timing
from fa2.bench.output import default_name
from fa2.bench.providers import PROVIDERS, Shape
from fa2.spec import AttentionSpec
from fa2_triton import backward, forward
from fa2_triton.tiles import BwdTiles, KernelTiles, bwd_tiles_for
from fa2_triton.tuning import forward as tune_forward
from fa2_triton.tuning.forward import (
    CSV_COLUMNS,
    DTYPES,
    MAX_REASONS,
    SMEM_PER_SM,
    SMEM_RESERVED,
    WARM_SEQLEN,
    Result,
    Run,
    add_shape_arguments,
    context_lost,
    failure_reason,
    gpu_name,
    median_ms,
    parse_with_run_arguments,
    precompile,
    shape_spec,
    table_entries,
    tuning_device,
)

KINDS = ("dkdv", "dq")
# Where in --budget-s each stage must end: compiling the candidates, timing them, compiling the atomic-dQ
# variants of the winners; the final table comes after.
COMPILE_SHARE, SEARCH_SHARE, ATOMIC_COMPILE_SHARE = 0.4, 0.9, 1.0
# dk, dv against the current table's: max |x - x_cur| <= CROSS_ULPS · eps(dtype) · max |x_cur|. The same
# sums in another order round to the same value or a neighbour; a missed or doubled tile is far off.
CROSS_ULPS = 4


class Point(tune_forward.Point):
    """One shape of the sweep; ``flops``: the backward's, 2.5 times the forward's (as fa2.bench)."""

    @property
    def fwd_flops(self) -> float:
        return super().flops

    @property
    def flops(self) -> float:
        return 2.5 * self.fwd_flops


# The matmuls each kernel does per (query, key) tile, in forward FLOPs (two matmuls): dK/dV four (S, dP,
# dV, dK), dQ three (S, dP, dQ). A kernel's TFLOP/s in the CSV counts these.
KERNEL_FLOPS = {"dkdv": 2.0, "dq": 1.5}


def describe(t: BwdTiles | KernelTiles) -> str:
    if isinstance(t, BwdTiles):
        return f"BwdTiles({describe(t.dkdv)}, {describe(t.dq)})"
    return f"KernelTiles({', '.join(str(x) for x in t if x is not None)})"


def _short(t: KernelTiles) -> str:
    return f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"


def points(args: argparse.Namespace) -> list[Point]:
    return tune_forward.points(args, Point)


def current_tiles(p: Point) -> BwdTiles:
    return bwd_tiles_for(p.head_dim, DTYPES[p.dtype], p.causal, p.seqlen)


def candidates(args: argparse.Namespace, p: Point, kind: str) -> list[KernelTiles]:
    """The current table's choice first, then the grid."""
    grid = [
        KernelTiles(bm, bn, w, s) for bm, bn in getattr(args, f"{kind}_tiles") for w in args.warps for s in args.stages
    ]
    current = getattr(current_tiles(p), kind)
    return [current] + [t for t in grid if t != current]


def smem_estimate(kind: str, t: KernelTiles, head_dim: int, elem_bytes: int = 2) -> int:
    """Shared memory: the two tiles a program keeps (dK/dV: k, v; dQ: q, dO) and num_stages buffers of
    the two it streams (dK/dV: q, dO; dQ: k, v)."""
    kept, streamed = (t.block_n, t.block_m) if kind == "dkdv" else (t.block_m, t.block_n)
    return (2 * kept + 2 * t.num_stages * streamed) * head_dim * elem_bytes


# ---------------------------------------------------------------------------------------------------------
# One problem and its kernels


class Problem(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dO: torch.Tensor
    O: torch.Tensor
    L: torch.Tensor
    delta: torch.Tensor
    spec: AttentionSpec


def _outputs(prob: Problem, kind: str, t: KernelTiles) -> tuple[torch.Tensor, ...]:
    """Output buffers: dq; dk, dv; dk, dv and the fp32 dQ accumulator (dkdv-atomic)."""
    if kind == "dq":
        return (torch.empty_like(prob.q),)
    out = (torch.empty_like(prob.k), torch.empty_like(prob.v))
    if kind == "dkdv-atomic":
        b, h, n, d = prob.q.shape
        padded = (b, h, triton.cdiv(n, t.block_m) * t.block_m, max(16, triton.next_power_of_2(d)))
        out += (torch.empty(padded, device=prob.q.device, dtype=torch.float32),)
    return out


def _launch(prob: Problem, kind: str, t: KernelTiles, out: tuple[torch.Tensor, ...]):
    """One kernel into ``out`` (from ``_outputs``); what the launch returns."""
    args = (prob.q, prob.k, prob.v, prob.dO, prob.L, prob.delta)
    if kind == "dq":
        return backward.launch_dq(*args, out[0], prob.spec, t)
    dq_acc = None
    if kind == "dkdv-atomic":
        dq_acc = out[2].zero_()
    return backward.launch_dkdv(*args, out[0], out[1], dq_acc, prob.spec, t)


# ---------------------------------------------------------------------------------------------------------
# Compiling in worker processes (as fa2_triton.tuning.forward)


def _warm_problem(dtype: torch.dtype, head_dim: int, heads: int, causal: bool, device: torch.device) -> Problem:
    """A small problem of the benchmark's H and head_dim (N a multiple of 16, as the real ones, so that
    Triton specialises the same way). O and L need only be finite: L is the unmasked logsumexp."""
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, heads, WARM_SEQLEN, head_dim)
    q, k, v, dO, O = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(5))
    scale = head_dim**-0.5
    L = (q.float() @ k.float().transpose(-1, -2) * scale).logsumexp(-1)
    return Problem(q, k, v, dO, O, L, backward.launch_preprocess(O, dO)[0], shape_spec(causal, scale))


# Set in a worker once a kernel has broken its CUDA context: its later jobs are left to the main process.
_BROKEN_CONTEXT = []


def _compile_job(job):
    """In a worker: compile one kernel configuration and run it on the small input. A Result, or None if
    this worker's CUDA context is no longer usable."""
    if _BROKEN_CONTEXT:
        return None
    dtype, head_dim, heads, causal, kind, tiles = job
    try:
        prob = _warm_problem(DTYPES[dtype], head_dim, heads, causal, torch.device("cuda"))
        out = _outputs(prob, kind, tiles)
        for x in out:
            x.fill_(math.nan)
        kernel = _launch(prob, kind, tiles, out)
        torch.cuda.synchronize()
    except Exception as e:
        if context_lost(e):
            _BROKEN_CONTEXT.append(job)
        return Result("failed", failure_reason(e))
    if any(torch.isnan(x).any() for x in out):
        return Result("wrong", "NaN left in the outputs on the small input")
    return Result("ok", n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared)


def _ckey(job) -> tuple:
    dtype, head_dim, _heads, causal, kind, tiles = job
    return dtype, head_dim, causal, kind, tiles


def _jobs(pts: list[Point], per_point: dict) -> list[tuple]:
    """Compile jobs for per_point[p][kind] (lists of KernelTiles), candidate-major, each once."""
    jobs = {}
    longest = max((len(c) for per_kind in per_point.values() for c in per_kind.values()), default=0)
    for i in range(longest):
        for p in pts:
            for kind, cands in per_point[p].items():
                if i < len(cands):
                    jobs.setdefault(
                        (p.dtype, p.head_dim, p.causal, kind, cands[i]),
                        (p.dtype, p.head_dim, p.heads, p.causal, kind, cands[i]),
                    )
    return list(jobs.values())


# ---------------------------------------------------------------------------------------------------------
# Checking and timing in this process


class Bench:
    """One point's inputs, its reference sample, the current table's gradients and the results."""

    def __init__(self, run: Run, p: Point):
        self.run, self.p = run, p
        g = torch.Generator(device=run.device).manual_seed(p.seqlen * 7 + p.head_dim)
        shape = (p.batch, p.heads, p.seqlen, p.head_dim)
        q, k, v, dO = (torch.randn(shape, generator=g, device=run.device).to(DTYPES[p.dtype]) for _ in range(4))
        scale = p.head_dim**-0.5
        if run.device.type == "cuda":  # SDPA flash's O and L (natural log): nothing to compile
            O, L = PROVIDERS["sdpa-flash"].build(self.shape(), run.device)(q, k, v)
        else:
            O, L = forward.flash_attn_forward(q, k, v, shape_spec(p.causal, scale))
        self.prob = Problem(q, k, v, dO, O, L, backward.launch_preprocess(O, dO)[0], shape_spec(p.causal, scale))
        self.sample = check.reference_sample(q, k, v, p.causal, p.seqlen * 7 + p.head_dim, dO)
        self.current = current_tiles(p)
        self.current_grads = backward.flash_attn_backward(q, k, v, O, L, dO, self.prob.spec, self.current)
        self.current_problem = check.grad_problem(self.current_grads, q, k, v, self.sample)
        self.results: dict[str, dict[KernelTiles, Result]] = {kind: {} for kind in KINDS}
        self.buffers: dict = {}

    def shape(self) -> Shape:
        p = self.p
        return Shape(p.dtype, p.head_dim, p.causal, p.seqlen, p.batch, p.heads, mode="bwd")

    def grad_problem(self, grads) -> str | None:
        """dq on the sample against the reference; dk, dv against the current table's (the module docstring)."""
        q, k, v = self.prob.q, self.prob.k, self.prob.v
        problem = check.grad_problem(grads, q, k, v, self.sample)
        if problem is not None:
            return problem
        eps = torch.finfo(q.dtype).eps
        for name, x, ref in zip(("dk", "dv"), grads[1:], self.current_grads[1:]):
            err = (x.float() - ref.float()).abs().max().item()
            tol = CROSS_ULPS * eps * ref.float().abs().max().item()
            if err > tol:
                return f"max |{name} - {name}_current| = {err:.3g} > {tol:.3g}"
        return None

    def measure(self, kind: str, t: KernelTiles) -> Result:
        """One kernel alone: checked on the real shape, then timed with the search's clock."""
        compiled = self.run.compiled.get((self.p.dtype, self.p.head_dim, self.p.causal, kind, t))
        if compiled is not None and compiled.status != "ok":
            return compiled
        try:
            if kind not in self.buffers:
                self.buffers[kind] = _outputs(self.prob, kind, t)
            out = self.buffers[kind]
            for x in out:
                x.fill_(math.nan)
            t0 = time.monotonic()
            _launch(self.prob, kind, t, out)
            timing.sync(self.run.device)
            if self.run.device.type == "cuda" and time.monotonic() - t0 > 1.0:
                self.run.compiled_here += 1  # not precompiled, or the workers' kernel was not this one
            grads = (out[0], *self.current_grads[1:]) if kind == "dq" else (self.current_grads[0], *out)
            problem = self.grad_problem(grads)
            if problem is not None:
                return Result("wrong", problem)
            ms = median_ms(self.run.device, lambda: _launch(self.prob, kind, t, out), search=True)
        except Exception as e:
            if context_lost(e):
                raise  # the CUDA context is gone: nothing after this can be trusted
            return Result("failed", failure_reason(e))
        result = Result("ok", ms=ms)
        if compiled is not None:
            result.n_regs, result.n_spills, result.shared = compiled.n_regs, compiled.n_spills, compiled.shared
        return result

    def fa2_grad(self, tiles: BwdTiles, deterministic: bool = True) -> tuple[str | None, object]:
        """(problem, the timed call): torch.autograd.grad through a Function whose backward is fa2-triton's
        with these tiles (its forward returns SDPA's O, untimed), as the benchmark times a backward."""
        prob = self.prob

        def bwd(dO):
            return backward.flash_attn_backward(
                prob.q, prob.k, prob.v, prob.O, prob.L, dO, prob.spec, tiles, deterministic
            )

        class Attention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                return prob.O.clone()

            @staticmethod
            def backward(ctx, dO):
                return bwd(dO)

        inputs = tuple(x.detach().requires_grad_() for x in (prob.q, prob.k, prob.v))
        with torch.enable_grad():
            O = Attention.apply(*inputs)

        def call():
            return torch.autograd.grad(O, inputs, prob.dO, retain_graph=True)

        return self.grad_problem(call()), call

    def sdpa_grad(self, provider: str):
        """The timed call of an SDPA provider's backward, as fa2.bench.sweep.measure."""
        fn = PROVIDERS[provider].build(self.shape(), self.run.device)
        inputs = tuple(x.detach().requires_grad_() for x in (self.prob.q, self.prob.k, self.prob.v))
        with torch.enable_grad():
            O, _ = fn(*inputs)
        return lambda: torch.autograd.grad(O, inputs, self.prob.dO, retain_graph=True)


def record(run: Run, p: Point, stage: str, config: str, r: Result, flops: float) -> None:
    tflops = flops / (r.ms * 1e-3) / 1e12 if r.status == "ok" else math.nan
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


def search(run: Run, pts: list[Point], benches: dict, per_point: dict) -> None:
    """Times per_point[p][kind] for every point, candidate-major, within the search's share of the budget."""
    longest = max(len(c) for per_kind in per_point.values() for c in per_kind.values())
    for i in range(longest):
        for p in pts:
            for kind, cands in per_point[p].items():
                if i >= len(cands) or cands[i] in benches[p].results[kind]:
                    continue
                t = cands[i]
                if not run.left(SEARCH_SHARE):
                    r = Result("skipped", f"budget: search share of --budget-s {run.args.budget_s:g} s spent")
                else:
                    r = benches[p].measure(kind, t)
                benches[p].results[kind][t] = r
                record(run, p, f"search-{kind}", describe(t), r, KERNEL_FLOPS[kind] * p.fwd_flops)


def fastest(results: dict) -> KernelTiles | None:
    ok = sorted((r.ms, i, t) for i, (t, r) in enumerate(results.items()) if r.status == "ok")
    return ok[0][2] if ok else None


# ---------------------------------------------------------------------------------------------------------
# The final table and the proposal


def final(run: Run, b: Bench) -> dict:
    """The winner, the current table's choice, the atomic-dQ path and SDPA's backwards, re-timed."""
    p = b.p
    row = {"p": b.p, "ms": {}, "ok": False}
    dkdv, dq = fastest(b.results["dkdv"]), fastest(b.results["dq"])
    winner = BwdTiles(dkdv, dq) if dkdv and dq else None
    row["tiles"] = winner
    entries = [("winner", winner, True), ("current", b.current, True)]
    entries.append(("atomic-dq", winner, False))
    for name, tiles, deterministic in entries:
        if tiles is None:
            r = Result("failed", "no configuration of a kernel passed")
        elif name == "current" and b.current_problem is not None:
            r = Result("wrong", b.current_problem)
        else:
            try:
                problem, call = b.fa2_grad(tiles, deterministic)
                r = Result("wrong", problem) if problem else Result("ok", ms=median_ms(run.device, call, search=False))
            except Exception as e:
                if context_lost(e):
                    raise
                r = Result("failed", failure_reason(e))
        record(run, p, f"final-{name}", describe(tiles) if tiles else "", r, p.flops)
        row["ms"][name] = r.ms if r.status == "ok" else math.nan
        if name == "winner":
            row["ok"] = r.status == "ok"
    for provider in ("sdpa-flash", "sdpa-cudnn"):
        ms = math.nan
        if run.device.type == "cuda":
            try:
                ms = median_ms(run.device, b.sdpa_grad(provider), search=False)
                record(run, p, "final", provider, Result("ok", ms=ms), p.flops)
            except Exception as e:
                record(run, p, "final", provider, Result("failed", failure_reason(e)), p.flops)
        row["ms"][provider] = ms
    return row


def proposal(pts: list[Point], benches: dict, table: list[dict]) -> dict:
    """(head_dim, causal) -> [(seqlen, BwdTiles)]: per seqlen and kernel the configuration with the
    smallest geometric mean of time / best time over the dtypes measured there (all 16-bit); a seqlen
    whose assembled winner failed its final check in some dtype is left out."""
    passed = {row["p"]: row["ok"] for row in table}
    groups: dict = {}
    for p in pts:
        groups.setdefault((p.head_dim, p.causal, p.seqlen), []).append(p)
    out: dict = {}
    for (d, causal, n), ps in sorted(groups.items()):
        if not all(passed.get(p) for p in ps):
            continue
        chosen = []
        for kind in KINDS:
            scores: dict = {}
            for p in ps:
                ok = {t: r.ms for t, r in benches[p].results[kind].items() if r.status == "ok"}
                for t, ms in ok.items():
                    scores.setdefault(t, []).append(ms / min(ok.values()))
            full = {t: s for t, s in scores.items() if len(s) == len(ps)}
            chosen.append(min(full, key=lambda t: math.prod(full[t])) if full else None)
        if all(chosen):
            out.setdefault((d, causal), []).append((n, BwdTiles(*chosen)))
    return out


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text):
        return tuple(int(x) for x in text.split(",") if x)

    def pairs(text):
        return tuple(tuple(int(y) for y in x.split("x")) for x in text.split(",") if x)

    parser = argparse.ArgumentParser(prog="python -m fa2_triton.tuning.backward", description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, ints)
    parser.add_argument(
        "--dkdv-tiles",
        type=pairs,
        default=((32, 64), (32, 128), (64, 64), (64, 128)),
        help="dK/dV kernel's block_m x block_n (default 32x64,32x128,64x64,64x128)",
    )
    parser.add_argument(
        "--dq-tiles",
        type=pairs,
        default=((64, 32), (64, 64), (128, 32), (128, 64)),
        help="dQ kernel's block_m x block_n (default 64x32,64x64,128x32,128x64)",
    )
    parser.add_argument("--warps", type=ints, default=(8, 4))
    parser.add_argument("--stages", type=ints, default=(3, 2, 4))
    return parse_with_run_arguments(parser, argv, budget_s=100.0, final_s=20, csv_suffix="tune-bwd")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = tuning_device()
    if device is None:
        return 2
    run = Run(args, device)
    pts = points(args)
    print(
        f"{gpu_name(device)} | triton {triton.__version__} | torch {torch.__version__} | {len(pts)} shapes | "
        f"budget {args.budget_s:g} s",
        flush=True,
    )

    per_point = {p: {kind: candidates(args, p, kind) for kind in KINDS} for p in pts}
    limit = SMEM_PER_SM - SMEM_RESERVED
    for p in pts:  # not worth compiling: more shared memory than an SM has
        for kind, cands in per_point[p].items():
            for t in cands:
                need = smem_estimate(kind, t, p.head_dim)
                if need > limit:
                    run.compiled[p.dtype, p.head_dim, p.causal, kind, t] = Result(
                        "failed", f"needs ~{need // 1024} KiB of shared memory, over {limit // 1024} KiB"
                    )
    precompile(run, _jobs(pts, per_point), COMPILE_SHARE * args.budget_s, _compile_job, _ckey)
    print(
        f"compiled {sum(r.status == 'ok' for r in run.compiled.values())}/{len(run.compiled)} in {run.elapsed():.0f} s",
        flush=True,
    )

    benches = {p: Bench(run, p) for p in pts}
    for b in benches.values():
        if b.current_problem is not None:
            print(f"{b.p.label} {b.p.dtype}: the current table's gradients fail: {b.current_problem}")
    search(run, pts, benches, per_point)
    print(f"searched: {run.elapsed():.0f} s", flush=True)

    atomic = {}
    for p in pts:
        winner = fastest(benches[p].results["dkdv"])
        atomic[p] = {"dkdv-atomic": [winner] if winner else []}
    precompile(run, _jobs(pts, atomic), ATOMIC_COMPILE_SHARE * args.budget_s, _compile_job, _ckey)
    if run.pool is not None:
        run.pool.shutdown()

    table = [final(run, benches[p]) for p in pts]

    path = args.csv or args.out / f"{default_name(device)}-tune-bwd.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS)
        w.writeheader()
        w.writerows(run.rows)

    print_summary(run, table, proposal(pts, benches, table))
    print(f"{len(run.rows)} rows -> {path} | {run.compiled_here} compiled in this process | {run.elapsed():.0f} s")
    return 0


def print_summary(run: Run, table: list[dict], prop: dict) -> None:
    statuses: dict = {}
    for row in run.rows:
        if row["status"] != "ok":
            key = (row["status"], re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", row["reason"])[:90])
            statuses.setdefault(key, []).append(f"{row['stage']} {row['config']}")
    ranked = sorted(statuses.items(), key=lambda item: -len(item[1]))
    for (status, reason), configs in ranked[:MAX_REASONS]:
        print(f"{status} x{len(configs)}: {reason} (e.g. {configs[0]})")
    if len(ranked) > MAX_REASONS:
        print(f"... {len(ranked) - MAX_REASONS} more reasons in the CSV")

    # TFLOP/s of each; x columns: the other's time over the winner's (> 1: the winner is faster), except
    # "x atom": the winner's time over the atomic-dQ path's (> 1: atomics would be faster).
    print(
        f"{'shape':15} {'dtype':5} {'dK/dV':12} {'dQ':12} {'TF/s':>5} {'table':>5} {'atom':>5} {'flash':>5} "
        f"{'cudnn':>5} {'x tbl':>5} {'x fa2':>5} {'x cdn':>5} {'x atom':>6}"
    )

    def tf(p, ms):
        return p.flops / (ms * 1e-3) / 1e12

    for row in table:
        p, ms = row["p"], row["ms"]
        cells = [tf(p, ms[x]) for x in ("winner", "current", "atomic-dq", "sdpa-flash", "sdpa-cudnn")]
        ratios = [ms[x] / ms["winner"] for x in ("current", "sdpa-flash", "sdpa-cudnn")]
        t = row["tiles"]
        kernels = [_short(t.dkdv), _short(t.dq)] if t else ["-", "-"]
        print(
            f"{p.label:15} {p.dtype:5} {kernels[0]:12} {kernels[1]:12} "
            + " ".join(f"{c:5.0f}" for c in cells)
            + " "
            + " ".join(f"{r:5.2f}" for r in ratios)
            + f" {ms['winner'] / ms['atomic-dq']:6.2f}"
        )
    print("BWD_TILES entries for tiles.py (16-bit; replace the ones with the same keys):")
    for line in table_entries(prop, describe):
        print(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
