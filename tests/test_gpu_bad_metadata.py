"""Bad metadata and NaN inputs on the GPU backends: compute-sanitizer's memcheck finds no
out-of-bounds access whatever ``cu_seqlens``, ``max_seqlen``, ``indices`` and ``q_map`` hold, the
rows the metadata makes meaningless are NaN and the others equal the well-formed call's; and
every backend follows one NaN rule (docs/design.md, "Bad input").

The CPU twin of the metadata cases is tests/test_bad_metadata.py; this file runs them where the
value checks are off by default (GPU tensors) and the kernels are the CuTe and Triton ones.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
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


NAN_AT = {
    "q": ("q", 300, 3),
    "k": ("k", 140, 1),
    "v": ("v", 140, 1),
    "k_proxy": ("kp", 140, 0),
    "q_proxy": ("qp", 450, 2),
}


def _run(backend, xs, monkeypatch):
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


@pytest.mark.parametrize("where", sorted(NAN_AT))
def test_backends_follow_one_nan_rule(where, monkeypatch):
    """A NaN in q, k or v makes NaN the rows that attend it; a NaN proxy score is never what
    selects a block (the selections agree); the KL is NaN whenever a proxy input is."""
    pytest.importorskip("cutlass")
    xs = _nan_case(NAN_AT[where])
    runs = {be: _run(be, xs, monkeypatch) for be in ("torch", "triton", "cute")}
    idx_t, nan_t, kl_t = runs["torch"]
    for be in ("triton", "cute"):
        idx, nan, kl = runs[be]
        assert torch.equal(idx, idx_t), f"{be} selects other blocks than torch"
        if where == "v":  # the GPU kernels' P.V tile: earlier rows of the key's block too
            assert (nan | ~nan_t).all(), f"{be} misses a NaN row"
            assert not (nan & ~_keep_block(idx, *NAN_AT["v"][1:])).any(), f"{be}: NaN too far"
        else:
            assert torch.equal(nan, nan_t), f"{be}: other NaN rows than torch"
        assert kl.isnan().item() == kl_t.isnan().item()
    assert nan_t.any() == (where in ("q", "k", "v"))
