"""Hugging Face transformers: convert a Llama, Mistral, Qwen2 or Qwen3 causal LM to MSA.

``convert_to_msa(model, top_k=..., block_size=...)`` replaces each decoder layer's
``self_attn`` by an :class:`HFMSAttention` (a :class:`flash_msa.nn.MSAttention` taking the
Hugging Face attention call) that shares the model's own q/k/v/o projections and, for Qwen3,
its per-head ``q_norm``/``k_norm``: a pretrained dense checkpoint converts in place, its
state-dict keys unchanged, plus ``self_attn.indexer.*`` (the new proxy). In dense warmup the
converted model computes the original model's logits.

Supported: the attention classes in :data:`SUPPORTED` (tested on CPU with tiny random models of
each family, transformers 5.24). Anything else is refused with the class name, as is a module
with parts the conversion does not know (a silently dropped norm changes the model), a sliding
window, attention dropout, or a softmax scale other than ``head_dim ** -0.5``.

Batches: unpadded; padded (the 2-D ``attention_mask``, unpadded to the packed form; padded
positions output 0); packed (``position_ids`` restarting at 0, or the ``cu_seq_lens_q`` /
``max_length_q`` keyword arguments of transformers' flattening collator). Training and prefill:
no KV cache (``use_cache=False``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..nn import MSAIndexer, MSAttention
from .training import msa_layers

# not "flash_...": transformers treats every implementation name containing "flash" as a
# FlashAttention build and looks for one
ATTN_IMPLEMENTATION = "msa"

# attention class name -> the child modules the conversion carries over (every child of a
# supported module must be in its set: an unknown one would be dropped silently)
SUPPORTED = {
    "LlamaAttention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "MistralAttention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "Qwen2Attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "Qwen3Attention": ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"),
}


def _not_converted(module, *args, **kwargs):
    raise RuntimeError(
        f"{type(module).__name__} was not converted: call convert_to_msa(model) so that every "
        "attention module is an HFMSAttention"
    )


# The attention function itself is never called (HFMSAttention runs the whole layer); the
# registration gives the model FlashAttention-style masks: None, or the 2-D padding mask (which
# HFMSAttention unpads), instead of a dense 4-D mask. Without a registered mask function
# transformers sets the mask to None and would silently drop padding.
AttentionInterface.register(ATTN_IMPLEMENTATION, _not_converted)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


def check_supported(attn) -> None:
    """Raise TypeError/ValueError saying why ``attn`` (a decoder layer's ``self_attn``) cannot
    be converted; return None when it can."""
    name = type(attn).__name__
    if name not in SUPPORTED:
        raise TypeError(
            f"flash_msa.integrations.hf cannot convert {name} ({type(attn).__module__}): "
            f"supported attention classes are {', '.join(SUPPORTED)}"
        )
    unknown = sorted(set(dict(attn.named_children())) - set(SUPPORTED[name]))
    if unknown:
        raise ValueError(
            f"{name} has modules the conversion does not carry over: {', '.join(unknown)} "
            "(converting would drop them and change the model)"
        )
    config = attn.config
    window = getattr(attn, "sliding_window", None) or getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if (window and getattr(config, "use_sliding_window", True)) or (
        "sliding_attention" in layer_types
    ):
        raise ValueError(
            f"{name}: sliding-window attention (sliding_window={window}) is not MSA's causal "
            "attention; set config.sliding_window = None (or use_sliding_window = False) to "
            "convert"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{name}: MSA has no attention dropout; set attention_dropout=0.0")
    scaling = getattr(attn, "scaling", attn.head_dim**-0.5)
    if abs(scaling - attn.head_dim**-0.5) > 1e-12 * scaling:
        raise ValueError(
            f"{name}: softmax scale {scaling} is not head_dim ** -0.5 ({attn.head_dim**-0.5})"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        # q/k use the model's own (cos, sin), any RoPE type; the indexer's built-in RoPE
        # implements the default one only
        raise ValueError(
            f"{name}: the indexer's RoPE supports rope_type 'default' only, got "
            f"{rope.get('rope_type')!r}"
        )


class HFMSAttention(MSAttention):
    """:class:`~flash_msa.nn.MSAttention` with the Hugging Face attention call and return.

    ``forward(hidden_states (B, S, hidden_size), position_embeddings, attention_mask, ...)
    -> (output (B, S, hidden_size), None)``; see the module docstring for the batch forms.
    """

    @classmethod
    def from_hf(cls, attn, *, top_k, block_size, num_proxy_heads=None, proxy_head_dim=None,
                **layer_args):  # fmt: skip
        """A converted copy of ``attn`` (one of :data:`SUPPORTED`) sharing its modules.

        ``num_proxy_heads`` defaults to the model's KV heads and ``proxy_head_dim`` to its
        head_dim (the paper's shape); ``layer_args`` go to :class:`MSAttention` (``kl_coeff``,
        ``warmup``, ``deterministic``, ``selection_precision``)."""
        check_supported(attn)
        config = attn.config
        weight = attn.q_proj.weight
        proxy_head_dim = proxy_head_dim or attn.head_dim
        layer = cls(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            attn.head_dim,
            top_k=top_k,
            block_size=block_size,
            indexer=MSAIndexer(
                config.hidden_size,
                num_proxy_heads or config.num_key_value_heads,
                proxy_head_dim,
                rope_theta=config.rope_parameters["rope_theta"],
                norm_eps=config.rms_norm_eps,
                device=weight.device,
                dtype=weight.dtype,
            ),
            rope_theta=None,  # q/k get the model's position_embeddings
            device=weight.device,
            dtype=weight.dtype,
            **layer_args,
        )
        # the model's own modules: same parameters, same state_dict keys as the original
        for child in SUPPORTED[type(attn).__name__]:
            setattr(layer, child, getattr(attn, child))
        layer.layer_idx = attn.layer_idx
        return layer

    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        cache=None,
        position_ids=None,
        **kwargs,
    ):
        """``hidden_states (B, S, hidden_size) -> (output (B, S, hidden_size), None)``."""
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError("HFMSAttention has no KV cache: pass use_cache=False")
        if kwargs.get("is_causal", True) is False:
            raise ValueError("MSA is causal; is_causal=False is not supported")
        B, S, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=hidden_states.device)[None]
        position_ids = position_ids.expand(B, S)
        cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if attention_mask is not None:  # (B, S) padding mask: run the valid tokens packed
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be the 2-D (B, S) padding mask (the model's attention "
                    f"implementation must be {ATTN_IMPLEMENTATION!r}); got shape "
                    f"{tuple(attention_mask.shape)}"
                )
            keep = attention_mask.bool()
            lengths = keep.sum(1, dtype=torch.int32)
            cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            cos, sin = (t.expand(B, S, -1)[keep] for t in position_embeddings)
            out, _ = super().forward(
                hidden_states[keep],
                position_ids=position_ids[keep],
                cu_seqlens=cu,
                max_seqlen=int(lengths.max()),
                position_embeddings=(cos, sin),
            )
            return hidden_states.new_zeros(hidden_states.shape).index_put((keep,), out), None
        if cu is None and B == 1 and bool((position_ids[0, 1:] == 0).any()):
            # packed documents, each restarting its positions at 0 (one host sync)
            starts = (position_ids[0] == 0).nonzero().flatten()
            if starts.numel() == 0 or int(starts[0]) != 0:
                raise ValueError("packed position_ids must start at 0")
            cu = torch.cat([starts, starts.new_tensor([S])])
            max_len = int((cu[1:] - cu[:-1]).max())
        if cu is not None:
            cu = cu.to(torch.int32)
            max_len = None if max_len is None else int(max_len)
        out, _ = super().forward(
            hidden_states,
            position_ids=position_ids,
            cu_seqlens=cu,
            max_seqlen=max_len,
            position_embeddings=position_embeddings,
        )
        return out, None


def decoder_layers(model):
    """The decoder layers of a causal LM (``model.model.layers``) or of its base model."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(
            f"cannot find the decoder layers of {type(model).__name__}: expected "
            "model.model.layers (a *ForCausalLM) or model.layers (the base model)"
        )
    return layers


def convert_to_msa(model, *, top_k, block_size, **layer_args):
    """Replace every decoder layer's ``self_attn`` of ``model`` by an :class:`HFMSAttention`
    (in place; returns ``model``). Every layer is checked before any is replaced, so a refused
    model is left unchanged. ``layer_args``: :meth:`HFMSAttention.from_hf`'s."""
    layers = decoder_layers(model)
    for layer in layers:
        check_supported(layer.self_attn)
    for layer in layers:
        layer.self_attn = HFMSAttention.from_hf(
            layer.self_attn, top_k=top_k, block_size=block_size, **layer_args
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED",
    "HFMSAttention",
    "check_supported",
    "convert_to_msa",
    "decoder_layers",
    "msa_layers",
]
