"""The checks every entry point makes on the caller's arguments, and the ``AttentionSpec`` built from them.

``fa2.attention``, ``fa2.varlen_attention``, ``fa2.kvcache_attention``, ``fa2.flash_attn``, ``fa2.sdpa`` and
``fa2.distributed`` all check q, k, v and their options here, with the same messages, and build their spec
with ``make_spec``; nothing below them validates again.
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from fa2.spec import AttentionSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (..., seqlen_q, head_dim), k and v (..., seqlen_k, head_dim) as ``fa2.attention`` takes them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # Each shape, dtype and device read once: every read makes a new object, and this runs on every call
    # (2.5 against 1.5 µs of host time on this project's CPU).
    qs, ks, vs = q.shape, k.shape, v.shape
    for name, shape in (("q", qs), ("k", ks), ("v", vs)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., seqlen, head_dim), got {tuple(shape)}")
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"q, k and v must have the same rank, got {_shapes(qs, ks, vs)}")
    if qs[:-3] != ks[:-3] or ks[:-2] != vs[:-2]:
        raise ValueError(f"q, k and v must have the same leading dims, got {_shapes(qs, ks, vs)}")
    if len(qs) > 2 and qs[-3] != ks[-3]:
        if ks[-3] == 0 or qs[-3] % ks[-3]:
            raise ValueError(
                "q's heads (dim -3) must be a multiple of k's and v's (grouped-query attention), got "
                + _shapes(qs, ks, vs)
            )
    if ks[-2] != vs[-2]:
        raise ValueError(f"k and v must have the same sequence length, got k {tuple(ks)} and v {tuple(vs)}")
    head_dim = qs[-1]
    if not (head_dim == ks[-1] == vs[-1]):
        raise ValueError(f"q, k and v must have the same head_dim, got {_shapes(qs, ks, vs)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be from 1 to {MAX_HEAD_DIM}, got {head_dim}")
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {dtype}")
    if not (dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {dtype}, k {k.dtype}, v {v.dtype}")
    device = q.device
    if not (device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {device}, k {k.device}, v {v.device}")


def _shapes(qs: torch.Size, ks: torch.Size, vs: torch.Size) -> str:
    return f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")


def check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a non-negative int, got {type(m).__name__} {m!r}")


def check_index(name: str, t, shape: tuple, device) -> None:
    """An int32 index tensor of the given shape (None: any size) on device; None passes."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        dims = ", ".join("n" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape ({dims}{',' if len(shape) == 1 else ''}), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def check_offsets(q: torch.Tensor, k: torch.Tensor | None, cu_q, cu_k) -> int:
    """The number of sequences of checked cu_seqlens_q and cu_seqlens_k (one device sync for the totals;
    k None: cu_seqlens_k's total is not checked)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must have shape (num_seqs + 1,), got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got {cu_q.numel()} and "
            f"{cu_k.numel()}"
        )
    # k None: paged keys (fa2.kvcache.varlen_paged), whose offsets' total is no size of k.
    checks = [("cu_seqlens_q", cu_q, q.shape[0])] + ([] if k is None else [("cu_seqlens_k", cu_k, k.shape[0])])
    if not all(_checked_before(cu, total) for _, cu, total in checks):
        ends = torch.stack([end for _, cu, _ in checks for end in (cu[0], cu[-1])]).tolist()
        for (name, cu, total), first, last in zip(checks, ends[0::2], ends[1::2]):
            if first != 0 or last != total:
                raise ValueError(
                    f"{name} must run from 0 to the total length {total} of its tensor, got {first} ... {last}"
                )
            _remember_checked(cu, total)
    return cu_q.numel() - 1


# id(offsets) -> (a weak reference to them, their version counter, the total they were checked against).
_CHECKED: dict[int, tuple[weakref.ref, int, int]] = {}


def _checked_before(cu: torch.Tensor, total: int) -> bool:
    """Whether these offsets, unmodified since (their version counter), were checked against this total: a
    model's layers, and a training loop's steps, pass the same offsets tensor again and again, and its sync
    (which stalls the host until the GPU has caught up, so that the launches after it no longer overlap the
    kernels before it) is paid once. Inference-mode tensors have no version counter, and under
    torch.compile nothing is kept: they are checked every call."""
    if torch.compiler.is_compiling() or cu.is_inference():
        return False
    hit = _CHECKED.get(id(cu))
    return hit is not None and hit[0]() is cu and hit[1:] == (cu._version, total)


def _remember_checked(cu: torch.Tensor, total: int) -> None:
    if torch.compiler.is_compiling() or cu.is_inference():
        return
    key = id(cu)
    _CHECKED[key] = (weakref.ref(cu, lambda _, key=key: _CHECKED.pop(key, None)), cu._version, total)


def make_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float | None,
    window=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    **fields,
) -> AttentionSpec:
    """The AttentionSpec of validated q and k (``validate``) and the caller's options, checked here; the
    ALiBi slopes come out as the (batch, heads) of q's (B, H, N, D) view (``fa2.layout.as_bhnd``), the sink
    contiguous (``check_sink``). ``fields``: AttentionSpec's other fields (a KV cache's, a packed batch's), set
    as given."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    left, right = check_window(window)
    if causal:
        right = 0
    softcap = check_softcap(softcap)
    slopes = None if alibi_slopes is None else check_alibi(alibi_slopes, q)
    group = q.shape[-3] // k.shape[-3] if q.dim() > 2 and k.shape[-3] else 1
    if sink is not None:
        fields["sink"] = check_sink(sink, q)
    return AttentionSpec.build(scale, (left, right), softcap, slopes, group, **fields)


