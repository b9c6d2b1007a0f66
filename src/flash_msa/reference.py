"""Pure-PyTorch MSA: the normative semantics (``shared/spec/semantics.md``) as plain tensor code.

This module is three things at once:

1. the ``torch`` backend (CPU fallback; it implements the op contract of docs/design.md:
   :func:`select`, :func:`fwd`, :func:`bwd` on the packed varlen layout, and the contract's
   optional query map ``q_map`` that context parallelism uses, docs/distributed.md);
2. the oracle the Triton backend is tested against;
3. a readable statement of the math (see docs/algorithm.md for the derivation).

It materializes dense ``(heads, rows, keys)`` score tiles per sequence, so memory is
O(chunk * S) and time O(S^2): it is meant for tests and small problems. Queries are processed in
chunks of rows so that one tile stays below ~128 MB.

Numerics: statistics, softmax and the KL are computed in fp32 (fp64 when the inputs are fp64).
With ``upcast=False`` the forward does its matmuls in the input dtype instead (scores of bf16
operands rounded to bf16, probabilities cast to bf16 before ``P @ V``), which is what the bf16
tolerance rule ``err(kernel) <= 2 * err(same-dtype reference) + atol`` compares against.
"""

from __future__ import annotations

import math

import torch

from . import limits, quant
from .limits import OPS, Limits
from .problem import Config, Forward, Grads, Problem, Saved

_TILE_BYTES = 1 << 27  # one (heads, rows, keys) fp32 tile stays below 128 MB


# ---------------------------------------------------------------------------------------------
# backend surface
# ---------------------------------------------------------------------------------------------
def unavailable_reason() -> str | None:
    """The torch backend runs wherever torch runs."""
    return None


# every op, on any device, in every float dtype (fp64 included), any head dim and block size,
# with or without a query map, and in deterministic mode: this backend is deterministic as it
# is (no atomics: its sums are torch reductions and matmuls over fixed shapes, and scatters
# write each element once or the same value), so the flag changes nothing here. Its select
# is also the reference of the fp8 selection (selection_precision="fp8", flash_msa.quant).
LIMITS = {
    op: Limits(
        devices=None,
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        block_sizes=None,
        q_map=True,
        deterministic=True,
        fp8_selection=op == "select",
    )
    for op in OPS
}


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """The torch backend implements every op, dtype (fp64 included), head dim and block size."""
    return limits.reason(LIMITS, op, problem)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequences(cu_seqlens: torch.Tensor):
    """Yield ``(start, length)`` of each packed sequence (host copy: fine for the reference)."""
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        if s1 > s0:
            yield s0, s1 - s0


