"""CPU tests of the one sort per chunked forward (``sparse_forward.one_sort``, P1 of
docs/reviews/2026-12-01-fwd-after-partials.md, the default since the twelfth session's A/B):
a chunked forward sorts its work list once (``worklist.lists(..., chunk=C)``), cuts each chunk's
work list from it (``worklist.chunk_items``: item for item the per-chunk ``build``'s) and runs
the KL stage once over the whole lists; out, lse and proxy_lse are bitwise those of the
per-chunk sorts, the KL value equal up to its fp32 summation order (and the same bits run to
run), the lists reach the backward (one sort per training step, the main gradients bitwise),
and the driver runs fewer torch ops. Triton backend under the interpreter, ``PARTIAL_BYTES``
patched small so that the calls run in several chunks; the per-chunk sorts (the fallback) are
forced with ``ONE_SORT_BYTES = 0``, one of ``one_sort``'s own conditions."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_msa
from flash_msa import reference, sparse_forward, testing, worklist
from harness import config, packed_inputs
from harness import random_rows as _rows
from harness import work_items as _items


_ONE_SORT_BYTES = sparse_forward.ONE_SORT_BYTES


def _switch(monkeypatch, on):
    """One sort (the default) or, ``on`` False, the per-chunk sorts: the fallback ``one_sort``
    takes when the sort's transient memory would pass ``ONE_SORT_BYTES``."""
    monkeypatch.setattr(sparse_forward, "ONE_SORT_BYTES", _ONE_SORT_BYTES if on else 0)


# ---------------------------------------------------------------------------------------------
# the cut: chunk_items of the one sort == the per-chunk build
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lengths, mapped, block",
    [((300,), False, 64), ((0, 130, 1, 257, 0), False, 64), ((130, 0, 170), True, 128),
     ((200, 90), False, 128)],
)  # fmt: skip
@pytest.mark.parametrize("rows_per_chunk", [None, 48, 40])
def test_chunk_items_equal_the_per_chunk_build(lengths, mapped, block, rows_per_chunk):
    """For every chunk of C rows (C = all rows, 48, 40) and item sizes 256 and 16: the same
    item lists, each item the same entries, the same empty items (``[0, 0)``), ``W``, blocks,
    map and sizes as ``build`` of the chunk's rows (varlen with empty sequences, a query map
    with padding rows, blocks 64 and 128); the item tensors contiguous and 16-byte aligned;
    the whole ``perm`` and ``bounds`` those of ``lists`` without chunks."""
    T, Hs, K = sum(lengths), 2, 3
    q_map = None
    if mapped:  # query rows of any token, in any order, and padding rows
        g = torch.Generator().manual_seed(T)
        q_map = torch.randint(-1, T, (T + 5,), generator=g, dtype=torch.int32)
    cu, idx = _rows(lengths, Hs, K, block, q_map, T + block)
    R = idx.shape[0]
    C = R if rows_per_chunk is None else rows_per_chunk
    one = worklist.lists(idx, cu, block, 0, T, q_map, chunk=C)
    plain = worklist.lists(idx, cu, block, 0, T, q_map)
    assert torch.equal(one.perm, plain.perm) and torch.equal(one.bounds, plain.bounds)
    assert one.num_chunks == -(-R // C) and one.chunk_bounds.shape == (
        one.num_chunks + 1,
        Hs * one.num_blocks + 1,
    )
    for TW in (256, 16):
        cut = worklist.chunk_items(one, TW)
        assert len(cut) == one.num_chunks
        for c, c0 in enumerate(range(0, R, C)):
            mine = cut[c]
            want = worklist.build(idx[c0 : c0 + C], cu, block, TW, c0, T, q_map)
            assert torch.equal(mine.item_list, want.item_list), (c, TW)
            assert _items(mine) == _items(want), (c, TW)
            for wl in (mine, want):  # the empty items: [0, 0)
                empty = wl.item_end == wl.item_start
                assert not wl.item_start[empty].any()
            assert torch.equal(mine.item_end - mine.item_start, want.item_end - want.item_start)
            assert (mine.num_items, mine.item_tokens, mine.slots, mine.heads) == (
                want.num_items, want.item_tokens, want.slots, want.heads,
            )  # fmt: skip
            assert mine.num_blocks == want.num_blocks and mine.q_map is q_map
            assert torch.equal(mine.block_start, want.block_start)
            assert torch.equal(mine.block_end, want.block_end)
            for x in mine[1:4]:
                assert x.is_contiguous() and x.data_ptr() % 16 == 0
    whole = worklist.items(one, 256)
    assert _items(whole) == _items(worklist.build(idx, cu, block, 256, 0, T, q_map))
    kept = one.unchunked()
    assert kept.chunk_bounds is None and torch.equal(kept.bounds, plain.bounds)
    assert kept.nbytes == plain.nbytes
    assert worklist.matches(kept, idx, cu, block, T, q_map)
    with pytest.raises(ValueError, match="TW"):
        worklist.chunk_items(one, 0)
    with pytest.raises(ValueError, match="sorted_lists"):
        worklist.chunk_items(plain, 256)
    with pytest.raises(ValueError, match="chunk"):
        worklist.lists(idx, cu, block, 0, T, q_map, chunk=0)


