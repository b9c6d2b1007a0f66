#!/usr/bin/env bash
# Eleventh session, second lease (two H200s): after the A/Bs' switches (the WS backward's teacher
# in registers, the selection's rank insertion, both now the only path), their GPU tests on GPU 0
# and the benchmarks on GPU 1: the training step next to FA4 (anchor 16K with CUDA graphs, paper
# 128K), the anchor 1M step with bf16 and fp8 selection, the fp8 selection A/B at 128K and 1M.
# Usage: bash s11_flip.sh OUT
out="${1:?usage: s11_flip.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  t timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -n 8 -q tests/test_gpu_cute_bwd.py \
    > "$out/test_bwd.log" 2>&1
  t timeout 170 python3 -m pytest -m gpu -p no:cacheprovider -n 8 -q tests/test_gpu_cute.py \
    tests/test_gpu_cute_fp8.py -k "select" > "$out/test_select.log" 2>&1
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  b() { local name=$1; shift; t timeout 200 python3 -m flash_msa bench --backends cute "$@" \
    --json "$out/$name.json" > "$out/$name.log" 2>&1; }
  b bench_anchor16k --shape anchor --seqlen 16384 --inputs random --iters 10 --dense fa4 --cuda-graph
  b bench_paper128k --shape paper --seqlen 131072 --inputs random --iters 5 --dense fa4
  b bench_long1m --shape long --seqlen 1048576 --inputs random local --iters 3 --dense \
    --selection-precision bf16 fp8
  t timeout 150 python3 benchmarks/cute_select_ab.py --fp8 --fp8-cases paper:131072 long:1048576 \
    --kinds random local > "$out/select_fp8.log" 2>&1
}
gpu0 > "$out/gpu0.txt" 2>&1 &
gpu1 > "$out/gpu1.txt" 2>&1 &
wait
cat "$out/gpu0.txt" "$out/gpu1.txt"
for f in "$out"/test_*.log; do grep -E "FAILED|ERROR" "$f" | head -8; tail -n 1 "$f"; done
for f in "$out"/bench_*.log; do grep -E "^ *(shape|anchor|paper|long) |graph_error" "$f" | cut -c1-260; done
grep -E "TFLOP|FAIL" "$out/select_fp8.log" | cut -c1-200 | tail -16
