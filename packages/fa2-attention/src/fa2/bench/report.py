"""From a run's files to its summary: ``<name>.md`` (ratio tables, TFLOP/s, memory, what was not
measured) and the ratio tables on stdout, each per mode (forward, backward). Reads only the files, so a
summary can be redrawn anywhere."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fa2.bench.check import SAMPLE_ROWS
from fa2.bench.providers import FA2_PROVIDERS, PROVIDERS
from fa2.bench.sweep import MODES, read_csv, read_runs

# What the fa2 backends are measured against: the GPU kernels a user would pick instead; without a GPU,
# the only baseline that runs on the CPU.
BASELINES = {False: ("sdpa-flash", "sdpa-cudnn"), True: ("sdpa-math",)}
MODE_NAMES = {"fwd": "forward", "bwd": "backward"}


@dataclass
class Run:
    results: list[dict]  # the CSV's rows, numbers parsed
    issues: list[dict]
    runs: list[dict]  # <name>-run.json: one per run that wrote the CSV (several with --append)

    @property
    def info(self) -> dict:
        """The latest run: its environment and matmul ceilings describe the report."""
        return self.runs[-1] if self.runs else {}

    def ceilings_of(self, rows: list[dict]) -> dict:
        """The matmul ceilings measured by the run that measured ``rows``: of an --append sequence, the last
        part that started before the first of them (ISO timestamps, one clock)."""
        first = min(r["timestamp"] for r in rows)
        parts = [r for r in self.runs if r.get("started", "") <= first] or self.runs[:1]
        return parts[-1].get("ceilings", {}) if parts else {}

    @property
    def emulated(self) -> bool:
        return bool(self.info.get("emulated"))

    def tflops(self) -> dict[tuple, float]:
        return {_key(r): r["tflops"] for r in self.results}

    def modes(self) -> list[str]:
        return [m for m in MODES if any(r["mode"] == m for r in self.results)]

    def of_mode(self, mode: str) -> Run:
        """This run's measurements in one mode (the tables and plots take one mode at a time)."""
        return Run([r for r in self.results if r["mode"] == mode], self.issues, self.runs)


def load(out_dir: Path, name: str) -> Run:
    results = read_csv(out_dir / f"{name}.csv")
    if not results:
        raise SystemExit(f"no results in {out_dir / f'{name}.csv'}")
    for r in results:
        r["head_dim"], r["seqlen"] = int(r["head_dim"]), int(r["seqlen"])
        r["heads"], r["heads_k"], r["window"] = int(r["heads"]), int(r["heads_k"]), int(r["window"])
        r["softcap"] = float(r["softcap"])
        r["causal"] = r["causal"] == "True"
        r["ms"], r["tflops"] = float(r["ms"]), float(r["tflops"])
        r["peak_mem_gb"] = float(r["peak_mem_gb"]) if r["peak_mem_gb"] else None
    return Run(results, read_csv(out_dir / f"{name}-skipped.csv"), read_runs(out_dir / f"{name}-run.json"))


def _key(r: dict) -> tuple:
    return r["provider"], r["dtype"], r["head_dim"], r["causal"], variant(r), r["seqlen"]


def variant(r: dict) -> tuple[int, int, int, float]:
    """The options of a row beyond dtype, D, causal and N: (heads, heads_k, window, softcap)."""
    return r["heads"], r["heads_k"], r["window"], r["softcap"]


def variant_text(v: tuple[int, int, int, float]) -> str:
    """ "H32/8 w4096 cap50" (query/key-value heads, window, softcap), "H16" without options."""
    heads, heads_k, window, softcap = v
    parts = [f"H{heads}" + (f"/{heads_k}" if heads_k != heads else ""), f"w{window}" if window >= 0 else "",
             f"cap{softcap:g}" if softcap else ""]
    return " ".join(p for p in parts if p)


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def groups(results: list[dict]) -> list[tuple[str, int, bool, tuple]]:
    """The (dtype, D, causal, variant) of the rows, in the tables' order."""
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return sorted({(r["dtype"], r["head_dim"], r["causal"], variant(r)) for r in results},
                  key=lambda g: (order[g[0]], g[1:]))


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def ratios(run: Run, fa2: str, baseline: str) -> dict[tuple, float]:
    """fa2's TFLOP/s over the baseline's, per (dtype, D, causal, variant, N) where both were measured."""
    t = run.tflops()
    return {k[1:]: t[k] / t[(baseline, *k[1:])] for k in t if k[0] == fa2 and (baseline, *k[1:]) in t}


