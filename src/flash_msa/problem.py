"""Plain-data descriptions of one call, shared by ``api.py``, ``backends.py`` and every backend.

Two frozen dataclasses and three named tuples, nothing else:

- :class:`Config`: the non-tensor arguments of a call, after validation and defaulting.
- :class:`Problem`: what a backend needs to know to say whether it can run a call (device,
  dtype, head counts, head dims, ``Config``), without touching tensor data.
- :class:`Forward`: what a backend's ``fwd`` returns.
- :class:`Saved`: what the forward keeps for the backward (see docs/design.md, "Contract").
- :class:`Grads`: what the backward returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True, kw_only=True)
class Config:
    """Non-tensor parameters of one call (validated, defaults filled in).

    ``top_k`` is ``None`` for warmup and for ``sparse_attention`` (given indices);
    ``proxy_scale`` is ``None`` when the call has no proxy (``sparse_attention``).
    ``max_seqlen`` is the longest sequence (batch form: ``S``). ``deterministic``: every output
    and gradient bitwise reproducible across runs on the same inputs (ordered reductions
    instead of fp32 atomics; ``FLASH_MSA_DETERMINISTIC`` / the ``deterministic=`` keyword,
    :func:`flash_msa.backends.deterministic`); only backends whose ``Limits`` declare it run it.
    ``selection_precision``: ``"bf16"`` (default: the selection ranks fp32 scores of the
    input-dtype operands, exact) or ``"fp8"`` (e4m3 operands with fp32 scales, an approximate
    selection: :mod:`flash_msa.quant`); only backends whose ``Limits`` declare
    ``fp8_selection`` select in fp8.
    """

    block_size: int
    softmax_scale: float
    max_seqlen: int
    proxy_scale: float | None = None
    top_k: int | None = None
    warmup: bool = False
    compute_kl: bool = False
    deterministic: bool = False
    selection_precision: str = "bf16"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Everything a backend's ``unsupported_reason`` may look at.

    ``capability`` is ``(major, minor)`` for CUDA devices, ``None`` on CPU.
    ``num_sel_heads`` is the number of selection heads (``Hp`` for the fused op and
    ``select_blocks``, the index tensor's heads for ``sparse_attention``). Heads and dims a call
    does not have are 0: no proxy in ``sparse_attention``, no main tensors in ``select_blocks``.
    """

    device_type: str
    capability: tuple[int, int] | None
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_sel_heads: int
    num_proxy_k_heads: int
    proxy_head_dim: int
    varlen: bool
    cfg: Config
    num_seqs: int = 1  # sequences in the call (batch size, or len(cu_seqlens) - 1)
    # the call passes a query map (``q_map``: queries that are not the keys' own tokens, as in
    # context parallelism; docs/distributed.md); only backends that declare it run such calls
    q_map: bool = False

    @property
    def deterministic(self) -> bool:
        """The call asks for deterministic mode (``Config.deterministic``); only backends whose
        ``Limits`` declare ``deterministic`` run it."""
        return self.cfg.deterministic

    @property
    def selection_precision(self) -> str:
        """The call's ``Config.selection_precision`` (``"bf16"`` or ``"fp8"``); only backends
        whose ``Limits`` declare ``fp8_selection`` run an fp8 ``select``."""
        return self.cfg.selection_precision


def problem_of(
    device, dtype, dims, num_seqs: int, varlen: bool, cfg: Config, *, q_map: bool = False
) -> Problem:
    """The :class:`Problem` of a call on ``device`` in ``dtype``, with
    ``dims = (H, Hkv, D, Hsel, Hpk, Dp)`` (0 for the heads/dims a call does not have) and
    ``q_map`` whether the call maps its queries onto the keys' tokens; the capability is read
    from the device (the one place a Problem is built)."""
    H, Hkv, D, Hsel, Hpk, Dp = dims
    device = torch.device(device)
    cuda = device.type == "cuda"
    return Problem(
        device_type=device.type,
        capability=capability(device) if cuda else None,
        dtype=dtype,
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=D,
        num_sel_heads=Hsel,
        num_proxy_k_heads=Hpk,
        proxy_head_dim=Dp,
        varlen=varlen,
        cfg=cfg,
        num_seqs=num_seqs,
        q_map=q_map,
    )


