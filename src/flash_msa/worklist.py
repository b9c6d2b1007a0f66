"""The reverse index: key block -> the (query token, slot) entries that selected it.

Block-sparse attention with per-token selections is re-parameterized as variable-length
attention: for every (selection head p, key block) the list of query tokens that kept the block,
split into work items of at most ``TW`` tokens. A kernel program owns one work item: it loads its
key block once and streams the item's queries, so every MMA row does useful work whatever the
selection's overlap between neighbouring queries.

Built with a handful of torch ops on fixed-size tensors (upper bounds known from ``T``, ``N``
and the block size): no host synchronization, CUDA-graph capturable, deterministic (a stable
sort keeps each list in token order).

Backend-neutral: both backends' forward and backward kernels walk these lists (the Triton
kernels and the CuTe kernels read the same six tensors), and :func:`geometry` says how a work
item's main heads are packed into MMA rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ITEM_TOKENS = 256  # tokens per work item: K/V (and dK/dV) stay on chip over them


def geometry(H: int, Hkv: int, Hs: int, rows: int) -> tuple[int, int, int, int]:
    """``(G, G2, R, BT)`` for MMA tiles of about ``rows`` rows.

    G main heads share a selection head; they are visited in R sub-groups of G2 heads that share
    one KV head (G2 <= rows / 16); a tile holds BT >= 16 tokens x G2 heads (BM = BT * G2).
    """
    G = H // Hs
    G2 = min(H // max(Hs, Hkv), rows // 16)
    return G, G2, G // G2, max(16, rows // G2)


class WorkList(NamedTuple):
    perm: torch.Tensor  # [T*Hs*K] int64: flat (token, head, slot) entries sorted by list
    item_list: torch.Tensor  # [W] int32: list id = p * NB + global block, of each work item
    item_start: torch.Tensor  # [W] int64: first entry (into perm) of the item
    item_end: torch.Tensor  # [W] int64: one past its last entry (== start: empty item)
    block_start: torch.Tensor  # [NB] int32: first token (packed) of each global block
    block_end: torch.Tensor  # [NB] int32: one past its last token
    num_blocks: int  # NB: upper bound on the number of global key blocks
    num_items: int  # W: upper bound on the number of work items
    slots: int  # K: index slots per (token, head)
    heads: int  # Hs: selection heads


def build(
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    TW: int,
    tok0: int = 0,
    total_tokens: int | None = None,
) -> WorkList:
    """Reverse index of ``indices`` ``(C, Hs, K)`` (sequence-local blocks, -1 unused): the rows
    of packed tokens ``[tok0, tok0 + C)`` of a ``total_tokens``-token batch (default: all).
    ``perm`` holds flat entries of the whole batch: ``token * Hs * K + head * K + slot``."""
    T, Hs, K = indices.shape
    total = T if total_tokens is None else total_tokens
    dev = indices.device
    N = cu_seqlens.numel() - 1
    NB = total // block_size + N  # sum over sequences of ceil(len / b) never exceeds this
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    nblk = (lens + block_size - 1) // block_size  # [N]
    blk_end_cum = nblk.cumsum(0)
    blk_first = blk_end_cum - nblk  # [N] global id of each sequence's block 0

    # global blocks -> token ranges
    gb = torch.arange(NB, device=dev)
    seq_of_gb = torch.searchsorted(blk_end_cum, gb, right=True).clamp_max(N - 1)
    local = gb - blk_first[seq_of_gb]
    start = cu[seq_of_gb] + local * block_size
    end = torch.minimum(start + block_size, cu[seq_of_gb + 1])
    valid_gb = gb < blk_end_cum[-1]
    block_start = torch.where(valid_gb, start, 0).to(torch.int32)
    block_end = torch.where(valid_gb, end, 0).to(torch.int32)

    # entries -> list keys, stable-sorted (token order inside each list)
    tok = torch.arange(tok0, tok0 + T, device=dev)
    seq_of_tok = torch.searchsorted(cu[1:], tok, right=True)
    idx = indices.long()
    head = torch.arange(Hs, device=dev)[None, :, None]
    key = head * NB + blk_first[seq_of_tok][:, None, None] + idx
    key = torch.where(idx >= 0, key, Hs * NB).flatten()  # unused slots sort last
    perm = torch.sort(key, stable=True).indices + tok0 * Hs * K
    counts = torch.zeros(Hs * NB + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:-1]
    list_start = counts.cumsum(0) - counts

    # lists -> work items of at most TW entries
    items = (counts + TW - 1) // TW
    items_end = items.cumsum(0)
    W = (T * Hs * K) // TW + Hs * NB  # >= sum(ceil(count / TW))
    w = torch.arange(W, device=dev)
    lst = torch.searchsorted(items_end, w, right=True)
    ok = lst < Hs * NB
    lst_c = lst.clamp_max(Hs * NB - 1)
    first = list_start[lst_c] + (w - (items_end[lst_c] - items[lst_c])) * TW
    last = torch.minimum(first + TW, list_start[lst_c] + counts[lst_c])
    item_start = torch.where(ok, first, 0)  # int64: T * Hs * K can pass 2**31 at long context
    item_end = torch.where(ok, last, 0)
    return WorkList(
        perm, lst_c.to(torch.int32), item_start, item_end, block_start, block_end, NB, W, K, Hs
    )
