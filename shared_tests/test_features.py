"""Sliding windows, softcap and ALiBi, alone and together with causal and GQA, for every backend: the
forward against the fp64 reference (fa2.reference.attention with the same options), the gradients against
its autograd, and the interface's refusals of bad options.

Each case is one chosen combination, not a cross product: windows that straddle tile edges, exceed N,
have left = 0 or right > 0; softcap on large scores; ALiBi per head and per (batch, head), with and without
causal; seqlen_q != seqlen_k both ways. The small ones run in numba's simulator.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, random_qkv
from test_conformance import DTYPES, require_runnable
from test_gradients import assert_grads_match, grads


def _case(b, h, h_k, n_q, n_k, d, causal=False, window=(-1, -1), softcap=0.0, alibi=None, gain=1.0):
    """alibi: None, "head" (slopes (heads,)) or "batch" (slopes (batch, heads)); gain multiplies q and k
    (large scores, for the softcap)."""
    parts = [f"B{b}-H{h}" + (f"-Hk{h_k}" if h_k != h else ""), f"{n_q}x{n_k}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}-x{gain:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    case = dict(shape=(b, h, h_k, n_q, n_k, d), causal=causal, window=window, softcap=softcap, alibi=alibi, gain=gain)
    return pytest.param(case, id="-".join(parts))


WINDOW_CASES = [
    _case(1, 2, 2, 17, 29, 16, window=(3, 5)),
    _case(1, 1, 1, 23, 23, 16, window=(0, 0)),
    _case(2, 2, 2, 19, 19, 16, causal=True, window=(4, 4)),
    _case(1, 2, 2, 21, 33, 16, window=(-1, 4)),
    _case(1, 2, 2, 33, 21, 16, window=(7, -1)),
    _case(1, 1, 1, 17, 23, 32, window=(100, 100)),
    _case(1, 2, 2, 37, 19, 16, window=(4, 2)),
    _case(1, 2, 1, 130, 257, 64, window=(64, 31)),
    _case(1, 2, 2, 300, 300, 128, causal=True, window=(127, 0)),
    _case(1, 2, 2, 1024, 1024, 64, window=(256, 0)),
    _case(1, 1, 1, 1000, 1100, 128, window=(129, 63)),
]
SOFTCAP_CASES = [
    _case(1, 2, 2, 17, 29, 16, softcap=5.0, gain=4.0),
    _case(1, 2, 2, 29, 17, 32, causal=True, softcap=2.0, gain=3.0),
    _case(1, 2, 2, 130, 257, 64, softcap=30.0, gain=10.0),
    _case(1, 2, 2, 300, 300, 128, causal=True, softcap=50.0, gain=6.0),
]
ALIBI_CASES = [
    _case(1, 2, 2, 17, 29, 16, alibi="head"),
    _case(2, 2, 2, 37, 19, 32, causal=True, alibi="batch"),
    _case(1, 4, 2, 33, 47, 16, causal=True, window=(9, 0), softcap=8.0, gain=3.0, alibi="batch"),
    _case(1, 2, 2, 130, 257, 64, window=(40, 40), alibi="head"),
    _case(2, 8, 2, 300, 300, 128, causal=True, alibi="batch"),
]
FEATURE_CASES = WINDOW_CASES + SOFTCAP_CASES + ALIBI_CASES
GRAD_CASES = [
    _case(1, 2, 2, 17, 29, 16, window=(3, 5)),
    _case(1, 2, 2, 37, 19, 16, causal=True, window=(4, 4)),
    _case(1, 2, 1, 130, 257, 64, window=(64, 31)),
    _case(1, 2, 2, 29, 17, 32, causal=True, softcap=2.0, gain=3.0),
    _case(1, 2, 2, 130, 130, 64, softcap=20.0, gain=8.0),
    _case(2, 2, 2, 37, 19, 32, causal=True, alibi="batch"),
    _case(1, 4, 2, 33, 47, 16, causal=True, window=(9, 0), softcap=8.0, gain=3.0, alibi="batch"),
    _case(1, 2, 2, 203, 113, 128, window=(40, 40), alibi="head"),
]


def _inputs(case, dtype, device, seed):
    b, h, h_k, n_q, n_k, d = case["shape"]
    q, k, v = random_qkv((b, h, n_q, d), (b, h_k, n_k, d), dtype, device, seed=seed)
    q, k = q * case["gain"], k * case["gain"]
    slopes = None
    if case["alibi"] is not None:
        g = torch.Generator().manual_seed(seed + 1)
        slopes = (torch.rand((h,) if case["alibi"] == "head" else (b, h), generator=g) * 0.3).to(device)
    options = dict(window=case["window"], softcap=case["softcap"], alibi_slopes=slopes)
    return q, k, v, options


def _run(backend, q, k, v, causal, options):
    try:
        return fa2.attention(q, k, v, causal=causal, backend=backend, **options)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


def _work(case):
    b, h, _, n_q, n_k, d = case["shape"]
    return (b, h, n_q, n_k, d)


@pytest.mark.parametrize("case", FEATURE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_features_match_reference(backend, status, device, dtype, case):
    require_runnable(backend, status, device, dtype, _work(case))
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["shape"]))
    O, L = _run(backend, q, k, v, case["causal"], options)
    assert_matches_reference(O, L, q, k, v, case["causal"], **options)


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_gradients(backend, status, device, dtype, case):
    require_runnable(backend, status, device, dtype, _work(case))
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["shape"]) + 5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    O, _ = _run(backend, q, k, v, case["causal"], options)
    assert_grads_match(*grads(O, (q, k, v), dO), q, k, v, dO, case["causal"], **options)


def test_window_rows_that_see_no_key(backend, status, device):
    """A window that misses every key of some rows: those rows get O = 0, L = +inf and zero gradient."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 24, 8, 16))
    q, k, v = (t.requires_grad_() for t in random_qkv((1, 2, 24, 16), (1, 2, 8, 16), torch.float32, device))
    # Nq - Nk = 16: query i's window is [i - 16 - 2, i - 16 + 1]; rows 0..14 see no key.
    O, L = _run(backend, q, k, v, False, dict(window=(2, 1)))
    assert (O[:, :, :15] == 0).all() and torch.isposinf(L[:, :, :15]).all()
    assert torch.isfinite(L[:, :, 15:]).all()
    assert_matches_reference(O.detach(), L, q.detach(), k.detach(), v.detach(), False, window=(2, 1))
    (dq,) = grads(O, (q,), torch.ones_like(O))
    assert (dq[:, :, :15] == 0).all(), "rows that see no key must get dq = 0"


