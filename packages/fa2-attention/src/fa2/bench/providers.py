"""What the benchmark compares: fa2's backends, and the attention a user would pick instead.

Every provider returns O and the natural-log logsumexp L from (batch, heads, seqlen, head_dim) contiguous
inputs. The baselines are forced explicitly, each through the aten op of one SDPA backend (never the
dispatcher), so that a kernel that cannot run fails instead of falling back to another.

    fa2-pytorch, fa2-triton, fa2-numba-cuda   fa2.attention(q, k, v, causal=..., window=..., softcap=...,
                     backend=...), or with ``--fa2-entry sdpa`` fa2.scaled_dot_product_attention(q, k, v,
                     is_causal=..., enable_gqa=True, backend=...), which returns O alone (checked alone)
    sdpa-flash       torch.ops.aten._scaled_dot_product_flash_attention (FlashAttention-2 in PyTorch)
    sdpa-cudnn       torch.ops.aten._scaled_dot_product_cudnn_attention; its L comes back (B, H, N, 1)
    sdpa-efficient   torch.ops.aten._scaled_dot_product_efficient_attention (memory-efficient, CUTLASS)
    sdpa-math        torch.ops.aten._scaled_dot_product_attention_math: materialises the scores and
                     returns O and the attention weights, not L; its check covers O only
    flex             FlexAttention compiled with torch.compile, return_lse=True, causal and the sliding
                     window through a block mask made once per shape, the softcap as a score_mod

SDPA's causal mask is aligned top-left and fa2's bottom-right; they agree because every benchmark shape
has seqlen_q = seqlen_k. With ``--group`` (grouped-query attention) k and v have fewer heads: the fa2
backends, sdpa-flash and sdpa-cudnn take them as they are (an op that refuses them is recorded as failed),
sdpa-math and flex with ``enable_gqa=True``. SDPA's flash and cuDNN ops are what
``F.scaled_dot_product_attention(..., enable_gqa=True)`` calls under ``sdpa_kernel(FLASH_ATTENTION)``
(``CUDNN_ATTENTION``): those backends read the fewer key/value heads in place; only the math backend repeats
them.

Sliding windows (``--window W``: window (W, 0) with causal, each query sees its W + 1 most recent keys) and
softcapping (``--softcap C``) run in the fa2 backends (through fa2.attention: SDPA's signature has neither,
so ``--fa2-entry sdpa`` skips those shapes) and in flex. SDPA's flash, cuDNN, memory-efficient and math
backends take neither option: they are skipped for those shapes, with the reason, not emulated with an
explicit mask.

Mode ``bwd`` times the backward alone: the provider's forward runs once on inputs that require grad, then
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` is timed. It runs for the fa2 backends and
for sdpa-flash, sdpa-cudnn and sdpa-math, whose aten ops above are what ``F.scaled_dot_product_attention``
calls under ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` (``CUDNN_ATTENTION``, ``MATH``): their autograd
runs FlashAttention-2's, cuDNN's and the math backward.

Packed batches (``--varlen``, issue 21; ``VARLEN_PROVIDERS``): a Shape with ``lengths``, the sequences one
after the other. Every provider takes q, k, v (total, heads, head_dim), the layout of a packed batch's
projections, and returns O (total, heads, head_dim) and L (heads, total) or None; what each needs beside
the tensors (offsets, a block mask) is made once per shape, untimed. Forward and backward, each:

    fa2-pytorch, fa2-triton, fa2-numba-cuda   fa2.varlen_attention(q, k, v, cu_seqlens, cu_seqlens,
                     max_seqlen, max_seqlen, causal=..., backend=...): int32 offsets on the device, ints
    sdpa-njt         F.scaled_dot_product_attention on nested jagged tensors
                     (torch.nested.nested_tensor_from_jagged(q, offsets, min_seqlen, max_seqlen), transposed
                     to (B, H, j, D)), is_causal=causal; forced to SDPBackend.FLASH_ATTENTION on a GPU (the
                     first one NJT's dispatcher tries) and MATH on the CPU (NJT's only one there); where the
                     forced backend has no kernel for the case (torch 2.13's NJT math: no is_causal) it is
                     skipped, with what torch logs as the reason. O only.
    flex             compiled FlexAttention on (1, H, total, D) views, with a document mask (each query sees
                     the keys of its own sequence; causal within it) made by create_block_mask once per shape

Causal is per sequence; every sequence has as many queries as keys, so top-left and bottom-right alignment
agree (the flex mask and NJT's is_causal are top-left).

Decoding (``--decode``, issue 22; ``DECODE_PROVIDERS``): a Shape with ``seqlen_q`` query tokens per sequence
against a cache of ``seqlen`` keys, every key visible (no mask: the new tokens see the whole cache, as
``F.scaled_dot_product_attention`` without a mask computes it), and ``page_size`` 0 (a contiguous cache) or
P (a paged one). Every provider is called as ``(q, k, v, cache_seqlens, block_table)``: q (batch, heads,
seqlen_q, head_dim) a transposed view of flash-attn's (batch, seqlen_q, heads, head_dim); k, v the cache as
transposed views of flash-attn's layouts, (batch, heads_k, seqlen, head_dim) of (batch, seqlen, heads_k,
head_dim) contiguous, or paged (num_pages, heads_k, P, head_dim) of (num_pages, P, heads_k, head_dim) with
block_table (batch, pages_per_seq) int32 a random permutation of the pages (None for a contiguous cache);
cache_seqlens (batch,) int32, every entry seqlen. A provider's ``prepare`` makes what it needs from them
once per shape, untimed:

    fa2-pytorch, fa2-triton, fa2-numba-cuda   fa2.kvcache_attention(q, k, v, cache_seqlens,
                     block_table=block_table, num_splits=0, backend=...): the cache as stored, contiguous
                     or paged (``paged=True``: the same providers on the paged shapes)
    sdpa             F.scaled_dot_product_attention(q, k, v, enable_gqa=True), the dispatcher's pick, on
                     contiguous (batch, heads[_k], seqlen, head_dim) copies; O only
    sdpa-flash       the same under sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    flex             compiled FlexAttention (no mask, enable_gqa, return_lse) on the contiguous copies; not
                     in the default providers (a compile per shape)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import fa2
from fa2 import registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (q, k, v) -> (O, L); L is None where the provider does not return it.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class Shape:
    """One point of the sweep: q (batch, heads, seqlen, head_dim) of ``dtype`` ("bf16", ...), k and v with
    heads // group heads (grouped-query attention where group > 1), timed in ``mode`` "fwd" (the forward)
    or "bwd" (the backward alone)."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    mode: str = "fwd"
    group: int = 1
    # Sliding window: -1 none, W >= 0 fa2's window (W, 0) with causal (each query sees its W + 1 most recent
    # keys). Only causal shapes have one.
    window: int = -1
    # Logit softcapping: 0.0 none, C > 0 scores become C · tanh(scores / C).
    softcap: float = 0.0
    # A packed batch (``--varlen``): the sequences' lengths, one after the other; then batch is their number
    # and seqlen their total. Empty: a dense (batch, heads, seqlen, head_dim) shape.
    lengths: tuple[int, ...] = ()
    # Decoding (``--decode``): seqlen_q query tokens per sequence against a KV cache of seqlen keys, every
    # key visible; 0: as many queries as keys (every other shape).
    seqlen_q: int = 0
    # A decode shape's cache: 0 contiguous, P > 0 paged in pages of P keys.
    page_size: int = 0

    def __post_init__(self):
        if self.lengths and (self.batch, self.seqlen) != (len(self.lengths), sum(self.lengths)):
            raise ValueError(
                f"a packed shape has batch = the number of sequences and seqlen = their total, got "
                f"batch {self.batch}, seqlen {self.seqlen} for lengths {self.lengths}"
            )
        if self.seqlen_q and (self.causal or self.window >= 0 or self.softcap or self.lengths or self.mode != "fwd"):
            raise ValueError(
                "a decode shape is the forward of plain attention over the whole cache: no causal, "
                "window, softcap, packing or backward"
            )
        if self.page_size and not self.seqlen_q:
            raise ValueError(f"page_size {self.page_size}: only a decode shape (seqlen_q > 0) has a paged cache")

    @property
    def varlen(self) -> bool:
        return bool(self.lengths)

    @property
    def decode(self) -> bool:
        return self.seqlen_q > 0

    @property
    def queries(self) -> int:
        """Query rows per (batch, head)."""
        return self.seqlen_q or self.seqlen

    @property
    def kv_bytes(self) -> int:
        """What a decode step must read of the cache: K and V, 2·B·H_k·seqlen·D elements."""
        return 2 * self.batch * self.heads_k * self.seqlen * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def heads_k(self) -> int:
        return self.heads // self.group

    @property
    def window_pair(self) -> tuple[int, int]:
        """fa2.attention's ``window`` argument: (W, 0), or (-1, -1) without a window."""
        return (self.window, 0) if self.window >= 0 else (-1, -1)

    @property
    def pairs(self) -> int:
        """The (query, key) pairs counted per (batch, head): N² full; N²/2 causal (the FlashAttention-2 paper's
        count, kept so that causal figures compare with earlier runs and with flash-attn's); with a window,
        exactly the visible pairs (``visible_pairs``), as issue 20 counts sliding windows. A packed batch: per
        head, the real pairs of every sequence, summed exactly (issue 21): Σ n² full, Σ n (n + 1) / 2 causal."""
        if self.lengths:
            window = self.window_pair if self.window >= 0 else (-1, 0) if self.causal else (-1, -1)
            return sum(visible_pairs(n, n, window) for n in self.lengths)
        if self.seqlen_q:
            return self.seqlen_q * self.seqlen  # decode: every query sees every cached key
        if self.window >= 0:
            return visible_pairs(self.seqlen, self.seqlen, (self.window, 0))
        return self.seqlen**2 // 2 if self.causal else self.seqlen**2

    @property
    def flops(self) -> int:
        """4·B·H·D·pairs (two matmuls over the pairs counted, see ``pairs``), 4·H·D·pairs for a packed batch
        (its pairs sum over the sequences); the backward 2.5 times that (five matmuls)."""
        flops = 4 * (1 if self.lengths else self.batch) * self.heads * self.pairs * self.head_dim
        return flops * 5 // 2 if self.mode == "bwd" else flops

    @property
    def work(self) -> int:
        """B·H·N²·D, the measure of the emulators' budgets (as in shared_tests); H·D·Σ n² packed; B·H·Nq·N·D
        decoding."""
        squares = sum(n * n for n in self.lengths) if self.lengths else self.batch * self.queries * self.seqlen
        return self.heads * squares * self.head_dim

    def __str__(self) -> str:
        causal = "causal" if self.causal else "full"
        heads = f"H{self.heads}" + (f"/{self.heads_k}" if self.group > 1 else "")
        if self.seqlen_q:
            layout = f"paged{self.page_size}" if self.page_size else "contiguous"
            return (
                f"decode {self.dtype} B{self.batch} {heads} q{self.seqlen_q} K{self.seqlen} D{self.head_dim} {layout}"
            )
        options = variant_label(self.group, self.window, self.softcap)
        return (
            f"{self.mode} {self.dtype} {'packed ' if self.lengths else ''}B{self.batch} {heads} N{self.seqlen} "
            f"D{self.head_dim} {causal}" + (f" {options}" if options else "")
        )


