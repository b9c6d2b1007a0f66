"""FP8 selection (``selection_precision="fp8"``) on CPU: the argument, the backends'
declarations and ``auto``'s fallback, the torch reference's semantics, the Triton oracle under
the interpreter against it, the recall protocol on a small structured input, and the keyword
through every entry point: ``nn.MSAttention``, ``torch.compile`` (the ``flash_msa::select``
op) and ``distributed.msa_attention`` (2 gloo ranks, spawned).

CPU time (``--durations``): 8.0 s in all on the 2-core machine (the compiled calls 2.7 s, the
gloo spawn 2.1 s, the Triton interpreter 1.7 s, the public calls 0.7 s, the recall 0.4 s).

GPU tests of the CuTe FP8 selection (``selection_precision="fp8"``; ``pytest -m gpu`` on Hopper
with nvidia-cutlass-dsl): ``SelectSm90`` with e4m3 operands and key scales, called directly
(``selection.select_fp8_into`` / ``selection.select``; declared for ``auto`` in
``LIMITS["select"].fp8_selection``).

Every check compares index sets on **identical quantized operands** (``quant.quantize`` once,
given to every implementation): the Triton fp8 oracle (``triton_ref/selection_fp8.py``, the same
``wgmma ... .e4m3.e4m3`` products) and the torch reference (``reference.select(...,
quantized=)``, exact e4m3 products summed in fp32; Hopper's FP8 MMA accumulates with about 22
bits, so the kernels' scores are slightly less exact: if only the reference comparison fails,
look at that before the kernel). They may differ only by near-ties:
``testing.selection_mismatch`` on the dequantized operands (``quant.dequantize``: their fp64
products are the fp8 scores times a positive row constant), as tests/ops/test_select_fp8.py
checks the oracle. Inputs: random, local and ``gain`` (each key block scaled by its own factor in
[1/8, 8], so that the key scales decide the ranking; a kernel that ignored them fails, which
the test shows on the same input). The index buffer starts poisoned (``testing.POISON_INT``),
so a slot the kernel forgot fails the format check.
"""

import dataclasses
import math

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flash_msa
from flash_msa import backends, limits, quant, recall, reference, testing
from flash_msa import distributed as cp
from flash_msa.nn import MSAttention
from flash_msa.problem import Config, Problem
from flash_msa.triton_ref import selection_fp8
from harness import SM90, config, cute_backend, gloo_group, marked, no_host_sync, packed_inputs

FP8 = {"selection_precision": "fp8"}


def _cfg(top_k=3, block_size=64, max_seqlen=300, Dp=32, **kw):
    return Config(
        block_size=block_size,
        softmax_scale=1.0,
        max_seqlen=max_seqlen,
        proxy_scale=Dp**-0.5,
        top_k=top_k,
        **kw,
    )


