"""Sparse main forward on Hopper (sm_90a) in CuTe DSL: per-block attention partials, key-outer.

The CuTe backend's ``fwd`` (:func:`fwd`): this kernel makes the per-block partials, Triton's
combine, proxy-LSE and KL passes do the rest. Checked on an H200 against the Triton kernel
(same work list, same partial buffers) and the reference (tests/test_gpu_cute.py).

Same decomposition as the Triton forward (docs/algorithm.md, "Main attention: key-outer over a
reverse index"): one CTA per work item = (selection head p, key block, up to TW query tokens
that kept it). The CTA has ``WARPGROUPS`` consumer warpgroups (128 threads, M = 64 rows per
chunk each). Per KV sub-group of G2 heads it loads the block's K and V tiles once by TMA (a
one-shot mbarrier); the warpgroups then take turns at the chunks of 64 rows (BT tokens x G2
heads, row = token-major; warpgroup w takes chunks w, w + WARPGROUPS, ...). For a chunk a
warpgroup

1. gathers the rows' queries by cp.async (16-byte pieces, row index from ``PERM``) into a
   128B-swizzled shared tile (with ``Q_STAGES = 2`` the next chunk's gather is issued into the
   other buffer before waiting for this one),
2. computes S = Q K^T by warpgroup MMA (``m64nBLOCKk16``, both operands in shared memory),
3. masks keys past the block's end or after the row's token, takes the row max and
   ``P = exp2((S - max) * scale * log2 e)`` in registers (quad shuffles for the row reductions),
4. computes O = P V by warpgroup MMA with P from registers and V through a transposed
   (MN-major) view of its shared tile,
5. writes the normalized partial ``O / l`` (input dtype) and its natural-log LSE to the row's
   slot of the ``(C, H, K, D)`` / ``(C, H, K)`` partial buffers of the Triton forward; with
   ``STAGE_PARTIALS`` the tile goes through this chunk's Q buffer first, so the global stores
   are 16-byte pieces of whole rows.

One block per item means no online softmax: the combine merges a query's K partials by LSE.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Constexpr, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..worklist import geometry
from .common import acc_rows_cols, aligned, cute_tensor, launch, stream, tma_tiles

CHUNK = 64  # rows per chunk: one warpgroup's MMA M
THREADS = 128
# query-row buffers: 1 = gather, wait, compute; 2 = the next chunk's gather is in flight while
# this chunk computes. H200 measurements of these three switches: docs/perf-notes.md, "CuTe
# forward partials v2-v5". Same-run gains of the default over each alternative (v5 run, 8 cases):
# Q_STAGES 2 vs 1 -1..+12%; STAGE_PARTIALS vs direct +6..+19%; WARPGROUPS 3 vs 1 +12..+31% at
# the paper head layout, -9..+1% (a tie) at the anchor one.
Q_STAGES = 2
# partial outputs: True = staged through shared memory, 16-byte stores of whole rows; False =
# each thread's column pairs stored directly (4-byte stores)
STAGE_PARTIALS = True
# consumer warpgroups per CTA, sharing the block's K/V tiles and taking turns at the chunks
# (each with its own Q buffers); 3 fits the register file once (168 registers x 384 threads)
WARPGROUPS = 3
LN2 = 0.6931471805599453


def _acc_as_a(t: cute.Tensor) -> cute.Tensor:
    """A ``((2, 2, V), M, N)`` accumulator-shaped register tensor as a wgmma register-A fragment
    ``((2, 2, 2), M, (V / 2, N))``: two neighbouring 8-column groups make one k16 slice."""
    s, d = t.layout.shape, t.layout.stride
    shape = ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2]))
    stride = ((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def _pairs(t: cute.Tensor) -> cute.Tensor:
    """A ``(rows, cols)`` view (:func:`acc_rows_cols`) as ``(2, rows, cols / 2)``: mode 0 the
    two adjacent columns a thread holds (neighbouring registers)."""
    s, d = t.layout.shape, t.layout.stride
    shape = (s[1][0], s[0], (s[1][1], s[1][2]))
    stride = (d[1][0], d[0], (d[1][1], d[1][2]))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def _wg_sync(wg, WGS: int):
    """Barrier of warpgroup ``wg``'s 128 threads (the whole CTA when it has one warpgroup)."""
    if cutlass.const_expr(WGS == 1):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=THREADS)


