"""GPU tests of the CuTe KL stage (``flash_msa/cute/forward.py``: ``kl``; the ``FwdKlSm90``
kernel, ``flash_msa/cute/fwd_kl_sm90.py``) on Hopper: the forward's KL value by the rule against
the exact reference, next to the Triton forward's and to the CuTe forward with Triton's KL stage
passed explicitly; the stage's sum alone against Triton's stage on the same work list and final
LSEs; bitwise equal across runs (one fp32 sum per item, added in a fixed order)."""

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
def test_cute_kl_stage_matches_triton_and_reference(case, dtype):
    """The KL of the CuTe forward, by the rule against the fp64 reference (and the Triton
    forward's on the same indices); where the CuTe stage fits, its sum against Triton's stage
    on the same work list and LSEs (relative 1e-3: both fp32 sums of the same terms), two runs
    bitwise equal, and the outputs other than the KL the same as with Triton's KL stage passed
    to the driver."""
    import dataclasses

    from flash_msa import sparse_forward
    from flash_msa.cute import forward

    cute_be, triton_be, (qp, kp, q, k, v), cu, cfg, idx = _setup(case, dtype, seed=5)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg)
    picked = cute_be.stages_for(q, k, qp, kp, idx, cfg)
    off = sparse_forward.fwd(dataclasses.replace(picked, kl=None), q, k, v, idx, cu, cfg, qp, kp)
    on = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    tri = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    for name, f in (("cute kl stage", on), ("triton", tri)):
        check(results(f), exact, same, ["kl"], label=f"{name} ")
    for a, b in ((on.out, off.out), (on.lse, off.lse), (on.proxy_lse, off.proxy_lse)):
        assert torch.equal(a, b)

    if not forward.kl_fits(q, k, qp, kp, idx, cfg):
        assert picked.kl is None  # Triton's stage (e.g. D != Dp)
        return
    T = q.shape[0]
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, T)
    mine = forward.kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    again = forward.kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    theirs = triton_be.forward_stages().kl(q, k, qp, kp, on.lse, on.proxy_lse, wl, cfg)
    assert torch.equal(mine, again)
    assert torch.isfinite(mine)
    rel = (mine - theirs).abs().item() / max(theirs.abs().item(), 1e-6)
    assert rel < 1e-3, (mine.item(), theirs.item())


def test_cute_kl_stage_refuses_the_unit_gradient():
    """This backend's backward makes the proxy gradient: the KL stage refuses to."""
    cute_be, triton_be, (qp, kp, q, k, v), cu, cfg, idx = _setup(CASES["anchor"], torch.bfloat16, 1)
    from flash_msa.cute import forward

    f = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, q.shape[0])
    unit = (torch.zeros(qp.shape, device="cuda"), torch.zeros(kp.shape, device="cuda"))
    with pytest.raises(ValueError, match="unit"):
        forward.kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg, unit)


# ---------------------------------------------------------------------------------------------
# the KL stage on the forward partials' kernel (fwd_kl_sm90.FwdKlSm90, forward.kl; the CuTe
# forward's kl stage): its sum against the reference and Triton's stage, and in the driver
# ---------------------------------------------------------------------------------------------
# the CUTE layouts with D == Dp (G = H / Hs: anchor 4, paper 16, Hp>Hpk>1-b64 2, G2=1 1,
# D=64-b128 4; empty and one-token sequences; Dp > D is refused: FwdKlSm90.can_implement) and
# G = 8 with short sequences
FWD_MODE_CASES = {
    **{name: c for name, c in CASES.items() if c[5] == c[6]},
    "G=8": ((1200, 5, 0, 640), 32, 4, 4, 1, 128, 128, 128, 8),
}


def _fwd_mode_setup(case, dtype, seed, kind):
    pytest.importorskip("cutlass")
    cute_be, why = backends.load("cute")
    assert cute_be is not None, why
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed, kind=kind
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    idx = reference.select(qp, kp, cu, cfg)
    return cute_be, (qp, kp, q, k, v), cu, cfg, idx


