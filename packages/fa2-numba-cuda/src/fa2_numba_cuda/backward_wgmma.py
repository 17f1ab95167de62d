"""FlashAttention-2's backward on Hopper's warpgroup MMA: fp16 and bf16, ``wgmma.mma_async`` from numba-cuda.

The algorithm of ``fa2_numba_cuda.backward_tc`` (FA2, Algorithm 2, in its two-kernel split: delta = rowsum(dO ∘
O) by ``backward_simt.launch_preprocess``, then one kernel for dK and dV, one for dQ; every element of dq, dk, dv
written once, no atomics: deterministic), with every matrix product as wgmma (``wgmma.py`` has the instructions,
the shared-memory layout and the register layouts), in the two forms ``forward_wgmma`` already uses: A and B from
shared memory, B K-major (its S = Q Kᵀ), and A from registers, B MN-major (its P V). WgmmaBwdConfig's DQ_WGMMA
False runs ``backward_tc``'s dQ kernel instead (``backward_tc.launch_dq``).

``_attn_bwd_dkdv_wgmma``:

- A block of two warpgroups (256 threads) owns BLOCK_N = 128 keys of one (batch, key/value head); warpgroup wg owns
  keys 64 wg .. 64 wg + 63 (wgmma's M) and never exchanges data with the other. K and V are copied once into
  shared memory, one 64 x HEAD_DIM tile per warpgroup each, in the 128 B swizzled layout
  (``wgmma.swizzle128_offset``), and stay there.
- Steps over (query head of the group, query tile of BLOCK_M rows that sees a key of the block), as backward_tc's
  (GQA: dK and dV of the key/value head sum over its group's query heads in the same registers). Each step's Q and
  dO tiles (BLOCK_M x HEAD_DIM, the same layout), L · log2 e and delta of its rows (static shared memory; L = +inf
  and delta = 0 past seqlen_q) take two stages: the copies of step i + 1 (``cp.async`` by all 256 threads, 16 B
  each, zero-filled past seqlen_q) run during the products of step i. One barrier a step: each thread's copies
  have landed (``cp.async.wait_all``), are visible to wgmma's async proxy (``fence.proxy.async``), then
  ``syncthreads``, after which both warpgroups have also finished step i - 1 (their wgmma waited), so its stage
  takes the next copy.
- Per warpgroup and step, in D's register layout (register 4 j + e of thread 4 g + t of warp w: key 16 w + g + 8
  (e // 2) of the warpgroup's 64, query 8 j + 2 t + e % 2 of the tile; forward_tc's and backward_tc's)::

      Sᵀ = K Qᵀ      HEAD_DIM / 16 wgmma m64nBLOCK_Mk16, A = K, B = Q K-major, both from descriptors; commit
      dPᵀ = V dOᵀ    the same with V and dO; commit; wait for Sᵀ alone (wait_group 1): dPᵀ runs on during
      Pᵀ = exp2(Sᵀ · qk_scale - L · log2 e)    (qk_scale = scale · log2 e; masked elements 0, fp32; softcap
                     and ALiBi below)
                     then wait for dPᵀ
      dSᵀ = Pᵀ ∘ (dPᵀ - delta)    in place of Pᵀ, 16 queries at a time: Pᵀ's and dSᵀ's 16-bit pairs packed as
                     they are made, 8 registers a fragment (``wgmma.wgmma_a_layout``: D's registers 8 kk .. 8 kk
                     + 7 are the A registers of queries 16 kk .. 16 kk + 15, as forward_wgmma's P)
      dV += Pᵀ dO    BLOCK_M / 16 wgmma m64nHEAD_DIMk16, A = Pᵀ from registers, B = dO MN-major
      dK += dSᵀ Q    the same with dSᵀ and Q (Q's tile is both Sᵀ's K-major B and this MN-major one); one
                     commit for both, wait for all (the next step's copies take this stage)

  then dk = scale · dK and dv = dV are written once, rounded to the inputs' type. DV_EARLY (``WgmmaBwdConfig``)
  issues dV's products as soon as Pᵀ is packed, before dSᵀ's arithmetic, and waits for dPᵀ with wait_group 1
  (dV's products running on): more overlap, more registers live. Per thread: dK and dV HEAD_DIM / 2 registers
  each, Sᵀ (then Pᵀ, dSᵀ) and dPᵀ BLOCK_M / 2 each, Pᵀ's and dSᵀ's A fragments BLOCK_M / 4 each. K's and V's
  shared addresses go through ``wgmma.opaque_address`` each step, so that their HEAD_DIM / 8 descriptors are
  made there, not hoisted out of the loop into 2 · HEAD_DIM / 4 registers held throughout (spilled at HEAD_DIM
  128).

``_attn_bwd_dq_wgmma``: forward_wgmma's loop without its online softmax.

- A block of two warpgroups owns BLOCK_M_DQ = 128 query rows of one (batch, head); warpgroup wg owns rows 64 wg ..
  64 wg + 63, their Q and dO tiles copied once into shared memory (one 64 x HEAD_DIM tile each per warpgroup), L ·
  log2 e and delta of the thread's two rows in registers. Key tiles of DQ_BLOCK_N keys, K and V in two stages, as
  forward_wgmma's (one barrier a tile, the next tile's cp.async during this one's products). Per warpgroup and
  key tile, in D's layout (row 16 w + g + 8 (e // 2), key 8 j + 2 t + e % 2)::

      S = Q Kᵀ       HEAD_DIM / 16 wgmma m64nDQ_BLOCK_Nk16, A = Q, B = K K-major; commit
      dP = dO Vᵀ     the same with dO and V; commit; wait for S alone: dP runs on during
      P = exp2(S · qk_scale - L · log2 e)    masked where the tile crosses the end of the keys (zero-filled K rows
                     would give exp2(-L), not 0) or a window edge of the warpgroup's rows; then wait for dP
      dS = P ∘ (dP - delta)    in place of P, packed 16 keys at a time
      dQ += dS K     DQ_BLOCK_N / 16 wgmma m64nHEAD_DIMk16, A = dS from registers, B = K MN-major (forward_wgmma's
                     P V with K for V); commit, wait

  then dq = scale · dQ is written once. A block's key tiles are those its rows see: from the one holding its
  first row's left edge (LEFT) to the last its last row sees (a right edge); a warpgroup skips the tiles none of
  its rows sees, and every tile when its rows are all past seqlen_q. With a right edge blocks are launched
  longest (last) first. Registers: dQ HEAD_DIM / 2, S (then P, dS) and dP DQ_BLOCK_N / 2 each, dS's fragments
  DQ_BLOCK_N / 4; Q's and dO's addresses through ``wgmma.opaque_address``, as K's and V's above.

Both kernels:

- Scores, masks and L as backward_tc: base 2, rows with L = +inf (no key visible) and query rows past seqlen_q
  (read with L = +inf) get P = 0, so zero gradients. Windows as backward_tc's, bottom-right aligned: key j
  visible to query i iff i + diag - window_left <= j <= i + diag + window_right, diag = seqlen_k - seqlen_q,
  each side unbounded or not (``_window_flags``: CAUSAL, a right side of 0 known at compile time, causal itself
  and (left, 0); RIGHT, a right side above 0; LEFT, a left side; the sizes are runtime arguments, the kernels'
  last two, unread without LEFT and RIGHT; causal's code is the one it had before windows). In the dK/dV kernel
  keys past seqlen_k (zero-filled K and V rows) are never written back; a block's walk over the group's heads
  takes the query tiles from the one holding its first key's right edge to the one holding its last key's left
  edge; a warpgroup masks only the steps whose tile crosses a window edge of its keys and skips (no wgmma) those
  where no query of the tile sees any of its keys, or its keys are all past seqlen_k (the window's sizes go
  through ``wgmma.opaque_address`` each tile, as K's and V's addresses do, for the registers at HEAD_DIM 128).
  Its blocks are launched in key order, the longest (causal) first.
- Softcap and ALiBi (SOFTCAP, ALIBI: compile-time, from ``common.features``; softcap_log2 = c · log2 e, the slopes
  and their strides runtime arguments after the tile count, ``common.feature_args``'s, unread without them) as
  backward_tc computes them: the forward's scores in base 2, with a softcap c x = c · log2 e · tanh(S · scale / c)
  (qk_scale = scale / c, ``common.score_scale``; ``tanh_approx``), ALiBi's slope · log2 e · |i + diag - j|
  subtracted (one FMA: the distance from one value a tile and a constant per register, in each kernel's layout),
  then P = exp2(x - L · log2 e), masked as above, and dS (dSᵀ) multiplied by the cap's derivative 1 - tanh². The
  dK/dV kernel takes tanh during dPᵀ's products and makes Pᵀ from it after dPᵀ's wait, 16 queries at a time,
  so that no register holds 1 - tanh² across the wait (its dense registers are at ptxas's 255 at HEAD_DIM 128;
  hence DV_EARLY, which packs Pᵀ before that wait, takes no softcap); the dQ kernel keeps 1 - tanh² of its
  DQ_BLOCK_N / 2 scores from P to dS. The slopes (per batch and query head: the dK/dV kernel reads the slope of
  each (head, tile) of its walk, the dQ kernel one) get no gradient.
- Shared memory (dynamic, above 48 KB: ``launch.prepare`` raises the kernel's limit), 16-bit elements, plus 1 KB
  to align the tiles on the swizzle's 1024 B repeat (``shared_bytes``): dK/dV, K and V 2 · 2 · 64 · HEAD_DIM, Q
  and dO 2 stages · 2 · BLOCK_M · HEAD_DIM, and 4 · 2 · 2 · BLOCK_M B of static (L and delta); dQ, Q and dO 2 · 2 ·
  64 · HEAD_DIM, K and V 2 stages · 2 · DQ_BLOCK_N · HEAD_DIM. With 64-row tiles either takes 132,096 B at HEAD_DIM
  128 and 66,560 B at 64. ``bwd_config`` has ptxas's register counts.
- Packed (variable-length) batches (``spec.varlen``: VARLEN, compile-time) as ``backward_tc`` takes them: q, O, dO
  (1, heads, total_q, head_dim), L (1, heads, total_q), k, v (1, heads_k, total_k, head_dim). One launch per kernel,
  no host sync: the preprocess runs on the packed rows as on one sequence (delta is per row); the dK/dV grid is (key
  block of max_seqlen_k, sequence·key/value head), the dQ grid (query block of max_seqlen_q, sequence·head)
  (``common.grid_extent``), block major (every sequence's block i before any block i + 1) so that the longest blocks
  come first across sequences without their lengths on the host: the dK/dV kernel's key blocks first to last under
  causal (the first sees the most queries), else last to first (only the longest sequences have the last ones), the
  dQ kernel's query blocks last to first. Each block reads its sequence's offsets (``common.sequence``; cu_seqlens_q
  and cu_seqlens_k after the slopes' strides, before the window's sizes, ``common.offset_args``, so that the dense
  builds keep every other parameter where it was), exits before any copy or barrier where its block starts past
  the sequence's end, and otherwise runs the dense block on the sequence's rows with its own lengths: its copies
  start at the sequence's first row and are zero-filled past its end (no row of the next sequence enters a tile),
  L and delta of its rows, the window's diagonal and tile bounds, ALiBi's slopes[s, h], the keys past its end
  never written, per sequence. Keys of a sequence without queries get dk = dv = 0, rows of one without keys
  dq = 0.
- An attention sink (``spec.sink``, a logit per head in the softmax's denominator, gpt-oss): the kernels are the
  sink's as they are, since the forward's L includes it and so P = exp(S - L) is the sink's P; its gradient,
  dsink[h] = -Σ exp(sink[h] - L) · delta over the rows, is the preprocess's (``backward_simt.launch_preprocess``
  with ``dsink_parts``: a share a block), summed per head by torch in a fixed order (``sink_gradient``).

Limits (``takes``): fp16 and bf16, head_dim exactly 64 or 128, (batch, heads, seqlen, head_dim) q, k, v and dO of
one dtype (dense or packed), contiguous along head_dim with 16 B aligned rows (cp.async), any window, a sink, no
KV cache. Which kernels run: ``fa2_numba_cuda.backward.flash_attn_backward`` runs these where ``uses_wgmma``
holds: ``takes``, a CUDA device of compute capability 9.0 (wgmma is sm_90a's), the switch ``ENABLED`` (on,
unless the environment variable FA2_NUMBA_WGMMA_BWD=0 when this module is imported), and for an input with a
softcap, ALiBi, a window other than none and causal, a packed batch or a sink the switch ``FEATURES`` naming each
("softcap", "alibi", "window", "varlen", "sink": ``features_on``): all of them, unless FA2_NUMBA_WGMMA_BWD_FEATURES
names fewer (comma-separated, or "none") at import (a caller may also set ``FEATURES`` at run time); ``backward_tc``
otherwise. An error in
these kernels is raised, never answered by others.
Under numba's simulator they run only when called directly, on ``wgmma.py``'s emulation of the instructions:
slow, for tests.

Launch: on torch's current CUDA stream, no host synchronisation; one compiled kernel per (dK/dV or dQ, HEAD_DIM,
WgmmaBwdConfig, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, bf16 or fp16), cached; ``kernel_resources`` reports
registers, shared and local memory of each. Launched through ``launch.prepare`` as ``backward_tc``
(``_PREPARED``; with ALiBi the slopes, for a packed batch its offsets, are varying tensors of the class, as q, k,
v).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np
import torch
from numba import cuda, float32, int16, int32, int64, uint32, uint64

from fa2.spec import UNBOUNDED, AttentionSpec
from fa2_numba_cuda import backward_tc, launch, wgmma
from fa2_numba_cuda.backward_simt import dsink_parts, launch_preprocess, preprocess_tensors, sink_gradient
from fa2_numba_cuda.common import (
    LOG2E,
    SHARED_ALIGN,
    check_device,
    feature_args,
    grid_extent,
    named_features,
    offset_args,
    rows_16b_aligned,
    score_scale,
    sequence,
    simulated,
    spec_class,
    spec_features,
    spec_positions,
    spec_tensors,
)
from fa2_numba_cuda.mma import (
    cp_async_commit,
    cp_async_wait_all,
    device_function,
    exp2_approx,
    global_address,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    tanh_approx,
    unrolled,
)
from fa2_numba_cuda.tensor_cores import capability

# Whether fa2_numba_cuda.backward runs these kernels where they can (``uses_wgmma``): on unless
# FA2_NUMBA_WGMMA_BWD=0 at import (1.02-1.58x backward_tc's time at every point timed on the H200).
ENABLED = os.environ.get("FA2_NUMBA_WGMMA_BWD", "1") != "0"
# The features ("softcap", "alibi", "window": a window other than none and causal, "varlen": packed batches,
# "sink": an attention sink) whose inputs ``uses_wgmma`` sends to these kernels: all, unless
# FA2_NUMBA_WGMMA_BWD_FEATURES names fewer at import (comma-separated, or "none"); the others stay on backward_tc.
# On the H200 these kernels ran 1.03-1.55x backward_tc's speed on every feature input timed, with dq, dk, dv
# bit-identical (docs/notes/numba-wgmma.md). Set it at run time to compare.
FEATURES = named_features("FA2_NUMBA_WGMMA_BWD_FEATURES")

HEAD_DIMS = (64, 128)
COMPUTE_CAPABILITY = (9, 0)
BLOCK_N = 128  # the dK/dV kernel's keys: two warpgroups of 64
BLOCK_M_DQ = 128  # the dQ kernel's query rows: two warpgroups of 64
NUM_THREADS = 2 * wgmma.WARPGROUP_SIZE


class WgmmaBwdConfig(NamedTuple):
    """The dK/dV kernel's query tile: BLOCK_M rows (a multiple of 16 from 16 to 256, wgmma's N, with whole
    16 B copies: BLOCK_M · HEAD_DIM / 8 a multiple of 256). Past 64 rows the builder writes the step's loops over
    Sᵀ's registers out (``unrolled``: NVVM leaves them rolled, their arrays in local memory); built offline
    (sm_90a) at HEAD_DIM 64, 96 rows take 249-255 registers and no local memory (8-40 B with a softcap, ALiBi and a
    packed batch together), 128 rows spill 268-440 B. DV_EARLY: each warpgroup issues dV += Pᵀ dO as soon
    as Pᵀ is packed, so that it runs during dSᵀ's arithmetic (Pᵀ in fp32 and packed, dPᵀ and dSᵀ live at once);
    else dV's and dK's products are issued together after dSᵀ (fewer registers). The dQ kernel's key tile:
    DQ_BLOCK_N keys (the same bounds; past 64 its loops written out too: at HEAD_DIM 64, 96 keys take 184-194
    registers, 128 keys 216-242, no local memory); DQ_WGMMA False runs backward_tc's dQ kernel instead (with its own
    ``backward_tc.tc_bwd_config``). SPLIT_MASK: both kernels branch once per tile on whether it crosses an edge
    (a window's, the causal diagonal, the dQ kernel's end of the keys) into a masked copy of the probabilities'
    loop, else one without any mask compare (``_MASKS``); off, one loop masks each element where the tile crosses.
    The same arithmetic in the same order either way: bit-identical gradients on the simulator, and on the H200
    but with a softcap at HEAD_DIM 128, where the two builds' bits differ (within the tests' tolerance; the
    compiler's choice, not traced). A dK/dV step takes one query tile: two a step (one barrier for both) ran 2-8%
    slower at HEAD_DIM 64 on an H100 (docs/notes/numba-wgmma.md), and so did both grids ordered tile first across
    heads (as a packed batch's are: longest blocks first), 3-5% at HEAD_DIM 64 and 128 causal."""

    BLOCK_M: int
    DV_EARLY: bool = False
    DQ_BLOCK_N: int = 64
    DQ_WGMMA: bool = True
    SPLIT_MASK: bool = False


def bwd_config(HEAD_DIM: int, softcap: bool = False, masked: bool = False) -> WgmmaBwdConfig:
    """The tuner's choice (``python -m fa2_numba_cuda.tuning.backward``, run at b113bb1 on an H100, bf16, 16k
    tokens, hidden 2048, N = 2k, 4k, 16k, 3 alternating rounds of the benchmark's clock; CSV
    docs/benchmarks/h100-tune-numba-bwd.csv): the dQ kernel on wgmma with 128-key tiles at HEAD_DIM 64 (96 with a
    softcap, untimed) and 96-key tiles at 128, and 96-query dK/dV tiles at 64 where no key is masked (``masked``:
    causal or a window), 64 elsewhere. The earlier choice's time (below) and SDPA's FA2's over this one's, full /
    causal, in the same run:

        point              earlier / this choice      FA2 / this choice
        D64 2k  (8, 32)    1.079 / 1.006              1.034 / 0.960
        D64 4k  (4, 32)    1.149 / 1.050              1.036 / 0.982
        D64 16k (1, 32)    1.138 / 1.119              1.036 / 1.001
        D128 2k (8, 16)    1.016 / 1.022              1.101 / 1.060
        D128 4k (4, 16)    1.045 / 1.035              1.142 / 1.118
        D128 16k (1, 16)   1.033 / 0.991              1.159 / 1.116

    (96 query rows with a mask at HEAD_DIM 64: 0.94-1.13x the earlier choice's speed; at 128 they spill 224-504 B
    and ran 0.65-0.91x.) The earlier choice: 64-query dK/dV tiles without DV_EARLY (FlashAttention-3's dK/dV tile
    at head dim 128: 2 warpgroups x 64 keys against 64 queries); at HEAD_DIM 128 the dQ kernel on wgmma with 64-key
    tiles, at 64 backward_tc's dQ kernel. Timed on the H200 (``.whl`` probe ``probe_wgbwd.py``, bf16,
    ``triton.testing.do_bench`` ms of the whole backward, full / causal; docs/notes/numba-wgmma.md):

        point              backward_tc      default (M64)    DV_EARLY         M32              mma.sync dQ
        D128 4k  (4, 16)   6.444 / 3.556    4.287 / 2.631    4.541 / 2.745    5.010 / 3.004    5.117 / 2.875
        D128 16k (1, 16)   25.038 / 12.795  15.810 / 8.496   16.702 / 9.125   18.511 / 9.678   19.485 / 10.150
        D128 2k  (8, 16)   3.336 / 1.939    2.404 / 1.611    2.474 / 1.669    2.797 / 1.806    2.753 / 1.660
        D64 4k   (4, 32)   6.565 / 3.504    5.568 / 3.432    5.606 / 3.452    6.767 / 4.049    5.526 / 3.135

    (128-key dQ tiles, before the builder wrote their loops out: 2.7-3.6x the default's time, S in 384 B of local
    memory.) At HEAD_DIM 64 the wgmma dQ
    kernel took 2.562 / 1.602 ms against backward_tc's 2.427 / 1.288 at (4, 32, 4k). The GPU's build: dK/dV 254-255
    registers at 128 and 216-219 at 64, no local memory (DV_EARLY: 72-96 B at 128); dQ 187-199 at 128. One block
    of 256 threads an SM.

    SPLIT_MASK on, but with a softcap at HEAD_DIM 128: the whole backward on the H200 (``.whl`` probe
    ``split_probe.py``, bf16, do_bench, best of two rounds), time without / with it:

        (1, 16, 16k, 128)  causal 1.04x, full 1.02x, causal softcap 1.09x, full softcap 0.995x, causal ALiBi 1.19x,
                           windows (4096, 0) 1.15x, (1024, 0) 1.08x, (1024, 1024) 1.10x
        (4, 32, 4k, 64)    causal 0.997x, causal softcap 1.08x, causal ALiBi 1.07x,
                           windows (1024, 0) 0.999x, (1024, 1024) 0.986x

    Its builds there: dK/dV 255 registers and 8-16 B of local memory at 128 with a mask (causal ALiBi 16 B, was
    112), none at 64. Their gradients were the single loop's bit for bit, but with a softcap at 128: there the
    switch stays off until the GPU tests have checked that build against the reference."""
    split = not (softcap and HEAD_DIM == 128)
    if HEAD_DIM == 64:
        # With a softcap the 128-key dQ build spills 72 B (offline, causal); 96 keys none.
        return WgmmaBwdConfig(64 if masked else 96, DQ_BLOCK_N=96 if softcap else 128, SPLIT_MASK=split)
    return WgmmaBwdConfig(64, DQ_BLOCK_N=96, SPLIT_MASK=split)


def tc_dq_config(config: WgmmaBwdConfig, head_dim: int, device: torch.device) -> backward_tc.TensorCoreBwdConfig | None:
    """The configuration of backward_tc's dQ kernel where ``config`` runs it (without DQ_WGMMA): backward_tc's own
    tiles, the device's shared memory allowing; None where the dQ kernel is this module's."""
    if config.DQ_WGMMA:
        return None
    return backward_tc.tc_bwd_config(head_dim, backward_tc.max_shared_bytes(device))


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dO: torch.Tensor, spec: AttentionSpec) -> str | None:
    """Why these kernels cannot take these inputs, or None where they can."""
    if q.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in (k, v, dO)):
        return f"takes fp16 or bf16 q, k, v, dO of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {dO.dtype}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or dO.shape != q.shape:
        return f"takes (batch, heads, seqlen, head_dim) inputs and dO of q's shape, got q {tuple(q.shape)}"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"takes head_dim {' or '.join(map(str, HEAD_DIMS))} for q, k and v, got {q.shape[-1]}, {v.shape[-1]}"
    if spec.cache_seqlens is not None or spec.block_table is not None:
        return "takes no KV cache"
    if not all(rows_16b_aligned(t) for t in (q, k, v, dO)):
        return "takes q, k, v, dO contiguous along head_dim with 16 B aligned rows (cp.async)"
    return None


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dO: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether these kernels compute the gradients for these inputs (``refusal`` says why not)."""
    return refusal(q, k, v, dO, spec) is None


def features_on(spec: AttentionSpec) -> bool:
    """Whether ``FEATURES`` lets ``uses_wgmma`` take the spec's features: a softcap only where it names
    "softcap", ALiBi only where it names "alibi", a window other than none and causal only where it names
    "window", a packed batch only where it names "varlen", a sink only where it names "sink" (a dense spec with
    none of them: True)."""
    return spec_features(spec) <= FEATURES


def uses_wgmma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dO: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether ``fa2_numba_cuda.backward.flash_attn_backward`` runs these kernels: ``ENABLED``, numba not
    simulating, q on a CUDA device of compute capability 9.0, ``features_on``, and ``takes``."""
    return (
        ENABLED
        and not simulated()
        and q.device.type == "cuda"
        and capability(q.device) == COMPUTE_CAPABILITY
        and features_on(spec)
        and takes(q, k, v, dO, spec)
    )


