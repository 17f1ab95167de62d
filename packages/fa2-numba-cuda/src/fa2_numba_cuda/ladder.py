"""fa2-numba-cuda's optimisation ladder (issue 43): the steps from the CUDA-core kernel to the default one.

Each rung is a configuration of the real kernels, never a copy of one: ``forward_simt`` and ``backward_simt``
for the first, then ``forward_tc`` and ``backward_tc`` with a ``TensorCoreConfig`` and a
``TensorCoreBwdConfig`` (their tiles and the switches LDMATRIX and CP_ASYNC), ``launch.FAST`` (prepared
launches) for the eighth, and for the last ``forward_wgmma`` and ``backward_wgmma`` (warpgroup MMA) where their
``uses_wgmma`` takes the inputs, as ``fa2_numba_cuda.flash_attn_forward`` and ``flash_attn_backward`` run them
(on compute capability 9.0, dense fp16 and bf16 at head_dim 64 and 128), the eighth rung's kernels elsewhere.
Each rung changes one lever of the one before; where a lever is forward-only, or taken only on some inputs,
the rest is the previous rung's, and the rung's ``lever`` says so. ``RUNGS[-1]`` is the default path of
``fa2_numba_cuda.flash_attn_forward`` and ``flash_attn_backward`` for fp16 and bf16 with head_dim <= 128 on a
GPU of compute capability 8.0+ (the same kernels and configurations, bit-identical outputs). The rungs, and
what each should change on Hopper, are explained in docs/ladder/numba-cuda.md; ``fa2.bench``'s ladder times
them.

Under numba's CUDA simulator every rung runs (the tensor-core ones on ``mma.py``'s emulated instructions) on
CPU tensors, slowly: for tests on tiny shapes. ``launch.FAST`` is off there, and ``uses_wgmma`` never holds
(the default path does not run the wgmma kernels in the simulator), so the last three rungs are the same calls
in the simulator.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from fa2.spec import AttentionSpec
from fa2_numba_cuda import (
    backward_simt,
    backward_tc,
    backward_wgmma,
    common,
    forward_simt,
    forward_tc,
    forward_wgmma,
    launch,
)
from fa2_numba_cuda.backward_tc import TensorCoreBwdConfig, max_shared_bytes, tc_bwd_config
from fa2_numba_cuda.backward_wgmma import WgmmaBwdConfig, bwd_config
from fa2_numba_cuda.forward_tc import TensorCoreConfig, tc_config
from fa2_numba_cuda.forward_wgmma import WgmmaConfig, wgmma_config
from fa2_numba_cuda.tensor_cores import padded_head_dim


class Rung(NamedTuple):
    name: str  # short id, in CSV rows and test ids
    title: str  # one line, for the plot legend and the docs' heading
    lever: str  # what this rung changes relative to the previous one


RUNGS: tuple[Rung, ...] = (
    Rung(
        "simt",
        "SIMT: CUDA cores, fp32",
        "The starting point: one block per query tile, fp32 FMAs on CUDA cores, tiles in shared memory by plain "
        "loads, exp2 with the scale folded into Q, numba's own launch (forward_simt, backward_simt).",
    ),
    Rung(
        "mma",
        "mma.sync tensor cores",
        "Both matrix products on tensor cores (mma.sync m16n8k16 through inline PTX, fp32 accumulators), P kept "
        "in registers between them; fragments by plain shared loads, plain global loads, 4 warps x 64 keys "
        "(backward: dK/dV 4 warps x 16 queries, dQ 4 warps x 32 keys).",
    ),
    Rung(
        "ldmatrix",
        "ldmatrix fragment loads",
        "Fragments of Q, K, V (backward: also dO) from shared memory by one ldmatrix.x4 (.trans for V) per "
        "four 8x8 matrices, instead of each lane's own shared loads; forward and backward.",
    ),
    Rung(
        "cp-async",
        "cp.async double buffering",
        "Tiles copied global -> shared by cp.async (16 B a thread, no registers), the next tile's copy in "
        "flight during this tile's products; forward and backward.",
    ),
    Rung(
        "tiles",
        "tile table",
        "The tile table's blocks: forward 8 warps (128 queries) x 64 keys; backward tc_bwd_config's tiles "
        "(D64: dK/dV 64-query tiles; D128: 8 warps x 64 queries, K and V in dynamic shared memory).",
    ),
    Rung(
        "maxnreg",
        "register cap",
        "Forward at head dim <= 64: ptxas capped at 128 registers, so that two blocks share an SM (at D128 the "
        "same kernel as the previous rung); backward as the previous rung.",
    ),
    Rung(
        "s-ahead",
        "S of the next tile during the softmax",
        "Forward at head dim > 64: each warp computes S of the next key tile interleaved with this tile's "
        "exponentials (S_AHEAD), so tensor-core and FP32 work issue side by side (at D64 the same kernel as "
        "the previous rung); backward as the previous rung.",
    ),
    Rung(
        "prepared",
        "prepared launches",
        "Later calls of a class skip numba's dispatch: packed parameters, only the data pointers rewritten, one "
        "cuLaunchKernel (host time only; kernels as the previous rung); forward and backward. The default path "
        "but on Hopper at head dim 64 and 128 (the next rung).",
    ),
    Rung(
        "wgmma",
        "wgmma: warpgroup MMA (Hopper)",
        "On compute capability 9.0, dense fp16 and bf16 at head dim 64 and 128 (where forward_wgmma.uses_wgmma and "
        "backward_wgmma.uses_wgmma take the inputs): both products as asynchronous wgmma.mma_async, two "
        "warpgroups x 64 rows a block, operands read from 128 B swizzled shared memory through descriptors "
        "(forward_wgmma: 128 queries x 64 keys, 96 at D64; backward_wgmma: dK/dV 128 keys x 64 queries, 96 at D64 "
        "without a mask, dQ 128 queries x 128 keys at D64, 96 at D128: bwd_config); prepared launches. Elsewhere "
        "(other GPUs and head dims, the simulator) "
        "the previous rung. The default path.",
    ),
)

_NAMES = tuple(r.name for r in RUNGS)

# The first tensor-core rung's blocks: FA2's usual 4 warps x 64 keys forward; the backward's first tiles
# (docs/notes/numba-tc-backward.md), V's tile in shared memory.
_FIRST_TC = TensorCoreConfig(4, 64, 0, False, LDMATRIX=False, CP_ASYNC=False)
_FIRST_TC_BWD = TensorCoreBwdConfig(4, 16, 4, 32, 0, True, LDMATRIX=False, CP_ASYNC=False)


def _forward_config(rung: str, HEAD_DIM: int) -> TensorCoreConfig | None:
    """The tensor-core forward's configuration at a rung (None: the kernel's default, ``tc_config``)."""
    table = tc_config(HEAD_DIM)
    # side-by-side: configs
    return {
        "mma": _FIRST_TC,
        "ldmatrix": _FIRST_TC._replace(LDMATRIX=True),
        "cp-async": _FIRST_TC._replace(LDMATRIX=True, CP_ASYNC=True),
        "tiles": table._replace(MAX_REGISTERS=0, S_AHEAD=False),
        "maxnreg": table._replace(S_AHEAD=False),
        "s-ahead": table,
        "prepared": None,
        "wgmma": None,
    }[rung]
    # side-by-side: end


def _backward_config(rung: str, HEAD_DIM: int, device: torch.device) -> TensorCoreBwdConfig | None:
    """The tensor-core backward's configuration at a rung (None: the kernels' default, ``tc_bwd_config``)."""
    if rung == "mma":
        return _FIRST_TC_BWD
    if rung == "ldmatrix":
        return _FIRST_TC_BWD._replace(LDMATRIX=True)
    if rung == "cp-async":
        return _FIRST_TC_BWD._replace(LDMATRIX=True, CP_ASYNC=True)
    if rung in ("prepared", "wgmma"):
        return None
    return tc_bwd_config(HEAD_DIM, max_shared_bytes(device))


# What each rung ran in this process, for ``resources``: (direction, head_dim, the kernels' configuration, None
# for the SIMT kernels, and the wgmma backward's dQ configuration where its dQ kernel is backward_tc's, else None).
_RAN: dict[str, set[tuple]] = {name: set() for name in _NAMES}


@contextlib.contextmanager
def _launches(rung: str):
    """Prepared launches (``launch.FAST``) on the last two rungs only; numba's own launch below them."""
    saved = launch.FAST
    launch.FAST = saved and _NAMES.index(rung) >= _NAMES.index("prepared")
    try:
        yield
    finally:
        launch.FAST = saved


