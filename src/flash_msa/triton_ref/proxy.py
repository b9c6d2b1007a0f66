"""The proxy pass: the KL value and/or the proxy's closed-form gradient, on the kept pairs.

One program per work item (worklist.py) = (selection head p, key block, up to TW tokens). For
each chunk of BT tokens it rebuilds the teacher ``target = mean over the G main heads of P``
(P from the saved main LSE; the G heads are visited in R sub-groups of G2 heads that share a KV
head, packed into the MMA's M dimension, padded to G2P rows per token: common.teacher) and the
proxy distribution ``Q = exp(z - proxy_lse)`` on the block's visible keys, then

- KL value: ``sum target * (log target - log Q)`` over the item (one fp32 partial per item);
- gradient: ``dz = coef * (Q - target)`` with ``coef = dkl / (Hs * T)``,
  ``dq_proxy += pscale * dz @ k_proxy`` (fp32 atomics, a query's rows come from K blocks) and
  ``dk_proxy += pscale * dz^T @ q_proxy`` (kept in registers over the item, added once).

``Q - target`` (not ``dz``) is what is cast to the input dtype for the MMAs: ``coef`` is ~1/T and
would underflow fp16; it is applied to the fp32 results.

Deterministic mode (:func:`launch` with ``deterministic``; the forward's KL stage with
``cfg.deterministic``): ``DETERMINISTIC`` stores the dq_proxy rows and dk_proxy tiles into
partial buffers, which ordered.py adds in a fixed order (no atomics).

Query map (``HAS_QMAP``: the work list's ``q_map``): entries are query rows (``q``, ``lse``,
``q_proxy``, ``proxy_lse``, ``dq_proxy``, the row partials), keys are key tokens; causality
compares the keys with the rows' tokens ``QMAP[row]``, and ``coef = dkl / (Hs * Tq)``.
Without a map ``QMAP`` is ``None`` (a constexpr) and the map's loads compile away.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton import jit

from .. import ordered
from ..worklist import padded_geometry
from . import tiles
from .common import item_block, item_rows, proxy_step, teacher


@jit
def _proxy_kernel(
    Q,
    Kt,
    QP,
    KP,
    LSE,
    PLSE,
    DKL,  # lse [T,H], proxy lse [T,Hs] fp32; dkl: 0-dim
    PERM,
    ITEM_LIST,
    ITEM_START,
    ITEM_END,
    BLK_START,
    BLK_END,
    QMAP,  # [Tq] int32: each query row's packed key token (HAS_QMAP), else None
    KL_PART,
    DQP,
    DKP,  # [W] fp32; fp32 [T,Hs,Dp] / [T,Hpk,Dp], zero-initialized (DETERMINISTIC: partials)
    TOK0,  # (1,) int64: first token of the work list's chunk (DETERMINISTIC only)
    scale,
    pscale,
    inv_rows,
    P0,
    P1,  # DETERMINISTIC: only selection heads P0 .. P1 run (the row partials' head slice)
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    Hpk: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    Dp: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,  # G2 padded to a power of two (worklist.padded_geometry)
    R: tl.constexpr,
    BN: tl.constexpr,  # keys per program: the block's part program_id(1) (BN <= block size)
    BT: tl.constexpr,
    NB,  # runtime: it changes with the number of packed sequences
    KL_VALUE: tl.constexpr,
    GRAD: tl.constexpr,
    PREC: tl.constexpr,
    PREFETCH: tl.constexpr,
    # stores instead of fp32 atomics (ordered.py): DQP is the row partials [C, P1 - P0, K * S,
    # Dp] of the chunk's tokens and heads P0 .. P1, DKP the key-tile partials [items, S * BN,
    # Dp] of the item range, S = programs per key block (program_id(1))
    DETERMINISTIC: tl.constexpr = False,
    HAS_QMAP: tl.constexpr = False,  # queries are rows of QMAP (causality from their tokens)
):
    w = tl.program_id(0)
    e0 = tl.load(ITEM_START + w)
    e1 = tl.load(ITEM_END + w)
    if e0 >= e1:
        return
    sub = tl.program_id(1)
    p, kpos, m_k = item_block(ITEM_LIST, BLK_START, BLK_END, w, NB, BN, sub)
    if DETERMINISTIC:
        if (p < P0) | (p >= P1):
            return
        S = tl.num_programs(1)
        tok0 = tl.load(TOK0)
    o_d = tl.arange(0, D)
    o_dp = tl.arange(0, Dp)
    pk = p // (Hs // Hpk)
    p_kp = KP + (kpos * Hpk + pk)[:, None] * Dp + o_dp[None, :]
    b_kp = tl.load(p_kp, mask=m_k[:, None], other=0.0)  # [BN, Dp]
    kl_acc = tl.zeros([BT], tl.float32)
    b_dkp = tl.zeros([BN, Dp], tl.float32)
    if GRAD:
        coef = tl.load(DKL).to(tl.float32) * inv_rows
    # with one KV sub-group (R == 1) the key tile stays in registers for the whole item
    p_k0 = Kt + (kpos * Hkv + (p * G) // (H // Hkv))[:, None] * D + o_d[None, :]
    b_k0 = tl.load(p_k0, mask=m_k[:, None], other=0.0)
    nxt = item_rows(PERM, e0, e1, Hs * K, K, BT, G2, G2P)  # (token, slot, head, mask) per row
    nxt1 = item_rows(PERM, e0, e1, Hs * K, K, BT, 1, 1)  # one row per token
    for c in range(e0, e1, BT):
        if not PREFETCH:
            nxt = item_rows(PERM, c, e1, Hs * K, K, BT, G2, G2P)
            nxt1 = item_rows(PERM, c, e1, Hs * K, K, BT, 1, 1)
        tr, _, hj, m_r = nxt
        t, slot, _, m_t = nxt1
        tr_pos, t_pos = tr, t  # the queries' packed key positions (causality)
        if HAS_QMAP:
            tr_pos = tl.load(QMAP + tr, mask=m_r, other=0).to(tl.int64)
            t_pos = tl.load(QMAP + t, mask=m_t, other=0).to(tl.int64)
        prow = t * Hs + p
        b_qp = tl.load(QP + prow[:, None] * Dp + o_dp[None, :], mask=m_t[:, None], other=0.0)
        b_plse = tl.load(PLSE + prow, mask=m_t, other=0.0)
        if PREFETCH:  # the next chunk's entries load while this one computes
            nxt = item_rows(PERM, c + BT, e1, Hs * K, K, BT, G2, G2P)
            nxt1 = item_rows(PERM, c + BT, e1, Hs * K, K, BT, 1, 1)
        b_tgt = teacher(  # [BT, BN]
            Q, LSE, Kt, b_k0, tr, hj, m_r, tr_pos, kpos, kpos, m_k, p, scale,
            H, Hkv, D, G, G2, G2P, R, BT, BN, PREC,
        )  # fmt: skip
        kl_acc, b_diff = proxy_step(
            kl_acc, b_tgt, b_qp, b_kp, b_plse, m_t, t_pos, kpos, m_k, pscale, KL_VALUE, GRAD, PREC
        )
        if GRAD:
            b_dqp = tl.dot(b_diff, b_kp, input_precision=PREC) * (coef * pscale)  # [BT, Dp]
            if DETERMINISTIC:  # the row's own partial: (token, head, slot, key part)
                part = (((t - tok0) * (P1 - P0) + p - P0) * K + slot) * S + sub
                tl.store(DQP + part[:, None] * Dp + o_dp[None, :], b_dqp, mask=m_t[:, None])
            else:
                p_dqp = DQP + prow[:, None] * Dp + o_dp[None, :]
                tl.atomic_add(p_dqp, b_dqp, mask=m_t[:, None], sem="relaxed")
            b_dkp += tl.dot(tl.trans(b_diff), b_qp, input_precision=PREC)
    if KL_VALUE:
        tl.store(KL_PART + w * tl.num_programs(1) + sub, tl.sum(kl_acc, axis=0))
    if GRAD:
        if DETERMINISTIC:  # this item's tile
            k_row = (w * S + sub) * BN + tl.arange(0, BN)
            p_part = DKP + k_row.to(tl.int64)[:, None] * Dp + o_dp[None, :]
            tl.store(p_part, b_dkp * (coef * pscale), mask=m_k[:, None])
        else:
            p_dkp = DKP + (kpos * Hpk + pk)[:, None] * Dp + o_dp[None, :]
            tl.atomic_add(p_dkp, b_dkp * (coef * pscale), mask=m_k[:, None], sem="relaxed")


# (rows, BN, PREFETCH[, stages]) candidates of the proxy pass, in order of preference (tiles.py
# picks the first that compiles without spills within the shared memory): MMA rows per token
# chunk, keys per program (a key block is split over block // BN programs; each re-gathers the
# block's query rows), whether the next chunk's PERM entries load one iteration ahead (it costs
# registers), and software-pipelining stages (default: the caller's ``num_stages``, 1). The
# last two are for mma.sync targets (sm_80 to sm_120; Triton 3.9, D = 128), where the MMA
# operands pass through registers: with 2 stages they are copied to shared memory by cp.async
# instead. At the paper layout (G = 16 heads per selection head) every earlier entry spills on
# sm_80/89/120; 256 rows keep the teacher's heads in one KV sub-group (R = 1: one key tile, not
# R unrolled loads): 160-252 registers, 85-91 KB on sm_80/89/100/120. With Hs < Hkv (R = 2 at
# any rows) 64 x 32 keys at 2 stages fit (192-227 registers, 83-91 KB). docs/algorithm.md,
# "GPUs with less shared memory". The last, 64 x 16 keys, is for fp32 inputs (IEEE products,
# twice bf16's bytes per tile): at the paper layout, D = 128, the KL value alone needs
# 120-360 KB with every earlier entry (so none fits sm_86/89/120's 99 KB) and 80 KB with it
# (Triton 3.9, the LLVM IR's count, the same on every target: fp32 has no MMA).
PROXY_TILES = (
    (128, 128, True), (128, 128, False), (128, 64, True), (128, 64, False), (64, 128, True),
    (64, 64, True), (64, 64, False), (128, 32, True), (32, 64, True), (64, 32, True),
    (32, 32, True), (256, 16, False, 2), (64, 32, False, 2), (64, 16, True),
)  # fmt: skip


SIGNATURE = dict(  # runtime-argument types, for compile checks without a GPU (bf16 inputs)
    {k: "*bf16" for k in ("Q", "Kt", "QP", "KP")},
    LSE="*fp32",
    PLSE="*fp32",
    DKL="*fp32",
    PERM="*i64",
    **{k: "*i32" for k in ("ITEM_LIST", "BLK_START", "BLK_END")},
    ITEM_START="*i64",
    ITEM_END="*i64",
    NB="i32",
    QMAP="*i32",  # a constexpr None without a query map (compile_check passes QMAP=None)
    KL_PART="*fp32",
    DQP="*fp32",
    DKP="*fp32",
    TOK0="*i64",
    scale="fp32",
    pscale="fp32",
    inv_rows="fp32",
    P0="i32",
    P1="i32",
)


def launch(
    q,
    k,
    q_proxy,
    k_proxy,
    lse,
    proxy_lse,
    wl,
    cfg,
    *,
    kl_value=False,
    dkl=None,
    dqp=None,
    dkp=None,
    num_stages=1,
    deterministic=False,
    tok0=None,
    tables=tiles.SHIPPED,
):
    """Run the proxy pass over work list ``wl``: with ``kl_value``, returns the fp32 KL partials
    (one per program; their sum is the item's KL sum), and/or adds the gradients to
    ``dqp``/``dkp`` (fp32) when ``dkl`` is given.

    ``deterministic``: the gradients are added in a fixed order (ordered.py) instead of by fp32
    atomics: per slice of selection heads (so that the dQ_proxy row partials ``(C, heads, K *
    S, Dp)`` of the work list's C tokens fit ``ordered.PARTIAL_BYTES``) and per range of work
    items (the dK_proxy tiles ``(items, block, Dp)``, likewise), launch, add the range's tiles
    into ``dkp``, then the slice's rows into ``dqp``. ``tok0`` (``(1,)`` int64 on the device)
    is the chunk's first token, computed from ``wl`` when not given. ``tables.proxy``: the tile
    candidates (default :data:`PROXY_TILES`)."""
    T, H, D = q.shape
    Hs, Dp = q_proxy.shape[1:]
    Hpk = k_proxy.shape[1]
    grad = dkl is not None
    ordered_sums = deterministic and grad  # the KL value alone has no atomics
    block = cfg.block_size
    cands = tiles.fitting(PROXY_TILES if tables.proxy is None else tables.proxy, block)
    kl_part = lse  # a dummy pointer without the KL value
    if kl_value:
        most = wl.num_items * (block // min(t[1] for t in cands))  # programs at the smallest BN
        kl_part = torch.zeros(most, dtype=torch.float32, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    stub = torch.empty(4, **f32) if ordered_sums else None  # partial pointers, for the pick

    def args(w0=0, w1=wl.num_items, dqp=dqp, dkp=dkp, tok0=wl.perm, p0=0, p1=Hs):
        return (
            q, k, q_proxy, k_proxy, lse, proxy_lse, dkl if grad else lse,
            wl.perm, wl.item_list[w0:w1], wl.item_start[w0:w1], wl.item_end[w0:w1],
            wl.block_start, wl.block_end, wl.q_map,
            kl_part[w0 * splits :] if kl_value else kl_part,
            dqp if grad else lse, dkp if grad else lse, tok0,
            cfg.softmax_scale, cfg.proxy_scale, 1.0 / (Hs * T), p0, p1,
        )  # fmt: skip

    def options(tile):
        rows, BN, prefetch, *stages = tile  # stages: PROXY_TILES' optional 4th entry
        G, G2, G2P, R, BT = padded_geometry(H, k.shape[1], Hs, rows)
        return dict(
            H=H, Hkv=k.shape[1], Hs=Hs, Hpk=Hpk, K=wl.slots, D=D,
            Dp=Dp, G=G, G2=G2, G2P=G2P, R=R, BN=BN, BT=BT, NB=wl.num_blocks,
            KL_VALUE=kl_value, GRAD=grad,
            PREC="ieee" if q.dtype.itemsize == 4 else "tf32", PREFETCH=prefetch,
            DETERMINISTIC=ordered_sums, HAS_QMAP=wl.q_map is not None, num_warps=8,
            num_stages=stages[0] if stages else num_stages,
        )  # fmt: skip

    key = (q.dtype, H, k.shape[1], Hs, Hpk, wl.slots, D, Dp, block, kl_value, grad)
    key += (num_stages, ordered_sums, wl.q_map is not None)
    splits = 1  # (args() reads it for the KL partials' offset)
    pick_args = args(dqp=stub, dkp=stub) if ordered_sums else args()
    tile = tiles.pick(_proxy_kernel, pick_args, cands, options, key)
    splits = block // tile[1]
    if not ordered_sums:
        _proxy_kernel[(wl.num_items, splits)](*args(), **options(tile))
    else:
        K = wl.slots
        C = wl.perm.numel() // (Hs * K)  # the work list's tokens
        tok0 = ordered.first_token(wl) if tok0 is None else tok0
        heads = max(1, min(Hs, ordered.PARTIAL_BYTES // (C * K * splits * Dp * 4)))
        ranges = ordered.item_ranges(wl.num_items, block * Dp * 4)
        items = ordered.list_items(wl)
        k_part = torch.empty((max(w1 - w0 for w0, w1 in ranges), 1, block, Dp), **f32)
        for p0 in range(0, Hs, heads):
            p1 = min(Hs, p0 + heads)
            part = torch.zeros((C, p1 - p0, K * splits, Dp), **f32)  # unused slots: 0
            for w0, w1 in ranges:
                run = args(w0, w1, part, k_part, tok0, p0, p1)
                _proxy_kernel[(w1 - w0, splits)](*run, **options(tile))
                ordered.item_sum((k_part,), (dkp,), items, w0, w1, wl, groups=Hs // Hpk,
                                 per_item=1, heads=(p0, p1))  # fmt: skip
            ordered.slot_sum(part, dqp, tok0, slots=K, parts=splits, h0=p0, accumulate=True)
    return kl_part[: wl.num_items * splits] if kl_value else None


def kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit=None, *, tables=tiles.SHIPPED):
    """Driver stage ``kl`` (flash_msa.sparse_forward): the fp32 sum of the per-row KL terms of
    work list ``wl``'s rows; with ``unit = (dq_proxy, dk_proxy)`` it also adds the proxy gradient
    for ``dkl = 1`` there (the same pass: the scores are computed once; in a fixed order with
    ``cfg.deterministic``)."""
    grad = {}
    if unit is not None:
        one = torch.ones((), dtype=torch.float32, device=q.device)
        grad = dict(dkl=one, dqp=unit[0], dkp=unit[1])
    return launch(
        q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, kl_value=True,
        deterministic=cfg.deterministic, tables=tables, **grad,
    ).sum()  # fmt: skip
