"""``flash-msa check`` and the benchmark's verification can fail: a backend with plausible wrong
gradients (proxy gradient 25% too large, dv 20% too small: the issue's example) fails both.

On the CPU the check runs the torch backend (and Triton under the interpreter) in fp32; these
tests plant the bug in the torch backend's ``bwd`` (the check's same-dtype yardstick is bound at
import, so the planted bug does not move it) and check only that backend, to stay fast.
"""

import pytest
import torch

from flash_msa import bench, diagnostics, reference
from flash_msa.cli import main

GRADS = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")
# (name, {gradient: factor}): the examples, one at a time
PLANTS = [
    ("proxy x1.25", {"dq_proxy": 1.25, "dk_proxy": 1.25}),
    ("dv x0.8", {"dv": 0.8}),
    ("dk_proxy x1.01", {"dk_proxy": 1.01}),  # a 1% error is far above fp32 noise too
]


def _plant(monkeypatch, module, factors):
    real = module.bwd

    def wrong(*args, **kw):
        g = real(*args, **kw)
        return g._replace(
            **{n: getattr(g, n) * f for n, f in factors.items() if getattr(g, n) is not None}
        )

    monkeypatch.setattr(module, "bwd", wrong)


def test_check_passes_the_torch_backend():
    rows = list(diagnostics.check(names=["torch"]))
    assert rows and all(r["status"] == "PASS" for r in rows), [
        r for r in rows if r["status"] != "PASS"
    ]
    quantities = {r["quantity"] for r in rows}
    assert quantities >= {"out", "kl", *GRADS, "selection: rows differing"}
    # the tolerance is the rule's, not a loose relative one: fp32 noise, far below 1e-3
    assert max(r["tol"] for r in rows) < 1e-4


def test_info_and_check_commands(capsys):
    """``flash-msa info`` lists the ops; ``flash-msa check --backend torch`` passes and says so
    (the check of every backend is CI's first command; bench without a GPU is tested below)."""
    assert main(["info"]) == 0
    assert "select" in capsys.readouterr().out
    assert main(["check", "--backend", "torch"]) == 0
    assert "0 failed" in capsys.readouterr().out


@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_check_fails_wrong_gradients(plant, monkeypatch):
    _, factors = plant
    _plant(monkeypatch, reference, factors)
    rows = list(diagnostics.check(names=["torch"]))
    failed = {r["quantity"] for r in rows if r["status"] == "FAIL"}
    assert failed == set(factors), failed  # the planted gradients fail, nothing else
    # every case that runs a backward catches it
    per_case = {r["case"] for r in rows if r["status"] == "FAIL"}
    assert per_case == {c[0] for c in diagnostics.CASES}


def test_cli_check_exit_code(monkeypatch, capsys):
    assert main(["check", "--backend", "torch"]) == 0
    assert " 0 failed" in capsys.readouterr().out
    _plant(monkeypatch, reference, {"dv": 0.8})
    assert main(["check", "--backend", "torch"]) == 1
    out = capsys.readouterr().out
    assert "dv" in out and "FAIL" in out and " 0 failed" not in out


def test_check_fails_wrong_forward(monkeypatch):
    real = reference.fwd

    def wrong(*args, **kw):  # out off by 1e-4 in one row: 1000x fp32 noise
        res = real(*args, **kw)
        out = res.out.clone()
        out[3] += 1e-4
        return res._replace(out=out)

    monkeypatch.setattr(reference, "fwd", wrong)
    rows = list(diagnostics.check(names=["torch"]))
    assert "out" in {r["quantity"] for r in rows if r["status"] == "FAIL"}


def test_check_rejects_unknown_backend():
    with pytest.raises(ValueError, match="names: unknown backend 'cuda'"):
        list(diagnostics.check(names=["cuda"]))


