"""CPU checks of the CuTe work-list build (``flash_msa/cute/worklist_host.py``: ``blocks``,
``items`` and ``lists`` by the kernels of ``cute/worklist_sm90.py``, bitwise
``flash_msa.worklist``'s; the kernels themselves run in tests/ops/test_worklist.py): every
configuration compiles for sm_90a without spills, the reasons to fall back to torch, the
refusals of bad arguments naming them, the launch's arguments, the CPU path (torch's result),
and the host path end to end with each launch replaced by a Python replay of its kernel (the
same index math, block scan and binary searches, thread by thread, run on the buffers at the
launch's addresses) against the torch functions bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from flash_msa import testing, worklist
from harness import random_rows, same_blocks, same_items, same_lists

cutlass = pytest.importorskip("cutlass")


def _module():
    from flash_msa.cute import worklist_host

    return worklist_host


def _kernels():
    from flash_msa.cute import worklist_sm90

    return worklist_sm90


def test_configurations_compile_for_sm90_without_spills(tmp_path):
    ws = _module()
    from flash_msa.cute import compile_check as cc

    cfgs = list(cc.worklist_configurations())
    names = [name for name, *_ in cfgs]
    assert len(names) == len(set(names)) == len(cc.WORKLIST_KERNELS)
    for name, kind in cfgs:
        res = cc.compile_worklist(kind, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0, (name, res)  # spills show up as stack
        ptx = open(tmp_path / f"{name.replace(' ', '_')}.ptx").read()
        # the one-CTA scans: two barriers per tile (the block scan), one before the searches
        bars = {"blocks": 3, "item_ends": 2}.get(kind, 0)
        assert ptx.count("bar.sync") == bars, name
        assert ("shfl.sync.up" in ptx) == (bars > 0), name


def test_kernel_objects_and_limits():
    ws, wk = _module(), _kernels()
    assert wk.BlocksSm90() == ws.BLOCKS and hash(wk.BlocksSm90()) != hash(wk.BlocksSm90(512))
    for cls in (wk.BlocksSm90, wk.ItemEndsSm90, wk.ItemsSm90, wk.ListKeysSm90, wk.ListBoundsSm90):
        with pytest.raises(ValueError, match="threads"):
            cls(threads=100)
    with pytest.raises(ValueError, match="per_thread"):
        wk.ItemEndsSm90(per_thread=3)


def test_worklist_arguments():
    """Typed pointers at the given addresses (aligned to their element), Int32 counts, the
    stream last; a wrong count of values raises."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64

    ws = _module()
    strm = cuda.CUstream(0)
    args = ws.worklist_arguments(ws.ITEMS, 16, 32, 48, 64, 80, 5, 6, 7, 128, strm)
    assert [int(p._pointer) for p in args[:5]] == [16, 32, 48, 64, 80]
    assert [p.dtype for p in args[:5]] == [Int64, Int32, Int32, Int64, Int64]
    assert all(isinstance(c, Int32) for c in args[5:9]) and [int(c) for c in args[5:9]] == [
        5, 6, 7, 128,
    ]  # fmt: skip
    assert args[-1] is strm
    with pytest.raises(TypeError, match="addresses"):
        ws.worklist_arguments(ws.BLOCKS, 16, 32, strm)


def _cu(lengths):
    return testing.cu(lengths)


def test_fallback_reasons():
    ws = _module()
    cu = _cu([100, 0, 300])
    # CPU tensors: well-formed calls fall back for the device alone
    assert "CUDA" in ws.can_implement_blocks(cu, 128, 400)
    assert "int32" in ws.can_implement_blocks(cu.long(), 128, 400)
    assert "contiguous" in ws.can_implement_blocks(torch.zeros(8, dtype=torch.int32)[::2], 64, 0)
    assert "int64" in ws.can_implement_blocks(cu, 128, 2**31 - 1)  # worklist's wide path
    assert ws.can_implement_blocks(cu, 1, 2**30) is not None
    idx = random_rows([100, 0, 300], 2, 3, 64, None, 0)[1]
    sl = worklist.lists(idx, cu, 64)
    assert "CUDA" in ws.can_implement_items(sl, 128)
    assert "int64" in ws.can_implement_items(sl._replace(bounds=sl.bounds.int()), 128)
    assert "(L + 1,)" in ws.can_implement_items(sl._replace(bounds=sl.bounds[:-1]), 128)
    assert "exceed" in ws.can_implement_items(sl, 2**31)
    assert "chunk" in ws.can_implement_lists(idx, cu, 64, chunk=100)
    assert "q_map" in ws.can_implement_lists(idx, cu, 64, q_map=torch.zeros(400, dtype=torch.int32))
    assert "int32" in ws.can_implement_lists(idx.long(), cu, 64)
    assert "int32" in ws.can_implement_lists(idx, cu.long(), 64)
    kb = worklist.blocks(cu, 64, 400)
    assert "seq_first" in ws.can_implement_lists(
        idx, cu, 64, key_blocks=kb._replace(seq_first=kb.seq_first.long())
    )
    assert "CUDA" in ws.can_implement_lists(idx, cu, 64, key_blocks=kb)


