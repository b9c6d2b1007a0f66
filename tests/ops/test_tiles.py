"""The Triton tiles for GPUs with less shared memory per block (sm_80, sm_86/89, sm_120).

GPU tests (``pytest -m gpu``, on an H200: 227 KB per block): ``FLASH_MSA_SMEM_LIMIT`` caps
``tiles.shared_limit`` to another architecture's limit (``tiles.SHARED_LIMITS``: sm_80 163 KB,
sm_86/89/120 99 KB), so ``tiles.pick`` walks the same candidate tables as on that GPU. The kernels
are still compiled for sm_90 (wgmma) there: their shared memory and registers per tile are close to,
not the same as, the ``mma.sync`` build's, so these tests check the small tiles' *results*; whether
they fit and do not spill on those targets is the CI compile check (``compile_check --arch``,
tests/integration/test_compile_check.py; the query-map kernels here). A third GPU test forces the
last entry of every table (what the register limits of the ``mma.sync`` targets may leave) and
checks that it is what ran.

Each case of the first test runs select (sparse), fwd (with the proxy gradient, as training
asks it) and bwd on the Triton backend, sparse and warmup, default and deterministic mode, in
bf16 and fp16, and compares out, lse, proxy_lse, kl and the five gradients of
``testing.training_loss`` (O(1) in all five inputs; ``harness.incoming``) with the reference by
``testing.assert_close`` (``err <= 2 * err(same-dtype reference) + atol``). The selection is
compared as sets (near-ties accepted) and the other ops run on the reference's indices. The
second test does the same under each cap for fp32 inputs and with a query map (``q_map``, the
reference run with the same map), outputs and partial buffers NaN-poisoned, and checks that
every tile chosen fits the cap.

The tests without the ``gpu`` marker run on CPU (~80 s, 2-core machine, empty Triton cache):
the cap's parsing and its place in ``tiles.pick``'s cache key (a fake kernel: no compiler),
the new small tiles under Triton's interpreter (which takes the first candidate: the lists are
cut to the entries tested), also with a query map, and the query-map kernels compiled for
sm_80 and sm_89 (tests/integration/test_compile_check.py's arch test leaves them out).

fp32 inputs under small shared memory: a tile that fits, or a clear refusal.

fp32 inputs take IEEE products (``PREC="ieee"``: no tensor cores) and twice the bytes of bf16
per operand tile. Under sm_120's 99 KB the fp32 dense warmup at D = 128 fits no bf16-sized
entry of ``dense.DENSE_TILES`` for ``_dense_bwd_kernel`` (launched, the smallest, 290 KB, fails
in Triton with ``OutOfResources``). The tables end in fp32 entries (so the bf16/fp16 choices are
those of the earlier entries), and ``tiles.pick`` raises ``flash_msa.BackendError`` before any
launch when nothing fits.

- ``tiles.pick`` on a fake kernel (no compiler, no GPU): the refusal names the kernel, the
  dtype, the head dim, the limit and the smallest need; it is cached; a fitting tile that
  spills is still used.
- The tables as they were before the fp32 entries are prefixes of today's, so the first
  candidate without spills within the limit (what bf16/fp16 take on every target, checked by
  tests/integration/test_compile_check.py) is the same candidate.
- ``compile_check --dtype fp32 --any --shared-only`` for sm_120 (99 KB, as sm_86/89): every
  family of a handful of representative configurations has a candidate within the limit.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flash_msa import BackendError, backends, reference, testing
from flash_msa.problem import Saved
from flash_msa.triton_ref import dense, proxy, selection, sparse_bwd, sparse_fwd, tiles
from harness import check, config, incoming, packed_inputs, poison_new_buffers, references, results

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CAPS = {"sm80": tiles.SHARED_LIMITS[80], "sm120": tiles.SHARED_LIMITS[120]}  # sm_86/89: sm120's
SHAPES = {  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k
    "anchor": ((1100, 0, 300), 16, 2, 4, 1, 128, 128, 128, 16),
    "paper-k64": ((700,), 64, 4, 4, 1, 128, 128, 128, 64),
    "Hs<Hkv-b64": ((900, 65), 8, 4, 2, 1, 64, 64, 64, 8),
}
MODES = {  # warmup, deterministic
    "sparse": (False, False),
    "warmup": (True, False),
    "sparse-det": (False, True),
    "warmup-det": (True, True),
}
# bf16 and fp16 have the same bytes per operand (the same shared memory per tile): each (cap,
# shape) runs both dtypes, each in two of the modes (both dtypes in all modes took 145 s on
# the H200 with -n 8, 49 tests: half of them keep the file near 2 minutes with fp32 and the map)
DTYPE_MODES = [
    (torch.bfloat16, "sparse"),
    (torch.float16, "warmup"),
    (torch.float16, "sparse-det"),
    (torch.bfloat16, "warmup-det"),
]


def _run(
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, warmup, det=False, device="cuda",
    tables=tiles.SHIPPED,
):  # fmt: skip
    """select (sparse only), fwd and bwd of the Triton backend (tile candidates ``tables``)
    against the references."""
    be = backends.load("triton")[0]
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=device, seed=1
    )
    cfg = dataclasses.replace(
        config(max(lengths), D, Dp, b, top_k, warmup=warmup), deterministic=det
    )
    idx = None
    if not warmup:
        mine_idx = be.select(qp, kp, cu, cfg, tables=tables)
        idx = reference.select(qp, kp, cu, cfg)
        bad = testing.selection_mismatch(
            mine_idx.cpu(), idx.cpu(), qp.cpu(), kp.cpu(), b, cfg.proxy_scale, cu.cpu()
        )
        assert bad == 0
    fwd = be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True, tables=tables)
    dout, dkl = incoming(q, Hp, seed=2)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    grads = be.bwd(dout, dkl, saved, cu, cfg, tables=tables)
    check(results(fwd, grads), *references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl))


def _choices(limit):
    """``{(kernel, candidates, *static key): (tile, shared, spills)}`` chosen under ``limit``
    (``tiles.chosen`` keys: kernel, candidates, device, capability, limit, *static key)."""
    used = tiles.usage()
    return {(k[0], k[1], *k[5:]): (t, *used[k]) for k, t in tiles.chosen().items() if k[4] == limit}


@pytest.mark.parametrize(
    ("dtype", "mode"),
    DTYPE_MODES,
    ids=["bf16-sparse", "fp16-warmup", "fp16-sparse-det", "bf16-warmup-det"],
)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("arch", CAPS, ids=CAPS.keys())
@pytest.mark.usefixtures("fresh_tiles")
@pytest.mark.gpu
@needs_gpu
def test_small_shared_memory_tiles_match_reference(arch, shape, dtype, mode, monkeypatch):
    """Uncapped, then capped to ``arch``'s shared memory: every tile chosen under the cap fits
    it without spills, is the uncapped choice where that one fits (the same rule on the same
    list) and a later, smaller candidate where it does not; the results pass the rule."""
    cap = CAPS[arch]
    warmup, det = MODES[mode]
    device_limit = tiles.shared_limit(torch.cuda.current_device())
    assert device_limit > cap, "the device already has this little shared memory"
    monkeypatch.delenv(tiles.SMEM_LIMIT_ENV, raising=False)
    _run(*shape, dtype, warmup, det)  # the device's own choices
    free = _choices(device_limit)
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(cap))
    assert tiles.shared_limit(torch.cuda.current_device()) == cap
    _run(*shape, dtype, warmup, det)
    capped = _choices(cap)
    assert capped.keys() == free.keys(), (capped, free)
    moved = 0
    for key, (tile, shared, spills) in capped.items():
        table = list(key[1])
        assert 0 <= shared <= cap and spills == 0, (key, tile, shared, spills)
        f_tile, f_shared, _ = free[key]
        if f_shared > cap:  # the device's choice does not fit: a later, smaller candidate
            assert table.index(tile) > table.index(f_tile), (key, tile, f_tile)
            moved += 1
        else:
            assert tile == f_tile, (key, tile, f_tile)
    print(f"\n{arch} {mode}: {moved} of {len(capped)} kernels took a smaller tile")


@pytest.mark.usefixtures("fresh_tiles")
@pytest.mark.gpu
@needs_gpu
def test_last_candidates_match_reference():
    """The last entry of every table, forced as the only candidate, ran (``tiles.chosen``) and
    passes the rule on every shape and mode, in bf16."""
    for shape in SHAPES.values():
        for warmup, det in MODES.values():
            _run(*shape, torch.bfloat16, warmup, det, tables=LAST)
    chosen = {}
    for k, t in tiles.chosen().items():
        chosen.setdefault(k[0], set()).add(t)
    assert chosen == _last_tiles(), chosen


# every candidate table reduced to its last entry (the selection's list likewise)
LAST = tiles.Tables(
    fwd=sparse_fwd.FWD_TILES[-1:],
    bwd=sparse_bwd.BWD_TILES[-1:],
    proxy=proxy.PROXY_TILES[-1:],
    dense=dense.DENSE_TILES[-1:],
    dense_fwd=dense.FWD_TILES[-1:],
    select=lambda candidates: candidates[-1:],
)


def _last_tiles():
    """``{kernel name: {tile}}`` that :data:`LAST` leaves on the shapes of SHAPES."""
    sel = {selection.tile_candidates(8, 2, 128, G)[-1] for G in (4, 2)}  # Hp / Hpk of SHAPES
    sel |= {selection.tile_candidates(4, 2, 128, G)[-1] for G in (4, 2)}  # (block 64 tables)
    return {
        "_select_kernel": sel,
        "_fwd_kernel": {LAST.fwd[-1], *sparse_fwd.fwd_tiles(False, LAST.fwd)},  # main, proxy-only
        "_bwd_kernel": {sparse_bwd.BWD_TILES[-1]},
        "_proxy_kernel": {proxy.PROXY_TILES[-1]},
        "_dense_fwd_kernel": {dense.FWD_TILES[-1]},
        "_dense_bwd_kernel": {dense.DENSE_TILES[-1]},
        "_dense_bwd_dq_kernel": {dense.DENSE_TILES[-1]},
        "_dense_proxy_kernel": {dense.DENSE_TILES[-1]},
        "_dense_proxy_dk_kernel": {dense.DENSE_TILES[-1]},
    }


# ---------------------------------------------------------------------------------------------
# fp32 inputs and the query map under the caps
# ---------------------------------------------------------------------------------------------
# One shape and mode per case (the matrix above covers shapes x modes in bf16/fp16): fp32 in
# every mode (its kernels take IEEE fp32 products, ``PREC="ieee"``, and twice the bytes per
# operand tile), the map (``q_map``, context parallelism: select, fwd and bwd; the warmup takes
# none) in all three dtypes, default and deterministic, both kinds of map. The fp32 sparse ops
# at D = 64 only: at the anchor layout's D = 128 every candidate spills (compile_check for sm_90
# on CPU: forward 8-18 KB, backward 5-20 KB), so tiles.pick compiles whole lists (the backward's
# 10 took 355 s on the 2-core CPU machine), minutes of GPU-host time for one test.
EXTRA = {  # dtype, shape (SHAPES), mode (MODES), map: None, "zigzag" or "random"
    "fp32-Hs<Hkv-b64-sparse": (torch.float32, "Hs<Hkv-b64", "sparse", None),
    "fp32-Hs<Hkv-b64-sparse-det": (torch.float32, "Hs<Hkv-b64", "sparse-det", None),
    "fp32-anchor-warmup-det": (torch.float32, "anchor", "warmup-det", None),
    "fp32-Hs<Hkv-b64-warmup": (torch.float32, "Hs<Hkv-b64", "warmup", None),
    "qmap-bf16-anchor-zigzag": (torch.bfloat16, "anchor", "sparse", "zigzag"),
    "qmap-fp16-Hs<Hkv-b64-random-det": (torch.float16, "Hs<Hkv-b64", "sparse-det", "random"),
    "qmap-fp32-Hs<Hkv-b64-zigzag": (torch.float32, "Hs<Hkv-b64", "sparse", "zigzag"),
}
SPARSE_KERNELS = {"_select_kernel", "_fwd_kernel", "_bwd_kernel", "_proxy_kernel"}
WARMUP_KERNELS = {"_dense_fwd_kernel", "_dense_proxy_kernel", "_dense_bwd_kernel"}


@pytest.mark.parametrize("case", EXTRA.values(), ids=EXTRA.keys())
@pytest.mark.parametrize("arch", CAPS, ids=CAPS.keys())
@pytest.mark.usefixtures("fresh_tiles")
@pytest.mark.gpu
@needs_gpu
def test_fp32_and_q_map_under_the_caps_match_reference(arch, case, monkeypatch):
    """Capped to ``arch``'s shared memory, with every ``torch.empty`` output and partial buffer
    NaN-poisoned: the ops of the case pass the rule (mapped: padding rows exact) and every tile
    chosen fits the cap. Spills are asserted away in bf16/fp16 only: the fp32 (IEEE) tiles spill
    on sm_90 itself, uncapped too (compile_check on CPU: the selection at Dp = block = 128 by
    3.4-15 KB in every candidate); ``tiles.pick`` then runs the fitting one with the fewest
    spill bytes, which is what must hold here. The spills are printed."""
    dtype, shape, mode, kind = case
    cap = CAPS[arch]
    warmup, det = MODES[mode]
    assert tiles.shared_limit(torch.cuda.current_device()) > cap
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(cap))
    poison_new_buffers(monkeypatch)
    if kind is None:
        _run(*SHAPES[shape], dtype, warmup, det)
    else:
        _run_mapped(*SHAPES[shape], dtype, det, kind)
    capped = _choices(cap)
    names = {key[0] for key in capped}
    assert names >= (WARMUP_KERNELS if warmup else SPARSE_KERNELS), names
    spilled = {}
    for key, (tile, shared, spills) in capped.items():
        assert 0 <= shared <= cap, (key, tile, shared, spills)
        assert spills == 0 or dtype == torch.float32, (key, tile, shared, spills)
        if spills:
            spilled[key[0]] = max(spills, spilled.get(key[0], 0))
    print(f"\n{arch} {'-'.join(map(str, case[1:]))}: {len(capped)} tiles, spill bytes {spilled}")


def _q_map(kind, lengths, block):
    """``(Tq,)`` int32 query map over the packed tokens of ``lengths``: "zigzag" is rank 1 of the
    2-rank layout of ``flash_msa.distributed`` (chunks 1 and 2 of every sequence, padding rows
    where a chunk passes the sequence's end); "random" a random half of the tokens in a random
    order, one token twice, padding rows between them."""
    from flash_msa import distributed

    cu = testing.cu(lengths)
    if kind == "zigzag":
        return distributed.layout(2, 1, cu_seqlens=cu, block_size=block).q_map.to(torch.int32)
    T = int(cu[-1])
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(T))[: T // 2]
    pad = torch.tensor([-1])
    return torch.cat([rows[:5], rows[:1], pad, rows[5:], pad, pad]).to(torch.int32)


def _local(x, q_map):
    """Row ``i`` of a packed ``(T, ...)`` tensor's query rows is token ``q_map[i]``; padding rows
    hold a value no token has (their results must not depend on it)."""
    y = x[q_map.long().clamp_min(0)].clone()
    y[q_map < 0] = 7.0
    return y


def _run_mapped(
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, det, kind, device="cuda",
    tables=tiles.SHIPPED,
):  # fmt: skip
    """select, fwd (proxy gradient asked) and bwd of the Triton backend with a query map of
    ``kind`` against the reference with the same map: the selection as sets on the mapped rows
    (near-ties accepted) and -1 on padding rows; fwd and bwd on the reference's indices (padding
    rows given a real row's: they must be ignored) by the rule on the mapped rows, padding rows
    exactly 0 / -inf."""
    be = backends.load("triton")[0]
    xs, cu = packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=device, seed=1)
    qp_all, kp, q_all, k, v = xs
    q_map = _q_map(kind, lengths, b).to(device)
    qp, q = _local(qp_all, q_map), _local(q_all, q_map)
    cfg = dataclasses.replace(config(max(lengths), D, Dp, b, top_k), deterministic=det)
    real = q_map >= 0
    mine_idx = be.select(qp, kp, cu, cfg, q_map=q_map, tables=tables)
    idx = reference.select(qp, kp, cu, cfg, q_map=q_map)
    assert (mine_idx[~real] == -1).all() and (idx[~real] == -1).all()
    every = reference.select(qp_all, kp, cu, cfg).cpu()  # every token's row (the map's others)

    def on_tokens(sel):  # the mapped rows at their tokens' rows (what selection_mismatch reads)
        out = every.clone()
        out[q_map[real].long().cpu()] = sel[real].cpu()
        return out

    bad = testing.selection_mismatch(
        on_tokens(mine_idx), on_tokens(idx), qp_all.cpu(), kp.cpu(), b, cfg.proxy_scale, cu.cpu()
    )
    assert bad == 0
    idx[~real] = idx[int(torch.nonzero(real)[0])].clone()
    fwd = be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True, q_map=q_map, tables=tables)
    dout, dkl = incoming(q, Hp, seed=2)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    mine = results(fwd, be.bwd(dout, dkl, saved, cu, cfg, q_map=q_map, tables=tables))
    refs = []
    for exact in (True, False):  # harness.references' pair, with the map
        cast = (lambda x: x.double()) if exact else (lambda x: x)
        qp_, kp_, q_, k_, v_, do_ = (cast(x) for x in (qp, kp, q, k, v, dout))
        f = reference.fwd(q_, k_, v_, idx, cu, cfg, qp_, kp_, upcast=exact, q_map=q_map)
        s = Saved(q_, k_, v_, f.out, f.lse, idx, qp_, kp_, f.proxy_lse)
        refs.append(results(f, reference.bwd(do_, dkl, s, cu, cfg, upcast=exact, q_map=q_map)))
    exact, same = refs
    assert set(mine) == set(exact), (set(mine), set(exact))
    for name in exact:
        m, ex, sm = mine[name], exact[name], same[name]
        if name in ("out", "lse", "proxy_lse", "dq", "dq_proxy"):  # query rows
            want = -torch.inf if name.endswith("lse") else 0.0
            assert (m[~real] == want).all(), f"{name}: padding rows"
            m, ex, sm = m[real], ex[real], sm[real]
        testing.assert_close(name, m, ex, sm)


@pytest.fixture
def fresh_tiles():
    """``tiles.chosen`` / ``usage`` hold this test's choices only."""
    tiles.clear()
    yield
    tiles.clear()


# ---------------------------------------------------------------------------------------------
# CPU: the cap and the cache key (no compiler), the smallest new tiles under the interpreter
# ---------------------------------------------------------------------------------------------
def test_smem_cap_is_validated(monkeypatch):
    """``FLASH_MSA_SMEM_LIMIT``: unset or empty -> no cap; a positive integer (spaces allowed)
    -> that cap; anything else -> ValueError naming the variable."""
    monkeypatch.delenv(tiles.SMEM_LIMIT_ENV, raising=False)
    assert tiles.smem_cap() is None
    for raw, cap in (("", None), (" 101376 ", 101376), ("166912", 166912)):
        monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, raw)
        assert tiles.smem_cap() == cap, raw
    for bad in ("abc", "0", "-5", "1e5", "99KB", "+5"):
        monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=tiles.SMEM_LIMIT_ENV):
            tiles.smem_cap()


