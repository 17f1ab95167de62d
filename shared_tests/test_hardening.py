"""Hardening, for every backend through fa2.attention: fuzzed against the fp64 reference, hostile inputs,
large tensors, resources.

- Property tests (hypothesis): leading dims, seqlens (0, 1, primes, tile edges), head_dim (every value from
  1 to 256: a backend that refuses one raises NotImplementedError naming head_dim and the value), memory
  layouts (transposed, head_dim stride != 1, misaligned slices inside NaN-filled buffers, broadcast heads),
  scale (negative, tiny, zero), causal and dtype, within checks.py's tolerances.
- Edge inputs: empty sequences, fully masked rows, huge scores (inputs ×60), NaN and ±inf inputs,
  requires_grad inputs, inputs on different devices, tensors on a non-current CUDA device.
- GPU-only (``@pytest.mark.gpu``, run with --device cuda; skipped on the CPU): offsets past 2^31 elements,
  one 128k-token head, two CUDA streams at once, no host sync, 10,000 calls without growth of GPU or host
  memory and without recompiles.

Hypothesis runs derandomized, without a database (the same examples every run); each example's
B·H·seqlen_q·seqlen_k·head_dim is bounded per backend (FUZZ_WORK), and the CPU, where Triton and numba run
emulated, gets fewer examples than a GPU.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fa2
from checks import assert_matches_reference, random_qkv, tolerances
from fa2 import reference, registry
from test_conformance import CAUSAL, CPU_BUDGET, DTYPES, EMULATOR_GAPS, require_runnable, run
from test_gradients import assert_grads_match, grads

MAX_HEAD_DIM = fa2.api.MAX_HEAD_DIM

# --- property tests ---------------------------------------------------------------------------------

# Per example, B·H·seqlen_q·seqlen_k·head_dim at most this, and seqlens at most FUZZ_SEQLEN. numba's
# simulator spends ~0.7 s per block and key tile (a Python thread per CUDA thread): a few blocks each.
FUZZ_WORK = {"cpu": {"pytorch": 2e6, "triton": 2e6, "numba-cuda": 4e4}, "cuda": 3e8}
FUZZ_SEQLEN = {"cpu": 300, "cuda": 2100}
FUZZ_EXAMPLES = {"cpu": {"pytorch": 30, "triton": 25, "numba-cuda": 8}, "cuda": 50}

# Hypothesis starts from, and shrinks towards, the first entry of each: a plain case, not a degenerate one.
SEQLENS = (17, 1, 2, 3, 5, 7, 13, 16, 31, 32, 33, 61, 64, 65, 127, 128, 129, 131, 257, 1021, 2048, 0)
HEAD_DIMS = (64, 1, 8, 16, 32, 40, 72, 96, 128, 160, 256)
SCALES = (0.5, -1.0, -0.125, 1e-6, 1e-30, 0.0, 2.0)
LAYOUTS = ("contiguous", "transposed", "head_dim_strided", "sliced", "d_major", "broadcast")


def lay_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values in a memory layout, on x's device and in its dtype:

    contiguous; transposed: (..., N, H, D) memory seen as (..., H, N, D) (rank 2: as d_major);
    head_dim_strided: every other element of a (..., N, 2·D) buffer; sliced: rows 1.. and columns 3.. of a
    (..., N + 3, D + 5) buffer (a storage offset that breaks 16-byte alignment); d_major: (..., D, N) memory
    seen as (..., N, D), head_dim stride N; broadcast: x's first entry along dim -3 expanded over that dim
    (stride 0; rank 2: contiguous). Buffers around the view are NaN, so a kernel that reads outside fails.
    """
    if layout == "transposed" and x.dim() >= 3:
        return x.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout in ("transposed", "d_major"):
        return x.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "broadcast" and x.dim() >= 3:
        return x[..., :1, :, :].expand(x.shape)
    n, d = x.shape[-2:]
    if layout == "head_dim_strided":
        view = torch.full((*x.shape[:-1], 2 * d), math.nan, dtype=x.dtype, device=x.device)[..., ::2]
    elif layout == "sliced":
        view = torch.full((*x.shape[:-2], n + 3, d + 5), math.nan, dtype=x.dtype, device=x.device)
        view = view[..., 1 : n + 1, 3 : d + 3]
    else:
        return x.contiguous()
    return view.copy_(x)


