"""One NaN rule on every backend (docs/design.md, "Bad input"), the torch reference against the
Triton interpreter; tests/test_gpu_bad_metadata.py compares the GPU kernels, CuTe included.

A NaN in q, k or v makes NaN the rows that attend it (the Triton kernels' P V tile also the
earlier rows of a NaN value's block); a NaN proxy score counts as -inf in its block's maximum,
so the selections agree; a NaN in a proxy input makes the KL NaN. The value checks (which
refuse non-finite inputs on CPU) are off, as on a GPU.
"""

import pytest
import torch

import flash_msa
from flash_msa import api

T, H, HKV, HP, HPK, D, DP, BLOCK = 256, 4, 2, 2, 1, 16, 16, 64
NAN_AT = {  # input, token, head
    "q": ("q", 100, 1),
    "k": ("k", 70, 1),
    "v": ("v", 70, 1),
    "k_proxy": ("kp", 70, 0),
    "q_proxy": ("qp", 200, 1),
}


def _inputs(where):
    g = torch.Generator().manual_seed(0)
    shapes = dict(qp=(T, HP, DP), kp=(T, HPK, DP), q=(T, H, D), k=(T, HKV, D), v=(T, HKV, D))
    xs = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    name, token, head = NAN_AT[where]
    xs[name][token, head, 3] = float("nan")
    return list(xs.values())


def _run(backend, xs, monkeypatch):
    monkeypatch.setenv("FLASH_MSA_BACKEND", backend)
    cu = torch.tensor([0, 160, T], dtype=torch.int32)
    kw = dict(block_size=BLOCK, cu_seqlens=cu, max_seqlen=160)
    idx = flash_msa.select_blocks(xs[0], xs[1], 2, **kw)
    out, kl = flash_msa.msa_attention(*xs, 2, **kw)
    return idx, out.isnan().any(-1), kl


@pytest.mark.parametrize("where", sorted(NAN_AT))
def test_torch_and_triton_follow_one_nan_rule(where, monkeypatch):
    monkeypatch.setattr(api, "_value_checks", lambda device: False)
    xs = _inputs(where)
    idx_t, nan_t, kl_t = _run("torch", xs, monkeypatch)
    idx, nan, kl = _run("triton", xs, monkeypatch)
    assert torch.equal(idx, idx_t), "the selections differ"
    if where == "v":
        token = NAN_AT["v"][1]
        assert (nan | ~nan_t).all(), "triton misses a row that attends the NaN value"
        assert not nan[: token - token % BLOCK].any() and not nan[160:].any()
    else:
        assert torch.equal(nan, nan_t)
    assert nan_t.any() == (where in ("q", "k", "v"))
    assert kl.isnan().item() == kl_t.isnan().item()
    if where in ("k_proxy", "q_proxy"):
        assert kl_t.isnan()
