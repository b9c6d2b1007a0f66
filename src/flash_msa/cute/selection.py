"""Host code of the CuTe backend's ``select``: the selection's limits beyond ``LIMITS["select"]``
and the op, with the FP8 selection's quantize pass.

The FP8 selection (``selection_precision="fp8"``): the quantize pass (the shipped key scale
and rotation) by :func:`.quantize_sm90.quantize` where :func:`.quantize_sm90.can_implement`
takes the call (bitwise equal to :func:`flash_msa.quant.quantize`), else the torch pass, then
:class:`~.select_sm90.SelectSm90` on e4m3 operands. On the H200 the fp8 kernel runs at 741 /
1053 TFLOP/s at paper 128K (random / local inputs, top_k 16; bf16 601 / 782) and 935 / 1180 at
anchor 1M (bf16 655 / 796), against 275-326 for Triton's fp8 selection; no row differs from
Triton's fp8 selection beyond near-ties.
"""

from __future__ import annotations

import cutlass
import torch

from .. import quant
from ..problem import Problem
from . import quantize_sm90
from .common import cutlass_dtype
from .select_sm90 import FP8_STAGES, TILE_M, SelectSm90, select_fp8_into, select_into


def select_reason(problem: Problem) -> str | None:
    """The selection's limits beyond ``LIMITS``: its kernel's (``SelectSm90.can_implement``:
    the same table plus head ratio and shared memory) and the grid's (run-time sizes)."""
    cfg = problem.cfg
    if problem.selection_precision == "fp8":  # the e4m3 kernel, with the shipped key scale
        if problem.q_map:
            return "the CuTe fp8 selection has no query map (q_map)"
        dtype, stages, key_scale = cutlass.Float8E4M3FN, FP8_STAGES, quant.KEY_SCALE
    else:
        dtype, stages, key_scale = cutlass_dtype(problem.dtype), 4, None
    why = SelectSm90.can_implement(
        dtype, problem.proxy_head_dim, problem.num_sel_heads, problem.num_proxy_k_heads,
        cfg.top_k, cfg.block_size, stages, key_scale,
    )  # fmt: skip
    if why is not None:
        return why
    if -(-cfg.max_seqlen // TILE_M) > 65535:
        return f"max_seqlen {cfg.max_seqlen} needs more than 65535 query tiles (grid y)"
    if problem.num_seqs * problem.num_sel_heads >= 2**31:
        return "too many (sequence, proxy head) pairs for the grid"
    return None


def select(q_proxy, k_proxy, cu_seqlens, cfg, *, q_map=None):
    """Backend op ``select`` (docs/design.md): ``indices (T, Hp, top_k)`` int32, ascending
    sequence-local block numbers, -1 in unused slots (:func:`~.select_sm90.select_into` a new
    tensor); with ``q_map`` ``(Tq, Hp, top_k)``, all -1 for a padding row.

    ``cfg.selection_precision == "fp8"``: the quantize pass (module docstring), then
    :func:`~.select_sm90.select_fp8_into`; no query map."""
    T, Hp, _ = q_proxy.shape
    shape, dev = (T, Hp, cfg.top_k), q_proxy.device
    if cfg.selection_precision == "fp8":
        if q_map is not None:
            raise ValueError("CuTe fp8 selection: no query map (q_map) in the fp8 kernel")
        b = cfg.block_size
        if quantize_sm90.can_implement(q_proxy, k_proxy, b) is None:
            qz = quantize_sm90.quantize(q_proxy, k_proxy, cu_seqlens, b, max_seqlen=cfg.max_seqlen)
        else:  # the named fallback: the torch pass (same bits)
            qz = quant.quantize(q_proxy, k_proxy, cu_seqlens, b)
        idx = torch.empty(shape, dtype=torch.int32, device=dev)
        return select_fp8_into(idx, qz, cu_seqlens, cfg)
    if q_map is None:
        idx = torch.empty(shape, dtype=torch.int32, device=dev)
    else:  # padding rows are never visited
        idx = torch.full(shape, -1, dtype=torch.int32, device=dev)
    return select_into(idx, q_proxy, k_proxy, cu_seqlens, cfg, q_map=q_map)
