"""Context parallelism (CP): one MSA op over the ranks of a ``torch.distributed`` group.

A long sequence (or a packed varlen batch) is split over the ``P`` ranks of a CP group; each rank
holds a shard of every input. :func:`msa_attention` keeps the queries local and all-gathers the
keys: all three gathers are launched at once, ``k_proxy`` first, and the op waits for
``k_proxy`` before its selection (which needs every block's proxy score) but for ``k`` and ``v``
only after it, so their transfer overlaps the selection; its backward reduce-scatters
``dk_proxy``, ``dk``, ``dv`` in fp32. The single-process op (:func:`flash_msa.msa_attention`)
runs the local queries against the whole batch's keys through its query map (``q_map``: the
packed key index of each local query's token), so blocks, the forced own block and causality use
each query's position in its own sequence; the collectives run inside it, through its
``key_gather`` hook (:class:`flash_msa.api.KeyGather`). They are functional collectives
(``torch.ops._c10d_functional``): asynchronous (on NCCL, on its own stream; a wait orders the
current stream after it, no host synchronization) and traceable, so the op also runs under
``torch.compile(fullgraph=True)``. :class:`WaitTimer` measures the waits (the collective time
not overlapped with compute). Outputs and all five gradients equal the single-process op on the
whole batch up to summation order. docs/distributed.md states the scheme, the bytes moved per
step and what each backend supports.

The layout (:func:`layout`) is causal zigzag per sequence: a sequence of ``L`` tokens is padded
at its end to ``2P`` chunks of ``c`` tokens, ``c`` the smallest multiple of the block size with
``2P * c >= L``, and rank ``r`` holds chunks ``r`` and ``2P-1-r`` of every sequence (sequence by
sequence, in order). Every rank then holds the same number of tokens and about the same causal
work. :func:`shard` / :func:`unshard` move any tensor between the global and the sharded
layout; :func:`gather` is a differentiable all-gather with the collectives of the op.

Per-rank ``kl``: this rank's share of the single-process KL (its rows' terms over the global
``Hp * T`` rows): the SUM over the group is the single-process ``kl``, and per-rank losses
``main_share + w * kl`` followed by the usual SUM all-reduce of the parameter gradients over the
CP group give the single-process gradients.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Layout:
    """Where each token of a batch lies across the ranks of a CP group (see :func:`layout`).

    ``T`` real tokens, ``N`` sequences, ``P = world_size``, ``Tl = local_tokens``. Tensors live
    on the device the layout was built for; the ints are host values (no sync to read them).
    """

    world_size: int  # P
    rank: int  # this rank's index in the CP group
    block_size: int  # the op's key block; every chunk is a whole number of blocks
    batch_size: int | None  # batch form: B sequences of `seqlen` tokens; None: varlen
    seqlen: int | None  # batch form: S (global); None: varlen
    cu_seqlens: torch.Tensor  # (N+1,) int32: the global sequences (no padding)
    max_seqlen: int  # the longest global sequence
    total_tokens: int  # T
    local_tokens: int  # Tl, the same on every rank (padding included)
    chunks: tuple[int, ...]  # per sequence, its chunk length c (a multiple of block_size)
    local_cu_seqlens: torch.Tensor  # (N+1,) int32: the shard's per-sequence segments (2c each)
    token_index: torch.Tensor  # (P, Tl) int64: global packed token of each rank's slot; -1 pad
    gather_index: torch.Tensor  # (T,) int64: each token's row in the rank-major (P*Tl) gather
    q_map: torch.Tensor  # (Tl,) int32: token_index[rank], the op's query map
    positions: torch.Tensor  # (Tl,) int64: position of this rank's tokens in their sequence; -1 pad

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading dims of a local shard: ``(B, Tl // B)`` (batch form) or ``(Tl,)``."""
        if self.batch_size is None:
            return (self.local_tokens,)
        return (self.batch_size, self.local_tokens // self.batch_size)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Leading dims of a global tensor: ``(B, S)`` (batch form) or ``(T,)``."""
        if self.batch_size is None:
            return (self.total_tokens,)
        return (self.batch_size, self.seqlen)

    def for_rank(self, rank: int) -> Layout:
        """The same layout as rank ``rank`` of the group sees it (host-side sharding, tests)."""
        rank = _int_arg("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {rank}")
        q_map, positions = _rank_maps(self.token_index[rank], self.cu_seqlens)
        return dataclasses.replace(self, rank=rank, q_map=q_map, positions=positions)


def _int_arg(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _rank_maps(token_index: torch.Tensor, cu_seqlens: torch.Tensor):
    """``(q_map, positions)`` of one rank's ``token_index`` row."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], token_index, right=True).clamp_max(cu.numel() - 2)
    positions = torch.where(token_index >= 0, token_index - cu[seq], -1)
    return token_index.to(torch.int32), positions


def layout(
    world_size,
    rank,
    *,
    cu_seqlens=None,
    batch_size=None,
    seqlen=None,
    block_size=128,
    device=None,
) -> Layout:
    """The causal zigzag CP layout of a batch.

    Give ``cu_seqlens`` (packed varlen batch) or ``batch_size`` and ``seqlen`` (batch form).
    Sequence ``n`` of ``L`` tokens gets chunks of ``c = block_size * ceil(L / (2P *
    block_size))`` tokens, ``2P`` of them, padded at its end; rank ``r`` holds chunks ``r`` and
    ``2P-1-r`` of every sequence, sequence after sequence, so its shard has
    ``Tl = sum_n 2 c_n`` tokens (``B * 2c`` in batch form: shards are ``(B, 2c, ...)``).

    Built on the host from the lengths: a ``cu_seqlens`` on a GPU costs one device-to-host copy
    (build the layout where the lengths are known, e.g. in the data loader, from a CPU tensor).

    Args:
        world_size: ``P``, the size of the CP group; rank: this rank's index in it.
        cu_seqlens: int32 ``(N+1,)``, the global batch's cumulative lengths.
        batch_size, seqlen: the batch form ``(B, S)`` instead of ``cu_seqlens``.
        block_size: the op's block size (64 or 128); every chunk is a whole number of blocks.
        device: where the layout's index tensors live (default: ``cu_seqlens``'s, else CPU).
    """
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    if block_size not in (64, 128) or isinstance(block_size, bool):
        raise ValueError(f"block_size must be 64 or 128, got {block_size!r}")
    if cu_seqlens is None:
        if batch_size is None or seqlen is None:
            raise ValueError("give cu_seqlens (varlen) or both batch_size and seqlen (batch form)")
        batch_size = _int_arg("batch_size", batch_size, 1)
        seqlen = _int_arg("seqlen", seqlen, 1)
        lengths = [seqlen] * batch_size
    else:
        if batch_size is not None or seqlen is not None:
            raise ValueError("give cu_seqlens or batch_size/seqlen, not both")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                "cu_seqlens must be 1-D int32 [0, ..., total_tokens] with at least 2 entries; "
                f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        device = cu_seqlens.device if device is None else device
        cu = cu_seqlens.tolist()  # the layout is host metadata (see above)
        if cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if sum(lengths) == 0:
        raise ValueError("the batch has no tokens")
    device = torch.device("cpu" if device is None else device)

    P, b = world_size, block_size
    chunks = tuple(b * -(-n // (2 * P * b)) for n in lengths)
    # token_index[r] = per sequence: its chunk r, then its chunk 2P-1-r (positions past its end
    # are padding, -1). Built for every rank: shard/unshard and the gather index need them all.
    pairs = torch.stack([torch.arange(P), 2 * P - 1 - torch.arange(P)], 1)  # (P, 2)
    rows, start = [], 0
    for n, c in zip(lengths, chunks):
        pos = (pairs[:, :, None] * c + torch.arange(c)).reshape(P, 2 * c)  # (P, 2c)
        rows.append(torch.where(pos < n, start + pos, -1))
        start += n
    token_index = torch.cat(rows, 1)  # (P, Tl)
    T, Tl = start, token_index.shape[1]
    flat = token_index.flatten()
    real = flat >= 0
    gather_index = torch.empty(T, dtype=torch.long)
    gather_index[flat[real]] = torch.arange(P * Tl)[real]
    local_cu = torch.tensor([0, *torch.tensor(chunks).mul(2).cumsum(0).tolist()], dtype=torch.int32)
    global_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    token_index, global_cu = token_index.to(device), global_cu.to(device)
    q_map, positions = _rank_maps(token_index[rank], global_cu)
    return Layout(
        world_size=P,
        rank=rank,
        block_size=b,
        batch_size=batch_size if cu_seqlens is None else None,
        seqlen=seqlen if cu_seqlens is None else None,
        cu_seqlens=global_cu,
        max_seqlen=max(lengths),
        total_tokens=T,
        local_tokens=Tl,
        chunks=chunks,
        local_cu_seqlens=local_cu.to(device),
        token_index=token_index,
        gather_index=gather_index.to(device),
        q_map=q_map,
        positions=positions,
    )


def _check_layout(lay):
    if not isinstance(lay, Layout):
        raise TypeError(
            f"layout must be a flash_msa.distributed.Layout (from layout()), got "
            f"{type(lay).__name__}"
        )


def _flat(x, shape, name, where):
    """``x`` with leading dims ``shape`` as ``(prod(shape), *rest)``; ValueError otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape[: len(shape)]) != tuple(shape):
        raise ValueError(
            f"{name} must have leading dims {tuple(shape)} ({where}); got shape {tuple(x.shape)}"
        )
    return x.reshape(-1, *x.shape[len(shape) :])


