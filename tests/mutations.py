"""Mutation check: plant plausible bugs one at a time and see whether the CPU test suite fails.

    python tests/mutations.py            # every mutant
    python tests/mutations.py --list     # names, files and the tests each one runs
    python tests/mutations.py NAME ...   # some of them (--keep: leave the temp trees)

For each mutant: copy the tree (``src/``, ``tests/``, ``pyproject.toml``, ``README.md``,
``examples/``) to a temporary directory, apply its textual replacements (each must match the
file exactly once, else the mutant is reported ``ANCHOR`` and the anchor has to be updated),
run the tests that should catch it there (``pytest -x`` with ``TRITON_INTERPRET=1`` and
``PYTHONPATH=<tmp>/src``), and print one table row: ``caught`` (tests failed), ``MISSED`` (they
passed: a hole in the suite), ``ERROR`` (pytest could not run them: collection error, no test
selected) or ``VOID`` (the selection already fails on the unmutated tree, run first as a
baseline unless ``--no-baseline``). Exit status 0 iff every mutant is caught.

Not collected by pytest (the name does not match ``test_*.py``). Each mutant runs a fixed,
narrow selection of tests so that the whole list takes a few minutes on 2 CPU cores; a mutant
that a wider selection would catch but its own does not is still a hole in that selection.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = ("src", "tests", "pyproject.toml", "README.md", "examples")
PKG = "src/flash_msa/"
# Triton forward/backward against the reference on the case with everything in it: varlen, an
# empty sequence, Hp > Hpk > 1, partial blocks; both proxy-gradient paths (backward pass, forward)
FWD_BWD = "fwd_bwd_fp32 and 150x0x110"


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the bug, as a kernel engineer would make it
    edits: tuple[tuple[str, str, str], ...]  # (file, old text, new text); one bug, 1+ edits
    tests: tuple[str, ...]  # pytest files
    k: str | None = None  # pytest -k expression


MUTANTS = (
    Mutant(
        "ref-row-chunk-offset",
        "reference.fwd reads the indices of a row chunk from the sequence's start (c0 dropped)",
        (
            (
                PKG + "reference.py",
                "idx = None if indices is None else indices[sl]",
                "idx = None if indices is None else indices[_take(qrows, 0, c1 - c0)]",
            ),
        ),
        ("tests/ops/test_reference.py",),
        "row_chunks",
    ),
    Mutant(
        "triton-proxy-head-map",
        "Triton forward: proxy key head of selection head p is p % Hpk, not p // (Hp / Hpk)",
        ((PKG + "triton_ref/sparse_fwd.py", "pk = p // (Hs // Hpk)", "pk = p % Hpk"),),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-causal-off-by-one",
        "Triton forward: a key is visible when kpos < t (the query's own key is dropped)",
        (
            (
                PKG + "triton_ref/sparse_fwd.py",
                "keep = m_k[None, :] & (kpos[None, :] <= t[:, None])",
                "keep = m_k[None, :] & (kpos[None, :] < t[:, None])",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-combine-lse-no-max",
        "Triton combine: the merged LSE is log(sum exp(l - m)) without its max term m",
        (
            (
                PKG + "triton_ref/sparse_fwd.py",
                "tl.store(LSE + t * H + h, finish_lse(b_m, b_l), mask=m_h)",
                "tl.store(LSE + t * H + h, finish_lse(0.0 * b_m, b_l), mask=m_h)",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-bwd-dkl-unscaled",
        "Triton backward: the forward's unit proxy gradient is returned without the dkl factor",
        (
            (
                PKG + "triton_ref/sparse_bwd.py",
                "dqp, dkp = (g * dkl for g in unit)",
                "dqp, dkp = (g for g in unit)",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-proxy-grad-sign",
        "Triton proxy pass: dz = t - q instead of q - t (the KL gradient's sign flipped)",
        (
            (
                PKG + "triton_ref/common.py",
                "b_diff = (tl.where(keep, tl.exp(b_logq), 0.0) - b_tgt).to(b_qp.dtype)",
                "b_diff = (b_tgt - tl.where(keep, tl.exp(b_logq), 0.0)).to(b_qp.dtype)",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-dv-half",
        "Triton backward: dv halved (as if half the heads of a KV group were accumulated)",
        (
            (
                PKG + "triton_ref/sparse_bwd.py",
                "tl.atomic_add(DV + p_kv, b_dv, mask=m_k[:, None]",
                "tl.atomic_add(DV + p_kv, 0.5 * b_dv, mask=m_k[:, None]",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "triton-split-block-offset",
        "item_block: the sub-th part of a split key block starts at the block start (sub*BN lost)",
        (
            (
                PKG + "triton_ref/common.py",
                "(tl.load(BLK_START + gb) + sub * BN + tl.arange(0, BN))",
                "(tl.load(BLK_START + gb) + tl.arange(0, BN))",
            ),
        ),
        ("tests/ops/test_msa.py",),
        "split_key_blocks and 32x32",  # 32 keys per program: blocks of 64 split in 2
    ),
    Mutant(
        "ref-own-block-not-forced",
        "reference.select ranks the own block by its score instead of always keeping it",
        (
            (
                PKG + "reference.py",
                "score.scatter_(2, own, math.inf)  # the own block always wins",
                "pass  # the own block competes like the others",
            ),
        ),
        ("tests/ops/test_reference.py",),
        "select_matches_brute_force or selection_properties",
    ),
    Mutant(
        "ref-top-k-off-by-one",
        "reference.select keeps top_k - 1 blocks (the own block counted twice)",
        ((PKG + "reference.py", "kk = min(top_k, nb)", "kk = min(top_k - 1, nb)"),),
        ("tests/ops/test_reference.py",),
        "select_matches_brute_force or selection_properties",
    ),
    Mutant(
        "worklist-empty-sequence",
        "worklist.build maps a global block to a sequence with searchsorted(right=False), which "
        "lands on an earlier (e.g. empty) sequence at every repeated block end",
        (
            (
                PKG + "worklist.py",
                "seq_of_gb = torch.searchsorted(blk_end_cum, gb, right=True)",
                "seq_of_gb = torch.searchsorted(blk_end_cum, gb, right=False)",
            ),
        ),
        ("tests/ops/test_msa.py",),
        FWD_BWD,
    ),
    Mutant(
        "ref-compute-kl-false-nonzero",
        "reference.fwd computes and returns the KL value when compute_kl=False",
        (
            (PKG + "reference.py", "            if cfg.compute_kl:\n", "            if True:\n"),
            (PKG + "reference.py", "    if proxy and cfg.compute_kl:\n", "    if proxy:\n"),
        ),
        ("tests/ops/test_reference.py",),
        "compute_kl",
    ),
    Mutant(
        "triton-compute-kl-false-nonzero",
        "the sparse-forward driver computes and returns the KL value when compute_kl=False",
        (
            (
                PKG + "sparse_forward.py",
                "        if cfg.compute_kl and whole is None:\n            part =",
                "        if whole is None:\n            part =",
            ),
            (
                PKG + "sparse_forward.py",
                "    if proxy and cfg.compute_kl and whole is not None:",
                "    if proxy and whole is not None:",
            ),
            (
                PKG + "sparse_forward.py",
                "    if proxy and cfg.compute_kl:\n        kl = (",
                "    if proxy:\n        kl = (",
            ),
        ),
        ("tests/ops/test_msa.py",),
        "compute_kl or proxy_gradient_made",
    ),
    Mutant(
        "api-head-ratio-unchecked",
        "the API no longer checks that H is a multiple of the selection heads",
        ((PKG + "api.py", "    if H % Hsel:\n", "    if False:\n"),),
        ("tests/api/test_validation.py",),
        "bad_input",
    ),
    Mutant(
        "api-top-k-unclamped",
        "the API passes top_k to the backends unclamped (a (T, Hp, 10**6) index tensor)",
        (
            (
                PKG + "api.py",
                "    return min(top_k, max(-(-max_seqlen // block_size), UNCLAMPED_TOP_K))",
                "    return top_k",
            ),
        ),
        ("tests/api/test_top_k.py",),
        None,
    ),
    Mutant(
        "check-yardstick-moves",
        "flash-msa check takes its same-dtype yardstick from the backend under test (a wrong torch "
        "backend then passes: err == err(same))",
        (
            (
                PKG + "diagnostics.py",
                "_reference_fwd, _reference_bwd = reference.fwd, reference.bwd",
                "_reference_fwd = reference.fwd\n"
                "def _reference_bwd(*a, **kw):\n"
                "    return reference.bwd(*a, **kw)",
            ),
        ),
        ("tests/integration/test_cli.py",),
        "check_fails_wrong_gradients",
    ),
    Mutant(
        "det-last-slot-dropped",
        "ordered.slot_sum stops one slot early (an off-by-one in the fixed-order row sum)",
        ((PKG + "ordered.py", "for s in range(K * S):", "for s in range(K * S - 1):"),),
        ("tests/ops/test_deterministic.py",),
        "step_twice_same_bits_and_reference and not warmup",
    ),
    Mutant(
        "det-main-kernel-atomic",
        "the deterministic backward launches the main kernel compiled without DETERMINISTIC "
        "(its stores become atomics again, into the partial buffers' layout)",
        (
            (
                PKG + "triton_ref/sparse_bwd.py",
                "tile, options = _main_tile(q, k, probe, cfg, args, True, tables)",
                "tile, options = _main_tile(q, k, probe, cfg, args, False, tables)",
            ),
        ),
        ("tests/ops/test_deterministic.py",),
        "step_twice_same_bits_and_reference or program_order",
    ),
)


def _copy_tree(dst: str):
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".hypothesis", "*.pyc")
    for name in COPY:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(dst, name))


def _apply(tree: str, mutant: Mutant) -> str | None:
    """Apply the mutant's edits in ``tree``; the reason it cannot be applied, else ``None``."""
    for path, old, new in mutant.edits:
        full = os.path.join(tree, path)
        with open(full) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            return f"{path}: anchor matches {n} times, not once: {old.strip()[:60]!r}"
        with open(full, "w") as f:
            f.write(text.replace(old, new))
    return None


