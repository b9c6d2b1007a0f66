"""The work-list build's kernels (Hopper, sm_90a) in CuTe DSL: one op, the device side of
:mod:`.worklist_host` (``blocks``, ``lists``, ``items``: bitwise what
:func:`flash_msa.worklist.blocks`, :func:`~flash_msa.worklist.lists` and
:func:`~flash_msa.worklist.items` return), in five passes whose kernel classes live in this
one file: :class:`BlocksSm90` (the key blocks), :class:`ListKeysSm90` and
:class:`ListBoundsSm90` (the lists' sort keys and bounds, around torch's sort),
:class:`ItemEndsSm90` and :class:`ItemsSm90` (the items). Each takes raw device addresses and
Int32 counts (its ``POINTERS`` and ``COUNTS``, typed by ``worklist_host.worklist_arguments``).

Sizes (``N`` sequences, ``NB = total_tokens // block_size + N`` global key blocks, ``L = Hs *
NB`` lists, ``E = rows * Hs * K`` entries, ``W = E // TW + L`` items, ``W' = W + W % 2``; the
buffers' layouts: :mod:`.worklist_host`).

Design, per kernel (every index is an Int32 except the int64 entry offsets; the host refuses
sizes past 2^30, ``worklist_host.MAX_SIZE``, and ``blocks`` where ``worklist.blocks`` computes
in int64):

- :class:`BlocksSm90`, one CTA of 1024 threads: (1) the sequences in tiles of 1024, thread
  ``s`` computes ``nblk[s] = ceil(len / b)`` (floor division, as torch's), a block-wide scan
  (warp ``shfl.up`` scans, the 32 warp totals scanned by warp 0 through shared memory, a
  running carry between tiles: exact for any N) gives ``seq_first[s]``, stored; (2) after a
  barrier (the CTA's global stores are then visible to it), thread ``g`` of each tile of
  blocks finds its sequence by a binary search of ``seq_first`` (the last ``s`` with
  ``seq_first[s] <= g``: ``worklist``'s ``searchsorted(blk_end_cum, g, right=True)`` for
  non-decreasing ``cu_seqlens``; no step for N = 1) and writes ``start = cu[s] + (g -
  seq_first[s]) b``, ``end = min(start + b, cu[s + 1])``, ``[0, 0)`` past the last block.
- :class:`ItemEndsSm90`, one CTA of 1024 threads, 4 lists per thread per tile: ``per_list[l]
  = ceil((bounds[l + 1] - bounds[l]) / TW)`` (int64 floor division, as torch's) and its
  inclusive scan, ``items_end[l]`` (int32: at most W), into the scratch.
- :class:`ItemsSm90`, a grid of 256-thread CTAs over the W' items: thread ``w`` finds its list
  ``l`` = the number of lists with ``items_end[l] <= w`` (binary search; ``L`` past the last
  item) and writes ``worklist.items``' values: ``base = bounds[l] - items_end[l - 1] TW``
  (0 for ``l = 0``), ``end = bounds[l + 1]`` (0 for ``l = L``), ``start = min(base + w TW,
  end)``, ``end = min(base + (w + 1) TW, end)``, list ``min(l, L - 1)``.
- :class:`ListKeysSm90` (grid, thread per entry ``(r, h, k)``): ``worklist.lists``' key
  ``h NB + seq_first[seq(tok0 + r)] + idx`` (``L`` for ``idx < 0``), the sequence by a binary
  search of ``cu_seqlens``; then ``torch.sort(stable=True)`` as in ``worklist``; then
  :class:`ListBoundsSm90` (grid, thread per list ``l <= L``): ``bounds[l]`` = the first sorted
  key ``>= l`` (binary search: balanced whatever the lists' sizes).

Rows past ``cu_seqlens[-1]`` (only in metadata the API's guard rewrote, :mod:`flash_msa.guard`,
which sets every slot of such a row to ``-1``) are taken as the last sequence's by
:class:`ListKeysSm90`'s search, as by ``worklist.lists``: their keys are all ``L``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator


# ---------------------------------------------------------------------------------------------
# device helpers (traced inline)
# ---------------------------------------------------------------------------------------------
@cute.jit
def _warp_scan(x, lane):
    """Inclusive sum of ``x`` (Int32) over lanes ``0 .. lane`` of the warp (``shfl.up``)."""
    for off in (1, 2, 4, 8, 16):
        y = cute.arch.shuffle_sync_up(x, off)
        x = x + cutlass.select_(lane >= off, y, Int32(0))
    return x


@cute.jit
def _block_scan(x, lane, warp, warps: int, sTot, sScan):
    """``(inclusive sum of x up to this thread, the CTA's total)`` over the CTA's threads in
    thread order; ``sTot``, ``sScan``: 32 Int32 of shared memory each. Two barriers; a next call
    may reuse the two buffers (sTot is rewritten only after every thread passed the second
    barrier, by which warp 0 has read it; sScan only after the next call's first barrier)."""
    x = _warp_scan(x, lane)
    if lane == 31:
        sTot[warp] = x
    cute.arch.sync_threads()
    if warp == 0:
        t = Int32(0)
        if lane < warps:
            t = sTot[lane]
        sScan[lane] = _warp_scan(t, lane)
    cute.arch.sync_threads()
    below = Int32(0)
    if warp > 0:
        below = sScan[warp - 1]
    return below + x, sScan[warps - 1]


@cute.jit
def _last_at_most(m, hi, v):
    """The last index ``j`` in ``[0, hi]`` with ``m[j] <= v`` (``m`` non-decreasing, ``m[0] <=
    v``): binary search, no step when ``hi`` is 0."""
    lo = Int32(0)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if m[mid] <= v:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cute.jit
def _count_below(m, n, v, strict: bool):
    """How many of ``m[0:n]`` (non-decreasing) are ``< v`` (``strict``) or ``<= v``."""
    lo = Int32(0)
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        below = m[mid] < v if strict else m[mid] <= v
        if below:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _flat(pointer, n):
    """The flat tensor of ``n`` elements at ``pointer`` (in a ``@cute.jit`` launch)."""
    return cute.make_tensor(pointer, cute.make_layout(n))


def _check_threads(kernel) -> None:
    """ValueError unless ``kernel.threads`` is 128, 256, 512 or 1024 (whole warps, at most 32:
    the block scan's second level is one warp)."""
    if kernel.threads not in (128, 256, 512, 1024):
        raise ValueError(
            f"{type(kernel).__name__}: threads must be 128, 256, 512 or 1024, got {kernel.threads}"
        )


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlocksSm90:
    """:func:`worklist.blocks` in one CTA (module docstring). Run-time values: N, NB, b."""

    threads: int = 1024
    POINTERS = (Int32, Int32, Int32, Int32)  # cu_seqlens, start, end, seq_first
    COUNTS = 3  # N, NB, block_size

    def __post_init__(self):
        _check_threads(self)

    @cute.jit
    def __call__(self, pCu: cute.Pointer, pStart: cute.Pointer, pEnd: cute.Pointer,
                 pFirst: cute.Pointer, n_seqs: Int32, n_blocks: Int32, block_size: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        self.kernel(
            _flat(pCu, n_seqs + 1), _flat(pStart, n_blocks), _flat(pEnd, n_blocks),
            _flat(pFirst, n_seqs), n_seqs, n_blocks, block_size,
        ).launch(grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, mCu: cute.Tensor, mStart: cute.Tensor, mEnd: cute.Tensor,
               mFirst: cute.Tensor, n_seqs: Int32, n_blocks: Int32, b: Int32):  # fmt: skip
        NT = self.threads
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        alloc = SmemAllocator()
        sTot = alloc.allocate_tensor(Int32, cute.make_layout(32), 16)
        sScan = alloc.allocate_tensor(Int32, cute.make_layout(32), 16)
        # 1. seq_first: the exclusive scan of ceil(len / b) over the sequences, by tiles
        total = Int32(0)
        for base in cutlass.range(0, n_seqs, NT, unroll=1):
            s = base + tidx
            n = Int32(0)
            if s < n_seqs:
                n = (mCu[s + 1] - mCu[s] + b - 1) // b
            upto, tile = _block_scan(n, lane, warp, NT // 32, sTot, sScan)
            if s < n_seqs:
                mFirst[s] = total + upto - n
            total = total + tile
        cute.arch.sync_threads()  # seq_first complete and visible to the CTA
        # 2. each global block's token range; [0, 0) past the last one
        for g in cutlass.range(tidx, n_blocks, NT, unroll=1):
            start = Int32(0)
            end = Int32(0)
            if g < total:
                s = _last_at_most(mFirst, n_seqs - 1, g)
                start = mCu[s] + (g - mFirst[s]) * b
                end = cutlass.min(start + b, mCu[s + 1])
            mStart[g] = start
            mEnd[g] = end


@dataclass(frozen=True)
class ItemEndsSm90:
    """``items_end = cumsum(ceil(diff(bounds) / TW))`` (int32) in one CTA. Run-time values:
    L, TW."""

    threads: int = 1024
    per_thread: int = 4  # consecutive lists per thread and tile: their loads in flight together
    POINTERS = (Int64, Int32)  # bounds, items_end
    COUNTS = 2  # L, TW

    def __post_init__(self):
        _check_threads(self)
        if self.per_thread not in (1, 2, 4, 8):
            raise ValueError(f"ItemEndsSm90: per_thread 1, 2, 4 or 8, got {self.per_thread}")

    @cute.jit
    def __call__(self, pBounds: cute.Pointer, pEnds: cute.Pointer, n_lists: Int32, tw: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        self.kernel(_flat(pBounds, n_lists + 1), _flat(pEnds, n_lists), n_lists, tw).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mB: cute.Tensor, mEnds: cute.Tensor, n_lists: Int32, tw: Int32):
        NT, V = self.threads, self.per_thread
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        alloc = SmemAllocator()
        sTot = alloc.allocate_tensor(Int32, cute.make_layout(32), 16)
        sScan = alloc.allocate_tensor(Int32, cute.make_layout(32), 16)
        tw64 = Int64(tw)
        total = Int32(0)
        for base in cutlass.range(0, n_lists, NT * V, unroll=1):
            l0 = base + tidx * V
            bv = cute.make_rmem_tensor(V + 1, Int64)  # bounds[l0 .. l0 + V] (clamped to L)
            for j in cutlass.range_constexpr(V + 1):
                bv[j] = mB[cutlass.min(l0 + j, n_lists)]
            upto = cute.make_rmem_tensor(V, Int32)  # the thread's inclusive sums
            acc = Int32(0)
            for j in cutlass.range_constexpr(V):  # (0 past L: equal clamped bounds)
                acc = acc + Int32((bv[j + 1] - bv[j] + tw64 - 1) // tw64)
                upto[j] = acc
            incl, tile = _block_scan(acc, lane, warp, NT // 32, sTot, sScan)
            below = total + incl - acc
            for j in cutlass.range_constexpr(V):
                if l0 + j < n_lists:
                    mEnds[l0 + j] = below + upto[j]
            total = total + tile


@dataclass(frozen=True)
class ItemsSm90:
    """Every item of :func:`worklist.items` from ``bounds`` and ``items_end``: one thread per
    item of the W' columns. Run-time values: L, W, W', TW."""

    threads: int = 256
    POINTERS = (Int64, Int32, Int32, Int64, Int64)  # bounds, items_end, list, start, end
    COUNTS = 4  # L, W, W', TW

    def __post_init__(self):
        _check_threads(self)

    @cute.jit
    def __call__(self, pBounds: cute.Pointer, pEnds: cute.Pointer, pList: cute.Pointer,
                 pStart: cute.Pointer, pEnd: cute.Pointer, n_lists: Int32, n_items: Int32,
                 n_cols: Int32, tw: Int32, stream: cuda.CUstream):  # fmt: skip
        self.kernel(
            _flat(pBounds, n_lists + 1), _flat(pEnds, n_lists), _flat(pList, n_items),
            _flat(pStart, n_cols), _flat(pEnd, n_cols), n_lists, n_items, n_cols, tw,
        ).launch(
            grid=((n_cols + self.threads - 1) // self.threads, 1, 1),
            block=(self.threads, 1, 1), stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, mB: cute.Tensor, mEnds: cute.Tensor, mList: cute.Tensor,
               mStart: cute.Tensor, mEnd: cute.Tensor, n_lists: Int32, n_items: Int32,
               n_cols: Int32, tw: Int32):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        w = bid * self.threads + tidx
        if w < n_cols:
            lst = _count_below(mEnds, n_lists, w, strict=False)  # L past the last item
            base = Int64(0)  # worklist.items' table: (0, bounds[1]) for list 0, (.., 0) for L
            end = Int64(0)
            if lst > 0:
                base = mB[lst] - Int64(mEnds[lst - 1]) * Int64(tw)
            if lst < n_lists:
                end = mB[lst + 1]
            first = base + Int64(w) * Int64(tw)
            mStart[w] = cutlass.min(first, end)
            mEnd[w] = cutlass.min(first + Int64(tw), end)
            if w < n_items:
                mList[w] = cutlass.min(lst, n_lists - 1)


@dataclass(frozen=True)
class ListKeysSm90:
    """:func:`worklist.lists`' sort keys (``chunk=None``, no query map), one thread per entry.
    Run-time values: E, Hs * K, K, N, NB, L, tok0."""

    threads: int = 256
    POINTERS = (Int32, Int32, Int32, Int32)  # indices, cu_seqlens, seq_first, keys
    COUNTS = 7  # E, Hs * K, K, N, NB, L, tok0

    def __post_init__(self):
        _check_threads(self)

    @cute.jit
    def __call__(self, pIdx: cute.Pointer, pCu: cute.Pointer, pFirst: cute.Pointer,
                 pKey: cute.Pointer, n_entries: Int32, row: Int32, slots: Int32, n_seqs: Int32,
                 n_blocks: Int32, n_lists: Int32, tok0: Int32, stream: cuda.CUstream):  # fmt: skip
        self.kernel(
            _flat(pIdx, n_entries), _flat(pCu, n_seqs + 1), _flat(pFirst, n_seqs),
            _flat(pKey, n_entries), n_entries, row, slots, n_seqs, n_blocks, n_lists, tok0,
        ).launch(
            grid=((n_entries + self.threads - 1) // self.threads, 1, 1),
            block=(self.threads, 1, 1), stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mCu: cute.Tensor, mFirst: cute.Tensor,
               mKey: cute.Tensor, n_entries: Int32, row: Int32, slots: Int32, n_seqs: Int32,
               n_blocks: Int32, n_lists: Int32, tok0: Int32):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        e = bid * self.threads + tidx
        if e < n_entries:
            r = e // row
            h = (e - r * row) // slots
            idx = mIdx[e]
            key = n_lists
            if idx >= 0:
                s = _last_at_most(mCu, n_seqs - 1, tok0 + r)  # the token's sequence
                key = h * n_blocks + mFirst[s] + idx
            mKey[e] = key


@dataclass(frozen=True)
class ListBoundsSm90:
    """:func:`worklist.lists`' ``bounds[l]`` = the first sorted key ``>= l``, thread per list
    ``l <= L``. Run-time values: E, L."""

    threads: int = 256
    POINTERS = (Int32, Int64)  # sorted keys, bounds
    COUNTS = 2  # E, L

    def __post_init__(self):
        _check_threads(self)

    @cute.jit
    def __call__(self, pKey: cute.Pointer, pBounds: cute.Pointer, n_entries: Int32,
                 n_lists: Int32, stream: cuda.CUstream):  # fmt: skip
        self.kernel(_flat(pKey, n_entries), _flat(pBounds, n_lists + 1), n_entries, n_lists).launch(
            grid=((n_lists + self.threads) // self.threads, 1, 1),
            block=(self.threads, 1, 1), stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, mKey: cute.Tensor, mBounds: cute.Tensor, n_entries: Int32, n_lists: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lst = bid * self.threads + tidx
        if lst <= n_lists:
            mBounds[lst] = Int64(_count_below(mKey, n_entries, lst, strict=True))
