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
from harness import (
    CUTE_LAYOUTS,
    FWD,
    GRADS,
    SM90,
    check,
    config,
    incoming,
    no_host_sync,
    packed_inputs,
    poison_new_buffers,
    references,
    results,
    selected_inputs,
)
from harness import cute_backend as _cute

pytestmark = SM90


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
    from flash_msa.cute import selection

    out = testing.poisoned((qp.shape[0], qp.shape[1], cfg.top_k), torch.int32, "cuda")
    return selection.select_into(out, qp, kp, cu, cfg, **variant)


def _check_rows(idx, own):
    """The index format of rows ``idx`` ``(R, Hp, K)`` whose own blocks are ``own`` ``(R, 1,
    1)``: ascending valid entries, then -1; ``min(K, own + 1)`` of them; the own block among
    them; no future block."""
    valid = idx >= 0
    assert (valid.sum(-1) == torch.clamp(own[..., 0] + 1, max=idx.shape[-1])).all(), "count"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 only after the valid entries"
    big = torch.where(valid, idx, torch.iinfo(torch.int32).max)
    assert (big[..., 1:] > big[..., :-1])[valid[..., 1:]].all(), "ascending, no duplicates"
    assert ((idx == own) & valid).any(-1).all(), "own block kept"
    assert (idx[valid] <= own.expand_as(idx)[valid]).all(), "no future block"


def _check_format(idx, cu, b):
    """:func:`_check_rows` on every row, positions from ``cu``."""
    lens = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(n, device=idx.device) for n in lens])  # sequence-local
    _check_rows(idx, (pos // b)[:, None, None])


SELECT_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16),  # anchor proxy heads
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16),  # varlen, block 64, Dp 64
    ((1500,), 4, 2, 128, 128, 1, torch.float16),  # top_k 1, Hpk 2, fp16
    ((2000, 4000), 8, 2, 64, 128, 16, torch.float16),
    ((4100,), 4, 4, 128, 64, 12, torch.bfloat16),  # top_k not a power of two, block 64
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16),  # top_k 64: the selector's longest list
    ((5000,), 2, 1, 64, 64, 17, torch.float16),  # odd top_k > 16, block 64
    ((6000,), 4, 2, 128, 128, 40, torch.bfloat16),
    ((5000, 77), 4, 1, 128, 64, 64, torch.float16),  # block 64 (two ring slabs), top_k 64
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


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_cute_select_pipeline_depth_does_not_change_the_result(stages):
    """``SelectSm90(stages=...)``: the same scores in the same order, so the same indices. 5 is
    the deepest bf16 Dp=128 pipeline beside the selector's ring (6 at block 64: 235,520 bytes
    of shared memory, past sm_90's 232,448; ``can_implement``)."""
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
    """Equal block maxima: the lower block wins a tie, the list order survives evictions; a
    64-entry list over 40 blocks keeps them all and pads with -1."""
    cute_be = _cute()
    S, Dp = 128 * 40, 128
    qp = torch.zeros(S, 1, Dp, dtype=torch.bfloat16, device="cuda")
    qp[:, :, 0] = 1.0
    kp = torch.zeros(S, 1, Dp, dtype=torch.bfloat16, device="cuda")
    kp[::128, :, 0] = torch.tensor([1.0, 2.0, 2.0, 0.5] * 10, dtype=torch.bfloat16)[:, None]
    cu = testing.cu([S], "cuda")
    for top_k in (5, 24, 64):
        cfg = config(S, 16, Dp, 128, top_k)
        got = cute_be.select(qp, kp, cu, cfg)
        assert torch.equal(got, reference.select(qp, kp, cu, cfg)), top_k


