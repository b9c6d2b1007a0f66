"""Sparse main forward on Hopper (sm_90a) in CuTe DSL: per-block attention partials, key-outer.

The CuTe forward's per-block stage (``cute.forward``): the kernel :class:`FwdPartialsSm90` makes
the per-block partials (the driver stage :func:`partials`) and, in the same launch, the proxy
LSE partials where :func:`proxy_fits` ("Proxy LSE" below); :class:`FwdKlSm90` makes the KL value
(the driver stage :func:`kl`). Checked on an H200 against the Triton kernel (same work list,
same partial buffers) and the reference (tests/ops/test_fwd.py, tests/ops/test_kl.py).

Same decomposition as the Triton forward (docs/algorithm.md, "Main attention: key-outer over a
reverse index"): one CTA per work item = (selection head p, key block, up to TW query tokens
that kept it). The CTA has ``warpgroups`` consumer warpgroups (128 threads, M = 64 rows per
chunk each). Per KV sub-group of G2 heads it loads the block's K and V tiles once by TMA (a
one-shot mbarrier); the warpgroups then take turns at the chunks of 64 rows (BT tokens x G2
heads, row = token-major; warpgroup w takes chunks w, w + warpgroups, ...). For a chunk a
warpgroup

1. gathers the rows' queries by cp.async (16-byte pieces, row index from ``perm``) into a
   128B-swizzled shared tile; each warpgroup has two Q buffers, and the next chunk's gather is
   issued into the other one before waiting for this one (:meth:`FwdPartialsSm90.gather`),
2. computes S = Q K^T by warpgroup MMA (``m64nBLOCKk16``, both operands in shared memory),
3. masks keys past the block's end or after the row's token, takes the row max and
   ``P = exp2((S - max) * scale * log2 e)`` in registers (quad shuffles for the row reductions),
4. computes O = P V by warpgroup MMA with P from registers and V through a transposed
   (MN-major) view of its shared tile,
5. writes the normalized partial ``O / l`` (input dtype) and its natural-log LSE to the row's
   slot of the ``(C, H, K, D)`` / ``(C, H, K)`` partial buffers of the driver
   (:mod:`flash_msa.sparse_forward`); the tile goes through this chunk's Q buffer first, so the
   global stores are 16-byte pieces of whole rows.

One block per item means no online softmax: the combine merges a query's K partials by LSE.

Proxy LSE (``proxy=True``; the driver's ``partials_make_proxy``): the same launch also writes
the proxy LSE partials ``pl_part (C, Hs, K)``, the natural-log LSE of ``proxy_scale * q_proxy .
k_proxy`` over the slot's block keys visible to the token (same causal and block-end mask as
the main part). Per item, warp 0 issues the block's k_proxy tile (``BLOCK x Dp``, head ``p //
(Hs / Hpk)``) by TMA on a second mbarrier together with the first K/V tile, into a buffer of
its own, so it has landed long before it is read. After the last KV sub-group's closing CTA
barrier the warpgroups take turns at chunks of 64 tokens (one row each, head ``p``), as in the
main part: the rows' q_proxy gathered by cp.async into the (now free) Q buffers, double
buffered, one ``m64nBLOCKk16`` wgmma chain of Dp / 16 steps into the main part's S registers,
the main part's mask / row max / exp2-sum, and the LSE stored by the quad leader into the
row's slot; no P V, no O. Why after the main part and not inside it: a main chunk holds BT =
64 / G2 tokens of G2 heads while a proxy row is one per token, so the proxy needs its own
chunks; after the main part every Q buffer is free, whatever Dp (the Q region is sized for
max(D, Dp)), and the main part's code is unchanged (``proxy=False`` compiles to the same PTX).
Its cost per item is one exposed gather latency plus Dp / (2 G D) of the main part's MMA work
and 1/G of its exp2 (one proxy row per G main rows, and no P V).
Unused slots have no work-list entry and are never written (the partial-buffer contract).

Query map (``qmap=True``, context parallelism; the contract's ``q_map``, docs/distributed.md;
the driver's ``wl.q_map``): the work list's entries are query rows (``worklist.build(...,
q_map)``: ``q``, ``q_proxy`` and the partial buffers have ``Tq`` rows, K, V and k_proxy the
keys' ``T``, blocks by key tokens), so the gathers, the partial slots and ``tok0`` are
unchanged; only the causal mask of both parts compares the block's keys with the row's token
``q_map[row]`` instead of the row (:meth:`FwdPartialsSm90.row_info`: one extra load per row,
issued with the row's ``perm`` load, before the gather wait; every compiled layout is
spill-free at 168 registers or fewer, the paper head layout (D = 128, R = 4 sub-groups) too
since :meth:`FwdPartialsSm90.store_lse` has no branch: compile_check "fwd ... qmap", the paper
one in tests/cute_host/test_fwd.py). Padding rows (``-1``) have no
entries (``worklist.build`` drops them), so a row the kernel visits always has a token. Without
the map the kernel compiles to the PTX it had before the field existed (a compile-time branch;
the map travels in the work-list argument, :class:`MappedWorkItems`, so no argument is added).

Measured variants that left this file (H200, same-run gains of the kept choice, 8 cases): two Q
buffers per warpgroup against one (-1..+12%), partials staged through shared memory against each
thread's 4-byte column-pair stores (+6..+19%), 3 consumer warpgroups against 1 (+12..+31% at the
paper head layout, -9..+1%, a tie, at the anchor one) and 2: 3 ship for every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Constexpr, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..cubin import SHARED_LIMIT
from ..worklist import geometry
from .common import (
    PointerTensors,
    WorkItems,
    acc_as_a,
    acc_rows_cols,
    cutlass_dtype,
    pointer_tensors,
    row_gather_copy,
    tma_tiles,
)
from .launch import aligned, bound, pointer_arguments, run_typed, stream

LN2 = 0.6931471805599453


def head_geometry_reason(H: int, Hkv: int, Hs: int) -> str | None:
    """Why the kernel cannot cover these head counts (``None`` if it can): each selection
    head's G = H / Hs main heads are visited in R sub-groups of G2 heads sharing one KV head,
    which must tile the group exactly (else heads would be skipped), G2 a power of two."""
    if H % Hs or H % Hkv:
        return f"H={H} must be a multiple of the selection heads ({Hs}) and KV heads ({Hkv})"
    if Hs % Hkv and Hkv % Hs:  # the kernel reloads K/V only where a sub-group starts a KV head
        return f"the selection heads ({Hs}) and KV heads ({Hkv}) must divide one another"
    G, G2, R, _ = geometry(H, Hkv, Hs, FwdPartialsSm90.ROWS)
    if G2 * R != G or G2 & (G2 - 1) or (H // Hkv) % G2:
        return (
            f"H={H}, Hkv={Hkv}, Hs={Hs}: the {G} heads of a selection head do not split into "
            "sub-groups of a power-of-two number of heads sharing one KV head"
        )
    return None


def _pairs(t: cute.Tensor) -> cute.Tensor:
    """A ``(rows, cols)`` view (:func:`acc_rows_cols`) as ``(2, rows, cols / 2)``: mode 0 the
    two adjacent columns a thread holds (neighbouring registers)."""
    s, d = t.layout.shape, t.layout.stride
    shape = (s[1][0], s[0], (s[1][1], s[1][2]))
    stride = (d[1][0], d[0], (d[1][1], d[1][2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def _staged(row, unit):
    """Element offset of 16-byte piece ``unit`` of chunk row ``row`` in a Q buffer used as the
    partial's staging tile: the bytes of Q's own row there (128-byte row segments, one per 64
    columns, 16-byte pieces XOR-swizzled by ``row % 8``: bank-conflict-free both for the
    accumulator's column-pair writes and for whole-row reads)."""
    seg = FwdPartialsSm90.ROWS * 64  # elements of one 64-column segment of the tile
    return (unit // 8) * seg + row * 64 + ((unit % 8) ^ (row % 8)) * 8


class MappedWorkItems(NamedTuple):
    """A ``WorkItems`` (common.py) and the work list's query map (``FwdPartialsSm90(qmap=True)``:
    the map travels with the list, as in :class:`flash_msa.worklist.WorkList`)."""

    perm: cute.Tensor
    item_list: cute.Tensor
    item_start: cute.Tensor
    item_end: cute.Tensor
    block_start: cute.Tensor
    block_end: cute.Tensor
    q_map: cute.Tensor  # (Tq,) int32: each query row's packed key token (-1: padding row)


class ProxyArgs(NamedTuple):
    """The run-time arguments of the proxy LSE part (``FwdPartialsSm90(proxy=True)``)."""

    q_proxy: cute.Tensor  # (T * Hs, Dp): row t * Hs + p
    k_proxy: cute.Tensor  # (T, Dp, Hpk) view of k_proxy: a TMA box = one head's block
    pl_part: cute.Tensor  # (C * Hs * K,) fp32 proxy LSE partials
    scale_log2: Float32  # proxy scale * log2(e)


def _loads_before(r: int, g2: int, kv_group: int) -> int:
    """K/V tile loads issued before sub-group ``r``'s (trace time): one per new KV head."""
    return sum(1 for i in range(r) if i == 0 or (i * g2) % kv_group == 0)


@dataclass(frozen=True)
class FwdPartialsSm90:
    """The per-block attention partials of a work list (module docstring), one static
    configuration; the fields are all of it (the compile cache keys on the object).

    Run-time values: the token, entry, work-item and block counts, ``tok0``, the scale."""

    dtype: type[cutlass.Numeric]  # BFloat16 or Float16: q, k, v and the partial outputs
    heads: int  # H
    kv_heads: int  # Hkv
    sel_heads: int  # Hs: selection heads (work lists are per selection head)
    head_dim: int  # D
    top_k: int  # K: index slots per (token, selection head)
    block_size: int  # keys per block (one block per work item)
    # consumer warpgroups per CTA, sharing the block's K/V tiles and taking turns at the chunks
    # (each with its own two Q buffers); 3 fills the register file (168 registers x 384
    # threads). 3 vs 1: +12..+31% at the paper head layout, a tie (-9..+1%) at the anchor one.
    warpgroups: int = 3
    # also the proxy LSE partials of the same items (module docstring, "Proxy LSE"); False
    # compiles to the main-only kernel (the same PTX as before the field existed)
    proxy: bool = False
    proxy_head_dim: int = 128  # Dp (read only when ``proxy``)
    proxy_k_heads: int = 1  # Hpk: proxy key heads (read only when ``proxy``)
    # query rows through a query map (module docstring, "Query map"): a row's causal position
    # is ``q_map[row]``; the launch's work list carries the map (:class:`MappedWorkItems`)
    qmap: bool = False
    # the launch's tensors as their CuTe views had them (``launch.view_layout``: element type,
    # static sizes and strides, in the order of :func:`launch_tensor_names`), set by
    # :func:`launch_arguments` from the tensors of the call: the compiled code bakes them in
    # (TMA descriptors' boxes, the rows' strides), so two layouts are two kernel objects.
    # ``()`` for a configuration not yet bound to a launch's tensors (it cannot be compiled)
    views: tuple = ()

    LABEL: ClassVar[str] = "CuTe forward partials"  # (the ValueError's prefix: __post_init__)
    ROWS: ClassVar[int] = 64  # rows per chunk: one warpgroup's MMA M
    THREADS: ClassVar[int] = 128  # threads per warpgroup
    Q_BUFFERS: ClassVar[int] = 2  # per warpgroup: the next chunk's gather lands in the other

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def shared_bytes(
        elem_bytes: int, head_dim: int, block_size: int, warpgroups: int, proxy_head_dim: int = 0
    ) -> dict:
        """Bytes of each shared-memory buffer, in the order of the ``Storage`` struct (the
        operand tiles aligned to 1024 bytes, the 128B swizzle's period), and their sum.
        ``proxy_head_dim``: Dp of the proxy LSE part (0: none): a second mbarrier, the Q
        buffers sized for max(D, Dp) (they take the q_proxy rows after the main part) and the
        k_proxy tile."""
        dq = max(head_dim, proxy_head_dim)
        sizes = {
            "kv_mbar": 8 * (2 if proxy_head_dim else 1),  # K/V tiles' mbarrier (+ k_proxy's)
            "sPart": 8 * FwdPartialsSm90.ROWS * warpgroups,  # a row's partial index (int64)
            "sQ": FwdPartialsSm90.ROWS * dq * elem_bytes * FwdPartialsSm90.Q_BUFFERS * warpgroups,
            "sK": block_size * head_dim * elem_bytes,
            "sV": block_size * head_dim * elem_bytes,
        }  # fmt: skip
        if proxy_head_dim:
            sizes["sKp"] = block_size * proxy_head_dim * elem_bytes
        end = 0
        for name, size in sizes.items():
            if name in ("sQ", "sK", "sV", "sKp"):
                end = -(-end // 1024) * 1024
            end += size
        return {**sizes, "total": end}

    @classmethod
    def can_implement(
        cls, dtype, heads, kv_heads, sel_heads, head_dim, top_k, block_size, warpgroups=3,
        proxy=False, proxy_head_dim=128, proxy_k_heads=1,
    ) -> str | None:  # fmt: skip
        """Why this configuration cannot be compiled or run (``None``: it can).

        Shared memory (:meth:`shared_bytes`) at D = 128, block 128, bf16, 3 warpgroups: 6 Q
        buffers of 64 x 128 x 2 = 16 KB (96 KB) + K and V tiles of 128 x 128 x 2 = 32 KB each
        (64 KB) + 1.5 KB of row indices + the mbarrier, aligned: 165,888 bytes of the sm_90
        capacity of 232,448 (SHARED_LIMIT). With the proxy part at Dp = 128, + the 32 KB
        k_proxy tile: 198,656, the most of any configuration (D = 64, Dp = 128: Q buffers of
        64 x max(D, Dp), 165,888), so every supported layout fits. Registers: 168 per thread
        with 3 warpgroups (384 threads x 168 = 64,512 of 65,536; compile_check asserts no
        spills, with and without the proxy part)."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"the CuTe forward needs bf16 or fp16, not {dtype}"
        if head_dim not in (64, 128):
            return f"the CuTe forward needs head_dim 64 or 128, not {head_dim}"
        if block_size not in (64, 128):
            return f"the CuTe forward needs block_size 64 or 128, not {block_size}"
        if warpgroups not in (1, 2, 3):
            return f"the CuTe forward has 1-3 consumer warpgroups per CTA, not {warpgroups}"
        if top_k is not None and top_k < 1:  # None: not known yet (no limit on the slots)
            return f"top_k must be positive, not {top_k}"
        why = head_geometry_reason(heads, kv_heads, sel_heads)
        if why is not None:
            return why
        if proxy and proxy_head_dim not in (64, 128):
            return f"the CuTe proxy LSE needs proxy_head_dim 64 or 128, not {proxy_head_dim}"
        if proxy and (proxy_k_heads < 1 or sel_heads % proxy_k_heads):
            return (
                f"the selection heads ({sel_heads}) must be a multiple of the proxy key heads "
                f"({proxy_k_heads})"
            )
        dp = proxy_head_dim if proxy else 0
        smem = cls.shared_bytes(dtype.width // 8, head_dim, block_size, warpgroups, dp)["total"]
        if smem > SHARED_LIMIT:
            return f"{smem} bytes of shared memory exceed the sm_90 capacity ({SHARED_LIMIT})"
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.kv_heads, self.sel_heads, self.head_dim, self.top_k,
            self.block_size, self.warpgroups, self.proxy, self.proxy_head_dim, self.proxy_k_heads,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"{self.LABEL}: {why}")

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(G, G2, R)``: main heads per selection head, heads per KV sub-group, sub-groups."""
        return geometry(self.heads, self.kv_heads, self.sel_heads, self.ROWS)[:3]

    # -----------------------------------------------------------------------------------------
    # host: MMAs, layouts, TMA atoms, shared storage, launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        tensors: PointerTensors,
        scale_log2: Float32,
        tok0: Int32,
        NB: Int32,
        stream: cuda.CUstream,
        pscale_log2: Float32,
    ):
        """Launch one CTA per work item. ``tensors``: per tensor of :func:`launch_tensor_names`
        its typed global pointer and mode-0 size (run-time; :class:`~.common.PointerTensors`),
        the rest of its layout in :attr:`views` (:func:`launch_arguments`); rebuilt here as the
        tensors the kernel takes: ``mQ (T*H, D)``; ``mK``, ``mV`` the ``(T, D, Hkv)`` views of
        k and v; ``work`` the work list; partial buffers ``mO (C*H*K, D)`` and ``mL
        (C*H*K,)``; with :attr:`proxy` a :class:`ProxyArgs` (q_proxy, the k_proxy view,
        pl_part and ``pscale_log2``, unused without it). ``scale_log2`` = softmax scale *
        log2(e); ``tok0`` the chunk's first packed token; ``NB`` the work list's block count.
        With :attr:`qmap` ``work`` is a :class:`MappedWorkItems` (the list and its query map
        ``(Tq,)`` int32; ``T`` of ``mQ`` and ``tok0`` then count query rows, ``mK``, ``mV``
        keep the keys' ``T``), else a ``WorkItems``."""
        assert len(self.views) == len(launch_tensor_names(self)), "views of every tensor"
        t = pointer_tensors(tensors, self.views)
        mQ, mK, mV = t[:3]
        mO, mL = t[9:11]
        qmap = cutlass.const_expr(self.qmap)  # (the map travels with the list)
        work = MappedWorkItems(*t[3:9], t[11]) if qmap else WorkItems(*t[3:9])
        proxy = ProxyArgs(*t[-3:], pscale_log2) if cutlass.const_expr(self.proxy) else None
        ROWS, D, BLOCK, WGS = self.ROWS, self.head_dim, self.block_size, self.warpgroups
        dtype = self.dtype
        assert mQ.element_type == dtype and mQ.shape[1] == D and mK.shape[1:] == (D, self.kv_heads)

        def make_qk():
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, BLOCK),
            )  # fmt: skip

        def make_pv():
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, D),
                a_source=warpgroup.OperandSource.RMEM,
            )  # fmt: skip

        mmas = (make_qk(), make_qk(), make_pv(), make_pv())  # first k-slice / accumulating
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, D), dtype, WGS * self.Q_BUFFERS
        )
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, D), dtype, 1)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)),
            (BLOCK, D),
        )  # fmt: skip
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(sK_layout, (None, None, 0)),
            (BLOCK, D),
        )  # fmt: skip
        gather = row_gather_copy(dtype, self.THREADS, D)

        pargs = self.proxy_host(proxy)
        assert isinstance(work, MappedWorkItems) == self.qmap, "a query map exactly when qmap"
        Storage = self.storage(sQ_layout, sK_layout, pargs)
        dp = self.proxy_head_dim if self.proxy else 0
        smem = self.shared_bytes(dtype.width // 8, D, BLOCK, WGS, dp)["total"]
        assert Storage.__sizeof__() == smem <= SHARED_LIMIT, (Storage.__sizeof__(), smem)
        self.kernel(
            mQ, tma_k, tma_mK, tma_v, tma_mV, work, mO, mL, scale_log2, tok0, NB, mmas,
            sQ_layout, sK_layout, gather, Storage, pargs,
        ).launch(
            grid=(work.item_list.shape[0], 1, 1), block=(self.THREADS * WGS, 1, 1), stream=stream
        )  # fmt: skip

    def proxy_host(self, proxy):
        """The proxy part's kernel arguments (traced inline into ``__call__``; ``()`` without
        it): the k_proxy TMA atom and coordinates, q_proxy, pl_part, the scale, the q_proxy
        gather and the q_proxy / k_proxy tile layouts."""
        if not self.proxy:
            assert proxy is None, "proxy arguments given to a kernel without the proxy part"
            return ()
        ROWS, BLOCK, DP, dtype = self.ROWS, self.block_size, self.proxy_head_dim, self.dtype
        mQp, mKp, mPL, pscale_log2 = proxy
        assert mQp.element_type == dtype and mQp.shape[1] == DP
        assert mKp.shape[1:] == (DP, self.proxy_k_heads)
        sQp_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, DP), dtype, self.warpgroups * self.Q_BUFFERS
        )
        sKp_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, DP), dtype, 1
        )
        tma_kp, tma_mKp = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKp, cute.slice_(sKp_layout, (None, None, 0)),
            (BLOCK, DP),
        )  # fmt: skip
        gather_p = row_gather_copy(dtype, self.THREADS, DP)
        return (tma_kp, tma_mKp, mQp, mPL, pscale_log2, gather_p, sQp_layout, sKp_layout)

    def storage(self, sQ_layout, sK_layout, pargs):
        """The shared-memory struct (sizes: :meth:`shared_bytes`); with the proxy part
        (``pargs`` from :meth:`proxy_host`) a second mbarrier, Q buffers that also hold a
        q_proxy tile each, and the k_proxy tile. (Built from an annotation dict: this module's
        postponed annotations would reach ``cute.struct`` as strings.)"""
        MemRange, Align = cute.struct.MemRange, cute.struct.Align
        q_elems = cute.cosize(sQ_layout)
        if self.proxy:
            q_elems = max(q_elems, cute.cosize(pargs[6]))
        fields = {
            "kv_mbar": MemRange[cutlass.Int64, 2 if self.proxy else 1],  # K/V's (+ k_proxy's)
            "sPart": MemRange[cutlass.Int64, self.ROWS * self.warpgroups],
            "sQ": Align[MemRange[self.dtype, q_elems], 1024],
            "sK": Align[MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": Align[MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
        }
        if self.proxy:
            fields["sKp"] = Align[MemRange[self.dtype, cute.cosize(pargs[7])], 1024]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (T * H, D): row t * H + h
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,  # TMA coordinates of k seen as (T, D, Hkv)
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        work: WorkItems | MappedWorkItems,  # the work list (and its query map: qmap)
        mO: cute.Tensor,  # (C * H * K, D) partial outputs, input dtype
        mL: cute.Tensor,  # (C * H * K,) fp32 partial LSEs
        scale_log2: Float32,
        tok0: Int32,
        NB: Int32,
        mmas: tuple,  # (QK first k-slice, QK accumulating, PV first, PV accumulating)
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        gather: cute.TiledCopy,
        Storage: Constexpr,
        pargs: tuple,  # the proxy part's arguments (proxy_host), () without it
    ):
        ROWS, THREADS, D, BLOCK, WGS = (
            self.ROWS, self.THREADS, self.head_dim, self.block_size, self.warpgroups
        )  # fmt: skip
        H, HKV = self.heads, self.kv_heads
        G, G2, R = self.geometry
        t_all, _, _ = cute.arch.thread_idx()
        tidx = t_all % THREADS  # thread in its warpgroup
        wg = cute.arch.make_warp_uniform(t_all // THREADS)  # warpgroup: takes chunks wg, wg+WGS..
        mma_qk, mma_qk_acc, mma_pv, mma_pv_acc = mmas
        mma_qk.set(warpgroup.Field.ACCUMULATE, False)
        mma_qk_acc.set(warpgroup.Field.ACCUMULATE, True)
        mma_pv.set(warpgroup.Field.ACCUMULATE, False)  # one block: O = P V, first k-slice writes
        mma_pv_acc.set(warpgroup.Field.ACCUMULATE, True)
        w, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        st = SmemAllocator().allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, D, WGS * 2)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (BLOCK, D, 1)
        sV = st.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))  # (D, BLOCK)
        sQ_raw = st.sQ.data_ptr()  # the same bytes, unswizzled: partial staging (_staged)
        sPart = st.sPart.get_tensor(cute.make_layout(ROWS * WGS))  # row's partial index or -1
        kv_bar = st.kv_mbar.data_ptr()
        qm = (work.q_map,) if cutlass.const_expr(self.qmap) else ()  # the map, for row_info
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_bar, 1)
                if cutlass.const_expr(self.proxy):
                    cute.arch.mbarrier_init(kv_bar + 1, 1)  # the k_proxy tile's
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        e0 = work.item_start[w]
        e1 = work.item_end[w]
        if e0 < e1:  # CTA-uniform: empty work items (the grid is a worst-case bound) do nothing
            lst = work.item_list[w]
            p = lst // NB
            gb = lst % NB
            ks = work.block_start[gb]  # packed position of the block's first key
            ke = work.block_end[gb]
            if cutlass.const_expr(self.proxy):  # lands during the main part, read after it
                sKp = st.sKp.get_tensor(pargs[7].outer, swizzle=pargs[7].inner)
                self.load_kp(pargs[0], pargs[1], sKp, ks, p, kv_bar + 1, warp_idx)

            thr_qk = mma_qk.get_slice(tidx)
            thr_pv = mma_pv.get_slice(tidx)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, BLOCK)), Float32)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, D)), Float32)
            S_rc = acc_rows_cols(acc_S)
            O_rc = acc_rows_cols(acc_O)
            cS = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((ROWS, BLOCK))))
            cO = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((ROWS, D))))
            rP = cute.make_rmem_tensor_like(acc_S, mQ.element_type)
            tOrP = acc_as_a(rP)
            rO = cute.make_rmem_tensor_like(acc_O, mQ.element_type)

            thr_g = gather.get_slice(tidx)
            tGsQ = thr_g.partition_D(sQ)  # ((8, 1), passes, 1, WGS * 2)
            tGcQ = thr_g.partition_D(cute.make_identity_tensor((ROWS, D)))
            g_col = tGcQ[0, 0, 0][1]
            BT = ROWS // G2  # tokens per chunk
            n_chunks = (e1 - e0 + BT - 1) // BT

            for r in cutlass.range_constexpr(R):
                h0 = p * G + r * G2  # first main head of this KV sub-group
                kvh = h0 // (H // HKV)
                gq = (gather, mQ, work.perm, tGsQ, tGcQ, g_col, e0, e1, h0, G2, H)
                # buffer 0 is free (the barriers closing the last sub-group): the first chunk's
                # rows land during the K/V load
                if wg < n_chunks:
                    self.gather(*gq, wg, wg * self.Q_BUFFERS)
                # K/V change only where a sub-group starts a new KV head (static: p * G is a
                # multiple of the KV group or inside one); reloading the same tile is skipped
                if cutlass.const_expr(r == 0 or (r * G2) % (H // HKV) == 0):
                    self.load_kv(tma_k, mK, tma_v, mV, sK, sV, ks, kvh, kv_bar, warp_idx)
                    cute.arch.mbarrier_wait(kv_bar, _loads_before(r, G2, H // HKV) % 2)

                for ch in cutlass.range(wg, n_chunks, WGS, unroll=1):
                    # this thread's two rows: token (for the causal mask), partial slot,
                    # validity. Loaded first so the global-load latency overlaps the gather
                    # wait and the MMA.
                    row_tok, row_part, row_ok = self.row_info(
                        work.perm, cS, e0 + ch * BT, e1, h0, tok0, G2, H, qm
                    )
                    # 1. this chunk's query rows in shared memory (the next chunk's issued)
                    qb = self.chunk_ready(gq, ch, n_chunks, wg)

                    # 2. S = Q K^T
                    self.qk(mma_qk, mma_qk_acc, acc_S, tSrQ, tSrK, qb)
                    # 3. mask and exponentiate (each thread: 2 rows, BLOCK / 4 columns)
                    row_max, row_sum = self.softmax(S_rc, cS, ks, ke, row_tok, scale_log2)
                    # 4. O = P V (P from registers)
                    self.pv(mma_pv, mma_pv_acc, acc_O, acc_S, rP, tOrP, tOrV)
                    # 5. normalized partial and natural-log LSE into the row's slot
                    self.store(
                        O_rc, acc_O, rO, cO, sQ_raw, qb, sPart, mO, mL, wg, tidx, row_part,
                        row_ok, row_max, row_sum, scale_log2,
                    )  # fmt: skip
                    self.wg_sync(wg)  # this Q buffer is overwritten by a later gather
                cute.arch.sync_threads()  # sK / sV may be overwritten by the next sub-group's TMA

            if cutlass.const_expr(self.proxy):  # every Q buffer is free (the barrier above)
                sQp = st.sQ.get_tensor(pargs[6].outer, swizzle=pargs[6].inner)  # (64, Dp, WGS*2)
                # p reloaded (an L1 hit), not kept live through the main part: with it live,
                # ptxas spilled 16-32 bytes at 168 registers (paper; D = 128, Dp = 64)
                pp = work.item_list[w] // NB
                self.proxy_part(
                    pargs, sQp, sKp, mma_qk, mma_qk_acc, acc_S, S_rc, cS, work.perm, e0, e1, pp,
                    ks, ke, tok0, kv_bar + 1, wg, tidx, qm,
                )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # device roles (traced inline into the kernel)
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def wg_sync(self, wg):
        """Barrier of warpgroup ``wg``'s 128 threads (the whole CTA when it has one warpgroup)."""
        if cutlass.const_expr(self.warpgroups == 1):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=self.THREADS)

    @cute.jit
    def gather(self, gather, mQ, mPerm, tGsQ, tGcQ, g_col, e0, e1, h0, G2, H, ch, buf):
        """cp.async the query rows of chunk ``ch`` of a work item into Q buffer ``buf`` (one
        commit group); pad rows (past the item's end) re-load the last valid row. A chunk row
        is (token, head): ``64 / G2`` tokens x ``G2`` heads from ``h0`` of the ``H`` heads of
        ``mQ`` (the proxy part: G2 = 1, ``h0`` = p, H = Hs)."""
        BT = self.ROWS // G2
        c = e0 + ch * BT
        for ps in cutlass.range_constexpr(cute.size(tGsQ, mode=[1])):
            row = tGcQ[0, ps, 0][0]
            e = cutlass.min(c + row // G2, e1 - 1)
            t = mPerm[e] // (self.sel_heads * self.top_k)
            qrow = t * H + h0 + row % G2
            off = cute.assume(Int64(qrow) * mQ.stride[0] + g_col, divby=8)
            src = cute.make_tensor(mQ.iterator + off, cute.make_layout(((8, 1),)))
            cute.copy(gather, src, tGsQ[None, ps, 0, buf])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_kv(self, tma_k, mK, tma_v, mV, sK, sV, ks, kvh, kv_bar, warp_idx):
        """Issue the TMA loads of KV head ``kvh``'s K and V tiles of the block starting at packed
        position ``ks`` (warp 0), completing on ``kv_bar``."""
        BLOCK, D = self.block_size, self.head_dim
        gK = cute.local_tile(
            cute.domain_offset((ks, 0, 0), mK)[None, None, kvh], (BLOCK, D), (0, 0)
        )
        gV = cute.local_tile(
            cute.domain_offset((ks, 0, 0), mV)[None, None, kvh], (BLOCK, D), (0, 0)
        )
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    kv_bar, 2 * BLOCK * D * (self.dtype.width // 8)
                )
            cute.copy(tma_k, tKgK, tKsK[(None, 0)], tma_bar_ptr=kv_bar)
            cute.copy(tma_v, tVgV, tVsV[(None, 0)], tma_bar_ptr=kv_bar)

    @cute.jit
    def load_kp(self, tma_kp, mKp, sKp, ks, p, kp_bar, warp_idx):
        """Issue the TMA load of the k_proxy tile of selection head ``p``'s proxy key head for
        the block starting at packed position ``ks`` (warp 0), completing on ``kp_bar``."""
        BLOCK, DP = self.block_size, self.proxy_head_dim
        pk = p // (self.sel_heads // self.proxy_k_heads)
        gKp = cute.local_tile(
            cute.domain_offset((ks, 0, 0), mKp)[None, None, pk], (BLOCK, DP), (0, 0)
        )
        tKsK, tKgK = tma_tiles(tma_kp, sKp, gKp)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    kp_bar, BLOCK * DP * (self.dtype.width // 8)
                )
            cute.copy(tma_kp, tKgK, tKsK[(None, 0)], tma_bar_ptr=kp_bar)

    @cute.jit
    def proxy_part(
        self, pargs, sQp, sKp, mma_qk, mma_qk_acc, acc_S, S_rc, cS, mPerm, e0, e1, p, ks, ke,
        tok0, kp_bar, wg, tidx, qm=(),
    ):  # fmt: skip
        """The item's proxy LSE partials: chunks of 64 tokens (row = token, head ``p``) taken
        in turn by the warpgroups, each ``S = q_proxy k_proxy^T`` into the main part's S
        registers, masked like the main part, and the natural-log LSE of ``proxy_scale * S``
        stored at the row's slot of ``pl_part``. Q buffers and double buffering as in the main
        part; called after a CTA barrier (every Q buffer free). ``qm``: the query map's kernel
        arguments (:attr:`qmap`)."""
        ROWS, WGS, HS, DP = self.ROWS, self.warpgroups, self.sel_heads, self.proxy_head_dim
        mQp, mPL, pscale_log2, gather_p = pargs[2], pargs[3], pargs[4], pargs[5]
        thr_qk = mma_qk.get_slice(tidx)
        tSrQp = mma_qk.make_fragment_A(thr_qk.partition_A(sQp))
        tSrKp = mma_qk.make_fragment_B(thr_qk.partition_B(sKp))
        thr_g = gather_p.get_slice(tidx)
        tGsQp = thr_g.partition_D(sQp)  # ((8, 1), passes, 1, WGS * 2)
        tGcQp = thr_g.partition_D(cute.make_identity_tensor((ROWS, DP)))
        gq = (gather_p, mQp, mPerm, tGsQp, tGcQp, tGcQp[0, 0, 0][1], e0, e1, p, 1, HS)
        n_chunks = (e1 - e0 + ROWS - 1) // ROWS
        if wg < n_chunks:
            self.gather(*gq, wg, wg * self.Q_BUFFERS)
        cute.arch.mbarrier_wait(kp_bar, 0)  # one k_proxy tile per CTA: phase 0
        for ch in cutlass.range(wg, n_chunks, WGS, unroll=1):
            row_tok, row_part, row_ok = self.row_info(
                mPerm, cS, e0 + ch * ROWS, e1, p, tok0, 1, HS, qm
            )
            qb = self.chunk_ready(gq, ch, n_chunks, wg)
            self.qk(mma_qk, mma_qk_acc, acc_S, tSrQp, tSrKp, qb)
            row_max, row_sum = self.softmax(S_rc, cS, ks, ke, row_tok, pscale_log2)
            for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
                if cS[i, 0][1] == 0 and row_ok[i]:  # the quad's leader stores the row's LSE
                    self.store_lse(mPL, row_part[i], row_max[i], row_sum[i], pscale_log2)
            self.wg_sync(wg)  # this Q buffer is overwritten by a later gather

    @cute.jit
    def chunk_ready(self, gq, ch, n_chunks, wg):
        """Warpgroup ``wg``'s chunk ``ch`` (of ``n_chunks``, taken every ``warpgroups``) in
        shared memory, its Q buffer returned: the next chunk's gather (arguments ``gq`` of
        :meth:`gather`) is issued first into the other buffer, whose rows were last read in the
        previous iteration before its closing barrier, and lands while this chunk computes;
        then this chunk's group is waited for, fenced for the async proxy (wgmma reads it) and
        the warpgroup synchronized. The main and the proxy part's chunk loops both start so."""
        WGS = self.warpgroups
        stage = (ch // WGS) % 2
        qb = wg * self.Q_BUFFERS + stage
        if ch + WGS < n_chunks:
            self.gather(*gq, ch + WGS, wg * self.Q_BUFFERS + 1 - stage)
            cute.arch.cp_async_wait_group(1)  # all but the newest group
        else:
            cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.wg_sync(wg)
        return qb

    @cute.jit
    def row_info(self, mPerm, cS, c, e1, h0, tok0, G2, H, qm=()):
        """For each of this thread's two rows of the chunk whose first entry is ``c`` (rows as
        in :meth:`gather`): its causal position (its token ``t``; with the query map ``qm`` the
        query row ``t``'s token ``q_map[t]``), its partial index ``((t - tok0) * H + h) * K +
        slot`` and whether it is a real entry. (A pad row past the item's end repeats the last
        entry's row: a real row, never a padding row of the map.)"""
        HS, K = self.sel_heads, self.top_k
        row_tok = []
        row_part = []
        row_ok = []
        for i in cutlass.range_constexpr(cute.size(cS, mode=[0])):
            row = cS[i, 0][0]
            e = c + row // G2
            flat = mPerm[cutlass.min(e, e1 - 1)]
            t = flat // (HS * K)
            if cutlass.const_expr(self.qmap):  # the causal position: the row's token
                row_tok.append(qm[0][t])
            else:
                row_tok.append(t)
            row_part.append(((t - tok0) * H + h0 + row % G2) * K + flat % K)
            row_ok.append(e < e1)
        return row_tok, row_part, row_ok

    @cute.jit
    def qk(self, mma_first, mma_rest, acc_S, tSrQ, tSrK, qb):
        """``acc_S = Q[qb] K^T`` (warpgroup MMAs from shared memory, waited for)."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma = mma_first if kb == 0 else mma_rest
            cute.gemm(mma, acc_S, tSrQ[None, None, kb, qb], tSrK[None, None, kb, 0], acc_S)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def softmax(self, S_rc, cS, ks, ke, row_tok, scale_log2):
        """Mask keys at or past ``ke`` (the block's end) or after the row's token, and replace
        the scores by ``exp2((S - max) * scale_log2)`` in place; returns each row's max and
        exp2-sum (quad-reduced). A row with no visible key gets max 0 and sum 0."""
        row_max = []
        row_sum = []
        for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
            mx = -Float32.inf
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                kpos = ks + cS[i, j][1]
                if kpos >= ke or kpos > row_tok[i]:
                    S_rc[i, j] = -Float32.inf
                mx = cute.arch.fmax(mx, S_rc[i, j])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            mx = Float32(0.0) if mx == -Float32.inf else mx  # a row with no key
            ssum = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                pv = cute.math.exp2(S_rc[i, j] * scale_log2 - mx * scale_log2, fastmath=True)
                S_rc[i, j] = pv
                ssum += pv
            ssum += cute.arch.shuffle_sync_bfly(ssum, offset=1)
            ssum += cute.arch.shuffle_sync_bfly(ssum, offset=2)
            row_max.append(mx)
            row_sum.append(ssum)
        return row_max, row_sum

    @cute.jit
    def pv(self, mma_first, mma_rest, acc_O, acc_S, rP, tOrP, tOrV):
        """``acc_O = P V`` with P (``acc_S`` in the input dtype) from registers and V through
        its transposed shared view (warpgroup MMAs, waited for)."""
        rP.store(acc_S.load().to(rP.element_type))
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            mma = mma_first if kb == 0 else mma_rest
            cute.gemm(mma, acc_O, tOrP[None, None, kb], tOrV[None, None, kb, 0], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def store(
        self, O_rc, acc_O, rO, cO, sQ_raw, qb, sPart, mO, mL, wg, tidx, row_part, row_ok,
        row_max, row_sum, scale_log2,
    ):  # fmt: skip
        """Write the chunk's normalized partials ``O / l`` and LSEs into the rows' slots.

        The tile goes through shared memory first (Q buffer ``qb`` of ``sQ_raw``, this chunk's; a
        warp overwrites only its own 16 rows, which its finished QK MMA no longer reads) so
        that global stores are 16-byte pieces of whole rows, not a thread's scattered column
        pairs; ``sPart`` passes each row's partial index (or -1) to the warp's lanes."""
        D, ROWS = self.head_dim, self.ROWS
        for i in cutlass.range_constexpr(cute.size(O_rc, mode=[0])):
            ssum = row_sum[i]
            inv = Float32(0.0) if ssum == 0.0 else cute.arch.rcp_approx(ssum)
            for j in cutlass.range_constexpr(cute.size(O_rc, mode=[1])):
                O_rc[i, j] = O_rc[i, j] * inv
        rO.store(acc_O.load().to(mO.element_type))
        rO_pairs = _pairs(acc_rows_cols(rO))  # (2, rows, pairs)
        stage_base = sQ_raw + qb * (ROWS * D)
        for i in cutlass.range_constexpr(cute.size(O_rc, mode=[0])):
            row = cO[i, 0][0]
            for jj in cutlass.range_constexpr(cute.size(rO_pairs, mode=[2])):
                col = cO[i, 2 * jj][1]
                off = _staged(row, col // 8) + col % 8
                sdst = cute.make_tensor(stage_base + cute.assume(off, divby=2), cute.make_layout(2))
                cute.autovec_copy(rO_pairs[None, i, jj], sdst)
            if cO[i, 0][1] == 0:
                part = row_part[i]
                sPart[wg * ROWS + row] = part if row_ok[i] else Int64(-1)
                if row_ok[i]:
                    self.store_lse(mL, part, row_max[i], row_sum[i], scale_log2)
        cute.arch.sync_warp()
        lane = tidx % 32
        for it in cutlass.range_constexpr(D // 16):  # 16 rows x D/8 pieces / 32 lanes
            piece = it * 32 + lane
            srow = (tidx // 32) * 16 + piece // (D // 8)
            unit = piece % (D // 8)
            gpart = sPart[wg * ROWS + srow]
            if gpart >= 0:
                ssrc = cute.make_tensor(
                    stage_base + cute.assume(_staged(srow, unit), divby=8), cute.make_layout(8)
                )
                vals = cute.make_rmem_tensor(8, mO.element_type)
                cute.autovec_copy(ssrc, vals)
                gdst = cute.make_tensor(
                    mO.iterator + cute.assume(gpart * D + unit * 8, divby=8), cute.make_layout(8)
                )
                cute.autovec_copy(vals, gdst)

    @cute.jit
    def store_lse(self, mL: cute.Tensor, part, mx, ssum, scale_log2):
        """Store the natural-log LSE of a row with max ``mx`` and exp2-sum ``ssum`` (``-inf``
        for a row with no visible key: ``log2(0) = -inf``; NaN for a row with a NaN score,
        whose ``ssum`` is NaN) at partial index ``part``."""
        mL[part] = (mx * scale_log2 + cute.math.log2(ssum)) * LN2


# ---------------------------------------------------------------------------------------------
# host: the partials of one query chunk over a work list
# ---------------------------------------------------------------------------------------------
def partials(q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None):
    """Driver stage ``partials`` (:mod:`flash_msa.sparse_forward`, which states the buffers'
    contract): fill ``o_part (C, H, K, D)`` and ``l_part (C, H, K)`` for packed tokens
    ``tok0 .. tok0 + C`` from work list ``wl`` (:func:`flash_msa.worklist.build`); with
    ``proxy = (q_proxy, k_proxy, pl_part)`` also the proxy LSE partials ``pl_part (C, Hs, K)``
    in the same launch (``FwdPartialsSm90(proxy=True)``; :func:`proxy_fits` says where it
    can run). With the work list's query map ``wl.q_map`` (``worklist.build(..., q_map)``) the
    rows ``tok0 .. tok0 + C`` are query rows (``q``, ``q_proxy``: ``Tq`` rows; ``k``, ``v``,
    ``k_proxy``: the keys' ``T``), run by ``FwdPartialsSm90(qmap=True)``."""
    H, D = q.shape[1:]
    Hkv = k.shape[1]
    variant = {}
    if proxy is not None:
        q_proxy, k_proxy, _ = proxy
        _check_proxy_inputs(q, k, q_proxy, k_proxy, wl.heads)  # before their shapes are read
        variant = dict(proxy=True, proxy_head_dim=q_proxy.shape[2], proxy_k_heads=k_proxy.shape[1])
    # (raises ValueError with the reason if the kernel cannot run this configuration)
    kernel = FwdPartialsSm90(
        cutlass_dtype(q.dtype), H, Hkv, wl.heads, D, wl.slots, cfg.block_size,
        FwdPartialsSm90.warpgroups, **variant, qmap=wl.q_map is not None,
    )  # fmt: skip
    launch(kernel, q, k, v, wl, o_part, l_part, cfg, tok0, proxy)


def launch(kernel: FwdPartialsSm90, q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None):
    """One launch of ``kernel`` over work list ``wl`` (arguments as :func:`partials`, which
    picks the kernel): the buffers and the query map checked, ValueError naming the argument;
    the map ``wl.q_map`` goes to a ``qmap`` kernel, and only there."""
    T, H, D = q.shape
    if kernel.qmap != (wl.q_map is not None):
        raise ValueError(
            f"CuTe forward partials: a kernel with qmap={kernel.qmap} for a work list "
            f"{'with' if wl.q_map is not None else 'without'} a query map (wl.q_map)"
        )
    q_map = wl.q_map
    if q_map is not None and (
        q_map.shape != (T,) or q_map.dtype != torch.int32 or q_map.device != q.device
    ):
        raise ValueError(
            f"CuTe forward partials: wl.q_map must be an int32 ({T},) tensor on {q.device} (a "
            f"row of q each), got {q_map.dtype} {tuple(q_map.shape)} on {q_map.device}"
        )
    buffers = [("o_part", o_part, (H, wl.slots, D)), ("l_part", l_part, (H, wl.slots))]
    if proxy is not None:
        q_proxy, k_proxy, pl_part = proxy
        buffers.append(("pl_part", pl_part, (wl.heads, wl.slots)))
    for name, buf, shape in buffers:
        dtype = q.dtype if name == "o_part" else torch.float32
        if buf.dtype != dtype:
            raise ValueError(f"CuTe forward partials: {name} must be {dtype}, not {buf.dtype}")
        if tuple(buf.shape[1:]) != shape or not buf.is_contiguous() or buf.data_ptr() % 16:
            raise ValueError(
                f"CuTe forward partials: {name} must be a contiguous, 16-byte aligned (C, "
                f"{', '.join(map(str, shape))}) buffer; got shape {tuple(buf.shape)}, strides "
                f"{buf.stride()}, address % 16 = {buf.data_ptr() % 16}"
            )
    # (contiguous: the launch bakes every stride in, mode 0's size aside; a tensor laid out
    # otherwise is copied once here, where its CuTe view had a run-time stride before)
    tensors = [
        aligned(q.contiguous()).view(T * H, D),
        aligned(k.contiguous()).permute(0, 2, 1),  # (T, D, Hkv): a TMA box = one head's block
        aligned(v.contiguous()).permute(0, 2, 1),
        *(aligned(x) for x in wl[:6]),  # (fresh buffers: the check is a formality)
        o_part.view(-1, D),
        l_part.view(-1),
    ]
    if q_map is not None:  # (the map travels with the list: MappedWorkItems)
        tensors.append(aligned(q_map.contiguous()))
    pscale_log2 = 1.0
    if proxy is not None:
        Hs, Dp = q_proxy.shape[1:]
        tensors += [
            aligned(q_proxy.contiguous()).view(T * Hs, Dp),
            aligned(k_proxy.contiguous()).permute(0, 2, 1),  # (T, Dp, Hpk)
            pl_part.view(-1),
        ]
        pscale_log2 = (cfg.proxy_scale or 1.0) * math.log2(math.e)
    scalars = (cfg.softmax_scale * math.log2(math.e), tok0, wl.num_blocks, pscale_log2)
    kernel, args = launch_arguments(kernel, tensors, scalars, stream(q.device))
    run_typed(kernel, q.device, args, LAUNCH_SIGNATURE)


def launch_tensor_names(kernel: FwdPartialsSm90) -> tuple[str, ...]:
    """The launch's tensors, in the order of ``kernel.views`` and its ``__call__``'s pointers:
    q, k, v, the work list's six, o_part, l_part (+ q_map with :attr:`~FwdPartialsSm90.qmap`,
    + q_proxy, k_proxy, pl_part with :attr:`~FwdPartialsSm90.proxy`); for a
    :class:`FwdKlSm90` q, k, the work list's six, lse, q_proxy, k_proxy, proxy_lse, sums."""
    if isinstance(kernel, FwdKlSm90):
        return _KL_TENSORS
    return _TENSORS[kernel.qmap, kernel.proxy]


_WORK = ("perm", "item_list", "item_start", "item_end", "block_start", "block_end")
_MAIN = ("q", "k", "v", *_WORK, "o_part", "l_part")
_PROXY = ("q_proxy", "k_proxy", "pl_part")
_TENSORS = {
    (qmap, proxy): _MAIN + ("q_map",) * qmap + _PROXY * proxy
    for qmap in (False, True)
    for proxy in (False, True)
}
_KL_TENSORS = ("q", "k", *_WORK, "lse", "q_proxy", "k_proxy", "proxy_lse", "sums")


def launch_arguments(kernel: FwdPartialsSm90, tensors, scalars, strm):
    """``(kernel', args)`` of a launch of ``kernel`` (a :class:`FwdPartialsSm90` or
    :class:`FwdKlSm90`): ``tensors`` the torch tensors of :func:`launch_tensor_names`, laid out
    as its ``__call__`` takes them, ``scalars`` its scalars in ``__call__``'s order (floats and
    ints: ``scale_log2, tok0, NB, pscale_log2`` / ``scale_log2, pscale_log2, NB``), ``strm``
    the stream. ``kernel'`` is ``kernel`` with ``views`` set to the tensors' layouts
    (``launch.view_layout``: what their CuTe views baked in; the element types too), ``args``
    its ``__call__``'s arguments: typed pointers and mode-0 sizes in one
    :class:`~.common.PointerTensors` (``launch.pointer_arguments``: ~1 us a tensor instead of a
    DLPack view's 10-40 us), the scalars as ``Float32`` / ``Int32``. Every argument's type is then
    fixed by ``kernel'``, so :func:`~.launch.run_typed` keys the compile cache on it alone.
    ValueError (naming the tensor) for a wrong tensor count, a base that is not 16-byte aligned, a
    tensor on another device than q, or a layout whose view would have a run-time stride."""
    names = launch_tensor_names(kernel)
    what = "CuTe KL stage" if isinstance(kernel, FwdKlSm90) else "CuTe forward partials"
    if len(tensors) != len(names):
        raise ValueError(f"{what}: {len(tensors)} launch tensors, {len(names)} expected")
    views, pointers = pointer_arguments(what, names, tensors, tensors[0].device)
    if isinstance(kernel, FwdKlSm90):
        scale_log2, pscale_log2, nb = scalars
        typed = (Float32(scale_log2), Float32(pscale_log2), Int32(nb), strm)
    else:
        scale_log2, tok0, nb, pscale_log2 = scalars
        typed = (Float32(scale_log2), Int32(tok0), Int32(nb), strm, Float32(pscale_log2))
    return bound(kernel, views), (pointers, *typed)


# the disk cache's text for the argument types: fixed by the kernel object (its views) and
# this module's source (both in the disk key); launches go through launch.run_typed
LAUNCH_SIGNATURE = "fwd_partials_sm90.launch_arguments"


def _check_proxy_inputs(q, k, q_proxy, k_proxy, Hs):
    """ValueError naming the argument unless q_proxy ``(T, Hs, Dp)`` and k_proxy ``(T, Hpk,
    Dp)`` match q's dtype and token count (the kernel has one element type)."""
    T = q.shape[0]
    if q_proxy.dim() != 3:
        raise ValueError(
            f"CuTe forward partials: q_proxy must be (T, Hs, Dp); got {tuple(q_proxy.shape)}"
        )
    for name, x, rows in (("q_proxy", q_proxy, T), ("k_proxy", k_proxy, k.shape[0])):
        if x.dtype != q.dtype:
            raise ValueError(f"CuTe forward partials: {name} must be {q.dtype}, not {x.dtype}")
        if x.dim() != 3 or x.shape[0] != rows or x.shape[2] != q_proxy.shape[2]:
            raise ValueError(
                f"CuTe forward partials: {name} must be ({rows}, heads, {q_proxy.shape[2]}); "
                f"got {tuple(x.shape)}"
            )
    if q_proxy.shape[1] != Hs:
        raise ValueError(
            f"CuTe forward partials: q_proxy has {q_proxy.shape[1]} heads, the work list {Hs}"
        )


def proxy_fits(q, k, q_proxy, k_proxy, indices, cfg) -> bool:
    """Whether :func:`partials` can make this call's proxy LSE partials in its own launch (a
    proxy in q's dtype, and the head layout, dims, block and shared memory that
    ``FwdPartialsSm90.can_implement(proxy=True)`` accepts)."""
    if q_proxy is None or q_proxy.dtype != q.dtype or k_proxy.dtype != q.dtype:
        return False
    why = FwdPartialsSm90.can_implement(
        cutlass_dtype(q.dtype), q.shape[1], k.shape[1], q_proxy.shape[1], q.shape[2],
        indices.shape[2], cfg.block_size, FwdPartialsSm90.warpgroups, True, q_proxy.shape[2],
        k_proxy.shape[1],
    )  # fmt: skip
    return why is None


# ---------------------------------------------------------------------------------------------
# the KL value on this kernel: FwdKlSm90, the driver stage kl
# ---------------------------------------------------------------------------------------------
# The CuTe forward's ``kl`` stage (``cute.forward.forward_stages``; tests/ops/test_kl.py on
# the H200). The KL stage alone, H200: 1.11 / 2.03 / 4.98 / 17.5 ms at anchor 16K / 32K, paper
# 32K / 128K, against 2.17 / 3.66 / 12.11 / 43.75 for the fused backward's kernel in a KL mode
# and 3.56 / 7.29 / 18.48 / 73.96 for Triton's stage; sums equal to 6e-7 relative. The calls
# this kernel cannot run (a query map, D != Dp) take Triton's stage (``kl_fits``).

LOG2E = 1.4426950408889634
TINY = 1.1754944e-38  # the smallest normal fp32: lg2.approx.ftz takes a subnormal t for 0


def _lp_index(row, col, block: int):
    """Element offset of (token ``row``, key ``col``) in a warpgroup's ``(64, block)`` fp32 tile
    of proxy log2-probabilities: row-major, 8-float groups XOR-swizzled by ``row % 8``, so the
    accumulator's column-pair writes (8 rows x 8 floats per warp) and the teacher lanes' reads
    of one row (:meth:`FwdKlSm90.chunk_terms`) take the fewest shared-memory wavefronts."""
    return row * block + ((col // 8) ^ (row % 8)) * 8 + col % 8


@dataclass(frozen=True)
class FwdKlSm90(FwdPartialsSm90):
    """The forward's KL value on the forward partials' kernel (its KL mode: no ``P V``, no
    partial stores): per work item (selection head ``p``, key block, up to 256 tokens) the sum
    over the item's (token, visible key) pairs of ``t (ln t - ln p')``, ``t = (1/G) sum_h
    exp(s[h] - lse[h])`` over the ``G`` main heads of ``p`` (the final ``lse``), ``ln p' = s' -
    proxy_lse`` (docs/algorithm.md, "The proxy KL"), ``0 ln 0 = 0``.

    A CTA loads the block's K tile (the group's one KV head) and k_proxy tile by TMA; its
    ``warpgroups`` warpgroups take turns at super-chunks of 64 tokens (warpgroup ``w``: ``w,
    w + warpgroups, ...``). For a super-chunk a warpgroup

    1. gathers its 64 tokens' q_proxy rows (head ``p``), computes ``S' = q_proxy k_proxy^T``
       (one ``m64nBLOCK`` wgmma chain) and stores ``log2 p' = S' * proxy_scale * log2 e -
       proxy_lse * log2 e`` into its own ``(64, BLOCK)`` fp32 tile of shared memory;
    2. takes the ``G`` main chunks of those tokens, each 64 rows = ``64 / G`` tokens x their
       ``G`` heads (token-major: one warp's 16 rows are whole tokens): gathers the q rows,
       computes ``S = q K^T``, ``P = exp2(S * scale * log2 e - lse * log2 e)`` (0 past the
       block's end, after the token, and for pad rows), and sums each token's ``G`` heads
       inside the warp: the thread's two rows where they are one token (``G = 16``), then a
       reduce-scatter over lane bits 2, 3, 4 (as far as ``G`` needs: each xor-shuffle level
       halves the columns a lane keeps, so a lane ends with distinct columns and no sum is
       made twice); each lane then adds ``t (log2 t - log2 p')`` for its columns, reading
       ``log2 p'`` from step 1's tile.

    The q and q_proxy gathers are one double-buffered stream per warpgroup (the next step's
    rows issued before this step's wait). The item's sum: each thread's terms in program
    order, the warp's lanes by butterfly shuffles, the CTA's warps in order (thread 0), times
    ln 2: the same bits every run. Limits (:meth:`can_implement`): bf16 / fp16, D and Dp 64 or
    128, block 64 or 128, G = H / Hs a power of two <= 16 whose heads share one KV head, Hs a
    multiple of Hpk; no query map (the forward borrows Triton's stage for a mapped call).

    Resources (sm_90a, 2 warpgroups = 256 threads; compile_check "fwd kl"): shared memory
    (:meth:`kl_shared_bytes`) 4 Q buffers of 64 x max(D, Dp) + K and k_proxy tiles + 2 log2 p'
    tiles of 64 x BLOCK fp32: 197,632 bytes at D = Dp = 128, block 128 (3 warpgroups fit only
    with smaller tiles), so one CTA per SM; registers: see ``tests/cute_host/test_kl.py``
    and the compile check (no spills)."""

    LABEL: ClassVar[str] = "CuTe KL stage"

    warpgroups: int = 2  # 3 exceeds the shared memory at D = Dp = 128, block 128
    proxy: bool = True  # the KL needs the proxy part's inputs (always True here)

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def kl_shared_bytes(
        elem_bytes: int, head_dim: int, proxy_head_dim: int, block_size: int, warpgroups: int
    ) -> dict:
        """Bytes of each shared-memory buffer of the KL mode, in the order of its ``Storage``
        struct (operand tiles aligned to 1024 bytes), and their sum."""
        rows = FwdPartialsSm90.ROWS
        sizes = {
            "mbar": 16,  # the K tile's and the k_proxy tile's mbarriers
            "sRed": 16 * warpgroups,  # one fp32 per warp: the item sum's second level
            "sQ": rows * max(head_dim, proxy_head_dim) * elem_bytes * 2 * warpgroups,
            "sK": block_size * head_dim * elem_bytes,
            "sKp": block_size * proxy_head_dim * elem_bytes,
            "sLp": rows * block_size * 4 * warpgroups,  # log2 p' per warpgroup (fp32)
        }
        end = 0
        for name, size in sizes.items():
            if name not in ("mbar", "sRed"):
                end = -(-end // 1024) * 1024
            end += size
        return {**sizes, "total": end}

    @classmethod
    def can_implement(
        cls, dtype, heads, kv_heads, sel_heads, head_dim, top_k, block_size, warpgroups=2,
        proxy=True, proxy_head_dim=128, proxy_k_heads=1,
    ) -> str | None:  # fmt: skip
        """Why the KL mode cannot run this configuration (``None``: it can); class docstring."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"the CuTe KL stage needs bf16 or fp16, not {dtype}"
        if head_dim not in (64, 128) or proxy_head_dim not in (64, 128):
            return f"the CuTe KL stage needs D and Dp 64 or 128, not {head_dim}, {proxy_head_dim}"
        if head_dim != proxy_head_dim:
            # the q and q_proxy gathers share one double-buffered Q region read through two
            # views whose buffer strides are 64 x D and 64 x Dp elements: with D != Dp their
            # buffers overlap (a race within and across warpgroups: tests/cute_host/test_kl.py).
            # Triton's stage runs these calls.
            return f"the CuTe KL stage needs D == Dp, not {head_dim} and {proxy_head_dim}"
        if block_size not in (64, 128):
            return f"the CuTe KL stage needs block_size 64 or 128, not {block_size}"
        if warpgroups not in (1, 2, 3):
            return f"the CuTe KL stage has 1-3 warpgroups per CTA, not {warpgroups}"
        if not proxy:
            return "the CuTe KL stage needs the proxy (proxy=True)"
        if top_k is not None and top_k < 1:
            return f"top_k must be positive, not {top_k}"
        if heads % sel_heads or heads % kv_heads:
            return f"H={heads} must be a multiple of the selection ({sel_heads}) and KV heads"
        G = heads // sel_heads
        if G > 16 or G & (G - 1):
            return f"the CuTe KL stage needs H / Hs a power of two <= 16, not {G}"
        if (heads // kv_heads) % G:
            return f"the {G} heads of a selection head must share one KV head (Hkv={kv_heads})"
        if proxy_k_heads < 1 or sel_heads % proxy_k_heads:
            return (
                f"the selection heads ({sel_heads}) must be a multiple of the proxy key heads "
                f"({proxy_k_heads})"
            )
        smem = cls.kl_shared_bytes(
            dtype.width // 8, head_dim, proxy_head_dim, block_size, warpgroups
        )["total"]
        if smem > SHARED_LIMIT:
            return f"{smem} bytes of shared memory exceed the sm_90 capacity ({SHARED_LIMIT})"
        return None

    def __post_init__(self):
        super().__post_init__()  # (this class's can_implement, with LABEL)
        if self.qmap:
            raise ValueError("CuTe KL stage: no query map (Triton's stage runs a mapped call)")

    # -----------------------------------------------------------------------------------------
    # host
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        tensors: PointerTensors,
        scale_log2: Float32,
        pscale_log2: Float32,
        NB: Int32,
        stream: cuda.CUstream,
    ):
        """Launch one CTA per work item. ``tensors``: per tensor of :func:`launch_tensor_names`
        its typed global pointer and mode-0 size (:class:`~.common.PointerTensors`), the rest
        of its layout in :attr:`views` (:func:`launch_arguments`); rebuilt here as ``mQ (T*H, D)``,
        ``mK`` the ``(T, D, Hkv)`` view of k, the work list, ``mLSE (T*H,)`` the final LSEs,
        ``mQp (T*Hs, Dp)``, ``mKp`` the ``(T, Dp, Hpk)`` view of k_proxy, ``mPLSE (T*Hs,)``
        the final proxy LSEs (natural log), ``mSum (W,)`` fp32: each item's KL sum (every CTA
        writes its own, 0 for an empty item)."""
        assert len(self.views) == len(launch_tensor_names(self)), "views of every tensor"
        t = pointer_tensors(tensors, self.views)
        mQ, mK = t[:2]
        work = WorkItems(*t[2:8])
        mLSE, mQp, mKp, mPLSE, mSum = t[8:13]
        ROWS, D, DP, BLOCK, WGS = (
            self.ROWS, self.head_dim, self.proxy_head_dim, self.block_size, self.warpgroups
        )  # fmt: skip
        dtype = self.dtype
        assert mQ.element_type == dtype and mQ.shape[1] == D and mK.shape[1:] == (D, self.kv_heads)
        assert mQp.element_type == dtype and mQp.shape[1] == DP
        assert mKp.shape[1:] == (DP, self.proxy_k_heads)

        def make_qk():
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(ROWS, BLOCK),
            )  # fmt: skip

        mmas = (make_qk(), make_qk())  # first k-slice / accumulating
        nbuf = WGS * self.Q_BUFFERS
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, D), dtype, nbuf
        )
        sQp_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, DP), dtype, nbuf
        )
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, D), dtype, 1)
        sKp_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (ROWS, BLOCK, DP), dtype, 1
        )
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)),
            (BLOCK, D),
        )  # fmt: skip
        tma_kp, tma_mKp = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKp, cute.slice_(sKp_layout, (None, None, 0)),
            (BLOCK, DP),
        )  # fmt: skip
        gathers = (
            row_gather_copy(dtype, self.THREADS, D),
            row_gather_copy(dtype, self.THREADS, DP),
        )

        MemRange, Align = cute.struct.MemRange, cute.struct.Align
        fields = {
            "mbar": MemRange[cutlass.Int64, 2],
            "sRed": MemRange[Float32, 4 * WGS],
            "sQ": Align[
                MemRange[dtype, max(cute.cosize(sQ_layout), cute.cosize(sQp_layout))], 1024
            ],
            "sK": Align[MemRange[dtype, cute.cosize(sK_layout)], 1024],
            "sKp": Align[MemRange[dtype, cute.cosize(sKp_layout)], 1024],
            "sLp": Align[MemRange[Float32, ROWS * BLOCK * WGS], 1024],
        }
        Storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        smem = self.kl_shared_bytes(dtype.width // 8, D, DP, BLOCK, WGS)["total"]
        assert Storage.__sizeof__() == smem <= SHARED_LIMIT, (Storage.__sizeof__(), smem)
        self.kl_kernel(
            mQ, tma_k, tma_mK, mQp, tma_kp, tma_mKp, work, mLSE, mPLSE, mSum, scale_log2,
            pscale_log2, NB, mmas, (sQ_layout, sQp_layout, sK_layout, sKp_layout), gathers,
            Storage,
        ).launch(
            grid=(work.item_list.shape[0], 1, 1), block=(self.THREADS * WGS, 1, 1), stream=stream
        )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kl_kernel(
        self,
        mQ: cute.Tensor,  # (T * H, D): row t * H + h
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,  # TMA coordinates of k seen as (T, D, Hkv)
        mQp: cute.Tensor,  # (T * Hs, Dp): row t * Hs + p
        tma_kp: cute.CopyAtom,
        mKp: cute.Tensor,  # TMA coordinates of k_proxy seen as (T, Dp, Hpk)
        work: WorkItems,
        mLSE: cute.Tensor,  # (T * H,) fp32, natural log
        mPLSE: cute.Tensor,  # (T * Hs,) fp32, natural log
        mSum: cute.Tensor,  # (W,) fp32: each item's KL sum
        scale_log2: Float32,
        pscale_log2: Float32,
        NB: Int32,
        mmas: tuple,  # (QK first k-slice, QK accumulating)
        layouts: tuple,  # shared layouts of q, q_proxy, K, k_proxy tiles
        gathers: tuple,  # row gathers of q (D) and q_proxy (Dp) rows
        Storage: Constexpr,
    ):
        ROWS, THREADS, D, DP, BLOCK, WGS = (
            self.ROWS, self.THREADS, self.head_dim, self.proxy_head_dim, self.block_size,
            self.warpgroups,
        )  # fmt: skip
        H, HKV, HS, HPK = self.heads, self.kv_heads, self.sel_heads, self.proxy_k_heads
        G = H // HS
        STEPS = G + 1  # per super-chunk: the proxy step, then G main chunks
        t_all, _, _ = cute.arch.thread_idx()
        tidx = t_all % THREADS
        wg = cute.arch.make_warp_uniform(t_all // THREADS)
        mma_first, mma_rest = mmas
        mma_first.set(warpgroup.Field.ACCUMULATE, False)
        mma_rest.set(warpgroup.Field.ACCUMULATE, True)
        w, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sQ_layout, sQp_layout, sK_layout, sKp_layout = layouts

        st = SmemAllocator().allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, D, WGS * 2)
        sQp = st.sQ.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner)  # the same bytes
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sKp = st.sKp.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner)
        sLp = st.sLp.get_tensor(cute.make_layout(ROWS * BLOCK * WGS))
        sRed = st.sRed.get_tensor(cute.make_layout(4 * WGS))
        bar = st.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init(bar + 1, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        kl2 = Float32(0.0)  # this thread's sum of t (log2 t - log2 p')
        e0 = work.item_start[w]
        e1 = work.item_end[w]
        if e0 < e1:  # CTA-uniform: empty work items (the grid is a worst-case bound) add 0
            lst = work.item_list[w]
            p = lst // NB
            gb = lst % NB
            ks = work.block_start[gb]  # packed position of the block's first key
            ke = work.block_end[gb]
            self.load_tile(tma_k, mK, sK, D, ks, (p * G) // (H // HKV), bar, warp_idx)
            self.load_tile(tma_kp, mKp, sKp, DP, ks, p // (HS // HPK), bar + 1, warp_idx)

            thr = mma_first.get_slice(tidx)
            tSrQ = mma_first.make_fragment_A(thr.partition_A(sQ))
            tSrK = mma_first.make_fragment_B(thr.partition_B(sK))
            tSrQp = mma_first.make_fragment_A(thr.partition_A(sQp))
            tSrKp = mma_first.make_fragment_B(thr.partition_B(sKp))
            acc_S = cute.make_rmem_tensor(thr.partition_shape_C((ROWS, BLOCK)), Float32)
            S_rc = acc_rows_cols(acc_S)
            cS = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((ROWS, BLOCK))))
            thr_g = gathers[0].get_slice(tidx)
            tGsQ = thr_g.partition_D(sQ)
            tGcQ = thr_g.partition_D(cute.make_identity_tensor((ROWS, D)))
            thr_gp = gathers[1].get_slice(tidx)
            tGsQp = thr_gp.partition_D(sQp)
            tGcQp = thr_gp.partition_D(cute.make_identity_tensor((ROWS, DP)))
            # main chunk ch: 64 / G tokens x the G heads from p * G; proxy chunk: 64 tokens
            gq = (gathers[0], mQ, work.perm, tGsQ, tGcQ, tGcQ[0, 0, 0][1], e0, e1, p * G, G, H)
            gqp = (gathers[1], mQp, work.perm, tGsQp, tGcQp, tGcQp[0, 0, 0][1], e0, e1, p, 1, HS)

            n_sc = (e1 - e0 + ROWS - 1) // ROWS  # super-chunks of 64 tokens
            n_steps = (n_sc - wg + WGS - 1) // WGS * STEPS  # this warpgroup's
            if n_steps > 0:  # the first proxy rows land during the TMA loads
                self.gather(*gqp, wg, wg * self.Q_BUFFERS)
            cute.arch.mbarrier_wait(bar, 0)  # one K and one k_proxy tile per CTA: phase 0
            cute.arch.mbarrier_wait(bar + 1, 0)
            for s in cutlass.range(n_steps, unroll=1):
                sc = wg + (s // STEPS) * WGS  # the super-chunk
                m = s % STEPS - 1  # -1: its proxy step, else its main chunk m
                qb = wg * self.Q_BUFFERS + s % 2
                # the next step's rows into the other buffer (last read by step s - 1, before
                # its closing barrier), then wait for this step's
                if s + 1 < n_steps:
                    sc1 = wg + ((s + 1) // STEPS) * WGS
                    m1 = (s + 1) % STEPS - 1
                    nb = wg * self.Q_BUFFERS + (s + 1) % 2
                    if m1 < 0:
                        self.gather(*gqp, sc1, nb)
                    else:
                        self.gather(*gq, sc1 * G + m1, nb)
                    cute.arch.cp_async_wait_group(1)  # all but the newest group
                else:
                    cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                self.wg_sync(wg)
                if m < 0:
                    self.qk(mma_first, mma_rest, acc_S, tSrQp, tSrKp, qb)
                    self.proxy_scores(
                        S_rc, cS, sLp, work.perm, mPLSE, e0 + sc * ROWS, e1, p, wg, pscale_log2
                    )
                else:
                    self.qk(mma_first, mma_rest, acc_S, tSrQ, tSrK, qb)
                    kl2 = self.chunk_terms(
                        S_rc, cS, sLp, work.perm, mLSE, e0 + (sc * G + m) * (ROWS // G), e1, p,
                        ks, ke, m, wg, tidx, scale_log2, kl2,
                    )  # fmt: skip
                self.wg_sync(wg)  # this Q buffer (and, after a super-chunk, sLp) is rewritten
        self.store_item_sum(kl2 * Float32(LN2), sRed, mSum, t_all)

    @cute.jit
    def load_tile(self, tma, mX, sX, dim: Constexpr, ks, head, bar, warp_idx):
        """Issue the TMA load of head ``head``'s ``(BLOCK, dim)`` tile of the block starting at
        packed position ``ks`` (warp 0), completing on ``bar``."""
        BLOCK = self.block_size
        gX = cute.local_tile(
            cute.domain_offset((ks, 0, 0), mX)[None, None, head], (BLOCK, dim), (0, 0)
        )
        tXsX, tXgX = tma_tiles(tma, sX, gX)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, BLOCK * dim * (self.dtype.width // 8))
            cute.copy(tma, tXgX, tXsX[(None, 0)], tma_bar_ptr=bar)

    @cute.jit
    def proxy_scores(self, S_rc, cS, sLp, mPerm, mPLSE, c, e1, p, wg, pscale_log2):
        """Store ``log2 p' = S' * pscale_log2 - proxy_lse * log2 e`` of the super-chunk whose
        first entry is ``c`` (row = token, head ``p``; a pad row repeats the last entry's
        token: never read) into warpgroup ``wg``'s tile of ``sLp`` (:func:`_lp_index`)."""
        HS, K, BLOCK, ROWS = self.sel_heads, self.top_k, self.block_size, self.ROWS
        base = wg * (ROWS * BLOCK)
        for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
            row = cS[i, 0][0]
            t = mPerm[cutlass.min(c + row, e1 - 1)] // (HS * K)
            plse2 = mPLSE[t * HS + p] * Float32(LOG2E)
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                sLp[base + _lp_index(row, cS[i, j][1], BLOCK)] = S_rc[i, j] * pscale_log2 - plse2

    @cute.jit
    def chunk_terms(
        self, S_rc, cS, sLp, mPerm, mLSE, c, e1, p, ks, ke, m, wg, tidx, scale_log2, kl2
    ):  # fmt: skip
        """Main chunk ``m`` of a super-chunk (first entry ``c``: ``64 / G`` tokens x ``G``
        heads, token-major) from ``S`` in ``S_rc``: the probabilities ``P`` (0 past the
        block's end ``ke``, after the token, and for pad rows), each token's head sum by the
        in-warp reduce-scatter (class docstring), and ``kl2 + sum t (log2 t - log2 p')`` over
        this lane's columns returned (``log2 p'`` from ``sLp``; ``t`` below the smallest
        normal fp32 counts as 0: ``t log t`` is below 1e-36 there)."""
        H, HS, K, BLOCK, ROWS = self.heads, self.sel_heads, self.top_k, self.block_size, self.ROWS
        G = H // HS
        BT = ROWS // G  # tokens per main chunk
        NV = BLOCK // 8  # 8-column groups: a thread holds columns 2 (lane % 4) + {0, 1} + 8 v
        lane = tidx % 32
        # 1. P in place (each thread: rows i = 0, 1 of its warp's 16; columns j = v0 + 2 v)
        for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
            row = cS[i, 0][0]
            e = c + row // G
            t = mPerm[cutlass.min(e, e1 - 1)] // (HS * K)
            lse2 = Float32(Float32.inf)  # a pad row: P = 0
            if e < e1:
                lse2 = mLSE[t * H + p * G + row % G] * Float32(LOG2E)
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                kpos = ks + cS[i, j][1]
                pv = cute.math.exp2(S_rc[i, j] * scale_log2 - lse2, fastmath=True)
                if kpos >= ke or kpos > t:
                    pv = Float32(0.0)
                S_rc[i, j] = pv
        # 2. each token's sum over its G heads: vals[row][slot][v0], slot = 8-column group
        n_rows = 2
        vals = []
        for i in cutlass.range_constexpr(2):
            vi = []
            for v in cutlass.range_constexpr(NV):
                vi.append([S_rc[i, 2 * v], S_rc[i, 2 * v + 1]])
            vals.append(vi)
        if cutlass.const_expr(G == 16):  # rows lane / 4 and lane / 4 + 8: the same token
            n_rows = 1
            both = []
            for v in cutlass.range_constexpr(NV):
                both.append([vals[0][v][0] + vals[1][v][0], vals[0][v][1] + vals[1][v][1]])
            vals = [both]
        levels = min(G.bit_length() - 1, 3)  # lane bits 2 .. 2 + levels - 1 hold the heads
        v_base = Int32(0)  # this lane's first 8-column group after the levels
        n = NV
        for lvl in cutlass.range_constexpr(levels):
            n = n // 2
            up = ((lane >> (2 + lvl)) & 1) == 1  # keeps the upper half of the groups
            v_base = v_base + (Int32(n) if up else Int32(0))
            halved = []
            for i in cutlass.range_constexpr(n_rows):
                hi = []
                for x in cutlass.range_constexpr(n):
                    pair = []
                    for v0 in cutlass.range_constexpr(2):
                        a = vals[i][x][v0]
                        b = vals[i][x + n][v0]
                        send = a if up else b
                        keep = b if up else a
                        pair.append(keep + cute.arch.shuffle_sync_bfly(send, offset=4 << lvl))
                    hi.append(pair)
                halved.append(hi)
            vals = halved
        # 3. the terms of this lane's (token, column) pairs
        inv_g = Float32(1.0 / G)
        base = wg * (ROWS * BLOCK)
        for i in cutlass.range_constexpr(n_rows):
            tok = m * BT + cS[i, 0][0] // G  # the token's row in the super-chunk's tile
            for x in cutlass.range_constexpr(n):
                for v0 in cutlass.range_constexpr(2):
                    col = 2 * (lane % 4) + v0 + 8 * (v_base + x)
                    tv = vals[i][x][v0] * inv_g
                    lp2 = sLp[base + _lp_index(tok, col, BLOCK)]
                    if tv >= Float32(TINY):
                        kl2 += tv * (cute.math.log2(tv, fastmath=True) - lp2)
        return kl2

    @cute.jit
    def store_item_sum(self, val, sRed, mSum, t_all):
        """``mSum[item] =`` the sum of every thread's ``val`` in a fixed order: the warp's
        lanes by butterfly shuffles, then the CTA's warps in order (thread 0)."""
        for k in cutlass.range_constexpr(5):
            val = val + cute.arch.shuffle_sync_bfly(val, offset=16 >> k)
        if t_all % 32 == 0:
            sRed[t_all // 32] = val
        cute.arch.sync_threads()
        if t_all == 0:
            total = Float32(0.0)
            for wi in cutlass.range_constexpr(4 * self.warpgroups):
                total = total + sRed[wi]
            w, _, _ = cute.arch.block_idx()
            mSum[w] = total


def _kl_reason(q, k, q_proxy, k_proxy, top_k, cfg) -> str | None:
    """Why :class:`FwdKlSm90` cannot run this call's KL (``None``: it can)."""
    if q_proxy is None or k_proxy is None:
        return "no proxy"
    if q_proxy.dtype != q.dtype or k_proxy.dtype != q.dtype:
        return f"the proxy must be in q's dtype ({q.dtype})"
    return FwdKlSm90.can_implement(
        cutlass_dtype(q.dtype), q.shape[1], k.shape[1], q_proxy.shape[1], q.shape[2], top_k,
        cfg.block_size, FwdKlSm90.warpgroups, True, q_proxy.shape[2], k_proxy.shape[1],
    )  # fmt: skip


def kl_fits(q, k, q_proxy, k_proxy, indices, cfg, mapped: bool = False) -> bool:
    """Whether :func:`kl` runs this call's KL (a proxy in q's dtype, ``cfg.compute_kl``, no
    query map: ``mapped`` False, and the layout :class:`FwdKlSm90`'s ``can_implement``
    accepts); the forward borrows Triton's KL stage for a call it does not fit."""
    if q_proxy is None or not cfg.compute_kl or mapped:
        return False
    return _kl_reason(q, k, q_proxy, k_proxy, indices.shape[2], cfg) is None


def kl(q, k, q_proxy, k_proxy, lse, proxy_lse, wl, cfg, unit=None):
    """Driver stage ``kl`` (:mod:`flash_msa.sparse_forward`): the fp32 0-dim sum of the
    per-row KL terms ``sum_keys t (ln t - ln p)`` of work list ``wl``'s rows (t: the group mean
    of the main probabilities, p: the proxy's, both over the row's kept keys) from the final
    ``lse (T, H)`` and ``proxy_lse (T, Hs)``, by :class:`FwdKlSm90` on the driver's items
    (256 tokens; no split), one fp32 sum per item added by ``torch.sum`` (the same bits every
    run). ``unit`` must be ``None`` (no proxy gradient: this backend's backward makes it).
    ValueError for a call :func:`kl_fits` refuses (a query map ``wl.q_map``, a layout the
    kernel cannot run)."""
    if unit is not None:
        raise ValueError("unit: the CuTe KL stage does not make the proxy gradient")
    if wl.q_map is not None:
        raise ValueError("wl.q_map: the CuTe KL stage has no query map (kl_fits)")
    why = _kl_reason(q, k, q_proxy, k_proxy, wl.slots, cfg)
    if why is not None:
        raise ValueError(f"CuTe KL stage: {why}")
    T, H, D = q.shape
    Hs, Dp = q_proxy.shape[1:]
    for name, x, shape in (("lse", lse, (T, H)), ("proxy_lse", proxy_lse, (T, Hs))):
        if x.dtype != torch.float32 or tuple(x.shape) != shape:
            raise ValueError(
                f"CuTe KL stage: {name} must be fp32 {shape}, got {x.dtype} {tuple(x.shape)}"
            )
    kernel = FwdKlSm90(
        cutlass_dtype(q.dtype), H, k.shape[1], Hs, D, wl.slots, cfg.block_size,
        FwdKlSm90.warpgroups, True, Dp, k_proxy.shape[1],
    )  # fmt: skip
    W = wl.item_list.shape[0]  # the grid: every CTA writes its item's sum
    if W == 0:
        return torch.zeros((), dtype=torch.float32, device=q.device)
    sums = torch.empty((W,), dtype=torch.float32, device=q.device)
    tensors = (
        aligned(q.contiguous()).view(T * H, D),  # (contiguous: see launch)
        aligned(k.contiguous()).permute(0, 2, 1),  # (T, D, Hkv): a TMA box = one head's block
        *(aligned(x) for x in wl[:6]),
        aligned(lse.contiguous()).view(-1),
        aligned(q_proxy.contiguous()).view(T * Hs, Dp),
        aligned(k_proxy.contiguous()).permute(0, 2, 1),  # (T, Dp, Hpk)
        aligned(proxy_lse.contiguous()).view(-1),
        sums,
    )
    scalars = (cfg.softmax_scale * LOG2E, (cfg.proxy_scale or 1.0) * LOG2E, wl.num_blocks)
    kernel, args = launch_arguments(kernel, tensors, scalars, stream(q.device))
    run_typed(kernel, q.device, args, LAUNCH_SIGNATURE)
    return sums.sum()
