"""What "correct" means for every backend, as assertions the suite and its known-wrong fixtures share.

Precision follows FlashAttention-2's test rule: in fp16 and bf16 a kernel's max error against the fp64
reference is at most twice that of a naive attention computed in the same low precision, plus twice the
error of merely rounding the fp64 result to that dtype (a floor no kernel can beat). fp32 inputs get fixed,
tight tolerances: an fp32 path that rounds through fp16/bf16 or uses TF32 fails them.

Both rules get one more term, for scores of large magnitude (``score_error``): every backend computes the
scores S = scale · q kᵀ in fp32, whatever the input dtype, and an fp32 dot product's rounding error grows
with the magnitude of its products, Σ_d |q_d k_d|, not with |S|. With inputs of size 1 the term is far below
the fixed tolerances; with inputs ×60 (|S| ~ 10⁴, where one fp32 ulp of a score is 10⁻³) it is what lets a
correct kernel pass, while one that overflows or loses a term still fails.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from fa2 import reference

FP32_ATOL = {"O": 5e-5, "L": 5e-5}
L_FLOOR = 1e-5
U32 = 2.0**-24  # fp32's unit roundoff: the precision every backend computes scores in


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item() if x.numel() else 0.0


def score_error(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, rows=None) -> torch.Tensor:
    """A bound on |δS_ij| over j, per query row (q.shape[:-1], or rows only), for scores computed in fp32:

        |δS_ij| <= (2·sqrt(D) + 2) · u · |scale| · Σ_d |q_id k_jd|,   u = 2^-24.

    The rounding errors of a D-term fp32 sum grow like sqrt(D) in practice (Higham, "Accuracy and Stability
    of Numerical Algorithms", §4.2; the worst case D is never approached by tiled or pairwise sums), taken
    twice for margin; the + 2 covers the products with scale and log2(e). Measured on the CPU backends with
    inputs ×60: 1.4 to 2.9 · u · |scale| · Σ_d |q_id k_jd|, against 10 (D = 16) to 34 (D = 256) here.
    """
    (k,) = reference.repeat_kv_heads(q, k)
    if rows is not None:
        q = q[..., rows.to(q.device), :]
    if k.shape[-2] == 0:
        return torch.zeros(q.shape[:-1], dtype=torch.float64, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    magnitude = (q.double().abs() @ k.double().abs().transpose(-2, -1)).amax(dim=-1) * abs(scale)
    return (2 * math.sqrt(q.shape[-1]) + 2) * U32 * magnitude


def tolerances(q, k, v, causal, scale=None, rows=None, ref=None, **features) -> tuple[float, float]:
    """(tol_O, tol_L): the max errors of O and of the finite L allowed against the fp64 reference.

    fp32: the fixed FP32_ATOL; fp16 and bf16: FlashAttention-2's rule (twice the naive same-precision
    attention's error, where it stays finite, plus twice the error of rounding to the dtype), at least the
    error of rounding the weights and O to the dtype (2u · max|v|). Plus, for
    every dtype, what the scores' rounding (``score_error``, δS per row) does through the softmax: L is
    logsumexp_j S_ij, which moves by at most max_j |δS_ij|; O_ic = Σ_j P_ij v_jc moves, to first order, by
    Σ_j P_ij δS_ij (v_jc - O_ic), at most max_j |δS_ij| · sqrt(Σ_j P_ij (v_jc - O_ic)²) (Cauchy-Schwarz),
    the spread of v's column c under row i's softmax: near 0 where one key dominates the row.
    ``ref``: the fp64 reference's (O, L) on these rows, if the caller has it. ``features``: window, softcap,
    alibi_slopes, as fa2.reference.attention takes them. The softcap's tanh only shrinks a score's error;
    an ALiBi bias computed in fp32 adds up to 2u of its own size (slope · distance, up to ~10³ at 16k keys).
    """
    O_ref, L_ref = ref if ref is not None else reference.attention(q, k, v, causal, scale, rows=rows, **features)
    seen = torch.isfinite(L_ref)
    dS = score_error(q, k, scale, rows)
    slopes = features.get("alibi_slopes")
    if slopes is not None and k.shape[-2]:
        bias = reference.alibi_bias(slopes.double(), q.shape[-2], k.shape[-2], rows).abs().amax(dim=-1)
        dS = dS + 4 * U32 * bias
    O2_ref, _ = reference.attention(q, k, v.double().square(), causal, scale, rows=rows, **features)
    spread = (O2_ref - O_ref.square()).clamp_min(0).sqrt()
    score_O = (dS[..., None] * spread).max().item() if spread.numel() else 0.0
    score_L = dS[seen].max().item() if seen.any() else 0.0

    if q.dtype == torch.float32:
        return FP32_ATOL["O"] + score_O, FP32_ATOL["L"] + score_L
    O_naive, L_naive = reference.attention(q, k, v, causal, scale, upcast=False, rows=rows, **features)
    # fp16 scores past 65504 overflow in the naive attention: only where it stays finite is it a yardstick.
    naive_O = torch.isfinite(O_naive)
    naive_L = seen & torch.isfinite(L_naive)
    tol_O = 2 * max_err(O_naive[naive_O], O_ref[naive_O]) + 2 * max_err(O_ref.to(q.dtype), O_ref)
    # A kernel may round P to the input dtype for P·V (FlashAttention-2's kernels and Triton's tutorial do)
    # and rounds O to it: each weight then carries a relative error up to u, the dtype's unit roundoff, and
    # O one rounding more, |δO_ic| <= u · Σ_j P_ij |v_jc| + u · |O_ic| <= 2u · max|v|. Where one key takes
    # each row's whole weight (huge scores) the naive attention is exact and the rule falls below that.
    tol_O = max(tol_O, torch.finfo(q.dtype).eps * (v.abs().max().item() if v.numel() else 0.0))
    tol_L = 2 * max_err(L_naive[naive_L], L_ref[naive_L]) + L_FLOOR
    return tol_O + score_O, tol_L + score_L


def assert_matches_reference(O, L, q, k, v, causal, scale=None, rows=None, **features):
    """O: q's shape and dtype; L: q.shape[:-1], float32; both against the fp64 reference. ``rows`` (a 1-D
    index tensor): only those query rows are checked, against ``fa2.reference.attention(..., rows=rows)``.
    ``features``: window, softcap, alibi_slopes, passed to the reference as fa2.attention took them."""
    assert O.shape == q.shape, f"O shape {tuple(O.shape)} != q shape {tuple(q.shape)}"
    assert O.dtype == q.dtype, f"O dtype {O.dtype} != q dtype {q.dtype}"
    assert O.device == q.device, f"O on {O.device}, q on {q.device}"
    assert L.shape == q.shape[:-1], f"L shape {tuple(L.shape)} != {tuple(q.shape[:-1])}"
    assert L.dtype == torch.float32, f"L dtype {L.dtype}, want float32"
    if rows is not None:
        rows = rows.to(q.device)
        O, L = O[..., rows, :], L[..., rows]
    assert not torch.isnan(O).any(), "NaN in O (an unwritten or 0/0 element)"
    assert not torch.isnan(L).any(), "NaN in L"

    O_ref, L_ref = reference.attention(q, k, v, causal, scale, rows=rows, **features)
    empty = torch.isinf(L_ref)
    assert torch.equal(L[empty], L_ref[empty].float()), "rows that see no key must have L = +inf"
    assert torch.isfinite(L[~empty]).all(), "L must be finite on rows that see a key"
    assert (O[empty] == 0).all(), "rows that see no key must have O = 0"

    tol_O, tol_L = tolerances(q, k, v, causal, scale, rows, ref=(O_ref, L_ref), **features)
    err_O = max_err(O, O_ref)
    err_L = max_err(L[~empty], L_ref[~empty])
    assert err_O <= tol_O, f"max |O - O_ref| = {err_O:.3g} > tolerance {tol_O:.3g} ({q.dtype})"
    assert err_L <= tol_L, f"max |L - L_ref| = {err_L:.3g} > tolerance {tol_L:.3g} ({q.dtype})"


def offsets(lens, device) -> torch.Tensor:
    """cu_seqlens of a packed batch of sequences of these lengths: (len(lens) + 1,) int32, from 0."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, ...) tensor as the kernels take it: (1, heads, total, ...), a view."""
    return t.transpose(0, 1)[None]


