"""``selection_precision="fp8_rerank"``: the fp8 top ``top_k + RERANK_EXTRA`` re-ranked exactly.

CPU: the torch backend and the Triton re-rank kernel under the interpreter (fp32/fp16 there:
the interpreter computes bf16 wrongly). What is held: the mode equals the recall protocol's
``recall.refine`` of the fp8 top ``top_k + m`` (batch and varlen, blocks 64 and 128, a
sequence shorter than one block, ``top_k`` above the block count), the Triton kernel's scores
(tensor cores over the work list of the candidates) equal the torch re-rank's bit for bit on
inputs whose fp32 sums are exact in any order and meet the rule on random ones, the
selection's rules, the dispatch of the two steps, and the argument checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flash_msa
from flash_msa import backends, quant, recall, reference, testing
from flash_msa.problem import Config, problem_of
from flash_msa.triton_ref import reranking as triton_rerank
from flash_msa.triton_ref.tiles import Tables


def _cfg(block_size, top_k, max_seqlen, Dp, precision="fp8_rerank"):
    return Config(
        block_size=block_size,
        softmax_scale=1.0,
        max_seqlen=max_seqlen,
        proxy_scale=Dp**-0.5,
        top_k=top_k,
        selection_precision=precision,
    )


def _proxies(lengths, Hp, Hpk, Dp, kind, seed, dtype=torch.float32):
    """Packed ``(q_proxy, k_proxy)`` of sequences of ``lengths`` (one make_inputs call each)."""
    qs, ks = [], []
    for n, L in enumerate(lengths):
        qp, kp = testing.make_inputs(
            1, L, Hp, Hpk, Hp, Hpk, 16, Dp, kind=kind, seed=seed + n, dtype=dtype
        )[:2]
        qs.append(qp[0])
        ks.append(kp[0])
    return torch.cat(qs), torch.cat(ks)


def _protocol(qp, kp, cu, cfg):
    """``recall.refine`` of the torch fp8 top ``candidate_top_k``, sequence by sequence."""
    cand = reference.select(qp, kp, cu, quant.candidates_config(cfg))
    out = torch.full((qp.shape[0], qp.shape[1], cfg.top_k), -1, dtype=torch.int32)
    bounds = cu.tolist()
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        scores = recall.block_scores(qp[s0:s1], kp[s0:s1], cfg)
        out[s0:s1] = recall.refine(cand[s0:s1], scores, cfg.top_k, cfg.block_size)
    return out


# (lengths, block, top_k): batch-like, varlen with a sequence shorter than one block, top_k
# above every sequence's block count
CASES = [
    ((384,), 64, 3),
    ((200, 37, 330), 64, 4),
    ((300, 50), 128, 1),
    ((200, 130), 64, 16),
]


@pytest.mark.parametrize("kind", ["random", "local"])
@pytest.mark.parametrize("lengths,block,top_k", CASES)
def test_torch_mode_equals_protocol(kind, lengths, block, top_k):
    """The torch backend's fp8_rerank selection is ``recall.refine`` of its fp8 candidates."""
    Dp = 32
    qp, kp = _proxies(lengths, 4, 2, Dp, kind, seed=len(lengths) + block)
    cu = testing.cu(list(lengths))
    cfg = _cfg(block, top_k, max(lengths), Dp)
    got = reference.select(qp, kp, cu, cfg)
    assert got.shape == (qp.shape[0], 4, top_k) and got.dtype == torch.int32
    assert torch.equal(got, _protocol(qp, kp, cu, cfg))
    # every kept block is a candidate and the own block is kept
    own = (torch.arange(qp.shape[0]) - torch.repeat_interleave(cu[:-1], cu.diff())) // block
    assert (got == own[:, None, None]).any(-1).all()


interpreted = pytest.mark.skipif(
    not backends.interpreting(), reason="the Triton re-rank on CPU needs TRITON_INTERPRET=1"
)


