"""``python -m fa2_numba_cuda.tuning.forward``: times configurations of the wgmma forward
(``forward_wgmma.WgmmaConfig``) on this GPU against its default (``forward_wgmma.wgmma_config``) and SDPA's
forward, and proposes ``wgmma_config``'s choice per head dim.

Shapes: the benchmark's (16k tokens, hidden 2048: B = tokens / N, H = hidden / D), contiguous (B, H, N, D), causal
and not, bf16 by default. Candidates: the default first, then every configuration of the grid --block-n x
--max-registers x --stages x --s-ahead x --overlap-pv that differs from it. Each candidate's O and L are checked on
the benchmark's sample of rows against the fp64 reference (``fa2.bench.check``'s rule) before it is timed; a
wrong one is recorded, not timed, and so is one that raises (with the reason).

The clock is the benchmark's (``fa2.bench.timing``: do_bench median, 25/100 ms), in ``ROUNDS`` rounds over a
shape's candidates and SDPA's providers, every other round in reverse order, each one's time the median of its
rounds: the candidates as calls of ``forward_wgmma.flash_attn_forward`` (prepared once per configuration), SDPA's
as the benchmark calls them. TFLOP/s count 4·B·H·N²·D, halved for causal, as the benchmark.

Writes every measurement, with the kernel's registers and local memory as numba reports them
(``forward_wgmma.kernel_resources``), to ``<gpu>-tune-numba-fwd.csv`` in ``--out`` (default: the checkout's
docs/benchmarks, as ``python -m fa2.bench``) or to ``--csv``; prints per shape each candidate's time and ratio to the
default, and per head dim the candidate with the best geometric mean of that ratio over its shapes (one that failed
or was wrong on a shape is not proposed), then, where both masks ran, per head dim and mask (the backward's default
differs between them). Without a GPU it runs on numba's simulator (NUMBA_ENABLE_CUDASIM=1) on
tiny shapes, fp16, timed with ``time.perf_counter``: a check of this tool, not a measurement.

What the two tuners share (shapes, rounds, records, the proposal, the command line) is here; ``tuning.backward``
adds the backward's candidates and checks.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fa2.bench import check, timing
from fa2.bench.output import default_name, default_out, exception_reason
from fa2.bench.providers import PROVIDERS, Shape
from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_numba_cuda import forward_wgmma
from fa2_numba_cuda.common import simulated
from fa2_numba_cuda.forward_wgmma import WgmmaConfig, wgmma_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS, HIDDEN = 16384, 2048
BASELINES = ("sdpa-flash", "sdpa-cudnn")
ROUNDS = 3
CSV_COLUMNS = (
    "dtype",
    "head_dim",
    "causal",
    "seqlen",
    "batch",
    "heads",
    "config",
    "status",
    "reason",
    "ms",
    "tflops",
    "vs_default",
)
CSV_TAIL = ("gpu", "torch")
# The kernel's registers and local memory: forward_wgmma.kernel_resources's for the candidate.
RESOURCE_COLUMNS = ("registers", "local_bytes")


@dataclass(frozen=True)
class Point:
    """One shape of the sweep, timed in ``mode`` "fwd" or "bwd"."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    mode: str = "fwd"

    @property
    def flops(self) -> float:
        """The forward's 4·B·H·N²·D, halved for causal; the backward's 2.5 times that (as fa2.bench)."""
        fwd = 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim / (2 if self.causal else 1)
        return fwd * (2.5 if self.mode == "bwd" else 1.0)

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} D{self.head_dim} {mask} N{self.seqlen} B{self.batch} H{self.heads}"

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.head_dim**-0.5, (UNBOUNDED, 0) if self.causal else (UNBOUNDED, UNBOUNDED))

    @property
    def shape(self) -> Shape:
        return Shape(self.dtype, self.head_dim, self.causal, self.seqlen, self.batch, self.heads, mode=self.mode)


@dataclass
class Result:
    status: str  # ok, wrong, failed, skipped
    reason: str = ""
    times: list[float] = field(default_factory=list)
    resources: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


