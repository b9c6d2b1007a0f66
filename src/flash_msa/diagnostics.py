"""``info()``: what this machine has and which backend each op would use; ``check()``: every
available backend against an independent brute-force computation on small problems."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

from . import __version__, backends
from .problem import Config, Problem


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
    dev = torch.device(device)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    cfg = Config(
        block_size=128,
        softmax_scale=128**-0.5,
        max_seqlen=16384,
        proxy_scale=128**-0.5,
        top_k=16,
        warmup=False,
        compute_kl=True,
    )
    return Problem(
        device_type=dev.type,
        capability=cap,
        dtype=torch.bfloat16,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        num_sel_heads=4,
        num_proxy_k_heads=1,
        proxy_head_dim=128,
        varlen=False,
        cfg=cfg,
    )


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
    from . import limits

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
_TOL = {torch.float32: 2e-4, torch.float64: 1e-9, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _rel_err(a, b) -> float:
    b = b.double()
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _run_case(case, device, dtype, seed, select_only=False):
    """Rows ``(quantity, rel err, tol)`` of one case on the currently forced backend
    (only the selection when ``select_only``)."""
    from . import testing
    from .api import msa_attention

    name, shape, H, Hkv, Hp, Hpk, D, Dp, b, top_k, warmup = case
    varlen = isinstance(shape, tuple)
    S = sum(shape) if varlen else _SEQLEN[b]
    B = 1 if varlen else shape
    inputs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed)
    cu = None
    if varlen:
        inputs = tuple(x[0] for x in inputs)
        cu = torch.tensor([0, *torch.tensor(shape).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [x.to(device).requires_grad_() for x in inputs]
    cu_dev = None if cu is None else cu.to(device)
    kw = dict(block_size=b, cu_seqlens=cu_dev, max_seqlen=None if cu is None else max(shape))
    if not select_only:
        out, kl = msa_attention(*leaves, top_k, warmup=warmup, **kw)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
        (out.float() * dout.float()).sum().add(0.5 * kl).backward()
    rows = []
    selection = None
    if not warmup:
        from .api import select_blocks

        idx = select_blocks(*leaves[:2], top_k, **kw).cpu()
        truth = testing.brute_force_select(*inputs[:2], top_k, b, Dp**-0.5, cu)
        truth_t = torch.tensor([[r + [-1] * (top_k - len(r)) for r in tok] for tok in truth])
        bad = testing.selection_mismatch(idx, truth_t.view(idx.shape), *inputs[:2], b, Dp**-0.5, cu)
        rows.append(("selection: rows differing", float(bad), 0.0))
        selection = testing.indices_to_lists(idx)
    if select_only:
        return rows
    ref_leaves = [x.detach().double().requires_grad_() for x in inputs]
    ref = testing.brute_force(*ref_leaves, selection, block_size=b, cu_seqlens=cu, warmup=warmup)
    ref_dout = dout.cpu().double()
    (ref["out"] * ref_dout).sum().add(0.5 * ref["kl"]).backward()
    tol = _TOL[dtype]
    rows.append(("out", _rel_err(out.detach().cpu(), ref["out"].detach()), tol))
    rows.append(("kl", _rel_err(kl.detach().cpu(), ref["kl"].detach()), tol))
    for gname, mine, theirs in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), leaves, ref_leaves):
        rows.append((gname, _rel_err(mine.grad.cpu(), theirs.grad), 5 * tol))
    return rows


def check(seed: int = 0):
    """Run every backend that can run here on :data:`CASES`; yield result rows.

    Each row is a dict with ``backend, device, case, quantity, err, tol, status`` where status is
    ``PASS``, ``FAIL`` or ``NOT RUN`` (with the reason in ``quantity``). Errors are relative to
    the largest magnitude of the brute-force fp64 value.
    """
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
    for device in _devices():
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        for name in backends.MODULES:
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
                for quantity, err, tol in rows:
                    yield dict(
                        base,
                        quantity=quantity,
                        err=err,
                        tol=tol,
                        status="PASS" if err <= tol else "FAIL",
                    )


def _case_problem(case, device, dtype) -> Problem:
    _, _, H, Hkv, Hp, Hpk, D, Dp, b, top_k, warmup = case
    dev = torch.device(device)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    cfg = Config(
        block_size=b,
        softmax_scale=D**-0.5,
        max_seqlen=300,
        proxy_scale=Dp**-0.5,
        top_k=None if warmup else top_k,
        warmup=warmup,
        compute_kl=True,
    )
    return Problem(
        device_type=dev.type,
        capability=cap,
        dtype=dtype,
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=D,
        num_sel_heads=Hp,
        num_proxy_k_heads=Hpk,
        proxy_head_dim=Dp,
        varlen=isinstance(case[1], tuple),
        cfg=cfg,
    )
