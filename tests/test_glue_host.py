"""CPU tests of the training step's glue cuts (docs/reviews/2026-12-01-step-glue.md).

- The work list is built in fewer torch ops (each one a CUDA launch and ~5-10 us of host time
  in an eager step: the anchor 16K forward waits for them between the selection and the
  partials) with the same values: key blocks against plain Python over many batches, the op
  counts pinned (tests/test_worklist.py checks the whole list bit for bit).
- The sparse-forward driver sums the KL without a zero fill, and fills nothing without the KL.
- The CuTe backend's remembered reasons and stage picks (``cute.memo``) are the ones a fresh
  call makes, switch and stage-function changes included, and a repeated call recomputes
  nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_msa import backends, sparse_forward, worklist
from flash_msa.problem import Config, Problem
from harness import config

# aten ops that make no data (views, allocations): no launch on a GPU
_NO_LAUNCH = {
    "view", "_unsafe_view", "slice", "select", "as_strided", "unsqueeze", "detach", "empty",
    "empty_like", "empty_strided", "expand", "alias", "t", "permute", "reshape", "flatten",
    "squeeze", "unbind", "lift_fresh",
}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Records the aten ops that make data (``ops``: their names, in order)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_LAUNCH:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _ops(fn, *args):
    """``(fn(*args), the data-making aten ops it ran)``."""
    with _Ops() as rec:
        out = fn(*args)
    return out, rec.ops


def _blocks_by_python(lengths, block):
    """``(start, end, seq_first)`` of :func:`flash_msa.worklist.blocks` by plain Python."""
    N, T = len(lengths), sum(lengths)
    NB = T // block + N
    starts, ends, first, s0 = [], [], [], 0
    for n in lengths:
        first.append(len(starts))
        for b in range(0, n, block):
            starts.append(s0 + b)
            ends.append(min(s0 + n, s0 + b + block))
        s0 += n
    pad = NB - len(starts)
    return starts + [0] * pad, ends + [0] * pad, first


def test_key_blocks_equal_plain_python():
    """``worklist.blocks`` (17 ops, int32 arithmetic) gives the Python ranges for batches with
    empty sequences, lengths at and around block multiples and one-token sequences; both rows
    16-byte aligned and contiguous (the kernels read them by pointer)."""
    g = torch.Generator().manual_seed(0)
    cases = [(1,), (64,), (65,), (0, 0, 5), (128, 0, 127, 129, 1), (0,)]
    cases += [tuple(torch.randint(0, 300, (n,), generator=g).tolist()) for n in (1, 2, 7, 33)]
    for lengths in cases:  # (0,): a batch of one empty sequence, every block [0, 0)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        for block in (64, 128):
            kb = worklist.blocks(cu, block, sum(lengths))
            starts, ends, first = _blocks_by_python(lengths, block)
            assert kb.start.tolist() == starts, (lengths, block)
            assert kb.end.tolist() == ends, (lengths, block)
            assert kb.seq_first.tolist() == first and kb.num_blocks == len(starts)
            for x in (kb.start, kb.end, kb.seq_first):
                assert x.dtype == torch.int32 and x.is_contiguous()
            assert kb.start.data_ptr() % 16 == 0 and kb.end.data_ptr() % 16 == 0


def test_work_list_build_op_counts():
    """The build's torch ops (CUDA launches; ``cumsum`` and ``sort`` launch more than one):
    blocks 17 (27 before), lists 11 (12), items 14 (16): the anchor step's forward builds all
    three, its backward cuts items again."""
    lengths, Hs, K, block = (200, 0, 333), 2, 4, 64
    g = torch.Generator().manual_seed(1)
    T = sum(lengths)
    cu = torch.tensor([0, 200, 200, 533], dtype=torch.int32)
    idx = torch.where(
        torch.rand(T, Hs, K, generator=g) < 0.3, -1, torch.randint(0, 2, (T, Hs, K), generator=g)
    ).int()
    kb, blocks_ops = _ops(worklist.blocks, cu, block, T)
    sl, lists_ops = _ops(worklist.lists, idx, cu, block, 0, T, None, kb)
    _, items_ops = _ops(worklist.items, sl, 128)
    assert len(blocks_ops) <= 17, blocks_ops
    assert len(lists_ops) <= 11, lists_ops
    assert len(items_ops) <= 14, items_ops
    assert "where" not in lists_ops + blocks_ops  # (a Python-scalar where fills a device scalar)


# ---------------------------------------------------------------------------------------------
# the sparse-forward driver's KL sum
# ---------------------------------------------------------------------------------------------
def _driver(monkeypatch, compute_kl, parts, chunk_rows=None, sorts=None):
    """The driver on stub stages (no tensor ops of their own; the KL stage returns ``parts``
    in turn): its result and the aten ops it ran besides the work list's (the per-chunk
    sorts' build; ``sorts=1``: not subtracted, the one sort's ops are another set)."""
    lengths, H, Hkv, Hs, D, block, K = (100, 60), 4, 2, 2, 16, 64, 2
    T = sum(lengths)
    if chunk_rows is not None:
        monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", chunk_rows * H * K * D * 4)
    q, k, v = (torch.zeros(T, h, D) for h in (H, Hkv, Hkv))
    qp, kp = torch.zeros(T, Hs, D), torch.zeros(T, 1, D)
    cu = torch.tensor([0, 100, 160], dtype=torch.int32)
    idx = torch.zeros(T, Hs, K, dtype=torch.int32)
    kl_parts = iter(parts)
    stages = sparse_forward.Stages(
        partials=lambda *a: None,
        partials_make_proxy=True,
        combine=lambda *a: None,
        combine_makes_proxy=True,
        kl=lambda *a: next(kl_parts),
    )
    cfg = dataclasses.replace(config(100, D, D, block, K), compute_kl=compute_kl)
    f, ops = _ops(lambda: sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp))
    C = T if chunk_rows is None else chunk_rows
    kb, build = _ops(worklist.blocks, cu, block, T)
    for c0 in range(0, T, C):
        sl, lists_ops = _ops(worklist.lists, idx[c0 : c0 + C], cu, block, c0, T, None, kb)
        build += lists_ops + _ops(worklist.items, sl, worklist.ITEM_TOKENS)[1]
    rest = list(ops)
    if sorts == 1:
        return f, rest
    for op in build:
        rest.remove(op)
    return f, rest


def test_driver_kl_sum_without_zero_fill(monkeypatch):
    """Without the KL the driver fills nothing (the anchor no-KL step: one launch less); with
    it the chunks' sums add up as before (first chunk's sum itself, then added), over ``Hs *
    T`` rows."""
    f, ops = _driver(monkeypatch, False, [])
    assert f.kl is None
    assert ops == [], ops
    parts = [torch.tensor(0.25), torch.tensor(1.5), torch.tensor(-0.125)]
    # the per-chunk sorts (one_sort's fallback, forced): a KL call per chunk
    monkeypatch.setattr(sparse_forward, "ONE_SORT_BYTES", 0)
    f, _ = _driver(monkeypatch, True, parts, chunk_rows=64)  # 3 chunks of 64, 64, 32 rows
    expect = (torch.zeros(()) + parts[0] + parts[1] + parts[2]) / (2 * 160)
    assert torch.equal(f.kl, expect) and f.kl.dtype == torch.float32
    monkeypatch.undo()
    # the one sort (the default for a chunked call): one KL call over the whole lists
    f, _ = _driver(monkeypatch, True, parts, chunk_rows=64, sorts=1)
    assert torch.equal(f.kl, parts[0] / (2 * 160))  # (three calls would have added the rest)
    f, _ = _driver(monkeypatch, True, parts[1:2], chunk_rows=160)  # one chunk
    assert torch.equal(f.kl, parts[1] / (2 * 160))


# ---------------------------------------------------------------------------------------------
# the CuTe backend's remembered reasons and stage picks
# ---------------------------------------------------------------------------------------------
def _hopper(**kw) -> Problem:
    """The anchor 16K problem on sm_90 (``kw`` replaces fields of it and of its Config)."""
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(Config)}}
    cfg = Config(
        block_size=128, softmax_scale=128**-0.5, max_seqlen=16384, proxy_scale=128**-0.5,
        top_k=16, compute_kl=False,
    )  # fmt: skip
    prob = Problem(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, num_heads=16,
        num_kv_heads=2, head_dim=128, num_sel_heads=4, num_proxy_k_heads=1, proxy_head_dim=128,
        varlen=False, cfg=dataclasses.replace(cfg, **cfg_kw),
    )  # fmt: skip
    return dataclasses.replace(prob, **kw)


_PROBLEMS = [
    {},
    dict(compute_kl=True),
    dict(top_k=64),
    dict(top_k=128),  # over the CuTe combine's 64 slots: Triton's combine, Triton's limits
    dict(block_size=64),
    dict(num_heads=8, num_kv_heads=8),  # selection heads spanning KV heads: bwd refuses
    dict(head_dim=64, proxy_head_dim=64),
    dict(head_dim=96),
    dict(dtype=torch.float16, deterministic=True),
    dict(q_map=True, compute_kl=True),
    dict(selection_precision="fp8"),
    dict(max_seqlen=100000, num_seqs=3),
    dict(warmup=True, top_k=None),
]


def _fresh(cute, op, prob):
    cute.clear_memo()
    return cute.unsupported_reason(op, prob)


def test_cute_remembered_reasons_are_fresh_ones(monkeypatch):
    """Every op's reason for a spread of problems (refusals, borrowed Triton stages, warmup,
    query map, fp8) is the same remembered as computed fresh, and a remembered stage pick
    follows what its fit checks read (a query map, the slots per row)."""
    pytest.importorskip("cutlass")
    from flash_msa import cute

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's limits answer for borrowed stages
    cute.clear_memo()
    seen = set()
    for kw in _PROBLEMS:
        prob = _hopper(**kw)
        for op in ("fwd", "bwd") if prob.cfg.warmup else ("select", "fwd", "bwd"):
            remembered = [cute.unsupported_reason(op, prob) for _ in range(2)]
            assert remembered == [_fresh(cute, op, prob)] * 2, (kw, op)
            seen.add(remembered[0] is None)
    assert seen == {True, False}  # (the spread has refusals and accepted calls)
    kl = _hopper(compute_kl=True)
    assert cute.call_stages(kl).kl is not None and cute.call_stages(kl).combine is not None
    assert cute.call_stages(_hopper(compute_kl=True, q_map=True)).kl is None  # Triton's
    wide = _hopper(compute_kl=True, top_k=128)  # over the CuTe combine's 64 slots
    assert cute.call_stages(wide).combine is None
    assert "combine" in sparse_forward.borrowed_names(cute.call_stages(wide))
    assert cute.call_stages(kl).combine is not None and cute.call_stages(kl).kl is not None


def test_cute_repeated_resolve_recomputes_nothing(monkeypatch):
    """``auto``'s three resolves of a repeated call pick the stages once (the forward's pick
    for the call's own tensors included, and another varlen step's ``max_seqlen``), another
    ``top_k`` is another key, and the
    bounded memo stays right when it is cleared for room."""
    pytest.importorskip("cutlass")
    from flash_msa import cute
    from flash_msa.cute import forward, memo

    monkeypatch.delenv("FLASH_MSA_BACKEND", raising=False)
    cute.clear_memo()
    picks, real = [], forward.forward_stages
    monkeypatch.setattr(forward, "forward_stages", lambda *a: picks.append(a) or real(*a))
    prob = _hopper()
    for _ in range(3):
        assert [backends.resolve(op, prob)[0] for op in ("select", "fwd", "bwd")] == ["cute"] * 3
    assert len(picks) == 1
    q, k, qp, kp, idx = (
        torch.empty(16384, *x.shape[1:], dtype=x.dtype, device="meta")
        for x in cute.meta_inputs(prob)
    )
    assert cute.stages_for(q, k, qp, kp, idx, prob.cfg) is cute.call_stages(prob)
    assert len(picks) == 1  # (the call's tensors: the same key as the problem's meta inputs)
    # a varlen step's longest sequence, the scales and the sequence count are read by no
    # kernel's limits (cute.run_free): the same pick; top_k is read: another key
    backends.resolve("fwd", _hopper(max_seqlen=8192, softmax_scale=0.1, num_seqs=3))
    assert len(picks) == 1
    backends.resolve("fwd", _hopper(top_k=8))
    assert len(picks) == 2
    monkeypatch.setattr(memo, "MEMO_ENTRIES", 2)
    for kw in _PROBLEMS[:6]:
        prob = _hopper(**kw)
        assert cute.unsupported_reason("fwd", prob) == _fresh(cute, "fwd", prob)
        assert len(memo._MEMO) <= 2
