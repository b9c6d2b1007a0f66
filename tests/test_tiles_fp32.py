"""fp32 inputs under small shared memory: a tile that fits, or a clear refusal.

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
  tests/test_compile.py) is the same candidate.
- ``compile_check --dtype fp32 --any --shared-only`` for sm_120 (99 KB, as sm_86/89): every
  family of a handful of representative configurations has a candidate within the limit.
"""

import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flash_msa import BackendError
from flash_msa.triton_ref import dense, proxy, selection, sparse_bwd, sparse_fwd, tiles

# compile results by content (compile_check.Record; tests/test_compile.py says how it is used)
RECORD = os.path.join(
    os.path.dirname(__file__), "..", "src", "flash_msa", "triton_ref", "compile_record.json"
)


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


# The candidate tables before the fp32 entries (commit fe4fd9b): each must be a prefix of
# today's, so that the first spill-free candidate within a limit (what bf16/fp16 run on every
# target: tests/test_compile.py) is the same one.
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
    want |= {"kl+grad-det", "proxy-grad-det", "combine", "slot-sum", "item-sum", "rerank"}
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
