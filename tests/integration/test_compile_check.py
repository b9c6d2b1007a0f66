"""Every kernel compiles for sm_90a on this (GPU-less) machine without register spills (stack +
local bytes 0) and, where it has MMAs of 64+ rows, uses wgmma. For Triton kernels the check
compiles the tile candidates in the order the host code tries them (``tiles.pick``) and looks
at the one that would run; the Triton kernels are also checked for sm_80, sm_89, sm_100 and
sm_120 within those targets' shared memory per block."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


# The Triton checks reuse the compile results recorded by content (compile_check.Record: Triton's
# cache key, i.e. its build, the kernel's source and dependencies, types, constexprs, options
# and target): a kernel that changed since the record compiles again, and --verify compiles the
# first configuration of each kernel anyway and fails if the record disagrees. The record's
# regeneration: the compile_check module docstring. No timeout: CI's own limit applies.
RECORD = os.path.join(
    os.path.dirname(__file__), "..", "..", "src", "flash_msa", "triton_ref", "compile_record.json"
)
# The CuTe check's record of the same kind (flash_msa.cute.compile_check: its content keys)
CUTE_RECORD = os.path.join(
    os.path.dirname(__file__), "..", "..", "src", "flash_msa", "cute", "compile_record.json"
)


def _compile_check(*args, verify: bool = True):
    """``python -m flash_msa.triton_ref.compile_check *args`` against the record (``verify``:
    with ``--verify``), without the interpreter: ``(completed process, JSON rows)``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "flash_msa.triton_ref.compile_check", *args, "--cached", RECORD]
    res = subprocess.run([*cmd, "--verify"] if verify else cmd, capture_output=True, text=True,
                         env=env)  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return res, rows


def test_triton_kernels_compile_for_sm90_without_spills():
    """Every shipped configuration (compile_check's list, one process): the candidate that
    runs has no spills, fits the shared memory and, where its MMA has 64+ rows, uses wgmma."""
    from flash_msa.triton_ref import compile_check

    res, rows = _compile_check()
    expected = [name for name, *_ in compile_check.configurations()]
    assert [r["kernel"] for r in rows] == expected, res.stderr[-3000:]
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 232448, r
        # no MMA in the combine and the ordered sums; the proxy-only forward's MMA has BT = 32
        # rows (< wgmma's M = 64), as have tiles of 32 rows (the last candidates; the
        # selection's tile is (warps, rows, stages))
        rows_ = r["tile"][1] if r["kernel"].startswith("select") else r["tile"]
        small = isinstance(rows_, list) and rows_[0] < 64 or isinstance(rows_, int) and rows_ < 64
        exempt = ("combine", "fwd-proxy-only", "slot-sum", "item-sum")
        assert r["wgmma"] or small or r["kernel"].startswith(exempt), r
    assert res.returncode == 0, res.stderr[-3000:]


# sm_80 (A100), sm_89 (L4, L40S, RTX 40xx), sm_100 (B200), sm_120 (RTX 50xx): the anchor and
# paper head layouts at head dim 128 and block 128 (the largest tiles), without the query-map
# kernels, each list walked from its end (compile_check --any: one compile per configuration
# mostly; the full walk, which tile runs, takes 10+ minutes per target and is in
# docs/algorithm.md). CPU time on the 2-core machine, empty Triton cache, without the record:
# 60-80 s per target.
OTHER_TARGETS = [80, 89, 100, 120]


@pytest.mark.parametrize("arch", OTHER_TARGETS, ids=lambda a: f"sm{a}")
def test_triton_kernels_compile_for_other_targets_within_their_shared_memory(arch):
    """Every kernel configuration has a candidate that compiles for ``sm_{arch}`` without
    spills and within that target's shared memory per block (``tiles.SHARED_LIMITS``), so
    ``tiles.pick`` finds one there; every kernel family is covered, and the MMAs are the
    target's (no wgmma off sm_90). A target the installed Triton cannot compile for skips with
    Triton's reason."""
    from flash_msa.triton_ref.compile_check import UNSUPPORTED
    from flash_msa.triton_ref.tiles import SHARED_LIMITS

    args = ["--arch", str(arch), "--layouts", "anchor,paper", "--dims", "128", "--blocks", "128"]
    # --verify (fresh compiles of each kernel's first configuration against the record) on sm_80
    # and sm_90: the record's keys are Triton's own cache keys, the target among them, so one
    # target's fresh compiles check the record and the compiler agree; the others read it
    res, rows = _compile_check(*args, "--no-qmap", "--any", verify=arch == OTHER_TARGETS[0])
    if res.returncode == UNSUPPORTED:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert rows, res.stderr
    families = {r["kernel"].split()[0] for r in rows}
    sparse = {"select", "fwd", "fwd-proxy-only", "bwd", "kl", "kl+grad", "proxy-grad"}
    sparse |= {"bwd-det", "kl+grad-det", "proxy-grad-det"}
    dense = {"dense-fwd", "dense-bwd", "dense-bwd-det", "dense-bwd-dq", "dense-proxy"}
    dense |= {"dense-proxy-det", "dense-proxy-dk", "combine", "slot-sum", "item-sum"}
    assert families >= sparse | dense, families
    assert {r["kernel"] for r in rows} >= {"dense-proxy paper D=128", "kl+grad paper D=128 b=128"}
    # sm_100: tcgen05 where the tile allows it (Triton may fall back to mma.sync)
    mma = {None, "mma.sync", "tcgen05"} if arch == 100 else {None, "mma.sync"}
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SHARED_LIMITS[arch], r
        assert not r["wgmma"], r  # the target's own MMA instructions
        assert r["mma"] in mma, r
        assert r["mma"] or r["kernel"].startswith(("combine", "slot-sum", "item-sum")), r
    assert res.returncode == 0, res.stderr


