"""What the benchmark modes share (``python -m fa2.bench``, ``fa2.bench.generate``, ``fa2.bench.ring``, and the
tools that write beside their results, fa2-triton's tuners): where the files go and what they are named
after, reading them back, the timestamps and one-line reasons in them, their markdown tables, and the
parsing of the modes' comma-separated options."""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from fa2 import registry


def default_out() -> Path:
    """docs/benchmarks of the checkout fa2 is imported from, wherever the command starts; ./fa2-bench for
    an installation from wheels."""
    root = registry.checkout()
    return root / "docs" / "benchmarks" if root is not None else Path("fa2-bench")


def default_name(device: torch.device) -> str:
    """ "NVIDIA H200" -> "h200"; "cpu-emulated" without a GPU."""
    if device.type != "cuda":
        return "cpu-emulated"
    gpu = re.sub(r"^nvidia\s+", "", torch.cuda.get_device_name(device).lower())
    return re.sub(r"[^a-z0-9]+", "-", gpu).strip("-")


def now_utc() -> str:
    """The time now, UTC, to the second (ISO 8601): a row's or a run's timestamp."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def exception_reason(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message (compiler errors run long)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV the benchmark wrote, as written; none if it does not exist."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def read_runs(path: Path) -> list[dict]:
    """``<name>-run.json``: one entry per run that wrote into the CSV (several with --append)."""
    return json.loads(path.read_text())["runs"] if path.exists() else []


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def comma_list(kind, valid=None):
    """An argparse type: comma-separated values of ``kind``, each in ``valid`` where given, ints at least 1."""

    def parse(text):
        items = tuple(kind(x) for x in text.split(",") if x)
        unknown = [x for x in items if valid is not None and x not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(str, unknown))}; choose from {', '.join(valid)}")
        if any(isinstance(x, int) and x < 1 for x in items):
            raise argparse.ArgumentTypeError(f"every value must be at least 1, got {text!r}")
        return items

    return parse


def positive_int(text: str) -> int:
    """An argparse type: an int at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def write_report(report, out_dir: Path, name: str) -> list[Path]:
    """``<name>.md`` and ``<name>.png`` (where matplotlib is installed) of ``report``, a mode's report over the
    run's files in out_dir (``generate.Report``, ``ring.Report``: ``plot(out_dir)`` and ``markdown(plots)``)."""
    try:
        plots = [report.plot(out_dir)]
    except ImportError as e:
        print(f"no plot ({e}): install matplotlib", file=sys.stderr)
        plots = []
    path = out_dir / f"{name}.md"
    path.write_text(report.markdown(plots))
    return [path, *plots]
