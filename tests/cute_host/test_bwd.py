"""CPU tests of four host-side parts of the training step, each exact:

- the CuTe backward's five fp32 accumulators are views of one zero-filled buffer (one fill
  launch instead of five), each 16-byte aligned, separate where a view would not be;
- the proxy gradients' ``dkl`` scale is stored straight into the input dtype (one op
  instead of a multiply and a cast), bit for bit the old expression;
- ``launch.pointer_arguments`` keeps its result per exact launch: the same objects for the
  same tensors, a fresh result for any change, and the same ValueErrors for bad tensors;
- ``problem.problem_of`` asks a device's capability once.

The backward's host code runs whole on CPU stand-ins with the kernel launch replaced by a
writer of known values (no compile: ``launch_items`` and ``run_typed`` stand in).

CPU checks of the warp-specialized backward's teacher in registers (``BwdWsSm90`` at G2 = 4;
its numerics are tested on the GPU: tests/ops/test_bwd.py, bitwise against BwdSm90's slab
update where the reductions commute, and by the rule everywhere): the anchor kernel compiles for
sm_90a without spills, its ``setmaxnreg`` kept, and its teacher is the register one (8
butterfly shuffles per stage, where BwdSm90's slab update at the same layout has 16: one per
column pair). CPU time on the 2-core machine: ~5 s in pytest (the two compiles).
"""

from __future__ import annotations

import collections

import pytest
import torch
from cutlass import BFloat16  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402

from flash_msa import problem, reference  # noqa: E402
from flash_msa.cute import backward, common, compile_check, launch  # noqa: E402
from flash_msa.problem import Saved  # noqa: E402
from harness import config, incoming, packed_inputs  # noqa: E402

pytest.importorskip("cutlass")


# ---------------------------------------------------------------------------------------------
# pointer_arguments kept per exact launch
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_pointers(monkeypatch):
    """An empty pointer cache for the test (the module's own is left as it was)."""
    monkeypatch.setattr(launch, "_POINTERS", collections.OrderedDict())
    return launch._POINTERS


def _bwd_specimens(tokens=8):
    kernel = backward.kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128)
    return backward.launch_tensor_names(kernel), compile_check.specimens(kernel, tokens)


def _described(result):
    """What a launch receives of a ``pointer_arguments`` result, as plain values."""
    views, pt = result
    ptrs = [(p._pointer, p.dtype, p.memspace, p._assumed_align) for p in pt.pointers]
    return views, ptrs, [int(s) for s in pt.sizes]


def test_launch_tensors_are_the_kernels():
    """``backward.LAUNCH_TENSORS`` (+ the map of a ``qmap`` kernel) are the tensors
    ``BwdSm90.__call__`` rebuilds (its ``TENSORS`` count), the compile check's specimens too."""
    for qmap in (False, True):
        kernel = backward.kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, qmap=qmap)
        names = backward.launch_tensor_names(kernel)
        assert len(names) == kernel.tensor_count == len(compile_check.specimens(kernel))
        assert names[: len(backward.LAUNCH_TENSORS)] == backward.LAUNCH_TENSORS
        assert names[-1] == ("q_map" if qmap else "dk_proxy")


def test_launch_cache_hit_equals_a_fresh_build(fresh_pointers):
    """The same tensors (and new tensor objects over the same memory) get the identical
    objects back, which describe what a call with an empty cache makes."""
    names, ts = _bwd_specimens()
    first = launch.pointer_arguments("CuTe backward", names, ts, ts[0].device)
    again = launch.pointer_arguments("CuTe backward", names, ts, ts[0].device)
    assert again is first
    views = tuple(t.view(t.shape) for t in ts)  # new tensor objects, same memory and layout
    assert launch.pointer_arguments("CuTe backward", names, views, ts[0].device) is first
    fresh_pointers.clear()
    fresh = launch.pointer_arguments("CuTe backward", names, ts, ts[0].device)
    assert fresh is not first and _described(fresh) == _described(first)


