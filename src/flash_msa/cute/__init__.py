"""CuTe DSL backend (nvidia-cutlass-dsl) for Hopper SM90: the dispatch (limits, reasons, ops).

What runs, for sm_90, checked on an H200 (the GPU cases of tests/ops/):

* ``select``: proxy block selection (:mod:`.selection`: :class:`~.select_sm90.SelectSm90`, bf16 /
  fp16, or e4m3 after the quantize pass :class:`~.quantize_sm90.QuantizeSm90` for
  ``selection_precision="fp8"``);
* ``fwd`` (sparse): the backend-neutral driver :mod:`flash_msa.sparse_forward` with every stage
  on CuTe where its fit check takes the call (:mod:`.forward`: work list, per-block partials with
  the proxy LSE, combine, KL value); a stage it refuses is borrowed from Triton;
* ``bwd`` (sparse): one fused key-outer kernel for the main and the proxy gradients
  (:mod:`.backward`: :class:`~.bwd_ws_sm90.BwdWsSm90` where it can run, else
  :class:`~.bwd_sm90.BwdSm90`); the forward then need not make the proxy gradient
  (``LIMITS["bwd"].fused_proxy_grad``);
* the dense warmup (``fwd`` / ``bwd`` with ``indices`` None): the sparse op over every causal
  block (:mod:`.warmup`), within ``LIMITS["warmup"]`` and ``warmup.reason``.

A call outside the limits: ``auto`` runs it on the Triton backend (the ops share one tensor
contract, docs/design.md), and ``FLASH_MSA_BACKEND=cute`` raises
:class:`~flash_msa.BackendError`; so does a backward outside its limits (``auto`` runs it on
Triton within the same autograd step). Blackwell (sm_100) kernels are not written.

Modules, imports pointing one way (tests/integration/test_import_graph.py): kernel modules
(``*_sm90.py``: device code only, one kernel class per file, the work list's five passes
excepted; a frozen dataclass per kernel, its static configuration as fields, ``can_implement``
saying why a configuration cannot run) import only :mod:`.common` (shared device helpers), a
base class's kernel module and the package's leaf modules (``problem``, ``worklist``,
``quant``, ``cubin``); the host modules per op (:mod:`.selection`, :mod:`.forward`,
:mod:`.backward`, :mod:`.worklist_host`, :mod:`.warmup`; :mod:`.memo` their remembered reasons)
import kernels and :mod:`.launch` (views, pointers, the stream, the compile cache), check
tensors, build launch arguments and pick between kernels; this dispatch imports the host
modules; :mod:`.compile_check` imports kernels and host code, and nothing imports it.

Kernels are compiled on first use and cached in-process (``launch.run_typed``) and on disk
(:mod:`.disk_cache`: a second process loads instead of compiling; ``FLASH_MSA_CACHE=0`` off)
per kernel object (every field of its configuration), static layout of its arguments and
device; sequence lengths, token counts and the number of sequences are run-time values.
"""

from __future__ import annotations

from .. import limits
from ..limits import Limits
from ..problem import Problem
from . import memo, warmup
from .backward import bwd as _sparse_bwd
from .backward import bwd_kernel_reason
from .forward import call_stages, forward_stages, fwd_reason, meta_inputs, stages_for
from .forward import fwd as _sparse_fwd
from .memo import clear_memo, run_free, shape_key
from .selection import select, select_reason

__all__ = [
    "LIMITS", "bwd", "bwd_kernel_reason", "call_stages", "clear_memo", "forward_stages", "fwd",
    "fwd_reason", "meta_inputs", "run_free", "select", "shape_key", "stages_for",
    "unavailable_reason", "unsupported_reason",
]  # fmt: skip

_SM90 = dict(capabilities=((9, 0),), capability_note="CuTe kernels exist for Hopper only so far")
# the fused backward (backward.py)
BWD_LIMITS = Limits(
    **_SM90,
    head_dims=(64, 128),
    proxy_head_dims=(64, 128),
    # ordered sums of per-slot / per-item partials (BwdSm90(deterministic=True)); bitwise equal
    # across runs and by the rule on the H200 (tests/ops/test_bwd.py)
    deterministic=True,
    # BwdSm90 / BwdWsSm90(qmap=True); on the H200 tests/ops/test_fwd.py and
    # tests/ops/test_bwd.py -k q_map check the mapped selection and backward against the
    # reference and the Triton backend
    q_map=True,
    # this backend's backward makes the proxy gradient itself: the forward need not
    # (Forward.proxy_grad)
    fused_proxy_grad=True,
    note="one fused kernel for the main and proxy gradients; each selection head's main heads "
    "must share one KV head",
)
# Deterministic mode (Problem.deterministic): the selection and the forward's partials have no
# atomics (every output element has one writer; the borrowed Triton stages order their sums
# when cfg.deterministic); the fused backward stores partials instead of fp32 atomics and
# flash_msa.ordered adds them in a fixed order.
LIMITS = {
    "select": Limits(
        **_SM90,
        proxy_head_dims=(64, 128),
        max_top_k=64,
        deterministic=True,
        q_map=True,  # SelectSm90(qmap=True), bf16 / fp16
        fp8_selection=True,  # SelectSm90 on e4m3 operands (selection.py)
    ),
    # every stage on CuTe; a stage whose CuTe kernel cannot run a call (combine_fits,
    # proxy_fits, kl_fits false) is borrowed from Triton, and flash_msa.sparse_forward.
    # borrowed_reason adds that stage's limits
    "fwd": Limits(
        **_SM90,
        head_dims=(64, 128),
        deterministic=True,
        # FwdPartialsSm90(qmap=True), main and proxy parts (tests/ops/test_fwd.py -k q_map on
        # the H200); the KL of a mapped call is Triton's stage
        q_map=True,
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
    """Why this backend cannot run at all on this machine; ``None`` if it can (importing this
    package needs nvidia-cutlass-dsl: ``flash_msa.backends.load`` reports a failed import)."""
    return None


def unsupported_reason(op: str, problem: Problem) -> str | None:
    """Why this backend cannot run ``op`` for ``problem``; ``None`` if it can."""
    why = limits.reason(LIMITS, op, problem)
    if why is not None:
        return why
    if problem.cfg.warmup and op in ("fwd", "bwd"):
        return warmup.reason(op, problem)
    if op == "fwd":
        return fwd_reason(problem)
    if op == "bwd":
        return bwd_kernel_reason(problem)
    return memo.memo((select_reason, problem), select_reason, problem)


def fwd(
    q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False, *, q_map=None
):
    """Backend op ``fwd``: :func:`flash_msa.cute.forward.fwd`, or the warmup's
    (:func:`flash_msa.cute.warmup.fwd`) for ``indices`` None."""
    if indices is None:  # warmup: the sparse forward over every causal block
        return warmup.fwd(q, k, v, cu_seqlens, cfg, q_proxy, k_proxy, q_map)
    return _sparse_fwd(
        q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad, q_map=q_map
    )


def bwd(dout, dkl, saved, cu_seqlens, cfg, *, q_map=None):
    """Backend op ``bwd``: :func:`flash_msa.cute.backward.bwd`, or the warmup's
    (:func:`flash_msa.cute.warmup.bwd`) for ``saved.indices`` None."""
    if saved.indices is None:  # warmup: the fused backward over every causal block
        return warmup.bwd(dout, dkl, saved, cu_seqlens, cfg, _sparse_bwd, q_map)
    return _sparse_bwd(dout, dkl, saved, cu_seqlens, cfg, q_map=q_map)
