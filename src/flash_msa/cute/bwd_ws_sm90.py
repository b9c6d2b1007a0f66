"""Sparse backward on Hopper (sm_90a), warp-specialized: :class:`BwdWsSm90`.

The computation is :class:`~flash_msa.cute.bwd_sm90.BwdSm90`'s (same work items, phases, tiles,
MMAs, teacher slab and reductions: that module's docstring); what changes is who waits for what.
BwdSm90's profile (ncu, H200) showed one CTA per SM whose 8 warps all
stop at every step of one serial chain per 64-row chunk: the row data (``perm`` -> LSE / Delta
loads), the gathers, four CTA-wide barriers. Here the CTA has three warpgroups (the default
backward where it can run, ``backward.kernel_for``: 1.08x / 1.04x / 1.16x / 1.14x BwdSm90 at
anchor 16K / anchor 32K / paper 32K / paper 128K, whole ``bwd`` op, H200):

* warpgroup 0, the **producer** (``setmaxnreg`` down to :attr:`PRODUCER_REGS`): the K/V TMA,
  then for every (chunk, sub-group) of phase A and every chunk of phase B, into a two-stage ring
  (stage = q and dO tiles of 64 rows, or the q_proxy tile, plus the rows' data): wait until the
  consumers freed the stage (``empty`` mbarrier), write the row data (threads 0..63), gather the
  rows by cp.async, wait for them, ``fence.proxy.async`` (wgmma reads them through the async
  proxy), arrive on the stage's ``full`` mbarrier (128 arrivals);
* warpgroups 1-2, the **consumers** (64 keys each, ``setmaxnreg`` up to :attr:`CONSUMER_REGS`):
  per stage, wait ``full``, then the MMAs and register math of BwdSm90's chunk loop; they
  synchronize only with each other, by named barriers over their 256 threads: ``DS_FREE``
  before a chunk's dS tile is written (both warpgroups' previous dQ MMAs, which read all of it,
  are done), ``DS_READY`` after it is written (fenced) and before the dQ MMA; at the end of the
  stage (MMAs waited, row data read by the reductions) every consumer thread arrives on
  ``empty`` (256 arrivals).

Stage ``s = i % 2`` of iteration ``i`` (phase A's iterations, then phase B's) is in its
``n = i // 2``-th use: consumers wait ``full[s]`` for parity ``n % 2``; the producer waits
``empty[s]`` for parity ``n % 2 ^ 1`` (the phase before the first completes at once).
K_proxy replaces V in shared memory after phase A: the consumers meet at ``DS_READY``, then one
thread issues its TMA.

At G2 = 4 phase A's teacher is kept in registers: the (token, key)
pairs a thread holds are the same in every sub-group r of a chunk (row = token-major), so each
thread sums its tokens' head sums over r = 0 .. R - 1 in 8 registers (the same additions in the
same order as BwdSm90's slab load-add-store chain: the same bits; tests/ops/test_bwd.py
checks it against BwdSm90 where the atomic reductions commute) and stores them once per chunk,
after r = R - 1, at addresses from one per-item offset plus constants; a lane pair splits the
tokens by selects instead of a branch (:meth:`BwdSm90.teacher_add`). Why: the per-sub-group
slab update was ~30 % of the consumers' stall samples at paper 32K (ncu); on the H200 (one run,
against the slab update) the whole ``bwd`` op went 24.65 -> 22.20 ms at paper 32K, 99.6 -> 92.5
ms at paper 128K and 4.76 -> 4.32 ms at anchor 16K. ptxas serializes
the paper kernel's wgmmas with it (C7512) and it is faster all the same. The slab stays
thread-private until phase B (read across threads only after the consumers' ``DS_READY``
meeting that ends phase A), so the flush needs no barrier.

Shared memory: BwdSm90's with ``gather_stages=2`` plus four mbarriers (216,064 bytes at D = Dp
= 128, block 128, bf16). Registers: 384 threads launch at 168 each (``.minnctapersm 1`` pins
it: without it ptxas dropped the setmaxnreg at D = 64); the producer drops to 32 and the
consumers take 232 (128 * 32 + 256 * 232 = 63,488 <= 384 * 168 = 64,512). The split was chosen
by compiling every configuration of the compile check: 24 / 240 spilled 8-32 bytes (anchor,
paper, fp16), 40 / 224 8-56 bytes (anchor, G2 = 1, main-only, fp16); 32 / 232 none. With
``deterministic`` it spilled 8 bytes at every split tried: refused for now (``can_implement``;
the deterministic backward runs on BwdSm90). The consumers' thread index is masked to 0..255
(the compilers then know it is not negative; without it, with 256 ``empty`` arrivals, a
derived value was held across phase A and spilled 4 bytes). The dS tile is stored by one
vectorized copy of the thread's partition (per-element indices held 32 registers and spilled
at 240), before the dK MMA takes the same registers as its A operand (a wgmma's register
operands may not be read until it is waited).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator

from .bwd_sm90 import BwdSm90
from .common import WorkItems, acc_as_a, acc_rows_cols


@dataclass(frozen=True)
class BwdWsSm90(BwdSm90):
    """:class:`BwdSm90` with a producer warpgroup and two consumer warpgroups (module
    docstring). Same constructor, limits (and ``gather_stages == 2``), launch and results."""

    MBARS: ClassVar[int] = 6  # K/V, K_proxy, full[2], empty[2]
    QP_STAGES: ClassVar[int] = 2  # phase B's q_proxy tiles ride the ring too
    MIN_BLOCKS: ClassVar[int] = 1  # pins the launch register count (168) for setmaxnreg
    PRODUCER_REGS: ClassVar[int] = 32
    CONSUMER_REGS: ClassVar[int] = 232
    # named barriers of the consumers (0 is the CTA's __syncthreads)
    DS_READY: ClassVar[int] = 1
    DS_FREE: ClassVar[int] = 2
    PRODUCER_BAR: ClassVar[int] = 3  # the producer warpgroup: row data written, then gathers

    @classmethod
    def can_implement(
        cls, dtype, heads, kv_heads, sel_heads, proxy_k_heads, head_dim, proxy_head_dim, top_k,
        block_size, proxy=True, gather_stages=2, deterministic=False,
    ) -> str | None:  # fmt: skip
        """:meth:`BwdSm90.can_implement`, and: two ring stages; block 128 (two consumer
        warpgroups); ``proxy_head_dim == head_dim`` (a stage's q_proxy tile then sits where
        its q tile does: with other sizes the first phase-B stage would overlap the last
        phase-A stage still in use)."""
        why = super().can_implement(
            dtype, heads, kv_heads, sel_heads, proxy_k_heads, head_dim, proxy_head_dim, top_k,
            block_size, proxy, gather_stages, deterministic,
        )  # fmt: skip
        if why is not None:
            return why
        if gather_stages != 2:
            return f"the warp-specialized backward has two gather stages, not {gather_stages}"
        if block_size != 128:
            return f"the warp-specialized backward needs block_size 128, not {block_size}"
        if deterministic:
            return "the warp-specialized backward has no deterministic mode yet (BwdSm90 has)"
        if proxy and proxy_head_dim != head_dim:
            return (
                f"the warp-specialized backward needs proxy_head_dim == head_dim "
                f"({proxy_head_dim} != {head_dim})"
            )
        return None

    @property
    def cta_threads(self) -> int:
        return self.THREADS * (1 + self.warpgroups)

    @property
    def gather_threads(self) -> int:
        return self.THREADS

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mDO: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mQp: cute.Tensor,
        tma_kp: cute.CopyAtom,
        mKp: cute.Tensor,
        mPLSE: cute.Tensor,
        work: WorkItems,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDV: cute.Tensor,
        mDQp: cute.Tensor,
        mDKp: cute.Tensor,
        scales: tuple,
        NB: Int32,
        mmas: tuple,
        mmas_p: tuple,
        layouts: tuple,
        gathers: tuple,
        Storage: Constexpr,
        qm: tuple,  # (q_map,) with the query map, else () (BwdSm90.qmap)
    ):
        ROWS, BLOCK, D = self.ROWS, self.block_size, self.head_dim
        H, HKV = self.heads, self.kv_heads
        G, G2, R = self.geometry
        sQ_layout, sQp_layout, sK_layout, sKp_layout, sdS_layout = layouts
        t_all, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = cute.arch.make_warp_uniform(t_all // self.THREADS)  # 0 producer, 1-2 consumers

        st = SmemAllocator().allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (ROWS, D, 2)
        sdO = st.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (BLOCK, D, 1)
        sV = st.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = st.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)  # (ROWS, BLOCK, 1)
        row_layout = cute.make_layout((ROWS, 2, 2), stride=(1, ROWS, 2 * ROWS))
        sRowF = st.sRowF.get_tensor(row_layout)  # (row, field, stage)
        F = self.row_fields
        sRowI = st.sRowI.get_tensor(cute.make_layout((ROWS, F, 2), stride=(1, ROWS, F * ROWS)))
        sQp = st.sQ.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner)  # (ROWS, DP, 2)
        bars = st.mbar.data_ptr()  # K/V, K_proxy, full[0], full[1], empty[0], empty[1]
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bars, 1)
                cute.arch.mbarrier_init(bars + 1, 1)
                for s in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(bars + 2 + s, self.THREADS)  # producer threads
                    # release(): one arrival per consumer thread
                    cute.arch.mbarrier_init(bars + 4 + s, self.THREADS * self.warpgroups)
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
            kvh = (p * G) // (H // HKV)  # every head of the group uses this KV head
            slab = None
            if cutlass.const_expr(self.proxy):
                slab = st.slab.get_tensor(cute.make_layout(self.ITEM_TOKENS * BLOCK))
            if role == 0:
                cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
                if cutlass.const_expr(self.main):
                    self.load_tile(tma_k, mK, sK, D, ks, kvh, bars, warp_idx, 2)
                    self.load_tile(tma_v, mV, sV, D, ks, kvh, bars, warp_idx, -1)
                else:
                    self.load_tile(tma_k, mK, sK, D, ks, kvh, bars, warp_idx, 1)
                self.producer(
                    mQ, mDO, mLSE, mDelta, mQp, mPLSE, sQ, sdO, sQp, sRowF, sRowI, work.perm,
                    gathers, bars, e0, e1, p, scales[4], t_all, qm,
                )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(self.CONSUMER_REGS)
                # 0 .. 255; the mask tells the compilers it is not negative (divisions and
                # remainders by 128 become shifts and masks: a 4-byte spill went away)
                tc = (t_all - self.THREADS) & (self.THREADS * self.warpgroups - 1)
                cute.arch.mbarrier_wait(bars, 0)
                it = self.consumer_a(
                    sQ, sdO, sK, sV, sdS, sRowF, sRowI, slab, mDQ, mDK, mDV, mmas, scales, bars,
                    e0, e1, ks, ke, kvh, tc, role,
                )  # fmt: skip
                if cutlass.const_expr(self.proxy):
                    # both warpgroups are past phase A (its MMAs waited, its teacher written):
                    # sV may take K_proxy, the slab may be read across threads
                    self.consumers_sync(self.DS_READY)
                    sKp = st.sV.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner)
                    pk = p // (self.sel_heads // self.proxy_k_heads)
                    self.load_tile(
                        tma_kp, mKp, sKp, self.proxy_head_dim, ks, pk, bars + 1, warp_idx - 4, 1
                    )
                    cute.arch.mbarrier_wait(bars + 1, 0)
                    self.consumer_b(
                        sQp, sKp, sdS, sRowF, sRowI, slab, mDQp, mDKp, mmas_p, scales, bars, it,
                        e0, e1, ks, ke, pk, tc, role,
                    )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # roles
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def consumers_sync(self, bar_id: Constexpr):
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=self.THREADS * self.warpgroups)

    @cute.jit
    def producer(
        self, mQ, mDO, mLSE, mDelta, mQp, mPLSE, sQ, sdO, sQp, sRowF, sRowI, mPerm, gathers,
        bars, e0, e1, p, tok0, tp, qm=(),
    ):  # fmt: skip
        """Fill the ring: phase A's (chunk, sub-group) iterations, then phase B's chunks
        (``qm``: the query map's kernel arguments, read by the row data)."""
        ROWS, D, DP = self.ROWS, self.head_dim, self.proxy_head_dim
        G, G2, R = self.geometry
        BT = ROWS // G2
        n_a = (e1 - e0 + BT - 1) // BT
        it = Int32(0)
        for ch in cutlass.range(n_a, unroll=1):
            c = e0 + ch * BT
            for r in cutlass.range(R, unroll=1):
                s = it % 2
                cute.arch.mbarrier_wait(bars + 4 + s, (it // 2) % 2 ^ 1)
                h0 = p * G + r * G2
                self.row_data(mPerm, mLSE, mDelta, sRowI, sRowF, c, e1, h0, s, tp, tok0, qm)
                self.producer_sync()
                self.gather_rows(gathers[0], mQ, sQ, D, sRowI, s, tp)
                if cutlass.const_expr(self.main):
                    self.gather_rows(gathers[0], mDO, sdO, D, sRowI, s, tp)
                self.publish(bars + 2 + s)
                it += 1
        if cutlass.const_expr(self.proxy):
            n_b = (e1 - e0 + ROWS - 1) // ROWS
            for ch in cutlass.range(n_b, unroll=1):
                c = e0 + ch * ROWS
                s = it % 2
                cute.arch.mbarrier_wait(bars + 4 + s, (it // 2) % 2 ^ 1)
                self.proxy_row_data(mPerm, mPLSE, sRowI, sRowF, c, e1, p, s, tp, tok0, qm)
                self.producer_sync()
                self.gather_rows(gathers[1], mQp, sQp, DP, sRowI, s, tp)
                self.publish(bars + 2 + s)
                it += 1

    @cute.jit
    def ds_partition(self, thr_sdp, sdS):
        """This thread's elements of the dS tile ``(ROWS, BLOCK)`` in the layout of its
        ``S^T`` accumulator (keys x rows): one vectorized copy from registers, addresses from
        one base (per-element indices cost 32 live registers and spilled)."""
        sdSt = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))
        return thr_sdp.partition_C(sdSt[None, None, 0])

    @cute.jit
    def producer_sync(self):
        """The producer warpgroup's barrier: the row data (threads 0..63) before the gathers
        read it."""
        cute.arch.barrier(barrier_id=self.PRODUCER_BAR, number_of_threads=self.THREADS)

    @cute.jit
    def publish(self, full):
        """This thread's gathers are in shared memory and visible to wgmma (async proxy):
        arrive on the stage's ``full`` barrier."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(full)

    @cute.jit
    def release(self, empty):
        """The consumers are done with the stage (MMAs waited, row-data reads issued and used):
        every consumer thread arrives on ``empty`` (256 arrivals), so each thread's own reads
        are ordered before the producer's next writes. (One elected lane per warp after
        ``bar.warp.sync``, the first version, is not covered by the PTX memory model's
        synchronizing operations: racecheck reported 12 hazards. A named barrier per warpgroup
        then one arrival each, correct by the model but reported by racecheck, ran within 1% of
        this in the same run on the H200 and left.)"""
        cute.arch.mbarrier_arrive(empty)

    @cute.jit
    def consumer_a(
        self, sQ, sdO, sK, sV, sdS, sRowF, sRowI, slab, mDQ, mDK, mDV, mmas, scales, bars, e0,
        e1, ks, ke, kvh, tc, role,
    ):  # fmt: skip
        """Phase A on the consumer warpgroups (BwdSm90.phase_a's math); returns the ring
        iterations used."""
        ROWS, D, BLOCK = self.ROWS, self.head_dim, self.block_size
        G, G2, R = self.geometry
        BT = ROWS // G2
        scale, scale_log2 = scales[0], scales[1]
        mma_sdp, mma_dkv, mma_dq = mmas
        thr_sdp = mma_sdp.get_slice(tc)
        thr_dkv = mma_dkv.get_slice(tc)
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0, 2]))  # (D, ROWS)
        sdOt = cute.make_tensor(sdO.iterator, cute.select(sdO.layout, mode=[1, 0, 2]))
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0, 2]))  # (D, BLOCK)
        tSrK = mma_sdp.make_fragment_A(thr_sdp.partition_A(sK))
        tSrQ = mma_sdp.make_fragment_B(thr_sdp.partition_B(sQ))
        tSrV = mma_sdp.make_fragment_A(thr_sdp.partition_A(sV))
        tSrdO = mma_sdp.make_fragment_B(thr_sdp.partition_B(sdO))
        tVrdO = mma_dkv.make_fragment_B(thr_dkv.partition_B(sdOt))
        tKrQ = mma_dkv.make_fragment_B(thr_dkv.partition_B(sQt))
        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BLOCK, ROWS)), Float32)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BLOCK, ROWS)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((BLOCK, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((BLOCK, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        S_rc = acc_rows_cols(acc_S)
        dP_rc = acc_rows_cols(acc_dP)
        cS = acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((BLOCK, ROWS))))
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        tCsdS = self.ds_partition(thr_sdp, sdS)
        wg = role - 1  # consumer warpgroup 0 / 1 (warp-uniform: no vector register)
        regs = self.proxy and G2 == 4  # the teacher in registers (module docstring)
        rT = None
        t_base = None
        if cutlass.const_expr(regs):
            rT = cute.make_rmem_tensor((2, 4), Float32)  # (key half, token): teacher_add
            rT.fill(0.0)
            t_base = self.teacher_base(cS)
        n_a = (e1 - e0 + BT - 1) // BT
        it = Int32(0)
        for ch in cutlass.range(n_a, unroll=1):
            for r in cutlass.range(R, unroll=1):
                b = it % 2
                cute.arch.mbarrier_wait(bars + 2 + b, (it // 2) % 2)
                # 1. S^T = K q^T, dP^T = V dO^T
                self.s_dp_products(mma_sdp, acc_S, acc_dP, tSrK, tSrQ, tSrV, tSrdO, b)

                # 2. P^T and dS^T (in place), 3. the teacher
                self.probs_and_ds(S_rc, dP_rc, cS, sRowI, sRowF, b, ks, ke, scale_log2)
                if cutlass.const_expr(regs):
                    # summed over the sub-groups r = 0 .. R - 1 in order, stored after the last
                    # (every chunk runs all R, the last partial one too: its pad tokens' P is 0)
                    self.teacher_add(S_rc, rT)
                    if cutlass.const_expr(R == 1):
                        self.teacher_flush(rT, slab, t_base + ch * (BT * BLOCK))
                        rT.fill(0.0)
                    else:
                        if r == R - 1:
                            self.teacher_flush(rT, slab, t_base + ch * (BT * BLOCK))
                            rT.fill(0.0)
                elif cutlass.const_expr(self.proxy):
                    self.add_teacher(S_rc, cS, slab, ch * BT, r)
                if cutlass.const_expr(self.main):
                    # 4. dV += P^T dO, dK += dS^T q (A from registers)
                    rP.store(acc_S.load().to(self.dtype))
                    rdS.store(acc_dP.load().to(self.dtype))
                    tVrP = acc_as_a(rP)
                    tKrdS = acc_as_a(rdS)
                    warpgroup.fence()
                    mma_dkv.set(warpgroup.Field.ACCUMULATE, True)
                    for kb in cutlass.range_constexpr(cute.size(tVrP, mode=[2])):
                        cute.gemm(
                            mma_dkv, acc_dV, tVrP[None, None, kb], tVrdO[None, None, kb, b], acc_dV
                        )
                    warpgroup.commit_group()
                    # 5. dS to shared memory (once both warpgroups' last dQ MMAs are done) before
                    # the dK MMA takes rdS as its A operand (a wgmma's register operands may not
                    # be read until it is waited); from the converted copy, one vectorized
                    # store: the fp32 accumulators are dead by now
                    self.consumers_sync(self.DS_FREE)
                    cute.autovec_copy(rdS, tCsdS)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(cute.size(tKrdS, mode=[2])):
                        cute.gemm(
                            mma_dkv, acc_dK, tKrdS[None, None, kb], tKrQ[None, None, kb, b], acc_dK
                        )
                    warpgroup.commit_group()
                    self.consumers_sync(self.DS_READY)
                    # dQ = dS K (its wait also waits the dV / dK MMAs)
                    self.dq_product(mma_dq, sdS, sKt, sRowI, b, mDQ, D, scale, tc, wg)
                warpgroup.wait_group(0)  # (waited in dq_part, but not by warpgroup 1 at D = 64)
                self.release(bars + 4 + b)
                it += 1
        if cutlass.const_expr(self.main):
            self.store_dkv(thr_dkv, acc_dK, mDK, ks, ke, kvh, self.kv_heads, D, scale)
            self.store_dkv(thr_dkv, acc_dV, mDV, ks, ke, kvh, self.kv_heads, D, Float32(1.0))
        return it

    @cute.jit
    def consumer_b(
        self, sQp, sKp, sdS, sRowF, sRowI, slab, mDQp, mDKp, mmas, scales, bars, it0, e0, e1, ks,
        ke, pk, tc, role,
    ):  # fmt: skip
        """Phase B on the consumer warpgroups (BwdSm90.phase_b's math), ring iterations from
        ``it0``."""
        ROWS, DP, BLOCK = self.ROWS, self.proxy_head_dim, self.block_size
        G = self.geometry[0]
        pcoef = scales[3]
        mma_sdp, mma_dkv, mma_dq = mmas
        thr_sdp = mma_sdp.get_slice(tc)
        thr_dkv = mma_dkv.get_slice(tc)
        sQpt = cute.make_tensor(sQp.iterator, cute.select(sQp.layout, mode=[1, 0, 2]))
        sKpt = cute.make_tensor(sKp.iterator, cute.select(sKp.layout, mode=[1, 0, 2]))
        tSrKp = mma_sdp.make_fragment_A(thr_sdp.partition_A(sKp))
        tSrQp = mma_sdp.make_fragment_B(thr_sdp.partition_B(sQp))
        tKrQp = mma_dkv.make_fragment_B(thr_dkv.partition_B(sQpt))
        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BLOCK, ROWS)), Float32)
        acc_dKp = cute.make_rmem_tensor(thr_dkv.partition_shape_C((BLOCK, DP)), Float32)
        acc_dKp.fill(0.0)
        S_rc = acc_rows_cols(acc_S)
        cS = acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((BLOCK, ROWS))))
        rD = cute.make_rmem_tensor_like(acc_S, self.dtype)
        tCsdS = self.ds_partition(thr_sdp, sdS)
        wg = role - 1  # consumer warpgroup 0 / 1 (warp-uniform: no vector register)
        inv_g = Float32(1.0 / G)
        n_b = (e1 - e0 + ROWS - 1) // ROWS
        it = it0
        for ch in cutlass.range(n_b, unroll=1):
            b = it % 2
            cute.arch.mbarrier_wait(bars + 2 + b, (it // 2) % 2)
            self.proxy_products(mma_sdp, acc_S, tSrKp, tSrQp, b)
            # d = pr - teacher / G on the visible keys of real tokens, 0 elsewhere
            self.proxy_terms(S_rc, cS, sRowI, sRowF, slab, b, ch, ks, ke, scales, inv_g)
            rD.store(acc_S.load().to(self.dtype))
            tKrD = acc_as_a(rD)
            # d to shared memory before the dKp MMA takes rD as its A operand
            self.consumers_sync(self.DS_FREE)
            cute.autovec_copy(rD, tCsdS)
            cute.arch.fence_proxy("async.shared", space="cta")
            warpgroup.fence()
            mma_dkv.set(warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(cute.size(tKrD, mode=[2])):
                cute.gemm(mma_dkv, acc_dKp, tKrD[None, None, kb], tKrQp[None, None, kb, b], acc_dKp)
            warpgroup.commit_group()
            self.consumers_sync(self.DS_READY)
            self.dq_product(mma_dq, sdS, sKpt, sRowI, b, mDQp, DP, pcoef, tc, wg)
            warpgroup.wait_group(0)  # (waited in dq_part, but not by warpgroup 1 at D = 64)
            self.release(bars + 4 + b)
            it += 1
        self.store_dkv(thr_dkv, acc_dKp, mDKp, ks, ke, pk, self.proxy_k_heads, DP, pcoef)
