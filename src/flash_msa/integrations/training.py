"""Helpers every trainer of an MSA model needs: the warmup switch over all layers, the KL over
all layers for logging, and the recall of a selection on a batch."""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import recall as _recall
from .. import reference
from ..nn import MSAttention
from ..problem import Config


def msa_layers(model: nn.Module) -> list[MSAttention]:
    """The :class:`~flash_msa.nn.MSAttention` layers of ``model`` (every converted layer of
    :mod:`flash_msa.integrations` is one), in module order. Raises ValueError when there is
    none: a trainer that flips warmup on an unconverted model would otherwise do nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, MSAttention)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MSAttention layer: convert it first (for example "
            "flash_msa.integrations.hf.convert_to_msa)"
        )
    return layers


def set_warmup(model: nn.Module, warmup: bool) -> int:
    """Set ``warmup`` on every MSA layer of ``model`` (dense causal attention with the KL over
    every visible key when True; sparse when False); returns the number of layers set."""
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be a bool, got {type(warmup).__name__}")
    layers = msa_layers(model)
    for m in layers:
        m.warmup = warmup
    return len(layers)


def total_kl(model: nn.Module, reduction: str = "sum") -> torch.Tensor:
    """The detached proxy KL of the latest forward over the MSA layers of ``model``: their sum
    (``reduction="sum"``, default) or mean (``"mean"``), a 0-dim fp32 tensor for logging.
    Raises RuntimeError when a layer has not run yet (its ``last_kl`` is None)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    layers = msa_layers(model)
    missing = [i for i, m in enumerate(layers) if m.last_kl is None]
    if missing:
        raise RuntimeError(
            f"MSA layers {missing} (of {len(layers)}) have no KL yet: run a forward first"
        )
    kls = torch.stack([m.last_kl.detach().float() for m in layers])
    return kls.sum() if reduction == "sum" else kls.mean()


def measure_recall(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    top_k: int,
    *,
    block_size: int = 128,
    cu_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    proxy_scale: float | None = None,
) -> dict:
    """How well the proxy's top-k block selection matches the main attention, on one batch.

    The reference set of a row is the ``top_k`` key blocks holding the most mass of the main
    heads' dense causal attention (averaged over the main heads of each proxy head's group; the
    own block always kept, as in the selection); the proxy's set is the op's exact selection
    (:func:`flash_msa.reference.select`). Over the rows that have a choice (more visible
    blocks than ``top_k``), the own block excluded from both sets (:mod:`flash_msa.recall`):

    - ``recall``: ``|proxy & oracle| / |oracle|``;
    - ``exact_rows``: the fraction of rows whose two sets are equal;
    - ``mass_ratio``: main attention mass in the proxy's blocks over that in the oracle's
      (1.0: the proxy keeps as much of the attention as any ``top_k`` blocks could).

    Shapes as :func:`flash_msa.msa_attention`: batch ``(B, S, heads, dim)`` or packed
    ``(T, heads, dim)`` with ``cu_seqlens``. Computed on the CPU in fp32 (a dense
    ``S x S`` attention per head: meant for a logging batch, not every step). Returns
    ``{"recall", "exact_rows", "mass_ratio", "rows"}`` (``rows``: rows with a choice; the
    ratios are NaN when there is none), weighted over sequences by their rows.
    """
    tensors = dict(q_proxy=q_proxy, k_proxy=k_proxy, q=q, k=k)
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if block_size not in (64, 128):
        raise ValueError(f"block_size must be 64 or 128, got {block_size!r}")
    rank = 3 if cu_seqlens is not None else 4
    for name, x in tensors.items():
        if x.dim() != rank:
            form = "(T, heads, dim) with cu_seqlens" if rank == 3 else "(B, S, heads, dim)"
            raise ValueError(f"{name} must be {form}; got shape {tuple(x.shape)}")
    if rank == 4:
        B, S = q.shape[:2]
        lengths = [S] * B
        tensors = {n: x.reshape(B * S, *x.shape[2:]) for n, x in tensors.items()}
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    qp, kp, qm, km = (x.detach().to("cpu", torch.float32) for x in tensors.values())
    Hp, H = qp.shape[1], qm.shape[1]
    if H % Hp:
        raise ValueError(f"q's heads ({H}) must be a multiple of q_proxy's heads ({Hp})")
    softmax_scale = qm.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    proxy_scale = qp.shape[-1] ** -0.5 if proxy_scale is None else proxy_scale
    totals = dict(recall=0.0, exact_rows=0.0, mass_ratio=0.0)
    rows_total, start = 0, 0
    for n in lengths:
        end = start + int(n)
        if n == 0:
            continue
        cfg = Config(
            block_size=block_size,
            softmax_scale=softmax_scale,
            max_seqlen=int(n),
            proxy_scale=proxy_scale,
            top_k=top_k,
            compute_kl=False,
        )
        cu = torch.tensor([0, int(n)], dtype=torch.int32)
        picked = reference.select(qp[start:end], kp[start:end], cu, cfg)
        mass = _recall.block_mass(qm[start:end], km[start:end], cu, block_size, softmax_scale)
        oracle = _oracle(mass, Hp, top_k, block_size)
        rows = int(_recall._rows_with_choice(int(n), top_k, block_size).sum())
        if rows:
            m = _recall.selection_metrics(picked, oracle, mass, top_k, block_size)
            for key in totals:
                totals[key] += m[key] * rows
            rows_total += rows
        start = end
    out = {key: (v / rows_total if rows_total else math.nan) for key, v in totals.items()}
    out["rows"] = rows_total
    return out


def _oracle(mass: torch.Tensor, Hp: int, top_k: int, block_size: int) -> torch.Tensor:
    """int32 ``(T, Hp, top_k)``: per row and proxy head, the own block and the ``top_k - 1``
    visible blocks of most group-mean main mass (``mass``: ``(H, T, nb)``), -1 where fewer."""
    H, T, nb = mass.shape
    group = mass.view(Hp, H // Hp, T, nb).mean(1).permute(1, 0, 2).clone()  # (T, Hp, nb)
    own = torch.arange(T) // block_size
    visible = torch.arange(nb)[None, :] <= own[:, None]  # (T, nb)
    group = group.masked_fill(~visible[:, None, :], -1.0)
    group[torch.arange(T), :, own] = math.inf
    k = min(top_k, nb)
    idx = group.topk(k, dim=-1).indices
    idx = torch.where(group.gather(-1, idx) < 0, -1, idx)
    if k < top_k:
        idx = torch.nn.functional.pad(idx, (0, top_k - k), value=-1)
    return idx.sort(-1).values.to(torch.int32)
