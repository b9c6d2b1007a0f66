"""Sparse main forward (key-outer), proxy LSE and the KL value.

Layout (see worklist.py): one program per work item = (selection head p, key block, up to TW
query tokens that kept the block). The program loads the key block's K/V tile once per KV head
and streams its tokens BT at a time; the G2 main heads of a token that share a KV head are
packed into the MMA's M dimension (BM = BT * G2P rows, row r = token r // G2P, head r % G2P;
G2P is G2 padded to a power of two, the padded rows masked: worklist.padded_geometry).

Because a query's keys are split over its K kept blocks, the forward writes one partial
(normalized o, lse) per (token, head, slot) and a combine kernel merges the K partials by their
LSE. The proxy LSE over the kept keys is built the same way.

Each token loop loads the next chunk's entries of ``PERM`` before computing the current chunk
(``nxt``): a gathered row then costs one dependent global-memory round trip instead of two
(H200, anchor 16K: forward kernel 2.31 ms with it, 2.41 ms without; the sparse backward does
not prefetch, sparse_bwd.py says why).

The KL value needs the final LSEs, so it is a second pass over the same work items (proxy.py:
recomputing the scores, no stored P); in training it also makes the proxy gradient.

Query map (``HAS_QMAP``, context parallelism; the work list's ``q_map``): a work-list entry's
token is a query row (it addresses ``q``, ``q_proxy`` and the partials), and the
causal limit compares the block's keys with the row's token ``QMAP[row]`` instead of the row
itself: one extra load per MMA row. Without a map ``QMAP`` is ``None`` (a constexpr) and the
map's loads compile away.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import sparse_forward
from ..problem import Config
from ..worklist import padded_geometry
from . import proxy, tiles
from .common import finish_lse, item_block, item_rows, proxy_chunk, row_exp


@triton.jit
def _fwd_kernel(
    Q,
    Kt,
    V,
    QP,
    KP,  # q [T,H,D], k/v [T,Hkv,D], q_proxy [T,Hs,Dp], k_proxy [T,Hpk,Dp]
    PERM,
    ITEM_LIST,
    ITEM_START,
    ITEM_END,
    BLK_START,
    BLK_END,  # work list
    QMAP,  # [Tq] int32: each query row's packed key token (HAS_QMAP), else None
    O_PART,
    L_PART,
    PL_PART,  # [C,H,K,D] input dtype, [C,H,K] f32, [C,Hs,K] f32 for tokens tok0 .. tok0 + C
    scale,
    pscale,
    tok0,
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
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    NB,  # runtime: it changes with the number of packed sequences
    HAS_PROXY: tl.constexpr,
    PREC: tl.constexpr,
    HAS_MAIN: tl.constexpr = True,  # False: only the proxy LSE partials (another kernel did O)
    OUT_SPLIT: tl.constexpr = 1,  # O = P V in column slices (fewer live registers)
    HAS_QMAP: tl.constexpr = False,  # queries are rows of QMAP (causality from their tokens)
):
    w = tl.program_id(0)
    e0 = tl.load(ITEM_START + w)
    e1 = tl.load(ITEM_END + w)
    if e0 >= e1:
        return
    p, kpos, m_k = item_block(ITEM_LIST, BLK_START, BLK_END, w, NB, BLOCK)
    o_d = tl.arange(0, D)
    if HAS_MAIN:
        for r in tl.static_range(R):
            h0 = p * G + r * G2  # first main head of this KV sub-group
            kvh = h0 // (H // Hkv)
            p_kv = (kpos * Hkv + kvh)[:, None] * D + o_d[None, :]
            b_k = tl.load(Kt + p_kv, mask=m_k[:, None], other=0.0)  # [BLOCK, D]
            b_v = tl.load(V + p_kv, mask=m_k[:, None], other=0.0)
            nxt = item_rows(PERM, e0, e1, Hs * K, K, BT, G2, G2P)
            for c in range(e0, e1, BT):
                qrow, slot, hj, m_r = nxt
                t = qrow  # the query's packed key position (causality)
                if HAS_QMAP:
                    t = tl.load(QMAP + qrow, mask=m_r, other=0).to(tl.int64)
                row = qrow * H + h0 + hj  # [BM] (token, head)
                b_q = tl.load(Q + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
                # the next chunk's entries load while this one computes
                nxt = item_rows(PERM, c + BT, e1, Hs * K, K, BT, G2, G2P)
                b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale  # [BM, BLOCK]
                keep = m_k[None, :] & (kpos[None, :] <= t[:, None])
                b_s = tl.where(keep, b_s, float("-inf"))
                b_m, b_p, b_l = row_exp(b_s)  # [BM], [BM, BLOCK], [BM]
                b_lse = finish_lse(b_m, b_l)
                part = ((qrow - tok0) * H + h0 + hj) * K + slot  # chunk-local partial row
                b_pv = b_p.to(b_v.dtype)
                b_inv = 1.0 / tl.where(b_l == 0, 1.0, b_l)
                if OUT_SPLIT == 1:
                    b_o = tl.dot(b_pv, b_v, input_precision=PREC) * b_inv[:, None]  # [BM, D]
                    p_o = O_PART + part[:, None] * D + o_d[None, :]
                    tl.store(p_o, b_o.to(O_PART.dtype.element_ty), mask=m_r[:, None])
                else:  # O = P V in column slices of V (reloaded: L1/L2 hits), fewer registers
                    for j in tl.static_range(OUT_SPLIT):
                        o_j = j * (D // OUT_SPLIT) + tl.arange(0, D // OUT_SPLIT)
                        p_vj = V + (kpos * Hkv + kvh)[:, None] * D + o_j[None, :]
                        b_vj = tl.load(p_vj, mask=m_k[:, None], other=0.0)
                        b_o = tl.dot(b_pv, b_vj, input_precision=PREC) * b_inv[:, None]
                        p_o = O_PART + part[:, None] * D + o_j[None, :]
                        tl.store(p_o, b_o.to(O_PART.dtype.element_ty), mask=m_r[:, None])
                tl.store(L_PART + part, b_lse, mask=m_r)
    if HAS_PROXY:
        o_dp = tl.arange(0, Dp)
        # the key tile stays spelled out: loaded by a helper (common.load_rows), its inlined
        # line info moved ptxas's register allocation (same PTX, another SASS at Hs<Hkv
        # D=128)
        pk = p // (Hs // Hpk)
        b_kp = tl.load(
            KP + (kpos * Hpk + pk)[:, None] * Dp + o_dp[None, :], mask=m_k[:, None], other=0.0
        )  # [BLOCK, Dp]
        nxt = item_rows(PERM, e0, e1, Hs * K, K, BT, 1, 1)
        for c in range(e0, e1, BT):
            b_z, qrow, slot, t, m_t, nxt = proxy_chunk(
                QP, QMAP, PERM, b_kp, nxt, p, c, e1, o_dp, Hs, K, BT, PREC, HAS_QMAP
            )  # [BT, BLOCK]: q_proxy k_proxy^T
            b_z = b_z * pscale
            b_z = tl.where(m_k[None, :] & (kpos[None, :] <= t[:, None]), b_z, float("-inf"))
            b_m, _, b_l = row_exp(b_z)
            b_lse = finish_lse(b_m, b_l)
            tl.store(PL_PART + ((qrow - tok0) * Hs + p) * K + slot, b_lse, mask=m_t)


@triton.jit
def _combine_kernel(
    O_PART,
    L_PART,
    IDX,
    OUT,
    LSE,  # partials, indices [T,Hs,K], out [T,H,D], lse [T,H]
    H: tl.constexpr,
    Hs: tl.constexpr,
    K: tl.constexpr,
    KP2: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    HB: tl.constexpr,
    HAS_O: tl.constexpr,
):
    """Merge the K partials of HB (token, head) rows by their LSE (also: the proxy LSE)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    m_h = h < H
    o_s = tl.arange(0, KP2)
    m_s = m_h[:, None] & (o_s < K)[None, :]
    ids = tl.load(IDX + (t * Hs + h[:, None] // G) * K + o_s[None, :], mask=m_s, other=-1)
    valid = ids >= 0  # [HB, KP2]
    p_l = L_PART + (t * H + h[:, None]) * K + o_s[None, :]
    b_lse = tl.load(p_l, mask=valid, other=float("-inf"))
    b_m, b_w, b_l = row_exp(b_lse)  # b_w: 0 for unused slots and empty partials
    tl.store(LSE + t * H + h, finish_lse(b_m, b_l), mask=m_h)
    if HAS_O:
        o_d = tl.arange(0, D)
        p_o = (
            O_PART + ((t * H + h[:, None, None]) * K + o_s[None, :, None]) * D + o_d[None, None, :]
        )
        m_o = (valid & (b_w > 0))[:, :, None]
        b_o = tl.load(p_o, mask=m_o, other=0.0).to(tl.float32)  # [HB, KP2, D]
        b_safe = tl.where(b_l == 0, 1.0, b_l)
        b_out = tl.sum(b_w[:, :, None] * b_o, axis=1) / b_safe[:, None]  # [HB, D]
        p_out = OUT + (t * H + h[:, None]) * D + o_d[None, :]
        tl.store(p_out, b_out.to(OUT.dtype.element_ty), mask=m_h[:, None])


# ---------------------------------------------------------------------------------------------
# host
# ---------------------------------------------------------------------------------------------
_WL = dict(
    ITEM_LIST="*i32", BLK_START="*i32", BLK_END="*i32", ITEM_START="*i64", ITEM_END="*i64", NB="i32"
)
SIGNATURE = {  # runtime-argument types, for compile checks without a GPU (bf16 inputs)
    "fwd": dict(
        {k: "*bf16" for k in ("Q", "Kt", "V", "QP", "KP")},
        PERM="*i64",
        **_WL,
        QMAP="*i32",  # a constexpr None without a query map (compile_check passes QMAP=None)
        O_PART="*bf16",
        L_PART="*fp32",
        PL_PART="*fp32",
        scale="fp32",
        pscale="fp32",
        tok0="i32",
    ),
    "combine": dict(O_PART="*bf16", L_PART="*fp32", IDX="*i32", OUT="*bf16", LSE="*fp32"),
}


# (rows, OUT_SPLIT[, warps]) candidates of the main forward, in order of preference (tiles.py
# picks the first that compiles without spills within the shared memory): MMA rows per token
# chunk, column slices of O = P V, warps (default 8). The last entry is for sm_80: at the paper
# layout, D = 64, block 128 every 8-warp tile spills 16-48 bytes there (Triton 3.9; sm_86/89/
# 120 take 128 rows with O in 4 slices); 32 rows with 4 warps do not (215 registers, 40 KB).
FWD_TILES = ((128, 1), (128, 4), (128, 2), (64, 1), (64, 4), (64, 2), (32, 1), (32, 1, 4))
# the same for D = 256 (K and V tiles [block, 256]): at block 128 every 128- and 64-row entry
# of FWD_TILES spills on sm_90 (Triton 3.9) but for 32 rows on mma.sync; O in 8 slices of 32
# columns does not (241 registers, 128 KB), nor 4 slices at block 64 (254, 96 KB)
FWD_TILES_WIDE = ((128, 4), (128, 8), (64, 4, 4), (32, 1), (32, 1, 4))


def fwd_tiles(has_main: bool, table=None, D: int = 128) -> tuple[tuple[int, ...], ...]:
    """The forward's candidates (``table``, default :data:`FWD_TILES`, at ``D = 256``
    :data:`FWD_TILES_WIDE`); without the main pass (another kernel makes it) ``OUT_SPLIT``
    changes nothing, so only the row counts (and warps) remain."""
    if table is None:
        table = FWD_TILES if D <= 128 else FWD_TILES_WIDE
    if has_main:
        return table
    return tuple(dict.fromkeys((t[0], 1, *t[2:]) for t in table))


FWD_STAGES = 1  # software-pipelining stages of the main forward


def combine_heads(H: int, K: int, D: int = 128) -> int:
    """Heads merged per combine program: an [HB, K, D] tile of ~16K elements at D <= 128 (no
    spills), half as many heads at D = 256."""
    wide = max(1, D // 128)
    return max(1, min(triton.next_power_of_2(H), 128 // triton.next_power_of_2(K) // wide))


def partials(
    q, k, v, wl, o_part, l_part, cfg: Config, tok0: int, proxy=None, *, tables=tiles.SHIPPED
):  # fmt: skip
    """Driver stage ``partials`` (flash_msa.sparse_forward): the main partials of work list
    ``wl`` and, with ``proxy = (q_proxy, k_proxy, pl_part)``, the proxy LSE partials in the same
    launch."""
    _launch(q, k, v, wl, cfg, tok0, (o_part, l_part), proxy, tables)


def proxy_partials(
    q, k, q_proxy, k_proxy, wl, pl_part, cfg: Config, tok0: int, *, tables=tiles.SHIPPED
):  # fmt: skip
    """Driver stage ``proxy_partials``: the proxy LSE partials alone (another kernel made the
    main partials)."""
    _launch(q, k, None, wl, cfg, tok0, None, (q_proxy, k_proxy, pl_part), tables)


def _launch(q, k, v, wl, cfg: Config, tok0: int, main, proxy, tables: tiles.Tables):
    """One ``_fwd_kernel`` launch over ``wl``: ``main = (o_part, l_part)`` or ``None``,
    ``proxy = (q_proxy, k_proxy, pl_part)`` or ``None``; absent buffers are dummy pointers;
    the tile candidates of ``tables.fwd`` (default :data:`FWD_TILES`)."""
    T, H, D = q.shape
    Hkv, Hs, K = k.shape[1], wl.heads, wl.slots
    qp, kp, pl_part = proxy if proxy is not None else (q, k, None)
    # absent buffers: pointers of the types the compile check's SIGNATURE names (input dtype
    # for O_PART, fp32 for L_PART), so the proxy-only launch is the binary it checks
    o_part, l_part = main if main is not None else (q, pl_part)
    pl_part = l_part if pl_part is None else pl_part
    v = q if v is None else v
    Dp = qp.shape[2] if proxy is not None else 16
    Hpk = kp.shape[1] if proxy is not None else 1
    has_main = main is not None
    has_qmap = wl.q_map is not None  # (without a map QMAP is None: a constexpr, no parameter)
    args = (
        q, k, v, qp, kp, wl.perm, wl.item_list, wl.item_start, wl.item_end, wl.block_start,
        wl.block_end, wl.q_map, o_part, l_part, pl_part, cfg.softmax_scale,
        cfg.proxy_scale or 1.0, tok0,
    )  # fmt: skip
    prec = "ieee" if q.dtype == torch.float32 else "tf32"

    def options(tile):
        rows, split, *warps = tile  # warps: FWD_TILES' optional 3rd entry
        G, G2, G2P, R, BT = padded_geometry(H, Hkv, Hs, rows)
        return dict(
            H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, K=K, D=D, Dp=Dp, G=G, G2=G2, G2P=G2P, R=R,
            BLOCK=cfg.block_size, BT=BT, NB=wl.num_blocks, PREC=prec,
            HAS_PROXY=proxy is not None, HAS_MAIN=has_main,
            OUT_SPLIT=split, HAS_QMAP=has_qmap, num_warps=warps[0] if warps else 8,
            num_stages=FWD_STAGES,
        )  # fmt: skip

    key = (q.dtype, H, Hkv, Hs, Hpk, K, D, Dp, cfg.block_size, proxy is not None, has_main)
    key += (has_qmap,)
    cands = fwd_tiles(has_main, tables.fwd, D)
    tile = tiles.pick(_fwd_kernel, args, cands, options, (*key, FWD_STAGES))
    _fwd_kernel[(wl.num_items,)](*args, **options(tile))


def combine(o_part, l_part, idx, out, lse):
    """Driver stage ``combine``: merge the chunk's partials into ``out`` and ``lse``; with
    ``o_part`` and ``out`` ``None``, the proxy LSE partials into ``lse`` (the proxy LSE)."""
    C, Hs, K = idx.shape
    H = lse.shape[1]
    has_o = o_part is not None
    D = out.shape[-1] if has_o else 16
    HB = combine_heads(H, K, D)
    _combine_kernel[(C, triton.cdiv(H, HB))](
        o_part if has_o else l_part, l_part, idx, out if has_o else lse, lse,
        H=H, Hs=Hs, K=K, KP2=max(2, triton.next_power_of_2(K)), D=D, G=H // Hs, HB=HB,
        HAS_O=has_o,
    )  # fmt: skip


def forward_stages(tables: tiles.Tables = tiles.SHIPPED) -> sparse_forward.Stages:
    """This backend's stages of the sparse-forward driver (:mod:`flash_msa.sparse_forward`):
    one kernel makes the main and the proxy LSE partials; the KL pass also makes the proxy
    gradient for ``dkl = 1`` when the step will need it. They run calls with a query map.
    ``tables``: the tile candidates they pick from (:class:`~flash_msa.triton_ref.tiles.Tables`)."""
    return sparse_forward.Stages(
        partials=functools.partial(partials, tables=tables),
        partials_make_proxy=True,
        proxy_partials=functools.partial(proxy_partials, tables=tables),
        combine=combine,
        kl=functools.partial(proxy.kl, tables=tables),
        kl_makes_proxy_grad=True,
        q_map=True,  # every stage reads wl.q_map (the combine needs none: it works per row)
    )


def fwd(
    q, k, v, indices, cu_seqlens, cfg: Config, q_proxy=None, k_proxy=None, proxy_grad=False, *,
    q_map=None, tables: tiles.Tables = tiles.SHIPPED,
):  # fmt: skip
    """Backend op ``fwd`` for given indices (not warmup): the sparse-forward driver
    (:func:`flash_msa.sparse_forward.fwd`) with this backend's stages; ``q_map`` as there."""
    return sparse_forward.fwd(
        forward_stages(tables), q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad,
        q_map=q_map,
    )  # fmt: skip
