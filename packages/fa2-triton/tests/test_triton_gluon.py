"""fa2-triton's Hopper forward in Gluon (``fa2_triton.forward_gluon``): which inputs take it (on the CPU,
whatever the GPU), that it compiles for sm_90a with the Gluon API of the Triton this runs with (wherever
Gluon is importable, a GPU or not: Gluon's API moves between releases, and this pins what the kernel uses),
and, on a Hopper GPU, that its O and L match the fp64 reference and that fa2.attention reaches it. Head dim 64
(three consumer warpgroups, 192-row query tiles, any seqlen_q) is built and checked as head dim 128, and taken
only where ``forward_gluon.HEAD_DIMS`` has it (FA2_TRITON_GLUON_D64=1). The persistent variant
(``forward_gluon.PERSISTENT``) too: its switch, its order of work tiles, its builds, and on a GPU its outputs on
1 to 3 CTAs, so that every CTA walks several work tiles."""

from __future__ import annotations

import json

import pytest
import torch
import triton

import fa2
import gluon_build
from checks import assert_matches_reference, random_qkv, run_python, values_at_import
from fa2.spec import AttentionSpec
from fa2_triton import forward_gluon
from fa2_triton.forward import flash_attn_forward

# The Gluon kernel on small inputs, which short calls pass to the tl kernel (conftest.long_calls).
pytestmark = pytest.mark.usefixtures("long_calls")

needs_gluon = pytest.mark.skipif(not forward_gluon.GLUON, reason=f"Triton {triton.__version__} has no Gluon Hopper API")
SCALE = 128**-0.5


def _qkv(
    batch, heads, heads_k, seqlen_q, seqlen_k, dtype=torch.bfloat16, device="cpu", interleaved=False, head_dim=128
):
    """q (batch, heads, seqlen_q, head_dim), k, v (batch, heads_k, seqlen_k, head_dim); interleaved: views
    of (batch, seqlen, heads, head_dim) tensors, flash-attn's layout."""
    if interleaved:
        q, k, v = random_qkv((batch, seqlen_q, heads, head_dim), (batch, seqlen_k, heads_k, head_dim), dtype, device)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return random_qkv((batch, heads, seqlen_q, head_dim), (batch, heads_k, seqlen_k, head_dim), dtype, device)


# forward_gluon's head dim 64 bounds before a fixture sets them.
_D64_BOUNDS = (forward_gluon.D64_MIN_KEYS, forward_gluon.D64_MIN_CAUSAL_QUERIES)


def _spec(group=1, window=(-1, -1), softcap=0.0, alibi=None, **packed):
    return AttentionSpec(SCALE, window, softcap, alibi, group, **packed)


TAKES = {
    "bf16-256x384": (dict(), dict(), True),
    "fp16-gqa4-384x640": (
        dict(heads=8, heads_k=2, seqlen_q=384, seqlen_k=640, dtype=torch.float16),
        dict(group=4),
        True,
    ),
    "flash-attn-layout": (dict(interleaved=True), dict(), True),
    "causal": (dict(), dict(window=(-1, 0)), False),
    "window": (dict(), dict(window=(64, 64)), False),
    "softcap": (dict(), dict(softcap=30.0), False),
    "alibi": (dict(), dict(alibi=torch.ones(2, 4)), False),
    "head_dim-64-off": (dict(head_dim=64), dict(), False),
    "seqlen_q-200": (dict(seqlen_q=200), dict(), False),
    "seqlen_k-200": (dict(seqlen_k=200), dict(), False),
    "fp32": (dict(dtype=torch.float32), dict(), False),
    "batch-0": (dict(batch=0), dict(), False),
    "packed": (
        dict(batch=1),
        dict(
            cu_seqlens_q=torch.tensor([0, 256], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 384], dtype=torch.int32),
            max_seqlen_q=256,
            max_seqlen_k=384,
        ),
        False,
    ),
}


@pytest.mark.parametrize("case", TAKES, ids=list(TAKES))
def test_which_inputs_the_gluon_kernel_takes(case, monkeypatch):
    monkeypatch.setattr(forward_gluon, "CAUSAL", False)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (128,))
    shape, spec, expected = TAKES[case]
    shape = dict(batch=2, heads=4, heads_k=4, seqlen_q=256, seqlen_k=384) | shape
    q, k, v = _qkv(**shape)
    assert forward_gluon.takes(q, k, v, _spec(**spec)) is expected


CAUSAL_TAKES = {
    "256x384": (256, 384, True),
    "256x256": (256, 256, True),
    "fewer-keys-384x256": (384, 256, False),
}


@pytest.mark.parametrize("case", CAUSAL_TAKES, ids=list(CAUSAL_TAKES))
def test_which_causal_inputs_the_gluon_kernel_takes_when_on(case, monkeypatch):
    """Causal runs on the Gluon kernel only where CAUSAL is on and no query tile lies wholly above the
    diagonal (seqlen_k >= seqlen_q); a window never does."""
    seqlen_q, seqlen_k, expected = CAUSAL_TAKES[case]
    q, k, v = _qkv(2, 4, 4, seqlen_q, seqlen_k)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    assert forward_gluon.takes(q, k, v, _spec(window=(-1, 0))) is expected
    assert not forward_gluon.takes(q, k, v, _spec(window=(64, 0))), "a window stays on the tl kernel"
    monkeypatch.setattr(forward_gluon, "CAUSAL", False)
    assert not forward_gluon.takes(q, k, v, _spec(window=(-1, 0))), "off: causal stays on the tl kernel"


