"""KV-cache decoding captured in a CUDA graph (issue 22, item 3): a replay equals the eager call.

A decode step that syncs with the host, or allocates outside torch's caching allocator, or launches on a
stream other than torch's current one, cannot be captured; one that reads a value on the host at capture
time would replay that value forever. So each case captures ``fa2.kvcache_attention`` (rotary, append,
split-KV, combine) once, on every backend (the issue asks it of fa2-triton's and fa2-numba-cuda's kernels;
fa2-pytorch's torch ops are held to it as well), then changes every input in place (queries, new keys and
values, the cache lengths), replays, and compares O, L and the caches bit for bit with an eager call on a copy of the
caches as they were before the replay. GPU only: CPU tensors have no graphs, and the emulators no streams.
"""

from __future__ import annotations

import pytest
import torch

import fa2

pytestmark = pytest.mark.gpu

CASES = {
    # (batch, heads, heads_k, seqlen_q, head_dim, capacity, page_size or None, seqlen_new, rotary)
    "contiguous-gqa-one-token": (3, 8, 2, 1, 64, 300, None, 1, False),
    "contiguous-mqa-rotary-4-tokens": (2, 4, 1, 4, 128, 257, None, 4, True),
    "paged16-gqa-one-token": (3, 8, 2, 1, 128, 512, 16, 1, False),
    "paged256-rotary-2-tokens": (2, 6, 3, 2, 64, 1024, 256, 2, True),
}


def _inputs(case, device, dtype, generator):
    batch, heads, heads_k, seqlen_q, head_dim, capacity, page_size, seqlen_new, rotary = case

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    if page_size is None:
        k_cache = randn(batch, capacity, heads_k, head_dim).transpose(1, 2)
        v_cache = randn(batch, capacity, heads_k, head_dim).transpose(1, 2)
        table = None
    else:
        per_seq = -(-capacity // page_size)
        pages = batch * per_seq + 5
        k_cache = randn(pages, page_size, heads_k, head_dim).transpose(1, 2)
        v_cache = randn(pages, page_size, heads_k, head_dim).transpose(1, 2)
        table = torch.randperm(pages, device=device, generator=generator)[: batch * per_seq]
        table = table.reshape(batch, per_seq).to(torch.int32)
        capacity = per_seq * page_size
    cos = sin = None
    if rotary:
        angle = torch.rand(capacity, head_dim // 4, device=device, generator=generator) * 6.28
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    statics = dict(
        q=randn(batch, heads, seqlen_q, head_dim),
        k=randn(batch, heads_k, seqlen_new, head_dim),
        v=randn(batch, heads_k, seqlen_new, head_dim),
        cache_seqlens=torch.zeros(batch, device=device, dtype=torch.int32),
    )
    return k_cache, v_cache, table, cos, sin, statics, capacity - seqlen_new


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_replay_equals_eager(backend, case, dtype, device):
    generator = torch.Generator(device=device).manual_seed(0)
    k_cache, v_cache, table, cos, sin, x, room = _inputs(case, device, dtype, generator)

    def call(kc, vc):
        return fa2.kvcache_attention(
            x["q"],
            kc,
            vc,
            x["cache_seqlens"],
            k=x["k"],
            v=x["v"],
            rotary_cos=cos,
            rotary_sin=sin,
            rotary_interleaved=True,
            block_table=table,
            causal=True,
            backend=backend,
        )

    # Compile every kernel outside the capture (on copies, so that the cache under test keeps its values).
    for _ in range(2):
        call(k_cache.clone(), v_cache.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(k_cache, v_cache)
    for step, lengths in enumerate(([0, room, room // 2], [room // 3, 1, room])):
        x["q"].copy_(torch.randn(x["q"].shape, device=device, generator=generator))
        x["k"].copy_(torch.randn(x["k"].shape, device=device, generator=generator))
        x["v"].copy_(torch.randn(x["v"].shape, device=device, generator=generator))
        x["cache_seqlens"].copy_(torch.tensor(lengths[: x["q"].shape[0]], dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        expected = call(k_before, v_before)
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_before), f"replay {step}: the appended keys differ from the eager call's"
        assert torch.equal(v_cache, v_before), f"replay {step}: the appended values differ from the eager call's"
        assert torch.equal(captured.O, expected.O), f"replay {step}: O differs from the eager call's"
        assert torch.equal(captured.L, expected.L), f"replay {step}: L differs from the eager call's"
        assert torch.isfinite(expected.O).all(), f"replay {step}: O has non-finite entries"
