"""Resource usage of a compiled kernel (registers, spill bytes), read from its cubin.

Backend-neutral: the Triton tile picker (``triton_ref/tiles.py``) reads it at run time to skip
tiles that spill, and both compile checks (``triton_ref/compile_check.py``,
``cute/compile_check.py``) report it without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KB)


def cuobjdump() -> str:
    """The ``cuobjdump`` bundled with Triton (a CUDA toolkit need not be installed)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> dict:
    """``{"reg", "stack", "local"}`` of a cubin by ``cuobjdump --dump-resource-usage``. Spills
    show up as stack (CuTe) or local (Triton) bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "LOCAL")}


def sass_counts(cubin: bytes, opcodes) -> dict:
    """``{opcode: count}``: how many SASS instructions of a cubin start with each of
    ``opcodes`` (one ``cuobjdump -sass``), e.g. ``USETMAXREG`` (ptxas may drop a PTX
    ``setmaxnreg`` it cannot honour, with only a warning) or ``WARPGROUP.DEPBAR``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run(
            [cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    instructions = [line.split(";")[0] for line in out.splitlines()]
    return {op: sum(1 for ins in instructions if f" {op}" in ins) for op in opcodes}
