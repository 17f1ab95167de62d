"""Launching fa2-triton's kernels with less host time per call.

``kernel[grid](*args, **constexprs, **options)`` costs ~75 µs of host time per call on the lent H200's
host (Triton 3.6, the forward's 28 arguments, four of them tensor descriptors), most of it before the
kernel's own launcher runs: binding the arguments, classifying each one for specialisation, building and
hashing the cache key. A short attention call is then bound by the host, not the GPU
(docs/notes/host-overhead.md). fa2 launches the same few kernels with arguments of the same kinds again
and again, so ``launch`` keeps the compiled kernel Triton returned for one class of arguments and sends
later calls of that class straight to that kernel's launcher.

The class must hold everything Triton specialises a compilation on, or a kernel compiled for other inputs
would run: a wrong class is a wrong result, not a slow one. ``arg_class`` is finer than Triton's rules
(3.6 and 3.9): an integer by whether it equals 1, is divisible by 16 and fits in 32 or 64 bits; a
tensor by dtype and 16-byte alignment of its data; a tensor descriptor by dtype, block shape, padding and
the same facts about its data, shape and strides (a Gluon descriptor by its shared-memory layout too); a
float by its type. With the constexprs, the launch options, the device and Triton's debug and
instrumentation settings, two calls of one class are two calls Triton would send to the same compiled
kernel, which ``test_triton_launch`` checks against Triton's own classifier. Kernels that Triton's
interpreter runs, and kernels with pre-run hooks, are launched as written.

``recording`` collects the compiled kernels of the launches made inside a block (the optimisation ladder,
``fa2_triton.ladder``, reads their registers, spills and shared memory).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
from triton.runtime import _allocation
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon's descriptors carry their shared-memory layout (Triton 3.5 and up)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:
    GluonTensorDescriptor = None

# (kernel, device, constexprs, options, Triton settings, argument classes) -> the compiled kernel. One entry
# per class of arguments met, so it stays as small as Triton's own cache of compilations.
_COMPILED: dict[tuple, Any] = {}
# The lists of the ``recording`` blocks open now, innermost last: each launch adds its compiled kernel there.
_RECORDING: list[list] = []


def copy_descriptor(cls: type, fields: dict, base: torch.Tensor):
    """A tensor descriptor of class ``cls`` (Triton's or Gluon's) with ``fields`` (a checked descriptor's
    ``__dict__``, but for its base) over ``base``, whose shape, strides and alignment are the checked one's (the
    plan's class): the same checks would pass, so they are not made again (~3 µs a descriptor on the H200's
    host)."""
    d = cls.__new__(cls)
    d.__dict__.update(fields, base=base)
    return d


def on_device(device: torch.device):
    """Makes ``device`` the current CUDA device for a launch (nothing to do on CPU or when it already is):
    Triton compiles for, and launches on, the current device."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@contextlib.contextmanager
def recording():
    """Yields a list that gets the compiled kernel of every launch ``launch`` makes inside the block (on a
    GPU: Triton's ``CompiledKernel``, with ``n_regs``, ``n_spills`` and ``metadata.shared``; nothing for
    kernels the interpreter runs, which compiles none)."""
    kernels: list = []
    _RECORDING.append(kernels)
    try:
        yield kernels
    finally:
        _RECORDING.remove(kernels)


@contextlib.contextmanager
def scratch_allocator():
    """Lets kernels that build tensor descriptors on the device get their global scratch memory from
    torch's caching allocator, on the current device and stream, for the launches inside the block. Triton
    asks the allocator in its context variable (``triton.set_allocator`` sets it for good; none is set by
    default); the caller's is back in place afterwards."""
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # torch's blocks are 512-byte aligned, more than the 128 bytes a descriptor needs.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def arg_class(arg: Any) -> Any:
    """What a compiled kernel may have been specialised on, for one runtime argument (see the module's
    docstring)."""
    if type(arg) is int:
        return _int_classes((arg,))[0]
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if GluonTensorDescriptor is not None and isinstance(arg, GluonTensorDescriptor):
        return (
            arg.base.dtype,
            arg.base.data_ptr() % 16 == 0,
            tuple(arg.block_shape),
            arg.layout,
            arg.padding,
            getattr(arg, "round_f32_to_tf32", False),
            _int_classes((*arg.shape, *arg.strides)),
        )
    if isinstance(arg, TensorDescriptor):
        return (
            arg.base.dtype,
            arg.base.data_ptr() % 16 == 0,
            tuple(arg.block_shape),
            arg.padding,
            _int_classes((*arg.shape, *arg.strides)),
        )
    if type(arg) is float:
        return float
    raise TypeError(f"fa2_triton.launch: no argument class for {type(arg).__name__}")


