"""fa2-triton's launch configurations: the tile tables and what chooses from them.

Forward: the levers that change the speed but not the result (the tile sizes, the order of the programs, a
lazy rescale, maxnreg, tensor descriptors, warp specialisation) are the fields of ``Tiles``, chosen per
(head_dim, dtype class, masked (causal's entries serve every window), seqlen bucket) from ``TILES`` by
``tiles_for``, which ``python -m fa2_triton.tuning.forward`` measures on a GPU. Whether the inputs can take
what the tiles ask for: ``tma_layout`` (host tensor descriptors over (B, H, N, D)) and ``ws_tiles`` /
``ws_layout`` (the warp-specialised loop).

Backward: each kernel has its own configuration (``KernelTiles``: tiles, num_warps, num_stages, a register
cap; a ``BwdTiles`` for the dK/dV and dQ kernels), chosen the same way from ``BWD_TILES`` by
``bwd_tiles_for``, which ``python -m fa2_triton.tuning.backward`` measures on a GPU, timing the two kernels
apart; packed batches' dK/dV kernel at head_dim 64 takes ``BWD_DKDV_VARLEN``, padded 16-bit head dims
``BWD_TILES_16BIT_PADDED``, the preprocess kernel ``PREPROCESS_ELEMENTS``.

The KV-cache kernel's tiles are worked out from head_dim, the dtype, the group's query rows and the page size,
not read from a table (``kvcache._tiles``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fa2_triton.common import INTERPRETED, capability, padded_head_dim


class Tiles(NamedTuple):
    """One launch configuration: the tiles, and levers that change the speed but not the result."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Read q, k, v and write O through tensor descriptors (TMA on Hopper) when ``tma_layout`` allows it;
    # otherwise, or if False, pointer loads. Either way the same kernel, the same arithmetic.
    tma: bool = False
    # The order of the programs: 0 query tiles fastest; 1 query tiles fastest, the last (under causal the
    # longest) first; 2 batch·heads fastest, the last query tiles first.
    grid_order: int = 0
    # Rescale acc only when some row's max moved by more than RESCALE_THRESHOLD (one branch per tile).
    lazy_rescale: bool = False
    # Scale and subtract the max in one FMA inside exp2; taken only when scale > 0.
    fused_exp2: bool = True
    # Registers per thread at most (PTX .maxnreg), so that more programs fit on one SM; None: the compiler's.
    maxnreg: int | None = None
    # One key loop that Triton splits into a producer warp group (the loads) and two consumer warp groups of
    # BLOCK_M / 2 rows each, so that one group's softmax overlaps the other's matmuls; taken when
    # ``ws_layout`` holds (else the path the fields above choose; ``tiles_for`` picks a table's fallback).
    warp_specialize: bool = False
    # The ladder's first rungs (``fa2_triton.ladder``) turn these off; every table entry keeps them on.
    # False: scores in natural units and ``exp`` instead of log2 units and exp2 (then never fused_exp2).
    exp2: bool = True
    # False: the seed's one key loop, every visited tile masked, instead of an unmasked loop over the tiles
    # every row sees whole and masked ones across the edges (then never warp_specialize).
    split_loop: bool = True


# Keys of TILES: HEAD_DIM (head_dim padded to a power of two), the dtype class, masked (causal or any window:
# causal's entries serve them all).
DTYPE_CLASS = {torch.float16: "16-bit", torch.bfloat16: "16-bit", torch.float32: "fp32"}

