"""From a run's files to its summary: ``<name>.md`` (ratio tables, TFLOP/s, memory, what was not
measured) and the ratio tables on stdout, each per mode (forward, backward). Reads only the files, so a
summary can be redrawn anywhere. A --varlen run's (rows with lengths) has its own tables
(``varlen_tables``): each fa2 backend's packed TFLOP/s against its own dense TFLOP/s and against SDPA on
nested jagged tensors and FlexAttention on the same batch, with issue 21's targets. A --decode run's (rows
with seqlen_q) has ``decode_tables``: µs and K/V bytes read per second per provider and layout, against SDPA,
the copy ceiling, the contiguous cache and fa2-triton, with issue 22's targets."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fa2.bench.check import SAMPLE_ROWS
from fa2.bench.providers import DECODE_PROVIDERS, FA2_PROVIDERS, PROVIDERS, VARLEN_PROVIDERS
from fa2.bench.sweep import MODES, read_csv, read_runs

# What the fa2 backends are measured against: the GPU kernels a user would pick instead; without a GPU,
# the only baseline that runs on the CPU.
BASELINES = {False: ("sdpa-flash", "sdpa-cudnn"), True: ("sdpa-math",)}
MODE_NAMES = {"fwd": "forward", "bwd": "backward"}
# Issue 21: an fa2 backend's packed TFLOP/s (over the real pairs) at least these times its own dense TFLOP/s at
# N = 2k ("dense") and each alternative's on the same batch; forward and backward.
VARLEN_TARGETS = {"dense": 0.95, "sdpa-njt": 1.0, "flex": 1.0}
VARLEN_ALTERNATIVES = tuple(p for p in VARLEN_PROVIDERS if p not in FA2_PROVIDERS)
# Issue 22, per fa2 backend's decode rows: SDPA's time over the backend's (each SDPA entry), the K/V bytes read
# per second over the copy ceiling's from DECODE_COPY_FROM cached keys, a paged cache's rate over the contiguous
# one's, and fa2-numba-cuda's rate over fa2-triton's.
DECODE_BASELINES = ("sdpa", "sdpa-flash")
DECODE_TARGETS = {"sdpa": 1.0, "sdpa-flash": 1.0, "copy": 0.85, "paged": 0.95, "fa2-triton": 0.5}
DECODE_COPY_FROM = 32768
# An emulated run's times are the emulators' on the CPU: every table says so (``_caption``, ``_heading``), and the
# tables printed at the end of a run open with this, so that no ratio of them reads as a GPU's.
EMULATED_NOTE = (
    "EMULATED on the CPU: no GPU; fa2-triton ran in Triton's interpreter, fa2-numba-cuda in numba's CUDA "
    "simulator, the rest on the CPU, on tiny shapes. These times and ratios show that the harness and the "
    "kernels run and agree with the reference; they say nothing about GPU speed."
)
EMULATED_TAG = "EMULATED, not GPU speed"


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

    @property
    def varlen(self) -> bool:
        """A --varlen run: packed batches (and the fa2 backends' dense reference shapes)."""
        return any(r["lengths"] for r in self.results)

    @property
    def decode(self) -> bool:
        """A --decode run: query tokens against a KV cache."""
        return any(r["seqlen_q"] for r in self.results)

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
        r["head_dim"], r["seqlen"], r["batch"] = int(r["head_dim"]), int(r["seqlen"]), int(r["batch"])
        r["seqlen_q"], r["page_size"] = int(r["seqlen_q"]), int(r["page_size"])
        r["tbps"] = float(r["tbps"]) if r["tbps"] else None
        r["heads"], r["heads_k"], r["window"] = int(r["heads"]), int(r["heads_k"]), int(r["window"])
        r["softcap"] = float(r["softcap"])
        r["lengths"] = tuple(int(n) for n in r["lengths"].split())
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
    parts = [
        f"H{heads}" + (f"/{heads_k}" if heads_k != heads else ""),
        f"w{window}" if window >= 0 else "",
        f"cap{softcap:g}" if softcap else "",
    ]
    return " ".join(p for p in parts if p)


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _caption(run: Run, text: str) -> str:
    """A table's caption, EMULATED_TAG first for an emulated run."""
    return f"**{EMULATED_TAG}.** {text}" if run.emulated else text


def _heading(run: Run, text: str) -> str:
    """A section's heading, EMULATED_TAG after it for an emulated run."""
    return f"{text} ({EMULATED_TAG})" if run.emulated else text


def groups(results: list[dict]) -> list[tuple[str, int, bool, tuple]]:
    """The (dtype, D, causal, variant) of the rows, in the tables' order."""
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return sorted(
        {(r["dtype"], r["head_dim"], r["causal"], variant(r)) for r in results}, key=lambda g: (order[g[0]], g[1:])
    )


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def ratios(run: Run, fa2: str, baseline: str) -> dict[tuple, float]:
    """fa2's TFLOP/s over the baseline's, per (dtype, D, causal, variant, N) where both were measured."""
    t = run.tflops()
    return {k[1:]: t[k] / t[(baseline, *k[1:])] for k in t if k[0] == fa2 and (baseline, *k[1:]) in t}


def ratio_tables(run: Run) -> list[str]:
    """Per mode: the headline (min and geomean per fa2 backend and baseline), then one table per baseline,
    per shape; then the options against none (``option_tables``), where the run measured both. A --varlen
    run: ``varlen_tables``; a --decode run: ``decode_tables``. An emulated run's open with EMULATED_NOTE."""
    banner = [f"**{EMULATED_NOTE}**", ""] if run.emulated else []
    if run.varlen:
        return banner + varlen_tables(run)
    if run.decode:
        return banner + decode_tables(run)
    out = banner
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
    out = [_caption(run, "Ratio of TFLOP/s (above 1: the fa2 backend is faster), per shape where both ran."), ""]
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
                    rows.append(
                        [
                            fa2,
                            dtype,
                            str(d),
                            "yes" if causal else "no",
                            variant_text(v),
                            *("—" if c is None else _ratio(c) for c in cells),
                            _ratio(min(present)),
                            _ratio(_geomean(present)),
                        ]
                    )
        out += ["", "### " + _heading(run, f"fa2 / {b}"), ""]
        out += (
            _table(
                [
                    "fa2 backend",
                    "dtype",
                    "D",
                    "causal",
                    "heads, options",
                    *map(seqlen_label, seqlens),
                    "min",
                    "geomean",
                ],
                rows,
            )
            if rows
            else [f"No shape where an fa2 backend and {b} both ran."]
        )
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
                    rows.append(
                        [
                            p,
                            str(d),
                            "yes" if causal else "no",
                            variant_text(v),
                            *("" if c is None else fmt(c) for c in cells),
                        ]
                    )
        if rows:
            out += ["", "### " + _heading(run, dtype), ""]
            out += _table(["provider", "D", "causal", "heads, options", *map(seqlen_label, seqlens)], rows)
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
                cells = [
                    t.get((p, dtype, d, causal, v, n))
                    and t.get((p, dtype, d, causal, without(v), n))
                    and t[p, dtype, d, causal, v, n] / t[p, dtype, d, causal, without(v), n]
                    for n in seqlens
                ]
                if any(cells):
                    rows.append(
                        [
                            name,
                            p,
                            dtype,
                            str(d),
                            "yes" if causal else "no",
                            f"{variant_text(v)} / {variant_text(without(v))}",
                            *("—" if not c else _ratio(c) for c in cells),
                        ]
                    )
    if not rows:
        return []
    return [
        _caption(
            run, "Ratio of TFLOP/s with the option to without it (the same provider and shape; 1: it costs nothing)."
        ),
        "",
        *_table(["option", "provider", "dtype", "D", "causal", "heads, options", *map(seqlen_label, seqlens)], rows),
    ]


def _packed_key(r: dict) -> tuple:
    return r["mode"], r["dtype"], r["head_dim"], r["causal"], r["heads"]


def varlen_ratios(run: Run) -> list[dict]:
    """Per fa2 backend's packed row: its TFLOP/s, and per reference (its own dense rows at each N of the run,
    "dense <N>"; each alternative on the same lengths) that one's TFLOP/s and the ratio, where measured."""
    dense = {(r["provider"], *_packed_key(r), r["seqlen"]): r["tflops"] for r in run.results if not r["lengths"]}
    packed = {(r["provider"], *_packed_key(r), r["lengths"]): r["tflops"] for r in run.results if r["lengths"]}
    dense_ns = sorted({r["seqlen"] for r in run.results if not r["lengths"]})
    out = []
    for fa2 in FA2_PROVIDERS:
        for r in sorted(
            (r for r in run.results if r["provider"] == fa2 and r["lengths"]),
            key=lambda r: (MODES.index(r["mode"]), *_packed_key(r)[1:], r["lengths"]),
        ):
            refs = {f"dense {seqlen_label(n)}": dense.get((fa2, *_packed_key(r), n)) for n in dense_ns}
            refs.update({b: packed.get((b, *_packed_key(r), r["lengths"])) for b in VARLEN_ALTERNATIVES})
            out.append({"row": r, "refs": {name: (t, t and r["tflops"] / t) for name, t in refs.items()}})
    return out


def varlen_tables(run: Run) -> list[str]:
    """Issue 21's targets per fa2 backend and mode (the least ratio over the shapes), then every packed shape:
    the backend's TFLOP/s, each reference's and the ratio."""
    ratios_ = varlen_ratios(run)
    if not ratios_:
        return ["No packed batch measured for an fa2 backend."]
    names = list(ratios_[0]["refs"])

    def target(name):
        return VARLEN_TARGETS["dense" if name.startswith("dense") else name]

    summary = []
    for fa2 in FA2_PROVIDERS:
        for mode in MODES:
            mine = [x for x in ratios_ if (x["row"]["provider"], x["row"]["mode"]) == (fa2, mode)]
            if mine:
                cells = []
                for name in names:
                    rs = [x["refs"][name][1] for x in mine if x["refs"][name][1]]
                    cells.append(f"{_ratio(min(rs))} ({len(rs)})" if rs else "—")
                summary.append([fa2, MODE_NAMES[mode], *cells])
    out = [
        _caption(
            run,
            "Packed TFLOP/s over the real (query, key) pairs, divided by each reference's: the least "
            "over the shapes (how many), against issue 21's targets.",
        ),
        "",
        *_table(["fa2 backend", "mode", *(f"/ {n} (target {target(n):g})" for n in names)], summary),
        "",
    ]
    rows = []
    for x in ratios_:
        r = x["row"]
        cells = [
            c
            for name in names
            for c in (
                _num(x["refs"][name][0]) if x["refs"][name][0] else "—",
                _ratio(x["refs"][name][1]) if x["refs"][name][1] else "—",
            )
        ]
        rows.append(
            [
                r["provider"],
                MODE_NAMES[r["mode"]],
                r["dtype"],
                str(r["head_dim"]),
                str(r["heads"]),
                "yes" if r["causal"] else "no",
                _num(r["tflops"]),
                *cells,
            ]
        )
    out += [_caption(run, "Per packed batch: the fa2 backend's TFLOP/s, each reference's and the ratio."), ""]
    out += _table(
        ["fa2 backend", "mode", "dtype", "D", "H", "causal", "TFLOP/s", *(c for n in names for c in (n, "ratio"))], rows
    )
    return out


def _varlen_value_table(run: Run) -> list[str]:
    """Every measured row: provider, shape, ms, TFLOP/s, peak memory."""
    order = list(dict.fromkeys([*VARLEN_PROVIDERS, *PROVIDERS]))
    rows = []
    for r in sorted(
        run.results,
        key=lambda r: (
            MODES.index(r["mode"]),
            *_packed_key(r)[1:],
            not r["lengths"],
            r["seqlen"],
            order.index(r["provider"]),
        ),
    ):
        shape = (
            f"packed {len(r['lengths'])} seqs, {r['seqlen']} tokens"
            if r["lengths"]
            else f"dense B{r['batch']} N{r['seqlen']}"
        )
        rows.append(
            [
                r["provider"],
                MODE_NAMES[r["mode"]],
                r["dtype"],
                str(r["head_dim"]),
                str(r["heads"]),
                "yes" if r["causal"] else "no",
                shape,
                f"{r['ms']:.4g}",
                _num(r["tflops"]),
                "" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.3g}",
            ]
        )
    return _table(["provider", "mode", "dtype", "D", "H", "causal", "shape", "ms", "TFLOP/s", "peak GB"], rows)


