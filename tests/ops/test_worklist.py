"""CPU tests of the work list (``flash_msa/worklist.py``): the reverse index covers every used
(token, head, slot) entry once, items stay within their size and one list, and
``split_items`` cuts items without losing, repeating or reordering entries; ``lists`` /
``items`` (one sort, cut at any size) equal a plain-Python reverse index bit for bit; a training
step sorts once (the forward's lists reach the backward: Triton interpreter, and the CuTe
backward's host code with its launch replaced) with the same gradients bit for bit, and a
chunked forward keeps nothing.

CPU tests of the one sort per chunked forward (``sparse_forward.one_sort``, the default):
a chunked forward sorts its work list once (``worklist.lists(..., chunk=C)``), cuts each chunk's
work list from it (``worklist.chunk_items``: item for item the per-chunk ``build``'s) and runs
the KL stage once over the whole lists; out, lse and proxy_lse are bitwise those of the
per-chunk sorts, the KL value equal up to its fp32 summation order (and the same bits run to
run), the lists reach the backward (one sort per training step, the main gradients bitwise),
and the driver runs fewer torch ops. Triton backend under the interpreter, ``PARTIAL_BYTES``
patched small so that the calls run in several chunks; the per-chunk sorts (the fallback) are
forced with ``ONE_SORT_BYTES = 0``, one of ``one_sort``'s own conditions.

The shared work list (one sort per training step): CPU tests that it keeps nothing a
backward does not read. Correctness held in every case tried (checkpoint, save_on_cpu,
retain_graph, chunked deterministic backwards: gradients bit for bit); these two are memory.

A training step keeps the forward's sorted lists (``sparse_forward.keeps``: up to a quarter of
q, k, v, out; 8 MiB at anchor 16K) for a backward that does not read them:

- deterministic mode when the backward's dQ partials make it run in chunks while the forward ran
  in one (anchor 16K and 32K: the forward's rows take 64 KiB of partials, 32768 per chunk; the
  deterministic backwards' at least 128 KiB, 8192 per chunk): each chunk sorts its own list;
- a proxy-only step on the Triton backend (main weights frozen, the proxy trained by the KL):
  the forward made the unit proxy gradient, so the backward builds no work list at all.

api.py / sparse_forward.py keep the lists only for a backward that uses them.

CPU tests of the training step's glue: few torch ops, the same values.

- The work list is built in fewer torch ops (each one a CUDA launch and ~5-10 us of host time
  in an eager step: the anchor 16K forward waits for them between the selection and the
  partials) with the same values: key blocks against plain Python over many batches, the op
  counts pinned (tests/ops/test_worklist.py checks the whole list bit for bit).
- The sparse-forward driver sums the KL without a zero fill, and fills nothing without the KL.
- The CuTe backend's remembered reasons and stage picks (``cute.memo``) are the ones a fresh
  call makes, switch and stage-function changes included, and a repeated call recomputes
  nothing.

GPU tests of the CuTe work-list build (``flash_msa/cute/worklist_host.py``) on Hopper: its
``blocks``, ``items`` and ``lists`` equal ``flash_msa.worklist``'s torch functions bit for bit on
fresh random inputs (1 to 3000 sequences of random lengths, zero-length ones among them, block
64 and 128, NB a multiple of 4 and not; selections of 1 to 4 heads of 1 to 16 slots over 1 to
131072 tokens, TW 128 and 256, lists of many items and empty lists), with every new buffer
NaN/int-poisoned (a kernel that leaves an element unwritten fails) and the kernels' launches
counted (the CuTe path ran, not the fallback); and the three captured in one CUDA graph (no host
sync), replayed on changed inputs.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_msa
from flash_msa import backends, ordered, reference, sparse_forward, testing, worklist
from flash_msa.problem import Config, Forward, Problem, Saved
from harness import (
    config,
    marked,
    packed_inputs,
    random_rows,
    same_blocks,
    same_items,
    same_lists,
)
from harness import (
    random_rows as _random_rows,
)
from harness import (
    random_rows as _rows,
)
from harness import (
    work_items as _items,
)


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
# head packing: padded_geometry (the Triton kernels') tiles every group of up to 16 heads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [32, 64, 128, 256])
def test_padded_geometry_tiles_every_head_group(rows):
    """For every layout with up to 16 main heads per (selection head, KV head): the sub-groups
    tile the G heads exactly and each lies on one KV head, G2 is the largest divisor of the
    group whose power-of-two padding G2P fits ``rows / 16``, and the tile is BT tokens x G2P
    slots = ``rows`` MMA rows; a group that is a power of two is ``geometry``'s, unpadded."""

    def G2P_of(d):  # the next power of two
        return next(p for p in (1, 2, 4, 8, 16, 32) if p >= d)

    for Hkv in (1, 2, 4, 8):
        for Hs in (1, 2, 4, 8, 16):
            if Hs % Hkv and Hkv % Hs:  # not a legal layout
                continue
            for g in range(1, 17):
                H = g * max(Hs, Hkv)
                G, G2, G2P, R, BT = worklist.padded_geometry(H, Hkv, Hs, rows)
                assert G == H // Hs and G2 * R == G and (H // Hkv) % G2 == 0, (H, Hkv, Hs)
                assert G2P == G2P_of(G2)
                fits = [d for d in range(1, g + 1) if g % d == 0 and G2P_of(d) <= rows // 16]
                assert G2 == max(fits) and BT * G2P == rows and BT >= 16
                if g & (g - 1) == 0:
                    assert worklist.geometry(H, Hkv, Hs, rows) == (G, G2, R, BT) and G2P == G2
    assert worklist.padded_geometry(28, 4, 4, 128) == (7, 7, 8, 1, 16)  # Qwen2.5-7B, Hs = 4
    assert worklist.padded_geometry(48, 8, 8, 64) == (6, 3, 4, 2, 16)  # two padded sub-groups


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
    out, kl = flash_msa.api._msa_attention(  # (q_map: distributed's private entry)
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
def test_chunk_items_equal_a_build_of_the_chunk(lengths, mapped, block, rows_per_chunk):
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


def _count_sorts_one_sort(monkeypatch) -> list:
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
    calls = _count_sorts_one_sort(monkeypatch)
    f = sparse_fwd.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad, **kw)
    monkeypatch.undo()
    return f, calls, idx


@pytest.mark.parametrize(
    "lengths, mapped, det",
    [((70, 0, 26), False, False), ((66, 30), True, False), ((70, 26), False, True)],
)
def test_chunked_forward_sorts_once_with_the_same_outputs(monkeypatch, lengths, mapped, det):
    """One sort against the per-chunk sorts, 4 chunks (varlen with an empty sequence; a query map
    with padding rows; deterministic mode): one sort instead of one per chunk, out, lse and
    proxy_lse bitwise equal, the KL value within fp32 summation order (and bitwise the same in a
    second run), the whole lists kept for the backward (off: none kept)."""
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


def test_chunked_forward_makes_the_unit_proxy_gradient_in_one_kl_pass(monkeypatch):
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
    calls = _count_sorts_one_sort(monkeypatch)
    out, kl = flash_msa.msa_attention(
        *inputs, s["top_k"], block_size=s["block"], cu_seqlens=cu, max_seqlen=max(lengths)
    )
    testing.training_loss(out, kl, s["Hp"] * q.shape[0]).backward()
    monkeypatch.undo()
    return [x.grad for x in inputs], kl.detach(), calls


def test_chunked_training_step_sorts_once(monkeypatch):
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


def test_chunked_forward_glue_ops_do_not_grow_per_chunk(monkeypatch):
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


def test_cute_partials_take_the_chunk_lists(monkeypatch):
    """The CuTe partials' host code (launch replaced by a recorder: no GPU here) takes each
    chunk's work list, rows of shared buffers and the whole call's ``perm``: every pointer
    16-byte aligned and every layout one its launch accepts (ValueError otherwise)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import forward

    launched = []
    monkeypatch.setattr(forward, "run_typed", lambda kernel, dev, args, sig: launched.append(args))
    monkeypatch.setattr(forward, "stream", lambda device: None)
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
        forward.partials(q, k, v, wl, o_part, l_part, cfg, c * C, (qp, kp, pl_part))
    assert len(launched) == 6


def _forward_keeps_lists(monkeypatch, det: bool, main_grad: bool) -> tuple[bool, list]:
    """Runs ``msa_attention`` (Triton, interpreter) and returns whether the forward's sorted
    lists are still alive once the forward returned (i.e. saved for the backward), and the
    rows of each sort the backward ran."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    s = _STEP
    (qp, kp, q, k, v), cu = packed_inputs(
        s["lengths"], s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=2,
    )  # fmt: skip
    wants = (True, True, main_grad, main_grad, main_grad)  # q_proxy, k_proxy always
    inputs = [x.detach().requires_grad_(w) for x, w in zip((qp, kp, q, k, v), wants)]
    perms, sorts, real = [], [], worklist.lists

    def recording(idx, *a, **kw):
        sorted_lists = real(idx, *a, **kw)
        perms.append(weakref.ref(sorted_lists.perm))
        sorts.append(idx.shape[0])
        return sorted_lists

    monkeypatch.setattr(worklist, "lists", recording)
    out, kl = flash_msa.msa_attention(
        *inputs, s["top_k"], block_size=s["block"], cu_seqlens=cu,
        max_seqlen=max(s["lengths"]), deterministic=det,
    )  # fmt: skip
    gc.collect()
    kept = perms[0]() is not None
    del sorts[:]
    testing.training_loss(out, kl, s["Hp"] * q.shape[0]).backward()
    return kept, sorts


def test_forward_keeps_no_lists_for_a_chunked_deterministic_backward(monkeypatch):
    """The forward runs in one chunk, the deterministic backward in four (its partial budget
    cut to ~40 rows, as anchor 16K is cut to 8192 rows): it sorts each chunk, so the forward's
    lists held until then are dead weight."""
    monkeypatch.setattr(ordered, "PARTIAL_BYTES", 40 * 4 * 2 * 16 * 4)  # 40 rows of H K D fp32
    kept, sorts = _forward_keeps_lists(monkeypatch, det=True, main_grad=True)
    assert sorts[-4:] == [40, 40, 40, 10]  # the backward sorted every chunk itself
    assert not kept


def test_forward_keeps_no_lists_for_a_proxy_only_step(monkeypatch):
    """Only the proxy requires grad: the Triton forward's KL pass makes the unit proxy
    gradient, the backward only scales it (no work list), so nothing should be kept."""
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=False)
    assert sorts == []
    assert not kept


