"""The on-disk cubin cache: render -> key -> disk -> compile -> store.

Layout under ``config.cache_dir()``::

    <uri>/<key>.cubin   framed cubin: magic, key, URI, payload length, sha256, payload
    <uri>/<key>.cu      the rendered source (what CompileError points at)
    <uri>/<key>.json    metadata: spec, options, NVRTC version, CUDA headers' major, compile seconds
    <uri>/<key>.lock    per-entry file lock

The URI makes the folder readable; the key (a digest of everything that decides the binary) makes
the entry correct.  The cubin is written last, so an entry exists exactly when its cubin does.

An entry is bound to its kernel: the frame holds the key and the URI it was compiled for, and a
cubin whose frame names another key or URI (one copied or linked under another name) is a miss,
logged, never a load.

Only this user or root may have written what is loaded.  A configured cache folder that is writable
by every user (without the sticky bit) or owned by another user is not used at all: reads and writes
go to the per-user fallback folder, with one warning.  A per-kernel folder must be a real folder
owned by this user or root and not writable by every user; links are never followed (entries are
opened with O_NOFOLLOW, folders checked with lstat, the lock file is opened by flashgen itself with
O_NOFOLLOW and never truncated).  The configured folder itself may be a link.  The key is no
secret, so this ownership rule, not the key, is what keeps planted code out.

Faults never stop the caller: a corrupt, mismatched or truncated cubin is a miss, logged and
recompiled; an unwritable cache folder is still read, and new entries go to a per-user temporary
folder (one warning); a fault below the top folder (a per-kernel folder that is a file, a link or
another user's, a lock that cannot be made, a full disk) is a warning, and the compiled cubin is used
from memory.  Hits take no lock, so a read-only prebuilt cache works (see FLASHGEN_DISABLE_JIT).
Files are written 0644 and folders 0755 whatever the umask, so a cache prebuilt by one user
(root in an image, say) is readable by the others.

A prebuilt cache needs no NVRTC: when NVRTC or CUDA headers of known version cannot be found, or
FLASHGEN_DISABLE_JIT is set and the exact entry is missing, the entry is looked up by URI.  The
metadata of the entries in the URI's folder proposes the NVRTC versions and CUDA headers' major
versions they were built with; for each pair, this process computes the key from its own schema,
rendered source, headers, options and arch with that pair, and loads the cubin only when its frame
carries that key.  So everything in the key but those two must match (the stored metadata is only a
hint); the newest NVRTC wins.

An entry is one compile target (matrix.compile_target): an sm_86 instance that compiles the same
as its sm_80 twin has no entry of its own, the sm_80 entry serves it.

An archive (`flashgen build --archive`, export_archive) carries entries to such a machine: the
framed cubins and their metadata (what that lookup reads) plus a manifest; `flashgen cache import`
(import_archive) checks every member and writes the entries with the writers above.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import stat
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from .. import config
from . import files, matrix, nvrtc, render
from .spec import KernelSpec

try:
    import fcntl
except ImportError:  # Windows: entries are locked with filelock there
    fcntl = None

logger = logging.getLogger("flashgen")

# Bump when the key's fields, the fixed flags of nvrtc.compile_with_log or the entry format change.
# 3: the CUDA headers' major version is a key field.
SCHEMA_VERSION = 3

_MAGIC = b"FGCUBIN2"
# magic, key (sha256 digest), URI length, payload length, sha256(key + URI + payload); then the
# URI, then the payload.
_FRAME = struct.Struct("<8s32sHQ32s")

# Temp files of writers that died (a killed build) are removed when their folder is next written.
STALE_TEMP_SECONDS = 600

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # none on Windows, where making a link needs a privilege
# O_NONBLOCK: opening a FIFO planted as an entry must not hang the caller.
_OPEN_FLAGS = (
    _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
)

# Cubin bytes already found or built by this process, by (spec, options).  Options are part of the
# memo key because FLASHGEN_NVRTC_EXTRA_OPTIONS may change while the process runs.
_cubins: dict[tuple[KernelSpec, tuple[str, ...]], bytes] = {}

# Per configured cache folder: where this process reads entries (the folder, or the fallback when
# the folder is refused: one stat on the first lookup) and where it writes new ones (decided on the
# first miss, probing the folder once, so a read-only folder costs one warning, not a probe per call).
_read_dirs: dict[Path, Path] = {}
_write_dirs: dict[Path, Path] = {}
_dirs_lock = threading.RLock()  # reentrant: deciding the write folder decides the read folder

# One lock per entry for the threads of this process, taken before the entry's file lock: where
# file locks are per process (fcntl/POSIX locks, some network file systems) the file lock alone
# would let two threads compile the same entry at once.
_entry_locks: dict[Path, threading.Lock] = {}
_entry_locks_guard = threading.Lock()


class JitDisabledError(RuntimeError):
    """FLASHGEN_DISABLE_JIT is set and a kernel is not in the cache."""

    def __init__(self, spec: KernelSpec, directory: Path):
        self.uri = spec.uri
        self.directory = directory
        self.command = f"flashgen build --arch {spec.arch} --filter {spec.uri}"
        super().__init__(
            f"kernel {spec.uri} is not in the cache {directory} and FLASHGEN_DISABLE_JIT=1 forbids "
            f"compiling it: build it into that cache with `{self.command}` (with the same "
            f"FLASHGEN_CACHE_DIR and FLASHGEN_NVRTC_EXTRA_OPTIONS), or unset FLASHGEN_DISABLE_JIT"
        )


class CacheWriteError(OSError):
    """A compiled cubin could not be stored (e.g. the disk is full, or the entry's folder is not
    usable).  Nothing of the entry is left on disk; ``cubin`` holds the compiled binary."""

    def __init__(self, path: Path, cause: OSError, cubin: bytes):
        self.path = path
        self.cubin = cubin
        super().__init__(cause.errno, f"could not store {path} in the kernel cache: {cause}")


def compile_options() -> list[str]:
    """The NVRTC options flashgen kernels are compiled with (besides arch and include dir)."""
    return [*nvrtc.DEFAULT_OPTIONS, *config.nvrtc_extra_options()]


def cache_key(
    *,
    source: str,
    headers: Mapping[str, str],
    arch: str,
    options: Sequence[str],
    nvrtc_version: tuple[int, int],
    cuda_headers_major: int | None,
) -> str:
    """sha256 over labelled, length-prefixed fields, so no two different inputs share a byte stream.
    Headers are taken in name order: the dict's insertion order does not decide the binary.
    ``cuda_headers_major``: of the CUDA headers NVRTC includes (cuda_fp16.h, ...), so that one NVRTC
    compiling against two toolkits' headers never shares an entry; None when they do not say."""
    digest = hashlib.sha256()

    def field(label: str, value: str) -> None:
        data = value.encode()
        digest.update(f"{label}:{len(data)}:".encode())
        digest.update(data)

    field("schema", str(SCHEMA_VERSION))
    field("nvrtc", "{}.{}".format(*nvrtc_version))
    field("cuda-headers", "none" if cuda_headers_major is None else str(cuda_headers_major))
    field("options", json.dumps(list(options)))
    field("arch", arch)
    field("source", source)
    for name in sorted(headers):
        field("header-name", name)
        field("header", headers[name])
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class _Entry:
    spec: KernelSpec
    source: str
    headers: Mapping[str, str]
    options: tuple[str, ...]
    nvrtc_version: tuple[int, int]
    cuda_headers_major: int | None
    key: str
    directory: Path

    def path(self, suffix: str) -> Path:
        return self.directory / f"{self.key}{suffix}"