# ---------------------------------------------------------------------------------------------
# flash-msa bench: the provider's training step is verified before it is timed
# ---------------------------------------------------------------------------------------------
SHAPE = (1, 4, 2, 2, 1, 16, 16, ())  # B, H, Hkv, Hp, Hpk, D, Dp, seqlens (bench.SHAPES form)
TINY = dict(S=300, top_k=2, block_size=64, device="cpu", dtype=torch.float32)  # 5 blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bench_verify_passes(backend):
    ok, msg = bench.verify_msa(backend, SHAPE, **TINY)
    assert ok, msg
    assert "selection rows differing 0" in msg


@pytest.mark.parametrize("plant", PLANTS, ids=[p[0] for p in PLANTS])
def test_bench_verify_fails_wrong_gradients(plant, monkeypatch):
    _, factors = plant
    _plant(monkeypatch, reference, factors)
    ok, msg = bench.verify_msa("torch", SHAPE, **TINY)
    assert not ok
    failed = msg.split("FAILED: ")[1]
    assert {part.split()[0] for part in failed.split(", ")} == set(factors), msg


def test_bench_verify_fails_wrong_triton_gradient(monkeypatch):
    from flash_msa import triton_ref

    _plant(monkeypatch, triton_ref, {"dq": 0.9})
    ok, msg = bench.verify_msa("triton", SHAPE, **TINY)
    assert not ok and "FAILED: dq " in msg, msg


# ---------------------------------------------------------------------------------------------
# flash-msa bench --cuda-graph: the steps replayed from a CUDA graph (the capture needs a GPU;
# the flag, the steps captured, the replay's check and the table are checked here)
# ---------------------------------------------------------------------------------------------
def test_bench_cuda_graph_flag(monkeypatch, capsys):
    from flash_msa import cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_bench", lambda args: seen.append(args) or 0)
    assert main(["bench", "--cuda-graph", "--dense"]) == 0
    assert main(["bench"]) == 0
    assert [a.cuda_graph for a in seen] == [True, False]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--cuda-graph" in capsys.readouterr().out


def _steps_on_cpu(prov):
    xs = [x.requires_grad_() for x in bench_inputs()]
    return bench.graph_steps(prov, xs, bench._dense_providers())


def bench_inputs():
    from flash_msa import testing

    B, H, Hkv, Hp, Hpk, D, Dp, _ = SHAPE
    return testing.make_inputs(1, 300, H, Hkv, Hp, Hpk, D, Dp, dtype=torch.float32, seed=1)


def test_bench_graph_steps_return_outputs_and_gradients():
    """The steps a graph captures return every output and gradient, fresh each call, equal from
    call to call (torch backend and SDPA on the CPU), and the compute_kl=False step has kl = 0
    and the KL step's gradients."""
    steps = _steps_on_cpu("torch")
    assert set(steps) == {"step_graph_ms", "step_nokl_graph_ms"}
    step, names = steps["step_graph_ms"]
    first, again = step(), step()
    assert len(first) == len(names) == 7 and first[0].data_ptr() != again[0].data_ptr()
    assert bench.graph_mismatch(names, first, first, again) == []
    nokl, _ = steps["step_nokl_graph_ms"]
    no = nokl()
    assert no[1].item() == 0 and first[1].item() > 0
    grads = slice(2, None)
    assert bench.graph_mismatch(names[grads], no[grads], first[grads], again[grads]) == []
    step, names = _steps_on_cpu("sdpa")["step_graph_ms"]
    dense = step()
    assert names == ("out", "dq", "dk", "dv") and len(dense) == 4
    # no output keeps the step's autograd graph (and with it the leaves' AccumulateGrad nodes,
    # whose stream broke the first CUDA-graph capture of a process: bench.graph_steps)
    assert all(t.grad_fn is None for t in (*first, *no, *dense))


