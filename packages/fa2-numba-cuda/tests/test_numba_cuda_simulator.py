"""Under numba's CUDA simulator: ``cuda.shared.array`` gives every thread of a block one array, however the
GIL passes between the threads (``fa2_numba_cuda.common._shared_array``). numba-cuda's own checks whether a
line's array exists, then stores the one it makes: a thread that lost the GIL in between kept an array of its
own, its writes unseen by the block (CI: dq off by 0.9 in test_gradients, a forward's first rows changing
between identical calls in test_flash_attn_api)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fa2_numba_cuda import common


@pytest.fixture(autouse=True)
def _numba_cuda_simulated(request):
    selected = request.config.getoption("--backend")
    if selected and "numba-cuda" not in selected:
        pytest.skip(f"numba-cuda's own tests; --backend {selected}")
    if not common.simulated():
        pytest.skip("numba's CUDA simulator only (NUMBA_ENABLE_CUDASIM=1); on a GPU shared memory is the hardware's")


def test_shared_array_is_one_array_when_the_gil_passes_mid_declaration(monkeypatch):
    """Thread A is held inside the making of a line's array (np.empty) until thread B has declared the same
    line, the interleaving that lost a thread's tile in CI; both must get the same array."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared = FakeCUDAShared(0)

    def declare():  # one cuda.shared.array line, as a kernel's
        return shared.array((4, 8), np.float32)

    a_in_empty, b_done = threading.Event(), threading.Event()
    empty = np.empty

    def held_empty(*args, **kwargs):
        if threading.current_thread().name == "A":
            a_in_empty.set()
            assert b_done.wait(10), "thread B did not declare the array"
        return empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", held_empty)
    arrays = {}

    def thread_a():
        arrays["A"] = declare()

    thread = threading.Thread(target=thread_a, name="A")
    thread.start()
    assert a_in_empty.wait(10), "thread A did not make the array"
    arrays["B"] = declare()
    b_done.set()
    thread.join(10)
    assert arrays["A"] is arrays["B"], "two threads of a block got different arrays for one cuda.shared.array line"
    assert declare() is arrays["B"]