@interpreted
@pytest.mark.parametrize("batch", [True, False])
def test_api_equals_protocol(batch, monkeypatch):
    """``select_blocks(..., selection_precision="fp8_rerank")`` equals the protocol: varlen under
    ``auto`` on CPU (fp8 candidates on torch, the re-rank on Triton's interpreter, fp16), the
    batch form on the forced torch backend (the interpreter is slow)."""
    Dp, block, top_k = 32, 64, 2
    lengths = (200, 200) if batch else (20, 330)
    qp, kp = _proxies(lengths, 1, 1, Dp, "local", seed=7, dtype=torch.float16)
    cu = testing.cu(list(lengths))
    cfg = _cfg(block, top_k, max(lengths), Dp)
    if batch:
        monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
        got = flash_msa.select_blocks(
            qp.view(2, 200, 1, Dp), kp.view(2, 200, 1, Dp), top_k, block_size=block,
            selection_precision="fp8_rerank",
        ).view(-1, 1, top_k)  # fmt: skip
    else:
        problem = problem_of("cpu", torch.float16, (0, 0, 0, 1, 1, Dp), 2, True, cfg)
        assert backends.resolve("select", problem)[0] == "torch+triton"
        got = flash_msa.select_blocks(
            qp, kp, top_k, block_size=block, cu_seqlens=cu, max_seqlen=max(lengths),
            selection_precision="fp8_rerank",
        )  # fmt: skip
    assert torch.equal(got, _protocol(qp, kp, cu, cfg))


def _exact_inputs(T, Hp, Hpk, Dp, seed):
    """fp32 proxies of multiples of 1/8 in [-1, 1]: every product is a multiple of 1/64 and
    every partial sum of Dp of them is exact in fp32, so any summation order gives the same
    score (proxy_scale a power of two keeps the product exact)."""
    g = torch.Generator().manual_seed(seed)
    qp = torch.randint(-8, 9, (T, Hp, Dp), generator=g).float() / 8
    kp = torch.randint(-8, 9, (T, Hpk, Dp), generator=g).float() / 8
    return qp, kp


@interpreted
@pytest.mark.parametrize(
    "block,chunked,dtype",
    [
        (64, False, torch.float32),
        (128, False, torch.float32),
        (128, False, torch.float16),
        (64, True, torch.float16),
    ],
    ids=["b64-fp32", "b128-fp32", "b128-fp16", "b64-fp16-chunked"],
)
def test_triton_scores_equal_torch(block, chunked, dtype, monkeypatch):
    """The Triton kernel's candidate scores equal the torch re-rank's exactly (inputs whose
    fp32 sums are exact in any order; fp16 holds them exactly too), and so do the re-ranked
    indices: ``-1`` slots, blocks past the row's causal limit and past its sequence's end,
    repeated blocks, a list longer than a work item (block 0 of the 300-token sequence is a
    candidate of all its rows: 300 entries per head, two items, ``BT``-row chunks), ``G = 2``
    proxy heads per key head, ``K = top_k + 8``; ``chunked``: the rows in 4 launches; with a
    query map too (rows in another order, a padding row: every score -inf)."""
    lengths, Hp, Hpk, Dp, K, top_k = (40, 9, 300), 4, 2, 32, 10, 2
    T = sum(lengths)
    if chunked:  # about 100 rows per launch
        monkeypatch.setattr(triton_rerank, "ENTRY_BYTES", 100 * 8 * Hp * K)
        assert triton_rerank.chunk_rows(Hp, K) == 100
    qp, kp = (x.to(dtype) for x in _exact_inputs(T, Hp, Hpk, Dp, seed=block))
    cu = testing.cu(list(lengths))
    cfg = dataclasses.replace(_cfg(block, top_k, max(lengths), Dp), proxy_scale=0.25)
    g = torch.Generator().manual_seed(1)
    cand = torch.randint(-1, 7, (T, Hp, K), generator=g, dtype=torch.int32)
    cand[:, :, 0] = 0
    want = reference.rerank_scores(qp, kp, cu, cand, cfg)
    got = triton_rerank.scores(qp, kp, cu, cand, cfg)
    assert torch.isinf(want).any() and torch.isfinite(want).sum() > T * Hp
    assert torch.equal(got, want)
    want_idx = reference.rerank(qp, kp, cu, cand, cfg)
    assert torch.equal(triton_rerank.rerank(qp, kp, cu, cand, cfg), want_idx)
    # a query map: rows in another order, one padding row
    q_map = torch.tensor([5, 60, -1, T - 1, 0, 200], dtype=torch.int32)
    rows = qp[q_map.long().clamp_min(0)]
    want = reference.rerank_scores(rows, kp, cu, cand[:6], cfg, q_map=q_map)
    got = triton_rerank.scores(rows, kp, cu, cand[:6], cfg, q_map=q_map)
    assert torch.equal(got, want) and torch.isneginf(got[2]).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_scores_rule(dtype):
    """On random inputs, with the torch fp8 selection's candidates (``top_k + 4``): the
    kernel's scores against the exact (fp64) ones by the rule ``err <= 2 * err(torch re-rank in
    the same dtype) + atol``, the same ``-inf`` slots."""
    lengths, Hp, Hpk, Dp, block, top_k = (300, 77), 4, 1, 64, 64, 2
    qp, kp = _proxies(lengths, Hp, Hpk, Dp, "random", seed=11, dtype=dtype)
    cu = testing.cu(list(lengths))
    cfg = _cfg(block, top_k, max(lengths), Dp)
    cand = reference.select(qp, kp, cu, quant.candidates_config(cfg))
    assert cand.shape[-1] == 5  # 300 tokens: 5 blocks of 64
    exact = reference.rerank_scores(qp.double(), kp.double(), cu, cand, cfg)
    same = reference.rerank_scores(qp, kp, cu, cand, cfg)
    got = triton_rerank.scores(qp, kp, cu, cand, cfg)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(got)) and finite.any() and not finite.all()
    testing.assert_close("scores", got[finite], exact[finite], same[finite], dtype=torch.float32)


