"""CuTe DSL backend (nvidia-cutlass-dsl) for Hopper SM90.

What exists, for sm_90, checked on an H200:

* ``select``: proxy block selection (``select_sm90.py``: ``SelectSm90``);
* ``fwd`` (sparse, not warmup): the per-block main attention is the CuTe kernel of
  ``fwd_partials_sm90.py`` (``FwdPartialsSm90``), run by the backend-neutral driver
  ``flash_msa.sparse_forward``; the proxy LSE, the combine of the partials and the KL value are
  the Triton backend's stages, borrowed through the driver's stage interface (until CuTe has
  its own).

One module per kernel, named by op and architecture. A kernel is a frozen dataclass (its static
configuration, tuning choices included, as constructor arguments) with a ``@cute.jit``
``__call__`` (host setup and launch), a ``@cute.kernel`` ``kernel`` and its role methods, and a
``can_implement`` that says why a configuration cannot run (shared-memory arithmetic
included); ``common.py`` holds what they share.

* ``bwd`` (sparse, not warmup): one fused key-outer kernel for the main and the proxy gradients
  (``bwd_ws_sm90.py``: ``BwdWsSm90``, warp-specialized, where it can run; else ``bwd_sm90.py``:
  ``BwdSm90``; ``BwdSm90.make`` picks), within ``LIMITS["bwd"]`` and :func:`bwd_kernel_reason` (each
  selection head's main heads share one KV head); the forward then does not make the proxy
  gradient (``FUSED_PROXY_GRAD``).

* the dense warmup (``fwd`` / ``bwd`` with ``indices`` None): the sparse forward and the
  fused backward over every causal block (``warmup.py``: lists built on the device, no
  selection), within ``LIMITS["warmup"]`` and ``warmup.reason`` (a memory budget for the lists,
  no Triton stage at top_k > 64); outside them ``auto`` runs the Triton warmup.

A call outside the limits: ``auto`` runs it on the Triton backend (the ops share one tensor
contract, see docs/design.md), and ``FLASH_MSA_BACKEND=cute`` raises
:class:`~flash_msa.BackendError`; so does a backward outside its limits (``auto`` runs it on
Triton within the same autograd step). Blackwell (sm_100) kernels are not written yet.

Kernels are compiled on first use and cached in-process (``common.run_typed``) and on disk
(``disk_cache.py``: a second process loads instead of compiling; ``FLASH_MSA_CACHE=0`` off) per
kernel object
(every field of its configuration: dtype, head dims, head counts, top_k, block size, tuning),
static layout of its arguments and device; sequence lengths, token counts and the number of
sequences are run-time values (no recompilation).
"""

from __future__ import annotations

import dataclasses

from .. import limits
from ..limits import Limits
from ..problem import Problem

