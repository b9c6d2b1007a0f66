"""Compile every shipped CuTe kernel configuration for sm_90a without a GPU and report its
resources.

Run as ``python -m flash_msa.cute.compile_check [PREFIX] [--dump DIR] [--jobs N]``. Prints one
JSON line per configuration whose name starts with ``PREFIX`` (``select``, ``fwd``, ...): name,
registers (the launch count), stack and local bytes (spills appear as stack), whether the PTX
uses wgmma and TMA, and where it has ``setmaxnreg`` whether the SASS kept them. ``--dump DIR``
also writes each configuration's PTX and cubin there (``<name>.ptx`` / ``.cubin``, spaces as
``_``: for comparing two versions of a kernel). Exit status 1 if a configuration spills or
lost a ``setmaxnreg``.

The configurations are this module's data (``*_configurations``): each kernel the host code
can pick (``backward.kernel_for``, the stages of ``forward.forward_stages``, ``selection.select``, the
work list, the row delta), at the head layouts, dims, blocks and modes that change its code.

Results are kept by content (:func:`cached_report`): the key is the kernel object (every field,
its launch's static layouts), the source of the modules it is traced from
(``disk_cache.source_hash``), this module's source, the DSL's settings and the versions of the
toolchain (``disk_cache.env_text``), so an unchanged kernel is not compiled again; the entries
live in the disk cache's directory (``FLASH_MSA_CACHE_DIR``, off with ``FLASH_MSA_CACHE=0``) and
a ``--dump`` run always compiles. ``--jobs N`` compiles in N processes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream

from .. import quant
from ..cubin import resources as cubin_resources
from ..cubin import sass_counts
from . import (
    bwd_sm90,
    disk_cache,
    forward,
    quantize_sm90,
    row_delta_sm90,
    selection,
    worklist_host,
    worklist_sm90,
)
from .backward import bwd_arguments, kernel_for, row_delta_arguments
from .combine_sm90 import CombineSm90
from .fwd_kl_sm90 import FwdKlSm90
from .fwd_partials_sm90 import FwdPartialsSm90
from .launch import specimen_makers
from .quantize_sm90 import QuantizeSm90
from .row_delta_sm90 import RowDeltaSm90
from .select_sm90 import FP8_STAGES, SelectSm90

DTYPES = {
    "bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "e4m3": cutlass.Float8E4M3FN, None: None
}  # fmt: skip
COMPILE_OPTIONS = "--gpu-arch sm_90a --keep-cubin --keep-ptx"


def compile_kernel(kernel, *args, dump: str | None = None, name: str = "", mma=False) -> dict:
    """Compile kernel object ``kernel`` for sm_90a on specimen ``args``; cuobjdump's counts and
    whether the PTX uses wgmma and TMA; ``mma``: also the distinct wgmma instructions (e.g.
    ``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3``). Without ``dump`` the result of
    an unchanged kernel comes from the content cache (:func:`cached_report`)."""
    if dump:
        return _compile_kernel(kernel, *args, dump=dump, name=name, mma=mma)
    return cached_report(kernel, lambda: _compile_kernel(kernel, *args, mma=mma), mma)


def _compile_kernel(kernel, *args, dump: str | None = None, name: str = "", mma=False) -> dict:
    """:func:`compile_kernel`, compiled."""
    with tempfile.TemporaryDirectory() as tmp:  # (the kept files go there, not into the cwd)
        c = cute.compile(
            kernel, *args, options=f"{COMPILE_OPTIONS} --dump-dir={tmp}"
        )
        ptx, cubin = c.artifacts.PTX, c.artifacts.CUBIN
    if dump:
        stem = os.path.join(dump, name.replace(" ", "_"))
        with open(stem + ".ptx", "w") as f:
            f.write(ptx)
        with open(stem + ".cubin", "wb") as f:
            f.write(cubin)
    res = dict(
        cubin_resources(cubin),
        wgmma="wgmma.mma_async" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
    )
    if mma:
        res["mma"] = sorted(set(re.findall(r"\bwgmma\.mma_async[\w.]*", ptx)))
    ops = ("USETMAXREG", "HGMMA", "QGMMA", "WARPGROUP.DEPBAR")
    n = sass_counts(cubin, ops) if "setmaxnreg" in ptx or res["wgmma"] else {}
    if "setmaxnreg" in ptx:  # kept by ptxas? (it drops one it cannot honour, with a warning)
        res["setmaxnreg_kept"] = n["USETMAXREG"] == ptx.count("setmaxnreg.")
    if res["wgmma"]:
        # ptxas serializes a kernel's wgmmas when registers do not allow their overlap (warning
        # C7512): a wait after every MMA. Reported, not refused: the default WS backward at
        # anchor D = 128 is so, a lead for its speed
        mmas = n["HGMMA"] + n["QGMMA"]
        res["wgmma_waits"] = f"{n['WARPGROUP.DEPBAR']}/{mmas}"
        res["wgmma_serialized"] = mmas > 1 and n["WARPGROUP.DEPBAR"] >= mmas
    return res


def _report_path(kernel, mma: bool) -> Path | None:
    """The content cache's file of ``kernel``'s report (module docstring), ``None`` where the
    disk cache is off or the kernel has no process-independent text."""
    if not disk_cache.enabled():
        return None
    try:
        text = "\n".join((
            disk_cache.env_text(), disk_cache.stable_text(kernel), disk_cache.dsl_settings(),
            disk_cache.source_hash(disk_cache.kernel_modules(kernel)),
            Path(__file__).read_text(), str(mma),
        ))  # fmt: skip
    except disk_cache.Uncacheable:
        return None
    key = hashlib.sha256(text.encode()).hexdigest()
    return disk_cache.root() / "compile_check" / disk_cache.env_tag() / f"{key}.json"


def cached_report(kernel, compile_now, mma: bool = False) -> dict:
    """``compile_now()``'s report of ``kernel``, kept by content (:func:`_report_path`): read
    back where a trusted entry exists, else computed and stored (a file written whole, then
    renamed into place)."""
    path = _report_path(kernel, mma)
    if path is None:
        return compile_now()
    try:
        entry = disk_cache._trusted_dirs(path, create=True)
    except disk_cache.Untrusted as e:
        disk_cache._refuse(e)
        return compile_now()
    try:
        return json.loads(entry.read_text())
    except (OSError, ValueError):
        pass
    res = compile_now()
    fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(res, f)
    os.replace(tmp, entry)
    return res


def compile_memory_bound(kernel, launch_arguments, addresses: int, counts=(1,), *, dump=None,
                         name: str = "") -> dict:  # fmt: skip
    """Compile a memory-bound pointer-launch kernel (the combine, the quantize pass, the row
    delta: no MMA, no TMA) for sm_90a on ``launch_arguments(kernel, *addresses dummy device
    addresses, *counts, stream)``, the arguments its host function passes; cuobjdump's counts
    (:func:`compile_kernel`) with ``wgmma``/``tma`` False."""
    a = 1 << 20  # a dummy address, 16-byte aligned
    args = launch_arguments(kernel, *(a,) * addresses, *counts, make_fake_stream())
    return dict(compile_kernel(kernel, *args, dump=dump, name=name), wgmma=False, tma=False)


def kernel_dtype(name: str | None):
    """The CuTe element type of a configuration's dtype name (``None``: ``None``)."""
    return DTYPES[name]


