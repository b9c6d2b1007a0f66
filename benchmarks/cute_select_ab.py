"""Selection kernels side by side on one GPU: every line verified on its own output, then timed
(ms and TFLOP/s by the SELECT formula).

    PYTHONPATH=src python3 benchmarks/cute_select_ab.py          # every line below
    PYTHONPATH=src python3 benchmarks/cute_select_ab.py --fp8    # the bf16 / fp8 A/B only
    PYTHONPATH=src python3 benchmarks/cute_select_ab.py --fp8 --op-only  # its op lines, k=16

Times the CuTe and the Triton selection on the same inputs (paper shape at 128K, anchor shape
at 32K; random and local inputs; top_k 16 and 64), and the CuTe kernel with other key-pipeline
depths (``SelectSm90(stages=)``, the constructor argument; 4 is the default) at top_k 16.

FP8 selection (``selection_precision="fp8"``, issue 15), at paper 128K and on the anchor's heads
at 1M (``bench.SHAPES["long"]``), random and local inputs, against the bf16 CuTe line of the
same input:

- ``cute-fp8 k=K``: the op as the backend runs it, the quantize pass
  (``quant.quantize``: rotation, e4m3, block scales) included in the time;
- ``cute-fp8 cute-quantize k=K``: the same op with the CuTe quantize pass
  (``cute/quantize_sm90.py``, what ``select_sm90.select`` runs once ``QUANTIZE_ON_CUTE`` is on);
- ``cute-fp8 kernel k=K``: the kernel alone on the quantized operands (``select_fp8_into``),
  and with other pipeline depths (``stages=``; ``select_sm90.FP8_STAGES`` is the default);
- ``triton-fp8 k=K``: the Triton oracle (``triton_ref/selection_fp8.py``) on the same operands;
- a ``quantize`` line: the torch quantize pass alone (ms), and ``cute quantize [variant]``
  lines beside it: the CuTe pass alone in each tuning variant of ``quantize_sm90.VARIANTS``
  (since the ninth session's A/B the shipped one alone, w8 u1), checked bitwise equal to the
  torch pass's bytes and scales first, with the HBM rate its bytes would take (inputs read
  once, e4m3 and scales written).

``--op-only``: the fp8 A/B times three lines per input and nothing else, at top_k 16: ``cute
k=16`` (the bf16 op), ``cute-fp8 cute-quantize k=16`` (the fp8 op as the backend ships it, the
CuTe quantize pass included) and ``cute-fp8 kernel k=16``; no pipeline-depth, Triton,
torch-quantize op or quantize-pass lines. Each line is verified as without the flag.

Verification, per line and before it is timed, on that line's own output (a NaN-like poisoned
index buffer, ``testing.POISON_INT``): every slot written, and every (token, head) row's block
set equal to the torch reference's or different only by near-ties
(``testing.selection_mismatch``, scores recomputed in fp64; for the fp8 lines the reference
ranks the same quantized operands, ``reference.select(quantized=...)``, and the scores are
those of the dequantized operands, ``quant.dequantize``). At 1M the torch reference (an
``O(S^2)`` fp32 pass) and the CPU near-tie check are out of reach: a line there is checked
against the Triton kernel of its precision on the same inputs, passing when at most
:data:`MAX_DIFFERING` of the rows differ (the CuTe and Triton kernels returned identical
indices at 128K, top_k 16: docs/performance.md; the Triton fp8 line is then its own
reference, timed but not checked). The line prints the number of failing rows and PASS or
FAIL; a failing line is not timed.
"""

import argparse
import dataclasses
import functools

import torch

from flash_msa import bench, quant, reference, testing
from flash_msa.cute import quantize_sm90, select_sm90
from flash_msa.triton_ref import selection as triton_sel
from flash_msa.triton_ref import selection_fp8 as triton_fp8

