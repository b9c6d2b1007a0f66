"""Triton kernels against the reference, on CPU under the interpreter (or on a GPU).

The interpreter computes fp32 and fp16 correctly but not bf16 (toolchain notes), so CPU runs use
fp32 and fp16. Every numeric check is the harness's rule (``flash_msa.testing.assert_close``):
``err(kernel) <= 2 * err(same-dtype reference) + atol``, both against the fp64 reference on the
same indices (tests/harness.py), with gradients of ``testing.training_loss``.

GPU tests (``pytest -m gpu``): every GPU backend against the reference, the training step
itself, CUDA graphs, memory.

Numbers by the harness's rule (``flash_msa.testing.assert_close``): ``err(kernel) <= 2 *
err(same-dtype reference) + atol``, both against the fp64 reference on the kernel's own indices
(tests/harness.py), gradients of ``testing.training_loss`` (O(1) in all five inputs).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flash_msa
from flash_msa import backends, reference, testing
from flash_msa.problem import Config, Saved
from harness import (
    FWD,
    GRADS,
    check,
    config,
    incoming,
    marked,
    no_host_sync,
    packed_inputs,
    poison_new_buffers,
    references,
    results,
)

MARKS_MSA = pytest.mark.skipif(
    not (torch.cuda.is_available() or backends.interpreting()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------
def _select_case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random"):
    from flash_msa.triton_ref import selection

    (qp, kp, *_), cu = packed_inputs(
        lengths, 1, 1, Hp, Hpk, 1, Dp, dtype=dtype, device=DEV, seed=seed, kind=kind
    )
    cfg = Config(
        block_size=b, softmax_scale=1.0, max_seqlen=max(lengths), proxy_scale=Dp**-0.5, top_k=top_k
    )
    out = testing.poisoned((sum(lengths), Hp, top_k), torch.int32, DEV)
    selection.select_into(out, qp, kp, cu, cfg)
    ref = reference.select(qp.cpu(), kp.cpu(), cu.cpu(), cfg)
    return out.cpu(), ref, qp.cpu(), kp.cpu(), cu.cpu()


@marked(MARKS_MSA)
@pytest.mark.parametrize(
    "lengths, Hp, Hpk, Dp, b, top_k",
    [
        ((300,), 4, 1, 16, 64, 3),  # anchor-like grouping G=4, partial last block
        ((70, 1, 200), 2, 2, 32, 128, 2),  # varlen, G=1, a 1-token sequence
        ((257,), 3, 1, 16, 64, 5),  # G=3 (rows not a power of two per token)
        ((200, 140), 2, 1, 16, 64, 9),  # top_k > visible blocks for most rows
        ((0, 150, 0, 90, 0), 4, 2, 16, 64, 2),  # Hp > Hpk > 1; empty sequences
    ],
)
def test_select_fp32_equals_reference(lengths, Hp, Hpk, Dp, b, top_k):
    out, ref, *_ = _select_case(lengths, Hp, Hpk, Dp, b, top_k, torch.float32)
    assert (out != testing.POISON_INT).all(), "unwritten entries"
    assert torch.equal(out, ref)


@marked(MARKS_MSA)
def test_select_fp16_equals_reference_up_to_near_ties():
    out, ref, qp, kp, cu = _select_case((400,), 4, 1, 32, 64, 4, torch.float16, seed=3)
    assert (out != testing.POISON_INT).all()
    assert testing.selection_mismatch(out, ref, qp, kp, 64, 32**-0.5, cu) == 0


@marked(MARKS_MSA)
def test_select_ties_go_to_lower_block():
    from flash_msa.triton_ref import selection

    T, b = 5 * 64, 64
    qp = torch.zeros(T, 2, 16, device=DEV)  # every score 0: all blocks tie
    kp = torch.randn(T, 1, 16, device=DEV)
    cfg = Config(block_size=b, softmax_scale=1.0, max_seqlen=T, proxy_scale=0.25, top_k=3)
    out = selection.select(qp, kp, testing.cu([T], DEV), cfg).cpu()
    assert torch.equal(out, reference.select(qp.cpu(), kp.cpu(), testing.cu([T]), cfg))
    assert out[T - 1, 0].tolist() == [0, 1, 4]


@marked(MARKS_MSA)
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
def _fwd_bwd(
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed=1, in_fwd=False, warmup=False,
    tables=None, deterministic=False,
):  # fmt: skip
    """Forward and backward of one problem by the Triton ops, and the two references.

    ``in_fwd``: the proxy gradient comes from the forward's KL pass (``proxy_grad=True``, what
    training takes) instead of the backward's own pass. ``tables``: the tile candidates
    (``triton_ref.tiles.Tables``; default the shipped ones). ``deterministic``: the ordered
    sums (``Config.deterministic``). Returns ``(mine, exact, same)``.
    """
    import dataclasses

    from flash_msa import triton_ref

    tables = triton_ref.SHIPPED if tables is None else tables

    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=DEV, seed=seed
    )
    cfg = config(max(lengths), D, Dp, b, top_k, warmup=warmup)
    cfg = dataclasses.replace(cfg, deterministic=deterministic)
    idx = None if warmup else reference.select(qp, kp, cu, cfg)
    fwd = triton_ref.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=in_fwd, tables=tables)
    assert (fwd.proxy_grad is not None) == in_fwd
    dout, dkl = incoming(q, Hp, seed)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    grads = triton_ref.bwd(dout, dkl, saved, cu, cfg, tables=tables)
    return (results(fwd, grads), *references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl))


FWD_BWD_CASES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    ((300,), 8, 2, 4, 1, 16, 16, 64, 3),  # Hp > Hkv, partial last block
    ((70, 1, 200), 4, 4, 2, 1, 16, 32, 128, 2),  # varlen, Hp < Hkv (a group spans 2 KV heads)
    ((190,), 4, 1, 2, 2, 32, 16, 64, 2),  # Hpk = Hp, Dp != D
    ((150, 0, 110), 8, 2, 4, 2, 16, 16, 64, 2),  # Hp > Hpk > 1, an empty sequence
    ((0, 130), 4, 2, 2, 1, 16, 16, 64, 2),  # the first sequence empty
]
CASE_IDS = ["300-Hp>Hkv", "70x1x200-Hp<Hkv", "190-Hpk=Hp", "150x0x110-Hp>Hpk>1", "0x130"]


@marked(MARKS_MSA)
@pytest.mark.parametrize("in_fwd", [False, True], ids=["grad-pass", "grad-in-fwd"])
@pytest.mark.parametrize("case", FWD_BWD_CASES, ids=CASE_IDS)
def test_fwd_bwd_fp32_equals_reference(case, in_fwd, monkeypatch):
    poison_new_buffers(monkeypatch)
    check(*_fwd_bwd(*case, torch.float32, in_fwd=in_fwd))


@marked(MARKS_MSA)
def test_fwd_in_query_chunks_equals_reference(monkeypatch):
    """Small PARTIAL_BYTES forces several query chunks (the path that keeps 1M tokens in memory);
    chunk edges fall inside sequences and on the empty one."""
    from flash_msa import sparse_forward

    poison_new_buffers(monkeypatch)
    monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", 40 * 8 * 3 * 16 * 4)  # ~40-token chunks
    check(*_fwd_bwd((70, 1, 0, 200), 8, 2, 4, 2, 16, 16, 64, 3, torch.float32, in_fwd=True))


# (rows, keys per program, dQ / O column slices, proxy-pass prefetch), proxy gradient in the
# forward. Where the gradient is made does not depend on the tile (test_fwd_bwd_fp32 covers
# both at the default tiles): both for the first tile, one each for the others.
SMALL_TILES = [
    ((32, 32, 2, True), False),
    ((32, 32, 2, True), True),
    ((64, 32, 4, False), True),
    ((32, 64, 1, True), False),
    ((64, 64, 4, False), True),
]


@marked(MARKS_MSA)
@pytest.mark.parametrize(
    "tile, in_fwd",
    SMALL_TILES,
    ids=[f"{'grad-in-fwd' if f else 'grad-pass'}-{'x'.join(map(str, t))}" for t, f in SMALL_TILES],
)
def test_fwd_bwd_with_split_key_blocks_equals_reference(tile, in_fwd, monkeypatch):
    """The other tile candidates (tiles.pick takes them on a GPU when larger ones spill): key
    blocks split over block // BN programs, fewer MMA rows, dQ and O in column slices, the
    proxy pass without prefetch, in every sparse pass."""
    from flash_msa.triton_ref.tiles import Tables

    rows, keys, split, prefetch = tile
    poison_new_buffers(monkeypatch)
    tables = Tables(
        bwd=((rows, keys, split),), proxy=((rows, keys, prefetch),), fwd=((rows, split),)
    )
    # one of two layouts per tile (alternating over SMALL_TILES: each layout meets tiles of
    # both proxy-gradient paths and of split and whole key blocks)
    cases = [((300,), 8, 2, 4, 2, 16, 16, 64, 3), ((70, 1, 200), 4, 4, 2, 1, 16, 32, 128, 2)]
    case = cases[SMALL_TILES.index((tile, in_fwd)) % 2]
    check(*_fwd_bwd(*case, torch.float32, in_fwd=in_fwd, tables=tables))


@marked(MARKS_MSA)
def test_fwd_bwd_fp16_tolerance_rule(monkeypatch):
    poison_new_buffers(monkeypatch)
    check(*_fwd_bwd((260,), 8, 2, 4, 2, 32, 32, 64, 3, torch.float16, in_fwd=True))


# Head groups that are not powers of two: G2 = H / max(Hp, Hkv) main heads per (selection
# head, KV head), padded to G2P rows per token in the MMA tiles (worklist.padded_geometry);
# and head dim 256. lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k, proxy gradient in the
# forward, deterministic
WIDE_CASES = {
    "G2=7-Qwen2.5-7B": ((150,), 28, 4, 4, 1, 16, 16, 64, 2, True, False),  # 28 / 4 heads
    "G2=5-varlen-Hp>Hpk>1": ((0, 70, 1, 60), 20, 4, 4, 2, 16, 16, 64, 2, False, False),
    "G2=6-Dp!=D": ((140,), 12, 2, 2, 1, 16, 32, 128, 2, True, False),
    "G2=3-Hp<Hkv": ((130,), 12, 4, 2, 1, 16, 16, 64, 2, False, False),  # 2 KV heads (R = 2)
    "G2=3-Hp>Hkv-det": ((130,), 24, 2, 8, 2, 16, 16, 64, 2, True, True),
    "D=256": ((100,), 4, 2, 2, 1, 256, 128, 64, 2, True, False),
    "D=256-G2=7-det": ((70,), 28, 4, 4, 1, 256, 128, 64, 2, False, True),
}


@marked(MARKS_MSA)
@pytest.mark.parametrize("case", WIDE_CASES.values(), ids=WIDE_CASES.keys())
def test_fwd_bwd_padded_head_groups_and_d256_equal_reference(case, monkeypatch):
    """The sparse forward (partials, proxy LSE, KL value), the backward and the proxy gradient
    of layouts whose head group is padded: the padded rows add nothing to the teacher (its mean
    is over the G real heads), the LSEs, dK/dV or any atomic, and write nothing (poisoned
    buffers)."""
    *shape, in_fwd, det = case
    poison_new_buffers(monkeypatch)
    check(*_fwd_bwd(*shape, torch.float32, in_fwd=in_fwd, deterministic=det))


@marked(MARKS_MSA)
def test_padded_head_groups_in_several_sub_groups_equal_reference(monkeypatch):
    """Tiles of 64 rows: H 12, Hkv 2, Hp 2 (G2 = 6) runs in R = 2 padded sub-groups of 3 heads
    (G2P = 4) in every sparse pass, the teacher's second key tile loaded per sub-group."""
    from flash_msa.triton_ref.tiles import Tables
    from flash_msa.worklist import padded_geometry

    assert padded_geometry(12, 2, 2, 64) == (6, 3, 4, 2, 16)
    poison_new_buffers(monkeypatch)
    tables = Tables(bwd=((64, 64, 1),), proxy=((64, 64, True),), fwd=((64, 1),))
    check(*_fwd_bwd((140,), 12, 2, 2, 1, 16, 16, 64, 2, torch.float32, tables=tables))


