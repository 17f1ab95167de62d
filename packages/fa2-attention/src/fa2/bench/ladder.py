"""``python -m fa2.bench --ladder``: each backend's optimisation ladder (issue 43), rung by rung.

Every backend whose package has a ``ladder`` module (``fa2_<backend>.ladder``: ``RUNGS``, ``forward``,
``backward``, ``resources``; the interface is the one fa2_triton.ladder and fa2_pytorch.ladder follow) is
run at each rung × head_dim × causal: the forward and the backward, each checked against ``fa2.reference``
on a sample of rows (``check``) before it is timed, then timed as the sweep times (``timing.median_ms``: on
a GPU the median of ``triton.testing.do_bench``), with the registers, spills and shared memory of the
kernels the rung compiled for that call (``resources``; empty where the backend compiles none or runs
emulated).

GPU: N = 4096, 16k tokens (B = 4), hidden 2048 (H = 2048 / D), D = 64 and 128, causal and not, bf16.
Emulated (no GPU: Triton's interpreter, numba's simulator): N = 64, B = 1, H = 2, D = 16 and 32, fp16; its
times check the harness and say nothing about GPU speed, which the run prints and the plots say.

Files, under --out (default docs/benchmarks), named ``<name>-ladder`` (``h200-ladder``):

    <name>-ladder.csv            one row per (backend, rung, direction, head_dim, causal): ``COLUMNS``
    <name>-ladder-run.json       the environment, the command, the shapes, how it was timed
    <name>-ladder-<backend>.png  TFLOP/s per rung, forward and backward panels, a bar per (D, causal)

A run replaces the rows of the backends it measures and keeps the others' (one run per DSL, each within
a device call's time); the plots are drawn again from the whole CSV. A rung whose check fails, or that
raises, gets a row with no time and the reason in ``problem``.
"""

from __future__ import annotations

import csv
import functools
import importlib
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from fa2 import registry
from fa2.bench import check, timing
from fa2.bench.sweep import environment
from fa2.spec import AttentionSpec

