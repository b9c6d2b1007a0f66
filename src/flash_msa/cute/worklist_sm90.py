"""The work-list build's torch glue as CuTe kernels (Hopper, sm_90a): :func:`blocks`,
:func:`items` and :func:`lists`, bitwise what :func:`flash_msa.worklist.blocks`,
:func:`~flash_msa.worklist.items` and :func:`~flash_msa.worklist.lists` (``chunk=None``,
``q_map=None``) return, in one, two and two launches (plus ``lists``' torch sort) where the
torch functions take 17, 14 and ~12 torch ops.

Why (benchmarks/host_breakdown.py on the H200, anchor
16K: T 16384, Hs 4, K 16, block 128, one sequence): the eager training step is host-bound (6.1
ms of CUDA-event time against 4.75 ms of kernels), and before the forward's partials launch its
host time goes mostly to ``worklist``'s torch glue: ``blocks()`` 360 us (17 ops), ``lists()``
241 us, ``items()`` ~309 us per call (14 ops; once in the forward, once in the backward with TW
128). A torch op costs ~20 us of host time inside the step, a CuTe launch through
``launch.run_typed`` (TVM-FFI) ~4 us on its own. The values are the same
bit for bit, so each function here is a drop-in: the kernel where :func:`can_implement_blocks`
(``..._items``, ``..._lists``) allows the call, else the torch function (the reason is
returned, not raised).

Measured (H200, before the launches moved to TVM-FFI, one sequence, Hs 4, K 16, block 128; every CuTe result first checked bitwise equal to torch's; host us = median perf_counter of
one call started on an idle GPU, torch -> CuTe): anchor 16K ``blocks`` 203 -> 21, ``lists``
(key blocks given) 174 -> 108 (the torch sort stays), ``items`` TW 256 196 -> 41, TW 128 365 ->
62, the four in a row 897 -> 222; paper 128K 858 -> 213 in all; long 1M 1482 -> 469. The
kernels' own GPU time (events, host hidden) is lower too: anchor ``blocks`` 36 -> 3.6 us,
``items`` 37 -> 8; long 1M ``items`` TW 128 401 -> 39 us; ``lists`` is the sort's (3.1 -> 2.9
ms at 1M).

Shapes (``N`` sequences, ``NB = total_tokens // block_size + N`` global key blocks, ``L = Hs *
NB`` lists, ``E = rows * Hs * K`` entries, ``W = E // TW + L`` items, ``W' = W + W % 2``):

- :func:`blocks`: ``cu_seqlens`` ``(N + 1,)`` int32 in; ``start`` / ``end`` laid out as the
  two rows ``[:, :NB]`` of a ``(2, ceil(NB / 4) * 4)`` int32 block (``end`` ``ceil(NB / 4) *
  4`` elements after ``start``, each 16-byte aligned: the kernels read them by pointer; the 0-3
  padding columns are not written, as in ``worklist``), ``seq_first`` ``(N,)`` int32 right
  after it in the same allocation (one ``torch.empty``; the three are 1-D views of it).
- :func:`items`: ``bounds`` ``(L + 1,)`` int64 in; ``item_list`` ``(W,)`` int32 (the first W
  of an int32 buffer of ``ceil(W / 4) * 4 + L``: the rest is the scan's scratch),
  ``item_start`` / ``item_end`` the two rows ``[:, :W]`` of one ``(2, W')`` int64 buffer (all
  W' columns written, as ``worklist`` computes them).
- :func:`lists`: ``indices`` ``(C, Hs, K)`` int32 in; ``perm`` ``(E,)`` int64 (torch's stable
  sort of the int32 keys, as ``worklist``), ``bounds`` ``(L + 1,)`` int64.

Design, per kernel (every index is an Int32 except the int64 entry offsets; the host refuses
sizes past 2^30, and ``blocks`` where ``worklist.blocks`` computes in int64):

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

Host: raw device addresses (``cute.runtime.make_ptr``) and Int32 counts
(:func:`launch_arguments`: the kernel object fixes every argument's type, so
``launch.run_typed`` keys on it alone), built for the compile only: the launch passes the ints
themselves (:func:`_launch`); the outputs in one ``torch.empty`` for ``blocks``, two for
``items`` and ``lists`` (with the sort's), written in full by the kernels (the padding columns
of ``blocks`` aside); no host synchronization, the current stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

from .. import worklist
from ..problem import capability
from .launch import run_typed, stream

MAX_SIZE = 2**30  # every count and index of a launch (sequences, blocks, lists, items, entries)


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


BLOCKS, ITEM_ENDS, ITEMS = BlocksSm90(), ItemEndsSm90(), ItemsSm90()  # the shipped tunings
LIST_KEYS, LIST_BOUNDS = ListKeysSm90(), ListBoundsSm90()


# ---------------------------------------------------------------------------------------------
# host: validation, the reasons to fall back, the launches
# ---------------------------------------------------------------------------------------------
def _int(name: str, v, least: int) -> None:
    """ValueError naming ``name`` unless ``v`` is an int ``>= least``."""
    if not isinstance(v, int) or v < least:
        raise ValueError(f"{name}: must be an int >= {least}, got {v!r}")


def _validate_blocks(cu_seqlens, block_size, total_tokens) -> None:
    """ValueError naming the argument that :func:`blocks` cannot take whatever the device."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: must be a torch.Tensor, not {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: must be (N + 1,) with N >= 1 sequences, got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: must be int32 or int64, got {cu_seqlens.dtype}")
    _int("block_size", block_size, 1)
    _int("total_tokens", total_tokens, 0)