@cute.jit
def _store_lse(mL: cute.Tensor, part, mx, ssum, scale_log2):
    """Store the natural-log LSE of a row with max ``mx`` and exp2-sum ``ssum`` (``-inf`` for a
    row with no visible key) at partial index ``part`` (inlined into the kernel)."""
    lse = -Float32.inf
    if ssum > 0.0:
        lse = (mx * scale_log2 + cute.math.log2(ssum)) * LN2
    mL[part] = lse


def _staged(row, unit, D: int):
    """Element offset of 16-byte piece ``unit`` of chunk row ``row`` in a Q buffer used as the
    partial's staging tile: the bytes of Q's own row there (128-byte row segments, one per 64
    columns, 16-byte pieces XOR-swizzled by ``row % 8``: bank-conflict-free both for the
    accumulator's column-pair writes and for whole-row reads)."""
    seg = CHUNK * 64  # elements of one 64-column segment of the tile
    return (unit // 8) * seg + row * 64 + ((unit % 8) ^ (row % 8)) * 8


def _loads_before(r: int, g2: int, kv_group: int) -> int:
    """K/V tile loads issued before sub-group ``r``'s (trace time): one per new KV head."""
    return sum(1 for i in range(r) if i == 0 or (i * g2) % kv_group == 0)


def _gather_chunk(gather, mQ, mPerm, tGsQ, tGcQ, g_col, e0, e1, h0, H, HS, K, G2, BT, ch, stage):
    """cp.async the query rows of chunk ``ch`` of a work item into Q buffer ``stage`` (one
    commit group); pad rows (past the item's end) re-load the last valid row. Plain Python,
    traced inline where the kernel calls it (the loop unrolls at trace time)."""
    c = e0 + ch * BT
    for ps in range(cute.size(tGsQ, mode=[1])):
        row = tGcQ[0, ps, 0][0]
        e = cutlass.min(c + row // G2, e1 - 1)
        t = mPerm[e] // (HS * K)
        qrow = t * H + h0 + row % G2
        off = cute.assume(Int64(qrow) * mQ.stride[0] + g_col, divby=8)
        src = cute.make_tensor(mQ.iterator + off, cute.make_layout(((8, 1),)))
        cute.copy(gather, src, tGsQ[None, ps, 0, stage])
    cute.arch.cp_async_commit_group()


@cute.kernel
def _partials_kernel(
    mQ: cute.Tensor,  # (T * H, D): row t * H + h
    tma_k: cute.CopyAtom,
    mK: cute.Tensor,  # TMA coordinates of k seen as (T, D, Hkv)
    tma_v: cute.CopyAtom,
    mV: cute.Tensor,
    mPerm: cute.Tensor,  # (E,) int64 flat entries token * Hs * K + head * K + slot
    mItemList: cute.Tensor,  # (W,) int32
    mItemStart: cute.Tensor,  # (W,) int64
    mItemEnd: cute.Tensor,  # (W,) int64
    mBlkStart: cute.Tensor,  # (NB,) int32
    mBlkEnd: cute.Tensor,  # (NB,) int32
    mO: cute.Tensor,  # (C * H * K, D) partial outputs, input dtype
    mL: cute.Tensor,  # (C * H * K,) fp32 partial LSEs
    scale_log2: Float32,
    tok0: Int32,
    NB: Int32,
    mma_qk: cute.TiledMma,
    mma_qk_acc: cute.TiledMma,
    mma_pv: cute.TiledMma,
    mma_pv_acc: cute.TiledMma,
    sQ_layout: cute.ComposedLayout,
    sK_layout: cute.ComposedLayout,
    gather: cute.TiledCopy,
    Storage: Constexpr,
    H: Constexpr,
    HKV: Constexpr,
    HS: Constexpr,
    K: Constexpr,
    D: Constexpr,
    G: Constexpr,
    G2: Constexpr,
    R: Constexpr,
    BLOCK: Constexpr,
    ELEM_BYTES: Constexpr,
    QSTAGES: Constexpr,
    STAGE: Constexpr,
    WGS: Constexpr,
):
    t_all, _, _ = cute.arch.thread_idx()
    tidx = t_all % THREADS  # thread in its warpgroup
    wg = cute.arch.make_warp_uniform(t_all // THREADS)  # warpgroup: takes chunks wg, wg+WGS, ..
    mma_qk.set(warpgroup.Field.ACCUMULATE, False)
    mma_qk_acc.set(warpgroup.Field.ACCUMULATE, True)
    mma_pv.set(warpgroup.Field.ACCUMULATE, False)  # one block: O = P V, first k-slice writes
    mma_pv_acc.set(warpgroup.Field.ACCUMULATE, True)
    w, _, _ = cute.arch.block_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

    st = SmemAllocator().allocate(Storage)
    sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, D, WGS * QSTAGES)
    sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (BLOCK, D, 1)
    sV = st.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))  # (D, BLOCK, 1)
    sQ_raw = st.sQ.data_ptr()  # the same bytes, unswizzled: partial staging (_staged)
    sPart = st.sPart.get_tensor(cute.make_layout(CHUNK * WGS))  # row's partial index or -1
    kv_bar = st.kv_mbar.data_ptr()
    if warp_idx == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(kv_bar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    e0 = mItemStart[w]
    e1 = mItemEnd[w]
    if e0 < e1:  # CTA-uniform: empty work items (the grid is a worst-case bound) do nothing
        lst = mItemList[w]
        p = lst // NB
        gb = lst % NB
        ks = mBlkStart[gb]  # packed position of the block's first key
        ke = mBlkEnd[gb]

        thr_qk = mma_qk.get_slice(tidx)
        thr_pv = mma_pv.get_slice(tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((CHUNK, BLOCK)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((CHUNK, D)), Float32)
        S_rc = acc_rows_cols(acc_S)
        O_rc = acc_rows_cols(acc_O)
        cS = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((CHUNK, BLOCK))))
        cO = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((CHUNK, D))))
        n_rows = cute.size(S_rc, mode=[0])  # 2
        rP = cute.make_rmem_tensor_like(acc_S, mQ.element_type)
        tOrP = _acc_as_a(rP)
        rO = cute.make_rmem_tensor_like(acc_O, mQ.element_type)
        rO_pairs = _pairs(acc_rows_cols(rO))  # (2, rows, pairs)

        thr_g = gather.get_slice(tidx)
        tGsQ = thr_g.partition_D(sQ)  # ((8, 1), passes, 1, WGS * QSTAGES)
        tGcQ = thr_g.partition_D(cute.make_identity_tensor((CHUNK, D)))
        g_col = tGcQ[0, 0, 0][1]
        BT = CHUNK // G2  # tokens per chunk
        n_chunks = (e1 - e0 + BT - 1) // BT

        for r in cutlass.range_constexpr(R):
            h0 = p * G + r * G2  # first main head of this KV sub-group
            kvh = h0 // (H // HKV)
            gq = (gather, mQ, mPerm, tGsQ, tGcQ, g_col, e0, e1, h0, H, HS, K, G2, BT)
            if cutlass.const_expr(QSTAGES == 2):  # noqa: SIM102 (static, then dynamic)
                # buffer 0 is free (the barriers closing the last sub-group): the first chunk's
                # rows land during the K/V load
                if wg < n_chunks:
                    _gather_chunk(*gq, wg, wg * QSTAGES)
            # K/V change only where a sub-group starts a new KV head (static: p * G is a
            # multiple of the KV group or inside one); reloading the same tile is skipped
            if cutlass.const_expr(r == 0 or (r * G2) % (H // HKV) == 0):
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
                        cute.arch.mbarrier_arrive_and_expect_tx(kv_bar, 2 * BLOCK * D * ELEM_BYTES)
                    cute.copy(tma_k, tKgK, tKsK[(None, 0)], tma_bar_ptr=kv_bar)
                    cute.copy(tma_v, tVgV, tVsV[(None, 0)], tma_bar_ptr=kv_bar)
                cute.arch.mbarrier_wait(kv_bar, _loads_before(r, G2, H // HKV) % 2)

            for ch in cutlass.range(wg, n_chunks, WGS, unroll=1):
                c = e0 + ch * BT
                # this thread's two rows: token (for the causal mask), partial slot, validity.
                # Loaded first so the global-load latency overlaps the gather wait and the MMA.
                row_tok = []
                row_part = []
                row_ok = []
                for i in cutlass.range_constexpr(n_rows):
                    row = cS[i, 0][0]
                    e = c + row // G2
                    flat = mPerm[cutlass.min(e, e1 - 1)]
                    t = flat // (HS * K)
                    row_tok.append(t)
                    row_part.append(((t - tok0) * H + h0 + row % G2) * K + flat % K)
                    row_ok.append(e < e1)
                # 1. this chunk's query rows in shared memory. With two Q buffers the next
                # chunk's gather is issued first and lands while this chunk computes (its
                # buffer was last read in the previous iteration, before its closing barrier).
                qb = wg * QSTAGES  # this chunk's Q buffer
                if cutlass.const_expr(QSTAGES == 2):
                    stage = (ch // WGS) % 2
                    qb = qb + stage
                    if ch + WGS < n_chunks:
                        _gather_chunk(*gq, ch + WGS, wg * QSTAGES + 1 - stage)
                        cute.arch.cp_async_wait_group(1)  # all but the newest group
                    else:
                        cute.arch.cp_async_wait_group(0)
                else:
                    _gather_chunk(*gq, ch, qb)
                    cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                _wg_sync(wg, WGS)

                # 2. S = Q K^T
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    mma = mma_qk if kb == 0 else mma_qk_acc
                    cute.gemm(mma, acc_S, tSrQ[None, None, kb, qb], tSrK[None, None, kb, 0], acc_S)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # 3. mask and exponentiate (each thread: 2 rows, BLOCK / 4 columns)
                row_max = []
                row_sum = []
                for i in cutlass.range_constexpr(n_rows):
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
                        pv = cute.math.exp2(
                            S_rc[i, j] * scale_log2 - mx * scale_log2, fastmath=True
                        )
                        S_rc[i, j] = pv
                        ssum += pv
                    ssum += cute.arch.shuffle_sync_bfly(ssum, offset=1)
                    ssum += cute.arch.shuffle_sync_bfly(ssum, offset=2)
                    row_max.append(mx)
                    row_sum.append(ssum)

                # 4. O = P V (P from registers)
                rP.store(acc_S.load().to(mQ.element_type))
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    mma = mma_pv if kb == 0 else mma_pv_acc
                    cute.gemm(mma, acc_O, tOrP[None, None, kb], tOrV[None, None, kb, 0], acc_O)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # 5. normalized partial and natural-log LSE into the row's slot. The partial goes
                # through shared memory (this chunk's Q buffer: a warp overwrites only its own
                # 16 rows, which its finished QK MMA no longer reads) so that global stores are
                # 16-byte pieces of whole rows, not a thread's scattered column pairs.
                for i in cutlass.range_constexpr(n_rows):
                    ssum = row_sum[i]
                    inv = Float32(0.0) if ssum == 0.0 else cute.arch.rcp_approx(ssum)
                    for j in cutlass.range_constexpr(cute.size(O_rc, mode=[1])):
                        O_rc[i, j] = O_rc[i, j] * inv
                rO.store(acc_O.load().to(mO.element_type))
                if cutlass.const_expr(STAGE):
                    stage_base = sQ_raw + qb * (CHUNK * D)
                    for i in cutlass.range_constexpr(n_rows):
                        row = cO[i, 0][0]
                        for jj in cutlass.range_constexpr(cute.size(rO_pairs, mode=[2])):
                            col = cO[i, 2 * jj][1]
                            off = _staged(row, col // 8, D) + col % 8
                            sdst = cute.make_tensor(
                                stage_base + cute.assume(off, divby=2), cute.make_layout(2)
                            )
                            cute.autovec_copy(rO_pairs[None, i, jj], sdst)
                        if cO[i, 0][1] == 0:
                            part = row_part[i]
                            sPart[wg * CHUNK + row] = part if row_ok[i] else Int64(-1)
                            if row_ok[i]:
                                _store_lse(mL, part, row_max[i], row_sum[i], scale_log2)
                    cute.arch.sync_warp()
                    lane = tidx % 32
                    for it in cutlass.range_constexpr(D // 16):  # 16 rows x D/8 pieces / 32 lanes
                        piece = it * 32 + lane
                        srow = (tidx // 32) * 16 + piece // (D // 8)
                        unit = piece % (D // 8)
                        gpart = sPart[wg * CHUNK + srow]
                        if gpart >= 0:
                            ssrc = cute.make_tensor(
                                stage_base + cute.assume(_staged(srow, unit, D), divby=8),
                                cute.make_layout(8),
                            )
                            vals = cute.make_rmem_tensor(8, mO.element_type)
                            cute.autovec_copy(ssrc, vals)
                            gdst = cute.make_tensor(
                                mO.iterator + cute.assume(gpart * D + unit * 8, divby=8),
                                cute.make_layout(8),
                            )
                            cute.autovec_copy(vals, gdst)
                else:  # each thread's column pairs straight to global memory (4-byte stores)
                    for i in cutlass.range_constexpr(n_rows):
                        if row_ok[i]:
                            part = row_part[i]
                            for jj in cutlass.range_constexpr(cute.size(rO_pairs, mode=[2])):
                                gdst = cute.make_tensor(
                                    mO.iterator + cute.assume(part * D + cO[i, 2 * jj][1], divby=2),
                                    cute.make_layout(2),
                                )
                                cute.autovec_copy(rO_pairs[None, i, jj], gdst)
                            if cO[i, 0][1] == 0:
                                _store_lse(mL, part, row_max[i], row_sum[i], scale_log2)
                _wg_sync(wg, WGS)  # this Q buffer is overwritten by a later gather
            cute.arch.sync_threads()  # sK / sV may be overwritten by the next sub-group's TMA


@cute.jit
def partials_host(
    mQ: cute.Tensor,
    mK: cute.Tensor,
    mV: cute.Tensor,
    mPerm: cute.Tensor,
    mItemList: cute.Tensor,
    mItemStart: cute.Tensor,
    mItemEnd: cute.Tensor,
    mBlkStart: cute.Tensor,
    mBlkEnd: cute.Tensor,
    mO: cute.Tensor,
    mL: cute.Tensor,
    scale_log2: Float32,
    tok0: Int32,
    NB: Int32,
    stream: cuda.CUstream,
    H: Constexpr,
    HS: Constexpr,
    K: Constexpr,
    G: Constexpr,
    G2: Constexpr,
    R: Constexpr,
    BLOCK: Constexpr,
    QSTAGES: Constexpr,
    STAGE: Constexpr = True,
    WGS: Constexpr = 1,
):
    """Launch one CTA per work item. ``mQ (T*H, D)``; ``mK``, ``mV`` the ``(T, D, Hkv)`` views;
    the work list of ``flash_msa.triton_ref.worklist``; partial buffers ``mO (C*H*K, D)``,
    ``mL (C*H*K,)``."""
    D = mQ.shape[1]
    HKV = mK.shape[2]
    dtype = mQ.element_type

    def make_qk():
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(CHUNK, BLOCK),
        )  # fmt: skip

    def make_pv():
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(CHUNK, D),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip

    mma_qk, mma_qk_acc = make_qk(), make_qk()
    mma_pv, mma_pv_acc = make_pv(), make_pv()
    sQ_layout = sm90_utils.make_smem_layout_a(
        LayoutEnum.ROW_MAJOR, (CHUNK, BLOCK, D), dtype, WGS * QSTAGES
    )
    sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (CHUNK, BLOCK, D), dtype, 1)
    tma_k, tma_mK = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)), (BLOCK, D)
    )
    tma_v, tma_mV = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(sK_layout, (None, None, 0)), (BLOCK, D)
    )
    tpr = D // 8  # threads per row: 16-byte pieces
    gather = cute.make_tiled_copy_tv(
        cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
            num_bits_per_copy=128,
        ),
        cute.make_layout((THREADS // tpr, tpr), stride=(tpr, 1)),
        cute.make_layout((1, 8)),
    )  # fmt: skip

    @cute.struct
    class Storage:
        kv_mbar: cute.struct.MemRange[cutlass.Int64, 1]
        sPart: cute.struct.MemRange[cutlass.Int64, CHUNK * WGS]
        sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]

    assert Storage.__sizeof__() <= cutlass.memory.get_smem_capacity_in_bytes("sm_90")
    _partials_kernel(
        mQ, tma_k, tma_mK, tma_v, tma_mV, mPerm, mItemList, mItemStart, mItemEnd, mBlkStart,
        mBlkEnd, mO, mL, scale_log2, tok0, NB, mma_qk, mma_qk_acc, mma_pv, mma_pv_acc, sQ_layout,
        sK_layout,
        gather, Storage, H, HKV, HS, K, D, G, G2, R, BLOCK, dtype.width // 8, QSTAGES, STAGE, WGS,
    ).launch(
        grid=(mItemList.shape[0], 1, 1), block=(THREADS * WGS, 1, 1), stream=stream
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host: the partials of one query chunk over a work list
# ---------------------------------------------------------------------------------------------
def head_geometry_reason(H: int, Hkv: int, Hs: int) -> str | None:
    """Why the kernel cannot cover these head counts (``None`` if it can): each selection
    head's G = H / Hs main heads are visited in R sub-groups of G2 heads sharing one KV head,
    which must tile the group exactly (else heads would be skipped), G2 a power of two."""
    if H % Hs or H % Hkv:
        return f"H={H} must be a multiple of the selection heads ({Hs}) and KV heads ({Hkv})"
    if Hs % Hkv and Hkv % Hs:  # the kernel reloads K/V only where a sub-group starts a KV head
        return f"the selection heads ({Hs}) and KV heads ({Hkv}) must divide one another"
    G, G2, R, _ = geometry(H, Hkv, Hs, CHUNK)
    if G2 * R != G or G2 & (G2 - 1) or (H // Hkv) % G2:
        return (
            f"H={H}, Hkv={Hkv}, Hs={Hs}: the {G} heads of a selection head do not split into "
            "sub-groups of a power-of-two number of heads sharing one KV head"
        )
    return None


def partials(q, k, v, wl, o_part, l_part, cfg, tok0=0, proxy=None):
    """Driver stage ``partials`` (:mod:`flash_msa.sparse_forward`, which states the buffers'
    contract): fill ``o_part (C, H, K, D)`` and ``l_part (C, H, K)`` for packed tokens
    ``tok0 .. tok0 + C`` from work list ``wl`` (:func:`flash_msa.worklist.build`). The main
    partials only: ``proxy`` must be ``None`` (the proxy LSE partials are another stage)."""
    import math

    if proxy is not None:
        raise ValueError("CuTe forward partials: the proxy LSE partials are not made here")
    num_sel_heads = wl.heads

    T, H, D = q.shape
    Hkv = k.shape[1]
    G, G2, R, _ = geometry(H, Hkv, num_sel_heads, CHUNK)
    why = head_geometry_reason(H, Hkv, num_sel_heads)
    if why is None and (D not in (64, 128) or cfg.block_size not in (64, 128)):
        why = f"head_dim {D} / block_size {cfg.block_size}: each must be 64 or 128"
    if why is not None:
        raise ValueError(f"CuTe forward partials: {why}")
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
    runtime = (
        cute_tensor(aligned(q).view(T * H, D)),
        cute_tensor(aligned(k).permute(0, 2, 1)),  # (T, D, Hkv): a TMA box = one head's block
        cute_tensor(aligned(v).permute(0, 2, 1)),
        *(cute_tensor(x) for x in wl[:6]),  # perm, item_list, item_start/end, block_start/end
        cute_tensor(o_part.view(-1, D)),
        cute_tensor(l_part.view(-1)),
        Float32(cfg.softmax_scale * math.log2(math.e)),
        Int32(tok0),
        Int32(wl.num_blocks),
        stream(q.device),
    )
    static = (
        H, num_sel_heads, wl.slots, G, G2, R, cfg.block_size, Q_STAGES, STAGE_PARTIALS,
        WARPGROUPS,
    )  # fmt: skip
    launch(partials_host, (q.dtype, D, Hkv, *static, q.device.index), runtime, static)


def fwd(q, k, v, indices, cu_seqlens, cfg, q_proxy=None, k_proxy=None, proxy_grad=False):
    """Backend op ``fwd`` for given indices: the sparse-forward driver
    (:mod:`flash_msa.sparse_forward`) with :func:`partials` as its per-block attention stage;
    the proxy LSE partials, combine and KL stages are borrowed from the Triton backend through
    the driver until CuTe has its own. Limits: ``flash_msa.cute.unsupported_reason("fwd", ...)``."""
    from .. import sparse_forward
    from . import forward_stages

    return sparse_forward.fwd(
        forward_stages(), q, k, v, indices, cu_seqlens, cfg, q_proxy, k_proxy, proxy_grad
    )
