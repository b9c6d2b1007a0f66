"""Host enqueue time vs GPU time of one anchor 16K training step (``auto``), for the package on
``sys.path``; run once per source tree for an A/B with one harness, e.g.
``for s in old/src src old/src src; do PYTHONPATH=$s python benchmarks/step_host_time.py; done``.

Prints one JSON line (medians of 10 steps after 3 warm-ups: ``host_ms`` = time to enqueue the
step, ``gpu_ms`` = CUDA-event time of the step) and a cProfile of 5 steps by own time."""

import cProfile
import io
import json
import pstats
import time

import torch

import flash_msa
from flash_msa import testing

S, H, Hkv, Hp, Hpk, D, Dp = 16384, 16, 2, 4, 1, 128, 128


def main():
    xs = [
        x.requires_grad_()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", seed=0)
    ]
    dout = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out, kl = flash_msa.msa_attention(*xs, 16, compute_kl=True)
        ((out * dout).sum() + kl).backward()

    for _ in range(3):
        step()
    host, gpu = [], []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        step()
        e1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        gpu.append(e0.elapsed_time(e1))

    def med(a):
        return sorted(a)[len(a) // 2]

    res = dict(src=flash_msa.__file__, host_ms=med(host), gpu_ms=med(gpu))
    print(json.dumps(dict(res, host_all=host, gpu_all=gpu)))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
