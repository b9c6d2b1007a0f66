"""One launch of a backward op at one shape, for a profiler (``ncu``, ``nsys``).

``PYTHONPATH=src python3 benchmarks/profile_bwd.py [--shape anchor] [--seqlen 32768]
[--provider cute] [--repeat 2]``: selection and forward on CuTe, then ``--repeat`` calls of the
provider's whole ``bwd`` op (a ``benchmarks/bwd_ab.py`` provider: ``triton`` or a CuTe
variant); profile the last one, e.g. ``ncu --kernel-name regex:BwdSm90 --launch-skip 1
--launch-count 1 ...``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bwd_ab import SHAPES, VARIANTS
from flash_msa import backends, testing
from flash_msa.bench import step_config
from flash_msa.problem import Saved


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="anchor", choices=list(SHAPES))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--provider", default="cute", choices=["triton", *VARIANTS])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    from flash_msa.cute import bwd_sm90

    H, Hkv, Hp, Hpk, D, Dp = SHAPES[args.shape]
    S = args.seqlen
    cute_be = backends.load("cute")[0]
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
    if args.provider == "triton":
        fn = backends.load("triton")[0].bwd
    else:

        def fn(*a):
            return bwd_sm90.bwd(*a, **VARIANTS[args.provider])

    for _ in range(args.repeat):
        fn(dout, dkl, saved, cu, cfg)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
