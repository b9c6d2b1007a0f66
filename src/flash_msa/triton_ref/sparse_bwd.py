"""Sparse backward (key-outer), main gradients fused with the proxy's closed-form KL gradient.

Same work items as the forward (worklist.py). A program owns (selection head p, key block, up to
TW tokens): it keeps dK/dV of its key block (and dK_proxy) in registers over its tokens and adds
them to fp32 buffers once at the end; dQ and dQ_proxy rows are added with fp32 atomics (a
query's gradient arrives from its K kept blocks). Probabilities are rebuilt from the saved LSEs;
indices are reused, never recomputed.

Proxy part (only when the KL receives a gradient): on the same pairs,
``dz = dkl / (Hs*T) * (Q - target)`` with ``Q = exp(z - proxy_lse)`` and ``target`` the mean of
the group's main probabilities, then ``dq_proxy += pscale * dz @ k_proxy`` and
``dk_proxy += pscale * dz^T @ q_proxy``. When a selection head maps to one KV head (R == 1) the
target comes from the main pass's probabilities for free; otherwise (R > 1, a selection group
spanning several KV heads) a second loop rebuilds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..problem import Config, Grads, Saved
from . import worklist
from .sparse_fwd import _item_rows, head_groups, tiles


@triton.jit
def _probs(
    Q,
    LSE,
    b_k,
    t,
    hj,
    m_r,
    h0,
    kpos,
    m_k,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    PREC: tl.constexpr,
):
    """P [BM, BLOCK] of the rows (token t, head h0 + hj) on the block, and their q and row id."""
    o_d = tl.arange(0, D)
    row = t * H + h0 + hj
    b_q = tl.load(Q + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    keep = m_r[:, None] & m_k[None, :] & (kpos[None, :] <= t[:, None])
    b_lse = tl.load(LSE + row, mask=m_r, other=0.0)
    return tl.where(keep, tl.exp(b_s - b_lse[:, None]), 0.0), b_q, row


@triton.jit
def _proxy_chunk(
    QP,
    PLSE,
    DQP,
    b_kp,
    b_tgt,
    t,
    m_t,
    p,
    kpos,
    m_k,
    coef,
    pscale,
    Hs: tl.constexpr,
    Dp: tl.constexpr,
    PREC: tl.constexpr,
):
    """dq_proxy rows (atomically) and the chunk's dk_proxy contribution [BLOCK, Dp]."""
    o_dp = tl.arange(0, Dp)
    prow = t * Hs + p
    b_qp = tl.load(QP + prow[:, None] * Dp + o_dp[None, :], mask=m_t[:, None], other=0.0)
    b_z = tl.dot(b_qp, tl.trans(b_kp), input_precision=PREC) * pscale  # [BT, BLOCK]
    keep = m_t[:, None] & m_k[None, :] & (kpos[None, :] <= t[:, None])
    b_plse = tl.load(PLSE + prow, mask=m_t, other=0.0)
    b_qprob = tl.where(keep, tl.exp(b_z - b_plse[:, None]), 0.0)
    b_dz = (coef * (b_qprob - b_tgt)).to(b_qp.dtype)  # 0 off the kept pairs
    b_dqp = tl.dot(b_dz, b_kp, input_precision=PREC) * pscale  # [BT, Dp]
    tl.atomic_add(DQP + prow[:, None] * Dp + o_dp[None, :], b_dqp, mask=m_t[:, None], sem="relaxed")
    return tl.dot(tl.trans(b_dz), b_qp, input_precision=PREC) * pscale


