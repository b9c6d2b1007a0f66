"""Persistent on-disk cache of compiled CuTe kernels, shared by the processes of one machine.

:func:`flash_msa.cute.launch.run_typed` compiles a kernel on its first call in a process; this
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
on the H200 (tests/integration/test_first_call_gpu.py) a second process's first anchor-16K training step
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
import errno
import functools
import hashlib
import importlib.metadata
import logging
import math
import os
import platform
import socket
import stat
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import cutlass.cute as cute

log = logging.getLogger("flash_msa")

DIR_ENV = "FLASH_MSA_CACHE_DIR"
SWITCH_ENV = "FLASH_MSA_CACHE"  # "0" turns the disk cache off (on by default: module docstring)
LOCK_TIMEOUT_ENV = "FLASH_MSA_CACHE_LOCK_TIMEOUT"  # seconds a miss waits for another compile
# The slowest kernel compiles in about 5 s on an idle CPU (module docstring) and the ranks of a
# node compiling at once slow each other a few times: a minute lets a waiter load what a live
# process is compiling, and bounds what a stopped or hung lock holder costs it.
DEFAULT_LOCK_TIMEOUT = 60.0
PREFIX = "flash_msa_kernel"  # symbol prefix of the exported function inside each object
# The entry's trailer: MARKER (16 bytes), the entry's key (32), the SHA-256 of all before (32)
MARKER = b"flash_msa-cute-2"
TRAILER = len(MARKER) + 32 + 32
# The distributions whose versions change a compiled object or how it is loaded and called: the
# DSL and its compiler libraries, TVM-FFI (the calling convention of TVM-FFI functions), the
# CUDA bindings (a version not installed is "none")
VERSIONED = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "apache-tvm-ffi",
    "cuda-bindings",
)

# What this process did, for tests and logs: "compiled" (cute.compile ran), "loaded" (from
# disk), "stored", "dropped" (an entry that failed its trailer check or did not load: deleted),
# "refused" (a path failing a trust check: compiled, not stored), "uncached" (a configuration
# without a process-independent key: compiled, not stored).
stats: Counter = Counter()
events: list = []  # (kernel class name, "compiled" or "loaded", seconds) per compiled() call
_warned: set = set()  # (path, reason) of the refusals this process has warned about


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


def lock_timeout() -> float:
    """Seconds a miss waits for another process compiling the same kernel:
    ``$FLASH_MSA_CACHE_LOCK_TIMEOUT`` (read at each call), default :data:`DEFAULT_LOCK_TIMEOUT`.
    Raises ValueError naming the variable for anything but a finite number >= 0."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{LOCK_TIMEOUT_ENV} must be a number of seconds >= 0, got {raw!r}")
    return seconds


class UntrustedCacheWarning(UserWarning):
    """The disk cache refused a path it cannot trust and compiled in-process (module docstring,
    "Trust")."""


class Untrusted(Exception):
    """A cache path failing a trust check: ``path`` and ``reason`` (a phrase)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


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


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _driver_version() -> str:
    """The CUDA driver's version, ``"none"`` without a driver (a CPU machine). Asked through
    ``cuDriverGetVersion``, which needs no ``cuInit``: no CUDA context is made."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
    except Exception:  # no cuda-bindings, or no libcuda to load
        return "none"
    return str(version) if err == driver.CUresult.CUDA_SUCCESS else "none"


@functools.cache
def env_text() -> str:
    """What every entry of this process depends on besides its kernel: the :data:`VERSIONED`
    distributions' versions, the CUDA driver's, Python's and the host machine's."""
    versions = ";".join(f"{d}={_version(d)}" for d in VERSIONED)
    host = f"py={sys.version_info[:2]};{platform.machine()}"
    return f"{versions};cuda-driver={_driver_version()};{host}"


