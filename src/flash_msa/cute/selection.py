"""Host code of the CuTe backend's ``select``: the selection's limits beyond ``LIMITS["select"]``,
the op, the launches of :class:`~.select_sm90.SelectSm90` (:func:`select_into`,
:func:`select_fp8_into`) and the FP8 selection's quantize pass (:func:`quantize`).

The FP8 selection (``selection_precision="fp8"``): the quantize pass (the shipped key scale,
the Hadamard rotation) by :func:`quantize` (:class:`~.quantize_sm90.QuantizeSm90`, bitwise
equal to :func:`flash_msa.quant.quantize`) where :func:`quantize_reason` takes the call, else
the torch pass, then :class:`~.select_sm90.SelectSm90` on e4m3 operands
(:func:`select_fp8_into`). On the H200 the fp8 kernel runs at 741 / 1053 TFLOP/s at paper 128K
(random / local inputs, top_k 16; bf16 601 / 782) and 935 / 1180 at anchor 1M (bf16 655 / 796),
against 275-326 for Triton's fp8 selection; no row differs from Triton's fp8 selection beyond
near-ties.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

from .. import quant, worklist
from ..problem import Problem
from .common import cutlass_dtype
from .launch import aligned, bound, builder_signature, pointer_arguments, run_typed, stream
from .quantize_sm90 import OUT_ALIGN, ROW_ALIGN, SCALAR_ALIGN, QuantizeSm90
from .select_sm90 import FP8_STAGES, TILE_M, SelectSm90


def select_reason(problem: Problem) -> str | None:
    """The selection's limits beyond ``LIMITS``: its kernel's (``SelectSm90.can_implement``:
    the same table plus head ratio and shared memory) and the grid's (run-time sizes)."""
    cfg = problem.cfg
    if problem.selection_precision == "fp8":  # the e4m3 kernel, with the shipped key scale
        if problem.q_map:
            return "the CuTe fp8 selection has no query map (q_map)"
        dtype, stages, key_scale = cutlass.Float8E4M3FN, FP8_STAGES, quant.KEY_SCALE
    else:
        dtype, stages, key_scale = cutlass_dtype(problem.dtype), 4, None
    why = SelectSm90.can_implement(
        dtype, problem.proxy_head_dim, problem.num_sel_heads, problem.num_proxy_k_heads,
        cfg.top_k, cfg.block_size, stages, key_scale,
    )  # fmt: skip
    if why is not None:
        return why
    if -(-cfg.max_seqlen // TILE_M) > 65535:
        return f"max_seqlen {cfg.max_seqlen} needs more than 65535 query tiles (grid y)"
    if problem.num_seqs * problem.num_sel_heads >= 2**31:
        return "too many (sequence, proxy head) pairs for the grid"
    return None


def select(q_proxy, k_proxy, cu_seqlens, cfg, *, q_map=None):
    """Backend op ``select`` (docs/design.md): ``indices (T, Hp, top_k)`` int32, ascending
    sequence-local block numbers, -1 in unused slots (:func:`select_into` a new tensor); with
    ``q_map`` ``(Tq, Hp, top_k)``, all -1 for a padding row.

    ``cfg.selection_precision == "fp8"``: the quantize pass (module docstring), then
    :func:`select_fp8_into`; no query map."""
    T, Hp, _ = q_proxy.shape
    shape, dev = (T, Hp, cfg.top_k), q_proxy.device
    if cfg.selection_precision == "fp8":
        if q_map is not None:
            raise ValueError("CuTe fp8 selection: no query map (q_map) in the fp8 kernel")
        b = cfg.block_size
        if quantize_reason(q_proxy, k_proxy, b) is None:
            qz = quantize(q_proxy, k_proxy, cu_seqlens, b, max_seqlen=cfg.max_seqlen)
        else:  # the named fallback: the torch pass (same bits)
            qz = quant.quantize(q_proxy, k_proxy, cu_seqlens, b)
        idx = torch.empty(shape, dtype=torch.int32, device=dev)
        return select_fp8_into(idx, qz, cu_seqlens, cfg)
    if q_map is None:
        idx = torch.empty(shape, dtype=torch.int32, device=dev)
    else:  # padding rows are never visited
        idx = torch.full(shape, -1, dtype=torch.int32, device=dev)
    return select_into(idx, q_proxy, k_proxy, cu_seqlens, cfg, q_map=q_map)


# ---------------------------------------------------------------------------------------------
# the selection kernel's launches: torch tensors in, indices out
# ---------------------------------------------------------------------------------------------
def select_into(
    indices, q_proxy, k_proxy, cu_seqlens, cfg, *, stages: int = SelectSm90.stages, q_map=None
):
    """Write the selection into ``indices`` ``(T, Hp, top_k)`` int32 (every entry is written):
    ascending sequence-local block numbers, -1 in unused slots. Returns ``indices``.

    ``q_proxy (T, Hp, Dp)``, ``k_proxy (T, Hpk, Dp)`` contiguous bf16/fp16 CUDA tensors,
    ``cu_seqlens (N+1,)`` int32; ``cfg.max_seqlen`` bounds the grid (no host synchronization).
    ``stages``: the kernel's pipeline depth (default ``SelectSm90.stages``, the shipped one;
    another depth gives the same indices: tests/ops/test_fwd.py).
    ``q_map``: ``None`` or ``(Tq,)`` int32 (the contract's query map): ``q_proxy`` and
    ``indices`` have ``Tq`` rows, ``k_proxy`` the keys' ``T``; every entry of a mapped row is
    written, those of padding rows (``-1``) are left as they are (:func:`select` fills them
    with -1). The exact selection only:
    ``cfg.selection_precision == "fp8"`` raises (:func:`select_fp8_into` is that one).
    """
    if cfg.selection_precision != "bf16":
        raise ValueError(
            f"CuTe selection: select_into is the exact selection, cfg.selection_precision is "
            f"{cfg.selection_precision!r} (select or select_fp8_into run the fp8 one)"
        )
    T, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[1]
    K = cfg.top_k
    kernel = SelectSm90(
        cutlass_dtype(q_proxy.dtype), Dp, Hp, Hpk, K, cfg.block_size, stages, q_map is not None
    )
    _check_indices(indices, T, Hp, K)
    if T == 0:
        return indices
    rows = cfg.max_seqlen  # query rows per sequence: at most its tokens
    extra = ()
    if q_map is not None:
        if q_map.shape != (T,) or q_map.dtype != torch.int32 or q_map.device != q_proxy.device:
            raise ValueError(
                f"CuTe selection: q_map must be an int32 ({T},) tensor on {q_proxy.device}, got "
                f"{q_map.dtype} {tuple(q_map.shape)} on {q_map.device}"
            )
        order = worklist.query_order(q_map, cu_seqlens, k_proxy.shape[0])
        maps = (aligned(q_map.contiguous()), order.rows, order.seq_start)
        extra = tuple(aligned(x) for x in maps)
        rows = min(T, cfg.max_seqlen)  # and at most the query rows (a host bound: no sync)
    _launch(kernel, q_proxy, k_proxy, cu_seqlens, indices, rows, *extra)
    return indices


def select_fp8_into(indices, quantized, cu_seqlens, cfg, *, stages: int = FP8_STAGES):
    """The fp8 selection (``selection_precision="fp8"``) of quantized operands into
    ``indices`` ``(T, Hp, top_k)`` int32 (every entry written, as :func:`select_into`).
    Returns ``indices``.

    ``quantized``: :class:`flash_msa.quant.Quantized` of :func:`flash_msa.quant.quantize`
    with ``cfg.block_size`` (its block scales are per selection block): e4m3 ``q (T, Hp, Dp)``
    and ``k (T, Hpk, Dp)``, fp32 ``k_scale (T, Hpk)`` on one CUDA device, per block or per token
    (``key_scale``, compiled in); ``q_scale`` is not read (a positive row constant). No query
    map. ``stages``: the key-pipeline depth (default :data:`FP8_STAGES`, the shipped one).
    """
    qz = quantized
    for name, x in (("q", qz.q), ("k", qz.k)):  # before their shapes are read
        if x.dim() != 3:
            raise ValueError(
                f"CuTe fp8 selection: quantized.{name} must be 3-D (T, heads, Dp), got "
                f"{tuple(x.shape)}"
            )
    T, Hp, Dp = qz.q.shape
    Hpk = qz.k.shape[1]
    K = cfg.top_k
    for name, x in (("q", qz.q), ("k", qz.k)):
        if x.dtype != quant.E4M3 or x.dim() != 3 or x.shape[0] != T or x.shape[2] != Dp:
            raise ValueError(
                f"CuTe fp8 selection: quantized.{name} must be e4m3 ({T}, heads, {Dp}), got "
                f"{x.dtype} {tuple(x.shape)}"
            )
    if qz.k_scale.dtype != torch.float32 or tuple(qz.k_scale.shape) != (T, Hpk):
        raise ValueError(
            f"CuTe fp8 selection: quantized.k_scale must be fp32 ({T}, {Hpk}), got "
            f"{qz.k_scale.dtype} {tuple(qz.k_scale.shape)}"
        )
    kernel = SelectSm90(
        cutlass.Float8E4M3FN, Dp, Hp, Hpk, K, cfg.block_size, stages, key_scale=qz.key_scale
    )
    _check_indices(indices, T, Hp, K)
    if T == 0:
        return indices
    scales = aligned(qz.k_scale.contiguous())
    q, k = qz.q.contiguous(), qz.k.contiguous()
    _launch(kernel, q, k, cu_seqlens, indices, cfg.max_seqlen, scales)
    return indices


def _check_indices(indices, T, Hp, K):
    """Raise ValueError unless ``indices`` is a contiguous, 16-byte aligned int32 ``(T, Hp,
    K)`` tensor (the kernel writes it through a 16-byte aligned view)."""
    if tuple(indices.shape) != (T, Hp, K) or indices.dtype != torch.int32:
        raise ValueError(
            f"CuTe selection: indices must be an int32 ({T}, {Hp}, {K}) tensor, got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if not indices.is_contiguous() or indices.data_ptr() % 16:
        raise ValueError("CuTe selection: indices must be contiguous and 16-byte aligned")


def _launch(kernel, q, k, cu_seqlens, indices, rows, *mode_tensors):
    """Run ``kernel`` on ``q (Tq, Hp, Dp)``, ``k (T, Hpk, Dp)`` (contiguous), its grid's y
    bounding ``rows`` query rows per sequence; ``mode_tensors`` the query map's three or the
    key scales (:func:`launch_tensor_names`)."""
    tensors = (
        aligned(q.contiguous()).permute(0, 2, 1),  # (T, Dp, Hp): a TMA box = one head
        aligned(k.contiguous()).permute(0, 2, 1),
        aligned(cu_seqlens),  # (copied only where a slice is not 16-byte aligned)
        indices,
        *mode_tensors,
    )
    n_mblk = max(1, -(-rows // TILE_M))
    kernel, args = select_arguments(kernel, tensors, n_mblk, stream(q.device))
    run_typed(kernel, q.device, args, SELECT_SIGNATURE)


def launch_tensor_names(kernel: SelectSm90) -> tuple[str, ...]:
    """The launch's tensors, in the order of ``kernel.views`` and its ``__call__``'s pointers:
    q_proxy, k_proxy, cu_seqlens, indices (+ q_map, rows, seq_start with
    :attr:`~SelectSm90.qmap`; + k_scale in the FP8 mode)."""
    if kernel.key_scale is not None:
        return (*_TENSORS, "k_scale")
    return (*_TENSORS, "q_map", "rows", "seq_start") if kernel.qmap else _TENSORS


_TENSORS = ("q_proxy", "k_proxy", "cu_seqlens", "indices")


def select_arguments(kernel: SelectSm90, tensors, n_mblk: int, strm):
    """``(kernel', args)`` of a launch of ``kernel``: ``tensors`` the torch tensors of
    :func:`launch_tensor_names` laid out as its ``__call__`` takes them (the proxy tensors as
    ``(T, Dp, heads)`` views), ``n_mblk`` the grid's y, ``strm`` the stream. ``kernel'`` is
    ``kernel`` with ``views`` set to the tensors' layouts (``launch.view_layout``: what their
    CuTe views baked in, element types too), ``args`` its ``__call__``'s arguments: typed
    pointers and mode-0 sizes (``launch.pointer_arguments``: ~1 us a tensor instead of a
    DLPack view's 10-40 us), ``Int32(n_mblk)``, the stream; :func:`~.launch.run_typed` keys
    the compile cache on ``kernel'`` alone. ValueError (naming the tensor) for a wrong tensor
    count, a base that is not 16-byte aligned, a tensor on another device than q_proxy, or a
    layout whose view would have a run-time stride."""
    names = launch_tensor_names(kernel)
    if len(tensors) != len(names):
        raise ValueError(f"CuTe selection: {len(tensors)} launch tensors, {len(names)} expected")
    views, pointers = pointer_arguments("CuTe selection", names, tensors, tensors[0].device)
    return bound(kernel, views), (pointers, Int32(n_mblk), strm)


# the disk cache's text for the argument types (the kernel object, its views included, and
# the kernel's module are in the key already); launches go through launch.run_typed
SELECT_SIGNATURE = builder_signature(select_arguments)


# ---------------------------------------------------------------------------------------------
# the quantize pass: torch tensors in, quant.Quantized out
# ---------------------------------------------------------------------------------------------
def quantize_reason(q_proxy, k_proxy, block_size, key_scale=quant.KEY_SCALE):
    """Why :func:`quantize` cannot run this call on the kernel (``None``: it can): CUDA tensors
    ``q_proxy (T, Hp, Dp)``, ``k_proxy (T, Hpk, Dp)`` of one device and dtype (bf16 or fp16),
    the same tokens, Dp and ``block_size`` the kernel's (:meth:`QuantizeSm90.can_implement`).
    :func:`select`'s fp8 branch asks this, else the torch pass runs."""
    for name, x in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor, not {type(x).__name__}"
        if x.dim() != 3:
            return f"{name} must be 3-D (T, heads, Dp), got shape {tuple(x.shape)}"
    if k_proxy.dtype != q_proxy.dtype:
        return f"q_proxy and k_proxy must share a dtype, got {q_proxy.dtype} and {k_proxy.dtype}"
    if k_proxy.shape[0] != q_proxy.shape[0] or k_proxy.shape[2] != q_proxy.shape[2]:
        return (
            f"q_proxy (T, Hp, Dp) and k_proxy (T, Hpk, Dp) must have the same T and Dp, got "
            f"{tuple(q_proxy.shape)} and {tuple(k_proxy.shape)}"
        )
    _, Hp, Dp = q_proxy.shape
    why = QuantizeSm90.can_implement(
        cutlass_dtype(q_proxy.dtype), Dp, Hp, k_proxy.shape[1], block_size, key_scale
    )
    if why is None and (q_proxy.device.type != "cuda" or k_proxy.device != q_proxy.device):
        devices = f"{q_proxy.device} and {k_proxy.device}"
        why = f"q_proxy and k_proxy must be on one CUDA device, got {devices}"
    return why


def quantize(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    key_scale: str = quant.KEY_SCALE,
    *,
    max_seqlen: int | None = None,
    out: tuple | None = None,
) -> quant.Quantized:
    """:func:`flash_msa.quant.quantize` by the kernel :class:`~.quantize_sm90.QuantizeSm90`: the
    same :class:`~flash_msa.quant.Quantized`, bit for bit (``quantize_sm90``'s docstring).

    Args:
        q_proxy: ``(T, Hp, Dp)``, k_proxy: ``(T, Hpk, Dp)``: bf16 or fp16 CUDA tensors (packed
            tokens; copied if not contiguous or not 16-byte aligned).
        cu_seqlens: ``(N+1,)`` int32 on their device, ``cu_seqlens[N] == T``.
        block_size: the selection's key block (64 or 128).
        key_scale: ``"block"`` or ``"token"``.
        max_seqlen: at least the longest sequence's length (bounds the grid: ``N *
            ceil(max_seqlen / block_size)`` CTAs; rows past it would be left unwritten, so it
            must not be smaller, as for the selection's ``cfg.max_seqlen``); ``None`` reads it
            from ``cu_seqlens`` (a host synchronization).
        out: ``(q8, q_scale, k8, k_scale)`` to write into (e4m3 ``(T, Hp, Dp)``, fp32 ``(T,
            Hp)``, e4m3 ``(T, Hpk, Dp)``, fp32 ``(T, Hpk)``, contiguous), else new tensors.
    Raises:
        TypeError / ValueError naming the argument (:func:`quantize_reason`'s reasons too).
    """
    for name, x in (("q_proxy", q_proxy), ("k_proxy", k_proxy), ("cu_seqlens", cu_seqlens)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"CuTe quantize: {name} must be a torch.Tensor, not {type(x).__name__}")
    for name, v in (("block_size", block_size), ("max_seqlen", max_seqlen)):
        if (v is not None or name == "block_size") and (
            not isinstance(v, int) or isinstance(v, bool)
        ):
            raise TypeError(f"CuTe quantize: {name} must be an int, not {type(v).__name__}")
    if not isinstance(key_scale, str):
        raise TypeError(f"CuTe quantize: key_scale must be a str, not {type(key_scale).__name__}")
    why = quantize_reason(q_proxy, k_proxy, block_size, key_scale)
    if why is not None:
        raise ValueError(f"CuTe quantize: {why}")
    T, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[1]
    dev = q_proxy.device
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"CuTe quantize: cu_seqlens must be a 1-D int32 (N+1,) tensor, got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != dev:
        raise ValueError(f"CuTe quantize: cu_seqlens must be on {dev}, got {cu_seqlens.device}")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    if max_seqlen < (1 if T else 0):
        raise ValueError(f"CuTe quantize: max_seqlen must be >= 1 for T = {T}, got {max_seqlen}")
    kernel = QuantizeSm90(cutlass_dtype(q_proxy.dtype), Dp, Hp, Hpk, block_size, key_scale)
    e4m3, f32 = quant.E4M3, torch.float32
    want = (((T, Hp, Dp), e4m3), ((T, Hp), f32), ((T, Hpk, Dp), e4m3), ((T, Hpk), f32))
    names = ("q8", "q_scale", "k8", "k_scale")
    if out is None:
        out = tuple(torch.empty(shape, dtype=dt, device=dev) for shape, dt in want)
    elif not isinstance(out, (tuple, list)) or len(out) != 4:
        raise TypeError("CuTe quantize: out must be a tuple (q8, q_scale, k8, k_scale)")
    for name, x, (shape, dt) in zip(names, out, want):
        align = OUT_ALIGN if dt == e4m3 else SCALAR_ALIGN
        if (
            not isinstance(x, torch.Tensor) or x.dtype != dt or tuple(x.shape) != shape
            or x.device != dev or not x.is_contiguous() or x.data_ptr() % align
        ):  # fmt: skip
            got = f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else x
            raise ValueError(
                f"CuTe quantize: out's {name} must be a contiguous, {align}-byte aligned {dt} "
                f"{shape} tensor on {dev}, got {got}"
            )
    q8, q_scale, k8, k_scale = out
    result = quant.Quantized(q8, q_scale, k8, k_scale, key_scale)
    n_seq = cu_seqlens.shape[0] - 1
    blocks = -(-max_seqlen // block_size)
    if T == 0 or n_seq == 0 or blocks == 0:
        return result
    if n_seq * blocks >= 2**31:
        raise ValueError(
            f"CuTe quantize: N * ceil(max_seqlen / block_size) = {n_seq * blocks} CTAs exceed "
            "the grid's 2^31 - 1"
        )
    q = aligned(q_proxy.contiguous())
    k = aligned(k_proxy.contiguous())
    cu = aligned(cu_seqlens.contiguous())
    args = quantize_arguments(
        kernel, q.data_ptr(), k.data_ptr(), cu.data_ptr(), q8.data_ptr(), q_scale.data_ptr(),
        k8.data_ptr(), k_scale.data_ptr(), n_seq, blocks, stream(dev),
    )  # fmt: skip
    run_typed(kernel, dev, args, QUANTIZE_SIGNATURE)
    return result


def quantize_arguments(
    kernel: QuantizeSm90, q, k, cu, q8, q_scale, k8, k_scale, n_seq, blocks, strm
):
    """The arguments of a launch of ``kernel`` (its ``__call__``): the seven buffers' device
    addresses (ints) as typed pointers of the alignments the kernel assumes, the sequence count,
    the key blocks per sequence and the stream. The types depend on ``kernel`` alone, so the
    compile cache keys on the kernel object and the compile check compiles what runs
    (``compile_check.compile_quantize``)."""
    gmem = cute.AddressSpace.gmem
    e4m3 = cutlass.Float8E4M3FN
    return (
        make_ptr(kernel.dtype, q, gmem, assumed_align=ROW_ALIGN),
        make_ptr(kernel.dtype, k, gmem, assumed_align=ROW_ALIGN),
        make_ptr(Int32, cu, gmem, assumed_align=SCALAR_ALIGN),
        make_ptr(e4m3, q8, gmem, assumed_align=OUT_ALIGN),
        make_ptr(Float32, q_scale, gmem, assumed_align=SCALAR_ALIGN),
        make_ptr(e4m3, k8, gmem, assumed_align=OUT_ALIGN),
        make_ptr(Float32, k_scale, gmem, assumed_align=SCALAR_ALIGN),
        Int32(n_seq),
        Int32(blocks),
        strm,
    )


# the disk cache's text for the argument types (the kernel object and the kernel's module are
# in the key already); launches go through launch.run_typed
QUANTIZE_SIGNATURE = builder_signature(quantize_arguments)
