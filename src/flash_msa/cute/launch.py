"""The host side of a CuTe launch: CuTe views and typed pointers of torch tensors, the current
stream, and the compile cache keyed by everything a compiled kernel bakes in (the kernel object,
its argument layout, the device), in-process here and on disk (:mod:`.disk_cache`). Host modules
(one per op) import this and the kernel modules; kernel modules never import it."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import re
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float16, Int32
from cutlass.cute.runtime import from_dlpack, make_ptr

from . import disk_cache
from .common import ALIGN, PointerTensors


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached (DLPack refuses autograd leaves), copied if its base is not 16-byte
    aligned (TMA boxes and 16-byte cp.async need it; a view into a larger buffer may not be)."""
    x = x.detach()
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


def cute_tensor(t: torch.Tensor):
    """A CuTe view of CUDA tensor ``t`` (base 16-byte aligned) with a run-time outermost size
    (no recompilation when the token or sequence count changes); other sizes stay static.

    The mode order is given outermost first by descending stride, ties to the lower mode (what
    CuTe deduces; ``Tensor.dim_order()`` differs when a size-1 mode repeats a stride)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    ct = from_dlpack(t, assumed_align=ALIGN)
    ct = ct.mark_compact_shape_dynamic(mode=0, stride_order=order, divisibility=1)
    # the view's static signature is a function of the tensor's dtype, inner sizes and strides
    # (mode 0's size is run-time): kept per those and attached, so each launch's compile-cache
    # key does not read the view's properties again (14 us per tensor on the CPU here, most of
    # it ``element_type``: 207 -> 15 us for 15 views; ~50 views per training step)
    key = (t.dtype, tuple(t.shape[1:]), t.stride(), t.device.type)
    sig = _VIEW_SIGNATURES.get(key)
    if sig is None:
        if len(_VIEW_SIGNATURES) > 4096:  # (a bound: layouts are few, but never grow forever)
            _VIEW_SIGNATURES.clear()
        sig = _VIEW_SIGNATURES[key] = view_signature(ct)
    ct._flash_msa_signature = sig
    return ct


_VIEW_SIGNATURES: dict = {}


def view_signature(x) -> tuple:
    """:func:`static_signature` of a CuTe tensor view, read from the view itself."""
    shape = tuple(None if d else n for n, d in zip(x.shape, x.dynamic_shapes_mask))
    stride = tuple(None if d else n for n, d in zip(x.stride, x.dynamic_strides_mask))
    return type(x), x.element_type, x.memspace, shape, stride


def view_layout(t: torch.Tensor) -> tuple | None:
    """``(element type, shape, stride)`` of :func:`cute_tensor`'s view of ``t`` (shape[0]
    ``None``: the run-time size), or ``None`` where the view has another run-time value (a
    stride that ``mark_compact_shape_dynamic`` derives from mode 0's size: mode 0 is not the
    outermost). Kept per ``(dtype, inner sizes, strides, device type)``; the view is made only
    the first time a layout is seen. A pointer launch (:func:`pointer_arguments`) rebuilds the
    same view inside its ``@cute.jit`` function from this and a run-time size.

    The sizes and strides are read from the view's layout text (``__cache_key__``), the
    layout the compiled code got: the view's ``stride`` and ``dynamic_strides_mask`` differ
    from it (nvidia-cutlass-dsl here): a size-1 mode has stride 0 in the layout (torch's
    ``(T, 128, 1)`` keys with strides ``(128, 1, 128)``: ``(?,128,1):(128,1,0)``) and a
    run-time stride has mask 0 (``(?,128,4):(4,?{i64 div=4},1)``). Where the text has an
    unknown form, the view's ``shape`` / ``stride`` and the order rule stand in."""
    key = (t.dtype, tuple(t.shape[1:]), t.stride(), t.device.type)
    layout = _VIEW_LAYOUTS.get(key, _UNSEEN)  # (one read: another thread may clear the dict)
    if layout is not _UNSEEN:
        return layout
    try:
        view = cute_tensor(t)
    except RuntimeError:  # (the DSL refuses a non-compact view, e.g. q of a fused qkv tensor)
        return None  # pointer_arguments names the tensor
    dtype = view._flash_msa_signature[1]
    parsed = _LAYOUT_TEXT.search(view.__cache_key__[2])
    if parsed is not None:
        shape, stride = (
            tuple(None if a.startswith("?") else int(a) for a in _LAYOUT_ITEM.findall(g))
            for g in parsed.groups()
        )
        static = len(shape) == len(stride) == t.dim() and None not in shape[1:] + stride
    else:  # (an unknown text: mode 0 outermost in cute_tensor's order means every stride static)
        _, _, _, shape, stride = view._flash_msa_signature
        static = min(range(t.dim()), key=lambda d: (-t.stride(d), d)) == 0
    layout = (dtype, shape, stride) if static and shape[0] is None else None
    if len(_VIEW_LAYOUTS) > 4096:  # (a bound: layouts are few, but never grow forever)
        _VIEW_LAYOUTS.clear()
    _VIEW_LAYOUTS[key] = layout
    return layout