_SM90 = dict(capabilities=((9, 0),), capability_note="CuTe kernels exist for Hopper only so far")
# The query map (context parallelism) in the selection and the backward (SelectSm90, BwdSm90,
# BwdWsSm90 and the KL mode with qmap=True): declared. H200 (eighth session,
# benchmarks/results/stage3-s8/test_qmap.log): tests/test_gpu_cute.py and
# tests/test_gpu_cute_bwd.py -k q_map, 40 passed (mapped selection and backward against the
# reference and the Triton backend). The forward's partials have no map: a mapped forward
# borrows nothing, it runs on Triton (fwd's limits do not declare q_map).
Q_MAP_DECLARED = True
# The FP8 selection (``selection_precision="fp8"``, issue 15: ``SelectSm90`` with e4m3 operands
# and ``key_scale``, after the quantize pass ``flash_msa.quant.quantize``): on. H200, eighth
# session (benchmarks/results/stage3-s8/): tests/test_gpu_cute_fp8.py 38 passed (against the
# Triton fp8 oracle on identical quantized operands and the reference); cute_select_ab.py
# --fp8: no row differs from Triton's fp8 selection beyond near-ties; the kernel 741 / 1053
# TFLOP/s at paper 128K (random / local, top_k 16; bf16 CuTe 601 / 782) and 935 / 1180 at
# anchor 1M (bf16 655 / 796); Triton's fp8 selection 275-326. No query map in the fp8 kernel
# (``_select_reason``).
FP8_SELECTION_ON_CUTE = True
# The query map in the forward partials (``fwd_partials_sm90.FwdPartialsSm90(qmap=True)``, main
# and proxy parts; context parallelism). Declared (ninth session, H200, benchmarks/results/
# stage9/test_verify8b.log: tests/test_gpu_cute.py -k q_map passed with the other mapped
# tests, 67 in all); compile_check "fwd ... qmap": no spills but 8 bytes at the paper layout.
# Declares the map in LIMITS["fwd"] and in forward_stages' q_map.
FWD_Q_MAP_DECLARED = True
# the fused backward (bwd_sm90.py)
BWD_LIMITS = Limits(
    **_SM90,
    head_dims=(64, 128),
    proxy_head_dims=(64, 128),
    # ordered sums of per-slot / per-item partials (BwdSm90(deterministic=True)); bitwise equal
    # across runs and by the rule on the H200 (tests/test_gpu_cute_bwd.py, sixth session)
    deterministic=True,
    q_map=Q_MAP_DECLARED,  # BwdSm90 / BwdWsSm90(qmap=True): see Q_MAP_DECLARED
    note="one fused kernel for the main and proxy gradients; each selection head's main heads "
    "must share one KV head",
)
# Deterministic mode (Problem.deterministic): the selection and the forward's partials have no
# atomics (every output element has one writer; the borrowed Triton stages order their sums
# when cfg.deterministic); the fused backward stores partials instead of fp32 atomics and
# flash_msa.ordered adds them in a fixed order.
LIMITS = {
    "select": Limits(  # the query map: SelectSm90(qmap=True), see Q_MAP_DECLARED
        **_SM90,
        proxy_head_dims=(64, 128),
        max_top_k=64,
        deterministic=True,
        q_map=Q_MAP_DECLARED,
        fp8_selection=FP8_SELECTION_ON_CUTE,
    ),
    # every stage on CuTe; a stage whose CuTe kernel cannot run a call (combine_fits,
    # proxy_fits, kl_fits false) is borrowed from Triton, and flash_msa.sparse_forward.
    # borrowed_reason adds that stage's limits
    "fwd": Limits(
        **_SM90,
        head_dims=(64, 128),
        deterministic=True,
        q_map=FWD_Q_MAP_DECLARED,  # the partials' map mode: see FWD_Q_MAP_DECLARED
        note="every stage on CuTe: the work list (with torch's sort; chunked and q_map "
        "lists by torch ops), per-block attention, the proxy LSE, the combine and the KL "
        "value; where a CuTe stage cannot run the call (its *_fits), the Triton stage "
        "runs it, with its limits",
    ),
    "bwd": BWD_LIMITS,
    # the dense warmup: the sparse forward and the fused backward over every causal block
    # (flash_msa.cute.warmup: lists built on the device, top_k = their width); beyond these,
    # warmup.reason: the lists' memory budget, the sparse ops' reasons at that top_k, and no
    # Triton stage (Triton's stop at top_k 64)
    "warmup": Limits(
        **_SM90,
        head_dims=(64, 128),
        proxy_head_dims=(64, 128),
        deterministic=True,  # the sparse forward's and BwdSm90(deterministic=True)'s
        note="the sparse op over every causal block (top_k = the block count, rounded up to a "
        "multiple of 64 above 64), within a memory budget for its lists "
        "(flash_msa.cute.warmup.LIST_BYTES, else the Triton warmup)",
    ),
}


def unavailable_reason() -> str | None:
    """Why this backend cannot run at all on this machine; ``None`` if it can."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except ImportError as e:
        return f"nvidia-cutlass-dsl is not importable: {e}"
    return None


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can."""
    why = limits.reason(LIMITS, op, problem)
    if why is not None:
        return why
    if problem.cfg.warmup and op in ("fwd", "bwd"):
        from . import warmup

        return warmup.reason(op, problem)
    if op == "fwd":
        return fwd_reason(problem)
    if op == "bwd":
        return bwd_kernel_reason(problem)
    return memo((_select_reason, problem), _select_reason, problem)