# (HEAD_DIM, dtype class, masked) -> ((largest seqlen_k, Tiles), ..., (None, Tiles)): the first entry whose
# bound holds seqlen_k wins, passing over one that asks for warp specialisation where the inputs cannot take
# it: each such entry is followed by its fallback, with the same bound. Each compiles for sm_90a on Triton
# 3.6 and 3.9 without register spills for head_dim = HEAD_DIM (a padded head_dim such as 72 takes the
# pointer path with column masks and spills).
# 16-bit inputs, wgmma. D = 64 and 128 are the benchmark's; `python -m fa2_triton.tuning.forward` on a GPU times
# candidates on its shapes and prints these entries, tuned, ready to replace the ones below.
# D = 256 halves BLOCK_M and keeps two stages (160 KiB of shared memory).
# fp32, FMA matmuls (no TF32): each thread holds whole rows of the operands, so small tiles from D = 64.
_UNTUNED = {
    (16, "16-bit"): Tiles(128, 64, 4, 3, tma=True),
    (32, "16-bit"): Tiles(128, 64, 4, 3, tma=True),
    (256, "16-bit"): Tiles(64, 64, 8, 2, tma=True),
    (16, "fp32"): Tiles(64, 32, 4, 2),
    (32, "fp32"): Tiles(64, 32, 4, 2),
    (64, "fp32"): Tiles(32, 32, 8, 2),
    (128, "fp32"): Tiles(32, 32, 8, 2),
    (256, "fp32"): Tiles(32, 32, 8, 2),
}
TILES: dict[tuple[int, str, bool], tuple[tuple[int | None, Tiles], ...]] = {
    **{(d, c, causal): ((None, t),) for (d, c), t in _UNTUNED.items() for causal in (False, True)},
    # Tuned on the H200 (python -m fa2_triton.tuning.forward --budget-s 270, bf16, N = 1k / 4k / 16k; its CSV is
    # docs/benchmarks/h200-tune.csv): the winner per bucket, seqlen_k <= bound.
    # From N = 1k: pointer loads, 8 warps, two programs per SM (maxnreg), since a search with pointer loads
    # among the tiles (docs/benchmarks/h200-tune-w8.csv): 1.03-1.11x the 64x128 entry at 1k-8k in that run,
    # 1.01-1.08x in one process over four alternating rounds (fp16 and bf16, N = 1k ... 16k).
    (64, "16-bit", False): (
        (724, Tiles(64, 128, 4, 2, tma=True)),
        (None, Tiles(128, 128, 8, 3, maxnreg=128)),
    ),
    (64, "16-bit", True): (
        (2048, Tiles(64, 64, 4, 2, tma=True, maxnreg=96)),
        (8192, Tiles(64, 128, 4, 2, tma=True)),
        (None, Tiles(64, 128, 4, 2, tma=True, grid_order=1)),
    ),
    # Tuned again with warp specialisation (fp16 and bf16, N = 512 ... 16k; docs/benchmarks/h200-tune-ws.csv):
    # 1.01-1.02x the unspecialised winner at 2k, 1.07-1.12x from 4k. On a Hopper GPU with Gluon, inputs
    # without softcap or ALiBi and lengths in multiples of 128 run forward_gluon's kernel instead
    # (forward_gluon.uses_gluon): these entries serve the rest, and the tuner times only this tl kernel.
    (128, "16-bit", False): (
        (1448, Tiles(128, 64, 4, 2, tma=True)),
        (None, Tiles(128, 128, 4, 2, tma=True, warp_specialize=True)),
        (None, Tiles(128, 64, 4, 2, tma=True)),
    ),
    # The 16k entry reads through descriptors since a run over both dtypes and every N (h200-tune-all-n.csv):
    # 1.04-1.05x the pointer loads it had, in both dtypes.
    (128, "16-bit", True): (
        (2048, Tiles(64, 64, 4, 3, tma=True)),
        (8192, Tiles(128, 64, 4, 2, tma=True)),
        (None, Tiles(128, 128, 8, 3, tma=True, grid_order=1)),
    ),
}


def tiles_for(
    head_dim_padded: int, dtype: torch.dtype, masked: bool = False, seqlen_k: int | None = None, can_specialize=None
) -> Tiles:
    """The launch configuration for a padded head_dim, an input dtype, whether a window masks some keys
    (``AttentionSpec.masked``: causal's entries serve every window, whose programs also end at a band) and
    seqlen_k (None: the largest bucket). ``can_specialize(tiles)``: whether the inputs can take the
    warp-specialised loop with those tiles (None: as if they could); an entry that asks for it where they
    cannot is passed over for its fallback. The interpreter gets the same tiles as the GPU (it ignores
    num_warps and num_stages), so CPU tests cover the GPU's tiling."""
    entries = TILES[head_dim_padded, DTYPE_CLASS[dtype], masked]
    tiles = _bucket(
        (
            (bound, t)
            for bound, t in entries
            if not (t.warp_specialize and can_specialize is not None and not can_specialize(t))
        ),
        seqlen_k,
    )
    if tiles is not None:
        return tiles
    raise AssertionError(f"TILES[{head_dim_padded}, {DTYPE_CLASS[dtype]}, {masked}] lacks its last (None) entry")


