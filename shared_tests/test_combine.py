"""fa2.combine: the merge of attention over key ranges into attention over their union.

Each backend's attention over disjoint key ranges (one of them empty, ends inside tiles), merged, against
the fp64 reference over all keys by the suite's precision rule; the merge itself against its formula in
fp64 and by gradcheck; rows that see no key in some or all ranges; bad input.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, random_qkv
from test_conformance import DTYPES, require_runnable

# Key ranges of 100 keys: an empty one, ends inside and on tile edges.
SPLITS = [(0, 37), (37, 37), (37, 64), (64, 100)]
FEATURES = {"plain": {}, "softcap": {"softcap": 3.0}}


@pytest.mark.parametrize("feature", list(FEATURES), ids=str)
@pytest.mark.parametrize("heads_k", [2, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_combined_ranges_match_attention_over_all_keys(backend, status, device, dtype, heads_k, feature):
    require_runnable(backend, status, device, dtype, (1, 2, 24, 100, 32))
    q, k, v = random_qkv((1, 2, 24, 32), (1, heads_k, 100, 32), dtype, device, seed=heads_k)
    q = q * 2  # scores spread wide enough that the ranges' masses differ by orders of magnitude
    parts = []
    for lo, hi in SPLITS:
        try:
            parts.append(fa2.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], backend=backend, **FEATURES[feature]))
        except NotImplementedError as e:
            pytest.skip(f"{backend} refuses: {e}")
    O, L = fa2.combine(torch.stack([p.O for p in parts]), torch.stack([p.L for p in parts]))
    assert_matches_reference(O, L, q, k, v, False, **FEATURES[feature])


def _parts(splits=3, rows=5, head_dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    O = torch.randn(splits, 2, rows, head_dim, generator=g, dtype=torch.float64)
    L = torch.randn(splits, 2, rows, generator=g, dtype=torch.float64) * 4
    return O, L


def test_combine_is_the_weighted_sum_and_the_logsumexp():
    O, L = _parts()
    got_O, got_L = fa2.combine(O, L)
    total = torch.log(torch.exp(L).sum(0))
    assert torch.allclose(got_L, total, rtol=0, atol=1e-12)
    assert torch.allclose(got_O, (torch.exp(L - total)[..., None] * O).sum(0), rtol=0, atol=1e-12)
    one_O, one_L = fa2.combine(O[:1], L[:1])
    assert torch.equal(one_O, O[0]) and torch.allclose(one_L, L[0], rtol=0, atol=1e-15)


def test_combine_gradients():
    O, L = _parts(seed=1)
    assert torch.autograd.gradcheck(lambda o, l: fa2.combine(o, l), (O.requires_grad_(), L.requires_grad_()))


def test_ranges_a_row_does_not_see_are_ignored_and_rows_that_see_nothing_stay_empty():
    """L = +inf marks a range where the row sees no key: its O row (here NaN) weighs nothing; a row with
    +inf everywhere comes out O = 0, L = +inf, as fa2.attention's rows that see no key."""
    O, L = _parts(splits=2)
    O32, L32 = O.float(), L.float()
    O32[1, 0, 2] = math.nan
    L32[1, 0, 2] = math.inf
    O32[:, 1, 4] = math.nan
    L32[:, 1, 4] = math.inf
    got_O, got_L = fa2.combine(O32, L32, dtype=torch.float16)
    assert got_O.dtype == torch.float16 and got_L.dtype == torch.float32
    assert torch.equal(got_O[0, 2], O32[0, 0, 2].half()) and got_L[0, 2] == L32[0, 0, 2]
    assert (got_O[1, 4] == 0).all() and got_L[1, 4] == math.inf
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 2] = keep[1, 4] = False
    assert not torch.isnan(got_O).any() and torch.isfinite(got_L[keep]).all()


@pytest.mark.parametrize(
    "O, L, error, match",
    [
        pytest.param(
            torch.zeros(2, 3, 4), torch.zeros(2, 4), ValueError, "splits, ..., seqlen_q, head_dim", id="shapes"
        ),
        pytest.param(torch.zeros(0, 3, 4), torch.zeros(0, 3), ValueError, "at least one split", id="no-split"),
        pytest.param(
            torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3), TypeError, "floating point", id="int-O"
        ),
        pytest.param(torch.zeros(2, 3, 4), None, TypeError, "must be tensors", id="no-L"),
        pytest.param(torch.zeros(2, 3, 4), torch.zeros(2, 3, device="meta"), ValueError, "one device", id="devices"),
    ],
)
def test_bad_inputs_are_refused(O, L, error, match):
    with pytest.raises(error, match=match):
        fa2.combine(O, L)
