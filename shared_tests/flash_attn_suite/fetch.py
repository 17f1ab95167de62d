"""Puts flash-attn 2.8.3's tests/test_flash_attn.py, and an einops wheel for it, into upstream/ (git-ignored).

    python shared_tests/flash_attn_suite/fetch.py                  # from GitHub, the v2.8.3 tag
    python shared_tests/flash_attn_suite/fetch.py --file PATH --source "where PATH came from"

The test file is flash-attn's, not ours: it is fetched, never committed. Sources, in order:

1. ``--file PATH``: a copy obtained some other way; ``--source`` says where from, for upstream/PROVENANCE.
2. The file at the v2.8.3 tag on GitHub (RAW_URL). flash-attn's sdist on PyPI (flash_attn-2.8.3.tar.gz)
   has no tests/ folder, so pip cannot bring it.

einops (the test imports ``rearrange`` and ``repeat``) is downloaded as a wheel with pip into
upstream/wheels/, for GPU machines without network and without einops; install it there with
``pip install --no-index --no-deps --target /tmp/site upstream/wheels/*.whl``.

upstream/PROVENANCE records the source, the time and the file's SHA-256 (the conftest prints its first line
in pytest's header). Carry upstream/ to the GPU machine with the checkout (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

VERSION = "2.8.3"
RAW_URL = f"https://raw.githubusercontent.com/Dao-AILab/flash-attention/v{VERSION}/tests/test_flash_attn.py"
UPSTREAM = Path(__file__).parent / "upstream"
TEST = UPSTREAM / "test_flash_attn.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, help="use this copy of tests/test_flash_attn.py instead of GitHub")
    parser.add_argument("--source", help="where --file came from (recorded in upstream/PROVENANCE)")
    parser.add_argument("--no-einops", action="store_true", help="do not download the einops wheel")
    args = parser.parse_args(argv)
    UPSTREAM.mkdir(exist_ok=True)

    if args.file is not None:
        if not args.source:
            parser.error("--file needs --source: say where the copy came from")
        text = args.file.read_text()
        source = args.source
    else:
        try:
            with urllib.request.urlopen(RAW_URL, timeout=60) as response:
                text = response.read().decode()
        except OSError as e:
            print(
                f"could not fetch {RAW_URL}: {e}\n"
                "(flash-attn's sdist on PyPI has no tests/); give a copy with --file PATH --source ...",
                file=sys.stderr,
            )
            return 1
        source = RAW_URL
    if "def test_flash_attn_output" not in text or "from flash_attn import" not in text:
        print("that is not flash-attn's tests/test_flash_attn.py (no test_flash_attn_output)", file=sys.stderr)
        return 1
    TEST.write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    (UPSTREAM / "PROVENANCE").write_text(f"{source}\nfetched {now}\nsha256 {digest}\n")
    print(f"{TEST}: {len(text)} characters, sha256 {digest}, from {source}")

    if not args.no_einops:
        wheels = UPSTREAM / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                str(wheels),
                "einops",
            ],
            check=True,
        )
        print(f"{wheels}: {', '.join(p.name for p in wheels.glob('*.whl'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
