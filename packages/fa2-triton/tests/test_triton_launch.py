"""fa2-triton's launch cache (``fa2_triton.launch``): it reuses a compiled kernel for every call whose
arguments fall in one class, so the class must be at least as fine as what Triton specialises a
compilation on. Checked against Triton's own classifier on the CPU (any Triton version this runs with),
and on a GPU by calls that must, and must not, share a compiled kernel. Also what the kernels refuse to
run: bfloat16 in the interpreter, whose bf16 tl.dot is wrong."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import fa2
import fa2_triton
from checks import assert_matches_reference, random_qkv
from fa2.spec import AttentionSpec
from fa2_triton import backward, backward_gluon, forward, forward_gluon, kvcache, launch, tiles
from fa2_triton.common import INTERPRETED
from test_gradients import assert_grads_match

INTS = [
    0,
    1,
    2,
    8,
    15,
    16,
    17,
    32,
    48,
    200,
    208,
    2**31 - 16,
    2**31 - 1,
    2**31,
    2**31 + 16,
    2**32,
    2**63 - 16,
    2**63,
    2**63 + 16,
    -1,
    -16,
    -(2**31),
    -(2**31) - 16,
]
FLOATS = [0.0, 0.5, -1.25]


def _tensors():
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.zeros(64, dtype=dtype)
        out += [t, t[1:], t[8:]]
    return out


def _descriptors():
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for shape in ((2, 3, 64, 64), (1, 1, 48, 64), (2, 3, 200, 64)):
            t = torch.zeros(shape, dtype=dtype)
            for rows in (16, 64):
                out.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, 64]))
    if launch.GluonTensorDescriptor is not None:  # the Gluon kernel's 2-D descriptors, with their layouts
        from triton.experimental.gluon import language as gl

        for dtype, gl_dtype in ((torch.float16, gl.float16), (torch.bfloat16, gl.bfloat16)):
            for shape in ((512, 128), (384, 128), (512, 512)):
                t = torch.zeros(shape, dtype=dtype)
                for rows in (64, 128):
                    layout = gl.NVMMASharedLayout.get_default_for([rows, 128], gl_dtype)
                    out.append(launch.GluonTensorDescriptor.from_tensor(t, [rows, 128], layout))
    return out


def test_arg_class_is_at_least_as_fine_as_tritons():
    """Any two arguments of one class get the same specialisation from Triton: a kernel compiled for one
    is the kernel Triton would run for the other."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError as e:
        pytest.skip(f"this Triton has no native_specialize_impl to compare with ({e})")

    def tritons(arg):
        return native_specialize_impl(BaseBackend, arg, False, True, True)

    samples = INTS + FLOATS + _tensors() + _descriptors()
    shared = 0
    for a, b in itertools.combinations(samples, 2):
        if launch.arg_class(a) == launch.arg_class(b):
            shared += 1
            assert tritons(a) == tritons(b), (a, b, launch.arg_class(a))
    # Not vacuous: classes do merge values (e.g. 32 and 48, two aligned fp16 tensors).
    assert shared > 20


def test_launch_classifies_as_arg_class():
    """The classes launch() keys its cache on, computed inline for speed, are arg_class's, met once or
    again (the integers' memo), for tensor subclasses too."""
    samples = INTS + FLOATS + _tensors() + _descriptors() + [torch.nn.Parameter(torch.zeros(8))]
    want = tuple(launch.arg_class(a) for a in samples)
    assert launch.arg_classes(tuple(samples)) == want
    assert launch.arg_classes(tuple(samples)) == want
    with pytest.raises(TypeError, match="no argument class for bool"):
        launch.arg_classes((1, True))


def test_arg_class_refuses_what_it_cannot_classify():
    with pytest.raises(TypeError, match="no argument class for bool"):
        launch.arg_class(True)


