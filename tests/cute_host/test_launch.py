"""CPU tests of the CuTe kernels' host code that need no GPU: the backward's deterministic glue
(token chunks, work-item ranges, partial layouts, the fixed-order sums of ``flash_msa.ordered``
under the Triton interpreter) with the kernel replaced by a stand-in that writes what the
kernel's indexing says it writes; the pointer launches of the selection, the forward partials,
the KL mode and the backward (``launch.pointer_arguments``: the views in the kernel object).

CPU tests of the pointer launches (``launch.pointer_arguments``, ``view_layout``, ``bound``,
each kernel's ``views`` field and ``launch_arguments``). No compile:
only the host code that builds a launch's kernel object and arguments runs, on CPU stand-ins.

Guards (pass): the layout cache never serves one layout's view for another; each launch's scalars
reach its ``__call__`` parameter of the same name; a mode-0 size of 2**31 or more is refused (it
wrapped silently to a negative ``Int32``); a gapped view (a fused-QKV projection's ``q``) is a
ValueError naming the tensor (it was the DSL's RuntimeError); ``view_layout`` reads its cache once
(a check-then-read was not safe against a concurrent ``clear``). (CPU time about 1 s in all, most of
it the first import.)
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from cutlass import BFloat16  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402

from flash_msa import ordered, reference, testing
from flash_msa.cute import (  # noqa: E402
    backward, common, compile_check, forward, fwd_kl_sm90, fwd_partials_sm90, launch, select_sm90,
    selection, worklist_host,
)
from flash_msa.cute.backward import kernel_for  # noqa: E402
from harness import config, packed_inputs


def _stand_in(H, Hs, K, block, written):
    """A ``launch(wl, outs, tok0, w0, w1)`` for ``backward._ordered`` writing, for every entry
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
    """``backward._ordered`` with the stand-in kernel: dq[t, h] and dq_proxy[t, p] are the
    count of (t, p)'s valid slots, each key's dK / dV / dK_proxy the number of items (over the
    selection heads of its key head) that hold its block, times 1 / 2 / 3; partial buffers
    NaN-poisoned, through several token chunks and item ranges (small budget) and in one."""
    pytest.importorskip("cutlass")
    from flash_msa.cute import backward

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
    dq, dk, dv, dqp, dkp = backward._ordered(launch, q, k, qp, kp, idx, cu, cfg, True, True)

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


# ---------------------------------------------------------------------------------------------
# pointer launches (launch.pointer_arguments): the selection, the forward partials, the KL
# mode and the backward take typed pointers and mode-0 sizes; the rest of each tensor's view
# is in the kernel object (its ``views`` field)
# ---------------------------------------------------------------------------------------------
def _specimens():
    """``(module, kernel, tensors, launch)`` per pointer-launched kernel class: the anchor
    layout's kernel (unbound), CPU stand-ins of its launch tensors and a ``launch(kernel,
    tensors)`` returning ``launch_arguments``' ``(kernel', args)``."""
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_fake_stream

    from flash_msa.cute import backward, compile_check, forward, select_sm90, selection
    from flash_msa.cute.backward import kernel_for
    from flash_msa.cute.fwd_kl_sm90 import FwdKlSm90
    from flash_msa.cute.fwd_partials_sm90 import FwdPartialsSm90

    s = make_fake_stream()
    out = []
    for kernel in (
        select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128),
        select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128, qmap=True),
    ):
        out.append((selection, kernel, lambda k, t: selection.select_arguments(k, t, 1, s)))
    fwd = FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128, proxy=True, qmap=True)
    out.append((forward, fwd, lambda k, t: forward.partials_arguments(k, t, (1.0, 0, 1, 1.0), s)))
    kl = FwdKlSm90(BFloat16, 16, 2, 4, 128, 16, 128, 2, True, 128, 1)
    out.append((forward, kl, lambda k, t: forward.kl_arguments(k, t, (1.0, 1.0, 1), s)))
    for kernel in (
        kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128),
        kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128, qmap=True, ws=False),
    ):
        launcher = lambda k, t: backward.bwd_arguments(k, t, (1.0,) * 4, 1, 0, s)  # noqa: E731
        out.append((backward, kernel, launcher))
    return [(m, k, compile_check.specimens(k), f) for m, k, f in out]


def _layout_text(shape, stride) -> str:
    """The DSL's text of a layout with a run-time mode-0 size and static strides."""
    return "({}):({})".format(",".join(["?", *map(str, shape[1:])]), ",".join(map(str, stride)))


