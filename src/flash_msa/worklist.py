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

With a query map (``q_map``, context parallelism: docs/distributed.md) the entries stay keyed
by query row, and only the row's sequence comes from its token ``q_map[row]`` (a padding row,
``-1``, has no entries); the list carries the map (``WorkList.q_map``) for the kernels, which
take a query's causal position from it. :func:`query_order` groups query rows by sequence for
the selection kernel, and :func:`drop_padding_rows` clears the indices of padding rows.
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
    # (Tq,) int32 or None: the query map of the call (query row -> packed key token, -1 for a
    # padding row); entries (``perm``) count query rows, blocks (``block_*``) key tokens
    q_map: torch.Tensor | None = None
    item_tokens: int = 0  # TW: the most entries an item holds (build's argument)


def build(
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    TW: int,
    tok0: int = 0,
    total_tokens: int | None = None,
    q_map: torch.Tensor | None = None,
) -> WorkList:
    """Reverse index of ``indices`` ``(C, Hs, K)`` (sequence-local blocks, -1 unused): the rows
    of packed tokens ``[tok0, tok0 + C)`` of a ``total_tokens``-token batch (default: all).
    ``perm`` holds flat entries of the whole batch: ``token * Hs * K + head * K + slot``.

    With ``q_map`` (``(Tq,)`` int32, the whole call's map) the rows ``[tok0, tok0 + C)`` are
    query rows, whose sequences come from their tokens ``q_map[row]``; ``total_tokens`` must
    then be the keys' ``T`` (it bounds the number of key blocks). Padding rows (``-1``) get no
    entries whatever their indices."""
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
    idx = indices.long()
    if q_map is not None:  # the row's token among the keys; a padding row: every slot unused
        tok = q_map[tok0 : tok0 + T].long()
        idx = torch.where(tok[:, None, None] >= 0, idx, -1)
    seq_of_tok = torch.searchsorted(cu[1:], tok, right=True)
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
        perm, lst_c.to(torch.int32), item_start, item_end, block_start, block_end, NB, W, K, Hs,
        q_map, TW,
    )  # fmt: skip


def split_items(wl: WorkList, size: int) -> WorkList:
    """``wl`` with each item (at most ``wl.item_tokens`` entries) cut into ``ceil(item_tokens /
    size)`` items of at most ``size`` entries, in order (empty ones where an item was shorter):
    for a kernel whose items hold fewer tokens than the driver's (the CuTe KL stage: 128 per
    item). On the device, no host sync."""
    f = -(-wl.item_tokens // size)
    if f == 1:
        return wl
    dev = wl.item_start.device
    part = torch.arange(f, device=dev).repeat(wl.num_items) * size
    start = wl.item_start.repeat_interleave(f)
    end = wl.item_end.repeat_interleave(f)
    first = torch.minimum(start + part, end)
    return wl._replace(
        item_list=wl.item_list.repeat_interleave(f),
        item_start=first,
        item_end=torch.minimum(first + size, end),
        num_items=wl.num_items * f,
        item_tokens=min(size, wl.item_tokens),
    )


def drop_padding_rows(indices: torch.Tensor, q_map: torch.Tensor | None) -> torch.Tensor:
    """``indices`` ``(C, Hs, K)`` with every slot of a padding row (``q_map == -1``, ``q_map``
    the same ``C`` rows' map) set to ``-1`` (unused), as the contract reads them: such a row has
    no keys whatever its indices say (the selection writes ``-1`` there already; this is for
    kernels that read a chunk's indices directly, e.g. the forward's combine). ``indices``
    itself without a map. (``build`` drops those entries itself.)"""
    if q_map is None:
        return indices
    return torch.where(q_map[:, None, None] >= 0, indices, -1)


class QueryOrder(NamedTuple):
    rows: torch.Tensor  # [Tq] int32: query rows sorted by their token (padding rows last)
    seq_start: torch.Tensor  # [N+1] int32: sequence n's rows are rows[seq_start[n]:seq_start[n+1]]


def query_order(q_map: torch.Tensor, cu_seqlens: torch.Tensor, total_tokens: int) -> QueryOrder:
    """Query rows grouped by sequence, for a kernel whose programs own a sequence's run of
    queries (the selection): rows sorted by their token ``q_map[row]`` (so within a sequence by
    position), padding rows (``-1``) after every sequence. ``total_tokens``: the keys' ``T``.
    Device ops only (no host synchronization)."""
    tokens = torch.where(q_map >= 0, q_map, total_tokens)  # padding rows sort last
    tokens, rows = torch.sort(tokens, stable=True)
    seq_start = torch.searchsorted(tokens, cu_seqlens.to(tokens.dtype), out_int32=True)
    return QueryOrder(rows.to(torch.int32), seq_start)
