"""Context parallelism (``flash_msa.distributed``) against the single-process op.

Three kinds of tests:

- single process, no communication: the zigzag layout (every token on exactly one rank, rank
  ``r`` holding chunks ``r`` and ``2P-1-r``, chunks of whole blocks), ``shard``/``unshard``
  round trips, and the op's query map (``q_map``) that CP runs on: each "rank"'s local queries
  against the whole batch's keys give that rank's rows of the single-process result, and its
  key gradients sum to the single-process ones;
- one ``torch.multiprocessing`` spawn of 4 processes on gloo (CPU, torch backend) that runs every
  case on the world group (P = 4) and on two groups of 2 ranks (P = 2): batch and varlen forms,
  fp64 and fp32, sparse and warmup, outputs, the KL and all five gradients against the
  single-process op computed once in this process; an unused KL (no proxy gradient, no
  collective for it); and a training step whose parameter gradients, after the SUM all-reduce
  over the CP group, equal one process on the whole batch;
- the real-size check (:func:`_real_worker`): 2 ranks, one long ``kind="local"`` sequence, the
  CP run against single-process runs that recompute on the whole sequence: on 2 GPUs (NCCL, 64K
  tokens, anchor heads, ``gpu``) and on CPU in bf16 (gloo, 1024 tokens), where bf16 is checked
  by comparing the selections first and then the rule over CP's selection.

Measured on the 2-core CI machine (``--durations``): see docs/distributed.md, "Tests".

The ranks' agreement check of ``flash_msa.distributed`` (docs/distributed.md, "Agreement").

Every eager ``msa_attention`` / ``gather`` all-gathers one fixed-length int64 fingerprint per
rank before its first collective, and every rank raises the same ``ValueError`` naming each
field that differs; a rank whose own argument checks raise takes part with an error flag, so
the others raise too instead of waiting in a collective. Two kinds of tests:

- single process: the verdict from synthetic tables (grouping of ranks by value, several
  fields, a rejecting rank, a truncated message, other formats and calls) and the layout's
  ``cu_seqlens_hash``;
- one ``torch.multiprocessing`` spawn of 2 gloo processes (a 30 s group timeout: a regression
  that hangs fails within it) that runs each mismatch in turn: layouts of different batches
  with the same local token count, ``top_k``, ``warmup``, the keys' head count, the dtype,
  ``requires_grad``, ``gather``'s elements per token, and a rank that rejects its own
  arguments (in the op's checks and in this module's); each must raise on both ranks within
  seconds, and a valid call afterwards shows the group still in step.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import time
import types

import pytest
import torch
import torch.multiprocessing as mp

import flash_msa
from flash_msa import api, backends, reference, testing
from flash_msa import distributed as cp
from flash_msa.problem import Config, problem_of
from harness import gloo_group

HEADS = dict(H=4, Hkv=2, Hp=2, Hpk=1, D=16, Dp=16)
TOP_K = 3
BLOCK = 64
pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(T, dtype, seed=0):
    """Packed ``(T, heads, dim)`` MSA inputs in ``dtype``."""
    h = HEADS
    xs = testing.make_inputs(
        1, T, h["H"], h["Hkv"], h["Hp"], h["Hpk"], h["D"], h["Dp"], dtype=dtype, seed=seed
    )
    return [x.reshape(-1, *x.shape[2:]) for x in xs]


def _single(xs, cu, *, warmup=False, kl_used=True, seed=0):
    """The single-process op on the whole batch (torch backend): out, kl and the five grads."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    with backends.forced("torch"):
        out, kl = flash_msa.msa_attention(
            *xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, warmup=warmup
        )
    rows = HEADS["Hp"] * out.shape[0]
    dout, w = testing.loss_weights(out.shape, rows, seed)
    dout = dout.to(out.dtype)  # the loss in the inputs' dtype: fp64 stays fp64
    loss = (out * dout).sum() + (w * kl if kl_used else 0.0)
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return {"out": out.detach(), "kl": kl.detach(), "grads": grads, "dout": dout, "w": w}


# ---------------------------------------------------------------------------------------------
# single process: layout, shard/unshard, the query map
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_layout_zigzag(P):
    """Every token on exactly one rank; rank r holds chunks r and 2P-1-r of every sequence,
    chunks of whole blocks, the same token count on every rank; padding only past the end."""
    lengths = [300, 0, 77, 520, 64]
    cu = testing.cu(lengths)
    lay = cp.layout(P, 0, cu_seqlens=cu, block_size=BLOCK)
    assert lay.token_index.shape == (P, lay.local_tokens)
    seen = lay.token_index[lay.token_index >= 0].sort().values
    assert torch.equal(seen, torch.arange(sum(lengths)))
    assert lay.max_seqlen == 520 and lay.total_tokens == sum(lengths)
    assert torch.equal(lay.local_cu_seqlens, testing.cu([2 * c for c in lay.chunks]))
    for r in range(P):
        mine = lay.for_rank(r)
        assert mine.rank == r and torch.equal(mine.q_map.long(), lay.token_index[r])
        for n, (L, c) in enumerate(zip(lengths, lay.chunks)):
            assert c % BLOCK == 0 and 2 * P * c >= L and (c == 0 or 2 * P * (c - BLOCK) < L)
            s0 = int(lay.local_cu_seqlens[n])
            want = torch.cat(
                [torch.arange(r * c, (r + 1) * c), torch.arange(c) + (2 * P - 1 - r) * c]
            )
            want = torch.where(want < L, want, -1)
            assert torch.equal(mine.positions[s0 : s0 + 2 * c], want)
            assert torch.equal(
                mine.q_map[s0 : s0 + 2 * c].long(),
                torch.where(want >= 0, want + sum(lengths[:n]), -1),
            )