def _int_classes(values) -> tuple[int, ...]:
    return tuple([(x == 1) | (x % 16 == 0) << 1 | (not -(2**31) <= x < 2**31) << 2 | (x >= 2**63) << 3 for x in values])


class _IntClasses(dict):
    """An integer's class, remembered once met: a launch's integers (a decode step passes 43, strides and
    sizes that recur call after call) cost a dict lookup each instead of the four comparisons, ~4x less
    time on this project's CPU. Emptied when it grows past 65536 integers."""

    def __missing__(self, x: int) -> int:
        if len(self) >= 1 << 16:
            self.clear()
        c = self[x] = _int_classes((x,))[0]
        return c


_INT_CLASSES = _IntClasses()


def arg_classes(args: tuple) -> tuple:
    """``arg_class`` of every argument, in order: one comprehension, integers and tensors classified inline
    (this runs on every launch; a function call per argument was the largest item of the launch's host
    time)."""
    return tuple(
        [
            _INT_CLASSES[a]
            if type(a) is int
            else (a.dtype, a.data_ptr() % 16 == 0)
            if type(a) is torch.Tensor
            else arg_class(a)
            for a in args
        ]
    )


class Plans(dict):
    """Launch plans kept per class of inputs (key -> plan: what a launcher works out from its inputs' shapes,
    strides, dtypes, alignment and spec, but for the tensors), emptied when a new entry would make it larger
    than LIMIT: a generate loop meets a new seqlen_k every step."""

    LIMIT = 4096

    def keep(self, key, plan):
        """plan, kept under key."""
        if len(self) >= self.LIMIT:
            self.clear()
        self[key] = plan
        return plan


def launch_planned(kernel, grid, tensors: tuple, scalars: tuple, scalar_classes: tuple, constexprs, options):
    """``launch`` of (*tensors, *scalars), whose scalars' classes a plan kept per class of inputs already
    has (its key fixes them); the tensors (dtype, 16-byte alignment) classified here, as ``arg_classes``
    does."""
    classes = (*[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors], *scalar_classes)
    return launch(kernel, grid, (*tensors, *scalars), constexprs, options, classes)


def launch(
    kernel,
    grid: int | tuple[int, ...],
    args: tuple,
    constexprs: dict[str, Any],
    options: dict[str, Any],
    classes: tuple | None = None,
):
    """Runs ``kernel[grid](*args, **constexprs, **options)`` on the current device and stream (``grid``: the
    programs along one axis, or a tuple of up to three); returns the compiled kernel (on a GPU; what the
    launch returns under the interpreter). Gluon kernels too (their ``GluonJITFunction`` is a
    ``JITFunction``, launched the same way).

    ``constexprs`` must be the kernel's last parameters, in order (checked when a class is first met).
    ``classes``: ``arg_classes(args)`` where the caller already has it, from a plan it keeps per class of
    inputs (``forward._plan``) whose key fixes every argument's class; None: computed here. Checked against
    ``arg_classes(args)`` whenever the class is first met.
    """
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if not isinstance(kernel, JITFunction) or kernel.pre_run_hooks:
        return kernel[grid](*args, **constexprs, **options)
    device = torch.cuda.current_device()
    knobs = triton.knobs
    key = (
        kernel,
        device,
        *constexprs.values(),
        *options.items(),
        knobs.runtime.debug,
        knobs.compilation.instrumentation_mode,
        arg_classes(args) if classes is None else classes,
    )
    compiled = _COMPILED.get(key)
    if compiled is None:
        if kernel.arg_names[len(args) :] != list(constexprs):
            raise AssertionError(f"{kernel.arg_names[len(args) :]} are not the constexprs {list(constexprs)}")
        if classes is not None and classes != arg_classes(args):
            raise AssertionError(f"the classes given for {kernel.fn.__name__} are not its arguments' classes")
        compiled = kernel[grid](*args, **constexprs, **options)
        _COMPILED[key] = compiled
        if _RECORDING:
            _RECORDING[-1].append(compiled)
        return compiled
    # What JITFunction.run does once it has found the compiled kernel (Triton 3.6 and 3.9).
    bound = (*args, *constexprs.values())
    stream = triton.runtime.driver.active.get_current_stream(device)
    grid = (grid + (1, 1))[:3]
    compiled.run(
        *grid,
        stream,
        compiled.function,
        compiled.packed_metadata,
        compiled.launch_metadata(grid, stream, *bound),
        knobs.runtime.launch_enter_hook,
        knobs.runtime.launch_exit_hook,
        *bound,
    )
    if _RECORDING:
        _RECORDING[-1].append(compiled)
    return compiled