@marked(MARKS_MSA)
@given(st.data())
def test_fwd_bwd_hypothesis(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(0, 2 * b + 5), min_size=1, max_size=2), label="lens")
    if max(lengths) < 2:  # no call without tokens; one key per row: KL = 0, dq = 0 (can't fail)
        lengths = [*lengths, 2]
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    Hp = data.draw(st.sampled_from([1, 2, 4]), label="Hp")
    Hpk = data.draw(st.sampled_from([h for h in (1, 2) if Hp % h == 0]), label="Hpk")
    H = max(Hp, Hkv) * data.draw(st.sampled_from([1, 2]), label="H/max(Hp,Hkv)")
    top_k = data.draw(st.integers(1, 4), label="top_k")
    seed = data.draw(st.integers(0, 1000), label="seed")
    in_fwd = data.draw(st.booleans(), label="proxy grad in fwd")
    with pytest.MonkeyPatch.context() as mp:  # hypothesis and function-scoped fixtures don't mix
        poison_new_buffers(mp)
        case = _fwd_bwd(lengths, H, Hkv, Hp, Hpk, 16, 16, b, top_k, torch.float32, seed, in_fwd)
    check(*case)


# ---------------------------------------------------------------------------------------------
# warmup: dense causal attention and the KL over every visible key
# ---------------------------------------------------------------------------------------------
WARMUP_CASES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp
    ((150, 1, 70), 8, 2, 4, 1, 16, 16),
    ((130,), 4, 4, 2, 2, 32, 16),
    ((100,), 8, 1, 2, 1, 16, 32),
    ((90, 0, 60), 8, 2, 4, 2, 16, 16),
]


