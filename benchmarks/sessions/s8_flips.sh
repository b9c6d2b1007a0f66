set -u
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
s=$(date +%s)
timeout 280 python3 -m pytest -m gpu -v -p no:cacheprovider -n 8 tests/test_gpu_cute.py tests/test_gpu_cute_kl.py tests/test_gpu_cute_fp8.py tests/test_compile_torch.py > $OUT/tests_flips.log 2>&1
echo "tests rc=$? $(( $(date +%s) - s )) s"; grep -E "FAILED|ERROR" $OUT/tests_flips.log | head; tail -1 $OUT/tests_flips.log
s=$(date +%s)
timeout 100 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_deterministic.py > $OUT/test_deterministic.log 2>&1
echo "det rc=$? $(( $(date +%s) - s )) s"; grep -E "PASSED|FAILED|ratio" $OUT/test_deterministic.log | tail -6
s=$(date +%s)
timeout 200 python3 -m flash_msa bench --shape anchor --seqlen 16384 32768 --backends cute --inputs random --iters 10 --dense fa4 --json $OUT/bench_anchor.json > $OUT/bench_anchor.log 2>&1
echo "bench rc=$? $(( $(date +%s) - s )) s"; tail -5 $OUT/bench_anchor.log | cut -c1-250
