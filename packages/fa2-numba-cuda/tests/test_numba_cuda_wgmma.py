"""Hopper's warpgroup MMA for numba-cuda (``fa2_numba_cuda.wgmma``), not yet used by a kernel (issue 42's item 2).

- numpy, anywhere: the register tables against literal entries of the PTX ISA's figures for m64nNk16 (D, and A
  in registers), D's registers repacked as the A of the next product, the 128 B swizzle against the ISA's
  figure, the descriptor's bit fields against hand-worked values, and the descriptors of each k16 slice,
  decoded through the ISA's canonical layouts, against the addresses the kernels store elements at;
- one block of 128 threads, on numba's simulator (``wgmma.py``'s emulation) or, with --device cuda, on an sm_90
  GPU: A (64 x K) and B stored in the swizzled layout, a k-loop of wgmma.mma_async, D to global, against an fp64
  matmul, bf16 and fp16, B K-major and MN-major, N 16 to 256; and S = Q Kᵀ then O = P V with P from S's
  accumulators in registers (FlashAttention-3's two products). On the GPU: pytest --device cuda with
  NUMBA_ENABLE_CUDASIM unset.

The simulator checks the index math against the ISA's tables as this module reads them; only the GPU run shows
that the hardware reads them the same way (and that fence.proxy.async and the barrier are where they must be).
"""

from __future__ import annotations

import dis
import functools

import numpy as np
import pytest
import torch
from numba import cuda, int16

from fa2_numba_cuda import common, mma, wgmma

SIMULATED = common.simulated()


@pytest.fixture
def wgmma_device(kernel_device):
    """Where the wgmma kernels run: the simulator on the CPU, or a GPU of compute capability 9.0 (sm_90a:
    wgmma is neither on Ampere nor on Blackwell)."""
    if kernel_device.type == "cuda":
        capability = torch.cuda.get_device_capability(kernel_device)
        if capability[0] != 9:
            pytest.skip(f"wgmma needs sm_90a (compute capability 9.x), got {capability}")
    return kernel_device


# --- the ISA's tables ---------------------------------------------------------------------------------

# Literal entries of the PTX ISA's figures for wgmma .m64nNk16 ("WGMMA .m64nNk16 register fragment layout for
# accumulator matrix D" and "... for matrix A"): threads 0, 37 (warp 1, lane 5: g = 1, t = 1) and 127 (warp 3,
# lane 31: g = 7, t = 3); D for N = 16, two blocks of 8 columns.
ISA_D16 = {
    0: [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)],
    37: [(17, 2), (17, 3), (25, 2), (25, 3), (17, 10), (17, 11), (25, 10), (25, 11)],
    127: [(55, 6), (55, 7), (63, 6), (63, 7), (55, 14), (55, 15), (63, 14), (63, 15)],
}
ISA_A = {
    0: [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)],
    37: [(17, 2), (17, 3), (25, 2), (25, 3), (17, 10), (17, 11), (25, 10), (25, 11)],
    127: [(55, 6), (55, 7), (63, 6), (63, 7), (55, 14), (55, 15), (63, 14), (63, 15)],
}


@pytest.mark.parametrize("thread", [0, 37, 127])
def test_register_tables_match_the_isa(thread):
    assert wgmma.wgmma_d_layout(thread, 16) == ISA_D16[thread]
    assert wgmma.wgmma_a_layout(thread) == ISA_A[thread]
    # D's last register for N = 256: the last of 32 column blocks
    w, g, t = thread // 32, thread % 32 // 4, thread % 4
    assert wgmma.wgmma_d_layout(thread, 256)[-1] == (16 * w + g + 8, 248 + 2 * t + 1)
    assert [wgmma.wgmma_d_row_col.py_func(thread, i) for i in range(64)] == wgmma.wgmma_d_layout(thread, 128)


@pytest.mark.parametrize(
    "layout, shape",
    [
        pytest.param(lambda thread: wgmma.wgmma_d_layout(thread, 64), (64, 64), id="D-N64"),
        pytest.param(lambda thread: wgmma.wgmma_d_layout(thread, 128), (64, 128), id="D-N128"),
        pytest.param(wgmma.wgmma_a_layout, (64, 16), id="A"),
    ],
)
def test_each_element_in_exactly_one_thread(layout, shape):
    seen = np.zeros(shape, dtype=int)
    for thread in range(wgmma.WARPGROUP_SIZE):
        for index in layout(thread):
            seen[index] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("thread", range(0, 128, 9))
