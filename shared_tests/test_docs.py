"""docs/side-by-side.md and the ladder's pages (docs/ladder/*.md) quote the real source: a quoted region that
drifts from its file fails here.
Regenerate the page with `python shared_tests/excerpts.py`."""

from __future__ import annotations

import pytest

from excerpts import PAGE, PAGES, ROOT, excerpts, regions

QUOTED = excerpts(PAGE.read_text())
# (page, path, region, code) of every page's excerpts.
ALL_QUOTED = [(page.name, *quoted) for page in PAGES for quoted in excerpts(page.read_text())]


def test_page_quotes_every_backend():
    files = {path for path, _, _ in QUOTED}
    for package in ("fa2_pytorch", "fa2_triton", "fa2_numba_cuda"):
        assert any(package in f for f in files), f"docs/side-by-side.md quotes nothing from {package}"


@pytest.mark.parametrize(
    "page, path, name, code", ALL_QUOTED, ids=[f"{page}:{p.split('/')[-2]}#{n}" for page, p, n, _ in ALL_QUOTED]
)
def test_excerpt_matches_source(page, path, name, code):
    found = regions(ROOT / path)
    assert name in found, f"{path} has no region {name!r}"
    assert code == found[name], f"{path}#{name} changed: run python shared_tests/excerpts.py"