@functools.cache
def visible_pairs(seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> int:
    """How many (query i, key j) pairs the window (left, right) lets through, aligned bottom-right as
    fa2.attention: i + Nk - Nq - left <= j <= i + Nk - Nq + right, -1 unbounded; causal is (-1, 0). Exact:
    the sum over the query rows of each row's clipped key range."""
    left, right = window
    shift = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + shift - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + shift + right)
        total += max(0, hi - lo + 1)
    return total


def variant_label(group: int, window: int, softcap: float) -> str:
    """The options beyond dtype, D, causal and N, as a short label ("gqa4 w4096 cap50"); "" without any."""
    parts = [
        f"gqa{group}" if group > 1 else "",
        f"w{window}" if window >= 0 else "",
        f"cap{softcap:g}" if softcap else "",
    ]
    return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Provider:
    """``build(shape, device)`` returns the timed callable for one shape (setup such as a block mask
    happens there, untimed). ``dtypes`` are those it takes, ``dtype_reason`` says why not the others;
    ``modes`` the modes it is timed in."""

    name: str
    build: Callable[[Shape, torch.device], Attention]
    dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")
    dtype_reason: str = ""
    cuda_only: bool = True
    returns_lse: bool = True
    backend: str | None = None
    modes: tuple[str, ...] = ("fwd",)
    # Whether it computes sliding windows and softcapping; those that do not are skipped for such shapes.
    windows: bool = False
    softcaps: bool = False
    # Why a cuda_only provider is not run on the CPU.
    cuda_reason: str = "a CUDA kernel: not run without a GPU"
    # Decoding: whether it reads a paged cache (block_table); those that do not are skipped on paged shapes.
    paged: bool = False
    # What the timed call takes, made once per shape from the shape's inputs (untimed); None: those inputs.
    prepare: Callable[..., tuple] | None = None

    def unavailable(self, device: torch.device) -> str | None:
        """Why this provider cannot run at all on ``device``, or None."""
        if self.backend is not None:
            return _fa2_unavailable(self.backend, device)
        if self.cuda_only and device.type != "cuda":
            return self.cuda_reason
        return None


