"""Review findings on the CuTe combine (``flash_msa/cute/combine_sm90.py``) that a CPU can show
(eighth session's review; both fixed). No kernel is compiled; CPU time < 0.01 s in pytest (plus the
session start).
"""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_shared_bytes_counts_all_shared_memory():
    """The main merge allocates, per warp, the partial-row pieces and also the staged index row
    ``(32, J)`` int32, LSE row ``(32, J)`` fp32 and, with the fused proxy, proxy-LSE row ``(32,
    J)`` fp32 (``warp_rows``); the review found the staged rows left out of the count. At the
    anchor layout with the proxy (K 16, D 128: 8 pieces per lane) the compiled kernel's PTX
    (``compile_combine("bf16", 16, 4, 16, 128, True, True, dump=...)``) stages the index, LSE
    and proxy-LSE rows at shared offsets 16,384, 16,896 and 17,408 (512 bytes each): its
    allocations end at 17,920 bytes. The sm_90 capacity needs no check in ``can_implement``
    since the variants of more warps and rows per warp are gone (test_cute_combine_cpu.py,
    ``test_limits``: 68,608 bytes at most)."""
    from flash_msa.cute.combine_sm90 import WARPS, CombineSm90

    K, D = 16, 128
    J = (K + 31) // 32  # slots per lane
    pieces = WARPS * 8 * 512  # 8 16-byte loads per lane, 512 bytes a warp each
    staged = WARPS * 32 * J * 3 * 4  # sI + sL + sP, 4-byte elements
    assert CombineSm90.shared_bytes(D, K, proxy=True) == pieces + staged == 17_920
    assert CombineSm90.shared_bytes(D, K) == pieces + staged - WARPS * 32 * J * 4


def test_fp32_output_is_refused_naming_the_argument():
    from flash_msa.cute.combine_sm90 import combine

    C, H, Hs, K, D = 4, 8, 2, 16, 64
    o_part = torch.zeros((C, H, K, D))
    l_part = torch.zeros((C, H, K))
    idx = torch.zeros((C, Hs, K), dtype=torch.int32)
    out, lse = torch.zeros((C, H, D)), torch.zeros((C, H))
    with pytest.raises(TypeError) as err:
        combine(o_part, l_part, idx, out, lse)
    assert "out" in str(err.value).replace("CuTe combine", "") and "float32" in str(err.value)