@pytest.mark.gpu
def test_calls_share_a_compiled_kernel_only_within_a_class(device, long_calls):
    """New data of the same class reuses the cached kernel; a seqlen that changes divisibility by 16, or
    misaligned data (which also leaves the descriptor path), gets its own entry. Each matches the
    reference."""
    if fa2_triton.availability()[0] != "native":
        pytest.skip("fa2-triton does not run natively here")
    launch._COMPILED.clear()

    def forward(n, seed, misaligned=False):
        q, k, v = random_qkv((2, 3, n, 64), (2, 3, n, 64), torch.bfloat16, device, seed=seed)
        if misaligned:
            buf = torch.empty(q.numel() + 1, device=device, dtype=q.dtype)
            q = buf[1:].view(q.shape).copy_(q)
            assert q.data_ptr() % 16
        O, L = fa2_triton.flash_attn_forward(q, k, v, AttentionSpec(0.125, (-1, 0)))
        assert_matches_reference(O, L, q, k, v, True, scale=0.125)
        return len(launch._COMPILED)

    assert forward(200, seed=1) == 1
    assert forward(200, seed=2) == 1
    assert forward(208, seed=3) == 2
    assert forward(200, seed=4, misaligned=True) == 3


def test_forward_plans_are_kept_per_class_of_inputs(device, long_calls):
    """The forward's plans (``forward._PLANS``): new data of one shape, strides and alignment reuses a plan;
    misaligned data of that shape gets its own, without host descriptors; a new shape its own. Each call
    matches the reference, and the plan's argument classes are what launch() computes (it checks them when
    it first meets a class)."""
    if fa2_triton.availability()[0] == "unavailable":
        pytest.skip("fa2-triton cannot run here")
    dtype = torch.float16
    forward._PLANS.clear()

    def call(n, seed, misaligned=False):
        q, k, v = random_qkv((1, 2, n, 64), (1, 2, n, 64), dtype, device, seed=seed)
        if misaligned:
            buf = torch.empty(q.numel() + 1, device=device, dtype=dtype)
            q = buf[1:].view(q.shape).copy_(q)
            assert q.data_ptr() % 16
        O, L = fa2_triton.flash_attn_forward(q, k, v, AttentionSpec(0.125, (-1, 0)))
        assert_matches_reference(O, L, q, k, v, True, scale=0.125)
        return list(forward._PLANS.values())

    plans = call(32, seed=1)
    assert len(plans) == 1 and plans[0].classes is not None
    assert (plans[0].descriptors is not None) == plans[0].use_tma
    assert call(32, seed=2) == plans
    plans = call(32, seed=3, misaligned=True)
    assert len(plans) == 2 and plans[1].descriptors is None
    assert len(call(48, seed=4)) == 3


@pytest.mark.parametrize(
    "deterministic, short, launches",
    [(True, True, 1), (True, False, 3), (False, True, 2)],
    ids=["one-launch", "three-launches", "atomic-dq"],
)
def test_backward_plans_are_kept_per_class_of_inputs(device, request, deterministic, short, launches):
    """The backward's launches (``backward._PLANS``, one per kernel: the one launch of a short call, the three
    of a longer one, or two with atomic dq): new data of one shape reuses them, misaligned data of that shape
    too (the tensors' classes are taken on every call), a new shape gets its own. The gradients match the
    reference each time, and each plan's scalar classes are launch's."""
    if fa2_triton.availability()[0] == "unavailable":
        pytest.skip("fa2-triton cannot run here")
    if not short:
        request.getfixturevalue("long_calls")
    dtype = torch.float16
    backward._PLANS.clear()

    def call(n, seed, misaligned=False):
        q, k, v = random_qkv((1, 2, n, 16), (1, 1, n, 16), dtype, device, seed=seed)
        dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
        if misaligned:
            buf = torch.empty(dO.numel() + 1, device=device, dtype=dtype)
            dO = buf[1:].view(dO.shape).copy_(dO)
            assert dO.data_ptr() % 16
        spec = AttentionSpec(0.25, (-1, 0), group=2)
        O, L = fa2_triton.flash_attn_forward(q, k, v, spec)
        dq, dk, dv = backward.flash_attn_backward(q, k, v, O, L, dO, spec, deterministic=deterministic)
        assert_grads_match(dq, dk, dv, q, k, v, dO, True, scale=0.25)
        return dict(backward._PLANS)

    plans = call(32, seed=1)
    assert len(plans) == launches
    assert all(p.scalar_classes == launch.arg_classes(p.scalars) for p in plans.values())
    assert call(32, seed=2) == plans
    assert call(32, seed=3, misaligned=True) == plans
    assert len(call(48, seed=4)) == 2 * len(plans)


