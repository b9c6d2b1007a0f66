"""FP8 (e4m3) quantization of the proxy operands for approximate selection.

``selection_precision="fp8"`` ranks key blocks by scores of e4m3 operands with fp32
accumulation: what an FP8 tensor-core selection computes. This module is the quantize pass
(plain torch, any device) that every fp8 selection reads, the torch reference
(:func:`flash_msa.reference.select`), the Triton oracle (``triton_ref/selection_fp8.py``) and
the SM90 kernel alike, so that they differ only in how they sum the e4m3 products: the
reference in fp32; FP8 tensor cores on Hopper accumulate with about 22 bits (the low bits
truncated, as DeepGEMM and SageAttention2 measured), over a chain of at most Dp/32 = 4 wgmma
steps here, so kernel scores are slightly less exact than fp32 and may swap near-tie blocks.

What is quantized, and why (CPU torch-reference measurements, anchor heads, ``Dp = 128``,
S 4096, 3 seeds, recall of the bf16 selection: ``benchmarks/fp8_recall.py``, the numbers in
docs/algorithm.md, "FP8 selection: semantics and recall"):

- ``k_proxy``: e4m3 with one fp32 scale per (proxy key head, key block) (``KEY_SCALE =
  "block"``): ``amax`` over the block's tokens and channels / 448. The block is the
  selection's (sequence-local, ``block_size`` tokens), so the scale multiplies the block's
  already pooled maximum, ``max_j(s_b * acc_j) = s_b * max_j(acc_j)`` for ``s_b > 0``: exact,
  and one multiply per (row, block) instead of one per score. ``"token"`` (one scale per key
  token, DeepGEMM's indexer) multiplies each score before the max. The two recall the same
  (random with outlier channels 99.25 % vs 99.32 %, local 98.53 % vs 98.64 %); e4m3 is a
  floating-point format, so a token 100x smaller than its block's largest keeps its 3 mantissa
  bits either way. The scales are stored per token, ``(T, Hpk)``; a block's tokens
  all hold its scale (a kernel reads it at the block's first token), so both granularities
  share one layout.
- ``q_proxy``: e4m3 with one fp32 scale per (query row, proxy head). It is **not applied** when
  ranking: it multiplies every block score of that row by the same positive number, which
  cannot change the row's order, and leaving it out also cannot turn two different fp32
  scores into a rounded tie. ``proxy_scale`` is left out for the same reason.
- Rotation: both operands times an orthonormal Walsh-Hadamard matrix (:func:`hadamard`)
  before quantizing, as DeepSeek-V3.2's indexer does; ``q H (k H)^T = q k^T``. An outlier
  channel concentrates a dot product in a few large terms whose rounding errors (up to 2^-4
  relative each) do not average out; rotated, the product is spread over all ``Dp`` terms. The
  cost is a ``Dp x Dp`` product per token and head in the quantize pass.

Values: ``x / scale`` is clamped to ``[-448, 448]`` (a division can round just past it; the
cast saturates on CPU but the behaviour is not promised everywhere) and rounded to nearest
even by the cast. An all-zero row or block gets scale 1 (its e4m3 values are 0 either way).
Every step is a correctly rounded fp32 operation in a fixed order (the rotation by
:func:`hadamard_transform`'s butterflies, IEEE divisions), so the bytes and scales are the same
on every device and equal those of the SM90 kernel ``cute/quantize_sm90.py``, NaN aside: a
NaN input gives an e4m3 NaN whose sign bit may differ (torch's cast keeps the sign, x86 makes
negative NaNs, the kernel's ``satfinite`` conversion gives 0x7F); a NaN proxy has no ranking
anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Config.selection_precision: "bf16" = the input dtype, exact; "fp8" the e4m3 top-k
PRECISIONS = ("bf16", "fp8")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
KEY_SCALES = ("block", "token")
KEY_SCALE = "block"  # the granularity of the key scale fp8 selections use (module docstring)
# smallest amax that gets its own scale: amax / 448 stays a normal fp32 number
_MIN_AMAX = E4M3_MAX * torch.finfo(torch.float32).tiny


def check_precision(selection_precision) -> str:
    """``selection_precision`` checked: one of :data:`PRECISIONS` (``"bf16"``, the exact
    selection, or ``"fp8"``, the approximate e4m3 one); raises TypeError (not a str) or
    ValueError (another str) naming the argument and the accepted values. The one check of
    every entry point that takes it (``flash_msa.msa_attention``, ``select_blocks``,
    ``nn.MSAttention``, ``distributed.msa_attention``)."""
    choices = ", ".join(map(repr, PRECISIONS))
    if not isinstance(selection_precision, str):
        raise TypeError(
            f"selection_precision must be a str, one of {choices}; got "
            f"{type(selection_precision).__name__} {selection_precision!r}"
        )
    if selection_precision not in PRECISIONS:
        raise ValueError(
            f"selection_precision must be one of {choices}, got {selection_precision!r}"
        )
    return selection_precision


class Quantized(NamedTuple):
    """The e4m3 proxy operands of one fp8 selection and their fp32 scales.

    ``q`` ``(Tq, Hp, Dp)`` and ``k`` ``(T, Hpk, Dp)`` e4m3; ``q_scale`` ``(Tq, Hp)`` and
    ``k_scale`` ``(T, Hpk)`` fp32 (``x ~= x8 * scale``). With ``key_scale == "block"`` every
    token of a key block holds the block's scale. The operands are the rotated ``q H``, ``k H``
    (:func:`hadamard`).
    """

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    key_scale: str


def hadamard(n: int, device=None) -> torch.Tensor:
    """The rotation of a head dim ``n``, fp32 ``(n, n)`` orthonormal (``H @ H.T = I``): the
    Walsh-Hadamard matrix of order ``m`` (Sylvester's construction divided by ``sqrt(m)``),
    ``m`` the largest power of two dividing ``n``, repeated on the diagonal (``n = 128``: one
    block of 128; ``n = 48``: three of 16; odd ``n``: the identity)."""
    if n < 1:
        raise ValueError(f"the Hadamard rotation needs a head dim >= 1, got {n}")
    m = n & -n
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < m:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h * m**-0.5] * (n // m))


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard(n)`` over the last dim ``n`` in fp32, by one fixed order of operations:
    within each block of ``m`` (:func:`hadamard`), the radix-2 Walsh-Hadamard butterflies at
    strides 1, 2, 4, ..., m/2 (elements ``i`` and ``i + s``, ``i`` without bit ``s``, become
    ``a + b`` and ``a - b``, each rounded once), then one multiply by the fp32 value of ``m **
    -0.5``. So the result's bits are defined (every device and kernel that keeps this order
    gets them: the SM90 quantize kernel, ``cute/quantize_sm90.py``), where ``x @ hadamard(n)``
    sums in an order its BLAS library picks (and in TF32 under matmul precision "high"); the
    two differ in the last bits of most values at ``n = 128`` (measured in that module's
    docstring), and compute the same rotation."""
    x = x.float()
    n = x.shape[-1]
    m = n & -n
    if m == 1:
        return x
    bufs = [torch.empty(x.shape, dtype=torch.float32, device=x.device), None]
    s, i = 1, 0
    while s < m:  # one pass of reads and writes per stage: into the other buffer, by views
        src = x.reshape(-1, n // (2 * s), 2, s)
        dst = bufs[i].view(-1, n // (2 * s), 2, s)
        torch.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        torch.sub(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        if bufs[1 - i] is None:
            bufs[1 - i] = torch.empty_like(bufs[i])
        x, s, i = bufs[i], 2 * s, 1 - i
    # m ** -0.5 rounded to fp32 first: the product is then one rounding, on any device
    return x.mul_(torch.tensor(m**-0.5, dtype=torch.float32).item())


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` (``scale`` broadcast over the last dim) as e4m3, clamped to +-448."""
    return (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # an IEEE division on every device: the divisor is a tensor, as torch on CUDA multiplies by
    # the reciprocal of a Python-number divisor ("may lose one bit", its div_true kernel), so
    # ``amax / 448.0`` differed between CPU and GPU (and from the CuTe kernel's div.rn)
    return torch.where(amax >= _MIN_AMAX, amax / amax.new_full((), E4M3_MAX), 1.0)


def block_of_token(cu_seqlens: torch.Tensor, total: int, block_size: int) -> torch.Tensor:
    """int64 ``(total,)``: the global number of each packed token's key block, blocks counted
    per sequence from its own start (sequence ``n``'s blocks follow sequence ``n - 1``'s)."""
    cu = cu_seqlens.long()
    tok = torch.arange(total, device=cu.device)
    # cu[seq] <= tok < cu[seq + 1]; a row past cu[-1] (metadata the API's guard rewrote) counts
    # as the last sequence's: its block numbers stay below total (a block has >= 1 token)
    seq = torch.searchsorted(cu[1:-1], tok, right=True)
    nblocks = -(-(cu[1:] - cu[:-1]) // block_size)
    first = torch.cumsum(nblocks, 0) - nblocks  # global number of each sequence's block 0
    return first[seq] + (tok - cu[seq]) // block_size


def key_scales(
    k: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, key_scale: str = KEY_SCALE
) -> torch.Tensor:
    """fp32 ``(T, Hpk)`` scales of ``k`` ``(T, Hpk, Dp)``: per token, or per (block, head)
    repeated on the block's tokens (``key_scale``, :data:`KEY_SCALES`)."""
    amax = k.detach().abs().amax(-1).float()  # (T, Hpk)
    if key_scale == "block":
        blk = block_of_token(cu_seqlens, k.shape[0], block_size)
        # T rows hold every block (a block has >= 1 token): no host read of the block count
        per_block = torch.zeros_like(amax)
        per_block.scatter_reduce_(0, blk[:, None].expand_as(amax), amax, "amax")
        amax = per_block[blk]
    elif key_scale != "token":
        raise ValueError(f"key_scale must be one of {KEY_SCALES}, got {key_scale!r}")
    return _scale(amax)


def quantize(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    *,
    key_scale: str = KEY_SCALE,
) -> Quantized:
    """The quantize pass of an fp8 selection: the rotation (:func:`hadamard_transform`), then
    the scales and the e4m3 values (module docstring).

    Args:
        q_proxy: ``(Tq, Hp, Dp)``; k_proxy: ``(T, Hpk, Dp)`` (packed, any float dtype);
        cu_seqlens: ``(N+1,)`` int32 of the keys' sequences (the key blocks).
        block_size: the selection's block (the key scale's block).
        key_scale: ``"block"`` or ``"token"`` (see the module docstring).
    Returns:
        :class:`Quantized`.
    """
    q = hadamard_transform(q_proxy.detach().float())
    k = hadamard_transform(k_proxy.detach().float())
    q_scale = _scale(q.abs().amax(-1))
    k_scale = key_scales(k, cu_seqlens, block_size, key_scale)
    return Quantized(to_e4m3(q, q_scale), q_scale, to_e4m3(k, k_scale), k_scale, key_scale)


def dequantize(qz: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(q8 * q_scale, k8 * k_scale)``: operands whose exact products give the fp8
    selection's scores times the row's ``q_scale`` (in the rotated basis), e.g.
    for :func:`flash_msa.testing.selection_mismatch`'s near-tie rule."""
    return qz.q.float() * qz.q_scale[..., None], qz.k.float() * qz.k_scale[..., None]