@marked(MARKS_MSA)
@pytest.mark.parametrize(
    "case", WARMUP_CASES, ids=["varlen-Hp>Hkv", "Hp<Hkv", "Dp!=D", "Hp>Hpk>1-empty-seq"]
)
def test_warmup_fp32_equals_reference(case, monkeypatch):
    poison_new_buffers(monkeypatch)
    lengths, H, Hkv, Hp, Hpk, D, Dp = case
    check(*_fwd_bwd(lengths, H, Hkv, Hp, Hpk, D, Dp, 64, None, torch.float32, 2, warmup=True))


# padded head groups and head dim 256 in the warmup's kernels (the proxy pass, and in
# deterministic mode its key-outer dk_proxy kernel): lengths, H, Hkv, Hp, Hpk, D, Dp,
# deterministic, the dense tile (rows, keys, warps): 128 rows hold G2 = 7 heads in G2P = 8
# slots, 64 rows G2 = 6 in two sub-groups of 3 in 4 slots, and G2 = 3 in 4
WARMUP_WIDE_CASES = {
    "G2=7": ((130, 0, 40), 28, 4, 4, 1, 16, 16, False, (128, 32, 4)),
    "G2=6-det": ((120,), 12, 2, 2, 1, 16, 16, True, (64, 32, 4)),
    "D=256-G2=3": ((90,), 12, 4, 4, 1, 256, 128, False, (64, 64, 4)),
}


