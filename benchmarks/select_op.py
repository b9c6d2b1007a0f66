"""The selection op as it ships, on one GPU: each line verified, then timed (ms and TFLOP/s by
the SELECT formula).

    PYTHONPATH=src python benchmarks/select_op.py [--cases paper:131072 long:1048576]
        [--kinds random local] [--iters 10] [--out FILE]

A line is :func:`flash_msa.select_blocks` on the CuTe backend (``backends.forced("cute")``),
top_k 16 (``bench.TOP_K``), block 128, one sequence of ``S`` tokens, in one precision:

- ``bf16``: the exact selection;
- ``fp8`` (``selection_precision="fp8"``): the quantize pass (rotation, e4m3, block scales;
  the CuTe pass where it takes the call, as the backend runs it) and the e4m3 kernel, both in
  the time.

Cases (``--cases SHAPE:S``): the heads of ``bench.SHAPES[SHAPE]`` at ``S`` tokens; default the
paper shape at 128K and the long shape (the anchor's heads) at 1M. Inputs (``--kinds``):
``testing.make_inputs``'s random and local proxies, seed 0 (the proxies ``flash-msa bench``
draws for the same shape and length).

Verification, before any line of an input is timed: the line's indices against the Triton
selection of the same precision on the same inputs (bf16: ``select_blocks`` forced to
``triton``; fp8: ``triton_ref.selection_fp8.select``, the torch quantize pass, bitwise equal
to CuTe's, then the Triton e4m3 kernel). The two kernels sum in different orders, so blocks of
nearly equal score may swap: a line passes when at most :data:`MAX_DIFFERING` of its (token,
proxy head) rows differ from Triton's and every row is a well-formed causal selection
(:func:`malformed_rows`). Every line of an input is verified before the first is timed, its
output and the references still held, so the buffer the allocator hands the op holds no
selection of these inputs: a slot the op failed to write shows as a differing or malformed
row (unless the memory held the same blocks for an earlier input, which only the first
``top_k`` blocks' rows can: they keep every visible block whatever the inputs). A line that
fails is reported and not timed; the script then exits 1.

``--out FILE`` writes the lines as a JSON list (one object per line, the environment in each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from flash_msa import BackendError, bench, select_blocks, testing
from flash_msa.backends import forced
from flash_msa.triton_ref import selection_fp8

PRECISIONS = ("bf16", "fp8")
CASES = ("paper:131072", "long:1048576")
# the CuTe and Triton kernels differed in at most 3 of 4,194,304 rows at long 1M (bf16, top_k
# 16; none in fp8, none at paper 128K: docs/performance.md); this bound leaves room for other
# near-ties and still fails a kernel that gets whole tiles or heads wrong
MAX_DIFFERING = 1e-3


def select_flops(S: int, Dp: int, Hp: int) -> float:
    """The SELECT formula of docs/performance.md for one sequence of ``S`` tokens."""
    return 2 * Dp * Hp * S * (S + 1) / 2


def malformed_rows(idx: torch.Tensor, block_size: int) -> int:
    """Rows of ``idx`` (``(S, Hp, K)`` int32, one sequence) that are not a causal selection of
    ``min(K, own + 1)`` blocks: entries ``-1`` or in ``[0, own]``, the blocks strictly ascending
    before the ``-1`` slots, the own block ``t // block_size`` among them. Finite inputs give
    every visible block a finite score, so a row keeps as many blocks as it may."""
    S, _, K = idx.shape
    own = (torch.arange(S, device=idx.device, dtype=torch.int32) // block_size)[:, None, None]
    kept = idx >= 0
    # each slot's predecessor (slot 0: -2, below every block and below -1)
    prev = torch.cat([torch.full_like(idx[..., :1], -2), idx[..., :-1]], -1)
    bad = (idx < -1) | (idx > own) | (kept & ((prev == -1) | (idx <= prev)))
    rows = bad.any(-1) | ~(idx == own).any(-1)
    rows |= kept.sum(-1) != torch.clamp(own[..., 0] + 1, max=K)
    return int(rows.sum())


def inputs(shape: str, S: int, kind: str):
    """``(q_proxy, k_proxy, Hp, Dp, D)``: the proxies of ``bench.SHAPES[shape]`` in batch form
    ``(1, S, heads, Dp)`` bf16 on the GPU (``testing.make_inputs`` draws them first, so the main
    heads, left out here as one head of dim 1, do not change them)."""
    _, _, _, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    xs = testing.make_inputs(1, S, 1, 1, Hp, Hpk, 1, Dp, device="cuda", kind=kind, seed=0)
    return xs[0], xs[1], Hp, Dp, D


def triton_indices(qp, kp, precision: str, cfg) -> torch.Tensor:
    """``(S, Hp, K)``: the Triton selection of ``precision`` on the same proxies."""
    if precision == "fp8":
        cu = testing.cu([qp.shape[1]], qp.device)
        return selection_fp8.select(qp[0], kp[0], cu, cfg)
    with forced("triton"):
        return select_blocks(qp, kp, cfg.top_k, block_size=cfg.block_size)[0]


def op(qp, kp, precision: str, cfg):
    """The line's call: the shipped op on the CuTe backend."""
    with forced("cute"):
        return select_blocks(
            qp, kp, cfg.top_k, block_size=cfg.block_size, selection_precision=precision
        )


