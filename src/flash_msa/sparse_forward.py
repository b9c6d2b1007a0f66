"""The sparse forward's driver, shared by the GPU backends: chunk loop, work list, partials.

A backend's ``fwd`` (given indices, not warmup) is this driver run with the backend's
:class:`Stages`. Per chunk of C query tokens (a static loop: C depends on shapes only, so that
the partial buffers stay below :data:`PARTIAL_BYTES`) the driver

1. builds the chunk's work list (:func:`flash_msa.worklist.lists`, the sorted lists, cut into
   items by :func:`flash_msa.worklist.items`; the key blocks once for all chunks),
2. runs ``partials``: the per-block main attention of every work item into the partial buffers
   (and, if the stage says it does, the proxy LSE partials in the same launch),
3. runs ``proxy_partials`` when ``partials`` does not make the proxy LSE partials,
4. runs ``combine`` for the main partials (``out``, ``lse``) and for the proxy LSE partials
   (``proxy_lse``): two calls, or one when the stage says it makes both
   (``Stages.combine_makes_proxy``),
5. with ``cfg.compute_kl``, runs ``kl``: the chunk's sum of per-row KL terms (and, in training,
   the proxy gradient for ``dkl = 1``).

Where :func:`one_sort` allows it (a chunked call, within memory) step 1 is one sort of all rows
before the loop (``worklist.lists(..., chunk=C)``), each chunk's work list cut from it
(``worklist.chunk_items``: the same items), and step 5 one ``kl`` call after the loop over the
whole lists' items.

The partial-buffer contract (what a ``partials`` stage writes and ``combine`` reads), for the
chunk's packed tokens ``tok0 .. tok0 + C`` and a row ``(t, h, slot)`` with ``slot`` the
position of the key block in the token's index row:

| buffer | shape | dtype | content |
|---|---|---|---|
| ``o_part`` | ``(C, H, K, D)`` | input dtype | the row's attention over that block, ``O / l`` |
| ``l_part`` | ``(C, H, K)`` | fp32 | its natural-log LSE (``-inf``: no visible key) |
| ``pl_part`` | ``(C, Hs, K)`` | fp32 | the proxy's LSE over the same block, per selection head |

Rows of unused slots (index ``-1``) are never written and never read: ``combine`` masks them by
the index row. The KL stage reads the final ``lse`` and ``proxy_lse`` of the chunk's tokens.

A backend that does not have a stage yet leaves it ``None``: the driver then runs the Triton
backend's stage in its place (:func:`borrowed`), and :func:`borrowed_reason` adds that stage's
limits to the backend's own. The CuTe backend supplies every stage (``cute.forward.forward_stages``);
it leaves one out, and so borrows Triton's, only where its kernel cannot run the call (its
``*_fits``; the README's backend table says so).

With a query map (``q_map``, context parallelism) the chunks are chunks of query rows, ``k``,
``v``, ``k_proxy`` keep the keys' ``T`` rows, and the map reaches the stages inside the work
list (``wl.q_map``): the stage signatures do not change. Only stages that declare it
(``Stages.q_map``) are run with a map; the driver refuses the call otherwise.

The work list is built once per training step: when the forward runs in one chunk (``C == T``:
e.g. anchor 16K and 32K) and :func:`keeps` allows it, the returned ``Forward`` carries the
chunk's sorted lists (:func:`flash_msa.worklist.carry`), which api.py keeps for the backward;
the backends' ``bwd`` cut their own items from them instead of sorting again. A chunked forward
(long context, e.g. paper 32K: 4 chunks) sorts once too where :func:`one_sort` allows it, and
keeps those lists, of all rows; where it sorted per chunk it keeps nothing and its backward
builds as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from . import backends, ordered, worklist
from .problem import Config, Forward, Problem

PARTIAL_BYTES = 2 << 30  # the partial-output buffer of one query chunk stays below 2 GiB


@dataclass(frozen=True)
class Stages:
    """One backend's stages of the sparse forward. Signatures (all write into given buffers):

    - ``partials(q, k, v, wl, o_part, l_part, cfg, tok0, proxy)``: the main partials of work
      list ``wl``; ``proxy`` is ``None`` or ``(q_proxy, k_proxy, pl_part)`` and is passed only
      when ``partials_make_proxy`` (the proxy LSE partials then come from the same launch).
    - ``proxy_partials(q, k, q_proxy, k_proxy, wl, pl_part, cfg, tok0)``: the proxy LSE
      partials alone.
    - ``combine(o_part, l_part, idx, out, lse)``: merge a chunk's partials by LSE into ``out``
      ``(C, H, D)`` and ``lse`` ``(C, H)``; ``o_part=None``, ``out=None``: the LSE only (the
      proxy's, with ``l_part = pl_part`` and ``lse = proxy_lse``). When
      ``combine_makes_proxy``, the driver instead calls ``combine(o_part, l_part, idx, out,
      lse, (pl_part, proxy_lse))`` once per chunk: both merges in one launch (one pass over
      ``idx``).
    - ``kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit)``: fp32 0-dim sum of the
      per-row KL of the chunk's rows; with ``unit = (dq_proxy, dk_proxy)`` (fp32) it also adds
      the proxy gradient for ``dkl = 1`` there.

    ``None``: the Triton backend's stage runs in its place (:func:`borrowed`).

    With a query map the work list carries it (``wl.q_map``, else ``None``): a stage takes each
    query row's causal position from it; rows (``q``, ``q_proxy``, the partials, ``out``,
    ``lse``) stay query rows and keys (``k``, ``v``, ``k_proxy``) key tokens.
    """

    partials: Callable
    partials_make_proxy: bool = False
    proxy_partials: Callable | None = None
    combine: Callable | None = None
    combine_makes_proxy: bool = False  # combine takes (pl_part, proxy_lse) in the same launch
    kl: Callable | None = None
    kl_makes_proxy_grad: bool = False  # the kl stage can make the unit proxy gradient
    q_map: bool = False  # every stage of these (borrowed ones included) honours wl.q_map
    # the work-list build: a module-like object with worklist's ``blocks``, ``lists``,
    # ``items`` and ``chunk_items`` (the same signatures and results, bit for bit); a backend
    # may build it with its own kernels (the CuTe backend: cute/worklist_host.py)
    work: Any = worklist


BORROWED_FROM = "triton"


def _lender() -> Stages:
    module, why = backends.load(BORROWED_FROM)
    if module is None:
        raise RuntimeError(f"the {BORROWED_FROM} backend's forward stages are needed: {why}")
    return module.forward_stages()


def borrowed_names(stages: Stages, proxy: bool = True, compute_kl: bool = True) -> tuple[str, ...]:
    """The stages of ``stages`` that the driver would borrow (``None`` and called) for a call
    with a proxy (``proxy``) and ``compute_kl``: not ``proxy_partials`` when the partials make
    the proxy LSE or there is no proxy, not ``kl`` without a proxy and ``compute_kl``
    (:func:`fwd` never calls them then), so that a stage the driver does not call adds no
    limits (:func:`borrowed_reason`)."""
    unused = ()
    if stages.partials_make_proxy or not proxy:
        unused += ("proxy_partials",)
    if not (proxy and compute_kl):
        unused += ("kl",)
    return tuple(
        f.name for f in fields(Stages) if getattr(stages, f.name) is None and f.name not in unused
    )


def borrowed(stages: Stages, proxy: bool = True, compute_kl: bool = True) -> Stages:
    """``stages`` with every stage the driver calls for a call with a proxy (``proxy``) and
    ``compute_kl`` (:func:`borrowed_names`) that is ``None`` replaced by the Triton backend's;
    a stage the call never runs stays ``None`` (the Triton backend is not even loaded for it)."""
    missing = borrowed_names(stages, proxy, compute_kl)
    if not missing:
        return stages
    lender = _lender()
    fill = {name: getattr(lender, name) for name in missing}
    if "kl" in missing:
        fill["kl_makes_proxy_grad"] = lender.kl_makes_proxy_grad
    if "combine" in missing:
        fill["combine_makes_proxy"] = lender.combine_makes_proxy
    fill["q_map"] = stages.q_map and lender.q_map  # the backend's own stages decide first
    return Stages(**{**{f.name: getattr(stages, f.name) for f in fields(Stages)}, **fill})


def with_proxy_grad(stages: Stages) -> Stages:
    """``stages`` (borrowed ones filled in) for a call that asks for the unit proxy gradient:
    a ``kl`` stage that cannot make it (the CuTe one, whose backend's backward makes the proxy
    gradient itself) gives way to the Triton backend's, which makes it in the same pass. So the
    driver makes the unit gradient whenever it is asked for, with a proxy and ``compute_kl``,
    whichever ``kl`` stage a backend has (``flash_msa.ops.makes_unit_proxy_grad`` relies on it:
    the fake implementation cannot see a call's stage choice)."""
    stages = borrowed(stages)
    if stages.kl_makes_proxy_grad:
        return stages
    lender = _lender()
    return replace(
        stages, kl=lender.kl, kl_makes_proxy_grad=True, q_map=stages.q_map and lender.q_map
    )


def borrowed_reason(stages: Stages, problem: Problem) -> str | None:
    """Why the stages ``stages`` borrows (:func:`borrowed_names`) cannot run ``problem``
    (``None``: they can, or it borrows none). A call that asks the forward for the unit proxy
    gradient may borrow the Triton ``kl`` too (:func:`with_proxy_grad`); its caller checks
    that case (the CuTe backend's forward is not asked for it: its backward makes it)."""
    proxy, kl = problem.proxy_head_dim > 0, problem.cfg.compute_kl
    if not borrowed_names(stages, proxy, kl):
        return None
    why = backends.reason_not(BORROWED_FROM, "fwd", problem)
    return None if why is None else f"its {BORROWED_FROM} forward stages cannot run: {why}"


def fwd(
    stages: Stages,
    q,
    k,
    v,
    indices,
    cu_seqlens,
    cfg: Config,
    q_proxy=None,
    k_proxy=None,
    proxy_grad=False,
    *,
    q_map=None,
) -> Forward:
    """Backend op ``fwd`` (contract in docs/design.md) for given indices, run with ``stages``.

    With ``proxy_grad`` and ``compute_kl`` the KL stage (a Triton one where the backend's
    cannot: :func:`with_proxy_grad`) also accumulates the proxy gradient for ``dkl = 1``
    (``Forward.proxy_grad``, fp32): the gradient is linear in ``dkl``, so ``bwd`` only scales
    it instead of recomputing the same scores.

    ``q_map``: ``None`` or ``(Tq,)`` int32, the contract's query map (docs/design.md): ``q``,
    ``q_proxy``, ``indices`` and the outputs have ``Tq`` rows, the KL is a mean over ``Hs * Tq``
    rows, padding rows (``-1``) get ``out = 0``, ``lse = -inf`` (their indices are ignored).
    Needs ``stages.q_map``.

    The result carries the forward's sorted lists (:func:`flash_msa.worklist.carried`) when it
    ran in one chunk and :func:`keeps` them, or sorted once (:func:`one_sort`): ``T * Hs * K *
    8`` bytes (+ ``(Hs * NB + 1) * 8 + NB * 8``), held as long as the caller holds them (api.py:
    until the backward).
    """
    if proxy_grad:
        stages = with_proxy_grad(stages)
    else:
        stages = borrowed(stages, q_proxy is not None, cfg.compute_kl)
    if q_map is not None and not stages.q_map:
        raise ValueError("q_map: these forward stages do not implement a query map")
    T, H, D = q.shape
    Hs, K = indices.shape[1:]
    proxy = q_proxy is not None
    f32 = dict(dtype=torch.float32, device=q.device)
    C = min(T, max(1, PARTIAL_BYTES // (H * K * D * q.element_size())))
    out = torch.empty_like(q)
    lse = torch.empty((T, H), **f32)
    proxy_lse = torch.empty((T, Hs), **f32) if proxy else None
    kl_sum = None  # the chunks' KL sum: the first chunk's itself (no zero fill), then added
    unit = None
    if proxy and cfg.compute_kl and proxy_grad and stages.kl_makes_proxy_grad:
        unit = (torch.zeros(q_proxy.shape, **f32), torch.zeros(k_proxy.shape, **f32))
    work = stages.work
    key_blocks = work.blocks(cu_seqlens, cfg.block_size, k.shape[0])  # every chunk's
    sorted_lists = whole = None
    if one_sort(T, C, Hs, K, key_blocks.num_blocks, q, k, v, cfg, unit):
        whole = work.lists(
            indices, cu_seqlens, cfg.block_size, 0, k.shape[0], q_map, key_blocks, chunk=C
        )  # (before the partial buffers: the sort's transient memory is freed by then)
        chunk_wls = work.chunk_items(whole, worklist.ITEM_TOKENS)  # every chunk's at once
    o_part = torch.empty((C, H, K, D), dtype=q.dtype, device=q.device)
    l_part = torch.empty((C, H, K), **f32)
    pl_part = torch.empty((C, Hs, K), **f32) if proxy else None
    for c, c0 in enumerate(range(0, T, C)):
        c1 = min(T, c0 + C)
        idx = indices[c0:c1]
        if q_map is not None:  # padding rows: no keys, whatever their slots hold (combine)
            idx = worklist.drop_padding_rows(idx, q_map[c0:c1])
        if whole is not None:  # the chunk's runs of the one sort: the same work list
            wl = chunk_wls[c]
        else:
            sorted_lists = work.lists(
                idx, cu_seqlens, cfg.block_size, c0, k.shape[0], q_map, key_blocks
            )
            wl = work.items(sorted_lists, worklist.ITEM_TOKENS)
        fused = (q_proxy, k_proxy, pl_part) if proxy and stages.partials_make_proxy else None
        stages.partials(q, k, v, wl, o_part, l_part, cfg, c0, fused)
        if proxy and fused is None:
            stages.proxy_partials(q, k, q_proxy, k_proxy, wl, pl_part, cfg, c0)
        if proxy and stages.combine_makes_proxy:
            stages.combine(o_part, l_part, idx, out[c0:c1], lse[c0:c1], (pl_part, proxy_lse[c0:c1]))
        else:
            stages.combine(o_part, l_part, idx, out[c0:c1], lse[c0:c1])
        if not proxy:
            continue
        if not stages.combine_makes_proxy:
            stages.combine(None, pl_part, idx, None, proxy_lse[c0:c1])
        if cfg.compute_kl and whole is None:
            part = stages.kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit).float()
            kl_sum = part if kl_sum is None else kl_sum + part
    if proxy and cfg.compute_kl and whole is not None:  # once, over the whole lists' items
        wl = work.items(whole, worklist.ITEM_TOKENS)
        kl_sum = stages.kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit).float()
    kl = None
    if proxy and cfg.compute_kl:
        kl = (torch.zeros((), **f32) if kl_sum is None else kl_sum) / (Hs * T)
    f = Forward(out, lse, proxy_lse, kl, unit)
    if whole is not None:  # (one_sort checked keeps' share before sorting: this is a formality)
        sorted_lists = whole.unchunked()
    elif C < T:
        return f  # chunked (long context) and sorted per chunk: each chunk's lists are gone
    if not keeps(sorted_lists, q, k, v):
        return f  # too large to keep
    # the ordered backwards sort per chunk of their own when their dQ partials (>= H K D fp32
    # per row) need chunks: nothing to keep
    if cfg.deterministic and ordered.token_chunk(T, H * K * D * 4) < T:
        return f
    return worklist.carry(f, sorted_lists)


# One sort per chunked forward: a chunked
# forward (C < T) sorts its work list once over all rows (worklist.lists(..., chunk=C)) instead
# of once per chunk, cuts each chunk's work list from it (worklist.chunk_items: the same items,
# so out, lse and proxy_lse are bitwise those of the per-chunk sorts), runs the KL stage once
# after the chunk loop over the whole lists' items (fuller items: the KL value changes by its
# fp32 summation order only, the same bits every run) and keeps the lists for the backward
# (which then does not sort). Paper 128K (16 chunks): 1 sort instead of 16, 67 torch ops of
# driver glue instead of 464 (counted on CPU with stub stages: tests/ops/test_worklist.py).
# Measured on the H200 (same run, verified bitwise against the per-chunk sorts): the CuTe
# forward op at paper 128K 70.42 -> 66.02 ms
# random, 65.29 -> 64.17 local (predicted 64-66); the bench's training step 173.6 -> 170.1 ms
# with the KL, 153.9 -> 152.3 without. The per-chunk sort stays only as the fallback where
# :func:`one_sort` says no (memory; deterministic mode with a unit proxy gradient).

# The one sort's transient device memory may reach this (worklist.lists over all T rows: ~40
# bytes per (row, selection head, slot) entry at the sort's peak, cute/warmup.py's count, as
# the backward's own sort of the same entries, which keeping the lists then saves): paper 128K
# 8.4M entries 0.34 GB, long 1M 67M entries 2.7 GB. It runs before the partial buffers
# (PARTIAL_BYTES) are allocated, so the two do not add up.
ONE_SORT_BYTES = 4 << 30


def one_sort(T: int, C: int, Hs: int, K: int, NB: int, q, k, v, cfg: Config, unit) -> bool:
    """Whether :func:`fwd` sorts once for all its ``T // C`` chunks: a chunked call (``C < T``:
    one chunk sorts once anyway), the sort's transient memory
    (``worklist.SORT_BYTES_PER_ENTRY`` per entry) within :data:`ONE_SORT_BYTES`, and the lists it
    holds through the forward (``T * Hs * K * 8`` bytes of ``perm``, ``(NC + 1) (Hs NB + 1)
    * 8`` of the chunk table, ``NB * 8`` of blocks; paper 128K: 67 MB) within :func:`keeps`'
    share of q, k, v and out, so that they can be kept for the backward too (outside
    deterministic mode: there the ordered backward sorts per chunk of its own, a quarter of the
    forward's chunk at real sizes, so :func:`fwd` drops the lists after the forward). Not
    with a unit proxy gradient in deterministic mode: the Triton KL stage's ordered dQ_proxy
    row partials are sized by its work list's rows (ordered.PARTIAL_BYTES per chunk; all T rows
    there)."""
    if C >= T or (cfg.deterministic and unit is not None):
        return False
    entries = T * Hs * K
    if worklist.SORT_BYTES_PER_ENTRY * entries > ONE_SORT_BYTES:
        return False
    held = entries * 8 + (-(-T // C) + 1) * (Hs * NB + 1) * 8 + NB * 8
    return KEEP_SHARE * held <= 2 * q.nbytes + k.nbytes + v.nbytes


# The forward's sorted lists are kept for the backward (:func:`fwd`) only while they cost at most
# 1 / KEEP_SHARE of the bytes of q, k, v and out, which every backward keeps anyway: a training
# step's saved memory grows by at most that share (anchor 16K: 8 MiB of 144 MiB, 5.6%; heads
# that select alone with a small D and a large top_k, e.g. H = Hs = 16, Hkv 2, D 64, K 64:
# 8 KiB of lists per token against 4.5 KiB, not kept, the backward sorts again). What keeping
# saves: the backward's sort of T * Hs * K keys and the ops around it (worklist.lists).
KEEP_SHARE = 4


def keeps(sorted_lists: worklist.Lists | None, q, k, v) -> bool:
    """Whether the forward keeps ``sorted_lists`` for the backward: within 1 /
    :data:`KEEP_SHARE` of the bytes of ``q``, ``k``, ``v`` and ``out`` (as large as ``q``)."""
    if sorted_lists is None:
        return False
    return KEEP_SHARE * sorted_lists.nbytes <= 2 * q.nbytes + k.nbytes + v.nbytes
