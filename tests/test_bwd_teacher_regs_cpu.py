"""CPU checks of the warp-specialized backward's teacher in registers (``BwdWsSm90.teacher_regs``,
the A/B switch ``BwdSm90.VARIANTS["teacher_regs"]``; its numerics are tested on the GPU:
tests/test_gpu_cute_bwd.py -k teacher_regs): the switch is a kernel field (so part of the
compile cache's key) that picks the warp-specialized kernel or refuses the layout; the anchor
kernel compiles for sm_90a without spills, its ``setmaxnreg`` kept, and its teacher is the
register one (8 butterfly shuffles and 8 slab stores per stage instead of 16 and 16), while the
default kernel's PTX is still the one this variant was written against (its SHA-256 under the
nvidia-cutlass-dsl versions ``DEFAULT_ANCHOR_PTX`` knows: if the default kernel changes on
purpose, update it; the A/B's premise is that the default is unchanged). CPU time on the
2-core machine: ~5 s in pytest (4.6 s the two compiles)."""

from __future__ import annotations

import dataclasses
import hashlib
from importlib.metadata import version

import pytest

cutlass = pytest.importorskip("cutlass")

ANCHOR = "bf16", 16, 2, 4, 1, 128, 128, 16, 128  # dtype, H, Hkv, Hs, Hpk, D, Dp, K, block
# sha256 of the default anchor kernel's PTX ("bwd bf16 anchor D=128 b=128") at 1b9e687, by
# nvidia-cutlass-dsl version (its PTX is the toolchain's too: pyproject asks for >= 4.8.1, so a
# clean machine may install a newer one, whose bytes this file does not know; the PTX checks
# below still run there)
DEFAULT_ANCHOR_PTX = {"4.8.1": "4ca8034c782f66a1cb2fd1439a22ef55de4b8d5c777b77d2dc891a2c95c132a4"}


def test_teacher_regs_is_a_kernel_field_and_a_variant():
    from cutlass import BFloat16

    from flash_msa.cute.bwd_sm90 import BwdSm90
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90

    variant = BwdSm90.VARIANTS["teacher_regs"]
    kernel = BwdSm90.make(BFloat16, *ANCHOR[1:], **variant)
    plain = BwdSm90.make(BFloat16, *ANCHOR[1:])
    assert type(kernel) is BwdWsSm90 and kernel.teacher_regs and not plain.teacher_regs
    assert kernel == dataclasses.replace(plain, teacher_regs=True)
    assert kernel != plain and hash(kernel) != hash(plain)  # (the compile cache keys on it)
    with pytest.raises(ValueError, match="block_size 128"):  # a layout it cannot run: refused
        BwdSm90.make(BFloat16, 16, 2, 4, 1, 128, 128, 16, 64, **variant)


def test_teacher_regs_compiles_and_changes_only_the_variant(tmp_path):
    from flash_msa.cute.bwd_sm90 import BwdSm90, compile_bwd

    ptx = {}
    for name, variant in (("default", None), ("teacher_regs", BwdSm90.VARIANTS["teacher_regs"])):
        res = compile_bwd(*ANCHOR, 1, 1, variant, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0 and res["setmaxnreg_kept"], (name, res)
        ptx[name] = (tmp_path / f"{name}.ptx").read_text()
    default, regs = ptx["default"], ptx["teacher_regs"]
    known = DEFAULT_ANCHOR_PTX.get(version("nvidia-cutlass-dsl"))
    if known is not None:  # the default kernel is the one the variant was written against
        assert hashlib.sha256(default.encode()).hexdigest() == known
    # the teacher: a lane pair's 16 shuffles (one per column pair) and 16 stores (even lanes)
    # per stage become 8 and 8 (the pair splits the tokens; anchor R = 1: a store per stage)
    assert default.count("shfl.sync.bfly") == 16 and regs.count("shfl.sync.bfly") == 8
    assert regs.count("st.shared.b32") == default.count("st.shared.b32") - 8
