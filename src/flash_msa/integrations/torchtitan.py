"""torchtitan: convert the ``GQAttention`` layers of a torchtitan decoder (Llama 3, Qwen 3, ...)
to MSA.

``convert_to_msa(model, top_k=..., block_size=...)`` replaces each transformer block's
``attention`` (a ``torchtitan.models.common.attention.GQAttention``) by a
:class:`TorchtitanMSAttention`: a :class:`flash_msa.nn.MSAttention` that keeps the block's own
modules under their own names (``qkv_linear``, fused or not, ``wo``, the optional ``q_norm`` /
``k_norm`` and the ``rope``), so a torchtitan checkpoint loads unchanged, plus
``attention.indexer.*`` (the new proxy). It takes ``GQAttention``'s call
``(x, attention_masks, positions)``:

- ``attention_masks=None``: causal attention over each row of the batch;
- torchtitan's ``VarlenMetadata`` (``attn_backend="varlen"``): its documents (``cu_seq_q``
  over the flattened batch);
- a FlexAttention ``BlockMask`` (``attn_backend="flex"``): the documents of ``positions``
  (each restarting at 0), as torchtitan's own causal document mask has them. A BlockMask
  built from anything but ``positions`` (sliding windows, fixed blocks) is not MSA's mask:
  call with ``attention_masks=None`` or use a varlen model.

In dense warmup the converted model computes the original model's logits. Tested on CPU with
torchtitan 0.3.0 (tests/integration/test_integrations_torchtitan.py). Training only: no KV cache; tensor,
context and pipeline parallelism of the attention are not handled (MSA's context parallelism is
:mod:`flash_msa.distributed`).
"""

from __future__ import annotations

import torch
from torchtitan.models.common.attention import (
    GQAttention,
    VarlenMetadata,
    create_varlen_metadata_for_document,
)

from ..api import msa_attention
from ..nn import MSAIndexer, MSAttention, attach_kl

# the child modules of GQAttention the conversion carries over (inner_attention, the dense
# kernel, is what MSA replaces)
CARRIED = ("qkv_linear", "wo", "q_norm", "k_norm", "rope")


def check_supported(attn) -> None:
    """Raise TypeError/ValueError saying why ``attn`` cannot be converted."""
    if not isinstance(attn, GQAttention):
        raise TypeError(
            f"flash_msa.integrations.torchtitan cannot convert {type(attn).__name__} "
            f"({type(attn).__module__}): supported is torchtitan's GQAttention"
        )
    unknown = sorted(set(dict(attn.named_children())) - set(CARRIED) - {"inner_attention"})
    if unknown:
        raise ValueError(
            f"{type(attn).__name__} has modules the conversion does not carry over: "
            f"{', '.join(unknown)} (converting would drop them and change the model)"
        )
    if attn.scaling is not None and abs(attn.scaling - attn.head_dim**-0.5) > 1e-12:
        raise ValueError(f"softmax scale {attn.scaling} is not head_dim ** -0.5")


class TorchtitanMSAttention(MSAttention):
    """:class:`~flash_msa.nn.MSAttention` with torchtitan's ``GQAttention`` modules and call:
    ``forward(x (B, L, dim), attention_masks, positions (B, L) or None) -> (B, L, dim)``."""

    @classmethod
    def from_gqa(cls, attn, *, top_k, block_size, num_proxy_heads=None, proxy_head_dim=None,
                 **layer_args):  # fmt: skip
        """A converted copy of ``attn`` sharing its modules. ``num_proxy_heads`` defaults to
        the KV heads and ``proxy_head_dim`` to head_dim (the paper's shape); ``layer_args``
        go to :class:`MSAttention` (``kl_coeff``, ``warmup``, ``deterministic``,
        ``selection_precision``, ``norm_eps`` of the indexer)."""
        check_supported(attn)
        weight = attn.wo.weight
        dim, Hkv, D = attn.wo.out_features, attn.n_kv_heads, attn.head_dim
        factory = dict(device=weight.device, dtype=weight.dtype)
        theta = attn.rope.config.theta
        layer = cls(
            dim,
            attn.n_heads,
            Hkv,
            D,
            top_k=top_k,
            block_size=block_size,
            indexer=MSAIndexer(
                dim,
                num_proxy_heads or Hkv,
                proxy_head_dim or D,
                rope_theta=theta,
                norm_eps=layer_args.get("norm_eps", 1e-6),
                **factory,
            ),
            rope_theta=None,  # q/k get the block's own rope module
            **layer_args,
            **factory,
        )
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # torchtitan's own replace them
            delattr(layer, name)
        for name in CARRIED:
            setattr(layer, name, getattr(attn, name))
        return layer

    def forward(self, x, attention_masks=None, positions=None):
        B, L, C = x.shape
        cu = max_len = None
        if attention_masks is not None:
            if not isinstance(attention_masks, VarlenMetadata):
                if positions is None:
                    raise ValueError(
                        f"{type(attention_masks).__name__} attention_masks: MSA reads the "
                        "documents from positions (restarting at 0 per document); pass "
                        "positions, or attention_masks=None for causal rows"
                    )
                attention_masks = create_varlen_metadata_for_document(positions)
            cu = attention_masks.cu_seq_q.to(torch.int32)
            max_len = int(attention_masks.max_q)
        q, k, v = self.qkv_linear(x)  # (B, L, heads, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, k, positions)
        position_ids = (
            torch.arange(L, device=x.device).expand(B, L) if positions is None else positions
        )
        if cu is None:
            q_proxy, k_proxy = self.indexer(x, position_ids=position_ids)
        else:  # the packed (T, ...) form over the flattened batch
            q, k, v = (t.reshape(B * L, *t.shape[2:]) for t in (q, k, v))
            q_proxy, k_proxy = self.indexer(
                x.reshape(B * L, C), position_ids=position_ids.reshape(-1), cu_seqlens=cu
            )
        out, kl = msa_attention(
            q_proxy,
            k_proxy,
            q,
            k,
            v,
            self.top_k,
            block_size=self.block_size,
            cu_seqlens=cu,
            max_seqlen=max_len,
            warmup=self.warmup,
            deterministic=self.deterministic,
            selection_precision=self.selection_precision,
        )
        out = self.wo(out.reshape(B, L, -1))
        if self.kl_coeff is not None and self.kl_coeff > 0:  # as MSAttention: docs/nn.md
            out = attach_kl(out, kl, self.kl_coeff)
        self.last_kl = kl.detach()
        return out


def convert_to_msa(model, *, top_k, block_size, **layer_args):
    """Replace every transformer block's ``attention`` of the torchtitan decoder ``model``
    (``model.layers``: its blocks) by a :class:`TorchtitanMSAttention`, in place; returns
    ``model``. Every block is checked before any is replaced."""
    blocks = getattr(model, "layers", None)
    if blocks is None:
        raise TypeError(
            f"cannot find the transformer blocks of {type(model).__name__}: expected "
            "model.layers (a torchtitan Decoder)"
        )
    blocks = list(blocks.values()) if hasattr(blocks, "values") else list(blocks)
    for block in blocks:
        check_supported(getattr(block, "attention", None))
    for block in blocks:
        block.attention = TorchtitanMSAttention.from_gqa(
            block.attention, top_k=top_k, block_size=block_size, **layer_args
        )
    return model


__all__ = ["CARRIED", "TorchtitanMSAttention", "check_supported", "convert_to_msa"]
