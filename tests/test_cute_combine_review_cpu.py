"""Review findings on the CuTe combine (``flash_msa/cute/combine_sm90.py``) that a CPU can show
(eighth session's review; both fixed). No kernel is compiled; CPU time ~0.1 s in pytest (plus
the session start).
"""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_can_implement_counts_all_shared_memory():
    """``smem=True`` allocates, per warp, the partial-row pieces (``shared_bytes``) and also
    the staged index rows ``(32, J, NI)`` int32, LSE rows ``(32, J, R)`` fp32 and, with the
    fused proxy, proxy-LSE rows ``(32, J, NI)`` fp32 (``warp_rows``). At H = Hs = 4 (G = 1, so
    NI = R = 4), K = 28, D = 128, 8 warps of 4 rows with the proxy, ``shared_bytes`` gives
    229,376 B (< 232,448) but the compiled kernel's shared allocations are 229,376 + 3 x 4,096
    = 241,664 B (read from its ``CUTE_DSL_KEEP=ir`` dump): accepted here, refused at launch."""
    from cutlass import BFloat16

    from flash_msa.cubin import SHARED_LIMIT
    from flash_msa.cute.combine_sm90 import CombineSm90

    H, Hs, K, D, warps, rows = 4, 4, 28, 128, 8, 4
    J = (K + 31) // 32  # slots per lane
    NI = 1 if (H // Hs) % rows == 0 else rows  # index rows per warp
    staging = warps * 32 * J * (NI + rows + NI) * 4  # sI + sL + sP, 4-byte elements
    total = CombineSm90.shared_bytes(D, K, warps, rows, H // Hs, proxy=True)
    assert total == warps * rows * 14 * 512 + staging == 241_664 > SHARED_LIMIT
    why = CombineSm90.can_implement(BFloat16, H, Hs, K, D, True, warps=warps, rows=rows, proxy=True)
    assert why is not None and "shared memory" in why


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
