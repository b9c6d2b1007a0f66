"""Compile every Triton kernel of the package for sm_90a without a GPU and report resources.

Run as ``python -m flash_msa.triton_ref.compile_check [prefix]`` in a process *without*
``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions). For each kernel
configuration it compiles the tile candidates in the order the host code tries them
(``tiles.pick``) and prints one JSON line for the one that would run: name, tile, registers,
spill bytes (stack + local), shared memory, whether the PTX uses wgmma. Exit status 1 if a
configuration has no spill-free candidate or exceeds the shared memory of a block.

Query map (context parallelism): the sparse kernels' default configurations compile with the
map's pointers as constexpr ``None`` (what the host passes without a map, so the binary checked
is the one that runs, unchanged by the map's code); the ``-qmap`` configurations (``HAS_QMAP``,
the pointers int32) cover the selection and the shapes and families of :data:`QMAP_FAMILIES`.
"""

from __future__ import annotations

import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..cubin import SHARED_LIMIT
from ..cubin import resources as cubin_resources


def _resources(cubin: bytes) -> dict:
    res = cubin_resources(cubin)
    return {"registers": res["reg"], "spill_bytes": res["stack"] + res["local"]}


def compile_kernel(
    fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int = 90
) -> dict:
    """Compile ``fn`` for ``sm_{arch}a``; returns resource usage and whether wgmma is used.

    Pointer arguments are marked 16-byte aligned, as the JIT specializes them for torch's
    allocations: without that, loads and atomics compile to scalar instructions and the
    register and shared-memory counts do not describe the kernel that runs."""
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    return dict(
        _resources(k.asm["cubin"]), shared_bytes=k.metadata.shared, wgmma="wgmma" in k.asm["ptx"]
    )


# The "-qmap" configurations (HAS_QMAP: query-map kernels of context parallelism), at D = 128
# and block 128: every sparse family except CuTe's proxy-only forward (which takes no map) at
# the anchor shape; the training step's kernels at the paper shape. Cold compiles on the 2-core
# CPU machine: ~60 s for these (the paper bwd alone ~23 s: 8 tile candidates), so not more.
QMAP_FAMILIES = {
    "anchor": ("fwd", "bwd", "bwd-det", "kl", "kl+grad", "proxy-grad", "kl+grad-det",
               "proxy-grad-det"),
    "paper": ("fwd", "bwd", "kl+grad"),
}  # fmt: skip