def _varlen_markdown(run: Run, name: str, plots: list[Path]) -> str:
    info, emulated = run.info, run.emulated
    gpu = info.get("gpu", run.results[0]["gpu"])
    modes = run.modes()
    title = " and ".join(MODE_NAMES[m] for m in modes)
    lines = [f"# fa2 packed-batch (varlen) {title} benchmark: {'EMULATED on the CPU' if emulated else gpu}", ""]
    if emulated:
        lines += [
            "> **EMULATED.** No GPU: fa2-pytorch and SDPA on nested jagged tensors (math) on the CPU, fa2-triton in",
            "> Triton's interpreter and fa2-numba-cuda in numba's CUDA simulator, on a tiny batch. These times show",
            "> that the harness and the kernels run and agree with the reference; they say nothing about GPU speed.",
            "",
        ]
    packings = {json.dumps(r["varlen"], sort_keys=True): r["varlen"] for r in run.runs if r.get("varlen")}
    batches = [
        f"{p['tokens']} tokens in {len(p['lengths'])} sequences of lengths "
        f"{', '.join(map(str, p['lengths']))} (drawn uniformly from {p['low']} to {p['high']} by "
        f"random.Random({p['seed']}), the last what is left)"
        for p in packings.values()
    ] or sorted({f"lengths {', '.join(map(str, r['lengths']))}" for r in run.results if r["lengths"]})
    bwd = "bwd" in modes
    shapes = [
        f"- Packed batch: {'; '.join(batches)}. q, k, v (total, H, D), standard normal; H = 2048 / D (hidden 2048; "
        "emulated 2) unless --heads.",
        "- FLOPs over the real (query, key) pairs, per head: Σ n² full, Σ n (n + 1) / 2 causal (causal within each "
        "sequence); 4·H·D·pairs forward. The fa2 backends' dense reference (fa2.attention on (B, H, N, D), B = "
        "tokens / N) is counted as the dense sweep counts it, 4·B·H·D·pairs with N² full and N²/2 causal"
        + ("; the backward (timed alone, after one forward) 2.5 times each." if bwd else "."),
        "- Providers: fa2's backends through `fa2.varlen_attention` (int32 cu_seqlens on the device, max_seqlen "
        "ints); sdpa-njt, `F.scaled_dot_product_attention` on nested jagged tensors "
        "(`torch.nested.nested_tensor_from_jagged` with min/max_seqlen, transposed to (B, H, j, D), is_causal) "
        "under `sdpa_kernel(FLASH_ATTENTION)` on a GPU, MATH on the CPU; flex, compiled FlexAttention on "
        "(1, H, total, D) views with a document mask (causal within each sequence) made once by "
        "`create_block_mask`. Offsets and masks are made before timing.",
    ]
    lines += [
        *_environment(run, shapes),
        "- Correctness: before timing, each provider's O (and L where it returns one; sdpa-njt does not) is "
        f"checked against `fa2.reference` run on each sampled row's own sequence, on {SAMPLE_ROWS} random query "
        "rows plus every sequence's first and last, of the first and last heads (the rule of "
        "`shared_tests/checks.py`); a provider that fails is not timed."
        + (" The backward's dq is checked on the same rows, dk and dv for NaN and inf." if bwd else ""),
    ]
    lines += ["", "## Packed against dense and the alternatives", "", *varlen_tables(run)]
    lines += ["", "## " + _heading(run, "Every measurement"), "", *_varlen_value_table(run)]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or [
        f"None drawn (no matplotlib here): `python -m fa2.bench --report-only --name {name}` draws them."
    ]
    lines += ["", "## Not measured", "", f"From `{name}-skipped.csv`, grouped by reason.", "", *not_measured(run)]
    return "\n".join(lines) + "\n"


