"""fa2-numba-cuda's tensor-core kernels (``fa2_numba_cuda.forward_tc`` and the KV-cache split kernel,
``fa2_numba_cuda.kvcache_tc``; instructions in ``fa2_numba_cuda.mma``).

On the GPU the conformance suite runs it: ``fa2.attention`` on fp16/bf16 CUDA tensors with head_dim <= 128
dispatches to it (``test_dispatch_on_the_gpu`` checks that, and that no kernel spills). numba's simulator
cannot run inline PTX, so the suite's fp16 cases run the SIMT kernel there; this file checks the tensor-core
kernel's index math on the CPU instead, in two ways:

- numpy, anywhere: the PTX ISA's fragment tables (``mma.py``'s layout functions) against literal entries of
  the ISA's figures, and composed as the kernel composes them (ldmatrix row addresses from
  ``ldmatrix_a_row_col`` / ``ldmatrix_b_row_col``, mma, S's accumulators repacked as P's A fragment, V
  through ldmatrix.trans) into the warp's 16-row S = Q Kᵀ and P V, against numpy matmuls;
- the kernel itself under numba's simulator, with ``mma.py``'s Python emulation of ldmatrix, mma, cp.async
  and the warp shuffles (from the same tables; cp.async lands only at the wait, shared memory starts as NaN,
  every address is bounds-checked), on small blocks, against the fp64 reference with the suite's tolerances.

Both check the kernel against the ISA's tables, not the hardware: the GPU run is what shows the tables and
the hardware agree. The KV-cache split kernel on tensor cores runs by default for fp16/bf16, in the simulator
too (test_kvcache's fp16 cases take it there); its own cases here (the block shapes of HEAD_DIM 128 and 64,
plain loads, two row tiles, bf16) check that it is the kernel chosen and that it matches the reference, on
the simulator or, with --device cuda, on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fa2
from checks import assert_matches_reference, offsets, random_qkv
from fa2.spec import AttentionSpec
from fa2_numba_cuda import common, forward, forward_tc, forward_wgmma, mma, tensor_cores

SIMULATED = common.simulated()


# --- the ISA's tables ---------------------------------------------------------------------------------

# Literal entries of the PTX ISA's figures ("Matrix Fragments for mma.m16n8k16 with floating point type",
# "ldmatrix"): lanes 0, 5 (g = 1, t = 1) and 31 (g = 7, t = 3).
ISA_A = {
    0: [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)],
    5: [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)],
    31: [(7, 6), (7, 7), (15, 6), (15, 7), (7, 14), (7, 15), (15, 14), (15, 15)],
}
ISA_B = {
    0: [(0, 0), (1, 0), (8, 0), (9, 0)],
    5: [(2, 1), (3, 1), (10, 1), (11, 1)],
    31: [(6, 7), (7, 7), (14, 7), (15, 7)],
}
ISA_C = {
    0: [(0, 0), (0, 1), (8, 0), (8, 1)],
    5: [(1, 2), (1, 3), (9, 2), (9, 3)],
    31: [(7, 6), (7, 7), (15, 6), (15, 7)],
}


@pytest.mark.parametrize("lane", [0, 5, 31])
def test_fragment_tables_match_the_isa(lane):
    assert mma.mma_a_layout(lane) == ISA_A[lane]
    assert mma.mma_b_layout(lane) == ISA_B[lane]
    assert mma.mma_c_layout(lane) == ISA_C[lane]
    g, t = lane // 4, lane % 4
    assert mma.ldmatrix_layout(lane, False)[:2] == [(0, g, 2 * t), (0, g, 2 * t + 1)]
    assert mma.ldmatrix_layout(lane, True)[6:] == [(3, 2 * t, g), (3, 2 * t + 1, g)]


@pytest.mark.parametrize(
    "layout, shape",
    [
        pytest.param(mma.mma_a_layout, (16, 16), id="A"),
        pytest.param(mma.mma_b_layout, (16, 8), id="B"),
        pytest.param(mma.mma_c_layout, (16, 8), id="C"),
        pytest.param(lambda lane: mma.ldmatrix_layout(lane, False), (4, 8, 8), id="ldmatrix"),
        pytest.param(lambda lane: mma.ldmatrix_layout(lane, True), (4, 8, 8), id="ldmatrix.trans"),
    ],
)
def test_each_element_in_exactly_one_lane(layout, shape):
    seen = np.zeros(shape, dtype=int)
    for lane in range(32):
        for index in layout(lane):
            seen[index] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("kind, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_16_bit_encoding_rounds_as_torch(kind, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1000, generator=g) * 100, torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, -0.0])])
    bits = mma.encode16(x.numpy(), kind)
    assert np.array_equal(bits, x.to(dtype).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(mma.decode16(bits, kind), x.to(dtype).double().numpy())


def test_register_pairs_low_half_first():
    halves = np.array([[0x1234, 0xABCD, 0x0001, 0x8000]], dtype=np.uint16)
    regs = mma.pack(halves)
    assert regs.dtype == np.int32 and [hex(r) for r in regs[0].view(np.uint32)] == ["0xabcd1234", "0x80000001"]
    assert np.array_equal(mma.halves(regs), halves)


# --- the kernel's composition of them, one warp, numpy ------------------------------------------------


def _smem(x: np.ndarray, LD: int) -> np.ndarray:
    """x (rows, cols) as 16-bit patterns in a shared tile with rows padded to LD elements (poison after)."""
    tile = np.full((x.shape[0], LD), 0xFFFF, dtype=np.uint16)
    tile[:, : x.shape[1]] = x
    return tile


def _ldmatrix(tile: np.ndarray, row0: int, col0: int, row_col, trans: bool) -> np.ndarray:
    """ldmatrix.x4 for a warp whose lanes point at (row0, col0) + row_col.py_func(lane) of ``tile``."""
    rows = []
    for lane in range(32):
        r, c = row_col.py_func(lane)
        rows.append(tile[row0 + r, col0 + c : col0 + c + 8])
    return mma.emulate_ldmatrix(rows, trans)


@pytest.mark.parametrize("kind, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("HEAD_DIM, BLOCK_N", [(16, 16), (64, 32), (128, 64)])
def test_one_warp_s_and_pv_compose(kind, dtype, HEAD_DIM, BLOCK_N):
    """S = Q Kᵀ and O = P V for one warp's 16 rows, as the kernel's loops build them from the tables."""
    g = torch.Generator().manual_seed(HEAD_DIM)
    q, k, v = (torch.randn(n, HEAD_DIM, generator=g).to(dtype) for n in (16, BLOCK_N, BLOCK_N))

    def bits(t):
        return t.view(torch.int16).numpy().view(np.uint16)

    LD = HEAD_DIM + 8
    q_tile, k_tile, v_tile = _smem(bits(q), LD), _smem(bits(k), LD), _smem(bits(v), LD)

    q_frag = [_ldmatrix(q_tile, 0, 16 * kk, mma.ldmatrix_a_row_col, False) for kk in range(HEAD_DIM // 16)]
    s = np.zeros((BLOCK_N // 8, 32, 4), dtype=np.float32)  # [8-key tile, lane, c0..c3]
    for jj in range(BLOCK_N // 16):
        for kk in range(HEAD_DIM // 16):
            b = _ldmatrix(k_tile, 16 * jj, 16 * kk, mma.ldmatrix_b_row_col, False)
            s[2 * jj] = mma.emulate_mma(q_frag[kk], b[:, 0:2], s[2 * jj], kind)
            s[2 * jj + 1] = mma.emulate_mma(q_frag[kk], b[:, 2:4], s[2 * jj + 1], kind)
    S = np.zeros((16, BLOCK_N))
    for j in range(BLOCK_N // 8):
        for lane in range(32):
            for e, (m, n) in enumerate(mma.mma_c_layout(lane)):
                S[m, 8 * j + n] = s[j, lane, e]
    S_ref = q.double().numpy() @ k.double().numpy().T
    np.testing.assert_allclose(S, S_ref, rtol=0, atol=1e-4 * np.abs(S_ref).max())

    # P: any values in S's accumulator layout; the kernel packs (c0, c1) and (c2, c3) of tiles 2kk, 2kk+1.
    p = np.random.default_rng(0).random(s.shape, dtype=np.float32)
    acc = np.zeros((HEAD_DIM // 8, 32, 4), dtype=np.float32)
    for kk in range(BLOCK_N // 16):
        pairs = [(2 * kk, 0), (2 * kk, 2), (2 * kk + 1, 0), (2 * kk + 1, 2)]
        a = np.stack([mma.pack(mma.encode16(p[j, :, e : e + 2], kind))[:, 0] for j, e in pairs], axis=1)
        for dd in range(HEAD_DIM // 16):
            b = _ldmatrix(v_tile, 16 * kk, 16 * dd, mma.ldmatrix_a_row_col, True)
            acc[2 * dd] = mma.emulate_mma(a, b[:, 0:2], acc[2 * dd], kind)
            acc[2 * dd + 1] = mma.emulate_mma(a, b[:, 2:4], acc[2 * dd + 1], kind)
    P, O = np.zeros((16, BLOCK_N)), np.zeros((16, HEAD_DIM))
    for lane in range(32):
        for e, (m, n) in enumerate(mma.mma_c_layout(lane)):
            for j in range(BLOCK_N // 8):
                P[m, 8 * j + n] = mma.decode16(mma.encode16(p[j, lane, e], kind), kind)
            for c in range(HEAD_DIM // 8):
                O[m, 8 * c + n] = acc[c, lane, e]
    O_ref = P @ v.double().numpy()
    np.testing.assert_allclose(O, O_ref, rtol=0, atol=1e-5 * np.abs(O_ref).max())


# --- the kernel under numba's simulator ---------------------------------------------------------------

needs_simulator = pytest.mark.skipif(
    not SIMULATED,
    reason="runs the kernel on mma.py's emulated instructions: needs NUMBA_ENABLE_CUDASIM=1 "
    "(on a GPU, the conformance suite runs the kernel itself)",
)


@pytest.fixture(autouse=True)
def mma_sync_forward(monkeypatch):
    """These tests are forward_tc's: on a Hopper GPU the default dispatch would run forward_wgmma's kernel on
    fp16 and bf16 inputs at head_dim 64 and 128 (with or without features), so its switch is off here."""
    monkeypatch.setattr(forward_wgmma, "ENABLED", False)


def _run_tc(q, k, v, causal, scale, config, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    window = (window[0], 0) if causal else window
    spec = AttentionSpec(scale, window, softcap, alibi_slopes, q.shape[1] // k.shape[1])
    return forward.flash_attn_forward(q, k, v, spec, config, tensor_cores=True)


def _case(dtype, b, h, n_q, n_k, d, causal, config, scale=None):
    kind, mask = "bf16" if dtype == torch.bfloat16 else "fp16", "causal" if causal else "full"
    warps, block_n, _, ahead = tuple(config)[:4]
    name = f"{kind}-B{b}-H{h}-{n_q}x{n_k}-D{d}-{mask}-{warps}w{block_n}" + ("-ahead" if ahead else "")
    return pytest.param(
        dtype, (b, h, n_q, n_k, d), causal, config, scale, id=name + (f"-scale{scale}" if scale is not None else "")
    )


SMALL, SMALL_AHEAD, ONE_WARP = (2, 16, 0, False), (2, 16, 0, True), (1, 16, 0, False)
SIM_CASES = [
    # several key and query tiles, masked key tiles, head_dim padded 24 -> 32
    _case(torch.float16, 1, 2, 37, 53, 24, True, SMALL),
    _case(torch.float16, 1, 2, 37, 53, 24, True, SMALL_AHEAD),
    # seqlen_q > seqlen_k: causal rows that see no key (O = 0, L = +inf)
    _case(torch.bfloat16, 1, 1, 37, 19, 16, True, ONE_WARP),
    _case(torch.bfloat16, 1, 1, 37, 19, 16, True, SMALL_AHEAD),
    # S_AHEAD's pairs of key tiles: one tile, an odd number, an even number
    _case(torch.bfloat16, 1, 1, 20, 16, 16, False, SMALL_AHEAD),
    _case(torch.float16, 1, 1, 20, 48, 48, True, SMALL_AHEAD),
    _case(torch.bfloat16, 2, 1, 33, 70, 40, False, (2, 32, 0, True), 2.5),
    # odd head_dim: O stored element by element; rows not 16 B apart: plain loads
    _case(torch.float16, 1, 1, 21, 30, 13, True, ONE_WARP),
    # scale < 0 (q's sign flipped in registers) and scale = 0
    _case(torch.bfloat16, 1, 1, 19, 37, 16, True, ONE_WARP, -0.7),
    _case(torch.float16, 1, 1, 19, 37, 16, False, SMALL_AHEAD, 0.0),
    # the GPU's block shapes (tc_config)
    _case(torch.float16, 1, 1, 100, 70, 64, False, forward_tc.tc_config(64)),
    _case(torch.bfloat16, 1, 1, 70, 80, 128, True, forward_tc.tc_config(128)),
]


@needs_simulator
@pytest.mark.parametrize("dtype, shape, causal, config, scale", SIM_CASES)
def test_simulated_kernel_matches_reference(dtype, shape, causal, config, scale):
    b, h, n_q, n_k, d = shape
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, "cpu", seed=n_q + n_k)
    O, L = _run_tc(q, k, v, causal, d**-0.5 if scale is None else scale, config)
    assert_matches_reference(O, L, q, k, v, causal, scale)


def _layouts(dtype):
    """q as (B, N, H, D) memory (cp.async with strides), k with a head_dim stride of 2 and v starting one
    element into its buffer (both: plain loads)."""
    g = torch.Generator().manual_seed(3)

    def make(*s):
        return torch.randn(*s, generator=g).to(dtype)

    q = make(1, 20, 2, 32).transpose(1, 2)
    k = make(1, 2, 41, 64)[..., ::2]
    v = make(2 * 41 * 32 + 1)[1:].view(1, 2, 41, 32)
    return q, k, v


@needs_simulator
def test_simulated_kernel_strided_inputs():
    q, k, v = _layouts(torch.float16)
    assert common.rows_16b_aligned(q) and not common.rows_16b_aligned(k)
    assert not common.rows_16b_aligned(v)
    O, L = _run_tc(q, k, v, True, 32**-0.5, SMALL)
    assert_matches_reference(O, L, q, k, v, True)
    O2, L2 = _run_tc(q, k.contiguous(), v.contiguous(), True, 32**-0.5, SMALL)
    assert torch.equal(O, O2) and torch.equal(L, L2), "cp.async and plain loads gave different bits"


@needs_simulator
def test_simulated_kernel_huge_scores():
    """Inputs ×60 (scores ~10⁴): the running max moves by thousands between key tiles."""
    q, k, v = (60 * t for t in random_qkv((1, 1, 20, 32), (1, 1, 50, 32), torch.float16, "cpu", seed=7))
    O, L = _run_tc(q, k, v, False, 32**-0.5, SMALL_AHEAD)
    assert torch.isfinite(O).all() and torch.isfinite(L).all()
    assert_matches_reference(O, L, q, k, v, False)


def _feature_case(
    dtype, b, h, h_k, n_q, n_k, d, config, causal=False, window=(-1, -1), softcap=0.0, alibi=None, gain=1.0, scale=None
):
    """alibi: None, "head" (one slope per head, expanded over batch with stride 0) or "batch"."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    warps, block_n, _, ahead = tuple(config)[:4]
    parts = [kind, f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else ""), f"{n_q}x{n_k}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}-x{gain:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    parts += [f"scale{scale}"] if scale is not None else []
    parts += [f"{warps}w{block_n}" + ("-ahead" if ahead else "")]
    case = dict(
        shape=(b, h, h_k, n_q, n_k, d),
        config=config,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi=alibi,
        gain=gain,
        scale=scale,
    )
    return pytest.param(dtype, case, id="-".join(parts))


