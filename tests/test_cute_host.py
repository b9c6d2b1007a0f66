"""CPU tests of the CuTe backward's host code (``cute/bwd_sm90.py``) that need no GPU: the
deterministic path's glue (token chunks, work-item ranges, partial layouts, the fixed-order sums
of ``flash_msa.ordered`` under the Triton interpreter) with the kernel replaced by a stand-in
that writes what the kernel's indexing says it writes."""

from __future__ import annotations

import pytest
import torch

from flash_msa import ordered, reference, testing
from harness import config, packed_inputs


def _stand_in(H, Hs, K, block, written):
    """A ``launch(wl, outs, tok0, w0, w1)`` for ``bwd_sm90._ordered`` writing, for every entry
    and item of the range, the rows and tiles the deterministic kernel writes (its index
    formulas): 1 into each of the entry's dQ partial rows ``((t - tok0) H + h) K + slot`` (h
    over the selection head's G heads) and dQ_proxy rows ``((t - tok0) Hs + p) K + slot``; 1 / 2
    / 3 into every row of the item's dK / dV / dK_proxy tile (rows ``(w - w0) block ..``).
    ``written[(p, gb)]`` counts the non-empty items of each list (the expected tile sums)."""
    G = H // Hs

    def launch(wl, outs, tok0=0, w0=0, w1=None):
        written.setdefault("launches", []).append((tok0, w0))
        dq, dk, dv, dqp, dkp = outs
        NB = wl.num_blocks
        for w in range(w0, wl.num_items if w1 is None else w1):
            e0, e1 = int(wl.item_start[w]), int(wl.item_end[w])
            if e0 >= e1:
                continue
            p, gb = divmod(int(wl.item_list[w]), NB)
            written[(p, gb)] = written.get((p, gb), 0) + 1
            tile = slice((w - w0) * block, (w - w0 + 1) * block)
            for buf, value in ((dk, 1.0), (dv, 2.0), (dkp, 3.0)):
                if buf is not None:
                    buf[tile] = value
            for e in range(e0, e1):
                t, rest = divmod(int(wl.perm[e]), Hs * K)
                slot = rest % K
                if dq is not None:
                    for h in range(p * G, p * G + G):
                        dq[((t - tok0) * H + h) * K + slot] = 1.0
                if dqp is not None:
                    dqp[((t - tok0) * Hs + p) * K + slot] = 1.0

    return launch


@pytest.mark.parametrize("budget", [1 << 30, 300_000], ids=["one-chunk", "chunks-and-ranges"])
def test_cute_deterministic_glue_sums_every_partial_once(budget, monkeypatch):
    """``bwd_sm90._ordered`` with the stand-in kernel: dq[t, h] and dq_proxy[t, p] are the
    count of (t, p)'s valid slots, each key's dK / dV / dK_proxy the number of items (over the
    selection heads of its key head) that hold its block, times 1 / 2 / 3; partial buffers
    NaN-poisoned, through several token chunks and item ranges (small budget) and in one."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import bwd_sm90

    monkeypatch.setattr(ordered, "PARTIAL_BYTES", budget)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    lengths, H, Hkv, Hs, Hpk, D, block, K = (300, 0, 170), 8, 2, 4, 2, 16, 64, 3
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hs, Hpk, D, D, dtype=torch.float32, device="cpu", seed=1
    )
    cfg = config(max(lengths), D, D, block, K)
    idx = reference.select(qp, kp, cu, cfg)  # (T, Hs, K), -1 where a token has fewer blocks
    written: dict = {}
    launch = _stand_in(H, Hs, K, block, written)
    dq, dk, dv, dqp, dkp = bwd_sm90._ordered(launch, q, k, qp, kp, idx, cu, cfg, True, True)

    launches = written.pop("launches")
    if budget < 1 << 30:  # the small budget really splits tokens and items
        assert len({t for t, _ in launches}) > 1 and any(w0 > 0 for _, w0 in launches), launches
    valid = (idx >= 0).sum(-1).float()  # (T, Hs)
    per_head = valid.repeat_interleave(H // Hs, 1)[..., None]
    torch.testing.assert_close(dq, per_head.expand_as(dq))
    torch.testing.assert_close(dqp, valid[..., None].expand_as(dqp))
    # keys: per key head, the items of its selection heads' lists that hold the key's block
    T = q.shape[0]
    starts = cu[:-1].tolist()
    gb_of, gb = [], 0
    for s0, L in zip(starts, lengths):
        for b in range(-(-L // block)):
            gb_of.append((gb, s0 + b * block, min(s0 + L, s0 + (b + 1) * block)))
            gb += 1
    for heads, per, buf, value in ((Hkv, Hs // Hkv, dk, 1.0), (Hpk, Hs // Hpk, dkp, 3.0)):
        want = torch.zeros(T, heads, D)
        for g, k0, k1 in gb_of:
            for p in range(Hs):
                want[k0:k1, p // per] += value * written.get((p, g), 0)
        torch.testing.assert_close(buf, want)
    torch.testing.assert_close(dv, 2.0 * dk)
