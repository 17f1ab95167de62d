"""fa2.distributed: ring attention over a sequence sharded across processes, against fa2.attention on one.

Worlds of 1, 2 and 3 processes on loopback (gloo and CPU tensors here; NCCL and one GPU per rank with
--device cuda), each rank holding its shard of q, k and v, contiguous or zig-zag. Forward and backward of
every case are checked on the whole sequence (the ranks' shards unsharded): O, L, dq, dk, dv against the
fp64 reference by the suite's rules (checks.assert_matches_reference, test_gradients.assert_grads_match:
the bar fa2.attention itself meets), and O, L, dq, dk, dv against single-process fa2.attention on the
same backend within the same tolerances. Also: a ring on a subgroup whose ranks are not 0..n-1 globally;
bad input (shards of different lengths, heads, dtypes, options, a rank whose own input is refused) raising
a ValueError on every rank instead of hanging; and the same group running the good cases after those
errors.

One launch of world_size processes per (backend, world) runs every case and writes its shards of the
results to a file (a process costs seconds of torch import, so not one launch per case); the tests read
them. Under pytest-xdist the launch is shared by the workers through a file lock.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import fa2
from checks import assert_matches_reference, max_err, random_qkv, tolerances
from fa2.distributed import ring_attention, shard, unshard
from test_conformance import CAUSAL, DTYPES, EMULATOR_GAPS, require_runnable
from test_gradients import assert_grads_match, grad_tolerances
from test_sinks import assert_dsink_matches

WORLDS = [pytest.param(1, id="world1"), pytest.param(2, id="world2"), pytest.param(3, id="world3")]
LAYOUTS = [pytest.param("contiguous", id="contiguous"), pytest.param("zigzag", id="zigzag")]
LAUNCH_TIMEOUT_S = 900
COLLECTIVE_TIMEOUT_S = 120  # a rank left waiting in the ring fails after this instead of hanging the suite


class Shape(NamedTuple):
    """Per-rank shapes: q (batch, heads, seqlen_shard, head_dim), k and v with heads_k heads."""

    batch: int
    heads: int
    heads_k: int
    seqlen_shard: int
    head_dim: int


def _shape(*dims):
    s = Shape(*dims)
    kind = "mqa" if s.heads_k == 1 < s.heads else "gqa" if s.heads_k < s.heads else "mha"
    return pytest.param(s, id=f"B{s.batch}-H{s.heads}-Hk{s.heads_k}-{kind}-{s.seqlen_shard}perrank-D{s.head_dim}")


# Shard lengths whose zig-zag chunks (half a shard) end inside tiles (7, 17, 20, 13, 9); MHA, GQA, MQA;
# head_dim 16 to 256; batches of 1 and 2 (the conformance suite's classes that a ring can shard: its q and
# k have one length). The first is the size numba's simulator can afford.
SHAPES = [
    _shape(1, 1, 1, 16, 16),
    _shape(1, 4, 2, 14, 16),
    _shape(1, 3, 1, 34, 32),
    _shape(1, 2, 2, 64, 64),
    _shape(1, 1, 1, 40, 128),
    _shape(2, 4, 2, 26, 64),
    _shape(2, 1, 1, 18, 256),
]
SIMULATOR_REASON = (
    "numba's CUDA simulator runs a Python thread per GPU thread (2 s a block's forward and "
    "backward): its rings are the first shape, fp32, causal, on 2 ranks (every kind of block: causal, "
    "full square, full 2c x c and c x 2c); the rest runs with --device cuda and on the other backends"
)
EMULATOR_REASON = (
    "under an emulator the rings run the first three shapes (head_dim 16 and 32: MHA, GQA, MQA) on 1 and 2 "
    "ranks and no full-attention zig-zag (the same blocks as contiguous, the rows in another order): 3 ranks "
    "send the kernels no block that 2 do, and their first case took 152 s in Triton's interpreter; the rest "
    "runs with --device cuda and on fa2-pytorch"
)
WORLD1_REASON = (
    "a group of one runs no ring (fa2.attention on the whole shard, whose own suite covers the shapes): "
    "the first two shapes only"
)


class Case(NamedTuple):
    shape: Shape
    dtype: torch.dtype
    causal: bool
    layout: str

    @property
    def key(self) -> str:
        return f"{'-'.join(map(str, self.shape))}-{self.dtype}-{self.causal}-{self.layout}"


def _skip_reason(backend, status, device, world, case: Case) -> str | None:
    """Why this backend does not run ``case`` here, or None."""
    if (reason := _gpu_reason(device, world)) is not None:
        return reason
    if status == "emulated" and (backend, case.dtype) in EMULATOR_GAPS:
        return EMULATOR_GAPS[backend, case.dtype]
    if world == 1 and case.shape not in [s.values[0] for s in SHAPES[:2]]:
        return WORLD1_REASON
    if (
        status == "emulated"
        and backend == "numba-cuda"
        and not (case.shape == SHAPES[0].values[0] and case.dtype == torch.float32 and case.causal and world == 2)
    ):
        return SIMULATOR_REASON
    if status == "emulated" and (
        case.shape not in [s.values[0] for s in SHAPES[:3]] or case.layout == "zigzag" and not case.causal or world > 2
    ):
        return EMULATOR_REASON
    b, h, _, n, d = case.shape
    try:
        require_runnable(backend, status, device, case.dtype, (b, h, n * world, n * world, d))
    except pytest.skip.Exception as e:
        return str(e)
    return None


# With --device cuda, worlds up to the GPU count run on NCCL, one GPU a rank. FA2_RING_GLOO_CUDA=1 runs the
# larger worlds too, on gloo with the ranks sharing the GPUs (CUDA tensors through gloo's send/recv).
GLOO_CUDA = os.environ.get("FA2_RING_GLOO_CUDA") == "1"


def _gpu_reason(device, world) -> str | None:
    if device.type == "cuda" and world > torch.cuda.device_count() and not GLOO_CUDA:
        return (
            f"a world of {world} needs {world} GPUs (NCCL runs one rank per GPU), {torch.cuda.device_count()} "
            "here; FA2_RING_GLOO_CUDA=1 runs it on gloo with ranks sharing GPUs"
        )
    return None


def _cases(backend, status, device, world) -> list[Case]:
    every = [
        Case(s.values[0], dt.values[0], c.values[0], lay.values[0])
        for s in SHAPES
        for dt in DTYPES
        for c in CAUSAL
        for lay in LAYOUTS
    ]
    return [c for c in every if _skip_reason(backend, status, device, world, c) is None]


def _inputs(case: Case, world: int, device):
    """The whole sequence's q, k, v and dO."""
    b, h, h_k, n, d = case.shape
    seqlen = n * world
    q, k, v = random_qkv((b, h, seqlen, d), (b, h_k, seqlen, d), case.dtype, device, seed=seqlen * 31 + h_k)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(seqlen)).to(device=device, dtype=case.dtype)
    return q, k, v, dO


