"""GPU tests of the CuTe backward (``flash_msa/cute/backward.py``) on Hopper: all five gradients
of ``testing.training_loss`` by the rule against the exact reference, next to the Triton
backward (the oracle of the fast path) on the same saved forward; drawn sizes, head layouts,
blocks and dtypes; the main-only and proxy-only variants; the layouts it refuses. With a query
map (context parallelism): the backward of every kernel and mode against the reference and
Triton with the same map, and the emulated CP step with ``auto``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flash_msa
from flash_msa import backends, reference, testing
from flash_msa.problem import Problem, Saved
from harness import CUTE_LAYOUTS as CASES
from harness import (
    GRADS,
    check,
    config,
    incoming,
    packed_inputs,
    poison_new_buffers,
    references,
    results,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def cute_bwd(dout, dkl, saved, cu, cfg, *, q_map=None, variant=None):
    """The CuTe backward op's sparse body with kernel choice ``variant``: ``ws`` (True / False:
    that kernel, ``backward.kernel_for``'s argument) and ``deterministic`` (the Config's)."""
    from flash_msa.cute import backward

    variant = variant or {}
    if variant.get("deterministic"):
        cfg = dataclasses.replace(cfg, deterministic=True)
    return backward.bwd(dout, dkl, saved, cu, cfg, q_map=q_map, ws=variant.get("ws"))


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
    """One backward on the Triton forward's saved tensors: CuTe (with the kernel's variant
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
    for name, fn in (("cute", cute_bwd), ("triton", triton_be.bwd)):
        kw = dict(variant=variant) if name == "cute" else {}
        grads = fn(dout, dkl, saved, cu, cfg, **kw)
        mine = results(fwd, grads)
        for n in GRADS:  # a part not asked for is not made
            assert (n in mine) == (n in names), (name, n)
        check(mine, exact, same, names, label=f"{name} ")


def bwd_fits(case, variant) -> bool:
    """Whether the kernel of ``variant`` (:func:`cute_bwd`) can run ``case``."""
    from cutlass import BFloat16

    from flash_msa.cute.bwd_sm90 import BwdSm90

    _, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    if variant.get("ws"):
        from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90

        return BwdWsSm90.can_implement(BFloat16, H, Hkv, Hp, Hpk, D, Dp, top_k, b) is None
    return BwdSm90.can_implement(BFloat16, H, Hkv, Hp, Hpk, D, Dp, top_k, b, True, 1) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cute_bwd_matches_reference_and_triton(case, dtype):
    """All five gradients of the CuTe backward by the rule, and the Triton backward's on the
    same saved forward."""
    _run(*case, dtype, seed=1)


# the kernel choices besides the default pick: the fallback BwdSm90 where the warp-specialized
# kernel would run, and deterministic mode
VARIANTS = {"v2": dict(ws=False), "deterministic": dict(deterministic=True)}