def test_cute_select_is_sync_free_and_graph_capturable():
    cute_be = _cute()
    qp, kp, cu, cfg = _select_case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    first = cute_be.select(qp, kp, cu, cfg)  # compiles
    with no_host_sync():
        again = cute_be.select(qp, kp, cu, cfg)
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
    """The driver stage ``partials`` (``FwdPartialsSm90`` with its shipped warpgroups): every
    kept (token, head, slot) row of a query chunk by the rule against the reference's attention
    over that slot's block; rows of unused slots stay unwritten (poisoned)."""
    _cute()
    from flash_msa.cute import forward

    lengths, H, Hkv, Hp, D, b, top_k, (c0, c1) = case
    T = sum(lengths)
    layout = (lengths, H, Hkv, Hp, 1, D, D, b, top_k)
    (qp, kp, q, k, v), cu, cfg, idx = selected_inputs(layout, dtype=torch.bfloat16, seed=5)
    wl = worklist.build(idx[c0:c1], cu, b, worklist.ITEM_TOKENS, c0, T)
    kept = (idx[c0:c1] >= 0).repeat_interleave(H // Hp, dim=1)  # (C, H, K)
    exact, same = (
        {n: x[c0:c1][kept] for n, x in r.items()} for r in _slot_references(q, k, v, idx, cu, cfg)
    )
    mine = dict(
        o_part=testing.poisoned((c1 - c0, H, top_k, D), q.dtype, "cuda"),
        l_part=testing.poisoned((c1 - c0, H, top_k), torch.float32, "cuda"),
    )
    forward.partials(q, k, v, wl, mine["o_part"], mine["l_part"], cfg, c0)
    assert mine["l_part"][~kept].isnan().all() and mine["o_part"][~kept].isnan().all()
    check({n: x[kept] for n, x in mine.items()}, exact, same)


def _fwd_case(lengths, H, Hkv, Hp, D, b, top_k, dtype, seed):
    layout = (lengths, H, Hkv, Hp, 1, D, D, b, top_k)
    xs, cu, cfg, idx = selected_inputs(layout, dtype=dtype, seed=seed)
    return *xs, cu, cfg, idx


def _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx, proxy_grad=False):
    """The CuTe forward op with every buffer it allocates poisoned."""
    with pytest.MonkeyPatch.context() as mp:
        poison_new_buffers(mp)
        return cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=proxy_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_forward_op_matches_reference(dtype):
    """The CuTe forward op (registered for sm_90): out, lse, proxy LSE and KL by the rule."""
    cute_be = _cute()
    qp, kp, q, k, v, cu, cfg, idx = _fwd_case((3000, 1, 900), 16, 2, 4, 128, 128, 8, dtype, 0)
    mine = _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx)
    check(results(mine), *references(qp, kp, q, k, v, idx, cu, cfg), FWD)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_forward_proxy_gradient_in_kl_pass_matches_reference(dtype):
    """Training's path when the backward runs on Triton: the CuTe forward with
    ``proxy_grad=True`` makes the unit proxy gradient in its KL pass, the Triton stage's even
    where the CuTe KL stage would run (it cannot make the gradient:
    ``sparse_forward.with_proxy_grad``), and the Triton backward scales it by ``dkl``. Every
    forward output, all five gradients of ``testing.training_loss`` and the unit gradient by
    the rule."""
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
    with no_host_sync():
        eager = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
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


# ---------------------------------------------------------------------------------------------
# forward: the proxy LSE partials in the CuTe partials' launch (forward.proxy_fits)
# ---------------------------------------------------------------------------------------------
# lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k: the backward's layouts (harness.CUTE_LAYOUTS)
# and Dp < D
PROXY_LAYOUTS = {
    name: CUTE_LAYOUTS[name] for name in ("anchor", "paper", "Hp>Hpk>1-b64", "Dp>D", "D=64-b128")
}
PROXY_LAYOUTS["Dp<D"] = ((2000, 600), 16, 2, 4, 1, 128, 64, 128, 16)


def _proxy_partials_case(layout, dtype, seed=7):
    """Inputs, config, indices and the work list of a later query chunk (``tok0 = T // 3``)."""
    xs, cu, cfg, idx = selected_inputs(PROXY_LAYOUTS[layout], dtype=dtype, seed=seed)
    T = xs[2].shape[0]
    c0 = T // 3
    wl = worklist.build(idx[c0:], cu, cfg.block_size, worklist.ITEM_TOKENS, c0, T)
    return xs, cfg, idx[c0:], wl, c0


