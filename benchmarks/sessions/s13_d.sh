#!/usr/bin/env bash
# Thirteenth session, the last call (one H200, from a git archive of HEAD): the final tree's
# first-step compile times (cold / warm process), the backward's hypothesis tests (its host path
# now cuts items with the CuTe work-list kernels), then the issue-14 set: paper 128K, long 1M,
# anchor 16K next to FA4 with --cuda-graph. Usage: bash s13_d.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c ${N:-700} $out/$name.log; }
T=120 N=400 r test_cache python3 -m pytest -m gpu -p no:cacheprovider -q -s tests/test_gpu_cute_cache.py -k first_step
grep -E "^first step|^warm first step" $out/test_cache.log
T=150 N=400 r test_bwd_hyp python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu_cute_bwd.py -k hypothesis
b() { local name=$1; shift; T=${TB:-150} N=${N:-700} r $name python3 -m flash_msa bench --backends cute "$@" --json $out/$name.json; }
b bench_anchor16k --shape anchor --seqlen 16384 --inputs random --iters 20 --dense fa4 --cuda-graph
TB=170 b bench_paper128k --shape paper --seqlen 131072 --inputs random --iters 5 --dense
TB=170 b bench_long1m --shape long --seqlen 1048576 --inputs random --iters 3 --dense
