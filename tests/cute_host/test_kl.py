"""CPU checks of the CuTe KL stage on the forward partials' kernel (``FwdKlSm90`` in
``flash_msa/cute/fwd_kl_sm90.py``, ``kl`` and ``kl_fits`` in ``flash_msa/cute/forward.py``; its
numerics are tested on the GPU:
tests/ops/test_kl.py -k fwd_mode): three configurations compile for sm_90a without spills
(the full list is ``compile_check.kl_configurations``, run by the CuTe compile check), the
limits and shared-memory sizes, the switch's default, the host's refusals naming the argument.
CPU time on the 2-core machine: 5-9 s in pytest, 4-7 s of it the three compiles.

The KL mode's Q buffers (``FwdKlSm90``, the KL mode of the forward partials kernel) never
overlap: a CPU check of its shared-memory layout.

The KL mode's q and q_proxy gathers are one double-buffered stream per warpgroup over one Q
region, read through two views, ``sQ`` (stages of ``64 x D``) and ``sQp`` (stages of ``64 x
Dp``), both indexed by the same buffer number ``qb = 2 wg + s % 2``. Each view's stage stride
is its own tile size, so when D != Dp buffer ``b`` of one view overlaps other buffers of the
other view: a warpgroup's next gather lands on the tile its current MMA reads (D = 64, Dp =
128: step 0's q_proxy tile, buffer 0 = elements [0, 8192), is overwritten by step 1's q rows
in sQ buffer 1 = [4096, 8192)), and across warpgroups (warpgroup 0's q_proxy buffer 1 = sQ
buffers 2 and 3, warpgroup 1's). The forward partials' own proxy part does not have this
problem: it runs after a CTA barrier, with only the sQp view in use. So D != Dp is refused
(``FwdKlSm90.can_implement``; the forward then borrows Triton's KL stage).

The test traces the host (``__call__``, as ``compile_check.compile_kl`` does) up to the kernel
launch and reads the layouts it hands the kernel. It asserts the invariant the kernel relies on
(different buffer numbers never share bytes, whichever view each is read through), so a fix
that keeps one buffer stride for both views (``64 * max(D, Dp)`` elements) makes it pass, and so
does one that builds the smaller view with ``r = max(D, Dp) / dim`` times the stages and reads
buffer ``qb`` at stage ``r * qb`` (the test takes a view with ``r * 2 * warpgroups`` stages to
mean that). CPU time: ~1 s (traces only, no compile).
"""

from __future__ import annotations

import types

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_configurations_compile_for_sm90_without_spills():
    from flash_msa.cute.compile_check import compile_kl, kl_configurations

    cfgs = {name: cfg for name, *cfg in kl_configurations()}
    assert len(cfgs) == len(list(kl_configurations())) == 9
    for name in (
        "kl bf16 paper D=128 Dp=128 b=128",  # G = 16: one token per warp
        "kl fp16 anchor D=128 Dp=128 b=128",  # G = 4: four tokens per warp
        "kl bf16 anchor D=64 Dp=64 b=64",
    ):
        res = compile_kl(*cfgs[name])
        assert res["stack"] == 0 and res["local"] == 0, (name, res)  # spills show up as stack
        assert res["wgmma"] and res["tma"], (name, res)


def test_limits_and_shared_memory():
    from cutlass import BFloat16, Float16, Float32

    from flash_msa.cubin import SHARED_LIMIT
    from flash_msa.cute import fwd_kl_sm90 as f

    ok = f.FwdKlSm90.can_implement
    assert f.FwdKlSm90.warpgroups == 2
    # anchor, paper, G = 1, 2, 8 (each selection head's heads inside one KV head)
    for H, Hkv, Hs, Hpk in (
        (16, 2, 4, 1),
        (64, 4, 4, 1),
        (4, 4, 4, 2),
        (8, 2, 4, 2),
        (32, 4, 4, 1),
    ):
        assert ok(BFloat16, H, Hkv, Hs, 128, 16, 128, 2, True, 128, Hpk) is None, (H, Hkv, Hs)
    assert ok(Float16, 16, 2, 4, 64, 16, 64, 3, True, 64, 1) is None
    assert "bf16 or fp16" in ok(Float32, 16, 2, 4, 128, 16, 128)
    assert "D and Dp" in ok(BFloat16, 16, 2, 4, 96, 16, 128)
    assert "D and Dp" in ok(BFloat16, 16, 2, 4, 128, 16, 128, 2, True, 32)
    assert "block_size" in ok(BFloat16, 16, 2, 4, 128, 16, 32)
    assert "warpgroups" in ok(BFloat16, 16, 2, 4, 128, 16, 128, 4)
    assert "proxy" in ok(BFloat16, 16, 2, 4, 128, 16, 128, 2, False)
    assert "top_k" in ok(BFloat16, 16, 2, 4, 128, 0, 128)
    assert "power of two" in ok(BFloat16, 128, 4, 4, 128, 16, 128)  # G = 32
    assert "power of two" in ok(BFloat16, 12, 4, 4, 128, 16, 128)  # G = 3
    assert "share one KV head" in ok(BFloat16, 16, 8, 4, 128, 16, 128)  # 2 heads per KV head
    assert "proxy key heads" in ok(BFloat16, 16, 2, 4, 128, 16, 128, 2, True, 128, 3)
    # D = Dp = 128, block 128: 4 Q buffers (64 KiB), K and k_proxy (64 KiB), 2 log2 p' tiles
    # (64 KiB) and the barriers; 3 warpgroups do not fit
    sizes = f.FwdKlSm90.kl_shared_bytes(2, 128, 128, 128, 2)
    assert sizes["total"] == 197632 <= SHARED_LIMIT
    assert "shared memory" in ok(BFloat16, 16, 2, 4, 128, 16, 128, 3)
    with pytest.raises(ValueError, match="CuTe KL stage"):
        f.FwdKlSm90(BFloat16, 16, 8, 4, 128, 16, 128)
    with pytest.raises(ValueError, match="query map"):
        f.FwdKlSm90(BFloat16, 16, 2, 4, 128, 16, 128, qmap=True)