def _entry(
    spec: KernelSpec,
    source: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    version: tuple[int, int],
    cuda_headers: int | None,
    root: Path,
) -> _Entry:
    """The entry of ``spec`` compiled by NVRTC ``version`` against CUDA headers of major version
    ``cuda_headers`` under the cache folder ``root``."""
    key = cache_key(
        source=source, headers=headers, arch=spec.arch, options=options, nvrtc_version=version,
        cuda_headers_major=cuda_headers,
    )
    return _Entry(spec, source, headers, tuple(options), version, cuda_headers, key, root / spec.uri)


@functools.cache
def _cuda_headers_major(nvrtc_major: int) -> int | None:
    """The major version of the CUDA headers an NVRTC of ``nvrtc_major`` compiles with here (None:
    none found, or they do not say).  Once per process, so a hit searches no folders; a CUDA_HOME
    changed later in the process is not seen."""
    include_dir = nvrtc.cuda_include_dir(nvrtc_major)
    return None if include_dir is None else nvrtc.cuda_headers_major(include_dir)


def _local_entry(
    spec: KernelSpec,
    source: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    version: tuple[int, int],
    root: Path,
) -> _Entry:
    """The entry this process compiles: NVRTC ``version`` and the CUDA headers it would use."""
    return _entry(spec, source, headers, options, version, _cuda_headers_major(version[0]), root)


def _nvrtc_version() -> tuple[int, int] | None:
    """NVRTC's version, None when NVRTC cannot be loaded (a prebuilt cache still serves hits)."""
    try:
        return nvrtc.nvrtc_version()
    except nvrtc.NvrtcNotFoundError:
        return None