# ---------------------------------------------------------------------------------------------
# specimen launches: each kernel on CPU stand-ins of the tensors its host code passes
# ---------------------------------------------------------------------------------------------
def select_specimens(kernel: SelectSm90, tokens: int = 4) -> tuple:
    """CPU stand-ins (zero-filled) of a selection launch's tensors
    (``selection.launch_tensor_names``) in the layouts ``select_into`` / ``select_fp8_into``
    pass, ``tokens`` rows each: the ``(T, Dp, heads)`` views of contiguous proxy tensors,
    ``cu_seqlens``, ``indices (T, Hp, K)`` int32, the query map's three int32 vectors or the
    key scales ``(T, Hpk)`` fp32. Only their layouts matter to a compile."""
    T, Dp, Hp, Hpk, K = tokens, kernel.proxy_head_dim, kernel.heads, kernel.k_heads, kernel.top_k
    x = {
        cutlass.BFloat16: torch.bfloat16, cutlass.Float16: torch.float16,
        cutlass.Float8E4M3FN: torch.float8_e4m3fn,
    }[kernel.dtype]  # fmt: skip
    i32 = torch.int32
    tensors = (
        torch.zeros((T, Hp, Dp), dtype=x).permute(0, 2, 1),
        torch.zeros((T, Hpk, Dp), dtype=x).permute(0, 2, 1),
        torch.zeros((T,), dtype=i32),
        torch.zeros((T, Hp, K), dtype=i32),
    )
    if kernel.key_scale is not None:
        return (*tensors, torch.zeros((T, Hpk)))
    if kernel.qmap:
        return (*tensors, *(torch.zeros((T,), dtype=i32) for _ in range(3)))
    return tensors


