"""Host code of the CuTe backend's sparse ``fwd``: which stage of the sparse-forward driver
(:mod:`flash_msa.sparse_forward`) runs on which kernel, the forward's limits beyond
``LIMITS["fwd"]``, the op itself, and the driver stages on the forward's kernels: their fit
checks, buffer checks and launches (the kernels: :mod:`.fwd_partials_sm90`,
:mod:`.fwd_kl_sm90`, :mod:`.combine_sm90`).

Every stage runs on CuTe where its fit check takes the call: the work list
(:mod:`.worklist_sm90`, bit for bit :mod:`flash_msa.worklist`'s; on the H200 at anchor 16K the
forward's blocks, lists and items took 222 us of host time against 897 us by torch ops), the
per-block attention (:func:`partials`), which also makes the proxy LSE partials in its own
launch (:func:`proxy_fits`), the combine (:func:`combine`, with the proxy LSE merge in the
same launch: :func:`combine_fits`) and the KL value (:func:`kl`: :func:`kl_fits`). A stage
whose fit check refuses the call is the Triton backend's, borrowed through the driver
(:func:`flash_msa.sparse_forward.borrowed`), with the Triton stage's limits
(:func:`fwd_reason`): e.g. the combine above 64 slots per row, the KL of a query-mapped call
or of D != Dp.

Measurements behind the choices (H200):

* proxy LSE in the partials' launch against Triton's separate proxy stage: anchor 32K 2.76 /
  2.73 ms against 3.28 / 2.98 (random / local inputs), paper 32K 9.03 / 9.67 against 8.95 /
  8.56: 0.25-0.5 ms won at the anchor layout, +1% / +13% of the partials (< 1% of a step) at
  the paper one, so that no Triton proxy stage runs;
* combine: device time of the main and proxy merges 0.257 / 0.518 / 0.523 ms against Triton's
  0.270 / 0.542 / 0.535 at anchor 16K / 32K, paper 128K;
* KL value: 1.11 / 2.03 / 4.98 / 17.5 ms against 3.56 / 7.29 / 18.48 / 73.96 for Triton's
  stage at anchor 16K / 32K, paper 32K / 128K, sums equal to 6e-7 relative.
"""

from __future__ import annotations

import math

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

from .. import sparse_forward
from ..problem import Problem
from ..sparse_forward import Stages, borrowed_reason
from . import worklist_host
from .combine_sm90 import CombineSm90
from .common import cutlass_dtype
from .fwd_kl_sm90 import LOG2E, FwdKlSm90
from .fwd_partials_sm90 import FwdPartialsSm90
from .launch import aligned, bound, builder_signature, pointer_arguments, run_typed, stream
from .memo import memo, run_free, shape_key


def forward_stages(kl_fits: bool = True, combine_fits: bool = True, proxy_fits: bool = True):
    """This backend's stages of the sparse-forward driver: the work list, the per-block
    partials, which also make the proxy LSE partials where ``proxy_fits``; the KL value where
    ``kl_fits``; the combine (with the proxy merge) where ``combine_fits``. The driver borrows
    the Triton backend's stage for each one left out (``proxy_partials`` where the partials do
    not make the proxy LSE)."""
    stages = dict(partials=partials, q_map=True, work=worklist_host)
    if proxy_fits:
        stages["partials_make_proxy"] = True
    if kl_fits:
        stages["kl"] = kl
    if combine_fits:
        stages["combine"] = combine
        stages["combine_makes_proxy"] = True  # main and proxy merges in one launch
    return Stages(**stages)


def meta_inputs(problem: Problem):
    """``(q, k, q_proxy, k_proxy, indices)`` of one token with ``problem``'s heads, dims and
    ``top_k`` on the meta device (no memory): for the stages' ``*_fits``, which read shapes
    and dtypes only. The proxy is ``None`` where the problem has none (``proxy_head_dim`` 0).
    The same tensors for the same heads, dims and ``top_k`` (:func:`memo`)."""
    p = problem
    dims = (p.dtype, p.num_heads, p.num_kv_heads, p.head_dim, p.num_sel_heads)
    dims += (p.num_proxy_k_heads, p.proxy_head_dim, p.cfg.top_k or 1)
    return memo((_meta_inputs, *dims), _meta_inputs, *dims)