@marked(MARKS_MSA)
@pytest.mark.parametrize("case", WARMUP_WIDE_CASES.values(), ids=WARMUP_WIDE_CASES.keys())
def test_warmup_padded_head_groups_and_d256_equal_reference(case, monkeypatch):
    from flash_msa.triton_ref.tiles import Tables

    *shape, det, tile = case
    poison_new_buffers(monkeypatch)
    kw = dict(warmup=True, deterministic=det, tables=Tables(dense=(tile,)))
    check(*_fwd_bwd(*shape, 64, None, torch.float32, 2, **kw))


@marked(MARKS_MSA)
def test_warmup_with_the_smallest_tiles_equals_reference():
    from flash_msa.triton_ref.tiles import Tables

    case = ((150, 1, 70), 8, 2, 4, 2, 16, 16, 64, None, torch.float32, 2)
    check(*_fwd_bwd(*case, warmup=True, tables=Tables(dense=((32, 32, 4),))))


@marked(MARKS_MSA)
def test_warmup_fp16_tolerance_rule():
    check(*_fwd_bwd((200,), 8, 2, 4, 1, 32, 32, 64, None, torch.float16, 2, warmup=True))


# ---------------------------------------------------------------------------------------------
# through the public API
# ---------------------------------------------------------------------------------------------
def _sparse_attention(name, q, k, v, idx, dout):
    """``sparse_attention`` on backend ``name`` with fresh leaves: out, lse and dq, dk, dv of
    ``(out * dout).sum()``."""
    import flash_msa

    with backends.forced(name):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flash_msa.sparse_attention(*leaves, idx, block_size=64, return_lse=True)
        (out.to(dout.dtype) * dout).sum().backward()
    return dict(out=out.detach(), lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)


