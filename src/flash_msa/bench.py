"""``flash-msa bench``: MSA backends next to dense attention, in one run, on the same inputs.

For each shape, sequence length and input kind, and each provider (our GPU backends, dense
causal GQA by SDPA and, when importable, FlashAttention-4), it verifies the provider on a small
case (MSA backends: the selection and the whole training step it times, outputs and all five
gradients, by the tolerance rule of :func:`verify_msa`; a provider that fails is reported and
not timed), then times with CUDA events (median after warm-up): selection alone, forward, backward,
forward+backward with the KL in the loss; and the step's peak memory. TFLOP/s follow the MiniMax
conventions of docs/performance.md:

    sparse = selected visible (query, key) pairs, summed over rows, averaged over proxy heads
    SELECT = 2*Dp*Hp*causal      FWD = 4*D*H*sparse      BWD = 10*D*H*sparse
    KL     = 2*(D*H + 3*Dp*Hp)*sparse
    fwd counts SELECT + FWD + KL, bwd counts BWD, fwd+bwd counts all four; dense providers
    count 4*D*H*causal (fwd) and 14*D*H*causal (fwd+bwd).

With ``cuda_graph`` (``flash-msa bench --cuda-graph``) each provider's training step (and, for
MSA, the ``compute_kl=False`` step) is also timed as the replay of one ``torch.cuda.CUDAGraph``
captured from it (:func:`graph_replay_ms`): what a trainer under CUDA graphs (``torch.compile``
mode ``"reduce-overhead"``) pays, without the host's time to enqueue the step's ~120 kernels,
which bounds the eager step at 16K (5.6-5.8 ms of host time for 5.65 ms of GPU work, H200).
The replay is checked against eager steps before it is timed (:func:`graph_mismatch`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from . import backends, diagnostics, reference, testing
from .api import msa_attention, select_blocks
from .backends import forced
from .diagnostics import sample_problem, version
from .problem import Config
from .version import __version__

SHAPES = {  # B, H, Hkv, Hp, Hpk, D, Dp, default seqlens
    "anchor": (1, 16, 2, 4, 1, 128, 128, (16384, 32768)),
    "paper": (1, 64, 4, 4, 1, 128, 128, (32768, 131072)),
    "long": (1, 16, 2, 4, 1, 128, 128, (131072, 262144, 524288, 1048576)),
}
BLOCK, TOP_K, PEAK_TFLOPS = 128, 16, 989.0


def step_config(S: int, D: int, Dp: int, *, top_k: int = None, block_size: int = None):
    """The :class:`~flash_msa.problem.Config` of the benchmarked step on one sequence of ``S``
    tokens (default scales, KL value on; ``top_k``/``block_size`` default to the bench's)."""

    return Config(
        block_size=BLOCK if block_size is None else block_size,
        softmax_scale=D**-0.5,
        max_seqlen=S,
        proxy_scale=Dp**-0.5,
        top_k=TOP_K if top_k is None else top_k,
        warmup=False,
        compute_kl=True,
    )


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_ms(fn, warmup=2, iters=5):
    """Median milliseconds of ``fn`` by CUDA events, after ``warmup`` calls (the one timer of
    ``flash-msa bench`` and the A/B scripts)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sparse_pairs(indices, S, block_size):
    """Selected visible (query, key) pairs, summed over queries, averaged over heads (batch
    form ``(B, S, Hp, K)``, equal lengths)."""
    i = torch.arange(S, device=indices.device)[None, :, None, None]
    n = indices.long()
    blk_len = torch.clamp(S - n * block_size, max=block_size)
    vis = torch.clamp(torch.minimum(i - n * block_size + 1, blk_len), min=0)
    vis = torch.where(n >= 0, vis, 0)
    return vis.sum().item() / indices.shape[2]


def _flops(shape, S, pairs):
    B, H, Hkv, Hp, Hpk, D, Dp, _ = shape
    causal = B * S * (S + 1) / 2
    sel = 2 * Dp * Hp * causal
    fwd = 4 * D * H * pairs
    bwd = 10 * D * H * pairs
    kl = 2 * (D * H + 3 * Dp * Hp) * pairs
    return dict(
        select=sel,
        fwd=sel + fwd + kl,
        bwd=bwd,
        step=sel + fwd + bwd + kl,
        dense_fwd=4 * D * H * causal,
        dense_step=14 * D * H * causal,
    )


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func  # FlashAttention-4

        return flash_attn_func
    except Exception:  # not installed, or not for this GPU
        return None


def _dense_providers():
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)

    prov = {"sdpa": sdpa}
    fa4 = _fa4()
    if fa4 is not None:

        def fa4_fn(q, k, v):
            out = fa4(q, k, v, causal=True)
            return out[0] if isinstance(out, tuple) else out

        prov["fa4"] = fa4_fn
    return prov


def _mix(prov):
    """``FLASH_MSA_BACKEND`` for provider ``prov``'s forward and backward: a backend that lacks
    some op (CuTe: only ``select`` so far) runs as ``auto`` does, its own kernels where it has
    them and Triton for the rest; its ``select`` is still timed forced."""
    return "auto" if prov == "cute" else prov


def verify_msa(
    backend,
    shape,
    *,
    S=4096,
    top_k=TOP_K,
    block_size=BLOCK,
    device="cuda",
    dtype=torch.bfloat16,
    seed=123,
):
    """Verify provider ``backend`` on one ``S``-token sequence of ``shape``'s heads before it is
    timed: its selection (as sets, near-ties accepted) against the reference's, then the whole
    training step it is timed on (``msa_attention`` forward and the backward of
    :func:`flash_msa.testing.training_loss`, O(1) gradients in all five inputs): ``out``, ``kl``
    and the five gradients by the rule ``err <= 2 * err(same-dtype reference) + atol``, both
    errors against the fp32 reference (fp64 for an fp32 run) on the backend's own indices
    (:func:`flash_msa.diagnostics.compare`).

    ``S = 4096`` has 32 blocks of 128, so ``top_k = 16`` is sparse. ``device``/``dtype`` let the
    function run on the CPU in fp32 (a test; the benchmark itself needs a GPU).
    Returns ``(ok, message)``; the message names the failing quantities.
    """

    B, H, Hkv, Hp, Hpk, D, Dp, _ = shape
    xs = testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=device, seed=seed)
    with forced(backend):
        idx = select_blocks(xs[0], xs[1], top_k, block_size=block_size)
    cu = testing.cu([S], device)
    cfg = step_config(S, D, Dp, top_k=top_k, block_size=block_size)
    flat = [x[0] for x in xs]
    ref_idx = reference.select(*flat[:2], cu, cfg)
    bad = testing.selection_mismatch(
        idx[0].cpu(), ref_idx.cpu(), flat[0].cpu(), flat[1].cpu(), block_size, Dp**-0.5
    )
    with forced(_mix(backend)):
        mine = diagnostics.step(xs, top_k, block_size=block_size, seed=seed)
    up = torch.float64 if dtype == torch.float32 else torch.float32  # exact: one precision up
    exact = diagnostics.reference_step([x.to(up) for x in flat], idx[0], cu, cfg, seed=seed)
    same = diagnostics.reference_step(flat, idx[0], cu, cfg, seed=seed, upcast=False)
    rows = diagnostics.compare(mine, same, exact)
    failed = [f"{q} {err:.2e} > {tol:.2e}" for q, err, tol, ok in rows if not ok]
    msg = f"selection rows differing {bad}; " + (
        "FAILED: " + ", ".join(failed)
        if failed
        else "out, kl, 5 grads within tol (worst err/tol "
        f"{max(err / tol if tol else math.inf for _, err, tol, _ in rows):.2f})"
    )
    return bad == 0 and not failed, msg


def _verify_dense(fn, shape):
    B, H, Hkv, Hp, Hpk, D, Dp, _ = shape
    q = torch.randn(1, 512, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 512, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    g = H // Hkv
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.float().repeat_interleave(g, 2)) * D**-0.5
    s = s.masked_fill(torch.ones(512, 512, device="cuda").triu(1).bool(), -math.inf)
    ref = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v.float().repeat_interleave(g, 2))
    err = (fn(q, k, v).float() - ref).abs().max().item()
    return err < 0.05, f"max |out err| {err:.2e}"


def run(
    shapes,
    seqlens,
    backends,
    inputs,
    iters=5,
    dense_names=("sdpa", "fa4"),
    precisions=("bf16",),
    cuda_graph=False,
):
    """Yield one result dict per (shape, S, input kind, provider, selection precision): each
    MSA provider runs once per ``precisions`` entry (``selection_precision``: ``"bf16"``
    exact, ``"fp8"`` the opt-in approximate selection), a dense one once. ``cuda_graph`` adds
    the graphed steps' keys (:func:`_measure_graph`) after the eager ones are measured."""

    dense = {k: v for k, v in _dense_providers().items() if k in dense_names}
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        B, H, Hkv, Hp, Hpk, D, Dp, default = shape
        verified, why = {}, {}
        for prov in [*backends, *dense]:
            try:
                ok, msg = (
                    verify_msa(prov, shape)
                    if prov in backends
                    else _verify_dense(dense[prov], shape)
                )
            except Exception as e:  # a provider that crashes is reported, not timed
                ok, msg = False, f"raised {type(e).__name__}: {e}"
            verified[prov], why[prov] = ok, msg
            _log(f"[verify] {shape_name} {prov}: {'ok' if ok else 'FAILED'} ({msg})")
        for S in seqlens or default:
            for kind in inputs:
                xs = testing.make_inputs(
                    B,
                    S,
                    H,
                    Hkv,
                    Hp,
                    Hpk,
                    D,
                    Dp,
                    dtype=torch.bfloat16,
                    device="cuda",
                    kind=kind,
                    seed=0,
                )
                base = dict(
                    shape=shape_name,
                    S=S,
                    inputs=kind,
                    B=B,
                    H=H,
                    Hkv=Hkv,
                    Hp=Hp,
                    Hpk=Hpk,
                    D=D,
                    Dp=Dp,
                    block_size=BLOCK,
                    top_k=TOP_K,
                )
                pairs = None
                runs = [(p, prec) for p in backends for prec in precisions]
                for prov, prec in [*runs, *((p, None) for p in dense)]:
                    if not verified[prov]:
                        yield dict(base, provider=prov, error=f"verification failed: {why[prov]}")
                        continue
                    if prov in dense and kind == "local":
                        continue  # dense attention does not depend on the proxy inputs
                    _log(f"[run] {shape_name} S={S} {kind} {prov} {prec or ''} ...")
                    t0 = time.time()
                    try:
                        res = _measure(prov, xs, dense, iters, prec or "bf16")
                    except torch.cuda.OutOfMemoryError as e:
                        res = dict(error=f"out of memory: {str(e).splitlines()[0]}")
                    torch.cuda.empty_cache()
                    if cuda_graph and "error" not in res:  # after, so the eager keys are as before
                        res.update(_measure_graph(prov, xs, dense, iters, prec or "bf16"))
                    if prov in backends and "error" not in res:
                        with forced(prov), torch.no_grad():
                            idx = select_blocks(xs[0], xs[1], TOP_K, selection_precision=prec)
                        pairs = sparse_pairs(idx, S, BLOCK)  # (FLOPs of this selection's pairs)
                        del idx
                    fl = _flops(shape, S, pairs or 0)
                    for key, fkey in (
                        ("select_ms", "select"),
                        ("fwd_ms", "fwd"),
                        ("bwd_ms", "bwd"),
                        ("step_ms", "step"),
                        ("step_graph_ms", "step"),
                    ):
                        if prov in dense:
                            fkey = {
                                "fwd_ms": "dense_fwd",
                                "step_ms": "dense_step",
                                "step_graph_ms": "dense_step",
                            }.get(key)
                        if res.get(key) and fkey:
                            res[key.replace("_ms", "_tflops")] = fl[fkey] / res[key] / 1e9
                    _log(f"      done in {time.time() - t0:.1f}s: {res}")
                    yield dict(
                        base, provider=prov, selection_precision=prec, sparse_pairs=pairs, **res
                    )
                del xs
                torch.cuda.empty_cache()


def _measure(prov, xs, dense, iters, precision="bf16"):

    sel = dict(selection_precision=precision)
    leaves = [x.detach().requires_grad_() for x in xs]
    res = {}
    if prov in dense:
        q, k, v = leaves[2:]
        dout = torch.randn_like(q)
        fn = dense[prov]
        res["fwd_ms"] = time_ms(lambda: fn(q, k, v), iters=iters)

        def step():  # (autograd.grad: no .grad accumulation adds, as in the graphed step)
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    else:
        dout = torch.randn_like(leaves[2])
        with forced(prov), torch.no_grad():
            res["select_ms"] = time_ms(
                lambda: select_blocks(leaves[0], leaves[1], TOP_K, **sel), iters=iters
            )
        with forced(_mix(prov)), torch.no_grad():
            res["fwd_ms"] = time_ms(lambda: msa_attention(*leaves, TOP_K, **sel), iters=iters)

        # autograd.grad, not backward() into .grad: a step that kept the leaves' .grad added
        # each new gradient to it (five bf16 adds here, three for a dense provider: 78 us of
        # GPU time and ~60 us of host time at anchor 16K, H200), which a training loop that
        # sets the grads to None does not pay; the graphed step takes them the same way
        def step(compute_kl=True):
            with forced(_mix(prov)):
                out, kl = msa_attention(*leaves, TOP_K, compute_kl=compute_kl, **sel)
                torch.autograd.grad([out, kl], leaves, [dout, torch.ones_like(kl)])

        # the same step without the KL value (its gradient stays exact)
        res["step_nokl_ms"] = time_ms(lambda: step(False), iters=iters)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res["step_ms"] = time_ms(step, iters=iters)
    res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    res["bwd_ms"] = res["step_ms"] - res["fwd_ms"]
    return res


def graph_mismatch(names, graph, eager, again):
    """The quantities where a CUDA graph's replay differs from an eager step on the same inputs
    (``[]``: none), as ``"name err > tol"`` strings; every argument a sequence of tensors in the
    order of ``names`` (outputs, then gradients).

    The yardstick is the eager step itself: ``again`` is a second eager step, and the rule is
    :func:`flash_msa.testing.tolerance`'s with ``eager`` in the exact value's place, ``err(graph
    vs eager) <= 2 * err(again vs eager) + atol`` (atol: one rounding of the dtype at the scale
    of ``eager``). Why not bitwise: the timed step is the default, non-deterministic one (fp32
    atomics in the backward), and ``deterministic=True`` runs other kernels than the ones
    timed, so a bitwise check in that mode would not check the graph that reports the time.
    The bf16 outputs of a reordered fp32 accumulation differ by at most about one rounding,
    which atol covers; the KL value is summed without atomics. A graph that skipped a kernel
    (its outputs poisoned with NaN before the replay, :func:`graph_replay_ms`) fails with
    ``err = inf``, and one that computed something else fails by the size of the values."""

    bad = []
    for name, mine, ref, ref2 in zip(names, graph, eager, again, strict=True):
        if mine.shape != ref.shape:
            bad.append(f"{name} shape {tuple(mine.shape)} != {tuple(ref.shape)}")
            continue
        err, tol = testing.max_err(mine, ref), testing.tolerance(ref, ref2, mine.dtype)
        if not err <= tol:
            bad.append(f"{name} {err:.2e} > {tol:.2e}")
    return bad


def graph_replay_ms(step, names, iters=5):
    """Median milliseconds of one replay of a ``torch.cuda.CUDAGraph`` captured from ``step``,
    after checking one replay against eager steps (:func:`graph_mismatch`); raises
    ``RuntimeError`` naming the quantities that differ.

    ``step()``: one training step on static inputs, returning its outputs and gradients (the
    order of ``names``) as new tensors, with no host synchronization (the MSA op is capture-safe:
    tests/ops/test_msa.py -k sync_free). The recipe of the torch docs ("CUDA Graphs", whole-network
    capture): warm-up calls on a side stream (compiles the kernels, fills the allocator's cache
    outside the capture), capture of one call, its returned tensors the static outputs, which
    live in the graph's private memory pool. The pool is freed before returning, whatever
    happens (graph and static tensors deleted, ``torch.cuda.empty_cache()``), so the next
    provider runs with the memory it would have had without the graph."""

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager, again = step(), step()
    graph, static = torch.cuda.CUDAGraph(), ()
    try:
        with torch.cuda.graph(graph):
            static = step()
        # NaN in every output before the replay: what the replay does not write cannot equal
        # the eager value (the capture itself ran no kernel, so these buffers hold garbage that
        # might otherwise match by accident)
        testing.poison(*static)
        graph.replay()
        torch.cuda.synchronize()
        bad = graph_mismatch(names, static, eager, again)
        if bad:
            raise RuntimeError("CUDA graph replay differs from the eager step: " + ", ".join(bad))
        return time_ms(graph.replay, iters=iters)
    finally:
        del graph, static, eager, again
        torch.cuda.empty_cache()


def graph_steps(prov, leaves, dense, precision="bf16"):
    """``{result key: (step, names)}``: the training steps :func:`_measure_graph` captures, for
    provider ``prov`` on the leaves ``(q_proxy, k_proxy, q, k, v)`` (requiring grad). Each
    ``step()`` returns ``out`` (and ``kl``), then the gradients, new tensors every call
    (``torch.autograd.grad``, not ``.grad``: in a capture they are allocated from the graph's
    pool, and no accumulation kernel is added; the eager ``step_ms`` takes them the same way).
    The incoming gradients are those of the eager step: a random
    ``dout``, ``dkl = 1``. Runs on any device (a CPU test calls the steps).

    The outputs are returned detached: a step's autograd graph must not outlive the step. An
    output that keeps its ``grad_fn`` keeps the leaves' ``AccumulateGrad`` nodes alive, with the
    stream they were made on; :func:`graph_replay_ms` holds the eager steps' outputs while it
    captures, so the captured backward met nodes of the default stream and synchronized that
    stream, which is not capturing, with the capture stream: the first capture of every process
    failed with "operation failed due to a previous error during capture" (torch warns "The
    AccumulateGrad node's stream does not match ..."). On the H200 the forward alone and a
    pure-torch step captured first were fine; the MSA step with its backward failed first in
    every order, capture error mode and with the garbage collector off."""

    if prov in dense:
        fn, (q, k, v) = dense[prov], leaves[2:]
        dout = torch.randn_like(q)

        def step():
            out = fn(q, k, v)
            return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

        return {"step_graph_ms": (step, ("out", "dq", "dk", "dv"))}
    dout = torch.randn_like(leaves[2])
    names = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")

    def msa_step(compute_kl):
        with forced(_mix(prov)):
            out, kl = msa_attention(
                *leaves, TOP_K, compute_kl=compute_kl, selection_precision=precision
            )
            grads = torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))
            return (out.detach(), kl.detach(), *grads)

    return {
        "step_graph_ms": (lambda: msa_step(True), names),
        "step_nokl_graph_ms": (lambda: msa_step(False), names),
    }


