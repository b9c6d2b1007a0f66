# The ninth session's last H200 call (run from the repository root of the session's tree,
# wheels installed): host time of the anchor-16K step before / after the pointer launches
# (old/ = a git archive of c37c2ab, snap/ = the commit under test), the bench with
# --cuda-graph next to FA4, the GPU suites of what changed (pointer launches, combine
# cleanup, fp8_rerank) on 14 xdist workers, the fp8_rerank selection's time. Usage: bash s9_end.sh OUT
set -uo pipefail
out="${1:?usage: s9_end.sh OUT}"; mkdir -p "$out"
base=/root/site:/root/site/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1 CUTE_DSL_CACHE_DIR=/root/cute-cache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
for s in old snap; do
  PYTHONPATH=$PWD/$s/src:$base timeout 60 python3 snap/benchmarks/step_host_time.py 2>&1 \
    | head -1 | cut -c1-160 | sed "s|^|$s: |" | tee -a "$out/step_host_time_ab.log"
done
cd snap && export PYTHONPATH=$PWD/src:$base
t timeout 150 python3 -m flash_msa bench --shape anchor --seqlen 16384 32768 --backends cute \
  --inputs random --iters 10 --dense fa4 --cuda-graph --json "$out/bench_graph.json" \
  > "$out/bench_graph.log" 2>&1
grep -E "^ *(shape|anchor)" "$out/bench_graph.log" | cut -c1-250
t timeout "${TESTS_LIMIT:-200}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 14 \
  tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py tests/test_gpu_cute_kl.py \
  tests/test_gpu_cute_fp8.py tests/test_gpu_cute_combine.py tests/test_fp8_rerank.py \
  ${EXTRA_TESTS:-} > "$out/test_end.log" 2>&1
grep -E "FAILED|ERROR" "$out/test_end.log" | head -10; tail -1 "$out/test_end.log"
grep -cE " PASSED" "$out/test_end.log"
t timeout 60 python3 benchmarks/fp8_rerank_time.py --iters 3 > "$out/fp8_rerank_time.log" 2>&1
cat "$out/fp8_rerank_time.log" | tail -6
