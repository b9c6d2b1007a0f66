"""CPU checks of the warp-specialized backward's teacher in registers (``BwdWsSm90`` at G2 = 4;
its numerics are tested on the GPU: tests/test_gpu_cute_bwd.py, bitwise against BwdSm90's slab
update where the reductions commute, and by the rule everywhere): the anchor kernel compiles for
sm_90a without spills, its ``setmaxnreg`` kept, and its teacher is the register one (8
butterfly shuffles per stage, where BwdSm90's slab update at the same layout has 16: one per
column pair). CPU time on the 2-core machine: ~5 s in pytest (the two compiles)."""

from __future__ import annotations

import pytest

cutlass = pytest.importorskip("cutlass")

ANCHOR = "bf16", 16, 2, 4, 1, 128, 128, 16, 128  # dtype, H, Hkv, Hs, Hpk, D, Dp, K, block


def test_ws_backward_is_the_default_and_keeps_the_teacher_in_registers(tmp_path):
    from cutlass import BFloat16

    from flash_msa.cute.backward import kernel_for
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90
    from flash_msa.cute.compile_check import compile_bwd

    assert type(kernel_for(BFloat16, *ANCHOR[1:])) is BwdWsSm90
    ptx = {}
    for name, variant in (("ws", None), ("v2", dict(ws=False))):
        res = compile_bwd(*ANCHOR, 1, 1, variant, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0, (name, res)
        ptx[name] = (tmp_path / f"{name}.ptx").read_text()
        if name == "ws":
            assert res["setmaxnreg_kept"], res
    # the teacher: the slab update's 16 shuffles (one per column pair) per stage are 8 in
    # registers (a lane pair splits the tokens; anchor R = 1: one flush per stage)
    assert ptx["v2"].count("shfl.sync.bfly") == 16
    assert ptx["ws"].count("shfl.sync.bfly") == 8