def shared_bytes(name: str, HEAD_DIM: int, config: WgmmaBwdConfig) -> int:
    """The dynamic shared memory of kernel ``name`` per block: "dkdv", K's and V's two 64-row tiles and two
    stages of Q and dO; "dq", Q's and dO's two 64-row tiles and two stages of K
    and V; 1 KB of alignment."""
    if name == "dkdv":
        once = wgmma.swizzle128_tile_bytes(64, HEAD_DIM)
        staged = wgmma.swizzle128_tile_bytes(config.BLOCK_M, HEAD_DIM)
    else:
        once, staged = (
            wgmma.swizzle128_tile_bytes(64, HEAD_DIM),
            wgmma.swizzle128_tile_bytes(config.DQ_BLOCK_N, HEAD_DIM),
        )
    return 2 * 2 * once + 2 * 2 * staged + wgmma.SWIZZLE_ATOM_BYTES


def _window_flags(spec: AttentionSpec) -> tuple[bool, bool, bool]:
    """The kernels' compile-time window (CAUSAL, LEFT, RIGHT): CAUSAL, keys right of the diagonal cut off (a right
    side of 0: causal, and a left-bounded window (left, 0)); RIGHT, keys more than window_right right of it (a
    right side above 0, a runtime argument); LEFT, keys more than window_left left of it. None of them: no
    window."""
    left, right = spec.window
    return right == 0, left != UNBOUNDED, right not in (UNBOUNDED, 0)


