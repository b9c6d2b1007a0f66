"""Row-delta A/B on one GPU: the CuTe kernel (``cute/row_delta_sm90.py``) against the torch path
``flash_msa.problem.row_delta`` it replaces in the backward (``delta = rowsum(dO * O)``).

Usage: ``python benchmarks/row_delta_ab.py [--out FILE.json] [--iters N] [--variants]
[--cases paper:131072 anchor:16384 long:1048576]``. A case is the backward's ``dout`` and
``out`` ``(T, H, D)`` bf16 of one sequence of T tokens at a shape of ``flash_msa.bench.SHAPES``
(paper: H 64; anchor and long: H 16; D 128). ``--variants``: also the kernel's other tuning
variants (``row_delta_sm90.VARIANTS``). Inputs random; every provider's result is compared
with the fp64 sum first (a provider whose error passes the harness's rule, ``2 *
err(problem.row_delta) + atol``, is reported and not timed).

Two times per provider, each the median of ``--iters`` calls, twice (A B A B), the minimum:
``ms``, CUDA events around the Python call (``flash_msa.bench.time_ms``'s method, the host
work included), and ``device ms``, the same with the GPU kept busy while the host prepares the
launch (the kernels alone). GB/s count the bytes the op must move (both inputs read once, the
fp32 delta written) by ``device ms``, next to the H200's ~4.8 TB/s HBM bound.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bwd_ab import run_cases
from combine_ab import event_ms
from flash_msa import bench, problem, testing

HBM_TBPS = 4.8


def case(shape: str, T: int, iters: int, variants: bool) -> dict:
    from flash_msa.cute import row_delta_sm90

    _, H, _, _, _, D, _, _ = bench.SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    dout = torch.randn((T, H, D), generator=g, device="cuda").to(torch.bfloat16)
    out = torch.randn((T, H, D), generator=g, device="cuda").to(torch.bfloat16)
    nbytes = 2 * dout.numel() * dout.element_size() + T * H * 4
    fns = {"torch problem.row_delta": lambda: problem.row_delta(dout, out)}
    fns["cute"] = lambda: row_delta_sm90.row_delta(dout, out)
    if variants:
        for name, tuning in row_delta_sm90.VARIANTS.items():
            fns[f"cute {name}"] = lambda tuning=tuning: row_delta_sm90.row_delta(
                dout, out, **tuning
            )
    res = dict(shape=shape, T=T, H=H, D=D, bytes=nbytes, elements=dout.numel())

    # verify before timing: the fp64 sum by chunks of rows (the fp64 products of paper 128K
    # would take 8.6 GB each)
    exact = torch.empty(T * H, dtype=torch.float64, device="cuda")
    a, b = dout.view(T * H, D), out.view(T * H, D)
    step = 1 << 20
    for r in range(0, T * H, step):
        exact[r : r + step] = (a[r : r + step].double() * b[r : r + step].double()).sum(-1)
    exact = exact.view(T, H)
    same = fns["torch problem.row_delta"]()
    tol = testing.tolerance(exact, same, torch.float32)
    res["max_err"], res["tolerance"] = {}, tol
    for name in list(fns):
        err = testing.max_err(fns[name](), exact)
        res["max_err"][name] = err
        if not err <= tol:
            print(f"[verify] {shape} {T} {name}: error {err:.3e} > {tol:.3e}: not timed",
                  file=sys.stderr)  # fmt: skip
            del fns[name]
    del exact, same
    runs = {name: dict(ms=[], device=[]) for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            runs[name]["ms"].append(event_ms(fn, iters, busy=False))
            runs[name]["device"].append(event_ms(fn, iters, busy=True))
    res["ms"] = {name: min(r["ms"]) for name, r in runs.items()}
    res["device ms"] = {name: min(r["device"]) for name, r in runs.items()}
    res["GB/s (device)"] = {
        name: round(nbytes / t / 1e6, 1) for name, t in res["device ms"].items()
    }
    res["ms at the HBM bound"] = nbytes / (HBM_TBPS * 1e9)
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--cases", nargs="+", default=["paper:131072", "anchor:16384", "long:1048576"])
    args = ap.parse_args(argv)

    def one(shape, T):
        torch.cuda.empty_cache()  # the previous case's inputs
        return case(shape, T, args.iters, args.variants)

    run_cases(one, args.cases, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
