#!/usr/bin/env bash
# Twelfth session, call 5 (one H200, from a git archive of HEAD 30654cf): the anchor-16K
# eager step four times, --iters 20, alternating the backward's delta by RowDeltaSm90 (default)
# and by problem.row_delta (row_delta_sm90.can_implement patched to refuse): is the eager
# step's 7.11 ms of call 4 the new host path or noise? Usage: bash s12_d.sh OUT
out=$1; mkdir -p $out
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
run() { local name=$1 pre=$2; timeout 80 python3 -c "
import sys
from flash_msa import cli
from flash_msa.cute import row_delta_sm90
$pre
sys.exit(cli.main(sys.argv[1:]))" bench --backends cute --dense --shape anchor --seqlen 16384 --inputs random --iters 20 > $out/$name.log 2>&1; grep -E "^ *anchor" $out/$name.log | sed "s/^/$name /" | cut -c1-200; }
run a_default ""
run b_torch_delta "row_delta_sm90.can_implement = lambda d, o: 'off'"
run c_default ""
run d_torch_delta "row_delta_sm90.can_implement = lambda d, o: 'off'"
