r"""``fa2.distributed``: context parallelism, attention over a sequence sharded across ranks (ring attention).

    import fa2.distributed as cp
    q, k, v = (cp.shard(x, rank, world, layout="zigzag") for x in (q_full, k_full, v_full))
    O, L = cp.ring_attention(q, k, v, causal=True, layout="zigzag")   # this rank's rows of fa2.attention
    O_full = cp.unshard(gathered_O_shards, layout="zigzag")

Each rank of a torch.distributed group holds its shard of q, k and v along the sequence (dim -2). The K/V
shards travel around the ring, rank r sending to r + 1 and receiving from r - 1, so that after world_size
steps every rank has attended its queries to every key; each step's partial (O, L) is merged into the
running result by its logsumexp (``fa2.combine``). The send of the next K/V shard is started before the
current one is attended and waited for after, so communication overlaps computation. The backward runs the
same ring: each rank computes its queries' part of a K/V shard's gradient with the backend's own backward,
given the final O and L, and the dK/dV partials travel with their shard until they are back at its owner.

Nothing here is specific to a torch.distributed backend: gloo with CPU tensors and NCCL with CUDA tensors
(each rank's tensors on its current device, ``torch.cuda.set_device``) run the same code, through
``torch.distributed.batch_isend_irecv``. The attention of each block is the public ``fa2.attention`` on
the chosen backend; its backward the backend's ``flash_attn_backward``.

Causal attention over contiguous shards leaves rank 0 one block of work and the last rank world_size; the
zig-zag layout (``layout="zigzag"``) gives every rank equal work. The sequence is cut into 2·world chunks
and rank r holds chunks r and 2·world − 1 − r, one after the other. With world = 2 (chunks 0..3; rank 0
holds 0 and 3, rank 1 holds 1 and 2), the causal mask by chunk (rows: query chunks, columns: key chunks)::

              keys: 0  1  2  3
    queries 0 (r0)   \  .  .  .        \ : causal within the chunk (the diagonal)
            1 (r1)   #  \  .  .        # : every key visible
            2 (r1)   #  #  \  .        . : no key visible (skipped)
            3 (r0)   #  #  #  \

and the block rank r attends when it holds rank s's K/V (c = the chunk length, seqlen_shard = 2c):

    s == r: its whole shard against the whole K/V shard, causal (the chunks are in order on both sides);
    s < r:  its whole shard against the K/V shard's first chunk, every key visible (2c x c entries);
    s > r:  its second chunk against the whole K/V shard, every key visible (c x 2c).

Every step after the first is thus 2c² score entries on every rank. Contiguous shards: s < r is the whole
block, s == r causal, s > r skipped.

Attention sinks (``sink=``) belong to the whole row, not to a block: the blocks are attended without it and
the ring's merged (O, L) takes it once at the end (``fa2.combine``'s ``sink``). The backward's blocks then
run on the final, sink-including L (their dq, dk, dv are the full gradient's terms as without a sink), and
the sink's gradient is this rank's rows' share, -Σ exp(sink[h] - L_i) · rowsum(dO_i ∘ O_i).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from fa2 import registry
from fa2.api import attention
from fa2.combine import combine
from fa2.layout import backward_any_rank
from fa2.spec import AttentionOutput
from fa2.validation import check_causal, make_spec, validate

__all__ = ["LAYOUTS", "ring_attention", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tags that keep a step's K/V apart from the backward's dK/dV partials between the same two ranks (gloo
# matches a receive to a send by peer and tag; NCCL, which orders them itself, ignores tags).
_TAG_KV, _TAG_DKV = 0, 1


def shard(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of a whole sequence, as ``ring_attention`` expects it.

    Arguments:
        x: (..., seqlen, head_dim) (the sequence along ``dim``; ``dim=-1`` for an L of shape (..., seqlen)).
        rank, world_size: 0 <= rank < world_size.
        layout: "contiguous": chunk ``rank`` of world_size equal chunks (a view); "zigzag": chunks ``rank``
            and 2·world_size − 1 − rank of 2·world_size equal chunks, concatenated (a new tensor).

    Returns:
        (..., seqlen / world_size, head_dim).

    Raises:
        ValueError: seqlen not a multiple of world_size (contiguous) or 2·world_size (zigzag), a rank out
            of range, an unknown layout.
    """
    _check_layout(layout)
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank!r} and world_size {world_size!r}")
    chunks = _chunks(x, world_size, layout, dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def unshard(shards: Sequence[torch.Tensor], *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard (e.g. the list ``torch.distributed.all_gather`` fills).

    Arguments:
        shards: world_size tensors (..., seqlen_shard, head_dim) in rank order, all the same shape.
        layout, dim: as given to ``shard``.

    Returns:
        (..., world_size · seqlen_shard, head_dim): ``unshard([shard(x, r, w) for r in range(w)]) == x``.
    """
    _check_layout(layout)
    shards = list(shards)
    if not shards or any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"unshard needs one or more shards of one shape, got {[tuple(s.shape) for s in shards]}")
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    n = shards[0].shape[dim]
    if n % 2:
        raise ValueError(f"zigzag shards hold two chunks each: their length must be even, got {n}")
    firsts = [s.narrow(dim, 0, n // 2) for s in shards]
    seconds = [s.narrow(dim, n // 2, n // 2) for s in reversed(shards)]
    return torch.cat(firsts + seconds, dim=dim)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    layout: str = "contiguous",
    sink: torch.Tensor | None = None,
) -> AttentionOutput:
    """FlashAttention-2 over a sequence sharded across the ranks of ``group``: this rank's rows of
    ``fa2.attention(q_full, k_full, v_full, causal=causal, scale=scale)``. Called by every rank of the group.

    Arguments:
        q: (batch, heads, seqlen_shard, head_dim): this rank's queries, ``shard(q_full, rank, world, layout)``.
        k, v: (batch, heads_k, seqlen_shard, head_dim), sharded the same way; heads a multiple of heads_k
            (grouped-query attention, as fa2.attention). Float32, float16 or bfloat16, one dtype, one device:
            the CPU for gloo, the current CUDA device for NCCL.
            Every rank's q, k, v must have the same shapes and dtype, and causal, scale and layout must be the
            same on every rank: checked with one all_gather of a small descriptor before the ring.
        causal: mask keys after the query in the whole sequence (seqlen_q = seqlen_k: aligned at the top
            left, which is fa2's bottom-right alignment for square attention).
        scale: multiplies q kᵀ; default 1 / sqrt(head_dim).
        group: the torch.distributed process group (default the world); a group of one is fa2.attention.
        backend: the fa2 backend of each block's attention and backward, as fa2.attention (None: its pick
            for q's device).
        layout: "contiguous" (rank r holds chunk r of world_size) or "zigzag" (rank r holds chunks r and
            2·world − 1 − r of 2·world, which balances causal work; seqlen_shard must then be even).
        sink: None, or float32 (heads,) on q's device: attention sinks, as fa2.attention, the same on every
            rank (that every rank passes one or none is checked; its values are not). Its gradient is this
            rank's rows' share: sum it over the group for the whole sequence's, as for any parameter that
            every rank holds (DDP's all-reduce does).

    Returns:
        AttentionOutput(O, L): O (batch, heads, seqlen_shard, head_dim), q's dtype; L (batch, heads,
        seqlen_shard), float32, natural log; this rank's rows in ``layout``'s order (``unshard`` of every
        rank's puts them back in sequence order). O is differentiable in q, k, v and the sink (the backward
        is a ring too, collective like the forward); L carries no gradient, as fa2.attention's.

    Communication per rank and step: one send and one receive of the stacked K/V shard (world − 1 steps of
    the forward), and in the backward also of its float32 dK/dV partials (world steps). Attention and merge
    run in float32 accumulators; the result is cast to q's dtype once.

    Raises:
        RuntimeError: torch.distributed not available or not initialised.
        ValueError: on every rank of the group, when any rank's input is wrong (the message lists what each
            rank had): shapes or dtypes that differ between ranks, q, k, v that fa2.attention would refuse,
            a k/v shard of another length than q's, an odd zigzag shard, a CUDA tensor off the current
            device, a bad sink, or causal, scale, layout, a sink or none that differ between ranks.
        fa2.BackendNotInstalledError, NotImplementedError: as fa2.attention, from the block's backend.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fa2.distributed.ring_attention needs an initialised torch.distributed process group")
    plan, sink = _check(q, k, v, causal, scale, group, backend, layout, sink)
    grad = q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    if torch.is_grad_enabled() and grad:
        O, L = _RingAttention.apply(q, k, v, sink, plan)
    else:
        O, L = _forward(q, k, v, sink, plan)
    return AttentionOutput(O, L)


class _Plan(NamedTuple):
    """What every rank agreed on: the ring's ranks (global ranks for the P2P ops) and the options."""

    rank: int
    world: int
    next_rank: int
    prev_rank: int
    group: dist.ProcessGroup | None
    causal: bool
    scale: float
    backend: str
    layout: str


def _block(plan: _Plan, src: int, n: int) -> tuple[slice, slice, bool] | None:
    """(query rows, key rows, causal) of the one block this rank attends when it holds rank ``src``'s K/V
    shard of length ``n``, or None where no query of this rank sees a key of it (module docstring)."""
    every = slice(0, n)
    if not plan.causal:
        return every, every, False
    if src == plan.rank:
        return every, every, True
    if plan.layout == "contiguous":
        return (every, every, False) if src < plan.rank else None
    half = n // 2
    if src < plan.rank:
        return every, slice(0, half), False
    return slice(half, n), every, False


def _forward(q, k, v, sink, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    n = q.shape[-2]
    kv = torch.stack([k, v])  # (2, batch, heads_k, n, head_dim): one message a step instead of two
    O = L = None
    for step in range(plan.world):
        src = (plan.rank - step) % plan.world
        # The next shard's transfer runs while this one is attended.
        pending = _exchange(kv, plan, _TAG_KV) if step + 1 < plan.world else None
        rows_keys = _block(plan, src, n)
        if rows_keys is not None:
            rows, keys, causal = rows_keys
            O_b, L_b = attention(
                q[..., rows, :],
                kv[0][..., keys, :],
                kv[1][..., keys, :],
                causal=causal,
                scale=plan.scale,
                backend=plan.backend,
            )
            if O is None:  # the first step is always the whole diagonal block
                O, L = O_b.float(), L_b
            else:
                merged = combine(torch.stack([O[..., rows, :], O_b.float()]), torch.stack([L[..., rows], L_b]))
                O[..., rows, :], L[..., rows] = merged
        if pending is not None:
            kv = _finish(*pending)
    if sink is not None:
        # The sink once, in the whole row's merge: one more partial of mass exp(sink[h]) and no value.
        return combine(O[None], L[None], sink=sink, dtype=q.dtype)
    return O.to(q.dtype), L


class _RingAttention(torch.autograd.Function):
    """The ring forward, saving the final O and L, and the ring backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan):
        O, L = _forward(q, k, v, sink, plan)
        ctx.save_for_backward(q, k, v, O, L, sink)
        ctx.plan = plan
        ctx.mark_non_differentiable(L)
        return O, L

    @staticmethod
    def backward(ctx, dO, _dL):
        q, k, v, O, L, sink = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, O, L, dO, ctx.plan)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            # This rank's rows' share (the sink's column of dS, summed): the blocks' backward needs none.
            delta = (dO.float() * O.float()).sum(dim=-1)  # (batch, heads, seqlen_shard)
            dsink = torch.exp(sink[:, None] - L).mul_(delta).sum(dim=(0, 2)).neg_()
        return dq, dk, dv, dsink, None


def _backward(q, k, v, O, L, dO, plan: _Plan):
    """dq of this rank's queries and dk, dv of its K/V shard. Each rank adds its queries' part of a shard's
    dK/dV to the float32 partials that travel around the ring with the shard; after world steps the sum over
    every rank's queries arrives at the shard's owner."""
    impl = registry.load(plan.backend)
    n = q.shape[-2]
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_pending = None
    for step in range(plan.world):
        src = (plan.rank - step) % plan.world
        kv_pending = _exchange(kv, plan, _TAG_KV) if step + 1 < plan.world else None
        rows_keys = _block(plan, src, n)
        if rows_keys is not None:
            rows, keys, causal = rows_keys
            k_b, v_b = kv[0][..., keys, :], kv[1][..., keys, :]
            q_b = q[..., rows, :]
            # The block's backward given the FINAL O and L: P = exp(S - L) is then this block's share of the
            # whole row's softmax, and D = rowsum(dO ∘ O) the whole row's, so the block's dq, dk, dv are its
            # terms of the full gradient (FlashAttention-2's backward is a sum over key blocks).
            spec = make_spec(q_b, k_b, causal, plan.scale)
            dq_b, dk_b, dv_b = backward_any_rank(
                impl.flash_attn_backward, q_b, k_b, v_b, O[..., rows, :], L[..., rows], dO[..., rows, :], spec
            )
            dq[..., rows, :] += dq_b
        # The partials of this shard, from the ranks before this one (none at the first step: this rank owns it).
        dkv = (
            _finish(*dkv_pending)
            if dkv_pending is not None
            else torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        )
        if rows_keys is not None:
            dkv[0][..., keys, :] += dk_b
            dkv[1][..., keys, :] += dv_b
        # On to the next rank; its receive of the partials for the shard it holds next overlaps its compute.
        dkv_pending = _exchange(dkv, plan, _TAG_DKV) if plan.world > 1 else None
        if kv_pending is not None:
            kv = _finish(*kv_pending)
    dkv = _finish(*dkv_pending) if dkv_pending is not None else dkv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _exchange(x: torch.Tensor, plan: _Plan, tag: int):
    """Starts sending ``x`` to the next rank and receiving its like from the previous one: (works, buffer)."""
    recv = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, plan.next_rank, plan.group, tag),
        dist.P2POp(dist.irecv, recv, plan.prev_rank, plan.group, tag),
    ]
    return dist.batch_isend_irecv(ops), recv


def _finish(works, recv: torch.Tensor) -> torch.Tensor:
    for work in works:
        work.wait()
    return recv


# --- agreeing on the input: every rank raises the same error instead of some hanging in the ring -----------


def _check(q, k, v, causal, scale, group, backend, layout, sink) -> tuple[_Plan, torch.Tensor | None]:
    """The plan every rank agreed on, and this rank's checked (contiguous) sink."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    error = None
    try:
        scale, backend, sink = _check_local(q, k, v, causal, scale, backend, layout, sink)
    except (TypeError, ValueError, ImportError) as e:
        error = e
    if world == 1:
        if error is not None:
            raise error
    else:
        device = _comm_device(q, group)
        mine = _describe(q, k, v, causal, scale, layout, sink, error).to(device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        every = [d.cpu() for d in every]
        if error is not None or any(not torch.equal(d[1:], every[0][1:]) or d[0] for d in every):
            raise ValueError(_disagreement(every, error, group, world))

    def ranks(r):
        return dist.get_global_rank(group, r) if group is not None else r

    plan = _Plan(
        rank, world, ranks((rank + 1) % world), ranks((rank - 1) % world), group, causal, scale, backend, layout
    )
    return plan, sink


def _check_local(q, k, v, causal, scale, backend, layout, sink) -> tuple[float, str, torch.Tensor | None]:
    """This rank's input as fa2.attention would check it, plus the ring's own conditions; (scale, backend,
    the sink made contiguous)."""
    validate(q, k, v)
    if q.dim() != 4:
        raise ValueError(f"q, k and v must have shape (batch, heads, seqlen_shard, head_dim), got q {tuple(q.shape)}")
    check_causal(causal)
    _check_layout(layout)
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"q's and k's shards must have the same length, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its length must be even, got q {tuple(q.shape)}")
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        raise ValueError(
            f"q is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()} "
            "(torch.cuda.set_device(local_rank) first: NCCL's P2P ops run on the current device)"
        )
    spec = make_spec(q, k, causal, scale, sink=sink)
    backend = backend if backend is not None else registry.default_backend(q.device)
    registry.load(backend)
    return spec.scale, backend, spec.sink


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks(x: torch.Tensor, world_size: int, layout: str, dim: int) -> tuple[torch.Tensor, ...]:
    parts = world_size if layout == "contiguous" else 2 * world_size
    n = x.shape[dim]
    if n % parts:
        raise ValueError(
            f"a sequence of {n} (dim {dim} of {tuple(x.shape)}) does not split into {parts} equal "
            f"chunks ({layout} layout over {world_size} ranks)"
        )
    return x.split(n // parts, dim=dim)


def _comm_device(q, group) -> torch.device:
    """Where the descriptor goes: q's device, or with no usable q, the current CUDA device for NCCL."""
    if isinstance(q, torch.Tensor):
        return q.device
    return (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in str(dist.get_backend(group))
        else torch.device("cpu")
    )


def _describe(q, k, v, causal, scale, layout, sink, error) -> torch.Tensor:
    """(20,) int64: what this rank was given, comparable across ranks: an error flag, q, k, v shapes (-1s
    where not 4-D), their dtypes (an index into _DTYPES, -1 for another), causal, layout, the scale's bits,
    whether it has a sink."""
    desc = [int(error is not None)]
    for t in (q, k, v):
        shape = list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4
        desc += shape
    for t in (q, k, v):
        dtype = t.dtype if isinstance(t, torch.Tensor) else None
        desc.append(_DTYPES.index(dtype) if dtype in _DTYPES else -1)
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0] if isinstance(scale, float) else 0
    desc += [
        int(causal) if isinstance(causal, bool) else -1,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        scale_bits,
        int(sink is not None),
    ]
    return torch.tensor(desc, dtype=torch.int64)


def _disagreement(every: list[torch.Tensor], error, group, world: int) -> str:
    """The message every rank raises: what each rank had, and which ranks refused their own input."""
    messages = [None] * world
    # Only on this error path: the ranks' own error messages, so that every rank can name them all.
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
    lines = []
    for r, (d, msg) in enumerate(zip(every, messages)):
        shapes = [tuple(d[1 + 4 * i : 5 + 4 * i].tolist()) for i in range(3)]
        dtypes = [str(_DTYPES[c]).removeprefix("torch.") if c >= 0 else "?" for c in d[13:16].tolist()]
        # A rank that refused its input never resolved its scale.
        scale = "?" if d[0] else f"{struct.unpack('<d', struct.pack('<q', int(d[18])))[0]:.6g}"
        layout = LAYOUTS[d[17]] if d[17] >= 0 else "?"
        line = (
            f"rank {r}: q {shapes[0]} {dtypes[0]}, k {shapes[1]} {dtypes[1]}, v {shapes[2]} {dtypes[2]}, "
            f"causal {bool(d[16]) if d[16] >= 0 else '?'}, scale {scale}, layout {layout}, "
            f"sink {'yes' if d[19] else 'none'}"
        )
        lines.append(line + (f" -- refused: {msg}" if msg else ""))
    return (
        "ring_attention: the ranks' inputs do not fit one sharded sequence (every rank needs q, k, v of the "
        "same shapes and dtype, and the same causal, scale, layout and sink or none):\n  " + "\n  ".join(lines)
    )
