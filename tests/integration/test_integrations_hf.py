"""flash_msa.integrations.hf on tiny random models of each supported family (CPU, torch
backend): in dense warmup the converted model's logits equal the original's (the harness rule:
the fp32 error against the fp64 original within twice the fp32 original's own error), and the
conversion carries every part of the attention over (Qwen3's q/k norms: dropping them moves
the logits by 3e-1). Unknown architectures and unsupported settings are refused, naming the
class or the setting, before any layer is replaced."""

import copy
import importlib.util
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flash_msa.integrations import hf, msa_layers, set_warmup, total_kl  # noqa: E402
from flash_msa.testing import assert_close, cu  # noqa: E402


def _example():
    path = pathlib.Path(__file__).parents[2] / "examples" / "hf_llama_msa.py"
    spec = importlib.util.spec_from_file_location("hf_llama_msa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _example().TINY  # the example's 2-layer GQA config arguments, for every family
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    # head_dim apart from hidden_size / heads, and the q/k norms
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


pytestmark = pytest.mark.usefixtures("torch_backend")


def _model(family, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    if family == "qwen2":  # biases start at zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    p.bias.normal_()
    if family == "qwen3":  # the norms start at one: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    model.set_attn_implementation("eager")
    return model.eval()


def _tokens(*shape, seed=7):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_warmup_logits_equal_the_original(family):
    dense = _model(family)
    tokens = _tokens(2, 150)
    same = dense(input_ids=tokens).logits
    exact = copy.deepcopy(dense).double()(input_ids=tokens).logits
    msa = hf.convert_to_msa(copy.deepcopy(dense), top_k=1, block_size=64)
    assert len(msa_layers(msa)) == TINY["num_hidden_layers"]
    assert all(isinstance(layer.self_attn, hf.HFMSAttention) for layer in msa.model.layers)
    set_warmup(msa, True)
    assert_close(f"{family} warmup logits", msa(input_ids=tokens).logits, exact, same)
    # all blocks kept (top_k = every block of the sequence): the sparse path is dense too
    set_warmup(msa, False)
    for m in msa_layers(msa):
        m.top_k = 3
    assert_close(f"{family} all-blocks logits", msa(input_ids=tokens).logits, exact, same)
    for m in msa_layers(msa):
        m.top_k = 1
    assert (msa(input_ids=tokens).logits - exact).abs().max() > 1e-3  # top_k=1 is sparse
    assert total_kl(msa) > 0


@torch.no_grad()
def test_qwen3_norms_are_carried_over():
    """The converted layers hold the model's own q_norm/k_norm (same parameters, same
    state-dict keys); without them the logits move far beyond the tolerance."""
    dense = _model("qwen3")
    msa = hf.convert_to_msa(copy.deepcopy(dense), top_k=1, block_size=64)
    for a, b in zip(dense.model.layers, msa.model.layers):
        assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight)
    keys = set(msa.state_dict())
    assert set(dense.state_dict()) <= keys
    assert any(k.endswith("self_attn.indexer.q_proj.weight") for k in keys)
    tokens = _tokens(1, 130)
    set_warmup(msa, True)
    with_norms = msa(input_ids=tokens).logits
    for layer in msa.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert (msa(input_ids=tokens).logits - with_norms).abs().max() > 1e-2


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_padding_and_packing(family):
    """Padded and packed batches give each document the logits it gets alone."""
    msa = hf.convert_to_msa(_model(family), top_k=1, block_size=64)
    msa64 = copy.deepcopy(msa).double()
    docs = [_tokens(1, n, seed=6 + n) for n in (130, 70)]
    same = [msa(input_ids=d).logits[0] for d in docs]
    exact = [msa64(input_ids=d).logits[0] for d in docs]
    padded = torch.zeros(2, 130, dtype=torch.long)
    padded[0], padded[1, 60:] = docs[0][0], docs[1][0]
    mask = torch.ones(2, 130, dtype=torch.long)
    mask[1, :60] = 0
    out = msa(input_ids=padded, attention_mask=mask).logits
    assert_close("padded doc 0", out[0], exact[0], same[0])
    assert_close("padded doc 1", out[1, 60:], exact[1], same[1])
    positions = torch.cat([torch.arange(130), torch.arange(70)])[None]
    out = msa(input_ids=torch.cat(docs, dim=1), position_ids=positions).logits[0]
    assert_close("packed doc 1", out[130:], exact[1], same[1])
    out = msa(input_ids=torch.cat(docs, 1), cu_seq_lens_q=cu([130, 70]), max_length_q=130)
    assert_close("cu_seq_lens doc 1", out.logits[0, 130:], exact[1], same[1])


def test_training_step_reaches_the_indexer():
    msa = hf.convert_to_msa(_model("qwen2").train(), top_k=1, block_size=64)
    tokens = _tokens(1, 200)
    msa(input_ids=tokens, labels=tokens).loss.backward()
    for m in msa_layers(msa):
        assert m.indexer.q_proj.weight.grad.abs().sum() > 0  # the KL trains the proxy
        assert m.q_proj.weight.grad.abs().sum() > 0  # the LM loss trains the model


def test_unknown_architecture_is_refused_unchanged():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(TypeError, match="decoder layers of GPT2LMHeadModel"):
        hf.convert_to_msa(model, top_k=1, block_size=64)
    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**{**TINY, "head_dim": 16, "num_hidden_layers": 1})
    )
    with pytest.raises(TypeError, match="cannot convert Gemma2Attention"):
        hf.convert_to_msa(gemma, top_k=1, block_size=64)
    assert type(gemma.model.layers[0].self_attn).__name__ == "Gemma2Attention"


def test_unsupported_settings_are_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        hf.convert_to_msa(_model("mistral", sliding_window=128), top_k=1, block_size=64)
    with pytest.raises(ValueError, match="attention dropout"):
        hf.convert_to_msa(_model("llama", attention_dropout=0.1), top_k=1, block_size=64)
    model = _model("llama")
    model.model.layers[1].self_attn.extra_norm = torch.nn.LayerNorm(16)
    with pytest.raises(ValueError, match="extra_norm"):
        hf.convert_to_msa(model, top_k=1, block_size=64)
    assert not any(isinstance(layer.self_attn, hf.HFMSAttention) for layer in model.model.layers)
    with pytest.raises(ValueError, match="no MSAttention layer"):
        set_warmup(model, True)
