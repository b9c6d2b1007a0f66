"""The sparse forward's combine on Hopper (sm_90a) in CuTe DSL: merge per-block partials by LSE.

NOT REGISTERED YET (off until its first H200 run, tests/test_gpu_cute_combine.py and
benchmarks/combine_ab.py). To switch it on, ``flash_msa/cute/__init__.py`` gets a switch
``COMBINE_ON_CUTE`` like ``KL_ON_CUTE`` and ``forward_stages`` passes
``combine=combine_sm90.combine`` when it is on and :func:`combine_fits` holds for the call.

Driver stage ``combine(o_part, l_part, idx, out, lse)`` of :mod:`flash_msa.sparse_forward` (its
docstring has the partial-buffer contract). For a chunk of C tokens and a row ``(t, h)``, its K
slots ``s`` (selection head ``h // (H / Hs)`` of ``idx (C, Hs, K)``; a slot with index -1 is
unused: its partial row was never written and is never read here) are merged as the Triton
stage (``triton_ref/sparse_fwd.py``: ``_combine_kernel``) merges them:

    l_s   = l_part[t, h, s] on used slots, -inf on unused ones
    m     = max_s l_s (0 if every l_s is -inf)
    w_s   = exp(l_s - m),  l = sum_s w_s
    lse   = m + log(l), or -inf when l = 0 (no visible key: also a padding row of a q_map)
    out   = sum_s w_s * o_part[t, h, s] / l, or 0 when l = 0; o_part is read only where
            w_s > 0 (a partial over no visible key has l_s = -inf and is not read either)

With ``o_part = out = None`` only the LSE (the proxy LSE: ``l_part = pl_part (C, Hs, K)``,
``lse = proxy_lse``). fp32 arithmetic; deterministic (no atomics, a fixed order).

Mapping: one warp per ``(t, h)`` row, rows in ``(t, h)`` order (consecutive warps share the
token's index row and read adjacent partial rows); ``warps`` warps per CTA, a 1D grid over the
chunk's ``C * H`` rows. Lane ``s`` loads slot ``s``'s index and, if it is used, its LSE (lanes
``s`` and ``s + 32`` for K > 32); the warp reduces max and sum by butterfly shuffles. For the
output, a partial row of D elements is D/8 pieces of 16 bytes: lane ``i`` loads piece
``i % (D/8)`` of slots ``i // (D/8) + (32 / (D/8)) * j`` (a warp's load instruction reads 512
contiguous bytes: two slots at D = 128, four at D = 64; K/2 resp. K/4 16-byte loads per lane,
issued in batches of up to 8 before their sums), takes its slot's weight from the owning lane by
shuffle, accumulates in fp32; the slot groups add up by butterfly shuffles and the first D/8
lanes store the row, one 16-byte store each. A slot of weight 0 loads a weight-1 slot's row in
its place (:meth:`CombineSm90.merge_o` says why). The LSE-only mode packs 32 / K' rows into a
warp (K' = K rounded up to a power of two, <= 32).

Bytes (memory-bound: a handful of flops per loaded byte): per token, with e the element size,
``H * K * (D * e + 4)`` partials read + ``Hs * K * 4`` indices + ``H * (D * e + 4)`` written,
i.e. at the anchor layout (H 16, Hs 4, K 16, D 128, bf16) 70,976 B per token (1.16 GB for 16K
tokens: 0.24 ms at the H200's ~4.8 TB/s HBM bound, ~0.27 ms at the ~4.3 TB/s device copy rate
measured there), at the paper layout (H 64) 283,136 B per token (2.32 GB for one 8192-token
chunk of 128K: 0.48 ms at 4.8 TB/s). Unused slots cost nothing but their index (early tokens
of a sequence have fewer than K blocks). The proxy LSE (H = Hs, no O) reads ``Hs * K * 8`` B per
token (+ Hs * 4 written): 528 B at Hs 4, K 16 (8.7 MB for 16K tokens: microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64

from .common import aligned, cute_tensor, cutlass_dtype, run, stream

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_TOPK = 64  # slots per row: lane s and s + 32 own a slot's weight (the selection's limit)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class CombineSm90:
    """The combine of one chunk's partials (module docstring), one static configuration; the
    fields are all of it (the compile cache keys on the object).

    Run-time values: the chunk's token count C (the rows ``C * heads``)."""

    dtype: type[cutlass.Numeric] | None  # BFloat16 or Float16: o_part and out; None: LSE only
    heads: int  # H: rows per token of l_part / lse (Hs for the proxy LSE)
    sel_heads: int  # Hs: index rows per token; row h reads index row h // (H / Hs)
    top_k: int  # K: slots per row
    head_dim: int  # D of o_part / out (0 without O)
    has_o: bool  # False: the LSE only (o_part and out absent)
    # warps per CTA (one row each). A tuning choice, not yet measured on the H200
    # (benchmarks/combine_ab.py --warps)
    warps: int = 4

    PIECE: ClassVar[int] = 8  # elements per 16-byte piece of a 2-byte dtype
    # 16-byte loads per lane issued before their sums: all 32 of K 64, D 128 at once took 255
    # registers and spilled 24 bytes (a 64-bit address per load); batches of 8: 110, no spill
    BATCH: ClassVar[int] = 8

    # -----------------------------------------------------------------------------------------
    # static limits
    # -----------------------------------------------------------------------------------------
    @classmethod
    def can_implement(cls, dtype, heads, sel_heads, top_k, head_dim, has_o, warps=4) -> str | None:
        """Why this configuration cannot be compiled or run (``None``: it can). No shared
        memory; registers: at most K / (32 / (D / 8)) 16-byte loads in flight per lane (32 at
        K 64, D 128; compile_combine asserts no spills)."""
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
        return None

    def __post_init__(self):
        why = self.can_implement(
            self.dtype, self.heads, self.sel_heads, self.top_k, self.head_dim, self.has_o,
            self.warps,
        )  # fmt: skip
        if why is not None:
            raise ValueError(f"CuTe combine: {why}")

    @property
    def row_lanes(self) -> int:
        """Lanes per row: the whole warp with O; else K rounded up to a power of two (<= 32)."""
        return 32 if self.has_o else min(32, _pow2_at_least(self.top_k))

    @property
    def rows_per_cta(self) -> int:
        return self.warps * (32 // self.row_lanes)

    # -----------------------------------------------------------------------------------------
    # host: launch
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mL: cute.Tensor,
        mIdx: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """Launch over the ``C * H`` rows of ``mLse``: ``mO (C*H*K*D,)`` partial outputs,
        ``mL (C*H*K,)`` fp32 partial LSEs, ``mIdx (C*Hs*K,)`` int32 indices, ``mOut (C*H*D,)``,
        ``mLse (C*H,)`` fp32 (without O, ``mO`` and ``mOut`` are unused placeholders)."""
        if cutlass.const_expr(self.has_o):
            assert mO.element_type == self.dtype and mOut.element_type == self.dtype
        assert mL.element_type == Float32 and mLse.element_type == Float32
        assert mIdx.element_type == Int32
        per_cta = self.rows_per_cta
        grid = ((mLse.shape[0] + per_cta - 1) // per_cta, 1, 1)
        self.kernel(mO, mL, mIdx, mOut, mLse).launch(
            grid=grid, block=(32 * self.warps, 1, 1), stream=stream
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
    ):
        H, K = self.heads, self.top_k
        G = self.heads // self.sel_heads
        RL = self.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        n_rows = mLse.shape[0]
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
            if cutlass.const_expr(RL * (j + 1) <= K):  # every lane's slot exists
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
        off = RL // 2
        while off >= 1:  # trace-time loop: butterfly within the row's lane group
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
            off //= 2
        mx = Float32(0.0) if mx == -Float32.inf else mx  # a row with no visible key
        w = []
        lsum = Float32(0.0)
        for j in cutlass.range_constexpr(len(lv)):
            wj = cute.math.exp2((lv[j] - mx) * LOG2E, fastmath=True)  # exp(-inf) = 0
            w.append(wj)
            lsum += wj
        off = RL // 2
        while off >= 1:
            lsum += cute.arch.shuffle_sync_bfly(lsum, offset=off)
            off //= 2
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
        """``out[row] = sum_s w_s o_part[row, s] / l`` (0 when ``l = 0``) by this warp: lane
        ``lane`` loads piece ``lane % (D/8)`` of slots ``lane // (D/8) + SG * i`` (SG = 32 /
        (D/8) slot groups), the groups add up by butterfly shuffles, the first D/8 lanes store.

        A slot of weight 0 (unused, no visible key, or underflow) loads the row of a slot of
        weight 1 instead (the first with ``l_s = m``: written, finite; an L1/L2 hit, as its own
        group reads it) and adds 0 times it. So the loads need no predicate: with one per slot
        (``if w_s > 0``) ptxas kept each predicate alive through the slot's bf16 conversion
        and had 5 of the 8 loads of K 16, D 128 in flight, the other 3 one latency later (K 64:
        5 at a time; SASS read on the compiled kernels; 7 predicate registers, the likely
        limit). Now all 8 are issued back to back (K 64: batches of 8, ``BATCH``). A row
        with no visible key (``l = 0``) loads nothing (a warp-uniform branch)."""
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
            for b0 in cutlass.range_constexpr(0, NS, self.BATCH):
                ws_all = []
                vals_all = []
                for i in cutlass.range_constexpr(b0, min(NS, b0 + self.BATCH)):
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
def combine_fits(dtype: torch.dtype, H: int, Hs: int, K: int, D: int) -> bool:
    """Whether :func:`combine` can run a forward with these inputs (both its calls: the main
    partials and the proxy LSE): the switch in ``cute.forward_stages`` asks this, else the
    driver borrows Triton's combine."""
    main = CombineSm90.can_implement(cutlass_dtype(dtype), H, Hs, K, D, True)
    proxy = CombineSm90.can_implement(None, Hs, Hs, K, 0, False)
    return main is None and proxy is None


def _contiguous_prefix(name: str, buf: torch.Tensor, C: int, shape: tuple, dtype) -> torch.Tensor:
    """``buf[:C]`` flattened, after checking the contract's buffer (ValueError naming it)."""
    if (
        buf.dtype != dtype
        or buf.dim() != len(shape) + 1
        or tuple(buf.shape[1:]) != shape
        or buf.shape[0] < C
        or not buf.is_contiguous()
        or buf.data_ptr() % 16
    ):
        raise ValueError(
            f"CuTe combine: {name} must be a contiguous, 16-byte aligned {dtype} (>= {C}, "
            f"{', '.join(map(str, shape))}) buffer; got {buf.dtype} {tuple(buf.shape)}, "
            f"strides {buf.stride()}, address % 16 = {buf.data_ptr() % 16}"
        )
    return buf[:C].view(-1)


def _output(name: str, buf: torch.Tensor, shape: tuple, dtype) -> torch.Tensor:
    """``buf`` itself if the kernel can write it in place (contiguous, 16-byte aligned), else
    a fresh buffer the caller copies back (a chunk's slice of ``lse`` may start mid-vector)."""
    if buf.dtype != dtype or tuple(buf.shape) != shape:
        raise ValueError(
            f"CuTe combine: {name} must be a {dtype} {shape} tensor, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    if buf.is_contiguous() and buf.data_ptr() % 16 == 0:
        return buf
    return torch.empty(shape, dtype=dtype, device=buf.device)


def combine(o_part, l_part, idx, out, lse, *, warps: int = CombineSm90.warps):
    """Driver stage ``combine`` (:mod:`flash_msa.sparse_forward`): merge the chunk's partials
    ``o_part (>= C, H, K, D)`` (input dtype) and ``l_part (>= C, H, K)`` fp32 by their LSE into
    ``out (C, H, D)`` and ``lse (C, H)`` fp32, C = ``idx.shape[0]``, ``idx (C, Hs, K)`` int32
    (-1: unused slot, never read). With ``o_part`` and ``out`` ``None`` the LSE only (the proxy
    LSE: ``l_part = pl_part (>= C, Hs, K)``, ``lse = proxy_lse``). ``warps``: the kernel's
    constructor argument (A/B runs; the default is the shipped one)."""
    has_o = o_part is not None
    if has_o != (out is not None):
        raise ValueError("CuTe combine: o_part and out are both given or both None")
    if idx.dtype != torch.int32 or idx.dim() != 3:
        raise ValueError(f"CuTe combine: idx must be int32 (C, Hs, K), got {idx.dtype} "
                         f"{tuple(idx.shape)}")  # fmt: skip
    C, Hs, K = idx.shape
    if lse.dim() != 2:
        raise ValueError(f"CuTe combine: lse must be (C, H), got {tuple(lse.shape)}")
    H = lse.shape[1]
    D = out.shape[-1] if has_o else 0
    kernel = CombineSm90(cutlass_dtype(out.dtype) if has_o else None, H, Hs, K, D, has_o, warps)
    if C * H * K >= 2**31:  # the kernel's LSE and index offsets are int32
        raise ValueError(f"CuTe combine: C * H * K = {C * H * K} partial rows exceed 2^31 - 1")
    l_flat = _contiguous_prefix("l_part", l_part, C, (H, K), torch.float32)
    lse_buf = _output("lse", lse, (C, H), torch.float32)
    if has_o:
        o_flat = _contiguous_prefix("o_part", o_part, C, (H, K, D), out.dtype)
        out_buf = _output("out", out, (C, H, D), out.dtype)
    if C == 0:
        return
    mL, mLse = cute_tensor(l_flat), cute_tensor(lse_buf.view(-1))
    mO, mOut = (cute_tensor(o_flat), cute_tensor(out_buf.view(-1))) if has_o else (mL, mLse)
    run(
        kernel,
        lse.device,
        mO,
        mL,
        cute_tensor(aligned(idx.contiguous()).view(-1)),
        mOut,
        mLse,
        stream(lse.device),
    )
    if lse_buf is not lse:
        lse.copy_(lse_buf)
    if has_o and out_buf is not out:
        out.copy_(out_buf)


# ---------------------------------------------------------------------------------------------
# compile check (no GPU): hooked into flash_msa.cute.compile_check by the lead
# ---------------------------------------------------------------------------------------------
def combine_configurations():
    """(name, dtype, H, Hs, K, D, has_o) of the combine kernels checked: bf16 and fp16, D 64
    and 128, K 8, 16 and 64, H 16 (anchor) and 64 (paper) over Hs 4; and the LSE-only mode
    (the proxy LSE: H = Hs; once with H > Hs)."""
    for dtype in ("bf16", "fp16"):
        for D in (64, 128):
            for K in (8, 16, 64):
                for H in (16, 64):
                    yield f"combine {dtype} H={H} Hs=4 K={K} D={D}", dtype, H, 4, K, D, True
    for K in (8, 16, 64):
        yield f"combine lse-only H=4 Hs=4 K={K}", None, 4, 4, K, 0, False
    yield "combine lse-only H=16 Hs=4 K=16", None, 16, 4, 16, 0, False


def compile_combine(dtype, H, Hs, K, D, has_o, warps=CombineSm90.warps, *, dump=None, name=""):
    """Compile :class:`CombineSm90` for sm_90a on specimen tensors of the layouts
    :func:`combine` passes; returns cuobjdump's ``{"reg", "stack", "local"}`` (spills show as
    stack) like ``compile_check``'s other kernels, with ``wgmma``/``tma`` False. ``dump``: a
    folder for ``<name>.ptx`` / ``.cubin``. The DSL's own copies of the artifacts go to a
    temporary folder (``--dump-dir``: ``CUTE_DSL_DUMP_DIR`` is read once per process)."""
    import os
    import tempfile

    from cutlass import BFloat16, Float16
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from ..cubin import resources

    dt = {"bf16": BFloat16, "fp16": Float16, None: None}[dtype]
    kernel = CombineSm90(dt, H, Hs, K, D, has_o, warps)
    sym = cute.sym_int32

    def flat(ty, n):
        return make_fake_compact_tensor(ty, (sym(symbol=n),), assumed_align=16)

    mL, mLse = flat(Float32, "CHK"), flat(Float32, "CH")
    mO, mOut = (flat(dt, "CHKD"), flat(dt, "CHD")) if has_o else (mL, mLse)
    with tempfile.TemporaryDirectory() as tmp:
        c = cute.compile(
            kernel, mO, mL, flat(Int32, "CSK"), mOut, mLse, make_fake_stream(),
            options=f"--gpu-arch sm_90a --keep-cubin --keep-ptx --dump-dir={tmp}",
        )  # fmt: skip
        ptx, cubin = c.artifacts.PTX, c.artifacts.CUBIN
    if dump:
        stem = os.path.join(dump, name.replace(" ", "_"))
        with open(stem + ".ptx", "w") as f:
            f.write(ptx)
        with open(stem + ".cubin", "wb") as f:
            f.write(cubin)
    return dict(resources(cubin), wgmma=False, tma=False)


def _main() -> int:  # python -m flash_msa.cute.combine_sm90: compile every configuration
    import json

    bad = 0
    for name, *cfg in combine_configurations():
        res = compile_combine(*cfg, name=name)
        bad += res["stack"] > 0 or res["local"] > 0
        print(json.dumps(dict(kernel=name, **res)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(_main())
