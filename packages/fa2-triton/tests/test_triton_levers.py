"""fa2-triton's speed levers (the fields of ``tiles.Tiles``) change how the forward runs, never what it
returns: every lever on its own, and the configurations the tile table ships, against the fp64 reference,
into NaN-poisoned outputs. Shapes where a lever's path applies (the descriptor paths need whole tiles for
the warp-specialised loop) and where it does not (a ragged seqlen, causal), so that both the lever's path
and its fallback are checked. On the CPU in Triton's interpreter (bf16 skipped there: the interpreter gets
bf16 ``tl.dot`` wrong), on a GPU natively, where the warp-specialised loop must also really be specialised."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fa2_triton
from checks import assert_matches_reference, max_err, offsets, random_qkv
from fa2 import reference
from fa2.spec import AttentionSpec
from fa2_triton import backward, forward
from fa2_triton.common import INTERPRETED
from fa2_triton.launch import Plans
from fa2_triton.tiles import TILES, Tiles, tiles_for, ws_layout

BASE = Tiles(128, 64, 4, 2, tma=True)
LEVERS = {
    "pointers": BASE._replace(tma=False),
    "descriptors": BASE,
    "grid_order_1": BASE._replace(grid_order=1),
    "grid_order_2": BASE._replace(grid_order=2),
    "lazy_rescale": BASE._replace(lazy_rescale=True),
    "no_fused_exp2": BASE._replace(fused_exp2=False),
    "maxnreg_168": BASE._replace(maxnreg=168),
    "warp_specialize": BASE._replace(warp_specialize=True),
    "warp_specialize_n128": Tiles(128, 128, 4, 2, tma=True, warp_specialize=True),
}
# (seqlen_q, seqlen_k): whole tiles; a ragged seqlen_k (the descriptor path reads zeros past it, the
# warp-specialised loop falls back); fewer queries than keys (causal's bottom-right diagonal).
SEQLENS = {"256x256": (256, 256), "256x200": (256, 200), "128x384": (128, 384)}
# Windows, softcap and ALiBi on every lever's path: unmasked (the warp-specialised loop takes softcap and
# ALiBi), a two-sided window narrower than a tile, and all of them with causal.
FEATURES = {
    "softcap-alibi": dict(softcap=20.0, alibi="head"),
    "window-33.17": dict(window=(33, 17)),
    "causal-window-softcap-alibi": dict(window=(100, 0), softcap=5.0, alibi="batch"),
}


def _spec(causal, scale, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """The spec fa2.attention would build (causal sets the window's right side to 0)."""
    return AttentionSpec(scale, (window[0], 0) if causal else window, softcap, alibi_slopes)


@pytest.fixture
def native_or_interpreted(device):
    mode = fa2_triton.availability()[0]
    if device.type == "cuda" and mode != "native":
        pytest.skip(f"fa2-triton does not run natively here ({mode})")
    if device.type == "cpu" and not INTERPRETED:
        pytest.skip("fa2-triton was imported without TRITON_INTERPRET=1: its kernel needs a GPU")


@pytest.mark.parametrize("seqlens", list(SEQLENS.values()), ids=list(SEQLENS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("lever", list(LEVERS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_lever_matches_reference(native_or_interpreted, device, dtype, lever, head_dim, causal, seqlens):
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; bf16 is tested on the GPU")
    tiles = LEVERS[lever]
    n_q, n_k = seqlens
    q, k, v = random_qkv((2, 2, n_q, head_dim), (2, 2, n_k, head_dim), dtype, device, seed=n_k + head_dim)
    O = torch.full_like(q, math.nan)
    L = torch.full(q.shape[:-1], math.nan, device=device)
    compiled = forward.launch_kernel(q, k, v, O, L, _spec(causal, head_dim**-0.5), tiles)
    assert_matches_reference(O, L, q, k, v, causal)
    specialised = ws_layout(q, k, v, causal, head_dim, tiles)
    # Not green by accident: the warp-specialised path runs exactly where its conditions say.
    assert specialised == (tiles.warp_specialize and not causal and n_q % 128 == 0 and n_k % tiles.block_n == 0)
    if specialised and device.type == "cuda":
        # A producer warp group and two consumer groups: 12 warps where 4 were asked for.
        assert compiled.metadata.num_warps == 3 * tiles.num_warps, compiled.metadata.num_warps


@pytest.mark.parametrize("feature", list(FEATURES), ids=str)
@pytest.mark.parametrize("lever", list(LEVERS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_lever_with_features_matches_reference(native_or_interpreted, device, dtype, lever, feature):
    """Every path (pointers, descriptors, warp-specialised, each lever) computes windows, softcap and ALiBi
    or is kept from them by the launcher: the warp-specialised loop never runs under a window. Whole tiles,
    so that each lever's own path is taken (test_features covers ragged lengths with the table's tiles)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly; bf16 is tested on the GPU")
    tiles, f = LEVERS[lever], dict(FEATURES[feature])
    causal = feature.startswith("causal")
    n_q, n_k = SEQLENS["256x256"]
    q, k, v = random_qkv((1, 2, n_q, 64), (1, 2, n_k, 64), dtype, device, seed=n_k + 7)
    q, k = q * 2, k * 2
    alibi = f.pop("alibi", None)
    if alibi is not None:
        g = torch.Generator().manual_seed(n_k)
        f["alibi_slopes"] = (torch.rand((2,) if alibi == "head" else (1, 2), generator=g) * 0.2).to(device)
    slopes = f.get("alibi_slopes")
    spec = _spec(causal, 64**-0.5, **{**f, "alibi_slopes": None if slopes is None else slopes.expand(1, 2)})
    O = torch.full_like(q, math.nan)
    L = torch.full(q.shape[:-1], math.nan, device=device)
    compiled = forward.launch_kernel(q, k, v, O, L, spec, tiles)
    assert_matches_reference(O, L, q, k, v, causal, **f)
    specialised = ws_layout(q, k, v, spec.masked, 64, tiles)
    assert specialised == (tiles.warp_specialize and not spec.masked and n_k % tiles.block_n == 0)
    if specialised and device.type == "cuda":
        assert compiled.metadata.num_warps == 3 * tiles.num_warps, compiled.metadata.num_warps


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_shipped_tiles_match_reference(native_or_interpreted, device, head_dim, causal):
    """Every configuration of the 16-bit tile table, at a seqlen of whole tiles (so each path it asks for
    is taken)."""
    q, k, v = random_qkv((1, 2, 256, head_dim), (1, 2, 256, head_dim), torch.float16, device, seed=3)
    for _, tiles in TILES[head_dim, "16-bit", causal]:
        O = torch.full_like(q, math.nan)
        L = torch.full(q.shape[:-1], math.nan, device=device)
        forward.launch_kernel(q, k, v, O, L, _spec(causal, head_dim**-0.5), tiles)
        assert_matches_reference(O, L, q, k, v, causal)


def test_tile_table_entries_are_ordered_with_fallbacks():
    """Bounds grow to a last unbounded entry; an entry asking for warp specialisation is followed by its
    fallback, with the same bound and without it."""
    for key, entries in TILES.items():
        bounds = [b for b, _ in entries]
        assert bounds[-1] is None, key
        finite = [b for b in bounds if b is not None]
        assert finite == sorted(finite) and bounds[: len(finite)] == finite, key
        for (bound, tiles), following in zip(entries, [*entries[1:], None]):
            if tiles.warp_specialize:
                assert following is not None and following[0] == bound and not following[1].warp_specialize, key


def test_tiles_for_passes_over_warp_specialisation_where_the_inputs_cannot_take_it(monkeypatch):
    small, ws, fallback = Tiles(64, 64, 4, 2), Tiles(128, 128, 4, 2, warp_specialize=True), Tiles(128, 64, 4, 2)
    monkeypatch.setitem(TILES, (128, "16-bit", False), ((1024, small), (None, ws), (None, fallback)))
    assert tiles_for(128, torch.float16, False, 1024) == small
    assert tiles_for(128, torch.float16, False, 4096) == ws
    assert tiles_for(128, torch.float16, False, 4096, lambda t: True) == ws
    assert tiles_for(128, torch.bfloat16, False, 4096, lambda t: False) == fallback
    assert tiles_for(128, torch.bfloat16, False, 1000, lambda t: False) == small


@pytest.mark.parametrize("seqlen", [256, 200], ids=["whole_tiles", "ragged"])
def test_default_tiles_specialise_exactly_where_the_inputs_can(
    native_or_interpreted, device, monkeypatch, long_calls, seqlen
):
    """Without tiles given, the table's warp-specialised entry runs where the inputs can take it and its
    fallback elsewhere (a ragged seqlen would read across heads in the specialised loop)."""
    ws, fallback = Tiles(128, 64, 4, 2, tma=True, warp_specialize=True), Tiles(128, 64, 4, 2, tma=True)
    monkeypatch.setitem(TILES, (64, "16-bit", False), ((None, ws), (None, fallback)))
    # The forward's plans were made from the table as it was: none of them may serve the patched one.
    monkeypatch.setattr(forward, "_PLANS", Plans())
    taken = []
    real_launch = forward.launch

    def launch(kernel, grid, args, constexprs, options, classes=None):
        taken.append(constexprs["WARP_SPECIALIZE"])
        return real_launch(kernel, grid, args, constexprs, options, classes)

    monkeypatch.setattr(forward, "launch", launch)
    q, k, v = random_qkv((2, 2, seqlen, 64), (2, 2, seqlen, 64), torch.float16, device, seed=seqlen)
    O = torch.full_like(q, math.nan)
    L = torch.full(q.shape[:-1], math.nan, device=device)
    forward.launch_kernel(q, k, v, O, L, AttentionSpec(64**-0.5))
    assert taken == [seqlen % 128 == 0]
    assert_matches_reference(O, L, q, k, v, False)


def test_tuner_writes_a_fallback_after_a_warp_specialised_entry():
    tune = pytest.importorskip("fa2_triton.tuning.forward")
    small, ws = Tiles(128, 64, 4, 2, tma=True), Tiles(128, 128, 4, 2, tma=True, warp_specialize=True)
    [line] = tune.table_entries({(128, False): [(1024, small), (2048, ws, small), (4096, ws, small)]})
    assert line == (
        f'    (128, "16-bit", False): ((1448, {tune.describe(small)}), (None, {tune.describe(ws)}), '
        f"(None, {tune.describe(small)}),),"
    )


def test_tuner_searches_both_loads_and_each_warp_specialised_tiling_once():
    tune = pytest.importorskip("fa2_triton.tuning.forward")
    args = tune.parse_args(["--block-m", "128", "--block-n", "64,128", "--warps", "4", "--stages", "2"])
    full = tune.base_candidates(args, causal=False)
    plain = [t for t in full if not t.warp_specialize]
    assert {(t.block_n, t.tma) for t in plain} == {(64, True), (64, False), (128, True), (128, False)}
    # The specialised loop builds its own descriptors: one variant per tiling, whichever loads it came from.
    assert [(t.block_n, t.tma) for t in full if t.warp_specialize] == [(64, True), (128, True)]
    assert not any(t.warp_specialize for t in tune.base_candidates(args, causal=True))
    ptr_only = tune.parse_args(
        ["--block-m", "128", "--block-n", "64", "--warps", "4", "--stages", "2", "--loads", "ptr"]
    )
    assert [t.tma for t in tune.base_candidates(ptr_only, causal=True)] == [False]
    with pytest.raises(SystemExit):
        tune.parse_args(["--loads", "tma,cp.async"])


# A packed batch whose sequences end inside tiles, are empty or of one row, and have Nq != Nk both ways.
VARLEN_Q, VARLEN_K = [70, 0, 128, 1, 200], [70, 5, 128, 1, 150]
VARLEN_LEVERS = ["pointers", "descriptors", "grid_order_1", "grid_order_2", "lazy_rescale", "warp_specialize"]


def _packed(dtype, device, heads, heads_k, head_dim, seed):
    """(q, k, v) as the backends get a packed batch, (1, heads, total, head_dim) views of (total, heads,
    head_dim) tensors, and the offsets."""
    q, k, v = random_qkv((sum(VARLEN_Q), heads, head_dim), (sum(VARLEN_K), heads_k, head_dim), dtype, device, seed)

    return *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), offsets(VARLEN_Q, device), offsets(VARLEN_K, device)


def _varlen_spec(causal, head_dim, cu_q, cu_k, heads, heads_k, features, device):
    f = dict(features)
    if f.pop("alibi", None):
        g = torch.Generator().manual_seed(1)
        f["alibi_slopes"] = (torch.rand(len(VARLEN_Q), heads, generator=g) * 0.2).to(device)
    spec = _spec(causal, head_dim**-0.5, **f)
    return dataclasses.replace(
        spec,
        group=heads // heads_k,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(VARLEN_Q),
        max_seqlen_k=max(VARLEN_K),
    ), f


def _per_sequence(cu_q, cu_k, f):
    """(query rows, key rows, that sequence's reference options) of each sequence."""
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(starts_q) - 1):
        slopes = f.get("alibi_slopes")
        yield (
            slice(starts_q[s], starts_q[s + 1]),
            slice(starts_k[s], starts_k[s + 1]),
            dict(f, alibi_slopes=None if slopes is None else slopes[s]),
        )


@pytest.mark.parametrize("feature", ["none", *FEATURES], ids=str)
@pytest.mark.parametrize("lever", VARLEN_LEVERS, ids=str)
def test_varlen_lever_matches_reference(native_or_interpreted, device, monkeypatch, lever, feature):
    """A packed batch on every lever's path (descriptors built in the kernel per sequence; the
    warp-specialised loop falls back), into NaN-poisoned outputs, each sequence against its own fp64
    reference."""
    causal = feature.startswith("causal")
    q, k, v, cu_q, cu_k = _packed(torch.float16, device, 4, 2, 64, seed=11)
    spec, f = _varlen_spec(causal, 64, cu_q, cu_k, 4, 2, FEATURES.get(feature, {}), device)
    O = torch.full_like(q, math.nan)
    L = torch.full(q.shape[:-1], math.nan, device=device)
    taken = []
    real_launch = forward.launch
    monkeypatch.setattr(forward, "launch", lambda *a: taken.append(a[3]) or real_launch(*a))
    forward.launch_kernel(q, k, v, O, L, spec, LEVERS[lever])
    [constexprs] = taken
    assert (constexprs["DEVICE_DESC"], constexprs["USE_TMA"], constexprs["WARP_SPECIALIZE"]) == (
        LEVERS[lever].tma,
        False,
        False,
    )
    for rows, keys, own in _per_sequence(cu_q, cu_k, f):
        assert_matches_reference(
            O[:, :, rows], L[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, **own
        )


@pytest.mark.parametrize("feature", ["none", *FEATURES], ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["dq_kernel", "atomic_dq"])
def test_varlen_backward_matches_reference(native_or_interpreted, device, deterministic, feature):
    """Both backward schedules on a packed batch (the atomic one adds a sequence's last query tile's zeros
    into the next sequence's rows): gradients per sequence against the fp64 reference's, within the
    error of the same-precision naive attention (test_gradients' rule)."""
    causal = feature.startswith("causal")
    q, k, v, cu_q, cu_k = _packed(torch.float16, device, 4, 2, 64, seed=12)
    spec, f = _varlen_spec(causal, 64, cu_q, cu_k, 4, 2, FEATURES.get(feature, {}), device)
    O, L = forward.flash_attn_forward(q, k, v, spec)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=q.dtype)
    dq, dk, dv = backward.flash_attn_backward(q, k, v, O, L, dO, spec, deterministic=deterministic)
    got = [
        torch.zeros_like(dq, dtype=torch.float64),
        torch.zeros_like(dk, dtype=torch.float64),
        torch.zeros_like(dv, dtype=torch.float64),
    ]
    naive = [torch.zeros_like(g) for g in got]
    for rows, keys, own in _per_sequence(cu_q, cu_k, f):
        for out, upcast in ((got, True), (naive, False)):
            x = [t[:, :, r].detach() for t, r in ((q, rows), (k, keys), (v, keys))]
            x = [t.double().requires_grad_() if upcast else t.clone().requires_grad_() for t in x]
            O_ref, _ = reference.attention(*x, causal, upcast=upcast, **own)
            for g, r, gr in zip(out, (rows, keys, keys), torch.autograd.grad(O_ref, x, dO[:, :, rows].to(O_ref.dtype))):
                g[:, :, r] = gr.double()
    for name, g, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), got, naive):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        tol = 3 * max_err(n, r) + 2 * max_err(r.to(g.dtype), r)
        err = max_err(g, r)
        assert err <= tol, f"max |{name} - ref| = {err:.3g} > tolerance {tol:.3g}"
