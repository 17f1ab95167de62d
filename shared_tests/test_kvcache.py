"""KV-cache attention (decoding, issue 22): every backend's ``kvcache_forward`` and ``fa2.kvcache_attention``.

A backend's ``kvcache_forward`` gets a hand-built AttentionSpec and is checked against
``fa2.reference.kvcache_attention``, row by row with the suite's precision rule (checks.tolerances on each
row's own dense problem, its keys [leftpad_b, K_b)): one query token, a few, and more than a tile; MHA, GQA,
MQA; contiguous caches with and without cache_batch_idx, cache_leftpad, paged caches with page sizes 16, 48
and one larger than any row's keys; rows with no key and rows at full capacity; windows, softcap, ALiBi per
head and per (row, head); num_splits 1, 0 (the backend picks) and several, more than the key tiles; packed
queries with a block table. Caches and q are transposed views of flash-attn's (.., seqlen, heads, d) layout,
cache slots no row uses hold random values (and, in one test, NaN), and outputs start as NaN (conftest).
``fa2.kvcache_attention`` adds the append of new k, v at cache_seqlens (the caches checked after the call)
and rotary, and refuses bad input. A backend without ``kvcache_forward`` fails here: it is not a skip.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import fa2
from checks import assert_matches_reference, max_err, tolerances
from fa2 import reference, registry
from fa2.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from fa2.spec import AttentionSpec
from test_conformance import DTYPES, require_runnable, simulated_subset

CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _case(
    q=1,
    b=2,
    h=2,
    hk=2,
    d=16,
    cap=40,
    seqlens=(40, 17),
    leftpad=None,
    batch_idx=None,
    page=None,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
    splits=1,
    varlen=None,
):
    """One KV-cache problem: q tokens per row (or, packed, the rows' token counts ``varlen``), b rows, h query
    and hk key/value heads, capacity cap (contiguous seqlen_cache, or pages of ``page`` rows), K_b =
    seqlens[b]."""
    parts = [
        f"q{'.'.join(map(str, varlen))}" if varlen else f"q{q}",
        f"B{b}-H{h}.{hk}-D{d}",
        f"cap{cap}",
        "K" + ".".join(map(str, seqlens)),
    ]
    parts += [f"pad{'.'.join(map(str, leftpad))}"] if leftpad else []
    parts += [f"idx{'.'.join(map(str, batch_idx))}"] if batch_idx else []
    parts += [f"page{page}"] if page else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"softcap{softcap:g}"] if softcap else []
    parts += [f"alibi-{alibi}"] if alibi else []
    parts += [f"split{splits}"]
    case = dict(
        q=q,
        b=b,
        h=h,
        hk=hk,
        d=d,
        cap=cap,
        seqlens=list(seqlens),
        leftpad=leftpad,
        batch_idx=batch_idx,
        page=page,
        window=window,
        softcap=softcap,
        alibi=alibi,
        splits=splits,
        varlen=varlen,
    )
    return pytest.param(case, id="-".join(parts))


CASES = [
    # one query token (decoding), MHA: a row at full capacity and a short one; no split
    _case(q=1, b=2, h=2, hk=2, cap=40, seqlens=(40, 17), splits=1),
    # a few tokens, GQA, a row with no key at all (O = 0, L = +inf); the backend picks the splits
    _case(q=4, b=3, h=4, hk=2, cap=40, seqlens=(33, 0, 40), splits=0),
    # more query tokens than a tile, MQA, three splits whose ends fall inside tiles
    _case(q=20, b=2, h=4, hk=1, cap=40, seqlens=(40, 29), splits=3),
    # cache_batch_idx: the rows read cache rows 2 and 0 of 3
    _case(q=4, b=2, h=4, hk=2, cap=40, seqlens=(25, 40), batch_idx=(2, 0), splits=2),
    # cache_leftpad: each row's first keys are padding; the last row's padding is all of its keys
    _case(q=4, b=3, h=2, hk=1, cap=40, seqlens=(30, 40, 6), leftpad=(5, 0, 6), splits=3),
    # paged, 16-row pages: 4 a row, shuffled among pages no row uses
    _case(q=1, b=3, h=4, hk=2, cap=64, seqlens=(64, 1, 37), page=16, splits=0),
    # paged, 48-row pages (not a power of two): keys 47 and 48 on two pages; with leftpad
    _case(q=4, b=2, h=4, hk=2, cap=96, seqlens=(50, 48), leftpad=(3, 0), page=48, splits=2),
    # paged, one 80-row page a row, larger than any row's keys
    _case(q=4, b=2, h=2, hk=2, cap=80, seqlens=(37, 5), page=80, splits=3),
    # a two-sided window with softcap (causal makes it (8, 0)), GQA
    _case(q=4, b=2, h=4, hk=2, cap=40, seqlens=(40, 19), window=(8, 2), softcap=5.0, splits=3),
    # a left-only window, more queries than a tile; a row with fewer keys than queries
    _case(q=20, b=2, h=2, hk=1, cap=40, seqlens=(40, 12), window=(5, -1), splits=0),
    # ALiBi, one slope per head (stride 0 over the rows), with leftpad
    _case(q=4, b=2, h=4, hk=2, cap=40, seqlens=(40, 22), leftpad=(0, 7), alibi="head", splits=2),
    # ALiBi per (row, head) on a paged cache, with softcap
    _case(q=1, b=3, h=4, hk=1, cap=48, seqlens=(48, 0, 30), page=16, alibi="row", softcap=3.0, splits=0),
    # more splits than key tiles: 64 splits of a 40-key capacity, most of one key or none
    _case(q=4, b=2, h=4, hk=2, cap=40, seqlens=(40, 3), splits=64),
    # packed queries with a block table (flash-attn's varlen function): 1, 4, 0 and 6 tokens
    _case(
        varlen=(1, 4, 0, 6),
        b=4,
        h=4,
        hk=2,
        cap=48,
        seqlens=(10, 48, 5, 3),
        page=16,
        window=(6, 1),
        alibi="row",
        splits=0,
    ),
    _case(varlen=(3, 1), b=2, h=2, hk=2, cap=40, seqlens=(40, 0), splits=3),
    # a capacity of several key tiles in every backend (fa2-triton's are up to 128 keys), three splits of it
    _case(q=2, b=2, h=4, hk=2, cap=260, seqlens=(260, 161), splits=3),
]


def _kvcache_forward(backend):
    """The backend's kvcache_forward; a backend without one fails (issue 22 asks every backend for it)."""
    impl = registry.load(backend)
    if not hasattr(impl, "kvcache_forward"):
        pytest.fail(f"fa2 backend {backend!r} has no kvcache_forward (issue 22: every backend needs one)")
    return impl.kvcache_forward


def _work(case):
    nq = max(case["varlen"]) if case["varlen"] else case["q"]
    return (case["b"], case["h"], nq, case["cap"], case["d"])


def _randn(shape, g, dtype, device):
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _make(case, causal, dtype, device, seed):
    """(q, k_cache, v_cache, spec) for a case: q and the caches as transposed views of (.., seqlen, heads, d)
    tensors, every cache slot random (the slots no row uses too), the spec as the interface would build it."""
    g = torch.Generator().manual_seed(seed)
    b, h, hk, d, cap = case["b"], case["h"], case["hk"], case["d"], case["cap"]
    if case["varlen"]:
        cu = torch.tensor([0, *itertools.accumulate(case["varlen"])], dtype=torch.int32, device=device)
        q = _randn((1, sum(case["varlen"]), h, d), g, dtype, device).transpose(1, 2)
    else:
        cu = None
        q = _randn((b, case["q"], h, d), g, dtype, device).transpose(1, 2)
    block_table = batch_idx = None
    if case["page"]:
        per_row = cap // case["page"]
        num_pages = b * per_row + 3  # pages no row uses
        k_cache = _randn((num_pages, case["page"], hk, d), g, dtype, device).transpose(1, 2)
        v_cache = _randn((num_pages, case["page"], hk, d), g, dtype, device).transpose(1, 2)
        block_table = torch.randperm(num_pages, generator=g)[: b * per_row].view(b, per_row).to(device, torch.int32)
    else:
        rows = max(case["batch_idx"]) + 1 if case["batch_idx"] else b
        k_cache = _randn((rows, cap, hk, d), g, dtype, device).transpose(1, 2)
        v_cache = _randn((rows, cap, hk, d), g, dtype, device).transpose(1, 2)
        if case["batch_idx"]:
            batch_idx = torch.tensor(case["batch_idx"], dtype=torch.int32, device=device)
    slopes = None
    if case["alibi"] == "head":
        slopes = (torch.rand(h, generator=g) * 0.3).to(device).expand(b, h)
    elif case["alibi"] == "row":
        slopes = (torch.rand(b, h, generator=g) * 0.3).to(device)
    left, right = case["window"]
    spec = AttentionSpec(
        scale=1.0 / math.sqrt(d),
        window=(left, 0) if causal else (left, right),
        softcap=case["softcap"],
        alibi_slopes=slopes,
        group=h // hk,
        cu_seqlens_q=cu,
        max_seqlen_q=max(case["varlen"]) if case["varlen"] else 0,
        cache_seqlens=torch.tensor(case["seqlens"], dtype=torch.int32, device=device),
        cache_leftpad=None
        if case["leftpad"] is None
        else torch.tensor(case["leftpad"], dtype=torch.int32, device=device),
        cache_batch_idx=batch_idx,
        block_table=block_table,
        num_splits=case["splits"],
    )
    return q, k_cache, v_cache, spec


def assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec):
    """O: q's shape and dtype, L: q.shape[:-1] float32, against ``fa2.reference.kvcache_attention``: rows that
    see no key exactly O = 0, L = +inf; the others within checks.tolerances of row b's own dense problem (its
    queries against its keys [leftpad_b, K_b), ``reference.kvcache_rows``). With ``spec.sink`` every row is
    the last kind (a row that sees no key has L = sink[h])."""
    assert O.shape == q.shape, f"O shape {tuple(O.shape)} != q shape {tuple(q.shape)}"
    assert O.dtype == q.dtype, f"O dtype {O.dtype} != q dtype {q.dtype}"
    assert O.device == q.device, f"O on {O.device}, q on {q.device}"
    assert L.shape == q.shape[:-1], f"L shape {tuple(L.shape)} != {tuple(q.shape[:-1])}"
    assert L.dtype == torch.float32, f"L dtype {L.dtype}, want float32"
    assert not torch.isnan(O).any(), "NaN in O (an unwritten or 0/0 element)"
    assert not torch.isnan(L).any(), "NaN in L"

    O_ref, L_ref = reference.kvcache_attention(q, k_cache, v_cache, spec)
    empty = torch.isinf(L_ref)
    assert torch.equal(L[empty], L_ref[empty].float()), "rows that see no key must have L = +inf"
    assert torch.isfinite(L[~empty]).all(), "L must be finite on rows that see a key"
    assert (O[empty] == 0).all(), "rows that see no key must have O = 0"

    packed = spec.cu_seqlens_q is not None
    for b, (rows, k_b, v_b, slopes) in enumerate(reference.kvcache_rows(q, k_cache, v_cache, spec)):
        at = (slice(None), slice(None), rows) if packed else (rows,)  # the sequence's rows of q, O, L
        q_b, seen = q[at], ~empty[at]
        if not seen.any():
            continue
        features = dict(
            window=spec.window,
            softcap=spec.softcap,
            alibi_slopes=None if slopes is None else slopes[None],
            sink=spec.sink,
        )
        tol_O, tol_L = tolerances(q_b, k_b[None], v_b[None], False, spec.scale, ref=(O_ref[at], L_ref[at]), **features)
        err_O = max_err(O[at], O_ref[at])
        err_L = max_err(L[at][seen], L_ref[at][seen])
        assert err_O <= tol_O, f"row {b}: max |O - O_ref| = {err_O:.3g} > tolerance {tol_O:.3g} ({q.dtype})"
        assert err_L <= tol_L, f"row {b}: max |L - L_ref| = {err_L:.3g} > tolerance {tol_L:.3g} ({q.dtype})"


