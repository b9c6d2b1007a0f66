"""The exact re-rank of ``selection_precision="fp8_rerank"``: the candidates' block scores.

An ``"fp8_rerank"`` selection keeps the fp8 top ``top_k + RERANK_EXTRA`` blocks (the backend
that declares ``fp8_selection`` makes them) and re-ranks them by their exact block scores: the
max of ``proxy_scale * q_proxy . k_proxy`` over the block's causally visible keys, in fp32 from
the input-dtype operands, the score the exact selection ranks. This module computes those
scores (:func:`scores`); the final top ``top_k`` of ``(T, Hp, K)`` values is torch
(:func:`flash_msa.quant.refine`, the one implementation of the selection's rules that the
torch backend and ``flash_msa.recall`` also call).

A separate small kernel rather than a "max" mode of the sparse forward's proxy stage
(``sparse_fwd.proxy_partials`` over the work list): the re-rank has its own inputs (``K`` blocks
per (row, head), not the selection's ``top_k``), runs before the forward's work list exists
(the final indices are what that list is built from), and one program per (row, proxy head)
gives each row's score in a fixed order independent of any tile shape. Cost: ``2 * Dp * K * b``
FLOPs per (row, proxy head) on CUDA cores (``K = 20``, ``b = Dp = 128``: 655 KFLOP; paper 128K
with ``Hp = 4``: 0.34 TFLOP), reading ``K`` key blocks per program that neighbouring rows share
(L2). The forward's work-list stage with tensor cores would be the faster form if it matters.

One program per (query row, proxy head): the row's ``q`` ``[Dp]`` in registers, a loop over its
``K`` candidates, each a ``[BLOCK, Dp]`` tile of its key head's rows masked to the causally
visible keys (``-1`` slots and padding rows of a query map see none: ``-inf``). The query map
is the positions' business only (:func:`flash_msa.quant.query_positions`): the kernel reads
each row's sequence start and position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..problem import Config


@triton.jit
def _rerank_kernel(
    QP,  # q_proxy [Tq, Hp, Dp]
    KP,  # k_proxy [T, Hpk, Dp]
    CAND,  # candidates [Tq, Hp, K] int32, -1 padded
    START,  # [Tq] int64: packed index of the row's sequence's first key
    POS,  # [Tq] int64: the row's position in its sequence, -1 for a padding row
    OUT,  # [Tq, Hp, K] fp32
    proxy_scale,
    K,
    Hp: tl.constexpr,
    G: tl.constexpr,  # proxy heads per proxy key head
    Hpk: tl.constexpr,
    Dp: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    pk = p // G
    o_d = tl.arange(0, Dp)
    o_k = tl.arange(0, BLOCK)
    row = t * Hp + p
    q = tl.load(QP + row * Dp + o_d).to(tl.float32)
    start = tl.load(START + t)
    pos = tl.load(POS + t)
    for j in range(K):
        c = tl.load(CAND + row * K + j).to(tl.int64)
        key = c * BLOCK + o_k  # sequence-local key positions
        # a -1 slot has negative keys; causal; pos < length keeps the keys in the sequence
        seen = (key >= 0) & (key <= pos)
        tok = start + key
        ptr = KP + (tok[:, None] * Hpk + pk) * Dp + o_d[None, :]
        k = tl.load(ptr, mask=seen[:, None], other=0.0)
        dot = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # [BLOCK] fp32
        z = tl.where(seen, proxy_scale * dot, float("-inf"))
        tl.store(OUT + row * K + j, tl.max(z, axis=0))


def num_warps(block_size: int, Dp: int) -> int:
    """Warps of one program: a ``[block, Dp]`` fp32 tile at 64 values per thread at most
    (``block = Dp = 128``: 8 warps)."""
    return max(1, min(8, block_size * Dp // (64 * 32)))


def scores(q_proxy, k_proxy, cu_seqlens, candidates, cfg: Config, *, q_map=None) -> torch.Tensor:
    """fp32 ``(Tq, Hp, K)``: the exact block score of each candidate (as
    :func:`flash_msa.reference.rerank_scores`, up to the order of the fp32 sum over ``Dp``).

    Args:
        q_proxy: ``(Tq, Hp, Dp)``; k_proxy: ``(T, Hpk, Dp)``; cu_seqlens: ``(N+1,)`` int32.
        candidates: ``(Tq, Hp, K)`` int32 sequence-local blocks, ``-1`` padded.
        cfg: uses ``block_size`` and ``proxy_scale``.
        q_map: ``None`` or ``(Tq,)`` int32, the packed key index of each row (``-1``: padding).
    """
    Tq, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[1]
    K, b = candidates.shape[-1], cfg.block_size
    out = torch.empty(Tq, Hp, K, dtype=torch.float32, device=q_proxy.device)
    if out.numel() == 0:
        return out
    start, pos = quant.query_positions(cu_seqlens, Tq, q_map)
    _rerank_kernel[(Tq, Hp)](
        q_proxy.contiguous(),
        k_proxy.contiguous(),
        candidates.contiguous(),
        start.contiguous(),
        pos.contiguous(),
        out,
        float(cfg.proxy_scale),
        K,
        Hp=Hp,
        G=Hp // Hpk,
        Hpk=Hpk,
        Dp=Dp,
        BLOCK=b,
        num_warps=num_warps(b, Dp),
    )
    return out


def rerank(q_proxy, k_proxy, cu_seqlens, candidates, cfg: Config, *, q_map=None) -> torch.Tensor:
    """Backend op ``rerank``: the top ``cfg.top_k`` of ``candidates`` ``(Tq, Hp, K)`` by
    :func:`scores`, with the selection's rules (:func:`flash_msa.quant.refine`).
    ``(Tq, Hp, cfg.top_k)`` int32, ascending, -1 padded."""
    z = scores(q_proxy, k_proxy, cu_seqlens, candidates, cfg, q_map=q_map)
    _, pos = quant.query_positions(cu_seqlens, q_proxy.shape[0], q_map)
    own = torch.where(pos >= 0, pos // cfg.block_size, -1)
    return quant.refine(candidates, z, cfg.top_k, own)


# ---------------------------------------------------------------------------------------------
# compile check (sm_90a without a GPU), in the style of compile_check.py
# ---------------------------------------------------------------------------------------------
SIGNATURE = {
    "QP": "*bf16",
    "KP": "*bf16",
    "CAND": "*i32",
    "START": "*i64",
    "POS": "*i64",
    "OUT": "*fp32",
    "proxy_scale": "fp32",
    "K": "i32",
}


def main(argv=None) -> int:
    """``python -m flash_msa.triton_ref.reranking [--arch 90]``: compile the kernel for Dp 64/128,
    blocks 64/128, ``G`` 1/4 (bf16) without a GPU (``TRITON_INTERPRET`` unset); one JSON line
    each. Exit status 1 if one spills or exceeds the shared memory."""
    import argparse
    import json
    import os
    import sys

    from .compile_check import compile_kernel
    from .tiles import SHARED_LIMITS

    parser = argparse.ArgumentParser(prog="python -m flash_msa.triton_ref.reranking")
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMITS))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    bad = 0
    for Dp in (64, 128):
        for block in (64, 128):
            for G in (1, 4):
                consts = dict(Hp=4 * G, G=G, Hpk=4, Dp=Dp, BLOCK=block)
                res = compile_kernel(
                    _rerank_kernel, SIGNATURE, consts, num_warps(block, Dp), 1, args.arch
                )
                bad += res["spill_bytes"] > 0 or res["shared_bytes"] > SHARED_LIMITS[args.arch]
                name = f"rerank Dp={Dp} b={block} G={G}"
                print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
