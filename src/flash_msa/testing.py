"""Test utilities shared by the test suite, ``flash-msa check`` and the benchmark's verification.

- :func:`make_inputs`: random or "local" MSA inputs (performance.md's two input kinds).
- :func:`brute_force`: an independent, loop-based fp64 statement of MSA (per-row Python
  selection, a dense boolean mask, ``torch.softmax``/``F.kl_div``, autograd gradients). It shares
  no code with :mod:`flash_msa.reference`, so comparing the two can fail.
- :func:`selection_mismatch`: compares two selections as sets with the near-tie rule of
  semantics.md ("Numerics").
- the harness every numeric test uses: :func:`cu` (``cu_seqlens`` of lengths), :func:`poison`
  (NaN-filled buffers), the one tolerance rule :func:`tolerance` / :func:`assert_close`
  (``err(kernel) <= 2 * err(same-dtype reference) + atol``, atol from the dtype's rounding), and
  :func:`training_loss` (a loss with O(1) gradients in all five inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def make_inputs(
    B,
    S,
    H,
    Hkv,
    Hp,
    Hpk,
    D,
    Dp,
    *,
    dtype=torch.bfloat16,
    device="cpu",
    kind="random",
    seed=0,
    requires_grad=False,
):
    """MSA inputs in batch form ``(B, S, heads, dim)``.

    ``kind="random"``: ``torch.randn`` everywhere. ``kind="local"``: the proxy q and k are
    cumulative sums of Gaussian noise along the sequence, each token rescaled to unit RMS, so that
    neighbouring queries rank blocks alike; main q, k, v stay random.
    Returns ``(q_proxy, k_proxy, q, k, v)``.
    """
    if kind not in ("random", "local"):
        raise ValueError(f"kind must be 'random' or 'local', got {kind!r}")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    def proxy(heads, dim):
        x = randn(B, S, heads, dim)
        if kind == "local":
            x = x.cumsum(dim=1)
            x = x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
        return x

    tensors = (
        proxy(Hp, Dp),
        proxy(Hpk, Dp),
        randn(B, S, H, D),
        randn(B, S, Hkv, D),
        randn(B, S, Hkv, D),
    )
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in tensors)


def _segments(x, cu_seqlens):
    """``[(start, end)]`` packed-token ranges of the non-empty sequences of ``x``: the batch rows
    of a 4-D ``(B, S, ...)`` tensor, or the ``cu_seqlens`` segments of a packed one."""
    if cu_seqlens is None:
        S = x.shape[1] if x.dim() == 4 else x.shape[0]
        return [(b * S, (b + 1) * S) for b in range(x.shape[0] if x.dim() == 4 else 1)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def _packed(x):
    return x.reshape(-1, *x.shape[2:]) if x.dim() == 4 else x


def brute_force_select(q_proxy, k_proxy, top_k, block_size, proxy_scale, cu_seqlens=None):
    """Selection by Python loops over (sequence, proxy head, query), in fp64.

    Returns a list indexed by packed token, each a list over proxy heads of the sorted list of
    selected sequence-local block numbers.
    """
    qp, kp = _packed(q_proxy).double(), _packed(k_proxy).double()
    segs = _segments(q_proxy, cu_seqlens)
    Hp, Hpk = qp.shape[1], kp.shape[1]
    chosen = [[[] for _ in range(Hp)] for _ in range(qp.shape[0])]
    for s0, s1 in segs:
        for p in range(Hp):
            keys = kp[s0:s1, p // (Hp // Hpk)]  # [L, Dp]
            z_all = proxy_scale * (qp[s0:s1, p] @ keys.T)  # [L, L]
            for i in range(s1 - s0):
                own = i // block_size
                row = z_all[i]
                scores = {
                    n: row[n * block_size : min((n + 1) * block_size, i + 1)].max().item()
                    for n in range(own + 1)
                }
                ranked = sorted(scores, key=lambda n: (n != own, -scores[n], n))
                chosen[s0 + i][p] = sorted(ranked[:top_k])
    return chosen


def indices_to_lists(indices):
    """``(T, Hsel, top_k)`` (or batch form) int tensor -> nested lists without the -1 padding."""
    idx = indices.reshape(-1, *indices.shape[-2:]).tolist()
    return [[[n for n in row if n >= 0] for row in tok] for tok in idx]


def brute_force(
    q_proxy,
    k_proxy,
    q,
    k,
    v,
    selection,
    *,
    block_size,
    softmax_scale=None,
    proxy_scale=None,
    cu_seqlens=None,
    warmup=False,
):
    """Main attention, LSE and KL over a given selection, with a dense mask, in fp64.

    ``selection`` is the nested list of :func:`brute_force_select` / :func:`indices_to_lists`
    (ignored when ``warmup``). Inputs may require grad: the result is differentiable (the KL
    target is detached, as in MSA). Returns a dict with ``out`` (input layout), ``lse``
    (``(T, H)``), ``kl`` (0-dim), all fp64.
    """
    D, Dp = q.shape[-1], q_proxy.shape[-1]
    softmax_scale = D**-0.5 if softmax_scale is None else softmax_scale
    proxy_scale = Dp**-0.5 if proxy_scale is None else proxy_scale
    qp, kp, qq, kk, vv = (_packed(x).double() for x in (q_proxy, k_proxy, q, k, v))
    T, H, _ = qq.shape
    Hkv, Hp, Hpk = kk.shape[1], qp.shape[1], kp.shape[1]
    segs = _segments(q, cu_seqlens)
    outs, lses, kl_total = [], [], qq.new_zeros(())
    for s0, s1 in segs:
        L = s1 - s0
        mask = torch.zeros(Hp, L, L, dtype=torch.bool)
        for p in range(Hp):
            for i in range(L):
                if warmup:
                    mask[p, i, : i + 1] = True
                    continue
                for n in selection[s0 + i][p]:
                    mask[p, i, n * block_size : min((n + 1) * block_size, i + 1)] = True
        mask_h = mask.repeat_interleave(H // Hp, dim=0)
        kh = kk[s0:s1].transpose(0, 1).repeat_interleave(H // Hkv, dim=0)
        vh = vv[s0:s1].transpose(0, 1).repeat_interleave(H // Hkv, dim=0)
        s = softmax_scale * qq[s0:s1].transpose(0, 1) @ kh.transpose(1, 2)
        s = s.masked_fill(~mask_h, -math.inf)
        lse = torch.logsumexp(s, -1)
        prob = torch.softmax(s, -1).nan_to_num(0.0)
        outs.append((prob @ vh).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        kph = kp[s0:s1].transpose(0, 1).repeat_interleave(Hp // Hpk, dim=0)
        z = proxy_scale * qp[s0:s1].transpose(0, 1) @ kph.transpose(1, 2)
        log_q = torch.log_softmax(z.masked_fill(~mask, -math.inf), -1)
        target = prob.detach().view(Hp, H // Hp, L, L).mean(1)
        # kl_div(input=log Q, target) = sum target * (log target - log Q); off the mask both the
        # target and the term are 0, so feed log Q = 0 there to avoid 0 * inf.
        kl_total = kl_total + F.kl_div(log_q.masked_fill(~mask, 0.0), target, reduction="sum")
    out = torch.cat(outs).reshape(q.shape[:-1] + (q.shape[-1],))
    return {"out": out, "lse": torch.cat(lses), "kl": kl_total / (Hp * T)}


def selection_mismatch(
    idx_a, idx_b, q_proxy, k_proxy, block_size, proxy_scale, cu_seqlens=None, rtol=1e-3
):
    """Number of (token, proxy head) rows whose selections differ beyond near-ties.

    A row passes when the two index sets are equal, or when every block in their symmetric
    difference has a score (recomputed in fp64) within ``rtol * (1 + |s_k|)`` of the k-th
    largest selected score ``s_k`` (the own block is excluded from the ranking).
    """
    a, b = indices_to_lists(idx_a), indices_to_lists(idx_b)
    qp, kp = _packed(q_proxy).double(), _packed(k_proxy).double()
    T, Hp = qp.shape[:2]
    Hpk = kp.shape[1]
    starts = {t: s0 for s0, s1 in _segments(q_proxy, cu_seqlens) for t in range(s0, s1)}
    bad = 0
    for t in range(T):
        for p in range(Hp):
            sa, sb = set(a[t][p]), set(b[t][p])
            if sa == sb:
                continue
            if len(sa) != len(sb):
                bad += 1
                continue
            s0, i = starts[t], t - starts[t]
            z = proxy_scale * (kp[s0 : t + 1, p // (Hp // Hpk)] @ qp[t, p])

            def score(n, z=z, i=i):
                return z[n * block_size : min((n + 1) * block_size, i + 1)].max().item()

            own = i // block_size
            kth = min(score(n) for n in (sa | sb) - {own})
            if any(abs(score(n) - kth) > rtol * (1 + abs(kth)) for n in sa ^ sb):
                bad += 1
    return bad


# ---------------------------------------------------------------------------------------------
# the test harness: sequences, poisoned buffers, the tolerance rule, O(1)-gradient losses
# ---------------------------------------------------------------------------------------------
def cu(lengths, device="cpu") -> torch.Tensor:
    """``cu_seqlens`` (int32, ``[0, l0, l0 + l1, ...]``) of packed sequences of ``lengths``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


