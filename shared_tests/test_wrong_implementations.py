"""The suite's own test: implementations that are wrong in ways a kernel is often wrong must fail the
checks every backend passes (after gpu-mode reference-kernels' solutions/wrong/)."""

from __future__ import annotations

import math

import pytest
import torch

from checks import assert_matches_reference, random_qkv
from fa2 import reference


def top_left_causal(q, k, v, causal, scale=None):
    """Causal mask aligned top-left (key j visible iff j <= i), as torch's SDPA is_causal."""
    if not causal or q.shape[-2] == k.shape[-2]:
        return _cast(*reference.attention(q, k, v, causal, scale), q.dtype)
    scale = scale or 1 / math.sqrt(q.shape[-1])
    S = (q.double() @ k.double().transpose(-2, -1)) * scale
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    S = S.masked_fill(j > i, -math.inf)
    return torch.softmax(S, -1).matmul(v.double()).to(q.dtype), torch.logsumexp(S, -1).float()


def log2_lse(q, k, v, causal, scale=None):
    """L in log base 2, as kernels that use exp2 internally forget to convert back."""
    O, L = reference.attention(q, k, v, causal, scale)
    return O.to(q.dtype), (L / math.log(2)).float()


def fp16_rounded_fp32(q, k, v, causal, scale=None):
    """An fp32 path that silently computes in fp16."""
    O, L = reference.attention(q.half(), k.half(), v.half(), causal, scale)
    return O.to(torch.float16).to(q.dtype), L.half().float()


def _cast(O, L, dtype):
    return O.to(dtype), L.float()


@pytest.mark.parametrize(
    "wrong, dtype, n_q, n_k",
    [
        pytest.param(top_left_causal, torch.float32, 5, 9, id="top-left-causal"),
        pytest.param(top_left_causal, torch.float16, 9, 5, id="top-left-causal-fp16"),
        pytest.param(log2_lse, torch.float16, 17, 17, id="log2-L"),
        pytest.param(fp16_rounded_fp32, torch.float32, 33, 47, id="fp16-rounded-fp32"),
    ],
)
def test_known_wrong_implementation_fails(wrong, dtype, n_q, n_k):
    q, k, v = random_qkv((2, 3, n_q, 32), (2, 3, n_k, 32), dtype, "cpu", seed=9)
    O, L = wrong(q, k, v, True)
    with pytest.raises(AssertionError):
        assert_matches_reference(O, L, q, k, v, True)
