"""``AttentionSpec``: the one frozen description of what to compute that every backend receives with q, k, v;
``AttentionOutput``: the (O, L) that every entry point returns.

fa2.attention validates the caller's arguments and builds the spec once (``fa2.validation.make_spec``); a
backend reads its fields and turns them into its own switches (Triton constexprs, numba-cuda compile-time
flags, PyTorch branches) instead of taking a growing list of arguments. Nothing here validates: by the time
a spec exists its values are legal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

UNBOUNDED = -1


class AttentionOutput(NamedTuple):
    """O: q's shape, dtype and device. L: q.shape[:-1], float32, natural-log logsumexp of the scaled scores."""

    O: torch.Tensor
    L: torch.Tensor


@dataclass(frozen=True)
class AttentionSpec:
    """What to compute: softmax(mask(bias(cap(q kᵀ · scale)))) v, for (batch, heads, seqlen, head_dim) inputs.

    Fields:
        scale: multiplies q kᵀ.
        window: (left, right), each >= 0 or -1 (UNBOUNDED). Aligned bottom-right like causal: query i sees
            key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right (a -1 side has no bound). Causal is
            (-1, 0). With Nq = 4, Nk = 6 and window (1, 0)::

                0 1 1 0 0 0
                0 0 1 1 0 0
                0 0 0 1 1 0
                0 0 0 0 1 1

        softcap: 0.0, or > 0: scores become softcap · tanh(scores / softcap) before the bias and the mask.
        alibi_slopes: None, or (batch, heads) float32 on q's device, any strides (a slope per head is
            expanded over batch with stride 0): adds -slope · |i + Nk - Nq - j| to the capped scores.
        group: heads // heads_k, the query heads that share one key/value head (1: multi-head attention).
        cu_seqlens_q, cu_seqlens_k: None, or (num_seqs + 1,) int32 offsets on q's device: a packed batch
            (``fa2.varlen_attention``). q is then (1, heads, total_q, head_dim) and k, v (1, heads_k,
            total_k, head_dim); sequence s has queries [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and keys
            [cu_seqlens_k[s], cu_seqlens_k[s + 1]), and the window, ALiBi and the rows that see no key are
            each sequence's own (its Nq, Nk). alibi_slopes is then (num_seqs, heads).
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (at least; 0 without cu_seqlens), for
            sizing a grid without reading the offsets.
        sink: None, or (heads,) float32, contiguous, on q's device: attention sinks (gpt-oss), a logit per
            head that joins every row's softmax denominator and no numerator: O_i = Σ_j exp(s_ij - L_i) v_j
            with L_i = log(exp(sink[h]) + Σ_j exp(s_ij)), the L returned. A row that sees no key gets O = 0
            and L = sink[h]. Its gradient, dsink[h] = -Σ_i exp(sink[h] - L_i) · rowsum(dO_i ∘ O_i) over every
            batch row and query of head h, leaves dq, dk and dv as they are without it (P = exp(s - L)).
            Finite values (``fa2.attention``'s docstring says what -inf gives).

    KV-cache attention (``fa2.kvcache_attention``, a backend's ``kvcache_forward``) adds:
        cache_seqlens: None, or (batch,) int32 on q's device: K_b, the keys row b of q attends to, keys
            [0, K_b) of its cache (after any append). Masks are aligned on K_b: query i sees key j iff
            leftpad_b <= j < K_b and i + K_b - Nq - left <= j <= i + K_b - Nq + right; ALiBi adds
            -slope · |i + K_b - Nq - j|. With Nq = 2, K_b = 5, leftpad_b = 1 and causal::

                0 1 1 1 0
                0 1 1 1 1

        cache_leftpad: None, or (batch,) int32: leftpad_b, the first key row b sees (the keys before it are
            padding).
        cache_batch_idx: None, or (batch,) int32: row b of q reads cache row cache_batch_idx[b] of a
            contiguous cache (default b). Never with a block table.
        block_table: None, or (batch, pages_per_seq) int32: a paged cache; key j of row b is row
            j % page_size of page block_table[b, j // page_size].
        num_splits: how many key ranges one (batch, key/value head) is split into, merged by their
            logsumexp; 0: the backend picks; 1: no split.
        With cu_seqlens_q also set (flash-attn's varlen function with a block table), q is packed as
        above and batch is the number of sequences, each sequence's Nq its own.
    """

    scale: float
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    group: int = 1
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    sink: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    num_splits: int = 0

    @classmethod
    def build(
        cls, scale: float, window: tuple[int, int], softcap: float, alibi_slopes, group: int, **fields
    ) -> AttentionSpec:
        """``AttentionSpec(scale, window, softcap, alibi_slopes, group, **fields)`` for the spec every call
        makes (``fa2.validation.make_spec``): the fields set at once instead of by the frozen class's
        ``__init__``, one ``object.__setattr__`` a field (0.4 against 1.2 µs of host time on this project's
        CPU). Validates nothing, as ``__init__`` validates nothing either. Under torch.compile, ``__init__``:
        dynamo traces no update of an instance's ``__dict__``."""
        if torch.compiler.is_compiling():
            return cls(scale, window, softcap, alibi_slopes, group, **fields)
        if fields:
            unknown = fields.keys() - _DEFAULTS.keys()
            if unknown:
                raise TypeError(f"AttentionSpec has no field {sorted(unknown)}")
        new = object.__new__(cls)
        new.__dict__.update(
            _DEFAULTS, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, group=group, **fields
        )
        return new

    def replace(self, **changes) -> AttentionSpec:
        """``dataclasses.replace(self, **changes)`` for the calls made on every decode step: the fields copied
        without replace's walk over the class's fields and a new ``__init__`` (3.1 against 1.0 µs of host time
        on this project's CPU). Validates nothing, as ``__init__`` validates nothing either."""
        unknown = changes.keys() - self.__dict__.keys()
        if unknown:
            raise TypeError(f"AttentionSpec has no field {sorted(unknown)}")
        new = object.__new__(AttentionSpec)
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def paged(self) -> bool:
        """The KV cache is paged (block_table given)."""
        return self.block_table is not None

    @property
    def varlen(self) -> bool:
        """q, k and v are packed sequences (cu_seqlens_q and cu_seqlens_k given)."""
        return self.cu_seqlens_q is not None

    @property
    def causal(self) -> bool:
        """The window is exactly the causal mask (-1, 0)."""
        return self.window == (UNBOUNDED, 0)

    @property
    def masked(self) -> bool:
        """Some key is out of some query's window."""
        return self.window != (UNBOUNDED, UNBOUNDED)

    def key_range(self, q_start: int, q_end: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """[lo, hi): the keys that some query of rows [q_start, q_end) sees, clipped to [0, seqlen_k). Empty
        (lo >= hi) where no row sees a key. Key tiles outside it are the ones a kernel skips."""
        left, right = self.window
        shift = seqlen_k - seqlen_q
        lo = 0 if left == UNBOUNDED else max(0, q_start + shift - left)
        hi = seqlen_k if right == UNBOUNDED else min(seqlen_k, q_end - 1 + shift + right + 1)
        return lo, hi

    def visible(self, rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
        """(len(rows), len(cols)) bool: True where query rows[a] sees key cols[b]. For the PyTorch backend's
        tiles and for the reference."""
        left, right = self.window
        diag = rows[:, None] + (seqlen_k - seqlen_q)
        ok = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
        if right != UNBOUNDED:
            ok &= cols[None, :] <= diag + right
        if left != UNBOUNDED:
            ok &= cols[None, :] >= diag - left
        return ok


# Every field's default (``AttentionSpec.build`` starts from them; scale, which has none, it always sets).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionSpec)}
