"""GPU tests of the CuTe backend (``pytest -m gpu``; Hopper with nvidia-cutlass-dsl).

Selection: the CuTe kernel against the torch reference and the Triton kernel (same block sets,
near-ties accepted, see ``testing.selection_mismatch``), the index format (ascending, -1 last,
``min(top_k, own + 1)`` entries, the own block kept), every slot written (poisoned output), the
pipeline depth (a constructor argument) not changing the result, no host synchronization, and
the mix that ``auto`` runs (CuTe selection and forward, Triton backward).

Forward: the per-block partials of every kernel variant (``warpgroups``, a constructor
argument) per slot against the reference, unused slots never written; the op in bf16 and fp16,
on drawn run-time sizes, and with the proxy gradient made in its KL pass (what training runs).

Every numeric check is the harness's rule (``flash_msa.testing.assert_close`` through
tests/harness.py): ``err(kernel) <= 2 * err(same-dtype reference) + atol``, both against the
fp64 reference on the same indices; gradients are those of ``testing.training_loss``; output
and partial buffers start NaN-poisoned so that an unwritten row fails.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flash_msa
from flash_msa import backends, reference, testing, worklist
from flash_msa.problem import Problem, Saved
from harness import FWD, GRADS, check, config, incoming, packed_inputs, references, results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


def _cute():
    pytest.importorskip("cutlass")
    module, why = backends.load("cute")
    assert module is not None, why
    assert module.unavailable_reason() is None
    return module


def _poison_new_buffers(mp):
    """Every buffer made by ``torch.empty`` / ``torch.empty_like`` while the op runs (its
    outputs and the driver's partial buffers among them) starts poisoned (``testing.poison``)."""
    real_empty, real_like = torch.empty, torch.empty_like
    mp.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    mp.setattr(torch, "empty_like", lambda *a, **kw: testing.poison(real_like(*a, **kw)))


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------
def _select_case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random"):
    (qp, kp, *_), cu = packed_inputs(
        lengths, 1, 1, Hp, Hpk, 1, Dp, dtype=dtype, device="cuda", seed=seed, kind=kind
    )
    return qp, kp, cu, config(max(lengths), 16, Dp, b, top_k)


def _select_into_poisoned(qp, kp, cu, cfg, **variant):
    """The CuTe selection into a poisoned index buffer (every slot must be written)."""
    from flash_msa.cute import select_sm90

    out = testing.poisoned((qp.shape[0], qp.shape[1], cfg.top_k), torch.int32, "cuda")
    return select_sm90.select_into(out, qp, kp, cu, cfg, **variant)


def _check_format(idx, cu, b):
    """Ascending valid entries, then -1; min(K, own + 1) of them; the own block among them."""
    T, Hp, K = idx.shape
    lens = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(n, device=idx.device) for n in lens])  # sequence-local
    own = (pos // b)[:, None, None]
    valid = idx >= 0
    n_valid = valid.sum(-1)
    assert (n_valid == torch.clamp(own[..., 0] + 1, max=K)).all(), "entry count"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 only after the valid entries"
    big = torch.where(valid, idx, torch.iinfo(torch.int32).max)
    assert (big[..., 1:] > big[..., :-1])[valid[..., 1:]].all(), "ascending, no duplicates"
    assert ((idx == own) & valid).any(-1).all(), "own block kept"
    assert (idx[valid] <= own.expand_as(idx)[valid]).all(), "no future block"


SELECT_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16),  # anchor proxy heads
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16),  # varlen, block 64, Dp 64
    ((1500,), 4, 2, 128, 128, 1, torch.float16),  # top_k 1, Hpk 2, fp16
    ((2000, 4000), 8, 2, 64, 128, 16, torch.float16),
    ((4100,), 4, 4, 128, 64, 12, torch.bfloat16),  # top_k not a power of two, block 64
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16),  # top_k 64: lists over two lanes
    ((5000,), 2, 1, 64, 64, 17, torch.float16),  # odd top_k > 16, block 64
    ((6000,), 4, 2, 128, 128, 40, torch.bfloat16),
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-k{c[5]}")
@pytest.mark.parametrize("kind", ["random", "local"])
def test_cute_select_matches_reference_and_triton(case, kind):
    triton_be = backends.load("triton")[0]
    _cute()
    qp, kp, cu, cfg = _select_case(*case, kind=kind)
    idx = _select_into_poisoned(qp, kp, cu, cfg)
    _check_format(idx, cu, cfg.block_size)
    for other in (reference.select(qp, kp, cu, cfg), triton_be.select(qp, kp, cu, cfg)):
        bad = testing.selection_mismatch(
            idx.cpu(), other.cpu(), qp.cpu(), kp.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
        )
        assert bad == 0


