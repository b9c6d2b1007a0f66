"""The CuTe disk cache's trust rules (flash_msa.cute.disk_cache, module docstring "Trust" and
"Locks"), on CPU without the DSL: entries are written and loaded through a stand-in for the
DSL's export and loader, so every check runs on real files, directories, owners and modes.

Each refusal compiles in-process, stores nothing, loads nothing and warns once; an entry copied
from another key's path is dropped and compiled again; directories the cache makes are 0700
under any umask; a held lock delays a miss by at most the configured timeout, and a lock whose
recorded holder is gone delays it not at all. Faking another owner needs root (``os.chown``):
those tests skip otherwise. CPU time: about 1 s.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from flash_msa.cute import disk_cache

OTHER_UID = 12345  # an owner that is not this process's


class Objects:
    """The DSL's export and loader, standing in: an object is ``b"object:" + fn``, a loaded
    function the object read back from the file the cache hands over."""

    def __init__(self):
        self.loaded: list[str] = []

    def export(self, fn, options, folder):
        return b"object:" + fn.encode()

    def load(self, path, options):
        self.loaded.append(path)
        return Path(path).read_bytes()[: -disk_cache.TRAILER].decode().removeprefix("object:")


class Cache:
    """A cache directory of its own (``FLASH_MSA_CACHE_DIR``), its entries, and a counting
    compile through :func:`disk_cache.cached`."""

    def __init__(self, root: Path):
        self.root, self.objects, self.compiles = root, Objects(), []

    def entry(self, name: str) -> Path:
        return self.root / "cute" / "env" / f"{hashlib.sha256(name.encode()).hexdigest()}.o"

    def get(self, path: Path, fn: str = "fn"):
        def compile_now():
            self.compiles.append(path)
            return fn

        return disk_cache.cached(path, "", compile_now, self.objects)

    def stored(self, name: str, fn: str = "fn") -> Path:
        path = self.entry(name)
        disk_cache.store(fn, path, "", self.objects)
        assert path.is_file(), path
        return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(disk_cache.LOCK_TIMEOUT_ENV, raising=False)
    disk_cache.stats.clear()
    return Cache(tmp_path / "cache")


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="faking another owner needs root (os.chown to another uid)"
)


def refused(cache: Cache, path: Path, match: str):
    """``cache.get(path)`` refuses: compiled in-process, nothing loaded, one warning matching
    ``match`` (plain text); returns what it got."""
    n = len(cache.compiles)
    with pytest.warns(disk_cache.UntrustedCacheWarning, match=re.escape(match)):
        fn = cache.get(path)
    assert len(cache.compiles) == n + 1 and not cache.objects.loaded
    return fn


def test_stored_entry_loads_without_compiling(cache):
    path = cache.stored("a", "kernel a")
    assert cache.get(path) == "kernel a" and not cache.compiles
    assert cache.objects.loaded == [str(path)]
    assert disk_cache.stats == {"stored": 1, "loaded": 1}


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_created_directories_are_private_whatever_the_umask(cache, umask):
    old = os.umask(umask)
    try:
        path = cache.entry("a")
        assert cache.get(path) == "fn" and cache.compiles == [path]
    finally:
        os.umask(old)
    for d in (cache.root, cache.root / "cute", path.parent):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, (d, oct(os.stat(d).st_mode))
    for f in (path, path.with_suffix(".lock")):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert cache.get(path) == "fn" and len(cache.compiles) == 1  # stored: loaded


def test_existing_directory_keeps_its_mode(cache):
    cache.root.mkdir(mode=0o755)
    os.chmod(cache.root, 0o755)  # the user's choice: readable by others, writable by the user
    path = cache.stored("a")
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o755
    assert cache.get(path) == "fn" and not cache.compiles


@pytest.mark.parametrize("level", [0, 1, 2])  # the cache root, cute/, cute/<env>/
@pytest.mark.parametrize("mode", [0o770, 0o707])
def test_refuses_directory_writable_by_group_or_others(cache, level, mode):
    a = cache.stored("a")
    d = [cache.root, cache.root / "cute", a.parent][level]
    os.chmod(d, mode)
    refused(cache, a, match=f"{d}: mode {mode:04o}: writable by group or others")
    b = cache.entry("b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same directory and reason: no second warning
        assert cache.get(b) == "fn"
    assert not b.exists() and not b.with_suffix(".lock").exists()  # nothing stored
    disk_cache.store("fn", b, "", cache.objects)  # a direct store refuses too
    assert not b.exists()
    assert disk_cache.stats == {"stored": 1, "refused": 3}


@needs_root
@pytest.mark.parametrize("level", [0, 2])
def test_refuses_directory_owned_by_another_uid(cache, level):
    a = cache.stored("a")
    d = [cache.root, cache.root / "cute", a.parent][level]
    os.chown(d, OTHER_UID, OTHER_UID)
    refused(cache, a, match=f"{d}: owned by uid {OTHER_UID}")
    b = cache.entry("b")
    cache.get(b)
    assert not b.exists()


@needs_root
def test_refuses_entry_owned_by_another_uid(cache):
    a = cache.stored("a")
    os.chown(a, OTHER_UID, OTHER_UID)
    refused(cache, a, match=f"{a}: owned by uid {OTHER_UID}")
    assert a.stat().st_uid == OTHER_UID  # left for the user to look at, not replaced


def test_refuses_entry_writable_by_others(cache):
    a = cache.stored("a")
    os.chmod(a, 0o622)
    refused(cache, a, match=f"{a}: mode 0622: writable by group or others")


def test_refuses_symbolic_links(cache, tmp_path):
    # an entry that is a link to a valid entry of its own key elsewhere
    a = cache.stored("a", "kernel a")
    planted = tmp_path / "elsewhere.o"
    shutil.move(a, planted)
    a.symlink_to(planted)
    refused(cache, a, match=f"{a}: a symbolic link, not a regular file")
    assert a.is_symlink()
    # a directory of the chain that is a link to a valid copy of it
    env = a.parent
    shutil.move(env, tmp_path / "env")
    (tmp_path / "env" / a.name).unlink()
    shutil.move(planted, tmp_path / "env" / a.name)
    env.symlink_to(tmp_path / "env")
    refused(cache, a, match=f"{env}: a symbolic link, not a directory")


def test_refuses_entry_copied_from_another_key(cache):
    a = cache.stored("a", "kernel a")
    b = cache.entry("b")
    shutil.copy(a, b)  # a whole, valid entry: of another key
    assert cache.get(b, "kernel b") == "kernel b" and cache.compiles == [b]
    assert not cache.objects.loaded  # dropped, never handed to the loader
    assert disk_cache.stats["dropped"] == 1 and disk_cache.stats["stored"] == 2
    assert cache.get(b) == "kernel b" and len(cache.compiles) == 1  # stored again: its own


def test_empty_directory_at_entry_path_is_removed(cache):
    a = cache.entry("a")
    a.mkdir(parents=True)
    assert cache.get(a) == "fn" and cache.compiles == [a]
    assert a.is_file() and disk_cache.stats["stored"] == 1
    assert cache.get(a) == "fn" and len(cache.compiles) == 1  # stored: the next one loads


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_refuses_other_non_regular_file_at_entry_path(cache, kind):
    a = cache.entry("a")
    a.parent.mkdir(parents=True)
    if kind == "directory":
        a.mkdir()
        (a / "kept").write_text("not the cache's to delete")
        match = f"{a}: a directory that is not empty"
    else:
        os.mkfifo(a, 0o600)  # opened without blocking
        match = f"{a}: a FIFO, not a regular file"
    refused(cache, a, match=match)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: a second miss compiles quietly
        assert cache.get(a) == "fn"
    assert len(cache.compiles) == 2 and disk_cache.stats["refused"] == 2
    assert not a.is_file() and "stored" not in disk_cache.stats


def test_lock_timeout_is_read_at_each_call(monkeypatch):
    monkeypatch.delenv(disk_cache.LOCK_TIMEOUT_ENV, raising=False)
    assert disk_cache.lock_timeout() == disk_cache.DEFAULT_LOCK_TIMEOUT <= 60
    monkeypatch.setenv(disk_cache.LOCK_TIMEOUT_ENV, "2.5")
    assert disk_cache.lock_timeout() == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv(disk_cache.LOCK_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=disk_cache.LOCK_TIMEOUT_ENV):
            disk_cache.lock_timeout()


def test_held_lock_delays_a_miss_at_most_the_timeout(cache, monkeypatch):
    monkeypatch.setenv(disk_cache.LOCK_TIMEOUT_ENV, "0.2")
    a = cache.entry("a")
    # a live holder (this process, through another open file: flock locks conflict)
    with disk_cache._Lock(a.with_suffix(".lock"), 0) as holder:
        assert holder.held
        t = time.monotonic()
        assert cache.get(a) == "fn"
        waited = time.monotonic() - t
    assert 0.2 <= waited < 1.5, waited
    assert cache.compiles == [a] and a.is_file()  # compiled and stored without the lock


def test_lock_of_a_gone_holder_is_taken_over(cache, monkeypatch):
    monkeypatch.setenv(disk_cache.LOCK_TIMEOUT_ENV, "30")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    a = cache.entry("a")
    # the flock still held (as through a descriptor a child forked while it held it), the
    # recorded holder a process that has exited
    with disk_cache._Lock(a.with_suffix(".lock"), 0) as holder:
        assert holder.held
        os.ftruncate(holder.fd, 0)
        os.pwrite(holder.fd, disk_cache._owner_text(pid), 0)
        t = time.monotonic()
        assert cache.get(a) == "fn"
        waited = time.monotonic() - t
    assert waited < 1.0, waited
    assert cache.compiles == [a] and a.is_file()


def test_key_text_holds_every_version_of_the_toolchain():
    from importlib.metadata import PackageNotFoundError, version

    try:
        tvm_ffi = version("apache-tvm-ffi")  # a dependency: always there where installed
    except PackageNotFoundError:
        tvm_ffi = "none"
    text = disk_cache.env_text()
    assert f"apache-tvm-ffi={tvm_ffi}" in text
    for name in disk_cache.VERSIONED:
        assert f"{name}=" in text
    assert "cuda-driver=" in text and f"py={sys.version_info[:2]}" in text
    assert disk_cache.env_tag() == hashlib.sha256(text.encode()).hexdigest()[:16]
