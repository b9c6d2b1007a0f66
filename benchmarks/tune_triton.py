"""A/B of the Triton backward's tile rows and pipelining stages, in one run (GPU).

    PYTHONPATH=src python3 benchmarks/tune_triton.py --seqlen 16384
Each configuration is checked against the first one (gradients close) before it is timed.
"""

import argparse
import os

import torch

import flash_msa
from flash_msa import bench, testing
from flash_msa.triton_ref import sparse_bwd

CONFIGS = [  # (BWD_ROWS, PROXY_GRAD_ROWS, BWD_STAGES)
    (64, 64, 1),
    (64, 64, 2),
    (128, 128, 1),
    (128, 128, 2),
    (64, 128, 2),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--shape", default="anchor")
    args = ap.parse_args()
    os.environ["FLASH_MSA_BACKEND"] = "triton"
    B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[args.shape]
    xs = testing.make_inputs(
        B, args.seqlen, H, Hkv, Hp, Hpk, D, Dp, device="cuda", requires_grad=True
    )
    dout = torch.randn_like(xs[2])
    ref = None
    for cfg in CONFIGS:
        sparse_bwd.BWD_ROWS, sparse_bwd.PROXY_GRAD_ROWS, sparse_bwd.BWD_STAGES = cfg

        def step():
            for x in xs:
                x.grad = None
            out, kl = flash_msa.msa_attention(*xs, bench.TOP_K)
            torch.autograd.backward([out, kl], [dout, torch.ones_like(kl)])

        try:
            step()
            grads = [x.grad.float().clone() for x in xs]
            if ref is None:
                ref = grads
            err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref))
            ms = bench._time(step, iters=5)
            print(
                f"rows(bwd, proxy-grad), stages = {cfg}: step {ms:.3f} ms, "
                f"max rel grad diff vs first {err:.1e}",
                flush=True,
            )
        except Exception as e:  # e.g. out of shared memory
            print(f"{cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