def check_window(window, arg: str = "window") -> tuple[int, int]:
    """(left, right) as ints; ``arg``: the argument's name in the messages (fa2.flash_attn's window_size)."""
    if (
        type(window) is tuple
        and len(window) == 2
        and type(window[0]) is int
        and type(window[1]) is int
        and (window[0] >= -1 and window[1] >= -1)
    ):
        return window  # the common case, on every call: already a pair of valid ints
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{arg} must be a pair (left, right) of ints, got {window!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not is_integer(side):
            raise TypeError(f"{arg} {name} must be an int (-1 for unbounded), got {type(side).__name__} {side!r}")
        side = int(side)
        if side < -1:
            raise ValueError(f"{arg} {name} must be >= 0, or -1 for unbounded, got {side} ({arg} {window!r})")
        sides.append(side)
    return sides[0], sides[1]


def is_integer(x) -> bool:
    """Anything with ``__index__`` (Python ints, bools included, NumPy integers), or a 0-d integer tensor that
    is not a bool one."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def check_softcap(softcap) -> float:
    """softcap as a float, finite and >= 0 (0: off)."""
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__} {softcap!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 turns it off), got {value}")
    return value


def check_alibi(slopes, q: torch.Tensor) -> torch.Tensor:
    """float32 slopes of shape (heads,) or q.shape[:-2] on q's device, as the (batch, heads) of q's
    (B, H, N, D) view."""
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch.Tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if q.dim() < 3:
        raise ValueError(f"alibi_slopes needs q with a heads dim (rank >= 3), got q {tuple(q.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device {q.device}, got {slopes.device}")
    heads = q.shape[-3]
    if tuple(slopes.shape) not in ((heads,), tuple(q.shape[:-2])):
        raise ValueError(
            f"alibi_slopes must have shape ({heads},) or {tuple(q.shape[:-2])} (heads, or q's dims before "
            f"seqlen_q), got {tuple(slopes.shape)} for q {tuple(q.shape)}"
        )
    batch = math.prod(q.shape[:-3])
    return slopes.expand(q.shape[:-2]).reshape(batch, heads)


def check_sink(sink, q: torch.Tensor, arg: str = "sink") -> torch.Tensor:
    """Attention sinks: a float32 tensor of shape (heads,) (q's dim -3) on q's device, returned contiguous
    (a copy only where it is not, through which a gradient still flows). ``arg``: the argument's name in the
    messages (fa2.flash_attn's learnable_sink)."""
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"{arg} must be a float32 torch.Tensor of shape (heads,), got {type(sink).__name__}")
    if sink.dtype != torch.float32:
        raise TypeError(f"{arg} must be float32 (one logit per head), got {sink.dtype}")
    if q.dim() < 3:
        raise ValueError(f"{arg} needs q with a heads dim (rank >= 3), got q {tuple(q.shape)}")
    if tuple(sink.shape) != (q.shape[-3],):
        raise ValueError(
            f"{arg} must have shape (heads,) = ({q.shape[-3]},), one logit per query head, got "
            f"{tuple(sink.shape)} for q {tuple(q.shape)}"
        )
    if sink.device != q.device:
        raise ValueError(f"{arg} must be on q's device {q.device}, got {sink.device}")
    return sink.contiguous()


def check_varlen_alibi(slopes, q: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``check_alibi`` for a packed q (total_q, heads, head_dim): slopes (heads,) or (num_seqs, heads), as
    (num_seqs, heads)."""
    heads = q.shape[1]
    if isinstance(slopes, torch.Tensor) and tuple(slopes.shape) not in ((heads,), (num_seqs, heads)):
        raise ValueError(
            f"alibi_slopes must have shape ({heads},) or ({num_seqs}, {heads}) (heads, or sequences and heads), "
            f"got {tuple(slopes.shape)}"
        )
    # check_alibi checks the type, dtype and device against a (num_seqs, heads, ...) view of the packed q.
    return check_alibi(slopes, q.new_empty(()).expand(num_seqs, heads, 1, q.shape[-1]))