def _cute_partials_into_poisoned(xs, cfg, idx, wl, c0, proxy=True):
    """``(o_part, l_part, pl_part)`` of the CuTe partials stage (with the proxy LSE part when
    ``proxy``, else ``pl_part`` is ``None``), every buffer NaN-poisoned first."""
    from flash_msa.cute import forward

    qp, kp, q, k, v = xs
    C, Hp, K = idx.shape
    H, D = q.shape[1:]
    o = testing.poisoned((C, H, K, D), q.dtype, "cuda")
    lp = testing.poisoned((C, H, K), torch.float32, "cuda")
    pl = testing.poisoned((C, Hp, K), torch.float32, "cuda") if proxy else None
    forward.partials(q, k, v, wl, o, lp, cfg, c0, (qp, kp, pl) if proxy else None)
    return o, lp, pl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", list(PROXY_LAYOUTS))
def test_cute_proxy_partials_match_triton(layout, dtype):
    """``pl_part`` from ``FwdPartialsSm90(proxy=True)`` against Triton's ``proxy_partials``
    stage on the same work list (a later chunk: ``tok0 > 0``), both into NaN-poisoned buffers:
    the same slots written (every used slot, finite: a kept block always has a visible key;
    no unused slot: it has no work-list entry, the partial-buffer contract), and

        |pl(CuTe) - pl(Triton)| <= 1e-5 + 2 * Dp * 2**-23 * proxy_scale * |q_p(t)| * max |k_p|

    per row. Why: both compute z = proxy_scale * q . k as an fp32 sum of Dp products that are
    exact in fp32 (bf16 / fp16 operands), in different orders; each sum is within Dp * u *
    sum |q_i k_i| <= Dp * u * |q| |k| of the exact one (Cauchy-Schwarz; u = 2**-23 allows
    for tensor-core accumulation that truncates), and an LSE moves by at most the largest
    change of its arguments. The 1e-5 covers the rest: the exp sums of <= 128 terms in other
    orders (<= ~40 u relative here), ex2 / lg2 approximations (~2**-22 each)."""
    _cute()
    triton_be = backends.load("triton")[0]
    xs, cfg, idx, wl, c0 = _proxy_partials_case(layout, dtype)
    qp, kp, q, k, _ = xs
    _, _, mine = _cute_partials_into_poisoned(xs, cfg, idx, wl, c0)
    theirs = testing.poisoned(mine.shape, torch.float32, "cuda")
    triton_be.forward_stages().proxy_partials(q, k, qp, kp, wl, theirs, cfg, c0)
    kept = idx >= 0  # (C, Hp, K)
    assert mine[~kept].isnan().all(), "an unused slot was written"
    assert theirs[~kept].isnan().all()
    assert torch.isfinite(mine[kept]).all(), "a used slot unwritten (NaN) or empty (-inf)"
    Hp, Hpk, Dp = qp.shape[1], kp.shape[1], qp.shape[2]
    qn = qp[c0:].float().norm(dim=-1)  # (C, Hp)
    kn = kp.float().norm(dim=-1).amax(0).repeat_interleave(Hp // Hpk)  # (Hp,)
    bound = 1e-5 + 2 * Dp * 2.0**-23 * cfg.proxy_scale * qn * kn
    bound = bound[:, :, None].expand_as(mine)[kept]
    err = (mine[kept] - theirs[kept]).abs()
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), f"err {err[worst]:.3e} > bound {bound[worst]:.3e}"


@pytest.mark.parametrize("layout", ["anchor", "paper", "Dp<D"])
def test_cute_proxy_partials_leave_the_main_partials_unchanged(layout):
    """The main partials of ``FwdPartialsSm90(proxy=True)`` equal the main-only kernel's bit
    for bit (the main part is the same code: its PTX is unchanged, the proxy part runs after
    it), unused rows unwritten in both."""
    _cute()
    xs, cfg, idx, wl, c0 = _proxy_partials_case(layout, torch.bfloat16, seed=8)
    o, lp, _ = _cute_partials_into_poisoned(xs, cfg, idx, wl, c0)
    o0, lp0, _ = _cute_partials_into_poisoned(xs, cfg, idx, wl, c0, proxy=False)
    H, Hp = o.shape[1], idx.shape[1]
    kept = (idx >= 0).repeat_interleave(H // Hp, dim=1)  # (C, H, K)
    assert o[~kept].isnan().all() and lp[~kept].isnan().all()
    assert torch.equal(o[kept], o0[kept]) and torch.equal(lp[kept], lp0[kept])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["anchor", "paper", "Hp>Hpk>1-b64", "Dp>D", "Dp<D"])
