"""fa2-numba-cuda's own tests: skipped unless numba-cuda is among the selected backends (``--backend``), and
the devices numba's kernels run on for the tensors of ``--device``."""

from __future__ import annotations

import pytest

from fa2_numba_cuda import common, tensor_cores


@pytest.fixture(autouse=True)
def _numba_cuda_selected(request):
    selected = request.config.getoption("--backend")
    if selected and "numba-cuda" not in selected:
        pytest.skip(f"numba-cuda's own tests; --backend {selected}")


@pytest.fixture
def kernel_device(device):
    """Where numba's kernels run on the tensors of ``--device``: CPU tensors in the simulator only, CUDA tensors
    only without it."""
    if common.simulated() != (device.type == "cpu"):
        pytest.skip(
            f"--device {device.type} with NUMBA_ENABLE_CUDASIM={int(common.simulated())}: numba runs "
            "CPU tensors only in its simulator and CUDA tensors only without it"
        )
    return device


@pytest.fixture
def tc_device(kernel_device):
    """Where the tensor-core kernels run: the simulator on the CPU, or a GPU of compute capability 8.0+."""
    if kernel_device.type == "cuda" and tensor_cores.capability(kernel_device) < tensor_cores.MIN_COMPUTE_CAPABILITY:
        pytest.skip(
            f"the tensor-core kernels need compute capability 8.0+, got {tensor_cores.capability(kernel_device)}"
        )
    return kernel_device