def _meta_inputs(dtype, H, Hkv, D, Hs, Hpk, Dp, K):
    """:func:`meta_inputs` of these heads and dims."""
    m = dict(dtype=dtype, device="meta")
    q, k = torch.empty(1, H, D, **m), torch.empty(1, Hkv, D, **m)
    qp = torch.empty(1, Hs, Dp, **m) if Dp else None
    kp = torch.empty(1, Hpk, Dp, **m) if Dp else None
    return q, k, qp, kp, torch.empty(1, Hs, K, dtype=torch.int32, device="meta")


def stages_for(
    q, k, q_proxy, k_proxy, indices, cfg, combine_ok: bool | None = None, mapped: bool = False
):
    """:func:`forward_stages` for one call's tensors (shapes and dtypes only: the meta device
    will do) and whether it has a query map (``mapped``): each CuTe stage where its ``*_fits``
    takes the call. ``combine_ok`` replaces ``combine_fits`` (the warmup's two-level combine,
    ``warmup.stages``). Remembered per what the ``*_fits`` read (dtypes, every size but the
    token count, ``cfg``, ``mapped``: :func:`memo`)."""
    shapes = (_rows(q), _rows(k), _rows(q_proxy), _rows(k_proxy), _rows(indices))
    key = (_pick_stages, shapes, run_free(cfg), combine_ok, mapped)
    return memo(key, _pick_stages, q, k, q_proxy, k_proxy, indices, cfg, combine_ok, mapped)


def _rows(x) -> tuple | None:
    """What the stages' ``*_fits`` may read of a call's tensor: dtype and row shape."""
    return None if x is None else (x.dtype, x.shape[1:])


def _pick_stages(q, k, q_proxy, k_proxy, indices, cfg, combine_ok, mapped):
    """:func:`stages_for`, computed."""
    if combine_ok is None:
        H, D = q.shape[1:]
        Hs, K = indices.shape[1:]
        combine_ok = combine_fits(q.dtype, H, Hs, K, D)
    return forward_stages(
        kl_fits(q, k, q_proxy, k_proxy, indices, cfg, mapped),
        combine_ok,
        proxy_fits(q, k, q_proxy, k_proxy, indices, cfg),
    )


def call_stages(problem: Problem):
    """The stages :func:`fwd` picks for ``problem`` (:func:`stages_for` on
    :func:`meta_inputs`)."""
    return stages_for(*meta_inputs(problem), problem.cfg, mapped=problem.q_map)


def fwd_reason(problem: Problem, stages=None) -> str | None:
    """The forward's limits beyond ``LIMITS``: its own kernel's
    (``FwdPartialsSm90.can_implement``: the same table plus the head-group arithmetic and
    shared memory), and those of the stages it borrows: those of ``stages``, by default the
    ones :func:`fwd` will pick for the call (:func:`call_stages`; e.g. Triton's combine above
    the CuTe combine's 64 slots, with Triton's ``max_top_k``)."""
    why = memo((_fwd_kernel_reason, shape_key(problem)), _fwd_kernel_reason, problem)
    if why is not None:
        return why
    # (the borrowed stages' limits are another backend's: asked per call, not remembered)
    return borrowed_reason(call_stages(problem) if stages is None else stages, problem)


def _fwd_kernel_reason(problem: Problem) -> str | None:
    """``FwdPartialsSm90.can_implement`` of ``problem``'s configuration."""
    return FwdPartialsSm90.can_implement(
        cutlass_dtype(problem.dtype), problem.num_heads, problem.num_kv_heads,
        problem.num_sel_heads, problem.head_dim, problem.cfg.top_k, problem.cfg.block_size,
    )  # fmt: skip


