"""Selection kernels side by side on one GPU (ms and TFLOP/s by the SELECT formula).

    PYTHONPATH=src python3 benchmarks/cute_select_ab.py

Times the CuTe selection with each value of its ``SPLIT_ROWS`` knob and the Triton selection on
the same inputs (paper shape at 128K, anchor shape at 32K; random and local inputs), after
checking that every variant returns the same indices as the first one (no near-tie swaps
expected between the two CuTe variants: they compute the same scores).
"""

import torch

from flash_msa import bench, testing
from flash_msa.cute import selection as cute_sel
from flash_msa.problem import Config
from flash_msa.triton_ref import selection as triton_sel


def main():
    cases = [("paper", 131072), ("anchor", 32768)]
    for shape, S in cases:
        _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
        for kind in ("random", "local"):
            qp, kp = testing.make_inputs(
                1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", kind=kind, seed=0
            )[:2]
            qp, kp = qp[0].contiguous(), kp[0].contiguous()
            cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
            cfg = Config(bench.BLOCK, D**-0.5, S, Dp**-0.5, bench.TOP_K, False, True)
            flops = 2 * Dp * Hp * S * (S + 1) / 2
            args = (qp, kp, cu, cfg)
            variants = {}
            for split in (True, False):

                def run(split=split, args=args):
                    cute_sel.SPLIT_ROWS = split
                    return cute_sel.select(*args)

                variants[f"cute split_rows={split}"] = run
            variants["triton"] = lambda args=args: triton_sel.select(*args)
            first = None
            for name, fn in variants.items():
                idx = fn()
                torch.cuda.synchronize()
                if first is None:
                    first = idx
                same = torch.equal(idx, first)
                ms = bench._time(fn, warmup=2, iters=10)
                print(
                    f"{shape} S={S} {kind} {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
                    f"indices equal to the first variant's: {same}",
                    flush=True,
                )
    cute_sel.SPLIT_ROWS = True


if __name__ == "__main__":
    main()
