"""fa2-pytorch's tile skipping under windows, at tile sizes small enough that every case crosses many tile
edges: the key tiles no window reaches are never read (NaN there changes nothing), the query tiles that
see none of a key tile skip it, and the mask on the tiles that straddle an edge, with softcap, ALiBi and
GQA riding along, forward and backward, against the fp64 reference. The shared suite runs the default
128 x 256 tiles, where most of these shapes fit in one or two."""

from __future__ import annotations

import math

import pytest
import torch

from checks import assert_matches_reference, random_qkv
from fa2.spec import AttentionSpec
from fa2_pytorch.backward import flash_attn_backward
from fa2_pytorch.forward import flash_attn_forward
from test_gradients import assert_grads_match

# Powers of two like the defaults, and odd sizes, whose tile edges land where powers of two cannot.
TILES = [pytest.param((8, 16), id="tiles8x16"), pytest.param((5, 7), id="tiles5x7")]


def _case(h, h_k, n_q, n_k, window, softcap=0.0, alibi=False):
    name = f"H{h}-Hk{h_k}-{n_q}x{n_k}-w{window[0]}.{window[1]}" + (f"-cap{softcap:g}" if softcap else "")
    return pytest.param((h, h_k, n_q, n_k), window, softcap, alibi, id=name + ("-alibi" if alibi else ""))


CASES = [
    _case(2, 2, 61, 61, (-1, 0)),
    _case(2, 1, 45, 77, (5, 0)),
    _case(2, 2, 77, 45, (0, 9)),
    _case(3, 1, 50, 50, (17, 3), softcap=4.0),
    _case(2, 2, 40, 97, (8, 8), alibi=True),
    _case(4, 2, 97, 40, (-1, 6), softcap=3.0, alibi=True),
    _case(2, 2, 33, 70, (2, -1)),
    _case(2, 2, 70, 33, (0, 0), alibi=True),
    # 5 x 7 tiles: the last row's first key is 29, in the key tile [28, 30); with no right edge to mask it,
    # only the left edge's test keeps key 28 from that row.
    _case(2, 2, 33, 30, (0, -1)),
]


def _poisoned_inputs(shape, spec, block_n, seed):
    """fp32 q, k, v with NaN in the keys and values of every key tile outside the loop's range."""
    h, h_k, n_q, n_k = shape
    q, k, v = random_qkv((2, h, n_q, 16), (2, h_k, n_k, 16), torch.float32, "cpu", seed=seed)
    q, k = q * 2, k * 2
    lo, hi = spec.key_range(0, n_q, n_q, n_k)
    first, last = lo // block_n * block_n, min(-(-hi // block_n) * block_n, n_k)
    k_bad, v_bad = k.clone(), v.clone()
    for t in (k_bad, v_bad):
        t[:, :, :first] = math.nan
        t[:, :, last:] = math.nan
    return q, k, v, k_bad, v_bad


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("shape, window, softcap, alibi", CASES)
def test_small_tiles_forward_and_backward(shape, window, softcap, alibi, tiles):
    block_m, block_n = tiles
    h, h_k, n_q, n_k = shape
    slopes = torch.rand(2, h, generator=torch.Generator().manual_seed(1)) * 0.3 if alibi else None
    spec = AttentionSpec(scale=0.25, window=window, softcap=softcap, alibi_slopes=slopes, group=h // h_k)
    q, k, v, k_bad, v_bad = _poisoned_inputs(shape, spec, block_n, seed=sum(shape))
    features = dict(window=window, softcap=softcap, alibi_slopes=slopes)

    O, L = flash_attn_forward(q, k_bad, v_bad, spec, block_m, block_n)
    assert not torch.isnan(O).any() and not torch.isnan(L).any(), "a key tile outside the window was read"
    assert_matches_reference(O, L, q, k, v, False, scale=0.25, **features)

    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    dq, dk, dv = flash_attn_backward(q, k_bad, v_bad, O, L, dO, spec, block_m, block_n)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv)), "a key tile outside the window was read"
    assert_grads_match(dq, dk, dv, q, k, v, dO, False, scale=0.25, **features)
