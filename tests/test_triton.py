"""Triton kernels against the reference, on CPU under the interpreter (or on a GPU).

The interpreter computes fp32 and fp16 correctly but not bf16 (toolchain notes), so CPU runs use
fp32 (exact comparisons) and fp16 (selection compared with the near-tie rule).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_msa import backends, reference, testing
from flash_msa.problem import Config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or backends.interpreting()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _select_case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random"):
    from flash_msa.triton_ref import selection

    T = sum(lengths)
    qp, kp = testing.make_inputs(1, T, 1, 1, Hp, Hpk, 1, Dp, dtype=dtype, seed=seed, kind=kind)[:2]
    qp, kp = qp[0].to(DEV), kp[0].to(DEV)
    cu = _cu(lengths).to(DEV)
    cfg = Config(
        block_size=b, softmax_scale=1.0, max_seqlen=max(lengths), proxy_scale=Dp**-0.5, top_k=top_k
    )
    out = torch.full((T, Hp, top_k), -7, dtype=torch.int32, device=DEV)  # poison
    selection.select_into(out, qp, kp, cu, cfg)
    ref = reference.select(qp.cpu(), kp.cpu(), cu.cpu(), cfg)
    return out.cpu(), ref, qp.cpu(), kp.cpu(), cu.cpu()


@pytest.mark.parametrize(
    "lengths, Hp, Hpk, Dp, b, top_k",
    [
        ((300,), 4, 1, 16, 64, 3),  # anchor-like grouping G=4, partial last block
        ((70, 1, 200), 2, 2, 32, 128, 2),  # varlen, G=1, a 1-token sequence
        ((257,), 3, 1, 16, 64, 5),  # G=3 (rows not a power of two per token)
        ((200, 140), 2, 1, 16, 64, 9),  # top_k > visible blocks for most rows
    ],
)
def test_select_fp32_equals_reference(lengths, Hp, Hpk, Dp, b, top_k):
    out, ref, *_ = _select_case(lengths, Hp, Hpk, Dp, b, top_k, torch.float32)
    assert (out != -7).all(), "unwritten entries"
    assert torch.equal(out, ref)


def test_select_fp16_equals_reference_up_to_near_ties():
    out, ref, qp, kp, cu = _select_case((400,), 4, 1, 32, 64, 4, torch.float16, seed=3)
    assert (out != -7).all()
    assert testing.selection_mismatch(out, ref, qp, kp, 64, 32**-0.5, cu) == 0


def test_select_ties_go_to_lower_block():
    from flash_msa.triton_ref import selection

    T, b = 5 * 64, 64
    qp = torch.zeros(T, 2, 16, device=DEV)  # every score 0: all blocks tie
    kp = torch.randn(T, 1, 16, device=DEV)
    cfg = Config(block_size=b, softmax_scale=1.0, max_seqlen=T, proxy_scale=0.25, top_k=3)
    out = selection.select(qp, kp, _cu([T]).to(DEV), cfg).cpu()
    assert torch.equal(out, reference.select(qp.cpu(), kp.cpu(), _cu([T]), cfg))
    assert out[T - 1, 0].tolist() == [0, 1, 4]


@given(st.data())
def test_select_properties_hypothesis(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 2 * b + 9), min_size=1, max_size=3), label="lens")
    Hpk = data.draw(st.sampled_from([1, 2]), label="Hpk")
    Hp = Hpk * data.draw(st.sampled_from([1, 2, 3]), label="G")
    top_k = data.draw(st.integers(1, 6), label="top_k")
    seed = data.draw(st.integers(0, 1000), label="seed")
    out, ref, *_ = _select_case(lengths, Hp, Hpk, 16, b, top_k, torch.float32, seed=seed)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# forward (+ proxy LSE, KL) and backward, on the reference's indices
# ---------------------------------------------------------------------------------------------
def _poison_empty(monkeypatch):
    """Every float buffer the kernels allocate starts as NaN, so unwritten tiles fail."""
    from flash_msa import sparse_forward

    real = torch.empty

    def empty(*shape, **kw):
        x = real(*shape, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(sparse_forward.torch, "empty", empty)


def _fwd_bwd_case(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed=1, in_fwd=False):
    """Forward and backward of one problem; ``in_fwd``: the proxy gradient comes from the
    forward's KL pass (``proxy_grad=True``) instead of the backward's own pass."""
    from flash_msa.problem import Saved
    from flash_msa.triton_ref import sparse_bwd, sparse_fwd

    T = sum(lengths)
    xs = testing.make_inputs(1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed)
    qp, kp, q, k, v = (x[0].to(DEV) for x in xs)
    cu = _cu(lengths).to(DEV)
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=max(lengths),
        proxy_scale=Dp**-0.5,
        top_k=top_k,
        warmup=False,
        compute_kl=True,
    )
    idx = reference.select(qp, kp, cu, cfg)
    mine = sparse_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=in_fwd)
    assert (mine.proxy_grad is not None) == in_fwd
    f32 = [x.float() for x in (qp, kp, q, k, v)]
    exact = reference.fwd(*f32[2:], idx, cu, cfg, *f32[:2])
    same = reference.fwd(q, k, v, idx, cu, cfg, qp, kp, upcast=False)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=g).to(q)
    dkl = torch.tensor(0.7, device=DEV)
    g_mine = sparse_bwd.bwd(
        dout, dkl, Saved(q, k, v, *mine[:2], idx, qp, kp, *mine[2:3], mine.proxy_grad), cu, cfg
    )
    g_exact = reference.bwd(
        dout.float(), dkl, Saved(*f32[2:], exact[0], exact[1], idx, *f32[:2], exact[2]), cu, cfg
    )
    g_same = reference.bwd(
        dout, dkl, Saved(q, k, v, same[0], same[1], idx, qp, kp, same[2]), cu, cfg
    )
    return mine, exact, same, g_mine, g_exact, g_same


def _check(mine, exact, same, g_mine, g_exact, g_same, rel_atol):
    """err(kernel) <= 2 * err(same-dtype reference) + atol, both against fp32."""

    def err(a, e):
        return (a.double() - e.double()).abs().max().item()

    for name, a, s, e in zip(["out", "lse", "proxy_lse", "kl"], mine, same, exact):
        assert torch.isfinite(a).all(), name
        assert err(a, e) <= 2 * err(s, e) + rel_atol * (1 + e.abs().max().item()), name
    for name, a, s, e in zip(["dq", "dk", "dv", "dq_proxy", "dk_proxy"], g_mine, g_same, g_exact):
        assert torch.isfinite(a).all(), name
        # atol floor of rel_atol (gradients of O(1) inputs): a 1-token sequence has dq ~ 1e-8 of
        # pure cancellation noise in every implementation
        assert err(a, e) <= 2 * err(s, e) + rel_atol * max(1.0, e.abs().max().item()), name


FWD_BWD_CASES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    ((300,), 8, 2, 4, 1, 16, 16, 64, 3),  # Hp > Hkv, partial last block
    ((70, 1, 200), 4, 4, 2, 1, 16, 32, 128, 2),  # varlen, Hp < Hkv (a group spans 2 KV heads)
    ((190,), 4, 1, 2, 2, 32, 16, 64, 2),  # Hpk = Hp, Dp != D
]


@pytest.mark.parametrize("in_fwd", [False, True], ids=["grad-pass", "grad-in-fwd"])
@pytest.mark.parametrize("case", FWD_BWD_CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_fwd_bwd_fp32_equals_reference(case, in_fwd, monkeypatch):
    _poison_empty(monkeypatch)
    _check(*_fwd_bwd_case(*case, torch.float32, in_fwd=in_fwd), rel_atol=1e-5)


def test_fwd_in_query_chunks_equals_reference(monkeypatch):
    """Small PARTIAL_BYTES forces several query chunks (the path that keeps 1M tokens in memory)."""
    from flash_msa import sparse_forward

    _poison_empty(monkeypatch)
    monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", 40 * 8 * 3 * 16 * 4)  # ~40-token chunks
    case = _fwd_bwd_case((70, 1, 200), 8, 2, 4, 1, 16, 16, 64, 3, torch.float32, in_fwd=True)
    _check(*case, rel_atol=1e-5)


SMALL_TILES = [  # rows, keys per program, dQ / O column slices, proxy-pass prefetch
    (32, 32, 2, True),
    (64, 32, 4, False),
    (32, 64, 1, True),
    (64, 64, 4, False),
]


@pytest.mark.parametrize("tile", SMALL_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("in_fwd", [False, True], ids=["grad-pass", "grad-in-fwd"])
def test_fwd_bwd_with_split_key_blocks_equals_reference(tile, in_fwd, monkeypatch):
    """The other tile candidates (tiles.pick takes them on a GPU when larger ones spill): key
    blocks split over block // BN programs, fewer MMA rows, dQ and O in column slices, the
    proxy pass without prefetch, in every sparse pass."""
    from flash_msa.triton_ref import proxy, sparse_bwd, sparse_fwd

    rows, keys, split, prefetch = tile
    _poison_empty(monkeypatch)
    monkeypatch.setattr(sparse_bwd, "BWD_TILES", ((rows, keys, split),))
    monkeypatch.setattr(proxy, "PROXY_TILES", ((rows, keys, prefetch),))
    monkeypatch.setattr(sparse_fwd, "FWD_TILES", ((rows, split),))
    for case in [((300,), 8, 2, 4, 1, 16, 16, 64, 3), ((70, 1, 200), 4, 4, 2, 1, 16, 32, 128, 2)]:
        _check(*_fwd_bwd_case(*case, torch.float32, in_fwd=in_fwd), rel_atol=1e-5)


def test_fwd_bwd_fp16_tolerance_rule(monkeypatch):
    _poison_empty(monkeypatch)
    case = _fwd_bwd_case((260,), 8, 2, 4, 1, 32, 32, 64, 3, torch.float16, in_fwd=True)
    _check(*case, rel_atol=1e-3)


@given(st.data())
def test_fwd_bwd_hypothesis(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 2 * b + 5), min_size=1, max_size=2), label="lens")
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    Hp = data.draw(st.sampled_from([1, 2, 4]), label="Hp")
    H = max(Hp, Hkv) * data.draw(st.sampled_from([1, 2]), label="H/max(Hp,Hkv)")
    top_k = data.draw(st.integers(1, 4), label="top_k")
    seed = data.draw(st.integers(0, 1000), label="seed")
    in_fwd = data.draw(st.booleans(), label="proxy grad in fwd")
    with pytest.MonkeyPatch.context() as mp:  # hypothesis and function-scoped fixtures don't mix
        _poison_empty(mp)
        case = _fwd_bwd_case(
            lengths, H, Hkv, Hp, 1, 16, 16, b, top_k, torch.float32, seed, in_fwd=in_fwd
        )
    _check(*case, rel_atol=1e-5)


# ---------------------------------------------------------------------------------------------
# warmup: dense causal attention and the KL over every visible key
# ---------------------------------------------------------------------------------------------
def _warmup_case(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype, seed=2):
    from flash_msa.problem import Saved
    from flash_msa.triton_ref import dense

    T = sum(lengths)
    xs = testing.make_inputs(1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed)
    qp, kp, q, k, v = (x[0].to(DEV) for x in xs)
    cu = _cu(lengths).to(DEV)
    cfg = Config(
        block_size=64,
        softmax_scale=D**-0.5,
        max_seqlen=max(lengths),
        proxy_scale=Dp**-0.5,
        top_k=None,
        warmup=True,
        compute_kl=True,
    )
    mine = dense.fwd(q, k, v, cu, cfg, qp, kp)
    f32 = [x.float() for x in (qp, kp, q, k, v)]
    exact = reference.fwd(*f32[2:], None, cu, cfg, *f32[:2])
    same = reference.fwd(q, k, v, None, cu, cfg, qp, kp, upcast=False)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)
    dkl = torch.tensor(0.7, device=DEV)
    g_mine = dense.bwd(dout, dkl, Saved(q, k, v, mine[0], mine[1], None, qp, kp, mine[2]), cu, cfg)
    g_exact = reference.bwd(
        dout.float(), dkl, Saved(*f32[2:], exact[0], exact[1], None, *f32[:2], exact[2]), cu, cfg
    )
    g_same = reference.bwd(
        dout, dkl, Saved(q, k, v, same[0], same[1], None, qp, kp, same[2]), cu, cfg
    )
    return mine, exact, same, g_mine, g_exact, g_same


@pytest.mark.parametrize(
    "case",
    [
        ((150, 1, 70), 8, 2, 4, 1, 16, 16),
        ((130,), 4, 4, 2, 2, 32, 16),
        ((100,), 8, 1, 2, 1, 16, 32),
    ],
    ids=["varlen-Hp>Hkv", "Hp<Hkv", "Dp!=D"],
)
def test_warmup_fp32_equals_reference(case, monkeypatch):
    from flash_msa.triton_ref import dense

    real = torch.empty
    monkeypatch.setattr(
        dense.torch,
        "empty",  # NaN-poison every float buffer it allocates
        lambda *a, **kw: (lambda x: x.fill_(float("nan")) if x.is_floating_point() else x)(
            real(*a, **kw)
        ),
    )
    _check(*_warmup_case(*case, torch.float32), rel_atol=1e-5)


def test_warmup_with_the_smallest_tiles_equals_reference(monkeypatch):
    from flash_msa.triton_ref import dense

    monkeypatch.setattr(dense, "DENSE_TILES", ((32, 32, 4),))
    _check(*_warmup_case((150, 1, 70), 8, 2, 4, 1, 16, 16, torch.float32), rel_atol=1e-5)


def test_warmup_fp16_tolerance_rule():
    _check(*_warmup_case((200,), 8, 2, 4, 1, 32, 32, torch.float16), rel_atol=1e-3)


def test_sparse_attention_empty_rows_and_future_blocks(monkeypatch):
    """Given indices: rows with no visible key (all -1, or only a future block) give out = 0,
    lse = -inf and zero gradients, as in the reference."""
    import flash_msa

    qp, kp, q, k, v = testing.make_inputs(1, 200, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=5)
    q, k, v = (x.to(DEV) for x in (q, k, v))
    idx = torch.full((1, 200, 2, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = torch.arange(200) // 64  # head 0: own block only
    idx[0, :60, 1, 0] = 2  # head 1, rows 0..59: a future block only (no visible key)
    idx[0, 130:, 1, :] = torch.tensor([0, 2], dtype=torch.int32)  # rows 130..: a past + own block
    idx = idx.to(DEV)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(0)).to(q)
    res = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("FLASH_MSA_BACKEND", name)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flash_msa.sparse_attention(*leaves, idx, block_size=64, return_lse=True)
        (out * dout).sum().backward()
        res[name] = (out.detach(), lse, *[x.grad for x in leaves])
    t, r = res["triton"], res["torch"]
    assert (t[0][0, 60:130, 2:] == 0).all() and torch.isinf(t[1][0, 60:130, 2:]).all()
    assert torch.isneginf(t[1][0, :60, 2:]).all()
    for a, b in zip(t, r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unsupported_reasons_name_the_limit():
    import dataclasses

    from flash_msa import triton_ref
    from flash_msa.problem import Problem

    cfg = Config(block_size=128, softmax_scale=0.1, max_seqlen=4096, proxy_scale=0.1, top_k=16)
    ok = Problem(
        device_type="cuda",
        capability=(9, 0),
        dtype=torch.bfloat16,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        num_sel_heads=4,
        num_proxy_k_heads=1,
        proxy_head_dim=128,
        varlen=True,
        cfg=cfg,
        num_seqs=8,
    )
    assert all(triton_ref.unsupported_reason(op, ok) is None for op in ("select", "fwd", "bwd"))
    cases = {
        "sm_80": dataclasses.replace(ok, capability=(8, 0)),
        "head_dim 256": dataclasses.replace(ok, head_dim=256),
        "top_k 65": dataclasses.replace(ok, cfg=dataclasses.replace(cfg, top_k=65)),
        "70000 sequences": dataclasses.replace(ok, num_seqs=70000),
        "float64": dataclasses.replace(ok, dtype=torch.float64),
        "3 main heads": dataclasses.replace(ok, num_heads=24, num_kv_heads=8, num_sel_heads=8),
    }
    for what, prob in cases.items():
        why = triton_ref.unsupported_reason("fwd", prob)
        assert why is not None and what in why, (what, why)


def test_packing_invariance_on_triton(monkeypatch):
    """out and main grads identical packed or alone; proxy grads and KL after the 1/R factor."""
    import flash_msa

    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    lengths, Hp = (70, 1, 150), 2
    T = sum(lengths)
    xs = [
        x[0].to(DEV)
        for x in testing.make_inputs(1, T, 4, 2, Hp, 1, 16, 16, dtype=torch.float32, seed=9)
    ]
    dout = torch.randn(T, 4, 16, generator=torch.Generator().manual_seed(9)).to(DEV)

    def run(parts, d, cu=None):
        leaves = [x.clone().requires_grad_() for x in parts]
        out, kl = flash_msa.msa_attention(
            *leaves,
            2,
            block_size=64,
            cu_seqlens=cu,
            max_seqlen=None if cu is None else max(lengths),
        )
        (out * d).sum().add(kl).backward()
        return out.detach(), kl.detach(), [x.grad for x in leaves]

    out, kl, grads = run(xs, dout, _cu(lengths).to(DEV))
    r_kl, s0 = 0.0, 0
    for n in lengths:
        sl = slice(s0, s0 + n)
        o, k_s, g = run([x[sl][None] for x in xs], dout[sl][None])
        torch.testing.assert_close(o[0], out[sl], rtol=1e-5, atol=1e-6)
        for a, b in zip(g[2:], grads[2:]):
            torch.testing.assert_close(a[0], b[sl], rtol=1e-4, atol=1e-6)
        for a, b in zip(g[:2], grads[:2]):
            torch.testing.assert_close(Hp * n * a[0], Hp * T * b[sl], rtol=1e-4, atol=1e-6)
        r_kl += Hp * n * k_s.item()
        s0 += n
    assert abs(r_kl - Hp * T * kl.item()) <= 1e-4 * abs(r_kl)


def test_proxy_gradient_made_by_the_forward_only_when_training(monkeypatch):
    """The forward makes the unit proxy gradient iff the call will need it; the backward then
    scales it (same gradients as the backward's own pass, checked in the fwd/bwd tests)."""
    import flash_msa
    import flash_msa.triton_ref as triton_ref

    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    seen = []
    real = triton_ref.fwd

    def spy(*args, **kw):
        res = real(*args, **kw)
        seen.append((kw.get("proxy_grad"), res.proxy_grad is not None))
        return res

    monkeypatch.setattr(triton_ref, "fwd", spy)
    xs = [x.to(DEV) for x in testing.make_inputs(1, 130, 4, 2, 2, 1, 16, 16, dtype=torch.float32)]
    with torch.no_grad():
        flash_msa.msa_attention(*[x.requires_grad_() for x in xs], 2, block_size=64)
    flash_msa.msa_attention(*xs, 2, block_size=64, compute_kl=False)[1].backward()
    out, kl = flash_msa.msa_attention(*xs, 2, block_size=64)
    kl.backward()
    assert seen == [(False, False), (True, False), (True, True)]
    assert all(x.grad is not None for x in xs[:2])


def test_driver_with_partials_from_another_stage(monkeypatch):
    """The sparse-forward driver with a backend that supplies only the main partials (as the
    CuTe backend does): the proxy LSE partials, combine and KL are borrowed from Triton's
    stages, and the result equals the all-Triton forward bit for bit."""
    from flash_msa import sparse_forward
    from flash_msa.triton_ref import forward_stages, sparse_fwd

    _poison_empty(monkeypatch)
    lengths, H, Hkv, Hp, D, b, top_k = (70, 1, 200), 8, 2, 4, 16, 64, 3
    T = sum(lengths)
    qp, kp, q, k, v = (
        x[0].to(DEV) for x in testing.make_inputs(1, T, H, Hkv, Hp, 1, D, D, dtype=torch.float32)
    )
    cu = _cu(lengths).to(DEV)
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=max(lengths),
        proxy_scale=D**-0.5,
        top_k=top_k,
        warmup=False,
        compute_kl=True,
    )
    idx = reference.select(qp, kp, cu, cfg)
    calls = []

    def main_only(q, k, v, wl, o_part, l_part, cfg, tok0, proxy):
        assert proxy is None  # partials_make_proxy=False: the driver runs proxy_partials
        calls.append(tok0)
        sparse_fwd.partials(q, k, v, wl, o_part, l_part, cfg, tok0)

    stages = sparse_forward.Stages(partials=main_only)
    assert sparse_forward.borrowed(stages).combine is forward_stages().combine
    mine = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp)
    ref = sparse_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp)
    assert calls == [0]
    for name, a, r in zip(["out", "lse", "proxy_lse", "kl"], mine, ref):
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)
