"""Sparse backward (key-outer): main dQ/dK/dV, then the proxy pass for the KL gradient.

Same work items as the forward (worklist.py). A program owns (selection head p, key block, up to
TW tokens); for each sub-group of G2 heads sharing a KV head it keeps the block's dK/dV in
registers over its tokens and adds them to fp32 buffers once; dQ rows are added with fp32
atomics (a query's gradient arrives from its K kept blocks). Probabilities are rebuilt from the
saved LSE; indices are reused, never recomputed. Where G2 is not a power of two the MMA rows
hold G2P (padded) head slots per token: a padded slot's row mask is False, so its dO, delta
and P are 0 (dS = 0: it adds exactly 0 to dK/dV) and no dQ atomic or store targets it.

The proxy gradient (closed form, only when the KL receives a gradient) is usually made by the
forward: its KL-value pass also accumulates the gradient for ``dkl = 1`` (``Saved.proxy_grad``),
which is only scaled here. Otherwise (``compute_kl=False``, or a forward that did not make it)
proxy.py's pass runs over this work list. Fusing it into the main kernel below would save
recomputing the group's scores, but that kernel's operand tiles plus a third accumulator exceed
the registers and 227 KB of shared memory (Triton 3.6).

The token loop loads each chunk's ``PERM`` entries at the top of its iteration, not one
iteration ahead as the forward does: prefetched, the main backward took 6.53 ms instead of
4.26 ms on the H200 at anchor 16K (benchmarks/tune_triton.py).

Deterministic mode (``cfg.deterministic``, :func:`_ordered`): the same kernel with
``DETERMINISTIC`` stores its dQ rows and dK/dV tiles into partial buffers instead of adding them
by atomics, over query chunks and item ranges, and ordered.py's kernels add them in a fixed
order; ``DETERMINISTIC`` is a constexpr, so the default path's (:func:`_atomic`) code has none
of it.

Query map (``q_map``, context parallelism; ``HAS_QMAP``): ``q``, ``dout``, ``lse``, ``dq`` (and
the proxy's query side) have ``Tq`` rows, ``k``, ``v``, ``dk``, ``dv`` (``k_proxy``,
``dk_proxy``) the keys' ``T``; the work list's entries are query rows and causality compares
the keys with the rows' tokens ``QMAP[row]``. Without a map ``QMAP`` is ``None`` (a constexpr):
the map's loads compile away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ordered, worklist
from ..problem import Config, Grads, Saved, row_delta
from ..worklist import ITEM_TOKENS, padded_geometry
from . import proxy as proxy_pass
from . import tiles
from .common import item_block, item_rows, probs


@triton.jit
def _bwd_kernel(
    Q,
    Kt,
    V,
    DO,
    DELTA,
    LSE,
    PERM,
    ITEM_LIST,
    ITEM_START,
    ITEM_END,
    BLK_START,
    BLK_END,
    QMAP,  # [Tq] int32: each query row's packed key token (HAS_QMAP), else None
    DQ,
    DK,
    DV,  # fp32, zero-initialized (DETERMINISTIC: the partial buffers below)
    TOK0,  # (1,) int64: first token of the chunk (DETERMINISTIC only)
    scale,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,  # G2 padded to a power of two (worklist.padded_geometry)
    R: tl.constexpr,
    BN: tl.constexpr,  # keys per program: the block's part program_id(1) (BN <= block size)
    BT: tl.constexpr,
    NB,  # runtime: it changes with the number of packed sequences
    PREC: tl.constexpr,
    DQ_SPLIT: tl.constexpr,  # dQ = dS K in DQ_SPLIT column slices (fewer live registers)
    # stores instead of fp32 atomics (ordered.py): DQ is the chunk's row partials [C, H, K * S,
    # D] and DK / DV the item range's key-tile partials [items, R, S * BN, D], S = programs
    # per key block (program_id(1))
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
    o_d = tl.arange(0, D)
    if DETERMINISTIC:
        S = tl.num_programs(1)
        tok0 = tl.load(TOK0)
    for r in tl.static_range(R):
        h0 = p * G + r * G2
        kvh = h0 // (H // Hkv)
        p_kv = (kpos * Hkv + kvh)[:, None] * D + o_d[None, :]
        b_k = tl.load(Kt + p_kv, mask=m_k[:, None], other=0.0)  # [BN, D]
        b_v = tl.load(V + p_kv, mask=m_k[:, None], other=0.0)
        b_dk = tl.zeros([BN, D], tl.float32)
        b_dv = tl.zeros([BN, D], tl.float32)
        for c in range(e0, e1, BT):
            t, slot, hj, m_r = item_rows(PERM, c, e1, Hs * K, K, BT, G2, G2P)
            t_pos = t  # the query's packed key position (causality)
            if HAS_QMAP:
                t_pos = tl.load(QMAP + t, mask=m_r, other=0).to(tl.int64)
            row = t * H + h0 + hj
            if DETERMINISTIC:  # the row's own partial: (token, head, slot, key part)
                dq_row = (((t - tok0) * H + h0 + hj) * K + slot) * S + sub
            b_do = tl.load(DO + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
            b_delta = tl.load(DELTA + row, mask=m_r, other=0.0)
            b_p, b_q = probs(Q, LSE, b_k, row, m_r, t_pos, kpos, m_k, scale, D, PREC)  # [BM, BN]
            b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)  # [BM, BN]
            b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
            if DQ_SPLIT == 1:
                b_dq = tl.dot(b_ds, b_k, input_precision=PREC) * scale
                if DETERMINISTIC:
                    tl.store(DQ + dq_row[:, None] * D + o_d[None, :], b_dq, mask=m_r[:, None])
                else:
                    tl.atomic_add(
                        DQ + row[:, None] * D + o_d[None, :], b_dq, mask=m_r[:, None], sem="relaxed"
                    )
            else:
                for j in tl.static_range(DQ_SPLIT):
                    o_j = j * (D // DQ_SPLIT) + tl.arange(0, D // DQ_SPLIT)
                    p_kj = (kpos * Hkv + kvh)[:, None] * D + o_j[None, :]
                    b_kj = tl.load(Kt + p_kj, mask=m_k[:, None], other=0.0)
                    b_dq = tl.dot(b_ds, b_kj, input_precision=PREC) * scale
                    if DETERMINISTIC:
                        p_dq = DQ + dq_row[:, None] * D + o_j[None, :]
                        tl.store(p_dq, b_dq, mask=m_r[:, None])
                    else:
                        p_dq = DQ + row[:, None] * D + o_j[None, :]
                        tl.atomic_add(p_dq, b_dq, mask=m_r[:, None], sem="relaxed")
            b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
        if DETERMINISTIC:  # this item's tile of sub-group r
            k_row = (w * R + r) * (S * BN) + sub * BN + tl.arange(0, BN)
            p_part = k_row.to(tl.int64)[:, None] * D + o_d[None, :]
            tl.store(DK + p_part, b_dk * scale, mask=m_k[:, None])
            tl.store(DV + p_part, b_dv, mask=m_k[:, None])
        else:
            tl.atomic_add(DK + p_kv, b_dk * scale, mask=m_k[:, None], sem="relaxed")
            tl.atomic_add(DV + p_kv, b_dv, mask=m_k[:, None], sem="relaxed")


SIGNATURE = dict(  # runtime-argument types, for compile checks without a GPU (bf16 inputs)
    {k: "*bf16" for k in ("Q", "Kt", "V", "DO")},
    DELTA="*fp32",
    LSE="*fp32",
    PERM="*i64",
    **{k: "*i32" for k in ("ITEM_LIST", "BLK_START", "BLK_END")},
    ITEM_START="*i64",
    ITEM_END="*i64",
    NB="i32",
    QMAP="*i32",  # a constexpr None without a query map (compile_check passes QMAP=None)
    **{k: "*fp32" for k in ("DQ", "DK", "DV")},
    TOK0="*i64",
    scale="fp32",
)

# (rows, BN, DQ_SPLIT) candidates of the main backward, in order of preference (tiles.py picks
# the first that compiles without spills): MMA rows per token chunk, keys per program (a key
# block is split over block // BN programs; each re-gathers the block's query rows), column
# slices of the dQ product (fewer live registers)
BWD_TILES = (
    (128, 128, 1), (128, 64, 1), (128, 64, 2), (128, 64, 4), (64, 64, 1), (64, 64, 4),
    (128, 32, 1), (32, 64, 1), (64, 32, 1), (32, 32, 1),
)  # fmt: skip


BWD_STAGES = 1  # software-pipelining stages of both loops


def _main_args(q, k, v, dout, delta, lse, wl, dq, dk, dv, tok0, cfg: Config, w0=0, w1=None):
    """The main kernel's runtime arguments over items ``w0 .. w1`` of ``wl`` (its item arrays
    sliced: program ``w`` runs item ``w0 + w``)."""
    w1 = wl.num_items if w1 is None else w1
    return (
        q, k, v, dout, delta, lse, wl.perm, wl.item_list[w0:w1], wl.item_start[w0:w1],
        wl.item_end[w0:w1], wl.block_start, wl.block_end, wl.q_map, dq, dk, dv, tok0,
        cfg.softmax_scale,
    )  # fmt: skip


def _main_tile(q, k, wl, cfg: Config, args, deterministic: bool, tables: tiles.Tables):
    """``(tile, options)`` of the main kernel: the first spill-free candidate of
    ``tables.bwd`` (default :data:`BWD_TILES`; tiles.py) and its launch keywords."""
    T, H, D = q.shape
    Hkv, Hs, K = k.shape[1], wl.heads, wl.slots

    def options(tile):
        rows, BN, split = tile
        G, G2, G2P, R, BT = padded_geometry(H, Hkv, Hs, rows)
        return dict(
            H=H, Hkv=Hkv, Hs=Hs, K=K, D=D, G=G, G2=G2, G2P=G2P, R=R, BN=BN, BT=BT, DQ_SPLIT=split,
            NB=wl.num_blocks, PREC="ieee" if q.dtype == torch.float32 else "tf32",
            DETERMINISTIC=deterministic, HAS_QMAP=has_qmap, num_warps=8,
            num_stages=BWD_STAGES,
        )  # fmt: skip

    has_qmap = wl.q_map is not None
    key = (q.dtype, H, Hkv, Hs, K, D, cfg.block_size, BWD_STAGES, deterministic, has_qmap)
    cands = tiles.fitting(BWD_TILES if tables.bwd is None else tables.bwd, cfg.block_size)
    return tiles.pick(_bwd_kernel, args, cands, options, key), options


def bwd(
    dout, dkl, saved: Saved, cu_seqlens, cfg: Config, *, q_map=None,
    tables: tiles.Tables = tiles.SHIPPED,
) -> Grads:  # fmt: skip
    """Backend op ``bwd`` (contract in docs/design.md) for given indices (not warmup).

    ``q_map``: ``None`` or the forward's ``(Tq,)`` int32 query map: ``dq``/``dq_proxy`` then
    have ``Tq`` rows (0 for a padding row), ``dk``/``dv``/``dk_proxy`` the keys' ``T``.

    The work list is cut from the forward's sorted lists when ``saved`` carries them
    (:func:`flash_msa.worklist.carried`; deterministic mode: when it runs in one chunk), else
    built here. ``tables``: the tile candidates (:class:`~flash_msa.triton_ref.tiles.Tables`)."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, unit = saved
    main, proxy = dout is not None, dkl is not None
    if not (main or proxy):
        return Grads(None, None, None, None, None)
    proxy_pass_needed = proxy and unit is None
    kept = worklist.carried(saved)  # the forward's sorted lists, if it kept them
    if not worklist.matches(kept, indices, cu_seqlens, cfg.block_size, k.shape[0], q_map):
        kept = None
    run = _ordered if cfg.deterministic else _atomic
    dq, dk, dv, dqp, dkp = run(
        dout, dkl, saved, cu_seqlens, cfg, proxy_pass_needed, q_map, kept, tables
    )
    if proxy and not proxy_pass_needed:  # the forward's KL pass made the gradient for dkl = 1
        dqp, dkp = (g * dkl for g in unit)

    return Grads.cast((dq, dk, dv, dqp, dkp), (q, k, v, q_proxy, k_proxy))