def _proxies(lengths, Hp=4, Hpk=1, Dp=32, seed=0, block_gain=False, block_size=64):
    """Packed ``(q_proxy, k_proxy)``; ``block_gain`` scales each key block by its own factor in
    [1/8, 8] (so that the key scales decide the ranking: a kernel that ignored them fails)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    qp = torch.randn(T, Hp, Dp, generator=g)
    kp = torch.randn(T, Hpk, Dp, generator=g)
    if block_gain:
        blk = quant.block_of_token(testing.cu(lengths), T, block_size)
        gain = 2.0 ** (6 * torch.rand(int(blk.max()) + 1, generator=g) - 3)
        kp = kp * gain[blk][:, None, None]
    return qp, kp


# ---------------------------------------------------------------------------------------------
# the argument
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", ["msa", "select"])
@pytest.mark.parametrize(
    "value, exc", [("fp16", ValueError), ("FP8", ValueError), (8, TypeError), (None, TypeError)]
)
def test_selection_precision_is_validated(fn, value, exc):
    qp, kp, q, k, v = testing.make_inputs(1, 70, 4, 2, 2, 1, 8, 8, dtype=torch.float32)
    with pytest.raises(exc, match="selection_precision"):
        if fn == "msa":
            flash_msa.msa_attention(qp, kp, q, k, v, 2, block_size=64, selection_precision=value)
        else:
            flash_msa.select_blocks(qp, kp, 2, block_size=64, selection_precision=value)


@pytest.mark.parametrize("fn", ["msa", "select", "layer"])
def test_fp8_rerank_is_refused_naming_the_accepted_values(fn):
    """``"fp8_rerank"`` (an over-selected fp8 top-k re-ranked exactly) is not a precision the
    package runs: every entry point raises ValueError naming ``selection_precision`` and the
    accepted ``"bf16"``, ``"fp8"``, before any work."""
    qp, kp, q, k, v = testing.make_inputs(1, 70, 4, 2, 2, 1, 8, 8, dtype=torch.float32)
    bad = dict(selection_precision="fp8_rerank")
    with pytest.raises(ValueError) as err:
        if fn == "msa":
            flash_msa.msa_attention(qp, kp, q, k, v, 2, block_size=64, **bad)
        elif fn == "select":
            flash_msa.select_blocks(qp, kp, 2, block_size=64, **bad)
        else:
            MSAttention(32, 4, 2, **bad)
    assert str(err.value) == (
        "selection_precision must be one of 'bf16', 'fp8', got 'fp8_rerank'"
    ), err.value


# ---------------------------------------------------------------------------------------------
# declarations: torch selects in fp8, the others refuse it by name and auto falls back
# ---------------------------------------------------------------------------------------------
def _problem(dtype=torch.float32, **cfg):
    return Problem(
        device_type="cpu",
        capability=None,
        dtype=dtype,
        num_heads=0,
        num_kv_heads=0,
        head_dim=0,
        num_sel_heads=4,
        num_proxy_k_heads=1,
        proxy_head_dim=32,
        varlen=True,
        cfg=_cfg(**cfg),
    )


def test_limits_refuse_fp8_by_name_and_auto_falls_back(monkeypatch, caplog):
    from flash_msa import triton_ref

    fp8, exact = _problem(**FP8), _problem()
    assert fp8.selection_precision == "fp8" and exact.selection_precision == "bf16"
    assert hash(fp8.cfg) != hash(exact.cfg)  # a field of the (hashable) Config
    why = limits.reason(triton_ref.LIMITS, "select", fp8)
    assert why is not None and 'selection_precision="fp8"' in why
    assert limits.reason(triton_ref.LIMITS, "fwd", fp8) is None  # a select-only setting
    assert limits.reason(reference.LIMITS, "select", fp8) is None
    assert "fp8 selection" in limits.describe(reference.LIMITS["select"])
    assert "fp8 selection" not in limits.describe(triton_ref.LIMITS["select"])
    assert backends.interpreting()  # conftest: auto tries triton first on CPU
    assert backends.resolve("select", exact)[0] == "triton"
    with caplog.at_level("WARNING", logger="flash_msa"):
        assert backends.resolve("select", fp8)[0] == "torch"
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    with pytest.raises(backends.BackendError, match="selection_precision"):
        backends.resolve("select", fp8)


def test_public_calls_run_the_fp8_reference():
    """select_blocks and msa_attention with fp8 (auto: the torch selection, then any fwd)
    return the reference's fp8 indices and the attention over them."""
    qp, kp, q, k, v = testing.make_inputs(1, 200, 4, 2, 2, 1, 16, 16, dtype=torch.float32)
    cu = testing.cu([200])
    cfg = _cfg(top_k=2, max_seqlen=200, Dp=16, **FP8)
    want = reference.select(qp[0], kp[0], cu, cfg)
    got = flash_msa.select_blocks(qp, kp, 2, block_size=64, **FP8)
    assert torch.equal(got[0], want)
    exact = flash_msa.select_blocks(qp, kp, 2, block_size=64)
    assert not torch.equal(got, exact)  # the inputs tell the two apart
    with backends.forced("torch"):
        out, _ = flash_msa.msa_attention(qp, kp, q, k, v, 2, block_size=64, **FP8)
    main = dataclasses.replace(cfg, softmax_scale=16**-0.5, compute_kl=True)
    f = reference.fwd(q[0], k[0], v[0], want, cu, main)
    torch.testing.assert_close(out[0], f.out, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# the reference's semantics
# ---------------------------------------------------------------------------------------------
def test_default_selection_is_unchanged():
    """The default is the exact selection: bitwise what "bf16" gives, and (fp64 inputs) the
    independent brute force."""
    qp, kp = _proxies([300, 129], Hp=2, Dp=16)
    qp, kp = qp.double(), kp.double()
    cu = testing.cu([300, 129])
    default = flash_msa.select_blocks(qp, kp, 3, block_size=64, cu_seqlens=cu)
    bf16 = flash_msa.select_blocks(
        qp, kp, 3, block_size=64, cu_seqlens=cu, selection_precision="bf16"
    )
    assert torch.equal(default, bf16)
    brute = testing.brute_force_select(qp, kp, 3, 64, 16**-0.5, cu)
    assert testing.indices_to_lists(default) == brute


@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
def test_fp8_reference_keeps_the_selection_rules(key_scale):
    lengths = [300, 129, 64, 1]
    cu = testing.cu(lengths)
    qp, kp = _proxies(lengths, block_gain=True)
    cfg = _cfg(top_k=3, **FP8)
    qz = quant.quantize(qp, kp, cu, 64, key_scale=key_scale)
    idx = reference.select(qp, kp, cu, cfg, quantized=qz)
    exact = reference.select(qp, kp, cu, dataclasses.replace(cfg, selection_precision="bf16"))
    pos = torch.cat([torch.arange(n) for n in lengths])
    own = (pos // 64)[:, None]
    valid = idx >= 0
    assert (idx == own[..., None]).any(-1).all(), "the own block is always kept"
    assert (torch.where(valid, idx, 0) <= own[..., None]).all(), "no block after the own one"
    # -1 only pads the end, entries strictly ascending, and a row keeps min(top_k, visible)
    assert (valid[..., 1:] <= valid[..., :-1]).all()
    assert ((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all()
    assert torch.equal(valid.sum(-1), (own + 1).clamp_max(3).expand(-1, 4))
    # a row with no choice (at most top_k visible blocks) keeps what the exact one keeps
    no_choice = (own[:, 0] + 1) <= 3
    assert torch.equal(idx[no_choice], exact[no_choice])
    assert not torch.equal(idx, exact)  # and elsewhere fp8 does rank (this input swaps some)


def test_fp8_ties_go_to_the_lower_block():
    """Key blocks with identical content quantize identically (the same block scale): every
    score ties, and the lower blocks win, as in the exact selection."""
    g = torch.Generator().manual_seed(1)
    kp = torch.randn(64, 1, 32, generator=g).repeat(5, 1, 1)  # 5 equal blocks of 64
    qp = torch.randn(320, 2, 32, generator=g)
    cu = testing.cu([320])
    idx = reference.select(qp, kp, cu, _cfg(top_k=3, max_seqlen=320, **FP8))
    want = torch.tensor([[0, 1, 4]] * 2, dtype=torch.int32)  # the last row: own block 4
    assert torch.equal(idx[-1], want)
    assert torch.equal(idx[256:], want.expand(64, -1, -1))


def test_fp8_selection_is_packing_and_query_map_invariant():
    """A sequence's fp8 selection does not depend on what it is packed with (the key scales
    are per sequence-local block, the query's per row), and a query map selects the mapped
    rows' selection."""
    lengths = [300, 129]
    cu = testing.cu(lengths)
    qp, kp = _proxies(lengths, block_gain=True)
    cfg = _cfg(top_k=3, **FP8)
    packed = reference.select(qp, kp, cu, cfg)
    alone = reference.select(qp[300:], kp[300:], testing.cu([129]), cfg)
    assert torch.equal(packed[300:], alone)
    rows = torch.tensor([5, 400, -1, 299, 64], dtype=torch.int32)
    mapped = reference.select(qp[rows.clamp_min(0).long()], kp, cu, cfg, q_map=rows)
    assert torch.equal(mapped[[0, 1, 3, 4]], packed[rows[[0, 1, 3, 4]].long()])
    assert (mapped[2] == -1).all()


def test_quantize_pass():
    """e4m3 operands of the rotated proxies within their rounding, scales per block (constant
    on a block's tokens), the rotation orthonormal and exact on the products."""
    lengths = [300, 129]
    cu = testing.cu(lengths)
    qp, kp = _proxies(lengths, block_gain=True)
    qr, kr = quant.hadamard_transform(qp), quant.hadamard_transform(kp)
    blk = quant.block_of_token(cu, 429, 64)
    qz = quant.quantize(qp, kp, cu, 64, key_scale="block")
    assert qz.q.dtype == qz.k.dtype == quant.E4M3
    amax = torch.zeros(int(blk.max()) + 1).scatter_reduce(0, blk, kr.abs().amax(-1)[:, 0], "amax")
    assert torch.equal(qz.k_scale[:, 0], amax[blk] / quant.E4M3_MAX)
    qd, kd = quant.dequantize(qz)
    assert ((qd - qr).abs() <= 2**-4 * qr.abs() + 2**-9 * qz.q_scale[..., None]).all()
    assert ((kd - kr).abs() <= 2**-4 * kr.abs() + 2**-9 * qz.k_scale[..., None]).all()
    h = quant.hadamard(32)
    torch.testing.assert_close(h @ h.T, torch.eye(32))
    torch.testing.assert_close((qp @ h) @ (kp @ h)[:, 0].T, qp @ kp[:, 0].T, atol=1e-4, rtol=0)
    assert torch.equal(quant.hadamard(3), torch.eye(3))  # no power-of-two factor: identity


# ---------------------------------------------------------------------------------------------
# the Triton oracle (interpreter) against the torch reference, identical quantized inputs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("key_scale", "layout"), [("block", (4, 1)), ("token", (2, 2))])
def test_triton_fp8_matches_the_reference(key_scale, layout):
    Hp, Hpk = layout
    lengths = [300, 129, 64]
    cu = testing.cu(lengths)
    qp, kp = _proxies(lengths, Hp, Hpk, block_gain=True)
    cfg = _cfg(top_k=3, **FP8)
    qz = quant.quantize(qp, kp, cu, 64, key_scale=key_scale)
    got = selection_fp8.select(qp, kp, cu, cfg, quantized=qz)
    want = reference.select(qp, kp, cu, cfg, quantized=qz)
    qd, kd = quant.dequantize(qz)  # the fp8 scores' operands, for the near-tie rule
    assert testing.selection_mismatch(got, want, qd, kd, 64, cfg.proxy_scale, cu) == 0
    # the check can fail: without its key scales the selection differs on these inputs
    unscaled = qz._replace(k_scale=torch.ones_like(qz.k_scale))
    assert not torch.equal(want, reference.select(qp, kp, cu, cfg, quantized=unscaled))


# ---------------------------------------------------------------------------------------------
# the recall protocol, small structured input
# ---------------------------------------------------------------------------------------------
def test_recall_on_structured_input():
    """The fp8 selection's recall gates on a small ``local`` input (S 2048, Dp 64, block 64, top_k
    8): covered mass >= 99.5 % of the bf16 selection's, and recall >= 99 %. The fp8 top-k recalls
    97.7 % here (98.5 % at Dp 128, S 4096: docs/algorithm.md, "FP8 selection"), so its recall gate
    is expected to fail: xfail below 99 %, a regression floor of 95 %."""
    res = recall.measure(
        "local",
        2048,
        (4, 2, 2, 1),
        64,
        top_k=8,
        block_size=64,
        variants=(),
        with_downstream=False,
    )
    shipped = res[quant.KEY_SCALE]
    assert shipped["mass_ratio"] >= 0.995, shipped
    assert shipped["recall"] >= 0.95, shipped
    assert res["bf16_vs_fp32"]["recall"] >= 0.99, res["bf16_vs_fp32"]
    assert math.isfinite(res["seconds"])
    if shipped["recall"] < 0.99:
        pytest.xfail(
            f"plain fp8 top-k recall {shipped['recall']:.4f} < 0.99 (the 99 % recall gate)"
        )


# ---------------------------------------------------------------------------------------------
# every entry point a user calls: the layer, torch.compile, context parallelism
# ---------------------------------------------------------------------------------------------
def _spy_select(monkeypatch):
    """The precisions the torch backend's select ran with (api.py calls the module's
    ``select``, so patching the module attribute sees every eager call)."""
    seen = []
    select = reference.select

    def spy(*a, **kw):
        seen.append(a[3].selection_precision)
        return select(*a, **kw)

    monkeypatch.setattr(reference, "select", spy)
    return seen


def test_nn_layer_selects_in_its_precision(monkeypatch):
    """``MSAttention(selection_precision=...)`` reaches the selection (an attribute, changeable
    between steps); fp8 gives another output on these inputs; a bad value raises naming it, at
    construction and when the attribute is set to one."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    seen = _spy_select(monkeypatch)
    torch.manual_seed(0)
    layer = MSAttention(32, 4, 2, top_k=2, block_size=64, selection_precision="fp8")
    assert "selection_precision='fp8'" in repr(layer)
    x = torch.randn(1, 300, 32, generator=torch.Generator().manual_seed(1))
    out8, _ = layer(x)
    layer.selection_precision = "bf16"
    out16, _ = layer(x)
    assert seen == ["fp8", "bf16"]
    assert not torch.equal(out8, out16)  # the inputs tell the two apart
    layer.selection_precision = "fp4"
    with pytest.raises(ValueError, match="selection_precision"):
        layer(x)
    with pytest.raises(ValueError, match="selection_precision"):
        MSAttention(32, 4, 2, selection_precision="FP8")
    with pytest.raises(TypeError, match="selection_precision"):
        MSAttention(32, 4, 2, selection_precision=8)


def test_compiled_calls_select_in_fp8():
    """Under ``torch.compile(fullgraph=True)`` (aot_eager: no Inductor build) the fp8 keyword
    reaches the ``flash_msa::select`` op: ``select_blocks`` and ``msa_attention`` (out, kl and
    the five gradients) equal the eager fp8 calls and differ from the compiled bf16 ones; the
    op passes ``torch.library.opcheck`` with the keyword and refuses an unknown one."""
    from flash_msa import ops

    xs = [x[0].detach() for x in testing.make_inputs(1, 200, 4, 2, 2, 1, 16, 16)]
    qp, kp = xs[:2]
    seq = dict(block_size=64, cu_seqlens=testing.cu([200]), max_seqlen=200)

    def step(fn, **kw):  # out, kl and the five gradients of the O(1)-gradient loss
        leaves = [x.clone().requires_grad_() for x in xs]
        out, kl = fn(*leaves, 2, **seq, **kw)
        testing.training_loss(out, kl, rows=2 * 200).backward()
        return [out.detach(), kl.detach(), *(x.grad for x in leaves)]

    torch._dynamo.reset()
    try:
        with backends.forced("torch"):
            sel = torch.compile(flash_msa.select_blocks, fullgraph=True, backend="aot_eager")
            eager = flash_msa.select_blocks(qp, kp, 2, **seq, **FP8)
            assert torch.equal(sel(qp, kp, 2, **seq, **FP8), eager)
            assert not torch.equal(sel(qp, kp, 2, **seq), eager)
            msa = torch.compile(flash_msa.msa_attention, fullgraph=True, backend="aot_eager")
            got8, got16, eager8 = step(msa, **FP8), step(msa), step(flash_msa.msa_attention, **FP8)
            for name, a, b in zip(("out", "kl", *recall.GRADS), got8, eager8):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
            assert not torch.equal(got8[0], got16[0])
            args = (200, 64, 16**-0.5, 16**-0.5, 2, False, True, True, [4, 2, 16, 2, 1, 16])
            select_args = (qp, kp, seq["cu_seqlens"], *args, "torch")
            torch.library.opcheck(ops.select, select_args, FP8)
            with pytest.raises(ValueError, match="selection_precision"):  # not run as exact
                ops.select(*select_args, selection_precision="fp16")
    finally:
        torch._dynamo.reset()


CP_LENGTHS = [300, 77, 200]


def _cp_worker(rank, world, init_file, case_file):
    """One gloo rank: ``distributed.msa_attention`` with fp8 on this rank's shards against the
    single-process fp8 op (out, the KL summed over the ranks, the five gradients)."""
    import torch.distributed as dist

    gloo_group(rank, world, init_file, 120)
    try:
        case = torch.load(case_file, weights_only=False)
        lay = cp.layout(world, rank, cu_seqlens=testing.cu(CP_LENGTHS), block_size=64)
        xs = [cp.shard(x, lay).requires_grad_() for x in case["xs"]]
        out, kl = cp.msa_attention(*xs, 2, layout=lay, **FP8)
        ((out * cp.shard(case["dout"], lay)).sum() + case["w"] * kl).backward()
        testing.assert_close("out", out, cp.shard(case["out"], lay))
        total = kl.detach().clone()
        dist.all_reduce(total)
        testing.assert_close("kl", total, case["kl"])
        for name, x, exact in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), xs, case["grads"]):
            testing.assert_close(name, x.grad, cp.shard(exact, lay))
    finally:
        dist.destroy_process_group()


def test_distributed_selects_in_fp8(tmp_path):
    """``flash_msa.distributed.msa_attention(selection_precision="fp8")`` over 2 gloo ranks
    (torch backend, fp64) equals the single-process fp8 op, which differs from the bf16 one
    here: the keyword reaches the selection, which ranks the gathered keys' scales."""
    T = sum(CP_LENGTHS)
    xs = [x[0] for x in testing.make_inputs(1, T, 4, 2, 2, 1, 16, 16, dtype=torch.float64)]
    cu = testing.cu(CP_LENGTHS)
    dout, w = testing.loss_weights(xs[2].shape, 2 * T, 0)
    dout = dout.double()
    res = {}
    with backends.forced("torch"):
        for prec in quant.PRECISIONS:
            leaves = [x.clone().requires_grad_() for x in xs]
            out, kl = flash_msa.msa_attention(
                *leaves, 2, block_size=64, cu_seqlens=cu, selection_precision=prec
            )
            grads = torch.autograd.grad((out * dout).sum() + w * kl, leaves)
            res[prec] = dict(out=out.detach(), kl=kl.detach(), grads=grads)
    assert not torch.equal(res["fp8"]["out"], res["bf16"]["out"])
    case_file = tmp_path / "case.pt"
    torch.save(dict(xs=xs, dout=dout, w=w, **res["fp8"]), case_file)
    mp.spawn(_cp_worker, args=(2, str(tmp_path / "init"), str(case_file)), nprocs=2, join=True)


def _selection():
    cute_backend()
    from flash_msa.cute import selection

    return selection


def _case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random", key_scale="block"):
    """``(qp, kp, cu, cfg, qz)``: packed proxies on the GPU (``kind`` random, local or gain),
    the fp8 ``Config`` and the quantized operands every implementation ranks."""
    gain = kind == "gain"
    (qp, kp, *_), cu = packed_inputs(
        lengths, 1, 1, Hp, Hpk, 1, Dp, dtype=torch.float32, device="cuda", seed=seed,
        kind="random" if gain else kind,
    )  # fmt: skip
    if gain:  # per key block a factor in [1/8, 8]: the key scales decide the ranking
        blk = quant.block_of_token(cu, kp.shape[0], b)
        g = torch.Generator().manual_seed(seed + 1)
        f = 2.0 ** (6 * torch.rand(int(blk.max()) + 1, generator=g) - 3)
        kp = kp * f.to("cuda")[blk][:, None, None]
    qp, kp = qp.to(dtype).contiguous(), kp.to(dtype).contiguous()
    cfg = dataclasses.replace(config(max(lengths), 16, Dp, b, top_k), selection_precision="fp8")
    return qp, kp, cu, cfg, quant.quantize(qp, kp, cu, b, key_scale=key_scale)


def _cute_fp8(qz, cu, cfg, **variant):
    """The CuTe fp8 kernel into a poisoned index buffer (every slot must be written)."""
    T, Hp, _ = qz.q.shape
    out = testing.poisoned((T, Hp, cfg.top_k), torch.int32, "cuda")
    return _selection().select_fp8_into(out, qz, cu, cfg, **variant)


def _check_format(idx, cu, b):
    """Ascending valid entries, then -1; min(K, own + 1) of them; the own block among them."""
    K = idx.shape[2]
    lens = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(n, device=idx.device) for n in lens])  # sequence-local
    own = (pos // b)[:, None, None]
    valid = idx >= 0
    assert (valid.sum(-1) == torch.clamp(own[..., 0] + 1, max=K)).all(), "entry count"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 only after the valid entries"
    big = torch.where(valid, idx, torch.iinfo(torch.int32).max)
    assert (big[..., 1:] > big[..., :-1])[valid[..., 1:]].all(), "ascending, no duplicates"
    assert ((idx == own) & valid).any(-1).all(), "own block kept"
    assert (idx[valid] <= own.expand_as(idx)[valid]).all(), "no future block"


def _mismatch(idx, other, qz, cu, cfg):
    """Rows of ``idx`` and ``other`` that differ beyond near-ties of the fp8 scores."""
    qd, kd = quant.dequantize(qz)
    return testing.selection_mismatch(
        idx.cpu(), other.cpu(), qd.cpu(), kd.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )


def _oracle_and_reference(qp, kp, cu, cfg, qz):
    from flash_msa.triton_ref import selection_fp8

    return (
        selection_fp8.select_quantized(qz, cu, cfg),
        reference.select(qp, kp, cu, cfg, quantized=qz),
    )


CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype, key scale
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16, "block"),  # anchor / paper proxy heads
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16, "block"),  # varlen, Dp 64, block 64
    ((1500,), 4, 2, 128, 128, 1, torch.float16, "block"),  # top_k 1, Hpk 2, fp16 inputs
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16, "block"),  # top_k 64: the longest list
    ((5000, 77), 4, 1, 128, 64, 64, torch.float16, "block"),  # two blocks per tile, top_k 64
    ((2000, 4000), 8, 2, 64, 128, 16, torch.float16, "block"),
    ((8192,), 4, 1, 128, 64, 16, torch.bfloat16, "block"),  # 64 tiles of two ring slabs
    ((4100,), 4, 4, 128, 64, 16, torch.bfloat16, "token"),  # per-token key scales
    ((6000, 1, 333), 4, 1, 128, 128, 64, torch.float16, "token"),
    ((2500,), 2, 1, 64, 64, 1, torch.bfloat16, "token"),
]


