"""Rewrite benchmarks/results/: every workload of docs/performance.md, one file name each.

Usage (from the repository root, on the GPU host)::

    python benchmarks/run_all.py                    # every workload this machine can run
    python benchmarks/run_all.py --only step-anchor-16k select-paper-128k-long-1m
    python benchmarks/run_all.py --list             # names, GPUs and commands; runs nothing

Each workload runs as a subprocess with ``PYTHONPATH=src`` (the tree's code, not an installed
copy). Its stdout and stderr go to ``benchmarks/results/<hardware>/<name>.log`` and, where the
command writes JSON, to ``<name>.json`` next to it; ``<hardware>`` is the GPU's name in lower
case without spaces (``h200``), followed by ``x<N>`` for workloads on N GPUs (``h200x2``). A
file of a workload that fails is left as the failed run wrote it, and the script exits 1
after the others ran. A workload that needs more GPUs than the machine has is skipped, and
says so. docs/performance.md quotes these files: update its tables from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shlex
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
BENCH = [PY, "-m", "flash_msa", "bench", "--backends", "cute", "--inputs", "random"]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    argv: tuple[str, ...]
    json_flag: str | None = "--json"  # the flag that takes the JSON path, None: log only
    gpus: int = 1
    timeout_s: int = 1800


def _bench(args: str) -> tuple[str, ...]:
    """``flash-msa bench`` on the CuTe backend, random inputs, with these arguments."""
    return (*BENCH, *args.split())


def _script(args: str) -> tuple[str, ...]:
    """A Python script or module of the tree (``benchmarks/...``, ``-m pytest ...``)."""
    return (PY, *args.split())


def _cp(name: str, ranks: int, seqlen: int, variants: str) -> Workload:
    """A context-parallel step on the paper heads (benchmarks/cp_bench.py, NCCL)."""
    args = f"--shape paper --seqlen {seqlen} --iters 3 --warmup 1 --variants {variants}"
    launch = (PY, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks))
    argv = (*launch, "benchmarks/cp_bench.py", *args.split())
    return Workload(name, argv, json_flag="--out", gpus=2)


GPU_TEST = "-m pytest -m gpu -p no:cacheprovider"

WORKLOADS = (
    Workload(
        "step-anchor-16k",
        _bench("--shape anchor --seqlen 16384 --iters 20 --dense fa4 --cuda-graph"),
    ),
    Workload(
        "step-anchor-32k",
        _bench("--shape anchor --seqlen 32768 --iters 10 --dense fa4 --cuda-graph"),
    ),
    Workload("step-paper-128k", _bench("--shape paper --seqlen 131072 --iters 5 --dense")),
    # the dense baselines at 128K take ~3.4 s a step: their own file, rerun rarely
    Workload(
        "dense-paper-128k", _bench("--shape paper --seqlen 131072 --iters 5 --dense sdpa fa4")
    ),
    Workload("step-paper-512k", _bench("--shape paper --seqlen 524288 --iters 3 --dense")),
    # --dense with no value: no dense baseline (sdpa alone takes minutes at 1M tokens)
    Workload(
        "step-long-1m",
        _bench("--shape long --seqlen 1048576 --iters 2 --selection-precision bf16 fp8 --dense"),
    ),
    Workload(
        "select-paper-128k-long-1m",
        _script("benchmarks/select_op.py --cases paper:131072 long:1048576 --kinds random local"),
        json_flag="--out",
    ),
    Workload("warmup-cute-vs-triton", _script("benchmarks/warmup_backends.py --iters 3")),
    Workload(
        "step-deterministic",
        _script(f"{GPU_TEST} -v -s tests/ops/test_deterministic.py -k gpu_step_twice_same_bits"),
        json_flag=None,
    ),
    Workload("guard-cost", _script("benchmarks/guard_cost.py"), json_flag=None),
    # kernel-time breakdown of one CuTe training step (torch.profiler): what each kernel costs
    Workload(
        "profile-step-anchor-32k",
        _script("benchmarks/profile_step.py --shape anchor --seqlen 32768 --backend cute"),
        json_flag=None,
    ),
    Workload(
        "profile-step-paper-128k",
        _script("benchmarks/profile_step.py --shape paper --seqlen 131072 --backend cute"),
        json_flag=None,
    ),
    Workload(
        "first-step-cache",
        _script(f"{GPU_TEST} -q -s tests/integration/test_first_call_gpu.py -k first_step"),
        json_flag=None,
    ),
    # correctness evidence the docs cite: the GPU suite, and the bad-metadata cases under
    # compute-sanitizer's memcheck
    Workload("gpu-tests", _script(f"{GPU_TEST} -q -n 8 tests"), json_flag=None, timeout_s=3600),
    Workload(
        "memcheck-bad-metadata",
        _script(f"{GPU_TEST} -v tests/api/test_bad_input.py -k memcheck"),
        json_flag=None,
    ),
    # the 1-GPU row is the reference of the 2-GPU ones, measured on the same host
    _cp("cp-paper-512k-1gpu", ranks=1, seqlen=524288, variants="overlap"),
    _cp("cp-paper-512k", ranks=2, seqlen=524288, variants="overlap"),
    _cp("cp-paper-1m", ranks=2, seqlen=1048576, variants="overlap,no-overlap,collectives"),
)


def hardware(gpus: int) -> str:
    """``h200`` for the first GPU's name "NVIDIA H200" (``h200x2`` for two GPUs)."""
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    name = "".join(ch for ch in name if ch.isalnum())
    return name if gpus == 1 else f"{name}x{gpus}"


def command(w: Workload, out_dir: pathlib.Path) -> list[str]:
    argv = list(w.argv)
    if w.json_flag:
        argv += [w.json_flag, str(out_dir / f"{w.name}.json")]
    return argv


def run(w: Workload, out_dir: pathlib.Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = command(w, out_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    print(f"+ {shlex.join(argv)}  > {out_dir / w.name}.log", flush=True)
    with open(out_dir / f"{w.name}.log", "w") as log:
        log.write(f"# {shlex.join(argv)}\n")
        log.flush()
        try:
            res = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                timeout=w.timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            log.write(f"\n# timed out after {w.timeout_s} s\n")
            return 124
    return res.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [w.name for w in WORKLOADS]
    p.add_argument("--only", nargs="+", choices=names, help="run these workloads only")
    p.add_argument("--list", action="store_true", help="print the workloads and exit")
    a = p.parse_args(argv)
    chosen = [w for w in WORKLOADS if not a.only or w.name in a.only]
    if a.list:
        for w in chosen:
            print(f"{w.name} ({w.gpus} GPU{'s' * (w.gpus > 1)}): {shlex.join(w.argv)}")
        return 0
    if not torch.cuda.is_available():
        print("run_all.py needs a CUDA GPU (no result file was written)", file=sys.stderr)
        return 1
    have = torch.cuda.device_count()
    failed = []
    for w in chosen:
        if w.gpus > have:
            print(f"- {w.name}: skipped, needs {w.gpus} GPUs ({have} here)")
            continue
        rc = run(w, RESULTS / hardware(w.gpus))
        print(f"  {w.name}: {'ok' if rc == 0 else f'failed (exit {rc})'}", flush=True)
        if rc:
            failed.append(w.name)
    if failed:
        print(f"failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
