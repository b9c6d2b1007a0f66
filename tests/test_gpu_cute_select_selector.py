"""GPU tests of the selection kernel where its selector warpgroup's ring is stressed
(``SelectSm90``: the top-k lists in a fourth warpgroup fed block maxima through a ring of
shared memory, issue 15, Option C of docs/reviews/2026-12-01-fp8-selection-epilogue.md;
``pytest -m gpu`` on Hopper with nvidia-cutlass-dsl).

Every case is checked against independent oracles, each kernel output written into a poisoned
buffer (``testing.POISON_INT``: a slot the selector forgot fails the index format): the exact
(bf16/fp16) kernel against ``reference.select`` with the near-tie rule of tests/test_gpu_cute.py
(``testing.selection_mismatch``, its ``_check_format``), the fp8 kernel against the Triton fp8
oracle and ``reference.select(..., quantized=)`` on the same quantized operands with the rule
of tests/test_gpu_cute_fp8.py (its ``_mismatch`` on the dequantized operands). Where every
score ties (identical key blocks) the block order alone decides: there the kernel must equal
the reference and the closed form exactly. Cases: bf16/fp16 and fp8 (block and per-token key
scales), top_k 1, 8, 16, 17, 64, block 64 and 128, Dp 64 and 128, varlen (sequences of 1 and
129 tokens: one key tile, fewer tiles than ring slots), random and local inputs, long sequences
(64 to 70 key tiles: the ring of 4 slots wraps 16 to 17 times), the shallowest and deepest key
pipelines that fit beside the ring, identical key blocks, and the query map. A hang here is
the ring's barrier accounting (``select_sm90``'s module docstring, "Selector warpgroup";
replayed on the CPU by tests/test_cute_select_selector_cpu.py).
"""

import dataclasses

import pytest
import torch

from flash_msa import reference, testing
from harness import config
from test_gpu_cute import (  # the exact selection's helpers: index format, inputs, query maps
    _check_format,
    _check_mapped_format,
    _local_rows,
    _on_tokens,
    _q_map,
    _select_case,
    _select_into_poisoned,
)
from test_gpu_cute_fp8 import _case, _cute_fp8, _mismatch, _oracle_and_reference, _select_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


def _exact(qp, kp, cu, cfg, **variant):
    """The exact kernel into a poisoned index buffer (cutlass present, the backend loaded)."""
    _select_sm90()
    return _select_into_poisoned(qp, kp, cu, cfg, **variant)


def _check_exact(idx, qp, kp, cu, cfg):
    """The exact kernel's ``idx``: the index format (every slot written) and the reference's
    block sets, near-ties accepted (tests/test_gpu_cute.py's rule)."""
    _check_format(idx, cu, cfg.block_size)
    ref = reference.select(qp, kp, cu, cfg)
    bad = testing.selection_mismatch(
        idx.cpu(), ref.cpu(), qp.cpu(), kp.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )
    assert bad == 0


def _check_fp8(idx, qp, kp, cu, cfg, qz):
    """The fp8 kernel's ``idx``: the index format and the block sets of the Triton fp8 oracle
    and the reference on the same quantized operands ``qz``, near-ties accepted
    (tests/test_gpu_cute_fp8.py's rule)."""
    _check_format(idx, cu, cfg.block_size)
    for other in _oracle_and_reference(qp, kp, cu, cfg, qz):
        assert _mismatch(idx, other, qz, cu, cfg) == 0


EXACT_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16),  # anchor / paper proxy heads, 64 tiles
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16),  # varlen, block 64, Dp 64
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16),  # top_k 64, block 128
    ((5000, 77), 4, 1, 128, 64, 64, torch.float16),  # top_k 64, block 64 (two slabs)
    ((4100,), 4, 2, 128, 64, 16, torch.bfloat16),  # block 64, Hpk 2
    ((5000,), 2, 1, 64, 64, 17, torch.float16),  # odd top_k > 16
    ((1500,), 4, 2, 128, 128, 1, torch.float16),  # top_k 1
]


@pytest.mark.parametrize(
    "case", EXACT_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-b{c[4]}-k{c[5]}"
)
@pytest.mark.parametrize("kind", ["random", "local"])
def test_selector_exact_matches_reference(case, kind):
    qp, kp, cu, cfg = _select_case(*case, kind=kind)
    _check_exact(_exact(qp, kp, cu, cfg), qp, kp, cu, cfg)


FP8_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype, key scale
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16, "block"),  # paper's kernel
    ((8192,), 4, 1, 128, 64, 16, torch.bfloat16, "block"),
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16, "block"),
    ((5000, 77), 4, 1, 128, 64, 64, torch.float16, "block"),
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16, "block"),  # varlen, Dp 64
    ((4100,), 4, 4, 128, 64, 16, torch.bfloat16, "token"),  # per-token key scales
    ((6000, 1, 333), 4, 1, 128, 128, 64, torch.float16, "token"),
    ((2500,), 2, 1, 64, 64, 1, torch.bfloat16, "token"),
]


def _fp8_id(c):
    return "x".join(map(str, c[0])) + f"-Dp{c[3]}-b{c[4]}-k{c[5]}-{c[7]}"