class Measured:
    """A shape's results by name (the candidates' ``describe``, then the baselines'), the calls that passed their
    check, and how long each one's check call took (the CPU clock's warm-up)."""

    def __init__(self):
        self.results: dict[str, Result] = {}
        self.calls: dict[str, Callable] = {}
        self.first_s: dict[str, float] = {}

    def run(self, name: str, call: Callable, device: torch.device, problem: Callable) -> None:
        """Runs ``call`` once and records ``name`` as "ok" (to be timed), "wrong" (``problem`` of what it returned:
        None if right, else what is wrong) or "failed" (it raised)."""
        try:
            out, self.first_s[name] = timing.timed_once(call, device)
            wrong = problem(out)
        except Exception as e:  # a configuration the kernels refuse, or that fails to build or launch
            self.results[name] = Result("failed", exception_reason(e))
            return
        if wrong:
            self.results[name] = Result("wrong", wrong)
            return
        self.results[name] = Result("ok")
        self.calls[name] = call

    def baselines(self, p: Point, names: tuple[str, ...], device: torch.device, inputs, problem: Callable) -> None:
        """SDPA's providers (``fa2.bench.providers``) on the GPU: the forward as the benchmark calls it, the
        backward as ``torch.autograd.grad`` of its output; skipped on the CPU."""
        for name in names:
            if device.type != "cuda":
                self.results[name] = Result("skipped", "SDPA's flash and cuDNN kernels run on a GPU only")
                continue
            try:
                fn = PROVIDERS[name].build(p.shape, device)
                if p.mode == "fwd":
                    call = functools.partial(fn, *inputs)
                else:
                    q, k, v, dO = inputs
                    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
                    with torch.enable_grad():
                        out = fn(*leaves)[0]
                    call = functools.partial(torch.autograd.grad, out, leaves, dO, retain_graph=True)
            except Exception as e:
                self.results[name] = Result("failed", exception_reason(e))
                continue
            self.run(name, call, device, problem)

    def time(self, device: torch.device, rounds: int) -> None:
        """Every call that passed, in ``rounds`` rounds, every other one in reverse order."""
        order = list(self.calls)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                self.results[name].times.append(timing.median_ms(self.calls[name], device, self.first_s[name]))


