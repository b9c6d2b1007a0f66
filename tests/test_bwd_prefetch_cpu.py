"""CPU checks of the warp-specialized backward's prefetching producer (``BwdWsSm90.prefetch``,
the A/B switch ``BwdSm90.VARIANTS["prefetch"]``; its numerics are tested on the GPU:
tests/test_gpu_cute_bwd.py -k prefetch): the switch is a kernel field (so part of the compile
cache's key) that picks the warp-specialized kernel or refuses the layout; the anchor kernel
compiles for sm_90a without spills, its ``setmaxnreg`` kept, and its producer issues the next
iteration's row-data loads between the gathers' commit and their wait, which the default
producer does not. CPU time on the 2-core machine: ~10 s in pytest, two compiles."""

from __future__ import annotations

import dataclasses
import re

import pytest

cutlass = pytest.importorskip("cutlass")

ANCHOR = "bf16", 16, 2, 4, 1, 128, 128, 16, 128  # dtype, H, Hkv, Hs, Hpk, D, Dp, K, block


def test_prefetch_is_a_kernel_field_and_a_variant():
    from cutlass import BFloat16

    from flash_msa.cute.bwd_sm90 import BwdSm90
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90

    variant = BwdSm90.VARIANTS["prefetch"]
    kernel = BwdSm90.make(BFloat16, *ANCHOR[1:], **variant)
    plain = BwdSm90.make(BFloat16, *ANCHOR[1:])
    assert type(kernel) is BwdWsSm90 and kernel.prefetch and not plain.prefetch
    assert kernel == dataclasses.replace(plain, prefetch=True)
    assert kernel != plain and hash(kernel) != hash(plain)  # (the compile cache keys on it)
    with pytest.raises(ValueError, match="block_size 128"):  # a layout it cannot run: refused
        BwdSm90.make(BFloat16, 16, 2, 4, 1, 128, 128, 16, 64, **variant)


def _producer_tail(ptx: str) -> str:
    """The producer's PTX from its last ``cp.async.commit_group`` to the ``cp.async.wait_group``
    after it (the code between the gathers' issue and their wait)."""
    producer = ptx[ptx.index("setmaxnreg.dec") : ptx.index("setmaxnreg.inc")]
    last = producer.rindex("cp.async.commit_group")
    return producer[last : producer.index("cp.async.wait_group", last)]


def test_prefetch_compiles_and_loads_during_the_gathers(tmp_path):
    from flash_msa.cute.bwd_sm90 import BwdSm90, compile_bwd

    tails = {}
    for name, variant in (("default", None), ("prefetch", BwdSm90.VARIANTS["prefetch"])):
        res = compile_bwd(*ANCHOR, 1, 1, variant, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0 and res["setmaxnreg_kept"], (name, res)
        tails[name] = _producer_tail((tmp_path / f"{name}.ptx").read_text())
    # prefetch: the next iteration's LSE and Delta (phase A) and proxy LSE (phase B)
    assert len(re.findall(r"ld\.global\.b32", tails["prefetch"])) == 3, tails["prefetch"]
    assert "ld.global" not in tails["default"], tails["default"]
