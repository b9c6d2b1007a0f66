"""Input validation of the public API and backend selection (CPU only, tiny tensors).

Every bad argument must raise ``TypeError``/``ValueError`` naming the argument (and the offending
value where the message carries it) before any backend is resolved or any op runs.
"""

import logging

import numpy as np
import pytest
import torch

import flash_msa
from flash_msa import backends, reference, testing
from flash_msa.problem import Config, Problem

FNS = {
    "msa": flash_msa.msa_attention,
    "select": flash_msa.select_blocks,
    "sparse": flash_msa.sparse_attention,
}
BASE = dict(B=1, S=70, H=4, Hkv=2, Hp=2, Hpk=1, D=8, Dp=8)
NAN, INF = float("nan"), float("inf")


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def idx(*slots, lead=(1, 70), heads=2):
    """int32 indices whose every row holds ``slots``."""
    row = torch.tensor(slots, dtype=torch.int32)
    return row.expand(*lead, heads, len(slots)).contiguous()


def cu(*offsets, dtype=torch.int32):
    return torch.tensor(offsets, dtype=dtype)


def inputs(fn, varlen=False, dtype=torch.float32, **shape):
    """Valid keyword arguments of ``FNS[fn]``; ``shape`` overrides entries of ``BASE``."""
    s = {**BASE, **shape}
    T = s["B"] * s["S"]
    lead = (T,) if varlen else (s["B"], s["S"])
    t = lambda heads, dim: rand(*lead, heads, dim, dtype=dtype)
    kw = {}
    if fn in ("msa", "select"):
        kw.update(q_proxy=t(s["Hp"], s["Dp"]), k_proxy=t(s["Hpk"], s["Dp"]), top_k=2)
    if fn in ("msa", "sparse"):
        kw.update(q=t(s["H"], s["D"]), k=t(s["Hkv"], s["D"]), v=t(s["Hkv"], s["D"]))
    if fn == "sparse":
        kw["indices"] = idx(0, -1, lead=lead, heads=s["Hp"])
    if varlen:
        kw["cu_seqlens"] = cu(0, min(30, T), T)
    return kw


def mutated(fn, varlen, shape, changes):
    kw = inputs(fn, varlen, **shape)
    for name, value in changes.items():
        kw[name] = value(kw) if callable(value) else value
    return kw


def case(fns, exc, match, shape=None, varlen=False, **changes):
    """One row of the table, expanded over the space-separated ``fns``."""
    plain = (int, float, str, bool, type(None), torch.dtype, np.generic)
    given = {**(shape or {}), **changes}
    label = (
        match.replace("\\", "")[:60]
        if match
        else ",".join(f"{k}={v!r}" if isinstance(v, plain) else k for k, v in given.items())
    )
    label += " (varlen)" * varlen
    return [
        pytest.param(fn, varlen, shape or {}, changes, exc, match, id=f"{fn}-{label}")
        for fn in fns.split()
    ]


def first(name):  # drop the batch dim
    return lambda kw: kw[name][0]


def cast(name, to):  # dtype or device
    return lambda kw: kw[name].to(to)


def poison(name, value):  # one token's values
    return lambda kw: kw[name].index_fill(-3, torch.tensor([0]), value)