def test_pick_takes_the_first_tile_within_the_cap_and_keys_the_cache_by_it(monkeypatch):
    """A fake kernel of three tiles (shared bytes 200 KB, 120 KB, 60 KB; none spills) on a fake
    227 KB device: uncapped the first, capped to sm_80's 163 KB the second, to sm_120's 99 KB
    the third; each limit is its own cache entry (a changed cap chooses again), and a cap above
    the device changes nothing. If no tile fits, BackendError (tests/ops/test_tiles.py: its
    message)."""
    shared = {"A": 200 * 1024, "B": 120 * 1024, "C": 60 * 1024}
    compiled = []
    kernel = SimpleNamespace(
        fn=SimpleNamespace(__name__="fake_kernel"),
        warmup=lambda *a, grid, tile: compiled.append(tile)
        or SimpleNamespace(asm={}, metadata=SimpleNamespace(shared=shared[tile])),
    )  # fmt: skip
    monkeypatch.setattr(tiles, "_chosen", {})
    monkeypatch.setattr(tiles, "_usage", {})
    monkeypatch.setattr(tiles, "_refused", {})
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    monkeypatch.setattr(tiles, "spill_bytes", lambda compiled: 0)
    monkeypatch.setattr(tiles, "_shared_limit", lambda dev: tiles.SHARED_LIMITS[90])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    args = (torch.zeros(1),)

    def pick():
        return tiles.pick(kernel, args, ("A", "B", "C"), lambda t: {"tile": t}, ("cap-test",))

    monkeypatch.delenv(tiles.SMEM_LIMIT_ENV, raising=False)
    assert pick() == "A"
    for cap, tile in ((tiles.SHARED_LIMITS[80], "B"), (tiles.SHARED_LIMITS[120], "C")):
        monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(cap))
        assert pick() == tile
        assert tiles.usage()[next(k for k in tiles.chosen() if k[4] == cap)] == (shared[tile], 0)
    assert sorted(k[4] for k in tiles.chosen()) == sorted(
        [tiles.SHARED_LIMITS[90], tiles.SHARED_LIMITS[80], tiles.SHARED_LIMITS[120]]
    )
    compiled.clear()
    assert pick() == "C" and not compiled  # cached under its limit: nothing compiled again
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(10**9))  # above the device: its own limit
    assert pick() == "A" and not compiled
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, "1024")  # nothing fits: refused before a launch
    with pytest.raises(backends.BackendError, match="fake_kernel fits 1024 bytes"):
        pick()


