#!/usr/bin/env bash
# Eleventh session, first call on two H200s: last session's unrun variants and mends, one GPU
# each side by side (separate GPUs, so the timings do not share a device).
#   GPU 0: the forward partials with the proxy at 1/2/3 warpgroups (cute_fwd_ab.py), then the
#          WS backward's teacher_regs variant (bwd_ab.py)
#   GPU 1: the GPU tests of the review mends and of the variants, then the top-k insertion A/B
# Usage: bash s11_ab.sh OUT
out="${1:?usage: s11_ab.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  t timeout 260 python3 benchmarks/cute_fwd_ab.py > "$out/fwd_ab.log" 2>&1
  (cd benchmarks && t timeout 200 python3 bwd_ab.py --cases paper:32768 paper:131072 anchor:16384 \
    --variants cute "cute teacher_regs" --out "$out/bwd_ab_teacher.json" > "$out/bwd_ab_teacher.log" 2>&1)
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  t timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -n 8 -q tests/test_gpu_cute_bwd.py \
    -k "teacher_regs" > "$out/test_teacher.log" 2>&1
  t timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -n 8 -q \
    tests/test_gpu_cute_warmup.py tests/test_gpu_cute.py tests/test_gpu_cute_fp8.py \
    -k "not hypothesis" > "$out/test_ab.log" 2>&1
  t timeout 240 python3 benchmarks/cute_select_ab.py --variants --fp8-cases paper:131072 long:1048576 \
    --kinds random local > "$out/select_ab.log" 2>&1
}
gpu0 > "$out/gpu0.txt" 2>&1 &
gpu1 > "$out/gpu1.txt" 2>&1 &
wait
cat "$out/gpu0.txt" "$out/gpu1.txt"
grep -E "wg[123]|fwd op" "$out/fwd_ab.log" | cut -c1-200 | head -60
grep -vE "^\s*$" "$out/bwd_ab_teacher.log" | tail -14 | cut -c1-220
grep -E "FAILED|ERROR|passed|failed" "$out"/test_ab*.log | tail -12
grep -E "TFLOP|FAIL" "$out/select_ab.log" | cut -c1-200 | tail -24
