"""Per-gradient max errors of the CuTe and Triton backwards against the fp64 reference (and the
same-dtype reference's), bf16, on the layouts of ``tests/ops/test_bwd.py``: a debugging
view of what the tests check by the rule. Run from the repository root on a GPU:
``python benchmarks/bwd_errors.py``."""

import sys
import traceback

import torch

sys.path.insert(0, "tests")
from flash_msa import backends, reference
from flash_msa.problem import Saved
from harness import GRADS, config, incoming, packed_inputs, references, results
from test_gpu_cute_bwd import CASES  # the layouts the GPU tests check

cute_be, triton_be = backends.load("cute")[0], backends.load("triton")[0]
for name, (lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k) in CASES.items():
    try:
        (qp, kp, q, k, v), cu = packed_inputs(
            lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda", seed=1
        )
        cfg = config(max(lengths), D, Dp, b, top_k)
        idx = reference.select(qp, kp, cu, cfg)
        fwd = triton_be.fwd(q, k, v, idx, cu, cfg, qp, kp)
        saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, None)
        dout, dkl = incoming(q, Hp, 1)
        exact, same = references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl)
        gc = results(fwd, cute_be.bwd(dout, dkl, saved, cu, cfg))
        gt = results(fwd, triton_be.bwd(dout, dkl, saved, cu, cfg))
        torch.cuda.synchronize()
        for n in GRADS:
            ex = exact[n].double()
            ec = (gc[n].double() - ex).abs()
            et = (gt[n].double() - ex).abs()
            es = (same[n].double() - ex).abs()
            loc = tuple(int(i) for i in torch.unravel_index(ec.argmax(), ec.shape))
            at = gc[n].double()[loc], ex[loc]
            print(
                f"{name:14s} {n:9s} max|ex| {ex.abs().max():.3e} cute {ec.max():.3e} "
                f"triton {et.max():.3e} same {es.max():.3e} nan {int(torch.isnan(gc[n]).sum())} "
                f"argmax {loc} cute/ex there {at[0]:.4e}/{at[1]:.4e}",
                flush=True,
            )
    except Exception:
        traceback.print_exc()