def test_refine_rules():
    """Own block first, ties to the lower block, -inf (and -1 slots) never kept, padded to
    top_k with -1, output ascending."""
    inf = float("inf")
    cand = torch.tensor([[[0, 2, 3, 5, -1]], [[1, 4, 6, 7, 9]]], dtype=torch.int32)
    scores = torch.tensor([[[1.0, 2.0, 2.0, -inf, 9.0]], [[0.5, 0.5, 3.0, 0.5, -1.0]]])
    own = torch.tensor([0, 9])
    got = quant.refine(cand, scores, 3, own)
    # row 0: own 0, then the tie 2/3 (2.0) -> 2 and 3; row 1: own 9, then 6, then the tie at
    # 0.5 among 1, 4, 7 -> 1
    assert got.tolist() == [[[0, 2, 3]], [[1, 6, 9]]]
    got = quant.refine(cand, scores, 6, own)  # wider than the candidates: -inf, -1 dropped
    assert got.tolist() == [[[0, 2, 3, -1, -1, -1]], [[1, 4, 6, 7, 9, -1]]]
    assert quant.refine(cand, scores, 2, torch.tensor([-1, 9]))[0].tolist() == [[2, 3]]


def test_candidate_count():
    """top_k + RERANK_EXTRA, capped by the longest sequence's blocks, never below top_k."""
    assert quant.RERANK_EXTRA == 16  # the shipped m (quant.py: the H200 sweep at paper 128K)
    assert quant.candidate_top_k(16, 4096, 128) == 32
    assert quant.candidate_top_k(16, 40 * 128, 128) == 32
    assert quant.candidate_top_k(16, 17 * 128, 128) == 17
    assert quant.candidate_top_k(16, 100, 128) == 16


@interpreted
def test_dispatch_and_forced_backends(monkeypatch):
    """Two steps, each by the usual rules: forced torch runs both, forced triton raises (no
    fp8 selection there), and the fused op runs on the re-ranked indices."""
    Dp, block = 16, 64
    qp, kp, q, k, v = testing.make_inputs(1, 150, 1, 1, 1, 1, 16, Dp, dtype=torch.float32)
    cfg = _cfg(block, 2, 150, Dp)
    problem = problem_of("cpu", torch.float32, (1, 1, 16, 1, 1, Dp), 1, False, cfg)
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    assert backends.resolve("select", problem)[0] == "torch+torch"
    idx = flash_msa.select_blocks(qp, kp, 2, block_size=block, selection_precision="fp8_rerank")
    out, _ = flash_msa.msa_attention(
        qp, kp, q, k, v, 2, block_size=block, selection_precision="fp8_rerank"
    )
    assert torch.equal(out, flash_msa.sparse_attention(q, k, v, idx, block_size=block))
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    with pytest.raises(backends.BackendError, match="fp8"):
        backends.resolve("select", problem)
    # the custom op (torch.compile's path) resolves the same two steps
    monkeypatch.setenv("FLASH_MSA_BACKEND", "auto")
    packed = (qp[0], kp[0], testing.cu([150]))
    args = (150, block, 1.0, Dp**-0.5, 2, False, False, False, [0, 0, 0, 1, 1, Dp], "auto")
    got = torch.ops.flash_msa.select(*packed, *args, selection_precision="fp8_rerank")
    assert torch.equal(got, idx[0])


