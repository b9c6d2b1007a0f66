"""flash_msa.integrations' trainer helpers (no framework needed): the warmup switch over every
MSA layer, the KL over layers, and the recall of the proxy's selection on a batch."""

import math

import pytest
import torch

from flash_msa.integrations import measure_recall, msa_layers, set_warmup, total_kl
from flash_msa.nn import MSAttention

pytestmark = pytest.mark.usefixtures("torch_backend")


class Stack(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            MSAttention(32, 4, 2, top_k=1, block_size=64) for _ in range(n)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def test_warmup_switch_and_kl_over_layers():
    model = Stack()
    with pytest.raises(RuntimeError, match=r"MSA layers \[0, 1, 2\] \(of 3\) have no KL yet"):
        total_kl(model)
    assert set_warmup(model, True) == 3 and all(m.warmup for m in msa_layers(model))
    x = torch.randn(1, 150, 32, generator=torch.Generator().manual_seed(1))
    model(x)
    kls = [m.last_kl for m in model.layers]
    assert torch.equal(total_kl(model), torch.stack(kls).sum())
    assert torch.equal(total_kl(model, reduction="mean"), torch.stack(kls).mean())
    assert set_warmup(model, False) == 3 and not any(m.warmup for m in model.layers)
    model(x)
    assert not torch.equal(total_kl(model), torch.stack(kls).sum())  # the sparse step's KL
    with pytest.raises(TypeError, match="warmup must be a bool"):
        set_warmup(model, 1)
    with pytest.raises(ValueError, match="reduction"):
        total_kl(model, reduction="max")
    with pytest.raises(ValueError, match="Linear has no MSAttention layer"):
        msa_layers(torch.nn.Linear(2, 2))


def _peaked(S=256, b=64, H=2, D=16, seed=0, proxy_sign=1.0):
    """Inputs whose main attention of every query sits on one key block (block 1, keys of a
    shared direction); the proxy sees the same keys (``proxy_sign=1``) or their opposite."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, H, D, generator=g) * 0.1
    k = torch.randn(1, S, 1, D, generator=g) * 0.1
    q[..., 0] += 8.0
    k[:, b : 2 * b, :, 0] += 8.0  # block 1 holds the mass for every row that sees it
    return q[:, :, :1] * 1.0, proxy_sign * k, q, k


def test_recall_of_a_proxy_that_matches_and_one_that_does_not():
    qp, kp, q, k = _peaked()
    good = measure_recall(qp, kp, q, k, 2, block_size=64)
    assert good["rows"] == 256 - 2 * 64  # rows with a choice: they see more than 2 blocks
    assert good["recall"] == 1.0 and good["exact_rows"] == 1.0
    assert good["mass_ratio"] == pytest.approx(1.0)
    qp, kp, q, k = _peaked(proxy_sign=-1.0)
    bad = measure_recall(qp, kp, q, k, 2, block_size=64)
    assert bad["recall"] == 0.0 and bad["mass_ratio"] < 0.1
    # packed form: two sequences, weighted by their rows
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    qp1, kp1, q1, k1 = _peaked()
    qp2, kp2, q2, k2 = _peaked(proxy_sign=-1.0, seed=1)
    both = measure_recall(
        *(torch.cat([a[0], b[0]]) for a, b in ((qp1, qp2), (kp1, kp2), (q1, q2), (k1, k2))),
        2,
        block_size=64,
        cu_seqlens=cu,
    )
    assert both["rows"] == 256 and both["recall"] == pytest.approx(0.5)


def test_recall_without_a_choice_and_bad_input():
    qp, kp, q, k = _peaked(S=100)
    out = measure_recall(qp, kp, q, k, 2, block_size=64)  # 2 blocks only: no row has a choice
    assert out["rows"] == 0 and math.isnan(out["recall"])
    with pytest.raises(ValueError, match="q_proxy must be"):
        measure_recall(qp[0], kp, q, k, 2)
    with pytest.raises(ValueError, match="block_size"):
        measure_recall(qp, kp, q, k, 2, block_size=32)
    with pytest.raises(ValueError, match="top_k"):
        measure_recall(qp, kp, q, k, 0)