def configurations():
    """(name, fn, signature, candidates) of every shipped kernel configuration; a candidate is
    ``(tile, constexprs, num_warps, num_stages)``, in the order the host code tries them
    (``tiles.pick`` runs the first that compiles without spills)."""
    from .. import ordered
    from ..worklist import geometry
    from . import dense, proxy, selection, sparse_bwd, sparse_fwd, tiles

    # without a query map its pointers are constexpr None (as the host passes them)
    no_qmap = dict.fromkeys(selection.QMAP_ARGS, None) | dict(HAS_QMAP=False)
    for Dp in (64, 128):
        for block in (64, 128):
            for top_k in (16, 64):
                for G in (1, 4):
                    consts, warps, stages = selection.launch_config(G, Dp, block, top_k, "bf16")
                    variants = [("", dict(consts, **no_qmap))]
                    if Dp == 128 and block == 128 and top_k == 16:
                        variants.append(("-qmap", dict(consts, HAS_QMAP=True)))
                    for suffix, consts in variants:
                        cands = [(w, consts, w, stages) for w in selection.warp_candidates(warps)]
                        yield (
                            f"select{suffix} bf16 Dp={Dp} b={block} k={top_k} G={G}",
                            selection._select_kernel,
                            selection.SIGNATURE("bf16"),
                            cands,
                        )
    # (name, H, Hkv, Hs, Hpk): the anchor and paper shapes, and a selection spanning 2 KV heads
    shapes = [("anchor", 16, 2, 4, 1), ("paper", 64, 4, 4, 1), ("Hs<Hkv", 8, 4, 2, 1)]
    for name, H, Hkv, Hs, Hpk in shapes:
        for D in (64, 128):
            for block in (64, 128):
                tag = f"{name} D={D} b={block}"
                base = dict(H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, K=16, D=D, Dp=D, BLOCK=block)
                base.update(PREC="tf32")

                def maps(fam, name=name, D=D, block=block):
                    """(suffix, constexprs): without a map (QMAP a constexpr None), then with
                    one where QMAP_FAMILIES asks for it."""
                    yield "", dict(QMAP=None, HAS_QMAP=False)
                    fams = QMAP_FAMILIES.get(name, ())
                    if D == 128 and block == 128 and fam in fams:
                        yield "-qmap", dict(HAS_QMAP=True)

                def geo(rows, H=H, Hkv=Hkv, Hs=Hs):
                    return dict(zip(("G", "G2", "R", "BT"), geometry(H, Hkv, Hs, rows)))

                for fam, has_main in (("fwd", True), ("fwd-proxy-only", False)):
                    for q, qconsts in maps(fam):
                        fixed = dict(base, HAS_PROXY=True, PREFETCH=sparse_fwd.FWD_PREFETCH)
                        fixed.update(HAS_MAIN=has_main, **qconsts)
                        cands = [
                            (t, dict(fixed, OUT_SPLIT=t[1], **geo(t[0])), 8, sparse_fwd.FWD_STAGES)
                            for t in sparse_fwd.fwd_tiles(has_main)
                        ]
                        sig = sparse_fwd.SIGNATURE["fwd"]
                        yield f"{fam}{q} {tag}", sparse_fwd._fwd_kernel, sig, cands
                # deterministic mode (ordered.py): the same kernels storing partials ("-det")
                for det, suffix in ((False, ""), (True, "-det")):
                    for q, qconsts in maps(f"bwd{suffix}"):
                        fixed = dict(base, PREFETCH=sparse_bwd.BWD_PREFETCH, DETERMINISTIC=det)
                        fixed.update(qconsts)
                        stages = sparse_bwd.BWD_STAGES
                        cands = [
                            (t, dict(fixed, BN=t[1], DQ_SPLIT=t[2], **geo(t[0])), 8, stages)
                            for t in tiles.fitting(sparse_bwd.BWD_TILES, block)
                        ]
                        fn, sig = sparse_bwd._bwd_kernel, sparse_bwd.SIGNATURE
                        yield f"bwd{suffix}{q} {tag}", fn, sig, cands
                modes = (
                    ("kl", True, False, False),
                    ("kl+grad", True, True, False),
                    ("proxy-grad", False, True, False),
                    ("kl+grad-det", True, True, True),
                    ("proxy-grad-det", False, True, True),
                )
                for mode, kl_value, grad, det in modes:
                    for q, qconsts in maps(mode):
                        fixed = dict(base, KL_VALUE=kl_value, GRAD=grad, DETERMINISTIC=det)
                        fixed.update(qconsts)
                        cands = [
                            (t, dict(fixed, BN=t[1], PREFETCH=t[2], **geo(t[0])), 8, 1)
                            for t in tiles.fitting(proxy.PROXY_TILES, block)
                        ]
                        yield f"{mode}{q} {tag}", proxy._proxy_kernel, proxy.SIGNATURE, cands

    for D in (64, 128):
        common = dict(D=D, PREC="tf32")
        fwd_consts = dict(common, BM=dense.BM, BN=dense.BN, H=16, Hk=2, HAS_V=True)
        yield (
            f"dense-fwd D={D}",
            dense._dense_fwd_kernel,
            dense.SIGNATURE["fwd"],
            [((dense.BM, dense.BN), fwd_consts, 4, 3)],
        )
        for det, suffix in ((False, ""), (True, "-det")):
            consts = dict(common, H=16, Hkv=2, DETERMINISTIC=det)
            cands = [(t, dict(consts, BM=t[0], BN=t[1]), t[2], 3) for t in dense.DENSE_TILES]
            yield f"dense-bwd{suffix} D={D}", dense._dense_bwd_kernel, dense.SIGNATURE["bwd"], cands
        cands = [
            (t, dict(common, H=16, Hkv=2, BM=t[0], BN=t[1]), t[2], 3) for t in dense.DENSE_TILES
        ]
        yield f"dense-bwd-dq D={D}", dense._dense_bwd_dq_kernel, dense.SIGNATURE["bwd-dq"], cands
        proxy_consts = dict(common, H=16, Hkv=2, Hs=4, Hpk=1, Dp=D)
        fams = (  # deterministic mode: dq_proxy in the usual kernel, dk_proxy key-outer
            ("dense-proxy", dense._dense_proxy_kernel, dict(KL_VALUE=True, DK_PROXY=True)),
            ("dense-proxy-det", dense._dense_proxy_kernel, dict(KL_VALUE=False, DK_PROXY=False)),
            ("dense-proxy-dk", dense._dense_proxy_dk_kernel, {}),
        )
        for fam, fn, extra in fams:
            extra = dict(extra, GRAD=True)
            cands = []
            for t in dense.DENSE_TILES:
                G, G2, R, BT = geometry(16, 2, 4, t[0])
                consts = dict(proxy_consts, **extra, G=G, G2=G2, R=R, BT=BT, BN=t[1])
                stages = dense.PROXY_DK_STAGES if fam == "dense-proxy-dk" else 3  # as dense.py
                cands.append((t, consts, t[2], stages))
            sig = dense.SIGNATURE["proxy-dk" if fam == "dense-proxy-dk" else "proxy"]
            yield f"{fam} D={D}", fn, sig, cands
    for K in (16, 64):
        HB = sparse_fwd.combine_heads(16, K)
        consts = dict(H=16, Hs=4, K=K, KP2=K, D=128, G=4, HB=HB, HAS_O=True)
        yield (
            f"combine K={K} D=128",
            sparse_fwd._combine_kernel,
            sparse_fwd.SIGNATURE["combine"],
            [(HB, consts, 4, 1)],
        )
    # deterministic mode's ordered reductions (anchor heads; K = 16 slots, 2 key parts)
    for D in (64, 128):
        for out, acc in (("bf16", False), ("fp32", True)):  # dQ (written), dQ_proxy (added)
            HB = ordered.slot_heads(16, D)
            consts = dict(HP=16, HO=16, G=4, Hs=4, K=16, S=2, D=D, HB=HB)
            consts.update(HAS_IDX=not acc, ACCUMULATE=acc)
            sig = dict(ordered.SIGNATURE["slot_sum"], OUT=f"*{out}")
            yield f"slot-sum {out} D={D}", ordered._slot_sum_kernel, sig, [(HB, consts, 4, 1)]
        for block in (64, 128):
            RB = ordered.item_rows(block, D)
            consts = dict(HO=2, D=D, NG=2, RP=1, BLOCK=block, RB=RB, TWO=True)
            sig = ordered.SIGNATURE["item_sum"]
            yield f"item-sum D={D} b={block}", ordered._item_sum_kernel, sig, [(RB, consts, 4, 1)]


def choose(fn, sig, cands) -> dict:
    """Compile the candidates in order; the first without spills (as ``tiles.pick`` chooses at
    run time), else the last one. Returns its resources plus ``tile`` and ``tried``."""
    for i, (tile, consts, warps, stages) in enumerate(cands):
        res = compile_kernel(fn, sig, consts, warps, stages)
        if res["spill_bytes"] == 0 and res["shared_bytes"] <= SHARED_LIMIT or i == len(cands) - 1:
            return dict(res, tile=tile, tried=i + 1)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # a kernel-name prefix, e.g. "bwd"
    bad = 0
    for name, fn, sig, cands in configurations():
        if not name.startswith(only):
            continue
        res = choose(fn, sig, cands)
        bad += res["spill_bytes"] > 0 or res["shared_bytes"] > SHARED_LIMIT
        print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