def _environment(run: Run, shapes: list[str], copy: bool = False) -> list[str]:
    """The summary's lines on the environment and the runs, then ``shapes`` (what was measured), then the
    clock and the matmul ceilings (``copy``: the copy ceiling instead)."""
    info = run.info
    ceil = info.get("ceilings", {})
    n = ceil.get("matmul_size", "?")
    if copy:

        def of_run(r):
            return f"copy {_copy_text(r.get('ceilings', {}))}"

        last = [
            f"- Copy ceiling{' (of the last part)' if len(run.runs) > 1 else ''}: `dst.copy_(src)` of "
            f"{ceil.get('copy_bytes', 0) / 2**30:.3g} GiB of bf16, {_copy_text(ceil)} read plus written."
        ]
    else:

        def of_run(r):
            return f"bf16 matmul {_num(r.get('ceilings', {}).get('bf16_matmul_tflops', math.nan))} TFLOP/s"

        # Runs recorded before fp16 matmuls were timed have bf16's and fp32's alone.
        fp16 = f"fp16 {_num(ceil['fp16_matmul_tflops'])} TFLOP/s, " if "fp16_matmul_tflops" in ceil else ""
        last = [
            f"- Matmul ceilings ({n}³{', of the last part' if len(run.runs) > 1 else ''}): "
            f"bf16 {_num(ceil.get('bf16_matmul_tflops', math.nan))} TFLOP/s, {fp16}"
            f"fp32 without TF32 {_num(ceil.get('fp32_matmul_tflops', math.nan))} TFLOP/s."
        ]
    return [
        f"- Environment: commit `{info.get('commit', '?')}`, torch {info.get('torch', '?')}, "
        f"triton {info.get('triton') or '—'}, numba-cuda {info.get('numba_cuda') or '—'}.",
        f"- Wall time {sum(r.get('wall_s', 0) for r in run.runs):.0f} s, from:",
        *(
            f"  - `{r.get('command', '?')}`, started {r.get('started', '?')}, {r.get('wall_s', '?')} s, {of_run(r)}"
            for r in run.runs
        ),
        *shapes,
        f"- Timing: {info.get('timing', '?')}. Peak memory: the most one call allocates beyond what was live "
        "before it (its outputs included); not measured on the CPU.",
        *last,
    ]


