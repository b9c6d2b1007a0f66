"""GPU tests of the CuTe combine stage (``flash_msa/cute/combine_sm90.py``, launched by
``flash_msa/cute/forward.py``'s ``combine``) on Hopper: the merge of a chunk's per-block
partials by LSE, against the Triton stage it replaces and the fp64 torch math of the contract
(``flash_msa.sparse_forward``), by the harness's rule; and the sparse forward with it in the
driver against the reference.

At bf16 and fp16, each also with the main merge and the proxy LSE in one launch (``proxy=``).
The partial buffers are built by hand: used slots with random LSEs (some ``-inf``: no visible
key), unused slots (index -1, scattered or last, whole rows of them) and ``-inf`` partials left
NaN in ``o_part`` and ``l_part`` (the kernel must not read them), buffers longer than the
chunk (the driver's last chunk), outputs NaN-poisoned (every row must be written).
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_msa import backends, sparse_forward, testing
from harness import (
    CUTE_LAYOUTS,
    FWD,
    SM90,
    check,
    poison_new_buffers,
    references,
    results,
    selected_inputs,
)

pytestmark = SM90

# C tokens, H, Hs, K, D: the anchor and paper layouts, D 64, K 64 (two slots per lane), and
# K that no slot-group count divides (K 5 at D 64: 4 groups; K 33: past 32 lanes)
LAYOUTS = {
    "anchor": (700, 16, 4, 16, 128),
    "paper": (300, 64, 4, 16, 128),
    "D=64-K8": (513, 16, 4, 8, 64),
    "K=64": (257, 16, 4, 64, 128),
    "K=5-D=64": (301, 8, 2, 5, 64),
    "K=33": (130, 4, 4, 33, 128),
    # C * H a multiple of neither 4 nor 8 (the main merge's last partial CTA) and G = 3 (the
    # proxy rows of the fused launch made by every third warp)
    "H=6-Hs=2": (301, 6, 2, 16, 64),
}


def _forward_module():
    """The CuTe forward's host module (``combine``, ``combine_fits``, ``partials``)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import forward

    return forward


def _partials(C, H, Hs, K, D, dtype, seed, extra=3, device="cuda"):
    """``(o_part, l_part, idx)`` of a chunk of C tokens, the buffers ``extra`` tokens longer.

    Rows of idx: a third with the used slots first and -1 last (what the selection writes), a
    third with -1 scattered, a tenth with no used slot (a q_map padding row); per main head,
    a tenth of the used slots have l = -inf and one row in 20 only such slots."""
    g = torch.Generator().manual_seed(seed)
    G = H // Hs
    n_used = torch.randint(0, K + 1, (C, Hs), generator=g)
    n_used[torch.rand((C, Hs), generator=g) < 0.1] = 0
    slot = torch.arange(K)
    used = slot[None, None, :] < n_used[..., None]  # prefix
    scatter = torch.rand((C, Hs), generator=g) < 0.5
    perm = torch.argsort(torch.rand((C, Hs, K), generator=g), dim=-1)
    used = torch.where(scatter[..., None], torch.gather(used, -1, perm), used)
    idx = torch.where(used, torch.randint(0, 1000, (C, Hs, K), generator=g), -1).to(torch.int32)

    used_h = used.repeat_interleave(G, dim=1)  # (C, H, K)
    lse = 4 * torch.randn((C, H, K), generator=g)
    dead = torch.rand((C, H, K), generator=g) < 0.1
    dead |= (torch.rand((C, H), generator=g) < 0.05)[..., None]
    lse = torch.where(dead, -math.inf, lse)
    l_part = torch.full((C + extra, H, K), math.nan)
    l_part[:C] = torch.where(used_h, lse, math.nan)
    o_part = torch.full((C + extra, H, K, D), math.nan)
    live = used_h & ~dead
    o_part[:C] = torch.where(live[..., None], torch.randn((C, H, K, D), generator=g), math.nan)
    return o_part.to(device, dtype), l_part.to(device), idx.to(device)


def _exact(o_part, l_part, idx):
    """The contract's merge in fp64: ``(out, lse)`` (``o_part=None``: ``out`` is ``None``)."""
    C, Hs, K = idx.shape
    H = l_part.shape[1]
    used = idx.repeat_interleave(H // Hs, dim=1) >= 0
    lv = torch.where(used, l_part[:C].double(), -math.inf)
    m = lv.amax(-1)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lv - m[..., None])
    s = w.sum(-1)
    lse = torch.where(s > 0, m + torch.log(torch.where(s > 0, s, 1.0)), -math.inf)
    if o_part is None:
        return None, lse
    o = torch.where((w > 0)[..., None], o_part[:C].double(), 0.0)  # NaN rows are not read
    out = (w[..., None] * o).sum(-2) / torch.where(s > 0, s, 1.0)[..., None]
    return out, lse


def _run(stage, o_part, l_part, idx, dtype, H, D, lse_out=None, **kw):
    C = idx.shape[0]
    out = testing.poisoned((C, H, D), dtype, "cuda") if o_part is not None else None
    lse = testing.poisoned((C, H), torch.float32, "cuda") if lse_out is None else lse_out
    stage(o_part, l_part, idx, out, lse, **kw)
    return out, lse