def varlen_grads(q, k, v, dO, cu_q, cu_k, causal, upcast, **features):
    """dq, dk, dv of ``reference.varlen_attention`` on packed (total, heads, head_dim) q, k, v by autograd: fp64
    with upcast, else in q's dtype (the naive attention of the tolerance rule)."""
    x = [t.detach().double().requires_grad_() if upcast else t.detach().requires_grad_() for t in (q, k, v)]
    O, _ = reference.varlen_attention(*x, cu_q, cu_k, causal, upcast=upcast, **features)
    return torch.autograd.grad(O, x, dO.double() if upcast else dO)


def packed_grad_tolerances(q, k, v, dO, cu_q, cu_k, causal, **features):
    """(the fp64 reference's dq, dk, dv of a packed fp16/bf16 batch, their tolerances): three times a
    same-precision naive attention's error plus twice the reference's rounding to the dtype, over the batch."""
    ref = varlen_grads(q, k, v, dO, cu_q, cu_k, causal, True, **features)
    naive = varlen_grads(q, k, v, dO, cu_q, cu_k, causal, False, **features)
    return ref, [3 * max_err(n, r) + 2 * max_err(r.to(q.dtype), r) for n, r in zip(naive, ref)]


def random_qkv(shape_q, shape_k, dtype, device, seed=0):
    """Standard-normal q, k, v (never zeros: zeros hide unwritten outputs and wrong indexing)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(s):
        return torch.randn(s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    return make(shape_q), make(shape_k), make(shape_k)


def values_at_import(module: str, name: str, variable: str, values: list[str | None]) -> list[str]:
    """``repr(module.name)`` as the module computes it at import with the environment variable ``variable``
    set to each of ``values`` in turn (None: unset), in one fresh interpreter: imported once, then reloaded
    for each further value (one import of a backend costs seconds; CI's emulators are slow to import)."""
    code = "\n".join(
        [
            "import importlib, os",
            f"values = {values!r}",
            "for i, value in enumerate(values):",
            "    if value is None:",
            f"        os.environ.pop({variable!r}, None)",
            "    else:",
            f"        os.environ[{variable!r}] = value",
            f"    m = importlib.import_module({module!r}) if i == 0 else importlib.reload(m)",
            f"    print(repr(m.{name}))",
        ]
    )
    run = run_python(code, without=variable, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-len(values) :]


def run_python(code: str, without: str, timeout: float) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter, its output captured, with this process's environment less the
    variable ``without`` (an emulator's switch: TRITON_INTERPRET, NUMBA_ENABLE_CUDASIM) and with this
    process's sys.path, so that the test modules and these helpers import there as they do here."""
    env = {name: value for name, value in os.environ.items() if name != without}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def build_group(kernel: str, head_dim: int, window, **switches) -> pytest.MarkDecorator:
    """The xdist group of a case by the kernel build it compiles: ``kernel`` (its name and tiles), the head dim, the
    window's kind (full, causal, or which sides are bounded) and the switches that are on; under ``--dist
    loadgroup`` one worker then compiles each build (numba: 10-40 s a kernel on the GPU) for all its cases."""
    mask = {(-1, -1): "full", (-1, 0): "causal"}.get(tuple(window), f"left{window[0] >= 0:d}-right{window[1] >= 0:d}")
    on = "".join(f"-{name}" for name, value in switches.items() if value)
    return pytest.mark.xdist_group(f"{kernel}-D{head_dim}-{mask}{on}")