def _copy_text(ceilings: dict) -> str:
    tbps = ceilings.get("copy_tbps")
    return f"{tbps:.3g} TB/s" if tbps else "? TB/s"


def not_measured(run: Run) -> list[str]:
    counts = Counter((i["provider"], i["status"], i["reason"]) for i in run.issues)
    rows = [[p, status, reason, str(n)] for (p, status, reason), n in sorted(counts.items())]
    return _table(["provider", "status", "reason", "shapes"], rows) if rows else ["Nothing: every planned shape ran."]


def markdown(run: Run, name: str, plots: list[Path]) -> str:
    if run.varlen:
        return _varlen_markdown(run, name, plots)
    if run.decode:
        return _decode_markdown(run, name, plots)
    info, emulated = run.info, run.emulated
    gpu = info.get("gpu", run.results[0]["gpu"])
    modes = run.modes()
    title = " and ".join(MODE_NAMES[m] for m in modes)
    lines = [f"# fa2 {title} benchmark: {'EMULATED on the CPU' if emulated else gpu}", ""]
    if emulated:
        lines += [
            "> **EMULATED.** No GPU: fa2-pytorch and SDPA math on the CPU, fa2-triton in Triton's interpreter",
            "> and fa2-numba-cuda in numba's CUDA simulator, on tiny shapes. These times show that the",
            "> harness and the kernels run and agree with the reference; they say nothing about GPU speed.",
            "",
        ]
    shapes = (
        "B = 1, H = 2 unless --heads (emulated)"
        if emulated
        else "16k tokens (B = 16384 / N), hidden 2048 (H = 2048 / D) unless --heads, as in the FlashAttention-2 paper"
    )
    lines += [
        *_environment(
            run,
            [
                f"- Shapes: {shapes}; inputs (B, H, N, D) contiguous, standard normal. "
                "FLOPs = 4·B·H·D·pairs: N² full, N²/2 causal, with a sliding window exactly the visible (query, key) "
                "pairs"
                + ("; the backward (timed alone, after one forward) 2.5 times that." if "bwd" in modes else "."),
            ],
        ),
        "- Correctness: before timing, each provider's O and L on each shape are checked against "
        f"`fa2.reference` with the same mask, window and softcap, on {SAMPLE_ROWS} sampled query rows of the first "
        "and last batch entries and heads (the rule of `shared_tests/checks.py`); a provider that fails is not "
        "timed. sdpa-math's op returns the attention weights, not L, and fa2.scaled_dot_product_attention "
        "(`--fa2-entry sdpa`) O alone: their check covers O only."
        + (
            " The backward's dq is checked on the same rows (the rule of `shared_tests/test_gradients.py`), "
            "dk and dv for NaN and inf."
            if "bwd" in modes
            else ""
        ),
    ]
    for mode in modes:
        sub, which = run.of_mode(mode), "" if mode == "fwd" else f" ({MODE_NAMES[mode]})"
        lines += ["", f"## fa2 against {' and '.join(BASELINES[emulated])}{which}", "", *_ratio_tables(sub)]
        options = option_tables(sub)
        lines += ["", f"## Options against none{which}", "", *options] if options else []
        lines += ["", f"## TFLOP/s{which}", *value_tables(sub, "tflops", _num)]
        if not emulated:
            lines += [
                "",
                f"## Peak memory per call (GB){which}",
                *value_tables(sub, "peak_mem_gb", lambda x: f"{x:.3g}"),
            ]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or [
        f"None drawn (no matplotlib here): `python -m fa2.bench --report-only --name {name}` draws them."
    ]
    lines += ["", "## Not measured", "", f"From `{name}-skipped.csv`, grouped by reason.", "", *not_measured(run)]
    return "\n".join(lines) + "\n"


