"""What the device-side metadata guard (flash_msa.guard) costs a varlen training step.

Runs the same packed training step (forward with the KL, backward) with the guard on (the GPU
default) and with it off (``api._guarded`` returning ``None``, as for trusted metadata), side
by side in one process, and the guard's own ops alone; prints one JSON line per shape.

    PYTHONPATH=src python benchmarks/guard_cost.py [--lengths 16384] [--docs 8]
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

import flash_msa
from flash_msa import api, guard


def _inputs(T, H=32, Hkv=8, Hp=4, Hpk=1, D=128, Dp=128):
    dt = dict(device="cuda", dtype=torch.bfloat16)
    shapes = [(T, Hp, Dp), (T, Hpk, Dp), (T, H, D), (T, Hkv, D), (T, Hkv, D)]
    return [torch.randn(*s, **dt).requires_grad_() for s in shapes]


def _ms(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--docs", type=int, default=8)
    a = ap.parse_args()
    for T in a.tokens:
        xs = _inputs(T)
        lengths = [T // a.docs] * a.docs
        lengths[-1] += T - sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu, ms = cu.cuda(), max(lengths)

        def step():
            out, kl = flash_msa.msa_attention(*xs, 16, cu_seqlens=cu, max_seqlen=ms)
            (out.float().square().mean() + kl).backward()

        guarded = _ms(step)
        with mock.patch.object(api, "_guarded", lambda *args, **kw: None):
            plain = _ms(step)
        guarded_again = _ms(step)
        out = torch.empty_like(xs[2])

        def guard_ops():
            seqs = guard.sequences(cu, ms, T)
            guard.poison_(out, seqs.row_ok)

        print(json.dumps(dict(
            tokens=T, docs=a.docs, step_ms_guarded=round(guarded, 3),
            step_ms_unguarded=round(plain, 3), step_ms_guarded_again=round(guarded_again, 3),
            ratio=round(guarded / plain, 4), guard_ops_ms=round(_ms(guard_ops), 4),
        )), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