D64_TAKES = {
    "bf16-256x384": (dict(), dict(), True),
    "fp16-gqa4-320x640": (
        dict(heads=8, heads_k=2, seqlen_q=320, seqlen_k=640, dtype=torch.float16),
        dict(group=4),
        True,
    ),
    "flash-attn-layout-1000x1024": (dict(seqlen_q=1000, seqlen_k=1024, interleaved=True), dict(), True),
    "seqlen_q-1": (dict(seqlen_q=1), dict(), True),
    "seqlen_q-200": (dict(seqlen_q=200), dict(), True),
    "seqlen_k-200": (dict(seqlen_k=200), dict(), False),
    "causal-320x384": (dict(seqlen_q=320), dict(window=(-1, 0)), True),
    "causal-fewer-keys-640x384": (dict(seqlen_q=640), dict(window=(-1, 0)), False),
    "window": (dict(), dict(window=(64, 0)), False),
    "softcap": (dict(), dict(softcap=30.0), False),
    "fp32": (dict(dtype=torch.float32), dict(), False),
    "head_dim-96": (dict(head_dim=96), dict(), False),
}


@pytest.mark.parametrize("case", D64_TAKES, ids=list(D64_TAKES))
def test_which_head_dim_64_inputs_the_gluon_kernel_takes_when_on(case, monkeypatch):
    """With head dim 64 in HEAD_DIMS: seqlen_q any length (its query tiles of 192 rows end in a tail),
    seqlen_k a multiple of 128, causal where seqlen_k >= seqlen_q (CAUSAL on); off (the default), none."""
    shape, spec, expected = D64_TAKES[case]
    shape = dict(batch=2, heads=4, heads_k=4, seqlen_q=256, seqlen_k=384, head_dim=64) | shape
    q, k, v = _qkv(**shape)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    assert forward_gluon.takes(q, k, v, _spec(**spec)) is expected
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (128,))
    assert not forward_gluon.takes(q, k, v, _spec(**spec)), "head dim 64 off: the tl kernel"


def test_head_dim_64_takes_a_sink_and_keeps_head_dim_128s_lengths(monkeypatch):
    """A sink at head dim 64 too; head dim 128 still asks for seqlen_q a multiple of its 128-row tiles."""
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    q, k, v = _qkv(2, 4, 4, 200, 256, head_dim=64)
    assert forward_gluon.takes(q, k, v, AttentionSpec(SCALE, sink=torch.zeros(4)))
    q, k, v = _qkv(2, 4, 4, 200, 256)
    assert not forward_gluon.takes(q, k, v, _spec())


def test_head_dim_64_is_on_unless_turned_off():
    """HEAD_DIMS, read from FA2_TRITON_GLUON_D64 at import: (64, 128) unless it is 0, then (128,)."""
    values = [None, "1", "0", "yes"]
    got = values_at_import("fa2_triton.forward_gluon", "HEAD_DIMS", "FA2_TRITON_GLUON_D64", values)
    assert got == ["(64, 128)", "(64, 128)", "(128,)", "(64, 128)"], values


@pytest.mark.parametrize(
    "head_dim, seqlen_q, seqlen_k, causal, expected",
    [
        (128, 256, 256, False, True),
        (128, 256, 256, True, True),
        (64, 128, 2048, False, False),
        (64, 1, 4096, False, True),
        (64, 4096, 4096, True, False),
        (64, 4096, 8192, True, False),
        (64, 8192, 8192, True, True),
    ],
    ids=[
        "D128-full",
        "D128-causal",
        "D64-2k-keys",
        "D64-4k-keys",
        "D64-causal-4k",
        "D64-causal-4k-of-8k",
        "D64-causal-8k",
    ],
)
def test_head_dim_64_runs_where_it_was_measured_faster(head_dim, seqlen_q, seqlen_k, causal, expected, monkeypatch):
    """``pays``: head dim 128 always; 64 from D64_MIN_KEYS keys without a mask, D64_MIN_CAUSAL_QUERIES queries
    causal (its causal band costs most where a query tile reads few key tiles), whatever the keys. The module's
    bounds as imported: the conftest's long_calls, which every test here uses, sets both to 0."""
    monkeypatch.setattr(forward_gluon, "D64_MIN_KEYS", _D64_BOUNDS[0])
    monkeypatch.setattr(forward_gluon, "D64_MIN_CAUSAL_QUERIES", _D64_BOUNDS[1])
    q = torch.empty(1, 1, seqlen_q, head_dim, dtype=torch.bfloat16)
    k = torch.empty(1, 1, seqlen_k, head_dim, dtype=torch.bfloat16)
    assert forward_gluon.pays(q, k, _spec(window=(-1, 0) if causal else (-1, -1))) is expected