def _issue_products(HEAD_DIM, N, IS_BF16):
    """issue(a_tile, b_tile) -> acc: A Bᵀ, A the 64 rows of a warpgroup's tile at shared address a_tile (K or V;
    Q or dO), B the N rows of the tile at b_tile (Q or dO; K or V), HEAD_DIM columns each, both K-major, into
    N / 2 fp32 registers: fenced, issued, committed, not waited for."""
    ss = wgmma.wgmma_bf16 if IS_BF16 else wgmma.wgmma_f16
    REGS = N // 2
    D_STEPS = HEAD_DIM // 16

    @device_function
    def issue(a_tile, b_tile):
        acc = wgmma.zero_accumulators(REGS)
        wgmma.wgmma_fence()
        for kk in range(D_STEPS):
            acc = ss(
                acc,
                wgmma.descriptor_k_major(a_tile, 64, 16 * kk),
                wgmma.descriptor_k_major(b_tile, N, 16 * kk),
                kk,
                0,
            )
        wgmma.wgmma_commit()
        return acc

    return issue


def _issue_update(K, IS_BF16):
    """update(acc, a_regs, b_tile) -> acc: acc += A B, A (64 rows x K) from a_regs [K / 16, 4] (``wgmma_a_layout``
    fragments), B the K rows of the tile at shared address b_tile, MN-major (dO or Q; K): fenced (acc and A were
    written by this thread), issued, committed, not waited for."""
    rs = wgmma.wgmma_bf16_rs if IS_BF16 else wgmma.wgmma_f16_rs
    K_STEPS = K // 16

    @device_function
    def update(acc, a_regs, b_tile):
        wgmma.wgmma_fence()
        for kk in range(K_STEPS):
            a_kk = (a_regs[kk, 0], a_regs[kk, 1], a_regs[kk, 2], a_regs[kk, 3])
            acc = rs(acc, a_kk, wgmma.descriptor_mn_major(b_tile, K, 16 * kk), 1, 1)
        wgmma.wgmma_commit()
        return acc

    return update


