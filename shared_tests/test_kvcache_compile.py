"""``fa2.kvcache_attention`` under ``torch.compile(fullgraph=True)``, for every backend (issue 39): a decode
step traces as one graph holding the backend's fa2::<name>_kvcache_fwd op (fa2.ops), gives eager's bits (O, L
and the caches after the append), and is not traced again when only cache_seqlens' values change, as a
static cache's decode loop does; and the op passes torch.library.opcheck.

The compiled function runs on a graph-recording dynamo backend (no Inductor): what is checked is the trace,
and the op runs the backend's own kvcache_forward, so the CPU cost is that of the eager calls.
"""

from __future__ import annotations

import pytest
import torch

import fa2
from checks import random_qkv
from fa2 import ops
from test_conformance import require_runnable, simulated_subset

# (batch, heads, heads_k, head_dim, capacity): grouped-query heads, a capacity of a few key tiles.
SHAPE = (2, 4, 2, 16, 32)
PAGE = 8
# Each row's keys before the append, on the first call and on the second (same shapes, other values),
# and each row's first key (cache_leftpad).
SEQLENS = ([5, 20], [6, 27])
LEFTPAD = [2, 0]

CACHES = [
    pytest.param(None, False, id="contiguous"),
    pytest.param(None, True, id="contiguous-rotary"),
    pytest.param(PAGE, False, id=f"paged{PAGE}"),
]


def _skip_refusal(backend, fn, *args):
    """fn(*args); a backend's documented refusal (NotImplementedError) becomes a skip."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        pytest.skip(f"{backend} refuses: {e}")


def _inputs(device, page, seed):
    """q, k_cache, v_cache, the new k and v (one token a row), block_table (None for a contiguous cache): q
    and the caches as transposed views of flash-attn's (.., seqlen, heads, d) layout."""
    b, h, hk, d, cap = SHAPE
    q, k, v = random_qkv((b, h, 1, d), (b, hk, 1, d), torch.float32, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if page is None:
        cache_shape, block_table = (b, cap, hk, d), None
    else:
        num_pages = b * cap // page + 2  # pages no row uses
        cache_shape = (num_pages, page, hk, d)
        block_table = torch.randperm(num_pages, generator=g)[: b * cap // page].view(b, -1)
        block_table = block_table.to(device, torch.int32)
    k_cache, v_cache = (torch.randn(cache_shape, generator=g).to(device).transpose(1, 2) for _ in range(2))
    return q, k_cache, v_cache, k, v, block_table


def _rotary(device):
    """cos, sin (capacity, rotary_dim / 2) for rotary_dim 8."""
    angles = torch.arange(SHAPE[4])[:, None] * 0.1 ** torch.arange(4)[None]
    return angles.cos().to(device), angles.sin().to(device)


def _decode_step(q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad, block_table, cos, sin, backend):
    return fa2.kvcache_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        block_table=block_table,
        cache_leftpad=cache_leftpad,
        causal=True,
        backend=backend,
    )


@pytest.mark.parametrize("page, rotary", CACHES)
def test_decode_step_compiles_once(backend, status, device, page, rotary):
    """fullgraph=True raises on any graph break; the one graph calls the backend's KV-cache op and gives
    eager's O, L and caches, for two sets of cache_seqlens values without a second trace."""
    b, h, _, d, cap = SHAPE
    require_runnable(backend, status, device, torch.float32, (b, h, 1, cap, d))
    # The graph and its op are the same for every backend: the simulator leaves them to the GPU (10 s a case).
    simulated_subset(backend, status, False, "none: the compiled graph is every backend's, tested on the others")
    op = _skip_refusal(backend, ops.load_kvcache, backend)
    cos, sin = _rotary(device) if rotary else (None, None)
    leftpad = torch.tensor(LEFTPAD, dtype=torch.int32, device=device)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_decode_step, fullgraph=True, backend=record)
    for step, seqlens in enumerate(SEQLENS):
        q, k_cache, v_cache, k, v, block_table = _inputs(device, page, seed=step)
        seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, seqlens, k, v, leftpad, block_table, cos, sin, backend)
        eager_caches = k_cache.clone(), v_cache.clone()
        expected = _skip_refusal(backend, _decode_step, q, *eager_caches, *args[3:])
        O, L = compiled(*args)
        assert len(graphs) == 1, f"traced again at step {step} (cache_seqlens {seqlens.tolist()})"
        assert torch.equal(O, expected.O) and torch.equal(L, expected.L)
        assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])
    called = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert op in called, f"no fa2 KV-cache op in the graph: {called}"


def test_opcheck_kvcache(backend, status, device):
    """Schema, fake tensor (shapes, dtypes, strides of O and L), autograd registration and AOT dispatch of
    fa2::<name>_kvcache_fwd on a paged cache with cache_leftpad, causal."""
    b, h, _, d, cap = SHAPE
    require_runnable(backend, status, device, torch.float32, (b, h, 1, cap, d))
    if backend == "numba-cuda" and status == "emulated":
        pytest.skip("numba-cuda's simulator: opcheck runs the op a dozen times; this case runs on the GPU")
    op = _skip_refusal(backend, ops.load_kvcache, backend)
    q, k_cache, v_cache, _, _, block_table = _inputs(device, PAGE, seed=0)
    seqlens = torch.tensor(SEQLENS[0], dtype=torch.int32, device=device)
    leftpad = torch.tensor(LEFTPAD, dtype=torch.int32, device=device)
    # cache_seqlens, cache_leftpad, cache_batch_idx, block_table, num_splits, then fa2.ops' options: alibi_slopes,
    # scale, window_left, window_right (causal), softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k.
    args = (q, k_cache, v_cache, seqlens, leftpad, None, block_table, 2, None, 0.25, -1, 0, 0.0, None, None, 0, 0)
    _skip_refusal(backend, op, *args)
    torch.library.opcheck(op, args)
