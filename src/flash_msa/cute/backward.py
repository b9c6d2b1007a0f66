"""Host code of the CuTe backend's sparse ``bwd``: the kernel choice between the warp-specialized
:class:`~.bwd_ws_sm90.BwdWsSm90` and :class:`~.bwd_sm90.BwdSm90` (its named fallback), the
backward's limits beyond ``LIMITS["bwd"]``, the op (atomic and deterministic), the kernel's
launch (its tensors, their typed pointers: :func:`bwd_arguments`), and the row delta ``delta =
rowsum(dO * O)`` on :class:`~.row_delta_sm90.RowDeltaSm90` (:func:`bwd_delta`, the op's call;
:func:`row_delta`, the kernel alone).

The warp-specialized kernel runs where it can (block 128, Dp == D, not deterministic): 1.08x /
1.04x / 1.16x / 1.14x the fallback's speed at anchor 16K / anchor 32K / paper 32K / paper 128K
on the H200. The fallback keeps two gather buffers where they fit the shared memory (+5% / +7%
/ +17% / +18% over one at the same four workloads), else one.
"""

from __future__ import annotations

import math

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

from .. import ordered, worklist
from ..problem import Grads, Problem, Saved
from ..problem import row_delta as problem_row_delta
from . import worklist_host
from .bwd_sm90 import LOG2E, BwdSm90
from .bwd_ws_sm90 import BwdWsSm90
from .common import ALIGN, cutlass_dtype
from .launch import aligned, bound, builder_signature, pointer_arguments, run_typed, stream
from .memo import memo, shape_key
from .row_delta_sm90 import HEAD_DIMS, IN_ALIGN, MAX_ROWS, OUT_ALIGN, RowDeltaSm90


def kernel_for(
    dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main=True, proxy=True, deterministic=False,
    qmap=False, ws: bool | None = None,
) -> BwdSm90:  # fmt: skip
    """The backward kernel of a configuration: :class:`BwdWsSm90` where it can run it, else
    :class:`BwdSm90` with two gather buffers where they fit the shared memory, else one.
    ``ws`` True / False forces the one kernel or the other (tests of the fallback at a layout
    where the warp-specialized kernel runs). ValueError with the reason if the chosen kernel
    cannot run the configuration."""
    if ws is None:
        ws = BwdWsSm90.can_implement(
            dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, proxy, 2, deterministic
        ) is None  # fmt: skip
    mode = dict(deterministic=deterministic, qmap=qmap)
    if ws:
        return BwdWsSm90(dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy, **mode)
    two = BwdSm90.can_implement(dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, proxy, 2) is None
    return BwdSm90(
        dtype, H, Hkv, Hs, Hpk, D, Dp, K, block, main, proxy, gather_stages=2 if two else 1,
        **mode,
    )  # fmt: skip


def bwd_kernel_reason(problem: Problem) -> str | None:
    """Why the fused backward kernel cannot run ``problem`` beyond the backend's ``LIMITS``
    (``None``: it can): ``BwdSm90.can_implement`` (the head-group arithmetic and shared
    memory), remembered per ``problem`` (:func:`~.memo.memo`)."""
    return memo((_bwd_kernel_reason, shape_key(problem)), _bwd_kernel_reason, problem)


def _bwd_kernel_reason(problem: Problem) -> str | None:
    """:func:`bwd_kernel_reason`, computed."""
    Hs = problem.num_sel_heads
    return BwdSm90.can_implement(
        cutlass_dtype(problem.dtype), problem.num_heads, problem.num_kv_heads, Hs,
        problem.num_proxy_k_heads or Hs, problem.head_dim, problem.proxy_head_dim or
        problem.head_dim, problem.cfg.top_k, problem.cfg.block_size,
    )  # fmt: skip


