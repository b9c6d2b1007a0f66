"""Sparse forward kernels side by side on one GPU (ms and TFLOP/s by the FWD formula).

    PYTHONPATH=src python3 benchmarks/cute_fwd_ab.py [--quick]
    ncu --clock-control none -k regex:partials python3 benchmarks/cute_fwd_ab.py --profile

``--profile`` only runs the CuTe partials (anchor 32K random, three launches) for a profiler;
``--breakdown`` prints the kernels of one CuTe forward op (torch.profiler) at anchor and paper 32K.

For the anchor and paper shapes at S=32K and 128K (random and local inputs, top_k 16), times
  * the per-block partials alone (all S tokens in one launch): the CuTe kernel (and its
    variants: one query-row buffer, partials stored without shared-memory staging, 1-3
    warpgroups per CTA)
    and the Triton kernel (main attention only, no proxy), on the same work list;
  * the whole forward op without selection (partials, combine, proxy LSE, KL value): Triton's,
    and the CuTe one (CuTe partials + Triton's other passes).
TFLOP/s are by FWD = 4*D*H*sparse pairs for every line (for the ops this leaves out the
proxy LSE and KL work, so it understates them).
Outputs of the two ops are compared (max abs difference of ``out``).
"""

import sys

import torch

from flash_msa import bench, testing, worklist
from flash_msa.cute import sparse_fwd as cute_fwd
from flash_msa.problem import Config
from flash_msa.triton_ref import selection as tri_sel
from flash_msa.triton_ref import sparse_fwd as tri_fwd


def run_case(shape, S, kind, profile=False, breakdown=False):
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    qp, kp, q, k, v = (
        x[0].contiguous()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", kind=kind, seed=0)
    )
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
    idx = tri_sel.select(qp, kp, cu, cfg)
    pairs = bench.sparse_pairs(idx[None], S, bench.BLOCK)
    flops = 4 * D * H * pairs
    K = cfg.top_k
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS)
    # the partials alone run over all S tokens at once (buffers of S*H*K*D elements: 34 GB at
    # paper 128K; the op itself works in chunks of at most PARTIAL_BYTES)
    o_part = torch.empty((S, H, K, D), dtype=q.dtype, device="cuda")
    l_part = torch.empty((S, H, K), dtype=torch.float32, device="cuda")
    G, G2, R, BT = worklist.geometry(H, Hkv, Hp, 128)
    items = (wl.perm, wl.item_list, wl.item_start, wl.item_end, wl.block_start,
             wl.block_end)  # fmt: skip

    def tri_partials():
        tri_fwd._fwd_kernel[(wl.num_items,)](
            q, k, v, q, k, *items, o_part, l_part, l_part, cfg.softmax_scale, 1.0, 0,
            H=H, Hkv=Hkv, Hs=Hp, Hpk=1, K=K, D=D, Dp=16, G=G, G2=G2, R=R,
            BLOCK=cfg.block_size, BT=BT, NB=wl.num_blocks, PREC="tf32",
            HAS_PROXY=False, PREFETCH=tri_fwd.FWD_PREFETCH, HAS_MAIN=True,
            num_warps=8, num_stages=tri_fwd.FWD_STAGES,
        )  # fmt: skip

    def cute_partials():
        cute_fwd.partials(q, k, v, wl, o_part, l_part, Hp, cfg)

    def variant(**flags):  # the CuTe partials with module switches changed for this call
        def run():
            old = {name: getattr(cute_fwd, name) for name in flags}
            try:
                for name, value in flags.items():
                    setattr(cute_fwd, name, value)
                cute_fwd.partials(q, k, v, wl, o_part, l_part, Hp, cfg)
            finally:
                for name, value in old.items():
                    setattr(cute_fwd, name, value)

        return run

    def tri_op():
        return tri_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp)

    def cute_op():
        return cute_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp)

    if profile:
        for _ in range(3):
            cute_partials()
        torch.cuda.synchronize()
        return
    if breakdown:
        cute_op()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            cute_op()
            torch.cuda.synchronize()
        print(f"{shape} S={S} {kind}: kernels of one CuTe forward op")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                        max_name_column_width=50))  # fmt: skip
        return
    diff = (tri_op().out.float() - cute_op().out.float()).abs().max().item()
    runs = [
        ("partials triton", tri_partials),
        ("partials cute", cute_partials),
        ("partials cute q1", variant(Q_STAGES=1)),  # one query-row buffer
        ("partials cute direct", variant(STAGE_PARTIALS=False)),  # no smem staging
        ("partials cute wg1", variant(WARPGROUPS=1)),
        ("partials cute wg2", variant(WARPGROUPS=2)),
        ("partials cute wg3", variant(WARPGROUPS=3)),
        ("fwd op triton", tri_op),
        ("fwd op cute", cute_op),
    ]
    for name, fn in runs:
        ms = bench._time(fn, warmup=2, iters=10)
        print(
            f"{shape} S={S} {kind} {name}: {ms:.3f} ms, "
            f"{flops / ms / 1e9:.0f} TFLOP/s (FWD formula), |out diff| {diff:.2e}",
            flush=True,
        )


def main():
    if "--profile" in sys.argv:
        return run_case("anchor", 32768, "random", profile=True)
    if "--breakdown" in sys.argv:
        for shape in ("anchor", "paper"):
            run_case(shape, 32768, "random", breakdown=True)
        return
    quick = "--quick" in sys.argv
    cases = [("anchor", 32768), ("paper", 32768)]
    if not quick:
        cases += [("anchor", 131072), ("paper", 131072)]
    for shape, S in cases:
        for kind in ("random", "local"):
            run_case(shape, S, kind)


if __name__ == "__main__":
    main()
