"""The README's example runs as written (CPU, a few seconds)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_msa_layer_example_trains():
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "msa_layer.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    kls = [float(line.split("kl")[1]) for line in res.stdout.splitlines() if "kl" in line]
    assert len(kls) == 3 and kls[-1] < kls[0]  # the proxy learns