def _case_id(c):
    return "x".join(map(str, c[0])) + f"-Dp{c[3]}-b{c[4]}-k{c[5]}-{str(c[6])[6:]}-{c[7]}"


@marked(SM90)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("kind", ["random", "local", "gain"])
def test_cute_fp8_select_matches_oracle_and_reference(case, kind):
    """The kernel's indices against the Triton oracle and the torch reference on the same
    quantized operands: equal up to near-ties, in the index format, every slot written."""
    *shape, key_scale = case
    qp, kp, cu, cfg, qz = _case(*shape, kind=kind, key_scale=key_scale)
    idx = _cute_fp8(qz, cu, cfg)
    _check_format(idx, cu, cfg.block_size)
    for other in _oracle_and_reference(qp, kp, cu, cfg, qz):
        assert _mismatch(idx, other, qz, cu, cfg) == 0


@marked(SM90)
@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
def test_cute_fp8_select_applies_the_key_scales(key_scale):
    """On ``gain`` inputs the key scales decide the ranking: the kernel given unit scales
    selects otherwise (so the comparison above can fail) and then agrees with the reference
    given the same unit scales."""
    qp, kp, cu, cfg, qz = _case((3000, 1200), 4, 1, 128, 64, 8, torch.bfloat16, 3, "gain",
                                key_scale)  # fmt: skip
    unit = qz._replace(k_scale=torch.ones_like(qz.k_scale))
    scaled, unscaled = _cute_fp8(qz, cu, cfg), _cute_fp8(unit, cu, cfg)
    assert not torch.equal(scaled, unscaled)
    for idx, ops in ((scaled, qz), (unscaled, unit)):
        want = reference.select(qp, kp, cu, cfg, quantized=ops)
        assert _mismatch(idx, want, ops, cu, cfg) == 0