def test_small_tiles_equal_reference_under_the_interpreter():
    """Under the interpreter ``tiles.pick`` takes the first candidate. With every list cut to
    its last entry (the selection's 64 rows x 8 warps x 1 stage, BT = 64 / G tokens; the
    forward's 32 rows x 4 warps; the fp32 entries: the proxy pass's 64 x 16 keys, the warmup's
    64 x 16 tile without pipelining), then with the proxy passes' 256-row entries (R = 1),
    sparse and warmup equal the reference (fp16: the interpreter's bf16 is wrong)."""
    case = ((100, 1, 40), 8, 2, 4, 1, 16, 16, 64, 2)
    for warmup in (False, True):
        _run(*case, torch.float16, warmup, device="cpu", tables=LAST)
    wide = tiles.Tables(proxy=((256, 16, False, 2),), dense=((256, 32, 8, 1),))
    for warmup in (False, True):
        _run(*case, torch.float16, warmup, device="cpu", tables=wide)


def test_small_tiles_with_q_map_equal_reference_under_the_interpreter(monkeypatch):
    """The GPU test's mapped run (:func:`_run_mapped`) on CPU with every list cut to its last
    entry (as above), outputs and partials NaN-poisoned: fp32 with the zigzag map, fp16 with the
    random map in deterministic mode."""
    case = ((100, 1, 40), 8, 2, 4, 1, 16, 16, 64, 2)
    poison_new_buffers(monkeypatch)
    _run_mapped(*case, torch.float32, False, "zigzag", device="cpu", tables=LAST)
    _run_mapped(*case, torch.float16, True, "random", device="cpu", tables=LAST)