# ---------------------------------------------------------------------------------------------
# shard / unshard (no communication)
# ---------------------------------------------------------------------------------------------
def shard(x: torch.Tensor, layout: Layout, rank: int | None = None, fill=0) -> torch.Tensor:
    """This rank's shard of a global tensor (differentiable; padding slots hold ``fill``).

    Args:
        x: ``(T, ...)`` (varlen) or ``(B, S, ...)`` (batch form), any dtype: inputs, hidden
            states, labels, ``dout``...
        layout: from :func:`layout`; rank: whose shard (default ``layout.rank``).
    Returns:
        ``(Tl, ...)`` or ``(B, Tl // B, ...)``. The shard's ``cu_seqlens`` (its per-sequence
        segments) is ``layout.local_cu_seqlens``, its tokens' positions ``layout.positions``.
    """
    _check_layout(layout)
    lay = layout if rank is None else layout.for_rank(rank)
    flat = _flat(x, lay.global_shape, "x", "the layout's global tokens")
    idx = lay.token_index[lay.rank]
    pad = (idx < 0).view(-1, *([1] * (flat.dim() - 1)))
    out = flat.index_select(0, idx.clamp_min(0)).masked_fill(pad, fill)
    return out.view(*lay.local_shape, *flat.shape[1:])


def unshard(shards, layout: Layout) -> torch.Tensor:
    """The global tensor from every rank's shard (differentiable; padding dropped).

    Args:
        shards: a list of the ``P`` shards in rank order, each ``(Tl, ...)`` or
            ``(B, Tl // B, ...)``, or one tensor of them stacked on a new first dim.
    Returns:
        ``(T, ...)`` or ``(B, S, ...)``. Inside the op path use :func:`gather` (a collective).
    """
    _check_layout(layout)
    if len(shards) != layout.world_size:
        raise ValueError(
            f"unshard needs {layout.world_size} shards (one per rank), got {len(shards)}"
        )
    flat = torch.cat(
        [_flat(s, layout.local_shape, f"shards[{r}]", "a shard") for r, s in enumerate(shards)]
    )
    out = flat.index_select(0, layout.gather_index)
    return out.view(*layout.global_shape, *out.shape[1:])


