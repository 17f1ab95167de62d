"""fa2-numba-cuda's fast launch (``fa2_numba_cuda.launch``): after numba's own first launch of a class of
arguments, later calls of the class pack the compiled kernel's parameters on the host and call the driver.
A wrong packing is a wrong result, not a slow one, so:

- on the CPU (any numba-cuda this runs with; without the simulator, in a subprocess when this process runs
  it): for every launch of ``kvcache_forward`` (split kernel and combine) over test_kvcache's cases and
  dtypes, and of the dense forward (SIMT, tensor cores) and backward, all prepared (``launch.prepare``), a
  class's first call packed with a second call's data pointers written into their slots equals, byte for
  byte, the parameters numba's own ``_Kernel._prepare_args`` builds for that second call's arguments, of
  the types numba infers (``launch.prepare`` checks the same against the compiled kernel's own types on
  each class's first GPU launch, and raises on a mismatch);
- on a GPU: O and L of the fast path equal numba's own launch bit for bit (contiguous and paged caches, one
  split and several, fp16 and bf16), and a small decode call costs under 150 µs of host time (114 µs
  measured there; issue 23 asks under 100); the dense forward's and backward's outputs of a prepared call
  equal numba's own launch's bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch

from checks import run_python
from fa2.spec import AttentionSpec
from fa2_numba_cuda import backward_simt, common, forward, forward_simt, forward_tc, kvcache, launch

# A guard against the ~1.2 ms a call of numba's own launch, not yet issue 23's 100 µs: on the H200 at 87cbb30
# this call took 114 µs with the fast launch and 1188 µs with numba's.
HOST_US_LIMIT = 150.0


# --- the packing against numba's, on the CPU ----------------------------------------------------------


def _kvcache_inputs(case, dtype, tensor_cores, seed):
    """(launcher, its arguments, the tensors the caller gave) of one kvcache_forward call of a test_kvcache
    case (not causal), on CPU tensors, the split kernel the SIMT one or (``tensor_cores``) the tensor-core
    one."""
    import functools

    from test_kvcache import _make

    q, k_cache, v_cache, spec = _make(case, False, dtype, "cpu", seed=seed)
    given = (
        q,
        k_cache,
        v_cache,
        *(
            t
            for t in (
                spec.block_table,
                spec.cache_seqlens,
                spec.cache_leftpad,
                spec.cache_batch_idx,
                spec.cu_seqlens_q,
                spec.alibi_slopes,
            )
            if t is not None
        ),
    )
    return functools.partial(kvcache.kvcache_forward, tensor_cores=tensor_cores), (q, k_cache, v_cache, spec), given


def check_parameters_match_numba() -> int:
    """The prepared launches of kvcache_forward (split kernel and combine) over test_kvcache's cases, with the
    SIMT split kernel in three dtypes and the tensor-core one in fp16 and bf16 (contiguous, paged, leftpad,
    cache_batch_idx, packed queries with a block table, ALiBi, windows; one split and several) on CPU tensors,
    kernels not run, as ``check_dense_parameters_match_numba`` checks the dense kernels'. Needs numba-cuda
    without the simulator (no GPU). Returns the number of launches compared."""
    from test_kvcache import CASES

    assert not common.simulated()
    real = kvcache.check_device, kvcache.block_slots, kvcache.capability
    kvcache.check_device = lambda q: None  # CPU tensors, kernels not launched
    kvcache.block_slots = lambda *a: 132 * 4  # an H100's SMs x blocks, without asking a GPU
    kvcache.capability = lambda device: (9, 0)
    kinds = [
        (torch.float32, False),
        (torch.float16, False),
        (torch.bfloat16, False),
        (torch.float16, True),
        (torch.bfloat16, True),
    ]
    try:
        return _check_prepared(
            [
                (
                    f"{case.id}-{dtype}-{'tc' if tc else 'simt'}",
                    lambda seed, c=case.values[0], d=dtype, tc=tc: _kvcache_inputs(c, d, tc, seed),
                )
                for case in CASES
                for dtype, tc in kinds
            ],
            (kvcache,),
        )
    finally:
        kvcache.check_device, kvcache.block_slots, kvcache.capability = real


def test_packed_parameters_are_numbas():
    """kvcache_forward's prepared launches: a class's first call packed with a second call's pointers equals
    numba's parameters for that second call (``check_parameters_match_numba``)."""
    if not common.simulated():
        assert check_parameters_match_numba() >= 16 * 5  # a split kernel each, and combines
        return
    code = "import test_numba_cuda_launch as t; print('compared', t.check_parameters_match_numba())"
    done = run_python(code, without="NUMBA_ENABLE_CUDASIM", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[-1]) >= 16 * 5, done.stdout


