"""The exact re-rank of ``selection_precision="fp8_rerank"``: the candidates' block scores.

An ``"fp8_rerank"`` selection keeps the fp8 top ``top_k + m`` blocks (``m`` =
``quant.RERANK_EXTRA``; the backend that declares ``fp8_selection`` makes them) and re-ranks them
by their exact block scores: the max of ``proxy_scale * q_proxy . k_proxy`` over the block's
causally visible keys, in fp32 from the input-dtype operands, the score the exact selection
ranks. This module computes those scores on tensor cores (:func:`scores`); the final top
``top_k`` of the ``(Tq, Hp, K)`` values is torch (:func:`flash_msa.quant.refine`, the one
implementation of the selection's rules that the torch backend and ``flash_msa.recall`` also
call). ``K = top_k + m`` is the candidates' last dim: any ``m`` runs (the cost is linear in it).

Layout: the sparse forward's reverse index (:mod:`flash_msa.worklist`) built over the
candidates (``Hs = Hp`` selection heads, ``K`` slots): for every (proxy head ``p``, key block)
the query rows that hold it as a candidate, sorted, cut into work items of at most
:data:`ITEM_TOKENS` rows. One program per work item loads the block's ``[BLOCK, Dp]`` k_proxy
tile of ``p``'s key head once and streams the item's rows ``BT`` at a time: a gathered
``[BT, Dp]`` q_proxy tile, ``tl.dot`` against the key tile (wgmma on sm_90 where ``BT >= 64``),
the causal mask, the row max, one fp32 store per (row, slot). It is the forward's proxy stage
(``sparse_fwd._fwd_kernel``, ``HAS_PROXY``; the loop body shared as ``common.proxy_chunk``)
with a max in place of the logsumexp; a separate
kernel rather than a mode of that one because it has none of the forward's other inputs or
outputs and its tile candidates are its own (one ``[BT, BLOCK]`` accumulator, no main pass), and
the forward's compiled code stays as it is.

Why not one program per (row, proxy head) with the ``K`` blocks' scores on CUDA cores: measured
on an H200 at paper 128K (H 64, Hp 4, Hpk 1, Dp 128, block 128, top_k 16, ``K = 20``;
benchmarks/fp8_rerank_time.py) that form took ~45 ms, ~7.5 TFLOP/s, for ``2 * Dp * K * block``
= 655 KFLOP per (row, proxy head), 0.34 TFLOP in all: the fp8_rerank selection then cost 57 /
54 ms (random / local) against 13.7 / 11.4 ms for bf16. Here the same FLOPs are MMAs, each key
tile is read once per item instead of once per row, and the extra cost is the work list's sort
of ``Tq * Hp * K`` keys (10.5 M at paper 128K), which the forward pays for its ``top_k`` slots
too.

Exactness: the products of the input-dtype operands are exact in fp32 and ``tl.dot`` sums them
in fp32 (``input_precision="ieee"`` for fp32 inputs, no TF32), so a score equals the torch
reference's (:func:`flash_msa.reference.rerank_scores`) up to the order of the fp32 sum over
``Dp``, as the bf16 selection's tensor-core scores do. Slots no entry covers keep ``-inf``: a
``-1`` slot, every slot of a padding row of a query map, and a candidate above the row's own
block (none of its keys is visible: dropped before the sort, so a block number past the
sequence's end cannot name another sequence's block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant, worklist
from ..problem import Config
from . import tiles
from .common import item_rows, load_rows, proxy_chunk

# Query rows per work item: the forward's (its measured choice; one key tile per item, read
# once for up to this many rows).
ITEM_TOKENS = worklist.ITEM_TOKENS
# (BT, warps) candidates, in order of preference (tiles.pick takes the first that compiles
# without spills within the shared memory): BT gathered query rows per MMA against the key
# block. The order is by occupancy, not by a timing (benchmarks/fp8_rerank_time.py --tiles
# times them): compiled for sm_90a at Dp 128, block 128 (bf16), 64 rows over 4 warps
# (one wgmma warpgroup) take 152 registers and 48 KiB (3 CTAs an SM: one CTA's gather of its
# next rows overlaps another's MMA), 128 over 8 warps 164 registers and 64 KiB (1 CTA an SM);
# 32 rows for a device whose budget refuses both.
RERANK_TILES = ((64, 4), (128, 8), (32, 4))
# The sorted entries (int64, rows * Hp * K of them) of one launch stay below this many bytes:
# the rows are cut into chunks (chunk_rows; paper 128K, Hp 4, K 20: 84 MB, one launch).
ENTRY_BYTES = 1 << 30


@triton.jit
def _rerank_kernel(
    QP,  # q_proxy [Tq, Hs, Dp]
    KP,  # k_proxy [T, Hpk, Dp]
    PERM,
    ITEM_LIST,
    ITEM_START,
    ITEM_END,
    BLK_START,
    BLK_END,  # the work list over the candidates (worklist.build, Hs = Hp, K slots)
    QMAP,  # [Tq] int32: each query row's packed key token (HAS_QMAP), else None
    OUT,  # [Tq, Hs, K] fp32, -inf where no entry writes
    pscale,
    NB,  # runtime: it changes with the number of packed sequences
    Hs: tl.constexpr,
    Hpk: tl.constexpr,
    K: tl.constexpr,
    Dp: tl.constexpr,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    PREC: tl.constexpr,
    HAS_QMAP: tl.constexpr = False,
):
    w = tl.program_id(0)
    e0 = tl.load(ITEM_START + w)
    e1 = tl.load(ITEM_END + w)
    if e0 >= e1:
        return
    # the item's block as common.item_block gives it, spelled out here: the row mask below needs
    # the block's first key and key count as int32 scalars, and kpos, m_k follow from them
    lst = tl.load(ITEM_LIST + w)
    p, gb = lst // NB, lst % NB  # selection head, global key block
    k0 = tl.load(BLK_START + gb)  # int32: the block's first packed key
    n_k = tl.load(BLK_END + gb) - k0  # its keys (fewer in a sequence's last block)
    o_k = tl.arange(0, BLOCK)
    kpos, m_k = (k0 + o_k).to(tl.int64), o_k < n_k  # [BLOCK] packed keys, in the block
    o_dp = tl.arange(0, Dp)
    b_kp = load_rows(KP, kpos * Hpk + p // (Hs // Hpk), m_k, o_dp)  # [BLOCK, Dp]: p's key head
    nxt = item_rows(PERM, e0, e1, Hs * K, K, BT, 1, 1)
    for c in range(e0, e1, BT):
        # b_z [BT, BLOCK] = q_proxy k_proxy^T; t: the rows' packed key positions
        b_z, qrow, slot, t, m_t, nxt = proxy_chunk(
            QP, QMAP, PERM, b_kp, nxt, p, c, e1, o_dp, Hs, K, BT, PREC, HAS_QMAP
        )
        # keys seen per row: causal (t >= k0 for every entry: the block is at most the row's
        # own) and within the block, as an int32 count against the block-local key index
        # (int64 packed positions in the accumulator's layout cost ~10 registers a thread)
        n_vis = tl.minimum(t - k0 + 1, n_k).to(tl.int32)  # [BT]
        b_z = tl.where(o_k[None, :] < n_vis[:, None], b_z, float("-inf"))
        # proxy_scale after the max: max_j(s * z_j) = s * max_j(z_j) exactly for s > 0 (fp32
        # rounding is monotone; the API checks proxy_scale > 0), one multiply per row
        tl.store(OUT + (qrow * Hs + p) * K + slot, tl.max(b_z, axis=1) * pscale, mask=m_t)


def options(Hs, Hpk, K, Dp, block, prec, has_qmap, tile):
    """The launch keywords (constexprs, ``num_warps``, ``num_stages``) of ``_rerank_kernel``
    for a :data:`RERANK_TILES` entry ``tile``."""
    BT, warps = tile
    return dict(
        Hs=Hs, Hpk=Hpk, K=K, Dp=Dp, BLOCK=block, BT=BT, PREC=prec, HAS_QMAP=has_qmap,
        num_warps=warps, num_stages=1,
    )  # fmt: skip


def chunk_rows(Hp: int, K: int) -> int:
    """Query rows per launch: their ``rows * Hp * K`` int64 sorted entries stay below
    :data:`ENTRY_BYTES` (a bound from the shapes: no host read of the data)."""
    return max(1, ENTRY_BYTES // (8 * Hp * max(1, K)))


def scores(
    q_proxy, k_proxy, cu_seqlens, candidates, cfg: Config, *, q_map=None,
    tables: tiles.Tables = tiles.SHIPPED,
) -> torch.Tensor:  # fmt: skip
    """fp32 ``(Tq, Hp, K)``: the exact block score of each candidate (as
    :func:`flash_msa.reference.rerank_scores`, up to the order of the fp32 sum over ``Dp``;
    ``-inf`` for a ``-1`` slot, a candidate above the row's own block and a padding row).

    Args:
        q_proxy: ``(Tq, Hp, Dp)``; k_proxy: ``(T, Hpk, Dp)``; cu_seqlens: ``(N+1,)`` int32.
        candidates: ``(Tq, Hp, K)`` int32 sequence-local blocks, ``-1`` padded (any ``K``:
            ``top_k + m`` for an fp8 selection that kept ``m`` extra blocks).
        cfg: uses ``block_size`` and ``proxy_scale``.
        q_map: ``None`` or ``(Tq,)`` int32, the packed key index of each row (``-1``: padding).
        tables: the tile candidates (``tables.rerank``, default :data:`RERANK_TILES`).

    Work: one work-list build over ``candidates`` per chunk of :func:`chunk_rows` rows (device
    ops, no host synchronization) and one launch of ``W`` work items (module docstring).
    """
    Tq, Hp, Dp = q_proxy.shape
    T, Hpk = k_proxy.shape[:2]
    K, b = candidates.shape[-1], cfg.block_size
    dev = q_proxy.device
    out = torch.full((Tq, Hp, K), float("-inf"), dtype=torch.float32, device=dev)
    if out.numel() == 0 or T == 0:
        return out
    qp, kp = q_proxy.contiguous(), k_proxy.contiguous()
    _, pos = quant.query_positions(cu_seqlens, Tq, q_map)
    own = torch.where(pos >= 0, pos // b, -1)
    # a block above the own one has no visible key (-inf): no entry, and a number past the
    # sequence's blocks cannot reach the next sequence's list
    cand = torch.where(candidates.long() > own[:, None, None], -1, candidates.long())
    cand = cand.to(torch.int32)
    key_blocks = worklist.blocks(cu_seqlens, b, T)
    prec = "ieee" if qp.dtype == torch.float32 else "tf32"
    has_qmap = q_map is not None
    qmap = q_map.contiguous() if has_qmap else None
    step = chunk_rows(Hp, K)
    cands = RERANK_TILES if tables.rerank is None else tables.rerank
    for c0 in range(0, Tq, step):
        c1 = min(Tq, c0 + step)
        sl = worklist.lists(cand[c0:c1], cu_seqlens, b, c0, T, qmap, key_blocks)
        wl = worklist.items(sl, ITEM_TOKENS)
        args = (
            qp, kp, wl.perm, wl.item_list, wl.item_start, wl.item_end, wl.block_start,
            wl.block_end, qmap, out, float(cfg.proxy_scale), wl.num_blocks,
        )  # fmt: skip

        def launch(tile):
            return options(Hp, Hpk, K, Dp, b, prec, has_qmap, tile)

        key = (qp.dtype, kp.dtype, Hp, Hpk, K, Dp, b, has_qmap)
        tile = tiles.pick(_rerank_kernel, args, cands, launch, key)
        _rerank_kernel[(wl.num_items,)](*args, **launch(tile))
    return out


def rerank(
    q_proxy, k_proxy, cu_seqlens, candidates, cfg: Config, *, q_map=None,
    tables: tiles.Tables = tiles.SHIPPED,
) -> torch.Tensor:  # fmt: skip
    """Backend op ``rerank``: the top ``cfg.top_k`` of ``candidates`` ``(Tq, Hp, K)`` by
    :func:`scores`, with the selection's rules (:func:`flash_msa.quant.refine`).
    ``(Tq, Hp, cfg.top_k)`` int32, ascending, -1 padded. ``K - cfg.top_k`` is the extra count
    ``m`` of the fp8 pass that made the candidates (any ``m >= 0``)."""
    z = scores(q_proxy, k_proxy, cu_seqlens, candidates, cfg, q_map=q_map, tables=tables)
    _, pos = quant.query_positions(cu_seqlens, q_proxy.shape[0], q_map)
    own = torch.where(pos >= 0, pos // cfg.block_size, -1)
    return quant.refine(candidates, z, cfg.top_k, own)


SIGNATURE = {  # runtime-argument types, for compile checks without a GPU (bf16 inputs)
    "QP": "*bf16",
    "KP": "*bf16",
    "PERM": "*i64",
    "ITEM_LIST": "*i32",
    "ITEM_START": "*i64",
    "ITEM_END": "*i64",
    "BLK_START": "*i32",
    "BLK_END": "*i32",
    "QMAP": "*i32",  # with HAS_QMAP; else a constexpr None (the check passes QMAP=None)
    "OUT": "*fp32",
    "pscale": "fp32",
    "NB": "i32",
}
