"""TFLOP/s against N, one figure per mode and head_dim (``<name>-fwd-D64.png``, ``<name>-bwd-D64.png``): a
panel per (dtype, causal), a line per provider (one per variant, a marker each, where the run has several:
GQA, window, softcap), the matmul ceiling of the panel's dtype (``matmul_ceiling``), as measured by the run (or
the part of an --append sequence) that measured the panel, as a horizontal line. A --varlen run: one figure per mode
(``<name>-fwd.png``), a panel per (dtype, D), bars of TFLOP/s per provider for not causal and causal: the
packed batch, and hatched each fa2 backend's dense reference shapes; a log scale when emulated. A --decode run:
``<name>.png``, a panel per (dtype, D, query tokens), bars of K/V bytes read per second per provider and cache
layout (paged hatched) at each (batch, cached keys), the copy ceiling as a line."""

from __future__ import annotations

from pathlib import Path

from fa2.bench.providers import DECODE_PROVIDERS, PROVIDERS, VARLEN_PROVIDERS
from fa2.bench.report import MODE_NAMES, Run, groups, layout_text, seqlen_label, variant, variant_text

# An emulated run's figures: under the title, where its times come from and what they do not say.
EMULATED_SUBTITLE = (
    "\nCPU: Triton's interpreter, numba's CUDA simulator, tiny shapes; these times say nothing about GPU speed"
)
# A run with several variants (GQA, windows, softcaps): one marker per variant, the provider's colour.
MARKERS = ("o", "s", "^", "D", "v", "x")


def _title(run: Run, what: str, then: str = "") -> str:
    """A figure's title: ``what`` on the run's GPU, or EMULATED on the CPU with EMULATED_SUBTITLE; ``then`` after."""
    if run.emulated:
        return f"{what} EMULATED on the CPU{then}{EMULATED_SUBTITLE}"
    return f"{what} on {run.info.get('gpu', run.results[0]['gpu'])}{then}"


def matmul_ceiling(ceilings: dict, dtype: str) -> tuple[str, float] | None:
    """The matmul ceiling a panel of ``dtype`` is drawn against, as (legend, TFLOP/s): the run's matmul in that
    dtype. Runs recorded before fp16 matmuls were timed have bf16's alone: their fp16 panels draw it, said so."""
    timed = "bf16" if dtype == "fp16" and "fp16_matmul_tflops" not in ceilings else dtype
    tflops = ceilings.get(f"{timed}_matmul_tflops")
    if tflops is None:
        return None
    size = f" {ceilings['matmul_size']}³" if "matmul_size" in ceilings else ""
    note = "" if timed == dtype else f" (no {dtype} matmul timed in this run)"
    return f"{timed} matmul{size}: {tflops:.3g} TFLOP/s{note}", tflops


def plot(run: Run, out_dir: Path, name: str) -> list[Path]:
    if run.varlen:
        return [_plot_varlen(run.of_mode(mode), mode, out_dir, name) for mode in run.modes()]
    if run.decode:
        return [_plot_decode(run, out_dir, name)]
    return [path for mode in run.modes() for path in _plot_mode(run.of_mode(mode), mode, out_dir, name)]