def _inputs(dtype=torch.bfloat16, H=16, Hkv=2, Hs=4, D=128, Dp=128, T=8):
    from flash_msa.problem import Config

    q = torch.zeros((T, H, D), dtype=dtype)
    k = torch.zeros((T, Hkv, D), dtype=dtype)
    qp = torch.zeros((T, Hs, Dp), dtype=dtype)
    kp = torch.zeros((T, 1, Dp), dtype=dtype)
    idx = torch.zeros((T, Hs, 16), dtype=torch.int32)
    cfg = Config(
        block_size=128, softmax_scale=D**-0.5, max_seqlen=T, proxy_scale=Dp**-0.5,
        top_k=16, compute_kl=True,
    )  # fmt: skip
    return q, k, qp, kp, idx, cfg


def test_kl_fits():
    import dataclasses

    from flash_msa.cute.forward import kl_fits

    q, k, qp, kp, idx, cfg = _inputs()
    assert kl_fits(q, k, qp, kp, idx, cfg)
    assert kl_fits(*_inputs(H=64, Hkv=4)[:5], cfg)  # paper
    assert not kl_fits(q, k, None, None, idx, cfg)
    assert not kl_fits(q, k, qp, kp, idx, dataclasses.replace(cfg, compute_kl=False))
    assert not kl_fits(q, k, qp.float(), kp, idx, cfg)  # the proxy in another dtype
    assert not kl_fits(*_inputs(dtype=torch.float32)[:5], cfg)
    assert not kl_fits(*_inputs(H=16, Hkv=8)[:5], cfg)  # a group over two KV heads


def test_host_refusals_name_the_argument():
    from flash_msa.cute.forward import kl

    q, k, qp, kp, _, cfg = _inputs()
    T, H, Hs = q.shape[0], q.shape[1], qp.shape[1]
    wl = types.SimpleNamespace(q_map=None, slots=16)  # (read before any launch)
    lse, plse = torch.zeros((T, H)), torch.zeros((T, Hs))
    with pytest.raises(ValueError, match="unit"):
        kl(q, k, qp, kp, lse, plse, wl, cfg, (torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="lse must be fp32"):
        kl(q, k, qp, kp, lse.double(), plse, wl, cfg)
    with pytest.raises(ValueError, match="proxy_lse must be fp32"):
        kl(q, k, qp, kp, lse, plse[:, :2], wl, cfg)


pytest.importorskip("cutlass")


class _Traced(Exception):
    pass


def _kernel_layouts(monkeypatch, D, Dp, block=128):
    """The (sQ, sQp) layouts ``FwdKlSm90.__call__`` passes to ``kl_kernel`` (anchor heads)."""
    import cutlass.cute as cute

    from flash_msa.cute import compile_check
    from flash_msa.cute import fwd_kl_sm90 as f

    seen = {}

    class Probe(f.FwdKlSm90):
        def kl_kernel(self, *args):  # the launch: record the layouts, stop the trace
            sQ_layout, sQp_layout = args[14][:2]
            seen["q"] = (sQ_layout.outer.shape, sQ_layout.outer.stride, cute.cosize(sQ_layout))
            seen["qp"] = (sQp_layout.outer.shape, sQp_layout.outer.stride, cute.cosize(sQp_layout))
            raise _Traced

    monkeypatch.setattr(compile_check, "FwdKlSm90", Probe)
    with pytest.raises(Exception) as info:
        compile_check.compile_kl("bf16", 16, 2, 4, 1, D, Dp, 16, block)
    assert "q" in seen, info.value  # (the trace reached the launch)
    return seen["q"], seen["qp"]


def _buffers(layout, dim, nbuf):
    """Element ranges ``[start, end)`` of Q buffers ``0 .. nbuf - 1`` in a
    ``((8,8),(64,n),(1,stages))`` 128B-swizzled tile view (the swizzle permutes inside a
    buffer's 64 x dim elements); buffer ``b`` is stage ``b * stages / nbuf``."""
    shape, stride, _ = layout
    stages, step = shape[2][1], stride[2][1]
    r = stages // nbuf
    return [(b * r * step, b * r * step + 64 * dim) for b in range(nbuf)]


def _overlaps(D, Dp, q, qp, nbuf=4):
    qb, qpb = _buffers(q, D, nbuf), _buffers(qp, Dp, nbuf)
    return [
        (i, j)
        for i, (s0, e0) in enumerate(qb)
        for j, (s1, e1) in enumerate(qpb)
        if i != j and s0 < e1 and s1 < e0
    ]


def test_kl_q_buffers_of_equal_dims_do_not_overlap(monkeypatch):
    q, qp = _kernel_layouts(monkeypatch, 128, 128)
    assert _overlaps(128, 128, q, qp) == []


@pytest.mark.parametrize("D, Dp", [(64, 128), (128, 64)])
def test_kl_mode_refuses_unequal_q_and_proxy_dims(D, Dp):
    """The overlap the views would have with D != Dp (buffer strides 64 x D and 64 x Dp) is
    avoided by refusing those layouts: ``kl_fits`` is false, so Triton's KL stage runs them."""
    from cutlass import BFloat16

    from flash_msa.cute.fwd_kl_sm90 import FwdKlSm90

    why = FwdKlSm90.can_implement(BFloat16, 16, 2, 4, D, 16, 128, proxy_head_dim=Dp)
    assert why is not None and "D == Dp" in why
