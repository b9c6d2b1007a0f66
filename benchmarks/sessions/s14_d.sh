#!/usr/bin/env bash
# Fourteenth session, the last call (one H200, from a git archive of HEAD): issue 15's numbers
# with the selector design as the only selection kernel -- the bf16 and fp8 selection ops
# (fp8: the CuTe quantize pass included) at paper 128K and long 1M, random and local inputs,
# then the long 1M training step with bf16 and fp8 selection side by side. Usage: bash s14_d.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c ${N:-3000} $out/$name.log; }
T=200 N=3000 r select_ops python3 benchmarks/cute_select_ab.py --fp8 --op-only --fp8-cases paper:131072 long:1048576 --kinds random local
T=330 N=2500 r bench_long1m python3 -m flash_msa bench --shape long --seqlen 1048576 --backends cute --inputs random --iters 2 --selection-precision bf16 fp8 --json $out/bench_long1m.json
