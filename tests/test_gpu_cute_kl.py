"""GPU tests of the CuTe KL stage (``flash_msa/cute/bwd_sm90.py``: ``kl``, the fused backward's
kernel in its KL mode) on Hopper: the forward's KL value with the stage on (``cute.KL_ON_CUTE``)
by the rule against the exact reference, next to the Triton forward's; the stage's sum alone
against Triton's stage on the same work list, final LSEs and items split to the kernel's size;
bitwise equal across runs (one fp32 sum per item, added in a fixed order)."""

from __future__ import annotations

import pytest
import torch

from flash_msa import backends, reference, worklist
from harness import CUTE_LAYOUTS as CASES
from harness import check, config, packed_inputs, references, results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _setup(case, dtype, seed):
    pytest.importorskip("cutlass")
    cute_be, why = backends.load("cute")
    assert cute_be is not None, why
    triton_be = backends.load("triton")[0]
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    idx = reference.select(qp, kp, cu, cfg)
    return cute_be, triton_be, (qp, kp, q, k, v), cu, cfg, idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cute_kl_stage_matches_triton_and_reference(case, dtype, monkeypatch):
    """The KL of the CuTe forward with the stage on, by the rule against the fp64 reference
    (and the Triton forward's on the same indices); the stage's sum against Triton's stage on
    the same work list and LSEs (relative 1e-3: both fp32 sums of the same terms); two runs
    bitwise equal; the outputs other than the KL unchanged by the switch."""
    cute_be, triton_be, (qp, kp, q, k, v), cu, cfg, idx = _setup(case, dtype, seed=5)
    from flash_msa import cute
    from flash_msa.cute import bwd_sm90

    exact, same = references(qp, kp, q, k, v, idx, cu, cfg)
    off = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    monkeypatch.setattr(cute, "KL_ON_CUTE", True)
    on = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    tri = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    for name, f in (("cute kl stage", on), ("triton", tri)):
        check(results(f), exact, same, ["kl"], label=f"{name} ")
    for a, b in ((on.out, off.out), (on.lse, off.lse), (on.proxy_lse, off.proxy_lse)):
        assert torch.equal(a, b)

    T = q.shape[0]
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, T)
    mine = bwd_sm90.kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    again = bwd_sm90.kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    theirs = triton_be.forward_stages().kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    assert torch.equal(mine, again)
    assert torch.isfinite(mine)
    rel = (mine - theirs).abs().item() / max(theirs.abs().item(), 1e-6)
    assert rel < 1e-3, (mine.item(), theirs.item())


def test_cute_kl_stage_refuses_the_unit_gradient():
    """This backend's backward makes the proxy gradient: the KL stage refuses to."""
    cute_be, triton_be, (qp, kp, q, k, v), cu, cfg, idx = _setup(CASES["anchor"], torch.bfloat16, 1)
    from flash_msa.cute import bwd_sm90

    f = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, q.shape[0])
    unit = (torch.zeros(qp.shape, device="cuda"), torch.zeros(kp.shape, device="cuda"))
    with pytest.raises(ValueError, match="unit"):
        bwd_sm90.kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg, unit)
