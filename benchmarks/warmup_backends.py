"""The dense warmup (``warmup=True``) on the CuTe backend against the Triton backend, side by
side in one run on the same inputs.

    PYTHONPATH=src python benchmarks/warmup_backends.py [--shapes SHAPE:S[:B] ...] [--iters 5]
        [--json FILE]

A row is one training step of :func:`flash_msa.msa_attention` with ``warmup=True`` (dense
causal main attention, KL over every visible key, in the loss: forward and the backward of all
five inputs), forced on each backend (``backends.forced("cute")`` / ``("triton")``): the CuTe
warmup is the sparse op over every causal block (``flash_msa.cute.warmup``), Triton's its dense
kernels. Each row records the largest relative difference of ``out``, ``kl`` and the five
gradients between the two (Triton's as the base: the same function up to summation order),
then the median step time (``bench.time_ms``) and the peak allocated memory of each backend
(inputs included). A CuTe refusal (a call beyond ``flash_msa.cute.warmup``'s list budget, a
GPU that is not Hopper) is recorded in ``cute_refused`` and the Triton step still timed.

A row whose difference exceeds :data:`MAX_REL_ERR`, or whose outputs are not finite, is
reported as failed and not timed; the script then exits 1. ``--json FILE`` writes
``{"env": ..., "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from flash_msa import BackendError, bench, msa_attention, testing
from flash_msa.backends import forced

NAMES = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
SHAPES = ("anchor:16384", "anchor:32768", "anchor:65536", "paper:32768")
# bf16 rounds at 2**-8 = 3.9e-3 relative; the two backends' fp32 sums in different orders
# differed by at most 5.2e-3 (a gradient, anchor 32K, H200): four times that fails a backend
# that computes something else, not one that rounds differently
MAX_REL_ERR = 2e-2


def step(leaves, dout, backend: str):
    """One warmup training step forced on ``backend``: ``(out, kl, *five gradients)``."""
    with forced(backend):
        out, kl = msa_attention(*leaves, bench.TOP_K, warmup=True, compute_kl=True)
        grads = torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))
    return (out, kl, *grads)


def rel_errs(mine, ref) -> dict:
    """``max |mine - ref| / max |ref|`` per quantity of :data:`NAMES` (NaN if not finite)."""
    errs = {}
    for name, m, r in zip(NAMES, mine, ref):
        m, r = m.detach().float(), r.detach().float()
        errs[name] = float((m - r).abs().max() / r.abs().max().clamp_min(1e-30))
    return errs


def timed(leaves, dout, backend: str, iters: int) -> tuple[float, float]:
    """``(median ms, peak GiB allocated)`` of the step on ``backend``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = bench.time_ms(lambda: step(leaves, dout, backend), iters=iters)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def row_of(spec: tuple[str, int, int], iters: int) -> dict:
    """The row of one ``(shape, S, B)``: differences first, then each backend timed."""
    shape, S, B = spec
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    leaves = [x.detach().requires_grad_() for x in xs]
    dout = torch.randn_like(leaves[2])
    row = {"shape": shape, "S": S, "B": B, "warmup": True}
    ref = step(leaves, dout, "triton")
    try:
        mine = step(leaves, dout, "cute")
    except BackendError as e:
        row["cute_refused"] = str(e)
        mine = None
    finite = all(bool(torch.isfinite(x).all()) for x in ref)
    if mine is not None:
        row["max_rel_err"] = rel_errs(mine, ref)
        finite = finite and all(bool(torch.isfinite(x).all()) for x in mine)
    del mine, ref
    errs = row.get("max_rel_err", {}).values()
    row["ok"] = finite and all(math.isfinite(e) and e <= MAX_REL_ERR for e in errs)
    if row["ok"]:
        row["triton_warmup_ms"], row["triton_peak_gib"] = timed(leaves, dout, "triton", iters)
        if "cute_refused" not in row:
            row["cute_warmup_ms"], row["cute_peak_gib"] = timed(leaves, dout, "cute", iters)
    print(json.dumps(row), flush=True)
    return row


def spec(text: str) -> tuple[str, int, int]:
    """``SHAPE:S[:B]`` (argparse type), ``B`` default 1."""
    parts = text.split(":")
    ok = 2 <= len(parts) <= 3 and parts[0] in bench.SHAPES
    ok = ok and all(p.isdigit() and int(p) > 0 for p in parts[1:])
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected SHAPE:S[:B] with SHAPE one of {', '.join(bench.SHAPES)}, got {text!r}"
        )
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", nargs="+", type=spec, default=[spec(s) for s in SHAPES],
        help=f"SHAPE:S[:B] rows (default: {' '.join(SHAPES)})",
    )  # fmt: skip
    p.add_argument("--iters", type=int, default=5, help="timed steps per backend (median)")
    p.add_argument("--json", default=None, help='write {"env", "rows"} to this file')
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        why = "warmup_backends.py needs a CUDA GPU (a Hopper one for the CuTe backend)"
        print(why, file=sys.stderr)
        return 1
    rows = []
    for s in a.shapes:
        rows.append(row_of(s, a.iters))
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": bench.environment(), "rows": rows}, f, indent=1)
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} rows failed the comparison", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