def _fa2_unavailable(backend: str, device: torch.device) -> str | None:
    """The backend's own account (its ``availability()``); one half-written backend must not stop the others,
    so any exception while importing it is a reason, not a crash."""
    if backend not in registry.installed():
        return f"fa2 backend {backend!r} is not installed"
    try:
        status, detail = registry.load(backend).availability()
    except Exception as e:
        return f"fa2 backend {backend!r} failed to load: {type(e).__name__}: {e}"
    if status == "unavailable":
        return f"fa2 backend {backend!r} unavailable: {detail}"
    if device.type == "cuda" and status != "native":
        return f"fa2 backend {backend!r} runs {status} here ({detail}); the GPU sweep times native kernels only"
    return None


# The fa2 providers' entry points (``--fa2-entry``): fa2.attention carries every option and returns O and L;
# fa2.scaled_dot_product_attention is the drop-in for SDPA that issue 20 measures GQA through, and has SDPA's
# signature: no window, no softcap, O only.
FA2_ENTRIES = ("attention", "sdpa")


def _fa2(backend: str, entry: str = "attention") -> Callable[[Shape, torch.device], Attention]:
    def build(shape: Shape, device: torch.device) -> Attention:
        if entry == "sdpa":
            if shape.window >= 0 or shape.softcap:
                # sweep.skip_reason skips these shapes first; this guards a direct call.
                raise NotImplementedError("fa2.scaled_dot_product_attention has no window or softcap")
            # enable_gqa=True for every group, 1 included: dense and grouped rows run the same Python path.
            return lambda q, k, v: (
                fa2.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=True, backend=backend),
                None,
            )
        return lambda q, k, v: fa2.attention(
            q, k, v, causal=shape.causal, window=shape.window_pair, softcap=shape.softcap, backend=backend
        )

    return build


