"""One conformance suite for every fa2 backend: the same tests, parametrized by backend (see conftest.py).

Emulated backends (Triton's interpreter, numba's CUDA simulator) run the same tests on shapes small enough
for CI; a shape over a backend's budget is skipped with the reason, and runs on a GPU with --device cuda.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, random_qkv
from fa2 import registry

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _shape(b, h, n_q, n_k, d):
    return pytest.param((b, h, n_q, n_k, d), id=f"B{b}-H{h}-{n_q}x{n_k}-D{d}")


# (batch, heads, seqlen_q, seqlen_k, head_dim): awkward lengths around tile edges, both orders of unequal
# lengths (seqlen_q > seqlen_k leaves causal rows with no key), every common head_dim.
SHAPES = [
    _shape(1, 1, 1, 1, 16),
    _shape(2, 3, 17, 17, 32),
    _shape(1, 1, 19, 37, 16),
    _shape(1, 1, 37, 19, 16),
    _shape(1, 2, 113, 203, 64),
    _shape(1, 2, 203, 113, 64),
    _shape(2, 2, 128, 128, 128),
    _shape(1, 1, 65, 97, 256),
    _shape(1, 2, 1023, 1024, 64),
    _shape(1, 2, 1024, 1023, 128),
    _shape(1, 1, 4093, 4099, 128),
    _shape(2, 4, 4096, 4096, 64),
]

# The most B·H·seqlen_q·seqlen_k·head_dim a test gives a backend that is not on a GPU. Triton's interpreter
# runs one program (a whole tile) at a time in NumPy, fast enough for pytorch's budget and the GPU's tiles;
# numba's simulator runs a Python thread per GPU thread, so its budget is small.
CPU_BUDGET = {"pytorch": 3e8, "triton": 3e8, "numba-cuda": 2e5}
# fa2-triton's fp32 tiles (FMA matmuls, 32 x 32 from D = 64) make many more interpreted programs than its 16-bit
# ones for one shape (fp32 B2-H8-300x300-D128 with ALiBi: 137 s of a loaded CI worker, fp16 24 s): in the
# interpreter fp32 keeps the shapes up to 1e8, the larger ones run in fp16 there and in fp32 on the GPU.
TRITON_FP32_CPU_BUDGET = 1e8

# Combinations an emulator gets wrong or lacks; each is covered natively on the GPU.
EMULATOR_GAPS = {
    ("triton", torch.bfloat16): "Triton's interpreter computes bf16 tl.dot wrongly, so fa2-triton refuses bf16 "
    "there (test_triton_launch checks the refusal); bf16 is tested on the GPU",
    ("numba-cuda", torch.bfloat16): "numba's CUDA simulator has no bfloat16; bf16 is tested on the GPU",
}


def require_runnable(backend, status, device, dtype, shape):
    """Skips, with the reason, a case the backend cannot run here in reasonable time or at all."""
    if status == "emulated" and (backend, dtype) in EMULATOR_GAPS:
        pytest.skip(EMULATOR_GAPS[backend, dtype])
    work = math.prod(shape)
    budget = CPU_BUDGET.get(backend, 0)
    if status == "emulated" and backend == "triton" and dtype == torch.float32:
        budget = TRITON_FP32_CPU_BUDGET
    if device.type == "cpu" and work > budget:
        pytest.skip(
            f"B*H*Nq*Nk*D = {work:.2g} is over {backend}'s CPU budget {budget:.0g} "
            f"({status}{', fp32' if budget != CPU_BUDGET.get(backend, 0) else ''}); run with --device cuda on a GPU"
        )


def simulated_subset(backend, status, keep: bool, why: str):
    """Skips, with the reason, a case that numba-cuda's CUDA simulator leaves to the GPU. The simulator is
    most of the CPU run's time (15 of its 21 minutes at 26519a3, measured with nox -s test), and it is there
    for index math: where a test's cases differ only in what happens before the kernels (a packing of the
    inputs, a flag the kernels do not read) or repeat a kernel path in the other dtype, it runs the cases
    that ``keep`` names, ``why`` says which; every case runs on the GPU (nox -s test_gpu)."""
    if backend == "numba-cuda" and status == "emulated" and not keep:
        pytest.skip(f"numba-cuda's simulator runs {why}; this case runs on the GPU (nox -s test_gpu)")


def emulated_subset(backend, status, keep: bool, why: str):
    """``simulated_subset`` for both emulators, Triton's interpreter too: a case whose code is the shared
    interface's (fa2-pytorch runs it natively on the CPU) or whose property only a GPU can break, that the
    emulated backends leave to the GPU; ``why`` says what they run instead."""
    if backend != "pytorch" and status == "emulated" and not keep:
        pytest.skip(f"{backend} emulated runs {why}; this case runs on the GPU (nox -s test_gpu)")


def run(backend, q, k, v, causal=False, scale=None):
    """fa2.attention, with a backend's documented refusal (NotImplementedError) turned into a skip."""
    try:
        return fa2.attention(q, k, v, causal=causal, scale=scale, backend=backend)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(backend, status, device, dtype, causal, shape):
    b, h, n_q, n_k, d = shape
    require_runnable(backend, status, device, dtype, shape)
    q, k, v = random_qkv((b, h, n_q, d), (b, h, n_k, d), dtype, device, seed=n_q * 7 + n_k)
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal)


