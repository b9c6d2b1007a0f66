"""Persistent on-disk cache of compiled CuTe kernels, shared by the processes of one machine.

:func:`flash_msa.cute.common.run_typed` compiles a kernel on its first call in a process; this
module makes a second process (the other ranks of a training job, the next job) load that compiled
kernel from disk instead: no Python tracing, no MLIR pipeline, no ptxas. nvidia-cutlass-dsl's
own file cache (``CUTE_DSL_CACHE_DIR``) cannot do it: ``cute.compile`` turns it off
(``compile_only`` implies ``no_cache``), and where it is on its key is the hash of the traced IR
module, so every process traces before it can look (docs/design.md, "Compile cache").

What is stored is the DSL's ahead-of-time export: ``JitCompiledFunction.dump_to_object`` (an
ELF object holding the host launch function, its argument signature and the cubin), loaded back
by ``cutlass.cute.runtime.load_module`` as a callable taking the same arguments. On CPU (4.8.1,
sm_90a, anchor configurations): compile + store 2.0 s (selection), 2.8 s (forward partials),
5.3 s (backward), of which the export 0.15 s (selection); load 3-16 ms.

Layout: ``<dir>/cute/<env>/<key>.o`` with ``<dir>`` = ``$FLASH_MSA_CACHE_DIR``, else
``$XDG_CACHE_HOME/flash_msa`` (``~/.cache/flash_msa``); ``<env>`` a hash of the DSL version,
the Python version and the host machine; ``<key>`` a hash of everything a compiled kernel bakes
in: the kernel object (type and every field), the static signature of its arguments, the
device's compute capability, the DSL's compile settings (``CUTE_DSL_ARCH``, ``..._OPT``, ...:
its own cache key text), the compile options, and the source of the modules the kernel's code
comes from (its class's modules and what they import from flash_msa at module level), so an
edited kernel never loads a stale binary. On by default (``FLASH_MSA_CACHE=0`` turns it off):
on the H200 (tests/test_gpu_cute_cache.py) a second process's first anchor-16K training step
took 3.5-3.7 s instead of 13.0-17.7 s, its three CuTe kernels loaded in 4-6 ms each, and its
gradients equal the compiling process's.

Safety: an entry is written to a temporary file and renamed into place (a reader never sees a
partial file, whatever the number of ranks writing at once); its last 48 bytes are a marker and
the SHA-256 of the object, checked before the DSL sees it, so a truncated or corrupted entry is
deleted and recompiled, never loaded; a process that misses takes an exclusive ``flock`` on
``<key>.lock`` while it compiles, so ranks that start together compile each kernel once and the
others wait, then load (after :data:`LOCK_TIMEOUT` seconds they compile without waiting). Any
error of the cache (unwritable directory, unloadable entry) is logged and the kernel compiled
in-process: the cache can cost a compile, never a failure. Loading an entry runs its host code:
the directory must be writable by its user only (the default is).

Not in the key, as in the in-process key: a module constant patched at run time (a test's
``monkeypatch``) that a kernel reads while tracing; such runs need ``FLASH_MSA_CACHE=0`` (the
test suite sets it in tests/conftest.py; a test of the cache turns it on itself).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import enum
import functools
import hashlib
import logging
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

log = logging.getLogger("flash_msa")

DIR_ENV = "FLASH_MSA_CACHE_DIR"
SWITCH_ENV = "FLASH_MSA_CACHE"  # "0" turns the disk cache off (on by default: module docstring)
LOCK_TIMEOUT = 600.0  # seconds a miss waits for another process compiling the same kernel
PREFIX = "flash_msa_kernel"  # symbol prefix of the exported function inside each object
MARKER = b"flash_msa-cute-1"  # 16 bytes, then the SHA-256 of the object: the entry's trailer

# What this process did, for tests and logs: "compiled" (cute.compile ran), "loaded" (from
# disk), "stored", "dropped" (an entry that failed its checksum or did not load: deleted),
# "uncached" (a configuration without a process-independent key: compiled, not stored).
stats: Counter = Counter()
events: list = []  # (kernel class name, "compiled" or "loaded", seconds) per compiled() call


class Uncacheable(Exception):
    """A value without an exact, process-independent text: no disk key."""


def enabled() -> bool:
    """Whether the disk cache is on: ``FLASH_MSA_CACHE`` unset, empty or ``1`` (the default);
    ``0`` turns it off. Raises ValueError naming the variable for any other value."""
    raw = os.environ.get(SWITCH_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{SWITCH_ENV} must be 0 (off) or 1 (on, the default), got {raw!r}")
    return raw != "0"


def root() -> Path:
    """The cache directory: ``$FLASH_MSA_CACHE_DIR``, else ``$XDG_CACHE_HOME/flash_msa``."""
    if d := os.environ.get(DIR_ENV):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash_msa"


def stable_text(x) -> str:
    """Deterministic text of a kernel configuration or argument signature: the same in every
    process for equal values. Dataclasses by type and every field (a ``repr=False`` field
    included), tuples by type and items, classes by qualified name, enums by name, Python
    scalars by ``repr``; raises :class:`Uncacheable` for any other value."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = ", ".join(
            f"{f.name}={stable_text(getattr(x, f.name))}" for f in dataclasses.fields(x)
        )
        return f"{stable_text(type(x))}({fields})"
    if isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    if isinstance(x, (tuple, list)):
        return f"{stable_text(type(x))}[{', '.join(stable_text(a) for a in x)}]"
    if isinstance(x, enum.Enum):
        return f"{stable_text(type(x))}.{x.name}"
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return repr(x)
    # anything else may have a repr that hides part of its value (or shows an address): a
    # key that could name two configurations would load a wrong binary, so none
    raise Uncacheable(f"no exact text for a {type(x).__name__}: {x!r}")


