"""GPU tests of the dense warmup on CuTe (``flash_msa/cute/warmup.py``: the sparse forward and
the fused backward over every causal block): out, lse, proxy LSE, KL and the five gradients of
``testing.training_loss`` by the rule against the exact reference (fp64), next to the Triton
warmup on the same inputs; batch and varlen (shorter, one-token and empty sequences), one width
within the CuTe combine's 64 slots and one above (the two-level combine); new buffers
NaN-poisoned; deterministic mode bitwise; no host synchronization; ``auto`` picks CuTe."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flash_msa
from flash_msa import backends, testing
from flash_msa.problem import Saved
from harness import check, config, incoming, packed_inputs, references, results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# lengths, H, Hkv, Hp, Hpk, D, Dp, block: 64 blocks or fewer (one-level combine) and more
CASES = {
    "anchor-varlen": ((3000, 1, 0, 900), 16, 2, 4, 1, 128, 128, 128),
    "anchor-batch": ((2048, 2048), 16, 2, 4, 1, 128, 128, 128),
    "anchor-wide": ((9000, 4100), 16, 2, 4, 1, 128, 128, 128),  # 71 blocks: width 128
    "paper-b64": ((5000, 70), 64, 4, 4, 1, 128, 128, 64),  # 79 blocks: width 128
    "D=64": ((2049, 33), 16, 2, 4, 1, 64, 64, 128),
}


def _cute():
    pytest.importorskip("cutlass")
    cute_be, why = backends.load("cute")
    assert cute_be is not None, why
    return cute_be, backends.load("triton")[0]


def _poison_new_buffers(mp):
    real_empty, real_like = torch.empty, torch.empty_like
    mp.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    mp.setattr(torch, "empty_like", lambda *a, **kw: testing.poison(real_like(*a, **kw)))


def _run(be, xs, cu, cfg, dout, dkl):
    qp, kp, q, k, v = xs
    f = be.fwd(q, k, v, None, cu, cfg, qp, kp)
    saved = Saved(q, k, v, f.out, f.lse, None, qp, kp, f.proxy_lse)
    return results(f, be.bwd(dout, dkl, saved, cu, cfg))


@pytest.mark.parametrize("name", list(CASES))
def test_cute_warmup_matches_reference_and_triton(name, monkeypatch):
    cute_be, triton_be = _cute()
    lengths, H, Hkv, Hp, Hpk, D, Dp, b = CASES[name]
    xs, cu = packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    cfg = config(max(lengths), D, Dp, b, None, warmup=True)
    dout, dkl = incoming(xs[2], Hp, seed=1)
    with monkeypatch.context() as mp:
        _poison_new_buffers(mp)
        mine = _run(cute_be, xs, cu, cfg, dout, dkl)
    theirs = _run(triton_be, xs, cu, cfg, dout, dkl)
    exact, same = references(*xs, None, cu, cfg, dout, dkl)
    check(mine, exact, same, label="cute ")
    check(theirs, exact, same, label="triton ")


def test_cute_warmup_deterministic_same_bits(monkeypatch):
    cute_be, _ = _cute()
    lengths, H, Hkv, Hp, Hpk, D, Dp, b = CASES["anchor-wide"]
    xs, cu = packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    cfg = config(max(lengths), D, Dp, b, None, warmup=True)
    cfg = dataclasses.replace(cfg, deterministic=True)
    dout, dkl = incoming(xs[2], Hp, seed=2)
    runs = []
    for _ in range(2):
        with monkeypatch.context() as mp:
            _poison_new_buffers(mp)
            runs.append(_run(cute_be, xs, cu, cfg, dout, dkl))
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key
    exact, same = references(*xs, None, cu, cfg, dout, dkl)
    check(runs[0], exact, same)


@pytest.mark.parametrize("batch", [False, True])
def test_msa_attention_warmup_auto_runs_cute(batch, monkeypatch):
    """``msa_attention(warmup=True)`` on ``auto`` runs the CuTe warmup on sm_90 (its forward
    and backward are called), its forward without a host synchronization,
    ``FLASH_MSA_BACKEND=cute`` accepts it, and it matches the forced Triton warmup (bf16,
    relative difference < 2e-2: the A/B measured <= 5e-3)."""
    _cute()
    from flash_msa.cute import warmup as cute_warmup
    from harness import no_host_sync

    calls = []
    for op in ("fwd", "bwd"):
        real = getattr(cute_warmup, op)

        def spy(*a, _real=real, _op=op, **kw):
            calls.append(_op)
            return _real(*a, **kw)

        monkeypatch.setattr(cute_warmup, op, spy)

    B, S, H, Hkv, Hp, Hpk, D, Dp = 2, 3000, 16, 2, 4, 1, 128, 128
    xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    kw = {}
    if not batch:  # the same tokens as two packed sequences of different lengths
        xs = [x.reshape(B * S, *x.shape[2:]) for x in xs]
        kw = dict(cu_seqlens=testing.cu((S + 700, S - 700), "cuda"), max_seqlen=S + 700)
    leaves = [x.detach().requires_grad_() for x in xs]
    flash_msa.msa_attention(*leaves, 16, warmup=True, compute_kl=True, **kw)  # compiles
    with no_host_sync():
        out, kl = flash_msa.msa_attention(*leaves, 16, warmup=True, compute_kl=True, **kw)
    rows = Hp * out.numel() // (H * D)
    loss = testing.training_loss(out, kl, rows, seed=3)
    mine = [out, kl, *torch.autograd.grad(loss, leaves)]
    assert calls.count("fwd") == 2 and calls.count("bwd") == 1, calls  # auto ran CuTe's
    with backends.forced("triton"):
        out2, kl2 = flash_msa.msa_attention(*leaves, 16, warmup=True, compute_kl=True, **kw)
        loss2 = testing.training_loss(out2, kl2, rows, seed=3)
        theirs = [out2, kl2, *torch.autograd.grad(loss2, leaves)]
    with backends.forced("cute"):  # the forced backend accepts the warmup (no BackendError)
        flash_msa.msa_attention(*leaves, 16, warmup=True, compute_kl=True, **kw)
    for n, m, t in zip(("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv"), mine, theirs):
        rel = ((m.float() - t.float()).abs().max() / t.float().abs().max()).item()
        assert rel < 2e-2, (n, rel)
