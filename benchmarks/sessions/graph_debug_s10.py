"""Why did the first CUDA-graph capture of the anchor-16K KL step fail (stage9/end)?
One scenario per fresh process (python graph_debug_s10.py SCENARIO): the order of the
captures, the capture error mode, the garbage collector. Prints one line per capture."""
import gc
import sys

import torch

from flash_msa import bench, testing

scenario = sys.argv[1]
S = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES["anchor"]
xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
leaves = [x.detach().requires_grad_() for x in xs]
steps = bench.graph_steps("cute", leaves, {}, "bf16")
order = ["step_nokl_graph_ms", "step_graph_ms"] if scenario == "nokl_first" else ["step_graph_ms", "step_nokl_graph_ms"]
mode = "thread_local" if scenario == "thread_local" else "relaxed" if scenario == "relaxed" else "global"
if scenario == "nogc":
    gc.disable()
orig = torch.cuda.graph


class Graph(orig):
    def __init__(self, g, **kw):
        super().__init__(g, capture_error_mode=mode, **kw)


bench.torch.cuda.graph = Graph
for key in order:
    step, names = steps[key]
    try:
        ms = bench.graph_replay_ms(step, names, 5)
        print(f"{scenario} S={S} {key}: ok {ms:.3f} ms", flush=True)
    except Exception as e:
        print(f"{scenario} S={S} {key}: {type(e).__name__}: {str(e).strip()[:600]}", flush=True)
    torch.cuda.empty_cache()
