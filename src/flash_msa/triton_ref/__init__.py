"""Triton backend: readable kernels, the oracle of the CuTe backend and the portable fallback.

Ops (contract in docs/design.md): ``select`` (``selection.py``), ``fwd`` (``sparse_fwd.py``) and
``bwd`` (``sparse_bwd.py``) over the reverse index of ``worklist.py``, the proxy KL value and
gradient (``proxy.py``); warmup (dense causal attention, KL over every visible key) in
``dense.py``; deterministic mode's ordered reductions (``Config.deterministic``) in the neutral
``flash_msa.ordered`` (the CuTe backward uses them too).
On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported). Triton is optional: without it this package imports (its limits
readable) and :func:`unavailable_reason` says why the backend cannot run; the kernel modules
are imported only where triton is.

The sparse ops take the contract's query map (``q_map``, context parallelism; docs/design.md):
the selection groups the query rows by sequence (``worklist.query_order``), the forward and
backward kernels read each row's token from the work list's map for the causal limit (a
``HAS_QMAP`` constexpr: without a map its loads compile away). The warmup (``dense.py``) does
not take one.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import limits
from ..backends import interpreting
from ..limits import OPS, Limits
from ..problem import Problem
from .tiles import HEAD_DIMS, PROXY_HEAD_DIMS, SHIPPED, Tables

try:  # optional: without triton the package imports and the backend says why it cannot run
    import triton  # noqa: F401
except ImportError as e:
    _NO_TRITON = f"triton is not importable: {e}"
else:
    _NO_TRITON = None
    from . import dense, selection, sparse_bwd, sparse_fwd

_ALL = Limits(
    devices=("cuda", "cpu"),
    # The architectures whose tiles are checked: every candidate list ends in tiles that fit
    # the per-block shared memory of tiles.SHARED_LIMITS (sm_80 163 KB; sm_86/89/120 99 KB;
    # sm_90/10x 227 KB) and compile without spills for the target (compile_check --arch, CI:
    # sm_80/89/100/120; sm_86 by hand: 35 configurations, 0 spills, at most 96 KB), and
    # tiles.pick walks the list to the first that fits the device. Run on an H200 only: sm_90
    # itself, and the other budgets forced there by FLASH_MSA_SMEM_LIMIT
    # (tests/ops/test_tiles.py). The fp8 selection is not declared here (the torch
    # backend's alone); a Triton declaration of it must leave out sm_80/86 (no e4m3 MMA).
    capabilities=((8, 0), (8, 6), (8, 9), (9, None), (10, None), (12, 0)),
    capability_note=(
        "the Triton tiles are sized and compile-checked for these architectures' shared "
        "memory and MMA instructions only"
    ),
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    # the interpreter computes bf16 matmuls wrongly (out error ~1e9 seen): refuse, so that
    # auto falls back to torch on CPU instead of returning garbage
    cpu_dtypes=(torch.float16, torch.float32),
    cpu_note="Triton's CPU interpreter computes bf16 wrongly",
    head_dims=HEAD_DIMS,  # tiles.py says why these (D 256, Dp at most 128)
    proxy_head_dims=PROXY_HEAD_DIMS,
    block_sizes=(64, 128),
    max_top_k=64,
    # deterministic mode (Config.deterministic): ordered reductions instead of fp32 atomics in
    # the sparse backward, the proxy pass and the warmup backward (ordered.py, dense.py)
    deterministic=True,
)
# Main heads per (selection head, KV head) the sparse and warmup kernels run: any count up to
# 16 (worklist.padded_geometry pads a group that is not a power of two to G2P rows per token,
# the padded rows masked), the most that one sub-group of the largest tiles (256 rows, G2P <=
# 256 / 16) holds, and the envelope the tests and the compile check cover
MAX_GROUP = 16
# every op, warmup included, within one envelope; the sparse ops also take a query map (with
# or without deterministic mode), the warmup's dense kernels do not
LIMITS = {op: dataclasses.replace(_ALL, q_map=op != "warmup") for op in OPS}


def unavailable_reason() -> str | None:
    """Why this backend cannot run at all on this machine; ``None`` if it can."""
    if _NO_TRITON is not None:
        return _NO_TRITON
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device, and TRITON_INTERPRET=1 is not set (Triton's CPU interpreter)"
    return None


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can: the declared
    :data:`LIMITS`, then the rules no table holds."""
    if problem.device_type == "cpu" and not interpreting():
        return "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
    why = limits.reason(LIMITS, op, problem)
    if why is not None:
        return why
    if problem.num_seqs > 65535:  # the sequence index is a grid dimension (y) of some kernels
        return f"{problem.num_seqs} sequences in one call: at most 65535"
    if op == "select":
        if problem.num_sel_heads // problem.num_proxy_k_heads > 128:
            return "more than 128 proxy heads share one proxy key head"
        return None
    H, Hkv, Hs = problem.num_heads, problem.num_kv_heads, problem.num_sel_heads
    if H % Hs or H % Hkv or (Hs % Hkv and Hkv % Hs):
        return (
            f"H={H}, Hkv={Hkv}, selection heads {Hs}: H must be a multiple of both, and one of "
            "Hkv and the selection heads a multiple of the other"
        )
    g2 = H // max(Hs, Hkv)
    if g2 > MAX_GROUP:
        return (
            f"{g2} main heads per (selection head, KV head): at most {MAX_GROUP} (any count "
            f"up to it runs, padded to a power of two in the MMA rows: "
            f"worklist.padded_geometry)"
        )
    return None


def forward_stages(tables: Tables = SHIPPED):
    """This backend's stages of the sparse-forward driver: see
    :func:`flash_msa.triton_ref.sparse_fwd.forward_stages`."""
    return sparse_fwd.forward_stages(tables)


def _no_warmup_q_map(q_map):
    if q_map is not None:
        raise ValueError(
            "q_map: the Triton warmup (dense attention, indices=None) does not take a query map"
        )


def select(q_proxy, k_proxy, cu_seqlens, cfg, *, q_map=None, tables: Tables = SHIPPED):
    """Backend op ``select``: see :func:`flash_msa.triton_ref.selection.select`. ``tables``
    (every op): the tile candidates (:class:`flash_msa.triton_ref.tiles.Tables`; the shipped
    tables by default)."""
    return selection.select(q_proxy, k_proxy, cu_seqlens, cfg, q_map=q_map, tables=tables)


def fwd(
    q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False, *,
    q_map=None, tables: Tables = SHIPPED,
):  # fmt: skip
    """Backend op ``fwd``: see :func:`flash_msa.triton_ref.sparse_fwd.fwd`; with ``indices is
    None`` the warmup's dense attention (:func:`flash_msa.triton_ref.dense.fwd`)."""
    if indices is None:  # warmup: dense causal attention
        _no_warmup_q_map(q_map)
        return dense.fwd(q, k, v, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad, tables=tables)
    return sparse_fwd.fwd(
        q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad, q_map=q_map,
        tables=tables,
    )  # fmt: skip


def bwd(dout, dkl, saved, cu_seqlens, cfg, *, q_map=None, tables: Tables = SHIPPED):
    """Backend op ``bwd``: see :func:`flash_msa.triton_ref.sparse_bwd.bwd`; for a warmup
    forward (``saved.indices is None``) :func:`flash_msa.triton_ref.dense.bwd`."""
    if saved.indices is None:  # warmup
        _no_warmup_q_map(q_map)
        return dense.bwd(dout, dkl, saved, cu_seqlens, cfg, tables=tables)
    return sparse_bwd.bwd(dout, dkl, saved, cu_seqlens, cfg, q_map=q_map, tables=tables)
