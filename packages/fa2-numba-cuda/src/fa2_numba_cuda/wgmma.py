"""Hopper's warpgroup MMA for numba-cuda kernels: ``wgmma.mma_async`` and shared-memory matrix descriptors, in PTX.

As in ``mma.py``, each GPU function is a ``numba.cuda.extending.intrinsic`` emitting one ``llvmlite.ir.InlineAsm``.
All need sm_90a (numba-cuda compiles for the "a" target on a device of compute capability 9.0). A warpgroup is
four consecutive warps, threads 128 w .. 128 w + 127 of the block; every ``.sync.aligned`` instruction below is
executed by all 128 threads together (the same instruction, not in divergent code). The kernels here give every
thread of a warpgroup the same descriptors and scale_d (the emulation checks it).

    wgmma_bf16, wgmma_f16(acc, desc_a, desc_b, scale_d, trans_b) -> acc
        wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}: D = A B + (D if scale_d else 0), A 64 x 16
        and B 16 x N from shared memory through their descriptors, D 64 x N in fp32 registers. acc is a tuple of
        N / 2 float32 (N = 8 .. 256, a multiple of 8: N = 64 is 32 registers, N = 128 is 64), read and written in
        place (the same registers). scale_d: a runtime int, 0 overwrites D (the first k step). trans_b, a
        compile-time 0 or 1: B K-major (0: stored as N rows of K, as K for Q Kᵀ) or MN-major (1: K rows of N, as
        V for P V). A is always K-major (imm-trans-a 0); imm-scale-a and imm-scale-b are 1 (no negation).
    wgmma_bf16_rs, wgmma_f16_rs(acc, a, desc_b, scale_d, trans_b) -> acc
        The same with A from registers: a is a tuple of four int32 .b32 registers, 16-bit pairs low half first
        (``mma.pack_bf16x2``), in the layout ``wgmma_a_layout`` (P V with P in registers, as FlashAttention-3).
    wgmma_fence()          wgmma.fence.sync.aligned: orders the warpgroup's earlier register accesses (to acc and
        to a register A) before the wgmma.mma_async that follow. Needed before the first mma_async of a sequence
        and after any access to acc or A by the threads; not between mma_async chained on the same acc.
    wgmma_commit()         wgmma.commit_group.sync.aligned: the mma_async issued since the last commit become one
        wgmma-group, the newest.
    wgmma_wait(n)          wgmma.wait_group.sync.aligned n (n a compile-time constant): waits until at most the n
        newest groups are pending; the results of the others are in their registers.
    wgmma_fence_operand(acc) -> acc
        An empty inline asm that reads and writes acc's registers (CUTLASS's warpgroup_fence_operand): after the
        wait, it keeps the compiler from moving uses of acc above the wait. The simulator needs it (below).
    fence_proxy_async()    fence.proxy.async.shared::cta: the thread's earlier shared-memory writes (generic
        proxy: st.shared, and what cp.async has landed) become visible to the async proxy that wgmma reads through.
        Each writing thread fences, then a barrier (``cuda.syncthreads``), then the wgmma.
    zero_accumulators(n) -> acc: a tuple of n float32 zeros (n a compile-time constant).
    opaque_address(address) -> address: the same shared address, as a uint32, through a volatile asm that LLVM
        cannot move: descriptors made from it in a loop are made there, not hoisted out of the loop (where each
        would hold two registers throughout).
    scale_rows(acc, lo, hi) -> acc: D's registers times a factor per row, lo for the thread's rows 16 w + g
        (registers 4 j, 4 j + 1) and hi for rows 16 w + g + 8 (4 j + 2, 4 j + 3): an online softmax's rescale
        of O by alpha (after the wait and ``wgmma_fence_operand``; a ``wgmma_fence`` before the next mma_async).
    wgmma_d_row_col(thread, i) -> (row, column): the element of D in register i of thread (an epilogue's index).
    tile_loader(ROWS, TILE_ROWS, HEAD_DIM, NUM_THREADS) -> load: a block's ``cp.async`` copy of ROWS rows of a
        (.., seqlen, HEAD_DIM) tensor into swizzled tiles (the layout below), zeros past the rows' end; the caller
        commits.

Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): a 64-bit value,

    bits  0-13   (start address & 0x3FFFF) >> 4              the first element of the 64 x 16 or 16 x N slice
    bits 16-29   (leading dimension byte offset & 0x3FFFF) >> 4
    bits 32-45   (stride dimension byte offset & 0x3FFFF) >> 4
    bits 49-51   matrix base offset: 0 when the swizzle pattern starts on its repeat boundary (1024 B for 128 B
                 swizzle), else (pattern start address >> 7) & 7. Always 0 here: tiles are 1024 B aligned.
    bits 62-63   swizzle mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte

``smem_descriptor(address, lbo, sbo, swizzle)`` packs it; ``descriptor_k_major`` and ``descriptor_mn_major`` give
the one for a k16 slice of a tile in the layout below.

The layout supported: 128-byte swizzle (SWIZZLE_128B), 16-bit elements. A tile of R rows (R a multiple of 8) and C
columns, stored in ceil(C / 64) panels of 64 columns (the last one partly used when C is not a multiple of 64),
each panel R rows of 128 bytes, 1024 B aligned (``swizzle128_tile_bytes`` in all); in each 1024 B group of 8
rows, row r's 16-byte chunk j (elements 8 j .. 8 j + 7) sits at chunk j ^ (r % 8):

    byte(r, c) = (c // 64) R 128 + r 128 + 16 ((c % 64 // 8) ^ (r % 8)) + 2 (c % 8)        (``swizzle128_offset``)

the layout TMA's SWIZZLE_128B writes, and 8 consecutive elements of a row stay one 16 B chunk (one cp.async). For
K-major operands (A = Q: 64 rows m, columns k; B = K: N rows n, columns k) the k16 slice s starts at byte(0, 16 s)
(+ 32 B a step inside a panel), SBO = 1024 (8 rows to the next 8), LBO unused (the ISA: "assumed to be 1", encoded
1). For an MN-major B (V: K rows k, columns n) the slice starts at byte(16 s, 0), SBO = 1024 (k rows 0-7 to 8-15),
LBO = R 128 (one 64-column panel to the next). The ISA's canonical layouts, in elements (T = 8 of 16 bits = 16 B),
with the hardware applying Swizzle<3,4,3> to the byte address (address bits 4-6 ^= bits 7-9):

    K-major:  ((8, m), (T, 2)) : ((8T, SBO), (1, T))        MN-major:  ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))

Register fragments (PTX ISA, "Matrix Fragments for wgmma.mma_async.m64nNk16"): warp w = thread // 32 % 4 of the
warpgroup holds rows 16 w .. 16 w + 15; in it lane = 4 g + t as in ``mma.py``. D (``wgmma_d_layout``): register
4 j + e is D[16 w + g + 8 (e // 2), 8 j + 2 t + e % 2], mma.m16n8's C layout repeated over the N / 8 column
blocks j. A in registers (``wgmma_a_layout``): element e (half e % 2 of register e // 2) is A[16 w + g + 8 (e // 2
% 2), 2 t + e % 2 + 8 (e // 4)], mma.m16n8k16's A layout. So D's registers 8 kk .. 8 kk + 7, packed by pairs, are
the A registers of key columns 16 kk .. 16 kk + 15: S = Q Kᵀ's accumulators become P's A fragment for P V.

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same names are Python functions. A warpgroup's 128
simulator threads meet at a barrier; one decodes the descriptors into the elements' byte addresses through the ISA's
canonical layout and the swizzle (not through ``swizzle128_offset``, which the kernels write with), reads shared
memory in ``mma.py``'s simulated address space, multiplies in fp64 and hands each thread its registers. The
descriptors must agree across the warpgroup, swizzle mode 128 B, base offset 0. The results are in flight until
the wait: mma_async returns NaN placeholders, and ``wgmma_fence_operand`` after the ``wgmma_wait`` that completes
their group turns them into the values; so a kernel that reads acc before the wait, or without the fence, gets
NaN. mma_async without a ``wgmma_fence`` since the thread's last wait (or start) raises. The simulator does not
model the async proxy: a missing ``fence_proxy_async`` or barrier before the wgmma goes unseen (the warpgroup's
barrier even hides a missing ``syncthreads`` between its own warps); only the GPU shows those.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import cuda, uint32, uint64

from fa2_numba_cuda import mma
from fa2_numba_cuda.mma import device_function

WARPGROUP_SIZE = 128
SWIZZLE_128B = 1  # the descriptor's swizzle-mode field
SWIZZLE_BYTES = 128
SWIZZLE_ATOM_BYTES = 1024  # 8 rows of 128 B: the swizzle's repeat, and the tiles' alignment
PANEL_COLUMNS = 64  # 16-bit elements in a 128 B row


# The ISA's tables, as (row, column) per thread of the warpgroup: the reference the emulation and the tests use.


def wgmma_d_layout(thread: int, n: int) -> list[tuple[int, int]]:
    """The N / 2 elements of D (64 x n, fp32) thread (0..127) holds, as (row, column), in register order."""
    w, g, t = thread // 32 % 4, thread % 32 // 4, thread % 4
    return [(16 * w + g + 8 * (e % 4 // 2), 8 * (e // 4) + 2 * t + e % 2) for e in range(n // 2)]


def wgmma_a_layout(thread: int) -> list[tuple[int, int]]:
    """The 8 elements of A (64 x 16) thread holds in registers, as (m, k): element e is half e % 2 of register
    e // 2."""
    w, g, t = thread // 32 % 4, thread % 32 // 4, thread % 4
    return [(16 * w + g + 8 * (e // 2 % 2), 2 * t + e % 2 + 8 * (e // 4)) for e in range(8)]


# Index math for kernels: plain integer functions, called on the CPU by the tests.


@device_function
def wgmma_d_row_col(thread, i):
    """(row, column) of D that register i of thread holds (``wgmma_d_layout``)."""
    lane = thread % 32
    return 16 * (thread // 32 % 4) + lane // 4 + 8 * (i % 4 // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


@device_function
def swizzle128_offset(row, col, rows):
    """Byte offset of element (row, col) in a 128 B swizzled tile of ``rows`` rows of 16-bit elements, from the
    tile's 1024 B aligned start (the layout in the module docstring)."""
    chunk = (col % 64 // 8) ^ (row % 8)
    return (col // 64) * rows * 128 + row * 128 + chunk * 16 + (col % 8) * 2


def swizzle128_tile_bytes(rows: int, cols: int) -> int:
    """Shared memory a tile of rows x cols 16-bit elements takes in the 128 B swizzled layout."""
    return -(-cols // PANEL_COLUMNS) * rows * SWIZZLE_BYTES


@device_function
def smem_descriptor(address, lbo, sbo, swizzle):
    """The 64-bit matrix descriptor: start address, leading and stride dimension byte offsets (bytes, multiples of
    16), swizzle mode (``SWIZZLE_128B``); base offset 0."""
    field = uint64(0x3FFFF)
    return (
        ((uint64(address) & field) >> uint64(4))
        | (((uint64(lbo) & field) >> uint64(4)) << uint64(16))
        | (((uint64(sbo) & field) >> uint64(4)) << uint64(32))
        | (uint64(swizzle) << uint64(62))
    )


@device_function
def descriptor_k_major(tile, rows, k0):
    """The descriptor of columns k0 .. k0 + 15 (k0 a multiple of 16) of a K-major tile of ``rows`` rows at shared
    address ``tile`` (A, or B with trans_b = 0)."""
    start = tile + (k0 // 64) * rows * 128 + (k0 % 64) * 2
    return smem_descriptor(start, 16, SWIZZLE_ATOM_BYTES, SWIZZLE_128B)


@device_function
def descriptor_mn_major(tile, rows, k0):
    """The descriptor of rows k0 .. k0 + 15 (k0 a multiple of 16) of an MN-major B tile of ``rows`` rows (K) at
    shared address ``tile`` (trans_b = 1): LBO is one 64-column panel to the next."""
    return smem_descriptor(tile + k0 * 128, rows * 128, SWIZZLE_ATOM_BYTES, SWIZZLE_128B)


def tile_loader(ROWS, TILE_ROWS, HEAD_DIM, NUM_THREADS):
    """A device function load(tile, x_base, offset, stride_n, start, seqlen) for blocks of NUM_THREADS threads: rows
    start .. start + ROWS - 1 of x (16-bit elements at global address x_base, row n's at element offset + n ·
    stride_n, unit stride along its HEAD_DIM columns, 16 B aligned) into swizzled tiles of TILE_ROWS rows from
    shared address tile on (row r into tile r // TILE_ROWS, each ``swizzle128_tile_bytes(TILE_ROWS, HEAD_DIM)``),
    a 16 B ``cp.async`` per thread and chunk, zeros past row seqlen; not committed: ``mma.cp_async_wait_all``
    commits and waits for every copy, and a ring that waits with ``cp_async_wait_group`` commits its own groups."""
    CHUNKS = HEAD_DIM // 8  # 16 B chunks per row
    if (ROWS * CHUNKS) % NUM_THREADS or ROWS % TILE_ROWS or TILE_ROWS % 8:
        raise ValueError(f"{ROWS} rows of {HEAD_DIM} in {TILE_ROWS}-row tiles are not whole copies of {NUM_THREADS}")
    PER_THREAD = ROWS * CHUNKS // NUM_THREADS

    @device_function
    def load(tile, x_base, offset, stride_n, start, seqlen):
        c = cuda.threadIdx.x % CHUNKS
        nowhere = x_base + uint64(2 * offset)  # a valid address for copies that read nothing
        for it in range(PER_THREAD):
            r = cuda.threadIdx.x // CHUNKS + it * (NUM_THREADS // CHUNKS)
            dst = tile + uint32(
                r // TILE_ROWS * TILE_ROWS * CHUNKS * 16 + swizzle128_offset(r % TILE_ROWS, 8 * c, TILE_ROWS)
            )
            if start + r < seqlen:
                mma.cp_async_16(dst, x_base + uint64(2 * (offset + (start + r) * stride_n + 8 * c)), 16)
            else:
                mma.cp_async_16(dst, nowhere, 0)

    return load


# The emulation: whole-warpgroup numpy versions of the instructions.


def decode_descriptor(desc: int) -> dict[str, int]:
    """The fields of a matrix descriptor, offsets in bytes."""
    desc = int(desc)
    return {
        "start": (desc & 0x3FFF) << 4,
        "lbo": (desc >> 16 & 0x3FFF) << 4,
        "sbo": (desc >> 32 & 0x3FFF) << 4,
        "base_offset": desc >> 49 & 0x7,
        "swizzle": desc >> 62 & 0x3,
    }


def _swizzle128(address: np.ndarray) -> np.ndarray:
    return address ^ ((address >> 7 & 7) << 4)


def descriptor_addresses(desc: int, rows: int, cols: int, mn_major: bool) -> np.ndarray:
    """Byte addresses (rows, cols) of the 16-bit elements the descriptor gives wgmma: A (64 x 16, rows m, cols k) or
    a K-major B seen as N x 16 (mn_major False), or an MN-major B (16 x N, rows k, cols n), from the ISA's canonical
    layouts with 128 B swizzle."""
    f = decode_descriptor(desc)
    if f["swizzle"] != SWIZZLE_128B or f["base_offset"] != 0:
        raise ValueError(f"the emulation supports 128 B swizzle with base offset 0, got descriptor fields {f}")
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    if mn_major:  # ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO)), bytes
        offset = (c % 64) * 2 + (c // 64) * f["lbo"] + (r % 8) * 128 + (r // 8) * f["sbo"]
    else:  # ((8, m), (T, 2)) : ((8T, SBO), (1, T))
        offset = (r % 8) * 128 + (r // 8) * f["sbo"] + c * 2
    return _swizzle128(f["start"] + offset)


def emulate_wgmma(a: np.ndarray, b: np.ndarray, c, scale_d: bool) -> np.ndarray:
    """D = A B + (C if scale_d) for a warpgroup: a (64, 16), b (16, N) fp64, c (128, N / 2) fp32 registers. Returns
    (128, N / 2) fp32, the products summed in fp64 and rounded once."""
    n = b.shape[1]
    index = tuple(np.array([wgmma_d_layout(thread, n) for thread in range(WARPGROUP_SIZE)]).transpose(2, 0, 1))
    d = a @ b
    if scale_d:
        C = np.zeros((64, n))
        C[index] = np.asarray(c, dtype=np.float64)
        d += C
    return d[index].astype(np.float32)


def _a_from_registers(regs, kind: str) -> np.ndarray:
    """A (64 x 16, fp64) from the warpgroup's (128, 4) int32 registers."""
    index = tuple(np.array([wgmma_a_layout(thread) for thread in range(WARPGROUP_SIZE)]).transpose(2, 0, 1))
    A = np.zeros((64, 16))
    A[index] = mma.decode16(mma.halves(regs), kind)
    return A


if numba.config.ENABLE_CUDASIM:
    # The shared arrays' simulated addresses are mma.py's (``mma.shared_address``); mma.simulated_bytes reads them.

    _lock = threading.Lock()
    _state = threading.local()  # this thread's wgmma-groups: fenced, uncommitted and committed results

    class _Warpgroup:
        def __init__(self):
            self.barrier = threading.Barrier(WARPGROUP_SIZE)
            self.inputs = [None] * WARPGROUP_SIZE
            self.outputs = None
            self.error = None

    def _warpgroup():
        thread = threading.current_thread()
        manager = thread._manager
        block_threads = int(np.prod(manager._block_dim))
        if block_threads % WARPGROUP_SIZE:
            raise ValueError(f"wgmma needs whole warpgroups of 128 threads, the block has {block_threads}")
        with _lock:
            groups = manager.__dict__.setdefault("_fa2_warpgroups", {})
            group = groups.setdefault(thread.thread_id // WARPGROUP_SIZE, _Warpgroup())
        return thread.thread_id % WARPGROUP_SIZE, group

    def _collective(value, compute):
        """Every thread of the warpgroup passes ``value``; one runs ``compute`` on the list of all 128 and each gets
        its own element of the result (or compute's exception)."""
        index, group = _warpgroup()
        group.inputs[index] = value
        if group.barrier.wait(timeout=600) == 0:
            try:
                group.outputs, group.error = compute(list(group.inputs)), None
            except Exception as error:  # every thread raises it, none waits forever
                group.outputs, group.error = None, error
        group.barrier.wait(timeout=600)
        if group.error is not None:
            raise group.error
        return group.outputs[index]

    def _thread_state():
        if not hasattr(_state, "fenced"):
            _state.fenced = False
            _state.uncommitted = []  # placeholders of mma_async issued since the last commit
            _state.groups = []  # committed groups, oldest first: lists of placeholders
            _state.results = {}  # id(placeholder) -> (placeholder, values, done)
        return _state

    def _placeholder(n):
        return tuple(np.float32(np.nan) for _ in range(n))

    def _values(acc):
        """acc's values: an in-flight placeholder's result (the hardware chains mma_async on the same registers),
        else acc itself."""
        entry = _thread_state().results.get(id(acc))
        return entry[1] if entry is not None and entry[0] is acc else acc

    def _mma_async(kind, acc, a, desc_b, scale_d, trans_b, a_in_registers):
        state = _thread_state()
        if not state.fenced:
            raise RuntimeError("wgmma.mma_async without a wgmma.fence since this thread's last wait (or start)")
        n = 2 * len(acc)
        if len(acc) % 4 or not 8 <= n <= 256:
            raise ValueError(f"wgmma m64nNk16 takes N / 2 accumulators, N = 8 .. 256 a multiple of 8, got {len(acc)}")
        if int(trans_b) not in (0, 1):
            raise ValueError(f"wgmma's trans_b must be 0 (B K-major) or 1 (MN-major), got {trans_b}")

        def compute(values):
            if len({v[1:] for v in values}) != 1:
                raise ValueError("wgmma's descriptors, scale_d and trans_b must agree across the warpgroup")
            _, desc_a, desc_b, scale, trans = values[0]
            if a_in_registers:
                A = _a_from_registers([v[0][1] for v in values], kind)
            else:
                A = mma.decode16(_read(descriptor_addresses(desc_a, 64, 16, False)), kind)
            if trans:
                B = mma.decode16(_read(descriptor_addresses(desc_b, 16, n, True)), kind)
            else:
                B = mma.decode16(_read(descriptor_addresses(desc_b, n, 16, False)), kind).T
            return emulate_wgmma(A, B, [v[0][0] for v in values], bool(scale))

        a_value = (tuple(int(r) for r in a), None) if a_in_registers else (None, int(a))
        key = (a_value[1], int(desc_b), bool(scale_d), int(trans_b))
        d = _collective(((_values(acc), a_value[0]), *key), compute)
        placeholder = _placeholder(len(acc))
        state.results[id(placeholder)] = (placeholder, tuple(np.float32(x) for x in d), False)
        state.uncommitted.append(placeholder)
        return placeholder

    def _read(addresses: np.ndarray) -> np.ndarray:
        """The 16-bit patterns at the byte addresses (any shape), from mma.py's simulated shared memory."""
        flat = addresses.reshape(-1)
        if (flat % 2).any():
            raise ValueError("a 16-bit element's address is odd: the descriptor's start is not 16 B aligned")
        out = np.array([mma.simulated_bytes(int(x), 2).view(np.uint16)[0] for x in flat], dtype=np.uint16)
        return out.reshape(addresses.shape)

    def wgmma_bf16(acc, desc_a, desc_b, scale_d, trans_b):
        return _mma_async("bf16", acc, desc_a, desc_b, scale_d, trans_b, False)

    def wgmma_f16(acc, desc_a, desc_b, scale_d, trans_b):
        return _mma_async("f16", acc, desc_a, desc_b, scale_d, trans_b, False)

    def wgmma_bf16_rs(acc, a, desc_b, scale_d, trans_b):
        return _mma_async("bf16", acc, a, desc_b, scale_d, trans_b, True)

    def wgmma_f16_rs(acc, a, desc_b, scale_d, trans_b):
        return _mma_async("f16", acc, a, desc_b, scale_d, trans_b, True)

    def wgmma_fence():
        _thread_state().fenced = True

    def wgmma_commit():
        state = _thread_state()
        state.groups.append(state.uncommitted)
        state.uncommitted = []

    def wgmma_wait(n):
        # The groups but the n newest complete; the thread's next mma_async needs a fence again.
        state = _thread_state()
        kept = len(state.groups) - min(int(n), len(state.groups))
        for group in state.groups[:kept]:
            for placeholder in group:
                entry = state.results[id(placeholder)]
                state.results[id(placeholder)] = (entry[0], entry[1], True)
        state.groups = state.groups[kept:]
        state.fenced = False

    def wgmma_fence_operand(acc):
        entry = _thread_state().results.get(id(acc))
        if entry is None or entry[0] is not acc:
            return acc
        return entry[1] if entry[2] else acc

    def fence_proxy_async():
        pass

    def zero_accumulators(n):
        return tuple(np.float32(0) for _ in range(n))

    def opaque_address(address):
        return address

    def scale_rows(acc, lo, hi):
        return tuple(np.float32(x) * np.float32(lo if i % 4 < 2 else hi) for i, x in enumerate(acc))

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    _i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _asm(builder, result, operands, text, constraints):
        # side_effect and the memory clobber on all of them: they read shared memory (or order reads of it) that
        # LLVM cannot see being written, and must stay in program order with the barriers and each other.
        fnty = ir.FunctionType(result, [o.type for o in operands])
        return builder.call(ir.InlineAsm(fnty, text, constraints + ",~{memory}", side_effect=True), operands)

    def _statement_intrinsic(text):
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])

            return types.void(), codegen

        return statement

    wgmma_fence = _statement_intrinsic("wgmma.fence.sync.aligned;")
    wgmma_commit = _statement_intrinsic("wgmma.commit_group.sync.aligned;")
    fence_proxy_async = _statement_intrinsic("fence.proxy.async.shared::cta;")

    @intrinsic
    def wgmma_wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None  # numba types the call again with the constant as a literal
        text = f"wgmma.wait_group.sync.aligned {n.literal_value};"

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])

        return types.void(n), codegen

    def _accumulator_type(acc):
        if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32):
            raise TypingError(f"wgmma's accumulators must be a tuple of float32, got {acc}")
        if acc.count % 4 or not 4 <= acc.count <= 128:
            raise TypingError(f"wgmma m64nNk16 takes N / 2 accumulators, N = 8 .. 256 a multiple of 8, got {acc.count}")

    def _unpack(builder, value, count):
        return [builder.extract_value(value, i) for i in range(count)]

    def _tied(count):
        """Constraints of ``count`` float outputs, and of inputs in the same registers (C's "+f"): the inputs go
        last, after any others."""
        return ["=f"] * count, [str(i) for i in range(count)]

    @intrinsic
    def wgmma_fence_operand(typingctx, acc):
        _accumulator_type(acc)

        def codegen(context, builder, sig, args):
            count = sig.args[0].count
            outputs, tied = _tied(count)
            result = _asm(
                builder,
                ir.LiteralStructType([_f32] * count),
                _unpack(builder, args[0], count),
                "",
                ",".join(outputs + tied),
            )
            return context.make_tuple(builder, sig.return_type, _unpack(builder, result, count))

        return acc(acc), codegen

    @intrinsic
    def opaque_address(typingctx, address):
        if not isinstance(address, types.Integer):
            raise TypingError(f"opaque_address takes a shared address (an integer), got {address}")

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.uint32)
            return _asm(builder, _i32, [value], "mov.b32 $0, $1;", "=r,r")

        return types.uint32(address), codegen

    @intrinsic
    def zero_accumulators(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        result = types.UniTuple(types.float32, n.literal_value)

        def codegen(context, builder, sig, args):
            zero = context.get_constant(types.float32, 0.0)
            return context.make_tuple(builder, sig.return_type, [zero] * n.literal_value)

        return result(n), codegen

    @intrinsic
    def scale_rows(typingctx, acc, lo, hi):
        _accumulator_type(acc)

        def codegen(context, builder, sig, args):
            acc_v, lo_v, hi_v = args
            values = [
                builder.fmul(builder.extract_value(acc_v, i), lo_v if i % 4 < 2 else hi_v)
                for i in range(sig.args[0].count)
            ]
            return context.make_tuple(builder, sig.return_type, values)

        return acc(acc, types.float32, types.float32), codegen

    def _wgmma_intrinsic(kind, a_in_registers):
        @intrinsic
        def wgmma(typingctx, acc, a, desc_b, scale_d, trans_b):
            if not isinstance(trans_b, (types.IntegerLiteral, types.BooleanLiteral)):
                return None  # numba types the call again with the constant as a literal
            _accumulator_type(acc)
            if a_in_registers and not (isinstance(a, types.UniTuple) and a.count == 4 and a.dtype == types.int32):
                raise TypingError(f"wgmma's A registers must be a tuple of four int32, got {a}")
            count = acc.count
            tb = int(trans_b.literal_value)
            if tb not in (0, 1):
                raise TypingError(f"wgmma's trans_b must be 0 (B K-major) or 1 (MN-major), got {tb}")
            d = ", ".join(f"${i}" for i in range(count))
            if a_in_registers:
                a_operand, b_operand, scale = (
                    "{" + ", ".join(f"${count + i}" for i in range(4)) + "}",
                    count + 4,
                    count + 5,
                )
                tail = f"1, 1, {tb}"
            else:
                a_operand, b_operand, scale = f"${count}", count + 1, count + 2
                tail = f"1, 1, 0, {tb}"
            # scale-d is a predicate operand: set from the int at run time inside the asm's own scope.
            text = (
                "{\n.reg .pred p;\n"
                f"setp.ne.b32 p, ${scale}, 0;\n"
                f"wgmma.mma_async.sync.aligned.m64n{2 * count}k16.f32.{kind}.{kind} "
                f"{{{d}}}, {a_operand}, ${b_operand}, p, {tail};\n}}"
            )
            outputs, tied = _tied(count)
            inputs = ["r"] * 4 + ["l", "r"] if a_in_registers else ["l", "l", "r"]
            constraints = ",".join(outputs + inputs + tied)

            def codegen(context, builder, sig, args):
                acc_v, a_v, desc_b_v, scale_v, _ = args
                if a_in_registers:
                    a_ops = _unpack(builder, a_v, 4)
                else:
                    a_ops = [context.cast(builder, a_v, sig.args[1], types.uint64)]
                operands = [
                    *a_ops,
                    context.cast(builder, desc_b_v, sig.args[2], types.uint64),
                    context.cast(builder, scale_v, sig.args[3], types.int32),
                    *_unpack(builder, acc_v, count),
                ]
                result = _asm(builder, ir.LiteralStructType([_f32] * count), operands, text, constraints)
                return context.make_tuple(builder, sig.return_type, _unpack(builder, result, count))

            return acc(acc, a, desc_b, scale_d, trans_b), codegen

        return wgmma

    wgmma_bf16 = _wgmma_intrinsic("bf16", False)
    wgmma_f16 = _wgmma_intrinsic("f16", False)
    wgmma_bf16_rs = _wgmma_intrinsic("bf16", True)
    wgmma_f16_rs = _wgmma_intrinsic("f16", True)