def test_cute_kernels_compile_for_sm90_without_spills():
    """Every configuration of ``flash_msa.cute.compile_check`` (each shipped kernel: selection,
    forward partials with the proxy LSE and the query map, the KL kernel, backward, combine,
    the fp8 quantize pass, the row delta, the work list) compiles without spills; all but the
    memory-bound ones (no MMA) use wgmma and TMA. Results of unchanged kernels come from the
    check's content cache (in the pytest run's cache directory, tests/conftest.py), seeded with
    the committed record (``--cached``; ``--verify`` compiles the first configuration of each
    family and fails where the record disagrees); no time limit of its own (CI's limit applies)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import compile_check

    expected = {name for name, *_ in compile_check.checks()}
    jobs = str(os.cpu_count() or 1)
    res = subprocess.run(
        [sys.executable, "-m", "flash_msa.cute.compile_check", "--jobs", jobs, "--cached",
         CUTE_RECORD, "--verify"],
        capture_output=True, text=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows} == expected, res.stderr
    for r in rows:
        assert r["stack"] == 0 and r["local"] == 0, r  # spills show up as stack
        # (the combine, the quantize pass, the row delta and the work-list kernels are
        # memory-bound: no MMA, no TMA)
        memory_bound = r["kernel"].startswith(("combine", "quantize", "row_delta", "worklist"))
        assert memory_bound or (r["wgmma"] and r["tma"]), r
        assert r.get("setmaxnreg_kept", True), r  # ptxas may drop a setmaxnreg, warning only
        if r["kernel"].startswith("select e4m3"):  # the FP8 selection: e4m3 products, k 32
            assert r["mma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"], r
    assert res.returncode == 0, res.stderr


def test_cute_kernel_limits_and_shared_memory_arithmetic():
    """``can_implement`` of both kernel classes (no GPU needed): the stated shared-memory
    arithmetic, the refusals, and construction raising the same reason; the kernel objects are
    hashable values (the compile cache's key) that differ in every field."""
    pytest.importorskip("cutlass")
    import dataclasses

    from cutlass import BFloat16, Float8E4M3FN, Float16, Float32

    from flash_msa.cute.fwd_partials_sm90 import FwdPartialsSm90
    from flash_msa.cute.select_sm90 import SelectSm90

    # the numbers the docstrings state (and __call__ asserts against the Storage struct)
    assert FwdPartialsSm90.shared_bytes(2, 128, 128, 3)["total"] == 165888
    assert SelectSm90.shared_bytes(2, 128, 4, 128)["total"] == 167936
    assert SelectSm90.can_implement(BFloat16, 128, 4, 1, 16, 128, stages=5) is None
    assert "shared memory" in SelectSm90.can_implement(BFloat16, 128, 4, 1, 16, 128, stages=6)
    assert "top_k <= 64" in SelectSm90.can_implement(BFloat16, 128, 4, 1, 65, 128)
    assert "Dp" in SelectSm90.can_implement(Float16, 96, 4, 1, 16, 128)
    assert "bf16 or fp16" in SelectSm90.can_implement(Float32, 128, 4, 1, 16, 128)
    assert FwdPartialsSm90.can_implement(BFloat16, 64, 4, 4, 128, 16, 128, 3) is None
    assert "head_dim" in FwdPartialsSm90.can_implement(BFloat16, 16, 2, 4, 96, 16, 128)
    assert "warpgroups" in FwdPartialsSm90.can_implement(BFloat16, 16, 2, 4, 128, 16, 128, 4)
    assert "divide one another" in FwdPartialsSm90.can_implement(BFloat16, 24, 3, 2, 64, 4, 64)
    with pytest.raises(ValueError, match="head_dim"):
        FwdPartialsSm90(BFloat16, 16, 2, 4, 96, 16, 128)
    # the proxy LSE part: Dp in {64, 128}, Hs a multiple of Hpk; at most 198,656 bytes
    assert FwdPartialsSm90.shared_bytes(2, 128, 128, 3, 128)["total"] == 198656
    assert FwdPartialsSm90.shared_bytes(2, 64, 128, 3, 128)["total"] == 165888
    assert FwdPartialsSm90.can_implement(BFloat16, 8, 2, 4, 64, 8, 64, 3, True, 64, 2) is None
    assert "proxy_head_dim" in FwdPartialsSm90.can_implement(
        BFloat16, 16, 2, 4, 128, 16, 128, 3, True, 96
    )
    assert "proxy key heads" in FwdPartialsSm90.can_implement(
        BFloat16, 16, 2, 4, 128, 16, 128, 3, True, 128, 3
    )
    assert FwdPartialsSm90.can_implement(BFloat16, 16, 2, 4, 128, 16, 128, 3, False, 96) is None
    with pytest.raises(ValueError, match="top_k"):
        SelectSm90(BFloat16, 128, 4, 1, 65, 128)
    # the FP8 selection (e4m3 operands with key scales): half the bytes per tile, 8 stages
    assert SelectSm90.shared_bytes(1, 128, 8, 128)["total"] == 151552
    assert SelectSm90.can_implement(Float8E4M3FN, 128, 4, 1, 64, 64, 12, "token") is None
    assert "shared memory" in SelectSm90.can_implement(
        Float8E4M3FN, 128, 4, 1, 16, 128, 13, "block"
    )
    assert "e4m3 with a key_scale" in SelectSm90.can_implement(Float8E4M3FN, 128, 4, 1, 16, 128)
    assert "needs e4m3" in SelectSm90.can_implement(BFloat16, 128, 4, 1, 16, 128, 8, "block")
    assert "key_scale" in SelectSm90.can_implement(Float8E4M3FN, 128, 4, 1, 16, 128, 8, "row")
    with pytest.raises(ValueError, match="no query map"):
        SelectSm90(Float8E4M3FN, 128, 4, 1, 16, 128, 8, qmap=True, key_scale="block")
    fp8 = SelectSm90(Float8E4M3FN, 128, 4, 1, 16, 128, 8, key_scale="block")
    for other in (dataclasses.replace(fp8, key_scale="token"), dataclasses.replace(fp8, stages=4)):
        assert other != fp8 and hash(other) != hash(fp8)

    base = FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128)
    assert base == FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128, warpgroups=3)
    changes = dict(
        dtype=Float16, heads=32, kv_heads=4, sel_heads=2, head_dim=64, top_k=8, block_size=64,
        warpgroups=1, proxy=True, proxy_head_dim=64, proxy_k_heads=2, qmap=True,
        views=((BFloat16, (None, 128), (128, 1)),),  # (the pointer launch's tensor layouts)
    )  # fmt: skip
    assert set(changes) == {f.name for f in dataclasses.fields(FwdPartialsSm90)}
    for name, value in changes.items():  # any field changes the cache key
        other = dataclasses.replace(base, **{name: value})
        assert other != base and hash(other) != hash(base), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.warpgroups = 1


