"""Deterministic mode (``FLASH_MSA_DETERMINISTIC=1`` / ``deterministic=True``).

CPU tests (Triton under its interpreter, tiny shapes):

- a full training step (forward + backward, KL in the loss) run twice gives the same bits for
  ``out``, ``kl`` and all five gradients, and matches the reference by the tolerance rule;
- the mechanism, since the interpreter runs a grid's programs one after another in a fixed
  order (its fp32 atomics then happen to sum in a fixed order too): the same step with every
  launch's programs run in a shuffled order gives the same bits, and runs no atomic at all;
  the same shuffle changes the default (atomic) path's bits, so the check can fail;
- the setting: the environment variable and the keyword, the keyword winning, bad values
  refused naming the setting; backends that do not declare the mode are skipped by ``auto``
  and raise when forced; the custom ops take the keyword (``torch.library.opcheck``);
- what the interpreter cannot run, a race of Triton's software pipelining (an async wgmma
  reading a ring-buffer slot being refilled; the likely cause of the warmup's dk_proxy
  differing between two runs on the H200): every tile of the deterministic dense kernels
  compiled for sm_90a and checked (``tiles.ring_hazards``), and ``tiles.pick`` skipping a
  racing tile.

GPU tests (``-m gpu``): the step four times on ``auto`` at T = 4096 (anchor heads), bit for
bit, sparse and warmup (a failure says which elements differ and which tiles ran), and the time
of deterministic vs default printed side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import flash_msa
from flash_msa import backends, limits, ops, reference, testing
from flash_msa.nn import MSAttention
from flash_msa.problem import Config, Problem
from harness import config, poison_new_buffers, references

INTERPRETED = backends.interpreting() and not torch.cuda.is_available()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tests of the Triton kernels need TRITON_INTERPRET=1"
)
NAMES = ("out", "kl", "dq", "dk", "dv", "dq_proxy", "dk_proxy")
# lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k: varlen with a partial last block, Hp > Hkv
SPARSE = ((130, 50), 8, 2, 4, 1, 16, 16, 64, 2)
HS_LT_HKV = ((100,), 4, 4, 2, 1, 16, 16, 64, 2)  # a selection group spans 2 KV heads
# the shuffled-programs test (4 steps each): 3 slots per row and 4 selection heads per KV head,
# so that every gradient is a sum of >= 3 terms (a sum of two is the same in either order)
SMALL = ((160, 40), 4, 1, 4, 1, 16, 16, 64, 3)
# warmup with the anchor's head layout (H16/Hkv2/Hp4/Hpk1): 4 heads per proxy head share a KV
# head, so the dense proxy kernels pack G2 = 4 heads into a tile of BT = 16 tokens, fewer than
# the BN = 64 keys (SMALL has G2 = 1, BT = BN = 64); the GPU runs this geometry
ANCHOR_HEADS = ((100, 60), 16, 2, 4, 1, 16, 16, 64, 1)


def _step(case, *, deterministic, warmup=False, device="cpu", dtype=torch.float32, seed=0):
    """One training step of ``msa_attention`` (loss: ``testing.training_loss``): ``{name:
    tensor}`` for :data:`NAMES`, plus the inputs ``(qp, kp, q, k, v)`` and ``cu_seqlens``."""
    lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k = case
    T = sum(lengths)
    xs = testing.make_inputs(1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed)
    xs = [x[0].to(device).contiguous().requires_grad_() for x in xs]
    cu = testing.cu(lengths, device)
    out, kl = flash_msa.msa_attention(
        *xs, top_k, block_size=block, cu_seqlens=cu, max_seqlen=max(lengths), warmup=warmup,
        deterministic=deterministic,
    )  # fmt: skip
    testing.training_loss(out, kl, Hp * T, seed=seed + 1).backward()
    grads = [x.grad for x in (xs[2], xs[3], xs[4], xs[0], xs[1])]
    return dict(zip(NAMES, (out.detach(), kl.detach(), *grads))), xs, cu


def _assert_same_bits(a: dict, b: dict, label: str, note: str = ""):
    """Every tensor of :data:`NAMES` the same bits in ``a`` and ``b``; a failure names each that
    differs, how many elements, where the first is, the largest difference and whether NaN
    occur (a NaN never equals itself), then ``note``."""
    bad = []
    for name in NAMES:
        x, y = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a[name], b[name]))
        if torch.equal(x, y):  # bits, not values: -0.0 vs 0.0 differ, equal NaNs do not
            continue
        diff = (a[name] != b[name]) & ~(a[name].isnan() & b[name].isnan())
        where = diff.nonzero()[:1].tolist()
        gap = (a[name].float() - b[name].float()).abs().nan_to_num(float("inf")).max().item()
        nan = (a[name].isnan().sum().item(), b[name].isnan().sum().item())
        n = int(diff.sum())  # 0: the bits differ in signed zeros only
        bad.append(f"{name}: {n} elements, first at {where}, max |diff| {gap:.3g}, "
                   f"NaN counts {nan}")  # fmt: skip
    assert not bad, f"{label}: differ between the runs: " + "; ".join(bad) + note


def _check_reference(mine: dict, xs, cu, case, warmup: bool, seed=0):
    """``mine`` against the fp64 reference by the tolerance rule (same indices, same loss)."""
    lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k = case
    qp, kp, q, k, v = (x.detach() for x in xs)
    cfg = config(max(lengths), D, Dp, block, top_k, warmup=warmup)
    idx = None if warmup else reference.select(qp, kp, cu, cfg)
    dout, w = testing.loss_weights(q.shape, Hp * q.shape[0], seed + 1, q.device)
    dkl = torch.tensor(w, dtype=torch.float32, device=q.device)
    exact, same = references(qp, kp, q, k, v, idx, cu, cfg, dout.to(q.dtype), dkl)
    for name in NAMES:
        testing.assert_close(name, mine[name], exact[name], same[name])


@pytest.fixture
def small_partials(monkeypatch):
    """Partial buffers of 120 KB and key blocks split over two programs: for :data:`SPARSE`, 4
    token chunks (the last of 6 tokens) of 2 item ranges each in the backward, 2 head slices in
    the forward's KL stage, ``S = 2`` key parts per slot (on a GPU the tiles are whatever
    ``tiles.pick`` finds). The tiles reach the Triton backend's ops as their ``tables``
    argument; the step must have run both ops with them."""
    from flash_msa import ordered, triton_ref
    from flash_msa.triton_ref.tiles import Tables

    tables = Tables(bwd=((64, 32, 2),), proxy=((32, 32, True),))
    ran = set()

    def with_tables(op):
        def run(*args, **kw):
            ran.add(op.__name__)
            return op(*args, **kw, tables=tables)

        return run

    monkeypatch.setattr(ordered, "PARTIAL_BYTES", 120_000)
    monkeypatch.setattr(triton_ref, "fwd", with_tables(triton_ref.fwd))
    monkeypatch.setattr(triton_ref, "bwd", with_tables(triton_ref.bwd))
    yield
    assert ran == {"fwd", "bwd"}, ran


# ---------------------------------------------------------------------------------------------
# the step twice
# ---------------------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize(
    "case, warmup",
    [(SPARSE, False), (HS_LT_HKV, False), (SMALL, True), (ANCHOR_HEADS, True)],
    ids=["sparse", "sparse-Hs<Hkv", "warmup", "warmup-anchor-heads"],
)
def test_step_twice_same_bits_and_reference(case, warmup, small_partials, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    poison_new_buffers(monkeypatch)
    first, xs, cu = _step(case, deterministic=True, warmup=warmup)
    again, _, _ = _step(case, deterministic=True, warmup=warmup)
    _assert_same_bits(first, again, "deterministic step twice")
    _check_reference(first, xs, cu, case, warmup)


# ---------------------------------------------------------------------------------------------
# the mechanism: program order and atomics
# ---------------------------------------------------------------------------------------------
def _interpreter_hooks(monkeypatch, shuffle_seed):
    """Run every launch's programs in a shuffled order (``shuffle_seed``; ``None``: the usual
    order) and count the atomic read-modify-writes. Patches the Triton interpreter's builder
    (``triton.runtime.interpreter.interpreter_builder``: its grid loop sets each program's id
    there, and atomics are created there). Returns the counter ``{"atomics": n}``."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    seen = {"atomics": 0}
    real_atomic = builder.create_atomic_rmw

    def atomic(*args, **kw):
        seen["atomics"] += 1
        return real_atomic(*args, **kw)

    monkeypatch.setattr(builder, "create_atomic_rmw", atomic)
    if shuffle_seed is None:
        return seen
    real_idx = builder.set_grid_idx
    orders: dict[tuple, list[int]] = {}

    def shuffled(x, y, z):  # program (x, y, z) of the loop runs as another one of the grid
        nx, ny, nz = builder.grid_dim
        if (nx, ny, nz) not in orders:
            g = torch.Generator().manual_seed(shuffle_seed + nx * 7919 + ny * 31 + nz)
            orders[(nx, ny, nz)] = torch.randperm(nx * ny * nz, generator=g).tolist()
        f = orders[(nx, ny, nz)][(x * ny + y) * nz + z]
        real_idx(f // (ny * nz), f // nz % ny, f % nz)

    monkeypatch.setattr(builder, "set_grid_idx", shuffled)
    return seen


@needs_interpreter
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_program_order_changes_atomic_bits_but_not_deterministic_ones(warmup, monkeypatch):
    """The shuffle is what a GPU's scheduler does to the fp32 atomics: it changes the default
    path's gradients (this test can fail) and leaves deterministic mode's bits alone."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    runs = {}
    for det in (True, False):
        for shuffle in (None, 1234):
            with monkeypatch.context() as mp:
                seen = _interpreter_hooks(mp, shuffle)
                runs[det, shuffle] = _step(SMALL, deterministic=det, warmup=warmup)[0]
            if det:
                assert seen["atomics"] == 0, "an atomic ran in deterministic mode"
            else:
                assert seen["atomics"] > 0, "the default path no longer uses atomics: update"
    _assert_same_bits(runs[True, None], runs[True, 1234], "deterministic, shuffled programs")
    changed = {n for n in NAMES if not torch.equal(runs[False, None][n], runs[False, 1234][n])}
    # every gradient the default path sums by atomics (the warmup's dq_proxy is query-outer, in
    # registers, in both modes); measured: the shuffle changes each of them at this shape
    atomic = {"dq", "dk", "dv", "dk_proxy"} | (set() if warmup else {"dq_proxy"})
    assert changed == atomic, f"the shuffle changed {changed} of the atomic path, not {atomic}"


# ---------------------------------------------------------------------------------------------
# the setting
# ---------------------------------------------------------------------------------------------
def test_env_and_keyword(monkeypatch):
    monkeypatch.delenv("FLASH_MSA_DETERMINISTIC", raising=False)
    assert backends.deterministic() is False  # default off
    for raw, want in (("1", True), ("true", True), (" TRUE ", True), ("0", False), ("", False)):
        monkeypatch.setenv("FLASH_MSA_DETERMINISTIC", raw)
        assert backends.deterministic() is want, raw
        assert backends.deterministic(not want) is (not want), raw  # the keyword wins
    monkeypatch.setenv("FLASH_MSA_DETERMINISTIC", "yes")
    with pytest.raises(ValueError, match="FLASH_MSA_DETERMINISTIC"):
        backends.deterministic()
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        backends.deterministic(1)


def _seen_configs(monkeypatch):
    """Run on the torch backend and record the ``Config`` its ``fwd`` / ``bwd`` receive."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    seen = []
    for op in ("fwd", "bwd"):
        real = getattr(reference, op)

        def spy(*args, real=real, **kw):
            seen.append(next(a for a in args if isinstance(a, Config)).deterministic)
            return real(*args, **kw)

        monkeypatch.setattr(reference, op, spy)
    return seen


@pytest.mark.parametrize("env, keyword, want", [
    (None, None, False), ("1", None, True), ("1", False, False), ("0", True, True),
    (None, True, True),
])  # fmt: skip
def test_setting_reaches_the_backend(env, keyword, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("FLASH_MSA_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("FLASH_MSA_DETERMINISTIC", env)
    seen = _seen_configs(monkeypatch)
    case = ((70,), 2, 1, 1, 1, 8, 8, 64, 1)
    _step(case, deterministic=keyword)
    assert seen == [want, want]  # fwd, then bwd
    seen.clear()
    layer = MSAttention(16, 2, 1, top_k=1, block_size=64, deterministic=keyword)
    layer(torch.randn(1, 70, 16))[0].sum().backward()
    assert seen == [want, want]


def test_bad_values_name_the_setting(monkeypatch):
    q = torch.randn(1, 64, 2, 8)
    monkeypatch.setenv("FLASH_MSA_DETERMINISTIC", "2")
    with pytest.raises(ValueError, match="FLASH_MSA_DETERMINISTIC"):
        flash_msa.msa_attention(q, q, q, q, q, 1, block_size=64)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_msa.msa_attention(q, q, q, q, q, 1, block_size=64, deterministic="1")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        MSAttention(16, 2, deterministic=1)


def _sm90_problem(deterministic: bool) -> Problem:
    """An anchor-shaped sparse call on an sm_90 GPU (no GPU needed to ask about it)."""
    cfg = Config(
        block_size=128, softmax_scale=0.1, max_seqlen=4096, proxy_scale=0.1, top_k=16,
        deterministic=deterministic,
    )  # fmt: skip
    return Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=16,
        num_kv_heads=2, head_dim=128, num_sel_heads=4, num_proxy_k_heads=1, proxy_head_dim=128,
        varlen=True, cfg=cfg,
    )  # fmt: skip


def test_backends_declare_it_and_auto_skips_the_others(monkeypatch):
    """Every op of the three backends declares deterministic mode (CuTe's backward since its
    H200 run); an op whose Limits do not refuses it with a reason naming the setting: ``auto``
    picks the next backend, a forced one raises."""
    import dataclasses

    problem = _sm90_problem(True)
    for name in ("triton", "torch", "cute"):
        module, why = backends.load(name)
        if module is None:
            assert name == "cute", why
            pytest.skip(why)
        assert all(lim.deterministic for lim in module.LIMITS.values() if not isinstance(lim, str))
    cute = module
    assert limits.reason(cute.LIMITS, "bwd", problem) is None
    assert backends.choose("bwd", problem)[0] == "cute"
    no = dataclasses.replace(cute.LIMITS["bwd"], deterministic=False)
    monkeypatch.setitem(cute.LIMITS, "bwd", no)
    reason = limits.reason(cute.LIMITS, "bwd", problem)
    assert reason is not None and "FLASH_MSA_DETERMINISTIC" in reason
    assert limits.reason(cute.LIMITS, "bwd", _sm90_problem(False)) is None
    name, rejected = backends.choose("bwd", problem)
    assert name == "triton" and rejected[0][0] == "cute" and "deterministic" in rejected[0][1]
    monkeypatch.setenv("FLASH_MSA_BACKEND", "cute")
    with pytest.raises(backends.BackendError, match="FLASH_MSA_DETERMINISTIC"):
        backends.resolve("bwd", problem)


def test_custom_ops_take_the_keyword():
    """The ``flash_msa::`` ops' keyword-only ``deterministic`` (torch backend: the same
    results), checked by ``torch.library.opcheck``."""
    case = ((40, 60), 4, 2, 2, 1, 8, 8, 64, 2)
    lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k = case
    xs = testing.make_inputs(1, 100, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.float64, seed=0)
    qp, kp, q, k, v = (x[0].contiguous() for x in xs)
    cu = testing.cu(lengths)
    args = (60, block, D**-0.5, Dp**-0.5, top_k, False, True, True, [H, Hkv, D, Hp, Hpk, Dp])
    args += ("torch",)
    kw = {"deterministic": True}
    torch.library.opcheck(ops.select, (qp, kp, cu, *args), kw)
    idx = ops.select(qp, kp, cu, *args, **kw)
    torch.library.opcheck(ops.fwd, (q, k, v, idx, cu, qp, kp, True, *args), kw)
    out, lse, plse, kl, u1, u2 = ops.fwd(q, k, v, idx, cu, qp, kp, True, *args, **kw)
    dout, dkl = torch.randn_like(out), torch.ones((), dtype=kl.dtype)
    saved = (q, k, v, out, lse, idx, qp, kp, plse, u1, u2, cu)
    torch.library.opcheck(ops.bwd, (dout, dkl, *saved, *args), kw)


@pytest.mark.parametrize("kernel", ["slot-sum", "item-sum"])
def test_reduction_kernels_compile_for_sm90_without_spills(kernel):
    """The two reduction kernels of ordered.py (no MMA, so outside
    tests/integration/test_compile_check.py's wgmma rule; the deterministic variants of the other
    kernels are checked there: their names carry the families' prefixes). ~3 s each."""
    pytest.importorskip("triton")
    from flash_msa.triton_ref import compile_check

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "flash_msa.triton_ref.compile_check", kernel],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    expected = [name for name, *_ in compile_check.configurations() if name.startswith(kernel)]
    assert len(expected) >= 4 and [r["kernel"] for r in rows] == expected, res.stderr
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= 232448, r
    assert res.returncode == 0, res.stderr


# The pipelining race tiles.ring_hazards finds, reduced to a few lines: x's load has a register
# use (the first MMA) and feeds the accumulating wgmma from its 2-slot ring; the wgmma with an
# immediate wait before it makes Triton defer the accumulating one's wait to the next
# iteration, after the refill of the slot it reads. (Without the first wgmma Triton waits.)
_RACE_SCRIPT = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flash_msa.triton_ref import compile_check, dense, tiles


@triton.jit
def shared_ring(X, W, OUT, n):
    o16, o64, o128 = tl.arange(0, 16), tl.arange(0, 64), tl.arange(0, 128)
    b_w = tl.load(W + o64[:, None] * 128 + o128[None, :])
    acc = tl.zeros([64, 128], tl.float32)
    for m0 in range(0, n, 16):
        b_x = tl.load(X + (m0 + o16)[:, None] * 128 + o128[None, :])
        b_y = tl.load(X + (m0 + o64)[:, None] * 128 + o128[None, :])
        b_s = tl.sum(tl.reshape(tl.dot(b_y, tl.trans(b_w)), [16, 4, 64]), axis=1)
        b_z = tl.dot(b_x, tl.trans(b_w)) + b_s
        acc += tl.dot(tl.trans(b_z.to(tl.bfloat16)), b_x)
    tl.store(OUT + o64[:, None] * 128 + o128[None, :], acc)


class Ttgir(Exception):  # raised in place of the LLVM IR stage: carries the TTGIR text
    pass


def stop_after_ttgir(*args):
    # Triton's add_stages_inspection_hook: without arguments the cache-key suffix, else the
    # llir stage raises Ttgir and the later stages go (no LLVM, no ptxas: seconds a compile)
    if not args:
        return "-flash-msa-ttgir-only", "flash-msa-ttgir-only"
    def stop(src, metadata):
        raise Ttgir(str(src))
    args[1]["llir"] = stop
    for stage in ("ptx", "cubin"):
        args[1].pop(stage, None)


def hazards(fn, sig, consts, warps, stages):
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    full = dict(sig, **{k: "constexpr" for k in consts})
    full = {a: full[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(full.values()) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages)
    runtime = triton.knobs.runtime
    saved, runtime.add_stages_inspection_hook = runtime.add_stages_inspection_hook, stop_after_ttgir
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except Ttgir as ir:
        return tiles.ring_hazards(ir.args[0])
    finally:
        runtime.add_stages_inspection_hook = saved
    raise RuntimeError("the TTGIR stage hook did not run")


sig = dict(X="*bf16", W="*bf16", OUT="*fp32", n="i32")
print(json.dumps(dict(kernel="control", hazards=hazards(shared_ring, sig, {}, 4, 3))))
for name, fn, sig, cands in compile_check.configurations():
    if name.split(" ")[0] in sys.argv[1:]:
        for tile, consts, warps, stages in cands:
            if name.startswith("dense-proxy-dk"):  # the stages it runs with
                stages = dense.PROXY_DK_STAGES
            found = hazards(fn, sig, consts, warps, stages)
            print(json.dumps(dict(kernel=name, tile=tile, hazards=found)))
"""


def test_dense_kernels_have_no_pipelining_race(tmp_path):
    """Every tile candidate of the deterministic warmup kernels (the ones compiled with Triton's
    software pipelining, 2 or 3 stages; the sparse kernels use 1), compiled for sm_90a with the
    stages they run with: no async wgmma reads a ring-buffer slot that the loop refills while
    it is in flight (``tiles.ring_hazards``). The interpreter cannot see this race; it is the
    likely cause of dk_proxy differing between two runs on the H200 (``_dense_proxy_dk_kernel``,
    BN = 64 tiles, before its q_proxy operand got a load of its own: then this test fails). A
    control kernel with the race must be flagged, so the check cannot pass by not parsing the
    IR. Each compile stops after the TTGIR (the IR the check reads): no LLVM, no ptxas."""
    pytest.importorskip("triton")
    from flash_msa.triton_ref import compile_check

    script = tmp_path / "race_check.py"
    script.write_text(_RACE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    families = ["dense-bwd-det", "dense-bwd-dq", "dense-proxy-det", "dense-proxy-dk"]
    res = subprocess.run(
        [sys.executable, str(script), *families], capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert rows[0]["kernel"] == "control" and rows[0]["hazards"], rows[0]
    confs = [c for c in compile_check.configurations() if c[0].split(" ")[0] in families]
    assert len(confs) >= 8, confs  # each family at two head dims at least
    assert len(rows) == 1 + sum(len(c[3]) for c in confs), [r["kernel"] for r in rows]
    raced = [r for r in rows[1:] if r["hazards"]]
    assert not raced, raced


def test_pick_skips_a_racing_tile(monkeypatch):
    """``tiles.pick`` on a GPU (faked here: no compiler runs) skips a candidate whose TTGIR has
    the pipelining race and takes the next one."""
    from types import SimpleNamespace

    from flash_msa.triton_ref import tiles

    racing = "\n".join([
        "%r = ttg.local_alloc : () -> !ttg.memdesc<2x16x128xbf16, #s, #smem, mutable>",
        "%s0 = ttg.memdesc_index %r[%c0_i32] : !ttg.memdesc<2x16x128xbf16>",
        "%s1 = ttg.memdesc_index %r[%c1_i32] : !ttg.memdesc<2x16x128xbf16>",
        "%o = scf.for %i = %a to %b step %c iter_args(%acc = %z) -> (tensor<64x128xf32>) {",
        "  %s = ttg.memdesc_index %r[%k] : !ttg.memdesc<2x16x128xbf16>",
        "  %d = ttng.warp_group_dot %x, %s, %acc {inputPrecision = 0 : i32, isAsync = true}",
        "  scf.yield %d : tensor<64x128xf32>",
        "}",
    ])  # fmt: skip
    waited = racing.replace(
        "  scf.yield", "  %w = ttng.warp_group_dot_wait %d {pendings = 0}\n  scf.yield"
    )
    assert tiles.ring_hazards(racing) and not tiles.ring_hazards(waited)
    code = {"A": racing, "B": waited}
    kernel = SimpleNamespace(
        fn=SimpleNamespace(__name__="fake_kernel"),
        warmup=lambda *a, grid, tile: SimpleNamespace(
            asm={"ttgir": code[tile]}, metadata=SimpleNamespace(shared=0)
        ),
    )  # fmt: skip
    monkeypatch.setattr(tiles, "_chosen", {})  # the fake's choice is not cached for good
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    monkeypatch.setattr(tiles, "spill_bytes", lambda compiled: 0)
    monkeypatch.setattr(tiles, "_shared_limit", lambda dev: 1 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    args = (torch.zeros(1),)
    assert tiles.pick(kernel, args, ("A", "B"), lambda t: {"tile": t}, ("race-test",)) == "B"


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
ANCHOR = ((4096,), 16, 2, 4, 1, 128, 128, 128, 16)  # T = 4096, anchor heads


def _step_time(case, *, deterministic, warmup, reps=5):
    """Seconds per training step (forward + backward of the op, KL in the loss) on inputs made
    once; the first step (compilation) is not timed."""
    lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k = case
    T = sum(lengths)
    xs = testing.make_inputs(1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, seed=0)
    xs = [x[0].cuda().contiguous().requires_grad_() for x in xs]
    cu = testing.cu(lengths, "cuda")
    dout, w = testing.loss_weights((T, H, D), Hp * T, 1, "cuda")
    dout = dout.to(torch.bfloat16)

    def step():
        out, kl = flash_msa.msa_attention(
            *xs, top_k, block_size=block, cu_seqlens=cu, max_seqlen=max(lengths),
            warmup=warmup, deterministic=deterministic,
        )  # fmt: skip
        torch.autograd.backward((out, kl), (dout, torch.full_like(kl, w)))

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_gpu_step_twice_same_bits_on_auto(warmup, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "auto")
    kw = dict(warmup=warmup, device="cuda", dtype=torch.bfloat16)
    first = _step(ANCHOR, deterministic=True, **kw)[0]
    # a race shows in some runs only: 3 more (~10 ms each); on a failure, the tiles
    # tiles.pick chose name the kernels that ran (tiles.pick skips a tile it finds racing, with
    # a warning in the log)
    from flash_msa.triton_ref import tiles

    for rep in range(3):
        again = _step(ANCHOR, deterministic=True, **kw)[0]
        chosen = [(k[0], *k[4:], v) for k, v in tiles.chosen().items()]
        _assert_same_bits(first, again, f"deterministic step on auto, run {rep + 2}", f"; {chosen}")
    default = _step(ANCHOR, deterministic=False, **kw)[0]
    for name in NAMES:  # the same math: the default's rounding order differs, nothing else
        scale = default[name].float().abs().max().item()
        err = (first[name].float() - default[name].float()).abs().max().item()
        assert err <= 2e-2 * max(scale, 1e-6), (name, err, scale)
    t_det = _step_time(ANCHOR, deterministic=True, warmup=warmup)
    t_def = _step_time(ANCHOR, deterministic=False, warmup=warmup)
    print(
        f"\nstep {'warmup' if warmup else 'sparse'} T=4096 anchor bf16: deterministic "
        f"{t_det * 1e3:.2f} ms, default {t_def * 1e3:.2f} ms, ratio {t_det / t_def:.2f}x"
    )
