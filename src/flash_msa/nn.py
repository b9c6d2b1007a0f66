"""Layers over :func:`flash_msa.msa_attention`: the MSA indexer and a GQA attention layer.

- :class:`RotaryEmbedding`: rotate-half RoPE (the Llama / Hugging Face convention), also the
  RoPE hook's signature ``rotary(q, k, position_ids) -> (q, k)``.
- :class:`MSAIndexer`: the proxy (index) projections ``q_proxy``, ``k_proxy`` with optional
  RMSNorm and RoPE; reads a detached input by default, as the MSA paper does.
- :class:`MSAttention`: q/k/v/o projections, RoPE, an :class:`MSAIndexer` and the fused op;
  returns ``(output, kl)``. The KL trains the indexer through :func:`attach_kl`: its gradient
  rides on ``output``'s backward, so a trainer that only backpropagates its own loss trains the
  proxy too (docs/nn.md, "The KL and the loss").

Shapes: batch form ``hidden_states (B, S, hidden_size)``; varlen form ``(T, hidden_size)`` (or
``(1, T, hidden_size)``, as packed Hugging Face / fla batches come) with int32 or int64
``cu_seqlens``.
Names follow Hugging Face / fla layers (``hidden_size``, ``num_heads``, ``num_key_value_heads``,
``head_dim``, ``qkv_bias``, ``qk_norm``, ``norm_eps``, ``rope_theta``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import nn

from . import quant
from .api import msa_attention

__all__ = [
    "MSAIndexer",
    "MSAttention",
    "RotaryEmbedding",
    "apply_rotary",
    "attach_kl",
    "position_ids_from_cu_seqlens",
]


# ---------------------------------------------------------------------------------------------
# argument checks (constructor errors name the argument, as the functional API's do)
# ---------------------------------------------------------------------------------------------
def _positive_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _positive_float(name, value, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return value


def _bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _divides(small_name, small, big_name, big):
    if big % small:
        raise ValueError(f"{big_name} ({big}) must be a multiple of {small_name} ({small})")


# ---------------------------------------------------------------------------------------------
# positions and RoPE
# ---------------------------------------------------------------------------------------------
def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Per-document positions of a packed batch: ``[0..l0-1, 0..l1-1, ...]``.

    Args:
        cu_seqlens: int32 or int64 ``(N + 1,)`` cumulative lengths.
        total_tokens: ``T`` (passed in so that no device-to-host copy is needed).

    Returns:
        int64 ``(T,)`` on ``cu_seqlens``' device.
    """
    cu = cu_seqlens.long()
    t = torch.arange(total_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)  # the sequence each token belongs to
    return t - cu[seq.clamp_max(cu.numel() - 1)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` features of ``x`` (the rest pass through).

    Args:
        x: ``(..., heads, dim)``.
        cos, sin: broadcastable to ``(..., 1, rotary_dim)``, ``rotary_dim <= dim`` and even.

    Returns:
        like ``x``; the rotation is computed in fp32 (fp64 for fp64 inputs) and rounded once.
    """
    r = cos.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    xr = x[..., :r].to(compute)
    out = xr * cos.to(compute) + _rotate_half(xr) * sin.to(compute)
    if r == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1)


class RotaryEmbedding:
    """RoPE with ``inv_freq[i] = rope_theta ** (-2i / rotary_dim)`` (rotate-half layout).

    The frequencies are those of Llama's default RoPE in Hugging Face transformers. A plain
    callable, not a module: it has no parameters, and no buffers (``inv_freq`` is rebuilt in fp32
    on each call, ``rotary_dim / 2`` values, so ``model.to(torch.bfloat16)`` cannot round it);
    and a layer's ``rotary`` attribute can be replaced by any function of the same call.

    Args:
        head_dim: features per head of the tensors it rotates.
        rope_theta: the base (> 0).
        rotary_dim: rotate only the first ``rotary_dim`` features (partial RoPE); default all.
            Must be even.

    Call: ``rotary(q, k, position_ids) -> (q, k)`` with ``q (..., Hq, head_dim)``,
    ``k (..., Hk, head_dim)`` and integer ``position_ids`` broadcastable to ``q.shape[:-2]``.
    """

    def __init__(self, head_dim: int, rope_theta: float = 10000.0, rotary_dim: int | None = None):
        self.head_dim = _positive_int("head_dim", head_dim)
        self.rope_theta = _positive_float("rope_theta", rope_theta)
        rotary_dim = (
            self.head_dim if rotary_dim is None else _positive_int("rotary_dim", rotary_dim)
        )
        if rotary_dim == self.head_dim and rotary_dim % 2:
            raise ValueError(
                f"head_dim must be even for RoPE, got {head_dim} (pass rope_theta=None for a "
                "layer without RoPE, or an even rotary_dim for partial RoPE)"
            )
        if rotary_dim % 2 or rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and <= head_dim ({self.head_dim}), got {rotary_dim}"
            )
        self.rotary_dim = rotary_dim

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(cos, sin)`` of shape ``(*position_ids.shape, 1, rotary_dim)`` in ``dtype``.

        ``inv_freq`` is always the fp32 value (Hugging Face keeps it in an fp32 buffer); the
        angles are computed in ``dtype``, so fp64 inputs get fp64-accurate rotations."""
        d = self.rotary_dim
        arange = torch.arange(0, d, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = (1.0 / (self.rope_theta ** (arange / d))).to(dtype)
        freqs = position_ids[..., None].to(dtype) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
        return emb.cos(), emb.sin()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor):
        for name, x in (("q", q), ("k", k)):
            if x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{name} has head_dim {x.shape[-1]} but this RotaryEmbedding was built for "
                    f"{self.head_dim}"
                )
        cos, sin = self.cos_sin(position_ids, torch.promote_types(q.dtype, torch.float32))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def __repr__(self) -> str:
        return (
            f"RotaryEmbedding(head_dim={self.head_dim}, rope_theta={self.rope_theta}, "
            f"rotary_dim={self.rotary_dim})"
        )


def _default_positions(lead: torch.Size, cu_seqlens, device) -> torch.Tensor:
    """Positions when none are given: per document (varlen) or ``arange(S)`` per batch row."""
    if cu_seqlens is not None:
        return position_ids_from_cu_seqlens(cu_seqlens, lead[0])
    return torch.arange(lead[-1], device=device).expand(lead)


# ---------------------------------------------------------------------------------------------
# the KL as an auxiliary loss
# ---------------------------------------------------------------------------------------------
class _AttachKL(torch.autograd.Function):
    """Identity on ``output``; its backward also sends ``kl_coeff`` as the KL's gradient."""

    @staticmethod
    def forward(ctx, output, kl, kl_coeff):
        ctx.kl_coeff, ctx.kl_dtype = kl_coeff, kl.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        dkl = torch.full((), ctx.kl_coeff, dtype=ctx.kl_dtype, device=grad_output.device)
        return grad_output, dkl, None


def attach_kl(output: torch.Tensor, kl: torch.Tensor, kl_coeff: float) -> torch.Tensor:
    """Return ``output`` unchanged, with ``kl_coeff * kl`` riding on its backward.

    Whatever loss ``L`` is built on the returned tensor, ``L.backward()`` produces the gradients
    of ``L + kl_coeff * kl``: the KL's gradient is injected once per backward of ``output``,
    whatever the loss does with ``output``. This is the Megatron-style auxiliary-loss scaler; it
    needs no module state, survives frameworks that drop extra outputs (Hugging Face decoder
    layers) and gradient checkpointing (the KL is part of ``output``'s graph).

    Caveat: the injected gradient does not see the scaling the trainer applies to ``L`` itself.
    Divide ``kl_coeff`` by the gradient-accumulation steps if the loss is divided by them, and
    multiply it by the loss scale under ``torch.amp.GradScaler`` (fp16).

    Args:
        output: any tensor that takes part in the loss, e.g. ``(B, S, hidden_size)``.
        kl: 0-dim tensor (from :func:`flash_msa.msa_attention`).
        kl_coeff: finite float >= 0.
    """
    kl_coeff = _positive_float("kl_coeff", kl_coeff, allow_zero=True)
    if kl.dim() != 0:
        raise ValueError(f"kl must be a 0-dim tensor, got shape {tuple(kl.shape)}")
    return _AttachKL.apply(output, kl, kl_coeff)


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
class MSAIndexer(nn.Module):
    """The MSA proxy (index) attention's projections: ``hidden -> (q_proxy, k_proxy)``.

    ``q_proj``/``k_proj`` (no bias), then per-head RMSNorm (``q_norm``/``k_norm``, if
    ``qk_norm``), then RoPE (``rotary``). No value projection: the proxy only ranks blocks.

    Args:
        hidden_size: features of ``hidden_states``.
        num_proxy_heads: ``Hp``; :class:`MSAttention` needs ``num_heads % Hp == 0`` and ``Hp``,
            ``num_key_value_heads`` dividing one another (the paper: ``Hp == Hkv``).
        proxy_head_dim: ``Dp`` (may differ from the main ``head_dim``).
        num_proxy_kv_heads: ``Hpk``, proxy key heads; ``Hp % Hpk == 0`` (the paper: 1).
        qk_norm: RMSNorm over ``Dp`` on ``q_proxy`` and ``k_proxy`` before RoPE.
        norm_eps: the RMSNorm epsilon.
        rope_theta: base of the built-in :class:`RotaryEmbedding` over all ``Dp`` features;
            ``None`` for no RoPE on the proxy.
        rotary: the RoPE hook: a callable ``(q_proxy, k_proxy, position_ids) -> (q_proxy,
            k_proxy)`` used instead of the built-in one (e.g. ``RotaryEmbedding(Dp, 1e4,
            rotary_dim=64)`` for partial RoPE). Stored as ``self.rotary``, which may also be
            reassigned later.
        detach_input: project ``hidden_states.detach()``, so that only the KL trains the
            proxy and the proxy never pulls the backbone towards what is easy to index (the
            MSA paper). Attribute, may be flipped.
        device, dtype: parameter factory arguments.
    """

    def __init__(
        self,
        hidden_size: int,
        num_proxy_heads: int,
        proxy_head_dim: int = 128,
        num_proxy_kv_heads: int = 1,
        *,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        rope_theta: float | None = 10000.0,
        rotary: Callable | None = None,
        detach_input: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_proxy_heads = _positive_int("num_proxy_heads", num_proxy_heads)
        self.proxy_head_dim = _positive_int("proxy_head_dim", proxy_head_dim)
        self.num_proxy_kv_heads = _positive_int("num_proxy_kv_heads", num_proxy_kv_heads)
        _divides("num_proxy_kv_heads", num_proxy_kv_heads, "num_proxy_heads", num_proxy_heads)
        self.detach_input = _bool("detach_input", detach_input)
        _bool("qk_norm", qk_norm)
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary must be callable, got {type(rotary).__name__}")
        if rotary is None and rope_theta is not None:
            rotary = RotaryEmbedding(self.proxy_head_dim, rope_theta)
        self.rotary = rotary
        factory = {"device": device, "dtype": dtype}
        C, Hp, Hpk, Dp = hidden_size, num_proxy_heads, num_proxy_kv_heads, proxy_head_dim
        self.q_proj = nn.Linear(C, Hp * Dp, bias=False, **factory)
        self.k_proj = nn.Linear(C, Hpk * Dp, bias=False, **factory)
        eps = _positive_float("norm_eps", norm_eps)
        self.q_norm = nn.RMSNorm(Dp, eps=eps, **factory) if qk_norm else None
        self.k_norm = nn.RMSNorm(Dp, eps=eps, **factory) if qk_norm else None

    def forward(self, hidden_states: torch.Tensor, position_ids=None, cu_seqlens=None):
        """Project ``hidden_states`` to the proxy queries and keys.

        Args:
            hidden_states: ``(B, S, hidden_size)``, or ``(T, hidden_size)`` (packed, with
                ``cu_seqlens``, or one sequence).
            position_ids: integer positions broadcastable to the leading dims; default
                per-document positions from ``cu_seqlens``, else ``0..S-1`` per row.
            cu_seqlens: int32 or int64 ``(N + 1,)`` for packed input (used for the default
                positions).

        Returns:
            ``(q_proxy, k_proxy)``: ``(..., Hp, Dp)`` and ``(..., Hpk, Dp)`` with the leading dims
            of ``hidden_states``.
        """
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be (B, S, {self.hidden_size}) or (T, {self.hidden_size}); "
                f"got shape {tuple(hidden_states.shape)}"
            )
        x = hidden_states.detach() if self.detach_input else hidden_states
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_proxy_heads, self.proxy_head_dim)
        k = self.k_proj(x).view(*lead, self.num_proxy_kv_heads, self.proxy_head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            if position_ids is None:
                position_ids = _default_positions(lead, cu_seqlens, x.device)
            q, k = self.rotary(q, k, position_ids)
        return q, k

    def extra_repr(self) -> str:
        return (
            f"num_proxy_heads={self.num_proxy_heads}, proxy_head_dim={self.proxy_head_dim}, "
            f"num_proxy_kv_heads={self.num_proxy_kv_heads}, detach_input={self.detach_input}, "
            f"rotary={self.rotary!r}"
        )


class MSAttention(nn.Module):
    """GQA self-attention with MiniMax Sparse Attention (causal; training and prefill).

    ``q = q_proj(x)``, ``k = k_proj(x)``, ``v = v_proj(x)`` (optionally RMSNorm-ed per head,
    then RoPE), the indexer's ``(q_proxy, k_proxy)``, then :func:`flash_msa.msa_attention` and
    ``o_proj``. Heads map as in the op: main head ``h`` reads KV head ``h // (H / Hkv)`` and
    proxy head ``h // (H / Hp)``.

    Args:
        hidden_size: features of ``hidden_states`` and of the output.
        num_heads: ``H``, query heads.
        num_key_value_heads: ``Hkv`` (default ``num_heads``); ``num_heads % Hkv == 0``.
        head_dim: ``D`` (default ``hidden_size // num_heads``, which must then divide exactly).
        top_k: key *blocks* each query keeps (its own included); the paper uses 16.
        block_size: tokens per key block, 64 or 128.
        indexer: an :class:`MSAIndexer` (or any module with its call signature); default
            ``MSAIndexer(hidden_size, num_proxy_heads=Hkv, proxy_head_dim=D,
            rope_theta=rope_theta, norm_eps=norm_eps)``, the paper's shape.
        qkv_bias: bias on ``q_proj``, ``k_proj``, ``v_proj`` (``o_proj`` has none).
        qk_norm: per-head RMSNorm on ``q`` and ``k`` before RoPE.
        norm_eps: the RMSNorm epsilon (``qk_norm`` and the default indexer).
        rope_theta: RoPE base for ``q``/``k``; ``None`` for none. ``self.rotary`` is the hook
            (``(q, k, position_ids) -> (q, k)``), reassignable; ``position_embeddings`` passed
            to :meth:`forward` take precedence over it.
        warmup: dense causal attention with the KL over all visible keys (``top_k`` unused);
            an attribute a trainer flips when dense warmup ends.
        kl_coeff: weight of the KL attached to the output's backward (:func:`attach_kl`);
            ``None`` attaches nothing and returns a ``kl`` that carries the gradient, for the
            trainer to add to its loss itself; ``0`` trains no proxy. Attribute, may be
            changed between steps.
        deterministic: bitwise-reproducible outputs and gradients (the ``deterministic=``
            keyword of :func:`flash_msa.msa_attention`); ``None`` (default) follows
            ``FLASH_MSA_DETERMINISTIC``. Attribute, may be changed between steps.
        selection_precision: ``"bf16"`` (default, the exact selection) or ``"fp8"`` (an
            approximate selection by e4m3 proxy scores); the ``selection_precision=`` keyword
            of :func:`flash_msa.msa_attention`, which says where it runs. Attribute, may be
            changed between steps (checked again at each call).
        device, dtype: parameter factory arguments.

    Attributes:
        last_kl: the detached KL of the latest forward (0-dim fp32), for logging; not part of
            any gradient path.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        *,
        top_k: int = 16,
        block_size: int = 128,
        indexer: nn.Module | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        rope_theta: float | None = 10000.0,
        warmup: bool = False,
        kl_coeff: float | None = 1.0,
        deterministic: bool | None = None,
        selection_precision: str = "bf16",
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_heads = _positive_int("num_heads", num_heads)
        if num_key_value_heads is None:
            num_key_value_heads = num_heads
        self.num_key_value_heads = _positive_int("num_key_value_heads", num_key_value_heads)
        _divides("num_key_value_heads", num_key_value_heads, "num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"head_dim is not given and hidden_size ({hidden_size}) is not a multiple of "
                    f"num_heads ({num_heads}); pass head_dim explicitly"
                )
            head_dim = hidden_size // num_heads
        self.head_dim = _positive_int("head_dim", head_dim)
        self.top_k = _positive_int("top_k", top_k)
        self.block_size = _positive_int("block_size", block_size)
        if self.block_size not in (64, 128):
            raise ValueError(f"block_size must be 64 or 128, got {block_size}")
        self.warmup = _bool("warmup", warmup)
        if deterministic is not None:
            _bool("deterministic", deterministic)
        self.deterministic = deterministic
        self.selection_precision = quant.check_precision(selection_precision)
        _bool("qkv_bias", qkv_bias)
        _bool("qk_norm", qk_norm)
        self.kl_coeff = (
            None if kl_coeff is None else _positive_float("kl_coeff", kl_coeff, allow_zero=True)
        )
        factory = {"device": device, "dtype": dtype}
        C, H, Hkv, D = self.hidden_size, self.num_heads, self.num_key_value_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(C, Hkv * D, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(C, Hkv * D, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(H * D, C, bias=False, **factory)
        eps = _positive_float("norm_eps", norm_eps)
        self.q_norm = nn.RMSNorm(D, eps=eps, **factory) if qk_norm else None
        self.k_norm = nn.RMSNorm(D, eps=eps, **factory) if qk_norm else None
        self.rotary = None if rope_theta is None else RotaryEmbedding(D, rope_theta)
        if indexer is None:
            indexer = MSAIndexer(C, Hkv, D, rope_theta=rope_theta, norm_eps=eps, **factory)
        elif not isinstance(indexer, nn.Module):
            raise TypeError(f"indexer must be an nn.Module, got {type(indexer).__name__}")
        self._check_indexer(indexer)
        self.indexer = indexer
        self.last_kl = None

    def _check_indexer(self, indexer):
        Hp = getattr(indexer, "num_proxy_heads", None)
        if Hp is None:
            return  # a custom module: the op checks the heads at the first call
        if self.num_heads % Hp:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of the indexer's "
                f"num_proxy_heads ({Hp})"
            )
        Hkv = self.num_key_value_heads
        if Hp % Hkv and Hkv % Hp:
            raise ValueError(
                f"the indexer's num_proxy_heads ({Hp}) and num_key_value_heads ({Hkv}) must "
                "divide one another (a proxy group lies inside one KV group or is a union of "
                "whole KV groups)"
            )
        if getattr(indexer, "hidden_size", self.hidden_size) != self.hidden_size:
            raise ValueError(
                f"the indexer's hidden_size ({indexer.hidden_size}) must equal hidden_size "
                f"({self.hidden_size})"
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Causal MSA self-attention over ``hidden_states``.

        Args:
            hidden_states: ``(B, S, hidden_size)``; with ``cu_seqlens`` the packed
                ``(T, hidden_size)`` or ``(1, T, hidden_size)``.
            position_ids: integer RoPE positions, shaped like the leading dims (``(B, S)``,
                ``(1, S)``, ``(S,)``, or ``(T,)``/``(1, T)`` packed). Default: ``0..S-1`` per row,
                or per document from ``cu_seqlens``.
            cu_seqlens: int32 or int64 ``(N + 1,)`` cumulative document lengths (packed input;
                int64 is cast once, as in :func:`flash_msa.msa_attention`);
                documents never attend to one another.
            max_seqlen: the longest document; required when ``cu_seqlens`` is on a GPU.
            position_embeddings: precomputed ``(cos, sin)`` for ``q``/``k``, each
                ``(..., S or T, head_dim)`` in rotate-half layout, as Hugging Face models pass
                them; used instead of ``self.rotary``. The indexer keeps its own RoPE.

        Returns:
            ``(output, kl)``: ``output`` shaped like ``hidden_states``; ``kl`` the 0-dim mean
            proxy KL (fp32; fp64 for fp64 inputs). With ``kl_coeff`` set, ``kl`` is detached (its
            gradient already rides on ``output``); with ``kl_coeff=None`` it carries the
            gradient.
        """
        x = hidden_states
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be (B, S, {self.hidden_size}) or, with cu_seqlens, "
                f"(T, {self.hidden_size}); got shape {tuple(x.shape)}"
            )
        if cu_seqlens is not None:
            if x.dim() == 3 and x.shape[0] != 1:
                raise ValueError(
                    "with cu_seqlens, hidden_states must be packed as (T, hidden_size) or "
                    f"(1, T, hidden_size); got shape {tuple(x.shape)}"
                )
            x = x.reshape(-1, self.hidden_size)
            if position_ids is not None:
                position_ids = position_ids.reshape(-1)
        elif x.dim() != 3:
            raise ValueError(
                f"hidden_states of shape {tuple(x.shape)} needs cu_seqlens (the packed form); "
                "the batch form is (B, S, hidden_size)"
            )
        lead = x.shape[:-1]
        if position_ids is None:
            position_ids = _default_positions(lead, cu_seqlens, x.device)

        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_key_value_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None:
            cos, sin = (
                t.reshape(*lead, 1, t.shape[-1]) if cu_seqlens is not None else t.unsqueeze(-2)
                for t in position_embeddings
            )
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif self.rotary is not None:
            q, k = self.rotary(q, k, position_ids)
        q_proxy, k_proxy = self.indexer(x, position_ids=position_ids, cu_seqlens=cu_seqlens)

        out, kl = msa_attention(
            q_proxy,
            k_proxy,
            q,
            k,
            v,
            self.top_k,
            block_size=self.block_size,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            warmup=self.warmup,
            deterministic=self.deterministic,
            selection_precision=self.selection_precision,
        )
        out = self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
        if self.kl_coeff is not None:
            if self.kl_coeff > 0:  # 0: no gradient at all, so the proxy backward is skipped
                out = attach_kl(out, kl, self.kl_coeff)
            kl = kl.detach()
        self.last_kl = kl.detach()
        return out.view(hidden_states.shape), kl

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_key_value_heads={self.num_key_value_heads}, "
            f"head_dim={self.head_dim}, top_k={self.top_k}, block_size={self.block_size}, "
            f"warmup={self.warmup}, kl_coeff={self.kl_coeff}, "
            f"selection_precision={self.selection_precision!r}, rotary={self.rotary!r}"
        )
