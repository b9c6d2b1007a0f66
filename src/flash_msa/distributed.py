"""Context parallelism (CP): one MSA op over the ranks of a ``torch.distributed`` group.

A long sequence (or a packed varlen batch) is split over the ``P`` ranks of a CP group; each rank
holds a shard of every input. :func:`msa_attention` keeps the queries local and all-gathers the
keys: all three gathers are launched at once, ``k_proxy`` first, and the op waits for
``k_proxy`` before its selection (which needs every block's proxy score) but for ``k`` and ``v``
only after it, so their transfer overlaps the selection; its backward reduce-scatters
``dk_proxy``, ``dk``, ``dv`` in fp32. The single-process op (:func:`flash_msa.msa_attention`)
runs the local queries against the whole batch's keys through its query map (``q_map``: the
packed key index of each local query's token), so blocks, the forced own block and causality use
each query's position in its own sequence; the collectives run inside it, through its
``key_gather`` hook (:class:`flash_msa.api.KeyGather`). They are functional collectives
(``torch.ops._c10d_functional``): asynchronous (on NCCL, on its own stream; a wait orders the
current stream after it, no host synchronization) and traceable, so the op also runs under
``torch.compile(fullgraph=True)``. :class:`WaitTimer` measures the waits (the collective time
not overlapped with compute). Outputs and all five gradients equal the single-process op on the
whole batch up to summation order. Before its first collective an eager call checks that the
ranks' calls agree (one all-gather of a small fingerprint per rank; every rank raises the same
ValueError on a difference: "agreement" below). docs/distributed.md states the scheme, the bytes
moved per step and what each backend supports.

The layout (:func:`layout`) is causal zigzag per sequence: a sequence of ``L`` tokens is padded
at its end to ``2P`` chunks of ``c`` tokens, ``c`` the smallest multiple of the block size with
``2P * c >= L``, and rank ``r`` holds chunks ``r`` and ``2P-1-r`` of every sequence (sequence by
sequence, in order). Every rank then holds the same number of tokens and about the same causal
work. :func:`shard` / :func:`unshard` move any tensor between the global and the sharded
layout; :func:`gather` is a differentiable all-gather with the collectives of the op.

Per-rank ``kl``: this rank's share of the single-process KL (its rows' terms over the global
``Hp * T`` rows): the SUM over the group is the single-process ``kl``, and per-rank losses
``main_share + w * kl`` followed by the usual SUM all-reduce of the parameter gradients over the
CP group give the single-process gradients.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import operator
import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api, backends, quant


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Layout:
    """Where each token of a batch lies across the ranks of a CP group (see :func:`layout`).

    ``T`` real tokens, ``N`` sequences, ``P = world_size``, ``Tl = local_tokens``. Tensors live
    on the device the layout was built for; the ints are host values (no sync to read them).
    """

    world_size: int  # P
    rank: int  # this rank's index in the CP group
    block_size: int  # the op's key block; every chunk is a whole number of blocks
    batch_size: int | None  # batch form: B sequences of `seqlen` tokens; None: varlen
    seqlen: int | None  # batch form: S (global); None: varlen
    cu_seqlens: torch.Tensor  # (N+1,) int32: the global sequences (no padding)
    max_seqlen: int  # the longest global sequence
    total_tokens: int  # T
    local_tokens: int  # Tl, the same on every rank (padding included)
    chunks: tuple[int, ...]  # per sequence, its chunk length c (a multiple of block_size)
    local_cu_seqlens: torch.Tensor  # (N+1,) int32: the shard's per-sequence segments (2c each)
    token_index: torch.Tensor  # (P, Tl) int64: global packed token of each rank's slot; -1 pad
    gather_index: torch.Tensor  # (T,) int64: each token's row in the rank-major (P*Tl) gather
    q_map: torch.Tensor  # (Tl,) int32: token_index[rank], the op's query map
    positions: torch.Tensor  # (Tl,) int64: position of this rank's tokens in their sequence; -1 pad
    # a 63-bit hash of the global cu_seqlens, computed once on the host from the lengths: the
    # ranks compare it before the op's collectives (batches of equal Tl can differ in it alone)
    cu_seqlens_hash: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading dims of a local shard: ``(B, Tl // B)`` (batch form) or ``(Tl,)``."""
        if self.batch_size is None:
            return (self.local_tokens,)
        return (self.batch_size, self.local_tokens // self.batch_size)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Leading dims of a global tensor: ``(B, S)`` (batch form) or ``(T,)``."""
        if self.batch_size is None:
            return (self.total_tokens,)
        return (self.batch_size, self.seqlen)

    def for_rank(self, rank: int) -> Layout:
        """The same layout as rank ``rank`` of the group sees it (host-side sharding, tests)."""
        rank = _int_arg("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {rank}")
        q_map, positions = _rank_maps(self.token_index[rank], self.cu_seqlens)
        return dataclasses.replace(self, rank=rank, q_map=q_map, positions=positions)


def _int_arg(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _rank_maps(token_index: torch.Tensor, cu_seqlens: torch.Tensor):
    """``(q_map, positions)`` of one rank's ``token_index`` row."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], token_index, right=True).clamp_max(cu.numel() - 2)
    positions = torch.where(token_index >= 0, token_index - cu[seq], -1)
    return token_index.to(torch.int32), positions


def layout(
    world_size,
    rank,
    *,
    cu_seqlens=None,
    batch_size=None,
    seqlen=None,
    block_size=128,
    device=None,
) -> Layout:
    """The causal zigzag CP layout of a batch.

    Give ``cu_seqlens`` (packed varlen batch) or ``batch_size`` and ``seqlen`` (batch form).
    Sequence ``n`` of ``L`` tokens gets chunks of ``c = block_size * ceil(L / (2P *
    block_size))`` tokens, ``2P`` of them, padded at its end; rank ``r`` holds chunks ``r`` and
    ``2P-1-r`` of every sequence, sequence after sequence, so its shard has
    ``Tl = sum_n 2 c_n`` tokens (``B * 2c`` in batch form: shards are ``(B, 2c, ...)``).

    Built on the host from the lengths: a ``cu_seqlens`` on a GPU costs one device-to-host copy
    (build the layout where the lengths are known, e.g. in the data loader, from a CPU tensor).

    Args:
        world_size: ``P``, the size of the CP group; rank: this rank's index in it.
        cu_seqlens: int32 or int64 ``(N+1,)``, the global batch's cumulative lengths (read on
            the host; the layout's own offsets are int32).
        batch_size, seqlen: the batch form ``(B, S)`` instead of ``cu_seqlens``.
        block_size: the op's block size (64 or 128); every chunk is a whole number of blocks.
        device: where the layout's index tensors live (default: ``cu_seqlens``'s, else CPU).
    """
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    if block_size not in (64, 128) or isinstance(block_size, bool):
        raise ValueError(f"block_size must be 64 or 128, got {block_size!r}")
    if cu_seqlens is None:
        if batch_size is None or seqlen is None:
            raise ValueError("give cu_seqlens (varlen) or both batch_size and seqlen (batch form)")
        batch_size = _int_arg("batch_size", batch_size, 1)
        seqlen = _int_arg("seqlen", seqlen, 1)
        lengths = [seqlen] * batch_size
    else:
        if batch_size is not None or seqlen is not None:
            raise ValueError("give cu_seqlens or batch_size/seqlen, not both")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        int_dtype = cu_seqlens.dtype in (torch.int32, torch.int64)
        if not int_dtype or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                "cu_seqlens must be 1-D int32 or int64 [0, ..., total_tokens] with at least 2 "
                f"entries; got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        device = cu_seqlens.device if device is None else device
        cu = cu_seqlens.tolist()  # the layout is host metadata (see above)
        if cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if sum(lengths) == 0:
        raise ValueError("the batch has no tokens")
    if sum(lengths) > torch.iinfo(torch.int32).max:  # the layout's offsets are int32
        raise ValueError(f"the batch's {sum(lengths)} tokens do not fit int32 offsets")
    device = torch.device("cpu" if device is None else device)

    P, b = world_size, block_size
    chunks = tuple(b * -(-n // (2 * P * b)) for n in lengths)
    # token_index[r] = per sequence: its chunk r, then its chunk 2P-1-r (positions past its end
    # are padding, -1). Built for every rank: shard/unshard and the gather index need them all.
    pairs = torch.stack([torch.arange(P), 2 * P - 1 - torch.arange(P)], 1)  # (P, 2)
    rows, start = [], 0
    for n, c in zip(lengths, chunks):
        pos = (pairs[:, :, None] * c + torch.arange(c)).reshape(P, 2 * c)  # (P, 2c)
        rows.append(torch.where(pos < n, start + pos, -1))
        start += n
    token_index = torch.cat(rows, 1)  # (P, Tl)
    T, Tl = start, token_index.shape[1]
    flat = token_index.flatten()
    real = flat >= 0
    gather_index = torch.empty(T, dtype=torch.long)
    gather_index[flat[real]] = torch.arange(P * Tl)[real]
    local_cu = torch.tensor([0, *torch.tensor(chunks).mul(2).cumsum(0).tolist()], dtype=torch.int32)
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    global_cu = torch.tensor(cu_list, dtype=torch.int32)
    token_index, global_cu = token_index.to(device), global_cu.to(device)
    q_map, positions = _rank_maps(token_index[rank], global_cu)
    return Layout(
        world_size=P,
        rank=rank,
        block_size=b,
        batch_size=batch_size if cu_seqlens is None else None,
        seqlen=seqlen if cu_seqlens is None else None,
        cu_seqlens=global_cu,
        max_seqlen=max(lengths),
        total_tokens=T,
        local_tokens=Tl,
        chunks=chunks,
        local_cu_seqlens=local_cu.to(device),
        token_index=token_index,
        gather_index=gather_index.to(device),
        q_map=q_map,
        positions=positions,
        cu_seqlens_hash=_hash(struct.pack(f"<{len(cu_list)}q", *cu_list)),
    )


def _check_layout(lay):
    if not isinstance(lay, Layout):
        raise TypeError(
            f"layout must be a flash_msa.distributed.Layout (from layout()), got "
            f"{type(lay).__name__}"
        )


def _flat(x, shape, name, where):
    """``x`` with leading dims ``shape`` as ``(prod(shape), *rest)``; ValueError otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape[: len(shape)]) != tuple(shape):
        raise ValueError(
            f"{name} must have leading dims {tuple(shape)} ({where}); got shape {tuple(x.shape)}"
        )
    return x.reshape(-1, *x.shape[len(shape) :])