class Problem(NamedTuple):
    dtype: torch.dtype
    causal: bool
    lead: tuple[int, ...]
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    layouts: tuple[str, str, str]
    scale: float | None
    seed: int

    def inputs(self, device):
        g = torch.Generator().manual_seed(self.seed)
        shapes = [(*self.lead, n, self.head_dim) for n in (self.seqlen_q, self.seqlen_k, self.seqlen_k)]
        return tuple(
            lay_out(torch.randn(s, generator=g).to(device=device, dtype=self.dtype), layout)
            for s, layout in zip(shapes, self.layouts)
        )


def _seqlens(hi: int):
    return st.one_of(st.sampled_from([n for n in SEQLENS if n <= hi]), st.integers(1, hi))


@st.composite
def problems(draw, dtypes, max_work, max_seqlen):
    """A Problem with B·H·seqlen_q·seqlen_k·head_dim <= max_work (seqlens of 0 and 1 always allowed)."""
    head_dim = draw(st.one_of(st.sampled_from(HEAD_DIMS), st.integers(1, MAX_HEAD_DIM)))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    room = max(1, int(max_work // (math.prod(lead) * head_dim)))  # what seqlen_q * seqlen_k may be
    seqlen_q = draw(_seqlens(min(max_seqlen, room)))
    seqlen_k = draw(_seqlens(min(max_seqlen, max(1, room // max(seqlen_q, 1)))))
    return Problem(
        dtype=draw(st.sampled_from(dtypes)),
        causal=draw(st.booleans()),
        lead=lead,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=head_dim,
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
        scale=draw(st.one_of(st.none(), st.sampled_from(SCALES), st.floats(-3.0, 3.0))),
        seed=draw(st.integers(0, 2**16)),
    )


def assert_refusal_names_head_dim(error: NotImplementedError, head_dim: int):
    message = str(error)
    assert "head_dim" in message and str(head_dim) in message, (
        f"a refusal must name the limit (head_dim) and the value given ({head_dim}), got: {message}"
    )


def test_fuzz_against_reference(backend, status, device):
    """Random problems (see ``problems``) through fa2.attention: O and L match the fp64 reference within
    checks.py's tolerances, or the backend refuses the head_dim with a NotImplementedError that names it."""
    dtypes = [d.values[0] for d in DTYPES if not (status == "emulated" and (backend, d.values[0]) in EMULATOR_GAPS)]
    on = device.type
    max_work = FUZZ_WORK[on][backend] if on == "cpu" else FUZZ_WORK[on]
    examples = FUZZ_EXAMPLES[on][backend] if on == "cpu" else FUZZ_EXAMPLES[on]
    # Shrinking a failure reruns the backend many times: cheap for the CPU's own backend, minutes under an
    # emulator or on a GPU (a compile for each new shape class).
    phases = tuple(Phase) if on == "cpu" and status == "native" else (Phase.explicit, Phase.generate)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(problems(dtypes, max_work, FUZZ_SEQLEN[on]))
    def check(p: Problem):
        q, k, v = p.inputs(device)
        try:
            O, L = fa2.attention(q, k, v, causal=p.causal, scale=p.scale, backend=backend)
        except NotImplementedError as e:
            assert_refusal_names_head_dim(e, p.head_dim)
            return
        assert_matches_reference(O, L, q, k, v, p.causal, p.scale)

    check()


# numba's simulator spends ~0.7 s a call: there the sweep takes the head dims around its padding (to a
# multiple of 32) and Triton's (to a power of two), which run every code path the others do.
HEAD_DIM_EDGES = sorted(
    {1, 2, 8, 15, 16, 17} | {m + e for m in range(32, MAX_HEAD_DIM + 1, 32) for e in (-1, 0, 1)} - {MAX_HEAD_DIM + 1}
)


def test_every_head_dim(backend, status, device):
    """Every head_dim from 1 to 256 (HEAD_DIM_EDGES under numba's simulator) matches the reference or is
    refused with a NotImplementedError naming head_dim and the value; at least one is supported."""
    slow = status == "emulated" and CPU_BUDGET[backend] < 1e6
    head_dims = HEAD_DIM_EDGES if slow else range(1, MAX_HEAD_DIM + 1)
    supported, failures = [], []
    for head_dim in head_dims:
        q, k, v = random_qkv((1, 1, 5, head_dim), (1, 1, 9, head_dim), torch.float16, device, seed=head_dim)
        try:
            O, L = fa2.attention(q, k, v, causal=True, backend=backend)
        except NotImplementedError as e:
            assert_refusal_names_head_dim(e, head_dim)
            continue
        try:
            assert_matches_reference(O, L, q, k, v, True)
        except AssertionError as e:
            failures.append(f"head_dim {head_dim}: {e}")
        supported.append(head_dim)
    assert not failures, "\n".join(failures)
    assert supported, f"{backend} refuses every head_dim"


# --- edge inputs ------------------------------------------------------------------------------------

EMPTY = [
    pytest.param((2, 3), 0, 5, id="seqlen_q0"),
    pytest.param((2, 3), 3, 0, id="seqlen_k0"),
    pytest.param((2, 3), 0, 0, id="both0"),
    pytest.param((0, 3), 4, 5, id="batch0"),
    pytest.param((2, 1, 2), 0, 3, id="rank5-seqlen_q0"),
    pytest.param((2, 1, 2), 3, 0, id="rank5-seqlen_k0"),
]


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lead, n_q, n_k", EMPTY)
def test_empty_inputs(backend, status, device, causal, lead, n_q, n_k):
    """As fa2.attention documents: seqlen_q = 0 (or a leading dim 0) gives empty O and L; seqlen_k = 0
    leaves every row without a key, O = 0 and L = +inf.

    Broke (found by the fuzz test): rank-5 inputs with a 0 in their shape raised RuntimeError, "cannot
    reshape tensor of 0 elements ... -1 ... is ambiguous": fa2.layout.as_bhnd merged the leading dims with
    reshape(-1, ...)."""
    q, k, v = random_qkv((*lead, n_q, 16), (*lead, n_k, 16), torch.float32, device)
    O, L = fa2.attention(q, k, v, causal=causal, backend=backend)
    assert O.shape == q.shape and L.shape == q.shape[:-1]
    if n_k == 0:
        assert (O == 0).all() and torch.isposinf(L).all()
    assert_matches_reference(O, L, q, k, v, causal)


@pytest.mark.parametrize("lead, n_q, n_k", EMPTY)
def test_empty_inputs_gradients(backend, status, device, lead, n_q, n_k):
    """Gradients through empty inputs: seqlen_k = 0 gives dq = 0 (O does not depend on q), seqlen_q = 0
    gives dk = dv = 0; every gradient has its input's shape. A backend without a backward says so."""
    q, k, v = (t.requires_grad_() for t in random_qkv((*lead, n_q, 16), (*lead, n_k, 16), torch.float32, device))
    O, _ = fa2.attention(q, k, v, causal=True, backend=backend)
    dq, dk, dv = grads(O, (q, k, v), torch.ones_like(O))
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert g.shape == x.shape, f"{name} shape {tuple(g.shape)} != {tuple(x.shape)}"
        assert (g == 0).all(), f"{name} must be 0: O has no entries or no key"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q, n_k", [(300, 3), (129, 1), (70, 64)], ids=["300x3", "129x1", "70x64"])
def test_fully_masked_rows(backend, status, device, dtype, n_q, n_k):
    """Causal, seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key (with 300x3 whole query
    tiles of every backend): exactly O = 0 and L = +inf there, the rest as the reference."""
    require_runnable(backend, status, device, dtype, (1, 1, n_q, n_k, 16))
    q, k, v = random_qkv((1, 1, n_q, 16), (1, 1, n_k, 16), dtype, device, seed=n_q)
    O, L = run(backend, q, k, v, causal=True)
    masked = n_q - n_k
    assert (O[..., :masked, :] == 0).all() and torch.isposinf(L[..., :masked]).all()
    assert_matches_reference(O, L, q, k, v, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("head_dim", [16, 32, 128, 256], ids=lambda d: f"D{d}")
def test_huge_scores(backend, status, device, dtype, causal, head_dim):
    """q, k and v ×60: scores of ~10⁴ (exp of them overflows any float), spread over several key tiles so
    that the running max moves by thousands. No inf or NaN; O and L match the reference within checks.py's
    tolerances (their score_error term: one fp32 ulp of such a score is ~10⁻³)."""
    shape = (1, 1, 45, 131, head_dim)
    require_runnable(backend, status, device, dtype, shape)
    q, k, v = (60 * t for t in random_qkv((1, 1, 45, head_dim), (1, 1, 131, head_dim), dtype, device, seed=7))
    O, L = run(backend, q, k, v, causal)
    assert torch.isfinite(O).all() and torch.isfinite(L).all(), "huge scores overflowed"
    assert_matches_reference(O, L, q, k, v, causal)


def strict_reference(q, k, v, causal, scale=None):
    """The fp64 reference in which a key a row does not see contributes nothing, not even 0 · v_j:
    fa2.reference's P @ V multiplies a masked key's value by 0, which turns a NaN or inf there into NaN
    in every row. O: (..., seqlen_q, head_dim), L: (..., seqlen_q), float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = reference.causal_mask(n_q, n_k, q.device) if causal else q.new_ones(n_q, n_k, dtype=torch.bool)
    S = (q @ k.transpose(-2, -1) * scale).masked_fill(~visible, -math.inf)
    P = torch.softmax(S, dim=-1)
    O = (P[..., None] * v[..., None, :, :]).masked_fill(~visible[..., None], 0.0).sum(dim=-2)
    empty = ~visible.any(dim=-1)
    _, L = reference.attention(q, k, v, causal, scale)
    return O.masked_fill(empty[:, None], 0.0), L


def assert_non_finite_as_expected(x, expected, tol, name, nan_stays_nan, may_leak=None):
    """Where ``expected`` is finite: x too, within tol (except entries in ``may_leak``, which may instead
    be NaN or inf). Where it is not: x not finite either; NaN exactly where the bad input was a NaN."""
    finite = torch.isfinite(expected)
    leaked = may_leak & ~torch.isfinite(x) if may_leak is not None else torch.zeros_like(finite)
    compare = finite & ~leaked
    assert torch.isfinite(x[compare]).all(), f"{name}: non-finite where the reference is finite"
    err = (x[compare].double() - expected[compare]).abs().max().item() if compare.any() else 0.0
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} where the reference is finite"
    assert not torch.isfinite(x[~finite]).any(), f"{name}: finite where the reference is NaN or inf"
    if nan_stays_nan:
        assert torch.isnan(x[torch.isnan(expected)]).all(), f"{name}: a NaN input must give NaN, not inf"


NON_FINITE = [pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="+inf"), pytest.param(-math.inf, id="-inf")]
# Row 30 of q sees keys 0..22 under causal (seqlen_q 37, seqlen_k 29); key 20 is seen by rows 28.. only.
POISONED = {"q": (0, 1, 30, 3), "k": (0, 1, 20, 3), "v": (0, 1, 20, 3)}


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_non_finite_input(backend, status, device, tensor, value, causal):
    """One NaN or ±inf in fp32 q, k or v (batch 0, head 1): the outputs it reaches are as the fp64 reference
    (``strict_reference``), the others unchanged; no crash, no hang. Per case:

    - q row i: a NaN makes O row i and L_i NaN; an inf gives scores ±inf, so O row i is NaN and L_i NaN or
      +inf (the reference's logsumexp gives +inf, the kernels' m + log(l) NaN; both say "not finite").
    - k row j: the same for every row that sees key j; a -inf score just drops key j from that row.
    - v[j, c]: O[i, c] NaN (NaN or inf for an inf) for every row i that sees key j; L untouched. A row
      that does not see key j may get it there too, through 0 · v_j in P·V, as the reference's own P @ V
      does for every row: either that or the clean value.
    Everything else, and head 0, matches the reference within the clean inputs' tolerances.

    Broke: fa2-pytorch gave a row with a +inf score (causal, in the diagonal's key tile) O = 0 and
    L = +inf, a row that "sees no key", instead of NaN: it took the tile's max score at the argmax of the
    softmax, which for an all-NaN softmax is key 0 (here a -inf score). fa2-numba-cuda (both kernels) wrote
    O = 0 and L = +inf for a row whose sum l was NaN: its epilogue took `l > 0` (False for NaN) to mean "no
    key"; it now tests l != 0, so such rows get NaN and their gradients NaN, not zeros.
    """
    require_runnable(backend, status, device, torch.float32, (1, 2, 37, 29, 16))
    clean = random_qkv((1, 2, 37, 16), (1, 2, 29, 16), torch.float32, device, seed=11)
    tol_O, tol_L = tolerances(*clean, causal)
    q, k, v = (t.clone() for t in clean)
    {"q": q, "k": k, "v": v}[tensor][POISONED[tensor]] = value
    O, L = run(backend, q, k, v, causal)
    O_exp, L_exp = strict_reference(q, k, v, causal)

    may_leak = torch.zeros(O.shape, dtype=torch.bool, device=O.device)
    if tensor == "v":
        b, h, j, c = POISONED["v"]
        sees = reference.causal_mask(37, 29, O.device)[:, j] if causal else torch.ones(37, dtype=torch.bool)
        may_leak[b, h, ~sees.to(O.device), c] = True
    nan_stays_nan = math.isnan(value)
    assert_non_finite_as_expected(O, O_exp, tol_O, "O", nan_stays_nan, may_leak)
    assert_non_finite_as_expected(L, L_exp, tol_L, "L", nan_stays_nan)


MINUS_INF_KEYS = {
    "leading-256-of-300": (300, slice(0, 256)),
    "trailing-1-of-257": (257, slice(256, 257)),
    "every-key-of-300": (300, slice(0, 300)),
}


@pytest.mark.parametrize("case", list(MINUS_INF_KEYS))
def test_key_tiles_of_minus_inf_scores(backend, status, device, case):
    """Keys whose scores are -inf for every row (k = -inf in column 0, q > 0 there) drop out, as in the
    reference: O and L are those of attention over the other keys, even where the -inf keys fill whole
    key tiles (leading: keys 0..255 of 300, every backend's first tiles; trailing: key 256 of 257, alone in
    fa2-pytorch's last key tile of 128 or 256); with every key -inf, each row counts as seeing no key: O = 0, L = +inf.

    Broke: fa2-pytorch gave those rows NaN (softmax of an all -inf tile row is NaN, and only tiles on the
    causal diagonal discarded it). fa2-triton gave NaN for the leading cases: a key tile off the causal band
    (unmasked) whose scores were all -inf for a row that had seen no key yet made p = exp2(-inf - (-inf));
    only the band's loop subtracted 0 instead of a -inf max, now both do."""
    n_k, poisoned = MINUS_INF_KEYS[case]
    require_runnable(backend, status, device, torch.float32, (1, 1, 37, n_k, 16))
    q, k, v = random_qkv((1, 1, 37, 16), (1, 1, n_k, 16), torch.float32, device, seed=12)
    q[..., 0] = q[..., 0].abs() + 0.1
    k[..., poisoned, 0] = -math.inf
    O, L = run(backend, q, k, v)
    keep = torch.ones(n_k, dtype=torch.bool)
    keep[poisoned] = False
    keep = keep.to(device)
    assert_matches_reference(O, L, q, k[..., keep, :], v[..., keep, :], False)


def test_requires_grad_inputs(backend, status, device):
    """Inputs that require grad (all, or only q) give the same O and L as plain ones; O requires grad, L
    never does (it is not differentiable); under no_grad nothing does; the backward matches the reference
    (test_gradients.py's rule) or says the backend has none."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 17, 29, 16))
    q, k, v = random_qkv((1, 2, 17, 16), (1, 2, 29, 16), torch.float32, device, seed=13)
    O0, L0 = run(backend, q, k, v, causal=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    O, L = fa2.attention(qg, kg, vg, causal=True, backend=backend)
    assert torch.equal(O.detach(), O0) and torch.equal(L, L0)
    assert O.requires_grad and not L.requires_grad
    O_q, _ = fa2.attention(qg, k, v, causal=True, backend=backend)
    assert O_q.requires_grad and torch.equal(O_q.detach(), O0)
    with torch.no_grad():
        assert not fa2.attention(qg, kg, vg, causal=True, backend=backend).O.requires_grad
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(14)).to(device)
    dq, dk, dv = grads(O, (qg, kg, vg), dO)
    assert_grads_match(dq, dk, dv, q, k, v, dO, True)
    (dq_only,) = torch.autograd.grad(O_q, (qg,), dO)
    torch.testing.assert_close(dq_only, dq)


# --- devices ----------------------------------------------------------------------------------------


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
def test_inputs_on_different_devices(backend, device):
    """q on the GPU with k and v on the CPU, or on two GPUs: ValueError naming the devices, before any
    backend runs (the CPU/meta case is test_interface.py's)."""
    q, k, v = random_qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float32, device)
    with pytest.raises(ValueError, match=r"one device, got q cuda:0, k cpu, v cuda:0"):
        fa2.attention(q, k.cpu(), v, backend=backend)
    _need_two_gpus()
    with pytest.raises(ValueError, match=r"one device, got q cuda:0, k cuda:1, v cuda:1"):
        fa2.attention(q, k.to("cuda:1"), v.to("cuda:1"), backend=backend)


@pytest.mark.gpu
def test_tensors_on_a_non_current_device(backend, status, device):
    """Tensors on cuda:1 while cuda:0 is current: O and L on cuda:1, matching the reference and the same
    bits as with cuda:1 current; the current device is still cuda:0 afterwards."""
    _need_two_gpus()
    q, k, v = random_qkv((2, 3, 129, 64), (2, 3, 200, 64), torch.float16, "cuda:1", seed=15)
    with torch.cuda.device(0):
        O, L = run(backend, q, k, v, causal=True)
        assert torch.cuda.current_device() == 0
    assert O.device == q.device and L.device == q.device
    assert_matches_reference(O, L, q, k, v, True)
    with torch.cuda.device(1):
        O1, L1 = run(backend, q, k, v, causal=True)
    assert torch.equal(O, O1) and torch.equal(L, L1)


# --- large tensors (GPU) ----------------------------------------------------------------------------


# Heads and rows checked against the reference on the large problems: the first, middle and last heads
# (the last lies past 2^31 elements) and 64 rows including the first and the last.
def _sample_rows(n: int, device, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.tensor([0, 1, n // 2, n - 1]), torch.randperm(n, generator=g)[:60]])
    return rows.unique().to(device)


def _skip_if_pytorch_would_not_fit(backend, q):
    """fa2-pytorch keeps up to eight fp32 tensors of q's size at once (q in fp32, acc, p·V, and the scores
    and p, each BLOCK_N / head_dim of q's size): skip, with the reason, where they would not fit in the
    GPU's free memory."""
    need = 8 * 4 * q.numel()
    free, _ = torch.cuda.mem_get_info(q.device)
    if backend == "pytorch" and need > free:
        pytest.skip(f"fa2-pytorch's fp32 temporaries (~{need / 2**30:.0f} GiB) exceed the free {free / 2**30:.0f} GiB")


@pytest.mark.gpu
@pytest.mark.alone
def test_offsets_past_2_31_elements(backend, status, device):
    """B·H·N·D = 1·16800·1000·128 = 2.15e9 elements, bf16, causal: k's and v's last heads and O's lie past
    element 2^31, and q is a (B, N, H, D) tensor seen as (B, H, N, D), whose row stride H·D puts its last
    rows past 2^31 too. Any 32-bit offset wraps; checked on three heads and 64 rows (~18 GB of inputs)."""
    heads, n, d = 16800, 1000, 128
    assert heads * n * d > 2**31 and (n - 1) * heads * d > 2**31
    g = torch.Generator(device=device).manual_seed(16)
    q = torch.randn(1, n, heads, d, generator=g, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, heads, n, d, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    _skip_if_pytorch_would_not_fit(backend, q)
    O, L = run(backend, q, k, v, causal=True)
    h = torch.tensor([0, heads // 2, heads - 1], device=device)
    q_s, k_s, v_s, O_s, L_s = (t.index_select(1, h) for t in (q, k, v, O, L))
    del q, k, v, O, L
    assert_matches_reference(O_s, L_s, q_s, k_s, v_s, True, rows=_sample_rows(n, device))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", CAUSAL)
def test_one_head_of_128k_tokens(backend, status, device, causal):
    """One head of N = 131072 tokens, D = 128, bf16 (4·10¹³ FLOPs of scores), checked on 64 rows."""
    n, d = 131072, 128
    q, k, v = random_qkv((1, 1, n, d), (1, 1, n, d), torch.bfloat16, device, seed=17)
    O, L = run(backend, q, k, v, causal)
    assert_matches_reference(O, L, q, k, v, causal, rows=_sample_rows(n, device))


# --- concurrency and resources (GPU) ----------------------------------------------------------------


@pytest.mark.gpu
def test_two_streams_match_serial_calls(backend, status, device):
    """Two problems run on two CUDA streams at once, ten times over, give the bits of serial calls on the
    default stream: each backend launches on the caller's current stream and keeps no shared state."""
    a = random_qkv((4, 16, 1024, 64), (4, 16, 1024, 64), torch.float16, device, seed=18)
    b = random_qkv((2, 8, 777, 64), (2, 8, 1500, 64), torch.float16, device, seed=19)
    serial = [run(backend, *a, causal=True), run(backend, *b, causal=True)]
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    current = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(current)
    results = []
    for _ in range(10):
        for s, inputs in zip(streams, (a, b)):
            with torch.cuda.stream(s):
                results.append(fa2.attention(*inputs, causal=True, backend=backend))
    for s in streams:
        current.wait_stream(s)
    torch.cuda.synchronize(device)
    for i, (O, L) in enumerate(results):
        O_serial, L_serial = serial[i % 2]
        assert torch.equal(O, O_serial) and torch.equal(L, L_serial), f"call {i} differs from the serial one"


@pytest.mark.gpu
@pytest.mark.alone
def test_no_host_sync(backend, status, device):
    """A call returns while the GPU is still busy with earlier work: behind a ~0.5 s torch.cuda._sleep on
    the stream, a warm fa2.attention call takes the host well under that (a host sync would wait it out)."""
    q, k, v = random_qkv((2, 4, 257, 64), (2, 4, 300, 64), torch.float16, device, seed=20)
    run(backend, q, k, v, causal=True)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000_000)
    t0 = time.perf_counter()
    fa2.attention(q, k, v, causal=True, backend=backend)
    host_ms = 1000 * (time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize(device)
    gpu_ms = start.elapsed_time(end)
    assert host_ms < gpu_ms / 2, f"the call held the host {host_ms:.0f} ms of the GPU's {gpu_ms:.0f} ms: a sync"


def compiled_kernels(backend) -> int | None:
    """How many kernels the backend has compiled in this process: the entries of its Triton JIT functions'
    caches, or its numba dispatchers' overloads; None for a backend that compiles nothing (pytorch)."""
    modules = [m for name, m in sys.modules.items() if name.split(".")[0] == registry.load(backend).__name__]
    if backend == "triton":
        from triton.runtime.jit import JITFunction

        functions = {}
        for value in (v for m in modules for v in vars(m).values()):
            for _ in range(3):  # an Autotuner or Heuristics around the JITFunction: its .fn
                if not isinstance(value, JITFunction):
                    value = getattr(value, "fn", None)
            if isinstance(value, JITFunction):
                functions[id(value)] = value
        return sum(len(cache[0]) for f in functions.values() for cache in f.device_caches.values())
    if backend == "numba-cuda":
        from numba.cuda.dispatcher import CUDADispatcher

        found = {}
        for value in (v for m in modules for v in vars(m).values()):
            for item in value.values() if isinstance(value, dict) else [value]:
                if isinstance(item, CUDADispatcher):
                    found[id(item)] = item
        return sum(len(d.overloads) for d in found.values())
    return None


def _host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.gpu
@pytest.mark.alone
def test_10000_calls_no_growth_no_recompile(backend, status, device):
    """10,000 calls on tiny problems of one shape class (causal, fp16, D = 64, odd seqlens under 64, cycled):
    after a warm-up on one of them, no compiled kernel is added, torch's allocated GPU memory is unchanged,
    the driver's free memory drops by at most 8 MiB and the host's resident memory grows by at most
    8 MiB (under 1 KiB a call)."""
    inputs = [
        random_qkv((1, 2, n_q, 64), (1, 2, n_k, 64), torch.float16, device, seed=n_q)
        for n_q, n_k in ((33, 47), (35, 45), (37, 43))
    ]
    for _ in range(100):
        fa2.attention(*inputs[0], causal=True, backend=backend)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    kernels, allocated = compiled_kernels(backend), torch.cuda.memory_allocated(device)
    assert kernels != 0, f"found no compiled kernel of {backend}: compiled_kernels() must learn where they are"
    free, rss = torch.cuda.mem_get_info(device)[0], _host_rss()
    for i in range(10_000):
        fa2.attention(*inputs[i % 3], causal=True, backend=backend)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    assert compiled_kernels(backend) == kernels, f"recompiled: {kernels} kernels -> {compiled_kernels(backend)}"
    assert torch.cuda.memory_allocated(device) == allocated, "torch's allocated GPU memory grew"
    dropped = free - torch.cuda.mem_get_info(device)[0]
    assert dropped <= 8 * 2**20, f"the GPU's free memory dropped by {dropped / 2**20:.1f} MiB"
    grown = _host_rss() - rss
    assert grown <= 8 * 2**20, f"host resident memory grew by {grown / 2**20:.1f} MiB over 10,000 calls"