# the query-map kernels (compile_check's "-qmap" configurations: the selection, and the anchor
# and paper layouts at D = block = 128), each list walked from its end as
# tests/integration/test_compile_check.py
# does for the others (its arch test passes --no-qmap)
# compile results by content (compile_check.Record; tests/integration/test_compile_check.py says
# how it is used)
RECORD = os.path.join(
    os.path.dirname(__file__), "..", "..", "src", "flash_msa", "triton_ref", "compile_record.json"
)
_QMAP_COMPILE = """
import json, sys
from flash_msa.triton_ref import compile_check as cc

arch = int(sys.argv[1])
record = cc.Record(sys.argv[2])
why = cc.target_unsupported(arch)
if why is not None:
    print(why, file=sys.stderr)
    sys.exit(cc.UNSUPPORTED)
for name, fn, sig, cands in cc.configurations(("anchor", "paper"), (128,), (128,)):
    if "-qmap" in name:
        res = cc.choose(fn, sig, cands, arch, True, record=record)
        print(json.dumps(dict(kernel=name, **res)), flush=True)
"""


@pytest.mark.parametrize("arch", [80, 89], ids=lambda a: f"sm{a}")
def test_q_map_kernels_compile_for_small_targets_within_their_shared_memory(arch):
    """Every query-map kernel configuration has a candidate that compiles for ``sm_{arch}``
    (sm_80: 163 KB, sm_89: 99 KB as sm_86/120) without spills, within the target's shared
    memory and with its own MMA (``mma.sync``), so ``tiles.pick`` finds one there. A target the
    installed Triton cannot compile for skips. CPU time on the 2-core machine, empty Triton
    cache: ~27 s per target."""
    pytest.importorskip("triton")
    from flash_msa.triton_ref.compile_check import QMAP_FAMILIES, UNSUPPORTED

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _QMAP_COMPILE, str(arch), RECORD],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if res.returncode == UNSUPPORTED:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    want = {"select-qmap bf16 Dp=128 b=128 k=16 G=4"}
    want |= {f"{f}-qmap {n} D=128 b=128" for n, fams in QMAP_FAMILIES.items() for f in fams}
    assert {r["kernel"] for r in rows} == want, res.stderr[-3000:]
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= tiles.SHARED_LIMITS[arch], r
        assert r["mma"] == "mma.sync" and not r["wgmma"], r