@marked(MARKS_MSA)
def test_sparse_attention_empty_rows_and_future_blocks():
    """Given indices: rows with no visible key (all -1, or only a future block) give out = 0,
    lse = -inf and zero gradients, and everything else matches the reference by the rule."""
    qp, kp, q, k, v = testing.make_inputs(1, 200, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=5)
    q, k, v = (x.to(DEV) for x in (q, k, v))
    idx = torch.full((1, 200, 2, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = torch.arange(200) // 64  # head 0: own block only
    idx[0, :60, 1, 0] = 2  # head 1, rows 0..59: a future block only (no visible key)
    idx[0, 130:, 1, :] = torch.tensor([0, 2], dtype=torch.int32)  # rows 130..: a past + own block
    idx = idx.to(DEV)
    dout = testing.loss_weights(q.shape, 1, seed=0, device=DEV)[0]
    mine = _sparse_attention("triton", q, k, v, idx, dout)
    same = _sparse_attention("torch", q, k, v, idx, dout)
    exact = _sparse_attention("torch", *(x.double() for x in (q, k, v)), idx, dout.double())
    empty = torch.zeros(1, 200, 4, dtype=torch.bool, device=DEV)
    empty[0, :130, 2:] = True  # head 1's main heads (2, 3), rows 0..129
    assert (mine["out"][empty] == 0).all() and torch.isneginf(mine["lse"][empty]).all()
    assert torch.equal(torch.isneginf(exact["lse"]), empty)
    for name in ("out", "lse"):  # lse only where finite: -inf - -inf is not an error of 0
        check({name: mine[name][~empty]}, {name: exact[name][~empty]}, {name: same[name][~empty]})
    check(mine, exact, same, ["dq", "dk", "dv"])


@marked(MARKS_MSA)
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
    runs = {
        "anchor": ok,
        # head groups that are not powers of two: Qwen2.5-7B's 28 / 4 heads (G2 = 7), 40 / 8
        # (5), 48 / 8 (6), 24 / 8 (3); 16 per (selection head, KV head); head dim 256
        "G2=7": dataclasses.replace(ok, num_heads=28, num_kv_heads=4),
        "G2=5": dataclasses.replace(ok, num_heads=40, num_kv_heads=8, num_sel_heads=8),
        "G2=6": dataclasses.replace(ok, num_heads=48, num_kv_heads=8, num_sel_heads=8),
        "G2=3": dataclasses.replace(ok, num_heads=24, num_kv_heads=8, num_sel_heads=8),
        "G2=16": dataclasses.replace(ok, num_heads=64, num_kv_heads=4),
        "D=256": dataclasses.replace(ok, head_dim=256),
    }
    for what, prob in runs.items():
        for op in ("select", "fwd", "bwd"):
            assert triton_ref.unsupported_reason(op, prob) is None, (what, op)
    cases = {
        "sm_75": dataclasses.replace(ok, capability=(7, 5)),
        "head_dim 512": dataclasses.replace(ok, head_dim=512),
        "proxy head_dim 256": dataclasses.replace(ok, proxy_head_dim=256),
        "top_k 65": dataclasses.replace(ok, cfg=dataclasses.replace(cfg, top_k=65)),
        "70000 sequences": dataclasses.replace(ok, num_seqs=70000),
        "float64": dataclasses.replace(ok, dtype=torch.float64),
        "17 main heads": dataclasses.replace(ok, num_heads=34, num_kv_heads=2, num_sel_heads=2),
        "H must be a multiple": dataclasses.replace(ok, num_heads=18),
    }
    for what, prob in cases.items():
        why = triton_ref.unsupported_reason("fwd", prob)
        assert why is not None and what in why, (what, why)


@marked(MARKS_MSA)
def test_packing_invariance_on_triton():
    """out and main grads the same packed or alone (the same kernels; fp32 rounding apart: the
    rule with atol only), proxy grads and KL after the 1/R factor of the mean over rows."""
    import flash_msa

    lengths, Hp = (70, 1, 0, 150), 2
    T = sum(lengths)
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, 4, 2, Hp, 1, 16, 16, dtype=torch.float32, device=DEV, seed=9
    )
    dout, w = testing.loss_weights(q.shape, Hp * T, seed=9, device=DEV)

    def run(parts, d, w, cu=None):
        leaves = [x.clone().requires_grad_() for x in parts]
        with backends.forced("triton"):
            out, kl = flash_msa.msa_attention(
                *leaves, 2, block_size=64, cu_seqlens=cu, max_seqlen=None if cu is None else 150
            )
        ((out * d).sum() + w * kl).backward()
        names = ("out", "kl", *GRADS[3:], *GRADS[:3])  # the inputs' order: proxy first
        return dict(zip(names, (out, kl, *(x.grad for x in leaves))))

    packed = run((qp, kp, q, k, v), dout, w, cu)
    r_kl, starts = 0.0, cu.tolist()
    for s0, n in zip(starts, lengths):
        if n == 0:
            continue
        sl = slice(s0, s0 + n)
        # the same weight per row: the proxy gradients of both runs carry w / R = w_s / R_s
        alone = run([x[sl][None] for x in (qp, kp, q, k, v)], dout[sl][None], w * n / T)
        for name in ("out", *GRADS):
            mine = packed[name][sl]
            testing.assert_close(f"{name}[{s0}:]", mine, alone[name][0].detach(), can_fail=n > 1)
        r_kl += Hp * n * alone["kl"].item()
    testing.assert_close("R*kl", torch.tensor(Hp * T * packed["kl"].item()), torch.tensor(r_kl))


@marked(MARKS_MSA)
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


@marked(MARKS_MSA)
def test_compute_kl_false_skips_the_kl_pass_and_keeps_its_gradient(monkeypatch):
    """``compute_kl=False`` on Triton: the forward runs no KL stage and returns ``kl is None``
    (the op returns 0), and the proxy gradient of that 0 equals the gradient of the exact KL
    (the backward's own proxy pass)."""
    import flash_msa
    from flash_msa import sparse_forward
    from flash_msa.triton_ref import proxy, sparse_fwd

    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    xs = testing.make_inputs(1, 200, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=5)
    qp, kp, q, k, v = (x[0].to(DEV) for x in xs)
    cu = testing.cu([200], DEV)
    cfg = Config(
        block_size=64, softmax_scale=0.25, max_seqlen=200, proxy_scale=0.25, top_k=2,
        compute_kl=False,
    )  # fmt: skip
    idx = reference.select(qp, kp, cu, cfg)
    calls = []
    monkeypatch.setattr(proxy, "kl", lambda *a, **kw: calls.append(1))
    res = sparse_forward.fwd(sparse_fwd.forward_stages(), q, k, v, idx, cu, cfg, qp, kp, True)
    assert res.kl is None and res.proxy_grad is None and calls == []
    monkeypatch.undo()
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    leaves = [[x.clone().requires_grad_() for x in xs] for _ in range(2)]
    _, kl0 = flash_msa.msa_attention(*leaves[0], 2, block_size=64, compute_kl=False)
    _, kl1 = flash_msa.msa_attention(*leaves[1], 2, block_size=64)
    assert kl0.item() == 0.0 and kl1.item() > 0.01
    (300 * kl0).backward()
    (300 * kl1).backward()
    for name, a, b in zip(("dq_proxy", "dk_proxy"), leaves[0], leaves[1]):
        testing.assert_close(name, a.grad, b.grad, dtype=torch.float32)


@marked(MARKS_MSA)
def test_driver_with_partials_from_another_stage(monkeypatch):
    """The sparse-forward driver with a backend that supplies only the main partials (as the
    CuTe backend does): the proxy LSE partials, combine and KL are borrowed from Triton's
    stages, and the result equals the all-Triton forward bit for bit."""
    from flash_msa import sparse_forward
    from flash_msa.triton_ref import forward_stages, sparse_fwd

    poison_new_buffers(monkeypatch)
    lengths, H, Hkv, Hp, D, b, top_k = (70, 1, 200), 8, 2, 4, 16, 64, 3
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, 1, D, D, dtype=torch.float32, device=DEV
    )
    cfg = config(max(lengths), D, D, b, top_k)
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
    for name, a, r in zip(FWD, mine, ref):
        assert torch.equal(a, r), name


