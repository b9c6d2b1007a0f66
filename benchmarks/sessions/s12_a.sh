#!/usr/bin/env bash
# Twelfth session, one H200 (x2 was not lent): s12_pending.sh's checks and A/Bs split into
# calls of at most 10 minutes, riskiest first.
#   calls: 1 = row_delta on CUDA, the ping-pong GPU tests alone under a timeout (a wrong named
#          barrier hangs), the ping-pong A/B (random inputs), the ONE_SORT forward tests
#          2 = the suites the glue changes touch, the paper-128K step with and without ONE_SORT,
#          the forward op lines at paper 128K (cute_fwd_ab --lines "fwd op")
# Usage: bash s12_a.sh OUT 1|2; logs under OUT (tar them: the tool returns few files).
out="${1:?usage: s12_a.sh OUT 1|2}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
b() { local name=$1; shift; t timeout 200 python3 -m flash_msa bench --backends cute "$@" \
  --json "$out/$name.json" > "$out/$name.log" 2>&1; }
case "$2" in
1)
  t timeout 60 python3 -c "
import torch
from flash_msa.problem import row_delta as r
for d in (torch.bfloat16, torch.float16):
    a, b = (torch.randn(16384, 16, 128, device='cuda').to(d) for _ in '12')
    print('row_delta', d, torch.equal(r(a, b), (a.float() * b.float()).sum(-1)))" > "$out/row_delta.log" 2>&1
  t timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu_cute.py \
    tests/test_gpu_cute_fp8.py -k pingpong > "$out/test_pingpong.log" 2>&1
  t timeout 170 python3 benchmarks/cute_select_ab.py --variants --fp8-cases paper:131072 \
    long:1048576 --kinds random > "$out/select_variants.log" 2>&1
  FLASH_MSA_ONE_SORT=1 t timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 \
    tests/test_gpu_cute.py -k "forward_op" > "$out/test_one_sort.log" 2>&1
  ;;
2)
  t timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu.py \
    tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py tests/test_gpu_cute_kl.py \
    -k "not pingpong and not sanitizer and not hypothesis" > "$out/test_suites.log" 2>&1
  b bench_paper128k --shape paper --seqlen 131072 --inputs random --iters 5
  FLASH_MSA_ONE_SORT=1 b bench_paper128k_onesort --shape paper --seqlen 131072 --inputs random --iters 5
  t timeout 120 python3 benchmarks/cute_fwd_ab.py --case paper:131072 --lines "fwd op cute" \
    > "$out/fwd_ab.log" 2>&1
  ;;
esac
cat "$out/row_delta.log" 2>/dev/null
for f in "$out"/test_*.log; do [ -f "$f" ] && { grep -E "FAILED|ERROR|Timeout" "$f" | head -6; tail -n 1 "$f"; }; done
grep -hE "fwd op" "$out/fwd_ab.log" 2>/dev/null | cut -c1-220
for f in "$out"/bench_*.log; do [ -f "$f" ] && grep -E "^ *(shape|anchor|paper|long) |graph_error" "$f" | cut -c1-240; done
grep -E "pingpong|TFLOP" "$out/select_variants.log" 2>/dev/null | cut -c1-180 | tail -16