# ---------------------------------------------------------------------------------------------
# shard / unshard (no communication)
# ---------------------------------------------------------------------------------------------
def shard(x: torch.Tensor, layout: Layout, rank: int | None = None, fill=0) -> torch.Tensor:
    """This rank's shard of a global tensor (differentiable; padding slots hold ``fill``).

    Args:
        x: ``(T, ...)`` (varlen) or ``(B, S, ...)`` (batch form), any dtype: inputs, hidden
            states, labels, ``dout``...
        layout: from :func:`layout`; rank: whose shard (default ``layout.rank``).
    Returns:
        ``(Tl, ...)`` or ``(B, Tl // B, ...)``. The shard's ``cu_seqlens`` (its per-sequence
        segments) is ``layout.local_cu_seqlens``, its tokens' positions ``layout.positions``.
    """
    _check_layout(layout)
    lay = layout if rank is None else layout.for_rank(rank)
    flat = _flat(x, lay.global_shape, "x", "the layout's global tokens")
    idx = lay.token_index[lay.rank]
    pad = (idx < 0).view(-1, *([1] * (flat.dim() - 1)))
    out = flat.index_select(0, idx.clamp_min(0)).masked_fill(pad, fill)
    return out.view(*lay.local_shape, *flat.shape[1:])


def unshard(shards, layout: Layout) -> torch.Tensor:
    """The global tensor from every rank's shard (differentiable; padding dropped).

    Args:
        shards: a list of the ``P`` shards in rank order, each ``(Tl, ...)`` or
            ``(B, Tl // B, ...)``, or one tensor of them stacked on a new first dim.
    Returns:
        ``(T, ...)`` or ``(B, S, ...)``. Inside the op path use :func:`gather` (a collective).
    """
    _check_layout(layout)
    if len(shards) != layout.world_size:
        raise ValueError(
            f"unshard needs {layout.world_size} shards (one per rank), got {len(shards)}"
        )
    flat = torch.cat(
        [_flat(s, layout.local_shape, f"shards[{r}]", "a shard") for r, s in enumerate(shards)]
    )
    out = flat.index_select(0, layout.gather_index)
    return out.view(*layout.global_shape, *out.shape[1:])


