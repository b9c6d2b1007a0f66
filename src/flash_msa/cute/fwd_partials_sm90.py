"""Sparse main forward on Hopper (sm_90a) in CuTe DSL: per-block attention partials, key-outer.

The CuTe backend's ``fwd`` (:func:`fwd`): the kernel :class:`FwdPartialsSm90` makes the
per-block partials (the driver stage :func:`partials`), Triton's combine, proxy-LSE and KL
passes do the rest. Checked on an H200 against the Triton kernel (same work list, same partial
buffers) and the reference (tests/test_gpu_cute.py).

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

Measured variants that left this file (H200, docs/perf-notes.md "CuTe forward partials
v2-v5", same-run gains of the kept choice, 8 cases): two Q buffers per warpgroup against one
(-1..+12%), partials staged through shared memory against each thread's 4-byte column-pair
stores (+6..+19%). The number of warpgroups stays a constructor argument (3 vs 1: +12..+31% at
the paper head layout, -9..+1%, a tie, at the anchor one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

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
    WorkItems,
    acc_as_a,
    acc_rows_cols,
    aligned,
    cute_tensor,
    cutlass_dtype,
    run,
    stream,
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

    ROWS: ClassVar[int] = 64  # rows per chunk: one warpgroup's MMA M
    THREADS: ClassVar[int] = 128  # threads per warpgroup
    Q_BUFFERS: ClassVar[int] = 2  # per warpgroup: the next chunk's gather lands in the other

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def shared_bytes(elem_bytes: int, head_dim: int, block_size: int, warpgroups: int) -> dict:
        """Bytes of each shared-memory buffer, in the order of the ``Storage`` struct (the
        operand tiles aligned to 1024 bytes, the 128B swizzle's period), and their sum."""
        sizes = {
            "kv_mbar": 8,  # one mbarrier
            "sPart": 8 * FwdPartialsSm90.ROWS * warpgroups,  # a row's partial index (int64)
            "sQ": FwdPartialsSm90.ROWS * head_dim * elem_bytes * FwdPartialsSm90.Q_BUFFERS
            * warpgroups,
            "sK": block_size * head_dim * elem_bytes,
            "sV": block_size * head_dim * elem_bytes,
        }  # fmt: skip
        end = 0
        for name, size in sizes.items():
            if name in ("sQ", "sK", "sV"):
                end = -(-end // 1024) * 1024
            end += size
        return {**sizes, "total": end}

    @classmethod
    def can_implement(
        cls, dtype, heads, kv_heads, sel_heads, head_dim, top_k, block_size, warpgroups=3
    ) -> str | None:
        """Why this configuration cannot be compiled or run (``None``: it can).

        Shared memory (:meth:`shared_bytes`) at D = 128, block 128, bf16, 3 warpgroups: 6 Q
        buffers of 64 x 128 x 2 = 16 KB (96 KB) + K and V tiles of 128 x 128 x 2 = 32 KB each
        (64 KB) + 1.5 KB of row indices + the mbarrier, aligned: 165,888 bytes of the sm_90
        capacity of 232,448 (SHARED_LIMIT). Registers: 168 per thread with 3 warpgroups
        (384 threads x 168 = 64,512 of 65,536; compile_check asserts no spills)."""
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
        smem = cls.shared_bytes(dtype.width // 8, head_dim, block_size, warpgroups)["total"]
        if smem > SHARED_LIMIT:
            return f"{smem} bytes of shared memory exceed the sm_90 capacity ({SHARED_LIMIT})"
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.kv_heads, self.sel_heads, self.head_dim, self.top_k,
            self.block_size, self.warpgroups,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe forward partials: {why}")

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
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        work: WorkItems,
        mO: cute.Tensor,
        mL: cute.Tensor,
        scale_log2: Float32,
        tok0: Int32,
        NB: Int32,
        stream: cuda.CUstream,
    ):
        """Launch one CTA per work item. ``mQ (T*H, D)``; ``mK``, ``mV`` the ``(T, D, Hkv)``
        views of k and v; ``work`` the work list; partial buffers ``mO (C*H*K, D)`` and
        ``mL (C*H*K,)``; ``scale_log2`` = softmax scale * log2(e); ``tok0`` the chunk's first
        packed token; ``NB`` the work list's block count."""
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
        tpr = D // 8  # threads per row: 16-byte pieces
        gather = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                num_bits_per_copy=128,
            ),
            cute.make_layout((self.THREADS // tpr, tpr), stride=(tpr, 1)),
            cute.make_layout((1, 8)),
        )  # fmt: skip

        @cute.struct
        class Storage:  # sizes: shared_bytes
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sPart: cute.struct.MemRange[cutlass.Int64, ROWS * WGS]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]

        smem = self.shared_bytes(dtype.width // 8, D, BLOCK, WGS)["total"]
        assert Storage.__sizeof__() == smem <= SHARED_LIMIT, (Storage.__sizeof__(), smem)
        self.kernel(
            mQ, tma_k, tma_mK, tma_v, tma_mV, work, mO, mL, scale_log2, tok0, NB, mmas,
            sQ_layout, sK_layout, gather, Storage,
        ).launch(
            grid=(work.item_list.shape[0], 1, 1), block=(self.THREADS * WGS, 1, 1), stream=stream
        )  # fmt: skip

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
        work: WorkItems,
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
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_bar, 1)
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
                gq = (gather, mQ, work.perm, tGsQ, tGcQ, g_col, e0, e1, h0)
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
                        work.perm, cS, e0 + ch * BT, e1, h0, tok0
                    )
                    # 1. this chunk's query rows in shared memory. The next chunk's gather is
                    # issued first and lands while this chunk computes (its buffer was last read
                    # in the previous iteration, before its closing barrier).
                    qb = wg * self.Q_BUFFERS  # this chunk's Q buffer
                    stage = (ch // WGS) % 2
                    qb = qb + stage
                    if ch + WGS < n_chunks:
                        self.gather(*gq, ch + WGS, wg * self.Q_BUFFERS + 1 - stage)
                        cute.arch.cp_async_wait_group(1)  # all but the newest group
                    else:
                        cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.wg_sync(wg)

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
    def gather(self, gather, mQ, mPerm, tGsQ, tGcQ, g_col, e0, e1, h0, ch, buf):
        """cp.async the query rows of chunk ``ch`` of a work item into Q buffer ``buf`` (one
        commit group); pad rows (past the item's end) re-load the last valid row."""
        G2 = self.geometry[1]
        BT = self.ROWS // G2
        c = e0 + ch * BT
        for ps in cutlass.range_constexpr(cute.size(tGsQ, mode=[1])):
            row = tGcQ[0, ps, 0][0]
            e = cutlass.min(c + row // G2, e1 - 1)
            t = mPerm[e] // (self.sel_heads * self.top_k)
            qrow = t * self.heads + h0 + row % G2
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
    def row_info(self, mPerm, cS, c, e1, h0, tok0):
        """For each of this thread's two rows of the chunk whose first entry is ``c``: its token,
        its partial index ``((t - tok0) * H + h) * K + slot`` and whether it is a real entry."""
        HS, K = self.sel_heads, self.top_k
        G2 = self.geometry[1]
        row_tok = []
        row_part = []
        row_ok = []
        for i in cutlass.range_constexpr(cute.size(cS, mode=[0])):
            row = cS[i, 0][0]
            e = c + row // G2
            flat = mPerm[cutlass.min(e, e1 - 1)]
            t = flat // (HS * K)
            row_tok.append(t)
            row_part.append(((t - tok0) * self.heads + h0 + row % G2) * K + flat % K)
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
        for a row with no visible key) at partial index ``part``."""
        lse = -Float32.inf
        if ssum > 0.0:
            lse = (mx * scale_log2 + cute.math.log2(ssum)) * LN2
        mL[part] = lse


# ---------------------------------------------------------------------------------------------
# host: the partials of one query chunk over a work list
# ---------------------------------------------------------------------------------------------
def partials(
    q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None, *,
    warpgroups: int = FwdPartialsSm90.warpgroups,
):  # fmt: skip
    """Driver stage ``partials`` (:mod:`flash_msa.sparse_forward`, which states the buffers'
    contract): fill ``o_part (C, H, K, D)`` and ``l_part (C, H, K)`` for packed tokens
    ``tok0 .. tok0 + C`` from work list ``wl`` (:func:`flash_msa.worklist.build`). The main
    partials only: ``proxy`` must be ``None`` (the proxy LSE partials are another stage).
    ``warpgroups``: the kernel's constructor argument (A/B runs and tests; the default is the
    measured choice)."""
    if proxy is not None:
        raise ValueError("CuTe forward partials: the proxy LSE partials are not made here")
    T, H, D = q.shape
    Hkv = k.shape[1]
    kernel = FwdPartialsSm90(
        cutlass_dtype(q.dtype), H, Hkv, wl.heads, D, wl.slots, cfg.block_size, warpgroups
    )  # raises ValueError with the reason if the kernel cannot run this configuration
    for name, buf, shape in (
        ("o_part", o_part, (H, wl.slots, D)),
        ("l_part", l_part, (H, wl.slots)),
    ):
        if tuple(buf.shape[1:]) != shape or not buf.is_contiguous() or buf.data_ptr() % 16:
            raise ValueError(
                f"CuTe forward partials: {name} must be a contiguous, 16-byte aligned (C, "
                f"{', '.join(map(str, shape))}) buffer; got shape {tuple(buf.shape)}, strides "
                f"{buf.stride()}, address % 16 = {buf.data_ptr() % 16}"
            )
    run(
        kernel,
        q.device,
        cute_tensor(aligned(q).view(T * H, D)),
        cute_tensor(aligned(k).permute(0, 2, 1)),  # (T, D, Hkv): a TMA box = one head's block
        cute_tensor(aligned(v).permute(0, 2, 1)),
        WorkItems(*(cute_tensor(x) for x in wl[:6])),
        cute_tensor(o_part.view(-1, D)),
        cute_tensor(l_part.view(-1)),
        Float32(cfg.softmax_scale * math.log2(math.e)),
        Int32(tok0),
        Int32(wl.num_blocks),
        stream(q.device),
    )


def fwd(q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False):
    """Backend op ``fwd`` for given indices: the sparse-forward driver
    (:mod:`flash_msa.sparse_forward`) with :func:`partials` as its per-block attention stage;
    the proxy LSE partials, combine and KL stages are borrowed from the Triton backend through
    the driver until CuTe has its own. Limits: ``flash_msa.cute.unsupported_reason("fwd", ...)``."""
    from .. import sparse_forward
    from . import forward_stages
    from .bwd_sm90 import kl_fits
    from .combine_sm90 import combine_fits

    H, D = q.shape[1:]
    Hs, K = indices.shape[1:]
    stages = forward_stages(
        kl_fits(q, k, q_proxy, k_proxy, indices, cfg), combine_fits(q.dtype, H, Hs, K, D)
    )
    return sparse_forward.fwd(
        stages, q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad
    )