PROXY, MAIN, ALL = "msa select", "msa sparse", "msa select sparse"
VE, TE = ValueError, TypeError
CASES = [
    # tensors: type, rank, leading dims, head dims, dtype, device
    *case(PROXY, TE, r"q_proxy must be a torch.Tensor, got list", q_proxy=[[1.0]]),
    *case(PROXY, TE, r"k_proxy must be a torch.Tensor, got NoneType", k_proxy=None),
    *case(MAIN, TE, r"v must be a torch.Tensor, got NoneType", v=None),
    *case(MAIN, VE, r"k must be 4-D .*got shape \(70, 2, 8\)", k=first("k")),
    *case(PROXY, VE, r"k_proxy must be 4-D .*got shape \(70, 1, 8\)", k_proxy=first("k_proxy")),
    *case(ALL, VE, r"must be 3-D .*because cu_seqlens is given", cu_seqlens=cu(0, 70)),
    *case("msa", VE, r"q has \(batch, seqlen\) = \(1, 69\) but q_proxy has \(1, 70\)",
          q=rand(1, 69, 4, 8)),
    *case(MAIN, VE, r"v has \(batch, seqlen\) = \(2, 70\)", v=rand(2, 70, 2, 8)),
    *case(PROXY, VE, r"k_proxy has \(batch, seqlen\) = \(1, 71\)", k_proxy=rand(1, 71, 1, 8)),
    *case(MAIN, VE, r"k has total_tokens = \(69,\)", varlen=True, k=rand(69, 2, 8)),
    *case(MAIN, VE, r"head_dim of k/v \(4\) must equal head_dim of q \(8\)",
          k=rand(1, 70, 2, 4), v=rand(1, 70, 2, 4)),
    *case(MAIN, VE, r"k and v must have the same shape.*v \(1, 70, 2, 4\)", v=rand(1, 70, 2, 4)),
    *case(MAIN, VE, r"k and v must have the same shape.*v \(1, 70, 1, 8\)", v=rand(1, 70, 1, 8)),
    *case(PROXY, VE, r"head_dim of k_proxy \(4\) must equal head_dim of q_proxy \(8\)",
          k_proxy=rand(1, 70, 1, 4)),
    *case(PROXY, VE, r"k_proxy must have at least one head", k_proxy=rand(1, 70, 0, 8)),
    *case(MAIN, VE, r"q must have at least one head and head_dim >= 1", q=rand(1, 70, 4, 0)),
    *case(MAIN, TE, r"q has unsupported dtype torch.int32", q=cast("q", torch.int32)),
    *case(PROXY, TE, r"k_proxy has unsupported dtype torch.float8_e4m3fn",
          k_proxy=cast("k_proxy", torch.float8_e4m3fn)),
    *case(MAIN, TE, r"v has dtype torch.float64 but q(_proxy)? has torch.float32",
          v=cast("v", torch.float64)),
    *case("msa", TE, r"q has dtype torch.float16 but q_proxy has torch.float32",
          q=cast("q", torch.float16)),
    *case(MAIN, VE, r"k is on meta but q(_proxy)? is on cpu", k=cast("k", "meta")),
    *case(PROXY, VE, r"k_proxy is on meta but q_proxy is on cpu", k_proxy=cast("k_proxy", "meta")),
    *case(ALL, VE, r"(q_proxy|q) has no tokens", shape=dict(S=0)),
    *case(ALL, VE, r"(q_proxy|q) has no tokens", shape=dict(S=0), varlen=True),
    # head ratios
    *case(MAIN, VE, r"heads of q \(4\) must be a multiple of heads of k/v \(3\)",
          shape=dict(Hkv=3)),
    *case("msa", VE, r"heads of q \(4\) must be a multiple of heads of q_proxy \(3\)",
          shape=dict(Hp=3)),
    *case(PROXY, VE, r"heads of q_proxy \(2\) must be a multiple of heads of k_proxy \(3\)",
          shape=dict(Hpk=3)),
    *case("msa", VE, r"heads of q_proxy \(6\) and of k/v \(4\) must divide one another",
          shape=dict(H=12, Hkv=4, Hp=6)),
    *case("sparse", VE, r"heads of q \(4\) must be a multiple of heads of indices \(3\)",
          shape=dict(Hp=3)),
    *case("sparse", VE, r"heads of indices \(6\) and of k/v \(4\) must divide one another",
          shape=dict(H=12, Hkv=4, Hp=6)),
    # scalars
    *case(PROXY, VE, r"top_k must be >= 1, got 0", top_k=0),
    *case(PROXY, VE, r"top_k must be >= 1, got -3", top_k=-3),
    *case(PROXY, TE, r"top_k must be an int, got float 2.0", top_k=2.0),
    *case(PROXY, TE, r"top_k must be an int, got bool True", top_k=True),
    *case(PROXY, TE, r"top_k must be an int, got str '2'", top_k="2"),
    *case(PROXY, TE, r"top_k must be an int, got NoneType", top_k=None),
    *case(ALL, VE, r"block_size must be 64 or 128, got 32", block_size=32),
    *case(ALL, VE, r"block_size must be 64 or 128, got 256", block_size=256),
    *case(ALL, VE, r"block_size must be >= 1, got 0", block_size=0),
    *case(ALL, TE, r"block_size must be an int, got float 128.0", block_size=128.0),
    *case(ALL, TE, r"block_size must be an int, got bool True", block_size=True),
    *case(MAIN, VE, r"softmax_scale must be finite and > 0, got 0", softmax_scale=0),
    *case(MAIN, VE, r"softmax_scale must be finite and > 0, got -0.5", softmax_scale=-0.5),
    *case(MAIN, VE, r"softmax_scale must be finite and > 0, got inf", softmax_scale=INF),
    *case(MAIN, VE, r"softmax_scale must be finite and > 0, got nan", softmax_scale=NAN),
    *case(MAIN, TE, r"softmax_scale must be a float, got str '0.1'", softmax_scale="0.1"),
    *case(MAIN, VE, r"softmax_scale must be finite and > 0, got 1000", softmax_scale=10**400),
    *case(PROXY, VE, r"proxy_scale must be finite and > 0, got 0.0", proxy_scale=0.0),
    *case(PROXY, VE, r"proxy_scale must be finite and > 0, got -inf", proxy_scale=-INF),
    *case(PROXY, VE, r"proxy_scale must be finite and > 0, got nan", proxy_scale=NAN),
    *case(PROXY, TE, r"proxy_scale must be a float, got bool True", proxy_scale=True),
    *case("msa", TE, r"warmup must be a bool, got int 1", warmup=1),
    *case("msa", TE, r"compute_kl must be a bool, got NoneType None", compute_kl=None),
    *case("sparse", TE, r"return_lse must be a bool, got str 'yes'", return_lse="yes"),
    # cu_seqlens / max_seqlen
    *case(ALL, VE, r"max_seqlen is only used with cu_seqlens.*max_seqlen=70", max_seqlen=70),
    *case(ALL, TE, r"cu_seqlens must be a torch.Tensor, got list", varlen=True,
          cu_seqlens=[0, 30, 70]),
    *case(ALL, TE, r"cu_seqlens must be int32 or int64, got torch.int16", varlen=True,
          cu_seqlens=cu(0, 30, 70, dtype=torch.int16)),
    *case(ALL, VE, r"cu_seqlens \(int64\) holds values in \[0, 4294967326\], outside int32",
          varlen=True, cu_seqlens=cu(0, 2**32 + 30, 70, dtype=torch.int64)),
    *case(ALL, VE, r"cu_seqlens must be 1-D .*got shape \(1, 3\)", varlen=True,
          cu_seqlens=cu([0, 30, 70])),
    *case(ALL, VE, r"cu_seqlens must be 1-D with at least 2 entries.*got shape \(1,\)",
          varlen=True, cu_seqlens=cu(70)),
    *case(ALL, VE, r"cu_seqlens is on meta but the inputs are on cpu", varlen=True,
          cu_seqlens=cast("cu_seqlens", "meta")),
    *case(ALL, VE, r"cu_seqlens must start at 0, got 5", varlen=True, cu_seqlens=cu(5, 30, 70)),
    *case(ALL, VE, r"cu_seqlens must be non-decreasing, got \[0, 50, 40, 70\]", varlen=True,
          cu_seqlens=cu(0, 50, 40, 70)),
    *case(ALL, VE, r"cu_seqlens\[-1\] \(60\) must equal total_tokens \(70\)", varlen=True,
          cu_seqlens=cu(0, 30, 60)),
    *case(ALL, VE, r"max_seqlen \(39\) is smaller than the longest sequence .*\(40\)",
          varlen=True, max_seqlen=39),
    *case(ALL, VE, r"max_seqlen must be >= 1, got 0", varlen=True, max_seqlen=0),
    *case(ALL, VE, r"max_seqlen \(71\) is larger than the total tokens \(70\)", varlen=True,
          max_seqlen=71),
    *case(MAIN, VE, r"softmax_scale must be in \[.*\].*got 1e\+39", softmax_scale=1e39),
    *case(PROXY, VE, r"proxy_scale must be in \[.*\].*got 1e-46", proxy_scale=1e-46),
    *case(ALL, TE, r"max_seqlen must be an int, got float 40.0", varlen=True, max_seqlen=40.0),
    *case(ALL, TE, r"max_seqlen must be an int, got Tensor", varlen=True,
          max_seqlen=torch.tensor(70)),
    # sparse_attention indices
    *case("sparse", TE, r"indices must be a torch.Tensor, got list", indices=[[0]]),
    *case("sparse", TE, r"indices must be int32, got torch.int64",
          indices=cast("indices", torch.int64)),
    *case("sparse", VE, r"indices must be \(batch, seqlen, Hsel, top_k\) .*\(1, 70\); "
          r"got shape \(1, 69, 2, 1\)", indices=idx(0, lead=(1, 69))),
    *case("sparse", VE, r"indices must be \(total_tokens, Hsel, top_k\) .*\(70,\); "
          r"got shape \(1, 70, 2, 1\)", varlen=True, indices=idx(0)),
    *case("sparse", VE, r"indices needs at least one head and one slot",
          indices=lambda kw: kw["indices"][..., :0]),
    *case("sparse", VE, r"indices is on meta but q is on cpu", indices=cast("indices", "meta")),
    *case("sparse", VE, r"indices must hold -1 or block numbers .*token 0, head 0: \[-2\]",
          indices=idx(-2)),
    *case("sparse", VE, r"indices must hold -1 or block numbers", indices=idx(0, 1)),
    # [0, 30, 70] at block 64: 1 block per sequence although the packed tensor spans 2
    *case("sparse", VE, r"indices must hold -1 or block numbers", varlen=True, block_size=64,
          indices=idx(1, lead=(70,))),
    *case("sparse", VE, r"indices may use -1 only to pad the end .*\[-1, 0\]",
          indices=idx(-1, 0)),
    *case("sparse", VE, r"indices must list each row's blocks strictly ascending.*\[0, 0\]",
          indices=idx(0, 0)),
    *case("sparse", VE, r"indices must list .* strictly ascending.*\[1, 0\]", block_size=64,
          indices=idx(1, 0)),
    # non-finite inputs (checked on CPU tensors)
    *case(PROXY, VE, r"q_proxy contains non-finite values", q_proxy=poison("q_proxy", NAN)),
    *case(PROXY, VE, r"k_proxy contains non-finite values", k_proxy=poison("k_proxy", -INF)),
    *case(MAIN, VE, r"k contains non-finite values", k=poison("k", INF)),
    *case(MAIN, VE, r"v contains non-finite values", varlen=True, v=poison("v", NAN)),
]  # fmt: skip


