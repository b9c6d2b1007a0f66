#!/usr/bin/env bash
# Run the GPU test suite and the standard benchmark set on a GPU machine.
# Usage: benchmarks/gpu_suite.sh OUTDIR [--quick]
# Runs from the working tree (PYTHONPATH=src); writes logs and JSON under OUTDIR.
set -uo pipefail
out="${1:?usage: gpu_suite.sh OUTDIR [--quick]}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_COMMIT="${FLASH_MSA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
python3 -m flash_msa info > "$out/info.txt" 2>&1
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log" | tail -15
if [ "${2:-}" = "--quick" ]; then
  python3 -m flash_msa bench --shape anchor --seqlen 16384 --json "$out/bench-quick.json" 2>&1 \
    | tee "$out/bench-quick.log"
  exit 0
fi
python3 -m flash_msa bench --shape anchor paper --json "$out/bench-standard.json" \
  --plot "$out/bench-standard.png" 2>&1 | tee "$out/bench-standard.log"
# memory/scaling run: the longest sequence each GPU backend completes (no dense baseline there)
python3 -m flash_msa bench --shape long --inputs random --iters 1 --dense \
  --json "$out/bench-long.json" 2>&1 | tee "$out/bench-long.log"
