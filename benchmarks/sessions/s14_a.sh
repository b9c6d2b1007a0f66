#!/usr/bin/env bash
# Fourteenth session, call 2 (one H200, from a git archive of HEAD): issue 14's remaining GPU
# checks on the current tree -- the training-step suites in full, with the backward's hypothesis
# and compute-sanitizer tests and the work-list and KL modules -- beside issue 15's selector
# warpgroup tests (bitwise against the default selection). Usage: bash s14_a.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $out/gpu.txt 2>&1
which compute-sanitizer >> $out/gpu.txt 2>&1
t0=$(date +%s)
timeout 540 python3 -m pytest -m gpu -p no:cacheprovider -q -n 9 --durations=25 -rs \
  tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py tests/test_gpu.py tests/test_gpu_cute_worklist.py tests/test_gpu_cute_kl.py \
  > $out/test_step.log 2>&1 &
p1=$!
timeout 540 python3 -m pytest -m gpu -p no:cacheprovider -q -n 5 --durations=10 tests/test_gpu_cute_select_selector.py \
  > $out/test_selector.log 2>&1 &
p2=$!
wait $p2; echo "[selector rc=$? $(( $(date +%s) - t0 )) s]"; tail -n 15 $out/test_selector.log
wait $p1; echo "[step rc=$? $(( $(date +%s) - t0 )) s]"; tail -n 40 $out/test_step.log
