"""fa2-numba-cuda's fast launch (``fa2_numba_cuda.launch``): after numba's own first launch of a class of
arguments, later calls of the class pack the compiled kernel's parameters on the host and call the driver.
A wrong packing is a wrong result, not a slow one, so:

- on the CPU (any numba-cuda this runs with; without the simulator, in a subprocess when this process runs
  it): the values ``launch`` packs for every launch of ``kvcache_forward`` over test_kvcache's cases and
  dtypes equal, byte for byte, the parameters numba's own ``_Kernel._prepare_args`` builds for the argument
  types numba infers (``launch`` checks the same against the compiled kernel's own types on each class's
  first GPU launch, and raises on a mismatch);
- on a GPU: O and L of the fast path equal numba's own launch bit for bit (contiguous and paged caches, one
  split and several, fp16 and bf16), and a small decode call costs under 150 µs of host time (114 µs measured there; issue 23 asks under 100).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fa2_numba_cuda")
from fa2_numba_cuda import common, kvcache, launch  # noqa: E402
from fa2.spec import AttentionSpec  # noqa: E402

HERE = Path(__file__).parent
# A guard against the ~1.2 ms a call of numba's own launch, not yet issue 23's 100 µs: on the H200 at 87cbb30
# this call took 114 µs with the fast launch and 1188 µs with numba's.
HOST_US_LIMIT = 150.0


@pytest.fixture(autouse=True)
def _numba_cuda_selected(request):
    selected = request.config.getoption("--backend")
    if selected and "numba-cuda" not in selected:
        pytest.skip(f"numba-cuda's own tests; --backend {selected}")


# --- the packing against numba's, on the CPU ----------------------------------------------------------


def check_parameters_match_numba() -> int:
    """Every launch kvcache_forward makes over test_kvcache's cases (causal, three dtypes) on CPU tensors, its
    kernel not run: ``launch.parameter_values`` packed by ``launch.parameter_layout`` of numba's inferred
    argument types equals numba's ``_prepare_args``. Needs numba-cuda without the simulator (no GPU needed).
    Returns the number of launches compared."""
    import struct
    import types

    from numba.cuda.dispatcher import _Kernel
    from numba.cuda.typing.typeof import Purpose, typeof
    from test_kvcache import CASES, _make

    assert not common.simulated()
    calls = []
    real = kvcache.launch, kvcache._check_device, kvcache.block_slots
    kvcache.launch = lambda kernel, grid, block, device, args: calls.append((kernel, args))
    kvcache._check_device = lambda q: None  # CPU tensors, kernels not launched
    kvcache.block_slots = lambda *a: 132 * 4  # an H100's SMs x blocks, without asking a GPU
    try:
        for case in CASES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                q, k_cache, v_cache, spec = _make(case.values[0], True, dtype, "cpu", seed=1)
                kvcache.kvcache_forward(q, k_cache, v_cache, spec)
    finally:
        kvcache.launch, kvcache._check_device, kvcache.block_slots = real
    for kernel, args in calls:
        values, key = launch.parameter_values(args, [kernel, 0])
        flat = [common._flat(a) if isinstance(a, torch.Tensor) else a for a in args]
        compiled = _Kernel.__new__(_Kernel)  # only what _prepare_args reads: no compilation, no GPU
        compiled.extensions = []
        compiled.signature = types.SimpleNamespace(args=[typeof(a, Purpose.argument) for a in flat])
        packed = struct.pack(launch.parameter_layout(compiled.argument_types), *values)
        expected = launch.numba_parameters(compiled, flat)
        launch.assert_same_parameters(packed, expected)
        # Not vacuous: a data pointer one element off is caught.
        data = 4 * 8  # the first array's data pointer: parameter 4
        wrong = packed[:data] + (int.from_bytes(packed[data:data + 8], "little") + 2).to_bytes(8, "little")
        with pytest.raises(AssertionError, match="parameter 4 packed as"):
            launch.assert_same_parameters(wrong + packed[data + 8:], expected)
    return len(calls)


def test_packed_parameters_are_numbas():
    if not common.simulated():
        assert check_parameters_match_numba() >= 15 * 3  # a split kernel each, and combines
        return
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_numba_cuda_launch as t; "
            "print('compared', t.check_parameters_match_numba())")
    done = subprocess.run([sys.executable, "-c", code, str(HERE)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[-1]) >= 15 * 3, done.stdout


# --- on the GPU -----------------------------------------------------------------------------------------


def _decode(device, dtype, batch=1, heads=32, heads_k=8, keys=4096, head_dim=128, page=None, splits=0,
            seed=0):
    """(q, k_cache, v_cache, spec) of one decode step, caches as transposed views of flash-attn's layout;
    rows hold keys//2 .. keys keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(device, dtype).transpose(1, 2)
    if page:
        pages = batch * keys // page
        shape = (pages + 3, page, heads_k, head_dim)
        table = (torch.randperm(pages + 3, generator=g)[:pages].view(batch, keys // page)
                 .to(device, torch.int32))
    else:
        shape, table = (batch, keys, heads_k, head_dim), None
    k_cache = torch.randn(shape, generator=g).to(device, dtype).transpose(1, 2)
    v_cache = torch.randn(shape, generator=g).to(device, dtype).transpose(1, 2)
    seqlens = torch.randint(keys // 2, keys + 1, (batch,), generator=g).to(device, torch.int32)
    spec = AttentionSpec(scale=head_dim ** -0.5, window=(-1, 0), group=heads // heads_k, cache_seqlens=seqlens,
                         block_table=table, num_splits=splits)
    return q, k_cache, v_cache, spec


GPU_CASES = [
    pytest.param(dict(batch=2, keys=1024, splits=1), id="contiguous-split1"),
    pytest.param(dict(batch=2, keys=1024, splits=4), id="contiguous-split4"),
    pytest.param(dict(batch=1, keys=4096, splits=0), id="contiguous-split0"),
    pytest.param(dict(batch=2, keys=1024, page=16, splits=1), id="paged16-split1"),
    pytest.param(dict(batch=2, keys=1024, page=256, splits=3), id="paged256-split3"),
    pytest.param(dict(batch=3, heads=8, heads_k=8, keys=512, head_dim=64, page=16, splits=0), id="paged16-MHA-D64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_fast_launch_equals_numbas_bit_for_bit(device, monkeypatch, dtype, case):
    q, k_cache, v_cache, spec = _decode(device, dtype, **case)
    monkeypatch.setattr(launch, "FAST", False)
    O_ref, L_ref = kvcache.kvcache_forward(q, k_cache, v_cache, spec)
    monkeypatch.setattr(launch, "FAST", True)
    kvcache.kvcache_forward(q, k_cache, v_cache, spec)  # a class's first call: numba's launch, then checked
    numba_launches = []
    real = launch._numba_launch
    monkeypatch.setattr(launch, "_numba_launch", lambda *a: numba_launches.append(a) or real(*a))
    O, L = kvcache.kvcache_forward(q, k_cache, v_cache, spec)
    assert not numba_launches, "the second call of a class must take the fast path"
    torch.cuda.synchronize()
    assert torch.equal(O, O_ref), f"max |O - O_numba| = {(O.float() - O_ref.float()).abs().max().item():.3g}"
    assert torch.equal(L, L_ref), f"max |L - L_numba| = {(L - L_ref).abs().max().item():.3g}"
    assert torch.isfinite(L).all()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 256], ids=["contiguous", "paged256"])
def test_host_time_per_call(device, monkeypatch, page):
    """kvcache_forward of one token, batch 1, 32/8 heads, 4k keys, D 128, bf16: host time per call (200 calls
    timed with perf_counter, no sync inside) under HOST_US_LIMIT; numba's own launch printed beside it."""
    monkeypatch.undo()  # conftest's NaN-poisoned torch.empty adds a fill kernel per output
    q, k_cache, v_cache, spec = _decode(device, torch.bfloat16, page=page)

    def per_call():
        for _ in range(10):
            kvcache.kvcache_forward(q, k_cache, v_cache, spec)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            kvcache.kvcache_forward(q, k_cache, v_cache, spec)
        host = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        return host

    launch.FAST = False
    try:
        numba_us = per_call()
    finally:
        launch.FAST = True
    fast_us = per_call()
    print(f"\nkvcache_forward host time per call ({'paged 256' if page else 'contiguous'}): fast launch "
          f"{fast_us:.1f} µs, numba's launch {numba_us:.1f} µs")
    assert fast_us < HOST_US_LIMIT, f"{fast_us:.1f} µs of host time a call (numba's own launch: {numba_us:.1f})"
