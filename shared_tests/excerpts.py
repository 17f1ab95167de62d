"""Keeps the code excerpts of docs/side-by-side.md equal to the source they quote.

A source file marks a region with two comment lines (the same in Python for every backend):

    # side-by-side: load-q
    ...code...
    # side-by-side: end

and the page quotes it as a fenced block right after a marker comment naming file and region:

    <!-- excerpt: packages/fa2-triton/src/fa2_triton/forward.py#load-q -->
    ```python
    ...code, dedented...
    ```

``python shared_tests/excerpts.py`` rewrites every such block from the source; test_docs.py fails when a
block and its region differ.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "side-by-side.md"
_START = re.compile(r"^\s*# side-by-side: (?P<name>[\w-]+)\s*$")
_END = re.compile(r"^\s*# side-by-side: end\s*$")
_EXCERPT = re.compile(
    r"(?P<head><!-- excerpt: (?P<path>[^#\s]+)#(?P<name>[\w-]+) -->\n```python\n)(?P<body>.*?)(?P<tail>```)",
    re.DOTALL,
)


def regions(path: Path) -> dict[str, str]:
    """Every marked region of a source file, dedented, by name."""
    found: dict[str, str] = {}
    name, lines = None, []
    for line in path.read_text().splitlines():
        if name is None:
            m = _START.match(line)
            if m:
                name, lines = m["name"], []
        elif _END.match(line):
            found[name] = textwrap.dedent("\n".join(lines)) + "\n"
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
    new = render(PAGE.read_text())
    if "--check" in sys.argv:
        sys.exit(new != PAGE.read_text())
    PAGE.write_text(new)
