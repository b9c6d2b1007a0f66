"""The selection's top-k insertion (``SelectSm90.offer_row``, issue 15) replayed on the CPU.

The kernel inserts a block's maximum into its selector thread's descending top-k list (one
row's whole list per thread) by a rank update,
``v'[t] = v[t-1] if gt[t-1] else (c if gt[t] else v[t])`` with ``gt[t] = shift | (c > v[t])``,
behind a warp vote, and reduces the quad's block maxima by exchanging rows
(``quad_exchange_max``). It replaced a sequential insertion (a swap carried through the list)
after the session-11 H200 A/B (``select_sm90``'s module docstring); that chain lives on here
only, as the oracle (:func:`offer_chain`): the rule stated step by step. Both are pure
arithmetic on float32 values, so these tests replay them in torch, batched over many
independent rows, exactly as the kernel executes them per thread, and require the same
lists after every offer, ties included: random values on a few levels (many ties), ``-inf``
blocks (never entering), the own block's ``+inf`` anywhere (first included), ``top_k`` 1..64.
(Until the fourteenth session the consumer lanes held the lists, split over two lanes beyond
16 entries; the selector warpgroup that replaced them holds a row's list in one thread, so the
replay has one lane per list.) The kernel's PTX is checked by
``python -m flash_msa.cute.compile_check select``.
CPU time ~7 s on this 2-core machine (``--durations``: 40 tests, the slowest 0.65 s).
"""

from __future__ import annotations

import pytest
import torch

INF = float("inf")


def layout(top_k):
    """``(lanes, half)``: threads per list and entries per thread: one selector thread holds
    its row's whole list (``SelectSm90.offer_row``)."""
    return 1, top_k


def empty(rows, lanes, half):
    """Per lane a list of ``half`` entries: ``(values, indices)`` of ``(rows, lanes, half)``,
    filled as the kernel fills them."""
    return (
        torch.full((rows, lanes, half), -INF, dtype=torch.float32),
        torch.full((rows, lanes, half), -1, dtype=torch.int32),
    )


def lane_candidates(v, i, cv, ci):
    """Each lane's ``(c, index, shift)``: the offered block, no shift (one lane per list)."""
    rows, lanes, half = v.shape
    c = cv[:, None].expand(rows, lanes).clone()
    x = torch.full((rows, lanes), ci, dtype=torch.int32)
    return c, x, torch.zeros((rows, lanes), dtype=torch.bool)


def offer_chain(v, i, cv, ci):
    """The oracle: the sequential insertion (the kernel's before the rank update), per lane the
    candidate swapped through the list from the first slot it beats strictly (in place)."""
    _, _, half = v.shape
    c, x, shift = lane_candidates(v, i, cv, ci)
    take = shift | (c > v[:, :, half - 1])  # the lanes that run the loop
    shift = shift.clone()
    for t in range(half):
        swap = take & (shift | (c > v[:, :, t]))
        ov, oi = v[:, :, t].clone(), i[:, :, t].clone()
        v[:, :, t] = torch.where(swap, c, v[:, :, t])
        i[:, :, t] = torch.where(swap, x, i[:, :, t])
        c = torch.where(swap, ov, c)
        x = torch.where(swap, oi, x)
        shift = shift | swap


def offer_rank(v, i, cv, ci, *, vote=True):
    """``SelectSm90.offer_row``: every entry from its own comparison, last entry first, in
    place. ``vote``: as the kernel, skip when no row's lane enters (the replay's rows stand in
    for one warp's); False: every lane runs the update (what a lane does when another lane
    of its warp enters); the result must not depend on it."""
    _, _, half = v.shape
    c, x, shift = lane_candidates(v, i, cv, ci)
    if vote and not bool((shift | (c > v[:, :, half - 1])).any()):
        return
    gt = shift[:, :, None] | (c[:, :, None] > v)
    for t in range(half - 1, -1, -1):
        nv = torch.where(gt[:, :, t], c, v[:, :, t])
        ni = torch.where(gt[:, :, t], x, i[:, :, t])
        if t > 0:
            nv = torch.where(gt[:, :, t - 1], v[:, :, t - 1], nv)
            ni = torch.where(gt[:, :, t - 1], i[:, :, t - 1], ni)
        v[:, :, t], i[:, :, t] = nv, ni


def kept(i, top_k):
    """``SelectSm90.write_row``: the list's first ``top_k`` entries, ascending with -1 last
    (as a set of rows of ``top_k`` int64)."""
    keys = i.reshape(i.shape[0], -1)[:, :top_k].long()
    big = torch.iinfo(torch.int64).max
    keys = torch.where(keys < 0, big, keys).sort(dim=1).values
    return torch.where(keys == big, -1, keys)


def stable_top(scores, top_k):
    """The selection rule from scratch: blocks by score descending, ties by the lower block,
    ``-inf`` never kept; the kept blocks ascending, -1 padded."""
    rows, n = scores.shape
    out = torch.full((rows, top_k), -1, dtype=torch.int64)
    for r in range(rows):
        order = sorted(range(n), key=lambda b: (-scores[r, b].item(), b))
        sel = sorted(b for b in order[:top_k] if scores[r, b] > -INF)
        out[r, : len(sel)] = torch.tensor(sel, dtype=torch.int64)
    return out