def test_cute_backward_limits_and_shared_memory_arithmetic():
    """``BwdSm90.can_implement``: the numbers its docstring states, the head layouts it refuses
    (a selection head's main heads over several KV heads), dims and dtypes; the kernel object
    is its whole configuration (the compile cache key); ``bwd_kernel_reason`` on a Problem."""
    pytest.importorskip("cutlass")
    import dataclasses

    import torch
    from cutlass import BFloat16, Float16, Float32

    from flash_msa import cute
    from flash_msa.cute.bwd_sm90 import BwdSm90
    from flash_msa.problem import Config, Problem

    assert BwdSm90.shared_bytes(2, 128, 128, 128, True)["total"] == 182272
    assert BwdSm90.shared_bytes(2, 128, 128, 128, False)["total"] == 117760
    # two gather buffers (+33 KB): still fits
    assert BwdSm90.shared_bytes(2, 128, 128, 128, True, 2)["total"] == 216064
    assert BwdSm90.can_implement(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, True, 2) is None
    assert "gather_stages" in BwdSm90.can_implement(
        BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, True, 3
    )
    ok = BwdSm90.can_implement
    assert ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128) is None  # anchor
    assert ok(BFloat16, 64, 4, 4, 1, 128, 128, 16, 128) is None  # paper
    assert ok(Float16, 8, 1, 4, 1, 64, 128, 3, 64) is None  # Hp > Hkv, Dp > D
    assert "share one KV head" in ok(BFloat16, 8, 4, 2, 1, 64, 64, 8, 64)  # Hp < Hkv
    assert "head_dim" in ok(BFloat16, 16, 2, 4, 1, 96, 128, 16, 128)
    assert "proxy_head_dim" in ok(BFloat16, 16, 2, 4, 1, 128, 32, 16, 128)
    assert "block_size" in ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 256)
    assert "bf16 or fp16" in ok(Float32, 16, 2, 4, 1, 128, 128, 16, 128)
    with pytest.raises(ValueError, match="share one KV head"):
        BwdSm90(BFloat16, 8, 4, 2, 1, 64, 64, 8, 64)
    with pytest.raises(ValueError, match="nothing to make"):
        BwdSm90(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, main=False, proxy=False)
    base = BwdSm90(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128)
    changes = dict(main=False, proxy=False, top_k=8, proxy_k_heads=2, gather_stages=1)
    for name, value in dict(changes, deterministic=True).items():
        other = dataclasses.replace(base, **{name: value})
        assert other != base and hash(other) != hash(base), name

    cfg = Config(block_size=128, softmax_scale=0.1, max_seqlen=4096, proxy_scale=0.1, top_k=16)
    prob = Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=16,
        num_kv_heads=2, head_dim=128, num_sel_heads=4, num_proxy_k_heads=1, proxy_head_dim=128,
        varlen=False, cfg=cfg,
    )  # fmt: skip
    assert cute.bwd_kernel_reason(prob) is None
    assert "sm_80" in cute.unsupported_reason("bwd", dataclasses.replace(prob, capability=(8, 0)))
    assert "share one KV head" in cute.bwd_kernel_reason(dataclasses.replace(prob, num_kv_heads=8))
    assert cute.unsupported_reason("bwd", prob) is None  # registered: LIMITS["bwd"]
    assert "share one KV head" in cute.unsupported_reason(
        "bwd", dataclasses.replace(prob, num_kv_heads=8)
    )
    # the CuTe KL stage: it runs where its kernel can (kl_fits), and the driver borrows
    # Triton's KL stage elsewhere: the forward is never refused for it
    spread = dataclasses.replace(prob, num_kv_heads=8)  # a head group on two KV heads
    assert cute.unsupported_reason("fwd", spread) is None
    assert cute.forward_stages().kl is not None
    assert cute.forward_stages(kl_fits=False).kl is None
    with_kl = dataclasses.replace(prob, cfg=dataclasses.replace(cfg, compute_kl=True))
    assert cute.call_stages(with_kl).kl is not None
    assert cute.call_stages(dataclasses.replace(with_kl, q_map=True)).kl is None  # Triton's
    # a call that asks for the unit proxy gradient (its backward runs on Triton) gets Triton's
    # KL stage, which makes it: the fake implementation's shapes (makes_unit_proxy_grad) then
    # hold whichever stage kl_fits would pick
    from flash_msa import ops, sparse_forward, triton_ref

    asked = sparse_forward.with_proxy_grad(cute.forward_stages())
    tri = triton_ref.forward_stages().kl  # (a partial over the shipped tile tables: a new object)
    assert (asked.kl.func, asked.kl.keywords) == (tri.func, tri.keywords)
    assert asked.kl_makes_proxy_grad
    assert not sparse_forward.borrowed(cute.forward_stages()).kl_makes_proxy_grad
    assert ops.makes_unit_proxy_grad("cute", True, True, True, True)
    assert not ops.makes_unit_proxy_grad("cute", True, True, True, False)
    assert cute.LIMITS["bwd"].fused_proxy_grad  # the backward makes the proxy gradient


