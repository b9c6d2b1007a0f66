"""Combine-stage A/B on one GPU: the CuTe combine against the Triton stage.

The CuTe combine (``cute/combine_sm90.py``, the backend's stage since the ninth session) and the
Triton stage on the same partial buffers of one forward chunk, in one run, interleaved: the main
merge (``out`` and ``lse``), the proxy LSE (LSE only) and both (Triton: its two launches; CuTe:
one fused launch, ``proxy=``, as the driver runs it).

Usage: ``python benchmarks/combine_ab.py [--out FILE.json] [--iters N]
[--cases anchor:16384 anchor:32768 paper:131072]``. A case is the chunk the driver
(``flash_msa.sparse_forward``) combines for one sequence of S tokens: C = min(S,
PARTIAL_BYTES / (H K D 2)) tokens (anchor 16K and 32K: the whole sequence, 1 and 2 GiB of
``o_part``; paper 128K: 8192 tokens, 2 GiB), the last chunk of the sequence, bf16, top_k 16,
block 128: a token's used slots are its first min(K, t / 128 + 1), as the selection gives.
Partials are random (finite); every CuTe result is compared with Triton's first (a provider
further than ``MAX_DIFF`` is reported and not timed).

Three times per provider, each the median of ``--iters`` calls, twice (A B A B), the minimum:
``ms``, CUDA events around the Python call on an idle GPU (what the first run measured: the
host work before the launch included); ``device ms``, the same events with the GPU kept busy
(``torch.cuda._sleep``) while the host prepares the launch, so the kernel alone; ``host us``,
the CPU time of one call while the GPU is busy (launches queue). GB/s count the bytes the
merge must move (used partial rows, indices, outputs: the CuTe module docstring's count) by
``device ms``, next to the H200's ~4.8 TB/s HBM bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bwd_ab import run_cases
from flash_msa.sparse_forward import PARTIAL_BYTES

SHAPES = {"anchor": (16, 4), "paper": (64, 4)}  # H, Hs
K, D, BLOCK = 16, 128, 128
HBM_TBPS = 4.8
MAX_DIFF = 1e-2  # max |out difference| / max |out| (bf16 roundings) and max |lse difference|
SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU spin at ~2 GHz: longer than any call's host work


def buffers(shape: str, S: int):
    """The chunk's ``(o_part, l_part, pl_part, idx)`` and the merge's bytes ``(main, proxy)``."""
    H, Hs = SHAPES[shape]
    C = min(S, PARTIAL_BYTES // (H * K * D * 2))
    tok = torch.arange(S - C, S, device="cuda")
    n = torch.clamp(tok // BLOCK + 1, max=K)  # used slots per token
    used = torch.arange(K, device="cuda")[None, :] < n[:, None]  # (C, K)
    idx = torch.where(used, torch.arange(K, device="cuda")[None, :], -1).to(torch.int32)
    idx = idx[:, None, :].expand(C, Hs, K).contiguous()
    o_part = torch.randn((C, H, K, D), dtype=torch.bfloat16, device="cuda")
    l_part = 3 * torch.randn((C, H, K), device="cuda")
    pl_part = 3 * torch.randn((C, Hs, K), device="cuda")
    rows = int(used.sum()) * H  # used (token, head, slot) partial rows
    main = rows * (D * 2 + 4) + C * Hs * K * 4 + C * H * (D * 2 + 4)
    proxy = int(used.sum()) * Hs * 4 + C * Hs * K * 4 + C * Hs * 4
    return (o_part, l_part, pl_part, idx), (main, proxy)


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def event_ms(fn, iters: int, busy: bool) -> float:
    """Median ms of ``fn`` by CUDA events (``flash_msa.bench.time_ms``'s method); ``busy``: the
    GPU spins before the start event, so the host's work overlaps it and the events time the
    kernels alone."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy:
            torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return _median(times)


def host_us(fn, iters: int) -> float:
    """CPU microseconds of one call of ``fn`` while the GPU is busy (its launches queue)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 4)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return t


def case(shape: str, S: int, iters: int) -> dict:
    from flash_msa.cute import combine_sm90
    from flash_msa.triton_ref import sparse_fwd

    H, Hs = SHAPES[shape]
    (o_part, l_part, pl_part, idx), (main_bytes, proxy_bytes) = buffers(shape, S)
    C = idx.shape[0]
    res = dict(shape=shape, S=S, C=C, bytes=dict(main=main_bytes, proxy=proxy_bytes))
    nbytes = dict(main=main_bytes, proxy=proxy_bytes, both=main_bytes + proxy_bytes)

    def stage(fn, kind, fused=False):
        out = torch.empty((C, H, D), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((C, H), device="cuda")
        plse = torch.empty((C, Hs), device="cuda")

        def run():
            if kind in ("main", "both"):
                if fused:
                    fn(o_part, l_part, idx, out, lse, (pl_part, plse))
                else:
                    fn(o_part, l_part, idx, out, lse)
            if kind in ("proxy", "both") and not fused:
                fn(None, pl_part, idx, None, plse)
            return out, lse, plse

        return run

    fns = {f"triton {k}": stage(sparse_fwd.combine, k) for k in ("main", "proxy", "both")}
    fns["cute main"] = stage(combine_sm90.combine, "main")
    fns["cute proxy"] = stage(combine_sm90.combine, "proxy")
    fns["cute both"] = stage(combine_sm90.combine, "both", fused=True)  # the fused launch
    ref = {k: fns[f"triton {k}"]() for k in ("main", "proxy", "both")}
    res["max_diff"] = {}
    for name in list(fns):
        if name.startswith("triton"):
            continue
        kind = name.split()[-1]
        out, lse, plse = fns[name]()
        r_out, r_lse, r_plse = ref[kind]
        d = 0.0
        if kind in ("main", "both"):
            theirs = r_out.float()
            d = ((out.float() - theirs).abs().max() / theirs.abs().max()).item()
            d = max(d, (lse - r_lse).abs().max().item())
        if kind in ("proxy", "both"):
            d = max(d, (plse - r_plse).abs().max().item())
        res["max_diff"][name] = d
        if not d <= MAX_DIFF:
            print(f"[verify] {shape} {S} {name}: MISMATCH {d}: not timed", file=sys.stderr)
            del fns[name]
    runs = {name: dict(ms=[], device=[], host=[]) for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            runs[name]["ms"].append(event_ms(fn, iters, busy=False))
            runs[name]["device"].append(event_ms(fn, iters, busy=True))
            runs[name]["host"].append(host_us(fn, iters))
    res["ms"] = {name: min(r["ms"]) for name, r in runs.items()}
    res["device ms"] = {name: min(r["device"]) for name, r in runs.items()}
    res["host us"] = {name: round(min(r["host"]), 1) for name, r in runs.items()}
    res["GB/s (device)"] = {
        name: round(nbytes[name.split()[-1]] / t / 1e6, 1) for name, t in res["device ms"].items()
    }
    res["ms at the HBM bound"] = {k: b / (HBM_TBPS * 1e9) for k, b in nbytes.items()}
    res["ms_all"] = {name: r["ms"] for name, r in runs.items()}
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cases", nargs="+", default=["anchor:16384", "anchor:32768", "paper:131072"])
    args = ap.parse_args(argv)

    def one(shape, S):
        torch.cuda.empty_cache()  # the previous case's partial buffers
        return case(shape, S, args.iters)

    run_cases(one, args.cases, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