@pytest.mark.parametrize("case", ["anchor", "paper", "Hp>Hpk>1-b64", "G2=1", "Dp>D", "D=64-b128"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_cute_bwd_variants_match_reference(variant, case):
    """Each kernel choice (:data:`VARIANTS`) by the rule, on layouts with
    one and several KV sub-groups, varlen with empty and one-token sequences, block 64, Dp > D,
    and two warpgroups with dQ on warpgroup 0 alone (D = 64, block 128)."""
    if not bwd_fits(CASES[case], variant):
        pytest.skip(f"{variant} cannot run this layout (can_implement)")
    _run(*CASES[case], torch.bfloat16, seed=3, variant=variant)
    if variant in (VARIANTS["v2"], VARIANTS["deterministic"]):
        _run(*CASES[case], torch.bfloat16, seed=3, main=False, variant=variant)


def test_cute_bwd_deterministic_same_bits(monkeypatch):
    """Deterministic mode: two backwards on the same inputs give bitwise equal gradients,
    through several token chunks and work-item ranges (a 1 MiB partial budget), no atomics,
    new buffers NaN-filled; by the rule against the reference (the variant tests), and close to
    the atomic default."""
    from flash_msa import ordered

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
    first = cute_bwd(dout, dkl, saved, cu, cfg, variant=variant)
    again = cute_bwd(dout, dkl, saved, cu, cfg, variant=variant)
    atomic = cute_bwd(dout, dkl, saved, cu, cfg)
    for n, a, b2, c in zip(GRADS, first, again, atomic):
        assert torch.equal(a, b2), f"{n} differs between two deterministic runs"
        scale = c.float().abs().max().item()
        err = (a.float() - c.float()).abs().max().item()
        assert err <= 1e-2 * max(scale, 1e-6), (n, err, scale)


@pytest.mark.parametrize("case", ["anchor", "paper"])
def test_cute_bwd_ws_teacher_in_registers_is_bitwise_the_slab(case):
    """BwdWsSm90 sums the teacher in registers (G2 = 4, anchor and paper layouts), BwdSm90
    (``ws=False``) by the slab's per-sub-group load-add-store: the same additions in the same
    order, so the same bits where the teacher acts, ``dq_proxy`` (its rows' d = p - t / G),
    and in ``dq``. Sequences of at most 256 tokens (two key blocks): each of those rows then
    gets at most two fp32 atomic additions onto zero, which commute exactly. The key
    gradients sum more terms (every selection head's items, both chunks) in the atomics'
    run-time order: close, not bitwise (on the H200 ``dk`` differed by one bf16 ulp)."""
    _backends()
    _, H, Hkv, Hp, Hpk, D, Dp, b, _ = CASES[case]
    lengths = (256, 200, 129, 64, 256)
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda", seed=11
    )
    cfg = config(max(lengths), D, Dp, b, 2)
    idx = reference.select(qp, kp, cu, cfg)
    fwd = backends.load("triton")[0].fwd(q, k, v, idx, cu, cfg, qp, kp)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, None)
    dout, dkl = incoming(q, Hp, 11)
    ws = dict(zip(GRADS, cute_bwd(dout, dkl, saved, cu, cfg)))
    slab = dict(zip(GRADS, cute_bwd(dout, dkl, saved, cu, cfg, variant=dict(ws=False))))
    for n in GRADS:
        a, c = ws[n], slab[n]
        assert torch.isfinite(a).all(), n
        if n in ("dq", "dq_proxy"):
            assert torch.equal(a, c), (n, (a.float() - c.float()).abs().max().item())
        else:
            err = (a.float() - c.float()).abs().max().item()
            assert err <= 1e-2 * c.float().abs().max().item(), (n, err)


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
import dataclasses, sys, torch
sys.path.insert(0, "tests")
from flash_msa import reference, backends
from flash_msa.cute import backward
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
if variant.get("deterministic"):
    cfg = dataclasses.replace(cfg, deterministic=True)
backward.bwd(dout, dkl, saved, cu, cfg, ws=variant.get("ws"))
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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
    from cutlass import BFloat16

    from flash_msa.cute.backward import kernel_for

    # the filter names the class of the kernel bwd() builds for this variant (a filter matching
    # no kernel would sanitize nothing and pass): the default is the warp-specialized one
    kname = type(kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 2, 128, **variant)).__name__
    assert variant or kname == "BwdWsSm90", kname
    run = subprocess.run(
        [tool_bin, "--tool", tool, "--kernel-name", f"kns={kname}", "--error-exitcode", "3",
         sys.executable, "-c", _SANITIZED, repr(variant)],
        capture_output=True, text=True, env=env, cwd=root,
    )  # fmt: skip
    log = run.stdout + run.stderr
    if "Device not supported" in log or "not supported on this" in log:
        pytest.skip(f"compute-sanitizer refuses this device: {log[-300:]}")
    assert run.returncode == 0 and "sanitized run done" in log, log[-4000:]
    # racecheck ends with "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    # synccheck with "ERROR SUMMARY: 0 errors"
    clean = "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
    assert clean in log, log[-4000:]


