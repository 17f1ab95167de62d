"""``python -m fa2_numba_cuda.tuning.backward``: times configurations of the wgmma backward
(``backward_wgmma.WgmmaBwdConfig``) on this GPU against its default (``backward_wgmma.bwd_config``) and SDPA's
backward, and proposes ``bwd_config``'s choice per head dim.

Shapes: the benchmark's (16k tokens, hidden 2048: B = tokens / N, H = hidden / D), contiguous (B, H, N, D), causal
and not, bf16 by default; O and L from fa2-numba-cuda's forward, computed once per shape. Candidates: the default
first, then every configuration of the grid --block-m x --dq-block-n x --dq (wgmma: the dQ kernel of
backward_wgmma; tc: backward_tc's, whose own tiles ignore --dq-block-n) x --split x --dv-early that differs from it.

Before it is timed, each candidate's dq is checked on the benchmark's sample of rows against the fp64 reference
(``fa2.bench.check``'s rule) and its dk and dv against the default's (every element within ``CROSS_ULPS`` units of
the dtype's epsilon times the largest magnitude: other tiles add the same products in another order); a wrong one
is recorded, not timed, and so is one that raises (with the reason). The clock is the benchmark's
(``fa2.bench.timing``: do_bench median, 25/100 ms), in ``ROUNDS`` rounds over a shape's candidates and SDPA's
providers, every other round in reverse order, each one's time the median of its rounds. The candidates are timed
as calls of ``backward_wgmma.flash_attn_backward`` (preprocess, dK/dV and dQ launches, prepared once per
configuration); SDPA's as ``torch.autograd.grad`` of their forward's output, as the benchmark's bwd mode times
every provider, which adds the autograd engine's host time (tens of microseconds, behind the GPU's queue at these
shapes). TFLOP/s count the backward as 2.5 times the forward's FLOPs, halved for causal, as the benchmark.

Writes every measurement, with the kernels' registers and local memory as numba reports them
(``backward_wgmma.kernel_resources``), to ``<gpu>-tune-numba-bwd.csv`` in ``--out`` (default: the checkout's
docs/benchmarks, as ``python -m fa2.bench``) or to ``--csv``; prints per shape each candidate's time and ratio to the
default, and per head dim the candidate with the best geometric mean of that ratio over its shapes (one that failed
or was wrong on a shape is not proposed). Without a GPU it runs on numba's simulator (NUMBA_ENABLE_CUDASIM=1) on
tiny shapes, fp16, timed with ``time.perf_counter``: a check of this tool, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fa2.bench import check, timing
from fa2.bench.output import default_name, default_out, exception_reason
from fa2.bench.providers import PROVIDERS, Shape
from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_numba_cuda import backward_wgmma, forward
from fa2_numba_cuda.backward_wgmma import WgmmaBwdConfig, bwd_config
from fa2_numba_cuda.common import simulated

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS, HIDDEN = 16384, 2048
BASELINES = ("sdpa-flash", "sdpa-cudnn")
ROUNDS = 3
# dk, dv against the default's: max |x - x_default| <= CROSS_ULPS · eps(dtype) · max |x_default|.
CROSS_ULPS = 4
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
    "dkdv_registers",
    "dkdv_local_bytes",
    "dq_registers",
    "dq_local_bytes",
    "gpu",
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
        """The backward's: 2.5 times the forward's 4·B·H·N²·D, halved for causal."""
        return 2.5 * 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim / (2 if self.causal else 1)

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} D{self.head_dim} {mask} N{self.seqlen} B{self.batch} H{self.heads}"


@dataclass
class Result:
    status: str  # ok, wrong, failed, skipped
    reason: str = ""
    times: list[float] = field(default_factory=list)
    resources: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


def describe(config: WgmmaBwdConfig) -> str:
    """A candidate's name: the fields that differ from WgmmaBwdConfig's defaults (the tile always)."""
    defaults = WgmmaBwdConfig(config.BLOCK_M)
    changed = [f"{name}={value}" for name, value in config._asdict().items() if getattr(defaults, name) != value]
    return f"WgmmaBwdConfig({', '.join([str(config.BLOCK_M), *changed])})"


def points(args: argparse.Namespace) -> list[Point]:
    return [
        Point(dtype, d, causal, n, max(1, args.tokens // n), max(1, args.hidden // d))
        for dtype in args.dtypes
        for d in args.head_dims
        for causal in args.causal
        for n in args.seqlens
    ]


def candidates(args: argparse.Namespace, head_dim: int) -> list[WgmmaBwdConfig]:
    """The default first, then the grid's other configurations (with backward_tc's dQ kernel, one per DQ_BLOCK_N:
    it has its own tiles)."""
    default = bwd_config(head_dim)
    out = [default]
    for block_m, dq_n, dq, split, early in itertools.product(
        args.block_m, args.dq_block_n, args.dq, args.split, args.dv_early
    ):
        wgmma_dq = dq == "wgmma"
        config = WgmmaBwdConfig(block_m, early, dq_n if wgmma_dq else default.DQ_BLOCK_N, wgmma_dq, split)
        if config not in out:
            out.append(config)
    return out


def spec(p: Point) -> AttentionSpec:
    return AttentionSpec(p.head_dim**-0.5, (UNBOUNDED, 0) if p.causal else (UNBOUNDED, UNBOUNDED))


def resources(config: WgmmaBwdConfig, p: Point) -> dict:
    """Registers and local memory of the candidate's wgmma kernels for this shape's flags, as numba reports them
    (none under the simulator, and no dQ row where backward_tc's kernel runs)."""
    out = {}
    flags = {"HEAD_DIM": p.head_dim, "causal": p.causal, "bf16": p.dtype == "bf16"}
    flags.update(dict.fromkeys(("left", "right", "softcap", "alibi", "varlen"), False))
    for row in backward_wgmma.kernel_resources():
        if WgmmaBwdConfig(*(row[f] for f in WgmmaBwdConfig._fields)) != config:
            continue
        if any(row[f] != value for f, value in flags.items()):
            continue
        name = row["kernel"].split()[-1]
        out[f"{name}_registers"] = row["registers_per_thread"]
        out[f"{name}_local_bytes"] = row["local_bytes_per_thread"]
    return out


def cross_problem(grads, default_grads, dtype: torch.dtype) -> str | None:
    """Whether dk and dv are the default's up to the order of their sums (``CROSS_ULPS``)."""
    for name, x, ref in zip(("dk", "dv"), grads[1:], default_grads[1:]):
        scale = ref.float().abs().max().item()
        err = (x.float() - ref.float()).abs().max().item()
        if not err <= CROSS_ULPS * torch.finfo(dtype).eps * scale:
            return f"max |{name} - the default's| = {err:.3g} > {CROSS_ULPS} eps x max |{name}| = {scale:.3g}"
    return None


def measure_point(p: Point, args: argparse.Namespace, device: torch.device) -> dict:
    """name -> Result for the candidates (by ``describe``) and the baselines."""
    dtype = DTYPES[p.dtype]
    g = torch.Generator(device="cpu").manual_seed(p.seqlen)
    q, k, v, dO = (
        torch.randn(p.batch, p.heads, p.seqlen, p.head_dim, generator=g).to(device=device, dtype=dtype)
        for _ in range(4)
    )
    s = spec(p)
    O, L = forward.flash_attn_forward(q, k, v, s)
    sample = check.reference_sample(q, k, v, p.causal, dO=dO)
    results, calls, first_s, default_grads = {}, {}, {}, None
    for config in candidates(args, p.head_dim):
        name = describe(config)
        call = functools.partial(backward_wgmma.flash_attn_backward, q, k, v, O, L, dO, s, config)
        try:
            grads, first_s[name] = timing.timed_once(call, device)
            problem = check.grad_problem(grads, q, k, v, sample)
            if problem is None and default_grads is not None:
                problem = cross_problem(grads, default_grads, dtype)
            elif problem is None:
                default_grads = grads
        except Exception as e:  # a configuration the kernels refuse, or that fails to build or launch
            results[name] = Result("failed", exception_reason(e))
            continue
        results[name] = Result("wrong", problem) if problem else Result("ok", resources=resources(config, p))
        if not problem:
            calls[name] = call
    for name in args.baselines if device.type != "cuda" else ():
        results[name] = Result("skipped", "SDPA's flash and cuDNN kernels run on a GPU only")
    if device.type == "cuda":
        shape = Shape(p.dtype, p.head_dim, p.causal, p.seqlen, p.batch, p.heads, mode="bwd")
        for name in args.baselines:
            try:
                inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
                with torch.enable_grad():
                    out = PROVIDERS[name].build(shape, device)(*inputs)[0]
                call = functools.partial(torch.autograd.grad, out, inputs, dO, retain_graph=True)
                grads, first_s[name] = timing.timed_once(call, device)
                problem = check.grad_problem(grads, q, k, v, sample)
            except Exception as e:
                results[name] = Result("failed", exception_reason(e))
                continue
            results[name] = Result("wrong", problem) if problem else Result("ok")
            if not problem:
                calls[name] = call
    order = list(calls)  # each has run once: its check (on the CPU, the clock's warm-up call)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            results[name].times.append(timing.median_ms(calls[name], device, first_s[name]))
    return results


def record(rows: list[dict], p: Point, results: dict, device: torch.device) -> None:
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
                **{c: r.resources.get(c, "") for c in CSV_COLUMNS if c.startswith(("dkdv_", "dq_"))},
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (numba's simulator)",
                "torch": torch.__version__,
            }
        )