@pytest.mark.parametrize("bad,error", [("fp8rerank", ValueError), ("FP8_RERANK", ValueError)])
def test_bad_precision_raises(bad, error):
    qp, kp, q, k, v = testing.make_inputs(1, 64, 2, 1, 2, 1, 16, 16, dtype=torch.float32)
    with pytest.raises(error, match="selection_precision.*fp8_rerank"):
        flash_msa.select_blocks(qp, kp, 2, block_size=64, selection_precision=bad)
    with pytest.raises(error, match="selection_precision"):
        flash_msa.msa_attention(qp, kp, q, k, v, 2, block_size=64, selection_precision=bad)
    with pytest.raises(TypeError, match="selection_precision"):
        flash_msa.select_blocks(qp, kp, 2, block_size=64, selection_precision=8)


def test_recall_not_below_plain_fp8():
    """On a structured (``local``) case the shipped mode recalls the bf16 selection at least
    as well as the plain fp8 top-k, and meets the 99 % recall gate there."""
    res = recall.measure(
        "local",
        1024,
        (4, 2, 2, 1),
        64,
        top_k=8,
        block_size=64,
        variants=(),
        refine_extra=(),
        with_downstream=False,
    )
    plain = res[quant.KEY_SCALE + ("+rot" if quant.ROTATE else "")]
    assert res["fp8_rerank"]["recall"] >= plain["recall"], (res["fp8_rerank"], plain)
    assert res["fp8_rerank"]["recall"] >= 0.99, res["fp8_rerank"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["random", "local"])
def test_gpu_auto_rerank(kind):
    """On a GPU under ``auto``: the two steps' backends (``cute+triton`` on SM90), the Triton
    scores (every tile of ``RERANK_TILES``, and with a query map) against the exact fp64 ones
    by the rule (``err <= 2 * err(torch re-rank in bf16) + atol``), and the mode's indices
    against the torch re-rank of the same fp8 candidates (near-ties only)."""
    Dp, block, top_k, lengths = 128, 128, 16, (4096, 1000, 3000)
    qp, kp = (x.cuda().bfloat16() for x in _proxies(lengths, 4, 1, Dp, kind, seed=3))
    cu = testing.cu(list(lengths), "cuda")
    cfg = _cfg(block, top_k, max(lengths), Dp)
    problem = problem_of(qp.device, qp.dtype, (0, 0, 0, 4, 1, Dp), 3, True, cfg)
    name, sel = backends.resolve("select", problem)
    if torch.cuda.get_device_capability() == (9, 0):
        assert name == "cute+triton", name
    cand = sel.fp8.select(qp, kp, cu, quant.candidates_config(cfg))
    exact = reference.rerank_scores(qp.double(), kp.double(), cu, cand, cfg)
    same = reference.rerank_scores(qp, kp, cu, cand, cfg)
    finite = torch.isfinite(exact)
    for tile in triton_rerank.RERANK_TILES:
        got = triton_rerank.scores(qp, kp, cu, cand, cfg, tables=Tables(rerank=(tile,)))
        assert torch.equal(finite, torch.isfinite(got)), tile
        testing.assert_close(f"scores {tile}", got[finite], exact[finite], same[finite])
    # a query map: every 7th row, reversed, one padding row
    q_map = torch.cat([torch.arange(qp.shape[0] - 1, -1, -7), torch.tensor([-1])])
    q_map = q_map.to(torch.int32).cuda()
    rows, c = qp[q_map.long().clamp_min(0)], cand[q_map.long().clamp_min(0)]
    got = triton_rerank.scores(rows, kp, cu, c, cfg, q_map=q_map)
    want = reference.rerank_scores(rows.double(), kp.double(), cu, c, cfg, q_map=q_map)
    same = reference.rerank_scores(rows, kp, cu, c, cfg, q_map=q_map)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and torch.isneginf(got[-1]).all()
    testing.assert_close("scores q_map", got[fin], want[fin], same[fin])
    idx = flash_msa.select_blocks(
        qp, kp, top_k, block_size=block, cu_seqlens=cu, max_seqlen=max(lengths),
        selection_precision="fp8_rerank",
    )  # fmt: skip
    ref = reference.rerank(qp, kp, cu, cand, cfg)
    rows = (idx != ref).any(-1).float().mean().item()
    assert rows <= 1e-3, f"{rows:.2e} of the (row, head) pairs differ (near-ties only)"