# ---------------------------------------------------------------------------------------------
# the query map (context parallelism: BwdSm90 / BwdWsSm90(qmap=True))
# ---------------------------------------------------------------------------------------------
def _q_map(kind, lengths, block, seed=0):
    """``(Tq,)`` int32 CUDA query map: "zigzag" (rank 0 of the 2-rank layout of
    ``flash_msa.distributed``: chunks 0 and 3 of every sequence, padding rows at the end of a
    short last chunk) or "random" (a random half of the tokens in a random order, one token
    twice, padding rows between them)."""
    from flash_msa import distributed as cp

    cu = testing.cu(lengths)
    if kind == "zigzag":
        return cp.layout(2, 0, cu_seqlens=cu, block_size=block).q_map.to(torch.int32).cuda()
    T = int(cu[-1])
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(seed + T))[: T // 2]
    pad = torch.tensor([-1])
    return torch.cat([rows[:5], rows[:1], pad, rows[5:], pad, pad]).to(torch.int32).cuda()


def _local_rows(x, q_map):
    """Row ``i`` of packed ``x`` is token ``q_map[i]``'s; padding rows hold values no key has."""
    y = x[q_map.long().clamp_min(0)].clone()
    y[q_map < 0] = 7.0
    return y


def _mapped_references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl, q_map):
    """``(exact, same)`` as harness.references (fp64 reference; the input dtype's), with the
    map (the reference's ``fwd`` and ``bwd`` take it)."""
    refs = []
    for exact in (True, False):
        cast = (lambda x: x.double()) if exact else (lambda x: x)
        qp_, kp_, q_, k_, v_ = (cast(x) for x in (qp, kp, q, k, v))
        do_ = None if dout is None else cast(dout)
        f = reference.fwd(q_, k_, v_, idx, cu, cfg, qp_, kp_, upcast=exact, q_map=q_map)
        saved = Saved(q_, k_, v_, f.out, f.lse, idx, qp_, kp_, f.proxy_lse)
        g = reference.bwd(do_, dkl, saved, cu, cfg, upcast=exact, q_map=q_map)
        refs.append(results(f, g))
    return refs


def _check_mapped(mine, exact, same, q_map, label=""):
    """Each quantity of ``mine`` by the rule on the mapped rows (key-side ones on every key);
    the query side of padding rows exactly as the contract says (no keys, no gradient)."""
    real, pad = q_map >= 0, q_map < 0
    for name, m in mine.items():
        ex, sm = exact[name], same[name]
        if name in ("out", "lse", "proxy_lse", "dq", "dq_proxy"):
            want = -torch.inf if name.endswith("lse") else 0.0
            assert (m[pad] == want).all(), f"{label}{name}: padding rows"
            m, ex, sm = m[real], ex[real], sm[real]
        testing.assert_close(f"{label}{name}", m, ex, sm)


def _mapped_case(case, kind, dtype, seed):
    """Inputs of ``case`` with a ``kind`` query map: the local rows, the keys, the map, the
    config, the reference's indices with the map (padding rows given a real row's: they must
    be ignored) and the Triton forward with the map."""
    cute_be, triton_be = _backends()
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = case
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device="cuda", seed=seed
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    q_map = _q_map(kind, lengths, b, seed)
    qp_l, q_l = _local_rows(qp, q_map), _local_rows(q, q_map)
    prob = _problem(q_l, k, qp_l, kp, cfg, len(lengths))
    assert cute_be.unsupported_reason("bwd", dataclasses.replace(prob, q_map=True)) is None
    idx = reference.select(qp_l, kp, cu, cfg, q_map=q_map)
    real = q_map >= 0
    idx[~real] = idx[int(torch.nonzero(real)[0])].clone()
    f = triton_be.fwd(q_l, k, v, idx, cu, cfg, qp_l, kp, q_map=q_map)
    return (qp_l, kp, q_l, k, v), cu, q_map, cfg, idx, f


