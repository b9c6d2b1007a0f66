#!/usr/bin/env bash
# Fourteenth session, call 3 (one H200, from a git archive of HEAD): issue 15's Option C A/B,
# the default selection kernel against SelectSm90(selector=True) side by side (bf16 and fp8
# kernels, paper 128K and long 1M, random and local inputs), then the fp8 op A/B (quantize
# included) for the record. Usage: bash s14_b.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
r() { local name=$1; shift; local t0=$(date +%s); timeout ${T:-150} "$@" > $out/$name.log 2>&1; echo "[$name rc=$? $(( $(date +%s) - t0 )) s]"; tail -c ${N:-3000} $out/$name.log; }
T=330 N=6000 r variants python3 benchmarks/cute_select_ab.py --variants --fp8-cases paper:131072 long:1048576 --kinds random local
T=200 N=4000 r fp8_op python3 benchmarks/cute_select_ab.py --fp8 --fp8-cases paper:131072 long:1048576 --kinds random
