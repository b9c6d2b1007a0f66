#!/usr/bin/env bash
# Where the WS backward's warps stall, by SASS instruction (paper layout, 32K tokens): ncu's
# warp-state sampling per instruction, exported as CSV for reading off-line. Usage: s10_ncu_sass.sh OUT
out="${1:?}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
(cd benchmarks && timeout 150 "$NCU" --kernel-name regex:BwdWsSm90 --launch-skip 1 --launch-count 1 \
  --section WarpStateStats --section SourceCounters -o "$out/ws_sass" \
  python3 profile_bwd.py --shape paper --seqlen 32768 --provider cute > "$out/ncu_sass.log" 2>&1)
tail -2 "$out/ncu_sass.log"
timeout 60 "$NCU" -i "$out/ws_sass.ncu-rep" --page source --print-source sass --csv > "$out/ws_sass.csv" 2>&1
ls -la "$out"; head -c 600 "$out/ws_sass.csv"; gzip -f "$out/ws_sass.csv"; rm -f "$out/ws_sass.ncu-rep"