COLUMNS = [
    "backend",
    "rung",
    "direction",
    "head_dim",
    "causal",
    "ms",
    "tflops",
    "registers",
    "spills",
    "shared_bytes",
    "speedup_vs_previous",
    "speedup_vs_first",
    "dtype",
    "batch",
    "heads",
    "seqlen",
    "problem",
]
DIRECTIONS = ("fwd", "bwd")
# (emulated) -> (seqlen, batch, heads by head_dim, head_dims, dtype)
SHAPES = {
    False: (4096, 4, lambda d: 2048 // d, (64, 128), torch.bfloat16),
    True: (64, 1, lambda d: 2, (16, 32), torch.float16),
}
EMULATED_NOTE = (
    "EMULATED on the CPU (Triton's interpreter, numba's CUDA simulator, tiny shapes): these timings need a GPU; "
    "they check the harness and say nothing about GPU speed"
)


def ladder_module(backend: str) -> ModuleType | None:
    """``fa2_<backend>.ladder`` of an installed backend, or None if its package has none."""
    package = registry.load(backend).__name__
    try:
        return importlib.import_module(f"{package}.ladder")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.ladder":
            raise
        return None


def with_ladder() -> list[str]:
    """The installed backends whose package has a ladder module."""
    return [b for b in registry.installed() if ladder_module(b) is not None]


def flops(direction: str, batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> int:
    """4·B·H·D·pairs (causal: N²/2 pairs, as the sweep counts them), the backward 2.5 times that."""
    pairs = seqlen**2 // 2 if causal else seqlen**2
    f = 4 * batch * heads * pairs * head_dim
    return f * 5 // 2 if direction == "bwd" else f


def _resources_of(kernels: list[dict]) -> dict:
    """One row's registers (the most of its kernels), spills (their sum, bytes) and shared memory (the most)."""
    if not kernels:
        return {"registers": "", "spills": "", "shared_bytes": ""}
    return {
        "registers": max(k["registers_per_thread"] for k in kernels),
        "spills": sum(k["spilled_bytes"] for k in kernels),
        "shared_bytes": max(k["shared_bytes"] for k in kernels),
    }


def _new_kernels(lad: ModuleType, rung: str, call: Callable[[], object]) -> tuple[object, list[dict]]:
    """call()'s result and the resources of the kernels the rung met first during it."""
    before = lad.resources(rung)
    out = call()
    return out, [k for k in lad.resources(rung) if k not in before]


def _checked_calls(lad: ModuleType, rung: str, q, k, v, dO, spec: AttentionSpec, sample, device: torch.device):
    """({direction: (the call to time, the resources of the kernels it compiled)}, {direction: problem or
    None}): each direction run once and checked; a rung that raises gets no calls and the error as both
    problems."""
    try:
        forward = functools.partial(lad.forward, rung, q, k, v, spec)
        (O, L), fwd_kernels = _new_kernels(lad, rung, forward)
        timing.sync(device)
        problems = {"fwd": check.problem(O, L, q, sample)}
        backward = functools.partial(lad.backward, rung, q, k, v, O, L, dO, spec)
        grads, bwd_kernels = _new_kernels(lad, rung, backward)
        timing.sync(device)
        problems["bwd"] = check.grad_problem(grads, q, k, v, sample)
        return {"fwd": (forward, fwd_kernels), "bwd": (backward, bwd_kernels)}, problems
    except Exception as e:  # noqa: BLE001 -- a rung that fails is a row with its reason, not the end of the run
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return {}, {d: reason for d in DIRECTIONS}


def measure_backend(
    backend: str,
    lad: ModuleType,
    device: torch.device,
    emulated: bool,
    head_dims: tuple[int, ...] | None = None,
    causals: tuple[bool, ...] = (False, True),
    progress: Callable[[str], None] = lambda text: None,
) -> list[dict]:
    """The rows of one backend's ladder (see the module docstring)."""
    seqlen, batch, heads_of, default_dims, dtype = SHAPES[emulated]
    rows = []
    for head_dim in head_dims or default_dims:
        heads = heads_of(head_dim)
        g = torch.Generator().manual_seed(head_dim)
        q, k, v, dO = (
            torch.randn(batch, heads, seqlen, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(4)
        )
        for causal in causals:
            spec = AttentionSpec(head_dim**-0.5, (-1, 0) if causal else (-1, -1))
            sample = check.reference_sample(q, k, v, causal, dO=dO)
            first: dict[str, float] = {}
            previous: dict[str, float] = {}
            for rung in lad.RUNGS:
                progress(f"{backend} {rung.name} D{head_dim} {'causal' if causal else 'full'}")
                base = {
                    "backend": backend,
                    "rung": rung.name,
                    "head_dim": head_dim,
                    "causal": causal,
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch,
                    "heads": heads,
                    "seqlen": seqlen,
                }
                calls, problems = _checked_calls(lad, rung.name, q, k, v, dO, spec, sample, device)
                for direction in DIRECTIONS:
                    row = {**base, "direction": direction, "problem": problems[direction] or ""}
                    row.update(_resources_of(calls[direction][1] if direction in calls else []))
                    if direction in calls and not problems[direction]:
                        fn = calls[direction][0]
                        _, first_s = timing.timed_once(fn, device)
                        ms = timing.median_ms(fn, device, first_s)
                        row["ms"] = ms
                        row["tflops"] = flops(direction, batch, heads, seqlen, head_dim, causal) / (ms * 1e-3) / 1e12
                        # Against the rungs before it that were measured (all of them, unless one failed).
                        first.setdefault(direction, ms)
                        row["speedup_vs_previous"] = previous.get(direction, ms) / ms
                        row["speedup_vs_first"] = first[direction] / ms
                        previous[direction] = ms
                    rows.append(row)
                del calls
    return rows


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.csv")
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c, "")) for c in COLUMNS})
    partial.replace(path)


