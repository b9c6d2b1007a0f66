"""CPU checks of the CuTe row delta (``flash_msa/cute/row_delta_sm90.py``, its host code in
``flash_msa/cute/backward.py``, the backward's ``rowsum(dO * O)``; its numerics are tested on
the GPU: tests/ops/test_row_delta.py): the configurations compile for sm_90a without spills
and with 128-bit loads, the limits, the host's refusals of bad inputs naming the argument
(before any launch), the launch's arguments, and that the kernel's row mapping covers every row
once."""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")


def test_configurations_compile_for_sm90_without_spills_with_128_bit_loads(tmp_path):
    from flash_msa.cubin import resources, sass_counts
    from flash_msa.cute.compile_check import compile_row_delta, row_delta_configurations
    from flash_msa.cute.row_delta_sm90 import RowDeltaSm90

    cfgs = list(row_delta_configurations())
    names = [name for name, *_ in cfgs]
    assert len(names) == len(set(names)) == 4
    for name, dtype, D in cfgs:
        res = compile_row_delta(dtype, D, dump=str(tmp_path), name=name)
        assert res["stack"] == 0 and res["local"] == 0, (name, res)  # spills show up as stack
        stem = tmp_path / name.replace(" ", "_")
        ptx = open(f"{stem}.ptx").read()
        cubin = open(f"{stem}.cubin", "rb").read()
        unroll = RowDeltaSm90.unroll
        # every load is one 16-byte vector load: two per pass (dout, out), nothing narrower
        assert ptx.count("ld.global.v4.b32") == 2 * unroll, name
        assert ptx.count("ld.global") == 2 * unroll, name
        n = sass_counts(cubin, ("LDG.E.128", "STG.E", "SHFL.BFLY"))
        assert n["LDG.E.128"] == 2 * unroll and n["STG.E"] == unroll, (name, n)
        lanes = D // 8
        assert n["SHFL.BFLY"] == unroll * (lanes.bit_length() - 1), (name, n)
        assert resources(cubin) == {k: res[k] for k in ("reg", "stack", "local")}


def test_limits():
    from cutlass import BFloat16, Float16, Float32

    from flash_msa.cute.backward import row_delta_fits
    from flash_msa.cute.row_delta_sm90 import RowDeltaSm90

    ok = RowDeltaSm90.can_implement
    assert ok(BFloat16, 128) is None and ok(Float16, 64) is None
    assert "bf16 or fp16" in ok(Float32, 128)
    assert "head dim" in ok(BFloat16, 96)
    assert "warps" in ok(BFloat16, 128, warps=3)
    assert "unroll" in ok(BFloat16, 128, unroll=3)
    with pytest.raises(ValueError, match="head dim"):
        RowDeltaSm90(BFloat16, 256)
    assert row_delta_fits(torch.bfloat16, 128) and row_delta_fits(torch.float16, 64)
    assert not row_delta_fits(torch.float32, 128)
    assert not row_delta_fits(torch.bfloat16, 96)
    assert not row_delta_fits(torch.bfloat16, 256)
    assert RowDeltaSm90(BFloat16, 128).rows_per_cta == 8 * 2 * 4
    assert RowDeltaSm90(BFloat16, 64).rows_per_cta == 8 * 4 * 4
    assert hash(RowDeltaSm90(BFloat16, 128)) != hash(RowDeltaSm90(Float16, 128))


