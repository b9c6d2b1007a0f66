"""The recall protocol of the fp8 selection: inputs, metrics, one measurement.

An fp8 selection (``selection_precision="fp8"``, :mod:`flash_msa.quant`) may swap blocks whose
scores are close; this module measures what that costs against the exact (bf16) selection of
the same inputs, with the torch reference (``benchmarks/fp8_recall.py`` runs it, a CPU test
gates it):

- **recall**: ``|I_fp8 & I_bf16| / |I_bf16|`` over the rows that have a choice (more visible
  blocks than ``top_k``), the forced own block excluded from both sets; also the fraction of
  such rows whose sets are equal.
- **covered mass**: the main heads' dense causal attention mass (the group mean over a
  selection head's main heads) that falls in the selected blocks, summed over the rows with a
  choice, fp8 over bf16.
- **downstream**: ``out``, ``kl`` and the five gradients of the torch reference given the fp8
  indices, relative to the same given the bf16 indices (rel. L2 error ``|a - b| / |b|``; for the
  0-dim ``kl`` the relative difference), under :func:`flash_msa.testing.training_loss`'s loss.

Inputs (:func:`make_case`, batch form ``B = 1``): the proxies are
:func:`flash_msa.testing.make_inputs`'s ``random`` (N(0, 1)) or ``local`` (cumulative sums,
unit RMS per token: neighbouring queries rank blocks alike, the benchmark's structured kind);
``+outliers`` multiplies :data:`OUTLIER_CHANNELS` proxy channels (the same in ``q_proxy`` and
``k_proxy``) by :data:`OUTLIER_GAIN`. The main heads follow their proxy (``q[h] =
q_proxy[p(h)] + 0.5 * noise``, ``k[g] = k_proxy[pk(g)] + 0.5 * noise``, before the outliers),
as a trained proxy does; with independent main heads the attention is flat over the keys and
the covered mass would only count kept keys. ``D = Dp`` therefore.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from . import quant, reference, testing
from .problem import Config, Saved

KINDS = ("random", "local", "random+outliers", "local+outliers")
OUTLIER_CHANNELS = 4  # proxy channels scaled up in the "+outliers" kinds
OUTLIER_GAIN = 30.0  # their gain (activation outliers of 10-100x, research note A.5)
MAIN_NOISE = 0.5  # the main heads' deviation from their proxy, per element
# the key scales (quant.KEY_SCALES) of the fp8 selections the protocol compares
VARIANTS = ("block", "token")
GRADS = ("dq", "dk", "dv", "dq_proxy", "dk_proxy")


def make_case(kind, S, layout, D, *, seed=0, dtype=torch.bfloat16):
    """``(q_proxy, k_proxy, q, k, v)`` of one recall case, batch form ``(1, S, heads, D)``.

    ``kind`` is one of :data:`KINDS`; ``layout`` is ``(H, Hkv, Hp, Hpk)``; ``D = Dp``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    H, Hkv, Hp, Hpk = layout
    base = kind.removesuffix("+outliers")
    qp, kp, _, _, v = testing.make_inputs(
        1, S, H, Hkv, Hp, Hpk, D, D, kind=base, seed=seed, dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed + 1)
    q = qp.repeat_interleave(H // Hp, dim=2) + MAIN_NOISE * torch.randn(1, S, H, D, generator=g)
    kmain = kp[:, :, [g_ * Hpk // Hkv for g_ in range(Hkv)]]
    k = kmain + MAIN_NOISE * torch.randn(1, S, Hkv, D, generator=g)
    if kind.endswith("+outliers"):
        ch = torch.randperm(D, generator=g)[:OUTLIER_CHANNELS]
        gain = torch.ones(D)
        gain[ch] = OUTLIER_GAIN
        qp, kp = qp * gain, kp * gain
    return tuple(x.to(dtype) for x in (qp, kp, q, k, v))


def block_mass(q, k, cu_seqlens, block_size, softmax_scale, chunk=512):
    """fp32 ``(H, T, nb)``: dense causal attention mass of main head ``h``, row ``t`` in key
    block ``n`` (one sequence: ``cu_seqlens = [0, T]``; packed ``(T, heads, D)`` inputs)."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    nb = -(-T // block_size)
    kh = k.float().transpose(0, 1).repeat_interleave(H // Hkv, 0)  # (H, T, D)
    out = torch.zeros(H, T, nb)
    keys = torch.arange(T)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        s = softmax_scale * (q[c0:c1].float().transpose(0, 1) @ kh.transpose(1, 2))
        s = s.masked_fill(keys[None, None, :] > torch.arange(c0, c1)[None, :, None], -math.inf)
        p = torch.softmax(s, -1)
        p = torch.nn.functional.pad(p, (0, nb * block_size - T))
        out[:, c0:c1] = p.view(H, c1 - c0, nb, block_size).sum(-1)
    return out


def _rows_with_choice(T, top_k, block_size):
    """Bool ``(T,)``: row ``i`` sees more than ``top_k`` blocks (one sequence)."""
    return torch.arange(T) // block_size + 1 > top_k


def selection_metrics(idx, ref, mass, top_k, block_size):
    """``{recall, exact_rows, mass_ratio}`` of selection ``idx`` against ``ref`` (both
    ``(T, Hp, top_k)`` int32 of one sequence; ``mass`` from :func:`block_mass`)."""
    T, Hp, _ = ref.shape
    H, _, nb = mass.shape
    rows = _rows_with_choice(T, top_k, block_size)

    def sets(x):  # bool (T, Hp, nb + 1) of the kept blocks, the own block and -1 left out
        m = torch.zeros(T, Hp, nb + 1, dtype=torch.bool)
        m.scatter_(2, torch.where(x < 0, nb, x.long()), True)
        own = (torch.arange(T) // block_size)[:, None, None].expand(T, Hp, 1)
        m.scatter_(2, own, False)
        return m[..., :nb]

    a, b = sets(idx)[rows], sets(ref)[rows]
    group = mass.view(Hp, H // Hp, T, nb).mean(1).permute(1, 0, 2)[rows]  # (rows, Hp, nb)
    own = torch.zeros_like(a)
    own_blk = (torch.arange(T)[rows] // block_size)[:, None, None].expand(-1, Hp, 1)
    own.scatter_(2, own_blk, True)
    covered = ((a | own) * group).sum().item(), ((b | own) * group).sum().item()
    return dict(
        recall=(a & b).sum().item() / max(1, b.sum().item()),
        exact_rows=(a == b).all(-1).float().mean().item(),
        mass_ratio=covered[0] / covered[1],
    )


def downstream(tensors, idx, ref, cfg: Config, seed=0):
    """Rel. errors of ``out``, ``kl`` and the five gradients (torch reference, fp32 statistics)
    given ``idx`` against the same given ``ref`` (packed ``(T, heads, dim)`` tensors of one
    sequence, ``cfg`` with ``compute_kl``)."""
    qp, kp, q, k, v = tensors
    T, Hp = qp.shape[:2]
    cu = testing.cu([T])
    dout, w = testing.loss_weights(q.shape, Hp * T, seed)
    dkl = torch.tensor(w, dtype=torch.float32)
    res = []
    for indices in (idx, ref):
        f = reference.fwd(q, k, v, indices, cu, cfg, qp, kp)
        saved = Saved(q, k, v, f.out, f.lse, indices, qp, kp, f.proxy_lse)
        g = reference.bwd(dout.to(q.dtype), dkl, saved, cu, cfg)
        res.append(dict(out=f.out, kl=f.kl, **dict(zip(GRADS, g))))
    a, b = res

    def rel(x, y):
        x, y = x.double(), y.double()
        return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()

    return {name: rel(a[name], b[name]) for name in ("out", "kl", *GRADS)}


def measure(
    kind,
    S,
    layout=(16, 2, 4, 1),
    D=128,
    *,
    top_k=16,
    block_size=128,
    seed=0,
    variants=VARIANTS,
    with_downstream=True,
    downstream_all=False,
    fp8_select=None,
):
    """One case, every variant against the bf16 selection: ``{name: metrics}`` with the fp8
    selections of the shipped key scale and of each in ``variants`` (named by key scale,
    ``"block"`` or ``"token"``), the bf16 selection against the fp32 one of the inputs before
    their rounding to bf16 (``"bf16_vs_fp32"``: the floor that bf16 itself sets), and
    ``"seconds"``. Downstream errors (:func:`downstream`) for the shipped key scale, with
    ``downstream_all`` also for ``bf16_vs_fp32`` (the fp32 selection's indices against the bf16
    one's, on the same bf16 tensors).

    ``fp8_select(q_proxy, k_proxy, cu_seqlens, cfg, quantized=...)`` makes the fp8 selections
    (default :func:`flash_msa.reference.select`; e.g. a GPU kernel's hook, which gets the CPU
    tensors and returns CPU indices); the bf16 reference, the masses and the downstream errors
    stay the torch reference's."""
    t0 = time.perf_counter()
    select = reference.select if fp8_select is None else fp8_select
    fp32 = [x[0] for x in make_case(kind, S, layout, D, seed=seed, dtype=torch.float32)]
    tensors = [x.to(torch.bfloat16) for x in fp32]  # packed (T, heads, D), as make_case's
    qp, kp, q, k, _ = tensors
    cu = testing.cu([S])
    cfg = Config(
        block_size=block_size,
        softmax_scale=D**-0.5,
        max_seqlen=S,
        proxy_scale=D**-0.5,
        top_k=top_k,
        compute_kl=True,
    )
    ref = reference.select(qp, kp, cu, cfg)
    mass = block_mass(q, k, cu, block_size, cfg.softmax_scale)
    fp8 = dataclasses.replace(cfg, selection_precision="fp8")
    out = {}
    for key_scale in dict.fromkeys((quant.KEY_SCALE, *variants)):
        qz = quant.quantize(qp, kp, cu, block_size, key_scale=key_scale)
        idx = select(qp, kp, cu, fp8, quantized=qz)
        m = selection_metrics(idx, ref, mass, top_k, block_size)
        if with_downstream and key_scale == quant.KEY_SCALE:
            m.update(downstream(tensors, idx, ref, cfg, seed))
        out[key_scale] = m
    exact = reference.select(fp32[0], fp32[1], cu, cfg)
    m = selection_metrics(ref, exact, mass, top_k, block_size)
    if with_downstream and downstream_all:
        m.update(downstream(tensors, ref, exact, cfg, seed))
    out["bf16_vs_fp32"] = m
    out["seconds"] = time.perf_counter() - t0
    return out
