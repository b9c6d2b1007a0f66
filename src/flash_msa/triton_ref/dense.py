"""Warmup mode: dense causal attention (and the proxy KL over every visible key), query-outer.

In warmup the kept set is every visible key, so the usual FlashAttention layout is right: a
program owns a tile of queries (one head) and walks the key tiles up to the diagonal with an
online softmax; nothing is split, no partials, memory linear in S.

- ``_dense_fwd_kernel``: out and the natural-log LSE; with ``HAS_V=False`` only the LSE, which is
  how the proxy LSE over all visible keys is computed (``q_proxy``/``k_proxy`` as q/k).
- ``_dense_proxy_kernel``: per (proxy head, query tile), the teacher (mean of the G main
  probabilities, rebuilt from the saved LSE) and ``Q = exp(z - proxy_lse)`` tile by tile; sums the
  KL terms and/or accumulates ``dq_proxy`` in registers (its queries are its own) and adds
  ``dk_proxy`` per key tile with fp32 atomics.
- ``_dense_bwd_kernel``: per (head, key tile), dK/dV in registers over the query tiles below the
  diagonal, dQ by fp32 atomics (FlashAttention-2's key-outer backward).

Deterministic mode (``cfg.deterministic``): no atomics. ``_dense_bwd_kernel`` owns a (key tile,
KV head) and walks its group's heads in order (dK/dV stored once), ``_dense_bwd_dq_kernel``
makes dQ query-outer (recomputing S, P, dP: 2 more MMAs per tile pair), and
``_dense_proxy_dk_kernel`` makes dk_proxy key-outer (recomputing the teacher and the proxy
probabilities: the proxy gradient's work twice). ``DETERMINISTIC`` and ``DK_PROXY`` are
constexprs: the default path's code has none of this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..problem import Config, Forward, Grads, Saved, row_delta
from ..worklist import padded_geometry
from . import tiles
from .common import (
    finish_lse,
    load_rows,
    proxy_step,
    row_offsets,
    row_ptrs,
    sequence_tile,
    teacher,
    tile_rows,
)

# (rows, keys, warps[, stages]) candidates of the backward and the proxy pass, in order
# (tiles.py picks the first that compiles without register spills within the shared memory);
# stages: software pipelining (default 3, PROXY_DK_STAGES in _dense_proxy_dk_kernel). The
# 256-row entries are for the proxy pass at the paper layout (G = 16 heads per selection head),
# D = 128: with fewer rows the teacher's R = G / G2 KV sub-groups are unrolled, each with its
# own pipelined key tile: every earlier entry of the pass with dk_proxy spills or needs 286-458 KB
# of shared memory, and of the dk kernel spills, even on sm_90 (Triton 3.9); 256 rows make
# R = 1. (256, 32, 8, 1) fits sm_80/89/90/100 (sm_90: 210 registers, 76 KB), (256, 16, 8, 2)
# sm_120 (201 registers, 85 KB). docs/algorithm.md, "GPUs with less shared memory".
# The last two, without software pipelining, are for fp32 inputs: IEEE products
# without tensor cores, operand tiles of twice bf16's bytes, each pipelining stage holding them.
# At D = 128 under sm_86/89/120's 99 KB no earlier entry of the deterministic backward fits
# (the smallest, (32, 32, 4), needs 103 KB for _dense_bwd_kernel, 100 KB for the dq kernel;
# the 256-row ones 290-330 KB). (32, 32, 4, 1) needs 40-74 KB in every dense kernel at the
# anchor layout; at the paper layout (G = 16) _dense_proxy_dk_kernel needs 168 KB with it
# (R = 8 key sub-groups) and 80 KB with (64, 16, 4, 1). Triton 3.9, the LLVM IR's count, the
# same on sm_80/89/90/120 (fp32 has no MMA). The paper layout's deterministic proxy pass
# (_dense_proxy_kernel without dk_proxy) needs 145 KB with any tile (its R unrolled q tiles are
# live together): fp32 there runs on sm_80/90/100 only, elsewhere tiles.pick refuses it.
# bf16/fp16 stop at an earlier entry on every target (compile_check).
DENSE_TILES = (
    (64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 32, 4), (256, 32, 8, 1), (256, 16, 8, 2),
    (32, 32, 4, 1), (64, 16, 4, 1),
)  # fmt: skip
# the same for D = 256 (the K / V tiles [keys, 256]; sm_90, Triton 3.9): the backward spills
# with every DENSE_TILES entry (296-656 bytes at best) but 32 x 32 with 8 warps, 1 stage
# (176 registers, 82 KB); the proxy pass at G2 = 7 heads (padded to 8) with every one but
# 128 rows x 32 keys, 8 warps, 1 stage (R = 1: 217 registers, 84 KB; its dk_proxy kernel 177,
# 92 KB). Both go before the 256-row entries, which spill there.
DENSE_TILES_WIDE = (
    (64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 32, 4), (128, 32, 8, 1), (32, 32, 8, 1),
    (256, 32, 8, 1), (256, 16, 8, 2), (32, 32, 4, 1), (64, 16, 4, 1),
)  # fmt: skip


def dense_tiles(D: int, table=None) -> tuple[tuple[int, ...], ...]:
    """The candidates of the warmup's backward and proxy kernels at head dim ``D`` (``table``,
    default :data:`DENSE_TILES`, at ``D = 256`` :data:`DENSE_TILES_WIDE`)."""
    if table is not None:
        return table
    return DENSE_TILES if D <= 128 else DENSE_TILES_WIDE


# the same for the forward (and the proxy LSE): 64 x 64 with 4 warps runs on sm_90; with 8
# warps it does not spill on sm_120 (D = 128: 4 warps spill 72 bytes there, Triton 3.9)
FWD_TILES = ((64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 32, 4))


def tile_stages(tile, default: int = 3) -> int:
    """Software-pipelining stages of a :data:`DENSE_TILES` / :data:`FWD_TILES` entry: its
    optional 4th element, else ``default``."""
    return tile[3] if len(tile) > 3 else default


# software-pipelining stages of _dense_proxy_dk_kernel (deterministic mode; the other dense
# kernels use 3). Its q_proxy operand's second load (see the kernel) costs registers: at 3
# stages every D = 128 tile with BN = 64 or 32 spills (sm_90a, Triton 3.9), leaving (32, 32, 4)
# and no wgmma; at 2 stages (64, 64, 8) fits (247 registers, no spill, 78 KB shared).
PROXY_DK_STAGES = 2


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, rows, m_i, o_d):
    """The backward's query side of the main rows ``rows`` [BM] (int64 ``token * H + head``,
    mask ``m_i``): q and dO [BM, D] (``o_d = tl.arange(0, D)``), the saved LSE and ``delta =
    rowsum(dO * out)`` [BM]."""
    b_q = load_rows(Q, rows, m_i, o_d)
    b_do = load_rows(DO, rows, m_i, o_d)
    b_lse = tl.load(LSE + rows, mask=m_i, other=0.0)
    b_delta = tl.load(DELTA + rows, mask=m_i, other=0.0)
    return b_q, b_do, b_lse, b_delta


@triton.jit
def _masked_probs(b_q, b_k, b_lse, i, m_i, j, m_j, scale, PREC: tl.constexpr):
    """P [BM, BN] = ``exp(q k^T * scale - lse)`` (fp32) of queries ``i`` [BM] on keys ``j``
    [BN] (sequence-local; masks ``m_i``, ``m_j``), 0 where either is masked or the key is after
    the query; ``b_q`` [BM, D], ``b_k`` [BN, D], ``b_lse`` [BM] the saved LSE."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    keep = m_i[:, None] & m_j[None, :] & (j[None, :] <= i[:, None])
    return tl.where(keep, tl.exp(b_s - b_lse[:, None]), 0.0)


