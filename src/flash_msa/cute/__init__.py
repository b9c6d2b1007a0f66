"""CuTe DSL backend for Hopper (SM90) and Blackwell (SM100).

Not implemented yet: the kernels land with the CuTe-backend issues. Until then this module only
reports why it cannot run, so that ``FLASH_MSA_BACKEND=cute`` raises a clear error and ``auto``
skips it.
"""

from __future__ import annotations

from ..problem import Problem

_NOT_YET = "the CuTe DSL kernels are not implemented yet (they land with the CuTe-backend issues)"


def unavailable_reason() -> str | None:
    """Why this backend cannot run at all on this machine; ``None`` if it can."""
    try:
        import cutlass  # noqa: F401
    except ImportError as e:
        return f"nvidia-cutlass-dsl is not importable: {e}"
    return _NOT_YET


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can."""
    if problem.device_type != "cuda":
        return "CuTe kernels need a CUDA device"
    if problem.capability not in ((9, 0), (10, 0)):
        major, minor = problem.capability
        return f"CuTe kernels target sm_90 and sm_100, not sm_{major}{minor}"
    return _NOT_YET
