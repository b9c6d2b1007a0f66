"""CPU checks of the CuTe combine stage (the kernel ``flash_msa/cute/combine_sm90.py``, its host
code ``combine`` in ``flash_msa/cute/forward.py``; its numerics are tested on the GPU:
tests/ops/test_combine.py): the main merge, the LSE-only mode and the fused proxy LSE
compile for sm_90a without spills (the full list is ``compile_check.combine_configurations``, run by
the CuTe compile check), the limits, the host's refusals of bad buffers, naming the argument, and
what the host passes to a launch (addresses, token count; its CPU time). CPU time on the 2-core
machine: ~2 s in pytest, ~1 s of it the three compiles (plus pytest start-up).

Two invariants of the combine's host code that a CPU can show: the shared-memory count includes
the staged rows, and an fp32 output is refused naming it. No kernel is compiled for these; CPU
time < 0.01 s in pytest.
"""

from __future__ import annotations

import time

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_configurations_compile_for_sm90_without_spills():
    from flash_msa.cute.compile_check import combine_configurations, compile_combine

    names = [name for name, *_ in combine_configurations()]
    assert len(names) == len(set(names)) == 24 + 4 + 4
    for cfg in (
        ("bf16", 16, 4, 16, 128, True),
        (None, 4, 4, 16, 0, False),
        ("bf16", 64, 4, 16, 128, True, True),  # the fused proxy LSE
    ):
        res = compile_combine(*cfg)
        assert res["stack"] == 0 and res["local"] == 0, (cfg, res)  # spills show up as stack


def test_limits():
    from cutlass import BFloat16, Float16, Float32

    from flash_msa.cubin import SHARED_LIMIT
    from flash_msa.cute.combine_sm90 import MAX_TOPK, CombineSm90
    from flash_msa.cute.forward import combine_fits

    ok = CombineSm90.can_implement
    assert ok(BFloat16, 64, 4, 64, 128, True) is None
    assert ok(None, 4, 4, 1, 0, False) is None
    assert "bf16 or fp16" in ok(Float32, 16, 4, 16, 128, True)
    assert "head_dim" in ok(Float16, 16, 4, 16, 96, True)
    assert "top_k" in ok(BFloat16, 16, 4, 65, 128, True)
    assert "multiple" in ok(BFloat16, 6, 4, 16, 128, True)
    assert "LSE-only" in ok(BFloat16, 4, 4, 16, 0, False)
    assert ok(Float16, 64, 4, 64, 64, True, proxy=True) is None
    assert "proxy" in ok(None, 4, 4, 16, 0, False, proxy=True)
    # can_implement checks no shared memory: the largest CTA (K 64, D 128, the fused proxy)
    # takes 64 KiB of partial-row pieces + 3 KiB of staged rows
    largest = max(
        CombineSm90.shared_bytes(D, K, proxy)
        for D in (64, 128)
        for K in range(1, MAX_TOPK + 1)
        for proxy in (False, True)
    )
    assert largest == CombineSm90.shared_bytes(128, 64, True) == 68_608 < SHARED_LIMIT
    with pytest.raises(ValueError, match="top_k"):
        CombineSm90(BFloat16, 16, 4, 0, 128, True)
    assert combine_fits(torch.bfloat16, 16, 4, 16, 128)
    assert not combine_fits(torch.float32, 16, 4, 16, 128)
    assert not combine_fits(torch.bfloat16, 16, 4, 16, 256)
    assert hash(CombineSm90(BFloat16, 16, 4, 16, 128, True)) != hash(
        CombineSm90(BFloat16, 16, 4, 16, 128, True, proxy=True)
    )


def _buffers(C=8, H=16, Hs=4, K=16, D=128):
    return (
        torch.zeros((C + 2, H, K, D), dtype=torch.bfloat16),
        torch.zeros((C + 2, H, K)),
        torch.zeros((C, Hs, K), dtype=torch.int32),
        torch.zeros((C, H, D), dtype=torch.bfloat16),
        torch.zeros((C, H)),
        torch.zeros((C + 2, Hs, K)),
        torch.zeros((C, Hs)),
    )


def test_host_refuses_bad_buffers_naming_them():
    from flash_msa.cute.forward import combine

    o_part, l_part, idx, out, lse, pl_part, plse = _buffers()
    cases = {
        "l_part": (o_part, l_part.double(), idx, out, lse),
        "o_part": (o_part[:, :, :8], l_part, idx, out, lse),
        "idx": (o_part, l_part, idx.long(), out, lse),
        "head_dim": (o_part[..., :32].contiguous(), l_part, idx, out[..., :32], lse),
        "lse": (o_part, l_part, idx, out, lse[:4]),
        "both": (None, l_part, idx, out, lse),
        "proxy": (None, pl_part, idx, None, plse, (pl_part, plse)),
        "pl_part": (o_part, l_part, idx, out, lse, (pl_part[:, :2], plse)),
        "proxy_lse": (o_part, l_part, idx, out, lse, (pl_part, plse[:, :2])),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError, match=name):
            combine(*args)


