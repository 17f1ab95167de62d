"""``python -m fa2.bench.ring``: ``fa2.distributed.ring_attention`` on several GPUs (issue 25 item 4).

Causal attention over a sequence sharded in the zig-zag layout, one process a GPU over NCCL (gloo and the CPU
without a GPU), for each world size of ``--worlds`` at a fixed number of tokens per GPU (weak scaling: the
whole sequence grows with the world). Per (world, tokens per GPU, provider, mode):

- ``ms``: the median over ``--repeats`` of the slowest rank's time (each repeat: a barrier, the device
  synchronised, the call, synchronised again; the max over the ranks), after ``--warmups`` calls. Mode
  ``fwd``: the forward, inputs without grad; mode ``bwd``: the backward alone,
  ``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` after one forward (as ``python -m fa2.bench``).
- ``tflops_per_gpu``: causal FLOPs, 4·B·H·N²·D / 2 for the forward and 2.5 times that for the backward, N
  the whole sequence, divided by the world and by ``ms``.
- The report's weak-scaling efficiency: TFLOP/s per GPU over the same provider's at world 1 and the same
  tokens per GPU.
- Provider ``comm`` (no attention): the ring's transfers alone, as ``ring_attention`` makes them, through
  ``torch.distributed.batch_isend_irecv``: mode ``fwd`` world − 1 exchanges of the rank's stacked K/V shard
  (send to rank + 1, receive from rank − 1, wait); mode ``bwd`` world − 1 of the K/V shard and world of its
  float32 dK/dV partials. ``gbps``: bytes each rank sends per second. Set against the fa2 rows' ``ms``,
  it shows how much transfer the compute has to hide.

Providers (``--providers``): ``fa2`` (``ring_attention`` on each backend of ``--backends``: ``fa2-<backend>``
rows); ``torch-cp`` and ``torch-cp-cudnn``: PyTorch's context parallelism
(``torch.distributed.tensor.experimental.context_parallel``, its ring over SDPA, with its head-tail load
balancer, which is fa2's zig-zag layout, so both take the same shards), SDPA forced to its FlashAttention-2
kernel or to cuDNN's, K/V rotated by ``--torch-cp-rotate`` (``alltoall``: a shard a step, a ring;
``allgather``: PyTorch's default, every shard gathered once). A provider that cannot run here (torch-cp on
the CPU: its ring handles the CUDA SDPA kernels only) is recorded as skipped with the exception's message.

Correctness before timing, where the whole sequence has at most ``--check-limit`` tokens (default 128k): the
ranks' O, L, dq, dk, dv (torch-cp: no L) are gathered, unsharded, and checked on rank 0 against the fp64
reference on a sample of rows by ``fa2.bench.check``'s rule (O, L, dq; dk and dv finite), and the fa2 rows
also against single-device ``fa2.attention`` on the whole sequence, same backend: O, L and dq within the
same tolerances, dk and dv within ``DKV_ULPS`` units of the dtype's rounding at their largest magnitude
(fp32: ``check.FP32_GRAD_ATOL``); the whole sequence's fp64 dk and dv are out of reach at 128k (every query
row's softmax), which is why check.py checks them for NaN and inf only. A provider that fails is not timed at
that point and is recorded in the skipped file with the errors. Longer sequences are timed unchecked (the
CSV's ``checked``).

Inputs: batch ``--batch`` (1), ``--heads`` query and key/value heads, ``--head-dim``, standard normal; the
sequence is cut into chunks of half a rank's shard and chunk c drawn from its own seed, so each rank makes
only its two chunks (a million tokens is 8 GB a tensor in bf16) and rank 0 the whole sequence to check it.

Launch: the command starts one process per rank itself, ``torch.multiprocessing.spawn`` per world size
(a group from a file store in a temporary folder; ``torch.cuda.set_device(rank)``), so one call on one host
runs every world; rank 0 writes the rows as they are measured. A world whose process dies (a rank out of
memory leaves the others waiting in the ring until ``COLLECTIVE_TIMEOUT_S``) is recorded as failed for the
points it did not measure, and the next world runs. Several hosts are out of scope.

    python -m fa2.bench.ring                                  # GPU: worlds 1, 2, 4, 8 (up to the GPU count)
    python -m fa2.bench.ring --worlds 1,2,4 --tokens-per-gpu 16384,65536
    python -m fa2.bench.ring --worlds 8 --append              # a run in parts, into the same files

Without a GPU: EMULATED on the CPU, worlds 1 and 2 on gloo, fa2-pytorch, fp32, tiny shapes: the harness runs
and the ring agrees with one device; the times say nothing about GPU speed.

Files, under ``--out`` (default the checkout's docs/benchmarks), named ``<gpu>-ring`` (``h200-ring``,
``cpu-emulated-ring``):

    <name>.csv           a row per measured (world, tokens per GPU, provider, mode): COLUMNS
    <name>-skipped.csv   every one not measured, with the reason
    <name>-run.json      per run (several with --append): environment, command, world sizes, wall time
    <name>.md            weak scaling (TFLOP/s per GPU, efficiency), communication alone, fa2 against torch-cp
    <name>.png           TFLOP/s per GPU against the world size, a line per (provider, tokens per GPU)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fa2 import registry
from fa2.bench import check
from fa2.bench.__main__ import EMULATION
from fa2.bench.output import (
    comma_list,
    default_name,
    default_out,
    exception_reason,
    markdown_table,
    now_utc,
    positive_int,
    read_csv,
    read_runs,
    write_report,
)
from fa2.bench.report import EMULATED_TAG, seqlen_label
from fa2.bench.sweep import environment

MODES = ("fwd", "bwd")
TORCH_CP = {"torch-cp": "flash", "torch-cp-cudnn": "cudnn"}  # provider -> the SDPA kernel it forces
PROVIDERS = ("fa2", *TORCH_CP)
COMM = "comm"
ROTATE = ("alltoall", "allgather")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECK_LIMIT = 131072
DKV_ULPS = 4
COLLECTIVE_TIMEOUT_S = 900
SEED = 0


@dataclass(frozen=True)
class Defaults:
    tokens_per_gpu: tuple[int, ...]
    heads: int
    head_dim: int
    dtype: str
    backends: tuple[str, ...]
    providers: tuple[str, ...]
    warmups: int
    repeats: int


DEFAULTS = {
    "cuda": Defaults((16384, 32768, 65536, 131072), 32, 128, "bf16", ("triton",), PROVIDERS, 2, 5),
    # The emulated run: 2 ranks on 2 shared cores, fp32 where the CPU is quick and exact enough.
    "cpu": Defaults((32, 64), 4, 32, "fp32", ("pytorch",), ("fa2", "torch-cp"), 1, 3),
}

KEY = ("world", "tokens_per_gpu", "provider", "mode")
COLUMNS = (
    *KEY,
    "seqlen",
    "batch",
    "heads",
    "head_dim",
    "dtype",
    "layout",
    "ms",
    "ms_fastest_rank",
    "tflops_per_gpu",
    "gbps",
    "checked",
    "backend",
    "gpu",
    "torch",
    "triton",
    "numba_cuda",
    "commit",
    "timestamp",
)
ISSUE_COLUMNS = (*KEY, "status", "reason", "timestamp")
EMULATED_NOTE = (
    "EMULATED on the CPU: no GPU; the ranks are processes on gloo sharing a few CPU cores, tiny shapes in fp32. "
    "These numbers show that the harness runs and the ring agrees with one device; they say nothing about GPU "
    "speed or NCCL."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    gpu, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    parser = argparse.ArgumentParser(
        prog="python -m fa2.bench.ring",
        description="fa2.distributed.ring_attention on 1 to 8 GPUs of one host (NCCL, one process a GPU), causal, "
        "zig-zag: weak scaling, the ring's transfers alone, and PyTorch's context_parallel beside it. Without a "
        "GPU an emulated run on gloo.",
    )
    parser.add_argument(
        "--worlds",
        type=comma_list(int),
        help="world sizes, each a launch of that many processes; default 1,2,4,8 up to the GPU count (emulated: 1,2)",
    )
    parser.add_argument(
        "--tokens-per-gpu",
        type=comma_list(int),
        help=f"tokens of each rank's shard, even; default {','.join(map(str, gpu.tokens_per_gpu))} "
        f"(emulated {','.join(map(str, cpu.tokens_per_gpu))})",
    )
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument(
        "--heads", type=positive_int, help=f"query and key/value heads; default {gpu.heads} (emulated {cpu.heads})"
    )
    parser.add_argument("--head-dim", type=positive_int, help=f"default {gpu.head_dim} (emulated {cpu.head_dim})")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help=f"default {gpu.dtype} (emulated {cpu.dtype})")
    parser.add_argument(
        "--backends",
        type=comma_list(str, registry.KNOWN),
        help=f"fa2 backends the fa2 provider times; default {','.join(gpu.backends)} (emulated "
        f"{','.join(cpu.backends)})",
    )
    parser.add_argument(
        "--providers",
        type=comma_list(str, PROVIDERS),
        help=f"of {', '.join(PROVIDERS)}; default {','.join(gpu.providers)} (emulated {','.join(cpu.providers)}); "
        "the ring's transfers alone (comm) are timed whenever fa2 is",
    )
    parser.add_argument("--modes", type=comma_list(str, MODES), default=MODES, help="fwd, bwd (default both)")
    parser.add_argument("--torch-cp-rotate", choices=ROTATE, default="alltoall", help="torch-cp's K/V rotation")
    parser.add_argument(
        "--warmups", type=int, help=f"untimed calls first; default {gpu.warmups} (emulated {cpu.warmups})"
    )
    parser.add_argument(
        "--repeats", type=positive_int, help=f"timed calls; default {gpu.repeats} (emulated {cpu.repeats})"
    )
    parser.add_argument(
        "--check-limit",
        type=int,
        default=CHECK_LIMIT,
        help=f"check a point only where the whole sequence has at most this many tokens (default {CHECK_LIMIT})",
    )
    parser.add_argument("--out", type=Path, default=default_out(), help="folder of the results")
    parser.add_argument("--name", help="file stem; default <gpu>-ring (h200-ring), or cpu-emulated-ring")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the earlier rows of <name>.csv, replacing those measured again (a run in parts)",
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Config:
    worlds: tuple[int, ...]
    tokens_per_gpu: tuple[int, ...]
    batch: int
    heads: int
    head_dim: int
    dtype: str
    backends: tuple[str, ...]
    providers: tuple[str, ...]
    modes: tuple[str, ...]
    rotate: str
    warmups: int
    repeats: int
    check_limit: int
    device_type: str
    out_dir: Path
    name: str
    append: bool
    command: str

    @property
    def emulated(self) -> bool:
        return self.device_type != "cuda"

    def path(self, suffix: str) -> Path:
        return self.out_dir / f"{self.name}{suffix}"

    def provider_names(self) -> list[str]:
        """The CSV's providers: fa2-<backend> for each backend, the torch-cp ones, and comm with fa2."""
        names = []
        for p in self.providers:
            names += [f"fa2-{b}" for b in self.backends] if p == "fa2" else [p]
        return names + ([COMM] if "fa2" in self.providers else [])

    def keys(self, world: int) -> list[dict]:
        return [
            dict(world=world, tokens_per_gpu=t, provider=p, mode=m)
            for t in self.tokens_per_gpu
            for p in self.provider_names()
            for m in self.modes
        ]

    def planned(self) -> set[tuple[str, ...]]:
        """The KEY of every row this run may write (as the CSV's strings): what --append replaces."""
        return {tuple(str(key[c]) for c in KEY) for w in self.worlds for key in self.keys(w)}