def test_the_gluon_kernel_takes_no_mixed_or_strided_layouts():
    q, k, v = _qkv(2, 4, 4, 256, 256)
    assert forward_gluon.takes(q, k, v, _spec())
    _, k_i, _ = _qkv(2, 4, 4, 256, 256, interleaved=True)
    assert not forward_gluon.takes(q, k_i, v, _spec()), "k interleaved, v not: one layout switch serves both"
    wide = torch.randn(2, 4, 512, 128, dtype=torch.bfloat16)[:, :, ::2]
    assert not forward_gluon.takes(wide, k, v, _spec()), "rows 2 apart are neither layout"
    shifted = torch.randn(2 * 4 * 256 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 256, 128)
    assert not forward_gluon.takes(shifted, k, v, _spec()), "q 2 bytes off a 16-byte boundary"


def test_the_gluon_kernel_takes_no_more_than_its_grid_holds():
    """batch·heads is the grid's second axis, at most 65,535 (meta tensors: shapes without memory)."""
    q, k, v = (torch.empty(65535, 1, 128, 128, dtype=torch.bfloat16, device="meta") for _ in range(3))
    assert forward_gluon.takes(q, k, v, _spec())
    q, k, v = (torch.empty(16384, 4, 128, 128, dtype=torch.bfloat16, device="meta") for _ in range(3))
    assert not forward_gluon.takes(q, k, v, _spec())


def test_no_gluon_kernel_off_a_hopper_gpu():
    q, k, v = _qkv(2, 4, 4, 256, 256)
    assert not forward_gluon.uses_gluon(q, k, v, _spec()), "CPU tensors never take the Gluon kernel"


