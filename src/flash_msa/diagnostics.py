"""``info()``: what this machine has and which backend each op would use; ``check()``: every
available backend against an independent brute-force computation on small problems."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import sys

import torch

from . import backends, limits, reference, testing
from .api import msa_attention, select_blocks
from .problem import Config, Problem, Saved, problem_of
from .version import __version__


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices() -> list[str]:
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devs


def sample_problem(device: str) -> Problem:
    """The anchor shape (H=16, Hkv=2, Hp=4, Hpk=1, D=Dp=128, block 128, top_k 16) in bf16."""
    cfg = Config(
        block_size=128,
        softmax_scale=128**-0.5,
        max_seqlen=16384,
        proxy_scale=128**-0.5,
        top_k=16,
        warmup=False,
        compute_kl=True,
    )
    return problem_of(device, torch.bfloat16, (16, 2, 128, 4, 1, 128), 1, False, cfg)


def explain(op: str, problem: Problem) -> tuple[str | None, str]:
    """``(backend, why)`` for one op of ``problem``; backend is ``None`` if none can run it."""
    choice = backends.requested()
    if choice != "auto":
        why = backends.reason_not(choice, op, problem)
        return (choice, f"forced by FLASH_MSA_BACKEND={choice}") if why is None else (None, why)
    name, rejected = backends.choose(op, problem)
    skipped = "; ".join(f"{n}: {w}" for n, w in rejected)
    return name, "auto" + (f" ({skipped})" if skipped else "")


def info() -> dict:
    """Versions, devices, backend availability and, per device, the backend of each op.

    The per-op choice is shown for the anchor shape in bf16 (a call with other head dims or
    sizes may pick differently: the choice is made per call).
    """
    devices = {}
    for dev in _devices():
        entry = {}
        if dev.startswith("cuda"):
            entry["name"] = torch.cuda.get_device_name(dev)
            entry["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(dev))
        problem = sample_problem(dev)
        entry["ops"] = {
            op: dict(zip(("backend", "why"), explain(op, problem))) for op in backends.OPS
        }
        devices[dev] = entry
    return {
        "versions": {
            "python": platform.python_version(),
            "flash-msa": __version__,  # the tree's own (pyproject reads it too)
            "torch": torch.__version__,
            "triton": version("triton"),
            "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl"),
            "cuda (torch)": torch.version.cuda,
        },
        "environment": {
            var: os.environ.get(var)
            for var in ("FLASH_MSA_BACKEND", "TRITON_INTERPRET", "FLASH_MSA_DEBUG")
        },
        "backends": {
            name: backends.load(name)[1]
            or backends.load(name)[0].unavailable_reason()
            or "available"
            for name in backends.MODULES
        },
        "limits": limits_table(),
        "devices": devices,
    }


def limits_table() -> dict:
    """Each importable backend's declared limits per op (``LIMITS``, :mod:`flash_msa.limits`),
    as text: the README's backend table shows the same cells."""
    table = {}
    for name in backends.MODULES:
        module, why = backends.load(name)
        if module is not None:
            table[name] = dict(limits.rows(name, module.LIMITS))
    return table


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------
# (name, B or lengths, H, Hkv, Hp, Hpk, D, Dp, block_size, top_k, warmup)
CASES = (
    ("batch b64", 2, 4, 2, 2, 1, 32, 16, 64, 2, False),  # S = 160: partial last block
    ("varlen Hp<Hkv", (70, 1, 130, 64), 8, 4, 2, 2, 16, 16, 64, 3, False),
    ("batch b128 Hp>Hkv", 1, 8, 1, 4, 2, 16, 32, 128, 2, False),
    ("warmup varlen", (50, 90), 4, 2, 4, 1, 16, 16, 64, 1, True),
)
_SEQLEN = {64: 160, 128: 300}
QUANTITIES = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")

# The same-dtype yardstick of the tolerance rule is the torch backend's code, bound here once:
# the backend under test may be the torch backend itself (or a patched one in a test), and a
# backend must not move its own yardstick. (A textual bug in reference.py moves both; the CPU
# tests hold the reference to testing.brute_force for that.)
_reference_fwd, _reference_bwd = reference.fwd, reference.bwd


def step(inputs, top_k, *, seed=0, **kw) -> dict:
    """One training step of :func:`~flash_msa.msa_attention` on the backend(s) currently forced:
    forward, then backward of :func:`flash_msa.testing.training_loss` (``rows = Hp * T``).

    Args:
        inputs: ``(q_proxy, k_proxy, q, k, v)`` in batch or varlen form (not modified).
        top_k, kw: passed to ``msa_attention`` (``block_size``, ``cu_seqlens``, ...).
    Returns:
        ``{quantity: tensor}`` for :data:`QUANTITIES`, packed ``(T, heads, dim)`` (``kl`` 0-dim).
    """
    leaves = [x.detach().requires_grad_() for x in inputs]
    out, kl = msa_attention(*leaves, top_k, **kw)
    rows = inputs[0].shape[-2] * out.shape[:-2].numel()
    testing.training_loss(out, kl, rows, seed).backward()
    grads = [x.grad.reshape(-1, *x.shape[-2:]) for x in leaves]
    return dict(zip(QUANTITIES, (out.detach().reshape(-1, *out.shape[-2:]), kl.detach(), *grads)))


