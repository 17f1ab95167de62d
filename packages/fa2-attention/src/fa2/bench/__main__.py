"""``python -m fa2.bench``: the side-by-side forward (and backward) benchmark (see fa2/bench/__init__.py)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from fa2.bench import ladder, report, sweep
from fa2.bench.output import default_name, default_out
from fa2.bench.providers import (
    DECODE_DEFAULT_PROVIDERS,
    DECODE_PROVIDERS,
    DTYPES,
    FA2_ENTRIES,
    PROVIDERS,
    VARLEN_PROVIDERS,
)

# Without a GPU the kernels run emulated, as in nox's sessions. Triton and numba read these when imported,
# and importing fa2 may import Triton, so they must be set before the interpreter starts.
EMULATION = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"}


def _list(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def _choices(valid):
    def parse(text):
        items = _list(str)(text)
        unknown = [x for x in items if x not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(valid)}")
        return items

    return parse


def _window(text: str) -> int:
    """--window's entries: "none" (-1) or W >= 0."""
    if text in ("none", "-1"):
        return -1
    try:
        w = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a window is an int >= 0 or none, got {text!r}") from None
    if w < 0:
        raise argparse.ArgumentTypeError(f"a window is an int >= 0 or none, got {w}")
    return w


def _softcap(text: str) -> float:
    try:
        c = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a softcap is a number >= 0 (0: none), got {text!r}") from None
    if not c >= 0 or c == float("inf"):
        raise argparse.ArgumentTypeError(f"a softcap is a finite number >= 0 (0: none), got {text!r}")
    return c


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _point(text: str) -> tuple[int, int]:
    """--decode-points' entries: BxK, batch B and K cached keys."""
    try:
        batch, keys = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a decode point is BATCHxKEYS, e.g. 8x32768, got {text!r}") from None
    if batch < 1 or keys < 1:
        raise argparse.ArgumentTypeError(f"a decode point has batch and keys >= 1, got {text!r}")
    return batch, keys


def _page_sizes(text: str) -> tuple[int, ...]:
    """--page-sizes: comma-separated sizes >= 1, or none."""
    return () if text == "none" else _list(_positive)(text)