# ---------------------------------------------------------------------------------------------
# the collectives
# ---------------------------------------------------------------------------------------------
def _acc_dtype(dtype):
    """Reduce-scatter accumulation dtype: fp32 (fp64 for fp64 gradients)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _functional():
    """``torch.ops._c10d_functional``: collectives that return their output (asynchronous until
    ``wait_tensor``) and that Dynamo traces; the same ops in eager and compiled code."""
    return torch.ops._c10d_functional


class WaitTimer:
    """How long this rank waited for the collectives of :func:`msa_attention` (and
    :func:`gather`): their time not overlapped with compute.

    Pass one as ``timer=`` (eager only) and read :meth:`times_ms` after the step. Each wait is
    bracketed on CUDA by two timing events on the current stream (the stream's stall on the
    collective; no host synchronization), on CPU by the host clock (gloo's wait blocks the
    host). Names: ``k_proxy``, ``k``, ``v`` (forward all-gathers), ``dk_proxy``, ``dk``, ``dv``
    (backward reduce-scatters); ``all_gather`` / ``reduce_scatter`` for :func:`gather`.

    A wait also lasts while a slower rank has not yet joined the collective: on one rank the
    time includes the group's load imbalance (a wait long on one rank and short on the others),
    so the smallest rank's total is the closer bound on the transfer left unhidden.
    """

    def __init__(self):
        self.spans = []  # (name, start, end): CUDA events, or perf_counter seconds on CPU

    def wait(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``wait_tensor(x)``, timed as ``name``."""
        if x.is_cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            x = _functional().wait_tensor(x)
            end.record()
        else:
            start = time.perf_counter()
            x = _functional().wait_tensor(x)
            end = time.perf_counter()
        self.spans.append((name, start, end))
        return x

    def times_ms(self) -> dict[str, float]:
        """Milliseconds waited per name, summed over the spans since :meth:`reset` (CUDA: waits
        for the last event, i.e. call it after the step)."""
        out = {}
        for name, start, end in self.spans:
            if isinstance(start, torch.cuda.Event):
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = 1e3 * (end - start)
            out[name] = out.get(name, 0.0) + ms
        return out

    def reset(self):
        self.spans.clear()