def test_cute_warp_specialized_backward_limits():
    """``BwdWsSm90`` (the default): BwdSm90's limits plus its own (block 128, ``Dp == D``, two
    ring stages, no deterministic mode yet), each refused with the reason; its shared memory is
    BwdSm90's with two gather stages and two q_proxy stages; ``backward.kernel_for`` picks it
    where it can run (``ws=True`` forces it), BwdSm90 otherwise."""
    pytest.importorskip("cutlass")
    from cutlass import BFloat16

    from flash_msa.cute.backward import kernel_for
    from flash_msa.cute.bwd_sm90 import BwdSm90
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90

    ok = BwdWsSm90.can_implement
    assert ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128) is None  # anchor
    assert ok(BFloat16, 64, 4, 4, 1, 128, 128, 16, 128) is None  # paper
    assert "block_size 128" in ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 64)
    assert "proxy_head_dim == head_dim" in ok(BFloat16, 8, 1, 4, 1, 64, 128, 3, 128)
    assert ok(BFloat16, 8, 1, 4, 1, 64, 128, 3, 128, False) is None  # main-only: no q_proxy
    assert "two gather stages" in ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, True, 1)
    assert "deterministic" in ok(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, True, 2, True)
    assert "share one KV head" in ok(BFloat16, 8, 4, 2, 1, 64, 64, 8, 128)
    ws = kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, ws=True)
    assert type(ws) is BwdWsSm90 and ws.gather_stages == 2 and ws.cta_threads == 384
    # the default: the warp-specialized kernel where it can run, else BwdSm90 (two stages)
    assert kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128) == ws
    for args, kw in (
        ((16, 2, 4, 1, 128, 128, 16, 64), {}),  # block 64
        ((8, 1, 4, 1, 64, 128, 3, 128), {}),  # Dp != D
        ((16, 2, 4, 1, 128, 128, 16, 128), dict(deterministic=True)),
        ((16, 2, 4, 1, 128, 128, 16, 128), dict(ws=False)),
    ):
        kernel = kernel_for(BFloat16, *args, **kw)
        assert type(kernel) is BwdSm90 and kernel.gather_stages == 2, (args, kw)
    with pytest.raises(ValueError, match="nothing to make"):
        BwdSm90(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, False, False)
    assert BwdWsSm90.shared_bytes(2, 128, 128, 128, True, 2)["total"] == 216064
    with pytest.raises(ValueError, match="block_size 128"):
        kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 64, ws=True)


