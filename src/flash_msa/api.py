"""Public entry points: validation, layout normalization and the autograd Functions.

Every public call (1) validates its arguments and raises ``TypeError``/``ValueError`` naming the
argument before anything runs, (2) brings batch-form tensors to the packed varlen layout
``(T, heads, dim)`` with ``cu_seqlens`` (a view, no copy for contiguous inputs), (3) checks that
a backend can run each op (``backends.resolve``; each op resolves again when it runs) and (4)
runs the ``flash_msa::`` custom ops (ops.py) through one autograd Function per public op, in
eager and under ``torch.compile`` alike. The op contract shared by all backends is in
docs/design.md.
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import os
from typing import Protocol

import torch

from . import backends, guard, quant, worklist

from . import ops as custom_ops
from .problem import Config, Problem, problem_of

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BLOCK_SIZES = (64, 128)
# top_k counts key *blocks*: 2**14 is every block of a 1M-token sequence at block 64 (the longest
# lengths of docs/performance.md), far above any sparse use (the paper keeps 16, the GPU kernels
# at most 64). A larger value is a mistake (keys for blocks, a typo), refused before it can size
# select_blocks' (tokens, Hp, top_k) output.
MAX_TOP_K = 1 << 14


def _debug() -> bool:
    return os.environ.get("FLASH_MSA_DEBUG", "0") not in ("", "0")


def _value_checks(device: torch.device) -> bool:
    """Whether checks that read tensor values (a device-to-host copy) run for ``device``.

    Always on CPU, on GPU only with ``FLASH_MSA_DEBUG=1``, and never while ``torch.compile``
    traces the call: a value read is data-dependent control flow, a graph break that
    ``fullgraph=True`` refuses (the eager call of the same function still checks).
    """
    return (device.type == "cpu" or _debug()) and not torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def _check_tensors(tensors: dict, varlen: bool):
    """Type, rank, dtype, device and leading (batch/token) dims of the named tensors."""
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    rank = 3 if varlen else 4
    form = (
        "(total_tokens, heads, head_dim) because cu_seqlens is given"
        if varlen
        else "(batch, seqlen, heads, head_dim) (pass cu_seqlens for the varlen form)"
    )
    first, ref = next(iter(tensors.items()))
    for name, x in tensors.items():
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {form}; got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has unsupported dtype {x.dtype}; use bfloat16 or float16 "
                "(float32/float64 for debugging and the reference)"
            )
        if x.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {first} has {ref.dtype}; "
                "all inputs must share one dtype"
            )
        if x.device != ref.device:
            raise ValueError(f"{name} is on {x.device} but {first} is on {ref.device}")
        if x.shape[: rank - 2] != ref.shape[: rank - 2]:
            if not varlen and _heads_first(tensors.values()):
                raise ValueError(
                    f"{name} {tuple(x.shape)} and {first} {tuple(ref.shape)} agree in dims 0 and "
                    "2 but not in dim 1: this looks like the (batch, heads, seqlen, head_dim) "
                    "layout of torch's scaled_dot_product_attention. flash_msa takes "
                    "(batch, seqlen, heads, head_dim): pass x.transpose(1, 2)"
                )
            what = "total_tokens" if varlen else "(batch, seqlen)"
            raise ValueError(
                f"{name} has {what} = {tuple(x.shape[: rank - 2])} but {first} has "
                f"{tuple(ref.shape[: rank - 2])}"
            )
        if x.shape[-1] < 1 or x.shape[-2] < 1:
            raise ValueError(
                f"{name} must have at least one head and head_dim >= 1; got shape {tuple(x.shape)}"
            )
    if ref.shape[: rank - 2].numel() == 0:
        raise ValueError(f"{first} has no tokens (shape {tuple(ref.shape)})")


def _heads_first(tensors) -> bool:
    """Whether 4-D tensors whose ``(batch, seqlen)`` disagree look like the ``(batch, heads,
    seqlen, head_dim)`` layout: one batch, one dim 2 (the sequence there) longer than every
    dim 1 (the heads there). A call whose head counts all agree cannot be told apart by shape."""
    shapes = [x.shape for x in tensors if isinstance(x, torch.Tensor) and x.dim() == 4]
    batch, dim2 = {s[0] for s in shapes}, {s[2] for s in shapes}
    return len(batch) == len(dim2) == 1 and all(s[1] < s[2] for s in shapes)


def _check_heads(H, Hkv, Hsel, sel_name):
    if H % Hkv:
        raise ValueError(f"heads of q ({H}) must be a multiple of heads of k/v ({Hkv})")
    if H % Hsel:
        raise ValueError(f"heads of q ({H}) must be a multiple of heads of {sel_name} ({Hsel})")
    if Hsel % Hkv and Hkv % Hsel:
        raise ValueError(
            f"heads of {sel_name} ({Hsel}) and of k/v ({Hkv}) must divide one another (a "
            "selection group lies inside one KV group or is a union of whole KV groups)"
        )


def _check_main(q, k, v):
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"head_dim of k/v ({k.shape[-1]}) must equal head_dim of q ({q.shape[-1]})"
        )


def _check_proxy(q_proxy, k_proxy):
    Hp, Hpk = q_proxy.shape[-2], k_proxy.shape[-2]
    if k_proxy.shape[-1] != q_proxy.shape[-1]:
        raise ValueError(
            f"head_dim of k_proxy ({k_proxy.shape[-1]}) must equal head_dim of "
            f"q_proxy ({q_proxy.shape[-1]})"
        )
    if Hp % Hpk:
        raise ValueError(f"heads of q_proxy ({Hp}) must be a multiple of heads of k_proxy ({Hpk})")


def _int_arg(name, value, low):
    if isinstance(value, (bool, torch.Tensor)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    # an int needs no conversion, and under torch.compile with dynamic shapes it is symbolic
    # (max_seqlen): operator.index would specialize it, i.e. recompile per value
    if not isinstance(value, int):
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{name} must be an int, got {type(value).__name__} {value!r}"
            ) from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


# the scales' fp32 range: the kernels multiply by log2(e) (for exp2), and the product must be a
# finite, nonzero float32
_FP32_MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)
_FP32_TINY = torch.finfo(torch.float32).tiny


def _scale_arg(name, value, default):
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    # the kernels hold the scale (times log2(e), for exp2) in fp32: beyond this it is inf or 0
    if not (_FP32_TINY <= value <= _FP32_MAX_SCALE):
        raise ValueError(
            f"{name} must be in [{_FP32_TINY:.3g}, {_FP32_MAX_SCALE:.3g}] (finite and nonzero "
            f"in float32 after the kernels' factor log2(e)), got {value!r}"
        )
    return value


def _bool_arg(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _causal_arg(causal) -> None:
    """``causal`` as FlashAttention callers pass it: ``True`` is what MSA is, ``False`` refused."""
    _bool_arg("causal", causal)
    if not causal:
        raise ValueError(
            "causal=False is not supported: MSA is causal by definition (each query attends to "
            "key blocks at or before its own, its own block causally masked); pass causal=True "
            "or leave it out"
        )


def _top_k_arg(top_k):
    top_k = _int_arg("top_k", top_k, 1)
    if top_k > MAX_TOP_K:
        raise ValueError(
            f"top_k must be <= {MAX_TOP_K} (it counts key blocks of block_size tokens, not "
            f"keys), got {top_k}"
        )
    return top_k


# K below which top_k is never clamped: the GPU kernels' own top_k limit. K is a compile-time
# constant of every kernel, so clamping a top_k <= 64 to a varlen batch's block count would
# compile a new set of kernels per distinct max_seqlen (CuTe: tens of seconds each).
UNCLAMPED_TOP_K = 64


def _kernel_top_k(top_k, max_seqlen, block_size):
    """The K the backends run with: ``top_k`` clamped to ``max(ceil(max_seqlen / block_size),
    UNCLAMPED_TOP_K)``.

    No row has more than ``ceil(max_seqlen / block_size)`` visible blocks, so a larger ``top_k``
    selects exactly the same blocks and would only add ``-1`` slots (for ``top_k=10**4``, a
    ``(tokens, Hp, 10**4)`` index tensor). Values up to ``UNCLAMPED_TOP_K`` are kept as given, so
    the compiled kernels do not depend on the batch's lengths; the clamp also lets a backend
    whose kernels keep at most 64 blocks run a short sequence asked for more.
    """
    return min(top_k, max(-(-max_seqlen // block_size), UNCLAMPED_TOP_K))


def _block_size_arg(block_size):
    block_size = _int_arg("block_size", block_size, 1)
    if block_size not in _BLOCK_SIZES:
        raise ValueError(f"block_size must be 64 or 128, got {block_size}")
    return block_size


def _sequences(ref, cu_seqlens, max_seqlen, total=None):
    """``(cu_seqlens, max_seqlen)`` for the packed layout; validates the varlen arguments.

    Batch form builds ``cu_seqlens = [0, S, 2S, ...]`` on the device (no host sync).
    ``total``: the tokens ``cu_seqlens`` must end at (default ``ref``'s rows; a key gather's
    ``total_tokens`` when ``ref`` is a shard).
    """
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(
                "max_seqlen is only used with cu_seqlens (varlen form); got "
                f"max_seqlen={max_seqlen!r} without cu_seqlens"
            )
        B, S = ref.shape[:2]
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=ref.device)
        return cu, S
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be 1-D with at least 2 entries [0, ..., total_tokens]; "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != ref.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {ref.device}")
    total = ref.shape[0] if total is None else total
    cu_seqlens = _int32_offsets(cu_seqlens, total).contiguous()  # kernels read it with stride 1
    if max_seqlen is not None:
        max_seqlen = _int_arg("max_seqlen", max_seqlen, 1)
        if max_seqlen > max(total, 1):  # it sizes the kernels' grids: bound it by the tokens
            raise ValueError(
                f"max_seqlen ({max_seqlen}) is larger than the total tokens ({total}) that "
                "cu_seqlens describes"
            )
    if max_seqlen is None and torch.compiler.is_compiling():
        raise ValueError(
            "max_seqlen is required under torch.compile (computing it would read cu_seqlens: "
            "a graph break)"
        )
    if max_seqlen is None and cu_seqlens.device.type != "cpu":
        raise ValueError(
            "max_seqlen is required when cu_seqlens is on a GPU (computing it would "
            "need a host sync)"
        )
    if _value_checks(cu_seqlens.device):
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        if any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
        if cu[-1] != total:
            raise ValueError(f"cu_seqlens[-1] ({cu[-1]}) must equal total_tokens ({total})")
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        if max_seqlen is None:
            max_seqlen = max(1, longest)
        elif max_seqlen < longest:
            raise ValueError(
                f"max_seqlen ({max_seqlen}) is smaller than the longest sequence "
                f"in cu_seqlens ({longest})"
            )
    return cu_seqlens, max_seqlen


_INT32_MAX = torch.iinfo(torch.int32).max


def _int32_offsets(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``cu_seqlens`` as the int32 the kernels read: an int64 one cast once (one small copy).

    Its values are checked where they are read anyway (:func:`_value_checks`): beyond int32
    they raise. Elsewhere (GPU, ``torch.compile``) they are first clamped to ``[-1, total + 1]``:
    the cast cannot wrap an offset into a well-formed one, and an offset out of ``[0, total]``
    stays out, for the guard (:mod:`flash_msa.guard`) to drop its rows."""
    if cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    if total > _INT32_MAX:
        raise ValueError(f"total_tokens ({total}) does not fit the kernels' int32 offsets")
    if _value_checks(cu_seqlens.device):
        low, high = int(cu_seqlens.min()), int(cu_seqlens.max())
        if low < -_INT32_MAX - 1 or high > _INT32_MAX:
            raise ValueError(
                f"cu_seqlens (int64) holds values in [{low}, {high}], outside int32: the "
                "kernels read int32 offsets"
            )
        return cu_seqlens.to(torch.int32)
    return cu_seqlens.clamp(-1, total + 1).to(torch.int32)