def test_cute_pointer_launch_views_are_the_dlpack_views():
    """Each pointer launch's kernel object carries, per tensor, exactly what the tensor's
    DLPack view (``launch.cute_tensor``, the launches' arguments before) baked into the
    compiled code: its element type and static sizes and strides, mode 0's size run-time;
    its arguments are a pointer per tensor (the view's element type, global memory, 16-byte
    alignment) and the mode-0 sizes; the bound object is kept (one per layout) and has a
    disk-cache text. (CPU time about 1 s.)"""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from flash_msa.cute import disk_cache
    from flash_msa.cute.common import ALIGN
    from flash_msa.cute.launch import cute_tensor, view_signature

    for module, kernel, tensors, launcher in _specimens():
        bound, args = launcher(kernel, tensors)
        assert type(bound) is type(kernel) and bound != kernel, module.__name__
        assert bound == dataclasses.replace(kernel, views=bound.views)
        for t, (dtype, shape, stride) in zip(tensors, bound.views):
            view = cute_tensor(t)
            assert dtype is view_signature(view)[1] and shape == (None, *t.shape[1:])
            # the layout the view gave the compiled code: static strides (a size-1 mode's 0)
            assert view.__cache_key__[2].endswith(_layout_text(shape, stride)), module.__name__
            assert stride == tuple(0 if n == 1 else d for n, d in zip(t.shape, t.stride()))
        pointers, sizes = args[0]
        assert [int(n) for n in sizes] == [t.shape[0] for t in tensors]
        for p, view in zip(pointers, bound.views):
            assert p.__cache_key__ == (view[0], cute.AddressSpace.gmem, ALIGN)
        again, _ = launcher(kernel, tensors)
        assert again is bound  # (kept: no dataclasses.replace per launch)
        assert disk_cache.stable_text(bound) != disk_cache.stable_text(kernel)


def test_launch_signatures_name_their_builders():
    """Every host module's ``<OP>_SIGNATURE`` (the disk-cache key's stand-in for a launch's
    argument layout, passed to ``run_typed``) is ``launch.builder_signature`` of its builder
    ``<op>_arguments``: the builder's name and a hash of its module's source."""
    seen = []
    for module in (selection, forward, backward, worklist_host):
        for attr in dir(module):
            if attr.endswith("_SIGNATURE"):
                builder = getattr(module, attr[: -len("_SIGNATURE")].lower() + "_arguments")
                assert getattr(module, attr) == launch.builder_signature(builder), attr
                assert getattr(module, attr).startswith(f"{module.__name__}.{builder.__name__}:")
                seen.append(attr)
    assert len(seen) == 8, seen  # select, quantize, partials, kl, combine, bwd, row delta, work list


def test_cute_pointer_launch_layouts_make_different_kernels():
    """Two launches that differ only in a layout property the compiled code bakes in (the
    strides of the heads' and the head dim's modes; a static size, as of a part not made's
    stand-in buffer) build different kernel objects, so they never share a compiled function,
    in process or on disk, and two torch layouts of one view share one; a
    misaligned base, a layout whose view has a run-time stride (its mode 0 is not outermost),
    a tensor on another device and a wrong tensor count are ValueErrors naming the tensor.
    (CPU time about 1 s.)"""
    pytest.importorskip("cutlass")
    from flash_msa.cute import disk_cache
    from flash_msa.cute.launch import cute_tensor

    for module, kernel, tensors, launcher in _specimens():
        base, _ = launcher(kernel, tensors)
        names = module.launch_tensor_names(kernel)
        assert len(names) == len(tensors) == kernel.tensor_count, module.__name__
        k = names.index("k_proxy")
        T, dim, heads = tensors[k].shape
        assert heads == 1  # (the specimens' proxy key heads, Hpk = 1)
        # torch strides the view does not have (a size-1 mode's stride is 0 in the view):
        # the same view, so the same kernel object
        odd = torch.zeros(T, dim, dtype=tensors[k].dtype).as_strided((T, dim, 1), (dim, 1, 1))
        same, _ = launcher(kernel, tensors[:k] + (odd,) + tensors[k + 1 :])
        assert same is base, module.__name__
        # the first (T, dim, heads) view of keys (or queries) with heads > 1, laid out
        # head-minor ((T, dim, heads) contiguous) instead of (T, heads, dim) permuted: the
        # strides differ, so the kernel objects and their disk-cache texts do
        i = next(i for i, t in enumerate(tensors) if t.dim() == 3 and t.shape[2] > 1)
        minor = torch.zeros(tensors[i].shape, dtype=tensors[i].dtype)
        other, _ = launcher(kernel, tensors[:i] + (minor,) + tensors[i + 1 :])
        assert other.views[i][2] != base.views[i][2] and other != base, module.__name__
        assert disk_cache.stable_text(other) != disk_cache.stable_text(base)
        # a static size: a buffer of twice the width (the backward's stand-in of a part not
        # made is (1, 64) fp32 where the real buffer is (T*H, D))
        j = max(i for i, t in enumerate(tensors) if t.dim() > 1)
        t = tensors[j]
        wider = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        other, _ = launcher(kernel, tensors[:j] + (wider,) + tensors[j + 1 :])
        assert other.views[j][1] != base.views[j][1] and other != base, (module.__name__, j)
        with pytest.raises(ValueError, match=f"{names[0]}'s base is not 16-byte aligned"):
            launcher(kernel, (torch.zeros(64, dtype=tensors[0].dtype)[1:],) + tensors[1:])
        moved = tensors[0].transpose(0, 1).contiguous().transpose(0, 1)  # mode 0 not outermost
        assert "?{" in cute_tensor(moved).__cache_key__[2]  # (a run-time stride in the view)
        with pytest.raises(ValueError, match="no static view"):
            launcher(kernel, (moved,) + tensors[1:])
        with pytest.raises(ValueError, match="expected"):
            launcher(kernel, tensors[:-1])


