"""flash_msa.nn layers on CPU: numbers against a hand-written composition, packing, warmup,
gradient routing of the KL, training, argument errors, and the Hugging Face example.

The layers are backend-neutral (they call ``flash_msa.msa_attention``); the kernels are tested
elsewhere. The torch backend is forced because ``conftest.py`` sets ``TRITON_INTERPRET=1``, under
which fp32 CPU calls would go to the (slow) Triton interpreter. Numeric checks are the harness's
rule: the fp32 layer against an fp64 copy (exact), with the same-dtype (fp32) reference setting
the tolerance.
"""

import copy
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import flash_msa
from flash_msa.nn import (
    MSAIndexer,
    MSAttention,
    RotaryEmbedding,
    attach_kl,
    position_ids_from_cu_seqlens,
)
from flash_msa.testing import assert_close, cu, training_loss

ROOT = pathlib.Path(__file__).resolve().parents[2]
F64 = torch.float64
HIDDEN = 32


pytestmark = pytest.mark.usefixtures("torch_backend")


def make_layer(seed=0, dtype=torch.float32, **kw):
    """H=4, Hkv=2, D=8; default indexer Hp=2, Hpk=1, Dp=8; 64-token blocks."""
    torch.manual_seed(seed)
    args = dict(num_key_value_heads=2, top_k=2, block_size=64, kl_coeff=None, dtype=dtype)
    return MSAttention(HIDDEN, 4, **{**args, **kw})


def f64(module):
    """An fp64 copy of ``module`` (the same weights): the exact side of the rule."""
    return copy.deepcopy(module).double()


def hidden(*shape, seed=1, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, HIDDEN, generator=g, dtype=dtype).requires_grad_(requires_grad)


def grads(loss, module, retain_graph=False):
    """``{name: grad or None}`` of ``module``'s parameters (``None``: no path from ``loss``)."""
    names, params = zip(*module.named_parameters())
    g = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain_graph)
    return dict(zip(names, g))


def assert_grads_close(mine, exact, same):
    for name, g in exact.items():
        assert mine[name] is not None, name
        assert_close(name, mine[name], g, same[name])


# ---------------------------------------------------------------------------------------------
# shapes and the hand-written composition
# ---------------------------------------------------------------------------------------------
def test_shapes_batch_and_varlen():
    layer = make_layer()
    out, kl = layer(hidden(2, 150))
    assert out.shape == (2, 150, HIDDEN) and kl.shape == () and kl.dtype == torch.float32
    for x in (hidden(150), hidden(1, 150)):
        out, kl = layer(x, cu_seqlens=cu([90, 60]))
        assert out.shape == x.shape and kl.shape == ()
    q_proxy, k_proxy = layer.indexer(hidden(2, 150))
    assert q_proxy.shape == (2, 150, 2, 8) and k_proxy.shape == (2, 150, 1, 8)
    indexer = MSAIndexer(HIDDEN, 4, 16, 2, qk_norm=False, rope_theta=None)
    q_proxy, k_proxy = indexer(hidden(150))
    assert q_proxy.shape == (150, 4, 16) and k_proxy.shape == (150, 2, 16)