@marked(SM90)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_fp8_select_op_quantizes_then_selects(dtype, monkeypatch):
    """``selection.select`` with ``selection_precision="fp8"`` (the backend op's body): the
    quantize pass with the shipped choices (block scale, rotation) and the kernel, against the
    reference's fp8 selection of the same inputs (which quantizes them the same way); the
    backend entry runs it."""
    from flash_msa import cute

    _selection()
    from flash_msa.cute import selection

    qp, kp, cu, cfg, qz = _case((7000, 900), 4, 1, 128, 128, 16, dtype, 5, "local")
    got = selection.select(qp, kp, cu, cfg)
    _check_format(got, cu, cfg.block_size)
    assert _mismatch(got, reference.select(qp, kp, cu, cfg), qz, cu, cfg) == 0
    assert torch.equal(got, _cute_fp8(qz, cu, cfg))  # quant.quantize: the same operands
    exact = selection.select(qp, kp, cu, dataclasses.replace(cfg, selection_precision="bf16"))
    assert not torch.equal(got, exact)  # the precision reached the kernel
    assert torch.equal(cute.select(qp, kp, cu, cfg), got)


@marked(SM90)
def test_cute_fp8_select_keeps_ties_in_block_order():
    """Key blocks with identical content quantize identically (the same block scale): every
    score ties and the lower blocks win, as in the reference (equal indices, no near-tie
    allowance); also across list evictions at top_k 24, and a whole 64-entry list."""
    g = torch.Generator().manual_seed(1)
    S, Dp = 128 * 40, 128
    kp = torch.randn(128, 1, Dp, generator=g).repeat(40, 1, 1).to("cuda", torch.bfloat16)
    qp = torch.randn(S, 2, Dp, generator=g).to("cuda", torch.bfloat16)
    cu = testing.cu([S], "cuda")
    qz = quant.quantize(qp, kp, cu, 128)
    for top_k in (5, 24, 64):
        cfg = dataclasses.replace(config(S, 16, Dp, 128, top_k), selection_precision="fp8")
        got = _cute_fp8(qz, cu, cfg)
        assert torch.equal(got, reference.select(qp, kp, cu, cfg, quantized=qz)), top_k


