"""CPU checks of the CuTe combine stage (``flash_msa/cute/combine_sm90.py``; its numerics are
tested on the GPU: tests/test_gpu_cute_combine.py): two configurations compile for sm_90a
without spills (the full list is ``combine_configurations``, run by the CuTe compile check),
the limits, and the host's refusals of bad buffers, naming the argument. CPU time on the
2-core machine: 2.4 s in pytest, 0.9 s of it the two compiles (plus the session start)."""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_two_configurations_compile_for_sm90_without_spills():
    from flash_msa.cute.combine_sm90 import combine_configurations, compile_combine

    names = [name for name, *_ in combine_configurations()]
    assert len(names) == len(set(names)) == 28
    for cfg in (("bf16", 16, 4, 16, 128, True), (None, 4, 4, 16, 0, False)):
        res = compile_combine(*cfg)
        assert res["stack"] == 0 and res["local"] == 0, (cfg, res)  # spills show up as stack


def test_limits():
    from cutlass import BFloat16, Float16, Float32

    from flash_msa.cute.combine_sm90 import CombineSm90, combine_fits

    assert CombineSm90.can_implement(BFloat16, 64, 4, 64, 128, True) is None
    assert CombineSm90.can_implement(None, 4, 4, 1, 0, False) is None
    assert "bf16 or fp16" in CombineSm90.can_implement(Float32, 16, 4, 16, 128, True)
    assert "head_dim" in CombineSm90.can_implement(Float16, 16, 4, 16, 96, True)
    assert "top_k" in CombineSm90.can_implement(BFloat16, 16, 4, 65, 128, True)
    assert "multiple" in CombineSm90.can_implement(BFloat16, 6, 4, 16, 128, True)
    assert "LSE-only" in CombineSm90.can_implement(BFloat16, 4, 4, 16, 0, False)
    assert "warps" in CombineSm90.can_implement(BFloat16, 16, 4, 16, 128, True, warps=3)
    with pytest.raises(ValueError, match="top_k"):
        CombineSm90(BFloat16, 16, 4, 0, 128, True)
    assert combine_fits(torch.bfloat16, 16, 4, 16, 128)
    assert not combine_fits(torch.float32, 16, 4, 16, 128)
    assert not combine_fits(torch.bfloat16, 16, 4, 16, 256)
    assert hash(CombineSm90(BFloat16, 16, 4, 16, 128, True)) != hash(
        CombineSm90(BFloat16, 16, 4, 16, 128, True, warps=8)
    )


def test_host_refuses_bad_buffers_naming_them():
    from flash_msa.cute.combine_sm90 import combine

    C, H, Hs, K, D = 8, 16, 4, 16, 128
    o_part = torch.zeros((C, H, K, D), dtype=torch.bfloat16)
    l_part = torch.zeros((C, H, K))
    idx = torch.zeros((C, Hs, K), dtype=torch.int32)
    out = torch.zeros((C, H, D), dtype=torch.bfloat16)
    lse = torch.zeros((C, H))
    cases = {
        "l_part": (o_part, l_part.double(), idx, out, lse),
        "o_part": (o_part[:, :, :8], l_part, idx, out, lse),
        "idx": (o_part, l_part, idx.long(), out, lse),
        "head_dim": (o_part[..., :32].contiguous(), l_part, idx, out[..., :32], lse),
        "lse": (o_part, l_part, idx, out, lse[:4]),
        "both": (None, l_part, idx, out, lse),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError, match=name):
            combine(*args)
