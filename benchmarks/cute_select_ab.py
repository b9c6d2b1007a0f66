"""Selection kernels side by side on one GPU (ms and TFLOP/s by the SELECT formula).

    PYTHONPATH=src python3 benchmarks/cute_select_ab.py

Times the CuTe and the Triton selection on the same inputs (paper shape at 128K, anchor shape
at 32K; random and local inputs; top_k 16 and 64) and says whether their indices are equal
(they may differ by near-ties: the GPU tests check that).
"""

import dataclasses

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
            cfg = Config(
                block_size=bench.BLOCK,
                softmax_scale=D**-0.5,
                max_seqlen=S,
                proxy_scale=Dp**-0.5,
                top_k=bench.TOP_K,
                warmup=False,
                compute_kl=True,
            )
            flops = 2 * Dp * Hp * S * (S + 1) / 2
            variants = {}
            for top_k in (bench.TOP_K, 64):
                args = (qp, kp, cu, dataclasses.replace(cfg, top_k=top_k))
                variants[f"cute k={top_k}"] = lambda args=args: cute_sel.select(*args)
                variants[f"triton k={top_k}"] = lambda args=args: triton_sel.select(*args)
            first = {}
            for name, fn in variants.items():
                idx = fn()
                torch.cuda.synchronize()
                k = name.split("=")[1]
                first.setdefault(k, idx)
                same = torch.equal(idx, first[k])
                ms = bench._time(fn, warmup=2, iters=10)
                print(
                    f"{shape} S={S} {kind} {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
                    f"indices equal to CuTe's: {same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
