#!/usr/bin/env bash
# A/B of two source trees of the package in one GPU run, interleaved (A B A B) so that clock
# and thermal drift hit both alike. Usage:
#   benchmarks/ab.sh OUTDIR A_SRC B_SRC [flash-msa bench arguments...]
# A_SRC / B_SRC are directories holding the flash_msa package (e.g. src, and an older commit's
# src from `git archive <commit> src | tar -x -C /tmp/old`). Writes OUTDIR/{a,b}{1,2}.json/.log.
# AB_BACKENDS (default "triton") names the providers timed, e.g. AB_BACKENDS="cute triton".
set -uo pipefail
out="${1:?usage}"; a="${2:?usage}"; b="${3:?usage}"; shift 3
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for rep in 1 2; do
  for side in a b; do
    src=$a; [ "$side" = b ] && src=$b
    PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 -m flash_msa bench --backends ${AB_BACKENDS:-triton} \
      --dense --json "$out/$side$rep.json" "$@" > "$out/$side$rep.log" 2>&1
    echo "== $side$rep ($src)"; grep -E "^\| (anchor|paper|long)" "$out/$side$rep.log"
  done
done
