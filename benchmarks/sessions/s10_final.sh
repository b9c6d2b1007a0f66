#!/usr/bin/env bash
# Tenth session, final lease: the WS backward's producer prefetch (BwdWsSm90(prefetch=True)):
# its A/B against the default in one run, then its GPU tests and the CuTe warmup's after the
# review's mends. Usage: bash s10_final.sh OUT
out="${1:?usage: s10_final.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
(cd benchmarks && t timeout 170 python3 bwd_ab.py --cases paper:32768 paper:131072 anchor:16384 \
  --variants cute "cute prefetch" --out "$out/bwd_ab_prefetch.json" > "$out/bwd_ab_prefetch.log" 2>&1)
grep -vE "^\s*$" "$out/bwd_ab_prefetch.log" | tail -12 | cut -c1-220
t timeout "${TESTS_LIMIT:-220}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 14 \
  tests/test_gpu_cute_bwd.py tests/test_gpu_cute_warmup.py -k "prefetch or warmup" \
  > "$out/test_final.log" 2>&1
grep -E "FAILED|ERROR" "$out/test_final.log" | head -12; tail -1 "$out/test_final.log"
