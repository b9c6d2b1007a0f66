#!/usr/bin/env bash
# One GPU session's backward work, in priority order, each step time-boxed; logs under OUTDIR.
# Usage (repo root, CuTe DSL importable): benchmarks/bwd_session.sh OUTDIR [STEPS]
#   STEPS: any of tests det ab ncu bench sanitizer hypothesis kl cache combine bench_stages
#   host small_tiles qmap proxy_lse fp8 verify8 verify8b ab8 profile16k train64k ncu_paper
#   ncu_fp8 verify9 rerank_sweep (default: tests det ab
#   ncu bench sanitizer hypothesis,
#   in that order);
#   bench_anchor / bench_paper: one half of bench
#   BWD_TESTS_K / BWD_TESTS_LIMIT: override the test steps' pytest -k selection and time limit
#   BWD_TESTS_N: run the test steps (not det, whose timing ratio needs the GPU alone) on N
#   pytest-xdist workers: the tests' wall time is mostly kernel compiles, which parallelize
set -uo pipefail
out="${1:?usage: bwd_session.sh OUTDIR [STEPS]}"
steps="${2:-tests det ab ncu bench sanitizer hypothesis}"  # (kl, cache, combine: by name)
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t() { local s rc; s=$(date +%s); "$@"; rc=$?; echo "  [$(( $(date +%s) - s )) s, rc=$rc] $*" | cut -c1-160; }
for step in $steps; do
  case "$step" in
    tests|sanitizer|hypothesis)  # the CuTe backward's GPU tests, in three time-boxed parts
      case "$step" in
        tests) sel="not hypothesis and not sanitizer"; limit=420 ;;  # v2, ws, deterministic
        sanitizer) sel="sanitizer"; limit=240 ;;  # racecheck + synccheck per variant
        hypothesis) sel="hypothesis"; limit=300 ;;
      esac
      sel="${BWD_TESTS_K:-$sel}"; limit="${BWD_TESTS_LIMIT:-$limit}"  # a session's override
      t timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} tests/test_gpu_cute_bwd.py \
        -k "$sel" > "$out/test_gpu_cute_bwd_$step.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_gpu_cute_bwd_$step.log" | head -5
      echo "  passed: $(grep -cE "PASSED" "$out/test_gpu_cute_bwd_$step.log")" ;;
    kl)  # the CuTe KL stage (off by default: cute.KL_ON_CUTE): its tests, then its A/B
      t timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} tests/test_gpu_cute_kl.py \
        > "$out/test_gpu_cute_kl.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_gpu_cute_kl.log" | head -5
      echo "  passed: $(grep -cE "PASSED" "$out/test_gpu_cute_kl.log")"
      (cd benchmarks && t timeout 300 python3 kl_ab.py --out "$out/kl_ab.json" > "$out/kl_ab.log" 2>&1)
      python3 - "$out/kl_ab.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], r["S"], r["kl_sum"]["rel_diff"], {k: round(v, 2) for k, v in r["ms"].items()})
PY
      ;;
    cache)  # the CuTe disk cache (off by default): cold and warm first steps in fresh processes
      t timeout 420 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu_cute_cache.py \
        > "$out/test_gpu_cute_cache.log" 2>&1
      grep -E "PASSED|FAILED|ERROR|cold|warm" "$out/test_gpu_cute_cache.log" | head -12 ;;
    combine)  # the CuTe combine (off by default: cute.COMBINE_ON_CUTE): its tests, then its A/B
      t timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} tests/test_gpu_cute_combine.py \
        > "$out/test_gpu_cute_combine.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_gpu_cute_combine.log" | head -5
      echo "  passed: $(grep -cE "PASSED" "$out/test_gpu_cute_combine.log")"
      (cd benchmarks && t timeout 200 python3 combine_ab.py --warps 4 8 > "$out/combine_ab.log" 2>&1)
      tail -12 "$out/combine_ab.log" ;;
    det)  # deterministic mode on auto (sparse and warmup)
      t timeout 180 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_deterministic.py \
        > "$out/test_deterministic.log" 2>&1
      grep -E "PASSED|FAILED|ratio" "$out/test_deterministic.log" | tail -6 ;;
    ab)  # the backward op, same run: Triton, v2, ws, deterministic
      (cd benchmarks && t timeout 420 python3 bwd_ab.py --variants cute "cute v2" "cute deterministic" \
        --cases anchor:16384 anchor:32768 paper:32768 paper:131072 --out "$out/bwd_ab.json" \
        > "$out/bwd_ab.log" 2>&1)
      python3 - "$out/bwd_ab.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], r["S"], " ".join(f"{k}:{min(v['ms']):.2f}ms/{v['tflops']:.0f}"
          for k, v in r.items() if isinstance(v, dict) and "tflops" in v))
