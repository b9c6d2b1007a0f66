"""The dense warmup on the CuTe backend: the sparse op over fixed block lists.

The warmup (``msa_attention(..., warmup=True)``: dense causal main attention, KL over every
visible key) is the sparse op with every causal block kept (docs/algorithm.md, "Warmup mode":
the KL formula with the dense ``T``; ``reference.fwd`` with ``indices=None`` builds the causal mask,
with the lists of :func:`flash_msa.worklist.causal_blocks` the block mask of every block
``<= i // b`` and the causal mask: the same set, so the same outputs; tests/ops/test_warmup.py
checks it). So :func:`fwd` and :func:`bwd` build those lists on the device (no selection pass,
no host synchronization) and run the CuTe sparse forward (the driver,
:mod:`flash_msa.sparse_forward`) and the fused backward with ``top_k`` = the list width.

Measured (H200, anchor layout, S 8192: 64 blocks, every
one kept): the sparse op on CuTe over these lists, forward + backward with the KL, 8.78 / 27.85
ms at B 1 / 4 against the Triton warmup's 11.22 / 41.92 in the same run; max relative
differences of out / kl / gradients 1e-3 / 5e-7 / <= 5e-3 (bf16).

Limits beyond the sparse op's (:func:`reason`):

* memory: the lists and the work list grow as ``T * Hs * W`` (``W`` the width), the Triton
  warmup's buffers as ``T``; the CuTe warmup runs within :data:`LIST_BYTES` (formula there),
  else ``auto`` runs the Triton warmup and ``info()`` / the warning say why;
* no Triton stage at ``top_k = W > 64`` (Triton's ``max_top_k``): the combine is CuTe's in two
  levels (:func:`grouped_combine`: its kernel merges at most 64 slots per row), the proxy LSE
  partials come from the CuTe partials, the KL from a CuTe kernel, and the forward is never
  asked for the unit proxy gradient (the Triton warmup ignores it too; the backward makes it).
  A call whose CuTe stages cannot run it is refused before any kernel runs.

Every CuTe kernel specializes on ``top_k`` (a field of its configuration: the flat entry
``token * Hs * K + head * K + slot`` is divided by ``Hs * K`` at compile time): each width is
its own set of compiled kernels (the partials, the combine's two levels, the KL, the backward:
about 5 compiles, cached on disk). :func:`width` rounds the block count up to a multiple of
:data:`GROUP` above 64 so that sequence lengths within one 8K step (block 128) share them.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import sparse_forward, worklist
from ..backends import BackendError
from ..problem import Config, Forward, Problem, Saved
from .backward import bwd_kernel_reason
from .bwd_sm90 import BwdSm90
from .common import cutlass_dtype
from .forward import combine, combine_fits, fwd_reason, meta_inputs, stages_for
from .fwd_partials_sm90 import FwdPartialsSm90

GROUP = 64  # slots the CuTe combine merges per row (combine_sm90.MAX_TOPK): the first level

# The bytes that grow as T * Hs * W (W: :func:`width`), per list entry, at the peak of the
# backward's work-list sort over all T rows (backward.bwd: worklist.lists over the whole call):
# the index lists (int32, 4), the sort keys (int32, 4), the sorted keys (4), the permutation
# (int64, 8), and inside torch.sort(stable=True) of a 1-D tensor (ATen's SortStable.cu: a
# segmented sort) an int64 index array (8) and cub's alternate key and value buffers (4 + 8):
# 40 bytes (counted from ATen's and cub's source). The items are
# W' = T Hs W / 256 + Hs NB entries of 16 bytes, < 1 byte per entry. The forward sorts per
# query chunk (less), and its partial buffers are bounded apart by
# sparse_forward.PARTIAL_BYTES (2 GiB: o_part C H W D, plus l_part C H W and pl_part C Hs W
# fp32 and the grouped combine's expanded indices C H W int32, 12 bytes per (row, slot)
# against o_part's 256 at D 128 bf16). T is bounded by num_seqs * max_seqlen (the Problem has
# no token count: a varlen call is counted as if every sequence were the longest); the heads
# are the most either pass may use (:func:`list_heads`). Budget: 6 GiB of transient memory
# (freed after the step), 4 % of an H200: 0.31 GiB per sequence at 16K, 1.25 at 32K, 5 at 64K
# (4 heads, block 128: the anchor and paper layouts alike): 16K up to B 19, 32K up to B 4, 64K
# B 1 (H200: the whole anchor-64K warmup step peaked at 6.71
# GiB against the Triton warmup's 3.02); beyond that the Triton warmup (O(T) memory) runs.
# A sort-free builder (each list is one run of tokens: 8 bytes per entry, no sort) would cut
# this five-fold: not written yet.
LIST_BYTES = 6 << 30
BYTES_PER_ENTRY = worklist.SORT_BYTES_PER_ENTRY


def width(max_seqlen: int, block_size: int) -> int:
    """Slots per list row: the block count ``ceil(max_seqlen / block_size)``, rounded up to a
    multiple of :data:`GROUP` above :data:`GROUP` (the grouped combine's levels; fewer compiled
    widths)."""
    nb = -(-max_seqlen // block_size)
    return nb if nb <= GROUP else -(-nb // GROUP) * GROUP


def list_bytes(tokens: int, sel_heads: int, max_seqlen: int, block_size: int) -> int:
    """The warmup's ``T * Hs * W``-sized bytes (:data:`LIST_BYTES`' formula)."""
    return BYTES_PER_ENTRY * tokens * sel_heads * width(max_seqlen, block_size)


def sparse_config(cfg: Config) -> Config:
    """The sparse op's configuration that runs warmup ``cfg``: ``top_k`` = the list width."""
    return dataclasses.replace(cfg, warmup=False, top_k=width(cfg.max_seqlen, cfg.block_size))