def _decode_point(r: dict) -> tuple:
    """A decode row's point, its layout aside: (dtype, D, heads, heads_k, query tokens, batch, cached keys)."""
    return r["dtype"], r["head_dim"], r["heads"], r["heads_k"], r["seqlen_q"], r["batch"], r["seqlen"]


def layout_text(page_size: int) -> str:
    return f"paged {page_size}" if page_size else "contiguous"


def point_text(point: tuple) -> str:
    """ "q1 B8 K32k": query tokens, batch, cached keys."""
    return f"q{point[4]} B{point[5]} K{seqlen_label(point[6])}"


def _decode_rows(run: Run) -> list[dict]:
    """The decode rows in the sweep's order of points, then provider, then layout."""
    points = list(dict.fromkeys(_decode_point(r) for r in run.results if r["seqlen_q"]))
    order = list(dict.fromkeys([*DECODE_PROVIDERS, *(r["provider"] for r in run.results)]))
    return sorted(
        (r for r in run.results if r["seqlen_q"]),
        key=lambda r: (points.index(_decode_point(r)), order.index(r["provider"]), r["page_size"]),
    )


def decode_ratios(run: Run) -> list[dict]:
    """Per decode row: its fraction of the copy ceiling ("copy", of the run that measured it), and where
    measured (None otherwise) each SDPA entry's time over its time (contiguous rows; above 1: faster than
    SDPA), its rate over the same provider's on the contiguous cache ("paged", paged rows), and its rate over
    fa2-triton's on the same layout ("fa2-triton", the other fa2 backends). Rates are the inverse times: one
    point's layouts read the same bytes."""
    ms = {(r["provider"], _decode_point(r), r["page_size"]): r["ms"] for r in run.results if r["seqlen_q"]}
    out = []

    def over(key: tuple, mine: float) -> float | None:
        return ms[key] / mine if key in ms else None

    for r in _decode_rows(run):
        point, page, mine = _decode_point(r), r["page_size"], r["ms"]
        copy = run.ceilings_of([r]).get("copy_tbps")
        ratios = {b: over((b, point, 0), mine) if not page and r["provider"] != b else None for b in DECODE_BASELINES}
        ratios["copy"] = r["tbps"] / copy if copy and r["tbps"] else None
        ratios["paged"] = over((r["provider"], point, 0), mine) if page else None
        fa2 = r["provider"] in FA2_PROVIDERS and r["provider"] != "fa2-triton"
        ratios["fa2-triton"] = over(("fa2-triton", point, page), mine) if fa2 else None
        out.append({"row": r, **ratios})
    return out