def test_cute_query_map_limits_and_kernels(monkeypatch):
    """The query map (context parallelism) on CuTe: declared in ``LIMITS``: select, fwd and bwd take
    a mapped call (their kernels' ``qmap`` mode), so ``auto`` picks CuTe for every mapped op on
    sm_90; with limits that do not declare it, every CuTe op refuses a mapped call by name and
    ``auto`` runs it on Triton; ``qmap`` is part of each kernel object (the compile cache's key),
    ``backward.kernel_for`` passes it to both backward kernels, and a launch refuses a work list
    whose map disagrees with its kernel. (No GPU: the kernels' GPU tests are in
    tests/ops/test_fwd.py / tests/ops/test_bwd.py; CPU time about 1 s.)"""
    pytest.importorskip("cutlass")
    import dataclasses

    import torch
    from cutlass import BFloat16

    from flash_msa import backends, cute, limits, testing, worklist
    from flash_msa.cute.backward import kernel_for, launch_items
    from flash_msa.cute.bwd_sm90 import BwdSm90
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90
    from flash_msa.cute.select_sm90 import SelectSm90
    from flash_msa.problem import Config, Problem

    cfg = Config(block_size=128, softmax_scale=0.1, max_seqlen=4096, proxy_scale=0.1, top_k=16)
    plain = Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=16,
        num_kv_heads=2, head_dim=128, num_sel_heads=4, num_proxy_k_heads=1, proxy_head_dim=128,
        varlen=True, cfg=cfg,
    )  # fmt: skip
    mapped = dataclasses.replace(plain, q_map=True)
    for op in ("select", "fwd", "bwd"):
        assert cute.unsupported_reason(op, plain) is None, op
    assert all(cute.LIMITS[op].q_map for op in ("select", "fwd", "bwd"))
    assert backends.choose("select", mapped)[0] == "cute"
    assert backends.choose("bwd", mapped)[0] == "cute"
    assert backends.choose("fwd", mapped)[0] == "cute"
    with monkeypatch.context() as mp:  # limits without the map: every op refuses it by name
        for name, lim in (
            ("select", cute.LIMITS["select"]), ("bwd", cute.BWD_LIMITS), ("fwd", cute.LIMITS["fwd"])
        ):  # fmt: skip
            off = dataclasses.replace(lim, q_map=False)
            mp.setitem(cute.LIMITS, name, off)
        cute.clear_memo()
        for op in ("select", "fwd", "bwd"):
            assert "q_map" in (cute.unsupported_reason(op, mapped) or ""), op
            assert backends.choose(op, mapped)[0] == "triton", op
    cute.clear_memo()
    assert cute.unsupported_reason("select", mapped) is None
    assert cute.unsupported_reason("bwd", mapped) is None
    assert cute.bwd_kernel_reason(mapped) is None
    assert cute.unsupported_reason("fwd", mapped) is None
    assert "query map" in limits.describe(cute.LIMITS["select"])
    assert "query map" in limits.describe(cute.LIMITS["bwd"])
    # outside the kernels' other limits a mapped call is refused for those, not for the map
    assert "top_k" in cute.unsupported_reason(
        "select", dataclasses.replace(mapped, cfg=dataclasses.replace(cfg, top_k=65))
    )
    assert "share one KV head" in cute.unsupported_reason(
        "bwd", dataclasses.replace(mapped, num_kv_heads=8)
    )
    picks = {op: backends.choose(op, mapped)[0] for op in ("select", "fwd", "bwd")}
    assert picks == {"select": "cute", "fwd": "cute", "bwd": "cute"}, picks

    sel = SelectSm90(BFloat16, 128, 4, 1, 16, 128)
    assert not sel.qmap and sel == SelectSm90(BFloat16, 128, 4, 1, 16, 128, qmap=False)
    other = dataclasses.replace(sel, qmap=True)
    assert other != sel and hash(other) != hash(sel)
    args = (BFloat16, 16, 2, 4, 1, 128, 128, 16, 128)
    ws = kernel_for(*args, qmap=True)
    assert type(ws) is BwdWsSm90 and ws.qmap and ws != kernel_for(*args)
    assert type(kernel_for(*args, qmap=True, ws=False)) is BwdSm90
    assert kernel_for(*args, qmap=True, deterministic=True).qmap

    # a launch whose work list's map disagrees with the kernel: refused before anything runs
    cu = testing.cu([100, 60])
    q_map = torch.tensor([5, 120, -1, 0], dtype=torch.int32)
    idx = torch.zeros((4, 4, 16), dtype=torch.int32)
    wl = worklist.build(idx, cu, 128, BwdSm90.ITEM_TOKENS, 0, 160, q_map)
    with pytest.raises(ValueError, match="qmap=False for a work list with a query map"):
        launch_items(kernel_for(*args), (), (), wl, (None,) * 5)
    with pytest.raises(ValueError, match="qmap=True for a work list without"):
        launch_items(ws, (), (), wl._replace(q_map=None), (None,) * 5)