def _measure_graph(prov, xs, dense, iters, precision="bf16"):
    """The graphed steps' keys of one provider (:func:`graph_replay_ms` of each
    :func:`graph_steps` entry): ``step_graph_ms`` (and ``step_nokl_graph_ms`` for MSA), or,
    where a capture or its check failed, ``graph_error`` (the step and the exception's first
    line; the other step is still tried) in place of the step's time."""
    leaves = [x.detach().requires_grad_() for x in xs]
    res, errors = {}, []
    for key, (step, names) in graph_steps(prov, leaves, dense, precision).items():
        try:
            res[key] = graph_replay_ms(step, names, iters)
        except Exception as e:  # reported in the row, never a crash of the whole bench
            lines = str(e).strip().splitlines()
            errors.append(f"{key}: {type(e).__name__}: {lines[0] if lines else ''}")
        torch.cuda.empty_cache()  # here, not in the except: its traceback held the tensors
    if errors:
        res["graph_error"] = "; ".join(errors)
    return res


def source_commit(package_dir: str) -> str | None:
    """The git commit of ``package_dir`` (flash_msa's own directory) when it is the
    ``src/flash_msa`` of a git work tree, i.e. a checkout of this project; ``None`` otherwise.
    An installed copy (site-packages) gets ``None`` even when some repository encloses it: that
    repository's commit says nothing about the installed code."""
    package_dir = os.path.realpath(package_dir)

    def git(*args):
        try:
            res = subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=package_dir, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if not top or os.path.realpath(os.path.join(top, "src", "flash_msa")) != package_dir:
        return None
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no", "--", "."):
        commit += "-dirty"  # the package's tracked files differ from the commit
    return commit