@pytest.mark.parametrize("case", FP8_CASES, ids=_fp8_id)
@pytest.mark.parametrize("kind", ["random", "local"])
def test_selector_fp8_matches_oracle_and_reference(case, kind):
    *shape, key_scale = case
    qp, kp, cu, cfg, qz = _case(*shape, kind=kind, key_scale=key_scale)
    _check_fp8(_cute_fp8(qz, cu, cfg), qp, kp, cu, cfg, qz)


@pytest.mark.parametrize("stages", [2, 5])
def test_selector_beside_the_shallowest_and_deepest_key_pipelines(stages):
    """The ring beside 2 key stages (the consumers wait on the producer more often) and 5 (the
    most bf16 Dp=128 stages that fit with the ring, ``can_implement``): the reference's
    selection, and the default depth's indices (the same scores in the same order)."""
    qp, kp, cu, cfg = _select_case((3000, 1, 2100), 4, 1, 128, 64, 24, torch.bfloat16, seed=2)
    got = _exact(qp, kp, cu, cfg, stages=stages)
    _check_exact(got, qp, kp, cu, cfg)
    assert torch.equal(got, _exact(qp, kp, cu, cfg))


def test_selector_fp8_at_the_deepest_pipeline_that_fits():
    """12 fp8 stages (13 do not fit with the ring: ``can_implement``): the oracle's and the
    reference's selection, and the default depth's indices."""
    qp, kp, cu, cfg, qz = _case((3000, 1, 2100), 4, 1, 128, 64, 24, torch.bfloat16, seed=2)
    got = _cute_fp8(qz, cu, cfg, stages=12)
    _check_fp8(got, qp, kp, cu, cfg, qz)
    assert torch.equal(got, _cute_fp8(qz, cu, cfg))


def _ties_expected(S, block, top_k):
    """The selection when every key block scores the same for a query: the own block and the
    lowest ``top_k - 1`` blocks before it, ascending, -1 padded (``(S, top_k)`` int32)."""
    out = torch.full((S, top_k), -1, dtype=torch.int32)
    for i in range(S // block):
        kept = [*range(min(top_k - 1, i)), i]
        out[i * block : (i + 1) * block, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out


def test_selector_keeps_ties_in_block_order():
    """Identical key blocks: every score ties, the lower blocks win, across list evictions
    (top_k 5, 24) and with a whole 64-entry list: the kernels and the references equal the
    closed form exactly (no near-tie allowance). Integer-valued operands, so that the exact
    scores are exact in the kernel and the reference alike (no rounding can break a tie); the
    fp8 operands of identical blocks are identical (the same rotation, e4m3 bytes and block
    scale), and both fp8 implementations score identical key columns identically (as in
    tests/test_gpu_cute_fp8.py's tie test)."""
    from flash_msa import quant

    g = torch.Generator().manual_seed(1)
    S, Dp, b = 128 * 40, 128, 128
    kp = torch.randint(-3, 4, (b, 1, Dp), generator=g).float().repeat(S // b, 1, 1)
    qp = torch.randint(-3, 4, (S, 2, Dp), generator=g).float()
    kp, qp = kp.to("cuda", torch.bfloat16), qp.to("cuda", torch.bfloat16)
    cu = testing.cu([S], "cuda")
    qz = quant.quantize(qp, kp, cu, b)
    for top_k in (5, 24, 64):
        want = _ties_expected(S, b, top_k)[:, None].expand(S, 2, top_k).cuda()
        exact = config(S, 16, Dp, b, top_k)
        assert torch.equal(reference.select(qp, kp, cu, exact), want), top_k  # the closed form
        assert torch.equal(_exact(qp, kp, cu, exact), want), top_k
        cfg = dataclasses.replace(exact, selection_precision="fp8")
        assert torch.equal(reference.select(qp, kp, cu, cfg, quantized=qz), want), top_k
        assert torch.equal(_cute_fp8(qz, cu, cfg), want), top_k


@pytest.mark.parametrize("kind", ["zigzag", "random"])
@pytest.mark.parametrize("case", [0, 2], ids=["8192-k16", "9000x300-k64"])
def test_selector_query_map_matches_reference(case, kind):
    """The query-map kernel (each selector thread writes its row's query row; padding rows
    left alone, still poisoned): the index format at the rows' positions and the reference's
    selection with the same map, near-ties accepted (tests/test_gpu_cute.py's rule on the
    tokens' rows)."""
    qp, kp, cu, cfg = _select_case(*EXACT_CASES[case])
    q_map = _q_map(kind, EXACT_CASES[case][0], cfg.block_size)
    qp_l = _local_rows(qp, q_map)
    real = q_map >= 0
    into = testing.poisoned((qp_l.shape[0], qp.shape[1], cfg.top_k), torch.int32, "cuda")
    _select_sm90().select_into(into, qp_l, kp, cu, cfg, q_map=q_map)
    assert (into[~real] == testing.POISON_INT).all(), "a padding row was written"
    _check_mapped_format(into, q_map, cu, cfg.block_size)
    want = reference.select(qp_l, kp, cu, cfg, q_map=q_map)
    base = reference.select(qp, kp, cu, cfg)  # every token's (rows the map leaves out)
    bad = testing.selection_mismatch(
        _on_tokens(into, q_map, base), _on_tokens(want, q_map, base), qp.cpu(), kp.cpu(),
        cfg.block_size, cfg.proxy_scale, cu.cpu(),
    )  # fmt: skip
    assert bad == 0
