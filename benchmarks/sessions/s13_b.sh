#!/usr/bin/env bash
# Thirteenth session, call 2 (one H200, from a git archive of HEAD): every CuTe launch through
# TVM-FFI (common.run_typed) and the raw-handle stream: the CuTe GPU suites, the host breakdown
# again, the anchor-16K bench next to FA4. Usage: bash s13_b.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c ${N:-1200} $out/$name.log; }
T=330 N=1500 r test_gpu python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu_cute_row_delta.py \
  tests/test_gpu_cute_bwd.py tests/test_gpu_cute.py tests/test_gpu_cute_fp8.py tests/test_gpu_cute_cache.py \
  tests/test_gpu_cute_combine.py tests/test_gpu_cute_kl.py tests/test_gpu_cute_warmup.py \
  -k "not sanitizer and not hypothesis"
T=100 r host_nokl python3 benchmarks/host_breakdown.py --steps 20
T=150 r bench16k python3 -m flash_msa bench --backends cute --dense fa4 --shape anchor --seqlen 16384 --inputs random --iters 20 --cuda-graph --json $out/bench16k.json
