"""CPU tests of the dense warmup on CuTe (``flash_msa/cute/warmup.py``): the
block lists (``worklist.causal_blocks``) against a plain loop, on the meta device (no data read
on the host: capture-safe), the warmup as the sparse op over them in the reference (the
semantics' "KL over every visible key" is the sparse KL with every causal block kept), the
grouped combine against the one-level combine (Triton's under the interpreter), and the
resolution: the CuTe reason within / over the list budget, ``borrowed_reason`` at top_k > 64.

The dense warmup on CuTe in the cases its GPU tests do not reach, on the CPU (the CuTe kernels do
not run here: the grouped combine runs with a torch combine of the stage contract, the backward with
a stand-in kernel).

- the grouped combine on the driver's last, shorter chunk (``o_part`` holds more rows than the
  chunk), one head (``H = Hs = 1``), rows whose every slot past group 0 is unused, unused slots
  NaN-filled (the contract: never written, whatever the memory holds);
- the block lists at block 64 and a width above the block count, short and empty sequences;
- the warmup backward without a saved proxy uses the
  forward's kept lists (their heads); the driver borrows (loads) no Triton stage a call never
  runs (``kl`` / ``proxy_partials`` without a proxy).

GPU tests of the dense warmup on CuTe (``flash_msa/cute/warmup.py``: the sparse forward and
the fused backward over every causal block): out, lse, proxy LSE, KL and the five gradients of
``testing.training_loss`` by the rule against the exact reference (fp64), next to the Triton
warmup on the same inputs; batch and varlen (shorter, one-token and empty sequences), one width
within the CuTe combine's 64 slots and one above (the two-level combine); new buffers
NaN-poisoned; deterministic mode bitwise; no host synchronization; ``auto`` picks CuTe.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flash_msa
from flash_msa import backends, reference, sparse_forward, testing, worklist
from flash_msa.problem import Problem, Saved
from harness import (
    check,
    config,
    incoming,
    marked,
    packed_inputs,
    poison_new_buffers,
    references,
    results,
    torch_combine,
)


def _plain(lengths, block, heads, width):
    rows = []
    for n in lengths:
        for i in range(n):
            own = i // block
            rows.append([s if s <= own else -1 for s in range(width)])
    t = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
    return t[:, None, :].expand(len(rows), heads, width)


@pytest.mark.parametrize(
    "lengths, block, width",
    [
        ((256, 256), 64, None),
        ((300, 1, 0, 130, 64), 64, None),
        ((200, 65), 64, 8),
        ((129,), 128, 2),
    ],
)
def test_causal_blocks_match_a_plain_loop(lengths, block, width):
    """Batch (equal lengths) and varlen (shorter, one-token and empty sequences): every causal
    block of the row's own sequence, ascending, the own block present, -1 padded."""
    cu = testing.cu(lengths)
    ms = max(lengths)
    got = worklist.causal_blocks(cu, block, ms, 3, sum(lengths), width)
    W = -(-ms // block) if width is None else width
    assert got.dtype == torch.int32 and got.is_contiguous() and got.shape == (sum(lengths), 3, W)
    assert torch.equal(got, _plain(lengths, block, 3, W))


def test_causal_blocks_shapes_only_and_width_check():
    """On the meta device (no values: an op that reads a tensor on the host, ``.item()`` or
    ``.tolist()``, raises there), so the builder needs no host synchronization; a width below
    the block count is a ValueError naming it."""
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    got = worklist.causal_blocks(cu, 128, 1000, 4, 3000, 64)
    assert got.shape == (3000, 4, 64) and got.device.type == "meta"
    with pytest.raises(ValueError, match="width"):
        worklist.causal_blocks(testing.cu((10,)), 4, 10, 1, 10, 2)


def test_warmup_is_the_sparse_op_over_every_causal_block():
    """The reference's warmup (``indices=None``: the causal mask) and its sparse op over the
    lists give the same out, lse, proxy LSE, KL and gradients, bit for bit (the same mask),
    varlen with a sequence shorter than max_seqlen; at the CuTe width (rounded up, -1 padded)
    too."""
    lengths, H, Hkv, Hp, D, b = (150, 40, 1), 4, 2, 2, 16, 32
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, 1, D, D, dtype=torch.float64, device="cpu"
    )
    cfg = config(max(lengths), D, D, b, None, warmup=True)
    dense = reference.fwd(q, k, v, None, cu, cfg, qp, kp)
    for width in (None, 8):
        idx = worklist.causal_blocks(cu, b, max(lengths), Hp, sum(lengths), width)
        scfg = dataclasses.replace(cfg, warmup=False, top_k=idx.shape[2])
        sparse = reference.fwd(q, k, v, idx, cu, scfg, qp, kp)
        for name, a, c in zip(("out", "lse", "proxy_lse", "kl"), dense, sparse):
            assert torch.equal(a, c), name


