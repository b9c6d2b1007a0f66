"""The backward's ``delta = rowsum(dO * O)`` on Hopper (sm_90a) in CuTe DSL: one memory-bound
kernel in place of :func:`flash_msa.problem.row_delta`'s two torch launches.

The CuTe backward (``cute.backward.bwd``) calls ``backward.bwd_delta``: this kernel where
``backward.row_delta_reason`` allows the call, else ``problem.row_delta``.

Measured (H200, bf16, random inputs; device ms, the kernel alone): paper 128K (T 131072, H 64, D
128) 0.965 ms (4.49 TB/s) against 7.94 ms for ``problem.row_delta`` on the same inputs; anchor
16K (H 16) 0.034 ms (3.92 TB/s) against 0.257; long 1M (H 16, 2^31 elements) 1.92 ms (4.50
TB/s) against 15.9. The tunings 8 warps x 4 passes (shipped), 8 x 2 and 4 x 8 are within 1%
of each other at 128K and 1M. With the host work (events around the Python call on an idle
GPU): 1.01 / 0.079 / 1.98 ms, ~45 us of it the host path at 16K (validation, three
``make_ptr``, the launch).
tests/ops/test_row_delta.py: 19 passed there (the 2.2e9-element case included).

What it computes: for contiguous ``dout`` and ``out`` ``(T, H, D)`` of one dtype (bf16 or
fp16), ``delta[t, h] = sum_d fp32(dout[t, h, d]) * fp32(out[t, h, d])``, ``(T, H)`` fp32. Each
product of two 16-bit values is exact in fp32 (11 x 11 significand bits at most) unless it
leaves fp32's normal range (bf16 only), where it rounds as torch's fp32 product does; the D
products are summed in fp32 in a fixed order (below), so the result is deterministic, but not
bitwise ``problem.row_delta``'s (torch's reduction has its own order): the two differ by a few
fp32 roundings of the row's terms.

Why (the profile of the paper-shape training step on the H200, T 131072, H 64, D
128): ``problem.row_delta`` is an ``addcmul`` onto an fp32 ``-0.0`` that writes the (T, H, D)
fp32 products (4.3 GB, ~3.05 ms) and a ``.sum(-1)`` that reads them back (~1.0 ms): ~4 ms of a
~150 ms step, for 4.3 GB of input. This kernel reads the input once and writes 4 bytes per row.

Bytes: per row ``2 * D * 2`` read + 4 written: paper 128K (8.4M rows, D 128) 4.33 GB,
~0.90 ms at the H200's ~4.8 TB/s HBM bound, ~1.0 ms at the ~4.3 TB/s its device copy reaches
(toolchain notes); anchor 16K (H 16) 0.135 GB, ~0.028 ms; long 1M (H 16) 8.66 GB, ~1.8 ms.

Mapping (:class:`RowDeltaSm90`): a row of D elements is ``L = D / 8`` lanes, each loading one
16-byte piece (8 elements) of ``dout`` and of ``out`` (``ld.global.v4``: a warp's load
instruction reads ``32 / L`` whole rows, 512 contiguous bytes); a CTA of :attr:`warps` warps
takes ``warps * (32 / L) * unroll`` consecutive rows, pass ``u`` of warp ``w`` the rows ``base
+ (u * warps + w) * (32 / L) + lane / L``. The passes' loads are written before the first
product; ptxas issues passes 0 and 1 first and the later ones between pass 0's arithmetic (SASS
of the compiled kernel), so 2-3 passes' 16-byte pairs are in flight per lane: at 8 warps, 4
passes and the 32 registers of the compiled kernel, 8 CTAs (2048 threads) per SM keep ~130-200
KB in flight per SM, where ~4.8 TB/s x ~1.5 us of loaded latency / 132 SMs = ~55 KB is
needed. The lane's 8 products are summed in element order (``fma`` after the first product),
then the row's ``L`` lanes by butterfly shuffles (offsets ``L/2 .. 1``: the same sum, bitwise,
on every lane of the row); the row's first lane stores it. Rows past the end reload the last
row (every lane takes part in the shuffles) and store nothing.

Large inputs: element offsets are 64-bit (``Int64(row) * D``), so ``T * H * D`` may pass 2^31
(T 1M, H 64, D 128: 8.6e9 elements); the row index and count are 32-bit, limited to
:data:`MAX_ROWS` (2^30 rows = 275 GB of bf16 input at D 64, more than one GPU holds).

Host (``backward.row_delta``): raw device addresses (``cute.runtime.make_ptr``) and the row
count as an ``Int32``; the compile cache is keyed by the kernel object alone (``launch.run_typed``:
once per (dtype, D, tuning) per process, through the disk cache across processes). The output
is ``torch.empty``, written on every row; no host synchronization, the current stream (CUDA
graph capture works: the launch's arguments are the addresses and the row count).
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

HEAD_DIMS = (64, 128)  # D / 8 lanes per row must divide a warp: 8 or 16 lanes
PIECE = 8  # elements of a 16-byte piece of a 2-byte dtype
IN_ALIGN = 16  # bytes: base alignment of dout and out (16-byte loads)
OUT_ALIGN = 4  # bytes: delta, one fp32 per row
MAX_ROWS = 2**30  # T * H: the row index (and the last CTA's rows past the end) stay in an Int32


@dataclass(frozen=True)
class RowDeltaSm90:
    """``delta = rowsum(dO * O)`` of one static configuration (module docstring); the fields
    are all of it (the compile cache keys on the object, and it fixes every launch argument's
    type).

    Run-time values: the row count ``T * H``."""

    dtype: type[cutlass.Numeric]  # BFloat16 or Float16: dout and out
    head_dim: int  # D
    # tuning: warps per CTA, passes of rows per warp with their loads in flight together
    warps: int = 8
    unroll: int = 4

    @classmethod
    def can_implement(cls, dtype, head_dim, warps=8, unroll=4) -> str | None:
        """Why this configuration cannot be compiled or run (``None``: it can)."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"the CuTe row delta needs bf16 or fp16 inputs, not {dtype}"
        if head_dim not in HEAD_DIMS:
            return f"the CuTe row delta needs a head dim in {HEAD_DIMS}, not {head_dim}"
        if warps not in (1, 2, 4, 8, 16, 32) or unroll not in (1, 2, 4, 8):
            return (
                f"warps must be a power of two <= 32 and unroll 1, 2, 4 or 8, got {warps}, "
                f"{unroll}"
            )
        return None

    def __post_init__(self):
        why = self.can_implement(self.dtype, self.head_dim, self.warps, self.unroll)
        if why is not None:
            raise ValueError(f"CuTe row delta: {why}")

    @property
    def row_lanes(self) -> int:
        """Lanes per row: one 16-byte piece each."""
        return self.head_dim // PIECE

    @property
    def rows_per_cta(self) -> int:
        return self.warps * (32 // self.row_lanes) * self.unroll

    # -----------------------------------------------------------------------------------------
    # host: launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        pDO: cute.Pointer,
        pO: cute.Pointer,
        pDelta: cute.Pointer,
        n_rows: Int32,
        stream: cuda.CUstream,
    ):
        """Launch over ``n_rows = T * H`` rows: device addresses of ``dout`` and ``out`` ``(T, H,
        D)`` (contiguous) and ``delta (T, H)`` fp32. The pointers' types are
        ``backward.row_delta_arguments``' (the compile cache relies on it)."""
        # the flat sizes of the inputs are not read: offsets into them are 64-bit (kernel)
        big = cute.make_layout(1 << 30)
        mDO = cute.make_tensor(pDO, big)
        mO = cute.make_tensor(pO, big)
        mDelta = cute.make_tensor(pDelta, cute.make_layout(n_rows))
        per_cta = self.rows_per_cta
        self.kernel(mDO, mO, mDelta, n_rows).launch(
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
        mDO: cute.Tensor,  # flat dout (T * H * D,), input dtype
        mO: cute.Tensor,  # flat out (T * H * D,), input dtype
        mDelta: cute.Tensor,  # (T * H,) fp32
        n_rows: Int32,  # T * H
    ):
        D, W, U, L = self.head_dim, self.warps, self.unroll, self.row_lanes
        RPW = 32 // L  # rows per warp pass
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        col = (lane % L) * PIECE  # the lane's piece of its row
        first = bid * self.rows_per_cta + warp * RPW + lane // L  # pass 0's row

        # 1. every pass's two 16-byte loads (a row past the end reloads the last row)
        pieces = []
        for u in cutlass.range_constexpr(U):
            r = cutlass.min(first + u * (W * RPW), n_rows - 1)
            off = cute.assume(Int64(r) * D + col, divby=PIECE)
            pair = []
            for m in (mDO, mO):
                vals = cute.make_rmem_tensor(PIECE, self.dtype)
                cute.autovec_copy(cute.make_tensor(m.iterator + off, cute.make_layout(PIECE)), vals)
                pair.append(vals)
            pieces.append(pair)

        # 2. per pass: the lane's 8 products in element order, the row's L lanes by butterfly
        #    shuffles, the row's first lane stores
        for u in cutlass.range_constexpr(U):
            a = cute.make_rmem_tensor(PIECE, Float32)
            b = cute.make_rmem_tensor(PIECE, Float32)
            a.store(pieces[u][0].load().to(Float32))
            b.store(pieces[u][1].load().to(Float32))
            s = a[0] * b[0]
            for e in cutlass.range_constexpr(1, PIECE):
                s = cute.math.fma(a[e], b[e], s)
            off = L // 2
            while off >= 1:  # trace-time loop
                s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
                off //= 2
            row = first + u * (W * RPW)
            if lane % L == 0 and row < n_rows:
                mDelta[row] = s