def test_shard_unshard_round_trip():
    """``unshard`` of every rank's ``shard`` is the identity (varlen and batch form); padding
    slots hold ``fill``; both are differentiable."""
    cu = testing.cu([300, 77, 520])
    x = torch.randn(897, 3, 2, dtype=torch.float64, requires_grad=True)
    lay = cp.layout(2, 1, cu_seqlens=cu, block_size=BLOCK)
    shards = [cp.shard(x, lay, rank=r, fill=7.0) for r in range(2)]
    assert shards[1].shape == (lay.local_tokens, 3, 2)
    assert torch.equal(
        shards[1][lay.positions < 0], torch.full_like(shards[1][lay.positions < 0], 7)
    )
    assert torch.equal(cp.unshard(shards, lay), x)
    assert torch.equal(cp.shard(x, lay, fill=7.0), shards[1])  # rank=None: the layout's
    cp.unshard(shards, lay).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # batch form, S not a multiple of 2P blocks: (B, S, ...) <-> (B, 2c, ...)
    xb = torch.randn(2, 200, 5)
    lay = cp.layout(2, 0, batch_size=2, seqlen=200, block_size=BLOCK)
    shards = [cp.shard(xb, lay, rank=r) for r in range(2)]
    assert shards[0].shape == (2, 128, 5) and lay.local_shape == (2, 128)
    assert torch.equal(cp.unshard(torch.stack(shards), lay), xb)


def test_layout_validation():
    cu = testing.cu([100])
    with pytest.raises(ValueError, match="rank"):
        cp.layout(2, 2, cu_seqlens=cu)
    with pytest.raises(TypeError, match="world_size"):
        cp.layout(2.0, 0, cu_seqlens=cu)
    with pytest.raises(ValueError, match="block_size"):
        cp.layout(2, 0, cu_seqlens=cu, block_size=32)
    with pytest.raises(ValueError, match="give cu_seqlens"):
        cp.layout(2, 0)
    with pytest.raises(ValueError, match="not both"):
        cp.layout(2, 0, cu_seqlens=cu, batch_size=1, seqlen=100)
    with pytest.raises(ValueError, match="int32 or int64"):
        cp.layout(2, 0, cu_seqlens=cu.to(torch.int16))
    lay = cp.layout(2, 0, cu_seqlens=cu, block_size=BLOCK)
    wide = cp.layout(2, 0, cu_seqlens=cu.long(), block_size=BLOCK)  # int64: the same layout
    assert wide.cu_seqlens.dtype == torch.int32 and torch.equal(wide.q_map, lay.q_map)
    with pytest.raises(ValueError, match="leading dims"):
        cp.shard(torch.zeros(99, 2), lay)
    with pytest.raises(ValueError, match="2 shards"):
        cp.unshard([torch.zeros(lay.local_tokens)], lay)
    with pytest.raises(TypeError, match="Layout"):
        cp.shard(torch.zeros(100), object())
    xs = [cp.shard(x, lay) for x in _inputs(100, torch.float64)]
    with pytest.raises(RuntimeError, match="initialized"):
        cp.msa_attention(*xs, TOP_K, layout=lay)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        cp.msa_attention(*xs, TOP_K, layout=lay, overlap=1)
    with pytest.raises(TypeError, match="timer must be a flash_msa.distributed.WaitTimer"):
        cp.msa_attention(*xs, TOP_K, layout=lay, timer=object())
    with pytest.raises(TypeError, match="timer must be"):
        cp.gather(xs[0], lay, timer=[])


@pytest.mark.parametrize("P, dtype", [(3, torch.float64)])
def test_q_map_emulated_cp(P, dtype):
    """The op with a query map, each rank in turn, no communication: the local queries against
    the whole batch's keys give that rank's rows of the single-process out and q-side
    gradients; the KL shares and the key gradients summed over the ranks give the
    single-process ones (what the collectives of flash_msa.distributed add)."""
    lengths = [300, 77, 520]
    cu = testing.cu(lengths)
    xs = _inputs(sum(lengths), dtype)
    ref = _single(xs, cu)
    rows = HEADS["Hp"] * sum(lengths)
    kl_sum, key_grads = 0.0, [0.0, 0.0, 0.0]
    for r in range(P):
        lay = cp.layout(P, r, cu_seqlens=cu, block_size=BLOCK)
        qp, q = (cp.shard(x, lay).requires_grad_() for x in (xs[0], xs[2]))
        kp, k, v = (x.detach().clone().requires_grad_() for x in (xs[1], xs[3], xs[4]))
        with backends.forced("torch"):
            out, kl = api._msa_attention(
                qp, kp, q, k, v, TOP_K, block_size=BLOCK, cu_seqlens=cu, q_map=lay.q_map
            )
        share = kl * (lay.local_tokens / lay.total_tokens)
        loss = (out * cp.shard(ref["dout"], lay)).sum() + ref["w"] * share
        grads = torch.autograd.grad(loss, (qp, kp, q, k, v))
        testing.assert_close(f"out[{r}]", out, cp.shard(ref["out"], lay))
        assert out[lay.positions < 0].abs().max() == 0  # padding rows: out = 0
        for name, i in (("dq_proxy", 0), ("dq", 2)):
            testing.assert_close(f"{name}[{r}]", grads[i], cp.shard(ref["grads"][i], lay))
        kl_sum = kl_sum + share.detach()
        key_grads = [a + g for a, g in zip(key_grads, (grads[1], grads[3], grads[4]))]
    testing.assert_close("kl", kl_sum, ref["kl"], dtype=dtype)
    for name, mine, i in zip(("dk_proxy", "dk", "dv"), key_grads, (1, 3, 4)):
        testing.assert_close(name, mine, ref["grads"][i])
    assert rows > 0


