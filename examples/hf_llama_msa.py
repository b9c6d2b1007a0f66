"""Swap the attention of a Hugging Face Llama for flash_msa.nn.MSAttention, then train it.

A tiny randomly initialized ``LlamaForCausalLM`` (no downloads) gets one
:class:`LlamaMSAttention` per decoder layer. The converted layer keeps the model's own
q/k/v/o projections (a pretrained dense checkpoint converts in place; the indexer is new) and
takes ``LlamaAttention``'s call. The KL reaches the loss through ``MSAttention``'s ``kl_coeff``
(its gradient rides on the attention output's backward), so the usual
``model(input_ids, labels=...).loss.backward()`` trains the proxy as well.

Needs ``pip install transformers`` (tested with 5.24). Runs on CPU in well under a minute:

    python examples/hf_llama_msa.py
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from flash_msa.nn import MSAIndexer, MSAttention

# not "flash_…": transformers treats every name containing "flash" as a FlashAttention build
ATTN_IMPLEMENTATION = "msa"


def _not_converted(module, *args, **kwargs):
    raise RuntimeError(
        f"{type(module).__name__} was not converted: call convert_to_msa(model) so that every "
        "attention module is a LlamaMSAttention"
    )


# The attention function itself is never called (LlamaMSAttention runs the whole layer); the
# registration gives the model FlashAttention-style masks: None, or the 2-D padding mask (which
# LlamaMSAttention unpads), instead of a dense 4-D mask. Without a registered mask function
# transformers sets the mask to None and would silently drop padding.
AttentionInterface.register(ATTN_IMPLEMENTATION, _not_converted)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


class LlamaMSAttention(MSAttention):
    """:class:`~flash_msa.nn.MSAttention` with ``LlamaAttention``'s call and return.

    Supports unpadded batches, padded batches (the 2-D ``attention_mask``, unpadded to the varlen
    form) and packed batches (``position_ids`` restarting at 0, or the ``cu_seq_lens_q`` /
    ``max_length_q`` keyword arguments of transformers' flattening collator). Training and
    prefill only: no KV cache.
    """

    @classmethod
    def from_llama(cls, attn, *, top_k, block_size, num_proxy_heads=None, proxy_head_dim=None):
        """A converted copy of ``attn`` (a ``LlamaAttention``) sharing its projections."""
        config = attn.config
        if config.rope_parameters.get("rope_type", "default") != "default":
            # the main q/k use the model's own (cos, sin), any RoPE type; the indexer's built-in
            # RoPE implements the default one only
            raise ValueError("the indexer's RoPE supports rope_type 'default' only")
        if config.attention_dropout:
            raise ValueError("MSA has no attention dropout; set attention_dropout=0.0")
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
        )
        # keep the model's projections: same parameters, same state_dict keys as LlamaAttention
        layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj = (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
        )
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
        if cache is not None:
            raise NotImplementedError("LlamaMSAttention has no KV cache: pass use_cache=False")
        if kwargs.get("is_causal", True) is False:
            raise ValueError("MSA is causal; is_causal=False is not supported")
        B, S, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=hidden_states.device)[None]
        position_ids = position_ids.expand(B, S)
        cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if attention_mask is not None:  # (B, S) padding mask: run the valid tokens packed
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
            # packed documents, each restarting its positions at 0 (host sync: an example)
            starts = (position_ids[0] == 0).nonzero().flatten()
            cu = torch.cat([starts, starts.new_tensor([S])])
            if int(cu[0]) != 0:
                raise ValueError("packed position_ids must start at 0")
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


def convert_to_msa(model, *, top_k, block_size, **indexer_args):
    """Replace every decoder layer's ``self_attn`` of a Llama model by a LlamaMSAttention."""
    for layer in model.model.layers:
        layer.self_attn = LlamaMSAttention.from_llama(
            layer.self_attn, top_k=top_k, block_size=block_size, **indexer_args
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def msa_layers(model):
    """The model's MSAttention layers (to flip ``warmup`` or read ``last_kl``)."""
    return [m for m in model.modules() if isinstance(m, MSAttention)]


def tiny_config(**overrides):
    """A 2-layer GQA Llama small enough for a CPU (about 0.1 M parameters, indexers included)."""
    args = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_cache=False,
    )
    return LlamaConfig(**{**args, **overrides})


def main():
    torch.manual_seed(0)
    model = convert_to_msa(LlamaForCausalLM(tiny_config()), top_k=2, block_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 256))  # 4 blocks of 64: top_k=2 keeps half
    for step in range(4):
        for m in msa_layers(model):
            m.warmup = step == 0  # one dense warmup step, then sparse
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        kl = torch.stack([m.last_kl for m in msa_layers(model)]).mean()
        print(f"step {step}: loss {loss.item():.4f}  kl {kl.item():.4f}")


if __name__ == "__main__":
    main()
