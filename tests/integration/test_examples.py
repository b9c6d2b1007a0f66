"""The examples run as written on CPU: the README's layer example (a few seconds) and the
training example's `--tiny` run (CI; CPU time measured in its test's docstring)."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import torch

from flash_msa import backends

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_msa_layer_example_trains():
    """The layer example as a user runs it on a CPU: without the pytest run's
    ``TRITON_INTERPRET`` (a child without a GPU then runs on the torch backend; the Triton
    kernels' numerics are tests/ops/test_msa.py's). Measured: 36 s on the interpreter, ~5 s so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "msa_layer.py")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    kls = [float(line.split("kl")[1]) for line in res.stdout.splitlines() if "kl" in line]
    assert len(kls) == 3 and kls[-1] < kls[0]  # the proxy learns


# ---------------------------------------------------------------------------------------------
# examples/train_long_retrieval.py
# ---------------------------------------------------------------------------------------------
def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_long_retrieval_batches():
    """Each query's answer is the value that followed its key in the context; pairs sit
    inside one block, before the queries' blocks; every curriculum length has the same
    tokens per step."""
    ex = _load_example("train_long_retrieval")
    cfg = ex.Config(**ex.TINY).resolved()
    task = ex.RetrievalTask(cfg)
    for length in [*ex.curriculum_lengths(cfg), cfg.seqlen]:
        b = task.batch(task.TRAIN, 0, "cpu", length)
        assert b.tokens.numel() == cfg.batch_size * cfg.seqlen
        assert b.tokens.shape[1] == length
        tok = b.tokens
        assert torch.equal(tok.gather(1, b.query_pos), tok.gather(1, b.answer_pos - 1))  # keys
        assert torch.equal(tok.gather(1, b.answer_pos), b.answers)
        assert torch.equal(tok.gather(1, b.query_pos + 1), b.answers)
        assert bool(((b.answers >= task.value0) & (b.answers < task.vocab_size)).all())
        assert bool((b.answer_pos % 2 == 1).all())  # (key, value) never straddles a block
        if length == cfg.seqlen:
            first_query_block = b.query_pos.min() // cfg.block_size
            assert bool((b.answer_pos // cfg.block_size < first_query_block).all())
        keys = tok.gather(1, b.query_pos)
        assert all(len(set(row.tolist())) == row.numel() for row in keys)  # distinct queries
    again = task.batch(task.TRAIN, 0, "cpu")
    assert torch.equal(again.tokens, task.batch(task.TRAIN, 0, "cpu").tokens)  # seeded
    assert not torch.equal(again.tokens, task.batch(task.EVAL, 0, "cpu").tokens)


def test_long_retrieval_tiny_run(tmp_path):
    """The CI run of the training example: `--device cpu --tiny`, both models, JSON lines with
    every field; the MSA model's dense warmup equals the dense model step for step.

    CPU time (2 cores, `--durations`): 4-9 s on a quiet machine, 82 s while another CI run
    held both cores."""
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_long_retrieval.py"),
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--plot",
            str(tmp_path / "plot.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    cfg = summary["config"]
    runs = {}
    for name in ("msa", "dense"):
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
        assert [r["step"] for r in runs[name]] == list(range(cfg["steps"]))
        for r in runs[name]:
            assert set(r) >= {
                "loss",
                "acc",
                "kl",
                "recall",
                "recall_layers",
                "recall_weighted",
                "answer_mass_layers",
                "step_ms",
                "phase",
            }
            assert len(r["answer_mass_layers"]) == cfg["layers"]
            assert math.isfinite(r["loss"]) and 0 <= r["acc"] <= 1 and r["step_ms"] > 0
            if name == "dense":
                assert r["kl"] is None and r["recall"] is None and r["phase"] == "dense"
                continue
            assert math.isfinite(r["kl"]) and r["kl"] >= 0
            assert len(r["recall_layers"]) == cfg["layers"]
            assert 0 <= r["recall"] <= 1 and 0 <= r["recall_weighted"] <= 1
            assert r["phase"] == ("warmup" if r["step"] < cfg["warmup_steps"] else "sparse")
        assert [r["seqlen"] for r in runs[name]][-1] == cfg["seqlen"]
    assert runs["msa"][0]["seqlen"] < cfg["seqlen"]  # the curriculum ran
    # same initial weights and batches, and warmup is dense attention: equal losses until the
    # MSA model turns sparse (fp32; only the kernels' rounding differs)
    for m, d in zip(runs["msa"][: cfg["warmup_steps"]], runs["dense"]):
        assert abs(m["loss"] - d["loss"]) < 1e-3 * max(1.0, abs(d["loss"]))
    for name in ("msa", "dense"):
        final = summary["final_eval"][name]
        assert math.isfinite(final["loss"]) and 0 <= final["acc"] <= 1
    assert 0 <= summary["final_eval"]["msa"]["recall"] <= 1
    assert "dense_attention" in summary["final_eval"]["msa"]
    assert "last step" in res.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plot.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in res.stderr


def test_long_retrieval_attention_helpers():
    """`main_qk` computes the q/k that MSAttention attends with (its dense warmup output is
    rebuilt from them), and `answer_mass` is a probability mass."""
    ex = _load_example("train_long_retrieval")
    cfg = ex.Config(**ex.TINY).resolved()
    task = ex.RetrievalTask(cfg)
    torch.manual_seed(0)
    model = ex.RetrievalLM(cfg, task.vocab_size, "msa")
    attn = model.blocks[0].attn
    batch = task.batch(task.EVAL, 0, "cpu")
    x = torch.randn(cfg.batch_size, cfg.seqlen, cfg.hidden_size)
    with backends.forced("torch"), torch.no_grad():
        out, _ = attn(x)  # warmup=True: dense causal attention
        q, k = ex.main_qk(attn, x)
        v = attn.v_proj(x).view_as(k)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)
        torch.testing.assert_close(out, attn.o_proj(dense.flatten(2)), rtol=1e-4, atol=1e-5)
        mass = ex.answer_mass(attn, x, batch, cfg.block_size)
        assert mass.shape == (cfg.batch_size, cfg.queries, cfg.num_heads)
        assert bool(((mass >= 0) & (mass <= 1)).all())
        whole = ex.answer_mass(attn, x, batch, cfg.seqlen)  # one block: all of the mass
        torch.testing.assert_close(whole, torch.ones_like(whole))