@marked(SM90)
@pytest.mark.parametrize("stages", [2, 4, 12])
def test_cute_fp8_select_pipeline_depth_does_not_change_the_result(stages):
    """``SelectSm90(stages=...)`` (default ``select_sm90.FP8_STAGES``): the same scores in the
    same order, so the same indices."""
    _, _, cu, cfg, qz = _case((3000, 1, 2100), 4, 1, 128, 64, 24, torch.bfloat16, 2)
    assert torch.equal(_cute_fp8(qz, cu, cfg, stages=stages), _cute_fp8(qz, cu, cfg))


@marked(SM90)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_cute_fp8_select_hypothesis_runtime_sizes(data):
    """Run-time sizes (lengths, number of sequences) and a few static ones (top_k, block, key
    scale) against the Triton oracle on the same quantized operands."""
    b = data.draw(st.sampled_from([64, 128]), label="block")
    lengths = data.draw(st.lists(st.integers(0, 900), min_size=1, max_size=5), label="lengths")
    assume(max(lengths) > 0)  # (an empty sequence among others: the kernel must skip it)
    top_k = data.draw(st.sampled_from([1, 3, 16, 33, 64]), label="top_k")
    key_scale = data.draw(st.sampled_from(quant.KEY_SCALES), label="key_scale")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    qp, kp, cu, cfg, qz = _case(lengths, 4, 1, 64, b, top_k, torch.bfloat16, seed,
                                key_scale=key_scale)  # fmt: skip
    idx = _cute_fp8(qz, cu, cfg)
    _check_format(idx, cu, b)
    oracle, _ = _oracle_and_reference(qp, kp, cu, cfg, qz)
    assert _mismatch(idx, oracle, qz, cu, cfg) == 0