# compile results by content (compile_check.Record; tests/integration/test_compile_check.py says
# how it is used)


def _fake_pick(monkeypatch, shared, spills=None, races=(), dtype=torch.float32):
    """A ``pick()`` of a fake kernel ``fake_kernel`` over the tiles of ``shared`` (tile ->
    shared bytes; ``spills``: tile -> spill bytes, default none; ``races``: tiles whose TTGIR
    has a pipelining race) on a fake 227 KB sm_90 device; returns ``(pick, compiled)``, the
    latter the tiles compiled so far."""
    spills = spills or {}
    compiled = []

    def warmup(*args, grid, tile, D):
        compiled.append(tile)
        ttgir = "race" if tile in races else ""
        return SimpleNamespace(
            asm={"ttgir": ttgir}, metadata=SimpleNamespace(shared=shared[tile]), tile=tile
        )

    kernel = SimpleNamespace(fn=SimpleNamespace(__name__="fake_kernel"), warmup=warmup)
    monkeypatch.setattr(tiles, "_chosen", {})
    monkeypatch.setattr(tiles, "_usage", {})
    monkeypatch.setattr(tiles, "_refused", {})
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    monkeypatch.setattr(tiles, "ring_hazards", lambda ttgir: ["a race"] if ttgir else [])
    monkeypatch.setattr(tiles, "spill_bytes", lambda c: spills.get(c.tile, 0))
    monkeypatch.setattr(tiles, "_shared_limit", lambda dev: tiles.SHARED_LIMITS[90])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    args = (torch.zeros(1, dtype=dtype), 1.0)

    def pick():
        return tiles.pick(kernel, args, tuple(shared), lambda t: {"tile": t, "D": 128}, ("k",))

    return pick, compiled