# A call of at most SHORT_CALL_PAIRS (query, key) pairs and SHORT_CALL_ROWS query and key rows over its
# batch and heads is bound by the host: Triton's launcher encodes every host tensor descriptor on every call
# (four for the tl forward, more for the Gluon kernels), which costs more host time than such a kernel runs.
# Such calls read through pointers and take the tl kernels (``short_call``). Measured on the H200
# (docs/notes/host-overhead.md): a tiny call's host time falls by 14-24 µs forward and 50-65 µs backward,
# while at 2^20 pairs the kernels (graph replays) take 0-1 µs more at D = 64 forward, 0-15 µs more backward,
# and up to 20 µs more at D = 128 forward (the tl kernel in place of Gluon's: 36 µs against 16 at
# (1, 1, 1024, 1024)). Tests that exercise the descriptor paths on small inputs set SHORT_CALL_PAIRS to -1.
SHORT_CALL_PAIRS = 1 << 20
SHORT_CALL_ROWS = 1 << 16


def short_call(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call on q (batch, heads, seqlen_q, head_dim) and k (batch, heads_k, seqlen_k, head_dim) is
    short enough to be bound by the host (``SHORT_CALL_PAIRS``): then the default tiles read through
    pointers, and the Gluon kernels pass it to the tl ones."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    rows = batch * heads
    return rows * seqlen_q * seqlen_k <= SHORT_CALL_PAIRS and rows * (seqlen_q + seqlen_k) <= SHORT_CALL_ROWS


def tma_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim_padded: int) -> bool:
    """Whether q, k, v can be read through (B, H or H_K, N, D) tensor descriptors: a Hopper or later GPU (or the
    interpreter), head_dim already a power of two >= 16 (HEAD_DIM == head_dim, so a block never reaches past
    a row), no empty dimension, unit stride along head_dim, every other stride (of a dimension longer than
    one) positive and a multiple of 16 bytes, and 16-byte aligned data. O, fresh and contiguous, always
    qualifies then. The block is [1, 1, BLOCK, HEAD_DIM], so a tile never crosses into another head: rows
    past seqlen come back as zeros and are not written."""
    if q.shape[-1] != head_dim_padded:
        return False
    if not INTERPRETED and capability(q.device.index)[0] < 9:
        return False
    for t in (q, k, v):
        if t.numel() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            if size > 1 and (stride <= 0 or stride * t.element_size() % 16):
                return False
    return True


def ws_tiles(tiles: Tiles, masked: bool) -> bool:
    """Whether ``tiles`` take the warp-specialised loop where the inputs allow it: asked for, no window
    (``masked``: causal or any window; Triton 3.6 does not specialise a kernel with a second key loop, the
    band's, and causal as one loop masking every tile ran at 0.83-1.01x the unspecialised kernel at D = 128
    and 0.59-0.78x at D = 64), and the configuration measured correct on the H200 with Triton 3.6: BLOCK_M
    128 (two consumer groups of 64 rows), 4 warps a group, 2 stages (3 gave NaN there), without lazy_rescale
    (its branch keeps Triton from specialising the loop) or maxnreg (the groups set their own), with the
    split loop (the specialised loop is the unmasked one). Softcap and ALiBi take it: they are elementwise
    work inside the one loop."""
    shape = (tiles.block_m, tiles.num_warps, tiles.num_stages)
    return (
        tiles.warp_specialize
        and not masked
        and shape == (128, 4, 2)
        and not tiles.lazy_rescale
        and tiles.maxnreg is None
        and tiles.split_loop
    )


def ws_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool, head_dim_padded: int, tiles: Tiles
) -> bool:
    """Whether the warp-specialised loop runs: ``ws_tiles``, a Hopper GPU (sm_90; or the interpreter,
    which runs the loop without specialising it), contiguous q, k, v with head_dim a power of two >= 16
    (descriptors built in the kernel over the (B·H·N, D) rows of q and the (B·H_K·N, D) rows of k and v,
    16-byte aligned), seqlen_q a multiple of
    BLOCK_M and seqlen_k of BLOCK_N (so no tile crosses into another head and no key needs a mask), and
    fewer than 2^31 rows."""
    if not ws_tiles(tiles, masked):
        return False
    if not INTERPRETED and capability(q.device.index)[0] != 9:
        return False
    if q.shape[-1] != head_dim_padded or q.shape[2] % tiles.block_m or k.shape[2] % tiles.block_n:
        return False
    if max(q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]) >= 2**31:
        return False
    return all(t.numel() > 0 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v))