def fwd(
    q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False, *,
    q_map=None,
):  # fmt: skip
    """Backend op ``fwd`` for given indices: the sparse-forward driver with the stages of
    :func:`stages_for` (the others borrowed from the Triton backend through the driver).
    Limits: ``flash_msa.cute.unsupported_reason("fwd", ...)``.

    ``q_map``: ``None`` or ``(Tq,)`` int32, the contract's query map (``q``, ``q_proxy``,
    ``indices`` and the outputs have ``Tq`` rows): the driver hands it to the stages in the
    work list."""
    stages = stages_for(q, k, q_proxy, k_proxy, indices, cfg, mapped=q_map is not None)
    return sparse_forward.fwd(
        stages, q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad, q_map=q_map
    )


# ---------------------------------------------------------------------------------------------
# the per-block partials of one query chunk over a work list: FwdPartialsSm90
# ---------------------------------------------------------------------------------------------
def partials(q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None):
    """Driver stage ``partials`` (:mod:`flash_msa.sparse_forward`, which states the buffers'
    contract): fill ``o_part (C, H, K, D)`` and ``l_part (C, H, K)`` for packed tokens
    ``tok0 .. tok0 + C`` from work list ``wl`` (:func:`flash_msa.worklist.build`); with
    ``proxy = (q_proxy, k_proxy, pl_part)`` also the proxy LSE partials ``pl_part (C, Hs, K)``
    in the same launch (``FwdPartialsSm90(proxy=True)``; :func:`proxy_fits` says where it
    can run). With the work list's query map ``wl.q_map`` (``worklist.build(..., q_map)``) the
    rows ``tok0 .. tok0 + C`` are query rows (``q``, ``q_proxy``: ``Tq`` rows; ``k``, ``v``,
    ``k_proxy``: the keys' ``T``), run by ``FwdPartialsSm90(qmap=True)``."""
    H, D = q.shape[1:]
    Hkv = k.shape[1]
    variant = {}
    if proxy is not None:
        q_proxy, k_proxy, _ = proxy
        _check_proxy_inputs(q, k, q_proxy, k_proxy, wl.heads)  # before their shapes are read
        variant = dict(proxy=True, proxy_head_dim=q_proxy.shape[2], proxy_k_heads=k_proxy.shape[1])
    # (raises ValueError with the reason if the kernel cannot run this configuration)
    kernel = FwdPartialsSm90(
        cutlass_dtype(q.dtype), H, Hkv, wl.heads, D, wl.slots, cfg.block_size,
        FwdPartialsSm90.warpgroups, **variant, qmap=wl.q_map is not None,
    )  # fmt: skip
    launch_partials(kernel, q, k, v, wl, o_part, l_part, cfg, tok0, proxy)


