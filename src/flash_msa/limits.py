"""What each backend can run, declared as data and checked by one generic function.

A backend module declares ``LIMITS``: for each op (``"select"``, ``"fwd"``, ``"bwd"``, and
``"warmup"`` for the dense warmup's ``fwd``/``bwd``) either a :class:`Limits` or a string saying
why the op is not there (e.g. "not implemented yet"). :func:`reason` checks a
:class:`~flash_msa.problem.Problem` against them; a backend's ``unsupported_reason`` adds only
the rules that do not fit a table (head-group arithmetic, grid sizes). :func:`describe` renders
the declarations as the README's backend table cells and ``flash-msa info`` shows them; a test
holds the README to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backends
from .problem import Problem

OPS = ("select", "fwd", "bwd", "warmup")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The envelope of one backend op. ``None`` means "any"."""

    devices: tuple[str, ...] | None = ("cuda",)
    # CUDA compute capabilities as (major, minor); minor None = every minor of that major
    capabilities: tuple[tuple[int, int | None], ...] | None = None
    capability_note: str = ""  # why other architectures are refused (appended to the reason)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    cpu_dtypes: tuple[torch.dtype, ...] | None = None  # on CPU tensors; None: as ``dtypes``
    cpu_note: str = ""  # why a dtype is refused on CPU (appended to the reason)
    head_dims: tuple[int, ...] | None = None  # D (main)
    proxy_head_dims: tuple[int, ...] | None = None  # Dp
    block_sizes: tuple[int, ...] | None = (64, 128)
    max_top_k: int | None = None
    # runs calls with a query map (``Problem.q_map``: queries other than the keys' own tokens,
    # as context parallelism passes them; docs/distributed.md)
    q_map: bool = False
    # runs deterministic calls (``Problem.deterministic``: every output and gradient bitwise
    # reproducible, by ordered reductions instead of fp32 atomics; docs/design.md)
    deterministic: bool = False
    # selects in fp8 (``Problem.selection_precision == "fp8"``: e4m3 proxy operands with fp32
    # scales, an approximate selection; flash_msa.quant); checked for the "select" op only
    fp8_selection: bool = False
    # the backward makes the proxy gradient itself, so the forward need not
    # (``Forward.proxy_grad``); read for the "bwd" op
    fused_proxy_grad: bool = False
    note: str = ""  # what the table should also say (e.g. stages run by another backend)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device(dev: str) -> str:
    return {"cuda": "CUDA", "cpu": "CPU"}.get(dev, dev)


def _arch(cap: tuple[int, int | None]) -> str:
    return f"sm_{cap[0]}{'x' if cap[1] is None else cap[1]}"


def entry(limits: dict, op: str, problem: Problem) -> Limits | str:
    """The declaration that applies to ``op`` of ``problem`` (warmup calls use ``"warmup"``)."""
    key = "warmup" if problem.cfg.warmup and op in ("fwd", "bwd") else op
    return limits[key]


