"""The distribution as a user gets it: ``python -m build`` makes an sdist and a wheel named
flash-msa-kernels; the wheel installs into a fresh venv (no dependencies fetched: the test's
own torch is visible to it) and imports and runs from there; its dependency markers leave
macOS arm64 and Windows only what installs there (torch), the GPU stacks on Linux; the package
imports and runs its torch backend with triton and the CuTe stack blocked from importing; and
importing it warns when PyPI's other ``flash-msa`` distribution is installed next to it."""

import email
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

import flash_msa

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the sources a build reads (pyproject.toml's readme, license-files and packages)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")
GPU_STACK = {"triton", "nvidia-cutlass-dsl", "apache-tvm-ffi"}
PLATFORMS = {  # the marker variables pip evaluates on each
    "macos-arm64": dict(sys_platform="darwin", platform_system="Darwin", os_name="posix",
                        platform_machine="arm64"),
    "windows-amd64": dict(sys_platform="win32", platform_system="Windows", os_name="nt",
                          platform_machine="AMD64"),
    "linux-x86_64": dict(sys_platform="linux", platform_system="Linux", os_name="posix",
                         platform_machine="x86_64"),
    "linux-aarch64": dict(sys_platform="linux", platform_system="Linux", os_name="posix",
                          platform_machine="aarch64"),
}  # fmt: skip


def _env_without_pythonpath():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """``(sdist, wheel)`` paths built from a copy of the sources (the checkout stays clean)."""
    pytest.importorskip("build")
    work = tmp_path_factory.mktemp("build")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, work / name)
    out = work / "dist"
    # --no-isolation: the build backend (setuptools) of this environment, no download
    res = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(work)],
        capture_output=True,
        text=True,
        env=_env_without_pythonpath(),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return sdists[0], wheels[0]


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name)), z.namelist()


def test_build_makes_sdist_and_wheel_named_flash_msa_kernels(dist):
    sdist, wheel = dist
    version = flash_msa.__version__
    assert sdist.name == f"flash_msa_kernels-{version}.tar.gz"
    assert wheel.name == f"flash_msa_kernels-{version}-py3-none-any.whl"
    meta, names = _metadata(wheel)
    assert meta["Name"] == "flash-msa-kernels" and meta["Version"] == version
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "flash_msa/integrations/hf.py" in names and "flash_msa/cute/__init__.py" in names
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in names)
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    assert "numpy" not in {r.name for r in requires if not r.marker or "extra" not in str(r.marker)}


def _active(requires, platform, extras=()):
    """The requirement names pip would install on ``platform`` with ``extras``."""
    names = set()
    for extra in ("", *extras):
        env = {**default_environment(), **PLATFORMS[platform], "extra": extra}
        names |= {r.name for r in requires if r.marker is None or r.marker.evaluate(env)}
    return names


def test_dependencies_resolve_per_platform(dist):
    """No network: the wheel's Requires-Dist markers. macOS arm64 and Windows have no triton
    wheel and no nvidia-cutlass-dsl-libs-base wheel for macOS (pip download --only-binary),
    so there the runtime dependencies (and those of the cu13 extra) must be torch alone."""
    meta, _ = _metadata(dist[1])
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    for platform in ("macos-arm64", "windows-amd64"):
        assert _active(requires, platform, extras=("cu13",)) == {"torch"}, platform
    for platform in ("linux-x86_64", "linux-aarch64"):
        assert _active(requires, platform) == {"torch"} | GPU_STACK, platform
    # every 0.x package and the DSL carry an upper bound (versions not run are not allowed in)
    for r in requires:
        if r.name in GPU_STACK:
            assert any(s.operator in ("<", "<=", "==") for s in r.specifier), str(r)


def _fresh_venv(path):
    """A venv that sees this environment's packages behind its own (a .pth line appends
    them to sys.path; their own .pth files, such as an editable install's, are not run)."""
    venv.EnvBuilder(with_pip=False).create(path)
    bindir = path / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    parents = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    pathlib.Path(site, "parent_env.pth").write_text("\n".join(parents) + "\n")
    return python, bindir, pathlib.Path(site)


def test_wheel_installs_into_a_fresh_venv_and_runs(dist, tmp_path):
    python, bindir, site = _fresh_venv(tmp_path / "venv")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(dist[1])],
        capture_output=True, text=True, env=_env_without_pythonpath(),
    )  # fmt: skip
    if res.returncode and "no such option" in res.stderr:
        pytest.skip("pip older than 22.3 (no --python)")
    assert res.returncode == 0, res.stderr
    env = _env_without_pythonpath()
    code = "import flash_msa, torch; print(flash_msa.__file__); print(flash_msa.__version__)"
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    where, version = res.stdout.split()
    assert pathlib.Path(where).is_relative_to(site), where  # the wheel's copy, not the checkout
    assert version == flash_msa.__version__
    script = bindir / ("flash-msa.exe" if os.name == "nt" else "flash-msa")
    res = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"flash-msa-kernels {version} (import package flash_msa)"


BLOCKED = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "cutlass", "tvm_ffi"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Blocked())
"""


def test_torch_backend_runs_without_triton_and_cutlass():
    code = BLOCKED + textwrap.dedent("""
        import torch
        import flash_msa
        from flash_msa import testing
        from flash_msa.cli import main
        q_proxy, k_proxy, q, k, v = testing.make_inputs(
            1, 200, 4, 2, 2, 1, 16, 16, dtype=torch.float32, seed=0)
        out, kl = flash_msa.msa_attention(q_proxy, k_proxy, q, k, v, 2, block_size=64)
        assert out.shape == q.shape and torch.isfinite(out).all() and torch.isfinite(kl)
        assert flash_msa.info()["devices"]["cpu"]["ops"]["select"]["backend"] == "torch"
        assert main(["info"]) == 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "cutlass"))
        assert not loaded, loaded
        print("ran")
    """)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env={**os.environ, "FLASH_MSA_BACKEND": "auto", "TRITON_INTERPRET": "0"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ran" in res.stdout
    assert "triton is not importable" in res.stdout  # info says why, it does not fail


def _fake_dist(root, name, version, entry_point=None):
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_point:
        (info / "entry_points.txt").write_text(f"[console_scripts]\nflash-msa = {entry_point}\n")


def _import_warnings(site):
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as seen:
            import flash_msa
            import importlib; importlib.import_module("flash_msa")  # a second import: no rerun
        hits = [w for w in seen if issubclass(w.category, flash_msa.ConflictingDistributionWarning)]
        assert all(issubclass(w.category, UserWarning) for w in hits)
        print(len(hits)); [print(w.message) for w in hits]
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    count, *messages = res.stdout.strip().splitlines()
    return int(count), "\n".join(messages)


def test_warns_once_when_the_other_flash_msa_is_installed(tmp_path):
    _fake_dist(tmp_path / "other", "flash-msa", "0.1.1")
    count, message = _import_warnings(tmp_path / "other")
    assert count == 1
    assert "flash-msa 0.1.1 (a different project)" in message
    assert "pip uninstall flash-msa flash-msa-kernels" in message
    # this project installed under the old name (its console script) is not the other one
    _fake_dist(tmp_path / "own", "flash-msa", "0.1.0.dev0", entry_point="flash_msa.cli:main")
    assert _import_warnings(tmp_path / "own")[0] == 0
