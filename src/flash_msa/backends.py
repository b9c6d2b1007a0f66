"""Backend probing and selection (``FLASH_MSA_BACKEND=auto|cute|triton|torch``).

A backend is a module with the same small surface (see docs/design.md, "Contract"):
``unavailable_reason()``, ``unsupported_reason(op, problem)``, ``select``, ``fwd``, ``bwd``.

``FLASH_MSA_DETERMINISTIC=1`` (or a call's ``deterministic=True``, :func:`deterministic`) asks
for bitwise-reproducible results; a backend's ``Limits`` say whether it runs such calls, and the
rules below apply to them unchanged (``auto`` skips the backends that do not).

Rules:

- forced (``cute``/``triton``/``torch``): that backend runs every op, or the call raises
  :class:`BackendError` with the backend's reason. No silent fallback.
- ``auto``: per op, the first backend that supports the call: on CUDA tensors ``cute`` then
  ``triton``; on CPU tensors ``triton`` when ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) and
  ``torch`` otherwise or as fallback. ``auto`` never falls back to the O(S^2) ``torch`` backend for
  GPU tensors: it raises, naming each backend's reason. A fallback is logged once per reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from types import ModuleType

from .problem import Problem

MODULES = {
    "cute": "flash_msa.cute",
    "triton": "flash_msa.triton_ref",
    "torch": "flash_msa.reference",
}
OPS = ("select", "fwd", "bwd")
CHOICES = ("auto", *MODULES)

log = logging.getLogger("flash_msa")


class BackendError(RuntimeError):
    """No backend (or not the forced one) can run this call; the message says why."""


def requested() -> str:
    """The value of ``FLASH_MSA_BACKEND`` (default ``auto``), validated."""
    choice = os.environ.get("FLASH_MSA_BACKEND", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"FLASH_MSA_BACKEND must be one of {', '.join(CHOICES)}; got {choice!r}")
    return choice


DETERMINISTIC_ENV = "FLASH_MSA_DETERMINISTIC"
_ON, _OFF = ("1", "true"), ("", "0", "false")


def deterministic(value: bool | None = None) -> bool:
    """Whether a call runs in deterministic mode: ``value`` (a call's ``deterministic=``
    keyword) when it is a bool, else ``FLASH_MSA_DETERMINISTIC`` (``1``/``true`` on,
    ``0``/``false``/unset off; default off). The keyword overrides the environment.

    Deterministic mode makes every output and gradient bitwise identical across runs on the
    same inputs (ordered reductions instead of fp32 atomics, at a cost in time and memory:
    docs/design.md, "Deterministic mode"); only backends that declare it run such calls."""
    if value is not None:
        if not isinstance(value, bool):
            raise TypeError(
                f"deterministic must be a bool or None (None: {DETERMINISTIC_ENV}), got "
                f"{type(value).__name__} {value!r}"
            )
        return value
    raw = os.environ.get(DETERMINISTIC_ENV, "")
    flag = raw.strip().lower()
    if flag not in _ON + _OFF:
        raise ValueError(f"{DETERMINISTIC_ENV} must be 0 or 1 (or false / true); got {raw!r}")
    return flag in _ON


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import backend ``name`` once: ``(module, None)`` or ``(None, why it cannot be imported)``."""
    try:
        return importlib.import_module(MODULES[name]), None
    except ImportError as e:  # a missing optional dependency, e.g. nvidia-cutlass-dsl
        return None, f"cannot import {MODULES[name]}: {e}"


def reason_not(name: str, op: str, problem: Problem) -> str | None:
    """Why backend ``name`` cannot run ``op`` for ``problem``; ``None`` if it can."""
    module, why = load(name)
    if module is None:
        return why
    return module.unavailable_reason() or module.unsupported_reason(op, problem)


def candidates(device_type: str) -> tuple[str, ...]:
    """Backends ``auto`` tries, in order of preference, for tensors on ``device_type``."""
    if device_type == "cpu":
        return ("triton", "torch") if interpreting() else ("torch",)
    return ("cute", "triton")


_logged: set[tuple[str, str, str]] = set()


def choose(op: str, problem: Problem) -> tuple[str | None, list[tuple[str, str]]]:
    """``auto``'s pick for one op: ``(name or None, [(rejected backend, reason), ...])``."""
    rejected = []
    for name in candidates(problem.device_type):
        why = reason_not(name, op, problem)
        if why is None:
            return name, rejected
        rejected.append((name, why))
    return None, rejected


def resolve(op: str, problem: Problem):
    """Pick the backend for one op of one call; returns ``(name, module)`` or raises."""
    choice = requested()
    where = problem.device_type
    if problem.capability is not None:
        where += f" (sm_{problem.capability[0]}{problem.capability[1]})"
    if choice != "auto":
        why = reason_not(choice, op, problem)
        if why is not None:
            raise BackendError(f"FLASH_MSA_BACKEND={choice} cannot run {op!r} on {where}: {why}")
        return choice, load(choice)[0]
    name, rejected = choose(op, problem)
    if name is None:
        detail = "; ".join(f"{n}: {w}" for n, w in rejected)
        raise BackendError(
            f"no backend can run {op!r} on {where} ({detail}). The O(S^2) torch backend is never "
            "chosen automatically for GPU tensors; set FLASH_MSA_BACKEND=torch to force it."
        )
    for other, why in rejected:
        if (op, other, why) not in _logged:
            _logged.add((op, other, why))
            log.warning("flash_msa: %s runs on %s: %s cannot: %s", op, name, other, why)
    return name, load(name)[0]


@contextlib.contextmanager
def forced(name: str):
    """Run the enclosed calls with ``FLASH_MSA_BACKEND=name``, restoring the previous value."""
    old = os.environ.get("FLASH_MSA_BACKEND")
    os.environ["FLASH_MSA_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLASH_MSA_BACKEND"]
        else:
            os.environ["FLASH_MSA_BACKEND"] = old
