#!/usr/bin/env bash
# Twelfth session, call 3 (one H200), after the one sort became the default: the long-1M step
# with it (time, peak memory: bound 40 GiB), the partial buffer's size at paper 128K (P5 of
# docs/reviews/2026-12-01-fwd-after-partials.md: PARTIAL_BYTES 2 GiB, the default, against 4
# and 8 GiB: 16, 8 and 4 chunks), and the paper-128K step's kernels (profile_step, no KL).
# Usage: bash s12_b.sh OUT; logs under OUT (tar them).
out="${1:?usage: s12_b.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
# flash-msa bench with sparse_forward.PARTIAL_BYTES = $1 GiB (2: the default)
pb() { local gib=$1 name=$2; shift 2; t timeout 200 python3 -c "
import sys
from flash_msa import sparse_forward, cli
sparse_forward.PARTIAL_BYTES = $gib << 30
sys.exit(cli.main(sys.argv[1:]))" bench --backends cute --dense "$@" --json "$out/$name.json" \
  > "$out/$name.log" 2>&1; }
pb 2 bench_long1m --shape long --seqlen 1048576 --inputs random --iters 3
for g in 2 4 8; do pb $g bench_paper128k_pb$g --shape paper --seqlen 131072 --inputs random --iters 5; done
pb 2 bench_paper128k_pb2again --shape paper --seqlen 131072 --inputs random --iters 5
t timeout 150 python3 benchmarks/profile_step.py --shape paper --seqlen 131072 --backend auto \
  --no-kl > "$out/profile128k.log" 2>&1
for f in "$out"/bench_*.log; do echo "== $f"; grep -E "^ *(shape|anchor|paper|long) |rror" "$f" | cut -c1-240; done
head -40 "$out/profile128k.log"; tail -n 4 "$out/profile128k.log"