def _mapped_run(case, kind, dtype, seed, *, main=True, proxy=True, variant=None):
    """The CuTe backward with the map (kernel choice ``variant``) and the Triton backward
    with it, on the Triton forward's saved tensors, by the rule; padding rows' dq, dq_proxy
    exactly 0. New buffers start NaN-poisoned (deterministic mode's partials)."""
    _, triton_be = _backends()
    (qp, kp, q, k, v), cu, q_map, cfg, idx, f = _mapped_case(case, kind, dtype, seed)
    saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, None)
    dout, dkl = incoming(q, qp.shape[1], seed)
    dout, dkl = (dout if main else None), (dkl if proxy else None)
    exact, same = _mapped_references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl, q_map)
    for name, fn in (("cute", cute_bwd), ("triton", triton_be.bwd)):
        kw = dict(variant=variant) if name == "cute" else {}
        with pytest.MonkeyPatch.context() as mp:
            poison_new_buffers(mp)
            g = fn(dout, dkl, saved, cu, cfg, q_map=q_map, **kw)
        mine = {n: x for n, x in zip(GRADS, g) if x is not None}
        want = {n for n in GRADS if exact.get(n) is not None}
        assert set(mine) == want, (name, set(mine), want)
        assert mine["dk" if main else "dk_proxy"].shape[0] == k.shape[0]  # the keys' T
        _check_mapped(mine, exact, same, q_map, label=f"{name} ")


QMAP_CASES = ["anchor", "paper", "Hp>Hpk>1-b64", "G2=1", "Dp>D"]


@pytest.mark.parametrize("kind", ["zigzag", "random"])
@pytest.mark.parametrize("case", QMAP_CASES)
def test_cute_bwd_q_map_matches_reference_and_triton(case, kind):
    """All five gradients of the CuTe backward with a query map (the default kernel: the
    warp-specialized one where it runs) by the rule against the reference with the map, and
    the Triton backward's; dq / dq_proxy of padding rows exactly 0, dk / dv / dk_proxy over
    the keys' tokens."""
    _mapped_run(CASES[case], kind, torch.bfloat16, seed=11)


def test_cute_bwd_q_map_fp16():
    _mapped_run(CASES["anchor"], "random", torch.float16, seed=12)