def test_host_refuses_bad_inputs_naming_them(monkeypatch):
    """Every refusal comes before a launch (``run_typed`` would fail the test)."""
    from flash_msa.cute import backward
    from flash_msa.cute.backward import row_delta
    from flash_msa.cute.row_delta_sm90 import MAX_ROWS

    def no_launch(*a):
        raise AssertionError("launched")

    monkeypatch.setattr(backward, "run_typed", no_launch)
    bf = torch.bfloat16
    x = torch.zeros((6, 4, 128), dtype=bf)
    xt = x.transpose(0, 1)  # (4, 6, 128), not contiguous
    cases = [
        (TypeError, "dout must be a torch.Tensor", (x.numpy, x)),
        (TypeError, "out must be a torch.Tensor", (x, None)),
        (TypeError, "dout must be bfloat16 or float16", (x.float(), x.float())),
        (TypeError, "out must be bfloat16 or float16", (x, x.double())),
        (ValueError, "dout and out must share a dtype", (x, x.half())),
        (ValueError, "one shape", (x, x[:5])),
        (ValueError, "one shape", (x[0], x[0])),
        (ValueError, r"head dim D \(dout.shape\[-1\]\)", (x[..., :96], x[..., :96])),
        (ValueError, "head dim", (torch.zeros((6, 4, 256), dtype=bf),) * 2),
        (ValueError, "dout must be contiguous", (xt, xt.contiguous())),
        (ValueError, "out must be contiguous", (x[:, :, :64].contiguous(), x[:, :, 64:])),
        (ValueError, "dout's base must be 16-byte aligned", (_misaligned(x), x)),
        (ValueError, "CUDA device", (x, x)),  # CPU tensors: the kernel needs CUDA ones
    ]
    for kind, match, args in cases:
        with pytest.raises(kind, match=match):
            row_delta(*args)
    big = torch.empty((MAX_ROWS // 4 + 1, 4, 64), dtype=bf, device="meta")
    with pytest.raises(ValueError, match="rows exceed"):
        row_delta(big, big)


def _misaligned(x):
    """A contiguous (T, H, D) view of ``x``'s shape whose base is 2 bytes past a 16-byte
    boundary."""
    buf = torch.zeros(x.numel() + 8, dtype=x.dtype)
    v = buf[1 : 1 + x.numel()].view(x.shape)
    assert v.is_contiguous() and v.data_ptr() % 16
    return v


def test_launch_arguments():
    """What a launch gets: the three addresses as typed pointers with the alignments the kernel
    assumes, the row count as an Int32 (the kernel object fixes every type: the compile cache
    keys on it alone)."""
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32

    from flash_msa.cute.backward import row_delta_arguments
    from flash_msa.cute.row_delta_sm90 import RowDeltaSm90

    k = RowDeltaSm90(BFloat16, 128)
    a_do, a_o, a_d = 1 << 20, 3 << 20, 5 << 20
    n_rows = 131072 * 64
    args = row_delta_arguments(k, a_do, a_o, a_d, n_rows, cuda.CUstream(0))
    p_do, p_o, p_d, rows, _ = args
    assert [int(p._pointer) for p in (p_do, p_o, p_d)] == [a_do, a_o, a_d]
    assert (p_do.dtype, p_o.dtype, p_d.dtype) == (BFloat16, BFloat16, Float32)
    assert isinstance(rows, Int32) and int(rows) == n_rows


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("n_rows", [1, 63, 64, 65, 1000, 8193])
def test_row_mapping_covers_every_row_once(D, n_rows):
    """The kernel's index math (``kernel``: pass ``u`` of warp ``w``, lane ``l`` of CTA ``b``
    takes row ``b * rows_per_cta + w * RPW + l / L + u * W * RPW``, stored by lanes ``l % L ==
    0`` where ``< n_rows``; loads clamp to the last row) replayed in Python: each row stored
    exactly once, by one row's lanes, every load in bounds."""
    from cutlass import BFloat16

    from flash_msa.cute.row_delta_sm90 import RowDeltaSm90

    k = RowDeltaSm90(BFloat16, D)
    W, U, L = k.warps, k.unroll, k.row_lanes
    RPW = 32 // L
    grid = (n_rows + k.rows_per_cta - 1) // k.rows_per_cta
    stored = []
    for b in range(grid):
        for t in range(32 * W):
            lane, warp = t % 32, t // 32
            first = b * k.rows_per_cta + warp * RPW + lane // L
            for u in range(U):
                row = first + u * W * RPW
                assert 0 <= min(row, n_rows - 1) < n_rows
                if lane % L == 0 and row < n_rows:
                    stored.append(row)
    assert sorted(stored) == list(range(n_rows))