def _rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _rope(x, theta, positions):
    """Rotate-half RoPE written out: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    d = x.shape[-1]
    # Llama's default frequencies as transformers computes them (an fp32 buffer)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = positions[..., None, None].to(x.dtype) * inv_freq.to(x.dtype)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def by_hand(layer, x, theta=10000.0):
    """The layer's forward as projections + RMSNorm + RoPE + flash_msa.msa_attention."""
    B, S, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    ix, pos = layer.indexer, torch.arange(S)
    q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).view(B, S, H, D)
    k = F.linear(x, layer.k_proj.weight, layer.k_proj.bias).view(B, S, Hkv, D)
    v = F.linear(x, layer.v_proj.weight, layer.v_proj.bias).view(B, S, Hkv, D)
    if layer.q_norm is not None:
        q, k = _rms(q, layer.q_norm), _rms(k, layer.k_norm)
    q, k = _rope(q, theta, pos), _rope(k, theta, pos)
    xd = x.detach()
    qp = F.linear(xd, ix.q_proj.weight).view(B, S, ix.num_proxy_heads, ix.proxy_head_dim)
    kp = F.linear(xd, ix.k_proj.weight).view(B, S, ix.num_proxy_kv_heads, ix.proxy_head_dim)
    qp, kp = _rope(_rms(qp, ix.q_norm), theta, pos), _rope(_rms(kp, ix.k_norm), theta, pos)
    out, kl = flash_msa.msa_attention(
        qp, kp, q, k, v, layer.top_k, block_size=layer.block_size, warmup=layer.warmup
    )
    return F.linear(out.reshape(B, S, H * D), layer.o_proj.weight), kl


