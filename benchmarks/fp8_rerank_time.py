"""The selection op's time by precision under ``auto`` (one GPU, same run): ``bf16``, ``fp8``
and ``fp8_rerank`` (the fp8 top ``top_k + m`` re-ranked exactly: the fp8 backend's selection,
then the re-rank backend's kernel), with the recall of the bf16 selection's non-own blocks.

``--extra M ...`` sweeps ``m`` (``quant.RERANK_EXTRA``, the shipped 4 by default): one
``fp8_rerank`` line per ``m`` with the whole selection's time (``ms``), the re-rank step's
alone (``rerank_ms``: the Triton kernel and ``quant.refine`` on the fp8 top ``top_k + m`` of
``selection_precision="fp8"``, the same candidates) and the recall.

Usage: ``python benchmarks/fp8_rerank_time.py [--shape paper] [--seqlen 131072] [--iters 5]
[--inputs random local] [--extra 4 8 16] [--tiles 64,4 128,8]``; one line per (inputs,
precision[, m][, tile]). ``--tiles``: the re-rank kernel's tile (``BT,warps``) forced in turn
(``reranking.RERANK_TILES`` set to that one), each with its own ``fp8_rerank`` lines."""

import argparse
import json

import torch

from flash_msa import quant, select_blocks, testing
from flash_msa.bench import BLOCK, SHAPES, TOP_K, time_ms
from flash_msa.problem import Config
from flash_msa.triton_ref import reranking


def recall(idx, ref, block_size):
    """Share of ``ref``'s kept non-own blocks that ``idx`` keeps too (both ``(B, S, Hp, K)``)."""
    S = ref.shape[1]
    own = (torch.arange(S, device=ref.device) // block_size)[None, :, None, None]
    want = (ref >= 0) & (ref != own)
    hit = (ref[..., :, None] == idx[..., None, :]).any(-1) & want
    return hit.sum().item() / max(want.sum().item(), 1)


def rerank_ms(qp, kp, m, iters):
    """Milliseconds of the re-rank step alone (``reranking.rerank``) on the fp8 top ``TOP_K +
    m`` of ``qp``, ``kp`` ``(B, S, H, Dp)`` (packed as one batch of ``B`` sequences)."""
    B, S, Hp, Dp = qp.shape
    cand = select_blocks(qp, kp, TOP_K + m, selection_precision="fp8").view(B * S, Hp, -1)
    cu = testing.cu([S] * B, "cuda")
    cfg = Config(block_size=BLOCK, softmax_scale=1.0, max_seqlen=S, proxy_scale=Dp**-0.5,
                 top_k=TOP_K, selection_precision="fp8_rerank")  # fmt: skip
    q2, k2 = qp.reshape(B * S, Hp, Dp), kp.reshape(B * S, -1, Dp)
    return time_ms(lambda: reranking.rerank(q2, k2, cu, cand, cfg), iters=iters)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="paper", choices=list(SHAPES))
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--inputs", nargs="+", default=["random", "local"])
    ap.add_argument("--extra", nargs="+", type=int, default=[quant.RERANK_EXTRA])
    ap.add_argument("--tiles", nargs="+", default=None, help="BT,warps of the re-rank kernel")
    args = ap.parse_args()
    shipped, shipped_tiles = quant.RERANK_EXTRA, reranking.RERANK_TILES
    tile_list = [None]
    if args.tiles:
        tile_list = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    B, H, Hkv, Hp, Hpk, D, Dp, _ = SHAPES[args.shape]
    for kind in args.inputs:
        xs = testing.make_inputs(
            B, args.seqlen, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda",
            kind=kind, seed=0,
        )  # fmt: skip
        qp, kp = xs[0], xs[1]
        with torch.no_grad():
            ref = select_blocks(qp, kp, TOP_K)
            runs = [("bf16", None, None), ("fp8", None, None)]
            runs += [("fp8_rerank", m, tile) for tile in tile_list for m in args.extra]
            for prec, m, tile in runs:
                if m is not None:  # read by quant.candidate_top_k when the call resolves
                    quant.RERANK_EXTRA = m
                    reranking.RERANK_TILES = shipped_tiles if tile is None else (tile,)

                def sel(p=prec, qp=qp, kp=kp):
                    return select_blocks(qp, kp, TOP_K, selection_precision=p)

                ms = time_ms(sel, iters=args.iters)
                rec = recall(sel(), ref, BLOCK)
                row = dict(shape=args.shape, S=args.seqlen, inputs=kind, precision=prec,
                           ms=round(ms, 3), recall_of_bf16=round(rec, 5))  # fmt: skip
                if m is not None:
                    row.update(extra=m, rerank_ms=round(rerank_ms(qp, kp, m, args.iters), 3))
                    row.update(tile=list(reranking.RERANK_TILES[0]) if tile else "default")
                print(json.dumps(row), flush=True)
            quant.RERANK_EXTRA, reranking.RERANK_TILES = shipped, shipped_tiles
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