POISON_INT = -(2**30)  # an index no kernel may leave behind (not -1, the "unused slot" value)


def poison(*tensors: torch.Tensor):
    """Fill buffers in place with values no kernel writes (NaN; ``POISON_INT`` for integers), so
    that a tile a kernel forgot to write fails the comparison. Returns the tensors (one tensor
    when given one)."""
    for t in tensors:
        t.fill_(float("nan") if t.is_floating_point() else POISON_INT)
    return tensors[0] if len(tensors) == 1 else tensors


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A new tensor of ``shape`` filled by :func:`poison`."""
    return poison(torch.empty(shape, dtype=dtype, device=device))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in fp64 (``inf`` if either holds a NaN where the other does not)."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    d = (a - b).abs()
    return float("inf") if d.isnan().any() else (d.max().item() if d.numel() else 0.0)


# Outputs in fp32/fp64 are not the rounding of a more precise value but the result of many
# roundings in that precision, in another order than the reference's (tiles, exp2 instead of
# exp, atomics, closed-form vs autograd gradients), amplified by the size of the exponents
# (P = exp(s - lse) carries |s| * eps). Measured, in units of one rounding of max |exact|
# beyond 2 * err(same): fp32 Triton kernels on CPU up to 1.4 (dv of 300 tokens, G = 4: their
# exp2(s*log2e - lse*log2e) rounds at the scale of |lse| ~ 7); the fp64 reference against the
# fp64 brute force up to 4.5 at the default scales and 15 with softmax_scale = 1 (dq, D = 8).
# 64 keeps fp32 checks at ~8e-6 and fp64 at ~1.4e-14 of max |exact| (an fp32 leak into an
# fp64 path still fails). bf16/fp16 outputs, dominated by their final rounding, keep 1.
HIGH_PRECISION_ROUNDINGS = 64


def rounding_atol(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The output dtype's rounding at the scale of ``exact``: twice the largest error of one
    ``x + 0.3 - 0.3`` round trip in ``dtype`` (FlashAttention-4's tests derive their atol this
    way), at least twice the rounding of ``max |exact|`` (a tensor of one or few values, a 0-dim
    KL, may round-trip exactly: alone that would give 0); times :data:`HIGH_PRECISION_ROUNDINGS`
    for fp32/fp64. About 8e-3 for bf16 values of size 1, 8e-6 for fp32."""
    if exact.numel() == 0:
        return 0.0
    r = exact.detach().to(dtype)
    trip = ((r + 0.3) - 0.3 - r).abs().max().double().item()
    one = torch.finfo(dtype).eps / 2 * exact.detach().abs().max().double().item()
    atol = 2 * max(trip, one)
    return atol * (HIGH_PRECISION_ROUNDINGS if dtype in (torch.float32, torch.float64) else 1)


