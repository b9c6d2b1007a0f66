"""Host time of the CuTe backend's dispatch: what ``auto``'s resolves and the forward's stage
pick compute per call are pure functions of the call's shapes, dtypes and configuration
(kernels' ``can_implement``, the stages' ``*_fits``, meta tensors), kept here per what they read.

Measured on the CPU of the H200 host: 49 us per training step for the three resolves
(``resolve("fwd")`` 30 us, 20 of them the forward's stage pick) and 12 us for the forward's
``stages_for``, ~2-3 us each remembered (tests/ops/test_worklist.py). The forward's and
backward's keys leave out what varlen steps vary and no limit reads (:func:`run_free`,
:func:`shape_key`), so a remembered value is the one a fresh call returns; the dict is bounded
by clearing it when full (the selection's key keeps ``max_seqlen``: its grid limit).
"""

from __future__ import annotations

import dataclasses

from ..problem import Problem

MEMO_ENTRIES = 4096
_MEMO: dict = {}


def memo(key: tuple, fn, *args):
    """``fn(*args)``, computed once per ``key`` (hashable: ``fn`` and whatever ``fn`` reads of
    ``args``; :data:`MEMO_ENTRIES` keys at most)."""
    value = _MEMO.get(key, _MEMO)
    if value is _MEMO:
        if len(_MEMO) >= MEMO_ENTRIES:
            _MEMO.clear()
        value = _MEMO[key] = fn(*args)
    return value


def clear_memo() -> None:
    """Forget what :func:`memo` kept (for a caller that changes what a remembered function
    reads beyond its key, e.g. a test that patches a kernel's ``can_implement``)."""
    _MEMO.clear()


def run_free(cfg):
    """``cfg`` without what changes from call to call in training but no kernel's limits read
    (``max_seqlen``: every varlen step's longest sequence; the scales): a :func:`memo` key of
    the limits and stage picks, which would otherwise miss on nearly every varlen call. Their
    readers (``limits.reason``, the kernels' ``can_implement``, the stages' ``*_fits``) read
    ``block_size``, ``top_k``, ``compute_kl``, ``deterministic``, ``selection_precision`` and
    ``warmup`` of a config, all kept."""
    return dataclasses.replace(cfg, max_seqlen=0, softmax_scale=0.0, proxy_scale=None)


def shape_key(problem: Problem) -> Problem:
    """``problem`` with :func:`run_free`'s config and one sequence: the :func:`memo` key of the
    forward's and backward's kernel reasons (``limits.reason`` and ``can_implement`` read
    neither the sequence count nor the lengths; the selection's reason does, and keeps the
    whole problem as its key)."""
    return dataclasses.replace(problem, num_seqs=1, cfg=run_free(problem.cfg))
