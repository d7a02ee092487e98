"""On-disk kernel cache: compiled kernels survive the process, for every backend (CPU machine
code, PTX, AMD code objects).

An entry's name is a hash of everything that changes the binary: the package's source, the
toolchain versions, the backend's target (host CPU features, compute capability, gfx arch) and
the builder's explicit key (builder name and frozen spec).  Editing a kernel or upgrading numba
therefore never loads a stale binary; old entries are simply never asked for again
(``rmsnorm-hip cache clear`` removes them).  Each file carries a checksum of its payload: a
truncated or corrupted entry is deleted and rebuilt, never loaded.  Writes go to a temporary
file in the same folder and are renamed into place, so concurrent processes see either no
entry or a whole one.

``RMSNORM_HIP_CACHE_DIR`` moves the cache; ``RMSNORM_HIP_CACHE_DIR=off`` (or ``0``) disables it.
By default it lives in the platform's user cache folder (``$XDG_CACHE_HOME/rmsnorm_hip``,
``~/.cache/rmsnorm_hip``; ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows).
"""
import functools
import hashlib
import importlib.metadata
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:         # Windows: no cross-process build lock; each process builds its own
    fcntl = None

ENV = "RMSNORM_HIP_CACHE_DIR"
FORMAT = 1                      # bump when the entry layout or a payload's meaning changes
_MAGIC = b"rmsnorm-hip-cache\n"
_DISABLED = ("0", "off", "none", "false", "no")
# distributions whose versions change what the compilers emit
_TOOLCHAIN = ("numba", "llvmlite", "numba-cuda", "numba-hip", "cuda-bindings", "numpy")


def directory():
    """The cache folder (a Path; it may not exist yet), or None when caching is disabled."""
    value = os.environ.get(ENV, "").strip()
    if value:
        return None if value.lower() in _DISABLED else Path(value).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local"
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rmsnorm_hip"


@functools.lru_cache(maxsize=None)
def source_hash():
    """sha256 of the package's Python sources (path and bytes of each, in path order)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def toolchain():
    """(distribution, version) of each installed compiler package, and the Python version."""
    versions = []
    for name in _TOOLCHAIN:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return (sys.version.split()[0],) + tuple(versions)


def entry_path(kind, key):
    """Where the entry of ``key`` (any value with a deterministic repr) of ``kind`` lives."""
    folder = directory()
    if folder is None:
        return None
    name = hashlib.sha256(repr((FORMAT, kind, source_hash(), toolchain(), key)).encode())
    return folder / kind / f"{name.hexdigest()}.bin"


def load(kind, key):
    """The payload stored for ``key``, or None (absent, disabled, unreadable or corrupted; a
    corrupted entry is deleted)."""
    path = entry_path(kind, key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + 32
    payload = data[head:]
    if data[:len(_MAGIC)] != _MAGIC or data[len(_MAGIC):head] != hashlib.sha256(payload).digest():
        discard(kind, key)
        return None
    return payload


def store(kind, key, payload):
    """Write ``payload`` (bytes) for ``key``: atomically, or not at all (a read-only or full
    disk only costs the next process a compile)."""
    path = entry_path(kind, key)
    if path is None:
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


class BuildLock:
    """An exclusive lock on one entry's build, across processes (``flock`` on a file beside
    it), so that processes starting together build a kernel once: the first builds and stores
    it, the others wait and load it.  A holder that dies releases it with its file; a waiter
    gives up after ``timeout`` seconds and builds for itself."""

    def __init__(self, kind, key, timeout=300.0):
        self._path = entry_path(kind, key)
        self._timeout = timeout
        self._file = None

    def acquire(self):
        if self._path is None or fcntl is None:
            return self
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path.with_suffix(".lock"), "a")
        except OSError:
            return self
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.release()
                    return self
                time.sleep(0.05)

    def release(self):
        if self._file is not None:
            self._file.close()          # closing the file drops the lock
            self._file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def discard(kind, key):
    path = entry_path(kind, key)
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def cached(kind, key, build, encode=bytes, decode=bytes):
    """``build()``'s result for ``key``: from disk when an entry is there (``decode(payload)``;
    an entry that fails to decode is deleted and rebuilt), else built and stored
    (``encode(result)`` -> bytes)."""
    for attempt in range(2):
        payload = load(kind, key)
        if payload is not None:
            try:
                return decode(payload)
            except Exception:
                discard(kind, key)
        if attempt == 0:
            lock = BuildLock(kind, key).acquire()   # another process may be building it
    try:
        result = build()
        store(kind, key, encode(result))
    finally:
        lock.release()
    return result


def info():
    """{"directory", "enabled", "entries": {kind: count}, "bytes"} of the cache."""
    folder = directory()
    summary = {"directory": str(folder) if folder else None, "enabled": folder is not None,
               "entries": {}, "bytes": 0}
    if folder is None or not folder.is_dir():
        return summary
    for kind in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = [f for f in kind.glob("*.bin")]
        summary["entries"][kind.name] = len(files)
        summary["bytes"] += sum(f.stat().st_size for f in files)
    return summary


def clear():
    """Delete every entry (and stray temporary files); returns how many entries went."""
    folder = directory()
    if folder is None or not folder.is_dir():
        return 0
    removed = 0
    for kind in (p for p in folder.iterdir() if p.is_dir()):
        for f in kind.iterdir():
            if f.suffix in (".bin", ".lock") or f.name.startswith(".tmp-"):
                try:
                    f.unlink()
                    removed += f.name.endswith(".bin")
                except OSError:
                    pass
        try:
            kind.rmdir()
        except OSError:
            pass
    return removed