def fa2_provider(p: Provider, entry: str) -> Provider:
    """``p`` (an fa2 backend's provider) called through ``entry`` (FA2_ENTRIES)."""
    if entry == "attention":
        return p
    return replace(p, build=_fa2(p.backend, entry), returns_lse=False, windows=False, softcaps=False)


def _sdpa_flash(shape: Shape, device: torch.device) -> Attention:
    def call(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, shape.causal)
        return out[0], out[1]

    return call


def _sdpa_cudnn(shape: Shape, device: torch.device) -> Attention:
    def call(q, k, v):
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, shape.causal, False)
        return out[0], out[1].reshape(q.shape[:-1])  # L: (B, H, N, 1)

    return call


def _sdpa_efficient(shape: Shape, device: torch.device) -> Attention:
    def call(q, k, v):
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, shape.causal)
        return out[0], out[1][..., : q.shape[-2]]  # L may be padded along N to a multiple of 32

    return call


def _sdpa_math(shape: Shape, device: torch.device) -> Attention:
    def call(q, k, v):
        O, _attn_weights = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, None, 0.0, shape.causal, enable_gqa=shape.group > 1
        )
        return O, None

    return call


@functools.cache
def _compiled_flex_attention():
    """flex_attention through torch.compile, once per process. Every shape and dtype is a recompile:
    dynamo's default limit (8) would silently fall back to the eager path, ~30x slower."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    return torch.compile(flex_attention, dynamic=False)


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_mods(shape: Shape):
    """(mask_mod, score_mod) of FlexAttention for ``shape``: the causal mask, narrowed to the last W + 1 keys
    with a window (seqlen_q = seqlen_k, so bottom-right and top-left alignment agree); the softcap as a
    score_mod of the scaled score (flex applies it after the scale, as fa2). None where not needed."""
    mask_mod = score_mod = None
    if shape.window >= 0:
        w = shape.window

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= w)
    elif shape.causal:
        mask_mod = _causal_mask_mod
    if shape.softcap:
        cap = shape.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    return mask_mod, score_mod


def _flex(shape: Shape, device: torch.device) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = _compiled_flex_attention()
    n = shape.seqlen
    mask_mod, score_mod = flex_mods(shape)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=device) if mask_mod else None
    return lambda q, k, v: flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, enable_gqa=shape.group > 1
    )


def cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(len(lengths) + 1,) int32 offsets on ``device``: sequence s is rows cu[s] to cu[s + 1]."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _fa2_varlen(backend: str) -> Callable[[Shape, torch.device], Attention]:
    def build(shape: Shape, device: torch.device) -> Attention:
        cu, longest = cu_seqlens(shape.lengths, device), max(shape.lengths)
        return lambda q, k, v: tuple(
            fa2.varlen_attention(q, k, v, cu, cu, longest, longest, causal=shape.causal, backend=backend)
        )

    return build


def _sdpa_njt(shape: Shape, device: torch.device) -> Attention:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    offsets = cu_seqlens(shape.lengths, device).long()
    seqlens = {"min_seqlen": min(shape.lengths), "max_seqlen": max(shape.lengths)}  # known: no sync to find them

    def attend(q, k, v):
        q, k, v = (torch.nested.nested_tensor_from_jagged(t, offsets, **seqlens).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(backend):
            O = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        return O.transpose(1, 2).values(), None  # (B, H, j, D) -> (total, H, D)

    checked = []

    def call(q, k, v):
        if checked:
            return attend(q, k, v)
        # The first call: where the forced backend has no kernel, torch logs why (to stderr, for every
        # backend) and raises a RuntimeError that does not say; that log, caught, becomes the reason.
        with _NjtLog() as log:
            try:
                out = attend(q, k, v)
            except RuntimeError as e:
                if "No viable backend" not in str(e):
                    raise
                raise NotImplementedError(
                    f"SDPA on nested jagged tensors (torch {torch.__version__}) has no {backend.name} kernel for "
                    f"is_causal={shape.causal} here: {log.reason(backend)}"
                ) from None
        checked.append(True)
        return out

    return call


class _NjtLog:
    """Catches what torch/nested/_internal/sdpa.py logs while NJT's SDPA dispatcher picks a backend (a
    heading "<backend> kernel not used because:" per backend, its reasons below), and the warnings of the
    C++ checks, instead of printing them."""

    HEADS = {
        "FLASH_ATTENTION": "Flash attention kernel",
        "EFFICIENT_ATTENTION": "Memory efficient kernel",
        "MATH": "Math attention kernel",
        "CUDNN_ATTENTION": "cuDNN attention kernel",
    }

    def __enter__(self) -> _NjtLog:
        import logging
        import warnings

        self.lines: list[str] = []
        lines = self.lines

        class Catch(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        self.log, self.handler = logging.getLogger("torch.nested._internal.sdpa"), Catch()
        self.propagate, self.log.propagate = self.log.propagate, False
        self.log.addHandler(self.handler)
        self.warnings = warnings.catch_warnings(record=True)
        self.caught = self.warnings.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc) -> None:
        self.warnings.__exit__(*exc)
        self.log.removeHandler(self.handler)
        self.log.propagate = self.propagate

    def reason(self, backend) -> str:
        """The lines under ``backend``'s heading, then the warnings; one line."""
        head, section, inside = self.HEADS.get(backend.name, backend.name), [], False
        for line in self.lines:
            if line.endswith("not used because:"):
                inside = line.startswith(head)
            elif inside:
                section.append(line.strip())
        section += [str(w.message).splitlines()[0] for w in self.caught if str(w.message).strip()]
        return " ".join(dict.fromkeys(section)) or "torch logged no reason"


