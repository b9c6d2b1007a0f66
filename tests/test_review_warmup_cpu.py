"""Review tests of the dense warmup on CuTe (commit "The dense warmup on CuTe", 5476009): the
cases its GPU tests do not reach, on the CPU (the CuTe kernels do not run here: the grouped
combine runs with a torch combine of the stage contract, the backward with a stand-in kernel).

- the grouped combine on the driver's last, shorter chunk (``o_part`` holds more rows than the
  chunk), one head (``H = Hs = 1``), rows whose every slot past group 0 is unused, unused slots
  NaN-filled (the contract: never written, whatever the memory holds);
- the block lists at block 64 and a width above the block count, short and empty sequences;
- (the review's two findings, mended) the warmup backward without a saved proxy uses the
  forward's kept lists (their heads); the driver borrows (loads) no Triton stage a call never
  runs (``kl`` / ``proxy_partials`` without a proxy).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash_msa import sparse_forward, testing, worklist
from flash_msa.problem import Saved
from harness import config, torch_combine


def _lists_of(own: torch.Tensor, Hs: int, K: int) -> torch.Tensor:
    slot = torch.arange(K)
    idx = torch.where(slot[None, :] <= own[:, None], slot[None, :], -1).to(torch.int32)
    return idx[:, None, :].expand(own.numel(), Hs, K).contiguous()


@pytest.mark.parametrize("H, Hs, K", [(1, 1, 128), (4, 2, 192), (2, 2, 256)])
def test_grouped_combine_last_chunk_one_head_nan_slots(H, Hs, K):
    """``grouped_combine`` on a chunk of C rows of buffers made for ``Cbuf > C`` rows (the
    driver's last chunk), unused slots NaN: equal to the one-level merge; rows whose own block
    is below 64 (every later group unused: level 2 must skip them by their first slot)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import warmup

    Cbuf, C, D = 11, 7, 16
    g = torch.Generator().manual_seed(1)
    own = torch.tensor([0, 5, 63, 64, K - 1, 1, 127 % K])  # 0..63: group 0 only
    idx = _lists_of(own, Hs, K)
    o = torch.randn(Cbuf, H, K, D, generator=g)
    lp = torch.randn(Cbuf, H, K, generator=g) * 3
    pl = torch.randn(Cbuf, Hs, K, generator=g) * 3
    unused = (idx < 0).repeat_interleave(H // Hs, dim=1)
    o[:C][unused] = torch.nan
    lp[:C][unused] = torch.nan
    pl[:C][idx < 0] = torch.nan
    want_out, want_lse, want_plse = torch.empty(C, H, D), torch.empty(C, H), torch.empty(C, Hs)
    torch_combine(o, lp, idx, want_out, want_lse, (pl, want_plse))
    assert torch.isfinite(want_out).all() and torch.isfinite(want_lse).all()
    out, lse = testing.poisoned((C, H, D), torch.float32, "cpu"), torch.full((C, H), torch.nan)
    plse = torch.full((C, Hs), torch.nan)
    warmup.grouped_combine(torch_combine)(o, lp, idx, out, lse, (pl, plse))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plse, want_plse, rtol=1e-6, atol=1e-6)
    # the LSE-only call (a driver whose combine does not make the proxy LSE in one launch)
    lse2 = torch.full((C, Hs), torch.nan)
    warmup.grouped_combine(torch_combine)(None, pl, idx, None, lse2)
    torch.testing.assert_close(lse2, want_plse, rtol=1e-6, atol=1e-6)


def test_causal_blocks_block64_wide_rows():
    """Block 64 at the CuTe width (block count rounded up to 64 above 64, so W > blocks):
    short, one-token and empty sequences, every slot past the own block -1."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import warmup

    lengths, b = (4200, 0, 65, 1, 63), 64
    W = warmup.width(max(lengths), b)
    assert W == 128 > -(-max(lengths) // b)
    got = worklist.causal_blocks(testing.cu(lengths), b, max(lengths), 2, sum(lengths), W)
    pos = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(got, _lists_of(pos // b, 2, W))


def _saved(T, H, Hkv, D, dtype=torch.bfloat16):
    q = torch.zeros(T, H, D, dtype=dtype)
    k = torch.zeros(T, Hkv, D, dtype=dtype)
    return Saved(q, k, k, q, torch.zeros(T, H), None, None, None, None)


def test_warmup_bwd_uses_the_forwards_lists_without_a_saved_proxy():
    """The anchor layout (H 16, Hkv 2, Hp 4), KL on, proxy frozen, main trained: the forward
    (with the proxy, for the KL) keeps its sorted lists (Hs 4); the backward has no saved
    proxy. The lists it hands the kernel should be the ones the forward kept."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import warmup

    lengths, H, Hkv, Hp, D, b = (300, 200), 16, 2, 4, 128, 128
    cu, T = testing.cu(lengths), sum(lengths)
    cfg = config(max(lengths), D, D, b, None, warmup=True)
    fwd_lists = worklist.lists(warmup.lists(cu, cfg, Hp, T), cu, b, 0, T)  # the forward's
    saved = worklist.carry(_saved(T, H, Hkv, D), fwd_lists)
    seen = {}

    def sparse_bwd(dout, dkl, full, cu_seqlens, scfg):
        seen["match"] = worklist.matches(
            worklist.carried(full), full.indices, cu_seqlens, scfg.block_size, T, None
        )

    warmup.bwd(torch.zeros(T, H, D, dtype=torch.bfloat16), None, saved, cu, cfg, sparse_bwd)
    assert seen["match"]


def test_driver_borrows_no_stage_it_does_not_call(monkeypatch):
    """A call without a proxy (the CuTe warmup's forward when the KL is off and the proxy gets
    no gradient): ``kl`` and ``proxy_partials`` are never called, so ``borrowed_reason`` adds
    no Triton limits for them, and the driver should not need the Triton backend for them."""

    def lender():
        raise RuntimeError("the Triton stages were loaded")

    monkeypatch.setattr(sparse_forward, "_lender", lender)

    def partials(q, k, v, wl, o_part, l_part, cfg, tok0, proxy):
        o_part.zero_()
        l_part.zero_()

    stages = sparse_forward.Stages(partials=partials, combine=torch_combine)
    assert sparse_forward.borrowed_names(stages, proxy=False, compute_kl=False) == ()
    T, H, D, b = 40, 2, 16, 16
    cu = testing.cu((T,))
    cfg = dataclasses.replace(config(T, D, D, b, 3), compute_kl=False)
    q = torch.zeros(T, H, D)
    idx = worklist.causal_blocks(cu, b, T, H, T)
    sparse_forward.fwd(stages, q, q[:, :1], q[:, :1], idx, cu, cfg)