def test_q_map_identity_and_padding_rows():
    """``q_map = arange(T)`` is the op without a map, bit for bit; padding rows (-1) give out 0,
    lse -inf (no keys) and add nothing to the KL sum."""
    cu = testing.cu([200, 130])
    xs = _inputs(330, torch.float64)
    with backends.forced("torch"):
        out, kl = flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu)
        ident = torch.arange(330, dtype=torch.int32)
        out2, kl2 = api._msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, q_map=ident)
    assert torch.equal(out, out2) and torch.equal(kl, kl2)
    rows = torch.tensor([5, 329, 0, 200], dtype=torch.long)
    q_map = torch.cat([rows, torch.tensor([-1, -1])]).to(torch.int32)

    def take(x):
        return torch.cat([x[rows], torch.zeros(2, *x.shape[1:], dtype=x.dtype)])

    cfg = Config(block_size=BLOCK, softmax_scale=0.25, max_seqlen=200, proxy_scale=8**-0.5)
    cfg = Config(**{**cfg.__dict__, "top_k": TOP_K, "compute_kl": True})
    full_idx = reference.select(xs[0], xs[1], cu, cfg)
    idx = reference.select(take(xs[0]), xs[1], cu, cfg, q_map=q_map)
    assert torch.equal(idx[:4], full_idx[rows]) and (idx[4:] == -1).all()
    full = reference.fwd(xs[2], xs[3], xs[4], full_idx, cu, cfg, xs[0], xs[1])
    mine = reference.fwd(take(xs[2]), xs[3], xs[4], idx, cu, cfg, take(xs[0]), xs[1], q_map=q_map)
    testing.assert_close("out", mine.out[:4], full.out[rows])
    assert (mine.out[4:] == 0).all() and (mine.lse[4:] == -torch.inf).all()
    assert (mine.proxy_lse[4:] == -torch.inf).all()


def test_q_map_validation():
    cu = testing.cu([100, 60])
    qp, kp, q, k, v = _inputs(160, torch.float64)
    lay = cp.layout(2, 0, cu_seqlens=cu, block_size=BLOCK)
    qp_l, q_l = cp.shard(qp, lay), cp.shard(q, lay)
    qm = lay.q_map

    def call(qp_=qp_l, kp_=kp, q_=q_l, k_=k, v_=v, **kw):
        kw = {"block_size": BLOCK, "cu_seqlens": cu, "q_map": qm, **kw}
        return api._msa_attention(qp_, kp_, q_, k_, v_, TOP_K, **kw)

    with backends.forced("torch"):
        call()  # valid
        with pytest.raises(ValueError, match="key_gather needs q_map"):
            call(q_map=None, key_gather=object())
        with pytest.raises(ValueError, match="varlen form"):
            api._msa_attention(qp[None], kp[None], q[None], k[None], v[None], TOP_K, q_map=qm)
        with pytest.raises(TypeError, match="q_map must be int32"):
            call(q_map=qm.long())
        with pytest.raises(TypeError, match="q_map must be a torch.Tensor"):
            call(q_map=qm.tolist())
        with pytest.raises(ValueError, match="one entry per query row"):
            call(q_map=qm[:-1])
        with pytest.raises(ValueError, match=r"key token indices in \[0, 160\)"):
            call(q_map=torch.full_like(qm, 160))
        with pytest.raises(ValueError, match=r"-1 \(a padding row\)"):
            call(q_map=torch.full_like(qm, -2))
        with pytest.raises(ValueError, match="total_tokens"):
            call(q_=q_l[:-1])  # q_proxy and q disagree
        with pytest.raises(ValueError, match="total_tokens"):
            call(k_=k[:-1], v_=v[:-1])  # keys do not match cu_seqlens / k_proxy
        with pytest.raises(TypeError, match="dtype"):
            call(k_=k.float(), v_=v.float(), kp_=kp.float())


def test_q_map_refused_by_gpu_backends(monkeypatch):
    """The torch backend declares the query map everywhere, Triton for its sparse ops (not the
    warmup), CuTe for select, fwd and bwd (``cute.Q_MAP_DECLARED`` and
    ``cute.FWD_Q_MAP_DECLARED``, after their GPU tests passed); a backend that does not refuses it
    by name (the same call without a map runs there), so a forced backend raises and ``auto``
    falls back to one that runs it. (The Triton ops with a map: tests/ops/test_q_map.py.)"""
    mapped_ops = {"triton": ("select", "fwd", "bwd"), "cute": ("select", "fwd", "bwd")}
    cfg = Config(block_size=BLOCK, softmax_scale=0.25, max_seqlen=128, proxy_scale=0.3, top_k=4)
    plain = problem_of("cpu", torch.bfloat16, (16, 2, 128, 4, 1, 128), 1, True, cfg)
    plain = type(plain)(**{**plain.__dict__, "device_type": "cuda", "capability": (9, 0)})
    mapped = type(plain)(**{**plain.__dict__, "q_map": True})
    warm = Config(**{**cfg.__dict__, "top_k": None, "warmup": True})
    warm_mapped = type(mapped)(**{**mapped.__dict__, "cfg": warm})
    for op in ("select", "fwd", "bwd"):
        assert reference.unsupported_reason(op, mapped) is None
        for name in ("triton", "cute"):
            module, _ = backends.load(name)
            if module is not None:
                assert module.unsupported_reason(op, plain) is None, (name, op)
                why = module.unsupported_reason(op, mapped)
                if op in mapped_ops[name]:
                    assert why is None, (name, op, why)
                else:
                    assert "q_map" in (why or ""), (name, op)
    for op in ("fwd", "bwd"):  # the Triton warmup takes no map
        module, _ = backends.load("triton")
        if module is not None:
            assert "q_map" in (module.unsupported_reason(op, warm_mapped) or ""), op
    cu = testing.cu([100])
    xs = _inputs(100, torch.float32)
    q_map = torch.arange(100, dtype=torch.int32)
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")  # runs fp32 CPU under the interpreter
    with pytest.raises(flash_msa.BackendError, match="q_map"):
        api._msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, q_map=q_map, warmup=True)


