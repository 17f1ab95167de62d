"""Tensor-core instructions for numba-cuda kernels: ``mma.sync``, ``ldmatrix`` and ``cp.async`` as inline PTX.

numba-cuda has no tensor-core API. Each GPU function here is a ``numba.cuda.extending.intrinsic`` whose code
generator emits one ``llvmlite.ir.InlineAsm`` statement; kernels call them as ordinary functions. All need
sm_80 or newer. 16-bit values travel in pairs, as int32 ".b32 registers" whose low half holds the element
with the lower index (the order ``mma`` and ``ldmatrix`` use).

    mma_f16, mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
        mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: D = A B + C, A 16 x 16, B 16 x 8,
        C and D 16 x 8 in fp32.
    ldmatrix_x4(address), ldmatrix_x4_trans(address) -> (r0, r1, r2, r3)
        ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 matrices of 16-bit elements from shared
        memory; lanes 8j .. 8j + 7 give the (16 B aligned) addresses of the 8 rows of matrix j.
    lds_x4(address), lds_x4_trans(address) -> (r0, r1, r2, r3)
        The same registers without ldmatrix, for the ladder's rung before it (``fa2_numba_cuda.ladder``) and
        the kernels' LDMATRIX switch: each lane fetches the row addresses it needs from the lanes that hold
        them (``shfl_idx``) and loads its own words, four 32-bit ``ld.shared`` (.trans: eight 16-bit ones).
    ld_shared_b32(address) -> int32, ld_shared_u16(address) -> int32: one plain shared-memory load.
    shfl_idx(value, src_lane) -> int32: ``cuda.shfl_sync`` over the full warp, lane src_lane's value.
    pack_f16x2, pack_bf16x2(lo, hi) -> int32: two fp32 values rounded to nearest even (cvt.rn.*x2.f32).
    cp_async_16(dst, src, src_bytes); cp_async_commit(); cp_async_wait_all(); cp_async_wait_group(n)
        cp.async.cg.shared.global: copy 16 B from global to shared memory without passing through registers;
        only src_bytes (0 to 16) are read, the rest of the 16 B is zero-filled. cp_async_commit closes the
        thread's group of copies issued since the last one. The copies are complete and visible to the issuing
        thread after cp_async_wait_all (every group: cp.async.wait_group 0), those of all but the n newest
        committed groups after cp_async_wait_group(n) (n a compile-time constant); to the block after a barrier
        that follows the wait.
    shared_address(array) -> uint32, global_address(array) -> uint64: the byte address of array[0] (a shared
        array, in the shared window; a global one, generic), for the instructions above.
    shfl_xor(value, lane_mask) -> float32: ``cuda.shfl_xor_sync`` over the full warp.
    all_lanes(predicate) -> bool: ``cuda.all_sync`` over the full warp.
    exp2_approx(x) -> float32: ex2.approx.ftz.f32, one MUFU instruction (libdevice's exp2f adds a range
        check and two multiplies for denormal results; here they flush to 0). exp2_approx(-inf) = 0.
    tanh_approx(x) -> float32: tanh.approx.f32, one MUFU instruction, relative error at most 2^-10.99 (PTX
        ISA; fine for the scores of fp16 and bf16 inputs, not for fp32 ones). ±1 at ±inf, NaN for NaN.

Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"). Each matrix is
spread over the 32 lanes of a warp; lane = 4 g + t, with g = lane // 4 ("groupID", 0..7) and t = lane % 4
("threadID_in_group", 0..3).

A, 16 x 16 (rows m, columns k), four .b32 registers of two halves:

                 k = 0 .. 7               k = 8 .. 15
    m = 0 .. 7   a0 = A[g, 2t], A[g, 2t+1]      a2 = A[g, 2t+8], A[g, 2t+9]
    m = 8 .. 15  a1 = A[g+8, 2t], A[g+8, 2t+1]  a3 = A[g+8, 2t+8], A[g+8, 2t+9]

B, 16 x 8 (rows k, columns n), two .b32 registers: b0 = B[2t, g], B[2t+1, g]; b1 = B[2t+8, g], B[2t+9, g].

C and D, 16 x 8, four fp32 registers: c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]. Which
lane holds which element, for rows m = 0 .. 7 (c0, c1) and again for rows 8 .. 15 (c2, c3):

              n = 0 1   2 3   4 5   6 7
    m = 0       T0      T1    T2    T3
    m = 1       T4      T5    T6    T7
    ...
    m = 7       T28     T29   T30   T31

A row of C lives in the four lanes of one quad (4g .. 4g + 3): row reductions are two ``shfl_xor`` (1, 2).
C's layout is A's left or right half: two C tiles side by side (n = 0..7, 8..15), packed to 16 bits, are
one A fragment — a0 = (c0, c1) of the left, a1 = (c2, c3) of the left, a2 and a3 the same of the right.
So P = softmax(Q Kᵀ) goes from the accumulators of S = Q Kᵀ into P V without leaving registers.

ldmatrix: register j of lane l holds matrix j's row l // 4, columns 2 (l % 4) and 2 (l % 4) + 1 — a quarter
of an A fragment, or a B fragment's register when the matrix is stored with B's columns as rows; with
``.trans``, rows 2 (l % 4) and 2 (l % 4) + 1 of column l // 4, for a B stored row-major (k rows of n).
``ldmatrix_a_row_col`` and ``ldmatrix_b_row_col`` give the row and column each lane points at so that one
x4 load yields an A fragment or two B fragments.

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same names are Python functions that emulate the
instructions from the tables above (``emulate_ldmatrix``, ``emulate_mma``): a warp's 32 simulator threads
meet at a barrier, exchange their registers and each takes its own lane's result. Shared and global arrays
get virtual addresses, bounds-checked on every access; shared memory starts as NaN bit patterns and
``cp.async`` copies land only at the wait that covers their group, so reading a tile too early gives NaN. That checks a
kernel's index math and synchronisation against the ISA's layouts on the CPU; it is slow (tests only), and
says nothing of the hardware beyond those tables. The approximate MUFU instructions (ex2.approx,
tanh.approx) are emulated by the exact function rounded to fp32 (numpy's exp2, math.tanh): their error on
the hardware (tanh.approx's up to 2^-10.99 relative) is not reproduced; only runs on a GPU see it.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import math
import textwrap
import threading

import numba
import numpy as np
from numba import cuda, int32, uint32

WARP_SIZE = 32


def device_function(fn, unroll: bool = False):
    """``cuda.jit(device=True)``, inlined into its callers on the GPU (NVVM's alwaysinline: the small index
    helpers then fold into constants); the simulator's jit takes no forceinline. With unroll, fn's constant-range
    loops written out first (``unrolled``)."""
    if unroll:
        fn = unrolled(fn)
    if numba.config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def unrolled(fn):
    """``fn`` with every loop ``for i in range(...)`` whose bounds are constants (of its globals and closure, and
    the outer loops' i once those are written out) written out: its body once per i, i a constant in each copy,
    in order. numba-cuda has no unroll hint, and NVVM leaves a long loop rolled; the arrays its body indexes by i
    then live in local memory. A loop whose body breaks, continues or assigns i is left as it is. The same
    statements in the same order: for a kernel builder to apply where NVVM would not unroll (a kernel or device
    function, before ``cuda.jit``)."""
    names = dict(fn.__globals__)
    if fn.__closure__:
        names.update(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__)))
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    definition = tree.body[0]
    definition.decorator_list = []
    definition.body = _written_out(definition.body, names, {})
    # Line numbers as in the source file, for numba's messages.
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    exec(compile(ast.fix_missing_locations(tree), inspect.getsourcefile(fn), "exec"), names)
    return names[fn.__name__]


class _Constants(ast.NodeTransformer):
    """Names bound to constants (the written-out loops' indices) replaced by the constants."""

    def __init__(self, constants: dict):
        self.constants = constants

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.constants:
            return ast.copy_location(ast.Constant(self.constants[node.id]), node)
        return node


def _range_of(loop: ast.For, names: dict, constants: dict) -> range | None:
    """The values of loop's index if it can be written out: ``range`` of constant bounds, a plain name as index,
    no else clause, no break or continue anywhere in its body, no assignment to the index."""
    call = loop.iter
    if not (
        isinstance(loop.target, ast.Name)
        and not loop.orelse
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "range"
        and not call.keywords
    ):
        return None
    for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if isinstance(node, (ast.Break, ast.Continue)):
            return None
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == loop.target.id:
            return None
    try:
        bounds = [
            eval(compile(ast.Expression(_Constants(constants).visit(copy.deepcopy(arg))), "<range>", "eval"), names)
            for arg in call.args
        ]
    except Exception:  # a bound known only at run time
        return None
    return range(*bounds) if all(isinstance(b, int) for b in bounds) else None


def _written_out(statements: list, names: dict, constants: dict) -> list:
    """statements with their constant-range loops written out (``unrolled``) and the constants substituted."""
    out = []
    for statement in statements:
        values = _range_of(statement, names, constants) if isinstance(statement, ast.For) else None
        if values is not None:
            for value in values:
                inner = {**constants, statement.target.id: value}
                out += _written_out(copy.deepcopy(statement.body), names, inner)
            continue
        statement = _Constants(constants).visit(statement)
        for field in ("body", "orelse", "finalbody"):
            block = getattr(statement, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                setattr(statement, field, _written_out(block, names, constants))
        out.append(statement)
    return out


# The ISA's tables, as (row, column) per lane: the reference the emulation and the tests use.


def mma_a_layout(lane: int) -> list[tuple[int, int]]:
    """The 8 elements of A (16 x 16) lane holds, as (m, k): element e is half e % 2 of register e // 2."""
    g, t = lane // 4, lane % 4
    return [(g + 8 * (e // 2 % 2), 2 * t + e % 2 + 8 * (e // 4)) for e in range(8)]


def mma_b_layout(lane: int) -> list[tuple[int, int]]:
    """The 4 elements of B (16 x 8) lane holds, as (k, n): element e is half e % 2 of register e // 2."""
    g, t = lane // 4, lane % 4
    return [(2 * t + e % 2 + 8 * (e // 2), g) for e in range(4)]


def mma_c_layout(lane: int) -> list[tuple[int, int]]:
    """The 4 elements of C and D (16 x 8, fp32) lane holds, as (m, n), in register order c0 .. c3."""
    g, t = lane // 4, lane % 4
    return [(g + 8 * (e // 2), 2 * t + e % 2) for e in range(4)]


def ldmatrix_layout(lane: int, trans: bool) -> list[tuple[int, int, int]]:
    """The 8 elements lane receives from ldmatrix.x4, as (matrix, row, column) of the 8 x 8 matrices as
    stored (row r of matrix j at the address lane 8j + r gave): element e is half e % 2 of register e // 2."""
    g, t = lane // 4, lane % 4
    if trans:
        return [(e // 2, 2 * t + e % 2, g) for e in range(8)]
    return [(e // 2, g, 2 * t + e % 2) for e in range(8)]


# The rows and columns lanes point ldmatrix.x4 at; plain integer math, called on the CPU by the tests.


@device_function
def ldmatrix_a_row_col(lane):
    """(row, column) within a 16 x 16 block of 16-bit elements stored row-major whose address lane gives to
    ldmatrix.x4: matrices 0..3 are the block's quarters rows 0-7 / cols 0-7, rows 8-15 / cols 0-7, rows 0-7 /
    cols 8-15, rows 8-15 / cols 8-15. Without .trans, registers 0..3 are the A fragment a0..a3 of the block
    (Q: rows m, columns k). With .trans on a block stored as k rows of n (V: keys x head dims), registers
    (0, 1) are the B fragment of columns n = 0..7 and (2, 3) that of n = 8..15."""
    return lane % 16, (lane // 16) * 8


@device_function
def ldmatrix_b_row_col(lane):
    """(row, column) within a 16 x 16 block stored as n rows of k (K: keys x head dims, B = Kᵀ) whose address
    lane gives to ldmatrix.x4 without .trans: matrices 0..3 are rows 0-7 / cols 0-7, rows 0-7 / cols 8-15,
    rows 8-15 / cols 0-7, rows 8-15 / cols 8-15, so registers (0, 1) are the B fragment of n = 0..7 and
    (2, 3) that of n = 8..15."""
    return lane % 8 + (lane // 16) * 8, (lane // 8) % 2 * 8


# The emulation: whole-warp numpy versions of the instructions, lane by lane from the tables above.


def halves(regs) -> np.ndarray:
    """(..., 2 n) uint16 halves of (..., n) .b32 registers, low half first."""
    regs = np.asarray(regs).astype(np.int64) & 0xFFFFFFFF
    return np.stack([regs & 0xFFFF, regs >> 16], axis=-1).reshape(*regs.shape[:-1], -1).astype(np.uint16)


def pack(halves) -> np.ndarray:
    """(..., n) int32 registers from (..., 2 n) uint16 halves, low half first."""
    h = np.asarray(halves).astype(np.int64).reshape(*np.shape(halves)[:-1], -1, 2)
    return (h[..., 0] | (h[..., 1] << 16)).astype(np.uint32).view(np.int32)


def decode16(bits, kind: str) -> np.ndarray:
    """fp64 values of 16-bit patterns, kind "f16" or "bf16"."""
    bits = np.asarray(bits).astype(np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def encode16(values, kind: str) -> np.ndarray:
    """16-bit patterns (uint16) of fp32 values rounded to nearest even, kind "f16" or "bf16"."""
    values = np.asarray(values, dtype=np.float32)
    if kind == "f16":
        return values.astype(np.float16).view(np.uint16)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16)


@functools.cache
def _table(layout, *args) -> tuple[np.ndarray, ...]:
    """A layout function's (row, column, ...) for every lane, as index arrays of shape (32, elements)."""
    entries = np.array([layout(lane, *args) for lane in range(WARP_SIZE)])
    return tuple(entries[..., i] for i in range(entries.shape[-1]))


def emulate_ldmatrix(rows, trans: bool) -> np.ndarray:
    """ldmatrix.x4 for a whole warp: ``rows[l]`` is the 8 uint16 elements at the address lane l gave (row
    l % 8 of matrix l // 8). Returns (32, 4) int32 registers."""
    rows = np.asarray(rows, dtype=np.uint16).reshape(4, 8, 8)  # [matrix, row, column]
    matrix, row, col = _table(ldmatrix_layout, trans)
    return pack(rows[matrix, row, col])


def emulate_mma(a, b, c, kind: str) -> np.ndarray:
    """mma.sync m16n8k16 for a whole warp: a (32, 4), b (32, 2) int32 registers of 16-bit pairs (kind "f16"
    or "bf16"), c (32, 4) fp32. Returns d (32, 4) fp32, the products summed in fp64 and rounded once."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    A[_table(mma_a_layout)] = decode16(halves(a), kind)
    B[_table(mma_b_layout)] = decode16(halves(b), kind)
    c_index = _table(mma_c_layout)
    C[c_index] = np.asarray(c, dtype=np.float64)
    return (A @ B + C)[c_index].astype(np.float32)


if numba.config.ENABLE_CUDASIM:
    # Simulator threads are Python threads (numba's BlockThread: thread_id, _manager for the block); a
    # warp's 32 meet at a barrier to exchange registers.

    _lock = threading.Lock()
    _SHARED_BASE, _GLOBAL_BASE, _GAP = 0x1000, 1 << 40, 1 << 12
    _pending = threading.local()  # cp.async copies issued by this thread and not yet waited for

    class _Block:
        """What a simulated block's threads share here: its warps' exchanges and the virtual addresses of
        the arrays they have taken the address of (id(array) -> (base, the array's bytes, the array))."""

        def __init__(self):
            self.warps = {}
            self.regions = {}
            self.next_base = {"shared": _SHARED_BASE, "global": _GLOBAL_BASE}

    class _Warp:
        def __init__(self):
            self.barrier = threading.Barrier(WARP_SIZE)
            self.inputs = [None] * WARP_SIZE
            self.outputs = None

    def _block():
        manager = threading.current_thread()._manager  # numba's BlockManager, one per simulated block
        with _lock:
            return manager.__dict__.setdefault("_fa2_block", _Block())

    def _lane_and_warp():
        thread = threading.current_thread()
        block = _block()
        with _lock:
            warp = block.warps.setdefault(thread.thread_id // WARP_SIZE, _Warp())
        return thread.thread_id % WARP_SIZE, warp

    def _collective(value, compute):
        """Every lane of the warp passes ``value``; one lane runs ``compute`` on the list of all 32 and each
        gets its own element of the result."""
        lane, warp = _lane_and_warp()
        warp.inputs[lane] = value
        if warp.barrier.wait(timeout=600) == 0:
            warp.outputs = compute(list(warp.inputs))
        warp.barrier.wait(timeout=600)
        return warp.outputs[lane]

    def _register(array, space: str) -> int:
        """The array's virtual base address in this block. A shared array is filled with 0xFF bytes when the
        block first takes its address: NaN in fp16 and bf16, so that a tile read before it is written shows.
        Arrays are told apart by their memory (first byte and size), not by the Python object: the
        simulator's dynamic shared array (``cuda.shared.array(0, dtype)``) is a new numpy view of the same
        buffer for every thread that declares it."""
        data = getattr(array, "_item", None)
        data = data._ary if data is not None else array  # a kernel argument's numpy array
        key = (data.__array_interface__["data"][0], data.nbytes)
        block = _block()
        with _lock:
            entry = block.regions.get(key)
            if entry is None:
                base = block.next_base[space]
                block.next_base[space] = base + -(-data.nbytes // _GAP) * _GAP + _GAP
                if space == "shared":
                    data.view(np.uint8)[:] = 0xFF
                entry = block.regions[key] = (base, data.reshape(-1).view(np.uint8), data)
        return entry[0]

    def simulated_bytes(address: int, nbytes: int) -> np.ndarray:
        """A view of the nbytes (uint8) at a simulated shared or global address (``shared_address``,
        ``global_address``), bounds-checked against the array it falls in."""
        address = int(address)
        for base, data, _ in _block().regions.values():
            if base <= address and address + nbytes <= base + data.size:
                return data[address - base : address - base + nbytes]
        raise IndexError(f"address {address:#x} (+{nbytes} B) is outside every shared and global array")

    def shared_address(array):
        return np.uint32(_register(array, "shared"))

    def global_address(array):
        return np.uint64(_register(array, "global"))

    def _ldmatrix(address, trans):
        def compute(addresses):
            if any(int(a) % 16 for a in addresses):
                raise ValueError(f"ldmatrix row addresses must be 16 B aligned, got {addresses}")
            rows = [simulated_bytes(a, 16).view(np.uint16) for a in addresses]
            return emulate_ldmatrix(rows, trans)

        return tuple(np.int32(r) for r in _collective(address, compute))

    def ldmatrix_x4(address):
        return _ldmatrix(address, False)

    def ldmatrix_x4_trans(address):
        return _ldmatrix(address, True)

    def _mma(kind, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def compute(values):
            a = [v[0] for v in values]
            b = [v[1] for v in values]
            c = [v[2] for v in values]
            return emulate_mma(a, b, c, kind)

        d = _collective(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), compute)
        return tuple(np.float32(x) for x in d)

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("f16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("bf16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def pack_f16x2(lo, hi):
        return pack(encode16([lo, hi], "f16"))[0]

    def pack_bf16x2(lo, hi):
        return pack(encode16([lo, hi], "bf16"))[0]

    def cp_async_16(dst, src, src_bytes):
        if int(dst) % 16 or int(src) % 16:
            raise ValueError(f"cp.async addresses must be 16 B aligned, got dst {int(dst):#x}, src {int(src):#x}")
        if not 0 <= int(src_bytes) <= 16:
            raise ValueError(f"cp.async src_bytes must be 0 to 16, got {src_bytes}")
        if not hasattr(_pending, "copies"):
            _pending.copies = []
        source = simulated_bytes(src, int(src_bytes)).copy()  # what the hardware may read by the time of the wait
        _pending.copies.append((simulated_bytes(dst, 16), source))

    def cp_async_commit():
        # The thread's copies since its last commit become a group, the newest.
        if not hasattr(_pending, "groups"):
            _pending.groups = []
        _pending.groups.append(getattr(_pending, "copies", []))
        _pending.copies = []

    def _land(copies):
        for dst, source in copies:
            dst[:] = 0
            dst[: source.size] = source

    def cp_async_wait_all():
        # Every copy lands, committed or not (uncommitted ones may land at any time on the hardware).
        for group in getattr(_pending, "groups", []):
            _land(group)
        _land(getattr(_pending, "copies", []))
        _pending.groups = []
        _pending.copies = []

    def cp_async_wait_group(n):
        # The groups but the n newest land; those, and copies not yet committed, stay in flight.
        groups = getattr(_pending, "groups", [])
        kept = len(groups) - min(int(n), len(groups))
        for group in groups[:kept]:
            _land(group)
        _pending.groups = groups[kept:]

    def ld_shared_b32(address):
        if int(address) % 4:
            raise ValueError(f"ld.shared.b32 address must be 4 B aligned, got {int(address):#x}")
        return simulated_bytes(address, 4).view(np.int32)[0]

    def ld_shared_u16(address):
        if int(address) % 2:
            raise ValueError(f"ld.shared.u16 address must be 2 B aligned, got {int(address):#x}")
        return np.int32(simulated_bytes(address, 2).view(np.uint16)[0])

    def shfl_idx(value, src_lane):
        def compute(values):
            return [values[int(src)][0] for _, src in values]

        return np.int32(_collective((value, src_lane), compute))

    def shfl_xor(value, lane_mask):
        return np.float32(_collective(value, lambda values: [values[i ^ lane_mask] for i in range(WARP_SIZE)]))

    def all_lanes(predicate):
        return _collective(bool(predicate), lambda values: [all(values)] * WARP_SIZE)

    def exp2_approx(x):
        with np.errstate(under="ignore", over="ignore"):
            return np.exp2(np.float32(x))

    def tanh_approx(x):
        return np.float32(math.tanh(float(x)))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _i32, _i64, _f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _asm(builder, result, operands, text, constraints, side_effect=False):
        fnty = ir.FunctionType(result, [o.type for o in operands])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), operands)

    def _cast(context, builder, sig, args, to_types):
        return [context.cast(builder, a, t, to) for a, t, to in zip(args, sig.args, to_types)]

    @intrinsic
    def shared_address(typingctx, array):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            generic = builder.bitcast(data, ir.PointerType(ir.IntType(8)))
            shared = builder.addrspacecast(generic, ir.PointerType(ir.IntType(8), 3))
            return builder.ptrtoint(shared, _i32)

        return types.uint32(array), codegen

    @intrinsic
    def global_address(typingctx, array):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            return builder.ptrtoint(data, _i64)

        return types.uint64(array), codegen

    def _ldmatrix_intrinsic(trans):
        text = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

        @intrinsic
        def ldmatrix(typingctx, address):
            def codegen(context, builder, sig, args):
                (address,) = _cast(context, builder, sig, args, [types.uint32])
                # side_effect and the memory clobber: the load depends on shared memory LLVM cannot see
                # being written (cp.async, other threads), so it must neither move across barriers nor merge.
                result = _asm(
                    builder,
                    ir.LiteralStructType([_i32] * 4),
                    [address],
                    text,
                    "=r,=r,=r,=r,r,~{memory}",
                    side_effect=True,
                )
                return context.make_tuple(
                    builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)]
                )

            return types.UniTuple(types.int32, 4)(address), codegen

        return ldmatrix

    ldmatrix_x4 = _ldmatrix_intrinsic(False)
    ldmatrix_x4_trans = _ldmatrix_intrinsic(True)

    def _mma_intrinsic(kind):
        text = (
            f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
        )

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            def codegen(context, builder, sig, args):
                operands = _cast(context, builder, sig, args, [types.int32] * 6 + [types.float32] * 4)
                result = _asm(
                    builder, ir.LiteralStructType([_f32] * 4), operands, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"
                )
                return context.make_tuple(
                    builder, sig.return_type, [builder.extract_value(result, i) for i in range(4)]
                )

            return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

        return mma

    mma_f16 = _mma_intrinsic("f16")
    mma_bf16 = _mma_intrinsic("bf16")

    def _pack_intrinsic(kind):
        # cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower.
        text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

        @intrinsic
        def pack(typingctx, lo, hi):
            def codegen(context, builder, sig, args):
                lo, hi = _cast(context, builder, sig, args, [types.float32] * 2)
                return _asm(builder, _i32, [hi, lo], text, "=r,f,f")

            return types.int32(lo, hi), codegen

        return pack

    pack_f16x2 = _pack_intrinsic("f16")
    pack_bf16x2 = _pack_intrinsic("bf16")

    @intrinsic
    def cp_async_16(typingctx, dst, src, src_bytes):
        def codegen(context, builder, sig, args):
            operands = _cast(context, builder, sig, args, [types.uint32, types.uint64, types.int32])
            _asm(
                builder,
                ir.VoidType(),
                operands,
                "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                "r,l,r,~{memory}",
                side_effect=True,
            )

        return types.void(dst, src, src_bytes), codegen

    @intrinsic
    def cp_async_commit(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", side_effect=True)

        return types.void(), codegen

    @intrinsic
    def cp_async_wait_all(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], "cp.async.wait_group 0;", "~{memory}", side_effect=True)

        return types.void(), codegen

    @intrinsic
    def cp_async_wait_group(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None  # numba types the call again with the constant as a literal
        text = f"cp.async.wait_group {n.literal_value};"

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)

        return types.void(n), codegen

    @intrinsic
    def exp2_approx(typingctx, x):
        def codegen(context, builder, sig, args):
            (x,) = _cast(context, builder, sig, args, [types.float32])
            return _asm(builder, _f32, [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

        return types.float32(x), codegen

    @intrinsic
    def tanh_approx(typingctx, x):
        def codegen(context, builder, sig, args):
            (x,) = _cast(context, builder, sig, args, [types.float32])
            return _asm(builder, _f32, [x], "tanh.approx.f32 $0, $1;", "=f,f")

        return types.float32(x), codegen

    def _ld_shared_intrinsic(text):
        @intrinsic
        def ld_shared(typingctx, address):
            def codegen(context, builder, sig, args):
                (address,) = _cast(context, builder, sig, args, [types.uint32])
                # As ldmatrix: shared memory that LLVM cannot see being written, so neither moved nor merged.
                return _asm(builder, _i32, [address], text, "=r,r,~{memory}", side_effect=True)

            return types.int32(address), codegen

        return ld_shared

    ld_shared_b32 = _ld_shared_intrinsic("ld.shared.b32 $0, [$1];")
    # A .u16 load into a 32-bit register zero-extends (PTX's relaxed type rules for ld's destination).
    ld_shared_u16 = _ld_shared_intrinsic("ld.shared.u16 $0, [$1];")

    @device_function
    def shfl_idx(value, src_lane):
        return cuda.shfl_sync(0xFFFFFFFF, value, src_lane)

    @device_function
    def shfl_xor(value, lane_mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)

    @device_function
    def all_lanes(predicate):
        return cuda.all_sync(0xFFFFFFFF, predicate)


# side-by-side: ladder-lds
@device_function
def lds_x4(address):
    """``ldmatrix_x4(address)`` from plain loads: register j of lane 4 g + t is row g of matrix j, columns 2 t and
    2 t + 1 (``ldmatrix_layout``): the 32-bit word 4 t bytes into the row whose address lane 8 j + g gave."""
    lane = cuda.laneid
    g = lane // 4
    t = lane % 4
    r0 = ld_shared_b32(uint32(shfl_idx(int32(address), g)) + uint32(4 * t))
    r1 = ld_shared_b32(uint32(shfl_idx(int32(address), 8 + g)) + uint32(4 * t))
    r2 = ld_shared_b32(uint32(shfl_idx(int32(address), 16 + g)) + uint32(4 * t))
    r3 = ld_shared_b32(uint32(shfl_idx(int32(address), 24 + g)) + uint32(4 * t))
    return r0, r1, r2, r3


# side-by-side: end


@device_function
def _column_pair(address, row_lane, g):
    """Column g of the rows whose addresses lanes row_lane and row_lane + 1 gave, as one .b32 (low half first)."""
    lo = ld_shared_u16(uint32(shfl_idx(int32(address), row_lane)) + uint32(2 * g))
    hi = ld_shared_u16(uint32(shfl_idx(int32(address), row_lane + 1)) + uint32(2 * g))
    return int32(uint32(lo) | (uint32(hi) << uint32(16)))


@device_function
def lds_x4_trans(address):
    """``ldmatrix_x4_trans(address)`` from plain loads: register j of lane 4 g + t is column g of matrix j's
    rows 2 t and 2 t + 1 (``ldmatrix_layout``), two 16-bit loads from the rows lanes 8 j + 2 t and 8 j + 2 t + 1
    gave."""
    lane = cuda.laneid
    g = lane // 4
    t = lane % 4
    r0 = _column_pair(address, 2 * t, g)
    r1 = _column_pair(address, 8 + 2 * t, g)
    r2 = _column_pair(address, 16 + 2 * t, g)
    r3 = _column_pair(address, 24 + 2 * t, g)
    return r0, r1, r2, r3
