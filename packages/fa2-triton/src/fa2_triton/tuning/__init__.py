"""fa2-triton's tuners, apart from what an attention call imports (they need ``fa2.bench``):
``python -m fa2_triton.tuning.forward`` and ``python -m fa2_triton.tuning.backward`` time launch
configurations of the forward's and the backward's kernels on a GPU and print the ``tiles.TILES`` and
``tiles.BWD_TILES`` entries to paste into tiles.py."""