def proposal(rows: list[dict]) -> dict[int, tuple[str, float, float, int]]:
    """head_dim -> (candidate, geomean and min of default time / its time, shapes) for the candidate of best
    geomean among those that ran right on every shape of that head dim (baselines excluded)."""
    out = {}
    for d in sorted({r["head_dim"] for r in rows}):
        mine = [r for r in rows if r["head_dim"] == d and r["config"].startswith("WgmmaBwdConfig")]
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
            out[d] = best
    return out


def print_point(p: Point, results: dict) -> None:
    print(f"\n{p.label}  (TFLOP/s over visible pairs, backward = 2.5 x forward)")
    default_ms = next(iter(results.values())).ms
    for name, r in results.items():
        if r.status != "ok":
            print(f"  {name:<64} {r.status}: {r.reason}")
            continue
        regs = " ".join(f"{k.split('_')[0]} {v} regs" for k, v in r.resources.items() if k.endswith("registers"))
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text):
        return tuple(int(x) for x in text.split(",") if x)

    def words(valid):
        def parse(text):
            values = tuple(text.split(","))
            if not values or set(values) - set(valid):
                raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(valid)}")
            return values

        return parse

    def switches(text):
        return tuple(x == "on" for x in words(("on", "off"))(text))

    prog = "python -m fa2_numba_cuda.tuning.backward"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=ints, default=(2048, 4096, 16384), help="default 2048,4096,16384")
    parser.add_argument("--head-dims", type=ints, default=(64, 128), help="default 64,128")
    parser.add_argument(
        "--causal", type=lambda s: tuple(x == "yes" for x in words(("yes", "no"))(s)), default=(False, True)
    )
    parser.add_argument("--dtypes", type=words(tuple(DTYPES)), default=("bf16",), help="bf16,fp16 (default bf16)")
    parser.add_argument("--block-m", type=ints, default=(64, 96), help="dK/dV query tiles (default 64,96)")
    parser.add_argument("--dq-block-n", type=ints, default=(64, 128), help="wgmma dQ key tiles (default 64,128)")
    parser.add_argument("--dq", type=words(("wgmma", "tc")), default=("wgmma", "tc"), help="dQ kernels (default both)")
    parser.add_argument("--split", type=switches, default=(True,), help="SPLIT_MASK on,off (default on)")
    parser.add_argument("--dv-early", type=switches, default=(False,), help="DV_EARLY on,off (default off)")
    parser.add_argument("--baselines", type=words(BASELINES), default=BASELINES, help="SDPA providers timed beside")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timing rounds (default {ROUNDS})")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"B = tokens / N (default {TOKENS})")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"H = hidden / D (default {HIDDEN})")
    out = default_out()
    parser.add_argument("--out", type=Path, default=out, help=f"folder of <gpu>-tune-numba-bwd.csv (default {out})")
    parser.add_argument("--csv", type=Path, help="the CSV's path, instead of <out>/<gpu>-tune-numba-bwd.csv")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = tuning_device()
    if device is None:
        return 2
    pts = points(args)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "numba's simulator (not a measurement)"
    print(f"{where} | torch {torch.__version__} | {len(pts)} shapes | {timing.describe(device)}", flush=True)
    rows = []
    for p in pts:
        results = measure_point(p, args, device)
        print_point(p, results)
        record(rows, p, results, device)
    path = args.csv or args.out / f"{default_name(device)}-tune-numba-bwd.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path}")
    for d, (name, geomean, low, n) in proposal(rows).items():
        print(f"head_dim {d}: {name}, {geomean:.3f}x the default's speed (geomean over {n} shapes, min {low:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