def document_ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(total,) int32: the sequence each token of a packed batch belongs to."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int32, device=device), torch.tensor(lengths, device=device)
    )


def document_mask_mod(doc: torch.Tensor, causal: bool):
    """FlexAttention's mask of a packed batch: query i sees key j of its own sequence (``doc``: document_ids),
    and with ``causal`` only j <= i (every sequence has as many queries as keys)."""
    if causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

    return mask_mod


def _flex_varlen(shape: Shape, device: torch.device) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = _compiled_flex_attention()
    n = shape.seqlen
    mask_mod = document_mask_mod(document_ids(shape.lengths, device), shape.causal)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=device)

    def call(q, k, v):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, total, D) views
        O, L = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        return O[0].transpose(0, 1), L[0]

    return call


_FP16_BF16 = ("bf16", "fp16")
_FWD_BWD = ("fwd", "bwd")
# The fp32 comparison: the CUDA-core numba kernel and the PyTorch backend, against SDPA's fp32 paths.
_NOT_IN_FP32 = "the fp32 comparison is fa2-pytorch, fa2-numba-cuda, sdpa-math and sdpa-efficient only"
_EVERY_OPTION = {"windows": True, "softcaps": True}
_FLEX_ON_CPU = (
    "compiled FlexAttention (torch.compile into Triton kernels): not run without a GPU; its eager path "
    "on the CPU is not what a user times"
)