def _dense_spec(
    case: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, g: torch.Generator, device="cpu"
) -> AttentionSpec:
    """The spec of a dense-kernel case: causal; causal with an attention sink; a window with softcap and ALiBi
    (slopes a strided view); or a packed batch of two sequences with ALiBi (q, k, v then (1, heads, total,
    head_dim))."""
    scale = head_dim**-0.5
    if case == "causal":
        return AttentionSpec(scale, (-1, 0))
    if case == "sink":
        return AttentionSpec(scale, (-1, 0), sink=torch.randn(heads, generator=g).to(device))
    slopes = torch.rand(batch, 2 * heads, generator=g).to(device)[:, ::2]
    if case == "features":
        return AttentionSpec(scale, (5, 2), softcap=20.0, alibi_slopes=slopes)
    cu_q = torch.tensor([0, seqlen_q // 3, seqlen_q], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, seqlen_k // 2, seqlen_k], dtype=torch.int32, device=device)
    return AttentionSpec(
        scale,
        (-1, 0),
        alibi_slopes=torch.rand(2, heads, generator=g).to(device),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=seqlen_q - seqlen_q // 3,
        max_seqlen_k=seqlen_k - seqlen_k // 2,
    )


DENSE_CASES = [
    (direction, dtype, case)
    for direction in ("forward-simt", "forward-tc", "backward")
    for dtype in (
        (torch.float16, torch.bfloat16) if direction == "forward-tc" else (torch.float32, torch.float16, torch.bfloat16)
    )
    for case in ("causal", "sink", "features", "varlen")
]


def _dense_inputs(direction, dtype, case, seed, device="cpu", seqlen_q=70, seqlen_k=90, head_dim=48):
    """(launcher, its arguments) of one dense call (B 2, H 4, H_k 2, seqlen_q x seqlen_k, head_dim; q a
    transposed view), fresh tensors and a fresh spec of the case's class for each seed. direction:
    "forward-simt", "forward-tc", "backward" (the SIMT kernels), or "forward" (the dispatch)."""
    g = torch.Generator().manual_seed(seed)
    batch = 1 if case == "varlen" else 2
    q = torch.randn(batch, seqlen_q, 4, head_dim, generator=g).to(device, dtype).transpose(1, 2)
    k, v = (torch.randn(batch, 2, seqlen_k, head_dim, generator=g).to(device, dtype) for _ in range(2))
    spec = _dense_spec(case, batch, 4, seqlen_q, seqlen_k, head_dim, g, device)
    launchers = {
        "forward-simt": forward_simt.flash_attn_forward,
        "forward-tc": forward_tc.flash_attn_forward,
        "forward": forward.flash_attn_forward,
    }
    if direction in launchers:
        return launchers[direction], (q, k, v, spec)
    O = torch.randn(q.shape, generator=g).to(device, dtype)
    L = torch.randn(q.shape[:3], generator=g).to(device)
    dO = torch.randn(q.shape, generator=g).to(device, dtype)
    return backward_simt.flash_attn_backward, (q, k, v, O, L, dO, spec)


def check_dense_parameters_match_numba() -> int:
    """The prepared launches of the dense forward (SIMT and tensor cores) and backward, over DENSE_CASES on
    CPU tensors, kernels not run (``_check_prepared``). Needs numba-cuda without the simulator (no GPU).
    Returns the number of launches compared."""
    assert not common.simulated()
    modules = (forward_simt, forward_tc, backward_simt)
    real = [m.check_device for m in modules], forward_tc.capability
    for m in modules:
        m.check_device = lambda q: None  # CPU tensors, kernels not launched
    forward_tc.capability = lambda device: (9, 0)

    def make(direction, dtype, case):
        def inputs(seed):
            launcher, args = _dense_inputs(direction, dtype, case, seed=seed)
            spec = args[-1]
            return launcher, args, (*args[:-1], *common.spec_tensors(spec), *common.sink_tensors(spec))

        return inputs

    try:
        return _check_prepared(
            [(f"{direction}-{dtype}-{case}", make(direction, dtype, case)) for direction, dtype, case in DENSE_CASES],
            modules,
        )
    finally:
        checks, forward_tc.capability = real
        for m, check in zip(modules, checks):
            m.check_device = check


def _check_prepared(cases, modules) -> int:
    """For each (name, make) of ``cases``, make(seed) giving (launcher, its arguments, the tensors the caller
    gave): a class's first call (seed 1) is prepared from its arguments (``launch.prepare``'s packing:
    ``parameter_values`` by ``parameter_layout`` of numba's inferred types); a second call, other tensors of
    the same class (seed 2), takes the prepared path; the same second call through the full path (the
    ``_PREPARED`` of ``modules`` forgotten) gives the arguments numba would have launched. The first call's
    packed parameters with the second call's data pointers written into ``pointer_slots`` must equal, byte for
    byte, numba's ``_prepare_args`` of those arguments, the prepared path passing the second call's own
    inputs in each slot (its outputs are allocated anew by each path: the same span of bytes). Returns the
    number of launches compared."""
    prepared, fast = [], []

    class Recorder:
        def __call__(self, *tensors):
            fast.append(tensors)

    def fake_prepare(kernel, grid, block, device, args, varying, shared=0):
        prepared.append(((kernel, shared), grid, block, args, varying))
        return Recorder()

    real = launch.prepare
    launch.prepare = fake_prepare
    compared = 0
    try:
        for name, make in cases:
            for m in modules:
                m._PREPARED.clear()
            launcher, inputs, _ = make(1)
            launcher(*inputs)  # the class's first call: prepared
            first = list(prepared)
            launcher, inputs, given = make(2)
            launcher(*inputs)  # the same class: the prepared path
            assert first and len(prepared) == len(first) and len(fast) == len(first), name
            for m in modules:
                m._PREPARED.clear()
            del prepared[:]
            launcher(*inputs)  # the same call's full path: the arguments numba would launch
            assert len(prepared) == len(first), name
            for (kernel, grid, block, args, varying), tensors, (kernel2, grid2, block2, args2, _) in zip(
                first, fast, prepared
            ):
                assert (kernel, grid, block) == (kernel2, grid2, block2), name
                compared += _compare_prepared(args, varying, tensors, args2, given)
            del prepared[:], fast[:]
    finally:
        launch.prepare = real
    return compared


def _span_bytes(t: torch.Tensor) -> int:
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _compare_prepared(args, varying, tensors, args2, given) -> int:
    """``args`` packed with the data pointers of ``tensors`` written at ``pointer_slots(args, varying)``
    equals numba's parameters for ``args2`` with the same pointers there; each of ``tensors`` is the tensor
    of ``args2`` at its position where that is one of the tensors the caller ``given``, else (an output)
    spans as many bytes. A pointer left unwritten is caught."""
    import struct
    import types

    from numba.cuda.dispatcher import _Kernel
    from numba.cuda.typing.typeof import Purpose, typeof

    def compiled_for(flat):
        compiled = _Kernel.__new__(_Kernel)  # only what _prepare_args reads: no compilation, no GPU
        compiled.extensions = []
        compiled.signature = types.SimpleNamespace(args=[typeof(a, Purpose.argument) for a in flat])
        return compiled

    flat, flat2 = ([common.flat_view(a) if isinstance(a, torch.Tensor) else a for a in x] for x in (args, args2))
    compiled, compiled2 = compiled_for(flat), compiled_for(flat2)
    assert compiled.argument_types == compiled2.argument_types  # one class, one compiled kernel
    given = {t.data_ptr() for t in given}
    slots = launch.pointer_slots(args, varying)
    assert len(slots) == len(tensors) == len(varying)
    for i, t in zip(varying, tensors):
        a2 = args2[i]
        if a2.data_ptr() in given:
            assert t.data_ptr() == a2.data_ptr(), f"argument {i}: not the call's own tensor"
        else:
            assert _span_bytes(t) == _span_bytes(a2), f"argument {i}: an output of another size"
    values = launch.parameter_values(args)
    packed = bytearray(struct.pack(launch.parameter_layout(compiled.argument_types), *values))
    expected = launch.numba_parameters(compiled2, flat2)
    with pytest.raises(AssertionError, match=f"parameter {slots[0]} packed as"):
        launch.assert_same_parameters(bytes(packed), expected)  # the first call's q: not the second's
    for slot, t in zip(slots, tensors):
        pointer = t.data_ptr().to_bytes(8, "little")
        packed[8 * slot : 8 * slot + 8] = pointer
        expected[slot] = pointer  # an output's: the prepared path's own allocation
    launch.assert_same_parameters(bytes(packed), expected)
    return 1


def test_dense_prepared_parameters_are_numbas():
    if not common.simulated():
        assert check_dense_parameters_match_numba() >= len(DENSE_CASES)
        return
    code = "import test_numba_cuda_launch as t; print('compared', t.check_dense_parameters_match_numba())"
    done = run_python(code, without="NUMBA_ENABLE_CUDASIM", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[-1]) >= len(DENSE_CASES), done.stdout


# --- on the GPU -----------------------------------------------------------------------------------------


def _decode(device, dtype, batch=1, heads=32, heads_k=8, keys=4096, head_dim=128, page=None, splits=0, seed=0):
    """(q, k_cache, v_cache, spec) of one decode step, caches as transposed views of flash-attn's layout;
    rows hold keys//2 .. keys keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(device, dtype).transpose(1, 2)
    if page:
        pages = batch * keys // page
        shape = (pages + 3, page, heads_k, head_dim)
        table = torch.randperm(pages + 3, generator=g)[:pages].view(batch, keys // page).to(device, torch.int32)
    else:
        shape, table = (batch, keys, heads_k, head_dim), None
    k_cache = torch.randn(shape, generator=g).to(device, dtype).transpose(1, 2)
    v_cache = torch.randn(shape, generator=g).to(device, dtype).transpose(1, 2)
    seqlens = torch.randint(keys // 2, keys + 1, (batch,), generator=g).to(device, torch.int32)
    spec = AttentionSpec(
        scale=head_dim**-0.5,
        window=(-1, 0),
        group=heads // heads_k,
        cache_seqlens=seqlens,
        block_table=table,
        num_splits=splits,
    )
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
@pytest.mark.alone
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
    print(
        f"\nkvcache_forward host time per call ({'paged 256' if page else 'contiguous'}): fast launch "
        f"{fast_us:.1f} µs, numba's launch {numba_us:.1f} µs"
    )
    assert fast_us < HOST_US_LIMIT, f"{fast_us:.1f} µs of host time a call (numba's own launch: {numba_us:.1f})"


DENSE_GPU_CASES = [
    pytest.param("forward", torch.bfloat16, "causal", 128, id="forward-tc-bf16-causal-D128"),
    pytest.param("forward", torch.float16, "features", 64, id="forward-tc-fp16-window-softcap-alibi-D64"),
    pytest.param("forward", torch.bfloat16, "varlen", 48, id="forward-tc-bf16-varlen-alibi-D48"),
    pytest.param("forward-simt", torch.float32, "causal", 128, id="forward-simt-fp32-causal-D128"),
    pytest.param("forward-simt", torch.bfloat16, "features", 160, id="forward-simt-bf16-window-softcap-alibi-D160"),
    pytest.param("backward", torch.bfloat16, "causal", 128, id="backward-bf16-causal-D128"),
    pytest.param("backward", torch.bfloat16, "sink", 64, id="backward-bf16-causal-sink-D64"),
    pytest.param("backward", torch.float32, "features", 64, id="backward-fp32-window-softcap-alibi-D64"),
    pytest.param("backward", torch.float16, "varlen", 48, id="backward-fp16-varlen-alibi-D48"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("direction, dtype, case, head_dim", DENSE_GPU_CASES)
def test_dense_fast_launch_equals_numbas_bit_for_bit(device, monkeypatch, direction, dtype, case, head_dim):
    """The dense forward (tensor cores through the dispatch, SIMT) and backward: a class's second call takes
    the prepared launch (``launch.prepare`` not called again) and its outputs equal numba's own launch's
    bit for bit (the kernels are deterministic: no atomics)."""
    launcher, inputs = _dense_inputs(
        direction, dtype, case, seed=0, device=device, seqlen_q=300, seqlen_k=333, head_dim=head_dim
    )
    monkeypatch.setattr(launch, "FAST", False)
    expected = launcher(*inputs)
    monkeypatch.setattr(launch, "FAST", True)
    launcher(*inputs)  # a class's first call: numba's launch, checked, then prepared
    prepares = []
    real = launch.prepare
    monkeypatch.setattr(launch, "prepare", lambda *a: prepares.append(a) or real(*a))
    got = launcher(*inputs)
    assert not prepares, "the second call of a class must take the prepared launch"
    torch.cuda.synchronize()
    assert len(got) == len(expected)
    for name, x, ref in zip(("first", "second", "third", "fourth"), got, expected):
        difference = (x.float() - ref.float()).abs().max()
        assert torch.equal(x, ref), f"output {name}: max |fast - numba| = {difference:.3g}"