@pytest.mark.parametrize(
    "shape_q, shape_k",
    [
        pytest.param((3, 17, 32), (3, 29, 32), id="BND-3x17x29-D32"),
        pytest.param((2, 2, 2, 17, 16), (2, 2, 2, 9, 16), id="5D-2x2x2-17x9-D16"),
        pytest.param((17, 16), (23, 16), id="ND-17x23-D16"),
    ],
)
@pytest.mark.parametrize("causal", CAUSAL)
def test_any_leading_dims(backend, status, device, causal, shape_q, shape_k):
    require_runnable(backend, status, device, torch.float16, shape_q[:-1] + shape_k[-2:])
    q, k, v = random_qkv(shape_q, shape_k, torch.float16, device, seed=1)
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal)


def _gqa(h, h_k, b, n_q, n_k, d):
    kind = "-mqa" if h_k == 1 else ""
    return pytest.param((h, h_k), (b, n_q, n_k, d), id=f"H{h}-Hk{h_k}{kind}-B{b}-{n_q}x{n_k}-D{d}")


# (heads, heads_k) with a shape: groups of 2, 3 and 8 and one key/value head (MQA; group 1 is every other
# test), lengths straddling tile edges both ways (seqlen_q > seqlen_k leaves causal rows with no key).
# The small ones run in numba's simulator; the others wherever the CPU budget allows, and on a GPU.
GQA_CASES = [
    _gqa(4, 2, 2, 17, 29, 16),
    _gqa(6, 2, 1, 37, 19, 32),
    _gqa(8, 1, 1, 37, 19, 16),
    _gqa(16, 2, 1, 130, 257, 64),
    _gqa(8, 1, 2, 300, 300, 128),
]


@pytest.mark.parametrize("heads, shape", GQA_CASES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_query_heads(backend, status, device, dtype, causal, heads, shape):
    """k and v with fewer heads than q: query head h attends to key/value head h // (heads // heads_k)."""
    (h, h_k), (b, n_q, n_k, d) = heads, shape
    require_runnable(backend, status, device, dtype, (b, h, n_q, n_k, d))
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=h * 31 + n_q)
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal)


@pytest.mark.parametrize("causal", CAUSAL)
def test_grouped_query_heads_strided(backend, status, device, causal):
    """GQA on (batch, seqlen, heads, head_dim) tensors transposed to (batch, heads, seqlen, head_dim)."""
    require_runnable(backend, status, device, torch.float16, (1, 4, 21, 33, 16))
    g = torch.Generator().manual_seed(8)

    def make(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=torch.float16).transpose(1, 2)

    q, k, v = make(1, 21, 4, 16), make(1, 33, 2, 16), make(1, 33, 2, 16)
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal)


def test_grouped_query_heads_reach_the_kernel_uncopied(backend, status, device, monkeypatch):
    """fa2.attention and fa2.scaled_dot_product_attention(enable_gqa=True) hand the backend k and v with
    their own heads and storage: no repeated or expanded copy per query head is made on the way."""
    require_runnable(backend, status, device, torch.float32, (1, 4, 9, 11, 16))
    impl = registry.load(backend)
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((k.shape, k.data_ptr(), v.data_ptr()))
        return real(q, k, v, *args, **kwargs)

    real = impl.flash_attn_forward
    monkeypatch.setattr(impl, "flash_attn_forward", spy)
    q, k, v = random_qkv((1, 4, 9, 16), (1, 2, 11, 16), torch.float32, device, seed=9)
    fa2.attention(q, k, v, backend=backend)
    fa2.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    assert seen == [((1, 2, 11, 16), k.data_ptr(), v.data_ptr())] * 2


def _strided_views(device, dtype):
    """Non-contiguous q, k, v in three layouts: (B, N, H, D) transposed to (B, H, N, D); a head_dim
    stride of 2 (every other element of a wider tensor); k and v as slices of one packed kv tensor."""
    g = torch.Generator().manual_seed(3)

    def make(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    q = make(2, 33, 3, 16).transpose(1, 2)
    k = make(2, 3, 41, 32)[..., ::2]
    kv = make(2, 3, 41, 2, 16)
    v = kv[..., 1, :]
    return q, k, v


@pytest.mark.parametrize("causal", CAUSAL)
def test_strided_inputs(backend, status, device, causal):
    q, k, v = _strided_views(device, torch.float16)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    require_runnable(backend, status, device, q.dtype, (2, 3, 33, 41, 16))
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal)


