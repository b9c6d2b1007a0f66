#!/usr/bin/env bash
# Eleventh session, two H200s, second CP call (the first's torchrun lines failed on a script bug;
# the one-GPU bench OOMed at paper 1M): paper 1M over 2 GPUs, then 512K over 1 and 2 GPUs (the
# longest one GPU holds is the comparison where 1M does not fit), 1M on one GPU tried.
out="${1:?usage: s11_cp2.sh OUT}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASH_MSA_CACHE_DIR=/root/fmcache TRITON_CACHE_DIR=/root/tcache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
cpb() { local n=$1 name=$2; shift 2
  t timeout 170 torchrun --nproc-per-node "$n" --master-port $((29500 + n)) benchmarks/cp_bench.py \
    --shape paper "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1
  grep "^rank" "$out/$name.log" || tail -4 "$out/$name.log" | cut -c1-300; }
cpb 2 cp_paper_1m_x2 --seqlen 1048576 --iters 3 --warmup 1
cpb 2 cp_paper_512k_x2 --seqlen 524288 --iters 3 --warmup 1 --variants overlap
CUDA_VISIBLE_DEVICES=0 cpb 1 cp_paper_512k_x1 --seqlen 524288 --iters 3 --warmup 1 --variants overlap &
sleep 2; CUDA_VISIBLE_DEVICES=1 cpb 1 cp_paper_1m_x1 --seqlen 1048576 --iters 2 --warmup 1 --variants overlap &
wait
