"""Tile choice without register spills: the first candidate whose compiled kernel has none.

Triton kernels with 8 warps get at most 255 registers per thread; a tile that needs more makes
ptxas spill to local memory (a stack frame), which costs memory traffic in the inner loop. How
many registers a tile needs depends on the head counts, ``D``, the block size and the Triton
version, so a fixed table cannot be right everywhere. Each kernel family therefore lists tile
candidates in order of preference (largest first); :func:`pick` compiles them in that order
for the call's actual arguments (``JITFunction.warmup``: compile only, nothing runs, no host
synchronization) and keeps the first one whose cubin has no stack frame and no local memory
(``cuobjdump --dump-resource-usage``, as ``compile_check`` reads it) and whose shared memory
fits the device. The choice is cached per
static configuration; the kernel launch that follows reuses the compiled binary.

The tables are the same on every GPU. Their last entries are small enough for the per-block
shared memory and the ``mma.sync`` register layouts of the smaller architectures
(:data:`SHARED_LIMITS`: sm_80 163 KB, sm_86/89/120 99 KB), so on those the same rule (the first
candidate without spills that fits) walks further down the list; the sm_90 choices are those
of the first entries and do not change. The limit is the device's opt-in maximum (queried at
run time), lowered by the environment variable ``FLASH_MSA_SMEM_LIMIT=<bytes>`` if set
(:func:`shared_limit`, part of the cache key): with it a test on an H200 forces the tiles
another architecture would choose (compiled for sm_90 there, whose shared memory and
registers per tile are close to, not the same as, the ``mma.sync`` build's; the compile check
``compile_check --arch`` covers the real targets).

A candidate is also skipped when its TTGIR has a shared-memory race of Triton's software
pipelining (:func:`ring_hazards`: an async wgmma reading a ring-buffer slot that the loop's
next prefetch overwrites; found in ``dense._dense_proxy_dk_kernel``, the likely cause of a
non-deterministic dk_proxy on the H200).

If every candidate that fits the shared memory spills or races (fp32 inputs: their IEEE
products run without tensor cores and need twice the bytes per operand tile), the one that
fits with the fewest spill bytes is used (the first of equals; spills are slow, but run) and a
warning names the kernel. If none fits at all,
:func:`pick` raises :class:`flash_msa.BackendError` naming the kernel, the input dtype, the head
dim, the limit and the smallest need, before any launch: launching one would only fail in
Triton with ``OutOfResources`` (the fp32 dense backward at D = 128 under sm_120's 99 KB would with every entry but the fp32
ones at the end of ``dense.DENSE_TILES``). Under Triton's interpreter (CPU)
nothing is compiled and the first candidate is used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
from collections.abc import Callable

import torch

from ..backends import BackendError, interpreting
from ..cubin import resources as cubin_resources

log = logging.getLogger("flash_msa")

_chosen: dict[tuple, object] = {}
_usage: dict[tuple, tuple[int, int]] = {}  # same keys: (shared bytes, spill bytes) of the choice
_refused: dict[tuple, str] = {}  # same keys: why no candidate fits (pick raises it again)

# Opt-in shared memory per block in bytes by compute capability ``major * 10 + minor``: the
# SM's shared memory less the 1 KB the system reserves per block, as in the CUDA C++
# Programming Guide's table of technical specifications per compute capability ("maximum amount
# of shared memory per thread block": 163 KB on 8.0/8.7, 99 KB on 8.6/8.9/12.x, 227 KB on
# 9.0/10.0) and nvidia-cutlass-dsl's SMEM_CAPACITY_MAP (cutlass_dsl/cutlass.py). For targets
# without a device (compile_check) and devices whose torch does not report the value.
SHARED_LIMITS = {
    80: 166912,  # A100 (164 - 1) KB
    86: 101376,  # A10, A40, RTX 30xx (100 - 1) KB
    87: 166912,  # Jetson Orin
    89: 101376,  # L4, L40S, RTX 40xx
    90: 232448,  # H100, H200 (228 - 1) KB
    100: 232448,  # B200
    120: 101376,  # RTX 50xx, RTX PRO 6000 Blackwell
}
SMEM_LIMIT_ENV = "FLASH_MSA_SMEM_LIMIT"  # a cap (bytes per block) below the device's, for tests

# The head dims the tables hold a spill-free tile for that fits the shared memory (the
# backend's LIMITS declare them; compile_check checks them). D = 256 (Gemma's): the main
# kernels' K / V tiles are [BN, 256] (2 x 64 KB per block of 128 keys in bf16), so the lists
# walk further (sm_90, Triton 3.9: the forward 32 rows at block 128, the backward 32 rows x 32
# keys, 82 KB: every larger tile spills). Dp stops at 128: at D = Dp = 256 the deterministic
# proxy pass spills with every candidate on sm_90 (24-40 bytes), at Dp = 128 it does not.
HEAD_DIMS = (16, 32, 64, 128, 256)
PROXY_HEAD_DIMS = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class Tables:
    """The candidate tables the host code hands to :func:`pick`, one per kernel family; a
    field left ``None`` is the kernel module's shipped table. The backend ops take one as
    ``tables=`` (default :data:`SHIPPED`), so that a test can run other entries (a smaller
    tile, the last entry of a list) through the same host code.

    ``select`` filters the selection's list (``selection.tile_candidates``, computed from its
    launch table) instead of replacing it."""

    fwd: tuple | None = None  # sparse_fwd.FWD_TILES: (rows, OUT_SPLIT[, warps])
    bwd: tuple | None = None  # sparse_bwd.BWD_TILES: (rows, BN, DQ_SPLIT)
    proxy: tuple | None = None  # proxy.PROXY_TILES: (rows, BN, PREFETCH[, stages])
    dense: tuple | None = None  # dense.DENSE_TILES: (rows, keys, warps[, stages])
    dense_fwd: tuple | None = None  # dense.FWD_TILES: (rows, keys, warps[, stages])
    select: Callable[[tuple], tuple] | None = None  # of selection.tile_candidates' list


SHIPPED = Tables()


def fitting(table, block: int) -> tuple[tuple[int, ...], ...]:
    """The entries ``(rows, BN, ...)`` of a candidate table whose ``BN`` keys per program fit a
    key block of ``block`` keys."""
    return tuple(t for t in table if t[1] <= block)


def spill_bytes(compiled) -> int:
    """Stack + local bytes per thread of a compiled Triton kernel."""
    try:
        res = cubin_resources(compiled.asm["cubin"])
    except (OSError, subprocess.CalledProcessError):  # no cuobjdump: the driver's local size
        compiled._init_handles()
        return 4 * compiled.n_spills
    return res["stack"] + res["local"]


_ALLOC = re.compile(r"\s*(%[\w.]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x")
_SLOT = re.compile(r"\s*(%[\w.]+) = ttg\.memdesc_(?:index|subview) (%[\w.]+)\[(%[\w.]+)")
_DOT = re.compile(r"\s*(%[\w.]+) = ttng\.warp_group_dot (%[\w.]+), (%[\w.]+), .*isAsync = true")


def ring_hazards(ttgir: str) -> list[str]:
    """Shared-memory races of software pipelining in a kernel's TTGIR (sm_90): an async wgmma
    whose operand is a slot of a pipelining ring buffer with every slot in flight (as many
    slots as the loop's prologue fills) and which no ``pendings = 0`` wait completes before its
    loop iteration ends. The iteration's refill then targets the slot the wgmma still reads.
    Triton sizes a ring ``distance + 1`` when a load feeds a wgmma alone, but only ``distance``
    when the load also has a register use (``dense._dense_proxy_dk_kernel`` before its fix).
    Returns one line per hazard (empty: none found; a text without these ops gives none)."""
    lines = ttgir.splitlines()
    slots = {m[1]: int(m[2]) for m in map(_ALLOC.match, lines) if m}
    ring_of, fills = {}, {a: set() for a in slots}
    for m in map(_SLOT.match, lines):
        if m and m[2] in slots:
            ring_of[m[1]] = m[2]
            if re.fullmatch(r"%c\d+_i32", m[3]):  # a constant slot: a prologue fill
                fills[m[2]].add(m[3])
    found = []
    for n, line in enumerate(lines):
        dot = _DOT.match(line)
        if not dot:
            continue
        depth, waited = 0, False
        for later in lines[n + 1 :]:  # up to the yield of the dot's own loop body
            if depth == 0 and "scf.yield" in later:
                break
            depth += later.rstrip().endswith("{") - later.lstrip().startswith("}")
            wait = "warp_group_dot_wait" in later and "pendings = 0" in later
            if wait and re.search(re.escape(dot[1]) + r"\b", later):
                waited = True
                break
        for operand in () if waited else dot.group(2, 3):
            ring = ring_of.get(operand)
            if ring is not None and len(fills[ring]) >= slots[ring]:
                found.append(
                    f"{dot[1]} reads {operand}, a slot of {ring} ({slots[ring]} slots, "
                    f"{len(fills[ring])} in flight)"
                )
    return found


def _shared_limit(dev) -> int:
    """The device's opt-in shared memory per block (bytes), without the cap."""
    props = torch.cuda.get_device_properties(dev)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    return limit or SHARED_LIMITS.get(props.major * 10 + props.minor, SHARED_LIMITS[90])


def smem_cap() -> int | None:
    """The cap ``FLASH_MSA_SMEM_LIMIT`` sets (bytes of shared memory per block), ``None`` when
    unset or empty. Raises ValueError naming the variable if it is not a positive integer."""
    raw = os.environ.get(SMEM_LIMIT_ENV, "").strip()
    if not raw:
        return None
    cap = int(raw) if raw.isdigit() else 0
    if cap <= 0:
        raise ValueError(f"{SMEM_LIMIT_ENV}={raw!r}: must be a positive number of bytes")
    return cap


def shared_limit(dev) -> int:
    """Bytes of shared memory a block may use on CUDA device ``dev`` (what :func:`pick`
    checks): the device's opt-in maximum, or the cap of ``FLASH_MSA_SMEM_LIMIT`` if lower."""
    limit = _shared_limit(dev)
    cap = smem_cap()
    return limit if cap is None else min(limit, cap)


def chosen() -> dict[tuple, object]:
    """The tiles :func:`pick` chose so far (a copy): ``(kernel name, candidates, device,
    capability, shared limit, *key) -> tile`` (benchmarks/tune_triton.py prints them)."""
    return dict(_chosen)


def usage() -> dict[tuple, tuple[int, int]]:
    """``(shared bytes, spill bytes)`` of each choice of :func:`chosen` (same keys), as
    compiled; ``(-1, -1)`` where no candidate compiled (the launch then reports why)."""
    return dict(_usage)


def clear() -> None:
    """Forget every choice. A changed ``FLASH_MSA_SMEM_LIMIT`` needs no clearing (the limit is
    part of the key); this keeps :func:`chosen` to one setting's choices in tests."""
    _chosen.clear()
    _usage.clear()
    _refused.clear()


def pick(kernel, args, candidates, options, key):
    """First of ``candidates`` whose kernel compiles without spills and within
    :func:`shared_limit`, for ``args`` (checked for the specialization of the first call of a
    configuration: Triton may compile another one for other integer values, e.g. divisibility
    by 16, which is not re-checked).

    ``options(candidate)`` gives the launch keywords (constexprs, ``num_warps``,
    ``num_stages``) of a candidate; ``key`` identifies the static configuration (it must
    include everything ``options`` and the argument dtypes depend on). The shared-memory limit
    is part of the cache key, so a changed ``FLASH_MSA_SMEM_LIMIT`` chooses again.

    Raises :class:`flash_msa.BackendError` (:func:`refusal`'s message; cached like a choice)
    when candidates compiled but none fits the shared memory without a pipelining race."""
    if interpreting():
        return candidates[0]
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    limit = shared_limit(dev)
    capability = torch.cuda.get_device_capability(dev)
    key = (kernel.fn.__name__, tuple(candidates), dev, capability, limit, *key)
    if key in _chosen:
        return _chosen[key]
    if key in _refused:
        raise BackendError(_refused[key])
    if not _chosen and not _refused:  # the first pick of the process says why the call waits
        log.warning(
            "flash_msa: compiling Triton kernels for this configuration (first use: each tile "
            "candidate until one fits; Triton's cache keeps them for later processes)"
        )
    choice = fits = None
    used = {}  # candidate -> (shared bytes, spill bytes; -1 where not read)
    racy = []
    for cand in candidates:
        try:
            with torch.cuda.device(dev):
                compiled = kernel.warmup(*args, grid=(1,), **options(cand))
        except Exception as e:  # e.g. out of resources at compile time: try the next one
            log.info("flash_msa: tile %s of %s does not compile: %s", cand, key[0], e)
            continue
        hazards = ring_hazards(compiled.asm.get("ttgir", ""))
        if hazards:
            log.warning(
                "flash_msa: tile %s of %s skipped, a pipelining race: %s", cand, key[0], hazards
            )
            racy.append(cand)
            continue
        used[cand] = (compiled.metadata.shared, -1)
        if compiled.metadata.shared > limit:  # would not launch
            continue
        used[cand] = (compiled.metadata.shared, spill_bytes(compiled))
        if fits is None or used[cand][1] < used[fits][1]:  # the fewest spill bytes so far
            fits = cand
        if used[cand][1] == 0:
            choice = cand
            break
    if fits is None and (used or racy):  # nothing launchable: refuse before any launch
        _refused[key] = refusal(key[0], args, options, limit, used, racy)
        raise BackendError(_refused[key])
    if choice is None:  # spills are slow but run (or nothing compiled: the launch says why)
        choice = candidates[-1] if fits is None else fits
        log.warning(
            "flash_msa: every tile candidate of %s spills registers, races or exceeds %d bytes "
            "of shared memory (%s)",
            key[0],
            limit,
            key,
        )
    _chosen[key] = choice
    _usage[key] = used.get(choice, (-1, -1))
    return choice


def refusal(name: str, args, options, limit: int, used: dict, racy=()) -> str:
    """The message of :func:`pick`'s :class:`~flash_msa.BackendError` when no candidate of
    kernel ``name`` fits ``limit`` bytes of shared memory: the input dtype (of the first tensor
    argument), the head dim (the ``D`` or ``Dp`` constexpr), the limit and the smallest need
    among ``used`` (``candidate -> (shared bytes, spill bytes)``, as compiled); ``racy``: the
    candidates skipped for a pipelining race."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
    dims = {options(c).get("D", options(c).get("Dp")) for c in [*used, *racy]}
    head_dim = "/".join(str(d) for d in sorted(dims, key=str))
    if used:
        small = min(used, key=lambda c: used[c][0])
        need = f"the smallest candidate, {small}, needs {used[small][0]} bytes"
    else:
        need = "no candidate is free of pipelining races"
    if racy and used:
        need += f" ({len(racy)} more skipped for a pipelining race)"
    return (
        f"no tile candidate of Triton kernel {name} fits {limit} bytes of shared memory per "
        f"block for {str(dtype).removeprefix('torch.')} inputs at head dim {head_dim}: {need}. "
        f"Use bf16/fp16 inputs, a smaller head dim or a GPU with more shared memory "
        f"(a cap {SMEM_LIMIT_ENV} lower than the device's also limits it)."
    )
