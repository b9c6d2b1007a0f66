"""Host code of the CuTe backend's sparse ``fwd``: which stage of the sparse-forward driver
(:mod:`flash_msa.sparse_forward`) runs on which kernel, the forward's limits beyond
``LIMITS["fwd"]``, and the op itself.

Every stage runs on CuTe where its fit check takes the call: the work list
(:mod:`.worklist_sm90`, bit for bit :mod:`flash_msa.worklist`'s; on the H200 at anchor 16K the
forward's blocks, lists and items took 222 us of host time against 897 us by torch ops), the
per-block attention (:func:`.fwd_partials_sm90.partials`), which also makes the proxy LSE
partials in its own launch (:func:`.fwd_partials_sm90.proxy_fits`), the combine
(:func:`.combine_sm90.combine`, with the proxy LSE merge in the same launch:
:func:`.combine_sm90.combine_fits`) and the KL value (:func:`.fwd_partials_sm90.kl`:
:func:`.fwd_partials_sm90.kl_fits`). A stage whose fit check refuses the call is the Triton
backend's, borrowed through the driver (:func:`flash_msa.sparse_forward.borrowed`), with the
Triton stage's limits (:func:`fwd_reason`): e.g. the combine above 64 slots per row, the KL of
a query-mapped call or of D != Dp.

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

import torch

from .. import sparse_forward
from ..problem import Problem
from ..sparse_forward import Stages, borrowed_reason
from . import worklist_host
from .combine_sm90 import combine, combine_fits
from .common import cutlass_dtype
from .fwd_partials_sm90 import FwdPartialsSm90, kl, kl_fits, partials, proxy_fits
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
