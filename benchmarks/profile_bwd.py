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

from bwd_ab import PROBES, SHAPES, VARIANTS, setup
from flash_msa import backends


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="anchor", choices=list(SHAPES))
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--provider", default="cute", choices=["triton", *VARIANTS, *PROBES])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    from flash_msa.cute import bwd_sm90

    saved, cu, cfg, dout, dkl = setup(args.shape, args.seqlen)
    if args.provider == "triton":
        fn = backends.load("triton")[0].bwd
    else:

        def fn(*a):
            return bwd_sm90.bwd(*a, **{**VARIANTS, **PROBES}[args.provider])

    for _ in range(args.repeat):
        fn(dout, dkl, saved, cu, cfg)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