def launch_partials(kernel: FwdPartialsSm90, q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None):
    """One launch of ``kernel`` over work list ``wl`` (arguments as :func:`partials`, which
    picks the kernel): the buffers and the query map checked, ValueError naming the argument;
    the map ``wl.q_map`` goes to a ``qmap`` kernel, and only there."""
    T, H, D = q.shape
    if kernel.qmap != (wl.q_map is not None):
        raise ValueError(
            f"CuTe forward partials: a kernel with qmap={kernel.qmap} for a work list "
            f"{'with' if wl.q_map is not None else 'without'} a query map (wl.q_map)"
        )
    q_map = wl.q_map
    if q_map is not None and (
        q_map.shape != (T,) or q_map.dtype != torch.int32 or q_map.device != q.device
    ):
        raise ValueError(
            f"CuTe forward partials: wl.q_map must be an int32 ({T},) tensor on {q.device} (a "
            f"row of q each), got {q_map.dtype} {tuple(q_map.shape)} on {q_map.device}"
        )
    buffers = [("o_part", o_part, (H, wl.slots, D)), ("l_part", l_part, (H, wl.slots))]
    if proxy is not None:
        q_proxy, k_proxy, pl_part = proxy
        buffers.append(("pl_part", pl_part, (wl.heads, wl.slots)))
    for name, buf, shape in buffers:
        dtype = q.dtype if name == "o_part" else torch.float32
        if buf.dtype != dtype:
            raise ValueError(f"CuTe forward partials: {name} must be {dtype}, not {buf.dtype}")
        if tuple(buf.shape[1:]) != shape or not buf.is_contiguous() or buf.data_ptr() % 16:
            raise ValueError(
                f"CuTe forward partials: {name} must be a contiguous, 16-byte aligned (C, "
                f"{', '.join(map(str, shape))}) buffer; got shape {tuple(buf.shape)}, strides "
                f"{buf.stride()}, address % 16 = {buf.data_ptr() % 16}"
            )
    # (contiguous: the launch bakes every stride in, mode 0's size aside; a tensor laid out
    # otherwise is copied once here, where its CuTe view had a run-time stride before)
    tensors = [
        aligned(q.contiguous()).view(T * H, D),
        aligned(k.contiguous()).permute(0, 2, 1),  # (T, D, Hkv): a TMA box = one head's block
        aligned(v.contiguous()).permute(0, 2, 1),
        *(aligned(x) for x in wl[:6]),  # (fresh buffers: the check is a formality)
        o_part.view(-1, D),
        l_part.view(-1),
    ]
    if q_map is not None:  # (the map travels with the list: MappedWorkItems)
        tensors.append(aligned(q_map.contiguous()))
    pscale_log2 = 1.0
    if proxy is not None:
        Hs, Dp = q_proxy.shape[1:]
        tensors += [
            aligned(q_proxy.contiguous()).view(T * Hs, Dp),
            aligned(k_proxy.contiguous()).permute(0, 2, 1),  # (T, Dp, Hpk)
            pl_part.view(-1),
        ]
        pscale_log2 = (cfg.proxy_scale or 1.0) * math.log2(math.e)
    scalars = (cfg.softmax_scale * math.log2(math.e), tok0, wl.num_blocks, pscale_log2)
    kernel, args = partials_arguments(kernel, tensors, scalars, stream(q.device))
    run_typed(kernel, q.device, args, PARTIALS_SIGNATURE)


def launch_tensor_names(kernel: FwdPartialsSm90) -> tuple[str, ...]:
    """The launch's tensors, in the order of ``kernel.views`` and its ``__call__``'s pointers:
    q, k, v, the work list's six, o_part, l_part (+ q_map with
    :attr:`~.fwd_partials_sm90.FwdPartialsSm90.qmap`, + q_proxy, k_proxy, pl_part with
    :attr:`~.fwd_partials_sm90.FwdPartialsSm90.proxy`); for a :class:`~.fwd_kl_sm90.FwdKlSm90`
    q, k, the work list's six, lse, q_proxy, k_proxy, proxy_lse, sums."""
    if isinstance(kernel, FwdKlSm90):
        return _KL_TENSORS
    return _TENSORS[kernel.qmap, kernel.proxy]


_WORK = ("perm", "item_list", "item_start", "item_end", "block_start", "block_end")
_MAIN = ("q", "k", "v", *_WORK, "o_part", "l_part")
_PROXY = ("q_proxy", "k_proxy", "pl_part")
_TENSORS = {
    (qmap, proxy): _MAIN + ("q_map",) * qmap + _PROXY * proxy
    for qmap in (False, True)
    for proxy in (False, True)
}
_KL_TENSORS = ("q", "k", *_WORK, "lse", "q_proxy", "k_proxy", "proxy_lse", "sums")


def partials_arguments(kernel: FwdPartialsSm90, tensors, scalars, strm):
    """``(kernel', args)`` of a launch of ``kernel``: ``tensors`` the torch tensors of
    :func:`launch_tensor_names`, laid out as its ``__call__`` takes them, ``scalars`` its
    scalars in ``__call__``'s order (floats and ints: ``scale_log2, tok0, NB, pscale_log2``),
    ``strm`` the stream. ``kernel'`` is ``kernel`` with ``views`` set to the tensors' layouts
    (``launch.view_layout``: what their CuTe views baked in; the element types too), ``args``
    its ``__call__``'s arguments: typed pointers and mode-0 sizes in one
    :class:`~.common.PointerTensors` (``launch.pointer_arguments``: ~1 us a tensor instead of a
    DLPack view's 10-40 us), the scalars as ``Float32`` / ``Int32``. Every argument's type is then
    fixed by ``kernel'``, so :func:`~.launch.run_typed` keys the compile cache on it alone.
    ValueError (naming the tensor) for a wrong tensor count, a base that is not 16-byte aligned, a
    tensor on another device than q, or a layout whose view would have a run-time stride."""
    views, pointers = _pointers("CuTe forward partials", kernel, tensors)
    scale_log2, tok0, nb, pscale_log2 = scalars
    typed = (Float32(scale_log2), Int32(tok0), Int32(nb), strm, Float32(pscale_log2))
    return bound(kernel, views), (pointers, *typed)