# --- the processes: one launch per (backend, world), every case, results to files ---------------------------

# A ring on a subgroup of the 3-process world: global ranks 1 and 2 (ring ranks 0 and 1), rank 0 outside.
SUBGROUP = (1, 2)
SUBGROUP_CASE = Case(Shape(1, 2, 1, 16, 16), torch.float32, True, "zigzag")
# A ring with attention sinks, on the 2-process world: the blocks attended without the sink, the sink once in
# the final merge; dsink each rank's rows' share (summed over the ranks here).
SINK_CASE = Case(Shape(1, 4, 2, 14, 16), torch.float32, True, "zigzag")


def _sink(heads: int) -> torch.Tensor:
    return torch.linspace(-0.5, 2.5, heads)


class Bad(NamedTuple):
    """A bad input: what each rank passes (``make(rank, world) -> q, k, v, kwargs``) and what every rank's
    ValueError must say."""

    name: str
    expect: str


BAD = [
    Bad("lengths-differ", "rank 0: q (1, 2, 17, 16)"),
    Bad("heads-differ", "k (1, 1, 16, 16)"),
    Bad("dtype-differs", "float16"),
    Bad("causal-differs", "causal True"),
    Bad("odd-zigzag-shard", "its length must be even"),
    Bad("refused-on-one-rank", "refused: ValueError: q, k and v must have the same head_dim"),
    Bad("sink-on-one-rank", "sink yes"),
]


