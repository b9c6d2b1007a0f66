"""The ranks' agreement check of ``flash_msa.distributed`` (docs/distributed.md, "Agreement").

Every eager ``msa_attention`` / ``gather`` all-gathers one fixed-length int64 fingerprint per
rank before its first collective, and every rank raises the same ``ValueError`` naming each
field that differs; a rank whose own argument checks raise takes part with an error flag, so
the others raise too instead of waiting in a collective. Two kinds of tests:

- single process: the verdict from synthetic tables (grouping of ranks by value, several
  fields, a rejecting rank, a truncated message, other formats and calls) and the layout's
  ``cu_seqlens_hash``;
- one ``torch.multiprocessing`` spawn of 2 gloo processes (a 30 s group timeout: a regression
  that hangs fails within it) that runs each mismatch in turn: layouts of different batches
  with the same local token count, ``top_k``, ``warmup``, the keys' head count, the dtype,
  ``requires_grad``, ``gather``'s elements per token, and a rank that rejects its own
  arguments (in the op's checks and in this module's); each must raise on both ranks within
  seconds, and a valid call afterwards shows the group still in step.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import BLOCK, TOP_K, _inputs

from flash_msa import distributed as cp
from flash_msa import testing

CASE_SECONDS = 10  # each mismatch raises on every rank well within this (measured: < 20 ms)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as in test_distributed.py (tiny tensors, 2 busy CI cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# single process: the verdict, the layout's hash
# ---------------------------------------------------------------------------------------------
def _fields(**change):
    """Valid ``msa_attention`` fields with ``change`` (field name -> int) applied."""
    names = [name for name, _ in cp._FIELDS["msa_attention"]]
    values = list(range(10, 10 + len(names)))
    for name, value in change.items():
        values[names.index(name)] = value
    return values


def _table(*rows):
    return [cp._fingerprint("msa_attention", fields, error) for fields, error in rows]


def test_verdict_names_each_field_and_groups_ranks():
    """Equal tables agree; a difference names the field, the ranks grouped by value in order of
    first appearance, every differing field in the one message."""
    same = _table(*[(_fields(), None)] * 3)
    assert cp._verdict("msa_attention", same) is None
    table = _table(
        (_fields(top_k=16, warmup=0), None),
        (_fields(top_k=8, warmup=1), None),
        (_fields(top_k=16, warmup=0), None),
        (_fields(top_k=16, warmup=0), None),
    )
    why = cp._verdict("msa_attention", table)
    assert why.startswith("flash_msa.distributed.msa_attention: ranks disagree on top_k: ")
    assert "top_k: ranks 0, 2, 3 have 16, rank 1 has 8; warmup: ranks 0, 2, 3 have False" in why
    f64, f32 = (cp._str_code(str(d)) for d in (torch.float64, torch.float32))
    half = cp._float_code(0.5)
    table = _table((_fields(**{"dtype of q": f64}), None), (_fields(**{"dtype of q": f32}), None))
    assert "dtype of q: rank 0 has torch.float64, rank 1 has torch.float32" in cp._verdict(
        "msa_attention", table
    )
    table = _table((_fields(softmax_scale=half), None), (_fields(), None))
    assert "softmax_scale: rank 0 has 0.5, rank 1 has " in cp._verdict("msa_attention", table)


def test_verdict_rejected_arguments():
    """A rank's error flag wins over every field: its peers quote its message (truncated to the
    fingerprint's bytes, a cut character dropped)."""
    error = ValueError("top_k must be >= 1, got 0")
    table = _table((_fields(), None), (None, error), (_fields(top_k=1), None))
    why = cp._verdict("msa_attention", table)
    assert why == (
        "flash_msa.distributed.msa_attention: rank 1 rejected its arguments: ValueError: "
        "top_k must be >= 1, got 0"
    )
    long = TypeError("x" + "\u00e9" * 400)  # 2 bytes each after 12: the cut splits one
    (text,) = re.findall("rejected its arguments: (.*)", cp._verdict("gather", _gather(long)))
    assert text.startswith("TypeError: x\u00e9\u00e9") and text.endswith("\u00e9...")
    assert len(text.encode()) <= cp._MESSAGE_BYTES