# the disk cache's text for the argument types (the kernel object, its views, is in the key)
PARTIALS_SIGNATURE = builder_signature(partials_arguments)


def _pointers(what: str, kernel, tensors) -> tuple:
    """``launch.pointer_arguments`` of a partials or KL launch's ``tensors`` (ValueError
    prefixed ``what``, also for a tensor count other than :func:`launch_tensor_names`')."""
    names = launch_tensor_names(kernel)
    if len(tensors) != len(names):
        raise ValueError(f"{what}: {len(tensors)} launch tensors, {len(names)} expected")
    return pointer_arguments(what, names, tensors, tensors[0].device)


def _check_proxy_inputs(q, k, q_proxy, k_proxy, Hs):
    """ValueError naming the argument unless q_proxy ``(T, Hs, Dp)`` and k_proxy ``(T, Hpk,
    Dp)`` match q's dtype and token count (the kernel has one element type)."""
    T = q.shape[0]
    if q_proxy.dim() != 3:
        raise ValueError(
            f"CuTe forward partials: q_proxy must be (T, Hs, Dp); got {tuple(q_proxy.shape)}"
        )
    for name, x, rows in (("q_proxy", q_proxy, T), ("k_proxy", k_proxy, k.shape[0])):
        if x.dtype != q.dtype:
            raise ValueError(f"CuTe forward partials: {name} must be {q.dtype}, not {x.dtype}")
        if x.dim() != 3 or x.shape[0] != rows or x.shape[2] != q_proxy.shape[2]:
            raise ValueError(
                f"CuTe forward partials: {name} must be ({rows}, heads, {q_proxy.shape[2]}); "
                f"got {tuple(x.shape)}"
            )
    if q_proxy.shape[1] != Hs:
        raise ValueError(
            f"CuTe forward partials: q_proxy has {q_proxy.shape[1]} heads, the work list {Hs}"
        )


def proxy_fits(q, k, q_proxy, k_proxy, indices, cfg) -> bool:
    """Whether :func:`partials` can make this call's proxy LSE partials in its own launch (a
    proxy in q's dtype, and the head layout, dims, block and shared memory that
    ``FwdPartialsSm90.can_implement(proxy=True)`` accepts)."""
    if q_proxy is None or q_proxy.dtype != q.dtype or k_proxy.dtype != q.dtype:
        return False
    why = FwdPartialsSm90.can_implement(
        cutlass_dtype(q.dtype), q.shape[1], k.shape[1], q_proxy.shape[1], q.shape[2],
        indices.shape[2], cfg.block_size, FwdPartialsSm90.warpgroups, True, q_proxy.shape[2],
        k_proxy.shape[1],
    )  # fmt: skip
    return why is None


# ---------------------------------------------------------------------------------------------
# the KL value: FwdKlSm90
# ---------------------------------------------------------------------------------------------
def _kl_reason(q, k, q_proxy, k_proxy, top_k, cfg) -> str | None:
    """Why :class:`FwdKlSm90` cannot run this call's KL (``None``: it can)."""
    if q_proxy is None or k_proxy is None:
        return "no proxy"
    if q_proxy.dtype != q.dtype or k_proxy.dtype != q.dtype:
        return f"the proxy must be in q's dtype ({q.dtype})"
    return FwdKlSm90.can_implement(
        cutlass_dtype(q.dtype), q.shape[1], k.shape[1], q_proxy.shape[1], q.shape[2], top_k,
        cfg.block_size, FwdKlSm90.warpgroups, True, q_proxy.shape[2], k_proxy.shape[1],
    )  # fmt: skip