@pytest.fixture
def calls(monkeypatch):
    """Record every backend resolution and every torch-backend op (they still run)."""
    seen = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            seen.append(name if name != "resolve" else f"resolve:{args[0]}")
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(backends, "resolve", spy("resolve", backends.resolve))
    for op in backends.OPS:
        monkeypatch.setattr(reference, op, spy(op, getattr(reference, op)))
    return seen


@pytest.mark.parametrize("fn, varlen, shape, changes, exc, match", CASES)
def test_bad_input_raises_before_anything_runs(calls, fn, varlen, shape, changes, exc, match):
    kw = mutated(fn, varlen, shape, changes)
    with pytest.raises(exc, match=match):
        FNS[fn](**kw)
    assert calls == [], "a backend was resolved or an op ran before validation finished"


@pytest.mark.parametrize("debug", [None, "0", "1"])
def test_cu_seqlens_values_checked_on_cpu_with_or_without_debug(monkeypatch, calls, debug):
    if debug is not None:
        monkeypatch.setenv("FLASH_MSA_DEBUG", debug)
    kw = inputs("select", varlen=True)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] \(69\)"):
        flash_msa.select_blocks(**{**kw, "cu_seqlens": cu(0, 30, 69), "max_seqlen": 70})
    assert calls == []


def test_value_checks_skipped_off_cpu_without_debug(calls):
    """No host sync on device tensors: bad cu_seqlens values pass validation (meta ~ a GPU)."""
    kw = {k: v.to("meta") for k, v in inputs("select", varlen=True).items() if k != "top_k"}
    kw["cu_seqlens"] = cu(0, 50, 40, 70).to("meta")
    with pytest.raises(flash_msa.BackendError, match="no backend can run 'select' on meta"):
        flash_msa.select_blocks(**kw, top_k=2, max_seqlen=70)
    assert calls == ["resolve:select"]


