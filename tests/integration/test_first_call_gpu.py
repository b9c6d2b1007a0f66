"""GPU test of the first-call compile time (``pytest -m gpu``; Hopper with nvidia-cutlass-dsl):
a fresh process's first training step (anchor shape, one 16K sequence, ``compute_kl=True``,
``auto`` backends: CuTe on sm_90 where it runs, Triton elsewhere) with empty caches, then in a
second process with the caches the first one wrote: the CuTe kernels are loaded from
``FLASH_MSA_CACHE_DIR`` (nothing traced or compiled) and the Triton kernels, the tile picker's
candidates included, from ``TRITON_CACHE_DIR`` (no new cache entry); and two processes starting
together on empty caches compile each CuTe kernel once between them (what 8 ranks of one node
do). Each child prints its times and its gradients' absolute sums, which the warm process must
match (the loaded kernels compute what the compiled ones did); the issue's target for the warm
first step is <= 2 s.

Run as a script (``python tests/integration/test_first_call_gpu.py S``), this file is the child: one
step on a sequence of ``S`` tokens, timed from the first op call to the gradients' synchronize, then
a second (steady-state) step; one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from harness import script_result, spawn_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]

SEQLEN = 16384  # the anchor shape of `flash-msa bench` (B, H, Hkv, Hp, Hpk, D, Dp below)


def _child(S: int) -> dict:
    t_start = time.perf_counter()
    import flash_msa

    dev = torch.device("cuda")
    torch.cuda.init()
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        x = torch.randn(1, S, *shape, device=dev, dtype=torch.bfloat16, generator=g)
        return x.requires_grad_()

    H, Hkv, Hp, Hpk, D, Dp = 16, 2, 4, 1, 128, 128  # B = 1
    inputs = (rand(Hp, Dp), rand(Hpk, Dp), rand(H, D), rand(Hkv, D), rand(Hkv, D))
    torch.cuda.synchronize()

    def step():
        out, kl = flash_msa.msa_attention(*inputs, 16, block_size=128, compute_kl=True)
        (out.float().square().mean() + kl).backward()
        torch.cuda.synchronize()

    prof = None
    if os.environ.get("FLASH_MSA_PROFILE_FIRST") == "1":  # where the warm first step goes
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    t0 = time.perf_counter()
    step()
    second = time.perf_counter() - t0
    from flash_msa.cute import disk_cache

    # what the kernels computed (two steps' gradients accumulated): a process that loaded them
    # must agree with the one that compiled them (to the atomics' reordering)
    sums = [float(x.grad.double().abs().sum()) for x in inputs]
    return dict(
        grad_abs_sums=sums,
        first_step_s=round(first, 3),
        second_step_s=round(second, 4),
        process_s=round(time.perf_counter() - t_start, 2),
        stats=dict(disk_cache.stats),
        kernels=disk_cache.events,  # (class, compiled or loaded, seconds) per CuTe kernel
        profile=None if prof is None else _top(prof),
    )


def _top(prof, n: int = 30) -> list[str]:
    """The ``n`` entries of a cProfile with the most cumulative time, one line each."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-n:]


def _spawn(tmp_path, S=SEQLEN, **env) -> subprocess.Popen:
    return spawn_script(
        __file__, [S], FLASH_MSA_CACHE_DIR=str(tmp_path / "flash_msa"), FLASH_MSA_CACHE="1",
        TRITON_CACHE_DIR=str(tmp_path / "triton"), FLASH_MSA_BACKEND="auto", **env,
    )  # fmt: skip


def _result(p: subprocess.Popen) -> dict:
    return script_result(p)


def _triton_entries(tmp_path) -> set:
    return {p.relative_to(tmp_path) for p in (tmp_path / "triton").rglob("*") if p.is_file()}


def test_second_process_first_step_is_warm(tmp_path):
    pytest.importorskip("cutlass")
    cold = _result(_spawn(tmp_path))
    print("cold:", cold)
    assert cold["stats"].get("compiled", 0) > 0 and cold["stats"].get("stored", 0) > 0, cold
    triton_before = _triton_entries(tmp_path)
    warm = _result(_spawn(tmp_path))
    print("warm:", warm)
    profiled = _result(_spawn(tmp_path, FLASH_MSA_PROFILE_FIRST="1"))  # a third, profiled one
    print(f"warm first step under cProfile: {profiled['first_step_s']:.2f} s; by cumulative time:",
          *profiled["profile"], sep="\n  ")  # fmt: skip
    print(f"first step: cold {cold['first_step_s']:.1f} s, warm {warm['first_step_s']:.2f} s")
    assert warm["stats"] == {"loaded": cold["stats"]["compiled"]}, warm  # nothing compiled
    new = _triton_entries(tmp_path) - triton_before
    assert not new, f"the warm process compiled Triton kernels: {sorted(map(str, new))[:10]}"
    assert warm["first_step_s"] < cold["first_step_s"]
    # the loaded kernels compute what the compiled ones did (q_proxy, k_proxy, q, k, v)
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), cold["grad_abs_sums"],
                          warm["grad_abs_sums"]):  # fmt: skip
        assert a > 0 and abs(a - b) <= 1e-3 * a, (name, a, b)


def test_ranks_starting_together_compile_once(tmp_path):
    pytest.importorskip("cutlass")
    S = 4096  # smaller: the kernels are the same (sequence lengths are run-time values)
    ranks = [_result(p) for p in [_spawn(tmp_path, S) for _ in range(2)]]
    print("ranks:", ranks)
    compiled = sum(r["stats"].get("compiled", 0) for r in ranks)
    loaded = sum(r["stats"].get("loaded", 0) for r in ranks)
    assert compiled == ranks[0]["stats"].get("compiled", 0) + ranks[0]["stats"].get("loaded", 0)
    assert compiled == loaded, ranks  # each kernel: one rank compiled it, the other loaded it


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]))), flush=True)