def fwd_specimens(kernel: FwdPartialsSm90, tokens: int = 4) -> tuple:
    """CPU stand-ins (zero-filled) of a forward-partials or KL launch's tensors
    (``forward.launch_tensor_names``) in the layouts ``forward.launch_partials`` /
    ``forward.kl`` pass,
    ``tokens`` rows each: ``(T*H, D)`` / ``(T*Hs, Dp)`` rows, the ``(T, D, Hkv)`` / ``(T, Dp,
    Hpk)`` views of contiguous keys, the work list (int64 / int32), the partial buffers or the
    LSEs and sums (fp32), the map of a ``qmap`` kernel."""
    T, H, Hkv, Hs, D = tokens, kernel.heads, kernel.kv_heads, kernel.sel_heads, kernel.head_dim
    Hpk, Dp = kernel.proxy_k_heads, kernel.proxy_head_dim
    x, z, keys = specimen_makers(kernel.dtype, T)

    i32, i64 = torch.int32, torch.int64
    work = tuple(z(T, dtype=d) for d in (i64, i32, i64, i64, i32, i32))
    qp, kp = z(T * Hs, Dp, dtype=x), keys(Hpk, Dp)
    if isinstance(kernel, FwdKlSm90):
        return (z(T * H, D, dtype=x), keys(Hkv, D), *work, z(T * H), qp, kp, z(T * Hs), z(T))
    tensors = (z(T * H, D, dtype=x), keys(Hkv, D), keys(Hkv, D), *work, z(T, D, dtype=x), z(T))
    if kernel.qmap:
        tensors += (z(T, dtype=i32),)
    if kernel.proxy:
        tensors += (qp, kp, z(T))
    return tensors


def bwd_specimens(kernel: bwd_sm90.BwdSm90, tokens: int = 4) -> tuple:
    """CPU stand-ins (zero-filled) of a backward launch's tensors
    (``backward.LAUNCH_TENSORS``) in the layouts ``backward.bwd`` passes, for ``tokens`` tokens
    (the work list's sizes too): the ``(T*H, D)`` / ``(T*Hs, Dp)`` rows, the ``(T, D, Hkv)`` /
    ``(T, Dp, Hpk)`` views of contiguous keys, the fp32 rows' data and outputs, the work list
    (and the map of a ``qmap`` kernel)."""
    T, H, Hkv, Hs = tokens, kernel.heads, kernel.kv_heads, kernel.sel_heads
    Hpk, D, Dp = kernel.proxy_k_heads, kernel.head_dim, kernel.proxy_head_dim
    x, z, keys = specimen_makers(kernel.dtype, T)

    i32, i64 = torch.int32, torch.int64
    return (
        z(T * H, D, dtype=x), z(T * H, D, dtype=x), keys(Hkv, D), keys(Hkv, D), z(T * H),
        z(T * H), z(T * Hs, Dp, dtype=x), keys(Hpk, Dp), z(T * Hs),
        z(T, dtype=i64), z(T, dtype=i32), z(T, dtype=i64), z(T, dtype=i64), z(T, dtype=i32),
        z(T, dtype=i32),
        z(T * H, D), z(T * Hkv, D), z(T * Hkv, D), z(T * Hs, Dp), z(T * Hpk, Dp),
    ) + ((z(T, dtype=i32),) if kernel.qmap else ())  # fmt: skip


def specimens(kernel, tokens: int = 4) -> tuple:
    """The specimen tensors of ``kernel``'s launch (:func:`select_specimens`,
    :func:`fwd_specimens` or :func:`bwd_specimens`, by its class)."""
    if isinstance(kernel, SelectSm90):
        return select_specimens(kernel, tokens)
    if isinstance(kernel, FwdPartialsSm90):
        return fwd_specimens(kernel, tokens)
    return bwd_specimens(kernel, tokens)