@pytest.mark.parametrize("kind", ["random", "local"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", FWD_MODE_CASES.values(), ids=FWD_MODE_CASES.keys())
def test_cute_kl_fwd_mode_stage(case, dtype, kind):
    """``forward.kl`` (FwdKlSm90, the driver's 256-token items): its sum over the
    rows, as the forward's KL (sum / (Hs T)), by the rule against the fp64 reference on the
    same indices; against Triton's KL stage on the same work list and final LSEs (relative
    1e-3: fp32 sums of the same terms in another order); two runs bitwise equal."""
    from flash_msa.cute import forward

    cute_be, (qp, kp, q, k, v), cu, cfg, idx = _fwd_mode_setup(case, dtype, 11, kind)
    assert forward.kl_fits(q, k, qp, kp, idx, cfg)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg)
    f = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    T, Hs = q.shape[0], qp.shape[1]
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, T)
    mine = forward.kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg)
    again = forward.kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg)
    assert torch.equal(mine, again)
    assert torch.isfinite(mine)
    check({"kl": mine / (Hs * T)}, exact, same, ["kl"], label="cute fwd-mode kl stage ")
    triton_kl = backends.load("triton")[0].forward_stages().kl
    theirs = triton_kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg)
    rel = (mine - theirs).abs().item() / max(theirs.abs().item(), 1e-6)
    assert rel < 1e-3, (mine.item(), theirs.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["anchor", "paper", "G=8"])
def test_cute_kl_fwd_mode_in_the_driver(case, dtype):
    """The CuTe forward's stages with ``kl`` = ``forward.kl`` (what
    ``cute.forward_stages`` runs): the KL by the rule against the
    fp64 reference, every other output bitwise equal to today's stages'; the unit proxy
    gradient still goes to Triton's stage (``with_proxy_grad``)."""
    import dataclasses

    from flash_msa import cute, sparse_forward
    from flash_msa.cute import forward

    cute_be, (qp, kp, q, k, v), cu, cfg, idx = _fwd_mode_setup(
        FWD_MODE_CASES[case], dtype, 3, "random"
    )
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg)
    base = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    stages = dataclasses.replace(cute.forward_stages(), kl=forward.kl, kl_makes_proxy_grad=False)
    on = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp)
    check(results(on), exact, same, ["kl"], label="cute fwd-mode kl in the driver ")
    for a, b in ((on.out, base.out), (on.lse, base.lse), (on.proxy_lse, base.proxy_lse)):
        assert torch.equal(a, b)
    grad = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True)
    assert grad.proxy_grad is not None


def test_cute_kl_fwd_mode_refuses_the_unit_gradient_and_a_query_map():
    """``forward.kl`` refuses the unit gradient and a work list with a query map
    (``kl_fits`` is false for a mapped call: the forward borrows Triton's stage)."""
    from flash_msa.cute import forward

    cute_be, (qp, kp, q, k, v), cu, cfg, idx = _fwd_mode_setup(
        CASES["anchor"], torch.bfloat16, 1, "random"
    )
    f = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    T = q.shape[0]
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, T)
    unit = (torch.zeros(qp.shape, device="cuda"), torch.zeros(kp.shape, device="cuda"))
    with pytest.raises(ValueError, match="unit"):
        forward.kl(q, k, qp, kp, f.lse, f.proxy_lse, wl, cfg, unit)
    q_map = torch.arange(T, dtype=torch.int32, device="cuda")  # the identity map
    mapped = wl._replace(q_map=q_map)
    with pytest.raises(ValueError, match="q_map"):
        forward.kl(q, k, qp, kp, f.lse, f.proxy_lse, mapped, cfg)
    assert not forward.kl_fits(q, k, qp, kp, idx, cfg, mapped=True)