def _row_chunks(length: int, heads: int, rows: int | None = None):
    """Split ``range(rows)`` query rows (default ``length``) so that a ``(heads, rows, length)``
    tile stays small."""
    rows = length if rows is None else rows
    step = max(1, _TILE_BYTES // (4 * max(1, heads) * max(1, length)))
    for c0 in range(0, rows, step):
        yield c0, min(rows, c0 + step)


def _queries(cu_seqlens: torch.Tensor, q_map: torch.Tensor | None):
    """Yield ``(start, length, rows, pos)`` of each non-empty sequence.

    The sequence's keys are packed tokens ``[start, start + length)``; its queries are the rows
    ``rows`` of ``q`` (a ``slice`` without a query map: the same tokens; else an int64 index
    tensor) at positions ``pos`` (int64, ``len(rows)``) within the sequence. With ``q_map``
    (``(Tq,)`` int32, the packed key index of each query row's token, -1 for a padding row),
    the rows of a sequence are those whose token lies in it; padding rows belong to none.
    """
    if q_map is None:
        for s0, L in _sequences(cu_seqlens):
            yield s0, L, slice(s0, s0 + L), torch.arange(L, device=cu_seqlens.device)
        return
    cu = cu_seqlens.long()
    m = q_map.long()
    seq = torch.searchsorted(cu[1:], m, right=True)  # cu[n] <= m < cu[n + 1]
    seq = torch.where(m >= 0, seq, cu.numel())  # padding rows sort after every sequence
    order = torch.sort(seq, stable=True).indices
    counts = torch.bincount(seq, minlength=cu.numel() + 1).tolist()
    first = 0
    for n, (s0, L) in enumerate(zip(cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist())):
        rows = order[first : first + counts[n]]
        first += counts[n]
        if L > 0 and rows.numel():
            yield s0, L, rows, m[rows] - s0


def _take(rows, c0: int, c1: int):
    """Rows ``[c0, c1)`` of a sequence's query rows (a slice or an index tensor)."""
    return slice(rows.start + c0, rows.start + c1) if isinstance(rows, slice) else rows[c0:c1]


def _heads_first(x: torch.Tensor, dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """``(rows, heads, dim) -> (heads * repeat, rows, dim)`` in ``dtype``; head ``h`` of the result
    is input head ``h // repeat`` (the contiguous-group head map of semantics.md)."""
    x = x.transpose(0, 1).to(dtype)
    return x.repeat_interleave(repeat, dim=0) if repeat > 1 else x


def _kept_mask(indices, rows, length, block_size):
    """Bool ``(Hsel, C, L)``: key ``j`` is in ``T(row)`` of selection head ``p``.

    ``indices`` is ``(C, Hsel, top_k)`` sequence-local block numbers (-1 = unused) or ``None``
    (dense warmup: every visible key). ``rows`` holds the sequence-local positions ``i``.
    """
    keys = torch.arange(length, device=rows.device)
    causal = keys[None, :] <= rows[:, None]  # [C, L]
    if indices is None:
        return causal[None]
    nb = -(-length // block_size)
    idx = indices.long()
    idx = torch.where((idx < 0) | (idx >= nb), nb, idx)  # unused / past-the-end -> dummy column
    blocks = torch.zeros(idx.shape[0], idx.shape[1], nb + 1, dtype=torch.bool, device=idx.device)
    blocks.scatter_(2, idx, True)
    kept = blocks[:, :, keys // block_size]  # [C, Hsel, L]
    return kept.permute(1, 0, 2) & causal[None]


def _probs(s: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)`` on the mask, exactly 0 elsewhere (also for rows with no kept key)."""
    return torch.where(mask, torch.exp(s - lse[..., None]), 0.0)


# ---------------------------------------------------------------------------------------------
# select
# ---------------------------------------------------------------------------------------------
def select(
    q_proxy, k_proxy, cu_seqlens, cfg: Config, *, q_map=None, quantized=None
) -> torch.Tensor:
    """Top-k block selection (semantics.md, "Selection").

    Args:
        q_proxy: ``(T, Hp, Dp)``; k_proxy: ``(T, Hpk, Dp)``; cu_seqlens: ``(N+1,)`` int32.
        cfg: uses ``top_k``, ``block_size``, ``proxy_scale``, ``selection_precision``.
        q_map: ``None`` (the queries are the keys' tokens) or ``(Tq,)`` int32: the packed key
            index of each query row's token, ``-1`` for a padding row (docs/distributed.md,
            "Scheme"); ``q_proxy`` then has ``Tq`` rows and ``k_proxy`` the keys' ``T``.
        quantized: with ``selection_precision="fp8"``, the :class:`flash_msa.quant.Quantized`
            operands to rank (default: ``quant.quantize`` of ``q_proxy``, ``k_proxy`` with the
            shipped choices), e.g. another key-scale granularity.
    Returns:
        ``(Tq, Hp, top_k)`` int32: sequence-local block numbers, ascending, -1 padded (a
        padding row: all -1).

    ``selection_precision="fp8"`` (docs/algorithm.md, "FP8 selection"): the scores are the
    exact products of the e4m3 operands of :func:`flash_msa.quant.quantize`, summed in fp32
    (what an FP8 tensor-core MMA with fp32 accumulation computes, up to the order of the sum),
    times the key scale (per token before the block max, or per block after it); the query
    row's scale and ``proxy_scale`` are left out (positive per-row constants). The own block,
    causality, ``-inf`` blocks and the tie order are those of the exact selection.
    """
    T, Hp, _ = q_proxy.shape
    Hpk = k_proxy.shape[1]
    b, top_k = cfg.block_size, cfg.top_k
    sdt = _stat_dtype(q_proxy.dtype)
    fp8 = cfg.selection_precision == "fp8"
    if fp8:
        qz = quant.quantize(q_proxy, k_proxy, cu_seqlens, b) if quantized is None else quantized
        q_proxy, k_proxy, scale = qz.q, qz.k, 1.0  # e4m3: exact in sdt
        per_block = qz.key_scale == "block"
    else:
        scale = cfg.proxy_scale
    out = torch.full((T, Hp, top_k), -1, dtype=torch.int32, device=q_proxy.device)
    for s0, L, qrows, pos in _queries(cu_seqlens, q_map):
        nb = -(-L // b)
        kp = _heads_first(k_proxy[s0 : s0 + L], sdt, Hp // Hpk)  # [Hp, L, Dp]
        if fp8:  # the key scales, [Hp, 1, L] per token or [Hp, 1, nb] per block
            ks = _heads_first(qz.k_scale[s0 : s0 + L, :, None], sdt, Hp // Hpk).transpose(1, 2)
            ks = ks[..., ::b] if per_block else ks
        for c0, c1 in _row_chunks(L, Hp, len(pos)):
            rows = pos[c0:c1]  # positions i within the sequence
            sl = _take(qrows, c0, c1)
            qp = _heads_first(q_proxy[sl], sdt)  # [Hp, C, Dp]
            z = scale * (qp @ kp.transpose(1, 2))  # [Hp, C, L]
            if fp8 and not per_block:
                z = z * ks
            # causal: j <= i; a NaN score counts as -inf in its block's maximum (the GPU
            # kernels' fmax)
            z = z.masked_fill(~_kept_mask(None, rows, L, b) | z.isnan(), -math.inf)
            z = torch.nn.functional.pad(z, (0, nb * b - L), value=-math.inf)  # partial last block
            score = z.view(Hp, c1 - c0, nb, b).amax(-1)  # [Hp, C, nb]
            if fp8 and per_block:
                score = score * ks  # s_b * max_j(acc_j) = max_j(s_b * acc_j), s_b > 0
            # a non-finite block score (+inf by overflow, NaN from a scale) is never selected
            score = torch.where(score < math.inf, score, -math.inf)
            own = (rows // b)[None, :, None].expand(Hp, -1, 1)
            score.scatter_(2, own, math.inf)  # the own block always wins
            kk = min(top_k, nb)
            # stable descending sort: among equal scores the lower block comes first
            order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :kk]
            order = torch.where(score.gather(-1, order) == -math.inf, nb, order)  # never selected
            order = torch.sort(order, dim=-1).values  # ascending, dropped ones (= nb) last
            order = torch.where(order == nb, -1, order)
            out[sl, :, :kk] = order.permute(1, 0, 2).to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def fwd(
    q,
    k,
    v,
    indices,
    cu_seqlens,
    cfg: Config,
    q_proxy=None,
    k_proxy=None,
    *,
    upcast=True,
    proxy_grad=False,
    q_map=None,
):
    """Main attention over the kept keys, plus the proxy LSE and the KL when a proxy is given.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, Hkv, D)``; cu_seqlens: ``(N+1,)`` int32.
        indices: ``(T, Hsel, top_k)`` int32 sequence-local blocks, or ``None`` for dense
            (warmup) attention. Main head ``h`` uses selection head ``h // (H / Hsel)``.
        q_proxy, k_proxy: ``(T, Hp, Dp)`` / ``(T, Hpk, Dp)`` or ``None``; when given, ``Hp``
            must equal ``Hsel`` (or, in warmup, divide ``H``).
        cfg: uses ``block_size``, ``softmax_scale``, ``proxy_scale``, ``compute_kl``.
        upcast: ``False`` computes the matmuls in the input dtype (for the bf16 tolerance rule).
        proxy_grad: accepted for the op contract; this backend computes the proxy gradient in
            ``bwd`` (``Forward.proxy_grad`` is ``None``).
        q_map: as in :func:`select`: ``q``, ``q_proxy`` and ``indices`` then have ``Tq`` rows,
            ``k``, ``v``, ``k_proxy`` the keys' ``T``; the KL is a mean over ``Hp * Tq`` rows
            (a padding row adds 0 to it, and gets ``out = 0``, ``lse = -inf``).
    Returns:
        :class:`~flash_msa.problem.Forward` ``(out, lse, proxy_lse, kl, None)``: out
        ``(T, H, D)`` input dtype; lse ``(T, H)`` fp32 natural log (``-inf`` for a row with no
        kept key); proxy_lse ``(T, Hp)`` fp32 or ``None`` without a proxy; kl a 0-dim fp32
        tensor when ``cfg.compute_kl`` and a proxy is given, else ``None``.
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    b = cfg.block_size
    sdt = _stat_dtype(q.dtype)
    cdt = sdt if upcast else q.dtype
    proxy = q_proxy is not None
    Hp = q_proxy.shape[1] if proxy else 0
    out = torch.zeros_like(q)
    lse = torch.full((T, H), -math.inf, dtype=sdt, device=q.device)
    proxy_lse = torch.full((T, Hp), -math.inf, dtype=sdt, device=q.device) if proxy else None
    kl_sum = torch.zeros((), dtype=sdt, device=q.device)
    for s0, L, qrows, pos in _queries(cu_seqlens, q_map):
        kh = _heads_first(k[s0 : s0 + L], cdt, H // Hkv)  # [H, L, D]
        vh = _heads_first(v[s0 : s0 + L], cdt, H // Hkv)
        vbad = vh.isnan()
        vbad = vbad if bool(vbad.any()) else None  # (the NaN rule: _attend)
        if proxy:
            kp = _heads_first(k_proxy[s0 : s0 + L], sdt, Hp // k_proxy.shape[1])  # [Hp, L, Dp]
        for c0, c1 in _row_chunks(L, H, len(pos)):
            rows = pos[c0:c1]  # positions i within the sequence
            sl = _take(qrows, c0, c1)
            idx = None if indices is None else indices[sl]
            mask = _kept_mask(idx, rows, L, b)  # [Hsel or 1, C, L]
            mask_h = mask.repeat_interleave(H // mask.shape[0], dim=0)  # [H, C, L]
            qh = _heads_first(q[sl], cdt)  # [H, C, D]
            s = (qh @ kh.transpose(1, 2)).to(sdt) * cfg.softmax_scale
            s = s.masked_fill(~mask_h, -math.inf)
            row_lse = torch.logsumexp(s, dim=-1)  # [H, C]
            p = _probs(s, mask_h, row_lse)
            o = _attend(p.to(cdt), mask_h, vh, vbad)  # [H, C, D]
            out[sl] = o.transpose(0, 1).to(q.dtype)
            lse[sl] = row_lse.transpose(0, 1)
            if not proxy:
                continue
            pmask = mask.repeat_interleave(Hp // mask.shape[0], dim=0)  # [Hp, C, L]
            qp = _heads_first(q_proxy[sl], sdt)
            z = (cfg.proxy_scale * (qp @ kp.transpose(1, 2))).masked_fill(~pmask, -math.inf)
            row_plse = torch.logsumexp(z, dim=-1)  # [Hp, C]
            proxy_lse[sl] = row_plse.transpose(0, 1)
            if cfg.compute_kl:
                target = p.to(sdt).view(Hp, H // Hp, c1 - c0, L).mean(1)  # detached teacher
                kl_sum += _kl_terms(target, z - row_plse[..., None], pmask).sum()
    kl = None
    if proxy and cfg.compute_kl:
        kl = kl_sum / (Hp * T)  # fp32 (fp64 for fp64 inputs)
    lse = lse.float() if sdt == torch.float32 else lse
    if proxy_lse is not None and sdt == torch.float32:
        proxy_lse = proxy_lse.float()
    return Forward(out, lse, proxy_lse, kl)


def _attend(p, mask, vh, vbad):
    """``p @ vh`` (``[H, C, L] @ [H, L, D]``) where a NaN value reaches only the rows that
    attend its key (``mask``), not every row through ``0 * NaN``; ``vbad``: ``vh.isnan()``, or
    ``None`` when ``vh`` has no NaN (the plain product)."""
    if vbad is None:
        return p @ vh
    o = p @ vh.masked_fill(vbad, 0.0)
    return o.masked_fill((mask.to(vh.dtype) @ vbad.to(vh.dtype)) > 0, math.nan)


def _kl_terms(target, log_q, mask):
    """``target * (log target - log Q)`` on the kept keys; terms with ``target == 0`` are 0."""
    keep = mask & (target > 0)
    safe_t = torch.where(keep, target, 1.0)
    return torch.where(keep, target * (torch.log(safe_t) - torch.where(keep, log_q, 0.0)), 0.0)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
def bwd(dout, dkl, saved: Saved, cu_seqlens, cfg: Config, upcast=True, *, q_map=None) -> Grads:
    """Main gradients (when ``dout`` is given) and closed-form proxy gradients (when ``dkl`` is).

    Recomputes the probabilities from the saved ``lse`` / ``proxy_lse`` (no reselection). The
    proxy part is skipped entirely when ``dkl`` is ``None``.

    Args:
        dout: ``(T, H, D)`` or ``None``; dkl: 0-dim tensor or ``None``.
        saved: :class:`~flash_msa.problem.Saved` from the forward.
        upcast: ``False`` runs every matmul on operands in the input dtype, as the kernels'
            MMAs do (``P`` and ``dS`` rounded to it; the proxy's ``Q - target`` too, its
            ``dkl / R`` factor applied to the fp32 product): the same-dtype reference of the
            tolerance rule. Statistics and accumulation stay fp32.
        q_map: as in :func:`fwd` (the forward's); ``dq``/``dq_proxy`` then have ``Tq`` rows,
            ``dk``/``dv``/``dk_proxy`` the keys' ``T`` (every query's share summed).
    Returns:
        :class:`~flash_msa.problem.Grads` in the input dtypes, ``None`` where not computed.
    """
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse = saved[:9]
    T, H, D = q.shape
    Tk, Hkv = k.shape[:2]  # the keys' tokens: T unless a query map is given
    b = cfg.block_size
    sdt = _stat_dtype(q.dtype)
    cdt = sdt if upcast else q.dtype

    def mm(a, b):  # a @ b on operands rounded to cdt, the product in sdt
        return (a.to(cdt) @ b.to(cdt)).to(sdt)

    main = dout is not None
    proxy = dkl is not None
    if proxy and (q_proxy is None or proxy_lse is None):
        raise RuntimeError("bwd: the forward did not save the proxy tensors needed for dkl")
    dq = torch.zeros((T, H, D), dtype=sdt, device=q.device) if main else None
    dk = torch.zeros((Tk, Hkv, D), dtype=sdt, device=q.device) if main else None
    dv = torch.zeros((Tk, Hkv, D), dtype=sdt, device=q.device) if main else None
    if proxy:
        Hp, Dp = q_proxy.shape[1:]
        Hpk = k_proxy.shape[1]
        R = Hp * T
        dqp = torch.zeros((T, Hp, Dp), dtype=sdt, device=q.device)
        dkp = torch.zeros((Tk, Hpk, Dp), dtype=sdt, device=q.device)
        scale_kl = dkl.to(sdt) / R
    if not (main or proxy):
        return Grads(None, None, None, None, None)
    for s0, L, qrows, pos in _queries(cu_seqlens, q_map):
        kh = _heads_first(k[s0 : s0 + L], sdt, H // Hkv)  # [H, L, D]
        vh = _heads_first(v[s0 : s0 + L], sdt, H // Hkv)
        dkh = torch.zeros_like(kh) if main else None
        dvh = torch.zeros_like(vh) if main else None
        if proxy:
            kp = _heads_first(k_proxy[s0 : s0 + L], sdt, Hp // Hpk)  # [Hp, L, Dp]
            dkph = torch.zeros_like(kp)
        for c0, c1 in _row_chunks(L, H, len(pos)):
            rows = pos[c0:c1]  # positions i within the sequence
            sl = _take(qrows, c0, c1)
            mask = _kept_mask(None if indices is None else indices[sl], rows, L, b)
            mask_h = mask.repeat_interleave(H // mask.shape[0], dim=0)
            qh = _heads_first(q[sl], sdt)  # [H, C, D]
            s = mm(qh, kh.transpose(1, 2)) * cfg.softmax_scale
            p = _probs(s, mask_h, lse[sl].transpose(0, 1).to(sdt))  # [H, C, L]
            if main:
                do = _heads_first(dout[sl], sdt)  # [H, C, D]
                delta = (do * _heads_first(out[sl], sdt)).sum(-1, keepdim=True)  # [H, C, 1]
                dvh += mm(p.transpose(1, 2), do)
                ds = p * (mm(do, vh.transpose(1, 2)) - delta)
                dq[sl] = (cfg.softmax_scale * mm(ds, kh)).transpose(0, 1)
                dkh += cfg.softmax_scale * mm(ds.transpose(1, 2), qh)
            if proxy:
                pmask = mask.repeat_interleave(Hp // mask.shape[0], dim=0)
                qp = _heads_first(q_proxy[sl], sdt)  # [Hp, C, Dp]
                z = cfg.proxy_scale * (qp @ kp.transpose(1, 2))
                prob_q = _probs(z, pmask, proxy_lse[sl].transpose(0, 1).to(sdt))
                target = p.view(Hp, H // Hp, c1 - c0, L).mean(1)
                diff = prob_q - target  # both are 0 off the mask; dz = scale_kl * diff
                dqp[sl] = (scale_kl * cfg.proxy_scale * mm(diff, kp)).transpose(0, 1)
                dkph += scale_kl * cfg.proxy_scale * mm(diff.transpose(1, 2), qp)
        if main:
            dk[s0 : s0 + L] = dkh.view(Hkv, H // Hkv, L, D).sum(1).transpose(0, 1)
            dv[s0 : s0 + L] = dvh.view(Hkv, H // Hkv, L, D).sum(1).transpose(0, 1)
        if proxy:
            dkp[s0 : s0 + L] = dkph.view(Hpk, Hp // Hpk, L, Dp).sum(1).transpose(0, 1)

    if not proxy:
        dqp = dkp = None
    return Grads.cast((dq, dk, dv, dqp, dkp), (q, k, v, q_proxy, k_proxy))