FEATURE_SIM_CASES = [
    # both window edges inside the keys: later blocks start past key tile 0, edge tiles masked per warp
    _feature_case(torch.float16, 1, 1, 1, 37, 53, 16, SMALL, window=(5, 3)),
    _feature_case(torch.float16, 1, 1, 1, 37, 53, 16, SMALL_AHEAD, window=(5, 3)),
    # a right bound alone, past the diagonal (row_max's mask without a left bound, tiles masked from a
    # right edge that is not causal's)
    _feature_case(torch.float16, 1, 1, 1, 37, 53, 16, SMALL_AHEAD, window=(-1, 3)),
    # seqlen_q > seqlen_k with a window: rows that see no key (O = 0, L = +inf), left = 0 with right > 0
    _feature_case(torch.bfloat16, 1, 1, 1, 37, 19, 16, ONE_WARP, window=(0, 2)),
    # causal with a left bound, GQA, S_AHEAD's pairs of tiles starting past 0
    _feature_case(torch.float16, 1, 2, 1, 40, 70, 32, SMALL_AHEAD, causal=True, window=(20, 0)),
    # four warps whose windows start one key tile apart: each skips the block's first or last tiles, S_AHEAD's
    # S of a warp's first tile coming from either buffer
    _feature_case(torch.float16, 1, 1, 1, 64, 80, 16, (4, 16, 0, True), causal=True, window=(10, 0)),
    # the GPU's D128 block shape with both window edges and a softcap: row_max's per-element mask (a left bound
    # at D128), the end of the keys inside the last tile
    _feature_case(
        torch.bfloat16, 1, 1, 1, 70, 90, 128, forward_tc.tc_config(128), window=(20, 3), softcap=5.0, gain=2.0
    ),
    # softcap on large scores, with and without S_AHEAD; a negative scale (q's sign flipped)
    _feature_case(torch.float16, 1, 1, 1, 20, 48, 16, SMALL_AHEAD, softcap=5.0, gain=4.0),
    _feature_case(torch.bfloat16, 1, 1, 1, 29, 17, 32, SMALL, causal=True, softcap=2.0, gain=3.0, scale=-0.4),
    # ALiBi per head (batch stride 0) and per (batch, head), alone and with everything else
    _feature_case(torch.float16, 2, 2, 2, 17, 29, 16, ONE_WARP, alibi="head"),
    _feature_case(
        torch.bfloat16,
        2,
        2,
        1,
        33,
        47,
        16,
        SMALL_AHEAD,
        causal=True,
        window=(9, 0),
        softcap=8.0,
        gain=3.0,
        alibi="batch",
    ),
]


