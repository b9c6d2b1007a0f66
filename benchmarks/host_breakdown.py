"""Where the host time of one eager training step goes, function by function (no profiler).

PYTHONPATH=src python3 benchmarks/host_breakdown.py [--seqlen 16384] [--kl] [--steps 20]
[--launch-ab]

Wraps the step's host functions (the work-list build, the CuTe stages and their launch path,
the backward's glue) with ``perf_counter`` timers, wherever a module holds them by name, and
runs ``--steps`` eager anchor steps (``torch.autograd.grad``, as ``flash-msa bench``) after
three warm-ups. Prints one JSON line: per function the calls per step and the inclusive host
microseconds per step (median over steps; nested functions count in their callers too), the
step's host enqueue time and its CUDA-event time. The launches are asynchronous and the step
has no host sync, so a function's time is its host cost, not the GPU's.

``--launch-ab``: the host cost of one CuTe launch (the row-delta kernel on 64 rows, so the GPU
never waits) through ``launch.run_typed`` (the DSL's executor, typed pointers) against the same
kernel compiled with ``--enable-tvm-ffi`` and called with plain ints (device addresses, the row
count, the stream handle); the two outputs must be bitwise equal.
"""

import argparse
import functools
import json
import statistics
import sys
import time

import torch

import flash_msa
from flash_msa import bench, testing

TARGETS = {
    "flash_msa.api": ["msa_attention"],
    "flash_msa.sparse_forward": ["fwd", "one_sort"],
    "flash_msa.worklist": ["blocks", "lists", "items", "chunk_items", "carry", "carried"],
    "flash_msa.cute.selection": ["select_into"],
    "flash_msa.cute.forward": ["partials", "combine"],
    "flash_msa.cute.backward": ["bwd", "bwd_delta", "zero_buffers", "scaled"],
    "flash_msa.cute.launch": ["run_typed", "pointer_arguments", "stream"],
    "flash_msa.backends": ["resolve"],
}

TIMES: dict = {}


def wrap_everywhere():
    """Replace every target function by a timing wrapper in every loaded flash_msa module that
    holds it by name (``from .common import run_typed`` included)."""
    import importlib

    for mod in TARGETS:
        importlib.import_module(mod)
    originals = {}
    for mod, names in TARGETS.items():
        m = sys.modules[mod]
        for n in names:
            f = getattr(m, n, None)
            if callable(f):
                originals[id(f)] = (f"{mod.split('.')[-1]}.{n}", f)
    wrappers = {}
    for key, (label, f) in originals.items():

        @functools.wraps(f)
        def w(*a, __f=f, __label=label, **k):
            t0 = time.perf_counter()
            try:
                return __f(*a, **k)
            finally:
                TIMES.setdefault(__label, []).append(time.perf_counter() - t0)

        wrappers[key] = w
    for name, m in list(sys.modules.items()):
        if not name.startswith("flash_msa") or m is None:
            continue
        for attr, v in list(vars(m).items()):
            if callable(v) and id(v) in wrappers:
                setattr(m, attr, wrappers[id(v)])


def step_breakdown(seqlen: int, kl: bool, steps: int) -> dict:
    B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES["anchor"]
    xs = testing.make_inputs(B, seqlen, H, Hkv, Hp, Hpk, D, Dp, device="cuda", requires_grad=True)
    dout = torch.randn_like(xs[2])

    def step():
        out, kl_ = flash_msa.msa_attention(*xs, bench.TOP_K, compute_kl=kl)
        torch.autograd.grad([out, kl_], xs, [dout, torch.ones_like(kl_)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wrap_everywhere()
    step()
    torch.cuda.synchronize()
    per_step, host, gpu = [], [], []
    for _ in range(steps):
        TIMES.clear()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        step()
        e1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        gpu.append(e0.elapsed_time(e1))
        per_step.append({k: (len(v), sum(v) * 1e6) for k, v in TIMES.items()})
    names = sorted({k for s in per_step for k in s})
    funcs = {
        n: dict(
            calls=statistics.median(s.get(n, (0, 0))[0] for s in per_step),
            us=round(statistics.median(s.get(n, (0, 0.0))[1] for s in per_step), 1),
        )
        for n in names
    }
    return dict(
        seqlen=seqlen, kl=kl, host_ms=round(statistics.median(host), 3),
        gpu_ms=round(statistics.median(gpu), 3), functions=funcs,
    )  # fmt: skip


def launch_ab(reps: int = 2000) -> dict:
    """Host microseconds per launch of the row-delta kernel: run_typed vs TVM-FFI."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from flash_msa.cute import backward, common, launch
    from flash_msa.cute.row_delta_sm90 import RowDeltaSm90

    T, H, D = 4, 16, 128
    dout = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.randn_like(dout)
    ref = backward.bwd_delta(dout, out)
    torch.cuda.synchronize()

    def per_call(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best.append((time.perf_counter() - t0) / reps * 1e6)
            torch.cuda.synchronize()
        return round(min(best), 2)

    res = dict(delta_path_us=per_call(lambda: backward.bwd_delta(dout, out)))
    kernel = RowDeltaSm90(common.cutlass_dtype(dout.dtype), D, RowDeltaSm90.warps,
                          RowDeltaSm90.unroll)  # fmt: skip
    dst = torch.empty((T, H), dtype=torch.float32, device="cuda")
    args = backward.row_delta_arguments(
        kernel, dout.data_ptr(), out.data_ptr(), dst.data_ptr(), T * H, launch.stream(dout.device)
    )
    key = next(k for k in launch._compiled if k[1] == kernel)
    fn = launch._compiled[key]
    res["executor_call_us"] = per_call(lambda: fn(*args))
    res["run_typed_us"] = per_call(
        lambda: launch.run_typed(kernel, dout.device, args, backward.ROW_DELTA_SIGNATURE)
    )
    spec = backward.row_delta_arguments(kernel, 1 << 20, 1 << 20, 1 << 20, 1, make_fake_stream())
    t0 = time.perf_counter()
    tvm = cute.compile(kernel, *spec, options="--enable-tvm-ffi")
    res["tvm_compile_s"] = round(time.perf_counter() - t0, 2)
    dst2 = torch.full((T, H), float("nan"), device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    ints = (dout.data_ptr(), out.data_ptr(), dst2.data_ptr(), T * H, s)
    tvm(*ints)
    torch.cuda.synchronize()
    res["tvm_bitwise_equal"] = bool(torch.equal(dst2, ref))
    res["tvm_call_us"] = per_call(lambda: tvm(*ints))
    res["tvm_call_with_ptrs_us"] = per_call(
        lambda: tvm(dout.data_ptr(), out.data_ptr(), dst2.data_ptr(), T * H,
                    torch.cuda.current_stream().cuda_stream)  # fmt: skip
    )
    x = torch.randn(64, device="cuda")
    res["torch_add_us"] = per_call(lambda: torch.add(x, 1.0))
    res["torch_empty_us"] = per_call(lambda: torch.empty((T, H), device="cuda"))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--kl", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--launch-ab", action="store_true")
    args = ap.parse_args()
    if args.launch_ab:
        print(json.dumps(dict(launch_ab=launch_ab())), flush=True)
    print(json.dumps(step_breakdown(args.seqlen, args.kl, args.steps)), flush=True)


if __name__ == "__main__":
    main()