# ---------------------------------------------------------------------------------------------
# multi-process: gloo, torch.multiprocessing
# ---------------------------------------------------------------------------------------------
def _cases():
    """The cases every CP group runs: inputs and the single-process results."""
    out = {}
    lengths = {"batch": None, "varlen": [300, 77, 0, 520], "warmup": [200, 130]}
    for name, dtype in (
        ("batch", torch.float64),
        ("varlen", torch.float32),
        ("warmup", torch.float64),
    ):
        if name == "batch":
            B, S = 2, 512
            cu = testing.cu([S] * B)
            xs = _inputs(B * S, dtype)
            form = dict(batch_size=B, seqlen=S)
        else:
            cu = testing.cu(lengths[name])
            xs = _inputs(int(cu[-1]), dtype)
            form = dict(cu_seqlens=cu)
        ref = _single(xs, cu, warmup=name == "warmup")
        out[name] = {"xs": xs, "cu": cu, "form": form, "warmup": name == "warmup", **ref}
    # the batch case again with the KL unused: no proxy gradient anywhere
    out["kl_unused"] = {
        **out["batch"],
        **_single(out["batch"]["xs"], out["batch"]["cu"], kl_used=False),
    }
    out["step"] = _step_reference()
    return out


# (heads, head_dim) of q_proxy, k_proxy, q, k, v
_DIMS = tuple(
    (HEADS[a], HEADS[b])
    for a, b in (("Hp", "Dp"), ("Hpk", "Dp"), ("H", "D"), ("Hkv", "D"), ("Hkv", "D"))
)


def _projections(T, dm=12, seed=1):
    """A layer's input ``x (T, dm)`` and the five projection weights (fp64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, dm, generator=g, dtype=torch.float64)
    ws = [torch.randn(dm, h * d, generator=g, dtype=torch.float64) / dm**0.5 for h, d in _DIMS]
    return x, ws


def _project(x, ws):
    """``q_proxy, k_proxy, q, k, v`` of ``x``: ``x @ w`` per projection, split into heads."""
    return [(x @ w).view(x.shape[0], *d) for w, d in zip(ws, _DIMS)]


def _step_reference():
    """One process, whole batch: the projection weights' gradients of main + KL loss."""
    cu = testing.cu([300, 77, 520])
    x, ws = _projections(int(cu[-1]))
    ws = [w.requires_grad_() for w in ws]
    with backends.forced("torch"):
        out, kl = flash_msa.msa_attention(*_project(x, ws), TOP_K, block_size=BLOCK, cu_seqlens=cu)
    dout, w = testing.loss_weights(out.shape, HEADS["Hp"] * out.shape[0], 3)
    grads = torch.autograd.grad((out * dout).sum() + w * kl, ws)
    return {"x": x, "ws": [w.detach() for w in ws], "cu": cu, "dout": dout, "w": w, "grads": grads}


def _run_case(case, group, P, rank, compiled=False, **op):
    """One case on one CP group: this rank's out, KL share and five gradients against the
    single-process ones. ``compiled``: the op under ``torch.compile(fullgraph=True)`` (the
    ``aot_eager`` backend: Dynamo and AOTAutograd trace the whole step, collectives included,
    without Inductor's C++ build; Inductor itself is checked in tests/api/test_torch_compile.py);
    ``op``: further keywords of ``cp.msa_attention`` (``overlap``, ``timer``)."""
    lay = cp.layout(P, rank, block_size=BLOCK, **case["form"])

    def local(x):  # packed global (T, ...) -> this rank's shard in the layout's form
        return cp.shard(x.view(*lay.global_shape, *x.shape[1:]), lay)

    xs = [local(x).requires_grad_() for x in case["xs"]]
    fn = torch.compile(cp.msa_attention, fullgraph=True, backend="aot_eager") if compiled else None
    out, kl = (fn or cp.msa_attention)(
        *xs, TOP_K, layout=lay, group=group, warmup=case["warmup"], **op
    )
    kl_used = case["grads"][0] is not None
    loss = (out * local(case["dout"])).sum()
    (loss + case["w"] * kl if kl_used else loss).backward()
    testing.assert_close("out", out, local(case["out"]))
    total = kl.detach().clone()
    torch.distributed.all_reduce(total, group=group)  # the single-process kl
    testing.assert_close("kl", total, case["kl"])
    for name, x, exact in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), xs, case["grads"]):
        if exact is None:  # KL unused: no proxy gradient (and no collective for it)
            assert x.grad is None, name
        else:
            testing.assert_close(name, x.grad, local(exact))


def _run_step(case, group, P, rank):
    """A training step: per-rank loss (its share of the main loss + w * its KL share), backward,
    SUM all-reduce of the weights' gradients over the CP group = one process."""
    lay = cp.layout(P, rank, cu_seqlens=case["cu"], block_size=BLOCK)
    ws = [w.clone().requires_grad_() for w in case["ws"]]
    out, kl = cp.msa_attention(
        *_project(cp.shard(case["x"], lay), ws), TOP_K, layout=lay, group=group
    )
    ((out * cp.shard(case["dout"], lay)).sum() + case["w"] * kl).backward()
    for i, (w, exact) in enumerate(zip(ws, case["grads"])):
        torch.distributed.all_reduce(w.grad, group=group)
        testing.assert_close(f"dW[{i}]", w.grad, exact)


