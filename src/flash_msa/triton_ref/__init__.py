"""Triton backend: readable kernels, the oracle of the CuTe backend and the portable fallback.

Ops (contract in docs/design.md): ``select`` is implemented (``selection.py``); ``fwd`` and ``bwd``
land in the next steps of the Triton-backend issue and are reported as unsupported until then,
so that ``auto`` runs them on another backend and a forced ``triton`` raises naming the op.
On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported).
"""

from __future__ import annotations

import torch

from ..backends import interpreting
from ..problem import Problem

_DIMS = (16, 32, 64, 128, 256)
MAX_TOP_K = 64


def unavailable_reason() -> str | None:
    """Why this backend cannot run at all on this machine; ``None`` if it can."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable: {e}"
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device, and TRITON_INTERPRET=1 is not set (Triton's CPU interpreter)"
    return None


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can."""
    if problem.device_type == "cpu":
        if not interpreting():
            return "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
    elif problem.device_type != "cuda":
        return f"Triton kernels run on CUDA devices, not {problem.device_type}"
    elif problem.capability < (8, 0):
        return "Triton kernels need compute capability 8.0 or newer"
    if problem.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {problem.dtype} is not supported (float64 runs on the torch backend)"
    if op == "select":
        cfg = problem.cfg
        if problem.proxy_head_dim not in _DIMS:
            return f"proxy head_dim {problem.proxy_head_dim} is not one of {_DIMS}"
        if cfg.top_k is not None and cfg.top_k > MAX_TOP_K:
            return f"top_k {cfg.top_k} > {MAX_TOP_K}"
        if problem.num_sel_heads // problem.num_proxy_k_heads > 128:
            return "more than 128 proxy heads share one proxy key head"
        return None
    return f"op {op!r} is not implemented yet in the Triton backend"


def select(q_proxy, k_proxy, cu_seqlens, cfg):
    """Backend op ``select``: see :func:`flash_msa.triton_ref.selection.select`."""
    from .selection import select as _select

    return _select(q_proxy, k_proxy, cu_seqlens, cfg)