def ratio_tables(run: Run) -> list[str]:
    """Per mode: the headline (min and geomean per fa2 backend and baseline), then one table per baseline,
    per shape; then the options against none (``option_tables``), where the run measured both."""
    out = []
    for mode in run.modes():
        out += [f"## {MODE_NAMES[mode]}", ""] if run.modes() != ["fwd"] else []
        out += _ratio_tables(run.of_mode(mode)) + [""]
        options = option_tables(run.of_mode(mode))
        out += [*options, ""] if options else []
    return out[:-1]


def _ratio_tables(run: Run) -> list[str]:
    baselines = BASELINES[run.emulated]
    fa2s = [p for p in FA2_PROVIDERS if any(r["provider"] == p for r in run.results)]
    seqlens = sorted({r["seqlen"] for r in run.results})
    out = ["Ratio of TFLOP/s (above 1: the fa2 backend is faster), per shape where both ran.", ""]
    summary = []
    for fa2 in fa2s:
        cells = [fa2]
        for b in baselines:
            rs = list(ratios(run, fa2, b).values())
            cells += [_ratio(min(rs)), _ratio(_geomean(rs)), str(len(rs))] if rs else ["—", "—", "0"]
        summary.append(cells)
    header = ["fa2 backend"] + [f"{h} vs {b}" for b in baselines for h in ("min", "geomean", "shapes")]
    out += _table(header, summary)
    for b in baselines:
        rows = []
        for fa2 in fa2s:
            rs = ratios(run, fa2, b)
            for dtype, d, causal, v in groups(run.results):
                cells = [rs.get((dtype, d, causal, v, n)) for n in seqlens]
                present = [c for c in cells if c is not None]
                if present:
                    rows.append([fa2, dtype, str(d), "yes" if causal else "no", variant_text(v),
                                 *("—" if c is None else _ratio(c) for c in cells),
                                 _ratio(min(present)), _ratio(_geomean(present))])
        out += ["", f"### fa2 / {b}", ""]
        out += _table(["fa2 backend", "dtype", "D", "causal", "heads, options", *map(seqlen_label, seqlens), "min",
                       "geomean"], rows) \
            if rows else [f"No shape where an fa2 backend and {b} both ran."]
    return out


def value_tables(run: Run, column: str, fmt) -> list[str]:
    """One table per dtype: a row per (provider, D, causal, variant), a column per N."""
    seqlens = sorted({r["seqlen"] for r in run.results})
    values = {_key(r): r[column] for r in run.results if r[column] is not None}
    out = []
    for dtype in ("bf16", "fp16", "fp32"):
        rows = []
        for p in PROVIDERS:
            for g_dtype, d, causal, v in groups(run.results):
                cells = [values.get((p, dtype, d, causal, v, n)) for n in seqlens]
                if g_dtype == dtype and any(c is not None for c in cells):
                    rows.append([p, str(d), "yes" if causal else "no", variant_text(v),
                                 *("" if c is None else fmt(c) for c in cells)])
        if rows:
            out += ["", f"### {dtype}", ""] + _table(["provider", "D", "causal", "heads, options",
                                                      *map(seqlen_label, seqlens)], rows)
    return out


# Each option and the variant of a row without it: GQA against the dense heads, the window against plain
# causal, the softcap against none (the other options kept).
OPTIONS = {
    "GQA": (lambda v: v[1] != v[0], lambda v: (v[0], v[0], v[2], v[3])),
    "window": (lambda v: v[2] >= 0, lambda v: (v[0], v[1], -1, v[3])),
    "softcap": (lambda v: v[3] != 0, lambda v: (v[0], v[1], v[2], 0.0)),
}


def option_tables(run: Run) -> list[str]:
    """Per option measured beside its absence in the run: each provider's TFLOP/s with it over its TFLOP/s
    without it, the other options the same (the windowed rows counted over the visible pairs)."""
    t = run.tflops()
    seqlens = sorted({r["seqlen"] for r in run.results})
    rows = []
    for name, (has, without) in OPTIONS.items():
        for p in PROVIDERS:
            for dtype, d, causal, v in groups(run.results):
                if not has(v):
                    continue
                cells = [t.get((p, dtype, d, causal, v, n)) and t.get((p, dtype, d, causal, without(v), n))
                         and t[p, dtype, d, causal, v, n] / t[p, dtype, d, causal, without(v), n] for n in seqlens]
                if any(cells):
                    rows.append([name, p, dtype, str(d), "yes" if causal else "no",
                                 f"{variant_text(v)} / {variant_text(without(v))}",
                                 *("—" if not c else _ratio(c) for c in cells)])
    if not rows:
        return []
    return ["Ratio of TFLOP/s with the option to without it (the same provider and shape; 1: it costs nothing).",
            "", *_table(["option", "provider", "dtype", "D", "causal", "heads, options",
                         *map(seqlen_label, seqlens)], rows)]


