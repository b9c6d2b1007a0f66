"""Compile every CuTe kernel configuration for sm_90a without a GPU and report its resources.

Run as ``python -m flash_msa.cute.compile_check``. Prints one JSON line per configuration:
name, registers (the launch count), stack and local bytes (spills appear as stack), and whether
the PTX uses wgmma and TMA. Exit status 1 if a configuration spills.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _compile(host, *args) -> dict:
    """Compile ``host`` for sm_90a; cuobjdump's counts and whether the PTX uses wgmma and TMA."""
    import cutlass.cute as cute

    from ..cubin import resources as cubin_resources

    c = cute.compile(host, *args, options="--gpu-arch sm_90a --keep-cubin --keep-ptx")
    ptx = c.artifacts.PTX
    return dict(
        cubin_resources(c.artifacts.CUBIN),
        wgmma="wgmma.mma_async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
    )


def configurations():
    """(name, dtype, Dp, Hp, Hpk, top_k, block) of the selection kernels checked."""
    for Dp in (64, 128):
        for block in (64, 128):
            yield f"select bf16 Dp={Dp} b={block} k=16 Hp=4 Hpk=1", "bf16", Dp, 4, 1, 16, block
    yield "select fp16 Dp=128 b=128 k=16 Hp=4 Hpk=1", "fp16", 128, 4, 1, 16, 128
    yield "select bf16 Dp=128 b=128 k=1 Hp=2 Hpk=2", "bf16", 128, 2, 2, 1, 128
    yield "select bf16 Dp=64 b=64 k=8 Hp=8 Hpk=2", "bf16", 64, 8, 2, 8, 64
    for Dp, block, K in ((128, 128, 64), (128, 64, 64), (64, 128, 32), (64, 64, 17)):
        yield f"select bf16 Dp={Dp} b={block} k={K} Hp=4 Hpk=1", "bf16", Dp, 4, 1, K, block


def fwd_configurations():
    """(name, dtype, H, Hkv, Hs, D, K, block, Q stages, staged partials, warpgroups) of the
    forward-partials kernels checked (the shipped ``Q_STAGES`` / ``STAGE_PARTIALS`` /
    ``WARPGROUPS`` and the variants)."""
    from .sparse_fwd import Q_STAGES, STAGE_PARTIALS, WARPGROUPS

    ship = (Q_STAGES, STAGE_PARTIALS, WARPGROUPS)

    for D in (64, 128):
        for block in (64, 128):
            yield f"fwd bf16 anchor D={D} b={block}", "bf16", 16, 2, 4, D, 16, block, *ship
    yield "fwd bf16 paper D=128 b=128", "bf16", 64, 4, 4, 128, 16, 128, *ship
    yield "fwd fp16 Hs<Hkv D=64 b=64", "fp16", 8, 4, 2, 64, 8, 64, *ship
    yield "fwd bf16 anchor D=128 b=128 q1", "bf16", 16, 2, 4, 128, 16, 128, 1, True, 1
    yield "fwd bf16 paper D=128 b=64 direct", "bf16", 64, 4, 4, 128, 16, 64, 2, False, 1
    yield "fwd fp16 Hs<Hkv D=64 b=64 q1", "fp16", 8, 4, 2, 64, 8, 64, 1, True, 1
    yield "fwd bf16 anchor D=128 b=128 wg3", "bf16", 16, 2, 4, 128, 16, 128, 2, True, 3
    yield "fwd bf16 paper D=128 b=128 wg3", "bf16", 64, 4, 4, 128, 16, 128, 2, True, 3
    yield "fwd fp16 Hs<Hkv D=64 b=64 wg2 q1", "fp16", 8, 4, 2, 64, 8, 64, 1, True, 2


def compile_fwd(
    dtype: str,
    H: int,
    Hkv: int,
    Hs: int,
    D: int,
    K: int,
    block: int,
    qstages: int,
    staged: bool,
    wgs: int,
) -> dict:
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    from ..worklist import geometry
    from .sparse_fwd import CHUNK, partials_host

    dt = {"bf16": BFloat16, "fp16": Float16}[dtype]
    G, G2, R, _ = geometry(H, Hkv, Hs, CHUNK)
    sym = cute.sym_int32
    T = sym(symbol="T")
    q = make_fake_tensor(dt, (sym(symbol="TH"), D), stride=(D, 1), assumed_align=16)
    k = make_fake_tensor(dt, (T, D, Hkv), stride=(Hkv * D, 1, D), assumed_align=16)
    v = make_fake_tensor(dt, (T, D, Hkv), stride=(Hkv * D, 1, D), assumed_align=16)
    vec = [
        make_fake_compact_tensor(ty, (sym(symbol=n),), assumed_align=16)
        for ty, n in ((Int64, "E"), (Int32, "W"), (Int64, "W"), (Int64, "W"), (Int32, "NB"))
    ]
    vec.append(make_fake_compact_tensor(Int32, (sym(symbol="NB"),), assumed_align=16))
    o = make_fake_tensor(dt, (sym(symbol="P"), D), stride=(D, 1), assumed_align=16)
    lse = make_fake_compact_tensor(Float32, (sym(symbol="P"),), assumed_align=16)
    return _compile(
        partials_host, q, k, v, *vec, o, lse, Float32(1.0), Int32(0), Int32(1),
        make_fake_stream(), H, Hs, K, G, G2, R, block, qstages, staged, wgs,
    )  # fmt: skip


def compile_select(dtype: str, Dp: int, Hp: int, Hpk: int, K: int, block: int) -> dict:
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    from .selection import select_host

    dt = {"bf16": BFloat16, "fp16": Float16}[dtype]
    T = cute.sym_int32(symbol="T")
    q = make_fake_tensor(dt, (T, Dp, Hp), stride=(Hp * Dp, 1, Dp), assumed_align=16)
    k = make_fake_tensor(dt, (T, Dp, Hpk), stride=(Hpk * Dp, 1, Dp), assumed_align=16)
    cu = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="N1"),), assumed_align=16)
    idx = make_fake_tensor(Int32, (T, Hp, K), stride=(Hp * K, K, 1), assumed_align=16)
    return _compile(select_host, q, k, cu, idx, Int32(1), make_fake_stream(), block)


def main() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUTE_DSL_DUMP_DIR"] = tmp  # --keep-* also write files: keep them out of CWD
        only = sys.argv[1] if len(sys.argv) > 1 else ""  # a name prefix: "select" or "fwd"
        for name, *cfg in configurations():
            if name.startswith(only):
                res = compile_select(*cfg)
                bad += res["stack"] > 0 or res["local"] > 0
                print(json.dumps(dict(kernel=name, **res)), flush=True)
        for name, *cfg in fwd_configurations():
            if name.startswith(only):
                res = compile_fwd(*cfg)
                bad += res["stack"] > 0 or res["local"] > 0
                print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