def test_host_passes_the_buffers_addresses(monkeypatch):
    """What a launch gets (the kernel is not run: ``run_typed`` is replaced): the buffers'
    addresses in the kernel's argument order, the token count; absent buffers' slots hold
    addresses of the fp32 buffers given. And the host's CPU time per call without the launch
    (the first version's tensor views alone cost ~50 us here)."""
    import cuda.bindings.driver as cuda

    from flash_msa.cute import forward

    seen = []
    signatures = set()
    monkeypatch.setattr(
        forward, "run_typed",
        lambda k, dev, args, sig: seen.append((k, args)) or signatures.add(sig),
    )  # fmt: skip
    monkeypatch.setattr(forward, "stream", lambda dev: cuda.CUstream(0))
    o_part, l_part, idx, out, lse, pl_part, plse = _buffers()

    def addresses(args):
        return [int(a._pointer) for a in args[:7]], int(args[7])

    forward.combine(o_part, l_part, idx, out, lse)
    forward.combine(None, pl_part, idx, None, plse)
    forward.combine(o_part, l_part, idx, out, lse, (pl_part, plse))
    (k1, a1), (k2, a2), (k3, a3) = seen
    assert signatures == {forward.COMBINE_SIGNATURE}
    ptr = [t.data_ptr() for t in (o_part, l_part, idx, out, lse, pl_part, plse)]
    assert addresses(a1) == ([*ptr[:5], ptr[1], ptr[4]], 8)
    assert addresses(a2) == ([ptr[5], ptr[5], ptr[2], ptr[6], ptr[6], ptr[5], ptr[6]], 8)
    assert addresses(a3) == (ptr, 8)
    assert (k1.has_o, k1.proxy, k2.has_o, k2.heads, k3.has_o, k3.proxy) == (
        True, False, False, 4, True, True,
    )  # fmt: skip
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        forward.combine(o_part, l_part, idx, out, lse, (pl_part, plse))
    us = (time.perf_counter() - t0) / n * 1e6
    # (reported, not asserted: ~25 us measured alone; speed is no test's verdict)
    print(f"host path of a fused call without the launch: {us:.1f} us")


def test_combine_shared_bytes_count_the_staged_rows():
    """The main merge allocates, per warp, the partial-row pieces and also the staged index row
    ``(32, J)`` int32, LSE row ``(32, J)`` fp32 and, with the fused proxy, proxy-LSE row ``(32,
    J)`` fp32 (``warp_rows``): a count that leaves the staged rows out overstates what fits. At the
    anchor layout with the proxy (K 16, D 128: 8 pieces per lane) the compiled kernel's PTX
    (``compile_combine("bf16", 16, 4, 16, 128, True, True, dump=...)``) stages the index, LSE
    and proxy-LSE rows at shared offsets 16,384, 16,896 and 17,408 (512 bytes each): its
    allocations end at 17,920 bytes. The sm_90 capacity needs no check in ``can_implement``
    since the variants of more warps and rows per warp are gone (this file,
    ``test_limits``: 68,608 bytes at most)."""
    from flash_msa.cute.combine_sm90 import WARPS, CombineSm90

    K, D = 16, 128
    J = (K + 31) // 32  # slots per lane
    pieces = WARPS * 8 * 512  # 8 16-byte loads per lane, 512 bytes a warp each
    staged = WARPS * 32 * J * 3 * 4  # sI + sL + sP, 4-byte elements
    assert CombineSm90.shared_bytes(D, K, proxy=True) == pieces + staged == 17_920
    assert CombineSm90.shared_bytes(D, K) == pieces + staged - WARPS * 32 * J * 4


def test_combine_refuses_fp32_output_naming_it():
    from flash_msa.cute.forward import combine

    C, H, Hs, K, D = 4, 8, 2, 16, 64
    o_part = torch.zeros((C, H, K, D))
    l_part = torch.zeros((C, H, K))
    idx = torch.zeros((C, Hs, K), dtype=torch.int32)
    out, lse = torch.zeros((C, H, D)), torch.zeros((C, H))
    with pytest.raises(TypeError) as err:
        combine(o_part, l_part, idx, out, lse)
    assert "out" in str(err.value).replace("CuTe combine", "") and "float32" in str(err.value)
