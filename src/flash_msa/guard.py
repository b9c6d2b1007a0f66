"""Device-side guards for varlen metadata that the host does not read.

On GPU tensors (and under ``torch.compile``) the API cannot read ``cu_seqlens``, ``q_map`` or a
caller's ``indices`` without a host synchronization, so their values reach the backends
unchecked. The kernels trust them: an offset past the tensor is an out-of-bounds access, a
sequence longer than ``max_seqlen`` leaves rows that no program covers. This module turns any
such metadata into metadata the kernels can run safely, with a few small torch ops on the
device (no host synchronization, CUDA-graph capturable, traceable), and says which rows the
rewrite made meaningless, so that the API returns them as NaN:

- :func:`sequences`: a ``cu_seqlens`` that starts at 0, is non-decreasing, ends at or before the
  row count and has no sequence longer than ``max_seqlen``, equal to the given one wherever the
  given one is well formed. A sequence whose two offsets survive unchanged keeps its rows; every
  other row (a changed sequence's, or one past the last offset) is flagged.
- :func:`indices`: a caller's block lists with every ill-formed row (an entry outside ``[-1,
  blocks of the row's sequence)``, a ``-1`` before a block, blocks not strictly ascending)
  replaced by an empty one, flagged.
- :func:`query_map`: a query map whose entries outside ``[-1, key tokens)``, or on a flagged key
  row, become padding rows, flagged.

The rule the API states: rows that bad metadata makes meaningless come out NaN (``out``, and a
NaN ``kl`` when any row is flagged; their tokens' gradients are unspecified, NaN or 0); the
other rows and their gradients are exact. With ``FLASH_MSA_DEBUG=1``,
:func:`assert_ok` raises on the device instead (``torch._assert_async``: an asynchronous CUDA
error in eager, an assertion in the compiled graph). The host checks (CPU tensors, and
``FLASH_MSA_DEBUG=1`` in eager) refuse such metadata before anything runs; these guards are for
the calls those checks cannot see.

Cost: O(N + T log N) for :func:`sequences` and O(T * heads * top_k) for :func:`indices`, plus
the API's one in-place pass over ``out`` to poison flagged rows; batch-form calls build their own
``cu_seqlens`` and skip its guard (``sparse_attention``'s index guard still runs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Sequences(NamedTuple):
    """``cu``: int32 ``(N+1,)``, safe for every kernel; ``row_ok``: bool ``(T,)``, rows whose
    sequence is the caller's; ``seq``: int64 ``(T,)``, each row's sequence in ``cu`` (``N`` for
    rows past ``cu[-1]``); ``ok``: bool 0-dim, every row kept."""

    cu: torch.Tensor
    row_ok: torch.Tensor
    seq: torch.Tensor
    ok: torch.Tensor


def sequences(cu_seqlens: torch.Tensor, max_seqlen, total: int) -> Sequences:
    """Safe offsets for ``cu_seqlens`` (int32 ``(N+1,)``) over ``total`` rows, no sequence
    longer than ``max_seqlen``.

    The safe offsets are ``s[0] = 0``, ``s[j+1] = min(c[j+1], s[j] + max_seqlen)`` with ``c`` the
    given offsets clamped to ``[0, total]`` and made non-decreasing (a running maximum). The
    recurrence unrolls to ``s[j] = min over i <= j of (c[i] + (j - i) * max_seqlen)``, a running
    minimum of ``c[i] - i * max_seqlen``: no loop over sequences. For well-formed offsets
    ``s == cu_seqlens``.
    """
    dev = cu_seqlens.device
    given = cu_seqlens.long()
    j = torch.arange(given.numel(), dtype=torch.int64, device=dev)
    c = torch.where(j == 0, 0, given.clamp(0, total))
    c = torch.cummax(c, 0).values
    step = j * max_seqlen
    s = torch.cummin(c - step, 0).values + step
    seq_ok = (s[:-1] == given[:-1]) & (s[1:] == given[1:])
    rows = torch.arange(total, dtype=torch.int64, device=dev)
    # the first sequence whose end is past the row: N for rows at or past s[-1]. (The search
    # over s itself, less one, equals that over s[1:] since s[0] = 0 <= every row; Inductor
    # cannot lower a search whose boundaries are a slice of a computed buffer.)
    seq = torch.searchsorted(s, rows, right=True) - 1
    row_ok = torch.cat([seq_ok, seq_ok.new_zeros(1)])[seq]
    ok = row_ok.all() if total else seq_ok.all()
    return Sequences(s.to(torch.int32), row_ok, seq, ok)


def indices(idx: torch.Tensor, seqs: Sequences, block_size: int):
    """``(safe, head_ok)`` for a caller's int32 ``(T, Hs, K)`` block lists: ``safe`` equals
    ``idx`` on the rows ``head_ok`` (bool ``(T, Hs)``) keeps and is all ``-1`` on the others.
    A row is kept when its sequence is (``seqs.row_ok``) and its list is well formed: entries
    ``-1`` or in ``[0, blocks of the sequence)``, ``-1`` only after the blocks, blocks strictly
    ascending (the rules the host check, ``api._check_indices``, enforces)."""
    s = seqs.cu.long()
    blocks = torch.cat([(s[1:] - s[:-1] + block_size - 1) // block_size, s.new_zeros(1)])
    nb = blocks[seqs.seq][:, None, None]  # (T, 1, 1): the row's blocks, 0 past cu[-1]
    valid = idx >= 0
    # each slot's predecessor (slot 0: a valid -2, below every block): out of place, as
    # Inductor's CPU code generation refuses in-place updates of these slices
    prev = torch.cat([torch.full_like(idx[..., :1], -2), idx[..., :-1]], -1)
    bad = (idx < -1) | (idx >= nb) | (valid & ((prev == -1) | (idx <= prev)))
    head_ok = ~bad.any(-1) & seqs.row_ok[:, None]
    return torch.where(head_ok[..., None], idx, -1), head_ok


def query_map(q_map: torch.Tensor, seqs: Sequences):
    """``(safe, row_ok)`` for an int32 ``(Tq,)`` query map over the keys' rows of ``seqs``:
    an entry outside ``[-1, T)`` or on a key row ``seqs.row_ok`` drops becomes ``-1`` (a padding
    row) and is flagged; given padding rows stay, unflagged."""
    T = seqs.row_ok.numel()
    inside = (q_map >= 0) & (q_map < T)
    key_ok = seqs.row_ok[q_map.long().clamp(0, max(T - 1, 0))] if T else inside
    row_ok = (inside & key_ok) | (q_map == -1)
    return torch.where(inside & key_ok, q_map, -1), row_ok


def poison_(x: torch.Tensor, ok: torch.Tensor) -> None:
    """NaN, in place, on the rows of ``x`` (``(T, heads, ...)``) that ``ok`` (``(T,)``) drops,
    or on the (row, head group) pairs that ``ok`` (``(T, Hs)``, ``heads % Hs == 0``) drops."""
    T, heads = x.shape[:2]
    groups = 1 if ok.dim() == 1 else ok.shape[1]
    view = x.view(T, groups, heads // groups, -1)
    view.masked_fill_(~ok.view(T, groups, 1, 1), float("nan"))


def poison_scalar(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """A 0-dim ``x`` (the KL), NaN unless ``ok``."""
    return torch.where(ok, x, torch.full((), float("nan"), dtype=x.dtype, device=x.device))


def assert_ok(ok: torch.Tensor, what: str) -> None:
    """A device-side assertion that ``ok`` holds (``FLASH_MSA_DEBUG=1``): no host sync in
    eager, an assertion node under ``torch.compile``."""
    torch._assert_async(ok, f"flash_msa: {what} (FLASH_MSA_DEBUG=1 device check)")