PROVIDERS = {
    p.name: p
    for p in [
        Provider("fa2-pytorch", _fa2("pytorch"), backend="pytorch", modes=_FWD_BWD, **_EVERY_OPTION),
        Provider(
            "fa2-triton", _fa2("triton"), _FP16_BF16, _NOT_IN_FP32, backend="triton", modes=_FWD_BWD, **_EVERY_OPTION
        ),
        Provider("fa2-numba-cuda", _fa2("numba-cuda"), backend="numba-cuda", modes=_FWD_BWD, **_EVERY_OPTION),
        Provider(
            "sdpa-flash", _sdpa_flash, _FP16_BF16, "SDPA's FlashAttention-2 kernel takes fp16/bf16 only", modes=_FWD_BWD
        ),
        Provider("sdpa-cudnn", _sdpa_cudnn, _FP16_BF16, "SDPA's cuDNN kernel takes fp16/bf16 only", modes=_FWD_BWD),
        Provider("sdpa-efficient", _sdpa_efficient),
        Provider("sdpa-math", _sdpa_math, cuda_only=False, returns_lse=False, modes=_FWD_BWD),
        Provider("flex", _flex, _FP16_BF16, _NOT_IN_FP32, cuda_reason=_FLEX_ON_CPU, **_EVERY_OPTION),
    ]
}
FA2_PROVIDERS = tuple(name for name, p in PROVIDERS.items() if p.backend is not None)
# Packed batches (--varlen): each provider's packed path, forward and backward (see the module docstring).
VARLEN_PROVIDERS = {
    p.name: p
    for p in [
        Provider("fa2-pytorch", _fa2_varlen("pytorch"), backend="pytorch", modes=_FWD_BWD),
        Provider("fa2-triton", _fa2_varlen("triton"), _FP16_BF16, _NOT_IN_FP32, backend="triton", modes=_FWD_BWD),
        Provider("fa2-numba-cuda", _fa2_varlen("numba-cuda"), backend="numba-cuda", modes=_FWD_BWD),
        Provider("sdpa-njt", _sdpa_njt, cuda_only=False, returns_lse=False, modes=_FWD_BWD),
        Provider("flex", _flex_varlen, _FP16_BF16, _NOT_IN_FP32, modes=_FWD_BWD, cuda_reason=_FLEX_ON_CPU),
    ]
}


