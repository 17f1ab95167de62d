"""The side-by-side benchmark: every installed fa2 backend against the attention a user would pick
instead, each checked against ``fa2.reference`` before it is timed; the forward, and the backward (FLOPs
2.5 times the forward's) against SDPA's flash, cuDNN and math backward on fewer shapes.

    python -m fa2.bench                                  # GPU: the FlashAttention-2 paper's sweep, fwd and bwd
    python -m fa2.bench --providers fa2-triton,sdpa-flash --seqlens 1024,4096 --dtypes bf16
    python -m fa2.bench --quick                          # a few shapes; <name>-quick.*
    python -m fa2.bench --quick --modes fwd              # the same, forward only
    python -m fa2.bench --varlen                         # issue 21: packed batches; <name>-varlen.*
    python -m fa2.bench --decode                         # issue 22: KV-cache decoding; <name>-decode.*
    nox -s bench                                         # without a GPU: emulated, tiny shapes
    nox -s bench -- --varlen                             # arguments after -- go to fa2.bench

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

Issue 21's packed batches (``--varlen``): per (mode, D, causal) one batch of 16384 tokens in sequences
one after the other, their lengths drawn uniformly from 256 to 4096 by ``random.Random(--varlen-seed)``
(default 0; the last one what is left; printed, and recorded in the CSV and the run's JSON), D = 64 and 128,
H = 2048 / D, bf16, forward and backward. fa2's backends through fa2.varlen_attention against SDPA on
nested jagged tensors (sdpa-njt) and compiled FlexAttention with a document mask (flex), all on the same
(total, H, D) tensors; TFLOP/s over the real (query, key) pairs (Σ n², causal Σ n (n + 1) / 2). Beside
each batch, each fa2 backend's dense shape at N = 2048 (B = 8, fa2.attention, counted as the dense sweep
counts it): the report's ratios are packed against that, against sdpa-njt and against flex, with issue
21's targets (0.95, 1, 1). A backend without a packed path (NotImplementedError), NJT's math path without
is_causal (the CPU's) and flex on the CPU are skipped, with the reason. Emulated: 256 tokens, lengths 16 to
64, D 16 and 32, fp16. On the lent H200 in two parts, each well inside a call's 10 minutes:

    python -m fa2.bench --varlen --modes fwd                  # <name>-varlen.*
    python -m fa2.bench --varlen --modes bwd --append

Issue 22's decoding (``--decode``): one or a few query tokens against a KV cache, forward only. GPU: bf16,
32 query heads / 8 key/value heads, D 128, 1 and 4 query tokens at (batch, cached keys) (8, 8k), (8, 32k),
(1, 128k), (64, 4k) (``--decode-points``, ``--decode-queries``), every query seeing every cached key,
cache_seqlens = the cached keys. Each point's cache is contiguous and paged in pages of 16 and 256
(``--page-sizes``; the block table a random permutation of the pages), all layouts holding the same keys and
timed in the same rounds, stored as real caches are: transposed views of flash-attn's (batch, seqlen,
heads_k, D) and (pages, page, heads_k, D). fa2's backends through fa2.kvcache_attention(num_splits=0) on each
layout; sdpa (F.scaled_dot_product_attention(enable_gqa=True), the dispatcher's pick) and sdpa-flash (the same
forced to FLASH_ATTENTION) on contiguous copies; flex (compiled) only if named in --providers. Times in µs and
K/V bytes read per second (2·B·H_k·K·D·bytes per element / time) against a device-to-device copy
(``timing.copy_ceiling``: bytes read plus written per second, in the run's JSON). ``<name>-decode.md`` gives
issue 22's ratios with their targets: SDPA's time over fa2's (1), the fraction of the copy ceiling from 32k
keys (0.85), paged over contiguous (0.95), fa2-numba-cuda's rate over fa2-triton's (0.5). Emulated: fp16,
4 / 2 heads, D 16, (2, 40) and (1, 64), pages of 16 and 32.

    python -m fa2.bench --decode                                          # <name>-decode.*
    python -m fa2.bench --decode --providers flex --append                # FlexAttention beside it

Modules: ``providers`` (what is compared), ``check`` (the correctness check), ``timing`` (clocks, memory,
matmul ceilings), ``sweep`` (shapes, the loop, the CSV), ``report`` and ``plot`` (the summary), ``output``
(the default folder and file stem, which fa2-triton's tuners share).

Files, under ``--out`` (default: the checkout's docs/benchmarks), named after the GPU (``h200``) or
``cpu-emulated``, then the options (``-quick``, ``-gqa4``, ``-h32``, ``-w4096``, ``-cap50``, several values
joined by +; ``-attention`` or ``-sdpa`` for a --fa2-entry that is not the default); a run writes
``<name>.partial*`` and moves them over these once it has measured anything:

    <name>.csv           one row per measured (provider, dtype, shape, options), columns ``sweep.COLUMNS``
    <name>-skipped.csv   every (provider, shape) not measured: skipped, wrong or failed, with the reason
    <name>-run.json      the environment, the command, the wall time and the matmul ceilings
    <name>.md            ratio tables (fa2 against sdpa-flash and sdpa-cudnn), TFLOP/s, memory
    <name>-<mode>-D<D>.png  TFLOP/s against N, a panel per (dtype, causal), that dtype's matmul ceiling as a line

and for --varlen (``<name>-varlen``) the same CSVs and JSON (the CSVs' lengths column: the packed batch's
lengths, empty on the dense reference rows), ``<name>-varlen.md`` (packed against dense, sdpa-njt and
flex, issue 21's targets, every measurement) and ``<name>-varlen-<mode>.png`` (bars of TFLOP/s, a panel per
(dtype, D)); for --decode (``<name>-decode``) the same CSVs (seqlen the cached keys, seqlen_q the query
tokens, page_size 0 for a contiguous cache, tbps the K/V TB/s) and JSON (the sweep, the copy ceiling),
``<name>-decode.md`` (issue 22's ratios, µs per provider and layout, every measurement) and
``<name>-decode.png`` (bars of K/V TB/s per point, a panel per number of query tokens, the copy ceiling).
"""