def compile_select(
    dtype: str, Dp: int, Hp: int, Hpk: int, K: int, block: int, qmap: bool = False,
    key_scale: str | None = None, *, dump=None, name: str = "",
) -> dict:  # fmt: skip
    """Compile :class:`SelectSm90` on the launch arguments ``selection`` passes: ``dtype``
    "bf16" / "fp16" / "e4m3" (with ``key_scale``, the FP8 mode, its pipeline
    ``FP8_STAGES``; the wgmma instructions reported as ``mma``), ``qmap`` the query-map
    kernel. Returns :func:`compile_kernel`'s report (``dump``: a folder for ``<name>.ptx`` /
    ``.cubin``)."""
    stages = SelectSm90.stages if key_scale is None else FP8_STAGES
    kernel = SelectSm90(DTYPES[dtype], Dp, Hp, Hpk, K, block, stages, qmap=qmap, key_scale=key_scale)
    kernel, args = selection.select_arguments(
        kernel, select_specimens(kernel), 1, make_fake_stream()
    )
    return compile_kernel(kernel, *args, mma=key_scale is not None, dump=dump, name=name)


def compile_fwd(
    dtype: str, H: int, Hkv: int, Hs: int, D: int, K: int, block: int, proxy=None,
    qmap: bool = False, *, dump=None, name: str = "",
) -> dict:  # fmt: skip
    """Compile :class:`FwdPartialsSm90` on the launch arguments ``forward.launch_partials``
    passes; ``proxy = (Hpk, Dp)``: the kernel with the proxy LSE part; ``qmap``: the query-map
    kernel."""
    mode = {}
    if proxy is not None:
        mode = dict(proxy=True, proxy_k_heads=proxy[0], proxy_head_dim=proxy[1])
    wgs = FwdPartialsSm90.warpgroups
    kernel = FwdPartialsSm90(DTYPES[dtype], H, Hkv, Hs, D, K, block, wgs, **mode, qmap=qmap)
    scalars = (1.0, 0, 1, 1.0)
    kernel, args = forward.partials_arguments(
        kernel, fwd_specimens(kernel), scalars, make_fake_stream()
    )
    return compile_kernel(kernel, *args, dump=dump, name=name)


def compile_kl(
    dtype: str, H: int, Hkv: int, Hs: int, Hpk: int, D: int, Dp: int, K: int, block: int, *,
    dump=None, name: str = "",
) -> dict:  # fmt: skip
    """Compile :class:`FwdKlSm90` on the launch arguments ``forward.kl`` passes."""
    wgs = FwdKlSm90.warpgroups
    kernel = FwdKlSm90(DTYPES[dtype], H, Hkv, Hs, D, K, block, wgs, True, Dp, Hpk)
    kernel, args = forward.kl_arguments(
        kernel, fwd_specimens(kernel), (1.0, 1.0, 1), make_fake_stream()
    )
    return compile_kernel(kernel, *args, dump=dump, name=name)


def compile_bwd(
    dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy, mode=None, *, dump=None, name=""
) -> dict:
    """Compile ``backward.kernel_for``'s kernel of a configuration (``mode`` its keyword arguments)
    on the launch arguments ``backward.launch_items`` passes."""
    kernel = kernel_for(
        DTYPES[dtype], H, Hkv, Hs, Hpk, D, Dp, K, block, bool(main), bool(proxy), **(mode or {})
    )
    kernel, args = bwd_arguments(
        kernel, bwd_specimens(kernel), (1.0, 1.0, 1.0, 1.0), 1, 0, make_fake_stream()
    )
    return compile_kernel(kernel, *args, dump=dump, name=name)


def compile_combine(dtype, H, Hs, K, D, has_o, proxy=False, *, dump=None, name=""):
    """Compile :class:`CombineSm90` (``proxy``: the fused proxy LSE) on the launch arguments
    ``forward.combine`` passes (dummy addresses)."""
    kernel = CombineSm90(DTYPES[dtype], H, Hs, K, D, has_o, proxy)
    return compile_memory_bound(kernel, forward.combine_arguments, 7, dump=dump, name=name)


def compile_quantize(dtype, Dp, Hp, Hpk, block, key_scale, *, dump=None, name=""):
    """Compile :class:`QuantizeSm90` on the launch arguments ``selection.quantize`` passes
    (dummy addresses)."""
    kernel = QuantizeSm90(DTYPES[dtype], Dp, Hp, Hpk, block, key_scale)
    launch = selection.quantize_arguments
    return compile_memory_bound(kernel, launch, 7, (1, 1), dump=dump, name=name)


