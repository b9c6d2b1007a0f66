"""Selection kernels side by side on one GPU: every line verified on its own output, then timed
(ms and TFLOP/s by the SELECT formula).

    PYTHONPATH=src python3 benchmarks/cute_select_ab.py

Times the CuTe and the Triton selection on the same inputs (paper shape at 128K, anchor shape
at 32K; random and local inputs; top_k 16 and 64), and the CuTe kernel with other key-pipeline
depths (``SelectSm90(stages=)``, the constructor argument; 4 is the default) at top_k 16.

Verification, per line and before it is timed, on that line's own output (a NaN-like poisoned
index buffer, ``testing.POISON_INT``): every slot written, and every (token, head) row's block
set equal to the torch reference's or different only by near-ties
(``testing.selection_mismatch``, scores recomputed in fp64). The line prints the number of
failing rows and PASS or FAIL; a failing line is not timed.
"""

import dataclasses
import functools

import torch

from flash_msa import bench, reference, testing
from flash_msa.cute import select_sm90
from flash_msa.triton_ref import selection as triton_sel

STAGES = (2, 6)  # key-pipeline depths timed besides the default (SelectSm90.stages), top_k 16


def median_ms(fn):
    """Median of 10 timed calls after 2 warm-up calls (``flash_msa.bench.time_ms``)."""
    return bench.time_ms(fn, iters=10)


def verify(idx, ref, qp, kp, cu, cfg):
    """``(ok, text)``: the line's indices against the reference's ``ref`` (near-ties pass)."""
    unwritten = int((idx == testing.POISON_INT).sum())
    bad = testing.selection_mismatch(
        idx.cpu(), ref.cpu(), qp.cpu(), kp.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )
    ok = unwritten == 0 and bad == 0
    text = f"{'PASS' if ok else 'FAIL'} rows differing beyond near-ties {bad}"
    return ok, text + (f", unwritten slots {unwritten}" if unwritten else "")


def main():
    cases = [("paper", 131072), ("anchor", 32768)]
    for shape, S in cases:
        _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
        for kind in ("random", "local"):
            qp, kp = testing.make_inputs(
                1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", kind=kind, seed=0
            )[:2]
            qp, kp = qp[0].contiguous(), kp[0].contiguous()
            cu = testing.cu([S], "cuda")
            cfg = bench.step_config(S, D, Dp)
            flops = 2 * Dp * Hp * S * (S + 1) / 2
            lines = []  # (name, cfg, function writing the indices into a given buffer)
            for top_k in (bench.TOP_K, 64):
                c = dataclasses.replace(cfg, top_k=top_k)
                lines.append((f"cute k={top_k}", c, select_sm90.select_into))
                lines.append((f"triton k={top_k}", c, triton_sel.select_into))
            for stages in STAGES:
                variant = functools.partial(select_sm90.select_into, stages=stages)
                lines.append((f"cute k={bench.TOP_K} stages={stages}", cfg, variant))
            refs = {}  # top_k -> the reference's indices
            for name, c, select_into in lines:
                out = testing.poisoned((S, Hp, c.top_k), torch.int32, "cuda")
                select_into(out, qp, kp, cu, c)
                torch.cuda.synchronize()
                if c.top_k not in refs:
                    refs[c.top_k] = reference.select(qp, kp, cu, c)
                ok, text = verify(out, refs[c.top_k], qp, kp, cu, c)
                head = f"{shape} S={S} {kind} {name}: {text}"
                if not ok:
                    print(f"{head}; NOT TIMED", flush=True)
                    continue
                ms = median_ms(functools.partial(select_into, out, qp, kp, cu, c))
                print(f"{head}; {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
