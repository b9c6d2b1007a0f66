"""Compile every Triton kernel of the package for a GPU target without a GPU; report resources.

Run as ``python -m flash_msa.triton_ref.compile_check [prefix] [--arch 90] [options]`` in a
process *without* ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions).
For each kernel configuration it compiles the tile candidates in the order the host code tries
them (``tiles.pick``) for ``sm_{arch}`` (default 90, i.e. sm_90a; 80, 86, 89, 100 and 120 too)
and prints one JSON line for the one that would run there (the first without spills within
that target's shared memory per block, ``tiles.SHARED_LIMITS``, or ``--smem-limit``): name,
tile, registers, spill bytes (stack + local), shared memory, whether the PTX uses wgmma, which
MMA instruction family it uses. ``--layouts anchor,paper`` keeps the sparse and dense kernels
of those head layouts only (and the selection's proxy-head groups of them), ``--dims 128`` the
head dim 128 only, ``--blocks 128`` the block size 128 only, ``--no-qmap`` drops the query-map
kernels; ``--any`` walks each list from its end (is some candidate spill-free, not which one
runs; the CI check of the other targets). Exit status 1 if a configuration has no spill-free
candidate within the shared memory, 3 if the installed Triton cannot compile for the target
(the reason on stderr).

``--dtype fp32`` (or ``fp16``) compiles every kernel for inputs of that dtype (default bf16;
fp16 has bf16's bytes per tile). fp32 inputs take IEEE fp32 products (``PREC="ieee"``: no
tensor cores) and twice the shared memory per operand tile, and they spill registers on every
target (``tiles.pick`` then runs the last candidate that fits), so for fp32 the rule is only
the shared memory: exit status 1 if a configuration has no candidate within it (issue 18: the
fp32 dense backward at D = 128 had none under 99 KB and died in Triton at launch).
``--shared-only`` stops each compile after the LLVM IR, where Triton fixes the shared memory
(no ptxas: registers and spills are not reported, -1; ptxas takes up to ~35 s on a spilling
fp32 kernel, the IR ~1-4 s).

Query map (context parallelism): the sparse kernels' default configurations compile with the
map's pointers as constexpr ``None`` (what the host passes without a map, so the binary checked
is the one that runs, unchanged by the map's code); the ``-qmap`` configurations (``HAS_QMAP``,
the pointers int32) cover the selection and the shapes and families of :data:`QMAP_FAMILIES`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..cubin import resources as cubin_resources
from .tiles import SHARED_LIMITS

# (H, Hkv, Hs, Hpk) of the head layouts checked: the anchor and paper shapes, and a selection
# spanning 2 KV heads
LAYOUTS = {"anchor": (16, 2, 4, 1), "paper": (64, 4, 4, 1), "Hs<Hkv": (8, 4, 2, 1)}
DENSE_LAYOUTS = ("anchor", "paper")  # the warmup kernels' head layouts
UNSUPPORTED = 3  # exit status when the installed Triton cannot compile for the target
DTYPES = ("bf16", "fp16", "fp32")  # input dtypes (--dtype)


def mma_kind(ptx: str) -> str | None:
    """The tensor-core instruction family a PTX uses: ``tcgen05`` (sm_100), ``wgmma`` (sm_90),
    ``mma.sync`` (sm_80 and later without the other two) or ``None``."""
    for kind in ("tcgen05.mma", "wgmma", "mma.sync"):
        if kind in ptx:
            return kind.removesuffix(".mma")
    return None


def _resources(cubin: bytes) -> dict:
    res = cubin_resources(cubin)
    return {"registers": res["reg"], "spill_bytes": res["stack"] + res["local"]}


class _SharedKnown(Exception):
    """Raised in place of the PTX stage by :func:`compile_kernel` with ``shared_only``: carries
    the shared memory Triton fixed in the LLVM IR stage."""


def _stop_after_llir(*args):
    """Triton's ``add_stages_inspection_hook``: without arguments the cache-key suffix, else
    replace the ``ptx`` stage by raising :class:`_SharedKnown` (and drop ``cubin``)."""
    if not args:
        return "-flash-msa-shared-only", "flash-msa-shared-only"
    stages = args[1]

    def stop(src, metadata):
        raise _SharedKnown(metadata["shared"])

    stages["ptx"] = stop
    stages.pop("cubin", None)


def compile_kernel(
    fn,
    signature: dict,
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    arch: int = 90,
    shared_only: bool = False,
) -> dict:
    """Compile ``fn`` for ``sm_{arch}`` (Triton adds the ``a`` of sm_90a and later); returns
    resource usage, whether wgmma is used and the MMA family (:func:`mma_kind`).

    Pointer arguments are marked 16-byte aligned, as the JIT specializes them for torch's
    allocations: without that, loads and atomics compile to scalar instructions and the
    register and shared-memory counts do not describe the kernel that runs.

    ``shared_only``: stop after the LLVM IR (no PTX, no ptxas) where the installed Triton has
    ``knobs.runtime.add_stages_inspection_hook``; registers and spill bytes are then -1, the
    MMA family ``None``."""
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = shared_only and hasattr(runtime, "add_stages_inspection_hook")
    if hook:
        saved, runtime.add_stages_inspection_hook = (
            runtime.add_stages_inspection_hook,
            _stop_after_llir,
        )
    try:
        k = triton.compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    except _SharedKnown as known:
        unknown = dict(registers=-1, spill_bytes=-1, wgmma=False, mma=None)
        return dict(unknown, shared_bytes=known.args[0])
    finally:
        if hook:
            runtime.add_stages_inspection_hook = saved
    ptx = k.asm["ptx"]
    return dict(
        _resources(k.asm["cubin"]),
        shared_bytes=k.metadata.shared,
        wgmma="wgmma" in ptx,
        mma=mma_kind(ptx),
    )


def target_unsupported(arch: int) -> str | None:
    """Why the installed Triton cannot compile for ``sm_{arch}`` (its error's last line);
    ``None`` if it can (a one-line kernel is compiled to find out)."""
    import triton.language as tl

    @triton.jit
    def probe(X):
        tl.store(X, 1.0)

    try:
        compile_kernel(probe, {"X": "*fp32"}, {}, 1, 1, arch)
    except Exception as e:  # any failure: the target is not usable with this Triton
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        return f"triton {triton.__version__} cannot compile for sm_{arch}: {last[:300]}"
    return None


# The "-qmap" configurations (HAS_QMAP: query-map kernels of context parallelism), at D = 128
# and block 128: every sparse family except CuTe's proxy-only forward (which takes no map) at
# the anchor shape; the training step's kernels at the paper shape. Cold compiles on the 2-core
# CPU machine: ~60 s for these (the paper bwd alone ~23 s: 8 tile candidates), so not more.
QMAP_FAMILIES = {
    "anchor": ("fwd", "bwd", "bwd-det", "kl", "kl+grad", "proxy-grad", "kl+grad-det",
               "proxy-grad-det"),
    "paper": ("fwd", "bwd", "kl+grad"),
}  # fmt: skip


def configurations(layouts=None, dims=(64, 128), blocks=(64, 128), qmap=True, dtype="bf16"):
    """(name, fn, signature, candidates) of every shipped kernel configuration; a candidate is
    ``(tile, constexprs, num_warps, num_stages)``, in the order the host code tries them
    (``tiles.pick`` runs the first that compiles without spills and fits the shared memory).

    ``dtype`` (:data:`DTYPES`): the inputs' dtype; every ``*bf16`` pointer of the signatures
    (the inputs and the buffers of their dtype) becomes one of it, and fp32 takes IEEE products
    (``PREC="ieee"``) as the host code does; the selection's names carry it.

    ``layouts``: names of :data:`LAYOUTS` to check (default all); with a subset the selection
    is checked only for their proxy heads per proxy key head ``Hs / Hpk``. ``dims``: the head
    dims (``D = Dp``) checked, ``blocks`` the block sizes of the selection and the sparse
    kernels; ``qmap=False`` leaves out the ``-qmap`` configurations. The dense kernels hold one
    head per row, except the warmup proxy pass (``H / Hs`` heads per token): by default it is
    checked for the anchor layout (the shipped list), with ``layouts`` for those of
    :data:`DENSE_LAYOUTS` among them (named with the layout, except the anchor's)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {DTYPES}")
    for name, fn, sig, cands in _bf16_configurations(layouts, dims, blocks, qmap):
        if dtype == "bf16":
            yield name, fn, sig, cands
            continue
        sig = {k: f"*{dtype}" if t == "*bf16" else t for k, t in sig.items()}
        prec = "ieee" if dtype == "fp32" else "tf32"
        cands = [
            (t, dict(c, PREC=prec) if "PREC" in c else c, warps, stages)
            for t, c, warps, stages in cands
        ]
        yield name.replace("select bf16", f"select {dtype}"), fn, sig, cands


def _bf16_configurations(layouts, dims, blocks, qmap):
    """:func:`configurations` for bf16 inputs."""
    from .. import ordered
    from ..worklist import geometry
    from . import dense, proxy, selection, sparse_bwd, sparse_fwd, tiles

    if layouts is None:
        layouts, groups, dense_layouts = tuple(LAYOUTS), (1, 4), ("anchor",)
    else:
        dense_layouts = tuple(n for n in DENSE_LAYOUTS if n in layouts)
        unknown = set(layouts) - set(LAYOUTS)
        if unknown:
            raise ValueError(f"layouts: unknown {sorted(unknown)}; known: {list(LAYOUTS)}")
        groups = tuple(sorted({LAYOUTS[n][2] // LAYOUTS[n][3] for n in layouts}))
    # without a query map its pointers are constexpr None (as the host passes them)
    no_qmap = dict.fromkeys(selection.QMAP_ARGS, None) | dict(HAS_QMAP=False)
    for Dp in dims:
        for block in blocks:
            for top_k in (16, 64):
                for G in groups:
                    consts, warps, stages = selection.launch_config(G, Dp, block, top_k, "bf16")
                    variants = [("", dict(consts, **no_qmap))]
                    if qmap and Dp == 128 and block == 128 and top_k == 16:
                        variants.append(("-qmap", dict(consts, HAS_QMAP=True)))
                    for suffix, consts in variants:
                        cands = [
                            (t, dict(consts, BM=t[1], BT=t[1] // G), t[0], t[2])
                            for t in selection.tile_candidates(warps, stages, consts["BM"], G)
                        ]
                        yield (
                            f"select{suffix} bf16 Dp={Dp} b={block} k={top_k} G={G}",
                            selection._select_kernel,
                            selection.SIGNATURE("bf16"),
                            cands,
                        )
    for name in layouts:
        H, Hkv, Hs, Hpk = LAYOUTS[name]
        for D in dims:
            for block in blocks:
                tag = f"{name} D={D} b={block}"
                base = dict(H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, K=16, D=D, Dp=D, BLOCK=block)
                base.update(PREC="tf32")

                def maps(fam, name=name, D=D, block=block):
                    """(suffix, constexprs): without a map (QMAP a constexpr None), then with
                    one where QMAP_FAMILIES asks for it."""
                    yield "", dict(QMAP=None, HAS_QMAP=False)
                    fams = QMAP_FAMILIES.get(name, ()) if qmap else ()
                    if D == 128 and block == 128 and fam in fams:
                        yield "-qmap", dict(HAS_QMAP=True)

                def geo(rows, H=H, Hkv=Hkv, Hs=Hs):
                    return dict(zip(("G", "G2", "R", "BT"), geometry(H, Hkv, Hs, rows)))

                for fam, has_main in (("fwd", True), ("fwd-proxy-only", False)):
                    for q, qconsts in maps(fam):
                        fixed = dict(base, HAS_PROXY=True, PREFETCH=sparse_fwd.FWD_PREFETCH)
                        fixed.update(HAS_MAIN=has_main, **qconsts)
                        cands = []
                        for t in sparse_fwd.fwd_tiles(has_main):
                            consts = dict(fixed, OUT_SPLIT=t[1], **geo(t[0]))
                            warps = t[2] if len(t) > 2 else 8  # as sparse_fwd.py
                            cands.append((t, consts, warps, sparse_fwd.FWD_STAGES))
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
                        cands = []
                        for t in tiles.fitting(proxy.PROXY_TILES, block):
                            consts = dict(fixed, BN=t[1], PREFETCH=t[2], **geo(t[0]))
                            stages = t[3] if len(t) > 3 else 1  # else the callers' stages
                            cands.append((t, consts, 8, stages))
                        yield f"{mode}{q} {tag}", proxy._proxy_kernel, proxy.SIGNATURE, cands

    for D in dims:
        common = dict(D=D, PREC="tf32")
        fwd_consts = dict(common, H=16, Hk=2, HAS_V=True)
        cands = [
            (t, dict(fwd_consts, BM=t[0], BN=t[1]), t[2], dense.tile_stages(t))
            for t in dense.FWD_TILES
        ]
        yield f"dense-fwd D={D}", dense._dense_fwd_kernel, dense.SIGNATURE["fwd"], cands
        for det, suffix in ((False, ""), (True, "-det")):
            consts = dict(common, H=16, Hkv=2, DETERMINISTIC=det)
            cands = [
                (t, dict(consts, BM=t[0], BN=t[1]), t[2], dense.tile_stages(t))
                for t in dense.DENSE_TILES
            ]
            yield f"dense-bwd{suffix} D={D}", dense._dense_bwd_kernel, dense.SIGNATURE["bwd"], cands
        cands = [
            (t, dict(common, H=16, Hkv=2, BM=t[0], BN=t[1]), t[2], dense.tile_stages(t))
            for t in dense.DENSE_TILES
        ]
        yield f"dense-bwd-dq D={D}", dense._dense_bwd_dq_kernel, dense.SIGNATURE["bwd-dq"], cands
        fams = (  # deterministic mode: dq_proxy in the usual kernel, dk_proxy key-outer
            ("dense-proxy", dense._dense_proxy_kernel, dict(KL_VALUE=True, DK_PROXY=True)),
            ("dense-proxy-det", dense._dense_proxy_kernel, dict(KL_VALUE=False, DK_PROXY=False)),
            ("dense-proxy-dk", dense._dense_proxy_dk_kernel, {}),
        )
        for name in dense_layouts:
            H, Hkv, Hs, Hpk = LAYOUTS[name]
            proxy_consts = dict(common, H=H, Hkv=Hkv, Hs=Hs, Hpk=Hpk, Dp=D)
            tag = f"D={D}" if name == "anchor" else f"{name} D={D}"
            for fam, fn, extra in fams:
                extra = dict(extra, GRAD=True)
                cands = []
                for t in dense.DENSE_TILES:
                    G, G2, R, BT = geometry(H, Hkv, Hs, t[0])
                    consts = dict(proxy_consts, **extra, G=G, G2=G2, R=R, BT=BT, BN=t[1])
                    dk = fam == "dense-proxy-dk"  # its stages as dense.py's
                    stages = dense.tile_stages(t, dense.PROXY_DK_STAGES if dk else 3)
                    cands.append((t, consts, t[2], stages))
                sig = dense.SIGNATURE["proxy-dk" if fam == "dense-proxy-dk" else "proxy"]
                yield f"{fam} {tag}", fn, sig, cands
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
    for D in dims:
        for out, acc in (("bf16", False), ("fp32", True)):  # dQ (written), dQ_proxy (added)
            HB = ordered.slot_heads(16, D)
            consts = dict(HP=16, HO=16, G=4, Hs=4, K=16, S=2, D=D, HB=HB)
            consts.update(HAS_IDX=not acc, ACCUMULATE=acc)
            sig = dict(ordered.SIGNATURE["slot_sum"], OUT=f"*{out}")
            yield f"slot-sum {out} D={D}", ordered._slot_sum_kernel, sig, [(HB, consts, 4, 1)]
        for block in blocks:
            RB = ordered.item_rows(block, D)
            consts = dict(HO=2, D=D, NG=2, RP=1, BLOCK=block, RB=RB, TWO=True)
            sig = ordered.SIGNATURE["item_sum"]
            yield f"item-sum D={D} b={block}", ordered._item_sum_kernel, sig, [(RB, consts, 4, 1)]


def choose(
    fn,
    sig,
    cands,
    arch: int = 90,
    from_end: bool = False,
    limit=None,
    spills_ok: bool = False,
    shared_only: bool = False,
) -> dict:
    """Compile the candidates in order for ``sm_{arch}``; the first without spills within
    ``limit`` bytes of shared memory per block (default: the target's; as ``tiles.pick``
    chooses at run time), else the last one. Returns its resources plus ``tile`` and ``tried``
    (compiles). ``from_end``: walk the list from its end (the smallest tiles) instead: whether
    *some* candidate is spill-free and fits (then ``tiles.pick`` finds one) at about one
    compile per configuration. ``spills_ok``: the first that fits, spills or not (fp32: what
    ``tiles.pick`` needs to launch one); ``shared_only``: :func:`compile_kernel`'s (implies
    ``spills_ok``: spills are not known)."""
    limit = SHARED_LIMITS[arch] if limit is None else limit
    spills_ok = spills_ok or shared_only
    order = cands[::-1] if from_end else cands
    for i, (tile, consts, warps, stages) in enumerate(order):
        res = compile_kernel(fn, sig, consts, warps, stages, arch, shared_only)
        ok = spills_ok or res["spill_bytes"] == 0
        if ok and res["shared_bytes"] <= limit or i == len(order) - 1:
            return dict(res, tile=tile, tried=i + 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_msa.triton_ref.compile_check")
    parser.add_argument("prefix", nargs="?", default="", help='kernel-name prefix, e.g. "bwd"')
    parser.add_argument(
        "--arch", type=int, default=90, choices=sorted(SHARED_LIMITS), help="target sm_ARCH"
    )
    parser.add_argument("--layouts", help=f"comma-separated subset of {','.join(LAYOUTS)}")
    parser.add_argument("--dims", default="64,128", help="comma-separated head dims (D = Dp)")
    parser.add_argument("--blocks", default="64,128", help="comma-separated block sizes")
    parser.add_argument("--no-qmap", action="store_true", help="without the -qmap kernels")
    parser.add_argument(
        "--smem-limit",
        type=int,
        help="bytes of shared memory per block instead of the target's (FLASH_MSA_SMEM_LIMIT's "
        "cap: e.g. --arch 90 --smem-limit 101376 is what the capped GPU tests compile)",
    )
    parser.add_argument(
        "--any",
        action="store_true",
        help="walk each list from its end: is some candidate spill-free (not: which one runs)",
    )
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=DTYPES,
        help="input dtype (fp32: only the shared memory must fit; spills are reported)",
    )
    parser.add_argument(
        "--shared-only",
        action="store_true",
        help="stop after the LLVM IR: the shared memory only (no ptxas; registers, spills -1)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    why = target_unsupported(args.arch)
    if why is not None:
        print(why, file=sys.stderr)
        return UNSUPPORTED
    layouts = None if args.layouts is None else tuple(args.layouts.split(","))
    dims = tuple(int(d) for d in args.dims.split(","))
    blocks = tuple(int(b) for b in args.blocks.split(","))
    limit = SHARED_LIMITS[args.arch] if args.smem_limit is None else args.smem_limit
    spills_ok = args.dtype == "fp32" or args.shared_only  # fp32: tiles.pick runs a spiller
    bad = 0
    for name, fn, sig, cands in configurations(layouts, dims, blocks, not args.no_qmap, args.dtype):
        if not name.startswith(args.prefix):
            continue
        res = choose(fn, sig, cands, args.arch, args.any, limit, spills_ok, args.shared_only)
        bad += res["shared_bytes"] > limit or not spills_ok and res["spill_bytes"] > 0
        print(json.dumps(dict(kernel=name, dtype=args.dtype, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
