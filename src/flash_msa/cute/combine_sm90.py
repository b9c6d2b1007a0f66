"""The sparse forward's combine on Hopper (sm_90a) in CuTe DSL: merge per-block partials by LSE.

NOT REGISTERED YET (off until it is at least as fast as Triton's on the H200:
benchmarks/combine_ab.py; exactness: tests/test_gpu_cute_combine.py). To switch it on,
``flash_msa/cute/__init__.py``'s ``COMBINE_ON_CUTE`` and ``forward_stages`` passes
``combine=combine_sm90.combine`` when :func:`combine_fits` holds for the call.

Driver stage ``combine(o_part, l_part, idx, out, lse)`` of :mod:`flash_msa.sparse_forward` (its
docstring has the partial-buffer contract). For a chunk of C tokens and a row ``(t, h)``, its K
slots ``s`` (selection head ``h // (H / Hs)`` of ``idx (C, Hs, K)``; a slot with index -1 is
unused: its partial row was never written, and nothing read from it reaches a result) are
merged as the Triton stage (``triton_ref/sparse_fwd.py``: ``_combine_kernel``) merges them:

    l_s   = l_part[t, h, s] on used slots, -inf on unused ones
    m     = max_s l_s (0 if every l_s is -inf)
    w_s   = exp(l_s - m),  l = sum_s w_s
    lse   = m + log(l), or -inf when l = 0 (no visible key: also a padding row of a q_map)
    out   = sum_s w_s * o_part[t, h, s] / l, or 0 when l = 0; a partial row of weight 0 (unused
            slot, or a partial over no visible key: l_s = -inf, never written) adds nothing,
            whatever its memory holds (NaN included)

With ``o_part = out = None`` only the LSE (the proxy LSE: ``l_part = pl_part (C, Hs, K)``,
``lse = proxy_lse``). With ``proxy = (pl_part, proxy_lse)`` one launch makes both (the main
rows and the proxy rows share ``idx``: the warp of head ``h`` with ``h % (H / Hs) == 0`` also
merges proxy row ``(t, h / (H / Hs))``), saving a launch and a pass over ``idx``. fp32
arithmetic; deterministic (no atomics, a fixed order).

Bytes (memory-bound: a handful of flops per loaded byte): per token, with e the element size,
``H * K * (D * e + 4)`` partials read + ``Hs * K * 4`` indices + ``H * (D * e + 4)`` written,
i.e. at the anchor layout (H 16, Hs 4, K 16, D 128, bf16) 70,976 B per token (1.16 GB for 16K
tokens: 0.24 ms at the H200's ~4.8 TB/s HBM bound, ~0.27 ms at the ~4.3 TB/s device copy rate
measured there), at the paper layout (H 64) 283,136 B per token (2.32 GB for one 8192-token
chunk of 128K: 0.48 ms at 4.8 TB/s). The proxy LSE reads ``Hs * K * 8`` B per token (+ Hs * 4
written): 528 B at Hs 4, K 16 (8.7 MB for 16K tokens: ~2 us of HBM time; its launch costs more).

Why the first version (``order="lse"``, the H200 run of benchmarks/results/cute-stage3/
combine_ab.log) was slower than Triton's, from that log's own numbers:

- Host time. Its times are CUDA events around the Python call on an idle GPU, so they include
  the host work before the launch. The proxy-only call took 0.132-0.136 ms whatever the size
  (16K, 32K, 8K tokens: 8.4, 17, 4.3 MB, ~2-4 us of HBM time): a floor, the host. The main
  call's two anchor sizes give a slope of 1.163 GB / 0.281 ms = 4.14 TB/s (Triton: / 0.264 ms
  = 4.40 TB/s) and an intercept of ~0.17 ms (Triton ~0.035): the same floor plus two more
  tensor views. Per launch that path made 5 DLPack views (``cute_tensor``: ``from_dlpack`` and
  ``mark_compact_shape_dynamic``, 10 us each on this CPU, 20-40 on the GPU host's), the
  compile-cache key of 7 arguments, the call's argument adapters, an ``aligned`` copy check.
  Now the launch takes raw device addresses (``cute.runtime.make_ptr``, 1 us each here; the
  compiled function's argument marshalling of 7 pointers 3 us) and the token count as an
  ``Int32``; the compile cache is keyed by the kernel object alone (it fixes every argument's
  type), and one launch can make the main and the proxy LSE (``proxy=``).
- Memory-level parallelism (the 6% of the slope). A warp's row was a chain of three dependent
  global round trips: its index row, then (used slots only) its LSEs, then, after the weights'
  shuffles, its K partial rows (4 KB at K 16, D 128: 8 16-byte loads per lane). Only the last
  third of a row's time has bytes in flight; at 64 registers (32 warps per SM) that is ~45 KB
  per SM on average where ~4.8 TB/s x ~1.5 us loaded latency / 132 SMs = ~55 KB is needed.

The variants (constructor fields, swept side by side by benchmarks/combine_ab.py):

- ``order``: when a row's partial rows are loaded. ``"lse"``: the first version (index, then
  LSE of used slots, then the partial rows of weight > 0: three round trips). ``"idx"``: the
  LSEs are loaded with the index row (every slot's, unconditionally: the buffer holds them, an
  unused slot's value is replaced by -inf), and the partial rows right after the index row
  arrives, before any weight is known: an unused slot loads the row of the first used slot in
  its place (an L2 hit: the copies are ``cp.async.cg``, which bypass L1; the same trick as
  before) and a slot of weight 0 adds 0 by a select (its row may be NaN). Two round trips,
  and the weights' shuffles run while the rows are in flight. ``"all"``: the partial rows
  are loaded with the index row, unused slots too (one round
  trip; the unused slots' bytes are read for nothing: 6% more bytes at anchor 16K, 0 in a
  128K chunk of the paper layout, up to half for short sequences).
- ``rows``: rows ``(t, h)`` per warp (consecutive heads of one token: one index row when they
  share a selection head), all their loads issued before any sum: ``rows * K / (32 / (D / 8))``
  16-byte loads per lane (16 at rows 2, K 16, D 128), at most ``batch`` of them at once.
- ``smem`` ("idx" / "all"): every global load is a ``cp.async`` into shared memory (one
  commit group for the index and LSE rows, one per ``batch`` of partial rows), read back by the
  lane that copied it. In registers (``smem=False``) ptxas sinks the partial-row loads below
  the weights' shuffle chain and interleaves them with the sums (SASS of the compiled kernel:
  2-3 of 8 loads in flight); a commit group's copies stay ahead of its wait. 32 registers at K
  16 (64 for the first version); shared memory ``warps * rows * K * D * 2`` bytes (16 KiB per
  CTA at the anchor layout): ~13 CTAs, 52 warps, ~200 KB in flight per SM.
- ``warps`` per CTA; ``batch``: the 16-byte loads per lane per commit group, or in registers
  issued before their sums (all 32 of K 64, D 128 at once took 255 registers and spilled 24
  bytes in the first version, a 64-bit address per load; batches of 8: 110, no spill).
- a slot of weight 0 is zeroed as four 32-bit words before the bf16 conversion (4 SEL + 8 FFMA
  per 16 bytes instead of 8 FMUL + 8 FSEL + 8 FADD: ~32 instructions per piece, SASS).

Mapping (``order`` "idx" / "all"): warp ``w`` of the grid merges rows ``rows * w ...``; lane
``s`` holds slot ``s`` (and ``s + 32``) of the index row, the LSE row and the weights, reduced
by butterfly shuffles over the warp. A partial row of D elements is D/8 pieces of 16 bytes:
lane ``i`` loads piece ``i % (D/8)`` of slots ``i // (D/8) + (32 / (D/8)) * j`` (a warp load
instruction reads 512 contiguous bytes: two slots at D 128, four at D 64), takes its slot's
weight from the owning lane by shuffle and accumulates in fp32; the slot groups add up by
butterfly shuffles and the first D/8 lanes store the row, one 16-byte store each. ``order
"lse"`` is the first version's code (one row per warp). The LSE-only mode packs 32 / K' rows
into a warp (K' = K rounded up to a power of two, <= 32); with ``order`` "idx" / "all" its LSE
loads do not wait for the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..cubin import SHARED_LIMIT
from .common import cutlass_dtype, run_typed, stream

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_TOPK = 64  # slots per row: lane s and s + 32 own a slot's weight (the selection's limit)
ORDERS = ("lse", "idx", "all")  # when the partial rows are loaded (module docstring)
# byte alignment the launch assumes of each buffer's base: 16 for the 16-byte loads and stores
# of o_part and out; the fp32 / int32 buffers are read and written one element at a time
O_ALIGN, SCALAR_ALIGN = 16, 4


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warp_max(x, lanes: int):
    """Max of ``x`` over groups of ``lanes`` lanes (a power of two) by butterfly shuffles."""
    off = lanes // 2
    while off >= 1:  # trace-time loop
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=off))
        off //= 2
    return x


def _warp_sum(x, lanes: int):
    """Sum of ``x`` over groups of ``lanes`` lanes (a power of two) by butterfly shuffles."""
    off = lanes // 2
    while off >= 1:
        x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
        off //= 2
    return x


@dataclass(frozen=True)
class CombineSm90:
    """The combine of one chunk's partials (module docstring), one static configuration; the
    fields are all of it (the compile cache keys on the object, and it fixes the type of every
    launch argument).

    Run-time values: the chunk's token count C (the rows ``C * heads``)."""

    dtype: type[cutlass.Numeric] | None  # BFloat16 or Float16: o_part and out; None: LSE only
    heads: int  # H: rows per token of l_part / lse (Hs for the proxy LSE)
    sel_heads: int  # Hs: index rows per token; row h reads index row h // (H / Hs)
    top_k: int  # K: slots per row
    head_dim: int  # D of o_part / out (0 without O)
    has_o: bool  # False: the LSE only (o_part and out absent)
    # tuning (module docstring; benchmarks/combine_ab.py sweeps them): warps per CTA, rows per
    # warp, when the partial rows are loaded, 16-byte loads per lane in flight
    warps: int = 4
    rows: int = 1
    order: str = "idx"
    batch: int = 16
    smem: bool = True  # order "idx" / "all": the partial rows by cp.async into shared memory
    proxy: bool = False  # also the proxy LSE rows (pl_part, proxy_lse) in the same launch

    PIECE: ClassVar[int] = 8  # elements per 16-byte piece of a 2-byte dtype

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @classmethod
    def can_implement(
        cls, dtype, heads, sel_heads, top_k, head_dim, has_o, warps=4, rows=1, order="idx",
        batch=16, smem=True, proxy=False,
    ) -> str | None:  # fmt: skip
        """Why this configuration cannot be compiled or run (``None``: it can). Shared memory
        (``smem``): every partial row the CTA merges (:meth:`shared_bytes`); registers: at most
        ``batch`` 16-byte loads in flight per lane without it (compile_combine checks that no
        configuration spills)."""
        if has_o:
            if dtype not in (cutlass.BFloat16, cutlass.Float16):
                return f"the CuTe combine needs bf16 or fp16 partials, not {dtype}"
            if head_dim not in (64, 128):
                return f"the CuTe combine needs head_dim 64 or 128, not {head_dim}"
        elif dtype is not None or head_dim != 0:
            return "the LSE-only combine has no dtype or head_dim (None, 0)"
        if not 1 <= top_k <= MAX_TOPK:
            return f"the CuTe combine merges 1..{MAX_TOPK} slots per row, not top_k={top_k}"
        if heads < 1 or sel_heads < 1 or heads % sel_heads:
            return (
                f"heads ({heads}) must be a positive multiple of the selection heads ({sel_heads})"
            )
        if warps not in (1, 2, 4, 8, 16, 32):
            return f"warps per CTA must be a power of two <= 32, not {warps}"
        if order not in ORDERS:
            return f"order must be one of {ORDERS}, not {order!r}"
        if rows not in (1, 2, 4, 8) or heads % rows:
            return f"rows per warp must be 1, 2, 4 or 8 and divide heads ({heads}), not {rows}"
        if rows > 1 and (order == "lse" or not has_o):
            return "rows per warp > 1 needs the main merge (has_o) and order 'idx' or 'all'"
        if batch not in (4, 8, 16, 32):
            return f"batch (16-byte loads per lane in flight) must be 4, 8, 16 or 32, not {batch}"
        if proxy and (not has_o or order == "lse"):
            return "the fused proxy LSE needs the main merge (has_o) and order 'idx' or 'all'"
        smem_bytes = 0
        if has_o and smem:
            smem_bytes = cls.shared_bytes(head_dim, top_k, warps, rows, heads // sel_heads, proxy)
        if order != "lse" and smem_bytes > SHARED_LIMIT:
            return (
                f"{smem_bytes} bytes of shared memory (warps {warps}, rows {rows}, top_k "
                f"{top_k}, head_dim {head_dim}) exceed the sm_90 capacity ({SHARED_LIMIT})"
            )
        return None

    @staticmethod
    def shared_bytes(
        head_dim: int, top_k: int, warps: int, rows: int, groups: int = 1, proxy: bool = False
    ) -> int:
        """Shared memory of ``smem``: each warp's 16-byte loads (``rows`` rows of ``top_k /
        (32 / (head_dim / 8))`` per lane, 512 bytes a warp), all in flight at once, and its
        staged 4-byte rows (``warp_rows``): ``NI`` index rows, ``rows`` LSE rows and, with the
        fused ``proxy``, ``NI`` proxy-LSE rows of ``32 J`` entries (``J = ceil(top_k / 32)``;
        ``NI = 1`` when the warp's rows share one selection head, ``groups = heads / sel_heads``
        a multiple of ``rows``, else ``rows``). Each buffer is a multiple of 128 bytes, so the
        16-byte alignment adds nothing (the compiled kernels' allocations match, review of the
        eighth session)."""
        sg = 32 // (head_dim // 8)
        J = (top_k + 31) // 32
        NI = 1 if groups % rows == 0 else rows
        staged = warps * 32 * J * (NI + rows + (NI if proxy else 0)) * 4
        return warps * rows * ((top_k + sg - 1) // sg) * 512 + staged

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.sel_heads, self.top_k, self.head_dim, self.has_o,
            self.warps, self.rows, self.order, self.batch, self.smem, self.proxy,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe combine: {why}")

    @property
    def packed(self) -> bool:
        """Whether rows are merged by :meth:`packed_rows` (LSE only, or ``order="lse"``);
        else by :meth:`warp_rows`."""
        return not self.has_o or self.order == "lse"

    @property
    def row_lanes(self) -> int:
        """Lanes per row of :meth:`packed_rows`: the whole warp with O; else K rounded up to a
        power of two (<= 32)."""
        return 32 if self.has_o else min(32, _pow2_at_least(self.top_k))

    @property
    def rows_per_cta(self) -> int:
        if self.packed:
            return self.warps * (32 // self.row_lanes)
        return self.warps * self.rows

    # -----------------------------------------------------------------------------------------
    # host: launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        pO: cute.Pointer,
        pL: cute.Pointer,
        pIdx: cute.Pointer,
        pOut: cute.Pointer,
        pLse: cute.Pointer,
        pPL: cute.Pointer,
        pPLse: cute.Pointer,
        tokens: Int32,
        stream: cuda.CUstream,
    ):
        """Launch over the chunk's ``tokens * H`` rows: device addresses of ``o_part (C, H, K,
        D)``, ``l_part (C, H, K)`` fp32, ``idx (C, Hs, K)`` int32, ``out (C, H, D)``, ``lse (C,
        H)`` fp32, ``pl_part (C, Hs, K)`` and ``proxy_lse (C, Hs)`` fp32 (absent buffers: any
        pointer of the type :func:`launch_arguments` gives, never read). The pointers' types
        are :func:`launch_arguments`' (the compile cache relies on it)."""
        H, Hs, K, D = self.heads, self.sel_heads, self.top_k, self.head_dim
        n_rows = tokens * H
        mL = cute.make_tensor(pL, cute.make_layout(n_rows * K))
        mLse = cute.make_tensor(pLse, cute.make_layout(n_rows))
        mIdx = cute.make_tensor(pIdx, cute.make_layout(tokens * (Hs * K)))
        mPL = cute.make_tensor(pPL, cute.make_layout(tokens * (Hs * K)))
        mPLse = cute.make_tensor(pPLse, cute.make_layout(tokens * Hs))
        # (the flat sizes are not read: offsets into o_part are 64-bit, see warp_rows)
        mO = cute.make_tensor(pO, cute.make_layout(n_rows * (K * max(D, 1))))
        mOut = cute.make_tensor(pOut, cute.make_layout(n_rows * max(D, 1)))
        per_cta = self.rows_per_cta
        self.kernel(mO, mL, mIdx, mOut, mLse, mPL, mPLse, n_rows).launch(
            grid=((n_rows + per_cta - 1) // per_cta, 1, 1),
            block=(32 * self.warps, 1, 1),
            stream=stream,
        )

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,  # (C * H * K * D,) partial outputs O / l, input dtype
        mL: cute.Tensor,  # (C * H * K,) fp32 partial LSEs
        mIdx: cute.Tensor,  # (C * Hs * K,) int32: -1 marks an unused slot
        mOut: cute.Tensor,  # (C * H * D,) output, input dtype
        mLse: cute.Tensor,  # (C * H,) fp32 natural-log LSE
        mPL: cute.Tensor,  # (C * Hs * K,) fp32 proxy partial LSEs (proxy only)
        mPLse: cute.Tensor,  # (C * Hs,) fp32 proxy LSE (proxy only)
        n_rows: Int32,  # C * H
    ):
        if cutlass.const_expr(self.packed):
            self.packed_rows(mO, mL, mIdx, mOut, mLse, n_rows)
        else:
            self.warp_rows(mO, mL, mIdx, mOut, mLse, mPL, mPLse, n_rows)

    @cute.jit
    def warp_rows(self, mO, mL, mIdx, mOut, mLse, mPL, mPLse, n_rows: Int32):
        """``order`` "idx" / "all": ``rows`` rows per warp (module docstring, "Mapping")."""
        H, Hs, K, D, R, P = (
            self.heads, self.sel_heads, self.top_k, self.head_dim, self.rows, self.PIECE
        )  # fmt: skip
        G = H // Hs
        J = (K + 31) // 32  # slots per lane in the weights
        TPR = D // P  # lanes per partial row
        SG = 32 // TPR  # slot groups: slots one warp load instruction covers
        NS = (K + SG - 1) // SG  # 16-byte loads per lane and row
        NJ = R * NS  # 16-byte loads per lane
        # index rows: one when the warp's R heads share a selection head (R divides G; the
        # first head is a multiple of R), else one per row (repeats are L1 hits)
        NI = 1 if G % R == 0 else R
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        row0 = (bid * self.warps + warp) * R
        in_range = row0 < n_rows
        # a warp past the end recomputes the last rows (no stores): every lane of a warp takes
        # part in the shuffles. R divides H, so the R rows are one token's.
        row0 = cutlass.min(row0, n_rows - R)
        t = row0 // H
        h0 = row0 - t * H
        sg = lane // TPR
        col = (lane % TPR) * P
        irows = [t * Hs + (h0 + q) // G for q in range(NI)]
        jobs = [(r, i) for r in range(R) for i in range(NS)]  # (row, slot group) per 16-B load
        batches = [list(range(b, min(NJ, b + self.batch))) for b in range(0, NJ, self.batch)]
        NB = len(batches)

        slots = []  # the lane's slots in the weights, clamped into the row
        for j in cutlass.range_constexpr(J):
            s = lane + 32 * j
            if cutlass.const_expr(32 * (j + 1) > K):
                s = cutlass.min(s, K - 1)
            slots.append(s)

        def at(m, off):  # trace-time: one element of flat tensor m, as a tensor
            return cute.make_tensor(m.iterator + off, cute.make_layout(1))

        def past_k(v, j):  # trace-time: index v of the lane's slot j, -1 for a slot past K
            if cutlass.const_expr(32 * (j + 1) > K):
                v = v if lane + 32 * j < K else Int32(-1)
            return v

        if cutlass.const_expr(self.smem):
            # every global load is a cp.async into shared memory: in flight without a register,
            # and ptxas keeps a commit group's copies ahead of its wait (it sank plain loads
            # and copies whose results were used later below the weights' shuffle chain, SASS
            # of the compiled kernels: 2-3 of 8 rows in flight). Lane l's 16-byte load n lands
            # at unit (l, n, warp): a warp's 32 fill 512 contiguous bytes (no bank conflict,
            # nor for its own reads back). A lane reads back only what it copied: no barrier.
            alloc = SmemAllocator()
            sO = alloc.allocate_tensor(
                self.dtype,
                cute.make_layout((P, 32, NJ, self.warps), stride=(1, P, 32 * P, NJ * 32 * P)),
                byte_alignment=16,
            )
            sI = alloc.allocate_tensor(Int32, cute.make_layout((1, 32, J, NI, self.warps)), 16)
            sL = alloc.allocate_tensor(Float32, cute.make_layout((1, 32, J, R, self.warps)), 16)
            sP = sL
            if cutlass.const_expr(self.proxy):
                sP = alloc.allocate_tensor(
                    Float32, cute.make_layout((1, 32, J, NI, self.warps)), 16
                )
            c16 = cute.make_copy_atom(  # L2 only (.cg): each partial row is read once
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                num_bits_per_copy=128,
            )  # fmt: skip
            ci = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
            cf = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

        # 1. every load that needs nothing but the row number, at once: the index rows, every
        #    slot's LSE (a clamped address for lanes past K: the value is dropped), the proxy
        #    LSEs of the proxy rows this warp owns (the first head of their selection head)
        iv = []  # iv[q][j]: the index of slot lane + 32 j of index row q (-1 past K)
        lraw = []  # lraw[r][j]: the LSE of slot lane + 32 j of row r (whatever an unused holds)
        pv = []  # pv[q][j]: the proxy LSEs of index row q (where this warp owns that row)
        if cutlass.const_expr(self.smem):
            for q in cutlass.range_constexpr(NI):
                for j in cutlass.range_constexpr(J):
                    cute.copy(ci, at(mIdx, irows[q] * K + slots[j]), sI[None, lane, j, q, warp])
            for r in cutlass.range_constexpr(R):
                for j in cutlass.range_constexpr(J):
                    cute.copy(cf, at(mL, (row0 + r) * K + slots[j]), sL[None, lane, j, r, warp])
            if cutlass.const_expr(self.proxy):
                for q in cutlass.range_constexpr(NI):
                    if (h0 + q) % G == 0:  # warp-uniform
                        for j in cutlass.range_constexpr(J):
                            cute.copy(
                                cf, at(mPL, irows[q] * K + slots[j]), sP[None, lane, j, q, warp]
                            )
            cute.arch.cp_async_commit_group()
        else:
            for q in cutlass.range_constexpr(NI):
                iv.append([past_k(mIdx[irows[q] * K + slots[j]], j) for j in range(J)])
            for r in cutlass.range_constexpr(R):
                lraw.append([mL[(row0 + r) * K + slots[j]] for j in range(J)])
            if cutlass.const_expr(self.proxy):
                for q in cutlass.range_constexpr(NI):
                    vals = []
                    for j in cutlass.range_constexpr(J):
                        v = -Float32.inf
                        if (h0 + q) % G == 0:  # warp-uniform
                            v = mPL[irows[q] * K + slots[j]]
                        vals.append(v)
                    pv.append(vals)

        def load(n):  # trace-time: 16-byte load n of the lane (ternaries only: no control flow)
            r, i = jobs[n]
            s0 = SG * i  # the slot group's first slot (static): slot s0 + sg
            slot = s0 + sg
            if cutlass.const_expr(s0 + SG > K):  # the last group passes K: stay in the row
                slot = cutlass.min(slot, K - 1)
            if cutlass.const_expr(self.order == "idx"):
                q = r if NI > 1 else 0
                used = ((masks[q][s0 // 32] >> (s0 % 32 + sg)) & 1) != 0
                slot = slot if used else firsts[q]
            src = cute.make_tensor(
                mO.iterator + cute.assume((Int64(row0 + r) * K + slot) * D + col, divby=P),
                cute.make_layout(P),
            )
            if cutlass.const_expr(self.smem):
                cute.copy(c16, src, sO[None, lane, n, warp])
                return None
            vals = cute.make_rmem_tensor(P, self.dtype)
            cute.autovec_copy(src, vals)
            return vals

        def issue():  # trace-time: the loads (registers: the first batch; shared: all)
            if cutlass.const_expr(self.smem):
                for b in cutlass.range_constexpr(NB):
                    for n in batches[b]:
                        load(n)
                    cute.arch.cp_async_commit_group()  # one group per batch
                return []
            return [load(n) for n in batches[0]]

        def read_idx():  # trace-time: iv from shared memory (after its wait)
            for q in cutlass.range_constexpr(NI):
                iv.append([past_k(sI[0, lane, j, q, warp], j) for j in range(J)])

        # 2. the partial rows' loads, before any weight: "all" now, "idx" once the index
        #    rows are in (an unused slot loads the lowest used slot's row in its place)
        masks = []  # masks[q][j]: bit s of the used slots 32 j + s of index row q
        firsts = []  # firsts[q]: the lowest used slot of index row q (0 if none)
        pending = []
        if cutlass.const_expr(self.order == "all"):
            pending = issue()
            if cutlass.const_expr(self.smem):
                cute.arch.cp_async_wait_group(NB)  # the index and LSE group
                read_idx()
        else:
            if cutlass.const_expr(self.smem):
                cute.arch.cp_async_wait_group(0)
                read_idx()
            for q in cutlass.range_constexpr(NI):
                ms = [cute.arch.vote_ballot_sync(iv[q][j] >= 0) for j in range(J)]
                first = Int32(0)
                for j in cutlass.range_constexpr(J - 1, -1, -1):
                    low = Int32(cute.arch.clz(cute.arch.brev(ms[j]))) + 32 * j
                    first = low if ms[j] != 0 else first
                masks.append(ms)
                firsts.append(first)
            pending = issue()
        if cutlass.const_expr(self.smem):
            for r in cutlass.range_constexpr(R):
                lraw.append([sL[0, lane, j, r, warp] for j in range(J)])
            if cutlass.const_expr(self.proxy):
                for q in cutlass.range_constexpr(NI):
                    pv.append([sP[0, lane, j, q, warp] for j in range(J)])

        # 3. the weights (while the partial rows are in flight) and the LSE stores
        ws = []  # ws[r][j]: weight of slot lane + 32 j of row r
        lsums = []
        for r in cutlass.range_constexpr(R):
            q = r if NI > 1 else 0
            w, lsum, lse = self.weights(lraw[r], iv[q], J)
            ws.append(w)
            lsums.append(lsum)
            if lane == 0 and in_range:
                mLse[row0 + r] = lse
        if cutlass.const_expr(self.proxy):
            for q in cutlass.range_constexpr(NI):
                _, _, plse = self.weights(pv[q], iv[q], J)
                if lane == 0 and in_range and (h0 + q) % G == 0:
                    mPLse[irows[q]] = plse

        # 4. the weighted sums, batch after batch: a slot of weight 0 adds 0 by a select (its
        #    row may hold anything, NaN included); in registers, then the next batch's loads
        accs = []
        for _ in cutlass.range_constexpr(R):
            acc = cute.make_rmem_tensor(P, Float32)
            acc.fill(0.0)
            accs.append(acc)
        for b in cutlass.range_constexpr(NB):
            if cutlass.const_expr(self.smem):
                cute.arch.cp_async_wait_group(NB - 1 - b)
            elif cutlass.const_expr(b > 0):
                pending = [load(n) for n in batches[b]]
            for k in cutlass.range_constexpr(len(batches[b])):
                n = batches[b][k]
                r, i = jobs[n]
                s0 = SG * i
                wgt = cute.arch.shuffle_sync(ws[r][s0 // 32], offset=s0 % 32 + sg)
                ok = wgt > 0.0
                # the select on the 16 bytes as 4 words, before the conversion: 4 SEL and 8
                # FFMA per piece instead of 8 FMUL, 8 FSEL, 8 FADD (SASS of the compiled kernel)
                raw = cute.make_rmem_tensor(P // 2, Int32)
                if cutlass.const_expr(self.smem):
                    raw.store(cute.recast_tensor(sO[None, lane, n, warp], Int32).load())
                else:
                    raw.store(cute.recast_tensor(pending[k], Int32).load())
                for e in cutlass.range_constexpr(P // 2):
                    word = raw[e]
                    raw[e] = word if ok else Int32(0)
                v = cute.recast_tensor(raw, self.dtype).load().to(Float32)
                acc = accs[r]
                acc.store(acc.load() + v * wgt)

        # 5. per row: the slot groups add up, 1 / l, the first D/8 lanes store
        for r in cutlass.range_constexpr(R):
            acc = accs[r]
            off = TPR
            while off < 32:  # trace-time loop
                for e in cutlass.range_constexpr(P):
                    acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], offset=off)
                off *= 2
            lsum = lsums[r]
            inv = cute.arch.rcp_approx(lsum) if lsum > 0.0 else Float32(0.0)
            res = cute.make_rmem_tensor(P, self.dtype)
            res.store((acc.load() * inv).to(self.dtype))
            if sg == 0 and in_range:
                dst = cute.make_tensor(
                    mOut.iterator + cute.assume(Int64(row0 + r) * D + col, divby=P),
                    cute.make_layout(P),
                )
                cute.autovec_copy(res, dst)

    @cute.jit
    def weights(self, lraw, iv, J: cutlass.Constexpr):
        """One row's weights over the whole warp: ``(w, l, lse)`` with ``w[j]`` the weight of
        slot ``lane + 32 j`` (0 where the index is -1 or the LSE -inf), ``l`` their sum and
        ``lse`` the row's LSE (-inf when ``l = 0``)."""
        lv = []
        for j in cutlass.range_constexpr(J):
            lv.append(lraw[j] if iv[j] >= 0 else -Float32.inf)
        mx = lv[0]
        for j in cutlass.range_constexpr(1, J):
            mx = cute.arch.fmax(mx, lv[j])
        mx = _warp_max(mx, 32)
        mx = Float32(0.0) if mx == -Float32.inf else mx  # a row with no visible key
        w = []
        lsum = Float32(0.0)
        for j in cutlass.range_constexpr(J):
            wj = cute.math.exp2((lv[j] - mx) * LOG2E, fastmath=True)  # exp(-inf) = 0
            w.append(wj)
            lsum += wj
        lsum = _warp_sum(lsum, 32)
        lse = -Float32.inf
        if lsum > 0.0:
            lse = mx + cute.math.log2(lsum, fastmath=True) * LN2
        return w, lsum, lse

    @cute.jit
    def packed_rows(self, mO, mL, mIdx, mOut, mLse, n_rows: Int32):
        """The LSE-only mode (32 / K' rows per warp) and ``order="lse"`` (the first version:
        one row per warp, the partial rows loaded after the weights, :meth:`merge_o`)."""
        H, K = self.heads, self.top_k
        G = self.heads // self.sel_heads
        RL = self.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        row = (bid * self.warps + warp) * (32 // RL) + lane // RL
        in_range = row < n_rows
        # rows past the end recompute the last row (no stores): every lane of a warp takes
        # part in the shuffles
        row = cutlass.min(row, n_rows - 1)
        rl = lane % RL  # lane within the row's group
        irow = (row // H) * self.sel_heads + (row % H) // G  # the row's index row

        # 1. the slots' LSEs (-inf for unused slots and lanes past K), their max and the
        #    weights w_s = exp(l_s - m); lane rl owns slots rl, rl + RL, ...
        lv = []
        for j in cutlass.range_constexpr((K + RL - 1) // RL):
            s = rl + RL * j
            v = -Float32.inf
            if cutlass.const_expr(self.order != "lse"):
                # the LSE load does not wait for the index (clamped address past K)
                sc = s
                if cutlass.const_expr(RL * (j + 1) > K):
                    sc = cutlass.min(s, K - 1)
                raw = mL[row * K + sc]
                ix = mIdx[irow * K + sc]
                v = raw if (ix >= 0 and s < K) else v
            elif cutlass.const_expr(RL * (j + 1) <= K):  # every lane's slot exists
                if mIdx[irow * K + s] >= 0:
                    v = mL[row * K + s]
            else:  # nested: the index is loaded only for s < K, whatever a traced `and` does
                if s < K:  # noqa: SIM102
                    if mIdx[irow * K + s] >= 0:
                        v = mL[row * K + s]
            lv.append(v)
        mx = lv[0]
        for j in cutlass.range_constexpr(1, len(lv)):
            mx = cute.arch.fmax(mx, lv[j])
        mx = _warp_max(mx, RL)  # within the row's lane group
        mx = Float32(0.0) if mx == -Float32.inf else mx  # a row with no visible key
        w = []
        lsum = Float32(0.0)
        for j in cutlass.range_constexpr(len(lv)):
            wj = cute.math.exp2((lv[j] - mx) * LOG2E, fastmath=True)  # exp(-inf) = 0
            w.append(wj)
            lsum += wj
        lsum = _warp_sum(lsum, RL)
        lse = -Float32.inf
        if lsum > 0.0:
            lse = mx + cute.math.log2(lsum, fastmath=True) * LN2
        if rl == 0 and in_range:
            mLse[row] = lse

        # 2. the weighted sum of the used slots' partial rows (whole warp: RL == 32)
        if cutlass.const_expr(self.has_o):
            self.merge_o(mO, mOut, row, in_range, lane, lv, mx, w, lsum)

    @cute.jit
    def merge_o(self, mO, mOut, row, in_range, lane, lv, mx, w, lsum):
        """``order="lse"``: ``out[row] = sum_s w_s o_part[row, s] / l`` (0 when ``l = 0``) by
        this warp: lane ``lane`` loads piece ``lane % (D/8)`` of slots ``lane // (D/8) + SG *
        i`` (SG = 32 / (D/8) slot groups), the groups add up by butterfly shuffles, the first
        D/8 lanes store.

        A slot of weight 0 (unused, no visible key, or underflow) loads the row of a slot of
        weight 1 instead (the first with ``l_s = m``: written, finite; an L1/L2 hit, as its own
        group reads it) and adds 0 times it. So the loads need no predicate: with one per slot
        (``if w_s > 0``) ptxas kept each predicate alive through the slot's bf16 conversion
        and had 5 of the 8 loads of K 16, D 128 in flight, the other 3 one latency later (K 64:
        5 at a time; SASS read on the compiled kernels; 7 predicate registers, the likely
        limit). Now all 8 are issued back to back (K 64: batches of ``batch``). A row with no
        visible key (``l = 0``) loads nothing (a warp-uniform branch)."""
        D, K, P = self.head_dim, self.top_k, self.PIECE
        TPR = D // P  # lanes per partial row
        SG = 32 // TPR  # slot groups: slots a warp load instruction covers
        sg = lane // TPR
        col = (lane % TPR) * P
        first = Int32(0)  # a slot of weight 1: the lowest with l_s = m
        for j in cutlass.range_constexpr(len(lv) - 1, -1, -1):  # slot lane + 32 j
            hits = cute.arch.vote_ballot_sync(lv[j] == mx)
            if hits != 0:
                first = Int32(cute.arch.clz(cute.arch.brev(hits))) + 32 * j
        NS = (K + SG - 1) // SG  # slots per lane
        acc = cute.make_rmem_tensor(P, Float32)
        acc.fill(0.0)
        if lsum > 0.0:  # uniform over the warp
            base = Int64(row) * K  # the row's first partial row
            for b0 in cutlass.range_constexpr(0, NS, self.batch):
                ws_all = []
                vals_all = []
                for i in cutlass.range_constexpr(b0, min(NS, b0 + self.batch)):
                    s0 = SG * i  # the group's first slot (static): owned by lane s0 % 32 + sg
                    ws = cute.arch.shuffle_sync(w[s0 // 32], offset=s0 % 32 + sg)
                    slot = s0 + sg if ws > 0.0 else first
                    src = cute.make_tensor(
                        mO.iterator + cute.assume((base + slot) * D + col, divby=P),
                        cute.make_layout(P),
                    )
                    vals = cute.make_rmem_tensor(P, self.dtype)
                    cute.autovec_copy(src, vals)
                    ws_all.append(ws)
                    vals_all.append(vals)
                for i in cutlass.range_constexpr(len(vals_all)):
                    acc.store(acc.load() + vals_all[i].load().to(Float32) * ws_all[i])
        off = TPR
        while off < 32:  # trace-time loop: add the slot groups up
            for e in cutlass.range_constexpr(P):
                acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], offset=off)
            off *= 2
        inv = Float32(0.0)
        if lsum > 0.0:
            inv = cute.arch.rcp_approx(lsum)
        res = cute.make_rmem_tensor(P, self.dtype)
        res.store((acc.load() * inv).to(self.dtype))
        if sg == 0 and in_range:
            dst = cute.make_tensor(
                mOut.iterator + cute.assume(Int64(row) * D + col, divby=P), cute.make_layout(P)
            )
            cute.autovec_copy(res, dst)


# ---------------------------------------------------------------------------------------------
# host: the driver stage
# ---------------------------------------------------------------------------------------------
TUNING = ("warps", "rows", "order", "batch", "smem")  # the variants' fields (combine_ab.py)


def combine_fits(dtype: torch.dtype, H: int, Hs: int, K: int, D: int) -> bool:
    """Whether :func:`combine` can run a forward with these inputs (the main partials, the
    proxy LSE alone and both in one launch) with the shipped variant: the switch in
    ``cute.forward_stages`` asks this, else the driver borrows Triton's combine."""
    main = CombineSm90.can_implement(cutlass_dtype(dtype), H, Hs, K, D, True, proxy=True)
    proxy = CombineSm90.can_implement(None, Hs, Hs, K, 0, False)
    return main is None and proxy is None


def _address(name: str, buf: torch.Tensor, C: int, shape: tuple, dtype, align: int) -> int:
    """The device address of ``buf[:C]`` after checking the contract's buffer: ``dtype``,
    ``(>= C, *shape)``, contiguous, base ``align``-byte aligned (ValueError naming it)."""
    if (
        buf.dtype != dtype
        or buf.dim() != len(shape) + 1
        or tuple(buf.shape[1:]) != shape
        or buf.shape[0] < C
        or not buf.is_contiguous()
        or buf.data_ptr() % align
    ):
        raise ValueError(
            f"CuTe combine: {name} must be a contiguous, {align}-byte aligned {dtype} (>= {C}, "
            f"{', '.join(map(str, shape))}) buffer; got {buf.dtype} {tuple(buf.shape)}, "
            f"strides {buf.stride()}, address % {align} = {buf.data_ptr() % align}"
        )
    return buf.data_ptr()


def _output(name: str, buf: torch.Tensor, shape: tuple, dtype, align: int) -> torch.Tensor:
    """``buf`` itself if the kernel can write it in place (contiguous, ``align``-byte aligned),
    else a fresh buffer the caller copies back."""
    if buf.dtype != dtype or tuple(buf.shape) != shape:
        raise ValueError(
            f"CuTe combine: {name} must be a {dtype} {shape} tensor, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    if buf.is_contiguous() and buf.data_ptr() % align == 0:
        return buf
    return torch.empty(shape, dtype=dtype, device=buf.device)


def launch_arguments(kernel: CombineSm90, o, lp, idx, out, lse, pl, plse, tokens: int, strm):
    """The arguments of a launch of ``kernel`` (its ``__call__``): the seven buffers' device
    addresses (ints; an absent buffer: any address, never read) as typed pointers, the token
    count, the stream. The pointers' types and alignments depend on ``kernel`` alone, so the
    compile cache keys on the kernel object (:func:`combine`) and the compile check compiles
    what runs (:func:`compile_combine`)."""
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    o_type, o_align = (kernel.dtype, O_ALIGN) if kernel.has_o else (Float32, SCALAR_ALIGN)

    def f32(a):
        return make_ptr(Float32, a, gmem, assumed_align=SCALAR_ALIGN)

    return (
        make_ptr(o_type, o, gmem, assumed_align=o_align),
        f32(lp),
        make_ptr(Int32, idx, gmem, assumed_align=SCALAR_ALIGN),
        make_ptr(o_type, out, gmem, assumed_align=o_align),
        f32(lse),
        f32(pl),
        f32(plse),
        Int32(tokens),
        strm,
    )


# the disk cache's text for the argument types: fixed by the kernel object and this module's
# source (both in the disk key); launches go through common.run_typed
LAUNCH_SIGNATURE = "combine_sm90.launch_arguments"


def combine(
    o_part, l_part, idx, out, lse, proxy=None, *, warps=CombineSm90.warps,
    rows=CombineSm90.rows, order=CombineSm90.order, batch=CombineSm90.batch,
    smem=CombineSm90.smem,
):  # fmt: skip
    """Driver stage ``combine`` (:mod:`flash_msa.sparse_forward`): merge the chunk's partials
    ``o_part (>= C, H, K, D)`` (input dtype) and ``l_part (>= C, H, K)`` fp32 by their LSE into
    ``out (C, H, D)`` and ``lse (C, H)`` fp32, C = ``idx.shape[0]``, ``idx (C, Hs, K)`` int32
    (-1: unused slot). With ``o_part`` and ``out`` ``None`` the LSE only (the proxy LSE:
    ``l_part = pl_part (>= C, Hs, K)``, ``lse = proxy_lse``). ``proxy = (pl_part, proxy_lse)``
    (with ``o_part``): the proxy LSE too, in the same launch. ``warps``, ``rows``, ``order``,
    ``batch``, ``smem``: the kernel's tuning fields (A/B runs; the defaults are the shipped
    variant; the LSE-only launch takes ``warps`` and ``order`` only)."""
    has_o = o_part is not None
    if has_o != (out is not None):
        raise ValueError("CuTe combine: o_part and out are both given or both None")
    if proxy is not None and not has_o:
        raise ValueError("CuTe combine: proxy = (pl_part, proxy_lse) needs o_part and out")
    if idx.dtype != torch.int32 or idx.dim() != 3:
        raise ValueError(f"CuTe combine: idx must be int32 (C, Hs, K), got {idx.dtype} "
                         f"{tuple(idx.shape)}")  # fmt: skip
    C, Hs, K = idx.shape
    if lse.dim() != 2:
        raise ValueError(f"CuTe combine: lse must be (C, H), got {tuple(lse.shape)}")
    H = lse.shape[1]
    D = out.shape[-1] if has_o else 0
    if has_o:
        for name, t in (("o_part", o_part), ("out", out)):
            if t.dtype not in (torch.bfloat16, torch.float16):
                raise TypeError(
                    f"CuTe combine: {name} must be bfloat16 or float16 (the partials' and the "
                    f"output's dtype), got {t.dtype}"
                )
        kernel = CombineSm90(
            cutlass_dtype(out.dtype), H, Hs, K, D, True, warps, rows, order, batch, smem,
            proxy is not None,
        )  # fmt: skip
    else:
        kernel = CombineSm90(None, H, Hs, K, 0, False, warps, order=order)
    if C * H * K * max(D, 1) >= 2**31:  # the kernel's flat sizes and LSE offsets are int32
        raise ValueError(f"CuTe combine: C * H * K * D = {C * H * K * max(D, 1)} >= 2^31")
    f32 = torch.float32
    a_l = _address("l_part", l_part, C, (H, K), f32, SCALAR_ALIGN)
    if not idx.is_contiguous():
        idx = idx.contiguous()
    lse_buf = _output("lse", lse, (C, H), f32, SCALAR_ALIGN)
    a_o, a_out, a_pl, a_plse = a_l, lse_buf.data_ptr(), a_l, lse_buf.data_ptr()
    if has_o:
        a_o = _address("o_part", o_part, C, (H, K, D), out.dtype, O_ALIGN)
        out_buf = _output("out", out, (C, H, D), out.dtype, O_ALIGN)
        a_out = out_buf.data_ptr()
    if proxy is not None:
        pl_part, proxy_lse = proxy
        a_pl = _address("pl_part", pl_part, C, (Hs, K), f32, SCALAR_ALIGN)
        plse_buf = _output("proxy_lse", proxy_lse, (C, Hs), f32, SCALAR_ALIGN)
        a_plse = plse_buf.data_ptr()
    if C == 0:
        return
    device = lse.device
    args = launch_arguments(
        kernel, a_o, a_l, idx.data_ptr(), a_out, lse_buf.data_ptr(), a_pl, a_plse, C,
        stream(device),
    )  # fmt: skip
    run_typed(kernel, device, args, LAUNCH_SIGNATURE)
    if lse_buf is not lse:
        lse.copy_(lse_buf)
    if has_o and out_buf is not out:
        out.copy_(out_buf)
    if proxy is not None and plse_buf is not proxy_lse:
        proxy_lse.copy_(plse_buf)


# ---------------------------------------------------------------------------------------------
# compile check (no GPU): hooked into flash_msa.cute.compile_check
# ---------------------------------------------------------------------------------------------
# the variants benchmarks/combine_ab.py times (name: tuning fields of CombineSm90). The first
# version (order "lse", registers, batches of 8; only the launch path is new); the early-load
# orders through shared memory (the shipped default first), wider CTAs, two rows per warp; and
# "idx" in registers (ptxas interleaves those loads with the sums: see warp_rows)
VARIANTS = {
    "idx": dict(order="idx", warps=4, rows=1, batch=16, smem=True),
    "lse": dict(order="lse", warps=4, rows=1, batch=8, smem=False),
    "all": dict(order="all", warps=4, rows=1, batch=16, smem=True),
    "idx w8": dict(order="idx", warps=8, rows=1, batch=16, smem=True),
    "idx r2": dict(order="idx", warps=4, rows=2, batch=16, smem=True),
    "all r2": dict(order="all", warps=4, rows=2, batch=16, smem=True),
    "idx regs": dict(order="idx", warps=4, rows=1, batch=16, smem=False),
}


def lse_only_tuning(tuning: dict) -> dict:
    """The fields of a variant the LSE-only kernel takes (``warps``, ``order``)."""
    return {k: v for k, v in tuning.items() if k in ("warps", "order")}


def combine_configurations():
    """(name, dtype, H, Hs, K, D, has_o, tuning) of the combine kernels the CuTe compile check
    compiles (``tuning``: ``None`` for the shipped variant, else the fields that differ). The
    shipped variant at bf16 and fp16, D 64 and 128, K 8, 16 and 64, H 16 (anchor) and 64
    (paper) over Hs 4, and the LSE-only mode (the proxy LSE: H = Hs; once with H > Hs); with the
    fused proxy LSE at the anchor and paper layouts; every other variant of :data:`VARIANTS` at
    the anchor layout (the whole matrix: :func:`variant_configurations`)."""
    for dtype in ("bf16", "fp16"):
        for D in (64, 128):
            for K in (8, 16, 64):
                for H in (16, 64):
                    name = f"combine {dtype} H={H} Hs=4 K={K} D={D}"
                    yield name, dtype, H, 4, K, D, True, None
    for K in (8, 16, 64):
        yield f"combine lse-only H=4 Hs=4 K={K}", None, 4, 4, K, 0, False, None
    yield "combine lse-only H=16 Hs=4 K=16", None, 16, 4, 16, 0, False, None
    for dtype in ("bf16", "fp16"):
        for H in (16, 64):
            name = f"combine {dtype} H={H} Hs=4 K=16 D=128 +proxy"
            yield name, dtype, H, 4, 16, 128, True, dict(proxy=True)
    for vname, tuning in list(VARIANTS.items())[1:]:
        yield f"combine bf16 H=16 Hs=4 K=16 D=128 [{vname}]", "bf16", 16, 4, 16, 128, True, tuning
    yield "combine lse-only H=4 Hs=4 K=16 [lse]", None, 4, 4, 16, 0, False, dict(order="lse")


def variant_configurations():
    """(name, dtype, H, Hs, K, D, has_o, tuning) of every variant of :data:`VARIANTS` at the
    layouts of the shipped variant's check, the main ones also with the fused proxy LSE where
    the variant has it (``python -m flash_msa.cute.combine_sm90 --variants``)."""
    for vname, tuning in VARIANTS.items():
        for name, dtype, H, Hs, K, D, has_o, extra in combine_configurations():
            if extra is not None:
                continue
            if not has_o:
                yield f"{name} [{vname}]", dtype, H, Hs, K, D, has_o, lse_only_tuning(tuning)
                continue
            yield f"{name} [{vname}]", dtype, H, Hs, K, D, has_o, tuning
            if tuning["order"] != "lse":
                fused = dict(tuning, proxy=True)
                yield f"{name} +proxy [{vname}]", dtype, H, Hs, K, D, has_o, fused


def compile_combine(dtype, H, Hs, K, D, has_o, tuning=None, *, dump=None, name=""):
    """Compile :class:`CombineSm90` (``tuning``: a dict of its tuning fields and ``proxy``,
    ``None``: the shipped variant) for sm_90a on the launch arguments :func:`combine` passes
    (:func:`launch_arguments`, dummy addresses); returns cuobjdump's ``{"reg", "stack",
    "local"}`` (spills show as stack) like ``compile_check``'s other kernels, with
    ``wgmma``/``tma`` False. ``dump``: a folder for ``<name>.ptx`` / ``.cubin``
    (``compile_check.compile_kernel``)."""
    from cutlass import BFloat16, Float16
    from cutlass.cute.runtime import make_fake_stream

    from .compile_check import compile_kernel

    dt = {"bf16": BFloat16, "fp16": Float16, None: None}[dtype]
    kernel = CombineSm90(dt, H, Hs, K, D, has_o, **(tuning or {}))
    a = 1 << 20  # a dummy address, 16-byte aligned
    args = launch_arguments(kernel, a, a, a, a, a, a, a, 1, make_fake_stream())
    res = compile_kernel(kernel, *args, dump=dump, name=name)
    return dict(res, wgmma=False, tma=False)


def _main(argv: list[str]) -> int:
    """``python -m flash_msa.cute.combine_sm90 [--variants]``: compile the shipped variant's
    configurations (``--variants``: every variant's), one JSON line each; exit 1 on a spill."""
    import json

    bad = 0
    every = variant_configurations if "--variants" in argv else combine_configurations
    for name, *cfg in every():
        res = compile_combine(*cfg, name=name)
        bad += res["stack"] > 0 or res["local"] > 0
        print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
