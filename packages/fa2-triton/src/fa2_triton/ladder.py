"""fa2-triton's optimisation ladder (issue 43): the levers from the seed's minimal kernel to today's default
path, one rung at a time, each rung a configuration of the real kernels, never a copy of one.

A rung of the forward is a ``tiles.Tiles`` for ``forward_tl._attn_fwd``: the minimal rung's fixed fields,
then, rung after rung, one more group of fields taken from the entry that the tile table (``tiles_for``)
gives these inputs, so that the last ``forward_tl`` rung is that entry and the last rung of all is
``forward.flash_attn_forward`` with no tiles: the default path (the Gluon kernel where it takes the inputs,
that entry elsewhere). Where the table's entry leaves a lever off (pointer loads, no maxnreg, no warp
specialisation at these inputs), its rung runs what the rung before it ran. The backward's levers are its
kernels' tiles (``tiles.bwd_tiles_for``): their sizes and warps, their stages, their register cap; its
kernels have no exp or one-loop switch, so every rung's backward uses exp2 and split loops, and the
forward-only rungs reuse the backward of the rung before them (their ``lever`` says so).

The Hopper rungs: descriptors (``tma``) run on compute capability 9.0 and later and in the interpreter;
warp specialisation on 9.0 (the interpreter runs its loop unspecialised); Gluon on 9.0 with Triton's
Gluon Hopper API, not in the interpreter. Elsewhere each runs the nearest path its conditions allow
(``tiles.tma_layout``, ``tiles.ws_layout``, ``forward_gluon.uses_gluon``), which is the rung before it.
docs/ladder/triton.md explains every rung and quotes the lines it changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from fa2.spec import AttentionSpec
from fa2_triton.backward import flash_attn_backward
from fa2_triton.common import INTERPRETED
from fa2_triton.forward import flash_attn_forward
from fa2_triton.launch import recording
from fa2_triton.tiles import BwdTiles, KernelTiles, Tiles, bwd_tiles_for, tiles_for, ws_layout


class Rung(NamedTuple):
    name: str  # short id used in CSV rows and test ids
    title: str  # one line for the plot legend and the docs' heading
    lever: str  # what this rung changes relative to the previous one


RUNGS: tuple[Rung, ...] = (
    Rung(
        "minimal",
        "minimal: the seed's kernel",
        "One program per 64-row query tile, 64-key tiles, 4 warps, num_stages=1, pointer loads, scores in "
        "natural units and exp, one key loop that masks every tile; backward: 32x64 (dK/dV) and 64x32 (dQ) "
        "tiles, 4 warps, num_stages=1.",
    ),
    Rung(
        "tiles",
        "tuned tiles",
        "BLOCK_M, BLOCK_N, num_warps and the programs' order from the tile table (tiles.TILES, tuned on the "
        "H200) instead of 64x64 and 4 warps; the backward's tile sizes and warps from tiles.BWD_TILES.",
    ),
    Rung(
        "exp2",
        "exp2, scale folded into one FMA",
        "Scores in log2 units: exp2 instead of exp (one multiply fewer per score), the scale and the max "
        "subtraction in one FMA inside exp2 (FUSED_EXP2); forward only, the backward is the previous rung's.",
    ),
    Rung(
        "causal-split",
        "causal split: unmasked and diagonal loops",
        "The key loop split in two: the tiles every query row sees whole run without a mask, only the "
        "diagonal band (and a last partial tile) masked; forward only, the backward is the previous rung's.",
    ),
    Rung(
        "stages",
        "software pipelining",
        "num_stages from the tables instead of 1: Triton prefetches the next K/V tiles into shared memory "
        "while the current one is computed, in the forward and in both backward kernels.",
    ),
    Rung(
        "tma",
        "TMA descriptors (Hopper)",
        "q, k, v and O through host tensor descriptors (TMA, compute capability 9.0+) where the table's entry "
        "asks for them; pointer loads elsewhere (then this rung is the previous one); forward only.",
    ),
    Rung(
        "maxnreg",
        "register cap",
        "maxnreg from the tables (and lazy_rescale, which no entry asks for today) where an entry sets it, "
        "so that two programs fit on one SM; elsewhere this rung is the previous one.",
    ),
    Rung(
        "warp-specialize",
        "warp specialisation (Hopper)",
        "One key loop that Triton splits into a producer warp group and two consumer groups (compute "
        "capability 9.0, unmasked inputs of whole tiles, where the table asks: D = 128 from N = 2k); "
        "elsewhere this rung is the previous one; forward only.",
    ),
    Rung(
        "gluon",
        "Gluon (Hopper): the default path",
        "fa2-triton's default forward: the warp-specialised Gluon kernel (forward_gluon, ping-pong consumers "
        "on wgmma) where forward_gluon.uses_gluon takes the inputs (a Hopper GPU, 16-bit, D = 128, or D = 64 on "
        "three consumers from 4k keys, 8k queries causal; no window, seqlen_k a multiple of 128, causal with "
        "seqlen_k >= seqlen_q), the table's tl kernel elsewhere (then this "
        "rung is the previous one); the default backward (on Hopper at D = 64 and 128, causal or no mask, Gluon "
        "dK/dV and dQ kernels, backward_gluon).",
    ),
)
_INDEX = {r.name: i for i, r in enumerate(RUNGS)}

# The minimal rung's launch configurations.
# side-by-side: minimal
_MINIMAL = Tiles(64, 64, 4, 1, exp2=False, fused_exp2=False, split_loop=False)
_MINIMAL_BWD = BwdTiles(dkdv=KernelTiles(32, 64, 4, 1), dq=KernelTiles(64, 32, 4, 1))
# side-by-side: end

# rung name -> {(kernel, hash): resources}: the compiled kernels each rung has launched in this process.
_KERNELS: dict[str, dict[tuple, dict]] = {}


def _at(rung: str) -> int:
    if rung not in _INDEX:
        raise ValueError(f"fa2-triton's ladder has no rung {rung!r}; its rungs are {', '.join(_INDEX)}")
    return _INDEX[rung]


def _forward_tiles(rung: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> Tiles | None:
    """The forward's tiles at ``rung`` for these inputs (None: the default path, the last rung)."""
    i = _at(rung)
    if i == len(RUNGS) - 1:
        return None
    HEAD_DIM = max(16, triton.next_power_of_2(q.shape[-1]))

    def can_specialize(tiles):
        return ws_layout(q, k, v, spec.masked, HEAD_DIM, tiles)

    table = tiles_for(HEAD_DIM, q.dtype, spec.masked, k.shape[2], can_specialize)
    # side-by-side: climb
    t = _MINIMAL
    if i >= _INDEX["tiles"]:
        t = t._replace(
            block_m=table.block_m, block_n=table.block_n, num_warps=table.num_warps, grid_order=table.grid_order
        )
    if i >= _INDEX["exp2"]:
        t = t._replace(exp2=table.exp2, fused_exp2=table.fused_exp2)
    if i >= _INDEX["causal-split"]:
        t = t._replace(split_loop=table.split_loop)
    if i >= _INDEX["stages"]:
        t = t._replace(num_stages=table.num_stages)
    if i >= _INDEX["tma"]:
        t = t._replace(tma=table.tma)
    if i >= _INDEX["maxnreg"]:
        t = t._replace(maxnreg=table.maxnreg, lazy_rescale=table.lazy_rescale)
    if i >= _INDEX["warp-specialize"]:
        t = t._replace(warp_specialize=table.warp_specialize)
    # side-by-side: end
    return t


