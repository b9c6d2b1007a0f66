"""Test-side helpers around the harness of :mod:`flash_msa.testing` (the rule lives there).

One problem on given indices is checked the same way everywhere (CPU Triton tests, GPU tests):

- :func:`references`: the *exact* result (the torch reference in fp64 on the same input values)
  and the *same-dtype* result (the reference's forward and backward with ``upcast=False``: every
  matmul on input-dtype operands, statistics in fp32, as the kernels' MMAs), as dicts;
- :func:`results`: a backend's ``Forward`` / ``Grads`` as the same kind of dict;
- :func:`check`: every quantity by ``testing.assert_close`` (``err <= 2 * err(same) + atol``,
  and the check must be able to fail).

Gradients always come from :func:`flash_msa.testing.training_loss` (O(1) gradients in all five
inputs): :func:`incoming` gives what autograd hands the op for that loss (``dout`` in the
output's dtype, ``dkl`` = the KL weight).

Why fp64 and not fp32 as "exact": the same-dtype reference computes the proxy scores in fp32
(also for bf16 inputs), so against an fp32 exact its ``proxy_lse`` error would be 0 and the rule
would leave only one fp32 rounding of slack for the kernel's own fp32 reductions.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from flash_msa import backends, reference, testing
from flash_msa.problem import Config, Forward, Grads, Saved

FWD = ("out", "lse", "proxy_lse", "kl")
GRADS = ("dq", "dk", "dv", "dq_proxy", "dk_proxy")


def config(max_seqlen, D, Dp, block_size, top_k, *, warmup=False, compute_kl=True) -> Config:
    """The ``Config`` of one call with the default scales (``top_k`` is dropped in warmup)."""
    return Config(
        block_size=block_size,
        softmax_scale=D**-0.5,
        max_seqlen=max_seqlen,
        proxy_scale=Dp**-0.5,
        top_k=None if warmup else top_k,
        warmup=warmup,
        compute_kl=compute_kl,
    )


def packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, *, dtype, device, seed=0, kind="random"):
    """``([q_proxy, k_proxy, q, k, v], cu_seqlens)``: packed ``(T, heads, dim)`` inputs of
    sequences of ``lengths`` (zeros allowed: empty sequences)."""
    T = sum(lengths)
    xs = testing.make_inputs(1, T, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, seed=seed, kind=kind)
    return [x[0].to(device).contiguous() for x in xs], testing.cu(lengths, device)


def selected_inputs(layout, *, dtype, device="cuda", seed=0):
    """``(xs, cu_seqlens, cfg, idx)`` of one sparse call: :func:`packed_inputs` ``xs = [q_proxy,
    k_proxy, q, k, v]`` of ``layout = (lengths, H, Hkv, Hp, Hpk, D, Dp, block, top_k)`` (as
    :data:`CUTE_LAYOUTS`), its :func:`config` and the torch reference's selection ``idx``
    ``(T, Hp, top_k)``."""
    lengths, H, Hkv, Hp, Hpk, D, Dp, b, top_k = layout
    xs, cu = packed_inputs(lengths, H, Hkv, Hp, Hpk, D, Dp, dtype=dtype, device=device, seed=seed)
    cfg = config(max(lengths), D, Dp, b, top_k)
    return xs, cu, cfg, reference.select(xs[0], xs[1], cu, cfg)


def incoming(q, Hp, seed):
    """``(dout, dkl)`` that autograd hands the op for ``testing.training_loss(out, kl, rows,
    seed)`` with ``rows = Hp * T``: ``dout`` in the output's dtype (``q``'s), ``dkl`` the KL
    weight as a 0-dim fp32 tensor."""
    T = q.shape[0]
    dout, w = testing.loss_weights(q.shape, Hp * T, seed, q.device)
    return dout.to(q.dtype), torch.tensor(w, dtype=torch.float32, device=q.device)


def results(fwd: Forward, grads: Grads | None = None) -> dict:
    """A backend's forward (and backward) outputs by name (``None`` entries dropped)."""
    named = dict(zip(FWD, fwd[:4]))
    if grads is not None:
        named.update(zip(GRADS, grads))
    return {k: v for k, v in named.items() if v is not None}


def _reference(qp, kp, q, k, v, idx, cu, cfg, dout, dkl, *, exact):
    cast = (lambda x: x.double()) if exact else (lambda x: x)
    qp, kp, q, k, v, dout = (None if x is None else cast(x) for x in (qp, kp, q, k, v, dout))
    f = reference.fwd(q, k, v, idx, cu, cfg, qp, kp, upcast=exact)
    saved = Saved(q, k, v, f.out, f.lse, idx, qp, kp, f.proxy_lse)
    wanted = dout is not None or dkl is not None
    g = reference.bwd(dout, dkl, saved, cu, cfg, upcast=exact) if wanted else None
    return results(f, g)