def test_bench_graph_mismatch_reports_skipped_and_wrong_work():
    from flash_msa import testing

    g = torch.Generator().manual_seed(0)
    eager = [torch.randn(64, 8, generator=g).bfloat16(), torch.tensor(1.7)]
    # a second eager step with fp32 accumulations in another order: one rounding apart
    again = [eager[0].float().mul(1 + 2**-9).bfloat16(), eager[1] + 1e-7]
    names = ("out", "kl")
    assert bench.graph_mismatch(names, [t.clone() for t in eager], eager, again) == []
    assert bench.graph_mismatch(names, again, eager, again) == []  # within the eager spread
    # a kernel the replay did not run leaves the poisoned (NaN) buffer: err = inf
    skipped = [testing.poison(eager[0].clone()), eager[1].clone()]
    assert bench.graph_mismatch(names, skipped, eager, again) == ["out inf > " + _tol(eager, 0)]
    # a part computed wrongly (one row 10% off: 1% is below bf16 rounding at max |out| ~ 3),
    # or a wrong KL value (0.1% off: fp32)
    wrong = [eager[0].clone(), eager[1] * 1.001]
    wrong[0][5] *= 1.1
    bad = bench.graph_mismatch(names, wrong, eager, eager)
    assert [b.split()[0] for b in bad] == ["out", "kl"], bad
    bad = bench.graph_mismatch(names, [eager[0][:32], eager[1]], eager, again)
    assert bad == ["out shape (32, 8) != (64, 8)"]


def _tol(eager, i):
    from flash_msa import testing

    return f"{testing.tolerance(eager[i], eager[i], eager[i].dtype):.2e}"


def test_bench_table_graph_columns():
    rows = [
        dict(shape="anchor", S=16384, inputs="random", provider="cute", step_ms=9.0),
        dict(shape="anchor", S=16384, inputs="random", provider="fa4", step_ms=6.0),
    ]
    assert "graph" not in bench.table([dict(r) for r in rows])  # the eager table, unchanged
    rows[0].update(step_graph_ms=5.0, step_nokl_graph_ms=4.8)
    rows[1].update(graph_error="step_graph_ms: RuntimeError: " + "x" * 60)
    header = bench.table(rows).splitlines()[0].split()
    assert header[-3:] == ["step_graph_ms", "step_nokl_graph_ms", "graph_error"]
    rows[1].update(step_graph_ms=6.0)  # fa4 graphed too: the graphed speedup appears
    text = bench.table(rows)
    assert text.splitlines()[0].split()[-2:] == ["graph_speedup_vs_fa4", "graph_error"]
    assert rows[0]["graph_speedup_vs_fa4"] == 6.0 / 5.0
    assert "4.800" in text and "x" * 10 in text and "x" * 41 not in text


def test_bench_graph_failure_is_reported_not_raised():
    """A step whose capture fails (here: no CUDA at all) gives ``graph_error`` naming each
    step and the exception's first line, no time, and no exception out of the bench."""
    res = bench._measure_graph("torch", bench_inputs(), {}, iters=1)
    assert set(res) == {"graph_error"}, res
    parts = res["graph_error"].split("; ")
    assert [p.split(":")[0] for p in parts] == ["step_graph_ms", "step_nokl_graph_ms"], parts
    assert all("\n" not in p for p in parts)


def test_bench_exit_code_counts_graph_errors(monkeypatch, capsys):
    """A graph that failed its check fails the run; one out of memory does not (as eager)."""
    import argparse

    row = dict(shape="anchor", S=16384, inputs="random", provider="cute", step_ms=9.0)
    errors = {
        None: 0,
        "step_graph_ms: RuntimeError: CUDA graph replay differs from the eager step: dq": 1,
        "step_graph_ms: OutOfMemoryError: CUDA out of memory.": 0,
        "step_graph_ms: OutOfMemoryError: x; step_nokl_graph_ms: RuntimeError: capture": 1,
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(
        shape=["anchor"], seqlen=None, backends=["cute"], inputs=["random"], iters=1, dense=[],
        selection_precision=["bf16"], cuda_graph=True, json=None, plot=None,
    )  # fmt: skip
    for error, code in errors.items():
        rows = [dict(row, **({"graph_error": error} if error else {}))]
        monkeypatch.setattr(bench, "run", lambda *a, rows=rows: iter(rows))
        assert bench.main(args) == code, error
    assert "graph_error" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# --version, bench without a GPU, the commit bench records, info's environment variables
# ---------------------------------------------------------------------------------------------
def test_version(capsys):
    import flash_msa

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"flash-msa-kernels {flash_msa.__version__} (import package flash_msa)"
    )


