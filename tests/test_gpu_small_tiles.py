"""The Triton tiles for GPUs with less shared memory per block (sm_80, sm_86/89, sm_120).

GPU tests (``pytest -m gpu``, on an H200: 227 KB per block): ``FLASH_MSA_SMEM_LIMIT`` caps
``tiles.shared_limit`` to another architecture's limit (``tiles.SHARED_LIMITS``: sm_80 163 KB,
sm_86/89/120 99 KB), so ``tiles.pick`` walks the same candidate tables as on that GPU. The
kernels are still compiled for sm_90 (wgmma) there: their shared memory and registers per tile
are close to, not the same as, the ``mma.sync`` build's, so these tests check the small tiles'
*results*; whether they fit and do not spill on those targets is the CI compile check
(``compile_check --arch``, tests/test_compile.py). A third GPU test forces the last entry of
every table (what the register limits of the ``mma.sync`` targets may leave) and checks that
it is what ran.

Each case runs select (sparse), fwd (with the proxy gradient, as training asks it) and bwd on
the Triton backend, sparse and warmup, default and deterministic mode, in bf16 and fp16, and
compares out, lse, proxy_lse, kl and the five gradients of ``testing.training_loss`` (O(1) in
all five inputs; ``harness.incoming``) with the reference by ``testing.assert_close`` (``err <=
2 * err(same-dtype reference) + atol``). The selection is compared as sets (near-ties
accepted) and the other ops run on the reference's indices.

The tests without the ``gpu`` marker run on CPU (~20 s): the cap's parsing and its place in
``tiles.pick``'s cache key (a fake kernel: no compiler), and the new small tiles under Triton's
interpreter (which takes the first candidate: the lists are cut to the entries tested).
"""

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flash_msa import backends, reference, testing
from flash_msa.problem import Saved
from flash_msa.triton_ref import dense, proxy, selection, sparse_bwd, sparse_fwd, tiles
from harness import check, config, incoming, packed_inputs, references, results

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16]
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


def _run(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, dtype, warmup, det=False, device="cuda"):
    """select (sparse only), fwd and bwd of the Triton backend against the references."""
    be = backends.load("triton")[0]
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=device, seed=1
    )
    cfg = dataclasses.replace(
        config(max(lengths), D, Dp, b, top_k, warmup=warmup), deterministic=det
    )
    idx = None
    if not warmup:
        mine_idx = be.select(qp, kp, cu, cfg)
        idx = reference.select(qp, kp, cu, cfg)
        bad = testing.selection_mismatch(
            mine_idx.cpu(), idx.cpu(), qp.cpu(), kp.cpu(), b, cfg.proxy_scale, cu.cpu()
        )
        assert bad == 0
    fwd = be.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True)
    dout, dkl = incoming(q, Hp, seed=2)
    saved = Saved(q, k, v, fwd.out, fwd.lse, idx, qp, kp, fwd.proxy_lse, fwd.proxy_grad)
    grads = be.bwd(dout, dkl, saved, cu, cfg)
    check(results(fwd, grads), *references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl))


def _choices(limit):
    """``{(kernel, candidates, *static key): (tile, shared, spills)}`` chosen under ``limit``
    (``tiles.chosen`` keys: kernel, candidates, device, capability, limit, *static key)."""
    used = tiles.usage()
    return {(k[0], k[1], *k[5:]): (t, *used[k]) for k, t in tiles.chosen().items() if k[4] == limit}


