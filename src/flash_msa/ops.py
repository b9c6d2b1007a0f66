"""The op contract as ``torch.library`` custom ops, for ``torch.compile``.

Three functional ops (``mutates_args=()``), each with a fake (meta) implementation, so that
Dynamo and AOTAutograd treat a backend call as one opaque node and never trace into a kernel
launcher (CuTe DSL reads data pointers, which fake tensors do not have):

- ``flash_msa::select(q_proxy, k_proxy, cu_seqlens, max_seqlen, block_size, proxy_scale, top_k,
  backend, q_map?, *, deterministic, selection_precision) -> indices``
- ``flash_msa::fwd(q, k, v, indices?, cu_seqlens, q_proxy?, k_proxy?, max_seqlen, ...,
  backend, q_map?) -> (out, lse, proxy_lse, kl, unit_dq_proxy, unit_dk_proxy)``
- ``flash_msa::bwd(dout?, dkl?, <the saved tensors>, cu_seqlens, max_seqlen, ..., backend,
  q_map?) -> (dq, dk, dv, dq_proxy, dk_proxy)``

The last positional argument, ``q_map: Tensor? = None``, is the optional query map (int32
``(Tq,)``, docs/distributed.md): with one, ``q``/``q_proxy`` (and the query-side outputs) have
``Tq`` rows while ``k``/``v``/``k_proxy`` and ``cu_seqlens`` describe the keys; it reaches
``backends.resolve`` (``Problem.q_map``: a backend whose ``Limits`` do not declare it is not
chosen) and the backend's ``select``/``fwd``/``bwd`` as their keyword ``q_map``. It is
positional because ``torch.library`` refuses keyword-only tensors; a call without a map does not
pass it, so a map-less graph has no map argument.

``select`` also takes the keyword-only ``selection_precision: str = "bf16"``
(``Config.selection_precision``; ``api.py`` passes it only when it is not ``"bf16"``, so a
bf16 graph has no such keyword): it reaches ``backends.resolve`` (a backend whose ``Limits``
do not declare ``fp8_selection`` is not chosen) and the backend's ``Config``.

Each also takes the keyword-only ``deterministic: bool = False`` (``Config.deterministic``, the
value ``api.py`` resolved when the graph was traced): it reaches ``backends.resolve`` (a backend
whose ``Limits`` do not declare deterministic mode is not chosen) and the backend's ``Config``.

``backend`` is the name ``backends.resolve`` chose (``"cute"``, ``"triton"``, ``"torch"``);
the real implementation runs that module's ``select``/``fwd``/``bwd`` (docs/design.md,
"Contract") on a :class:`~flash_msa.problem.Config` rebuilt from the scalar arguments.

Outputs have a fixed arity and never alias an input or each other. An output the contract
makes optional is an empty tensor of shape ``(0,)`` when absent: ``proxy_lse`` without a
proxy; the unit proxy gradient pair when the backend does not make it in the forward
(:func:`makes_unit_proxy_grad`, which the fake and the real implementation share); ``dq``,
``dk``, ``dv`` without ``dout``; ``dq_proxy``, ``dk_proxy`` without ``dkl``. ``kl`` is always a
0-dim tensor (0 when not computed). Dtypes: ``lse``, ``proxy_lse``, ``kl`` fp32 (fp64 for fp64
inputs), the unit pair fp32, gradients in their input's dtype.

The forward's sorted work lists (``worklist.Lists``: one sort per training step) are not
outputs: their host fields and the choice to keep them are the driver's, not shapes a fake can
give. In eager the ``fwd`` op's real implementation leaves them on its ``out`` tensor
(:func:`attach_lists`; a Python attribute, which the dispatcher passes through since the tensor
object is the one returned), api.py takes them off at once (:func:`take_lists`), saves their
tensors with the others and hands them back to ``bwd`` the same way, on its ``lse`` argument.
Under ``torch.compile`` the traced tensors carry nothing, so the compiled backward sorts again:
four more outputs and inputs per graph would buy a host cost that a step captured in a CUDA
graph does not pay per step anyway.

``max_seqlen`` and ``top_k`` are ``SymInt`` in the schemas: under ``torch.compile`` with dynamic
shapes they stay symbolic, so a new sequence length does not recompile (the real
implementation always receives plain ints). ``api.py``'s autograd Functions call these ops in
eager and under ``torch.compile`` alike: there is one autograd path per op.
"""

import torch

from . import backends, quant, sparse_forward, worklist
from .problem import Config, Problem, Saved, problem_of

_EMPTY = (0,)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``lse``, ``proxy_lse`` and ``kl`` for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mapped(q_map) -> dict:
    """The backends' keyword for a query map: ``{}`` without one (the map-less call unchanged)."""
    return {} if q_map is None else {"q_map": q_map}


