"""flash-attn 2.8.3's own tests/test_flash_attn.py, run against fa2.flash_attn.

The test file is not ours and is not in the repository: ``fetch.py`` puts it (and an einops wheel) into
``upstream/``, which git ignores. It needs CUDA at import (torch.cuda.get_device_capability at module level),
so it runs on a GPU only, and only when asked for, with the fa2 backend to run it on:

    FA2_FLASH_ATTN_SUITE=triton python -m pytest shared_tests/flash_attn_suite -n 8
    FA2_FLASH_ATTN_SUITE=triton FA2_FLASH_ATTN_SUBSET=quick python -m pytest shared_tests/flash_attn_suite -n 8

Without FA2_FLASH_ATTN_SUITE, ``upstream/`` is not collected (``pytest shared_tests`` on a CPU never
imports the file). With it, ``flash_attn_shims.install`` puts fa2 under the names the test imports (``flash_attn``,
``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``, ``flash_attn.layers.rotary``) before
collection, and collection

- deselects every item whose ``dropout_p`` is > 0 (fa2 has no dropout: the issue's "dropout aside");
- with FA2_FLASH_ATTN_SUBSET=quick, makes only the items of QUICK below (the rest is never collected):
  chosen test functions on fewer head dims and sequence lengths, every flag of theirs kept.

Everything else runs unchanged: the test's own reference, its tolerance rule, its skips. The conformance
suite's conftest (conftest.py at the repository's root) is loaded too; its ``--backend`` and ``--device`` do not
apply here, and its NaN-poisoned ``torch.empty`` (``poison_empty``) is overridden below by a no-op, so
that flash-attn's tests run as they were written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _pytest.mark.structures import Mark

ENV = "FA2_FLASH_ATTN_SUITE"
BACKENDS = ("pytorch", "triton", "numba-cuda")
UPSTREAM = Path(__file__).parent / "upstream"
SUBSET_ENV = "FA2_FLASH_ATTN_SUBSET"
# FA2_FLASH_ATTN_SUBSET=quick: test function -> {parameter: the values kept}; a parameter not named keeps all
# its values. The head dims not a multiple of 8 (59) and a large one (128); lengths around tile edges with
# seqlen_q != seqlen_k both ways; the one-key and one-query extremes of the race-condition test.
QUICK = {
    "test_flash_attn_qkvpacked": {"d": {59, 128}, "seqlen": {97, 1025}},
    "test_flash_attn_output": {
        "d": {59, 128},
        "seqlen_q": {113, 512},
        "seqlen_k": {203, 256},
        "deterministic": {False},
    },
    "test_flash_attn_causal": {"d": {59, 128}},
    "test_flash_attn_splitkv": {
        "d": {64},
        "seqlen_q": {3, 64, 128},
        "seqlen_k": {1024, 800, 128},
        "deterministic": {False},
    },
    "test_flash_attn_race_condition": {"d": {64}, "seqlen_q": {239, 128, 1024}, "seqlen_k": {1, 128}},
    "test_flash_attn_bwd_overflow": {},
    "test_flash_attn_bwd_transpose": {},
    "test_flash_attn_deterministic": {"d": {59, 128}, "seqlen_q": {113, 1023}, "seqlen_k": {203, 1024}},
    # varlen: random padding masks unpadded into packed sequences of different lengths, GQA, and both
    # orders of seqlen_q / seqlen_k.
    "test_flash_attn_varlen_qkvpacked": {"d": {59, 128}, "seqlen": {97, 1025}, "deterministic": {False}},
    "test_flash_attn_varlen_output": {
        "d": {59, 128},
        "seqlen_q": {113, 512},
        "seqlen_k": {203, 256},
        "mha_type": {"gqa"},
        "deterministic": {False},
    },
    "test_flash_attn_varlen_causal": {"d": {59, 128}, "seqlen_q": {1, 113}, "seqlen_k": {239, 203}},
    "test_flash_attn_bwd_varlen_overflow": {},
    "test_flash_attn_varlen_deterministic": {"d": {59, 128}, "seqlen_q": {113}, "seqlen_k": {203}},
    # KV cache: one token, a few, and 16 against 20k keys; every mask, rotary, append, paged (256) and
    # leftpad flag, MQA and GQA, the split heuristic.
    "test_flash_attn_kvcache": {
        "d": {59, 128},
        "seqlen_q": {1, 3, 16},
        "seqlen_k": {339, 1024, 20000},
        "rotary_fraction": {0.0, 0.5},
        "rotary_interleaved": {False},
        "seqlen_new_eq_seqlen_q": {False},
        "mha_type": {"mqa", "gqa"},
        "num_splits": {0},
    },
}


def _backend() -> str | None:
    name = os.environ.get(ENV) or None
    if name is not None and name not in BACKENDS:
        raise pytest.UsageError(f"{ENV} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def pytest_ignore_collect(collection_path, config):
    if collection_path == UPSTREAM or UPSTREAM in collection_path.parents:
        return True if _backend() is None else None
    return None


def pytest_configure(config):
    backend = _backend()
    if backend is None:
        return
    if not (UPSTREAM / "test_flash_attn.py").exists():
        raise pytest.UsageError(f"{UPSTREAM}/test_flash_attn.py is missing: run shared_tests/flash_attn_suite/fetch.py")
    import flash_attn_shims

    flash_attn_shims.install(backend)
    config.addinivalue_line("markers", f"fa2_backend: flash-attn's suite on fa2 backend {backend}")


def pytest_report_header(config):
    backend = _backend()
    if backend is None:
        return None
    provenance = UPSTREAM / "PROVENANCE"
    source = provenance.read_text().strip().splitlines()[0] if provenance.exists() else "unknown source"
    return [f"flash-attn suite: fa2 backend {backend}; upstream/test_flash_attn.py from {source}"]


def _subset() -> dict | None:
    name = os.environ.get(SUBSET_ENV) or None
    if name not in (None, "quick"):
        raise pytest.UsageError(f"{SUBSET_ENV} must be quick or unset, got {name!r}")
    return QUICK if name == "quick" else None


def _in_subset(subset: dict | None, name: str, params: dict) -> bool:
    if subset is None:
        return True
    if name not in subset:
        return False
    return all(params.get(key) in values for key, values in subset[name].items())


def _upstream(path) -> bool:
    return UPSTREAM in Path(str(path)).parents


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """With a subset, the test functions outside it are not collected at all (the whole file's 508,772
    items take minutes to collect, in every xdist worker)."""
    subset = _subset() if _backend() is not None else None
    if subset is not None and name.startswith("test_") and _upstream(collector.path) and name not in subset:
        return []
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """With a subset, its values (and dropout_p = 0) filter the test's own parametrize lists before pytest
    expands them, so that only the subset's items are made."""
    subset = _subset() if _backend() is not None else None
    if subset is None or not _upstream(metafunc.definition.path):
        return
    keep = dict(subset.get(metafunc.function.__name__, {}), dropout_p={0.0})
    own = metafunc.definition.own_markers
    for i, mark in enumerate(own):
        if mark.name != "parametrize":
            continue
        argnames, argvalues = mark.args[0], mark.args[1]
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        if not any(n in keep for n in names):
            continue

        def kept(value, names=names):
            values = value if len(names) > 1 else (value,)
            return all(v in keep[n] for n, v in zip(names, values) if n in keep)

        own[i] = Mark(
            mark.name, (argnames, [v for v in argvalues if kept(v)], *mark.args[2:]), mark.kwargs, _ispytest=True
        )


def pytest_collection_modifyitems(config, items):
    backend = _backend()
    if backend is None:
        return
    subset = _subset()
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = getattr(item, "originalname", item.name)
        upstream = _upstream(item.path)
        if upstream and (params.get("dropout_p", 0.0) > 0 or not _in_subset(subset, name, params)):
            dropped.append(item)
            continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def poison_empty():
    """The conformance suite's NaN-poisoned torch.empty stays out of flash-attn's tests."""
    yield
