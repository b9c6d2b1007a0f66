"""The docs describe the software as it is: no development history in the code, README, docs or
tests (history belongs to git); docs/design.md's module map is the package's module list; the
README's links resolve, its CPU snippet runs as written, and it stays short."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "flash_msa"

# Words that date a line to how the software was made rather than what it does.
_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
HISTORY = re.compile(
    rf"\b(?:{_ORDINALS}) session\b"
    r"|\bsession \d+"
    r"|\bstage ?\d"
    r"|\bissue \d+"
    r"|\breview [A-Z]\d"
    r"|\bF\d+ finding"
    r"|until (?:its|the next) (?:H200 )?run",
    re.IGNORECASE,
)
# Files allowed to hold those words, and why: this test states them.
HISTORY_ALLOWED = {"tests/integration/test_docs.py"}
SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh"}


def _history_files():
    yield ROOT / "README.md"
    for top in ("src", "docs", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def _lines():
    """``(file, line number, text)`` of every checked file but the allowed ones."""
    for path in _history_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in HISTORY_ALLOWED:
            for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                yield rel, no, line


def history_lines():
    """Every ``file:line: text`` of the tree that matches :data:`HISTORY`."""
    return [f"{rel}:{no}: {line.strip()}" for rel, no, line in _lines() if HISTORY.search(line)]


def test_history_pattern_catches_what_it_names():
    for line in (
        "measured in the fourteenth session",
        "Session 11 H200 results",
        "see stage13/c4_final",
        "the CuTe stage 3 kernels",
        "issue 15's gate",
        "review F2 mends",
        "the F1 finding of the review",
        "declared until its H200 run",
        "off until the next run",
    ):
        assert HISTORY.search(line), line
    for line in ("a two-stage ring", "stages=6", "first-session cache", "the issue tracker"):
        assert not HISTORY.search(line), line


def test_no_history_words():
    hits = history_lines()
    assert not hits, f"{len(hits)} lines carry development history:\n" + "\n".join(hits)


RESULT_PATH = re.compile(
    r"benchmarks/results/[\w./*-]*[\w*]|benchmarks/sessions/|docs/reviews/|docs/perf-notes\.md"
)


def stale_references():
    """Every ``file:line: path`` that names a result file, folder or page the tree does not hold
    (the development diary, reviews and session scripts are git history; result files are
    renamed by workload and hardware)."""
    return [
        f"{rel}:{no}: {ref}"
        for rel, no, line in _lines()
        for ref in RESULT_PATH.findall(line)
        if not any(ROOT.glob(ref.rstrip("/")))
    ]


def test_no_references_to_removed_files():
    hits = stale_references()
    assert not hits, f"{len(hits)} references to files that are gone:\n" + "\n".join(hits)


# ---------------------------------------------------------------------------------------------
# docs/design.md's module map
# ---------------------------------------------------------------------------------------------
def module_map():
    """The modules docs/design.md's module map names, as paths under src/: the first fenced
    block after "## Layers and module map". A line whose first word ends in ``/`` at column 0
    opens a package; an indented first word ending in ``.py`` is a module of the last package
    opened; other lines continue a description."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers and module map", 1)[1]
    block = section.split("```", 2)[1]
    package, names = None, []
    for line in block.splitlines():
        word = line.split()[0] if line.strip() else ""
        if not line.startswith(" ") and word.endswith("/"):
            package = word
        elif line.startswith(" ") and word.endswith(".py"):
            assert package, f"module {word} listed before any package"
            names.append(package + word)
    return names


def test_module_map_lists_every_module():
    listed = module_map()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    actual = {p.relative_to(ROOT / "src").as_posix() for p in PACKAGE.rglob("*.py")}
    missing = sorted(actual - set(listed))
    stale = sorted(set(listed) - actual)
    assert not missing and not stale, f"not in the map: {missing}; in the map, not in src: {stale}"


# ---------------------------------------------------------------------------------------------
# README.md
# ---------------------------------------------------------------------------------------------
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"


def _relative_targets(path):
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        yield target.split("#", 1)[0]


def test_readme_and_docs_links_resolve():
    broken = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in _relative_targets(page):
            if target.startswith("/"):
                broken.append(f"{page.relative_to(ROOT)}: {target} (absolute path)")
            elif not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def cpu_snippet():
    """The fenced python block after README.md's ``<!-- cpu-snippet ... -->`` marker."""
    m = re.search(r"<!-- cpu-snippet[^>]*-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert m, "README.md has no python block after a <!-- cpu-snippet ... --> marker"
    return m.group(1)


def test_readme_cpu_snippet_runs(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(cpu_snippet())
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip(), "the snippet prints nothing"


# ---------------------------------------------------------------------------------------------
# benchmarks/run_all.py: the one script that rewrites benchmarks/results/
# ---------------------------------------------------------------------------------------------
def test_run_all_names_scripts_and_tests_that_exist():
    """Every workload's script, test file and CLI flag is in the tree (a renamed benchmark or
    test would otherwise surface only on the GPU host), and without a GPU it writes nothing
    and exits 1."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--list"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    listed = res.stdout.splitlines()
    assert len(listed) >= 10, res.stdout
    paths = {w for line in listed for w in line.split() if w.startswith(("benchmarks/", "tests/"))}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"run_all.py names files that are not in the tree: {missing}"
    help_text = subprocess.run(
        [sys.executable, "-m", "flash_msa", "bench", "--help"], capture_output=True, text=True
    ).stdout
    flags = {w for line in listed if " bench " in line for w in line.split() if w.startswith("--")}
    unknown = sorted(f for f in flags if f not in help_text)
    assert not unknown, f"run_all.py passes flags flash-msa bench does not take: {unknown}"
