"""The Triton backend's sparse ops with a query map (``q_map``, context parallelism) against the
torch reference with the same map, on CPU under the interpreter (fp32).

A query map gives ``q``/``q_proxy`` ``Tq`` rows whose tokens ``q_map[row]`` lie anywhere among
the ``T`` keys (``-1``: a padding row). The maps here: rank 1 of the 2-rank zigzag layout of
``flash_msa.distributed`` (two chunks per sequence, padding rows at each sequence's end), and a
random subset of the tokens in random order with a duplicated token and padding rows in between.
Checks: ``select`` equals the reference's indices (every mapped row written, padding rows -1);
``fwd`` (out, lse, proxy LSE, KL, the unit proxy gradient) and ``bwd`` (all five gradients, the
proxy gradient from the forward's KL pass and from the backward's own pass) by the tolerance
rule (``flash_msa.testing.assert_close``, tests/harness.py's exact and same-dtype references run
with the map), padding rows exactly 0 / -inf; outputs and partial buffers start NaN-poisoned.
Deterministic mode with a map. (The default path without a map is checked against the
reference by tests/ops/test_msa.py, bitwise run to run by tests/ops/test_deterministic.py.)

CPU time on the 2-core machine: each test's own in its docstring.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flash_msa import backends, reference, testing
from flash_msa import distributed as cp
from flash_msa.problem import Config, Saved
from harness import FWD, GRADS, config, incoming, packed_inputs, poison_new_buffers, results

pytestmark = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() or backends.interpreting()),
        reason="needs a GPU or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("one_thread"),
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _q_map(kind: str, lengths, block: int) -> torch.Tensor:
    """``(Tq,)`` int32 query map of ``kind`` over the packed tokens of ``lengths``."""
    cu = testing.cu(lengths)
    T = int(cu[-1])
    if kind == "zigzag":  # rank 1 of 2: chunks 1 and 2 of every sequence, padding at the ends
        return cp.layout(2, 1, cu_seqlens=cu, block_size=block).q_map
    g = torch.Generator().manual_seed(len(lengths) + T)
    rows = torch.randperm(T, generator=g)[: T // 2]
    rows = torch.cat([rows[:5], rows[:1], torch.tensor([-1]), rows[5:], torch.tensor([-1, -1])])
    return rows.to(torch.int32)  # a random subset in random order, a duplicate, padding rows


def _local(x: torch.Tensor, q_map: torch.Tensor) -> torch.Tensor:
    """The query rows of a packed ``(T, ...)`` tensor: row ``i`` is token ``q_map[i]``; padding
    rows hold values no key has (their results must not depend on them)."""
    y = x[q_map.long().clamp_min(0)].clone()
    y[q_map < 0] = 7.0
    return y


def _problem(lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, kind, seed=1, deterministic=False):
    """Inputs, the map and the config of one case (keys on ``DEV``)."""
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.float32, device=DEV, seed=seed
    )
    q_map = _q_map(kind, lengths, b).to(DEV)
    cfg = config(max(lengths), D, Dp, b, top_k)
    cfg = Config(**{**cfg.__dict__, "deterministic": deterministic})
    return _local(qp, q_map), kp, _local(q, q_map), k, v, cu, q_map, cfg


def _references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl, q_map):
    """``(exact, same)`` of tests/harness.py (fp64 reference; input-dtype matmuls), with the
    map: the reference's ``fwd`` and ``bwd`` take it as an argument."""
    out = []
    for exact in (True, False):
        cast = (lambda x: x.double()) if exact else (lambda x: x)
        qp_, kp_, q_, k_, v_, do_ = (cast(x) for x in (qp, kp, q, k, v, dout))
        f = reference.fwd(q_, k_, v_, idx, cu, cfg, qp_, kp_, upcast=exact, q_map=q_map)
        saved = Saved(q_, k_, v_, f.out, f.lse, idx, qp_, kp_, f.proxy_lse)
        g = reference.bwd(do_, dkl, saved, cu, cfg, upcast=exact, q_map=q_map)
        out.append(results(f, g))
    return out


