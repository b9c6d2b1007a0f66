"""The selection kernel's selector warpgroup (``SelectSm90``) without a GPU.

The kernel keeps the top-k lists in a fourth warpgroup (one row per thread), fed the block
maxima by the two consumer warpgroups through a shared-memory ring of ``SelectSm90.RING_SLOTS``
slots with a full and an empty mbarrier per slot (the accounting: ``select_sm90``'s module
docstring, "Selector warpgroup"). Checked here:

- the ring's phase accounting replayed on a model of the hardware mbarrier (arrival count,
  phase, ``try_wait.parity``) over random interleavings of the 8 consumer warps and the 4
  selector warps, with the kernel's own slot and parity functions: no deadlock, every tile's
  values read by the selector exactly once and in order (a slot overwritten before it was
  read would show a later tile's value), nothing pending at the end; and the model fails
  each of three mutated parities (so it can catch an error);
- the register split (``setmaxnreg``) sums to the register file at every top_k and leaves the
  selector its list; ``can_implement``'s shared-memory refusals (the ring beside the key
  stages) and the shared-memory arithmetic;
- compiled for sm_90a: spill-free, ``setmaxnreg`` kept with the split's counts, wgmmas not
  serialized, 512 threads, and the PTX's ``mbarrier.init`` counts: 1 (query tile), per key
  stage, 1 (full: the producer's arrive with its byte count) and 8 (empty: one per consumer
  warp), per ring slot 8 (full: consumer warps) and 4 (empty: selector warps), at the ring's
  offsets in the shared storage.

On the GPU the kernel is checked by tests/ops/test_fwd.py and tests/ops/test_select_fp8.py
(against the reference and the Triton kernels; their cases include the ring's: block 64's two
slabs, top_k 64, sequences of 1 and 129 tokens, 70 key tiles, the shallowest and deepest
pipelines that fit).

The selection's top-k insertion (``SelectSm90.offer_row``) replayed on the CPU.

The kernel inserts a block's maximum into its selector thread's descending top-k list (one row's
whole list per thread) by a rank update, ``v'[t] = v[t-1] if gt[t-1] else (c if gt[t] else v[t])``
with ``gt[t] = shift | (c > v[t])``, behind a warp vote, and reduces the quad's block maxima by
exchanging rows (``quad_exchange_max``). A sequential insertion (a swap carried through the list;
slower on the H200: ``select_sm90``'s module docstring) serves here as the oracle
(:func:`offer_chain`): the rule stated step by step. Both are pure arithmetic on float32 values, so
these tests replay them in torch, batched over many independent rows, exactly as the kernel executes
them per thread, and require the same lists after every offer, ties included: random values on a few
levels (many ties), ``-inf`` blocks (never entering), the own block's ``+inf`` anywhere (first
included), ``top_k`` 1..64. (The selector warpgroup holds a row's list in one thread, so the replay
has one lane per list.) The kernel's PTX is checked by ``python -m flash_msa.cute.compile_check
select``. CPU time ~7 s on this 2-core machine (``--durations``: 40 tests, the slowest 0.65 s).
"""

from __future__ import annotations

import random
import re

import cutlass  # noqa: E402
import pytest
import torch

from flash_msa.cute import compile_check, select_sm90, selection  # noqa: E402
from flash_msa.cute.select_sm90 import SelectSm90  # noqa: E402

pytest.importorskip("cutlass")


# ---------------------------------------------------------------------------------------------
# the ring's accounting on a model of the mbarrier
# ---------------------------------------------------------------------------------------------
CONSUMER_WARPS = 8
SELECTOR_WARPS = 4