def _defaults(table: dict, column: int, lead: str = "default") -> str:
    """A DEFAULTS column as help text: the GPU's and the emulated run's values."""

    def text(values):
        return ",".join(map(str, values))

    return f"{lead} on a GPU {text(table[False, False][column])}, emulated {text(table[True, False][column])}"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one; those that depend on the machine are in the help text."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fa2.bench",
        formatter_class=_Help,
        description="fa2's forward and backward against SDPA (flash, cuDNN, memory-efficient, math) and "
        "FlexAttention, every provider checked against the fp64 reference before it is timed. By default both "
        "modes: on a GPU the FlashAttention-2 paper's sweep (16k tokens, hidden 2048), without one an emulated "
        "run on tiny shapes (TRITON_INTERPRET=1, NUMBA_ENABLE_CUDASIM=1). A run that measures nothing keeps the "
        "earlier files.",
    )
    parser.add_argument(
        "--providers",
        type=_choices(list(dict.fromkeys([*PROVIDERS, *VARLEN_PROVIDERS, *DECODE_PROVIDERS]))),
        help=f"comma-separated; default {','.join(PROVIDERS)}, with --varlen "
        f"{','.join(VARLEN_PROVIDERS)}, with --decode {','.join(DECODE_DEFAULT_PROVIDERS)} (flex "
        "too if named: a compile per shape)",
    )
    parser.add_argument(
        "--seqlens",
        type=_list(int),
        help=f"comma-separated N; {_defaults(sweep.DEFAULTS, 0)}; "
        "with --varlen the N of the fa2 backends' dense reference shapes (B = tokens / N), "
        f"{_defaults(sweep.VARLEN_DEFAULTS, 4, 'default')}",
    )
    parser.add_argument("--head-dims", type=_list(int), help=f"comma-separated D; {_defaults(sweep.DEFAULTS, 1)}")
    parser.add_argument(
        "--causal", type=_choices(["no", "yes"]), help="no, yes or both; default both, yes alone with a --window"
    )
    parser.add_argument(
        "--dtypes",
        type=_choices(list(DTYPES)),
        help=f"comma-separated, of {','.join(DTYPES)}; {_defaults(sweep.DEFAULTS, 2)}",
    )
    parser.add_argument(
        "--modes",
        type=_choices(list(sweep.MODES)),
        default=",".join(sweep.MODES),
        help="fwd: the forward; bwd: the backward alone (fa2's backends, sdpa-flash, -cudnn, "
        "-math), on fewer shapes unless --seqlens or --dtypes are given: "
        f"{_defaults(sweep.BWD_DEFAULTS, 0, 'N')}; {_defaults(sweep.BWD_DEFAULTS, 1, 'dtypes')}",
    )
    parser.add_argument(
        "--heads",
        type=_positive,
        help="query heads of every shape; default on a GPU 2048 / D (hidden 2048), emulated 2",
    )
    parser.add_argument(
        "--group",
        type=_list(_positive),
        help="comma-separated query heads per key/value head: grouped-query attention, k and v "
        "with heads / GROUP heads, each GROUP a point of the sweep (1,4: the dense heads beside "
        "GQA in one process); the files are named <name>-gqa<GROUP> for those above 1. Default 1; "
        "with --decode one GROUP, default on a GPU 4 (32 / 8 heads), emulated 2",
    )
    parser.add_argument(
        "--window",
        type=_list(_window),
        default="none",
        help="comma-separated sliding windows W (or none) of the causal shapes: fa2's "
        "window=(W, 0) with causal=True, each query sees its W + 1 most recent keys; TFLOP/s "
        "counted over the visible (query, key) pairs exactly. none,4096: plain causal beside "
        "the window. SDPA's backends have no window and are skipped there. Files "
        "<name>-w<W>",
    )
    parser.add_argument(
        "--softcap",
        type=_list(_softcap),
        default="0",
        help="comma-separated logit softcaps C (0: none): scores become C·tanh(scores / C). "
        "SDPA's backends have none and are skipped there. Files <name>-cap<C>",
    )
    parser.add_argument(
        "--fa2-entry",
        choices=FA2_ENTRIES,
        help="how the fa2 providers are called: attention, fa2.attention (O and L checked, "
        "every option); sdpa, fa2.scaled_dot_product_attention(is_causal=, enable_gqa=True), "
        "the drop-in for F.scaled_dot_product_attention (O checked; no window or softcap: those "
        "shapes are skipped). "
        "Default sdpa with a --group above 1 and no window or softcap, attention otherwise; "
        "the other one adds -<entry> to the file names",
    )
    parser.add_argument(
        "--varlen",
        action="store_true",
        help="packed batches instead of the dense sweep: per (mode, dtype, D, causal) one batch "
        "of sequences of different lengths one after the other, "
        f"{_varlen_help(False)} on a GPU, {_varlen_help(True)} emulated; fa2.varlen_attention "
        "against SDPA on nested jagged tensors (sdpa-njt) and FlexAttention with a document mask, "
        "TFLOP/s over the real (query, key) pairs, beside each fa2 backend's dense TFLOP/s at "
        "--seqlens. Files <name>-varlen",
    )
    parser.add_argument(
        "--varlen-seed",
        type=int,
        default=0,
        help="the seed of --varlen's lengths (random.Random); files <name>-varlen-seed<S> where not 0",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="KV-cache decoding (one or a few new query tokens against the cached keys) instead of "
        f"the dense sweep, forward only (--modes is not read): {_decode_help(False)} on a GPU; "
        f"{_decode_help(True)} emulated. Each fa2 backend "
        "through fa2.kvcache_attention on the contiguous and each paged cache, against "
        "F.scaled_dot_product_attention(enable_gqa=True) (sdpa, and sdpa-flash forced to its flash "
        "backend) on contiguous copies; µs and K/V bytes read per second, against a device copy. "
        "Files <name>-decode",
    )
    parser.add_argument(
        "--decode-points",
        type=_list(_point),
        help="--decode's comma-separated BATCHxKEYS (batch, cached keys); "
        f"{_decode_defaults(lambda d: ','.join(f'{b}x{k}' for b, k in d.points))}",
    )
    parser.add_argument(
        "--decode-queries",
        type=_list(_positive),
        help="--decode's comma-separated query tokens per sequence; "
        f"{_decode_defaults(lambda d: ','.join(map(str, d.queries)))}",
    )
    parser.add_argument(
        "--page-sizes",
        type=_page_sizes,
        help="--decode's paged caches: comma-separated page sizes, or none; "
        f"{_decode_defaults(lambda d: ','.join(map(str, d.page_sizes)))}",
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="each backend's optimisation ladder instead of the sweep (docs/ladder.md): every rung of "
        "fa2_<backend>.ladder, forward and backward, checked then timed, with the compiler's registers, "
        "spills and shared memory; on a GPU N 4096, B 4, H 2048 / D, D 64,128, causal and not, bf16; "
        "emulated N 64, D 16,32, fp16 (timings that need a GPU). Files <name>-ladder (one CSV, a plot "
        "per backend; a run keeps the rows of backends it does not measure)",
    )
    parser.add_argument(
        "--backends",
        type=_list(str),
        help="--ladder's comma-separated fa2 backends (pytorch, triton, numba-cuda); default every installed "
        "one whose package has a ladder module",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few shapes in one dtype (GPU: bf16, N 1k and 4k; with --varlen D 128 alone), written as <name>-quick",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out(),
        help="folder of the results (a relative path is taken from the current directory)",
    )
    parser.add_argument("--name", help="file stem; default from the GPU's name (h200), or cpu-emulated")
    parser.add_argument(
        "--math-max-seqlen",
        type=int,
        default=sweep.MATH_MAX_SEQLEN,
        help="largest N for sdpa-math, which materialises the scores",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the earlier rows of <name>.csv, replacing those measured again (a sweep in parts)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="measure nothing: redraw <name>.md and the plots from <name>.csv"
    )
    args = parser.parse_args(argv)
    decode_only = {
        "--decode-points": args.decode_points,
        "--decode-queries": args.decode_queries,
        "--page-sizes": args.page_sizes,
    }
    if not args.decode and any(value is not None for value in decode_only.values()):
        parser.error(f"{', '.join(k for k, v in decode_only.items() if v is not None)}: only with --decode")
    if args.decode and (
        args.varlen
        or args.window != (-1,)
        or args.softcap != (0.0,)
        or args.fa2_entry == "sdpa"
        or args.causal not in (None, ("no",))
        or (args.group and len(args.group) > 1)
    ):
        parser.error(
            "--decode times plain attention over the whole cache through fa2.kvcache_attention: no "
            "--varlen, --window, --softcap, --causal yes, --fa2-entry sdpa, and one --group"
        )
    if args.backends is not None and not args.ladder:
        parser.error("--backends: only with --ladder (the sweep's are --providers)")
    if args.ladder and (args.decode or args.varlen or args.quick or args.report_only or args.append):
        parser.error("--ladder runs on its own shapes: no --decode, --varlen, --quick, --report-only or --append")
    if not args.decode:
        args.group = args.group or (1,)
    if args.varlen and (
        args.group != (1,) or args.window != (-1,) or args.softcap != (0.0,) or args.fa2_entry == "sdpa"
    ):
        parser.error(
            "--varlen times plain attention through fa2.varlen_attention (its dense reference through "
            "fa2.attention): no --group, --window, --softcap or --fa2-entry sdpa"
        )
    if args.causal is None:
        args.causal = ("no",) if args.decode else ("yes",) if any(w >= 0 for w in args.window) else ("no", "yes")
    args.default_entry = default_entry(args.group or (1,), args.window, args.softcap)
    args.fa2_entry = args.fa2_entry or args.default_entry
    return args


