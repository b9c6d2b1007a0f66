"""``flash-msa info | check``: the package's command line."""

from __future__ import annotations

import argparse
import json


def _cmd_info(args) -> int:
    from .diagnostics import info

    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("versions:")
    for k, v in data["versions"].items():
        print(f"  {k:20s} {v}")
    print("environment:")
    for k, v in data["environment"].items():
        print(f"  {k:20s} {v if v is not None else '(unset)'}")
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
    from .diagnostics import check

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
    import torch

    if not torch.cuda.is_available():
        print(
            "flash-msa bench: no CUDA GPU here; timings on CPU mean nothing. Running a tiny "
            "correctness pass of the available backends instead (flash-msa check)."
        )
        return _cmd_check(argparse.Namespace(seed=0))
    from .bench import main as bench_main

    return bench_main(args)


def main(argv=None) -> int:
    from .quant import PRECISIONS

    parser = argparse.ArgumentParser(prog="flash-msa", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="versions, devices and the backend each op would use")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("check", help="check every available backend against brute force")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        nargs="+",
        choices=["cute", "triton", "torch"],
        help="check only these backends (default: all)",
    )
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("bench", help="time the backends next to dense attention (GPU)")
    p.add_argument("--shape", nargs="+", default=["anchor"], choices=["anchor", "paper", "long"])
    p.add_argument("--seqlen", nargs="+", type=int, help="override the shape's lengths")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=["cute", "triton"],
        help="default: every GPU backend that runs here",
    )
    p.add_argument("--inputs", nargs="+", default=["random", "local"], choices=["random", "local"])
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median)")
    p.add_argument(
        "--dense",
        nargs="*",
        default=["sdpa", "fa4"],
        choices=["sdpa", "fa4"],
        help="dense baselines to run next to MSA (none: --dense with no value)",
    )
    p.add_argument(
        "--selection-precision",
        nargs="+",
        default=["bf16"],
        choices=list(PRECISIONS),
        help="run each MSA backend with these selection precisions (fp8: the opt-in e4m3 "
        "selection, approximate; fp8_rerank: the fp8 top_k + 16 re-ranked exactly)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time each provider's training step (and MSA's compute_kl=False step) as the "
        "replay of one CUDA graph captured from it, after checking one replay against eager "
        "steps (columns step_graph_ms, step_nokl_graph_ms; a failed capture or check is "
        "reported in graph_error and fails the run). The eager columns are unchanged",
    )
    p.add_argument("--json", help="write results and environment to this JSON file")
    p.add_argument("--plot", help="write a log-log PNG of time vs length (needs matplotlib)")
    p.set_defaults(func=_cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)
