"""Backend declarations (``LIMITS``, flash_msa.limits): the generic check, what ``auto`` does
with them on CPU, and the README's backend table and ``flash-msa info`` held to them."""

import dataclasses
import pathlib
import re

import pytest
import torch

import flash_msa
from flash_msa import backends, limits, reference, testing
from flash_msa.problem import Config, Problem

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _problem(device="cpu", dtype=torch.float32, capability=None, **cfg):
    c = dict(block_size=64, softmax_scale=0.3, max_seqlen=70, proxy_scale=0.3, top_k=2)
    return Problem(
        device_type=device,
        capability=capability,
        dtype=dtype,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_sel_heads=2,
        num_proxy_k_heads=1,
        proxy_head_dim=16,
        varlen=False,
        cfg=Config(**{**c, **cfg}),
    )


def test_generic_check_names_the_limit():
    lim = {
        op: limits.Limits(
            capabilities=((9, 0),), head_dims=(64,), proxy_head_dims=(64,), max_top_k=4
        )
        for op in limits.OPS
    }
    ok = dataclasses.replace(_problem("cuda", torch.bfloat16, (9, 0)), head_dim=64)
    ok = dataclasses.replace(ok, proxy_head_dim=64)
    assert all(limits.reason(lim, op, ok) is None for op in ("select", "fwd", "bwd"))
    bad = {
        "runs on CUDA tensors, not cpu": dataclasses.replace(ok, device_type="cpu"),
        "sm_100 is not one of sm_90": dataclasses.replace(ok, capability=(10, 0)),
        "dtype float32": dataclasses.replace(ok, dtype=torch.float32),
        "head_dim 128": dataclasses.replace(ok, head_dim=128),
        "proxy head_dim 32": dataclasses.replace(ok, proxy_head_dim=32),
        "top_k 5 > 4": dataclasses.replace(ok, cfg=dataclasses.replace(ok.cfg, top_k=5)),
        "block_size 32": dataclasses.replace(ok, cfg=dataclasses.replace(ok.cfg, block_size=32)),
    }
    for what, prob in bad.items():
        why = limits.reason(lim, "fwd", prob)
        assert why is not None and what in why, (what, why)
    lim["bwd"] = "not implemented yet"
    assert limits.reason(lim, "bwd", ok) == "not implemented yet"
    warm = dataclasses.replace(ok, cfg=dataclasses.replace(ok.cfg, warmup=True, top_k=None))
    lim["warmup"] = "no warmup here"
    assert limits.reason(lim, "fwd", warm) == "no warmup here"
    assert limits.reason(lim, "select", ok) is None


