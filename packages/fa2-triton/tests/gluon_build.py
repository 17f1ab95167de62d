"""A Gluon kernel compiled for sm_90a by ptxas, no GPU needed, and what its cubin says: the build tests of
test_triton_gluon, test_triton_gluon_backward and test_triton_sinks read it. Triton's interpreter cannot
compile Gluon (its kernels become interpreted functions), so those tests call it in a subprocess without
TRITON_INTERPRET."""

import os
import re
import subprocess
import tempfile

import triton


def sm90a(fn, signature: dict, constexprs: dict, maxnreg: int) -> dict:
    """``fn`` (a Gluon kernel) built for sm_90a with four warps a partition's default and ``maxnreg``; every
    argument not in ``signature`` or ``constexprs`` an i32. Returns its registers and warps at launch (Triton
    pads the worker partitions to whole warpgroups), local memory a thread (bytes), shared memory a CTA
    (bytes), and in its SASS the HGMMA count, the warpgroup MMA waits (``WARPGROUP.DEPBAR``: one an HGMMA where
    ptxas serialised them) and the mbarrier arrives (``SYNCS.ARRIVE``, an expect's too)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict(signature)
    for arg in fn.arg_names:
        signature.setdefault(arg, "constexpr" if arg in constexprs else "i32")
    src = GluonASTSource(
        fn=fn, signature=signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()}
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return dict(
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        warps=kernel.metadata.num_warps,
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        shared=kernel.metadata.shared,
        hgmma=sass.count("HGMMA"),
        wgmma_waits=sass.count("WARPGROUP.DEPBAR"),
        arrives=sass.count("SYNCS.ARRIVE"),
    )