class Mbarrier:
    """``mbarrier.init(count)``, ``arrive`` (one arrival) and ``try_wait.parity``: a phase
    completes when ``count`` arrivals have come, and a wait on parity ``P`` passes once the
    current phase's parity differs from ``P`` (the phase of that parity has completed; a fresh
    barrier passes parity 1, the "previous" phase)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity):
        return (self.phase & 1) != parity


def replay(n_tiles, seed, slot=SelectSm90.ring_slot, full_parity=SelectSm90.ring_full_parity,
           empty_parity=SelectSm90.ring_empty_parity):  # fmt: skip
    """Run the ring's protocol for ``n_tiles`` key tiles under a random interleaving; returns
    ``(ok, why)``. A consumer warp per tile: wait empty[slot] (``empty_parity``), write its
    rows' values (the tile number), arrive on full[slot]; a selector warp per tile: wait
    full[slot] (``full_parity``), read every row of the slot, arrive on empty[slot]."""
    R = SelectSm90.RING_SLOTS
    rng = random.Random(seed)
    full = [Mbarrier(CONSUMER_WARPS) for _ in range(R)]
    empty = [Mbarrier(SELECTOR_WARPS) for _ in range(R)]
    data = [[None] * CONSUMER_WARPS for _ in range(R)]  # slot -> each consumer warp's rows
    # per agent: (kind, warp, next tile, step within the tile)
    agents = [["c", w, 0, 0] for w in range(CONSUMER_WARPS)]
    agents += [["s", w, 0, 0] for w in range(SELECTOR_WARPS)]
    while True:
        live = [a for a in agents if a[2] < n_tiles]
        if not live:
            break
        runnable = []
        for a in live:
            kind, _, j, step = a
            s = slot(j)
            if step == 0:  # the wait
                bar, par = (empty[s], empty_parity(j)) if kind == "c" else (full[s], full_parity(j))
                if bar.passes(par):
                    runnable.append(a)
            else:
                runnable.append(a)
        if not runnable:
            return False, f"deadlock at tiles {[(a[0], a[1], a[2]) for a in live]}"
        a = rng.choice(runnable)
        kind, w, j, step = a
        s = slot(j)
        if step == 0:
            a[3] = 1
        elif kind == "c":  # write, then arrive
            data[s][w] = j
            full[s].arrive()
            a[2], a[3] = j + 1, 0
        else:  # read every row, then arrive
            if data[s] != [j] * CONSUMER_WARPS:
                return False, f"selector warp {w} read {data[s]} for tile {j}"
            empty[s].arrive()
            a[2], a[3] = j + 1, 0
    if any(b.pending != b.count for b in full + empty):
        return False, "arrivals pending at the end"
    return True, ""


@pytest.mark.parametrize("n_tiles", [1, 2, 3, 4, 5, 8, 9, 13])
def test_ring_accounting_has_no_deadlock_and_no_overwrite(n_tiles):
    """The kernel's slot and parity functions over 30 random interleavings per tile count
    (fewer tiles than slots, exactly R, several wraps)."""
    for seed in range(30):
        ok, why = replay(n_tiles, seed)
        assert ok, (seed, why)


def test_ring_model_catches_wrong_parities():
    """Mutants the model must fail: the consumers' empty wait without the "previous phase"
    offset (deadlock on the first tile), the selector's full wait offset by one (it reads a slot
    before it is written: a stale value), and a single-slot ring's parity used with R slots
    (a phase skipped: a slot overwritten before it was read, or a deadlock)."""
    R = SelectSm90.RING_SLOTS
    mutants = {
        "empty without offset": dict(empty_parity=lambda j: (j // R) & 1),
        "full offset": dict(full_parity=lambda j: ((j // R) + 1) & 1),
        "parity of j": dict(full_parity=lambda j: j & 1, empty_parity=lambda j: (j + 1) & 1),
    }
    for name, mutant in mutants.items():
        results = [replay(9, seed, **mutant)[0] for seed in range(30)]
        assert not all(results), name


def test_ring_slot_and_parities_are_the_kernels_formulas():
    """Slot ``j mod R``, the full barrier's phase ``j div R`` and the empty barrier's the one
    before it (R = 4: a shift and a mask in the kernel)."""
    R = SelectSm90.RING_SLOTS
    assert R == 1 << SelectSm90.RING_SHIFT
    for j in range(40):
        assert SelectSm90.ring_slot(j) == j % R
        assert SelectSm90.ring_full_parity(j) == (j // R) % 2
        assert SelectSm90.ring_empty_parity(j) == (j // R - 1) % 2


# ---------------------------------------------------------------------------------------------
# registers, shared memory, refusals
# ---------------------------------------------------------------------------------------------
def test_register_split_fills_the_file_and_holds_the_list():
    assert SelectSm90.THREADS == 512
    for top_k in range(1, 65):
        r = SelectSm90.register_split(top_k)
        assert r["threads"] == 512 and r["launch"] == 128
        counts = (r["producer"], r["consumer"], r["selector"])
        assert all(c % 8 == 0 and 24 <= c <= 256 for c in counts), (top_k, r)
        used = 128 * (r["producer"] + 2 * r["consumer"] + r["selector"])
        assert 65536 - 2048 < used <= 65536, (top_k, r)  # within 8 registers of the consumers
        assert r["selector"] >= 2 * top_k + 24, (top_k, r)  # the list and its temporaries
        assert r["consumer"] >= 160, (top_k, r)  # the accumulator (64) and ~50 more
    assert SelectSm90.register_split(16)["consumer"] == 216
    assert SelectSm90.register_split(16)["selector"] == 56
    assert SelectSm90.register_split(64)["consumer"] == 168
    assert SelectSm90.register_split(64)["selector"] == 152


def test_shared_memory_with_the_ring_and_refusals():
    """The ring's bytes after the key stages (the struct rounded up to 1024) and the deepest
    pipelines that fit beside it at Dp 128: bf16 5 stages, fp8 12 (the numbers of
    ``can_implement``'s docstring)."""
    bf16, e4m3 = cutlass.BFloat16, cutlass.Float8E4M3FN
    sb = SelectSm90.shared_bytes
    assert sb(1, 128, 8, 128)["total"] == 151552  # 148,480 + 64 + 2048, rounded up to 1024
    assert sb(1, 128, 8, 64)["total"] == 153600  # + 64 + 4096
    assert sb(1, 128, 8, 64)["ring"] == 4 * 4 * 2 * 128
    assert sb(1, 128, 8, 128)["ring"] == 4 * 4 * 1 * 128
    assert sb(2, 128, 4, 128)["total"] == 167936
    assert sb(2, 128, 4, 64)["total"] == 169984
    ci = SelectSm90.can_implement
    assert ci(e4m3, 128, 4, 1, 64, 64, 12, "block") is None  # 219,136 bytes
    why = ci(e4m3, 128, 4, 1, 16, 128, 13, "block")
    assert why is not None and "shared memory" in why and "233472" in why
    assert ci(bf16, 128, 4, 1, 16, 64, 5) is None  # 202,752 bytes
    why = ci(bf16, 128, 4, 1, 16, 128, 6)
    assert why is not None and "shared memory" in why and "233472" in why
    assert why.startswith("stages=6:"), why  # the error names the argument to change
    with pytest.raises(ValueError, match="stages=6: .* shared memory"):
        SelectSm90(bf16, 128, 4, 1, 16, 128, 6)
    # every mode has the ring: the query map, both key scales, top_k 1..64
    SelectSm90(bf16, 64, 4, 1, 64, 64, qmap=True)
    SelectSm90(e4m3, 128, 4, 1, 1, 128, 8, key_scale="token")


def test_tensor_count_is_the_host_launch_tensor_list():
    """The kernel's own count of its launch's tensors (its ``__call__`` asserts its views hold
    that many) is the length of the host's list of them, in every mode."""
    bf16, e4m3 = cutlass.BFloat16, cutlass.Float8E4M3FN
    for kernel, count in (
        (SelectSm90(bf16, 128, 4, 1, 16, 128), 4),
        (SelectSm90(bf16, 128, 4, 1, 16, 128, qmap=True), 7),
        (SelectSm90(e4m3, 128, 4, 1, 16, 128, 8, key_scale="block"), 5),
    ):
        assert kernel.tensor_count == len(selection.launch_tensor_names(kernel)) == count


# ---------------------------------------------------------------------------------------------
# compiled (sm_90a, no GPU)
# ---------------------------------------------------------------------------------------------
def _compile(tmp_path, name, *cfg, **kw):
    res = compile_check.compile_select(*cfg, dump=str(tmp_path), name=name, **kw)
    return res, (tmp_path / f"{name}.ptx").read_text()


def _inits(ptx):
    """``(offset, count)`` of every ``mbarrier.init`` in the PTX: the shared storage's byte
    offset of the barrier (0 without one) and its count (an immediate, or the value a ``mov``
    put into the register)."""
    movs = dict(re.findall(r"mov\.(?:u|b|s)32\s+(%r\d+), (\d+);", ptx))
    out = []
    init = r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[([^\]]+)\],\s*([^;]+);"
    for addr, cnt in re.findall(init, ptx):
        m = re.search(r"\+(\d+)$", addr.strip())
        cnt = cnt.strip()
        out.append((int(m.group(1)) if m else 0, int(movs.get(cnt, cnt))))
    return sorted(out)


