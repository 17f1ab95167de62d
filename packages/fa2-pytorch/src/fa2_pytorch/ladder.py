"""fa2-pytorch's optimisation ladder (issue 43): the naive attention that materialises the scores, then
FlashAttention-2's tiled loop, which is this backend's forward and backward (the default path), then the same
loop through ``torch.compile``.

Unlike the other backends' ladders, the last rung is not the default path but one past it: fa2-pytorch runs
eager (no compilation on the first call, any shape at once), and ``compiled`` shows what compiling its loop
buys. ``tiled`` is the default path. docs/ladder/pytorch.md explains the rungs and quotes the lines they run.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from fa2.spec import AttentionSpec
from fa2_pytorch.backward import flash_attn_backward
from fa2_pytorch.forward import flash_attn_forward


class Rung(NamedTuple):
    name: str  # short id used in CSV rows and test ids
    title: str  # one line for the plot legend and the docs' heading
    lever: str  # what this rung changes relative to the previous one


RUNGS: tuple[Rung, ...] = (
    Rung(
        "naive",
        "naive: the scores materialised",
        "S = scale · q kᵀ for every (query, key) pair in fp32, the causal mask, torch.softmax, P V; the "
        "backward from the materialised P (dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))).",
    ),
    Rung(
        "tiled",
        "tiled: FlashAttention-2's loop (the default path)",
        "FlashAttention-2's online softmax over key tiles (fa2_pytorch.flash_attn_forward and "
        "flash_attn_backward): memory O(N · BLOCK_N) instead of O(N²), key tiles past the diagonal skipped.",
    ),
    Rung(
        "compiled",
        "compiled: torch.compile of the tiled loop (past the default path)",
        "The same forward and backward through torch.compile (TorchInductor): each key tile's passes over the "
        "scores fused into generated kernels; compiled once per class of inputs.",
    ),
)
# The rung that is fa2-pytorch's default path (the last rung, ``compiled``, is one past it).
DEFAULT = "tiled"
_NAMES = [r.name for r in RUNGS]


def _check(rung: str) -> None:
    if rung not in _NAMES:
        raise ValueError(f"fa2-pytorch's ladder has no rung {rung!r}; its rungs are {', '.join(_NAMES)}")


def _naive_probabilities(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, L): the softmax of the masked, scaled scores, (batch, heads, seqlen_q, seqlen_k) fp32, and its
    natural-log normaliser (batch, heads, seqlen_q); rows that see no key get P = 0 and L = +inf."""
    # side-by-side: naive
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * spec.scale  # [B, H, N_Q, N_K]
    if spec.causal:
        # Bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
        n_q, n_k = s.shape[-2:]
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~visible, -math.inf)
    L = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with every key masked: 0, not NaN
    # side-by-side: end
    return p, L.masked_fill(L == -math.inf, math.inf)


def forward(
    rung: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) as ``fa2_pytorch.flash_attn_forward`` returns them: O (batch, heads, seqlen_q, head_dim) in
    q's dtype, L (batch, heads, seqlen_q) float32, natural log. q, k, v: (batch, heads, seqlen, head_dim),
    the same heads; spec: the scale, causal or no window."""
    _check(rung)
    if rung == "tiled":
        return flash_attn_forward(q, k, v, spec)
    if rung == "compiled":
        return _compiled(flash_attn_forward)(q, k, v, spec)
    _check_spec(spec, q, k)
    p, L = _naive_probabilities(q, k, spec)
    return torch.matmul(p, v.float()).to(q.dtype), L


def backward(
    rung: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the shapes and dtypes of q, k, v, as ``fa2_pytorch.flash_attn_backward`` returns them;
    O and L from this rung's forward."""
    _check(rung)
    if rung == "tiled":
        return flash_attn_backward(q, k, v, O, L, dO, spec)
    if rung == "compiled":
        return _compiled(flash_attn_backward)(q, k, v, O, L, dO, spec)
    _check_spec(spec, q, k)
    # side-by-side: naive-backward
    p, _ = _naive_probabilities(q, k, spec)  # recomputed, as the tiled backward does: [B, H, N_Q, N_K]
    do = dO.float()
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.float().transpose(-2, -1))
    delta = (do * O.float()).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.float()) * spec.scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * spec.scale
    # side-by-side: end
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def _compiled(fn):
    """torch.compile of fn, made once (its compilations are cached by torch per class of inputs)."""
    # side-by-side: compiled
    return torch.compile(fn, fullgraph=False, dynamic=False)
    # side-by-side: end


def resources(rung: str) -> list[dict]:
    """[]: eager PyTorch compiles no kernel of its own (its ops' kernels are PyTorch's), and Inductor's
    kernels (``compiled``) report no registers here."""
    _check(rung)
    return []


def _check_spec(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor) -> None:
    """The naive rung computes what the ladder measures: dense attention, causal or not, one key/value head
    per query head."""
    if spec.window not in ((-1, -1), (-1, 0)) or spec.softcap or spec.alibi_slopes is not None:
        raise NotImplementedError(
            f"fa2-pytorch's naive rung computes causal or full attention alone, got window {spec.window}, "
            f"softcap {spec.softcap}, ALiBi {spec.alibi_slopes is not None}"
        )
    if spec.sink is not None or spec.varlen or q.shape[1] != k.shape[1]:
        raise NotImplementedError(
            f"fa2-pytorch's naive rung takes no sink, packed batch or grouped heads, got heads {q.shape[1]} "
            f"and heads_k {k.shape[1]}"
        )