@functools.cache
def _module_imports(path: str, package: str) -> tuple[str, ...]:
    """flash_msa modules imported at module level by the module at ``path``, whose relative
    imports resolve against ``package``: the code a kernel traces can come from these (not
    from imports inside functions, which are host glue). Only the import statements that
    start a line are parsed (a whole-file ``ast.parse`` of bwd_sm90.py took 0.3 s here)."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith(("from ", "import ")):
            continue
        stmt = line
        while (("(" in stmt and ")" not in stmt) or stmt.endswith("\\")) and i + 1 < len(lines):
            i += 1
            stmt += "\n" + lines[i]
        try:
            node = ast.parse(stmt).body[0]
        except SyntaxError:  # a docstring line that starts with "from "
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "flash_msa"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "flash_msa":
                out.append(mod)
                out += [f"{mod}.{a.name}" for a in node.names]  # `from .. import worklist`
    return tuple(out)


def source_files(modules: tuple[str, ...]) -> dict[str, str]:
    """``{module name: file}`` of ``modules`` and of every flash_msa module they import at
    module level, transitively (names that are not modules, and packages, are skipped). Found
    by path under the package's directory: nothing is imported."""
    top = Path(__file__).resolve().parent.parent  # the flash_msa package directory
    seen: dict[str, str] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        path = top.joinpath(*parts[1:]).with_suffix(".py")
        # a package (`from .. import worklist` names flash_msa): its modules are listed by
        # name, its __init__ holds no kernel code; `common.WorkItems` is not a module
        if name in seen or parts[0] != "flash_msa" or len(parts) < 2 or not path.is_file():
            continue
        seen[name] = str(path)
        todo += _module_imports(str(path), name.rpartition(".")[0])
    return seen


@functools.cache
def source_hash(modules: tuple[str, ...]) -> str:
    """SHA-256 of the :func:`source_files` of ``modules`` (read once per process)."""
    files = source_files(modules)
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + Path(files[name]).read_bytes() + b"\0")
    return h.hexdigest()


def kernel_modules(kernel) -> tuple[str, ...]:
    """The flash_msa modules defining the classes of ``kernel``'s type (subclasses included:
    a warp-specialized kernel traces its base class's methods)."""
    return tuple(
        sorted({c.__module__ for c in type(kernel).__mro__ if c.__module__.startswith("flash_msa")})
    )


@functools.cache
def env_tag() -> str:
    """The ``<env>`` directory name: the DSL, Python and host machine the objects are for."""
    import cutlass

    text = f"cutlass-dsl={cutlass.__version__};py={sys.version_info[:2]};{platform.machine()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dsl_settings() -> str:
    """The DSL's own compile-affecting settings (``CUTE_DSL_ARCH``, ``CUTE_DSL_COMPILER_OPT``,
    line info, assertions, ...), as its in-memory cache keys them."""
    try:  # the DSL's own text (a private accessor in 4.8.1: CuTeDSL._get_dsl)
        from cutlass.cutlass_dsl import CuTeDSL

        return CuTeDSL._get_dsl().envar.cache_key_str()
    except Exception:  # another DSL version: every CUTE_DSL_ variable (some needlessly)
        return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_")))


def entry_path(kernel, signature, target: str, options: str = "") -> Path | None:
    """Where the compiled ``kernel`` for arguments of static signature ``signature`` on device
    ``target`` (e.g. ``"sm_90"``) with compile ``options`` is stored; ``None`` where the disk
    cache is off or the configuration has no process-independent text (``stats["uncached"]``)."""
    if not enabled():
        return None
    try:
        text = "\n".join(
            (
                stable_text(kernel),
                stable_text(signature),
                target,
                options,
                dsl_settings(),
                source_hash(kernel_modules(kernel)),
            )
        )
        key = hashlib.sha256(text.encode()).hexdigest()
        return root() / "cute" / env_tag() / f"{key}.o"
    except Uncacheable as e:
        log.info("flash_msa: %s is not cached on disk: %s", type(kernel).__name__, e)
    except Exception as e:  # e.g. a source file gone: no key, compile as without the cache
        log.warning("flash_msa: no compile cache key for %s: %s", type(kernel).__name__, e)
    stats["uncached"] += 1
    return None


