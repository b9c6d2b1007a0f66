"""KL-stage A/B on one GPU: the CuTe KL stage (``cute/bwd_sm90.py``: ``kl``) and the CuTe KL stage
on the forward partials' kernel (``cute/fwd_partials_sm90.py``: ``kl``, ``FwdKlSm90``; "cute
fwd-mode stage") against the Triton stage they would replace, on the same work list (the
driver's 256-token items) and final LSEs, in one run, interleaved; and the
whole CuTe forward op with the KL on Triton, on CuTe (``cute.KL_ON_CUTE``), and without it
(``compute_kl=False``).

Usage: ``python benchmarks/kl_ab.py [--out FILE.json] [--iters N] [--cases anchor:16384 ...]``.
Random inputs, top_k 16, block 128 (``bwd_ab.setup``). Before timing, each CuTe stage's sum is
compared with Triton's (relative difference; one further than ``MAX_REL_DIFF`` is reported and
not timed). Times by CUDA events (``flash_msa.bench.time_ms``), twice (A B A B); the minimum is
reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bwd_ab import run_cases, setup
from flash_msa import backends, worklist
from flash_msa.bench import time_ms

MAX_REL_DIFF = 1e-3


def case(shape: str, S: int, iters: int) -> dict:
    from flash_msa import cute
    from flash_msa.cute import bwd_sm90, fwd_partials_sm90

    cute_be, triton_be = backends.load("cute")[0], backends.load("triton")[0]
    saved, cu, cfg, _, _ = setup(shape, S)
    q, k, v, _, lse, idx, qp, kp, plse, _ = saved
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS, 0, q.shape[0])
    stage = {
        "triton stage": lambda: triton_be.forward_stages().kl(q, k, qp, kp, lse, plse, wl, cfg),
        "cute stage": lambda: bwd_sm90.kl(q, k, qp, kp, lse, plse, wl, cfg),
        "cute fwd-mode stage": lambda: fwd_partials_sm90.kl(q, k, qp, kp, lse, plse, wl, cfg),
    }
    a, b = stage["triton stage"](), stage["cute stage"]()
    c = stage["cute fwd-mode stage"]()
    rel = ((a - b).abs() / a.abs().clamp_min(1e-6)).item()
    rel_fwd = ((a - c).abs() / a.abs().clamp_min(1e-6)).item()
    sums = dict(triton=a.item(), cute=b.item(), rel_diff=rel)
    sums.update(cute_fwd_mode=c.item(), rel_diff_fwd_mode=rel_fwd)
    res = dict(shape=shape, S=S, kl_sum=sums)
    for name, r in (("cute stage", rel), ("cute fwd-mode stage", rel_fwd)):
        if not r <= MAX_REL_DIFF:
            print(f"[verify] {shape} {S}: MISMATCH {r}: {name} not timed", file=sys.stderr)
            del stage[name]
    nokl = dataclasses.replace(cfg, compute_kl=False)

    def forward(kl_on_cute: bool, conf):
        def fn():
            cute.KL_ON_CUTE = kl_on_cute
            try:
                return cute_be.fwd(q, k, v, idx, cu, conf, qp, kp)
            finally:
                cute.KL_ON_CUTE = False

        return fn

    fns = dict(stage)
    fns["fwd, KL on Triton"] = forward(False, cfg)
    if "cute stage" in stage:
        fns["fwd, KL on CuTe"] = forward(True, cfg)
    fns["fwd, compute_kl=False"] = forward(False, nokl)
    ms = {name: [] for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            ms[name].append(time_ms(fn, iters=iters))
    res["ms"] = {name: min(t) for name, t in ms.items()}
    res["ms_all"] = ms
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["anchor:16384", "anchor:32768", "paper:32768", "paper:131072"],
    )
    args = ap.parse_args(argv)
    run_cases(lambda shape, S: case(shape, S, args.iters), args.cases, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
