"""Bad varlen metadata never reaches a kernel: rows it makes meaningless come out NaN, the
other rows are exact (flash_msa.guard).

The value checks that read ``cu_seqlens``/``indices``/``q_map`` run on CPU tensors; on GPU
tensors and under ``torch.compile`` they do not (a host sync), and the device-side guard takes
over. These tests turn the value checks off on CPU (``api._value_checks``) to run that path on
the torch backend and on the Triton interpreter. Without the guard, the first case aborts the
process with heap corruption on the interpreter (an out-of-bounds write on a GPU).
"""

import math

import pytest
import torch

import flash_msa
from flash_msa import api

T, H, HKV, D, HP, DP, BLOCK, TOP_K = 150, 4, 2, 32, 2, 32, 64, 2

# (cu_seqlens, max_seqlen, the rows whose sequence is well formed: (start, end) or None)
CASES = {
    "past_the_tokens": ([0, 90, 170], 90, (0, 90)),
    "longer_than_max_seqlen": ([0, 50, 150], 60, (0, 50)),
    "not_starting_at_0": ([10, 90, 150], 90, (90, 150)),
    "decreasing": ([0, 100, 60, 150], 100, (0, 100)),
    "short_of_the_tokens": ([0, 100], 100, (0, 100)),
}


@pytest.fixture
def unchecked(monkeypatch):
    """The GPU default on CPU: the API reads no metadata values."""
    monkeypatch.setattr(api, "_value_checks", lambda device: False)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(T, HP, DP), (T, HP, DP), (T, H, D), (T, HKV, D), (T, HKV, D)]
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _msa(xs, cu, max_seqlen, **kw):
    cu = torch.tensor(cu, dtype=torch.int32)
    return flash_msa.msa_attention(
        *xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=max_seqlen, **kw
    )