@pytest.mark.parametrize("warmup", [False, True])
def test_layer_equals_hand_written_composition(warmup):
    layer = make_layer(qkv_bias=True, qk_norm=True, warmup=warmup)
    for norm in (layer.q_norm, layer.k_norm, layer.indexer.q_norm, layer.indexer.k_norm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # not the identity
    layer64, x = f64(layer), hidden(2, 200)
    rows = 2 * 2 * 200  # Hp * tokens

    def run(module, fn, x):
        out, kl = fn(x)
        return {"out": out, "kl": kl, **grads(training_loss(out, kl, rows), module)}

    mine = run(layer, layer, x)
    same = run(layer, lambda x: by_hand(layer, x), x)
    exact = run(layer64, lambda x: by_hand(layer64, x), x.double())
    assert all(g is not None for g in mine.values())
    assert_grads_close(mine, exact, same)


def test_position_embeddings_replace_the_builtin_rotary():
    """(cos, sin) as Hugging Face models pass them, shape (1, S, D), give the same layer."""
    layer = make_layer()
    layer64, x = f64(layer), hidden(2, 100)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    out, kl = layer(x, position_embeddings=(emb.cos(), emb.sin()))
    (same_out, same_kl), (exact_out, exact_kl) = layer(x), layer64(x.double())
    assert_close("out", out, exact_out, same_out)
    assert_close("kl", kl, exact_kl, same_kl)


def test_partial_rotary():
    rotary = RotaryEmbedding(8, 500.0, rotary_dim=4)
    q, k = torch.randn(10, 2, 8), torch.randn(10, 1, 8)
    pos = torch.arange(10)
    qr, kr = rotary(q, k, pos)
    assert torch.equal(qr[..., 4:], q[..., 4:]) and torch.equal(kr[..., 4:], k[..., 4:])
    exact = _rope(q[..., :4].double(), 500.0, pos)
    assert_close("q", qr[..., :4], exact, _rope(q[..., :4], 500.0, pos))


# ---------------------------------------------------------------------------------------------
# packing, warmup
# ---------------------------------------------------------------------------------------------
def test_position_ids_from_cu_seqlens():
    got = position_ids_from_cu_seqlens(cu([3, 0, 2, 1]), 6)
    assert got.tolist() == [0, 1, 2, 0, 1, 0]


def test_packed_equals_separate():
    """Two packed documents equal two separate calls: outputs, the KL and every gradient.

    The KL is a mean over ``Hp * tokens`` rows, so ``rows * kl`` is what adds up over documents.
    RoPE positions restart per document by default."""
    layer = make_layer()
    layer64 = f64(layer)
    lengths = (150, 70)
    rows = [2 * n for n in lengths]  # Hp = 2
    docs = [hidden(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(1, n, HIDDEN, generator=g) for n in lengths]

    def separate(module, dtype):
        outs, kls = zip(*(module(x.to(dtype)) for x in docs))
        loss = sum((o * wi).sum() + r * kl for o, wi, r, kl in zip(outs, w, rows, kls))
        rkl = sum(r * kl for r, kl in zip(rows, kls))
        return {"out": torch.cat(outs, dim=1), "R*kl": rkl, **grads(loss, module)}

    out, kl = layer(torch.cat(docs, dim=1), cu_seqlens=cu(lengths), max_seqlen=max(lengths))
    loss = (out * torch.cat(w, dim=1)).sum() + sum(rows) * kl
    mine = {"out": out, "R*kl": sum(rows) * kl, **grads(loss, layer)}
    assert_grads_close(mine, separate(layer64, F64), separate(layer, torch.float32))


def test_default_positions_restart_per_document():
    """RoPE is relative, so the packing test cannot see absolute positions: record them through
    the rotary hook (both the layer's and the indexer's)."""
    seen = {}

    def recorder(name):
        def rotary(q, k, position_ids):
            seen[name] = position_ids.tolist()
            return q, k

        return rotary

    layer = make_layer()
    layer.rotary, layer.indexer.rotary = recorder("main"), recorder("proxy")
    layer(hidden(5), cu_seqlens=cu([3, 2]))
    assert seen == {"main": [0, 1, 2, 0, 1], "proxy": [0, 1, 2, 0, 1]}
    layer(hidden(2, 3))
    assert seen["main"] == seen["proxy"] == [[0, 1, 2]] * 2


def _dense_causal_gqa(layer, x):
    B, S, _ = x.shape
    H, Hkv, D = layer.num_heads, layer.num_key_value_heads, layer.head_dim
    pos = torch.arange(S)
    q = _rope(layer.q_proj(x).view(B, S, H, D), 10000.0, pos).transpose(1, 2)
    k = _rope(layer.k_proj(x).view(B, S, Hkv, D), 10000.0, pos).transpose(1, 2)
    v = layer.v_proj(x).view(B, S, Hkv, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return layer.o_proj(out.transpose(1, 2).reshape(B, S, H * D))


@torch.no_grad()
def test_warmup_switch():
    """warmup=True is dense causal attention; flipping the attribute makes the layer sparse."""
    layer = make_layer(top_k=1)
    x = hidden(2, 200)
    same, exact = _dense_causal_gqa(layer, x), _dense_causal_gqa(f64(layer), x.double())
    layer.warmup = True
    warm, warm_kl = layer(x)
    layer.warmup = False
    sparse, sparse_kl = layer(x)
    assert_close("warmup out", warm, exact, same)
    # top_k=1 keeps only the own block: queries past the first block lose keys
    assert (sparse - exact).abs().max() > 1e-2
    assert_close("first block", sparse[:, :64], exact[:, :64], same[:, :64])
    assert warm_kl > 0 and sparse_kl > 0 and warm_kl != sparse_kl


# ---------------------------------------------------------------------------------------------
# where the gradients go
# ---------------------------------------------------------------------------------------------
def _split(g):
    proxy = {n: v for n, v in g.items() if n.startswith("indexer.")}
    main = {n: v for n, v in g.items() if not n.startswith("indexer.")}
    return proxy, main


def test_kl_gradient_reaches_only_the_indexer():
    layer = make_layer()
    x = hidden(2, 200, requires_grad=True)
    out, kl = layer(x)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))

    proxy, main = _split(grads((out * dout).sum(), layer, retain_graph=True))
    assert all(v is None for v in proxy.values())  # the main loss never reaches the proxy
    assert all(v is not None and v.abs().max() > 0 for v in main.values())

    # detach_input: not even the layer's input sees the KL
    assert torch.autograd.grad(kl, x, allow_unused=True, retain_graph=True)[0] is None
    proxy, main = _split(grads(kl, layer))
    assert all(v is None for v in main.values())  # the KL never reaches q, k, v, o
    assert all(v is not None and v.abs().max() > 0 for v in proxy.values())


def test_kl_coeff_attaches_the_kl_to_the_output_backward():
    """With kl_coeff=c, d(loss(out)) equals d(loss(out) + c * kl) of the kl_coeff=None layer."""
    rows = 2 * 2 * 200
    c = 0.7 * rows
    plain, attached = make_layer(), make_layer(kl_coeff=1.0)
    attached.kl_coeff = c  # an attribute: a trainer may change it between steps
    x = hidden(2, 200)
    dout = torch.randn(2, 200, HIDDEN, generator=torch.Generator().manual_seed(5))

    def reference(module, dtype):
        out, kl = module(x.to(dtype))
        return {"kl": kl, **grads((out * dout).sum() + c * kl, module)}

    out, kl = attached(x)
    assert not kl.requires_grad  # detached: adding it to the loss cannot count it twice
    assert torch.equal(attached.last_kl, kl)
    mine = {"kl": kl, **grads((out * dout).sum(), attached)}
    assert_grads_close(mine, reference(f64(plain), F64), reference(plain, torch.float32))


def test_kl_coeff_zero_trains_no_proxy():
    layer = make_layer(kl_coeff=0.0)
    out, kl = layer(hidden(2, 100))
    assert not kl.requires_grad and kl > 0
    proxy, main = _split(grads(out.sum(), layer))
    assert all(v is None for v in proxy.values()) and all(v is not None for v in main.values())


def test_attach_kl_is_the_identity_forward():
    out = torch.randn(3, 4, requires_grad=True)
    kl = torch.tensor(0.5, requires_grad=True)
    y = attach_kl(out, kl, 2.5)
    assert torch.equal(y, out)
    y.sum().backward()
    assert torch.equal(out.grad, torch.ones_like(out)) and kl.grad.item() == 2.5
    with pytest.raises(ValueError, match="kl_coeff"):
        attach_kl(out, kl, -1.0)


def test_training_reduces_the_kl():
    layer = make_layer(kl_coeff=1.0)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = hidden(2, 192)
    kls = []
    for _ in range(6):
        out, kl = layer(x)
        loss = out.pow(2).mean()  # no KL term: kl_coeff attaches it
        opt.zero_grad()
        loss.backward()
        opt.step()
        kls.append(kl.item())
    assert kls[-1] < 0.8 * kls[0], kls


# ---------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=4, num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_heads=5), "head_dim is not given"),
        (dict(num_heads=4, block_size=96), "block_size"),
        (dict(num_heads=4, top_k=0), "top_k"),
        (dict(num_heads=4, kl_coeff=-1.0), "kl_coeff"),
        (dict(num_heads=4, kl_coeff=float("nan")), "kl_coeff"),
        (dict(num_heads=4, rope_theta=0.0), "rope_theta"),
        (dict(num_heads=4, norm_eps=0.0), "norm_eps"),
        (dict(num_heads=4, indexer=MSAIndexer(HIDDEN, 3, 8)), "num_proxy_heads"),
        (
            dict(num_heads=12, num_key_value_heads=4, head_dim=8, indexer=MSAIndexer(HIDDEN, 6, 8)),
            "divide one another",
        ),
        (dict(num_heads=4, indexer=MSAIndexer(2 * HIDDEN, 2, 8)), "hidden_size"),
    ],
)
def test_constructor_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSAttention(HIDDEN, **kwargs)


