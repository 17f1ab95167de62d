"""Launching fa2-numba-cuda's kernels with less host time per call.

``kernel[grid, block, stream](*args)`` costs most of a short call's host time: for every launch numba's
dispatcher types each argument again (a torch tensor through DLPack, ``_typeof_dlpack``), finds the
compiled kernel for those types, and ``_Kernel.launch`` converts each array once more
(``_to_strided_memory_view``) to build the kernel's parameters, ~40 arguments a KV-cache call. fa2 launches
the same few kernels with arguments of the same kinds again and again, so ``prepare`` (as
``fa2_triton.launch``) launches the first call of a class of calls through numba, keeps that call's
parameters packed, and on later calls of the class writes only the tensors' data pointers into them
(``Prepared.__call__``) and calls the driver's ``cuLaunchKernel`` on torch's current stream (a CUDA-graph
capture records it as it records numba's launch).

Parameters, as numba's ``_Kernel._prepare_args`` lays them out (numba-cuda 0.30): an array is meminfo (0),
parent (0), nitems, itemsize, data pointer, then its shape and its strides in bytes, each 8 bytes; an int64
scalar 8 bytes, a float32 4, a float64 8, a bool its first byte (numba hands the driver the Python bool);
each is packed into 8 bytes here. Every array argument here is ``common.flat_view`` of a tensor, a 1-d
C-contiguous array over the memory the tensor spans: nitems = shape = that span, stride = itemsize.

The callers key a class by everything the launch depends on but the tensors' memory: shapes, strides,
dtypes, device, the spec's values and the configuration. That holds what numba specialises a compilation on,
the argument types it infers: an array's dtype (``flat_view`` maps bf16 to int16, a function of the dtype),
ndim (1) and layout ("C"), both fixed by ``flat_view``, and its readonly flag (torch exports its tensors,
inference-mode ones too, as writable; the flag changes what numba lets a kernel write, not the code that
reads); a Python int's type by its bit length (int64 below 64 bits: packing with struct's "q" refuses a
larger value, and such a class is launched by numba); np.float32 as float32, a float as float64. So within
a class every parameter but the data pointers is the first call's. When a class is first met, its packed
parameters are compared byte by byte with what numba's own ``_prepare_args`` builds for the compiled
kernel's argument types, and a mismatch raises: a wrong layout fails loudly on its first use, never as a
wrong result. Kernels compiled with debug, as cooperative or sensitive to the launch configuration, with
argument extensions or a type this module does not pack, and calls with an empty tensor (``flat_view``
substitutes a fresh array) are always launched by numba.

A kernel whose tiles live in dynamic shared memory (``cuda.shared.array(0, dtype)``) is launched with its
size (``prepare``'s ``shared``): numba's launch ``kernel[grid, block, stream, shared]`` and the prepared
cuLaunchKernel's sharedMemBytes. Over the 48 KB a block may have without opting in, the kernel's
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES is raised first (``allow_dynamic_shared``: numba-cuda 0.30
has no call for it; cuKernelSetAttribute on the kernel numba loaded for the call's argument types, a
cuda.core library's CUkernel, for the context's device, or cuFuncSetAttribute on its function).

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) every launch is ``kernel[grid, block, 0, shared](*args)``.
Setting ``FAST = False`` makes every launch numba's own (the tests compare the two).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from operator import mul

import torch
from numba import cuda

from fa2_numba_cuda.common import flat_view, simulated

FAST = not simulated()

if not simulated():
    from cuda.bindings import driver as _driver
    from numba.cuda import types as _types

    _SUCCESS = _driver.CUresult.CUDA_SUCCESS
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def parameter_values(args: tuple) -> list | None:
    """The values ``prepare`` packs for ``args``, each tensor as the seven of its ``flat_view`` array; None when
    a tensor is empty."""
    values = []
    for a in args:
        if type(a) is torch.Tensor:
            n = a.numel()
            if n == 0:
                return None
            if not a.is_contiguous():  # the span: 1 + sum((size - 1) * stride)
                st = a.stride()
                n = 1 + sum(map(mul, a.shape, st)) - sum(st)
            es = a.element_size()
            values += (0, 0, n, es, a.data_ptr(), n, es)
        else:
            values.append(a)
    return values


# The dynamic shared memory a block may have without raising the kernel's limit (every GPU since sm_20).
PORTABLE_SHARED_BYTES = 48 * 1024


def _numba_launch(kernel, grid, block, device, args, shared=0):
    """numba's own launch: ``kernel[grid, block, stream, shared](*flat args)`` on torch's current stream, with
    ``shared`` bytes of dynamic shared memory a block (the kernel's limit raised first when over 48 KB)."""
    flat = [flat_view(a) if isinstance(a, torch.Tensor) else a for a in args]
    if simulated():
        kernel[grid, block, 0, shared](*flat)
        return flat
    with cuda.gpus[device.index]:
        if shared > PORTABLE_SHARED_BYTES:
            allow_dynamic_shared(kernel, flat, shared)
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        kernel[grid, block, stream, shared](*flat)
    return flat


def allow_dynamic_shared(kernel, flat, shared: int) -> None:
    """Raises the dynamic shared memory limit of the kernel numba compiles for the arguments ``flat`` (numba
    arrays and scalars) to ``shared`` bytes, in the current context: compiled now if it was not (numba's
    launch then finds it in ``kernel.overloads``). Fails naming the device's limit and each call's error."""
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in flat))
    handle = int(compiled._codelibrary.get_cufunc().handle)
    attribute = _driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    device = _driver.cuCtxGetDevice()[1]
    # numba-cuda 0.30 loads through cuda.core (cuLibraryLoadData, cuLibraryGetKernel): the handle is a
    # library's CUkernel, which cuLaunchKernel takes in place of a function but cuFuncSetAttribute does not.
    # So: the kernel's attribute for this device; else the attribute of its function in this context; else
    # (a loader that hands out a module's CUfunction) the function's. The first that succeeds stands.
    kernel_handle = _driver.CUkernel(handle)
    (err,) = _driver.cuKernelSetAttribute(attribute, shared, kernel_handle, device)
    errors = [f"cuKernelSetAttribute {err!r}"]
    if err != _SUCCESS:
        err, function = _driver.cuKernelGetFunction(kernel_handle)
        if err == _SUCCESS:
            (err,) = _driver.cuFuncSetAttribute(function, attribute, shared)
            errors.append(f"cuKernelGetFunction + cuFuncSetAttribute {err!r}")
        else:
            errors.append(f"cuKernelGetFunction {err!r}")
    if err != _SUCCESS:
        (err,) = _driver.cuFuncSetAttribute(_driver.CUfunction(handle), attribute, shared)
        errors.append(f"cuFuncSetAttribute {err!r}")
    if err != _SUCCESS:
        _, optin = _driver.cuDeviceGetAttribute(
            _driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device
        )
        raise RuntimeError(
            f"fa2_numba_cuda.launch: {shared} B of dynamic shared memory a block refused "
            f"({'; '.join(errors)}); this device allows {optin} B a block in all, static shared "
            f"memory included"
        )


