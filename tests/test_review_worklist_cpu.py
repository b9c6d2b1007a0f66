"""Review of the shared work list (commit 2b8f47e, one sort per training step): CPU tests of
what it keeps for nothing. Correctness held in every case tried (checkpoint, save_on_cpu,
retain_graph, chunked deterministic backwards: gradients bit for bit); these two are memory.

A training step keeps the forward's sorted lists (``sparse_forward.keeps``: up to a quarter of
q, k, v, out; 8 MiB at anchor 16K) for a backward that does not read them:

- deterministic mode when the backward's dQ partials make it run in chunks while the forward ran
  in one (anchor 16K and 32K: the forward's rows take 64 KiB of partials, 32768 per chunk; the
  deterministic backwards' at least 128 KiB, 8192 per chunk): each chunk sorts its own list;
- a proxy-only step on the Triton backend (main weights frozen, the proxy trained by the KL):
  the forward made the unit proxy gradient, so the backward builds no work list at all.

Both fixed (api.py / sparse_forward.py keep the lists only for a backward that uses them).
"""

from __future__ import annotations

import gc
import weakref

import torch

import flash_msa
from flash_msa import ordered, sparse_forward, testing, worklist
from harness import packed_inputs

_STEP = dict(lengths=(90, 0, 40), H=4, Hkv=2, Hp=2, Hpk=1, D=16, block=64, top_k=2)


def _forward_keeps_lists(monkeypatch, det: bool, main_grad: bool) -> tuple[bool, list]:
    """Runs ``msa_attention`` (Triton, interpreter) and returns whether the forward's sorted
    lists are still alive once the forward returned (i.e. saved for the backward), and the
    rows of each sort the backward ran."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "triton")
    s = _STEP
    (qp, kp, q, k, v), cu = packed_inputs(
        s["lengths"], s["H"], s["Hkv"], s["Hp"], s["Hpk"], s["D"], s["D"],
        dtype=torch.float32, device="cpu", seed=2,
    )  # fmt: skip
    wants = (True, True, main_grad, main_grad, main_grad)  # q_proxy, k_proxy always
    inputs = [x.detach().requires_grad_(w) for x, w in zip((qp, kp, q, k, v), wants)]
    perms, sorts, real = [], [], worklist.lists

    def recording(idx, *a, **kw):
        sorted_lists = real(idx, *a, **kw)
        perms.append(weakref.ref(sorted_lists.perm))
        sorts.append(idx.shape[0])
        return sorted_lists

    monkeypatch.setattr(worklist, "lists", recording)
    out, kl = flash_msa.msa_attention(
        *inputs, s["top_k"], block_size=s["block"], cu_seqlens=cu,
        max_seqlen=max(s["lengths"]), deterministic=det,
    )  # fmt: skip
    gc.collect()
    kept = perms[0]() is not None
    del sorts[:]
    testing.training_loss(out, kl, s["Hp"] * q.shape[0]).backward()
    return kept, sorts


def test_chunked_deterministic_backward_keeps_no_lists(monkeypatch):
    """The forward runs in one chunk, the deterministic backward in four (its partial budget
    cut to ~40 rows, as anchor 16K is cut to 8192 rows): it sorts each chunk, so the forward's
    lists held until then are dead weight."""
    monkeypatch.setattr(ordered, "PARTIAL_BYTES", 40 * 4 * 2 * 16 * 4)  # 40 rows of H K D fp32
    kept, sorts = _forward_keeps_lists(monkeypatch, det=True, main_grad=True)
    assert sorts[-4:] == [40, 40, 40, 10]  # the backward sorted every chunk itself
    assert not kept


def test_proxy_only_step_keeps_no_lists(monkeypatch):
    """Only the proxy requires grad: the Triton forward's KL pass makes the unit proxy
    gradient, the backward only scales it (no work list), so nothing should be kept."""
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=False)
    assert sorts == []
    assert not kept


def test_kept_and_used_when_it_should(monkeypatch):
    """The control: a full step keeps the lists and its backward sorts nothing."""
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=True)
    assert kept and sorts == []
    monkeypatch.setattr(sparse_forward, "keeps", lambda *a: False)  # the rule decides
    kept, sorts = _forward_keeps_lists(monkeypatch, det=False, main_grad=True)
    assert not kept and sorts == [130]
