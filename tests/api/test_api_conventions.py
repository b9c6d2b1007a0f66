"""The public API's conventions: ``causal``, the (B, H, S, D) layout mistake, int64
``cu_seqlens``, the context-parallel arguments kept private, and one autograd path per op
(eager calls run the ``flash_msa::`` custom ops, as compiled ones do). CPU, torch backend."""

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_msa
from flash_msa import api, testing
from flash_msa import distributed as cp

HP, HPK, H, HKV, DP, D = 2, 1, 4, 2, 16, 32
TOP_K, BLOCK = 2, 64


pytestmark = pytest.mark.usefixtures("torch_backend")


def _inputs(lead, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    shapes = ((HP, DP), (HPK, DP), (H, D), (HKV, D), (HKV, D))
    return [torch.randn(*lead, *s, generator=g).requires_grad_(grad) for s in shapes]


def _step(xs, **kw):
    """out, kl and the five gradients (deterministic mode: bitwise comparable run to run)."""
    out, kl = flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, deterministic=True, **kw)
    grads = torch.autograd.grad(out.square().sum() + kl, xs)
    return out.detach(), kl.detach(), grads


# ---------------------------------------------------------------------------------------------
# causal
# ---------------------------------------------------------------------------------------------
def test_causal_true_is_the_default_and_changes_nothing():
    xs = _inputs((1, 150))
    plain, causal = _step(xs), _step(xs, causal=True)
    for a, b in zip((plain[0], plain[1], *plain[2]), (causal[0], causal[1], *causal[2])):
        assert torch.equal(a, b)
    qp, kp, q, k, v = (x.detach() for x in xs)
    idx = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK, causal=True)
    assert torch.equal(idx, flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK))
    out = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK, causal=True)
    assert torch.equal(out, flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK))


def _calls(xs):
    qp, kp, q, k, v = (x.detach() for x in xs)
    idx = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK)
    lay = cp.layout(1, 0, cu_seqlens=testing.cu([150]), block_size=BLOCK)
    return {
        "msa_attention": lambda c: flash_msa.msa_attention(*xs, TOP_K, causal=c),
        "select_blocks": lambda c: flash_msa.select_blocks(qp, kp, TOP_K, causal=c),
        "sparse_attention": lambda c: flash_msa.sparse_attention(q, k, v, idx, causal=c),
        "distributed": lambda c: cp.msa_attention(*xs, TOP_K, layout=lay, causal=c),
    }


@pytest.mark.parametrize(
    "entry", ["msa_attention", "select_blocks", "sparse_attention", "distributed"]
)
def test_causal_false_is_refused_with_the_reason(entry):
    call = _calls(_inputs((1, 150)))[entry]
    with pytest.raises(ValueError, match="causal=False is not supported: MSA is causal"):
        call(False)
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(1)


# ---------------------------------------------------------------------------------------------
# the (B, H, S, D) layout
# ---------------------------------------------------------------------------------------------
def test_heads_first_layout_is_named():
    xs = [x.detach().transpose(1, 2) for x in _inputs((1, 128))]  # SDPA's (B, heads, S, dim)
    with pytest.raises(ValueError, match="scaled_dot_product_attention") as e:
        flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK)
    assert "transpose(1, 2)" in str(e.value) and "seqlen" in str(e.value)
    q, k, v = xs[2:]
    idx = torch.zeros(1, 4, 128, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK)


def test_a_real_sequence_mismatch_is_still_blamed_on_the_sequence():
    xs = [x.detach() for x in _inputs((1, 128))]
    xs[3] = xs[3][:, :100]  # k shorter than q: not a layout mistake
    with pytest.raises(ValueError, match=r"\(batch, seqlen\)") as e:
        flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK)
    assert "scaled_dot_product_attention" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# int64 cu_seqlens
# ---------------------------------------------------------------------------------------------
def test_int64_cu_seqlens_equals_int32():
    xs = _inputs((230,))
    cu = testing.cu([150, 0, 80])
    a = _step(xs, cu_seqlens=cu, max_seqlen=150)
    b = _step(xs, cu_seqlens=cu.long(), max_seqlen=150)
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        assert torch.equal(x, y)
    qp, kp, q, k, v = (x.detach() for x in xs)
    idx = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu)
    idx64 = flash_msa.select_blocks(qp, kp, TOP_K, block_size=BLOCK, cu_seqlens=cu.long())
    assert torch.equal(idx, idx64)
    out = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK, cu_seqlens=cu)
    out64 = flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK, cu_seqlens=cu.long())
    assert torch.equal(out, out64)


def test_int64_cu_seqlens_beyond_int32_is_refused():
    xs = _inputs((230,), grad=False)
    cu = torch.tensor([0, 2**32 + 150, 230], dtype=torch.int64)
    with pytest.raises(ValueError, match="outside int32"):
        flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu)
    with pytest.raises(TypeError, match="int32 or int64"):
        flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu.to(torch.int16))


def test_unchecked_int64_cu_seqlens_does_not_wrap_into_a_good_one(monkeypatch):
    """Where values are not read (GPU, compile), an int64 offset beyond int32 must not wrap
    into a well-formed int32 one (2**32 + 150 would become 150): its rows come out NaN."""
    monkeypatch.setattr(api, "_value_checks", lambda device: False)
    xs = _inputs((230,), grad=False)
    cu = torch.tensor([0, 2**32 + 150, 230], dtype=torch.int64)
    out, kl = flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, cu_seqlens=cu, max_seqlen=230)
    assert out.isnan().all() and kl.isnan()


# ---------------------------------------------------------------------------------------------
# the context-parallel arguments
# ---------------------------------------------------------------------------------------------
def test_context_parallel_arguments_are_not_public():
    public = inspect.signature(flash_msa.msa_attention).parameters
    assert "q_map" not in public and "key_gather" not in public and "causal" in public
    private = inspect.signature(api._msa_attention).parameters
    assert {"q_map", "key_gather"} <= set(private)
    # the private entry takes the public keywords with the public defaults, and no others
    keywords = {n: p.default for n, p in public.items() if p.kind is p.KEYWORD_ONLY}
    assert api._KEYWORDS == keywords
    with pytest.raises(TypeError, match="q_map"):
        flash_msa.msa_attention(*_inputs((150,)), TOP_K, q_map=torch.zeros(150))
    with pytest.raises(TypeError, match="blocksize"):
        api._msa_attention(*_inputs((150,)), TOP_K, blocksize=64)


# ---------------------------------------------------------------------------------------------
# one autograd path
# ---------------------------------------------------------------------------------------------
class _Ops(TorchDispatchMode):
    """The names of the ops dispatched (the custom ops appear as ``flash_msa::...``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("warmup", [False, True])
def test_eager_calls_run_the_custom_ops(warmup):
    xs = _inputs((1, 150))
    with _Ops() as mode:
        out, kl = flash_msa.msa_attention(*xs, TOP_K, block_size=BLOCK, warmup=warmup)
        (out.sum() + kl).backward()
    ours = [n for n in mode.names if n.startswith("flash_msa::")]
    want = ["flash_msa::fwd", "flash_msa::bwd"]
    assert ours == (want if warmup else ["flash_msa::select", *want]), ours
    with _Ops() as mode:
        q, k, v = xs[2:]
        idx = flash_msa.select_blocks(*xs[:2], TOP_K, block_size=BLOCK)
        flash_msa.sparse_attention(q, k, v, idx, block_size=BLOCK).sum().backward()
    ours = [n for n in mode.names if n.startswith("flash_msa::")]
    assert ours == ["flash_msa::select", "flash_msa::fwd", "flash_msa::bwd"], ours
