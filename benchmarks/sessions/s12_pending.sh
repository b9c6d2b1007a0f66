#!/usr/bin/env bash
# For the twelfth session's first lease (written in the eleventh, after its GPU time): every
# GPU check of what was written without a GPU, in order of risk, then the three A/Bs.
# Two GPUs (nvidia-h200-x2) run PART 1 on GPU 0 and PART 2 on GPU 1 side by side (call once
# with PART=both); one GPU runs them one after the other.
#   1 (tests): row_delta on CUDA; the ping-pong GPU tests ALONE under a timeout (a wrong named
#     barrier hangs); then the suites the glue changes touch (work lists, memo, row_delta)
#   2 (A/Bs): the forward with ONE_SORT on/off (cute_fwd_ab's "one-sort" line and the bench at
#     paper 128K and long 1M with FLASH_MSA_ONE_SORT=1, peak memory); the selection ping-pong
#     (cute_select_ab --variants); the anchor-16K step's kernel count and the bench with graphs
# Usage: bash s12_pending.sh OUT [1|2|both]. Logs under OUT; tar them (the device tool returns a
# limited number of files): tar czf OUT.tgz OUT.
out="${1:?usage: s12_pending.sh OUT [1|2|both]}"; part="${2:-both}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
part1() {
  t timeout 60 python3 -c "
import torch
from flash_msa.problem import row_delta as r
for d in (torch.bfloat16, torch.float16):
    a, b = (torch.randn(16384, 16, 128, device='cuda').to(d) for _ in '12')
    print('row_delta', d, torch.equal(r(a, b), (a.float() * b.float()).sum(-1)))" > "$out/row_delta.log" 2>&1
  t timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu_cute.py \
    tests/test_gpu_cute_fp8.py -k pingpong > "$out/test_pingpong.log" 2>&1
  t timeout 420 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu.py \
    tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py tests/test_gpu_cute_kl.py \
    tests/test_gpu_cute_warmup.py -k "not pingpong" > "$out/test_suites.log" 2>&1
  FLASH_MSA_ONE_SORT=1 t timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 \
    tests/test_gpu_cute.py -k "forward_op" > "$out/test_one_sort.log" 2>&1
}
part2() {
  t timeout 300 python3 benchmarks/cute_fwd_ab.py > "$out/fwd_ab.log" 2>&1
  b() { local name=$1; shift; t timeout 200 python3 -m flash_msa bench --backends cute "$@" \
    --json "$out/$name.json" > "$out/$name.log" 2>&1; }
  b bench_paper128k --shape paper --seqlen 131072 --inputs random --iters 5
  FLASH_MSA_ONE_SORT=1 b bench_paper128k_onesort --shape paper --seqlen 131072 --inputs random --iters 5
  FLASH_MSA_ONE_SORT=1 b bench_long1m_onesort --shape long --seqlen 1048576 --inputs random --iters 3
  t timeout 240 python3 benchmarks/cute_select_ab.py --variants --fp8-cases paper:131072 \
    long:1048576 --kinds random local > "$out/select_variants.log" 2>&1
  b bench_anchor16k --shape anchor --seqlen 16384 --inputs random --iters 10 --dense fa4 --cuda-graph
  t timeout 120 python3 benchmarks/profile_step.py --backend auto --no-kl --trace "$out/trace16k.json" \
    > "$out/profile16k.log" 2>&1; gzip -f "$out/trace16k.json"
}
case "$part" in
  1) part1 ;;
  2) part2 ;;
  both) (CUDA_VISIBLE_DEVICES=0 part1 > "$out/part1.txt" 2>&1) &
        (CUDA_VISIBLE_DEVICES=1 part2 > "$out/part2.txt" 2>&1) &
        wait; cat "$out/part1.txt" "$out/part2.txt" ;;
esac
cat "$out/row_delta.log" 2>/dev/null
for f in "$out"/test_*.log; do [ -f "$f" ] && { grep -E "FAILED|ERROR" "$f" | head -6; tail -n 1 "$f"; }; done
grep -hE "one-sort|fwd op cute:" "$out/fwd_ab.log" 2>/dev/null | cut -c1-200
for f in "$out"/bench_*.log; do [ -f "$f" ] && grep -E "^ *(shape|anchor|paper|long) |graph_error" "$f" | cut -c1-240; done
grep -E "pingpong|insert|TFLOP" "$out/select_variants.log" 2>/dev/null | cut -c1-180 | tail -16
tail -n 3 "$out/profile16k.log" 2>/dev/null
