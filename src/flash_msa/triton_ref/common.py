"""``@triton.jit`` helpers shared by the Triton kernels (they inline into their callers).

- Sequences and rows: :func:`sequence_tile` (a program's tile of a packed sequence, from
  ``cu_seqlens``), :func:`tile_rows` (a tile's positions, mask and rows), :func:`row_ptrs` /
  :func:`load_rows` / :func:`row_offsets` (a tile of whole rows of a row-major ``[..., D]``
  tensor); for the dense (warmup) kernels.
- Work items (the reverse index of :mod:`flash_msa.worklist`): :func:`item_block` (a work
  item's selection head and key positions) and :func:`item_rows` (the token, slot and head of
  each MMA row of a token chunk), for the sparse forward, backward and proxy pass.
- Proxy scores of a work item: :func:`proxy_chunk` (one token chunk: the gathered q_proxy rows'
  ``[BT, BLOCK]`` scores against the block's k_proxy tile), the loop body of the forward's proxy
  LSE (``sparse_fwd``), which keeps its own mask and reduction.
- Block-local LSE: :func:`row_exp` (row max and ``exp``) and :func:`finish_lse` (``m + log l``,
  ``-inf`` for a row with no visible key), for the forward's partials, the combine and the dense
  forward.
- Main probabilities from the saved LSE: :func:`probs` (sparse backward, and through
  :func:`teacher` both proxy passes).
- The proxy pass, one body for the sparse (``proxy.py``) and the warmup (``dense.py``) kernels:
  :func:`teacher` (the mean over the group's main probabilities) and :func:`proxy_step` (the
  proxy probabilities, the KL terms ``t * (log t - log q)`` and the gradient's ``q - t``, with
  ``dz = coef * (q - t)``). The gradient MMAs that follow stay in the kernels: which side is
  kept in registers and which goes out by atomics differs (the sparse pass keeps ``dk_proxy``
  over its tokens, the dense one ``dq_proxy`` over its keys).

Import graph of ``triton_ref/`` (``a -> b``: ``a`` imports ``b``; one way, no cycles, every
import at module level)::

    __init__      -> tiles; selection, sparse_fwd, sparse_bwd, dense (where triton imports: the
                     package imports without it)
    compile_check -> selection, selection_fp8, sparse_fwd, sparse_bwd, proxy, dense, tiles
                                                  (+ flash_msa.ordered, worklist, cubin)
    sparse_fwd    -> proxy, common, tiles         (+ flash_msa.sparse_forward: the driver)
    sparse_bwd    -> proxy, common, tiles         (+ flash_msa.ordered, worklist)
    dense         -> common, tiles
    proxy         -> common, tiles                (+ flash_msa.ordered)
    selection     -> tiles                        (+ flash_msa.worklist: query_order)
    selection_fp8 -> selection, tiles             (+ flash_msa.quant)
    tiles         -> (flash_msa.backends, cubin)
    common        -> (triton only)

Outside the package the modules import only neutral ones: ``flash_msa.problem``,
``flash_msa.worklist``, ``flash_msa.sparse_forward`` (sparse_fwd), ``flash_msa.quant``,
``flash_msa.cubin`` (tiles, compile_check), ``flash_msa.backends`` (tiles), ``flash_msa.ordered``
(deterministic mode's fixed-order sums, shared with the CuTe backward). No kernel module imports
``compile_check`` (the CI's check, run as a program, reads their tables and signatures), and no
module imports another's ``_private`` names; the one reach into other modules' private objects
is ``compile_check`` compiling their ``@triton.jit`` kernels (``sparse_fwd._fwd_kernel`` ...;
the tests use those names too).
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# sequences and rows
# ---------------------------------------------------------------------------------------------


@triton.jit
def sequence_tile(CU, tile, B: tl.constexpr):
    """Packed sequence ``tl.program_id(1)``'s first packed token ``s0`` and length ``L`` (``CU``
    = cu_seqlens [N + 1]), and the first sequence-local position ``tile * B`` of its tile
    ``tile`` (B positions per tile; the grid has the longest sequence's tiles). The caller
    returns when that position is ``>= L``."""
    seq = tl.program_id(1)
    s0 = tl.load(CU + seq)
    return s0, tl.load(CU + seq + 1) - s0, tile * B


@triton.jit
def tile_rows(s0, t0, L, head, NH: tl.constexpr, B: tl.constexpr):
    """The sequence-local positions ``t0 .. t0 + B`` [B] of a tile of a sequence of ``L`` tokens
    from packed token ``s0``, their mask (``< L``) and their rows ``(s0 + pos) * NH + head``
    (int64) in a packed ``[T, NH, ...]`` tensor."""
    pos = t0 + tl.arange(0, B)
    m = pos < L
    return pos, m, (s0 + pos).to(tl.int64) * NH + head


@triton.jit
def row_ptrs(PTR, row, cols):
    """Pointers [N, D] to the rows ``row`` [N] (int64, e.g. ``token * heads + head``) of a
    row-major tensor of D-element rows at ``PTR``. ``cols`` is ``tl.arange(0, D)``, made by the
    kernel: where a kernel makes its ranges decides the order of its layouts, and with it the
    compiled code (a range made here moved the dense kernels' instructions)."""
    return PTR + row[:, None] * cols.shape[0] + cols[None, :]


@triton.jit
def load_rows(PTR, row, mask, cols):
    """The rows ``row`` [N] of ``PTR`` as an [N, D] tile (see :func:`row_ptrs`), 0 where
    ``mask`` [N] is False."""
    return tl.load(row_ptrs(PTR, row, cols), mask=mask[:, None], other=0.0)


@triton.jit
def row_offsets(row, cols):
    """Element offsets [N, D] of the rows ``row`` [N] (as :func:`row_ptrs`), for tensors of one
    layout that share them (k and v, dk and dv)."""
    return row[:, None] * cols.shape[0] + cols[None, :]


# ---------------------------------------------------------------------------------------------
# work items
# ---------------------------------------------------------------------------------------------


@triton.jit
def item_rows(
    PERM,
    c,
    e1,
    HsK: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,
):
    """Token (int64), slot, head-in-group and mask of each of the ``BT * G2P`` rows of the
    chunk of entries ``c .. min(c + BT, e1)`` of ``PERM`` (row = token-major: token ``r //
    G2P``, head ``r % G2P``); ``HsK = Hs * K`` entries per token. ``G2P`` is ``G2`` padded to a
    power of two (:func:`flash_msa.worklist.padded_geometry`): the rows of head slots ``>= G2``
    are masked, so that they load nothing and every load, store and sum they reach through the
    mask adds nothing. Where ``G2 == G2P`` that test is not emitted (a constexpr branch)."""
    o_r = tl.arange(0, BT * G2P)
    e = c + o_r // G2P
    m_r = e < e1
    if G2 != G2P:  # padded head slots
        m_r = m_r & (o_r % G2P < G2)
    flat = tl.load(PERM + e, mask=m_r, other=0)
    return (flat // HsK).to(tl.int64), flat % K, o_r % G2P, m_r


@triton.jit
def item_block(ITEM_LIST, BLK_START, BLK_END, w, NB, BN: tl.constexpr, sub=0):
    """Selection head, key positions [BN] (packed, int64) and their mask of work item ``w``'s
    key block, or of its ``sub``-th part of BN keys (kernels that split a block over
    programs)."""
    lst = tl.load(ITEM_LIST + w)
    gb = lst % NB
    kpos = (tl.load(BLK_START + gb) + sub * BN + tl.arange(0, BN)).to(tl.int64)
    return lst // NB, kpos, kpos < tl.load(BLK_END + gb)


@triton.jit
def proxy_chunk(
    QP,
    QMAP,
    PERM,
    b_kp,
    nxt,
    p,
    c,
    e1,
    cols,
    Hs: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    PREC: tl.constexpr,
    HAS_QMAP: tl.constexpr,
):
    """One step of a work item's proxy score loop over its entries ``c .. min(c + BT, e1)`` of
    ``PERM`` (one MMA row per token, selection head ``p``), the loop body of the forward's proxy
    LSE; the caller scales, masks and reduces the scores.

    ``nxt`` is this chunk's :func:`item_rows` (loaded one step ahead), ``b_kp`` the block's k_proxy tile [BN, Dp] of ``p``'s proxy key head, ``cols``
    ``tl.arange(0, Dp)``; ``QP`` is q_proxy [Tq, Hs, Dp], ``QMAP`` [Tq] int32 the rows' packed
    key tokens (with ``HAS_QMAP``, else ``None``). Returns

    - ``b_z`` [BT, BN] fp32: ``q_proxy k_proxy^T`` of the gathered rows, neither scaled nor
      masked (the forward scales before its mask);
    - ``qrow`` [BT] (int64 query rows), ``slot`` [BT], ``t`` [BT] (int64 packed key positions of
      the rows, for causality: ``qrow`` itself without a map), ``m_t`` [BT] (the rows' mask);
    - the next chunk's :func:`item_rows` (loaded before the MMA so that it overlaps it), for the
      caller's next call.
    """
    qrow, slot, _, m_t = nxt
    t = qrow  # the query's packed key position (causality)
    if HAS_QMAP:
        t = tl.load(QMAP + qrow, mask=m_t, other=0).to(tl.int64)
    b_qp = tl.load(
        QP + (qrow * Hs + p)[:, None] * cols.shape[0] + cols[None, :], mask=m_t[:, None], other=0.0
    )  # [BT, Dp]
    nxt = item_rows(PERM, c + BT, e1, Hs * K, K, BT, 1, 1)  # loads while this chunk computes
    b_z = tl.dot(b_qp, tl.trans(b_kp), input_precision=PREC)  # [BT, BN] fp32
    return b_z, qrow, slot, t, m_t, nxt


# ---------------------------------------------------------------------------------------------
# block-local LSE
# ---------------------------------------------------------------------------------------------


@triton.jit
def row_exp(b_s):
    """For scores ``b_s`` [M, N] (``-inf`` where masked): the row max [M] (0 for a row with no
    finite score, so that ``exp`` gives 0 there, not NaN), ``exp(b_s - max)`` [M, N] and its
    row sums [M]."""
    b_m = tl.max(b_s, axis=1)
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)  # a row with no visible key
    b_p = tl.exp(b_s - b_m[:, None])
    return b_m, b_p, tl.sum(b_p, axis=1)


@triton.jit
def finish_lse(b_m, b_l):
    """Natural-log LSE ``m + log l`` [M] of rows with max ``b_m`` and sum ``b_l`` of
    ``exp(s - m)``; ``-inf`` for a row with no visible key (``l = 0``), NaN for a row with a
    NaN score (``l`` is NaN: the ``l == 0`` tests let it through, ``l > 0`` would not)."""
    return tl.where(b_l == 0, float("-inf"), b_m + tl.log(tl.where(b_l == 0, 1.0, b_l)))


# ---------------------------------------------------------------------------------------------
# main probabilities and the proxy pass
# ---------------------------------------------------------------------------------------------


@triton.jit
def probs(Q, LSE, b_k, row, m_r, q_pos, k_pos, m_k, scale, D: tl.constexpr, PREC: tl.constexpr):
    """P [BM, BN] = ``exp(q k^T * scale - lse)`` of main rows ``row`` [BM] (int64 ``token * H +
    head``, mask ``m_r``) on the key tile ``b_k`` [BN, D] (mask ``m_k``), 0 where a key is
    masked or after the query (``k_pos > q_pos``: positions [BN] and [BM] on one axis, packed
    or per sequence); also the rows' q [BM, D]."""
    o_d = tl.arange(0, D)
    b_q = tl.load(Q + row[:, None] * D + o_d[None, :], mask=m_r[:, None], other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    keep = m_r[:, None] & m_k[None, :] & (k_pos[None, :] <= q_pos[:, None])
    b_lse = tl.load(LSE + row, mask=m_r, other=0.0)
    return tl.where(keep, tl.exp(b_s - b_lse[:, None]), 0.0), b_q


@triton.jit
def teacher(
    Q,
    LSE,
    Kt,
    b_k0,
    tok,
    hj,
    m_r,
    q_pos,
    kpos,
    k_pos,
    m_k,
    p,
    scale,
    H: tl.constexpr,
    Hkv: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    G2: tl.constexpr,
    G2P: tl.constexpr,
    R: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """The KL's teacher [BT, BN]: the mean over selection head ``p``'s G main heads of their
    probabilities on the keys ``kpos`` [BN] (packed, int64; mask ``m_k``).

    The G heads are visited in R sub-groups of G2 heads that share a KV head, packed into the
    MMA's M dimension: BT * G2P rows (G2 padded to a power of two) of token ``tok`` (packed,
    int64) and head ``p * G + r * G2 + hj``, mask ``m_r`` (False on the padded head slots
    ``hj >= G2``: their probabilities are 0, so the sum over the G2P slots is the sum over the
    G2 heads, and the mean divides by the G real heads); causality compares ``k_pos`` [BN]
    with ``q_pos`` [BT * G2P] (see :func:`probs`). With one sub-group (R == 1) the key tile is
    the caller's ``b_k0`` [BN, D], which it may keep in registers over several calls;
    otherwise each sub-group's tile is loaded here."""
    o_d = tl.arange(0, D)
    b_tgt = tl.zeros([BT, BN], tl.float32)
    for r in tl.static_range(R):
        h0 = p * G + r * G2  # first main head of this KV sub-group
        kvh = h0 // (H // Hkv)
        if R == 1:
            b_k = b_k0
        else:
            p_k = Kt + (kpos * Hkv + kvh)[:, None] * D + o_d[None, :]
            b_k = tl.load(p_k, mask=m_k[:, None], other=0.0)  # [BN, D]
        row = tok * H + h0 + hj
        b_p, _ = probs(Q, LSE, b_k, row, m_r, q_pos, k_pos, m_k, scale, D, PREC)  # [BT * G2P, BN]
        b_tgt += tl.sum(tl.reshape(b_p, [BT, G2P, BN]), axis=1)
    return b_tgt / G


@triton.jit
def proxy_step(
    kl_acc,
    b_tgt,
    b_qp,
    b_kp,
    b_plse,
    m_t,
    q_pos,
    k_pos,
    m_k,
    pscale,
    KL_VALUE: tl.constexpr,
    GRAD: tl.constexpr,
    PREC: tl.constexpr,
):
    """The proxy side of one [BT, BN] tile, against the teacher ``b_tgt``: the proxy
    probabilities ``q = exp(z - proxy_lse)``, ``z = q_proxy k_proxy^T * pscale`` (``b_qp`` [BT,
    Dp], ``b_kp`` [BN, Dp], ``b_plse`` [BT]; tokens masked by ``m_t``, keys by ``m_k``, causal
    by ``k_pos <= q_pos``). Returns

    - ``kl_acc`` [BT] plus the tile's KL row sums ``t * (log t - log q)`` (with ``KL_VALUE``;
      terms with ``t = 0`` are 0, their ``log t`` never evaluated), else ``kl_acc``;
    - ``q - t`` [BT, BN] in the input dtype, the operand of the gradient's MMAs
      (``dz = coef * (q - t)``; with ``GRAD``, else ``b_tgt``). The caller applies ``coef =
      dkl / (Hs * T)`` to their fp32 results: ``coef`` is ~1/T and ``coef * (q - t)`` would
      underflow fp16."""
    b_z = tl.dot(b_qp, tl.trans(b_kp), input_precision=PREC) * pscale
    keep = m_t[:, None] & m_k[None, :] & (k_pos[None, :] <= q_pos[:, None])
    b_logq = b_z - b_plse[:, None]
    if KL_VALUE:
        pos = keep & (b_tgt > 0)
        b_logt = tl.log(tl.where(pos, b_tgt, 1.0))
        kl_acc += tl.sum(tl.where(pos, b_tgt * (b_logt - b_logq), 0.0), axis=1)
    b_diff = b_tgt  # unused without GRAD
    if GRAD:
        b_diff = (tl.where(keep, tl.exp(b_logq), 0.0) - b_tgt).to(b_qp.dtype)  # q - t
    return kl_acc, b_diff