def _check(mine: dict, exact: dict, same: dict, q_map: torch.Tensor, label=""):
    """Every quantity of ``mine`` by the rule on the mapped rows; padding rows exactly as the
    contract says (no keys: out 0, lse and proxy LSE -inf, no gradient)."""
    assert mine, "nothing to check"
    real, pad = q_map >= 0, q_map < 0
    for name in mine:
        m, ex, sm = mine[name], exact[name], same[name]
        query_side = name in ("out", "lse", "proxy_lse", "dq", "dq_proxy")
        if query_side:
            want = -torch.inf if name.endswith("lse") else 0.0
            assert (m[pad] == want).all(), f"{label}{name}: padding rows"
            m, ex, sm = m[real], ex[real], sm[real]
        testing.assert_close(f"{label}{name}", m, ex, sm)


# ---------------------------------------------------------------------------------------------
# select
# ---------------------------------------------------------------------------------------------
SELECT_CASES = [  # lengths, Hp, Hpk, Dp, block, top_k, map
    ((300, 77, 200), 4, 1, 16, 64, 3, "zigzag"),  # G = 4, varlen, partial last blocks
    ((150, 0, 260), 4, 2, 16, 128, 4, "random"),  # top_k > blocks available; empty sequence
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=["zigzag-b64", "random-b128"])
def test_select_q_map_equals_reference(case):
    """Indices equal to the reference's with the same map; every mapped row written (a poisoned
    output), padding rows not visited (the op fills them with -1). 2 s (zigzag), 1 s (random)."""
    from flash_msa.triton_ref import selection

    lengths, Hp, Hpk, Dp, b, top_k, kind = case
    qp, kp, *_, cu, q_map, _ = _problem(lengths, 1, 1, Hp, Hpk, 16, Dp, b, top_k, kind)
    cfg = config(max(lengths), 16, Dp, b, top_k)
    into = testing.poisoned((qp.shape[0], Hp, top_k), torch.int32, DEV)
    selection.select_into(into, qp, kp, cu, cfg, q_map)
    ref = reference.select(qp.cpu(), kp.cpu(), cu.cpu(), cfg, q_map=q_map.cpu())
    real = (q_map >= 0).cpu()
    assert torch.equal(into.cpu()[real], ref[real])
    assert (into.cpu()[~real] == testing.POISON_INT).all()  # padding rows: never visited
    out = selection.select(qp, kp, cu, cfg, q_map=q_map).cpu()  # the op: -1 there
    assert torch.equal(out, ref) and (out[~real] == -1).all()


# ---------------------------------------------------------------------------------------------
# fwd and bwd on the reference's indices
# ---------------------------------------------------------------------------------------------
FWD_BWD_CASES = [  # lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k, map
    ((300, 77, 200), 8, 2, 4, 1, 16, 16, 64, 3, "zigzag"),  # Hp > Hkv
    ((150, 0, 260), 4, 4, 2, 1, 16, 32, 128, 4, "random"),  # Hp < Hkv, top_k > blocks, Dp != D
]


def _fwd_bwd(case, deterministic=False):
    """The Triton ``fwd`` (unit proxy gradient asked) and ``bwd`` twice (proxy gradient from the
    forward, then by the backward's own pass) with the map, on the reference's indices (padding
    rows given a real row's: they must be ignored); the references. Returns
    ``(mine_fwd_unit, mine_own_pass, exact, same, q_map)``."""
    from flash_msa import triton_ref

    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, kind = case
    qp, kp, q, k, v, cu, q_map, cfg = _problem(
        lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k, kind, deterministic=deterministic
    )
    idx = reference.select(qp, kp, cu, cfg, q_map=q_map)
    # padding rows have no keys whatever their indices say: give them a real row's
    idx[q_map < 0] = idx[int(torch.nonzero(q_map >= 0)[0])].clone()
    f = triton_ref.fwd(q, k, v, idx, cu, cfg, qp, kp, proxy_grad=True, q_map=q_map)
    assert f.proxy_grad is not None
    dout, dkl = incoming(q, Hp, 1)
    saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse, f.proxy_grad)
    with_unit = triton_ref.bwd(dout, dkl, saved, cu, cfg, q_map=q_map)
    own = triton_ref.bwd(dout, dkl, saved._replace(proxy_grad=None), cu, cfg, q_map=q_map)
    exact, same = _references(qp, kp, q, k, v, idx, cu, cfg, dout, dkl, q_map)
    return results(f, with_unit), results(f, own), exact, same, q_map


@pytest.mark.parametrize("case", FWD_BWD_CASES, ids=["zigzag-b64", "random-b128"])
def test_fwd_bwd_q_map_equals_reference(case, monkeypatch):
    """Forward outputs and all five gradients (the proxy's both ways) by the rule; padding rows
    exact. 7.3 s (zigzag), 3.4 s (random)."""
    poison_new_buffers(monkeypatch)
    mine, own, exact, same, q_map = _fwd_bwd(case)
    assert set(mine) == set(exact) == set(FWD + GRADS)
    _check(mine, exact, same, q_map)
    _check({n: own[n] for n in ("dq_proxy", "dk_proxy")}, exact, same, q_map, "own pass: ")