@needs_simulator
@pytest.mark.parametrize("dtype, case", FEATURE_SIM_CASES)
def test_simulated_kernel_features(dtype, case):
    """Windows, softcap and ALiBi in the tensor-core kernel against the fp64 reference."""
    b, h, h_k, n_q, n_k, d = case["shape"]
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, "cpu", seed=n_q + n_k + d)
    q, k = q * case["gain"], k * case["gain"]
    slopes = None
    if case["alibi"] is not None:
        g = torch.Generator().manual_seed(n_q)
        slopes = torch.rand(h, generator=g) * 0.3
        slopes = slopes.expand(b, h) if case["alibi"] == "head" else torch.rand(b, h, generator=g) * 0.3
    scale = d**-0.5 if case["scale"] is None else case["scale"]
    window = (case["window"][0], 0) if case["causal"] else case["window"]
    O, L = _run_tc(q, k, v, case["causal"], scale, case["config"], window, case["softcap"], slopes)
    assert_matches_reference(
        O, L, q, k, v, case["causal"], scale, window=window, softcap=case["softcap"], alibi_slopes=slopes
    )


@needs_simulator
def test_simulated_kernel_window_skips_key_tiles():
    """Key tiles no row's window reaches are never loaded: NaN there changes nothing (a kernel that loaded
    and masked them would still meet 0 · NaN in P V)."""
    q, k, v = random_qkv((1, 1, 16, 16), (1, 1, 96, 16), torch.float16, "cpu", seed=11)
    # Query i sees keys [i + 80 - 8, i + 80]: from 72 on; the 16-key tiles below 64 are skipped.
    k[..., :64, :] = float("nan")
    v[..., :64, :] = float("nan")
    O, L = _run_tc(q, k, v, False, 0.25, ONE_WARP, window=(8, 0))
    assert not torch.isnan(O).any() and not torch.isnan(L).any(), "a key tile outside the window was read"
    assert_matches_reference(O, L, q, k[..., 64:, :], v[..., 64:, :], False, 0.25, window=(8, 0))