def _bad_input(name: str, rank: int, world: int):
    last = rank == world - 1
    q, k, v = random_qkv((1, 2, 16, 16), (1, 2, 16, 16), torch.float32, "cpu", seed=rank)
    kwargs = {}
    if name == "lengths-differ":  # a 16 * world + 1 token sequence split as evenly as it goes
        q, k, v = random_qkv(
            (1, 2, 17 if rank == 0 else 16, 16), (1, 2, 17 if rank == 0 else 16, 16), torch.float32, "cpu", seed=rank
        )
    elif name == "heads-differ" and last:
        k, v = k[:, :1], v[:, :1]
    elif name == "dtype-differs" and last:
        q, k, v = q.half(), k.half(), v.half()
    elif name == "causal-differs":
        kwargs["causal"] = rank == 0
    elif name == "odd-zigzag-shard":
        q, k, v = q[..., :15, :], k[..., :15, :], v[..., :15, :]
        kwargs["layout"] = "zigzag"
    elif name == "refused-on-one-rank" and last:
        v = v[..., :8]
    elif name == "sink-on-one-rank" and last:
        kwargs["sink"] = torch.zeros(2)
    return q, k, v, kwargs


def _run_case(
    case: Case, rank: int, world: int, device, backend: str, group=None, sink=False
) -> dict[str, torch.Tensor]:
    q, k, v, dO = _inputs(case, world, device)
    qs, ks, vs = (shard(t, rank, world, layout=case.layout).requires_grad_() for t in (q, k, v))
    inputs, names = (qs, ks, vs), ("O", "L", "dq", "dk", "dv")
    kwargs = dict(causal=case.causal, group=group, backend=backend, layout=case.layout)
    if sink:
        kwargs["sink"] = _sink(case.shape.heads).to(device).requires_grad_()
        inputs, names = (*inputs, kwargs["sink"]), (*names, "dsink")
    O, L = ring_attention(qs, ks, vs, **kwargs)
    grads = torch.autograd.grad(O, inputs, shard(dO, rank, world, layout=case.layout))
    return {name: t.detach().cpu() for name, t in zip(names, (O, L, *grads))}