def test_run_typed_builds_typed_arguments_for_the_compile_only(monkeypatch):
    """``launch.run_typed`` with the call's values (``ffi``) and a function making the typed
    arguments: the function runs once, for the compile (its stream as a ``cuda.CUstream``),
    every launch gets the values as given; a function without the values is refused."""
    pytest.importorskip("cutlass")
    import cuda.bindings.driver as cuda
    import torch

    from flash_msa.cute import disk_cache, worklist_host, worklist_sm90

    compiled, calls, built = [], [], []
    monkeypatch.setattr(
        disk_cache, "compiled",
        lambda kernel, args, sig, target, options: compiled.append((args, options))
        or (lambda *a: calls.append(a)),
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "_compiled", {})
    kernel, dev = worklist_sm90.ListBoundsSm90(threads=128), torch.device("cuda", 0)
    values = (1 << 20, 2 << 20, 5, 3, launch.RawStream(7))

    def typed():
        built.append(1)
        return worklist_host.worklist_arguments(kernel, *values)

    for _ in range(3):
        launch.run_typed(kernel, dev, typed, "sig", values)
    assert len(built) == 1 and len(compiled) == 1 and calls == [values] * 3
    args, options = compiled[0]
    assert options == launch.FFI_OPTIONS and isinstance(args[-1], cuda.CUstream)
    assert launch.ffi_args(worklist_host.worklist_arguments(kernel, *values)) == values
    with pytest.raises(TypeError, match="ffi"):
        launch.run_typed(kernel, dev, typed, "sig")


pytest.importorskip("cutlass")


def _layouts():
    """Tensors whose cache keys (dtype, inner sizes, strides) repeat with other mode-0 sizes
    (1, 7 rows) and whose views differ from each other (heads 1 / 2, a size-1 mode with the
    strides torch gives it in several ways, a run-time stride)."""
    out = []
    bf = dict(dtype=torch.bfloat16)
    for T in (7, 1):  # (0 rows: no launch runs; some of these views raise in the DSL then)
        out += [
            torch.zeros(T, 4, 128, **bf),
            torch.zeros(T, 2, 128, **bf).permute(0, 2, 1),  # keys (T, D, Hkv)
            torch.zeros(T, 1, 128, **bf).permute(0, 2, 1),  # Hpk = 1: stride 0 in the view
            torch.zeros(T, 128, **bf).as_strided((T, 128, 1), (128, 1, 1)),
            torch.zeros(T, 4, 16, dtype=torch.int32),
            torch.zeros(T, dtype=torch.int64),
            torch.zeros(T, 1),
        ]
    return out + [torch.zeros(4, 7, 128, **bf).transpose(0, 1)]  # mode 0 not outermost: None


def test_view_layout_cache_never_serves_another_layout(monkeypatch):
    """``view_layout`` is kept per (dtype, inner sizes, strides, device type), not per mode-0
    size: whatever order layouts are first seen in (1 or 7 rows first), each tensor gets
    the view a fresh cache gives it, and two tensors get one kernel object from ``bound``
    exactly when their views are equal (so no compiled function serves another layout)."""
    tensors = _layouts()
    fresh = []
    for t in tensors:
        monkeypatch.setattr(launch, "_VIEW_LAYOUTS", {})
        fresh.append(launch.view_layout(t))
    for order in (tensors, tensors[::-1]):
        monkeypatch.setattr(launch, "_VIEW_LAYOUTS", {})
        got = {id(t): launch.view_layout(t) for t in order}
        assert [got[id(t)] for t in tensors] == fresh
    kernel = select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128)
    for a in fresh:
        for b in fresh:
            same = launch.bound(kernel, (a,)) is launch.bound(kernel, (b,))
            assert same == (a == b)


