"""GPU tests of the CuTe FP8 selection (``selection_precision="fp8"``; ``pytest -m gpu`` on Hopper
with nvidia-cutlass-dsl): ``SelectSm90`` with e4m3 operands and key scales, called directly
(``select_sm90.select_fp8_into`` / ``selection.select``; declared for ``auto`` in
``LIMITS["select"].fp8_selection``).

Every check compares index sets on **identical quantized operands** (``quant.quantize`` once,
given to every implementation): the Triton fp8 oracle (``triton_ref/selection_fp8.py``, the same
``wgmma ... .e4m3.e4m3`` products) and the torch reference (``reference.select(...,
quantized=)``, exact e4m3 products summed in fp32; Hopper's FP8 MMA accumulates with about 22
bits, so the kernels' scores are slightly less exact: if only the reference comparison fails,
look at that before the kernel). They may differ only by near-ties:
``testing.selection_mismatch`` on the dequantized operands (``quant.dequantize``: their fp64
products are the fp8 scores times a positive row constant), as tests/test_fp8_selection.py
checks the oracle. Inputs: random, local and ``gain`` (each key block scaled by its own factor in
[1/8, 8], so that the key scales decide the ranking; a kernel that ignored them fails, which
the test shows on the same input). The index buffer starts poisoned (``testing.POISON_INT``),
so a slot the kernel forgot fails the format check.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flash_msa import backends, quant, reference, testing
from harness import config, no_host_sync, packed_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


def _select_sm90():
    pytest.importorskip("cutlass")
    module, why = backends.load("cute")
    assert module is not None, why
    from flash_msa.cute import select_sm90

    return select_sm90


def _case(lengths, Hp, Hpk, Dp, b, top_k, dtype, seed=0, kind="random", key_scale="block"):
    """``(qp, kp, cu, cfg, qz)``: packed proxies on the GPU (``kind`` random, local or gain),
    the fp8 ``Config`` and the quantized operands every implementation ranks."""
    gain = kind == "gain"
    (qp, kp, *_), cu = packed_inputs(
        lengths, 1, 1, Hp, Hpk, 1, Dp, dtype=torch.float32, device="cuda", seed=seed,
        kind="random" if gain else kind,
    )  # fmt: skip
    if gain:  # per key block a factor in [1/8, 8]: the key scales decide the ranking
        blk = quant.block_of_token(cu, kp.shape[0], b)
        g = torch.Generator().manual_seed(seed + 1)
        f = 2.0 ** (6 * torch.rand(int(blk.max()) + 1, generator=g) - 3)
        kp = kp * f.to("cuda")[blk][:, None, None]
    qp, kp = qp.to(dtype).contiguous(), kp.to(dtype).contiguous()
    cfg = dataclasses.replace(config(max(lengths), 16, Dp, b, top_k), selection_precision="fp8")
    return qp, kp, cu, cfg, quant.quantize(qp, kp, cu, b, key_scale=key_scale)


def _cute_fp8(qz, cu, cfg, **variant):
    """The CuTe fp8 kernel into a poisoned index buffer (every slot must be written)."""
    T, Hp, _ = qz.q.shape
    out = testing.poisoned((T, Hp, cfg.top_k), torch.int32, "cuda")
    return _select_sm90().select_fp8_into(out, qz, cu, cfg, **variant)


def _check_format(idx, cu, b):
    """Ascending valid entries, then -1; min(K, own + 1) of them; the own block among them."""
    K = idx.shape[2]
    lens = (cu[1:] - cu[:-1]).tolist()
    pos = torch.cat([torch.arange(n, device=idx.device) for n in lens])  # sequence-local
    own = (pos // b)[:, None, None]
    valid = idx >= 0
    assert (valid.sum(-1) == torch.clamp(own[..., 0] + 1, max=K)).all(), "entry count"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 only after the valid entries"
    big = torch.where(valid, idx, torch.iinfo(torch.int32).max)
    assert (big[..., 1:] > big[..., :-1])[valid[..., 1:]].all(), "ascending, no duplicates"
    assert ((idx == own) & valid).any(-1).all(), "own block kept"
    assert (idx[valid] <= own.expand_as(idx)[valid]).all(), "no future block"


def _mismatch(idx, other, qz, cu, cfg):
    """Rows of ``idx`` and ``other`` that differ beyond near-ties of the fp8 scores."""
    qd, kd = quant.dequantize(qz)
    return testing.selection_mismatch(
        idx.cpu(), other.cpu(), qd.cpu(), kd.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )


def _oracle_and_reference(qp, kp, cu, cfg, qz):
    from flash_msa.triton_ref import selection_fp8

    return (
        selection_fp8.select_quantized(qz, cu, cfg),
        reference.select(qp, kp, cu, cfg, quantized=qz),
    )


CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, dtype, key scale
    ((8192,), 4, 1, 128, 128, 16, torch.bfloat16, "block"),  # anchor / paper proxy heads
    ((3000, 1, 700, 129), 2, 1, 64, 64, 8, torch.bfloat16, "block"),  # varlen, Dp 64, block 64
    ((1500,), 4, 2, 128, 128, 1, torch.float16, "block"),  # top_k 1, Hpk 2, fp16 inputs
    ((9000, 300), 4, 1, 128, 128, 64, torch.bfloat16, "block"),  # top_k 64: the longest list
    ((5000, 77), 4, 1, 128, 64, 64, torch.float16, "block"),  # two blocks per tile, top_k 64
    ((2000, 4000), 8, 2, 64, 128, 16, torch.float16, "block"),
    ((8192,), 4, 1, 128, 64, 16, torch.bfloat16, "block"),  # 64 tiles of two ring slabs
    ((4100,), 4, 4, 128, 64, 16, torch.bfloat16, "token"),  # per-token key scales
    ((6000, 1, 333), 4, 1, 128, 128, 64, torch.float16, "token"),
    ((2500,), 2, 1, 64, 64, 1, torch.bfloat16, "token"),
]


def _case_id(c):
    return "x".join(map(str, c[0])) + f"-Dp{c[3]}-b{c[4]}-k{c[5]}-{str(c[6])[6:]}-{c[7]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("kind", ["random", "local", "gain"])
def test_cute_fp8_select_matches_oracle_and_reference(case, kind):
    """The kernel's indices against the Triton oracle and the torch reference on the same
    quantized operands: equal up to near-ties, in the index format, every slot written."""
    *shape, key_scale = case
    qp, kp, cu, cfg, qz = _case(*shape, kind=kind, key_scale=key_scale)
    idx = _cute_fp8(qz, cu, cfg)
    _check_format(idx, cu, cfg.block_size)
    for other in _oracle_and_reference(qp, kp, cu, cfg, qz):
        assert _mismatch(idx, other, qz, cu, cfg) == 0


@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
def test_cute_fp8_select_applies_the_key_scales(key_scale):
    """On ``gain`` inputs the key scales decide the ranking: the kernel given unit scales
    selects otherwise (so the comparison above can fail) and then agrees with the reference
    given the same unit scales."""
    qp, kp, cu, cfg, qz = _case((3000, 1200), 4, 1, 128, 64, 8, torch.bfloat16, 3, "gain",
                                key_scale)  # fmt: skip
    unit = qz._replace(k_scale=torch.ones_like(qz.k_scale))
    scaled, unscaled = _cute_fp8(qz, cu, cfg), _cute_fp8(unit, cu, cfg)
    assert not torch.equal(scaled, unscaled)
    for idx, ops in ((scaled, qz), (unscaled, unit)):
        want = reference.select(qp, kp, cu, cfg, quantized=ops)
        assert _mismatch(idx, want, ops, cu, cfg) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cute_fp8_select_op_quantizes_then_selects(dtype, monkeypatch):
    """``selection.select`` with ``selection_precision="fp8"`` (the backend op's body): the
    quantize pass with the shipped choices (block scale, rotation) and the kernel, against the
    reference's fp8 selection of the same inputs (which quantizes them the same way); the
    backend entry runs it."""
    from flash_msa import cute

    _select_sm90()
    from flash_msa.cute import selection
    qp, kp, cu, cfg, qz = _case((7000, 900), 4, 1, 128, 128, 16, dtype, 5, "local")
    got = selection.select(qp, kp, cu, cfg)
    _check_format(got, cu, cfg.block_size)
    assert _mismatch(got, reference.select(qp, kp, cu, cfg), qz, cu, cfg) == 0
    assert torch.equal(got, _cute_fp8(qz, cu, cfg))  # quant.quantize: the same operands
    exact = selection.select(qp, kp, cu, dataclasses.replace(cfg, selection_precision="bf16"))
    assert not torch.equal(got, exact)  # the precision reached the kernel
    assert torch.equal(cute.select(qp, kp, cu, cfg), got)


def test_cute_fp8_select_keeps_ties_in_block_order():
    """Key blocks with identical content quantize identically (the same block scale): every
    score ties and the lower blocks win, as in the reference (equal indices, no near-tie
    allowance); also across list evictions at top_k 24, and a whole 64-entry list."""
    g = torch.Generator().manual_seed(1)
    S, Dp = 128 * 40, 128
    kp = torch.randn(128, 1, Dp, generator=g).repeat(40, 1, 1).to("cuda", torch.bfloat16)
    qp = torch.randn(S, 2, Dp, generator=g).to("cuda", torch.bfloat16)
    cu = testing.cu([S], "cuda")
    qz = quant.quantize(qp, kp, cu, 128)
    for top_k in (5, 24, 64):
        cfg = dataclasses.replace(config(S, 16, Dp, 128, top_k), selection_precision="fp8")
        got = _cute_fp8(qz, cu, cfg)
        assert torch.equal(got, reference.select(qp, kp, cu, cfg, quantized=qz)), top_k


@pytest.mark.parametrize("stages", [2, 4, 12])
def test_cute_fp8_select_pipeline_depth_does_not_change_the_result(stages):
    """``SelectSm90(stages=...)`` (default ``select_sm90.FP8_STAGES``): the same scores in the
    same order, so the same indices."""
    _, _, cu, cfg, qz = _case((3000, 1, 2100), 4, 1, 128, 64, 24, torch.bfloat16, 2)
    assert torch.equal(_cute_fp8(qz, cu, cfg, stages=stages), _cute_fp8(qz, cu, cfg))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_cute_fp8_select_hypothesis_runtime_sizes(data):
    """Run-time sizes (lengths, number of sequences) and a few static ones (top_k, block, key
    scale) against the Triton oracle on the same quantized operands."""
    b = data.draw(st.sampled_from([64, 128]), label="block")
    lengths = data.draw(st.lists(st.integers(0, 900), min_size=1, max_size=5), label="lengths")
    assume(max(lengths) > 0)  # (an empty sequence among others: the kernel must skip it)
    top_k = data.draw(st.sampled_from([1, 3, 16, 33, 64]), label="top_k")
    key_scale = data.draw(st.sampled_from(quant.KEY_SCALES), label="key_scale")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    qp, kp, cu, cfg, qz = _case(lengths, 4, 1, 64, b, top_k, torch.bfloat16, seed,
                                key_scale=key_scale)  # fmt: skip
    idx = _cute_fp8(qz, cu, cfg)
    _check_format(idx, cu, b)
    oracle, _ = _oracle_and_reference(qp, kp, cu, cfg, qz)
    assert _mismatch(idx, oracle, qz, cu, cfg) == 0


def test_cute_fp8_select_is_sync_free():
    """The op (quantize pass and kernel) makes no host synchronization, and repeats itself."""
    _select_sm90()
    from flash_msa.cute.selection import select

    qp, kp, cu, cfg, _ = _case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    first = select(qp, kp, cu, cfg)  # compiles
    with no_host_sync():
        again = select(qp, kp, cu, cfg)
    assert torch.equal(first, again)


def test_cute_fp8_select_is_graph_capturable():
    """The op captured in a CUDA graph and replayed on new inputs equals an eager call."""
    _select_sm90()
    from flash_msa.cute.selection import select

    qp, kp, cu, cfg, _ = _case((3000, 700), 4, 1, 128, 128, 16, torch.bfloat16)
    select(qp, kp, cu, cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select(qp, kp, cu, cfg)
    qp.copy_(torch.randn_like(qp))
    graph.replay()
    assert torch.equal(captured, select(qp, kp, cu, cfg))


# ---------------------------------------------------------------------------------------------
# the quantize pass as a CuTe kernel (cute/quantize_sm90.py): bitwise the torch pass
# ---------------------------------------------------------------------------------------------
def _quantize_sm90():
    pytest.importorskip("cutlass")
    from flash_msa.cute import quantize_sm90

    return quantize_sm90


QUANT_CASES = [  # lengths (empty and short sequences among them), Hp, Hpk, Dp, block, dtype
    ((8192,), 4, 1, 128, 128, torch.bfloat16),  # anchor / paper proxy heads
    ((3000, 0, 1, 700, 129), 2, 1, 64, 64, torch.bfloat16),
    ((1500, 63, 65), 4, 2, 128, 64, torch.float16),
    ((0, 2000, 4000, 1), 8, 2, 64, 128, torch.float16),
]


def _poisoned_like(qz):
    return tuple(testing.poisoned(x.shape, x.dtype, "cuda") for x in qz[:4])


def _assert_bitwise(got, want):
    """Equal e4m3 bytes and fp32 scales (as bits), NaN at the same places."""
    for name in ("q", "q_scale", "k", "k_scale"):
        a, b = getattr(got, name), getattr(want, name)
        bits = torch.uint8 if a.dtype == quant.E4M3 else torch.int32
        a_nan, b_nan = a.float().isnan(), b.float().isnan()
        assert torch.equal(a_nan, b_nan), name
        assert torch.equal(a.view(bits)[~a_nan], b.view(bits)[~b_nan]), name
    assert (got.key_scale, got.rotated) == (want.key_scale, want.rotated)


def _qcase_id(c):
    return "x".join(map(str, c[0])) + f"-Hp{c[1]}-Hpk{c[2]}-Dp{c[3]}-b{c[4]}-{str(c[5])[6:]}"


@pytest.mark.parametrize("case", QUANT_CASES, ids=_qcase_id)
@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
def test_cute_quantize_is_bitwise_the_torch_pass(case, key_scale):
    """``quantize_sm90.quantize`` against ``quant.quantize`` on the same GPU inputs (``gain``:
    key blocks of different magnitudes, so that the block scales differ): the same e4m3 bytes
    and fp32 scales, every output element written (the buffers start NaN-poisoned); with
    the rotation, and without it on the first two cases."""
    lengths, Hp, Hpk, Dp, b, dtype = case
    qs = _quantize_sm90()
    qp, kp, cu, _, _ = _case(lengths, Hp, Hpk, Dp, b, 16, dtype, 7, "gain", key_scale)
    for rotate in (True, False) if case in QUANT_CASES[:2] else (True,):
        want = quant.quantize(qp, kp, cu, b, key_scale=key_scale, rotate=rotate)
        out = _poisoned_like(want)
        got = qs.quantize(qp, kp, cu, b, key_scale, rotate, max_seqlen=max(lengths), out=out)
        assert all(x is y for x, y in zip(got, out))
        _assert_bitwise(got, want)
        # a loose max_seqlen (more CTAs, the extra ones do nothing) and the default (read from
        # cu_seqlens) give the same
        _assert_bitwise(qs.quantize(qp, kp, cu, b, key_scale, rotate, max_seqlen=9000), want)
        _assert_bitwise(qs.quantize(qp, kp, cu, b, key_scale, rotate), want)


@pytest.mark.parametrize("key_scale", quant.KEY_SCALES)
@pytest.mark.parametrize("Dp", [64, 128])
def test_cute_quantize_edge_values(key_scale, Dp):
    """Rows the scale rule treats specially, bitwise as the torch pass: all zeros (scale 1),
    -0.0, an amax below ``448 * fp32 tiny`` (scale 1), subnormal and huge elements, outlier
    channels, and (query rows; key rows with per-token scales) inf and NaN (the torch pass's
    amax is NaN: scale 1, NaN values). Also without the rotation (``-0.0`` and subnormals
    reach the division unrotated)."""
    qs = _quantize_sm90()
    T, Hp, Hpk, b = 512, 4, 1, 64
    cu = testing.cu([T - 100, 100], "cuda")
    for dtype in (torch.bfloat16, torch.float16):
        fi = torch.finfo(dtype)
        g = torch.Generator().manual_seed(Dp)
        spread = torch.randint(-6, 7, (T, 1, 1), generator=g)  # key rows of many magnitudes
        qp = torch.randn(T, Hp, Dp, generator=g)
        fp16 = dtype == torch.float16
        kp = torch.randn(T, Hpk, Dp, generator=g) * 2.0 ** (spread * (1 if fp16 else 3))
        for x in (qp, kp):
            x[0] = 0.0
            x[1] = -0.0
            x[2] = 1e-37  # amax below quant's threshold (bf16; 0 in fp16)
            x[3, :, ::3] = fi.tiny / 4  # the dtype's subnormals beside normal elements
            x[4] *= fi.max / (16 if fp16 else 1024)  # huge (the rotated sums stay finite)
            x[5, :, :4] *= 1000.0  # outlier channels
            x[64:128] = 0.0  # a whole key block of zeros
        for x in (qp,) if key_scale == "block" else (qp, kp):
            x[6, 0, 5] = float("inf")
            x[7, 0, 9] = float("nan")
        q, k = (x.to(dtype).cuda() for x in (qp, kp))
        for rotate in (True, False):
            want = quant.quantize(q, k, cu, b, key_scale=key_scale, rotate=rotate)
            got = qs.quantize(q, k, cu, b, key_scale, rotate, out=_poisoned_like(want))
            _assert_bitwise(got, want)


def test_cute_fp8_select_op_with_the_cute_quantize_pass(monkeypatch):
    """``selection.select`` (fp8) with the CuTe quantize pass (where it fits) against the torch
    pass (its named fallback, taken where ``quantize_sm90.can_implement`` refuses; forced here
    by patching it): the same indices (the operands are the same bits), no host
    synchronization, and a CUDA graph capture replays it on new inputs."""
    _select_sm90()
    from flash_msa.cute import selection

    qs = _quantize_sm90()
    qp, kp, cu, cfg, _ = _case((7000, 900), 4, 1, 128, 128, 16, torch.bfloat16, 5, "local")

    def torch_pass():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qs, "can_implement", lambda *a: "forced: the torch pass")
            return selection.select(qp, kp, cu, cfg)

    before = torch_pass()
    calls = []
    real = qs.quantize
    monkeypatch.setattr(qs, "quantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = selection.select(qp, kp, cu, cfg)
    assert calls and torch.equal(got, before)
    with no_host_sync():
        again = selection.select(qp, kp, cu, cfg)
    assert torch.equal(again, got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = selection.select(qp, kp, cu, cfg)
    qp.copy_(torch.randn_like(qp))
    graph.replay()
    assert torch.equal(captured, torch_pass())