def reason(limits: dict, op: str, problem: Problem) -> str | None:
    """Why ``problem``'s ``op`` is outside the declared ``limits`` (``None``: inside)."""
    lim = entry(limits, op, problem)
    if isinstance(lim, str):
        return lim
    dev = problem.device_type
    if lim.devices is not None and dev not in lim.devices:
        return f"runs on {' / '.join(map(_device, lim.devices))} tensors, not {dev}"
    if dev == "cuda" and lim.capabilities is not None:
        major, minor = problem.capability
        if not any(m == major and n in (None, minor) for m, n in lim.capabilities):
            archs = ", ".join(_arch(c) for c in lim.capabilities)
            note = f": {lim.capability_note}" if lim.capability_note else ""
            return f"sm_{major}{minor} is not one of {archs}{note}"
    dtypes = lim.cpu_dtypes if dev == "cpu" and lim.cpu_dtypes is not None else lim.dtypes
    if problem.dtype not in dtypes:
        note = f" ({lim.cpu_note})" if dev == "cpu" and lim.cpu_note else ""
        where = " on CPU" if dev == "cpu" and lim.cpu_dtypes is not None else ""
        allowed = ", ".join(map(_name, dtypes))
        return f"dtype {_name(problem.dtype)} is not supported{where}: {allowed}{note}"
    cfg = problem.cfg
    if lim.block_sizes is not None and cfg.block_size not in lim.block_sizes:
        return f"block_size {cfg.block_size} is not one of {lim.block_sizes}"
    if lim.max_top_k is not None and cfg.top_k is not None and cfg.top_k > lim.max_top_k:
        return f"top_k {cfg.top_k} > {lim.max_top_k}"
    D, Dp = problem.head_dim, problem.proxy_head_dim  # 0: the call has no such tensor
    if op != "select" and D and lim.head_dims is not None and D not in lim.head_dims:
        return f"head_dim {D} is not one of {lim.head_dims}"
    if Dp and lim.proxy_head_dims is not None and Dp not in lim.proxy_head_dims:
        return f"proxy head_dim {Dp} is not one of {lim.proxy_head_dims}"
    if problem.q_map and not lim.q_map:
        return (
            "q_map (queries that are not the keys' own tokens: context parallelism) "
            "is not implemented"
        )
    if problem.deterministic and not lim.deterministic:
        return (
            "deterministic mode (FLASH_MSA_DETERMINISTIC=1 or deterministic=True: ordered "
            "reductions instead of fp32 atomics) is not implemented"
        )
    if op == "select" and problem.selection_precision == "fp8" and not lim.fp8_selection:
        return (
            'selection_precision="fp8" (e4m3 proxy scores, an approximate selection) is not '
            "implemented"
        )
    return None


def describe(lim: Limits | str) -> str:
    """One op's declaration as text (the README table's cells and ``flash-msa info``)."""
    if isinstance(lim, str):
        return lim
    parts = []
    if lim.capabilities is not None:
        parts.append(" / ".join(_arch(c) for c in lim.capabilities))
    if lim.devices is None:
        parts.append("any device")
    elif "cpu" in lim.devices:
        parts.append("CPU")
    dtypes = "/".join(_name(d) for d in lim.dtypes)
    if lim.cpu_dtypes is not None:
        dtypes += " (CPU: " + "/".join(_name(d) for d in lim.cpu_dtypes) + ")"
    parts.append(dtypes)
    if lim.head_dims is not None:
        parts.append("D " + "/".join(map(str, lim.head_dims)))
    if lim.proxy_head_dims is not None:
        parts.append("Dp " + "/".join(map(str, lim.proxy_head_dims)))
    if lim.block_sizes is not None:
        parts.append("block " + "/".join(map(str, lim.block_sizes)))
    if lim.max_top_k is not None:
        parts.append(f"top_k <= {lim.max_top_k}")
    if lim.q_map:
        parts.append("query map (q_map)")
    if lim.deterministic:
        parts.append("deterministic mode")
    if lim.fp8_selection:
        parts.append('fp8 selection (selection_precision="fp8")')
    return ", ".join(parts) + (f"; {lim.note}" if lim.note else "")


def rows(name: str, declared: dict) -> list[tuple[str, str]]:
    """``[(ops, text)]`` of one backend: ops with the same declaration share a row."""
    groups: dict[str, list[str]] = {}
    for op in OPS:
        groups.setdefault(describe(declared[op]), []).append(op)
    return [(", ".join(ops), text) for text, ops in groups.items()]


def markdown() -> str:
    """The README's backend table, from every importable backend's ``LIMITS``."""
    lines = ["| backend | ops | declared limits |", "|---|---|---|"]
    for name in backends.MODULES:
        module, why = backends.load(name)
        if module is None:
            raise RuntimeError(f"cannot render the table without the {name} backend: {why}")
        lines += [f"| `{name}` | {ops} | {text} |" for ops, text in rows(name, module.LIMITS)]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m flash_msa.limits: the README table
    print(markdown())
