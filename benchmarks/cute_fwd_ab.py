"""Sparse forward kernels side by side on one GPU: every line verified on its own output, then
timed (ms and TFLOP/s by the FWD formula).

    PYTHONPATH=src python3 benchmarks/cute_fwd_ab.py [--quick] [--case SHAPE:S] [--lines TEXT]
    ncu --clock-control none -k regex:kernel python3 benchmarks/cute_fwd_ab.py --profile

``--profile`` only runs the CuTe partials (anchor 32K random, three launches) for a profiler;
``--breakdown`` prints the kernels of one CuTe forward op (torch.profiler) at anchor and paper 32K.

For the anchor and paper shapes at S=32K and 128K (random and local inputs, top_k 16), times
  * the per-block partials alone (all S tokens in one launch, one work list): the Triton stage
    and the CuTe kernel with 1, 2 and 3 warpgroups per CTA (``FwdPartialsSm90(warpgroups=)``,
    the constructor argument; 3 is the default);
  * the partials with the proxy LSE partials (issue 14 item 1): Triton's one launch that makes
    both ("partials+proxy triton (fused)"), the CuTe partials then Triton's ``proxy_partials``
    stage ("partials cute + proxy triton"), the CuTe kernel that makes both
    (``FwdPartialsSm90(proxy=True)``, the CuTe forward today, with 1, 2 and 3 warpgroups:
    "partials+proxy cute wgN"), and Triton's
    ``proxy_partials`` alone;
  * the whole forward op without selection (partials, combine, proxy LSE, KL value): Triton's,
    the CuTe one (one work-list sort per op where ``sparse_forward.one_sort`` allows it, the
    default since the twelfth session), the CuTe one with the per-chunk sorts, the fallback
    ("fwd op cute per-chunk sorts": ``sparse_forward.ONE_SORT_BYTES = 0``; verified also
    bitwise against "fwd op cute" for out, lse and proxy_lse, the KL value within 1e-5
    relative, and the default's KL the same bits in a second run; it differs from "fwd op
    cute" only where the op runs in several chunks: paper 32K (4), anchor 128K (4), paper 128K
    (16)), and the CuTe one with
    ``cute.PROXY_LSE_ON_CUTE`` on ("fwd op cute proxy-on-cute").
TFLOP/s are by FWD = 4*D*H*sparse pairs for every line (for the proxy lines and the ops this
leaves out the proxy LSE and KL work, so it understates them).

Verification, per line and before it is timed, on that line's own output (its buffers
NaN-poisoned first): ``SAMPLES`` random kept rows, recomputed in this script in fp64 ("exact")
and the way the reference computes in the input dtype ("same"), by the tolerance rule of
``flash_msa.testing`` (``err <= 2 * err(same) + atol``); a partials line also has every kept
row finite (its LSE, and its output row) and every unused row still poisoned; a proxy line
also has its sampled proxy LSE partials by the rule (exact: fp64; same: fp32 scores, as the
reference computes them), every used slot finite and every unused one still poisoned. The line
prints the errors and PASS or FAIL; a failing line is not timed.
"""

import sys

import torch

from flash_msa import bench, cute, sparse_forward, testing, triton_ref, worklist
from flash_msa.cute import fwd_partials_sm90
from flash_msa.triton_ref import selection as tri_sel

SAMPLES = 2048  # rows verified per line
WARPGROUPS = (1, 2, 3)  # the CuTe partials variants timed (FwdPartialsSm90's default: 3)


def median_ms(fn):
    """Median of 10 timed calls after 2 warm-up calls (``flash_msa.bench.time_ms``)."""
    return bench.time_ms(fn, iters=10)