def test_launch_cache_misses_on_any_changed_tensor_field(fresh_pointers):
    """One field of one tensor changed, the rest of the launch the same (another address; the
    same address with another row count, stride or dtype), or another module: a new result,
    the one an empty cache gives (mode-0 size, pointer, view), unlike the first."""
    names, ts = _bwd_specimens()
    dev = ts[0].device
    q, k = ts[0], ts[2]  # (T H, D) rows; (T, D, Hkv) keys: a permuted view
    rows = torch.zeros(q.shape[0] + 1, q.shape[1], dtype=q.dtype)
    keys = torch.zeros(k.shape[0], k.shape[2], k.shape[1], dtype=k.dtype)
    base = (rows[:-1], ts[1], keys.permute(0, 2, 1), *ts[3:])
    first = launch.pointer_arguments("CuTe backward", names, base, dev)
    changes = {
        "address": (0, torch.zeros_like(q)),
        "rows": (0, rows),
        "stride": (2, keys.view(k.shape)),  # the same shape over the same memory
        "dtype": (0, rows[:-1].view(torch.float16)),
    }
    for what, (i, t) in changes.items():
        assert t.data_ptr() == base[i].data_ptr() or what == "address"
        tensors = base[:i] + (t,) + base[i + 1 :]
        got = launch.pointer_arguments("CuTe backward", names, tensors, dev)
        assert got is not first, what
        want = _described(got)
        fresh_pointers.clear()
        assert _described(launch.pointer_arguments("CuTe backward", names, tensors, dev)) == want
        assert want != _described(first), what
        assert launch.pointer_arguments("CuTe backward", names, base, dev) is not first
        first = launch.pointer_arguments("CuTe backward", names, base, dev)
    other = launch.pointer_arguments("CuTe selection", names, base, dev)
    assert other is not first and _described(other) == _described(first)


def test_launch_cache_keeps_the_refusals(fresh_pointers):
    """Misaligned, wrong-device, non-compact and too-long tensors raise the ValueErrors they
    raised before, also after the well-formed launch they come from was kept."""
    names, ts = _bwd_specimens()
    dev = ts[0].device
    launch.pointer_arguments("CuTe backward", names, ts, dev)  # kept
    buf = torch.zeros(ts[0].numel() + 8, dtype=ts[0].dtype)
    bad = {
        "not 16-byte aligned": buf[1 : 1 + ts[0].numel()].view(ts[0].shape),
        "is on meta, not cpu": torch.zeros(ts[0].shape, dtype=ts[0].dtype, device="meta"),
        "has no static view": torch.zeros(ts[0].shape[1], ts[0].shape[0], dtype=ts[0].dtype).t(),
    }
    for _ in range(2):  # (the second time: nothing kept makes them pass)
        for text, t in bad.items():
            with pytest.raises(ValueError, match=text) as err:
                launch.pointer_arguments("CuTe backward", names, (t, *ts[1:]), dev)
            assert "CuTe backward: q" in str(err.value)
    with pytest.raises(ValueError, match="is on cpu, not meta"):  # the device argument
        launch.pointer_arguments("CuTe backward", names, ts, torch.device("meta"))
    long = torch.empty((2**31 + 16,), dtype=torch.int8)
    for _ in range(2):
        with pytest.raises(ValueError, match="more than 2"):
            launch.pointer_arguments("probe", ("perm",), (long,), long.device)
    assert len(fresh_pointers) == 1  # only the well-formed launch was kept


def test_launch_cache_is_bounded_least_recently_used(fresh_pointers, monkeypatch):
    """At most ``POINTER_CACHE_SIZE`` launches; a hit makes its launch the most recent."""
    monkeypatch.setattr(launch, "POINTER_CACHE_SIZE", 3)
    ts = [torch.zeros(4, 8, dtype=torch.bfloat16) for _ in range(5)]
    got = [launch.pointer_arguments("m", ("x",), (t,), t.device) for t in ts[:3]]
    assert launch.pointer_arguments("m", ("x",), (ts[0],), ts[0].device) is got[0]  # refreshed
    launch.pointer_arguments("m", ("x",), (ts[3],), ts[3].device)  # drops ts[1]'s
    assert len(fresh_pointers) == 3
    assert launch.pointer_arguments("m", ("x",), (ts[0],), ts[0].device) is got[0]
    assert launch.pointer_arguments("m", ("x",), (ts[1],), ts[1].device) is not got[1]


