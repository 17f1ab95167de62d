"""Where a benchmark's files go and what they are named after: shared by ``python -m fa2.bench`` and the
tools that write beside its results (fa2-triton's tuners)."""

from __future__ import annotations

import re
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
