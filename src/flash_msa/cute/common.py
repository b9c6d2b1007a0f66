"""Device helpers shared by the CuTe kernels: register-fragment views, the one-CTA TMA
partition, the row-gather copy, the views of a work list and of a pointer launch's tensors
inside a ``@cute.jit`` function. Kernel modules import this and nothing host-side; the host side
of a launch (views and pointers of torch tensors, the stream, the compile cache) is
:mod:`.launch`."""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16
from cutlass.cute.nvgpu import cpasync

ALIGN = 16  # bytes: every CuTe view and pointer of a launch (launch.py) assumes this base alignment


ALIGN = 16  # bytes: every CuTe view made by cute_tensor assumes this base alignment


class WorkItems(NamedTuple):
    """CuTe views of the six tensors of a work list (:class:`flash_msa.worklist.WorkList`)."""

    perm: cute.Tensor  # (E,) int64 flat entries token * Hs * K + head * K + slot
    item_list: cute.Tensor  # (W,) int32 list id p * NB + global block of each work item
    item_start: cute.Tensor  # (W,) int64 first entry of the item (into perm)
    item_end: cute.Tensor  # (W,) int64 one past its last entry
    block_start: cute.Tensor  # (NB,) int32 packed position of each global block's first key
    block_end: cute.Tensor  # (NB,) int32 one past its last key


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View a thread's m64nNk16 accumulator ``((2, 2, V), M, N)`` as ``(rows, cols)``.

    Mode 0 of the fragment is (column pair, row half, 8-column group): a thread holds two rows
    and, for each, columns ``2 * (lane % 4) + {0, 1} + 8 * v``, so the column index ``c`` of the
    view ascends with the key column."""
    s, d = t.layout.shape, t.layout.stride
    shape = ((s[0][1], s[1]), (s[0][0], s[0][2], s[2]))
    stride = ((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def acc_as_a(t: cute.Tensor) -> cute.Tensor:
    """A ``((2, 2, V), M, N)`` accumulator-shaped register tensor as a wgmma register-A fragment
    ``((2, 2, 2), M, (V / 2, N))``: two neighbouring 8-column groups make one k16 slice."""
    s, d = t.layout.shape, t.layout.stride
    shape = ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2]))
    stride = ((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def tma_tiles(atom, s: cute.Tensor, g: cute.Tensor):
    """``(shared, global)`` views of one-CTA TMA copy ``atom`` (no multicast) for a shared tile
    ``s`` and global tile(s) ``g`` whose first two modes are one TMA box (traced inline)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
    )


def cutlass_dtype(dtype: torch.dtype):
    """The CuTe element type of a bf16 / fp16 torch dtype (``None`` for any other)."""
    return {torch.bfloat16: BFloat16, torch.float16: Float16}.get(dtype)


class PointerTensors(NamedTuple):
    """A pointer launch's tensors (:func:`pointer_arguments`): a typed pointer and the mode-0
    size of each, one ``@cute.jit`` argument. (A ``NamedTuple``: the compiled function packs
    its items without the DSL's per-item adapter lookup of a plain ``tuple`` argument, ~3 us
    an item on this CPU: 125 us for the backward's 42 when they were two tuples.)"""

    pointers: tuple  # cute.Pointer per tensor (global memory, the view's element type)
    sizes: tuple  # Int32 per tensor: mode 0's size


def pointer_tensors(tensors: PointerTensors, views: tuple) -> list:
    """Inside a ``@cute.jit`` launch: the tensors of :func:`pointer_arguments`, each at its
    pointer with its run-time mode-0 size and the static rest of its ``views`` entry
    (:func:`view_layout`: what :func:`cute_tensor` gave)."""
    out = []
    for pointer, size, (_, shape, stride) in zip(tensors.pointers, tensors.sizes, views):
        layout = cute.make_layout((size, *shape[1:]), stride=stride)
        out.append(cute.make_tensor(pointer, layout))
    return out


def row_gather_copy(dtype, threads: int, width: int):
    """The tiled cp.async copy that gathers rows of ``width`` elements of a 2-byte ``dtype``
    from global into shared memory: 16-byte pieces (8 elements), ``width / 8`` threads per
    row, ``threads`` threads in all (``threads * 8 / width`` rows per copy); L2 only
    (``cp.async.cg``: the gathered rows are read once per CTA). Built at trace time, inside a
    kernel's ``@cute.jit`` launch (the forward partials, the backward and the mapped selection
    gather their rows with it)."""
    tpr = width // 8  # threads per row: 16-byte pieces
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
            num_bits_per_copy=128,
        ),
        cute.make_layout((threads // tpr, tpr), stride=(tpr, 1)),
        cute.make_layout((1, 8)),
    )  # fmt: skip