def _gather(error):
    fields = list(range(len(cp._FIELDS["gather"])))
    return [cp._fingerprint("gather", fields), cp._fingerprint("gather", None, error)]


def test_verdict_other_format_or_call():
    ok = cp._fingerprint("msa_attention", _fields())
    other = [cp._FORMAT + 1, *ok[1:]]
    assert "different fingerprint formats" in cp._verdict("msa_attention", [ok, other])
    gathering = cp._fingerprint("gather", range(len(cp._FIELDS["gather"])))
    why = cp._verdict("msa_attention", [ok, gathering])
    assert why.endswith("different calls: rank 0 in msa_attention, rank 1 in gather")


def test_fingerprint_values_past_int64_are_invalid():
    """A Python int past int64 (``top_k=10**30``) cannot break the gather's tensor."""
    row = cp._fingerprint("msa_attention", _fields(top_k=10**30))
    assert len(row) == cp._LENGTH and torch.tensor(row).dtype == torch.int64
    assert cp._INVALID in row[cp._HEADER : cp._HEADER + cp._MAX_FIELDS]


def test_layout_hash():
    """The hash is the global batch's: equal on every rank, for every world size and for the
    batch form of the same lengths; another order of the lengths changes it."""
    cu = testing.cu([512, 512])
    lays = [cp.layout(P, r, cu_seqlens=cu, block_size=BLOCK) for P in (1, 2) for r in range(P)]
    lays.append(cp.layout(2, 1, batch_size=2, seqlen=512, block_size=128))
    lays.append(lays[1].for_rank(1))
    assert len({lay.cu_seqlens_hash for lay in lays}) == 1
    a, b = (cp.layout(2, 0, cu_seqlens=testing.cu(n), block_size=BLOCK) for n in ([3, 2], [2, 3]))
    assert a.local_tokens == b.local_tokens and a.cu_seqlens_hash != b.cu_seqlens_hash


# ---------------------------------------------------------------------------------------------
# two gloo processes: each mismatch raises on both ranks
# ---------------------------------------------------------------------------------------------
def _op(rank, *, lengths=(300, 200), top_k=TOP_K, grad=True, change=None, **kw):
    """``cp.msa_attention`` on this rank's shards of a float64 batch of ``lengths``, forward
    and backward; ``change``: a function applied to the five shards first."""
    lay = cp.layout(2, rank, cu_seqlens=testing.cu(lengths), block_size=BLOCK)
    xs = [cp.shard(x, lay).requires_grad_(grad) for x in _inputs(sum(lengths), torch.float64)]
    xs = change(xs) if change else xs
    out, kl = cp.msa_attention(*xs, top_k, layout=lay, **kw)
    if grad:
        (out.sum() + kl).backward()
    return out


def _gather_op(rank, heads=3):
    lay = cp.layout(2, rank, cu_seqlens=testing.cu([300, 200]), block_size=BLOCK)
    return cp.gather(torch.zeros(lay.local_tokens, heads, 2), lay)


def _on_rank(which, change, plain=None):
    """A case's call: ``change`` on rank ``which``, ``plain`` (default ``_op``) elsewhere."""
    plain = plain or _op
    return lambda rank: (change if rank == which else plain)(rank)


def _keys_one_head(xs):
    qp, kp, q, k, v = xs
    return [qp, kp, q, k[:, :1].contiguous(), v[:, :1].contiguous()]  # Hkv 2 -> 1: still valid


def _as_float32(xs):
    return [x.detach().float().requires_grad_() for x in xs]


