"""Sparse backward on Hopper (sm_90a) in CuTe DSL: main and proxy gradients in one key-outer pass.

The CuTe backend's ``bwd`` kernel (host code: ``cute.backward``). One CTA per work item =
(selection head p, key block, up to :attr:`BwdSm90.ITEM_TOKENS` query tokens that kept it), the
reverse index of :mod:`flash_msa.worklist` (docs/algorithm.md, "Main attention: key-outer over a
reverse index").
The CTA has ``block_size / 64`` warpgroups; warpgroup w owns keys ``64 w .. 64 w + 63`` of the
block, so its dK and dV tiles (64 keys x D, fp32) stay in its registers for the whole item.

**Phase A: main gradients** (when ``main``). K and V of the block arrive once by TMA. For each
chunk of 64 rows (BT = 64 / G2 tokens x G2 heads of one KV sub-group, row = token-major) the
CTA gathers the rows' q and dO (cp.async, 16-byte pieces, row from ``perm``) and their LSE and
Delta, then each warpgroup, with keys in the MMA's M dimension (so that P and dS are the
register A operands of the dV and dK products, and a token's heads sit in neighbouring columns):

1. ``S^T = K q^T`` and ``dP^T = V dO^T`` (warpgroup MMAs, both operands in shared memory),
2. ``P^T = exp2(S^T * scale * log2 e - LSE * log2 e)`` (0 for keys past the block's end or
   after the row's token, and for pad rows), ``dS^T = P^T (dP^T - Delta)``,
3. adds the group's teacher: the sum over the row's heads of P^T into a per-item fp32 slab in
   shared memory ``(ITEM_TOKENS, block)`` (proxy only; the heads of a token are in one thread
   or two neighbouring lanes),
4. ``dV += P^T dO``, ``dK += dS^T q`` (A from registers, B through transposed views),
5. writes dS (input dtype) to shared memory; ``dQ = dS K`` (split over the warpgroups by
   columns when D allows) is added to the fp32 dQ buffer with ``red.global.add.f32``.

dK and dV are added to fp32 buffers at the end of the item (several items share a key block).

**Phase B: proxy gradient** (when ``proxy``), after phase A over the same tokens, 64 per chunk:
Kp of the block by TMA, q_proxy rows gathered, ``Sp^T = Kp qp^T``, the proxy probabilities
``pr = exp(Sp * pscale - proxy_lse)`` on the visible keys, ``d = pr - teacher / G`` (cast to the
input dtype, as the Triton proxy pass does: ``coef`` ~ 1/T would underflow fp16), ``dKp +=
d^T qp`` in registers (phase A's registers are free by now), ``dQp = d Kp`` through shared
memory and ``red.add``; ``coef * pscale`` (``coef = 1 / (Hs T)``, the unit KL gradient) is
applied to the fp32 results. The host scales by ``dkl``.

Limits (:meth:`BwdSm90.can_implement`): bf16 / fp16, D and Dp in {64, 128}, block 64
or 128, and every main head of a selection head sharing one KV head (``(H / Hkv) % (H / Hs) ==
0``: the chunk's KV sub-groups then reuse one K/V tile and one dK/dV accumulator).

Query map (:attr:`BwdSm90.qmap`, context parallelism; the contract's ``q_map``, docs/design.md):
the work list's entries are query rows (``worklist.build(..., q_map)``: ``q``, ``dO``, LSE,
Delta, ``q_proxy``, proxy LSE, dQ and dQ_proxy have ``Tq`` rows; K, V, K_proxy and their
gradients the keys' ``T``, blocks by key tokens), and a row's causal position is its token
``q_map[row]``: the row data's token field (read by the causal mask of both phases) is loaded
from the map instead of being the row itself; nothing else changes (padding rows have no
entries). Without the map the kernels' code is the one before the map existed (a compile-time
branch; PTX identical up to the kernel's name, compile_check ``--dump``).

No warp specialization (that is :mod:`.bwd_ws_sm90`, the default where it runs); two gather buffers
(``gather_stages``) where shared memory allows; fp32 reductions by ``red.global.add.v2.f32``.
Deterministic mode (:attr:`BwdSm90.deterministic`, ``backward._ordered``): stores into
partials summed in a fixed order (bitwise equal across runs on the H200,
tests/ops/test_bwd.py).
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
    PointerTensors,
    WorkItems,
    acc_as_a,
    acc_rows_cols,
    pointer_tensors,
    row_gather_copy,
    tma_tiles,
)

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class BwdSm90:
    """The fused sparse backward of a work list (module docstring), one static configuration;
    the fields are all of it (the compile cache keys on the object).

    Run-time values: the token, entry, work-item and block counts, the scales."""

    dtype: type[cutlass.Numeric]  # BFloat16 or Float16: q, k, v, dout, q_proxy, k_proxy
    heads: int  # H
    kv_heads: int  # Hkv
    sel_heads: int  # Hs = Hp: selection (proxy) heads
    proxy_k_heads: int  # Hpk
    head_dim: int  # D
    proxy_head_dim: int  # Dp
    top_k: int  # K: index slots per (token, selection head)
    block_size: int  # keys per block (one block per work item)
    main: bool = True  # make dq, dk, dv
    proxy: bool = True  # make the unit proxy gradient dq_proxy, dk_proxy
    # q/dO (and row data) buffers of phase A: 2 = the next (chunk, sub-group)'s gather is
    # issued before this one's MMAs, so its rows land while they run (+5% / +7% / +17% at
    # anchor 16K / anchor 32K / paper 32K, +18% at paper 128K, H200); ``backward.kernel_for``
    # uses 1 where two do not fit the shared memory
    gather_stages: int = 2
    # deterministic mode (docs/algorithm.md "Deterministic mode"): no fp32 atomics; each item
    # stores its dQ / dQ_proxy rows into per-slot partial rows (``((t - tok0) * heads + h) *
    # K + slot``: one writer each) and its dK / dV / dK_proxy tile into a per-item tile (row
    # ``item * block + key``), which flash_msa.ordered adds in a fixed order (bwd(): chunks of
    # tokens, ranges of items)
    deterministic: bool = False
    # query rows through a query map (module docstring): the row data's token is
    # ``q_map[row]``; the launch takes the map as its last tensor
    qmap: bool = False
    # the launch's tensors as their CuTe views had them (``launch.view_layout``: element type,
    # static sizes and strides, in the order of ``backward.LAUNCH_TENSORS``), set by
    # ``backward.bwd_arguments`` from the tensors of the call: the compiled code bakes them in
    # (TMA descriptors' boxes, the rows' strides), so two layouts are two kernel objects.
    # ``()`` for a configuration not yet bound to a launch's tensors (it cannot be compiled)
    views: tuple = ()

    ROWS: ClassVar[int] = 64  # rows per chunk: the MMAs' N (phase A) / tokens per chunk (B)
    THREADS: ClassVar[int] = 128  # threads per warpgroup
    KEYS: ClassVar[int] = 64  # keys per warpgroup (its M)
    ITEM_TOKENS: ClassVar[int] = 128  # tokens per work item: the teacher slab's rows
    MBARS: ClassVar[int] = 2  # mbarriers in shared memory: the K/V tiles', the K_proxy tile's
    QP_STAGES: ClassVar[int] = 1  # q_proxy tiles (phase B) in the q buffer
    # .minnctapersm of the launch (0: none): a subclass using setmaxnreg needs 1, or ptxas may
    # drop it ("unable to determine register count at entry", seen at D = 64)
    MIN_BLOCKS: ClassVar[int] = 0

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @property
    def tensor_count(self) -> int:
        """How many tensors a launch passes (``backward.launch_tensor_names``): the 20 of
        ``backward.LAUNCH_TENSORS``, then the query map (:attr:`qmap`)."""
        return 20 + self.qmap

    @classmethod
    def shared_bytes(
        cls,
        elem_bytes, head_dim, proxy_head_dim, block_size, proxy, gather_stages=1,
        deterministic=False,
    ) -> dict:  # fmt: skip
        """Bytes of each shared-memory buffer, in the order of the ``Storage`` struct (operand
        tiles aligned to 1024 bytes, the 128B swizzle's period), and their sum."""
        rows, D, Dmax = cls.ROWS, head_dim, max(head_dim, proxy_head_dim)
        sizes = {
            "mbar": 8 * cls.MBARS,  # mbarriers: K/V and Kp tiles (+ the subclass's)
            "sRowF": 2 * rows * 4 * gather_stages,  # per row: LSE (log2 units), Delta / proxy LSE
            # per row: token (-1: pad), gradient row (+ its partial row, deterministic)
            "sRowI": (3 if deterministic else 2) * rows * 4 * gather_stages,
            # q rows (gather_stages buffers), then QP_STAGES buffers of q_proxy rows
            "sQ": rows * max(D * gather_stages, proxy_head_dim * cls.QP_STAGES) * elem_bytes,
            "sdO": rows * D * elem_bytes * gather_stages,
            "sK": block_size * D * elem_bytes,
            "sV": block_size * Dmax * elem_bytes,  # V, then K_proxy
            "sdS": rows * block_size * elem_bytes,
            "slab": cls.ITEM_TOKENS * block_size * 4 if proxy else 4,  # (stub)
        }
        end = 0
        for name, size in sizes.items():
            if name.startswith("s") and name not in ("sRowF", "sRowI"):
                end = -(-end // 1024) * 1024
            end += size
        return {**sizes, "total": -(-end // 1024) * 1024}  # the struct's size: its alignment

    @classmethod
    def can_implement(
        cls, dtype, heads, kv_heads, sel_heads, proxy_k_heads, head_dim, proxy_head_dim, top_k,
        block_size, proxy=True, gather_stages=1, deterministic=False,
    ) -> str | None:  # fmt: skip
        """Why this configuration cannot be compiled or run (``None``: it can).

        Shared memory (:meth:`shared_bytes`) at D = Dp = 128, block 128, bf16: q and dO tiles
        of 64 x 128 x 2 = 16 KB each, K and V tiles of 128 x 128 x 2 = 32 KB each, the dS tile
        64 x 128 x 2 = 16 KB, the teacher slab 128 tokens x 128 keys x 4 = 64 KB, 1 KB of row
        data, aligned: 182,272 bytes of the sm_90 capacity of 232,448 (SHARED_LIMIT)."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"the CuTe backward needs bf16 or fp16, not {dtype}"
        if head_dim not in (64, 128):
            return f"the CuTe backward needs head_dim 64 or 128, not {head_dim}"
        if proxy_head_dim not in (64, 128):
            return f"the CuTe backward needs proxy_head_dim 64 or 128, not {proxy_head_dim}"
        if block_size not in (64, 128):
            return f"the CuTe backward needs block_size 64 or 128, not {block_size}"
        if top_k is not None and top_k < 1:
            return f"top_k must be positive, not {top_k}"
        H, Hkv, Hs = heads, kv_heads, sel_heads
        if H % Hs or H % Hkv or Hs % proxy_k_heads:
            return f"H={H} must be a multiple of Hs={Hs} and Hkv={Hkv}, Hs of Hpk={proxy_k_heads}"
        if (H // Hkv) % (H // Hs):
            return (
                f"the CuTe backward needs each selection head's {H // Hs} main heads to share one "
                f"KV head (H={H}, Hkv={Hkv}, Hs={Hs})"
            )
        G, G2, R, _ = geometry(H, Hkv, Hs, cls.ROWS)
        if G2 * R != G or G2 not in (1, 2, 4):
            return f"H={H}, Hkv={Hkv}, Hs={Hs}: sub-groups of {G2} heads do not tile {G}"
        if gather_stages not in (1, 2):
            return f"gather_stages must be 1 or 2, not {gather_stages}"
        smem = cls.shared_bytes(
            dtype.width // 8, head_dim, proxy_head_dim, block_size, proxy, gather_stages,
            deterministic,
        )  # fmt: skip
        if smem["total"] > SHARED_LIMIT:
            return f"{smem['total']} bytes of shared memory exceed the sm_90 capacity"
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.kv_heads, self.sel_heads, self.proxy_k_heads,
            self.head_dim, self.proxy_head_dim, self.top_k, self.block_size, self.teacher,
            self.gather_stages, self.deterministic,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe backward: {why}")
        if not (self.main or self.proxy):
            raise ValueError("CuTe backward: nothing to make (main and proxy both False)")

    @property
    def teacher(self) -> bool:
        """Whether phase A builds the teacher slab and phase B runs (the proxy gradient)."""
        return self.proxy

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(G, G2, R)``: main heads per selection head, heads per sub-group, sub-groups."""
        return geometry(self.heads, self.kv_heads, self.sel_heads, self.ROWS)[:3]

    @property
    def warpgroups(self) -> int:
        """MMA warpgroups: one per 64 keys of the block."""
        return self.block_size // self.KEYS

    @property
    def row_fields(self) -> int:
        """Int32 fields per row in shared memory: token, gradient row (+ partial row)."""
        return 3 if self.deterministic else 2

    @property
    def cta_threads(self) -> int:
        return self.THREADS * self.warpgroups

    @property
    def gather_threads(self) -> int:
        """Threads that issue the row gathers (the tiled copy's size)."""
        return self.THREADS * self.warpgroups

    # -----------------------------------------------------------------------------------------
    # host: MMAs, layouts, TMA atoms, shared storage, launch
    # -----------------------------------------------------------------------------------------
    def _mmas(self, dim: int):
        """``(sdp, dkv, dq)`` tiled MMAs for head dim ``dim``: ``S^T = K q^T`` (keys x rows, both
        K-major from shared memory), ``dK += dS^T q`` (A from registers, q as MN-major B) and
        ``dQ = dS K`` (dS M-major, K as MN-major B; split by columns over the warpgroups when
        each gets >= 64, the 128B swizzle's width, else warpgroup 0 alone)."""
        dt, ROWS, WGS = self.dtype, self.ROWS, self.warpgroups
        K_, MN = OperandMajorMode.K, OperandMajorMode.MN
        sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_, K_, Float32, atom_layout_mnk=(WGS, 1, 1), tiler_mn=(self.KEYS, ROWS)
        )
        dkv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_, MN, Float32, atom_layout_mnk=(WGS, 1, 1), tiler_mn=(self.KEYS, dim),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        nq = self.dq_split(dim)
        dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, MN, MN, Float32, atom_layout_mnk=(1, nq, 1), tiler_mn=(ROWS, dim // nq)
        )
        return sdp, dkv, dq

    def dq_split(self, dim: int) -> int:
        """Warpgroups sharing the dQ product's columns (each >= 64 of them)."""
        return self.warpgroups if dim // self.warpgroups >= 64 else 1

    @cute.jit
    def __call__(
        self,
        tensors: PointerTensors,
        scale: Float32,
        scale_log2: Float32,
        pscale_log2: Float32,
        pcoef: Float32,
        NB: Int32,
        tok0: Int32,
        stream: cuda.CUstream,
    ):
        """Launch one CTA per work item. ``tensors``: per tensor of ``backward.LAUNCH_TENSORS`` its
        typed global pointer and mode-0 size (run-time; :class:`~.common.PointerTensors`), the rest
        of its layout in :attr:`views` (``backward.bwd_arguments``); rebuilt here as the tensors the
        kernel takes: ``mQ``, ``mDO (T*H, D)``; ``mK``, ``mV`` the ``(T, D, Hkv)`` views of k and v;
        ``mLSE``, ``mDelta (T*H,)`` fp32 (natural-log LSE; Delta = rowsum(out * dout)); ``mQp (T*Hs,
        Dp)``, ``mKp`` the ``(T, Dp, Hpk)`` view of k_proxy, ``mPLSE (T*Hs,)``; the work list's six
        tensors (:class:`~.common.WorkItems`); fp32 outputs, zero-filled, as rows (2-D: more than
        2**31 elements at 1M tokens; the kernel adds by 64-bit offsets from the base): ``mDQ (T*H,
        D)``, ``mDK``, ``mDV (T*Hkv, D)``, ``mDQp (T*Hs, Dp)``, ``mDKp (T*Hpk, Dp)``;
        ``q_map (Tq,)`` int32 exactly when :attr:`qmap` (the row-indexed tensors then have ``Tq``
        query rows, the key-indexed ones the keys' ``T``). The scales: softmax scale, its * log2 e,
        proxy scale * log2 e, coef * proxy scale (coef = 1 / (Hs T)); ``NB`` the block count;
        ``tok0`` the first token of the work list's chunk (deterministic)."""
        assert len(self.views) == self.tensor_count, "views of every tensor"
        t = pointer_tensors(tensors, self.views)
        mQ, mDO, mK, mV, mLSE, mDelta, mQp, mKp, mPLSE = t[:9]
        work = WorkItems(*t[9:15])
        mDQ, mDK, mDV, mDQp, mDKp = t[15:20]
        q_map = t[20] if cutlass.const_expr(self.qmap) else None
        ROWS, D, DP, BLOCK = self.ROWS, self.head_dim, self.proxy_head_dim, self.block_size
        dtype = self.dtype
        mmas = self._mmas(D)
        mmas_p = self._mmas(DP)
        STAGES = self.gather_stages
        sQ_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (BLOCK, ROWS, D), dtype, STAGES
        )
        sQp_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (BLOCK, ROWS, DP), dtype, self.QP_STAGES
        )
        sK_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK, ROWS, D), dtype, 1)
        sKp_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (BLOCK, ROWS, DP), dtype, 1
        )
        sdS_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.COL_MAJOR, (ROWS, D, BLOCK), dtype, 1
        )  # (ROWS, BLOCK), rows contiguous: the A operand of dQ = dS K, M-major
        one = (None, None, 0)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, one), (BLOCK, D)
        )
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.slice_(sK_layout, one), (BLOCK, D)
        )
        tma_kp, tma_mKp = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKp, cute.slice_(sKp_layout, one), (BLOCK, DP)
        )
        nthreads = self.gather_threads
        gathers = (row_gather_copy(dtype, nthreads, D), row_gather_copy(dtype, nthreads, DP))

        smem_q = max(cute.cosize(sQ_layout), cute.cosize(sQp_layout))
        smem_v = max(cute.cosize(sK_layout), cute.cosize(sKp_layout))
        SLAB = self.ITEM_TOKENS * BLOCK if self.teacher else 1

        @cute.struct
        class Storage:  # sizes: shared_bytes
            mbar: cute.struct.MemRange[cutlass.Int64, self.MBARS]
            sRowF: cute.struct.MemRange[Float32, 2 * ROWS * STAGES]
            sRowI: cute.struct.MemRange[Int32, self.row_fields * ROWS * STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, smem_q], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, smem_v], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sdS_layout)], 1024]
            slab: cute.struct.Align[cute.struct.MemRange[Float32, SLAB], 1024]

        smem = self.shared_bytes(
            dtype.width // 8, D, DP, BLOCK, self.teacher, STAGES, self.deterministic
        )["total"]  # fmt: skip
        assert Storage.__sizeof__() == smem <= SHARED_LIMIT, (Storage.__sizeof__(), smem)
        qm = (q_map,) if cutlass.const_expr(self.qmap) else ()  # the map's kernel arguments
        self.kernel(
            mQ, mDO, tma_k, tma_mK, tma_v, tma_mV, mLSE, mDelta, mQp, tma_kp, tma_mKp, mPLSE,
            work, mDQ, mDK, mDV, mDQp, mDKp, (scale, scale_log2, pscale_log2, pcoef, tok0), NB,
            mmas, mmas_p,
            (sQ_layout, sQp_layout, sK_layout, sKp_layout, sdS_layout),
            gathers, Storage, qm,
        ).launch(
            grid=(work.item_list.shape[0], 1, 1),
            block=(self.cta_threads, 1, 1),
            stream=stream,
            min_blocks_per_mp=self.MIN_BLOCKS,
        )  # fmt: skip

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
        qm: tuple,  # (q_map,) with the query map, else ()
    ):
        ROWS, BLOCK, D = self.ROWS, self.block_size, self.head_dim
        H, HKV, HS = self.heads, self.kv_heads, self.sel_heads
        G, G2, R = self.geometry
        sQ_layout, sQp_layout, sK_layout, sKp_layout, sdS_layout = layouts
        t_all, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        st = SmemAllocator().allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (ROWS, D, 1)
        sdO = st.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (BLOCK, D, 1)
        sV = st.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = st.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)  # (ROWS, BLOCK, 1)
        row_layout = cute.make_layout(
            (ROWS, 2, self.gather_stages), stride=(1, ROWS, 2 * ROWS)
        )  # (row, field, buffer)
        sRowF = st.sRowF.get_tensor(row_layout)
        F = self.row_fields
        sRowI = st.sRowI.get_tensor(
            cute.make_layout((ROWS, F, self.gather_stages), stride=(1, ROWS, F * ROWS))
        )
        bars = st.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bars, 1)
                cute.arch.mbarrier_init(bars + 1, 1)
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
            if cutlass.const_expr(self.main):
                self.load_tile(tma_k, mK, sK, D, ks, kvh, bars, warp_idx, 2)
                self.load_tile(tma_v, mV, sV, D, ks, kvh, bars, warp_idx, -1)
            else:
                self.load_tile(tma_k, mK, sK, D, ks, kvh, bars, warp_idx, 1)
            slab = None
            if cutlass.const_expr(self.teacher):
                slab = st.slab.get_tensor(cute.make_layout(self.ITEM_TOKENS * BLOCK))
            cute.arch.mbarrier_wait(bars, 0)
            self.phase_a(
                mQ, mDO, mLSE, mDelta, sQ, sdO, sK, sV, sdS, sRowF, sRowI, slab, work.perm, mDQ,
                mDK, mDV, mmas, gathers[0], scales, e0, e1, p, ks, ke, kvh, t_all, qm,
            )  # fmt: skip
            if cutlass.const_expr(self.teacher):
                # phase A's MMAs are done (waited, then the CTA barrier closing its last chunk):
                # sV may take K_proxy, sQ the proxy rows
                sKp = st.sV.get_tensor(sKp_layout.outer, swizzle=sKp_layout.inner)
                sQp = st.sQ.get_tensor(sQp_layout.outer, swizzle=sQp_layout.inner)
                pk = p // (HS // self.proxy_k_heads)
                self.load_tile(tma_kp, mKp, sKp, self.proxy_head_dim, ks, pk, bars + 1, warp_idx, 1)
                cute.arch.mbarrier_wait(bars + 1, 0)
                self.phase_b(
                    mQp, mPLSE, sQp, sKp, sdS, sRowF, sRowI, slab, work.perm, mDQp, mDKp,
                    mmas_p, gathers[1], scales, e0, e1, p, ks, ke, pk, t_all, qm,
                )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # device roles (traced inline into the kernel)
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load_tile(self, tma, mX, sX, dim: Constexpr, ks, head, bar, warp_idx, tiles: Constexpr):
        """TMA the ``(BLOCK, dim)`` tile of head ``head`` of the block starting at packed
        position ``ks`` into ``sX`` (warp 0), completing on ``bar``. ``tiles`` > 0: arm the
        barrier for that many tiles of this size first; -1: the barrier is already armed."""
        BLOCK = self.block_size
        gX = cute.local_tile(
            cute.domain_offset((ks, 0, 0), mX)[None, None, head], (BLOCK, dim), (0, 0)
        )
        tXsX, tXgX = tma_tiles(tma, sX, gX)
        if warp_idx == 0:
            if cutlass.const_expr(tiles > 0):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        bar, tiles * BLOCK * dim * (self.dtype.width // 8)
                    )
            cute.copy(tma, tXgX, tXsX[(None, 0)], tma_bar_ptr=bar)

    @cute.jit
    def gather_rows(self, gather, mX, sX, dim: Constexpr, sRowI, buf, t_all):
        """cp.async rows ``sRowI[r, 1, buf]`` of ``mX`` (pad rows: any valid row) into buffer
        ``buf`` of ``sX`` (one commit group)."""
        thr = gather.get_slice(t_all)
        tGsX = thr.partition_D(sX)  # ((8, 1), passes, 1, 1)
        tGcX = thr.partition_D(cute.make_identity_tensor((self.ROWS, dim)))
        col = tGcX[0, 0, 0][1]
        for ps in cutlass.range_constexpr(cute.size(tGsX, mode=[1])):
            row = tGcX[0, ps, 0][0]
            src_row = sRowI[row, 1, buf]
            off = cute.assume(Int64(src_row) * mX.stride[0] + col, divby=8)
            src = cute.make_tensor(mX.iterator + off, cute.make_layout(((8, 1),)))
            cute.copy(gather, src, tGsX[None, ps, 0, buf])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def row_data(self, mPerm, mLSE, mDelta, sRowI, sRowF, c, e1, h0, buf, t_all, tok0=0, qm=()):
        """Threads 0..63 write the data of phase A's rows (entries ``c + row / G2``, heads
        ``h0 + row % G2``) into buffer ``buf``: token (-1: pad; with the query map ``qm`` the
        query row's token ``q_map[t]``), q/dO row, LSE (log2 units, +inf: pad), Delta;
        deterministic: the row's partial row (:attr:`deterministic`)."""
        H, HS, K = self.heads, self.sel_heads, self.top_k
        G2 = self.geometry[1]
        if t_all < self.ROWS:
            e = c + t_all // G2
            flat = mPerm[cutlass.min(e, e1 - 1)]
            t = Int32(flat // (HS * K))
            qrow = t * H + h0 + t_all % G2
            sRowI[t_all, 1, buf] = qrow
            if cutlass.const_expr(self.deterministic):
                sRowI[t_all, 2, buf] = ((t - tok0) * H + h0 + t_all % G2) * K + Int32(flat % K)
            if e < e1:
                if cutlass.const_expr(self.qmap):  # the causal position: the row's token
                    sRowI[t_all, 0, buf] = qm[0][t]
                else:
                    sRowI[t_all, 0, buf] = t
                sRowF[t_all, 0, buf] = mLSE[qrow] * LOG2E
                if cutlass.const_expr(self.main):
                    sRowF[t_all, 1, buf] = mDelta[qrow]
            else:
                sRowI[t_all, 0, buf] = Int32(-1)
                sRowF[t_all, 0, buf] = Float32.inf
                sRowF[t_all, 1, buf] = Float32(0.0)

    @cute.jit
    def proxy_row_data(self, mPerm, mPLSE, sRowI, sRowF, c, e1, p, buf, t_all, tok0, qm=()):
        """Threads 0..63 write the data of phase B's rows (entries ``c + row``, selection head
        ``p``) into buffer ``buf``: token (-1: pad; with the query map ``qm`` ``q_map[t]``),
        q_proxy row, proxy LSE (log2 units, +inf: pad); deterministic: the row's dQ_proxy
        partial row."""
        HS, K = self.sel_heads, self.top_k
        if t_all < self.ROWS:
            e = c + t_all
            flat = mPerm[cutlass.min(e, e1 - 1)]
            t = Int32(flat // (HS * K))
            prow = t * HS + p
            sRowI[t_all, 1, buf] = prow
            if cutlass.const_expr(self.deterministic):
                sRowI[t_all, 2, buf] = ((t - tok0) * HS + p) * K + Int32(flat % K)
            if e < e1:
                if cutlass.const_expr(self.qmap):  # the causal position: the row's token
                    sRowI[t_all, 0, buf] = qm[0][t]
                else:
                    sRowI[t_all, 0, buf] = t
                sRowF[t_all, 0, buf] = mPLSE[prow] * LOG2E
            else:
                sRowI[t_all, 0, buf] = Int32(-1)
                sRowF[t_all, 0, buf] = Float32.inf

    @cute.jit
    def phase_a(
        self, mQ, mDO, mLSE, mDelta, sQ, sdO, sK, sV, sdS, sRowF, sRowI, slab, mPerm, mDQ,
        mDK, mDV, mmas, gather, scales, e0, e1, p, ks, ke, kvh, t_all, qm=(),
    ):  # fmt: skip
        """Main gradients (and the teacher slab) over the item's rows (module docstring);
        ``qm``: the query map's kernel arguments (:attr:`qmap`)."""
        ROWS, D, BLOCK = self.ROWS, self.head_dim, self.block_size
        G, G2, R = self.geometry
        BT = ROWS // G2
        scale, scale_log2, tok0 = scales[0], scales[1], scales[4]
        mma_sdp, mma_dkv, mma_dq = mmas
        thr_sdp = mma_sdp.get_slice(t_all)
        thr_dkv = mma_dkv.get_slice(t_all)
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
        wg = cute.arch.make_warp_uniform(t_all // self.THREADS)
        n_chunks = (e1 - e0 + BT - 1) // BT
        STAGES = self.gather_stages
        pending = 2 if self.main else 1  # commit groups of one (chunk, sub-group)'s gathers
        if cutlass.const_expr(STAGES == 2):  # prologue: the first (chunk, sub-group)'s rows
            self.row_data(mPerm, mLSE, mDelta, sRowI, sRowF, e0, e1, p * G, 0, t_all, tok0, qm)
            cute.arch.sync_threads()
            self.gather_rows(gather, mQ, sQ, D, sRowI, 0, t_all)
            if cutlass.const_expr(self.main):
                self.gather_rows(gather, mDO, sdO, D, sRowI, 0, t_all)
        for ch in cutlass.range(n_chunks, unroll=1):
            c = e0 + ch * BT
            for r in cutlass.range(R, unroll=1):  # (unrolled: 264 B of spills at R = 4)
                h0 = p * G + r * G2  # first main head of this sub-group
                b = 0  # this (chunk, sub-group)'s buffer
                if cutlass.const_expr(STAGES == 1):
                    # rows' data: token (-1 = pad), q/dO row, LSE (log2 units), Delta
                    self.row_data(mPerm, mLSE, mDelta, sRowI, sRowF, c, e1, h0, 0, t_all, tok0, qm)
                    cute.arch.sync_threads()
                    self.gather_rows(gather, mQ, sQ, D, sRowI, 0, t_all)
                    if cutlass.const_expr(self.main):
                        self.gather_rows(gather, mDO, sdO, D, sRowI, 0, t_all)
                    cute.arch.cp_async_wait_group(0)
                else:
                    # the next (chunk, sub-group)'s rows into the other buffer (last read by the
                    # previous iteration, before its closing barrier), then wait for this one's
                    it = ch * R + r
                    b = it % 2
                    if it + 1 < n_chunks * R:
                        nch = (it + 1) // R
                        h1 = p * G + Int32((it + 1) - nch * R) * G2
                        c1 = e0 + nch * BT
                        self.row_data(
                            mPerm, mLSE, mDelta, sRowI, sRowF, c1, e1, h1, 1 - b, t_all, tok0, qm
                        )
                        cute.arch.sync_threads()
                        self.gather_rows(gather, mQ, sQ, D, sRowI, 1 - b, t_all)
                        if cutlass.const_expr(self.main):
                            self.gather_rows(gather, mDO, sdO, D, sRowI, 1 - b, t_all)
                        cute.arch.cp_async_wait_group(pending)
                    else:
                        cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()

                # 1. S^T = K q^T, dP^T = V dO^T
                self.s_dp_products(mma_sdp, acc_S, acc_dP, tSrK, tSrQ, tSrV, tSrdO, b)

                # 2. P^T and dS^T (in place), 3. the teacher
                self.probs_and_ds(S_rc, dP_rc, cS, sRowI, sRowF, b, ks, ke, scale_log2)
                if cutlass.const_expr(self.teacher):
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
                    for kb in cutlass.range_constexpr(cute.size(tKrdS, mode=[2])):
                        cute.gemm(
                            mma_dkv, acc_dK, tKrdS[None, None, kb], tKrQ[None, None, kb, b], acc_dK
                        )
                    warpgroup.commit_group()
                    # 5. dS to shared memory, dQ = dS K
                    for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                        for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
                            sdS[cS[i, j][1], cS[i, j][0], 0] = dP_rc[i, j].to(self.dtype)
                    warpgroup.wait_group(0)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.sync_threads()
                    self.dq_product(mma_dq, sdS, sKt, sRowI, b, mDQ, D, scale, t_all, wg)
                cute.arch.sync_threads()  # sQ, sdO, sdS and the row data are rewritten next
        if cutlass.const_expr(self.main):
            self.store_dkv(thr_dkv, acc_dK, mDK, ks, ke, kvh, self.kv_heads, D, scale)
            self.store_dkv(thr_dkv, acc_dV, mDV, ks, ke, kvh, self.kv_heads, D, Float32(1.0))

    @cute.jit
    def s_dp_products(self, mma_sdp, acc_S, acc_dP, tSrK, tSrQ, tSrV, tSrdO, b):
        """A chunk's step 1: ``S^T = K q^T`` (and ``dP^T = V dO^T`` when :attr:`main`) from
        the q / dO tiles of buffer ``b``, issued and waited."""
        warpgroup.fence()
        mma_sdp.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
            cute.gemm(mma_sdp, acc_S, tSrK[None, None, kb, 0], tSrQ[None, None, kb, b], acc_S)
            mma_sdp.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.main):
            mma_sdp.set(warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(cute.size(tSrV, mode=[2])):
                cute.gemm(
                    mma_sdp, acc_dP, tSrV[None, None, kb, 0], tSrdO[None, None, kb, b],
                    acc_dP,
                )  # fmt: skip
                mma_sdp.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def probs_and_ds(self, S_rc, dP_rc, cS, sRowI, sRowF, b, ks, ke, scale_log2):
        """A chunk's step 2: ``P^T`` in place of ``S^T`` (0 past the block's end, after the
        row's token, and for pad rows: token -1) and, when :attr:`main`, ``dS^T = P^T (dP^T -
        Delta)`` in place of ``dP^T``; rows' data from buffer ``b``."""
        for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
            row = cS[0, j][1]
            tok = sRowI[row, 0, b]
            lse2 = sRowF[row, 0, b]
            delta = sRowF[row, 1, b]
            # the row sees the keys before min(ke, its token + 1) (a pad row's token -1: none):
            # one bound per row, one compare per key
            lim = cutlass.min(ke, tok + 1)
            for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
                pv = cute.math.exp2(S_rc[i, j] * scale_log2 - lse2, fastmath=True)
                if ks + cS[i, j][0] >= lim:
                    pv = Float32(0.0)
                S_rc[i, j] = pv
                if cutlass.const_expr(self.main):
                    dP_rc[i, j] = pv * (dP_rc[i, j] - delta)

    @cute.jit
    def add_teacher(self, S_rc, cS, slab, tok0, r):
        """Add each token's sum over its G2 heads of P^T to the slab's rows ``tok0 ..`` (the
        first sub-group ``r == 0`` writes, later ones add). Columns are (token, head), head
        fastest; a thread holds column pairs, so G2 <= 2 sums in-thread and G2 = 4 adds the
        neighbouring lane's pair."""
        G2 = self.geometry[1]
        SLAB_W = self.block_size  # floats per slab row
        lane = cute.arch.lane_idx()
        npairs = cute.size(S_rc, mode=[1]) // 2
        for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
            key = cS[i, 0][0]
            for jj in cutlass.range_constexpr(npairs):
                col = cS[i, 2 * jj][1]
                a = S_rc[i, 2 * jj]
                b = S_rc[i, 2 * jj + 1]
                if cutlass.const_expr(G2 == 1):
                    for u, val in ((0, a), (1, b)):
                        idx = (tok0 + col + u) * SLAB_W + key
                        slab[idx] = (slab[idx] if r > 0 else Float32(0.0)) + val
                elif cutlass.const_expr(G2 == 2):
                    idx = (tok0 + col // 2) * SLAB_W + key
                    slab[idx] = (slab[idx] if r > 0 else Float32(0.0)) + (a + b)
                else:  # G2 == 4: lanes 2m and 2m + 1 hold the token's four heads
                    s = a + b
                    s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
                    if lane % 2 == 0:
                        idx = (tok0 + col // 4) * SLAB_W + key
                        slab[idx] = (slab[idx] if r > 0 else Float32(0.0)) + s

    @cute.jit
    def teacher_base(self, cS):
        """This thread's slab offset for :meth:`teacher_add` / :meth:`teacher_flush` (G2 = 4),
        from its first accumulator coordinate (key ``cS[0, 0][0]``, column ``cS[0, 0][1]`` =
        ``2 (lane % 4)``, so token ``(lane % 4) // 2``) and its lane's half of the token pairs
        (odd lanes: 2 tokens on); computed once per item, every store then adds a constant."""
        odd = cute.arch.lane_idx() % 2
        return (cS[0, 0][1] // 4 + 2 * odd) * self.block_size + cS[0, 0][0]

    @cute.jit
    def teacher_add(self, S_rc, rT):
        """G2 = 4: add this sub-group's teacher terms to the registers ``rT`` (2 rows x 4; the
        teacher in registers of ``BwdWsSm90``). A thread holds rows (keys) r and r + 8 and
        column pairs ``8 jj + 2 (lane % 4)``: pair jj is token ``2 jj + (lane % 4) // 2``,
        heads 2 (lane % 2) .. + 1, so lanes 2m and 2m + 1 hold a token's four heads. The
        lane pair splits the tokens without a branch: the even lane keeps the even jj (its
        ``rT[i, k]`` is jj = 2k), the odd lane the odd jj, each sends the other its pair sum of
        the other's jj. The sum is the same as :meth:`add_teacher`'s (even lane's pair + odd
        lane's pair, then added to the previous sub-groups' in sub-group order): bitwise."""
        assert cute.size(S_rc, mode=[0]) == 2 and cute.size(S_rc, mode=[1]) == 16
        odd = cute.arch.lane_idx() % 2 == 1
        for i in cutlass.range_constexpr(2):
            for k in cutlass.range_constexpr(4):
                s_even = S_rc[i, 4 * k] + S_rc[i, 4 * k + 1]  # jj = 2k
                s_odd = S_rc[i, 4 * k + 2] + S_rc[i, 4 * k + 3]  # jj = 2k + 1
                send = Float32(cutlass.select_(odd, s_even, s_odd))
                keep = Float32(cutlass.select_(odd, s_odd, s_even))
                rT[i, k] = rT[i, k] + (keep + cute.arch.shuffle_sync_bfly(send, offset=1))

    @cute.jit
    def teacher_flush(self, rT, slab, base):
        """Store :meth:`teacher_add`'s registers into the slab at ``base`` (:meth:`teacher_base`
        plus the chunk's rows): ``rT[i, k]`` is key + 8 i, token + 4 k; plain stores, both lanes
        of a pair (distinct tokens), pad tokens' zeros included."""
        for i in cutlass.range_constexpr(2):
            for k in cutlass.range_constexpr(4):
                slab[base + (4 * k * self.block_size + 8 * i)] = rT[i, k]

    @cute.jit
    def dq_product(
        self, mma_dq, sdS, sXt, sRowI, buf, mOut, dim: Constexpr, coef, t_all, wg
    ):  # fmt: skip
        """``out[row, :] += coef * (dS X)[r, :]`` for the chunk's real rows r (``sRowI[r, 0,
        buf] >= 0``), ``row = sRowI[r, 1, buf]`` of a ``(rows, dim)`` fp32 output, by fp32
        reductions. The warpgroups split the columns (:meth:`dq_split`), or warpgroup 0 does it
        all."""
        if cutlass.const_expr(self.dq_split(dim) > 1):
            self.dq_part(mma_dq, sdS, sXt, sRowI, buf, mOut, dim, coef, t_all)
        else:
            if wg == 0:
                tq = t_all % self.THREADS
                self.dq_part(mma_dq, sdS, sXt, sRowI, buf, mOut, dim, coef, tq)

    @cute.jit
    def dq_part(self, mma_dq, sdS, sXt, sRowI, buf, mOut, dim: Constexpr, coef, tq):
        """Thread ``tq`` of :meth:`dq_product`'s MMA: its part of the product, reduced into
        ``out``."""
        ROWS = self.ROWS
        thr = mma_dq.get_slice(tq)
        tArdS = mma_dq.make_fragment_A(thr.partition_A(sdS))
        tBrX = mma_dq.make_fragment_B(thr.partition_B(sXt))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((ROWS, dim)), Float32)
        warpgroup.fence()
        mma_dq.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tArdS, mode=[2])):
            cute.gemm(mma_dq, acc, tArdS[None, None, kb, 0], tBrX[None, None, kb, 0], acc)
            mma_dq.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        a_rc = acc_rows_cols(acc)
        c_rc = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((ROWS, dim))))
        r0, r1 = c_rc[0, 0][0], c_rc[1, 0][0]
        f = 2 if self.deterministic else 1  # the row's partial row, or its gradient row
        mode = "red"
        if cutlass.const_expr(self.deterministic):
            mode = "store"
        self.red_rows(
            mOut, Int64(sRowI[r0, f, buf]) * dim, sRowI[r0, 0, buf] >= 0,
            Int64(sRowI[r1, f, buf]) * dim, sRowI[r1, 0, buf] >= 0, a_rc, c_rc, coef, mode,
        )  # fmt: skip

    @cute.jit
    def store_dkv(self, thr, acc, mOut, ks, ke, head, heads: Constexpr, dim: Constexpr, coef):
        """``out[(ks + key) * heads + head, :] += coef * acc[key, :]`` (a flat fp32 ``(T *
        heads * dim,)`` output) for the CTA's keys before ``ke``: fp32 reductions, other
        items add to the same block. Deterministic: ``out`` is the per-item tiles, ``out[w *
        block + key, :] = coef * acc[key, :]`` for all the block's keys (work item ``w``)."""
        a_rc = acc_rows_cols(acc)
        c_rc = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((self.block_size, dim))))
        if cutlass.const_expr(self.deterministic):
            w, _, _ = cute.arch.block_idx()
            r0 = Int64(w) * self.block_size + c_rc[0, 0][0]
            r1 = Int64(w) * self.block_size + c_rc[1, 0][0]
            self.red_rows(mOut, r0 * dim, True, r1 * dim, True, a_rc, c_rc, coef, "store")
        else:
            k0, k1 = ks + c_rc[0, 0][0], ks + c_rc[1, 0][0]
            self.red_rows(
                mOut, (Int64(k0) * heads + head) * dim, k0 < ke,
                (Int64(k1) * heads + head) * dim, k1 < ke, a_rc, c_rc, coef,
            )  # fmt: skip

    @cute.jit
    def red_rows(self, mOut, base0, ok0, base1, ok1, a_rc, c_rc, coef, mode: Constexpr = "red"):
        """``out[base_i + col] += coef * acc[i, col]`` for this thread's columns of its two
        accumulator rows ``i`` (a warpgroup MMA's thread holds rows r and r + 8, column pairs
        ``8 j + 2 (lane % 4)``) where ``ok_i``, by ``red.global.add.v2.f32`` per pair (``mode``
        "red"), or ``out[...] = ...`` by 8-byte stores ("store": deterministic partials)."""
        red = dict(op="add", dtype="f32", sem="relaxed", scope="gpu")
        assert cute.size(a_rc, mode=[0]) == 2
        pair = cute.make_rmem_tensor(2, Float32)
        for i, base, ok in ((0, base0, ok0), (1, base1, ok1)):
            if ok:
                for jj in cutlass.range_constexpr(cute.size(a_rc, mode=[1]) // 2):
                    pair[0] = a_rc[i, 2 * jj] * coef
                    pair[1] = a_rc[i, 2 * jj + 1] * coef
                    off = base + c_rc[i, 2 * jj][1]
                    if cutlass.const_expr(mode == "store"):  # (8-byte aligned: even column)
                        off = cute.assume(off, divby=2)
                        dst = cute.make_tensor(mOut.iterator + off, cute.make_layout(2))
                        dst.store(pair.load())
                    else:
                        cute.arch.red(mOut.iterator + off, pair.load(), **red)

    @cute.jit
    def phase_b(
        self, mQp, mPLSE, sQp, sKp, sdS, sRowF, sRowI, slab, mPerm, mDQp, mDKp, mmas, gather,
        scales, e0, e1, p, ks, ke, pk, t_all, qm=(),
    ):  # fmt: skip
        """The unit proxy gradient over the item's tokens, against the slab's teacher
        (:attr:`proxy`); ``qm`` as in :meth:`phase_a`."""
        ROWS, DP, BLOCK = self.ROWS, self.proxy_head_dim, self.block_size
        G = self.geometry[0]
        pcoef, tok0 = scales[3], scales[4]
        mma_sdp, mma_dkv, mma_dq = mmas
        thr_sdp = mma_sdp.get_slice(t_all)
        thr_dkv = mma_dkv.get_slice(t_all)
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
        wg = cute.arch.make_warp_uniform(t_all // self.THREADS)
        inv_g = Float32(1.0 / G)
        n_chunks = (e1 - e0 + ROWS - 1) // ROWS
        for ch in cutlass.range(n_chunks, unroll=1):
            c = e0 + ch * ROWS
            self.proxy_row_data(mPerm, mPLSE, sRowI, sRowF, c, e1, p, 0, t_all, tok0, qm)
            cute.arch.sync_threads()
            self.gather_rows(gather, mQp, sQp, DP, sRowI, 0, t_all)
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            self.proxy_products(mma_sdp, acc_S, tSrKp, tSrQp, 0)
            # d = pr - teacher / G (the gradient's)
            self.proxy_terms(S_rc, cS, sRowI, sRowF, slab, 0, ch, ks, ke, scales, inv_g)
            if cutlass.const_expr(self.proxy):
                rD.store(acc_S.load().to(self.dtype))
                tKrD = acc_as_a(rD)
                warpgroup.fence()
                mma_dkv.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(tKrD, mode=[2])):
                    cute.gemm(
                        mma_dkv, acc_dKp, tKrD[None, None, kb], tKrQp[None, None, kb, 0], acc_dKp
                    )
                warpgroup.commit_group()
                for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
                    for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
                        sdS[cS[i, j][1], cS[i, j][0], 0] = S_rc[i, j].to(self.dtype)
                warpgroup.wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                self.dq_product(mma_dq, sdS, sKpt, sRowI, 0, mDQp, DP, pcoef, t_all, wg)
            cute.arch.sync_threads()  # sQp, sdS and the row data are rewritten next
        if cutlass.const_expr(self.proxy):
            self.store_dkv(thr_dkv, acc_dKp, mDKp, ks, ke, pk, self.proxy_k_heads, DP, pcoef)

    @cute.jit
    def proxy_products(self, mma_sdp, acc_S, tSrKp, tSrQp, b):
        """Phase B's ``Sp^T = Kp qp^T`` from the q_proxy tile of buffer ``b``, issued and
        waited."""
        warpgroup.fence()
        mma_sdp.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tSrKp, mode=[2])):
            cute.gemm(mma_sdp, acc_S, tSrKp[None, None, kb, 0], tSrQp[None, None, kb, b], acc_S)
            mma_sdp.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def proxy_terms(self, S_rc, cS, sRowI, sRowF, slab, b, ch, ks, ke, scales, inv_g):
        """Phase B's elementwise step on the chunk ``ch`` of ``Sp^T`` (rows' data in buffer
        ``b``): on the visible keys of real tokens (0 elsewhere), ``d = p - t`` in place when
        :attr:`proxy` (p the proxy probability, t = teacher / G)."""
        ROWS, BLOCK = self.ROWS, self.block_size
        pscale_log2 = scales[2]
        for j in cutlass.range_constexpr(cute.size(S_rc, mode=[1])):
            tl = cS[0, j][1]
            tok = sRowI[tl, 0, b]
            plse2 = sRowF[tl, 0, b]
            lim = cutlass.min(ke, tok + 1)  # (one bound per row: probs_and_ds)
            for i in cutlass.range_constexpr(cute.size(S_rc, mode=[0])):
                key = cS[i, j][0]
                d = Float32(0.0)
                if ks + key < lim:
                    lp2 = S_rc[i, j] * pscale_log2 - plse2
                    if cutlass.const_expr(self.proxy):
                        pr = cute.math.exp2(lp2, fastmath=True)
                        d = pr - slab[(ch * ROWS + tl) * BLOCK + key] * inv_g
                S_rc[i, j] = d
