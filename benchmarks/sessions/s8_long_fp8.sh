set -u
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
s=$(date +%s)
timeout 330 python3 -m flash_msa bench --shape long --seqlen 1048576 --backends cute --inputs random --iters 2 --dense --selection-precision bf16 fp8 --json $OUT/bench_long_fp8.json > $OUT/bench_long_fp8.log 2>&1
echo "long rc=$? $(( $(date +%s) - s )) s"; tail -4 $OUT/bench_long_fp8.log | cut -c1-250
s=$(date +%s)
timeout 230 python3 -m flash_msa bench --shape paper --seqlen 131072 --backends cute --inputs random --iters 3 --dense --json $OUT/bench_paper.json > $OUT/bench_paper.log 2>&1
echo "paper rc=$? $(( $(date +%s) - s )) s"; tail -3 $OUT/bench_paper.log | cut -c1-250