def test_bad_arguments_raise_naming_them():
    ws = _module()
    cu = _cu([100, 300])
    cases = [
        ("cu_seqlens", lambda: ws.blocks(cu[None], 64, 400)),
        ("cu_seqlens", lambda: ws.blocks(cu[:1], 64, 400)),
        ("cu_seqlens", lambda: ws.blocks(cu.float(), 64, 400)),
        ("cu_seqlens", lambda: ws.blocks(cu.tolist(), 64, 400)),
        ("block_size", lambda: ws.blocks(cu, 0, 400)),
        ("total_tokens", lambda: ws.blocks(cu, 64, -1)),
        ("indices", lambda: ws.lists(torch.zeros(400, 4, dtype=torch.int32), cu, 64)),
        ("tok0", lambda: ws.lists(torch.zeros(4, 1, 1, dtype=torch.int32), cu, 64, tok0=-1)),
        ("chunk", lambda: ws.lists(torch.zeros(4, 1, 1, dtype=torch.int32), cu, 64, chunk=0)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    sl = worklist.lists(torch.zeros(400, 1, 1, dtype=torch.int32), cu, 64)
    for TW in (0, -3, 1.5):
        with pytest.raises(ValueError, match="TW"):
            ws.items(sl, TW)
    with pytest.raises(TypeError, match="sorted_lists"):
        ws.items(tuple(sl), 128)


def test_cpu_falls_back_to_torch():
    """CPU tensors: the torch functions' results."""
    ws = _module()
    lengths = [130, 0, 1, 257]
    cu, idx = random_rows(lengths, 2, 4, 64, None, 1)
    same_blocks(ws.blocks(cu, 64, 388), worklist.blocks(cu, 64, 388))
    sl = ws.lists(idx, cu, 64)
    same_lists(sl, worklist.lists(idx, cu, 64))
    same_items(ws.items(sl, 128), worklist.items(sl, 128))


# ---------------------------------------------------------------------------------------------
# the host path with each launch replayed in Python
# ---------------------------------------------------------------------------------------------
def _at(pointer, n):
    """The ``n`` elements at ``pointer``'s host address (a CPU tensor's storage) as numpy."""
    ct = {4: ctypes.c_int32, 8: ctypes.c_int64}[pointer.dtype.width // 8]
    return np.ctypeslib.as_array(ctypes.cast(int(pointer._pointer), ctypes.POINTER(ct)), (n,))


def _warp_scan(v):
    """``_warp_scan``: shfl.up by 1, 2, 4, 8, 16, lanes below the offset add 0."""
    for off in (1, 2, 4, 8, 16):
        v = [v[lane] + (v[lane - off] if lane >= off else 0) for lane in range(32)]
    return v


def _block_scan(xs, NT):
    """``_block_scan`` of the NT threads' values: per thread its inclusive sum, and the total."""
    NW = NT // 32
    incl = [_warp_scan(xs[w * 32 : w * 32 + 32]) for w in range(NW)]
    scan = _warp_scan([incl[w][31] for w in range(NW)] + [0] * (32 - NW))
    out = [(scan[w - 1] if w else 0) + incl[w][lane] for w in range(NW) for lane in range(32)]
    return out, scan[NW - 1]


def _last_at_most(m, hi, v):
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        lo, hi = (mid, hi) if m[mid] <= v else (lo, mid - 1)
    return lo


def _count_below(m, n, v, strict):
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        below = m[mid] < v if strict else m[mid] <= v
        lo, hi = (mid + 1, hi) if below else (lo, mid)
    return lo


def _replay(kernel, device, args, signature):
    """A launch of ``kernel`` done in Python, thread by thread, on the buffers at its
    addresses (CPU tensors' storage)."""
    ws, wk = _module(), _kernels()
    assert signature == ws.WORKLIST_SIGNATURE
    n = len(kernel.POINTERS)
    p, c = args[:n], [int(x) for x in args[n:-1]]
    NT = kernel.threads
    if isinstance(kernel, wk.BlocksSm90):
        N, NB, b = c
        cu, start, end, first = _at(p[0], N + 1), _at(p[1], NB), _at(p[2], NB), _at(p[3], N)
        total = 0
        for base in range(0, N, NT):
            ns = [(int(cu[s + 1]) - int(cu[s]) + b - 1) // b if s < N else 0
                  for s in range(base, base + NT)]  # fmt: skip
            upto, tile = _block_scan(ns, NT)
            for t in range(min(NT, N - base)):
                first[base + t] = total + upto[t] - ns[t]
            total += tile
        for g in range(NB):
            s = _last_at_most(first, N - 1, g)
            st = int(cu[s]) + (g - int(first[s])) * b if g < total else 0
            start[g], end[g] = st, min(st + b, int(cu[s + 1])) if g < total else 0
    elif isinstance(kernel, wk.ItemEndsSm90):
        L, tw = c
        V = kernel.per_thread
        bounds, ends = _at(p[0], L + 1), _at(p[1], L)
        total = 0
        for base in range(0, L, NT * V):
            ups, accs = [], []
            for t in range(NT):
                l0 = base + t * V
                bv = [int(bounds[min(l0 + j, L)]) for j in range(V + 1)]
                up = list(np.cumsum([(bv[j + 1] - bv[j] + tw - 1) // tw for j in range(V)]))
                ups.append(up)
                accs.append(up[-1])
            incl, tile = _block_scan(accs, NT)
            for t in range(NT):
                for j in range(V):
                    if base + t * V + j < L:
                        ends[base + t * V + j] = total + incl[t] - accs[t] + ups[t][j]
            total += tile
    elif isinstance(kernel, wk.ItemsSm90):
        L, W, Wp, tw = c
        bounds, ends, lst = _at(p[0], L + 1), _at(p[1], L), _at(p[2], W)
        start, end = _at(p[3], Wp), _at(p[4], Wp)
        for w in range(Wp):
            li = _count_below(ends, L, w, False)
            base = int(bounds[li]) - int(ends[li - 1]) * tw if li > 0 else 0
            e = int(bounds[li + 1]) if li < L else 0
            start[w], end[w] = min(base + w * tw, e), min(base + (w + 1) * tw, e)
            if w < W:
                lst[w] = min(li, L - 1)
    elif isinstance(kernel, wk.ListKeysSm90):
        E, row, slots, N, NB, L, tok0 = c
        idx, cu, first, key = _at(p[0], E), _at(p[1], N + 1), _at(p[2], N), _at(p[3], E)
        for e in range(E):
            r, h = e // row, (e % row) // slots
            s = _last_at_most(cu, N - 1, tok0 + r)
            key[e] = h * NB + int(first[s]) + int(idx[e]) if idx[e] >= 0 else L
    else:
        assert isinstance(kernel, wk.ListBoundsSm90)
        E, L = c
        key, bounds = _at(p[0], E), _at(p[1], L + 1)
        for lst in range(L + 1):
            bounds[lst] = _count_below(key, E, lst, True)


@pytest.fixture
def replayed(monkeypatch):
    """The module with CPU tensors accepted, every launch replayed in Python (counted in the
    returned list) and every ``torch.empty`` buffer poisoned first."""
    ws = _module()
    launches = []

    def run(kernel, device, args, signature, ffi=None):
        from flash_msa.cute import launch

        # the TVM-FFI call's values the launch hands over are the typed arguments' conversion
        args = args()  # (the typed arguments, built for the compile only)
        assert ffi == launch.ffi_args(args), (type(kernel).__name__, ffi)
        launches.append(type(kernel).__name__)
        _replay(kernel, device, args, signature)

    monkeypatch.setattr(ws, "_device_reason", lambda device: None)
    monkeypatch.setattr(ws, "run_typed", run)
    from flash_msa.cute import launch

    monkeypatch.setattr(ws, "stream", lambda device: launch.RawStream(0))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    return ws, launches


@pytest.mark.parametrize(
    "lengths, block",
    [([1], 64), ([300], 128), ([0, 130, 1, 257, 0], 64), ([5] * 40 + [0] * 3 + [200], 64)],
)
def test_blocks_replayed_equal_torch(replayed, lengths, block):
    ws, launches = replayed
    cu = _cu(lengths)
    for total in (sum(lengths), sum(lengths) + 3 * block + 5):
        same_blocks(ws.blocks(cu, block, total), worklist.blocks(cu, block, total))
    assert launches == ["BlocksSm90"] * 2


def test_blocks_replayed_more_sequences_than_threads(replayed):
    """N past one tile of the scan (1024 threads): the carry between tiles."""
    ws, _ = replayed
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 300, (2500,), generator=g)
    lengths[torch.rand(2500, generator=g) < 0.2] = 0
    cu = _cu(lengths.tolist())
    T = int(cu[-1])
    same_blocks(ws.blocks(cu, 128, T), worklist.blocks(cu, 128, T))


@pytest.mark.parametrize(
    "lengths, Hs, K, block",
    [([300], 1, 1, 64), ([0, 130, 1, 257, 0], 2, 4, 64), ([700, 33], 3, 5, 128)],
)
@pytest.mark.parametrize("TW", [1, 7, 128, 256])
def test_items_replayed_equal_torch(replayed, lengths, Hs, K, block, TW):
    ws, launches = replayed
    cu, idx = random_rows(lengths, Hs, K, block, None, sum(lengths) + TW)
    sl = worklist.lists(idx, cu, block)
    same_items(ws.items(sl, TW), worklist.items(sl, TW))
    empty = worklist.lists(torch.full_like(idx, -1), cu, block)  # every list empty
    same_items(ws.items(empty, TW), worklist.items(empty, TW))
    assert launches == ["ItemEndsSm90", "ItemsSm90"] * 2


def test_lists_without_entries_launch_no_bounds_kernel(replayed):
    """No rows (E = 0): the bounds are zeros made on the host, as ``worklist.lists``' search
    gives them; neither list kernel is launched (the empty key buffer's address may be null)."""
    ws, launches = replayed
    cu = torch.tensor([0, 300, 420], dtype=torch.int32)
    idx = torch.empty((0, 3, 5), dtype=torch.int32)
    for tok0 in (0, 300):
        same_lists(ws.lists(idx, cu, 64, tok0, 420), worklist.lists(idx, cu, 64, tok0, 420))
    assert "ListBoundsSm90" not in launches and "ListKeysSm90" not in launches, launches


def test_items_replayed_many_lists(replayed):
    """More lists than one tile of the scan (1024 threads x 4), lists of several items."""
    ws, _ = replayed
    cu, idx = random_rows([6000], 2, 8, 64, None, 5)
    idx[:3000, :, :4] = 0  # list 0 of each head: thousands of entries
    sl = worklist.lists(idx, cu, 64, total_tokens=6000 * 30)  # NB 2813 + 1: L 5628
    assert sl.heads * sl.num_blocks > 4096
    same_items(ws.items(sl, 128), worklist.items(sl, 128))


@pytest.mark.parametrize(
    "lengths, Hs, K, block, tok0",
    [([300], 2, 3, 64, 0), ([0, 130, 1, 257, 0], 2, 4, 64, 7), ([100, 0, 50], 1, 1, 128, 0)],
)
def test_lists_replayed_equal_torch(replayed, lengths, Hs, K, block, tok0):
    ws, launches = replayed
    T = sum(lengths)
    cu, idx = random_rows(lengths, Hs, K, block, None, T + K)
    rows = idx[tok0:]
    same_lists(ws.lists(rows, cu, block, tok0, T), worklist.lists(rows, cu, block, tok0, T))
    kb = worklist.blocks(cu, block, T)
    mine = ws.lists(idx, cu, block, key_blocks=kb)
    same_lists(mine, worklist.lists(idx, cu, block, key_blocks=kb))
    assert mine.block_start is kb.start
    assert launches == ["BlocksSm90", "ListKeysSm90", "ListBoundsSm90"] + [
        "ListKeysSm90", "ListBoundsSm90",
    ]  # fmt: skip