def reference_step(inputs, indices, cu_seqlens, cfg: Config, *, seed=0, upcast=True) -> dict:
    """The same step (same loss, same ``indices``) by the torch backend's ``fwd``/``bwd``.

    Args:
        inputs: packed ``(q_proxy, k_proxy, q, k, v)``, ``(T, heads, dim)``; their dtype is the
            step's dtype.
        indices: ``(T, Hp, K)`` int32 (the backend's own selection) or ``None`` (warmup).
        upcast: ``False`` computes the forward's matmuls in the input dtype: the same-dtype
            reference of the tolerance rule; ``True`` with inputs one precision up (fp32 for a
            bf16 step, fp64 for an fp32 one): the exact value.
    Returns:
        ``{quantity: tensor}`` as :func:`step`.
    """
    qp, kp, q, k, v = inputs
    fwd = _reference_fwd(q, k, v, indices, cu_seqlens, cfg, qp, kp, upcast=upcast)
    dout, w = testing.loss_weights(fwd.out.shape, qp.shape[1] * qp.shape[0], seed, q.device)
    dkl = torch.tensor(w, dtype=torch.float32, device=q.device)  # as autograd gives kl.float()
    saved = Saved(q, k, v, fwd.out, fwd.lse, indices, qp, kp, fwd.proxy_lse)
    g = _reference_bwd(dout.to(q.dtype), dkl, saved, cu_seqlens, cfg, upcast=upcast)
    return dict(zip(QUANTITIES, (fwd.out, fwd.kl, g.dq_proxy, g.dk_proxy, g.dq, g.dk, g.dv)))


def exact_step(inputs, selection, *, block_size, cu_seqlens=None, warmup=False, seed=0) -> dict:
    """The same step by :func:`flash_msa.testing.brute_force` in fp64 (no code shared with the
    backends) on ``selection`` (nested lists, :func:`flash_msa.testing.indices_to_lists`).

    ``inputs`` in batch or varlen form, on the CPU; returns ``{quantity: fp64 tensor}`` packed.
    """
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    ref = testing.brute_force(
        *leaves, selection, block_size=block_size, cu_seqlens=cu_seqlens, warmup=warmup
    )
    out = ref["out"].reshape(-1, *ref["out"].shape[-2:])
    dout, w = testing.loss_weights(out.shape, inputs[0].shape[-2] * out.shape[0], seed)
    ((out * dout.double()).sum() + w * ref["kl"]).backward()
    grads = [x.grad.reshape(-1, *x.shape[-2:]) for x in leaves]
    return dict(zip(QUANTITIES, (out.detach(), ref["kl"].detach(), *grads)))


def _tolerance(exact, same, dtype) -> float:
    """:func:`flash_msa.testing.tolerance`, with the atol of a 0-dim ``exact`` (the KL) measured
    over 64 values spread over ``[exact, 2 * exact)``. ``rounding_atol`` is the largest
    ``x + 0.3 - 0.3`` round-trip error over the elements, and a lone value can round-trip
    exactly (every fp32 value in [0.5, 0.7) does: 0.3f is a multiple of 2**-24), which left the
    rule with atol 0 and failed Triton's fp32 KL of 0.61 at 1 ulp (4.9e-8 against 2.0e-8)."""
    tol = testing.tolerance(exact, same, dtype)
    if exact.dim() == 0:
        near = exact.double().cpu() * (1 + torch.arange(64, dtype=torch.float64) / 64)
        tol += testing.rounding_atol(near, dtype) - testing.rounding_atol(exact, dtype)
    return tol