def environment():

    # FLASH_MSA_COMMIT: for a run from a tree that is not a git checkout (an unpacked sdist)
    commit = os.environ.get("FLASH_MSA_COMMIT") or source_commit(os.path.dirname(__file__))
    return dict(
        flash_msa=__version__,
        commit=commit,
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        torch=torch.__version__,
        triton=version("triton"),
        cutlass=version("nvidia-cutlass-dsl"),
        flash_attn_4=_fa4() is not None,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def table(rows):
    cols = [
        ("shape", "{}"),
        ("S", "{}"),
        ("inputs", "{}"),
        ("provider", "{}"),
        ("selection_precision", "{}"),
        ("select_ms", "{:.3f}"),
        ("select_tflops", "{:.0f}"),
        ("fwd_ms", "{:.3f}"),
        ("fwd_tflops", "{:.0f}"),
        ("bwd_ms", "{:.3f}"),
        ("step_ms", "{:.3f}"),
        ("step_tflops", "{:.0f}"),
        ("step_nokl_ms", "{:.3f}"),
        ("peak_gib", "{:.2f}"),
        ("step_pct_peak", "{:.0f}%"),
        ("speedup_vs_sdpa", "{:.2f}x"),
        ("speedup_vs_fa4", "{:.2f}x"),
    ]
    graphed = [  # only with --cuda-graph: the eager table is unchanged without it
        ("step_graph_ms", "{:.3f}"),
        ("step_nokl_graph_ms", "{:.3f}"),
        ("graph_speedup_vs_sdpa", "{:.2f}x"),
        ("graph_speedup_vs_fa4", "{:.2f}x"),
        ("graph_error", "{:.40}"),
    ]
    for base in ("sdpa", "fa4"):  # fwd+bwd speedup against each dense baseline, same (shape, S)
        for key, name in (("step_ms", "speedup_vs"), ("step_graph_ms", "graph_speedup_vs")):
            ref = {(r["shape"], r["S"]): r.get(key) for r in rows if r["provider"] == base}
            for r in rows:
                t = ref.get((r["shape"], r["S"]))
                if t and r.get(key):
                    r[f"{name}_{base}"] = t / r[key]
    cols += [c for c in graphed if any(r.get(c[0]) is not None for r in rows)]
    for r in rows:
        if r.get("step_tflops"):
            r["step_pct_peak"] = 100 * r["step_tflops"] / PEAK_TFLOPS

    def cell(r, c, fmt):
        if c == "provider" and "error" in r:
            return f"{r[c]} (ERROR: {r['error'][:40]})"
        return fmt.format(r[c]) if r.get(c) is not None else "-"

    cells = [[c for c, _ in cols]] + [[cell(r, c, fmt) for c, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for key in sorted({(r["shape"], r["inputs"], r["provider"]) for r in rows}):
        pts = sorted(
            (r["S"], r["step_ms"])
            for r in rows
            if (r["shape"], r["inputs"], r["provider"]) == key and r.get("step_ms")
        )
        if pts:
            ax.loglog(*zip(*pts), marker="o", label=" ".join(map(str, key)))
    ax.set_xlabel("sequence length")
    ax.set_ylabel("forward+backward (ms)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(args) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("flash-msa bench needs a CUDA GPU (the CLI runs `check` instead)")

    cuda_graph = getattr(args, "cuda_graph", False)
    names = args.backends or [
        n
        for n in ("cute", "triton")
        if backends.reason_not(n, "select", sample_problem("cuda")) is None
    ]
    rows = list(
        run(
            args.shape, args.seqlen, names, args.inputs, args.iters, args.dense,
            args.selection_precision, cuda_graph,
        )
    )  # fmt: skip
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(), results=rows), f, indent=1)
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            _log("matplotlib is not installed: no plot")
    # a graph that could not be captured or differs from the eager step fails the run too (its
    # row keeps the eager times; graph_error says why the graphed one is missing); running out
    # of memory, eager or graphed, is a result, not a failure
    failed = [
        part
        for r in rows
        for part in [r.get("error", ""), *r.get("graph_error", "").split("; ")]
        if part and "memory" not in part.lower()
    ]
    return 1 if failed else 0