def kl_fits(q, k, q_proxy, k_proxy, indices, cfg, mapped: bool = False) -> bool:
    """Whether :func:`kl` runs this call's KL (a proxy in q's dtype, ``cfg.compute_kl``, no
    query map: ``mapped`` False, and the layout :class:`FwdKlSm90`'s ``can_implement``
    accepts); the forward borrows Triton's KL stage for a call it does not fit."""
    if q_proxy is None or not cfg.compute_kl or mapped:
        return False
    return _kl_reason(q, k, q_proxy, k_proxy, indices.shape[2], cfg) is None


def kl_arguments(kernel: FwdKlSm90, tensors, scalars, strm):
    """``(kernel', args)`` of a launch of KL kernel ``kernel``, as :func:`partials_arguments`:
    ``tensors`` those of :func:`launch_tensor_names`, ``scalars`` ``scale_log2, pscale_log2,
    NB`` (``__call__``'s order)."""
    views, pointers = _pointers("CuTe KL stage", kernel, tensors)
    scale_log2, pscale_log2, nb = scalars
    typed = (Float32(scale_log2), Float32(pscale_log2), Int32(nb), strm)
    return bound(kernel, views), (pointers, *typed)


KL_SIGNATURE = builder_signature(kl_arguments)


def kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit=None):
    """Driver stage ``kl`` (:mod:`flash_msa.sparse_forward`): the fp32 0-dim sum of the
    per-row KL terms ``sum_keys t (ln t - ln p)`` of work list ``wl``'s rows (t: the group mean
    of the main probabilities, p: the proxy's, both over the row's kept keys) from the final
    ``lse (T, H)`` and ``proxy_lse (T, Hs)``, by :class:`FwdKlSm90` on the driver's items
    (256 tokens; no split), one fp32 sum per item added by ``torch.sum`` (the same bits every
    run). ``unit`` must be ``None`` (no proxy gradient: this backend's backward makes it).
    ValueError for a call :func:`kl_fits` refuses (a query map ``wl.q_map``, a layout the
    kernel cannot run)."""
    if unit is not None:
        raise ValueError("unit: the CuTe KL stage does not make the proxy gradient")
    if wl.q_map is not None:
        raise ValueError("wl.q_map: the CuTe KL stage has no query map (kl_fits)")
    why = _kl_reason(q, k, q_proxy, k_proxy, wl.slots, cfg)
    if why is not None:
        raise ValueError(f"CuTe KL stage: {why}")
    T, H, D = q.shape
    Hs, Dp = q_proxy.shape[1:]
    for name, x, shape in (("lse", lse, (T, H)), ("proxy_lse", proxy_lse, (T, Hs))):
        if x.dtype != torch.float32 or tuple(x.shape) != shape:
            raise ValueError(
                f"CuTe KL stage: {name} must be fp32 {shape}, got {x.dtype} {tuple(x.shape)}"
            )
    kernel = FwdKlSm90(
        cutlass_dtype(q.dtype), H, k.shape[1], Hs, D, wl.slots, cfg.block_size,
        FwdKlSm90.warpgroups, True, Dp, k_proxy.shape[1],
    )  # fmt: skip
    W = wl.item_list.shape[0]  # the grid: every CTA writes its item's sum
    if W == 0:
        return torch.zeros((), dtype=torch.float32, device=q.device)
    sums = torch.empty((W,), dtype=torch.float32, device=q.device)
    tensors = (
        aligned(q.contiguous()).view(T * H, D),  # (contiguous: see launch_partials)
        aligned(k.contiguous()).permute(0, 2, 1),  # (T, D, Hkv): a TMA box = one head's block
        *(aligned(x) for x in wl[:6]),
        aligned(lse.contiguous()).view(-1),
        aligned(q_proxy.contiguous()).view(T * Hs, Dp),
        aligned(k_proxy.contiguous()).permute(0, 2, 1),  # (T, Dp, Hpk)
        aligned(proxy_lse.contiguous()).view(-1),
        sums,
    )
    scalars = (cfg.softmax_scale * LOG2E, (cfg.proxy_scale or 1.0) * LOG2E, wl.num_blocks)
    kernel, args = kl_arguments(kernel, tensors, scalars, stream(q.device))
    run_typed(kernel, q.device, args, KL_SIGNATURE)
    return sums.sum()


