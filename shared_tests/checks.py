"""What "correct" means for every backend, as assertions the suite and its known-wrong fixtures share.

Precision follows FlashAttention-2's test rule: in fp16 and bf16 a kernel's max error against the fp64
reference is at most twice that of a naive attention computed in the same low precision, plus twice the
error of merely rounding the fp64 result to that dtype (a floor no kernel can beat). fp32 inputs get fixed,
tight tolerances: an fp32 path that rounds through fp16/bf16 or uses TF32 fails them.
"""

from __future__ import annotations

import torch

from fa2 import reference

FP32_ATOL = {"O": 5e-5, "L": 5e-5}
L_FLOOR = 1e-5


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item() if x.numel() else 0.0


def assert_matches_reference(O, L, q, k, v, causal, scale=None):
    """O: q's shape and dtype; L: q.shape[:-1], float32; both against the fp64 reference."""
    assert O.shape == q.shape, f"O shape {tuple(O.shape)} != q shape {tuple(q.shape)}"
    assert O.dtype == q.dtype, f"O dtype {O.dtype} != q dtype {q.dtype}"
    assert O.device == q.device, f"O on {O.device}, q on {q.device}"
    assert L.shape == q.shape[:-1], f"L shape {tuple(L.shape)} != {tuple(q.shape[:-1])}"
    assert L.dtype == torch.float32, f"L dtype {L.dtype}, want float32"
    assert not torch.isnan(O).any(), "NaN in O (an unwritten or 0/0 element)"
    assert not torch.isnan(L).any(), "NaN in L"

    O_ref, L_ref = reference.attention(q, k, v, causal, scale)
    empty = torch.isinf(L_ref)
    assert torch.equal(L[empty], L_ref[empty].float()), "rows that see no key must have L = +inf"
    assert torch.isfinite(L[~empty]).all(), "L must be finite on rows that see a key"
    assert (O[empty] == 0).all(), "rows that see no key must have O = 0"

    if q.dtype == torch.float32:
        tol_O, tol_L = FP32_ATOL["O"], FP32_ATOL["L"]
    else:
        O_naive, L_naive = reference.attention(q, k, v, causal, scale, upcast=False)
        tol_O = 2 * max_err(O_naive, O_ref) + 2 * max_err(O_ref.to(q.dtype), O_ref)
        tol_L = 2 * max_err(L_naive[~empty], L_ref[~empty]) + L_FLOOR
    err_O = max_err(O, O_ref)
    err_L = max_err(L[~empty], L_ref[~empty])
    assert err_O <= tol_O, f"max |O - O_ref| = {err_O:.3g} > tolerance {tol_O:.3g} ({q.dtype})"
    assert err_L <= tol_L, f"max |L - L_ref| = {err_L:.3g} > tolerance {tol_L:.3g} ({q.dtype})"


def random_qkv(shape_q, shape_k, dtype, device, seed=0):
    """Standard-normal q, k, v (never zeros: zeros hide unwritten outputs and wrong indexing)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda s: torch.randn(s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    return make(shape_q), make(shape_k), make(shape_k)