def test_full_step_keeps_the_lists_and_its_backward_sorts_nothing(monkeypatch):
    """The control: a full step keeps the lists and its backward sorts nothing."""
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=True)
    assert kept and sorts == []
    monkeypatch.setattr(sparse_forward, "keeps", lambda *a: False)  # the rule decides
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=True)
    assert not kept and sorts == [130]


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


def test_driver_kl_sum_needs_no_zero_fill(monkeypatch):
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


def test_remembered_reasons_equal_fresh_ones(monkeypatch):
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


MARKS_GPU_CUTE_WORKLIST = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


@pytest.fixture
def ws(monkeypatch):
    """The module, with every ``torch.empty`` buffer poisoned and each launch recorded in
    ``ws.launches`` (kernel class names)."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import worklist_host

    launches = []
    real_run = worklist_host.run_typed

    def run(kernel, device, args, signature, ffi=None):
        launches.append(type(kernel).__name__)
        real_run(kernel, device, args, signature, ffi)

    monkeypatch.setattr(worklist_host, "run_typed", run)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    monkeypatch.setattr(worklist_host, "launches", launches, raising=False)
    return worklist_host


def _lengths(N, block, nb_mod4, seed):
    """N random sequence lengths (0 .. 3 blocks, ~15% zero), the last one grown by whole blocks
    until ``NB % 4 == 0`` (``nb_mod4``) or not."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3 * block + 1, (N,), generator=g)
    lengths[torch.rand(N, generator=g) < 0.15] = 0
    lengths = lengths.tolist()
    while ((sum(lengths) // block + N) % 4 == 0) != nb_mod4:
        lengths[-1] += block
    return lengths


@marked(MARKS_GPU_CUTE_WORKLIST)
@pytest.mark.parametrize("nb_mod4", [True, False], ids=["NB%4=0", "NB%4!=0"])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("N", [1, 2, 7, 300, 3000])
def test_blocks_equal_torch(ws, N, block, nb_mod4):
    lengths = _lengths(N, block, nb_mod4, seed=N * block + nb_mod4)
    cu = testing.cu(lengths, "cuda")
    T = sum(lengths)
    assert ws.can_implement_blocks(cu, block, T) is None
    mine = ws.blocks(cu, block, T)
    assert ws.launches == ["BlocksSm90"]
    same_blocks(mine, worklist.blocks(cu, block, T))
    # a larger key count (total_tokens past the sequences: NB grows, the blocks past are [0, 0))
    more = T + 5 * block + 3
    same_blocks(ws.blocks(cu, block, more), worklist.blocks(cu, block, more))


# (lengths, Hs, K, block): one token; short and zero-length sequences; 7 sequences; one of
# 70000 tokens (block 64: ~700 entries per list, several items each); paper 128K's layout
ITEM_CASES = [
    ([1], 1, 1, 64),
    ([300], 2, 3, 64),
    ([0, 130, 1, 257, 0], 3, 5, 128),
    ([900, 13, 0, 2048, 77, 640, 1], 4, 16, 64),
    ([70000], 4, 16, 64),
    ([131072], 4, 16, 128),
]


def _case(lengths, Hs, K, block, seed):
    cu, idx = random_rows(lengths, Hs, K, block, None, seed)
    return cu.cuda(), idx.cuda()


@marked(MARKS_GPU_CUTE_WORKLIST)
@pytest.mark.parametrize("case", ITEM_CASES, ids=lambda c: f"T{sum(c[0])}-Hs{c[1]}-K{c[2]}-b{c[3]}")
def test_lists_and_items_equal_torch(ws, case):
    lengths, Hs, K, block = case
    cu, idx = _case(lengths, Hs, K, block, sum(lengths) + Hs * K)
    T = sum(lengths)
    ref = worklist.lists(idx, cu, block)
    assert ws.can_implement_lists(idx, cu, block) is None
    mine = ws.lists(idx, cu, block)
    assert ws.launches == ["BlocksSm90", "ListKeysSm90", "ListBoundsSm90"]
    same_lists(mine, ref)
    for TW in (128, 256):
        assert ws.can_implement_items(ref, TW) is None
        same_items(ws.items(ref, TW), worklist.items(ref, TW))
    assert ws.launches[3:] == ["ItemEndsSm90", "ItemsSm90"] * 2
    # rows tok0 .. of a batch of T tokens, with given key blocks
    tok0 = T // 3
    kb = worklist.blocks(cu, block, T)
    same_lists(
        ws.lists(idx[tok0:], cu, block, tok0, T, key_blocks=kb),
        worklist.lists(idx[tok0:], cu, block, tok0, T, key_blocks=kb),
    )


@marked(MARKS_GPU_CUTE_WORKLIST)
def test_items_of_long_and_empty_lists(ws):
    """Lists of hundreds of items (two slots of every token on block 0), and every list empty
    (all slots unused: only the empty items ``[0, 0)`` of list ``L - 1``); TW 1 too."""
    cu, idx = _case([20000, 3000], 2, 8, 128, 7)
    idx[:, :, :2] = 0
    sl = worklist.lists(idx, cu, 128)
    assert int((sl.bounds[1] - sl.bounds[0]).item()) >= 2 * 20000
    for TW in (1, 128, 256):
        same_items(ws.items(sl, TW), worklist.items(sl, TW))
    empty = worklist.lists(torch.full_like(idx, -1), cu, 128)
    for TW in (128, 256):
        same_items(ws.items(empty, TW), worklist.items(empty, TW))
    assert ws.launches == ["ItemEndsSm90", "ItemsSm90"] * 5


@marked(MARKS_GPU_CUTE_WORKLIST)
def test_cuda_graph_capture_and_replay_on_new_inputs():
    """``blocks`` -> ``lists`` -> ``items`` (TW 256 and 128) captured in one CUDA graph (a host
    sync would fail the capture), replayed after the indices and the sequence bounds change in
    place: the torch functions' results on the new inputs."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import worklist_host as ws

    lengths, Hs, K, block = [3000, 0, 1000, 17], 4, 16, 128
    cu, idx = _case(lengths, Hs, K, block, 11)
    T = sum(lengths)

    def build():
        kb = ws.blocks(cu, block, T)
        sl = ws.lists(idx, cu, block, key_blocks=kb)
        return kb, sl, ws.items(sl, 256), ws.items(sl, 128)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        build()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kb, sl, wl256, wl128 = build()
    for seed in (12, 13):
        new_cu, new_idx = _case([2000, 1500, 0, 517], Hs, K, block, seed)  # same T and N
        cu.copy_(new_cu)
        idx.copy_(new_idx)
        graph.replay()
        torch.cuda.synchronize()
        ref_kb = worklist.blocks(cu, block, T)
        ref = worklist.lists(idx, cu, block, key_blocks=ref_kb)
        same_blocks(kb, ref_kb)
        same_lists(sl, ref)
        same_items(wl256, worklist.items(ref, 256))
        same_items(wl128, worklist.items(ref, 128))