def compare(mine: dict, same: dict, exact: dict) -> list[tuple[str, float, float, bool]]:
    """Rows ``(quantity, err, tol, passed)`` by the rule of :func:`flash_msa.testing.tolerance`:
    ``err(mine) <= 2 * err(same) + atol``, both against ``exact``, atol from the rounding of
    ``mine``'s dtype. A quantity whose exact value is not larger than twice its tolerance could
    not fail (a never-written zero output would pass): it fails, as in
    :func:`flash_msa.testing.assert_close`, with a note in its name."""
    rows = []
    for name in QUANTITIES:
        a, s, e = mine[name], same[name], exact[name].to(mine[name].device)
        if a.shape != e.shape:
            rows.append((f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}", math.inf, 0, False))
            continue
        err, tol = testing.max_err(a, e), _tolerance(e, s, a.dtype)
        scale = e.detach().abs().max().item() if e.numel() else 0.0
        if scale <= 2 * tol:
            rows.append((f"{name} (cannot fail: max|exact| {scale:.1e})", err, tol, False))
        else:
            rows.append((name, err, tol, err <= tol))
    return rows


def _run_case(case, device, dtype, seed, select_only=False):
    """Rows ``(quantity, err, tol, passed)`` of one case on the currently forced backend (only
    the selection when ``select_only``)."""
    name, shape, H, Hkv, Hp, Hpk, D, Dp, b, top_k, warmup = case
    varlen = isinstance(shape, tuple)
    S = sum(shape) if varlen else _SEQLEN[b]
    B = 1 if varlen else shape
    inputs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed)
    cu = testing.cu(shape) if varlen else testing.cu([S] * B)
    if varlen:
        inputs = tuple(x[0] for x in inputs)
    on_dev = [x.to(device) for x in inputs]
    kw = dict(block_size=b)
    if varlen:
        kw.update(cu_seqlens=cu.to(device), max_seqlen=max(shape))
    rows, idx, selection = [], None, None
    if not warmup:
        idx = select_blocks(*on_dev[:2], top_k, **kw)
        truth = testing.brute_force_select(
            *inputs[:2], top_k, b, Dp**-0.5, None if not varlen else cu
        )
        truth_t = torch.tensor([[r + [-1] * (top_k - len(r)) for r in tok] for tok in truth])
        bad = testing.selection_mismatch(
            idx.cpu(), truth_t.view(idx.shape), *inputs[:2], b, Dp**-0.5, cu if varlen else None
        )
        rows.append(("selection: rows differing", float(bad), 0.0, bad == 0))
        selection = testing.indices_to_lists(idx.cpu())
        idx = idx.reshape(-1, Hp, idx.shape[-1])
    if select_only:
        return rows
    mine = step(on_dev, top_k, warmup=warmup, seed=seed, **kw)
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=max(shape) if varlen else S,
        proxy_scale=Dp**-0.5,
        top_k=None if warmup else top_k,
        warmup=warmup,
        compute_kl=True,
    )
    packed = [x.reshape(-1, *x.shape[-2:]) for x in on_dev]
    same = reference_step(packed, idx, cu.to(device), cfg, seed=seed, upcast=False)
    exact = exact_step(
        inputs, selection, block_size=b, cu_seqlens=cu if varlen else None, warmup=warmup, seed=seed
    )
    return rows + compare(mine, same, exact)


def check(seed: int = 0, names=None):
    """Run every backend that can run here (or those in ``names``) on :data:`CASES`; yield
    result rows.

    Each row is a dict with ``backend, device, case, quantity, err, tol, status`` where status is
    ``PASS``, ``FAIL`` or ``NOT RUN`` (with the reason in ``quantity``). On the CPU the check
    runs in fp32, on a GPU in bf16. The selection must match an fp64 brute force up to near-ties;
    the step's ``out``, ``kl`` and five gradients (of :func:`flash_msa.testing.training_loss`,
    O(1) in every input) pass by the rule ``err <= 2 * err(same-dtype reference) + atol``: both
    errors are max-abs against the fp64 brute force on the backend's own selection, the
    same-dtype reference is the torch backend's ``fwd``/``bwd`` (``upcast=False``, inputs in the
    checked dtype) on that selection, atol the dtype's rounding at the exact value's scale.
    """
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
    for device in _devices():
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        for name in names or backends.MODULES:
            if name not in backends.MODULES:
                raise ValueError(
                    f"names: unknown backend {name!r}; one of {list(backends.MODULES)}"
                )
            for case in CASES:
                base = dict(backend=name, device=device, case=case[0])
                problem = _case_problem(case, device, dtype)
                why = {op: backends.reason_not(name, op, problem) for op in backends.OPS}
                full = why["fwd"] is None and why["bwd"] is None
                select_only = not full and why["select"] is None and not case[-1]
                if not (full or select_only):
                    reason = next(r for r in why.values() if r is not None)
                    yield dict(base, quantity=reason, err=None, tol=None, status="NOT RUN")
                    continue
                if select_only:  # the ops this backend cannot run yet are reported, not hidden
                    yield dict(
                        base,
                        quantity=why["fwd"] or why["bwd"],
                        err=None,
                        tol=None,
                        status="NOT RUN",
                    )
                try:
                    with backends.forced(name):
                        rows = _run_case(case, device, dtype, seed, select_only)
                except Exception as e:  # a crash is a failure, reported, not hidden
                    yield dict(
                        base,
                        quantity=f"raised {type(e).__name__}: {e}",
                        err=None,
                        tol=None,
                        status="FAIL",
                    )
                    continue
                for quantity, err, tol, passed in rows:
                    yield dict(
                        base,
                        quantity=quantity,
                        err=err,
                        tol=tol,
                        status="PASS" if passed else "FAIL",
                    )


def _case_problem(case, device, dtype) -> Problem:
    _, _, H, Hkv, Hp, Hpk, D, Dp, b, top_k, warmup = case
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=300,
        proxy_scale=Dp**-0.5,
        top_k=None if warmup else top_k,
        warmup=warmup,
        compute_kl=True,
    )
    dims = (H, Hkv, D, Hp, Hpk, Dp)
    return problem_of(device, dtype, dims, 1, isinstance(case[1], tuple), cfg)