class KernelTiles(NamedTuple):
    """One kernel's launch configuration. dK/dV kernel: block_m the query step, block_n the key tile;
    dQ kernel: block_m the query tile, block_n the key step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread at most (PTX .maxnreg); None: the compiler's


class BwdTiles(NamedTuple):
    """The two kernels' configurations, tuned apart (``python -m fa2_triton.tuning.backward``)."""

    dkdv: KernelTiles
    dq: KernelTiles


# Defaults for Hopper (H100/H200) with pointer loads, by HEAD_DIM (head_dim padded to a power of two);
# each compiles for sm_90a on Triton 3.6 and 3.9 without register spills (contiguous inputs), except
# where noted. 16-bit inputs, wgmma: the dK/dV kernel holds two fp32 [BLOCK_N, HEAD_DIM] accumulators,
# so its tiles shrink as HEAD_DIM grows. D = 256 spills a few bytes in the dK/dV kernel.
# fp32, FMA matmuls (no TF32): each thread holds whole rows of the operands, so small tiles from D = 64.
_BWD_UNTUNED = {
    (16, "16-bit"): BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    (32, "16-bit"): BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    (64, "16-bit"): BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    (128, "16-bit"): BwdTiles(KernelTiles(32, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    (256, "16-bit"): BwdTiles(KernelTiles(16, 64, 8, 2), KernelTiles(64, 32, 8, 2)),
    (16, "fp32"): BwdTiles(KernelTiles(32, 32, 4, 2), KernelTiles(32, 32, 4, 2)),
    (32, "fp32"): BwdTiles(KernelTiles(32, 32, 4, 2), KernelTiles(32, 32, 4, 2)),
    (64, "fp32"): BwdTiles(KernelTiles(16, 32, 8, 2), KernelTiles(32, 32, 8, 2)),
    (128, "fp32"): BwdTiles(KernelTiles(16, 32, 8, 2), KernelTiles(32, 32, 8, 2)),
    (256, "fp32"): BwdTiles(KernelTiles(16, 32, 8, 2), KernelTiles(16, 32, 8, 2)),
}
# (HEAD_DIM, dtype class, causal) -> ((largest seqlen_k, BwdTiles), ..., (None, BwdTiles)): the first entry
# whose bound holds seqlen_k wins, as TILES. `python -m fa2_triton.tuning.backward` on a GPU times
# each kernel's candidates on the benchmark's shapes and prints these entries, tuned, ready to replace
# the ones below.
BWD_TILES: dict[tuple[int, str, bool], tuple[tuple[int | None, BwdTiles], ...]] = {
    **{(d, c, causal): ((None, t),) for (d, c), t in _BWD_UNTUNED.items() for causal in (False, True)},
    # Tuned on the H200 (python -m fa2_triton.tuning.backward --budget-s 110, bf16, N = 1k / 4k / 16k; its CSV
    # is docs/benchmarks/h200-tune-bwd.csv): the winner per bucket, seqlen_k <= bound.
    (64, "16-bit", False): (
        (2048, BwdTiles(KernelTiles(32, 64, 4, 3), KernelTiles(64, 64, 4, 3))),
        (8192, BwdTiles(KernelTiles(32, 128, 8, 4), KernelTiles(64, 64, 4, 3))),
        (None, BwdTiles(KernelTiles(32, 128, 8, 3), KernelTiles(64, 64, 4, 3))),
    ),
    (64, "16-bit", True): (
        (2048, BwdTiles(KernelTiles(32, 64, 4, 4), KernelTiles(128, 64, 8, 3))),
        (8192, BwdTiles(KernelTiles(64, 128, 4, 3), KernelTiles(128, 64, 8, 4))),
        (None, BwdTiles(KernelTiles(64, 128, 4, 3), KernelTiles(128, 64, 4, 3))),
    ),
    (128, "16-bit", False): (
        (2048, BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3))),
        (8192, BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 4))),
        (None, BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3))),
    ),
    (128, "16-bit", True): (
        (2048, BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(64, 64, 4, 2))),
        (None, BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 4))),
    ),
}
# Packed batches (VARLEN), the dK/dV kernel at HEAD_DIM = 64, 16-bit: (HEAD_DIM, dtype class, causal) ->
# ((largest max_seqlen_k, KernelTiles), ...), the first bound that holds wins; past the last, BWD_TILES'
# bucket. Each sequence's offsets and lengths are loaded from memory, so the lengths and everything derived
# from them (the loops' bounds, the masks' diagonals) sit in per-thread registers where a dense batch's
# are kernel arguments: offline (sm_90a, Triton 3.6) the (32, 64, 4 warps) kernel takes 177 registers full
# and 233 causal against 158 / 168 dense, two blocks an SM instead of three. Capped at 168 (no spills full,
# 24 B causal; GQA, softcap and the atomic dQ spill 24-112 B): on the H200 (.whl/scripts/varlen_ctrl.py,
# bf16, 8 sequences of 2048, the dK/dV kernel alone) full 294 -> 378 TFLOP/s (dense: 451), causal
# 247 -> 324 (348). The 8-warp tiles of the longer buckets lose as much (276 against dense 446, one block
# an SM either way; not explained yet), so the full kernel keeps the capped 4-warp tiles at every length.
BWD_DKDV_VARLEN: dict[tuple[int, str, bool], tuple[tuple[int | None, KernelTiles], ...]] = {
    (64, "16-bit", False): ((None, KernelTiles(32, 64, 4, 3, 168)),),
    (64, "16-bit", True): ((2048, KernelTiles(32, 64, 4, 4, 168)),),
}
# A padded head_dim (16-bit, not a multiple of 16: loads masked along it and not vectorised) needs more
# registers for the same tiles: smaller ones, by HEAD_DIM. They still spill a few hundred bytes from
# HEAD_DIM = 128 (as the forward does). Not tuned: no benchmark shape has one.
BWD_TILES_16BIT_PADDED = {
    16: BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    32: BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3)),
    64: BwdTiles(KernelTiles(32, 128, 8, 3), KernelTiles(128, 32, 8, 3)),
    128: BwdTiles(KernelTiles(32, 64, 8, 3), KernelTiles(128, 32, 8, 3)),
    256: BwdTiles(KernelTiles(16, 32, 8, 2), KernelTiles(64, 16, 8, 2)),
}
# The preprocess kernel reads O and dO once: 4096 elements of each per program, 8 warps.
PREPROCESS_ELEMENTS = 4096


