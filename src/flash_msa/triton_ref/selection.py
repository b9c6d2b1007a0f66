"""Proxy block selection: causal proxy scores, block max-pool, streaming top-k, indices only.

One program owns (sequence, proxy key head, tile of BT query tokens). Its BM = BT * G rows are
the G = Hp/Hpk proxy heads that share the key head, for each token (row r = token r // G, head
r % G), so every key tile is loaded once for all of them. It walks the key blocks 0..last of the
tile in ascending order; per block it computes the [BM, BLOCK] score tile, masks causally,
max-pools it to one score per row and offers that score to a per-row top-k kept in registers.
Nothing but the final block numbers is written: no S x S or S x num_blocks buffer exists.

Top-k rule (matches the reference exactly): a new block enters only if its score is strictly
greater than the current minimum (blocks arrive in ascending order, so ties keep the lower
block); the own block enters with score +inf and is never evicted; blocks with no visible key
score -inf and never enter. The evicted slot is the minimum one, the highest block among equal
minima. At the end the kept blocks are sorted ascending, empty slots become -1.

Query map (``HAS_QMAP``, context parallelism): the queries are rows of ``q_proxy`` whose tokens
``q_map[row]`` lie anywhere among the keys. The host groups them by sequence
(:func:`flash_msa.worklist.query_order`: rows sorted by token, ``QSTART`` the first sorted row
of each sequence), and a program owns BT consecutive rows of its sequence's group instead of BT
consecutive tokens: each row's position (causal limit, own block) is ``q_map[row] - start``,
and the program walks the key blocks up to its last row's. Padding rows (``-1``) belong to no
sequence: no program visits them, and the host fills their indices with -1. Without a map the
three pointers are ``None`` (constexprs) and the map's code compiles away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import worklist
from ..problem import Config
from . import tiles


@triton.jit
def _select_kernel(
    QP,
    KP,
    CU,
    IDX,  # q_proxy [T, Hp, Dp], k_proxy [T, Hpk, Dp], cu [N+1], indices [T, Hp, K]
    QMAP,  # [Tq] int32: each query row's packed key token (HAS_QMAP), else None
    ROWS,  # [Tq] int32: query rows sorted by token (worklist.query_order), else None
    QSTART,  # [N+1] int32: sequence n's sorted rows are ROWS[QSTART[n]:QSTART[n+1]], else None
    scale,
    Hp: tl.constexpr,
    Hpk: tl.constexpr,
    G: tl.constexpr,
    Dp: tl.constexpr,
    BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    KP2: tl.constexpr,
    BM: tl.constexpr,
    BT: tl.constexpr,
    PREC: tl.constexpr,
    HAS_QMAP: tl.constexpr = False,  # q_proxy rows are mapped queries (QMAP, ROWS, QSTART)
):
    # longest (last) tiles first: they walk the most key blocks
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    pk = tl.program_id(2)
    s0 = tl.load(CU + seq)
    L = tl.load(CU + seq + 1) - s0
    t0 = tile * BT
    # (the default path keeps its own order of ops: the order fixes its SASS)
    if HAS_QMAP:  # the tile's rows: sorted rows t0 .. t0 + BT of the sequence's group
        q0 = tl.load(QSTART + seq)
        nq = tl.load(QSTART + seq + 1) - q0
        if t0 >= nq:
            return
    else:
        if t0 >= L:
            return
    o_r = tl.arange(0, BM)
    o_d = tl.arange(0, Dp)
    o_k = tl.arange(0, BLOCK)
    slot = tl.arange(0, KP2)
    if HAS_QMAP:
        m_r = (o_r < BT * G) & (t0 + o_r // G < nq)
        qrow = tl.load(ROWS + q0 + t0 + o_r // G, mask=m_r, other=0).to(tl.int64)  # [BM]
        tok = tl.load(QMAP + qrow, mask=m_r, other=0) - s0  # [BM] sequence-local position
        tok = tl.where(m_r, tok, 0)
    else:
        tok = t0 + o_r // G  # [BM] sequence-local query position
    head = pk * G + o_r % G  # [BM] proxy head
    if not HAS_QMAP:
        m_r = (o_r < BT * G) & (tok < L)
        qrow = (s0 + tok).to(tl.int64)  # [BM] row of q_proxy and of indices
    p_q = QP + (qrow * Hp + head)[:, None] * Dp + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None], other=0.0)  # [BM, Dp]
    own = tok // BLOCK

    # per-row top-k state; padding slots (>= TOPK) hold +inf so they are never evicted
    b_val = tl.where(slot[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros(
        [BM, KP2], tl.float32
    )
    b_id = tl.full([BM, KP2], -1, tl.int32)

    if HAS_QMAP:
        last = tl.max(tok, axis=0)  # the rows ascend by token, but the max needs no such promise
    else:
        last = tl.minimum(t0 + BT, L) - 1
    for n in range(0, last // BLOCK + 1):
        kpos = n * BLOCK + o_k  # [BLOCK]
        p_k = KP + ((s0 + kpos).to(tl.int64) * Hpk + pk)[:, None] * Dp + o_d[None, :]
        b_k = tl.load(p_k, mask=(kpos < L)[:, None], other=0.0)  # [BLOCK, Dp]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BM, BLOCK] fp32
        # causal (=> < L); a NaN score counts as -inf in its block's maximum, as fmax (CuTe)
        b_s = tl.where((kpos[None, :] <= tok[:, None]) & (b_s == b_s), b_s, float("-inf"))
        b_score = tl.max(b_s, axis=1) * scale  # [BM]
        # a non-finite block score never enters (NaN < inf is false); the own block always does
        b_score = tl.where(b_score < float("inf"), b_score, float("-inf"))
        b_score = tl.where(own == n, float("inf"), b_score)
        # offer the block: replace the minimum slot (highest block among equal minima)
        b_min = tl.min(b_val, axis=1)  # [BM]
        e_key = tl.where(b_val == b_min[:, None], b_id * KP2 + slot[None, :], -(1 << 30))
        e_max = tl.max(e_key, axis=1)
        hit = (e_key == e_max[:, None]) & (b_score > b_min)[:, None]
        b_val = tl.where(hit, b_score[:, None], b_val)
        b_id = tl.where(hit, n, b_id)

    b_key = tl.where(b_id >= 0, b_id, 1 << 30)
    b_key = tl.sort(b_key, dim=1)  # ascending, empty slots last
    b_out = tl.where(b_key == (1 << 30), -1, b_key)
    if not HAS_QMAP:
        qrow = (s0 + tok).to(tl.int64)
    p_o = IDX + (qrow * Hp + head)[:, None] * TOPK + slot[None, :]
    tl.store(p_o, b_out, mask=m_r[:, None] & (slot[None, :] < TOPK))


QMAP_ARGS = ("QMAP", "ROWS", "QSTART")  # the query map's pointers (None without a map)


def SIGNATURE(dtype: str) -> dict:
    """Runtime-argument types of ``_select_kernel`` (for compile checks without a GPU; without a
    query map the constexprs hold ``QMAP = ROWS = QSTART = None``)."""
    return {
        "QP": f"*{dtype}", "KP": f"*{dtype}", "CU": "*i32", "IDX": "*i32",
        **{k: "*i32" for k in QMAP_ARGS}, "scale": "fp32",
    }  # fmt: skip


def launch_config(G: int, Dp: int, block: int, top_k: int, dtype: str):
    """``(constexprs, num_warps, num_stages)`` for one problem: the fixed tile table (the warps,
    the rows per program ``BM`` with ``BT = BM // G`` and the stages are the first of
    :func:`tile_candidates`)."""
    BM = 128 if G <= 128 else triton.next_power_of_2(G)
    consts = dict(
        Hp=G, Hpk=1, G=G, Dp=Dp, BLOCK=block, TOPK=top_k,
        KP2=max(2, triton.next_power_of_2(top_k)), BM=BM, BT=BM // G,
        PREC="ieee" if dtype == "fp32" else "tf32",
    )  # fmt: skip
    return consts, (8 if BM * block >= 128 * 128 else 4), 2


def tile_candidates(num_warps: int, num_stages: int, BM: int, G: int):
    """``(num_warps, BM, num_stages)`` to try in order (tiles.pick): the table's, then 8 warps
    (more registers per tile) if that one spills (top_k 64 on sm_90), then 16 warps, then half
    the rows (``BT = BM // 2 // G`` tokens, while that is one or more) with 8 warps and no
    software pipelining. The last two are for ``mma.sync`` targets (sm_80 to sm_120), where
    the ``[BM, BLOCK]`` scores and the ``[BM, KP2]`` top-k state take more registers than with
    wgmma: at ``Dp = 128``, block 128, top_k 64, ``G = 4`` (Triton 3.9) the 8-warp tile spills
    8 bytes on sm_80 and 24 on sm_120, 16 warps fit sm_80 (128 registers) but spill 32 bytes on
    sm_120, and 64 rows x 8 warps x 1 stage fit both (170 registers, 24 KB; compile_check
    --arch)."""
    cands = [(num_warps, BM, num_stages), (8, BM, num_stages), (16, BM, num_stages)]
    if BM // 2 >= G:
        cands.append((8, BM // 2, 1))
    return tuple(dict.fromkeys(cands))


def select_into(
    indices, q_proxy, k_proxy, cu_seqlens, cfg: Config, q_map=None,
    tables: tiles.Tables = tiles.SHIPPED,
):  # fmt: skip
    """Write the selection into ``indices`` ``(T, Hp, top_k)`` int32 (every entry is written).

    ``q_map``: ``None`` or ``(Tq,)`` int32 (the contract's query map): ``q_proxy`` and
    ``indices`` have ``Tq`` rows, ``k_proxy`` the keys' ``T``; every entry of a mapped row is
    written, those of padding rows (``-1``) are left as they are (:func:`select` fills them
    with -1). ``tables.select``: a filter of the tile candidates (:func:`tile_candidates`)."""
    T, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[1]
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[q_proxy.dtype]
    consts, num_warps, num_stages = launch_config(Hp // Hpk, Dp, cfg.block_size, cfg.top_k, dtype)
    consts.update(Hp=Hp, Hpk=Hpk)
    qm = dict.fromkeys(QMAP_ARGS)  # None: constexprs, not parameters
    rows = cfg.max_seqlen  # query rows per sequence: at most its tokens
    if q_map is not None:
        order = worklist.query_order(q_map, cu_seqlens, k_proxy.shape[0])
        qm = dict(QMAP=q_map, ROWS=order.rows, QSTART=order.seq_start)
        rows = min(T, cfg.max_seqlen)  # and at most the query rows (a host bound: no sync)
        consts.update(HAS_QMAP=True)
    args = (q_proxy, k_proxy, cu_seqlens, indices, *qm.values(), cfg.proxy_scale)
    G = Hp // Hpk

    def options(tile):
        warps, BM, stages = tile
        return dict(consts, BM=BM, BT=BM // G, num_warps=warps, num_stages=stages)

    cands = tile_candidates(num_warps, num_stages, consts["BM"], G)
    if tables.select is not None:
        cands = tables.select(cands)
    key = (dtype, *sorted(consts.items()), num_stages)
    tile = tiles.pick(_select_kernel, args, cands, options, key)
    grid = (triton.cdiv(rows, options(tile)["BT"]), cu_seqlens.numel() - 1, Hpk)
    _select_kernel[grid](*args, **options(tile))
    return indices


def select(
    q_proxy, k_proxy, cu_seqlens, cfg: Config, *, q_map=None, tables: tiles.Tables = tiles.SHIPPED
):
    """Backend op ``select`` (contract in docs/design.md): ``(T, Hp, top_k)`` int32 indices;
    with ``q_map`` ``(Tq, Hp, top_k)``, all -1 for a padding row."""
    T, Hp, _ = q_proxy.shape
    shape, dev = (T, Hp, cfg.top_k), q_proxy.device
    if q_map is None:
        out = torch.empty(shape, dtype=torch.int32, device=dev)
    else:  # padding rows are never visited
        out = torch.full(shape, -1, dtype=torch.int32, device=dev)
    return select_into(out, q_proxy, k_proxy, cu_seqlens, cfg, q_map, tables)