# ---------------------------------------------------------------------------------------------
# the driver: one sort vs the per-chunk sorts (Triton stages, interpreter)
# ---------------------------------------------------------------------------------------------
_SHAPE = dict(H=4, Hkv=2, Hp=2, Hpk=1, D=16, block=64, top_k=2)
_ROW_BYTES = 4 * 2 * 16 * 4  # H * K * D * fp32: PARTIAL_BYTES per row
_CHUNK = 24  # rows per chunk (PARTIAL_BYTES patched): 4 chunks of the calls below
# (small: the interpreter's time goes mostly to the combine's one program per row)


def _count_sorts(monkeypatch) -> list:
    """Patch ``worklist.lists`` (``build`` calls it too) to record the rows of each sort."""
    calls, real = [], worklist.lists
    monkeypatch.setattr(
        worklist, "lists", lambda idx, *a, **kw: calls.append(idx.shape[0]) or real(idx, *a, **kw)
    )
    return calls


def _forward(monkeypatch, on, lengths, mapped=False, det=False, proxy_grad=False):
    """The Triton forward (the driver) in chunks of ``_CHUNK`` rows, one sort if ``on``: its
    ``Forward`` and the rows of each sort."""
    from flash_msa.triton_ref import sparse_fwd

    s = _SHAPE
    monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", _CHUNK * _ROW_BYTES)
    _switch(monkeypatch, on)
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=4,
    )  # fmt: skip
    cfg = config(max(lengths), s["D"], s["D"], s["block"], s["top_k"])
    if det:
        cfg = type(cfg)(**{**cfg.__dict__, "deterministic": True})
    kw = {}
    if mapped:  # query rows: tokens in another order, and padding rows
        g = torch.Generator().manual_seed(1)
        rows = torch.randperm(sum(lengths), generator=g)
        rows = torch.cat((rows[:30], torch.tensor([-1, -1]), rows[30:], torch.tensor([-1])))
        kw["q_map"] = rows.int()
        qp, q = qp[rows.clamp_min(0)], q[rows.clamp_min(0)]
        idx = reference.select(qp, kp, cu, cfg, **kw)
    else:
        idx = reference.select(qp, kp, cu, cfg)
    calls = _count_sorts(monkeypatch)
    f = sparse_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad, **kw)
    monkeypatch.undo()
    return f, calls, idx


