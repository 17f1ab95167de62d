"""docs/side-by-side.md and docs/ladder/*.md quote the real source: a quoted region that drifts from its
file fails here.
Regenerate the pages with `python shared_tests/excerpts.py`; the ladder pages' tables (the committed run's
figures) with `python -m fa2.bench.ladder`."""

from __future__ import annotations

import pytest

from excerpts import PAGE, ROOT, excerpts, pages, regions

QUOTED = excerpts(PAGE.read_text())
# Every page's excerpts, the optimisation ladder's too: (page, path, region, code).
ALL_QUOTED = [(page.name, *e) for page in pages() for e in excerpts(page.read_text())]


def test_page_quotes_every_backend():
    files = {path for path, _, _ in QUOTED}
    for package in ("fa2_pytorch", "fa2_triton", "fa2_numba_cuda"):
        assert any(package in f for f in files), f"docs/side-by-side.md quotes nothing from {package}"


@pytest.mark.parametrize(
    "page, path, name, code", ALL_QUOTED, ids=[f"{g}:{p.split('/')[-2]}#{n}" for g, p, n, _ in ALL_QUOTED]
)
def test_excerpt_matches_source(page, path, name, code):
    found = regions(ROOT / path)
    assert name in found, f"{path} has no region {name!r}"
    assert code == found[name], f"{page} quotes {path}#{name}, which changed: run python shared_tests/excerpts.py"


LADDER_PAGES = [ROOT / "docs" / "ladder.md", *sorted((ROOT / "docs" / "ladder").glob("*.md"))]


@pytest.mark.parametrize("page", LADDER_PAGES, ids=[p.name for p in LADDER_PAGES])
def test_ladder_figures_are_the_committed_run(page):
    """The ladder pages' tables are docs/benchmarks/h200-ladder.csv's rows, rendered by fa2.bench.ladder: a
    number on them that the committed run does not give fails here."""
    from fa2.bench import ladder

    text = page.read_text()
    assert ladder.TABLES_END in text, f"{page.name} has no table block rendered from the committed run"
    rows = ladder.read_rows(ROOT / "docs" / "benchmarks" / "h200-ladder.csv")
    assert ladder.render_page(text, rows) == text, (
        f"{page.name}'s tables differ from docs/benchmarks/h200-ladder.csv: run python -m fa2.bench.ladder"
    )
