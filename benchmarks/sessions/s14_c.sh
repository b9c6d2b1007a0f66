#!/usr/bin/env bash
# Fourteenth session, call 4 (one H200, from the working tree with the selector design as the
# only selection kernel): the selection GPU tests (the ring's cases against the reference and
# the Triton fp8 oracle, the CuTe selection and fp8 suites, the disk cache) and the
# training-step suites that run the selection. Usage: bash s14_c.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t0=$(date +%s)
timeout 330 python3 -m pytest -m gpu -p no:cacheprovider -q -n 12 --durations=15 -rs \
  tests/test_gpu_cute_select_selector.py tests/test_gpu_cute_fp8.py tests/test_gpu_cute_cache.py \
  tests/test_gpu_cute.py tests/test_gpu.py \
  > $out/test_select.log 2>&1
echo "[select rc=$? $(( $(date +%s) - t0 )) s]"; tail -n 30 $out/test_select.log