def _varlen_help(emulated: bool) -> str:
    """--varlen's batch and shapes, for the help text."""
    tokens, (low, high), head_dims, dtypes, _ = sweep.VARLEN_DEFAULTS[emulated, False]
    return (
        f"{tokens} tokens in lengths drawn from {low} to {high}, D {','.join(map(str, head_dims))}, {','.join(dtypes)}"
    )


def _decode_help(emulated: bool) -> str:
    """--decode's sweep, for the help text."""
    d, head_dims, dtypes = sweep.DECODE_DEFAULTS[emulated, False]
    points = ", ".join(f"({b}, {k})" for b, k in d.points)
    return (
        f"{','.join(map(str, d.queries))} query tokens at (batch, cached keys) {points}, "
        f"H {d.heads}/{d.heads // d.group}, D {','.join(map(str, head_dims))}, {','.join(dtypes)}, caches "
        f"contiguous and paged ({','.join(map(str, d.page_sizes))})"
    )


def _decode_defaults(field) -> str:
    """A --decode option's defaults on a GPU and emulated, for the help text."""
    return (
        f"default on a GPU {field(sweep.DECODE_DEFAULTS[False, False][0])}, "
        f"emulated {field(sweep.DECODE_DEFAULTS[True, False][0])}"
    )


def default_entry(groups, windows, softcaps) -> str:
    """--fa2-entry's default: sdpa (fa2.scaled_dot_product_attention) for GQA without a window or softcap, else
    attention."""
    plain = all(w < 0 for w in windows) and not any(softcaps)
    return "sdpa" if plain and any(g > 1 for g in groups) else "attention"


