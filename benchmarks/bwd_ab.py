"""Backward op A/B on one GPU: the CuTe fused backward against the Triton backward (main pass +
proxy pass) on the same saved forward, in one run, interleaved.

Usage: ``python benchmarks/bwd_ab.py [--out FILE.json] [--iters N] [--cases anchor:16384 ...]``.
For each case (shape:seqlen, random inputs, top_k 16, block 128): selection and forward on CuTe,
then the whole ``bwd`` op of each backend with ``dout`` and ``dkl`` given (all five gradients:
glue included, i.e. the work list, Delta, zero-fills and casts), timed A B A B by CUDA events
(``flash_msa.bench.time_ms``). TFLOP/s by the BWD formula ``10 * D * H * pairs`` (the proxy
gradient's FLOPs are not counted, as in ``flash-msa bench``). Before timing, each gradient of
the CuTe op is compared to Triton's: the max abs difference relative to Triton's max abs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from flash_msa import backends, testing
from flash_msa.bench import sparse_pairs, step_config, time_ms
from flash_msa.problem import Saved

SHAPES = {  # H, Hkv, Hp, Hpk, D, Dp
    "anchor": (16, 2, 4, 1, 128, 128),
    "paper": (64, 4, 4, 1, 128, 128),
}


def case(shape: str, S: int, iters: int) -> dict:
    H, Hkv, Hp, Hpk, D, Dp = SHAPES[shape]
    cute_be, triton_be = backends.load("cute")[0], backends.load("triton")[0]
    qp, kp, q, k, v = (
        x[0].contiguous()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", seed=0)
    )
    cu = testing.cu([S], "cuda")
    cfg = step_config(S, D, Dp)
    idx = cute_be.select(qp, kp, cu, cfg)
    f = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, None)
    dout, dkl = testing.loss_weights(q.shape, Hp * S, 0, q.device)
    dout, dkl = dout.to(q.dtype), torch.tensor(dkl, dtype=torch.float32, device="cuda")
    grads = {
        n: be.bwd(dout, dkl, saved, cu, cfg) for n, be in (("cute", cute_be), ("triton", triton_be))
    }
    names = ("dq", "dk", "dv", "dq_proxy", "dk_proxy")
    rel = {
        n: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for n, a, b in zip(names, grads["cute"], grads["triton"])
    }
    del grads
    pairs = sparse_pairs(idx[None], S, cfg.block_size)
    flop = 10 * D * H * pairs
    ms = {"cute": [], "triton": []}
    for _ in range(2):
        for name, be in (("cute", cute_be), ("triton", triton_be)):
            ms[name].append(time_ms(lambda be=be: be.bwd(dout, dkl, saved, cu, cfg), iters=iters))
    res = dict(shape=shape, S=S, rel_diff_vs_triton=rel)
    for name, t in ms.items():
        best = min(t)
        res[name] = dict(ms=t, tflops=flop / best / 1e9)
    res["speedup"] = min(ms["triton"]) / min(ms["cute"])
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=["anchor:16384", "anchor:32768", "paper:32768"])
    args = ap.parse_args(argv)
    rows = []
    for c in args.cases:
        shape, S = c.split(":")
        r = case(shape, int(S), args.iters)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