def _sm90a_build(
    dtype_name: str,
    q_cols: bool,
    kv_cols: bool,
    causal: bool = False,
    sink: bool = False,
    head_dim: int = 128,
    persistent: bool = False,
) -> dict:
    """The kernel (with ``sink``, ``_attn_fwd_gluon_sink``) at ``head_dim`` (its ``forward_gluon.CONFIGS``
    entry), with ``persistent`` its persistent variant, compiled for sm_90a (``gluon_build.sm90a``): registers
    and warps, local and shared memory, HGMMA count."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    config = forward_gluon.CONFIGS[head_dim]
    q_layout, kv_layout = forward_gluon._smem_layouts(dtype, head_dim)
    rows, block_n, d = forward_gluon.ROWS, forward_gluon.BLOCK_N, head_dim
    q_block = f"1, {rows}, {d}" if config.q_tail else f"{rows}, {d}"
    signature = {
        "q_desc": f"tensordesc<{dtype_name}[{q_block}],{q_layout!r}>",
        "k_desc": f"tensordesc<{dtype_name}[{block_n}, {d}],{kv_layout!r}>",
        "v_desc": f"tensordesc<{dtype_name}[{block_n}, {d}],{kv_layout!r}>",
        "o_desc": f"tensordesc<{dtype_name}[{q_block}],{q_layout!r}>",
        "L": "*fp32",
        **({"Sink": "*fp32"} if sink else {}),
        "qk_scale": "fp32",
    }
    l2_bytes = forward_gluon.L2_BYTES if persistent else 0
    constexprs = forward_gluon._constexprs(config, q_cols, kv_cols, d, causal, persistent, l2_bytes)
    fn = forward_gluon._attn_fwd_gluon_sink if sink else forward_gluon._attn_fwd_gluon
    return gluon_build.sm90a(fn, signature, constexprs, config.maxnreg)


# Local memory a thread of the persistent head dim 64 causal build: its consumers' band steps, inside the loop over
# work tiles, keep values LLVM hoists out of that loop (the mask's column indices among them) and spill: 272 B
# with Triton 3.9, 24 B with 3.6 (none in the loop of unmasked steps). Every other build has none.
PERSISTENT_D64_CAUSAL_STACK = 272


@needs_gluon
@pytest.mark.parametrize(
    "dtype, q_cols, kv_cols, causal, sink, head_dim, persistent",
    [
        ("bf16", False, False, False, False, 128, False),
        ("fp16", True, True, False, False, 128, False),
        ("bf16", False, False, True, False, 128, False),
        ("bf16", False, False, False, False, 64, False),
        ("fp16", True, True, False, True, 64, False),
        ("bf16", False, False, True, False, 64, False),
        ("fp16", True, True, True, True, 64, False),
        ("bf16", False, False, False, False, 128, True),
        ("fp16", True, True, True, True, 128, True),
        ("bf16", False, False, False, False, 64, True),
        ("bf16", False, False, True, False, 64, True),
        ("fp16", True, True, True, True, 64, True),
    ],
    ids=[
        "bf16-heads-contiguous",
        "fp16-flash-attn-layout",
        "bf16-causal",
        "D64-bf16-heads-contiguous",
        "D64-fp16-flash-attn-layout-sink",
        "D64-bf16-causal",
        "D64-fp16-flash-attn-layout-causal-sink",
        "persistent-bf16-heads-contiguous",
        "persistent-fp16-flash-attn-layout-causal-sink",
        "persistent-D64-bf16-heads-contiguous",
        "persistent-D64-bf16-causal",
        "persistent-D64-fp16-flash-attn-layout-causal-sink",
    ],
)
def test_the_gluon_kernel_compiles_for_sm90a(dtype, q_cols, kv_cols, causal, sink, head_dim, persistent):
    """ptxas's sm_90a build, the persistent variant's too: warpgroup MMAs in the SASS, no local memory (but
    the persistent head dim 64 causal build's, ``PERSISTENT_D64_CAUSAL_STACK``), the shared memory within a CTA's
    227 KB, the registers at launch its config's (``forward_gluon.CONFIGS``) and within the 64K for every warp at
    launch: at head dim 64, three consumer warpgroups and the loader's (its one warp padded to a warpgroup), 16
    warps of 128."""
    code = (
        "import json, test_triton_gluon as t; "
        "print(json.dumps(t._sm90a_build("
        f"{dtype!r}, {q_cols}, {kv_cols}, {causal}, {sink}, {head_dim}, {persistent})))"
    )
    run = run_python(code, without="TRITON_INTERPRET", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    build = json.loads(run.stdout.strip().splitlines()[-1])
    config = forward_gluon.CONFIGS[head_dim]
    assert build["hgmma"] > 0, "no warpgroup MMA in the SASS"
    stack = PERSISTENT_D64_CAUSAL_STACK if persistent and causal and head_dim == 64 else 0
    assert build["stack"] <= stack, f"{build['stack']} B of local memory a thread"
    assert build["shared"] <= 227 * 1024, f"{build['shared']} B of shared memory"
    assert build["warps"] == 4 * (config.consumers + 1), f"{build['warps']} warps at launch"
    assert build["registers"] == config.maxnreg, f"{build['registers']} registers a thread at launch"
    assert build["registers"] * build["warps"] * 32 <= 65536, "more registers at launch than an SM has"


def _hopper(device):
    if device.type != "cuda":
        pytest.skip("needs a Hopper GPU (--device cuda)")
    if not forward_gluon._on_hopper(device):
        pytest.skip(
            f"the Gluon kernel runs on compute capability 9.0 with Gluon's Hopper API "
            f"(this GPU: {torch.cuda.get_device_capability(device)}, Gluon: {forward_gluon.GLUON})"
        )


CASES = {
    "B2-H4-256x256": dict(batch=2, heads=4, heads_k=4, seqlen_q=256, seqlen_k=256),
    "gqa4-384x640": dict(batch=1, heads=8, heads_k=2, seqlen_q=384, seqlen_k=640),
    "mqa-flash-attn-layout-512x256": dict(batch=2, heads=4, heads_k=1, seqlen_q=512, seqlen_k=256, interleaved=True),
    "B3-H2-128x1024": dict(batch=3, heads=2, heads_k=2, seqlen_q=128, seqlen_k=1024),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_gluon_kernel_matches_the_reference(case, dtype, causal, device, monkeypatch):
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    q, k, v = _qkv(dtype=dtype, device=device, **CASES[case])
    spec = _spec(group=q.shape[1] // k.shape[1], window=(-1, 0) if causal else (-1, -1))
    if causal and k.shape[2] < q.shape[2]:
        assert not forward_gluon.uses_gluon(q, k, v, spec)
        pytest.skip("causal with fewer keys than queries runs the tl kernel")
    assert forward_gluon.uses_gluon(q, k, v, spec)
    O, L = flash_attn_forward(q, k, v, spec)
    assert O.is_contiguous()
    assert_matches_reference(O, L, q, k, v, causal, SCALE)


D64_CASES = {
    # One CTA, its third warpgroup's rows all past seqlen_q.
    "B2-H4-128x256": dict(batch=2, heads=4, heads_k=4, seqlen_q=128, seqlen_k=256),
    # A CTA and a tail of 128 rows; causal, the band offset by 64 keys (seqlen_k - seqlen_q).
    "gqa4-320x384": dict(batch=1, heads=8, heads_k=2, seqlen_q=320, seqlen_k=384),
    "mqa-flash-attn-layout-1024x1024": dict(
        batch=2, heads=4, heads_k=1, seqlen_q=1024, seqlen_k=1024, interleaved=True
    ),
    "B1-H2-1000x1024-flash-attn-layout": dict(
        batch=1, heads=2, heads_k=2, seqlen_q=1000, seqlen_k=1024, interleaved=True
    ),
    "B3-H2-1x640": dict(batch=3, heads=2, heads_k=2, seqlen_q=1, seqlen_k=640),
    "B2-H2-384x256": dict(batch=2, heads=2, heads_k=2, seqlen_q=384, seqlen_k=256),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D64_CASES, ids=list(D64_CASES))
def test_the_head_dim_64_gluon_kernel_matches_the_reference(case, dtype, causal, device, monkeypatch):
    """Head dim 64 (switched on): three consumer warpgroups, 192-row query tiles whose last one ends past
    seqlen_q (its O rows not written, its L rows masked: O and L start as NaN), causal with the band of two or
    three masked key tiles; against the fp64 reference."""
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    q, k, v = _qkv(dtype=dtype, device=device, head_dim=64, **D64_CASES[case])
    spec = AttentionSpec(64**-0.5, (-1, 0) if causal else (-1, -1), group=q.shape[1] // k.shape[1])
    if causal and k.shape[2] < q.shape[2]:
        assert not forward_gluon.uses_gluon(q, k, v, spec)
        pytest.skip("causal with fewer keys than queries runs the tl kernel")
    assert forward_gluon.uses_gluon(q, k, v, spec)
    O, L = flash_attn_forward(q, k, v, spec)
    assert O.is_contiguous()
    assert_matches_reference(O, L, q, k, v, causal, 64**-0.5)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (128,))
    assert not forward_gluon.uses_gluon(q, k, v, spec), "head dim 64 off: the tl kernel"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_head_dim_64_gluon_kernel_with_a_sink(dtype, causal, device, monkeypatch):
    """Head dim 64 with a sink (``_attn_fwd_gluon_sink``), GQA and a query tail."""
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    q, k, v = _qkv(2, 8, 2, 320, 512, dtype=dtype, device=device, head_dim=64)
    sink = torch.linspace(-2.0, 3.0, 8, device=device, dtype=torch.float32)
    spec = AttentionSpec(64**-0.5, (-1, 0) if causal else (-1, -1), group=4, sink=sink)
    assert forward_gluon.uses_gluon(q, k, v, spec)
    O, L = flash_attn_forward(q, k, v, spec)
    assert_matches_reference(O, L, q, k, v, causal, 64**-0.5, sink=sink)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_gluon_kernel_on_keys_of_minus_inf(dtype, device):
    """Keys whose scores are -inf for every row (k = -inf in column 0, q > 0 there), as test_hardening asks
    of every backend at D16: head 0's first key tile all -inf (its rows' attention over the other keys),
    head 1's every key (rows that see no finite score: O = 0, L = +inf)."""
    _hopper(device)
    q, k, v = _qkv(1, 2, 2, 128, 256, dtype=dtype, device=device)
    q[..., 0] = q[..., 0].abs() + 0.1
    k[:, 0, :128, 0] = -float("inf")
    k[:, 1, :, 0] = -float("inf")
    assert forward_gluon.uses_gluon(q, k, v, _spec())
    O, L = flash_attn_forward(q, k, v, _spec())
    assert_matches_reference(O[:, :1], L[:, :1], q[:, :1], k[:, :1, 128:], v[:, :1, 128:], False, SCALE)
    assert torch.equal(O[:, 1], torch.zeros_like(O[:, 1])), "no finite score: O = 0"
    assert torch.isinf(L[:, 1]).all() and (L[:, 1] > 0).all(), "no finite score: L = +inf"


