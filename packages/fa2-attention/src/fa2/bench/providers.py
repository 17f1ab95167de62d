"""What the benchmark compares: fa2's backends, and the attention a user would pick instead.

Every provider returns O and the natural-log logsumexp L from (batch, heads, seqlen, head_dim) contiguous
inputs. The baselines are forced explicitly, each through the aten op of one SDPA backend (never the
dispatcher), so that a kernel that cannot run fails instead of falling back to another.

    fa2-pytorch, fa2-triton, fa2-numba-cuda   fa2.attention(q, k, v, causal=..., backend=...)
    sdpa-flash       torch.ops.aten._scaled_dot_product_flash_attention (FlashAttention-2 in PyTorch)
    sdpa-cudnn       torch.ops.aten._scaled_dot_product_cudnn_attention; its L comes back (B, H, N, 1)
    sdpa-efficient   torch.ops.aten._scaled_dot_product_efficient_attention (memory-efficient, CUTLASS)
    sdpa-math        torch.ops.aten._scaled_dot_product_attention_math: materialises the scores and
                     returns O and the attention weights, not L; its check covers O only
    flex             FlexAttention compiled with torch.compile, return_lse=True, causal through a block
                     mask made once per shape

SDPA's causal mask is aligned top-left and fa2's bottom-right; they agree because every benchmark shape
has seqlen_q = seqlen_k. With ``--group`` (grouped-query attention) k and v have fewer heads: the fa2
backends, sdpa-flash and sdpa-cudnn take them as they are (an op that refuses them is recorded as failed),
sdpa-math and flex with ``enable_gqa=True``.

Mode ``bwd`` times the backward alone: the provider's forward runs once on inputs that require grad, then
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)`` is timed. It runs for the fa2 backends and
for sdpa-flash, sdpa-cudnn and sdpa-math, whose aten ops above are what ``F.scaled_dot_product_attention``
calls under ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` (``CUDNN_ATTENTION``, ``MATH``): their autograd
runs FlashAttention-2's, cuDNN's and the math backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

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

    @property
    def heads_k(self) -> int:
        return self.heads // self.group

    @property
    def flops(self) -> int:
        """4·B·H·N²·D (two matmuls), halved when causal; the backward 2.5 times that (five matmuls)."""
        flops = 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim
        flops = flops // 2 if self.causal else flops
        return flops * 5 // 2 if self.mode == "bwd" else flops

    @property
    def work(self) -> int:
        """B·H·N²·D, the measure of the emulators' budgets (as in shared_tests)."""
        return self.batch * self.heads * self.seqlen**2 * self.head_dim

    def __str__(self) -> str:
        causal = "causal" if self.causal else "full"
        heads = f"H{self.heads}" + (f"/{self.heads_k}" if self.group > 1 else "")
        return f"{self.mode} {self.dtype} B{self.batch} {heads} N{self.seqlen} D{self.head_dim} {causal}"


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

    def unavailable(self, device: torch.device) -> str | None:
        """Why this provider cannot run at all on ``device``, or None."""
        if self.backend is not None:
            return _fa2_unavailable(self.backend, device)
        if self.cuda_only and device.type != "cuda":
            return "a CUDA kernel: not run without a GPU"
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


def _fa2(backend: str) -> Callable[[Shape, torch.device], Attention]:
    def build(shape: Shape, device: torch.device) -> Attention:
        return lambda q, k, v: fa2.attention(q, k, v, causal=shape.causal, backend=backend)

    return build


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
            q, k, v, None, 0.0, shape.causal, enable_gqa=shape.group > 1)
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


def _flex(shape: Shape, device: torch.device) -> Attention:
    from torch.nn.attention.flex_attention import create_block_mask

    flex_attention = _compiled_flex_attention()
    n = shape.seqlen
    block_mask = create_block_mask(_causal_mask_mod, None, None, n, n, device=device) if shape.causal else None
    return lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                          enable_gqa=shape.group > 1)


_FP16_BF16 = ("bf16", "fp16")
_FWD_BWD = ("fwd", "bwd")
# The fp32 comparison: the CUDA-core numba kernel and the PyTorch backend, against SDPA's fp32 paths.
_NOT_IN_FP32 = "the fp32 comparison is fa2-pytorch, fa2-numba-cuda, sdpa-math and sdpa-efficient only"

PROVIDERS = {
    p.name: p
    for p in [
        Provider("fa2-pytorch", _fa2("pytorch"), backend="pytorch", modes=_FWD_BWD),
        Provider("fa2-triton", _fa2("triton"), _FP16_BF16, _NOT_IN_FP32, backend="triton", modes=_FWD_BWD),
        Provider("fa2-numba-cuda", _fa2("numba-cuda"), backend="numba-cuda", modes=_FWD_BWD),
        Provider("sdpa-flash", _sdpa_flash, _FP16_BF16, "SDPA's FlashAttention-2 kernel takes fp16/bf16 only",
                 modes=_FWD_BWD),
        Provider("sdpa-cudnn", _sdpa_cudnn, _FP16_BF16, "SDPA's cuDNN kernel takes fp16/bf16 only",
                 modes=_FWD_BWD),
        Provider("sdpa-efficient", _sdpa_efficient),
        Provider("sdpa-math", _sdpa_math, cuda_only=False, returns_lse=False, modes=_FWD_BWD),
        Provider("flex", _flex, _FP16_BF16, _NOT_IN_FP32),
    ]
}
FA2_PROVIDERS = tuple(name for name, p in PROVIDERS.items() if p.backend is not None)
