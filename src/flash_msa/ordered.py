"""Deterministic mode: fixed-order reductions in place of fp32 atomics (``Config.deterministic``).

Backend-neutral (Triton kernels without MMAs, portable to any Triton GPU): the Triton backend's
sparse backward and proxy pass and the CuTe backward store their partials in the layouts below
and call :func:`slot_sum` / :func:`item_sum`.

The sparse kernels sum two kinds of contributions with fp32 atomics by default, whose order
(hence the rounding, hence the bits) depends on which program runs first:

- per-row sums: a query row's gradient (dQ, dQ_proxy) arrives from its K kept blocks (K work
  items, each maybe split into ``S = block // BN`` key parts);
- per-key-tile sums: a key block's gradient (dK, dV, dK_proxy) arrives from every work item of
  the lists that kept it (a list longer than ``TW`` tokens is several items; several selection
  heads, or several KV sub-groups of one item, share a key head).

In deterministic mode the kernels store each contribution once, without atomics, into a
partial buffer, and the two kernels here add them in an order fixed by the data alone:

- :func:`slot_sum`: row partials ``(C, heads, K * S, dim)`` (fp32, one writer per (token, head,
  slot, key part)) summed over slots ``0 .. K*S-1`` in order, into the rows of tokens
  ``tok0 .. tok0 + C``;
- :func:`item_sum`: key-tile partials ``(items, RP, block, dim)`` (fp32, one tile per work item
  and per sub-group ``r < RP`` of it) summed per (key head, key block): over the sub-groups
  ``g`` of the key head in order (``g = head * NG + i``, ``i < NG``, item sub-group ``g % RP``
  of selection head ``g // RP``), and for each over the list's items in work-list order (token
  order), then added to the output tile (which holds the earlier chunks' and ranges' sums).

Memory is bounded by :data:`PARTIAL_BYTES` per buffer: the callers run over chunks of query
tokens (row partials of one chunk, each chunk its own work list, as the forward driver does)
and, inside a chunk, over ranges of work items (:func:`item_ranges`, key-tile partials of one
range). Every launch, chunk and range is visited in a fixed order, so the result depends on
the inputs only, whatever the scheduling of the programs.
"""

from __future__ import annotations

import torch

try:  # the package imports without Triton (the torch backend); launching these sums needs it
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None
    jit = lambda fn: fn  # noqa: E731  (never launched: no backend that needs them loads)

# Each partial buffer of deterministic mode stays below 1 GiB: the row partials of one token
# chunk and the key-tile partials of one item range (so at most 2 GiB of partials live at once;
# the forward's own partial buffer, flash_msa.sparse_forward.PARTIAL_BYTES, is 2 GiB).
PARTIAL_BYTES = 1 << 30