@pytest.mark.parametrize("stages", [2, 3, 6])
def test_cute_select_pipeline_depth_does_not_change_the_result(stages):
    """``SelectSm90(stages=...)``: the same scores in the same order, so the same indices."""
    _cute()
    qp, kp, cu, cfg = _select_case((3000, 1, 2100), 4, 1, 128, 64, 24, torch.bfloat16, seed=2)
    default = _select_into_poisoned(qp, kp, cu, cfg)
    assert torch.equal(_select_into_poisoned(qp, kp, cu, cfg, stages=stages), default)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_cute_select_hypothesis_runtime_sizes(data):
    """Run-time sizes (lengths, number of sequences) and a few static ones (top_k, block)."""
    _cute()
    b = data.draw(st.sampled_from([64, 128]), label="block")
    lengths = data.draw(st.lists(st.integers(1, 900), min_size=1, max_size=5), label="lengths")
    top_k = data.draw(st.sampled_from([1, 3, 16, 33]), label="top_k")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    qp, kp, cu, cfg = _select_case(lengths, 4, 1, 64, b, top_k, torch.bfloat16, seed=seed)
    idx = _select_into_poisoned(qp, kp, cu, cfg)
    _check_format(idx, cu, b)
    ref = reference.select(qp, kp, cu, cfg)
    bad = testing.selection_mismatch(
        idx.cpu(), ref.cpu(), qp.cpu(), kp.cpu(), b, cfg.proxy_scale, cu.cpu()
    )
    assert bad == 0


def test_cute_select_keeps_ties_in_block_order():
    """Equal block maxima: the lower block wins a tie, the list order survives evictions."""
    cute_be = _cute()
    S, Dp = 128 * 40, 128
    qp = torch.zeros(S, 1, Dp, dtype=torch.bfloat16, device="cuda")
    qp[:, :, 0] = 1.0
    kp = torch.zeros(S, 1, Dp, dtype=torch.bfloat16, device="cuda")
    kp[::128, :, 0] = torch.tensor([1.0, 2.0, 2.0, 0.5] * 10, dtype=torch.bfloat16)[:, None]
    cu = testing.cu([S], "cuda")
    for top_k in (5, 24):
        cfg = config(S, 16, Dp, 128, top_k)
        got = cute_be.select(qp, kp, cu, cfg)
        assert torch.equal(got, reference.select(qp, kp, cu, cfg)), top_k


def test_cute_select_is_sync_free_and_graph_capturable():
    cute_be = _cute()
    qp, kp, cu, cfg = _select_case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    first = cute_be.select(qp, kp, cu, cfg)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = cute_be.select(qp, kp, cu, cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)  # deterministic
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cute_be.select(qp, kp, cu, cfg)
    qp.copy_(torch.randn_like(qp))
    graph.replay()
    assert torch.equal(captured, cute_be.select(qp, kp, cu, cfg))