class Records:
    """The two CSVs, written row by row into ``<name>.partial*`` (by the parent's launcher and rank 0 of each
    world) and moved over the earlier files by ``commit`` once anything was measured; --append keeps the
    earlier rows that this run does not measure again."""

    SUFFIXES = (".csv", "-skipped.csv")

    def __init__(self, cfg: Config, env: dict):
        self.cfg, self.env = cfg, env

    def start(self) -> None:
        """The partial files, with the earlier rows this run keeps (--append)."""
        self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
        planned = self.cfg.planned()
        for suffix, columns in zip(self.SUFFIXES, (COLUMNS, ISSUE_COLUMNS)):
            earlier = read_csv(self.cfg.path(suffix)) if self.cfg.append else []
            with self._partial(suffix).open("w", newline="") as f:
                writer = csv.DictWriter(f, columns)
                writer.writeheader()
                writer.writerows(r for r in earlier if tuple(r[c] for c in KEY) not in planned)

    def _partial(self, suffix: str) -> Path:
        return self.cfg.path(f".partial{suffix}")

    def result(self, row: dict) -> None:
        self._append(".csv", COLUMNS, {**row, **self.env, "timestamp": now_utc()})

    def issue(self, key: dict, status: str, reason: str) -> None:
        print(f"  world {key['world']} {key['tokens_per_gpu']}/GPU {key['provider']} {key['mode']}: {status}: {reason}")
        self._append("-skipped.csv", ISSUE_COLUMNS, {**key, "status": status, "reason": reason, "timestamp": now_utc()})

    def _append(self, suffix: str, columns: tuple[str, ...], row: dict) -> None:
        with self._partial(suffix).open("a", newline="") as f:
            csv.DictWriter(f, columns, extrasaction="ignore").writerow(row)

    def written(self) -> set[tuple[str, ...]]:
        """The KEY of every row and issue in the partial files."""
        return {tuple(r[c] for c in KEY) for suffix in self.SUFFIXES for r in read_csv(self._partial(suffix))}

    def measured(self) -> bool:
        """Whether this run wrote a row (not one kept from an earlier run)."""
        planned = self.cfg.planned()
        return any(tuple(r[c] for c in KEY) in planned for r in read_csv(self._partial(".csv")))

    def commit(self, measured: bool) -> None:
        if not measured:
            raise SystemExit(
                f"fa2.bench.ring: nothing was measured; {self.cfg.path('.csv')} is kept as it was, and "
                f"{self._partial('-skipped.csv')} says why"
            )
        for suffix in self.SUFFIXES:
            os.replace(self._partial(suffix), self.cfg.path(suffix))