@functools.cache
def _runtime_loaded() -> None:
    """Load the DSL's runtime library with global symbols: exporting an object resolves the
    launch function's CUDA runtime symbols against it (without this, 4.8.1 fails with
    "Symbols not found: _cudaLaunchKernelEx, ..."); done before a load too, as
    FlashAttention-4's cache does before loading its objects."""
    import cutlass.cute as cute

    try:
        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError) as e:  # then an export fails and is logged
        log.warning("flash_msa: cannot load the CuTe DSL runtime library globally: %s", e)


TVM_FFI = "--enable-tvm-ffi"  # the compile option of TVM-FFI functions (common.FFI_OPTIONS)


def _tvm_ffi(options: str) -> bool:
    """Whether ``options`` compile a TVM-FFI function: stored by its own export, loaded as a
    TVM-FFI module."""
    return TVM_FFI in options.split()


def load(path: Path, options: str = ""):
    """The compiled function stored at ``path``, or ``None`` if there is none. An entry that
    fails its checksum or does not load is deleted (``stats["dropped"]``) and ``None``
    returned: it will be compiled again. ``options``: the compile options it was stored with."""
    import cutlass.cute as cute

    _runtime_loaded()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("flash_msa: cannot read compile cache entry %s: %s", path, e)
        return None
    try:
        obj, marker, digest = data[:-48], data[-48:-32], data[-32:]
        if marker != MARKER or hashlib.sha256(obj).digest() != digest:
            raise ValueError("bad checksum (truncated or corrupted)")
        fn = cute.runtime.load_module(str(path), enable_tvm_ffi=_tvm_ffi(options))[PREFIX]
    except Exception as e:  # any failure: the entry is unusable, recompile
        log.warning("flash_msa: dropping compile cache entry %s: %s", path, e)
        stats["dropped"] += 1
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    stats["loaded"] += 1
    return fn


def _object_bytes(fn, options: str, folder: Path) -> bytes:
    """The ELF object of compiled function ``fn``: the DSL's ``dump_to_object``, or for a TVM-FFI
    function its ``export_to_c`` (which writes a file: a temporary one in ``folder``)."""
    if not _tvm_ffi(options):
        return fn.dump_to_object(PREFIX)
    fd, name = tempfile.mkstemp(dir=folder, suffix=".o")
    os.close(fd)
    try:
        fn.export_to_c(name, function_name=PREFIX)
        return Path(name).read_bytes()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def store(fn, path: Path, options: str = "") -> None:
    """Write compiled function ``fn`` (compiled with ``options``) to ``path``: a temporary file
    in the same directory, renamed into place (atomic: a reader sees no entry or a whole one).
    Failures are logged."""
    tmp = None
    try:
        _runtime_loaded()
        path.parent.mkdir(parents=True, exist_ok=True)
        obj = _object_bytes(fn, options, path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0o600 would hide the entry from other users
        with os.fdopen(fd, "wb") as f:
            f.write(obj + MARKER + hashlib.sha256(obj).digest())
        os.replace(tmp, path)
        tmp = None
        stats["stored"] += 1
    except Exception as e:
        log.warning("flash_msa: cannot write compile cache entry %s: %s", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class _Lock:
    """Exclusive ``flock`` on ``path`` for the duration of a compile; ``held`` is False where
    it could not be taken within ``timeout`` seconds or at all (then nobody waits on us)."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout, self.fd, self.held = path, timeout, None, False

    def __enter__(self):
        try:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self.held = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("flash_msa: %s still locked, compiling anyway", self.path)
                        break
                    time.sleep(0.05)
        except (ImportError, OSError) as e:
            log.warning("flash_msa: no compile cache lock %s: %s", self.path, e)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
        return False


def compiled(kernel, args: tuple, signature, target: str, options: str | None = None):
    """``cute.compile(kernel, *args)`` through the disk cache: loaded if stored (no tracing,
    no compile), else compiled (``stats["compiled"]``) and stored. ``signature`` is
    ``static_signature(args)`` (:mod:`flash_msa.cute.common`), ``target`` names the device's
    architecture (part of the key), ``options`` the compile options string (e.g.
    ``"--gpu-arch sm_90a"`` to compile without a GPU). Appends ``(kernel class, "loaded" or
    "compiled", seconds)`` to :data:`events`."""
    import cutlass.cute as cute

    t0 = time.perf_counter()
    n = stats["compiled"]

    def compile_now():
        stats["compiled"] += 1
        if options is None:
            return cute.compile(kernel, *args)
        return cute.compile(kernel, *args, options=options)

    def get():
        path = entry_path(kernel, signature, target, options or "")
        if path is None:
            return compile_now()
        fn = load(path, options or "")
        if fn is not None:
            return fn
        with _Lock(path.with_suffix(".lock"), LOCK_TIMEOUT) as lock:
            if lock.held:  # another process may have compiled it while we waited
                fn = load(path, options or "")
                if fn is not None:
                    return fn
            fn = compile_now()
            store(fn, path, options or "")
        return fn

    fn = get()
    what = "compiled" if stats["compiled"] > n else "loaded"
    events.append((type(kernel).__name__, what, round(time.perf_counter() - t0, 3)))
    return fn
