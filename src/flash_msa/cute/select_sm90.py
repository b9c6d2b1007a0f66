"""Proxy block selection on Hopper (sm_90a) in CuTe DSL: wgmma scores, TMA pipeline, top-k epilogue.

One CTA of :class:`SelectSm90` owns (proxy head p, sequence s, query tile of 128 tokens). Its 512
threads split into a producer warpgroup (one warp issues TMA copies: the query tile once, then the
sequence's key tiles 0..m through a ``stages``-deep mbarrier pipeline), two consumer warpgroups
(64 query rows each) and a selector warpgroup (one query row per thread; "Selector warpgroup"
below). Per key tile the consumers compute the 128 x 128 score tile with warpgroup MMAs
(``m64n128k16``, operands in swizzled shared memory), max-pool each row over every key block
(one block per tile for block size 128, two for 64) and put the block maxima into a ring in
shared memory; the selector offers them to each row's descending top-k list, kept in its
registers. Only the diagonal tile is masked (causal, and keys past the sequence end). The MMA of
tile j+1 is issued after tile j's row maxima and runs under their quad reduction and ring store
(two alternating accumulators, so that it also runs under the row maxima, measured 11-22%
slower on the H200 when the consumers kept the lists).

Selection rule (identical to the reference and the Triton kernel): the own block enters with
rank +inf; a block enters the list only if its maximum is strictly greater than the list's last
(smallest) entry, so ties keep the lower block (tiles arrive in ascending order); a block with no
visible key never enters. At the end each row's kept blocks are sorted ascending, unused slots
are -1, and the row's selector thread writes them: the only output is ``indices (T, Hp, K)``
int32.

The scale is not applied: ``proxy_scale > 0`` (validated by the API) does not change the order.
Layouts: ``q_proxy (T, Hp, Dp)`` and ``k_proxy (T, Hpk, Dp)`` are seen as ``(T, Dp, heads)``
(strides ``(heads*Dp, 1, Dp)``) so that one TMA box is 128 tokens x Dp of one head; a sequence
starts at ``cu_seqlens[s]`` through a domain offset of the TMA coordinates.

Query map (``SelectSm90(qmap=True)``, context parallelism; the contract's ``q_map``,
docs/design.md): ``q_proxy`` and ``indices`` have ``Tq`` query rows whose tokens ``q_map[row]``
lie anywhere among the keys. As in the Triton kernel (``HAS_QMAP``), the host groups the rows by
sequence (:func:`flash_msa.worklist.query_order`: sorted by token, ``seq_start``), and a CTA owns
128 consecutive rows of its sequence's group instead of 128 consecutive tokens. Its query tile
is gathered by the consumer threads (16-byte ``cp.async`` pieces, one row per query row: the
rows need not be contiguous, so no TMA box fits them); each row's position (causal limit, own
block) is ``q_map[row] - start``; the CTA walks the key tiles up to its last (largest) row's
and masks every tile from its first row's on (a tile's rows may span several key tiles); the
lists are written to the rows themselves. Padding rows (``-1``) belong to no sequence: no CTA
visits them and ``selection.select`` fills them with -1. The map's parts are compile-time branches:
without the map none of them is traced.

FP8 mode (``SelectSm90(dtype=Float8E4M3FN, key_scale="block" | "token")``,
``selection_precision="fp8"``; docs/algorithm.md, "FP8 selection"): the operands are
the e4m3 ``q8 (T, Hp, Dp)``, ``k8 (T, Hpk, Dp)`` of :func:`flash_msa.quant.quantize` (the pass
the torch reference and the Triton oracle read), the score tile is ``m64n128k32 .f32.e4m3.e4m3``
wgmmas (K-major A and B in swizzled shared memory, as in bf16: FP8 wgmma has no transposed
operand), and the key scales ``(T, Hpk)`` fp32 (:class:`KeyScales`) enter the epilogue: per
block, one multiply of the lane's quad-reduced block maximum (``max_j(s * acc_j) = s *
max_j(acc_j)``, ``s > 0``; read at the block's first token, loaded before the tile's MMA wait);
per token, one multiply per score before the max (the thread's 32 columns, loaded likewise).
The query scale is not applied (a positive row constant). Everything else is the bf16
kernel's code: the same 128 x 128 score tile (two consumer warpgroups x 64 rows) and top-k
epilogue; an e4m3 tile of 128 keys takes half the bytes, so the default pipeline is twice as
deep (:data:`FP8_STAGES`, the same bytes in flight). The mode's parts are compile-time
branches. No query map in this mode.

Top-k insertion: a
rank update (:meth:`SelectSm90.offer_row`) computes every list entry from its own comparison
behind a warp vote, and the quad's block maxima are reduced by exchanging rows
(:meth:`SelectSm90.quad_exchange_max`). The rank update replaced a sequential insertion, a
swap carried through the list (at k=16 a 16-deep dependent chain, 151 register moves and a
divergent BSSY/BSYNC region in the SASS; the insertion's instructions, paper fp8: k=16 172 ->
79, k=64 347 -> 158), measured on the H200 while the consumers still kept the lists (paper
S=131072, kernel ms chain -> rank, the rank indices identical to the chain's on every line):
random bf16 k=16 14.59 -> 13.01, fp8 k=16 11.83 -> 9.60, bf16 k=64 20.38 -> 15.53, fp8 k=64
19.48 -> 12.68; local bf16 k=16 11.20 -> 11.21, fp8 k=16 8.19 -> 7.98. It keeps
the sequential insertion's lists after every offer, ties included; that chain survives only as
the CPU oracle of tests/cute_host/test_select.py, which replays both.

An MMA ping-pong (the consumer warpgroups taking turns to issue a tile's MMA on two named
barriers) lost on the H200 (paper S=131072 random, kernel ms default -> ping-pong, identical
indices): bf16 k=16 13.499 -> 13.528, fp8 k=16 9.697 -> 9.876, bf16 k=64 15.829 -> 16.014, fp8
k=64 12.379 -> 13.770; it left the code.

Selector warpgroup: a fourth warpgroup (``SELECTOR_WG`` = 3) keeps the 128 rows' top-k lists, thread ``t`` the
whole list of the tile's row ``t`` (no split at any top_k, no pair of lanes per row, no
divergence between them), so the consumers' per-tile work has no insertion: they compute the
block maxima (scale, own block's ``+inf``, ``-inf`` for masked blocks) and put them into a ring
in shared memory, ``ring[row, slab, slot]`` fp32 (``RING_SLOTS`` = R = 4 tiles, 1 slab at block
128, 2 at 64). The selector offers them in block order (:meth:`SelectSm90.offer_row`, behind a
vote of its warp) and writes the lists out (:meth:`SelectSm90.write_row`, one row per thread).
Every mode has it: bf16/fp16, e4m3 with either key scale, block 64 and 128, top_k 1..64, the
query map. It replaced the lists in the consumer warpgroups (two lanes per row, each list split
over both beyond 16 entries), which lost on the H200 (kernels alone, same run, the indices
bitwise equal on every line and on all 38 GPU test cases: paper 128K random fp8 k=16 9.829 ->
8.898 ms, bf16
k=16 13.642 -> 12.973, 1M random fp8 k=16 571.8 -> 556.9, the k=64 and local lines faster or
within 0.5%).

Barrier accounting (per CTA, N = ``n_tiles`` key tiles, CTA-uniform; slot ``s = j mod R``, use
``u = j div R``; :meth:`~SelectSm90.ring_slot`, ``ring_full_parity``, ``ring_empty_parity``):

- full[s] (``mbarrier.init`` count 8): each consumer warp, after its lanes' stores of tile j
  (one lane per row: lanes 4q and 4q+2) and a ``bar.warp.sync`` (the other lanes' stores
  ordered before the release), arrives once from one elected lane (``mbarrier.arrive``,
  release): 8 arrivals complete full[s]'s phase u. The selector's 128 threads wait on it with
  parity ``u & 1``.
- empty[s] (count 4): each selector warp, after its lanes' loads of the slot and a
  ``bar.warp.sync``, arrives once from one elected lane: 4 arrivals complete empty[s]'s phase
  u. The consumers' 256 threads wait on it before writing tile j with parity ``(u + 1) & 1``
  (phase u - 1: the selector's read of tile j - R; for j < R parity 1, which a fresh barrier
  passes).
- So each slot's barriers complete ceil((N - s) / R) phases each, nothing pending at the end.
  A parity is never ambiguous: the consumers cannot complete full[s]'s phase u + 1 before the
  selector arrived for phase u (they wait on empty first), nor the selector empty[s]'s phase
  u + 1 before the consumers wrote use u + 1. No cycle: the consumers wait on the producer
  (key stages) and on the selector's read of R tiles back; the selector only on the
  consumers. The barriers are initialized with ``q_bar`` (warp 0, one elected thread) before
  the key pipeline's ``create()``, whose fence and CTA-wide ``bar.sync 0`` (all 512 threads)
  publish them. tests/cute_host/test_select.py replays this on a model of the
  mbarrier over random interleavings, and checks the ``mbarrier.init`` counts in the PTX.

Registers (:meth:`SelectSm90.register_split`): 512 threads launch with 65,536 / 512 = 128;
``setmaxnreg`` producer 24, selector ``max(56, 2 top_k + 24)`` rounded up to 8, consumers
the rest, half each, rounded down to 8: top_k 16: 24 / 216 / 56, top_k 64: 24 / 168 / 152
(128 x (24 + 56 + 2 x 216) = 128 x (24 + 152 + 2 x 168) = 65,536). Highest register named in
the SASS (compile_check ``select``, sm_90a), the consumers' (when they kept the lists -> now)
and the selector's: e4m3 k=16 b=128 145 -> 113, selector 39 (of 56); e4m3 k=64 b=128 175 -> 113,
139 (of 152); bf16 k=16 b=128 133 -> 100, 39; bf16 k=64 b=64 159 -> 97, 139; e4m3 per-token
k=16 229 -> 201 (of 216), k=64 b=64 236 -> 164 (of 168): no spills, ``setmaxnreg`` kept, the
wgmmas not serialized (waits 2/8 e4m3, 2/16 bf16). One ``wgmma.wait_group 0`` after the
consumers' loop (a no-op at run time) keeps the MMA pipeline inside their region: without it
ptxas saw the loop-skipping path reach the kernel's common exit with the first MMA in flight
and serialized every wgmma (C7511, waits 8/8).
Shared memory: the ring and its 8 mbarriers after the key stages, 2,112 / 4,160 bytes
(block 128 / 64), the struct rounded up to 1,024 (:meth:`SelectSm90.shared_bytes`): bf16 Dp
128 4 stages 167,936 / 169,984 bytes, fp8 Dp 128 8 stages 151,552 / 153,600.

Limits (:meth:`SelectSm90.can_implement`): Dp in {64, 128}, block size in {64, 128},
top_k <= 64 (a selector thread keeps its row's list in registers: 2 x 64 + 24 = 152 of them
at top_k 64), bf16 or fp16 (e4m3 in the FP8 mode), the pipeline depth as shared memory allows
(Dp 128: bf16 5 stages, fp8 12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Constexpr, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .. import quant
from ..cubin import SHARED_LIMIT
from .common import PointerTensors, acc_rows_cols, pointer_tensors, row_gather_copy, tma_tiles

TILE_M = 128  # query tokens per CTA (two consumer warpgroups x 64 rows); the grid's y
MAX_TOPK = 64  # a selector thread keeps its row's list in registers (152 of them at 64)
# key-pipeline depth of the FP8 mode: an e4m3 key tile is half a bf16 one (16 KB at Dp 128), so
# 8 stages keep the bf16 default's bytes (128 KB) in flight and cover the same latency when the
# tile's MMA takes half the time; 16 + 8 x 16 KB = 144 KB of shared memory, 148 or 150 KB with
# the ring
FP8_STAGES = 8


def _max_of(vals):
    """Pairwise (log-depth) maximum of a Python list of Float32 values."""
    while len(vals) > 1:
        nxt = [cute.arch.fmax(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def _sort_ascending(keys):
    """Bitonic sorting network (trace-time unrolled) over a Python list of DSL integers whose
    length is a power of two: ``n/2 * log2(n) * (log2(n) + 1) / 2`` compare-exchanges (672 for
    64 entries; an odd-even transposition network needs 2016, which ptxas compiles for minutes)."""
    n = len(keys)
    k = 2
    while k <= n:
        j = k // 2
        while j > 0:
            for i in range(n):
                m = i ^ j
                if m > i:
                    lo = cutlass.min(keys[i], keys[m])
                    hi = cutlass.max(keys[i], keys[m])
                    keys[i], keys[m] = (lo, hi) if i & k == 0 else (hi, lo)
            j //= 2
        k *= 2
    return keys


class QueryMap(NamedTuple):
    """The run-time arguments of the query map (``SelectSm90(qmap=True)``)."""

    q_map: cute.Tensor  # (Tq,) int32: each query row's packed key token (-1: padding row)
    rows: cute.Tensor  # (Tq,) int32: query rows sorted by token (worklist.query_order)
    seq_start: cute.Tensor  # (N+1,) int32: sequence n's sorted rows rows[seq_start[n]:...[n+1]]


class KeyScales(NamedTuple):
    """The run-time argument of the FP8 mode (``SelectSm90(key_scale=...)``)."""

    # (T, Hpk) fp32: quant.Quantized.k_scale, per token (per block: each token holds its block's)
    k_scale: cute.Tensor


@dataclass(frozen=True)
class SelectSm90:
    """Proxy block selection (module docstring), one static configuration; the fields are all
    of it (the compile cache keys on the object).

    Run-time values: the token count, the number of sequences and their lengths, the number of
    query tiles of the longest one (the grid's y)."""

    dtype: type[cutlass.Numeric]  # BFloat16 or Float16: q_proxy and k_proxy (FP8: Float8E4M3FN)
    proxy_head_dim: int  # Dp
    heads: int  # Hp: proxy query heads (one selection per head)
    k_heads: int  # Hpk: proxy key heads (Hp / Hpk query heads share one)
    top_k: int  # K
    block_size: int  # keys per block: one or two blocks per key tile
    stages: int = 4  # key tiles in flight (the TMA pipeline's depth)
    # query rows through a query map (module docstring): the query tile is gathered, positions
    # come from the map; False: the kernel compiles as before the map existed
    qmap: bool = False
    # FP8 mode (module docstring): the key scales' granularity, "block" or "token"
    # (quant.KEY_SCALES), with e4m3 operands; None: the exact bf16/fp16 selection
    key_scale: str | None = None
    # the launch's tensors as their CuTe views had them (``launch.view_layout``: element type,
    # static sizes and strides, in the order of ``selection.launch_tensor_names``), set by
    # ``selection.select_arguments`` from the tensors of the call: the compiled code
    # bakes them in (TMA descriptors' boxes, the index rows' strides), so two layouts are two
    # kernel objects. ``()`` for a configuration not yet bound to a launch's tensors
    views: tuple = ()

    TILE_M: ClassVar[int] = TILE_M
    TILE_N: ClassVar[int] = 128  # keys per pipeline stage (one or two key blocks)
    THREADS: ClassVar[int] = 512  # producer, two consumer and the selector warpgroups
    CONSUMERS: ClassVar[int] = 256  # the consumer warpgroups' threads
    QUERY_BAR: ClassVar[int] = 1  # named barrier of the consumers: the gathered query tile
    PRODUCER_REGS: ClassVar[int] = 24  # the rest of the file: :meth:`register_split`
    # warpgroup 3 keeps the lists (module docstring, "Selector warpgroup"); its ring of block
    # maxima has RING_SLOTS slots (tiles the consumers may run ahead of it)
    SELECTOR_WG: ClassVar[int] = 3
    RING_SHIFT: ClassVar[int] = 2  # log2(RING_SLOTS): slot j & (R - 1), phase j >> RING_SHIFT
    RING_SLOTS: ClassVar[int] = 1 << RING_SHIFT
    REGISTER_FILE: ClassVar[int] = 65536  # 32-bit registers of an SM (one CTA per SM)

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def shared_bytes(elem_bytes: int, proxy_head_dim: int, stages: int, block_size: int) -> dict:
        """Bytes of each shared-memory buffer, in the order of the ``Storage`` struct (the
        operand tiles aligned to 1024 bytes, the 128B swizzle's period), and their sum: the
        key pipeline's and the query tile's mbarriers, the query tile, the key stages, the
        ring's full and empty mbarriers per slot and the ring of block maxima (fp32,
        ``RING_SLOTS x (TILE_N / block_size) x TILE_M``), the struct rounded up to its
        alignment (1024, the tiles')."""
        slabs = SelectSm90.TILE_N // block_size  # key blocks per tile: the ring's per slot
        sizes = {
            "k_mbar": 8 * 2 * stages,  # full and empty mbarrier per stage
            "q_mbar": 8,
            "sQ": SelectSm90.TILE_M * proxy_head_dim * elem_bytes,
            "sK": SelectSm90.TILE_N * proxy_head_dim * elem_bytes * stages,
            "ring_mbar": 8 * 2 * SelectSm90.RING_SLOTS,  # full and empty per slot
            "ring": 4 * SelectSm90.RING_SLOTS * slabs * SelectSm90.TILE_M,
        }
        end = 0
        for name, size in sizes.items():
            if name in ("sQ", "sK"):
                end = -(-end // 1024) * 1024
            end += size
        end = -(-end // 1024) * 1024  # the struct's size is a multiple of its alignment
        return {**sizes, "total": end}

    @classmethod
    def register_split(cls, top_k: int) -> dict:
        """The launch's threads and registers per thread (``launch``: the file over the
        threads), and the ``setmaxnreg`` counts of the producer, consumer and selector
        warpgroups; their sum over the threads is the file.

        512 threads, 128 at launch; the selector's lists take 2 x top_k registers (values and
        block numbers, one row per thread) and ~24 more (the ring's addresses and phase, the
        candidates, the rank update's temporaries, the write-out's sort network beside the
        block numbers), rounded up to 8 and at least 56; the consumers get the rest, half
        each, rounded down to 8: top_k 16: 24 / 216 / 56, top_k 64: 24 / 168 / 152 (160 / 176 for k = 64 is 128 x (24 + 160) + 256 x 176 = 68,608, past the
        file). The consumers hold no list: the accumulator (64) and ~30 more (compile_check:
        no spills)."""
        per_row = cls.REGISTER_FILE // 128  # one thread of each of the 4 warpgroups
        sel = max(56, -(-(2 * top_k + 24) // 8) * 8)
        cons = (per_row - cls.PRODUCER_REGS - sel) // 2 // 8 * 8
        return dict(threads=cls.THREADS, launch=cls.REGISTER_FILE // cls.THREADS,
                    producer=cls.PRODUCER_REGS, consumer=cons, selector=sel)  # fmt: skip

    @classmethod
    def can_implement(
        cls, dtype, proxy_head_dim, heads, k_heads, top_k, block_size, stages=4, key_scale=None
    ) -> str | None:  # fmt: skip
        """Why this configuration cannot be compiled or run (``None``: it can).

        Shared memory (:meth:`shared_bytes`) at Dp = 128, bf16, 4 stages: the query tile
        128 x 128 x 2 = 32 KB + 4 key tiles of 32 KB (128 KB) + 9 mbarriers, aligned, then the
        ring: 2,112 bytes at block 128 (4 slots x 128 rows x 4 bytes + 8 mbarriers), 4,160 at
        block 64 (two slabs), the struct rounded up to 1,024: 167,936 / 169,984 bytes of the
        sm_90 capacity of 232,448 (SHARED_LIMIT; 5 stages fit, 202,752 at block 64; 6 do not,
        233,472 at block 128). FP8 mode (``key_scale``): e4m3 tiles, 16 KB + 8 stages of 16 KB
        at Dp = 128 (:data:`FP8_STAGES`): 151,552 / 153,600 bytes; 12 stages fit (219,136 at
        block 64), 13 do not (233,472 at block 128). Registers (:meth:`register_split`): a
        selector thread keeps its row's list, 2 x top_k + 24; top_k > 64 would not fit beside
        the consumers' (compile_check asserts no spills)."""
        if key_scale is not None:
            if key_scale not in quant.KEY_SCALES:
                return f"key_scale must be one of {quant.KEY_SCALES}, not {key_scale!r}"
            if dtype is not cutlass.Float8E4M3FN:
                return f"the CuTe fp8 selection needs e4m3 operands (quant.quantize), not {dtype}"
        elif dtype not in (cutlass.BFloat16, cutlass.Float16):
            return f"CuTe selection needs bf16 or fp16 (e4m3 with a key_scale), not {dtype}"
        if proxy_head_dim not in (64, 128):
            return f"CuTe selection needs Dp in (64, 128), not {proxy_head_dim}"
        if block_size not in (64, 128):
            return f"CuTe selection needs block_size 64 or 128, not {block_size}"
        if not 1 <= top_k <= MAX_TOPK:
            return f"CuTe selection keeps top_k <= {MAX_TOPK} blocks in registers, not {top_k}"
        if heads % k_heads:
            return (
                f"the proxy query heads ({heads}) are not a multiple of the key heads ({k_heads})"
            )
        if stages < 2:
            return f"the key pipeline needs 2 or more stages, not {stages}"
        smem = cls.shared_bytes(dtype.width // 8, proxy_head_dim, stages, block_size)["total"]
        if smem > SHARED_LIMIT:
            return (
                f"stages={stages}: {smem} bytes of shared memory exceed the sm_90 capacity "
                f"({SHARED_LIMIT})"
            )
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.proxy_head_dim, self.heads, self.k_heads, self.top_k,
            self.block_size, self.stages, self.key_scale,
        )  # fmt: skip
        if why is None and self.qmap and self.key_scale is not None:
            why = "the fp8 selection has no query map"
        if why is not None:
            raise ValueError(f"CuTe selection: {why}")

    @property
    def tensor_count(self) -> int:
        """How many tensors a launch passes (``selection.launch_tensor_names``): q_proxy,
        k_proxy, cu_seqlens, indices, then the key scales (FP8 mode) or the query map's three
        (:attr:`qmap`)."""
        return 5 if self.key_scale is not None else 7 if self.qmap else 4

    # -----------------------------------------------------------------------------------------
    # host: MMAs, layouts, TMA atoms, shared storage, launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, tensors: PointerTensors, n_mblk: Int32, stream: cuda.CUstream):
        """Launch. ``tensors``: per tensor of ``selection.launch_tensor_names`` its typed global
        pointer and mode-0 size (run-time), the rest of its layout in :attr:`views`
        (``selection.select_arguments``); rebuilt here as ``mQ (T, Dp, Hp)``, ``mK (T,
        Dp, Hpk)`` views of the proxy tensors, ``mCu (N+1,)``, ``mIdx (T, Hp, K)``; grid (Hp *
        N, n_mblk = ceil(max_seqlen / 128)). ``mode_args``: a :class:`QueryMap` exactly when
        :attr:`qmap` (``mQ`` and ``mIdx`` then have ``Tq`` query rows, ``mK`` the keys' ``T``,
        and ``n_mblk`` bounds the query rows of one sequence, ceil(min(Tq, max_seqlen) / 128));
        :class:`KeyScales` exactly in the FP8 mode (:attr:`key_scale`); else none."""
        assert len(self.views) == self.tensor_count, "views of every tensor"
        t = pointer_tensors(tensors, self.views)
        mQ, mK, mCu, mIdx = t[:4]
        mode_args = None
        if cutlass.const_expr(self.key_scale is not None):
            mode_args = KeyScales(t[4])
        elif cutlass.const_expr(self.qmap):
            mode_args = QueryMap(*t[4:7])
        DP, TILE_N, dtype = self.proxy_head_dim, self.TILE_N, self.dtype
        assert mQ.element_type == dtype and mQ.shape[1:] == (DP, self.heads)
        assert mK.shape[1:] == (DP, self.k_heads) and mIdx.shape[1:] == (self.heads, self.top_k)
        tile = (self.TILE_M, TILE_N, DP)

        def make_mma():
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(2, 1, 1), tiler_mn=(64, TILE_N),
            )  # fmt: skip

        mma_first, mma_rest = make_mma(), make_mma()
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dtype, self.stages)
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.slice_(sQ_layout, (None, None, 0)),
            (self.TILE_M, DP),
        )  # fmt: skip
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.slice_(sK_layout, (None, None, 0)),
            (TILE_N, DP),
        )  # fmt: skip

        Storage = self.storage(sQ_layout, sK_layout)
        smem = self.shared_bytes(dtype.width // 8, DP, self.stages, self.block_size)["total"]
        assert Storage.__sizeof__() == smem <= SHARED_LIMIT, (Storage.__sizeof__(), smem)
        grid = (self.heads * (mCu.shape[0] - 1), n_mblk, 1)
        qm = ()  # the query map's kernel arguments (none without it)
        ks = ()  # the FP8 mode's: the key scales (none without it)
        if cutlass.const_expr(self.key_scale is not None):
            assert isinstance(mode_args, KeyScales), "the FP8 mode needs its KeyScales"
            ks = (mode_args.k_scale,)
        elif cutlass.const_expr(self.qmap):
            query_map = mode_args
            assert isinstance(query_map, QueryMap), "a query-map kernel needs its QueryMap"
            # the consumers gather the query tile: 16-byte pieces, Dp / 8 threads per row
            gather = row_gather_copy(dtype, self.CONSUMERS, DP)
            qm = (mQ, *query_map, gather)
        else:
            assert mode_args is None, "a QueryMap or KeyScales given to a kernel without its mode"
        self.kernel(
            tma_q, tma_mQ, tma_k, tma_mK, mCu, mIdx, mma_first, mma_rest, sQ_layout, sK_layout,
            Storage, qm, ks,
        ).launch(grid=grid, block=(self.THREADS, 1, 1), stream=stream)  # fmt: skip

    def storage(self, sQ_layout, sK_layout):
        """The shared storage (sizes: :meth:`shared_bytes`): the key stages' and the query
        tile's mbarriers, the query tile, the key stages, the ring's mbarriers (full
        ``0..R-1``, empty ``R..2R-1``) and the ring ``(TILE_M, slabs, R)`` fp32 (R =
        ``RING_SLOTS``, slabs the key blocks per tile)."""
        R, dtype, S = self.RING_SLOTS, self.dtype, cute.struct
        ring_slabs = self.TILE_N // self.block_size
        fields_ = {  # (evaluated here: this module's annotations are strings, PEP 563)
            "k_mbar": S.MemRange[cutlass.Int64, 2 * self.stages],
            "q_mbar": S.MemRange[cutlass.Int64, 1],
            "sQ": S.Align[S.MemRange[dtype, cute.cosize(sQ_layout)], 1024],
            "sK": S.Align[S.MemRange[dtype, cute.cosize(sK_layout)], 1024],
            "ring_mbar": S.MemRange[cutlass.Int64, 2 * R],
            "ring": S.MemRange[Float32, R * ring_slabs * self.TILE_M],
        }
        return S(type("Storage", (), {"__annotations__": fields_}))

    # -----------------------------------------------------------------------------------------
    # device
    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,  # TMA coordinates of q_proxy seen as (T, Dp, Hp)
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,  # (T, Dp, Hpk)
        mCu: cute.Tensor,  # (N + 1,) int32
        mIdx: cute.Tensor,  # (T, Hp, K) int32
        mma_first: cute.TiledMma,
        mma_rest: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        Storage: Constexpr,
        qm: tuple,  # (q_proxy (Tq, Dp, Hp), q_map, rows, seq_start, gather) with the map, else ()
        ks: tuple,  # (k_scale (T, Hpk) fp32,) in the FP8 mode, else ()
    ):
        TILE_M, TILE_N, DP, BLOCK, TOPK = (
            self.TILE_M, self.TILE_N, self.proxy_head_dim, self.block_size, self.top_k
        )  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        mma_first.set(warpgroup.Field.ACCUMULATE, False)
        mma_rest.set(warpgroup.Field.ACCUMULATE, True)
        head_seq, m_rev, _ = cute.arch.block_idx()
        _, n_mblk, _ = cute.arch.grid_dim()
        m_blk = n_mblk - 1 - m_rev  # longest causal rows first
        p = head_seq % self.heads
        seq = head_seq // self.heads
        start = mCu[seq]
        L = mCu[seq + 1] - start
        n_rows = L  # query rows of the sequence: its tokens, or its group of mapped rows
        if cutlass.const_expr(self.qmap):
            qs = qm[3][seq]  # the sequence's first sorted row
            n_rows = qm[3][seq + 1] - qs
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4

        st = SmemAllocator().allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (128, Dp, 1)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (128, Dp, stages)
        q_bar = st.q_mbar.data_ptr()
        if warp_idx == 0:
            if cutlass.const_expr(not self.qmap):  # (with the map the query tile is gathered)
                cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(q_bar, 1)
                self.ring_init(st.ring_mbar.data_ptr())
        # create() initializes the stage barriers, then fences and syncs the CTA (q_bar included)
        k_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.k_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),  # consumer warps
            tx_count=TILE_N * DP * (self.dtype.width // 8),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        if m_blk * TILE_M < n_rows:  # CTA-uniform: tiles past this sequence's end do nothing
            n_tiles = m_blk + 1  # key tiles 0..m_blk (causal)
            mask_from = None  # with the map: the first key tile that needs the causal mask
            if cutlass.const_expr(self.qmap):  # from the tile's first and last rows' tokens
                first, last = self.qmap_positions(qm, qs, n_rows, start, m_blk)
                n_tiles = last // TILE_N + 1
                mask_from = first // TILE_N
            regs = self.register_split(TOPK)
            # the producer's and the selector's warpgroups: one test, then which (the branch
            # structure timed on the H200)
            side = (wg_idx == 0) | (wg_idx == self.SELECTOR_WG)
            if side:
                if wg_idx == self.SELECTOR_WG:  # the lists (module docstring, "Selector")
                    self.select_rows(
                        st, regs["selector"], regs["launch"], tidx, n_tiles, m_blk, mIdx,
                        start, p, L, qm, qs if cutlass.const_expr(self.qmap) else None, n_rows,
                    )  # fmt: skip
                else:
                    cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
                    if warp_idx == 0:
                        self.load(
                            tma_q, mQ, tma_k, mK, sQ, sK, q_bar, k_pipe, start, p, m_blk, n_tiles
                        )  # fmt: skip
                # (with the map the consumers gather the query tile: the producer warpgroup
                # runs at 24 registers, the consumers' are free before their key loop)
            else:  # consumer warpgroups: scores, block maxima into the ring
                cute.arch.setmaxregister_increase(regs["consumer"])
                wg_mma = mma_first.get_slice((wg_idx - 1) * 128)
                thr_mma = mma_first.get_slice(tidx - 128)
                tSrQ = mma_first.make_fragment_A(wg_mma.partition_A(sQ))
                tSrK = mma_first.make_fragment_B(wg_mma.partition_B(sK))
                acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TILE_N)), Float32)
                acc_rc = acc_rows_cols(acc)
                crd = acc_rows_cols(
                    thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
                )
                SLABS = TILE_N // BLOCK  # key blocks per tile

                # a quad's four lanes hold the same two rows: lanes 4q, 4q+1 reduce and store
                # row 0's block maxima, 4q+2, 4q+3 row 1's (quad_exchange_max, ring_put)
                my_row = (tidx % 4) // 2  # which of the thread's two rows this lane stores
                ring = self.ring_tensors(st)
                q0 = m_blk * TILE_M  # sequence-local position of the tile's first query
                pos = None  # with the map: the positions of the thread's two rows
                if cutlass.const_expr(self.qmap):
                    pos = self.gather_queries(qm, sQ, qs, n_rows, start, q0, p, crd, tidx - 128)
                else:
                    cute.arch.mbarrier_wait(q_bar, 0)
                cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                k_pipe.consumer_wait(cons)
                self.scores(mma_first, mma_rest, acc, tSrQ, tSrK, cons.index)
                for j in cutlass.range(n_tiles, unroll=1):
                    scale = None  # FP8: the key scales of this tile (block's or columns')
                    if cutlass.const_expr(self.key_scale is not None):  # loads under the MMA
                        kh = p // (self.heads // self.k_heads)  # the proxy key head
                        scale = self.tile_scales(ks[0], crd, j, start, L, kh)
                    warpgroup.wait_group(0)
                    k_pipe.consumer_release(cons)  # the stage is free: the scores are in registers
                    cons.advance()
                    col_scale = scale if cutlass.const_expr(self.key_scale == "token") else None
                    cand = self.block_maxima(
                        acc_rc, crd, j, n_tiles, q0, L, pos, mask_from, col_scale
                    )
                    if j + 1 < n_tiles:  # the next tile's MMA runs under the ring's store
                        k_pipe.consumer_wait(cons)
                        self.scores(mma_first, mma_rest, acc, tSrQ, tSrK, cons.index)
                    # the quad's maximum of this lane's row, per block (the quad shares a row)
                    kept = self.quad_exchange_max(cand, my_row)
                    row = q0 + (crd[0, 0][0] if my_row == 0 else crd[1, 0][0])
                    if cutlass.const_expr(self.qmap):
                        row = pos[0] if my_row == 0 else pos[1]
                    own = row // BLOCK
                    offers = []  # this lane's row's offers of the tile, to the ring
                    for sl in cutlass.range_constexpr(SLABS):
                        cv = kept[sl]
                        if cutlass.const_expr(self.key_scale == "block"):
                            cv = cv * scale[sl]  # one multiply per (row, block): s_b > 0
                        if cv == Float32.inf:  # a non-finite block score is never kept
                            cv = -Float32.inf  # (fmax already skips NaN scores)
                        blk = j * SLABS + sl
                        if blk == own:
                            cv = Float32.inf  # the own block is always kept
                        offers.append(cv)
                    r_tile = crd[0, 0][0] if my_row == 0 else crd[1, 0][0]
                    self.ring_put(ring, j, offers, r_tile, tidx)

                # the selector writes the lists out. No MMA is in flight here (the last tile's
                # was waited for in the loop), but ptxas cannot see that n_tiles >= 1: the path
                # that skips the loop reached the kernel's exit (shared with the producer's and
                # the selector's warpgroups, of other register counts) with the first MMA in
                # flight, and ptxas serialized every wgmma for it (C7511 "insufficient register
                # resources", waits 8/8). This wait, a no-op at run time, ends the pipeline
                # inside the consumers' region (waits 2/8)
                warpgroup.wait_group(0)

    # -----------------------------------------------------------------------------------------
    # device roles (traced inline into the kernel)
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load(self, tma_q, mQ, tma_k, mK, sQ, sK, q_bar, k_pipe, start, p, m_blk, n_tiles):
        """Producer warp: the query tile once (on ``q_bar``), then key tiles ``0..n_tiles-1``
        of the sequence starting at ``start`` through the ``k_pipe`` stages."""
        TILE_M, TILE_N, DP = self.TILE_M, self.TILE_N, self.proxy_head_dim
        mQ_s = cute.domain_offset((start, 0, 0), mQ)
        mK_s = cute.domain_offset((start, 0, 0), mK)
        gQ = cute.local_tile(mQ_s[None, None, p], (TILE_M, DP), (m_blk, 0))
        gK = cute.local_tile(
            mK_s[None, None, p // (self.heads // self.k_heads)], (TILE_N, DP), (None, 0)
        )
        tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        if cutlass.const_expr(not self.qmap):  # (with the map the consumers gather it)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    q_bar, TILE_M * DP * (self.dtype.width // 8)
                )
            cute.copy(tma_q, tQgQ, tQsQ[(None, 0)], tma_bar_ptr=q_bar)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for j in cutlass.range(n_tiles, unroll=1):
            k_pipe.producer_acquire(prod)
            cute.copy(
                tma_k, tKgK[(None, j)], tKsK[(None, prod.index)],
                tma_bar_ptr=k_pipe.producer_get_barrier(prod),
            )  # fmt: skip
            k_pipe.producer_commit(prod)
            prod.advance()
        k_pipe.producer_tail(prod)

    @cute.jit
    def scores(self, mma_first, mma_rest, acc, tSrQ, tSrK, stage):
        """acc = Q . K[stage]^T as async wgmma, committed as one group (the caller waits).

        ``mma_first``/``mma_rest`` are one tiled MMA with ACCUMULATE set once to False/True at
        the kernel's top level (setting it inside a runtime branch does not dominate later
        uses)."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):  # Dp / 16 (e4m3: / 32)
            mma = mma_first if kb == 0 else mma_rest
            cute.gemm(mma, acc, tSrQ[None, None, kb, 0], tSrK[None, None, kb, stage], acc)
        warpgroup.commit_group()

    @cute.jit
    def block_maxima(
        self, acc_rc, crd, j, n_tiles, q0, L, pos=None, mask_from=None, col_scale=None
    ):
        """This thread's maximum of each of its two rows over each key block of tile ``j``
        (``cand[row][block]``); keys after the row's token or past the sequence end ``L`` are
        masked on the diagonal tile (the last). With the query map (``pos``: the two rows'
        positions) keys after the row's position are masked on tiles ``mask_from`` and later
        (a position is within the sequence: that also masks its end). ``col_scale`` (FP8 mode,
        per-token key scales: one per column of the thread) multiplies each score first."""
        SLABS = self.TILE_N // self.block_size
        cand = []  # per row and block: this thread's maximum
        for r in cutlass.range_constexpr(cute.size(crd, mode=[0])):
            cand.append([])
            if cutlass.const_expr(self.qmap):
                for sl in cutlass.range_constexpr(SLABS):
                    cand[r].append(self.slab_max(acc_rc, crd, r, sl, j, j >= mask_from, pos[r]))
            else:
                row = q0 + crd[r, 0][0]
                for sl in cutlass.range_constexpr(SLABS):  # diagonal tile: causal, sequence end
                    cand[r].append(
                        self.slab_max(acc_rc, crd, r, sl, j, j == n_tiles - 1, row, L, col_scale)
                    )
        return cand

    @cute.jit
    def slab_max(self, acc_rc, crd, r, sl, j, masked, last, end=None, col_scale=None):
        """This thread's maximum of row ``r`` over key block ``sl`` of tile ``j`` (its columns of
        the block ascend with ``c``); where ``masked``, keys after position ``last`` (and, given
        ``end``, keys at or past it) are ``-inf``. ``col_scale``: :meth:`scaled`."""
        per_slab = cute.size(crd, mode=[1]) // (self.TILE_N // self.block_size)
        mx = -Float32.inf
        if masked:
            vals = []
            for cc in cutlass.range_constexpr(per_slab):
                c = sl * per_slab + cc
                col = j * self.TILE_N + crd[r, c][1]
                v = self.scaled(acc_rc, r, c, col_scale)
                if cutlass.const_expr(end is None):  # (a position is within its sequence)
                    if col > last:
                        v = -Float32.inf
                else:  # noqa: PLR5501 (a trace-time branch, then a run-time one)
                    if col > last or col >= end:
                        v = -Float32.inf
                vals.append(v)
            mx = _max_of(vals)
        else:
            vals = []
            for cc in cutlass.range_constexpr(per_slab):
                vals.append(self.scaled(acc_rc, r, sl * per_slab + cc, col_scale))
            mx = _max_of(vals)
        return mx

    def scaled(self, acc_rc, r, c, col_scale):
        """Score ``(r, c)`` of the thread's tile, times its column's key scale when given
        (FP8 mode, per token); traced inline."""
        if col_scale is None:
            return acc_rc[r, c]
        return acc_rc[r, c] * col_scale[c]

    @cute.jit
    def tile_scales(self, mKS, crd, j, start, L, kh):
        """FP8 mode: the key scales ``mKS (T, Hpk)`` of key tile ``j`` (head ``kh``) this thread
        applies, loaded before the tile's MMA is waited for: per block (``"block"``), the
        value at each of the tile's blocks' first token; per token, the value of each of the
        thread's columns (``crd``: the same for its two rows). Positions are clamped to the
        sequence's last token ``L - 1``: a block or key past the end is masked to ``-inf``
        anyway, and the load must stay inside ``mKS``."""
        out = []
        if cutlass.const_expr(self.key_scale == "block"):
            for sl in cutlass.range_constexpr(self.TILE_N // self.block_size):
                first = (j * (self.TILE_N // self.block_size) + sl) * self.block_size
                out.append(mKS[start + cutlass.min(first, L - 1), kh])
        else:
            for c in cutlass.range_constexpr(cute.size(crd, mode=[1])):
                col = j * self.TILE_N + crd[0, c][1]
                out.append(mKS[start + cutlass.min(col, L - 1), kh])
        return out

    @cute.jit
    def qmap_positions(self, qm, qs, n_rows, start, m_blk):
        """Sequence-local positions of the first and the last row of query tile ``m_blk`` of
        the sequence's group (sorted rows ``qs ..``, ``n_rows`` of them, the sequence starting
        at packed key ``start``): the group is sorted by token, so they bound every row's."""
        q_map, rows = qm[1], qm[2]
        i0 = qs + m_blk * self.TILE_M
        i1 = qs + cutlass.min((m_blk + 1) * self.TILE_M, n_rows) - 1
        return q_map[rows[i0]] - start, q_map[rows[i1]] - start

    @cute.jit
    def gather_queries(self, qm, sQ, qs, n_rows, start, q0, p, crd, tc):
        """Consumer thread ``tc`` (0..255): gather the query tile (sorted rows ``qs + q0 ..``
        of the group, head ``p``; rows past ``n_rows`` repeat the last one) into ``sQ`` by
        cp.async, wait for the whole tile (named barrier of the consumers: each warpgroup's
        MMA reads rows another one gathered), and return the positions of the thread's two
        accumulator rows (``crd``), ``q_map[row] - start``."""
        mQ, q_map, rows, _, gather = qm
        DP = self.proxy_head_dim
        thr = gather.get_slice(tc)
        tGsQ = thr.partition_D(sQ)  # ((8, 1), passes, 1, 1)
        tGcQ = thr.partition_D(cute.make_identity_tensor((self.TILE_M, DP)))
        col = tGcQ[0, 0, 0][1]
        for ps in cutlass.range_constexpr(cute.size(tGsQ, mode=[1])):
            r = tGcQ[0, ps, 0][0]
            qrow = rows[qs + cutlass.min(q0 + r, n_rows - 1)]
            # q_proxy (Tq, Dp, Hp) with strides (Hp * Dp, 1, Dp): row qrow, head p
            off = cute.assume(Int64(qrow) * mQ.stride[0] + p * mQ.stride[2] + col, divby=8)
            src = cute.make_tensor(mQ.iterator + off, cute.make_layout(((8, 1),)))
            cute.copy(gather, src, tGsQ[None, ps, 0, 0])
        cute.arch.cp_async_commit_group()
        pos = []
        for r in cutlass.range_constexpr(cute.size(crd, mode=[0])):
            qrow = rows[qs + cutlass.min(q0 + crd[r, 0][0], n_rows - 1)]
            pos.append(q_map[qrow] - start)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")  # read by wgmma (async proxy)
        cute.arch.barrier(barrier_id=self.QUERY_BAR, number_of_threads=self.CONSUMERS)
        return pos

    @cute.jit
    def quad_exchange_max(self, cand, my_row):
        """The quad's maximum of this lane's row (``my_row``) over each key block, from the
        lanes' maxima ``cand[row][block]``: lanes 4q(+1) and 4q+2(+3) first swap the row they
        do not keep (butterfly 2), then the pair of a row combines (butterfly 1): 2 shuffles
        and 2 maxima per block instead of the 4 and 4 of every lane reducing both rows (the
        reduction it replaced, with the sequential insertion). The same set of values is
        reduced, so the maximum is the same float (tests/cute_host/test_select.py)."""
        kept = []
        for sl in cutlass.range_constexpr(self.TILE_N // self.block_size):
            mine = cand[0][sl] if my_row == 0 else cand[1][sl]
            other = cand[1][sl] if my_row == 0 else cand[0][sl]
            mx = cute.arch.fmax(mine, cute.arch.shuffle_sync_bfly(other, offset=2))
            kept.append(cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1)))
        return kept

    # -----------------------------------------------------------------------------------------
    # the ring and the selector warpgroup (module docstring, "Selector warpgroup")
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def ring_slot(j):
        """The ring slot of key tile ``j``: ``j mod R`` (plain ints or DSL integers)."""
        return j & (SelectSm90.RING_SLOTS - 1)

    @staticmethod
    def ring_full_parity(j):
        """The parity the selector waits for on full[slot] at tile ``j``: the slot's use
        ``j div R`` completes that barrier's phase ``j div R``."""
        return (j >> SelectSm90.RING_SHIFT) & 1

    @staticmethod
    def ring_empty_parity(j):
        """The parity the consumers wait for on empty[slot] at tile ``j``: the selector's read
        of tile ``j - R`` completed empty's phase ``j div R - 1``; for ``j < R`` parity 1, which
        a fresh barrier passes (the "previous" phase)."""
        return ((j >> SelectSm90.RING_SHIFT) + 1) & 1

    def ring_init(self, bars):
        """Initialize the ring's mbarriers (in the elected thread of warp 0 that initializes
        ``q_bar``, before the key pipeline's fence and CTA-wide sync publish them): full[s] =
        ``bars + s``, one arrival per consumer warp (8); empty[s] = ``bars + R + s``, one per
        selector warp (4)."""
        R = self.RING_SLOTS
        for s in range(R):
            cute.arch.mbarrier_init(bars + s, self.CONSUMERS // 32)
            cute.arch.mbarrier_init(bars + R + s, 4)

    def ring_tensors(self, st):
        """``(ring, bars)``: the ring of block maxima ``(TILE_M, slabs, R)`` fp32 in shared
        memory (the tile's row fastest: a warp's 32 rows are 32 banks) and its mbarriers."""
        slabs = self.TILE_N // self.block_size
        ring = st.ring.get_tensor(cute.make_layout((self.TILE_M, slabs, self.RING_SLOTS)))
        return ring, st.ring_mbar.data_ptr()

    @cute.jit
    def ring_put(self, ring, j, offers, r_tile, tidx):
        """Consumer thread: put tile ``j``'s offers of its row (``offers[block]``, the lane's
        row ``r_tile`` of the 128) into ring slot ``j % R``. Every lane waits for the slot to
        be empty (the selector's read of tile ``j - R``: empty's phase ``j // R - 1``, parity
        ``(j // R + 1) & 1``; for ``j < R`` parity 1 of a fresh barrier, which passes), one
        lane of each pair writes (both hold the row's value), then the warp's lanes sync (the
        other lanes' stores before the arrival) and one elected lane arrives on full[slot]."""
        ring_t, bars = ring
        R = self.RING_SLOTS
        slot = self.ring_slot(j)
        cute.arch.mbarrier_wait(bars + R + slot, self.ring_empty_parity(j))
        if tidx % 2 == 0:
            for sl in cutlass.range_constexpr(len(offers)):
                ring_t[r_tile, sl, slot] = offers[sl]
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(bars + slot)

    @cute.jit
    def select_rows(
        self, st, sel_regs, launch_regs, tidx, n_tiles, m_blk, mIdx, start, p, L, qm, qs, n_rows
    ):
        """Selector warpgroup: thread ``t`` keeps the top-k list of the tile's row ``t``
        (values and block numbers in registers, the whole list: no split at any top_k).
        Per key tile ``j``: wait for full[slot] (phase ``j // R``, parity ``(j // R) & 1``),
        read the row's block maxima, sync the warp (the loads before the release) and
        arrive once per warp on empty[slot]; then offer them in block order
        (:meth:`offer_row`). At the end the row's list is written out (:meth:`write_row`)."""
        if cutlass.const_expr(sel_regs < launch_regs):
            cute.arch.setmaxregister_decrease(sel_regs)
        elif cutlass.const_expr(sel_regs > launch_regs):
            cute.arch.setmaxregister_increase(sel_regs)
        R = self.RING_SLOTS
        SLABS = self.TILE_N // self.block_size
        ring_t, bars = self.ring_tensors(st)
        t = tidx - self.SELECTOR_WG * 128  # the tile's row this thread keeps
        topv = cute.make_rmem_tensor(self.top_k, Float32)
        topi = cute.make_rmem_tensor(self.top_k, Int32)
        topv.fill(-Float32.inf)
        topi.fill(-1)
        for j in cutlass.range(n_tiles, unroll=1):
            slot = self.ring_slot(j)
            cute.arch.mbarrier_wait(bars + slot, self.ring_full_parity(j))
            offers = []
            for sl in cutlass.range_constexpr(SLABS):
                offers.append(ring_t[t, sl, slot])
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(bars + R + slot)
            for sl in cutlass.range_constexpr(SLABS):
                self.offer_row(topv, topi, offers[sl], j * SLABS + sl)
        row = m_blk * self.TILE_M + t
        if cutlass.const_expr(self.qmap):  # the row's place in the group, its query row
            qrow = qm[2][qs + cutlass.min(row, n_rows - 1)]
            self.write_row(topi, mIdx, 0, qrow, p, row < n_rows)
        else:
            self.write_row(topi, mIdx, start, row, p, row < L)

    @cute.jit
    def offer_row(self, topv, topi, cv, ci):
        """Offer block ``ci`` with maximum ``cv`` to this selector thread's descending top-k
        list (``topv``, ``topi``: its row's whole list).

        Rule: the block enters at the first entry it beats strictly (ties keep the lower
        block: blocks arrive in ascending order), every later entry moves down one and the
        last one drops out. As a rank update: the list is descending, so ``c > v[t]`` is false
        up to the insertion entry and true from it on; each entry takes its new value from one
        comparison pair, independently of the others: ``v'[t] = v[t-1]`` if ``c > v[t-1]``,
        else ``c`` if ``c > v[t]``, else ``v[t]`` (per entry one compare and four selects,
        where the sequential insertion it replaced, a swap carried through the list, was a
        16-deep chain at k=16 that ptxas compiled to 151 register moves; the timings in the
        module docstring). Written from the last entry up, so that only
        two comparisons are live at once (a 64-entry list's would not fit as predicates).

        Skip: ``vote.any`` over the warp (its 32 rows) of "the candidate enters"; a thread
        whose candidate does not enter has every comparison false and keeps its list. The
        vote is warp-uniform (no divergent branch) and needs the warp converged: it is called
        at the loop's top level. The CPU replay (tests/cute_host/test_select.py) checks the
        rule against the sequential insertion, ties and ``-inf`` included."""
        H = cute.size(topv)
        if cute.arch.vote_any_sync(cv > topv[H - 1]):
            g = cv > topv[H - 1]
            for t in cutlass.range_constexpr(H - 1, -1, -1):
                v = Float32(cutlass.select_(g, cv, topv[t]))
                x = Int32(cutlass.select_(g, ci, topi[t]))
                if cutlass.const_expr(t > 0):
                    gp = cv > topv[t - 1]  # (entry t - 1 is still the old one)
                    v = Float32(cutlass.select_(gp, topv[t - 1], v))
                    x = Int32(cutlass.select_(gp, topi[t - 1], x))
                    g = gp
                topv[t] = v
                topi[t] = x

    @cute.jit
    def write_row(self, topi, mIdx, start, row, p, valid):
        """Selector thread: sort its row's kept blocks ascending (-1 last; the list is held in
        score order) and write them to row ``start + row`` of ``mIdx`` where ``valid``."""
        TOPK = self.top_k
        big = Int32(2147483647)  # -1 read as +inf by the sort
        keys = []
        for t in cutlass.range_constexpr(TOPK):
            keys.append(topi[t])
        for t in cutlass.range_constexpr(TOPK):
            keys[t] = big if keys[t] < 0 else keys[t]
        P2 = 1 << (TOPK - 1).bit_length()  # the network needs a power of two
        keys = _sort_ascending(keys + [big] * (P2 - TOPK))
        if valid:
            for t in cutlass.range_constexpr(TOPK):
                k = keys[t]
                mIdx[Int64(start + row), p, t] = -1 if k == big else k  # 64-bit offset