def compile_row_delta(dtype, D, *, dump=None, name=""):
    """Compile :class:`RowDeltaSm90` on the launch arguments ``backward.row_delta`` passes
    (dummy addresses)."""
    kernel = RowDeltaSm90(DTYPES[dtype], D)
    return compile_memory_bound(kernel, row_delta_arguments, 3, dump=dump, name=name)


WORKLIST_KERNELS = {
    "blocks": worklist_sm90.BlocksSm90,
    "item_ends": worklist_sm90.ItemEndsSm90,
    "items": worklist_sm90.ItemsSm90,
    "list_keys": worklist_sm90.ListKeysSm90,
    "list_bounds": worklist_sm90.ListBoundsSm90,
}


def compile_worklist(kind: str, *, dump=None, name=""):
    """Compile work-list kernel ``kind`` (:data:`WORKLIST_KERNELS`) on
    ``worklist_host.worklist_arguments`` (dummy addresses)."""
    kernel = WORKLIST_KERNELS[kind]()
    counts = (1,) * kernel.COUNTS
    return compile_memory_bound(
        kernel, worklist_host.worklist_arguments, len(kernel.POINTERS), counts, dump=dump, name=name
    )


# ---------------------------------------------------------------------------------------------
# the configurations
# ---------------------------------------------------------------------------------------------
def select_configurations():
    """(name, dtype, Dp, Hp, Hpk, top_k, block[, qmap[, key_scale[, stages]]]) of the selection
    kernels checked (the lists in the selector warpgroup, fed through the ring: block 128 and
    64 are one and two slabs in it; top_k 1, 8, 16, 17, 32 and 64: the smallest and largest
    selector lists); the ``qmap`` ones (``SelectSm90(qmap=True)``, context parallelism's query
    map): anchor / paper (their selections have the same shape), both dims and blocks, top_k 64
    (the most registers), fp16, several key heads; the ``e4m3`` ones (the FP8 mode,
    ``key_scale`` "block" or "token"): anchor / paper, Dp 64, blocks 64 and 128, top_k 1, 16 and
    64, both key scales (per token: the consumers' most registers), several key heads."""
    for Dp in (64, 128):
        for block in (64, 128):
            yield f"select bf16 Dp={Dp} b={block} k=16 Hp=4 Hpk=1", "bf16", Dp, 4, 1, 16, block
    yield "select fp16 Dp=128 b=128 k=16 Hp=4 Hpk=1", "fp16", 128, 4, 1, 16, 128
    yield "select bf16 Dp=128 b=128 k=1 Hp=2 Hpk=2", "bf16", 128, 2, 2, 1, 128
    yield "select bf16 Dp=64 b=64 k=8 Hp=8 Hpk=2", "bf16", 64, 8, 2, 8, 64
    for Dp, block, K in ((128, 128, 64), (128, 64, 64), (64, 128, 32), (64, 64, 17)):
        yield f"select bf16 Dp={Dp} b={block} k={K} Hp=4 Hpk=1", "bf16", Dp, 4, 1, K, block
    for dt, Dp, Hp, Hpk, K, block in (
        ("bf16", 128, 4, 1, 16, 128), ("bf16", 64, 4, 1, 16, 64), ("bf16", 128, 4, 1, 64, 64),
        ("bf16", 64, 4, 1, 32, 128), ("fp16", 128, 4, 1, 16, 128), ("bf16", 64, 8, 2, 8, 64),
    ):  # fmt: skip
        name = f"select {dt} qmap Dp={Dp} b={block} k={K} Hp={Hp} Hpk={Hpk}"
        yield name, dt, Dp, Hp, Hpk, K, block, True
    for scale, Dp, Hp, Hpk, K, block in (
        ("block", 128, 4, 1, 16, 128), ("block", 128, 4, 1, 64, 128),
        ("block", 128, 4, 1, 64, 64), ("block", 64, 4, 1, 16, 128),
        ("block", 128, 2, 2, 1, 128), ("block", 64, 8, 2, 8, 64),
        ("token", 128, 4, 1, 16, 128), ("token", 128, 4, 1, 64, 64),
        ("token", 64, 4, 1, 16, 64), ("block", 128, 4, 1, 16, 64),
        ("block", 64, 8, 2, 1, 128),
    ):  # fmt: skip
        name = f"select e4m3 scale={scale} Dp={Dp} b={block} k={K} Hp={Hp} Hpk={Hpk}"
        yield name, "e4m3", Dp, Hp, Hpk, K, block, False, scale

