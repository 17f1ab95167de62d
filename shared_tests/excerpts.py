"""Keeps the code excerpts of docs/side-by-side.md and of the ladder's pages (docs/ladder/*.md) equal to the
source they quote.

A source file marks a region with two comment lines (the same in Python for every backend):

    # side-by-side: scores
    ...code...
    # side-by-side: end

and the page quotes it as a fenced block right after a marker comment naming file and region:

    <!-- excerpt: packages/fa2-triton/src/fa2_triton/forward_tl.py#scores -->
    ```python
    # packages/fa2-triton/src/fa2_triton/forward_tl.py, in _attn_fwd_inner(), at "# side-by-side: scores"
    ...code, dedented...
    ```

The first line of the block is not source: it tells a reader of the rendered page (where the marker
comment is invisible) which file, function and marker to look for.

``python shared_tests/excerpts.py`` rewrites every such block from the source; test_docs.py fails when a
block and its region differ.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "side-by-side.md"
# Every page whose excerpts are kept: the side-by-side page and each DSL's page of the optimisation ladder.
PAGES = (PAGE, *sorted((ROOT / "docs" / "ladder").glob("*.md")))
_START = re.compile(r"^\s*# side-by-side: (?P<name>[\w-]+)\s*$")
_END = re.compile(r"^\s*# side-by-side: end\s*$")
_EXCERPT = re.compile(
    r"(?P<head><!-- excerpt: (?P<path>[^#\s]+)#(?P<name>[\w-]+) -->\n```python\n)(?P<body>.*?)(?P<tail>```)",
    re.DOTALL,
)


def _functions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function in a source file, outermost first."""
    spans = [
        (node.lineno, node.end_lineno, node.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return sorted(spans, key=lambda span: (span[0], -span[1]))


def _location(path: Path, lineno: int, name: str, functions: list[tuple[int, int, str]]) -> str:
    """The block's first line: file, enclosing function (innermost, with the ones around it), marker."""
    inside = [f for first, last, f in functions if first <= lineno <= last]
    where = "at top level"
    if inside:
        where = f"in {inside[-1]}()" + "".join(f" inside {f}()" for f in reversed(inside[:-1]))
    return f'# {path.relative_to(ROOT).as_posix()}, {where}, at "# side-by-side: {name}"\n'


def regions(path: Path) -> dict[str, str]:
    """Every marked region of a source file, dedented, under a line saying where it is, by name."""
    source = path.read_text()
    functions = _functions(source)
    found: dict[str, str] = {}
    name, lines, start = None, [], 0
    for lineno, line in enumerate(source.splitlines(), start=1):
        if name is None:
            m = _START.match(line)
            if m:
                name, lines, start = m["name"], [], lineno
        elif _END.match(line):
            code = textwrap.dedent("\n".join(lines)) + "\n"
            found[name] = _location(path, start, name, functions) + code
            name = None
        else:
            lines.append(line)
    if name is not None:
        raise ValueError(f"{path}: region {name!r} has no '# side-by-side: end'")
    return found


def excerpts(page: str) -> list[tuple[str, str, str]]:
    """(path, region name, quoted code) for every excerpt on the page."""
    return [(m["path"], m["name"], m["body"]) for m in _EXCERPT.finditer(page)]


def render(page: str) -> str:
    """The page with every excerpt replaced by its region's current code."""
    cache: dict[str, dict[str, str]] = {}

    def fill(m: re.Match) -> str:
        found = cache.setdefault(m["path"], regions(ROOT / m["path"]))
        if m["name"] not in found:
            raise KeyError(f"{m['path']} has no region {m['name']!r}")
        return m["head"] + found[m["name"]] + m["tail"]

    return _EXCERPT.sub(fill, page)


if __name__ == "__main__":
    stale = False
    for page in PAGES:
        new = render(page.read_text())
        if "--check" in sys.argv:
            stale = stale or new != page.read_text()
        else:
            page.write_text(new)
    sys.exit(stale)