def untrusted_reason(directory: Path) -> str | None:
    """Why the cache folder ``directory`` is refused (flashgen neither reads nor writes it), None
    when it is usable or does not exist yet.  It may be a link; what it points to is checked."""
    try:
        st = directory.stat()
    except OSError:
        return None  # missing, or not reachable: it holds nothing to load, and the write probe says why
    if not stat.S_ISDIR(st.st_mode):
        return None
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        # Without the sticky bit anyone may swap a per-kernel folder between its check and a read.
        return "writable by every user"
    return files.owner_problem(st)


def unwritable_reason(directory: Path) -> str | None:
    """None when ``directory`` can be created and written, else why not."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        files.make_dir(directory)
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return str(exc)


def fallback_cache_dir() -> Path:
    """The per-user temporary cache folder used when the configured one is not usable."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"flashgen-{user}"


def _decided(memo: dict[Path, Path], configured: Path, choose) -> Path:
    directory = memo.get(configured)
    if directory is None:
        with _dirs_lock:
            if configured not in memo:
                memo[configured] = choose(configured)
        directory = memo[configured]
    return directory


def read_dir(configured: Path | None = None) -> Path:
    """The folder entries are looked up in: the configured cache folder, or the fallback when the
    configured one is refused (see untrusted_reason; one warning per process and folder)."""
    configured = config.cache_dir() if configured is None else configured
    return _decided(_read_dirs, configured, _choose_read_dir)


def _choose_read_dir(configured: Path) -> Path:
    reason = untrusted_reason(configured)
    if reason is None:
        return configured
    fallback = fallback_cache_dir()
    logger.warning(
        "kernel cache %s is %s, so it may hold kernels another user planted: not using it; reading "
        "and writing kernels in %s instead (set FLASHGEN_CACHE_DIR to a folder only you can write)",
        configured, reason, fallback,
    )
    return fallback


def write_dir(configured: Path | None = None) -> Path:
    """The folder new entries are written to: the configured cache folder when it is usable and
    writable, else the fallback (with one warning per process and folder)."""
    configured = config.cache_dir() if configured is None else configured
    return _decided(_write_dirs, configured, _choose_write_dir)


def _choose_write_dir(configured: Path) -> Path:
    refused = read_dir(configured) != configured  # already warned about
    reason = None if refused else unwritable_reason(configured)
    if not refused and reason is None:
        return configured
    fallback = fallback_cache_dir()
    # 0o700: another user must not be able to plant cubins that this user's jobs would run.
    with contextlib.suppress(OSError):
        fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    fallback_reason = unwritable_reason(fallback) or untrusted_reason(fallback)
    if fallback_reason is None and hasattr(os, "getuid") and fallback.stat().st_uid != os.getuid():
        fallback_reason = "owned by another user"
    if fallback_reason is not None:
        why = untrusted_reason(configured) if refused else f"not writable ({reason})"
        raise OSError(
            f"the kernel cache {configured} is {why}, and the fallback {fallback} is not usable "
            f"({fallback_reason}): set FLASHGEN_CACHE_DIR to a writable folder"
        )
    if not refused:
        logger.warning(
            "kernel cache %s is not writable (%s); reading it, and writing new kernels to %s "
            "(set FLASHGEN_CACHE_DIR to a writable folder to keep them)", configured, reason, fallback
        )
    return fallback


