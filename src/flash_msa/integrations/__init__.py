"""Model conversions and the helpers every trainer needs.

- :mod:`flash_msa.integrations.hf`: Hugging Face transformers (Llama, Mistral, Qwen2, Qwen3):
  ``convert_to_msa(model, top_k=..., block_size=...)``. Needs ``transformers``.
- :mod:`flash_msa.integrations.torchtitan`: torchtitan's decoders (``GQAttention`` layers).
  Needs ``torchtitan``.
- helpers (here, no extra dependency), for any model holding :class:`flash_msa.nn.MSAttention`
  layers: :func:`msa_layers`, :func:`set_warmup`, :func:`total_kl`, :func:`measure_recall`.

The framework modules are imported by name (``from flash_msa.integrations import hf``), so
importing this package needs neither framework.
"""

from .training import measure_recall, msa_layers, set_warmup, total_kl

__all__ = ["msa_layers", "set_warmup", "total_kl", "measure_recall"]