def test_fa2_attention_reaches_the_gluon_kernel(device, monkeypatch):
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", False)
    calls = []
    real = forward_gluon.flash_attn_forward
    monkeypatch.setattr(forward_gluon, "flash_attn_forward", lambda *a: calls.append(1) or real(*a))
    q, k, v = _qkv(2, 4, 4, 256, 256, device=device)
    out = fa2.attention(q, k, v, scale=SCALE, backend="triton")
    assert calls == [1]
    assert_matches_reference(out.O, out.L, q, k, v, False, SCALE)
    fa2.attention(q, k, v, scale=SCALE, causal=True, backend="triton")
    assert calls == [1], "causal inputs run the tl kernel"


def test_gluon_calls_share_a_compiled_kernel_only_within_a_class(device):
    """The Gluon launch goes through fa2_triton.launch's cache: new data of one class reuses the compiled
    kernel, another dtype or layout (a constexpr) gets its own entry, and each matches the reference."""
    _hopper(device)
    from fa2_triton import launch

    def entries():
        return sum(1 for key in launch._COMPILED if key[0] is forward_gluon._attn_fwd_gluon)

    launch._COMPILED.clear()
    for n, (dtype, interleaved, seed) in enumerate(
        [(torch.bfloat16, False, 1), (torch.bfloat16, False, 2), (torch.float16, False, 3), (torch.bfloat16, True, 4)]
    ):
        q, k, v = random_qkv(
            (2, 256, 4, 128) if interleaved else (2, 4, 256, 128),
            (2, 256, 4, 128) if interleaved else (2, 4, 256, 128),
            dtype,
            device,
            seed=seed,
        )
        if interleaved:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        assert forward_gluon.uses_gluon(q, k, v, _spec())
        O, L = flash_attn_forward(q, k, v, _spec())
        assert_matches_reference(O, L, q, k, v, False, SCALE)
        assert entries() == [1, 1, 2, 3][n]


