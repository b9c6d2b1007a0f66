"""Context parallelism (CP): one MSA op over the ranks of a ``torch.distributed`` group.

A long sequence (or a packed varlen batch) is split over the ``P`` ranks of a CP group; each rank
holds a shard of every input. :func:`msa_attention` keeps the queries local and all-gathers the
keys (``k_proxy`` first: the selection needs every block's proxy score; then ``k`` and ``v``);
its backward reduce-scatters ``dk_proxy``, ``dk``, ``dv`` in fp32. In between, the
single-process op (:func:`flash_msa.msa_attention`) runs the local queries against the whole
batch's keys through its query map (``q_map``: the packed key index of each local query's
token), so blocks, the forced own block and causality use each query's position in its own
sequence. Outputs and all five gradients equal the single-process op on the whole batch up to
summation order. docs/distributed.md states the scheme, the bytes moved per step and what each
backend supports.

The layout (:func:`layout`) is causal zigzag per sequence: a sequence of ``L`` tokens is padded
at its end to ``2P`` chunks of ``c`` tokens, ``c`` the smallest multiple of the block size with
``2P * c >= L``, and rank ``r`` holds chunks ``r`` and ``2P-1-r`` of every sequence (sequence by
sequence, in order). Every rank then holds the same number of tokens and about the same causal
work. :func:`shard` / :func:`unshard` move any tensor between the global and the sharded
layout; :func:`gather` is the differentiable all-gather the op uses for the keys.

Per-rank ``kl``: this rank's share of the single-process KL (its rows' terms over the global
``Hp * T`` rows): the SUM over the group is the single-process ``kl``, and per-rank losses
``main_share + w * kl`` followed by the usual SUM all-reduce of the parameter gradients over the
CP group give the single-process gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api

# torch >= 2.13 names them *_single (the *_tensor names became deprecated aliases with the same
# signature); torch 2.6-2.12 has only the *_tensor names; a torch built without distributed
# support has neither (then _check_group refuses every call).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


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


class _GatherFunction(torch.autograd.Function):
    """All-gather of local shards into the global packed order; backward: reduce-scatter.

    Forward: one all-gather per tensor into a rank-major ``(P * Tl, ...)`` buffer, all launched
    (``async_op``) before the first wait, in argument order (the op passes ``k_proxy`` first);
    then ``index_select(gather_index)`` drops the padding and restores the global order.
    Backward: each incoming ``(T, ...)`` gradient is scattered into a zeroed ``(P * Tl, ...)``
    buffer in fp32 (fp64 for fp64), reduce-scattered (SUM) back to ``(Tl, ...)`` and cast to the
    input's dtype; a ``None`` gradient skips its collective (the same on every rank: the
    condition is the loss's structure, not data). ``work.wait()`` on NCCL only orders the
    current stream after the collective: no host synchronization.
    """

    @staticmethod
    def forward(ctx, lay, group, *xs):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no collective
        ctx.lay, ctx.group = lay, group
        ctx.dtypes = [x.dtype for x in xs]
        P, Tl = lay.world_size, lay.local_tokens
        bufs, works = [], []
        for x in xs:
            buf = x.new_empty((P * Tl, *x.shape[1:]))
            works.append(_ALL_GATHER(buf, x.contiguous(), group=group, async_op=True))
            bufs.append(buf)
        outs = []
        for buf, work in zip(bufs, works):
            work.wait()
            outs.append(buf.index_select(0, lay.gather_index))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        lay, group = ctx.lay, ctx.group
        P, Tl = lay.world_size, lay.local_tokens
        outs, works = [], []
        for g, dtype, need in zip(grads, ctx.dtypes, ctx.needs_input_grad[2:]):
            if g is None or not need:
                outs.append(None)
                works.append(None)
                continue
            acc = _acc_dtype(dtype)
            full = g.new_zeros((P * Tl, *g.shape[1:]), dtype=acc)
            full.index_copy_(0, lay.gather_index, g.to(acc))
            local = g.new_empty((Tl, *g.shape[1:]), dtype=acc)
            works.append(_REDUCE_SCATTER(local, full, group=group, async_op=True))
            outs.append(local)
        for work in works:
            if work is not None:
                work.wait()
        grads_in = [None if o is None else o.to(d) for o, d in zip(outs, ctx.dtypes)]
        return (None, None, *grads_in)


def _check_group(group, lay):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_msa.distributed needs an initialized torch.distributed group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != lay.world_size or rank != lay.rank:
        raise ValueError(
            f"the layout is for rank {lay.rank} of {lay.world_size} but this process is rank "
            f"{rank} of {size} in the group"
        )


def gather(x: torch.Tensor, layout: Layout, group=None) -> torch.Tensor:
    """The global tensor from every rank's shard: a differentiable all-gather over ``group``.

    Args:
        x: this rank's shard, ``(Tl, ...)`` or ``(B, Tl // B, ...)``.
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).
    Returns:
        ``(T, ...)`` or ``(B, S, ...)`` in the global order, padding dropped. Its gradient is
        reduce-scattered back (summed over the ranks in fp32), so every rank gets the gradient
        of its own tokens with every rank's contribution.
    """
    _check_layout(layout)
    _check_group(group, layout)
    flat = _flat(x, layout.local_shape, "x", "this rank's shard")
    (out,) = _GatherFunction.apply(layout, group, flat)
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
        layout: this rank's :class:`Layout`; group: the CP process group (default: the world).

    Returns:
        ``(out, kl)``: ``out`` like ``q``, this rank's rows of the single-process output (0 on
        padding rows); ``kl`` this rank's share of the single-process KL (its rows' terms over
        the global ``Hp * T`` rows; 0-dim fp32, fp64 for fp64 inputs). ``all_reduce(kl)`` (SUM)
        over the group is the single-process ``kl``; gradients: docs/distributed.md.
    """
    _check_layout(layout)
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
    kp_all, k_all, v_all = _GatherFunction.apply(layout, group, kp, kk, vv)
    out, kl = api.msa_attention(
        qp,
        kp_all,
        qq,
        k_all,
        v_all,
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
    )
    # the op's kl is a mean over this rank's Hp * Tl rows (padding rows add 0): rescale to the
    # share of the global Hp * T rows (a host constant: no sync)
    kl = kl * (layout.local_tokens / layout.total_tokens)
    return out.view(q.shape), kl
