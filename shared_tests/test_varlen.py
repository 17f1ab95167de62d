"""fa2.varlen_attention: packed batches of sequences of different lengths, for every backend.

Each sequence of the packed forward is checked on its own against the fp64 reference of that sequence alone
(checks.assert_matches_reference, the same precision rule as every other test), so that a kernel which lets
one sequence see another's keys, or aligns a mask to the packed tensor instead of the sequence, fails; the
gradients of the whole batch against the reference's.
Backends without a packed path raise NotImplementedError (a skip, with their message).
"""

from __future__ import annotations

import random

import pytest
import torch

import fa2
from checks import assert_matches_reference, max_err, offsets, packed_grad_tolerances, varlen_grads
from test_conformance import DTYPES, require_runnable
from test_gradients import FP32_GRAD_ATOL, grads


def _case(lens_q, lens_k, h, h_k, d, causal=False, window=(-1, -1), softcap=0.0, alibi=None):
    parts = [f"q{'.'.join(map(str, lens_q))}-k{'.'.join(map(str, lens_k))}", f"H{h}-Hk{h_k}-D{d}"]
    parts += ["causal"] if causal else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"cap{softcap:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    case = dict(
        lens_q=lens_q, lens_k=lens_k, h=h, h_k=h_k, d=d, causal=causal, window=window, softcap=softcap, alibi=alibi
    )
    return pytest.param(case, id="-".join(parts))


def _random_lengths(n, longest, seed):
    rng = random.Random(seed)
    return [rng.randint(0, longest) for _ in range(n)], [rng.randint(0, longest) for _ in range(n)]


# Lengths of 0 and 1, Nq != Nk both ways within a batch, lengths around 16-, 32-, 64- and 128-row tiles.
CASES = [
    _case([5, 0, 7, 1], [5, 3, 0, 4], 4, 2, 16, causal=True),
    _case([9, 13], [9, 13], 2, 2, 32),
    _case([17, 33, 1, 64], [17, 33, 2, 64], 2, 1, 16, window=(8, 0), softcap=4.0),
    _case([40], [60], 2, 2, 64, causal=True, alibi="seq"),
    _case([130, 257, 3], [130, 257, 3], 2, 2, 64, alibi="head"),
    _case([100, 29, 200], [150, 29, 64], 4, 2, 128, causal=True, window=(31, 0)),
    # small enough for numba's simulator (the cases above with features are over its budget): a window with
    # softcap and ALiBi per sequence, GQA, lengths 0 and 1, Nq != Nk, 33 and 40 around 32-row and -key tiles
    _case([33, 1, 0, 6], [40, 2, 3, 0], 4, 2, 16, window=(7, 2), softcap=4.0, alibi="seq"),
    # Random lengths (seeded): eight sequences of 0 to 150 queries and, independently, keys, straddling
    # every tile edge the backends use; causal, and a two-sided window with softcap and GQA.
    _case(*_random_lengths(8, 150, seed=21), 2, 1, 32, causal=True),
    _case(*_random_lengths(8, 150, seed=22), 4, 2, 64, window=(40, 9), softcap=6.0),
]


def _inputs(case, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)

    def make(n, h):
        return torch.randn(n, h, case["d"], generator=g).to(device=device, dtype=dtype)

    total_q, total_k = sum(case["lens_q"]), sum(case["lens_k"])
    q, k, v = make(total_q, case["h"]), make(total_k, case["h_k"]), make(total_k, case["h_k"])
    slopes = None
    if case["alibi"] is not None:
        shape = (case["h"],) if case["alibi"] == "head" else (len(case["lens_q"]), case["h"])
        slopes = (torch.rand(shape, generator=g) * 0.3).to(device)
    return q, k, v, dict(window=case["window"], softcap=case["softcap"], alibi_slopes=slopes)


def _run(backend, q, k, v, case, options, device):
    cu_q, cu_k = offsets(case["lens_q"], device), offsets(case["lens_k"], device)
    try:
        return fa2.varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(case["lens_q"]),
            max(case["lens_k"]),
            causal=case["causal"],
            backend=backend,
            **options,
        )
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


def _sequences(case, options):
    """(rows, keys, that sequence's options) of each sequence: its slices of the packed tensors."""
    starts_q, starts_k = offsets(case["lens_q"], "cpu").tolist(), offsets(case["lens_k"], "cpu").tolist()
    for s in range(len(case["lens_q"])):
        slopes = options["alibi_slopes"]
        own = dict(options, alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[s])
        yield slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1]), own


