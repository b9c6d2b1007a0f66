"""GPU tests of the CuTe work-list build (``flash_msa/cute/worklist_sm90.py``) on Hopper: its
``blocks``, ``items`` and ``lists`` equal ``flash_msa.worklist``'s torch functions bit for bit on
fresh random inputs (1 to 3000 sequences of random lengths, zero-length ones among them, block
64 and 128, NB a multiple of 4 and not; selections of 1 to 4 heads of 1 to 16 slots over 1 to
131072 tokens, TW 128 and 256, lists of many items and empty lists), with every new buffer
NaN/int-poisoned (a kernel that leaves an element unwritten fails) and the kernels' launches
counted (the CuTe path ran, not the fallback); and the three captured in one CUDA graph (no host
sync), replayed on changed inputs."""

from __future__ import annotations

import pytest
import torch

from flash_msa import testing, worklist
from harness import random_rows
from test_cute_worklist_cpu import _same_blocks, _same_items, _same_lists

pytestmark = [
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
    from flash_msa.cute import worklist_sm90

    launches = []
    real_run = worklist_sm90.run_typed

    def run(kernel, device, args, signature, ffi=None):
        launches.append(type(kernel).__name__)
        real_run(kernel, device, args, signature, ffi)

    monkeypatch.setattr(worklist_sm90, "run_typed", run)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    monkeypatch.setattr(worklist_sm90, "launches", launches, raising=False)
    return worklist_sm90


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
    _same_blocks(mine, worklist.blocks(cu, block, T))
    # a larger key count (total_tokens past the sequences: NB grows, the blocks past are [0, 0))
    more = T + 5 * block + 3
    _same_blocks(ws.blocks(cu, block, more), worklist.blocks(cu, block, more))


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


@pytest.mark.parametrize("case", ITEM_CASES, ids=lambda c: f"T{sum(c[0])}-Hs{c[1]}-K{c[2]}-b{c[3]}")
def test_lists_and_items_equal_torch(ws, case):
    lengths, Hs, K, block = case
    cu, idx = _case(lengths, Hs, K, block, sum(lengths) + Hs * K)
    T = sum(lengths)
    ref = worklist.lists(idx, cu, block)
    assert ws.can_implement_lists(idx, cu, block) is None
    mine = ws.lists(idx, cu, block)
    assert ws.launches == ["BlocksSm90", "ListKeysSm90", "ListBoundsSm90"]
    _same_lists(mine, ref)
    for TW in (128, 256):
        assert ws.can_implement_items(ref, TW) is None
        _same_items(ws.items(ref, TW), worklist.items(ref, TW))
    assert ws.launches[3:] == ["ItemEndsSm90", "ItemsSm90"] * 2
    # rows tok0 .. of a batch of T tokens, with given key blocks
    tok0 = T // 3
    kb = worklist.blocks(cu, block, T)
    _same_lists(
        ws.lists(idx[tok0:], cu, block, tok0, T, key_blocks=kb),
        worklist.lists(idx[tok0:], cu, block, tok0, T, key_blocks=kb),
    )


def test_items_of_long_and_empty_lists(ws):
    """Lists of hundreds of items (two slots of every token on block 0), and every list empty
    (all slots unused: only the empty items ``[0, 0)`` of list ``L - 1``); TW 1 too."""
    cu, idx = _case([20000, 3000], 2, 8, 128, 7)
    idx[:, :, :2] = 0
    sl = worklist.lists(idx, cu, 128)
    assert int((sl.bounds[1] - sl.bounds[0]).item()) >= 2 * 20000
    for TW in (1, 128, 256):
        _same_items(ws.items(sl, TW), worklist.items(sl, TW))
    empty = worklist.lists(torch.full_like(idx, -1), cu, 128)
    for TW in (128, 256):
        _same_items(ws.items(empty, TW), worklist.items(empty, TW))
    assert ws.launches == ["ItemEndsSm90", "ItemsSm90"] * 5


def test_cuda_graph_capture_and_replay_on_new_inputs():
    """``blocks`` -> ``lists`` -> ``items`` (TW 256 and 128) captured in one CUDA graph (a host
    sync would fail the capture), replayed after the indices and the sequence bounds change in
    place: the torch functions' results on the new inputs."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import worklist_sm90 as ws

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
        _same_blocks(kb, ref_kb)
        _same_lists(sl, ref)
        _same_items(wl256, worklist.items(ref, 256))
        _same_items(wl128, worklist.items(ref, 128))