@dataclass(frozen=True, eq=False)
class _KeyGather:
    """:class:`flash_msa.api.KeyGather` over a CP group (see its protocol).

    ``launch``: an all-gather of the shard into a rank-major ``(P * Tl, ...)`` buffer;
    ``finish``: its wait, then ``index_select(gather_index)``, which drops the padding and
    restores the global packed order. ``scatter``: each global ``(T, ...)`` gradient is put into
    a zeroed ``(P * Tl, ...)`` buffer in fp32 (fp64 for fp64), reduce-scattered (SUM) back to
    ``(Tl, ...)`` and cast to its dtype; all launched before the first wait; a ``None`` gradient
    skips its collective (the same on every rank: the condition is the loss's structure, not
    data). Frozen: Dynamo traces the methods (they change nothing but ``timer``, eager only).
    """

    gather_index: torch.Tensor  # layout.gather_index
    world_size: int  # P
    local_tokens: int  # Tl
    total_tokens: int  # T
    group_name: str
    overlap: bool = True
    timer: WaitTimer | None = None

    def _wait(self, x, name):
        if self.timer is not None:
            return self.timer.wait(x, name)
        return _functional().wait_tensor(x)

    def launch(self, x, name):
        return _functional().all_gather_into_tensor(
            x.contiguous(), self.world_size, self.group_name
        )

    def finish(self, pending, name):
        return self._wait(pending, name).index_select(0, self.gather_index)

    def scatter(self, grads, names):
        P, Tl = self.world_size, self.local_tokens
        pending = []
        for g in grads:
            if g is None:
                pending.append(None)
                continue
            full = g.new_zeros((P * Tl, *g.shape[1:]), dtype=_acc_dtype(g.dtype))
            full = full.index_copy(0, self.gather_index, g.to(full.dtype))
            pending.append(_functional().reduce_scatter_tensor(full, "sum", P, self.group_name))
        return tuple(
            None if p is None else self._wait(p, n).to(g.dtype)
            for p, n, g in zip(pending, names, grads)
        )


def _group_name(group) -> str:
    return (dist.group.WORLD if group is None else group).group_name


def _key_gather(lay, group, overlap=True, timer=None) -> _KeyGather:
    return _KeyGather(
        gather_index=lay.gather_index,
        world_size=lay.world_size,
        local_tokens=lay.local_tokens,
        total_tokens=lay.total_tokens,
        group_name=_group_name(group),
        overlap=overlap,
        timer=timer,
    )


class _GatherFunction(torch.autograd.Function):
    """All-gather of local shards into the global packed order (:func:`gather`); backward:
    reduce-scatter, both through a :class:`_KeyGather` ``keys`` (all gathers launched before the
    first wait)."""

    @staticmethod
    def forward(ctx, keys, *xs):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no collective
        ctx.keys, ctx.n = keys, len(xs)
        pending = [keys.launch(x, "all_gather") for x in xs]
        return tuple(keys.finish(p, "all_gather") for p in pending)

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad[1:]
        grads = tuple(g if n else None for g, n in zip(grads, need))
        return (None, *ctx.keys.scatter(grads, ("reduce_scatter",) * ctx.n))


def _check_group(group, lay):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_msa.distributed needs an initialized torch.distributed group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != lay.world_size or rank != lay.rank:
        raise ValueError(
            f"the layout is for rank {lay.rank} of {lay.world_size} but this process is rank "
            f"{rank} of {size} in the group"
        )


def _check_timer(timer):
    if timer is None:
        return
    if not isinstance(timer, WaitTimer):
        raise TypeError(
            f"timer must be a flash_msa.distributed.WaitTimer, got {type(timer).__name__}"
        )
    if torch.compiler.is_compiling():
        raise ValueError(
            "timer is eager only (it records events at each wait): pass None under torch.compile"
        )


