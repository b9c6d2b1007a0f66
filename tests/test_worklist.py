"""CPU tests of the work list (``flash_msa/worklist.py``): the reverse index covers every used
(token, head, slot) entry once, items stay within their size and one list, and
``split_items`` cuts items without losing, repeating or reordering entries."""

from __future__ import annotations

import pytest
import torch

from flash_msa import worklist


def _items(wl):
    """``[(list, [entries...])]`` of the non-empty items, in item order."""
    out = []
    for lst, s, e in zip(wl.item_list.tolist(), wl.item_start.tolist(), wl.item_end.tolist()):
        if e > s:
            out.append((lst, wl.perm[s:e].tolist()))
    return out


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
