"""flash-msa: the command line of the flash-msa-kernels package (import package flash_msa).

  flash-msa info     versions, environment variables, backends and the backend each op uses
  flash-msa check    every available backend against an fp64 brute-force computation (CPU ok)
  flash-msa bench    time the GPU backends next to dense attention (needs a CUDA GPU)

Shapes follow msa_attention: q (B, S, H, D), k and v (B, S, Hkv, D), the proxy's q_proxy
(B, S, Hp, Dp) and k_proxy (B, S, Hpk, Dp); keys are grouped in blocks of block_size tokens and
each query keeps top_k blocks (its own included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .version import DISTRIBUTION, __version__
from .bench import SHAPES
from .bench import main as bench_main
from .diagnostics import CASES, check, info
from .quant import PRECISIONS

# Every environment variable the package reads (tests/integration/test_cli.py checks this list against the
# os.environ reads in src/), with what it does; `flash-msa info` prints each with its value.
ENV_VARS = {
    "FLASH_MSA_BACKEND": "backend for every op: auto (default: the fastest that runs the call), "
    "cute, triton or torch (a forced backend that cannot run a call raises BackendError)",
    "FLASH_MSA_DETERMINISTIC": "1/true: bitwise-reproducible outputs and gradients (ordered "
    "reductions, slower); 0/false/unset: off. A call's deterministic= keyword overrides it",
    "FLASH_MSA_DEBUG": "1: also on GPU, the input checks that read tensor values (cu_seqlens, "
    "selections; a device-to-host sync per call; always on for CPU tensors); unset/0: off",
    "FLASH_MSA_CACHE": "0: no on-disk cache of compiled CuTe kernels; unset/1: on (default)",
    "FLASH_MSA_CACHE_DIR": "directory of that cache (default $XDG_CACHE_HOME/flash_msa, i.e. "
    "~/.cache/flash_msa)",
    "FLASH_MSA_CACHE_LOCK_TIMEOUT": "seconds a process waits for another one compiling the same "
    "CuTe kernel before compiling it itself (default 60)",
    "FLASH_MSA_SMEM_LIMIT": "cap in bytes on the shared memory per block that Triton tile "
    "choices may use (default: the device's limit; for tests)",
    "FLASH_MSA_COMMIT": "commit recorded by `flash-msa bench --json` when the installed source "
    "is not a git checkout of this project",
    "TRITON_INTERPRET": "1: run the Triton kernels in Triton's CPU interpreter (slow; tests)",
    "XDG_CACHE_HOME": "base of the default CuTe kernel cache directory",
}
# read by prefix: the CuTe DSL's compile settings, part of the kernel cache's key
ENV_PREFIXES = {"CUTE_DSL_": "the CuTe DSL's own settings (part of the kernel cache key)"}


def environment() -> dict:
    """``{variable: value or None}`` for :data:`ENV_VARS`, then every set ``CUTE_DSL_*``."""
    env = {var: os.environ.get(var) for var in ENV_VARS}
    for prefix in ENV_PREFIXES:
        env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(prefix)})
    return env


def _cmd_info(args) -> int:
    data = info()
    data["environment"] = environment()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("versions:")
    for k, v in data["versions"].items():
        print(f"  {k:20s} {v}")
    print("environment (every variable flash_msa reads; value, then meaning):")
    for k, v in data["environment"].items():
        meaning = ENV_VARS.get(k) or next(m for p, m in ENV_PREFIXES.items() if k.startswith(p))
        print(f"  {k:29s} {v if v is not None else '(unset)':10s} {meaning}")
    for prefix, meaning in ENV_PREFIXES.items():
        if not any(k.startswith(prefix) for k in data["environment"]):
            print(f"  {prefix + '*':29s} {'(unset)':10s} {meaning}")
    print("backends:")
    for k, v in data["backends"].items():
        print(f"  {k:20s} {v}")
    print("declared limits per op (flash_msa.limits; irregular rules aside):")
    for k, ops in data["limits"].items():
        for op, text in ops.items():
            print(f"  {k:7s} {op:26s} {text}")
    print("op -> backend per device (anchor shape, bf16):")
    for dev, entry in data["devices"].items():
        extra = f" ({entry['name']}, {entry['capability']})" if "name" in entry else ""
        print(f"  {dev}{extra}")
        for op, choice in entry["ops"].items():
            print(f"    {op:7s} {choice['backend'] or '-':7s} {choice['why']}")
    return 0


def _cmd_check(args) -> int:
    print("flash-msa check: each backend against an independent fp64 brute-force computation")
    print(
        "(err: max |backend - exact| of a training step with O(1) gradients; tol = 2 * err of\n"
        " the torch reference in the same dtype on the same selection + the dtype's rounding)\n"
    )
    header = (
        f"{'backend':8s} {'device':7s} {'case':20s} {'quantity':26s} {'err':>9s} "
        f"{'tol':>9s}  result"
    )
    print(header)
    print("-" * len(header))
    counts = {"PASS": 0, "FAIL": 0, "NOT RUN": 0}
    said = set()
    for r in check(seed=args.seed, names=getattr(args, "backend", None)):
        counts[r["status"]] += 1
        where = f"{r['backend']:8s} {r['device']:7s}"
        if r["status"] == "NOT RUN":  # one line per backend and device: the reason
            if (r["backend"], r["device"]) not in said:
                said.add((r["backend"], r["device"]))
                print(f"{where} {'(not run)':20s} NOT RUN: {r['quantity']}")
        elif r["err"] is None:  # the backend raised
            print(f"{where} {r['case']:20s} FAIL: {r['quantity']}")
        else:
            print(
                f"{where} {r['case']:20s} {r['quantity']:26s} {r['err']:9.2e} {r['tol']:9.2e}  "
                f"{r['status']}"
            )
    print(
        f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['NOT RUN']} not run "
        "(not run = backend unavailable for that device/case; see the reason)"
    )
    if counts["PASS"] == 0:
        print("nothing was checked: no backend could run")
        return 1
    return 1 if counts["FAIL"] else 0


def _cmd_bench(args) -> int:
    if not torch.cuda.is_available():  # nothing timed, no file written: a CPU time means nothing
        print(
            "flash-msa bench: no CUDA GPU (torch.cuda.is_available() is False); bench times the "
            "GPU kernels and needs one. Nothing was run"
            + (f" and {args.json} was not written" if getattr(args, "json", None) else "")
            + ". For a correctness check on this machine run `flash-msa check`.",
            file=sys.stderr,
        )
        return 2
    return bench_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="flash-msa", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"{DISTRIBUTION} {__version__} (import package flash_msa)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,check,bench}")
    p = sub.add_parser(
        "info",
        help="versions, environment variables, backends and the backend each op would use",
        description="Print the versions of flash_msa and its dependencies, every environment "
        "variable the package reads (value and meaning), whether each backend (cute, triton, "
        "torch) can be imported and why not, each backend's declared limits, and per device the "
        "backend each op would pick for the anchor shape in bf16.",
    )
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser(
        "check",
        help="check every available backend against an fp64 brute force (CPU or GPU)",
        description="Run small training steps (forward, KL and all five gradients) of each "
        "available backend on every device here and compare them to an independent fp64 "
        "brute-force computation. Cases: "
        + "; ".join(c[0] for c in CASES)
        + ". Exit status 0 when every run check passes, 1 when one fails or none could run.",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument(
        "--backend",
        nargs="+",
        choices=["cute", "triton", "torch"],
        help="check only these backends (default: all)",
    )
    p.set_defaults(func=_cmd_check)
    shapes = "; ".join(
        f"{name}: B={B} H={H} Hkv={Hkv} Hp={Hp} Hpk={Hpk} D={D} Dp={Dp}, S in {list(lens)}"
        for name, (B, H, Hkv, Hp, Hpk, D, Dp, lens) in SHAPES.items()
    )
    p = sub.add_parser(
        "bench",
        help="time the GPU backends next to dense attention (needs a CUDA GPU)",
        description="Verify, then time on a CUDA GPU each MSA backend (selection, forward, "
        "backward, training step, peak memory) next to dense causal attention (SDPA and, when "
        "installed, FlashAttention-4) on the same inputs, bf16, block_size 128, top_k 16. "
        f"Shapes: {shapes}. Without a GPU it exits with status 2 and writes nothing.",
    )
    p.add_argument(
        "--shape",
        nargs="+",
        default=["anchor"],
        choices=list(SHAPES),
        help="head configurations to run (default: anchor)",
    )
    p.add_argument(
        "--seqlen", nargs="+", type=int, help="sequence lengths S (default: the shape's own)"
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["cute", "triton"],
        help="MSA backends to time (default: every GPU backend that runs here)",
    )
    p.add_argument(
        "--inputs",
        nargs="+",
        default=["random", "local"],
        choices=["random", "local"],
        help="input kinds: random (torch.randn everywhere) and local (proxies of cumulative "
        "sums: neighbouring queries rank blocks alike; flash_msa.testing.make_inputs); default: "
        "both",
    )
    p.add_argument("--iters", type=int, default=5, help="timed iterations, median (default 5)")
    p.add_argument(
        "--dense",
        nargs="*",
        default=["sdpa", "fa4"],
        choices=["sdpa", "fa4"],
        help="dense baselines to run next to MSA (default: sdpa fa4; none: --dense with no value)",
    )
    p.add_argument(
        "--selection-precision",
        nargs="+",
        default=["bf16"],
        choices=list(PRECISIONS),
        help="run each MSA backend with these selection precisions (default bf16, exact; fp8: "
        "the opt-in e4m3 selection, approximate)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time each provider's training step (and MSA's compute_kl=False step) as the "
        "replay of one CUDA graph captured from it, after checking one replay against eager "
        "steps (columns step_graph_ms, step_nokl_graph_ms; a failed capture or check is "
        "reported in graph_error and fails the run). The eager columns are unchanged",
    )
    p.add_argument(
        "--json",
        help="write the results and the environment (GPU, versions, flash_msa version and "
        "commit) to this JSON file",
    )
    p.add_argument("--plot", help="write a log-log PNG of time vs length (needs matplotlib)")
    p.set_defaults(func=_cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)