def _combine_inputs(C, H, Hs, K, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    own = torch.randint(0, K, (C,), generator=g)  # rows with 1 .. K used slots
    slot = torch.arange(K)
    idx = torch.where(slot[None, :] <= own[:, None], slot[None, :], -1).to(torch.int32)
    idx = idx[:, None, :].expand(C, Hs, K).contiguous()
    o = torch.randn(C, H, K, D, generator=g, dtype=torch.float32)
    lp = torch.randn(C, H, K, generator=g, dtype=torch.float32) * 3
    pl = torch.randn(C, Hs, K, generator=g, dtype=torch.float32) * 3
    return o, lp, pl, idx


@pytest.mark.parametrize("with_proxy", [True, False])
def test_grouped_combine_equals_one_level(with_proxy):
    """The warmup's two-level combine (groups of 64 slots, then the groups) equals the
    one-level merge of all K slots (fp32: to rounding), rows with 1 .. K used slots; the proxy
    LSE in the same call or not. Runs the levels with a torch combine of the stage contract
    (the CuTe combine's two launches are checked on the GPU: tests/ops/test_warmup.py)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import warmup

    C, H, Hs, K, D = 9, 4, 2, 192, 16
    o, lp, pl, idx = _combine_inputs(C, H, Hs, K, D)
    want_out, want_lse = torch.empty(C, H, D), torch.empty(C, H)
    want_plse = torch.empty(C, Hs)
    torch_combine(o, lp, idx, want_out, want_lse, (pl, want_plse))
    out, lse, plse = testing.poisoned((C, H, D), torch.float32, "cpu"), torch.empty(C, H), None
    stage = warmup.grouped_combine(torch_combine)
    if with_proxy:
        plse = torch.full((C, Hs), torch.nan)
        stage(o, lp, idx, out, lse, (pl, plse))
        torch.testing.assert_close(plse, want_plse, rtol=1e-6, atol=1e-6)
    else:
        stage(o, lp, idx, out, lse)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


def _problem(S, B=1, *, warmup=True, top_k=None, H=16, Hkv=2, Hs=4, kl=True):
    cfg = dataclasses.replace(config(S, 128, 128, 128, top_k, warmup=warmup), compute_kl=kl)
    return Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=H,
        num_kv_heads=Hkv, head_dim=128, num_sel_heads=Hs, num_proxy_k_heads=1,
        proxy_head_dim=128, varlen=False, cfg=cfg, num_seqs=B,
    )  # fmt: skip


def test_cute_warmup_reason_within_and_over_the_budget():
    """The CuTe warmup runs (no reason) at the anchor layout up to 64K (5 GiB of lists) and the
    paper layout at 32K; over ``LIST_BYTES`` the reason names the bound (auto then runs the
    Triton warmup); the top_k its sparse ops run is the width (blocks rounded up to 64)."""
    pytest.importorskip("cutlass")
    from flash_msa import cute
    from flash_msa.cute import warmup

    assert warmup.width(8192, 128) == 64 and warmup.width(5000, 128) == 40
    assert warmup.width(8193, 128) == 128 and warmup.width(65536, 128) == 512
    for S, B in ((8192, 4), (16384, 1), (32768, 1), (65536, 1)):
        for op in ("fwd", "bwd"):
            assert cute.unsupported_reason(op, _problem(S, B)) is None, (S, B, op)
    assert cute.unsupported_reason("fwd", _problem(32768, H=64, Hkv=4)) is None  # paper
    assert warmup.list_bytes(65536, 4, 65536, 128) == 5 << 30  # 40 B x 2**27 entries
    for op in ("fwd", "bwd"):
        why = cute.unsupported_reason(op, _problem(65536, 2))
        assert why is not None and "LIST_BYTES" in why and "10.00 GiB" in why, why
    assert "query map" in warmup.reason("fwd", dataclasses.replace(_problem(8192), q_map=True))


def test_borrowed_reason_only_for_stages_the_driver_calls(monkeypatch):
    """``proxy_partials`` is not borrowed when the partials make the proxy LSE (CuTe), nor
    ``kl`` without the KL: no Triton limits (max_top_k 64) for them; a stage that is borrowed
    still adds them (the CuTe combine stops at 64 slots: a sparse call at top_k 128 gets
    Triton's reason; the warmup's grouped combine does not borrow it)."""
    pytest.importorskip("cutlass")
    from flash_msa import backends, cute
    from flash_msa.cute import warmup

    stages = cute.forward_stages()
    assert stages.proxy_partials is None and stages.partials_make_proxy
    assert sparse_forward.borrowed_names(stages) == ()
    big = _problem(16384, warmup=False, top_k=128)
    assert sparse_forward.borrowed_reason(stages, big) is None
    assert sparse_forward.borrowed_names(cute.forward_stages(proxy_fits=False)) == (
        "proxy_partials",
    )
    no_kl = cute.forward_stages(kl_fits=False)
    assert sparse_forward.borrowed_names(no_kl) == ("kl",)
    assert sparse_forward.borrowed_names(no_kl, compute_kl=False) == ()
    monkeypatch.setattr(backends, "interpreting", lambda: True)  # Triton "available" on CPU
    assert "top_k 128 > 64" in sparse_forward.borrowed_reason(no_kl, big)
    assert cute.call_stages(big).combine is None  # 128 slots: over the CuTe combine's 64
    assert "top_k 128 > 64" in cute.unsupported_reason("fwd", big)  # Triton's combine
    scfg = warmup.sparse_config(_problem(16384).cfg)
    st = warmup.stages(*cute.meta_inputs(dataclasses.replace(big, cfg=scfg)), scfg)
    assert sparse_forward.borrowed_names(st) == ()


def _lists_of(own: torch.Tensor, Hs: int, K: int) -> torch.Tensor:
    slot = torch.arange(K)
    idx = torch.where(slot[None, :] <= own[:, None], slot[None, :], -1).to(torch.int32)
    return idx[:, None, :].expand(own.numel(), Hs, K).contiguous()


@pytest.mark.parametrize("H, Hs, K", [(1, 1, 128), (4, 2, 192), (2, 2, 256)])
def test_grouped_combine_of_a_short_last_chunk_ignores_unused_slots(H, Hs, K):
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


def test_causal_blocks_pad_every_slot_past_the_own_block():
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


def test_warmup_backward_reuses_the_forward_lists_without_a_proxy():
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


MARKS_GPU_CUTE_WARMUP = [
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


def _run(be, xs, cu, cfg, dout, dkl):
    qp, kp, q, k, v = xs
    f = be.fwd(q, k, v, None, cu, cfg, qp, kp)
    saved = Saved(q, k, v, f.out, f.lse, None, qp, kp, f.proxy_lse)
    return results(f, be.bwd(dout, dkl, saved, cu, cfg))


@marked(MARKS_GPU_CUTE_WARMUP)
@pytest.mark.parametrize("name", list(CASES))
def test_cute_warmup_matches_reference_and_triton(name, monkeypatch):
    cute_be, triton_be = _cute()
    lengths, H, Hkv, Hp, Hpk, D, Dp, b = CASES[name]
    xs, cu = packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    cfg = config(max(lengths), D, Dp, b, None, warmup=True)
    dout, dkl = incoming(xs[2], Hp, seed=1)
    with monkeypatch.context() as mp:
        poison_new_buffers(mp)
        mine = _run(cute_be, xs, cu, cfg, dout, dkl)
    theirs = _run(triton_be, xs, cu, cfg, dout, dkl)
    exact, same = references(*xs, None, cu, cfg, dout, dkl)
    check(mine, exact, same, label="cute ")
    check(theirs, exact, same, label="triton ")


@marked(MARKS_GPU_CUTE_WARMUP)
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
            poison_new_buffers(mp)
            runs.append(_run(cute_be, xs, cu, cfg, dout, dkl))
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key
    exact, same = references(*xs, None, cu, cfg, dout, dkl)
    check(runs[0], exact, same)


@marked(MARKS_GPU_CUTE_WARMUP)
@pytest.mark.parametrize("batch", [False, True])
def test_msa_attention_warmup_auto_runs_cute(batch, monkeypatch):
    """``msa_attention(warmup=True)`` on ``auto`` runs the CuTe warmup on sm_90 (its forward
    and backward are called), its forward without a host synchronization,
    ``FLASH_MSA_BACKEND=cute`` accepts it, and it matches the forced Triton warmup (bf16,
    relative difference < 2e-2; measured <= 5e-3)."""
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