@triton.jit
def _dscores(b_p, b_do, b_v, b_delta, PREC: tl.constexpr):
    """dS [BM, BN] = ``P * (dO v^T - delta)`` (fp32) from P [BM, BN], dO [BM, D], v [BN, D] and
    ``delta = rowsum(dO * out)`` [BM]; the softmax scale is left to the dQ/dK results."""
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    return b_p * (b_dp - b_delta[:, None])


@triton.jit
def _dense_fwd_kernel(
    Q,
    Kt,
    V,
    CU,
    OUT,
    LSE,  # q [T,H,D], k/v [T,Hk,D], out [T,H,D], lse [T,H] fp32
    scale,
    H: tl.constexpr,
    Hk: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_V: tl.constexpr,
    PREC: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest tiles first
    s0, L, m0 = sequence_tile(CU, tile, BM)
    if m0 >= L:
        return
    h = tl.program_id(2)
    kh = h // (H // Hk)
    i, m_i, rows = tile_rows(s0, m0, L, h, H, BM)  # [BM] query positions, mask, rows
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BN)
    b_q = load_rows(Q, rows, m_i, o_d)
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_acc = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, tl.minimum(m0 + BM, L), BN):
        j = n0 + o_n
        kv = row_offsets((s0 + j).to(tl.int64) * Hk + kh, o_d)  # [BN, D] of k and v
        b_k = tl.load(Kt + kv, mask=(j < L)[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
        b_s = tl.where((j[None, :] <= i[:, None]) & (j < L)[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_mn_safe = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_p = tl.exp(b_s - b_mn_safe[:, None])
        alpha = tl.exp(b_m - b_mn_safe)
        b_l = b_l * alpha + tl.sum(b_p, axis=1)
        if HAS_V:
            b_v = tl.load(V + kv, mask=(j < L)[:, None], other=0.0)
            b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
        b_m = b_mn
    b_safe = tl.where(b_l == 0, 1.0, b_l)
    b_lse = finish_lse(b_m, b_l)
    tl.store(LSE + rows, b_lse, mask=m_i)
    if HAS_V:
        b_out = (b_acc / b_safe[:, None]).to(OUT.dtype.element_ty)
        tl.store(row_ptrs(OUT, rows, o_d), b_out, mask=m_i[:, None])


@triton.jit
def _dense_proxy_kernel(
    Q,
    Kt,
    QP,
    KP,
    CU,
    LSE,
    PLSE,
    DKL,
    KL_PART,
    DQP,
    DKP,
    scale,
    pscale,
    inv_rows,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    Hpk: tl.constexpr,
    D: tl.constexpr,
    Dp: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,  # G2 padded to a power of two (worklist.padded_geometry)
    R: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    KL_VALUE: tl.constexpr,
    GRAD: tl.constexpr,
    PREC: tl.constexpr,
    DK_PROXY: tl.constexpr = True,  # False: dk_proxy is left to _dense_proxy_dk_kernel
):
    pid = tl.program_id(0)  # (the order of these reads fixes the order of the code)
    s0, L, m0 = sequence_tile(CU, tl.num_programs(0) - 1 - pid, BT)  # longest tiles first
    p = tl.program_id(2)
    if m0 >= L:
        return
    pk = p // (Hs // Hpk)
    o_d = tl.arange(0, D)
    o_dp = tl.arange(0, Dp)
    o_n = tl.arange(0, BN)
    i, m_t, prow = tile_rows(s0, m0, L, p, Hs, BT)  # [BT] tokens, mask, q_proxy rows
    b_qp = load_rows(QP, prow, m_t, o_dp)
    b_plse = tl.load(PLSE + prow, mask=m_t, other=0.0)
    o_r = tl.arange(0, BT * G2P)  # main rows: token-major (token r // G2P, head r % G2P)
    ir = m0 + o_r // G2P  # [BT * G2P] sequence-local positions
    m_r = ir < L
    if G2 != G2P:  # padded head slots: masked (common.teacher)
        m_r = m_r & (o_r % G2P < G2)
    kl_acc = tl.zeros([BT], tl.float32)
    b_dqp = tl.zeros([BT, Dp], tl.float32)
    if GRAD:
        coef = tl.load(DKL).to(tl.float32) * inv_rows
    for n0 in range(0, tl.minimum(m0 + BT, L), BN):
        j = n0 + o_n  # [BN] sequence-local key positions
        m_j = j < L
        kpos = (s0 + j).to(tl.int64)  # packed key positions
        # the first KV sub-group's key tile (the teacher's with R == 1)
        b_k0 = load_rows(Kt, kpos * Hkv + (p * G) // (H // Hkv), m_j, o_d)  # [BN, D]
        tok = (s0 + ir).to(tl.int64)  # packed tokens of the main rows (loop-invariant, hoisted)
        b_tgt = teacher(  # [BT, BN]
            Q, LSE, Kt, b_k0, tok, o_r % G2P, m_r, ir, kpos, j, m_j, p, scale,
            H, Hkv, D, G, G2, G2P, R, BT, BN, PREC,
        )  # fmt: skip
        b_kp = load_rows(KP, kpos * Hpk + pk, m_j, o_dp)  # [BN, Dp]
        kl_acc, b_diff = proxy_step(
            kl_acc, b_tgt, b_qp, b_kp, b_plse, m_t, i, j, m_j, pscale, KL_VALUE, GRAD, PREC
        )
        if GRAD:
            b_dqp += tl.dot(b_diff, b_kp, input_precision=PREC)
            if DK_PROXY:
                b_dkp = tl.dot(tl.trans(b_diff), b_qp, input_precision=PREC) * (coef * pscale)
                p_dkp = row_ptrs(DKP, kpos * Hpk + pk, o_dp)
                tl.atomic_add(p_dkp, b_dkp, mask=m_j[:, None], sem="relaxed")
    if KL_VALUE:
        flat = (tl.program_id(1) * Hs + p) * tl.num_programs(0) + pid
        tl.store(KL_PART + flat, tl.sum(kl_acc, axis=0))
    if GRAD:
        tl.store(row_ptrs(DQP, prow, o_dp), b_dqp * (coef * pscale), mask=m_t[:, None])


@triton.jit
def _dense_proxy_dk_kernel(
    Q,
    Kt,
    QP,
    KP,
    CU,
    LSE,
    PLSE,
    DKL,
    DKP,  # fp32 [T, Hpk, Dp]: every row written once
    scale,
    pscale,
    inv_rows,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    Hs: tl.constexpr,
    Hpk: tl.constexpr,
    D: tl.constexpr,
    Dp: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,
    R: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Deterministic mode's dk_proxy, key-outer: a program owns (key tile, sequence, proxy key
    head) and sums, in order, over the Hs / Hpk proxy heads that read that key head and over
    the query tiles at or after the keys (the teacher and the proxy probabilities recomputed as
    in _dense_proxy_kernel), then stores its tile once: no atomics."""
    s0, L, n0 = sequence_tile(CU, tl.program_id(0), BN)
    if n0 >= L:
        return
    pk = tl.program_id(2)
    o_d = tl.arange(0, D)
    o_dp = tl.arange(0, Dp)
    j = n0 + tl.arange(0, BN)  # [BN] sequence-local key positions
    m_j = j < L
    kpos = (s0 + j).to(tl.int64)
    b_kp = load_rows(KP, kpos * Hpk + pk, m_j, o_dp)  # [BN, Dp]
    coef = tl.load(DKL).to(tl.float32) * inv_rows
    o_r = tl.arange(0, BT * G2P)  # main rows: token-major (token r // G2P, head r % G2P)
    b_dkp = tl.zeros([BN, Dp], tl.float32)
    for pp in range(Hs // Hpk):
        p = pk * (Hs // Hpk) + pp
        b_k0 = load_rows(Kt, kpos * Hkv + (p * G) // (H // Hkv), m_j, o_d)  # [BN, D]
        for m0 in range((n0 // BT) * BT, L, BT):
            i, m_t, prow = tile_rows(s0, m0, L, p, Hs, BT)  # [BT] tokens, mask, q_proxy rows
            b_qp = load_rows(QP, prow, m_t, o_dp)
            b_plse = tl.load(PLSE + prow, mask=m_t, other=0.0)
            ir = m0 + o_r // G2P
            m_r = ir < L
            if G2 != G2P:  # padded head slots: masked (common.teacher)
                m_r = m_r & (o_r % G2P < G2)
            b_tgt = teacher(  # [BT, BN]
                Q, LSE, Kt, b_k0, (s0 + ir).to(tl.int64), o_r % G2P, m_r, ir, kpos, j, m_j, p,
                scale, H, Hkv, D, G, G2, G2P, R, BT, BN, PREC,
            )  # fmt: skip
            _, b_diff = proxy_step(
                tl.zeros([BT], tl.float32), b_tgt, b_qp, b_kp, b_plse, m_t, i, j, m_j, pscale,
                False, True, PREC,
            )  # fmt: skip
            # The MMA's q_proxy operand is loaded a second time (an L2 hit; the eviction hint
            # keeps the compiler from merging the two loads) so that it gets a pipelining ring
            # buffer of its own, one slot more than the prefetch distance, as in any Triton
            # matmul. Sharing b_qp's ring (which has a register use too), the sm_90a code of
            # the BN = 64 tiles (Triton 3.9) had a ring of 2 slots, both in flight at 3 stages
            # (1 of 1 at 2), and issued this wgmma async, waited for in the next iteration
            # only: the cp.async of a later query tile overwrote the slot it was reading. That
            # race is the likely cause of dk_proxy differing between two runs on the H200
            # (Triton 3.6). tests/ops/test_deterministic.py checks every tile's code for it
            # (tiles.ring_hazards); tiles.pick skips a tile that has it.
            p_qp_b = row_ptrs(QP, prow, o_dp)
            b_qp_b = tl.load(p_qp_b, mask=m_t[:, None], other=0.0, eviction_policy="evict_last")
            b_dkp += tl.dot(tl.trans(b_diff), b_qp_b, input_precision=PREC)
    p_dkp = row_ptrs(DKP, kpos * Hpk + pk, o_dp)
    tl.store(p_dkp, b_dkp * (coef * pscale), mask=m_j[:, None])


@triton.jit
def _dense_bwd_kernel(
    Q,
    Kt,
    V,
    DO,
    DELTA,
    LSE,
    CU,
    DQ,
    DK,
    DV,  # DQ/DK/DV fp32, zero-initialized
    scale,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    # deterministic mode: a program owns (key tile, KV head) and visits the KV group's H / Hkv
    # heads in order, storing dK/dV once; dQ is left to _dense_bwd_dq_kernel. Grid z: Hkv.
    DETERMINISTIC: tl.constexpr = False,
):
    # key tile: the first ones see the most queries
    s0, L, n0 = sequence_tile(CU, tl.program_id(0), BN)
    if n0 >= L:
        return
    if DETERMINISTIC:
        kvh = tl.program_id(2)
    else:
        kvh = tl.program_id(2) // (H // Hkv)
    o_d = tl.arange(0, D)
    j, m_j, krow = tile_rows(s0, n0, L, kvh, Hkv, BN)
    kv = row_offsets(krow, o_d)  # [BN, D] of k, v, dk and dv
    b_k = tl.load(Kt + kv, mask=m_j[:, None], other=0.0)
    b_v = tl.load(V + kv, mask=m_j[:, None], other=0.0)
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    for hh in range(H // Hkv if DETERMINISTIC else 1):  # (one pass without DETERMINISTIC)
        if DETERMINISTIC:
            h = kvh * (H // Hkv) + hh
        else:
            h = tl.program_id(2)
        for m0 in range((n0 // BM) * BM, L, BM):
            i, m_i, rows = tile_rows(s0, m0, L, h, H, BM)
            b_q, b_do, b_lse, b_delta = _query_rows(Q, DO, LSE, DELTA, rows, m_i, o_d)
            b_p = _masked_probs(b_q, b_k, b_lse, i, m_i, j, m_j, scale, PREC)
            b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            b_ds = _dscores(b_p, b_do, b_v, b_delta, PREC).to(b_q.dtype)  # the MMAs' operand
            if not DETERMINISTIC:
                b_dq = tl.dot(b_ds, b_k, input_precision=PREC) * scale
                p_dq = row_ptrs(DQ, rows, o_d)
                tl.atomic_add(p_dq, b_dq, mask=m_i[:, None], sem="relaxed")
            b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
    if DETERMINISTIC:
        tl.store(DK + kv, b_dk * scale, mask=m_j[:, None])
        tl.store(DV + kv, b_dv, mask=m_j[:, None])
    else:
        tl.atomic_add(DK + kv, b_dk * scale, mask=m_j[:, None], sem="relaxed")
        tl.atomic_add(DV + kv, b_dv, mask=m_j[:, None], sem="relaxed")


@triton.jit
def _dense_bwd_dq_kernel(
    Q,
    Kt,
    V,
    DO,
    DELTA,
    LSE,
    CU,
    DQ,  # [T, H, D] fp32 (or the input dtype): every row written once
    scale,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Deterministic mode's dQ, query-outer: a program owns (query tile, sequence, head) and
    walks the key tiles up to the diagonal in order, recomputing P and dS (two more MMAs per
    tile than the key-outer kernel shares), dQ kept in registers and stored once."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest tiles first
    s0, L, m0 = sequence_tile(CU, tile, BM)
    if m0 >= L:
        return
    h = tl.program_id(2)
    kvh = h // (H // Hkv)
    o_d = tl.arange(0, D)
    i, m_i, rows = tile_rows(s0, m0, L, h, H, BM)
    b_q, b_do, b_lse, b_delta = _query_rows(Q, DO, LSE, DELTA, rows, m_i, o_d)
    b_dq = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, tl.minimum(m0 + BM, L), BN):
        j, m_j, krow = tile_rows(s0, n0, L, kvh, Hkv, BN)
        kv = row_offsets(krow, o_d)  # [BN, D] of k and v
        b_k = tl.load(Kt + kv, mask=m_j[:, None], other=0.0)
        b_v = tl.load(V + kv, mask=m_j[:, None], other=0.0)
        b_p = _masked_probs(b_q, b_k, b_lse, i, m_i, j, m_j, scale, PREC)
        b_ds = _dscores(b_p, b_do, b_v, b_delta, PREC).to(b_q.dtype)
        b_dq += tl.dot(b_ds, b_k, input_precision=PREC)
    p_dq = row_ptrs(DQ, rows, o_d)
    tl.store(p_dq, (b_dq * scale).to(DQ.dtype.element_ty), mask=m_i[:, None])


_B16, _F32 = "*bf16", "*fp32"
# runtime-argument types, for compile checks without a GPU (bf16 inputs); the backward's and
# the proxy pass's kernels share their inputs
_BWD_IN = dict(Q=_B16, Kt=_B16, V=_B16, DO=_B16, DELTA=_F32, LSE=_F32, CU="*i32")
_PROXY_IN = dict(Q=_B16, Kt=_B16, QP=_B16, KP=_B16, CU="*i32", LSE=_F32, PLSE=_F32, DKL=_F32)
_PROXY_SCALES = dict(scale="fp32", pscale="fp32", inv_rows="fp32")
SIGNATURE = {
    "fwd": dict(Q=_B16, Kt=_B16, V=_B16, CU="*i32", OUT=_B16, LSE=_F32, scale="fp32"),
    "bwd": dict(_BWD_IN, DQ=_F32, DK=_F32, DV=_F32, scale="fp32"),
    "bwd-dq": dict(_BWD_IN, DQ=_B16, scale="fp32"),
    "proxy-dk": dict(_PROXY_IN, DKP=_F32, **_PROXY_SCALES),
    "proxy": dict(_PROXY_IN, KL_PART=_F32, DQP=_F32, DKP=_F32, **_PROXY_SCALES),
}


def _prec(x):
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _attention(q, k, v, out, lse, scale, cu, cfg, tables: tiles.Tables):
    """Dense causal attention into ``out``/``lse``; with ``v is None`` only the LSE."""
    T, H, D = q.shape
    args = (q, k, k if v is None else v, cu, q if out is None else out, lse, scale)

    def options(tile):
        return dict(
            H=H, Hk=k.shape[1], D=D, BM=tile[0], BN=tile[1], HAS_V=v is not None, PREC=_prec(q),
            num_warps=tile[2], num_stages=tile_stages(tile),
        )  # fmt: skip

    key = (q.dtype, H, k.shape[1], D, v is not None)
    cands = FWD_TILES if tables.dense_fwd is None else tables.dense_fwd
    tile = tiles.pick(_dense_fwd_kernel, args, cands, options, key)
    grid = (triton.cdiv(cfg.max_seqlen, tile[0]), cu.numel() - 1, H)
    _dense_fwd_kernel[grid](*args, **options(tile))


def _proxy_pass(
    q, k, q_proxy, k_proxy, lse, proxy_lse, cu, cfg, tables: tiles.Tables, *, kl_value=False,
    dkl=None, dqp=None, dkp=None,
):  # fmt: skip
    """The KL value (returned when ``kl_value``) and/or the proxy gradient into ``dqp``/``dkp``
    (when ``dkl`` is given), over every visible key. With ``cfg.deterministic`` ``dkp`` is made
    by the key-outer ``_dense_proxy_dk_kernel`` (stores, no atomics) instead of atomics."""
    T, H, D = q.shape
    Hs, Dp = q_proxy.shape[1:]
    Hkv, Hpk = k.shape[1], k_proxy.shape[1]
    cands = dense_tiles(D, tables.dense)
    grad = dkl is not None
    det = grad and cfg.deterministic
    most = (triton.cdiv(cfg.max_seqlen, 16), cu.numel() - 1, Hs)  # grid at the smallest tile
    kl_part = torch.zeros(most[0] * most[1] * Hs, dtype=torch.float32, device=q.device)
    args = (
        q, k, q_proxy, k_proxy, cu, lse, proxy_lse, dkl if grad else lse, kl_part,
        dqp if grad else lse, dkp if grad else lse, cfg.softmax_scale, cfg.proxy_scale,
        1.0 / (Hs * T),
    )  # fmt: skip

    def options(tile):
        rows, keys, warps = tile[:3]
        G, G2, G2P, R, BT = padded_geometry(H, Hkv, Hs, rows)
        return dict(
            H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, D=D, Dp=Dp, G=G, G2=G2, G2P=G2P, R=R, BT=BT, BN=keys,
            KL_VALUE=kl_value, GRAD=grad, PREC=_prec(q), DK_PROXY=not det, num_warps=warps,
            num_stages=tile_stages(tile),
        )  # fmt: skip

    key = (q.dtype, H, Hkv, Hs, Hpk, D, Dp, kl_value, grad, det)
    tile = tiles.pick(_dense_proxy_kernel, args, cands, options, key)
    BT = options(tile)["BT"]
    _dense_proxy_kernel[(triton.cdiv(cfg.max_seqlen, BT), cu.numel() - 1, Hs)](
        *args, **options(tile)
    )
    if det:
        dk_args = (
            q, k, q_proxy, k_proxy, cu, lse, proxy_lse, dkl, dkp, cfg.softmax_scale,
            cfg.proxy_scale, 1.0 / (Hs * T),
        )  # fmt: skip

        def dk_options(tile):
            opts = options(tile)
            for name in ("KL_VALUE", "GRAD", "DK_PROXY"):
                del opts[name]
            return dict(opts, num_stages=tile_stages(tile, PROXY_DK_STAGES))

        tile = tiles.pick(_dense_proxy_dk_kernel, dk_args, cands, dk_options, key)
        grid = (triton.cdiv(cfg.max_seqlen, tile[1]), cu.numel() - 1, Hpk)
        _dense_proxy_dk_kernel[grid](*dk_args, **dk_options(tile))
    return kl_part.sum() / (Hs * T) if kl_value else None


def fwd(
    q, k, v, cu_seqlens, cfg: Config, q_proxy=None, k_proxy=None, proxy_grad=False, *,
    tables: tiles.Tables = tiles.SHIPPED,
):  # fmt: skip
    """Backend op ``fwd`` in warmup (``indices is None``): dense causal attention.

    ``proxy_grad`` is ignored: the warmup proxy gradient is computed in ``bwd``. ``tables``:
    the tile candidates (``dense_fwd``, ``dense``; :class:`~flash_msa.triton_ref.tiles.Tables`)."""
    T, H, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    _attention(q, k, v, out, lse, cfg.softmax_scale, cu_seqlens, cfg, tables)
    proxy_lse = kl = None
    if q_proxy is not None:
        proxy_lse = torch.empty(q_proxy.shape[:2], dtype=torch.float32, device=q.device)
        _attention(
            q_proxy, k_proxy, None, None, proxy_lse, cfg.proxy_scale, cu_seqlens, cfg, tables
        )
        if cfg.compute_kl:
            kl = _proxy_pass(
                q, k, q_proxy, k_proxy, lse, proxy_lse, cu_seqlens, cfg, tables, kl_value=True
            )
    return Forward(out, lse, proxy_lse, kl)


def bwd(
    dout, dkl, saved: Saved, cu_seqlens, cfg: Config, *, tables: tiles.Tables = tiles.SHIPPED
) -> Grads:
    """Backend op ``bwd`` in warmup: dense causal attention gradients and the proxy gradient.

    With ``cfg.deterministic`` no atomics run: ``_dense_bwd_kernel`` owns a (key tile, KV
    head) and visits its group's heads in order (dK/dV stored once), ``_dense_bwd_dq_kernel``
    makes dQ query-outer (recomputing P and dS), and the proxy pass makes dk_proxy key-outer
    (``_dense_proxy_dk_kernel``); every buffer is then written, not accumulated."""
    q, k, v, out, lse, _, q_proxy, k_proxy, proxy_lse = saved[:9]
    T, H, D = q.shape
    Hkv = k.shape[1]
    N = cu_seqlens.numel() - 1
    det = cfg.deterministic
    f32 = dict(dtype=torch.float32, device=q.device)
    # zeros in both modes: the deterministic stores cover every row of a sequence, not rows past
    # cu_seqlens[-1] (metadata the API's guard rewrote), which must not read as gradients
    new = torch.zeros
    dq = dk = dv = dqp = dkp = None
    if dout is not None:
        dq = torch.zeros_like(q) if det else torch.zeros((T, H, D), **f32)
        dk = new((T, Hkv, D), **f32)
        dv = new((T, Hkv, D), **f32)
        delta = row_delta(dout, out)
        args = (q, k, v, dout, delta, lse, cu_seqlens, dq, dk, dv, cfg.softmax_scale)

        def options(tile):
            rows, keys, warps = tile[:3]
            return dict(
                H=H, Hkv=Hkv, D=D, BM=rows, BN=keys, PREC=_prec(q), num_warps=warps,
                num_stages=tile_stages(tile),
            )  # fmt: skip

        def bwd_options(tile):
            return dict(options(tile), DETERMINISTIC=det)

        key = (q.dtype, H, Hkv, D, det)
        cands = dense_tiles(D, tables.dense)
        tile = tiles.pick(_dense_bwd_kernel, args, cands, bwd_options, key)
        grid = (triton.cdiv(cfg.max_seqlen, tile[1]), N, Hkv if det else H)
        _dense_bwd_kernel[grid](*args, **bwd_options(tile))
        if det:
            dq_args = (q, k, v, dout, delta, lse, cu_seqlens, dq, cfg.softmax_scale)
            tile = tiles.pick(_dense_bwd_dq_kernel, dq_args, cands, options, key)
            grid = (triton.cdiv(cfg.max_seqlen, tile[0]), N, H)
            _dense_bwd_dq_kernel[grid](*dq_args, **options(tile))
    if dkl is not None:
        dqp = torch.zeros(q_proxy.shape, **f32)
        dkp = new(k_proxy.shape, **f32)
        _proxy_pass(
            q, k, q_proxy, k_proxy, lse, proxy_lse, cu_seqlens, cfg, tables, dkl=dkl, dqp=dqp,
            dkp=dkp,
        )  # fmt: skip

    return Grads.cast((dq, dk, dv, dqp, dkp), (q, k, v, q_proxy, k_proxy))