def scores_with_ties(rows, blocks, seed, levels=4, p_neg_inf=0.15):
    """``(rows, blocks)`` float32 block maxima on ``levels`` values (many ties) with ``-inf``
    blocks (no visible key) and each row's own block ``+inf`` at a random place (first
    included: rows 0.. of every 8 have it at block 0)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, levels, (rows, blocks), generator=g).float() - 1.5
    s[torch.rand((rows, blocks), generator=g) < p_neg_inf] = -INF
    own = torch.randint(0, blocks, (rows,), generator=g)
    own[::8] = 0
    s[torch.arange(rows), own] = INF
    return s


@pytest.mark.parametrize("top_k", [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64])
@pytest.mark.parametrize("levels", [2, 5, 1000])
def test_rank_insertion_keeps_the_chains_lists(top_k, levels):
    """After every offer the rank insertion's lists (values and indices) equal
    the sequential insertion's, with the vote and without; the written indices equal the
    rule computed from scratch."""
    lanes, half = layout(top_k)
    rows, blocks = 64, 3 * top_k + 5  # more blocks than slots: entries drop out
    s = scores_with_ties(rows, blocks, seed=top_k * 131 + levels, levels=levels)
    chain, rank, always = (empty(rows, lanes, half) for _ in range(3))
    for b in range(blocks):
        offer_chain(*chain, s[:, b], b)
        offer_rank(*rank, s[:, b], b)
        offer_rank(*always, s[:, b], b, vote=False)
        for got in (rank, always):
            assert torch.equal(got[0], chain[0]) and torch.equal(got[1], chain[1]), b
    # the lists are descending (the invariant the rank formula rests on)
    flat = chain[0].reshape(rows, -1)
    assert bool((flat[:, :-1] >= flat[:, 1:]).all())
    assert torch.equal(kept(rank[1], top_k), stable_top(s, top_k))


@pytest.mark.parametrize("top_k", [16, 17, 64])
def test_vote_skip_is_a_no_op_for_lanes_that_do_not_enter(top_k):
    """A thread whose candidate does not enter (not strictly above its last entry) keeps its
    list bit for bit when it runs the update because another thread of its warp entered:
    ``gt`` is all false."""
    lanes, half = layout(top_k)
    rows = 256
    v, i = empty(rows, lanes, half)
    s = scores_with_ties(rows, 4 * top_k, seed=7, levels=3)
    for b in range(s.shape[1]):
        offer_chain(v, i, s[:, b], b)
    # candidates equal to the last entry (a tie: must not enter), below it, or -inf
    last = v.reshape(rows, -1)[:, -1]
    for cv in (last, last - 1, torch.full_like(last, -INF)):
        c, _, shift = lane_candidates(v, i, cv, 10**6)
        assert not bool((shift | (c > v[:, :, half - 1])).any())
        v2, i2 = v.clone(), i.clone()
        offer_rank(v2, i2, cv, 10**6, vote=False)
        assert torch.equal(v2, v) and torch.equal(i2, i)


def quad_butterfly(part):
    """The oracle of the quad reduction (the kernel's before ``quad_exchange_max``): every lane
    of a quad reduces both rows (butterfly 1 then 2) and keeps row ``(lane % 4) // 2``; ``part
    (quads, 4 lanes, 2 rows)``."""
    mx = torch.maximum(part, part[:, [1, 0, 3, 2]])
    mx = torch.maximum(mx, mx[:, [2, 3, 0, 1]])
    return mx[:, torch.arange(4), torch.tensor([0, 0, 1, 1])]


def quad_exchange(part):
    """``quad_exchange_max``: each lane sends the row it does not keep to lane ^ 2 and
    combines what it receives with its own row's, then the row's pair combines (lane ^ 1)."""
    mine = part[:, torch.arange(4), torch.tensor([0, 0, 1, 1])]
    other = part[:, torch.arange(4), torch.tensor([1, 1, 0, 0])]
    mx = torch.maximum(mine, other[:, [2, 3, 0, 1]])
    return torch.maximum(mx, mx[:, [1, 0, 3, 2]])


def test_quad_exchange_reduces_the_same_values():
    """The exchange's per-lane row maximum equals the butterfly's (ties, -inf, zeros of both
    signs: the maximum of the same four values, so the same float; a zero's sign, were it to
    differ, compares equal and cannot change the selection)."""
    g = torch.Generator().manual_seed(3)
    part = torch.randint(-2, 3, (4096, 4, 2), generator=g).float()
    part[torch.rand(part.shape, generator=g) < 0.2] = -INF
    part[torch.rand(part.shape, generator=g) < 0.1] = -0.0
    part = torch.cat([part, torch.randn((4096, 4, 2), generator=g)])
    a, b = quad_exchange(part), quad_butterfly(part)
    assert torch.equal(a, b)
    assert torch.equal(a, part.amax(dim=1)[:, [0, 0, 1, 1]])