def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, asked once per device index (a CUDA
    device's capability does not change; ``problem_of`` runs for every op of every call). ``cuda`` without an index is the current
    device, resolved per call. Keyed by the function too, so a test that patches
    ``torch.cuda.get_device_capability`` gets its value and never leaves it behind. H200 host
    (timeit, min of 7): the ask 2.18 us, this 0.21 us; ``problem_of`` 5.18 -> 4.72 us."""
    ask = torch.cuda.get_device_capability
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (ask, index)
    cap = _CAPABILITIES.get(key)
    if cap is None:
        if len(_CAPABILITIES) > 64:  # (a bound: patched functions are new keys)
            _CAPABILITIES.clear()
        cap = _CAPABILITIES[key] = ask(index)
    return cap


_CAPABILITIES: dict = {}


class Forward(NamedTuple):
    """What a backend's ``fwd`` returns (docs/design.md, "fwd outputs").

    ``proxy_grad`` is ``(dq_proxy, dk_proxy)`` in fp32 for ``dkl = 1`` (the proxy gradient is
    linear in ``dkl``) when ``fwd`` was asked for it (``proxy_grad=True``) and the backend
    computes it in the forward's KL pass; ``None`` otherwise (``bwd`` then computes it).
    """

    out: torch.Tensor  # (T, H, D), input dtype
    lse: torch.Tensor  # (T, H) fp32
    proxy_lse: torch.Tensor | None  # (T, Hp) fp32
    kl: torch.Tensor | None  # () fp32
    proxy_grad: tuple[torch.Tensor, torch.Tensor] | None = None


class Saved(NamedTuple):
    """Tensors the forward saves for the backward, packed varlen layout (``T`` = total tokens).

    ``indices`` is ``None`` in warmup; ``q_proxy``/``k_proxy``/``proxy_lse`` are ``None`` when the
    proxy gets no gradient. ``proxy_grad``: the forward's unit proxy gradient, if it made one
    (a ``bwd`` may use it, scaled by ``dkl``, instead of its own proxy pass).
    """

    q: torch.Tensor  # (T, H, D)
    k: torch.Tensor  # (T, Hkv, D)
    v: torch.Tensor  # (T, Hkv, D)
    out: torch.Tensor  # (T, H, D), input dtype
    lse: torch.Tensor  # (T, H) fp32, natural log, over the selected keys
    indices: torch.Tensor | None  # (T, Hsel, top_k) int32, sequence-local block numbers
    q_proxy: torch.Tensor | None  # (T, Hp, Dp)
    k_proxy: torch.Tensor | None  # (T, Hpk, Dp)
    proxy_lse: torch.Tensor | None  # (T, Hp) fp32, natural log of sum exp(z) over the kept keys
    proxy_grad: tuple[torch.Tensor, torch.Tensor] | None = None  # Forward.proxy_grad


class Grads(NamedTuple):
    """Gradients returned by a backend's ``bwd``; ``None`` where not requested."""

    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    dq_proxy: torch.Tensor | None
    dk_proxy: torch.Tensor | None

    @classmethod
    def cast(cls, grads, likes) -> Grads:
        """``Grads`` of ``grads`` (dq, dk, dv, dq_proxy, dk_proxy: fp32 accumulators or
        ``None``), each in the dtype of its input in ``likes`` (q, k, v, q_proxy, k_proxy)."""
        return cls(*(None if g is None else g.to(x.dtype) for g, x in zip(grads, likes)))


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The backward's ``delta = rowsum(dO * O)``: ``(T, H)`` fp32 from ``dout``, ``out`` ``(T, H,
    D)``, bitwise equal to ``(dout.float() * out.float()).sum(-1)``.

    For bf16/fp16 inputs the product is made by one ``addcmul`` onto a ``(1,)`` fp32 ``-0.0``
    (a 1-D fp32 operand promotes the op to fp32; a 16-bit product is exact in fp32 and ``x +
    (-0.0) == x`` for every ``x``, signed zeros included), so the sum sees the same values: 3
    launches instead of 4 (the two casts and the product) and about 40 % of the bytes. Anchor
    16K on the H200 (a trace of the eager step): the four took 361 us of a 5.1 ms step. The constant is made per call (one element),
    not cached: a tensor first made during a CUDA-graph capture would live in the graph's
    pool. Other dtypes keep the plain expression (fp64 inputs then give an fp32 delta, as
    before)."""
    if dout.dtype in (torch.bfloat16, torch.float16) and out.dtype == dout.dtype:
        zero = torch.full((1,), -0.0, dtype=torch.float32, device=dout.device)
        return torch.addcmul(zero, dout, out).sum(-1)
    return (dout.float() * out.float()).sum(-1)