def test_auto_runs_the_training_step_on_cute(monkeypatch):
    """``auto`` on Hopper: CuTe selection, forward and fused backward, one training step by the
    rule against the reference on the same indices; forced ``cute`` runs the same step."""
    _cute()
    monkeypatch.setenv("FLASH_MSA_BACKEND", "auto")
    info = next(v for k, v in flash_msa.info()["devices"].items() if k.startswith("cuda"))["ops"]
    assert [info[op]["backend"] for op in ("select", "fwd", "bwd")] == ["cute"] * 3, info
    S, H, Hkv, Hp, Hpk, D, Dp, top_k, seed = 3000, 8, 2, 4, 1, 64, 64, 8, 4
    xs = [
        x.requires_grad_()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", seed=seed)
    ]
    with torch.no_grad():
        idx = flash_msa.select_blocks(xs[0], xs[1], top_k)
        monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
        idx_triton = flash_msa.select_blocks(xs[0], xs[1], top_k)
    assert torch.equal(idx, idx_triton), "a near-tie on these inputs: pick another seed"
    names = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")  # of xs
    qp, kp, q, k, v = (x.detach()[0] for x in xs)
    dout, dkl = incoming(q, Hp, seed)
    cu = testing.cu([S], "cuda")
    exact, same = references(qp, kp, q, k, v, idx[0], cu, config(S, D, Dp, 128, top_k), dout, dkl)
    for backend in ("auto", "cute"):
        monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
        for x in xs:
            x.grad = None
        out, kl = flash_msa.msa_attention(*xs, top_k)
        testing.training_loss(out, kl, Hp * S, seed).backward()
        mine = dict(out=out[0], kl=kl, **{n: x.grad[0] for n, x in zip(names, xs)})
        check(mine, exact, same, ("out", "kl", *GRADS), label=f"{backend} ")


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def _slot_references(q, k, v, idx, cu, cfg):
    """``(exact, same)``: per index slot s, the attention of each (token, head) over slot s's
    block alone, i.e. the partial ``o_part[:, :, s]`` / ``l_part[:, :, s]`` of the driver's
    contract, as ``{"o_part": (T, H, K, D), "l_part": (T, H, K)}`` in fp64 and in the input
    dtype (the reference forward on the one-slot index ``idx[:, :, s:s+1]``)."""
    one = dataclasses.replace(cfg, top_k=1)
    refs = []
    for exact in (True, False):
        xs = [x.double() if exact else x for x in (q, k, v)]
        o, lse = [], []
        for s in range(idx.shape[2]):
            f = reference.fwd(*xs, idx[:, :, s : s + 1].contiguous(), cu, one, upcast=exact)
            o.append(f.out)
            lse.append(f.lse)
        refs.append(dict(o_part=torch.stack(o, 2), l_part=torch.stack(lse, 2)))
    return refs


PARTIAL_CASES = [  # lengths, H, Hkv, Hp, D, block, top_k, chunk (first token, end)
    ((4096,), 16, 2, 4, 128, 128, 16, (0, 4096)),  # anchor heads
    ((3000, 1, 700), 8, 4, 2, 64, 64, 8, (1000, 3300)),  # varlen, Hp < Hkv, a later chunk
    ((2048,), 64, 4, 4, 128, 128, 16, (0, 2048)),  # paper heads (R = 4 sub-groups)
]


@pytest.mark.parametrize("case", PARTIAL_CASES, ids=["anchor", "varlen-chunk", "paper"])
def test_cute_forward_partials_match_reference(case):
    """The driver stage ``partials`` with ``FwdPartialsSm90(warpgroups=1, 2, 3)``: every
    kept (token, head, slot) row of a query chunk by the rule against the reference's attention
    over that slot's block; rows of unused slots stay unwritten (poisoned)."""
    _cute()
    from flash_msa.cute import fwd_partials_sm90

    lengths, H, Hkv, Hp, D, b, top_k, (c0, c1) = case
    T = sum(lengths)
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, 1, D, D, dtype=torch.bfloat16, device="cuda", seed=5
    )
    cfg = config(max(lengths), D, D, b, top_k)
    idx = reference.select(qp, kp, cu, cfg)
    wl = worklist.build(idx[c0:c1], cu, b, worklist.ITEM_TOKENS, c0, T)
    kept = (idx[c0:c1] >= 0).repeat_interleave(H // Hp, dim=1)  # (C, H, K)
    exact, same = (
        {n: x[c0:c1][kept] for n, x in r.items()} for r in _slot_references(q, k, v, idx, cu, cfg)
    )
    for warpgroups in (1, 2, 3):
        mine = dict(
            o_part=testing.poisoned((c1 - c0, H, top_k, D), q.dtype, "cuda"),
            l_part=testing.poisoned((c1 - c0, H, top_k), torch.float32, "cuda"),
        )
        fwd_partials_sm90.partials(
            q, k, v, wl, mine["o_part"], mine["l_part"], cfg, c0, warpgroups=warpgroups
        )
        assert mine["l_part"][~kept].isnan().all() and mine["o_part"][~kept].isnan().all()
        check({n: x[kept] for n, x in mine.items()}, exact, same, label=f"wg{warpgroups} ")


def _fwd_case(lengths, H, Hkv, Hp, D, b, top_k, dtype, seed):
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, 1, D, D, dtype=dtype, device="cuda", seed=seed
    )
    cfg = config(max(lengths), D, D, b, top_k)
    return qp, kp, q, k, v, cu, cfg, reference.select(qp, kp, cu, cfg)