def _checked_packing(kernel, device, flat, values):
    """(driver function, a buffer holding ``values`` packed, context) for the kernel numba compiled
    for the arguments ``flat`` (just launched), the packing checked byte for byte against numba's
    ``_prepare_args``; None where numba must launch the class itself."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in flat)
    compiled = kernel.overloads.get(argtypes)
    if (
        compiled is None
        or compiled.debug
        or compiled.cooperative
        or compiled.extensions
        or getattr(compiled, "launch_config_sensitive", False)
        or getattr(kernel, "_launch_config_sensitive", False)
    ):
        return None  # numba would pick, or launch, the kernel by more than the argument types
    layout = parameter_layout(compiled.argument_types)
    if layout is None:
        return None
    packer = struct.Struct(layout)
    buffer = (ctypes.c_char * packer.size)()
    try:
        packer.pack_into(buffer, 0, *values)
    except struct.error:
        return None
    assert_same_parameters(bytes(buffer), numba_parameters(compiled, flat))
    with cuda.gpus[device.index]:
        cufunc = compiled._codelibrary.get_cufunc()
        context = int(cuda.current_context().handle)
    return _driver.CUfunction(int(cufunc.handle)), buffer, context


class Prepared:
    """The fast launch of one class of calls (``prepare``): the first call's parameters, packed; each call
    writes its tensors' data pointers into their slots (``pointer_slots``) and calls cuLaunchKernel."""

    __slots__ = (
        "function",
        "grid",
        "block",
        "shared",
        "device",
        "buffer",
        "words",
        "slots",
        "pointers",
        "params",
        "context",
        "lock",
    )

    def __init__(self, function, grid, block, shared, device, buffer, slots, context):
        self.function, self.grid, self.block, self.shared, self.device = function, grid, block, shared, device
        self.buffer, self.slots, self.context = buffer, slots, context
        count = len(buffer) // 8
        self.words = (ctypes.c_uint64 * count).from_buffer(buffer)  # the parameters as 8-byte words
        base = ctypes.addressof(buffer)
        self.pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        self.params = ctypes.addressof(self.pointers)
        self.lock = threading.Lock()  # the buffer is shared by the calls of the class

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launches the class's kernel on torch's current stream with ``tensors`` (the tensors at the
        positions ``varying`` named to ``prepare``, in that order) in place of the first call's."""
        index = self.device.index
        if _raw_stream is not None:
            stream = _raw_stream(index)
        else:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        with self.lock:
            words = self.words
            for slot, t in zip(self.slots, tensors, strict=True):
                words[slot] = t.data_ptr()
            if int(_driver.cuCtxGetCurrent()[1]) == self.context:
                (err,) = _driver.cuLaunchKernel(
                    self.function, self.grid, 1, 1, self.block, 1, 1, self.shared, stream, self.params, 0
                )
            else:  # another context is current: make numba's (the device's primary context) current
                with cuda.gpus[index]:
                    (err,) = _driver.cuLaunchKernel(
                        self.function, self.grid, 1, 1, self.block, 1, 1, self.shared, stream, self.params, 0
                    )
        if err != _SUCCESS:
            raise RuntimeError(f"fa2_numba_cuda.launch: cuLaunchKernel failed: {err!r}")