def _alone(xs, start, end):
    """The well-formed sequence ``[start, end)`` as its own call (checked metadata)."""
    part = [x.detach()[start:end] for x in xs]
    return _msa(part, [0, end - start], end - start)[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_cu_seqlens_gives_nan_rows_and_exact_others(unchecked, monkeypatch, backend, case):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    cu, max_seqlen, good = CASES[case]
    xs = _inputs()
    out, kl = _msa(xs, cu, max_seqlen)
    start, end = good
    bad_rows = torch.ones(T, dtype=torch.bool)
    bad_rows[start:end] = False
    assert out[bad_rows].isnan().all(), "a row of a malformed sequence is not NaN"
    assert math.isnan(kl.item())
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    torch.testing.assert_close(out[start:end], _alone(xs, start, end), atol=1e-5, rtol=1e-5)
    # the backward runs over the same safe metadata: the well-formed sequence's gradients are
    # finite (a dropped row's are NaN: its out is NaN where the backward reads it)
    (out.nan_to_num(0.0).sum() + kl.nan_to_num(0.0)).backward()
    for x in xs:
        assert x.grad is not None and torch.isfinite(x.grad[start:end]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_indices_give_nan_rows_and_exact_others(unchecked, monkeypatch, backend):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    q, k, v = (x.detach().requires_grad_() for x in _inputs()[2:])
    b = 1
    idx = torch.full((1, T, b, 2), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = torch.arange(T) // BLOCK  # the own block: well formed
    bad = {3: [2**31 - 1, -1], 70: [-2, -1], 100: [1, 0], 120: [-1, 1], 140: [3, -1]}
    for row, entries in bad.items():
        idx[0, row, 0] = torch.tensor(entries, dtype=torch.int32)
    q, k, v = q[None], k[None], v[None]
    out = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK)
    rows = torch.tensor(sorted(bad))
    assert out[0, rows].isnan().all()
    good = torch.ones(T, dtype=torch.bool)
    good[rows] = False
    clean = idx.clone()
    clean[0, rows, 0] = torch.stack([rows // BLOCK, torch.full_like(rows, -1)], 1).int()
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    want = flash_msa.sparse_attention(q.detach(), k.detach(), v.detach(), clean, block_size=BLOCK)
    torch.testing.assert_close(out[0, good], want[0, good], atol=1e-5, rtol=1e-5)


def test_bad_q_map_entries_become_nan_rows(unchecked):
    xs = [x.detach() for x in _inputs()]
    q_map = torch.arange(T, dtype=torch.int32)
    q_map[[5, 60]] = torch.tensor([T, -7], dtype=torch.int32)
    q_map[7] = -1  # a padding row: 0, as documented
    cu = torch.tensor([0, 80, T], dtype=torch.int32)
    out, kl = api._msa_attention(
        *xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=80, q_map=q_map
    )
    assert out[[5, 60]].isnan().all() and math.isnan(kl.item())
    assert (out[7] == 0).all()
    others = torch.ones(T, dtype=torch.bool)
    others[[5, 60]] = False
    assert torch.isfinite(out[others]).all()


def test_select_blocks_empties_rows_of_bad_sequences(unchecked):
    qp, kp = (x.detach() for x in _inputs()[:2])
    cu = torch.tensor([0, 90, 170], dtype=torch.int32)
    idx = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90)
    assert (idx[90:] == -1).all()  # no own block: the mark of a dropped row
    assert (idx[:90, :, 0] == 0).all()


def test_bad_cu_seqlens_under_torch_compile_gives_nan_rows():
    """Traced calls never read values: the guard is in the graph (aot_eager on CPU)."""
    xs = [x.detach() for x in _inputs()]
    cu = torch.tensor([10, 90, T], dtype=torch.int32)

    def f(*a):
        return flash_msa.msa_attention(
            *a, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90
        )

    torch._dynamo.reset()
    out, kl = torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)
    assert out[:90].isnan().all() and math.isnan(kl.item())
    torch.testing.assert_close(out[90:], _alone(xs, 90, T), atol=1e-5, rtol=1e-5)


def test_debug_mode_asserts_on_the_device_under_torch_compile(monkeypatch):
    monkeypatch.setenv("FLASH_MSA_DEBUG", "1")
    xs = [x.detach() for x in _inputs()]
    cu = torch.tensor([0, 90, 170], dtype=torch.int32)

    def f(*a):
        return flash_msa.msa_attention(
            *a, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=90
        )

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="cu_seqlens/max_seqlen are not well formed"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)


def test_max_seqlen_above_the_tokens_is_refused():
    xs = [x.detach() for x in _inputs()]
    with pytest.raises(ValueError, match=r"max_seqlen \(1000000000\) is larger than the total"):
        _msa(xs, [0, 60, T], 10**9)


@pytest.mark.parametrize(
    "name, value", [("softmax_scale", 1e39), ("proxy_scale", 3e38), ("softmax_scale", 1e-46)]
)
def test_scales_outside_float32_are_refused(name, value):
    xs = [x.detach() for x in _inputs()]
    with pytest.raises(ValueError, match=name):
        _msa(xs, [0, T], T, **{name: value})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_past_the_last_offset_leave_warmup_gradients_exact(
    unchecked, monkeypatch, backend, deterministic
):
    """``cu_seqlens`` ending short of the tokens (a batch padded at its end), dense warmup: the
    sequence's gradients equal its own call's (no list or store reaches the rows past the end;
    the deterministic backward's buffers are zeros there, not uninitialized memory)."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    xs = _inputs()
    out, kl = _msa(xs, [0, 100], 100, warmup=True, deterministic=deterministic)
    assert out[100:].isnan().all() and math.isnan(kl.item())
    (out.nan_to_num(0.0).sum() + kl.nan_to_num(0.0)).backward()
    monkeypatch.setattr(api, "_value_checks", lambda device: True)
    part = [x.detach()[:100].requires_grad_() for x in xs]
    o2, _ = _msa(part, [0, 100], 100, warmup=True, deterministic=deterministic)
    o2.sum().backward()
    for x, y in zip(xs[2:], part[2:]):  # the main gradients (the KL's weight is 0 here)
        torch.testing.assert_close(x.grad[:100], y.grad, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(x.grad[100:]).all()


def test_causal_blocks_of_rows_past_the_last_offset_are_empty():
    from flash_msa import worklist

    cu = torch.tensor([0, 100], dtype=torch.int32)
    rows = worklist.causal_blocks(cu, BLOCK, 100, 2, T)
    assert (rows[100:] == -1).all() and (rows[:100, :, 0] == 0).all()


@pytest.mark.parametrize("precision", ["fp8", "fp8_rerank"])
def test_fp8_selection_with_rows_past_the_last_offset(unchecked, monkeypatch, precision):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    qp, kp = (x.detach() for x in _inputs()[:2])
    cu = torch.tensor([0, 100], dtype=torch.int32)
    idx = flash_msa.select_blocks(
        qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=100,
        selection_precision=precision,
    )  # fmt: skip
    assert (idx[100:] == -1).all() and (idx[:100, :, 0] == 0).all()


def test_inference_mode(unchecked):
    xs = [x.detach() for x in _inputs()]
    with torch.inference_mode():
        cu = torch.tensor([0, 90, 170], dtype=torch.int32)
        out, _ = _msa(xs, cu.tolist(), 90)
    assert out[90:].isnan().all() and torch.isfinite(out[:90]).all()