@needs_gluon
def test_gluon_plans_are_kept_per_class_of_inputs(monkeypatch):
    """The Gluon forward's plans (``forward_gluon._PLANS``), on the CPU with the launch stubbed: new data of
    one class reuses a plan, whose copied descriptors are the ones Gluon builds for the new data (fields and
    base) and whose argument classes are launch's; another layout or shape gets its own plan."""
    from fa2_triton import launch

    launches = []
    monkeypatch.setattr(forward_gluon, "launch", lambda *a: launches.append(a))
    monkeypatch.setattr(forward_gluon, "PERSISTENT", False)
    forward_gluon._PLANS.clear()

    def call(seqlen, interleaved=False, seed=0):
        q, k, v = random_qkv((1, 4, seqlen, 128), (1, 2, seqlen, 128), torch.bfloat16, "cpu", seed=seed)
        if interleaved:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert forward_gluon.takes(q, k, v, _spec(group=2))
        O, L = forward_gluon.flash_attn_forward(q, k, v, _spec(group=2))
        kernel, grid, args, constexprs, options, classes = launches[-1]
        assert kernel is forward_gluon._attn_fwd_gluon and grid == (seqlen // 128, 4)
        assert classes == launch.arg_classes(args)
        q_layout, kv_layout = forward_gluon._smem_layouts(q.dtype, 128)
        want = [
            forward_gluon.GluonTensorDescriptor.from_tensor(forward_gluon._rows_2d(t, interleaved), block, layout)
            for t, block, layout in ((q, [64, 128], q_layout), (k, [128, 128], kv_layout), (v, [128, 128], kv_layout))
        ]
        want.append(forward_gluon.GluonTensorDescriptor.from_tensor(O.view(-1, 128), [64, 128], q_layout))
        for got, ref in zip(args[:4], want):
            assert got.base.data_ptr() == ref.base.data_ptr() and got.base.shape == ref.base.shape
            assert (tuple(got.shape), tuple(got.strides), got.block_shape, got.layout, got.padding) == (
                tuple(ref.shape),
                tuple(ref.strides),
                ref.block_shape,
                ref.layout,
                ref.padding,
            )
        assert args[4] is L and args[5:] == (SCALE * forward_gluon.LOG2_E, seqlen, seqlen, 4, 2)
        assert constexprs == dict(
            Q_COLS=interleaved,
            KV_COLS=interleaved,
            HEAD_DIM=128,
            CAUSAL=False,
            NUM_CONSUMERS=2,
            STAGES=3,
            Q_TAIL=False,
            CONSUMER_REGS=240,
            PERSISTENT=False,
            L2_BYTES=0,
        )
        assert options == dict(num_warps=4, maxnreg=168)
        return list(forward_gluon._PLANS.values())

    plans = call(128, seed=1)
    assert len(plans) == 1 and plans[0].classes is not None
    assert call(128, seed=2) == plans
    assert len(call(128, interleaved=True, seed=3)) == 2
    assert len(call(256, seed=4)) == 3


@needs_gluon
@pytest.mark.parametrize("interleaved", [False, True], ids=["heads-contiguous", "flash-attn-layout"])
def test_head_dim_64_gluon_plans(interleaved, monkeypatch):
    """The head dim 64 launch, on the CPU with the launch stubbed: Q's and O's descriptors over 3-D views, a
    plane a head (contiguous) or a batch (flash-attn's layout), in blocks of [1, 64, 64]; K's and V's 2-D in
    blocks of [128, 64]; a grid of cdiv(seqlen_q, 192) query tiles; the three-consumer build's constexprs and
    its 128 registers at launch."""
    launches = []
    monkeypatch.setattr(forward_gluon, "launch", lambda *a: launches.append(a))
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    monkeypatch.setattr(forward_gluon, "PERSISTENT", False)
    forward_gluon._PLANS.clear()
    q, k, v = random_qkv((2, 4, 320, 64), (2, 2, 384, 64), torch.bfloat16, "cpu")
    if interleaved:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert forward_gluon.takes(q, k, v, _spec(group=2))
    O, L = forward_gluon.flash_attn_forward(q, k, v, _spec(group=2))
    kernel, grid, args, constexprs, options, classes = launches[-1]
    assert kernel is forward_gluon._attn_fwd_gluon and grid == (2, 8)
    q_desc, k_desc, v_desc, o_desc = args[:4]
    q_shape = (2, 320, 4 * 64) if interleaved else (8, 320, 64)
    assert tuple(q_desc.shape) == q_shape and q_desc.block_shape == [1, 64, 64]
    assert tuple(o_desc.shape) == (8, 320, 64) and o_desc.block_shape == [1, 64, 64]
    assert o_desc.base.data_ptr() == O.data_ptr() and q_desc.base.data_ptr() == q.data_ptr()
    k_shape = (2 * 384, 2 * 64) if interleaved else (2 * 2 * 384, 64)
    assert tuple(k_desc.shape) == k_shape and tuple(v_desc.shape) == k_shape and k_desc.block_shape == [128, 64]
    assert args[4] is L and args[5:] == (SCALE * forward_gluon.LOG2_E, 320, 384, 4, 2)
    assert constexprs == dict(
        Q_COLS=interleaved,
        KV_COLS=interleaved,
        HEAD_DIM=64,
        CAUSAL=False,
        NUM_CONSUMERS=3,
        STAGES=6,
        Q_TAIL=True,
        CONSUMER_REGS=160,
        PERSISTENT=False,
        L2_BYTES=0,
    )
    assert options == dict(num_warps=4, maxnreg=128)
    forward_gluon._PLANS.clear()


def test_the_persistent_grid_is_off_unless_turned_on():
    """PERSISTENT, read from FA2_TRITON_GLUON_PERSISTENT at import: on for 1 alone."""
    values = [None, "1", "0", "yes"]
    got = values_at_import("fa2_triton.forward_gluon", "PERSISTENT", "FA2_TRITON_GLUON_PERSISTENT", values)
    assert got == ["False", "True", "False", "False"], values


def _work_order(query_tiles, batch_heads, seqlen_k, head_dim, group, l2_bytes, causal):
    """Every work tile's (t, bh) in the persistent grid's order (``forward_gluon.work_tile``) and the causal
    order's heads a section."""
    section = forward_gluon.section_heads(batch_heads, seqlen_k, head_dim, group, l2_bytes)
    tiles = query_tiles * batch_heads
    return [forward_gluon.work_tile(w, query_tiles, batch_heads, section, causal) for w in range(tiles)], section


MB32 = 32 * 1024 * 1024
# (query tiles, batch·heads, seqlen_k, head_dim, group, L2 bytes): the causal order's heads a section is L2 bytes
# // (4 · head_dim) // seqlen_k · group, at least 1, at most batch·heads; all with L2 bytes 0.
WORK = {
    "D128-16-tiles-128-heads-2k": ((16, 128, 2048, 128, 1, MB32), 32),
    "D128-16-tiles-128-heads-2k-one-section": ((16, 128, 2048, 128, 1, 0), 128),
    "D128-3-tiles-8-heads-one-section": ((3, 8, 384, 128, 1, MB32), 8),
    "D128-5-tiles-7-heads-sections-of-3": ((5, 7, 20480, 128, 1, MB32), 3),
    "D128-2-tiles-5-heads-a-head-a-section": ((2, 5, 131072, 128, 1, MB32), 1),
    "D64-gqa4-4-tiles-10-heads-sections-of-8": ((4, 10, 65536, 64, 4, MB32), 8),
    "D64-1-tile-3-heads": ((1, 3, 640, 64, 1, MB32), 3),
}


@pytest.mark.parametrize("case", WORK, ids=list(WORK))
def test_the_persistent_work_order(case):
    """``work_tile``, which the kernel's ``_work`` mirrors: every (query tile, batch·head) once; without a mask
    a head's tiles in order, one head after another; causal, sections of ``section_heads`` heads, within a
    section the query tiles last first (the longest first) across its heads, so with one section across all
    heads."""
    (query_tiles, batch_heads, seqlen_k, head_dim, group, l2_bytes), section = WORK[case]
    every = {(t, bh) for t in range(query_tiles) for bh in range(batch_heads)}
    full, _ = _work_order(query_tiles, batch_heads, seqlen_k, head_dim, group, l2_bytes, False)
    assert full == [(t, bh) for bh in range(batch_heads) for t in range(query_tiles)]
    causal, got = _work_order(query_tiles, batch_heads, seqlen_k, head_dim, group, l2_bytes, True)
    assert got == section
    assert len(causal) == len(every) and set(causal) == every, "each work tile once"
    for first in range(0, batch_heads, section):
        w0 = first * query_tiles
        heads = min(section, batch_heads - first)
        part = causal[w0 : w0 + heads * query_tiles]
        assert {bh for _, bh in part} == set(range(first, first + heads)), "a section's heads together"
        assert [t for t, _ in part] == sorted((t for t, _ in part), reverse=True), "longest first in a section"
    if section == batch_heads:
        assert [t for t, _ in causal] == [t for t in reversed(range(query_tiles)) for _ in range(batch_heads)]


@pytest.mark.parametrize("ctas", [1, 2, 3, 132])
def test_every_persistent_cta_walks_its_share(ctas, monkeypatch):
    """CTA p of P takes work tiles p, p + P, ...: together every work tile once, each CTA within one of the
    others' count; the grid is PERSISTENT_CTAS (or the SMs) CTAs, never more than the work tiles."""
    monkeypatch.setattr(forward_gluon, "PERSISTENT_CTAS", ctas)
    query_tiles, batch_heads = 3, 5
    grid = forward_gluon.persistent_ctas(query_tiles * batch_heads, torch.device("cpu"))
    assert grid == min(ctas, query_tiles * batch_heads)
    walks = [list(range(p, query_tiles * batch_heads, grid)) for p in range(grid)]
    assert sorted(w for walk in walks for w in walk) == list(range(query_tiles * batch_heads))
    assert max(map(len, walks)) - min(map(len, walks)) <= 1


@needs_gluon
@pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])
def test_persistent_gluon_plans_follow_the_switch(head_dim, monkeypatch):
    """On the CPU with the launch stubbed: with PERSISTENT a grid of PERSISTENT_CTAS CTAs (at most the work
    tiles) and the PERSISTENT constexpr; toggled at run time in one process, each setting its own plan (the
    plans' key holds the switch and the CTAs), no plan dropped in between."""
    launches = []
    monkeypatch.setattr(forward_gluon, "launch", lambda *a: launches.append(a))
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    forward_gluon._PLANS.clear()
    q, k, v = random_qkv((2, 4, 320 if head_dim == 64 else 256, head_dim), (2, 2, 384, head_dim), torch.bfloat16, "cpu")
    query_tiles = 2
    spec = _spec(group=2, window=(-1, 0))
    assert forward_gluon.takes(q, k, v, spec)
    settings = [
        (False, None, MB32),
        (True, 3, MB32),
        (True, 100, MB32),
        (True, 3, 0),
        (False, None, MB32),
        (True, 3, MB32),
    ]
    for persistent, ctas, l2_bytes in settings:
        monkeypatch.setattr(forward_gluon, "PERSISTENT", persistent)
        monkeypatch.setattr(forward_gluon, "PERSISTENT_CTAS", ctas)
        monkeypatch.setattr(forward_gluon, "L2_BYTES", l2_bytes)
        forward_gluon.flash_attn_forward(q, k, v, spec)
        kernel, grid, args, constexprs, options, classes = launches[-1]
        want = (min(ctas, query_tiles * 8),) if persistent else (query_tiles, 8)
        assert grid == want and constexprs["PERSISTENT"] is persistent and constexprs["CAUSAL"] is True
        assert constexprs["L2_BYTES"] == (l2_bytes if persistent else 0)
    assert len(forward_gluon._PLANS) == 4, "one plan a setting"
    forward_gluon._PLANS.clear()


