"""Triton kernels against the reference, on CPU under the interpreter (or on a GPU).

The interpreter computes fp32 and fp16 correctly but not bf16 (toolchain notes), so CPU runs use
fp32 (exact comparisons) and fp16 (selection compared with the near-tie rule).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_msa import backends, reference, testing
from flash_msa.problem import Config

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or backends.interpreting()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _select_case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random"):
    from flash_msa.triton_ref import selection

    T = sum(lengths)
    qp, kp = testing.make_inputs(1, T, 1, 1, Hp, Hpk, 1, Dp, dtype=dtype, seed=seed, kind=kind)[:2]
    qp, kp = qp[0].to(DEV), kp[0].to(DEV)
    cu = _cu(lengths).to(DEV)
    cfg = Config(b, 1.0, max(lengths), Dp**-0.5, top_k)
    out = torch.full((T, Hp, top_k), -7, dtype=torch.int32, device=DEV)  # poison
    selection.select_into(out, qp, kp, cu, cfg)
    ref = reference.select(qp.cpu(), kp.cpu(), cu.cpu(), cfg)
    return out.cpu(), ref, qp.cpu(), kp.cpu(), cu.cpu()


@pytest.mark.parametrize(
    "lengths, Hp, Hpk, Dp, b, top_k",
    [
        ((300,), 4, 1, 16, 64, 3),  # anchor-like grouping G=4, partial last block
        ((70, 1, 200), 2, 2, 32, 128, 2),  # varlen, G=1, a 1-token sequence
        ((257,), 3, 1, 16, 64, 5),  # G=3 (rows not a power of two per token)
        ((200, 140), 2, 1, 16, 64, 9),  # top_k > visible blocks for most rows
    ],
)
def test_select_fp32_equals_reference(lengths, Hp, Hpk, Dp, b, top_k):
    out, ref, *_ = _select_case(lengths, Hp, Hpk, Dp, b, top_k, torch.float32)
    assert (out != -7).all(), "unwritten entries"
    assert torch.equal(out, ref)


def test_select_fp16_equals_reference_up_to_near_ties():
    out, ref, qp, kp, cu = _select_case((400,), 4, 1, 32, 64, 4, torch.float16, seed=3)
    assert (out != -7).all()
    assert testing.selection_mismatch(out, ref, qp, kp, 64, 32**-0.5, cu) == 0


def test_select_ties_go_to_lower_block():
    from flash_msa.triton_ref import selection

    T, b = 5 * 64, 64
    qp = torch.zeros(T, 2, 16, device=DEV)  # every score 0: all blocks tie
    kp = torch.randn(T, 1, 16, device=DEV)
    cfg = Config(b, 1.0, T, 0.25, 3)
    out = selection.select(qp, kp, _cu([T]).to(DEV), cfg).cpu()
    assert torch.equal(out, reference.select(qp.cpu(), kp.cpu(), _cu([T]), cfg))
    assert out[T - 1, 0].tolist() == [0, 1, 4]


@given(st.data())
def test_select_properties_hypothesis(data):
    b = data.draw(st.sampled_from([64, 128]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 2 * b + 9), min_size=1, max_size=3), label="lens")
    Hpk = data.draw(st.sampled_from([1, 2]), label="Hpk")
    Hp = Hpk * data.draw(st.sampled_from([1, 2, 3]), label="G")
    top_k = data.draw(st.integers(1, 6), label="top_k")
    seed = data.draw(st.integers(0, 1000), label="seed")
    out, ref, *_ = _select_case(lengths, Hp, Hpk, 16, b, top_k, torch.float32, seed=seed)
    assert torch.equal(out, ref)
