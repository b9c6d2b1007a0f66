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

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


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
