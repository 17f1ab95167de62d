"""``python -m fa2.bench.routing``: where fa2.attention should leave the dense kernel for the KV-cache kernels
(issue 39: ``fa2.api.DECODE_MAX_SEQLEN_Q`` and ``DECODE_MIN_KEYS_PER_QUERY``). Each GPU backend's two paths
on the same tensors: ``dense``, its flash_attn_forward (what fa2.attention ran before routing), and
``routed``, its kvcache_forward through ``fa2.kvcache.dense_forward`` (what fa2.attention runs for a decode
shape), both on fa2.attention's spec, whatever the thresholds say.

    python -m fa2.bench.routing                                          # GPU: the sweep below
    python -m fa2.bench.routing --backends triton --batches 8 --seqlens-q 1,16 --seqlens-k 2048,32768

GPU defaults: seqlen_q 1, 2, 4, 8, 16, 32 × seqlen_k 128, 512, 2k, 8k, 32k × batch 1, 8; 32 query heads and 8
key/value heads, D 128, bf16, causal (bottom-right: every query sees the whole cache but the draft tokens
after it), fa2-triton and fa2-numba-cuda. Without a GPU it runs emulated (TRITON_INTERPRET=1,
NUMBA_ENABLE_CUDASIM=1) on tiny shapes: 4 / 2 heads, D 16, fp16, only to show that it runs.

Each path is checked against the fp64 reference on a sample of rows (``fa2.bench.check``) before it is
timed; times as ``python -m fa2.bench``'s (``fa2.bench.timing``: do_bench medians, the median of
GPU_ROUNDS rounds with the two paths interleaved, every other round reversed).

Files under --out (default: the checkout's docs/benchmarks), named after the GPU (``h200``):
    <name>-decode-routing.csv  one row per (backend, batch, seqlen_q, seqlen_k): dense_us, routed_us, speedup
                               (dense over routed), or why a path was not timed; and the environment
    <name>-decode-routing.md   per backend and batch, the speedup by seqlen_q (rows) and seqlen_k (columns), and
                               per seqlen_q the fewest keys per query from which routing wins at every larger
                               seqlen_k measured: the data for the two thresholds
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from pathlib import Path

import torch

from fa2 import kvcache, registry
from fa2.bench import check, sweep, timing
from fa2.bench.output import default_name, default_out
from fa2.layout import forward_any_rank
from fa2.validation import make_spec

EMULATION = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (backends, batches, seqlens_q, seqlens_k, heads, heads_k, head_dim, dtype) on a GPU and emulated.
DEFAULTS = {
    False: (("triton", "numba-cuda"), (1, 8), (1, 2, 4, 8, 16, 32), (128, 512, 2048, 8192, 32768), 32, 8, 128, "bf16"),
    True: (("triton", "numba-cuda"), (1,), (1, 4), (32, 64), 4, 2, 16, "fp16"),
}
COLUMNS = (
    "backend",
    "dtype",
    "batch",
    "heads",
    "heads_k",
    "head_dim",
    "seqlen_q",
    "seqlen_k",
    "dense_us",
    "routed_us",
    "speedup",
    "problem",
    "gpu",
    "torch",
    "triton",
    "numba_cuda",
    "commit",
)


def _list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str], emulated: bool) -> argparse.Namespace:
    backends, batches, seqlens_q, seqlens_k, heads, heads_k, head_dim, dtype = DEFAULTS[emulated]
    parser = argparse.ArgumentParser(
        prog="python -m fa2.bench.routing",
        description="Each GPU backend's dense forward against its KV-cache (split-KV) forward on decode shapes, "
        "to set fa2.api's DECODE_MAX_SEQLEN_Q and DECODE_MIN_KEYS_PER_QUERY.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backends", type=lambda t: tuple(x for x in t.split(",") if x), default=backends)
    parser.add_argument("--batches", type=_list, default=batches)
    parser.add_argument("--seqlens-q", type=_list, default=seqlens_q)
    parser.add_argument("--seqlens-k", type=_list, default=seqlens_k)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--heads-k", type=int, default=heads_k)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--dtype", choices=DTYPES, default=dtype)
    parser.add_argument("--out", type=Path, default=default_out(), help="folder of the results")
    parser.add_argument("--name", help="file stem before -decode-routing; default from the GPU's name")
    return parser.parse_args(argv)


def measure(backend: str, batch: int, seqlen_q: int, seqlen_k: int, args, device: torch.device) -> dict:
    """One row: both paths checked, then timed in interleaved rounds."""
    impl = registry.load(backend)
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(seqlen_q * seqlen_k + batch)

    def make(heads, n):
        return torch.randn(batch, heads, n, args.head_dim, device=device, dtype=dtype, generator=g)

    q, k, v = make(args.heads, seqlen_q), make(args.heads_k, seqlen_k), make(args.heads_k, seqlen_k)
    spec = make_spec(q, k, True, None)
    calls = {
        "dense": lambda: forward_any_rank(impl.flash_attn_forward, q, k, v, spec),
        "routed": lambda: kvcache.dense_forward(impl.kvcache_forward, q, k, v, spec),
    }
    row = {"backend": backend, "batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    sample = check.reference_sample(q, k, v, causal=True)
    timed = {}
    for name, call in calls.items():
        try:
            (O, L), first_s = timing.timed_once(call, device)
        except NotImplementedError as e:
            return {**row, "problem": f"{name}: {e}"}
        problem = check.problem(O, L, q, sample)
        if problem is not None:
            return {**row, "problem": f"{name}: {problem}"}
        timed[name] = (call, first_s)
    results = sweep.time_rounds(timed, device)
    failed = [f"{name}: {value}" for name, (status, value) in results.items() if status != "ok"]
    if failed:
        return {**row, "problem": "; ".join(failed)}
    dense, routed = (results[name][1] * 1e3 for name in ("dense", "routed"))
    return {**row, "dense_us": f"{dense:.1f}", "routed_us": f"{routed:.1f}", "speedup": f"{dense / routed:.3f}"}


def report(rows: list[dict], args, command: str, device: torch.device) -> str:
    """The markdown: the run's setup, then per (backend, batch) the speedup table and the break-even points."""
    first = rows[0]
    lines = [
        "# Decode shapes: the dense kernel against the KV-cache kernels (fa2.attention's routing)",
        "",
        f"`{command}`",
        "",
        f"{first['gpu']}; torch {first['torch']}, triton {first['triton']}, numba-cuda {first['numba_cuda']}; "
        f"commit {first['commit']}. {args.heads} query heads, {args.heads_k} key/value heads, D {args.head_dim}, "
        f"{args.dtype}, causal. Times: {timing.describe(device)}.",
        "",
        "Cells: dense µs / routed µs (speedup = dense / routed; above 1: routing wins).",
    ]
    for backend in args.backends:
        for batch in args.batches:
            mine = {
                (int(r["seqlen_q"]), int(r["seqlen_k"])): r
                for r in rows
                if (r["backend"], r["batch"]) == (backend, batch)
            }
            if not mine:
                continue
            lines += ["", f"## fa2-{backend}, batch {batch}", ""]
            lines.append("| seqlen_q | " + " | ".join(f"{n} keys" for n in args.seqlens_k) + " | routing wins from |")
            lines.append("|---:|" + "---:|" * (len(args.seqlens_k) + 1))
            for nq in args.seqlens_q:
                cells, wins_from = [], None
                for nk in args.seqlens_k:
                    r = mine.get((nq, nk), {})
                    if r.get("speedup"):
                        cells.append(f"{r['dense_us']} / {r['routed_us']} ({float(r['speedup']):.2f}×)")
                    else:
                        cells.append(f"— {r.get('problem', 'not run')}")
                # The smallest seqlen_k from which every larger one measured has routing ahead.
                for nk in reversed(args.seqlens_k):
                    r = mine.get((nq, nk), {})
                    if not r.get("speedup") or float(r["speedup"]) < 1.0:
                        break
                    wins_from = nk
                verdict = f"{wins_from} keys ({wins_from / nq:g} per query)" if wins_from else "never"
                lines.append(f"| {nq} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emulated = device.type != "cuda"
    unset = {key: value for key, value in EMULATION.items() if key not in os.environ}
    if emulated and unset:
        print(f"fa2.bench.routing: no GPU; running again with {' '.join(f'{k}={v}' for k, v in unset.items())}")
        os.execve(sys.executable, [sys.executable, "-m", "fa2.bench.routing", *argv], {**os.environ, **unset})
    args = parse_args(argv, emulated)
    command = shlex.join(["python", "-m", "fa2.bench.routing", *argv])
    env = sweep.environment(device)
    stem = f"{args.name or default_name(device)}-decode-routing"
    csv_path, md = args.out / f"{stem}.csv", args.out / f"{stem}.md"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    points = [
        (b, batch, nq, nk)
        for b in args.backends
        for batch in args.batches
        for nq in args.seqlens_q
        for nk in args.seqlens_k
    ]
    for i, (backend, batch, nq, nk) in enumerate(points, 1):
        row = {
            "dtype": args.dtype,
            "heads": args.heads,
            "heads_k": args.heads_k,
            "head_dim": args.head_dim,
            **measure(backend, batch, nq, nk, args, device),
            **env,
        }
        rows.append(row)
        outcome = f"{row['dense_us']} / {row['routed_us']} µs" if row.get("speedup") else row["problem"]
        print(f"[{i}/{len(points)}] fa2-{backend} B{batch} {nq}x{nk}: {outcome}", flush=True)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    md.write_text(report(rows, args, command, device))
    print(f"wrote {csv_path}, {md}")


if __name__ == "__main__":
    main()