# Host time: what ``auto``'s resolves and the forward's stage pick compute per call are pure
# functions of the call's shapes, dtypes and configuration (kernels' ``can_implement``, the
# stages' ``*_fits``, meta tensors) and of this module's switches: 49 us per training step on
# this CPU for the three resolves (``resolve("fwd")`` 30 us, 20 of them ``call_stages``) and 12
# us for the forward's ``stages_for``, ~2-3 us each remembered (tests/test_glue_host.py).
# Each is kept per what it reads (switches included: :func:`switches`; the forward's and
# backward's keys leave out what varlen steps vary and no limit reads: :func:`run_free`,
# :func:`shape_key`), so a remembered value is the one a fresh call returns; the dict is
# bounded by clearing it when full (the selection's key keeps ``max_seqlen``: its grid limit).
MEMO_ENTRIES = 4096
_MEMO: dict = {}


def memo(key: tuple, fn, *args):
    """``fn(*args)``, computed once per ``key`` (hashable: ``fn`` and whatever ``fn`` reads of
    ``args`` and of module state; :data:`MEMO_ENTRIES` keys at most)."""
    value = _MEMO.get(key, _MEMO)
    if value is _MEMO:
        if len(_MEMO) >= MEMO_ENTRIES:
            _MEMO.clear()
        value = _MEMO[key] = fn(*args)
    return value


def clear_memo() -> None:
    """Forget what :func:`memo` kept (for a caller that changes what a remembered function
    reads beyond its key, e.g. a test that patches a kernel's ``can_implement``)."""
    _MEMO.clear()


def run_free(cfg):
    """``cfg`` without what changes from call to call in training but no kernel's limits read
    (``max_seqlen``: every varlen step's longest sequence; the scales): a :func:`memo` key of
    the limits and stage picks, which would otherwise miss on nearly every varlen call. Their
    readers (``limits.reason``, the kernels' ``can_implement``, the stages' ``*_fits``) read
    ``block_size``, ``top_k``, ``compute_kl``, ``deterministic``, ``selection_precision`` and
    ``warmup`` of a config, all kept."""
    return dataclasses.replace(cfg, max_seqlen=0, softmax_scale=0.0, proxy_scale=None)


def shape_key(problem: Problem) -> Problem:
    """``problem`` with :func:`run_free`'s config and one sequence: the :func:`memo` key of the
    forward's and backward's kernel reasons (``limits.reason`` and ``can_implement`` read
    neither the sequence count nor the lengths; the selection's reason does, and keeps the
    whole problem as its key)."""
    return dataclasses.replace(problem, num_seqs=1, cfg=run_free(problem.cfg))


def switches() -> tuple:
    """What :func:`forward_stages` reads at call time besides its arguments: the stage switches
    and the stage functions it hands out (tests patch both), for the keys of :func:`memo`."""
    from . import bwd_sm90, combine_sm90, fwd_partials_sm90

    fp = fwd_partials_sm90
    return (
        PROXY_LSE_ON_CUTE, KL_ON_CUTE, COMBINE_ON_CUTE, FWD_Q_MAP_DECLARED,
        fp.partials, fp.kl, bwd_sm90.kl, combine_sm90.combine,
        fp.FwdPartialsSm90.warpgroups,  # (proxy_fits reads the class default at call time)
    )  # fmt: skip


# The forward's KL value on CuTe (``bwd_sm90.kl``: the fused backward's kernel in its KL mode,
# one S product for the teacher and one proxy product per kept block, no gradient). On: H200,
# benchmarks/kl_ab.py (benchmarks/results/cute-stage3/kl_ab.json), the stage 2.32 / 3.64 /
# 11.64 / 43.57 ms against Triton's 3.62 / 7.23 / 18.12 / 73.5 at anchor 16K / 32K, paper 32K /
# 128K, sums equal to 6e-7 relative; tests/test_gpu_cute_kl.py 13 passed. Where ``kl_fits``
# is false the driver borrows Triton's stage.
KL_ON_CUTE = True


