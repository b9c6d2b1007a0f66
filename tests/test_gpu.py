"""GPU tests (``pytest -m gpu``): every GPU backend against the reference, CUDA graphs, memory.

bf16/fp16 tolerance rule: ``err(kernel) <= 2 * err(same-dtype reference) + atol``, both
measured against the fp32 reference on the same indices.
"""

import pytest
import torch

import flash_msa
from flash_msa import reference, testing
from flash_msa.problem import Config, Saved

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BACKENDS = ["triton"]


def _cu(lengths, dev="cuda"):
    return torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )


def _module(name):
    from flash_msa import backends

    return backends.load(name)[0]


def _err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def _case(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed=0, kind="random"):
    T = sum(lengths)
    xs = testing.make_inputs(
        1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed, kind=kind, device="cuda"
    )
    xs = [x[0].contiguous() for x in xs]
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=max(lengths),
        proxy_scale=Dp**-0.5,
        top_k=top_k,
        warmup=False,
        compute_kl=True,
    )
    return xs, _cu(lengths), cfg


def _check_after_selection(be, qp, kp, q, k, v, idx, cu, cfg):
    """fwd and bwd of backend ``be`` on given indices (``None``: warmup) by the rule
    ``err(kernel) <= 2 * err(same-dtype reference) + atol``, both against the fp32 reference."""
    f32 = [x.float() for x in (q, k, v)]
    exact = reference.fwd(*f32, idx, cu, cfg, qp.float(), kp.float())
    same = reference.fwd(q, k, v, idx, cu, cfg, qp, kp, upcast=False)
    mine = be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    for i, name in enumerate(["out", "lse", "proxy_lse", "kl"]):
        tol = 2 * _err(same[i], exact[i]) + 1e-3
        assert _err(mine[i], exact[i]) <= tol, (name, _err(mine[i], exact[i]), tol)
    dout = torch.randn_like(q)
    dkl = torch.tensor(0.7, device=q.device)
    grads = [
        backend.bwd(g_out, dkl, Saved(*qkv, o[0], o[1], idx, *proxy, o[2]), cu, cfg)
        for backend, g_out, qkv, proxy, o in (
            (be, dout, (q, k, v), (qp, kp), mine),
            (reference, dout, (q, k, v), (qp, kp), same),
            (reference, dout.float(), f32, (qp.float(), kp.float()), exact),
        )
    ]
    for name, a, s, e in zip(("dq", "dk", "dv", "dq_proxy", "dk_proxy"), *grads):
        assert torch.isfinite(a).all(), name
        tol = 2 * _err(s, e) + 2e-3 * e.abs().max().item()
        assert _err(a, e) <= tol, (name, _err(a, e), tol)


SHAPES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    ((2048,), 16, 2, 4, 1, 128, 128, 128, 16),  # anchor heads
    ((8192,), 16, 2, 4, 1, 128, 128, 128, 16),
    ((3000, 1, 700, 129), 8, 4, 2, 1, 64, 64, 64, 8),  # varlen, Hp < Hkv, block 64
    ((1500,), 8, 1, 4, 2, 64, 128, 128, 64),  # Hp > Hkv, top_k 64, Dp != D
    ((4096,), 64, 4, 4, 1, 128, 128, 128, 16),  # paper heads (G2 = 16)
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
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


@pytest.mark.parametrize("name", BACKENDS)
def test_end_to_end_autograd_and_sync_free(name, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    (qp, kp, q, k, v), cu, _ = _case((1000, 3000), 16, 2, 4, 1, 128, 128, 128, 16, torch.bfloat16)
    leaves = [x.requires_grad_() for x in (qp, kp, q, k, v)]
    kw = dict(cu_seqlens=cu, max_seqlen=3000)
    out, kl = flash_msa.msa_attention(*leaves, 16, **kw)  # warm up (compile) first
    (out.float().sum() + kl).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, kl = flash_msa.msa_attention(*leaves, 16, **kw)
        (out.float().sum() + kl).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("name", BACKENDS)
def test_cuda_graph_training_step(name, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    (qp, kp, q, k, v), cu, _ = _case((1500, 2500), 16, 2, 4, 1, 128, 128, 128, 8, torch.bfloat16)
    leaves = [x.requires_grad_() for x in (qp, kp, q, k, v)]

    def step():
        for x in leaves:
            x.grad = None
        out, kl = flash_msa.msa_attention(*leaves, 8, cu_seqlens=cu, max_seqlen=2500)
        (out.float().square().mean() + kl).backward()
        return out.detach(), kl.detach()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = step()
        eager_grads = [x.grad.clone() for x in leaves]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for x in leaves:
        x.grad = None
    with torch.cuda.graph(g):
        graphed = step()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graphed[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(graphed[1], eager[1], rtol=1e-5, atol=1e-6)
    for a, b in zip([x.grad for x in leaves], eager_grads):  # atomics: order may differ
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_warmup_matches_reference(name, dtype):
    be = _module(name)
    (qp, kp, q, k, v), cu, cfg = _case((3000, 1, 1100), 16, 2, 4, 1, 128, 128, 128, 16, dtype)
    cfg = Config(
        block_size=cfg.block_size,
        softmax_scale=cfg.softmax_scale,
        max_seqlen=cfg.max_seqlen,
        proxy_scale=cfg.proxy_scale,
        top_k=None,
        warmup=True,
        compute_kl=True,
    )
    _check_after_selection(be, qp, kp, q, k, v, None, cu, cfg)
