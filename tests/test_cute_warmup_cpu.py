"""CPU tests of the dense warmup on CuTe (``flash_msa/cute/warmup.py``, issue 14 item 4): the
block lists (``worklist.causal_blocks``) against a plain loop, on the meta device (no data read
on the host: capture-safe), the warmup as the sparse op over them in the reference (the
semantics' "KL over every visible key" is the sparse KL with every causal block kept), the
grouped combine against the one-level combine (Triton's under the interpreter), and the
resolution: the CuTe reason within / over the list budget, ``borrowed_reason`` at top_k > 64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash_msa import reference, sparse_forward, testing, worklist
from flash_msa.problem import Problem
from harness import config, packed_inputs, torch_combine


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
    (the CuTe combine's two launches are checked on the GPU: tests/test_gpu_cute_warmup.py)."""
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
