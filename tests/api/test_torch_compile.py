"""torch.compile(fullgraph=True) through the public ops: the ``flash_msa::`` custom ops
(flash_msa/ops.py) inside the autograd Functions of api.py.

CPU tests run the torch backend (``FLASH_MSA_BACKEND=torch``); the last test (GPU, CUDA graphs
through ``mode="reduce-overhead"``) only collects here.
"""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import flash_msa
from flash_msa import api, ops, reference, testing

HP, HPK, H, HKV, DP, D = 2, 1, 4, 2, 16, 32
TOP_K, BLOCK = 2, 64


@pytest.fixture(autouse=True)
def _torch_backend_fresh_dynamo(torch_backend):
    """The torch backend, and Dynamo's caches and counters fresh for each test."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(lead, seed=0, dtype=torch.float32, device="cpu"):
    """``(q_proxy, k_proxy, q, k, v)`` leaves of leading dims ``lead`` ((B, S) or (T,))."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((HP, DP), (HPK, DP), (H, D), (HKV, D), (HKV, D))
    return [torch.randn(*lead, *s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


class Layer(torch.nn.Module):
    """The smallest module around msa_attention: a projection, then the op."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D, bias=False, dtype=torch.float32)

    def forward(self, qp, kp, q, k, v, cu_seqlens=None, max_seqlen=None):
        out, kl = flash_msa.msa_attention(
            qp, kp, self.proj(q), k, v, TOP_K, block_size=BLOCK,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        )  # fmt: skip
        return out, kl


def _step(fn, xs, **kw):
    """Forward, backward of the O(1)-gradient loss; returns (out, kl, five input gradients)."""
    for x in xs:
        x.grad = None
    out, kl = fn(*xs, **kw)
    testing.training_loss(out, kl, rows=HP * out[..., 0, 0].numel()).backward()
    return out.detach(), kl.detach(), [x.grad.clone() for x in xs]


def _same(name, mine, eager):
    out, kl, grads = mine
    testing.assert_close(f"{name} out", out, eager[0])
    testing.assert_close(f"{name} kl", kl, eager[1])
    for g_name, g, e in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), grads, eager[2]):
        testing.assert_close(f"{name} {g_name}", g, e)


@pytest.mark.parametrize("form", ["batch", "varlen"])
def test_fullgraph_matches_eager_and_does_not_recompile(form):
    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    # two lengths per form, both above TOP_K blocks (the clamp of top_k is a guard, not a shape)
    cases = {
        "batch": [((2, 160), {}), ((2, 224), {})],
        "varlen": [((200,), [70, 130]), ((260,), [0, 150, 110])],
    }[form]
    for i, (lead, lengths) in enumerate(cases):
        xs = _inputs(lead, seed=i)
        kw = {}
        if form == "varlen":
            kw = dict(cu_seqlens=testing.cu(lengths), max_seqlen=max(lengths))
        _same(f"{form} {lead}", _step(compiled, xs, **kw), _step(layer, xs, **kw))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_sparse_attention_and_select_blocks_fullgraph():
    qp, kp, q, k, v = _inputs((1, 192))

    def f(qp, kp, q, k, v):
        idx = flash_msa.select_blocks(qp, kp, 3, block_size=BLOCK)
        return idx, flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK)

    idx_c, out_c = torch.compile(f, fullgraph=True, dynamic=True)(qp, kp, q, k, v)
    idx_e, out_e = f(qp, kp, q, k, v)
    assert torch.equal(idx_c, idx_e)  # top_k 3 = every block of 192 tokens: no clamp padding
    testing.assert_close("sparse out", out_c, out_e)


def test_unused_kl_runs_proxy_backward_with_zero(monkeypatch):
    """Eager skips the proxy backward of an unused ``kl`` (``dkl is None``); the compiled
    backward materializes ``dkl = 0`` and runs it: exact zero proxy gradients, the pass's cost.
    ``q_proxy``/``k_proxy`` that do not require grad skip it under compile too."""
    seen = []
    bwd = reference.bwd

    def spy(dout, dkl, *args, **kw):
        seen.append(None if dkl is None else float(dkl))
        return bwd(dout, dkl, *args, **kw)

    monkeypatch.setattr(reference, "bwd", spy)

    def f(qp, kp, q, k, v):
        return flash_msa.msa_attention(qp, kp, q, k, v, TOP_K, block_size=BLOCK)[0].sum()

    xs = _inputs((1, 128))
    f(*xs).backward()
    assert seen == [None]  # eager: no proxy pass
    assert xs[0].grad is None and xs[1].grad is None
    seen.clear()
    torch.compile(f, fullgraph=True)(*xs).backward()
    assert seen == [0.0]  # compiled: the proxy pass runs with dkl = 0 ...
    assert xs[0].grad.abs().max() == 0 and xs[1].grad.abs().max() == 0  # ... exact zeros
    seen.clear()
    xs2 = [xs[0].detach(), xs[1].detach(), *xs[2:]]
    torch.compile(f, fullgraph=True)(*xs2).backward()
    assert seen == [None]  # proxy inputs without grad: skipped at trace time


def test_varlen_without_max_seqlen_is_refused_under_compile():
    xs = _inputs((100,))

    def f(qp, kp, q, k, v, cu):
        return flash_msa.msa_attention(qp, kp, q, k, v, TOP_K, block_size=BLOCK, cu_seqlens=cu)

    with pytest.raises(Exception, match="max_seqlen is required under torch.compile"):
        torch.compile(f, fullgraph=True)(*xs, testing.cu([40, 60]))


def _op_args(T, max_seqlen, top_k, varlen=True, dims=(H, HKV, D, HP, HPK, DP)):
    """The trailing scalar arguments of the ops (see api._op_args)."""
    return (max_seqlen, BLOCK, D**-0.5, DP**-0.5, top_k, False, True, varlen, list(dims), "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_each_op(dtype):
    xs = [x.detach() for x in _inputs((150,), dtype=dtype)]
    qp, kp, q, k, v = xs
    cu = testing.cu([50, 100])
    args = _op_args(150, 100, TOP_K)
    torch.library.opcheck(ops.select, (qp, kp, cu, *args))
    idx = ops.select(qp, kp, cu, *args)
    for proxy in (True, False):
        p = (qp, kp) if proxy else (None, None)
        torch.library.opcheck(ops.fwd, (q, k, v, idx, cu, *p, proxy, *args))
    out, lse, plse, kl, u1, u2 = ops.fwd(q, k, v, idx, cu, qp, kp, True, *args)
    assert plse.shape == (150, HP) and kl.shape == () and u1.shape == (0,)  # torch: bwd's pass
    dout, dkl = torch.randn_like(out), torch.ones((), dtype=kl.dtype)
    saved = (q, k, v, out, lse, idx, qp, kp, plse, u1, u2, cu)
    for d_out, d_kl in ((dout, dkl), (dout, None), (None, dkl)):
        torch.library.opcheck(ops.bwd, (d_out, d_kl, *saved, *args))


def _mapped_inputs(rank=1, P=2, lengths=(130, 0, 200)):
    """A query map as context parallelism makes it (rank ``rank`` of a ``P``-rank zigzag: local
    queries in two chunks per sequence, padding rows -1) and packed fp32 leaves: the queries
    (``q_proxy``, ``q``: ``Tl`` rows), the keys (``T`` rows); ``(xs, cu, max_seqlen, q_map)``."""
    from flash_msa import distributed as cp

    cu = testing.cu(list(lengths))
    lay = cp.layout(P, rank, cu_seqlens=cu, block_size=BLOCK)
    xs = [x.detach() for x in _inputs((int(cu[-1]),))]
    xs = [cp.shard(x, lay) if i in (0, 2) else x for i, x in enumerate(xs)]
    return [x.requires_grad_() for x in xs], cu, lay.max_seqlen, lay.q_map


def test_q_map_fullgraph_matches_eager():
    """The query map under ``torch.compile(fullgraph=True)``: the custom ops take it (their last
    positional argument) and the compiled step equals eager (the torch backend: bit for bit);
    another map of the same length reuses the graph; the warmup (dense) step with a map too."""

    def f(qp, kp, q, k, v, cu, max_seqlen, q_map):
        return api._msa_attention(
            qp, kp, q, k, v, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=max_seqlen,
            q_map=q_map,
        )  # fmt: skip

    compiled = torch.compile(f, fullgraph=True)
    for rank in (1, 0):
        xs, cu, max_seqlen, q_map = _mapped_inputs(rank)
        kw = dict(cu=cu, max_seqlen=max_seqlen, q_map=q_map)
        mine, eager = _step(compiled, xs, **kw), _step(f, xs, **kw)
        for name, a, b in zip(("out", "kl"), mine[:2], eager[:2]):
            assert torch.equal(a, b), name
        for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), mine[2], eager[2]):
            assert torch.equal(a, b), name
        assert (mine[0][q_map < 0] == 0).all()  # padding rows
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])

    def warm(qp, kp, q, k, v, cu, max_seqlen, q_map):  # the warmup (dense) forward and backward
        return api._msa_attention(
            qp, kp, q, k, v, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=max_seqlen,
            q_map=q_map, warmup=True,
        )  # fmt: skip

    mine, eager = _step(torch.compile(warm, fullgraph=True), xs, **kw), _step(warm, xs, **kw)
    _same("warmup", mine, eager)


def test_opcheck_each_op_with_q_map():
    """``torch.library.opcheck`` of the three ops with a query map (``Tq != T`` rows, padding
    rows): schema, fake shapes, autograd registration, dispatch (fp32 only: the map does not
    touch the dtypes, which test_opcheck_each_op covers)."""
    xs, cu, max_seqlen, q_map = _mapped_inputs(lengths=(70, 0, 130))
    qp, kp, q, k, v = (x.detach() for x in xs)
    args = (*_op_args(k.shape[0], max_seqlen, TOP_K), q_map)
    torch.library.opcheck(ops.select, (qp, kp, cu, *args))
    idx = ops.select(qp, kp, cu, *args)
    assert idx.shape == (q.shape[0], HP, TOP_K) and (idx[q_map < 0] == -1).all()
    for proxy in (True, False):
        p = (qp, kp) if proxy else (None, None)
        torch.library.opcheck(ops.fwd, (q, k, v, idx, cu, *p, proxy, *args))
    out, lse, plse, kl, u1, u2 = ops.fwd(q, k, v, idx, cu, qp, kp, True, *args)
    assert out.shape == q.shape and plse.shape == (q.shape[0], HP)
    dout, dkl = torch.randn_like(out), torch.ones((), dtype=kl.dtype)
    saved = (q, k, v, out, lse, idx, qp, kp, plse, u1, u2, cu)
    for d_out, d_kl in ((dout, dkl), (dout, None), (None, dkl)):
        torch.library.opcheck(ops.bwd, (d_out, d_kl, *saved, *args))
    dq, dk, dv, dqp, dkp = ops.bwd(dout, dkl, *saved, *args)
    assert dq.shape == q.shape and dk.shape == k.shape and dkp.shape == kp.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["batch", "varlen"])
def test_gpu_reduce_overhead_cuda_graphs(form, monkeypatch):
    """``mode="reduce-overhead"`` (CUDA graph trees) on the automatic GPU backend: two steps per
    length (warm-up, then replay) equal eager, and a second length does not recompile."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "auto")
    torch._dynamo.reset()

    def f(qp, kp, q, k, v, **kw):
        return flash_msa.msa_attention(qp, kp, q, k, v, TOP_K, block_size=BLOCK, **kw)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, mode="reduce-overhead")
    cases = {"batch": [((2, 256), None), ((2, 384), None)], "varlen": [((320,), [128, 192])]}
    cases["varlen"].append(((448,), [0, 256, 192]))
    for i, (lead, lengths) in enumerate(cases[form]):
        xs = _inputs(lead, seed=i, dtype=torch.bfloat16, device="cuda")
        kw = {}
        if lengths is not None:
            kw = dict(cu_seqlens=testing.cu(lengths, "cuda"), max_seqlen=max(lengths))
        eager = _step(f, xs, **kw)
        for _ in range(3):  # record, then replay
            mine = _step(compiled, xs, **kw)
        _same(f"{form} {lead}", mine, eager)
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_forward_is_not_asked_for_the_proxy_gradient_a_fused_backward_makes(monkeypatch):
    """Under compile, the ``fwd`` op makes the unit proxy gradient only when the backward's
    backend does not make it itself (its declared ``LIMITS["bwd"].fused_proxy_grad``, CuTe's).
    On CPU the torch backend is declared so: a compiled step then asks the backend's forward for
    ``proxy_grad=False`` (spied; undeclared it is asked True) and its gradients still equal
    eager."""
    asked = []
    real_fwd = reference.fwd

    def spy(*a, **kw):
        asked.append(kw.get("proxy_grad"))
        return real_fwd(*a, **kw)

    monkeypatch.setattr(reference, "fwd", spy)
    leaves = [x.detach().clone().requires_grad_() for x in _inputs((1, 150))]

    def f(*xs):
        return flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK)

    def compiled_step():
        torch._dynamo.reset()
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        out, kl = torch.compile(f, fullgraph=True)(*xs)
        (out.square().sum() + kl).backward()
        return [x.grad for x in xs]

    compiled_step()
    assert asked and all(asked), asked  # unmarked: the forward is asked for it
    asked.clear()
    fused = copy.copy(reference.LIMITS["bwd"])
    object.__setattr__(fused, "fused_proxy_grad", True)  # (frozen: the declaration, patched)
    monkeypatch.setitem(reference.LIMITS, "bwd", fused)
    grads = compiled_step()
    assert asked and not any(asked), asked
    ref = [x.detach().clone().requires_grad_() for x in leaves]
    out_e, kl_e = f(*ref)
    (out_e.square().sum() + kl_e).backward()
    for g, x in zip(grads, ref):
        torch.testing.assert_close(g, x.grad)