def _backward_case(name, dtype, head_dim, heads_k=2, causal=False, **options):
    return pytest.param(dtype, head_dim, heads_k, causal, options, id=name)


@pytest.mark.parametrize(
    "dtype, head_dim, heads_k, causal, options",
    [
        _backward_case("fp16-D32-full", torch.float16, 32),
        _backward_case("fp16-D32-causal-GQA", torch.float16, 32, heads_k=1, causal=True),
        _backward_case("fp32-D40-causal", torch.float32, 40, causal=True),
        _backward_case("fp16-D16-window", torch.float16, 16, window=(7, 3)),
        _backward_case("fp16-D16-softcap", torch.float16, 16, softcap=5.0),
        _backward_case("fp32-D16-alibi-causal", torch.float32, 16, causal=True, alibi=True),
        _backward_case("fp16-D32-varlen-causal", torch.float16, 32, causal=True, varlen=True),
    ],
)
def test_one_launch_backward_equals_three(device, monkeypatch, dtype, head_dim, heads_k, causal, options):
    """A short call's one launch (``backward.launch_short``, delta from O in each program) against the three
    launches the same inputs take when counted long (preprocess, dQ, dK/dV; on a Hopper GPU the long rule may
    send them to the Gluon kernels), with every option the one launch takes: the same gradients up to the
    order of delta's fp32 sums (a few units in the last place of the dtype, relative to the largest
    gradient). The shared suite checks the one launch against the reference."""
    if fa2_triton.availability()[0] == "unavailable":
        pytest.skip("fa2-triton cannot run here")
    heads, n_q, n_k = 4, 37, 45
    options = dict(options)
    varlen, alibi = options.pop("varlen", False), options.pop("alibi", False)
    batch = 1 if varlen else 2
    q, k, v = random_qkv((batch, heads, n_q, head_dim), (batch, heads_k, n_k, head_dim), dtype, device, seed=3)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    window = options.pop("window", (-1, 0 if causal else -1))
    spec = dict(group=heads // heads_k, **options)
    if alibi:
        spec["alibi_slopes"] = torch.rand(batch, heads, generator=torch.Generator().manual_seed(5)).to(device)
    if varlen:
        spec.update(
            cu_seqlens_q=torch.tensor([0, 10, 11, n_q], dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, 20, 21, n_k], dtype=torch.int32, device=device),
            max_seqlen_q=26,
            max_seqlen_k=24,
        )
    spec = AttentionSpec(head_dim**-0.5, window, **spec)
    O, L = fa2_triton.flash_attn_forward(q, k, v, spec)
    launched, one_launch = [], backward.launch_short
    monkeypatch.setattr(backward, "launch_short", lambda *args: launched.append(one_launch(*args)))
    one = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    assert len(launched) == 1, "a short call takes the one launch"
    monkeypatch.setattr(tiles, "SHORT_CALL_PAIRS", -1)
    three = backward.flash_attn_backward(q, k, v, O, L, dO, spec)
    assert len(launched) == 1, "a long call takes the three launches"
    for name, a, b in zip(("dq", "dk", "dv"), one, three):
        assert not torch.isnan(a).any(), f"NaN in {name}"
        tol = 4 * torch.finfo(dtype).eps * b.abs().max().item()
        assert (a - b).abs().max().item() <= tol, f"{name}: one launch and three differ by more than {tol:.3g}"