# a flat layout's text at the end of a view's cache key, "(?,128,1):(128,1,0)", and its items
_LAYOUT_TEXT = re.compile(r"\(([^()]*)\):\(([^()]*)\)$")
_LAYOUT_ITEM = re.compile(r"\?(?:\{[^}]*\})?|-?\d+")
_VIEW_LAYOUTS: dict = {}
_UNSEEN = object()


def pointer_arguments(module: str, names: tuple, tensors: tuple, device: torch.device):
    """``(views, PointerTensors)`` of a pointer launch of ``tensors`` (torch tensors, CUDA but
    on CPU stand-ins): per tensor its :func:`view_layout` (``views``: the compiled code bakes
    it in, so it belongs in the kernel object), a global-memory pointer of the view's element
    type with the view's :data:`ALIGN` (``cute.runtime.make_ptr``: ~1 us, where a DLPack view
    took 10 us on this CPU and 20-40 on the H200 host's) and mode 0's size as an ``Int32``.
    Raises ValueError naming ``module`` and the tensor (``names``) for a base that is not
    16-byte aligned, a tensor on another device, or a layout with a run-time stride (the
    pointer launches bake every stride but mode 0's size in: the caller passes tensors whose
    outermost mode is mode 0, e.g. contiguous ones). Kept per exact launch (module, device and
    every tensor's address, sizes, strides, dtype and device): a repeated launch gets the same
    objects (:data:`POINTER_CACHE_SIZE` launches, least recently used dropped first)."""
    # Why a cache: the result is a function of the
    # module (the ValueError's text) and, per tensor, of its address, sizes, strides,
    # dtype and device (view, pointer and mode-0 size; the device check), all in the key, so a
    # hit is the result a fresh call gives, and only tensors that passed the checks are ever
    # stored. The caching allocator hands a steady-state training step the same addresses, so
    # its launches hit. The objects are read-only to a launch (``_Pointer.__c_pointers__``
    # returns its one cached list; ``Integer``'s makes a new ctypes value per call; the
    # executor copies both into a new argument list) and hold no tensor: safe to hand to
    # several launches and threads (a kept result also went through a second cute.compile
    # unchanged). This CPU (2 shared cores; timeit, min of 7, best of 6 runs): the forward
    # partials' 14 tensors 85 -> 14 us per call, the backward's 21 123 -> 20 us; a miss costs
    # the key on top (partials 95, backward 141 us).
    key = (
        module, device,
        *[(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors],
    )  # fmt: skip
    hit = _POINTERS.get(key)
    if hit is not None:
        try:
            _POINTERS.move_to_end(key)
        except KeyError:  # (another thread evicted it meanwhile: the result stands)
            return hit
        return hit
    gmem = cute.AddressSpace.gmem
    views, pointers, sizes = [], [], []
    for name, t in zip(names, tensors):
        if t.device != device:
            raise ValueError(f"{module}: {name} is on {t.device}, not {device}")
        address = t.data_ptr()
        if address % ALIGN:
            raise ValueError(f"{module}: {name}'s base is not {ALIGN}-byte aligned ({address:#x})")
        view = view_layout(t)
        if view is None:
            raise ValueError(
                f"{module}: {name} {tuple(t.shape)} with strides {t.stride()} has no static "
                "view (its mode 0 is not the outermost, or it is not compact): pass a "
                "contiguous tensor"
            )
        if t.shape[0] >= 2**31:  # (mode 0's size is an Int32 kernel argument)
            raise ValueError(f"{module}: {name} has {t.shape[0]} rows, more than 2**31 - 1")
        views.append(view)
        pointers.append(make_ptr(view[0], address, gmem, assumed_align=ALIGN))
        sizes.append(Int32(t.shape[0]))
    result = tuple(views), PointerTensors(tuple(pointers), tuple(sizes))
    _POINTERS[key] = result
    while len(_POINTERS) > POINTER_CACHE_SIZE:
        try:
            _POINTERS.popitem(last=False)  # the least recently used launch
        except KeyError:  # (emptied by another thread)
            break
    return result


# pointer_arguments' results, least recently used first. A training step makes about four
# pointer launches per layer (selection, forward partials, KL, backward), each with its own
# addresses: 1024 keep a 256-layer step's (a cyclic pattern longer than the bound misses every
# time: LRU, each miss ~10-18 us dearer than no cache). ~11 KB per backward entry on this CPU
# (tracemalloc): ~11 MB of host memory at most.
POINTER_CACHE_SIZE = 1024
_POINTERS: collections.OrderedDict = collections.OrderedDict()


def specimen_makers(kernel_dtype, tokens: int):
    """``(x, z, keys)`` for a kernel's specimen tensors (``compile_check``: CPU stand-ins of a
    launch's tensors, whose layouts alone matter to a compile): ``x`` the torch dtype of the kernel's bf16 / fp16
    element type, ``z(*shape, dtype=fp32)`` a zero tensor, ``keys(heads, dim)`` the ``(tokens,
    dim, heads)`` view of contiguous ``(tokens, heads, dim)`` keys of dtype ``x`` (a TMA box
    = one head's block)."""
    x = {BFloat16: torch.bfloat16, Float16: torch.float16}[kernel_dtype]

    def z(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)

    def keys(heads, dim):
        return z(tokens, heads, dim, dtype=x).permute(0, 2, 1)

    return x, z, keys


def bound(kernel, views: tuple):
    """``kernel`` (a frozen dataclass with a ``views`` field) with ``views`` set: the object a
    pointer launch compiles and keys on (:func:`run_typed`), kept per ``(kernel, views)`` so a
    launch does not rebuild it (``dataclasses.replace`` re-runs its checks: tens of us)."""
    key = (kernel, views)
    k = _BOUND.get(key)
    if k is None:
        if len(_BOUND) > 4096:  # (a bound: configurations are few, but never grow forever)
            _BOUND.clear()
        k = _BOUND[key] = dataclasses.replace(kernel, views=views)
    return k


_BOUND: dict = {}


class RawStream(int):
    """A CUDA stream handle (``cudaStream_t`` as an int), a launch's stream argument: what a
    TVM-FFI launch takes (:func:`run_typed`); its compile sees a ``cuda.CUstream`` of it."""

    __slots__ = ()


def stream(device: torch.device) -> RawStream:
    """torch's current stream on ``device``, for a launch. (torch's raw-handle accessor: the H200
    host's step timing measured ~17 us a call for ``cuda.CUstream(torch.cuda.current_stream(
    device).cuda_stream)``, a Python stream object and a cuda-python wrapper per launch;
    benchmarks/host_breakdown.py.)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return RawStream(torch._C._cuda_getCurrentRawStream(index))


def builder_signature(builder) -> str:
    """The text that stands for a launch's argument layout in the disk cache's key
    (:func:`run_typed`'s ``signature``): the qualified name of ``builder`` (a host module's
    ``<op>_arguments``) and a hash of the source of its module and of this one. The kernel's
    own module is in the key already (``disk_cache.source_hash``); the builder lives in a host
    module, so a change to how it types the arguments changes the key too."""
    h = hashlib.sha256()
    for path in (inspect.getsourcefile(builder), __file__):
        h.update(Path(path).read_bytes() + b"\0")
    return f"{builder.__module__}.{builder.__qualname__}:{h.hexdigest()[:16]}"


_compiled: dict = {}


def run_typed(kernel, device: torch.device, args: tuple, signature: str, ffi=None) -> None:
    """Call ``kernel(*args)`` where the kernel object fixes every argument's type (raw
    pointers, scalars and the stream, built by its host module's ``<op>_arguments``): the kernel
    object is then the whole in-process key, and ``signature``, a fixed text naming that
    builder, stands for the argument layout in the disk cache's key. No DLPack views.

    Compiled with TVM-FFI (:data:`FFI_OPTIONS`) and called with plain values (:func:`ffi_args`:
    device addresses and sizes as ints, scalars as Python numbers, the stream handle): the
    call is one C function call instead of the DSL executor's Python argument packing. The
    H200 host (benchmarks/host_breakdown.py --launch-ab, the row-delta kernel, 5 arguments):
    10.9 us a launch through the executor, 4.1 through TVM-FFI; inside the anchor-16K eager
    step the five launches' ``run_typed`` took 410 us in all.

    ``ffi``: the call's values when the caller has them already (``ffi_args(args)``, e.g. the
    ints it would build ``args`` from: cute/worklist_host.py); ``args`` may then be a function
    returning the typed tuple, called only when the kernel is compiled (its types are all the
    compile reads), so a launch builds no typed argument at all."""
    if ffi is None and callable(args):
        raise TypeError("run_typed: a function for args needs the call's values (ffi)")
    key = (type(kernel), kernel, signature, device.index)
    fn = _compiled.get(key)
    if fn is None:
        major, minor = torch.cuda.get_device_capability(device)
        typed = args() if callable(args) else args
        fn = disk_cache.compiled(
            kernel, compile_arguments(typed), signature, f"sm_{major}{minor}", FFI_OPTIONS
        )
        _compiled[key] = fn
    fn(*(ffi_args(args) if ffi is None else ffi))


# TVM-FFI launches (apache-tvm-ffi, a dependency): the compiled function takes ints for typed
# pointers, Python numbers for DSL scalars, nested tuples for tuple arguments, an int stream
FFI_OPTIONS = disk_cache.TVM_FFI


def compile_arguments(args: tuple) -> tuple:
    """``args`` as ``cute.compile`` takes them: a :class:`RawStream` as a ``cuda.CUstream``."""
    return tuple(cuda.CUstream(int(a)) if type(a) is RawStream else a for a in args)


def _ffi_value(a):
    conv = _FFI_CONVERT.get(type(a))
    if conv is not None:
        return conv(a)
    if isinstance(a, cutlass.Numeric):  # Int32, Float32, ...: the Python value
        return a.value
    if isinstance(a, tuple):
        return tuple(_ffi_value(x) for x in a)
    if isinstance(a, cute.Pointer):
        return int(a.__tvm_ffi_opaque_ptr__())
    return a  # ints, floats, RawStream: as they are


def _ffi_pointer_tensors(pt: PointerTensors) -> tuple:
    hit = _FFI_POINTERS.get(id(pt))
    if hit is not None and hit[0] is pt:
        return hit[1]
    value = (tuple(int(p.__tvm_ffi_opaque_ptr__()) for p in pt.pointers),
             tuple(s.value for s in pt.sizes))  # fmt: skip
    if len(_FFI_POINTERS) >= 2 * POINTER_CACHE_SIZE:
        _FFI_POINTERS.clear()  # (the pointer cache keeps at most POINTER_CACHE_SIZE alive)
    _FFI_POINTERS[id(pt)] = (pt, value)
    return value


# a PointerTensors' (ints, sizes), per object: pointer_arguments hands a repeated launch the same
# object, so its conversion is one dict lookup (the object is held, so its id is not reused)
_FFI_POINTERS: dict = {}
_FFI_CONVERT = {
    PointerTensors: _ffi_pointer_tensors, RawStream: int, cuda.CUstream: int,
    Int32: lambda a: a.value,
}  # fmt: skip


def ffi_args(args: tuple) -> tuple:
    """``args`` (an ``<op>_arguments``' typed tuple) as the TVM-FFI function takes them."""
    return tuple(_ffi_value(a) for a in args)