def _poison_empty() -> None:
    """As the suite's conftest: floating tensors from torch.empty / empty_like start as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.is_floating_point() and t.numel():
            t.fill_(math.nan)
        return t

    torch.empty = lambda *a, **kw: poisoned(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poisoned(real_empty_like(*a, **kw))


def _worker(job_dir: Path, rank: int) -> None:
    """One rank: the bad inputs first, then every case on the same group (which must have survived them)."""
    import torch.distributed as dist

    job = torch.load(job_dir / "job.pt", weights_only=False)  # this suite's own file: Case tuples
    world, backend = job["world"], job["backend"]
    device = torch.device("cpu")
    if job["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    _poison_empty()
    dist.init_process_group(
        job["dist_backend"],
        init_method=f"file://{job_dir / 'store'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    out = {}
    if world > 1:
        for bad in BAD:
            q, k, v, kwargs = _bad_input(bad.name, rank, world)
            try:
                ring_attention(q.to(device), k.to(device), v.to(device), backend=backend, **kwargs)
                out[bad.name] = ("no error", "")
            except Exception as e:  # any failure: the test says which rank raised what
                out[bad.name] = (type(e).__name__, str(e))
    subgroup = dist.new_group(list(SUBGROUP)) if job["subgroup"] else None  # collective: every rank makes it
    for case in job["cases"]:
        out[case.key] = _attempt(_run_case, case, rank, world, device, backend)
    if subgroup is not None and rank in SUBGROUP:
        out["subgroup"] = _attempt(
            _run_case, SUBGROUP_CASE, SUBGROUP.index(rank), len(SUBGROUP), device, backend, subgroup
        )
    if job["sink"]:
        out["sink"] = _attempt(_run_case, SINK_CASE, rank, world, device, backend, None, True)
    torch.save(out, job_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


def _attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # any failure, reported by the case's test
        return f"{type(e).__name__}: {e}"


def _launch(job_dir: Path, backend: str, status: str, device, world: int) -> list[dict]:
    job_dir.mkdir(parents=True, exist_ok=True)
    dist_backend = "nccl" if device.type == "cuda" and world <= torch.cuda.device_count() else "gloo"
    subgroup = world == 3 and _skip_reason(backend, status, device, world, SUBGROUP_CASE) is None
    torch.save(
        {
            "world": world,
            "backend": backend,
            "device": device.type,
            "dist_backend": dist_backend,
            "cases": _cases(backend, status, device, world),
            "subgroup": subgroup,
            "sink": world == 2 and _skip_reason(backend, status, device, world, SINK_CASE) is None,
        },
        job_dir / "job.pt",
    )
    # One thread a process: world processes share the machine's cores. Gloo on loopback.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(job_dir), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode, log) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
    if failed:
        raise RuntimeError("\n".join(f"rank {r} exited {rc}:\n{log[-3000:]}" for r, rc, log in failed))
    return [torch.load(job_dir / f"rank{rank}.pt") for rank in range(world)]


_RESULTS: dict = {}


def _results(backend, status, device, world, tmp_path_factory) -> list[dict]:
    """Every rank's results of the (backend, world) launch: run once per test session, shared by xdist's
    workers (the first to take the lock launches; the others read its files)."""
    from filelock import FileLock  # torch's own dependency

    key = (backend, device.type, world)
    if key not in _RESULTS:
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        root = tmp_path_factory.getbasetemp() if run_id is None else tmp_path_factory.getbasetemp().parent / run_id
        job_dir = root / f"ring-{backend}-{device.type}-world{world}"
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(job_dir) + ".lock"):
            failure = job_dir / "failed.txt"
            if failure.exists():
                _RESULTS[key] = failure.read_text()
            elif (job_dir / f"rank{world - 1}.pt").exists():
                _RESULTS[key] = [torch.load(job_dir / f"rank{r}.pt") for r in range(world)]
            else:
                try:
                    _RESULTS[key] = _launch(job_dir, backend, status, device, world)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failure.write_text(str(e))
                    _RESULTS[key] = str(e)
    if isinstance(_RESULTS[key], str):
        pytest.fail(f"the {world}-process launch failed: {_RESULTS[key]}")
    return _RESULTS[key]


def _gather(results: list[dict], key: str, layout: str) -> dict[str, torch.Tensor]:
    """The whole sequence's O, L, dq, dk, dv from the ranks' shards."""
    per_rank = [r[key] for r in results]
    for rank, got in enumerate(per_rank):
        if isinstance(got, str):
            pytest.fail(f"rank {rank} raised {got}")
    return {
        name: unshard([got[name] for got in per_rank], layout=layout, dim=-1 if name == "L" else -2)
        for name in per_rank[0]
    }


def _assert_matches(got: dict, case: Case, world: int, backend: str, device) -> None:
    q, k, v, dO = _inputs(case, world, torch.device("cpu"))
    assert_matches_reference(got["O"], got["L"], q, k, v, case.causal)
    assert_grads_match(got["dq"], got["dk"], got["dv"], q, k, v, dO, case.causal)
    # And next to single-process fa2.attention on the whole sequence, forward and backward, within the same
    # tolerances.
    q1, k1, v1 = (t.to(device).requires_grad_() for t in (q, k, v))
    O_one, L_one = fa2.attention(q1, k1, v1, causal=case.causal, backend=backend)
    grads_one = torch.autograd.grad(O_one, (q1, k1, v1), dO.to(device))
    tol_O, tol_L = tolerances(q, k, v, case.causal)
    err_O, err_L = max_err(got["O"], O_one.detach().cpu().double()), max_err(got["L"], L_one.cpu().double())
    assert err_O <= tol_O, f"max |O - fa2.attention's O| = {err_O:.3g} > tolerance {tol_O:.3g}"
    assert err_L <= tol_L, f"max |L - fa2.attention's L| = {err_L:.3g} > tolerance {tol_L:.3g}"
    _, tols = grad_tolerances(q, k, v, dO, case.causal)
    for name, one, tol in zip(("dq", "dk", "dv"), grads_one, tols):
        err = max_err(got[name], one.cpu().double())
        assert err <= tol, f"max |{name} - fa2.attention's {name}| = {err:.3g} > tolerance {tol:.3g}"


# --- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_attention_matches_attention(
    backend, status, device, world, shape, dtype, causal, layout, tmp_path_factory
):
    case = Case(shape, dtype, causal, layout)
    reason = _skip_reason(backend, status, device, world, case)
    if reason is not None:
        pytest.skip(reason)
    got = _gather(_results(backend, status, device, world, tmp_path_factory), case.key, layout)
    _assert_matches(got, case, world, backend, device)


def test_ring_on_a_subgroup(backend, status, device, tmp_path_factory):
    """Global ranks 1 and 2 of a 3-process world as a ring of 2: P2P peers are global ranks."""
    reason = _skip_reason(backend, status, device, 3, SUBGROUP_CASE)
    if reason is not None:
        pytest.skip(reason)
    results = _results(backend, status, device, 3, tmp_path_factory)
    got = _gather([results[r] for r in SUBGROUP], "subgroup", SUBGROUP_CASE.layout)
    _assert_matches(got, SUBGROUP_CASE, len(SUBGROUP), backend, device)


def test_ring_with_a_sink(backend, status, device, tmp_path_factory):
    """The sink counted once per row, not once per block: O, L, dq, dk, dv against the reference with the
    sink, and the ranks' dsink shares summed against its gradient."""
    reason = _skip_reason(backend, status, device, 2, SINK_CASE)
    if reason is not None:
        pytest.skip(reason)
    results = _results(backend, status, device, 2, tmp_path_factory)
    for rank, result in enumerate(results):
        if isinstance(result["sink"], str):
            pytest.fail(f"rank {rank} raised {result['sink']}")
    dsink = sum(result["sink"].pop("dsink") for result in results)
    got = _gather(results, "sink", SINK_CASE.layout)
    q, k, v, dO = _inputs(SINK_CASE, 2, torch.device("cpu"))
    sink = _sink(SINK_CASE.shape.heads)
    assert_matches_reference(got["O"], got["L"], q, k, v, True, sink=sink)
    assert_grads_match(got["dq"], got["dk"], got["dv"], q, k, v, dO, True, sink=sink)
    assert_dsink_matches(dsink, q, k, v, dO, True, sink)