def bwd(
    dout, dkl, saved: Saved, cu_seqlens, cfg, *, q_map=None, ws: bool | None = None
) -> Grads:
    """Backend op ``bwd`` (contract in docs/design.md) for given indices (not warmup): the main
    gradients when ``dout`` is given, the proxy gradients (``dkl`` times the unit gradient made
    here; the forward's ``Saved.proxy_grad`` is not used) when ``dkl`` is given, in one launch
    of :func:`kernel_for`'s kernel (``ws``: its argument, None the pick). Deterministic mode
    (``cfg.deterministic``): :func:`_ordered`.
    ``q_map``: ``None`` or the forward's ``(Tq,)`` int32 query map: ``dq``/``dq_proxy`` then
    have ``Tq`` rows (0 for a padding row), ``dk``/``dv``/``dk_proxy`` the keys' ``T``.
    The work list is cut from the forward's sorted lists when ``saved`` carries them
    (:func:`flash_msa.worklist.carried`; not in deterministic mode over several chunks), else
    built. Limits: ``flash_msa.cute.unsupported_reason("bwd", ...)``."""
    q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, _ = saved
    main, proxy = dout is not None, dkl is not None
    if not (main or proxy):
        return Grads(None, None, None, None, None)
    T, H, D = q.shape  # query rows (Tq with a query map)
    Tk, Hkv = k.shape[:2]  # the keys' tokens: T without a query map
    if q_map is not None and (
        q_map.shape != (T,) or q_map.dtype != torch.int32 or q_map.device != q.device
    ):  # (the kernel reads it by pointer: a host tensor or a short one must not reach it)
        raise ValueError(
            f"CuTe backward: q_map must be an int32 ({T},) tensor on {q.device}, got "
            f"{q_map.dtype} {tuple(q_map.shape)} on {q_map.device}"
        )
    Hs, K = indices.shape[1:]
    Hpk, Dp = (k_proxy.shape[1], k_proxy.shape[2]) if proxy else (Hs, D)
    det = bool(cfg.deterministic)
    kept = worklist.carried(saved)  # the forward's sorted lists, if it kept them
    if not worklist.matches(kept, indices, cu_seqlens, cfg.block_size, Tk, q_map):
        kept = None
    kernel = kernel_for(
        cutlass_dtype(q.dtype), H, Hkv, Hs, Hpk, D, Dp, K, cfg.block_size, main, proxy, det,
        q_map is not None, ws,
    )  # raises ValueError with the reason if the kernel cannot run this configuration
    dummy = unused_buffer(q.device)  # fp32 inputs of a part not made
    # (contiguous: the launch bakes every stride in, mode 0's size aside; a tensor laid out
    # otherwise is copied once here, where its CuTe view had a run-time stride before)
    qv = aligned(q.contiguous()).view(T * H, D)
    kv = aligned(k.contiguous()).permute(0, 2, 1)  # (T, D, Hkv): a TMA box = one head's block
    lse_t = aligned(lse.contiguous()).view(-1)
    if main:
        dout = dout.contiguous()
        # (T, H): one CuTe pass where it runs (RowDeltaSm90: paper 128K 0.97 ms on the H200
        # against 7.9 ms for problem.row_delta's fp32 temporary and its sum), else torch's
        delta = bwd_delta(dout, out)
        dO, vt = aligned(dout).view(T * H, D), aligned(v.contiguous()).permute(0, 2, 1)
        main_args = (dO, kv, vt, lse_t, delta.view(-1))
    else:
        main_args = (qv, kv, kv, lse_t, dummy.view(-1))
    if proxy:
        proxy_args = (
            aligned(q_proxy.contiguous()).view(T * Hs, Dp),
            aligned(k_proxy.contiguous()).permute(0, 2, 1),
            aligned(proxy_lse.contiguous()).view(-1),
        )
        pscale = cfg.proxy_scale
    else:
        proxy_args = (qv, kv, lse_t)
        pscale = 1.0
    scalars = (
        cfg.softmax_scale,
        cfg.softmax_scale * LOG2E,
        pscale * LOG2E,
        pscale / (Hs * T),  # coef = 1 / (Hs T): the unit KL gradient, times pscale
    )

    def launch(wl, outs, tok0=0, w0=0, w1=None):
        """One launch over items ``w0 .. w1`` of ``wl`` into ``outs`` (dq, dk, dv, dqp, dkp
        buffers; ``None``: a part not made)."""
        launch_items(kernel, (qv, *main_args, *proxy_args), scalars, wl, outs, tok0, w0, w1)

    if det:
        dq, dk, dv, dqp, dkp = _ordered(launch, q, k, q_proxy, k_proxy, indices, cu_seqlens, cfg,
                                        main, proxy, q_map, kept)  # fmt: skip
    else:
        shapes = ((T, H, D), (Tk, Hkv, D), (Tk, Hkv, D)) if main else (None,) * 3
        shapes += ((T, Hs, Dp), (Tk, Hpk, Dp)) if proxy else (None,) * 2
        # one buffer if the cast below copies every main gradient (a returned view of it would
        # share storage with the others: the custom op refuses aliased outputs); the proxy
        # pair is always new (the dkl product's own tensors)
        copied = not main or torch.float32 not in (q.dtype, k.dtype, v.dtype)
        dq, dk, dv, dqp, dkp = zero_buffers(shapes, q.device, shared=copied)
        if T > 0:  # (no tokens: zero gradients, no launch)
            # (the CuTe build: worklist_sm90, the torch glue's values in 2 launches for the
            # cut, where the torch ops cost ~0.3 ms of host time at anchor 16K)
            if kept is not None:  # one sort per step: the forward's lists, this kernel's items
                wl = worklist_host.items(kept, BwdSm90.ITEM_TOKENS)
            else:
                wl = worklist_host.items(
                    worklist_host.lists(indices, cu_seqlens, cfg.block_size, 0, Tk, q_map),
                    BwdSm90.ITEM_TOKENS,
                )
            outs = [None if x is None else x.view(-1, x.shape[-1]) for x in (dq, dk, dv, dqp, dkp)]
            launch(wl, outs)  # 2-D fp32 views: > 2**31 elements at 1M tokens
    if proxy:
        dqp, dkp = scaled(dqp, dkl, q_proxy.dtype), scaled(dkp, dkl, k_proxy.dtype)

    return Grads.cast((dq, dk, dv, dqp, dkp), (q, k, v, q_proxy, k_proxy))


