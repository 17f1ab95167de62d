"""fa2-numba-cuda's tuners: ``python -m fa2_numba_cuda.tuning.backward`` times the wgmma backward's configurations."""