def token_chunk(T: int, per_token: int) -> int:
    """Tokens per chunk so that a row partial of ``per_token`` bytes per token stays within
    :data:`PARTIAL_BYTES` (at least 1)."""
    return max(1, min(T, PARTIAL_BYTES // max(1, per_token)))


def item_ranges(num_items: int, per_item: int) -> list[tuple[int, int]]:
    """``[(w0, w1), ...]``: consecutive ranges of a work list's ``num_items`` items (its static
    upper bound) whose key-tile partials of ``per_item`` bytes each fit :data:`PARTIAL_BYTES`.
    Ranges past the last non-empty item cost only a launch of programs that exit at once."""
    step = max(1, PARTIAL_BYTES // max(1, per_item))
    return [(w0, min(num_items, w0 + step)) for w0 in range(0, num_items, step)]


def first_token(wl) -> torch.Tensor:
    """``(1,)`` int64 on the device: the first packed token of work list ``wl``'s chunk
    (``perm`` holds every flat entry of tokens ``tok0 .. tok0 + C``, so its minimum is
    ``tok0 * Hs * K``). For callers that do not know ``tok0`` (the forward driver's KL stage):
    computed on the device, no host synchronization."""
    return (wl.perm.min() // (wl.heads * wl.slots)).reshape(1)


def list_items(wl) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``, int64 ``(Hs * NB,)``: the work items ``first[l] .. last[l]`` (one past)
    of list ``l = p * NB + global block``, empty items excluded. Items are sorted by list
    (worklist.py), the empty ones last; those get a list id past every list here."""
    n = wl.heads * wl.num_blocks
    lists = torch.where(wl.item_end > wl.item_start, wl.item_list.long(), n)
    ids = torch.arange(n, device=lists.device)
    return torch.searchsorted(lists, ids), torch.searchsorted(lists, ids, right=True)


@jit
def _slot_sum_kernel(
    PART,  # [C, HP, K * S, D] fp32 row partials
    IDX,  # [C, Hs, K] int32 indices of the chunk (HAS_IDX), else unused
    TOK0,  # (1,) int64: first token of the chunk
    OUT,  # [T, HO, D]: rows tok0 .. tok0 + C, heads H0 .. H0 + HP
    H0,
    HP: tl.constexpr,
    HO: tl.constexpr,
    G: tl.constexpr,  # OUT heads per index head
    Hs: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    HAS_IDX: tl.constexpr,  # mask unused slots by the index row (else PART is zero there)
    ACCUMULATE: tl.constexpr,  # OUT += sum (else OUT = sum)
):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB] heads of the partial
    m_h = h < HP
    o_d = tl.arange(0, D)
    b_acc = tl.zeros([HB, D], tl.float32)
    for s in range(K * S):  # slot-major, key part minor: the fixed order of the sum
        m = m_h
        if HAS_IDX:
            ids = tl.load(IDX + (c * Hs + (H0 + h) // G) * K + s // S, mask=m_h, other=-1)
            m = m_h & (ids >= 0)
        p_part = PART + ((c * HP + h) * (K * S) + s)[:, None] * D + o_d[None, :]
        b_acc += tl.load(p_part, mask=m[:, None], other=0.0)
    t = tl.load(TOK0) + c
    p_out = OUT + (t * HO + H0 + h)[:, None] * D + o_d[None, :]
    if ACCUMULATE:
        b_acc = tl.load(p_out, mask=m_h[:, None], other=0.0).to(tl.float32) + b_acc
    tl.store(p_out, b_acc.to(OUT.dtype.element_ty), mask=m_h[:, None])


@jit
def _item_sum_kernel(
    PA,
    PB,  # [items, RP, BLOCK, D] fp32 key-tile partials of one item range (PB: with TWO)
    OA,
    OB,  # [T, HO, D] fp32 outputs, accumulated into
    FIRST,
    LAST,  # [Hs * NB] int64: each list's items, relative to the range
    BLK_START,
    BLK_END,
    NB,
    P0,
    P1,  # selection heads [P0, P1) contribute
    HO: tl.constexpr,
    D: tl.constexpr,
    NG: tl.constexpr,  # contributing sub-groups per output head
    RP: tl.constexpr,  # sub-groups (partial tiles) per item
    BLOCK: tl.constexpr,
    RB: tl.constexpr,  # key rows per program
    TWO: tl.constexpr,
):
    gb = tl.program_id(0)
    th = tl.program_id(1)  # output (key) head
    rows = tl.program_id(2) * RB + tl.arange(0, RB)
    kpos = (tl.load(BLK_START + gb) + rows).to(tl.int64)
    m_k = kpos < tl.load(BLK_END + gb)
    o_d = tl.arange(0, D)
    b_a = tl.zeros([RB, D], tl.float32)
    b_b = tl.zeros([RB, D], tl.float32)
    # sub-group g = th * NG + i belongs to selection head g // RP: keep those in [P0, P1)
    i0 = tl.maximum(0, P0 * RP - th * NG)
    i1 = tl.minimum(NG, P1 * RP - th * NG)
    n = tl.zeros([], tl.int64)  # items summed
    for i in range(i0, i1):
        g = th * NG + i
        lst = (g // RP) * NB + gb
        w0 = tl.load(FIRST + lst)
        w1 = tl.load(LAST + lst)
        n += w1 - w0
        for w in range(w0, w1):  # the list's items in order (token order)
            off = ((w * RP + g % RP) * BLOCK + rows)[:, None] * D + o_d[None, :]
            b_a += tl.load(PA + off, mask=m_k[:, None], other=0.0)
            if TWO:
                b_b += tl.load(PB + off, mask=m_k[:, None], other=0.0)
    if n > 0:
        p_o = (kpos * HO + th)[:, None] * D + o_d[None, :]
        tl.store(OA + p_o, tl.load(OA + p_o, mask=m_k[:, None]) + b_a, mask=m_k[:, None])
        if TWO:
            tl.store(OB + p_o, tl.load(OB + p_o, mask=m_k[:, None]) + b_b, mask=m_k[:, None])


_RANGE_BOUNDS = dict(FIRST="*i64", LAST="*i64", BLK_START="*i32", BLK_END="*i32", NB="i32")
SIGNATURE = {  # runtime-argument types, for compile checks without a GPU
    "slot_sum": dict(PART="*fp32", IDX="*i32", TOK0="*i64", OUT="*bf16", H0="i32"),
    "item_sum": dict(
        PA="*fp32", PB="*fp32", OA="*fp32", OB="*fp32", **_RANGE_BOUNDS, P0="i32", P1="i32"
    ),
}


def slot_heads(heads: int, dim: int) -> int:
    """Heads per :func:`slot_sum` program: a ``[HB, dim]`` fp32 accumulator of <= 4K values."""
    return max(1, min(triton.next_power_of_2(heads), 4096 // dim))


def item_rows(block: int, dim: int) -> int:
    """Key rows per :func:`item_sum` program: two ``[RB, dim]`` fp32 accumulators of <= 4K
    values each."""
    return max(1, min(block, 4096 // dim))


def slot_sum(part, out, tok0, *, slots, parts, idx=None, group=1, h0=0, accumulate=False):
    """Sum the row partials ``part`` ``(C, HP, slots * parts, dim)`` (fp32) over their slots in
    order into ``out[tok0 + c, h0 + h]`` (``out`` is ``(T, HO, dim)``; ``tok0`` a ``(1,)`` int64
    device tensor). With ``idx`` ``(C, Hs, slots)`` (the chunk's indices; out head ``h`` reads
    index head ``h // group``) unused slots are masked (never written partials); without it,
    ``part`` must hold 0 there. ``accumulate`` adds to ``out`` instead of overwriting it."""
    C, HP, _, dim = part.shape
    HB = slot_heads(HP, dim)
    Hs = idx.shape[1] if idx is not None else 1
    if idx is None:  # an int32 placeholder pointer (the type the compile check names)
        idx = torch.empty(1, dtype=torch.int32, device=part.device)
        has_idx = False
    else:
        has_idx = True
    _slot_sum_kernel[(C, triton.cdiv(HP, HB))](
        part, idx, tok0, out, h0,
        HP=HP, HO=out.shape[1], G=group, Hs=Hs, K=slots, S=parts, D=dim, HB=HB,
        HAS_IDX=has_idx, ACCUMULATE=accumulate, num_warps=4,
    )  # fmt: skip


def item_sum(parts, outs, items, w0, w1, wl, *, groups, per_item, heads=None):
    """Add the key-tile partials ``parts`` (one or two ``(w1 - w0, per_item, block, dim)`` fp32
    buffers: items ``w0 .. w1`` of work list ``wl``) into ``outs`` (as many ``(T, HO, dim)`` fp32
    tensors), per (output head, key block) in the fixed order of the module docstring.

    ``items`` is :func:`list_items` of ``wl``; ``groups`` the contributing sub-groups per output
    head (``NG``); ``heads = (p0, p1)`` keeps the selection heads ``p0 .. p1`` only (default:
    all)."""
    first, last = items
    block, dim = parts[0].shape[2:]
    two = len(parts) == 2
    p0, p1 = heads if heads is not None else (0, wl.heads)
    RB = item_rows(block, dim)
    HO = outs[0].shape[1]
    _item_sum_kernel[(wl.num_blocks, HO, block // RB)](
        parts[0], parts[-1], outs[0], outs[-1],
        first.clamp(w0, w1) - w0, last.clamp(w0, w1) - w0, wl.block_start, wl.block_end,
        wl.num_blocks, p0, p1,
        HO=HO, D=dim, NG=groups, RP=per_item, BLOCK=block, RB=RB, TWO=two, num_warps=4,
    )  # fmt: skip