def test_cute_forward_op_with_proxy_lse_on_cute_matches_reference(layout, dtype, monkeypatch):
    """The CuTe forward op where ``proxy_fits``: its partials make the proxy LSE partials
    (Triton's ``proxy_partials`` stage, patched to fail, never runs); out, lse, proxy LSE and KL
    by the rule against the reference, every buffer poisoned."""
    from flash_msa.cute import forward
    from flash_msa.triton_ref import sparse_fwd

    def not_this_stage(*args, **kwargs):
        raise AssertionError("Triton's proxy_partials ran: the CuTe partials did not make them")

    monkeypatch.setattr(sparse_fwd, "proxy_partials", not_this_stage)
    cute_be = _cute()
    (qp, kp, q, k, v), cu, cfg, idx = selected_inputs(PROXY_LAYOUTS[layout], dtype=dtype, seed=9)
    assert forward.proxy_fits(q, k, qp, kp, idx, cfg)
    mine = _cute_fwd(cute_be, qp, kp, q, k, v, cu, cfg, idx)
    check(results(mine), *references(qp, kp, q, k, v, idx, cu, cfg), FWD)


# ---------------------------------------------------------------------------------------------
# selection with a query map (context parallelism: SelectSm90(qmap=True))
# ---------------------------------------------------------------------------------------------
def _q_map(kind, lengths, block, seed=0):
    """``(Tq,)`` int32 CUDA query map of ``kind`` over the packed tokens of ``lengths``:
    "zigzag" (rank 0 of the 2-rank layout of ``flash_msa.distributed``: chunks 0 and 3 of every
    sequence, padding rows at the end of a short last chunk), "permuted" (rank 1 of the 4-rank
    layout, its rows and 7 more padding rows in a random order), "random" (a random half of the
    tokens in a random order, one token twice, padding rows between them: a CTA's sorted rows
    then spread over the whole sequence)."""
    from flash_msa import distributed as cp

    cu = testing.cu(lengths)
    T = int(cu[-1])
    g = torch.Generator().manual_seed(seed + T)
    if kind == "zigzag":
        m = cp.layout(2, 0, cu_seqlens=cu, block_size=block).q_map
    elif kind == "permuted":
        m = cp.layout(4, 1, cu_seqlens=cu, block_size=block).q_map
        m = torch.cat([m, torch.full((7,), -1, dtype=m.dtype)])
        m = m[torch.randperm(m.numel(), generator=g)]
    else:
        rows = torch.randperm(T, generator=g)[: T // 2]
        pad = torch.tensor([-1])
        m = torch.cat([rows[:5], rows[:1], pad, rows[5:], pad, pad])
    return m.to(torch.int32).cuda()


def _local_rows(x, q_map):
    """The query rows of a packed ``(T, ...)`` tensor: row ``i`` is token ``q_map[i]``; padding
    rows hold values no key has (their results must not depend on them)."""
    y = x[q_map.long().clamp_min(0)].clone()
    y[q_map < 0] = 7.0
    return y


def _on_tokens(idx, q_map, base):
    """The mapped rows of ``idx`` ``(Tq, Hp, K)`` put at their tokens' rows of ``base`` ``(T,
    Hp, K)`` (a selection of every token): what ``testing.selection_mismatch`` compares (it
    recomputes a row's scores from the token's own q_proxy row)."""
    real = q_map >= 0
    out = base.clone()
    out[q_map[real].long()] = idx[real].to(base.device)
    return out.cpu()


def _check_mapped_format(idx, q_map, cu, b):
    """:func:`_check_rows` on the mapped rows, positions from the map."""
    real = q_map >= 0
    tok = q_map[real].long()
    seq = torch.searchsorted(cu[1:].long(), tok, right=True)
    _check_rows(idx[real], ((tok - cu[seq].long()) // b)[:, None, None])


QMAP_SELECT_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16),  # anchor / paper proxy heads
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16),  # varlen, tiles across chunks
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16),  # top_k 64: the selector's longest list
    ((2000, 4000), 8, 2, 64, 128, 16, torch.float16),  # Hpk 2, fp16
    ((5000,), 2, 1, 64, 64, 17, torch.float16),  # odd top_k > 16, block 64
]