def _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx, proxy_grad=False):
    """The CuTe forward op with every buffer it allocates poisoned."""
    with pytest.MonkeyPatch.context() as mp:
        _poison_new_buffers(mp)
        return cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=proxy_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_forward_op_matches_reference(dtype):
    """The CuTe forward op (registered for sm_90): out, lse, proxy LSE and KL by the rule."""
    cute_be = _cute()
    qp, kp, q, k, v, cu, cfg, idx = _fwd_case((3000, 1, 900), 16, 2, 4, 128, 128, 8, dtype, 0)
    mine = _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx)
    check(results(mine), *references(qp, kp, q, k, v, idx, cu, cfg), FWD)


@pytest.mark.parametrize("kl_stage", ["triton", "cute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_forward_proxy_gradient_in_kl_pass_matches_reference(dtype, kl_stage, monkeypatch):
    """Training's path when the backward runs on Triton: the CuTe forward with
    ``proxy_grad=True`` makes the unit proxy gradient in its KL pass, the Triton stage's even
    where the CuTe KL stage would run (``cute.KL_ON_CUTE``; it cannot make the gradient:
    ``sparse_forward.with_proxy_grad``), and the Triton backward scales it by ``dkl``. Every
    forward output, all five gradients of ``testing.training_loss`` and the unit gradient by
    the rule, with the switch either way."""
    from flash_msa import cute

    monkeypatch.setattr(cute, "KL_ON_CUTE", kl_stage == "cute")
    cute_be = _cute()
    triton_be = backends.load("triton")[0]
    qp, kp, q, k, v, cu, cfg, idx = _fwd_case((2500, 700), 16, 2, 4, 128, 128, 8, dtype, 6)
    fwd = _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx, proxy_grad=True)
    assert fwd.proxy_grad is not None, "the forward did not make the proxy gradient"
    Hp = qp.shape[1]
    dout, dkl = incoming(q, Hp, seed=6)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    grads = triton_be.bwd(dout, dkl, saved, cu, cfg)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl)
    check(results(fwd, grads), exact, same)
    # the unit gradient itself, scaled as the loss scales it (in the proxy's dtype's rounding)
    for name, unit in zip(("dq_proxy", "dk_proxy"), fwd.proxy_grad):
        testing.assert_close(name, unit * dkl, exact[name], same[name], dtype=dtype)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_cute_forward_hypothesis_runtime_sizes(data):
    """The registered CuTe forward (via the backend module, as ``auto`` calls it) on drawn
    lengths / varlen splits, top_k, block, head layout and dtype, by the rule against the
    reference; partial buffers and outputs are poisoned so unwritten rows fail."""
    cute_be = _cute()
    lengths = data.draw(st.lists(st.integers(1, 1500), min_size=1, max_size=4), label="lengths")
    # one-token sequences only: every row sees one key, the KL is exactly 0 and the rule's atol
    # with it (the check could not fail, and any rounding would)
    assume(max(lengths) > 1)
    b = data.draw(st.sampled_from([64, 128]), label="block")
    top_k = data.draw(st.sampled_from([1, 5, 16, 33]), label="top_k")
    H, Hkv, Hp = data.draw(
        st.sampled_from([(16, 2, 4), (8, 4, 2), (64, 4, 4), (4, 4, 4), (16, 16, 4)]), label="heads"
    )
    D = data.draw(st.sampled_from([64, 128]), label="D")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="dtype")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    qp, kp, q, k, v, cu, cfg, idx = _fwd_case(lengths, H, Hkv, Hp, D, b, top_k, dtype, seed)
    prob = Problem(
        device_type="cuda",
        capability=(9, 0),
        dtype=dtype,
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=D,
        num_sel_heads=Hp,
        num_proxy_k_heads=1,
        proxy_head_dim=D,
        varlen=True,
        cfg=cfg,
        num_seqs=len(lengths),
    )
    assert cute_be.unsupported_reason("fwd", prob) is None
    mine = _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx)
    check(results(mine), *references(qp, kp, q, k, v, idx, cu, cfg), FWD)


def test_cute_forward_is_sync_free_and_graph_capturable():
    """The CuTe forward op runs under sync-debug "error" and replays from a CUDA graph."""
    cute_be = _cute()
    qp, kp, q, k, v, cu, cfg, idx = _fwd_case(
        (3000, 1000), 16, 2, 4, 128, 128, 8, torch.bfloat16, 3
    )
    cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.out, eager.out) and torch.equal(captured.kl, eager.kl)
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert torch.equal(captured.out, cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp).out)
