"""Bad varlen metadata never reaches a kernel: rows it makes meaningless come out NaN, the
other rows are exact (flash_msa.guard).

The value checks that read ``cu_seqlens``/``indices``/``q_map`` run on CPU tensors; on GPU
tensors and under ``torch.compile`` they do not (a host sync), and the device-side guard takes
over. These tests turn the value checks off on CPU (``api._value_checks``) to run that path on
the torch backend and on the Triton interpreter. Without the guard, the first case aborts the
process with heap corruption on the interpreter (an out-of-bounds write on a GPU).

One NaN rule on every backend (docs/design.md, "Bad input"), the torch reference against the
Triton interpreter; tests/api/test_bad_input.py compares the GPU kernels, CuTe included.

A NaN in q, k or v makes NaN the rows that attend it (the Triton kernels' P V tile also the
earlier rows of a NaN value's block); a NaN proxy score counts as -inf in its block's maximum,
so the selections agree; a NaN in a proxy input makes the KL NaN. The value checks (which
refuse non-finite inputs on CPU) are off, as on a GPU.

Bad metadata and NaN inputs on the GPU backends: compute-sanitizer's memcheck finds no
out-of-bounds access whatever ``cu_seqlens``, ``max_seqlen``, ``indices`` and ``q_map`` hold, the
rows the metadata makes meaningless are NaN and the others equal the well-formed call's; and
every backend follows one NaN rule (docs/design.md, "Bad input").

The CPU twin of the metadata cases is tests/api/test_bad_input.py; this file runs them where the
value checks are off by default (GPU tensors) and the kernels are the CuTe and Triton ones.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flash_msa
from flash_msa import api
from harness import marked

T, H, HKV, D, HP, DP, BLOCK, TOP_K = 150, 4, 2, 32, 2, 32, 64, 2

# (cu_seqlens, max_seqlen, the rows whose sequence is well formed: (start, end) or None)
CASES = {
    "past_the_tokens": ([0, 90, 170], 90, (0, 90)),
    "longer_than_max_seqlen": ([0, 50, 150], 60, (0, 50)),
    "not_starting_at_0": ([10, 90, 150], 90, (90, 150)),
    "decreasing": ([0, 100, 60, 150], 100, (0, 100)),
    "short_of_the_tokens": ([0, 100], 100, (0, 100)),
}


@pytest.fixture
def unchecked(monkeypatch):
    """The GPU default on CPU: the API reads no metadata values."""
    monkeypatch.setattr(api, "_value_checks", lambda device: False)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(T, HP, DP), (T, HP, DP), (T, H, D), (T, HKV, D), (T, HKV, D)]
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _msa(xs, cu, max_seqlen, **kw):
    cu = torch.tensor(cu, dtype=torch.int32)
    return flash_msa.msa_attention(
        *xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=max_seqlen, **kw
    )


def _alone(xs, start, end):
    """The well-formed sequence ``[start, end)`` as its own call (checked metadata)."""
    part = [x.detach()[start:end] for x in xs]
    return _msa(part, [0, end - start], end - start)[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_cu_seqlens_gives_nan_rows_and_exact_others(unchecked, monkeypatch, backend, case):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    cu, max_seqlen, good = CASES[case]
    xs = _inputs()
    out, kl = _msa(xs, cu, max_seqlen)
    start, end = good
    bad_rows = torch.ones(T, dtype=torch.bool)
    bad_rows[start:end] = False
    assert out[bad_rows].isnan().all(), "a row of a malformed sequence is not NaN"
    assert math.isnan(kl.item())
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    torch.testing.assert_close(out[start:end], _alone(xs, start, end), atol=1e-5, rtol=1e-5)
    # the backward runs over the same safe metadata: the well-formed sequence's gradients are
    # finite (a dropped row's are NaN: its out is NaN where the backward reads it)
    (out.nan_to_num(0.0).sum() + kl.nan_to_num(0.0)).backward()
    for x in xs:
        assert x.grad is not None and torch.isfinite(x.grad[start:end]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_indices_give_nan_rows_and_exact_others(unchecked, monkeypatch, backend):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    q, k, v = (x.detach().requires_grad_() for x in _inputs()[2:])
    b = 1
    idx = torch.full((1, T, b, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = torch.arange(T) // BLOCK  # the own block: well formed
    bad = {3: [2**31 - 1, -1], 70: [-2, -1], 100: [1, 0], 120: [-1, 1], 140: [3, -1]}
    for row, entries in bad.items():
        idx[0, row, 0] = torch.tensor(entries, dtype=torch.int32)
    q, k, v = q[None], k[None], v[None]
    out = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK)
    rows = torch.tensor(sorted(bad))
    assert out[0, rows].isnan().all()
    good = torch.ones(T, dtype=torch.bool)
    good[rows] = False
    clean = idx.clone()
    clean[0, rows, 0] = torch.stack([rows // BLOCK, torch.full_like(rows, -1)], 1).int()
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    want = flash_msa.sparse_attention(q.detach(), k.detach(), v.detach(), clean, block_size=BLOCK)
    torch.testing.assert_close(out[0, good], want[0, good], atol=1e-5, rtol=1e-5)


def test_bad_q_map_entries_become_nan_rows(unchecked):
    xs = [x.detach() for x in _inputs()]
    q_map = torch.arange(T, dtype=torch.int32)
    q_map[[5, 60]] = torch.tensor([T, -7], dtype=torch.int32)
    q_map[7] = -1  # a padding row: 0, as documented
    cu = torch.tensor([0, 80, T], dtype=torch.int32)
    out, kl = api._msa_attention(
        *xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=80, q_map=q_map
    )
    assert out[[5, 60]].isnan().all() and math.isnan(kl.item())
    assert (out[7] == 0).all()
    others = torch.ones(T, dtype=torch.bool)
    others[[5, 60]] = False
    assert torch.isfinite(out[others]).all()


def test_select_blocks_empties_rows_of_bad_sequences(unchecked):
    qp, kp = (x.detach() for x in _inputs()[:2])
    cu = torch.tensor([0, 90, 170], dtype=torch.int32)
    idx = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90)
    assert (idx[90:] == -1).all()  # no own block: the mark of a dropped row
    assert (idx[:90, :, 0] == 0).all()


def test_bad_cu_seqlens_under_torch_compile_gives_nan_rows():
    """Traced calls never read values: the guard is in the graph (aot_eager on CPU)."""
    xs = [x.detach() for x in _inputs()]
    cu = torch.tensor([10, 90, T], dtype=torch.int32)

    def f(*a):
        return flash_msa.msa_attention(*a, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90)

    torch._dynamo.reset()
    out, kl = torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)
    assert out[:90].isnan().all() and math.isnan(kl.item())
    torch.testing.assert_close(out[90:], _alone(xs, 90, T), atol=1e-5, rtol=1e-5)


def test_debug_mode_asserts_on_the_device_under_torch_compile(monkeypatch):
    monkeypatch.setenv("FLASH_MSA_DEBUG", "1")
    xs = [x.detach() for x in _inputs()]
    cu = torch.tensor([0, 90, 170], dtype=torch.int32)

    def f(*a):
        return flash_msa.msa_attention(*a, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90)

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="cu_seqlens/max_seqlen are not well formed"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)


def test_max_seqlen_above_the_tokens_is_refused():
    xs = [x.detach() for x in _inputs()]
    with pytest.raises(ValueError, match=r"max_seqlen \(1000000000\) is larger than the total"):
        _msa(xs, [0, 60, T], 10**9)


@pytest.mark.parametrize(
    "name, value", [("softmax_scale", 1e39), ("proxy_scale", 3e38), ("softmax_scale", 1e-46)]
)
def test_scales_outside_float32_are_refused(name, value):
    xs = [x.detach() for x in _inputs()]
    with pytest.raises(ValueError, match=name):
        _msa(xs, [0, T], T, **{name: value})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_past_the_last_offset_leave_warmup_gradients_exact(
    unchecked, monkeypatch, backend, deterministic
):
    """``cu_seqlens`` ending short of the tokens (a batch padded at its end), dense warmup: the
    sequence's gradients equal its own call's (no list or store reaches the rows past the end;
    the deterministic backward's buffers are zeros there, not uninitialized memory)."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    xs = _inputs()
    out, kl = _msa(xs, [0, 100], 100, warmup=True, deterministic=deterministic)
    assert out[100:].isnan().all() and math.isnan(kl.item())
    (out.nan_to_num(0.0).sum() + kl.nan_to_num(0.0)).backward()
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    part = [x.detach()[:100].requires_grad_() for x in xs]
    o2, _ = _msa(part, [0, 100], 100, warmup=True, deterministic=deterministic)
    o2.sum().backward()
    for x, y in zip(xs[2:], part[2:]):  # the main gradients (the KL's weight is 0 here)
        torch.testing.assert_close(x.grad[:100], y.grad, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(x.grad[100:]).all()


def test_causal_blocks_of_rows_past_the_last_offset_are_empty():
    from flash_msa import worklist

    cu = torch.tensor([0, 100], dtype=torch.int32)
    rows = worklist.causal_blocks(cu, BLOCK, 100, 2, T)
    assert (rows[100:] == -1).all() and (rows[:100, :, 0] == 0).all()


def test_fp8_selection_with_rows_past_the_last_offset(unchecked, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    qp, kp = (x.detach() for x in _inputs()[:2])
    cu = torch.tensor([0, 100], dtype=torch.int32)
    idx = flash_msa.select_blocks(
        qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=100,
        selection_precision="fp8",
    )  # fmt: skip
    assert (idx[100:] == -1).all() and (idx[:100, :, 0] == 0).all()


def test_inference_mode(unchecked):
    xs = [x.detach() for x in _inputs()]
    with torch.inference_mode():
        cu = torch.tensor([0, 90, 170], dtype=torch.int32)
        out, _ = _msa(xs, cu.tolist(), 90)
    assert out[90:].isnan().all() and torch.isfinite(out[:90]).all()


# the NaN-rule case's shape (prefixed: the bad-metadata cases above have their own T, H, ...)
N_T, N_H, N_HKV, N_HP, N_HPK, N_D, N_DP, N_BLOCK = 256, 4, 2, 2, 1, 16, 16, 64
NAN_AT = {  # input, token, head
    "q": ("q", 100, 1),
    "k": ("k", 70, 1),
    "v": ("v", 70, 1),
    "k_proxy": ("kp", 70, 0),
    "q_proxy": ("qp", 200, 1),
}


def _inputs_nan_rule(where):
    g = torch.Generator().manual_seed(0)
    shapes = dict(
        qp=(N_T, N_HP, N_DP),
        kp=(N_T, N_HPK, N_DP),
        q=(N_T, N_H, N_D),
        k=(N_T, N_HKV, N_D),
        v=(N_T, N_HKV, N_D),
    )
    xs = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    name, token, head = NAN_AT[where]
    xs[name][token, head, 3] = float("nan")
    return list(xs.values())


def _run(backend, xs, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    cu = torch.tensor([0, 160, N_T], dtype=torch.int32)
    kw = dict(block_size=N_BLOCK, cu_seqlens=cu, max_seqlen=160)
    idx = flash_msa.select_blocks(xs[0], xs[1], 2, **kw)
    out, kl = flash_msa.msa_attention(*xs, 2, **kw)
    return idx, out.isnan().any(-1), kl


@pytest.mark.parametrize("where", sorted(NAN_AT))
def test_torch_and_triton_follow_one_nan_rule(where, monkeypatch):
    monkeypatch.setattr(api, "_value_checks", lambda device: False)
    xs = _inputs_nan_rule(where)
    idx_t, nan_t, kl_t = _run("torch", xs, monkeypatch)
    idx, nan, kl = _run("triton", xs, monkeypatch)
    assert torch.equal(idx, idx_t), "the selections differ"
    if where == "v":
        token = NAN_AT["v"][1]
        assert (nan | ~nan_t).all(), "triton misses a row that attends the NaN value"
        assert not nan[: token - token % N_BLOCK].any() and not nan[160:].any()
    else:
        assert torch.equal(nan, nan_t)
    assert nan_t.any() == (where in ("q", "k", "v"))
    assert kl.isnan().item() == kl_t.isnan().item()
    if where in ("k_proxy", "q_proxy"):
        assert kl_t.isnan()


MARKS_GPU_BAD_METADATA = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the child: every malformed case through the public API on FLASH_MSA_BACKEND, forward and
# backward; one JSON line per case, then the op -> backend map it ran on
_CHILD = r"""
import json, math, sys
import torch
import flash_msa

T, H, HKV, HP, HPK, D, DP, BLOCK, TOP_K = 1100, 16, 2, 4, 1, 128, 128, 128, 4
CASES = {  # cu_seqlens, max_seqlen, the one well-formed sequence (or None)
    "past_the_tokens": ([0, 700, 1500], 800, (0, 700)),
    "longer_than_max_seqlen": ([0, 300, 1100], 500, (0, 300)),
    "not_starting_at_0": ([100, 600, 1100], 600, (600, 1100)),
    "decreasing": ([0, 700, 400, 1100], 700, (0, 700)),
    "garbage": ([0, -5, 2**31 - 1], 1100, None),
    "short_of_the_tokens": ([0, 900], 900, (0, 900)),
}
g = torch.Generator(device="cuda").manual_seed(0)
def rnd(*s):
    return torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)
xs = [rnd(T, HP, DP), rnd(T, HPK, DP), rnd(T, H, D), rnd(T, HKV, D), rnd(T, HKV, D)]

def msa(inputs, cu, ms, **kw):
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return flash_msa.msa_attention(*inputs, TOP_K, block_size=BLOCK, cu_seqlens=cu,
                                   max_seqlen=ms, **kw)

def report(case, ok, **more):
    print(json.dumps(dict(case=case, ok=bool(ok), **more)), flush=True)

RUNS = [(case, {}) for case in CASES]
RUNS += [(case, {"warmup": True}) for case in ("past_the_tokens", "short_of_the_tokens")]
for case, kw in RUNS:
    cu, ms, good = CASES[case]
    inputs = [x.clone().requires_grad_() for x in xs]
    out, kl = msa(inputs, cu, ms, **kw)
    (out.float().nan_to_num(0.0).sum() + kl.nan_to_num(0.0)).backward()
    torch.cuda.synchronize()
    bad = torch.ones(T, dtype=torch.bool, device="cuda")
    err, grads_finite = 0.0, True
    if good is not None:  # (a dropped row's gradients are NaN: its out is)
        s, e = good
        bad[s:e] = False
        alone = msa([x[s:e] for x in xs], [0, e - s], e - s, **kw)[0]
        err = (out[s:e].float() - alone.float()).abs().max().item()
        grads_finite = all(bool(torch.isfinite(x.grad[s:e]).all()) for x in inputs)
    ok = out[bad].isnan().all() and math.isnan(kl.item()) and err <= 2e-2 and grads_finite
    report(case + (" warmup" if kw else ""), ok, err=err, grads_finite=grads_finite)

# select_blocks: the dropped rows come back empty (all -1)
cu = torch.tensor([0, 700, 1500], dtype=torch.int32, device="cuda")
idx = flash_msa.select_blocks(xs[0], xs[1], TOP_K, block_size=BLOCK, cu_seqlens=cu,
                              max_seqlen=800)
own = (torch.arange(700, device="cuda") // BLOCK)[:, None, None]
report("select_blocks", (idx[700:] == -1).all() and (idx[:700] == own).any(-1).all())

# sparse_attention: ill-formed index rows are NaN, the others exact
q, k, v = (x[None].clone().requires_grad_() for x in xs[2:])
idx = torch.full((1, T, HP, 2), -1, dtype=torch.int32, device="cuda")
idx[0, :, :, 0] = (torch.arange(T, device="cuda") // BLOCK)[:, None].int()
rows = [3, 300, 500, 700, 1000]
for row, entries in zip(rows, ([2**31 - 1, -1], [-2, -1], [1, 0], [-1, 1], [9, -1])):
    idx[0, row, 1] = torch.tensor(entries, dtype=torch.int32)
out = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK)
out.float().nan_to_num(0.0).sum().backward()
clean = idx.clone()
clean[0, rows, 1] = torch.tensor([[r // BLOCK, -1] for r in rows], dtype=torch.int32,
                                 device="cuda")
want = flash_msa.sparse_attention(q.detach(), k.detach(), v.detach(), clean, block_size=BLOCK)
G = H // HP  # main heads per index head: head 1's are 4..7
nan_ok = out[0, rows, G : 2 * G].isnan().all()
keep = torch.ones(T, H, dtype=torch.bool, device="cuda")
keep[rows, G : 2 * G] = False
err = (out[0][keep].float() - want[0][keep].float()).abs().max().item()
report("sparse_attention_indices", nan_ok and err <= 2e-2, err=err)

# q_map entries out of range: NaN rows, the rest finite
qm = torch.arange(T, dtype=torch.int32, device="cuda")
qm[[5, 600]] = torch.tensor([T, -7], dtype=torch.int32, device="cuda")
cu = torch.tensor([0, 500, T], dtype=torch.int32, device="cuda")
out, kl = flash_msa.api._msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu,
                                       max_seqlen=600, q_map=qm)
others = torch.ones(T, dtype=torch.bool, device="cuda")
others[[5, 600]] = False
report("q_map", out[[5, 600]].isnan().all() and torch.isfinite(out[others]).all())
torch.cuda.synchronize()
print("sanitized run done", flush=True)
"""


def _tool():
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.skip("compute-sanitizer is not installed")
    return tool


@marked(MARKS_GPU_BAD_METADATA)
@pytest.mark.parametrize("backend", ["cute", "triton"])
def test_bad_metadata_under_memcheck(backend):
    """memcheck over every malformed case, forward and backward: 0 errors, every case's rows as
    the rule says."""
    if backend == "cute":
        pytest.importorskip("cutlass")
    env = dict(os.environ, FLASH_MSA_BACKEND=backend, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        # (API errors off: the DSL's driver probes return CUDA_ERROR_INVALID_VALUE by design)
        [_tool(), "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "3",
         sys.executable, "-c", _CHILD],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    log = run.stdout + run.stderr
    print(log)
    assert run.returncode == 0 and "sanitized run done" in log, log[-6000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-6000:]
    cases = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(cases) == 11 and all(c["ok"] for c in cases), cases


# ---------------------------------------------------------------------------------------------
# one NaN rule
# ---------------------------------------------------------------------------------------------
def _nan_case(where, seed=0):
    torch.manual_seed(seed)
    T, H, HKV, HP, HPK, D, DP = 600, 16, 2, 4, 1, 128, 128
    shapes = dict(qp=(T, HP, DP), kp=(T, HPK, DP), q=(T, H, D), k=(T, HKV, D), v=(T, HKV, D))
    xs = {n: torch.randn(*s, device="cuda", dtype=torch.bfloat16) for n, s in shapes.items()}
    name, token, head = where
    xs[name][token, head, 5] = float("nan")
    return list(xs.values())


NAN_AT_gpu_bad_metadata = {
    "q": ("q", 300, 3),
    "k": ("k", 140, 1),
    "v": ("v", 140, 1),
    "k_proxy": ("kp", 140, 0),
    "q_proxy": ("qp", 450, 2),
}


def _run_gpu_bad_metadata(backend, xs, monkeypatch):
    import flash_msa

    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    cu = torch.tensor([0, 400, 600], dtype=torch.int32, device="cuda")
    idx = flash_msa.select_blocks(xs[0], xs[1], 2, block_size=64, cu_seqlens=cu, max_seqlen=400)
    out, kl = flash_msa.msa_attention(*xs, 2, block_size=64, cu_seqlens=cu, max_seqlen=400)
    return idx, out.isnan().any(-1), kl


def _keep_block(idx, token, kv_head, H=16, HKV=2, block=64):
    """bool ``(T, H)``: the (row, head) pairs of kv head ``kv_head`` that keep ``token``'s
    block (``idx`` ``(T, Hs, K)``), in its sequence (the first, 400 tokens)."""
    T, Hs = idx.shape[:2]
    kept = (idx == token // block).any(-1)  # (T, Hs)
    kept = kept.repeat_interleave(H // Hs, dim=1)
    heads = torch.arange(H, device=idx.device) // (H // HKV) == kv_head
    return kept & heads[None, :] & (torch.arange(T, device=idx.device) < 400)[:, None]


@marked(MARKS_GPU_BAD_METADATA)
@pytest.mark.parametrize("where", sorted(NAN_AT_gpu_bad_metadata))
def test_backends_follow_one_nan_rule(where, monkeypatch):
    """A NaN in q, k or v makes NaN the rows that attend it; a NaN proxy score is never what
    selects a block (the selections agree); the KL is NaN whenever a proxy input is."""
    pytest.importorskip("cutlass")
    xs = _nan_case(NAN_AT_gpu_bad_metadata[where])
    runs = {be: _run_gpu_bad_metadata(be, xs, monkeypatch) for be in ("torch", "triton", "cute")}
    idx_t, nan_t, kl_t = runs["torch"]
    for be in ("triton", "cute"):
        idx, nan, kl = runs[be]
        assert torch.equal(idx, idx_t), f"{be} selects other blocks than torch"
        if where == "v":  # the GPU kernels' P.V tile: earlier rows of the key's block too
            assert (nan | ~nan_t).all(), f"{be} misses a NaN row"
            assert not (nan & ~_keep_block(idx, *NAN_AT_gpu_bad_metadata["v"][1:])).any(), (
                f"{be}: NaN too far"
            )
        else:
            assert torch.equal(nan, nan_t), f"{be}: other NaN rows than torch"
        assert kl.isnan().item() == kl_t.isnan().item()
    assert nan_t.any() == (where in ("q", "k", "v"))