@pytest.mark.parametrize("scale", [0.03, 1.0, 2.5], ids=lambda s: f"scale{s}")
def test_custom_scale(backend, status, device, scale):
    shape = (1, 2, 19, 37, 16)
    require_runnable(backend, status, device, torch.float32, shape)
    q, k, v = random_qkv((1, 2, 19, 16), (1, 2, 37, 16), torch.float32, device, seed=4)
    O, L = run(backend, q, k, v, True, scale)
    assert_matches_reference(O, L, q, k, v, True, scale)


@pytest.mark.parametrize("head_dim", [1, 8, 12, 24, 40, 72, 96, 100, 160, 200, 256], ids=lambda d: f"D{d}")
def test_head_dims(backend, status, device, head_dim):
    require_runnable(backend, status, device, torch.float16, (1, 1, 9, 13, head_dim))
    q, k, v = random_qkv((1, 1, 9, head_dim), (1, 1, 13, head_dim), torch.float16, device, seed=head_dim)
    try:
        O, L = fa2.attention(q, k, v, causal=True, backend=backend)
    except NotImplementedError as e:
        assert "head_dim" in str(e), f"a head_dim refusal must name the limit, got: {e}"
        pytest.skip(f"{backend} refuses head_dim {head_dim}: {e}")
    assert_matches_reference(O, L, q, k, v, True)


def test_causal_alignment_is_bottom_right(backend, status, device):
    """seqlen_q = 2, seqlen_k = 5: row 0 sees keys 0..3, row 1 sees all five (not top-left's 0 and 0..1)."""
    require_runnable(backend, status, device, torch.float32, (1, 1, 2, 5, 16))
    q = torch.zeros(1, 1, 2, 16, device=device)
    k = torch.zeros(1, 1, 5, 16, device=device)
    v = torch.arange(5, dtype=torch.float32, device=device)[None, None, :, None].expand(1, 1, 5, 16)
    O, L = run(backend, q, k, v, causal=True)
    # Equal scores: each row's output is the mean of the values it sees, and L = log(count).
    torch.testing.assert_close(O[0, 0, :, 0].cpu(), torch.tensor([1.5, 2.0]))
    torch.testing.assert_close(L[0, 0].cpu(), torch.tensor([math.log(4), math.log(5)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key(backend, status, device, dtype):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows get O = 0, L = +inf, no NaN."""
    require_runnable(backend, status, device, dtype, (1, 2, 37, 19, 16))
    q, k, v = random_qkv((1, 2, 37, 16), (1, 2, 19, 16), dtype, device, seed=5)
    O, L = run(backend, q, k, v, causal=True)
    assert (O[:, :, :18] == 0).all() and torch.isposinf(L[:, :, :18]).all()
    assert torch.isfinite(L[:, :, 18:]).all() and not torch.isnan(O).any()
    assert_matches_reference(O, L, q, k, v, True)


def test_deterministic_and_inputs_untouched(backend, status, device):
    require_runnable(backend, status, device, torch.float16, (2, 2, 33, 47, 32))
    q, k, v = random_qkv((2, 2, 33, 32), (2, 2, 47, 32), torch.float16, device, seed=6)
    before = [t.clone() for t in (q, k, v)]
    O1, L1 = run(backend, q, k, v, causal=True)
    O2, L2 = run(backend, q, k, v, causal=True)
    assert torch.equal(O1, O2) and torch.equal(L1, L2), "two identical calls gave different bits"
    for name, t, t0 in zip("qkv", (q, k, v), before):
        assert torch.equal(t, t0), f"{name} was modified"


def test_autograd_contract(backend, status, device):
    """CS336: FlashAttention2.apply(q, k, v, is_causal) returns O and saves L (shape q.shape[:-1]) for
    the backward (whose results test_gradients.py checks)."""
    require_runnable(backend, status, device, torch.float32, (2, 1, 17, 17, 16))
    q, k, v = (t.requires_grad_() for t in random_qkv((2, 17, 16), (2, 17, 16), torch.float32, device))
    O = registry.load(backend).FlashAttention2.apply(q, k, v, True)
    assert isinstance(O, torch.Tensor) and O.shape == q.shape and O.requires_grad
    saved_L = [t for t in O.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved_L) == 1, f"want exactly one saved tensor of shape {tuple(q.shape[:-1])}"
    _, L_ref = fa2.reference.attention(q.detach(), k.detach(), v.detach(), True)
    torch.testing.assert_close(saved_L[0].double(), L_ref, rtol=0, atol=5e-5)
