"""Fixtures of fa2-triton's own tests."""

from __future__ import annotations

import pytest

from fa2_triton import forward, forward_gluon, tiles


@pytest.fixture
def long_calls(monkeypatch):
    """Every call counts as long (``tiles.short_call`` never holds): small inputs then take the paths that
    long calls take, the Gluon kernels and the host tensor descriptors, which short calls pass over (and the
    Gluon forward at head dim 64, which takes long sequences alone: ``forward_gluon.pays``). The forward's
    plans, kept per shape, are dropped before and after, so that no call reuses a plan made under the other
    rule."""
    forward._PLANS.clear()
    monkeypatch.setattr(tiles, "SHORT_CALL_PAIRS", -1)
    monkeypatch.setattr(forward_gluon, "D64_MIN_KEYS", 0)
    monkeypatch.setattr(forward_gluon, "D64_MIN_CAUSAL_QUERIES", 0)
    yield
    forward._PLANS.clear()
