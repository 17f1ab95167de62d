"""``python -m fa2_numba_cuda.tuning.backward``: times configurations of the wgmma backward
(``backward_wgmma.WgmmaBwdConfig``) on this GPU against its default (``backward_wgmma.bwd_config``) and SDPA's
backward, and proposes ``bwd_config``'s choice per head dim.

Shapes: the benchmark's (16k tokens, hidden 2048: B = tokens / N, H = hidden / D), contiguous (B, H, N, D), causal
and not, bf16 by default; O and L from fa2-numba-cuda's forward, computed once per shape. Candidates: the default
(for the shape's mask) first, then every configuration of the grid --block-m x --dq-block-n x --dq (wgmma: the dQ
kernel of backward_wgmma; tc: backward_tc's, whose own tiles ignore --dq-block-n) x --split x --dv-early that
differs from it.

Before it is timed, each candidate's dq is checked on the benchmark's sample of rows against the fp64 reference
(``fa2.bench.check``'s rule) and its dk and dv against the default's (every element within ``CROSS_ULPS`` units of
the dtype's epsilon times the largest magnitude: other tiles add the same products in another order); a wrong one
is recorded, not timed, and so is one that raises (with the reason). The clock is the benchmark's
(``fa2.bench.timing``: do_bench median, 25/100 ms), in ``ROUNDS`` rounds over a shape's candidates and SDPA's
providers, every other round in reverse order, each one's time the median of its rounds. The candidates are timed
as calls of ``backward_wgmma.flash_attn_backward`` (preprocess, dK/dV and dQ launches, prepared once per
configuration); SDPA's as ``torch.autograd.grad`` of their forward's output, as the benchmark's bwd mode times
every provider, which adds the autograd engine's host time (tens of microseconds, behind the GPU's queue at these
shapes). TFLOP/s count the backward as 2.5 times the forward's FLOPs, halved for causal, as the benchmark.

Candidates that differ only in the other kernel's fields share its compilation (``backward_wgmma.kernel_config``).
Writes every measurement, with the kernels' registers and local memory as numba reports them
(``backward_wgmma.kernel_resources``; backward_tc's dQ kernel has none there), to ``<gpu>-tune-numba-bwd.csv`` as
``tuning.forward`` writes its own, prints and proposes as it does, and runs on numba's simulator without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from fa2.bench import check
from fa2_numba_cuda import backward_wgmma, forward
from fa2_numba_cuda.backward_wgmma import WgmmaBwdConfig, bwd_config
from fa2_numba_cuda.tuning.forward import (
    Measured,
    Point,
    Result,
    describe,
    inputs,
    ints,
    parser_with_shapes,
    resources,
    switches,
    tune,
    words,
)

# dk, dv against the default's: max |x - x_default| <= CROSS_ULPS · eps(dtype) · max |x_default|.
CROSS_ULPS = 4
RESOURCE_COLUMNS = ("dkdv_registers", "dkdv_local_bytes", "dq_registers", "dq_local_bytes")


def candidates(args: argparse.Namespace, head_dim: int, causal: bool) -> list[WgmmaBwdConfig]:
    """The default for the mask first, then the grid's other configurations (with backward_tc's dQ kernel, one per
    BLOCK_M: it has its own tiles)."""
    default = bwd_config(head_dim, masked=causal)
    out = [default]
    for block_m, dq_n, dq, split, early in itertools.product(
        args.block_m, args.dq_block_n, args.dq, args.split, args.dv_early
    ):
        wgmma_dq = dq == "wgmma"
        # backward_tc's dQ kernel reads no DQ_BLOCK_N: the field's default, which its name then omits.
        dq_n = dq_n if wgmma_dq else WgmmaBwdConfig._field_defaults["DQ_BLOCK_N"]
        config = WgmmaBwdConfig(block_m, early, dq_n, wgmma_dq, split)
        if config not in out:
            out.append(config)
    return out


def cross_problem(grads, default_grads, dtype: torch.dtype) -> str | None:
    """Whether dk and dv are the default's up to the order of their sums (``CROSS_ULPS``)."""
    for name, x, ref in zip(("dk", "dv"), grads[1:], default_grads[1:]):
        scale = ref.float().abs().max().item()
        err = (x.float() - ref.float()).abs().max().item()
        if not err <= CROSS_ULPS * torch.finfo(dtype).eps * scale:
            return f"max |{name} - the default's| = {err:.3g} > {CROSS_ULPS} eps x max |{name}| = {scale:.3g}"
    return None


def measure_point(p: Point, args: argparse.Namespace, device: torch.device) -> dict[str, Result]:
    q, k, v, dO = inputs(p, device)
    O, L = forward.flash_attn_forward(q, k, v, p.spec)
    sample = check.reference_sample(q, k, v, p.causal, dO=dO)
    default_grads = []  # the first right candidate's (the default's, unless it is wrong)

    def problem(grads):
        wrong = check.grad_problem(grads, q, k, v, sample)
        if wrong:
            return wrong
        if not default_grads:
            default_grads.extend(grads)
            return None
        return cross_problem(grads, default_grads, q.dtype)

    m = Measured()
    configs = candidates(args, p.head_dim, p.causal)
    for config in configs:
        call = functools.partial(backward_wgmma.flash_attn_backward, q, k, v, O, L, dO, p.spec, config)
        m.run(describe(config), call, device, problem)
    m.baselines(
        p, args.baselines, device, (q, k, v, dO), functools.partial(check.grad_problem, q=q, k=k, v=v, s=sample)
    )
    m.time(device, args.rounds)
    built = backward_wgmma.kernel_resources()
    for config in configs:
        m.results[describe(config)].resources = resources(built, config, p)
    return m.results


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_with_shapes("python -m fa2_numba_cuda.tuning.backward", __doc__)
    parser.add_argument("--block-m", type=ints, default=(64, 96), help="dK/dV query tiles (default 64,96)")
    parser.add_argument("--dq-block-n", type=ints, default=(64, 96, 128), help="wgmma dQ key tiles (default 64,96,128)")
    parser.add_argument("--dq", type=words(("wgmma", "tc")), default=("wgmma", "tc"), help="dQ kernels (default both)")
    parser.add_argument("--split", type=switches, default=(True,), help="SPLIT_MASK on,off (default on)")
    parser.add_argument("--dv-early", type=switches, default=(False,), help="DV_EARLY on,off (default off)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return tune(parse_args(argv), "bwd", measure_point, RESOURCE_COLUMNS, "WgmmaBwdConfig")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