def options_suffix(args: argparse.Namespace) -> str:
    """What the file names add for the options: -decode, -varlen (-seed<S>), -quick, -gqa<G> (with --decode a
    --group given), -h<H> (--heads), -w<W>,
    -cap<C> and the entry where it is not the default; several values of one option joined by +: -gqa2+4."""

    def part(prefix: str, values) -> str:
        return f"-{prefix}{'+'.join(values)}" if values else ""

    return "".join(
        [
            "-decode" if args.decode else "",
            "-varlen" if args.varlen else "",
            f"-seed{args.varlen_seed}" if args.varlen and args.varlen_seed else "",
            "-quick" if args.quick else "",
            part("gqa", [str(g) for g in args.group or () if g > 1]),
            f"-h{args.heads}" if args.heads else "",
            part("w", [str(w) for w in args.window if w >= 0]),
            part("cap", [f"{c:g}" for c in args.softcap if c]),
            f"-{args.fa2_entry}" if args.fa2_entry != args.default_entry else "",
        ]
    )


def progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="run", dynamic_ncols=True, mininterval=1.0)


class _PlainProgress:
    """tqdm's few methods used here, as a line every 10%, where tqdm is not installed."""

    def __init__(self, total: int):
        self.total, self.n = total, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.total and self.n * 10 // self.total != (self.n - n) * 10 // self.total:
            print(f"{self.n}/{self.total}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emulated = device.type != "cuda"
    unset = {key: value for key, value in EMULATION.items() if key not in os.environ}
    if emulated and unset and not args.report_only:
        print(f"fa2.bench: no GPU; running again with {' '.join(f'{k}={v}' for k, v in unset.items())}", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "fa2.bench", *argv], {**os.environ, **unset})
    if args.ladder:
        _ladder(args, argv, device)
        return
    seqlens, head_dims, dtypes = sweep.DEFAULTS[emulated, args.quick]
    bwd_seqlens, bwd_dtypes = sweep.BWD_DEFAULTS[emulated, args.quick]
    providers, packing, decode, modes = tuple(PROVIDERS), None, None, args.modes
    if args.varlen:
        tokens, (low, high), head_dims, dtypes, seqlens = sweep.VARLEN_DEFAULTS[emulated, args.quick]
        bwd_seqlens, bwd_dtypes = seqlens, dtypes
        providers, packing = tuple(VARLEN_PROVIDERS), sweep.Packing(tokens, low, high, args.varlen_seed)
    if args.decode:
        decode, head_dims, dtypes = sweep.DECODE_DEFAULTS[emulated, args.quick]
        decode = sweep.Decode(
            args.decode_points or decode.points,
            args.decode_queries or decode.queries,
            decode.page_sizes if args.page_sizes is None else args.page_sizes,
            decode.heads,
            args.group[0] if args.group else decode.group,
        )
        seqlens = tuple(dict.fromkeys(k for _, k in decode.points))
        providers, modes = DECODE_DEFAULT_PROVIDERS, ("fwd",)
    name = args.name or default_name(device) + options_suffix(args)
    cfg = sweep.Config(
        providers=args.providers or providers,
        seqlens=args.seqlens or seqlens,
        head_dims=args.head_dims or head_dims,
        causals=tuple(c == "yes" for c in args.causal),
        dtypes=args.dtypes or dtypes,
        device=device,
        out_dir=args.out,
        name=name,
        math_max_seqlen=args.math_max_seqlen,
        append=args.append,
        modes=modes,
        groups=args.group or (1,),
        windows=args.window,
        softcaps=args.softcap,
        heads=args.heads,
        fa2_entry=args.fa2_entry,
        bwd_seqlens=args.seqlens or bwd_seqlens,
        bwd_dtypes=args.dtypes or bwd_dtypes,
        varlen=packing,
        decode=decode,
        command=shlex.join(["python", "-m", "fa2.bench", *argv]),
    )
    if not args.report_only:
        kind = "EMULATED on the CPU (TRITON_INTERPRET=1, NUMBA_ENABLE_CUDASIM=1)" if emulated else str(device)
        print(
            f"fa2.bench: {len(cfg.shapes())} shapes x {len(cfg.providers)} providers, {kind}; "
            f"writing {cfg.path('.csv')}",
            flush=True,
        )
        if decode:
            print(
                f"fa2.bench: decode, {','.join(map(str, decode.queries))} query tokens at (batch, cached keys) "
                f"{', '.join(f'({b}, {k})' for b, k in decode.points)}, caches contiguous and paged in pages of "
                f"{', '.join(map(str, decode.page_sizes)) or 'none'}",
                flush=True,
            )
        if packing:
            lengths = packing.lengths()
            print(
                f"fa2.bench: packed batch of {packing.tokens} tokens, {len(lengths)} sequences of lengths "
                f"{', '.join(map(str, lengths))} (drawn from {packing.low} to {packing.high}, seed {packing.seed}; "
                "the last what is left)",
                flush=True,
            )
        sweep.run(cfg, progress_bar)
    run = report.load(cfg.out_dir, cfg.name)
    try:
        from fa2.bench.plot import plot

        plots = plot(run, cfg.out_dir, cfg.name)
    except ImportError as e:
        print(
            f"no plots ({e}); draw them where matplotlib is installed: "
            f"python -m fa2.bench --report-only --name {cfg.name}",
            file=sys.stderr,
        )
        plots = []
    cfg.path(".md").write_text(report.markdown(run, cfg.name, plots))
    print("\n".join(report.ratio_tables(run)))
    written = [cfg.path(".md"), *plots]
    if not args.report_only:
        written = [cfg.path(".csv"), cfg.path("-skipped.csv"), cfg.path("-run.json"), *written]
    print(f"\nwrote {', '.join(map(str, written))}")


def _ladder(args: argparse.Namespace, argv: list[str], device: torch.device) -> None:
    """--ladder: fa2.bench.ladder's run, with its files under --out."""
    backends = list(args.backends or ladder.with_ladder())
    if not backends:
        sys.exit("fa2.bench --ladder: no installed fa2 backend has a ladder module")
    if device.type != "cuda":
        print(f"fa2.bench --ladder: {ladder.EMULATED_NOTE}", flush=True)
    name = args.name or default_name(device)
    print(f"fa2.bench --ladder: {', '.join(backends)} on {device}; writing {args.out / name}-ladder.csv", flush=True)
    csv_path, plots = ladder.run(
        backends,
        device,
        args.out,
        name,
        command=shlex.join(["python", "-m", "fa2.bench", *argv]),
        progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
    )
    if device.type != "cuda":
        print(f"fa2.bench --ladder: {ladder.EMULATED_NOTE}")
    print(f"\nwrote {', '.join(map(str, [csv_path, *plots]))}")


if __name__ == "__main__":
    main()
