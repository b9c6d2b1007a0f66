#!/usr/bin/env bash
# Tenth session, third lease: a pure-torch first capture, the warmup A/B at 8K (top_k 64 holds
# every block), the ncu reports of the paper-layout backward and the fp8 selection.
out="${1:?usage: s10_c.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
t timeout 120 python3 benchmarks/sessions/graph_debug_s10.py torch_first 16384 > "$out/graph_debug_torch.log" 2>&1
grep -E "S=|torch|Error" "$out/graph_debug_torch.log" | cut -c1-250 | head -12
t timeout 150 python3 benchmarks/warmup_ab.py --seqlen 8192 --batch 1 4 --json "$out/warmup_ab.json" > "$out/warmup_ab.log" 2>&1
grep -vE "^\s*$" "$out/warmup_ab.log" | tail -4 | cut -c1-700
bash benchmarks/bwd_session.sh "$out" "ncu_paper ncu_fp8"