def tolerance(exact: torch.Tensor, same: torch.Tensor | None, dtype: torch.dtype) -> float:
    """The rule ``err(kernel) <= 2 * err(same-dtype reference) + atol``, both errors against the
    exact (fp32 or fp64) value; ``same=None`` leaves only ``atol`` (the exact comparison of two
    high-precision implementations)."""
    same_err = 0.0 if same is None else max_err(same, exact)
    return 2 * same_err + rounding_atol(exact, dtype)


def assert_close(name, mine, exact, same=None, *, dtype=None, can_fail=True):
    """Assert ``mine`` matches ``exact`` by :func:`tolerance` (``dtype`` defaults to ``mine``'s).

    ``can_fail`` also asserts that the check means something: ``exact`` must be larger than the
    tolerance somewhere, or an all-zero (never written, never computed) ``mine`` would pass. Use
    losses with O(1) gradients (:func:`training_loss`) so that it holds."""
    assert mine.shape == exact.shape, (name, tuple(mine.shape), tuple(exact.shape))
    tol = tolerance(exact, same, dtype or mine.dtype)
    err = max_err(mine, exact)
    assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"
    if can_fail:
        scale = exact.detach().abs().max().item() if exact.numel() else 0.0
        assert scale > 2 * tol, (
            f"{name}: the check cannot fail (max |exact| {scale:.3e} <= 2 * tolerance {tol:.3e}); "
            "use a loss with O(1) gradients"
        )
    return err, tol


def loss_weights(out_shape, rows: int, seed: int = 0, device="cpu"):
    """``(dout, kl_weight)`` of :func:`training_loss`: a random fp32 ``dout`` of ``out_shape`` and
    a random KL weight times ``rows`` (``Hp * T``: the KL is a mean over rows, so its gradient
    is ``1 / rows`` small without it)."""
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out_shape, generator=g, dtype=torch.float32)
    w = (0.5 + torch.rand((), generator=g, dtype=torch.float64)).item() * rows
    return dout.to(device), w


def training_loss(out, kl, rows: int, seed: int = 0):
    """A loss with O(1) gradients in all five inputs: ``(out * dout).sum() + w * kl`` with the
    random ``dout`` and weight ``w`` of :func:`loss_weights` (the same for a given ``seed``, so
    a kernel and its references see one loss)."""
    dout, w = loss_weights(out.shape, rows, seed, out.device)
    return (out.float() * dout).sum() + w * kl.float()
