"""The import graph of ``flash_msa``, read from the source with ``ast``: no cycles, and no import
of a ``flash_msa`` module inside a function (a local import hides a cycle from the reader and
from this test's module-level view alike, so every import counts, wherever it stands).

Edges: ``import flash_msa.x`` and ``from flash_msa.x import y`` (relative forms resolved) import
``flash_msa.x``; ``from flash_msa import x`` (``from . import x``) imports ``flash_msa.x`` where
``x`` is a module, else the package ``flash_msa``. A module ``a.b.c`` does not import its parents
by this test's count (Python runs their ``__init__`` first, but that is not a dependency the
module's author wrote). Inside a function only the standard library and optional third-party
packages (``OPTIONAL``: the package must import without them) may be imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "flash_msa"
# third-party packages a flash_msa module may import inside a function: optional dependencies
# (the package imports without them; the function that needs one says so when it is missing)
OPTIONAL = ("cutlass", "cuda", "triton", "transformers", "flash_attn", "matplotlib")


def _modules() -> dict[str, Path]:
    """``{dotted name: path}`` of every module of the package (``__init__`` as the package)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of a ``from``-import's base (``level`` dots, then ``target``)."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """``(imported name, line, inside a function)`` of every import statement of ``name``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    out = []

    def visit(node, local: bool):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(name, child.level, child.module)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if sub in MODULES else base, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return out


def _internal(target: str) -> str | None:
    """The package module ``target`` names (its longest known prefix), or None if outside."""
    parts = target.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` (self-imports left out)."""
    g = {}
    for name in MODULES:
        g[name] = {_internal(t) for t, _, _ in _imports(name)} - {None, name}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_graph_sees_the_package():
    """The graph covers the package and resolves relative imports (a guard on the test)."""
    assert "flash_msa.cute" in MODULES and "flash_msa.api" in MODULES
    g = graph()
    assert "flash_msa.problem" in g["flash_msa.limits"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(graph())
    g = graph()
    text = "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{v} -> {sorted(g[v] & set(c))}" for v in c)
        for c in found
    )
    assert not found, f"import cycles in {PACKAGE}:\n{text}"


def test_no_function_local_imports():
    """Inside functions only the standard library and optional third-party packages
    (``OPTIONAL``) are imported: no flash_msa module, no required dependency."""
    bad = []
    for name in MODULES:
        for target, line, local in _imports(name):
            top = target.split(".")[0]
            if local and top not in OPTIONAL and top not in sys.stdlib_module_names:
                bad.append(f"{MODULES[name].relative_to(SRC)}:{line}: {target}")
    assert not bad, "function-local imports:\n" + "\n".join(bad)


def test_nothing_imports_the_cute_package_back():
    """The CuTe package's ``__init__`` is its dispatch: none of its own modules import it."""
    g = graph()
    back = [v for v in g if v.startswith("flash_msa.cute.") and "flash_msa.cute" in g[v]]
    assert not back, f"modules importing flash_msa.cute's __init__: {back}"


# What a CuTe kernel module (device code: ``cute/*_sm90.py``) may import from the package: the
# shared device helpers, another kernel module (a subclass's base) and the package's leaf
# modules of plain data and arithmetic. Host code (launch arguments, torch tensors, the compile
# cache, the choice between kernels) lives in the op's host module, which imports the kernels.
KERNEL_IMPORTS = (
    "flash_msa.cute.common", "flash_msa.problem", "flash_msa.worklist", "flash_msa.quant",
    "flash_msa.cubin",
)  # fmt: skip


def _kernel_modules() -> list[str]:
    return [n for n in MODULES if n.startswith("flash_msa.cute.") and n.endswith("_sm90")]


def test_kernel_modules_import_only_device_helpers():
    g = graph()
    kernels = _kernel_modules()
    assert len(kernels) >= 8, kernels  # (a guard on the test: the kernels are found)
    bad = {
        k: sorted(t for t in g[k] if t not in KERNEL_IMPORTS and t not in kernels) for k in kernels
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"kernel modules importing host code: {bad}"


def test_kernel_modules_define_one_kernel_class():
    """One kernel class per file (a class with a ``@cute.kernel`` method), except the work
    list's five passes, which share its scan helpers in one file."""
    counts = {}
    for k in _kernel_modules():
        tree = ast.parse(MODULES[k].read_text())
        counts[k] = sum(
            isinstance(c, ast.ClassDef)
            and any(
                isinstance(f, ast.FunctionDef)
                and any(ast.unparse(d).endswith("kernel") for d in f.decorator_list)
                for f in c.body
            )
            for c in tree.body
        )
    bad = {k: n for k, n in counts.items() if n != 1 and k != "flash_msa.cute.worklist_sm90"}
    assert not bad, f"kernel modules with other than one kernel class: {bad}"
    assert counts["flash_msa.cute.worklist_sm90"] == 5