@marked(MARKS_MSA)
def test_driver_with_a_combine_that_makes_the_proxy_lse(monkeypatch):
    """A combine stage with ``combine_makes_proxy`` (the CuTe combine's fused launch) is called
    once per chunk with ``(pl_part, proxy_lse)`` and never for the proxy alone; here it runs
    Triton's two merges, so the result equals the all-Triton forward bit for bit. A borrowed
    combine keeps the lender's two calls."""
    from flash_msa import sparse_forward
    from flash_msa.triton_ref import forward_stages, sparse_fwd

    poison_new_buffers(monkeypatch)
    lengths, H, Hkv, Hp, D, b, top_k = (70, 1, 200), 8, 2, 4, 16, 64, 3
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, 1, D, D, dtype=torch.float32, device=DEV
    )
    cfg = config(max(lengths), D, D, b, top_k)
    idx = reference.select(qp, kp, cu, cfg)
    tri = forward_stages()
    calls = []

    def fused(o_part, l_part, idx, out, lse, proxy=None):
        calls.append(proxy is not None)
        assert o_part is not None and proxy is not None
        tri.combine(o_part, l_part, idx, out, lse)
        tri.combine(None, proxy[0], idx, None, proxy[1])

    stages = sparse_forward.Stages(partials=tri.partials, combine=fused, combine_makes_proxy=True)
    mine = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp)
    ref = sparse_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp)
    assert calls == [True]
    for name, a, r in zip(FWD, mine, ref):
        assert torch.equal(a, r), name
    lent = sparse_forward.borrowed(sparse_forward.Stages(partials=tri.partials))
    assert lent.combine is tri.combine and not lent.combine_makes_proxy


MARKS_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BACKENDS = ["triton"]
DTYPES = [torch.bfloat16, torch.float16]


def _module(name):
    return backends.load(name)[0]


def _case(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed=0, kind="random", warmup=False):
    xs, cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed, kind=kind
    )
    return xs, cu, config(max(lengths), D, Dp, b, top_k, warmup=warmup)


def _check_after_selection(be, qp, kp, q, k, v, idx, cu, cfg, seed=0):
    """fwd and bwd of backend ``be`` on given indices (``None``: warmup) against the references
    by the rule. The forward is asked for the proxy gradient (``proxy_grad=True``) as a
    training step asks it, and the backward gets what it made."""
    fwd = be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True)
    dout, dkl = incoming(q, qp.shape[1], seed)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    grads = be.bwd(dout, dkl, saved, cu, cfg)
    check(results(fwd, grads), *references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl))


SHAPES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    ((2048,), 16, 2, 4, 1, 128, 128, 128, 16),  # anchor heads
    ((8192,), 16, 2, 4, 1, 128, 128, 128, 16),
    ((3000, 1, 0, 700, 129), 8, 4, 2, 1, 64, 64, 64, 8),  # varlen, Hp < Hkv, block 64
    ((1500,), 8, 1, 4, 2, 64, 128, 128, 64),  # Hp > Hkv, top_k 64, Dp != D
    ((4096,), 64, 4, 4, 1, 128, 128, 128, 16),  # paper heads (G2 = 16)
    # head groups padded to a power of two in the Triton kernels (worklist.padded_geometry)
    ((4096,), 28, 4, 4, 1, 128, 128, 128, 16),  # Qwen2.5-7B heads, Hp = Hkv (G2 = 7)
    ((3000, 1, 0, 900), 40, 8, 8, 1, 128, 128, 128, 16),  # 40 / 8 heads, varlen (G2 = 5)
    ((2500,), 48, 8, 8, 2, 128, 128, 64, 8),  # 48 / 8 heads, block 64, Hpk 2 (G2 = 6)
    ((3000,), 12, 4, 2, 1, 64, 64, 128, 8),  # Hp < Hkv (G2 = 3, two sub-groups)
    # head dim 256 (Gemma's; Dp at most 128)
    ((2000,), 16, 8, 8, 1, 256, 128, 128, 16),  # Gemma-2/3's 16 / 8 heads, Dp 128
    ((1700, 300), 28, 4, 4, 1, 256, 64, 64, 8),  # D 256 with G2 = 7, Dp 64, block 64
]


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + f"-H{s[1]}")
def test_backend_matches_reference(name, dtype, shape):
    be = _module(name)
    (qp, kp, q, k, v), cu, cfg = _case(*shape, dtype)
    # selection: sets, near-ties accepted
    idx = be.select(qp, kp, cu, cfg)
    ref_idx = reference.select(qp, kp, cu, cfg)
    bad = testing.selection_mismatch(
        idx.cpu(), ref_idx.cpu(), qp.cpu(), kp.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )
    assert bad == 0
    _check_after_selection(be, qp, kp, q, k, v, ref_idx, cu, cfg)


