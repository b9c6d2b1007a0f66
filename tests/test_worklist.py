"""CPU tests of the work list (``flash_msa/worklist.py``): the reverse index covers every used
(token, head, slot) entry once, items stay within their size and one list, and
``split_items`` cuts items without losing, repeating or reordering entries; ``lists`` /
``items`` (one sort, cut at any size) equal a plain-Python reverse index bit for bit; a training
step sorts once (the forward's lists reach the backward: Triton interpreter, and the CuTe
backward's host code with its launch replaced) with the same gradients bit for bit, and a
chunked forward keeps nothing."""

from __future__ import annotations

import pytest
import torch

import flash_msa
from flash_msa import reference, sparse_forward, testing, worklist
from flash_msa.problem import Forward, Saved
from harness import config, packed_inputs
from harness import random_rows as _random_rows
from harness import work_items as _items


@pytest.mark.parametrize("lengths", [(300,), (0, 130, 1, 257)])
@pytest.mark.parametrize("TW, size", [(256, 128), (256, 64), (128, 128), (96, 40)])
def test_split_items_keeps_every_entry_in_order(lengths, TW, size):
    torch.manual_seed(len(lengths) * TW + size)
    T, Hs, K, block = sum(lengths), 2, 4, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    # sequence-local block indices (-1: unused slot): any block of the token's sequence
    seq = torch.searchsorted(cu[1:].long(), torch.arange(T), right=True)
    nblk = (cu[1:] - cu[:-1] + block - 1) // block
    idx = (torch.rand(T, Hs, K) * nblk[seq].float()[:, None, None]).long()
    idx = torch.where(torch.rand(T, Hs, K) < 0.2, -1, idx).int()
    wl = worklist.build(idx, cu, block, TW)
    used = (idx.flatten() >= 0).nonzero().flatten().tolist()
    entries = [e for _, es in _items(wl) for e in es]
    assert sorted(entries) == used  # every used entry once
    assert all(len(es) <= TW for _, es in _items(wl))
    split = worklist.split_items(wl, size)
    assert split.num_items == wl.num_items * -(-TW // size) == split.item_list.numel()
    cut = _items(split)
    assert [e for _, es in cut for e in es] == entries  # same entries, same order
    assert all(len(es) <= size for _, es in cut)
    assert wl.item_tokens == TW and split.item_tokens == min(TW, size)
    # each piece stays in its item's list
    lists = {e: lst for lst, es in _items(wl) for e in es}
    assert all(lists[e] == lst for lst, es in cut for e in es)


# ---------------------------------------------------------------------------------------------
# lists (the sort) and items (the cut): the same work list as a plain-Python reverse index
# ---------------------------------------------------------------------------------------------
def _expected(idx, lengths, block, TW, tok0, total, q_map):
    """The work list of rows ``tok0 ..`` of ``idx`` by plain Python: every used entry in its
    (head, global block) list in token order, then the unused ones in flat order; each list cut
    into items of ``TW``, then empty items ``(L - 1, 0, 0)`` up to ``W``. Returns ``(perm,
    [(list, start, end)], block_start, block_end)``."""
    C, Hs, K = idx.shape
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    NB = total // block + len(lengths)
    seq_first, ranges = [], []
    for s0, n in zip(cu, lengths):
        seq_first.append(len(ranges))
        ranges += [(s0 + b, min(s0 + n, s0 + b + block)) for b in range(0, n, block)]
    pad = [(0, 0)] * (NB - len(ranges))
    L = Hs * NB
    lists, unused = [[] for _ in range(L)], []
    for r in range(C):
        tok = tok0 + r if q_map is None else int(q_map[tok0 + r])
        seq = next((n for n in range(len(lengths)) if cu[n] <= tok < cu[n + 1]), None)
        for h in range(Hs):
            for s in range(K):
                e, i = ((tok0 + r) * Hs + h) * K + s, int(idx[r, h, s])
                (unused if i < 0 or tok < 0 else lists[h * NB + seq_first[seq] + i]).append(e)
    perm, items = [], []
    for lst, entries in enumerate(lists):
        items += [(lst, len(perm) + j, len(perm) + min(j + TW, len(entries)))
                  for j in range(0, len(entries), TW)]  # fmt: skip
        perm += entries
    items += [(L - 1, 0, 0)] * ((C * Hs * K) // TW + L - len(items))
    starts, ends = zip(*(ranges + pad))
    return perm + unused, items, list(starts), list(ends)


@pytest.mark.parametrize("lengths", [(300,), (0, 130, 1, 257, 0), (64,)])
@pytest.mark.parametrize("Hs, K, block", [(1, 1, 64), (2, 4, 64), (3, 3, 128)])
@pytest.mark.parametrize("TW", [1, 7, 128, 256])
@pytest.mark.parametrize("tok0, mapped", [(0, False), (5, False), (0, True), (7, True)])
def test_items_of_lists_equal_a_plain_reverse_index(lengths, Hs, K, block, TW, tok0, mapped):
    """``build`` (= ``items(lists(...), TW)``) gives the plain-Python work list bit for bit
    (as the single-function build before the split did: same perm, items, empty items and
    blocks), with a query map (padding rows, rows of any sequence) and a chunk offset; item and
    block tensors contiguous and 16-byte aligned (the kernels read them by pointer)."""
    T = sum(lengths)
    q_map = None
    if mapped:
        g = torch.Generator().manual_seed(T + TW)
        q_map = torch.randint(-1, T, (T + 3,), generator=g, dtype=torch.int32)
    cu, idx = _random_rows(lengths, Hs, K, block, q_map, T * Hs + K + TW)
    wl = worklist.build(idx[tok0:], cu, block, TW, tok0, T, q_map)
    perm, items, starts, ends = _expected(idx[tok0:], lengths, block, TW, tok0, T, q_map)
    assert wl.perm.tolist() == perm
    assert list(zip(*(x.tolist() for x in (wl.item_list, wl.item_start, wl.item_end)))) == items
    assert (wl.block_start.tolist(), wl.block_end.tolist()) == (starts, ends)
    assert wl.num_items == len(items) and wl.item_tokens == TW and wl.q_map is q_map
    dtypes = (torch.int64, torch.int32, torch.int64, torch.int64, torch.int32, torch.int32)
    for x, dt in zip(wl[:6], dtypes):
        assert x.dtype == dt and x.is_contiguous() and x.data_ptr() % 16 == 0


def test_one_sort_cut_at_several_sizes():
    """Lists sorted once and cut at the forward's and the backward's item sizes equal fresh
    builds at each size, and the cut is a fixed number of small ops (no sort, no search over
    the entries: the backward's share of the work)."""
    lengths, Hs, K, block = (200, 0, 333), 2, 4, 64
    cu, idx = _random_rows(lengths, Hs, K, block, None, 3)
    sorted_lists = worklist.lists(idx, cu, block)
    assert sorted_lists.nbytes == idx.numel() * 8 + (Hs * sorted_lists.num_blocks + 1) * 8 + (
        sorted_lists.num_blocks * 8
    )
    for TW in (256, 128, 32):
        cut, fresh = worklist.items(sorted_lists, TW), worklist.build(idx, cu, block, TW)
        for a, b in zip(cut, fresh):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert cut.perm is sorted_lists.perm
    with pytest.raises(ValueError, match="TW"):
        worklist.items(sorted_lists, 0)


# ---------------------------------------------------------------------------------------------
# one sort per training step: the forward's lists reach the backward
# ---------------------------------------------------------------------------------------------
def _count_sorts(monkeypatch) -> list:
    """Patch ``worklist.lists`` (which ``build`` calls too) to record the rows of each sort."""
    calls, real = [], worklist.lists
    monkeypatch.setattr(
        worklist, "lists", lambda idx, *a, **kw: calls.append(idx.shape[0]) or real(idx, *a, **kw)
    )
    return calls


_STEP = dict(lengths=(90, 0, 40), H=4, Hkv=2, Hp=2, Hpk=1, D=16, block=64, top_k=2)


def _triton_step(monkeypatch, det: bool, share: bool, mapped: bool = False):
    """Gradients of ``msa_attention`` + ``training_loss`` on the Triton backend (interpreter)
    and the rows of each work-list sort, with (``share``) or without the forward's lists."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    if not share:
        monkeypatch.setattr(sparse_forward, "keeps", lambda *a: False)
    s = _STEP
    (qp, kp, q, k, v), cu = packed_inputs(
        s["lengths"], s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=2,
    )  # fmt: skip
    kw = {}
    if mapped:  # query rows: a few tokens in another order, and padding rows
        kw["q_map"] = torch.tensor([3, 100, -1, 0, 129, 77, 91, -1, 5], dtype=torch.int32)
        qp, q = qp[: len(kw["q_map"])], q[: len(kw["q_map"])]
    inputs = [x.detach().requires_grad_() for x in (qp, kp, q, k, v)]
    calls = _count_sorts(monkeypatch)
    out, kl = flash_msa.msa_attention(
        *inputs, s["top_k"], block_size=s["block"], cu_seqlens=cu,
        max_seqlen=max(s["lengths"]), deterministic=det, **kw,
    )  # fmt: skip
    testing.training_loss(out, kl, s["Hp"] * q.shape[0]).backward()
    monkeypatch.undo()
    return [x.grad for x in inputs], calls


@pytest.mark.parametrize("det, mapped", [(False, False), (True, False), (False, True)])
def test_training_step_sorts_once_same_gradients(monkeypatch, det, mapped):
    """A training step on the Triton backend sorts its work list once (the forward's lists cut
    again by the backward; deterministic mode: one chunk) instead of two or three times (the
    deterministic backward also sorts a one-row probe), and every gradient is bit for bit the
    one of a step that sorts again."""
    shared, sorts = _triton_step(monkeypatch, det, True, mapped)
    fresh, fresh_sorts = _triton_step(monkeypatch, det, False, mapped)
    T = 9 if mapped else sum(_STEP["lengths"])  # query rows
    assert sorts == [T], sorts
    assert fresh_sorts == ([T, 1, T] if det else [T, T]), fresh_sorts
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), shared, fresh):
        assert torch.equal(a, b), name


def test_sparse_attention_shares_too(monkeypatch):
    """``sparse_attention`` (given indices, no proxy) sorts once per step as well."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    s = _STEP
    (qp, kp, q, k, v), cu = packed_inputs(
        s["lengths"], s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=3,
    )  # fmt: skip
    idx = reference.select(qp, kp, cu, config(max(s["lengths"]), s["D"], s["D"], 64, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    calls = _count_sorts(monkeypatch)
    out = flash_msa.sparse_attention(q, k, v, idx, block_size=64, cu_seqlens=cu, max_seqlen=90)
    out.float().square().sum().backward()
    assert calls == [q.shape[0]]


def _driver_forward(monkeypatch, partial_bytes=None, keep_share=None):
    """The Triton forward (the sparse-forward driver) of a small call, and its sorts."""
    if partial_bytes is not None:
        monkeypatch.setattr(sparse_forward, "PARTIAL_BYTES", partial_bytes)
    if keep_share is not None:
        monkeypatch.setattr(sparse_forward, "KEEP_SHARE", keep_share)
    from flash_msa.triton_ref import sparse_fwd

    (qp, kp, q, k, v), cu = packed_inputs(
        (100, 60), 4, 2, 2, 1, 16, 16, dtype=torch.float32, device="cpu", seed=4
    )
    cfg = config(100, 16, 16, 64, 2)
    idx = reference.select(qp, kp, cu, cfg)
    calls = _count_sorts(monkeypatch)
    f = sparse_fwd.fwd(q, k, v, idx, cu, cfg)
    return f, calls, (q, k, v, idx, cu, cfg)


def test_memory_rule_one_chunk_kept_chunked_nothing(monkeypatch):
    """The driver keeps its lists when it sorted once (one chunk, or a chunked call that
    ``one_sort`` allows), within ``keeps``' share of q, k, v and out: ``T * Hs * K * 8`` bytes
    for ``perm`` and the small bounds; a chunked forward that sorted per chunk (one_sort's
    fallback) or a layout whose lists outgrow the share keeps nothing."""
    f, calls, (q, k, v, idx, cu, cfg) = _driver_forward(monkeypatch)
    kept = worklist.carried(f)
    assert calls == [160] and kept is not None and kept.rows == 160
    assert kept.perm.nbytes == idx.numel() * 8
    assert sparse_forward.KEEP_SHARE * kept.nbytes <= 2 * q.nbytes + k.nbytes + v.nbytes
    assert worklist.matches(kept, idx, cu, cfg.block_size, k.shape[0], None)
    out, lse = f[:2]  # a carrying Forward unpacks as a plain one
    assert isinstance(f, Forward) and len(f) == 5 and out is f.out
    monkeypatch.undo()
    # chunks of 48 rows (the partials' budget): one sort of all rows, kept
    per_row = 4 * 2 * 16 * 4  # H * K * D * fp32
    f, calls, _ = _driver_forward(monkeypatch, partial_bytes=48 * per_row)
    assert calls == [160] and worklist.carried(f) is not None
    assert worklist.carried(f).rows == 160
    monkeypatch.undo()
    # the same chunks sorted one by one (one_sort's fallback, forced): nothing kept
    monkeypatch.setattr(sparse_forward, "ONE_SORT_BYTES", 0)
    f, calls, _ = _driver_forward(monkeypatch, partial_bytes=48 * per_row)
    assert calls == [48, 48, 48, 16] and worklist.carried(f) is None
    monkeypatch.undo()
    f, calls, _ = _driver_forward(monkeypatch, keep_share=10**6)
    assert calls == [160] and worklist.carried(f) is None


def test_lists_match_only_their_own_call():
    """``matches``: the backward uses carried lists only if they are of the whole call, its
    block size, key count and map presence (else it sorts again)."""
    lengths, Hs, K, block = (100, 60), 2, 3, 64
    cu, idx = _random_rows(lengths, Hs, K, block, None, 5)
    whole = worklist.lists(idx, cu, block)
    assert worklist.matches(whole, idx, cu, block, 160, None)
    assert not worklist.matches(None, idx, cu, block, 160, None)
    assert not worklist.matches(worklist.lists(idx[40:], cu, block, 40, 160), idx, cu, block,
                                160, None)  # fmt: skip
    assert not worklist.matches(whole, idx, cu, 128, 160, None)
    assert not worklist.matches(whole, idx, cu, block, 300, None)
    assert not worklist.matches(whole, idx, cu, block, 160, torch.arange(160, dtype=torch.int32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the ordered sums of unwritten tiles
@pytest.mark.parametrize("det", [False, True])
def test_cute_backward_cuts_the_carried_lists(monkeypatch, det):
    """The CuTe backward's host code (``backward.bwd``, kernel launches replaced by a recorder;
    deterministic mode: one chunk) launches on the carried lists cut at its 128-entry items,
    the work list a fresh build gives, without sorting; without lists it sorts as before."""
    pytest.importorskip("cutlass")
    import dataclasses

    from flash_msa.cute import backward, bwd_sm90

    launched = []
    monkeypatch.setattr(backward, "launch_items", lambda *a, **kw: launched.append(a[3]))
    lengths, H, Hkv, Hs, Hpk, D, block, K = (130, 0, 70), 8, 2, 4, 1, 64, 64, 2
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hs, Hpk, D, D, dtype=torch.bfloat16, device="cpu", seed=1
    )
    cfg = config(max(lengths), D, D, block, K)
    idx = reference.select(qp, kp, cu, cfg)
    T = q.shape[0]
    stats = torch.zeros((T, H)), torch.zeros((T, Hs))
    saved = Saved(q, k, v, torch.zeros_like(q), stats[0], idx, qp, kp, stats[1], None)
    carrying = worklist.carry(saved, worklist.lists(idx, cu, block))
    calls = _count_sorts(monkeypatch)
    cfg = dataclasses.replace(cfg, deterministic=det)
    backward.bwd(torch.zeros_like(q), torch.ones(()), carrying, cu, cfg)
    assert calls == [] and len(launched) == 1
    want = worklist.build(idx, cu, block, bwd_sm90.BwdSm90.ITEM_TOKENS)
    for a, b in zip(launched[0], want):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    backward.bwd(torch.zeros_like(q), torch.ones(()), saved, cu, cfg)
    assert calls[-1] == T and len(launched) == 2