# --- the workers: one process per rank ----------------------------------------------------------------------


def flops_per_gpu(batch: int, heads: int, seqlen: int, head_dim: int, world: int, mode: str) -> float:
    """Causal attention's FLOPs on the whole sequence, per GPU: 4·B·H·N²·D / 2, the backward 2.5 times that."""
    fwd = 4 * batch * heads * seqlen**2 * head_dim / 2
    return (2.5 * fwd if mode == "bwd" else fwd) / world


def chunk(cfg: Config, tokens_per_gpu: int, index: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Chunk ``index`` of the whole sequence (half a rank's shard): q, k, v, dO of (batch, heads,
    tokens_per_gpu / 2, head_dim), the same on every rank and in every world, from its own seed."""
    generator = torch.Generator(device).manual_seed(SEED * 1_000_003 + tokens_per_gpu * 4099 + index)
    shape = (cfg.batch, cfg.heads, tokens_per_gpu // 2, cfg.head_dim)
    return tuple(
        torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(DTYPES[cfg.dtype])
        for _ in range(4)
    )


def whole(cfg: Config, tokens_per_gpu: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v, dO: the 2·world chunks in order."""
    chunks = [chunk(cfg, tokens_per_gpu, c, device) for c in range(2 * world)]
    return tuple(torch.cat([c[i] for c in chunks], dim=-2) for i in range(4))


def local_shard(cfg: Config, tokens_per_gpu: int, rank: int, world: int, device: torch.device):
    """This rank's zig-zag shard of q, k, v, dO: chunks rank and 2·world − 1 − rank."""
    first, second = chunk(cfg, tokens_per_gpu, rank, device), chunk(cfg, tokens_per_gpu, 2 * world - 1 - rank, device)
    return tuple(torch.cat([a, b], dim=-2) for a, b in zip(first, second))


class Ring:
    """What a worker needs of its group: rank, world, device, and agreeing on failures."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def agree(self, error: str | None) -> str | None:
        """None if no rank had an error, else the error (which ranks had it, if not all; each rank's if they
        differ), on every rank."""
        import torch.distributed as dist

        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        if not failed:
            return None
        if len(set(failed.values())) == 1:
            return next(iter(failed.values())) + ("" if len(failed) == self.world else f" (ranks {sorted(failed)})")
        return "; ".join(f"rank {r}: {e}" for r, e in failed.items())

    def timed(self, fn, warmups: int, repeats: int) -> tuple[float, float]:
        """(the median over the repeats of the slowest rank's ms, the median of the fastest rank's)."""
        import torch.distributed as dist

        for _ in range(warmups):
            fn()
        slowest, fastest = [], []
        for _ in range(repeats):
            dist.barrier()
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            ms = torch.tensor([1e3 * (time.perf_counter() - start)] * 2, dtype=torch.float64, device=self.device)
            ms[1] = -ms[1]
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            slowest.append(ms[0].item())
            fastest.append(-ms[1].item())
        return statistics.median(slowest), statistics.median(fastest)

    def gather(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Every rank's zig-zag shard of ``x`` put back in sequence order (on every rank)."""
        import torch.distributed as dist

        from fa2.distributed import unshard

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return unshard(parts, layout="zigzag", dim=dim)


def exchange_steps(x: torch.Tensor, steps: int, ring: Ring) -> None:
    """``steps`` exchanges of ``x`` around the ring as ``ring_attention`` makes them: send to rank + 1,
    receive from rank − 1 (one ``batch_isend_irecv``), wait, and send what arrived on the next step."""
    import torch.distributed as dist

    for _ in range(steps):
        recv = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, (ring.rank + 1) % ring.world),
            dist.P2POp(dist.irecv, recv, (ring.rank - 1) % ring.world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        x = recv


def comm_call(mode: str, k: torch.Tensor, v: torch.Tensor, ring: Ring):
    """(the call, the bytes one rank sends in it): the forward's K/V transfers, or the backward's K/V and
    float32 dK/dV partials."""
    kv = torch.stack([k, v])
    if mode == "fwd":
        return (lambda: exchange_steps(kv, ring.world - 1, ring)), (ring.world - 1) * kv.nbytes
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)

    def both():
        exchange_steps(kv, ring.world - 1, ring)
        exchange_steps(dkv, ring.world, ring)

    return both, (ring.world - 1) * kv.nbytes + ring.world * dkv.nbytes