@pytest.mark.parametrize(
    "case", QMAP_SELECT_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-k{c[5]}"
)
@pytest.mark.parametrize("kind", ["zigzag", "permuted", "random"])
def test_cute_select_q_map_matches_reference_and_triton(case, kind):
    """``SelectSm90(qmap=True)``: every mapped row written (a poisoned output), padding rows
    never visited (the op fills them with -1), the index format at the rows' positions, and the
    same block sets as the reference's and the Triton kernel's selections with the same map
    (near-ties accepted: ``testing.selection_mismatch`` on the tokens' rows)."""
    cute_be = _cute()
    triton_be = backends.load("triton")[0]
    from flash_msa.cute import selection

    qp, kp, cu, cfg = _select_case(*case)
    q_map = _q_map(kind, case[0], cfg.block_size)
    qp_l = _local_rows(qp, q_map)
    real = q_map >= 0
    into = testing.poisoned((qp_l.shape[0], qp.shape[1], cfg.top_k), torch.int32, "cuda")
    selection.select_into(into, qp_l, kp, cu, cfg, q_map=q_map)
    assert (into[~real] == testing.POISON_INT).all(), "a padding row was written"
    _check_mapped_format(into, q_map, cu, cfg.block_size)
    op = cute_be.select(qp_l, kp, cu, cfg, q_map=q_map)
    assert torch.equal(op[real], into[real]) and (op[~real] == -1).all()
    base = reference.select(qp, kp, cu, cfg)  # every token's (rows the map leaves out)
    for other in (
        reference.select(qp_l, kp, cu, cfg, q_map=q_map),
        triton_be.select(qp_l, kp, cu, cfg, q_map=q_map),
    ):
        assert (other[~real] == -1).all()
        bad = testing.selection_mismatch(
            _on_tokens(into, q_map, base), _on_tokens(other, q_map, base), qp.cpu(), kp.cpu(),
            cfg.block_size, cfg.proxy_scale, cu.cpu(),
        )  # fmt: skip
        assert bad == 0


@pytest.mark.parametrize("block", [64, 128])
def test_cute_select_identity_q_map_is_the_plain_selection(block):
    """``q_map = arange(T)``: the same rows, tiles and scores as without a map (the query tile
    gathered instead of one TMA box), so the same indices bit for bit."""
    cute_be = _cute()
    qp, kp, cu, cfg = _select_case((3000, 1, 2100), 4, 1, 128, block, 24, torch.bfloat16, seed=6)
    ident = torch.arange(qp.shape[0], dtype=torch.int32, device="cuda")
    plain = cute_be.select(qp, kp, cu, cfg)
    assert torch.equal(cute_be.select(qp, kp, cu, cfg, q_map=ident), plain)


def test_cute_select_q_map_is_sync_free_and_graph_capturable():
    """The map's host work (``worklist.query_order``: a sort and a search on the device) adds
    no host synchronization; the mapped selection replays in a CUDA graph."""
    cute_be = _cute()
    qp, kp, cu, cfg = _select_case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    q_map = _q_map("zigzag", (3000, 700), 128)
    qp_l = _local_rows(qp, q_map)
    first = cute_be.select(qp_l, kp, cu, cfg, q_map=q_map)  # compiles
    with no_host_sync():
        again = cute_be.select(qp_l, kp, cu, cfg, q_map=q_map)
    assert torch.equal(first, again)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cute_be.select(qp_l, kp, cu, cfg, q_map=q_map)
    qp_l.copy_(torch.randn_like(qp_l))
    graph.replay()
    assert torch.equal(captured, cute_be.select(qp_l, kp, cu, cfg, q_map=q_map))


