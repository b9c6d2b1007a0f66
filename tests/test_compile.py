"""Every kernel compiles for sm_90a on this (GPU-less) machine without register spills (stack +
local bytes 0) and, where it has MMAs of 64+ rows, uses wgmma. For Triton kernels the check
compiles the tile candidates in the order the host code tries them (``tiles.pick``) and looks
at the one that would run."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("kernel", ["select", "fwd", "kl", "bwd", "proxy-grad", "dense", "combine"])
def test_triton_kernels_compile_for_sm90_without_spills(kernel):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "flash_msa.triton_ref.compile_check", kernel],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert rows, res.stderr
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 232448, r
        # combine has no MMA; the proxy-only forward's MMA has BT = 32 rows (< wgmma's M = 64),
        # as have tiles of 32 rows (the last candidates)
        small = isinstance(r["tile"], list) and r["tile"][0] < 64
        assert r["wgmma"] or small or r["kernel"].startswith(("combine", "fwd-proxy-only")), r
    assert res.returncode == 0, res.stderr


def test_cute_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("cutlass")
    res = subprocess.run(
        [sys.executable, "-m", "flash_msa.cute.compile_check"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 7, res.stderr
    for r in rows:
        assert r["stack"] == 0 and r["local"] == 0, r  # spills show up as stack
        assert r["wgmma"] and r["tma"], r
    assert res.returncode == 0, res.stderr


def test_cute_forward_refuses_head_layouts_and_buffers_it_cannot_run():
    """Host-side checks of the CuTe forward partials (no GPU needed): head layouts whose KV
    sub-groups would read another KV head's tiles, and partial buffers the kernel cannot store
    into, raise ValueError before any launch."""
    pytest.importorskip("cutlass")
    import torch

    from flash_msa.cute import sparse_fwd
    from flash_msa.problem import Config

    assert sparse_fwd.head_geometry_reason(16, 2, 4) is None  # anchor
    assert sparse_fwd.head_geometry_reason(64, 4, 4) is None  # paper
    assert sparse_fwd.head_geometry_reason(8, 4, 2) is None  # Hs < Hkv
    # Hs=2, Hkv=3: selection head 1's second sub-group (heads 16-19) lies in KV head 2, but the
    # kernel would keep KV head 1's tiles
    assert "divide one another" in sparse_fwd.head_geometry_reason(24, 3, 2)

    class WL:  # the fields partials() reads before the launch
        slots = 4
        heads = 4

    T, H, Hkv, D = 8, 16, 2, 64
    q = torch.zeros(T, H, D, dtype=torch.bfloat16)
    k = torch.zeros(T, Hkv, D, dtype=torch.bfloat16)
    cfg = Config(
        block_size=64,
        softmax_scale=D**-0.5,
        max_seqlen=T,
        proxy_scale=D**-0.5,
        top_k=4,
        warmup=False,
        compute_kl=True,
    )
    o_ok = torch.zeros(T, H, 4, D, dtype=torch.bfloat16)
    l_ok = torch.zeros(T, H, 4)
    with pytest.raises(ValueError, match="o_part"):
        sparse_fwd.partials(q, k, k, WL, o_ok[:, :, :, :32], l_ok, cfg)
    with pytest.raises(ValueError, match="l_part"):
        sparse_fwd.partials(q, k, k, WL, o_ok, l_ok.transpose(0, 1), cfg)
    with pytest.raises(ValueError, match="divide one another"):
        q24 = torch.zeros(T, 24, D, dtype=torch.bfloat16)
        k3 = torch.zeros(T, 3, D, dtype=torch.bfloat16)
        WL.heads = 2
        sparse_fwd.partials(q24, k3, k3, WL, o_ok, l_ok, cfg)
