"""Work-list build A/B on one GPU: the CuTe kernels of ``cute/worklist_sm90.py`` against the
torch glue of ``flash_msa.worklist`` they replace (issue 14: the eager step is host-bound).

Usage: ``PYTHONPATH=src python benchmarks/worklist_ab.py [--cases anchor:16384 paper:131072
long:1048576] [--iters 200] [--out FILE.json]``. A case is one sequence of T tokens at a shape
of ``flash_msa.bench.SHAPES`` (Hs = its Hp: 4 for all three), K = ``bench.TOP_K`` (16) slots,
block ``bench.BLOCK`` (128); the indices are causal random selections (slot 0 the token's own
block, slot k a uniform block ``<= own`` where ``k <= own``, else -1; repeats allowed: the work
list does not care).

Rows: ``blocks``, ``lists`` (given the key blocks, as the forward calls it), ``items`` at TW 256
(the forward) and 128 (the CuTe backward), and ``build``: the four in a row, the step's work-list
host path. Every CuTe result is compared with torch's bit for bit first (a mismatch is reported
and not timed). Per row and provider: ``host us``, the median over ``--iters`` calls of the
``perf_counter`` time of one call, each started on an idle GPU (a synchronize after each call,
not counted): the host's cost; ``gpu us``, the median of 20 calls timed by CUDA events with the
GPU kept busy while the host enqueues (``torch.cuda._sleep`` before the start event): the
kernels alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flash_msa import bench, worklist

SLEEP_CYCLES = 40_000_000  # ~20 ms of GPU spin: longer than any call's host work here


def indices(T: int, Hs: int, K: int, block: int, seed: int = 0) -> torch.Tensor:
    """``(T, Hs, K)`` int32 causal selections of one sequence (module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    own = torch.arange(T, device="cuda") // block  # [T]
    pick = torch.rand((T, Hs, K), generator=g, device="cuda") * (own + 1)[:, None, None]
    idx = pick.long().clamp_max_(own[:, None, None])
    idx[:, :, 0] = own[:, None]
    slot = torch.arange(K, device="cuda")
    idx = torch.where(slot[None, None, :] <= own[:, None, None], idx, -1)
    return idx.int().contiguous()


def host_us(fn, iters: int) -> float:
    """Median host microseconds of one call of ``fn`` started on an idle GPU."""
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(sorted(times)[len(times) // 2] * 1e6, 1)


def gpu_us(fn, iters: int = 20) -> float:
    """Median CUDA-event microseconds of ``fn`` with the host's work hidden behind a GPU spin."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2] * 1e3, 1)


def _equal(a, b) -> bool:
    """Bitwise equality of two Blocks / Lists / WorkList tuples (tensors by value, the rest by
    ==)."""
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return len(a) == len(b)


def case(shape: str, T: int, iters: int) -> dict:
    from flash_msa.cute import worklist_sm90 as ws

    Hs, K, b = bench.SHAPES[shape][3], bench.TOP_K, bench.BLOCK
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    idx = indices(T, Hs, K, b)
    kb_t, kb_c = worklist.blocks(cu, b, T), ws.blocks(cu, b, T)
    sl_t = worklist.lists(idx, cu, b, key_blocks=kb_t)
    sl_c = ws.lists(idx, cu, b, key_blocks=kb_c)

    def build(mod):
        kb = mod.blocks(cu, b, T)
        sl = mod.lists(idx, cu, b, key_blocks=kb)
        return kb, sl, mod.items(sl, 256), mod.items(sl, 128)

    rows = {
        "blocks": (lambda: worklist.blocks(cu, b, T), lambda: ws.blocks(cu, b, T)),
        "lists": (
            lambda: worklist.lists(idx, cu, b, key_blocks=kb_t),
            lambda: ws.lists(idx, cu, b, key_blocks=kb_c),
        ),
        "items TW256": (lambda: worklist.items(sl_t, 256), lambda: ws.items(sl_c, 256)),
        "items TW128": (lambda: worklist.items(sl_t, 128), lambda: ws.items(sl_c, 128)),
        "build": (lambda: build(worklist), lambda: build(ws)),
    }
    res = dict(shape=shape, T=T, Hs=Hs, K=K, block=b, entries=T * Hs * K, lists=Hs * kb_t[3])
    for name, (torch_fn, cute_fn) in rows.items():
        a, c = torch_fn(), cute_fn()
        same = (
            all(_equal(x, y) for x, y in zip(a, c)) if name == "build" else _equal(a, c)
        )  # fmt: skip
        if not same:
            print(f"[verify] {shape} {T} {name}: CuTe differs: not timed", file=sys.stderr)
            res[name] = "MISMATCH"
            continue
        res[name] = {
            "host us": {"torch": host_us(torch_fn, iters), "cute": host_us(cute_fn, iters)},
            "gpu us": {"torch": gpu_us(torch_fn), "cute": gpu_us(cute_fn)},
        }
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=["anchor:16384", "paper:131072", "long:1048576"])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = []
    for c in args.cases:
        shape, T = c.split(":")
        r = case(shape, int(T), args.iters)
        results.append(r)
        print(json.dumps(r), flush=True)
        for name in ("blocks", "lists", "items TW256", "items TW128", "build"):
            v = r[name]
            if isinstance(v, str):
                print(f"  {shape} {T} {name:12s} {v}")
                continue
            h, g = v["host us"], v["gpu us"]
            print(
                f"  {shape} {T} {name:12s} host us torch {h['torch']:8.1f} cute {h['cute']:7.1f}"
                f" | gpu us torch {g['torch']:8.1f} cute {g['cute']:7.1f}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("MISMATCH" not in r.values() for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