def test_constructor_type_errors():
    with pytest.raises(TypeError, match="num_heads"):
        MSAttention(HIDDEN, 4.0)
    with pytest.raises(TypeError, match="top_k"):
        MSAttention(HIDDEN, 4, top_k=True)
    with pytest.raises(TypeError, match="warmup"):
        MSAttention(HIDDEN, 4, warmup=1)
    with pytest.raises(TypeError, match="indexer"):
        MSAttention(HIDDEN, 4, indexer=lambda x: x)
    with pytest.raises(TypeError, match="rotary"):
        MSAIndexer(HIDDEN, 2, 8, rotary=3)


def test_indexer_and_rotary_value_errors():
    with pytest.raises(ValueError, match="num_proxy_heads"):
        MSAIndexer(HIDDEN, 3, 8, num_proxy_kv_heads=2)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=10)
    with pytest.raises(ValueError, match="head_dim must be even"):
        MSAttention(HIDDEN, 4, head_dim=7)


def test_forward_value_errors():
    layer = make_layer()
    with pytest.raises(ValueError, match="hidden_states"):
        layer(hidden(2, 10)[..., :16])
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        layer(hidden(10))
    with pytest.raises(ValueError, match="packed"):
        layer(hidden(2, 10), cu_seqlens=cu([10, 10]))
    with pytest.raises(ValueError, match="cu_seqlens"):  # the op's own check
        layer(hidden(20), cu_seqlens=cu([10, 9]))