@needs_simulator
def test_simulated_kernel_no_keys():
    q = torch.randn(1, 2, 5, 16, dtype=torch.float16)
    k = v = torch.randn(1, 2, 0, 16, dtype=torch.float16)
    O, L = _run_tc(q, k, v, False, 0.25, ONE_WARP)
    assert (O == 0).all() and torch.isposinf(L).all()


# Packed (varlen) batches: q (1, h, total_q, d), k, v (1, h_k, total_k, d), views of (total, heads, d) tensors
# as fa2.varlen_attention passes them; one launch, each block reading its sequence's offsets.


def _packed(lens, h, d, dtype, g):
    x = torch.randn(sum(lens), h, d, generator=g).to(dtype)
    return x.transpose(0, 1).unsqueeze(0)


def _run_tc_varlen(q, k, v, lens_q, lens_k, scale, config, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    spec = AttentionSpec(
        scale,
        window,
        softcap,
        alibi_slopes,
        q.shape[1] // k.shape[1],
        offsets(lens_q, "cpu"),
        offsets(lens_k, "cpu"),
        max(lens_q),
        max(lens_k),
    )
    return forward.flash_attn_forward(q, k, v, spec, config, tensor_cores=True)


def _varlen_case(
    dtype, lens_q, lens_k, h, h_k, d, config, causal=False, window=(-1, -1), softcap=0.0, alibi=False, gain=1.0
):
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    warps, block_n, _, ahead = tuple(config)[:4]
    parts = [kind, f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}", f"H{h}-Hk{h_k}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}-x{gain:g}"] if softcap else []
    parts += ["alibi"] if alibi else []
    parts += [f"{warps}w{block_n}" + ("-ahead" if ahead else "")]
    case = dict(
        lens_q=lens_q,
        lens_k=lens_k,
        h=h,
        h_k=h_k,
        d=d,
        config=config,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi=alibi,
        gain=gain,
    )
    return pytest.param(dtype, case, id="-".join(parts))