def decode_tables(run: Run) -> list[str]:
    """Issue 22's targets per fa2 backend (the least ratio over the rows it applies to, and how many), the
    time of every provider and layout per point, then every measurement with its ratios."""
    ratios_ = decode_ratios(run)
    fa2s = [p for p in FA2_PROVIDERS if any(x["row"]["provider"] == p for x in ratios_)]
    pages = sorted({x["row"]["page_size"] for x in ratios_ if x["row"]["page_size"]})

    def least(xs):
        return f"{_ratio(min(xs))} ({len(xs)})" if xs else "—"

    summary = []
    for fa2 in fa2s:
        mine = [x for x in ratios_ if x["row"]["provider"] == fa2]
        cells = [least([x[b] for x in mine if x[b]]) for b in DECODE_BASELINES]
        cells.append(
            least(
                [
                    x["copy"]
                    for x in mine
                    if x["copy"] and not x["row"]["page_size"] and x["row"]["seqlen"] >= DECODE_COPY_FROM
                ]
            )
        )
        cells += [least([x["paged"] for x in mine if x["paged"] and x["row"]["page_size"] == p]) for p in pages]
        cells.append(least([x["fa2-triton"] for x in mine if x["fa2-triton"]]))
        summary.append([fa2, *cells])
    t = DECODE_TARGETS
    header = [
        "fa2 backend",
        *(f"{b} time / its (target {t[b]:g})" for b in DECODE_BASELINES),
        f"of the copy ceiling, from {seqlen_label(DECODE_COPY_FROM)} keys, contiguous (target {t['copy']:g})",
        *(f"paged {p} / contiguous rate (target {t['paged']:g})" for p in pages),
        f"rate / fa2-triton's (target {t['fa2-triton']:g}, fa2-numba-cuda)",
    ]
    out = [
        _caption(
            run,
            "Issue 22's ratios per fa2 backend: the least over the rows each applies to (how many); "
            "SDPA's against the contiguous cache, the rates in K/V bytes read per second.",
        ),
        "",
    ]
    out += _table(header, summary) if summary else ["No decode row measured for an fa2 backend."]

    points = list(dict.fromkeys(_decode_point(x["row"]) for x in ratios_))
    ms = {(x["row"]["provider"], x["row"]["page_size"], _decode_point(x["row"])): x["row"]["ms"] for x in ratios_}
    lines = list(dict.fromkeys((x["row"]["provider"], x["row"]["page_size"]) for x in ratios_))
    lines.sort(key=lambda pl: (list(DECODE_PROVIDERS).index(pl[0]) if pl[0] in DECODE_PROVIDERS else 99, pl[1]))
    rows = [[p, layout_text(page), *(_us(ms.get((p, page, pt))) for pt in points)] for p, page in lines]
    out += [
        "",
        _caption(run, "Time per call (µs); columns: query tokens, batch, cached keys."),
        "",
        *_table(["provider", "cache", *map(point_text, points)], rows),
    ]

    rows = []
    for x in ratios_:
        r = x["row"]
        rows.append(
            [
                r["provider"],
                layout_text(r["page_size"]),
                r["dtype"],
                str(r["head_dim"]),
                f"{r['heads']}/{r['heads_k']}",
                str(r["seqlen_q"]),
                str(r["batch"]),
                seqlen_label(r["seqlen"]),
                _us(r["ms"]),
                f"{r['tbps']:.3g}" if r["tbps"] else "—",
                *("—" if x[c] is None else _ratio(x[c]) for c in ("copy", *DECODE_BASELINES, "paged", "fa2-triton")),
            ]
        )
    out += [
        "",
        _caption(run, "Every measurement: K/V TB/s = 2·B·H_k·K·D·(bytes per element) / time; the ratios as above."),
        "",
        *_table(
            [
                "provider",
                "cache",
                "dtype",
                "D",
                "heads",
                "q",
                "B",
                "K",
                "µs",
                "K/V TB/s",
                "of copy",
                *(f"{b} / this" for b in DECODE_BASELINES),
                "rate / contiguous",
                "rate / fa2-triton",
            ],
            rows,
        ),
    ]
    return out