class _LogTimer(cp.WaitTimer):
    """A WaitTimer that also logs each wait's name in ``log`` (shared with a select spy)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def wait(self, x, name):
        self.log.append(name)
        return super().wait(x, name)


def _run_order(case, group, P, rank):
    """The overlap: with ``overlap=True`` the op waits for the ``k``/``v`` all-gathers after its
    selection (``k_proxy`` before it), with ``False`` before it; the backward waits for the three
    reduce-scatters; the timer reports every wait; both give the single-process result."""
    log = []
    select = reference.select

    def spy(*a, **kw):
        log.append("select")
        return select(*a, **kw)

    reference.select = spy  # the torch backend's module: api calls select_be.select
    try:
        for overlap, order in ((True, ["k_proxy", "select", "k", "v"]), (False, None)):
            log.clear()
            timer = _LogTimer(log)
            _run_case(case, group, P, rank, overlap=overlap, timer=timer)
            order = order or ["k_proxy", "k", "v", "select"]
            assert log == [*order, "dk_proxy", "dk", "dv"], (overlap, log)
            times = timer.times_ms()
            assert sorted(times) == sorted(set(log) - {"select"}), times
            assert all(t >= 0 for t in times.values()), times
    finally:
        reference.select = select


def _worker(rank, world, init_file, cases_file):
    """One process of the spawn: every case on the world group (P = 4), then every other case
    on its pair group (P = 2; ranks 0-1 and 2-3 run alternate cases, both forms among each)."""
    import torch.distributed as dist

    gloo_group(rank, world, init_file, 120)  # (4 processes on 2 cores: one thread each)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        cases = torch.load(cases_file, weights_only=False)
        pair = rank // 2
        for group, P, r in ((None, world, rank), (pairs[pair], 2, rank % 2)):
            runs = [
                (name, _run_step if name == "step" else _run_case, case, {})
                for i, (name, case) in enumerate(cases.items())
                if P == 4 or i % 2 == pair
            ]
            if P == 4:  # the overlap's order of waits and selection
                runs.append(("batch order", _run_order, cases["batch"], {}))
            else:  # torch.compile(fullgraph=True), one compile per process (~5-10 s each)
                form = ("varlen", "batch")[pair]
                runs.append((f"{form} compiled", _run_case, cases[form], {"compiled": True}))
            for name, run, case, kw in runs:
                try:
                    run(case, group, P, r, **kw)
                except AssertionError as e:
                    raise AssertionError(f"P={P} rank {r}, case {name}: {e}") from e
    finally:
        dist.destroy_process_group()


def test_cp_gloo(tmp_path):
    """CP over 4 and 2 gloo ranks equals the single-process op (see the module docstring)."""
    cases_file = tmp_path / "cases.pt"
    torch.save(_cases(), cases_file)
    mp.spawn(_worker, args=(4, str(tmp_path / "init"), str(cases_file)), nprocs=4, join=True)


# ---------------------------------------------------------------------------------------------
# the real-size check: 2 ranks, one long sequence (GPUs: NCCL, 64K tokens; CPU: gloo, small)
# ---------------------------------------------------------------------------------------------
GPU_HEADS = dict(H=16, Hkv=2, Hp=4, Hpk=1, D=128, Dp=128)  # the anchors' shape
GPU_SEQLEN = 65536
GPU_TOP_K = 16  # of 512 blocks of 128 at 64K

# Rows (token, proxy head) whose CP selection may differ from the single-process run's, each a
# near-tie (testing.selection_mismatch): the two runs rank the same fp32 scores of the same bf16
# operands, but the kernels may sum a dot product in another order (another query tiling under
# the map, or another backend: CuTe selects without a map, Triton with one), which can swap
# blocks whose scores agree to the last bits. Measured: 0 rows on CPU (torch backend, 4096
# tokens); the H200 count is printed by the GPU test.
MAX_SELECTION_FLIPS = 1e-3


@contextlib.contextmanager
def _selection(*, record=None, given=None):
    """Within it, the op's selection (on whichever backend resolves it) appends its indices to
    ``record`` (a list), or returns ``given`` instead (int32 ``(T, Hp, top_k)`` of the whole
    batch, no query map): the op then attends, and computes its KL and gradients, over a
    selection made elsewhere. It wraps ``backends.resolve``, which the eager op calls per op."""
    resolve = backends.resolve

    def hooked(op, problem):
        name, module = resolve(op, problem)
        if op != "select":
            return name, module

        def select(q_proxy, *args, **kw):
            if given is not None:
                assert "q_map" not in kw and given.shape[0] == q_proxy.shape[0], "whole batch only"
                return given
            indices = module.select(q_proxy, *args, **kw)
            record.append(indices)
            return indices

        return name, types.SimpleNamespace(select=select)

    backends.resolve = hooked
    try:
        yield
    finally:
        backends.resolve = resolve


def _check_selection(mine, single, q_proxy, k_proxy, cu, rank):
    """CP's selection (``mine``, gathered to the global order) against the single-process
    run's: the same blocks in all but ``MAX_SELECTION_FLIPS`` of the rows, each of those a
    near-tie by semantics.md's rule. Returns the number of rows that differ."""
    assert mine.shape == single.shape, (tuple(mine.shape), tuple(single.shape))
    differ = int((mine != single).any(-1).sum())  # both ascending, -1 padded
    rows = mine.shape[0] * mine.shape[1]
    print(f"rank {rank}: CP selection differs from one process in {differ} of {rows} rows")
    assert differ <= MAX_SELECTION_FLIPS * rows, f"selection: {differ} of {rows} rows differ"
    if differ:
        cpu = [x.cpu() for x in (mine, single, q_proxy, k_proxy)]
        block, scale = 128, q_proxy.shape[-1] ** -0.5  # the op's defaults
        bad = testing.selection_mismatch(*cpu, block, scale, cu.cpu())
        assert bad == 0, f"selection: {bad} of {differ} differing rows are not near-ties"
    return differ