PY
      ;;
    ncu)  # profile of the default (warp-specialized) kernel at anchor 32K (stall reasons)
      NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      (cd benchmarks && t timeout 240 "$NCU" --kernel-name regex:BwdWsSm90 --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section LaunchStats --section SourceCounters --import-source no \
        -o "$out/ws_anchor32k" python3 profile_bwd.py --provider cute > "$out/ncu.log" 2>&1)
      "$NCU" -i "$out/ws_anchor32k.ncu-rep" --page details > "$out/ncu_ws_details.txt" 2>&1
      grep -E "Duration|Eligible Warps|Issue Slots|Achieved Occ" "$out/ncu_ws_details.txt" ;;
    verify9)  # the ninth session's unrun GPU work: the tensor-core re-rank (fp8_rerank), the
              # backward's hypothesis test and the suite's tail the last call's time limit cut
      t timeout 540 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_fp8_rerank.py tests/test_gpu_cute_bwd.py tests/test_gpu_cute_fp8.py \
        tests/test_gpu_small_tiles.py > "$out/test_verify9.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_verify9.log" | head -8; tail -1 "$out/test_verify9.log" ;;
    rerank_sweep)  # issue 15: fp8_rerank's cost and recall at paper 128K by extra blocks and tile
      t timeout 300 python3 benchmarks/fp8_rerank_time.py --shape paper --seqlen 131072 \
        --extra 4 8 16 32 --tiles 64,4 128,8 > "$out/fp8_rerank_sweep.log" 2>&1
      tail -20 "$out/fp8_rerank_sweep.log" | cut -c1-200 ;;
    ncu_paper)  # issue 14's paper-128K target: the backward at the paper layout (its chunk, 32K
                # tokens), and the forward partials there, stall reasons
      NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      (cd benchmarks && t timeout 240 "$NCU" --kernel-name regex:BwdWsSm90 --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section MemoryWorkloadAnalysis --import-source no \
        -o "$out/ws_paper32k" python3 profile_bwd.py --shape paper --seqlen 32768 --provider cute \
        > "$out/ncu_paper.log" 2>&1)
      "$NCU" -i "$out/ws_paper32k.ncu-rep" --page details > "$out/ncu_paper_details.txt" 2>&1
      grep -E "Duration|Eligible Warps|Issue Slots|Achieved Occ|Compute \(SM\) Thr|Memory Thr" \
        "$out/ncu_paper_details.txt" ;;
    ncu_fp8)  # issue 15's 1000 TFLOP/s: the fp8 selection kernel at paper 128K, stall reasons
      NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      prog='import torch; from flash_msa import select_blocks, testing