def _us(ms: float | None) -> str:
    if ms is None:
        return "—"
    us = ms * 1e3
    return f"{us:.0f}" if us >= 100 else f"{us:.3g}"


def _decode_markdown(run: Run, name: str, plots: list[Path]) -> str:
    info, emulated = run.info, run.emulated
    gpu = info.get("gpu", run.results[0]["gpu"])
    lines = [f"# fa2 KV-cache decode benchmark: {'EMULATED on the CPU' if emulated else gpu}", ""]
    if emulated:
        lines += [
            "> **EMULATED.** No GPU: fa2-pytorch and SDPA on the CPU, fa2-triton in Triton's interpreter and",
            "> fa2-numba-cuda in numba's CUDA simulator, on tiny caches. These times show that the harness and",
            "> the kernels run and agree with the reference; they say nothing about GPU speed.",
            "",
        ]
    sweeps = {json.dumps(r["decode"], sort_keys=True): r["decode"] for r in run.runs if r.get("decode")}
    described = [
        f"{', '.join(map(str, d['queries']))} query tokens at (batch, cached keys) "
        f"{', '.join(f'({b}, {seqlen_label(k)})' for b, k in d['points'])}, the cache contiguous and in pages "
        f"of {', '.join(map(str, d['page_sizes'])) or 'none'}"
        for d in sweeps.values()
    ]
    heads = sorted({f"{r['heads']} query heads / {r['heads_k']} key-value heads" for r in run.results})
    shapes = [
        f"- Shapes: {'; '.join(described) or 'see the tables'}; {', '.join(heads)}; every query sees every cached "
        "key (no mask), cache_seqlens = the cached keys for every row, the cache's capacity the cached keys (a "
        "paged cache: whole pages).",
        "- Layouts (the real caches' storage): q a transposed view (batch, heads, q, D) of (batch, q, heads, D); "
        "a contiguous cache transposed views (batch, heads_k, K, D) of flash-attn's (batch, K, heads_k, D); a "
        "paged one views (pages, heads_k, page, D) of (pages, page, heads_k, D), batch · ⌈K / page⌉ pages, the "
        "block table a random permutation of them (as flash-attn's tests build it), holding the same keys.",
        "- Providers: fa2's backends through `fa2.kvcache_attention(q, k_cache, v_cache, cache_seqlens, "
        "block_table=..., num_splits=0, backend=...)` on the cache as stored; sdpa, "
        "`F.scaled_dot_product_attention(q, k, v, enable_gqa=True)` (the dispatcher's pick), and sdpa-flash, the "
        "same under `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`, both on contiguous (batch, heads, K, D) copies "
        "made before timing; flex (where run), compiled FlexAttention on the same copies.",
        "- K/V bytes read per second: 2·B·H_k·K·D·(bytes per element) over the time; the copy ceiling counts "
        "the bytes read plus written.",
    ]
    lines += [
        *_environment(run, shapes, copy=True),
        "- Correctness: before timing, each provider's O (and L where it returns one; SDPA's entries do not) is "
        "checked against `fa2.reference` (fp64, over the whole cache) on every query row of the first and last "
        "batch entries and heads (the rule of `shared_tests/checks.py`), each layout against the same reference; "
        "a provider that fails is not timed. The layouts of a point are timed in the same rounds.",
    ]
    lines += ["", "## Against issue 22's targets", "", *decode_tables(run)]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or [
        f"None drawn (no matplotlib here): `python -m fa2.bench --report-only --name {name}` draws them."
    ]
    lines += ["", "## Not measured", "", f"From `{name}-skipped.csv`, grouped by reason.", "", *not_measured(run)]
    return "\n".join(lines) + "\n"