def verify(qp, kp, cfg, row: dict) -> tuple[list, str]:
    """Run the line of ``cfg`` once and check it against Triton's (module docstring): fills
    ``row``'s verdict, returns ``(tensors to hold, PASS/FAIL text)``."""
    precision = cfg.selection_precision
    try:
        ref = triton_indices(qp, kp, precision, cfg)
        idx = op(qp, kp, precision, cfg)[0]
    except BackendError as e:  # e.g. not a Hopper GPU: the CuTe backend refuses
        row.update(ok=False, error=f"{type(e).__name__}: {e}")
        return [], f"FAIL {row['error']}"
    differing = int((idx != ref).any(-1).sum())
    malformed = malformed_rows(idx, cfg.block_size)
    ok = malformed == 0 and differing <= MAX_DIFFERING * row["rows"]
    row.update(rows_differing=differing, malformed_rows=malformed, ok=ok)
    text = f"{'PASS' if ok else 'FAIL'} rows differing from Triton's {differing} of {row['rows']}"
    return [ref, idx], text + (f", malformed rows {malformed}" if malformed else "")


def run_input(shape: str, S: int, kind: str, iters: int, env: dict) -> list[dict]:
    """Verify every precision's line on one input, then time those that passed."""
    qp, kp, Hp, Dp, D = inputs(shape, S, kind)
    base = bench.step_config(S, D, Dp)
    lines, held = [], []  # held: outputs and references, alive until every line is verified
    for precision in PRECISIONS:
        cfg = dataclasses.replace(base, selection_precision=precision)
        row = dict(
            shape=shape, S=S, inputs=kind, selection_precision=precision, top_k=cfg.top_k,
            block_size=cfg.block_size, Hp=Hp, Dp=Dp, rows=S * Hp, env=env,
        )  # fmt: skip
        tensors, text = verify(qp, kp, cfg, row)
        held += tensors
        lines.append((cfg, row, f"{shape} S={S} {kind} {precision} k={cfg.top_k}: {text}"))
    del held
    flops = select_flops(S, Dp, Hp)
    for cfg, row, text in lines:
        if not row["ok"]:
            print(f"{text}; NOT TIMED", flush=True)
            continue
        ms = bench.time_ms(lambda cfg=cfg: op(qp, kp, cfg.selection_precision, cfg), iters=iters)
        row.update(ms=ms, tflops=flops / ms / 1e9)
        print(f"{text}; {ms:.3f} ms, {row['tflops']:.0f} TFLOP/s", flush=True)
    return [row for _, row, _ in lines]


def case(text: str) -> tuple[str, int]:
    """``SHAPE:S`` (argparse type)."""
    shape, _, S = text.partition(":")
    if shape not in bench.SHAPES or not S.isdigit() or int(S) < 1:
        raise argparse.ArgumentTypeError(
            f"expected SHAPE:S with SHAPE one of {', '.join(bench.SHAPES)} and S > 0, got {text!r}"
        )
    return shape, int(S)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases", nargs="+", type=case, default=[case(c) for c in CASES],
        help=f"SHAPE:S (default: {' '.join(CASES)})",
    )  # fmt: skip
    p.add_argument("--kinds", nargs="+", choices=("random", "local"), default=["random", "local"])
    p.add_argument("--iters", type=int, default=10, help="timed calls per line (median)")
    p.add_argument("--out", default=None, help="write the lines as a JSON list to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("select_op.py needs a CUDA GPU (a Hopper one for the CuTe backend)", file=sys.stderr)
        return 1
    env = bench.environment()
    rows = []
    for shape, S in a.cases:
        for kind in a.kinds:
            rows += run_input(shape, S, kind, a.iters, env)
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = sum(not r["ok"] for r in rows)
    if bad:
        print(f"{bad} of {len(rows)} lines failed verification (not timed)", file=sys.stderr)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