class _EvictedByAnotherThread(collections.OrderedDict):
    """A cache from which another thread drops the launch between its read and its refresh."""

    def move_to_end(self, key, last=True):
        self.pop(key, None)
        super().move_to_end(key, last)  # KeyError, as in the race


def test_launch_cache_survives_a_concurrent_eviction(monkeypatch):
    names, ts = _bwd_specimens()
    monkeypatch.setattr(launch, "_POINTERS", _EvictedByAnotherThread())
    first = launch.pointer_arguments("CuTe backward", names, ts, ts[0].device)
    assert launch.pointer_arguments("CuTe backward", names, ts, ts[0].device) is first


# ---------------------------------------------------------------------------------------------
# dkl scaled into the cast
# ---------------------------------------------------------------------------------------------


def _bits(x):
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_proxy_grad_scale_is_bitwise_multiply_then_cast(dtype):
    """``backward.scaled(g, dkl, dtype)`` and ``(g * dkl).to(dtype)`` have the same bits: fp32
    ``g`` over 60 decades (signed zeros, infinities, NaN, subnormal and overflowing results),
    ``dkl`` a 0-dim fp32 tensor as autograd hands it (``harness.incoming``) and edge weights;
    a contiguous result of ``g``'s shape."""
    gen = torch.Generator().manual_seed(3)
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 7e4, 3.4e38]
    for trial in range(40):
        g = torch.randn((37, 3, 64), generator=gen) * 10.0 ** (trial - 20)
        g.view(-1)[: len(specials)] = torch.tensor(specials)
        weights = [torch.randn((), generator=gen)] + [
            torch.tensor(w) for w in (0.0, -0.0, 1.0, 3e-8, 1e30, -2.5)
        ]
        for w in weights:
            old = (g * w).to(dtype)
            new = backward.scaled(g, w, dtype)
            assert new.dtype == dtype and new.shape == g.shape and new.is_contiguous()
            assert torch.equal(_bits(new), _bits(old)), (trial, float(w))


def test_proxy_grad_scale_keeps_the_dkl_graph():
    """A ``create_graph`` backward's ``dkl`` that needs a gradient: the same values, and the
    result carries the graph (``out=`` would refuse it)."""
    g = torch.randn(5, 2, 64)
    w = torch.tensor(0.75, requires_grad=True)
    new = backward.scaled(g, w, torch.bfloat16)
    assert new.requires_grad and torch.equal(_bits(new), _bits((g * w.detach()).bfloat16()))


# ---------------------------------------------------------------------------------------------
# one zero fill for the backward's accumulators
# ---------------------------------------------------------------------------------------------

