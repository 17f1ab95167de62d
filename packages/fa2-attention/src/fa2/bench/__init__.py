"""The side-by-side benchmark: every installed fa2 backend against the attention a user would pick
instead, each checked against ``fa2.reference`` before it is timed; the forward, and the backward (FLOPs
2.5 times the forward's) against SDPA's flash, cuDNN and math backward on fewer shapes.

    python -m fa2.bench                                  # GPU: the FlashAttention-2 paper's sweep, fwd and bwd
    python -m fa2.bench --providers fa2-triton,sdpa-flash --seqlens 1024,4096 --dtypes bf16
    python -m fa2.bench --quick                          # a few shapes; <name>-quick.*
    python -m fa2.bench --quick --modes fwd              # the same, forward only
    nox -s bench                                         # without a GPU: emulated, tiny shapes

Modules: ``providers`` (what is compared), ``check`` (the correctness check), ``timing`` (clocks, memory,
matmul ceilings), ``sweep`` (shapes, the loop, the CSV), ``report`` and ``plot`` (the summary).

Files, under ``--out`` (default: the checkout's docs/benchmarks), named after the GPU (``h200``) or
``cpu-emulated``; a run writes ``<name>.partial*`` and moves them over these once it has measured anything:

    <name>.csv           one row per measured (provider, dtype, shape), columns ``sweep.COLUMNS``
    <name>-skipped.csv   every (provider, shape) not measured: skipped, wrong or failed, with the reason
    <name>-run.json      the environment, the command, the wall time and the matmul ceilings
    <name>.md            ratio tables (fa2 against sdpa-flash and sdpa-cudnn), TFLOP/s, memory
    <name>-<mode>-D<D>.png  TFLOP/s against N, a panel per (dtype, causal), the matmul ceiling as a line
"""
