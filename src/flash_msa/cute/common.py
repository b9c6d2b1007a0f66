"""Helpers shared by the CuTe kernels: a register-fragment view, and the host side of a launch
(CuTe views of torch tensors, the current stream, compiled functions cached per static key)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View a thread's m64nNk16 accumulator ``((2, 2, V), M, N)`` as ``(rows, cols)``.

    Mode 0 of the fragment is (column pair, row half, 8-column group): a thread holds two rows
    and, for each, columns ``2 * (lane % 4) + {0, 1} + 8 * v``, so the column index ``c`` of the
    view ascends with the key column."""
    s, d = t.layout.shape, t.layout.stride
    shape = ((s[0][1], s[1]), (s[0][0], s[0][2], s[2]))
    stride = ((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def tma_tiles(atom, s: cute.Tensor, g: cute.Tensor):
    """``(shared, global)`` views of one-CTA TMA copy ``atom`` (no multicast) for a shared tile
    ``s`` and global tile(s) ``g`` whose first two modes are one TMA box (traced inline)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
    )


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached (DLPack refuses autograd leaves), copied if its base is not 16-byte
    aligned (TMA boxes and 16-byte cp.async need it; a view into a larger buffer may not be)."""
    x = x.detach()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def cute_tensor(t: torch.Tensor):
    """A CuTe view of CUDA tensor ``t`` with a run-time outermost size (no recompilation when
    the token or sequence count changes); other sizes stay static.

    The mode order is given outermost first by descending stride, ties to the lower mode (what
    CuTe deduces; ``Tensor.dim_order()`` differs when a size-1 mode repeats a stride)."""
    from cutlass.cute.runtime import from_dlpack

    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    ct = from_dlpack(t, assumed_align=16)
    return ct.mark_compact_shape_dynamic(mode=0, stride_order=order, divisibility=1)


def stream(device: torch.device) -> cuda.CUstream:
    """torch's current stream on ``device``, for a launch."""
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


_compiled: dict = {}


def launch(host, key: tuple, runtime: tuple, static: tuple = ()):
    """Run jit function ``host(*runtime, *static)``, compiling it once per ``key`` (the static
    configuration: dtypes, dims, head counts, constexprs, device); ``runtime`` values vary
    freely between calls."""
    fn = _compiled.get((host, key))
    if fn is None:
        fn = cute.compile(host, *runtime, *static)
        _compiled[(host, key)] = fn
    fn(*runtime)