def test_interpreter_refuses_bf16_so_auto_runs_torch(monkeypatch):
    """Triton's CPU interpreter computes bf16 wrongly: under TRITON_INTERPRET=1 the Triton
    backend refuses bf16 CPU tensors with that reason, auto runs them on torch, and the result
    is right (by the tolerance rule against the fp32 reference)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prob = _problem(dtype=torch.bfloat16)
    for op in ("select", "fwd", "bwd"):
        why = backends.reason_not("triton", op, prob)
        assert why is not None and "bfloat16" in why and "interpreter" in why, why
        assert backends.choose(op, prob)[0] == "torch"
    assert backends.choose("fwd", _problem(dtype=torch.float32))[0] == "triton"

    xs = testing.make_inputs(1, 70, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=4)
    with backends.forced("torch"):
        exact = flash_msa.msa_attention(*xs, 2, block_size=64)
        idx = flash_msa.select_blocks(*xs[:2], 2, block_size=64)
    cfg = Config(
        block_size=64, softmax_scale=0.25, max_seqlen=70, proxy_scale=0.25, top_k=2,
        compute_kl=True,
    )  # fmt: skip
    packed = [x[0].to(torch.bfloat16) for x in xs]
    same = reference.fwd(*packed[2:], idx[0], testing.cu([70]), cfg, *packed[:2], upcast=False)
    out, kl = flash_msa.msa_attention(*(x.to(torch.bfloat16) for x in xs), 2, block_size=64)
    testing.assert_close("out", out[0], exact[0][0], same.out, dtype=torch.bfloat16)
    testing.assert_close("kl", kl, exact[1], same.kl, dtype=torch.bfloat16)


# The GPUs other than Hopper and B200 that Triton's smaller tiles are for (triton_ref/tiles.py,
# SHARED_LIMITS): A100 (sm_80, 163 KB per block), A10/RTX 30xx (sm_86), L40S/RTX 40xx (sm_89)
# and RTX 50xx (sm_120), 99 KB.
SMALL_SMEM_GPUS = [(8, 0), (8, 6), (8, 9), (12, 0)]


def _gpu_problem(capability, **cfg):
    """A bf16 CUDA call (faked: no device is touched) that is inside CuTe's limits on sm_90
    (D = Dp = 128; each selection head's two main heads share one KV head)."""
    prob = _problem("cuda", torch.bfloat16, capability, **cfg)
    return dataclasses.replace(prob, head_dim=128, proxy_head_dim=128)


def _warmup(prob):
    return dataclasses.replace(prob, cfg=dataclasses.replace(prob.cfg, warmup=True, top_k=None))


@pytest.mark.parametrize("cap", SMALL_SMEM_GPUS, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_auto_runs_triton_on_ampere_ada_and_consumer_blackwell(cap, monkeypatch):
    """On sm_80/86/89/120 ``auto`` picks Triton for select, fwd and bwd, sparse and warmup;
    CuTe is refused there by its capability, and says so. On sm_90 the same problem's sparse
    select and bwd, and its warmup's fwd and bwd, are CuTe's: the refusal is the arch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton available on this GPU-less machine
    sparse = _gpu_problem(cap)
    arch = f"sm_{cap[0]}{cap[1]}"
    not_hopper = f"{arch} is not one of sm_90: CuTe kernels exist for Hopper only"
    for prob, ops, cute_why in (
        (sparse, ("select", "fwd", "bwd"), not_hopper),
        (_warmup(sparse), ("fwd", "bwd"), not_hopper),
    ):
        for op in ops:
            name, rejected = backends.choose(op, prob)
            assert name == "triton", (op, rejected)
            assert [n for n, _ in rejected] == ["cute"] and cute_why in rejected[0][1], rejected
            assert backends.resolve(op, prob)[0] == "triton"
    hopper = _gpu_problem((9, 0))
    assert backends.choose("select", hopper) == ("cute", [])
    assert backends.choose("bwd", hopper) == ("cute", [])
    assert backends.choose("fwd", _warmup(hopper)) == ("cute", [])  # flash_msa.cute.warmup
    assert backends.choose("bwd", _warmup(hopper)) == ("cute", [])


@pytest.mark.parametrize("cap", [(7, 5), (8, 7), (12, 1)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_auto_refuses_undeclared_gpus_naming_the_architectures(cap, monkeypatch):
    """A capability neither GPU backend declares (Turing sm_75; Jetson Orin sm_87 and sm_121,
    whose tiles are not checked) raises ``BackendError`` with each backend's reason: CuTe's
    Hopper-only list, Triton's list and why it stops there."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    arch = f"sm_{cap[0]}{cap[1]}"
    for prob, op in ((_gpu_problem(cap), "select"), (_warmup(_gpu_problem(cap)), "fwd")):
        why = backends.reason_not("triton", op, prob)
        assert why == (
            f"{arch} is not one of sm_80, sm_86, sm_89, sm_9x, sm_10x, sm_120: the Triton tiles "
            "are sized and compile-checked for these architectures' shared memory and MMA "
            "instructions only"
        ), why
        whole = rf"no backend can run '{op}' on cuda \({arch}\) \(cute: .*; triton: {arch} is not"
        with pytest.raises(backends.BackendError, match=whole):
            backends.resolve(op, prob)


@pytest.mark.parametrize("cap", [*SMALL_SMEM_GPUS, (9, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_fp8_selection_auto_on_gpus(cap, monkeypatch):
    """The fp8 selection on GPUs: CuTe declares it for sm_90 (``LIMITS["select"].fp8_selection``),
    so ``auto`` runs it there where nvidia-cutlass-dsl is importable; Triton does not declare
    it (its fp8 kernel is the CuTe kernel's oracle), so elsewhere (sm_80/86: no e4m3 MMA)
    ``auto`` raises with Triton's reason naming ``selection_precision="fp8"``; torch declares
    it (forced only, for GPU tensors)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prob = _gpu_problem(cap, selection_precision="fp8")
    why = backends.reason_not("triton", "select", prob)
    assert why is not None and 'selection_precision="fp8"' in why, why
    assert backends.reason_not("torch", "select", prob) is None  # FLASH_MSA_BACKEND=torch runs it
    if cap == (9, 0) and backends.load("cute")[0] is not None:
        assert backends.resolve("select", prob)[0] == "cute"
        return
    with pytest.raises(backends.BackendError, match="selection_precision"):
        backends.resolve("select", prob)


def test_readme_backend_table_matches_declarations():
    """The README's backend table is the one ``python -m flash_msa.limits`` renders from the
    backends' LIMITS (``flash-msa info`` prints the same rows)."""
    for name in backends.MODULES:
        module, why = backends.load(name)
        if module is None:
            pytest.skip(f"{name} cannot be imported here: {why}")
    text = README.read_text()
    m = re.search(r"<!-- backend-table.*?-->\n(.*?)\n<!-- /backend-table -->", text, re.S)
    assert m, "README.md has no backend-table block"
    assert m.group(1) == limits.markdown(), "README backend table differs from the declarations"


def test_info_shows_declarations():
    data = flash_msa.info()
    for name, ops in data["limits"].items():
        assert ops == dict(limits.rows(name, backends.load(name)[0].LIMITS))
    assert set(data["limits"]) == {n for n in backends.MODULES if backends.load(n)[0]}
