"""Convert a Hugging Face Llama to MSA with flash_msa.integrations.hf, then train it.

A tiny randomly initialized ``LlamaForCausalLM`` (no downloads) gets one MSA layer per decoder
layer (``convert_to_msa``: the model's own q/k/v/o projections, a new indexer). The KL reaches
the loss through the layers' ``kl_coeff``, so the usual
``model(input_ids, labels=...).loss.backward()`` trains the proxy as well. The same call
converts Mistral, Qwen2 and Qwen3 models (docs/integrations.md).

Needs ``pip install transformers`` (tested with 5.24). Runs on CPU in well under a minute:

    python examples/hf_llama_msa.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flash_msa.integrations import msa_layers, set_warmup, total_kl
from flash_msa.integrations.hf import convert_to_msa

__all__ = ["TINY", "convert_to_msa", "msa_layers", "tiny_config", "main"]

# a 2-layer GQA decoder small enough for a CPU (about 0.1 M parameters, indexers included); the
# same arguments make a Mistral, Qwen2 or Qwen3 config (tests/integration/test_integrations_hf.py)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    use_cache=False,
)


def tiny_config(**overrides):
    """The :data:`TINY` Llama config, with ``overrides``."""
    return LlamaConfig(**{**TINY, **overrides})


def main():
    torch.manual_seed(0)
    model = convert_to_msa(LlamaForCausalLM(tiny_config()), top_k=2, block_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 256))  # 4 blocks of 64: top_k=2 keeps half
    for step in range(4):
        set_warmup(model, step == 0)  # one dense warmup step, then sparse
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        kl = total_kl(model, reduction="mean")
        print(f"step {step}: loss {loss.item():.4f}  kl {kl.item():.4f}")


if __name__ == "__main__":
    main()