def test_pick_refuses_when_no_candidate_fits(monkeypatch):
    """Under sm_120's 99 KB no tile fits (A: 290 KB, B: 180 KB, C: 120 KB): BackendError naming
    the kernel, the dtype, the head dim, the limit and the smallest need (C's), before any
    launch; asked again, the same error without compiling. With the device's 227 KB, B and C
    fit but spill (as fp32 tiles do): the one with the fewest spill bytes, C, is used (a
    warning says so)."""
    pick, compiled = _fake_pick(
        monkeypatch, {"A": 296960, "B": 180 * 1024, "C": 120 * 1024}, spills={"B": 64, "C": 8}
    )
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(tiles.SHARED_LIMITS[120]))
    with pytest.raises(BackendError) as err:
        pick()
    msg = str(err.value)
    for part in ("fake_kernel", "float32", "head dim 128", "101376 bytes", "122880 bytes"):
        assert part in msg, (part, msg)
    assert "candidate, C," in msg and compiled == ["A", "B", "C"]
    compiled.clear()
    with pytest.raises(BackendError, match="fake_kernel"):
        pick()
    assert not compiled and not tiles.chosen()  # refused from the cache, nothing chosen
    monkeypatch.delenv(tiles.SMEM_LIMIT_ENV)
    assert pick() == "C"
    assert tiles.usage()[next(iter(tiles.chosen()))] == (120 * 1024, 8)


