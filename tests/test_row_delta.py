"""``problem.row_delta`` (the backward's ``rowsum(dO * O)``) is bitwise the plain expression
``(dout.float() * out.float()).sum(-1)`` it replaced, in every dtype the backends take, signed
zeros, subnormal-range products and infinities included (CPU; the op is the same on CUDA)."""

from __future__ import annotations

import pytest
import torch

from flash_msa.problem import row_delta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_row_delta_is_bitwise_the_plain_expression(dtype):
    g = torch.Generator().manual_seed(0)
    dout = torch.randn(37, 5, 64, generator=g).to(dtype)
    out = torch.randn(37, 5, 64, generator=g).to(dtype)
    tiny = torch.finfo(dtype).tiny
    dout[0, 0, :8] = torch.tensor([0.0, -0.0, 0.0, -0.0, tiny, -tiny, 1e-3, 2.0], dtype=dtype)
    out[0, 0, :8] = torch.tensor([-0.0, -0.0, 0.0, 0.0, tiny, tiny, tiny, float("inf")]).to(dtype)
    dout[1, 0] = -0.0  # a whole row of -0 * x: the sum's sign
    out[2, 1, 3] = float("nan")
    want = (dout.float() * out.float()).sum(-1)
    got = row_delta(dout, out)
    assert got.dtype == torch.float32 and got.shape == (37, 5)
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all()
    assert torch.equal(torch.signbit(got), torch.signbit(want))
