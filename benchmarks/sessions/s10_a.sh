#!/usr/bin/env bash
# Tenth session, first GPU call (after the wheels): the 16K KL-step graph capture, the
# second-process compile time, the warmup A/B, then the re-rank's tests and sweep.
out="${1:?usage: s10_a.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
# 1. graph capture: each scenario a fresh process (the failure was the first capture of a process)
for sc in global nokl_first thread_local nogc; do
  t timeout 150 python3 benchmarks/sessions/graph_debug_s10.py $sc 16384 >> "$out/graph_debug.log" 2>&1
done
grep -E "S=" "$out/graph_debug.log"
# 2. compile time: cold, then warm second process, two concurrent cold (own caches: the test sets them)
(unset FLASH_MSA_CACHE_DIR TRITON_CACHE_DIR; t timeout 240 python3 -m pytest -m gpu -s -v -p no:cacheprovider \
  tests/test_gpu_cute_cache.py > "$out/test_gpu_cute_cache.log" 2>&1)
grep -E "PASSED|FAILED|first|\{" "$out/test_gpu_cute_cache.log" | cut -c1-300 | head -12
# 3. warmup A/B
t timeout 150 python3 benchmarks/warmup_ab.py --seqlen 16384 32768 --json "$out/warmup_ab.json" > "$out/warmup_ab.log" 2>&1
grep -vE "^\s*$" "$out/warmup_ab.log" | tail -6 | cut -c1-400
