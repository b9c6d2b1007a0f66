"""Sparse backward (key-outer): main dQ/dK/dV, then the proxy pass for the KL gradient.

Same work items as the forward (worklist.py). A program owns (selection head p, key block, up to
TW tokens); for each sub-group of G2 heads sharing a KV head it keeps the block's dK/dV in
registers over its tokens and adds them to fp32 buffers once; dQ rows are added with fp32
atomics (a query's gradient arrives from its K kept blocks). Probabilities are rebuilt from the
saved LSE; indices are reused, never recomputed.

The proxy gradient (closed form, only when the KL receives a gradient) is usually made by the
forward: its KL-value pass also accumulates the gradient for ``dkl = 1`` (``Saved.proxy_grad``),
which is only scaled here. Otherwise (``compute_kl=False``, or a forward that did not make it)
proxy.py's pass runs over this work list. Fusing it into the main kernel below would save
recomputing the group's scores, but that kernel's operand tiles plus a third accumulator exceed
the registers and 227 KB of shared memory on Triton 3.6; see docs/perf-notes.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import worklist
from ..problem import Config, Grads, Saved
from ..worklist import ITEM_TOKENS, geometry
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
    DQ,
    DK,
    DV,  # fp32, zero-initialized
    scale,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    R: tl.constexpr,
    BN: tl.constexpr,  # keys per program: the block's part program_id(1) (BN <= block size)
    BT: tl.constexpr,
    NB,  # runtime: it changes with the number of packed sequences
    PREC: tl.constexpr,
    PREFETCH: tl.constexpr,
    DQ_SPLIT: tl.constexpr,  # dQ = dS K in DQ_SPLIT column slices (fewer live registers)
):
    w = tl.program_id(0)
    e0 = tl.load(ITEM_START + w)
    e1 = tl.load(ITEM_END + w)
    if e0 >= e1:
        return
    p, kpos, m_k = item_block(ITEM_LIST, BLK_START, BLK_END, w, NB, BN, tl.program_id(1))
    o_d = tl.arange(0, D)
    for r in tl.static_range(R):
        h0 = p * G + r * G2
        kvh = h0 // (H // Hkv)
        p_kv = (kpos * Hkv + kvh)[:, None] * D + o_d[None, :]
        b_k = tl.load(Kt + p_kv, mask=m_k[:, None], other=0.0)  # [BN, D]
        b_v = tl.load(V + p_kv, mask=m_k[:, None], other=0.0)
        b_dk = tl.zeros([BN, D], tl.float32)
        b_dv = tl.zeros([BN, D], tl.float32)
        nxt = item_rows(PERM, e0, e1, Hs * K, K, BT, G2)
        for c in range(e0, e1, BT):
            if not PREFETCH:
                nxt = item_rows(PERM, c, e1, Hs * K, K, BT, G2)
            t, _, hj, m_r = nxt
            row = t * H + h0 + hj
            b_do = tl.load(DO + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
            b_delta = tl.load(DELTA + row, mask=m_r, other=0.0)
            if PREFETCH:  # the next chunk's entries load while this one computes
                nxt = item_rows(PERM, c + BT, e1, Hs * K, K, BT, G2)
            b_p, b_q = probs(Q, LSE, b_k, row, m_r, t, kpos, m_k, scale, D, PREC)  # [BM, BN]
            b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)  # [BM, BN]
            b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
            if DQ_SPLIT == 1:
                b_dq = tl.dot(b_ds, b_k, input_precision=PREC) * scale
                tl.atomic_add(
                    DQ + row[:, None] * D + o_d[None, :], b_dq, mask=m_r[:, None], sem="relaxed"
                )
            else:
                for j in tl.static_range(DQ_SPLIT):
                    o_j = j * (D // DQ_SPLIT) + tl.arange(0, D // DQ_SPLIT)
                    p_kj = (kpos * Hkv + kvh)[:, None] * D + o_j[None, :]
                    b_kj = tl.load(Kt + p_kj, mask=m_k[:, None], other=0.0)
                    b_dq = tl.dot(b_ds, b_kj, input_precision=PREC) * scale
                    tl.atomic_add(
                        DQ + row[:, None] * D + o_j[None, :], b_dq, mask=m_r[:, None], sem="relaxed"
                    )
            b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
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
    **{k: "*fp32" for k in ("DQ", "DK", "DV")},
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
BWD_PREFETCH = False  # load the next chunk's PERM entries one iteration ahead (main backward)


def bwd(dout, dkl, saved: Saved, cu_seqlens, cfg: Config) -> Grads:
    """Backend op ``bwd`` (contract in docs/design.md) for given indices (not warmup)."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, unit = saved
    main, proxy = dout is not None, dkl is not None
    if not (main or proxy):
        return Grads(None, None, None, None, None)
    T, H, D = q.shape
    Hkv = k.shape[1]
    Hs, K = indices.shape[1:]
    proxy_pass_needed = proxy and unit is None
    if main or proxy_pass_needed:
        wl = worklist.build(indices, cu_seqlens, cfg.block_size, ITEM_TOKENS)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = dk = dv = dqp = dkp = None
    if main:
        dq = torch.zeros((T, H, D), **f32)
        dk = torch.zeros((T, Hkv, D), **f32)
        dv = torch.zeros((T, Hkv, D), **f32)
        delta = (dout.float() * out.float()).sum(-1)  # [T, H]
        args = (
            q, k, v, dout, delta, lse,
            wl.perm, wl.item_list, wl.item_start, wl.item_end, wl.block_start, wl.block_end,
            dq, dk, dv, cfg.softmax_scale,
        )  # fmt: skip

        def options(tile):
            rows, BN, split = tile
            G, G2, R, BT = geometry(H, Hkv, Hs, rows)
            return dict(
                H=H, Hkv=Hkv, Hs=Hs, K=K, D=D, G=G, G2=G2, R=R, BN=BN, BT=BT, DQ_SPLIT=split,
                NB=wl.num_blocks, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                PREFETCH=BWD_PREFETCH, num_warps=8, num_stages=BWD_STAGES,
            )  # fmt: skip

        key = (q.dtype, H, Hkv, Hs, K, D, cfg.block_size, BWD_PREFETCH, BWD_STAGES)
        tile = tiles.pick(_bwd_kernel, args, tiles.fitting(BWD_TILES, cfg.block_size), options, key)
        _bwd_kernel[(wl.num_items, cfg.block_size // tile[1])](*args, **options(tile))
    if proxy and not proxy_pass_needed:  # the forward's KL pass made the gradient for dkl = 1
        dqp, dkp = (g * dkl for g in unit)
    elif proxy:
        dqp = torch.zeros(q_proxy.shape, **f32)
        dkp = torch.zeros(k_proxy.shape, **f32)
        proxy_pass.launch(
            q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg,
            dkl=dkl, dqp=dqp, dkp=dkp, num_stages=BWD_STAGES,
        )  # fmt: skip

    def cast(x, like):
        return None if x is None else x.to(like.dtype)

    return Grads(cast(dq, q), cast(dk, k), cast(dv, v), cast(dqp, q_proxy), cast(dkp, k_proxy))