# ---------------------------------------------------------------------------------------------
# agreement: the ranks compare their calls before the first collective
# ---------------------------------------------------------------------------------------------
# Each rank sizes and orders its collectives from its own arguments. Ranks that disagree (layouts
# of different batches with equal Tl, another top_k, dtype or head count) would silently mix one
# another's keys, abort inside the backend (gloo checks sizes in C++ and kills the process) or,
# when one rank raised in its own checks, leave the others blocked until the group's timeout. So
# every eager call first all-gathers one fixed-length int64 fingerprint per rank: its shape and
# dtype never depend on the arguments, so this gather itself cannot mismatch; from the gathered
# table every rank derives the same verdict and raises the same ValueError.
#
# A fingerprint (int64, _LENGTH entries): [format, call, error flag], then the call's fields
# (_FIELDS[call] order, zero-padded to _MAX_FIELDS; zeros when the rank rejected its
# arguments), then the rejecting rank's error text (UTF-8, 8 bytes per entry, zero-padded).

_FORMAT = 1  # the fingerprint's layout: a rank that packs another one is refused by name
_CALLS = ("msa_attention", "gather")  # a call's code is its index + 1
_MAX_FIELDS = 40
_MESSAGE_BYTES = 256  # of a rejecting rank's "Type: message" (truncated)
_HEADER = 3
_LENGTH = _HEADER + _MAX_FIELDS + _MESSAGE_BYTES // 8
_INVALID = -1  # a value this rank could not read (not a tensor, not an int...): the op refuses it
_INT64 = (-(1 << 63), (1 << 63) - 1)

