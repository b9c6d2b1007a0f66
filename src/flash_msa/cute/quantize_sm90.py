"""The FP8 selection's quantize pass on Hopper (sm_90a) in CuTe DSL: one kernel, bitwise equal
to :func:`flash_msa.quant.quantize`.

The CuTe selection's fp8 branch (``cute.selection.select``) launches it by
``cute.selection.quantize`` where ``cute.selection.quantize_reason`` takes the call, and falls
back to the torch pass ``quant.quantize`` where it does not.

What it computes (``quant.quantize``, term for term): per row of ``Dp`` elements (a ``(token,
head)`` of ``q_proxy (T, Hp, Dp)`` or ``k_proxy (T, Hpk, Dp)``, bf16 or fp16), the rotation
``quant.hadamard_transform`` (the radix-2 Walsh-Hadamard butterflies at strides 1, 2, ..., Dp/2,
each pair ``(a, b) -> (a + b, a - b)`` rounded once, then one multiply by the fp32 ``Dp **
-0.5``), the row's ``amax = max |y|`` (NaN-propagating, as ``torch.amax``), the fp32 scale
``amax / 448`` (1 below ``quant``'s smallest amax, and for a NaN amax), and the e4m3 values
``e4m3(clamp(y / scale, -448, 448))``: an IEEE division (``div.rn.f32``) and one
``cvt.rn.satfinite.e4m3x2.f32`` per pair (round to nearest even; ``satfinite`` maps a finite
value beyond 448 to 448, exactly what the clamp then the cast do, and keeps NaN, as 0x7F:
the torch pass's NaN bytes may carry the other sign). Key scales
per block (``key_scale="block"``): the max of the rows' amax over the block's tokens, per key
head (an integer ``atom.max`` on the bits of the non-negative amax in shared memory: exact and
order-free, NaN's bits above +inf's as in ``torch.amax``), written on every token of the block.

Exactness. Every arithmetic step is one correctly rounded IEEE fp32 operation, with the
rounding mode explicit in the PTX (``add.rn``, ``sub.rn``, ``fma.rn``, ``mul.rn``, ``div.rn``:
ptxas may not contract them with a neighbour), no flush of subnormals, in the reference's order;
max, abs and the bf16/fp16 -> fp32 conversion are exact. So the e4m3 bytes and the scales equal
the torch pass's on any device, given a reference with that property. ``quant.quantize`` had
two steps without it, both changed with this kernel (minimal changes in quant.py):

- the rotation was ``x @ hadamard(Dp)``: a matmul sums in an order its library picks (MKL,
  cuBLAS; TF32 under ``torch.set_float32_matmul_precision("high")``), and each product ``x *
  fp32(Dp ** -0.5)`` rounds. Measured on CPU (200000 random bf16 rows, ``x @ hadamard(Dp)``
  against ``quant.hadamard_transform``): at Dp 128, 85% of the rotated values and 79% of the
  row scales differ in the last bits, and 1.0e-5 of the e4m3 bytes (0.13% of the rows hold
  one); at Dp 64 (normalization 1/8, exact) 0.08% of the values and no byte. The butterflies
  compute the same orthonormal rotation; tests/cute_host/test_quantize.py checks, bit for bit,
  that a torch emulation of this kernel's lanes and shuffles computes the reference's.
- the scale was ``amax / 448.0``: torch on CUDA divides by a Python number as a multiply by its
  reciprocal (its ``div_true`` kernel: "may lose one bit"), on CPU it divides; on 100000 random
  fp32 values the two differed in 53%. ``quant._scale`` now divides by a tensor (an IEEE
  division on every device), as this kernel does (``div.rn``).

Mapping. One CTA per (sequence, key block): grid ``N * ceil(max_seqlen / block)`` (a CTA past
its sequence's end does nothing). It quantizes the block's tokens' query rows (``nb * Hp`` rows,
contiguous in memory) and key rows (``nb * Hpk``), ``nb = min(block, tokens left)``; ``Tq == T``
(the fp8 selection has no query map). A row is ``L = Dp / 16`` lanes: lane ``l`` of the row
loads the 16-byte pieces ``l`` and ``l + L`` (elements ``8 l .. 8 l + 7`` and ``Dp/2 + 8 l ..``:
one warp load instruction covers the first halves of ``32 / L`` rows, 128 contiguous bytes each
at Dp 128), so the butterflies at strides 1, 2, 4 and Dp/2 are within a lane's registers and
those at 8 .. Dp/4 (3 at Dp 128, 2 at Dp 64) pair lane ``l`` with ``l ^ (stride / 8)`` by a
butterfly shuffle: every lane computes ``fma(sign, own, partner)`` (the product is exact, so one
rounding), sign 1 on the lane with the stride bit clear (``a + b``), -1 on the other (``a - b``:
its own element is the upper one, ``b``). The row's amax: the lane's 16, then shuffles over its
``L`` lanes. The e4m3 row is stored as two 8-byte pieces per lane, the scale by the row's first
lane. Each warp keeps ``unroll`` passes of rows in flight (their loads issued before the first
pass's arithmetic). Block key scales: two passes over the block's key rows, the first for the
amax only (rows discarded), a barrier, the second recomputes the rows (their loads hit L1/L2)
and quantizes with the block's scale; the key rows are a fifth of the bytes at the paper layout
(Hp 4, Hpk 1).

Bytes: per token ``(Hp + Hpk) * Dp * (2 + 1) + (Hp + Hpk) * 4``: at paper 128K (Hp 4, Hpk 1,
Dp 128) 254 MB, ~53 us at the H200's ~4.8 TB/s. Instructions per element (SASS of the compiled
kernels, ``python -m flash_msa.cute.compile_check quantize --dump DIR``): 7 FADD/FFMA and 3
SHFL for the rotation, 1 FMUL, 1 FMNMX, and the IEEE division, ~6 of them in its fast path
(MUFU.RCP, 4 FFMA, FCHK) plus a branch around a slow-path call, ~20 in all: near the SM's issue
rate at the HBM rate (~6 elements per clock per SM), so the division may bound it: measured
0.199 ms at paper 128K (:class:`QuantizeSm90`'s tuning comment), ~4x the bytes' time. The
division's reciprocal (a function of the row's scale only) could be hoisted out of the row's 16
divisions per lane; that needs an argument that the fast path's
remaining 3 FFMA round correctly for these operands, so it is not done.

Limits (:meth:`QuantizeSm90.can_implement`): bf16 or fp16 proxies, Dp 64 or 128, block 64 or
128, ``q_proxy`` and ``k_proxy`` with the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from .. import quant

# Measured on the H200 at paper 128K (tests/ops/test_select_fp8.py: bytes and scales bitwise
# equal to quant.quantize): 0.199 ms (8 warps x 1 pass, shipped) / 0.228 (4 x 2) / 0.217 (8 x 4)
# / 0.237 (4 x 4) against 4.00 ms for the torch pass; the fp8 selection with it 12.45 ms (706
# TFLOP/s) against 15.72 (560).

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
PIECE = 8  # elements of a 16-byte piece of a 2-byte dtype
ROW_ALIGN = 16  # bytes: base alignment of q_proxy / k_proxy (16-byte loads)
OUT_ALIGN = 8  # bytes: base alignment of the e4m3 outputs (8-byte stores)
SCALAR_ALIGN = 4  # bytes: scales, cu_seqlens (one element at a time)
MIN_AMAX = quant.E4M3_MAX * torch.finfo(torch.float32).tiny  # quant's threshold (exact in fp32)


@dataclass(frozen=True)
class QuantizeSm90:
    """The quantize pass of one static configuration (module docstring); the fields are all of
    it (the compile cache keys on the object, and it fixes every launch argument's type).

    Run-time values: the sequence count N and the key blocks per sequence (grid bound)."""

    dtype: type[cutlass.Numeric]  # BFloat16 or Float16: q_proxy and k_proxy
    head_dim: int  # Dp
    q_heads: int  # Hp
    k_heads: int  # Hpk
    block_size: int  # the selection's key block (the block scale's tokens; the CTA's tokens)
    key_scale: str  # "block" or "token" (quant.KEY_SCALES)
    # tuning: warps per CTA, passes of rows per warp in flight (timings: above). At 8 warps x 2 passes ptxas settled at 64 registers and spilled
    # 8-16 bytes in 3 of the 12 checked configurations (around the IEEE division's slow-path
    # calls); 4 x 2 (62-72 registers), 8 x 1 (40-63) and 8 x 4 (78-102) spill in none.
    warps: int = 8
    unroll: int = 1

    @classmethod
    def can_implement(
        cls, dtype, head_dim, q_heads, k_heads, block_size, key_scale, warps=8, unroll=1
    ) -> str | None:
        """Why this configuration cannot be compiled or run (``None``: it can)."""
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"the CuTe quantize pass needs bf16 or fp16 proxies, not {dtype}"
        if head_dim not in HEAD_DIMS:
            return f"the CuTe quantize pass needs a proxy head dim in {HEAD_DIMS}, not {head_dim}"
        if block_size not in BLOCK_SIZES:
            return f"the CuTe quantize pass needs a block size in {BLOCK_SIZES}, not {block_size}"
        if key_scale not in quant.KEY_SCALES:
            return f"key_scale must be one of {quant.KEY_SCALES}, not {key_scale!r}"
        if q_heads < 1 or not 1 <= k_heads <= 32:  # (a block's key heads: one smem word each)
            return f"the head counts must be Hp >= 1, 1 <= Hpk <= 32, got {q_heads}, {k_heads}"
        if warps not in (1, 2, 4, 8, 16, 32) or unroll not in (1, 2, 4):
            return f"warps must be a power of two <= 32 and unroll 1, 2 or 4, got {warps}, {unroll}"
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.head_dim, self.q_heads, self.k_heads, self.block_size,
            self.key_scale, self.warps, self.unroll,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe quantize: {why}")

    # -----------------------------------------------------------------------------------------
    # host: launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        pQ: cute.Pointer,
        pK: cute.Pointer,
        pCu: cute.Pointer,
        pQ8: cute.Pointer,
        pQs: cute.Pointer,
        pK8: cute.Pointer,
        pKs: cute.Pointer,
        n_seq: Int32,
        blocks: Int32,
        stream: cuda.CUstream,
    ):
        """Launch over ``n_seq * blocks`` CTAs: device addresses of ``q_proxy (T, Hp, Dp)``,
        ``k_proxy (T, Hpk, Dp)``, ``cu_seqlens (N+1,)`` int32, ``q8 (T, Hp, Dp)`` e4m3,
        ``q_scale (T, Hp)`` fp32, ``k8 (T, Hpk, Dp)`` e4m3, ``k_scale (T, Hpk)`` fp32 (all
        contiguous); ``blocks``: key blocks per sequence, at least the longest's."""
        big = 1 << 30  # the flat sizes are not read: offsets are 64-bit (rows * Dp)
        lay = cute.make_layout(big)
        mQ, mK, mQ8, mQs, mK8, mKs = (
            cute.make_tensor(p, lay) for p in (pQ, pK, pQ8, pQs, pK8, pKs)
        )
        mCu = cute.make_tensor(pCu, cute.make_layout(n_seq + 1))
        self.kernel(mQ, mK, mCu, mQ8, mQs, mK8, mKs, blocks).launch(
            grid=(n_seq * blocks, 1, 1), block=(32 * self.warps, 1, 1), stream=stream
        )

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # flat q_proxy (T * Hp * Dp,)
        mK: cute.Tensor,  # flat k_proxy (T * Hpk * Dp,)
        mCu: cute.Tensor,  # (N+1,) int32
        mQ8: cute.Tensor,  # flat e4m3 q8 (T * Hp * Dp,)
        mQs: cute.Tensor,  # (T * Hp,) fp32 q_scale
        mK8: cute.Tensor,  # flat e4m3 k8 (T * Hpk * Dp,)
        mKs: cute.Tensor,  # (T * Hpk,) fp32 k_scale
        blocks: Int32,  # key blocks per sequence (the grid's bound)
    ):
        b, Hp, Hpk = self.block_size, self.q_heads, self.k_heads
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        seq = bid // blocks
        t0 = mCu[seq] + (bid - seq * blocks) * b
        end = mCu[seq + 1]
        amax_bits = None
        if cutlass.const_expr(self.key_scale == "block"):
            # the block's amax per key head, as the bits of a non-negative fp32 (their integer
            # order is the float order, NaN above +inf); zeroed before the CTA-uniform test below
            amax_bits = SmemAllocator().allocate_tensor(Int32, cute.make_layout(Hpk), 16)
            if tidx < Hpk:
                amax_bits[tidx] = Int32(0)
            cute.arch.sync_threads()
        if t0 < end:  # CTA-uniform: a block past its sequence's end does nothing
            nb = cutlass.min(end - t0, b)
            self.rows(mQ, mQ8, mQs, Int64(t0) * Hp, nb * Hp, tidx, amax_bits, 0)
            if cutlass.const_expr(self.key_scale == "block"):
                self.rows(mK, mK8, mKs, Int64(t0) * Hpk, nb * Hpk, tidx, amax_bits, 1)
                cute.arch.sync_threads()
                self.rows(mK, mK8, mKs, Int64(t0) * Hpk, nb * Hpk, tidx, amax_bits, 2)
            else:
                self.rows(mK, mK8, mKs, Int64(t0) * Hpk, nb * Hpk, tidx, amax_bits, 0)

    @cute.jit
    def rows(
        self, mX, mX8, mXs, row0: Int64, n_rows: Int32, tidx: Int32, amax_bits,
        phase: cutlass.Constexpr,
    ):  # fmt: skip
        """Rows ``row0 .. row0 + n_rows - 1`` of one operand (``n_rows >= 1``). ``phase`` 0:
        each row quantized by its own scale; 1: the rows' amax only, into ``amax_bits[row %
        Hpk]`` (key rows: ``row0`` is a multiple of Hpk); 2: quantized by the block's scale
        from ``amax_bits``."""
        Dp, U = self.head_dim, self.unroll
        L = Dp // 16  # lanes per row
        RPC = self.warps * 32 // L  # rows per CTA pass
        lane = tidx % L  # the lane within its row's group
        slot = tidx // L  # the thread's row within a pass
        col0 = lane * PIECE  # the lane's two pieces: elements col0.. and col0 + Dp/2..
        for base in cutlass.range(0, n_rows, RPC * U, unroll=1):
            # every load of the U passes first (a row past the end reloads the last one)
            raws = []
            for u in cutlass.range_constexpr(U):
                r = cutlass.min(base + u * RPC + slot, n_rows - 1)
                raws.append(self.load(mX, row0 + r, col0))
            for u in cutlass.range_constexpr(U):
                r = base + u * RPC + slot
                ok = r < n_rows
                y = self.rotated(raws[u], lane)
                if cutlass.const_expr(phase == 1):
                    amax = self.row_amax(y)
                    if ok and lane == 0:
                        cute.arch.atomic_max(amax_bits.iterator + r % self.k_heads, _bits(amax))
                else:
                    amax = Float32(0.0)
                    if cutlass.const_expr(phase == 2):
                        amax = _from_bits(amax_bits[r % self.k_heads])
                    else:
                        amax = self.row_amax(y)
                    scale = Float32(1.0)
                    if amax >= Float32(MIN_AMAX):  # quant._scale (False for NaN)
                        scale = cute.math.div(amax, Float32(quant.E4M3_MAX), rounding=RN)
                    row = row0 + cutlass.min(r, n_rows - 1)
                    self.store(mX8, row, col0, y, scale, ok)
                    if ok and lane == 0:
                        mXs[row] = scale

    @cute.jit
    def load(self, mX, row: Int64, col0: Int32):
        """The lane's two 16-byte pieces of row ``row`` (elements ``col0 ..`` and ``col0 +
        Dp/2 ..``), as two register tensors of 8 elements."""
        Dp = self.head_dim
        out = []
        for h in cutlass.range_constexpr(2):
            src = cute.make_tensor(
                mX.iterator + cute.assume(row * Dp + (col0 + h * (Dp // 2)), divby=PIECE),
                cute.make_layout(PIECE),
            )
            vals = cute.make_rmem_tensor(PIECE, self.dtype)
            cute.autovec_copy(src, vals)
            out.append(vals)
        return out

    @cute.jit
    def rotated(self, raws, lane: Int32):
        """The lane's 16 elements of the row in fp32 (element ``e`` at column ``col0 + e % 8 +
        (e // 8) * Dp / 2``), rotated: the butterflies at strides 1, 2, 4 (in
        registers), 8 .. Dp/4 (lane ``l`` with ``l ^ (stride / 8)``), Dp/2 (in registers), in
        that order, then the multiply by ``fp32(Dp ** -0.5)`` (quant.hadamard_transform)."""
        x = []
        for h in cutlass.range_constexpr(2):
            f = cute.make_rmem_tensor(PIECE, Float32)
            f.store(raws[h].load().to(Float32))
            for i in cutlass.range_constexpr(PIECE):
                x.append(f[i])
        for st in (1, 2, 4):
            _butterflies(x, st)
        for m in _lane_bits(self.head_dim):  # lane bit m: stride 8 m
            # own + partner (bit clear), partner - own (bit set: the upper element)
            sign = Float32(-1.0) if (lane & m) != 0 else Float32(1.0)
            _lane_butterflies(x, m, sign)
        _butterflies(x, 8)
        c = Float32(rotation_scale(self.head_dim))
        x = [cute.math.mul(v, c, rounding=RN) for v in x]
        return x

    @cute.jit
    def row_amax(self, y):
        """``max |y|`` over the row (its ``L`` lanes), NaN if any is (``torch.amax``)."""
        acc = cute.math.abs(y[0])
        for e in cutlass.range_constexpr(1, 16):
            acc = cute.arch.fmax(acc, cute.math.abs(y[e]), nan=True)
        for m in reversed(_lane_bits(self.head_dim)):  # over the row's lanes
            acc = cute.arch.fmax(acc, cute.arch.shuffle_sync_bfly(acc, offset=m), nan=True)
        return acc

    @cute.jit
    def store(self, mX8, row: Int64, col0: Int32, y, scale: Float32, ok):
        """``e4m3(y / scale)`` (saturated at +-448: the reference's clamp) as the lane's two
        8-byte pieces of row ``row``, if ``ok``."""
        Dp = self.head_dim
        for h in cutlass.range_constexpr(2):
            f = cute.make_rmem_tensor(PIECE, Float32)
            for i in cutlass.range_constexpr(PIECE):
                f[i] = cute.math.div(y[h * PIECE + i], scale, rounding=RN)
            v8 = cute.make_rmem_tensor(PIECE, cutlass.Float8E4M3FN)
            v8.store(f.load().to(cutlass.Float8E4M3FN))
            if ok:
                dst = cute.make_tensor(
                    mX8.iterator + cute.assume(row * Dp + (col0 + h * (Dp // 2)), divby=PIECE),
                    cute.make_layout(PIECE),
                )
                cute.autovec_copy(v8, dst)


RN = cute.math.RoundingMode.NEAREST_EVEN


def rotation_scale(head_dim: int) -> float:
    """The fp32 normalization of the rotation of a power-of-two ``head_dim`` (a Python float
    that is an fp32 value: quant.hadamard_transform's multiplier)."""
    return torch.tensor(head_dim**-0.5, dtype=torch.float32).item()


def _lane_bits(head_dim: int) -> tuple:
    """The lane-index bits of a row's ``head_dim / 16`` lanes: (1, 2, 4) at 128, (1, 2) at 64."""
    return tuple(1 << i for i in range((head_dim // 16).bit_length() - 1))


def _butterflies(x: list, st: int) -> None:
    """In place on the lane's 16 values: ``(x[e], x[e + st]) -> (a + b, a - b)`` for every
    ``e`` without bit ``st``, each rounded once (``add.rn`` and ``sub.rn``). Trace-time Python
    (no staged control flow)."""
    for e in range(16):
        if not e & st:
            a, b = x[e], x[e + st]
            x[e] = cute.math.add(a, b, rounding=RN)
            x[e + st] = cute.math.add(a, cute.math.neg(b), rounding=RN)


def _lane_butterflies(x: list, m: int, sign) -> None:
    """In place: the butterflies between this lane and lane ``^ m``: ``fma(sign, own,
    partner)``, ``sign`` -1 on the lane holding the upper elements (``partner - own``), else 1
    (``own + partner``). Trace-time Python."""
    for e in range(16):
        other = cute.arch.shuffle_sync_bfly(x[e], offset=m)
        x[e] = cute.math.fma(sign, x[e], other, rounding=RN)


def _bits(x):
    """The bits of fp32 ``x`` as an Int32 (traced inline)."""
    t = cute.make_rmem_tensor(1, Float32)
    t[0] = x
    return cute.recast_tensor(t, Int32)[0]


def _from_bits(i):
    """The fp32 whose bits are Int32 ``i`` (traced inline)."""
    t = cute.make_rmem_tensor(1, Int32)
    t[0] = i
    return cute.recast_tensor(t, Float32)[0]