# The combine on CuTe (``combine_sm90.py``). Its first version (one warp per row, 16-byte loads
# of the used slots' partial rows) was exact but slower than Triton's (benchmarks/results/
# cute-stage3/combine_ab.log: 0.44 / 0.72 / 0.73 ms against 0.28 / 0.55 / 0.56). Rewritten in
# the eighth session (raw-pointer launch, cp.async staging, the main and proxy merges in one
# launch: ``combine_makes_proxy``). On (ninth session, H200, benchmarks/results/stage9/):
# tests/test_gpu_cute_combine.py passed; benchmarks/combine_ab.py, device time of the main and
# proxy merges, same run: 0.257 / 0.518 / 0.523 ms against Triton's 0.270 / 0.542 / 0.535 at
# anchor 16K / 32K, paper 128K.
COMBINE_ON_CUTE = True


# The proxy LSE partials in the CuTe partials' own launch (``FwdPartialsSm90(proxy=True)``:
# the k_proxy tile by TMA, q_proxy rows gathered, one wgmma chain per 64 tokens, after the
# main part of each work item) instead of Triton's separate ``proxy_partials`` stage. On:
# H200, eighth session (benchmarks/results/stage3-s8/): tests/test_gpu_cute.py -k
# "proxy_partials or proxy_lse" 25 passed; benchmarks/cute_fwd_ab.py --quick, partials with
# the proxy against partials plus Triton's proxy stage, same run: anchor 32K 2.76 / 2.73 ms
# against 3.28 / 2.98 (random / local inputs), paper 32K 9.03 / 9.67 against 8.95 / 8.56. A
# win of 0.25-0.5 ms at the anchor layout; at the paper layout +1% / +13% of the partials
# (< 1% of a paper step), taken so that the CuTe op runs no Triton proxy stage.
PROXY_LSE_ON_CUTE = True


def forward_stages(kl_fits: bool = True, combine_fits: bool = True, proxy_fits: bool = True):
    """This backend's stages of the sparse-forward driver (:mod:`flash_msa.sparse_forward`):
    the per-block attention partials, which also make the proxy LSE partials when
    :data:`PROXY_LSE_ON_CUTE` and their kernel can run the call (``proxy_fits``:
    :func:`~flash_msa.cute.fwd_partials_sm90.proxy_fits`); the KL value when
    :data:`KL_ON_CUTE` and its kernel can run the call (``kl_fits``:
    :func:`~flash_msa.cute.bwd_sm90.kl_fits`); the combine when :data:`COMBINE_ON_CUTE` and
    ``combine_fits`` (:func:`~flash_msa.cute.combine_sm90.combine_fits`). The driver borrows
    the Triton backend's stage for each one left out (``proxy_partials`` where the partials
    do not make the proxy LSE)."""
    from ..sparse_forward import Stages
    from . import fwd_partials_sm90  # (imported here: the tests patch its switches)

    from . import worklist_sm90

    # the work list built by CuTe kernels (bit for bit worklist's; worklist_ab.py on the H200,
    # anchor 16K: the forward's blocks + lists + items 897 -> 222 us of host time)
    stages = dict(
        partials=fwd_partials_sm90.partials, q_map=FWD_Q_MAP_DECLARED, work=worklist_sm90
    )
    if PROXY_LSE_ON_CUTE and proxy_fits:
        stages["partials_make_proxy"] = True
    if KL_ON_CUTE and kl_fits:
        # the partials kernel's KL mode (FwdKlSm90, fwd_partials_sm90.kl: won its ninth-session
        # A/B against bwd_sm90.kl, 17.5 against 43.75 ms at paper 128K); it hands the calls it
        # cannot run (a query map, D != Dp) to bwd_sm90.kl
        stages["kl"] = fwd_partials_sm90.kl
    if COMBINE_ON_CUTE and combine_fits:
        from .combine_sm90 import combine

        stages["combine"] = combine
        stages["combine_makes_proxy"] = True  # main and proxy merges in one launch
    return Stages(**stages)


