#!/usr/bin/env bash
# Thirteenth session, call 1 (one H200, from a git archive of HEAD): where the eager anchor-16K
# step's host time goes (benchmarks/host_breakdown.py, no profiler), a CuTe launch's host cost
# through the DSL executor against TVM-FFI, and the same session's bench baseline.
# Usage: bash s13_a.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $out/gpu.txt 2>&1
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c 1500 $out/$name.log; }
T=200 r host_nokl python3 benchmarks/host_breakdown.py --launch-ab --steps 20
T=100 r host_kl python3 benchmarks/host_breakdown.py --kl --steps 20
T=150 r bench16k flash-msa bench --backends cute --dense fa4 --shape anchor --seqlen 16384 --inputs random --iters 20 --cuda-graph --json $out/bench16k.json