PERSISTENT_CASES = {
    # 2 query tiles x 8 heads (16 work tiles; causal, one section: the longest first across all heads).
    "D128-B2-H4-256x256": dict(batch=2, heads=4, heads_k=4, seqlen_q=256, seqlen_k=256),
    "D128-gqa4-384x640-fp16": dict(batch=1, heads=8, heads_k=2, seqlen_q=384, seqlen_k=640, dtype=torch.float16),
    "D128-mqa-flash-attn-layout-512x512": dict(
        batch=2, heads=3, heads_k=1, seqlen_q=512, seqlen_k=512, interleaved=True
    ),
    # Causal, 10 heads in sections of 4, 4 and 2 (L2_BYTES // (4 · 128) // 16384 = 4).
    "D128-B2-H5-256x16384-sections": dict(batch=2, heads=5, heads_k=5, seqlen_q=256, seqlen_k=16384),
    "D128-B2-H4-256x384-sink": dict(batch=2, heads=4, heads_k=4, seqlen_q=256, seqlen_k=384, sink=True),
    # A tail of 128 rows past one 192-row tile; the band offset by 64 keys.
    "D64-gqa4-320x384": dict(batch=1, heads=8, heads_k=2, seqlen_q=320, seqlen_k=384, head_dim=64),
    "D64-flash-attn-layout-1000x1024-fp16": dict(
        batch=1, heads=2, heads_k=2, seqlen_q=1000, seqlen_k=1024, interleaved=True, head_dim=64, dtype=torch.float16
    ),
    # Causal, 12 heads in sections of 8 and 4 (L2_BYTES // (4 · 64) // 16384 = 8).
    "D64-B2-H6-320x16384-sections": dict(batch=2, heads=6, heads_k=6, seqlen_q=320, seqlen_k=16384, head_dim=64),
    "D64-gqa4-B2-320x512-sink": dict(batch=2, heads=8, heads_k=2, seqlen_q=320, seqlen_k=512, head_dim=64, sink=True),
}