def _backward_tiles(rung: str, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> BwdTiles | None:
    """The backward kernels' tiles at ``rung`` for these inputs (None: the default, from ``maxnreg`` on,
    where every backward lever is the table's)."""
    i = _at(rung)
    if i >= _INDEX["maxnreg"]:
        return None
    table = bwd_tiles_for(q.shape[-1], q.dtype, spec.masked, k.shape[2])

    def climb(minimal: KernelTiles, entry: KernelTiles) -> KernelTiles:
        t = minimal
        if i >= _INDEX["tiles"]:
            t = t._replace(block_m=entry.block_m, block_n=entry.block_n, num_warps=entry.num_warps)
        if i >= _INDEX["stages"]:
            t = t._replace(num_stages=entry.num_stages)
        return t

    return BwdTiles(dkdv=climb(_MINIMAL_BWD.dkdv, table.dkdv), dq=climb(_MINIMAL_BWD.dq, table.dq))


def forward(
    rung: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) as ``fa2_triton.flash_attn_forward`` returns them, computed by the kernels as ``rung``
    configures them. q, k, v: (batch, heads, seqlen, head_dim) contiguous fp16 or bf16 (fp32 and fp16 in the
    interpreter); spec: the scale, causal or no window."""
    tiles = _forward_tiles(rung, q, k, v, spec)
    with recording() as kernels:
        out = flash_attn_forward(q, k, v, spec, tiles)
    _record(rung, kernels)
    return out


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
    """(dq, dk, dv) as ``fa2_triton.flash_attn_backward`` returns them (deterministic: the dQ kernel), by
    the kernels as ``rung`` configures them; O, L from this rung's forward."""
    tiles = _backward_tiles(rung, q, k, spec)
    with recording() as kernels:
        dq, dk, dv = flash_attn_backward(q, k, v, O, L, dO, spec, tiles)
    _record(rung, kernels)
    return dq, dk, dv


def resources(rung: str) -> list[dict]:
    """One dict per kernel ``rung`` has compiled and launched in this process, in the order first met:
    kernel (its name), registers_per_thread, spilled_bytes (local memory a thread), shared_bytes (static
    shared memory a program); [] in the interpreter, which compiles nothing."""
    _at(rung)
    return list(_KERNELS.get(rung, {}).values())


def _record(rung: str, kernels: list) -> None:
    if INTERPRETED:
        return
    seen = _KERNELS.setdefault(rung, {})
    for c in kernels:
        seen.setdefault(
            (c.name, c.hash),
            {
                "kernel": c.name,
                "registers_per_thread": c.n_regs,
                # Triton's n_spills is the kernel's local memory in 4-byte words.
                "spilled_bytes": 4 * c.n_spills,
                "shared_bytes": c.metadata.shared,
            },
        )