def test_cute_fp8_selection_host(monkeypatch):
    """The CuTe FP8 selection's host code on CPU tensors (no GPU): ``select`` with
    ``selection_precision="fp8"`` quantizes and hands the kernel e4m3 views and the key scales,
    which compile for sm_90a (the launch replaced by ``cute.compile``: the host and kernel
    agree on every argument), per block (the shipped quantization, ``FP8_STAGES``) and per
    token; the refusals (a query map, an fp8 Config on the exact entry, operands that are not
    e4m3); ``LIMITS`` declares ``fp8_selection`` and ``auto`` runs an fp8 selection on CuTe on
    sm_90 (a mapped one elsewhere: the fp8 kernel has no query map).
    (The kernel's GPU tests: tests/ops/test_select_fp8.py. CPU time about 3 s.)"""
    pytest.importorskip("cutlass")
    import dataclasses

    import cutlass.cute as cute_dsl
    import torch
    from cutlass.cute.runtime import make_fake_stream

    from flash_msa import backends, cute, quant, testing
    from flash_msa.cute import select_sm90, selection
    from flash_msa.problem import Config, Problem

    compiled = []

    def compile_instead(kernel, device, args, signature):
        # run_typed's launch: the pointer arguments selection.select_arguments built
        assert signature == selection.SELECT_SIGNATURE
        cute_dsl.compile(kernel, *args, options="--gpu-arch sm_90a")
        compiled.append(kernel)

    monkeypatch.setattr(selection, "run_typed", compile_instead)
    monkeypatch.setattr(selection, "stream", lambda device: make_fake_stream())
    cu = testing.cu([300, 129])
    qp, kp = (x[0] for x in testing.make_inputs(1, 429, 1, 1, 4, 1, 1, 128)[:2])
    cfg = Config(block_size=128, softmax_scale=0.1, max_seqlen=300, proxy_scale=128**-0.5,
                 top_k=16, selection_precision="fp8")  # fmt: skip
    out = selection.select(qp, kp, cu, cfg)
    assert out.shape == (429, 4, 16) and out.dtype == torch.int32
    assert compiled[-1].dtype.__name__ == "Float8E4M3FN"
    assert (compiled[-1].key_scale, compiled[-1].stages) == (
        quant.KEY_SCALE,
        select_sm90.FP8_STAGES,
    )
    qz = quant.quantize(qp, kp, cu, 64, key_scale="token")
    cfg64 = dataclasses.replace(cfg, block_size=64)
    selection.select_fp8_into(torch.empty(429, 4, 16, dtype=torch.int32), qz, cu, cfg64)
    assert compiled[-1].key_scale == "token" and compiled[-1].block_size == 64
    with pytest.raises(ValueError, match="q_map"):
        selection.select(qp, kp, cu, cfg, q_map=torch.arange(429, dtype=torch.int32))
    with pytest.raises(ValueError, match="exact selection"):
        selection.select_into(torch.empty(429, 4, 16, dtype=torch.int32), qp, kp, cu, cfg)
    with pytest.raises(ValueError, match="quantized.k must be e4m3"):
        bad = qz._replace(k=qz.k.float())
        selection.select_fp8_into(torch.empty(429, 4, 16, dtype=torch.int32), bad, cu, cfg64)
    assert len(compiled) == 2

    # declared, so auto runs an fp8 selection on CuTe on sm_90, but not a mapped one (the fp8
    # kernel has no query map)
    assert cute.LIMITS["select"].fp8_selection
    prob = Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=16,
        num_kv_heads=2, head_dim=128, num_sel_heads=4, num_proxy_k_heads=1, proxy_head_dim=128,
        varlen=True, cfg=cfg,
    )  # fmt: skip
    assert prob.selection_precision == "fp8"
    assert cute.unsupported_reason("select", prob) is None
    assert backends.choose("select", prob)[0] == "cute"
    mapped = dataclasses.replace(prob, q_map=True)
    assert "query map" in cute.unsupported_reason("select", mapped)
    assert backends.choose("select", mapped)[0] != "cute"
    odd = dataclasses.replace(prob, num_proxy_k_heads=3)  # the fp8 kernel's own check
    assert "multiple" in cute.unsupported_reason("select", odd)