# ---------------------------------------------------------------------------------------------
# the combine of one chunk's partials: CombineSm90
# ---------------------------------------------------------------------------------------------
# byte alignment the combine's launch assumes of each buffer's base: 16 for the 16-byte loads
# and stores of o_part and out; the fp32 / int32 buffers are read and written one element at a
# time
O_ALIGN, SCALAR_ALIGN = 16, 4


def combine_fits(dtype: torch.dtype, H: int, Hs: int, K: int, D: int) -> bool:
    """Whether :func:`combine` can run a forward with these inputs (the main partials, the
    proxy LSE alone and both in one launch): the switch in ``cute.forward_stages`` asks this,
    else the driver borrows Triton's combine."""
    main = CombineSm90.can_implement(cutlass_dtype(dtype), H, Hs, K, D, True, proxy=True)
    proxy = CombineSm90.can_implement(None, Hs, Hs, K, 0, False)
    return main is None and proxy is None


def _address(name: str, buf: torch.Tensor, C: int, shape: tuple, dtype, align: int) -> int:
    """The device address of ``buf[:C]`` after checking the contract's buffer: ``dtype``,
    ``(>= C, *shape)``, contiguous, base ``align``-byte aligned (ValueError naming it)."""
    if (
        buf.dtype != dtype
        or buf.dim() != len(shape) + 1
        or tuple(buf.shape[1:]) != shape
        or buf.shape[0] < C
        or not buf.is_contiguous()
        or buf.data_ptr() % align
    ):
        raise ValueError(
            f"CuTe combine: {name} must be a contiguous, {align}-byte aligned {dtype} (>= {C}, "
            f"{', '.join(map(str, shape))}) buffer; got {buf.dtype} {tuple(buf.shape)}, "
            f"strides {buf.stride()}, address % {align} = {buf.data_ptr() % align}"
        )
    return buf.data_ptr()


