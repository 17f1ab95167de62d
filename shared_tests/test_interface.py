"""fa2.attention's validation, backend lookup and dispatch rule: the same for every backend, checked once
per backend since each nox session installs only one."""

from __future__ import annotations

import re

import pytest
import torch

import fa2
from fa2 import registry


def _qkv(q=(2, 3, 8, 16), k=(2, 3, 8, 16), v=None, dtype=torch.float32):
    return torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype), torch.randn(v or k, dtype=dtype)


BAD_INPUTS = [
    pytest.param(
        lambda: _qkv(q=(16,)), ValueError, r"q must have shape \(\.\.\., seqlen, head_dim\), got \(16,\)", id="rank1"
    ),
    pytest.param(lambda: _qkv(q=(2, 8, 16)), ValueError, r"same rank.*q \(2, 8, 16\)", id="rank-mismatch"),
    pytest.param(lambda: _qkv(k=(3, 3, 8, 16)), ValueError, r"same leading dims.*k \(3, 3, 8, 16\)", id="leading-dims"),
    pytest.param(
        lambda: _qkv(k=(2, 4, 8, 16)),
        ValueError,
        r"q's heads \(dim -3\) must be a multiple of k's and v's .*q \(2, 3, 8, 16\), k \(2, 4, 8, 16\)",
        id="heads-not-a-multiple",
    ),
    pytest.param(
        lambda: _qkv(q=(2, 4, 8, 16), k=(2, 0, 8, 16)), ValueError, r"q's heads \(dim -3\) must be", id="no-kv-heads"
    ),
    pytest.param(
        lambda: _qkv(q=(2, 4, 8, 16), k=(2, 2, 8, 16), v=(2, 1, 8, 16)),
        ValueError,
        r"same leading dims.*v \(2, 1, 8, 16\)",
        id="k-v-heads",
    ),
    pytest.param(
        lambda: _qkv(k=(2, 3, 8, 16), v=(2, 3, 9, 16)),
        ValueError,
        r"k and v must have the same sequence length, got k \(2, 3, 8, 16\) and v \(2, 3, 9, 16\)",
        id="kv-lengths",
    ),
    pytest.param(lambda: _qkv(k=(2, 3, 8, 32)), ValueError, r"same head_dim.*k \(2, 3, 8, 32\)", id="head-dims"),
    pytest.param(
        lambda: _qkv(q=(1, 4, 300), k=(1, 4, 300)),
        ValueError,
        r"head_dim must be from 1 to 256, got 300",
        id="head-dim-300",
    ),
    pytest.param(
        lambda: _qkv(dtype=torch.float64), TypeError, r"float32, float16 or bfloat16, got torch.float64", id="float64"
    ),
    pytest.param(lambda: tuple(t.to(torch.int32) for t in _qkv()), TypeError, r"got torch.int32", id="int32"),
    pytest.param(
        lambda: (lambda q, k, v: (q, k.half(), v))(*_qkv()),
        TypeError,
        r"same dtype, got q torch.float32, k torch.float16",
        id="mixed-dtypes",
    ),
    pytest.param(
        lambda: (lambda q, k, v: (q, k.to("meta"), v))(*_qkv()),
        ValueError,
        r"one device, got q cpu, k meta, v cpu",
        id="mixed-devices",
    ),
    pytest.param(lambda: ([[0.0]], *_qkv()[1:]), TypeError, r"q must be a torch.Tensor, got list", id="not-a-tensor"),
]


@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_bad_inputs_are_refused_before_dispatch(backend, make, error, message):
    q, k, v = make()
    with pytest.raises(error, match=message):
        fa2.attention(q, k, v, backend=backend)


def test_bad_scale(backend):
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        fa2.attention(*_qkv(), scale=float("nan"), backend=backend)


def test_unknown_backend_lists_installed(backend):
    with pytest.raises(ValueError, match=rf"unknown fa2 backend 'cutlass'; installed: .*{backend}"):
        fa2.attention(*_qkv(), backend="cutlass")


@pytest.mark.parametrize("name", registry.KNOWN)
def test_known_backend_not_installed_gives_install_command(backend, name):
    if name in fa2.backends():
        pytest.skip(f"{name} is installed here")
    with pytest.raises(fa2.BackendNotInstalledError, match=re.escape(registry.install_command(name))):
        fa2.attention(*_qkv(), backend=name)


@pytest.mark.parametrize("name", registry.KNOWN)
def test_install_command_from_a_checkout_names_existing_folders(name):
    """The suite runs from a checkout with fa2 installed editable: the command names the interface's folder
    with the extra and the backend's folder, both of which exist (pip resolves no sibling by itself)."""
    root = registry.checkout()
    assert root is not None, f"fa2 imported from {fa2.__file__}, not from a checkout"
    command = registry.install_command(name)
    interface, backend_dir = root / "packages" / "fa2-attention", root / "packages" / f"fa2-{name}"
    assert command == f'pip install -e "{interface}[{name}]" -e {backend_dir}'
    assert (interface / "pyproject.toml").is_file() and (backend_dir / "pyproject.toml").is_file()


def test_install_command_from_wheels_names_the_distribution(monkeypatch):
    monkeypatch.setattr(registry, "checkout", lambda: None)
    assert registry.install_command("triton") == 'pip install --find-links WHEELS_DIR "fa2-attention[triton]"'
    assert registry.install_command("transformers") == 'pip install "fa2-attention[transformers]"'


@pytest.mark.parametrize("causal", ["no", 1, None, torch.tensor(True)], ids=["str", "int", "None", "tensor"])
def test_causal_must_be_a_bool(backend, causal):
    with pytest.raises(TypeError, match=r"causal must be a bool, got "):
        fa2.attention(*_qkv(), causal=causal, backend=backend)


def test_backends_lists_this_one(backend):
    info = fa2.backends()[backend]
    assert info.name == backend and info.status in ("native", "emulated", "unavailable") and info.detail


def test_default_backend_rule(backend, device):
    """CPU tensors: pytorch. CUDA tensors: the first of triton, numba-cuda, pytorch that runs natively."""
    if device.type == "cpu":
        assert registry.default_backend(device) == "pytorch"
    else:
        native = [n for n in registry.KNOWN if fa2.backends().get(n, (0, "")).status == "native"]
        assert registry.default_backend(device) == native[0]