def test_cute_view_signature_has_the_static_layout():
    """``launch.view_signature`` (what ``view_layout`` keys the pointer launches' views by):
    static sizes, strides and dtypes of CuTe tensor views are in it, the run-time (outermost)
    size is not."""
    pytest.importorskip("cutlass")
    import torch

    from flash_msa.cute.launch import cute_tensor, view_signature

    def sig(x):
        return view_signature(cute_tensor(x))

    def z(*shape, dtype=torch.bfloat16):
        return torch.zeros(shape, dtype=dtype)

    assert sig(z(8, 4, 64)) == sig(z(100, 4, 64))  # token count: run time
    assert sig(z(8, 4, 64)) != sig(z(8, 4, 128))
    assert sig(z(8, 4, 64)) != sig(z(8, 2, 64))
    assert sig(z(8, 4, 64)) != sig(z(8, 4, 64, dtype=torch.float16))
    assert sig(z(8, 2, 64, dtype=torch.float32).permute(0, 2, 1)) != sig(
        z(8, 64, 2, dtype=torch.float32)
    )
    for T in (1, 2, 300):  # plain, permuted and flat layouts: one signature whatever T
        for x, y in (
            (z(T, 4, 128), z(7, 4, 128)),
            (z(T, 2, 64, dtype=torch.float16).permute(0, 2, 1),
             z(7, 2, 64, dtype=torch.float16).permute(0, 2, 1)),
            (z(T, dtype=torch.int64), z(7, dtype=torch.int64)),
        ):  # fmt: skip
            assert sig(x) == sig(y), (T, x.shape, x.stride())


def test_cute_forward_refuses_head_layouts_and_buffers_it_cannot_run():
    """Host-side checks of the CuTe forward partials (no GPU needed): head layouts whose KV
    sub-groups would read another KV head's tiles, and partial buffers the kernel cannot store
    into, raise ValueError before any launch."""
    pytest.importorskip("cutlass")
    import cutlass
    import torch

    from flash_msa.cute import forward, fwd_partials_sm90
    from flash_msa.problem import Config

    reason = fwd_partials_sm90.head_geometry_reason
    assert reason(16, 2, 4) is None  # anchor
    assert reason(64, 4, 4) is None  # paper
    assert reason(8, 4, 2) is None  # Hs < Hkv
    # Hs=2, Hkv=3: selection head 1's second sub-group (heads 16-19) lies in KV head 2, but the
    # kernel would keep KV head 1's tiles
    assert "divide one another" in reason(24, 3, 2)

    class WL:  # the fields partials() reads before the launch
        slots = 4
        heads = 4
        q_map = None

    T, H, Hkv, D = 8, 16, 2, 64
    q = torch.zeros(T, H, D, dtype=torch.bfloat16)
    k = torch.zeros(T, Hkv, D, dtype=torch.bfloat16)
    cfg = Config(
        block_size=64,
        softmax_scale=D**-0.5,
        max_seqlen=T,
        proxy_scale=D**-0.5,
        top_k=4,
        warmup=False,
        compute_kl=True,
    )
    o_ok = torch.zeros(T, H, 4, D, dtype=torch.bfloat16)
    l_ok = torch.zeros(T, H, 4)
    with pytest.raises(ValueError, match="o_part"):
        forward.partials(q, k, k, WL, o_ok[:, :, :, :32], l_ok, cfg)
    with pytest.raises(ValueError, match="l_part"):
        forward.partials(q, k, k, WL, o_ok, l_ok.transpose(0, 1), cfg)
    with pytest.raises(ValueError, match="warpgroups"):
        fwd_partials_sm90.FwdPartialsSm90(cutlass.BFloat16, H, Hkv, 4, D, 4, 64, 4)
    with pytest.raises(ValueError, match="divide one another"):
        q24 = torch.zeros(T, 24, D, dtype=torch.bfloat16)
        k3 = torch.zeros(T, 3, D, dtype=torch.bfloat16)
        WL.heads = 2
        forward.partials(q24, k3, k3, WL, o_ok, l_ok, cfg)