def test_d_registers_are_the_next_products_a(thread):
    """Registers 8 kk + 2 j, 8 kk + 2 j + 1 of D hold A register j's two elements for columns 16 kk .. 16 kk + 15."""
    d = wgmma.wgmma_d_layout(thread, 64)
    for kk in range(4):
        shifted = [(m, k + 16 * kk) for m, k in wgmma.wgmma_a_layout(thread)]
        assert d[8 * kk : 8 * kk + 8] == shifted


# --- the shared-memory layout and the descriptors -----------------------------------------------------


def test_swizzle_128b_matches_the_isa_figure():
    """The ISA's "K major 128B swizzling" figure: in each 8-row group, 16 B chunk j of row r sits at j ^ r."""
    offset = wgmma.swizzle128_offset.py_func
    assert [offset(1, 8 * j, 64) // 16 % 8 for j in range(8)] == [1, 0, 3, 2, 5, 4, 7, 6]
    assert [offset(7, 8 * j, 64) // 16 % 8 for j in range(8)] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert offset(9, 40, 64) == 9 * 128 + 16 * (5 ^ 1)
    assert offset(3, 64 + 17, 16) == 16 * 128 + 3 * 128 + 16 * (2 ^ 3) + 2
    # a bijection onto the tile's bytes, 8 consecutive elements staying one 16 B chunk
    rows, cols = 64, 128
    addresses = np.array([[offset(r, c, rows) for c in range(cols)] for r in range(rows)])
    assert sorted(addresses.reshape(-1).tolist()) == list(range(0, 2 * rows * cols, 2))
    assert (np.diff(addresses.reshape(rows, cols // 8, 8), axis=-1) == 2).all()


def test_descriptor_fields_hand_worked():
    desc = int(wgmma.smem_descriptor.py_func(0x1420, 16, 1024, wgmma.SWIZZLE_128B))
    # start 0x1420 >> 4 = 0x142 (bits 0-13), LBO 16 >> 4 = 1 (bits 16-29), SBO 1024 >> 4 = 0x40 (bits 32-45),
    # swizzle mode 1 (bits 62-63)
    assert desc == 0x4000_0040_0001_0142
    desc = int(wgmma.smem_descriptor.py_func(0x3_F010, 2048 * 16, 1024, wgmma.SWIZZLE_128B))
    assert desc == (0x3F01 | 0x800 << 16 | 0x40 << 32 | 1 << 62)  # start 0x3F010 & 0x3FFFF >> 4 = 0x3F01
    assert wgmma.decode_descriptor(desc) == dict(start=0x3_F010, lbo=0x8000, sbo=1024, base_offset=0, swizzle=1)
    # an address of the shared window beyond 18 bits keeps its low 18 (the ISA's encode: x & 0x3FFFF)
    assert int(wgmma.smem_descriptor.py_func(0x4_0020, 16, 1024, 1)) & 0x3FFF == 0x2


@pytest.fixture
def host_descriptors(monkeypatch):
    """descriptor_k_major and descriptor_mn_major callable on the host (their py_func), without the simulator too:
    smem_descriptor, which they call, as its py_func."""
    monkeypatch.setattr(wgmma, "smem_descriptor", wgmma.smem_descriptor.py_func)


@pytest.mark.parametrize("rows, cols", [(64, 16), (64, 128), (128, 64)])
def test_k_major_descriptors_give_the_stored_addresses(host_descriptors, rows, cols):
    """Each k16 slice's descriptor, decoded through the ISA's canonical layout, addresses the elements where
    ``swizzle128_offset`` stored them (rows m of A, or n of a K-major B)."""
    tile = 9 * 1024
    for k0 in range(0, cols, 16):
        desc = wgmma.descriptor_k_major.py_func(tile, rows, k0)
        got = wgmma.descriptor_addresses(desc, rows, 16, False)
        want = [[tile + wgmma.swizzle128_offset.py_func(r, k0 + c, rows) for c in range(16)] for r in range(rows)]
        assert np.array_equal(got, want), f"k0 = {k0}"


@pytest.mark.parametrize("rows, cols", [(16, 64), (64, 128), (32, 256)])
def test_mn_major_descriptors_give_the_stored_addresses(host_descriptors, rows, cols):
    """The same for an MN-major B stored as K rows of N (V: keys x head dims)."""
    tile = 9 * 1024
    for k0 in range(0, rows, 16):
        desc = wgmma.descriptor_mn_major.py_func(tile, rows, k0)
        got = wgmma.descriptor_addresses(desc, 16, cols, True)
        want = [[tile + wgmma.swizzle128_offset.py_func(k0 + r, c, rows) for c in range(cols)] for r in range(16)]
        assert np.array_equal(got, want), f"k0 = {k0}"


# --- one warpgroup's kernels, on the simulator or an sm_90 GPU ----------------------------------------


@functools.cache
def matmul_kernel(kind: str, N: int, trans_b: int, K: int, fence_operand: bool = True):
    """D (64 x N, fp32) = A (64 x K) B for one block of 128 threads: A and B (16-bit patterns as int16; B as N
    rows of K if trans_b = 0, K rows of N if 1) stored in shared memory in the 128 B swizzled layout, one
    wgmma.mma_async per k16 slice, D to global. fence_operand False leaves out wgmma_fence_operand after the wait
    (a wrong kernel for the simulator's check)."""
    b_rows, b_cols = (K, N) if trans_b else (N, K)
    a_bytes = wgmma.swizzle128_tile_bytes(64, K)
    smem_elements = (a_bytes + wgmma.swizzle128_tile_bytes(b_rows, b_cols) + wgmma.SWIZZLE_ATOM_BYTES) // 2
    n_acc = N // 2
    mma_async = wgmma.wgmma_bf16 if kind == "bf16" else wgmma.wgmma_f16

    @cuda.jit
    def kernel(a, b, d):
        smem = cuda.shared.array(smem_elements, int16)
        tid = cuda.threadIdx.x
        base = mma.shared_address(smem)
        pad = (1024 - base % 1024) % 1024  # the swizzle's pattern starts on a 1024 B boundary (base offset 0)
        a_tile = base + pad
        b_tile = a_tile + a_bytes
        for i in range(tid, 64 * K, 128):
            smem[(pad + wgmma.swizzle128_offset(i // K, i % K, 64)) // 2] = a[i // K, i % K]
        for i in range(tid, b_rows * b_cols, 128):
            r = i // b_cols
            c = i % b_cols
            smem[(pad + a_bytes + wgmma.swizzle128_offset(r, c, b_rows)) // 2] = b[r, c]
        wgmma.fence_proxy_async()  # this thread's stores, visible to wgmma's async proxy ...
        cuda.syncthreads()  # ... and every thread's, before any warp's wgmma
        acc = wgmma.zero_accumulators(n_acc)
        wgmma.wgmma_fence()
        for s in range(K // 16):
            desc_a = wgmma.descriptor_k_major(a_tile, 64, 16 * s)
            if trans_b:
                desc_b = wgmma.descriptor_mn_major(b_tile, b_rows, 16 * s)
            else:
                desc_b = wgmma.descriptor_k_major(b_tile, b_rows, 16 * s)
            acc = mma_async(acc, desc_a, desc_b, s, trans_b)  # scale_d = s: the first slice overwrites
        wgmma.wgmma_commit()
        wgmma.wgmma_wait(0)
        if fence_operand:
            acc = wgmma.wgmma_fence_operand(acc)
        for i in range(n_acc):
            r, c = wgmma.wgmma_d_row_col(tid, i)
            d[r, c] = acc[i]

    return kernel


@functools.cache
def attention_kernel(kind: str, D: int, N: int, DV: int):
    """O (64 x DV) = P V with P = S rounded to 16 bits and S = Q Kᵀ: Q (64 x D) and K (N x D) K-major, V (N x
    DV) MN-major, S's accumulators repacked in registers as P's A (wgmma with A from registers)."""
    q_bytes, k_bytes = wgmma.swizzle128_tile_bytes(64, D), wgmma.swizzle128_tile_bytes(N, D)
    smem_elements = (q_bytes + k_bytes + wgmma.swizzle128_tile_bytes(N, DV) + wgmma.SWIZZLE_ATOM_BYTES) // 2
    s_acc, o_acc = N // 2, DV // 2
    ss = wgmma.wgmma_bf16 if kind == "bf16" else wgmma.wgmma_f16
    rs = wgmma.wgmma_bf16_rs if kind == "bf16" else wgmma.wgmma_f16_rs
    pack = mma.pack_bf16x2 if kind == "bf16" else mma.pack_f16x2

    @cuda.jit
    def kernel(q, k, v, o):
        smem = cuda.shared.array(smem_elements, int16)
        tid = cuda.threadIdx.x
        base = mma.shared_address(smem)
        pad = (1024 - base % 1024) % 1024
        q_tile = base + pad
        k_tile = q_tile + q_bytes
        v_tile = k_tile + k_bytes
        for i in range(tid, 64 * D, 128):
            smem[(pad + wgmma.swizzle128_offset(i // D, i % D, 64)) // 2] = q[i // D, i % D]
        for i in range(tid, N * D, 128):
            smem[(pad + q_bytes + wgmma.swizzle128_offset(i // D, i % D, N)) // 2] = k[i // D, i % D]
        for i in range(tid, N * DV, 128):
            smem[(pad + q_bytes + k_bytes + wgmma.swizzle128_offset(i // DV, i % DV, N)) // 2] = v[i // DV, i % DV]
        wgmma.fence_proxy_async()
        cuda.syncthreads()
        s = wgmma.zero_accumulators(s_acc)
        wgmma.wgmma_fence()
        for kk in range(D // 16):
            desc_q = wgmma.descriptor_k_major(q_tile, 64, 16 * kk)
            s = ss(s, desc_q, wgmma.descriptor_k_major(k_tile, N, 16 * kk), kk, 0)
        wgmma.wgmma_commit()
        wgmma.wgmma_wait(0)
        s = wgmma.wgmma_fence_operand(s)
        acc = wgmma.zero_accumulators(o_acc)
        for kk in range(N // 16):
            p = (
                pack(s[8 * kk], s[8 * kk + 1]),
                pack(s[8 * kk + 2], s[8 * kk + 3]),
                pack(s[8 * kk + 4], s[8 * kk + 5]),
                pack(s[8 * kk + 6], s[8 * kk + 7]),
            )
            wgmma.wgmma_fence()  # p's registers, written by this thread, before the mma_async reads them
            acc = rs(acc, p, wgmma.descriptor_mn_major(v_tile, N, 16 * kk), kk, 1)
        wgmma.wgmma_commit()
        wgmma.wgmma_wait(0)
        acc = wgmma.wgmma_fence_operand(acc)
        for i in range(o_acc):
            r, c = wgmma.wgmma_d_row_col(tid, i)
            o[r, c] = acc[i]

    return kernel


def _bits(t: torch.Tensor, device):
    """A 16-bit tensor's patterns as int16, where the kernel reads them: numpy for the simulator."""
    bits = t.view(torch.int16)
    return bits.numpy() if device.type == "cpu" else bits.to(device)


def _output(shape, device):
    if device.type == "cpu":
        return np.full(shape, np.nan, dtype=np.float32)
    return torch.full(shape, float("nan"), device=device)


def _result(out) -> np.ndarray:
    if isinstance(out, np.ndarray):
        return out.astype(np.float64)
    torch.cuda.synchronize()
    return out.double().cpu().numpy()


def _inputs(dtype, seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


DTYPES = [pytest.param("bf16", torch.bfloat16, id="bf16"), pytest.param("f16", torch.float16, id="fp16")]
# (N, trans_b, K): N = 16 to 256; K 96 and 128 cross a 64-column panel of A (and of a K-major B). Static shared
# memory (48 KiB) bounds the tiles. The simulator runs them all in about 10 s.
SHAPES = [
    pytest.param(N, trans_b, K, id=f"N{N}-{'MN' if trans_b else 'K'}major-K{K}")
    for N, trans_b, K in [
        (64, 0, 16),
        (64, 1, 16),
        (16, 0, 16),
        (128, 1, 32),
        (64, 0, 128),
        (128, 0, 64),
        (64, 1, 128),
        (128, 1, 96),
        (256, 1, 64),
    ]
]


@pytest.mark.parametrize("kind, dtype", DTYPES)
@pytest.mark.parametrize("N, trans_b, K", SHAPES)
def test_wgmma_matmul(wgmma_device, kind, dtype, N, trans_b, K):
    a, b = _inputs(dtype, N + K + trans_b, (64, K), (K, N) if trans_b else (N, K))
    d = _output((64, N), wgmma_device)
    matmul_kernel(kind, N, trans_b, K)[1, 128](_bits(a, wgmma_device), _bits(b, wgmma_device), d)
    b_kn = b.double().numpy() if trans_b else b.double().numpy().T
    want = a.double().numpy() @ b_kn
    scale = (np.abs(a.double().numpy()) @ np.abs(b_kn)).max()
    np.testing.assert_allclose(_result(d), want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("kind, dtype", DTYPES)
@pytest.mark.parametrize(
    "D, N, DV",
    [
        pytest.param(16, 32, 64, id="D16-N32-DV64"),
        pytest.param(64, 64, 128, id="D64-N64-DV128"),
        pytest.param(128, 64, 64, id="D128-N64-DV64"),
    ],
)
def test_wgmma_s_then_pv_from_registers(wgmma_device, kind, dtype, D, N, DV):
    q, k, v = _inputs(dtype, D + N, (64, D), (N, D), (N, DV))
    q = q * D**-0.5
    o = _output((64, DV), wgmma_device)
    attention_kernel(kind, D, N, DV)[1, 128](*(_bits(t, wgmma_device) for t in (q, k, v)), o)
    S = q.double().numpy() @ k.double().numpy().T
    P = torch.from_numpy(S).float().to(dtype).double().numpy()  # fp32 S rounded as the kernel's pack rounds
    want = P @ v.double().numpy()
    # S in fp32 may round to the neighbouring 16-bit value: one ulp of P (2^-8 relative for bf16) per product
    ulp = 2.0**-8 if kind == "bf16" else 2.0**-11
    np.testing.assert_allclose(_result(o), want, rtol=0, atol=ulp * (np.abs(P) @ np.abs(v.double().numpy())).max())


needs_simulator = pytest.mark.skipif(not SIMULATED, reason="checks the simulator's emulation: NUMBA_ENABLE_CUDASIM=1")


@needs_simulator
def test_simulator_accumulators_in_flight_until_wait_and_fence_operand():
    """Read after the wait without wgmma_fence_operand, D is the simulator's NaN placeholders."""
    a, b = _inputs(torch.bfloat16, 1, (64, 16), (64, 16))
    d = _output((64, 64), torch.device("cpu"))
    matmul_kernel("bf16", 64, 0, 16, fence_operand=False)[1, 128](
        a.view(torch.int16).numpy(), b.view(torch.int16).numpy(), d
    )
    assert np.isnan(d).all()


@needs_simulator
def test_simulator_refuses_mma_async_without_fence():
    @cuda.jit
    def kernel(d):
        smem = cuda.shared.array(4096, int16)
        tile = mma.shared_address(smem)
        desc = wgmma.descriptor_k_major(tile, 64, 0)
        acc = wgmma.wgmma_bf16(wgmma.zero_accumulators(32), desc, desc, 0, 0)
        d[cuda.threadIdx.x] = acc[0]

    with pytest.raises(RuntimeError, match="without a wgmma.fence"):
        kernel[1, 128](np.zeros(128, dtype=np.float32))


# --- mma.unrolled: the builder's loop unrolling (numba-cuda has no unroll hint) ---------------------------------
COLUMNS = 3


def _loops(out, x, n):
    """Loops of constant bounds (a global, and an outer index), one bounded at run time, one that breaks."""
    for i in range(COLUMNS):
        for j in range(i, i + 2):
            out[i, j] = x * i + j
    for k in range(n):
        out[3, k] = k
    for m in range(4):
        if m == n:
            break
        out[4, m] = m


def _closure(rows):
    def fill(out):
        for r in range(rows):  # a bound of the builder's closure
            out[r, 0] = r * r

    return fill


def _for_loops(fn) -> int:
    return sum(instruction.opname == "FOR_ITER" for instruction in dis.get_instructions(fn))


@pytest.mark.parametrize("make", [lambda: _loops, lambda: _closure(5)], ids=["globals", "closure"])
def test_unrolled_writes_out_constant_range_loops_only(make):
    """mma.unrolled writes out the loops whose bounds are constants (globals, closure, outer indices) and leaves
    those bounded at run time or that break; the function computes what it did."""
    fn = make()
    written = mma.unrolled(fn)
    args = (2.0, 2) if fn is _loops else ()
    expected, got = np.zeros((5, 5)), np.zeros((5, 5))
    fn(expected, *args)
    written(got, *args)
    assert np.array_equal(got, expected)
    assert _for_loops(written) == (2 if fn is _loops else 0) < _for_loops(fn)