def env_tag() -> str:
    """The ``<env>`` directory name: a hash of :func:`env_text`."""
    return hashlib.sha256(env_text().encode()).hexdigest()[:16]


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
    cache is off or the configuration has no process-independent text (``stats["uncached"]``).
    The file's name is the entry's key, the SHA-256 of all the text it depends on (module
    docstring, "Layout"); the entry's trailer repeats it."""
    if not enabled():
        return None
    try:
        text = "\n".join(
            (
                env_text(),
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
    try:
        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError) as e:  # then an export fails and is logged
        log.warning("flash_msa: cannot load the CuTe DSL runtime library globally: %s", e)


TVM_FFI = "--enable-tvm-ffi"  # the compile option of TVM-FFI functions (launch.FFI_OPTIONS)


def _tvm_ffi(options: str) -> bool:
    """Whether ``options`` compile a TVM-FFI function: stored by its own export, loaded as a
    TVM-FFI module."""
    return TVM_FFI in options.split()


# Trust checks (module docstring, "Trust"), made at each load, lock and store, not once per
# process: the directories may change between two uses, and it is the check just passed that
# makes the bytes read, and the file the DSL then loads, the user's own.


def _kind(mode: int) -> str:
    for is_kind, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if is_kind(mode):
            return name
    return "a device file"


def _problem(st: os.stat_result, want_dir: bool) -> str | None:
    """Why a file with status ``st`` is not a trusted directory (``want_dir``) or regular file;
    None where it is: of that kind, owned by the effective uid, writable by its owner only."""
    want = "a directory" if want_dir else "a regular file"
    if _kind(st.st_mode) != want:
        return f"{_kind(st.st_mode)}, not {want}"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others"
    return None


def _locate(path: Path) -> tuple[list[Path], Path]:
    """The directories to check for cache path ``path`` (the real path of :func:`root`, then
    each directory below it down to ``path``'s own) and ``path`` below that real path. The root
    is resolved once here and every later step uses the result, so a symbolic link on the way
    to it can change nothing between a check and a use. Raises :class:`Untrusted` for a path
    outside the cache directory."""
    top = root()
    try:
        rel = Path(path).relative_to(top)
    except ValueError:
        rel = None
    if rel is None or not rel.parts or ".." in rel.parts:
        raise Untrusted(path, f"not inside the cache directory {top}")
    dirs = [Path(os.path.realpath(top))]
    for part in rel.parts[:-1]:
        dirs.append(dirs[-1] / part)
    return dirs, dirs[-1] / rel.parts[-1]


def _make_private_dir(d: Path) -> None:
    """Create directory ``d`` and its missing parents, each mode 0700 whatever the umask (the
    mode ``mkdir`` gets is masked by it: 0o277 would leave 0o500). A directory that exists is
    left as it is: its owner chose its mode, and the checks judge it."""
    if os.path.lexists(d):
        return
    _make_private_dir(d.parent)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:  # another process made it first
        return
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # the one just made
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _trusted_dirs(path: Path, create: bool) -> Path | None:
    """``path`` below the real cache directory, once each directory down to it passed the
    checks (made first where ``create``); None where one does not exist. Raises
    :class:`Untrusted` naming the first directory that fails."""
    dirs, real = _locate(path)
    if create:
        _make_private_dir(dirs[-1])
    for d in dirs:
        try:
            st = os.lstat(d)  # a symbolic link is refused, not followed
        except FileNotFoundError:
            return None
        if reason := _problem(st, want_dir=True):
            raise Untrusted(d, reason)
    return real


def _open_nofollow(real: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of ``real`` that refuses a symbolic link (:class:`Untrusted`), and any other
    file that is not a regular one where the open fails on it (a socket, a directory opened
    for writing); O_NONBLOCK so that a FIFO planted there cannot block the open."""
    try:
        return os.open(real, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(real, "a symbolic link, not a regular file") from None
        with contextlib.suppress(OSError):
            if reason := _problem(os.lstat(real), want_dir=False):
                raise Untrusted(real, reason) from None
        raise


def _clear_directory(real: Path, st: os.stat_result) -> None:
    """What to do with a non-regular file (status ``st``) at entry path ``real``: an empty
    directory of ours is removed (a miss follows, then a store); anything else raises
    :class:`Untrusted` and stays for the user (removing it could destroy what it holds)."""
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise Untrusted(real, _problem(st, want_dir=False) or "not a regular file")
    try:
        os.rmdir(real)
    except FileNotFoundError:  # another process removed it
        return
    except OSError:
        raise Untrusted(real, "a directory that is not empty, not a regular file") from None
    log.warning("flash_msa: removed the empty directory at compile cache entry path %s", real)


def _read_entry(path: Path) -> tuple[Path, bytes] | None:
    """The real path and bytes of the entry at cache path ``path``; None where there is none.
    Raises :class:`Untrusted` where it or a directory above it fails a check."""
    real = _trusted_dirs(path, create=False)
    if real is None:
        return None
    try:
        fd = _open_nofollow(real, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)  # the file opened, not whatever the name points to now
        if not stat.S_ISREG(st.st_mode):
            _clear_directory(real, st)
            return None
        if reason := _problem(st, want_dir=False):
            raise Untrusted(real, reason)
        with open(fd, "rb", closefd=False) as f:
            return real, f.read()
    finally:
        os.close(fd)


def _refuse(e: Untrusted) -> None:
    """Count a refusal, and warn about it unless this process did for that path and reason."""
    stats["refused"] += 1
    if (str(e.path), e.reason) in _warned:
        return
    _warned.add((str(e.path), e.reason))
    warnings.warn(
        f"flash_msa: the CuTe compile cache refuses {e.path}: {e.reason}. Compiling in-process "
        f"and storing nothing there: the cache must be private to its user (directories owned "
        f"by uid {os.geteuid()}, mode 0700; entries regular files owned by it, mode 0600)",
        UntrustedCacheWarning,
        stacklevel=3,
    )


# Entries


def _key(path: Path) -> bytes:
    """The key of the entry at ``path``: its name's digest."""
    key = bytes.fromhex(Path(path).stem)
    if len(key) != 32:
        raise ValueError(f"{path}: an entry's name is a SHA-256 in hex")
    return key


def _trailer(obj: bytes, key: bytes) -> bytes:
    head = MARKER + key
    return head + hashlib.sha256(obj + head).digest()


def _check_trailer(data: bytes, key: bytes) -> None:
    """Raise ValueError unless entry bytes ``data`` end in a whole trailer naming ``key``: a
    truncated or corrupted entry, or one stored for another key, is never loaded."""
    obj, trailer = data[:-TRAILER], data[-TRAILER:]
    stored_key = trailer[len(MARKER) : len(MARKER) + 32]
    if len(data) < TRAILER or trailer != _trailer(obj, stored_key):
        raise ValueError("bad checksum (truncated or corrupted)")
    if stored_key != key:
        raise ValueError("stored for another key (copied from another entry's path)")


class DslObjects:
    """Compiled functions to object bytes and back through nvidia-cutlass-dsl: what
    :func:`load`, :func:`store` and :func:`cached` use unless given another ``objects`` (a test
    passes one that needs no DSL)."""

    def export(self, fn, options: str, folder: Path) -> bytes:
        _runtime_loaded()
        return _object_bytes(fn, options, folder)

    def load(self, path: str, options: str):
        _runtime_loaded()
        return cute.runtime.load_module(path, enable_tvm_ffi=_tvm_ffi(options))[PREFIX]


def load(path: Path, options: str = "", objects=None):
    """The compiled function stored at cache path ``path``, or ``None`` if there is none. An
    entry whose trailer does not check, names another key or does not load is deleted
    (``stats["dropped"]``) and ``None`` returned: it will be compiled again. ``options``: the
    compile options it was stored with; ``objects``: the loader (default :class:`DslObjects`).
    Raises :class:`Untrusted` where the entry or a directory above it fails a trust check."""
    key = _key(path)
    try:
        found = _read_entry(path)
    except OSError as e:
        log.warning("flash_msa: cannot read compile cache entry %s: %s", path, e)
        return None
    if found is None:
        return None
    real, data = found
    try:
        _check_trailer(data, key)
        # the file read is the file loaded: only the user can replace it (module docstring)
        fn = (objects or DslObjects()).load(str(real), options)
    except Exception as e:  # any failure: the entry is unusable, recompile
        log.warning("flash_msa: dropping compile cache entry %s: %s", real, e)
        stats["dropped"] += 1
        with contextlib.suppress(OSError):
            os.unlink(real)
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


def _make_room(real: Path) -> None:
    """Let a rename put an entry at ``real``: nothing or a regular file there (replaced: the
    rename changes only the name, in a checked directory); an empty directory of ours is
    removed; anything else raises :class:`Untrusted` (:func:`_clear_directory`)."""
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        _clear_directory(real, st)


def store(fn, path: Path, options: str = "", objects=None) -> None:
    """Write compiled function ``fn`` (compiled with ``options``) to cache path ``path``: a
    temporary file (mode 0600) in the same directory, renamed into place (a reader sees no
    entry or a whole one). The directories are made private and checked first; a refusal
    warns (:class:`UntrustedCacheWarning`) and stores nothing, other failures are logged.
    ``objects``: the exporter (default :class:`DslObjects`)."""
    tmp = None
    try:
        real = _trusted_dirs(path, create=True)
        if real is None:
            raise FileNotFoundError(f"{Path(path).parent} was removed while being made")
        _make_room(real)
        obj = (objects or DslObjects()).export(fn, options, real.parent)
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=real.name + ".", suffix=".tmp")
        os.fchmod(fd, 0o600)  # mkstemp's 0o600 is masked by the umask
        with os.fdopen(fd, "wb") as f:
            f.write(obj + _trailer(obj, _key(path)))
        os.replace(tmp, real)
        tmp = None
        stats["stored"] += 1
    except Untrusted as e:
        _refuse(e)
    except Exception as e:
        log.warning("flash_msa: cannot write compile cache entry %s: %s", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


# Locks


def _owner_text(pid: int) -> bytes:
    """What a lock file holds while locked: the holder's pid and host name."""
    return f"{pid} {socket.gethostname()}\n".encode()


def _owner_gone(fd: int) -> bool:
    """Whether the holder recorded in lock file ``fd`` is a process of this host that no
    longer exists. False where that cannot be told (no record yet, another host's)."""
    try:
        pid, _, host = os.pread(fd, 256, 0).decode().strip().partition(" ")
    except (OSError, UnicodeDecodeError):
        return False
    if host != socket.gethostname() or not pid.isdigit() or int(pid) <= 0:
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: the existence check, nothing is sent
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's: not ours to judge)
        return False
    return False


def _wait_for(fd: int, timeout: float, path: Path) -> bool:
    """Take the exclusive ``flock`` on lock file ``fd``: True once taken; False after
    ``timeout`` seconds, or at once where its recorded holder is gone (module docstring,
    "Locks"): then the caller compiles without waiting longer."""
    import fcntl

    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if _owner_gone(fd):
            log.warning("flash_msa: the holder of %s is gone, compiling without it", path)
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("flash_msa: %s still locked after %g s, compiling anyway", path, timeout)
            return False
        time.sleep(min(0.05, left))


class _Lock:
    """Exclusive ``flock`` on cache path ``path`` (``<key>.lock``) while a process compiles and
    stores; ``held`` is False where it was not taken (:func:`_wait_for`) or could not be (then
    nobody waits on us). Raises :class:`Untrusted` where the lock file or a directory above it
    fails a trust check."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout, self.fd, self.held = path, timeout, None, False

    def __enter__(self):
        real = _trusted_dirs(self.path, create=True)
        try:
            if real is None:
                raise FileNotFoundError(f"{self.path.parent} was removed while being made")
            self.fd = self._open(real)
            self.held = _wait_for(self.fd, self.timeout, real)
            if self.held:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, _owner_text(os.getpid()), 0)
        except (ImportError, OSError) as e:
            log.warning("flash_msa: no compile cache lock %s: %s", self.path, e)
        return self

    @staticmethod
    def _open(real: Path) -> int:
        fd = _open_nofollow(real, os.O_RDWR | os.O_CREAT, 0o600)
        reason = _problem(os.fstat(fd), want_dir=False)
        if reason:
            os.close(fd)
            raise Untrusted(real, reason)
        os.fchmod(fd, 0o600)  # the mode of a new one is masked by the umask; ours: checked
        return fd

    def __exit__(self, *exc):
        if self.fd is not None:
            if self.held:  # no holder recorded once released
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
            os.close(self.fd)  # releases the flock
        return False


def cached(path: Path, options: str, compile_now, objects=None):
    """The compiled function stored at cache path ``path``, else ``compile_now()``, stored
    there. A miss takes ``<key>.lock`` (waiting at most :func:`lock_timeout` seconds for
    another process compiling it) and, holding it, loads again before compiling. Where a trust
    check fails: ``compile_now()``, nothing stored, an :class:`UntrustedCacheWarning`.
    ``objects``: the exporter and loader (default :class:`DslObjects`)."""
    try:
        fn = load(path, options, objects)
        if fn is not None:
            return fn
        with _Lock(path.with_suffix(".lock"), lock_timeout()) as lock:
            # another process may have stored it while we waited
            fn = load(path, options, objects) if lock.held else None
            if fn is None:
                fn = compile_now()
                store(fn, path, options, objects)
            return fn
    except Untrusted as e:  # raised before compile_now: store() handles its own
        _refuse(e)
        return compile_now()


def compiled(kernel, args: tuple, signature, target: str, options: str | None = None):
    """``cute.compile(kernel, *args)`` through the disk cache: loaded if stored (no tracing,
    no compile), else compiled (``stats["compiled"]``) and stored (:func:`cached`).
    ``signature`` is ``static_signature(args)`` (:mod:`flash_msa.cute.common`), ``target`` names
    the device's architecture (part of the key), ``options`` the compile options string (e.g.
    ``"--gpu-arch sm_90a"`` to compile without a GPU). Appends ``(kernel class, "loaded" or
    "compiled", seconds)`` to :data:`events`."""
    t0 = time.perf_counter()
    n = stats["compiled"]

    def compile_now():
        if not stats["compiled"]:  # the first compile of the process says why the call waits
            log.warning(
                "flash_msa: compiling CuTe kernels for this configuration (first use, seconds "
                "each; stored in the compile cache %s for later processes)",
                "off (FLASH_MSA_CACHE=0)" if path is None else "under " + str(path.parent),
            )
        log.info("flash_msa: compiling %s", type(kernel).__name__)
        stats["compiled"] += 1
        if options is None:
            return cute.compile(kernel, *args)
        return cute.compile(kernel, *args, options=options)

    path = entry_path(kernel, signature, target, options or "")
    fn = compile_now() if path is None else cached(path, options or "", compile_now)
    what = "compiled" if stats["compiled"] > n else "loaded"
    events.append((type(kernel).__name__, what, round(time.perf_counter() - t0, 3)))
    return fn