@triton.jit
def _bwd_kernel(
    Q,
    Kt,
    V,
    DO,
    DELTA,
    LSE,
    QP,
    KP,
    PLSE,
    DKL,
    PERM,
    ITEM_LIST,
    ITEM_START,
    ITEM_END,
    BLK_START,
    BLK_END,
    DQ,
    DK,
    DV,
    DQP,
    DKP,  # fp32, zero-initialized
    scale,
    pscale,
    inv_rows,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    Hpk: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    Dp: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
    NB: tl.constexpr,
    MAIN: tl.constexpr,
    PROXY: tl.constexpr,
    PREC: tl.constexpr,
):
    w = tl.program_id(0)
    e0 = tl.load(ITEM_START + w)
    e1 = tl.load(ITEM_END + w)
    if e0 >= e1:
        return
    lst = tl.load(ITEM_LIST + w)
    p = lst // NB
    gb = lst % NB
    k0 = tl.load(BLK_START + gb)
    k1 = tl.load(BLK_END + gb)
    o_k = tl.arange(0, BLOCK)
    o_d = tl.arange(0, D)
    o_dp = tl.arange(0, Dp)
    kpos = (k0 + o_k).to(tl.int64)
    m_k = kpos < k1
    if PROXY:
        coef = tl.load(DKL).to(tl.float32) * inv_rows
        pk = p // (Hs // Hpk)
        p_kp = KP + (kpos * Hpk + pk)[:, None] * Dp + o_dp[None, :]
        b_kp = tl.load(p_kp, mask=m_k[:, None], other=0.0)  # [BLOCK, Dp]
        b_dkp = tl.zeros([BLOCK, Dp], tl.float32)
    if MAIN:
        for r in tl.static_range(R):
            h0 = p * G + r * G2
            kvh = h0 // (H // Hkv)
            p_kv = (kpos * Hkv + kvh)[:, None] * D + o_d[None, :]
            b_k = tl.load(Kt + p_kv, mask=m_k[:, None], other=0.0)  # [BLOCK, D]
            b_v = tl.load(V + p_kv, mask=m_k[:, None], other=0.0)
            b_dk = tl.zeros([BLOCK, D], tl.float32)
            b_dv = tl.zeros([BLOCK, D], tl.float32)
            for c in range(e0, e1, BT):
                t, _, hj, m_r = _item_rows(PERM, c, e1, Hs * K, K, BT, G2)
                b_p, b_q, row = _probs(Q, LSE, b_k, t, hj, m_r, h0, kpos, m_k, scale, H, D, PREC)
                b_do = tl.load(DO + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
                b_delta = tl.load(DELTA + row, mask=m_r, other=0.0)
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
                b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)  # [BM, BLOCK]
                b_ds = (b_p * (b_dp - b_delta[:, None])).to(b_q.dtype)
                b_dq = tl.dot(b_ds, b_k, input_precision=PREC) * scale
                tl.atomic_add(
                    DQ + row[:, None] * D + o_d[None, :], b_dq, mask=m_r[:, None], sem="relaxed"
                )
                b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
                if PROXY and R == 1:  # the whole group is here: the target is free
                    b_tgt = tl.sum(tl.reshape(b_p, [BT, G2, BLOCK]), axis=1) / G
                    tq, _, _, m_t = _item_rows(PERM, c, e1, Hs * K, K, BT, 1)
                    b_dkp += _proxy_chunk(
                        QP,
                        PLSE,
                        DQP,
                        b_kp,
                        b_tgt,
                        tq,
                        m_t,
                        p,
                        kpos,
                        m_k,
                        coef,
                        pscale,
                        Hs,
                        Dp,
                        PREC,
                    )
            tl.atomic_add(DK + p_kv, b_dk * scale, mask=m_k[:, None], sem="relaxed")
            tl.atomic_add(DV + p_kv, b_dv, mask=m_k[:, None], sem="relaxed")
    if PROXY and (R > 1 or not MAIN):  # rebuild the target from the saved main LSE
        for c in range(e0, e1, BT):
            b_tgt = tl.zeros([BT, BLOCK], tl.float32)
            for r in tl.static_range(R):
                h0 = p * G + r * G2
                kvh = h0 // (H // Hkv)
                b_k = tl.load(
                    Kt + (kpos * Hkv + kvh)[:, None] * D + o_d[None, :],
                    mask=m_k[:, None],
                    other=0.0,
                )
                t, _, hj, m_r = _item_rows(PERM, c, e1, Hs * K, K, BT, G2)
                b_p, _, _ = _probs(Q, LSE, b_k, t, hj, m_r, h0, kpos, m_k, scale, H, D, PREC)
                b_tgt += tl.sum(tl.reshape(b_p, [BT, G2, BLOCK]), axis=1)
            tq, _, _, m_t = _item_rows(PERM, c, e1, Hs * K, K, BT, 1)
            b_dkp += _proxy_chunk(
                QP, PLSE, DQP, b_kp, b_tgt / G, tq, m_t, p, kpos, m_k, coef, pscale, Hs, Dp, PREC
            )
    if PROXY:
        tl.atomic_add(
            DKP + (kpos * Hpk + pk)[:, None] * Dp + o_dp[None, :],
            b_dkp,
            mask=m_k[:, None],
            sem="relaxed",
        )


