"""Compile every CuTe kernel configuration for sm_90a without a GPU and report its resources.

Run as ``python -m flash_msa.cute.compile_check [PREFIX] [--dump DIR]``. Prints one JSON line
per configuration whose name starts with ``PREFIX`` (``select``, ``fwd``, ...): name,
registers (the launch count), stack and local bytes (spills appear as stack), whether the PTX
uses wgmma and TMA, and where it has ``setmaxnreg`` whether the SASS kept them. ``--dump DIR``
also writes each configuration's PTX and cubin there (``<name>.ptx`` / ``.cubin``, spaces as
``_``: for comparing two versions of a kernel). Exit status 1 if a configuration spills or
lost a ``setmaxnreg``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile


def compile_kernel(kernel, *args, dump: str | None = None, name: str = "", mma=False) -> dict:
    """Compile kernel object ``kernel`` for sm_90a on specimen ``args``; cuobjdump's counts and
    whether the PTX uses wgmma and TMA; ``mma``: also the distinct wgmma instructions (e.g.
    ``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3``)."""
    import cutlass.cute as cute

    from ..cubin import resources as cubin_resources
    from ..cubin import sass_counts

    with tempfile.TemporaryDirectory() as tmp:  # (the kept files go there, not into the cwd)
        c = cute.compile(
            kernel, *args, options=f"--gpu-arch sm_90a --keep-cubin --keep-ptx --dump-dir={tmp}"
        )
        ptx, cubin = c.artifacts.PTX, c.artifacts.CUBIN
    if dump:
        stem = os.path.join(dump, name.replace(" ", "_"))
        with open(stem + ".ptx", "w") as f:
            f.write(ptx)
        with open(stem + ".cubin", "wb") as f:
            f.write(cubin)
    res = dict(
        cubin_resources(cubin),
        wgmma="wgmma.mma_async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
    )
    if mma:
        res["mma"] = sorted(set(re.findall(r"\bwgmma\.mma_async[\w.]*", ptx)))
    ops = ("USETMAXREG", "HGMMA", "QGMMA", "WARPGROUP.DEPBAR")
    n = sass_counts(cubin, ops) if "setmaxnreg" in ptx or res["wgmma"] else {}
    if "setmaxnreg" in ptx:  # kept by ptxas? (it drops one it cannot honour, with a warning)
        res["setmaxnreg_kept"] = n["USETMAXREG"] == ptx.count("setmaxnreg.")
    if res["wgmma"]:
        # ptxas serializes a kernel's wgmmas when registers do not allow their overlap (warning
        # C7512): a wait after every MMA. Reported, not refused: the default WS backward at
        # anchor D = 128 is so (tenth session, docs/perf-notes.md), a lead for its speed
        mmas = n["HGMMA"] + n["QGMMA"]
        res["wgmma_waits"] = f"{n['WARPGROUP.DEPBAR']}/{mmas}"
        res["wgmma_serialized"] = mmas > 1 and n["WARPGROUP.DEPBAR"] >= mmas
    return res


def report(configurations, compile_one) -> int:
    """Compile each ``(name, *cfg)`` of ``configurations`` by ``compile_one(*cfg, name=name)``
    and print one JSON line per kernel; 1 if any spills (stack or local bytes), else 0. The
    ``python -m`` entry of a kernel module that lists its own configurations (combine,
    quantize)."""
    bad = 0
    for name, *cfg in configurations:
        res = compile_one(*cfg, name=name)
        bad += res["stack"] > 0 or res["local"] > 0
        print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


def configurations():
    """(name, dtype, Dp, Hp, Hpk, top_k, block[, qmap[, key_scale[, stages]]]) of the selection
    kernels checked (the lists in the selector warpgroup, fed through the ring: block 128 and
    64 are one and two slabs in it; top_k 1, 8, 16, 17, 32 and 64: the smallest and largest
    selector lists); the ``qmap`` ones (``SelectSm90(qmap=True)``, context parallelism's query
    map): anchor / paper (their selections have the same shape), both dims and blocks, top_k 64
    (the most registers), fp16, several key heads; the ``e4m3`` ones (the FP8 mode,
    ``key_scale`` "block" or "token"): anchor / paper, Dp 64, blocks 64 and 128, top_k 1, 16 and
    64, both key scales (per token: the consumers' most registers), several key heads; and the
    deepest pipelines the A/B times beside the ring (bf16 5 stages at block 64, the most shared
    memory of bf16 at Dp 128; fp8 12 stages; the defaults are ``SelectSm90.stages`` and
    ``select_sm90.FP8_STAGES``)."""
    for Dp in (64, 128):
        for block in (64, 128):
            yield f"select bf16 Dp={Dp} b={block} k=16 Hp=4 Hpk=1", "bf16", Dp, 4, 1, 16, block
    yield "select fp16 Dp=128 b=128 k=16 Hp=4 Hpk=1", "fp16", 128, 4, 1, 16, 128
    yield "select bf16 Dp=128 b=128 k=1 Hp=2 Hpk=2", "bf16", 128, 2, 2, 1, 128
    yield "select bf16 Dp=64 b=64 k=8 Hp=8 Hpk=2", "bf16", 64, 8, 2, 8, 64
    for Dp, block, K in ((128, 128, 64), (128, 64, 64), (64, 128, 32), (64, 64, 17)):
        yield f"select bf16 Dp={Dp} b={block} k={K} Hp=4 Hpk=1", "bf16", Dp, 4, 1, K, block
    for dt, Dp, Hp, Hpk, K, block in (
        ("bf16", 128, 4, 1, 16, 128), ("bf16", 64, 4, 1, 16, 64), ("bf16", 128, 4, 1, 64, 64),
        ("bf16", 64, 4, 1, 32, 128), ("fp16", 128, 4, 1, 16, 128), ("bf16", 64, 8, 2, 8, 64),
    ):  # fmt: skip
        name = f"select {dt} qmap Dp={Dp} b={block} k={K} Hp={Hp} Hpk={Hpk}"
        yield name, dt, Dp, Hp, Hpk, K, block, True
    for scale, Dp, Hp, Hpk, K, block in (
        ("block", 128, 4, 1, 16, 128), ("block", 128, 4, 1, 64, 128),
        ("block", 128, 4, 1, 64, 64), ("block", 64, 4, 1, 16, 128),
        ("block", 128, 2, 2, 1, 128), ("block", 64, 8, 2, 8, 64),
        ("token", 128, 4, 1, 16, 128), ("token", 128, 4, 1, 64, 64),
        ("token", 64, 4, 1, 16, 64), ("block", 128, 4, 1, 16, 64),
        ("block", 64, 8, 2, 1, 128),
    ):  # fmt: skip
        name = f"select e4m3 scale={scale} Dp={Dp} b={block} k={K} Hp={Hp} Hpk={Hpk}"
        yield name, "e4m3", Dp, Hp, Hpk, K, block, False, scale
    name = "select e4m3 scale=block Dp=128 b=128 k=16 Hp=4 Hpk=1 stages=12"
    yield name, "e4m3", 128, 4, 1, 16, 128, False, "block", 12
    name = "select bf16 Dp=128 b=64 k=16 Hp=4 Hpk=1 stages=5"
    yield name, "bf16", 128, 4, 1, 16, 64, False, None, 5


def fwd_configurations():
    """(name, dtype, H, Hkv, Hs, D, K, block, warpgroups[, (Hpk, Dp)[, qmap]]) of the
    forward-partials kernels checked: the head layouts, dims and blocks with the default 3
    warpgroups, and each also with 1 and 2 (the constructor argument the A/B script and the GPU
    tests vary); with ``(Hpk, Dp)`` the kernel that also makes the proxy LSE partials
    (``proxy=True``); with ``qmap`` True the query-map kernel (``qmap=True``)."""
    layouts = [
        (f"fwd bf16 anchor D={D} b={block}", "bf16", 16, 2, 4, D, 16, block)
        for D in (64, 128)
        for block in (64, 128)
    ]
    layouts.append(("fwd bf16 paper D=128 b=128", "bf16", 64, 4, 4, 128, 16, 128))
    layouts.append(("fwd fp16 Hs<Hkv D=64 b=64", "fp16", 8, 4, 2, 64, 8, 64))
    for name, *cfg in layouts:
        yield name, *cfg, 3
    for wgs in (1, 2):
        for name, *cfg in layouts:
            yield f"{name} wg{wgs}", *cfg, wgs
    proxy = [  # (name, dtype, H, Hkv, Hs, D, K, block, Hpk, Dp): FwdPartialsSm90(proxy=True)
        ("anchor D=128 b=128", "bf16", 16, 2, 4, 128, 16, 128, 1, 128),
        ("paper D=128 b=128", "bf16", 64, 4, 4, 128, 16, 128, 1, 128),
        ("anchor D=64 b=64", "bf16", 16, 2, 4, 64, 16, 64, 1, 64),
        ("Hp>Hpk>1 D=64 b=64", "bf16", 8, 2, 4, 64, 8, 64, 2, 64),
        ("anchor D=128 Dp=64 b=128", "bf16", 16, 2, 4, 128, 16, 128, 1, 64),
        ("anchor D=64 Dp=128 b=128", "bf16", 16, 2, 4, 64, 16, 128, 1, 128),
        ("Hs<Hkv D=64 b=64", "fp16", 8, 4, 2, 64, 8, 64, 1, 64),
    ]
    for name, dtype, *cfg, hpk, dp in proxy:
        yield f"fwd {dtype} proxy {name}", dtype, *cfg, 3, (hpk, dp)
    yield "fwd bf16 proxy anchor D=128 b=128 wg1", "bf16", 16, 2, 4, 128, 16, 128, 1, (1, 128)
    # the query map (FwdPartialsSm90(qmap=True), context parallelism), with and without the
    # proxy part (a CP forward has it wherever the KL or the proxy gradient is wanted); not the
    # paper layout: it spills 8 bytes with the map (fwd_partials_sm90's docstring), pinned by
    # tests/test_cute_fwd_qmap_cpu.py instead
    for name, *cfg in (layouts[i] for i in (0, 3, 5)):  # anchor D=64 / 128, fp16
        yield f"{name} qmap", *cfg, 3, None, True
    for name, dtype, *cfg, hpk, dp in proxy:
        if "paper" not in name:
            yield f"fwd {dtype} proxy {name} qmap", dtype, *cfg, 3, (hpk, dp), True


def bwd_configurations():
    """(name, dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy[, variant]) of the backward
    kernels checked: the anchor and paper head layouts, both head dims and blocks, fp16, the
    main- or proxy-only variants, and the A/B switches (``variant``: constructor arguments);
    the ``qmap`` ones (context parallelism's query map) over both kernels and every mode."""
    for D in (64, 128):
        for block in (64, 128):
            yield f"bwd bf16 anchor D={D} b={block}", "bf16", 16, 2, 4, 1, D, D, 16, block, 1, 1
    yield "bwd bf16 paper D=128 b=128", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1
    yield "bwd fp16 anchor D=128 Dp=64 b=128", "fp16", 16, 2, 4, 1, 128, 64, 16, 128, 1, 1
    yield "bwd bf16 Hp>Hkv D=64 Dp=128 b=128", "bf16", 8, 1, 4, 1, 64, 128, 3, 128, 1, 1
    yield "bwd bf16 G2=1 D=128 b=128", "bf16", 4, 4, 4, 2, 128, 128, 8, 128, 1, 1
    yield "bwd bf16 Hp>Hpk>1 G2=2 D=64 b=64", "bf16", 8, 2, 4, 2, 64, 64, 8, 64, 1, 1
    yield "bwd bf16 anchor main-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 0
    yield "bwd bf16 anchor proxy-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 1
    one = dict(gather_stages=1)
    yield "bwd bf16 anchor stages1", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, one
    yield "bwd bf16 paper stages1", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1, one
    yield "bwd bf16 anchor main-only stages1", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 0, one
    det = dict(deterministic=True)  # deterministic mode: stores into partials, no atomics
    yield "bwd bf16 anchor deterministic", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, det
    yield "bwd bf16 paper deterministic", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1, det
    yield "bwd bf16 anchor D=64 b=64 deterministic", "bf16", 16, 2, 4, 1, 64, 64, 16, 64, 1, 1, det
    v2 = dict(ws=False)  # the fallback without a producer warpgroup (the defaults above are
    # the warp-specialized kernel where it can run them: block 128, Dp == D, not deterministic)
    for name, H, Hkv, Hs, Hpk, D, K, main, proxy in (
        ("anchor", 16, 2, 4, 1, 128, 16, 1, 1), ("paper", 64, 4, 4, 1, 128, 16, 1, 1),
        ("anchor D=64", 16, 2, 4, 1, 64, 16, 1, 1), ("G2=1", 4, 4, 4, 2, 128, 8, 1, 1),
        ("anchor main-only", 16, 2, 4, 1, 128, 16, 1, 0),
        ("anchor proxy-only", 16, 2, 4, 1, 128, 16, 0, 1),
    ):  # fmt: skip
        yield f"bwd bf16 {name} v2", "bf16", H, Hkv, Hs, Hpk, D, D, K, 128, main, proxy, v2
    yield "bwd fp16 anchor v2", "fp16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, v2
    kl = dict(kl=True)  # the forward's KL stage (bwd_sm90.kl): the KL value, no gradient
    yield "bwd bf16 anchor kl", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 0, kl
    yield "bwd bf16 paper kl", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 0, 0, kl
    yield "bwd fp16 anchor D=64 b=64 kl", "fp16", 16, 2, 4, 1, 64, 64, 16, 64, 0, 0, kl
    yield "bwd bf16 Hp>Hpk>1 G2=2 D=64 b=64 kl", "bf16", 8, 2, 4, 2, 64, 64, 8, 64, 0, 0, kl
    yield "bwd bf16 G2=1 Dp>D kl", "bf16", 4, 4, 4, 2, 64, 128, 8, 128, 0, 0, kl
    qm = dict(qmap=True)  # the query map (context parallelism): the row data's token from it
    yield "bwd bf16 qmap anchor", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd bf16 qmap paper", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd fp16 qmap anchor", "fp16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd bf16 qmap anchor D=64 b=64", "bf16", 16, 2, 4, 1, 64, 64, 16, 64, 1, 1, qm
    yield "bwd bf16 qmap G2=1", "bf16", 4, 4, 4, 2, 128, 128, 8, 128, 1, 1, qm
    yield "bwd bf16 qmap anchor main-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 0, qm
    yield "bwd bf16 qmap anchor proxy-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 1, qm
    yield "bwd bf16 qmap anchor v2", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, dict(qm, **v2)
    qdet = dict(qm, **det)
    yield "bwd bf16 qmap anchor deterministic", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qdet
    yield "bwd bf16 qmap anchor kl", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 0, dict(qm, **kl)


def compile_bwd(dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy, variant=None, **dump) -> dict:
    """:func:`flash_msa.cute.bwd_sm90.compile_bwd`: the kernel compiled on the pointer
    launch's arguments."""
    from .bwd_sm90 import compile_bwd as compile_one

    return compile_one(dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy, variant, **dump)


def kernel_dtype(name: str | None):
    """The CuTe element type of a configuration's dtype name (``None``: ``None``)."""
    from cutlass import BFloat16, Float8E4M3FN, Float16

    return {"bf16": BFloat16, "fp16": Float16, "e4m3": Float8E4M3FN, None: None}[name]


def compile_memory_bound(kernel, launch_arguments, addresses: int, counts=(1,), *, dump=None,
                         name: str = "") -> dict:  # fmt: skip
    """Compile a memory-bound pointer-launch kernel (the combine, the quantize pass, the row
    delta: no MMA, no TMA) for sm_90a on ``launch_arguments(kernel, *addresses dummy device
    addresses, *counts, stream)``, the arguments its host function passes; cuobjdump's counts
    (:func:`compile_kernel`) with ``wgmma``/``tma`` False."""
    from cutlass.cute.runtime import make_fake_stream

    a = 1 << 20  # a dummy address, 16-byte aligned
    args = launch_arguments(kernel, *(a,) * addresses, *counts, make_fake_stream())
    return dict(compile_kernel(kernel, *args, dump=dump, name=name), wgmma=False, tma=False)


def compile_fwd(
    dtype: str, H: int, Hkv: int, Hs: int, D: int, K: int, block: int, wgs: int, proxy=None,
    qmap: bool = False, **dump,
) -> dict:  # fmt: skip
    """:func:`flash_msa.cute.fwd_partials_sm90.compile_fwd`: the kernel compiled on the pointer
    launch's arguments (``proxy = (Hpk, Dp)``: with the proxy LSE part; ``qmap``: the
    query-map kernel)."""
    from .fwd_partials_sm90 import compile_fwd as compile_one

    return compile_one(dtype, H, Hkv, Hs, D, K, block, wgs, proxy, qmap, **dump)


def kl_configurations():
    """(name, dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, warpgroups) of the forward partials'
    KL mode (:class:`~flash_msa.cute.fwd_partials_sm90.FwdKlSm90`): anchor and paper, both
    dims and blocks, bf16 and fp16, G = H / Hs of 1, 2, 4, 8, 16, several proxy key heads, and
    1 or 3 warpgroups (the default is 2)."""
    for dt, H, Hkv, D, Dp, block in (
        ("bf16", 16, 2, 128, 128, 128), ("bf16", 64, 4, 128, 128, 128),
        ("fp16", 64, 4, 128, 128, 128), ("fp16", 16, 2, 128, 128, 128),
        ("bf16", 16, 2, 64, 64, 64), ("bf16", 64, 4, 128, 128, 64),
    ):  # fmt: skip
        shape = "anchor" if H == 16 else "paper"
        yield f"kl {dt} {shape} D={D} Dp={Dp} b={block}", dt, H, Hkv, 4, 1, D, Dp, 16, block, 2
    yield "kl bf16 G=1 Hpk=2 D=128 b=128", "bf16", 4, 4, 4, 2, 128, 128, 5, 128, 2
    yield "kl bf16 G=2 Hpk=2 D=64 b=64", "bf16", 8, 2, 4, 2, 64, 64, 8, 64, 2
    yield "kl bf16 G=8 D=128 b=128", "bf16", 32, 4, 4, 1, 128, 128, 16, 128, 2
    yield "kl bf16 anchor D=64 Dp=64 b=64 wg3", "bf16", 16, 2, 4, 1, 64, 64, 16, 64, 3
    yield "kl bf16 anchor D=128 Dp=128 b=128 wg1", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1


def compile_kl(
    dtype: str, H: int, Hkv: int, Hs: int, Hpk: int, D: int, Dp: int, K: int, block: int,
    wgs: int = 2, **dump,
) -> dict:  # fmt: skip
    """:func:`flash_msa.cute.fwd_partials_sm90.compile_kl`: the KL mode compiled on the pointer
    launch's arguments."""
    from .fwd_partials_sm90 import compile_kl as compile_one

    return compile_one(dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, wgs, **dump)


def compile_select(
    dtype: str, Dp: int, Hp: int, Hpk: int, K: int, block: int, qmap: bool = False,
    key_scale: str | None = None, stages: int | None = None, **dump,
) -> dict:  # fmt: skip
    """:func:`flash_msa.cute.select_sm90.compile_select`: the kernel compiled on the pointer
    launch's arguments (``qmap``: the query-map kernel; ``key_scale``: the FP8 mode, ``dtype``
    "e4m3"; ``stages``: the pipeline depth, default the mode's)."""
    from .select_sm90 import compile_select as compile_one

    return compile_one(dtype, Dp, Hp, Hpk, K, block, qmap, key_scale, stages, **dump)


def main(argv: list[str]) -> int:
    dump = None
    if "--dump" in argv:
        i = argv.index("--dump")
        dump = os.path.abspath(argv[i + 1])
        os.makedirs(dump, exist_ok=True)
        argv = argv[:i] + argv[i + 2 :]
    only = argv[0] if argv else ""  # a name prefix: "select" or "fwd", ...
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUTE_DSL_DUMP_DIR"] = tmp  # --keep-* also write files: keep them out of CWD
        checks = [(n, compile_select, c) for n, *c in configurations()]
        checks += [(n, compile_fwd, c) for n, *c in fwd_configurations()]
        checks += [(n, compile_bwd, c) for n, *c in bwd_configurations()]
        checks += [(n, compile_kl, c) for n, *c in kl_configurations()]
        from .combine_sm90 import combine_configurations, compile_combine

        checks += [(n, compile_combine, c) for n, *c in combine_configurations()]
        from .quantize_sm90 import compile_quantize, quantize_configurations

        checks += [(n, compile_quantize, c) for n, *c in quantize_configurations()]
        from .row_delta_sm90 import compile_row_delta, row_delta_configurations

        checks += [(n, compile_row_delta, c) for n, *c in row_delta_configurations()]
        from .worklist_sm90 import compile_worklist, worklist_configurations

        checks += [(n, compile_worklist, c) for n, *c in worklist_configurations()]
        for name, compile_one, cfg in checks:
            if name.startswith(only):
                res = compile_one(*cfg, dump=dump, name=name)
                bad += res["stack"] > 0 or res["local"] > 0 or not res.get("setmaxnreg_kept", True)
                print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