def _select_reason(problem: Problem) -> str | None:
    """The selection's limits beyond ``LIMITS``: its kernel's (``SelectSm90.can_implement``:
    the same table plus head ratio and shared memory) and the grid's (run-time sizes)."""
    import cutlass

    from .. import quant
    from .common import cutlass_dtype
    from .select_sm90 import FP8_STAGES, TILE_M, SelectSm90

    cfg = problem.cfg
    if problem.selection_precision == "fp8":  # the e4m3 kernel, with the shipped key scale
        if problem.q_map:
            return "the CuTe fp8 selection has no query map (q_map)"
        dtype, stages, key_scale = cutlass.Float8E4M3FN, FP8_STAGES, quant.KEY_SCALE
    else:
        dtype, stages, key_scale = cutlass_dtype(problem.dtype), 4, None
    why = SelectSm90.can_implement(
        dtype, problem.proxy_head_dim, problem.num_sel_heads, problem.num_proxy_k_heads,
        cfg.top_k, cfg.block_size, stages, key_scale,
    )  # fmt: skip
    if why is not None:
        return why
    if -(-cfg.max_seqlen // TILE_M) > 65535:
        return f"max_seqlen {cfg.max_seqlen} needs more than 65535 query tiles (grid y)"
    if problem.num_seqs * problem.num_sel_heads >= 2**31:
        return "too many (sequence, proxy head) pairs for the grid"
    return None


def fwd_reason(problem: Problem, stages=None) -> str | None:
    """The forward's limits beyond ``LIMITS``: its own kernel's
    (``FwdPartialsSm90.can_implement``: the same table plus the head-group arithmetic and
    shared memory), and those of the stages it borrows: those of ``stages``, by default the
    ones ``fwd_partials_sm90.fwd`` will pick for the call (:func:`call_stages`; e.g. Triton's
    combine above the CuTe combine's 64 slots, with Triton's ``max_top_k``)."""
    from ..sparse_forward import borrowed_reason

    why = memo((_fwd_kernel_reason, shape_key(problem)), _fwd_kernel_reason, problem)
    if why is not None:
        return why
    # (the borrowed stages' limits are another backend's: asked per call, not remembered)
    return borrowed_reason(call_stages(problem) if stages is None else stages, problem)


def _fwd_kernel_reason(problem: Problem) -> str | None:
    """``FwdPartialsSm90.can_implement`` of ``problem``'s configuration."""
    from .common import cutlass_dtype
    from .fwd_partials_sm90 import FwdPartialsSm90

    return FwdPartialsSm90.can_implement(
        cutlass_dtype(problem.dtype), problem.num_heads, problem.num_kv_heads,
        problem.num_sel_heads, problem.head_dim, problem.cfg.top_k, problem.cfg.block_size,
    )  # fmt: skip


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
    import torch

    m = dict(dtype=dtype, device="meta")
    q, k = torch.empty(1, H, D, **m), torch.empty(1, Hkv, D, **m)
    qp = torch.empty(1, Hs, Dp, **m) if Dp else None
    kp = torch.empty(1, Hpk, Dp, **m) if Dp else None
    return q, k, qp, kp, torch.empty(1, Hs, K, dtype=torch.int32, device="meta")


def stages_for(q, k, q_proxy, k_proxy, indices, cfg, combine_ok: bool | None = None):
    """:func:`forward_stages` for one call's tensors (shapes and dtypes only: the meta device
    will do): each CuTe stage where its ``*_fits`` takes the call. ``combine_ok`` replaces
    ``combine_fits`` (the warmup's two-level combine, ``warmup.stages``). Remembered per what
    the ``*_fits`` read (dtypes, every size but the token count, ``cfg``) and the
    :func:`switches` (:func:`memo`)."""
    shapes = (_rows(q), _rows(k), _rows(q_proxy), _rows(k_proxy), _rows(indices))
    key = (_pick_stages, shapes, run_free(cfg), combine_ok, switches())
    return memo(key, _pick_stages, q, k, q_proxy, k_proxy, indices, cfg, combine_ok)


def _rows(x) -> tuple | None:
    """What the stages' ``*_fits`` may read of a call's tensor: dtype and row shape."""
    return None if x is None else (x.dtype, x.shape[1:])


def _pick_stages(q, k, q_proxy, k_proxy, indices, cfg, combine_ok):
    """:func:`stages_for`, computed."""
    from .bwd_sm90 import kl_fits
    from .combine_sm90 import combine_fits
    from .fwd_partials_sm90 import proxy_fits

    if combine_ok is None:
        H, D = q.shape[1:]
        Hs, K = indices.shape[1:]
        combine_ok = combine_fits(q.dtype, H, Hs, K, D)
    return forward_stages(
        kl_fits(q, k, q_proxy, k_proxy, indices, cfg),
        combine_ok,
        proxy_fits(q, k, q_proxy, k_proxy, indices, cfg),
    )


def call_stages(problem: Problem):
    """The stages ``fwd_partials_sm90.fwd`` picks for ``problem`` (:func:`stages_for` on
    :func:`meta_inputs`)."""
    return stages_for(*meta_inputs(problem), problem.cfg)


def bwd_kernel_reason(problem: Problem) -> str | None:
    """Why the fused backward kernel cannot run ``problem`` (``None``: it can): ``BWD_LIMITS``
    and ``BwdSm90.can_implement`` (the head-group arithmetic and shared memory); remembered
    per ``problem`` (:func:`memo`)."""
    return memo((_bwd_kernel_reason, shape_key(problem)), _bwd_kernel_reason, problem)


def _bwd_kernel_reason(problem: Problem) -> str | None:
    """:func:`bwd_kernel_reason`, computed."""
    from .bwd_sm90 import BwdSm90
    from .common import cutlass_dtype

    why = limits.reason(LIMITS, "bwd", problem)  # (LIMITS["bwd"] is BWD_LIMITS)
    if why is not None:
        return why
    Hs = problem.num_sel_heads
    return BwdSm90.can_implement(
        cutlass_dtype(problem.dtype), problem.num_heads, problem.num_kv_heads, Hs,
        problem.num_proxy_k_heads or Hs, problem.head_dim, problem.proxy_head_dim or
        problem.head_dim, problem.cfg.top_k, problem.cfg.block_size,
    )  # fmt: skip


def select(q_proxy, k_proxy, cu_seqlens, cfg, *, q_map=None):
    """Backend op ``select``: see :func:`flash_msa.cute.select_sm90.select` (``q_map``: the
    contract's query map). ``cfg.selection_precision == "fp8"`` raises
    :class:`~flash_msa.BackendError` while :data:`FP8_SELECTION_ON_CUTE` is off."""
    from .select_sm90 import select as _select

    if cfg.selection_precision == "fp8" and not FP8_SELECTION_ON_CUTE:
        from ..backends import BackendError

        raise BackendError(
            'selection_precision="fp8" on the CuTe backend is off until its H200 run '
            "(flash_msa.cute.FP8_SELECTION_ON_CUTE)"
        )
    return _select(q_proxy, k_proxy, cu_seqlens, cfg, q_map=q_map)


def fwd(
    q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False, *, q_map=None
):
    """Backend op ``fwd``: see :func:`flash_msa.cute.fwd_partials_sm90.fwd` (``q_map``: the
    contract's query map)."""
    if indices is None:  # warmup: the sparse forward over every causal block
        from .warmup import fwd as _warmup

        return _warmup(q, k, v, cu_seqlens, cfg, q_proxy, k_proxy, q_map)
    from .fwd_partials_sm90 import fwd as _fwd

    return _fwd(q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad, q_map=q_map)


def bwd(dout, dkl, saved, cu_seqlens, cfg, *, q_map=None):
    """Backend op ``bwd``: see :func:`flash_msa.cute.bwd_sm90.bwd` (``q_map``: the contract's
    query map)."""
    from .bwd_sm90 import bwd as _bwd

    if saved.indices is None:  # warmup: the fused backward over every causal block
        from .warmup import bwd as _warmup

        return _warmup(dout, dkl, saved, cu_seqlens, cfg, _bwd, q_map)
    return _bwd(dout, dkl, saved, cu_seqlens, cfg, q_map=q_map)


# this backend's backward makes the proxy gradient itself: the forward need not
# (Forward.proxy_grad); read by api.py when the backward runs here
FUSED_PROXY_GRAD = True