VARLEN_SIM_CASES = [
    # lengths 0 and 1 and Nq != Nk both ways around the 32-row query and 16-key tiles, GQA, head_dim padded
    # 24 -> 32 (cp.async from the packed rows); causal rows that see no key (20 queries against 9 keys, 1
    # against 0); S_AHEAD's pairs of key tiles, starting and ending per sequence
    _varlen_case(torch.float16, [37, 0, 1, 20, 16], [53, 4, 0, 9, 33], 2, 1, 24, SMALL_AHEAD, causal=True),
    # a window inside each sequence's keys, softcap on large scores, ALiBi per (sequence, head); odd head_dim:
    # plain loads, O element by element
    _varlen_case(
        torch.bfloat16, [17, 33, 2], [29, 19, 2], 2, 2, 13, ONE_WARP, window=(5, 3), softcap=5.0, alibi=True, gain=3.0
    ),
    # a batch of one; four warps whose windows start one key tile apart (each skips some of the block's tiles)
    _varlen_case(torch.float16, [64], [80], 1, 1, 16, (4, 16, 0, True), causal=True, window=(10, 0)),
]


@needs_simulator
@pytest.mark.parametrize("dtype, case", VARLEN_SIM_CASES)
def test_simulated_kernel_varlen(dtype, case):
    """Each sequence of a packed batch against the fp64 reference of that sequence alone."""
    lens_q, lens_k, h, h_k, d = (case[x] for x in ("lens_q", "lens_k", "h", "h_k", "d"))
    g = torch.Generator().manual_seed(sum(lens_q) + d)
    q, k, v = _packed(lens_q, h, d, dtype, g), _packed(lens_k, h_k, d, dtype, g), _packed(lens_k, h_k, d, dtype, g)
    q, k = q * case["gain"], k * case["gain"]
    slopes = torch.rand(len(lens_q), h, generator=g) * 0.3 if case["alibi"] else None
    window = (case["window"][0], 0) if case["causal"] else case["window"]
    O, L = _run_tc_varlen(q, k, v, lens_q, lens_k, d**-0.5, case["config"], window, case["softcap"], slopes)
    assert O.shape == q.shape and L.shape == q.shape[:-1]
    starts_q, starts_k = offsets(lens_q, "cpu").tolist(), offsets(lens_k, "cpu").tolist()
    for s in range(len(lens_q)):
        rows, keys = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        own = None if slopes is None else slopes[s : s + 1]
        assert_matches_reference(
            O[:, :, rows],
            L[:, :, rows],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            case["causal"],
            d**-0.5,
            window=window,
            softcap=case["softcap"],
            alibi_slopes=own,
        )