def prepare(
    kernel, grid: int, block: int, device: torch.device, args: tuple, varying: tuple[int, ...], shared: int = 0
) -> Prepared | None:
    """Launches ``kernel[grid, block, torch's current stream, shared](*args)`` (tensors as ``common.flat_view`` of
    them; ``shared``: bytes of dynamic shared memory a block) through numba and returns the ``Prepared``
    launch of the calls that differ from this one only in the memory of the tensors at the positions
    ``varying`` of ``args`` (the caller's class key holds everything else: shapes, strides, dtypes, device,
    every scalar). None where numba launches every call (the simulator, ``FAST`` off, an empty tensor, a
    type this module does not pack)."""
    values = parameter_values(args) if FAST else None
    flat = _numba_launch(kernel, grid, block, device, args, shared)
    if values is None:
        return None
    checked = _checked_packing(kernel, device, flat, values)
    if checked is None:
        return None
    function, buffer, context = checked
    return Prepared(function, grid, block, shared, device, buffer, pointer_slots(args, varying), context)


def pointer_slots(args: tuple, varying: tuple[int, ...]) -> tuple[int, ...]:
    """The 8-byte parameter holding the data pointer of each tensor ``args[i]``, i in ``varying``: a tensor
    is seven parameters (the data pointer its fifth), any other argument one."""
    starts, n = [], 0
    for a in args:
        starts.append(n)
        n += 7 if type(a) is torch.Tensor else 1
    for i in varying:
        if type(args[i]) is not torch.Tensor:
            raise TypeError(f"fa2_numba_cuda.launch: argument {i} is a {type(args[i]).__name__}, not a tensor")
    return tuple(starts[i] + 4 for i in varying)


def parameter_layout(argument_types) -> str | None:
    """The struct format of a kernel's parameters for numba argument types, 8 bytes each ("<": no padding
    but what the format spells), or None for a type this module does not pack."""
    parts = ["<"]
    for ty in argument_types:
        if isinstance(ty, _types.Array) and ty.ndim == 1:
            parts.append("qqqqQqq")  # meminfo, parent, nitems, itemsize, data, shape, stride
        elif ty == _types.int64:
            parts.append("q")
        elif ty == _types.float32:
            parts.append("f4x")
        elif ty == _types.float64:
            parts.append("d")
        elif ty == _types.boolean:
            parts.append("?7x")
        else:
            return None
    return "".join(parts)


def numba_parameters(compiled, flat_args) -> list[bytes]:
    """The kernel parameters numba's ``_Kernel._prepare_args`` builds for ``flat_args``, each as the bytes
    the driver copies (a Python int is a pointer-sized integer; ctypes scalars their own bytes)."""
    params = []
    for ty, value in zip(compiled.argument_types, flat_args):
        compiled._prepare_args(ty, value, -1, [], params)  # stream -1: DLPack export without a sync
    out = []
    for p in params:
        if isinstance(p, int):
            out.append(p.to_bytes(8, "little", signed=p < 0))
        elif isinstance(p, ctypes._SimpleCData):
            out.append(bytes(p))
        else:
            raise AssertionError(f"fa2_numba_cuda.launch: numba passes a {type(p).__name__} parameter")
    return out


def assert_same_parameters(packed: bytes, expected: list[bytes]) -> None:
    """``packed`` (8 bytes a parameter) holds exactly numba's parameters ``expected``."""
    if len(packed) != 8 * len(expected):
        raise AssertionError(f"fa2_numba_cuda.launch: {len(packed) // 8} parameters packed, numba has {len(expected)}")
    for i, p in enumerate(expected):
        if len(p) > 8 or packed[8 * i : 8 * i + len(p)] != p:
            raise AssertionError(
                f"fa2_numba_cuda.launch: parameter {i} packed as "
                f"{packed[8 * i : 8 * i + 8].hex()}, numba's is {p.hex()}"
            )
