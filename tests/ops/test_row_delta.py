"""GPU tests of the CuTe row delta (``flash_msa/cute/row_delta_sm90.py``, its host code
``backward.row_delta``: the backward's ``delta = rowsum(dO * O)``) on Hopper, against the fp64
sum of the products by the harness's rule
(``err(kernel) <= 2 * err(problem.row_delta) + atol``, ``problem.row_delta`` being the fp32
torch path it replaces) and next to ``problem.row_delta``; bf16 and fp16, both head dims, row
counts that leave a partial CTA, and one input past 2^31 elements (64-bit offsets). The output
starts NaN-poisoned (every row must be written). Also: bitwise determinism, NaN / inf
propagation as torch's, no host synchronization, CUDA-graph capture.

``problem.row_delta`` (the backward's ``rowsum(dO * O)``) is bitwise the plain expression
``(dout.float() * out.float()).sum(-1)`` it replaced, in every dtype the backends take, signed
zeros, subnormal-range products and infinities included (CPU; the op is the same on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from flash_msa import problem, testing
from flash_msa.problem import row_delta
from harness import marked, poison_new_buffers

MARKS_ROW_DELTA = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]

DTYPES = [torch.bfloat16, torch.float16]
# (T, H, D): one row (a CTA of one row), rows that fill no CTA exactly (64 / 128 rows per CTA
# at D 128 / 64), the anchor and paper head counts
SHAPES = [(1, 1, 128), (1, 1, 64), (777, 16, 128), (300, 64, 64), (4097, 3, 128), (2048, 64, 128)]


def _module():
    pytest.importorskip("cutlass")
    from flash_msa.cute import backward

    return backward


def _inputs(T, H, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn((T, H, D), generator=g, device="cuda").to(dtype)
    out = torch.randn((T, H, D), generator=g, device="cuda").to(dtype)
    return dout, out


def _exact(dout, out, chunk=1 << 24):
    """``rowsum(dout * out)`` in fp64, by chunks of rows (the fp64 products of an input past
    2^31 elements would take 17 GB)."""
    T, H, D = dout.shape
    a, b = dout.view(T * H, D), out.view(T * H, D)
    rows = max(1, chunk // D)
    res = torch.empty(T * H, dtype=torch.float64, device=dout.device)
    for r in range(0, T * H, rows):
        res[r : r + rows] = (a[r : r + rows].double() * b[r : r + rows].double()).sum(-1)
    return res.view(T, H)


def _check(delta, dout, out):
    exact = _exact(dout, out)
    same = problem.row_delta(dout, out)
    assert delta.dtype == torch.float32 and delta.shape == exact.shape
    assert not delta.isnan().any(), "unwritten (NaN-poisoned) rows"
    testing.assert_close("delta", delta, exact, same)
    # next to the torch path: both fp32 sums of the same exact products, in two orders
    assert testing.max_err(delta, same) <= testing.rounding_atol(exact, torch.float32)


@marked(MARKS_ROW_DELTA)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{t}x{h}x{d}" for t, h, d in SHAPES])
def test_row_delta_matches_fp64(shape, dtype, monkeypatch):
    rd = _module()
    poison_new_buffers(monkeypatch)
    dout, out = _inputs(*shape, dtype, seed=sum(shape))
    _check(rd.row_delta(dout, out), dout, out)


@marked(MARKS_ROW_DELTA)
@pytest.mark.slow
def test_past_2_to_the_31_elements(monkeypatch):
    """T * H * D = 2.21e9 > 2^31 (bf16, 4.4 GB per input): rows past element 2^31 read at
    64-bit offsets; the last rows checked on their own too."""
    rd = _module()
    poison_new_buffers(monkeypatch)
    T, H, D = 270_000, 64, 128
    assert T * H * D > 2**31
    dout, out = _inputs(T, H, D, torch.bfloat16, seed=31)
    delta = rd.row_delta(dout, out)
    tail = slice(T - 5000, T)  # all of it past 2^31 elements
    exact_tail = _exact(dout[tail], out[tail])
    same_tail = problem.row_delta(dout[tail], out[tail])
    testing.assert_close("delta tail", delta[tail], exact_tail, same_tail)
    _check(delta, dout, out)


@marked(MARKS_ROW_DELTA)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_and_no_host_sync(dtype):
    rd = _module()
    dout, out = _inputs(3000, 64, 128, dtype, seed=5)
    first = rd.row_delta(dout, out)  # (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = [rd.row_delta(dout, out) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x in again:
        assert torch.equal(x, first)


@marked(MARKS_ROW_DELTA)
def test_nan_and_inf_propagate_as_torch():
    rd = _module()
    dout, out = _inputs(64, 16, 128, torch.bfloat16, seed=7)
    dout[3, 2, 17] = float("nan")
    out[5, 1, 0] = float("inf")  # inf * (nonzero) -> +-inf
    dout[5, 1, 0] = 1.0
    out[9, 4, 100] = float("inf")
    dout[9, 4, 100] = 0.0  # inf * 0 -> NaN
    got = rd.row_delta(dout, out)
    want = problem.row_delta(dout, out)
    assert got[3, 2].isnan() and got[9, 4].isnan() and got[5, 1] == float("inf")
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = got.isfinite()
    assert testing.max_err(got[fin], want[fin]) < 1e-3


@marked(MARKS_ROW_DELTA)
def test_cuda_graph_capture():
    """Captured after a warm-up call (the compile), replayed on new values in the same input
    buffers: equal to eager calls, bitwise."""
    rd = _module()
    dout, out = _inputs(1000, 64, 128, torch.bfloat16, seed=9)
    rd.row_delta(dout, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rd.row_delta(dout, out)  # warm up on the side stream as well
        with torch.cuda.graph(graph, stream=s):
            delta = rd.row_delta(dout, out)
    torch.cuda.current_stream().wait_stream(s)
    new_dout, new_out = _inputs(1000, 64, 128, torch.bfloat16, seed=10)
    dout.copy_(new_dout)
    out.copy_(new_out)
    testing.poison(delta)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(delta, rd.row_delta(new_dout, new_out))


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
