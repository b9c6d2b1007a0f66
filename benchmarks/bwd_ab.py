"""Backward op A/B on one GPU: the CuTe fused backward against the Triton backward (main pass +
proxy pass) on the same saved forward, in one run, interleaved.

Usage: ``python benchmarks/bwd_ab.py [--out FILE.json] [--iters N] [--cases anchor:16384 ...]
[--variants cute "cute v2" ...]``. For each case (shape:seqlen, random inputs, top_k 16, block
128): selection and forward on CuTe, then the whole ``bwd`` op of Triton and of each CuTe
variant (the kernel's A/B switches, ``VARIANTS``) with ``dout`` and ``dkl`` given (all five
gradients: glue included, i.e. the work list, Delta, zero-fills and casts), timed in turn, twice
(A B A B), by CUDA events (``flash_msa.bench.time_ms``). TFLOP/s by the BWD formula ``10 * D *
H * pairs`` (the proxy gradient's FLOPs are not counted, as in ``flash-msa bench``). Before
timing, each CuTe variant's gradients are compared to Triton's (max abs difference relative to
Triton's max abs); one further than ``MAX_REL_DIFF`` is reported and not timed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from flash_msa import backends, testing
from flash_msa.bench import sparse_pairs, step_config, time_ms
from flash_msa.problem import Saved

SHAPES = {  # H, Hkv, Hp, Hpk, D, Dp
    "anchor": (16, 2, 4, 1, 128, 128),
    "paper": (64, 4, 4, 1, 128, 128),
}


def _variants() -> dict:
    from flash_msa.cute.bwd_sm90 import BwdSm90

    return {("cute" if n == "default" else f"cute {n}"): v for n, v in BwdSm90.VARIANTS.items()}


VARIANTS = _variants()  # CuTe providers: the kernel's A/B switches (BwdSm90.VARIANTS)
# measurement only: what the dQ / dQ_proxy reductions cost (wrong gradients: timed unverified)
PROBES = {"cute no_dq_red": dict(probe="no_dq_red"), "cute dq_store": dict(probe="dq_store")}
MAX_REL_DIFF = 1e-2  # a variant further than this from Triton's gradients is reported, not timed


def setup(shape: str, S: int):
    """Random inputs of one case (top_k 16, block 128), selection and forward on CuTe:
    ``(saved, cu_seqlens, cfg, dout, dkl)``, the arguments of a ``bwd`` op after ``dout, dkl``."""
    H, Hkv, Hp, Hpk, D, Dp = SHAPES[shape]
    cute_be = backends.load("cute")[0]
    qp, kp, q, k, v = (
        x[0].contiguous()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", seed=0)
    )
    cu = testing.cu([S], "cuda")
    cfg = step_config(S, D, Dp)
    idx = cute_be.select(qp, kp, cu, cfg)
    f = cute_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
    saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, None)
    dout, dkl = testing.loss_weights(q.shape, Hp * S, 0, q.device)
    dout, dkl = dout.to(q.dtype), torch.tensor(dkl, dtype=torch.float32, device="cuda")
    return saved, cu, cfg, dout, dkl


def case(shape: str, S: int, iters: int, variants: list[str]) -> dict:
    from flash_msa.cute import bwd_sm90

    H, D = SHAPES[shape][0], SHAPES[shape][4]
    triton_be = backends.load("triton")[0]
    saved, cu, cfg, dout, dkl = setup(shape, S)
    idx = saved.indices
    fns = {"triton": triton_be.bwd}
    for name in variants:
        fns[name] = lambda *a, _v={**VARIANTS, **PROBES}[name]: bwd_sm90.bwd(*a, **_v)
    names = ("dq", "dk", "dv", "dq_proxy", "dk_proxy")
    ref = fns["triton"](dout, dkl, saved, cu, cfg)
    res = dict(shape=shape, S=S, rel_diff_vs_triton={})
    for name in (n for n in variants if n not in PROBES):
        grads = fns[name](dout, dkl, saved, cu, cfg)
        rel = {
            n: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for n, a, b in zip(names, grads, ref)
        }
        res["rel_diff_vs_triton"][name] = rel
        if not max(rel.values()) <= MAX_REL_DIFF:  # (NaN fails too)
            print(f"[verify] {shape} {S} {name}: MISMATCH {rel}: not timed", file=sys.stderr)
            del fns[name]
    del ref
    pairs = sparse_pairs(idx[None], S, cfg.block_size)
    flop = 10 * D * H * pairs
    ms = {name: [] for name in fns}
    for _ in range(2):
        for name, fn in fns.items():
            ms[name].append(time_ms(lambda fn=fn: fn(dout, dkl, saved, cu, cfg), iters=iters))
    for name, t in ms.items():
        res[name] = dict(ms=t, tflops=flop / min(t) / 1e9)
    for name in ms:
        if name != "triton":
            res[name]["speedup_vs_triton"] = min(ms["triton"]) / min(ms[name])
    return res


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=["anchor:16384", "anchor:32768", "paper:32768"])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["cute"],
        choices=[*VARIANTS, *PROBES],
        help="CuTe providers",
    )
    args = ap.parse_args(argv)
    run_cases(lambda shape, S: case(shape, S, args.iters, args.variants), args.cases, args.out)
    return 0


def run_cases(case_fn, cases, out) -> list:
    """``case_fn(shape, S)`` for each ``"shape:S"`` of ``cases``, each row printed as JSON when
    done, all of them written to ``out`` (``{"rows": [...], "device": ...}``) if given."""
    rows = []
    for c in cases:
        shape, S = c.split(":")
        rows.append(case_fn(shape, int(S)))
        print(json.dumps(rows[-1]), flush=True)
    if out:
        with open(out, "w") as fh:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), fh, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
