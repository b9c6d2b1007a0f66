"""GPU tests of the selection's selector warpgroup (``SelectSm90(selector=True)``, issue 15,
Option C of docs/reviews/2026-12-01-fp8-selection-epilogue.md; ``pytest -m gpu`` on Hopper with
nvidia-cutlass-dsl).

The variant makes the same offers in the same order as the default kernel (the consumers
compute every block maximum as before, the selector runs the same insertion rule on one whole
list per thread), so its indices must be the default kernel's bit for bit: compared with
``torch.equal`` on both kernels' outputs, each written into a poisoned buffer
(``testing.POISON_INT``: a slot the selector forgot differs). The default kernel itself is
checked against the reference and the Triton kernels by tests/test_gpu_cute.py and
tests/test_gpu_cute_fp8.py. Cases: bf16/fp16 and fp8 (block and per-token key scales), top_k
1, 8, 16, 17, 64, block 64 and 128, Dp 64 and 128, varlen (sequences of 1 and 129 tokens:
one key tile, fewer tiles than ring slots), random and local inputs, long sequences (70 key
tiles: the ring wraps 17 times), the shallowest and deepest key pipelines beside the ring,
identical key blocks (every score ties: block order decides), and the query map. A hang here
is the ring's barrier accounting (``select_sm90``'s module docstring, "Selector warpgroup";
replayed on the CPU by tests/test_cute_select_selector_cpu.py).
"""

import dataclasses

import pytest
import torch

from flash_msa import quant, reference, testing
from harness import config, packed_inputs
from test_gpu_cute_fp8 import _select_sm90  # (the cute backend loaded, its selection module)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


def _inputs(lengths, Hp, Hpk, Dp, dtype, seed=0, kind="random"):
    (qp, kp, *_), cu = packed_inputs(
        lengths, 1, 1, Hp, Hpk, 1, Dp, dtype=dtype, device="cuda", seed=seed, kind=kind
    )
    return qp, kp, cu


def _exact(qp, kp, cu, cfg, **variant):
    """The exact (bf16/fp16) kernel into a poisoned index buffer."""
    out = testing.poisoned((qp.shape[0], qp.shape[1], cfg.top_k), torch.int32, "cuda")
    return _select_sm90().select_into(out, qp, kp, cu, cfg, **variant)


def _fp8(qz, cu, cfg, **variant):
    """The fp8 kernel alone on quantized operands into a poisoned index buffer."""
    T, Hp, _ = qz.q.shape
    out = testing.poisoned((T, Hp, cfg.top_k), torch.int32, "cuda")
    return _select_sm90().select_fp8_into(out, qz, cu, cfg, **variant)


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
def test_selector_exact_is_bitwise_the_default(case, kind):
    lengths, Hp, Hpk, Dp, b, top_k, dtype = case
    qp, kp, cu = _inputs(lengths, Hp, Hpk, Dp, dtype, kind=kind)
    cfg = config(max(lengths), 16, Dp, b, top_k)
    default = _exact(qp, kp, cu, cfg)
    assert torch.equal(_exact(qp, kp, cu, cfg, selector=True), default)


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
def test_selector_fp8_is_bitwise_the_default(case, kind):
    lengths, Hp, Hpk, Dp, b, top_k, dtype, key_scale = case
    qp, kp, cu = _inputs(lengths, Hp, Hpk, Dp, torch.float32, kind=kind)
    qp, kp = qp.to(dtype).contiguous(), kp.to(dtype).contiguous()
    cfg = dataclasses.replace(config(max(lengths), 16, Dp, b, top_k), selection_precision="fp8")
    qz = quant.quantize(qp, kp, cu, b, key_scale=key_scale)
    assert torch.equal(_fp8(qz, cu, cfg, selector=True), _fp8(qz, cu, cfg))


@pytest.mark.parametrize("stages", [2, 5])
def test_selector_beside_the_shallowest_and_deepest_key_pipelines(stages):
    """The ring beside 2 key stages (the consumers wait on the producer more often) and 5 (the
    most bf16 Dp=128 stages that fit with the ring): the default's indices."""
    qp, kp, cu = _inputs((3000, 1, 2100), 4, 1, 128, torch.bfloat16, seed=2)
    cfg = config(3000, 16, 128, 64, 24)
    default = _exact(qp, kp, cu, cfg)
    assert torch.equal(_exact(qp, kp, cu, cfg, stages=stages, selector=True), default)


def test_selector_fp8_at_the_deepest_pipeline_that_fits():
    """12 fp8 stages (13 do not fit with the ring: ``can_implement``)."""
    qp, kp, cu = _inputs((3000, 1, 2100), 4, 1, 128, torch.bfloat16, seed=2)
    cfg = dataclasses.replace(config(3000, 16, 128, 64, 24), selection_precision="fp8")
    qz = quant.quantize(qp, kp, cu, 64)
    assert torch.equal(_fp8(qz, cu, cfg, stages=12, selector=True), _fp8(qz, cu, cfg))


def test_selector_keeps_ties_in_block_order():
    """Identical key blocks: every score ties, the lower blocks win (equal to the reference
    and to the default, across list evictions at top_k 24 and with a whole 64-entry list)."""
    g = torch.Generator().manual_seed(1)
    S, Dp = 128 * 40, 128
    kp = torch.randn(128, 1, Dp, generator=g).repeat(40, 1, 1).to("cuda", torch.bfloat16)
    qp = torch.randn(S, 2, Dp, generator=g).to("cuda", torch.bfloat16)
    cu = testing.cu([S], "cuda")
    qz = quant.quantize(qp, kp, cu, 128)
    for top_k in (5, 24, 64):
        cfg = dataclasses.replace(config(S, 16, Dp, 128, top_k), selection_precision="fp8")
        got = _fp8(qz, cu, cfg, selector=True)
        assert torch.equal(got, _fp8(qz, cu, cfg)), top_k
        assert torch.equal(got, reference.select(qp, kp, cu, cfg, quantized=qz)), top_k
        exact = dataclasses.replace(cfg, selection_precision="bf16")
        assert torch.equal(_exact(qp, kp, cu, exact, selector=True), _exact(qp, kp, cu, exact))


@pytest.mark.parametrize("kind", ["zigzag", "random"])
@pytest.mark.parametrize("case", [0, 1], ids=["8192-k16", "9000x300-k64"])
def test_selector_query_map_is_bitwise_the_default(case, kind):
    """The query-map kernel with the selector (each selector thread writes its row's query
    row; padding rows left alone): the default's indices bit for bit."""
    from test_gpu_cute import _local_rows, _q_map  # the query maps of the q_map tests

    lengths, Hp, Hpk, Dp, b, top_k, dtype = (EXACT_CASES[0], EXACT_CASES[2])[case]
    qp, kp, cu = _inputs(lengths, Hp, Hpk, Dp, dtype)
    cfg = config(max(lengths), 16, Dp, b, top_k)
    q_map = _q_map(kind, lengths, b)
    qp_l = _local_rows(qp, q_map)
    outs = []
    for selector in (False, True):
        into = testing.poisoned((qp_l.shape[0], Hp, top_k), torch.int32, "cuda")
        outs.append(
            _select_sm90().select_into(into, qp_l, kp, cu, cfg, q_map=q_map, selector=selector)
        )
    assert torch.equal(outs[1], outs[0])
