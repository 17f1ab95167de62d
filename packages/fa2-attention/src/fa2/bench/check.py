"""The correctness check before timing: a provider's output on a sample of rows against fa2.reference.

The rule is shared_tests/checks.py's (FlashAttention-2's): in fp16 and bf16 the max error against the
fp64 reference may be twice that of a naive attention computed in the same precision, plus twice the
error of rounding the fp64 result to that dtype; fp32 gets fixed tolerances. The full reference at
N = 16k would materialise B·H·N² fp64 scores, so it runs on a sample instead: the first and last batch
entries and heads, and 64 query rows including the first and the last (``fa2.reference.attention(...,
rows=...)`` keeps the causal alignment of the full matrix).

The backward (mode "bwd"): row i of dq depends on row i of dO alone, so dq is checked on the same sample
by the rule of shared_tests/test_gradients.py (three times the naive error plus twice the rounding error;
fp32 within ``FP32_GRAD_ATOL``); dk and dv sum over every query row and are checked for NaN and inf only.

The reference computes what the provider was asked for: the same causal mask, sliding window and softcap
(``reference_sample(..., window=, softcap=)``), and each sampled query head against its key/value head.

A packed batch (``lengths``: the sequences one after the other) is checked on (1, heads, total, head_dim)
views of its (total, heads, head_dim) tensors: the sample adds each sequence's first and last row to the
random ones, and each sampled row's reference is its own sequence's attention (``fa2.reference.attention``
on that sequence's queries and keys), as ``fa2.reference.varlen_attention`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fa2 import reference

SAMPLE_ROWS = 64
FP32_ATOL = {"O": 5e-5, "L": 5e-5}
FP32_GRAD_ATOL = 1e-4
L_FLOOR = 1e-5


@dataclass
class Sample:
    """Where the sample lies in (B, H, N) and the reference there; tolerances per the rule above."""

    batch_idx: torch.Tensor
    head_idx: torch.Tensor
    rows: torch.Tensor
    O_ref: torch.Tensor
    L_ref: torch.Tensor
    tol_O: float
    tol_L: float
    dq_ref: torch.Tensor | None = None
    tol_dq: float = 0.0


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def reference_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    seed: int = 0,
    dO: torch.Tensor | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    lengths: tuple[int, ...] = (),
) -> Sample:
    """The fp64 reference (and, in fp16/bf16, the naive same-precision one) on the sample of q's rows, with
    the provider's options (``window`` and ``softcap`` as fa2.attention takes them); with ``dO``, also dq
    there. ``lengths``: q, k, v (1, heads, total, head_dim) hold a packed batch of sequences of these
    lengths (see the module docstring)."""
    options = {"window": window, "softcap": softcap, "lengths": lengths}
    batch, heads, seqlen, _ = q.shape
    device = q.device
    batch_idx = torch.tensor([0, batch - 1], device=device).unique()
    head_idx = torch.tensor([0, heads - 1], device=device).unique()
    g = torch.Generator().manual_seed(seed)
    edges = [0, seqlen - 1] + [end for start in _starts(lengths) for end in (start, start - 1)]
    rows = torch.cat([torch.tensor(edges), torch.randperm(seqlen, generator=g)[: SAMPLE_ROWS - 2]])
    rows = rows[(rows >= 0) & (rows < seqlen)].unique().to(device)
    # Grouped-query attention: query head h reads key/value head h // group.
    head_idx_k = head_idx // (heads // k.shape[1])
    q = q.index_select(0, batch_idx).index_select(1, head_idx)
    k, v = (t.index_select(0, batch_idx).index_select(1, head_idx_k) for t in (k, v))
    O_ref, L_ref = _reference(q, k, v, causal, rows, options)
    tol_O, tol_L = FP32_ATOL["O"], FP32_ATOL["L"]
    if q.dtype != torch.float32:
        O_naive, L_naive = _reference(q, k, v, causal, rows, options, upcast=False)
        tol_O = 2 * _max_err(O_naive, O_ref) + 2 * _max_err(O_ref.to(q.dtype), O_ref)
        tol_L = 2 * _max_err(L_naive, L_ref) + L_FLOOR
    sample = Sample(batch_idx, head_idx, rows, O_ref, L_ref, tol_O, tol_L)
    if dO is not None:
        dO = _sampled(dO, sample)
        sample.dq_ref = _dq_on_rows(q.double(), k.double(), v.double(), dO, causal, rows, options)
        sample.tol_dq = FP32_GRAD_ATOL
        if q.dtype != torch.float32:
            dq_naive = _dq_on_rows(q, k, v, dO, causal, rows, options, upcast=False)
            dq_ref = sample.dq_ref
            sample.tol_dq = 3 * _max_err(dq_naive, dq_ref) + 2 * _max_err(dq_ref.to(q.dtype), dq_ref)
    return sample


def _starts(lengths: tuple[int, ...]) -> list[int]:
    """Where each sequence of a packed batch starts."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts


def _reference(q, k, v, causal, rows, options, upcast=True) -> tuple[torch.Tensor, torch.Tensor]:
    """fa2.reference.attention at ``rows`` (sorted) with ``options``; with options["lengths"] each row's
    own sequence: the rows of sequence s against its keys, their indices taken from its start."""
    lengths = options["lengths"]
    options = {name: value for name, value in options.items() if name != "lengths"}
    if not lengths:
        return reference.attention(q, k, v, causal, upcast=upcast, rows=rows, **options)
    Os, Ls = [], []
    for start, n in zip(_starts(lengths), lengths):
        inside = rows[(rows >= start) & (rows < start + n)]
        if len(inside):
            seq = slice(start, start + n)
            O, L = reference.attention(
                q[..., seq, :], k[..., seq, :], v[..., seq, :], causal, upcast=upcast, rows=inside - start, **options
            )
            Os.append(O)
            Ls.append(L)
    return torch.cat(Os, dim=-2), torch.cat(Ls, dim=-1)


def _dq_on_rows(q, k, v, dO_rows, causal, rows, options, upcast=True) -> torch.Tensor:
    """dq at ``rows`` of q: the gradient of those rows' outputs (fa2.reference with ``options``, in q's dtype
    without ``upcast``) against dO_rows."""
    with torch.enable_grad():
        q = q.detach().requires_grad_()
        O, _ = _reference(q, k, v, causal, rows, options, upcast=upcast)
        (dq,) = torch.autograd.grad(O, q, dO_rows.to(O.dtype))
    return dq.index_select(2, rows)


def _sampled(x: torch.Tensor, s: Sample) -> torch.Tensor:
    """x's entries at the sample: x is (B, H, N, ...)."""
    return x.index_select(0, s.batch_idx).index_select(1, s.head_idx).index_select(2, s.rows)


def problem(O: torch.Tensor, L: torch.Tensor | None, q: torch.Tensor, s: Sample) -> str | None:
    """None if (O, L) passes on the sample, else what is wrong. L None: the check covers O only. Every
    row of the benchmark's shapes sees a key (seqlen_q = seqlen_k; a window (W, 0) keeps the diagonal), so
    L must be finite throughout."""
    if O.shape != q.shape or O.dtype != q.dtype:
        return f"O is {tuple(O.shape)} {O.dtype}, want {tuple(q.shape)} {q.dtype}"
    outputs = [("O", O, s.O_ref, s.tol_O)]
    if L is not None:
        if L.shape != q.shape[:-1]:
            return f"L is {tuple(L.shape)}, want {tuple(q.shape[:-1])}"
        outputs.append(("L", L, s.L_ref, s.tol_L))
    for name, x, ref, tol in outputs:
        x = _sampled(x, s)
        if not torch.isfinite(x).all():
            return f"{name} has NaN or inf on the sampled rows"
        err = _max_err(x, ref)
        if err > tol:
            return f"max |{name} - {name}_ref| = {err:.3g} > tolerance {tol:.3g} on the sampled rows"
    return None


def grad_problem(grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Sample) -> str | None:
    """None if (dq, dk, dv) pass (see the module docstring), else what is wrong."""
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if g.shape != x.shape or g.dtype != x.dtype:
            return f"{name} is {tuple(g.shape)} {g.dtype}, want {tuple(x.shape)} {x.dtype}"
        if not torch.isfinite(g).all():
            return f"{name} has NaN or inf"
    err = _max_err(_sampled(grads[0], s), s.dq_ref)
    if err > s.tol_dq:
        return f"max |dq - dq_ref| = {err:.3g} > tolerance {s.tol_dq:.3g} on the sampled rows"
    return None