# ---------------------------------------------------------------------------------------------
# forward with a query map (context parallelism: FwdPartialsSm90(qmap=True))
# ---------------------------------------------------------------------------------------------
def _mapped_fwd_case(layout, kind, dtype, seed):
    """Inputs of ``PROXY_LAYOUTS[layout]`` with a ``kind`` query map (``_q_map``): the local
    rows (q, q_proxy), the keys, the map, the config and the reference's indices with the map,
    padding rows given a real row's indices (the kernels must ignore them)."""
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = PROXY_LAYOUTS[layout]
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    q_map = _q_map(kind, lengths, b, seed)
    qp_l, q_l = _local_rows(qp, q_map), _local_rows(q, q_map)
    idx = reference.select(qp_l, kp, cu, cfg, q_map=q_map)
    real = q_map >= 0
    idx[~real] = idx[int(torch.nonzero(real)[0])].clone()
    return (qp_l, kp, q_l, k, v), cu, q_map, cfg, idx


def _mapped_slot_references(xs, idx, cu, cfg, q_map):
    """``(exact, same)`` per index slot with the map: the reference forward on the one-slot
    index ``idx[:, :, s:s+1]`` gives ``o_part``/``l_part`` ``(Tq, H, K, ...)`` and, from its
    proxy LSE, ``pl_part`` ``(Tq, Hs, K)`` (fp64 and the input dtype)."""
    qp, kp, q, k, v = xs
    one = dataclasses.replace(cfg, top_k=1, compute_kl=False)
    refs = []
    for exact in (True, False):
        ys = [x.double() if exact else x for x in xs]
        parts = {"o_part": [], "l_part": [], "pl_part": []}
        for s in range(idx.shape[2]):
            f = reference.fwd(
                *ys[2:], idx[:, :, s : s + 1].contiguous(), cu, one, ys[0], ys[1], upcast=exact,
                q_map=q_map,
            )  # fmt: skip
            for name, x in zip(parts, (f.out, f.lse, f.proxy_lse)):
                parts[name].append(x)
        refs.append({n: torch.stack(x, 2) for n, x in parts.items()})
    return refs