def test_short_calls_read_through_pointers(device, monkeypatch):
    """A short call (``tiles.short_call``: bound by the host) at the default tiles reads through pointers
    where the same inputs counted long take host descriptors (wherever ``tiles.tma_layout`` allows them);
    both match the reference. The Gluon kernels, forward and backward, pass short calls to the tl ones."""
    if fa2_triton.availability()[0] == "unavailable":
        pytest.skip("fa2-triton cannot run here")

    def shapes(q, k):
        return tiles.short_call(torch.empty(q, device="meta"), torch.empty(k, device="meta"))

    assert shapes((1, 16, 256, 64), (1, 16, 256, 64)), "2^20 pairs and 2^13 rows: short"
    assert not shapes((1, 16, 512, 64), (1, 16, 512, 64)), "2^22 pairs: long"
    assert not shapes((1, 1, 1, 64), (1, 1, 2**17, 64)), "one query over 2^17 keys: long by its rows"

    default = tiles.SHORT_CALL_PAIRS
    q, k, v = random_qkv((1, 2, 64, 64), (1, 2, 64, 64), torch.float16, device, seed=5)
    spec = AttentionSpec(0.125)
    taken = []
    real_launch = forward.launch
    monkeypatch.setattr(forward, "launch", lambda *a: taken.append(a[3]["USE_TMA"]) or real_launch(*a))
    forward._PLANS.clear()
    for pairs in (default, -1):
        monkeypatch.setattr(tiles, "SHORT_CALL_PAIRS", pairs)
        forward._PLANS.clear()
        O, L = fa2_triton.flash_attn_forward(q, k, v, spec)
        assert_matches_reference(O, L, q, k, v, False, scale=0.125)
    forward._PLANS.clear()
    assert taken == [False, tiles.tma_layout(q, k, v, 64)]

    monkeypatch.setattr(forward_gluon, "_on_hopper", lambda device: True)
    monkeypatch.setattr(backward_gluon, "_on_hopper", lambda device: True)
    q, k, v = (torch.empty(2, 4, 256, 128, dtype=torch.bfloat16) for _ in range(3))
    for pairs, long in ((default, False), (-1, True)):
        monkeypatch.setattr(tiles, "SHORT_CALL_PAIRS", pairs)
        assert forward_gluon.uses_gluon(q, k, v, spec) == long
        assert backward_gluon.uses_gluon(q, k, v, spec) == (long and 128 in backward_gluon.ENABLED)
        assert backward_gluon.uses_gluon_dq(q, k, v, spec) == (long and 128 in backward_gluon.DQ_ENABLED)


def test_kvcache_launches_are_kept_per_class_of_inputs(device):
    """The KV-cache kernel's launches (``kvcache._LAUNCHES``), through fa2.attention's decode route: new data
    of one shape reuses the launch; misaligned data of that shape too (the tensors' classes are taken on every
    call); a new key count gets its own. Each call matches the reference."""
    if fa2_triton.availability()[0] == "unavailable":
        pytest.skip("fa2-triton cannot run here")
    dtype = torch.float16
    kvcache._LAUNCHES.clear()

    def call(n, seed, misaligned=False):
        q, k, v = random_qkv((1, 4, 1, 16), (1, 2, n, 16), dtype, device, seed=seed)
        if misaligned:
            buf = torch.empty(q.numel() + 1, device=device, dtype=dtype)
            q = buf[1:].view(q.shape).copy_(q)
            assert q.data_ptr() % 16
        O, L = fa2.attention(q, k, v, causal=True, backend="triton")
        assert_matches_reference(O, L, q, k, v, True)
        return list(kvcache._LAUNCHES.values())

    launches = call(256, seed=1)
    assert len(launches) == 1 and launches[0].scalar_classes == launch.arg_classes(launches[0].scalars)
    assert call(256, seed=2) == launches
    assert call(256, seed=3, misaligned=True) == launches
    assert len(call(272, seed=4)) == 2


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's refusal (TRITON_INTERPRET=1); a GPU runs bfloat16")
def test_interpreter_refuses_bfloat16():
    """Forward and backward raise NotImplementedError naming the gap instead of returning the interpreter's
    wrong, partly non-finite bf16 products (max error inf before the refusal)."""
    q, k, v = random_qkv((1, 2, 32, 16), (1, 2, 32, 16), torch.bfloat16, "cpu")
    gap = r"does not run bfloat16 in Triton .*'s interpreter \(TRITON_INTERPRET=1\): .* bf16 tl\.dot wrongly"
    with pytest.raises(NotImplementedError, match=gap):
        fa2_triton.flash_attn_forward(q, k, v, AttentionSpec(0.25))
    with pytest.raises(NotImplementedError, match=gap):
        fa2.attention(q.requires_grad_(), k, v, backend="triton")
    L = torch.zeros(1, 2, 32)
    with pytest.raises(NotImplementedError, match=gap):
        fa2_triton.flash_attn_backward(q.detach(), k, v, q.detach(), L, q.detach(), AttentionSpec(0.25))