_ODD = [(1, 1), (3, 5), (7, 2)]  # token counts (T, Tk): odd, to catch offsets that need them


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Dp", [64, 128])
def test_bwd_accumulators_are_aligned_views_of_one_zero_fill(D, Dp):
    """At every dim the kernel takes (``BwdSm90.can_implement``: D, Dp in {64, 128}) and odd
    token and head counts, one storage, every view 16-byte aligned, zero, of its shape,
    contiguous and apart from the others; the parts not made are ``None``."""
    for (T, Tk), (H, Hkv, Hs, Hpk) in zip(_ODD, [(1, 1, 1, 1), (3, 1, 3, 1), (16, 2, 4, 1)]):
        for main, proxy in ((True, True), (True, False), (False, True)):
            shapes = ((T, H, D), (Tk, Hkv, D), (Tk, Hkv, D)) if main else (None,) * 3
            shapes += ((T, Hs, Dp), (Tk, Hpk, Dp)) if proxy else (None,) * 2
            bufs = backward.zero_buffers(shapes, torch.device("cpu"))
            made = [b for b in bufs if b is not None]
            assert [b is None for b in bufs] == [s is None for s in shapes]
            assert len({b.untyped_storage().data_ptr() for b in made}) == 1
            spans = []
            for b, s in zip(bufs, shapes):
                if b is None:
                    continue
                assert b.shape == s and b.dtype == torch.float32 and b.is_contiguous()
                assert b.data_ptr() % common.ALIGN == 0 and not b.any()
                spans.append((b.data_ptr(), b.data_ptr() + 4 * b.numel()))
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_bwd_accumulators_are_separate_where_a_view_would_be_misaligned():
    """An offset that is not a multiple of 16 bytes (D = 3, an odd row count), or
    ``shared=False``: separate zero tensors, each its own storage."""
    for shapes, shared in ((((1, 1, 3), (2, 1, 3), None, None, None), True),
                           ((((4, 2, 64),) * 3 + (None, None)), False)):  # fmt: skip
        bufs = backward.zero_buffers(shapes, torch.device("cpu"), shared)
        assert [b is None for b in bufs] == [s is None for s in shapes]
        bufs = [b for b in bufs if b is not None]
        assert len({b.untyped_storage().data_ptr() for b in bufs}) == len(bufs)
        assert all(not b.any() and b.dtype == torch.float32 for b in bufs)


# ---------------------------------------------------------------------------------------------
# the backward's host code on CPU stand-ins (the three above together)
# ---------------------------------------------------------------------------------------------


def _backward_call(D, dtype):
    """``(dout, dkl, saved, cu, cfg)`` of one CPU backward call the CuTe kernel can take."""
    lengths, H, Hkv, Hs, Hpk, block, K = (300, 0, 170), 16, 2, 4, 1, 128, 2
    (qp, kp, q, k, v), cu = packed_inputs(
        lengths, H, Hkv, Hs, Hpk, D, D, dtype=dtype, device="cpu", seed=4
    )
    cfg = config(max(lengths), D, D, block, K)
    idx = reference.select(qp, kp, cu, cfg)
    T = q.shape[0]
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(q.shape, generator=gen).to(dtype)
    lse = torch.randn(T, H, generator=gen)
    plse = torch.randn(T, Hs, generator=gen)
    dout, dkl = incoming(q, Hs, 6)
    saved = Saved(q, k, v, out, lse, idx, qp, kp, plse, None)
    return dout, dkl, saved, cu, cfg


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("parts", ["both", "main", "proxy"])
def test_bwd_host_hands_the_kernel_zeroed_accumulators_and_scales_them(
    monkeypatch, fresh_pointers, D, dtype, parts
):
    """``backward.bwd`` (non-deterministic) with the launch replaced by a writer of known fp32
    values into its five accumulators (after the real ``launch_arguments`` built the pointer
    launch, which ``run_typed`` records): the accumulators it handed over were zero, 16-byte
    aligned and views of one storage; the gradients are, bit for bit, what the old host code
    made of those values (``g.to(dtype)``, ``(g * dkl).to(dtype)``), each in its own storage
    (the custom op refuses aliased outputs). A second call hits the pointer cache."""
    dout, dkl, saved, cu, cfg = _backward_call(D, dtype)
    dout = None if parts == "proxy" else dout
    dkl = None if parts == "main" else dkl
    launched, written = [], []
    real_launch_items = backward.launch_items
    monkeypatch.setattr(backward, "run_typed", lambda k, dev, args, sig: launched.append(args))
    monkeypatch.setattr(backward, "stream", lambda dev: make_fake_stream())
    gen = torch.Generator().manual_seed(7)

    def launch_items(kernel, inputs, scalars, wl, outs, *rest):
        real_launch_items(kernel, inputs, scalars, wl, outs, *rest)
        made = [x for x in outs if x is not None]
        assert len({x.untyped_storage().data_ptr() for x in made}) == 1
        assert all(x.data_ptr() % common.ALIGN == 0 and not x.any() for x in made)
        vals = [None if x is None else torch.randn(x.shape, generator=gen) * 1e3 for x in outs]
        for x, val in zip(outs, vals):
            if x is not None:
                x.copy_(val)
        written.append(vals)

    monkeypatch.setattr(backward, "launch_items", launch_items)
    grads = backward.bwd(dout, dkl, saved, cu, cfg)
    assert len(launched) == len(written) == 1
    likes = (saved.q, saved.k, saved.v, saved.q_proxy, saved.k_proxy)
    storages = set()
    for i, (g, val, like) in enumerate(zip(grads, written[0], likes)):
        if val is None:
            assert g is None
            continue
        val = val.view(like.shape)
        want = val.to(like.dtype) if i < 3 else (val * dkl).to(like.dtype)
        assert g.dtype == like.dtype and g.is_contiguous()
        assert torch.equal(_bits(g), _bits(want)), i
        storages.add(g.untyped_storage().data_ptr())
    assert len(storages) == sum(v is not None for v in written[0])
    kept = dict(fresh_pointers)
    backward.bwd(dout, dkl, saved, cu, cfg)  # the allocator may hand out other addresses here
    assert launched[1][0] is launched[0][0] or len(fresh_pointers) == len(kept) + 1


