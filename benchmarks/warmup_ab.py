"""Issue 14 item 4: is a CuTe dense warmup worth writing? The warmup (dense causal attention,
KL over all visible keys) is the sparse op with every causal block kept, so the CuTe forward
and backward can run it today: ``msa_attention`` with ``top_k`` = the sequence's block count
with the selection replaced by the fixed lists (every causal block, ascending: what a CuTe
warmup would pass; both selections cap ``top_k`` at 64, so the op's own selection cannot run
it), forward and backward on ``auto`` (CuTe). This script times, in one run, at the anchor
layout: the Triton warmup step (``warmup=True``) and the all-blocks step, and reports the
largest difference of out, kl and the five gradients between them (bf16, same inputs: the
same function up to summation order).

    PYTHONPATH=src python benchmarks/warmup_ab.py --seqlen 8192 --batch 1 4 [--json F]

Since the CuTe warmup exists (``flash_msa/cute/warmup.py``: the same lists built inside the
op), the main comparison is ``warmup=True`` itself on each backend, forced
(``FLASH_MSA_BACKEND=cute`` / ``triton``), same inputs, same run, with the max differences:
``--warmup`` rows at ``--warmup-shapes`` (default anchor 16K, 32K, 64K and paper 32K, B 1);
the 8K all-blocks rows above stay as they were (``--seqlen``; ``--seqlen`` with no value skips
them).

    PYTHONPATH=src python benchmarks/warmup_ab.py --json F
"""

import argparse
import json

import torch

from flash_msa import backends, bench, msa_attention, testing
from flash_msa.backends import forced

ALL = {}  # the fixed lists of the all-blocks step, by S
_resolve = backends.resolve


class AllBlocks:
    """A stand-in select backend: every causal block of each row, ascending, -1 padded."""

    @staticmethod
    def select(q_proxy, k_proxy, cu_seqlens, cfg, **kw):
        return ALL[q_proxy.shape[0]]  # (B * S, Hp, S / block): one batch of equal lengths


RESOLVED = {}  # op -> backend of the last all-blocks call


def resolve(op, problem):
    if problem.cfg.top_k and problem.cfg.top_k > 64:
        RESOLVED[op] = "all-blocks" if op == "select" else _resolve(op, problem)[0]
        if op == "select":
            return "all-blocks", AllBlocks
    return _resolve(op, problem)


backends.resolve = resolve


NAMES = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")


def warmup_row(spec: str, iters: int) -> dict:
    """One ``warmup=True`` step (forward + backward, KL in the loss) forced on CuTe and on
    Triton, same inputs, same run: times and the max relative differences (Triton's as the
    base). A CuTe refusal (e.g. over its list budget) is recorded, not raised."""
    shape, S, *b = spec.split(":")
    S, B = int(S), int(b[0]) if b else 1
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
    leaves = [x.detach().requires_grad_() for x in xs]
    dout = torch.randn_like(leaves[2])

    def step(backend):
        def run():
            with forced(backend):
                out, kl = msa_attention(*leaves, 16, warmup=True, compute_kl=True)
                g = torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))
            return (out, kl, *g)

        return run

    row = {"shape": shape, "S": S, "B": B, "warmup": True}
    try:
        mine = step("cute")()
    except backends.BackendError as e:
        row["cute_refused"] = str(e)
        mine = None
    ref = step("triton")()
    if mine is not None:
        row["max_rel_err"] = {
            n: float((m.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
            for n, m, r in zip(NAMES, mine, ref)
        }
    del mine, ref
    torch.cuda.reset_peak_memory_stats()
    row["triton_warmup_ms"] = bench.time_ms(step("triton"), iters=iters)
    row["triton_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if "cute_refused" not in row:
        torch.cuda.reset_peak_memory_stats()
        row["cute_warmup_ms"] = bench.time_ms(step("cute"), iters=iters)
        row["cute_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(row), flush=True)
    return row  # (the inputs go with this frame; main empties the cache)


def main():
    p = argparse.ArgumentParser()
    # the lists hold every block, and both backends cap top_k at 64: S <= 64 blocks of 128
    p.add_argument("--seqlen", type=int, nargs="*", default=[8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--warmup-shapes", nargs="*", default=["anchor:16384", "anchor:32768", "anchor:65536",
                                               "paper:32768"],
        help="SHAPE:S[:B] rows of the forced cute-vs-triton warmup comparison",
    )  # fmt: skip
    a = p.parse_args()
    rows = []
    for spec in a.warmup_shapes:
        rows.append(warmup_row(spec, a.iters))
        torch.cuda.empty_cache()
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES["anchor"]
    for S, B in [(S, B) for S in a.seqlen for B in a.batch]:
        nb = S // bench.BLOCK
        own = (torch.arange(B * S, device="cuda") % S // bench.BLOCK)[:, None, None]
        slot = torch.arange(nb, device="cuda")[None, None, :]
        ALL[B * S] = torch.where(slot <= own, slot, -1).expand(B * S, Hp, nb).to(torch.int32)
        ALL[B * S] = ALL[B * S].contiguous()
        xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
        leaves = [x.detach().requires_grad_() for x in xs]
        dout = torch.randn_like(leaves[2])

        def step(backend, warmup, leaves=leaves, dout=dout, nb=nb):
            def run():
                with forced(backend):
                    out, kl = msa_attention(*leaves, nb, warmup=warmup, compute_kl=True)
                    g = torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))
                return (out, kl, *g)

            return run

        row = {"S": S, "B": B, "blocks": nb}
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
        row["all_blocks_backends"] = dict(RESOLVED)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del leaves, xs
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": bench.environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
