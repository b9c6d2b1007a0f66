"""``flash-msa check`` and the benchmark's verification can fail: a backend with plausible wrong
gradients (proxy gradient 25% too large, dv 20% too small: the issue's example) fails both.

On the CPU the check runs the torch backend (and Triton under the interpreter) in fp32; these
tests plant the bug in the torch backend's ``bwd`` (the check's same-dtype yardstick is bound at
import, so the planted bug does not move it) and check only that backend, to stay fast.
"""

import pytest
import torch

from flash_msa import bench, diagnostics, reference
from flash_msa.cli import main

GRADS = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")
# (name, {gradient: factor}): the examples, one at a time
PLANTS = [
    ("proxy x1.25", {"dq_proxy": 1.25, "dk_proxy": 1.25}),
    ("dv x0.8", {"dv": 0.8}),
    ("dk_proxy x1.01", {"dk_proxy": 1.01}),  # a 1% error is far above fp32 noise too
]


def _plant(monkeypatch, module, factors):
    real = module.bwd

    def wrong(*args, **kw):
        g = real(*args, **kw)
        return g._replace(
            **{n: getattr(g, n) * f for n, f in factors.items() if getattr(g, n) is not None}
        )

    monkeypatch.setattr(module, "bwd", wrong)


def test_check_passes_the_torch_backend():
    rows = list(diagnostics.check(names=["torch"]))
    assert rows and all(r["status"] == "PASS" for r in rows), [
        r for r in rows if r["status"] != "PASS"
    ]
    quantities = {r["quantity"] for r in rows}
    assert quantities >= {"out", "kl", *GRADS, "selection: rows differing"}
    # the tolerance is the rule's, not a loose relative one: fp32 noise, far below 1e-3
    assert max(r["tol"] for r in rows) < 1e-4


@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_check_fails_wrong_gradients(plant, monkeypatch):
    _, factors = plant
    _plant(monkeypatch, reference, factors)
    rows = list(diagnostics.check(names=["torch"]))
    failed = {r["quantity"] for r in rows if r["status"] == "FAIL"}
    assert failed == set(factors), failed  # the planted gradients fail, nothing else
    # every case that runs a backward catches it
    per_case = {r["case"] for r in rows if r["status"] == "FAIL"}
    assert per_case == {c[0] for c in diagnostics.CASES}


def test_cli_check_exit_code(monkeypatch, capsys):
    assert main(["check", "--backend", "torch"]) == 0
    assert " 0 failed" in capsys.readouterr().out
    _plant(monkeypatch, reference, {"dv": 0.8})
    assert main(["check", "--backend", "torch"]) == 1
    out = capsys.readouterr().out
    assert "dv" in out and "FAIL" in out and " 0 failed" not in out


def test_check_fails_wrong_forward(monkeypatch):
    real = reference.fwd

    def wrong(*args, **kw):  # out off by 1e-4 in one row: 1000x fp32 noise
        res = real(*args, **kw)
        out = res.out.clone()
        out[3] += 1e-4
        return res._replace(out=out)

    monkeypatch.setattr(reference, "fwd", wrong)
    rows = list(diagnostics.check(names=["torch"]))
    assert "out" in {r["quantity"] for r in rows if r["status"] == "FAIL"}


def test_check_rejects_unknown_backend():
    with pytest.raises(ValueError, match="names: unknown backend 'cuda'"):
        list(diagnostics.check(names=["cuda"]))


# ---------------------------------------------------------------------------------------------
# flash-msa bench: the provider's training step is verified before it is timed
# ---------------------------------------------------------------------------------------------
SHAPE = (1, 4, 2, 2, 1, 16, 16, ())  # B, H, Hkv, Hp, Hpk, D, Dp, seqlens (bench.SHAPES form)
TINY = dict(S=300, top_k=2, block_size=64, device="cpu", dtype=torch.float32)  # 5 blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bench_verify_passes(backend):
    ok, msg = bench.verify_msa(backend, SHAPE, **TINY)
    assert ok, msg
    assert "selection rows differing 0" in msg


@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_bench_verify_fails_wrong_gradients(plant, monkeypatch):
    _, factors = plant
    _plant(monkeypatch, reference, factors)
    ok, msg = bench.verify_msa("torch", SHAPE, **TINY)
    assert not ok
    failed = msg.split("FAILED: ")[1]
    assert {part.split()[0] for part in failed.split(", ")} == set(factors), msg


def test_bench_verify_fails_wrong_triton_gradient(monkeypatch):
    from flash_msa import triton_ref

    _plant(monkeypatch, triton_ref, {"dq": 0.9})
    ok, msg = bench.verify_msa("triton", SHAPE, **TINY)
    assert not ok and "FAILED: dq " in msg, msg