def test_cute_proxy_lse_fit_and_host_checks():
    """``proxy_fits`` decides whether the CuTe partials make the proxy LSE partials (the driver's
    ``partials_make_proxy``; else Triton's ``proxy_partials`` is borrowed), and ``partials`` refuses
    proxy inputs it cannot take before any launch (no GPU needed)."""
    pytest.importorskip("cutlass")
    import torch

    from flash_msa import cute, sparse_forward
    from flash_msa.cute import forward
    from flash_msa.problem import Config

    assert cute.forward_stages().partials_make_proxy
    assert not cute.forward_stages(proxy_fits=False).partials_make_proxy
    no_proxy = cute.forward_stages(proxy_fits=False)
    assert sparse_forward.borrowed(no_proxy).proxy_partials is not None  # Triton's

    T, H, Hkv, Hs, D, K = 8, 16, 2, 4, 128, 4
    cfg = Config(
        block_size=64, softmax_scale=D**-0.5, max_seqlen=T, proxy_scale=D**-0.5, top_k=K,
        warmup=False, compute_kl=True,
    )  # fmt: skip
    bf = dict(dtype=torch.bfloat16)
    q, k = torch.zeros(T, H, D, **bf), torch.zeros(T, Hkv, D, **bf)
    qp, kp = torch.zeros(T, Hs, 128, **bf), torch.zeros(T, 1, 128, **bf)
    idx = torch.zeros(T, Hs, K, dtype=torch.int32)
    fits = forward.proxy_fits
    assert fits(q, k, qp, kp, idx, cfg)
    assert not fits(q, k, None, None, idx, cfg)
    assert not fits(q, k, qp.half(), kp.half(), idx, cfg)  # one element type per kernel
    assert not fits(q, k, qp[..., :96], kp[..., :96], idx, cfg)  # Dp 64 or 128
    assert not fits(q, k, qp, torch.zeros(T, 3, 128, **bf), idx, cfg)  # Hs % Hpk

    class WL:  # the fields partials() reads before the launch
        slots = K
        heads = Hs
        q_map = None

    o, lp, pl = torch.zeros(T, H, K, D, **bf), torch.zeros(T, H, K), torch.zeros(T, Hs, K)
    with pytest.raises(ValueError, match="pl_part"):
        forward.partials(q, k, k, WL, o, lp, cfg, 0, (qp, kp, pl[:, :2]))
    with pytest.raises(ValueError, match="k_proxy"):
        forward.partials(q, k, k, WL, o, lp, cfg, 0, (qp, kp.half(), pl))
    with pytest.raises(ValueError, match="proxy_head_dim"):
        forward.partials(q, k, k, WL, o, lp, cfg, 0, (qp[..., :96], kp[..., :96], pl))
    with pytest.raises(ValueError, match="pl_part must be torch.float32"):
        forward.partials(q, k, k, WL, o, lp, cfg, 0, (qp, kp, pl.half()))
    with pytest.raises(ValueError, match="l_part must be torch.float32"):
        forward.partials(q, k, k, WL, o, lp.half(), cfg, 0, (qp, kp, pl))
    with pytest.raises(ValueError, match="q_proxy must be"):  # not an IndexError
        forward.partials(q, k, k, WL, o, lp, cfg, 0, (qp[:, 0], kp, pl))


def test_cute_compile_check_keeps_results_by_content(tmp_path, monkeypatch):
    """The compile check's content cache: a kernel compiled once is read back (no compile), an
    other configuration is compiled, a ``--dump`` always compiles (its files), and with the
    disk cache off every call compiles."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import compile_check

    monkeypatch.setenv("FLASH_MSA_CACHE_DIR", str(tmp_path / "cache"))
    real, compiled = compile_check._compile_kernel, []

    def counting(kernel, *args, **kw):
        compiled.append(kernel)
        return real(kernel, *args, **kw)

    monkeypatch.setattr(compile_check, "_compile_kernel", counting)
    cfg = ("bf16", 16, 4, 16, 128, True)
    first = compile_check.compile_combine(*cfg)
    assert compile_check.compile_combine(*cfg) == first and len(compiled) == 1
    compile_check.compile_combine("fp16", 16, 4, 16, 128, True)
    assert len(compiled) == 2
    compile_check.compile_combine(*cfg, dump=str(tmp_path), name="c")
    assert len(compiled) == 3 and (tmp_path / "c.cubin").is_file()
    monkeypatch.setenv("FLASH_MSA_CACHE", "0")
    assert compile_check.compile_combine(*cfg) == first and len(compiled) == 4


def test_cute_compile_record_is_checked_against_fresh_compiles(tmp_path):
    """The CuTe check's record (``--record`` writes this run's results by content key,
    ``--cached`` seeds the content cache with them): a configuration whose recorded result
    differs from a fresh compile fails ``--verify`` with exit status 4, naming it."""
    pytest.importorskip("cutlass")
    record = tmp_path / "record.json"
    only = "worklist list_bounds"

    def check(cache, *args):
        env = dict(os.environ, FLASH_MSA_CACHE_DIR=str(tmp_path / cache))
        cmd = [sys.executable, "-m", "flash_msa.cute.compile_check", only, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env)

    res = check("a", "--record", str(record))
    assert res.returncode == 0, res.stderr
    entries = json.loads(record.read_text())["entries"]
    assert len(entries) == 1, entries
    assert check("b", "--cached", str(record), "--verify").returncode == 0
    for res_ in entries.values():
        res_["reg"] += 1  # a record that lies
    record.write_text(json.dumps(dict(entries=entries)))
    res = check("c", "--cached", str(record), "--verify")
    assert res.returncode == 4 and only in res.stderr, res.stderr
    # without --verify the seeded (wrong) entry is what the report shows: the record is trusted
    # as the cache is, and CI runs with --verify
    res = check("d", "--cached", str(record))
    assert json.loads(res.stdout.splitlines()[-1])["reg"] == list(entries.values())[0]["reg"]

