"""``top_k`` beyond the number of blocks: clamped to ``max(ceil(max_seqlen / block_size),
api.UNCLAMPED_TOP_K)`` for the backends (nothing is allocated per requested slot; up to 64 it is
kept, so the compiled kernels do not depend on the lengths), refused above ``api.MAX_TOP_K``.

``select_blocks`` keeps its documented width ``top_k`` (the clamped slots are ``-1``), so a
sequence's indices do not depend on what it is packed with.
"""

import pytest
import torch

import flash_msa
from flash_msa import api, backends, reference, testing

B64 = 64


def _inputs(S=150, seed=0):
    # H=4, Hkv=2, Hp=2, Hpk=1, D=Dp=16; S=150 at block 64: 3 blocks
    return testing.make_inputs(1, S, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=seed)


@pytest.fixture
def seen_top_k(monkeypatch):
    """The ``cfg.top_k`` and index widths the torch backend is called with."""
    seen = []
    real_select, real_fwd = reference.select, reference.fwd

    def select(q_proxy, k_proxy, cu_seqlens, cfg):
        seen.append(("select", cfg.top_k))
        return real_select(q_proxy, k_proxy, cu_seqlens, cfg)

    def fwd(q, k, v, indices, *args, **kw):
        seen.append(("fwd", None if indices is None else indices.shape[-1]))
        return real_fwd(q, k, v, indices, *args, **kw)

    monkeypatch.setattr(reference, "select", select)
    monkeypatch.setattr(reference, "fwd", fwd)
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    return seen


@pytest.mark.parametrize("top_k, K", [(4, 4), (64, 64), (100, 64), (api.MAX_TOP_K, 64)])
def test_msa_attention_clamps_top_k(top_k, K, seen_top_k):
    xs = _inputs()  # ceil(150 / 64) = 3 blocks: kept up to 64, clamped to 64 above
    out, kl = flash_msa.msa_attention(*xs, top_k, block_size=B64)
    assert seen_top_k == [("select", K), ("fwd", K)]
    seen_top_k.clear()
    out3, kl3 = flash_msa.msa_attention(*xs, 3, block_size=B64)
    assert torch.equal(out, out3) and torch.equal(kl, kl3)


def test_msa_attention_clamps_to_max_seqlen_in_varlen(seen_top_k):
    xs = [x[0] for x in _inputs(S=4300)]
    cu = testing.cu([70, 4230])  # the longest has 67 blocks of 64 (more than 64)
    with torch.no_grad():
        flash_msa.msa_attention(*xs, 500, block_size=B64, cu_seqlens=cu, compute_kl=False)
    assert seen_top_k == [("select", 67), ("fwd", 67)]


def test_select_blocks_keeps_the_documented_width(seen_top_k):
    qp, kp = _inputs()[:2]
    idx = flash_msa.select_blocks(qp, kp, 200, block_size=B64)
    assert seen_top_k == [("select", 64)]  # the backend ran with the clamped K
    assert idx.shape == (1, 150, 2, 200) and idx.dtype == torch.int32
    assert torch.equal(idx[..., :3], flash_msa.select_blocks(qp, kp, 3, block_size=B64))
    assert (idx[..., 3:] == -1).all()


def test_select_blocks_width_does_not_depend_on_packing():
    xs = [x[0] for x in _inputs(S=270)]
    cu = testing.cu([70, 200])
    packed = flash_msa.select_blocks(*xs[:2], 6, block_size=B64, cu_seqlens=cu)
    alone = flash_msa.select_blocks(xs[0][:70][None], xs[1][:70][None], 6, block_size=B64)[0]
    assert packed.shape == (270, 2, 6) and torch.equal(packed[:70], alone)


def test_clamped_top_k_runs_on_a_backend_with_a_top_k_limit():
    """Triton keeps at most 64 blocks; a 3-block sequence asked for 1000 runs there, and gives
    the top_k=3 result (by the tolerance rule against the fp64 torch backend)."""
    xs = _inputs()
    with backends.forced("triton"):
        out, kl = flash_msa.msa_attention(*xs, 1000, block_size=B64)
        idx = flash_msa.select_blocks(*xs[:2], 1000, block_size=B64)
    with backends.forced("torch"):
        same_out, same_kl = flash_msa.msa_attention(*xs, 3, block_size=B64)
        exact_out, exact_kl = flash_msa.msa_attention(*(x.double() for x in xs), 3, block_size=B64)
        ref_idx = flash_msa.select_blocks(*xs[:2], 3, block_size=B64)
    assert idx.shape[-1] == 1000
    assert torch.equal(idx[..., :3], ref_idx) and (idx[..., 3:] == -1).all()
    testing.assert_close("out", out, exact_out, same_out)
    testing.assert_close("kl", kl, exact_kl, same_kl, can_fail=False)


@pytest.mark.parametrize("op", ["msa", "select"])
@pytest.mark.parametrize("top_k", [api.MAX_TOP_K + 1, 10**6, 10**30])
def test_top_k_above_the_bound_is_refused_before_allocating(op, top_k, monkeypatch):
    def boom(*a, **kw):  # nothing may run (or allocate) before validation
        raise AssertionError("a backend ran")

    monkeypatch.setattr(reference, "select", boom)
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    xs = _inputs()
    match = rf"top_k must be <= {api.MAX_TOP_K} \(it counts key blocks.*got {top_k}"
    with pytest.raises(ValueError, match=match):
        if op == "msa":
            flash_msa.msa_attention(*xs, top_k, block_size=B64)
        else:
            flash_msa.select_blocks(*xs[:2], top_k, block_size=B64)


def test_warmup_validates_top_k_too():
    with pytest.raises(ValueError, match="top_k must be <="):
        flash_msa.msa_attention(*_inputs(), 10**6, block_size=B64, warmup=True)
