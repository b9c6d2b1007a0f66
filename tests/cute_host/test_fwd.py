"""CPU checks of the query map in the CuTe forward partials (``FwdPartialsSm90(qmap=True)``, context
parallelism; its numerics are tested on the GPU: tests/ops/test_fwd.py -k q_map): the mapped kernels
compile for sm_90a within the register budget (no spills but the paper layout's known 8 bytes), the
field is part of the kernel object (so of the compile cache's key), the host refuses a kernel /
work-list mismatch and a bad map naming it, and the limits and stage picks declare the map. CPU time
on the 2-core machine: ~17 s in pytest, 15 s of it the two compiles (plus pytest start-up)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from flash_msa import testing, worklist  # noqa: E402
from flash_msa.problem import Config  # noqa: E402

PAPER = "bf16", 64, 4, 4, 128, 16, 128  # dtype, H, Hkv, Hs, D, K, block


@pytest.mark.parametrize(
    "name",
    ["fwd bf16 proxy anchor D=128 b=128 qmap", "paper"],
)
def test_mapped_configurations_compile_for_sm90(name):
    """A CP forward's kernel (anchor heads, the proxy part; one of the 9 mapped compile check
    entries, which tests/integration/test_compile_check.py runs in full): 168 registers at most (384
    threads), no spills; the paper layout (not a compile check entry) too (fwd_partials_sm90's
    docstring)."""
    from flash_msa.cute.compile_check import compile_fwd, fwd_configurations

    cfgs = {n: c for n, *c in fwd_configurations()}
    assert sum(n.endswith(" qmap") for n in cfgs) == 9
    cfg = (*PAPER, None, True) if name == "paper" else cfgs[name]
    res = compile_fwd(*cfg)
    assert res["reg"] <= 168 and res["local"] == 0, res
    assert res["stack"] == 0, res  # spills show up as stack


def test_qmap_is_a_kernel_field():
    from cutlass import BFloat16

    from flash_msa.cute.fwd_partials_sm90 import FwdPartialsSm90

    plain = FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 16, 128)
    mapped = dataclasses.replace(plain, qmap=True)
    assert not plain.qmap and mapped.qmap
    assert plain != mapped and hash(plain) != hash(mapped)  # (the compile cache keys on it)
    assert FwdPartialsSm90.can_implement(BFloat16, 16, 2, 4, 128, 16, 128) is None


def _case(q_map_dtype=torch.int32):
    """CPU inputs of a mapped forward partials call: q rows (8 of them, one padding row) over
    two sequences of keys, the reference's mapped selection, the work list and buffers."""
    cu = testing.cu([300, 200])
    T, H, Hkv, Hs, D, K = 500, 16, 2, 4, 128, 4
    q_map = torch.tensor([5, 299, -1, 300, 499, 0, 450, 128], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_map.numel(), H, D, generator=g).bfloat16()
    k, v = (torch.randn(T, Hkv, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.zeros((q_map.numel(), Hs, K), dtype=torch.int32)
    idx[:, :, 1:] = -1
    wl = worklist.build(idx, cu, 128, worklist.ITEM_TOKENS, 0, T, q_map.to(q_map_dtype))
    o = torch.empty((q_map.numel(), H, K, D), dtype=q.dtype)
    lse = torch.empty((q_map.numel(), H, K))
    cfg = Config(block_size=128, softmax_scale=D**-0.5, max_seqlen=300, top_k=K)
    return q, k, v, idx, cu, wl, o, lse, cfg


def test_host_refuses_a_kernel_and_list_mismatch_and_a_bad_map():
    from cutlass import BFloat16

    from flash_msa.cute.forward import launch_partials
    from flash_msa.cute.fwd_partials_sm90 import FwdPartialsSm90

    q, k, v, _, _, wl, o, lse, cfg = _case()
    plain = FwdPartialsSm90(BFloat16, 16, 2, 4, 128, 4, 128)
    with pytest.raises(ValueError, match=r"qmap=False for a work list with a query map"):
        launch_partials(plain, q, k, v, wl, o, lse, cfg)
    mapped = dataclasses.replace(plain, qmap=True)
    with pytest.raises(ValueError, match=r"qmap=True for a work list without a query map"):
        launch_partials(mapped, q, k, v, wl._replace(q_map=None), o, lse, cfg)
    with pytest.raises(ValueError, match=r"wl\.q_map must be an int32 \(8,\)"):
        launch_partials(mapped, q, k, v, wl._replace(q_map=wl.q_map.long()), o, lse, cfg)
    with pytest.raises(ValueError, match=r"wl\.q_map must be an int32 \(8,\)"):
        launch_partials(mapped, q, k, v, wl._replace(q_map=wl.q_map[:-1]), o, lse, cfg)


def test_the_forward_declares_the_map():
    """``LIMITS["fwd"]`` and every stage pick declare the map (the driver then runs the mapped
    kernel), and a mapped call's KL is Triton's stage (the CuTe KL kernel has no map)."""
    from flash_msa import cute

    assert cute.LIMITS["fwd"].q_map
    assert cute.forward_stages().q_map
    q, k, v, idx, cu, wl, *_, cfg = _case()
    mapped = cute.stages_for(q, k, None, None, idx, cfg, mapped=True)
    assert mapped.q_map and mapped.kl is None


def test_forward_launch_signatures_name_their_builders():
    """Each launch-argument builder of the forward's host module has its own disk-cache text
    (``launch.builder_signature``: the builder's qualified name and a hash of its module)."""
    from flash_msa.cute import forward, launch

    builders = {
        forward.PARTIALS_SIGNATURE: forward.partials_arguments,
        forward.KL_SIGNATURE: forward.kl_arguments,
        forward.COMBINE_SIGNATURE: forward.combine_arguments,
    }
    assert len(builders) == 3
    for signature, builder in builders.items():
        assert signature == launch.builder_signature(builder)
        assert signature.startswith(f"flash_msa.cute.forward.{builder.__name__}:")