def not_measured(run: Run) -> list[str]:
    counts = Counter((i["provider"], i["status"], i["reason"]) for i in run.issues)
    rows = [[p, status, reason, str(n)] for (p, status, reason), n in sorted(counts.items())]
    return _table(["provider", "status", "reason", "shapes"], rows) if rows else ["Nothing: every planned shape ran."]


def markdown(run: Run, name: str, plots: list[Path]) -> str:
    info, emulated = run.info, run.emulated
    gpu = info.get("gpu", run.results[0]["gpu"])
    ceil = info.get("ceilings", {})
    n = ceil.get("matmul_size", "?")
    modes = run.modes()
    title = " and ".join(MODE_NAMES[m] for m in modes)
    lines = [f"# fa2 {title} benchmark: {'EMULATED on the CPU' if emulated else gpu}", ""]
    if emulated:
        lines += ["> **EMULATED.** No GPU: fa2-pytorch and SDPA math on the CPU, fa2-triton in Triton's interpreter",
                  "> and fa2-numba-cuda in numba's CUDA simulator, on tiny shapes. These times show that the",
                  "> harness and the kernels run and agree with the reference; they say nothing about GPU speed.", ""]
    shapes = ("B = 1, H = 2 unless --heads (emulated)" if emulated else
              "16k tokens (B = 16384 / N), hidden 2048 (H = 2048 / D) unless --heads, as in the FlashAttention-2 "
              "paper")
    lines += [
        f"- Environment: commit `{info.get('commit', '?')}`, torch {info.get('torch', '?')}, "
        f"triton {info.get('triton') or '—'}, numba-cuda {info.get('numba_cuda') or '—'}.",
        f"- Wall time {sum(r.get('wall_s', 0) for r in run.runs):.0f} s, from:",
        *(f"  - `{r.get('command', '?')}`, started {r.get('started', '?')}, {r.get('wall_s', '?')} s, bf16 matmul "
          f"{_num(r.get('ceilings', {}).get('bf16_matmul_tflops', math.nan))} TFLOP/s" for r in run.runs),
        f"- Shapes: {shapes}; inputs (B, H, N, D) contiguous, standard normal. "
        "FLOPs = 4·B·H·D·pairs: N² full, N²/2 causal, with a sliding window exactly the visible (query, key) "
        "pairs"
        + ("; the backward (timed alone, after one forward) 2.5 times that." if "bwd" in modes else "."),
        f"- Timing: {info.get('timing', '?')}. Peak memory: the most one call allocates beyond what was live "
        "before it (its outputs included); not measured on the CPU.",
        f"- Matmul ceilings ({n}³{', of the last part' if len(run.runs) > 1 else ''}): "
        f"bf16 {_num(ceil.get('bf16_matmul_tflops', math.nan))} TFLOP/s, "
        f"fp32 without TF32 {_num(ceil.get('fp32_matmul_tflops', math.nan))} TFLOP/s.",
        "- Correctness: before timing, each provider's O and L on each shape are checked against "
        f"`fa2.reference` with the same mask, window and softcap, on {SAMPLE_ROWS} sampled query rows of the first "
        "and last batch entries and heads (the rule of `shared_tests/checks.py`); a provider that fails is not "
        "timed. sdpa-math's op returns the attention weights, not L, and fa2.scaled_dot_product_attention "
        "(`--fa2-entry sdpa`) O alone: their check covers O only."
        + (" The backward's dq is checked on the same rows (the rule of `shared_tests/test_gradients.py`), "
           "dk and dv for NaN and inf." if "bwd" in modes else ""),
    ]
    for mode in modes:
        sub, which = run.of_mode(mode), "" if mode == "fwd" else f" ({MODE_NAMES[mode]})"
        lines += ["", f"## fa2 against {' and '.join(BASELINES[emulated])}{which}", "", *_ratio_tables(sub)]
        options = option_tables(sub)
        lines += ["", f"## Options against none{which}", "", *options] if options else []
        lines += ["", f"## TFLOP/s{which}", *value_tables(sub, "tflops", _num)]
        if not emulated:
            lines += ["", f"## Peak memory per call (GB){which}",
                      *value_tables(sub, "peak_mem_gb", lambda x: f"{x:.3g}")]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or [
        f"None drawn (no matplotlib here): `python -m fa2.bench --report-only --name {name}` draws them."]
    lines += ["", "## Not measured", "", f"From `{name}-skipped.csv`, grouped by reason.", "", *not_measured(run)]
    return "\n".join(lines) + "\n"
