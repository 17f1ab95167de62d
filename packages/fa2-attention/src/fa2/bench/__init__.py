"""The side-by-side benchmark: every installed fa2 backend against the attention a user would pick
instead, each checked against ``fa2.reference`` before it is timed; the forward, and the backward (FLOPs
2.5 times the forward's) against SDPA's flash, cuDNN and math backward on fewer shapes.

    python -m fa2.bench                                  # GPU: the FlashAttention-2 paper's sweep, fwd and bwd
    python -m fa2.bench --providers fa2-triton,sdpa-flash --seqlens 1024,4096 --dtypes bf16
    python -m fa2.bench --quick                          # a few shapes; <name>-quick.*
    python -m fa2.bench --quick --modes fwd              # the same, forward only
    nox -s bench                                         # without a GPU: emulated, tiny shapes

Issue 20's shapes (Llama/Mistral-like: 32 query heads, 8 key/value heads, D = 128, causal, bf16, 16k tokens:
B = 4 at N = 4k, B = 1 at 16k). The GQA run times the dense heads (--group 1) beside GQA in one process,
both through fa2.scaled_dot_product_attention(enable_gqa=True) (--fa2-entry sdpa: the default with a group
above 1 and no window or softcap); the window and softcap runs go through fa2.attention, each beside its
plain causal run. Split by mode (--append adds to the files of the first part) to keep each run short:

    python -m fa2.bench --heads 32 --group 1,4 --head-dims 128 --causal yes --dtypes bf16 --seqlens 4096,16384 \
        --providers fa2-triton,fa2-numba-cuda,sdpa-flash,sdpa-cudnn --modes fwd    # <name>-gqa4-h32.*
    python -m fa2.bench --heads 32 --group 4 --head-dims 128 --dtypes bf16 --seqlens 16384 --window none,4096 \
        --providers fa2-triton,fa2-numba-cuda,sdpa-flash,sdpa-cudnn --modes fwd    # <name>-gqa4-h32-w4096.*
    python -m fa2.bench --heads 32 --group 4 --head-dims 128 --causal yes --dtypes bf16 --seqlens 4096,16384 \
        --softcap 0,50 --providers fa2-triton,fa2-numba-cuda --modes fwd           # <name>-gqa4-h32-cap50.*

each again with ``--modes bwd --append``, and with ``--providers flex --modes fwd --append`` for
FlexAttention's window and softcap (compiled per shape: tens of seconds each).

The ``<name>.md`` of a run with options has an "Options against none" table: each provider's TFLOP/s with
the option over its TFLOP/s without it, on the same shape (a window's counted over its visible pairs).

Modules: ``providers`` (what is compared), ``check`` (the correctness check), ``timing`` (clocks, memory,
matmul ceilings), ``sweep`` (shapes, the loop, the CSV), ``report`` and ``plot`` (the summary).

Files, under ``--out`` (default: the checkout's docs/benchmarks), named after the GPU (``h200``) or
``cpu-emulated``, then the options (``-quick``, ``-gqa4``, ``-h32``, ``-w4096``, ``-cap50``, several values
joined by +; ``-attention`` or ``-sdpa`` for a --fa2-entry that is not the default); a run writes
``<name>.partial*`` and moves them over these once it has measured anything:

    <name>.csv           one row per measured (provider, dtype, shape, options), columns ``sweep.COLUMNS``
    <name>-skipped.csv   every (provider, shape) not measured: skipped, wrong or failed, with the reason
    <name>-run.json      the environment, the command, the wall time and the matmul ceilings
    <name>.md            ratio tables (fa2 against sdpa-flash and sdpa-cudnn), TFLOP/s, memory
    <name>-<mode>-D<D>.png  TFLOP/s against N, a panel per (dtype, causal), the matmul ceiling as a line
"""