def references(qp, kp, q, k, v, idx, cu, cfg, dout=None, dkl=None):
    """``(exact, same)``: the reference's forward on ``idx`` (``None``: warmup) and, when
    ``dout`` / ``dkl`` are given, its backward, in fp64 and in the input dtype (see the module
    docstring). ``qp``/``kp`` may be ``None`` (no proxy)."""
    kw = dict(idx=idx, cu=cu, cfg=cfg, dout=dout, dkl=dkl)
    exact = _reference(qp, kp, q, k, v, exact=True, **kw)
    same = _reference(qp, kp, q, k, v, exact=False, **kw)
    return exact, same


def check(mine: dict, exact: dict, same: dict, names=None, *, can_fail=True, label=""):
    """Each named quantity (default: every one of ``exact``) by the tolerance rule, with the
    tolerance from ``mine``'s dtype. Returns ``{name: (err, tol)}``."""
    report = {}
    for name in names or exact:
        assert name in mine, f"{label}{name}: not computed"
        report[name] = testing.assert_close(
            f"{label}{name}", mine[name], exact[name], same[name], can_fail=can_fail
        )
    return report


# the GPU tests' head layouts of the CuTe kernels (backward, KL stage): lengths (with empty
# and one-token sequences), H, Hkv, Hp, Hpk, D, Dp, block, top_k
CUTE_LAYOUTS = {
    "anchor": ((3000, 1, 900), 16, 2, 4, 1, 128, 128, 128, 8),
    "paper": ((1500,), 64, 4, 4, 1, 128, 128, 128, 8),
    "Hp>Hpk>1-b64": ((700, 0, 1300, 1), 8, 2, 4, 2, 64, 64, 64, 8),
    "G2=1": ((1000, 333), 4, 4, 4, 2, 128, 128, 128, 5),
    "Dp>D": ((777, 777), 8, 1, 4, 1, 64, 128, 128, 3),
    "D=64-b128": ((2049,), 16, 2, 4, 1, 64, 64, 128, 16),
}


# the marks of a module of GPU tests of the CuTe kernels (``pytestmark``, or per test through
# :func:`marked`): ``gpu``, and skipped off an sm_90 device
SM90 = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]


def cute_backend():
    """The CuTe backend module, loaded and available (a test without nvidia-cutlass-dsl
    skips; one whose backend cannot load or run fails with the reason)."""
    pytest.importorskip("cutlass")
    module, why = backends.load("cute")
    assert module is not None, why
    why = module.unavailable_reason()
    assert why is None, why
    return module


