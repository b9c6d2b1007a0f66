"""Why did the first CUDA-graph capture of the anchor-16K KL step fail (stage9/end)?
One scenario per fresh process (python graph_debug_s10.py SCENARIO): the order of the
captures, the capture error mode, the garbage collector. Prints one line per capture."""

import gc
import sys
import traceback

import torch

from flash_msa import bench, testing

scenario = sys.argv[1]
S = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
B, H, Hkv, Hp, Hpk, D, Dp, _ = bench.SHAPES["anchor"]
xs = testing.make_inputs(B, S, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.bfloat16, device="cuda")
leaves = [x.detach().requires_grad_() for x in xs]
steps = bench.graph_steps("cute", leaves, {}, "bf16")
order = ["step_graph_ms", "step_nokl_graph_ms"]
if scenario == "nokl_first":
    order.reverse()
mode = scenario if scenario in ("thread_local", "relaxed") else "global"
if scenario == "nogc":
    gc.disable()
orig = torch.cuda.graph


class Graph(orig):
    def __init__(self, g, **kw):
        super().__init__(g, capture_error_mode=mode, **kw)


bench.torch.cuda.graph = Graph
if scenario == "pre_capture":  # a trivial capture first: is it the process's first capture?
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    g0 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g0):
            y = x * 2
        print(f"{scenario}: trivial capture ok", flush=True)
    except Exception as e:
        print(f"{scenario}: trivial capture failed: {e}", flush=True)
if scenario == "torch_first":  # a pure-torch autograd step on the same leaves, captured first

    def tstep():
        q, k = leaves[2], leaves[3]
        s = (q[0, :256, :2].float() * k[0, :256, :1].float()).sum()
        return torch.autograd.grad(s, (q, k))

    try:
        ms = bench.graph_replay_ms(tstep, ("dq", "dk"), 3)
        print(f"{scenario}: torch step ok {ms:.3f} ms", flush=True)
    except Exception:
        print(f"{scenario}: torch step failed:\n" + traceback.format_exc()[-1500:], flush=True)
if scenario == "fwd_only":  # the forward alone (no autograd) first
    from flash_msa import msa_attention
    from flash_msa.backends import forced

    def fwd():
        with forced("auto"), torch.no_grad():
            return msa_attention(*leaves, bench.TOP_K, compute_kl=True)

    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    g0 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g0):
            fwd()
        print(f"{scenario}: forward capture ok", flush=True)
    except Exception:
        print(f"{scenario}: forward capture failed:\n" + traceback.format_exc()[-2500:], flush=True)
for key in order:
    step, names = steps[key]
    try:
        ms = bench.graph_replay_ms(step, names, 5)
        print(f"{scenario} S={S} {key}: ok {ms:.3f} ms", flush=True)
    except Exception as e:
        print(f"{scenario} S={S} {key}: {type(e).__name__}: {str(e).strip()[:300]}", flush=True)
        if scenario in ("global", "fwd_only"):
            print(traceback.format_exc()[-3000:], flush=True)
    torch.cuda.empty_cache()