def sampled_attention(q, k, v, blocks, cu, cfg, t, h, exact):
    """Attention of rows ``(t[n], h[n])`` over the keys of blocks ``blocks[n]`` (sequence-local
    block numbers, -1 unused: one block for a partial, the row's whole index for the op), up to
    the row's own token: ``(out, lse)``.

    ``exact``: in fp64; else as ``flash_msa.reference.fwd(upcast=False)`` computes: scores by a
    matmul in the input dtype, softmax statistics in fp32, ``P`` cast to the input dtype for the
    ``P V`` matmul, the output rounded to the input dtype."""
    if t.numel() > 256:  # in slices: the gathered keys of 256 rows are up to 512 MB in fp64
        parts = [
            sampled_attention(q, k, v, blocks[i : i + 256], cu, cfg, t[i : i + 256],
                              h[i : i + 256], exact)
            for i in range(0, t.numel(), 256)
        ]  # fmt: skip
        return tuple(torch.cat(x) for x in zip(*parts))
    T, H, D = q.shape
    dt = torch.float64 if exact else q.dtype
    keys, visible = block_keys(blocks, cu, cfg.block_size, t, T)
    kvh = (h // (H // k.shape[1]))[:, None]
    kk, vv = k[keys, kvh].to(dt), v[keys, kvh].to(dt)  # (N, nb * b, D)
    s = (kk @ q[t, h].to(dt)[:, :, None])[..., 0]
    s = s.to(torch.float64 if exact else torch.float32) * cfg.softmax_scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    out = (p.to(dt)[:, None, :] @ vv)[:, 0]
    return (out if exact else out.to(q.dtype)), lse


def block_keys(blocks, cu, b, t, T):
    """``(keys, visible)`` ``(N, nb * b)``: the packed positions of the keys of blocks
    ``blocks`` ``(N, nb)`` (sequence-local, -1 unused) of rows of tokens ``t``, and whether
    each is one of the row's keys (a used block's, at or before the row's token)."""
    s0 = cu[torch.searchsorted(cu[1:].long(), t, right=True)].long()  # the row's sequence start
    local = blocks.long()[:, :, None] * b + torch.arange(b, device=t.device)  # (N, nb, b)
    visible = ((blocks[:, :, None] >= 0) & (local <= (t - s0)[:, None, None])).flatten(1)
    keys = (s0[:, None, None] + local).clamp(0, T - 1).flatten(1)  # (N, nb * b)
    return keys, visible


def sampled_proxy_lse(qp, kp, blocks, cu, cfg, t, p, exact):
    """Proxy LSE of rows ``(t[n], proxy head p[n])`` over the keys of ``blocks[n]`` up to the
    row's token: in fp64 (``exact``), else as the reference computes it (fp32 scores of the
    input-dtype values)."""
    if t.numel() > 256:
        return torch.cat([
            sampled_proxy_lse(qp, kp, blocks[i : i + 256], cu, cfg, t[i : i + 256],
                              p[i : i + 256], exact)
            for i in range(0, t.numel(), 256)
        ])  # fmt: skip
    T, Hp, _ = qp.shape
    dt = torch.float64 if exact else torch.float32
    keys, visible = block_keys(blocks, cu, cfg.block_size, t, T)
    kk = kp[keys, (p // (Hp // kp.shape[1]))[:, None]].to(dt)  # (N, nb * b, Dp)
    z = (kk @ qp[t, p].to(dt)[:, :, None])[..., 0] * cfg.proxy_scale
    return torch.logsumexp(z.masked_fill(~visible, float("-inf")), dim=-1)


def verify_proxy(mine, refs, kept):
    """``(ok, text)``: sampled proxy LSE partials ``mine`` by the rule against ``refs =
    (exact, same)``; ``kept`` says whether the whole buffer has every used slot finite and
    every unused one still poisoned (bool)."""
    err, tol = testing.max_err(mine, refs[0]), testing.tolerance(*refs, torch.float32)
    ok = err <= tol and kept
    text = f"proxy lse err {err:.2e} (tol {tol:.2e})" + ("" if kept else ", slots wrong")
    return ok, text


def verify(mine_out, mine_lse, refs, dtype):
    """``(ok, text)``: a line's sampled rows by the rule (``testing.tolerance``: err <= 2 *
    err(same) + atol); ``refs`` = ``(exact, same)``, each ``(out, lse)``."""
    (e_out, e_lse), (s_out, s_lse) = refs
    parts, ok = [], True
    for what, mine, e, s, dt in (
        ("out", mine_out, e_out, s_out, dtype),
        ("lse", mine_lse, e_lse, s_lse, torch.float32),
    ):
        err, tol = testing.max_err(mine, e), testing.tolerance(e, s, dt)
        ok &= err <= tol
        parts.append(f"{what} err {err:.2e} (tol {tol:.2e})")
    return ok, f"{'PASS' if ok else 'FAIL'} {', '.join(parts)}"


def run_case(shape, S, kind, profile=False, breakdown=False, lines=None):
    _, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES[shape]
    qp, kp, q, k, v = (
        x[0].contiguous()
        for x in testing.make_inputs(1, S, H, Hkv, Hp, Hpk, D, Dp, device="cuda", kind=kind, seed=0)
    )
    cu = testing.cu([S], "cuda")
    cfg = bench.step_config(S, D, Dp)
    idx = tri_sel.select(qp, kp, cu, cfg)
    pairs = bench.sparse_pairs(idx[None], S, bench.BLOCK)
    flops = 4 * D * H * pairs
    K = cfg.top_k
    wl = worklist.build(idx, cu, cfg.block_size, worklist.ITEM_TOKENS)
    # the partials alone run over all S tokens at once (buffers of S*H*K*D elements: 34 GB at
    # paper 128K; the op itself works in chunks of at most PARTIAL_BYTES)
    o_part = torch.empty((S, H, K, D), dtype=q.dtype, device="cuda")
    l_part = torch.empty((S, H, K), dtype=torch.float32, device="cuda")
    pl_part = torch.empty((S, Hp, K), dtype=torch.float32, device="cuda")
    tri_stage = triton_ref.forward_stages().partials
    tri_proxy_stage = triton_ref.forward_stages().proxy_partials

    def cute_partials(warpgroups):
        def run():
            fwd_partials_sm90.partials(q, k, v, wl, o_part, l_part, cfg, warpgroups=warpgroups)

        return run

    def tri_partials():
        tri_stage(q, k, v, wl, o_part, l_part, cfg, 0)

    def tri_partials_proxy():  # Triton's forward: one launch makes both
        tri_stage(q, k, v, wl, o_part, l_part, cfg, 0, (qp, kp, pl_part))

    def tri_proxy():
        tri_proxy_stage(q, k, qp, kp, wl, pl_part, cfg, 0)

    def cute_then_tri_proxy():  # the CuTe forward with PROXY_LSE_ON_CUTE off (today)
        fwd_partials_sm90.partials(q, k, v, wl, o_part, l_part, cfg)
        tri_proxy()

    def cute_partials_proxy(warpgroups):  # FwdPartialsSm90(proxy=True)
        def run():
            proxy = (qp, kp, pl_part)
            fwd_partials_sm90.partials(
                q, k, v, wl, o_part, l_part, cfg, 0, proxy, warpgroups=warpgroups
            )

        return run

    def tri_op():
        return triton_ref.fwd(q, k, v, idx, cu, cfg, qp, kp)

    def cute_op():
        return fwd_partials_sm90.fwd(q, k, v, idx, cu, cfg, qp, kp)

    def cute_op_per_chunk():  # the op sorting its work list per chunk (one_sort's fallback)
        limit = sparse_forward.ONE_SORT_BYTES
        sparse_forward.ONE_SORT_BYTES = 0
        try:
            return cute_op()
        finally:
            sparse_forward.ONE_SORT_BYTES = limit

    def cute_op_proxy():  # the op with the proxy LSE partials in the CuTe partials' launch
        switch = cute.PROXY_LSE_ON_CUTE
        cute.PROXY_LSE_ON_CUTE = True
        try:
            return cute_op()
        finally:
            cute.PROXY_LSE_ON_CUTE = switch

    if profile:
        for _ in range(3):
            cute_partials(3)()
        torch.cuda.synchronize()
        return
    if breakdown:
        cute_op()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            cute_op()
            torch.cuda.synchronize()
        print(f"{shape} S={S} {kind}: kernels of one CuTe forward op")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                        max_name_column_width=50))  # fmt: skip
        return

    # sampled rows: kept (token, head, slot) entries for the partials, (token, head) for the op
    g = torch.Generator(device="cuda").manual_seed(0)
    kept = (idx >= 0).repeat_interleave(H // Hp, dim=1)  # (S, H, K)
    flat = kept.flatten().nonzero()[:, 0]
    pick = flat[torch.randint(flat.numel(), (SAMPLES,), generator=g, device="cuda")]
    t, h, slot = pick // (H * K), pick // K % H, pick % K
    blocks = idx[t, h // (H // Hp), slot][:, None]  # (N, 1): the sampled slot's block
    ref_part = [sampled_attention(q, k, v, blocks, cu, cfg, t, h, e) for e in (True, False)]
    t_op = torch.randint(S, (SAMPLES,), generator=g, device="cuda")
    h_op = torch.randint(H, (SAMPLES,), generator=g, device="cuda")
    blocks_op = idx[t_op, h_op // (H // Hp)]  # (N, K): the row's whole index
    ref_op = [sampled_attention(q, k, v, blocks_op, cu, cfg, t_op, h_op, e) for e in (True, False)]
    p = h // (H // Hp)  # the sampled rows' proxy heads (their slot's block: ``blocks``)
    ref_proxy = [sampled_proxy_lse(qp, kp, blocks, cu, cfg, t, p, e) for e in (True, False)]
    kept_p = idx >= 0  # (S, Hp, K)

    runs = [("partials triton", tri_partials, "partials")]
    runs += [(f"partials cute wg{w}", cute_partials(w), "partials") for w in WARPGROUPS]
    runs += [
        ("partials+proxy triton (fused)", tri_partials_proxy, "partials+proxy"),
        ("partials cute + proxy triton", cute_then_tri_proxy, "partials+proxy"),
    ]
    # the proxy kernel by warpgroups: with 3 (the default) ptxas serializes its wgmmas at D 128
    # (compile_check's wgmma_serialized; tenth session), with 2 it does not
    runs += [
        (f"partials+proxy cute wg{w}", cute_partials_proxy(w), "partials+proxy") for w in WARPGROUPS
    ]
    runs += [("proxy_partials triton", tri_proxy, "proxy")]
    runs += [("fwd op triton", tri_op, "op"), ("fwd op cute", cute_op, "op")]
    runs += [("fwd op cute per-chunk sorts", cute_op_per_chunk, "op")]
    runs += [("fwd op cute proxy-on-cute", cute_op_proxy, "op")]
    if lines:  # --lines: only the lines whose name contains the text (e.g. "fwd op")
        runs = [r for r in runs if lines in r[0]]
    for name, fn, what in runs:
        if what == "proxy":
            testing.poison(pl_part)
            fn()
            torch.cuda.synchronize()
        if what.startswith("partials"):
            testing.poison(o_part, l_part, pl_part)
            fn()
            torch.cuda.synchronize()
            ok, text = verify(o_part[t, h, slot], l_part[t, h, slot], ref_part, q.dtype)
            written = bool(torch.isfinite(l_part[kept]).all())
            for c0 in range(0, S, 4096):  # the output rows in slices (34 GB at paper 128K)
                written &= bool(torch.isfinite(o_part[c0 : c0 + 4096][kept[c0 : c0 + 4096]]).all())
            if not written:
                ok, text = False, text.replace("PASS", "FAIL") + ", kept rows unwritten"
            if not l_part[~kept].isnan().all():  # the partial-buffer contract
                ok, text = False, text.replace("PASS", "FAIL") + ", unused rows written"
        if what in ("partials+proxy", "proxy"):
            slots = bool(torch.isfinite(pl_part[kept_p]).all() and pl_part[~kept_p].isnan().all())
            ok_p, text_p = verify_proxy(pl_part[t, p, slot], ref_proxy, slots)
            main = "" if what == "proxy" else text.split(" ", 1)[1] + ", "
            ok = ok_p and (what == "proxy" or ok)
            text = f"{'PASS' if ok else 'FAIL'} {main}{text_p}"
        if what == "op":
            res = fn()
            torch.cuda.synchronize()
            ok, text = verify(res.out[t_op, h_op], res.lse[t_op, h_op], ref_op, q.dtype)
            if fn is cute_op_per_chunk:  # and the same bits as the op that sorts once
                base = cute_op()
                same = all(torch.equal(getattr(res, n), getattr(base, n))
                           for n in ("out", "lse", "proxy_lse"))  # fmt: skip
                rel = ((res.kl - base.kl).abs() / res.kl.abs()).item()
                again = bool(torch.equal(cute_op().kl, base.kl))
                ok &= same and rel <= 1e-5 and again
                text = text.replace("PASS", "PASS" if ok else "FAIL")
                text += f", out/lse/proxy_lse {'bitwise' if same else 'DIFFER'} vs one sort"
                text += f", kl rel diff {rel:.1e}{'' if again else ', kl NOT reproducible'}"
                del base
        head = f"{shape} S={S} {kind} {name}: {text}"
        if not ok:
            print(f"{head}; NOT TIMED", flush=True)
            continue
        ms = median_ms(fn)
        print(f"{head}; {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (FWD formula)", flush=True)


def main():
    if "--profile" in sys.argv:
        return run_case("anchor", 32768, "random", profile=True)
    if "--breakdown" in sys.argv:
        for shape in ("anchor", "paper"):
            run_case(shape, 32768, "random", breakdown=True)
        return
    def option(name):  # --case shape:S / --lines text (one value each)
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None

    quick = "--quick" in sys.argv
    cases = [("anchor", 32768), ("paper", 32768)]
    if not quick:
        cases += [("anchor", 131072), ("paper", 131072)]
    if option("--case"):
        shape, S = option("--case").split(":")
        cases = [(shape, int(S))]
    for shape, S in cases:
        for kind in ("random", "local"):
            run_case(shape, S, kind, lines=option("--lines"))


if __name__ == "__main__":
    main()