def spawn_script(script: str, args, **env) -> subprocess.Popen:
    """Start ``python script *args`` with ``env`` added to this process's environment (a fresh
    process: the compile-cache tests); read its result with :func:`script_result`."""
    return subprocess.Popen(
        [sys.executable, script, *map(str, args)],
        env=dict(
            os.environ,
            **env,
            PYTHONPATH=os.pathsep.join(
                [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
            ),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def script_result(p: subprocess.Popen) -> dict:
    """The JSON object on the last line of a :func:`spawn_script` process's output (it must
    exit 0). No time limit of its own: a slow machine's child is not a failure (CI's limit
    applies to a hung one)."""
    out, err = p.communicate()
    assert p.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def no_host_sync():
    """The block must not synchronize with the host: CUDA's sync debug mode set to raise on
    one (after a synchronize, so that earlier work does not count), restored afterwards."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def torch_combine(o_part, l_part, idx, out, lse, proxy=None):
    """The sparse forward's combine stage (``sparse_forward.Stages.combine``) in torch, fp32:
    merge each row's used slots (index >= 0) by their LSE; an unused slot adds nothing whatever
    its partial rows hold (NaN included: the contract never writes them); a row with no used
    slot gets lse -inf and out 0. ``proxy``: ``(pl_part, proxy_lse)``, merged the same way."""
    C, Hs, K = idx.shape
    H = lse.shape[1]
    used = (idx >= 0).repeat_interleave(H // Hs, dim=1)
    lp = torch.where(used, l_part[:C], -torch.inf)
    lse.copy_(torch.logsumexp(lp, dim=-1))
    if o_part is not None:
        w = torch.where(used, torch.exp(lp - lse[..., None]), 0.0)
        o = torch.where(used[..., None], o_part[:C].float(), 0.0)
        out.copy_(torch.nan_to_num((w[..., None] * o).sum(2), nan=0.0).to(out.dtype))
    if proxy is not None:
        torch_combine(None, proxy[0], idx, None, proxy[1])


def work_items(wl):
    """``[(list, [entries...])]`` of a work list's non-empty items, in item order (the work
    list tests compare two builds by it)."""
    out = []
    for lst, s, e in zip(wl.item_list.tolist(), wl.item_start.tolist(), wl.item_end.tolist()):
        if e > s:
            out.append((lst, wl.perm[s:e].tolist()))
    return out


def random_rows(lengths, Hs, K, block, q_map, seed):
    """``(cu, idx)``: int32 sequence-local block indices of each query row (any block of its
    token's sequence, 30% unused; a padding row's are arbitrary) and the cu_seqlens of
    ``lengths`` (the work-list tests' inputs)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    toks = torch.arange(sum(lengths)) if q_map is None else q_map.clamp_min(0).long()
    seq = torch.searchsorted(cu[1:].long(), toks, right=True).clamp_max(len(lengths) - 1)
    nblk = (cu[1:] - cu[:-1] + block - 1) // block
    idx = (torch.rand(len(toks), Hs, K, generator=g) * nblk[seq].float()[:, None, None]).long()
    return cu, torch.where(torch.rand(idx.shape, generator=g) < 0.3, -1, idx).int()


def marked(marks):
    """Apply a mark or a list of marks (a merged module's former ``pytestmark``) to one test."""
    marks = list(marks) if isinstance(marks, (list, tuple)) else [marks]

    def apply(fn):
        for mark in reversed(marks):
            fn = mark(fn)
        return fn

    return apply


def same_blocks(a, b):
    NB = b.num_blocks
    assert (a.num_blocks, a.block_size) == (NB, b.block_size)
    for x, y in ((a.start, b.start), (a.end, b.end), (a.seq_first, b.seq_first)):
        assert x.dtype == y.dtype == torch.int32 and x.shape == y.shape
        assert torch.equal(x, y)
    # both rows in one (2, ceil(NB / 4) * 4) buffer, each 16-byte aligned
    assert a.start.data_ptr() + -(-NB // 4) * 16 == a.end.data_ptr()
    assert a.start.is_contiguous() and a.start.data_ptr() % 16 == 0


def same_items(a, b):
    assert a.num_items == b.num_items and a.item_tokens == b.item_tokens
    assert (a.num_blocks, a.slots, a.heads) == (b.num_blocks, b.slots, b.heads)
    assert a.q_map is b.q_map  # (None: no map)
    for x, y in ((a.perm, b.perm), (a.block_start, b.block_start), (a.block_end, b.block_end)):
        assert x is y or torch.equal(x, y)  # passed through from the lists
    assert a.item_list.dtype == torch.int32 and torch.equal(a.item_list, b.item_list)
    for x, y in ((a.item_start, b.item_start), (a.item_end, b.item_end)):
        assert x.dtype == torch.int64 and torch.equal(x, y)
    # the (2, W') buffers, the padding column too (item_start / item_end: its two rows)
    span, ref = a.item_start._base, b.item_start._base
    assert a.item_end._base is span
    assert span.shape == ref.shape == (2, b.num_items + b.num_items % 2)
    assert span.is_contiguous() and torch.equal(span, ref)


def same_lists(a, b):
    assert a.perm.dtype == a.bounds.dtype == torch.int64
    assert torch.equal(a.perm, b.perm) and torch.equal(a.bounds, b.bounds)
    assert torch.equal(a.block_start, b.block_start) and torch.equal(a.block_end, b.block_end)
    assert a[4:] == b[4:]  # NB, K, Hs, q_map (None), tok0, rows, block size, no chunks


def poison_new_buffers(mp) -> None:
    """Every buffer made by ``torch.empty`` / ``torch.empty_like`` while ``mp`` (a
    ``pytest.MonkeyPatch``) is active starts poisoned (``testing.poison``: NaN for floats), so
    that a tile, partial row or output the code under test forgot to write fails the check."""
    real_empty, real_like = torch.empty, torch.empty_like
    mp.setattr(torch, "empty", lambda *a, **kw: testing.poison(real_empty(*a, **kw)))
    mp.setattr(torch, "empty_like", lambda *a, **kw: testing.poison(real_like(*a, **kw)))


def gloo_group(rank: int, world: int, init_file: str, timeout_s: float) -> None:
    """Join a spawned CPU test worker to its gloo group (file rendezvous), with one intra-op
    thread (the ranks share the CI cores) and the torch backend; ``timeout_s`` bounds a hang."""
    torch.set_num_threads(1)
    os.environ["FLASH_MSA_BACKEND"] = "torch"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
