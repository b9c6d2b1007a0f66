"""The selection op's time by precision under ``auto`` (one GPU, same run): ``bf16``, ``fp8``
and ``fp8_rerank`` (the fp8 top ``top_k + 4`` re-ranked exactly: the fp8 backend's selection,
then the re-rank backend's kernel), with the rows where ``fp8_rerank`` and ``fp8`` differ from
the bf16 selection (recall of its non-own blocks).

Usage: ``python benchmarks/fp8_rerank_time.py [--shape paper] [--seqlen 131072] [--iters 5]
[--inputs random local]``; one line per (inputs, precision)."""

import argparse
import json

import torch

from flash_msa import select_blocks, testing
from flash_msa.bench import BLOCK, SHAPES, TOP_K, time_ms


def recall(idx, ref, block_size):
    """Share of ``ref``'s kept non-own blocks that ``idx`` keeps too (both ``(B, S, Hp, K)``)."""
    S = ref.shape[1]
    own = (torch.arange(S, device=ref.device) // block_size)[None, :, None, None]
    want = (ref >= 0) & (ref != own)
    hit = (ref[..., :, None] == idx[..., None, :]).any(-1) & want
    return hit.sum().item() / max(want.sum().item(), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="paper", choices=list(SHAPES))
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--inputs", nargs="+", default=["random", "local"])
    args = ap.parse_args()
    B, H, Hkv, Hp, Hpk, D, Dp, _ = SHAPES[args.shape]
    for kind in args.inputs:
        xs = testing.make_inputs(
            B, args.seqlen, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda",
            kind=kind, seed=0,
        )  # fmt: skip
        qp, kp = xs[0], xs[1]
        with torch.no_grad():
            ref = select_blocks(qp, kp, TOP_K)
            for prec in ("bf16", "fp8", "fp8_rerank"):

                def sel(p=prec, qp=qp, kp=kp):
                    return select_blocks(qp, kp, TOP_K, selection_precision=p)

                ms = time_ms(sel, iters=args.iters)
                rec = recall(sel(), ref, BLOCK)
                row = dict(shape=args.shape, S=args.seqlen, inputs=kind, precision=prec,
                           ms=round(ms, 3), recall_of_bf16=round(rec, 5))  # fmt: skip
                print(json.dumps(row), flush=True)
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
