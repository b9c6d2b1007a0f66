"""The reverse index: key block -> the (query token, slot) entries that selected it.

Block-sparse attention with per-token selections is re-parameterized as variable-length
attention: for every (selection head p, key block) the list of query tokens that kept the block,
split into work items of at most ``TW`` tokens. A kernel program owns one work item: it loads its
key block once and streams the item's queries, so every MMA row does useful work whatever the
selection's overlap between neighbouring queries.

Built with a handful of torch ops on fixed-size tensors (upper bounds known from ``T``, ``N``
and the block size): no host synchronization, CUDA-graph capturable, deterministic (a stable
sort keeps each list in token order). In two parts: :func:`lists`, the expensive one (the
stable sort of ``C * Hs * K`` keys into lists, their bounds; the key blocks, :func:`blocks`),
independent of the item size, and :func:`items`, the cheap cut into items of ``TW`` entries
(16 small ops). :func:`build` is both. :func:`lists` with ``chunk`` also finds each query
chunk's run of each list, and :func:`chunk_items` cuts every chunk's work list from that one
sort (the sparse-forward driver's ``one_sort``). A training step sorts once: the sparse-forward
driver's ``Forward`` carries its lists when it ran in one chunk or sorted once (:func:`carry`,
the memory rule in ``sparse_forward.keeps``), api.py saves them for the backward, whose ``bwd``
cuts its own items (``TW`` 128 on CuTe, 256 on Triton) from them when :func:`matches` says they
are the call's.

Backend-neutral: both backends' forward and backward kernels walk these lists (the Triton
kernels and the CuTe kernels read the same six tensors), and :func:`geometry` says how a work
item's main heads are packed into MMA rows (:func:`padded_geometry`: any head group, padded
to a power of two).

With a query map (``q_map``, context parallelism: docs/distributed.md) the entries stay keyed
by query row, and only the row's sequence comes from its token ``q_map[row]`` (a padding row,
``-1``, has no entries); the list carries the map (``WorkList.q_map``) for the kernels, which
take a query's causal position from it. :func:`query_order` groups query rows by sequence for
the selection kernel, and :func:`drop_padding_rows` clears the indices of padding rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .problem import Forward, Saved

ITEM_TOKENS = 256  # tokens per work item: K/V (and dK/dV) stay on chip over them


# Transient device bytes per (row, selection head, slot) entry at the peak of :func:`lists`'
# sort (keys, the stable sort's values and scratch): 40, counted for the CuTe warmup's lists
# (24, the count without the sort's scratch, undercounted them). Read by the budgets of the
# warmup's lists (cute/warmup.py) and of the forward's one sort (sparse_forward.one_sort).
SORT_BYTES_PER_ENTRY = 40


def geometry(H: int, Hkv: int, Hs: int, rows: int) -> tuple[int, int, int, int]:
    """``(G, G2, R, BT)`` for MMA tiles of about ``rows`` rows (the CuTe kernels' packing).

    G main heads share a selection head; they are visited in R sub-groups of G2 heads that share
    one KV head (G2 <= rows / 16); a tile holds BT >= 16 tokens x G2 heads (BM = BT * G2).
    Where ``H // max(Hs, Hkv)`` is not a power of two, ``G2 * R`` may fall short of ``G`` (the
    callers refuse that); :func:`padded_geometry` packs any group.
    """
    G = H // Hs
    G2 = min(H // max(Hs, Hkv), rows // 16)
    return G, G2, G // G2, max(16, rows // G2)


def padded_geometry(H: int, Hkv: int, Hs: int, rows: int) -> tuple[int, int, int, int, int]:
    """``(G, G2, G2P, R, BT)`` for MMA tiles of about ``rows`` rows, any head group (the Triton
    kernels' packing).

    The G = H / Hs main heads of a selection head are visited in R = G / G2 sub-groups of G2
    heads that share one KV head: G2 is the largest divisor of ``g = H // max(Hs, Hkv)`` (the
    heads of one selection head on one KV head) whose power-of-two padding ``G2P`` is at most
    ``rows / 16``. A tile holds BT >= 16 tokens x G2P head slots (BM = BT * G2P rows, row r =
    token r // G2P, slot r % G2P; ``tl.arange`` sizes are powers of two); the slots ``>= G2``
    are masked (no load, no store, no contribution). Where ``g`` is a power of two this is
    :func:`geometry` with ``G2P = G2`` (no padding). E.g. H 28, Hkv 4, Hs 4 (g = 7) at 128
    rows: G2 7, G2P 8, R 1, BT 16.
    """
    G = H // Hs
    g = H // max(Hs, Hkv)
    cap = max(1, rows // 16)
    G2 = max(d for d in range(1, g + 1) if g % d == 0 and _next_pow2(d) <= cap)
    G2P = _next_pow2(G2)
    return G, G2, G2P, G // G2, max(16, rows // G2P)


def _next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (n >= 1)."""
    return 1 << (n - 1).bit_length()


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


class Blocks(NamedTuple):
    """The global key blocks of a batch (:func:`blocks`): the same for every query chunk."""

    start: torch.Tensor  # [NB] int32: first token (packed) of each global block (0 past the last)
    end: torch.Tensor  # [NB] int32: one past its last token
    seq_first: torch.Tensor  # [N] int32: global id of each sequence's block 0
    num_blocks: int  # NB = total_tokens // block_size + N: an upper bound
    block_size: int


def blocks(cu_seqlens: torch.Tensor, block_size: int, total_tokens: int) -> Blocks:
    """The global key blocks of ``cu_seqlens``' sequences (``total_tokens`` keys): sequence n's
    blocks are numbered from ``seq_first[n]`` on, in order; ``NB`` (a bound known from the
    shapes) of them, the ones past the last with an empty token range."""
    dev = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    NB = total_tokens // block_size + N  # sum over sequences of ceil(len / b) never exceeds this
    # every value below is within [-(NB + 1) b, (NB + 1) b + T]: int32 arithmetic where that
    # fits (no conversions of cu_seqlens and seq_first), int64 past it (the same values)
    wide = torch.int32 if (NB + 1) * block_size + total_tokens < 2**31 else torch.int64
    cu = cu_seqlens.to(wide)
    nblk = (cu.diff() + (block_size - 1)) // block_size  # [N]
    blk_end_cum = nblk.cumsum(0, dtype=wide)
    blk_first = blk_end_cum - nblk  # [N] global id of each sequence's block 0

    # global block g of sequence s: start = cu[s] + (g - blk_first[s]) * b = g * b + off[s],
    # end = min(start + b, cu[s + 1]); the two per-sequence columns are gathered in one op.
    # Eager, each launch is ~5-10 us of host time (anchor 16K: the forward's host-bound
    # stretch before the partials): 17 torch ops, 18 launches, where the same values took 27
    # and 28 before
    table = torch.stack((torch.sub(cu[:-1], blk_first, alpha=block_size), cu[1:]))  # [2, N]
    gb = torch.arange(NB, device=dev, dtype=wide)
    seq_of_gb = torch.searchsorted(blk_end_cum, gb, right=True).clamp_max_(N - 1)
    span = table.index_select(1, seq_of_gb)  # [2, NB]: off, cu[s + 1]
    start, end = span[0], span[1]  # (written in place)
    torch.add(start, gb, alpha=block_size, out=start)
    torch.minimum(start + block_size, end, out=end)
    span.masked_fill_(gb >= blk_end_cum[-1], 0)  # the blocks past the last: [0, 0)
    # both int32 rows in one buffer, each 16-byte aligned (NB rounded up to 4: the kernels
    # read them by pointer)
    out = torch.empty((2, -(-NB // 4) * 4), dtype=torch.int32, device=dev)[:, :NB]
    out.copy_(span)
    return Blocks(out[0], out[1], blk_first.to(torch.int32), NB, block_size)


class Lists(NamedTuple):
    """The expensive part of a work list, independent of the item size (:func:`lists`): the
    entries of rows ``tok0 .. tok0 + rows`` stable-sorted into lists (one per selection head
    and global key block) and each list's bounds; :func:`items` cuts it into work items of any
    size in a few small ops. ``perm`` as :attr:`WorkList.perm`; list ``l = p * NB + block``
    holds ``perm[bounds[l]:bounds[l + 1]]``, ``bounds[-1]`` is the number of used entries.

    Kept between the forward and the backward of a training step (:func:`carry`): ``nbytes``
    device bytes, ``rows * Hs * K * 8`` for ``perm`` plus ``(Hs * NB + 1) * 8 + NB * 8`` (8 MiB
    at anchor 16K: 16384 rows, Hs 4, K 16; ``q_map`` is the caller's)."""

    perm: torch.Tensor  # [rows*Hs*K] int64
    bounds: torch.Tensor  # [Hs*NB + 1] int64
    block_start: torch.Tensor  # [NB] int32 (Blocks.start)
    block_end: torch.Tensor  # [NB] int32 (Blocks.end)
    num_blocks: int  # NB
    slots: int  # K
    heads: int  # Hs
    q_map: torch.Tensor | None  # as WorkList.q_map
    tok0: int  # the first row
    rows: int  # C: the rows sorted (tok0 .. tok0 + rows)
    block_size: int
    # ``lists(..., chunk=R)`` only (else None, 0): chunk c (rows tok0 + c R .. + R) of list l is
    # perm[chunk_bounds[c, l]:chunk_bounds[c + 1, l]] (the last chunk's end: the list's end);
    # (NC + 1, Hs * NB + 1) int64, NC = ceil(rows / R); bounds is its row 0 (a view)
    chunk_bounds: torch.Tensor | None = None
    chunk_rows: int = 0  # R: rows per chunk

    @property
    def nbytes(self) -> int:
        """Device bytes of the lists' own tensors (``q_map`` is the caller's; with a chunk
        table, the table instead of ``bounds``, its row 0)."""
        b = self.bounds if self.chunk_bounds is None else self.chunk_bounds
        return sum(x.nbytes for x in (self.perm, b, self.block_start, self.block_end))

    @property
    def num_chunks(self) -> int:
        """NC: the chunks of ``chunk_rows`` rows (1 without a chunk table)."""
        return 1 if self.chunk_bounds is None else self.chunk_bounds.shape[0] - 1

    def unchunked(self) -> Lists:
        """These lists without the chunk table (``bounds`` copied out of it: the table's
        storage is freed with it), as a caller keeps them for the backward (api.py saves the
        tensor fields; the host fields, ``chunk_bounds`` among them, would stay on its ``ctx``)."""
        if self.chunk_bounds is None:
            return self
        return self._replace(bounds=self.bounds.clone(), chunk_bounds=None, chunk_rows=0)


def lists(
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    tok0: int = 0,
    total_tokens: int | None = None,
    q_map: torch.Tensor | None = None,
    key_blocks: Blocks | None = None,
    chunk: int | None = None,
) -> Lists:
    """The sorted lists of ``indices`` ``(C, Hs, K)`` (sequence-local blocks, -1 unused): the
    rows of packed tokens ``[tok0, tok0 + C)`` of a ``total_tokens``-token batch (default: all).
    ``perm`` holds flat entries of the whole batch: ``token * Hs * K + head * K + slot``.

    With ``q_map`` (``(Tq,)`` int32, the whole call's map) the rows ``[tok0, tok0 + C)`` are
    query rows, whose sequences come from their tokens ``q_map[row]``; ``total_tokens`` must
    then be the keys' ``T`` (it bounds the number of key blocks). Padding rows (``-1``) get no
    entries whatever their indices. ``key_blocks``: :func:`blocks` of the same batch, for a
    caller that sorts several chunks (else computed here).

    One stable sort of ``C * Hs * K`` keys (int32 unless ``Hs * NB`` needs more: the radix
    sort then moves half the bytes; the order is the same) and one search for the bounds.

    ``chunk``: rows per chunk R (the sparse-forward driver's query chunks, ``one_sort``): the
    key of an entry of row ``tok0 + r`` becomes ``list * NC + r // R`` (NC = ceil(C / R)
    chunks; the unused slots ``L * NC + r // R``), a chunk-major key inside each list; the
    stable sort gives the same ``perm`` (a list's entries are in row order, so its chunks are
    consecutive runs), and one search over ``(NC + 1) * (L + 1)`` keys gives every chunk's
    run of every list (``Lists.chunk_bounds``; ``bounds`` is its row 0). :func:`chunk_items`
    cuts every chunk's work list from it, :func:`items` the whole one. Four torch ops more than
    without (one an elementwise pass over the keys); no host sync."""
    C, Hs, K = indices.shape
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk: the rows per chunk must be >= 1, got {chunk}")
    total = C if total_tokens is None else total_tokens
    if key_blocks is None:
        key_blocks = blocks(cu_seqlens, block_size, total)
    elif key_blocks.block_size != block_size:
        raise ValueError(
            f"key_blocks: made for block_size {key_blocks.block_size}, not {block_size}"
        )
    dev = indices.device
    NB = key_blocks.num_blocks
    L = Hs * NB  # lists; the key L marks an unused slot (sorts last)
    NC = 1 if chunk is None else max(1, -(-C // chunk))
    # (with chunks the keys reach (L + 1) NC: the search's last one)
    kdt = torch.int32 if (L if chunk is None else (L + 1) * NC) < 2**31 else torch.int64
    cu = cu_seqlens.to(torch.int32)

    # entries -> list keys, stable-sorted (token order inside each list)
    idx = indices
    if q_map is None:
        tok = torch.arange(tok0, tok0 + C, device=dev, dtype=torch.int32)
    else:  # the row's token among the keys; a padding row: every slot unused
        tok = q_map[tok0 : tok0 + C].to(torch.int32)
        idx = torch.where(tok[:, None, None] >= 0, idx, -1)
    # the first N - 1 ends only: a row past cu_seqlens[-1] (metadata the API's guard has
    # emptied, every slot -1) is taken as the last sequence's, as ListKeysSm90 does, where its
    # keys are all L; the search over every end would index past seq_first
    seq_of_tok = torch.searchsorted(cu[1:-1], tok, right=True)
    first = key_blocks.seq_first[seq_of_tok]  # [C]: the token's sequence's block 0
    row_key = torch.arange(0, L, NB, device=dev, dtype=kdt) + first[:, None]  # [C, Hs]
    # (masked_fill_ with a Python scalar: torch.where(..., L) makes a device scalar first, one
    # launch more)
    key = (row_key[:, :, None] + idx).masked_fill_(idx < 0, L)
    if chunk is not None:  # key * NC + the row's chunk, in place (one pass)
        rc = torch.arange(C, device=dev, dtype=kdt) // chunk
        torch.add(rc[:, None, None], key, alpha=NC, out=key)
    sorted_key, perm = torch.sort(key.flatten(), stable=True)
    if tok0:
        perm += tok0 * Hs * K
    if chunk is None:  # list l: the entries with key l, from the first key >= l on
        bounds = torch.searchsorted(sorted_key, torch.arange(L + 1, device=dev, dtype=kdt))
        return Lists(
            perm, bounds, key_blocks.start, key_blocks.end, NB, K, Hs, q_map, tok0, C, block_size
        )
    # chunk c of list l starts at the first key >= l NC + c: table[c, l] for c <= NC, l <= L
    # (row NC, l: = (l + 1) NC, the end of list l; row 0: the lists' bounds; column L: where
    # the chunk's unused slots start, never used as an end)
    keys = torch.arange((L + 1) * NC + 1, device=dev, dtype=kdt)
    keys = keys.as_strided((NC + 1, L + 1), (1, NC))
    table = torch.searchsorted(sorted_key, keys.contiguous())  # (NC + 1, L + 1) int64
    return Lists(
        perm, table[0], key_blocks.start, key_blocks.end, NB, K, Hs, q_map, tok0, C, block_size,
        table, chunk,
    )  # fmt: skip


def items(sorted_lists: Lists, TW: int) -> WorkList:
    """The work list of ``sorted_lists`` (:func:`lists`) with items of at most ``TW`` entries:
    each list cut into ``ceil(count / TW)`` items in order, then ``W`` (a bound known from the
    shapes) minus the used ones empty items (``start == end == 0``, list ``Hs * NB - 1``).

    A cheap cut on small tensors: no host sync, fixed sizes (CUDA-graph capturable), 14 torch
    ops, 16 CUDA launches (16 and 18 before the two per-list columns shared one buffer and one
    gather; eager, each is ~5-10 us of host time). ``item_start`` and ``item_end`` are the
    two rows of one ``(2, W')`` tensor (``W'`` = W rounded up to even: the second row stays
    16-byte aligned for the kernels)."""
    if TW < 1:
        raise ValueError(f"TW: the entries per item must be >= 1, got {TW}")
    sl = sorted_lists
    L = sl.heads * sl.num_blocks
    dev = sl.perm.device
    b = sl.bounds  # [L + 1]; b[0] = 0 (no key sorts below list 0)
    per_list = (b.diff() + (TW - 1)) // TW  # items of each list
    W = (sl.rows * sl.heads * sl.slots) // TW + L  # >= sum(ceil(count / TW))
    Wp = W + W % 2
    # item w of list l covers entries [base[l] + w TW, min(base[l] + (w + 1) TW, end[l])),
    # base[l] = bounds[l] - (l's first item) * TW, end[l] = bounds[l + 1]. The sentinel l = L
    # (items past the last): base = used - items * TW, so that base + w TW >= 0, and end = 0
    # (= bounds[0]): an item [0, 0). A non-empty item's start is below its list's end, so
    # min() keeps it. base and end are the two columns of one table, gathered per item at once
    # (base[0] = bounds[0] = 0 and end[L] = 0: the zeros).
    items_end = per_list.cumsum(0)  # [L]: one past each list's last item
    lst = torch.searchsorted(
        items_end, torch.arange(Wp, device=dev), right=True, out_int32=True
    )  # [W'] the item's list; L past the last item
    table = torch.zeros((L + 1, 2), dtype=torch.int64, device=dev)
    torch.sub(b[1:], items_end, alpha=TW, out=table[1:, 0])
    table[:L, 1].copy_(b[1:])
    steps = torch.arange(0, (Wp + 1) * TW, TW, device=dev).as_strided((2, Wp), (1, 1))
    # (into a row-major buffer: from steps' strides alone the sum would come out column-major,
    # and the kernels read item_start / item_end as contiguous rows; int64: T * Hs * K can
    # pass 2**31 at long context)
    span = torch.empty((2, Wp), dtype=torch.int64, device=dev)
    at = table.index_select(0, lst)  # [W', 2]: base, end of each item's list
    torch.add(at[:, 0], steps, out=span)
    torch.minimum(span, at[:, 1], out=span)
    return WorkList(
        sl.perm, lst[:W].clamp_max(L - 1), span[0, :W], span[1, :W], sl.block_start,
        sl.block_end, sl.num_blocks, W, sl.slots, sl.heads, sl.q_map, TW,
    )  # fmt: skip


def chunk_items(sorted_lists: Lists, TW: int) -> tuple[WorkList, ...]:
    """The work list of every chunk (rows ``tok0 + c R .. + R``, R = ``chunk_rows``) of lists
    sorted with chunks (``lists(..., chunk=R)``), items of at most ``TW`` entries: chunk c's is
    the work list ``items(lists(<its rows>, ..., tok0 + c R, ...), TW)`` (the driver's
    per-chunk sort) item by item: the same ``item_list``, each item the same entries
    (``perm[item_start:item_end]``), the same empty items (``[0, 0)``, list ``L - 1``), ``W``,
    blocks and map. Only ``perm`` is the whole call's (the item bounds index it).

    :func:`items`' cut, for all NC chunks at once on ``(NC, ...)`` tensors: 18 torch ops
    whatever NC (:func:`items` of one chunk: 14; paper 128K has 16 chunks), no host sync. Chunk c's
    ``item_list``, ``item_start``, ``item_end`` are rows of three shared buffers, each row
    16-byte aligned (``W'``: W of a full chunk rounded up to a multiple of 4)."""
    sl = sorted_lists
    if sl.chunk_bounds is None:
        raise ValueError("sorted_lists: made without chunks (lists(..., chunk=R))")
    if TW < 1:
        raise ValueError(f"TW: the entries per item must be >= 1, got {TW}")
    L = sl.heads * sl.num_blocks
    dev = sl.perm.device
    NC, R = sl.num_chunks, sl.chunk_rows
    t = sl.chunk_bounds  # (NC + 1, L + 1): chunk c of list l is [t[c, l], t[c + 1, l])
    starts, ends = t[:-1], t[1:, :-1]
    per_list = (ends - starts[:, :-1] + (TW - 1)) // TW  # (NC, L) items of each list
    Ws = [(min(R, sl.rows - c0) * sl.heads * sl.slots) // TW + L for c0 in range(0, sl.rows, R)]
    if not Ws:  # no rows: no chunks
        return ()
    Wp = -(-Ws[0] // 4) * 4  # the first chunk is a full one: the largest W
    # as in items(), per chunk: item w of list l covers [base + w TW, min(base + (w + 1) TW,
    # end)), base = start - (l's first item) TW; the sentinel l = L: base = where the chunk's
    # unused entries start - items TW (>= 0 from its first item on), end 0: [0, 0)
    items_end = per_list.cumsum(1)  # (NC, L)
    w = torch.arange(Wp, device=dev).expand(NC, Wp).contiguous()
    lst = torch.searchsorted(items_end, w, right=True)  # (NC, W') int64: L past the last item
    table = torch.zeros((NC, L + 1, 2), dtype=torch.int64, device=dev)
    torch.sub(starts[:, 1:], items_end, alpha=TW, out=table[:, 1:, 0])
    table[:, 0, 0].copy_(starts[:, 0])
    table[:, :L, 1].copy_(ends)
    at = torch.take_along_dim(table, lst[:, :, None], dim=1)  # (NC, W', 2): base, end
    steps = torch.arange(0, (Wp + 1) * TW, TW, device=dev).as_strided((2, Wp), (1, 1))
    span = torch.empty((NC, 2, Wp), dtype=torch.int64, device=dev)
    torch.add(at[:, None, :, 0], steps, out=span)
    torch.minimum(span, at[:, None, :, 1], out=span)
    lists_ = lst.clamp_max_(L - 1).to(torch.int32)
    return tuple(
        WorkList(
            sl.perm,
            lists_[c, :W],
            span[c, 0, :W],
            span[c, 1, :W],
            sl.block_start,
            sl.block_end,
            sl.num_blocks,
            W,
            sl.slots,
            sl.heads,
            sl.q_map,
            TW,
        )  # fmt: skip
        for c, W in enumerate(Ws)
    )


def build(
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    TW: int,
    tok0: int = 0,
    total_tokens: int | None = None,
    q_map: torch.Tensor | None = None,
) -> WorkList:
    """Reverse index of ``indices`` ``(C, Hs, K)``: ``items(lists(...), TW)`` (arguments as
    :func:`lists`), work items of at most ``TW`` entries."""
    return items(lists(indices, cu_seqlens, block_size, tok0, total_tokens, q_map), TW)


def matches(
    sorted_lists: Lists | None,
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    total_tokens: int,
    q_map: torch.Tensor | None,
) -> bool:
    """Whether ``sorted_lists`` (``None``: no) can stand for ``lists(indices, cu_seqlens,
    block_size, 0, total_tokens, q_map)``: made from all of the call's rows with the same
    shapes, block size, key count and the same query map object (api.py re-attaches the
    backward's own; host values only, no sync). The data itself is the caller's promise: the
    forward's lists of the same saved tensors (autograd's version counters guard them)."""
    if sorted_lists is None:
        return False
    s = sorted_lists
    C, Hs, K = indices.shape
    NB = total_tokens // block_size + cu_seqlens.numel() - 1
    return (
        s.tok0 == 0 and (s.rows, s.heads, s.slots) == (C, Hs, K) and s.block_size == block_size
        and s.num_blocks == NB and s.q_map is q_map
        and s.perm.device == indices.device
    )  # fmt: skip


class _CarriedForward(Forward):
    """A :class:`~flash_msa.problem.Forward` with the forward's sorted lists (``lists``)."""

    lists: Lists | None = None


class _CarriedSaved(Saved):
    """A :class:`~flash_msa.problem.Saved` with the forward's sorted lists (``lists``)."""

    lists: Lists | None = None


def carry(result: Forward | Saved, sorted_lists: Lists | None) -> Forward | Saved:
    """``result`` (a backend's ``Forward``, or the ``Saved`` handed to a backend's ``bwd``)
    that also carries ``sorted_lists`` (:func:`carried` reads them), its fields unchanged (it
    unpacks and compares as before): how the forward's lists reach the backward through the
    backends' unchanged ``fwd`` / ``bwd`` signatures (api.py keeps them in between)."""
    if sorted_lists is None:
        return result
    out = (_CarriedForward if isinstance(result, Forward) else _CarriedSaved)(*result)
    out.lists = sorted_lists
    return out


def carried(result) -> Lists | None:
    """The lists :func:`carry` put on ``result``; ``None`` if none."""
    return getattr(result, "lists", None)


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


def causal_blocks(
    cu_seqlens: torch.Tensor,
    block_size: int,
    max_seqlen: int,
    heads: int,
    total_tokens: int,
    width: int | None = None,
) -> torch.Tensor:
    """Every causal key block of each token's own sequence: the selection's output contract
    (``reference.select``: sequence-local block numbers, ascending, the own block always
    present, ``-1`` padded) with every visible block kept, which makes the sparse op the dense
    warmup (semantics.md, "Warmup mode": ``T(h, i)`` = every ``j <= i``; a kept block ``j <=
    i // block_size`` holds keys ``<= i`` and the kernels mask the rest causally).

    Args:
        cu_seqlens: ``(N + 1,)`` int32 sequence bounds of the ``total_tokens`` packed tokens.
        block_size: tokens per key block.
        max_seqlen: the longest sequence (a host int: the width's bound).
        heads: ``Hs``, selection heads (every head gets the same row).
        total_tokens: ``T``.
        width: slots per row, at least ``ceil(max_seqlen / block_size)`` (default: that);
            the slots past a row's own block are ``-1``.

    Returns:
        ``(T, heads, width)`` int32, contiguous: ``[t, :, s] = s`` for ``s <= pos(t) //
        block_size`` (``pos``: the token's position in its sequence), else ``-1``. Device ops on
        fixed sizes only (no host synchronization: CUDA-graph capturable)."""
    nb = -(-max_seqlen // block_size)
    width = nb if width is None else width
    if width < nb:
        raise ValueError(f"width: {width} slots cannot hold the {nb} blocks of max_seqlen")
    dev = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(total_tokens, device=dev)
    seq = torch.searchsorted(cu[1:], tok, right=True)  # the token's sequence
    own = (tok - cu[seq]) // block_size  # [T]: its own (last visible) block
    # a row past cu_seqlens[-1] (metadata the API's guard rewrote) attends nothing: all -1
    own.masked_fill_(tok >= cu[-1], -1)
    slot = torch.arange(width, device=dev, dtype=torch.int32)
    rows = torch.where(slot[None, :] <= own[:, None], slot[None, :], -1)  # [T, width] int32
    return rows[:, None, :].expand(total_tokens, heads, width).contiguous()
