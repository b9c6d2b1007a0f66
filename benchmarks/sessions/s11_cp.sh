#!/usr/bin/env bash
# Eleventh session, two H200s: issue 16's GPU items. The NCCL correctness test at 64K, then the
# paper shape at 1M tokens over 2 GPUs against 1 GPU (cp_bench with one rank: the same code, and
# `flash-msa bench` for the plain single-GPU op), then 2M over 2 GPUs.
# Usage: bash s11_cp.sh OUT
out="${1:?usage: s11_cp.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
nvidia-smi topo -m > "$out/topo.txt" 2>&1
t timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -s tests/test_distributed.py -k nccl \
  > "$out/test_cp_nccl.log" 2>&1
grep -E "error|PASS|FAIL|passed|failed" "$out/test_cp_nccl.log" | tail -20 | cut -c1-200
cpb="torchrun --nproc-per-node"; cpa="benchmarks/cp_bench.py --shape paper"
t timeout 170 $cpb 2 $cpa --seqlen 1048576 --iters 3 --warmup 1 --out "$out/cp_paper_1m_x2.json" \
  > "$out/cp_paper_1m_x2.log" 2>&1
grep "^rank" "$out/cp_paper_1m_x2.log"
(export CUDA_VISIBLE_DEVICES=0; t timeout 150 $cpb 1 $cpa --seqlen 1048576 --iters 3 --warmup 1 \
  --variants overlap --out "$out/cp_paper_1m_x1.json" > "$out/cp_paper_1m_x1.log" 2>&1) &
(export CUDA_VISIBLE_DEVICES=1; t timeout 150 python3 -m flash_msa bench --shape paper --seqlen 1048576 \
  --backends cute --dense --iters 3 --json "$out/bench_paper_1m.json" > "$out/bench_paper_1m.log" 2>&1) &
wait
grep "^rank" "$out/cp_paper_1m_x1.log" || tail -5 "$out/cp_paper_1m_x1.log"
tail -8 "$out/bench_paper_1m.log" | cut -c1-220
t timeout 170 $cpb 2 $cpa --seqlen 2097152 --iters 2 --warmup 1 --variants overlap \
  --out "$out/cp_paper_2m_x2.json" > "$out/cp_paper_2m_x2.log" 2>&1
grep "^rank" "$out/cp_paper_2m_x2.log" || tail -5 "$out/cp_paper_2m_x2.log"