# key-pipeline depths timed besides the default (SelectSm90.stages), top_k 16: 5 is the
# deepest bf16 one at Dp 128 beside the ring of block maxima (6 needs 233,472 bytes of shared
# memory, SelectSm90.can_implement)
STAGES = (2, 5)
FP8_STAGES = (4, 12)  # the fp8 kernel's, besides select_sm90.FP8_STAGES (12: its deepest)
FULL_CASES = [("paper", 131072), ("anchor", 32768)]
FP8_CASES = [("paper", 131072), ("long", 1048576)]
REFERENCE_MAX_S = 131072  # beyond this, lines are checked against the Triton kernel
MAX_DIFFERING = 1e-3  # the fraction of rows that may differ from Triton's there


def median_ms(fn):
    """Median of 10 timed calls after 2 warm-up calls (``flash_msa.bench.time_ms``)."""
    return bench.time_ms(fn, iters=10)


def verify(idx, ref, qp, kp, cu, cfg):
    """``(ok, text)``: the line's indices against the reference's ``ref`` (near-ties pass);
    ``qp``, ``kp``: the operands whose fp64 products rank the blocks."""
    unwritten = int((idx == testing.POISON_INT).sum())
    bad = testing.selection_mismatch(
        idx.cpu(), ref.cpu(), qp.cpu(), kp.cpu(), cfg.block_size, cfg.proxy_scale, cu.cpu()
    )
    ok = unwritten == 0 and bad == 0
    text = f"{'PASS' if ok else 'FAIL'} rows differing beyond near-ties {bad}"
    return ok, text + (f", unwritten slots {unwritten}" if unwritten else "")


def verify_against(idx, other):
    """``(ok, text)`` at sizes beyond the reference: the rows differing from ``other`` (the
    Triton kernel of the same precision) are at most :data:`MAX_DIFFERING` of all rows."""
    unwritten = int((idx == testing.POISON_INT).sum())
    rows = idx.shape[0] * idx.shape[1]
    differ = int((idx != other).any(-1).sum())
    ok = unwritten == 0 and differ <= MAX_DIFFERING * rows
    text = f"{'PASS' if ok else 'FAIL'} rows differing from Triton's {differ} of {rows}"
    return ok, text + (f", unwritten slots {unwritten}" if unwritten else "")


def fp8_op_into(out, qp, kp, cu, cfg):
    """The CuTe fp8 op into ``out``: the quantize pass, then the kernel (what
    ``select_sm90.select`` runs for ``selection_precision="fp8"``)."""
    qz = quant.quantize(qp, kp, cu, cfg.block_size)
    return select_sm90.select_fp8_into(out, qz, cu, cfg)


def fp8_op_cute_quantize_into(out, qp, kp, cu, cfg):
    """The CuTe fp8 op with the CuTe quantize pass (``quantize_sm90.quantize``, the Config's
    ``max_seqlen``: no host synchronization), then the kernel."""
    qz = quantize_sm90.quantize(qp, kp, cu, cfg.block_size, max_seqlen=cfg.max_seqlen)
    return select_sm90.select_fp8_into(out, qz, cu, cfg)


