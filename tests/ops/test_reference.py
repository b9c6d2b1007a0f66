"""The PyTorch reference (the torch backend) against independent definitions of MSA.

Independent oracles: torch's dense causal SDPA, ``flash_msa.testing.brute_force*`` (per-row
Python selection, dense masks, ``F.kl_div``, autograd), ``torch.autograd.gradcheck``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import flash_msa
from flash_msa import reference, testing
from flash_msa.testing import brute_force, brute_force_select, indices_to_lists, make_inputs

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("torch_backend")


GRADS = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")  # in the order of the inputs


def _varlen(inputs, lengths):
    """Batch-form inputs with B=1 -> packed (T, heads, dim) tensors + cu_seqlens."""
    return tuple(x[0] for x in inputs), testing.cu(lengths)


def _rows(q_proxy):
    """``Hp * T``: the rows the KL is a mean over (``testing.training_loss``'s ``rows``)."""
    return q_proxy.shape[:-1].numel()


def _run(inputs, top_k, seed=0, weights=None, **kw):
    """msa_attention with fresh leaves and ``testing.training_loss(seed)`` (or the loss
    ``(out * dout).sum() + w * kl`` of ``weights = (dout, w)``): out, kl and the five
    gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, kl = flash_msa.msa_attention(*leaves, top_k, **kw)
    if weights is None:
        testing.training_loss(out, kl, _rows(inputs[0]), seed).backward()
    else:
        ((out * weights[0]).sum() + weights[1] * kl).backward()
    return out.detach(), kl.detach(), [x.grad for x in leaves]


def _brute_force_run(inputs, selection, seed=0, **kw):
    """``testing.brute_force`` with fresh leaves and the same loss as :func:`_run`."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    ref = brute_force(*leaves, selection, **kw)
    testing.training_loss(ref["out"], ref["kl"], _rows(inputs[0]), seed).backward()
    return ref, [x.grad for x in leaves]


def _close(name, mine, exact, **kw):
    """Two fp64 implementations: the harness's rule with atol only (``same=None``)."""
    testing.assert_close(name, mine, exact, None, **kw)


def _dense_causal_gqa(q, k, v, scale=None):
    """Dense causal GQA attention by SDPA, batch form (B, S, H, D)."""
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b", [64, 128])
@pytest.mark.parametrize("lengths", [None, (1, 130, 64, 257)])
def test_select_matches_brute_force(b, lengths):
    S = 300 if lengths is None else sum(lengths)
    inputs = make_inputs(2 if lengths is None else 1, S, 4, 2, 4, 2, 8, 16, dtype=F64, seed=1)
    qp, kp = inputs[:2]
    cu = None
    if lengths is not None:
        (qp, kp), cu = _varlen((qp, kp), lengths)
    idx = flash_msa.select_blocks(qp, kp, 3, block_size=b, cu_seqlens=cu)
    assert idx.dtype == torch.int32 and idx.shape == (*qp.shape[:-1], 3)
    assert indices_to_lists(idx) == brute_force_select(qp, kp, 3, b, 16**-0.5, cu)


def test_select_ties_go_to_lower_block():
    # q_proxy = 0 makes every score 0: the own block plus the lowest other blocks win.
    qp = torch.zeros(1, 640, 2, 8, dtype=F64)
    kp = torch.randn(1, 640, 1, 8, dtype=F64)
    idx = flash_msa.select_blocks(qp, kp, 3, block_size=64)[0]  # [S, Hp, 3]
    for i in (0, 63, 64, 130, 200, 639):
        own = i // 64
        want = sorted({own, *[n for n in range(own) if n != own][:2]})
        want += [-1] * (3 - len(want))
        assert idx[i, 0].tolist() == want and idx[i, 1].tolist() == want, i


def test_select_breaks_ties_on_exact_equal_maxima():
    # Two earlier blocks with the same max score: the lower one wins the single free slot.
    S, b = 3 * 64, 64
    kp = torch.zeros(1, S, 1, 4, dtype=F64)
    kp[0, 5, 0, 0] = 1.0  # block 0 max = 1
    kp[0, 70, 0, 0] = 1.0  # block 1 max = 1
    qp = torch.zeros(1, S, 1, 4, dtype=F64)
    qp[..., 0] = 1.0
    idx = flash_msa.select_blocks(qp, kp, 2, block_size=b)[0, :, 0]
    assert idx[150].tolist() == [0, 2]
    kp[0, 70, 0, 0] = 1.0 + 1e-9  # now block 1 is strictly larger
    idx = flash_msa.select_blocks(qp, kp, 2, block_size=b)[0, :, 0]
    assert idx[150].tolist() == [1, 2]


@given(st.data())
def test_selection_properties(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 3 * b + 7), min_size=1, max_size=3), label="lens")
    Hpk = data.draw(st.sampled_from([1, 2]), label="Hpk")
    Hp = Hpk * data.draw(st.sampled_from([1, 2]), label="Hp/Hpk")
    top_k = data.draw(st.integers(1, 5), label="top_k")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    inputs = make_inputs(1, sum(lengths), 1, 1, Hp, Hpk, 1, 8, dtype=torch.float32, seed=seed)
    (qp, kp), cu = _varlen(inputs[:2], lengths)
    idx = flash_msa.select_blocks(qp, kp, top_k, block_size=b, cu_seqlens=cu)
    assert idx.shape == (sum(lengths), Hp, top_k) and idx.dtype == torch.int32
    pos = torch.cat([torch.arange(n) for n in lengths])  # sequence-local positions
    own = (pos // b)[:, None].expand(-1, Hp)
    valid = idx >= 0
    assert ((idx == own[..., None]) & valid).any(-1).all(), "own block missing"
    count = torch.clamp(own + 1, max=top_k)
    assert (valid.sum(-1) == count).all(), "count != min(top_k, visible blocks)"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 must only pad the end"
    assert ((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all(), "not ascending"
    assert (idx <= own[..., None]).all(), "a future (-inf) block was selected"


# ---------------------------------------------------------------------------------------------
# forward: dense special cases, brute force, KL
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b", [64, 128])
def test_full_top_k_equals_dense_causal(b):
    S = 2 * b + 5
    qp, kp, q, k, v = make_inputs(2, S, 8, 2, 4, 1, 16, 8, dtype=F64, seed=2)
    out, _ = flash_msa.msa_attention(qp, kp, q, k, v, top_k=8, block_size=b, softmax_scale=0.3)
    _close("out", out, _dense_causal_gqa(q, k, v, 0.3))


@pytest.mark.parametrize("varlen", [False, True])
def test_warmup_equals_dense_causal(varlen):
    qp, kp, q, k, v = make_inputs(1, 200, 4, 1, 2, 1, 16, 8, dtype=F64, seed=3)
    if not varlen:
        out, kl = flash_msa.msa_attention(qp, kp, q, k, v, top_k=1, block_size=64, warmup=True)
        _close("out", out, _dense_causal_gqa(q, k, v))
    else:
        lengths = (120, 80)
        packed, cu = _varlen((qp, kp, q, k, v), lengths)
        out, kl = flash_msa.msa_attention(
            *packed, top_k=1, block_size=64, warmup=True, cu_seqlens=cu
        )
        for s0, n in zip((0, 120), lengths):
            part = [x[:, s0 : s0 + n] for x in (q, k, v)]
            _close(f"out[{s0}:]", out[s0 : s0 + n], _dense_causal_gqa(*part)[0])
    ref = brute_force(
        *(packed if varlen else (qp, kp, q, k, v)),
        None,
        block_size=64,
        cu_seqlens=cu if varlen else None,
        warmup=True,
    )
    _close("kl", kl, ref["kl"])


@pytest.mark.parametrize("lengths", [None, (65, 1, 200)])
def test_forward_matches_brute_force(lengths):
    S = 266 if lengths else 190
    inputs = make_inputs(1 if lengths else 2, S, 4, 2, 2, 1, 16, 8, dtype=F64, seed=4)
    cu = None
    if lengths:
        inputs, cu = _varlen(inputs, lengths)
    out, kl = flash_msa.msa_attention(*inputs, 2, block_size=64, cu_seqlens=cu)
    sel = brute_force_select(inputs[0], inputs[1], 2, 64, 8**-0.5, cu)
    ref = brute_force(*inputs, sel, block_size=64, cu_seqlens=cu)
    _close("out", out, ref["out"])
    _close("kl", kl, ref["kl"])
    # the post-selection part on given indices, with its LSE
    idx = flash_msa.select_blocks(inputs[0], inputs[1], 2, block_size=64, cu_seqlens=cu)
    out2, lse = flash_msa.sparse_attention(
        *inputs[2:], idx, block_size=64, cu_seqlens=cu, return_lse=True
    )
    assert torch.equal(out2, out)
    _close("lse", lse.reshape(-1, 4), ref["lse"])


@pytest.mark.parametrize("rows", [3, 64])
def test_row_chunks_match_brute_force(rows, monkeypatch):
    """Query rows in chunks (the path of long sequences: one ``(heads, rows, keys)`` tile at a
    time) in select, fwd and bwd, chunk edges inside blocks, after an empty sequence."""
    lengths, H = (150, 0, 97), 4  # Hp = H: select chunks like fwd and bwd
    inputs, cu = _varlen(make_inputs(1, 247, H, 2, H, 2, 8, 8, dtype=F64, seed=14), lengths)
    # a tile of (heads, rows, longest sequence) fp32 entries: `rows` rows per chunk there
    monkeypatch.setattr(reference, "_TILE_BYTES", 4 * H * max(lengths) * rows)
    out, kl, grads = _run(inputs, 2, block_size=64, cu_seqlens=cu)
    idx = flash_msa.select_blocks(inputs[0], inputs[1], 2, block_size=64, cu_seqlens=cu)
    sel = brute_force_select(inputs[0], inputs[1], 2, 64, 8**-0.5, cu)
    assert indices_to_lists(idx) == sel
    ref, ref_grads = _brute_force_run(inputs, sel, block_size=64, cu_seqlens=cu)
    _, lse = flash_msa.sparse_attention(
        *inputs[2:], idx, block_size=64, cu_seqlens=cu, return_lse=True
    )
    _close("out", out, ref["out"])
    _close("lse", lse, ref["lse"])
    _close("kl", kl, ref["kl"])
    for name, mine, exact in zip(GRADS, grads, ref_grads):
        _close(name, mine, exact)


def test_kl_equals_direct_formula():
    """KL = (1/R) sum_rows kl_div(log Q, mean_g P) over the kept keys, written out by hand."""
    qp, kp, q, k, v = make_inputs(1, 150, 4, 2, 2, 2, 8, 8, dtype=F64, seed=5)
    b, top_k = 64, 2
    _, kl = flash_msa.msa_attention(qp, kp, q, k, v, top_k, block_size=b)
    idx = flash_msa.select_blocks(qp, kp, top_k, block_size=b)[0]  # [S, Hp, k]
    S = 150
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    total = 0.0
    for p in range(2):
        kept = torch.zeros(S, S, dtype=torch.bool)
        for row in range(S):
            for n in idx[row, p].tolist():
                if n >= 0:
                    kept[row, n * b : (n + 1) * b] = True
        kept &= j <= i
        probs = []
        for h in (2 * p, 2 * p + 1):  # the g = H/Hp main heads of proxy head p
            s = (q[0, :, h] @ k[0, :, h // 2].T) * 8**-0.5
            probs.append(torch.softmax(s.masked_fill(~kept, -math.inf), -1))
        target = torch.stack(probs).mean(0)
        z = (qp[0, :, p] @ kp[0, :, p].T) * 8**-0.5
        log_q = torch.log_softmax(z.masked_fill(~kept, -math.inf), -1).masked_fill(~kept, 0)
        total += F.kl_div(log_q, target, reduction="sum")
    _close("kl", kl, total / (2 * S))


def test_same_dtype_reference_is_lower_precision():
    """upcast=False computes in the input dtype: close to, but not equal to, the fp32 result."""
    qp, kp, q, k, v = make_inputs(1, 256, 4, 2, 2, 1, 32, 16, dtype=torch.bfloat16, seed=6)
    flat = [x[0] for x in (qp, kp, q, k, v)]
    cfg = flash_msa.problem.Config(
        block_size=64,
        softmax_scale=32**-0.5,
        max_seqlen=256,
        proxy_scale=16**-0.5,
        top_k=4,
        warmup=False,
        compute_kl=True,
    )
    cu = testing.cu([256])
    idx = reference.select(*flat[:2], cu, cfg)
    hi = reference.fwd(*flat[2:], idx, cu, cfg, *flat[:2])
    lo = reference.fwd(*flat[2:], idx, cu, cfg, *flat[:2], upcast=False)
    exact = reference.fwd(
        *(x.double() for x in flat[2:]), idx, cu, cfg, *(x.double() for x in flat[:2])
    )
    err_hi, err_lo = testing.max_err(hi.out, exact.out), testing.max_err(lo.out, exact.out)
    assert hi[0].dtype == lo[0].dtype == torch.bfloat16 and hi[1].dtype == torch.float32
    assert 0 < err_hi <= err_lo < 0.05


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [False, True])
def test_gradients_match_autograd_through_brute_force(warmup):
    """Closed-form proxy gradient and explicit main backward vs autograd, fp64."""
    lengths = (70, 130)
    inputs, cu = _varlen(make_inputs(1, 200, 4, 2, 2, 1, 16, 8, dtype=F64, seed=7), lengths)
    out, kl, grads = _run(inputs, 2, block_size=64, cu_seqlens=cu, warmup=warmup)
    sel = None if warmup else brute_force_select(inputs[0], inputs[1], 2, 64, 8**-0.5, cu)
    ref, ref_grads = _brute_force_run(inputs, sel, block_size=64, cu_seqlens=cu, warmup=warmup)
    for name, mine, exact in zip(GRADS, grads, ref_grads):
        _close(name, mine, exact)


def test_gradcheck_out_wrt_qkv_at_fixed_selection():
    qp, kp, q, k, v = make_inputs(1, 80, 2, 1, 2, 1, 4, 4, dtype=F64, seed=8)
    idx = flash_msa.select_blocks(qp, kp, 1, block_size=64)  # the own block only
    idx[0, 70:75, 1] = -1  # rows of head 1 without any block: out = 0, gradient 0
    idx[0, 75:, 1, 0] = 0  # ... and rows whose only block is a past one
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fn = lambda q, k, v: flash_msa.sparse_attention(q, k, v, idx, block_size=64)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, fast_mode=True)


def test_gradcheck_kl_wrt_proxy():
    qp, kp, q, k, v = make_inputs(1, 100, 4, 2, 2, 1, 8, 8, dtype=F64, seed=9)
    qp, kp = qp.requires_grad_(), kp.requires_grad_()
    fn = lambda qp, kp: flash_msa.msa_attention(qp, kp, q, k, v, 1, block_size=64)[1]
    assert torch.autograd.gradcheck(fn, (qp, kp), eps=1e-6, atol=1e-9, fast_mode=True)


def test_gradcheck_fast_mode_fails_on_a_wrong_gradient(monkeypatch):
    """The gradchecks above run in fast mode (``v^T J u`` for random ``u``, ``v``: 2 evaluations
    instead of one per Jacobian entry; measured 166 s -> 4 s for the KL's). Fast mode must still
    see a gradient 1 % off in one input: the backward's ``dk_proxy`` scaled by 1.01."""
    qp, kp, q, k, v = make_inputs(1, 20, 2, 1, 2, 1, 4, 4, dtype=F64, seed=9)
    qp, kp = qp.requires_grad_(), kp.requires_grad_()
    fn = lambda qp, kp: flash_msa.msa_attention(qp, kp, q, k, v, 1, block_size=64)[1]
    assert torch.autograd.gradcheck(fn, (qp, kp), eps=1e-6, atol=1e-9, fast_mode=True)
    real = reference.bwd

    def wrong(*args, **kw):
        g = real(*args, **kw)
        return g._replace(dk_proxy=g.dk_proxy * 1.01)

    monkeypatch.setattr(reference, "bwd", wrong)
    assert not torch.autograd.gradcheck(
        fn, (qp, kp), eps=1e-6, atol=1e-9, fast_mode=True, raise_exception=False
    )


def test_no_gradient_crosses_between_main_and_proxy():
    inputs = make_inputs(1, 100, 4, 2, 2, 1, 8, 8, dtype=F64, seed=10, requires_grad=True)
    out, kl = flash_msa.msa_attention(*inputs, 1, block_size=64)
    out.sum().backward(retain_graph=True)
    assert inputs[0].grad is None and inputs[1].grad is None  # no main loss -> proxy
    assert all(x.grad is not None for x in inputs[2:])
    for x in inputs:
        x.grad = None
    kl.backward()
    assert all(x.grad is None for x in inputs[2:])  # the KL target is detached
    assert inputs[0].grad.abs().sum() > 0 and inputs[1].grad.abs().sum() > 0


def test_unused_kl_skips_the_proxy_backward(monkeypatch):
    calls = []
    real = reference.bwd

    def spy(dout, dkl, *args):
        calls.append((dout is None, dkl is None))
        return real(dout, dkl, *args)

    monkeypatch.setattr(reference, "bwd", spy)
    inputs = make_inputs(1, 70, 4, 2, 2, 1, 8, 8, dtype=F64, seed=11, requires_grad=True)
    out, kl = flash_msa.msa_attention(*inputs, 1, block_size=64)
    out.sum().backward()
    assert calls == [(False, True)]  # dkl arrived as None: nothing multiplied by zero
    assert inputs[0].grad is None


def test_compute_kl_false_keeps_exact_gradient():
    inputs = make_inputs(1, 150, 4, 2, 2, 1, 8, 8, dtype=F64, seed=12)
    out1, kl1, g1 = _run(inputs, 2, block_size=64)
    out0, kl0, g0 = _run(inputs, 2, block_size=64, compute_kl=False)
    assert kl0.item() == 0.0 and kl1.item() > 0
    assert torch.equal(out0, out1)
    for name, a, b in zip(GRADS, g0, g1):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# packing invariance
# ---------------------------------------------------------------------------------------------
@given(st.data())
def test_packing_invariance(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 2 * b + 9), min_size=2, max_size=3), label="lens")
    Hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    Hp = data.draw(st.sampled_from([1, 2, 4]), label="Hp")
    H = max(Hp, Hkv) * data.draw(st.sampled_from([1, 2]), label="H/max(Hp,Hkv)")
    Hpk = data.draw(st.sampled_from([h for h in (1, 2) if Hp % h == 0]), label="Hpk")
    top_k = data.draw(st.integers(1, 3), label="top_k")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    T = sum(lengths)
    inputs, cu = _varlen(make_inputs(1, T, H, Hkv, Hp, Hpk, 8, 8, dtype=F64, seed=seed), lengths)
    R = Hp * T
    dout, w = testing.loss_weights((T, H, 8), R, seed)
    dout = dout.double()
    kw = dict(block_size=b)
    out, kl, grads = _run(inputs, top_k, weights=(dout, w), cu_seqlens=cu, **kw)
    idx = flash_msa.select_blocks(inputs[0], inputs[1], top_k, cu_seqlens=cu, **kw)
    r_kl = 0.0
    for s0, n in zip(cu[:-1].tolist(), lengths):
        sl = slice(s0, s0 + n)
        part = [x[sl][None] for x in inputs]  # alone, batch form
        # the same KL weight per row (w / R): proxy gradients then match without the 1/R factor
        o, kl_s, g = _run(part, top_k, weights=(dout[sl][None], w * n / T), **kw)
        i_s = flash_msa.select_blocks(part[0], part[1], top_k, **kw)[0]
        assert torch.equal(i_s, idx[sl])
        _close("out", out[sl], o[0])
        for name, a, bb in zip(GRADS, g, grads):
            _close(name, bb[sl], a[0], can_fail=n > 1)  # one token: dq = 0 (P = 1)
        r_kl += Hp * n * kl_s
    _close("R * kl", R * kl, r_kl, can_fail=max(lengths) > 1)  # one key per row: KL = 0


def test_testing_selection_mismatch_accepts_only_near_ties():
    qp, kp = make_inputs(1, 300, 1, 1, 1, 1, 1, 8, dtype=F64, seed=13)[:2]
    idx = flash_msa.select_blocks(qp, kp, 2, block_size=64)
    assert testing.selection_mismatch(idx, idx, qp, kp, 64, 8**-0.5) == 0
    other = idx.clone()
    row = other[0, 299, 0]  # own block 4 plus one of 0..3: swap it for a far worse block
    scores = [(kp[0, n * 64 : (n + 1) * 64, 0] @ qp[0, 299, 0]).max() for n in range(4)]
    worst = int(torch.stack(scores).argmin())
    assert row[0].item() != worst  # the kept block is the best of 0..3, not the worst
    row[0] = worst
    assert testing.selection_mismatch(idx, other, qp, kp, 64, 8**-0.5) == 1