def zero_buffers(shapes, device: torch.device, shared: bool = True) -> list:
    """Zero-filled fp32 tensors of ``shapes`` (``None``: ``None``), the backward's atomic
    accumulators: with ``shared``, views of one buffer filled by one ``torch.zeros``
    (5 fill launches -> 1 per eager backward, the same bytes), each view's offset a multiple of
    16 bytes (the pointer launch's alignment, ``common.ALIGN``: true for every dim the kernel
    takes, D and Dp in {64, 128}); separate tensors where an offset would not be, or without
    ``shared``. On the
    H200 (torch alone, anchor-16K shapes, 210 MB): five fills 64.3 us of GPU time, one 50.0;
    host 38.9 -> 27.8 us (64-row shapes, the views' slicing included)."""
    sizes = [0 if x is None else math.prod(x) for x in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    if not shared or any(o * 4 % ALIGN for o, n in zip(offsets, sizes) if n):
        return [None if x is None else torch.zeros(x, dtype=torch.float32, device=device)
                for x in shapes]  # fmt: skip
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    views = zip(shapes, offsets, sizes)
    return [None if x is None else flat[o : o + n].view(x) for x, o, n in views]


def scaled(grad: torch.Tensor, dkl, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * dkl).to(dtype)`` bit for bit, in one op: ``torch.mul`` computes in the inputs'
    common dtype (fp32: ``grad`` fp32, ``dkl`` the 0-dim fp32 gradient of ``kl``) and rounds
    once on the store into ``dtype``, as the cast of the fp32 product did: 2 launches instead of
    4 per backward, 80 MB less moved at anchor 16K (~25 us, the audit's estimate). Bitwise
    checked on CPU (tests/cute_host/test_bwd.py) and on the H200 (720 cases: bf16 / fp16 / fp32
    out, 60 decades, signed zeros, inf, NaN, subnormals, overflow). A contiguous result, as the
    cast's. Where ``dkl`` needs a gradient (a ``create_graph`` backward) ``out=`` is refused:
    the plain expression."""
    if torch.is_grad_enabled() and getattr(dkl, "requires_grad", False):
        return (grad * dkl).to(dtype)
    return torch.mul(grad, dkl, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def _ordered(
    launch, q, k, q_proxy, k_proxy, indices, cu_seqlens, cfg, main, proxy, q_map=None, kept=None
):
    """The deterministic backward: ``(dq, dk, dv, dqp, dkp)`` (fp32 but ``dq``, ``None`` where
    not made), by :func:`bwd`'s ``launch`` of the deterministic kernel and the fixed-order sums
    of :mod:`flash_msa.ordered`, as the Triton backward does (triton_ref/sparse_bwd.py).

    Over chunks of C query tokens (one work list each): the kernel stores dQ / dQ_proxy row
    partials ``(C, heads, K, dim)`` (fp32: one row per (token, head, slot), an item's CTA
    holding the whole block: one key part) and, per range of work items, dK / dV / dK_proxy
    tiles ``(items, 1, block, dim)`` (every sub-group of an item shares its key head: one tile),
    which ``ordered.item_sum`` adds after each range (per key head: its selection heads in
    order, each list's items in token order); ``ordered.slot_sum`` then sums the chunk's row
    partials over slots in order. C and the ranges keep each buffer within
    ``ordered.PARTIAL_BYTES``. With ``q_map`` the chunks are chunks of query rows (padding
    rows: no entries, zero dQ rows) and the key gradients have the keys' ``T``. ``kept``: the
    forward's sorted lists of the whole call (:func:`flash_msa.worklist.matches`) or ``None``;
    used when C covers every token (one chunk), else each chunk builds its own."""
    T, H, D = q.shape
    Tk, Hkv = k.shape[:2]  # the keys' tokens: T without a query map
    Hs, K = indices.shape[1:]
    block = cfg.block_size
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = dk = dv = dqp = dkp = None
    per_token = per_item = 0
    if main:
        dq = torch.empty_like(q)  # slot_sum writes every row
        dk = torch.zeros((Tk, Hkv, D), **f32)
        dv = torch.zeros((Tk, Hkv, D), **f32)
        per_token += H * K * D * 4
        per_item += 2 * block * D * 4
    if proxy:
        Hpk, Dp = k_proxy.shape[1:]
        dqp = torch.empty((T, Hs, Dp), **f32)
        dkp = torch.zeros((Tk, Hpk, Dp), **f32)
        per_token += Hs * K * Dp * 4
        per_item += block * Dp * 4
    if T == 0:
        return dq, dk, dv, dqp, dkp
    C = ordered.token_chunk(T, per_token)
    dq_part = torch.empty((C, H, K, D), **f32) if main else None
    dqp_part = torch.empty((C, Hs, K, Dp), **f32) if proxy else None
    tiles, cap = None, 0
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        idx = indices[c0:c1]
        if q_map is not None:  # padding rows: no keys, whatever their slots hold (slot_sum)
            idx = worklist.drop_padding_rows(idx, q_map[c0:c1])
        if kept is not None and C >= T:  # one chunk: the forward's lists, this kernel's items
            wl = worklist_host.items(kept, BwdSm90.ITEM_TOKENS)
        else:
            sl = worklist_host.lists(idx, cu_seqlens, block, c0, Tk, q_map)
            wl = worklist_host.items(sl, BwdSm90.ITEM_TOKENS)
        items = ordered.list_items(wl)
        ranges = ordered.item_ranges(wl.num_items, per_item)
        most = max((w1 - w0 for w0, w1 in ranges), default=0)
        if most > cap:  # dK, dV, dK_proxy tiles of one range, and their 2-D views
            cap = most
            tiles = [torch.empty((cap, 1, block, D), **f32) if main else None for _ in range(2)]
            tiles.append(torch.empty((cap, 1, block, Dp), **f32) if proxy else None)
            flat = [None if x is None else x.view(-1, x.shape[-1]) for x in tiles]
        rows = [
            None if x is None else x[: c1 - c0].view(-1, x.shape[-1]) for x in (dq_part, dqp_part)
        ]
        for w0, w1 in ranges:
            launch(wl, (rows[0], flat[0], flat[1], rows[1], flat[2]), c0, w0, w1)
            n = w1 - w0
            if main:
                parts = (tiles[0][:n], tiles[1][:n])
                ordered.item_sum(parts, (dk, dv), items, w0, w1, wl, groups=Hs // Hkv, per_item=1)
            if proxy:
                ordered.item_sum(
                    (tiles[2][:n],), (dkp,), items, w0, w1, wl, groups=Hs // Hpk, per_item=1
                )
        tok0 = torch.full((1,), c0, dtype=torch.int64, device=q.device)
        if main:
            part = dq_part[: c1 - c0]
            ordered.slot_sum(part, dq, tok0, slots=K, parts=1, idx=idx, group=H // Hs)
        if proxy:
            ordered.slot_sum(dqp_part[: c1 - c0], dqp, tok0, slots=K, parts=1, idx=idx, group=1)
    return dq, dk, dv, dqp, dkp


# ---------------------------------------------------------------------------------------------
# the backward kernel's launch
# ---------------------------------------------------------------------------------------------
_UNUSED: dict = {}


def unused_buffer(device: torch.device) -> torch.Tensor:
    """A ``(1, 64)`` fp32 buffer for the kernel's tensor arguments of a part not made (never
    read or written: the part's code is compiled out), made once per device instead of one
    allocation and zero-fill per argument per call."""
    key = (device.type, device.index)
    if key not in _UNUSED:
        _UNUSED[key] = torch.zeros((1, 64), dtype=torch.float32, device=device)
    return _UNUSED[key]


def launch_items(kernel, inputs, scalars, wl, outs, tok0=0, w0=0, w1=None):
    """One launch of ``kernel`` (a :class:`BwdSm90`) over items ``w0 .. w1`` of work list
    ``wl``: ``inputs`` its tensors up to ``mPLSE`` (:data:`LAUNCH_TENSORS`), ``outs`` the dq,
    dk, dv, dqp, dkp buffers (``None``: a part not made),
    ``scalars`` the four scales (floats); the query map ``wl.q_map`` goes to a ``qmap`` kernel
    (and only there)."""
    if kernel.qmap != (wl.q_map is not None):
        raise ValueError(
            f"CuTe backward: a kernel with qmap={kernel.qmap} for a work list "
            f"{'with' if wl.q_map is not None else 'without'} a query map"
        )
    dev = wl.perm.device
    w1 = wl.num_items if w1 is None else w1
    items = (wl.item_list[w0:w1], wl.item_start[w0:w1], wl.item_end[w0:w1])
    # (a range's slice: copied unless 16-byte aligned; the whole lists are fresh buffers)
    work = [aligned(x) for x in (wl.perm, *items, wl.block_start, wl.block_end)]
    dummy = unused_buffer(dev)  # a part not made
    bufs = [dummy if x is None else x for x in outs]
    extra = [] if wl.q_map is None else [aligned(wl.q_map.contiguous())]
    kernel, args = bwd_arguments(
        kernel, (*inputs, *work, *bufs, *extra), scalars, wl.num_blocks, tok0, stream(dev)
    )
    run_typed(kernel, dev, args, BWD_SIGNATURE)


# the launch's tensors, in the order of BwdSm90.views and __call__'s pointers (+ "q_map" last
# for a qmap kernel); BwdSm90.tensor_count counts them
LAUNCH_TENSORS = (
    "q", "dout", "k", "v", "lse", "delta", "q_proxy", "k_proxy", "proxy_lse",
    "perm", "item_list", "item_start", "item_end", "block_start", "block_end",
    "dq", "dk", "dv", "dq_proxy", "dk_proxy",
)  # fmt: skip
_NAMES = (LAUNCH_TENSORS, (*LAUNCH_TENSORS, "q_map"))


def launch_tensor_names(kernel: BwdSm90) -> tuple[str, ...]:
    """The launch's tensors, in the order of ``kernel.views`` and its ``__call__``'s pointers:
    :data:`LAUNCH_TENSORS` (+ "q_map" for a ``qmap`` kernel)."""
    return _NAMES[kernel.qmap]


def bwd_arguments(kernel: BwdSm90, tensors, scalars, num_blocks: int, tok0: int, strm):
    """``(kernel', args)`` of a launch of ``kernel``: ``tensors`` the torch tensors of
    :data:`LAUNCH_TENSORS` (and the query map last for a ``qmap`` kernel), laid out as the
    kernel takes them (``BwdSm90.__call__``), ``scalars`` the four scales, ``num_blocks`` and
    ``tok0`` ints, ``strm`` the stream. ``kernel'`` is ``kernel`` with :attr:`BwdSm90.views`
    set to the tensors' layouts (``launch.view_layout``: what their CuTe views baked in),
    ``args`` its ``__call__``'s arguments: typed pointers and mode-0 sizes in one
    :class:`~.common.PointerTensors` (``launch.pointer_arguments``: ~1 us a tensor instead of a
    DLPack view's 10-40 us), the scales as ``Float32``, the ints as ``Int32``. Every argument's type
    is then fixed by ``kernel'``, so :func:`~.launch.run_typed` keys the compile cache on it alone.

    The tensors' dtypes are in the views (each pointer has its tensor's element type), as
    they were in the views' signatures. Raises ValueError for a tensor count that does not
    match ``kernel.qmap``, a base that is not 16-byte aligned, a tensor on another device
    than the work list's (``tensors[9]``, ``perm``) or a layout whose view would have a
    run-time stride."""
    names = launch_tensor_names(kernel)
    if len(tensors) != len(names):
        raise ValueError(
            f"CuTe backward: {len(tensors)} launch tensors for a kernel with qmap="
            f"{kernel.qmap} ({len(names)} expected)"
        )
    views, pointers = pointer_arguments("CuTe backward", names, tensors, tensors[9].device)
    scale, scale_log2, pscale_log2, pcoef = scalars
    args = (
        pointers, Float32(scale), Float32(scale_log2), Float32(pscale_log2),
        Float32(pcoef), Int32(num_blocks), Int32(tok0), strm,
    )  # fmt: skip
    return bound(kernel, views), args


# the disk cache's text for the argument types: the builder's name and the hash of this module's
# source (the kernel object, its views, and its module are in the disk key too); launches go
# through launch.run_typed
BWD_SIGNATURE = builder_signature(bwd_arguments)


# ---------------------------------------------------------------------------------------------
# the row delta: torch tensors in, delta out (RowDeltaSm90)
# ---------------------------------------------------------------------------------------------
def row_delta_fits(dtype: torch.dtype, D: int) -> bool:
    """Whether :class:`~.row_delta_sm90.RowDeltaSm90` has a configuration for inputs of ``dtype``
    and head dim ``D`` (bf16 or fp16, D in ``row_delta_sm90.HEAD_DIMS``); the call also needs
    :func:`row_delta_reason`'s layout (a caller that cannot promise it asks that instead). Else
    ``problem.row_delta``."""
    return RowDeltaSm90.can_implement(cutlass_dtype(dtype), D) is None


def row_delta_reason(dout, out) -> str | None:
    """Why :func:`row_delta` cannot run this call (``None``: it can): ``dout`` and ``out``
    tensors of one shape ``(T, H, D)``, dtype (bf16 or fp16) and CUDA device, contiguous, bases
    16-byte aligned, D in ``row_delta_sm90.HEAD_DIMS``, ``T * H <= row_delta_sm90.MAX_ROWS``."""
    for name, x in (("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor, not {type(x).__name__}"
    for name, x in (("dout", dout), ("out", out)):
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"{name} must be bfloat16 or float16, got {x.dtype}"
    if dout.dtype != out.dtype:
        return f"dout and out must share a dtype, got {dout.dtype} and {out.dtype}"
    if dout.dim() != 3 or tuple(dout.shape) != tuple(out.shape):
        return (
            f"dout and out must be (T, H, D) tensors of one shape, got {tuple(dout.shape)} and "
            f"{tuple(out.shape)}"
        )
    T, H, D = dout.shape
    if D not in HEAD_DIMS:
        return f"the head dim D (dout.shape[-1]) must be one of {HEAD_DIMS}, got {D}"
    if T * H > MAX_ROWS:
        return f"T * H = {T * H} rows exceed the kernel's {MAX_ROWS}"
    for name, x in (("dout", dout), ("out", out)):
        if not x.is_contiguous():
            return f"{name} must be contiguous, got strides {x.stride()} for {tuple(x.shape)}"
        if x.data_ptr() % IN_ALIGN:
            return f"{name}'s base must be {IN_ALIGN}-byte aligned ({x.data_ptr():#x})"
    if dout.device.type != "cuda" or out.device != dout.device:
        return f"dout and out must be on one CUDA device, got {dout.device} and {out.device}"
    return None


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)``: ``(T, H)`` fp32 from ``dout`` and ``out`` ``(T, H, D)``
    (``row_delta_sm90``'s docstring: products exact in fp32, a fixed summation order).

    Args:
        dout, out: contiguous bf16 or fp16 CUDA tensors of one shape and dtype, bases 16-byte
            aligned, D in ``row_delta_sm90.HEAD_DIMS`` (:func:`row_delta_reason`).
    Raises:
        TypeError for a non-tensor or a dtype other than bf16 / fp16, ValueError for the other
        reasons of :func:`row_delta_reason`, naming the argument, before any launch.
    """
    why = row_delta_reason(dout, out)
    if why is not None:
        kind = TypeError if ("torch.Tensor" in why or "bfloat16 or" in why) else ValueError
        raise kind(f"CuTe row delta: {why}")
    return _row_delta_launch(dout, out)


def bwd_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The backward's ``delta`` ``(T, H)`` fp32: the row-delta kernel where
    :func:`row_delta_reason` allows the call (checked once), else
    :func:`flash_msa.problem.row_delta` (:func:`bwd`'s call)."""
    if row_delta_reason(dout, out) is None:
        return _row_delta_launch(dout, out)
    return problem_row_delta(dout, out)


def _row_delta_launch(dout, out) -> torch.Tensor:
    """One launch over ``dout``, ``out`` that :func:`row_delta_reason` accepted."""
    kernel = RowDeltaSm90(cutlass_dtype(dout.dtype), dout.shape[2])
    T, H, _ = dout.shape
    res = torch.empty((T, H), dtype=torch.float32, device=dout.device)
    if T * H == 0:
        return res
    device = dout.device
    args = row_delta_arguments(
        kernel, dout.data_ptr(), out.data_ptr(), res.data_ptr(), T * H, stream(device)
    )
    run_typed(kernel, device, args, ROW_DELTA_SIGNATURE)
    return res


def row_delta_arguments(kernel: RowDeltaSm90, dout: int, out: int, delta: int, n_rows: int, strm):
    """The arguments of a launch of ``kernel`` (its ``__call__``): the three buffers' device
    addresses (ints) as typed pointers of the alignments the kernel assumes, the row count,
    the stream. The types depend on ``kernel`` alone, so the compile cache keys on the kernel
    object and the compile check compiles what runs."""
    gmem = cute.AddressSpace.gmem
    return (
        make_ptr(kernel.dtype, dout, gmem, assumed_align=IN_ALIGN),
        make_ptr(kernel.dtype, out, gmem, assumed_align=IN_ALIGN),
        make_ptr(Float32, delta, gmem, assumed_align=OUT_ALIGN),
        Int32(n_rows),
        strm,
    )


# the disk cache's text for the argument types: the builder's name and the hash of this module's
# source (the kernel object and its module are in the disk key too); launches go through
# launch.run_typed
ROW_DELTA_SIGNATURE = builder_signature(row_delta_arguments)