SIGNATURE = dict(  # runtime-argument types, for compile checks without a GPU (bf16 inputs)
    {k: "*bf16" for k in ("Q", "Kt", "V", "DO")},
    DELTA="*fp32",
    LSE="*fp32",
    QP="*bf16",
    KP="*bf16",
    PLSE="*fp32",
    DKL="*fp32",
    PERM="*i64",
    **{k: "*i32" for k in ("ITEM_LIST", "ITEM_START", "ITEM_END", "BLK_START", "BLK_END")},
    **{k: "*fp32" for k in ("DQ", "DK", "DV", "DQP", "DKP")},
    scale="fp32",
    pscale="fp32",
    inv_rows="fp32",
)


def bwd(dout, dkl, saved: Saved, cu_seqlens, cfg: Config) -> Grads:
    """Backend op ``bwd`` (contract in docs/design.md) for given indices (not warmup)."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse = saved
    main, proxy = dout is not None, dkl is not None
    if not (main or proxy):
        return Grads(None, None, None, None, None)
    T, H, D = q.shape
    Hkv = k.shape[1]
    Hs, K = indices.shape[1:]
    G, G2, R = head_groups(H, Hkv, Hs)
    BT, TW = tiles(G2, D)
    wl = worklist.build(indices, cu_seqlens, cfg.block_size, TW)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.zeros((T, H, D), **f32) if main else None
    dk = torch.zeros((T, Hkv, D), **f32) if main else None
    dv = torch.zeros((T, Hkv, D), **f32) if main else None
    delta = (dout.float() * out.float()).sum(-1) if main else lse  # [T, H]
    dqp = torch.zeros(q_proxy.shape, **f32) if proxy else None
    dkp = torch.zeros(k_proxy.shape, **f32) if proxy else None
    Dp = q_proxy.shape[2] if proxy else 16
    Hpk = k_proxy.shape[1] if proxy else 1
    dummy = dq if main else dqp
    _bwd_kernel[(wl.num_items,)](
        q, k, v, dout if main else q, delta, lse,
        q_proxy if proxy else q, k_proxy if proxy else k, proxy_lse if proxy else lse,
        dkl if proxy else lse,
        wl.perm, wl.item_list, wl.item_start, wl.item_end, wl.block_start, wl.block_end,
        dq if main else dummy, dk if main else dummy, dv if main else dummy,
        dqp if proxy else dummy, dkp if proxy else dummy,
        cfg.softmax_scale, cfg.proxy_scale or 1.0, 1.0 / (Hs * T),
        H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, K=K, D=D, Dp=Dp, G=G, G2=G2, R=R,
        BLOCK=cfg.block_size, BT=BT, NB=wl.num_blocks, MAIN=main, PROXY=proxy,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=8,
    )  # fmt: skip

    def cast(x, like):
        return None if x is None else x.to(like.dtype)

    return Grads(
        cast(dq, q),
        cast(dk, k),
        cast(dv, v),
        cast(dqp, q_proxy) if proxy else None,
        cast(dkp, k_proxy) if proxy else None,
    )