def _launch_cases():
    """``(module, kernel, launch(values) -> args, {__call__ parameter: value})`` per
    pointer-launched class, each scalar a distinct value so that a swap of two same-typed ones
    shows."""
    s = make_fake_stream()
    fwd = fwd_partials_sm90.FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128, proxy=True, qmap=True)
    kl = fwd_kl_sm90.FwdKlSm90(BFloat16, 16, 2, 4, 128, 16, 128, 2, True, 128, 1)
    bwd = kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128)
    sel = select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128, qmap=True)
    return [
        (forward, fwd, lambda k, t: forward.partials_arguments(k, t, (1.5, 7, 9, 2.5), s),
         dict(scale_log2=1.5, tok0=7, NB=9, pscale_log2=2.5)),
        (forward, kl, lambda k, t: forward.kl_arguments(k, t, (1.5, 2.5, 9), s),
         dict(scale_log2=1.5, pscale_log2=2.5, NB=9)),
        (backward, bwd, lambda k, t: backward.bwd_arguments(k, t, (0.5, 1.5, 2.5, 3.5), 9, 7, s),
         dict(scale=0.5, scale_log2=1.5, pscale_log2=2.5, pcoef=3.5, NB=9, tok0=7)),
        (selection, sel, lambda k, t: selection.select_arguments(k, t, 5, s),
         dict(n_mblk=5)),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(4), ids=["fwd", "kl", "bwd", "select"])
def test_launch_arguments_follow_call_signature(case):
    """Each ``launch_arguments`` returns ``__call__``'s arguments in its order: the pointers
    (``PointerTensors``, one per tensor name), then each scalar under its parameter's name with
    its annotated type, the stream where ``stream`` stands."""
    module, kernel, launch, want = _launch_cases()[case]
    tensors = compile_check.specimens(kernel)
    bound, args = launch(kernel, tensors)
    params = list(inspect.signature(type(kernel).__call__).parameters.values())[1:]
    assert len(args) == len(params)
    assert isinstance(args[0], common.PointerTensors) and params[0].name == "tensors"
    assert len(args[0].pointers) == len(module.launch_tensor_names(kernel)) == len(bound.views)
    for p, a in zip(params[1:], args[1:]):
        if p.name == "stream":
            continue
        assert type(a).__name__ == str(p.annotation).rsplit(".", 1)[-1], p.name
        assert a.value == pytest.approx(want.pop(p.name)), p.name
    assert not want  # every scalar found


def test_sizes_past_int32_are_refused():
    """A (2**31 + 16,) tensor (int8: 2 GiB of untouched virtual memory) must be refused or get
    its true size; today its size reaches the kernel as Int32(-2147483632)."""
    t = torch.empty((2**31 + 16,), dtype=torch.int8)
    try:
        _, ptrs = launch.pointer_arguments("probe", ("perm",), (t,), t.device)
    except ValueError:
        return
    assert int(ptrs.sizes[0]) == t.shape[0]


def test_gapped_view_is_a_value_error_naming_the_tensor():
    """``qkv.view(T, 3, H, D).unbind(1)[0]``: strides (3 H D, D, 1). Refused with a ValueError
    naming it, or run from its static strides: both fine. (The RuntimeError is turned into a
    message here: pytest's traceback would repr the DSL's half-made view, and that repr
    segfaults, nvidia-cutlass-dsl here.)"""
    kernel = select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128)
    tensors = compile_check.specimens(kernel, tokens=8)
    q = torch.zeros(8, 3 * 4 * 128, dtype=torch.bfloat16).view(8, 3, 4, 128).unbind(1)[0]
    error = None
    try:
        selection.select_arguments(kernel, (q.permute(0, 2, 1),) + tensors[1:], 1, None)
    except ValueError as e:
        assert "q_proxy" in str(e)
    except RuntimeError as e:
        error = f"RuntimeError: {e}"
    assert error is None, error


class _ClearedByAnotherThread(dict):
    """A layout cache that another thread clears (its 4097th layout) between this thread's
    ``key in cache`` and ``cache[key]``."""

    def __contains__(self, key):
        found = dict.__contains__(self, key)
        self.clear()
        return found


def test_view_layout_survives_a_concurrent_clear(monkeypatch):
    t = torch.zeros(4, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(launch, "_VIEW_LAYOUTS", {})
    want = launch.view_layout(t)
    monkeypatch.setattr(launch, "_VIEW_LAYOUTS", _ClearedByAnotherThread(launch._VIEW_LAYOUTS))
    assert launch.view_layout(t) == want