def fwd_configurations():
    """(name, dtype, H, Hkv, Hs, D, K, block[, (Hpk, Dp)[, qmap]]) of the forward-partials
    kernels checked (with the shipped warpgroups, ``FwdPartialsSm90.warpgroups``): the head
    layouts, dims and blocks; with ``(Hpk, Dp)`` the kernel that also makes the proxy LSE
    partials (``proxy=True``); with ``qmap`` True the query-map kernel (``qmap=True``)."""
    layouts = [
        (f"fwd bf16 anchor D={D} b={block}", "bf16", 16, 2, 4, D, 16, block)
        for D in (64, 128)
        for block in (64, 128)
    ]
    layouts.append(("fwd bf16 paper D=128 b=128", "bf16", 64, 4, 4, 128, 16, 128))
    layouts.append(("fwd fp16 Hs<Hkv D=64 b=64", "fp16", 8, 4, 2, 64, 8, 64))
    yield from layouts
    proxy = [  # (name, dtype, H, Hkv, Hs, D, K, block, Hpk, Dp): FwdPartialsSm90(proxy=True)
        ("anchor D=128 b=128", "bf16", 16, 2, 4, 128, 16, 128, 1, 128),
        ("paper D=128 b=128", "bf16", 64, 4, 4, 128, 16, 128, 1, 128),
        ("anchor D=64 b=64", "bf16", 16, 2, 4, 64, 16, 64, 1, 64),
        ("Hp>Hpk>1 D=64 b=64", "bf16", 8, 2, 4, 64, 8, 64, 2, 64),
        ("anchor D=128 Dp=64 b=128", "bf16", 16, 2, 4, 128, 16, 128, 1, 64),
        ("anchor D=64 Dp=128 b=128", "bf16", 16, 2, 4, 64, 16, 128, 1, 128),
        ("Hs<Hkv D=64 b=64", "fp16", 8, 4, 2, 64, 8, 64, 1, 64),
    ]
    for name, dtype, *cfg, hpk, dp in proxy:
        yield f"fwd {dtype} proxy {name}", dtype, *cfg, (hpk, dp)
    # the query map (FwdPartialsSm90(qmap=True), context parallelism), with and without the
    # proxy part (a CP forward has it wherever the KL or the proxy gradient is wanted); not the
    # paper layout: it spills 8 bytes with the map (fwd_partials_sm90's docstring), pinned by
    # tests/cute_host/test_fwd.py instead
    for name, *cfg in (layouts[i] for i in (0, 3, 5)):  # anchor D=64 / 128, fp16
        yield f"{name} qmap", *cfg, None, True
    for name, dtype, *cfg, hpk, dp in proxy:
        if "paper" not in name:
            yield f"fwd {dtype} proxy {name} qmap", dtype, *cfg, (hpk, dp), True