xs = testing.make_inputs(1, 131072, 64, 4, 4, 1, 128, 128, dtype=torch.bfloat16, device="cuda")
for _ in range(2): select_blocks(xs[0], xs[1], 16, selection_precision="fp8")
torch.cuda.synchronize()'
      t timeout 240 "$NCU" --kernel-name regex:SelectSm90 --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section Occupancy --section SourceCounters --import-source no \
        -o "$out/select_fp8" python3 -c "$prog" > "$out/ncu_fp8.log" 2>&1
      "$NCU" -i "$out/select_fp8.ncu-rep" --page details > "$out/ncu_fp8_details.txt" 2>&1
      grep -E "Duration|Eligible Warps|Issue Slots|Achieved Occ|Compute \(SM\) Thr" \
        "$out/ncu_fp8_details.txt" ;;
    host)  # host enqueue time against GPU time of the anchor-16K step (is the 16K step host-bound?)
      t timeout 240 python3 benchmarks/step_host_time.py > "$out/step_host_time.log" 2>&1
      head -3 "$out/step_host_time.log" ;;
    small_tiles)  # issue 18: the training step on Triton with the small tiles forced, next to the default
      for cap in "" 166912 101376; do
        FLASH_MSA_SMEM_LIMIT=$cap t timeout 120 python3 -m flash_msa bench --shape anchor paper \
          --seqlen 16384 --backends triton --inputs random --iters 5 --dense \
          --json "$out/bench_triton_smem${cap:-default}.json" > "$out/bench_triton_smem${cap:-default}.log" 2>&1
        tail -2 "$out/bench_triton_smem${cap:-default}.log"
      done ;;
    qmap)  # the query map in the CuTe selection and backward (cute.Q_MAP_DECLARED off until this passes)
      t timeout 420 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_gpu_cute.py tests/test_gpu_cute_bwd.py -k q_map > "$out/test_qmap.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_qmap.log" | head -5; tail -1 "$out/test_qmap.log" ;;
    proxy_lse)  # the proxy LSE in the CuTe partials (cute.PROXY_LSE_ON_CUTE off until this passes and wins)
      t timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_gpu_cute.py -k "proxy_partials or proxy_lse" > "$out/test_proxy_lse.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_proxy_lse.log" | head -5; tail -1 "$out/test_proxy_lse.log"
      t timeout 300 python3 benchmarks/cute_fwd_ab.py --quick > "$out/cute_fwd_ab_proxy.log" 2>&1
      grep -E "proxy|FAIL" "$out/cute_fwd_ab_proxy.log" | head -20 ;;
    fp8)  # issue 15: the CuTe FP8 selection (cute.FP8_SELECTION_ON_CUTE off until this passes), then its A/B
      t timeout 300 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_gpu_cute_fp8.py > "$out/test_gpu_cute_fp8.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_gpu_cute_fp8.log" | head -5; tail -1 "$out/test_gpu_cute_fp8.log"
      t timeout 400 python3 benchmarks/cute_select_ab.py --fp8 > "$out/cute_select_ab_fp8.log" 2>&1
      tail -15 "$out/cute_select_ab_fp8.log" ;;
    verify8)  # the eighth session's unrun kernels and host changes: their GPU tests (-n N)
      t timeout 540 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_gpu_cute_kl.py tests/test_gpu_cute_combine.py tests/test_gpu_cute_fp8.py \
        > "$out/test_verify8.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_verify8.log" | head -8; tail -1 "$out/test_verify8.log" ;;
    verify8b)  # the forward's query map, fp32 small tiles, and the shared work list under graphs
      t timeout 540 python3 -m pytest -m gpu -v -p no:cacheprovider ${BWD_TESTS_N:+-n "$BWD_TESTS_N"} \
        tests/test_gpu_cute.py tests/test_gpu_small_tiles.py tests/test_gpu.py \
        -k "q_map or fp32 or sync_free or cuda_graph or graph" > "$out/test_verify8b.log" 2>&1
      grep -E "FAILED|ERROR" "$out/test_verify8b.log" | head -8; tail -1 "$out/test_verify8b.log" ;;
    ab8)  # the A/Bs of the eighth session's kernels, same run each: KL stage (fwd mode),
          # combine variants, the fp8 quantize kernel at paper 128K, host time (shared work list)
      (cd benchmarks && t timeout 200 python3 kl_ab.py --out "$out/kl_ab.json" > "$out/kl_ab.log" 2>&1)
      tail -6 "$out/kl_ab.log"
      (cd benchmarks && t timeout 150 python3 combine_ab.py --out "$out/combine_ab.json" > "$out/combine_ab.log" 2>&1)
      tail -14 "$out/combine_ab.log"
      t timeout 150 python3 benchmarks/cute_select_ab.py --fp8 --fp8-cases paper:131072 \
        > "$out/cute_select_ab_fp8.log" 2>&1
      grep -E "quantize|k=16:" "$out/cute_select_ab_fp8.log" | head -16
      t timeout 100 python3 benchmarks/step_host_time.py > "$out/step_host_time.log" 2>&1
      head -1 "$out/step_host_time.log" | cut -c1-200 ;;
    profile16k)  # where the anchor-16K step goes: kernels by GPU time, busy vs span (auto)
      t timeout 120 python3 benchmarks/profile_step.py --backend auto --no-kl > "$out/profile16k_nokl.log" 2>&1
      tail -3 "$out/profile16k_nokl.log" ;;
    train64k)  # issue 17: the long-retrieval run at 64K tokens, each model in its own call
      # (LR_MODEL=msa or dense; the summary merges in LR_OUT on the warm machine)
      t timeout 580 python3 examples/train_long_retrieval.py --seqlen 65536 --no-progress \
        --out "${LR_OUT:-/root/lr64}" $([ "${LR_MODEL:-msa}" = msa ] && echo --no-dense-baseline || echo --no-msa) \
        > "$out/train64k_${LR_MODEL:-msa}.log" 2>&1
      tail -4 "$out/train64k_${LR_MODEL:-msa}.log"; cp -r "${LR_OUT:-/root/lr64}" "$out/" ;;
    bench_stages)  # the training step with the CuTe KL and combine stages on (cute.KL_ON_CUTE, COMBINE_ON_CUTE)
      on='import sys, flash_msa.cute as c; c.KL_ON_CUTE = c.COMBINE_ON_CUTE = True; from flash_msa.cli import main; sys.exit(main(sys.argv[1:]))'
      t timeout 240 python3 -c "$on" bench --shape anchor --seqlen 16384 32768 --backends cute \
        --inputs random --iters 5 --dense --json "$out/bench_anchor_stages.json" > "$out/bench_anchor_stages.log" 2>&1
      t timeout 200 python3 -c "$on" bench --shape paper --seqlen 131072 --backends cute \
        --inputs random --iters 3 --dense --json "$out/bench_paper_stages.json" > "$out/bench_paper_stages.log" 2>&1
      tail -4 "$out/bench_anchor_stages.log"; tail -2 "$out/bench_paper_stages.log" ;;
    bench|bench_anchor|bench_paper)  # the training step (KL in the loss and compute_kl=False) next to FA4
      [ "$step" = bench_paper ] || t timeout 300 python3 -m flash_msa bench --shape anchor --seqlen 16384 32768 --backends cute \
        --inputs random --iters 5 --dense fa4 --json "$out/bench_anchor.json" > "$out/bench_anchor.log" 2>&1
      [ "$step" = bench_anchor ] || t timeout 240 python3 -m flash_msa bench --shape paper --seqlen 131072 --backends cute \
        --inputs random --iters 3 --dense --json "$out/bench_paper.json" > "$out/bench_paper.log" 2>&1
      tail -4 "$out/bench_anchor.log" 2>/dev/null; tail -2 "$out/bench_paper.log" 2>/dev/null ;;
  esac
done