def _fa2_decode(backend: str) -> Callable[[Shape, torch.device], Callable]:
    def build(shape: Shape, device: torch.device):
        return lambda q, k, v, cache_seqlens, block_table: tuple(
            fa2.kvcache_attention(q, k, v, cache_seqlens, block_table=block_table, num_splits=0, backend=backend)
        )

    return build


def contiguous_cache(q, k, v, cache_seqlens, block_table) -> tuple[torch.Tensor, ...]:
    """A decode shape's inputs as SDPA takes them: contiguous (batch, heads[_k], seqlen, head_dim) copies."""
    if block_table is not None:
        raise NotImplementedError("a contiguous copy of a paged cache is not what a paged cache is timed against")
    return q.contiguous(), k.contiguous(), v.contiguous()


def _sdpa_decode(forced: bool) -> Callable[[Shape, torch.device], Attention]:
    def build(shape: Shape, device: torch.device) -> Attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = torch.nn.functional.scaled_dot_product_attention
        if not forced:
            return lambda q, k, v: (sdpa(q, k, v, enable_gqa=True), None)

        def call(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, enable_gqa=True), None

        return call

    return build


def _flex_decode(shape: Shape, device: torch.device) -> Attention:
    flex_attention = _compiled_flex_attention()
    return lambda q, k, v: flex_attention(q, k, v, return_lse=True, enable_gqa=shape.group > 1)


# Decoding (--decode, issue 22): every provider forward only, fa2's on contiguous and paged caches.
DECODE_PROVIDERS = {
    p.name: p
    for p in [
        Provider("fa2-pytorch", _fa2_decode("pytorch"), backend="pytorch", paged=True),
        Provider("fa2-triton", _fa2_decode("triton"), backend="triton", paged=True),
        Provider("fa2-numba-cuda", _fa2_decode("numba-cuda"), backend="numba-cuda", paged=True),
        Provider("sdpa", _sdpa_decode(False), cuda_only=False, returns_lse=False, prepare=contiguous_cache),
        Provider(
            "sdpa-flash",
            _sdpa_decode(True),
            _FP16_BF16,
            "SDPA's FlashAttention-2 kernel takes fp16/bf16 only",
            cuda_only=False,
            returns_lse=False,
            prepare=contiguous_cache,
        ),
        Provider(
            "flex",
            _flex_decode,
            _FP16_BF16,
            "FlexAttention is timed in fp16/bf16 here",
            cuda_reason=_FLEX_ON_CPU,
            prepare=contiguous_cache,
        ),
    ]
}
# What --decode times without --providers: flex compiles once per shape (tens of seconds each on the H200).
DECODE_DEFAULT_PROVIDERS = tuple(name for name in DECODE_PROVIDERS if name != "flex")