def _cell(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def run(
    backends: list[str],
    device: torch.device,
    out_dir: Path,
    name: str,
    command: str = "",
    head_dims: tuple[int, ...] | None = None,
    causals: tuple[bool, ...] = (False, True),
    progress: Callable[[str], None] = lambda text: None,
) -> tuple[Path, list[Path]]:
    """Measures each backend's ladder into ``<name>-ladder.csv`` (keeping other backends' rows), writes the
    run's JSON and draws one plot per backend in the CSV; returns the CSV's path and the plots'."""
    emulated = device.type != "cuda"
    stem = f"{name}-ladder"
    csv_path = out_dir / f"{stem}.csv"
    measured = []
    started = time.time()
    for backend in backends:
        lad = ladder_module(backend)
        if lad is None:
            raise ValueError(f"fa2 backend {backend!r} has no ladder module (fa2_<backend>/ladder.py)")
        measured += measure_backend(backend, lad, device, emulated, head_dims, causals, progress)
    kept = [r for r in read_rows(csv_path) if r["backend"] not in backends]
    write_rows(csv_path, kept + measured)
    seqlen, batch, heads_of, dims, dtype = SHAPES[emulated]
    dims = head_dims or dims
    info = {
        **environment(device),
        "python": platform.python_version(),
        "command": command or " ".join(sys.argv),
        "backends": backends,
        "wall_s": round(time.time() - started, 1),
        "shapes": f"N {seqlen}, B {batch}, " + ", ".join(f"D {d} H {heads_of(d)}" for d in dims) + f", {dtype}",
        "timing": timing.describe(device) if not emulated else f"{timing.describe(device)}; {EMULATED_NOTE}",
    }
    runs_path = out_dir / f"{stem}-run.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else []
    runs_path.write_text(json.dumps([r for r in runs if set(r["backends"]) - set(backends)] + [info], indent=1) + "\n")
    rows = read_rows(csv_path)
    where = EMULATED_NOTE if emulated else info["gpu"]
    try:
        plots = [
            plot(rows, backend, out_dir / f"{stem}-{backend}.png", where, emulated) for backend in _backends_of(rows)
        ]
    except ImportError as e:
        print(f"no plots ({e}): matplotlib is not installed", file=sys.stderr)
        plots = []
    return csv_path, plots


def _backends_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["backend"] for r in rows))