_INPUT_NAMES = ("q_proxy", "k_proxy", "q", "k", "v")
# (name, kind): the kind says how _show prints a value; every field is one int64
_LAYOUT_FIELDS = (
    ("world_size", "int"),
    ("total_tokens", "int"),
    ("sequences", "int"),
    ("cu_seqlens", "hash"),
    ("local_tokens", "int"),
    ("block_size", "int"),
)
_FIELDS = {
    # whatever sizes the op's collectives (the layout, the keys' heads, dims and dtype, which
    # gradients flow back) or changes its math (the options, the scales, the queries' shapes)
    "msa_attention": _LAYOUT_FIELDS
    + (
        ("top_k", "int"),
        ("warmup", "bool"),
        ("compute_kl", "bool"),
        ("deterministic", "bool"),
        ("selection_precision", "precision"),
        ("softmax_scale", "float"),
        ("proxy_scale", "float"),
    )
    + tuple(
        (f"{what} of {name}", kind)
        for name in _INPUT_NAMES
        for what, kind in (
            ("dtype", "dtype"),
            ("heads", "int"),
            ("head_dim", "int"),
            ("requires_grad", "bool"),
        )
    ),
    "gather": _LAYOUT_FIELDS
    + (
        ("dtype of x", "dtype"),
        ("trailing dims of x", "int"),
        ("elements per token of x", "int"),
        ("requires_grad of x", "bool"),
    ),
}
assert all(len(f) <= _MAX_FIELDS for f in _FIELDS.values())


def _hash(data: bytes) -> int:
    """A 63-bit hash of ``data``, the same in every process (``hash(str)`` is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _int_code(value) -> int:
    if isinstance(value, bool):  # an int to Python, refused by the op's checks
        return _INVALID
    try:
        return operator.index(value)
    except TypeError:
        return _INVALID


def _bool_code(value) -> int:
    return int(value) if isinstance(value, bool) else _INVALID


def _float_code(value) -> int:
    """The float64 bits of ``value`` (exact comparison), or ``_INVALID``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _INVALID
    try:
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    except (OverflowError, ValueError):
        return _INVALID


def _str_code(value) -> int:
    return _hash(value.encode()) if isinstance(value, str) else _INVALID


