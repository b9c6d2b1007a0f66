"""FP8 proxy block selection (``selection_precision="fp8"``): the oracle of the SM90 kernel.

The exact selection's kernel (``selection.py``) with e4m3 operands: the quantize pass
(:func:`flash_msa.quant.quantize`, shared with the torch reference) writes ``q8 (T, Hp, Dp)``,
``k8 (T, Hpk, Dp)`` in e4m3 and the key scales ``(T, Hpk)`` fp32; the score tile is
``tl.dot`` of the e4m3 tiles with fp32 accumulation (``wgmma ... .f32.e4m3.e4m3`` on sm_90a),
then the same epilogue: causal mask, block max, key scale, streaming top-k.

Key scale (``quant.KEY_SCALE``): per block, it multiplies the block's pooled maximum, read once
per block at the block's first token (every token of a block holds it); per token
(``TOKEN_SCALE``), it multiplies each score column before the max. The query scale and
``proxy_scale`` are not applied (positive per-row constants: the order is unchanged), as in
:func:`flash_msa.reference.select`, so the two compute the same numbers up to the order and
precision of the sum inside ``tl.dot`` (Hopper's FP8 tensor cores accumulate with about 22 bits,
not fp32: :mod:`flash_msa.quant`) and agree up to near-ties.

One program owns (sequence, proxy key head, tile of BT query tokens) with the ``G = Hp/Hpk``
proxy heads that share the key head packed into its BM rows, as in ``selection.py`` (its
launch table and tile candidates are reused). No query map: this is a directly called hook
(:func:`select`, the oracle of the CuTe kernel), not registered for ``auto``, so its
``Limits`` are not declared; the torch backend is the one that declares ``fp8_selection``.
``python -m flash_msa.triton_ref.compile_check select-fp8 --fp8`` compiles its
:func:`configurations` for sm_90a and lists their MMA instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..problem import Config
from . import selection, tiles


@triton.jit
def offer(b_val, b_id, b_score, n, slot, KP2: tl.constexpr):
    """Offer block ``n`` with per-row ``b_score`` ``[BM]`` to the per-row top-k
    (``b_val``/``b_id`` ``[BM, KP2]``; padding slots hold +inf): it replaces the minimum slot,
    the highest block among equal minima, only if strictly greater (blocks arrive ascending,
    so ties keep the lower block; the own block comes as +inf, -inf never enters)."""
    b_min = tl.min(b_val, axis=1)  # [BM]
    e_key = tl.where(b_val == b_min[:, None], b_id * KP2 + slot[None, :], -(1 << 30))
    e_max = tl.max(e_key, axis=1)
    hit = (e_key == e_max[:, None]) & (b_score > b_min)[:, None]
    return tl.where(hit, b_score[:, None], b_val), tl.where(hit, n, b_id)


@triton.jit
def _select_fp8_kernel(
    Q8,
    K8,
    KS,
    CU,
    IDX,  # q8 [T, Hp, Dp] e4m3, k8 [T, Hpk, Dp] e4m3, k scale [T, Hpk] fp32, cu [N+1], [T, Hp, K]
    Hp: tl.constexpr,
    Hpk: tl.constexpr,
    G: tl.constexpr,
    Dp: tl.constexpr,
    BLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    KP2: tl.constexpr,
    BM: tl.constexpr,
    BT: tl.constexpr,
    TOKEN_SCALE: tl.constexpr,  # the key scale is per token (else per block)
):
    # longest (last) tiles first: they walk the most key blocks
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    pk = tl.program_id(2)
    s0 = tl.load(CU + seq)
    L = tl.load(CU + seq + 1) - s0
    t0 = tile * BT
    if t0 >= L:
        return
    o_r = tl.arange(0, BM)
    o_d = tl.arange(0, Dp)
    o_k = tl.arange(0, BLOCK)
    slot = tl.arange(0, KP2)
    tok = t0 + o_r // G  # [BM] sequence-local query position
    head = pk * G + o_r % G  # [BM] proxy head
    m_r = (o_r < BT * G) & (tok < L)
    qrow = (s0 + tok).to(tl.int64)  # [BM] row of q8 and of indices
    b_q = tl.load(
        Q8 + (qrow * Hp + head)[:, None] * Dp + o_d[None, :], mask=m_r[:, None], other=0.0
    )
    own = tok // BLOCK

    # per-row top-k state; padding slots (>= TOPK) hold +inf so they are never evicted
    b_val = tl.where(slot[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros(
        [BM, KP2], tl.float32
    )
    b_id = tl.full([BM, KP2], -1, tl.int32)

    last = tl.minimum(t0 + BT, L) - 1
    for n in range(0, last // BLOCK + 1):
        kpos = n * BLOCK + o_k  # [BLOCK]
        krow = (s0 + kpos).to(tl.int64) * Hpk + pk  # [BLOCK] row of k8 / the key scales
        m_k = kpos < L
        b_k = tl.load(K8 + krow[:, None] * Dp + o_d[None, :], mask=m_k[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k))  # [BM, BLOCK] fp32: e4m3 products, fp32 sums
        if TOKEN_SCALE:
            b_s = b_s * tl.load(KS + krow, mask=m_k, other=1.0)[None, :]
        # causal (=> < L); a NaN score counts as -inf in its block's maximum, as fmax (CuTe)
        b_s = tl.where((kpos[None, :] <= tok[:, None]) & (b_s == b_s), b_s, float("-inf"))
        b_score = tl.max(b_s, axis=1)  # [BM]
        if not TOKEN_SCALE:  # s_b * max_j(acc_j) = max_j(s_b * acc_j), s_b > 0
            b_score = b_score * tl.load(KS + ((s0 + n * BLOCK).to(tl.int64) * Hpk + pk))
        # a non-finite block score never enters (NaN < inf is false); the own block always does
        b_score = tl.where(b_score < float("inf"), b_score, float("-inf"))
        b_score = tl.where(own == n, float("inf"), b_score)
        b_val, b_id = offer(b_val, b_id, b_score, n, slot, KP2)

    b_key = tl.where(b_id >= 0, b_id, 1 << 30)
    b_key = tl.sort(b_key, dim=1)  # ascending, empty slots last
    b_out = tl.where(b_key == (1 << 30), -1, b_key)
    p_o = IDX + (qrow * Hp + head)[:, None] * TOPK + slot[None, :]
    tl.store(p_o, b_out, mask=m_r[:, None] & (slot[None, :] < TOPK))


SIGNATURE = {"Q8": "*fp8e4nv", "K8": "*fp8e4nv", "KS": "*fp32", "CU": "*i32", "IDX": "*i32"}


def launch_config(G: int, Dp: int, block: int, top_k: int, token_scale: bool):
    """``(constexprs, num_warps, num_stages)``: ``selection.launch_config``'s table (the tile
    of the bf16 kernel; the e4m3 tiles take half its shared memory) and the key scale's
    granularity."""
    consts, warps, stages = selection.launch_config(G, Dp, block, top_k, "bf16")
    consts.pop("PREC")
    return dict(consts, TOKEN_SCALE=token_scale), warps, stages


def select_quantized(qz: quant.Quantized, cu_seqlens, cfg: Config) -> torch.Tensor:
    """``(T, Hp, top_k)`` int32 indices of the fp8 selection of the quantized operands ``qz``
    (:func:`flash_msa.quant.quantize` with ``cfg.block_size``)."""
    T, Hp, Dp = qz.q.shape
    Hpk = qz.k.shape[1]
    G = Hp // Hpk
    token_scale = qz.key_scale == "token"
    consts, num_warps, num_stages = launch_config(G, Dp, cfg.block_size, cfg.top_k, token_scale)
    consts.update(Hp=Hp, Hpk=Hpk)
    out = torch.empty((T, Hp, cfg.top_k), dtype=torch.int32, device=qz.q.device)
    args = (qz.q, qz.k, qz.k_scale.contiguous(), cu_seqlens, out)

    def options(tile):
        warps, BM, stages = tile
        return dict(consts, BM=BM, BT=BM // G, num_warps=warps, num_stages=stages)

    cands = selection.tile_candidates(num_warps, num_stages, consts["BM"], G)
    key = ("fp8", *sorted(consts.items()), num_stages)
    tile = tiles.pick(_select_fp8_kernel, args, cands, options, key)
    grid = (triton.cdiv(cfg.max_seqlen, options(tile)["BT"]), cu_seqlens.numel() - 1, Hpk)
    _select_fp8_kernel[grid](*args, **options(tile))
    return out


def select(q_proxy, k_proxy, cu_seqlens, cfg: Config, *, quantized=None) -> torch.Tensor:
    """The fp8 selection of ``q_proxy (T, Hp, Dp)``, ``k_proxy (T, Hpk, Dp)`` (the op contract's
    ``select`` without a query map): the quantize pass (or the given ``quantized``), then
    :func:`select_quantized`. ``(T, Hp, top_k)`` int32, as the torch reference's fp8 selection
    up to near-ties."""
    qz = quantized
    if qz is None:
        qz = quant.quantize(q_proxy, k_proxy, cu_seqlens, cfg.block_size)
    return select_quantized(qz, cu_seqlens, cfg)


# ---------------------------------------------------------------------------------------------
# the configurations compile_check --fp8 compiles (sm_90a without a GPU)
# ---------------------------------------------------------------------------------------------
def configurations(dims=(64, 128)):
    """``(name, fn, signature, candidates)`` of the fp8 selection's configurations, as
    ``compile_check.configurations`` yields them: ``Dp`` in ``dims``, blocks 64/128, top_k
    16/64, 1 and 4 proxy heads per key head, the key scale per block and per token."""
    for Dp in dims:
        for block in (64, 128):
            for top_k in (16, 64):
                for G in (1, 4):
                    for token_scale in (False, True):
                        consts, warps, stages = launch_config(G, Dp, block, top_k, token_scale)
                        cands = [
                            (t, dict(consts, BM=t[1], BT=t[1] // G), t[0], t[2])
                            for t in selection.tile_candidates(warps, stages, consts["BM"], G)
                        ]
                        scale = "token" if token_scale else "block"
                        name = f"select-fp8 Dp={Dp} b={block} k={top_k} G={G} scale={scale}"
                        yield name, _select_fp8_kernel, SIGNATURE, cands
