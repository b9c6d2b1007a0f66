"""examples/train_real_text.py and examples/plot_training.py, run as written on CPU.

One test runs ``--tiny`` (torch backend, one thread) for dense and for MSA, the MSA run split
into a training invocation that saves a checkpoint and an ``--eval-only`` invocation that loads
it (as the GPU experiment is run), then the plot script over both, and a dense run cut short by
``--stop-step``. About 25 s of CPU time (40-60 s wall on 2 CPU cores shared with other jobs,
load 7-10), most of it the five interpreter starts and the MSA run's torch-reference attention.
"""

import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_real_text.py"
PLOT = ROOT / "examples" / "plot_training.py"


@pytest.fixture
def example(monkeypatch):
    """The training script as a module (its folder on sys.path, as when it runs)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("train_real_text")


def _run(script, *args):
    env = dict(os.environ)
    env.pop("FLASH_MSA_BACKEND", None)  # --tiny picks the torch backend itself
    res = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def _finite(x):
    return isinstance(x, float) and math.isfinite(x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_real_text")
    dense, msa, ckpt = tmp / "dense", tmp / "msa", tmp / "msa.pt"
    _run(SCRIPT, "--tiny", "--attn", "dense", "--out", dense)
    _run(SCRIPT, "--tiny", "--attn", "msa", "--out", msa, "--train-only", "--save", ckpt)
    assert "heldout" not in json.loads((msa / "summary.json").read_text())
    _run(SCRIPT, "--tiny", "--attn", "msa", "--out", msa, "--load", ckpt, "--eval-only")
    svg = tmp / "plot.svg"
    table = _run(PLOT, dense, msa, "--out", svg, "--smooth", "4").stdout
    return dict(dense=dense, msa=msa, svg=svg, table=table)


def test_steps_and_learning(runs, example):
    """One line per step with the fields the brief names; both runs see the same batches and
    learn (the loss falls by more than the step-to-step noise); during the dense warmup the
    MSA model is the dense model plus an indexer that no main-loss gradient reaches, so its
    losses equal the dense run's (fp32, same initialization)."""
    tiny = example.TINY
    dense, msa = _steps(runs["dense"]), _steps(runs["msa"])
    assert len(dense) == len(msa) == tiny["steps"]
    W = tiny["warmup_steps"]
    assert [r["phase"] for r in dense] == ["dense"] * len(dense)
    assert [r["phase"] for r in msa] == ["warmup"] * W + ["sparse"] * (len(msa) - W)
    for run in (dense, msa):
        for r in run:
            assert _finite(r["loss"]) and _finite(r["step_seconds"]) and r["step_seconds"] > 0
            assert r["tokens"] == tiny["batch"] * tiny["seq_len"]
        assert [r["tokens_total"] for r in run] == [
            r["tokens"] * (i + 1) for i, r in enumerate(run)
        ]
        first, last = run[0]["loss"], sum(r["loss"] for r in run[-4:]) / 4
        assert first > 5.0  # about ln(256) at the start
        assert last < first - 1.0, (first, last)
        held = [r["heldout_loss"] for r in run if "heldout_loss" in r]
        assert len(held) >= 2 and all(_finite(h) for h in held) and held[-1] < first
    assert [r["chunks"] for r in dense] == [r["chunks"] for r in msa]
    assert all(r["kl"] is None for r in dense)
    assert all(_finite(r["kl"]) and r["kl"] >= 0 for r in msa)
    for a, b in zip(dense[:W], msa[:W]):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["step"], a["loss"], b["loss"])


def _check_heldout(h, seq_len):
    assert _finite(h["loss"]) and 0 < h["loss"] < 6.0
    assert list(h["buckets"]) == ["0-1K"]  # 512-byte sequences: the first bucket only
    assert all(_finite(v) for v in h["buckets"].values())
    assert len(h["bins"]) == 32 and h["bin_tokens"] * 32 == seq_len
    assert abs(sum(h["bins"]) / 32 - h["loss"]) < 1e-6


