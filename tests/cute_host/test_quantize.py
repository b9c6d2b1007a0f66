"""CPU checks of the CuTe quantize pass (the kernel ``flash_msa/cute/quantize_sm90.py``, its host
code ``cute/selection.py``'s ``quantize``; its bytes and scales are compared with
``quant.quantize`` on the GPU: tests/ops/test_select_fp8.py): the kernel's order of the
rotation's operations is the reference's (a torch emulation of its lanes, bit for bit), the
kernels compile for sm_90a without spills (the full list is ``quantize_configurations``, run by
the CuTe compile check), the limits, the host's refusals naming the argument, and the switch in
the CuTe selection's fp8 branch. CPU time on the 2-core machine: 4-7 s of test calls,
~2 s of it the two compiles (plus pytest start-up)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash_msa import quant, testing

cutlass = pytest.importorskip("cutlass")


def _kernel_order_rotation(x: torch.Tensor) -> torch.Tensor:
    """The kernel's rotation of rows ``x (..., Dp)`` emulated in torch fp32, lane by lane: lane
    ``l`` of a row's ``L = Dp / 16`` holds elements ``8 l .. 8 l + 7`` (its e = 0..7) and ``Dp/2 +
    8 l ..`` (e = 8..15); butterflies at strides 1, 2, 4 within a lane, then one per lane bit m
    (stride 8 m) as the kernel's ``fma(sign, own, partner)`` (sign -1 on the lane with bit m:
    ``partner - own``; the product is exact, so one rounding of the sum), then stride Dp/2
    (e with e + 8), then the multiply by fp32(Dp ** -0.5)."""
    Dp = x.shape[-1]
    L = Dp // 16
    lanes = torch.arange(L)
    lo = [x[..., 8 * i : 8 * i + 8] for i in range(L)]
    hi = [x[..., Dp // 2 + 8 * i : Dp // 2 + 8 * i + 8] for i in range(L)]
    v = torch.stack([torch.cat(pieces, -1) for pieces in zip(lo, hi)], -2)  # (..., L, 16)

    def in_lane(v, st):
        out = v.clone()
        for e in range(16):
            if not e & st:
                out[..., e] = v[..., e] + v[..., e + st]
                out[..., e + st] = v[..., e] - v[..., e + st]
        return out

    for st in (1, 2, 4):
        v = in_lane(v, st)
    m = 1
    while m < L:
        partner = v[..., lanes ^ m, :]
        sign = torch.where((lanes & m) != 0, -1.0, 1.0)[:, None]
        v = partner + sign * v  # sign * v exact: one rounding, as fma
        m *= 2
    v = in_lane(v, 8) * torch.tensor(Dp**-0.5, dtype=torch.float32)
    out = torch.empty_like(x)
    for i in range(L):
        out[..., 8 * i : 8 * i + 8] = v[..., i, :8]
        out[..., Dp // 2 + 8 * i : Dp // 2 + 8 * i + 8] = v[..., i, 8:]
    return out


@pytest.mark.parametrize("Dp", [64, 128])
def test_kernel_order_of_the_rotation_is_the_reference_order(Dp):
    """The exactness argument of the module docstring, on CPU: the kernel's lanes and shuffles
    compute ``quant.hadamard_transform`` bit for bit (random bf16 rows with outlier channels,
    and fp16 ones with subnormal values); both are the orthonormal rotation ``x @
    hadamard(Dp)`` up to fp32 rounding, and differ from it in the last bits (why the reference
    is the butterflies, not the matmul)."""
    g = torch.Generator().manual_seed(Dp)
    x = torch.randn(1000, 2, Dp, generator=g)
    x[..., :4] *= 30
    x = x.bfloat16().float()
    tiny = (torch.randn(200, 1, Dp, generator=g) * 2**-20).half().float()  # subnormals of fp16
    for rows in (x, tiny, -x):
        want = quant.hadamard_transform(rows)
        assert torch.equal(_kernel_order_rotation(rows), want)
        torch.testing.assert_close(want, rows @ quant.hadamard(Dp), rtol=0, atol=2e-5 * 30)
    assert not torch.equal(quant.hadamard_transform(x), x @ quant.hadamard(Dp)) or Dp == 64
    # the reference's own invariants: an input is not modified, non-powers of two repeat blocks
    x48 = torch.randn(7, 48, generator=g)
    before = x48.clone()
    torch.testing.assert_close(quant.hadamard_transform(x48), x48 @ quant.hadamard(48))
    assert torch.equal(x48, before)


def test_configurations_compile_for_sm90_without_spills():
    from flash_msa.cute.compile_check import compile_quantize, quantize_configurations

    names = [name for name, *_ in quantize_configurations()]
    assert len(names) == len(set(names)) == 8
    for cfg in (
        ("bf16", 128, 4, 1, 128, "block"),  # the paper layout, shipped settings
        ("fp16", 64, 8, 2, 64, "token"),
    ):
        res = compile_quantize(*cfg)
        assert res["stack"] == 0 and res["local"] == 0, (cfg, res)  # spills show up as stack


def test_limits():
    from cutlass import BFloat16, Float16, Float32

    from flash_msa.cute import selection
    from flash_msa.cute.quantize_sm90 import QuantizeSm90

    ok = QuantizeSm90.can_implement
    assert ok(BFloat16, 128, 4, 1, 128, "block") is None
    assert ok(Float16, 64, 8, 2, 64, "token") is None
    assert "bf16 or fp16" in ok(Float32, 128, 4, 1, 128, "block")
    assert "head dim" in ok(BFloat16, 96, 4, 1, 128, "block")
    assert "block size" in ok(BFloat16, 128, 4, 1, 32, "block")
    assert "key_scale" in ok(BFloat16, 128, 4, 1, 128, "tile")
    assert "head counts" in ok(BFloat16, 128, 0, 1, 128, "block")
    assert "warps" in ok(BFloat16, 128, 4, 1, 128, "block", warps=3)
    with pytest.raises(ValueError, match="head dim"):
        QuantizeSm90(BFloat16, 32, 4, 1, 128, "block")
    qp, kp = (
        torch.zeros(10, 4, 128, dtype=torch.bfloat16),
        torch.zeros(10, 1, 128, dtype=torch.bfloat16),
    )
    assert "CUDA" in selection.quantize_reason(qp, kp, 128)  # the rest fits
    assert "same T" in selection.quantize_reason(qp, kp[:5], 128)
    assert "dtype" in selection.quantize_reason(qp, kp.half(), 128)
    assert "bf16 or fp16" in selection.quantize_reason(qp.float(), kp.float(), 128)
    assert "3-D" in selection.quantize_reason(qp[0], kp, 128)


def test_host_refuses_bad_arguments_naming_them():
    from flash_msa.cute.selection import quantize

    qp = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    kp = torch.zeros(10, 1, 128, dtype=torch.bfloat16)
    cu = testing.cu([10])
    for args, kw, err, name in (
        ((qp.tolist(), kp, cu, 128), {}, TypeError, "q_proxy"),
        ((qp, kp, cu.tolist(), 128), {}, TypeError, "cu_seqlens"),
        ((qp, kp, cu, 128.0), {}, TypeError, "block_size"),
        ((qp, kp, cu, 128), dict(max_seqlen=10.0), TypeError, "max_seqlen"),
        ((qp, kp, cu, 128, 1), {}, TypeError, "key_scale"),
        ((qp, kp, cu, 96), {}, ValueError, "block size"),
        ((qp, kp, cu, 128, "tile"), {}, ValueError, "key_scale"),
        ((qp, kp[:, :, :64], cu, 128), {}, ValueError, "same T and Dp"),
        ((qp, kp, cu, 128), {}, ValueError, "CUDA"),
    ):
        with pytest.raises(err, match=name):
            quantize(*args, **kw)


def test_select_fp8_branch_takes_the_kernel_where_it_fits(monkeypatch):
    """``selection.select`` with ``selection_precision="fp8"`` (the kernel launch replaced):
    the torch pass where the CuTe pass does not fit the call (``quantize_reason``: these CPU
    tensors), the CuTe pass with the Config's ``max_seqlen`` where it fits (``quantize_reason``
    patched)."""
    from flash_msa.cute import selection
    from flash_msa.problem import Config

    calls = []
    monkeypatch.setattr(selection, "select_fp8_into", lambda idx, qz, cu, cfg: qz)
    for module, name in ((selection, "cute"), (quant, "torch")):  # (the two select calls)
        monkeypatch.setattr(
            module, "quantize", lambda *a, name=name, **kw: calls.append((name, a[3], kw))
        )
    cu = testing.cu([300, 129])
    qp, kp = (x[0] for x in testing.make_inputs(1, 429, 1, 1, 4, 1, 1, 128)[:2])
    cfg = Config(block_size=64, softmax_scale=0.1, max_seqlen=300, proxy_scale=128**-0.5,
                 top_k=16, selection_precision="fp8")  # fmt: skip
    selection.select(qp, kp, cu, cfg)  # CPU tensors: quantize_reason refuses
    monkeypatch.setattr(selection, "quantize_reason", lambda *a: None)
    selection.select(qp, kp, cu, dataclasses.replace(cfg, max_seqlen=333))
    assert [c[0] for c in calls] == ["torch", "cute"]
    assert calls[1][1:] == (64, dict(max_seqlen=333))