@pytest.mark.parametrize("case", ["anchor", "Hp>Hpk>1-b64"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_cute_bwd_q_map_variants(variant, case):
    """Each kernel choice (v2, deterministic mode) with a query map, and the
    main-only and proxy-only parts."""
    if not bwd_fits(CASES[case], variant):
        pytest.skip(f"{variant} cannot run this layout (can_implement)")
    _mapped_run(CASES[case], "zigzag", torch.bfloat16, seed=13, variant=variant)
    _mapped_run(CASES[case], "random", torch.bfloat16, seed=14, main=False, variant=variant)
    _mapped_run(CASES[case], "random", torch.bfloat16, seed=15, proxy=False, variant=variant)


@pytest.mark.parametrize("P", [2, 3])
def test_q_map_emulated_cp_on_cuda_auto(P, monkeypatch):
    """tests/api/test_distributed.py::test_q_map_emulated_cp on one GPU in bf16 with ``auto``
    (every op on CuTe), anchor heads:
    each "rank"'s local queries against the whole batch's keys, no communication. bf16 runs
    that select independently may differ by a near-tie block (an O(1) change of a row), so, as
    tests/api/test_distributed.py's ``_real_worker`` does: each rank's selection against the single
    process's at its tokens (near-ties only), then out, the KL share and the q-side gradients
    by the rule over **the rank's selection** (the reference with the map and those indices),
    and the key gradients summed over the ranks against the references' sums."""
    from flash_msa import distributed as cp
    from flash_msa.problem import problem_of

    cute_be, _ = _backends()
    monkeypatch.setenv("FLASH_MSA_BACKEND", "auto")
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = (3000, 777, 5200), 16, 2, 4, 1, 128, 128, 128, 8
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda", seed=17
    )
    cfg = config(max(lengths), D, Dp, b, top_k)
    prob = problem_of("cuda", torch.bfloat16, (H, Hkv, D, Hp, Hpk, Dp), 3, True, cfg, q_map=True)
    picks = {op: backends.choose(op, prob)[0] for op in ("select", "fwd", "bwd")}
    assert picks == {"select": "cute", "fwd": "cute", "bwd": "cute"}, picks
    T = q.shape[0]
    dout, w = testing.loss_weights((T, H, D), Hp * T, 17, "cuda")
    alone = cute_be.select(qp, kp, cu, cfg)  # the single process's selection
    sums = {n: [0.0, 0.0, 0.0] for n in ("dk_proxy", "dk", "dv")}  # mine, exact, same
    for r in range(P):
        lay = cp.layout(P, r, cu_seqlens=cu.cpu(), block_size=b, device="cuda")
        frac = lay.local_tokens / lay.total_tokens
        qp_l, q_l = (cp.shard(x, lay).requires_grad_() for x in (qp, q))
        keys = [x.detach().clone().requires_grad_() for x in (kp, k, v)]
        out, kl = flash_msa.api._msa_attention(  # the query map: distributed's private entry
            qp_l, keys[0], q_l, keys[1], keys[2], top_k, block_size=b, cu_seqlens=cu,
            max_seqlen=max(lengths), q_map=lay.q_map,
        )  # fmt: skip
        dout_l = cp.shard(dout, lay)
        loss = (out.float() * dout_l).sum() + w * kl * frac
        grads = torch.autograd.grad(loss, (qp_l, keys[0], q_l, keys[1], keys[2]))
        mine = dict(out=out, kl=kl * frac, dq_proxy=grads[0], dq=grads[2])
        idx = cute_be.select(qp_l.detach(), kp, cu, cfg, q_map=lay.q_map)  # the op's (exact)
        bad = testing.selection_mismatch(
            _on_tokens(idx, lay.q_map, alone), alone.cpu(), qp.cpu(), kp.cpu(), b,
            cfg.proxy_scale, cu.cpu(),
        )  # fmt: skip
        assert bad == 0, f"rank {r}: {bad} rows differ from one process's selection"
        dkl = torch.tensor(w * frac, dtype=torch.float32, device="cuda")
        exact, same = _mapped_references(
            qp_l.detach(), kp, q_l.detach(), k, v, idx, cu, cfg, dout_l.to(q.dtype), dkl,
            lay.q_map,
        )  # fmt: skip
        for ref in (exact, same):
            ref["kl"] = ref["kl"] * frac
        real = lay.q_map >= 0
        assert (out[~real] == 0).all(), "padding rows: out = 0"
        for name in ("out", "dq_proxy", "dq"):
            m, ex, sm = mine[name][real], exact[name][real], same[name][real]
            testing.assert_close(f"{name}[{r}]", m, ex, sm)
        testing.assert_close(f"kl[{r}]", mine["kl"], exact["kl"], same["kl"], dtype=q.dtype)
        for i, name in ((1, "dk_proxy"), (3, "dk"), (4, "dv")):  # summed in fp32 / fp64
            for j, x in enumerate((grads[i].float(), exact[name], same[name].float())):
                sums[name][j] = sums[name][j] + x
    for name, (m, ex, sm) in sums.items():  # (the tolerance of the gradients' dtype)
        testing.assert_close(name, m, ex, sm, dtype=q.dtype)


def _on_tokens(idx, q_map, base):
    """The mapped rows of ``idx`` ``(Tq, Hp, K)`` at their tokens' rows of ``base`` (a selection
    of every token), on the CPU: what ``testing.selection_mismatch`` compares."""
    real = q_map >= 0
    out = base.clone()
    out[q_map[real].long()] = idx[real].to(base.device)
    return out.cpu()