class TorchCP:
    """PyTorch's context parallelism over SDPA: inside ``context_parallel`` (entered with a one-byte-a-token
    buffer that fixes the sequence length, so that its head-tail load balancer, fa2's zig-zag, is on; the
    shards are given as they are) F.scaled_dot_product_attention runs its ring on the group's mesh."""

    def __init__(self, provider: str, rotate: str, ring: Ring, seqlen: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[TORCH_CP[provider]]
        set_rotate_method(rotate)
        mesh = init_device_mesh(ring.device.type, (ring.world,))
        self.length = torch.zeros(1, 1, seqlen, dtype=torch.int8, device=ring.device)
        self.contexts = [
            context_parallel(mesh, buffers=[self.length], buffer_seq_dims=[2], no_restore_buffers={self.length}),
            sdpa_kernel([kernel]),
        ]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)

    @staticmethod
    def attention(q, k, v) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), None


def fa2_ring(backend: str):
    from fa2.distributed import ring_attention

    def attention(q, k, v):
        return ring_attention(q, k, v, causal=True, layout="zigzag", backend=backend)

    return attention


def check_point(cfg: Config, ring: Ring, attention, backend: str | None, tokens_per_gpu: int, local) -> str | None:
    """On every rank: None if the ranks' O, L, dq, dk, dv pass (module docstring), else what is wrong."""
    q, k, v, dO = (t.detach().requires_grad_(i < 3) for i, t in enumerate(local))
    O, L = attention(q, k, v)
    grads = torch.autograd.grad(O, (q, k, v), dO)
    gathered = [ring.gather(x) for x in (O.detach(), *grads)]
    L_all = ring.gather(L, dim=-1) if L is not None else None
    if ring.rank != 0:
        return None
    qf, kf, vf, dOf = whole(cfg, tokens_per_gpu, ring.world, ring.device)
    sample = check.reference_sample(qf, kf, vf, True, dO=dOf)
    O_all, dq, dk, dv = gathered
    problem = check.problem(O_all, L_all, qf, sample) or check.grad_problem((dq, dk, dv), qf, kf, vf, sample)
    if problem is not None:
        return f"against the fp64 reference: {problem}"
    if backend is None:
        return None
    import fa2

    q1, k1, v1 = (t.detach().requires_grad_() for t in (qf, kf, vf))
    O1, L1 = fa2.attention(q1, k1, v1, causal=True, backend=backend)
    dq1, dk1, dv1 = torch.autograd.grad(O1, (q1, k1, v1), dOf)
    bound = check.FP32_GRAD_ATOL if qf.dtype == torch.float32 else None
    for name, x, one, tol in (
        ("O", O_all, O1, sample.tol_O),
        ("L", L_all, L1, sample.tol_L),
        ("dq", dq, dq1, sample.tol_dq),
        ("dk", dk, dk1, bound or DKV_ULPS * torch.finfo(qf.dtype).eps * dk1.abs().max().item()),
        ("dv", dv, dv1, bound or DKV_ULPS * torch.finfo(qf.dtype).eps * dv1.abs().max().item()),
    ):
        err = (x.double() - one.double()).abs().max().item()
        if not err <= tol:
            return f"against single-device fa2.attention: max |{name} - {name}_one| = {err:.3g} > {tol:.3g}"
    return None