def _device_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (``None``: an sm_90 GPU)."""
    if device.type != "cuda":
        return f"the CuTe work-list kernels need a CUDA tensor, got one on {device}"
    major = capability(device)[0]
    if major != 9:
        return f"the CuTe work-list kernels are for sm_90 (this GPU: sm_{major}x)"
    return None


def can_implement_blocks(cu_seqlens, block_size: int, total_tokens: int) -> str | None:
    """Why :func:`blocks` falls back to ``worklist.blocks`` for these (validated) arguments
    (``None``: the kernel runs): ``cu_seqlens`` int32 and contiguous, every value within int32
    (``worklist.blocks`` computes in int64 past it), sizes within :data:`MAX_SIZE`, an sm_90
    GPU."""
    if cu_seqlens.dtype != torch.int32:
        return f"cu_seqlens is {cu_seqlens.dtype}: the kernel reads int32"
    if not cu_seqlens.is_contiguous():
        return f"cu_seqlens is not contiguous (stride {cu_seqlens.stride()})"
    N = cu_seqlens.numel() - 1
    NB = total_tokens // block_size + N
    if (NB + 1) * block_size + total_tokens >= 2**31:
        return "block bounds past int32: worklist.blocks computes them in int64"
    if NB > MAX_SIZE:
        return f"{NB} blocks exceed the kernel's {MAX_SIZE}"
    return _device_reason(cu_seqlens.device)


def blocks(cu_seqlens: torch.Tensor, block_size: int, total_tokens: int) -> worklist.Blocks:
    """:func:`flash_msa.worklist.blocks`, bit for bit (``start`` / ``end`` laid out as the two
    rows ``[:, :NB]`` of a ``(2, ceil(NB / 4) * 4)`` int32 block, ``seq_first`` int32 after it
    in the same allocation): one launch of :class:`BlocksSm90` where
    :func:`can_implement_blocks` allows it, else the torch function.

    Raises:
        ValueError naming the argument: ``cu_seqlens`` not a 1-D int32 / int64 tensor of at
        least 2 values, ``block_size < 1``, ``total_tokens < 0``.
    """
    _validate_blocks(cu_seqlens, block_size, total_tokens)
    if can_implement_blocks(cu_seqlens, block_size, total_tokens) is not None:
        return worklist.blocks(cu_seqlens, block_size, total_tokens)
    dev = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    NB = total_tokens // block_size + N
    NBp = -(-NB // 4) * 4
    buf = torch.empty(2 * NBp + N, dtype=torch.int32, device=dev)  # start, end, seq_first
    a = buf.data_ptr()
    _launch(BLOCKS, dev, cu_seqlens.data_ptr(), a, a + NBp * 4, a + 2 * NBp * 4, N, NB, block_size)
    # (as_strided: one view op each, ~1.5 us on this CPU; the rows of a (2, NBp) view took 3)
    return worklist.Blocks(
        buf.as_strided((NB,), (1,)), buf.as_strided((NB,), (1,), NBp),
        buf.as_strided((N,), (1,), 2 * NBp), NB, block_size,
    )  # fmt: skip


def _item_counts(sl: worklist.Lists, TW: int) -> tuple[int, int, int]:
    """``(L, W, W')`` of :func:`worklist.items`."""
    L = sl.heads * sl.num_blocks
    W = (sl.rows * sl.heads * sl.slots) // TW + L
    return L, W, W + W % 2


def can_implement_items(sorted_lists: worklist.Lists, TW: int) -> str | None:
    """Why :func:`items` falls back to ``worklist.items`` (``None``: the kernels run):
    ``bounds`` a contiguous int64 ``(L + 1,)`` tensor with ``L >= 1``, ``TW``, ``W'`` and ``L``
    within :data:`MAX_SIZE`, an sm_90 GPU."""
    b = sorted_lists.bounds
    L, W, Wp = _item_counts(sorted_lists, TW)
    if b.dtype != torch.int64 or not b.is_contiguous() or b.dim() != 1 or b.numel() != L + 1:
        return (
            f"sorted_lists.bounds must be a contiguous int64 (L + 1,) = ({L + 1},) tensor, got "
            f"{b.dtype} {tuple(b.shape)} with strides {b.stride()}"
        )
    if L < 1:
        return "no lists (Hs * NB = 0)"
    if max(TW, Wp + -(-W // 4) * 4 + L) > MAX_SIZE:
        return f"{Wp} items (TW {TW}) exceed the kernels' {MAX_SIZE}"
    return _device_reason(b.device)


def items(sorted_lists: worklist.Lists, TW: int) -> worklist.WorkList:
    """:func:`flash_msa.worklist.items`, bit for bit (``item_list`` int32 ``(W,)``,
    ``item_start`` / ``item_end`` the two rows ``[:, :W]`` of one ``(2, W')`` int64 buffer, the
    empty items past the last ``[0, 0)`` of list ``L - 1``): two launches (:class:`ItemEndsSm90`
    then :class:`ItemsSm90`) where :func:`can_implement_items` allows it, else the torch
    function. ``item_list`` is the first W entries of an int32 buffer whose tail (``L``
    values, after W rounded up to 4) holds the scan's ``items_end``: one allocation less.

    Raises:
        TypeError if ``sorted_lists`` is not a :class:`~flash_msa.worklist.Lists`; ValueError
        naming ``TW`` for ``TW < 1`` (or not an int).
    """
    if not isinstance(sorted_lists, worklist.Lists):
        raise TypeError(
            f"sorted_lists: must be a flash_msa.worklist.Lists, not {type(sorted_lists).__name__}"
        )
    if not isinstance(TW, int) or TW < 1:
        raise ValueError(f"TW: the entries per item must be >= 1, got {TW!r}")
    if can_implement_items(sorted_lists, TW) is not None:
        return worklist.items(sorted_lists, TW)
    sl = sorted_lists
    L, W, Wp = _item_counts(sl, TW)
    b = sl.bounds
    dev = b.device
    W4 = -(-W // 4) * 4
    buf = torch.empty(W4 + L, dtype=torch.int32, device=dev)  # item_list, then items_end
    span = torch.empty((2, Wp), dtype=torch.int64, device=dev)
    lst, ends, starts = buf.data_ptr(), buf.data_ptr() + W4 * 4, span.data_ptr()
    _launch(ITEM_ENDS, dev, b.data_ptr(), ends, L, TW)
    _launch(ITEMS, dev, b.data_ptr(), ends, lst, starts, starts + Wp * 8, L, W, Wp, TW)
    return worklist.WorkList(
        sl.perm, buf.as_strided((W,), (1,)), span.as_strided((W,), (1,)),
        span.as_strided((W,), (1,), Wp), sl.block_start, sl.block_end, sl.num_blocks, W,
        sl.slots, sl.heads, sl.q_map, TW,
    )  # fmt: skip


def can_implement_lists(indices, cu_seqlens, block_size, tok0=0, total_tokens=None,
                        q_map=None, key_blocks=None, chunk=None) -> str | None:  # fmt: skip
    """Why :func:`lists` falls back to ``worklist.lists`` (``None``: the kernels run): no
    ``chunk``, no ``q_map``; ``indices`` contiguous int32, ``cu_seqlens`` (and ``key_blocks``'
    ``seq_first``) contiguous int32 on its device, the blocks within :func:`blocks`' kernel
    (when it makes them), ``C * Hs * K``, ``tok0 + C`` and ``Hs * NB + 1`` within
    :data:`MAX_SIZE`, an sm_90 GPU."""
    if chunk is not None:
        return "chunk: the chunked sort (one_sort) stays in torch"
    if q_map is not None:
        return "q_map: the mapped rows stay in torch"
    C, Hs, K = indices.shape
    if indices.dtype != torch.int32 or not indices.is_contiguous():
        return f"indices must be contiguous int32, got {indices.dtype} strides {indices.stride()}"
    total = C if total_tokens is None else total_tokens
    if key_blocks is None:
        why = can_implement_blocks(cu_seqlens, block_size, total)
        if why is not None:
            return why
        NB = total // block_size + cu_seqlens.numel() - 1
    else:
        NB = key_blocks.num_blocks
        f = key_blocks.seq_first
        if f.dtype != torch.int32 or not f.is_contiguous() or f.device != indices.device:
            return "key_blocks.seq_first must be a contiguous int32 tensor on the indices' device"
        if cu_seqlens.dtype != torch.int32 or not cu_seqlens.is_contiguous():
            return f"cu_seqlens must be contiguous int32, got {cu_seqlens.dtype}"
    if cu_seqlens.device != indices.device:
        return f"cu_seqlens is on {cu_seqlens.device}, indices on {indices.device}"
    if max(C * Hs * K, tok0 + C, Hs * NB + 1) > MAX_SIZE:
        return f"{C * Hs * K} entries or {Hs * NB} lists exceed the kernels' {MAX_SIZE}"
    return _device_reason(indices.device)


def lists(
    indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    tok0: int = 0,
    total_tokens: int | None = None,
    q_map: torch.Tensor | None = None,
    key_blocks: worklist.Blocks | None = None,
    chunk: int | None = None,
) -> worklist.Lists:
    """:func:`flash_msa.worklist.lists`, bit for bit (arguments as there): for ``chunk=None``
    and ``q_map=None`` the keys by :class:`ListKeysSm90`, ``torch.sort(stable=True)`` as there,
    ``bounds`` by :class:`ListBoundsSm90` (and the blocks by :func:`blocks` when not given)
    where :func:`can_implement_lists` allows it, else the torch function.

    Raises:
        ValueError naming the argument: ``indices`` not a 3-D tensor, bad ``cu_seqlens`` /
        ``block_size`` / ``total_tokens`` (as :func:`blocks`), ``tok0 < 0``, ``key_blocks``
        made for another block size; ``chunk < 1`` as ``worklist.lists``.
    """
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3:
        raise ValueError(
            f"indices: must be a (C, Hs, K) tensor, got {getattr(indices, 'shape', indices)!r}"
        )
    total = indices.shape[0] if total_tokens is None else total_tokens
    _validate_blocks(cu_seqlens, block_size, total)
    _int("tok0", tok0, 0)
    why = can_implement_lists(
        indices, cu_seqlens, block_size, tok0, total_tokens, q_map, key_blocks, chunk
    )
    if why is not None:
        return worklist.lists(
            indices, cu_seqlens, block_size, tok0, total_tokens, q_map, key_blocks, chunk
        )
    if key_blocks is None:
        key_blocks = blocks(cu_seqlens, block_size, total)
    elif key_blocks.block_size != block_size:
        raise ValueError(
            f"key_blocks: made for block_size {key_blocks.block_size}, not {block_size}"
        )
    C, Hs, K = indices.shape
    dev = indices.device
    NB, N, E = key_blocks.num_blocks, cu_seqlens.numel() - 1, C * Hs * K
    L = Hs * NB
    key = torch.empty(E, dtype=torch.int32, device=dev)
    if E:
        _launch(
            LIST_KEYS, dev, indices.data_ptr(), cu_seqlens.data_ptr(),
            key_blocks.seq_first.data_ptr(), key.data_ptr(), E, Hs * K, K, N, NB, L, tok0,
        )  # fmt: skip
    sorted_key, perm = torch.sort(key, stable=True)
    if tok0:
        perm += tok0 * Hs * K
    if E == 0:  # no entries: every list is [0, 0) (no launch on an empty key buffer, whose
        # address may be null)
        bounds = torch.zeros(L + 1, dtype=torch.int64, device=dev)
    else:
        bounds = torch.empty(L + 1, dtype=torch.int64, device=dev)
        _launch(LIST_BOUNDS, dev, sorted_key.data_ptr(), bounds.data_ptr(), E, L)
    return worklist.Lists(
        perm, bounds, key_blocks.start, key_blocks.end, NB, K, Hs, None, tok0, C, block_size
    )


def chunk_items(sorted_lists: worklist.Lists, TW: int) -> tuple[worklist.WorkList, ...]:
    """:func:`flash_msa.worklist.chunk_items` itself (the chunked forward's cut, long context:
    GPU-bound there, so it stays in torch); here so that this module is a whole work-list
    build (``sparse_forward.Stages.work``)."""
    return worklist.chunk_items(sorted_lists, TW)


_WIDTH = {Int32: 4, Int64: 8}  # bytes: each pointer's assumed alignment (its element)


def launch_arguments(kernel, *values):
    """The arguments of a launch of ``kernel`` (one of this module's kernel objects): its
    ``POINTERS`` device addresses (ints) as typed global pointers aligned to their element,
    then its ``COUNTS`` counts as ``Int32``, then the stream (``values`` in that order). The
    types depend on the kernel's class alone, so the compile cache keys on the kernel object
    and the compile check compiles what runs (``compile_check.compile_worklist``)."""
    n, c = len(kernel.POINTERS), kernel.COUNTS
    if len(values) != n + c + 1:
        raise TypeError(f"{type(kernel).__name__}: {n} addresses, {c} counts and a stream")
    gmem = cute.AddressSpace.gmem
    ptrs = [
        make_ptr(dt, a, gmem, assumed_align=_WIDTH[dt]) for dt, a in zip(kernel.POINTERS, values)
    ]
    return (*ptrs, *[Int32(v) for v in values[n : n + c]], values[-1])


# the disk cache's text for the argument types: fixed by the kernel object and this module's
# source (both in the disk key); launches go through launch.run_typed
LAUNCH_SIGNATURE = "worklist_sm90.launch_arguments"

def _launch(kernel, device: torch.device, *values) -> None:
    """Launch ``kernel`` on ``device``'s current stream with ``values`` (its addresses and
    counts, :func:`launch_arguments`' order) through ``launch.run_typed``. The TVM-FFI call
    takes these ints as they are (tests/cute_host/test_worklist.py checks that they equal
    ``ffi_args`` of the typed arguments), so the typed arguments (``Int32(v)`` ~2.8 us and
    ``make_ptr`` ~2.1 us each on this CPU: 11.4 us for blocks' seven) are built only for the
    compile: no per-launch conversion and no cache of them."""
    strm = stream(device)
    typed = lambda: launch_arguments(kernel, *values, strm)  # noqa: E731
    run_typed(kernel, device, typed, LAUNCH_SIGNATURE, (*values, strm))