@pytest.mark.parametrize("bad", [pytest.param(b, id=b.name) for b in BAD])
@pytest.mark.parametrize("world", WORLDS[1:])
def test_bad_input_raises_on_every_rank(backend, status, device, world, bad, tmp_path_factory):
    if (reason := _gpu_reason(device, world)) is not None:
        pytest.skip(reason)
    if status == "emulated" and backend == "numba-cuda" and world != 2:
        pytest.skip(
            "the check before the ring is the same on every backend; under numba's simulator the 2-rank "
            "launch runs it, and fa2-pytorch's session every world"
        )
    results = _results(backend, status, device, world, tmp_path_factory)
    for rank, result in enumerate(results):
        kind, message = result[bad.name]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert bad.expect in message, f"rank {rank}'s message lacks {bad.expect!r}: {message}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_unshard_round_trip(world, layout):
    x = torch.arange(2 * 3 * world * 4 * 2, dtype=torch.float32).reshape(2, 3, world * 4, 2)
    shards = [shard(x, r, world, layout=layout) for r in range(world)]
    assert all(s.shape == (2, 3, 4, 2) for s in shards)
    assert torch.equal(unshard(shards, layout=layout), x)
    L = x[..., 0]
    assert torch.equal(
        unshard([shard(L, r, world, layout=layout, dim=-1) for r in range(world)], layout=layout, dim=-1), L
    )


def test_zigzag_shards_hold_chunks_r_and_2w_minus_1_minus_r():
    x = torch.arange(8).reshape(1, 8, 1)  # 2 ranks: 4 chunks of 2 rows
    assert shard(x, 0, 2, layout="zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 1, 2, layout="zigzag").flatten().tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout, seqlen", [("contiguous", 7), ("zigzag", 6)])
def test_shard_refuses_a_sequence_that_does_not_divide(layout, seqlen):
    with pytest.raises(ValueError, match="does not split into"):
        shard(torch.zeros(1, seqlen, 4), 0, 2, layout=layout)


def test_shard_refuses_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(torch.zeros(1, 4, 4), 0, 2, layout="striped")
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        shard(torch.zeros(1, 4, 4), 2, 2)
    with pytest.raises(ValueError, match="one shape"):
        unshard([torch.zeros(1, 4, 4), torch.zeros(1, 2, 4)])


def test_ring_attention_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        ring_attention(q, q, q)


if __name__ == "__main__":
    import test_distributed  # the module the job's Case tuples name, not a second copy as __main__

    test_distributed._worker(Path(sys.argv[1]), int(sys.argv[2]))
