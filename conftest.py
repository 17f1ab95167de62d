"""The test suites' knobs, shared by shared_tests/ and packages/<backend>/tests/: which backends
(``--backend``, default every installed one) on which device (``--device cpu|cuda``), NaN-poisoned
``torch.empty`` so that an unwritten output fails, and the ``alone`` tests that pytest-xdist's workers skip."""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import time

import pytest
import torch

import fa2


def pytest_addoption(parser):
    parser.addoption(
        "--backend",
        action="append",
        default=None,
        help="fa2 backend to test (repeatable); default: every installed backend",
    )
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="device the tensors live on (default cpu; backends that need CUDA run emulated)",
    )


def pytest_configure(config):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and importlib.util.find_spec("numba") is not None:
        _yield_while_polling_simulated_threads()
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (--device cuda); skipped, with the reason, on the CPU")
    config.addinivalue_line(
        "markers",
        "alone: measures the whole GPU or the host's time (free device memory, host microseconds a call), which "
        "other processes on the same GPU and cores disturb; skipped under pytest-xdist with several workers: "
        "run them in a pytest of their own, as nox -s test_gpu does",
    )


def _yield_while_polling_simulated_threads():
    """numba's CUDA simulator runs a block's threads as Python threads, and its main thread waits for them by
    polling each one's ``is_alive`` in a loop that never blocks (``numba.cuda.simulator.kernel.BlockManager
    .run``): it keeps the GIL from the threads it waits for. A ``time.sleep(0)`` in each poll hands the GIL
    over; the kernels run as before, only sooner."""
    from numba.cuda.simulator.kernel import BlockThread

    def is_alive(thread):
        time.sleep(0)
        return threading.Thread.is_alive(thread)

    BlockThread.is_alive = is_alive


def pytest_collection_modifyitems(config, items):
    skips = []
    if config.getoption("--device") != "cuda":
        skips.append(("gpu", pytest.mark.skip(reason="GPU-only: run with --device cuda on a machine with a CUDA GPU")))
    # Each xdist worker collects with PYTEST_XDIST_WORKER_COUNT set.
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        skips.append(
            (
                "alone",
                pytest.mark.skip(
                    reason="disturbed by the other xdist workers: run with -m alone, without -n (nox -s test_gpu does)"
                ),
            )
        )
    for item in items:
        for marker, skip in skips:
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        names = metafunc.config.getoption("--backend") or sorted(fa2.backends())
        metafunc.parametrize("backend", names, scope="session")


def pytest_report_header(config):
    infos = fa2.backends()
    lines = ["fa2 backends: " + "; ".join(f"{i.name} ({i.status}: {i.detail})" for i in infos.values())]
    lines.append(f"fa2 device: {config.getoption('--device')}")
    return lines


@pytest.fixture(scope="session")
def device(request):
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda given but torch sees no CUDA device", returncode=4)
    return torch.device(name)


@pytest.fixture(scope="session")
def status(backend, device):
    """How ``backend`` runs here: "native" or "emulated"; a backend that cannot run is an error, not a skip."""
    info = fa2.backends().get(backend)
    if info is None:
        pytest.fail(f"backend {backend!r} is not installed; installed: {sorted(fa2.backends())}")
    if info.status == "unavailable":
        pytest.fail(f"backend {backend!r} cannot run here: {info.detail}")
    return info.status


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Floating tensors from torch.empty / empty_like start as NaN (as flash-linear-attention's conftest)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.is_floating_point() and t.numel():
            with torch.no_grad():  # also for a leaf that requires grad (torch.compile makes such tensors)
                t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))
