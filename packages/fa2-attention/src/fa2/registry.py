"""Backends are found through the ``fa2.backends`` entry-point group: installing a backend package is all
it takes. Each entry point names a module that exposes ``NAME``, ``FlashAttention2`` and ``availability()``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

GROUP = "fa2.backends"
DISTRIBUTION = "fa2-attention"
# Known backends, fastest first: the order ``backend=None`` tries on CUDA tensors.
KNOWN = ("triton", "numba-cuda", "pytorch")


class BackendNotInstalledError(ImportError):
    """A known fa2 backend whose package is not installed."""


class BackendInfo(NamedTuple):
    """``status``: "native" (runs on this machine's hardware), "emulated" (runs in an emulator on the CPU:
    Triton's interpreter, numba's CUDA simulator) or "unavailable"; ``detail`` says why."""

    name: str
    status: str
    detail: str


@functools.cache
def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def installed() -> list[str]:
    return sorted(_entry_points())


def load(name: str) -> ModuleType:
    """The backend module for ``name``; never another one."""
    eps = _entry_points()
    if name in eps:
        # Every call asks: a module already imported is taken from sys.modules, without import_module's
        # machinery (~1 µs of host time a call).
        return sys.modules.get(eps[name]) or importlib.import_module(eps[name])
    if name in KNOWN:
        raise BackendNotInstalledError(f"fa2 backend {name!r} is not installed: {install_command(name)}")
    raise ValueError(f"unknown fa2 backend {name!r}; installed: {', '.join(installed()) or 'none'}")


def install_command(extra: str) -> str:
    """The command that adds ``extra`` (a backend's name, or "transformers") to this installation of fa2.
    From a checkout: editable, naming the backend's folder too (pip knows no workspace). Otherwise the
    distribution's extra; a backend's distribution comes from the folder of fa2's wheels (``nox -s build``)
    until fa2 is on PyPI, and nothing else on PyPI carries its name."""
    root = checkout()
    if root is None:
        wheels = "--find-links WHEELS_DIR " if extra in KNOWN else ""
        return f'pip install {wheels}"{DISTRIBUTION}[{extra}]"'
    sibling = f" -e {root / 'packages' / f'fa2-{extra}'}" if extra in KNOWN else ""
    return f'pip install -e "{root / "packages" / DISTRIBUTION}[{extra}]"{sibling}'


@functools.cache
def checkout() -> Path | None:
    """The root of the fa2 checkout this package is imported from (an editable install), else None."""
    # <root>/packages/fa2-attention/src/fa2/registry.py; an installed copy sits elsewhere (site-packages).
    parents = Path(__file__).resolve().parents
    if len(parents) < 5:
        return None
    root = parents[4]
    return root if (root / "packages" / DISTRIBUTION / "src" / "fa2" / "__init__.py").is_file() else None


def backends() -> dict[str, BackendInfo]:
    """Installed backends and whether each can run here."""
    out = {}
    for name in installed():
        try:
            status, detail = load(name).availability()
        except ImportError as e:
            status, detail = "unavailable", f"import failed: {e}"
        out[name] = BackendInfo(name, status, detail)
    return out


def default_backend(device: torch.device) -> str:
    """CUDA tensors: the first of KNOWN that is installed and native here. Other devices: pytorch."""
    return _default_cuda_backend() if device.type == "cuda" else "pytorch"


@functools.cache
def _default_cuda_backend() -> str:
    # Asked on every fa2.attention call without a backend: decided once, as the installed backends
    # (_entry_points) and whether each runs natively (its import-time mode, the CUDA driver) stay fixed for
    # the process. A failure is not cached.
    infos = backends()
    for name in KNOWN:
        if name in infos and infos[name].status == "native":
            return name
    raise BackendNotInstalledError(
        f"no installed fa2 backend runs natively on CUDA here ({_describe(infos)}); {install_command('triton')}"
    )


def _describe(infos: dict[str, BackendInfo]) -> str:
    return "; ".join(f"{i.name}: {i.status}, {i.detail}" for i in infos.values()) or "none installed"