def test_window_skips_key_tiles_outside(backend, status, device):
    """Keys that no query's window reaches are never read: NaN there (k and v) changes nothing. A kernel
    that loads those tiles and masks them would still multiply 0 by NaN in P·V."""
    require_runnable(backend, status, device, torch.float32, (1, 1, 16, 512, 16))
    q, k, v = random_qkv((1, 1, 16, 16), (1, 1, 512, 16), torch.float32, device, seed=11)
    # Query i sees keys [i + 496 - 16, i + 496]: from 480 on. Keys below 256 share no 256-key tile with them.
    k[..., :256, :] = math.nan
    v[..., :256, :] = math.nan
    O, L = _run(backend, q, k, v, False, dict(window=(16, 0)))
    assert not torch.isnan(O).any() and not torch.isnan(L).any(), "a tile outside the window was read"
    ref_k, ref_v = k[..., 256:, :], v[..., 256:, :]
    assert_matches_reference(O, L, q, ref_k, ref_v, False, window=(16, 0))


def test_softcap_bounds_the_scores(backend, status, device):
    """With softcap c every score is in (-c, c): huge q·k gives L <= c + log(seqlen_k)."""
    require_runnable(backend, status, device, torch.float32, (1, 1, 9, 13, 16))
    q, k, v = random_qkv((1, 1, 9, 16), (1, 1, 13, 16), torch.float32, device, seed=12)
    O, L = _run(backend, q * 100, k * 100, v, False, dict(softcap=3.0))
    assert (L <= 3.0 + math.log(13) + 1e-5).all()
    assert_matches_reference(O, L, q * 100, k * 100, v, False, softcap=3.0)


BAD_OPTIONS = [
    pytest.param(dict(window=(-2, 0)), ValueError, "window left", id="window-below-minus-1"),
    pytest.param(dict(window=(0, -5)), ValueError, "window right", id="window-right-below-minus-1"),
    pytest.param(dict(window=(1.5, 0)), TypeError, "window left", id="window-float"),
    pytest.param(dict(window=(True, 0)), TypeError, "window left", id="window-bool"),
    pytest.param(dict(window=3), TypeError, "window", id="window-not-a-pair"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
    pytest.param(dict(softcap=math.inf), ValueError, "softcap", id="softcap-inf"),
    pytest.param(dict(softcap=math.nan), ValueError, "softcap", id="softcap-nan"),
    pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, r"\(4,\)", id="alibi-wrong-heads"),
    pytest.param(dict(alibi_slopes=torch.ones(2, 4, 1)), ValueError, "alibi_slopes", id="alibi-wrong-rank"),
    pytest.param(dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "float32", id="alibi-fp64"),
    pytest.param(dict(alibi_slopes=[0.1] * 4), TypeError, "alibi_slopes", id="alibi-list"),
]


@pytest.mark.parametrize("options, error, match", BAD_OPTIONS)
def test_bad_options_are_refused(options, error, match):
    q = torch.randn(2, 4, 5, 16)
    with pytest.raises(error, match=match):
        fa2.attention(q, q, q, backend="pytorch", **options)


def test_alibi_on_another_device_is_refused():
    q = torch.randn(1, 2, 5, 16, device="meta")
    with pytest.raises(ValueError, match="alibi_slopes must be on q's device"):
        fa2.attention(q, q, q, alibi_slopes=torch.ones(2), backend="pytorch")


def test_causal_sets_the_window_right_to_zero(backend, status, device):
    """flash-attn's rule: causal with window (w, w) is window (w, 0)."""
    require_runnable(backend, status, device, torch.float32, (1, 1, 12, 12, 16))
    q, k, v = random_qkv((1, 1, 12, 16), (1, 1, 12, 16), torch.float32, device, seed=13)
    a = _run(backend, q, k, v, True, dict(window=(3, 3)))
    b = _run(backend, q, k, v, False, dict(window=(3, 0)))
    assert torch.equal(a.O, b.O) and torch.equal(a.L, b.L)