# ---------------------------------------------------------------------------------------------
# the training step: msa_attention forward + backward, as training runs it
# ---------------------------------------------------------------------------------------------
class _Recorder:
    """A backend module whose ``select`` and ``fwd`` record what they returned and were asked."""

    def __init__(self, module, log):
        self._module, self._log = module, log

    def __getattr__(self, name):
        return getattr(self._module, name)

    def select(self, *args, **kw):
        self._log["indices"] = self._module.select(*args, **kw)
        return self._log["indices"]

    def fwd(self, *args, **kw):
        res = self._module.fwd(*args, **kw)
        self._log["proxy_grad"] = (kw.get("proxy_grad"), res.proxy_grad is not None)
        return res


def _spy(monkeypatch):
    """Record, per msa_attention call, the backend each op resolves to (``ran``), the indices
    the selection made (so that the references use the kernel's own selection: two correct
    selections may differ at near-ties) and whether the forward was asked for (and made) the
    proxy gradient."""
    log = {"ran": {}}
    real = backends.resolve

    def resolve(op, problem):
        name, module = real(op, problem)
        log["ran"][op] = name
        return name, _Recorder(module, log)

    def load(name):  # the custom ops load their backend by name
        module, why = real_load(name)
        return (None if module is None else _Recorder(module, log)), why

    real_load = backends.load
    monkeypatch.setattr(backends, "resolve", resolve)
    monkeypatch.setattr(backends, "load", load)
    return log


def _packed(x):
    return x.detach().reshape(-1, *x.shape[-2:])


def _check_step(leaves, out, kl, log, lengths, cfg, seed, label=""):
    """out, kl and the five gradients of ``testing.training_loss(seed)`` of one msa_attention
    call (``leaves`` in the API's order: q_proxy, k_proxy, q, k, v) by the rule, against the
    references on the indices the call selected."""
    qp, kp, q, k, v = (_packed(x) for x in leaves)
    cu = testing.cu(lengths, q.device)
    dout, dkl = incoming(q, qp.shape[1], seed)
    exact, same = references(qp, kp, q, k, v, log["indices"], cu, cfg, dout, dkl)
    grads = [_packed(x.grad) for x in leaves]
    mine = dict(zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), grads), out=_packed(out), kl=kl)
    if cfg.compute_kl:
        check(mine, exact, same, ["out", "kl", *GRADS], label=label)
    else:  # the value is 0, its gradient exact
        assert kl.item() == 0.0, label
        check(mine, exact, same, ["out", *GRADS], label=label)


TRAIN_CASES = {  # (batch, seqlen) or varlen lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    "anchor-batch": ((2, 1024), 16, 2, 4, 1, 128, 128, 128, 4),
    "Hp>Hpk>1-varlen": ([700, 0, 1300, 1], 8, 2, 4, 2, 64, 64, 64, 8),  # empty, 1-token seqs
    "Hp<Hkv-varlen": ([0, 900, 513], 8, 4, 2, 1, 128, 64, 64, 6),  # empty first sequence
    "Hp>Hkv-batch": ((2, 777), 8, 1, 4, 1, 64, 128, 128, 3),  # partial last block, Dp != D
    "Qwen2.5-7B-varlen": ([1500, 0, 700], 28, 4, 4, 1, 128, 128, 128, 8),  # G2 = 7 (padded)
    "D=256-batch": ((2, 1024), 16, 8, 8, 1, 256, 128, 128, 4),  # Gemma's heads, Dp 128
}