def bwd_configurations():
    """(name, dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy[, mode]) of the backward
    kernels checked (``backward.kernel_for``'s pick, ``mode`` its keyword arguments): the anchor and
    paper head layouts, both head dims and blocks, fp16, the main- or proxy-only kernels, the
    deterministic ones, the fallback ``BwdSm90`` at layouts where the warp-specialized kernel
    runs (``ws=False``); the ``qmap`` ones (context parallelism's query map) over both kernels
    and every mode."""
    for D in (64, 128):
        for block in (64, 128):
            yield f"bwd bf16 anchor D={D} b={block}", "bf16", 16, 2, 4, 1, D, D, 16, block, 1, 1
    yield "bwd bf16 paper D=128 b=128", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1
    yield "bwd fp16 anchor D=128 Dp=64 b=128", "fp16", 16, 2, 4, 1, 128, 64, 16, 128, 1, 1
    yield "bwd bf16 Hp>Hkv D=64 Dp=128 b=128", "bf16", 8, 1, 4, 1, 64, 128, 3, 128, 1, 1
    yield "bwd bf16 G2=1 D=128 b=128", "bf16", 4, 4, 4, 2, 128, 128, 8, 128, 1, 1
    yield "bwd bf16 Hp>Hpk>1 G2=2 D=64 b=64", "bf16", 8, 2, 4, 2, 64, 64, 8, 64, 1, 1
    yield "bwd bf16 anchor main-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 0
    yield "bwd bf16 anchor proxy-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 1
    det = dict(deterministic=True)  # deterministic mode: stores into partials, no atomics
    yield "bwd bf16 anchor deterministic", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, det
    yield "bwd bf16 paper deterministic", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1, det
    yield "bwd bf16 anchor D=64 b=64 deterministic", "bf16", 16, 2, 4, 1, 64, 64, 16, 64, 1, 1, det
    v2 = dict(ws=False)  # the fallback without a producer warpgroup (the defaults above are
    # the warp-specialized kernel where it can run them: block 128, Dp == D, not deterministic)
    for name, H, Hkv, Hs, Hpk, D, K, main, proxy in (
        ("anchor", 16, 2, 4, 1, 128, 16, 1, 1), ("paper", 64, 4, 4, 1, 128, 16, 1, 1),
        ("anchor D=64", 16, 2, 4, 1, 64, 16, 1, 1), ("G2=1", 4, 4, 4, 2, 128, 8, 1, 1),
        ("anchor main-only", 16, 2, 4, 1, 128, 16, 1, 0),
        ("anchor proxy-only", 16, 2, 4, 1, 128, 16, 0, 1),
    ):  # fmt: skip
        yield f"bwd bf16 {name} v2", "bf16", H, Hkv, Hs, Hpk, D, D, K, 128, main, proxy, v2
    yield "bwd fp16 anchor v2", "fp16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, v2
    qm = dict(qmap=True)  # the query map (context parallelism): the row data's token from it
    yield "bwd bf16 qmap anchor", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd bf16 qmap paper", "bf16", 64, 4, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd fp16 qmap anchor", "fp16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qm
    yield "bwd bf16 qmap anchor D=64 b=64", "bf16", 16, 2, 4, 1, 64, 64, 16, 64, 1, 1, qm
    yield "bwd bf16 qmap G2=1", "bf16", 4, 4, 4, 2, 128, 128, 8, 128, 1, 1, qm
    yield "bwd bf16 qmap anchor main-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 0, qm
    yield "bwd bf16 qmap anchor proxy-only", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 0, 1, qm
    yield "bwd bf16 qmap anchor v2", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, dict(qm, **v2)
    qdet = dict(qm, **det)
    yield "bwd bf16 qmap anchor deterministic", "bf16", 16, 2, 4, 1, 128, 128, 16, 128, 1, 1, qdet

def kl_configurations():
    """(name, dtype, H, Hkv, Hs, Hpk, D, Dp, K, block) of the forward's KL kernel
    (:class:`~flash_msa.cute.fwd_kl_sm90.FwdKlSm90`, its shipped warpgroups): anchor and
    paper, both dims and blocks, bf16 and fp16, G = H / Hs of 1, 2, 4, 8, 16, several proxy key
    heads."""
    for dt, H, Hkv, D, Dp, block in (
        ("bf16", 16, 2, 128, 128, 128), ("bf16", 64, 4, 128, 128, 128),
        ("fp16", 64, 4, 128, 128, 128), ("fp16", 16, 2, 128, 128, 128),
        ("bf16", 16, 2, 64, 64, 64), ("bf16", 64, 4, 128, 128, 64),
    ):  # fmt: skip
        shape = "anchor" if H == 16 else "paper"
        yield f"kl {dt} {shape} D={D} Dp={Dp} b={block}", dt, H, Hkv, 4, 1, D, Dp, 16, block
    yield "kl bf16 G=1 Hpk=2 D=128 b=128", "bf16", 4, 4, 4, 2, 128, 128, 5, 128
    yield "kl bf16 G=2 Hpk=2 D=64 b=64", "bf16", 8, 2, 4, 2, 64, 64, 8, 64
    yield "kl bf16 G=8 D=128 b=128", "bf16", 32, 4, 4, 1, 128, 128, 16, 128