CONFIGS = [  # (name, dtype, Dp, Hp, Hpk, top_k, block, qmap, key_scale)
    ("e4m3_k16_b128", "e4m3", 128, 4, 1, 16, 128, False, "block"),
    ("bf16_k64_b64", "bf16", 128, 4, 1, 64, 64, False, None),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c[0])
def test_selector_compiles_spill_free_with_its_barriers(cfg, tmp_path):
    name, dt, Dp, Hp, Hpk, K, block, qmap, scale = cfg
    res, ptx = _compile(tmp_path, name, dt, Dp, Hp, Hpk, K, block, qmap, scale)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert res["setmaxnreg_kept"] and not res["wgmma_serialized"], res
    assert res["reg"] == 128, res  # the launch's: 65536 / 512
    split = SelectSm90.register_split(K)
    assert ".reqntid 512, 1, 1" in ptx
    dec = sorted(int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx))
    inc = sorted(int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx))
    want_dec = sorted([split["producer"]] + [split["selector"]] * (split["selector"] < 128))
    want_inc = sorted([split["consumer"]] + [split["selector"]] * (split["selector"] > 128))
    assert (dec, inc) == (want_dec, want_inc), ptx.count("setmaxnreg")
    stages = select_sm90.FP8_STAGES if scale else SelectSm90.stages
    sizes = SelectSm90.shared_bytes(1 if scale else 2, Dp, stages, block)
    R = SelectSm90.RING_SLOTS
    ring = sizes["k_mbar"] + sizes["q_mbar"]  # the ring's barriers: after the tiles
    ring = -(-ring // 1024) * 1024 + sizes["sQ"]
    ring = -(-ring // 1024) * 1024 + sizes["sK"]
    inits = _inits(ptx)
    want = [(8 * s, 1) for s in range(stages)] + [(8 * (stages + s), 8) for s in range(stages)]
    want += [(16 * stages, 1)]  # the query tile's
    want += [(ring + 8 * s, 8) for s in range(R)] + [(ring + 8 * (R + s), 4) for s in range(R)]
    assert sorted(c for _, c in inits) == sorted(c for _, c in want), inits
    ring_inits = [x for x in inits if x[0] >= ring]
    assert ring_inits == sorted(want[-2 * R :]), (ring, ring_inits)


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