DISAGREE = "ranks disagree on "
# name -> (the call per rank, the pattern every rank's ValueError matches, fields it must not
# name); the same message on both ranks
MISMATCHES = {
    "cu_seqlens": (
        _on_rank(1, lambda r: _op(r, lengths=(200, 300))),  # local tokens 384 on both
        DISAGREE + r"cu_seqlens: rank 0 has hash 0x[0-9a-f]{16}, rank 1 has hash 0x[0-9a-f]{16} \(",
        ("total_tokens", "local_tokens", "sequences"),
    ),
    "top_k": (
        lambda r: _op(r, top_k=(16, 8)[r]),
        DISAGREE + r"top_k: rank 0 has 16, rank 1 has 8 \(",
        (),
    ),
    "warmup": (
        _on_rank(1, lambda r: _op(r, warmup=True)),
        DISAGREE + r"warmup: rank 0 has False, rank 1 has True \(",
        (),
    ),
    "heads": (
        _on_rank(1, lambda r: _op(r, change=_keys_one_head)),
        DISAGREE + r"heads of k: rank 0 has 2, rank 1 has 1; heads of v: rank 0 has 2, rank 1 "
        r"has 1 \(",
        ("dtype of",),
    ),
    "dtype": (
        _on_rank(1, lambda r: _op(r, change=_as_float32)),
        DISAGREE + r"dtype of q_proxy: rank 0 has torch.float64, rank 1 has torch.float32; .*"
        r"dtype of v: rank 0 has torch.float64, rank 1 has torch.float32 \(",
        ("heads of",),
    ),
    "requires_grad": (  # rank 1 would skip the backward's reduce-scatters
        _on_rank(1, lambda r: _op(r, grad=False)),
        DISAGREE + r"requires_grad of q_proxy: rank 0 has True, rank 1 has False;",
        (),
    ),
    "gather": (
        _on_rank(1, lambda r: _gather_op(r, heads=1), _gather_op),
        r"flash_msa.distributed.gather: ranks disagree on elements per token of x: rank 0 has 6, "
        r"rank 1 has 2 \(",
        ("dtype of",),
    ),
}
# name -> (the call per rank, the rejecting rank, its own error, the peers' ValueError)
REJECTIONS = {
    "op check": (
        _on_rank(1, lambda r: _op(r, top_k=0)),
        1,
        (ValueError, "top_k must be >= 1, got 0"),
        "rank 1 rejected its arguments: ValueError: top_k must be >= 1, got 0",
    ),
    "module check": (
        _on_rank(0, lambda r: _op(r, overlap=1)),
        0,
        (TypeError, "overlap must be a bool"),
        "rank 0 rejected its arguments: TypeError: overlap must be a bool",
    ),
}


def _outcome(call, rank):
    """``(exception or None, seconds)`` of ``call(rank)``."""
    t0 = time.perf_counter()
    try:
        call(rank)
    except Exception as e:
        return e, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def _agreement_worker(rank, world, init_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["FLASH_MSA_BACKEND"] = "torch"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),  # a hang fails boundedly
    )
    try:
        for name, (call, pattern, absent) in MISMATCHES.items():
            error, seconds = _outcome(call, rank)
            texts = [None] * world
            dist.all_gather_object(texts, str(error))
            where = f"rank {rank}, {name}: {error!r}"
            assert isinstance(error, ValueError) and re.search(pattern, str(error)), where
            assert not any(field in str(error) for field in absent), where
            assert len(set(texts)) == 1, (name, texts)  # the same message on every rank
            assert seconds < CASE_SECONDS, (where, seconds)
            print(f"rank {rank}, {name}: raised in {1e3 * seconds:.1f} ms")
        for name, (call, which, (own, own_text), peer_text) in REJECTIONS.items():
            error, seconds = _outcome(call, rank)
            texts = [None] * world
            dist.all_gather_object(texts, repr(error))  # each rank's outcome, in step
            where = f"rank {rank}, {name}: {texts}"
            kind, text = (own, own_text) if rank == which else (ValueError, peer_text)
            assert isinstance(error, kind) and text in str(error), where
            assert seconds < CASE_SECONDS, (where, seconds)
            print(f"rank {rank}, {name}: raised in {1e3 * seconds:.1f} ms")
        # the group is still in step: valid calls run on both ranks
        out = _op(rank)
        assert torch.isfinite(out).all()
        assert _gather_op(rank).shape == (500, 3, 2)
    finally:
        dist.destroy_process_group()


def test_agreement_gloo(tmp_path):
    """Every mismatch raises the same ValueError on both gloo ranks, naming the field, and a
    rank that rejects its arguments makes its peer raise instead of wait (module docstring)."""
    mp.spawn(_agreement_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)

