"""Combine-stage A/B on one GPU: the CuTe combine (``cute/combine_sm90.py``) against the Triton
stage it would replace, on the same partial buffers of one forward chunk, in one run,
interleaved; the main merge (``out`` and ``lse``) and the proxy LSE (LSE only).

Usage: ``python benchmarks/combine_ab.py [--out FILE.json] [--iters N] [--warps 4 8 ...]
[--cases anchor:16384 anchor:32768 paper:131072]``. A case is the chunk the driver
(``flash_msa.sparse_forward``) combines for one sequence of S tokens: C = min(S,
PARTIAL_BYTES / (H K D 2)) tokens (anchor 16K and 32K: the whole sequence, 1 and 2 GiB of
``o_part``; paper 128K: 8192 tokens, 2 GiB), the last chunk of the sequence, bf16, top_k 16,
block 128: a token's used slots are its first min(K, t / 128 + 1), as the selection gives.
Partials are random (finite); the CuTe results are compared with Triton's first (a provider
further than ``MAX_DIFF`` is reported and not timed). Times by CUDA events
(``flash_msa.bench.time_ms``), twice (A B A B), the minimum; GB/s count the bytes the merge
must move (used partial rows, indices, outputs: the CuTe module docstring's count), next to the
H200's ~4.8 TB/s HBM bound.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bwd_ab import run_cases
from flash_msa.bench import time_ms
from flash_msa.sparse_forward import PARTIAL_BYTES

SHAPES = {"anchor": (16, 4), "paper": (64, 4)}  # H, Hs
K, D, BLOCK = 16, 128, 128
HBM_TBPS = 4.8
MAX_DIFF = 1e-2  # max |out difference| / max |out| (bf16 roundings) and max |lse difference|


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


def case(shape: str, S: int, iters: int, warps: list[int]) -> dict:
    from flash_msa.cute import combine_sm90
    from flash_msa.triton_ref import sparse_fwd

    H, Hs = SHAPES[shape]
    (o_part, l_part, pl_part, idx), (main_bytes, proxy_bytes) = buffers(shape, S)
    C = idx.shape[0]
    res = dict(shape=shape, S=S, C=C, bytes=dict(main=main_bytes, proxy=proxy_bytes))

    def stage(fn, has_o):
        out = torch.empty((C, H, D), dtype=torch.bfloat16, device="cuda") if has_o else None
        lse = torch.empty((C, H if has_o else Hs), device="cuda")

        def run():
            if has_o:
                fn(o_part, l_part, idx, out, lse)
            else:
                fn(None, pl_part, idx, None, lse)
            return out, lse

        return run

    providers = {"triton": sparse_fwd.combine}
    for w in warps:
        providers[f"cute w{w}"] = lambda *a, _w=w: combine_sm90.combine(*a, warps=_w)
    fns = {}
    for name, fn in providers.items():
        for has_o, kind in ((True, "main"), (False, "proxy")):
            fns[f"{name} {kind}"] = stage(fn, has_o)
    ref = {kind: fns[f"triton {kind}"]() for kind in ("main", "proxy")}
    res["max_diff"] = {}
    for name in list(fns):
        if name.startswith("triton"):
            continue
        kind = name.split()[-1]
        out, lse = fns[name]()
        d = (lse - ref[kind][1]).abs().max().item()
        if out is not None:
            theirs = ref[kind][0].float()
            rel = (out.float() - theirs).abs().max() / theirs.abs().max()
            d = max(d, rel.item())
        res["max_diff"][name] = d
        if not d <= MAX_DIFF:
            print(f"[verify] {shape} {S} {name}: MISMATCH {d}: not timed", file=sys.stderr)
            del fns[name]
    ms = {name: [] for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            ms[name].append(time_ms(fn, iters=iters))
    res["ms"] = {name: min(t) for name, t in ms.items()}
    res["GB/s"] = {
        name: round((main_bytes if name.endswith("main") else proxy_bytes) / t / 1e6, 1)
        for name, t in res["ms"].items()
    }
    res["ms at the HBM bound"] = {
        kind: b / (HBM_TBPS * 1e9) for kind, b in (("main", main_bytes), ("proxy", proxy_bytes))
    }
    res["ms_all"] = ms
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--cases", nargs="+", default=["anchor:16384", "anchor:32768", "paper:131072"])
    args = ap.parse_args(argv)

    def one(shape, S):
        torch.cuda.empty_cache()  # the previous case's partial buffers
        return case(shape, S, args.iters, args.warps)

    run_cases(one, args.cases, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