def _atomic(
    dout, dkl, saved: Saved, cu_seqlens, cfg: Config, proxy_pass_needed: bool, q_map, kept, tables
):
    """The default backward: one work list (cut from ``kept``, the forward's sorted lists, when
    given), sums by fp32 atomics. ``(dq, dk, dv, dqp, dkp)`` (fp32, ``None`` where not
    computed)."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, _ = saved
    T, H, D = q.shape
    Tk, Hkv = k.shape[:2]  # the keys' tokens: T without a query map
    main = dout is not None
    if (main or proxy_pass_needed) and kept is not None:
        wl = worklist.items(kept, ITEM_TOKENS)
    elif main or proxy_pass_needed:
        wl = worklist.build(indices, cu_seqlens, cfg.block_size, ITEM_TOKENS, 0, Tk, q_map)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = dk = dv = dqp = dkp = None
    if main:
        dq = torch.zeros((T, H, D), **f32)
        dk = torch.zeros((Tk, Hkv, D), **f32)
        dv = torch.zeros((Tk, Hkv, D), **f32)
        delta = row_delta(dout, out)  # [T, H]
        args = _main_args(q, k, v, dout, delta, lse, wl, dq, dk, dv, wl.perm, cfg)
        tile, options = _main_tile(q, k, wl, cfg, args, False, tables)
        _bwd_kernel[(wl.num_items, cfg.block_size // tile[1])](*args, **options(tile))
    if proxy_pass_needed:
        dqp = torch.zeros(q_proxy.shape, **f32)
        dkp = torch.zeros(k_proxy.shape, **f32)
        proxy_pass.launch(
            q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg,
            dkl=dkl, dqp=dqp, dkp=dkp, num_stages=BWD_STAGES, tables=tables,
        )  # fmt: skip
    return dq, dk, dv, dqp, dkp


def _ordered(
    dout, dkl, saved: Saved, cu_seqlens, cfg: Config, proxy_pass_needed: bool, q_map, kept, tables
):
    """The deterministic backward (``cfg.deterministic``; ordered.py): the same kernels storing
    their sums into partial buffers, added in a fixed order. ``(dq, dk, dv, dqp, dkp)``.

    Over chunks of C query tokens (a work list each, as the forward driver): per chunk the main
    kernel writes dQ row partials ``(C, H, K * S, D)`` fp32 (``S = block // BN`` programs per
    key block) and, per range of work items, dK / dV tiles ``(items, R, block, D)`` fp32, which
    :func:`~flash_msa.ordered.item_sum` adds into dK / dV after each range; then
    :func:`~flash_msa.ordered.slot_sum` sums the dQ partials into the chunk's rows.
    C and the ranges keep each buffer within ``ordered.PARTIAL_BYTES``. The proxy pass runs over
    the same chunks (proxy.py, ``deterministic=True``). ``kept``: the forward's sorted lists of
    the whole call, or ``None``; one chunk (C covers every token) cuts its work list from them."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, _ = saved
    T, H, D = q.shape
    Tk, Hkv = k.shape[:2]  # the keys' tokens: T without a query map
    Hs, K = indices.shape[1:]
    block = cfg.block_size
    main = dout is not None
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = dk = dv = dqp = dkp = None
    per_token = 0
    whole = None  # the one-chunk work list, cut from the forward's lists
    if kept is not None and (main or proxy_pass_needed):
        whole = worklist.items(kept, ITEM_TOKENS)
    if main:
        delta = row_delta(dout, out)  # [T, H]
        # the tile decides S, hence the partials' size: pick it first, on the one-chunk work list
        # if there is one, else a one-token one, with placeholder buffers (the compiled kernel
        # depends on dtypes, not sizes; tiles.pick compiles, it does not launch)
        probe = whole
        if probe is None:
            probe = worklist.build(indices[:1], cu_seqlens, block, ITEM_TOKENS, 0, Tk, q_map)
        stub = torch.empty(4, **f32)
        args = _main_args(q, k, v, dout, delta, lse, probe, stub, stub, stub, probe.perm, cfg)
        tile, options = _main_tile(q, k, probe, cfg, args, True, tables)
        S = block // tile[1]
        G, G2, _, R, _ = padded_geometry(H, Hkv, Hs, tile[0])
        per_token = H * K * S * D * 4
        per_item = 2 * R * block * D * 4
        dq = torch.empty_like(q)  # slot_sum writes every row
        dk = torch.zeros((Tk, Hkv, D), **f32)
        dv = torch.zeros((Tk, Hkv, D), **f32)
    if proxy_pass_needed:
        dqp = torch.zeros(q_proxy.shape, **f32)
        dkp = torch.zeros(k_proxy.shape, **f32)
        per_token = max(per_token, Hs * K * q_proxy.shape[2] * 4)  # it slices heads if needed
    C = ordered.token_chunk(T, per_token)
    dq_part = torch.empty((C, H, K * S, D), **f32) if main else None
    k_parts = None
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        idx = indices[c0:c1]
        if q_map is not None:  # padding rows: no keys, whatever their slots hold (slot_sum)
            idx = worklist.drop_padding_rows(idx, q_map[c0:c1])
        if whole is not None and C >= T:  # one chunk: the forward's lists
            wl = whole
        else:
            wl = worklist.build(idx, cu_seqlens, block, ITEM_TOKENS, c0, Tk, q_map)
        tok0 = torch.full((1,), c0, dtype=torch.int64, device=q.device)
        if main:
            items = ordered.list_items(wl)
            ranges = ordered.item_ranges(wl.num_items, per_item)
            most = max(w1 - w0 for w0, w1 in ranges)
            if k_parts is None or k_parts[0].shape[0] < most:
                k_parts = [torch.empty((most, R, block, D), **f32) for _ in range(2)]
            part = dq_part[: c1 - c0]
            for w0, w1 in ranges:
                args = _main_args(q, k, v, dout, delta, lse, wl, part, *k_parts, tok0, cfg, w0, w1)
                _bwd_kernel[(w1 - w0, S)](*args, **options(tile))
                # a KV head's sub-groups: its H / Hkv heads, G2 per item sub-group
                kw = dict(groups=H // Hkv // G2, per_item=R)
                ordered.item_sum(k_parts, (dk, dv), items, w0, w1, wl, **kw)
            ordered.slot_sum(part, dq, tok0, slots=K, parts=S, idx=idx, group=H // Hs)
        if proxy_pass_needed:
            proxy_pass.launch(
                q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, dkl=dkl, dqp=dqp, dkp=dkp,
                num_stages=BWD_STAGES, deterministic=True, tok0=tok0, tables=tables,
            )  # fmt: skip
    return dq, dk, dv, dqp, dkp
