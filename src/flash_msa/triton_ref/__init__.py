"""Triton backend: readable kernels, the oracle of the CuTe backend and the portable fallback.

Ops (contract in docs/design.md): ``select`` (``selection.py``), ``fwd`` (``sparse_fwd.py``) and
``bwd`` (``sparse_bwd.py``) over the reverse index of ``worklist.py``, the proxy KL value and
gradient (``proxy.py``); warmup (dense causal attention, KL over every visible key) in
``dense.py``.
On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported).
"""

from __future__ import annotations

import torch

from ..backends import interpreting
from ..problem import Problem

_DIMS = (16, 32, 64, 128)
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
    elif problem.capability[0] not in (9, 10):
        major, minor = problem.capability
        return (
            f"sm_{major}{minor}: the Triton tile tables need ~227 KB of shared memory per "
            "block (sm_90, sm_100); smaller tiles for other GPUs are not implemented yet"
        )
    if problem.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {problem.dtype} is not supported (float64 runs on the torch backend)"
    cfg = problem.cfg
    if problem.num_seqs > 65535:  # the sequence index is a grid dimension (y) of some kernels
        return f"{problem.num_seqs} sequences in one call: at most 65535"
    if cfg.top_k is not None and cfg.top_k > MAX_TOP_K:
        return f"top_k {cfg.top_k} > {MAX_TOP_K}"
    has_proxy = problem.proxy_head_dim > 0
    if has_proxy and problem.proxy_head_dim not in _DIMS:
        return f"proxy head_dim {problem.proxy_head_dim} is not one of {_DIMS}"
    if op == "select":
        if problem.num_sel_heads // problem.num_proxy_k_heads > 128:
            return "more than 128 proxy heads share one proxy key head"
        return None
    if problem.head_dim not in _DIMS:
        return f"head_dim {problem.head_dim} is not one of {_DIMS}"
    g2 = problem.num_heads // max(problem.num_sel_heads, problem.num_kv_heads)
    if g2 > 16 or g2 & (g2 - 1):
        return f"{g2} main heads per (selection head, KV head): must be a power of two <= 16"
    return None


def forward_stages():
    """This backend's stages of the sparse-forward driver (:mod:`flash_msa.sparse_forward`):
    one kernel makes the main and the proxy LSE partials; the KL pass also makes the proxy
    gradient for ``dkl = 1`` when the step will need it."""
    from ..sparse_forward import Stages
    from . import proxy, sparse_fwd

    return Stages(
        partials=sparse_fwd.partials,
        partials_make_proxy=True,
        proxy_partials=sparse_fwd.proxy_partials,
        combine=sparse_fwd.combine,
        kl=proxy.kl,
        kl_makes_proxy_grad=True,
    )


def select(q_proxy, k_proxy, cu_seqlens, cfg):
    """Backend op ``select``: see :func:`flash_msa.triton_ref.selection.select`."""
    from .selection import select as _select

    return _select(q_proxy, k_proxy, cu_seqlens, cfg)


def fwd(q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False):
    """Backend op ``fwd``: see :func:`flash_msa.triton_ref.sparse_fwd.fwd`."""
    if indices is None:  # warmup: dense causal attention
        from .dense import fwd as _dense_fwd

        return _dense_fwd(q, k, v, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad)
    from .sparse_fwd import fwd as _fwd

    return _fwd(q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad)


def bwd(dout, dkl, saved, cu_seqlens, cfg):
    """Backend op ``bwd``: see :func:`flash_msa.triton_ref.sparse_bwd.bwd`."""
    if saved.indices is None:  # warmup
        from .dense import bwd as _dense_bwd

        return _dense_bwd(dout, dkl, saved, cu_seqlens, cfg)
    from .sparse_bwd import bwd as _bwd

    return _bwd(dout, dkl, saved, cu_seqlens, cfg)