def _work(case):
    return (1, case["h"], sum(case["lens_q"]), max(case["lens_k"]), case["d"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_sequence_matches_its_reference(backend, status, device, dtype, case):
    require_runnable(backend, status, device, dtype, _work(case))
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["lens_q"]))
    O, L = _run(backend, q, k, v, case, options, device)
    assert O.shape == q.shape and O.dtype == q.dtype, f"O {tuple(O.shape)} {O.dtype}"
    assert L.shape == (q.shape[1], q.shape[0]) and L.dtype == torch.float32, f"L {tuple(L.shape)} {L.dtype}"
    for rows, keys, own in _sequences(case, options):

        def t(x):
            return x.transpose(0, 1)

        assert_matches_reference(t(O[rows]), L[:, rows], t(q[rows]), t(k[keys]), t(v[keys]), case["causal"], **own)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[5], CASES[6]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_the_reference(backend, status, device, dtype, case):
    """dq, dk, dv of the whole packed batch against the fp64 reference's, by test_gradients' rule applied to
    the batch, as flash-attn's varlen tests apply theirs: per sequence, a 1-query sequence's naive error can
    be 0 while any kernel that computes Delta = rowsum(dO O) from the rounded O (FlashAttention-2's, every fa2
    backend's) keeps a rounding's worth."""
    require_runnable(backend, status, device, dtype, _work(case))
    q, k, v, options = _inputs(case, dtype, device, seed=sum(case["lens_k"]) + 3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    O, _ = _run(backend, q, k, v, case, options, device)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    got = grads(O, (q, k, v), dO)
    cu_q, cu_k = offsets(case["lens_q"], device), offsets(case["lens_k"], device)
    if dtype == torch.float32:
        ref = varlen_grads(q, k, v, dO, cu_q, cu_k, case["causal"], True, **options)
        tols = [FP32_GRAD_ATOL] * 3
    else:
        ref, tols = packed_grad_tolerances(q, k, v, dO, cu_q, cu_k, case["causal"], **options)
    for name, g, r, tol in zip(("dq", "dk", "dv"), got, ref, tols):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g} ({dtype})"


def _bad(**changes):
    q = torch.randn(12, 2, 16)
    args = dict(
        q=q,
        k=q,
        v=q,
        cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32),
        max_seqlen_q=7,
        max_seqlen_k=7,
    )
    args.update(changes)
    return args


BAD_INPUTS = [
    pytest.param(_bad(cu_seqlens_q=torch.tensor([0, 5, 12])), TypeError, "cu_seqlens_q must be int32", id="int64"),
    pytest.param(
        _bad(cu_seqlens_k=torch.tensor([[0, 5, 12]], dtype=torch.int32)),
        ValueError,
        r"cu_seqlens_k must have shape \(num_seqs \+ 1,\)",
        id="rank-2",
    ),
    pytest.param(
        _bad(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "same length", id="lengths-differ"
    ),
    pytest.param(
        _bad(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32)),
        ValueError,
        "from 0 to the total length 12",
        id="total-disagrees",
    ),
    pytest.param(_bad(cu_seqlens_q=[0, 5, 12]), TypeError, "cu_seqlens_q must be an int32 torch.Tensor", id="list"),
    pytest.param(_bad(max_seqlen_q=7.0), TypeError, "max_seqlen_q must be a non-negative int", id="max-float"),
    pytest.param(_bad(max_seqlen_k=-1), TypeError, "max_seqlen_k must be a non-negative int", id="max-negative"),
    pytest.param(
        _bad(q=torch.randn(1, 12, 2, 16)), ValueError, r"q must have shape \(total, heads, head_dim\)", id="padded-q"
    ),
    pytest.param(_bad(alibi_slopes=torch.ones(3, 2)), ValueError, r"\(2,\) or \(2, 2\)", id="alibi-shape"),
]


@pytest.mark.parametrize("args, error, match", BAD_INPUTS)
def test_bad_inputs_are_refused(args, error, match):
    alibi = args.pop("alibi_slopes", None)
    with pytest.raises(error, match=match):
        fa2.varlen_attention(**args, alibi_slopes=alibi, backend="pytorch")


def test_offsets_on_another_device_are_refused():
    args = _bad(cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="cu_seqlens_q must be on q's device"):
        fa2.varlen_attention(**args, backend="pytorch")


def test_offsets_checked_once_are_checked_again_after_an_in_place_change(backend, status, device, monkeypatch):
    """The totals' sync is paid once per offsets tensor (its version counter): the same tensor again is not
    read, and one changed in place, or a new one, is checked again."""
    require_runnable(backend, status, device, torch.float32, (1, 2, 12, 12, 16))
    args = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in _bad().items()}
    reads = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **kw: reads.append(1) or real_stack(*a, **kw))
    fa2.varlen_attention(**args, backend=backend)
    fa2.varlen_attention(**args, backend=backend)
    assert len(reads) == 1
    args["cu_seqlens_k"][-1] = 11
    with pytest.raises(ValueError, match="cu_seqlens_k must run from 0 to the total length 12"):
        fa2.varlen_attention(**args, backend=backend)
    args["cu_seqlens_k"][-1] = 12
    args["cu_seqlens_q"] = torch.tensor([0, 5, 13], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to the total length 12"):
        fa2.varlen_attention(**args, backend=backend)


def test_offsets_outside_the_tensors_are_clamped_or_refused(backend, status, device):
    """A middle offset past the total, which fa2.varlen_attention cannot see without reading every offset:
    fa2-pytorch, which reads them, refuses it; the GPU backends' kernels clamp each sequence into [0,
    total], so sequence 0 is all 12 rows and sequence 1 is empty, and nothing outside the tensors is read
    or written."""
    dtype = torch.float16 if status == "emulated" else torch.bfloat16
    require_runnable(backend, status, device, dtype, (1, 2, 12, 12, 16))
    q, k, v = (torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(i)).to(device, dtype) for i in range(3))
    cu = torch.tensor([0, 100, 12], dtype=torch.int32, device=device)
    if backend == "pytorch":
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing offsets within"):
            fa2.varlen_attention(q, k, v, cu, cu, 12, 12, backend=backend)
        return
    O, L = fa2.varlen_attention(q, k, v, cu, cu, 12, 12, backend=backend)

    def t(x):
        return x.transpose(0, 1)

    assert_matches_reference(t(O), L, t(q), t(k), t(v), False)
