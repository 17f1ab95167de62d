"""FlashAttention-2's forward on Hopper's warpgroup MMA: fp16 and bf16, ``wgmma.mma_async`` from numba-cuda.

The algorithm of ``fa2_numba_cuda.forward_tc`` (FA2, Algorithm 1: running max ``m_i``, running sum ``l_i``,
unnormalised ``acc``, rescaled by ``alpha`` per key tile; scores in base 2; O and L written once), with both
matrix products as wgmma (``wgmma.py`` has the instructions, the shared-memory layout and the register
layouts), as FlashAttention-3 computes them, without its warp specialisation (every warp loads and computes):

- A block of two warpgroups (256 threads) owns BLOCK_M = 128 query rows of one (batch, head); warpgroup wg owns
  rows 64 wg .. 64 wg + 63 and never exchanges data with the other. Q is copied once into shared memory, one
  64 x HEAD_DIM tile per warpgroup in the 128 B swizzled layout (``wgmma.swizzle128_offset``), and stays there.
- K and V tiles of BLOCK_N keys, HEAD_DIM columns, in the same layout, two stages: the copy of key tile i + 1
  (``cp.async`` by all 256 threads, 16 B each, zero-filled past seqlen_k) runs during the products of tile i.
  Per key tile one barrier: each thread's copies of the tile have landed (``cp.async.wait_all``) and are made
  visible to wgmma's async proxy (``fence.proxy.async``), then ``syncthreads``, after which both warpgroups
  have also finished the previous tile (their wgmma waited), so its stage takes the next copy. With STAGES
  (``WgmmaConfig``) stages, tile i + STAGES - 1's copy is issued during tile i and the wait leaves the STAGES - 2
  newest tiles' copies in flight (``cp.async.wait_group``).
- S = Q Kᵀ: HEAD_DIM / 16 wgmma m64nBLOCK_Nk16, A = Q and B = K both K-major from their descriptors, into
  BLOCK_N / 2 fp32 registers ``s``; commit, wait. Register 4 j + e of thread 4 g + t of warp w is row 16 w +
  g + 8 (e // 2) of the warpgroup's 64, key 8 j + 2 t + e % 2 of the tile: forward_tc's layout, so the row
  max and sum go over the lane's keys then its quad (two ``shfl_xor``).
- Online softmax in fp32 on a local copy ``p`` of s (registers, the loops unrolled): the mask on the tiles that
  need it (the end of the keys, the causal diagonal), the row max, ``p = exp2(s · qk_scale - m)`` (qk_scale =
  scale · log2 e > 0: one FFMA and one ex2.approx), ``l_i`` the lane's partial sum, added over the quad once,
  after the last tile; ``acc`` rescaled by alpha (``wgmma.scale_rows``).
- O += P V: P rounded to 16 bits in pairs is, 8 registers at a time, the A fragment of 16 keys
  (``wgmma.wgmma_a_layout``): BLOCK_N / 16 wgmma m64nHEAD_DIMk16 with A from registers and B = V MN-major
  (stored keys x head dims); commit, wait. ``acc``: HEAD_DIM / 2 fp32 registers.
- S_AHEAD (``WgmmaConfig``): S of key tile i + 1 is issued before the softmax of tile i and waited for with P V
  of tile i, so that each warpgroup's tensor cores run during its softmax (forward_tc's S_AHEAD, with the
  hardware's asynchrony instead of interleaved instructions). K and V then take their stages a tile apart.
- Causal, bottom-right aligned (key j visible to query i iff j <= i + seqlen_k - seqlen_q): a block stops at the
  last key tile its last row sees; a warpgroup masks only the tiles that cross its rows' diagonal or the end
  of the keys. Blocks are launched longest first. Rows that see no key get O = 0 and L = +inf.

Grouped-query attention as ``forward_tc``: query head h reads key/value head h // group in place.

Softcap, ALiBi, windows, packed batches and sinks as ``forward_tc`` applies them, compile-time switches of their
own (LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN of ``common.Features``, and SINK; window sizes, softcap, slopes, offsets
and sinks runtime arguments after the dense ones, so that the dense and causal builds keep their parameters and,
offline, their SASS):

- Softcap and ALiBi: ``softmax`` first makes the final scores in base 2 (x = s · qk_scale, with a softcap c x = c ·
  log2 e · tanh.approx(s · scale / c), then x -= slope · log2 e · |i + diag - j|, one FMA, the distance from one
  conversion a tile); the row max is taken of them (after the bias), and the exponentials take x with scale 1.
  With a softcap alone it keeps tanh(s · scale / c) (bounded), its max and the exponentials' FFMA scaled by c ·
  log2 e.
- Windows (left, right), bottom-right aligned (key j visible to query i iff i + diag - left <= j <= i + diag +
  right): causal stays the build of its own (its bound the constant 0). A block visits only the key tiles from
  its first row's left edge (rounded down to a tile) to its last row's right edge; a warpgroup masks the right
  edge (and the end of the keys) on the tiles that cross it for some of its rows, the left edge on those that
  hold a key left of its last row's, each with per-row bounds as causal's. Both warpgroups compute every tile
  of the block (a tile one warpgroup does not see is wholly masked for it). Blocks with a right bound are
  launched longest first.
- Packed batches (``spec.varlen``): q (1, heads, total_q, head_dim), k, v (1, heads_k, total_k, head_dim), O
  and L in q's layout; one launch over (query tile of max_seqlen_q, sequence·head), block major with the last
  query tiles first (every sequence's tile i before any tile i - 1: the longest blocks first across sequences
  without their lengths on the host); a block reads its sequence's offsets (``common.sequence``), exits before
  any copy or barrier where its tile starts past the sequence's end, and otherwise runs on the sequence's rows
  with its own lengths (copies from its first row, zero-filled past its end; its window, ALiBi's slopes[s, h],
  rows that see no key).
- Sinks (``spec.sink``): in the epilogue, sink[h] · log2 e joins each row's m and l (``common.with_sink``):
  O = acc · alpha / l, L = m + log l; a row that sees no key gets O = 0 and L = sink[h].

Shared memory (dynamic, above 48 KB: ``launch.prepare`` raises the kernel's limit): Q 2 · 64 · HEAD_DIM, K and
V STAGES (2 by default) · 2 · BLOCK_N · HEAD_DIM, 16-bit elements, plus 1 KB to align the tiles on the swizzle's 1024 B
repeat (``shared_bytes``): with BLOCK_N 64, 99,328 B at HEAD_DIM 128 and 50,176 B at 64. Registers per thread:
s (BLOCK_N / 2), P (BLOCK_N / 4, live until P V's wait), acc (HEAD_DIM / 2); ``wgmma_config`` has ptxas's counts.

Limits (``takes``): fp16 and bf16, head_dim exactly 64 or 128, (batch, heads, seqlen, head_dim) inputs (dense
or packed) contiguous along head_dim with 16 B aligned rows (cp.async), no KV cache, scale >= 0 (the max of raw
scores is the max of scaled ones). Which kernel runs: ``fa2_numba_cuda.forward.flash_attn_forward`` runs this
one where ``uses_wgmma`` holds: ``takes``, a CUDA device of compute capability 9.0 (wgmma is sm_90a's), the
switch ``ENABLED`` (on, unless the environment variable FA2_NUMBA_WGMMA=0 when this module is imported), and
for an input with a softcap, ALiBi, a window other than causal, a packed batch or a sink the switch
``FEATURES`` naming each: all of "softcap", "alibi", "window", "varlen" and "sink", unless
FA2_NUMBA_WGMMA_FEATURES names fewer (comma-separated, or "none") at import (a caller may also set ``FEATURES``
at run time); ``forward_tc`` otherwise.
An error in this kernel is raised, never answered by another. Under numba's simulator it runs only when called
directly, on ``wgmma.py``'s emulation of the instructions: slow, for tests.

Launch: on torch's current CUDA stream, no host synchronisation; one compiled kernel per (HEAD_DIM,
WgmmaConfig, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, bf16 or fp16), cached; ``kernel_resources``
reports registers, shared and local memory of each. Launched through ``launch.prepare`` as ``forward_tc``
(``_PREPARED``; with ALiBi the slopes, for a packed batch its offsets, with a sink the sinks are varying tensors
of the class, as q, k, v).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, float32, int16, int32, uint32, uint64

from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_numba_cuda import launch, wgmma
from fa2_numba_cuda.common import (
    LN2,
    LOG2E,
    SHARED_ALIGN,
    check_device,
    feature_args,
    feature_columns,
    features,
    grid_extent,
    jit_kernel,
    named_features,
    offset_args,
    rows_16b_aligned,
    sequence,
    simulated,
    sink_arg,
    sink_positions,
    sink_tensors,
    spec_class,
    spec_features,
    spec_positions,
    spec_tensors,
    with_sink,
)
from fa2_numba_cuda.mma import (
    cp_async_commit,
    cp_async_wait_all,
    cp_async_wait_group,
    device_function,
    exp2_approx,
    global_address,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    shfl_xor,
    tanh_approx,
    unrolled,
)
from fa2_numba_cuda.tensor_cores import capability

# Whether fa2_numba_cuda.forward runs this kernel where it can (``uses_wgmma``): on unless FA2_NUMBA_WGMMA=0 at
# import (measured on the H200: 1.16-1.41x forward_tc's speed at every point timed, docs/notes/numba-wgmma.md).
ENABLED = os.environ.get("FA2_NUMBA_WGMMA", "1") != "0"
# The features ("softcap", "alibi", "window": any window but causal, "varlen": packed batches, "sink") whose inputs
# ``uses_wgmma`` sends to this kernel: all, unless FA2_NUMBA_WGMMA_FEATURES names fewer at import (comma-separated,
# or "none"); the others stay on forward_tc. On the H200 it ran 1.11-1.75x forward_tc's speed on every feature input
# timed, O and L bit-identical (docs/notes/numba-wgmma.md). Set it at run time to compare.
FEATURES = named_features("FA2_NUMBA_WGMMA_FEATURES")

HEAD_DIMS = (64, 128)
COMPUTE_CAPABILITY = (9, 0)
BLOCK_M = 128  # two warpgroups of 64 rows
NUM_THREADS = 2 * wgmma.WARPGROUP_SIZE
MAX_SHARED_BYTES = 227 * 1024  # a block's dynamic shared memory on compute capability 9.0


class WgmmaConfig(NamedTuple):
    """The key tile: BLOCK_N keys (a multiple of 16, at most 256: wgmma's N). S_AHEAD: each warpgroup issues S =
    Q Kᵀ of the next key tile before the softmax of this one, so that its tensor cores work during the softmax (as
    forward_tc's S_AHEAD; S's registers twice, K and V loaded a tile apart).

    For short key loops (N = 2k: at most 2k / BLOCK_N tiles a block), where one block an SM leaves the load of
    the first tiles, the softmax and the epilogue unhidden:

    - MAX_REGISTERS caps ptxas (numba's ``max_registers``; None: no cap, 163-167 at HEAD_DIM 128). At 128, two
      blocks of 256 threads fit an SM's 65,536 registers, and at HEAD_DIM 128 two blocks' 99,328 B of shared
      memory its 228 KB, so that one block's softmax runs while the other's wgmma do. Results do not change.
      Offline (NVVM and ptxas of CUDA 13, sm_90a) the cap spills 76-88 B a thread at HEAD_DIM 128, some of it
      in the key loop's copy addresses; HEAD_DIM 64 is at 125 registers uncapped already.
    - STAGES: K/V tiles in the shared-memory ring (2 or more; S_AHEAD takes only 2): the copy of key tile i +
      STAGES - 1 is issued during tile i, so that STAGES - 1 tiles' copies are in flight while a block computes
      (``cp.async.wait_group`` STAGES - 2 at a tile's barrier; still one barrier a tile). Each stage adds 2 ·
      BLOCK_N · HEAD_DIM · 2 B of shared memory (``shared_bytes``, at most 227 KB: 132,096 B at HEAD_DIM 128
      with 3, one block an SM whatever MAX_REGISTERS).
    - OVERLAP_PV (STAGES >= 3, not S_AHEAD): FlashAttention-3's intra-warpgroup overlap. P V of tile i - 1 is
      issued after S = Q Kᵀ of tile i, so that the wait for S leaves it running on the tensor cores during the
      softmax of tile i; it is waited for before acc is rescaled. P's packed registers of tile i - 1 stay live
      through the softmax (BLOCK_N / 4 more), and V of tile i - 1 is read until then, so a tile's copies go
      STAGES - 2 tiles ahead (the stage of tile i - 2)."""

    BLOCK_N: int
    S_AHEAD: bool = False
    MAX_REGISTERS: int | None = None
    STAGES: int = 2
    OVERLAP_PV: bool = False


def wgmma_config(HEAD_DIM: int) -> WgmmaConfig:
    """At HEAD_DIM 64, 96-key tiles capped at 128 registers: the tuner's choice (``python -m
    fa2_numba_cuda.tuning.forward``, run at b113bb1 on an H100, bf16, 16k tokens, hidden 2048, 3 alternating rounds of
    the benchmark's clock; docs/benchmarks/h100-tune-numba-fwd.csv), 1.024-1.121x the speed of 64 uncapped keys
    (geomean 1.063) and 1.17-1.29x SDPA's FA2 over N = 2k, 4k, 16k, full and causal (uncapped, 96 keys ran 1.04-1.08x
    full but 0.83-0.86x causal; 128 keys 0.86-0.91x uncapped, 1.00-1.12x capped with 80-104 B spilled). At
    HEAD_DIM 128 the same run kept 64 keys capped at 128 (96 and 128 keys: 0.92-1.06x uncapped, 0.22-0.61x
    capped, spilling 360-768 B).

    Before that: 64-key tiles without S_AHEAD at both head dims, the fastest of the three tile configurations timed
    on the H200 (bf16, ``triton.testing.do_bench``; ms at (4, 16, 4096, 128), (1, 16, 16384, 128), (8, 16, 2048,
    128) and (4, 32, 4096, 64), full / causal; docs/notes/numba-wgmma.md):

        BLOCK_N  S_AHEAD  D128 4k            D128 16k           D128 2k            D64 4k
        64       no       1.486 / 0.888      5.483 / 2.817      0.834 / 0.547      1.541 / 0.871
        64       yes      1.627 / 0.957      6.052 / 3.042      0.902 / 0.584      2.326 / 1.373
        128      no       4.674 / 2.590      18.098 / 9.079     2.406 / 1.433      8.354 / 4.450

    The GPU's build (numba's NVVM, then ptxas): 64 keys, 163-167 registers at HEAD_DIM 128, 125 at 64 (16 B of
    local memory there), none spilled, 99,328 and 50,176 B of dynamic shared memory; with S_AHEAD 212-214 and
    159; 128-key tiles kept the softmax's p in 256-272 B of local memory (its loops over S's 64 registers were
    not unrolled), which was their slowness; since the builder writes those loops out (``mma.unrolled``) they
    build without local memory (164-166 registers at 64, 225 uncapped at 128), not yet timed; 96-key tiles
    (offline, causal) 149 registers at 64 and 195 at 128 uncapped, none spilled, and capped at 128 at HEAD_DIM 64
    (two blocks an SM) none full and 16 B causal, where 128 keys spill 80-104 B.

    At HEAD_DIM 128 the registers are capped at 128 (MAX_REGISTERS), so that two blocks share an SM: ptxas then
    spills 80 B a thread (19-21 STL, 24-28 LDL in the SASS), and yet each HEAD_DIM 128 point ran 1.05-1.23x faster
    than uncapped in a second H200 run (``.whl`` probe ``probe_wgcfg.py``, the same timing; ms, full / causal, against
    SDPA's FA2, then uncapped, capped, three stages, and OVERLAP_PV with three and four stages):

        point             FA2            uncapped       capped at 128  STAGES 3       OVERLAP_PV 3 / 4
        D128 2k  (8, 16)  0.792 / 0.486  0.823 / 0.544  0.671 / 0.443  0.869 / 0.562  0.857 / 0.560, 0.861 / 0.553
        D128 4k  (4, 16)  1.588 / 0.898  1.478 / 0.890  1.283 / 0.768  1.581 / 0.931  1.540 / 0.923, 1.539 / 0.907
        D128 16k (1, 16)  6.294 / 3.413  5.372 / 2.809  4.866 / 2.681  5.875 / 2.960  5.654 / 2.931, 5.670 / 2.865
        D64 4k   (4, 32)  1.804 / 0.984  1.495 / 0.867  1.478 / 0.863  1.550 / 0.903  1.563 / 0.916, 1.548 / 0.890

    HEAD_DIM 64 builds to 125 registers uncapped (two blocks an SM already) and kept no cap then."""
    if HEAD_DIM == 64:
        return WgmmaConfig(96, MAX_REGISTERS=128)
    return WgmmaConfig(64, MAX_REGISTERS=128)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> str | None:
    """Why this kernel cannot take these inputs, or None where it can."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"takes fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"takes (batch, heads, seqlen, head_dim) inputs, got q {tuple(q.shape)}"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"takes head_dim {' or '.join(map(str, HEAD_DIMS))} for q, k and v, got {q.shape[-1]}, {v.shape[-1]}"
    if spec.cache_seqlens is not None or spec.block_table is not None:
        return "takes no KV cache"
    if spec.scale < 0:
        return f"takes scale >= 0, got {spec.scale}"
    if not all(rows_16b_aligned(t) for t in (q, k, v)):
        return "takes q, k, v contiguous along head_dim with 16 B aligned rows (cp.async)"
    return None


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether this kernel computes attention for these inputs (``refusal`` says why not)."""
    return refusal(q, k, v, spec) is None


def features_on(spec: AttentionSpec) -> bool:
    """Whether ``FEATURES`` lets ``uses_wgmma`` take the spec's features: a softcap only where it names
    "softcap", ALiBi only where it names "alibi", a window other than none and causal only where it names
    "window", a packed batch only where it names "varlen", a sink only where it names "sink" (a dense spec, causal
    or not, with none of them: True)."""
    return spec_features(spec) <= FEATURES


def uses_wgmma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether ``fa2_numba_cuda.forward.flash_attn_forward`` runs this kernel: ``ENABLED``, numba not
    simulating, q on a CUDA device of compute capability 9.0, ``features_on``, and ``takes``."""
    return (
        ENABLED
        and not simulated()
        and q.device.type == "cuda"
        and capability(q.device) == COMPUTE_CAPABILITY
        and features_on(spec)
        and takes(q, k, v, spec)
    )


def shared_bytes(HEAD_DIM: int, config: WgmmaConfig) -> int:
    """The block's dynamic shared memory: Q's two 64-row tiles, STAGES stages of K and V, 1 KB of alignment."""
    q_bytes = 2 * wgmma.swizzle128_tile_bytes(64, HEAD_DIM)
    kv_bytes = config.STAGES * 2 * wgmma.swizzle128_tile_bytes(config.BLOCK_N, HEAD_DIM)
    return q_bytes + kv_bytes + wgmma.SWIZZLE_ATOM_BYTES


def _build_kernel(HEAD_DIM, config, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16):
    """The kernel for one head dim, key tile, causal or not, the features (compile-time: a window's LEFT and RIGHT
    bounds other than causal's, SOFTCAP, ALIBI, VARLEN, SINK) and input type. CAUSAL is the window (-1, 0) with
    neither LEFT nor RIGHT, its bound a constant."""
    BLOCK_N, S_AHEAD, STAGES, OVERLAP_PV = config.BLOCK_N, config.S_AHEAD, config.STAGES, config.OVERLAP_PV
    assert BLOCK_N % 16 == 0 and 16 <= BLOCK_N <= 256 and HEAD_DIM in HEAD_DIMS
    assert STAGES >= 2 and (STAGES == 2 or not S_AHEAD) and (not OVERLAP_PV or (STAGES >= 3 and not S_AHEAD))
    S_REGS = BLOCK_N // 2  # s: the warpgroup's 64 x BLOCK_N scores
    N_TILES = BLOCK_N // 8  # 8-key column blocks of s, 4 registers each
    O_REGS = HEAD_DIM // 2  # acc: its 64 x HEAD_DIM output
    D_STEPS = HEAD_DIM // 16  # k steps of S = Q Kᵀ
    N_STEPS = BLOCK_N // 16  # k steps of O += P V
    # NVVM unrolls the loops over s's registers itself up to 64 keys; past that the builder writes them out
    # (``unrolled``), else p and P's fragments live in local memory (256-272 B a thread at 128 keys).
    UNROLL = BLOCK_N > 64
    Q_TILE = wgmma.swizzle128_tile_bytes(64, HEAD_DIM)  # one warpgroup's Q
    KV_TILE = wgmma.swizzle128_tile_bytes(BLOCK_N, HEAD_DIM)
    STAGE = 2 * KV_TILE  # K then V
    AHEAD = STAGES - 2 if OVERLAP_PV else STAGES - 1  # how many tiles ahead a tile issues copies
    IN_FLIGHT = AHEAD - 1  # groups of copies a tile's wait leaves in flight (a constant of the instruction)
    ss = wgmma.wgmma_bf16 if IS_BF16 else wgmma.wgmma_f16
    rs = wgmma.wgmma_bf16_rs if IS_BF16 else wgmma.wgmma_f16_rs
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    # What softmax turns s into before the mask and the max, as forward_tc's row_max: with ALiBi the final scores
    # in base 2 (the exponentials' scale 1); with a softcap alone tanh(s · qk_scale), scaled by c · log2 e in the
    # exponentials' FFMA; else the raw scores, scaled by qk_scale there.
    SCALED = SOFTCAP or ALIBI

    load_q = wgmma.tile_loader(BLOCK_M, 64, HEAD_DIM, NUM_THREADS)
    load_kv = wgmma.tile_loader(BLOCK_N, BLOCK_N, HEAD_DIM, NUM_THREADS)

    written_out = functools.partial(device_function, unroll=UNROLL)

    @written_out
    def softmax(
        s,
        p,
        m_i,
        l_i,
        alpha,
        start_n,
        seqlen_k,
        wg_row,
        diag,
        lane_diag,
        t,
        qk_scale,
        exp_scale,
        window_left,
        window_right,
        softcap_log2,
        slope,
    ):
        """The online softmax of the tile's scores s (S's registers, a tuple) into p [BLOCK_N / 8, 4] (local,
        float32; p[j, e] is register 4 j + e: forward_tc's s[BUF] layout, its loops): with a softcap or ALiBi the
        scores as forward_tc's row_max makes them (SCALED), the mask (on a tile that crosses the right edge for
        some row of the warpgroup, rows wg_row .. wg_row + 63: keys past seqlen_k, and past the right edge of the
        lane's row h, its diagonal lane_diag + 8 h counted from the lane's first key column 2 t, plus
        window_right; on a tile that holds a key left of the warpgroup's last row's left edge, keys before the
        lane's row's), the new row max m_i, alpha (acc's rescale) and p = exp2(x · exp_scale - m), l_i = alpha l_i
        + the lane's sum of p. Element (j, e) is key
        start_n + 2 t + 8 j + e % 2 of row h = e // 2: ALiBi's distance lane_diag - start_n + 8 h - 8 j - e % 2."""
        for j in range(N_TILES):
            for e in range(4):
                p[j, e] = s[4 * j + e]
        if SCALED:
            if ALIBI:
                distance = float32(lane_diag - start_n)  # one conversion a tile, an add and an FMA a score
            for j in range(N_TILES):
                for e in range(4):
                    if SOFTCAP and ALIBI:  # softcap c: qk_scale = scale / c
                        x = tanh_approx(p[j, e] * qk_scale) * softcap_log2
                    elif SOFTCAP:
                        x = tanh_approx(p[j, e] * qk_scale)
                    else:
                        x = p[j, e] * qk_scale
                    if ALIBI:
                        x = cuda.fma(-slope, abs(distance + float32(8 * (e // 2) - 8 * j - e % 2)), x)
                    p[j, e] = x
        # Only the tiles that cross an edge for some row of the warpgroup are masked: the right edge (the end of
        # the keys, causal's diagonal or the window's), the left edge where the tile holds a key left of the last
        # row's.
        crosses_right = (
            start_n + BLOCK_N > seqlen_k
            or (CAUSAL and start_n + BLOCK_N - 1 > wg_row + diag)
            or (RIGHT and start_n + BLOCK_N - 1 > wg_row + diag + window_right)
        )
        if crosses_right:
            for h in range(2):  # keys from column hi of the lane's row on
                hi = seqlen_k - 2 * t - start_n
                if CAUSAL:
                    hi = min(hi, lane_diag + 8 * h + 1 - start_n)
                elif RIGHT:
                    hi = min(hi, lane_diag + 8 * h + window_right + 1 - start_n)
                for j in range(N_TILES):
                    for e in range(2 * h, 2 * h + 2):
                        if 8 * j + e % 2 >= hi:
                            p[j, e] = -math.inf
        if LEFT and start_n < wg_row + 63 + diag - window_left:
            for h in range(2):  # keys before column lo of the lane's row
                lo = lane_diag + 8 * h - window_left - start_n
                for j in range(N_TILES):
                    for e in range(2 * h, 2 * h + 2):
                        if 8 * j + e % 2 < lo:
                            p[j, e] = -math.inf
        for h in range(2):
            m_tile = p[0, 2 * h]
            for j in range(N_TILES):
                m_tile = max(m_tile, max(p[j, 2 * h], p[j, 2 * h + 1]))
            m_tile = max(m_tile, shfl_xor(m_tile, 1))
            m_tile = max(m_tile, shfl_xor(m_tile, 2))
            m_new = max(m_i[h], m_tile if ALIBI else m_tile * exp_scale)
            # A row with nothing visible yet has m_new = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
            m_safe = m_new if m_new != -math.inf else float32(0.0)
            alpha[h] = exp2_approx(m_i[h] - m_safe)
            m_i[h] = m_new
            l_part = float32(0.0)
            for j in range(N_TILES):
                for e in range(2 * h, 2 * h + 2):
                    x = exp2_approx(p[j, e] * exp_scale - m_safe)
                    p[j, e] = x
                    l_part += x
            l_i[h] = alpha[h] * l_i[h] + l_part

    @written_out
    def pack_p(p, p_regs):
        """P's A registers p_regs [BLOCK_N / 16, 4] (int32, local): for keys 16 kk .. 16 kk + 15, S's registers 8
        kk .. 8 kk + 7 (two 8-key tiles of p) rounded to 16 bits in pairs."""
        for kk in range(N_STEPS):
            p_regs[kk, 0] = pack(p[2 * kk, 0], p[2 * kk, 1])
            p_regs[kk, 1] = pack(p[2 * kk, 2], p[2 * kk, 3])
            p_regs[kk, 2] = pack(p[2 * kk + 1, 0], p[2 * kk + 1, 1])
            p_regs[kk, 3] = pack(p[2 * kk + 1, 2], p[2 * kk + 1, 3])

    # side-by-side: ladder-wgmma
    @device_function
    def issue_qk(q_tile, k_tile):
        """S = Q Kᵀ of the warpgroup's Q and the K tile at k_tile: fenced, issued, committed, not waited for (S's
        registers are in flight until a wgmma_wait and wgmma_fence_operand)."""
        s = wgmma.zero_accumulators(S_REGS)
        wgmma.wgmma_fence()
        for kk in range(D_STEPS):
            s = ss(
                s,
                wgmma.descriptor_k_major(q_tile, 64, 16 * kk),
                wgmma.descriptor_k_major(k_tile, BLOCK_N, 16 * kk),
                kk,
                0,
            )
        wgmma.wgmma_commit()
        return s

    @device_function
    def issue_pv(acc, p_regs, v_tile):
        """acc += P V for the V tile at v_tile, P from p_regs: fenced (acc and P were written by this thread),
        issued, committed, not waited for."""
        wgmma.wgmma_fence()
        for kk in range(N_STEPS):
            p_kk = (p_regs[kk, 0], p_regs[kk, 1], p_regs[kk, 2], p_regs[kk, 3])
            acc = rs(acc, p_kk, wgmma.descriptor_mn_major(v_tile, BLOCK_N, 16 * kk), 1, 1)
        wgmma.wgmma_commit()
        # side-by-side: end
        return acc

    def _attn_fwd_wgmma(
        q,
        k,
        v,
        o,
        lse,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        qk_scale,
        num_m_tiles,
        window_left,
        window_right,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        cu_seqlens_q,
        cu_seqlens_k,
        sink,
    ):
        """One block: BLOCK_M query rows of one (batch, head). q, k, v: flat int16 views (fp16 or bf16 bit
        patterns) of (B, H, N, HEAD_DIM) tensors with unit stride along head dims, k and v with H // group
        heads; o: (B, H, seqlen_q, HEAD_DIM), flat, contiguous, int32 pairs; lse: (B, H, seqlen_q) fp32,
        flat. qk_scale: scale · log2 e, or with a softcap c, scale / c. The window, softcap and slopes arguments
        as ``common.feature_args`` gives them, read only where the kernel's switches say so. VARLEN: B = 1, N the
        packed totals, block i the query tile num_m_tiles - 1 - i // (sequences · H) of (sequence, head) i %
        (sequences · H), its rows from cu_seqlens_q and cu_seqlens_k (``common.offset_args``). sink: (H,) fp32,
        natural log, read with SINK only (``common.sink_arg``)."""
        # Key j is visible to query i iff i + diag - window_left <= j <= i + diag + window_right (causal: 0, no
        # left bound).
        diag = seqlen_k - seqlen_q
        if VARLEN:
            # Block major, the last query tiles first: the longest blocks first across sequences (causal: a tile
            # sees more keys the later it is; else only the longest sequences have the last tiles).
            seq_heads = cuda.gridDim.x // num_m_tiles
            m_block = num_m_tiles - 1 - cuda.blockIdx.x // seq_heads
        else:
            m_block = cuda.blockIdx.x % num_m_tiles
            if CAUSAL or RIGHT:
                m_block = num_m_tiles - 1 - m_block  # the longest rows first
        start_m = m_block * BLOCK_M
        if VARLEN:
            off_bh = cuda.blockIdx.x % seq_heads
        else:
            off_bh = cuda.blockIdx.x // num_m_tiles
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        off_hk = off_h // group  # GQA: the group's query heads share key/value head off_hk
        if VARLEN:
            # Sequence off_b: queries q_start .. q_start + seqlen_q of the packed q (and O, L), keys k_start ..
            # k_start + seqlen_k of k and v; its own lengths stand for seqlen_q and seqlen_k from here on. A tile
            # past its end exits (the whole block, before any copy or barrier).
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            o_start = off_h * seqlen_q + q_start  # O's and L's row of the sequence's query 0
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                return
        wg = cuda.threadIdx.x // wgmma.WARPGROUP_SIZE
        thread = cuda.threadIdx.x % wgmma.WARPGROUP_SIZE
        lane = thread % 32
        t = lane % 4
        row0 = start_m + 64 * wg + 16 * (thread // 32) + lane // 4  # the thread's rows: row0 and row0 + 8
        wg_row = start_m + 64 * wg  # the warpgroup's first row

        smem = cuda.shared.array(0, int16, alignment=SHARED_ALIGN)  # the launch's dynamic size
        base = shared_address(smem)
        tiles = base + (wgmma.SWIZZLE_ATOM_BYTES - base % wgmma.SWIZZLE_ATOM_BYTES) % wgmma.SWIZZLE_ATOM_BYTES
        q_tile = tiles + uint32(wg * Q_TILE)
        kv_tiles = tiles + uint32(2 * Q_TILE)
        q_base, k_base, v_base = global_address(q), global_address(k), global_address(v)
        if VARLEN:  # the sequence's first rows
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
        else:
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh

        # The key tiles that hold a key some row of the block sees: from the first row's left edge (its tile) to
        # the last row's right edge, clipped to [0, seqlen_k); causal, up to the last row's diagonal.
        if CAUSAL:
            end_n = max(min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag), 0)
        elif RIGHT:
            end_n = max(min(seqlen_k, min(start_m + BLOCK_M, seqlen_q) + diag + window_right), 0)
        else:
            end_n = seqlen_k
        if LEFT:
            begin_n = max(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N
            n_tiles = -(-(end_n - begin_n) // BLOCK_N)
        else:
            begin_n = 0
            n_tiles = -(-end_n // BLOCK_N)
        if n_tiles > 0:  # else no copy is issued (none is left in flight at the exit)
            if VARLEN:
                q_offset = off_h * stride_qh + q_start * stride_qm
            else:
                q_offset = off_b * stride_qb + off_h * stride_qh
            load_q(tiles, q_base, q_offset, stride_qm, start_m, seqlen_q)
            # Key tiles 0 .. AHEAD - 1, one group of copies each (Q's in the first), empty past the last tile.
            for stage in range(AHEAD):
                if stage < n_tiles:
                    kv_stage = kv_tiles + uint32(stage * STAGE)
                    stage_n = begin_n + stage * BLOCK_N
                    load_kv(kv_stage, k_base, k_offset, stride_kn, stage_n, seqlen_k)
                    load_kv(kv_stage + uint32(KV_TILE), v_base, v_offset, stride_vn, stage_n, seqlen_k)
                cp_async_commit()

        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        p = cuda.local.array((N_TILES, 4), float32)  # [64 rows, BLOCK_N] as S's registers
        p_regs = cuda.local.array((N_STEPS, 4), int32)  # the same, 16-bit pairs: P V's A fragments
        for h in range(2):
            m_i[h] = -math.inf
            l_i[h] = 0.0
        acc = wgmma.zero_accumulators(O_REGS)  # [64 rows, HEAD_DIM] as D's registers
        lane_diag = row0 + diag - 2 * t
        # ALiBi's slope for this (batch or sequence, head), in base 2; with ALiBi, the exponentials take final
        # scores.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        exp_scale = float32(1.0) if ALIBI else softcap_log2 if SOFTCAP else qk_scale
        if S_AHEAD:
            # S of tile it + 1 runs on the tensor cores during tile it's softmax. K and V take their stages a
            # tile apart: at the top of iteration it, K it + 1 and V it have landed; K it + 2 goes where K it was
            # (S it was waited for in iteration it - 1), V it + 1 where V it - 1 was.
            if n_tiles > 1:
                load_kv(kv_tiles + uint32(STAGE), k_base, k_offset, stride_kn, begin_n + BLOCK_N, seqlen_k)
                cp_async_commit()
            s = wgmma.zero_accumulators(S_REGS)
            if n_tiles > 0:
                cp_async_wait_all()
                wgmma.fence_proxy_async()
                cuda.syncthreads()
                s = issue_qk(q_tile, kv_tiles)
                wgmma.wgmma_wait(0)
                s = wgmma.wgmma_fence_operand(s)
            for it in range(n_tiles):
                start_n = begin_n + it * BLOCK_N
                cp_async_wait_all()  # this thread's copies of K it + 1 and V it have landed ...
                wgmma.fence_proxy_async()  # ... visible to wgmma's async proxy ...
                cuda.syncthreads()  # ... every thread's; both warpgroups are done with K it and V it - 1
                if it + 2 < n_tiles:
                    k_free = kv_tiles + uint32(it % 2 * STAGE)
                    load_kv(k_free, k_base, k_offset, stride_kn, start_n + 2 * BLOCK_N, seqlen_k)
                    cp_async_commit()
                if it + 1 < n_tiles:
                    v_free = kv_tiles + uint32((it + 1) % 2 * STAGE + KV_TILE)
                    load_kv(v_free, v_base, v_offset, stride_vn, start_n + BLOCK_N, seqlen_k)
                    cp_async_commit()
                    s_next = issue_qk(q_tile, kv_tiles + uint32((it + 1) % 2 * STAGE))
                else:
                    s_next = s
                softmax(
                    s,
                    p,
                    m_i,
                    l_i,
                    alpha,
                    start_n,
                    seqlen_k,
                    wg_row,
                    diag,
                    lane_diag,
                    t,
                    qk_scale,
                    exp_scale,
                    window_left,
                    window_right,
                    softcap_log2,
                    slope,
                )
                acc = wgmma.scale_rows(acc, alpha[0], alpha[1])
                pack_p(p, p_regs)
                acc = issue_pv(acc, p_regs, kv_tiles + uint32(it % 2 * STAGE + KV_TILE))
                wgmma.wgmma_wait(0)
                acc = wgmma.wgmma_fence_operand(acc)
                s = wgmma.wgmma_fence_operand(s_next)
        else:
            # A ring of STAGES stages: tile it + AHEAD's copies are issued during tile it, into the stage of tile
            # it - 1 (with OVERLAP_PV, of tile it - 2: V of tile it - 1 is read during tile it). A group is committed
            # for every tile, empty past the last, so that all groups but the IN_FLIGHT newest are tiles 0 .. it.
            for it in range(n_tiles):
                start_n = begin_n + it * BLOCK_N
                k_tile = kv_tiles + uint32(it % STAGES * STAGE)
                cp_async_wait_group(IN_FLIGHT)  # this thread's copies of tile it (and Q) have landed ...
                wgmma.fence_proxy_async()  # ... visible to wgmma's async proxy ...
                cuda.syncthreads()  # ... every thread's; both warpgroups are done with the stage the next copy takes
                ahead = it + AHEAD
                if ahead < n_tiles:
                    ahead_k = kv_tiles + uint32(ahead % STAGES * STAGE)
                    ahead_n = begin_n + ahead * BLOCK_N
                    load_kv(ahead_k, k_base, k_offset, stride_kn, ahead_n, seqlen_k)
                    load_kv(ahead_k + uint32(KV_TILE), v_base, v_offset, stride_vn, ahead_n, seqlen_k)
                    cp_async_commit()
                elif IN_FLIGHT > 0:
                    cp_async_commit()
                s = issue_qk(q_tile, k_tile)
                if OVERLAP_PV:
                    # P V of tile it - 1 after S in the wgmma order: waiting for S leaves it in flight. At the first
                    # tile an empty group instead, so that every tile waits alike (waits under a branch: ptxas
                    # serializes the wgmma, C7513).
                    if it > 0:
                        acc = issue_pv(acc, p_regs, kv_tiles + uint32((it - 1) % STAGES * STAGE + KV_TILE))
                    else:
                        wgmma.wgmma_commit()
                    wgmma.wgmma_wait(1)
                else:
                    wgmma.wgmma_wait(0)
                s = wgmma.wgmma_fence_operand(s)
                softmax(
                    s,
                    p,
                    m_i,
                    l_i,
                    alpha,
                    start_n,
                    seqlen_k,
                    wg_row,
                    diag,
                    lane_diag,
                    t,
                    qk_scale,
                    exp_scale,
                    window_left,
                    window_right,
                    softcap_log2,
                    slope,
                )
                if OVERLAP_PV:
                    wgmma.wgmma_wait(0)  # P V of tile it - 1: acc and P's registers are free again
                    acc = wgmma.wgmma_fence_operand(acc)
                acc = wgmma.scale_rows(acc, alpha[0], alpha[1])
                # All of P packed before the fence, in the source: packed between the mma_async (in the loop),
                # ptxas adds a warpgroup.arrive before each (C7519).
                pack_p(p, p_regs)
                if not OVERLAP_PV:
                    acc = issue_pv(acc, p_regs, k_tile + uint32(KV_TILE))
                    wgmma.wgmma_wait(0)
                    acc = wgmma.wgmma_fence_operand(acc)
            if OVERLAP_PV and n_tiles > 0:  # P V of the last tile
                acc = issue_pv(acc, p_regs, kv_tiles + uint32((n_tiles - 1) % STAGES * STAGE + KV_TILE))
                wgmma.wgmma_wait(0)
                acc = wgmma.wgmma_fence_operand(acc)

        # Epilogue: the row sums over each quad, then O = acc / l and L = m + log(l), each once.
        if SINK:  # the head's sink, in base 2 as m_i
            sink_log2 = sink[off_h] * float32(LOG2E)
        if not VARLEN:
            o_start = off_bh * seqlen_q  # O's and L's row of query 0 of this (batch, head)
        for h in range(2):
            l_sum = l_i[h] + shfl_xor(l_i[h], 1)
            l_sum += shfl_xor(l_sum, 2)
            row = row0 + 8 * h
            if SINK:
                # The sink joins the denominator: O = acc · alpha / l, L = m + log2 l (l >= 1).
                m_i[h], l_sum, alpha_row = with_sink(m_i[h], l_sum, sink_log2)
                inv_l = alpha_row / l_sum
            else:
                # Rows that saw no key have l = 0: O = 0 and L = +inf. A NaN score makes l NaN, and O and L must
                # then be NaN, not the no-key marker: != 0, not > 0.
                inv_l = float32(1.0) / l_sum if l_sum != 0.0 else float32(0.0)
            if row < seqlen_q:
                o_row = (o_start + row) * HEAD_DIM
                for j in range(HEAD_DIM // 8):
                    col = 8 * j + 2 * t
                    o[uint64((o_row + col) // 2)] = pack(acc[4 * j + 2 * h] * inv_l, acc[4 * j + 2 * h + 1] * inv_l)
                if t == 0:
                    lse[uint64(o_start + row)] = (m_i[h] + math.log2(l_sum)) * LN2 if l_sum != 0.0 else math.inf

    return jit_kernel(unrolled(_attn_fwd_wgmma) if UNROLL else _attn_fwd_wgmma, config.MAX_REGISTERS)


# Compiled kernels by (HEAD_DIM, WgmmaConfig, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, SINK, IS_BF16).
_KERNELS: dict[tuple, object] = {}
# Prepared launches (``launch.prepare``) by class of call: q's, k's and v's shapes, strides and dtypes, the
# device, whether their data is 16 B aligned, the spec's values (``spec_class``), the config.
_PREPARED: dict[tuple, object] = {}


def _kernel(*key):
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _build_kernel(*key)
    return kernel


def _qk_scale(scale: float) -> np.float32:
    """scale · log2 e, at least the smallest normal fp32 so that it is > 0 (``forward_tc``'s qk_scale)."""
    return np.float32(max(scale * LOG2E, float(np.finfo(np.float32).tiny)))


def _score_scale(spec: AttentionSpec) -> np.float32:
    """What the kernel multiplies raw scores by: ``_qk_scale``, or with a softcap c, scale / c, the argument of
    tanh (``forward_tc._score_scale``)."""
    if spec.softcap > 0:
        return np.float32(spec.scale / spec.softcap)
    return _qk_scale(spec.scale)


def _switches(spec: AttentionSpec) -> tuple[bool, ...]:
    """The kernel's compile-time switches for the spec: CAUSAL (the window (-1, 0), its bound a constant), then
    ``common.features``' LEFT, RIGHT (any other window), SOFTCAP, ALIBI, VARLEN, and SINK."""
    left, right, softcap, alibi, varlen = features(spec)
    causal = spec.window == (UNBOUNDED, 0)
    return causal, left and not causal, right and not causal, softcap, alibi, varlen, spec.sink is not None


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    config: WgmmaConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention): query head h attends to key/value head h // (heads //
            heads_k); fp16 or bf16, head_dim 64 or 128, contiguous along head_dim with 16 B aligned rows; CUDA
            tensors on compute capability 9.0, or CPU tensors under numba's simulator (emulated wgmma, tiny
            shapes).
        spec: scale >= 0; a window (left, right) bottom-right aligned (key j visible to query i iff i + seqlen_k
            - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 unbounded; causal is (-1, 0)), softcap,
            ALiBi slopes, sink, as ``fa2_numba_cuda.forward.flash_attn_forward`` describes them::

                causal, seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                                      1 1 1 1 1

            With cu_seqlens_q and cu_seqlens_k (spec.varlen, a packed batch): q (1, heads, total_q, head_dim),
            k, v (1, heads_k, total_k, head_dim), each sequence with its own lengths (``refusal`` names what this
            kernel does not take).
        config: the key tile, for tuning; default ``wgmma_config(head_dim)``.

    Returns:
        O: (batch, heads, seqlen_q, head_dim), q's dtype. L: (batch, heads, seqlen_q), float32, natural log;
        rows that see no key get O = 0 and L = +inf (with a sink, L = sink[h]). Packed: O (1, heads, total_q,
        head_dim), L (1, heads, total_q); rows outside every sequence are not written.
    """
    key = None
    if launch.FAST:  # a call of a class met before: the kernel's parameters are packed, only pointers change
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device)
        key += (aligned, spec_class(spec), None if config is None else tuple(config))
        prepared = _PREPARED.get(key)
        if prepared is not None:
            O = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            L = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            prepared(q, k, v, O, L, *spec_tensors(spec), *sink_tensors(spec))
            return O, L
    reason = refusal(q, k, v, spec)
    if reason is not None:
        raise NotImplementedError(f"fa2-numba-cuda's wgmma kernel {reason}")
    check_device(q)
    if not simulated() and capability(q.device) != COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"fa2-numba-cuda's wgmma kernel needs compute capability 9.0 (sm_90a), got {capability(q.device)} on "
            f"{q.device}"
        )
    batch, heads, seqlen_q, head_dim = q.shape
    O = torch.empty(batch, heads, seqlen_q, head_dim, dtype=q.dtype, device=q.device)
    L = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    # Packed: one block per (query tile of the longest sequence, sequence·head); the others' extra tiles exit.
    grid_batch, grid_seqlen_q, _ = grid_extent(spec, q, k)
    num_m_tiles = -(-grid_seqlen_q // BLOCK_M)
    grid = num_m_tiles * grid_batch * heads
    if grid == 0:
        return O, L
    config = WgmmaConfig(*config) if config is not None else wgmma_config(head_dim)
    if config.BLOCK_N % 16 or not 16 <= config.BLOCK_N <= 256 or (config.BLOCK_N * head_dim // 8) % NUM_THREADS:
        raise ValueError(f"WgmmaConfig needs BLOCK_N a multiple of 16 from 16 to 256, whole copies, got {config}")
    if config.STAGES < 2 or (config.S_AHEAD and config.STAGES != 2):
        raise ValueError(f"WgmmaConfig needs STAGES >= 2, and 2 with S_AHEAD, got {config}")
    if config.OVERLAP_PV and (config.STAGES < 3 or config.S_AHEAD):
        raise ValueError(f"WgmmaConfig needs STAGES >= 3 and no S_AHEAD with OVERLAP_PV, got {config}")
    if shared_bytes(head_dim, config) > MAX_SHARED_BYTES:
        raise ValueError(
            f"WgmmaConfig {config} needs {shared_bytes(head_dim, config)} B of shared memory at head_dim {head_dim}, "
            f"over a block's {MAX_SHARED_BYTES}"
        )
    kernel = _kernel(head_dim, config, *_switches(spec), q.dtype == torch.bfloat16)
    head = (
        *(t.view(torch.int16) for t in (q, k, v)),
        O.view(torch.int32),
        L,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        heads,
        heads // k.shape[1],
        seqlen_q,
        k.shape[2],
        _score_scale(spec),
        num_m_tiles,
    )
    # The features' arguments after the dense ones (the dense and causal builds keep their parameters' offsets).
    feats = feature_args(spec, seqlen_q, k.shape[2], q.device)
    args = (*head, *feats, *offset_args(spec, q.device), sink_arg(spec, q.device))
    # What changes within a class: q, k, v, O, L and the spec's tensors.
    varying = (0, 1, 2, 3, 4, *spec_positions(spec, len(head), len(args) - 3), *sink_positions(spec, len(args) - 1))
    prepared = launch.prepare(kernel, grid, NUM_THREADS, q.device, args, varying, shared_bytes(head_dim, config))
    if prepared is not None and key is not None:
        _PREPARED[key] = prepared
    return O, L


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every wgmma kernel compiled so
    far in this process (dynamic shared memory: ``shared_bytes``); empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (HEAD_DIM, config, CAUSAL, *switches, SINK, IS_BF16), kernel in _KERNELS.items():
        regs = kernel.get_regs_per_thread()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": "wgmma",
                    "HEAD_DIM": HEAD_DIM,
                    **config._asdict(),
                    "causal": CAUSAL,
                    **feature_columns(switches),
                    "sink": SINK,
                    "bf16": IS_BF16,
                    "registers_per_thread": regs[signature],
                    "dynamic_shared_bytes_per_block": shared_bytes(HEAD_DIM, config),
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