def test_spy_sees_valid_calls(calls, monkeypatch):
    """The API checks that each op can run before any runs; each op (a custom op) resolves its
    backend again when it runs."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    flash_msa.msa_attention(**inputs("msa"))
    ops = ["resolve:select", "select", "resolve:fwd", "fwd"]
    assert calls == ["resolve:select", "resolve:fwd", *ops]


@pytest.mark.parametrize("fn", FNS)
def test_bad_backend_env(monkeypatch, fn):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"FLASH_MSA_BACKEND must be one of .*'bogus'"):
        FNS[fn](**inputs(fn))


@pytest.mark.parametrize("fn, op", [("msa", "select"), ("select", "select"), ("sparse", "fwd")])
@pytest.mark.parametrize(
    "name, why",
    [
        ("triton", "not implemented yet|head_dim 8 is not one of"),
        ("cute", "not implemented yet|CUDA|import"),
    ],
)
def test_forced_backend_not_available(monkeypatch, fn, op, name, why):
    monkeypatch.setenv("FLASH_MSA_BACKEND", name)
    match = rf"FLASH_MSA_BACKEND={name} cannot run '{op}' on cpu: .*({why})"
    with pytest.raises(flash_msa.BackendError, match=match):
        FNS[fn](**inputs(fn))


@pytest.mark.parametrize(
    "fn, grads", [("msa", ("q_proxy", "k_proxy", "q", "k", "v")), ("select", ()), ("sparse", "qkv")]
)
def test_forced_torch_runs(monkeypatch, fn, grads):
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")
    kw = {k: v.requires_grad_() if k in grads else v for k, v in inputs(fn).items()}
    result = FNS[fn](**kw)
    if grads:
        sum(r.sum() for r in (result if fn == "msa" else [result])).backward()
    assert all(torch.isfinite(kw[n].grad).all() for n in grads)


def problem(device_type, capability=None):
    cfg = Config(block_size=128, softmax_scale=1.0, max_seqlen=70, proxy_scale=1.0, top_k=2)
    return Problem(
        device_type=device_type,
        capability=capability,
        dtype=torch.bfloat16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_sel_heads=2,
        num_proxy_k_heads=1,
        proxy_head_dim=8,
        varlen=False,
        cfg=cfg,
    )


@pytest.mark.parametrize("op", backends.OPS)
@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (8, 0)])
def test_auto_never_picks_torch_on_cuda(op, capability):
    with pytest.raises(flash_msa.BackendError) as e:
        backends.resolve(op, problem("cuda", capability))
    msg = str(e.value)
    assert f"no backend can run '{op}'" in msg and "cute: " in msg and "triton: " in msg


def test_auto_cpu_without_interpreter_is_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backends.resolve("fwd", problem("cpu")) == ("torch", reference)


def test_auto_cpu_interpreter_falls_back_to_torch_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backends, "_logged", set())
    caplog.set_level(logging.WARNING, logger="flash_msa")
    for _ in range(2):
        assert backends.resolve("fwd", problem("cpu"))[0] == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "flash_msa: fwd runs on torch: triton cannot: "
        + backends.reason_not("triton", "fwd", problem("cpu"))
    ]
    backends.resolve("select", problem("cpu"))  # another op: its own message, once
    assert len(caplog.records) == 2


VALID = [
    *case(ALL, None, None, varlen=True, cu_seqlens=cu(0, 30, 30, 70)),  # empty sequence
    *case(ALL, None, None, shape=dict(dtype=torch.float64)),
    *case(ALL, None, None, shape=dict(H=8, Hkv=4, Hp=2, Hpk=1)),  # Hp < Hkv
    *case(ALL, None, None, shape=dict(H=8, Hkv=2, Hp=4, Hpk=2)),  # Hp > Hkv
    *case(PROXY, None, None, shape=dict(Dp=16)),  # Dp != D
    *case(PROXY, None, None, top_k=5, block_size=64),  # top_k > blocks
    *case(ALL, None, None, block_size=64),
    *case(PROXY, None, None, top_k=np.int64(2)),
    *case(MAIN, None, None, softmax_scale=1),
    *case(PROXY, None, None, proxy_scale=np.float64(0.5)),
    *case(MAIN, None, None, softmax_scale=np.float32(0.3)),
    *case(ALL, None, None, varlen=True, max_seqlen=70),  # above the longest, = the tokens
    *case("msa", None, None, warmup=True, compute_kl=False),
    *case("sparse", None, None, block_size=64, indices=idx(0, 1)),
    *case("sparse", None, None, indices=idx(-1, -1)),  # rows with no key: out = 0
]


def _scale(value):
    return None if value is None else float(value)


def _brute_force(fn, kw):
    """``testing.brute_force`` (fp64, loops, dense masks) of the call ``FNS[fn](**kw)``."""
    b = int(kw.get("block_size", 128))
    cu = kw.get("cu_seqlens")
    if fn == "sparse":  # no proxy: a zero one of the index heads (its KL is not looked at)
        lead = kw["q"].shape[:-2]
        qp = torch.zeros(*lead, kw["indices"].shape[-2], 1, dtype=kw["q"].dtype)
        kp = torch.zeros(*lead, 1, 1, dtype=kw["q"].dtype)
        selection, warmup = testing.indices_to_lists(kw["indices"]), False
    else:
        qp, kp = kw["q_proxy"], kw["k_proxy"]
        warmup = kw.get("warmup", False)
        proxy_scale = _scale(kw.get("proxy_scale")) or qp.shape[-1] ** -0.5
        selection = testing.brute_force_select(qp, kp, kw["top_k"], b, proxy_scale, cu)
    if fn == "select":
        return selection
    return testing.brute_force(
        qp,
        kp,
        kw["q"],
        kw["k"],
        kw["v"],
        None if warmup else selection,
        block_size=b,
        softmax_scale=_scale(kw.get("softmax_scale")),
        proxy_scale=_scale(kw.get("proxy_scale")),
        cu_seqlens=cu,
        warmup=warmup,
    )


GRAD_INPUTS = {"msa": ("q_proxy", "k_proxy", "q", "k", "v"), "select": (), "sparse": "qkv"}


@pytest.mark.parametrize("fn, varlen, shape, changes, exc, match", VALID)
def test_valid_edge_inputs(fn, varlen, shape, changes, exc, match):
    """Accepted, and right: the result and the gradients of a loss with O(1) gradients equal the
    fp64 brute force (inputs in fp64: two fp64 implementations, the rule with atol only)."""
    torch.manual_seed(0)  # rand() draws from the global generator
    kw = mutated(fn, varlen, {"dtype": torch.float64, **shape}, changes)
    names = GRAD_INPUTS[fn]
    for name in names:
        kw[name].requires_grad_()
    result = FNS[fn](**kw)
    if fn == "select":
        assert result.shape == (*kw["q_proxy"].shape[:-1], int(kw["top_k"]))
        assert result.dtype == torch.int32
        assert testing.indices_to_lists(result) == _brute_force(fn, kw)
        return
    out, kl = result if fn == "msa" else (result, None)
    assert out.shape == kw["q"].shape
    if fn == "sparse" and (kw["indices"] < 0).all():  # no key anywhere: out = 0, no gradient
        out.sum().backward()
        assert (out == 0).all() and all((kw[n].grad == 0).all() for n in names)
        return
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in names}
    ref = _brute_force(fn, {**kw, **leaves})
    rows = kw["q_proxy"].shape[:-1].numel() if fn == "msa" else 1
    if fn == "msa":
        testing.training_loss(out, kl, rows).backward()
        testing.training_loss(ref["out"], ref["kl"], rows).backward()
    else:
        dout = testing.loss_weights(out.shape, rows)[0].double()
        (out * dout).sum().backward()
        (ref["out"] * dout).sum().backward()
    testing.assert_close("out", out, ref["out"])
    if fn == "msa" and kw.get("compute_kl", True):
        testing.assert_close("kl", kl, ref["kl"])
    elif fn == "msa":
        assert kl.item() == 0.0
    for name in names:
        testing.assert_close(f"d{name}", kw[name].grad, leaves[name].grad)
