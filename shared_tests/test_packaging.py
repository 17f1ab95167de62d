"""The distributions install as the README says: wheels built from this checkout, then
``pip install --find-links <wheels> "fa2-attention[pytorch]"`` into a fresh venv, which must take the
interface and the backend from those wheels (never PyPI's ``fa2``, ForceAtlas2) and compute attention.

Runs once, in the pytorch session of ``nox -s test``, where the test extra brings ``build`` and nox sets
``FA2_TORCH``, the torch requirement its own venv was given: the fresh venv installs the same from the
same index or find-links (uv's cache hard-links it where uv makes the venvs). Elsewhere (an offline GPU
machine's ``nox --no-venv -s test_gpu``) it is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv

import pytest

from fa2 import registry

DISTRIBUTIONS = ("fa2-attention", "fa2-pytorch", "fa2-triton", "fa2-numba-cuda")
CALL = """
import json, math
from importlib import metadata
import torch, fa2
q, k, v = (torch.randn(2, 3, 17, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
O, L = fa2.attention(q, k, v, causal=True)
s = (q @ k.transpose(-1, -2)) / math.sqrt(16)
s = s.masked_fill(torch.ones(17, 17, dtype=torch.bool).triu(1), -math.inf)
forceatlas = [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].lower() == "fa2"]
print(json.dumps({
    "versions": {d: metadata.version(d) for d in ("fa2-attention", "fa2-pytorch")},
    "backends": sorted(fa2.backends()),
    "file": fa2.__file__,
    "forceatlas": forceatlas,
    "o_err": (O - torch.softmax(s, -1) @ v).abs().max().item(),
    "l_err": (L - torch.logsumexp(s, -1)).abs().max().item(),
}))
"""


@pytest.fixture(scope="module")
def once(backend):
    if backend != "pytorch":
        pytest.skip("runs once, in the pytorch session")
    if "FA2_TORCH" not in os.environ:
        pytest.skip("runs in nox -s test, whose FA2_TORCH names the torch to install into the fresh venv")


@pytest.fixture(scope="module")
def wheels(once, tmp_path_factory):
    pytest.importorskip("build", reason="needs the test extra's build (pip install build)")
    root = registry.checkout()
    if root is None:
        pytest.skip("fa2 is not imported from a checkout: there is nothing to build")
    out, sources = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("sources")
    for name in DISTRIBUTIONS:
        # From a copy: setuptools writes build/ and egg-info beside the sources it builds.
        source = shutil.copytree(
            root / "packages" / name,
            sources / name,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
        )
        # No isolation: the session's setuptools builds them, with no download of a build environment.
        subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
            check=True,
            capture_output=True,
        )
    return out


def test_wheels_have_our_names(wheels):
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert names == sorted(d.replace("-", "_") for d in DISTRIBUTIONS)


def fresh_venv(env_dir) -> tuple[str, list[str]]:
    """A new venv (uv's where uv is installed, as nox's are) and the command that installs into it."""
    python = str(env_dir / "bin" / "python")
    uv = shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(env_dir)], check=True)
        return python, [uv, "pip", "install", "-q", "--python", python]
    venv.create(env_dir, with_pip=True)
    return python, [python, "-m", "pip", "install", "-q", "--no-compile"]


def test_extra_installs_from_the_wheels_into_a_fresh_venv(wheels, tmp_path):
    env_dir = tmp_path / "venv"
    python, install = fresh_venv(env_dir)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([*install, os.environ["FA2_TORCH"]], check=True, env=clean)
    subprocess.run([*install, "--find-links", str(wheels), "fa2-attention[pytorch]"], check=True, env=clean)
    out = subprocess.run([python, "-c", CALL], check=True, capture_output=True, text=True, env=clean, cwd=tmp_path)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["versions"] == {"fa2-attention": "0.1.0", "fa2-pytorch": "0.1.0"}
    assert got["backends"] == ["pytorch"]
    assert got["file"].startswith(str(env_dir)), got["file"]
    assert got["forceatlas"] == []
    assert got["o_err"] < 1e-5 and got["l_err"] < 1e-5, got