def _module(name: str):
    module, why = backends.load(name)
    if module is None:  # resolve() has checked it; kept for a direct call of the op
        raise backends.BackendError(f"backend {name!r} cannot be loaded: {why}")
    return module


def resolved(backend: str, op: str, problem: Problem):
    """``(name, module)`` that runs ``op``: :func:`backends.resolve` as if ``FLASH_MSA_BACKEND``
    were ``backend`` (the value read when the graph was traced), the same rules and messages."""
    if backend == backends.requested():
        return backends.resolve(op, problem)
    if backend not in backends.CHOICES:
        raise ValueError(f"backend must be one of {', '.join(backends.CHOICES)}; got {backend!r}")
    with backends.forced(backend):  # FLASH_MSA_BACKEND changed since the trace
        return backends.resolve(op, problem)


def resolve(backend: str, op: str, problem: Problem) -> str:
    """The name of the backend that runs ``op`` (:func:`resolved`)."""
    return resolved(backend, op, problem)[0]


def _call(
    ref,
    cu_seqlens,
    max_seqlen,
    block_size,
    softmax_scale,
    proxy_scale,
    top_k,
    warmup,
    compute_kl,
    varlen,
    dims,
    deterministic=False,
    q_map=None,
    selection_precision="bf16",
):
    """``(Config, Problem)`` of one call from the ops' scalar arguments (as api.py builds them;
    ``dims`` is ``(H, Hkv, D, Hsel, Hpk, Dp)``, 0 for what the call does not have; ``q_map``
    the call's query map or ``None``; ``selection_precision`` the select op's keyword, checked:
    a direct ``torch.ops.flash_msa.select`` call with another string must not run exact)."""
    cfg = Config(
        block_size=block_size,
        softmax_scale=softmax_scale,
        max_seqlen=max_seqlen,
        proxy_scale=proxy_scale,
        top_k=top_k,
        warmup=warmup,
        compute_kl=compute_kl,
        deterministic=deterministic,
        selection_precision=quant.check_precision(selection_precision),
    )
    problem = problem_of(
        ref.device, ref.dtype, dims, cu_seqlens.numel() - 1, varlen, cfg, q_map=q_map is not None
    )
    return cfg, problem


def fuses_proxy_grad(module) -> bool:
    """Whether backend ``module``'s ``bwd`` makes the proxy gradient itself: its declared
    ``LIMITS["bwd"].fused_proxy_grad`` (:class:`flash_msa.limits.Limits`; a backend whose
    ``bwd`` entry is a reason string, or whose limits do not declare the field, does not)."""
    limits_obj = getattr(module, "LIMITS", {}).get("bwd")
    return bool(getattr(limits_obj, "fused_proxy_grad", False))


def bwd_fuses_proxy_grad(problem: Problem, backend: str) -> bool:
    """Whether the backend that runs ``problem``'s ``bwd`` makes the proxy gradient itself
    (:func:`fuses_proxy_grad`, as CuTe's does): the ``fwd`` op then does not make the unit one,
    whatever ``proxy_grad`` asks (real and fake implementation alike). A ``bwd`` the backend
    cannot run (a BackendError) leaves the forward's choice as asked."""
    try:
        name = resolve(backend, "bwd", problem)
    except backends.BackendError:
        return False
    return fuses_proxy_grad(_module(name))


# the attribute that carries a forward's sorted lists across the ops in eager (module docstring)
_LISTS = "_flash_msa_lists"


def attach_lists(x: torch.Tensor, lists: worklist.Lists | None) -> None:
    """Leaves ``lists`` on the tensor object ``x`` (nothing for ``None``)."""
    if lists is not None:
        setattr(x, _LISTS, lists)


def take_lists(x: torch.Tensor) -> worklist.Lists | None:
    """The lists :func:`attach_lists` left on ``x``, removed from it (so that they live no longer
    than their holder decides); ``None`` if none. Under ``torch.compile`` always ``None``, and
    not looked up: a traced tensor carries nothing (and Dynamo does not trace ``__dict__``)."""
    if torch.compiler.is_compiling():
        return None
    return x.__dict__.pop(_LISTS, None)


def makes_unit_proxy_grad(
    name: str, sparse: bool, proxy: bool, compute_kl: bool, proxy_grad: bool
) -> bool:
    """Whether backend ``name``'s ``fwd`` returns ``Forward.proxy_grad`` for this call.

    Only the sparse-forward driver's KL stage makes it (``sparse_forward.fwd``: a proxy,
    ``compute_kl``, ``proxy_grad`` asked for; a backend's ``kl`` stage that cannot make it gives
    way to one that can, ``sparse_forward.with_proxy_grad``); the torch backend and the dense
    (warmup) forwards never do. The fake implementation needs this to give the pair its shape;
    the real implementation checks its backend agrees.
    """
    if not (sparse and proxy and compute_kl and proxy_grad):
        return False
    stages = getattr(_module(name), "forward_stages", None)
    return stages is not None and sparse_forward.with_proxy_grad(stages()).kl_makes_proxy_grad


