"""fa2-triton's backward tile table and its tuner (``python -m fa2_triton.tuning.backward``), on the CPU:
the table's lookup, and one tiny run of the tuner in Triton's interpreter in which a candidate that
computes wrong gradients and one that fails to launch are recorded as such and never win."""

from __future__ import annotations

import csv

import pytest
import torch

from fa2_triton.common import INTERPRETED
from fa2_triton.tiles import BWD_TILES, BWD_TILES_16BIT_PADDED, BwdTiles, KernelTiles, bwd_tiles_for
from fa2_triton.tuning import backward as tune_backward


def test_every_bwd_tiles_entry_ends_with_an_unbounded_one():
    for key, entries in BWD_TILES.items():
        bounds = [b for b, _ in entries]
        assert bounds[-1] is None and None not in bounds[:-1], key
        assert bounds[:-1] == sorted(bounds[:-1]), key


def test_bwd_tiles_for_picks_by_seqlen_and_padding(monkeypatch):
    small = BwdTiles(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2))
    large = BwdTiles(KernelTiles(64, 128, 8, 3), KernelTiles(128, 64, 8, 3))
    monkeypatch.setitem(BWD_TILES, (64, "16-bit", True), ((2048, small), (None, large)))
    assert bwd_tiles_for(64, torch.bfloat16, True, 2048) == small
    assert bwd_tiles_for(64, torch.float16, True, 2049) == large
    assert bwd_tiles_for(64, torch.bfloat16, True) == large
    # A padded head_dim keeps its own table; fp32 its own keys.
    assert bwd_tiles_for(56, torch.bfloat16, True, 1024) == BWD_TILES_16BIT_PADDED[64]
    assert bwd_tiles_for(64, torch.float32, True, 1024) == BWD_TILES[64, "fp32", True][0][1]


@pytest.mark.skipif(
    not INTERPRETED, reason="the interpreted self-check (TRITON_INTERPRET=1); on a GPU the tuner is run by hand"
)
def test_tuner_records_wrong_and_failed_candidates(tmp_path, monkeypatch, capsys):
    real_launch = tune_backward._launch

    def launch(prob, kind, t, out):
        if kind == "dq" and t.block_m == 32:
            raise RuntimeError("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
        result = real_launch(prob, kind, t, out)
        if kind == "dkdv" and t.block_m == 16:
            out[0].mul_(1.1)  # dk off by 10%
        return result

    monkeypatch.setattr(tune_backward, "_launch", launch)
    path = tmp_path / "tune-bwd.csv"
    argv = [
        "--dtypes",
        "fp16",
        "--head-dims",
        "16",
        "--seqlens",
        "48",
        "--causal",
        "yes",
        "--tokens",
        "48",
        "--hidden",
        "32",
        "--dkdv-tiles",
        "16x32,32x32",
        "--dq-tiles",
        "32x16,16x16",
        "--warps",
        "4",
        "--stages",
        "2",
        "--csv",
        str(path),
    ]
    assert tune_backward.main(argv) == 0
    rows = list(csv.DictReader(path.open()))
    status = {(r["stage"], r["config"]): r["status"] for r in rows}
    assert status["search-dkdv", "KernelTiles(16, 32, 4, 2)"] == "wrong"
    assert status["search-dkdv", "KernelTiles(32, 32, 4, 2)"] == "ok"
    assert status["search-dq", "KernelTiles(32, 16, 4, 2)"] == "failed"
    assert status["search-dq", "KernelTiles(16, 16, 4, 2)"] == "ok"
    final = {r["stage"]: r for r in rows if r["stage"].startswith("final")}
    assert final["final-winner"]["status"] == final["final-current"]["status"] == "ok"
    assert final["final-atomic-dq"]["status"] == "ok"
    assert "KernelTiles(16, 32" not in final["final-winner"]["config"]
    assert "KernelTiles(32, 16" not in final["final-winner"]["config"]
    printed = capsys.readouterr().out
    assert '(16, "16-bit", True): ((None, BwdTiles(KernelTiles(' in printed


def test_bwd_tiles_for_packed_batches():
    """A packed batch's dK/dV kernel at head_dim 64 takes BWD_DKDV_VARLEN's capped tiles (full: every length;
    causal: up to 2048 keys, then the dense bucket); the dQ kernel keeps the dense bucket's, and other head
    dims and dense batches are unchanged."""
    from fa2_triton.tiles import BWD_DKDV_VARLEN

    for causal, seqlen in [(False, 1024), (False, 3902), (True, 2048)]:
        tiles = bwd_tiles_for(64, torch.bfloat16, causal, seqlen, varlen=True)
        dense = bwd_tiles_for(64, torch.bfloat16, causal, seqlen)
        assert tiles.dkdv == BWD_DKDV_VARLEN[64, "16-bit", causal][0][1] and tiles.dkdv.maxnreg == 168
        assert tiles.dq == dense.dq
    assert bwd_tiles_for(64, torch.bfloat16, True, 3902, varlen=True) == bwd_tiles_for(64, torch.bfloat16, True, 3902)
    assert bwd_tiles_for(128, torch.float16, False, 3902, varlen=True) == bwd_tiles_for(128, torch.float16, False, 3902)
    assert bwd_tiles_for(64, torch.float32, False, 1024, varlen=True).dkdv.maxnreg is None