def _check_lse(name, mine, exact, same):
    """``-inf`` exactly where the exact LSE is (``-inf - -inf`` is not an error of 0), the
    finite entries by the rule."""
    empty = torch.isneginf(exact)
    assert torch.equal(torch.isneginf(mine), empty), name
    assert torch.equal(torch.isneginf(same), empty), name
    testing.assert_close(name, mine[~empty], exact[~empty], same[~empty])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_cute_combine_matches_triton_and_exact(layout, dtype):
    """out and lse of the CuTe stage by the rule against the fp64 merge, Triton's stage as the
    same-dtype result; rows with no visible key: out 0, lse -inf; two runs bitwise equal; the
    LSE-only call (the proxy LSE) the same way; the fused call (main and proxy in one launch)
    too (its sums may round differently from the separate calls')."""
    forward = _forward_module()
    from flash_msa.triton_ref import sparse_fwd

    C, H, Hs, K, D = layout
    o_part, l_part, idx = _partials(C, H, Hs, K, D, dtype, seed=C + K)
    exact_out, exact_lse = _exact(o_part, l_part, idx)
    out, lse = _run(forward.combine, o_part, l_part, idx, dtype, H, D)
    tri_out, tri_lse = _run(sparse_fwd.combine, o_part, l_part, idx, dtype, H, D)
    empty = torch.isneginf(exact_lse)
    assert empty.any() and (~empty).any()
    assert (out[empty] == 0).all()
    testing.assert_close("out", out, exact_out, tri_out, dtype=dtype)
    _check_lse("lse", lse, exact_lse, tri_lse)
    again = _run(forward.combine, o_part, l_part, idx, dtype, H, D)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])

    # the proxy LSE: l_part (C, Hs, K) by the selection heads' own index rows (NaN where
    # unused, as l_part); the buffer longer than the chunk, as the driver's
    pl_part = l_part[:, :: H // Hs].contiguous()
    _, plse = _run(forward.combine, None, pl_part, idx, dtype, Hs, D)
    _, tri_plse = _run(sparse_fwd.combine, None, pl_part, idx, dtype, Hs, D)
    _check_lse("proxy lse", plse, _exact(None, pl_part, idx)[1], tri_plse)

    fused_plse = testing.poisoned((C, Hs), torch.float32, "cuda")
    f_out, f_lse = _run(
        forward.combine, o_part, l_part, idx, dtype, H, D, proxy=(pl_part, fused_plse)
    )
    testing.assert_close("fused out", f_out, exact_out, tri_out, dtype=dtype)
    _check_lse("fused lse", f_lse, exact_lse, tri_lse)
    _check_lse("fused proxy lse", fused_plse, _exact(None, pl_part, idx)[1], tri_plse)


def test_cute_combine_writes_a_misaligned_lse_slice():
    """A chunk's ``lse`` slice that does not start on 16 bytes (Hs 1 and an odd chunk start):
    written through a temporary, the rows around it untouched."""
    forward = _forward_module()
    C, K = 101, 16
    _, l_part, idx = _partials(C, 4, 1, K, 64, torch.bfloat16, seed=3)
    pl_part = l_part[:, :1].contiguous()
    full = testing.poisoned((C + 2, 1), torch.float32, "cuda")
    lse = full[1 : C + 1]
    assert lse.data_ptr() % 16
    forward.combine(None, pl_part, idx, None, lse)
    exact = _exact(None, pl_part, idx)[1]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exact))
    fin = ~torch.isneginf(exact)
    testing.assert_close("lse", lse[fin], exact[fin])
    assert full[0].isnan().all() and full[-1].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CUTE_LAYOUTS.values(), ids=CUTE_LAYOUTS.keys())
@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
def test_cute_forward_with_the_cute_combine_matches_reference(case, dtype, fused):
    """The sparse-forward driver with the CuTe partials and the CuTe combine, its proxy merge in
    the same launch or not (the stages passed explicitly; the rest borrowed from Triton): out,
    lse, proxy LSE and KL by the rule against the fp64 reference; out and lse next to the CuTe
    forward as registered within the rule's tolerance of each other."""
    forward = _forward_module()
    cute_be, why = backends.load("cute")
    assert cute_be is not None, why
    (qp, kp, q, k, v), cu, cfg, idx = selected_inputs(case, dtype=dtype, seed=11)
    H, Hp, D = q.shape[1], qp.shape[1], q.shape[2]
    assert forward.combine_fits(dtype, H, Hp, cfg.top_k, D)
    stages = sparse_forward.Stages(  # fused: as cute.forward_stages gives it
        partials=forward.partials, combine=forward.combine, combine_makes_proxy=fused
    )
    with pytest.MonkeyPatch.context() as mp:
        poison_new_buffers(mp)
        mine = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg)
    check(results(mine), exact, same, FWD, label="cute combine ")
    registered = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    testing.assert_close("out vs registered", mine.out, exact["out"], registered.out)
