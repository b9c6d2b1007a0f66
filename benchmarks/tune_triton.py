"""A/B of the Triton backend's tuning knobs in one run (GPU), with a kernel-time breakdown.

    PYTHONPATH=src python3 benchmarks/tune_triton.py --seqlen 16384 [--shape anchor]

Each configuration sets module constants of ``flash_msa.triton_ref`` (the knobs below), is
checked against the first configuration (gradients and KL close), then timed: a training step
(forward with the KL + backward, CUDA events, median) and the device time of each kernel over
three profiled steps (torch.profiler).
"""

import argparse
import os
from collections import defaultdict

import torch

import flash_msa
from flash_msa import bench, testing
from flash_msa.triton_ref import proxy, sparse_bwd, sparse_fwd, tiles

KNOBS = {  # name -> (module, attribute)
    "fwd_stages": (sparse_fwd, "FWD_STAGES"),
    "fwd_prefetch": (sparse_fwd, "FWD_PREFETCH"),
    "bwd_prefetch": (sparse_bwd, "BWD_PREFETCH"),
    "bwd_tiles": (sparse_bwd, "BWD_TILES"),
    "proxy_tiles": (proxy, "PROXY_TILES"),
    "fwd_tiles": (sparse_fwd, "FWD_TILES"),
}

SPILLING_V4 = {
    "bwd_tiles": ((128, 128, 1),),
    "proxy_tiles": ((128, 128, True),),
    "fwd_tiles": ((128, 1),),
}
CONFIGS = [  # the shipped defaults first; each later one changes a few knobs
    {},
    SPILLING_V4,  # the v4 tiles (they spill at D=128, block 128)
    {"bwd_tiles": ((128, 64, 1),)},  # spills 80 B at the anchor shape
    {"proxy_tiles": ((128, 32, True),)},  # the v5a choice
    {"proxy_tiles": ((128, 64, True),)},  # spills in the KL+gradient pass
    {"fwd_tiles": ((64, 1),)},  # the v5a choice
    {"bwd_prefetch": True},
]


def _table(kernel_name, cfg):
    """The candidate table a kernel used under knob settings ``cfg`` (for the printout)."""
    tables = {
        "_bwd_kernel": cfg["bwd_tiles"],
        "_proxy_kernel": cfg["proxy_tiles"],
        "_fwd_kernel": cfg["fwd_tiles"],
    }
    return tuple(tables.get(kernel_name, ()))


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
    os.environ["FLASH_MSA_BACKEND"] = "triton"
    B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[args.shape]
    xs = testing.make_inputs(
        B, args.seqlen, H, Hkv, Hp, Hpk, D, Dp, device="cuda", requires_grad=True
    )
    dout = torch.randn_like(xs[2])
    defaults = {k: getattr(m, a) for k, (m, a) in KNOBS.items()}
    print(f"{args.shape} S={args.seqlen}; defaults {defaults}", flush=True)
    ref = None
    for change in CONFIGS:
        cfg = dict(defaults, **change)
        for k, v in cfg.items():
            setattr(*KNOBS[k], v)

        def step():
            for x in xs:
                x.grad = None
            out, kl = flash_msa.msa_attention(*xs, bench.TOP_K)
            torch.autograd.backward([out, kl], [dout, torch.ones_like(kl)])
            return kl

        try:
            kl = step().detach().clone()
            grads = [x.grad.float().clone() for x in xs]
            if ref is None:
                ref = (kl, grads)
            err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref[1]))
            kl_err = abs(kl.item() - ref[0].item()) / abs(ref[0].item())
            ms = bench.time_ms(step, iters=7)
            per = profile(step)
            kernels = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda x: -x[1]))
            chosen = [(k[0], v) for k, v in tiles.chosen().items() if k[1] == _table(k[0], cfg)]
            print(
                f"{change or 'defaults'}: tiles {chosen}; step {ms:.3f} ms "
                f" (kernels {sum(per.values()):.2f}: "
                f"{kernels}); rel diff vs first: grads {err:.1e}, kl {kl_err:.1e}",
                flush=True,
            )
        except Exception as e:  # e.g. out of shared memory
            print(f"{change}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    for k, v in defaults.items():
        setattr(*KNOBS[k], v)


if __name__ == "__main__":
    main()