def inputs(p: Point, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v and dO of the shape, contiguous (B, H, N, D), seeded by N."""
    g = torch.Generator(device="cpu").manual_seed(p.seqlen)
    return tuple(
        torch.randn(p.batch, p.heads, p.seqlen, p.head_dim, generator=g).to(device=device, dtype=DTYPES[p.dtype])
        for _ in range(4)
    )


def points(args: argparse.Namespace, mode: str) -> list[Point]:
    return [
        Point(dtype, d, causal, n, max(1, args.tokens // n), max(1, args.hidden // d), mode)
        for dtype in args.dtypes
        for d in args.head_dims
        for causal in args.causal
        for n in args.seqlens
    ]


def describe(config: tuple) -> str:
    """A candidate's name: its type's name, its first field, and the others that differ from their defaults."""
    defaults = type(config)(config[0])
    changed = [f"{name}={value}" for name, value in config._asdict().items() if getattr(defaults, name) != value]
    return f"{type(config).__name__}({', '.join([str(config[0]), *changed])})"


def candidates(args: argparse.Namespace, head_dim: int) -> list[WgmmaConfig]:
    """The default first, then the grid's other configurations (OVERLAP_PV only with 3 stages or more, without
    S_AHEAD: the kernel's bounds)."""
    out = [wgmma_config(head_dim)]
    for block_n, cap, stages, ahead, overlap in itertools.product(
        args.block_n, args.max_registers, args.stages, args.s_ahead, args.overlap_pv
    ):
        if overlap and (stages < 3 or ahead):
            continue
        config = WgmmaConfig(block_n, ahead, cap or None, stages, overlap)
        if config not in out:
            out.append(config)
    return out


def resources(rows: list[dict], config: tuple, p: Point) -> dict:
    """``kernel_resources`` rows of a candidate's kernels for this shape's flags (dense, no feature), as
    {column: value}: the kernel's name before each column (the forward: none). A backward kernel's row leaves the
    other kernel's fields None."""
    flags = {"HEAD_DIM": p.head_dim, "causal": p.causal, "bf16": p.dtype == "bf16"}
    out = {}
    for row in rows:
        if any(row[f] is not None and row[f] != v for f, v in config._asdict().items()):
            continue
        if any(row[f] != v for f, v in flags.items()):
            continue
        if any(row.get(f) for f in ("left", "right", "softcap", "alibi", "varlen", "sink")):
            continue
        prefix = "" if row["kernel"] == "wgmma" else row["kernel"].split()[-1] + "_"
        out[f"{prefix}registers"] = row["registers_per_thread"]
        out[f"{prefix}local_bytes"] = row["local_bytes_per_thread"]
    return out


def measure_point(p: Point, args: argparse.Namespace, device: torch.device) -> dict[str, Result]:
    q, k, v, _ = inputs(p, device)
    sample = check.reference_sample(q, k, v, p.causal)

    def problem(out):
        return check.problem(*out, q, sample)

    m = Measured()
    configs = candidates(args, p.head_dim)
    for config in configs:
        call = functools.partial(forward_wgmma.flash_attn_forward, q, k, v, p.spec, config)
        m.run(describe(config), call, device, problem)
    m.baselines(p, args.baselines, device, (q, k, v), problem)
    m.time(device, args.rounds)
    built = forward_wgmma.kernel_resources()
    for config in configs:
        m.results[describe(config)].resources = resources(built, config, p)
    return m.results


def record(rows: list[dict], p: Point, results: dict[str, Result], device: torch.device, columns) -> None:
    default_ms = next(iter(results.values())).ms
    for name, r in results.items():
        rows.append(
            {
                "dtype": p.dtype,
                "head_dim": p.head_dim,
                "causal": p.causal,
                "seqlen": p.seqlen,
                "batch": p.batch,
                "heads": p.heads,
                "config": name,
                "status": r.status,
                "reason": r.reason,
                "ms": f"{r.ms:.6g}",
                "tflops": f"{p.flops / (r.ms * 1e-3) / 1e12:.1f}",
                "vs_default": f"{default_ms / r.ms:.4f}",
                **{c: r.resources.get(c, "") for c in columns},
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (numba's simulator)",
                "torch": torch.__version__,
            }
        )


def proposal(rows: list[dict], prefix: str, by_mask: bool = False) -> dict[tuple, tuple[str, float, float, int]]:
    """(head_dim,) -> (candidate, geomean and min of default time / its time, shapes) for the candidate (a config
    named ``prefix``...) of best geomean among those that ran right on every shape of that head dim; with
    ``by_mask`` per (head_dim, causal) instead."""
    out = {}
    for key in sorted({(r["head_dim"], r["causal"]) if by_mask else (r["head_dim"],) for r in rows}):
        mine = [r for r in rows if (r["head_dim"], r["causal"])[: len(key)] == key and r["config"].startswith(prefix)]
        shapes = {(r["dtype"], r["causal"], r["seqlen"]) for r in mine}
        best = None
        for name in dict.fromkeys(r["config"] for r in mine):
            ratios = [float(r["vs_default"]) for r in mine if r["config"] == name and r["status"] == "ok"]
            if len(ratios) < len(shapes) or not all(math.isfinite(x) and x > 0 for x in ratios):
                continue
            geomean = math.exp(statistics.fmean(math.log(x) for x in ratios))
            if best is None or geomean > best[1]:
                best = (name, geomean, min(ratios), len(ratios))
        if best is not None:
            out[key] = best
    return out


def print_point(p: Point, results: dict[str, Result]) -> None:
    counted = "backward = 2.5 x forward" if p.mode == "bwd" else "forward"
    print(f"\n{p.label}  (TFLOP/s over visible pairs, {counted})")
    default_ms = next(iter(results.values())).ms
    for name, r in results.items():
        if r.status != "ok":
            print(f"  {name:<64} {r.status}: {r.reason}")
            continue
        regs = " ".join(f"{k[: -len('registers')]}{v} regs" for k, v in r.resources.items() if k.endswith("registers"))
        local = sum(v for k, v in r.resources.items() if k.endswith("local_bytes"))
        extra = f"  [{regs}{f', {local} B local' if local else ''}]" if regs else ""
        tflops = p.flops / (r.ms * 1e-3) / 1e12
        print(f"  {name:<64} {r.ms:9.3f} ms {tflops:7.1f} TF/s {default_ms / r.ms:6.3f}x{extra}")


def tuning_device() -> torch.device | None:
    """The CPU under numba's simulator, else the GPU; None (having said why) without either."""
    if simulated():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    print("no CUDA device: run on a Hopper GPU, or with NUMBA_ENABLE_CUDASIM=1 on tiny shapes to check this tool")
    return None


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def words(valid: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text):
        values = tuple(text.split(","))
        if not values or set(values) - set(valid):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(valid)}")
        return values

    return parse


def switches(text: str) -> tuple[bool, ...]:
    return tuple(x == "on" for x in words(("on", "off"))(text))


def parser_with_shapes(prog: str, doc: str) -> argparse.ArgumentParser:
    """The tuners' common arguments: shapes, baselines, rounds, where the CSV goes."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--seqlens", type=ints, default=(2048, 4096, 16384), help="default 2048,4096,16384")
    parser.add_argument("--head-dims", type=ints, default=(64, 128), help="default 64,128")
    parser.add_argument(
        "--causal", type=lambda s: tuple(x == "yes" for x in words(("yes", "no"))(s)), default=(False, True)
    )
    parser.add_argument("--dtypes", type=words(tuple(DTYPES)), default=("bf16",), help="bf16,fp16 (default bf16)")
    parser.add_argument("--baselines", type=words(BASELINES), default=BASELINES, help="SDPA providers timed beside")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timing rounds (default {ROUNDS})")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"B = tokens / N (default {TOKENS})")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"H = hidden / D (default {HIDDEN})")
    parser.add_argument("--out", type=Path, default=default_out(), help="folder of the CSV (default docs/benchmarks)")
    parser.add_argument("--csv", type=Path, help="the CSV's path, instead of <out>/<gpu>-<tuner>.csv")
    return parser


def tune(args: argparse.Namespace, mode: str, measure: Callable, columns: tuple[str, ...], prefix: str) -> int:
    """The tuners' main: every shape measured (``measure(point, args, device)``), printed and recorded; the CSV
    written; the proposal printed."""
    device = tuning_device()
    if device is None:
        return 2
    pts = points(args, mode)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "numba's simulator (not a measurement)"
    print(f"{where} | torch {torch.__version__} | {len(pts)} shapes | {timing.describe(device)}", flush=True)
    rows = []
    for p in pts:
        results = measure(p, args, device)
        print_point(p, results)
        record(rows, p, results, device, columns)
    path = args.csv or args.out / f"{default_name(device)}-tune-numba-{mode}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=(*CSV_COLUMNS, *columns, *CSV_TAIL))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path}")
    for (d,), (name, geomean, low, n) in proposal(rows, prefix).items():
        print(f"head_dim {d}: {name}, {geomean:.3f}x the default's speed (geomean over {n} shapes, min {low:.3f})")
    if len(args.causal) > 1:  # the defaults may differ by mask (the backward's do)
        for (d, causal), (name, geomean, low, n) in proposal(rows, prefix, by_mask=True).items():
            mask = "causal" if causal else "full"
            print(f"head_dim {d}, {mask}: {name}, {geomean:.3f}x the default's speed (geomean over {n}, min {low:.3f})")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_with_shapes("python -m fa2_numba_cuda.tuning.forward", __doc__)
    parser.add_argument("--block-n", type=ints, default=(64, 96, 128), help="key tiles (default 64,96,128)")
    parser.add_argument("--max-registers", type=ints, default=(0, 128), help="ptxas caps, 0 for none (default 0,128)")
    parser.add_argument("--stages", type=ints, default=(2,), help="K/V stages (default 2)")
    parser.add_argument("--s-ahead", type=switches, default=(False,), help="S_AHEAD on,off (default off)")
    parser.add_argument("--overlap-pv", type=switches, default=(False,), help="OVERLAP_PV on,off (default off)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return tune(parse_args(argv), "fwd", measure_point, RESOURCE_COLUMNS, "WgmmaConfig")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