def test_pick_takes_the_fitting_tile_with_the_fewest_spills(monkeypatch):
    """Every fitting tile spills (fp32): the one with the fewest spill bytes runs, the first of
    equals, whatever its place in the table (the new small fp32 tiles sit at the end)."""
    shared = {"A": 100 * 1024, "B": 50 * 1024, "C": 40 * 1024, "D": 30 * 1024}
    pick, compiled = _fake_pick(monkeypatch, shared, spills={"A": 64, "B": 8, "C": 32, "D": 8})
    assert pick() == "B" and compiled == ["A", "B", "C", "D"]


def test_pick_refusal_counts_racing_tiles(monkeypatch):
    """A tile that fits but has a pipelining race is no way out: with the others too large
    the refusal says how many were skipped for a race; with every tile racing it says so."""
    pick, _ = _fake_pick(monkeypatch, {"A": 200 * 1024, "B": 50 * 1024}, races=("B",))
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, str(tiles.SHARED_LIMITS[120]))
    with pytest.raises(BackendError, match=r"candidate, A, needs 204800 bytes.*1 more skipped"):
        pick()
    pick, _ = _fake_pick(monkeypatch, {"A": 1024}, races=("A",), dtype=torch.bfloat16)
    with pytest.raises(BackendError, match="bfloat16 inputs.*no candidate is free of pipelining"):
        pick()


# The candidate tables before the fp32 entries: each must be a prefix of
# today's, so that the first spill-free candidate within a limit (what bf16/fp16 run on every
# target: tests/integration/test_compile_check.py) is the same one.
BEFORE = {
    "dense.DENSE_TILES": (
        (64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 32, 4), (256, 32, 8, 1), (256, 16, 8, 2),
    ),
    "dense.FWD_TILES": ((64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 32, 4)),
    "sparse_fwd.FWD_TILES": (
        (128, 1), (128, 4), (128, 2), (64, 1), (64, 4), (64, 2), (32, 1), (32, 1, 4),
    ),
    "sparse_bwd.BWD_TILES": (
        (128, 128, 1), (128, 64, 1), (128, 64, 2), (128, 64, 4), (64, 64, 1), (64, 64, 4),
        (128, 32, 1), (32, 64, 1), (64, 32, 1), (32, 32, 1),
    ),
    "proxy.PROXY_TILES": (
        (128, 128, True), (128, 128, False), (128, 64, True), (128, 64, False), (64, 128, True),
        (64, 64, True), (64, 64, False), (128, 32, True), (32, 64, True), (64, 32, True),
        (32, 32, True), (256, 16, False, 2), (64, 32, False, 2),
    ),
}  # fmt: skip
MODULES = {"dense": dense, "sparse_fwd": sparse_fwd, "sparse_bwd": sparse_bwd, "proxy": proxy}


@pytest.mark.parametrize("table", BEFORE, ids=BEFORE.keys())
def test_new_candidates_come_last(table):
    """Each table starts with its entries from before the fp32 ones, in the same order."""
    module, name = table.split(".")
    now = getattr(MODULES[module], name)
    assert now[: len(BEFORE[table])] == BEFORE[table], now


