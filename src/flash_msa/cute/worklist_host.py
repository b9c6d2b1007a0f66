"""Host code of the CuTe work-list build: :func:`blocks`, :func:`lists` and :func:`items`,
bitwise what :func:`flash_msa.worklist.blocks`, :func:`~flash_msa.worklist.lists` and
:func:`~flash_msa.worklist.items` (``chunk=None``, ``q_map=None``) return, in one, two and two
launches of :mod:`.worklist_sm90`'s kernels (plus ``lists``' torch sort) where the torch
functions take 17, ~12 and 14 torch ops; with :func:`chunk_items`, a whole work-list build
(``sparse_forward.Stages.work``).

Why (benchmarks/host_breakdown.py on the H200, anchor 16K: T 16384, Hs 4, K 16, block 128, one
sequence): the eager training step is host-bound (6.1 ms of CUDA-event time against 4.75 ms of
kernels), and before the forward's partials launch its host time goes mostly to ``worklist``'s torch
glue: ``blocks()`` 360 us (17 ops), ``lists()`` 241 us, ``items()`` ~309 us per call (14 ops; once
in the forward, once in the backward with TW 128). A torch op costs ~20 us of host time inside the
step, a CuTe launch through ``launch.run_typed`` (TVM-FFI) ~4 us on its own. The values are the same
bit for bit, so each function here is a drop-in: the kernel where :func:`can_implement_blocks`
(``..._items``, ``..._lists``) allows the call, else the torch function (the reason is returned, not
raised).

Measured (H200, launches through the DSL's executor, one sequence, Hs 4, K 16, block 128;
every CuTe result first checked bitwise equal to torch's; host us = median perf_counter of one
call started on an idle GPU, torch -> CuTe): anchor 16K ``blocks`` 203 -> 21, ``lists``
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

Launches: raw device addresses (``cute.runtime.make_ptr``) and Int32 counts
(:func:`worklist_arguments`: the kernel object fixes every argument's type, so
``launch.run_typed`` keys on it alone), built for the compile only: the launch passes the ints
themselves (:func:`_launch`); the outputs in one ``torch.empty`` for ``blocks``, two for
``items`` and ``lists`` (with the sort's), written in full by the kernels (the padding columns
of ``blocks`` aside); no host synchronization, the current stream (CUDA-graph capturable).
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_ptr

from .. import worklist
from ..problem import capability
from .launch import builder_signature, run_typed, stream
from .worklist_sm90 import BlocksSm90, ItemEndsSm90, ItemsSm90, ListBoundsSm90, ListKeysSm90

MAX_SIZE = 2**30  # every count and index of a launch (sequences, blocks, lists, items, entries)

BLOCKS, ITEM_ENDS, ITEMS = BlocksSm90(), ItemEndsSm90(), ItemsSm90()  # the shipped tunings
LIST_KEYS, LIST_BOUNDS = ListKeysSm90(), ListBoundsSm90()


# ---------------------------------------------------------------------------------------------
# validation, the reasons to fall back, the launches
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


def worklist_arguments(kernel, *values):
    """The arguments of a launch of ``kernel`` (one of :mod:`.worklist_sm90`'s kernels): its
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


# the disk cache's text for the argument types (the kernel object and the kernel's module are
# in the key already); launches go through launch.run_typed
WORKLIST_SIGNATURE = builder_signature(worklist_arguments)


def _launch(kernel, device: torch.device, *values) -> None:
    """Launch ``kernel`` on ``device``'s current stream with ``values`` (its addresses and
    counts, :func:`worklist_arguments`' order) through ``launch.run_typed``. The TVM-FFI call
    takes these ints as they are (tests/cute_host/test_worklist.py checks that they equal
    ``ffi_args`` of the typed arguments), so the typed arguments (``Int32(v)`` ~2.8 us and
    ``make_ptr`` ~2.1 us each on this CPU: 11.4 us for blocks' seven) are built only for the
    compile: no per-launch conversion and no cache of them."""
    strm = stream(device)
    typed = lambda: worklist_arguments(kernel, *values, strm)  # noqa: E731
    run_typed(kernel, device, typed, WORKLIST_SIGNATURE, (*values, strm))
