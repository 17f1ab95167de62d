"""TFLOP/s against N, one figure per mode and head_dim (``<name>-fwd-D64.png``, ``<name>-bwd-D64.png``): a
panel per (dtype, causal), a line per provider (one per variant, a marker each, where the run has several:
GQA, window, softcap), the matmul ceiling of that precision, as measured by the run (or the part of an
--append sequence) that measured the panel, as a horizontal line. A --varlen run: one figure per mode
(``<name>-fwd.png``), a panel per (dtype, D), bars of TFLOP/s per provider for not causal and causal: the
packed batch, and hatched each fa2 backend's dense reference shapes; a log scale when emulated."""

from __future__ import annotations

from pathlib import Path

from fa2.bench.providers import PROVIDERS, VARLEN_PROVIDERS
from fa2.bench.report import MODE_NAMES, Run, groups, seqlen_label, variant, variant_text

# Only bf16 and fp32 matmuls are measured; fp16 panels draw the bf16 ceiling (Hopper's fp16 and bf16
# tensor-core peaks are equal).
CEILING_OF = {"bf16": "bf16", "fp16": "bf16", "fp32": "fp32"}
# A run with several variants (GQA, windows, softcaps): one marker per variant, the provider's colour.
MARKERS = ("o", "s", "^", "D", "v", "x")


def plot(run: Run, out_dir: Path, name: str) -> list[Path]:
    if run.varlen:
        return [_plot_varlen(run.of_mode(mode), mode, out_dir, name) for mode in run.modes()]
    return [path for mode in run.modes() for path in _plot_mode(run.of_mode(mode), mode, out_dir, name)]


def _plot_varlen(run: Run, mode: str, out_dir: Path, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(dict.fromkeys([*VARLEN_PROVIDERS, *PROVIDERS]))
    colors = dict(zip(order, plt.get_cmap("tab10").colors))
    gpu = run.info.get("gpu", run.results[0]["gpu"])
    title = f"fa2 packed batches ({MODE_NAMES[mode]}) on {gpu}: TFLOP/s over the real (query, key) pairs"
    if run.emulated:
        title += "\nEMULATED: CPU, Triton interpreter, numba simulator, tiny shapes (not GPU speed)"
    panels = sorted({(r["dtype"], r["head_dim"]) for r in run.results})
    # A bar per (provider, shape kind): the packed batch, then each dense reference N.
    kinds = sorted({(order.index(r["provider"]), r["provider"], r["seqlen"] if not r["lengths"] else 0)
                    for r in run.results})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    width = 0.8 / len(kinds)
    for ax, (dtype, head_dim) in zip(axes[0], panels):
        rows = [r for r in run.results if (r["dtype"], r["head_dim"]) == (dtype, head_dim)]
        for i, (_, p, n) in enumerate(kinds):
            label = p if not n else f"{p} dense N={seqlen_label(n)}"
            for x, causal in enumerate((False, True)):
                t = [r["tflops"] for r in rows if (r["provider"], r["causal"]) == (p, causal)
                     and (r["seqlen"] == n and not r["lengths"] if n else bool(r["lengths"]))]
                if t:
                    bars = ax.bar(x + (i - (len(kinds) - 1) / 2) * width, t[0], width, color=colors[p],
                                  hatch="//" if n else None, edgecolor="white" if n else None, label=label)
                    ax.bar_label(bars, [f"{t[0]:.3g}"], fontsize=6)
                    label = None
        ceiling = run.ceilings_of(rows).get(f"{CEILING_OF[dtype]}_matmul_tflops")
        if ceiling:
            ax.axhline(ceiling, color="gray", linestyle=":", label=f"{CEILING_OF[dtype]} matmul: {ceiling:.3g} TFLOP/s")
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
    gpu = run.info.get("gpu", run.results[0]["gpu"])
    title = f"fa2 {MODE_NAMES[mode]} on {gpu}"
    if run.emulated:
        title += "\nEMULATED: CPU, Triton interpreter, numba simulator, tiny shapes (not GPU speed)"
    seqlens = sorted({r["seqlen"] for r in run.results})
    variants = sorted({variant(r) for r in run.results})
    paths = []
    for head_dim in sorted({r["head_dim"] for r in run.results}):
        dtypes = list(dict.fromkeys(g[0] for g in groups(run.results) if g[1] == head_dim))
        fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 3.8 * len(dtypes)), squeeze=False)
        for ax_row, dtype in zip(axes, dtypes):
            ceilings = run.ceilings_of([r for r in run.results if (r["dtype"], r["head_dim"]) == (dtype, head_dim)])
            ceiling = ceilings.get(f"{CEILING_OF[dtype]}_matmul_tflops")
            for ax, causal in zip(ax_row, (False, True)):
                for p in PROVIDERS:
                    for v in variants:
                        pts = sorted((r["seqlen"], r["tflops"]) for r in run.results
                                     if (r["provider"], r["dtype"], r["head_dim"], r["causal"], variant(r))
                                     == (p, dtype, head_dim, causal, v))
                        if pts:
                            label = p if len(variants) == 1 else f"{p} {variant_text(v)}"
                            ax.plot(*zip(*pts), marker=MARKERS[variants.index(v) % len(MARKERS)], color=colors[p],
                                    label=label, linestyle="-" if p.startswith("fa2-") else "--")
                if ceiling:
                    n = ceilings["matmul_size"]
                    ax.axhline(ceiling, color="gray", linestyle=":",
                               label=f"{CEILING_OF[dtype]} matmul {n}³: {ceiling:.3g} TFLOP/s")
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
