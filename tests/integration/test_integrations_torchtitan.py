"""flash_msa.integrations.torchtitan on a tiny torchtitan Llama 3 decoder (CPU, torch backend):
in dense warmup the converted model's logits equal the original's (torchtitan's FlexAttention
with its causal document mask, forward only: FlexAttention has no CPU backward), for causal
rows, packed documents (positions restarting at 0) and varlen metadata; a training step trains
model and indexer; the block's modules and state-dict keys are kept; other modules are refused."""

import copy

import pytest
import torch

pytest.importorskip("torchtitan")
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import create_varlen_metadata_for_document  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers  # noqa: E402

from flash_msa.integrations import msa_layers, set_warmup, total_kl  # noqa: E402
from flash_msa.integrations import torchtitan as tt  # noqa: E402
from flash_msa.testing import assert_close  # noqa: E402

DIM, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 256


pytestmark = pytest.mark.usefixtures("torch_backend")


def _model(fuse_qkv=True):
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=2,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=128,
            fuse_qkv=fuse_qkv,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=1024, theta=10000.0),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():  # the default init leaves some weights at zero: all random
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    return model.eval()


class _MaskedSDPA(torch.nn.Module):
    """The fp64 side's dense attention (FlexAttention on CPU takes no fp64): SDPA under the
    causal document mask of ``positions``, the mask torchtitan's flex model builds."""

    def __init__(self, positions):
        super().__init__()
        doc = (positions == 0).cumsum(-1)  # (B, L): document number of each token
        L = positions.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        self.mask = (doc[:, :, None] == doc[:, None, :]) & causal  # (B, L, L)

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask[:, None], scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def _exact(dense, tokens, positions):
    """The fp64 logits of ``dense`` (its weights, dense attention under the same mask)."""
    model = copy.deepcopy(dense).double()
    for block in model.layers.values():
        block.attention.inner_attention = _MaskedSDPA(positions)
    return model(tokens, positions=positions)


def _run(model, tokens, positions):
    masks = model.get_attention_masks(positions)
    return model(tokens, positions=positions, attention_masks=masks)


@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["fused", "separate"])
@torch.no_grad()
def test_warmup_logits_equal_the_original(fuse_qkv):
    dense = _model(fuse_qkv)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 200), generator=g)
    causal = torch.arange(200).expand(2, 200)
    packed = torch.cat([torch.arange(130), torch.arange(70)]).expand(2, 200)
    msa = tt.convert_to_msa(copy.deepcopy(dense), top_k=1, block_size=64)
    assert all(isinstance(b.attention, tt.TorchtitanMSAttention) for b in msa.layers.values())
    assert set(dense.state_dict()) <= set(msa.state_dict())  # a checkpoint loads unchanged
    set_warmup(msa, True)
    for name, positions in (("causal", causal), ("packed", packed)):
        same = _run(dense, tokens, positions)
        exact = _exact(dense, tokens, positions)
        assert_close(f"{name} logits (flex mask)", _run(msa, tokens, positions), exact, same)
        varlen = create_varlen_metadata_for_document(positions)
        out = msa(tokens, positions=positions, attention_masks=varlen)
        assert_close(f"{name} logits (varlen)", out, exact, same)
        if name == "causal":
            assert_close("causal logits (no mask)", msa(tokens, positions=None), exact, same)
    set_warmup(msa, False)
    assert (_run(msa, tokens, causal) - exact).abs().max() > 1e-3  # top_k=1 is sparse
    assert total_kl(msa) > 0


def test_training_step_reaches_model_and_indexer():
    msa = tt.convert_to_msa(_model().train(), top_k=1, block_size=64)
    tokens = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(200)[None]
    logits = msa(tokens, positions=positions, attention_masks=msa.get_attention_masks(positions))
    torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
    for m in msa_layers(msa):
        assert m.indexer.q_proj.weight.grad.abs().sum() > 0  # the KL trains the proxy
        assert m.qkv_linear.wqkv.weight.grad.abs().sum() > 0  # the LM loss trains the model


def test_refusals():
    model = _model()
    model.layers["1"].attention = torch.nn.Linear(DIM, DIM)
    with pytest.raises(TypeError, match="cannot convert Linear"):
        tt.convert_to_msa(model, top_k=1, block_size=64)
    assert not isinstance(model.layers["0"].attention, tt.TorchtitanMSAttention)  # unchanged
    with pytest.raises(TypeError, match="transformer blocks of Linear"):
        tt.convert_to_msa(torch.nn.Linear(2, 2), top_k=1, block_size=64)
    msa = tt.convert_to_msa(_model(), top_k=1, block_size=64)
    positions = torch.arange(64)[None]
    with pytest.raises(ValueError, match="pass positions"):
        msa(
            torch.zeros(1, 64, dtype=torch.long),
            attention_masks=msa.get_attention_masks(positions),
        )
