#!/usr/bin/env bash
# Tenth session, second lease: the warm process with bytecode cached (pip's default install),
# the graph capture's first error, the warmup A/B (fixed lists), the re-rank's tests and sweep.
out="${1:?usage: s10_b.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
python3 -c "import sys, os; print('dont_write_bytecode', sys.flags.dont_write_bytecode, os.environ.get('PYTHONDONTWRITEBYTECODE'))" | tee "$out/bytecode.txt"
ls /root/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__pycache__ 2>&1 | head -3 >> "$out/bytecode.txt"
t python3 -m compileall -q /root/site /root/site/nvidia_cutlass_dsl/dsl_packages src > /dev/null 2>&1
(unset FLASH_MSA_CACHE_DIR TRITON_CACHE_DIR; t timeout 200 python3 -m pytest -m gpu -s -v -p no:cacheprovider \
  tests/test_gpu_cute_cache.py -k second_process > "$out/test_gpu_cute_cache_pyc.log" 2>&1)
grep -E "first step|PASSED|FAILED" "$out/test_gpu_cute_cache_pyc.log" | cut -c1-200
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
for sc in global pre_capture fwd_only; do
  CUDA_LOG_FILE=stderr t timeout 120 python3 benchmarks/sessions/graph_debug_s10.py $sc 16384 >> "$out/graph_debug.log" 2>&1
done
grep -E "S=|capture" "$out/graph_debug.log" | cut -c1-250
t timeout 150 python3 benchmarks/warmup_ab.py --seqlen 16384 32768 --json "$out/warmup_ab.json" > "$out/warmup_ab.log" 2>&1
grep -vE "^\s*$" "$out/warmup_ab.log" | tail -4 | cut -c1-600
t timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -n 8 tests/test_fp8_rerank.py > "$out/test_fp8_rerank.log" 2>&1
grep -E "FAILED|ERROR" "$out/test_fp8_rerank.log" | head -5; tail -1 "$out/test_fp8_rerank.log"
t timeout 170 python3 benchmarks/fp8_rerank_time.py --shape paper --seqlen 131072 --extra 4 8 16 32 \
  --tiles 64,4 128,8 > "$out/fp8_rerank_sweep.log" 2>&1
tail -14 "$out/fp8_rerank_sweep.log" | cut -c1-220
