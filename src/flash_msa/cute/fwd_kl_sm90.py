"""The sparse forward's KL value on Hopper (sm_90a) in CuTe DSL: :class:`FwdKlSm90`, the KL
mode of the forward partials' kernel (:class:`~.fwd_partials_sm90.FwdPartialsSm90`).

The CuTe forward's ``kl`` stage (``forward.kl``, ``cute.forward.forward_stages``;
tests/ops/test_kl.py on the H200). The KL stage alone, H200: 1.11 / 2.03 / 4.98 / 17.5 ms at
anchor 16K / 32K, paper 32K / 128K, against 3.56 / 7.29 / 18.48 / 73.96 for Triton's stage;
sums equal to 6e-7 relative. The calls this kernel cannot run (a query map, D != Dp) take Triton's stage
(``forward.kl_fits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Constexpr, Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..cubin import SHARED_LIMIT
from .common import (
    PointerTensors,
    WorkItems,
    acc_rows_cols,
    pointer_tensors,
    row_gather_copy,
    tma_tiles,
)
from .fwd_partials_sm90 import LN2, FwdPartialsSm90

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

    @property
    def tensor_count(self) -> int:
        """How many tensors a launch passes (``forward.launch_tensor_names``): q, k, the work
        list's six, lse, q_proxy, k_proxy, proxy_lse, sums."""
        return 13

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
        """Launch one CTA per work item. ``tensors``: per tensor of
        ``forward.launch_tensor_names`` its typed global pointer and mode-0 size
        (:class:`~.common.PointerTensors`), the rest of its layout in :attr:`views`
        (``forward.kl_arguments``); rebuilt here as ``mQ (T*H, D)``,
        ``mK`` the ``(T, D, Hkv)`` view of k, the work list, ``mLSE (T*H,)`` the final LSEs,
        ``mQp (T*Hs, Dp)``, ``mKp`` the ``(T, Dp, Hpk)`` view of k_proxy, ``mPLSE (T*Hs,)``
        the final proxy LSEs (natural log), ``mSum (W,)`` fp32: each item's KL sum (every CTA
        writes its own, 0 for an empty item)."""
        assert len(self.views) == self.tensor_count, "views of every tensor"
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
            lim = cutlass.min(ke, Int32(t) + 1)  # (one 32-bit bound per row, as the partials')
            for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                pv = cute.math.exp2(S_rc[i, j] * scale_log2 - lse2, fastmath=True)
                if ks + cS[i, j][1] >= lim:
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