# ---------------------------------------------------------------------------------------------
# examples
# ---------------------------------------------------------------------------------------------
def _run_example(name):
    env = {**os.environ, "FLASH_MSA_BACKEND": "torch"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    return [
        (int(m[1]), float(m[2]), float(m[3]))
        for m in re.finditer(r"step (\d+): loss (\S+)  kl (\S+)", res.stdout)
    ]


def _import_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_example_trains():
    pytest.importorskip("transformers")
    steps = _run_example("hf_llama_msa.py")
    assert [s for s, _, _ in steps] == [0, 1, 2, 3]
    losses, kls = [x[1] for x in steps], [x[2] for x in steps]
    assert losses[-1] < losses[0]
    assert kls[-1] < kls[1]  # step 0 is dense warmup (a KL over other keys); then sparse


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return _import_example("hf_llama_msa")


def _llama_pair(hf):
    """A dense Llama (eager attention) and its MSA conversion with the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(hf.tiny_config())
    dense.set_attn_implementation("eager")
    msa = LlamaForCausalLM(hf.tiny_config())
    msa.load_state_dict(dense.state_dict())
    hf.convert_to_msa(msa, top_k=1, block_size=64)
    return dense.eval(), msa.eval()


@torch.no_grad()
def test_hf_conversion_in_warmup_equals_the_dense_model(hf):
    """Dense warmup is ordinary causal attention: the converted model's logits equal the
    original Llama's (same projections, the model's own RoPE)."""
    dense, msa = _llama_pair(hf)
    tokens = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(7))
    same, exact = dense(input_ids=tokens).logits, f64(dense)(input_ids=tokens).logits
    for m in hf.msa_layers(msa):
        m.warmup = True
    assert_close("logits", msa(input_ids=tokens).logits, exact, same)
    for m in hf.msa_layers(msa):
        m.warmup = False
    assert (msa(input_ids=tokens).logits - exact).abs().max() > 1e-3  # top_k=1 is sparse


@torch.no_grad()
def test_hf_padding_and_packing(hf):
    """A padded batch (the second row left-padded: positions 60.. are the document's, only
    relative positions matter to RoPE) and a packed row (positions restarting at 0, or
    ``cu_seq_lens_q``) give each document the logits it gets alone."""
    _, msa = _llama_pair(hf)
    msa64 = f64(msa)
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, 256, (1, n), generator=g) for n in (130, 70)]
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
    assert_close("packed doc 0", out[:130], exact[0], same[0])
    assert_close("packed doc 1", out[130:], exact[1], same[1])

    # the flattening collator's keyword arguments (positions left 0..199: RoPE is relative)
    kwargs = dict(cu_seq_lens_q=cu([130, 70]), max_length_q=130)
    out = msa(input_ids=torch.cat(docs, dim=1), **kwargs).logits[0]
    assert_close("cu_seq_lens doc 0", out[:130], exact[0], same[0])
    assert_close("cu_seq_lens doc 1", out[130:], exact[1], same[1])