def _entry_lock(entry: _Entry) -> threading.Lock:
    path = entry.path(".cubin")
    with _entry_locks_guard:
        return _entry_locks.setdefault(path, threading.Lock())


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on the file ``path``, created if missing.  POSIX: opened here with
    O_NOFOLLOW and without O_TRUNC, so a planted link is an error (ELOOP) and never empties its
    target, whatever filelock version is installed (3.x opens its lock files with O_TRUNC)."""
    if fcntl is None:
        import filelock

        with filelock.FileLock(path):
            yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, files.FILE_MODE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_entry_file(path: Path) -> bytes:
    """The bytes of a regular file, never through a link (ELOOP)."""
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return file.read()


def get_cubin(spec: KernelSpec) -> bytes:
    """The cubin compiled for ``spec`` itself: from this process's memo, else the disk cache, else
    compiled (and stored).  The runtime asks for matrix.compile_target(spec), whose cubin serves
    ``spec``.  Raises nvrtc.CompileError when NVRTC rejects the instance."""
    options = tuple(compile_options())
    cubin = _cubins.get((spec, options))
    if cubin is None:
        try:
            cubin = _load_or_compile(
                spec, options, render.header_sources(), compile_on_miss=not config.disable_jit()
            )[0]
        except CacheWriteError as exc:
            # A training job or server must not stop because its cache disk filled up or an entry
            # folder is broken: the kernel is compiled, so use it; this process keeps it in memory,
            # the next one recompiles.  (`flashgen build`, whose job is to fill the cache, reports
            # it instead.)
            logger.warning("%s; using the compiled kernel from memory", exc)
            cubin = exc.cubin
        _cubins[(spec, options)] = cubin
    return cubin


def _find(
    spec: KernelSpec,
    source: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    version: tuple[int, int] | None,
    root: Path,
    any_nvrtc: bool,
) -> tuple[_Entry, bytes] | None:
    """The (entry, cubin) of ``spec`` under ``root`` built by NVRTC ``version`` with this process's
    CUDA headers.  When that one is missing and ``any_nvrtc`` is set, or this process could not
    compile it (NVRTC not loadable: ``version`` None; no CUDA headers of known version): the one
    built by the newest NVRTC whose entry matches every other key field (see the module docstring)."""
    local = None
    if version is not None:
        entry = _local_entry(spec, source, headers, options, version, root)
        local = (entry.nvrtc_version, entry.cuda_headers_major)
        cubin = _read_cubin(entry)
        if cubin is not None:
            return entry, cubin
        if not (any_nvrtc or entry.cuda_headers_major is None):
            return None
    stored = _stored_builds(root / spec.uri) - {local}
    for build in sorted(stored, key=lambda b: (b[0], -1 if b[1] is None else b[1]), reverse=True):
        entry = _entry(spec, source, headers, options, *build, root)
        cubin = _read_cubin(entry)
        if cubin is not None:
            logger.info("using %s, built with NVRTC %d.%d", entry.path(".cubin"), *build[0])
            return entry, cubin
    return None


def _stored_builds(directory: Path) -> set[tuple[tuple[int, int], int | None]]:
    """The (NVRTC version, CUDA headers' major) pairs the metadata in an entry folder names:
    candidates, checked by the key."""
    builds = set()
    try:
        files.check_dir(directory)
        names = [e.name for e in os.scandir(directory) if e.name.endswith(".json")]
    except OSError:
        return builds
    for name in names:
        with contextlib.suppress(OSError, ValueError, TypeError, LookupError):
            metadata = json.loads(_read_entry_file(directory / name))
            major, minor = metadata["nvrtc_version"]
            cuda_headers = metadata["cuda_headers_major"]
            builds.add(((int(major), int(minor)), None if cuda_headers is None else int(cuda_headers)))
    return builds


def _load_or_compile(
    spec: KernelSpec,
    options: Sequence[str],
    headers: Mapping[str, str],
    compile_on_miss: bool = True,
    source: str | None = None,
) -> tuple[bytes, float | None, Path | None, tuple[str, ...]]:
    """(cubin, compile seconds, the cache folder holding the entry, ptxas's performance-loss lines
    when compiled here): seconds None when it came from the disk cache, folder None when it could
    not be stored (a CacheWriteError caught by the caller).  Raises JitDisabledError on a miss
    when not ``compile_on_miss`` (FLASHGEN_DISABLE_JIT; `flashgen build` always compiles),
    CacheWriteError when the compiled cubin could not be stored, NvrtcNotFoundError on a miss
    without NVRTC. ``source``: the rendered instance, if the caller has it."""
    configured = config.cache_dir()
    root = read_dir(configured)
    if source is None:
        source = render.render_instance(spec)
    version = _nvrtc_version()
    found = _find(spec, source, headers, options, version, root, any_nvrtc=not compile_on_miss)
    if found is not None:
        return found[1], None, root, ()
    if not compile_on_miss:
        raise JitDisabledError(spec, root)
    if version is None:
        version = nvrtc.nvrtc_version()  # raises NvrtcNotFoundError, saying what to install
    directory = write_dir(configured)
    entry = _local_entry(spec, source, headers, options, version, directory)
    if directory != root:
        cubin = _read_cubin(entry)
        if cubin is not None:
            return cubin, None, directory, ()
    with _entry_lock(entry), contextlib.ExitStack() as locked:
        try:
            files.make_dir(entry.directory)
            files.check_dir(entry.directory)
            locked.enter_context(_file_lock(entry.path(".lock")))
        except OSError as exc:
            # A fault below the cache folder (the entry's folder is a file, a link or another
            # user's; no space or descriptors for the folder or lock): compile without storing.
            cubin, _, _ = _compile(entry, None)
            raise CacheWriteError(entry.path(".cubin"), exc, cubin) from exc
        # Another thread or process may have compiled this entry while we waited for the lock.
        cubin = _read_cubin(entry)
        if cubin is not None:
            return cubin, None, directory, ()
        cubin, seconds, losses = _compile_and_store(entry)
        return cubin, seconds, directory, losses


def _compile(entry: _Entry, source_path: Path | None) -> tuple[bytes, float, tuple[str, ...]]:
    """(cubin, seconds, ptxas's performance-loss lines)."""
    start = time.perf_counter()
    cubin, log = nvrtc.compile_with_log(
        entry.source, entry.spec.uri, entry.spec.arch, entry.headers, entry.options, source_path
    )
    return cubin, time.perf_counter() - start, nvrtc.performance_losses(log)


def _compile_and_store(entry: _Entry) -> tuple[bytes, float, tuple[str, ...]]:
    """Compile, then write metadata and cubin (last: an entry exists when its cubin does).  A
    failed write removes the entry's files and raises CacheWriteError carrying the cubin."""
    _sweep_stale_temp_files(entry.directory)
    source_path: Path | None = entry.path(".cu")
    write_error: OSError | None = None
    try:
        files.atomic_write(source_path, entry.source.encode())
    except OSError as exc:
        # Compile anyway: without a source path NVRTC saves a failing source to a temp folder.
        write_error, source_path = exc, None
    cubin, seconds, losses = _compile(entry, source_path)
    if write_error is None:
        try:
            files.atomic_write(entry.path(".json"), _metadata(entry, seconds, losses))
            files.atomic_write(entry.path(".cubin"), _frame(entry, cubin))
        except OSError as exc:
            write_error = exc
    if write_error is not None:
        for suffix in (".cubin", ".json", ".cu"):  # no half entry (nor a stale corrupt cubin)
            with contextlib.suppress(OSError):
                entry.path(suffix).unlink(missing_ok=True)
        raise CacheWriteError(entry.path(".cubin"), write_error, cubin) from write_error
    logger.info("compiled %s in %.1f s -> %s", entry.spec.uri, seconds, entry.path(".cubin"))
    return cubin, seconds, losses


def _metadata(entry: _Entry, seconds: float | None, performance_losses: Sequence[str] = ()) -> bytes:
    """The entry's .json: what the NVRTC-free lookup reads (NVRTC version, CUDA headers' major)
    and what a person reads.  ``seconds`` None: not compiled here (an archived entry)."""
    metadata = {
        "uri": entry.spec.uri,
        "key": entry.key,
        "spec": entry.spec.to_dict(),
        "options": list(entry.options),
        "nvrtc_version": list(entry.nvrtc_version),
        "cuda_headers_major": entry.cuda_headers_major,
        "compile_seconds": None if seconds is None else round(seconds, 3),
        "performance_losses": list(performance_losses),
    }
    return (json.dumps(metadata, indent=2) + "\n").encode()


def _frame(entry: _Entry, cubin: bytes) -> bytes:
    key, uri = bytes.fromhex(entry.key), entry.spec.uri.encode()
    digest = hashlib.sha256(key + uri + cubin).digest()
    return _FRAME.pack(_MAGIC, key, len(uri), len(cubin), digest) + uri + cubin


def _read_cubin(entry: _Entry) -> bytes | None:
    """The payload of the entry's framed cubin; None when missing, damaged, another kernel's, or
    not safely readable (a link, another user's folder)."""
    path = entry.path(".cubin")
    try:
        files.check_dir(entry.directory)
        data = _read_entry_file(path)
    except (FileNotFoundError, NotADirectoryError):  # the latter: the cache "folder" is a file
        return None
    except OSError as exc:
        logger.warning("cannot read cache entry %s (%s); recompiling", path, exc)
        return None
    framed = _unframe(data)
    if framed is None:
        logger.warning("corrupt cache entry %s; recompiling", path)
        return None
    key, uri, payload = framed
    if key == bytes.fromhex(entry.key) and uri == entry.spec.uri.encode():
        return payload
    logger.warning(
        "cache entry %s holds the kernel %s (key %s), not this one; recompiling",
        path, uri.decode(errors="replace"), key.hex(),
    )
    return None


def _unframe(data: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(key, URI, payload) of a framed cubin; None when it is not one or is damaged."""
    if len(data) < _FRAME.size:
        return None
    magic, key, uri_length, length, digest = _FRAME.unpack_from(data)
    uri = data[_FRAME.size:_FRAME.size + uri_length]
    payload = data[_FRAME.size + uri_length:]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(key + uri + payload).digest() != digest:
        return None
    return key, uri, payload


def _is_temp_file(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _sweep_stale_temp_files(directory: Path) -> None:
    """Remove the temp files that writers killed mid-write left in ``directory``: a live writer's
    temp file exists for the moment of one write, far less than STALE_TEMP_SECONDS."""
    deadline = time.time() - STALE_TEMP_SECONDS
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for item in entries:
            with contextlib.suppress(OSError):
                if _is_temp_file(item.name) and item.stat(follow_symlinks=False).st_mtime < deadline:
                    os.unlink(item.path)  # a link is removed, never followed


@dataclasses.dataclass(frozen=True)
class BuildResult:
    spec: KernelSpec
    seconds: float            # compile time; 0.0 when the cubin was already cached
    cached: bool
    error: str | None = None  # the CompileError message (source path, options, NVRTC log)
    cache_dir: Path | None = None  # the cache folder holding the entry (None on an error)
    # ptxas's performance-loss lines (nvrtc.performance_losses) when compiled here; a cached
    # entry's are in its .json.
    performance_losses: tuple[str, ...] = ()


def _set_parent_death_signal() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent exits (PR_SET_PDEATHSIG).  The
    signal follows the parent *thread* that started the process: ProcessPoolExecutor starts spawn
    workers from the thread that submits, the one iterating build()."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


# A build worker's header sources: the snapshot `build` took, so that every instance of one build
# compiles (and is keyed) against the same templates, whatever happens to the files meanwhile.
_worker_headers: Mapping[str, str] | None = None


def _worker_init(parent_pid: int, headers: Mapping[str, str]) -> None:
    """Build workers die with `flashgen build`: a killed build must not leave compiles running."""
    global _worker_headers
    _worker_headers = headers
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _build_executor(workers: int, headers: Mapping[str, str]) -> ProcessPoolExecutor:
    # spawn: NVRTC and CUDA state do not survive fork safely, and it behaves the same everywhere.
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(os.getpid(), dict(headers)),
    )


def build(specs: Iterable[KernelSpec], jobs: int) -> Iterator[BuildResult]:
    """Compile the cubins that serve ``specs`` into the cache, each compile target
    (matrix.compile_target) once, ``jobs`` processes at a time, yielding a result per target as it
    completes (cached entries first).  Failures are results, not exceptions, so one bad instance
    does not stop the rest.  The templates are read once, here: the workers compile the sources
    rendered here against these headers."""
    options = tuple(compile_options())
    headers = render.header_sources()
    root = read_dir()
    version = _nvrtc_version()
    misses = {}
    # Look up in this process first: a warm cache then costs no worker start-up.
    for spec in matrix.compile_targets(specs):
        source = render.render_instance(spec)
        if _find(spec, source, headers, options, version, root, any_nvrtc=False) is not None:
            yield BuildResult(spec, 0.0, cached=True, cache_dir=root)
        else:
            misses[spec] = source
    if jobs <= 1 or len(misses) <= 1:
        for spec, source in misses.items():
            yield _build_one(spec, source, options, headers)
        return
    executor = _build_executor(min(jobs, len(misses)), headers)
    try:
        futures = {executor.submit(_build_one, spec, source, options): spec for spec, source in misses.items()}
        for future in as_completed(futures):
            try:
                yield future.result()
            except Exception as exc:  # the worker died (e.g. NVRTC crashed); report and go on
                error = f"{type(exc).__name__}: {exc}"
                yield BuildResult(futures[future], 0.0, cached=False, error=error)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _build_one(spec: KernelSpec, source: str, options: tuple[str, ...],
               headers: Mapping[str, str] | None = None) -> BuildResult:
    """Worker (module-level so that a spawned process can unpickle it): headers default to the
    snapshot the worker was started with."""
    try:
        _, seconds, directory, losses = _load_or_compile(spec, options, headers or _worker_headers, source=source)
    except nvrtc.CompileError as exc:
        return BuildResult(spec, 0.0, cached=False, error=str(exc))
    except Exception as exc:
        return BuildResult(spec, 0.0, cached=False, error=f"{type(exc).__name__}: {exc}")
    return BuildResult(spec, seconds or 0.0, cached=seconds is None, cache_dir=directory, performance_losses=losses)


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    directory: Path
    entries: int   # cubins
    bytes: int     # every file, sources and metadata included


def cache_info(directory: Path | None = None) -> CacheInfo:
    """Entries and bytes of a cache folder (default: the configured one); links are not followed."""
    directory = config.cache_dir() if directory is None else directory
    entries = size = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                if stat.S_ISREG(st.st_mode):
                    entries += name.endswith(".cubin")
                    size += st.st_size
    return CacheInfo(directory, entries, size)


@dataclasses.dataclass(frozen=True)
class ClearResult:
    removed: int                         # cubins removed
    failed: list[tuple[Path, str]]       # what could not be removed, and why


def clear_cache() -> ClearResult:
    """Remove every entry (and this process's memo).  Only the per-URI folders are removed, so a
    cache dir pointed at a shared folder loses nothing else; the folders this process reads and
    writes instead (the fallback) are cleared too.  Links are never followed nor removed: a linked
    per-URI folder is reported.  Do not run it while another process is building."""
    configured = config.cache_dir()
    directories = [configured, read_dir(configured)]
    with contextlib.suppress(OSError):  # no usable folder to write to: nothing written there
        directories.append(write_dir(configured))
    removed, failed = 0, []

    def record(path, exc) -> None:
        failed.append((Path(path), str(exc)))

    # Python 3.12 replaced rmtree's onerror with onexc.
    on_error = (
        {"onexc": lambda function, path, exc: record(path, exc)} if sys.version_info >= (3, 12)
        else {"onerror": lambda function, path, info: record(path, info[1])}
    )
    for directory in dict.fromkeys(directories):
        try:
            children = [c for c in os.scandir(directory) if c.name.startswith("flash_")]
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            record(directory, exc)
            continue
        for child in children:
            if child.is_symlink():
                record(child.path, "a link, which flashgen does not follow")
                continue
            if not child.is_dir(follow_symlinks=False):
                continue
            try:
                cubins = [Path(child.path, n) for n in os.listdir(child.path) if n.endswith(".cubin")]
            except OSError as exc:
                record(child.path, exc)
                continue
            shutil.rmtree(child.path, **on_error)  # removes links inside without following them
            removed += sum(not os.path.lexists(p) for p in cubins)
    _cubins.clear()
    return ClearResult(removed, failed)


# --- Archives: a built cache carried to machines without NVRTC ----------------------------------
#
# A gzipped tar: manifest.json first, then per entry (by URI) <uri>/<key>.json and <uri>/<key>.cubin,
# the metadata and the framed cubin exactly as the cache stores them.  Members have mtime 0, owner 0
# and mode 0644, so one cache always gives the same bytes.

ARCHIVE_FORMAT = "flashgen-cubin-archive"
ARCHIVE_SCHEMA = 1
ARCHIVE_MANIFEST = "manifest.json"
_KEY_CHARS = frozenset("0123456789abcdef")


class ArchiveError(ValueError):
    """An archive that cannot be written or imported; the message names the member and why."""


@dataclasses.dataclass(frozen=True)
class ImportResult:
    entries: int
    directory: Path  # where the entries were written (the fallback when the cache is not writable)


def export_archive(specs: Iterable[KernelSpec], path: Path) -> int:
    """Write the cache entries that serve ``specs`` (their compile targets, which must be built) to
    the archive ``path``, replaced atomically, 0644; returns how many.  The entries are those this
    process would load (_find); each lists the instances of ``specs`` it serves."""
    import gzip
    import io
    import tarfile

    options = tuple(compile_options())
    headers = render.header_sources()
    root = read_dir()
    version = _nvrtc_version()
    members: list[tuple[str, bytes]] = []
    entries = []
    served: dict[KernelSpec, list[KernelSpec]] = {}
    for spec in set(specs):
        served.setdefault(matrix.compile_target(spec), []).append(spec)
    for spec in sorted(served, key=lambda s: s.uri):
        found = _find(spec, render.render_instance(spec), headers, options, version, root, any_nvrtc=False)
        if found is None:
            raise ArchiveError(f"kernel {spec.uri} is not in the cache {root}: build it first")
        entry, payload = found
        framed, metadata = _frame(entry, payload), _metadata(entry, None)
        name = f"{spec.uri}/{entry.key}"
        members += [(f"{name}.json", metadata), (f"{name}.cubin", framed)]
        entries.append({
            "uri": spec.uri, "key": entry.key, "arch": spec.arch,
            "serves": sorted(s.uri for s in served[spec]),
            "nvrtc_version": list(entry.nvrtc_version), "cuda_headers_major": entry.cuda_headers_major,
            "sha256": hashlib.sha256(framed).hexdigest(),
            "metadata_sha256": hashlib.sha256(metadata).hexdigest(),
        })

    def uniform(field: str):  # the archive's value when every entry agrees (they do when one build made them)
        values = {json.dumps(e[field]) for e in entries}
        return entries[0][field] if len(values) == 1 else None

    manifest = {
        "format": ARCHIVE_FORMAT, "schema": ARCHIVE_SCHEMA, "cache_schema": SCHEMA_VERSION,
        "nvrtc_version": uniform("nvrtc_version") if entries else None,
        "cuda_headers_major": uniform("cuda_headers_major") if entries else None,
        # The targets the archive serves, which an entry's own arch may be below (compile_target).
        "archs": sorted({s.arch for instances in served.values() for s in instances}), "entries": entries,
    }
    members.insert(0, (ARCHIVE_MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode()))

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            if hasattr(os, "fchmod"):
                os.fchmod(file.fileno(), files.FILE_MODE)
            with gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0) as gz, \
                    tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(data), files.FILE_MODE, 0
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(entries)


def _check_member_names(members) -> None:
    """Refuse the whole archive before anything is written: a member that is not a plain file, or
    whose name is absolute or climbs out (tar-slip).  Import never extracts by member name anyway;
    such a member is a sign of an archive flashgen did not write."""
    for member in members:
        name = member.name
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts:
            raise ArchiveError(f"archive member {name!r} has an absolute path or '..': refused")
        if not member.isfile():
            raise ArchiveError(f"archive member {name!r} is not a regular file (a link, folder or "
                               "device): refused")


def _valid_uri(uri) -> bool:
    return (isinstance(uri, str) and uri.startswith("flash_") and len(uri) < 256
            and all(c.isascii() and (c.isalnum() or c == "_") for c in uri))


def import_archive(path: Path) -> ImportResult:
    """Load an archive written by export_archive into the cache's write folder (the configured one
    when writable), through the cache's writers: folders checked and never followed, files 0644 by
    atomic replace, each entry under its lock, its cubin last.  Every member is checked first:
    names (no absolute paths, no '..', plain files only, nothing the manifest does not list), then
    per entry the cubin's sha256 and its frame's key and URI against the manifest.  Raises
    ArchiveError (and writes nothing for the entry at fault) when a check fails."""
    import tarfile

    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as exc:
        raise ArchiveError(f"{path} is not a flashgen archive: {exc}") from exc
    with tar:
        members = tar.getmembers()
        _check_member_names(members)
        by_name = {m.name: m for m in members}

        def read(name: str) -> bytes:
            member = by_name.get(name)
            if member is None:
                raise ArchiveError(f"{path}: member {name!r} is missing")
            return tar.extractfile(member).read()

        try:
            manifest = json.loads(read(ARCHIVE_MANIFEST))
            schema_ok = manifest["format"] == ARCHIVE_FORMAT and manifest["schema"] == ARCHIVE_SCHEMA
            entries = list(manifest["entries"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ArchiveError(f"{path}: no valid {ARCHIVE_MANIFEST} ({exc})") from exc
        if not schema_ok:
            raise ArchiveError(f"{path}: format {manifest.get('format')!r} schema {manifest.get('schema')!r}, "
                               f"not {ARCHIVE_FORMAT!r} schema {ARCHIVE_SCHEMA}")
        if manifest.get("cache_schema") != SCHEMA_VERSION:
            raise ArchiveError(f"{path} holds cache entries of schema {manifest.get('cache_schema')}, which this "
                               f"flashgen (schema {SCHEMA_VERSION}) would never load: rebuild it")
        listed = {ARCHIVE_MANIFEST}
        for item in entries:
            uri, key = (item.get("uri"), item.get("key")) if isinstance(item, dict) else (None, None)
            if not _valid_uri(uri) or not (isinstance(key, str) and len(key) == 64 and set(key) <= _KEY_CHARS):
                raise ArchiveError(f"{path}: manifest entry {item!r} has no valid URI and key")
            listed |= {f"{uri}/{key}.json", f"{uri}/{key}.cubin"}
        unlisted = sorted(by_name.keys() - listed)
        if unlisted:
            raise ArchiveError(f"{path}: member {unlisted[0]!r} is not in the manifest: refused")

        root = write_dir()
        root.parent.mkdir(parents=True, exist_ok=True)
        files.make_dir(root)
        for item in entries:
            uri, key = item["uri"], item["key"]
            framed, metadata = read(f"{uri}/{key}.cubin"), read(f"{uri}/{key}.json")
            _check_archived_entry(path, item, framed, metadata)
            directory = root / uri
            files.make_dir(directory)
            files.check_dir(directory)
            with _file_lock(directory / f"{key}.lock"):
                files.atomic_write(directory / f"{key}.json", metadata)
                files.atomic_write(directory / f"{key}.cubin", framed)  # last: the entry exists now
    logger.info("imported %d kernels from %s into %s", len(entries), path, root)
    return ImportResult(len(entries), root)


def _check_archived_entry(path: Path, item: Mapping, framed: bytes, metadata: bytes) -> None:
    uri, key = item["uri"], item["key"]
    where = f"{path}: {uri}/{key}.cubin"
    if hashlib.sha256(framed).hexdigest() != item.get("sha256"):
        raise ArchiveError(f"{where} does not match its sha256 in the manifest: refused")
    if hashlib.sha256(metadata).hexdigest() != item.get("metadata_sha256"):
        raise ArchiveError(f"{where[:-6]}.json does not match its sha256 in the manifest: refused")
    unframed = _unframe(framed)
    if unframed is None:
        raise ArchiveError(f"{where} is not a valid framed cubin: refused")
    if unframed[0] != bytes.fromhex(key) or unframed[1] != uri.encode():
        raise ArchiveError(f"{where} is framed for {unframed[1].decode(errors='replace')} (key "
                           f"{unframed[0].hex()}), not the entry the manifest names: refused")
    try:
        fields = json.loads(metadata)
        ok = fields["uri"] == uri and fields["key"] == key and len(fields["nvrtc_version"]) == 2
    except (ValueError, TypeError, KeyError) as exc:
        raise ArchiveError(f"{where[:-6]}.json is not valid entry metadata ({exc})") from exc
    if not ok:
        raise ArchiveError(f"{where[:-6]}.json names another entry: refused")