@pytest.mark.parametrize(
    "lengths, mapped, det",
    [((70, 0, 26), False, False), ((66, 30), True, False), ((70, 26), False, True)],
)
def test_driver_one_sort_same_outputs(monkeypatch, lengths, mapped, det):
    """One sort against the per-chunk sorts, 4 chunks (varlen with an empty sequence; a query map with
    padding rows; deterministic mode): one sort instead of one per chunk, out, lse and
    proxy_lse bitwise equal, the KL value within fp32 summation order (and bitwise the same
    in a second run), the whole lists kept for the backward (off: none kept)."""
    off, off_sorts, idx = _forward(monkeypatch, False, lengths, mapped, det)
    on, on_sorts, _ = _forward(monkeypatch, True, lengths, mapped, det)
    R = idx.shape[0]
    assert off_sorts == [min(_CHUNK, R - c0) for c0 in range(0, R, _CHUNK)] and on_sorts == [R]
    assert len(off_sorts) >= 4  # (the map: 99 rows, a short last chunk)
    for name in ("out", "lse", "proxy_lse"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name
    assert torch.allclose(on.kl, off.kl, rtol=1e-6, atol=0), (on.kl, off.kl)
    if det:  # the same bits run to run
        assert torch.equal(on.kl, _forward(monkeypatch, True, lengths, mapped, det)[0].kl)
    kept = worklist.carried(on)
    assert worklist.carried(off) is None and kept is not None and kept.chunk_bounds is None
    assert kept.rows == R and kept.tok0 == 0


def test_unit_proxy_gradient_one_pass(monkeypatch):
    """With the unit proxy gradient (the Triton KL stage makes it in the KL pass) the one KL
    pass over the whole lists adds the same gradient (fp32 atomics: up to order); in
    deterministic mode the one sort stands aside (the ordered row partials are sized by a work
    list's rows): one sort per chunk, the same bits as off."""
    off, _, _ = _forward(monkeypatch, False, (70, 26), proxy_grad=True)
    on, sorts, _ = _forward(monkeypatch, True, (70, 26), proxy_grad=True)
    assert sorts == [96]
    for a, b in zip(on.proxy_grad, off.proxy_grad):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # (deterministic: the fallback is the per-chunk path, off's code)
    on, sorts, _ = _forward(monkeypatch, True, (70, 26), det=True, proxy_grad=True)
    assert sorts == [24] * 4 and worklist.carried(on) is None


# ---------------------------------------------------------------------------------------------
# a training step: the one sort reaches the backward
# ---------------------------------------------------------------------------------------------
def _step(monkeypatch, on):
    """Gradients of ``msa_attention`` + ``training_loss`` (Triton, 4 forward chunks), the
    forward's KL, and the rows of each sort of the step."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", _CHUNK * _ROW_BYTES)
    _switch(monkeypatch, on)
    s, lengths = _SHAPE, (70, 0, 26)
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=2,
    )  # fmt: skip
    inputs = [x.detach().requires_grad_() for x in (qp, kp, q, k, v)]
    calls = _count_sorts(monkeypatch)
    out, kl = flash_msa.msa_attention(
        *inputs, s["top_k"], block_size=s["block"], cu_seqlens=cu, max_seqlen=max(lengths)
    )
    testing.training_loss(out, kl, s["Hp"] * q.shape[0]).backward()
    monkeypatch.undo()
    return [x.grad for x in inputs], kl.detach(), calls


def test_training_step_one_sort(monkeypatch):
    """A chunked training step sorts once (the backward cuts the forward's
    lists) instead of once per chunk plus the backward's; dq, dk, dv bitwise, the proxy
    gradients (made from the KL pass's unit gradient, fp32 atomics) to fp32 rounding."""
    on, kl_on, sorts = _step(monkeypatch, True)
    off, kl_off, off_sorts = _step(monkeypatch, False)
    assert sorts == [96] and off_sorts == [24] * 4 + [96], (sorts, off_sorts)
    assert torch.allclose(kl_on, kl_off, rtol=1e-6, atol=0)
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), on, off):
        if name.endswith("proxy"):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
        else:
            assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# the glue: fewer torch ops