def combine_configurations():
    """(name, dtype, H, Hs, K, D, has_o, proxy) of the combine kernels: bf16 and fp16, D 64 and 128, K 8, 16 and 64, H 16 (anchor) and 64 (paper) over
    Hs 4; the LSE-only mode (the proxy LSE: H = Hs; once with H > Hs); the fused proxy LSE at
    the anchor and paper layouts."""
    for dtype in ("bf16", "fp16"):
        for D in (64, 128):
            for K in (8, 16, 64):
                for H in (16, 64):
                    name = f"combine {dtype} H={H} Hs=4 K={K} D={D}"
                    yield name, dtype, H, 4, K, D, True, False
    for K in (8, 16, 64):
        yield f"combine lse-only H=4 Hs=4 K={K}", None, 4, 4, K, 0, False, False
    yield "combine lse-only H=16 Hs=4 K=16", None, 16, 4, 16, 0, False, False
    for dtype in ("bf16", "fp16"):
        for H in (16, 64):
            name = f"combine {dtype} H={H} Hs=4 K=16 D=128 +proxy"
            yield name, dtype, H, 4, 16, 128, True, True

def quantize_configurations():
    """(name, dtype, Dp, Hp, Hpk, block, key_scale) of the quantize kernels: the anchor /
    paper proxy heads (Hp 4, Hpk 1) at both head dims and key scales, block 64, fp16, several
    key heads."""
    for Dp in quantize_sm90.HEAD_DIMS:
        for scale in quant.KEY_SCALES:
            name = f"quantize bf16 Dp={Dp} b=128 {scale} Hp=4 Hpk=1"
            yield name, "bf16", Dp, 4, 1, 128, scale
    yield "quantize bf16 Dp=128 b=64 block Hp=4 Hpk=1", "bf16", 128, 4, 1, 64, "block"
    yield "quantize fp16 Dp=128 b=128 block Hp=4 Hpk=1", "fp16", 128, 4, 1, 128, "block"
    yield "quantize bf16 Dp=64 b=64 block Hp=8 Hpk=2", "bf16", 64, 8, 2, 64, "block"
    yield "quantize bf16 Dp=128 b=128 token Hp=2 Hpk=2", "bf16", 128, 2, 2, 128, "token"

def row_delta_configurations():
    """(name, dtype, D) of the row-delta kernels: bf16 and fp16 at D 64 and 128."""
    for dtype in ("bf16", "fp16"):
        for D in row_delta_sm90.HEAD_DIMS:
            yield f"row_delta {dtype} D={D}", dtype, D

def worklist_configurations():
    """(name, kernel kind) of the work-list kernels (:data:`WORKLIST_KERNELS`)."""
    for kind in WORKLIST_KERNELS:
        yield f"worklist {kind}", kind


def checks():
    """``(name, compile function, arguments)`` of every configuration, in report order."""
    for configurations, compile_one in (
        (select_configurations, compile_select), (fwd_configurations, compile_fwd),
        (bwd_configurations, compile_bwd), (kl_configurations, compile_kl),
        (combine_configurations, compile_combine), (quantize_configurations, compile_quantize),
        (row_delta_configurations, compile_row_delta), (worklist_configurations, compile_worklist),
    ):  # fmt: skip
        for name, *cfg in configurations():
            yield name, compile_one, cfg


def _run(check, dump):
    name, compile_one, cfg = check
    return name, compile_one(*cfg, dump=dump, name=name)


def main(argv: list[str]) -> int:
    dump, jobs = None, 1
    if "--dump" in argv:
        i = argv.index("--dump")
        dump = os.path.abspath(argv[i + 1])
        os.makedirs(dump, exist_ok=True)
        argv = argv[:i] + argv[i + 2 :]
    if "--jobs" in argv:
        i = argv.index("--jobs")
        jobs = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    only = argv[0] if argv else ""  # a name prefix: "select" or "fwd", ...
    todo = [c for c in checks() if c[0].startswith(only)]
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUTE_DSL_DUMP_DIR"] = tmp  # --keep-* also write files: keep them out of CWD
        if jobs > 1:
            pool = concurrent.futures.ProcessPoolExecutor(jobs)
            results = pool.map(_run, todo, [dump] * len(todo))
        else:
            pool, results = None, (_run(c, dump) for c in todo)
        for name, res in results:
            bad += res["stack"] > 0 or res["local"] > 0 or not res.get("setmaxnreg_kept", True)
            print(json.dumps(dict(kernel=name, **res)), flush=True)
        if pool is not None:
            pool.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