def _call(attention, mode: str, q, k, v, dO):
    """What ``mode`` times: the forward without grad, or the backward alone after one forward."""
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return attention(q, k, v)

        return forward
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    O, _ = attention(qg, kg, vg)
    return functools.partial(torch.autograd.grad, O, (qg, kg, vg), dO, retain_graph=True)


def _measure(cfg: Config, ring: Ring, tokens_per_gpu: int, provider: str, local, write) -> None:
    """Check (where the whole sequence fits) and time one provider at one point, every rank; rank 0 writes."""
    seqlen = tokens_per_gpu * ring.world
    checked = seqlen <= cfg.check_limit
    backend = provider[4:] if provider.startswith("fa2-") else None
    q, k, v, dO = local
    torch_cp = None
    # An exception here means the provider cannot run (torch-cp: skipped; fa2: failed); a check that finds
    # wrong numbers fails either. The ranks agree on the outcome before any other collective.
    error, status = None, "failed"
    try:
        if backend is None:
            torch_cp = TorchCP(provider, cfg.rotate, ring, seqlen).__enter__()
            attention = TorchCP.attention
        else:
            attention = fa2_ring(backend)
    except Exception as e:  # noqa: BLE001 - a provider's failure is recorded and the run goes on
        error = exception_reason(e)
    error = ring.agree(error)
    if error is None and checked:
        try:
            error = check_point(cfg, ring, attention, backend, tokens_per_gpu, local)
        except Exception as e:  # noqa: BLE001 - as above
            error, status = exception_reason(e), "skipped" if backend is None else "failed"
        error = ring.agree(error)
    elif error is not None and backend is None:
        status = "skipped"
    try:
        for mode in cfg.modes:
            key = dict(world=ring.world, tokens_per_gpu=tokens_per_gpu, provider=provider, mode=mode)
            if error is not None:
                write("issue", key, status, error)
                continue
            try:
                fn = _call(attention, mode, q, k, v, dO)
                ms, fastest = ring.timed(fn, cfg.warmups, cfg.repeats)
                problem = None
            except Exception as e:  # noqa: BLE001 - as above
                problem = exception_reason(e)
            problem = ring.agree(problem)
            if problem is not None:
                write("issue", key, "failed", problem)
                continue
            flops = flops_per_gpu(cfg.batch, cfg.heads, seqlen, cfg.head_dim, ring.world, mode)
            write("result", _row(cfg, key, seqlen, ms, fastest, checked, backend, tflops=flops / (ms * 1e-3) / 1e12))
    finally:
        if torch_cp is not None:
            torch_cp.__exit__(None, None, None)


def _measure_comm(cfg: Config, ring: Ring, tokens_per_gpu: int, local, write) -> None:
    _, k, v, _ = local
    seqlen = tokens_per_gpu * ring.world
    for mode in cfg.modes:
        key = dict(world=ring.world, tokens_per_gpu=tokens_per_gpu, provider=COMM, mode=mode)
        if ring.world == 1:
            write("issue", key, "skipped", "a group of one sends nothing")
            continue
        call, nbytes = comm_call(mode, k, v, ring)
        ms, fastest = ring.timed(call, cfg.warmups, cfg.repeats)
        write("result", _row(cfg, key, seqlen, ms, fastest, False, None, gbps=nbytes / (ms * 1e-3) / 1e9))


def _row(cfg: Config, key: dict, seqlen: int, ms: float, fastest: float, checked: bool, backend, **rate) -> dict:
    return {
        **key,
        "seqlen": seqlen,
        "batch": cfg.batch,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
        "layout": "zigzag",
        "ms": f"{ms:.4g}",
        "ms_fastest_rank": f"{fastest:.4g}",
        "tflops_per_gpu": f"{rate['tflops']:.4g}" if "tflops" in rate else "",
        "gbps": f"{rate['gbps']:.4g}" if "gbps" in rate else "",
        "checked": "yes" if checked else "no" if key["provider"] != COMM else "",
        "backend": backend or "",
    }


def worker(rank: int, world: int, cfg: Config, env: dict, store: str) -> None:
    """One rank: every point of this world, rank 0 writing the rows as they come."""
    import torch.distributed as dist

    if cfg.device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # the ranks share a few cores
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    records = Records(cfg, env)

    def write(kind, *args):
        if rank == 0:
            (records.result if kind == "result" else records.issue)(*args)
            if kind == "result":
                row = args[0]
                rate = f"{row['tflops_per_gpu']} TFLOP/s per GPU" if row["tflops_per_gpu"] else f"{row['gbps']} GB/s"
                point = f"world {world} {row['tokens_per_gpu']}/GPU {row['provider']} {row['mode']}"
                print(f"  {point}: {row['ms']} ms, {rate}", flush=True)

    ring = Ring(rank, world, device)
    try:
        for tokens_per_gpu in cfg.tokens_per_gpu:
            local = local_shard(cfg, tokens_per_gpu, rank, world, device)
            for provider in cfg.provider_names():
                if provider == COMM:
                    _measure_comm(cfg, ring, tokens_per_gpu, local, write)
                else:
                    _measure(cfg, ring, tokens_per_gpu, provider, local, write)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del local
    finally:
        dist.destroy_process_group()