# ---------------------------------------------------------------------------------------------
class _OpCount(TorchDispatchMode):
    """Counts the torch ops that would launch a kernel on a GPU: not views, not allocations."""

    FREE = ("empty", "empty_like", "empty_strided", "lift_fresh", "detach")

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1]
        if not func.is_view and name.split(".")[0] not in self.FREE:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _glue_ops(monkeypatch, on, chunks):
    """Torch ops of the driver around stub stages (no kernels: the work list, the buffers,
    the KL sum) for a call of ``chunks`` chunks of 32 rows."""
    monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", 32 * _ROW_BYTES)
    _switch(monkeypatch, on)
    T, H, Hs, K, D = 32 * chunks, 4, 2, 2, 16
    g = torch.Generator().manual_seed(0)
    q, qp = torch.randn(T, H, D, generator=g), torch.randn(T, Hs, D, generator=g)
    k, v, kp = torch.randn(T, 2, D, generator=g), torch.randn(T, 2, D), torch.randn(T, 1, D)
    cu = testing.cu([T], "cpu")
    cfg = config(T, D, D, 64, K)
    idx = reference.select(qp, kp, cu, cfg)
    kl_calls = []
    stages = sparse_forward.Stages(
        partials=lambda *a: None, partials_make_proxy=True, combine=lambda *a: None,
        combine_makes_proxy=True, kl=lambda *a: kl_calls.append(a[6]) or torch.ones(()),
    )  # fmt: skip
    with _OpCount() as count:
        f = sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp)
    monkeypatch.undo()
    return count.ops, kl_calls, f


def test_fewer_glue_ops(monkeypatch):
    """16 chunks (paper 128K's count): the driver's own torch ops drop several-fold (one sort
    and one search instead of 16 of each, the cut per chunk), and the KL stage runs once on
    the whole lists (off: once per chunk on the chunk's items)."""
    off, kl_off, f_off = _glue_ops(monkeypatch, False, 16)
    on, kl_on, f_on = _glue_ops(monkeypatch, True, 16)
    assert len(kl_off) == 16 and len(kl_on) == 1
    assert kl_on[0].num_items == (16 * 32 * 2 * 2) // 256 + kl_on[0].heads * kl_on[0].num_blocks
    assert torch.equal(f_on.kl, torch.ones(()) / (2 * 512)) and f_off.kl == 16 / (2 * 512)
    assert on < 0.3 * off, (on, off)
    print(f"driver glue ops, 16 chunks: one sort {on}, per-chunk sorts {off}")


def test_cute_host_takes_the_chunk_lists(monkeypatch):
    """The CuTe partials' host code (launch replaced by a recorder: no GPU here) takes each
    chunk's work list, rows of shared buffers and the whole call's ``perm``: every pointer
    16-byte aligned and every layout one its launch accepts (ValueError otherwise)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import fwd_partials_sm90 as fp

    launched = []
    monkeypatch.setattr(fp, "run_typed", lambda kernel, dev, args, sig: launched.append(args))
    monkeypatch.setattr(fp, "stream", lambda device: None)
    lengths, H, Hkv, Hs, D, block, K, C = (300, 0, 212), 8, 2, 4, 64, 64, 2, 100
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hs, 1, D, D, dtype=torch.bfloat16, device="cpu", seed=1
    )
    cfg = config(max(lengths), D, D, block, K)
    idx = reference.select(qp, kp, cu, cfg)
    one = worklist.lists(idx, cu, block, 0, q.shape[0], None, chunk=C)
    for c, wl in enumerate(worklist.chunk_items(one, worklist.ITEM_TOKENS)):
        rows = min(C, q.shape[0] - c * C)
        o_part = torch.empty((rows, H, K, D), dtype=q.dtype)
        l_part, pl_part = torch.empty((rows, H, K)), torch.empty((rows, Hs, K))
        fp.partials(q, k, v, wl, o_part, l_part, cfg, c * C, (qp, kp, pl_part))
    assert len(launched) == 6
