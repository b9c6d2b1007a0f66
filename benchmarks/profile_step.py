"""Kernel-time breakdown of one MSA training step (torch.profiler), on a GPU.

PYTHONPATH=src python3 benchmarks/profile_step.py --seqlen 16384 [--shape anchor] [--backend auto]
[--no-kl] [--trace FILE]: the kernels by total GPU time, then the step's GPU busy time against its
span (the gaps are launch latency and host-bound stretches). ``--trace``: also record the host
(CPU) activity and write a Chrome trace (chrome://tracing, Perfetto) of the profiled step: where
the GPU waits for the host, op by op.
"""

import argparse
import os

import torch

import flash_msa
from flash_msa import bench, testing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="anchor", choices=list(bench.SHAPES))
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--inputs", default="random")
    ap.add_argument("--no-kl", action="store_true", help="compute_kl=False (the step without the KL)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace (host and GPU) here")
    args = ap.parse_args()
    os.environ["FLASH_MSA_BACKEND"] = args.backend
    B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[args.shape]
    xs = testing.make_inputs(
        B, args.seqlen, H, Hkv, Hp, Hpk, D, Dp, device="cuda", kind=args.inputs, requires_grad=True
    )
    dout = torch.randn_like(xs[2])

    def step():
        out, kl = flash_msa.msa_attention(*xs, bench.TOP_K, compute_kl=not args.no_kl)
        torch.autograd.grad([out, kl], xs, [dout, torch.ones_like(kl)])  # (as bench's step)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    if args.trace:
        acts.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    )
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:  # busy time (union of kernel intervals) against the span, in us
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy, end = 0, spans[0][0]
        for a, b in spans:
            busy += max(0, b - max(a, end))
            end = max(end, b)
        span = end - spans[0][0]
        print(f"kernels {len(kernels)}, GPU busy {busy / 1e3:.3f} ms of a {span / 1e3:.3f} ms span")


if __name__ == "__main__":
    main()
