"""The sparse forward's combine on Hopper (sm_90a) in CuTe DSL: merge per-block partials by LSE.

The CuTe forward's ``combine`` stage (``forward.combine``, in ``cute.forward.forward_stages``)
where ``forward.combine_fits`` holds for the call (tests/ops/test_combine.py on the H200);
elsewhere the driver borrows Triton's combine.

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

Measured (H200, device ms at anchor 16K / 32K, paper 128K): the first version (one warp per row, three dependent round trips: index, used LSEs,
partial rows) merged the main rows in 0.279 / 0.562 / 0.570 against Triton's 0.256 / 0.518 /
0.526; this kernel merges main and proxy rows in 0.257 / 0.518 / 0.523 against Triton's two
launches' 0.270 / 0.542 / 0.535. Every slot's rows loaded with the index, 8 warps per CTA, two
rows per warp, the loads in registers: within 1% of it, or slower.

Design (the main merge: one row per warp, :data:`WARPS` warps per CTA):

- Two round trips per row, not three. The index row and every slot's LSE are loaded at once
  (the buffer holds an unused slot's LSE too; it is replaced by -inf), then the partial rows as
  soon as the index row is in, before any weight is known: an unused slot loads the row of the
  lowest used slot in its place (an L2 hit: the copies are ``cp.async.cg``, which bypass L1)
  and a slot of weight 0 adds 0 by a select (its row may be NaN). The weights' shuffles run
  while the rows are in flight. (In the first version only the last third of a row's time had
  bytes in flight: ~45 KB per SM where ~4.8 TB/s x ~1.5 us loaded latency / 132 SMs = ~55 KB
  is needed.)
- Every global load is a ``cp.async`` into shared memory (one commit group for the index and
  LSE rows, one per :data:`BATCH` partial-row loads per lane), read back by the lane that
  copied it. Loads into registers were sunk by ptxas below the weights' shuffle chain and
  interleaved with the sums (SASS of the compiled kernel: 2-3 of 8 loads in flight); a commit
  group's copies stay ahead of its wait. 32 registers at K 16; shared memory
  :meth:`CombineSm90.shared_bytes` (17-18 KiB per CTA at the anchor layout): ~13 CTAs, 52 warps,
  ~200 KB in flight per SM.
- A slot of weight 0 is zeroed as four 32-bit words before the bf16 conversion (4 SEL + 8 FFMA
  per 16 bytes instead of 8 FMUL + 8 FSEL + 8 FADD: ~32 instructions per piece, SASS).
- The launch takes raw device addresses (``cute.runtime.make_ptr``, 1 us each on the CPU here;
  the first version's DLPack views took 10 us each) and the token count as an ``Int32``; the
  compile cache is keyed by the kernel object alone (it fixes every argument's type).

Mapping: warp ``w`` of the grid merges row ``w``; lane ``s`` holds slot ``s`` (and ``s + 32``)
of the index row, the LSE row and the weights, reduced by butterfly shuffles over the warp. A
partial row of D elements is D/8 pieces of 16 bytes: lane ``i`` loads piece ``i % (D/8)`` of
slots ``i // (D/8) + (32 / (D/8)) * j`` (a warp load instruction reads 512 contiguous bytes:
two slots at D 128, four at D 64), takes its slot's weight from the owning lane by shuffle and
accumulates in fp32; the slot groups add up by butterfly shuffles and the first D/8 lanes store
the row, one 16-byte store each. The LSE-only mode packs 32 / K' rows into a warp (K' = K
rounded up to a power of two, <= 32); its LSE loads do not wait for the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_TOPK = 64  # slots per row: lane s and s + 32 own a slot's weight (the selection's limit)
# warps per CTA (8: the same device time, within 1%, H200)
WARPS = 4
# 16-byte partial-row loads per lane in one cp.async commit group: K 64 at D 128 (32 loads per
# lane) takes two groups, and the sums of the first start while the second is in flight
BATCH = 16


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
    proxy: bool = False  # also the proxy LSE rows (pl_part, proxy_lse) in the same launch

    PIECE: ClassVar[int] = 8  # elements per 16-byte piece of a 2-byte dtype

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @classmethod
    def can_implement(
        cls, dtype, heads, sel_heads, top_k, head_dim, has_o, proxy=False
    ) -> str | None:
        """Why this configuration cannot be compiled or run (``None``: it can). Shared memory
        needs no check: :meth:`shared_bytes` is at most 68,608 bytes (K 64, D 128, the fused
        proxy), under the sm_90 capacity."""
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
        if proxy and not has_o:
            return "the fused proxy LSE needs the main merge (has_o)"
        return None

    @staticmethod
    def shared_bytes(head_dim: int, top_k: int, proxy: bool = False) -> int:
        """Shared memory of the main merge's CTA: each warp's 16-byte loads (``top_k / (32 /
        (head_dim / 8))`` per lane, 512 bytes a warp), all in flight at once, and its staged
        4-byte rows (:meth:`warp_rows`): the index row, the LSE row and, with the fused
        ``proxy``, the proxy-LSE row, ``32 J`` entries each (``J = ceil(top_k / 32)``). Each
        buffer is a multiple of 128 bytes, so the 16-byte alignment adds nothing (the compiled
        kernels' allocations match)."""
        sg = 32 // (head_dim // 8)
        J = (top_k + 31) // 32
        staged = WARPS * 32 * J * (2 + (1 if proxy else 0)) * 4
        return WARPS * ((top_k + sg - 1) // sg) * 512 + staged

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.sel_heads, self.top_k, self.head_dim, self.has_o,
            self.proxy,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe combine: {why}")

    @property
    def row_lanes(self) -> int:
        """Lanes per row: the whole warp with O; the LSE only (:meth:`lse_rows`): K rounded up
        to a power of two (<= 32)."""
        return 32 if self.has_o else min(32, _pow2_at_least(self.top_k))

    @property
    def rows_per_cta(self) -> int:
        return WARPS * (32 // self.row_lanes)

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
        pointer of the type ``forward.combine_arguments`` gives, never read). The pointers'
        types are ``forward.combine_arguments``' (the compile cache relies on it)."""
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
            block=(32 * WARPS, 1, 1),
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
        if cutlass.const_expr(self.has_o):
            self.warp_rows(mO, mL, mIdx, mOut, mLse, mPL, mPLse, n_rows)
        else:
            self.lse_rows(mL, mIdx, mLse, n_rows)

    @cute.jit
    def warp_rows(self, mO, mL, mIdx, mOut, mLse, mPL, mPLse, n_rows: Int32):
        """The main merge, one row per warp (module docstring, "Design" and "Mapping")."""
        H, Hs, K, D, P = self.heads, self.sel_heads, self.top_k, self.head_dim, self.PIECE
        G = H // Hs
        J = (K + 31) // 32  # slots per lane in the weights
        TPR = D // P  # lanes per partial row
        SG = 32 // TPR  # slot groups: slots one warp load instruction covers
        NS = (K + SG - 1) // SG  # 16-byte loads per lane
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        row = bid * WARPS + warp
        in_range = row < n_rows
        # a warp past the end recomputes the last row (no stores): every lane of a warp takes
        # part in the shuffles
        row = cutlass.min(row, n_rows - 1)
        t = row // H
        h = row - t * H
        sg = lane // TPR
        col = (lane % TPR) * P
        irow = t * Hs + h // G  # the row's index row (and proxy row)
        batches = [list(range(b, min(NS, b + BATCH))) for b in range(0, NS, BATCH)]
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

        # every global load is a cp.async into shared memory: in flight without a register, and
        # ptxas keeps a commit group's copies ahead of its wait (it sank plain loads and copies
        # whose results were used later below the weights' shuffle chain, SASS of the compiled
        # kernels: 2-3 of 8 rows in flight). Lane l's 16-byte load n lands at unit (l, n, warp):
        # a warp's 32 fill 512 contiguous bytes (no bank conflict, nor for its own reads back).
        # A lane reads back only what it copied: no barrier.
        alloc = SmemAllocator()
        sO = alloc.allocate_tensor(
            self.dtype,
            cute.make_layout((P, 32, NS, WARPS), stride=(1, P, 32 * P, NS * 32 * P)),
            byte_alignment=16,
        )
        sI = alloc.allocate_tensor(Int32, cute.make_layout((1, 32, J, WARPS)), 16)
        sL = alloc.allocate_tensor(Float32, cute.make_layout((1, 32, J, WARPS)), 16)
        sP = sL
        if cutlass.const_expr(self.proxy):
            sP = alloc.allocate_tensor(Float32, cute.make_layout((1, 32, J, WARPS)), 16)
        c16 = cute.make_copy_atom(  # L2 only (.cg): each partial row is read once
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
            num_bits_per_copy=128,
        )  # fmt: skip
        ci = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
        cf = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

        # 1. every load that needs nothing but the row number, at once: the index row, every
        #    slot's LSE (a clamped address for lanes past K: the value is dropped), the proxy
        #    LSEs of the proxy row when this warp owns it
        for j in cutlass.range_constexpr(J):
            cute.copy(ci, at(mIdx, irow * K + slots[j]), sI[None, lane, j, warp])
        for j in cutlass.range_constexpr(J):
            cute.copy(cf, at(mL, row * K + slots[j]), sL[None, lane, j, warp])
        if cutlass.const_expr(self.proxy):  # noqa: SIM102 (a static test, then a traced one)
            if h % G == 0:  # warp-uniform: the warp owns the proxy row (its head is the first)
                for j in cutlass.range_constexpr(J):
                    cute.copy(cf, at(mPL, irow * K + slots[j]), sP[None, lane, j, warp])
        cute.arch.cp_async_commit_group()

        # 2. the partial rows' loads once the index row is in, before any weight: an unused
        #    slot loads the lowest used slot's row in its place
        cute.arch.cp_async_wait_group(0)
        iv = [past_k(sI[0, lane, j, warp], j) for j in range(J)]  # slot lane + 32 j's index
        masks = [cute.arch.vote_ballot_sync(iv[j] >= 0) for j in range(J)]  # bit s: slot 32 j + s
        first = Int32(0)  # the lowest used slot (0 if none)
        for j in cutlass.range_constexpr(J - 1, -1, -1):
            low = Int32(cute.arch.clz(cute.arch.brev(masks[j]))) + 32 * j
            first = low if masks[j] != 0 else first
        for b in cutlass.range_constexpr(NB):
            for n in batches[b]:  # 16-byte load n of the lane: ternaries only, no control flow
                s0 = SG * n  # the slot group's first slot (static): slot s0 + sg
                slot = s0 + sg
                if cutlass.const_expr(s0 + SG > K):  # the last group passes K: stay in the row
                    slot = cutlass.min(slot, K - 1)
                used = ((masks[s0 // 32] >> (s0 % 32 + sg)) & 1) != 0
                slot = slot if used else first
                src = cute.make_tensor(
                    mO.iterator + cute.assume((Int64(row) * K + slot) * D + col, divby=P),
                    cute.make_layout(P),
                )
                cute.copy(c16, src, sO[None, lane, n, warp])
            cute.arch.cp_async_commit_group()  # one group per batch
        lraw = [sL[0, lane, j, warp] for j in range(J)]  # whatever an unused slot holds
        pv = []
        if cutlass.const_expr(self.proxy):
            pv = [sP[0, lane, j, warp] for j in range(J)]

        # 3. the weights (while the partial rows are in flight) and the LSE stores
        w, lsum, lse = self.weights(lraw, iv, J)
        if lane == 0 and in_range:
            mLse[row] = lse
        if cutlass.const_expr(self.proxy):
            _, _, plse = self.weights(pv, iv, J)
            if lane == 0 and in_range and h % G == 0:
                mPLse[irow] = plse

        # 4. the weighted sums, batch after batch: a slot of weight 0 adds 0 by a select (its
        #    row may hold anything, NaN included)
        acc = cute.make_rmem_tensor(P, Float32)
        acc.fill(0.0)
        for b in cutlass.range_constexpr(NB):
            cute.arch.cp_async_wait_group(NB - 1 - b)
            for n in batches[b]:
                s0 = SG * n
                wgt = cute.arch.shuffle_sync(w[s0 // 32], offset=s0 % 32 + sg)
                ok = wgt > 0.0
                # the select on the 16 bytes as 4 words, before the conversion: 4 SEL and 8
                # FFMA per piece instead of 8 FMUL, 8 FSEL, 8 FADD (SASS of the compiled kernel)
                raw = cute.make_rmem_tensor(P // 2, Int32)
                raw.store(cute.recast_tensor(sO[None, lane, n, warp], Int32).load())
                for e in cutlass.range_constexpr(P // 2):
                    word = raw[e]
                    raw[e] = word if ok else Int32(0)
                v = cute.recast_tensor(raw, self.dtype).load().to(Float32)
                acc.store(acc.load() + v * wgt)

        # 5. the slot groups add up, 1 / l, the first D/8 lanes store
        off = TPR
        while off < 32:  # trace-time loop
            for e in cutlass.range_constexpr(P):
                acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], offset=off)
            off *= 2
        inv = cute.arch.rcp_approx(lsum) if lsum > 0.0 else Float32(0.0)
        res = cute.make_rmem_tensor(P, self.dtype)
        res.store((acc.load() * inv).to(self.dtype))
        if sg == 0 and in_range:
            dst = cute.make_tensor(
                mOut.iterator + cute.assume(Int64(row) * D + col, divby=P), cute.make_layout(P)
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
        # -inf when l = 0 (lg2.approx(0) = -inf), NaN when a partial's LSE is NaN (a NaN
        # query, key or score: the NaN rule propagates it; an `l > 0` test would not)
        lse = mx + cute.math.log2(lsum, fastmath=True) * LN2
        return w, lsum, lse

    @cute.jit
    def lse_rows(self, mL, mIdx, mLse, n_rows: Int32):
        """The LSE-only mode: 32 / K' rows per warp (K' = :attr:`row_lanes`), lane ``rl`` of a
        row's group owns its slots ``rl, rl + K', ...``; the LSE loads do not wait for the
        index (clamped addresses past K)."""
        H, K = self.heads, self.top_k
        G = self.heads // self.sel_heads
        RL = self.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        row = (bid * WARPS + warp) * (32 // RL) + lane // RL
        in_range = row < n_rows
        # rows past the end recompute the last row (no stores): every lane of a warp takes
        # part in the shuffles
        row = cutlass.min(row, n_rows - 1)
        rl = lane % RL  # lane within the row's group
        irow = (row // H) * self.sel_heads + (row % H) // G  # the row's index row

        # the slots' LSEs (-inf for unused slots and lanes past K), their max, the weights
        # w_s = exp(l_s - m) and their sum
        lv = []
        for j in cutlass.range_constexpr((K + RL - 1) // RL):
            s = rl + RL * j
            sc = s
            if cutlass.const_expr(RL * (j + 1) > K):
                sc = cutlass.min(s, K - 1)
            raw = mL[row * K + sc]
            ix = mIdx[irow * K + sc]
            lv.append(raw if (ix >= 0 and s < K) else -Float32.inf)
        mx = lv[0]
        for j in cutlass.range_constexpr(1, len(lv)):
            mx = cute.arch.fmax(mx, lv[j])
        mx = _warp_max(mx, RL)  # within the row's lane group
        mx = Float32(0.0) if mx == -Float32.inf else mx  # a row with no visible key
        lsum = Float32(0.0)
        for j in cutlass.range_constexpr(len(lv)):
            lsum += cute.math.exp2((lv[j] - mx) * LOG2E, fastmath=True)  # exp(-inf) = 0
        lsum = _warp_sum(lsum, RL)
        lse = -Float32.inf
        if lsum > 0.0:
            lse = mx + cute.math.log2(lsum, fastmath=True) * LN2
        if rl == 0 and in_range:
            mLse[row] = lse