@pytest.mark.parametrize("kind", ["zigzag", "permuted", "random"])
@pytest.mark.parametrize("layout", ["anchor", "paper", "Hp>Hpk>1-b64", "Dp<D", "D=64-b128"])
def test_cute_forward_partials_q_map_match_reference(layout, kind):
    """``FwdPartialsSm90(qmap=True)`` on a later chunk of query rows (``tok0 > 0``), with and
    without the proxy part, into NaN-poisoned buffers: every kept (row, head, slot) of a mapped
    row by the rule against the reference with the map over that slot's block (``o_part``,
    ``l_part``, ``pl_part``); unused slots and every slot of a padding row unwritten; the main
    partials of the kernel with the proxy part equal the main-only kernel's bit for bit."""
    _cute()
    xs, cu, q_map, cfg, idx = _mapped_fwd_case(layout, kind, torch.bfloat16, seed=11)
    Tq, Tk = q_map.numel(), xs[3].shape[0]
    c0 = Tq // 3
    wl = worklist.build(idx[c0:], cu, cfg.block_size, worklist.ITEM_TOKENS, c0, Tk, q_map)
    assert wl.q_map is not None
    o, lp, pl = _cute_partials_into_poisoned(xs, cfg, idx[c0:], wl, c0)
    o0, lp0, _ = _cute_partials_into_poisoned(xs, cfg, idx[c0:], wl, c0, proxy=False)
    H, Hp = o.shape[1], idx.shape[1]
    kept_p = (idx[c0:] >= 0) & (q_map[c0:] >= 0)[:, None, None]  # (C, Hs, K)
    kept = kept_p.repeat_interleave(H // Hp, dim=1)  # (C, H, K)
    for x in (o, lp, o0, lp0):
        assert x[~kept].isnan().all(), "an unused slot or a padding row was written"
    assert pl[~kept_p].isnan().all()
    assert torch.equal(o[kept], o0[kept]) and torch.equal(lp[kept], lp0[kept])
    exact, same = _mapped_slot_references(xs, idx, cu, cfg, q_map)
    for r in (exact, same):
        for name, mask in (("o_part", kept), ("l_part", kept), ("pl_part", kept_p)):
            r[name] = r[name][c0:][mask]
    mine = dict(o_part=o[kept], l_part=lp[kept], pl_part=pl[kept_p])
    check(mine, exact, same, label=f"{layout} {kind} ")


@pytest.mark.parametrize("block", [64, 128])
def test_cute_forward_partials_identity_q_map_is_the_plain_kernel(block):
    """``q_map = arange(T)``: the same rows, positions and work list as without a map, so the
    mapped kernel's partials equal the map-less kernel's bit for bit (proxy part included)."""
    _cute()
    layout = ((3000, 1, 900), 16, 2, 4, 1, 128, 128, block, 8)
    xs, cu, cfg, idx = selected_inputs(layout, dtype=torch.bfloat16, seed=12)
    T, c0 = xs[2].shape[0], 1000
    idx = idx[c0:]
    ident = torch.arange(T, dtype=torch.int32, device="cuda")
    lists = [worklist.build(idx, cu, block, worklist.ITEM_TOKENS, c0, T, m) for m in (None, ident)]
    plain, mapped = (_cute_partials_into_poisoned(xs, cfg, idx, wl, c0) for wl in lists)
    for x, y in zip(plain, mapped):
        assert torch.equal(x.nan_to_num(123.0), y.nan_to_num(123.0))


def _mapped_fwd_references(xs, idx, cu, cfg, q_map):
    """``(exact, same)``: the reference forward with the map (fp64; the input dtype)."""
    refs = []
    for exact in (True, False):
        qp, kp, q, k, v = (x.double() if exact else x for x in xs)
        f = reference.fwd(q, k, v, idx, cu, cfg, qp, kp, upcast=exact, q_map=q_map)
        refs.append(results(f))
    return refs


@pytest.mark.parametrize(
    "layout, kind, dtype",
    [(layout, kind, torch.bfloat16) for layout in PROXY_LAYOUTS for kind in ("zigzag", "random")]
    + [("anchor", "permuted", torch.float16), ("Hp>Hpk>1-b64", "zigzag", torch.float16)],
)
def test_cute_forward_op_q_map_matches_reference(layout, kind, dtype, monkeypatch):
    """The CuTe forward op with a map (``cute.forward.fwd(..., q_map)`` through the driver):
    its stages declare the map, the mapped
    partials make the proxy LSE partials (Triton's stage, patched to fail, never runs); out,
    lse, proxy LSE and KL by the rule against the reference with the map on the mapped rows,
    padding rows exactly ``out = 0``, ``lse = proxy_lse = -inf``; every buffer poisoned."""
    from flash_msa import cute
    from flash_msa.cute import forward
    from flash_msa.triton_ref import sparse_fwd

    def not_this_stage(*args, **kwargs):
        raise AssertionError("Triton's proxy_partials ran: the CuTe partials did not make them")

    monkeypatch.setattr(sparse_fwd, "proxy_partials", not_this_stage)
    _cute()
    assert cute.forward_stages().q_map
    xs, cu, q_map, cfg, idx = _mapped_fwd_case(layout, kind, dtype, seed=13)
    qp, kp, q, k, v = xs
    assert forward.proxy_fits(q, k, qp, kp, idx, cfg)
    with pytest.MonkeyPatch.context() as mp:
        poison_new_buffers(mp)
        mine = results(forward.fwd(q, k, v, idx, cu, cfg, qp, kp, q_map=q_map))
    exact, same = _mapped_fwd_references(xs, idx, cu, cfg, q_map)
    real, pad = q_map >= 0, q_map < 0
    for name in FWD:
        m, ex, sm = mine[name], exact[name], same[name]
        if name != "kl":
            want = -torch.inf if name.endswith("lse") else 0.0
            assert (m[pad] == want).all(), f"{name}: padding rows"
            m, ex, sm = m[real], ex[real], sm[real]
        testing.assert_close(f"{layout} {kind} {name}", m, ex, sm)
