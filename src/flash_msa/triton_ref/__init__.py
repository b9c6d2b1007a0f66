"""Triton backend (readable kernels; the oracle of the CuTe backend and the portable fallback).

Not implemented yet: the kernels land with the Triton-backend issue. Until then this module only
reports why it cannot run, so that ``FLASH_MSA_BACKEND=triton`` raises a clear error and ``auto``
skips it.
"""

from __future__ import annotations

from ..problem import Problem

_NOT_YET = "the Triton kernels are not implemented yet (they land with the Triton-backend issue)"


def unavailable_reason() -> str | None:
    """Why this backend cannot run at all on this machine; ``None`` if it can."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable: {e}"
    return _NOT_YET


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can."""
    return _NOT_YET