def gather(x: torch.Tensor, layout: Layout, group=None, *, timer=None) -> torch.Tensor:
    """The global tensor from every rank's shard: a differentiable all-gather over ``group``.

    Args:
        x: this rank's shard, ``(Tl, ...)`` or ``(B, Tl // B, ...)``.
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).
        timer: a :class:`WaitTimer` that times the waits (eager only), or ``None``.
    Returns:
        ``(T, ...)`` or ``(B, S, ...)`` in the global order, padding dropped. Its gradient is
        reduce-scattered back (summed over the ranks in fp32), so every rank gets the gradient
        of its own tokens with every rank's contribution.
    """
    _check_layout(layout)
    _check_timer(timer)
    _check_group(group, layout)
    flat = _flat(x, layout.local_shape, "x", "this rank's shard")
    (out,) = _GatherFunction.apply(_key_gather(layout, group, timer=timer), flat)
    return out.view(*layout.global_shape, *out.shape[1:])


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def msa_attention(
    q_proxy,
    k_proxy,
    q,
    k,
    v,
    top_k,
    *,
    layout,
    group=None,
    softmax_scale=None,
    proxy_scale=None,
    warmup=False,
    compute_kl=True,
    deterministic=None,
    overlap=True,
    timer=None,
    selection_precision="bf16",
):
    """:func:`flash_msa.msa_attention` over a context-parallel group, on this rank's shards.

    Every rank calls it with its shards (:func:`shard`, ``layout`` from :func:`layout`); all
    ranks must pass the same shapes and arguments (it runs collectives).

    Shapes (``Tl = layout.local_tokens``; batch-form layouts take ``(B, Tl // B, heads, dim)``):
    ``q_proxy (Tl, Hp, Dp)``, ``k_proxy (Tl, Hpk, Dp)``, ``q (Tl, H, D)``,
    ``k``, ``v`` ``(Tl, Hkv, D)``; head rules as in :func:`flash_msa.msa_attention`.

    Args:
        top_k, softmax_scale, proxy_scale, warmup, compute_kl, deterministic: as in
            :func:`flash_msa.msa_attention`; the block size is ``layout.block_size``.
            ``deterministic`` covers this rank's op; the sums inside the collectives (the fp32
            reduce-scatter of the key gradients) are ordered by the process group's backend.
        selection_precision: as in :func:`flash_msa.msa_attention` (``"fp8"``: e4m3 selection;
            ``"fp8_rerank"``: its top ``top_k + 4`` re-ranked by exact scores; the key scales
            are those of the gathered keys, so every rank ranks like the single-process op).
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).
        overlap: ``True`` (default) waits for the ``k``/``v`` all-gathers after the selection
            (they overlap it); ``False`` waits for them before it, as a baseline for
            measurements (the same result).
        timer: a :class:`WaitTimer` that times each wait for a collective (the time not
            overlapped), or ``None``; eager only.

    Works under ``torch.compile(fullgraph=True)`` (the collectives are functional ones, the
    backends' ops the ``flash_msa::`` custom ops with the query map).

    Returns:
        ``(out, kl)``: ``out`` like ``q``, this rank's rows of the single-process output (0 on
        padding rows); ``kl`` this rank's share of the single-process KL (its rows' terms over
        the global ``Hp * T`` rows; 0-dim fp32, fp64 for fp64 inputs). ``all_reduce(kl)`` (SUM)
        over the group is the single-process ``kl``; gradients: docs/distributed.md.
    """
    _check_layout(layout)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__} {overlap!r}")
    _check_timer(timer)
    _check_group(group, layout)
    shape = layout.local_shape
    where = "this rank's shard of the layout"
    names = ("q_proxy", "k_proxy", "q", "k", "v")
    tensors = (q_proxy, k_proxy, q, k, v)
    qp, kp, qq, kk, vv = (_flat(x, shape, n, where) for x, n in zip(tensors, names))
    if layout.q_map.device != qq.device:
        raise ValueError(
            f"the layout's tensors are on {layout.q_map.device} but q is on {qq.device}; build "
            "the layout with device=q.device"
        )
    # the op gathers the keys itself (its key_gather hook), so that it can wait for k and v only
    # after its selection
    out, kl = api.msa_attention(
        qp,
        kp,
        qq,
        kk,
        vv,
        top_k,
        block_size=layout.block_size,
        softmax_scale=softmax_scale,
        proxy_scale=proxy_scale,
        cu_seqlens=layout.cu_seqlens,
        max_seqlen=layout.max_seqlen,
        warmup=warmup,
        compute_kl=compute_kl,
        q_map=layout.q_map,
        deterministic=deterministic,
        key_gather=_key_gather(layout, group, overlap, timer),
        selection_precision=selection_precision,
    )
    # the op's kl is a mean over this rank's Hp * Tl rows (padding rows add 0): rescale to the
    # share of the global Hp * T rows (a host constant: no sync)
    kl = kl * (layout.local_tokens / layout.total_tokens)
    return out.view(q.shape), kl