@needs_simulator
def test_simulated_kernel_varlen_window_skips_key_tiles():
    """Per sequence, the key tiles no row's window reaches are never loaded: NaN there changes nothing."""
    g = torch.Generator().manual_seed(12)
    lens_q, lens_k = [16, 16], [96, 96]
    q, k, v = (_packed(n, 1, 16, torch.float16, g) for n in (lens_q, lens_k, lens_k))
    # Query i of either sequence sees its keys [i + 72, i + 80]: the 16-key tiles below 64 of each are skipped.
    for start in (0, 96):
        k[..., start : start + 64, :] = float("nan")
        v[..., start : start + 64, :] = float("nan")
    O, L = _run_tc_varlen(q, k, v, lens_q, lens_k, 0.25, ONE_WARP, window=(8, 0))
    assert not torch.isnan(O).any() and not torch.isnan(L).any(), "a key tile outside the window was read"
    for s, start in enumerate((0, 96)):
        rows, keys = slice(16 * s, 16 * s + 16), slice(start + 64, start + 96)
        assert_matches_reference(
            O[:, :, rows], L[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], False, 0.25, window=(8, 0)
        )


# --- the KV-cache split kernel on tensor cores (``kvcache_tc``) -----------------------------------------
# fa2's decode path takes it by default for fp16/bf16 with head_dim <= 128, under the simulator too (decode
# blocks are small), so test_kvcache's fp16 cases run it there; these add what those D-16 cases leave out:
# the two-warp block of HEAD_DIM 128, HEAD_DIM 64, a head_dim padded with plain loads, more than 16 query rows
# (two row tiles), bf16, a negative scale. On a GPU (--device cuda) they run the compiled kernel.


def _kv(dtype, scale=None, **case):
    """A test_kvcache case (its ``_case`` arguments) in ``dtype``, optionally with another scale."""
    from test_kvcache import _case as kv_case

    param = kv_case(**case)
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    suffix = f"-scale{scale}" if scale is not None else ""
    return pytest.param(dtype, param.values[0], scale, id=f"{kind}-{param.id}{suffix}")


KV_TC_CASES = [
    # HEAD_DIM 128: two warps of 16 keys a 32-key tile; 4 tokens x group 4 = 16 rows; pages of 16; two splits
    _kv(torch.bfloat16, q=4, b=1, h=8, hk=2, d=128, cap=80, seqlens=(70,), page=16, splits=2),
    # HEAD_DIM 64 (four warps, 64-key tiles), one token of GQA 4: leftpad, a left window, softcap, ALiBi per
    # row; no split (O in fp16, natural L); a negative scale
    _kv(
        torch.float16,
        -0.2,
        q=1,
        b=2,
        h=4,
        hk=1,
        d=64,
        cap=100,
        seqlens=(100, 41),
        leftpad=(3, 0),
        window=(20, -1),
        softcap=4.0,
        alibi="row",
        splits=1,
    ),
    # head_dim 36 padded to 64 (rows 72 B apart: plain loads); 5 tokens x group 4 = 20 rows, two row tiles;
    # cache_batch_idx, a row with no key; the backend picks the splits
    _kv(torch.float16, q=5, b=2, h=4, hk=1, d=36, cap=50, seqlens=(50, 0), batch_idx=(1, 0), splits=0),
    # packed queries with a block table, three splits
    _kv(torch.bfloat16, varlen=(2, 5), b=2, h=4, hk=2, d=32, cap=48, seqlens=(48, 20), page=16, splits=3),
    # 37 splits of a key tile each (64 keys at head_dim 32), the last five past K_b and one ending inside it,
    # in pages of 64: the combine's lanes each hold splits of the row, its groups of UNROLL a partial one
    _kv(torch.float16, q=1, b=1, h=2, hk=1, d=32, cap=37 * 64, seqlens=(2000,), page=64, splits=37),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, case, scale", KV_TC_CASES)
def test_kvcache_tensor_core_kernel(device, monkeypatch, dtype, case, scale, causal):
    """kvcache_forward's default choice for fp16/bf16 is the tensor-core split kernel (the SIMT one never
    built), and it matches ``fa2.reference.kvcache_attention`` with test_kvcache's tolerances."""
    import dataclasses

    from fa2_numba_cuda import kvcache, kvcache_simt, kvcache_tc
    from test_kvcache import _make, assert_matches_kvcache_reference

    if SIMULATED != (device.type == "cpu"):
        pytest.skip(f"the kernel runs on CUDA tensors, or on CPU tensors under numba's simulator; got {device}")
    if device.type == "cuda" and torch.cuda.get_device_capability() < tensor_cores.MIN_COMPUTE_CAPABILITY:
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} < 8.0: the SIMT kernel runs")
    q, k_cache, v_cache, spec = _make(case, causal, dtype, device, seed=case["cap"] + case["d"])
    if scale is not None:
        spec = dataclasses.replace(spec, scale=scale)
    assert kvcache.uses_tensor_cores(q)
    built = []
    real = kvcache_tc.kernel
    monkeypatch.setattr(kvcache_tc, "kernel", lambda *key: built.append(key) or real(*key))
    monkeypatch.setattr(kvcache_simt, "kernel", lambda *key: pytest.fail(f"the SIMT split kernel ran: {key}"))
    monkeypatch.setattr(kvcache, "_PREPARED", {})  # a prepared class would launch without asking for a kernel
    O, L = kvcache.kvcache_forward(q, k_cache, v_cache, spec)
    head_dim = kvcache.padded_head_dim(case["d"])
    assert built and built[0][:2] == (head_dim, kvcache_tc.tc_decode_config(head_dim)), built
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