def _tensor_codes(x) -> tuple[int, int, int, int]:
    """``(dtype, heads, head_dim, requires_grad)`` of an input ``(..., heads, head_dim)``."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return (_INVALID,) * 4
    grad = torch.is_grad_enabled() and x.requires_grad  # the backward's collectives follow it
    return _str_code(str(x.dtype)), x.shape[-2], x.shape[-1], int(grad)


def _layout_codes(lay) -> tuple[int, ...]:
    """``_LAYOUT_FIELDS`` of a layout: host ints, no device read."""
    if not isinstance(lay, Layout):
        return (_INVALID,) * len(_LAYOUT_FIELDS)
    return (
        lay.world_size,
        lay.total_tokens,
        len(lay.chunks),
        lay.cu_seqlens_hash,
        lay.local_tokens,
        lay.block_size,
    )


def _scale_code(value, x) -> int:
    """The scale the op uses: ``value``, or its default ``head_dim(x) ** -0.5``."""
    if value is not None:
        return _float_code(value)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] < 1:
        return _INVALID
    return _float_code(x.shape[-1] ** -0.5)


def _op_fields(lay, tensors, top_k, op) -> tuple[int, ...]:
    """This rank's ``_FIELDS["msa_attention"]`` (``op``: the op's keywords): ints, never raising
    (a bad argument becomes ``_INVALID``; the op's own checks then raise with their message)."""
    q_proxy, _, q, _, _ = tensors
    try:  # the resolved value: FLASH_MSA_DETERMINISTIC may differ between the ranks
        det = int(backends.deterministic(op["deterministic"]))
    except TypeError:
        det = _INVALID
    return (
        *_layout_codes(lay),
        _int_code(top_k),
        _bool_code(op["warmup"]),
        _bool_code(op["compute_kl"]),
        det,
        _str_code(op["selection_precision"]),
        _scale_code(op["softmax_scale"], q),
        _scale_code(op["proxy_scale"], q_proxy),
        *(c for x in tensors for c in _tensor_codes(x)),
    )


def _gather_fields(lay, x) -> tuple[int, ...]:
    """This rank's ``_FIELDS["gather"]`` for a shard ``x`` (valid: checked before)."""
    rest = x.shape[len(lay.local_shape) :]
    grad = torch.is_grad_enabled() and x.requires_grad
    return (*_layout_codes(lay), _str_code(str(x.dtype)), len(rest), rest.numel(), int(grad))


def _message_codes(error) -> list[int]:
    """``"Type: message"`` of ``error`` (``None``: empty) as ``_MESSAGE_BYTES // 8`` int64s."""
    data = b"" if error is None else f"{type(error).__name__}: {error}".encode()
    if len(data) > _MESSAGE_BYTES:
        data = data[: _MESSAGE_BYTES - 3] + b"..."
    data = data.ljust(_MESSAGE_BYTES, b"\0")
    return list(struct.unpack(f"<{_MESSAGE_BYTES // 8}q", data))


def _message_text(codes) -> str:
    data = struct.pack(f"<{len(codes)}q", *codes).rstrip(b"\0")
    return data.decode("utf-8", "ignore")  # a character cut by the truncation is dropped


def _fingerprint(call, fields, error=None) -> list[int]:
    """This rank's ``_LENGTH`` int64s (see above); ``error``: the exception it raises."""
    values = [0] * _MAX_FIELDS
    if error is None:
        # a Python int past int64 (top_k=10**30) is no value the op accepts
        values[: len(fields)] = [v if _INT64[0] <= v <= _INT64[1] else _INVALID for v in fields]
    header = [_FORMAT, _CALLS.index(call) + 1, int(error is not None)]
    return header + values + _message_codes(error)


_DTYPE_NAMES = {
    _str_code(str(d)): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_PRECISION_NAMES = {_str_code(p): repr(p) for p in quant.PRECISIONS}


def _show(kind, value) -> str:
    """One field's value as a message prints it."""
    if value == _INVALID and kind != "int":
        return "an unreadable value"
    if kind == "bool":
        return str(bool(value))
    if kind == "float":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if kind == "hash":
        return f"hash {value:#018x}"
    if kind == "dtype":
        return _DTYPE_NAMES.get(value, f"dtype hash {value:#x}")
    if kind == "precision":
        return _PRECISION_NAMES.get(value, f"string hash {value:#x}")
    return str(value)


def _by_value(column, kind) -> str:
    """``"rank 0 has 16, rank 1 has 8"``: the ranks grouped by value, first appearance first."""
    groups = {}
    for rank, value in enumerate(column):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {_join(ranks)} have"
        parts.append(f"{who} {_show(kind, value)}")
    return ", ".join(parts)


def _join(ranks) -> str:
    return ", ".join(map(str, ranks))


def _verdict(call, table) -> str | None:
    """The error text for ``table`` (every rank's fingerprint, rank order; ``(P, _LENGTH)``
    ints), or ``None`` when the ranks agree. A function of the table alone: every rank that
    gathered it derives the same text."""
    if all(row == table[0] for row in table[1:]) and not table[0][2]:
        return None  # the common case, decided without a per-field walk
    where = f"flash_msa.distributed.{call}"
    formats = [row[0] for row in table]
    if len(set(formats)) > 1:
        return f"{where}: ranks pack different fingerprint formats ({_by_value(formats, 'int')})"
    calls = [row[1] for row in table]
    if len(set(calls)) > 1:
        names = [_CALLS[c - 1] if 0 < c <= len(_CALLS) else f"call {c}" for c in calls]
        return f"{where}: ranks are in different calls: " + ", ".join(
            f"rank {r} in {n}" for r, n in enumerate(names)
        )
    rejected = [
        f"rank {r} rejected its arguments: {_message_text(row[_HEADER + _MAX_FIELDS :])}"
        for r, row in enumerate(table)
        if row[2]
    ]
    if rejected:
        return f"{where}: " + "; ".join(rejected)
    differ = []
    for i, (name, kind) in enumerate(_FIELDS[call]):
        column = [row[_HEADER + i] for row in table]
        if len(set(column)) > 1:
            differ.append(f"{name}: {_by_value(column, kind)}")
    if not differ:
        return None
    return (
        f"{where}: ranks disagree on " + "; ".join(differ) + " (every rank of the group must "
        "pass a layout of the same batch and the same shapes, dtypes and arguments)"
    )


def _fingerprint_device(group) -> torch.device:
    """Where the group's backend takes the fingerprint: the host when it has a CPU backend
    (gloo, also in ``"cpu:gloo,cuda:nccl"``: no device synchronization), else the current
    accelerator (NCCL: the current CUDA device)."""
    backend = str(dist.get_backend(group))
    if any(name in backend for name in ("gloo", "mpi", "ucc")):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _all_fingerprints(group, row) -> list[list[int]]:
    """Every rank's fingerprint: one all-gather of ``P * _LENGTH`` int64s, then one read to
    the host (on an accelerator: waits for the work queued before it)."""
    mine = torch.tensor(row, dtype=torch.int64, device=_fingerprint_device(group))
    P = dist.get_world_size(group)
    table = _functional().all_gather_into_tensor(mine, P, _group_name(group))
    return _functional().wait_tensor(table).view(P, _LENGTH).tolist()


class _Agreement:
    """The agreement check of one eager call over ``group``: exactly one fingerprint gather
    per call, before the call's first collective, on every rank.

    Set :attr:`fields` (this rank's ``_FIELDS[call]`` values) once the arguments are read, then
    :meth:`check` gathers and raises the common ValueError on any difference. A rank that
    raises before its check calls :meth:`reject` instead: the same gather with the error flag
    and its message, so that the others raise too rather than wait in the call's collectives.
    """

    def __init__(self, group, call):
        self.group, self.call = group, call
        self.fields = None
        self.done = False  # the gather ran (or was attempted): never a second one per call

    def check(self):
        if self.done:
            return
        self.done = True
        table = _all_fingerprints(self.group, _fingerprint(self.call, self.fields))
        verdict = _verdict(self.call, table)
        if verdict is not None:
            raise ValueError(verdict)

    def reject(self, error):
        """Takes part in the gather for a rank that raises ``error`` (then the caller re-raises
        it); nothing if the gather already ran (the others have passed it)."""
        if self.done:
            return
        self.done = True
        _all_fingerprints(self.group, _fingerprint(self.call, None, error))


def _agreement(group, call) -> _Agreement | None:
    """The check for an eager call; ``None`` under ``torch.compile`` (reading the gathered table
    is a graph break, which ``fullgraph=True`` refuses), while a CUDA graph is being captured
    (the read is a host sync, which capture refuses; the eager step run before capturing
    checked the same call) and without an initialized group (no peers to tell: the call raises
    in :func:`_check_group`)."""
    if torch.compiler.is_compiling() or not (dist.is_available() and dist.is_initialized()):
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return _Agreement(group, call)


# ---------------------------------------------------------------------------------------------
# the collectives
# ---------------------------------------------------------------------------------------------
def _acc_dtype(dtype):
    """Reduce-scatter accumulation dtype: fp32 (fp64 for fp64 gradients)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _functional():
    """``torch.ops._c10d_functional``: collectives that return their output (asynchronous until
    ``wait_tensor``) and that Dynamo traces; the same ops in eager and compiled code."""
    return torch.ops._c10d_functional


class WaitTimer:
    """How long this rank waited for the collectives of :func:`msa_attention` (and
    :func:`gather`): their time not overlapped with compute.

    Pass one as ``timer=`` (eager only) and read :meth:`times_ms` after the step. Each wait is
    bracketed on CUDA by two timing events on the current stream (the stream's stall on the
    collective; no host synchronization), on CPU by the host clock (gloo's wait blocks the
    host). Names: ``k_proxy``, ``k``, ``v`` (forward all-gathers), ``dk_proxy``, ``dk``, ``dv``
    (backward reduce-scatters); ``all_gather`` / ``reduce_scatter`` for :func:`gather`.

    A wait also lasts while a slower rank has not yet joined the collective: on one rank the
    time includes the group's load imbalance (a wait long on one rank and short on the others),
    so the smallest rank's total is the closer bound on the transfer left unhidden.
    """

    def __init__(self):
        self.spans = []  # (name, start, end): CUDA events, or perf_counter seconds on CPU

    def wait(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``wait_tensor(x)``, timed as ``name``."""
        if x.is_cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            x = _functional().wait_tensor(x)
            end.record()
        else:
            start = time.perf_counter()
            x = _functional().wait_tensor(x)
            end = time.perf_counter()
        self.spans.append((name, start, end))
        return x

    def times_ms(self) -> dict[str, float]:
        """Milliseconds waited per name, summed over the spans since :meth:`reset` (CUDA: waits
        for the last event, i.e. call it after the step)."""
        out = {}
        for name, start, end in self.spans:
            if isinstance(start, torch.cuda.Event):
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = 1e3 * (end - start)
            out[name] = out.get(name, 0.0) + ms
        return out

    def reset(self):
        self.spans.clear()


@dataclass(frozen=True, eq=False)
class _KeyGather:
    """:class:`flash_msa.api.KeyGather` over a CP group (see its protocol).

    ``launch``: an all-gather of the shard into a rank-major ``(P * Tl, ...)`` buffer;
    ``finish``: its wait, then ``index_select(gather_index)``, which drops the padding and
    restores the global packed order. ``scatter``: each global ``(T, ...)`` gradient is put into
    a zeroed ``(P * Tl, ...)`` buffer in fp32 (fp64 for fp64), reduce-scattered (SUM) back to
    ``(Tl, ...)`` and cast to its dtype; all launched before the first wait; a ``None`` gradient
    skips its collective (the same on every rank: the condition is the loss's structure, not
    data). ``agreement`` (eager only): the first ``launch`` runs its check, so the ranks compare
    their calls after the op's own argument checks and before its first collective. Frozen:
    Dynamo traces the methods (they change nothing but ``timer`` and ``agreement``, both
    eager only).
    """

    gather_index: torch.Tensor  # layout.gather_index
    world_size: int  # P
    local_tokens: int  # Tl
    total_tokens: int  # T
    group_name: str
    overlap: bool = True
    timer: WaitTimer | None = None
    agreement: _Agreement | None = None

    def _wait(self, x, name):
        if self.timer is not None:
            return self.timer.wait(x, name)
        return _functional().wait_tensor(x)

    def launch(self, x, name):
        if self.agreement is not None:  # once per call: check() returns at once after the first
            self.agreement.check()
        return _functional().all_gather_into_tensor(
            x.contiguous(), self.world_size, self.group_name
        )

    def finish(self, pending, name):
        return self._wait(pending, name).index_select(0, self.gather_index)

    def scatter(self, grads, names):
        P, Tl = self.world_size, self.local_tokens
        pending = []
        for g in grads:
            if g is None:
                pending.append(None)
                continue
            full = g.new_zeros((P * Tl, *g.shape[1:]), dtype=_acc_dtype(g.dtype))
            full = full.index_copy(0, self.gather_index, g.to(full.dtype))
            pending.append(_functional().reduce_scatter_tensor(full, "sum", P, self.group_name))
        return tuple(
            None if p is None else self._wait(p, n).to(g.dtype)
            for p, n, g in zip(pending, names, grads)
        )


def _group_name(group) -> str:
    return (dist.group.WORLD if group is None else group).group_name


def _key_gather(lay, group, overlap=True, timer=None, agreement=None) -> _KeyGather:
    return _KeyGather(
        gather_index=lay.gather_index,
        world_size=lay.world_size,
        local_tokens=lay.local_tokens,
        total_tokens=lay.total_tokens,
        group_name=_group_name(group),
        overlap=overlap,
        timer=timer,
        agreement=agreement,
    )


class _GatherFunction(torch.autograd.Function):
    """All-gather of local shards into the global packed order (:func:`gather`); backward:
    reduce-scatter, both through a :class:`_KeyGather` ``keys`` (all gathers launched before the
    first wait)."""

    @staticmethod
    def forward(ctx, keys, *xs):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no collective
        ctx.keys, ctx.n = keys, len(xs)
        pending = [keys.launch(x, "all_gather") for x in xs]
        return tuple(keys.finish(p, "all_gather") for p in pending)

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad[1:]
        grads = tuple(g if n else None for g, n in zip(grads, need))
        return (None, *ctx.keys.scatter(grads, ("reduce_scatter",) * ctx.n))


def _check_group(group, lay):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_msa.distributed needs an initialized torch.distributed group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != lay.world_size or rank != lay.rank:
        raise ValueError(
            f"the layout is for rank {lay.rank} of {lay.world_size} but this process is rank "
            f"{rank} of {size} in the group"
        )


def _check_timer(timer):
    if timer is None:
        return
    if not isinstance(timer, WaitTimer):
        raise TypeError(
            f"timer must be a flash_msa.distributed.WaitTimer, got {type(timer).__name__}"
        )
    if torch.compiler.is_compiling():
        raise ValueError(
            "timer is eager only (it records events at each wait): pass None under torch.compile"
        )


def gather(x: torch.Tensor, layout: Layout, group=None, *, timer=None) -> torch.Tensor:
    """The global tensor from every rank's shard: a differentiable all-gather over ``group``.

    Args:
        x: this rank's shard, ``(Tl, ...)`` or ``(B, Tl // B, ...)``.
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).
        timer: a :class:`WaitTimer` that times the waits (eager only), or ``None``.
    Returns:
        ``(T, ...)`` or ``(B, S, ...)`` in the global order, padding dropped. Its gradient is
        reduce-scattered back (summed over the ranks in fp32), so every rank gets the gradient
        of its own tokens with every rank's contribution.

    Eager calls first check that the ranks agree (the layout's batch, ``x``'s dtype, elements
    per token and ``requires_grad``): see :func:`msa_attention`.
    """
    agreement = _agreement(group, "gather")
    try:
        flat = _gather_checks(x, layout, group, timer)
        if agreement is not None:
            agreement.fields = _gather_fields(layout, x)
            agreement.check()
    except Exception as e:
        if agreement is not None:
            agreement.reject(e)  # the peers raise too instead of waiting in the all-gather
        raise
    (out,) = _GatherFunction.apply(_key_gather(layout, group, timer=timer), flat)
    return out.view(*layout.global_shape, *out.shape[1:])


def _gather_checks(x, layout, group, timer) -> torch.Tensor:
    """:func:`gather`'s local checks; ``x`` as ``(Tl, ...)``."""
    _check_layout(layout)
    _check_timer(timer)
    _check_group(group, layout)
    return _flat(x, layout.local_shape, "x", "this rank's shard")


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def msa_attention(
    q_proxy,
    k_proxy,
    q,
    k,
    v,
    top_k,
    *,
    layout,
    group=None,
    softmax_scale=None,
    proxy_scale=None,
    warmup=False,
    compute_kl=True,
    deterministic=None,
    overlap=True,
    timer=None,
    selection_precision="bf16",
    causal=True,
):
    """:func:`flash_msa.msa_attention` over a context-parallel group, on this rank's shards.

    Every rank calls it with its shards (:func:`shard`, ``layout`` from :func:`layout`); all
    ranks must pass the same shapes and arguments (it runs collectives). An eager call checks
    that they do before its first collective: one all-gather of a small int64 fingerprint per
    rank (the layout's batch and ``Tl``, the five inputs' dtypes, heads, head dims and
    ``requires_grad``, ``top_k``, ``warmup``, ``compute_kl``, ``deterministic``, the scales,
    ``selection_precision``), after which every rank raises the same ``ValueError`` naming each
    field that differs, or, when a rank's own argument checks raised, that rank raises its error
    and the others a ``ValueError`` quoting it (none waits for it in a collective). Not under
    ``torch.compile`` (docs/distributed.md, "Agreement").

    Shapes (``Tl = layout.local_tokens``; batch-form layouts take ``(B, Tl // B, heads, dim)``):
    ``q_proxy (Tl, Hp, Dp)``, ``k_proxy (Tl, Hpk, Dp)``, ``q (Tl, H, D)``,
    ``k``, ``v`` ``(Tl, Hkv, D)``; head rules as in :func:`flash_msa.msa_attention`.

    Args:
        top_k, softmax_scale, proxy_scale, warmup, compute_kl, deterministic: as in
            :func:`flash_msa.msa_attention`; the block size is ``layout.block_size``.
            ``deterministic`` covers this rank's op; the sums inside the collectives (the fp32
            reduce-scatter of the key gradients) are ordered by the process group's backend.
        selection_precision: as in :func:`flash_msa.msa_attention` (``"fp8"``: e4m3 selection;
            the key scales are those of the gathered keys, so every rank ranks like the
            single-process op).
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).
        overlap: ``True`` (default) waits for the ``k``/``v`` all-gathers after the selection
            (they overlap it); ``False`` waits for them before it, as a baseline for
            measurements (the same result).
        timer: a :class:`WaitTimer` that times each wait for a collective (the time not
            overlapped), or ``None``; eager only.
        causal: as in :func:`flash_msa.msa_attention` (``True``; ``False`` raises).

    Works under ``torch.compile(fullgraph=True)`` (the collectives are functional ones, the
    backends' ops the ``flash_msa::`` custom ops with the query map).

    Returns:
        ``(out, kl)``: ``out`` like ``q``, this rank's rows of the single-process output (0 on
        padding rows); ``kl`` this rank's share of the single-process KL (its rows' terms over
        the global ``Hp * T`` rows; 0-dim fp32, fp64 for fp64 inputs). ``all_reduce(kl)`` (SUM)
        over the group is the single-process ``kl``; gradients: docs/distributed.md.
    """
    api._causal_arg(causal)  # (the same on every rank: a constant of the call)
    kw = dict(
        top_k=top_k,
        softmax_scale=softmax_scale,
        proxy_scale=proxy_scale,
        warmup=warmup,
        compute_kl=compute_kl,
        deterministic=deterministic,
        overlap=overlap,
        timer=timer,
        selection_precision=selection_precision,
    )
    tensors = (q_proxy, k_proxy, q, k, v)
    if torch.compiler.is_compiling():  # no agreement check (see _agreement)
        out, kl = _msa(tensors, layout, group, None, **kw)
    else:
        agreement = _agreement(group, "msa_attention")
        try:
            out, kl = _msa(tensors, layout, group, agreement, **kw)
        except Exception as e:
            if agreement is not None:
                # raised before the check (this module's or the op's argument checks, backend
                # resolution): the peers raise too instead of waiting in the op's all-gathers
                agreement.reject(e)
            raise
    # the op's kl is a mean over this rank's Hp * Tl rows (padding rows add 0): rescale to the
    # share of the global Hp * T rows (a host constant: no sync)
    kl = kl * (layout.local_tokens / layout.total_tokens)
    return out.view(q.shape), kl


def _msa(tensors, layout, group, agreement, *, overlap, timer, top_k, **op):
    """:func:`msa_attention` before the KL rescale: its local checks, then the op, whose key
    gather runs ``agreement``'s check (if any) just before its first collective, i.e. after the
    op's own argument checks: a rank that fails those never reaches the check and rejects."""
    _check_layout(layout)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__} {overlap!r}")
    _check_timer(timer)
    _check_group(group, layout)
    where = "this rank's shard of the layout"
    flat = [_flat(x, layout.local_shape, n, where) for x, n in zip(tensors, _INPUT_NAMES)]
    if layout.q_map.device != flat[2].device:
        raise ValueError(
            f"the layout's tensors are on {layout.q_map.device} but q is on {flat[2].device}; "
            "build the layout with device=q.device"
        )
    if agreement is not None:
        agreement.fields = _op_fields(layout, tensors, top_k, op)
    # the op gathers the keys itself (its key_gather hook), so that it can wait for k and v only
    # after its selection
    return api._msa_attention(
        *flat,
        top_k,
        block_size=layout.block_size,
        cu_seqlens=layout.cu_seqlens,
        max_seqlen=layout.max_seqlen,
        q_map=layout.q_map,
        key_gather=_key_gather(layout, group, overlap, timer, agreement),
        **op,
    )