@marked(SM90)
def test_cute_fp8_select_is_sync_free():
    """The op (quantize pass and kernel) makes no host synchronization, and repeats itself."""
    _selection()
    from flash_msa.cute.selection import select

    qp, kp, cu, cfg, _ = _case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    first = select(qp, kp, cu, cfg)  # compiles
    with no_host_sync():
        again = select(qp, kp, cu, cfg)
    assert torch.equal(first, again)


@marked(SM90)
def test_cute_fp8_select_is_graph_capturable():
    """The op captured in a CUDA graph and replayed on new inputs equals an eager call."""
    _selection()
    from flash_msa.cute.selection import select

    qp, kp, cu, cfg, _ = _case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    select(qp, kp, cu, cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select(qp, kp, cu, cfg)
    qp.copy_(torch.randn_like(qp))
    graph.replay()
    assert torch.equal(captured, select(qp, kp, cu, cfg))


# ---------------------------------------------------------------------------------------------
# the quantize pass as a CuTe kernel (cute/quantize_sm90.py, launched by cute/selection.py):
# bitwise the torch pass
# ---------------------------------------------------------------------------------------------
def _cute_quantize():
    pytest.importorskip("cutlass")
    from flash_msa.cute import selection

    return selection


QUANT_CASES = [  # lengths (empty and short sequences among them), Hp, Hpk, Dp, block, dtype
    ((8192,), 4, 1, 128, 128, torch.bfloat16),  # anchor / paper proxy heads
    ((3000, 0, 1, 700, 129), 2, 1, 64, 64, torch.bfloat16),
    ((1500, 63, 65), 4, 2, 128, 64, torch.float16),
    ((0, 2000, 4000, 1), 8, 2, 64, 128, torch.float16),
]


def _poisoned_like(qz):
    return tuple(testing.poisoned(x.shape, x.dtype, "cuda") for x in qz[:4])


def _assert_bitwise(got, want):
    """Equal e4m3 bytes and fp32 scales (as bits), NaN at the same places."""
    for name in ("q", "q_scale", "k", "k_scale"):
        a, b = getattr(got, name), getattr(want, name)
        bits = torch.uint8 if a.dtype == quant.E4M3 else torch.int32
        a_nan, b_nan = a.float().isnan(), b.float().isnan()
        assert torch.equal(a_nan, b_nan), name
        assert torch.equal(a.view(bits)[~a_nan], b.view(bits)[~b_nan]), name
    assert got.key_scale == want.key_scale


def _qcase_id(c):
    return "x".join(map(str, c[0])) + f"-Hp{c[1]}-Hpk{c[2]}-Dp{c[3]}-b{c[4]}-{str(c[5])[6:]}"


@marked(SM90)
@pytest.mark.parametrize("case", QUANT_CASES, ids=_qcase_id)
@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
def test_cute_quantize_is_bitwise_the_torch_pass(case, key_scale):
    """``selection.quantize`` against ``quant.quantize`` on the same GPU inputs (``gain``: key
    blocks of different magnitudes, so that the block scales differ): the same e4m3 bytes and
    fp32 scales, every output element written (the buffers start NaN-poisoned)."""
    lengths, Hp, Hpk, Dp, b, dtype = case
    qs = _cute_quantize()
    qp, kp, cu, _, _ = _case(lengths, Hp, Hpk, Dp, b, 16, dtype, 7, "gain", key_scale)
    want = quant.quantize(qp, kp, cu, b, key_scale=key_scale)
    out = _poisoned_like(want)
    got = qs.quantize(qp, kp, cu, b, key_scale, max_seqlen=max(lengths), out=out)
    assert all(x is y for x, y in zip(got, out))
    _assert_bitwise(got, want)
    # a loose max_seqlen (more CTAs, the extra ones do nothing) and the default (read from
    # cu_seqlens) give the same
    _assert_bitwise(qs.quantize(qp, kp, cu, b, key_scale, max_seqlen=9000), want)
    _assert_bitwise(qs.quantize(qp, kp, cu, b, key_scale), want)


@marked(SM90)
@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
@pytest.mark.parametrize("Dp", [64, 128])
def test_cute_quantize_edge_values(key_scale, Dp):
    """Rows the scale rule treats specially, bitwise as the torch pass: all zeros (scale 1),
    -0.0, an amax below ``448 * fp32 tiny`` (scale 1), subnormal and huge elements, outlier
    channels, and (query rows; key rows with per-token scales) inf and NaN (the torch pass's
    amax is NaN: scale 1, NaN values)."""
    qs = _cute_quantize()
    T, Hp, Hpk, b = 512, 4, 1, 64
    cu = testing.cu([T - 100, 100], "cuda")
    for dtype in (torch.bfloat16, torch.float16):
        fi = torch.finfo(dtype)
        g = torch.Generator().manual_seed(Dp)
        spread = torch.randint(-6, 7, (T, 1, 1), generator=g)  # key rows of many magnitudes
        qp = torch.randn(T, Hp, Dp, generator=g)
        fp16 = dtype == torch.float16
        kp = torch.randn(T, Hpk, Dp, generator=g) * 2.0 ** (spread * (1 if fp16 else 3))
        for x in (qp, kp):
            x[0] = 0.0
            x[1] = -0.0
            x[2] = 1e-37  # amax below quant's threshold (bf16; 0 in fp16)
            x[3, :, ::3] = fi.tiny / 4  # the dtype's subnormals beside normal elements
            x[4] *= fi.max / (16 if fp16 else 1024)  # huge (the rotated sums stay finite)
            x[5, :, :4] *= 1000.0  # outlier channels
            x[64:128] = 0.0  # a whole key block of zeros
        for x in (qp,) if key_scale == "block" else (qp, kp):
            x[6, 0, 5] = float("inf")
            x[7, 0, 9] = float("nan")
        q, k = (x.to(dtype).cuda() for x in (qp, kp))
        want = quant.quantize(q, k, cu, b, key_scale=key_scale)
        got = qs.quantize(q, k, cu, b, key_scale, out=_poisoned_like(want))
        _assert_bitwise(got, want)


@marked(SM90)
def test_cute_fp8_select_op_with_the_cute_quantize_pass(monkeypatch):
    """``selection.select`` (fp8) with the CuTe quantize pass (where it fits) against the torch
    pass (its named fallback, taken where ``selection.quantize_reason`` refuses; forced here
    by patching it): the same indices (the operands are the same bits), no host
    synchronization, and a CUDA graph capture replays it on new inputs."""
    selection = _selection()
    qp, kp, cu, cfg, _ = _case((7000, 900), 4, 1, 128, 128, 16, torch.bfloat16, 5, "local")

    def torch_pass():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(selection, "quantize_reason", lambda *a: "forced: the torch pass")
            return selection.select(qp, kp, cu, cfg)

    before = torch_pass()
    calls = []
    real = selection.quantize
    monkeypatch.setattr(selection, "quantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = selection.select(qp, kp, cu, cfg)
    assert calls and torch.equal(got, before)
    with no_host_sync():
        again = selection.select(qp, kp, cu, cfg)
    assert torch.equal(again, got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = selection.select(qp, kp, cu, cfg)
    qp.copy_(torch.randn_like(qp))
    graph.replay()
    assert torch.equal(captured, torch_pass())