def cute_quantize_lines(head, qz, qp, kp, cu, cfg):
    """The CuTe quantize pass in each tuning variant: bitwise against the torch pass's ``qz``
    (bytes and scales), then timed (ms, and GB/s of its compulsory bytes)."""
    nbytes = (qp.numel() + kp.numel()) * (qp.element_size() + 1) + 4 * (
        qp.numel() + kp.numel()
    ) // qp.shape[-1]
    for vname, tuning in quantize_sm90.VARIANTS.items():
        fn = functools.partial(
            quantize_sm90.quantize, qp, kp, cu, cfg.block_size, max_seqlen=cfg.max_seqlen,
            **tuning,
        )  # fmt: skip
        got = fn(out=tuple(testing.poisoned(x.shape, x.dtype, "cuda") for x in qz[:4]))
        same = all(
            torch.equal(a.view(torch.uint8 if a.dtype == quant.E4M3 else torch.int32),
                        b.view(torch.uint8 if b.dtype == quant.E4M3 else torch.int32))
            for a, b in zip(got[:4], qz[:4])
        )  # fmt: skip
        line = f"{head} cute quantize [{vname}]: {'PASS' if same else 'FAIL'} bitwise"
        if not same:
            print(f"{line}; NOT TIMED", flush=True)
            continue
        ms = median_ms(fn)
        print(f"{line}; {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)


def fp8_kernel_into(qz, stages, out, qp, kp, cu, cfg):
    """The CuTe fp8 kernel alone on the quantized operands ``qz``."""
    return select_sm90.select_fp8_into(out, qz, cu, cfg, stages=stages)


def triton_fp8_into(qz, out, qp, kp, cu, cfg):
    """The Triton fp8 oracle on ``qz`` (copied into ``out``: it returns a new tensor)."""
    return out.copy_(triton_fp8.select_quantized(qz, cu, cfg))


def run_lines(head, lines, qp, kp, cu, S, Dp, Hp, check):
    """Verify (``check(out, cfg, name)`` -> ``(ok, text)``) and time each ``(name, cfg,
    into)`` line; ``into(out, qp, kp, cu, cfg)`` writes the indices into ``out``."""
    flops = 2 * Dp * Hp * S * (S + 1) / 2
    for name, c, into in lines:
        out = testing.poisoned((S, Hp, c.top_k), torch.int32, "cuda")
        into(out, qp, kp, cu, c)
        torch.cuda.synchronize()
        ok, text = check(out, c, name)
        line = f"{head} {name}: {text}"
        if not ok:
            print(f"{line}; NOT TIMED", flush=True)
            continue
        ms = median_ms(functools.partial(into, out, qp, kp, cu, c))
        print(f"{line}; {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


def inputs(shape, S, kind):
    """The proxies of the bench's shape (``testing.make_inputs``'s first two tensors, drawn
    first: the main heads are left out, the proxies are the same), packed, on the GPU."""
    _, _, _, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    qp, kp = testing.make_inputs(1, S, 1, 1, Hp, Hpk, 1, Dp, device="cuda", kind=kind, seed=0)[:2]
    return qp[0].contiguous(), kp[0].contiguous(), testing.cu([S], "cuda"), D, Dp, Hp


def bf16_ab(shape, S, kind):
    """The CuTe and Triton (exact) selections, top_k 16 and 64, and the CuTe pipeline depths."""
    qp, kp, cu, D, Dp, Hp = inputs(shape, S, kind)
    cfg = bench.step_config(S, D, Dp)
    lines = []  # (name, cfg, function writing the indices into a given buffer)
    for top_k in (bench.TOP_K, 64):
        c = dataclasses.replace(cfg, top_k=top_k)
        lines.append((f"cute k={top_k}", c, select_sm90.select_into))
        lines.append((f"triton k={top_k}", c, triton_sel.select_into))
    for stages in STAGES:
        variant = functools.partial(select_sm90.select_into, stages=stages)
        lines.append((f"cute k={bench.TOP_K} stages={stages}", cfg, variant))
    refs = {}  # top_k -> the reference's indices

    def check(out, c, name):
        if c.top_k not in refs:
            refs[c.top_k] = reference.select(qp, kp, cu, c)
        return verify(out, refs[c.top_k], qp, kp, cu, c)

    run_lines(f"{shape} S={S} {kind}", lines, qp, kp, cu, S, Dp, Hp, check)


def fp8_ab(shape, S, kind, top_ks, op_only=False):
    """bf16 CuTe against the fp8 CuTe op (quantize included), its kernel alone (and other
    pipeline depths) and the Triton fp8 oracle, on one input; ``op_only``: the bf16 op, the
    fp8 op with the CuTe quantize pass and the fp8 kernel alone, at ``bench.TOP_K`` only."""
    qp, kp, cu, D, Dp, Hp = inputs(shape, S, kind)
    head = f"{shape} S={S} {kind}"
    cfg = bench.step_config(S, D, Dp)
    qz = quant.quantize(qp, kp, cu, cfg.block_size)
    if not op_only:
        ms = median_ms(functools.partial(quant.quantize, qp, kp, cu, cfg.block_size))
        print(f"{head} quantize (rotation, e4m3, block scales): {ms:.3f} ms", flush=True)
        cute_quantize_lines(head, qz, qp, kp, cu, cfg)
    lines = []  # (name, cfg, into)
    for top_k in (bench.TOP_K,) if op_only else top_ks:
        c = dataclasses.replace(cfg, top_k=top_k)
        c8 = dataclasses.replace(c, selection_precision="fp8")
        lines.append((f"cute k={top_k}", c, select_sm90.select_into))
        if not op_only:
            lines.append((f"cute-fp8 k={top_k}", c8, fp8_op_into))
        lines.append((f"cute-fp8 cute-quantize k={top_k}", c8, fp8_op_cute_quantize_into))
        kernel = functools.partial(fp8_kernel_into, qz, select_sm90.FP8_STAGES)
        lines.append((f"cute-fp8 kernel k={top_k}", c8, kernel))
        if not op_only:
            lines.append((f"triton-fp8 k={top_k}", c8, functools.partial(triton_fp8_into, qz)))
    c8 = dataclasses.replace(cfg, selection_precision="fp8")
    for stages in () if op_only else FP8_STAGES:
        kernel = functools.partial(fp8_kernel_into, qz, stages)
        lines.append((f"cute-fp8 kernel k={bench.TOP_K} stages={stages}", c8, kernel))
    refs = {}  # (precision, top_k) -> the reference's (or at 1M Triton's) indices
    # the fp8 scores' operands (exact up to a positive row constant) for the near-tie rule
    qd, kd = quant.dequantize(qz) if S <= REFERENCE_MAX_S else (None, None)

    def check(out, c, name):
        fp8 = c.selection_precision == "fp8"
        ref = reference_indices(refs, c, qp, kp, cu, qz)
        if S > REFERENCE_MAX_S:
            return verify_against(out, ref)
        return verify(out, ref, qd if fp8 else qp, kd if fp8 else kp, cu, c)

    run_lines(head, lines, qp, kp, cu, S, Dp, Hp, check)


def reference_indices(refs, c, qp, kp, cu, qz):
    """The indices a line of config ``c`` is checked against, computed once per (precision,
    top_k) into ``refs``: the torch reference up to :data:`REFERENCE_MAX_S` tokens, the Triton
    kernel of the same precision beyond (the fp8 one on the same quantized operands ``qz``)."""
    fp8 = c.selection_precision == "fp8"
    key = (c.selection_precision, c.top_k)
    if key not in refs:
        S = c.max_seqlen
        if S > REFERENCE_MAX_S and fp8:
            refs[key] = triton_fp8.select_quantized(qz, cu, c)
        elif S > REFERENCE_MAX_S:
            refs[key] = triton_sel.select(qp, kp, cu, c)
        else:
            refs[key] = reference.select(qp, kp, cu, c, quantized=qz if fp8 else None)
    return refs[key]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fp8", action="store_true", help="only the bf16 / fp8 A/B")
    parser.add_argument(
        "--op-only",
        action="store_true",
        help="the fp8 A/B's op lines only, top_k 16: cute (bf16 op), cute-fp8 cute-quantize "
        "(the shipped fp8 op), cute-fp8 kernel",
    )
    parser.add_argument("--kinds", nargs="+", default=["random", "local"])
    parser.add_argument(
        "--fp8-cases",
        nargs="+",
        default=[f"{shape}:{S}" for shape, S in FP8_CASES],
        help="the fp8 A/B's cases, shape:S (default: paper:131072 long:1048576)",
    )
    args = parser.parse_args(argv)
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.fp8_cases]
    if not args.fp8:
        for shape, S in FULL_CASES:
            for kind in args.kinds:
                bf16_ab(shape, S, kind)
    for shape, S in cases:
        for kind in args.kinds:
            # top_k 64 at 1M: a 1M-token line takes ~1 s per call; 16 is the setting
            top_ks = (bench.TOP_K,) if S > REFERENCE_MAX_S else (bench.TOP_K, 64)
            fp8_ab(shape, S, kind, top_ks, args.op_only)


if __name__ == "__main__":
    main()