def _plot_varlen(run: Run, mode: str, out_dir: Path, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(dict.fromkeys([*VARLEN_PROVIDERS, *PROVIDERS]))
    colors = dict(zip(order, plt.get_cmap("tab10").colors))
    title = _title(run, f"fa2 packed batches ({MODE_NAMES[mode]})", ": TFLOP/s over the real (query, key) pairs")
    panels = sorted({(r["dtype"], r["head_dim"]) for r in run.results})
    # A bar per (provider, shape kind): the packed batch, then each dense reference N.
    kinds = sorted(
        {(order.index(r["provider"]), r["provider"], r["seqlen"] if not r["lengths"] else 0) for r in run.results}
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    width = 0.8 / len(kinds)
    for ax, (dtype, head_dim) in zip(axes[0], panels):
        rows = [r for r in run.results if (r["dtype"], r["head_dim"]) == (dtype, head_dim)]
        for i, (_, p, n) in enumerate(kinds):
            label = p if not n else f"{p} dense N={seqlen_label(n)}"
            for x, causal in enumerate((False, True)):
                t = [
                    r["tflops"]
                    for r in rows
                    if (r["provider"], r["causal"]) == (p, causal)
                    and (r["seqlen"] == n and not r["lengths"] if n else bool(r["lengths"]))
                ]
                if t:
                    bars = ax.bar(
                        x + (i - (len(kinds) - 1) / 2) * width,
                        t[0],
                        width,
                        color=colors[p],
                        hatch="//" if n else None,
                        edgecolor="white" if n else None,
                        label=label,
                    )
                    ax.bar_label(bars, [f"{t[0]:.3g}"], fontsize=6)
                    label = None
        ceiling = matmul_ceiling(run.ceilings_of(rows), dtype)
        if ceiling:
            ax.axhline(ceiling[1], color="gray", linestyle=":", label=ceiling[0])
        if run.emulated:
            ax.set_yscale("log")  # the interpreter and the simulator are orders of magnitude slower
        ax.set_xticks([0, 1], ["not causal", "causal"])
        ax.set_title(f"{dtype}, D = {head_dim}, H = {rows[0]['heads']}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / f"{name}-{mode}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_mode(run: Run, mode: str, out_dir: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(PROVIDERS, plt.get_cmap("tab10").colors))
    title = _title(run, f"fa2 {MODE_NAMES[mode]}")
    seqlens = sorted({r["seqlen"] for r in run.results})
    variants = sorted({variant(r) for r in run.results})
    paths = []
    for head_dim in sorted({r["head_dim"] for r in run.results}):
        dtypes = list(dict.fromkeys(g[0] for g in groups(run.results) if g[1] == head_dim))
        fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 3.8 * len(dtypes)), squeeze=False)
        for ax_row, dtype in zip(axes, dtypes):
            ceilings = run.ceilings_of([r for r in run.results if (r["dtype"], r["head_dim"]) == (dtype, head_dim)])
            ceiling = matmul_ceiling(ceilings, dtype)
            for ax, causal in zip(ax_row, (False, True)):
                for p in PROVIDERS:
                    for v in variants:
                        pts = sorted(
                            (r["seqlen"], r["tflops"])
                            for r in run.results
                            if (r["provider"], r["dtype"], r["head_dim"], r["causal"], variant(r))
                            == (p, dtype, head_dim, causal, v)
                        )
                        if pts:
                            label = p if len(variants) == 1 else f"{p} {variant_text(v)}"
                            ax.plot(
                                *zip(*pts),
                                marker=MARKERS[variants.index(v) % len(MARKERS)],
                                color=colors[p],
                                label=label,
                                linestyle="-" if p.startswith("fa2-") else "--",
                            )
                if ceiling:
                    ax.axhline(ceiling[1], color="gray", linestyle=":", label=ceiling[0])
                ax.set_title(f"{dtype}, D = {head_dim}, {'causal' if causal else 'not causal'}")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(seqlens, [seqlen_label(n) for n in seqlens])
                ax.set_xlabel("sequence length N")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / f"{name}-{mode}-D{head_dim}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_decode(run: Run, out_dir: Path, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run.results if r["seqlen_q"]]
    order = list(dict.fromkeys([*DECODE_PROVIDERS, *(r["provider"] for r in rows)]))
    colors = dict(zip(order, plt.get_cmap("tab10").colors))
    title = _title(run, "fa2 KV-cache decoding", ": K/V bytes read per second")
    panels = sorted({(r["dtype"], r["head_dim"], r["seqlen_q"]) for r in rows})
    bars = sorted({(order.index(r["provider"]), r["page_size"], r["provider"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 2.5, 4.5), squeeze=False)
    width = 0.8 / len(bars)
    for ax, (dtype, head_dim, n_q) in zip(axes[0], panels):
        mine = [r for r in rows if (r["dtype"], r["head_dim"], r["seqlen_q"]) == (dtype, head_dim, n_q)]
        points = list(dict.fromkeys((r["batch"], r["seqlen"]) for r in mine))
        for i, (_, page, p) in enumerate(bars):
            label = f"{p} {layout_text(page)}" if page else p
            for x, point in enumerate(points):
                t = [
                    r["tbps"]
                    for r in mine
                    if (r["provider"], r["page_size"], (r["batch"], r["seqlen"])) == (p, page, point) and r["tbps"]
                ]
                if t:
                    ax.bar(
                        x + (i - (len(bars) - 1) / 2) * width,
                        t[0],
                        width,
                        color=colors[p],
                        hatch="//" if page else None,
                        edgecolor="white" if page else None,
                        label=label,
                    )
                    label = None
        ceiling = run.ceilings_of(mine).get("copy_tbps")
        if ceiling:
            ax.axhline(ceiling, color="gray", linestyle=":", label=f"device copy: {ceiling:.3g} TB/s")
        if run.emulated:
            ax.set_yscale("log")  # the interpreter and the simulator are orders of magnitude slower
        ax.set_xticks(range(len(points)), [f"B{b} K{seqlen_label(k)}" for b, k in points])
        ax.set_title(
            f"{dtype}, D = {head_dim}, {n_q} query token{'s' if n_q > 1 else ''}, "
            f"H = {mine[0]['heads']}/{mine[0]['heads_k']}"
        )
        ax.set_ylabel("K/V TB/s")
        ax.grid(True, axis="y", alpha=0.3)
    # One legend for every panel, beside them: the bars reach the copy ceiling's line, a legend inside would hide them.
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
