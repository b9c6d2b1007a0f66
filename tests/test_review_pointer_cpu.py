"""CPU tests from the review of the pointer launches (commit 99acfb3: ``common.pointer_arguments``,
``view_layout``, ``bound``, each kernel's ``views`` field and ``launch_arguments``). No compile:
only the host code that builds a launch's kernel object and arguments runs, on CPU stand-ins.

Guards (pass): the layout cache never serves one layout's view for another; each launch's
scalars reach its ``__call__`` parameter of the same name. And the review's three findings,
fixed after it: a mode-0 size of 2**31 or more is refused (it wrapped silently to a negative
``Int32``); a gapped view (a fused-QKV projection's ``q``) is a ValueError naming the tensor
(it was the DSL's RuntimeError); ``view_layout`` reads its cache once (a check-then-read was
not safe against a concurrent ``clear``). (CPU time about 1 s in all, most of it the first
import.)"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("cutlass")

from cutlass import BFloat16  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402

from flash_msa.cute import bwd_sm90, common, compile_check, fwd_partials_sm90, select_sm90  # noqa: E402
from flash_msa.cute.backward import kernel_for  # noqa: E402


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
        monkeypatch.setattr(common, "_VIEW_LAYOUTS", {})
        fresh.append(common.view_layout(t))
    for order in (tensors, tensors[::-1]):
        monkeypatch.setattr(common, "_VIEW_LAYOUTS", {})
        got = {id(t): common.view_layout(t) for t in order}
        assert [got[id(t)] for t in tensors] == fresh
    kernel = select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128)
    for a in fresh:
        for b in fresh:
            same = common.bound(kernel, (a,)) is common.bound(kernel, (b,))
            assert same == (a == b)


def _launch_cases():
    """``(module, kernel, launch(values) -> args, {__call__ parameter: value})`` per
    pointer-launched class, each scalar a distinct value so that a swap of two same-typed ones
    shows."""
    s = make_fake_stream()
    fp = fwd_partials_sm90
    fwd = fp.FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128, proxy=True, qmap=True)
    kl = fp.FwdKlSm90(BFloat16, 16, 2, 4, 128, 16, 128, 2, True, 128, 1)
    bwd = kernel_for(BFloat16, 16, 2, 4, 1, 128, 128, 16, 128)
    sel = select_sm90.SelectSm90(BFloat16, 128, 4, 1, 16, 128, qmap=True)
    return [
        (fp, fwd, lambda k, t: fp.launch_arguments(k, t, (1.5, 7, 9, 2.5), s),
         dict(scale_log2=1.5, tok0=7, NB=9, pscale_log2=2.5)),
        (fp, kl, lambda k, t: fp.launch_arguments(k, t, (1.5, 2.5, 9), s),
         dict(scale_log2=1.5, pscale_log2=2.5, NB=9)),
        (bwd_sm90, bwd, lambda k, t: bwd_sm90.launch_arguments(k, t, (0.5, 1.5, 2.5, 3.5), 9, 7, s),
         dict(scale=0.5, scale_log2=1.5, pscale_log2=2.5, pcoef=3.5, NB=9, tok0=7)),
        (select_sm90, sel, lambda k, t: select_sm90.launch_arguments(k, t, 5, s), dict(n_mblk=5)),
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


def test_mode0_size_beyond_int32_is_refused():
    """A (2**31 + 16,) tensor (int8: 2 GiB of untouched virtual memory) must be refused or get
    its true size; today its size reaches the kernel as Int32(-2147483632)."""
    t = torch.empty((2**31 + 16,), dtype=torch.int8)
    try:
        _, ptrs = common.pointer_arguments("review", ("perm",), (t,), t.device)
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
        select_sm90.launch_arguments(kernel, (q.permute(0, 2, 1),) + tensors[1:], 1, None)
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
    monkeypatch.setattr(common, "_VIEW_LAYOUTS", {})
    want = common.view_layout(t)
    monkeypatch.setattr(common, "_VIEW_LAYOUTS", _ClearedByAnotherThread(common._VIEW_LAYOUTS))
    assert common.view_layout(t) == want