def test_selection_candidates_unchanged():
    """The selection's candidate list (a function of the launch, not a table) is as before."""
    assert selection.tile_candidates(8, 2, 128, 4) == ((8, 128, 2), (16, 128, 2), (8, 64, 1))
    assert selection.tile_candidates(4, 2, 128, 4) == ((4, 128, 2), (8, 128, 2), (16, 128, 2),
                                                        (8, 64, 1))  # fmt: skip


# compile_check for fp32 at sm_120's 99 KB (the least shared memory of the targets; sm_86/89
# have the same): the anchor layout, D = block = 128 (the largest tiles), every family, each
# list walked from its end, compiled to the LLVM IR only (the shared memory is fixed there; fp32
# tiles spill anyway, and ptxas on them takes up to ~35 s each). Without the dense tables' fp32
# entries dense-bwd-det has no candidate within 99 KB (smallest 103 KB) and this fails.
# CPU time on the 2-core machine, empty Triton cache: ~60 s (23 configurations, 25 compiles).
@pytest.mark.parametrize("arch", [120], ids=lambda a: f"sm{a}")
def test_fp32_kernels_have_a_tile_within_the_shared_memory(arch):
    """Every kernel family has, for fp32 inputs, a candidate within ``sm_{arch}``'s shared
    memory per block, so ``tiles.pick`` runs one there rather than refusing: the selection,
    the forward partials (main and proxy-only), the backward, the proxy passes (KL, gradient,
    deterministic), the combine, the ordered sums and the dense warmup kernels."""
    pytest.importorskip("triton")
    from flash_msa.triton_ref.compile_check import UNSUPPORTED

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "flash_msa.triton_ref.compile_check", "--arch", str(arch)]
    cmd += ["--layouts", "anchor", "--dims", "128", "--blocks", "128", "--no-qmap"]
    cmd += ["--dtype", "fp32", "--any", "--shared-only", "--cached", RECORD, "--verify"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode == UNSUPPORTED:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    families = {r["kernel"].split()[0] for r in rows}
    want = {"select", "fwd", "fwd-proxy-only", "bwd", "bwd-det", "kl", "kl+grad", "proxy-grad"}
    want |= {"kl+grad-det", "proxy-grad-det", "combine", "slot-sum", "item-sum"}
    want |= {"dense-fwd", "dense-bwd", "dense-bwd-det", "dense-bwd-dq", "dense-proxy"}
    want |= {"dense-proxy-det", "dense-proxy-dk"}
    assert families == want, (families, res.stderr[-3000:])
    for r in rows:
        assert r["dtype"] == "fp32" and r["shared_bytes"] <= tiles.SHARED_LIMITS[arch], r
    assert "select fp32 Dp=128 b=128 k=16 G=4" in {r["kernel"] for r in rows}
    assert res.returncode == 0, res.stderr[-3000:]


# bf16/fp16 choices before and after the fp32 entries, for real (sm_90a, the H200's 227 KB):
# the dense kernels whose table grew, at the anchor layout, D = 128, in the order tiles.pick
# walks them. CPU time on the 2-core machine, empty Triton cache: ~40 s.
_BEFORE_AFTER = """
import json, sys
from flash_msa.triton_ref import compile_check as cc, dense

before = tuple(json.loads(sys.argv[1]))
record = cc.Record(sys.argv[2])
names = ("dense-bwd-det D=128", "dense-proxy-dk D=128")
for dtype in ("bf16", "fp16"):
    for name, fn, sig, cands in cc.configurations(("anchor",), (128,), (128,), False, dtype):
        if name in names:
            old = [c for c in cands if list(c[0]) in before]
            picks = [cc.choose(fn, sig, cs, 90, record=record) for cs in (old, cands)]
            print(json.dumps(dict(kernel=name, dtype=dtype, old=picks[0], new=picks[1])))
"""


def test_bf16_fp16_choices_unchanged_by_the_fp32_entries():
    """For bf16 and fp16 the dense backward (deterministic) and the dk_proxy kernel choose the
    same spill-free tile for sm_90a from the table before the fp32 entries and from today's."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    before = json.dumps([list(t) for t in BEFORE["dense.DENSE_TILES"]])
    res = subprocess.run(
        [sys.executable, "-c", _BEFORE_AFTER, before, RECORD], capture_output=True, text=True,
        env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4, res.stderr[-3000:]
    for r in rows:
        assert r["old"]["tile"] == r["new"]["tile"] and r["new"]["spill_bytes"] == 0, r
        assert r["new"]["shared_bytes"] <= tiles.SHARED_LIMITS[90], r
