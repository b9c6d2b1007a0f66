#!/usr/bin/env bash
# Thirteenth session, call 3 (one H200, from a git archive of HEAD): the work list by CuTe
# kernels (cute/worklist_sm90.py, the CuTe stages' `work` and the backward's items), on top of
# the TVM-FFI launches: its GPU tests, the training-step suites, the host breakdown, the
# anchor-16K bench next to FA4 twice, a profile trace. Usage: bash s13_c.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c ${N:-1000} $out/$name.log; }
T=200 N=600 r test_worklist python3 -m pytest -m gpu -p no:cacheprovider -q -n 4 tests/test_gpu_cute_worklist.py
T=300 N=900 r test_step python3 -m pytest -m gpu -p no:cacheprovider -q -n 8 tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py tests/test_gpu.py \
  -k "not sanitizer and not hypothesis and not select"
T=100 r host_nokl python3 benchmarks/host_breakdown.py --steps 20
T=100 N=300 r host_kl python3 benchmarks/host_breakdown.py --kl --steps 20
for i in 1 2; do T=150 N=900 r bench16k_$i python3 -m flash_msa bench --backends cute --dense fa4 --shape anchor --seqlen 16384 --inputs random --iters 20 --cuda-graph --json $out/bench16k_$i.json; done
T=90 N=200 r profile16k python3 benchmarks/profile_step.py --backend auto --no-kl --trace $out/trace16k.json
gzip -f $out/trace16k.json