def test_summaries(runs, example):
    tiny = example.TINY
    dense = json.loads((runs["dense"] / "summary.json").read_text())
    msa = json.loads((runs["msa"] / "summary.json").read_text())
    assert dense["init_checksum"] == msa["init_checksum"]  # the same initial backbone
    assert dense["parameters"]["backbone"] == msa["parameters"]["backbone"]
    assert dense["parameters"]["indexer"] == 0 < msa["parameters"]["indexer"]
    for s in (dense, msa):
        assert s["tokens_trained"] == tiny["steps"] * tiny["batch"] * tiny["seq_len"]
        assert s["corpus"]["bytes_train"] > 0 and s["corpus"]["bytes_test"] > 0
        assert s["corpus"]["files_test"] >= 1
        _check_heldout(s["heldout"], tiny["seq_len"])
    assert set(dense["step_seconds_median"]) == {"dense"}
    assert set(msa["step_seconds_median"]) == {"warmup", "sparse"}
    by_prec = msa["heldout_by_precision"]
    assert set(by_prec) == {"bf16", "fp8"}
    for res in by_prec.values():  # the torch backend runs every selection precision
        _check_heldout(res, tiny["seq_len"])
    assert by_prec["bf16"] == msa["heldout"]
    _check_heldout(msa["heldout_dense_attention"], tiny["seq_len"])
    sel = msa["selection"]
    layers = tiny["layers"]
    assert set(sel) == {"proxy_vs_oracle", "fp8_vs_exact"}
    for key in sel:
        assert isinstance(sel[key], list) and len(sel[key]) == layers, sel[key]
        for m in sel[key]:
            assert 0.0 <= m["recall"] <= 1.0 and 0.0 <= m["exact_rows"] <= 1.0
            assert 0.0 < m["covered_mass"] <= 1.0 + 1e-6 and m["mass_ratio"] > 0
    for m in sel["proxy_vs_oracle"]:  # the oracle keeps the most mass: nothing covers more
        assert m["covered_mass"] <= m["oracle_covered_mass"] + 1e-6
        assert m["mass_ratio"] <= 1.0 + 1e-6
    gate = msa["fp8_gate"]
    assert set(gate) == {"fp8", "gate"}
    for p in ("fp8",):
        g = gate[p]
        assert g["min_mass_ratio"] == min(m["mass_ratio"] for m in sel[f"{p}_vs_exact"])
        rel = by_prec[p]["loss"] / by_prec["bf16"]["loss"] - 1
        assert abs(g["loss_rel"] - rel) < 1e-12
        assert g["passes"] == (g["min_mass_ratio"] >= 0.995 and g["loss_rel"] <= 0.002)


def test_plot(runs):
    root = ET.parse(runs["svg"]).getroot()
    assert root.tag.endswith("svg")
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) >= 2 + 2 + 2 * 2  # train + held-out per run; recall, mass: proxy, fp8
    bars = [r for r in root.findall(f"{ns}rect") if r.get("fill", "").startswith("#")]
    assert len(bars) >= 3  # dense, msa bf16, fp8 in the one bucket
    text = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
    for word in ("held-out", "fp8", "proxy recall vs oracle", "0-1K"):
        assert word in text


def test_table(runs):
    """The plot script's Markdown table: a row per model and precision, the MSA rows with
    their difference to the dense run, and the step times per phase."""
    rows = [line for line in runs["table"].splitlines() if line.startswith("| ")]
    losses = {r.split(" | ")[0][2:]: r for r in rows}
    assert {"dense (dense)", "msa bf16 (msa)", "msa fp8 (msa)"} <= set(losses)
    dense = json.loads((runs["dense"] / "summary.json").read_text())["heldout"]["loss"]
    assert f"{dense:.4f}" in losses["dense (dense)"]
    assert "%)" in losses["msa bf16 (msa)"] and "%)" not in losses["dense (dense)"]
    assert any("warmup" in r and "sparse" in r for r in rows)


def test_corpus_split_is_by_document(example):
    """The held-out split depends on the document's path alone, and takes about the asked
    fraction of a large set of paths."""
    ex = example
    paths = [f"pkg{i % 97}/mod{i}.py" for i in range(20000)]
    first = [ex.is_test_document("site", p, 0.02) for p in paths]
    assert first == [ex.is_test_document("site", p, 0.02) for p in paths]
    assert 0.015 < sum(first) / len(paths) < 0.025
    assert ex.bucket_edges(32768) == [
        ("0-1K", 0, 1024),
        ("1-4K", 1024, 4096),
        ("4-16K", 4096, 16384),
        ("16-32K", 16384, 32768),
    ]
    assert [b[0] for b in ex.bucket_edges(65536)][-1] == "32-64K"


def test_stop_step_matches_the_full_run(runs, tmp_path, example):
    """``--stop-step`` ends a run early on the full run's schedule: its steps are the full
    run's first steps (same batches, same learning rates, same losses)."""
    stop = example.TINY["warmup_steps"] - 2
    _run(
        SCRIPT, "--tiny", "--attn", "dense", "--out", tmp_path, "--stop-step", stop, "--train-only"
    )
    short, full = _steps(tmp_path), _steps(runs["dense"])[:stop]
    assert [r["step"] for r in short] == list(range(stop))
    for a, b in zip(short, full):
        assert a["chunks"] == b["chunks"] and a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) < 1e-5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == stop and "heldout" not in summary