def _check_finite(tensors: dict):
    """Inputs are assumed finite; checked on CPU tensors or with FLASH_MSA_DEBUG=1."""
    for name, x in tensors.items():
        if _value_checks(x.device) and not torch.isfinite(x).all():
            raise ValueError(f"{name} contains non-finite values (NaN or inf)")


def _guarded(cu, max_seqlen, total, trusted: bool) -> guard.Sequences | None:
    """The device-side guard of ``cu`` (:mod:`flash_msa.guard`), or ``None`` when its values
    are known good: built by the API (batch form) or read by the host checks
    (:func:`_value_checks`). With ``FLASH_MSA_DEBUG=1`` (under ``torch.compile``, where the
    host checks cannot run) bad offsets fail a device-side assertion instead. Computed per call,
    not cached per tensor: a buffer rewritten without a version bump (``.data``, a kernel of
    another library) would make a cached result silently stale."""
    if trusted or _value_checks(cu.device):
        return None
    seqs = guard.sequences(cu, max_seqlen, total)
    if _debug():
        guard.assert_ok(seqs.ok, "cu_seqlens/max_seqlen are not well formed")
    return seqs


def _check_indices(indices, ref, cu, max_seqlen, block_size, varlen):
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    lead = ref.shape[:1] if varlen else ref.shape[:2]
    if indices.dim() != len(lead) + 2 or indices.shape[: len(lead)] != lead:
        form = "(total_tokens, Hsel, top_k)" if varlen else "(batch, seqlen, Hsel, top_k)"
        raise ValueError(
            f"indices must be {form} matching q's leading dims {tuple(lead)}; got "
            f"shape {tuple(indices.shape)}"
        )
    if indices.shape[-1] < 1 or indices.shape[-2] < 1:
        raise ValueError(
            f"indices needs at least one head and one slot; got shape {tuple(indices.shape)}"
        )
    if indices.device != ref.device:
        raise ValueError(f"indices is on {indices.device} but q is on {ref.device}")
    if not _value_checks(indices.device):
        return
    idx = indices.reshape(-1, *indices.shape[-2:])
    lengths = (cu[1:] - cu[:-1]).long()
    nblocks = torch.repeat_interleave(-(-lengths // block_size), lengths)  # [T]

    def fail(bad, what):
        t, h = (int(x) for x in bad.nonzero()[0][:2])
        raise ValueError(
            f"indices {what}; first bad row: token {t}, head {h}: "
            f"{idx[t, h].tolist()} (the sequence has {int(nblocks[t])} blocks)"
        )

    bad = (idx < -1) | (idx >= nblocks[:, None, None])
    if bad.any():
        fail(bad, "must hold -1 or block numbers in [0, blocks of the sequence)")
    valid = idx >= 0
    bad = valid[..., 1:] & ~valid[..., :-1]
    if bad.any():
        fail(bad, "may use -1 only to pad the end of a row")
    bad = valid[..., 1:] & (idx[..., 1:] <= idx[..., :-1])
    if bad.any():
        fail(bad, "must list each row's blocks strictly ascending")


def _packed(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def _problem(ref, H, Hkv, D, Hsel, Hpk, Dp, cu, varlen, cfg, q_map=False) -> Problem:
    """The call as backends see it (0 for the heads/dims a call does not have)."""
    return problem_of(
        ref.device, ref.dtype, (H, Hkv, D, Hsel, Hpk, Dp), cu.numel() - 1, varlen, cfg, q_map=q_map
    )


def _check_q_map(q_map, q_proxy, k_proxy, q, k, v, varlen, keys=None):
    """A query map: queries (``q``, ``q_proxy``: ``Tq`` rows) that are not the keys' tokens
    (``k``, ``v``, ``k_proxy``: ``T`` rows, or this rank's shards of them with a key gather
    ``keys``, whose ``total_tokens`` is ``T``), as context parallelism passes them."""
    if not varlen:
        raise ValueError(
            "q_map needs the varlen form: cu_seqlens (of the keys' sequences) and packed "
            "(tokens, heads, head_dim) tensors"
        )
    _check_tensors({"q_proxy": q_proxy, "q": q}, varlen)
    _check_tensors({"k_proxy": k_proxy, "k": k, "v": v}, varlen)
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; all inputs must share one")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    if not isinstance(q_map, torch.Tensor):
        raise TypeError(f"q_map must be a torch.Tensor, got {type(q_map).__name__}")
    if q_map.dtype != torch.int32:
        raise TypeError(f"q_map must be int32, got {q_map.dtype}")
    if q_map.shape != q.shape[:1]:
        raise ValueError(
            f"q_map must be 1-D with one entry per query row ({q.shape[0]}); got shape "
            f"{tuple(q_map.shape)}"
        )
    if q_map.device != q.device:
        raise ValueError(f"q_map is on {q_map.device} but q is on {q.device}")
    T = k.shape[0] if keys is None else keys.total_tokens
    if _value_checks(q_map.device) and q_map.numel():
        low, high = int(q_map.min()), int(q_map.max())
        if low < -1 or high >= T:
            raise ValueError(
                f"q_map must hold -1 (a padding row) or key token indices in [0, {T}); "
                f"got values in [{low}, {high}]"
            )


def _resolvable(problem: Problem, ops) -> None:
    """Raises the :class:`~flash_msa.backends.BackendError` of the first of ``ops`` that no
    backend can run, before anything runs (a ``bwd`` too, when a backward can follow); each op
    resolves its backend again when it runs (ops.py), by the same rules."""
    for op in ops:
        backends.resolve(op, problem)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class KeyGather(Protocol):
    """Keys that live on other ranks: how the op gets them (``msa_attention(key_gather=...)``;
    :mod:`flash_msa.distributed` passes one).

    With a key gather, the op's ``k_proxy``, ``k``, ``v`` are this rank's shards (``Tl`` rows)
    and the op gathers them itself, so that it waits for each just before its first use: all
    three gathers are launched first, ``k_proxy`` is waited for before the selection, ``k`` and
    ``v`` after it (their transfer overlaps the selection). The op saves the gathered tensors for
    its backward, whose key gradients go back through :meth:`scatter`.

    The methods return what they make and change no state that the op reads, so that Dynamo can
    trace them inside the op's autograd Function (``torch.compile(fullgraph=True)``).
    """

    total_tokens: int  # T: rows of a gathered key tensor (= cu_seqlens[-1])
    overlap: bool  # False: k, v are waited for before the selection too (measurements)

    def launch(self, x: torch.Tensor, name: str):
        """Starts gathering the shard ``x (Tl, heads, dim)``; returns a pending handle."""

    def finish(self, pending, name: str) -> torch.Tensor:
        """Waits for ``pending``: the global ``(T, heads, dim)`` tensor in packed order."""

    def scatter(self, grads: tuple, names: tuple) -> tuple:
        """Global key gradients ``(T, heads, dim)`` (or ``None``: no collective) -> this rank's
        ``(Tl, heads, dim)`` gradients, summed over the ranks."""


_KEY_NAMES = ("k_proxy", "k", "v")
_KEY_GRAD_NAMES = ("dk_proxy", "dk", "dv")


def _launch_keys(keys, k_proxy, k, v):
    """Before the selection: launches the gathers of the shards ``k_proxy``, ``k``, ``v`` (in
    that order); returns the gathered ``k_proxy`` (waited for: the selection reads it) and the
    pending ``(k, v)`` for :func:`_finish_keys` (already waited for if not ``keys.overlap``)."""
    pending = [keys.launch(x, n) for x, n in zip((k_proxy, k, v), _KEY_NAMES)]
    k_proxy = keys.finish(pending[0], _KEY_NAMES[0])
    kv = tuple(pending[1:])
    if not keys.overlap:
        kv = tuple(keys.finish(p, n) for p, n in zip(kv, _KEY_NAMES[1:]))
    return k_proxy, kv


def _finish_keys(keys, kv):
    """After the selection: the gathered ``(k, v)`` of :func:`_launch_keys`."""
    if not keys.overlap:
        return kv
    return tuple(keys.finish(p, n) for p, n in zip(kv, _KEY_NAMES[1:]))


# ---------------------------------------------------------------------------------------------
# the forward's sorted lists, kept for the backward (one work-list sort per training step)
# ---------------------------------------------------------------------------------------------
_NO_LISTS = (None, None, None, None)


def _kept_lists(out, wanted: bool) -> tuple[tuple, worklist.Lists | None]:
    """``(tensors, rest)`` of the sorted lists that the ``fwd`` op left on ``out``
    (:func:`flash_msa.ops.take_lists`: eager, when the sparse-forward driver ran in one chunk
    and ``sparse_forward.keeps`` them), if ``wanted`` (a backward will read them): the four
    tensors go to ``save_for_backward`` (freed after the backward like the others,
    version-checked, and through saved-tensor hooks), the host fields stay on ``ctx``.
    ``(_NO_LISTS, None)`` if none; lists not wanted are dropped here, with their memory."""
    lists = custom_ops.take_lists(out)
    if lists is None or not wanted:
        return _NO_LISTS, None
    tensors = (lists.perm, lists.bounds, lists.block_start, lists.block_end)
    rest = lists._replace(perm=None, bounds=None, block_start=None, block_end=None, q_map=None)
    return tensors, rest


def _give_lists(lse, rest: worklist.Lists | None, tensors, q_map) -> None:
    """Puts the forward's lists (:func:`_kept_lists`'s ``rest`` and the unpacked ``tensors``,
    with the backward's ``q_map``) back together on ``lse`` for the ``bwd`` op, whose backend
    cuts its work items from them (:func:`flash_msa.worklist.items`) instead of sorting again."""
    if rest is None:
        return
    perm, bounds, start, end = tensors
    lists = rest._replace(perm=perm, bounds=bounds, block_start=start, block_end=end, q_map=q_map)
    custom_ops.attach_lists(lse, lists)


# ---------------------------------------------------------------------------------------------
# autograd: one Function per public op over the flash_msa:: custom ops, eager and compiled alike
# ---------------------------------------------------------------------------------------------
def _selected(indices, rows_ok):
    """The selection's ``indices`` with the rows the metadata guard dropped (``rows_ok`` false,
    e.g. rows past ``cu_seqlens[-1]``, which no selection program writes) emptied, so that the
    forward and the work list never read an unwritten row."""
    if indices is None or rows_ok is None:
        return indices
    return indices.masked_fill(~rows_ok[:, None, None], -1)


def _poison(out, kl, rows_ok):
    """The guard's rule on the forward's outputs: NaN on the rows ``rows_ok`` drops (in place,
    before ``out`` is saved, so no pass over ``dout`` is added; those rows' gradients are NaN
    or 0), a NaN ``kl`` (a mean over every row) when any is dropped."""
    if rows_ok is None:
        return kl
    guard.poison_(out, rows_ok)
    return guard.poison_scalar(kl, rows_ok.all())


def _poison_heads(out, lse, heads_ok):
    """NaN, in place, on the (row, index head) pairs ``heads_ok`` (``(T, Hs)``, the guard's)
    drops: ``out`` ``(T, H, D)`` and ``lse`` ``(T, H)``; nothing for ``None``."""
    if heads_ok is not None:
        guard.poison_(out, heads_ok)
        guard.poison_(lse, heads_ok)


def _op_args(cfg: Config, varlen: bool, dims) -> tuple:
    """The trailing scalar arguments of the ``flash_msa::`` custom ops (ops.py): ``cfg``, the
    form, ``dims = (H, Hkv, D, Hsel, Hpk, Dp)`` as in :func:`_problem` and the
    ``FLASH_MSA_BACKEND`` value, read here (when a graph is traced: at trace time); each op
    resolves its backend from them per call (``backends.resolve``). The ops' keyword
    ``deterministic`` is ``cfg.deterministic`` (passed next to these)."""
    return (
        cfg.max_seqlen,
        cfg.block_size,
        cfg.softmax_scale,
        cfg.proxy_scale,
        cfg.top_k,
        cfg.warmup,
        cfg.compute_kl,
        varlen,
        list(dims),
        backends.requested(),
    )


def _precision_kw(selection_precision: str) -> dict:
    """The ``flash_msa::select`` op's keyword ``selection_precision``, passed only when it is
    not the default, so that a bf16 graph holds no such keyword."""
    if selection_precision == "bf16":
        return {}
    return {"selection_precision": selection_precision}


class _MSAFunction(torch.autograd.Function):
    """select -> fwd (-> bwd): the fused MSA op on the packed layout, as ``flash_msa::`` custom
    ops (ops.py), eager and under ``torch.compile`` (Dynamo traces this Function, forward and
    backward; the ops stay opaque nodes).

    ``args`` is :func:`_op_args`; ``wants_grad`` says whether a backward can follow (grad mode
    on and an input requiring grad: ``needs_input_grad`` says True under ``torch.no_grad()``
    too); ``det`` is ``cfg.deterministic`` (the ops' ``deterministic`` keyword); ``q_map`` the
    query map or ``None`` (the ops' last positional argument, not passed without one);
    ``precision`` is ``cfg.selection_precision`` (the select op's keyword,
    :func:`_precision_kw`); ``rows_ok`` the guard's kept query rows or ``None``
    (:func:`_selected`, :func:`_poison`).

    With a key gather ``keys`` (:class:`KeyGather`), ``k_proxy``, ``k``, ``v`` are shards: the
    gathers are waited for around the selection (:func:`_launch_keys`), the gathered keys saved,
    and the backward's key gradients scattered back (``keys.scatter``; under ``torch.compile``
    its collectives must be traceable: ``flash_msa.distributed`` uses functional collectives).

    Each op resolves its own backend, so the backward runs where the forward's backend cannot
    (e.g. the Triton ``bwd`` after a CuTe ``fwd``) within one autograd step. The proxy gradient:
    a backward whose backend declares ``fused_proxy_grad`` makes it itself; otherwise, when the
    proxy requires grad, the forward's KL pass makes the unit one (``dkl = 1``) where its
    backend can, and a KL-only backward just scales it.

    An unused ``kl``: eager, its gradient arrives as ``None`` and the proxy backward is skipped;
    the compiled backward may materialize it as a 0 tensor, so the proxy pass runs with
    ``dkl = 0`` (exactly 0 gradients, at the pass's cost); a caller that knows the KL is unused
    skips it by passing ``q_proxy``/``k_proxy`` that do not require grad (e.g. ``.detach()``),
    which is decided at trace time.
    """

    @staticmethod
    def forward(
        ctx,
        q_proxy,
        k_proxy,
        q,
        k,
        v,
        cu_seqlens,
        q_map,
        args,
        wants_grad,
        det,
        keys,
        precision,
        rows_ok,
    ):
        ctx.set_materialize_grads(False)
        warmup, compute_kl = args[5:7]
        kw = {"deterministic": det}
        qm = () if q_map is None else (q_map,)
        if keys is not None:
            k_proxy, kv = _launch_keys(keys, k_proxy, k, v)
        indices = None
        if not warmup:
            sel = _precision_kw(precision)
            indices = custom_ops.select(q_proxy, k_proxy, cu_seqlens, *args, *qm, **kw, **sel)
            indices = _selected(indices, rows_ok)
        if keys is not None:  # the selection ran while k and v were in flight
            k, v = _finish_keys(keys, kv)
        proxy_grad = wants_grad and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        use_proxy = compute_kl or proxy_grad
        out, lse, proxy_lse, kl, unit_dq, unit_dk = custom_ops.fwd(
            q,
            k,
            v,
            indices,
            cu_seqlens,
            q_proxy if use_proxy else None,
            k_proxy if use_proxy else None,
            proxy_grad,
            *args,
            *qm,
            **kw,
            carry_lists=not torch.compiler.is_compiling(),  # (eager: the lists ride on out)
        )
        # kept for a backward that builds a work list: not one that only scales the forward's
        # unit proxy gradient (main inputs frozen, proxy trained by the KL)
        main_grads = any(ctx.needs_input_grad[2:5])
        unit_made = unit_dq.dim() == 3
        kept, ctx.lists = _kept_lists(out, wants_grad and (main_grads or not unit_made))
        kl = _poison(out, kl, rows_ok)
        ctx.save_for_backward(
            q,
            k,
            v,
            out,
            lse,
            indices,
            q_proxy if proxy_grad else None,
            k_proxy if proxy_grad else None,
            proxy_lse if proxy_grad else None,
            cu_seqlens,
            unit_dq if proxy_grad else None,
            unit_dk if proxy_grad else None,
            q_map,
            *kept,
        )
        ctx.args, ctx.proxy_grad, ctx.det, ctx.keys = args, proxy_grad, det, keys
        return out, kl

    @staticmethod
    def backward(ctx, dout, dkl):
        (q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, cu, *rest) = ctx.saved_tensors
        unit_dq, unit_dk, q_map, *kept = rest
        main = dout is not None and any(ctx.needs_input_grad[2:5])
        proxy = dkl is not None and ctx.proxy_grad
        if not (main or proxy):
            return (None,) * 13
        _give_lists(lse, ctx.lists, kept, q_map)
        dq, dk, dv, dq_proxy, dk_proxy = custom_ops.bwd(
            dout.contiguous() if main else None,
            dkl if proxy else None,
            q,
            k,
            v,
            out,
            lse,
            indices,
            q_proxy if proxy else None,
            k_proxy if proxy else None,
            proxy_lse if proxy else None,
            unit_dq if proxy else None,
            unit_dk if proxy else None,
            cu,
            *ctx.args,
            *(() if q_map is None else (q_map,)),
            deterministic=ctx.det,
        )
        if not main:
            dq = dk = dv = None
        if not proxy:
            dq_proxy = dk_proxy = None
        if ctx.keys is not None:  # global key gradients -> this rank's, summed over the ranks
            need = ctx.needs_input_grad
            grads = [x if need[i] else None for x, i in zip((dk_proxy, dk, dv), (1, 3, 4))]
            dk_proxy, dk, dv = ctx.keys.scatter(tuple(grads), _KEY_GRAD_NAMES)
        return dq_proxy, dk_proxy, dq, dk, dv, None, None, None, None, None, None, None, None


class _SparseFunction(torch.autograd.Function):
    """fwd (-> bwd) on given indices, no proxy, as ``flash_msa::`` custom ops (see
    :class:`_MSAFunction`); ``heads_ok`` the guard's kept (row, index head) pairs or ``None``."""

    @staticmethod
    def forward(ctx, q, k, v, indices, cu_seqlens, args, wants_grad, det, heads_ok):
        ctx.set_materialize_grads(False)
        kw = {"deterministic": det}
        kw["carry_lists"] = not torch.compiler.is_compiling()  # (eager: the lists ride on out)
        out, lse = custom_ops.fwd(q, k, v, indices, cu_seqlens, None, None, False, *args, **kw)[:2]
        kept, ctx.lists = _kept_lists(out, wants_grad)
        _poison_heads(out, lse, heads_ok)
        ctx.save_for_backward(q, k, v, out, lse, indices, cu_seqlens, *kept)
        ctx.args, ctx.det = args, det
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None or not any(ctx.needs_input_grad[:3]):
            return (None,) * 9
        q, k, v, out, lse, indices, cu, *kept = ctx.saved_tensors
        _give_lists(lse, ctx.lists, kept, None)
        dq, dk, dv = custom_ops.bwd(
            dout.contiguous(),
            None,
            q,
            k,
            v,
            out,
            lse,
            indices,
            None,
            None,
            None,
            None,
            None,
            cu,
            *ctx.args,
            deterministic=ctx.det,
        )[:3]
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def msa_attention(
    q_proxy,
    k_proxy,
    q,
    k,
    v,
    top_k,
    *,
    block_size=128,
    softmax_scale=None,
    proxy_scale=None,
    cu_seqlens=None,
    max_seqlen=None,
    causal=True,
    warmup=False,
    compute_kl=True,
    deterministic=None,
    selection_precision="bf16",
):
    """MiniMax Sparse Attention: proxy top-k block selection, sparse GQA attention, proxy KL.

    Shapes (batch form; varlen form drops ``B`` and packs ``(T, heads, dim)`` with
    ``cu_seqlens``):

    - ``q_proxy``: ``(B, S, Hp, Dp)``, ``k_proxy``: ``(B, S, Hpk, Dp)``
    - ``q``: ``(B, S, H, D)``, ``k``, ``v``: ``(B, S, Hkv, D)``
    - head rules: ``H % Hkv == 0``, ``H % Hp == 0``, ``Hp % Hpk == 0`` and ``Hp``, ``Hkv``
      divide one another.

    Args:
        top_k: number of key *blocks* each query keeps (its own block included), an int in
            ``[1, MAX_TOP_K]`` (``2**14``; larger values raise ``ValueError``). A ``top_k`` above
            both 64 and the blocks of the longest sequence, ``ceil(max_seqlen / block_size)``,
            is **clamped** to the larger of the two: the result is the same (every row keeps
            all of its visible blocks), and the internal index tensor and the backends'
            ``top_k`` limits see the clamped value, so nothing is allocated per requested slot
            (up to 64 it is kept, so the compiled kernels do not change with the lengths).
            Validated but unused when ``warmup=True``.
        block_size: 64 or 128 tokens per key block.
        softmax_scale: main attention scale, default ``D ** -0.5``.
        proxy_scale: proxy score scale, default ``Dp ** -0.5``.
        cu_seqlens: int32 or int64 ``(N+1,)`` cumulative sequence lengths (varlen form); an
            int64 one is cast to int32 once per call (a copy of ``N+1`` values; its values
            must fit int32, checked where values are checked). Its values are checked on CPU
            tensors and with ``FLASH_MSA_DEBUG=1``; elsewhere (GPU tensors,
            ``torch.compile``) reading them would sync, and a malformed one is made safe on the
            device instead (:mod:`flash_msa.guard`): the rows it makes meaningless (a sequence
            whose offsets are out of order, out of ``[0, T]`` or longer than ``max_seqlen``,
            rows past ``cu_seqlens[-1]``) come out NaN (their gradients NaN or 0) and ``kl``
            is NaN; the other rows and their gradients are exact. No kernel reads or writes
            out of bounds.
        max_seqlen: longest sequence, at most the tokens; required when ``cu_seqlens`` is on a
            GPU.
        causal: ``True`` (the default), accepted for FlashAttention-style calls: MSA is causal
            by definition. ``causal=False`` raises ``ValueError``.
        warmup: dense causal main attention, KL over all visible keys (``top_k`` ignored).
        compute_kl: compute the KL value (``False`` returns 0 but keeps its exact gradient).
        deterministic: ``True`` makes ``out``, ``kl`` and every gradient bitwise identical
            across runs on the same inputs (ordered reductions instead of fp32 atomics; more
            time and memory, docs/design.md "Deterministic mode"); ``None`` (default) reads
            ``FLASH_MSA_DETERMINISTIC`` (``1`` on, unset or ``0`` off), which the keyword
            overrides. Backends that do not implement it are skipped by ``auto`` and raise
            when forced.
        selection_precision: ``"bf16"`` (default): the selection ranks fp32 scores of the
            input-dtype proxy operands (exact). ``"fp8"``: it ranks scores of e4m3 operands
            with fp32 scales and accumulation (:mod:`flash_msa.quant`, made for FP8 tensor
            cores), an approximate selection: blocks of nearly equal scores may swap
            (docs/algorithm.md, "FP8 selection"). Only the indices change: the own block,
            causality, ``-inf`` blocks and the tie order stay, and the attention, the KL and
            every gradient over the kept blocks are exact. Only backends whose limits declare
            it select in fp8 (``cute`` on SM90 and ``torch``; ``auto`` skips the others, a
            forced backend raises). Any other value raises ValueError.

    Returns:
        ``(out, kl)``: ``out`` like ``q``; ``kl`` a 0-dim fp32 tensor (fp64 for fp64 inputs),
        the mean over ``Hp * tokens`` rows of ``KL(target || proxy)``. Its gradient reaches only
        ``q_proxy``/``k_proxy``; no main-loss gradient reaches them.
    """
    return _msa_attention(
        q_proxy,
        k_proxy,
        q,
        k,
        v,
        top_k,
        block_size=block_size,
        softmax_scale=softmax_scale,
        proxy_scale=proxy_scale,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        causal=causal,
        warmup=warmup,
        compute_kl=compute_kl,
        deterministic=deterministic,
        selection_precision=selection_precision,
    )


# msa_attention's keyword-only arguments and their defaults: its signature is their one
# definition, which _msa_attention (the same call plus q_map, key_gather) takes as they are
_KEYWORDS = {
    name: p.default
    for name, p in inspect.signature(msa_attention).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _msa_attention(
    q_proxy, k_proxy, q, k, v, top_k, *, q_map=None, key_gather=None, **keywords
):  # fmt: skip
    """:func:`msa_attention` with the context-parallel arguments, which only
    :func:`flash_msa.distributed.msa_attention` passes; ``keywords`` are those of
    :func:`msa_attention`, with its defaults (:data:`_KEYWORDS`), the other arguments as there.

    Args:
        q_map: queries that are not the keys' own tokens (context parallelism: local queries,
            gathered keys; docs/distributed.md). int32 ``(Tq,)``: the packed index into
            ``k``/``v``/``k_proxy`` of each query row's token, ``-1`` for a padding row (no
            keys: ``out = 0``, KL term 0). Varlen form only; ``q``/``q_proxy`` then have ``Tq``
            rows, ``cu_seqlens``/``max_seqlen`` describe the keys' sequences, positions (the
            blocks, the own block, causality) are those of each query's token in its
            sequence, and ``kl`` is a mean over ``Hp * Tq`` rows. Backends whose limits declare
            ``q_map`` run it (``flash-msa info``: ``torch``, ``triton`` and ``cute``, not the
            Triton warmup), eager and under ``torch.compile``.
        key_gather: a :class:`KeyGather` (with ``q_map``), the hook of
            :func:`flash_msa.distributed.msa_attention`: ``k_proxy``, ``k``, ``v`` are then this
            rank's shards (as many rows as ``q``) and the op all-gathers them itself, waiting for
            ``k`` and ``v`` only after the selection; ``cu_seqlens`` ends at
            ``key_gather.total_tokens``. ``None`` (default): the keys are given whole.
    """
    unknown = [name for name in keywords if name not in _KEYWORDS]
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}: the keywords are "
            f"msa_attention's ({', '.join(_KEYWORDS)}) and q_map, key_gather"
        )
    kw = {**_KEYWORDS, **keywords}
    _causal_arg(kw["causal"])
    cu_seqlens = kw["cu_seqlens"]
    varlen = cu_seqlens is not None
    tensors = {"q_proxy": q_proxy, "k_proxy": k_proxy, "q": q, "k": k, "v": v}
    if key_gather is not None and q_map is None:
        raise ValueError("key_gather needs q_map (the shards' queries are not the keys' tokens)")
    if q_map is None:
        _check_tensors(tensors, varlen)
    else:
        _check_q_map(q_map, q_proxy, k_proxy, q, k, v, varlen, key_gather)
    _check_main(q, k, v)
    _check_proxy(q_proxy, k_proxy)
    _check_heads(q.shape[-2], k.shape[-2], q_proxy.shape[-2], "q_proxy")
    top_k = _top_k_arg(top_k)
    block_size = _block_size_arg(kw["block_size"])
    softmax_scale = _scale_arg("softmax_scale", kw["softmax_scale"], q.shape[-1] ** -0.5)
    proxy_scale = _scale_arg("proxy_scale", kw["proxy_scale"], q_proxy.shape[-1] ** -0.5)
    warmup = _bool_arg("warmup", kw["warmup"])
    compute_kl = _bool_arg("compute_kl", kw["compute_kl"])
    deterministic = backends.deterministic(kw["deterministic"])
    selection_precision = quant.check_precision(kw["selection_precision"])
    total = None if key_gather is None else key_gather.total_tokens
    cu, max_seqlen = _sequences(q if q_map is None else k, cu_seqlens, kw["max_seqlen"], total)
    _check_finite(tensors)
    keys_total = k.shape[0] if total is None else total
    seqs = _guarded(cu, max_seqlen, keys_total, trusted=not varlen)
    rows_ok = None  # the query rows bad metadata makes meaningless: NaN (_poison); None: none
    if seqs is not None:
        cu = seqs.cu
        if q_map is None:
            rows_ok = seqs.row_ok
        else:
            q_map, rows_ok = guard.query_map(q_map, seqs)  # bad rows become padding rows
    if rows_ok is not None and _debug():
        guard.assert_ok(rows_ok.all(), "q_map or cu_seqlens is not well formed")
    cfg = Config(
        block_size=block_size,
        softmax_scale=softmax_scale,
        max_seqlen=max_seqlen,
        proxy_scale=proxy_scale,
        top_k=None if warmup else _kernel_top_k(top_k, max_seqlen, block_size),
        warmup=warmup,
        compute_kl=compute_kl,
        deterministic=deterministic,
        selection_precision=selection_precision,
    )
    packed = [_packed(x) for x in tensors.values()]
    Hp, Dp = q_proxy.shape[-2:]
    dims = (q.shape[-2], k.shape[-2], q.shape[-1], Hp, k_proxy.shape[-2], Dp)
    q_map = None if q_map is None else q_map.contiguous()
    wants = _wants_grad(*tensors.values())
    if not torch.compiler.is_compiling():  # (traced: the ops' fake implementations resolve)
        problem = _problem(q, *dims, cu, varlen, cfg, q_map=q_map is not None)
        steps = (() if warmup else ("select",)) + ("fwd",) + (("bwd",) if wants else ())
        _resolvable(problem, steps)
    args = _op_args(cfg, varlen, dims)
    out, kl = _MSAFunction.apply(
        *packed, cu, q_map, args, wants, deterministic, key_gather, selection_precision, rows_ok
    )
    return out.view(q.shape), kl


def select_blocks(
    q_proxy,
    k_proxy,
    top_k,
    *,
    block_size=128,
    proxy_scale=None,
    cu_seqlens=None,
    max_seqlen=None,
    causal=True,
    selection_precision="bf16",
):
    """The proxy's top-k key blocks per (query, proxy head). Not differentiable.

    Args:
        q_proxy: ``(B, S, Hp, Dp)`` or varlen ``(T, Hp, Dp)``.
        k_proxy: ``(B, S, Hpk, Dp)`` or varlen ``(T, Hpk, Dp)``; ``Hp % Hpk == 0``.
        top_k, block_size, proxy_scale, cu_seqlens, max_seqlen, causal, selection_precision: as
            in :func:`msa_attention` (``top_k`` in ``[1, MAX_TOP_K]``; ``selection_precision``
            ``"bf16"``, exact, or ``"fp8"``, approximate).

    Returns:
        int32 ``(B, S, Hp, top_k)`` (or ``(T, Hp, top_k)``): sequence-local block numbers,
        ascending, the own block always present, unused slots ``-1``. The selection runs with
        ``top_k`` **clamped** to ``max(ceil(max_seqlen / block_size), 64)`` (as in
        :func:`msa_attention`); the slots past that are ``-1`` padding, so the width stays the
        requested ``top_k`` and a sequence's indices do not depend on what it is packed with.
        Rows that a malformed ``cu_seqlens`` makes meaningless (see :func:`msa_attention`)
        are all ``-1``: no own block.
    """
    _causal_arg(causal)
    varlen = cu_seqlens is not None
    tensors = {"q_proxy": q_proxy, "k_proxy": k_proxy}
    _check_tensors(tensors, varlen)
    _check_proxy(q_proxy, k_proxy)
    top_k = _top_k_arg(top_k)
    block_size = _block_size_arg(block_size)
    proxy_scale = _scale_arg("proxy_scale", proxy_scale, q_proxy.shape[-1] ** -0.5)
    selection_precision = quant.check_precision(selection_precision)
    cu, max_seqlen = _sequences(q_proxy, cu_seqlens, max_seqlen)
    _check_finite(tensors)
    seqs = _guarded(cu, max_seqlen, q_proxy.shape[0], trusted=not varlen)
    if seqs is not None:
        cu = seqs.cu
    cfg = Config(
        block_size=block_size,
        softmax_scale=1.0,
        max_seqlen=max_seqlen,
        proxy_scale=proxy_scale,
        top_k=_kernel_top_k(top_k, max_seqlen, block_size),
        selection_precision=selection_precision,
    )
    dims = (0, 0, 0, q_proxy.shape[-2], k_proxy.shape[-2], q_proxy.shape[-1])
    args = _op_args(cfg, varlen, dims)
    with torch.no_grad():
        packed = (_packed(q_proxy), _packed(k_proxy), cu)
        indices = custom_ops.select(*packed, *args, **_precision_kw(selection_precision))
        indices = _selected(indices, None if seqs is None else seqs.row_ok)
    if cfg.top_k < top_k:  # the clamped slots: -1 in every row (see the docstring)
        indices = torch.nn.functional.pad(indices, (0, top_k - cfg.top_k), value=-1)
    return indices.view(*q_proxy.shape[:-1], top_k)


def sparse_attention(
    q,
    k,
    v,
    indices,
    *,
    block_size=128,
    softmax_scale=None,
    cu_seqlens=None,
    max_seqlen=None,
    causal=True,
    return_lse=False,
    deterministic=None,
):
    """Attention over given key blocks (differentiable in ``q``, ``k``, ``v``).

    Args:
        q: ``(B, S, H, D)``; k, v: ``(B, S, Hkv, D)`` (or varlen ``(T, heads, D)``).
        indices: int32 ``(B, S, Hsel, top_k)`` (or ``(T, Hsel, top_k)``): the sequence-local
            blocks each row attends, ascending, ``-1`` padded; main head ``h`` uses index head
            ``h // (H / Hsel)``. Causality holds inside each block; the own block is *not*
            implied. Values are checked on CPU or with ``FLASH_MSA_DEBUG=1``; elsewhere an
            ill-formed row (an entry outside ``[-1, blocks of its sequence)``, ``-1`` before a
            block, not strictly ascending) makes NaN the ``out`` and ``lse`` of the heads that
            use it, and nothing is read out of bounds (:mod:`flash_msa.guard`).
        block_size, softmax_scale, cu_seqlens, max_seqlen, causal: as in
            :func:`msa_attention` (the mask inside each kept block is causal).
        return_lse: also return the fp32 natural-log LSE ``(B, S, H)`` (not differentiable).
        deterministic: as in :func:`msa_attention` (``None``: ``FLASH_MSA_DETERMINISTIC``).

    Returns:
        ``out`` like ``q`` (rows with no visible key are 0), or ``(out, lse)``.
    """
    _causal_arg(causal)
    varlen = cu_seqlens is not None
    tensors = {"q": q, "k": k, "v": v}
    _check_tensors(tensors, varlen)
    _check_main(q, k, v)
    block_size = _block_size_arg(block_size)
    softmax_scale = _scale_arg("softmax_scale", softmax_scale, q.shape[-1] ** -0.5)
    return_lse = _bool_arg("return_lse", return_lse)
    deterministic = backends.deterministic(deterministic)
    cu, max_seqlen = _sequences(q, cu_seqlens, max_seqlen)
    _check_indices(indices, q, cu, max_seqlen, block_size, varlen)
    _check_heads(q.shape[-2], k.shape[-2], indices.shape[-2], "indices")
    _check_finite(tensors)
    packed_idx, head_ok = _packed(indices), None
    if not _value_checks(q.device):  # the indices' (and cu_seqlens') values are unread
        seqs = guard.sequences(cu, max_seqlen, packed_idx.shape[0])
        cu = seqs.cu
        packed_idx, head_ok = guard.indices(packed_idx, seqs, block_size)
        if _debug():
            guard.assert_ok(head_ok.all(), "indices or cu_seqlens are not well formed")
    cfg = Config(
        block_size=block_size,
        softmax_scale=softmax_scale,
        max_seqlen=max_seqlen,
        deterministic=deterministic,
    )
    dims = (q.shape[-2], k.shape[-2], q.shape[-1], indices.shape[-2], 0, 0)
    packed = (_packed(q), _packed(k), _packed(v), packed_idx, cu)
    wants = _wants_grad(q, k, v)
    if not torch.compiler.is_compiling():  # as in msa_attention
        _resolvable(_problem(q, *dims, cu, varlen, cfg), ("fwd", "bwd") if wants else ("fwd",))
    args = _op_args(cfg, varlen, dims)
    out, lse = _SparseFunction.apply(*packed, args, wants, deterministic, head_ok)
    out = out.view(q.shape)
    return (out, lse.view(q.shape[:-1])) if return_lse else out