def _output(name: str, buf: torch.Tensor, shape: tuple, dtype, align: int) -> torch.Tensor:
    """``buf`` itself if the kernel can write it in place (contiguous, ``align``-byte aligned),
    else a fresh buffer the caller copies back."""
    if buf.dtype != dtype or tuple(buf.shape) != shape:
        raise ValueError(
            f"CuTe combine: {name} must be a {dtype} {shape} tensor, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    if buf.is_contiguous() and buf.data_ptr() % align == 0:
        return buf
    return torch.empty(shape, dtype=dtype, device=buf.device)


def combine_arguments(kernel: CombineSm90, o, lp, idx, out, lse, pl, plse, tokens: int, strm):
    """The arguments of a launch of ``kernel`` (its ``__call__``): the seven buffers' device
    addresses (ints; an absent buffer: any address, never read) as typed pointers, the token
    count, the stream. The pointers' types and alignments depend on ``kernel`` alone, so the
    compile cache keys on the kernel object (:func:`combine`) and the compile check compiles
    what runs (``compile_check.compile_combine``)."""
    gmem = cute.AddressSpace.gmem
    o_type, o_align = (kernel.dtype, O_ALIGN) if kernel.has_o else (Float32, SCALAR_ALIGN)

    def f32(a):
        return make_ptr(Float32, a, gmem, assumed_align=SCALAR_ALIGN)

    return (
        make_ptr(o_type, o, gmem, assumed_align=o_align),
        f32(lp),
        make_ptr(Int32, idx, gmem, assumed_align=SCALAR_ALIGN),
        make_ptr(o_type, out, gmem, assumed_align=o_align),
        f32(lse),
        f32(pl),
        f32(plse),
        Int32(tokens),
        strm,
    )


COMBINE_SIGNATURE = builder_signature(combine_arguments)


def combine(o_part, l_part, idx, out, lse, proxy=None):
    """Driver stage ``combine`` (:mod:`flash_msa.sparse_forward`): merge the chunk's partials
    ``o_part (>= C, H, K, D)`` (input dtype) and ``l_part (>= C, H, K)`` fp32 by their LSE into
    ``out (C, H, D)`` and ``lse (C, H)`` fp32, C = ``idx.shape[0]``, ``idx (C, Hs, K)`` int32
    (-1: unused slot). With ``o_part`` and ``out`` ``None`` the LSE only (the proxy LSE:
    ``l_part = pl_part (>= C, Hs, K)``, ``lse = proxy_lse``). ``proxy = (pl_part, proxy_lse)``
    (with ``o_part``): the proxy LSE too, in the same launch."""
    has_o = o_part is not None
    if has_o != (out is not None):
        raise ValueError("CuTe combine: o_part and out are both given or both None")
    if proxy is not None and not has_o:
        raise ValueError("CuTe combine: proxy = (pl_part, proxy_lse) needs o_part and out")
    if idx.dtype != torch.int32 or idx.dim() != 3:
        raise ValueError(f"CuTe combine: idx must be int32 (C, Hs, K), got {idx.dtype} "
                         f"{tuple(idx.shape)}")  # fmt: skip
    C, Hs, K = idx.shape
    if lse.dim() != 2:
        raise ValueError(f"CuTe combine: lse must be (C, H), got {tuple(lse.shape)}")
    H = lse.shape[1]
    D = out.shape[-1] if has_o else 0
    if has_o:
        for name, t in (("o_part", o_part), ("out", out)):
            if t.dtype not in (torch.bfloat16, torch.float16):
                raise TypeError(
                    f"CuTe combine: {name} must be bfloat16 or float16 (the partials' and the "
                    f"output's dtype), got {t.dtype}"
                )
        kernel = CombineSm90(cutlass_dtype(out.dtype), H, Hs, K, D, True, proxy is not None)
    else:
        kernel = CombineSm90(None, H, Hs, K, 0, False)
    if C * H * K * max(D, 1) >= 2**31:  # the kernel's flat sizes and LSE offsets are int32
        raise ValueError(f"CuTe combine: C * H * K * D = {C * H * K * max(D, 1)} >= 2^31")
    f32 = torch.float32
    a_l = _address("l_part", l_part, C, (H, K), f32, SCALAR_ALIGN)
    if not idx.is_contiguous():
        idx = idx.contiguous()
    lse_buf = _output("lse", lse, (C, H), f32, SCALAR_ALIGN)
    a_o, a_out, a_pl, a_plse = a_l, lse_buf.data_ptr(), a_l, lse_buf.data_ptr()
    if has_o:
        a_o = _address("o_part", o_part, C, (H, K, D), out.dtype, O_ALIGN)
        out_buf = _output("out", out, (C, H, D), out.dtype, O_ALIGN)
        a_out = out_buf.data_ptr()
    if proxy is not None:
        pl_part, proxy_lse = proxy
        a_pl = _address("pl_part", pl_part, C, (Hs, K), f32, SCALAR_ALIGN)
        plse_buf = _output("proxy_lse", proxy_lse, (C, Hs), f32, SCALAR_ALIGN)
        a_plse = plse_buf.data_ptr()
    if C == 0:
        return
    device = lse.device
    args = combine_arguments(
        kernel, a_o, a_l, idx.data_ptr(), a_out, lse_buf.data_ptr(), a_pl, a_plse, C,
        stream(device),
    )  # fmt: skip
    run_typed(kernel, device, args, COMBINE_SIGNATURE)
    if lse_buf is not lse:
        lse.copy_(lse_buf)
    if has_o and out_buf is not out:
        out.copy_(out_buf)
    if proxy is not None and plse_buf is not proxy_lse:
        proxy_lse.copy_(plse_buf)
