"""Recall protocol of the fp8 selection, on the torch reference (CPU).

Usage: ``python benchmarks/fp8_recall.py [--S 4096 8192] [--seeds 0 1 2] [--kinds ...]
[--layout 16,2,4,1] [--dim 128] [--top-k 16] [--block 128] [--no-downstream | --downstream-all]
[--out FILE.jsonl]``.

For each (kind, S, seed) it builds the inputs of :func:`flash_msa.recall.make_case` and prints
one line per variant (each key scale of ``recall.VARIANTS``; bf16 against fp32): recall of the
bf16 selection (own block excluded, rows with a choice), the fraction of equal rows, the covered
main attention mass relative to the bf16 selection's and, for the shipped key scale
(``quant.KEY_SCALE``), the downstream relative errors of ``out``, ``kl`` and the five gradients.
The gates apply to the structured (``local``) kinds: recall >= 99 % and covered mass >= 99.5 %
of bf16's; ``GATE`` says whether the shipped ``fp8`` meets each there, and the exit status is 1
when it fails the mass gate (the fp8 top-k is known to fail the recall gate: docs/algorithm.md;
on a trained proxy the mass gate decides, docs/performance.md). These are the torch reference's
numbers, not a GPU kernel's (whose fp32 sums differ only in order).
"""

from __future__ import annotations

import argparse
import json
import sys

from flash_msa import quant, recall

RECALL_GATE, MASS_GATE = 0.99, 0.995


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/fp8_recall.py")
    parser.add_argument("--S", type=int, nargs="+", default=[4096])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--kinds", nargs="+", default=list(recall.KINDS), choices=recall.KINDS)
    parser.add_argument("--layout", default="16,2,4,1", help="H,Hkv,Hp,Hpk")
    parser.add_argument("--dim", type=int, default=128, help="D = Dp")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--no-downstream", action="store_true")
    parser.add_argument(
        "--downstream-all",
        action="store_true",
        help="downstream errors of bf16 vs fp32 too (slower)",
    )
    parser.add_argument("--out", help="write every result as JSON lines to this file")
    args = parser.parse_args(argv)
    layout = tuple(int(x) for x in args.layout.split(","))
    shipped = quant.KEY_SCALE
    sink = open(args.out, "w") if args.out else None  # noqa: SIM115
    failed = False
    print(f"shipped quantization: k scale per {quant.KEY_SCALE}, Hadamard rotation")
    for S in args.S:
        for kind in args.kinds:
            for seed in args.seeds:
                res = recall.measure(
                    kind,
                    S,
                    layout,
                    args.dim,
                    top_k=args.top_k,
                    block_size=args.block,
                    seed=seed,
                    with_downstream=not args.no_downstream,
                    downstream_all=args.downstream_all,
                )
                head = f"{kind:>15} S={S} seed={seed}"
                for name, m in res.items():
                    if name == "seconds":
                        continue
                    rest = " ".join(
                        f"{k}={v:.2e}"
                        for k, v in m.items()
                        if k not in ("recall", "exact_rows", "mass_ratio")
                    )
                    line = (
                        f"{head} {name:>12}: recall {100 * m['recall']:6.2f}% "
                        f"exact rows {100 * m['exact_rows']:6.2f}% "
                        f"mass {100 * m['mass_ratio']:7.3f}% {rest}"
                    )
                    print(line.rstrip(), flush=True)
                if kind.startswith("local"):
                    m = res[shipped]
                    gates = (("recall", m["recall"] >= RECALL_GATE),
                             ("mass", m["mass_ratio"] >= MASS_GATE))  # fmt: skip
                    failed |= not gates[1][1]
                    verdicts = ", ".join(f"{g} {'pass' if ok else 'FAIL'}" for g, ok in gates)
                    print(f"{head} GATE fp8 {verdicts} ({res['seconds']:.0f} s)")
                else:
                    print(f"{head} (no gate) ({res['seconds']:.0f} s)")
                if sink:
                    row = dict(kind=kind, S=S, seed=seed, layout=layout, D=args.dim)
                    row.update(top_k=args.top_k, block=args.block, shipped=shipped, results=res)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
