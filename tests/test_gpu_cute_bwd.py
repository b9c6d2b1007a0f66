"""GPU tests of the CuTe backward (``flash_msa/cute/bwd_sm90.py``) on Hopper: all five gradients
of ``testing.training_loss`` by the rule against the exact reference, next to the Triton
backward (the oracle of the fast path) on the same saved forward; drawn sizes, head layouts,
blocks and dtypes; the main-only and proxy-only variants; the layouts it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flash_msa import backends, reference, testing
from flash_msa.problem import Problem, Saved
from harness import CUTE_LAYOUTS as CASES
from harness import GRADS, check, config, incoming, packed_inputs, references, results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _backends():
    pytest.importorskip("cutlass")
    cute_be, why = backends.load("cute")
    assert cute_be is not None, why
    return cute_be, backends.load("triton")[0]


def _problem(q, k, qp, kp, cfg, num_seqs):
    return Problem(
        device_type="cuda",
        capability=torch.cuda.get_device_capability(),
        dtype=q.dtype,
        num_heads=q.shape[1],
        num_kv_heads=k.shape[1],
        head_dim=q.shape[2],
        num_sel_heads=qp.shape[1],
        num_proxy_k_heads=kp.shape[1],
        proxy_head_dim=qp.shape[2],
        varlen=True,
        cfg=cfg,
        num_seqs=num_seqs,
    )


def _run(
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed, *, main=True, proxy=True, variant=None
):
    """One backward on the Triton forward's saved tensors: CuTe (with the kernel's A/B switches
    ``variant``) and Triton by the rule."""
    cute_be, triton_be = _backends()
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    assert cute_be.bwd_kernel_reason(_problem(q, k, qp, kp, cfg, len(lengths))) is None
    idx = reference.select(qp, kp, cu, cfg)
    fwd = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, None)
    dout, dkl = incoming(q, Hp, seed)
    dout, dkl = (dout if main else None), (dkl if proxy else None)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl)
    names = [n for n in GRADS if n in exact and exact[n] is not None]
    from flash_msa.cute import bwd_sm90

    def cute_bwd(*args):
        return bwd_sm90.bwd(*args, **(variant or {}))

    for name, fn in (("cute", cute_bwd), ("triton", triton_be.bwd)):
        grads = fn(dout, dkl, saved, cu, cfg)
        mine = results(fwd, grads)
        for n in GRADS:  # a part not asked for is not made
            assert (n in mine) == (n in names), (name, n)
        check(mine, exact, same, names, label=f"{name} ")


def bwd_fits(case, variant) -> bool:
    """Whether the kernel with switches ``variant`` can run ``case`` (shared memory)."""
    from cutlass import BFloat16

    from flash_msa.cute.bwd_sm90 import BwdSm90

    _, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    if variant.get("ws"):
        from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90

        return BwdWsSm90.can_implement(BFloat16, H, Hkv, Hp, Hpk, D, Dp, top_k, b) is None
    stages = variant.get("gather_stages", 1)
    return BwdSm90.can_implement(BFloat16, H, Hkv, Hp, Hpk, D, Dp, top_k, b, True, stages) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cute_bwd_matches_reference_and_triton(case, dtype):
    """All five gradients of the CuTe backward by the rule, and the Triton backward's on the
    same saved forward."""
    _run(*case, dtype, seed=1)


def _variants() -> dict:
    """``BwdSm90.VARIANTS`` but the default (the A/B switches' combinations), or ``{}`` where
    the CuTe stack is missing (the tests then skip)."""
    try:
        from flash_msa.cute.bwd_sm90 import BwdSm90
    except ImportError:
        return {}
    return {n: v for n, v in BwdSm90.VARIANTS.items() if v}


VARIANTS = _variants()


@pytest.mark.parametrize("case", ["anchor", "paper", "Hp>Hpk>1-b64", "G2=1", "Dp>D", "D=64-b128"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_cute_bwd_variants_match_reference(variant, case):
    """Each A/B switch of the kernel (and all of them together) by the rule, on layouts with
    one and several KV sub-groups, varlen with empty and one-token sequences, block 64, Dp > D,
    and two warpgroups with dQ on warpgroup 0 alone (D = 64, block 128)."""
    if not bwd_fits(CASES[case], variant):
        pytest.skip(f"{variant} cannot run this layout (can_implement)")
    _run(*CASES[case], torch.bfloat16, seed=3, variant=variant)
    if variant in (VARIANTS["stages1"], VARIANTS["v2"], VARIANTS["deterministic"]):
        _run(*CASES[case], torch.bfloat16, seed=3, main=False, variant=variant)


def test_cute_bwd_deterministic_same_bits(monkeypatch):
    """Deterministic mode: two backwards on the same inputs give bitwise equal gradients,
    through several token chunks and work-item ranges (a 1 MiB partial budget), no atomics,
    new buffers NaN-filled; by the rule against the reference (the variant tests), and close to
    the atomic default."""
    from flash_msa import ordered
    from flash_msa.cute import bwd_sm90

    _backends()
    monkeypatch.setattr(ordered, "PARTIAL_BYTES", 1 << 20)
    real_empty, real_like = torch.empty, torch.empty_like  # new buffers start as NaN: a partial
    # row or tile the kernel should have written and did not shows up in the sums
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: testing.poison(real_like(*a, **kw)))
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = CASES["anchor"]
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda", seed=5
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    idx = reference.select(qp, kp, cu, cfg)
    fwd = backends.load("triton")[0].fwd(q, k, v, idx, cu, cfg, qp, kp)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, None)
    dout, dkl = incoming(q, Hp, 5)
    variant = dict(deterministic=True)
    first = bwd_sm90.bwd(dout, dkl, saved, cu, cfg, **variant)
    again = bwd_sm90.bwd(dout, dkl, saved, cu, cfg, **variant)
    atomic = bwd_sm90.bwd(dout, dkl, saved, cu, cfg)
    for n, a, b2, c in zip(GRADS, first, again, atomic):
        assert torch.equal(a, b2), f"{n} differs between two deterministic runs"
        scale = c.float().abs().max().item()
        err = (a.float() - c.float()).abs().max().item()
        assert err <= 1e-2 * max(scale, 1e-6), (n, err, scale)


@pytest.mark.parametrize("part", ["main", "proxy"])
def test_cute_bwd_main_or_proxy_only(part):
    """``dkl=None`` (the KL takes no gradient) makes dq, dk, dv only; ``dout=None`` the proxy
    gradients only: each by the rule."""
    case = CASES["anchor"]
    _run(*case, torch.bfloat16, seed=2, main=part == "main", proxy=part == "proxy")


def test_cute_bwd_refuses_layouts_outside_its_limits():
    """Selection heads whose main heads span several KV heads (Hp < Hkv) are refused with the
    reason; ``auto`` then runs the backward on Triton."""
    cute_be, _ = _backends()
    (qp, kp, q, k, v), cu = packed_inputs(
        (300,), 8, 4, 2, 1, 64, 64, dtype=torch.bfloat16, device="cuda"
    )
    cfg = config(300, 64, 64, 64, 4)
    why = cute_be.bwd_kernel_reason(_problem(q, k, qp, kp, cfg, 1))
    assert why is not None and "share one KV head" in why
    name, _ = backends.resolve("bwd", _problem(q, k, qp, kp, cfg, 1))
    assert name == "triton"


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_cute_bwd_hypothesis(data):
    """Drawn lengths / varlen splits (empty and one-token sequences), top_k, block, head layout,
    head dims and dtype: CuTe and Triton backwards by the rule."""
    lengths = data.draw(st.lists(st.integers(0, 1500), min_size=1, max_size=4), label="lengths")
    assume(max(lengths) > 1)  # one-token sequences only: the proxy gradient is exactly 0
    b = data.draw(st.sampled_from([64, 128]), label="block")
    top_k = data.draw(st.sampled_from([1, 5, 16, 33]), label="top_k")
    H, Hkv, Hp, Hpk = data.draw(
        st.sampled_from([(16, 2, 4, 1), (8, 4, 4, 2), (64, 4, 4, 1), (4, 4, 4, 4), (8, 1, 2, 1)]),
        label="heads",
    )
    D = data.draw(st.sampled_from([64, 128]), label="D")
    Dp = data.draw(st.sampled_from([64, 128]), label="Dp")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="dtype")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    _run(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, seed)


_SANITIZED = """
import sys, torch
sys.path.insert(0, "tests")
from flash_msa import reference, backends
from flash_msa.cute import bwd_sm90
from flash_msa.problem import Saved
from harness import config, incoming, packed_inputs
variant = eval(sys.argv[1])
(qp, kp, q, k, v), cu = packed_inputs(
    (300, 70), 16, 2, 4, 1, 128, 128, dtype=torch.bfloat16, device="cuda", seed=0
)
cfg = config(300, 128, 128, 128, 2)
idx = reference.select(qp, kp, cu, cfg)
f = backends.load("triton")[0].fwd(q, k, v, idx, cu, cfg, qp, kp)
dout, dkl = incoming(q, 4, 0)
saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, None)
bwd_sm90.bwd(dout, dkl, saved, cu, cfg, **variant)
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
@pytest.mark.parametrize(
    "variant",
    [{}, *VARIANTS.values()],
    ids=["default", *VARIANTS.keys()],
)
def test_cute_bwd_under_compute_sanitizer(tool, variant):
    """compute-sanitizer's racecheck (shared-memory hazards) and synccheck (barrier misuse) on
    one small backward (two sequences, both phases, padded chunks): no error reported. Skips,
    with the reason, where the tool is missing or refuses the device (a gVisor machine)."""
    import os
    import shutil
    import subprocess
    import sys

    _backends()
    tool_bin = shutil.which("compute-sanitizer")
    if tool_bin is None:
        pytest.skip("compute-sanitizer is not on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
    from cutlass import BFloat16

    from flash_msa.cute.bwd_sm90 import BwdSm90

    # the filter names the class of the kernel bwd() builds for this variant (a filter matching
    # no kernel would sanitize nothing and pass): the default is the warp-specialized one
    kname = type(BwdSm90.make(BFloat16, 16, 2, 4, 1, 128, 128, 2, 128, **variant)).__name__
    assert variant or kname == "BwdWsSm90", kname
    run = subprocess.run(
        [tool_bin, "--tool", tool, "--kernel-name", f"kns={kname}", "--error-exitcode", "3",
         sys.executable, "-c", _SANITIZED, repr(variant)],
        capture_output=True, text=True, env=env, timeout=600, cwd=root,
    )  # fmt: skip
    log = run.stdout + run.stderr
    if "Device not supported" in log or "not supported on this" in log:
        pytest.skip(f"compute-sanitizer refuses this device: {log[-300:]}")
    assert run.returncode == 0 and "sanitized run done" in log, log[-4000:]
    # racecheck ends with "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    # synccheck with "ERROR SUMMARY: 0 errors"
    clean = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in log, log[-4000:]