KV_STAGES_CASES = [
    # HEAD_DIM 64 (64-key tiles), three stages (55,808 B: dynamic shared memory), pages of 16; row 2's split 1
    # past its keys and its split 0 of 3 tiles
    pytest.param(
        3, _kv(torch.float16, q=4, b=2, h=4, hk=2, d=64, cap=400, seqlens=(400, 150), page=16, splits=2), id="stages3"
    ),
    # HEAD_DIM 128 (64-key tiles), four stages, contiguous, one split of 5 tiles and one of 2
    pytest.param(
        4, _kv(torch.bfloat16, q=1, b=2, h=4, hk=1, d=128, cap=288, seqlens=(288, 70), splits=1), id="stages4"
    ),
]


@pytest.mark.parametrize("stages, kv", KV_STAGES_CASES)
def test_kvcache_tensor_core_kernel_stages(device, stages, kv):
    """The tensor-core split kernel with more stages than its default two (``TensorCoreDecodeConfig.STAGES``:
    tiles in dynamic shared memory, STAGES - 1 tiles' copies issued ahead) matches the reference."""
    from fa2_numba_cuda import kvcache, kvcache_tc
    from test_kvcache import _make, assert_matches_kvcache_reference

    dtype, case, _ = kv.values
    if SIMULATED != (device.type == "cpu"):
        pytest.skip(f"the kernel runs on CUDA tensors, or on CPU tensors under numba's simulator; got {device}")
    if device.type == "cuda" and torch.cuda.get_device_capability() < tensor_cores.MIN_COMPUTE_CAPABILITY:
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} < 8.0: no tensor-core kernel")
    q, k_cache, v_cache, spec = _make(case, False, dtype, device, seed=stages)
    head_dim = kvcache.padded_head_dim(case["d"])
    config = kvcache_tc.tc_decode_config(head_dim)._replace(STAGES=stages)
    assert kvcache_tc.dynamic_shared_bytes(head_dim, config) > 0
    O, L = kvcache.kvcache_forward(q, k_cache, v_cache, spec, config=config)
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


@pytest.mark.skipif(
    SIMULATED or not torch.cuda.is_available(),
    reason=("registers and local memory of the compiled kernel: a CUDA GPU of compute capability 8.0+ only"),
)
@pytest.mark.parametrize("page", [None, 256, 16], ids=["contiguous", "paged256", "paged16"])
def test_kvcache_tensor_core_kernel_on_the_gpu(page):
    """The decode benchmark's class (bf16, 32 query / 8 key-value heads, D 128, one token, split): the
    tensor-core kernel runs, matches the reference, and keeps its registers (offline, ptxas 13.0 sm_90, 176
    registers: contiguous 24 B of local memory, pages of 16 16 B, spills outside the key loop; pages of 256
    none)."""
    from fa2_numba_cuda import kvcache
    from test_kvcache import _make, assert_matches_kvcache_reference

    if torch.cuda.get_device_capability() < tensor_cores.MIN_COMPUTE_CAPABILITY:
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} < 8.0: the SIMT kernel runs")
    case = dict(
        q=1,
        b=2,
        h=32,
        hk=8,
        d=128,
        cap=4096,
        seqlens=[4096, 2999],
        leftpad=None,
        batch_idx=None,
        page=page,
        window=(-1, -1),
        softcap=0.0,
        alibi=None,
        splits=0,
        varlen=None,
    )
    q, k_cache, v_cache, spec = _make(case, False, torch.bfloat16, "cuda", seed=5)
    O, L = kvcache.kvcache_forward(q, k_cache, v_cache, spec)
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)
    # switches: (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED, BATCH_IDX, LEFTPAD, SPLIT, SINK, IS_BF16, ...)
    rows = [
        r
        for r in kvcache.kernel_resources()
        if r["kernel"] == "kvcache-tensor-core"
        and r["HEAD_DIM"] == 128
        and r["switches"][:6] == [False] * 5 + [page is not None]
        and r["switches"][8]
    ]
    print(f"\nkvcache tensor-core kernel ({f'paged {page}' if page else 'contiguous'}): {rows}")
    assert rows, "the tensor-core split kernel of this class did not run"
    assert all(r["local_bytes_per_thread"] <= 64 for r in rows), f"local memory: {rows}"