def plot(rows: list[dict], backend: str, path: Path, where: str, emulated: bool) -> Path:
    """TFLOP/s per rung of one backend: a panel per direction, a bar per (D, causal) at each rung; ``where``:
    the GPU, or what the emulated run's times do not say (then a log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["backend"] == backend]
    rungs = list(dict.fromkeys(r["rung"] for r in mine))
    series = sorted({(int(r["head_dim"]), r["causal"] == "True") for r in mine})
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(rungs)), 8.5), squeeze=False)
    width = 0.8 / max(1, len(series))
    for ax, direction in zip(axes[:, 0], DIRECTIONS):
        for i, (head_dim, causal) in enumerate(series):
            cell = {
                r["rung"]: float(r["tflops"])
                for r in mine
                if (r["direction"], int(r["head_dim"]), r["causal"] == "True") == (direction, head_dim, causal)
                and r["tflops"]
            }
            if not cell:
                continue
            xs = [j + (i - (len(series) - 1) / 2) * width for j, rung in enumerate(rungs) if rung in cell]
            ax.bar(
                xs,
                [cell[r] for r in rungs if r in cell],
                width,
                label=f"D {head_dim}, {'causal' if causal else 'full'}",
            )
        ax.set_xticks(range(len(rungs)), rungs, rotation=30, ha="right")
        ax.set_ylabel("TFLOP/s")
        ax.set_title({"fwd": "forward", "bwd": "backward"}[direction])
        ax.grid(True, axis="y", alpha=0.3)
        if ax.containers:
            ax.legend(fontsize=7)
        if emulated and ax.containers:
            ax.set_yscale("log")  # the emulators' times span orders of magnitude
    first = mine[0]
    heads = ", ".join(f"{h} at D {d}" for d, h in sorted({int(r["head_dim"]): r["heads"] for r in mine}.items()))
    fig.suptitle(
        f"fa2-{backend}: the optimisation ladder, {first['dtype']}, N = {first['seqlen']}, B = {first['batch']}, "
        f"H = {heads}\non {where}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# The figures of a ladder page (docs/ladder/<backend>.md) sit between these two lines, rendered from the
# committed CSV by ``tables`` (``python -m fa2.bench.ladder`` writes them; the docs tests check them).
TABLES_START = "<!-- ladder-tables: {backend} -->"
TABLES_END = "<!-- ladder-tables: end -->"


def _kib(x: str) -> str:
    return f"{int(x) / 1024:.0f} KiB" if x else "—"


def tables(rows: list[dict], backend: str) -> str:
    """One backend's ladder as markdown: forward and backward TFLOP/s per rung at each (D, causal), each with
    its speed-up over the rung before (×), then the compiler's registers a thread, bytes spilled and shared
    memory a block (the most over the rung's kernels; — where the rung compiled none new in that call)."""
    mine = [r for r in rows if r["backend"] == backend]
    rungs = list(dict.fromkeys(r["rung"] for r in mine))
    points = sorted({(int(r["head_dim"]), r["causal"] == "True") for r in mine})
    cell = {(r["rung"], r["direction"], int(r["head_dim"]), r["causal"] == "True"): r for r in mine}
    heads = ", ".join(f"D {d}: H {h}" for d, h in sorted({int(r["head_dim"]): r["heads"] for r in mine}.items()))
    first = mine[0]
    out = [
        f"{first['dtype']}, N = {first['seqlen']}, B = {first['batch']}, {heads}; TFLOP/s (× the rung before).",
        "",
    ]
    header = "| rung | " + " | ".join(f"D {d} {'causal' if c else 'full'}" for d, c in points) + " |"
    rule = "|---|" + "---:|" * len(points)
    for direction, title in (("fwd", "Forward"), ("bwd", "Backward (2.5 forwards' FLOPs)")):
        out += [f"**{title}**", "", header, rule]
        for rung in rungs:
            cells = []
            for d, c in points:
                r = cell.get((rung, direction, d, c))
                if r is None or not r["tflops"]:
                    cells.append(r["problem"][:40] if r else "—")
                else:
                    cells.append(f"{float(r['tflops']):.0f} ({float(r['speedup_vs_previous']):.2f}×)")
            out.append(f"| `{rung}` | " + " | ".join(cells) + " |")
        out.append("")
    out += ["**Registers / spilled bytes / shared memory** (forward; backward)", "", header, rule]
    for rung in rungs:
        cells = []
        for d, c in points:
            parts = []
            for direction in DIRECTIONS:
                r = cell.get((rung, direction, d, c))
                if r is None or not r["registers"]:
                    parts.append("—")
                else:
                    parts.append(f"{r['registers']} / {r['spills']} / {_kib(r['shared_bytes'])}")
            cells.append("; ".join(parts))
        out.append(f"| `{rung}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """Every backend's first and last rung as markdown: TFLOP/s at each (direction, D, causal), and the last
    over the first."""
    points = sorted({(int(r["head_dim"]), r["causal"] == "True") for r in rows})
    cell = {(r["backend"], r["rung"], r["direction"], int(r["head_dim"]), r["causal"] == "True"): r for r in rows}
    out = [
        "| backend | rung | "
        + " | ".join(f"{t} D {d} {'causal' if c else 'full'}" for t in ("fwd", "bwd") for d, c in points)
        + " |",
        "|---|---|" + "---:|" * (2 * len(points)),
    ]
    for backend in _backends_of(rows):
        rungs = list(dict.fromkeys(r["rung"] for r in rows if r["backend"] == backend))
        ends = [(rungs[0], "first"), (rungs[-1], "last")]
        values = {}
        for rung, which in ends:
            cells = []
            for direction in DIRECTIONS:
                for d, c in points:
                    r = cell.get((backend, rung, direction, d, c))
                    values[which, direction, d, c] = float(r["tflops"]) if r and r["tflops"] else None
                    cells.append(
                        "—" if values[which, direction, d, c] is None else f"{values[which, direction, d, c]:.0f}"
                    )
            out.append(f"| {backend} | `{rung}` | " + " | ".join(cells) + " |")
        ratios = []
        for direction in DIRECTIONS:
            for d, c in points:
                a, b = values["first", direction, d, c], values["last", direction, d, c]
                ratios.append(f"{b / a:.2f}×" if a and b else "—")
        out.append(f"| {backend} | last / first | " + " | ".join(ratios) + " |")
    return "\n".join(out)


def render_page(page: str, rows: list[dict]) -> str:
    """``page`` with the block between each TABLES_START line (for a backend; ``summary`` for every backend's
    first and last rungs) and TABLES_END replaced by that backend's ``tables`` (or the ``summary``)."""
    lines = page.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        start = re.fullmatch(r"<!-- ladder-tables: ([\w-]+) -->", lines[i].strip())
        if start and start.group(1) != "end":
            end = lines.index(TABLES_END, i + 1)
            body = summary(rows) if start.group(1) == "summary" else tables(rows, start.group(1))
            out += ["", body, "", TABLES_END]
            i = end
        i += 1
    return "\n".join(out)


if __name__ == "__main__":
    # From the repository's root: python -m fa2.bench.ladder [CSV] writes the ladder pages' tables from the
    # committed run (default docs/benchmarks/h200-ladder.csv).
    committed = read_rows(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/h200-ladder.csv"))
    for page in [Path("docs/ladder.md"), *sorted(Path("docs/ladder").glob("*.md"))]:
        page.write_text(render_page(page.read_text(), committed))