@pytest.mark.parametrize("ctas", [1, 2, 3], ids=["1-CTA", "2-CTAs", "3-CTAs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=list(PERSISTENT_CASES))
def test_the_persistent_gluon_kernel_matches_the_reference(case, causal, ctas, device, monkeypatch):
    """The persistent variant (PERSISTENT) on 1, 2 and 3 CTAs, so that each walks several work tiles: the K/V
    ring, Q's barriers and the turns run on across them, Q's buffer reloaded once the O stored from it is read;
    O and L (poisoned NaN first) against the fp64 reference; causal in both orders (L2_BYTES 0: one section).
    The switch is set at run time, no plan dropped."""
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    monkeypatch.setattr(forward_gluon, "HEAD_DIMS", (64, 128))
    monkeypatch.setattr(forward_gluon, "PERSISTENT", True)
    monkeypatch.setattr(forward_gluon, "PERSISTENT_CTAS", ctas)
    shape = dict(PERSISTENT_CASES[case])
    sink = shape.pop("sink", False)
    q, k, v = _qkv(device=device, **shape)
    head_dim = q.shape[-1]
    sinks = torch.linspace(-2.0, 3.0, q.shape[1], device=device, dtype=torch.float32) if sink else None
    spec = AttentionSpec(head_dim**-0.5, (-1, 0) if causal else (-1, -1), group=q.shape[1] // k.shape[1], sink=sinks)
    assert forward_gluon.uses_gluon(q, k, v, spec)
    extra = {} if sinks is None else dict(sink=sinks)
    # Causal, the default order (heads in L2 sections) and the longest tiles first across all heads.
    for l2_bytes in (forward_gluon.L2_BYTES, 0) if causal else (forward_gluon.L2_BYTES,):
        monkeypatch.setattr(forward_gluon, "L2_BYTES", l2_bytes)
        O, L = flash_attn_forward(q, k, v, spec)
        assert O.is_contiguous()
        assert_matches_reference(O, L, q, k, v, causal, head_dim**-0.5, **extra)


def test_the_persistent_switch_at_run_time(device, monkeypatch):
    """One process, one class of inputs: off, on (2 CTAs), off again; each call against the reference."""
    _hopper(device)
    monkeypatch.setattr(forward_gluon, "CAUSAL", True)
    monkeypatch.setattr(forward_gluon, "PERSISTENT_CTAS", 2)
    q, k, v = _qkv(2, 4, 4, 384, 512, device=device)
    spec = _spec(window=(-1, 0))
    for persistent in (False, True, False, True):
        monkeypatch.setattr(forward_gluon, "PERSISTENT", persistent)
        O, L = flash_attn_forward(q, k, v, spec)
        assert_matches_reference(O, L, q, k, v, True, SCALE)
