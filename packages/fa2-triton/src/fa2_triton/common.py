"""What fa2-triton's kernels and their launchers share: the forward's (``forward_tl``, ``forward``,
``forward_gluon``), the backward's (``backward_tl``, ``backward``) and the KV-cache kernel's (``kvcache``).

- the interpreter switch (``INTERPRETED``: TRITON_INTERPRET was set when fa2_triton was imported) and the
  device check (``check_device``: what this build of the kernels cannot run, bfloat16 in the interpreter);
- the ``@triton.jit`` helpers: ``load_tile`` (a tile with rows past the end and padded columns zeroed),
  ``tanh`` (the softcap's, exact from exp2 or the GPU's tanh.approx: ``SOFTCAP_EXP2``, ``SOFTCAP_APPROX``),
  ``tiles_in_window`` (the tiles a window's rows see, as a key loop's bounds), ``sequence_rows`` and ``sequence``
  (a packed batch's sequences from their offsets);
- an ``AttentionSpec`` as the kernels' arguments (``ScoreArgs``, ``score_args``), the packed batch's grid
  extent and offsets (``packed``), grouped-query attention's group (``group_size``), the padded head_dim and
  a rounded-up division for the launchers (``padded_head_dim``, ``cdiv``);
- the GPU's compute capability (``capability``, cached: asked on every launch) and whether a device is a
  Hopper GPU the Gluon kernels can run on (``on_hopper``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fa2.spec import UNBOUNDED, AttentionSpec

# Whether fa2-triton's kernels were decorated for Triton's CPU interpreter: TRITON_INTERPRET was set when
# fa2_triton was imported.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

MAX_HEAD_DIM = 256
LOG2_E = math.log2(math.e)


@triton.jit
def load_tile(ptrs, rows, n_rows, offs_d, head_dim, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, HEAD_DIM] tile, zero where a row is >= n_rows (only if MASK_ROWS) or a column >= head_dim
    (only if HEAD_DIM pads it: not EVEN_D)."""
    if MASK_ROWS:
        mask = rows[:, None] < n_rows
        if not EVEN_D:
            mask = mask & (offs_d[None, :] < head_dim)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
    return tile


# SOFTCAP's values: no cap; tanh from exp2 (fp32 inputs, and everything in the interpreter); the GPU's
# tanh.approx.f32 (16-bit inputs on a GPU).
SOFTCAP_NONE, SOFTCAP_EXP2, SOFTCAP_APPROX = 0, 1, 2


@triton.jit
def tanh(x, SOFTCAP: tl.constexpr):
    """tanh in fp32 (Triton has no tl.tanh; libdevice's does not run in the interpreter).

    SOFTCAP_EXP2: 1 - 2 / (e^2x + 1), with x already multiplied by 2·log2(e) (``score_args`` folds that
    into cap_scale). e^2x overflows to +inf for large x (tanh = 1) and to 0 for very negative x (tanh = -1):
    never NaN; absolute error a few fp32 ulps of 1, the same in the interpreter and on the GPU. Two special
    function unit operations (exp2 and the reciprocal) on top of the softmax's exp2: the cap cost 20-42%
    in time with it on the H200 (docs/notes/windows-softcap.md).
    SOFTCAP_APPROX: PTX ``tanh.approx.f32`` of x, one MUFU.TANH: relative error at most 2^-10.99 (PTX ISA),
    about fp16's unit roundoff and 8x below bf16's, so kept for 16-bit inputs, whose scores the naive
    attention of the precision rule rounds that much anyway; fp32 inputs keep the exact formula."""
    if SOFTCAP == 2:  # SOFTCAP_APPROX
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.math.exp2(x) + 1.0)


