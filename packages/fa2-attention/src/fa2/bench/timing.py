"""Clocks: ``triton.testing.do_bench`` on a GPU, ``time.perf_counter`` on the CPU; peak memory; ceilings (a
matmul's TFLOP/s; for --decode a device-to-device copy's bytes per second).

GPU: median of do_bench (warm-up 25 ms, then 100 ms of repetitions; it flushes the L2 cache before each),
taken in ``GPU_ROUNDS`` rounds over the providers of a shape, every other round in reverse order; a provider's
time is the median of its rounds, so one slow stretch of the machine (a host hiccup, a clock dip) in one
round does not decide a ratio, and no provider always runs right after the same other one.
CPU (emulated runs): the correctness call has warmed the provider up; then the median of as many calls as
fit in ``CPU_BUDGET_S`` (at least one, at most ``CPU_MAX_REPS``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

WARMUP_MS = 25
REP_MS = 100
CPU_BUDGET_S = 1.0
CPU_MAX_REPS = 10
GPU_ROUNDS = 3
CEILING_SIZE = {"cuda": 8192, "cpu": 1024}
# The copy ceiling's tensor, in bytes: far beyond the H200's 60 MB of L2, so that the copy runs from memory.
COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            f"median of {GPU_ROUNDS} rounds (providers interleaved, every other round reversed) of "
            f"triton.testing.do_bench median, warmup {WARMUP_MS} ms, rep {REP_MS} ms"
        )
    return (
        f"time.perf_counter median of up to {CPU_MAX_REPS} calls within {CPU_BUDGET_S} s after one warm-up "
        f"call, {torch.get_num_threads()} CPU thread(s)"
    )


def rounds(device: torch.device) -> int:
    """How many times each provider of a shape is timed; the emulated run's CPU clock takes its own median."""
    return GPU_ROUNDS if device.type == "cuda" else 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_once(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """fn's result and its wall time in seconds."""
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def median_ms(fn: Callable[[], object], device: torch.device, first_s: float) -> float:
    """fn's median time in milliseconds; ``first_s``: how long its warm-up call took."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    reps = max(1, min(CPU_MAX_REPS, int(CPU_BUDGET_S / max(first_s, 1e-9))))
    return 1e3 * statistics.median(timed_once(fn, device)[1] for _ in range(reps))


def peak_mem_gb(fn: Callable[[], object], device: torch.device) -> float | None:
    """The most memory one call allocates beyond what was live before it (its outputs included), in
    GB (1e9 bytes); None off CUDA, where PyTorch keeps no such count."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak / 1e9


def matmul_ceilings(device: torch.device) -> dict[str, float | int]:
    """TFLOP/s of one n×n×n matmul in bf16, in fp16 and in fp32 without TF32, timed as the attention calls are:
    each dtype's plots draw their own (a GPU's fp16 and bf16 peaks need not be equal, nor a CPU's)."""
    n = CEILING_SIZE[device.type]
    out: dict[str, float | int] = {"matmul_size": n}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32: no TF32
    try:
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
            out[f"{name}_matmul_tflops"] = _matmul_tflops(n, dtype, device)
    finally:
        torch.set_float32_matmul_precision(precision)
    return out


def _matmul_tflops(n: int, dtype: torch.dtype, device: torch.device) -> float:
    """One n×n×n matmul's TFLOP/s; its inputs are freed on return, before the next dtype's are made."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def fn():
        return a @ b

    _, first_s = timed_once(fn, device)
    return 2 * n**3 / (median_ms(fn, device, first_s) * 1e-3) / 1e12


def copy_ceiling(device: torch.device) -> dict[str, float | int]:
    """A device-to-device copy (``dst.copy_(src)`` of COPY_BYTES of bf16) timed as the attention calls are:
    the bytes read plus the bytes written per second, in TB/s (1e12 bytes), the memory ceiling a decode
    step's K/V reads are measured against."""
    n = COPY_BYTES[device.type]
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def fn():
        return dst.copy_(src)

    _, first_s = timed_once(fn, device)
    seconds = median_ms(fn, device, first_s) * 1e-3
    return {"copy_bytes": n, "copy_tbps": 2 * n / seconds / 1e12}
