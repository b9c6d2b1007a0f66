"""GPU tests (``pytest -m gpu``): every GPU backend against the reference, the training step
itself, CUDA graphs, memory.

Numbers by the harness's rule (``flash_msa.testing.assert_close``): ``err(kernel) <= 2 *
err(same-dtype reference) + atol``, both against the fp64 reference on the kernel's own indices
(tests/harness.py), gradients of ``testing.training_loss`` (O(1) in all five inputs).
"""

import pytest
import torch

import flash_msa
from flash_msa import backends, reference, testing
from flash_msa.problem import Saved
from harness import (
    GRADS,
    check,
    config,
    incoming,
    no_host_sync,
    packed_inputs,
    references,
    results,
)

pytestmark = [
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
]


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
}


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


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_warmup_matches_reference(name, dtype):
    be = _module(name)
    (qp, kp, q, k, v), cu, cfg = _case(
        (3000, 1, 0, 1100), 16, 2, 4, 1, 128, 128, 128, None, dtype, warmup=True
    )
    _check_after_selection(be, qp, kp, q, k, v, None, cu, cfg)