def _real_worker(rank, world, init_file, spec):
    """One rank of the 2-rank check on one long sequence (``kind="local"`` inputs), ``spec``:
    ``device`` ("cuda": NCCL, one GPU per rank; "cpu": gloo), ``seqlen``, ``heads``, ``top_k``,
    ``backend`` and ``dtype`` of the CP run, ``perturb`` (added to rank 1's ``out`` before the
    check, to show that the check fails).

    fp32 (torch backend): CP against the single-process fp32 op, ``atol`` only. bf16: a flipped
    near-tie block changes a row's output by O(1), so bf16 and fp32 runs that select
    independently differ by far more than rounding (at 64K the bf16 single-process ``out`` was
    0.12 from fp32 on values up to 0.49, and the rule could not fail). So first the selections:
    CP's (recorded on each rank, gathered) against the single-process ``backend`` run's, by
    :func:`_check_selection`; then out, the KL and the five gradients by the rule over **CP's
    selection**: exact = the torch backend in fp32, same = the single-process ``backend`` run
    in bf16, both given CP's indices (:func:`_selection`), so that only rounding is compared."""
    import time

    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    if cuda:
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 exact reference stays fp32
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)  # 2 processes on the 2 CI cores
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        h, S, top_k, backend, dtype = (
            spec[n] for n in ("heads", "seqlen", "top_k", "backend", "dtype")
        )
        xs = testing.make_inputs(1, S, *h.values(), dtype=torch.float32, kind="local", seed=0)
        xs = [x.reshape(S, *x.shape[2:]).to(dev) for x in xs]
        cu = testing.cu([S], dev)
        rows = h["Hp"] * S

        def single(inputs, be, given=None):
            inputs = [x.detach().clone().requires_grad_() for x in inputs]
            hook = contextlib.nullcontext() if given is None else _selection(given=given)
            with backends.forced(be), hook:
                out, kl = flash_msa.msa_attention(*inputs, top_k, cu_seqlens=cu, max_seqlen=S)
                grads = torch.autograd.grad(testing.training_loss(out, kl, rows), inputs)
            return [out.detach(), kl.detach(), *grads]

        lay = cp.layout(world, rank, cu_seqlens=cu.cpu(), block_size=128, device=dev)
        local = [cp.shard(x.to(dtype), lay).requires_grad_() for x in xs]
        dout, w = testing.loss_weights((S, h["H"], h["D"]), rows, 0, dev)
        picked = []
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with backends.forced(backend), _selection(record=picked):
            out, kl = cp.msa_attention(*local, top_k, layout=lay)
            ((out.float() * cp.shard(dout, lay)).sum() + w * kl.float()).backward()
        if cuda:
            torch.cuda.synchronize()
        print(f"rank {rank}: CP step {1e3 * (time.perf_counter() - t0):.1f} ms ({backend})")
        total = kl.detach().clone()
        dist.all_reduce(total)
        out = out.detach() + (spec["perturb"] if rank == 1 else 0.0)
        mine = [out, total, *(x.grad for x in local)]
        if dtype == torch.float32:
            exact, same = single(xs, "torch"), None
        else:
            (indices,) = picked
            indices = cp.gather(indices, lay)  # (S, Hp, top_k): every rank's, global order
            low = [x.to(dtype) for x in xs]
            with backends.forced(backend):
                alone = flash_msa.select_blocks(low[0], low[1], top_k, cu_seqlens=cu, max_seqlen=S)
            _check_selection(indices, alone, low[0], low[1], cu, rank)
            exact = single(xs, "torch", given=indices)
            same = single(low, backend, given=indices)
        names = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
        for i, (name, m) in enumerate(zip(names, mine)):
            ex = exact[i] if name == "kl" else cp.shard(exact[i], lay)
            sm = None if same is None else same[i] if name == "kl" else cp.shard(same[i], lay)
            err, tol = testing.assert_close(name, m, ex, sm, dtype=dtype)
            print(f"rank {rank}: {name} error {err:.3e} <= tolerance {tol:.3e}")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cp_nccl_64k(tmp_path, backend):
    """2 GPUs, NCCL, one 64K-token sequence (anchor heads, top_k 16, block 128): CP equals the
    single-process op (torch backend: fp32, against the single-process fp32 op; auto: bf16,
    selections compared first, then the rule over CP's selection: :func:`_real_worker`).
    ``auto`` runs the Triton sparse ops (the query map is not on CuTe yet); skipped with the
    backends' reasons where no GPU backend takes it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if backend == "auto":
        cfg = Config(
            block_size=128, softmax_scale=1.0, max_seqlen=GPU_SEQLEN, proxy_scale=1.0, top_k=16
        )
        dims = tuple(GPU_HEADS[n] for n in ("H", "Hkv", "D", "Hp", "Hpk", "Dp"))
        prob = problem_of("cuda:0", torch.bfloat16, dims, 1, True, cfg, q_map=True)
        for op in ("select", "fwd", "bwd"):
            name, rejected = backends.choose(op, prob)
            if name is None:
                pytest.skip(f"no GPU backend runs {op} with a query map yet: {rejected}")
    spec = dict(
        device="cuda",
        seqlen=GPU_SEQLEN,
        heads=GPU_HEADS,
        top_k=GPU_TOP_K,
        backend=backend,
        dtype=torch.float32 if backend == "torch" else torch.bfloat16,
        perturb=0.0,
    )
    mp.spawn(_real_worker, args=(2, str(tmp_path / "init"), spec), nprocs=2, join=True)


CPU_SEQLEN = 1024  # the torch backend is O(S^2): 2048 took 18-19 s per case, 1024 5 s


@pytest.mark.parametrize("perturb", [0.0, 3e-2])
def test_cp_bf16_gloo(tmp_path, perturb):
    """The bf16 check of ``test_cp_nccl_64k[auto]`` on CPU: 2 gloo ranks, the torch backend in
    bf16, 1024 tokens (top_k 4 of 8 blocks), small heads. Here too bf16 and fp32 select
    differently (3 of 2048 rows), enough for the old comparison against the fp32 op's own
    selection to refuse itself (rank 1's dq: 2 * tolerance 1.04 > max |exact| 0.75); over CP's
    selection it passes (rank 1's out: error 5.7e-3, tolerance 1.55e-2), and with ``perturb``
    added to rank 1's ``out`` it fails on ``out`` (3e-2: twice the tolerance, a clear margin).
    4.6-8.5 s each (``--durations``, 2 cores, load 5 and more)."""
    spec = dict(
        device="cpu",
        seqlen=CPU_SEQLEN,
        heads=HEADS,
        top_k=4,
        backend="torch",
        dtype=torch.bfloat16,
        perturb=perturb,
    )
    args = (2, str(tmp_path / "init"), spec)
    if not perturb:
        mp.spawn(_real_worker, args=args, nprocs=2, join=True)
        return
    with pytest.raises(mp.ProcessRaisedException, match="out: max error"):
        mp.spawn(_real_worker, args=args, nprocs=2, join=True)


CASE_SECONDS = 10  # each mismatch raises on every rank well within this (measured: < 20 ms)


# ---------------------------------------------------------------------------------------------
# single process: the verdict, the layout's hash
# ---------------------------------------------------------------------------------------------
def _fields(**change):
    """Valid ``msa_attention`` fields with ``change`` (field name -> int) applied."""
    names = [name for name, _ in cp._FIELDS["msa_attention"]]
    values = list(range(10, 10 + len(names)))
    for name, value in change.items():
        values[names.index(name)] = value
    return values


def _table(*rows):
    return [cp._fingerprint("msa_attention", fields, error) for fields, error in rows]


def test_verdict_names_each_field_and_groups_ranks():
    """Equal tables agree; a difference names the field, the ranks grouped by value in order of
    first appearance, every differing field in the one message."""
    same = _table(*[(_fields(), None)] * 3)
    assert cp._verdict("msa_attention", same) is None
    table = _table(
        (_fields(top_k=16, warmup=0), None),
        (_fields(top_k=8, warmup=1), None),
        (_fields(top_k=16, warmup=0), None),
        (_fields(top_k=16, warmup=0), None),
    )
    why = cp._verdict("msa_attention", table)
    assert why.startswith("flash_msa.distributed.msa_attention: ranks disagree on top_k: ")
    assert "top_k: ranks 0, 2, 3 have 16, rank 1 has 8; warmup: ranks 0, 2, 3 have False" in why
    f64, f32 = (cp._str_code(str(d)) for d in (torch.float64, torch.float32))
    half = cp._float_code(0.5)
    table = _table((_fields(**{"dtype of q": f64}), None), (_fields(**{"dtype of q": f32}), None))
    assert "dtype of q: rank 0 has torch.float64, rank 1 has torch.float32" in cp._verdict(
        "msa_attention", table
    )
    table = _table((_fields(softmax_scale=half), None), (_fields(), None))
    assert "softmax_scale: rank 0 has 0.5, rank 1 has " in cp._verdict("msa_attention", table)


def test_verdict_rejected_arguments():
    """A rank's error flag wins over every field: its peers quote its message (truncated to the
    fingerprint's bytes, a cut character dropped)."""
    error = ValueError("top_k must be >= 1, got 0")
    table = _table((_fields(), None), (None, error), (_fields(top_k=1), None))
    why = cp._verdict("msa_attention", table)
    assert why == (
        "flash_msa.distributed.msa_attention: rank 1 rejected its arguments: ValueError: "
        "top_k must be >= 1, got 0"
    )
    long = TypeError("x" + "\u00e9" * 400)  # 2 bytes each after 12: the cut splits one
    (text,) = re.findall("rejected its arguments: (.*)", cp._verdict("gather", _gather(long)))
    assert text.startswith("TypeError: x\u00e9\u00e9") and text.endswith("\u00e9...")
    assert len(text.encode()) <= cp._MESSAGE_BYTES


def _gather(error):
    fields = list(range(len(cp._FIELDS["gather"])))
    return [cp._fingerprint("gather", fields), cp._fingerprint("gather", None, error)]


def test_verdict_other_format_or_call():
    ok = cp._fingerprint("msa_attention", _fields())
    other = [cp._FORMAT + 1, *ok[1:]]
    assert "different fingerprint formats" in cp._verdict("msa_attention", [ok, other])
    gathering = cp._fingerprint("gather", range(len(cp._FIELDS["gather"])))
    why = cp._verdict("msa_attention", [ok, gathering])
    assert why.endswith("different calls: rank 0 in msa_attention, rank 1 in gather")


def test_fingerprint_values_past_int64_are_invalid():
    """A Python int past int64 (``top_k=10**30``) cannot break the gather's tensor."""
    row = cp._fingerprint("msa_attention", _fields(top_k=10**30))
    assert len(row) == cp._LENGTH and torch.tensor(row).dtype == torch.int64
    assert cp._INVALID in row[cp._HEADER : cp._HEADER + cp._MAX_FIELDS]


def test_layout_hash():
    """The hash is the global batch's: equal on every rank, for every world size and for the
    batch form of the same lengths; another order of the lengths changes it."""
    cu = testing.cu([512, 512])
    lays = [cp.layout(P, r, cu_seqlens=cu, block_size=BLOCK) for P in (1, 2) for r in range(P)]
    lays.append(cp.layout(2, 1, batch_size=2, seqlen=512, block_size=128))
    lays.append(lays[1].for_rank(1))
    assert len({lay.cu_seqlens_hash for lay in lays}) == 1
    a, b = (cp.layout(2, 0, cu_seqlens=testing.cu(n), block_size=BLOCK) for n in ([3, 2], [2, 3]))
    assert a.local_tokens == b.local_tokens and a.cu_seqlens_hash != b.cu_seqlens_hash


# ---------------------------------------------------------------------------------------------
# two gloo processes: each mismatch raises on both ranks
# ---------------------------------------------------------------------------------------------
def _op(rank, *, lengths=(300, 200), top_k=TOP_K, grad=True, change=None, **kw):
    """``cp.msa_attention`` on this rank's shards of a float64 batch of ``lengths``, forward
    and backward; ``change``: a function applied to the five shards first."""
    lay = cp.layout(2, rank, cu_seqlens=testing.cu(lengths), block_size=BLOCK)
    xs = [cp.shard(x, lay).requires_grad_(grad) for x in _inputs(sum(lengths), torch.float64)]
    xs = change(xs) if change else xs
    out, kl = cp.msa_attention(*xs, top_k, layout=lay, **kw)
    if grad:
        (out.sum() + kl).backward()
    return out


def _gather_op(rank, heads=3):
    lay = cp.layout(2, rank, cu_seqlens=testing.cu([300, 200]), block_size=BLOCK)
    return cp.gather(torch.zeros(lay.local_tokens, heads, 2), lay)


def _on_rank(which, change, plain=None):
    """A case's call: ``change`` on rank ``which``, ``plain`` (default ``_op``) elsewhere."""
    plain = plain or _op
    return lambda rank: (change if rank == which else plain)(rank)


def _keys_one_head(xs):
    qp, kp, q, k, v = xs
    return [qp, kp, q, k[:, :1].contiguous(), v[:, :1].contiguous()]  # Hkv 2 -> 1: still valid


def _as_float32(xs):
    return [x.detach().float().requires_grad_() for x in xs]


DISAGREE = "ranks disagree on "
# name -> (the call per rank, the pattern every rank's ValueError matches, fields it must not
# name); the same message on both ranks
MISMATCHES = {
    "cu_seqlens": (
        _on_rank(1, lambda r: _op(r, lengths=(200, 300))),  # local tokens 384 on both
        DISAGREE + r"cu_seqlens: rank 0 has hash 0x[0-9a-f]{16}, rank 1 has hash 0x[0-9a-f]{16} \(",
        ("total_tokens", "local_tokens", "sequences"),
    ),
    "top_k": (
        lambda r: _op(r, top_k=(16, 8)[r]),
        DISAGREE + r"top_k: rank 0 has 16, rank 1 has 8 \(",
        (),
    ),
    "warmup": (
        _on_rank(1, lambda r: _op(r, warmup=True)),
        DISAGREE + r"warmup: rank 0 has False, rank 1 has True \(",
        (),
    ),
    "heads": (
        _on_rank(1, lambda r: _op(r, change=_keys_one_head)),
        DISAGREE + r"heads of k: rank 0 has 2, rank 1 has 1; heads of v: rank 0 has 2, rank 1 "
        r"has 1 \(",
        ("dtype of",),
    ),
    "dtype": (
        _on_rank(1, lambda r: _op(r, change=_as_float32)),
        DISAGREE + r"dtype of q_proxy: rank 0 has torch.float64, rank 1 has torch.float32; .*"
        r"dtype of v: rank 0 has torch.float64, rank 1 has torch.float32 \(",
        ("heads of",),
    ),
    "requires_grad": (  # rank 1 would skip the backward's reduce-scatters
        _on_rank(1, lambda r: _op(r, grad=False)),
        DISAGREE + r"requires_grad of q_proxy: rank 0 has True, rank 1 has False;",
        (),
    ),
    "gather": (
        _on_rank(1, lambda r: _gather_op(r, heads=1), _gather_op),
        r"flash_msa.distributed.gather: ranks disagree on elements per token of x: rank 0 has 6, "
        r"rank 1 has 2 \(",
        ("dtype of",),
    ),
}
# name -> (the call per rank, the rejecting rank, its own error, the peers' ValueError)
REJECTIONS = {
    "op check": (
        _on_rank(1, lambda r: _op(r, top_k=0)),
        1,
        (ValueError, "top_k must be >= 1, got 0"),
        "rank 1 rejected its arguments: ValueError: top_k must be >= 1, got 0",
    ),
    "module check": (
        _on_rank(0, lambda r: _op(r, overlap=1)),
        0,
        (TypeError, "overlap must be a bool"),
        "rank 0 rejected its arguments: TypeError: overlap must be a bool",
    ),
}


def _outcome(call, rank):
    """``(exception or None, seconds)`` of ``call(rank)``."""
    t0 = time.perf_counter()
    try:
        call(rank)
    except Exception as e:
        return e, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def _agreement_worker(rank, world, init_file):
    import torch.distributed as dist

    gloo_group(rank, world, init_file, 30)  # a hang fails boundedly
    try:
        for name, (call, pattern, absent) in MISMATCHES.items():
            error, seconds = _outcome(call, rank)
            texts = [None] * world
            dist.all_gather_object(texts, str(error))
            where = f"rank {rank}, {name}: {error!r}"
            assert isinstance(error, ValueError) and re.search(pattern, str(error)), where
            assert not any(field in str(error) for field in absent), where
            assert len(set(texts)) == 1, (name, texts)  # the same message on every rank
            assert seconds < CASE_SECONDS, (where, seconds)
            print(f"rank {rank}, {name}: raised in {1e3 * seconds:.1f} ms")
        for name, (call, which, (own, own_text), peer_text) in REJECTIONS.items():
            error, seconds = _outcome(call, rank)
            texts = [None] * world
            dist.all_gather_object(texts, repr(error))  # each rank's outcome, in step
            where = f"rank {rank}, {name}: {texts}"
            kind, text = (own, own_text) if rank == which else (ValueError, peer_text)
            assert isinstance(error, kind) and text in str(error), where
            assert seconds < CASE_SECONDS, (where, seconds)
            print(f"rank {rank}, {name}: raised in {1e3 * seconds:.1f} ms")
        # the group is still in step: valid calls run on both ranks
        out = _op(rank)
        assert torch.isfinite(out).all()
        assert _gather_op(rank).shape == (500, 3, 2)
    finally:
        dist.destroy_process_group()


def test_agreement_gloo(tmp_path):
    """Every mismatch raises the same ValueError on both gloo ranks, naming the field, and a
    rank that rejects its arguments makes its peer raise instead of wait (module docstring)."""
    mp.spawn(_agreement_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
