"""fa2-numba-cuda's tuners: ``python -m fa2_numba_cuda.tuning.forward`` and ``.backward`` time the wgmma kernels'
configurations against their defaults and SDPA's kernels."""
