"""Issue 14 item 4: is a CuTe dense warmup worth writing? The warmup (dense causal attention,
KL over all visible keys) is the sparse op with every causal block kept, so the CuTe forward
and backward can run it today: ``msa_attention`` with ``top_k`` = the sequence's block count
(``auto``: the selection on Triton, CuTe's is capped at 64 slots; forward and backward on
CuTe). This script times, in one run, at the anchor layout: the Triton warmup step
(``warmup=True``), the all-blocks step on ``auto``, and the all-blocks selection alone (what a
CuTe warmup would not run: its block lists are fixed), and checks that the all-blocks step
computes the warmup's out, kl and five gradients (fp32 on the same inputs: same function).

    PYTHONPATH=src python benchmarks/warmup_ab.py --seqlen 16384 32768 [--json F]
"""
import argparse
import json

import torch

from flash_msa import bench, msa_attention, select_blocks, testing
from flash_msa.backends import forced


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES["anchor"]
    rows = []
    for S in a.seqlen:
        nb = S // bench.BLOCK
        xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
        leaves = [x.detach().requires_grad_() for x in xs]
        dout = torch.randn_like(leaves[2])

        def step(backend, warmup):
            def run():
                with forced(backend):
                    out, kl = msa_attention(*leaves, nb, warmup=warmup, compute_kl=True)
                    g = torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))
                return (out, kl, *g)
            return run

        def sel():
            with forced("auto"), torch.no_grad():
                select_blocks(leaves[0], leaves[1], nb)

        row = {"S": S, "blocks": nb}
        ref = step("triton", True)()
        mine = step("auto", False)()
        names = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
        row["max_rel_err"] = {
            n: float((m.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
            for n, m, r in zip(names, mine, ref)
        }
        del ref, mine
        row["triton_warmup_ms"] = bench.time_ms(step("triton", True), iters=a.iters)
        row["auto_all_blocks_ms"] = bench.time_ms(step("auto", False), iters=a.iters)
        row["select_all_blocks_ms"] = bench.time_ms(sel, iters=a.iters)
        row["cute_all_blocks_minus_select_ms"] = row["auto_all_blocks_ms"] - row["select_all_blocks_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del leaves, xs
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": bench.environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