# ---------------------------------------------------------------------------------------------
# the capability asked once per device
# ---------------------------------------------------------------------------------------------


def test_device_capability_is_asked_once_per_device(monkeypatch):
    """Per device index one ``get_device_capability`` call; ``cuda`` without an index is the
    current device's; a patched function is asked afresh (and its answer never serves the
    real one); CPU asks nothing."""
    monkeypatch.setattr(problem, "_CAPABILITIES", {})
    asked = []

    def ask(index):
        asked.append(index)
        return (9, index)

    monkeypatch.setattr(torch.cuda, "get_device_capability", ask)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cfg = config(128, 64, 64, 64, 2)
    dims = (4, 2, 64, 2, 1, 64)

    def cap(device):
        return problem.problem_of(device, torch.bfloat16, dims, 1, False, cfg).capability

    assert [cap(d) for d in ("cuda:0", "cuda:1", "cuda:0", "cuda", torch.device("cuda", 1))] == [
        (9, 0), (9, 1), (9, 0), (9, 1), (9, 1)
    ]  # fmt: skip
    assert asked == [0, 1]
    assert cap("cpu") is None and asked == [0, 1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    assert cap("cuda:0") == (10, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", ask)
    assert cap("cuda:0") == (9, 0) and asked == [0, 1]


cutlass = pytest.importorskip("cutlass")

ANCHOR = "bf16", 16, 2, 4, 1, 128, 128, 16, 128  # dtype, H, Hkv, Hs, Hpk, D, Dp, K, block


def test_ws_backward_is_the_default_and_keeps_the_teacher_in_registers(tmp_path):
    from cutlass import BFloat16

    from flash_msa.cute.backward import kernel_for
    from flash_msa.cute.bwd_ws_sm90 import BwdWsSm90
    from flash_msa.cute.compile_check import compile_bwd

    assert type(kernel_for(BFloat16, *ANCHOR[1:])) is BwdWsSm90
    ptx = {}
    for name, variant in (("ws", None), ("v2", dict(ws=False))):
        res = compile_bwd(*ANCHOR, 1, 1, variant, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0, (name, res)
        ptx[name] = (tmp_path / f"{name}.ptx").read_text()
        if name == "ws":
            assert res["setmaxnreg_kept"], res
    # the teacher: the slab update's 16 shuffles (one per column pair) per stage are 8 in
    # registers (a lane pair splits the tokens; anchor R = 1: one flush per stage)
    assert ptx["v2"].count("shfl.sync.bfly") == 16
    assert ptx["ws"].count("shfl.sync.bfly") == 8