@marked(MARKS_GPU)
@pytest.mark.parametrize("backend", ["triton", "cute", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("compute_kl", [True, False], ids=["kl", "no-kl"])
@pytest.mark.parametrize("case", TRAIN_CASES.values(), ids=TRAIN_CASES.keys())
def test_training_step_matches_reference(case, compute_kl, dtype, backend, monkeypatch):
    """msa_attention forward + backward, the path training takes (the forward's KL pass makes
    the proxy gradient when the KL value is computed), out / kl / all five gradients by the
    rule. A forced backend that cannot run an op of the step (cute's backward outside its
    head layouts) skips with its reason; ``auto`` then mixes backends within the step."""
    sizes, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    seed = 3
    heads = (H, Hkv, Hp, Hpk, D, Dp)
    if isinstance(sizes, tuple):  # batch form
        B, S = sizes
        xs = testing.make_inputs(B, S, *heads, dtype=dtype, device="cuda", seed=seed)
        lengths, kw = [S] * B, {}
    else:
        lengths = sizes
        xs, cu = packed_inputs(lengths, *heads, dtype=dtype, device="cuda", seed=seed)
        kw = dict(cu_seqlens=cu, max_seqlen=max(lengths))
    cfg = config(max(lengths), D, Dp, b, top_k, compute_kl=compute_kl)
    log = _spy(monkeypatch)
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    try:
        with backends.forced(backend):
            out, kl = flash_msa.msa_attention(
                *leaves, top_k, block_size=b, compute_kl=compute_kl, **kw
            )
    except flash_msa.BackendError as e:
        if backend == "cute":
            pytest.skip(f"forced cute cannot run the training step: {e}")
        raise
    testing.training_loss(out, kl, Hp * sum(lengths), seed).backward()
    # the training path: the forward was asked for the proxy gradient, and made it with the KL,
    # unless the backward makes it itself (CuTe's fused backward)
    bwd_limits = backends.load(log["ran"]["bwd"])[0].LIMITS["bwd"]
    unfused = not getattr(bwd_limits, "fused_proxy_grad", False)
    assert log["proxy_grad"] == (unfused, compute_kl and unfused), log
    _check_step(leaves, out, kl, log, lengths, cfg, seed, label=f"{log['ran']} ")


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
def test_end_to_end_autograd_and_sync_free(name, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    (qp, kp, q, k, v), cu, _ = _case((1000, 3000), 16, 2, 4, 1, 128, 128, 128, 16, torch.bfloat16)
    leaves = [x.requires_grad_() for x in (qp, kp, q, k, v)]
    kw = dict(cu_seqlens=cu, max_seqlen=3000)
    out, kl = flash_msa.msa_attention(*leaves, 16, **kw)  # warm up (compile) first
    (out.float().sum() + kl).backward()
    with no_host_sync():
        out, kl = flash_msa.msa_attention(*leaves, 16, **kw)
        (out.float().sum() + kl).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
def test_cuda_graph_training_step(name, monkeypatch):
    """A training step captured in a CUDA graph: the replay's out equals the eager step's bit
    for bit, and its kl and five gradients (of testing.training_loss) pass the rule."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    lengths, seed = (1500, 2500), 5
    (qp, kp, q, k, v), cu, cfg = _case(lengths, 16, 2, 4, 1, 128, 128, 128, 8, torch.bfloat16)
    leaves = [x.requires_grad_() for x in (qp, kp, q, k, v)]
    # training_loss's weights, made before the capture (no host-to-device copy inside it)
    dout, w = testing.loss_weights(q.shape, 4 * sum(lengths), seed, "cuda")
    log = _spy(monkeypatch)

    def step():
        for x in leaves:
            x.grad = None
        out, kl = flash_msa.msa_attention(*leaves, 8, cu_seqlens=cu, max_seqlen=2500)
        ((out.float() * dout).sum() + w * kl.float()).backward()
        return out.detach(), kl.detach()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for x in leaves:
        x.grad = None
    with torch.cuda.graph(g):
        graphed = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed[0], eager[0])
    _check_step(leaves, graphed[0], graphed[1], log, lengths, cfg, seed, label="graphed ")


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
def test_memory_grows_linearly(name, monkeypatch):
    """Peak memory and the largest allocation of a training step, S = 32K -> 256K (8x)."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    peaks = {}
    for S in (32768, 262144):
        (qp, kp, q, k, v), cu, _ = _case((S,), 16, 2, 4, 1, 128, 128, 128, 16, torch.bfloat16)
        leaves = [x.requires_grad_() for x in (qp, kp, q, k, v)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=100000)
        out, kl = flash_msa.msa_attention(*leaves, 16, cu_seqlens=cu, max_seqlen=S)
        (out.float().sum() + kl).backward()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        largest = max(
            e["size"] for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"
        )
        peaks[S] = (torch.cuda.max_memory_allocated() - base, largest)
        del out, kl, leaves, qp, kp, q, k, v
        torch.cuda.empty_cache()
    ratio = peaks[262144][0] / peaks[32768][0]
    ratio_largest = peaks[262144][1] / peaks[32768][1]
    print(
        f"(peak, largest allocation) bytes {peaks}: ratios {ratio:.2f}, {ratio_largest:.2f} "
        "for 8x tokens"
    )
    assert ratio <= 8 * 1.15, peaks
    assert ratio_largest <= 8 * 1.15, peaks


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_warmup_matches_reference(name, dtype):
    be = _module(name)
    (qp, kp, q, k, v), cu, cfg = _case(
        (3000, 1, 0, 1100), 16, 2, 4, 1, 128, 128, 128, None, dtype, warmup=True
    )
    _check_after_selection(be, qp, kp, q, k, v, None, cu, cfg)


WARMUP_WIDE = {  # lengths, H, Hkv, Hp, Hpk, D, Dp
    "Qwen2.5-7B": ((2000, 1, 900), 28, 4, 4, 1, 128, 128),  # G2 = 7
    "G2=6": ((1500,), 48, 8, 8, 1, 128, 128),
    "D=256": ((1800, 0, 300), 16, 8, 8, 1, 256, 128),
}


@marked(MARKS_GPU)
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", WARMUP_WIDE.values(), ids=WARMUP_WIDE.keys())
def test_warmup_padded_head_groups_and_d256_match_reference(case, det, dtype, name):
    """The warmup's kernels at head groups padded to a power of two and at head dim 256, with
    the atomic and the ordered (deterministic) proxy gradient."""
    import dataclasses

    be = _module(name)
    (qp, kp, q, k, v), cu, cfg = _case(*case, 128, None, dtype, warmup=True)
    cfg = dataclasses.replace(cfg, deterministic=det)
    _check_after_selection(be, qp, kp, q, k, v, None, cu, cfg)