# ---------------------------------------------------------------------------------------------
# select
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("flash_msa::select", mutates_args=())
def select(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    block_size: int,
    softmax_scale: float,
    proxy_scale: float | None,
    top_k: int | None,
    warmup: bool,
    compute_kl: bool,
    varlen: bool,
    dims: list[int],
    backend: str,
    q_map: torch.Tensor | None = None,
    *,
    deterministic: bool = False,
    selection_precision: str = "bf16",
) -> torch.Tensor:
    """Backend op ``select``: int32 ``indices (T, Hp, top_k)`` (``top_k`` already clamped;
    ``Tq`` rows with a query map)."""
    cfg, problem = _call(
        q_proxy,
        cu_seqlens,
        max_seqlen,
        block_size,
        softmax_scale,
        proxy_scale,
        top_k,
        warmup,
        compute_kl,
        varlen,
        dims,
        deterministic,
        q_map,
        selection_precision,
    )
    module = resolved(backend, "select", problem)[1]
    return module.select(q_proxy, k_proxy, cu_seqlens, cfg, **_mapped(q_map))


@select.register_fake
def _select_fake(
    q_proxy,
    k_proxy,
    cu_seqlens,
    max_seqlen,
    block_size,
    softmax_scale,
    proxy_scale,
    top_k,
    warmup,
    compute_kl,
    varlen,
    dims,
    backend,
    q_map=None,
    *,
    deterministic=False,
    selection_precision="bf16",
):
    problem = _call(
        q_proxy,
        cu_seqlens,
        max_seqlen,
        block_size,
        softmax_scale,
        proxy_scale,
        top_k,
        warmup,
        compute_kl,
        varlen,
        dims,
        deterministic,
        q_map,
        selection_precision,
    )[1]
    resolve(backend, "select", problem)  # a BackendError surfaces when the graph is traced
    T, Hp = q_proxy.shape[:2]
    return q_proxy.new_empty((T, Hp, top_k), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# fwd
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("flash_msa::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    q_proxy: torch.Tensor | None,
    k_proxy: torch.Tensor | None,
    proxy_grad: bool,
    max_seqlen: int,
    block_size: int,
    softmax_scale: float,
    proxy_scale: float | None,
    top_k: int | None,
    warmup: bool,
    compute_kl: bool,
    varlen: bool,
    dims: list[int],
    backend: str,
    q_map: torch.Tensor | None = None,
    *,
    deterministic: bool = False,
    carry_lists: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backend op ``fwd``: ``(out, lse, proxy_lse, kl, unit_dq_proxy, unit_dk_proxy)``.
    ``carry_lists``: leave the sorted work lists on ``out`` (:func:`attach_lists`) for the eager
    backward; ``api.py`` passes it only outside ``torch.compile`` (a compiled graph's outputs
    must own every allocation: CUDA-graph trees refuse tensors kept alive beside them)."""
    cfg, problem = _call(
        q,
        cu_seqlens,
        max_seqlen,
        block_size,
        softmax_scale,
        proxy_scale,
        top_k,
        warmup,
        compute_kl,
        varlen,
        dims,
        deterministic,
        q_map,
    )
    name = resolve(backend, "fwd", problem)
    # a backward that fuses the proxy gradient (CuTe) makes it itself: not the forward
    proxy_grad = proxy_grad and not bwd_fuses_proxy_grad(problem, backend)
    f = _module(name).fwd(
        q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad=proxy_grad, **_mapped(q_map)
    )
    if carry_lists:
        attach_lists(f.out, worklist.carried(f))
    made = f.proxy_grad is not None
    sparse, proxy = indices is not None, q_proxy is not None
    if made != makes_unit_proxy_grad(name, sparse, proxy, compute_kl, proxy_grad):
        raise RuntimeError(
            f"backend {name!r} {'made' if made else 'did not make'} the forward's unit proxy "
            "gradient, unlike flash_msa.ops.makes_unit_proxy_grad (the fake's shapes): update it"
        )
    empty = q.new_empty(_EMPTY, dtype=torch.float32)
    kl = f.kl if f.kl is not None else torch.zeros((), dtype=f.lse.dtype, device=q.device)
    unit = f.proxy_grad if made else (empty, empty.clone())
    proxy_lse = f.proxy_lse if f.proxy_lse is not None else empty.to(f.lse.dtype, copy=True)
    return f.out, f.lse, proxy_lse, kl, *unit


# the ops' scalar arguments after their tensors, in order (then ``backend``, then ``q_map``)
_SCALARS = (
    "max_seqlen",
    "block_size",
    "softmax_scale",
    "proxy_scale",
    "top_k",
    "warmup",
    "compute_kl",
    "varlen",
    "dims",
)


def _split(call: tuple):
    """``(scalars, backend, q_map)`` of an op's trailing positional arguments (``max_seqlen``
    ... ``dims``, ``backend``, then ``q_map`` when the call passes one)."""
    n = len(_SCALARS)
    return call[:n], call[n], (call[n + 1] if len(call) > n + 1 else None)


@fwd.register_fake
def _fwd_fake(
    q,
    k,
    v,
    indices,
    cu_seqlens,
    q_proxy,
    k_proxy,
    proxy_grad,
    *call,
    deterministic=False,
    carry_lists=False,
):
    scalars, backend, q_map = _split(call)
    problem = _call(q, cu_seqlens, *scalars, deterministic, q_map)[1]
    name = resolve(backend, "fwd", problem)
    proxy_grad = proxy_grad and not bwd_fuses_proxy_grad(problem, backend)
    compute_kl = scalars[_SCALARS.index("compute_kl")]
    T, H = q.shape[:2]
    sdt = _stat_dtype(q.dtype)
    proxy = q_proxy is not None
    proxy_lse = q.new_empty((T, q_proxy.shape[1]) if proxy else _EMPTY, dtype=sdt)
    if makes_unit_proxy_grad(name, indices is not None, proxy, compute_kl, proxy_grad):
        unit = (
            q.new_empty(q_proxy.shape, dtype=torch.float32),
            q.new_empty(k_proxy.shape, dtype=torch.float32),
        )
    else:
        unit = (q.new_empty(_EMPTY, dtype=torch.float32), q.new_empty(_EMPTY, dtype=torch.float32))
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty((T, H), dtype=sdt),
        proxy_lse,
        q.new_empty((), dtype=sdt),
        *unit,
    )


# ---------------------------------------------------------------------------------------------
# bwd
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("flash_msa::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor | None,
    dkl: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    indices: torch.Tensor | None,
    q_proxy: torch.Tensor | None,
    k_proxy: torch.Tensor | None,
    proxy_lse: torch.Tensor | None,
    unit_dq_proxy: torch.Tensor | None,
    unit_dk_proxy: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    block_size: int,
    softmax_scale: float,
    proxy_scale: float | None,
    top_k: int | None,
    warmup: bool,
    compute_kl: bool,
    varlen: bool,
    dims: list[int],
    backend: str,
    q_map: torch.Tensor | None = None,
    *,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backend op ``bwd``: ``(dq, dk, dv, dq_proxy, dk_proxy)``, ``(0,)`` where not asked.

    ``dout=None`` skips the main gradients, ``dkl=None`` the proxy pass. The unit pair is the
    forward's (``fwd``'s last two outputs); a ``(0,)`` pair (or ``None``) means it was not made.
    Sorted lists left on ``lse`` (:func:`attach_lists`, eager only) reach the backend's ``bwd``
    (``worklist.carry``), which then cuts its work items from them instead of sorting again.
    """
    cfg, problem = _call(
        q,
        cu_seqlens,
        max_seqlen,
        block_size,
        softmax_scale,
        proxy_scale,
        top_k,
        warmup,
        compute_kl,
        varlen,
        dims,
        deterministic,
        q_map,
    )
    name = resolve(backend, "bwd", problem)
    unit = None
    if unit_dq_proxy is not None and unit_dq_proxy.dim() == 3:
        unit = (unit_dq_proxy, unit_dk_proxy)
    saved = Saved(q, k, v, out, lse, indices, q_proxy, k_proxy, proxy_lse, unit)
    saved = worklist.carry(saved, take_lists(lse))
    g = _module(name).bwd(dout, dkl, saved, cu_seqlens, cfg, **_mapped(q_map))
    return tuple(
        x if x is not None else q.new_empty(_EMPTY)
        for x in (g.dq, g.dk, g.dv, g.dq_proxy, g.dk_proxy)
    )


@bwd.register_fake
def _bwd_fake(dout, dkl, q, k, v, out, lse, indices, q_proxy, k_proxy, *rest, deterministic=False):
    cu_seqlens, (scalars, backend, q_map) = rest[3], _split(rest[4:])
    resolve(backend, "bwd", _call(q, cu_seqlens, *scalars, deterministic, q_map)[1])

    def like(x, wanted):
        if not wanted or x is None:
            return q.new_empty(_EMPTY)
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    main, proxy = dout is not None, dkl is not None
    return (like(q, main), like(k, main), like(v, main), like(q_proxy, proxy), like(k_proxy, proxy))
