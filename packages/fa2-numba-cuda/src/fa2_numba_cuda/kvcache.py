"""FlashAttention-2 decoding from a KV cache in fa2-numba-cuda: ``kvcache_forward`` picks the split kernel,
the splits and the launches.

Flash-decoding (Dao, Haziza, Massa, Sizov, 2023) in the terms of ``fa2_numba_cuda.forward_simt``: the keys of
one (batch, key/value head) are split into ranges of the cache's capacity, one block per (query tile, split,
batch, key/value head) runs the online softmax (running max ``m_i``, running sum ``l_i``, unnormalised
``acc``, rescaled by ``alpha`` per key tile; scores in base 2) over its range and writes a partial O (fp32)
and L, and a second kernel merges the splits by their logsumexp (``fa2.combine``'s formula: L = log Σ_s
exp(L_s), O = Σ_s exp(L_s - L) O_s; a split a row sees no key of has L_s = +inf and weighs nothing). With one
split the first kernel writes O and L itself and there is no second launch. The kernels:

- ``kvcache_simt``: the split kernel on CUDA cores, fp32 arithmetic, for fp32 caches, head_dim above 128 and
  GPUs older than compute capability 8.0;
- ``kvcache_tc``: the split kernel on tensor cores (``mma.sync`` m16n8k16), for fp16 and bf16 with head_dim
  <= 128 on compute capability 8.0+, and under numba's simulator (``uses_tensor_cores``);
- ``kvcache_combine``: the LSE combine, one warp a row.

The choice of split kernel is by dtype, head_dim and the device's compute capability only, never a fallback
after an error. Both take the same arguments, copy K and V the same way (``common.kv_loader``) and compute the
same thing. The query rows of a block are the group · seqlen_q rows (query head of the group, query token) of
one key/value head: row r is head ``off_hk · group + r // seqlen_q``, token ``r % seqlen_q``. One pass over
the head's K and V serves them all, so each cached key is read once per key/value head and call.

Per query row i (token i of its head, Nq_b = seqlen_q or the sequence's own count) and key j of row b's
cache, with K_b = cache_seqlens[b] (clamped to the capacity) and diag = K_b - Nq_b, in this order:
softcap c (Q pre-scaled by scale / c, score tanh(s) · c · log2 e); ALiBi (minus slope[b, h] · log2 e · |i +
diag - j|); the mask: key j is visible iff leftpad_b <= j < K_b and i + diag - left <= j <= i + diag + right
(window (left, right), -1 unbounded; causal is (-1, 0)). With Nq_b = 2, K_b = 5, leftpad_b = 1 and causal::

    0 1 1 1 0
    0 1 1 1 1

A row that sees no key gets O = 0 and L = +inf. With an attention sink (``spec.sink``, (heads,) fp32, SINK) a
row's L and denominator get sink[h] once: in the split kernel's epilogue without splits, in the combine with
them (the split kernels' partials leave it out); a row that sees no key then gets O = 0 and L = sink[h]. A
block visits only the tiles of its split's range that
hold a key some row sees: [max(leftpad_b, split start, diag - left), min(K_b, split end, Nq_b + diag +
right)).

Caches: contiguous (batch_cache, heads_k, seqlen_cache, head_dim), row b reading cache row
cache_batch_idx[b] (or b); or paged (num_pages, heads_k, page_size, head_dim), key j of row b at row
j % page_size of page block_table[b, j // page_size]; any page size, any strides. Indices that nobody
checked (the interface checks them outside a CUDA-graph capture) are clamped: cache_seqlens into [0,
capacity], cache_leftpad into [0, K_b], cache_batch_idx and page ids into the cache, cu_seqlens_q as in
``common.sequence``: wrong indices give wrong rows, never an access outside a tensor.

Splits (``num_splits``; 0 picks, ``num_splits_heuristic``): ranges of ``split_keys`` keys (a multiple of
BLOCK_N) of the capacity, never of cache_seqlens (which stays on the device). A split past K_b finds an
empty range and writes only L = +inf.

Inputs: fp32, fp16 or bf16 (bf16 as int16 bit patterns, numba having no bf16); head_dim up to 256 (tensor
cores: 128), padded to a power of two (at least 32) inside the block. Launch: on torch's current stream, no
host synchronisation, allocation by torch only (capturable in a CUDA graph); kernels compiled once per
specialisation and cached by their modules; launched through ``launch.prepare`` (numba's own launch cost
0.8-1.6 ms of host time a call of both kernels on the H200's host): a class of calls (``_class_key``: shapes,
strides, dtypes, device, the caches' alignment, the spec's values and its index tensors' layouts, the config,
the kernel asked for) is launched by numba once, then its packed parameters are kept and each later call
writes its tensors' data pointers and calls cuLaunchKernel (``_PREPARED``: the split kernel's launch and the
combine's). Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same kernels run on CPU tensors,
``cp.async``, ``mma.sync``, ``ldmatrix`` and ``shfl_xor`` emulated by ``mma.py``: use tiny shapes there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from fa2.spec import AttentionSpec
from fa2_numba_cuda import kvcache_combine, kvcache_simt, kvcache_tc, launch
from fa2_numba_cuda.common import (
    MAX_HEAD_DIM,
    check_device,
    feature_args,
    features,
    rows_16b_aligned,
    score_scale,
    simulated,
    sink_arg,
    spec_class,
)
from fa2_numba_cuda.tensor_cores import MAX_HEAD_DIM as TC_MAX_HEAD_DIM
from fa2_numba_cuda.tensor_cores import MIN_COMPUTE_CAPABILITY, capability

MAX_SPLITS = 128
MIN_SPLIT_TILES = 4  # the heuristic's splits hold at least this many key tiles


def padded_head_dim(head_dim: int) -> int:
    """The head dim the block computes with: a power of two, at least 32 (16 B chunks of a row then divide the
    block's threads evenly), the extra columns zero-filled."""
    return max(32, 1 << (head_dim - 1).bit_length())


def num_splits_heuristic(blocks: int, slots: int, n_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """How many key ranges to split each (query tile, batch, key/value head) into, flash-attn's rule
    (``num_splits_heuristic`` of flash_api.cpp): ``blocks`` unsplit blocks, ``slots`` blocks the GPU holds
    at once (SMs x blocks an SM holds), ``n_tiles`` groups of MIN_SPLIT_TILES key tiles in the capacity. No
    split where the blocks nearly fill the GPU (>= 80% of the slots); else the fewest splits whose waves are
    at least 85% as full as the best count's, among counts that change the keys a split holds."""
    if blocks >= 0.8 * slots:
        return 1
    max_splits = max(1, min(max_splits, slots, n_tiles))

    def eligible(s):
        return s == 1 or -(-n_tiles // s) != -(-n_tiles // (s - 1))

    efficiency = []
    for s in range(1, max_splits + 1):
        waves = blocks * s / slots
        efficiency.append(waves / math.ceil(waves) if eligible(s) else 0.0)
    best = max(efficiency)
    for s in range(1, max_splits + 1):
        if eligible(s) and efficiency[s - 1] >= 0.85 * best:
            return s
    return 1


_SLOTS: dict[tuple, int] = {}
_SPLITS: dict[tuple, int] = {}  # num_splits_heuristic's answers by its arguments


def block_slots(device: torch.device, threads: int, max_registers: int, shared: int) -> int:
    """Decode blocks the device holds at once, for blocks of ``threads`` threads, registers capped at
    ``max_registers`` and ``shared`` bytes of shared memory: SMs x min(by threads, by registers, by
    shared memory). From torch's device properties (no sync); under the simulator, 2 SMs of 4 blocks."""
    key = (device, threads, max_registers, shared)
    slots = _SLOTS.get(key)
    if slots is None:
        if simulated():
            slots = 8
        else:
            props = torch.cuda.get_device_properties(device)
            sm_threads = getattr(props, "max_threads_per_multi_processor", 2048)
            registers = getattr(props, "regs_per_multiprocessor", 65536)
            sm_shared = getattr(props, "shared_memory_per_multiprocessor", 100 * 1024)
            per_sm = min(
                sm_threads // threads, registers // (threads * max_registers), sm_shared // (shared + 1024), 32
            )
            slots = props.multi_processor_count * max(per_sm, 1)
        _SLOTS[key] = slots
    return slots


def uses_tensor_cores(q: torch.Tensor) -> bool:
    """Whether ``kvcache_forward`` runs the tensor-core split kernel for q: fp16 or bf16 with head_dim <= 128,
    on a CUDA device of compute capability 8.0 or newer or under numba's simulator (where ``mma.py`` emulates
    the instructions); the SIMT kernel otherwise (fp32, head_dim > 128, older GPUs). A capability and shape
    rule only: neither kernel stands in for the other after an error."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > TC_MAX_HEAD_DIM:
        return False
    return simulated() or (q.device.type == "cuda" and capability(q.device) >= MIN_COMPUTE_CAPABILITY)


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _no_index(device: torch.device) -> torch.Tensor:
    """The argument of an index tensor a kernel does not read: one int32 zero on ``device``, made once."""
    zero = _ZEROS.get(device)
    if zero is None:
        zero = _ZEROS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return zero


def _index(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if t is None:
        return _no_index(device)
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _cache_view(t: torch.Tensor) -> torch.Tensor:
    """The kernel's view of a K or V cache (``launch`` passes it as ``flat_view`` of it): fp16 as its int16 bit
    patterns (the plain loads move bits into the 32-bit words of the shared tiles), bf16 too (``flat_view``)."""
    return t.view(torch.int16) if t.dtype == torch.float16 else t


def _index_tensors(spec: AttentionSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The split kernel's index arguments 5 .. 9 (block table, cache_seqlens, cache_leftpad, cache_batch_idx,
    cu_seqlens_q), each as the kernel reads it (int32, contiguous) or ``_no_index`` where absent."""
    return (
        spec.block_table if spec.paged else _no_index(device),
        _index(spec.cache_seqlens, device),
        _index(spec.cache_leftpad, device),
        _index(spec.cache_batch_idx, device),
        _index(spec.cu_seqlens_q, device),
    )


def _varying(spec: AttentionSpec, slopes_at: int, sink_at: int) -> tuple[int, ...]:
    """The split kernel's arguments that change within a ``launch.prepare`` class: q, k, v, the outputs, the
    index tensors the spec has (``_index_tensors``' positions 5 .. 9), the slopes (at ``slopes_at``) and the
    sink (at ``sink_at``, the last)."""
    present = (spec.paged, True, spec.cache_leftpad is not None, spec.cache_batch_idx is not None, spec.varlen)
    indices = tuple(5 + i for i, there in enumerate(present) if there)
    slopes = (slopes_at,) if spec.alibi_slopes is not None else ()
    return (0, 1, 2, 3, 4, *indices, *slopes, *((sink_at,) if spec.sink is not None else ()))


def _varying_tensors(spec: AttentionSpec, index_tensors: tuple) -> tuple[torch.Tensor, ...]:
    """The tensors of a call at ``_varying``'s positions after the five of q, k, v and the outputs."""
    present = (spec.paged, True, spec.cache_leftpad is not None, spec.cache_batch_idx is not None, spec.varlen)
    slopes = (spec.alibi_slopes,) if spec.alibi_slopes is not None else ()
    sink = (spec.sink,) if spec.sink is not None else ()
    return (*(t for t, there in zip(index_tensors, present) if there), *slopes, *sink)


def _class_key(q, k_cache, v_cache, spec, config) -> tuple:
    """A ``launch.prepare`` class of kvcache_forward calls: everything the kernels, their grids and their
    arguments other than the tensors' memory are functions of (shapes, strides, dtypes, the device, the caches'
    16 B alignment for cp.async, the spec's values and its index tensors' layouts, the config)."""

    def layout(t):
        return None if t is None else (t.shape, t.stride(), t.dtype)

    return (
        layout(q),
        layout(k_cache),
        layout(v_cache),
        q.device,
        (k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0,
        spec_class(spec),
        spec.num_splits,
        layout(spec.block_table),
        layout(spec.cache_seqlens),
        layout(spec.cache_leftpad),
        layout(spec.cache_batch_idx),
        layout(spec.cu_seqlens_q),
        None if config is None else tuple(config),
    )


class _Plan(NamedTuple):
    """A class's prepared launches: the split kernel's, and with splits the combine's and the partial
    results' shape (num_splits, rows_total, head_dim)."""

    split: object
    combine: object | None
    parts: tuple[int, int, int] | None


# Prepared launches by class of call (``_class_key``).
_PREPARED: dict[tuple, _Plan] = {}


def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spec: AttentionSpec,
    config: kvcache_simt.DecodeConfig | kvcache_tc.TensorCoreDecodeConfig | None = None,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments:
        q: (batch, heads, seqlen_q, head_dim), any strides; with spec.cu_seqlens_q (packed queries) (1, heads,
            total_q, head_dim), sequence b's queries [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (at most
            spec.max_seqlen_q). fp32, fp16 or bf16; CUDA tensors, or CPU tensors under numba's simulator.
        k_cache, v_cache: q's dtype, any strides. Contiguous (spec.block_table None): (batch_cache, heads_k,
            seqlen_cache, head_dim), row b of q reading cache row spec.cache_batch_idx[b] (default b). Paged:
            (num_pages, heads_k, page_size, head_dim), key j of row b at row j % page_size of page
            spec.block_table[b, j // page_size]. heads a multiple of heads_k (GQA; 1 is MQA).
        spec: ``fa2.spec.AttentionSpec`` with cache_seqlens ((batch,) int32, K_b: row b attends to keys
            [cache_leftpad[b] or 0, K_b) of its cache); scale, window (aligned on K_b: query i of Nq_b sees
            key j iff i + K_b - Nq_b - left <= j <= i + K_b - Nq_b + right, -1 unbounded), softcap,
            alibi_slopes ((batch, heads) fp32, -slope · |i + K_b - Nq_b - j|), group, sink ((heads,) fp32:
            attention sinks, one more logit in every row's denominator), num_splits (0: picked by
            ``num_splits_heuristic``; 1: one pass, no combine). Causal, Nq_b = 2, K_b = 5, leftpad 1::

                0 1 1 1 0
                0 1 1 1 1

        config: the block shape, for tuning; default ``kvcache_simt.decode_config(...)`` (a ``DecodeConfig``),
            or for the tensor-core kernel ``kvcache_tc.tc_decode_config(...)`` (a ``TensorCoreDecodeConfig``).
        tensor_cores: which split kernel. None: the tensor-core kernel for fp16 and bf16 with head_dim <= 128
            on compute capability 8.0+ or under numba's simulator (``uses_tensor_cores``), the SIMT kernel
            otherwise (fp32, head_dim > 128, older GPUs); True or False forces one (an input the forced kernel
            cannot take is an error). Neither falls back to the other.

    Returns:
        O: q's shape and dtype. L: (batch, heads, seqlen_q) (packed: (1, heads, total_q)), float32, natural
        log of the sum of exp of the final (capped, biased) scores (and of the sink); rows that see no key: O = 0,
        L = +inf (L = sink[h] with a sink).
        One launch of the split-KV kernel, one of the combine when there are splits; no host sync.

    Raises:
        NotImplementedError: head_dim above 256; with tensor_cores=True, an fp32 q, head_dim above 128 or a GPU
            older than compute capability 8.0.
        ValueError: q and the caches of different dtypes, or tensors on the wrong device for the mode.
    """
    key = None
    if launch.FAST:  # a call of a class met before: the kernels' parameters are packed, only pointers change
        key = (_class_key(q, k_cache, v_cache, spec, config), tensor_cores)
        plan = _PREPARED.get(key)
        if plan is not None:
            O = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            L = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            varying = _varying_tensors(spec, _index_tensors(spec, q.device))
            if plan.combine is None:
                plan.split(q, k_cache, v_cache, O, L, *varying)
            else:
                o_out = torch.empty(plan.parts, dtype=torch.float32, device=q.device)
                lse_out = torch.empty(plan.parts[:2], dtype=torch.float32, device=q.device)
                plan.split(q, k_cache, v_cache, o_out, lse_out, *varying)
                plan.combine(o_out, lse_out, O, L, *((spec.sink,) if spec.sink is not None else ()))
            return O, L
    batch_q, heads, seqlen_rows, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"fa2-numba-cuda's KV-cache path supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype of float32, float16, bfloat16, got {q.dtype}, "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    check_device(q)
    device = q.device
    if tensor_cores is None:
        tensor_cores = uses_tensor_cores(q)
    elif tensor_cores:
        if q.dtype not in (torch.float16, torch.bfloat16) or head_dim > TC_MAX_HEAD_DIM:
            raise NotImplementedError(
                f"fa2-numba-cuda's tensor-core KV-cache kernel takes fp16 or bf16 with head_dim "
                f"up to {TC_MAX_HEAD_DIM}, got {q.dtype} with head_dim {head_dim}"
            )
        if not simulated() and capability(device) < MIN_COMPUTE_CAPABILITY:
            raise NotImplementedError(
                f"fa2-numba-cuda's tensor-core KV-cache kernel needs compute capability 8.0 or "
                f"newer, got {capability(device)} on {device}"
            )
    O = torch.empty(q.shape, dtype=q.dtype, device=device)
    L = torch.empty(q.shape[:3], dtype=torch.float32, device=device)
    heads_k = k_cache.shape[1]
    group = heads // heads_k
    if spec.varlen:
        batch, seqlen_q = spec.cu_seqlens_q.numel() - 1, spec.max_seqlen_q
    else:
        batch, seqlen_q = batch_q, seqlen_rows
    page_size = k_cache.shape[2]
    capacity = spec.block_table.shape[1] * page_size if spec.paged else k_cache.shape[2]
    if O.numel() == 0 or batch * seqlen_q == 0:
        return O, L
    if k_cache.numel() == 0:  # nothing to attend to: every row sees no key
        return O.zero_(), L.fill_(math.inf)

    kind = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype]
    element_size = q.element_size()
    HEAD_DIM = padded_head_dim(head_dim)
    rows = group * seqlen_q
    if tensor_cores:
        config = (
            kvcache_tc.TensorCoreDecodeConfig(*config) if config is not None else kvcache_tc.tc_decode_config(HEAD_DIM)
        )
        block_m, block_n, threads = 16, 16 * config.NUM_WARPS, 32 * config.NUM_WARPS
        shared = kvcache_tc.shared_bytes(HEAD_DIM, config)
    else:
        config = (
            kvcache_simt.DecodeConfig(*config)
            if config is not None
            else kvcache_simt.decode_config(HEAD_DIM, element_size, rows)
        )
        block_m, block_n, threads = config.BLOCK_M, config.BLOCK_N, kvcache_simt.NUM_THREADS
        shared = kvcache_simt.shared_bytes(HEAD_DIM, element_size, config)
    num_m_tiles = -(-rows // block_m)
    blocks = num_m_tiles * batch * heads_k
    tiles = -(-capacity // block_n)
    num_splits = spec.num_splits
    if num_splits == 0:
        slots = block_slots(device, threads, config.MAX_REGISTERS, shared)
        shape = (blocks, slots, -(-tiles // MIN_SPLIT_TILES))
        num_splits = _SPLITS.get(shape)
        if num_splits is None:  # a loop over up to MAX_SPLITS counts: computed once per shape
            num_splits = _SPLITS[shape] = num_splits_heuristic(*shape)
    # Ranges of whole tiles; as many splits as hold a key of the capacity (at least one).
    split_keys = -(-max(tiles, 1) // num_splits) * block_n
    num_splits = max(1, -(-capacity // split_keys))
    split = num_splits > 1
    rows_total = L.numel()

    async_loads = rows_16b_aligned(k_cache) and rows_16b_aligned(v_cache)
    # The sink joins each row once: in the split kernel without splits, else in the combine.
    sink = spec.sink is not None
    switches = (
        *features(spec),
        spec.paged,
        spec.cache_batch_idx is not None,
        spec.cache_leftpad is not None,
        split,
        sink and not split,
    )
    # The page size is compiled in (one kernel per page size met): the loader's divisions by it are shifts or
    # multiplies, not a division a key row.
    paging = page_size if spec.paged else 0
    if tensor_cores:
        kernel = kvcache_tc.kernel(
            HEAD_DIM, config, *switches, kind == "bf16", head_dim == HEAD_DIM, async_loads, paging
        )
    else:
        kernel = kvcache_simt.kernel(HEAD_DIM, config, *switches, kind, head_dim == HEAD_DIM, async_loads, paging)
    if split:
        o_out = torch.empty(num_splits, rows_total, head_dim, dtype=torch.float32, device=device)
        lse_out = torch.empty(num_splits, rows_total, dtype=torch.float32, device=device)
    else:
        o_out, lse_out = O, L
    table_strides = spec.block_table.stride() if spec.paged else (0, 0)
    head = (
        _cache_view(q) if tensor_cores else q,
        _cache_view(k_cache),
        _cache_view(v_cache),
        o_out,
        lse_out,
        *_index_tensors(spec, device),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *table_strides,
        heads,
        heads_k,
        group,
        seqlen_q,
        seqlen_rows,
        capacity,
        k_cache.shape[0],
        head_dim,
        np.float32(score_scale(spec)),
        num_m_tiles,
        num_splits,
        split_keys,
        rows_total,
    )
    sink_flat = sink_arg(spec, device)
    args = (*head, *feature_args(spec, seqlen_q, capacity, device), sink_flat)
    # Each launch is numba's the first time a class is met, then prepared (``launch.prepare``).
    varying = _varying(spec, len(head) + 3, len(args) - 1)
    dynamic = kvcache_tc.dynamic_shared_bytes(HEAD_DIM, config) if tensor_cores else 0
    split_launch = launch.prepare(kernel, blocks * num_splits, threads, device, args, varying, dynamic)
    combine_launch = None
    if split:
        combine_launch = launch.prepare(
            kvcache_combine.kernel(q.dtype == torch.bfloat16, sink, head_dim),
            -(-rows_total // kvcache_combine.ROWS),
            kvcache_combine.NUM_THREADS,
            device,
            (o_out, lse_out, O, L, num_splits, rows_total, head_dim, sink_flat, heads, seqlen_rows),
            (0, 1, 2, 3, *((7,) if sink else ())),
        )
    if key is not None and split_launch is not None and (combine_launch is not None or not split):
        _PREPARED[key] = _Plan(split_launch, combine_launch, tuple(o_out.shape) if split else None)
    return O, L


def kernel_resources() -> list[dict]:
    """Registers and local memory per thread, static shared memory per block, of every decode split kernel
    compiled so far in this process (one row per specialisation: the SIMT kernel's with "kernel": "kvcache",
    then the tensor-core kernel's, "kvcache-tensor-core"); empty under the simulator."""
    return kvcache_simt.kernel_resources() + kvcache_tc.kernel_resources()
