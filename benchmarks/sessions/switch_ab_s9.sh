# A/B of the ninth session's switches at anchor 16K (one process per setting, same machine)
cd snap; export PYTHONPATH=$PWD/src:/root/site:/root/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
for sw in "" "c.COMBINE_ON_CUTE=False" "c.FWD_Q_MAP_DECLARED=False" "c.COMBINE_ON_CUTE=False;c.FWD_Q_MAP_DECLARED=False;f.KL_FWD_MODE=False" ""; do
  echo "== switches: ${sw:-defaults}"
  timeout 120 python3 -c "import sys, flash_msa.cute as c, flash_msa.cute.fwd_partials_sm90 as f; $sw
from flash_msa.cli import main; sys.exit(main(sys.argv[1:]))" bench --shape anchor --seqlen 16384 --backends cute --inputs random --iters 10 2>&1 | grep -E "^anchor|Error|error" | head -3
done
cd ..; timeout 100 python3 snap/benchmarks/step_host_time.py 2>&1 | head -1 | cut -c1-200
cd snap && timeout 120 python3 benchmarks/profile_step.py --backend auto --no-kl 2>&1 | grep -E "Sm90|combine|kernels |Select|radix|elementwise" | cut -c1-60,150-200 | head -20