@triton.jit
def tiles_in_window(
    start,
    end,
    n_other,
    diag,
    window_left,
    window_right,
    BLOCK: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
):
    """The tiles of the other side that rows [start, end) see, as (lo, full_lo, full_hi, hi): row i sees
    column j iff i + diag - window_left <= j <= i + diag + window_right (an unbounded side has no bound).
    [lo, hi) holds every column some row sees (lo a multiple of BLOCK; empty if lo >= hi), [full_lo, full_hi)
    the whole tiles every row sees, all before n_other's last partial tile, so only [lo, full_lo) (across
    the left edge) and [full_hi, hi) (across the right edge or n_other) need masks. The dK/dV kernel asks
    it the other way round: key j is seen by query i iff j - diag - window_right <= i <= j - diag +
    window_left."""
    if WINDOW_LEFT:
        lo = tl.maximum(start + diag - window_left, 0) // BLOCK * BLOCK
        # The last row's first column starts the tiles that every row sees whole.
        full_lo = tl.cdiv(tl.maximum(end - 1 + diag - window_left, 0), BLOCK) * BLOCK
    else:
        lo = 0
        full_lo = 0
    if WINDOW_RIGHT:
        hi = tl.minimum(tl.maximum(end + diag + window_right, 0), n_other)
        # The first row's last column ends them.
        full_hi = tl.minimum(tl.maximum(start + diag + window_right + 1, 0), n_other) // BLOCK * BLOCK
    else:
        hi = n_other
        full_hi = n_other // BLOCK * BLOCK
    if WINDOW_LEFT:
        # Windows narrower than a tile, or rows that see nothing: every visited tile masked, none twice.
        # Without a left bound lo = full_lo = 0 <= full_hi <= hi already, and the bounds stay as before.
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def sequence_rows(Cu, s, total):
    """Sequence s's (first row, length) from offsets Cu, clamped into [0, total] (a length below 0 becomes
    0): offsets nobody checked (that would need a sync) give wrong rows, never accesses outside the
    tensors."""
    start = tl.minimum(tl.maximum(tl.load(Cu + s), 0), total)
    end = tl.minimum(tl.maximum(tl.load(Cu + s + 1), start), total)
    return start.to(tl.int64), end - start


@triton.jit
def sequence(Cu_q, Cu_k, off_b, N_Q, N_K, TOTAL_Q, TOTAL_K, VARLEN: tl.constexpr):
    """(batch index into the tensors, first query row, first key row, seqlen_q, seqlen_k) of batch entry
    off_b. VARLEN: off_b is a sequence of the packed batch, whose queries are rows [Cu_q[off_b],
    Cu_q[off_b + 1]) of the TOTAL_Q rows of q's single batch entry (keys likewise from Cu_k); N_Q and N_K,
    the longest sequence's lengths, only sized the grid. Otherwise the dense batch entry off_b, from row 0."""
    if VARLEN:
        q_start, n_q = sequence_rows(Cu_q, off_b, TOTAL_Q)
        k_start, n_k = sequence_rows(Cu_k, off_b, TOTAL_K)
        return 0, q_start, k_start, n_q, n_k
    else:
        return off_b, 0, 0, N_Q, N_K


class ScoreArgs(NamedTuple):
    """The spec as the kernels' arguments: the runtime values (``qk_scale`` the factor that takes the
    scores, or their tanh under a softcap, to log2 units; ``cap_scale`` what the raw score is multiplied by
    inside the tanh, scale / softcap (· 2·log2(e) for SOFTCAP_EXP2); the window's sizes, 0 for an unbounded
    side; the slopes tensor and its strides, or a stand-in) and the compile-time switches."""

    qk_scale: float
    cap_scale: float
    window_left: int
    window_right: int
    slopes: torch.Tensor | None
    slope_strides: tuple[int, int]
    WINDOW_LEFT: bool
    WINDOW_RIGHT: bool
    SOFTCAP: int
    ALIBI: bool


