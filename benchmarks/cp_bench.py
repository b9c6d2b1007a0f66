"""Context-parallel training step: its time, and the collective time it does not overlap.

Usage (one process per GPU, NCCL; on CPU the same command runs on gloo)::

    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --shape paper --seqlen 1048576 \\
        [--backend auto] [--iters 5] [--out benchmarks/results/cp/paper-1m.json]
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py --smoke      # CPU: gloo, tiny, seconds

Each rank builds its own shards of one sequence of ``--seqlen`` tokens (random inputs, the
causal zigzag layout of ``flash_msa.distributed``), then times, per variant:

- ``overlap``: the step (``cp.msa_attention`` forward + backward of ``sum(out * dout) + w *
  kl``) as shipped, the ``k``/``v`` all-gathers waited for after the selection;
- ``no-overlap``: the same step waiting for them before the selection (``overlap=False``);
- ``collectives``: the step's collectives alone (``cp.gather`` of ``k_proxy``, ``k``, ``v``,
  timed as ``all_gather``, and its backward's fp32 reduce-scatters, ``reduce_scatter``; no
  attention), i.e. what there is to hide.

For the two step variants, a :class:`flash_msa.distributed.WaitTimer` brackets every wait for
a collective (CUDA: timing events on the current stream, the stream's stall; CPU: host time),
so ``waited`` is the collective time that compute did not hide, per collective and in total, and
``waited / step`` is the number the issue bounds (<= 10% at 1M tokens on 2 GPUs). A wait also
counts the time until the slowest rank joins the collective (load imbalance): compare the ranks'
rows (the smallest ``waited`` bounds the unhidden transfer). Step times are
CUDA-event (GPU) or host (CPU) medians over ``--iters`` after ``--warmup`` steps; the peak
memory per GPU is ``torch.cuda.max_memory_allocated`` over the whole run. Rank 0 prints one
line per rank and variant and writes them all to ``--out`` (JSON) if given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from flash_msa import backends
from flash_msa import distributed as cp

SHAPES = {  # H, Hkv, Hp, Hpk, D, Dp
    "anchor": (16, 2, 4, 1, 128, 128),
    "paper": (64, 4, 4, 1, 128, 128),
    "tiny": (4, 2, 2, 1, 16, 16),  # the CPU smoke test
}
TOP_K, BLOCK = 16, 128


class _Clock:
    """Elapsed milliseconds of a region: CUDA events on the current stream, or the host clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def start(self):
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self.t0.elapsed_time(end)
        return 1e3 * (time.perf_counter() - self.t0)


def _shards(lay, shape, dtype, device, rank):
    """This rank's random shards ``q_proxy, k_proxy, q, k, v`` (leaves) and the gradients of
    ``out`` and ``kl`` (``dout`` in the inputs' dtype, so that the loss adds no fp32 copy of
    ``out``; the KL weight times ``Hp * T``, as in ``flash_msa.testing.loss_weights``)."""
    H, Hkv, Hp, Hpk, D, Dp = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(rank)

    def randn(*shape):
        return torch.randn(lay.local_tokens, *shape, generator=g, device=device, dtype=dtype)

    xs = [randn(h, d).requires_grad_() for h, d in ((Hp, Dp), (Hpk, Dp), (H, D), (Hkv, D))]
    xs.append(randn(Hkv, D).requires_grad_())  # v
    dkl = torch.tensor(0.7 * Hp * lay.total_tokens, device=device)
    return xs, (randn(H, D), dkl)


def _step(xs, grads, lay, top_k, overlap, timer):
    for x in xs:
        x.grad = None
    out, kl = cp.msa_attention(*xs, top_k, layout=lay, overlap=overlap, timer=timer)
    torch.autograd.backward((out, kl), (grads[0], grads[1].to(kl.dtype)))


def _collectives(xs, lay, timer):
    """The step's collectives alone: the three all-gathers and their reduce-scatters."""
    keys = [xs[i].detach().requires_grad_() for i in (1, 3, 4)]  # k_proxy, k, v
    outs = [cp.gather(x, lay, timer=timer) for x in keys]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


VARIANTS = ("overlap", "no-overlap", "collectives")


def measure(
    shape, seqlen, dtype, device, iters, warmup, top_k=TOP_K, block=BLOCK, only=VARIANTS
) -> list:
    """This rank's rows (one per variant of ``only``), on the default process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cu = torch.tensor([0, seqlen], dtype=torch.int32)
    lay = cp.layout(world, rank, cu_seqlens=cu, block_size=block, device=device)
    xs, grads = _shards(lay, shape, dtype, device, rank)
    clock = _Clock(device.type == "cuda")
    variants = {
        "overlap": lambda t: _step(xs, grads, lay, top_k, True, t),
        "no-overlap": lambda t: _step(xs, grads, lay, top_k, False, t),
        "collectives": lambda t: _collectives(xs, lay, t),
    }
    rows = []
    for name, fn in variants.items():
        if name not in only:
            continue
        for _ in range(warmup):
            fn(None)
        steps, waits = [], []
        for _ in range(iters):
            timer = cp.WaitTimer()
            dist.barrier()
            clock.start()
            fn(timer)
            steps.append(clock.stop())
            waits.append(timer.times_ms())
        step = statistics.median(steps)
        per = {k: statistics.median(wt[k] for wt in waits) for k in waits[0]}
        waited = statistics.median(sum(wt.values()) for wt in waits)
        rows.append(
            dict(
                variant=name,
                rank=rank,
                world=world,
                shape=shape,
                seqlen=seqlen,
                local_tokens=lay.local_tokens,
                dtype=str(dtype).removeprefix("torch."),
                step_ms=step,
                waited_ms=waited,
                waited_frac=waited / step if step else 0.0,
                waited_per_collective_ms=per,
            )
        )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        for r in rows:
            r["peak_gib"] = peak
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="paper")
    p.add_argument("--seqlen", type=int, default=1 << 20)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--backend", default=None, help="FLASH_MSA_BACKEND (default: as set; auto)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ",".join(VARIANTS),
    )
    p.add_argument("--out", default=None, help="JSON file (rank 0 writes every rank's rows)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, torch backend, fp32")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it under torchrun (one process per GPU), see the module docstring")
    if args.smoke:
        args.shape, args.seqlen, args.dtype, args.backend = "tiny", 2048, "float32", "torch"
        args.iters, args.warmup = 2, 1
    only = tuple(args.variants.split(","))
    if not only or any(v not in VARIANTS for v in only):
        p.error(
            f"--variants: a comma-separated subset of {','.join(VARIANTS)}, not {args.variants!r}"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        with backends.forced(args.backend) if args.backend else contextlib.nullcontext():
            rows = measure(
                args.shape,
                args.seqlen,
                getattr(torch, args.dtype),
                device,
                args.iters,
                args.warmup,
                only=only,
            )
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        rows = [r for rs in everyone for r in rs]
        for r in rows:
            per = " ".join(f"{k} {v:.2f}" for k, v in r["waited_per_collective_ms"].items())
            print(
                f"rank {r['rank']}/{r['world']} {r['variant']:<11} {r['shape']} "
                f"S={r['seqlen']} step {r['step_ms']:.2f} ms, waited {r['waited_ms']:.2f} ms "
                f"({100 * r['waited_frac']:.1f}%): {per}"
                + (f", peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else "")
            )
        if args.out:
            meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", args=vars(args))
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