def _check(rung: str, spec: AttentionSpec) -> None:
    """That rung is a rung and spec the ladder's dense attention."""
    if rung not in _NAMES:
        raise ValueError(f"fa2-numba-cuda's ladder has the rungs {', '.join(_NAMES)}, got {rung!r}")
    if spec.softcap or spec.alibi_slopes is not None or spec.varlen or spec.sink is not None:
        raise NotImplementedError(
            "fa2-numba-cuda's ladder measures dense attention with a scale and causal or no mask, got a spec "
            f"with softcap {spec.softcap}, alibi_slopes {spec.alibi_slopes is not None}, varlen {spec.varlen}, "
            f"sink {spec.sink is not None}"
        )


def forward(
    rung: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arguments: rung, a name in ``RUNGS``; q, k, v: (batch, heads, seqlen, head_dim), fp16 or bf16 (the SIMT
    rung also fp32), CUDA tensors (CPU under the simulator); spec: scale and causal or no window.

    Returns: (O, L) as ``fa2_numba_cuda.flash_attn_forward``, from the rung's kernel."""
    _check(rung, spec)
    head_dim = q.shape[-1]
    with _launches(rung):
        if rung == "simt":
            _RAN[rung].add(("forward", head_dim, None, None))
            return forward_simt.flash_attn_forward(q, k, v, spec)
        # side-by-side: ladder-wgmma
        if rung == "wgmma" and forward_wgmma.uses_wgmma(q, k, v, spec):
            _RAN[rung].add(("forward", head_dim, wgmma_config(head_dim), None))
            return forward_wgmma.flash_attn_forward(q, k, v, spec)
        # side-by-side: end
        HEAD_DIM = padded_head_dim(head_dim)
        config = _forward_config(rung, HEAD_DIM)
        _RAN[rung].add(("forward", head_dim, config or tc_config(HEAD_DIM), None))
        return forward_tc.flash_attn_forward(q, k, v, spec, config)


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
    """Arguments: as ``forward``, and O, L, dO as ``fa2_numba_cuda.flash_attn_backward`` takes them.

    Returns: (dq, dk, dv) as ``fa2_numba_cuda.flash_attn_backward``, from the rung's kernels."""
    _check(rung, spec)
    head_dim = q.shape[-1]
    with _launches(rung):
        if rung == "simt":
            _RAN[rung].add(("backward", head_dim, None, None))
            return tuple(backward_simt.flash_attn_backward(q, k, v, O, L, dO, spec)[:3])
        if rung == "wgmma" and backward_wgmma.uses_wgmma(q, k, v, dO, spec):
            config = bwd_config(head_dim, spec.softcap > 0, spec.masked)
            _RAN[rung].add(("backward", head_dim, config, backward_wgmma.tc_dq_config(config, head_dim, q.device)))
            # The config recorded is the one run: passed, not worked out again inside.
            return tuple(backward_wgmma.flash_attn_backward(q, k, v, O, L, dO, spec, config)[:3])
        HEAD_DIM = padded_head_dim(head_dim)
        config = _backward_config(rung, HEAD_DIM, q.device)
        _RAN[rung].add(("backward", head_dim, config or tc_bwd_config(HEAD_DIM, max_shared_bytes(q.device)), None))
        return tuple(backward_tc.flash_attn_backward(q, k, v, O, L, dO, spec, config)[:3])


def _same_config(row: dict, config: NamedTuple) -> bool:
    """Whether a kernel_resources row was compiled for config (a backward kernel's row leaves the other
    kernel's fields None)."""
    return all(row.get(f) is None or row[f] == value for f, value in config._asdict().items())


def resources(rung: str) -> list[dict]:
    """Per kernel compiled for this rung's calls in this process (every head dim it ran), the kernel's own
    ``kernel_resources`` row with "direction" ("forward" or "backward"), "spilled_bytes" (local memory per
    thread) and "shared_bytes" (static and dynamic per block) added; the backward's tensor-core and wgmma rows
    come with the SIMT preprocess's rows (the wgmma ones with backward_tc's dQ kernel's row where their
    configuration runs it).
    Empty under the simulator."""
    if rung not in _NAMES:
        raise ValueError(f"fa2-numba-cuda's ladder has the rungs {', '.join(_NAMES)}, got {rung!r}")
    rows = []
    simt = {"forward": forward_simt.kernel_resources(), "backward": backward_simt.kernel_resources()}
    tc = {"forward": forward_tc.kernel_resources(), "backward": backward_tc.kernel_resources()}
    wg = {"forward": forward_wgmma.kernel_resources(), "backward": backward_wgmma.kernel_resources()}
    for direction, head_dim, config, dq_config in sorted(_RAN[rung], key=repr):
        # The SIMT kernels (the preprocess too) pad the head dim to 32 columns, the tensor-core ones to 16; the
        # wgmma ones take 64 and 128 only, unpadded.
        simt_dim = common.padded_head_dim(head_dim)
        tc_dim = padded_head_dim(head_dim)
        if config is None:
            found = [r for r in simt[direction] if r["HEAD_DIM"] == simt_dim]
        else:
            if isinstance(config, (WgmmaConfig, WgmmaBwdConfig)):
                found = [r for r in wg[direction] if r["HEAD_DIM"] == head_dim and _same_config(r, config)]
            else:
                found = [r for r in tc[direction] if r["HEAD_DIM"] == tc_dim and _same_config(r, config)]
            if dq_config is not None:
                found += [
                    r
                    for r in tc[direction]
                    if r["kernel"] == "tensor-core dq" and r["HEAD_DIM"] == tc_dim and _same_config(r, dq_config)
                ]
            if direction == "backward":
                found += [r for r in simt[direction] if r["kernel"] == "preprocess" and r["HEAD_DIM"] == simt_dim]
        for r in found:
            rows.append(
                {
                    **r,
                    "direction": direction,
                    "spilled_bytes": r["local_bytes_per_thread"],
                    # The wgmma forward's row gives only its dynamic shared memory (its kernel has no static).
                    "shared_bytes": r.get("shared_bytes_per_block", 0) + r.get("dynamic_shared_bytes_per_block", 0),
                }
            )
    return rows
