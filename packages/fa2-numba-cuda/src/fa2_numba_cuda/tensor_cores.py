"""What fa2-numba-cuda's tensor-core kernels take, for their launchers (``forward_tc``, ``backward_tc``, and
``kvcache`` for ``kvcache_tc``) to choose and refuse by: the compute capability the instructions need
(``mma.sync`` m16n8k16 with bf16, ``ldmatrix``, ``cp.async``: 8.0) and a device's (``capability``), the largest
head dim (the fragments of O, Q and S in registers), a head dim padded to the mma's k (``padded_head_dim``;
the KV-cache kernels pad further, to their own blocks). The instructions themselves are in ``mma.py``.
"""

from __future__ import annotations

import torch

MAX_HEAD_DIM = 128
MIN_COMPUTE_CAPABILITY = (8, 0)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the block computes with: a multiple of 16 (an mma's k), the extra columns zero-filled."""
    return max(16, -(-head_dim // 16) * 16)


_CAPABILITIES: dict[torch.device, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once per device (``torch.cuda.get_device_capability``
    costs microseconds a call)."""
    found = _CAPABILITIES.get(device)
    if found is None:
        found = _CAPABILITIES[device] = torch.cuda.get_device_capability(device)
    return found