def _pytest(tree: str, tests, k) -> tuple[int, str]:
    """Run the selection in ``tree``: ``(pytest's exit status, its first FAILED or last line)``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += list(tests) + (["-k", k] if k else [])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.join(tree, "src"))
    env.pop("FLASH_MSA_BACKEND", None)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return proc.returncode, next(
        (ln for ln in lines if ln.startswith("FAILED")), lines[-1] if lines else ""
    )


def baseline(mutants) -> dict:
    """Each distinct selection on an unmutated copy: ``{(tests, k): (rc, detail)}``. A mutant
    whose selection already fails without it proves nothing."""
    tree = tempfile.mkdtemp(prefix="mutant-baseline-")
    try:
        _copy_tree(tree)
        return {sel: _pytest(tree, *sel) for sel in dict.fromkeys((m.tests, m.k) for m in mutants)}
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def run(mutant: Mutant, keep: bool = False) -> tuple[str, float, str]:
    """``(result, seconds, detail)`` of one mutant."""
    tree = tempfile.mkdtemp(prefix=f"mutant-{mutant.name}-")
    t0 = time.time()
    try:
        _copy_tree(tree)
        why = _apply(tree, mutant)
        if why is not None:
            return "ANCHOR", time.time() - t0, why
        rc, detail = _pytest(tree, mutant.tests, mutant.k)
        result = {0: "MISSED", 1: "caught"}.get(rc, f"ERROR rc={rc}")
        return result, time.time() - t0, detail
    finally:
        if keep:
            print(f"  (kept {tree})", file=sys.stderr)
        else:
            shutil.rmtree(tree, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary trees")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each selection on the unmutated tree first",
    )
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; see --list")
    chosen = [by_name[n] for n in args.names] or list(MUTANTS)
    if args.list:
        for m in chosen:
            files = ", ".join(sorted({p for p, _, _ in m.edits}))
            print(f"{m.name:32s} {files}\n    {m.why}\n    runs: {' '.join(m.tests)} -k {m.k!r}")
        return 0
    clean = {}
    if not args.no_baseline:
        t0 = time.time()
        clean = baseline(chosen)
        bad = {sel: res for sel, res in clean.items() if res[0] != 0}
        print(
            f"baseline: {len(clean) - len(bad)} of {len(clean)} selections pass unmutated "
            f"({time.time() - t0:.0f} s)"
        )
        for (tests, k), (rc, detail) in bad.items():
            print(f"    FAILS unmutated (rc {rc}): {' '.join(tests)} -k {k!r}: {detail}")
    header = f"{'mutant':32s} {'tests run':58s} {'result':10s} {'s':>6s}"
    print(header + "\n" + "-" * len(header), flush=True)
    results = []
    for m in chosen:
        if clean.get((m.tests, m.k), (0,))[0] != 0:
            result, secs, detail = "VOID", 0.0, "its selection fails on the unmutated tree"
        else:
            result, secs, detail = run(m, args.keep)
        results.append(result)
        sel = " ".join(t.removeprefix("tests/") for t in m.tests) + (f" -k {m.k!r}" if m.k else "")
        print(f"{m.name:32s} {sel:58s} {result:10s} {secs:6.1f}", flush=True)
        if result != "caught":
            print(f"    {detail}", flush=True)
    caught = results.count("caught")
    print(f"\n{caught} of {len(results)} mutants caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