def _simulated_masks(backend, status, dtype, causal):
    # fp16 and fp32 run the same SIMT split kernel in numba's simulator (no tensor cores there)
    simulated_subset(
        backend, status, causal == (dtype == torch.float16), "each case twice, fp32 without a mask and fp16 causal"
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_forward_matches_the_reference(backend, status, device, dtype, causal, case):
    forward = _kvcache_forward(backend)
    require_runnable(backend, status, device, dtype, _work(case))
    _simulated_masks(backend, status, dtype, causal)
    q, k_cache, v_cache, spec = _make(case, causal, dtype, device, seed=sum(case["seqlens"]) + case["cap"])
    O, L = forward(q, k_cache, v_cache, spec)
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


@pytest.mark.parametrize("case", [CASES[4], CASES[6]], ids=["contiguous-leftpad", "paged48-leftpad"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unused_cache_slots_never_reach_the_output(backend, status, device, dtype, case):
    """The slots outside each row's [leftpad_b, K_b), and the pages no row uses, hold NaN (as a cache from
    torch.empty may): none of it reaches O or L (flash-attn's kernels never read past K_b nor before the
    left padding)."""
    forward = _kvcache_forward(backend)
    require_runnable(backend, status, device, dtype, _work(case))
    q, k_cache, v_cache, spec = _make(case, False, dtype, device, seed=7)
    used = torch.zeros(k_cache.shape[0], k_cache.shape[2], dtype=torch.bool)  # (rows or pages, slots)
    table = spec.block_table.tolist() if spec.paged else None
    cache_rows = list(range(case["b"])) if spec.cache_batch_idx is None else spec.cache_batch_idx.tolist()
    for b, (lo, hi) in enumerate(zip(case["leftpad"] or [0] * case["b"], case["seqlens"])):
        for j in range(lo, hi):
            if spec.paged:
                used[table[b][j // case["page"]], j % case["page"]] = True
            else:
                used[cache_rows[b], j] = True
    for cache in (k_cache, v_cache):
        cache.masked_fill_(~used.to(device)[:, None, :, None], math.nan)
    O, L = forward(q, k_cache, v_cache, spec)
    assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)


def test_triton_split_counters_are_zero_again_after_a_call(backend, status, device):
    """fa2-triton's split kernel counts each tile's finished splits in counters it keeps per stream and that
    the merging program zeroes again: calls in a row, on other shapes too, each merge every split."""
    if backend != "triton":
        pytest.skip("fa2-triton's split counters")
    from fa2_triton import kvcache as triton_kvcache

    # Several key tiles a split (400 keys, fa2-triton's tiles being up to 128), on other grids in turn: GQA
    # with 4 tokens, leftpad, pages of 16.
    cases = [dict(CASES[i].values[0], cap=400, splits=3) for i in (-1, -1, 1, 4, 5, -1)]
    require_runnable(backend, status, device, torch.float32, max(map(_work, cases)))
    for seed, case in enumerate(cases):
        q, k_cache, v_cache, spec = _make(case, False, torch.float32, device, seed=seed)
        O, L = triton_kvcache.kvcache_forward(q, k_cache, v_cache, spec)
        assert_matches_kvcache_reference(O, L, q, k_cache, v_cache, spec)
        counters = [c for (d, _), c in triton_kvcache._COUNTERS.items() if d == q.device]
        assert counters and all(int(c.abs().sum()) == 0 for c in counters), "a split count was left behind"


def test_kvcache_mask_is_aligned_on_each_rows_keys(backend, status, device):
    """The spec's drawing: Nq = 2, K_b = 5, leftpad_b = 1, causal: row 0 sees keys 1..3, row 1 keys 1..4; a
    second row with K_b = 3 and no padding sees 0..1 and 0..2. Equal scores: O is the mean of the values
    seen and L the log of their count."""
    forward = _kvcache_forward(backend)
    require_runnable(backend, status, device, torch.float32, (2, 1, 2, 8, 16))
    q = torch.zeros(2, 1, 2, 16, device=device)
    k_cache = torch.zeros(2, 1, 8, 16, device=device)
    v_cache = torch.arange(8, dtype=torch.float32, device=device)[None, None, :, None].expand(2, 1, 8, 16)
    spec = AttentionSpec(
        scale=0.25,
        window=(-1, 0),
        cache_seqlens=torch.tensor([5, 3], dtype=torch.int32, device=device),
        cache_leftpad=torch.tensor([1, 0], dtype=torch.int32, device=device),
        num_splits=3,
    )
    O, L = forward(q, k_cache, v_cache, spec)
    torch.testing.assert_close(O[:, 0, :, 0].cpu(), torch.tensor([[2.0, 2.5], [0.5, 1.0]]))
    torch.testing.assert_close(L[:, 0].cpu(), torch.tensor([[math.log(3), math.log(4)], [math.log(2), math.log(3)]]))


def test_reference_is_the_masked_softmax_spelled_out():
    """fa2.reference.kvcache_attention against the contract written out on the whole cache row: scores
    capped, biased by -slope · |i + K_b - Nq - j|, masked to leftpad_b <= j < K_b and the window aligned on
    K_b; and a paged copy of the same cache gives the same result."""
    g = torch.Generator().manual_seed(0)
    b, h, hk, nq, d, cap = 3, 4, 2, 3, 8, 20
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(b + 1, hk, cap, d, generator=g, dtype=torch.float64) for _ in range(2))
    seqlens, leftpad, rows = torch.tensor([20, 7, 2]), torch.tensor([3, 0, 2]), torch.tensor([2, 0, 3])
    slopes = torch.rand(b, h, generator=g)
    for window in [(-1, -1), (-1, 0), (4, 1)]:
        spec = AttentionSpec(
            scale=0.3,
            window=window,
            softcap=2.0,
            alibi_slopes=slopes,
            group=h // hk,
            cache_seqlens=seqlens.int(),
            cache_leftpad=leftpad.int(),
            cache_batch_idx=rows.int(),
        )
        O, L = reference.kvcache_attention(q, k_cache, v_cache, spec)
        i, j = torch.arange(nq)[:, None], torch.arange(cap)[None, :]
        for r in range(b):
            K = seqlens[r]
            k, v = (c[rows[r]].repeat_interleave(h // hk, 0) for c in (k_cache, v_cache))
            S = 2.0 * torch.tanh(q[r] @ k.transpose(-1, -2) * 0.3 / 2.0)
            S = S - slopes[r].double()[:, None, None] * (i + K - nq - j).abs()
            visible = ((j >= leftpad[r]) & (j < K)).expand(nq, cap)
            if window[1] >= 0:
                visible = visible & (j <= i + K - nq + window[1])
            if window[0] >= 0:
                visible = visible & (j >= i + K - nq - window[0])
            S = S.masked_fill(~visible, -math.inf)
            seen = visible.any(-1)
            torch.testing.assert_close(L[r][:, seen], torch.logsumexp(S, -1)[:, seen], rtol=0, atol=1e-12)
            assert torch.isinf(L[r][:, ~seen]).all()
            torch.testing.assert_close(O[r], torch.softmax(S, -1).nan_to_num(0.0) @ v, rtol=0, atol=1e-12)
    page, per_row = 6, 4
    table = torch.randperm(b * per_row, generator=g).view(b, per_row)
    k_paged, v_paged = (torch.zeros(b * per_row, hk, page, d, dtype=torch.float64) for _ in range(2))
    for r, p in itertools.product(range(b), range(per_row)):
        n = min(page, cap - p * page)
        k_paged[table[r, p], :, :n] = k_cache[rows[r], :, p * page : p * page + n]
        v_paged[table[r, p], :, :n] = v_cache[rows[r], :, p * page : p * page + n]
    paged = dataclasses.replace(spec, cache_batch_idx=None, block_table=table.int())
    O_paged, L_paged = reference.kvcache_attention(q, k_paged, v_paged, paged)
    assert torch.equal(O_paged, O) and torch.equal(L_paged, L)


# fa2.kvcache_attention: the public function, with the append and rotary of the interface.


def _api_case(
    q=1,
    new=1,
    b=2,
    h=4,
    hk=2,
    d=16,
    cap=40,
    seqlens=(12, 0),
    leftpad=None,
    batch_idx=None,
    page=None,
    rotary=None,
    window=(-1, -1),
    splits=0,
):
    """seqlens: each row's keys before the append (an int: the same for all); new: tokens appended; rotary:
    None or (rotary_dim, interleaved)."""
    lens = "all" if seqlens is None else seqlens if isinstance(seqlens, int) else ".".join(map(str, seqlens))
    parts = [f"q{q}-new{new}", f"B{b}-H{h}.{hk}-D{d}", f"cap{cap}", f"K{lens}"]
    parts += [f"pad{'.'.join(map(str, leftpad))}"] if leftpad else []
    parts += [f"idx{'.'.join(map(str, batch_idx))}"] if batch_idx else []
    parts += [f"page{page}"] if page else []
    parts += [f"rotary{rotary[0]}-{'interleaved' if rotary[1] else 'halves'}"] if rotary else []
    parts += [f"w{window[0]}.{window[1]}"] if window != (-1, -1) else []
    parts += [f"split{splits}"]
    case = dict(
        q=q,
        new=new,
        b=b,
        h=h,
        hk=hk,
        d=d,
        cap=cap,
        seqlens=seqlens,
        leftpad=leftpad,
        batch_idx=batch_idx,
        page=page,
        rotary=rotary,
        window=window,
        splits=splits,
    )
    return pytest.param(case, id="-".join(parts))


API_CASES = [
    # decoding: one token appended and attended, a row that was empty, the other filled to capacity
    _api_case(q=1, new=1, seqlens=(39, 0), rotary=(8, False)),
    # a few tokens at once, cache_batch_idx, interleaved rotary
    _api_case(q=3, new=3, seqlens=(20, 5), batch_idx=(2, 0), rotary=(8, True), splits=3),
    # paged (16-row pages), leftpad, GQA; more tokens than are appended
    _api_case(q=4, new=2, b=3, cap=48, seqlens=(46, 9, 30), leftpad=(0, 3, 30), page=16, rotary=(16, False)),
    # an int cache_seqlens, MQA, a window, no rotary
    _api_case(q=2, new=2, hk=1, seqlens=17, window=(6, 0), splits=2),
    # no append: attention over cache_seqlens as given (None: the whole capacity)
    _api_case(q=2, new=0, seqlens=(40, 23), page=20),
    _api_case(q=2, new=0, seqlens=None, splits=1),
]


def _rotate(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb on x (batch, heads, n, d) at positions (batch, n), in float32."""
    half = cos.shape[1]
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]
    x32 = x.float()
    if interleaved:
        x1, x2 = x32[..., : 2 * half : 2], x32[..., 1 : 2 * half : 2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x32[..., :half], x32[..., half : 2 * half]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated, x32[..., 2 * half :]], dim=-1).to(x.dtype)


@pytest.mark.parametrize("case", API_CASES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_attention_appends_rotates_and_attends(backend, status, device, dtype, causal, case):
    """New k, v land in the caches at cache_seqlens (rotated k; every other slot untouched); q is rotated at
    cache_seqlens + i when causal or windowed, at cache_seqlens otherwise (flash-attn's rule); the output is
    the reference on the updated caches and the rotated q."""
    _kvcache_forward(backend)
    require_runnable(backend, status, device, dtype, (case["b"], case["h"], case["q"], case["cap"], case["d"]))
    _simulated_masks(backend, status, dtype, causal)
    g = torch.Generator().manual_seed(case["cap"] + case["q"])
    b, h, hk, d, cap, new = case["b"], case["h"], case["hk"], case["d"], case["cap"], case["new"]
    q = _randn((b, case["q"], h, d), g, dtype, device).transpose(1, 2)
    k_new, v_new = (_randn((b, new, hk, d), g, dtype, device).transpose(1, 2) for _ in range(2))
    block_table = batch_idx = None
    if case["page"]:
        per_row = cap // case["page"]
        num_pages = b * per_row + 2
        k_cache, v_cache = (
            _randn((num_pages, case["page"], hk, d), g, dtype, device).transpose(1, 2) for _ in range(2)
        )
        block_table = torch.randperm(num_pages, generator=g)[: b * per_row].view(b, per_row).to(device, torch.int32)
    else:
        rows = max(case["batch_idx"]) + 1 if case["batch_idx"] else b
        k_cache, v_cache = (_randn((rows, cap, hk, d), g, dtype, device).transpose(1, 2) for _ in range(2))
        if case["batch_idx"]:
            batch_idx = torch.tensor(case["batch_idx"], dtype=torch.int32, device=device)
    lens = case["seqlens"]
    before = [cap] * b if lens is None else [lens] * b if isinstance(lens, int) else list(lens)
    cache_seqlens = (
        lens if lens is None or isinstance(lens, int) else torch.tensor(lens, dtype=torch.int32, device=device)
    )
    leftpad = None if case["leftpad"] is None else torch.tensor(case["leftpad"], dtype=torch.int32, device=device)
    window = case["window"]
    options = dict(cos=None, sin=None)
    if case["rotary"]:
        rotary_dim, interleaved = case["rotary"]
        # Rows for every position a token takes (cache_seqlens + i < cap + q), none clamped.
        angle = torch.rand(cap + case["q"], rotary_dim // 2, generator=g) * 2 * math.pi
        options = dict(cos=angle.cos().to(device, dtype), sin=angle.sin().to(device, dtype))

    # What the call must do, spelled out: rotate, then write at positions before[b] + t.
    start = torch.tensor(before, device=device)[:, None]
    q_expected, k_expected = q, k_new
    if case["rotary"]:
        offset = torch.arange(case["q"], device=device) if causal or window != (-1, -1) else 0
        q_expected = _rotate(q, options["cos"], options["sin"], start + offset, interleaved)
        k_expected = _rotate(
            k_new, options["cos"], options["sin"], start + torch.arange(new, device=device), interleaved
        )
    k_after, v_after = k_cache.clone(), v_cache.clone()
    for r, t in itertools.product(range(b), range(new)):
        j = before[r] + t
        if block_table is not None:
            page, slot = block_table[r, j // case["page"]], j % case["page"]
        else:
            page, slot = (r if batch_idx is None else batch_idx[r]), j
        k_after[page, :, slot], v_after[page, :, slot] = k_expected[r, :, t], v_new[r, :, t]

    O, L = fa2.kvcache_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k=k_new if new else None,
        v=v_new if new else None,
        rotary_cos=options["cos"],
        rotary_sin=options["sin"],
        rotary_interleaved=bool(case["rotary"] and interleaved),
        block_table=block_table,
        cache_batch_idx=batch_idx,
        cache_leftpad=leftpad,
        causal=causal,
        window=window,
        num_splits=case["splits"],
        backend=backend,
    )
    assert torch.equal(v_cache, v_after), "v_cache after the call: the new v at cache_seqlens, nothing else changed"
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        k_cache,
        k_after,
        rtol=eps,
        atol=0.0,
        msg=lambda m: f"k_cache after the call (rotated new k at cache_seqlens): {m}",
    )
    spec = AttentionSpec(
        scale=1.0 / math.sqrt(d),
        window=(window[0], 0) if causal else window,
        group=h // hk,
        cache_seqlens=torch.tensor(before, dtype=torch.int32, device=device) + new,
        cache_leftpad=leftpad,
        cache_batch_idx=batch_idx,
        block_table=block_table,
    )
    assert_matches_kvcache_reference(O, L, q_expected, k_cache, v_cache, spec)


def _bad(**changes):
    """Valid arguments of fa2.kvcache_attention (batch 2, heads 2, D 16, a 40-slot contiguous cache), changed."""
    q = torch.randn(2, 2, 1, 16)
    args = dict(
        q=q,
        k_cache=torch.randn(2, 2, 40, 16),
        v_cache=torch.randn(2, 2, 40, 16),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        k=torch.randn(2, 2, 1, 16),
        v=torch.randn(2, 2, 1, 16),
    )
    args.update(changes)
    return args


def _paged(**changes):
    q = torch.randn(2, 2, 1, 16)
    args = dict(
        q=q,
        k_cache=torch.randn(5, 2, 16, 16),
        v_cache=torch.randn(5, 2, 16, 16),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
    )
    args.update(changes)
    return args


_cos = torch.ones(40, 4)
BAD_INPUTS = [
    pytest.param(
        _bad(cache_seqlens=torch.tensor([3, 7])), TypeError, "cache_seqlens must be int32", id="seqlens-int64"
    ),
    pytest.param(
        _bad(cache_seqlens=torch.tensor([3], dtype=torch.int32)),
        ValueError,
        r"cache_seqlens must have shape \(2,\)",
        id="seqlens-shape",
    ),
    pytest.param(
        _bad(cache_seqlens=torch.tensor([3, 40], dtype=torch.int32)),
        ValueError,
        "must be within",
        id="seqlens-past-capacity",
    ),
    pytest.param(
        _bad(cache_seqlens=40),
        ValueError,
        r"must be within \[0, 40\], the cache's capacity",
        id="int-seqlens-past-capacity",
    ),
    pytest.param(
        _bad(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)),
        ValueError,
        "must be within",
        id="seqlens-negative",
    ),
    pytest.param(_bad(cache_seqlens=None), ValueError, "new k and v need cache_seqlens", id="append-without-seqlens"),
    pytest.param(_bad(v=None), ValueError, "k and v must be given together", id="k-without-v"),
    pytest.param(
        _bad(k=torch.randn(2, 2, 1, 8), v=torch.randn(2, 2, 1, 8)),
        ValueError,
        r"k and v must have shape \(batch, heads_k, seqlen_new, head_dim\)",
        id="new-k-head-dim",
    ),
    pytest.param(_bad(k_cache=torch.randn(2, 40, 16)), ValueError, "k_cache must have shape", id="cache-rank-3"),
    pytest.param(
        _bad(v_cache=torch.randn(2, 2, 41, 16)),
        ValueError,
        "k_cache and v_cache must have one shape",
        id="caches-differ",
    ),
    pytest.param(
        _bad(k_cache=torch.randn(3, 2, 40, 16), v_cache=torch.randn(3, 2, 40, 16)),
        ValueError,
        "a contiguous cache without cache_batch_idx",
        id="cache-rows-without-batch-idx",
    ),
    pytest.param(
        _bad(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
        ValueError,
        r"cache_batch_idx must be within \[0, 2\)",
        id="batch-idx-out-of-range",
    ),
    pytest.param(
        _bad(cache_leftpad=torch.tensor([0, 9], dtype=torch.int32)),
        ValueError,
        "cache_leftpad must be within",
        id="leftpad-past-keys",
    ),
    pytest.param(_bad(num_splits=-1), ValueError, "num_splits must be an int >= 0", id="splits-negative"),
    pytest.param(
        _bad(rotary_cos=_cos), ValueError, "rotary_cos and rotary_sin must be given together", id="cos-without-sin"
    ),
    pytest.param(
        _bad(k=None, v=None, rotary_cos=_cos, rotary_sin=_cos), ValueError, "need k and v", id="rotary-without-k"
    ),
    pytest.param(
        _bad(rotary_cos=torch.ones(40, 9), rotary_sin=torch.ones(40, 9)),
        ValueError,
        "rotary_dim <= head_dim",
        id="rotary-dim-past-head-dim",
    ),
    pytest.param(
        _paged(block_table=torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)),
        ValueError,
        r"page ids must be within \[0, 5\)",
        id="page-id-out-of-range",
    ),
    pytest.param(
        _paged(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32)),
        ValueError,
        "must be within",
        id="paged-seqlens-past-capacity",
    ),
    pytest.param(
        _paged(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)),
        ValueError,
        "cache_batch_idx is for a contiguous cache",
        id="paged-with-batch-idx",
    ),
    pytest.param(
        _paged(block_table=torch.tensor([0, 1], dtype=torch.int32)),
        ValueError,
        r"block_table must have shape \(2, n\)",
        id="block-table-rank-1",
    ),
]


@pytest.mark.parametrize("args, error, match", BAD_INPUTS)
def test_bad_inputs_are_refused(args, error, match):
    """Refused by the interface before any backend runs, each error naming what was wrong."""
    with pytest.raises(error, match=match):
        fa2.kvcache_attention(**args, backend="pytorch")


def test_no_backward_through_a_kvcache(backend, status, device):
    _kvcache_forward(backend)
    require_runnable(backend, status, device, torch.float32, (2, 2, 1, 40, 16))
    args = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in _bad().items()}
    q = args.pop("q").requires_grad_()
    O, _ = fa2.kvcache_attention(q, **args, backend=backend)
    with pytest.raises(NotImplementedError, match="no backward through a KV cache"):
        O.sum().backward()


PAGE = 16


def _past_the_block_table(entry, device, new_key):
    """A call of ``entry`` on a paged cache of 4 pages of PAGE keys, q of one token, whose one row's block
    table addresses one page: PAGE + 1 cached keys, or PAGE and one new key (``new_key``), one past what it
    addresses (flash-attn's test_flash_attn_kvcache_paged_block_table_bounds; every page id is valid). An
    entry ending in "int": cache_seqlens as an int."""
    g = torch.Generator().manual_seed(3)
    q, k_new = (torch.randn(1, 1, 1, 16, generator=g).to(device) for _ in range(2))
    k_pages, v_pages = (torch.randn(4, PAGE, 1, 16, generator=g).to(device) for _ in range(2))  # flash-attn's layout
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.tensor([PAGE if new_key else PAGE + 1], dtype=torch.int32, device=device)
    new = dict(k=k_new, v=k_new.clone()) if new_key else {}
    if entry == "kvcache_attention":
        new = {name: t.transpose(1, 2) for name, t in new.items()}
        return lambda backend: fa2.kvcache_attention(
            q.transpose(1, 2),
            k_pages.transpose(1, 2),
            v_pages.transpose(1, 2),
            lens,
            block_table=table,
            **new,
            backend=backend,
        )
    if entry.startswith("flash_attn_with_kvcache"):
        seqlens = int(lens) if entry.endswith("int") else lens
        return lambda backend: flash_attn_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, **new, backend=backend
        )
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cu_k = torch.cat([cu_q[:1], lens])
    if entry == "varlen_attention":
        return lambda backend: fa2.varlen_attention(
            q[0], k_pages, v_pages, cu_q, cu_k, 1, PAGE + 1, block_table=table, backend=backend
        )
    return lambda backend: flash_attn_varlen_func(
        q[0], k_pages, v_pages, cu_q, cu_k, 1, PAGE + 1, block_table=table, backend=backend
    )


@pytest.mark.parametrize(
    "entry, new_key",
    [
        pytest.param("kvcache_attention", False, id="kvcache_attention"),
        pytest.param("kvcache_attention", True, id="kvcache_attention-new-key"),
        pytest.param("flash_attn_with_kvcache", False, id="flash_attn_with_kvcache"),
        pytest.param("flash_attn_with_kvcache", True, id="flash_attn_with_kvcache-new-key"),
        pytest.param("flash_attn_with_kvcache-int", False, id="flash_attn_with_kvcache-int-seqlens"),
        pytest.param("varlen_attention", False, id="varlen_attention"),
        pytest.param("flash_attn_varlen_func", False, id="flash_attn_varlen_func"),
    ],
)
def test_keys_past_the_block_table_raise_a_runtime_error_naming_it(backend, device, entry, new_key):
    """Refused before any kernel runs, on every backend: a RuntimeError (flash-attn's contract) that is also
    the ValueError of fa2's other range checks, its message naming block_table."""
    call = _past_the_block_table(entry, device, new_key)
    with pytest.raises(RuntimeError, match="block_table") as raised:
        call(backend)
    assert isinstance(raised.value, ValueError)


def test_keys_up_to_what_the_block_table_addresses_are_attended(backend, status, device):
    """flash-attn's positive control: exactly the PAGE keys the block table addresses run."""
    require_runnable(backend, status, device, torch.float32, (1, 1, 1, PAGE, 16))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 1, 16, generator=g).to(device)
    k_pages, v_pages = (torch.randn(4, PAGE, 1, 16, generator=g).to(device) for _ in range(2))
    lens = torch.full((1,), PAGE, dtype=torch.int32, device=device)
    table = torch.full((1, 1), 2, dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_softmax_lse=True, backend=backend
    )
    k, v = (t[2:3].transpose(1, 2) for t in (k_pages, v_pages))
    assert_matches_reference(out.transpose(1, 2), lse, q.transpose(1, 2), k, v, False)