def stages(q, k, q_proxy, k_proxy, indices, cfg: Config) -> sparse_forward.Stages:
    """The forward's stages for the lists ``indices`` (as ``forward.fwd`` picks
    them), with the combine grouped (:func:`grouped_combine`) where a row has more than
    :data:`GROUP` slots. Tensors may be on the meta device (:func:`reason` asks with shapes)."""
    H, D = q.shape[1:]
    Hs, K = indices.shape[1:]
    if K <= GROUP:
        return stages_for(q, k, q_proxy, k_proxy, indices, cfg)
    # the two levels: 64 slots of one row, then the groups' merges
    fits = combine_fits(q.dtype, 1, 1, GROUP, D) and combine_fits(q.dtype, H, Hs, K // GROUP, D)
    st = stages_for(q, k, q_proxy, k_proxy, indices, cfg, combine_ok=fits)
    if st.combine is not None:
        st = dataclasses.replace(st, combine=grouped_combine(combine))
    return st


def reason(op: str, problem: Problem) -> str | None:
    """Why the CuTe warmup cannot run ``op`` (``"fwd"`` / ``"bwd"``) of warmup ``problem``
    (``None``: it can), after ``LIMITS["warmup"]``: the list budget (:data:`LIST_BYTES`), then
    the sparse op's limits at ``top_k`` = the width: the forward's kernel and the stages
    :func:`stages` picks (a Triton one adds Triton's limits: ``max_top_k`` 64), the fused
    backward's kernel."""
    cfg = problem.cfg
    if problem.q_map:
        return "the CuTe warmup takes no query map (q_map)"
    tokens = problem.num_seqs * cfg.max_seqlen
    heads = list_heads(problem)
    need = list_bytes(tokens, heads, cfg.max_seqlen, cfg.block_size)
    if need > LIST_BYTES:
        return (
            f"the CuTe warmup's block lists need {need / 2**30:.2f} GiB ({BYTES_PER_ENTRY} B x "
            f"{tokens} tokens x {heads} list heads x "
            f"{width(cfg.max_seqlen, cfg.block_size)} blocks), over its budget of "
            f"{LIST_BYTES / 2**30:.0f} GiB (flash_msa.cute.warmup.LIST_BYTES)"
        )
    scfg = sparse_config(cfg)
    sparse = dataclasses.replace(problem, cfg=scfg)
    if op == "fwd":
        why = fwd_reason(sparse, stages(*meta_inputs(sparse), scfg))
    else:
        why = bwd_kernel_reason(sparse)
    if why is not None:
        return f"the CuTe warmup runs the sparse {op} at top_k {scfg.top_k}: {why}"
    return None


def lists(cu_seqlens, cfg: Config, heads: int, total_tokens: int) -> torch.Tensor:
    """The warmup's block lists (:func:`flash_msa.worklist.causal_blocks`) at the width of
    :func:`sparse_config`: ``(T, heads, W)`` int32."""
    W = width(cfg.max_seqlen, cfg.block_size)
    return worklist.causal_blocks(
        cu_seqlens, cfg.block_size, cfg.max_seqlen, heads, total_tokens, W
    )


def fwd(q, k, v, cu_seqlens, cfg: Config, q_proxy=None, k_proxy=None, q_map=None) -> Forward:
    """Backend op ``fwd`` of a warmup call (``indices`` None): the CuTe sparse forward over
    every causal block (:func:`lists`). ``Forward.proxy_grad`` is ``None`` (as the Triton
    warmup's: the backward makes the proxy gradient). A stage the CuTe kernels cannot run
    raises :class:`~flash_msa.BackendError` before any kernel runs (``auto`` does not get here:
    :func:`reason` refused the call)."""
    if q_map is not None:
        raise ValueError("q_map: the CuTe warmup does not take a query map")
    scfg = sparse_config(cfg)
    if q_proxy is not None:
        Hs = q_proxy.shape[1]
    else:  # no proxy (no KL, no proxy gradient): any head count the kernels take
        Hs = main_heads(q.dtype, q.shape[1], k.shape[1], q.shape[2], scfg)
    indices = lists(cu_seqlens, cfg, Hs, q.shape[0])
    st = stages(q, k, q_proxy, k_proxy, indices, scfg)
    missing = sparse_forward.borrowed_names(st, q_proxy is not None, cfg.compute_kl)
    if missing:
        raise BackendError(
            f"the CuTe warmup's forward would borrow Triton's {', '.join(missing)} at top_k "
            f"{scfg.top_k} (Triton's stages stop at 64)"
        )
    return sparse_forward.fwd(st, q, k, v, indices, cu_seqlens, scfg, q_proxy, k_proxy, False)


def bwd(dout, dkl, saved: Saved, cu_seqlens, cfg: Config, sparse_bwd, q_map=None):
    """Backend op ``bwd`` of a warmup call (``saved.indices`` None): ``sparse_bwd`` (the CuTe
    fused backward) over the forward's lists, built again (cheap: no selection) unless the
    forward's sorted lists came with ``saved`` (then the backward cuts its items from them)."""
    if q_map is not None:
        raise ValueError("q_map: the CuTe warmup does not take a query map")
    scfg = sparse_config(cfg)
    q, k = saved.q, saved.k
    kept = worklist.carried(saved)
    if saved.q_proxy is not None:
        Hs = saved.q_proxy.shape[1]
    elif kept is not None:  # no proxy saved (frozen proxy, KL on): the forward's lists' heads,
        Hs = kept.heads  # so that they match and are not sorted again (every head's are alike)
    else:  # main gradients only: any head count the kernel takes
        Hs = main_heads(q.dtype, q.shape[1], k.shape[1], q.shape[2], scfg)
    indices = lists(cu_seqlens, cfg, Hs, q.shape[0])
    full = worklist.carry(saved._replace(indices=indices), kept)
    return sparse_bwd(dout, dkl, full, cu_seqlens, scfg)


def list_heads(problem: Problem) -> int:
    """The most list heads a pass of warmup ``problem`` may use: the proxy's selection heads
    (a pass with the proxy) or :func:`main_heads` (a pass without it), whichever is more."""
    H, Hkv, D = problem.num_heads, problem.num_kv_heads, problem.head_dim
    scfg = sparse_config(problem.cfg)
    return max(problem.num_sel_heads, main_heads(problem.dtype, H, Hkv, D, scfg))


def main_heads(dtype: torch.dtype, H: int, Hkv: int, D: int, cfg: Config) -> int:
    """The lists' head count of a forward or backward without the proxy (no ``q_proxy``, so no
    selection heads known): every head keeps the same blocks, so any count the kernels take
    gives the same result; ``Hkv`` (the fewest lists at the usual layouts; at most the
    selection heads ``reason`` budgeted where each selection head's main heads share one KV
    head, as the fused backward needs) if the forward's partials and the fused backward take
    it, else ``H`` (one list per main head)."""
    dt, K, b = cutlass_dtype(dtype), cfg.top_k, cfg.block_size
    for Hs in dict.fromkeys((Hkv, H)):
        if (
            H % Hs == 0
            and FwdPartialsSm90.can_implement(dt, H, Hkv, Hs, D, K, b) is None
            and BwdSm90.can_implement(dt, H, Hkv, Hs, Hs, D, D, K, b, False) is None
        ):
            return Hs
    return H


def grouped_combine(combine):
    """The driver's ``combine`` stage for rows of ``K`` = a multiple of :data:`GROUP` slots
    from ``combine`` (one of at most :data:`GROUP` slots per row): two levels.

    1. every group of :data:`GROUP` slots of a ``(t, h)`` row is a row of its own: the buffers
       viewed as ``(C * H * K / GROUP, 1, GROUP[, D])`` (no copy), the index rows expanded
       to the main heads (``C H K`` int32); out ``(C H K/GROUP, D)`` in the input dtype, lse
       fp32 (the proxy LSE likewise, its rows ``(t, p)``);
    2. the groups merged by their LSE: ``combine`` with ``K / GROUP`` slots per row, a group
       used where its first slot is (the lists are ascending and -1 padded), and the proxy's
       in the same launch.

    The group outputs are rounded to the input dtype once more than the one-level merge
    (``O / l`` per group; the partials already are)."""

    def stage(o_part, l_part, idx, out, lse, proxy=None):
        C, Hs, K = idx.shape
        H = lse.shape[1]
        G, n = H // Hs, K // GROUP
        first = idx[:, :, ::GROUP].contiguous()  # (C, Hs, n): the group's first slot
        rows = idx.repeat_interleave(G, dim=1).reshape(C * H * n, 1, GROUP)  # main rows' slots
        l2 = torch.empty((C, H, n), dtype=torch.float32, device=idx.device)
        o2 = o_in = o_out = None  # the LSE only where o_part is None
        if o_part is not None:
            D = out.shape[-1]
            o2 = torch.empty((C, H, n, D), dtype=out.dtype, device=idx.device)
            o_in, o_out = o_part[:C].view(C * H * n, 1, GROUP, D), o2.view(C * H * n, 1, D)
        combine(o_in, l_part[:C].view(C * H * n, 1, GROUP), rows, o_out, l2.view(C * H * n, 1))
        second = ()
        if proxy is not None:
            pl_part, proxy_lse = proxy
            pl2 = torch.empty((C, Hs, n), dtype=torch.float32, device=idx.device)
            combine(
                None, pl_part[:C].view(C * Hs * n, 1, GROUP), idx.reshape(C * Hs * n, 1, GROUP),
                None, pl2.view(-1, 1),
            )  # fmt: skip
            second = ((pl2, proxy_lse),)
        combine(o2, l2, first, out, lse, *second)

    return stage
