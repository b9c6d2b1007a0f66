#!/usr/bin/env bash
# Tenth session, last lease. Part 1 (bash s10_end.sh OUT 1): the bench with --cuda-graph next
# to FA4 at anchor 16K (the first capture, the KL step, after graph_steps detaches its
# outputs), the GPU tests of what changed. Part 2 (... OUT 2): the warmup A/B, fp8_rerank at
# 1M tokens (m = 16), a host+GPU trace of the eager anchor-16K step.
set -uo pipefail
out="${1:?usage: s10_end.sh OUT PART}"; part="${2:?PART 1 or 2}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
if [ "$part" = 1 ]; then
  t timeout 200 python3 -m flash_msa bench --shape anchor --seqlen 16384 --backends cute \
    --inputs random --iters 10 --dense fa4 --cuda-graph --json "$out/bench_graph.json" \
    > "$out/bench_graph.log" 2>&1
  grep -E "^ *(shape|anchor)|graph_error" "$out/bench_graph.log" | cut -c1-250
  t timeout "${TESTS_LIMIT:-330}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 14 \
    ${EXTRA_TESTS:-} tests/test_gpu.py tests/test_fp8_rerank.py tests/test_compile_torch.py \
    tests/test_gpu_cute.py > "$out/test_end.log" 2>&1
  grep -E "FAILED|ERROR" "$out/test_end.log" | head -12; tail -1 "$out/test_end.log"
else
  t timeout 200 python3 benchmarks/warmup_ab.py ${WARMUP_AB_ARGS:-} --json "$out/warmup_ab.json" \
    > "$out/warmup_ab.log" 2>&1
  grep -vE "^\s*$" "$out/warmup_ab.log" | tail -8 | cut -c1-500
  t timeout 200 python3 benchmarks/fp8_rerank_time.py --shape long --seqlen 1048576 --iters 3 \
    --extra 16 > "$out/fp8_rerank_1m.log" 2>&1
  tail -6 "$out/fp8_rerank_1m.log" | cut -c1-220
  t timeout 90 python3 benchmarks/profile_step.py --backend auto --no-kl --trace "$out/trace16k.json" \
    > "$out/profile16k_trace.log" 2>&1
  tail -1 "$out/profile16k_trace.log"; gzip -f "$out/trace16k.json"; ls -la "$out/trace16k.json.gz"
fi
