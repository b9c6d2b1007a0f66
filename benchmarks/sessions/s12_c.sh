#!/usr/bin/env bash
# Twelfth session, the last call (one H200): GPU tests of what changed since the first two
# calls (the ping-pong removed, the CuTe row-delta kernel, the backward's one zero fill and
# scaled cast, the pointer-argument cache), the row-delta A/B, then the step: paper 128K (no
# dense baselines), anchor 16K next to FA4 with --cuda-graph, both steps' traces.
# Usage: bash s12_c.sh OUT; logs under OUT (tar them).
out="${1:?usage: s12_c.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
b() { local name=$1; shift; t timeout 200 python3 -m flash_msa bench --backends cute "$@" \
  --json "$out/$name.json" > "$out/$name.log" 2>&1; }
t timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu_cute_row_delta.py \
  tests/test_gpu_cute_bwd.py tests/test_gpu.py tests/test_gpu_cute.py tests/test_gpu_cute_fp8.py \
  -k "not sanitizer and not hypothesis and not pingpong" > "$out/test_gpu.log" 2>&1
t timeout 90 python3 benchmarks/row_delta_ab.py > "$out/row_delta_ab.log" 2>&1
b bench_paper128k --shape paper --seqlen 131072 --inputs random --iters 5 --dense
b bench_long1m --shape long --seqlen 1048576 --inputs random --iters 3 --dense
b bench_anchor16k --shape anchor --seqlen 16384 --inputs random --iters 10 --dense fa4 --cuda-graph
t timeout 90 python3 benchmarks/profile_step.py --backend auto --no-kl --trace "$out/trace16k.json" \
  > "$out/profile16k.log" 2>&1
t timeout 120 python3 benchmarks/profile_step.py --shape paper --seqlen 131072 --backend auto \
  --no-kl --trace "$out/trace128k.json" > "$out/profile128k.log" 2>&1
gzip -f "$out"/trace*.json
grep -E "FAILED|ERROR|Timeout" "$out/test_gpu.log" | head -8; tail -n 1 "$out/test_gpu.log"
cat "$out/row_delta_ab.log" | tail -12
for f in "$out"/bench_*.log; do echo "== $f"; grep -E "^ *(shape|anchor|paper|long) |rror" "$f" | cut -c1-260; done
for f in "$out"/profile*.log; do head -22 "$f" | cut -c1-60,160-240; tail -n 1 "$f"; done