def test_bench_without_gpu_fails_and_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target = tmp_path / "bench.json"
    assert main(["bench", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "was not written" in err and "flash-msa check" in err
    assert not target.exists()


def _git(cwd, *args):
    import subprocess

    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
        env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
             "GIT_COMMITTER_EMAIL": "t@t", "PATH": __import__("os").environ["PATH"]},
    ).stdout.strip()  # fmt: skip


def test_bench_commit_is_the_package_checkouts_only(tmp_path):
    """A checkout (src/flash_msa at its top level) gives its commit, "-dirty" when the
    package's tracked files changed; an installed copy inside some other repository (its
    site-packages) gives None; a directory outside any repository gives None."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    checkout = tmp_path / "checkout"
    pkg = checkout / "src" / "flash_msa"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-qm", "x")
    head = _git(checkout, "rev-parse", "--short", "HEAD")
    assert bench.source_commit(str(pkg)) == head
    (pkg / "__init__.py").write_text("changed = 1\n")
    assert bench.source_commit(str(pkg)) == head + "-dirty"
    installed = checkout / ".venv" / "lib" / "python3" / "site-packages" / "flash_msa"
    installed.mkdir(parents=True)
    assert bench.source_commit(str(installed)) is None
    alone = tmp_path / "alone" / "flash_msa"
    alone.mkdir(parents=True)
    assert bench.source_commit(str(alone)) is None
    env = bench.environment()
    assert env["flash_msa"] == __import__("flash_msa").__version__ and "commit" in env


def _env_reads():
    """The environment variable names src/ reads: os.environ.get/[]/getenv of a literal, or
    of a module constant NAME_ENV = "..." (one regex pass over every source file)."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "flash_msa"
    text = "\n".join(p.read_text() for p in src.rglob("*.py"))
    read = r"(?:environ\.get|environ\[|getenv)\(?\s*"
    literal = re.findall(read + r"""["']([A-Z][A-Z0-9_]*)["']""", text)
    consts = dict(re.findall(r"""^\s*([A-Z_]+_ENV)\s*=\s*["']([A-Z][A-Z0-9_]*)["']""", text, re.M))
    via_const = re.findall(read + r"([A-Z_]+_ENV)\b", text)
    assert via_const, "the regex found no constant read: it no longer matches src/"
    return set(literal) | {consts[c] for c in via_const}


def test_info_lists_every_environment_variable_read(capsys, monkeypatch):
    from flash_msa import cli

    reads = _env_reads()
    assert {"FLASH_MSA_BACKEND", "FLASH_MSA_CACHE_DIR", "FLASH_MSA_SMEM_LIMIT"} <= reads
    missing = {v for v in reads - set(cli.ENV_VARS) if not v.startswith(tuple(cli.ENV_PREFIXES))}
    assert not missing, f"read in src/ but not listed by flash-msa info: {sorted(missing)}"
    monkeypatch.setenv("FLASH_MSA_DETERMINISTIC", "1")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for var in cli.ENV_VARS:
        assert var in out, var
    line = next(x for x in out.splitlines() if "FLASH_MSA_DETERMINISTIC" in x)
    assert " 1 " in line and "bitwise" in line  # the value, then the meaning
    assert "CUTE_DSL_ARCH" in out and "sm_90a" in out


def test_help_explains_shapes_and_defaults(capsys):
    for argv, words in (
        ([], ("q (B, S, H, D)", "block_size", "top_k")),
        (["bench"], ("anchor: B=1 H=16", "default 5", "on a CUDA GPU", "status 2")),
        (["check"], ("fp64", "Exit status")),
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for w in words:
            assert w in out, (argv, w)