def score_args(spec: AttentionSpec, dtype: torch.dtype) -> ScoreArgs:
    """The forward's and the backward's kernel arguments for ``spec`` and inputs of ``dtype`` (see
    ``ScoreArgs``; the dtype picks the tanh, ``tanh``)."""
    left, right = spec.window
    softcap = spec.softcap
    qk_scale = softcap * LOG2_E if softcap else spec.scale * LOG2_E
    if not softcap:
        mode, cap_scale = SOFTCAP_NONE, 0.0
    elif dtype != torch.float32 and not INTERPRETED:
        mode, cap_scale = SOFTCAP_APPROX, spec.scale / softcap
    else:
        mode, cap_scale = SOFTCAP_EXP2, spec.scale / softcap * 2 * LOG2_E
    slopes = spec.alibi_slopes
    return ScoreArgs(
        qk_scale,
        cap_scale,
        max(left, 0),
        max(right, 0),
        slopes,
        (0, 0) if slopes is None else (slopes.stride(0), slopes.stride(1)),
        left != UNBOUNDED,
        right != UNBOUNDED,
        mode,
        slopes is not None,
    )


def packed(spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, stand_in: torch.Tensor):
    """(batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k) as the kernels take them: for a packed batch
    the sequences, the longest lengths (the grid's extent) and the offsets; otherwise the tensors' own
    sizes and ``stand_in`` for the unused offset pointers."""
    if spec.varlen:
        return (
            spec.cu_seqlens_q.numel() - 1,
            spec.max_seqlen_q,
            spec.max_seqlen_k,
            spec.cu_seqlens_q,
            spec.cu_seqlens_k,
        )
    return batch, seqlen_q, seqlen_k, stand_in, stand_in


def padded_head_dim(head_dim: int) -> int:
    """HEAD_DIM, the kernels' head_dim: the next power of two, at least 16. In plain Python, for the launchers:
    ``triton.next_power_of_2`` is a constexpr function (Triton 3.5 and up), whose call costs ~1 µs of host
    time, and a backward asked it four times."""
    return max(16, 1 << (head_dim - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, in plain Python for the launchers (``triton.cdiv`` is a constexpr function, as
    ``padded_head_dim`` says)."""
    return -(-a // b)


def group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    """group = heads // heads_k, the query heads that share one key/value head (fa2.attention has checked
    that heads is a multiple of heads_k; heads_k = 0 only with heads = 0)."""
    return q.shape[1] // k.shape[1] if k.shape[1] else 1


def check_device(q: torch.Tensor) -> None:
    """Refuses inputs this build of the kernels cannot run, or cannot run correctly: q (any input tensor, e.g.
    (batch, heads, seqlen_q, head_dim)) must be on the CPU under TRITON_INTERPRET=1, on a CUDA device otherwise."""
    if INTERPRETED and q.device.type != "cpu":
        raise RuntimeError(
            f"fa2-triton was imported with TRITON_INTERPRET=1, so its kernel runs in Triton's CPU interpreter "
            f"and takes CPU tensors, got tensors on {q.device}; run without TRITON_INTERPRET to use the GPU"
        )
    if not INTERPRETED and q.device.type != "cuda":
        raise RuntimeError(
            f"fa2-triton's kernel runs on CUDA tensors, got tensors on {q.device}; without a GPU, set "
            "TRITON_INTERPRET=1 in the environment before fa2_triton is imported to run it in Triton's CPU "
            "interpreter (slow; for tests)"
        )
    # The interpreter runs tl.dot in NumPy, which has no bfloat16: its bf16 products come out wrong and
    # partly non-finite (max error inf on a (1, 2, 32, 16) input, Triton 3.9), so they are refused.
    if INTERPRETED and q.dtype == torch.bfloat16:
        raise NotImplementedError(
            f"fa2-triton does not run bfloat16 in Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1): "
            "the interpreter computes bf16 tl.dot wrongly; use float16 or float32 there, or a GPU for bfloat16"
        )


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability. Cached: asked on every launch, and torch's own lookup costs
    ~8 µs a call on the H200's host."""
    return torch.cuda.get_device_capability(index)


def on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.0) outside the interpreter: where the Gluon
    kernels can run, given a Triton with Gluon's Hopper API (each Gluon module's ``GLUON``)."""
    return not INTERPRETED and device.type == "cuda" and capability(device.index) == (9, 0)
