"""The Triton backend's tile tables against other entries in one run (GPU), with a kernel-time
breakdown.

    PYTHONPATH=src python3 benchmarks/tune_triton.py --seqlen 16384 [--shape anchor]

Each configuration is a :class:`flash_msa.triton_ref.tiles.Tables` (the shipped tables first;
each later one replaces a few of them), passed to the backend ops as ``tables=``. It is checked
against the first configuration (gradients and KL close), then timed: a training step
(selection, forward with the KL and the unit proxy gradient, backward; CUDA events, median) and
the device time of each kernel over three profiled steps (torch.profiler).
"""

import argparse
from collections import defaultdict

import torch

from flash_msa import bench, testing, triton_ref
from flash_msa.problem import Config, Saved
from flash_msa.triton_ref import tiles

CONFIGS = [  # (name, tables): the shipped ones first
    ("shipped", tiles.SHIPPED),
    # the largest tiles alone: they spill at D = 128, block 128
    ("spilling", tiles.Tables(bwd=((128, 128, 1),), proxy=((128, 128, True),), fwd=((128, 1),))),
    ("bwd 128x64 unsplit dQ", tiles.Tables(bwd=((128, 64, 1),))),  # spills 80 B (anchor)
    ("proxy 128x32", tiles.Tables(proxy=((128, 32, True),))),
    ("proxy 128x64 prefetch", tiles.Tables(proxy=((128, 64, True),))),  # spills (KL+grad)
    ("fwd 64 rows", tiles.Tables(fwd=((64, 1),))),
]


def profile(step, n=3):
    """Device milliseconds per kernel name (summed over ``n`` steps, divided by ``n``)."""
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.key if e.key.startswith("_") else "torch ops"
            per[name] += e.self_device_time_total / 1000 / n
    return per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--shape", default="anchor")
    args = ap.parse_args()
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[args.shape]
    S = args.seqlen
    xs = testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda")
    qp, kp, q, k, v = (x[0] for x in xs)
    cu = testing.cu([S], "cuda")
    cfg = Config(
        block_size=bench.BLOCK, softmax_scale=D**-0.5, max_seqlen=S, proxy_scale=Dp**-0.5,
        top_k=bench.TOP_K,
    )  # fmt: skip
    dout = torch.randn_like(q)
    dkl = torch.ones((), device="cuda")
    print(f"{args.shape} S={S}", flush=True)
    ref = None
    for name, tables in CONFIGS:

        def step(tables=tables):
            idx = triton_ref.select(qp, kp, cu, cfg, tables=tables)
            f = triton_ref.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True, tables=tables)
            saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, f.proxy_grad)
            return f.kl, triton_ref.bwd(dout, dkl, saved, cu, cfg, tables=tables)

        try:
            tiles.clear()
            kl, grads = step()
            grads = [g.float().clone() for g in grads]
            if ref is None:
                ref = (kl, grads)
            err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref[1]))
            kl_err = abs(kl.item() - ref[0].item()) / abs(ref[0].item())
            chosen = sorted({(key[0], tile) for key, tile in tiles.chosen().items()})
            ms = bench.time_ms(step, iters=7)
            per = profile(step)
            kernels = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda x: -x[1]))
            print(
                f"{name}: tiles {chosen}; step {ms:.3f} ms (kernels {sum(per.values()):.2f}: "
                f"{kernels}); rel diff vs first: grads {err:.1e}, kl {kl_err:.1e}",
                flush=True,
            )
        except Exception as e:  # e.g. out of shared memory
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
