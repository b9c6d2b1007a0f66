"""Sparse main forward on Hopper (sm_90a) in CuTe DSL: per-block attention partials, key-outer.

The CuTe forward's per-block stage (``cute.forward``): the kernel :class:`FwdPartialsSm90` makes
the per-block partials (the driver stage ``forward.partials``) and, in the same launch, the
proxy LSE partials where ``forward.proxy_fits`` ("Proxy LSE" below); its subclass
:class:`~.fwd_kl_sm90.FwdKlSm90` makes the KL value (the driver stage ``forward.kl``). Checked
on an H200 against the Triton kernel (same work list, same partial buffers) and the reference
(tests/ops/test_fwd.py, tests/ops/test_kl.py).

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

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
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
    pointer_tensors,
    row_gather_copy,
    tma_tiles,
)

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
    # static sizes and strides, in the order of ``forward.launch_tensor_names``), set by
    # ``forward.partials_arguments`` from the tensors of the call: the compiled code bakes them in
    # (TMA descriptors' boxes, the rows' strides), so two layouts are two kernel objects.
    # ``()`` for a configuration not yet bound to a launch's tensors (it cannot be compiled)
    views: tuple = ()

    LABEL: ClassVar[str] = "CuTe forward partials"  # (the ValueError's prefix: __post_init__)
    ROWS: ClassVar[int] = 64  # rows per chunk: one warpgroup's MMA M
    THREADS: ClassVar[int] = 128  # threads per warpgroup
    Q_BUFFERS: ClassVar[int] = 2  # per warpgroup: the next chunk's gather lands in the other

    @property
    def tensor_count(self) -> int:
        """How many tensors a launch passes (``forward.launch_tensor_names``): q, k, v, the
        work list's six, o_part, l_part, then q_map (:attr:`qmap`) and q_proxy, k_proxy,
        pl_part (:attr:`proxy`)."""
        return 11 + self.qmap + 3 * self.proxy

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
        """Launch one CTA per work item. ``tensors``: per tensor of
        ``forward.launch_tensor_names`` its typed global pointer and mode-0 size (run-time;
        :class:`~.common.PointerTensors`), the rest of its layout in :attr:`views`
        (``forward.partials_arguments``); rebuilt here as the
        tensors the kernel takes: ``mQ (T*H, D)``; ``mK``, ``mV`` the ``(T, D, Hkv)`` views of
        k and v; ``work`` the work list; partial buffers ``mO (C*H*K, D)`` and ``mL
        (C*H*K,)``; with :attr:`proxy` a :class:`ProxyArgs` (q_proxy, the k_proxy view,
        pl_part and ``pscale_log2``, unused without it). ``scale_log2`` = softmax scale *
        log2(e); ``tok0`` the chunk's first packed token; ``NB`` the work list's block count.
        With :attr:`qmap` ``work`` is a :class:`MappedWorkItems` (the list and its query map
        ``(Tq,)`` int32; ``T`` of ``mQ`` and ``tok0`` then count query rows, ``mK``, ``mV``
        keep the keys' ``T``), else a ``WorkItems``."""
        assert len(self.views) == self.tensor_count, "views of every tensor"
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
            # the row sees the keys before min(ke, its token + 1): one 32-bit bound per row and
            # one compare per key (token positions fit Int32; the perm's token is Int64). sm_90a
            # SASS at anchor D = 128: ISETP 295 -> 196, FSEL 136 -> 72, 2024 -> 1816 in all
            lim = cutlass.min(ke, Int32(row_tok[i]) + 1)
            mx = -Float32.inf
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                if ks + cS[i, j][1] >= lim:
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