def test_deterministic_q_map_equals_reference(monkeypatch):
    """Deterministic mode (ordered partials keyed by query row) with a map: the same checks.
    9.1 s."""
    poison_new_buffers(monkeypatch)
    mine, own, exact, same, q_map = _fwd_bwd(FWD_BWD_CASES[1], deterministic=True)
    _check(mine, exact, same, q_map)
    _check({n: own[n] for n in ("dq_proxy", "dk_proxy")}, exact, same, q_map, "own pass: ")


def test_warmup_refuses_q_map():
    """The dense warmup kernels take no map: the limits say so (``auto`` runs warmup on torch)
    and a direct call raises, naming the argument."""
    from flash_msa import limits, triton_ref

    assert triton_ref.LIMITS["warmup"].q_map is False
    assert all(triton_ref.LIMITS[op].q_map for op in ("select", "fwd", "bwd"))
    (qp, kp, q, k, v), cu = packed_inputs(
        (64,), 2, 1, 1, 1, 16, 16, dtype=torch.float32, device=DEV
    )
    cfg = config(64, 16, 16, 64, 2, warmup=True)
    with pytest.raises(ValueError, match="q_map"):
        triton_ref.fwd(q, k, v, None, cu, cfg, qp, kp, q_map=torch.arange(64, dtype=torch.int32))
    # the README's backend table says which ops take a map
    assert "query map" in limits.describe(triton_ref.LIMITS["fwd"])
    assert "query map" not in limits.describe(triton_ref.LIMITS["warmup"])


def test_msa_attention_q_map_on_triton(monkeypatch):
    """The public op with a map, forced onto Triton (the keyword reaches select, fwd and bwd
    through the autograd function), against the torch backend with the same map in fp64: out,
    kl and the five gradients by the rule (no same-dtype run: the atol of fp32). 2.4 s."""
    import flash_msa

    lengths, b = (200, 70), 64
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, 4, 2, 2, 1, 16, 16, dtype=torch.float32, device=DEV, seed=5
    )
    q_map = _q_map("zigzag", lengths, b).to(DEV)
    xs = [_local(qp, q_map), kp, _local(q, q_map), k, v]
    rows = 2 * q_map.numel()
    got = {}
    for name, dtype in (("triton", torch.float32), ("torch", torch.float64)):
        inputs = [x.detach().to(dtype).requires_grad_() for x in xs]
        with backends.forced(name):
            out, kl = flash_msa.api._msa_attention(  # (the query map: distributed's entry)
                *inputs, 2, block_size=b, cu_seqlens=cu, max_seqlen=max(lengths), q_map=q_map
            )
            testing.training_loss(out, kl, rows, seed=5).backward()
        got[name] = [out, kl, *(x.grad for x in inputs)]
    real = q_map >= 0
    names = ("out", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
    for name, mine, exact in zip(names, got["triton"], got["torch"], strict=True):
        if name in ("out", "dq_proxy", "dq"):
            assert (mine[~real] == 0).all(), name
            mine, exact = mine[real], exact[real]
        testing.assert_close(name, mine, exact, dtype=torch.float32)


def test_driver_refuses_q_map_for_stages_without_it():
    """The sparse-forward driver runs a map only with stages that declare it (``Stages.q_map``:
    CuTe's partials do not read ``wl.q_map``): a clear ValueError, nothing launched."""
    from flash_msa import sparse_forward
    from flash_msa.triton_ref import sparse_fwd

    stages = sparse_forward.Stages(partials=sparse_fwd.partials)  # as CuTe's: no q_map
    assert not sparse_forward.borrowed(stages).q_map
    assert sparse_fwd.forward_stages().q_map
    (qp, kp, q, k, v), cu = packed_inputs(
        (64,), 2, 1, 1, 1, 16, 16, dtype=torch.float32, device=DEV
    )
    idx = torch.zeros((64, 1, 1), dtype=torch.int32, device=DEV)
    cfg = config(64, 16, 16, 64, 1)
    q_map = torch.arange(64, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="q_map"):
        sparse_forward.fwd(stages, q, k, v, idx, cu, cfg, qp, kp, q_map=q_map)