def _packing(HEAD_DIM, IS_BF16):
    """(pack_a_step, store_rows), in the inputs' 16-bit type:

    pack_a_step(x, regs, kk): the A registers regs[kk] (int32) of columns 16 kk .. 16 kk + 15 of x [columns / 8,
    4] (float32, D's layout): its registers 8 kk .. 8 kk + 7 rounded to 16 bits in pairs (``forward_wgmma``'s P).

    store_rows(out, acc, factor, row0, end, t): factor · acc (D's layout, HEAD_DIM columns) into rows row0 and
    row0 + 8 of out (flat int32 pairs, HEAD_DIM columns a row), those below end."""
    pack = pack_bf16x2 if IS_BF16 else pack_f16x2
    O_TILES = HEAD_DIM // 8

    @device_function
    def pack_a_step(x, regs, kk):
        regs[kk, 0] = pack(x[2 * kk, 0], x[2 * kk, 1])
        regs[kk, 1] = pack(x[2 * kk, 2], x[2 * kk, 3])
        regs[kk, 2] = pack(x[2 * kk + 1, 0], x[2 * kk + 1, 1])
        regs[kk, 3] = pack(x[2 * kk + 1, 2], x[2 * kk + 1, 3])

    @device_function
    def store_rows(out, acc, factor, row0, end, t):
        for h in range(2):
            row = row0 + 8 * h
            if row < end:
                for j in range(O_TILES):
                    col = 8 * j + 2 * t
                    out[uint64((row * HEAD_DIM + col) // 2)] = pack(
                        acc[4 * j + 2 * h] * factor, acc[4 * j + 2 * h + 1] * factor
                    )

    return pack_a_step, store_rows


def _probability(ALIBI):
    """probability(x, slope, distance, l2) -> exp2(x - l2) of one score, x in base 2 (S · scale · log2 e, or with
    a softcap c · log2 e · tanh), with ALIBI less ALiBi's bias slope · |distance| (slope in base 2) first: one FMA,
    as ``backward_tc``'s."""

    @device_function
    def probability(x, slope, distance, l2):
        if ALIBI:
            x = cuda.fma(-slope, abs(distance), x)
        return exp2_approx(x - l2)

    return probability


# The masking of a probabilities' loop, by a Python constant, so that numba builds one copy per value: "tile",
# each element masked where the tile crosses an edge (the runtime uniform ``crosses``) and it is outside; "all",
# masked where outside (the tiles that cross, SPLIT_MASK); "none", no mask compare (the tiles inside the mask).
_MASKS = ("tile", "all", "none")


def _build_dkdv(HEAD_DIM, config, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16):
    """The dK/dV kernel for one head dim, query tile, window (CAUSAL, LEFT, RIGHT: ``_window_flags``), softcap or
    not, ALiBi or not, packed or dense, and input type."""
    BLOCK_M, DV_EARLY, SPLIT = config.BLOCK_M, config.DV_EARLY, config.SPLIT_MASK
    assert HEAD_DIM in HEAD_DIMS and BLOCK_M % 16 == 0 and 16 <= BLOCK_M <= 256
    assert not (DV_EARLY and SOFTCAP) and not (CAUSAL and RIGHT)
    BOUNDED = CAUSAL or RIGHT  # a right edge: keys more than right (0 with CAUSAL) right of the diagonal masked
    M_TILES = BLOCK_M // 8  # 8-query column blocks of Sᵀ, 4 registers each
    O_REGS = HEAD_DIM // 2  # dK and dV: its 64 keys x HEAD_DIM
    M_STEPS = BLOCK_M // 16  # k steps of dV += Pᵀ dO and dK += dSᵀ Q
    # NVVM unrolls the loops over Sᵀ's registers itself up to 64 queries; past that the builder writes them out
    # (``unrolled``), else Sᵀ, Pᵀ and the A fragments live in local memory (512 B a thread at 128 queries).
    UNROLL = BLOCK_M > 64
    KV_TILE = wgmma.swizzle128_tile_bytes(64, HEAD_DIM)  # one warpgroup's K (or V)
    QDO_TILE = wgmma.swizzle128_tile_bytes(BLOCK_M, HEAD_DIM)
    STAGE = 2 * QDO_TILE  # the step's Q then dO
    ROW_STATS = 2 * BLOCK_M  # L · log2 e and delta of both stages' queries
    issue_products = _issue_products(HEAD_DIM, BLOCK_M, IS_BF16)
    issue_update = _issue_update(BLOCK_M, IS_BF16)
    pack_a_step, store_rows = _packing(HEAD_DIM, IS_BF16)
    probability = _probability(ALIBI)
    load_kv = wgmma.tile_loader(BLOCK_N, 64, HEAD_DIM, NUM_THREADS)
    load_qdo = wgmma.tile_loader(BLOCK_M, BLOCK_M, HEAD_DIM, NUM_THREADS)

    @device_function
    def outside(offset, rel_right, rel_left):
        """Whether the element of Pᵀ at offset = 8 j + e % 2 - 8 (e // 2) of a tile that crosses a window edge is
        masked: rel_right > offset (right edge) or rel_left < offset (left edge). With both edges one unsigned
        compare, offset - rel_right above rel_left - rel_right = window_left + right: the step body stays small
        enough for LLVM to unroll it whole (with two compares and a softcap and ALiBi, Sᵀ and the cap's derivative
        went to 256 B of local memory). int64 first: the simulator's uint32 wraps numpy integers only."""
        if BOUNDED and LEFT:
            return uint32(int64(offset - rel_right)) > uint32(int64(rel_left - rel_right))
        return (BOUNDED and rel_right > offset) or (LEFT and rel_left < offset)

    def masked_probabilities(MASK):
        """(scores, gradients): a step's loops that make Pᵀ, with MASK (``_MASKS``) for the window's mask; the
        masked one is ``scores`` without a softcap, ``gradients`` with one.

        scores(p, s, qk_scale, slope, distance, lse_tile, lse_row, t, rel_right, rel_left, crosses): p [M_TILES,
        4] := Pᵀ from Sᵀ's registers s, or with SOFTCAP tanh(Sᵀ · qk_scale) (Pᵀ is then ``gradients``').

        gradients(p, cap, p_regs, ds_regs, dp, softcap_log2, slope, distance, lse_tile, delta_tile, lse_row, t,
        rel_right, rel_left, crosses): dSᵀ in place of Pᵀ, by 16 queries, from dPᵀ's registers dp: with SOFTCAP Pᵀ
        from the capped scores c · log2 e · tanh first (cap [M_TILES, 4]: 1 - tanh²); without DV_EARLY Pᵀ's A
        registers p_regs packed first (dV waits for them); dSᵀ's into ds_regs."""
        ALL, TILE = MASK == "all", MASK == "tile"

        def scores(p, s, qk_scale, slope, distance, lse_tile, lse_row, t, rel_right, rel_left, crosses):
            for j in range(M_TILES):
                for e in range(4):
                    col = 8 * j + 2 * t + e % 2
                    offset = 8 * j + e % 2 - 8 * (e // 2)
                    if SOFTCAP:
                        # tanh(Sᵀ · scale / c) during dPᵀ's products; Pᵀ after its wait, with the cap's derivative
                        # 1 - tanh² (no registers held for it across the wait).
                        p[j, e] = tanh_approx(s[4 * j + e] * qk_scale)
                    else:
                        x = probability(
                            s[4 * j + e] * qk_scale, slope, distance + float32(offset), lse_tile[lse_row + col]
                        )
                        if (ALL or (TILE and crosses)) and outside(offset, rel_right, rel_left):
                            x = float32(0.0)
                        p[j, e] = x

        def gradients(
            p,
            cap,
            p_regs,
            ds_regs,
            dp,
            softcap_log2,
            slope,
            distance,
            lse_tile,
            delta_tile,
            lse_row,
            t,
            rel_right,
            rel_left,
            crosses,
        ):
            for kk in range(M_STEPS):
                if SOFTCAP:  # Pᵀ from the capped scores c · log2 e · tanh
                    for j in range(2 * kk, 2 * kk + 2):
                        for e in range(4):
                            col = 8 * j + 2 * t + e % 2
                            offset = 8 * j + e % 2 - 8 * (e // 2)
                            tanh_s = p[j, e]
                            cap[j, e] = float32(1.0) - tanh_s * tanh_s
                            x = probability(
                                tanh_s * softcap_log2, slope, distance + float32(offset), lse_tile[lse_row + col]
                            )
                            if (ALL or (TILE and crosses)) and outside(offset, rel_right, rel_left):
                                x = float32(0.0)
                            p[j, e] = x
                if not DV_EARLY:
                    pack_a_step(p, p_regs, kk)
                for j in range(2 * kk, 2 * kk + 2):
                    for e in range(4):
                        col = 8 * j + 2 * t + e % 2
                        p[j, e] = p[j, e] * (dp[4 * j + e] - delta_tile[lse_row + col])
                        if SOFTCAP:
                            p[j, e] *= cap[j, e]
                pack_a_step(p, ds_regs, kk)

        return device_function(scores, unroll=UNROLL), device_function(gradients, unroll=UNROLL)

    (scores, gradients), (scores_all, gradients_all), (scores_none, gradients_none) = map(masked_probabilities, _MASKS)

    @device_function
    def next_tile(start_m, head, begin_m, end_m):
        """The (query tile, head) after (start_m, head) in a block's walk over tiles begin_m .. end_m - 1: the
        head's next tile, else its first tile (begin_m) of the next head."""
        start_m += BLOCK_M
        if start_m >= end_m:
            return begin_m, head + 1
        return start_m, head

    @device_function
    def load_tile(
        tile,
        lse_tile,
        delta_tile,
        slot,
        start_m,
        q_base,
        q_offset,
        do_base,
        do_offset,
        stride_qm,
        stride_dom,
        lse,
        l_offset,
        stride_lm,
        delta,
        delta_offset,
        seqlen_q,
    ):
        """Slot slot of the stages := the query tile at start_m of one head: its Q and dO rows at shared address
        tile (cp.async, committed: landed after cp_async_wait_all), L · log2 e and delta of its rows (+inf and 0
        past seqlen_q: their P is zero)."""
        load_qdo(tile, q_base, q_offset, stride_qm, start_m, seqlen_q)
        load_qdo(tile + uint32(QDO_TILE), do_base, do_offset, stride_dom, start_m, seqlen_q)
        cp_async_commit()  # with the copies issued before it (K and V's, at the first step)
        r = cuda.threadIdx.x
        if 0 <= r < BLOCK_M:
            row = start_m + r
            lse_tile[BLOCK_M * slot + r] = float32(math.inf)
            delta_tile[BLOCK_M * slot + r] = 0.0
            if row < seqlen_q:
                lse_tile[BLOCK_M * slot + r] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                delta_tile[BLOCK_M * slot + r] = delta[uint64(delta_offset + row)]

    def _attn_bwd_dkdv_wgmma(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_dob,
        stride_doh,
        stride_dom,
        stride_lb,
        stride_lh,
        stride_lm,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        scale,
        qk_scale,
        num_n_tiles,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        cu_seqlens_q,
        cu_seqlens_k,
        window_left,
        window_right,
    ):
        """One block: BLOCK_N keys of one (batch, key/value head), for the group's query heads. q, k, v, do: flat
        int16 views (fp16 or bf16 bit patterns) of (B, H, N, HEAD_DIM) tensors with unit stride along head dims,
        k and v with H // group heads; lse: (B, H, seqlen_q) fp32;
        delta: (B·H, seqlen_q) fp32, flat; dk, dv: (B, H // group, seqlen_k, HEAD_DIM), flat, contiguous, int32
        pairs. qk_scale = scale · log2 e, with a softcap c scale / c (``common.score_scale``); softcap_log2 = c ·
        log2 e and the slopes (B, H) with their strides as ``common.feature_args`` gives them, read only with
        SOFTCAP and ALIBI; window_left and window_right (``common.feature_args``'s, the last arguments) only with
        LEFT and RIGHT. VARLEN: B = 1, N the packed totals, and the block's (key tile, sequence·key/value head)
        reads its sequence's rows from cu_seqlens_q and cu_seqlens_k (``common.offset_args``, after the slopes'
        strides: without VARLEN unread), the slopes (sequences, H); num_n_tiles covers max_seqlen_k; the window
        bounded by the sequence's own lengths (its diag)."""
        # Key j is visible to query i iff i + diag - window_left <= j (LEFT) and j <= i + diag + right (BOUNDED);
        # with VARLEN diag becomes the sequence's below, before any bound is taken.
        diag = seqlen_k - seqlen_q
        right = 0 if CAUSAL else window_right
        start_n = (cuda.blockIdx.x % num_n_tiles) * BLOCK_N
        heads_k = heads // group
        off_bhk = cuda.blockIdx.x // num_n_tiles
        if VARLEN:
            # Key block major instead: every sequence's block i before any block i + 1, from the first (causal: the
            # most queries) or else from the last (only the longest sequences have one): longest first across
            # sequences, without their lengths on the host.
            n_block = cuda.blockIdx.x // (cuda.gridDim.x // num_n_tiles)
            start_n = (n_block if CAUSAL else num_n_tiles - 1 - n_block) * BLOCK_N
            off_bhk = cuda.blockIdx.x % (cuda.gridDim.x // num_n_tiles)
        off_b = off_bhk // heads_k  # the batch; with VARLEN the sequence
        off_hk = off_bhk % heads_k
        if VARLEN:
            # Sequence off_b: keys k_start .. k_start + seqlen_k of the packed k, v (and dk, dv), queries q_start ..
            # q_start + seqlen_q of q, dO, L and delta; its own lengths (and their diag) stand for seqlen_q and
            # seqlen_k from here on. A key tile past its end exits (the whole block, before any copy or barrier).
            q_start, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_start, seqlen_k_s = sequence(cu_seqlens_k, off_b, seqlen_k)
            dkv_start = off_hk * seqlen_k + k_start  # dk's and dv's row of the sequence's key 0
            # The sequence's first row stands for the batch in q, dO and L (the row strides for the batch
            # strides); delta is (H, total_q), flat.
            batch_row = q_start
            stride_qb, stride_dob, stride_lb = stride_qm, stride_dom, stride_lm
            delta_rows, delta_head = q_start, seqlen_q
            k_offset = off_hk * stride_kh + k_start * stride_kn
            v_offset = off_hk * stride_vh + k_start * stride_vn
            seqlen_q, seqlen_k = seqlen_q_s, seqlen_k_s
            diag = seqlen_k - seqlen_q
            if start_n >= seqlen_k:
                return
        else:
            batch_row = off_b
            delta_rows, delta_head = off_b * heads * seqlen_q, seqlen_q  # delta: (B·H, seqlen_q), flat
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        wg = cuda.threadIdx.x // wgmma.WARPGROUP_SIZE
        thread = cuda.threadIdx.x % wgmma.WARPGROUP_SIZE
        lane = thread % 32
        t = lane % 4
        wg_key = start_n + 64 * wg  # the warpgroup's first key
        key0 = wg_key + 16 * (thread // 32) + lane // 4  # the thread's keys: key0 and key0 + 8

        smem = cuda.shared.array(0, int16, alignment=SHARED_ALIGN)  # the launch's dynamic size
        lse_tile = cuda.shared.array(ROW_STATS, float32)  # L · log2 e of each stage's queries
        delta_tile = cuda.shared.array(ROW_STATS, float32)
        base = shared_address(smem)
        tiles = base + (wgmma.SWIZZLE_ATOM_BYTES - base % wgmma.SWIZZLE_ATOM_BYTES) % wgmma.SWIZZLE_ATOM_BYTES
        k_tile = tiles + uint32(wg * KV_TILE)
        v_tile = tiles + uint32((2 + wg) * KV_TILE)
        qdo_tiles = tiles + uint32(4 * KV_TILE)
        q_base, k_base, v_base, do_base = global_address(q), global_address(k), global_address(v), global_address(do)

        # The query tiles that see a key of the block: from the one holding the first key's right edge (query
        # start_n - diag - right), up to the last key's left edge (query last key - diag + window_left).
        begin_m = max(start_n - diag - right, 0) // BLOCK_M * BLOCK_M if BOUNDED else 0
        end_m = min(seqlen_q, min(start_n + BLOCK_N, seqlen_k) - diag + window_left) if LEFT else seqlen_q
        head_tiles = (end_m - begin_m + BLOCK_M - 1) // BLOCK_M if end_m > begin_m else 0
        # GQA: the block's steps walk (query head off_hk · group + i // head_tiles, query tile i % head_tiles) for
        # i = 0 .. group · head_tiles - 1, each (head, tile) the previous one's next tile, wrapping to the next head.
        steps = group * head_tiles
        head0 = off_hk * group
        if steps > 0:  # else no copy is issued (none is left in flight at the exit)
            load_kv(tiles, k_base, k_offset, stride_kn, start_n, seqlen_k)
            load_kv(tiles + uint32(2 * KV_TILE), v_base, v_offset, stride_vn, start_n, seqlen_k)
            load_tile(  # step 0's tile into stage 0
                qdo_tiles,
                lse_tile,
                delta_tile,
                0,
                begin_m,
                q_base,
                batch_row * stride_qb + head0 * stride_qh,
                do_base,
                batch_row * stride_dob + head0 * stride_doh,
                stride_qm,
                stride_dom,
                lse,
                batch_row * stride_lb + head0 * stride_lh,
                stride_lm,
                delta,
                delta_rows + head0 * delta_head,
                seqlen_q,
            )

        p = cuda.local.array((M_TILES, 4), float32)  # Sᵀ, then Pᵀ: [64 keys, BLOCK_M] as D's registers
        p_regs = cuda.local.array((M_STEPS, 4), int32)  # Pᵀ in 16-bit pairs: dV's A fragments
        ds_regs = cuda.local.array((M_STEPS, 4), int32)  # dSᵀ in 16-bit pairs: dK's A fragments
        cap = cuda.local.array((M_TILES, 4), float32)  # SOFTCAP: 1 - tanh² of 16 queries' scores at a time
        dk_acc = wgmma.zero_accumulators(O_REGS)  # [64 keys, HEAD_DIM] as D's registers
        dv_acc = wgmma.zero_accumulators(O_REGS)
        start_m, start_h = begin_m, head0  # step it's (tile, head)
        for it in range(steps):
            buf = it % 2
            cp_async_wait_all()  # this thread's copies of step it (and K, V) have landed ...
            wgmma.fence_proxy_async()  # ... visible to wgmma's async proxy ...
            cuda.syncthreads()  # ... every thread's; both warpgroups are done with step it - 1's stage
            next_m, next_h = next_tile(start_m, start_h, begin_m, end_m)  # step it + 1's
            if it + 1 < steps:  # into the other stage
                load_tile(
                    qdo_tiles + uint32((1 - buf) * STAGE),
                    lse_tile,
                    delta_tile,
                    1 - buf,
                    next_m,
                    q_base,
                    batch_row * stride_qb + next_h * stride_qh,
                    do_base,
                    batch_row * stride_dob + next_h * stride_doh,
                    stride_qm,
                    stride_dom,
                    lse,
                    batch_row * stride_lb + next_h * stride_lh,
                    stride_lm,
                    delta,
                    delta_rows + next_h * delta_head,
                    seqlen_q,
                )
            # The warpgroup's products, unless no query of the tile sees any of its keys (all masked:
            # zero gradients: its first key right of the tile's last query's window, or its last key left
            # of the first query's) or they are all past seqlen_k (never written back). Uniform over the
            # warpgroup. The window's sizes go through ``wgmma.opaque_address`` each tile, so that LLVM does
            # not hoist the sums made of them out of the loop into registers held throughout (at HEAD_DIM
            # 128 that left 64-88 B of local memory).
            w_left = int32(wgmma.opaque_address(window_left)) if LEFT else 0
            w_right = int32(wgmma.opaque_address(right)) if RIGHT else right
            skip = (
                wg_key >= seqlen_k
                or (BOUNDED and start_m + BLOCK_M - 1 + diag + w_right < wg_key)
                or (LEFT and wg_key + 63 < start_m + diag - w_left)
            )
            if not skip:
                # ALiBi's slope of the tile's query head, in base 2 (loaded during the products).
                slope = (
                    slopes[uint64(off_b * stride_ab + start_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
                )
                q_tile = qdo_tiles + uint32(buf * STAGE)
                do_tile = q_tile + uint32(QDO_TILE)
                s = issue_products(wgmma.opaque_address(k_tile), q_tile)  # Sᵀ = K Qᵀ
                dp = issue_products(wgmma.opaque_address(v_tile), do_tile)  # dPᵀ = V dOᵀ
                wgmma.wgmma_wait(1)  # Sᵀ's group is done, dPᵀ's may run on
                s = wgmma.wgmma_fence_operand(s)
                # Pᵀ: masked only where the tile crosses a window edge of the warpgroup's keys. Element
                # (j, e) is key key0 + 8 (e // 2) against query start_m + 8 j + 2 t + e % 2: with offset =
                # 8 j + e % 2 - 8 (e // 2) and rel = key0 - start_m - 2 t - diag, masked iff rel - right >
                # offset (right edge) or rel + window_left < offset (left); ALiBi's distance |query + diag
                # - key| is |offset - rel| (backward_tc's).
                crosses = (BOUNDED and wg_key + 63 > start_m + diag + w_right) or (
                    LEFT and wg_key < start_m + BLOCK_M - 1 + diag - w_left
                )
                rel = key0 - start_m - 2 * t - diag
                rel_right = rel - w_right
                rel_left = rel + w_left
                distance = float32(-rel) if ALIBI else float32(0.0)
                lse_row = BLOCK_M * buf
                # The mask is scores' (gradients' with a softcap): with SPLIT_MASK its masked copy runs on
                # the tiles that cross an edge, one without any mask compare on the others.
                score_args = (qk_scale, slope, distance, lse_tile, lse_row, t, rel_right, rel_left, crosses)
                if SPLIT and not SOFTCAP:
                    if crosses:
                        scores_all(p, s, *score_args)
                    else:
                        scores_none(p, s, *score_args)
                else:
                    scores(p, s, *score_args)
                if DV_EARLY:
                    for kk in range(M_STEPS):
                        pack_a_step(p, p_regs, kk)
                    dv_acc = issue_update(dv_acc, p_regs, do_tile)  # dV += Pᵀ dO
                    wgmma.wgmma_wait(1)  # dPᵀ's group is done, dV's may run on
                else:
                    wgmma.wgmma_wait(0)
                dp = wgmma.wgmma_fence_operand(dp)
                ds_args = (softcap_log2, slope, distance, lse_tile, delta_tile, lse_row, t, rel_right, rel_left)
                if SPLIT and SOFTCAP:
                    if crosses:
                        gradients_all(p, cap, p_regs, ds_regs, dp, *ds_args, crosses)
                    else:
                        gradients_none(p, cap, p_regs, ds_regs, dp, *ds_args, crosses)
                else:
                    gradients(p, cap, p_regs, ds_regs, dp, *ds_args, crosses)
                if not DV_EARLY:
                    dv_acc = issue_update(dv_acc, p_regs, do_tile)  # dV += Pᵀ dO
                dk_acc = issue_update(dk_acc, ds_regs, q_tile)  # dK += dSᵀ Q
                wgmma.wgmma_wait(0)
                dv_acc = wgmma.wgmma_fence_operand(dv_acc)
                dk_acc = wgmma.wgmma_fence_operand(dk_acc)
            start_m, start_h = next_m, next_h

        # Epilogue: dk = scale · dK, dv = dV, each element once (keys that no row sees: zeros).
        if not VARLEN:
            dkv_start = off_bhk * seqlen_k  # dk's and dv's row of key 0 of this (batch, key/value head)
        store_rows(dk, dk_acc, scale, dkv_start + key0, dkv_start + seqlen_k, t)
        store_rows(dv, dv_acc, float32(1.0), dkv_start + key0, dkv_start + seqlen_k, t)

    return cuda.jit(unrolled(_attn_bwd_dkdv_wgmma) if UNROLL else _attn_bwd_dkdv_wgmma)


def _build_dq(HEAD_DIM, config, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16):
    """The dQ kernel for one head dim, key tile, window (CAUSAL, LEFT, RIGHT: ``_window_flags``), softcap or not,
    ALiBi or not, packed or dense, and input type."""
    BLOCK_N_DQ, SPLIT = config.DQ_BLOCK_N, config.SPLIT_MASK
    assert HEAD_DIM in HEAD_DIMS and BLOCK_N_DQ % 16 == 0 and 16 <= BLOCK_N_DQ <= 256 and not (CAUSAL and RIGHT)
    BOUNDED = CAUSAL or RIGHT  # a right edge: keys more than right (0 with CAUSAL) right of the diagonal masked
    N_TILES = BLOCK_N_DQ // 8  # 8-key column blocks of S, 4 registers each
    O_REGS = HEAD_DIM // 2  # dQ: the warpgroup's 64 rows x HEAD_DIM
    N_STEPS = BLOCK_N_DQ // 16  # k steps of dQ += dS K
    # NVVM unrolls the loops over S's registers itself up to 64 keys; past that the builder writes them out
    # (``unrolled``), else S, P and dS's fragments live in local memory (384 B a thread at 128 keys).
    UNROLL = BLOCK_N_DQ > 64
    QDO_TILE = wgmma.swizzle128_tile_bytes(64, HEAD_DIM)  # one warpgroup's Q (or dO)
    KV_TILE = wgmma.swizzle128_tile_bytes(BLOCK_N_DQ, HEAD_DIM)
    STAGE = 2 * KV_TILE  # K then V
    issue_products = _issue_products(HEAD_DIM, BLOCK_N_DQ, IS_BF16)
    issue_update = _issue_update(BLOCK_N_DQ, IS_BF16)
    pack_a_step, store_rows = _packing(HEAD_DIM, IS_BF16)
    probability = _probability(ALIBI)
    load_qdo = wgmma.tile_loader(BLOCK_M_DQ, 64, HEAD_DIM, NUM_THREADS)
    load_kv = wgmma.tile_loader(BLOCK_N_DQ, BLOCK_N_DQ, HEAD_DIM, NUM_THREADS)

    def masked_scores(MASK):
        """scores(p, cap, s, qk_scale, softcap_log2, slope, distance, lse_row, lane_diag, t, start_n, seqlen_k,
        right, window_left, mask): p [N_TILES, 4] := P from S's registers s (with SOFTCAP cap [N_TILES, 4] := 1 -
        tanh²), masked as ``_MASKS``'s MASK says (mask: the tile crosses the end of the keys or a window edge)."""
        ALL, TILE = MASK == "all", MASK == "tile"

        def scores(
            p,
            cap,
            s,
            qk_scale,
            softcap_log2,
            slope,
            distance,
            lse_row,
            lane_diag,
            t,
            start_n,
            seqlen_k,
            right,
            window_left,
            mask,
        ):
            for h in range(2):
                hi = seqlen_k - 2 * t - start_n  # keys from column hi of the lane's row h on are masked
                if BOUNDED:
                    hi = min(hi, lane_diag + 8 * h + right + 1 - start_n)
                lo = lane_diag + 8 * h - window_left - start_n  # LEFT: and those before column lo
                for j in range(N_TILES):
                    for e in range(2 * h, 2 * h + 2):
                        x = s[4 * j + e] * qk_scale
                        if SOFTCAP:  # the forward's capped score c · log2 e · tanh, keeping 1 - tanh² for dS
                            tanh_s = tanh_approx(x)
                            cap[j, e] = float32(1.0) - tanh_s * tanh_s
                            x = tanh_s * softcap_log2
                        x = probability(x, slope, distance + float32(8 * h - 8 * j - e % 2), lse_row[h])
                        if (ALL or (TILE and mask)) and (8 * j + e % 2 >= hi or (LEFT and 8 * j + e % 2 < lo)):
                            x = float32(0.0)
                        p[j, e] = x

        return device_function(scores, unroll=UNROLL)

    scores, scores_all, scores_none = map(masked_scores, _MASKS)

    def _attn_bwd_dq_wgmma(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_dob,
        stride_doh,
        stride_dom,
        stride_lb,
        stride_lh,
        stride_lm,
        heads,
        group,
        seqlen_q,
        seqlen_k,
        scale,
        qk_scale,
        num_m_tiles,
        softcap_log2,
        slopes,
        stride_ab,
        stride_ah,
        cu_seqlens_q,
        cu_seqlens_k,
        window_left,
        window_right,
    ):
        """One block: BLOCK_M_DQ query rows of one (batch, head). q, k, v, do, lse, delta and the strides as the
        dK/dV kernel's, as are qk_scale, softcap_log2, the slopes and the window; dq: (B, H, seqlen_q, HEAD_DIM),
        flat, contiguous, int32 pairs. VARLEN: as the dK/dV kernel's, b the sequence, num_m_tiles covering
        max_seqlen_q."""
        # Key j is visible to query i iff i + diag - window_left <= j (LEFT) and j <= i + diag + right (BOUNDED);
        # with VARLEN diag becomes the sequence's below, before any bound is taken.
        diag = seqlen_k - seqlen_q
        right = 0 if CAUSAL else window_right
        m_block = cuda.blockIdx.x % num_m_tiles
        if BOUNDED:
            m_block = num_m_tiles - 1 - m_block  # the longest rows first
        start_m = m_block * BLOCK_M_DQ
        off_bh = cuda.blockIdx.x // num_m_tiles
        if VARLEN:
            # Query block major instead, the last first: only the longest sequences have the last blocks, and
            # causal's later rows see more keys: longest first across sequences, without their lengths on the host.
            m_block = num_m_tiles - 1 - cuda.blockIdx.x // (cuda.gridDim.x // num_m_tiles)
            start_m = m_block * BLOCK_M_DQ
            off_bh = cuda.blockIdx.x % (cuda.gridDim.x // num_m_tiles)
        off_b = off_bh // heads  # the batch; with VARLEN the sequence
        off_h = off_bh % heads
        off_hk = off_h // group  # GQA: the group's query heads share key/value head off_hk
        if VARLEN:
            # Sequence off_b: queries q_first .. q_first + seqlen_q of the packed q, dO, L, delta (and dq), keys
            # k_first .. k_first + seqlen_k of k and v; its own lengths (and their diag) stand for seqlen_q and
            # seqlen_k from here on. A query tile past its end exits (the whole block, before any copy or
            # barrier).
            q_first, seqlen_q_s = sequence(cu_seqlens_q, off_b, seqlen_q)
            k_first, seqlen_k = sequence(cu_seqlens_k, off_b, seqlen_k)
            q_start = off_h * seqlen_q + q_first  # dq's and delta's row of the sequence's query 0
            q_offset = off_h * stride_qh + q_first * stride_qm
            do_offset = off_h * stride_doh + q_first * stride_dom
            l_offset = off_h * stride_lh + q_first * stride_lm
            k_offset = off_hk * stride_kh + k_first * stride_kn
            v_offset = off_hk * stride_vh + k_first * stride_vn
            seqlen_q = seqlen_q_s
            diag = seqlen_k - seqlen_q
            if start_m >= seqlen_q:
                return
        else:
            q_start = off_bh * seqlen_q  # dq's and delta's row of query 0 of this (batch, head)
            q_offset = off_b * stride_qb + off_h * stride_qh
            do_offset = off_b * stride_dob + off_h * stride_doh
            l_offset = off_b * stride_lb + off_h * stride_lh
            k_offset = off_b * stride_kb + off_hk * stride_kh
            v_offset = off_b * stride_vb + off_hk * stride_vh
        wg = cuda.threadIdx.x // wgmma.WARPGROUP_SIZE
        thread = cuda.threadIdx.x % wgmma.WARPGROUP_SIZE
        lane = thread % 32
        t = lane % 4
        wg_row = start_m + 64 * wg  # the warpgroup's first row
        row0 = wg_row + 16 * (thread // 32) + lane // 4  # the thread's rows: row0 and row0 + 8

        smem = cuda.shared.array(0, int16, alignment=SHARED_ALIGN)  # the launch's dynamic size
        base = shared_address(smem)
        tiles = base + (wgmma.SWIZZLE_ATOM_BYTES - base % wgmma.SWIZZLE_ATOM_BYTES) % wgmma.SWIZZLE_ATOM_BYTES
        q_tile = tiles + uint32(wg * QDO_TILE)
        do_tile = tiles + uint32((2 + wg) * QDO_TILE)
        kv_tiles = tiles + uint32(4 * QDO_TILE)
        k_base, v_base = global_address(k), global_address(v)

        # L · log2 e and delta of the thread's two rows (+inf and 0 past seqlen_q: their P is zero).
        lse_row = cuda.local.array(2, float32)
        delta_row = cuda.local.array(2, float32)
        for h in range(2):
            row = row0 + 8 * h
            lse_row[h] = float32(math.inf)
            delta_row[h] = 0.0
            if row < seqlen_q:
                lse_row[h] = lse[uint64(l_offset + row * stride_lm)] * float32(LOG2E)
                delta_row[h] = delta[uint64(q_start + row)]

        # The key tiles some row of the block sees: from the one holding the first row's left edge, up to the
        # last row's right edge (none where that is left of the first).
        begin_n = max(start_m + diag - window_left, 0) // BLOCK_N_DQ * BLOCK_N_DQ if LEFT else 0
        end_n = max(min(seqlen_k, min(start_m + BLOCK_M_DQ, seqlen_q) + diag + right), 0) if BOUNDED else seqlen_k
        n_tiles = -(-(end_n - begin_n) // BLOCK_N_DQ)
        if n_tiles > 0:  # else no copy is issued (none is left in flight at the exit)
            load_qdo(tiles, global_address(q), q_offset, stride_qm, start_m, seqlen_q)
            load_qdo(tiles + uint32(2 * QDO_TILE), global_address(do), do_offset, stride_dom, start_m, seqlen_q)
            load_kv(kv_tiles, k_base, k_offset, stride_kn, begin_n, seqlen_k)
            load_kv(kv_tiles + uint32(KV_TILE), v_base, v_offset, stride_vn, begin_n, seqlen_k)
            cp_async_commit()

        # ALiBi's slope of this (batch, head), in base 2.
        slope = slopes[uint64(off_b * stride_ab + off_h * stride_ah)] * float32(LOG2E) if ALIBI else float32(0.0)
        p = cuda.local.array((N_TILES, 4), float32)  # S, then P, then dS: [64 rows, BLOCK_N_DQ] as D's registers
        cap = cuda.local.array((N_TILES, 4), float32)  # SOFTCAP: 1 - tanh² of S's scores, until dS
        ds_regs = cuda.local.array((N_STEPS, 4), int32)  # dS in 16-bit pairs: dQ's A fragments
        acc = wgmma.zero_accumulators(O_REGS)  # dQ: [64 rows, HEAD_DIM] as D's registers
        lane_diag = row0 + diag - 2 * t
        for it in range(n_tiles):
            start_n = begin_n + it * BLOCK_N_DQ
            k_tile = kv_tiles + uint32(it % 2 * STAGE)
            cp_async_wait_all()  # this thread's copies of tile it (and Q, dO) have landed ...
            wgmma.fence_proxy_async()  # ... visible to wgmma's async proxy ...
            cuda.syncthreads()  # ... every thread's; both warpgroups are done with tile it - 1's stage
            if it + 1 < n_tiles:
                next_k = kv_tiles + uint32((it + 1) % 2 * STAGE)
                load_kv(next_k, k_base, k_offset, stride_kn, start_n + BLOCK_N_DQ, seqlen_k)
                load_kv(next_k + uint32(KV_TILE), v_base, v_offset, stride_vn, start_n + BLOCK_N_DQ, seqlen_k)
                cp_async_commit()
            # The warpgroup's products, unless its rows are all past seqlen_q or see none of the tile's keys (its
            # first key right of the last row's window, or its last key left of the first row's).
            skip = (
                wg_row >= seqlen_q
                or (BOUNDED and start_n > wg_row + 63 + diag + right)
                or (LEFT and start_n + BLOCK_N_DQ - 1 < wg_row + diag - window_left)
            )
            if not skip:
                s = issue_products(wgmma.opaque_address(q_tile), k_tile)  # S = Q Kᵀ
                dp = issue_products(wgmma.opaque_address(do_tile), k_tile + uint32(KV_TILE))  # dP = dO Vᵀ
                wgmma.wgmma_wait(1)  # S's group is done, dP's may run on
                s = wgmma.wgmma_fence_operand(s)
                # P, masked where the tile crosses the end of the keys or a window edge of the warpgroup's rows:
                # element (j, e) is row row0 + 8 (e // 2) against key start_n + 8 j + 2 t + e % 2 (forward_wgmma's
                # softmax mask); ALiBi's distance |row + diag - key| is |rel + 8 (e // 2) - 8 j - e % 2|, rel =
                # row0 + diag - start_n - 2 t (backward_tc's).
                mask = (
                    start_n + BLOCK_N_DQ > seqlen_k
                    or (BOUNDED and start_n + BLOCK_N_DQ - 1 > wg_row + diag + right)
                    or (LEFT and start_n < wg_row + 63 + diag - window_left)
                )
                distance = float32(lane_diag - start_n) if ALIBI else float32(0.0)
                # With SPLIT_MASK the masked copy of the loop runs where the tile crosses, one without any mask
                # compare elsewhere.
                args = (p, cap, s, qk_scale, softcap_log2, slope, distance, lse_row, lane_diag, t, start_n, seqlen_k)
                if SPLIT:
                    if mask:
                        scores_all(*args, right, window_left, mask)
                    else:
                        scores_none(*args, right, window_left, mask)
                else:
                    scores(*args, right, window_left, mask)
                wgmma.wgmma_wait(0)
                dp = wgmma.wgmma_fence_operand(dp)
                for kk in range(N_STEPS):  # dS in place of P, packed 16 keys at a time
                    for j in range(2 * kk, 2 * kk + 2):
                        for e in range(4):
                            p[j, e] = p[j, e] * (dp[4 * j + e] - delta_row[e // 2])
                            if SOFTCAP:
                                p[j, e] *= cap[j, e]
                    pack_a_step(p, ds_regs, kk)
                acc = issue_update(acc, ds_regs, k_tile)  # dQ += dS K
                wgmma.wgmma_wait(0)
                acc = wgmma.wgmma_fence_operand(acc)

        # Epilogue: dq = scale · dQ, each element once (rows that see no key: zeros).
        store_rows(dq, acc, scale, q_start + row0, q_start + seqlen_q, t)

    return cuda.jit(unrolled(_attn_bwd_dq_wgmma) if UNROLL else _attn_bwd_dq_wgmma)


# Compiled kernels by ("dkdv" or "dq", HEAD_DIM, ``kernel_config``, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN,
# IS_BF16).
_KERNELS: dict[tuple, object] = {}
# The fields of WgmmaBwdConfig each kernel's builder reads.
_FIELDS = {
    "dkdv": ("BLOCK_M", "DV_EARLY", "SPLIT_MASK"),
    "dq": ("DQ_BLOCK_N", "SPLIT_MASK"),
}
# Prepared launches (preprocess, dK/dV, dQ; ``launch.prepare``) by class of call: the tensors' shapes, strides
# and dtypes, the device, whether their data is 16 B aligned, the spec's values (``spec_class``), the config.
_PREPARED: dict[tuple, tuple] = {}


_BUILDERS = {"dkdv": _build_dkdv, "dq": _build_dq}


def kernel_config(name: str, config: WgmmaBwdConfig) -> WgmmaBwdConfig:
    """What kernel ``name`` ("dkdv" or "dq") is built from: ``config``'s fields that its builder reads, the others at
    WgmmaBwdConfig's defaults (BLOCK_M 64). Compilations are kept by it, so that configurations that differ only
    in the other kernel's fields (a tuner's candidates) share one."""
    return WgmmaBwdConfig(64)._replace(**{f: getattr(config, f) for f in _FIELDS[name]})


def _kernel(name, HEAD_DIM, config, *flags):
    key = (name, HEAD_DIM, kernel_config(name, config), *flags)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _BUILDERS[name](*key[1:])
    return kernel


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    O: torch.Tensor,
    L: torch.Tensor,
    dO: torch.Tensor,
    spec: AttentionSpec,
    config: WgmmaBwdConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """Arguments:
        q, dO: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_k, seqlen_k, head_dim), heads a multiple
            of heads_k (grouped-query attention): query head h attends to key/value head h // (heads //
            heads_k); fp16 or bf16, one dtype, head_dim 64 or 128, contiguous along head_dim with 16 B aligned
            rows; CUDA tensors on compute capability 9.0, or CPU tensors under numba's simulator (emulated
            wgmma, tiny shapes).
        O: (batch, heads, seqlen_q, head_dim), q's dtype; L: (batch, heads, seqlen_q), float32, natural log, from
            the forward (+inf on rows that see no key); any strides.
        spec: what the forward computed: any scale and window, bottom-right aligned (key j visible to query i
            iff i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q, each side -1 for unbounded;
            causal is (-1, 0))::

                causal, seqlen_q = 2, seqlen_k = 5:   1 1 1 1 0
                                                      1 1 1 1 1

            a softcap and ALiBi slopes ((batch, heads) fp32, no gradient) as ``backward_tc`` takes them; for a
            packed batch cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: q, O, dO (1, heads, total_q,
            head_dim), L (1, heads, total_q), k, v (1, heads_k, total_k, head_dim), the slopes (sequences,
            heads), each sequence's rows given by the offsets, its mask and gradients its own (``refusal``
            names what these kernels do not take).
        config: the kernels' tiles, for tuning; default ``bwd_config(head_dim, softcap, masked)`` (DV_EARLY takes
            no softcap).

    Returns:
        dq, dk, dv in the shapes and dtypes of q, k, v (dk, dv: each key/value head's gradient summed over its
        group's query heads), contiguous; rows that see no key get dq = 0, keys that no row sees dk = dv = 0.
        Three launches (preprocess, dK/dV, dQ) whatever the number of sequences, no host sync. With spec.sink
        (attention sinks, (heads,) fp32) also dsink, (heads,) fp32, as ``backward_tc`` returns it: the
        preprocess's shares (``backward_simt.dsink_parts``) summed per head (``backward_simt.sink_gradient``).
    """
    key = None
    if launch.FAST:  # a call of a class met before: the kernels' parameters are packed, only pointers change
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | dO.data_ptr()) % 16 == 0
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), O.shape, O.stride(), L.shape)
        key += (L.stride(), dO.shape, dO.stride(), q.dtype, k.dtype, v.dtype, O.dtype, L.dtype, dO.dtype, q.device)
        key += (aligned, spec_class(spec), None if config is None else tuple(config))
        plan = _PREPARED.get(key)
        if plan is not None:
            preprocess, dkdv, dq_kernel = plan
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            delta = torch.empty(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
            parts = dsink_parts(spec, O)
            preprocess(*preprocess_tensors(O, dO, L, delta, parts, spec))
            extra = spec_tensors(spec)  # the slopes with ALiBi, a packed batch's offsets
            dkdv(q, k, v, dO, L, delta, dk, dv, *extra)
            dq_kernel(q, k, v, dO, L, delta, dq, *extra)
            return dq, dk, dv, *sink_gradient(spec, parts)
    reason = refusal(q, k, v, dO, spec)
    if reason is not None:
        raise NotImplementedError(f"fa2-numba-cuda's wgmma backward {reason}")
    check_device(q)
    if not simulated() and capability(q.device) != COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"fa2-numba-cuda's wgmma backward needs compute capability 9.0 (sm_90a), got {capability(q.device)} "
            f"on {q.device}"
        )
    batch, heads, seqlen_q, head_dim = q.shape
    heads_k, seqlen_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # The grids: per (sequence, head) the tiles of the longest sequence with a packed batch (the others' extra
    # tiles exit).
    grid_batch, grid_seqlen_q, grid_seqlen_k = grid_extent(spec, q, k)
    if batch * heads == 0 or seqlen_k == 0 or seqlen_q == 0 or grid_batch * grid_seqlen_q * grid_seqlen_k == 0:
        # An empty side: no score, so zero gradients (backward_tc's kernels write them, seqlen_k = 0 or not).
        return backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec)
    config = WgmmaBwdConfig(*config) if config is not None else bwd_config(head_dim, spec.softcap > 0, spec.masked)
    for tile in (config.BLOCK_M, config.DQ_BLOCK_N):
        if tile % 16 or not 16 <= tile <= 256 or (tile * head_dim // 8) % NUM_THREADS:
            raise ValueError(
                f"WgmmaBwdConfig needs BLOCK_M and DQ_BLOCK_N multiples of 16 from 16 to 256, whole copies, got "
                f"{config}"
            )
    if config.DV_EARLY and spec.softcap:
        raise ValueError(f"WgmmaBwdConfig's DV_EARLY takes no softcap (its Pᵀ is made after dPᵀ's wait), got {config}")
    delta = torch.empty(batch * heads * seqlen_q, dtype=torch.float32, device=q.device)
    # delta = rowsum(dO ∘ O): the SIMT preprocess (fp32 sums; per row, a packed batch as one sequence), with a
    # sink also its blocks' shares of dsink (the kernels need no sink: L carries it into P = exp(S - L)).
    parts = dsink_parts(spec, O)
    preprocess = launch_preprocess(O, dO, L, delta, parts, spec)
    flags = (
        config,
        *_window_flags(spec),
        spec.softcap > 0,
        spec.alibi_slopes is not None,
        spec.varlen,
        q.dtype == torch.bfloat16,
    )
    inputs = (*(t.view(torch.int16) for t in (q, k, v, dO)), L, delta)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dO.stride()[:3], *L.stride())
    sizes = (heads, heads // heads_k, seqlen_q, seqlen_k, np.float32(spec.scale), np.float32(score_scale(spec)))
    # After the tile count: softcap_log2, the slopes and their strides (unread without SOFTCAP and ALIBI), then
    # a packed batch's offsets (unread without VARLEN), then the window's sizes (unread without LEFT and RIGHT;
    # last, so that the other arguments keep their places with a window or without).
    window_left, window_right, *score_args = feature_args(spec, seqlen_q, seqlen_k, q.device)
    tail = (*score_args, *offset_args(spec, q.device), window_left, window_right)
    # ``spec_tensors``' places among a kernel's arguments (head, then tail): feature_args would start two before
    # the tail (its window sizes are the tail's last), the offsets right after score_args.
    num_n_tiles = -(-grid_seqlen_k // BLOCK_N)
    head = (*inputs, dk.view(torch.int32), dv.view(torch.int32), *strides, *sizes, num_n_tiles)
    dkdv = launch.prepare(
        _kernel("dkdv", head_dim, *flags),
        num_n_tiles * grid_batch * heads_k,
        NUM_THREADS,
        q.device,
        (*head, *tail),
        (*range(8), *spec_positions(spec, len(head) - 2, len(head) + len(score_args))),
        shared_bytes("dkdv", head_dim, config),
    )
    if config.DQ_WGMMA:
        num_m_tiles = -(-grid_seqlen_q // BLOCK_M_DQ)
        head = (*inputs, dq.view(torch.int32), *strides, *sizes, num_m_tiles)
        dq_kernel = launch.prepare(
            _kernel("dq", head_dim, *flags),
            num_m_tiles * grid_batch * heads,
            NUM_THREADS,
            q.device,
            (*head, *tail),
            (*range(7), *spec_positions(spec, len(head) - 2, len(head) + len(score_args))),
            shared_bytes("dq", head_dim, config),
        )
    else:
        dq_kernel = backward_tc.launch_dq(
            q, k, v, dO, L, delta, dq, None, spec, tc_dq_config(config, head_dim, q.device)
        )
    if key is not None and None not in (preprocess, dkdv, dq_kernel):
        _PREPARED[key] = (preprocess, dkdv, dq_kernel)
    return dq, dk, dv, *sink_gradient(spec, parts)


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every wgmma backward kernel
    compiled so far in this process ("wgmma dkdv", "wgmma dq"; the preprocess, and the dQ kernel without
    DQ_WGMMA, are reported by backward_simt and backward_tc); each row's WgmmaBwdConfig fields are the kernel's
    own (``kernel_config``), the other kernel's None; empty under the simulator."""
    if simulated():
        return []
    rows = []
    for (name, HEAD_DIM, config, CAUSAL, LEFT, RIGHT, SOFTCAP, ALIBI, VARLEN, IS_BF16), kernel in _KERNELS.items():
        regs = kernel.get_regs_per_thread()
        shared = kernel.get_shared_mem_per_block()
        local = kernel.get_local_mem_per_thread()
        for signature in regs:
            rows.append(
                {
                    "kernel": f"wgmma {name}",
                    "HEAD_DIM": HEAD_DIM,
                    **{f: v if f in _FIELDS[name] else None for f, v in config._asdict().items()},
                    "causal": CAUSAL,
                    "left": LEFT,
                    "right": RIGHT,
                    "softcap": SOFTCAP,
                    "alibi": ALIBI,
                    "varlen": VARLEN,
                    "bf16": IS_BF16,
                    "registers_per_thread": regs[signature],
                    "shared_bytes_per_block": shared[signature],
                    "dynamic_shared_bytes_per_block": shared_bytes(name, HEAD_DIM, config),
                    "local_bytes_per_thread": local[signature],
                }
            )
    return rows