@pytest.mark.parametrize("mode", MODES, ids=MODES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
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
def test_last_candidates_match_reference(monkeypatch):
    """The last entry of every table, forced as the only candidate, ran (``tiles.chosen``) and
    passes the rule on every shape and mode, in bf16."""
    _force_last(monkeypatch)
    for shape in SHAPES.values():
        for warmup, det in MODES.values():
            _run(*shape, torch.bfloat16, warmup, det)
    chosen = {}
    for k, t in tiles.chosen().items():
        chosen.setdefault(k[0], set()).add(t)
    assert chosen == _last_tiles(), chosen


def _force_last(monkeypatch):
    """Every candidate table reduced to its last entry (the selection's function likewise)."""
    candidates = selection.tile_candidates
    monkeypatch.setattr(selection, "tile_candidates", lambda *a: candidates(*a)[-1:])
    monkeypatch.setattr(sparse_fwd, "FWD_TILES", sparse_fwd.FWD_TILES[-1:])
    monkeypatch.setattr(sparse_bwd, "BWD_TILES", sparse_bwd.BWD_TILES[-1:])
    monkeypatch.setattr(proxy, "PROXY_TILES", proxy.PROXY_TILES[-1:])
    monkeypatch.setattr(dense, "DENSE_TILES", dense.DENSE_TILES[-1:])
    monkeypatch.setattr(dense, "FWD_TILES", dense.FWD_TILES[-1:])


def _last_tiles():
    """``{kernel name: {tile}}`` that :func:`_force_last` leaves on the shapes of SHAPES."""
    sel = {selection.tile_candidates(8, 2, 128, G)[-1] for G in (4, 2)}  # Hp / Hpk of SHAPES
    sel |= {selection.tile_candidates(4, 2, 128, G)[-1] for G in (4, 2)}  # (block 64 tables)
    return {
        "_select_kernel": sel,
        "_fwd_kernel": {sparse_fwd.FWD_TILES[-1], *sparse_fwd.fwd_tiles(False)},  # main, proxy-only
        "_bwd_kernel": {sparse_bwd.BWD_TILES[-1]},
        "_proxy_kernel": {proxy.PROXY_TILES[-1]},
        "_dense_fwd_kernel": {dense.FWD_TILES[-1]},
        "_dense_bwd_kernel": {dense.DENSE_TILES[-1]},
        "_dense_bwd_dq_kernel": {dense.DENSE_TILES[-1]},
        "_dense_proxy_kernel": {dense.DENSE_TILES[-1]},
        "_dense_proxy_dk_kernel": {dense.DENSE_TILES[-1]},
    }


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
    the device changes nothing. If no tile fits, the last is used (with a warning)."""
    shared = {"A": 200 * 1024, "B": 120 * 1024, "C": 60 * 1024}
    compiled = []
    kernel = SimpleNamespace(
        fn=SimpleNamespace(__name__="fake_kernel"),
        warmup=lambda *a, grid, tile: compiled.append(tile)
        or SimpleNamespace(asm={}, metadata=SimpleNamespace(shared=shared[tile])),
    )  # fmt: skip
    monkeypatch.setattr(tiles, "_chosen", {})
    monkeypatch.setattr(tiles, "_usage", {})
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
    monkeypatch.setenv(tiles.SMEM_LIMIT_ENV, "1024")  # nothing fits: the last one, warned
    assert pick() == "C"


def test_small_tiles_equal_reference_under_the_interpreter(monkeypatch):
    """Under the interpreter ``tiles.pick`` takes the first candidate. With every list cut to
    its last entry (the selection's 64 rows x 8 warps x 1 stage, BT = 64 / G tokens; the
    forward's 32 rows x 4 warps; the proxy pass's 64 x 32 at 2 stages; the warmup's 32 x 32 and
    256 x 16 tiles), then with the proxy passes' 256-row entries (R = 1), sparse and warmup
    equal the reference (fp16: the interpreter's bf16 is wrong)."""
    case = ((100, 1, 40), 8, 2, 4, 1, 16, 16, 64, 2)
    _force_last(monkeypatch)
    for warmup in (False, True):
        _run(*case, torch.float16, warmup, device="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(proxy, "PROXY_TILES", ((256, 16, False, 2),))
    monkeypatch.setattr(dense, "DENSE_TILES", ((256, 32, 8, 1),))
    for warmup in (False, True):
        _run(*case, torch.float16, warmup, device="cpu")
