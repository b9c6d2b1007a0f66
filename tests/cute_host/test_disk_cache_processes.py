"""The persistent CuTe compile cache (flash_msa.cute.disk_cache), on CPU: kernels compiled for
sm_90a on specimen tensors (as ``compile_check`` does) are stored by one process and loaded by
the next without tracing or compiling, two processes starting together compile a kernel once,
a corrupted entry is recompiled, and a loaded kernel takes its launch arguments (real CuTe views
of torch tensors) up to the launch, which needs a GPU (tests/integration/test_first_call_gpu.py).

CPU time: ~25 s (three child processes, each importing the DSL (~4 s) and torch; the cold one
compiles two selection kernels, ~2 s each).

Run as a script (``python tests/cute_host/test_disk_cache_processes.py CACHE_DIR``), this file is
the child: it asks the cache for the kernels, packs launch arguments for each and prints one JSON
line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from harness import script_result, spawn_script

# Two selection kernels: (dtype, Dp, Hp, Hpk, top_k, block). The cheapest CuTe kernels to compile
# (~2 s each here); the cache treats every kernel class alike.
CONFIGS = [("bf16", 64, 4, 1, 16, 64), ("bf16", 128, 4, 1, 16, 128)]


def _child() -> dict:
    """Get each of CONFIGS through the disk cache, count real ``cute.compile`` calls, time it,
    and pack real launch arguments for the result (CPU tensors: everything up to the launch)."""
    t0 = time.perf_counter()
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass import BFloat16

    from flash_msa.cute import compile_check, disk_cache, launch, selection
    from flash_msa.cute.select_sm90 import SelectSm90

    imported = time.perf_counter() - t0
    real_compile, calls = cute.compile, []

    def counting_compile(*a, **kw):
        calls.append(1)
        return real_compile(*a, **kw)

    cute.compile = counting_compile
    out = dict(import_s=round(imported, 2), kernels=[])
    for _, Dp, Hp, Hpk, K, block in CONFIGS:
        # the pointer launch's kernel and arguments, as select_into builds them (specimen
        # tensors: only their layouts matter to the compile)
        kernel, args = selection.select_arguments(
            SelectSm90(BFloat16, Dp, Hp, Hpk, K, block),
            compile_check.select_specimens(SelectSm90(BFloat16, Dp, Hp, Hpk, K, block)),
            1,
            cuda.CUstream(0),
        )
        t = time.perf_counter()
        fn = disk_cache.compiled(  # (the production options: a TVM-FFI function)
            kernel, args, selection.SELECT_SIGNATURE, "sm_90-test",
            f"{launch.FFI_OPTIONS} --gpu-arch sm_90a",
        )  # fmt: skip
        seconds = time.perf_counter() - t
        # the launch arguments select_into passes for 300 (CPU) tokens
        n = 300
        q = torch.zeros(n, Hp, Dp, dtype=torch.bfloat16)
        k = torch.zeros(n, Hpk, Dp, dtype=torch.bfloat16)
        tensors = (
            q.permute(0, 2, 1),
            k.permute(0, 2, 1),
            torch.tensor([0, n], dtype=torch.int32),
            torch.zeros(n, Hp, K, dtype=torch.int32),
        )
        _, typed = selection.select_arguments(kernel, tensors, 3, launch.RawStream(0))
        # the call as run_typed makes it: the TVM-FFI function checks the arguments' number and
        # types first (a TypeError naming the parameter), then launches, which needs a GPU: on
        # this machine the CUDA runtime's error says the arguments were accepted
        try:
            fn(*launch.ffi_args(typed))
            called = "launched"
        except Exception as e:
            called = f"{type(e).__name__}: {str(e)[:200]}"
        out["kernels"].append(dict(seconds=round(seconds, 3), called=called))
    out["compile_calls"] = len(calls)
    out["stats"] = dict(disk_cache.stats)
    return out


def _spawn(cache_dir) -> subprocess.Popen:
    env = dict(FLASH_MSA_CACHE_DIR=str(cache_dir), FLASH_MSA_CACHE="1")
    return spawn_script(__file__, [cache_dir], **env)


def _result(p: subprocess.Popen) -> dict:
    return script_result(p)


def test_second_process_loads_instead_of_compiling(tmp_path):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    # two processes start together on an empty cache: each kernel is compiled once (the other
    # process waits on the entry's lock, then loads it)
    first = [_result(p) for p in [_spawn(tmp_path), _spawn(tmp_path)]]
    assert sum(r["compile_calls"] for r in first) == len(CONFIGS), first
    assert sum(r["stats"].get("stored", 0) for r in first) == len(CONFIGS), first
    entries = sorted((tmp_path / "cute").rglob("*.o"))
    assert len(entries) == len(CONFIGS), entries
    assert not list((tmp_path / "cute").rglob("*.tmp")), "a temporary file was left behind"

    # a later process: every kernel loaded, nothing traced or compiled
    warm = _result(_spawn(tmp_path))
    assert warm["compile_calls"] == 0 and warm["stats"] == {"loaded": len(CONFIGS)}, warm
    cold_s = max(k["seconds"] for r in first for k in r["kernels"])
    warm_s = max(k["seconds"] for k in warm["kernels"])
    print(f"slowest kernel: cold {cold_s:.2f} s (compile), warm {warm_s:.3f} s (load)")
    assert warm_s < 0.5 < cold_s, (cold_s, warm_s)
    for k in warm["kernels"]:  # ready to launch: the arguments select_into passes are accepted
        # (the pointer launch: the four tensors as a pointer and a mode-0 size each, then
        # n_mblk and the stream): past the argument checks, up to the CUDA runtime
        assert k["called"] == "launched" or (
            k["called"].startswith("RuntimeError") and "Cuda" in k["called"]
        ), k

    # a corrupted entry (one byte flipped, as a disk error would) is dropped and recompiled;
    # a truncated one (a writer killed mid-write without the rename) likewise
    data = entries[0].read_bytes()
    entries[0].write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    entries[1].write_bytes(entries[1].read_bytes()[:-100])
    mended = _result(_spawn(tmp_path))
    assert mended["stats"] == {"dropped": 2, "compiled": 2, "stored": 2}, mended
    assert entries[0].read_bytes() == data  # the same object again (deterministic compile)


def test_key_covers_configuration_and_source(tmp_path, monkeypatch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from cutlass import BFloat16, Float16

    from flash_msa.cute import disk_cache
    from flash_msa.cute.select_sm90 import SelectSm90

    monkeypatch.setenv(disk_cache.DIR_ENV, str(tmp_path))
    sig = ("specimen signature", 1)
    monkeypatch.setenv(disk_cache.SWITCH_ENV, "0")  # off (the test suite's setting)
    assert disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90") is None
    for value in ("1", "", " "):  # on: the default, unset or empty, or 1
        monkeypatch.setenv(disk_cache.SWITCH_ENV, value)
        assert disk_cache.enabled(), value
    monkeypatch.delenv(disk_cache.SWITCH_ENV)
    assert disk_cache.enabled()
    monkeypatch.setenv(disk_cache.SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match=disk_cache.SWITCH_ENV):
        disk_cache.enabled()
    monkeypatch.setenv(disk_cache.SWITCH_ENV, "1")
    a = disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90")
    assert a is not None and a.parent.parent == tmp_path / "cute"
    assert a == disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90")
    others = [
        disk_cache.entry_path(SelectSm90(Float16, 64, 4, 1, 16, 64), sig, "sm_90"),
        disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64, 3), sig, "sm_90"),
        disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), ("other", 1), "sm_90"),
        disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_100"),
        disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90", "-O0"),
    ]
    assert len({a, *others}) == 6, others
    # the kernel's source files, and what they import at module level, are part of the key
    files = disk_cache.source_files(
        disk_cache.kernel_modules(SelectSm90(BFloat16, 64, 4, 1, 16, 64))
    )
    assert {"flash_msa.cute.select_sm90", "flash_msa.cute.common"} <= set(files), files
    monkeypatch.setattr(disk_cache, "source_hash", lambda modules: "edited")
    assert disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90") != a
    # a value without a process-independent text is not cached (never a wrong hit)
    assert (
        disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), (object(),), "sm_90") is None
    )
    monkeypatch.setenv(disk_cache.SWITCH_ENV, "0")
    assert disk_cache.entry_path(SelectSm90(BFloat16, 64, 4, 1, 16, 64), sig, "sm_90") is None


if __name__ == "__main__":
    os.environ["CUTE_DSL_DUMP_DIR"] = os.path.join(sys.argv[1], "dump")  # not into the CWD
    print(json.dumps(_child()), flush=True)
