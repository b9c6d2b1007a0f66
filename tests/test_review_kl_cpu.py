"""Review of ``FwdKlSm90`` (flash_msa/cute/fwd_partials_sm90.py, the KL mode of the forward
partials kernel) before its first GPU run: a CPU demonstration of a shared-memory overlap.

The KL mode's q and q_proxy gathers are one double-buffered stream per warpgroup over one Q
region, read through two views, ``sQ`` (stages of ``64 x D``) and ``sQp`` (stages of ``64 x
Dp``), both indexed by the same buffer number ``qb = 2 wg + s % 2``. Each view's stage stride
is its own tile size, so when D != Dp buffer ``b`` of one view overlaps other buffers of the
other view: a warpgroup's next gather lands on the tile its current MMA reads (D = 64, Dp =
128: step 0's q_proxy tile, buffer 0 = elements [0, 8192), is overwritten by step 1's q rows
in sQ buffer 1 = [4096, 8192)), and across warpgroups (warpgroup 0's q_proxy buffer 1 = sQ
buffers 2 and 3, warpgroup 1's). The forward partials' own proxy part does not have this
problem: it runs after a CTA barrier, with only the sQp view in use. Fixed by refusing D != Dp
(``FwdKlSm90.can_implement``; the forward then borrows Triton's KL stage).

The test traces the host (``__call__``, as ``compile_check.compile_kl`` does) up to the kernel
launch and reads the layouts it hands the kernel. It asserts the invariant the kernel relies on
(different buffer numbers never share bytes, whichever view each is read through), so a fix
that keeps one buffer stride for both views (``64 * max(D, Dp)`` elements) makes it pass, and so
does one that builds the smaller view with ``r = max(D, Dp) / dim`` times the stages and reads
buffer ``qb`` at stage ``r * qb`` (the test takes a view with ``r * 2 * warpgroups`` stages to
mean that). CPU time: ~1 s (traces only, no compile)."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")


class _Traced(Exception):
    pass


def _kernel_layouts(monkeypatch, D, Dp, block=128):
    """The (sQ, sQp) layouts ``FwdKlSm90.__call__`` passes to ``kl_kernel`` (anchor heads)."""
    import cutlass.cute as cute

    from flash_msa.cute import compile_check
    from flash_msa.cute import fwd_partials_sm90 as f

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


def test_equal_dims_share_buffers_one_to_one(monkeypatch):
    q, qp = _kernel_layouts(monkeypatch, 128, 128)
    assert _overlaps(128, 128, q, qp) == []


@pytest.mark.parametrize("D, Dp", [(64, 128), (128, 64)])
def test_unequal_dims_are_refused(D, Dp):
    """The overlap the views would have with D != Dp (buffer strides 64 x D and 64 x Dp) is
    avoided by refusing those layouts: ``kl_fits`` is false, so Triton's KL stage runs them."""
    from cutlass import BFloat16

    from flash_msa.cute.fwd_partials_sm90 import FwdKlSm90

    why = FwdKlSm90.can_implement(BFloat16, 16, 2, 4, D, 16, 128, proxy_head_dim=Dp)
    assert why is not None and "D == Dp" in why