def bwd_tiles_for(
    head_dim: int, dtype: torch.dtype, masked: bool = False, seqlen_k: int | None = None, varlen: bool = False
) -> BwdTiles:
    """The launch configuration for a head_dim (unpadded), an input dtype, whether a window masks some keys
    (``AttentionSpec.masked``: causal's entries serve every window), seqlen_k (None: the largest bucket;
    a packed batch's max_seqlen_k) and whether the batch is packed (``BWD_DKDV_VARLEN``'s dK/dV tiles where
    it has them). The interpreter gets the same tiles as the GPU (it ignores num_warps, num_stages and
    maxnreg), so CPU tests cover the GPU's tiling."""
    HEAD_DIM = padded_head_dim(head_dim)
    dtype_class = DTYPE_CLASS[dtype]
    if dtype_class == "16-bit" and head_dim % 16:
        return BWD_TILES_16BIT_PADDED[HEAD_DIM]
    tiles = _bucket(BWD_TILES[HEAD_DIM, dtype_class, masked], seqlen_k)
    if tiles is None:
        raise AssertionError(f"BWD_TILES[{HEAD_DIM}, {dtype_class}, {masked}] lacks its last (None) entry")
    dkdv = _bucket(BWD_DKDV_VARLEN.get((HEAD_DIM, dtype_class, masked), ()), seqlen_k) if varlen else None
    return tiles if dkdv is None else tiles._replace(dkdv=dkdv)


def _bucket(entries, seqlen_k: int | None):
    """The first entry whose bound holds seqlen_k (a bound of None holds any), or None."""
    for bound, tiles in entries:
        if bound is None or (seqlen_k is not None and seqlen_k <= bound):
            return tiles
    return None