# --- the launcher ---------------------------------------------------------------------------------------------


def unavailable(cfg: Config, provider: str) -> str | None:
    """Why ``provider`` cannot run here at all, or None."""
    if not provider.startswith("fa2-"):
        return None
    backend = provider[4:]
    info = registry.backends().get(backend)
    if info is None:
        return f"fa2 backend {backend} is not installed: {registry.install_command(backend)}"
    if info.status == "unavailable" or (info.status == "emulated" and not cfg.emulated):
        return f"fa2 backend {backend} does not run natively here ({info.status}: {info.detail})"
    return None


def _config_error(cfg: Config) -> str | None:
    if any(t % 2 for t in cfg.tokens_per_gpu):
        return f"--tokens-per-gpu must be even (a zig-zag shard holds two chunks), got {cfg.tokens_per_gpu}"
    if cfg.device_type == "cuda" and max(cfg.worlds) > torch.cuda.device_count():
        return f"--worlds {cfg.worlds}: this host has {torch.cuda.device_count()} GPUs (one rank per GPU)"
    return None


def run(cfg: Config) -> None:
    """Measures ``cfg`` into ``<name>.csv``, ``<name>-skipped.csv`` and ``<name>-run.json``."""
    import torch.multiprocessing as mp

    if (error := _config_error(cfg)) is not None:
        raise SystemExit(f"fa2.bench.ring: {error}")
    started = time.perf_counter()
    device = torch.device(cfg.device_type)
    env = environment(device)
    records = Records(cfg, env)
    records.start()
    runnable = []
    for provider in cfg.provider_names():
        reason = unavailable(cfg, provider)
        if reason is None:
            runnable.append(provider)
            continue
        for world in cfg.worlds:
            for key in cfg.keys(world):
                if key["provider"] == provider:
                    records.issue(key, "skipped", reason)
    provider_fa2 = [p for p in runnable if p.startswith("fa2-")]
    providers = tuple(dict.fromkeys(p if p in TORCH_CP else "fa2" for p in runnable if p != COMM))
    work = Config(**{**cfg.__dict__, "providers": providers, "backends": tuple(p[4:] for p in provider_fa2)})
    print(
        f"fa2.bench.ring: {'EMULATED on the CPU, gloo' if cfg.emulated else env['gpu'] + ', NCCL'}; worlds "
        f"{','.join(map(str, cfg.worlds))}; {', '.join(work.provider_names())}; writing {cfg.path('.csv')}",
        flush=True,
    )
    for world in cfg.worlds if work.provider_names() else ():
        print(f"world {world}: {world} process(es)", flush=True)
        with tempfile.TemporaryDirectory(prefix="fa2-ring-") as tmp:
            try:
                mp.spawn(worker, args=(world, work, env, str(Path(tmp) / "store")), nprocs=world, join=True)
            except Exception as e:  # noqa: BLE001 - a world that dies is recorded and the next one runs
                done = records.written()
                for key in work.keys(world):
                    if tuple(str(key[c]) for c in KEY) not in done:
                        records.issue(key, "failed", f"world {world}'s processes stopped: {exception_reason(e)}")
    info = {
        **env,
        "device": cfg.device_type,
        "emulated": cfg.emulated,
        "command": cfg.command,
        "started": now_utc(),
        "worlds": list(cfg.worlds),
        "gpus": torch.cuda.device_count() if cfg.device_type == "cuda" else 0,
        "distributed_backend": "nccl" if cfg.device_type == "cuda" else "gloo",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cfg.device_type == "cuda" else "",
        "shape": {"batch": cfg.batch, "heads": cfg.heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype},
        "warmups": cfg.warmups,
        "repeats": cfg.repeats,
        "check_limit": cfg.check_limit,
        "torch_cp_rotate": cfg.rotate,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    earlier = read_runs(cfg.path("-run.json")) if cfg.append else []
    records.commit(records.measured())
    cfg.path("-run.json").write_text(json.dumps({"runs": [*earlier, info]}, indent=2) + "\n")


# --- the report, from the files alone ------------------------------------------------------------------------


class Report:
    """``<name>.md`` and ``<name>.png`` from ``<name>.csv``, ``<name>-skipped.csv`` and ``<name>-run.json``."""

    def __init__(self, out_dir: Path, name: str):
        self.name = name
        self.rows = read_csv(out_dir / f"{name}.csv")
        self.issues = read_csv(out_dir / f"{name}-skipped.csv")
        self.runs = read_runs(out_dir / f"{name}-run.json")
        self.info = self.runs[-1] if self.runs else {}
        self.emulated = bool(self.info.get("emulated"))
        self.by = {tuple(r[c] for c in KEY): r for r in self.rows}
        self.worlds = sorted({int(r["world"]) for r in self.rows})
        self.tokens = sorted({int(r["tokens_per_gpu"]) for r in self.rows})
        self.providers = list(dict.fromkeys(r["provider"] for r in self.rows if r["provider"] != COMM))
        self.modes = [m for m in MODES if any(r["mode"] == m for r in self.rows)]

    def caption(self, text: str) -> str:
        return f"**{EMULATED_TAG}.** {text}" if self.emulated else text

    def value(self, column: str, world: int, tokens: int, provider: str, mode: str) -> float | None:
        r = self.by.get((str(world), str(tokens), provider, mode))
        return float(r[column]) if r and r[column] else None

    def efficiency(self, world: int, tokens: int, provider: str, mode: str) -> float | None:
        mine, one = (self.value("tflops_per_gpu", w, tokens, provider, mode) for w in (world, 1))
        return mine / one if mine and one else None

    def scaling_tables(self) -> list[str]:
        out = []
        for provider in self.providers:
            for mode in self.modes:
                rows = []
                for t in self.tokens:
                    cells = []
                    for w in self.worlds:
                        tf, eff = (
                            self.value("tflops_per_gpu", w, t, provider, mode),
                            self.efficiency(w, t, provider, mode),
                        )
                        cells.append("—" if tf is None else f"{tf:.4g}" + (f" ({eff:.2f})" if eff is not None else ""))
                    if any(c != "—" for c in cells):
                        rows.append([seqlen_label(t), *cells])
                if rows:
                    out += ["", f"## Weak scaling: {provider}, {'forward' if mode == 'fwd' else 'backward'}", ""]
                    out += [
                        self.caption(
                            "TFLOP/s per GPU (causal FLOPs of the whole sequence over the world; the backward's 2.5 "
                            "times the forward's), and in brackets the weak-scaling efficiency: over the same "
                            "provider's TFLOP/s at world 1 and the same tokens per GPU."
                        ),
                        "",
                        *markdown_table(["tokens per GPU", *(f"world {w}" for w in self.worlds)], rows),
                    ]
        return out

    def comm_table(self) -> list[str]:
        fa2s = [p for p in self.providers if p.startswith("fa2-")]
        rows = []
        for w in self.worlds:
            for t in self.tokens:
                for mode in self.modes:
                    ms = self.value("ms", w, t, COMM, mode)
                    if ms is None:
                        continue
                    cells = [str(w), seqlen_label(t), mode, f"{ms:.4g}", f"{self.value('gbps', w, t, COMM, mode):.4g}"]
                    for p in fa2s:
                        attn = self.value("ms", w, t, p, mode)
                        cells.append("—" if attn is None else f"{attn:.4g} ({ms / attn:.2f})")
                    rows.append(cells)
        if not rows:
            return []
        return [
            "",
            "## The ring's transfers alone",
            "",
            self.caption(
                "Provider comm: the transfers ring_attention makes, without attention (fwd: world − 1 exchanges of "
                "the rank's K/V shard; bwd: those and world exchanges of its float32 dK/dV partials), ms and GB/s "
                "each rank sends; beside it each fa2 backend's ms at the same point and, in brackets, comm over "
                "that: the share of the step the compute has to hide."
            ),
            "",
            *markdown_table(
                ["world", "tokens per GPU", "mode", "comm ms", "GB/s", *(f"{p} ms (comm share)" for p in fa2s)], rows
            ),
        ]

    def against_torch_cp(self) -> list[str]:
        fa2s = [p for p in self.providers if p.startswith("fa2-")]
        cps = [p for p in self.providers if p in TORCH_CP]
        if not fa2s or not cps:
            return []
        rows = []
        for w in self.worlds:
            for t in self.tokens:
                cells = [str(w), seqlen_label(t)]
                present = False
                for p in [*fa2s, *cps]:
                    ms = [self.value("ms", w, t, p, m) for m in MODES]
                    present |= any(x is not None for x in ms)
                    cells += ["—" if x is None else f"{x:.4g}" for x in ms]
                    cells.append(f"{sum(ms):.4g}" if None not in ms else "—")
                mine = [self.value("ms", w, t, fa2s[0], m) for m in MODES]
                for cp in cps:
                    theirs = [self.value("ms", w, t, cp, m) for m in MODES]
                    cells.append(f"{sum(theirs) / sum(mine):.2f}" if None not in mine + theirs else "—")
                if present:
                    rows.append(cells)
        header = ["world", "tokens per GPU"]
        for p in [*fa2s, *cps]:
            header += [f"{p} fwd ms", f"{p} bwd ms", f"{p} fwd+bwd ms"]
        header += [f"{cp} / {fa2s[0]} (fwd+bwd)" for cp in cps]
        return [
            "",
            "## fa2 against PyTorch's context_parallel",
            "",
            self.caption(
                "Step times on the same shapes and shards: the forward, the backward alone, their sum; and "
                "torch-cp's sum over fa2's (above 1: fa2 is faster). torch-cp: SDPA's FlashAttention-2 kernel, "
                f"torch-cp-cudnn: cuDNN's, K/V rotated by {self.info.get('torch_cp_rotate', '?')}."
            ),
            "",
            *markdown_table(header, rows),
        ]

    def markdown(self, plots: list[Path]) -> str:
        info = self.info
        shape = info.get("shape", {})
        where = "EMULATED on the CPU" if self.emulated else info.get("gpu", "?")
        lines = [f"# fa2.distributed.ring_attention on several GPUs: {where}", ""]
        if self.emulated:
            lines += [f"> **{EMULATED_NOTE}**", ""]
        checked = sorted({(int(r["world"]), int(r["tokens_per_gpu"])) for r in self.rows if r["checked"] == "yes"})
        lines += [
            f"- Causal, zig-zag shards, batch {shape.get('batch')}, {shape.get('heads')} heads, head_dim "
            f"{shape.get('head_dim')}, {shape.get('dtype')}; one process per "
            f"{'CPU rank on gloo' if self.emulated else 'GPU on NCCL ' + str(info.get('nccl'))}.",
            f"- Environment: commit `{info.get('commit', '?')}`, torch {info.get('torch', '?')}, triton "
            f"{info.get('triton') or '—'}, numba-cuda {info.get('numba_cuda') or '—'}, {info.get('gpus', 0)} GPU(s).",
            f"- Timing: per point, {info.get('warmups', '?')} warm-up call(s), then the median over "
            f"{info.get('repeats', '?')} calls of the slowest rank's time (a barrier and a device synchronisation "
            "before each call, one after). fwd: the forward; bwd: the backward alone (autograd.grad after one "
            "forward).",
            f"- Checked before timing (O, L, dq against the fp64 reference on sampled rows; the fa2 rows also "
            f"O, L, dq, dk, dv against single-device fa2.attention), where the whole sequence has at most "
            f"{info.get('check_limit', '?')} tokens: (world, tokens per GPU) "
            + (", ".join(f"({w}, {seqlen_label(t)})" for w, t in checked) or "none")
            + ".",
            f"- Wall time {sum(r.get('wall_s', 0) for r in self.runs):.0f} s, from:",
            *(
                f"  - `{r.get('command', '?')}`, started {r.get('started', '?')}, {r.get('wall_s', '?')} s"
                for r in self.runs
            ),
        ]
        lines += self.scaling_tables() + self.comm_table() + self.against_torch_cp()
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots] or ["None drawn (no matplotlib here)."]
        rows = [
            [i["world"], seqlen_label(int(i["tokens_per_gpu"])), i["provider"], i["mode"], i["status"], i["reason"]]
            for i in self.issues
        ]
        lines += ["", "## Not measured", ""]
        lines += (
            markdown_table(["world", "tokens per GPU", "provider", "mode", "status", "reason"], rows)
            if rows
            else ["Nothing: every point ran."]
        )
        return "\n".join(lines) + "\n"

    def plot(self, out_dir: Path) -> Path:
        """TFLOP/s per GPU against the world size, a panel per mode, a colour per tokens per GPU, a line
        style per provider (fa2 solid, torch-cp dashed)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = dict(
            zip(
                self.tokens,
                plt.get_cmap("viridis")([i / max(1, len(self.tokens) - 1) for i in range(len(self.tokens))]),
            )
        )
        styles = dict(zip(self.providers, ["-", "--", ":", "-."] * 4))
        markers = dict(zip(self.providers, "osD^v<>" * 2))
        fig, axes = plt.subplots(1, len(self.modes), figsize=(6 * len(self.modes), 4.5), squeeze=False)
        for ax, mode in zip(axes[0], self.modes):
            for p in self.providers:
                for t in self.tokens:
                    points = [(w, self.value("tflops_per_gpu", w, t, p, mode)) for w in self.worlds]
                    points = [(w, y) for w, y in points if y is not None]
                    if points:
                        ax.plot(
                            *zip(*points),
                            styles[p],
                            marker=markers[p],
                            color=colors[t],
                            label=f"{p}, {seqlen_label(t)}/GPU",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.worlds, [str(w) for w in self.worlds])
            ax.set_xlabel("GPUs (world size)")
            ax.set_ylabel("TFLOP/s per GPU")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{'forward' if mode == 'fwd' else 'backward'}: weak scaling")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        where = "EMULATED on the CPU: says nothing about GPU speed" if self.emulated else self.info.get("gpu", "")
        fig.suptitle(f"ring attention, causal, zig-zag, fixed tokens per GPU; {where}")
        fig.tight_layout()
        path = out_dir / f"{self.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = DEFAULTS[device_type]
    backends = args.backends or defaults.backends
    unset = {key: value for key, value in EMULATION.items() if key not in os.environ}
    if device_type == "cpu" and unset and any(b in ("triton", "numba-cuda") for b in backends):
        # Triton and numba read these when imported: a fresh interpreter, as python -m fa2.bench does.
        print(f"fa2.bench.ring: no GPU; running again with {' '.join(f'{k}={v}' for k, v in unset.items())}")
        os.execve(sys.executable, [sys.executable, "-m", "fa2.bench.ring", *argv], {**os.environ, **unset})
    worlds = args.worlds or (
        tuple(w for w in (1, 2, 4, 8) if w <= torch.cuda.device_count()) if device_type == "cuda" else (1, 2)
    )
    cfg = Config(
        worlds=worlds,
        tokens_per_gpu=args.tokens_per_gpu or defaults.tokens_per_gpu,
        batch=args.batch,
        heads=args.heads or defaults.heads,
        head_dim=args.head_dim or defaults.head_dim,
        dtype=args.dtype or defaults.dtype,
        backends=backends,
        providers=args.providers or defaults.providers,
        modes=args.modes,
        rotate=args.torch_cp_rotate,
        warmups=defaults.warmups if args.warmups is None else args.warmups,
        repeats=args.repeats or defaults.repeats,
        check_limit=args.check_limit,
        device_type=device_type,
        out_dir=args.out,
        name=args.name or f"{default_name(torch.device(device_type))}-ring",
        append=args.append,
        command=shlex.join(["python", "-m", "fa2.bench.ring", *argv]),
    )
    run(cfg)
    written = write_report(Report(cfg.out_dir, cfg.name), cfg.out_dir, cfg.name)
    print(f"wrote {', '.join(map(str, [cfg.path('.csv'), cfg.path('-skipped.csv'), cfg.path('-run.json'), *written]))}")


if __name__ == "__main__":
    main()