def test_kvcache_kernel_choice_by_dtype_and_head_dim(device):
    """fp16/bf16 with head_dim <= 128 take the tensor-core split kernel (on compute capability 8.0+, or under
    the simulator); fp32 and head_dim > 128 keep the SIMT one, and forcing the tensor-core one on them is
    refused."""
    from fa2_numba_cuda import kvcache

    if SIMULATED != (device.type == "cpu"):
        pytest.skip(f"the kernels run on CUDA tensors, or on CPU tensors under numba's simulator; got {device}")
    q = torch.zeros(1, 4, 1, 64, device=device)
    capable = SIMULATED or torch.cuda.get_device_capability() >= tensor_cores.MIN_COMPUTE_CAPABILITY
    assert kvcache.uses_tensor_cores(q.half()) == capable and kvcache.uses_tensor_cores(q.bfloat16()) == capable
    assert not kvcache.uses_tensor_cores(q) and not kvcache.uses_tensor_cores(torch.zeros(1, 4, 1, 160).half())
    spec = AttentionSpec(0.125, cache_seqlens=torch.ones(1, dtype=torch.int32, device=device))
    cache = torch.zeros(1, 4, 8, 64, device=device)
    with pytest.raises(NotImplementedError, match="fp16 or bf16 with head_dim up to 128, got torch.float32"):
        kvcache.kvcache_forward(q, cache, cache, spec, tensor_cores=True)


def test_cpu_tensors_and_fp32_keep_the_simt_kernel():
    q = torch.zeros(1, 1, 4, 64)
    assert not forward_tc.uses_tensor_cores(q) and not forward_tc.uses_tensor_cores(q.half())


def test_refusals_name_the_limit():
    q = torch.zeros(1, 1, 4, 160, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="head_dim up to 128, got 160"):
        forward_tc.flash_attn_forward(q, q, q, AttentionSpec(1.0))
    with pytest.raises(NotImplementedError, match="fp16 or bf16, got torch.float32"):
        forward_tc.flash_attn_forward(q[..., :64].float(), q[..., :64].float(), q[..., :64].float(), AttentionSpec(1.0))


# --- on the GPU -----------------------------------------------------------------------------------------


@pytest.mark.skipif(
    SIMULATED or not torch.cuda.is_available(),
    reason=(
        "numba's simulator cannot run inline PTX (mma.sync, ldmatrix, cp.async): the tensor-core kernel runs on "
        "a CUDA GPU of compute capability 8.0+ only"
    ),
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dispatch_on_the_gpu(dtype, head_dim, causal):
    """fp16/bf16 with head_dim <= 128 on sm80+ take the tensor-core kernel (with the wgmma kernel switched off, as
    in this whole file: on Hopper it takes these inputs by default, test_numba_cuda_wgmma_forward), which matches
    the reference across several blocks and key tiles; its registers stay registers (tc_config: at most 24 B of local
    memory, spilled outside the key loop; fragments left in local arrays would take hundreds)."""
    if torch.cuda.get_device_capability() < tensor_cores.MIN_COMPUTE_CAPABILITY:
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} < 8.0: the SIMT kernel runs")
    q, k, v = random_qkv((2, 3, 300, head_dim), (2, 3, 333, head_dim), dtype, "cuda", seed=head_dim)
    assert forward_tc.uses_tensor_cores(q)
    before = len(forward_tc._KERNELS)
    O, L = fa2.attention(q, k, v, causal=causal, backend="numba-cuda")
    assert_matches_reference(O, L, q, k, v, causal)
    assert len(forward_tc._KERNELS) >= max(before, 1)
    is_bf16 = dtype == torch.bfloat16
    # Features (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN): causal is a right bound; then SINK, IS_BF16, EVEN_HEAD_DIM,
    # ASYNC_LOADS, O_PAIRS (``forward_tc._KERNELS``' key).
    key = (
        head_dim,
        forward_tc.tc_config(head_dim),
        False,
        causal,
        False,
        False,
        False,
        False,
        is_bf16,
        True,
        True,
        True,
    )
    assert key in forward_tc._KERNELS, f"the tensor-core kernel {key} did not run"
    rows = [
        r
        for r in forward_tc.kernel_resources()
        if (r["HEAD_DIM"], r["left"], r["right"], r["softcap"], r["alibi"], r["bf16"], r["async_loads"])
        == (head_dim, False, causal, False, False, is_bf16, True)
    ]
    assert rows and all(r["local_bytes_per_thread"] <= 64 for r in rows), f"local memory: {rows}"
