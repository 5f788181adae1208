"""The on-disk cubin cache: render -> key -> disk -> compile -> store.

Layout under ``config.cache_dir()``::

    <uri>/<key>.cubin   framed cubin: magic, payload length, sha256 of the payload, payload
    <uri>/<key>.cu      the rendered source (what CompileError points at)
    <uri>/<key>.json    metadata: spec, options, NVRTC version, compile seconds
    <uri>/<key>.lock    per-entry file lock

The URI makes the folder readable; the key (a digest of everything that decides the binary) makes
the entry correct.  The cubin is written last, so an entry exists exactly when its cubin does.

Faults never stop the caller: a corrupt or truncated cubin is a miss, logged and recompiled; an
unwritable cache folder is still read, and new entries go to a per-user temporary folder (one
warning); a failed write (a full disk) removes what it wrote and the compiled cubin is used from
memory.  Hits take no lock, so a read-only prebuilt cache works (see FLASHGEN_DISABLE_JIT).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import filelock

from .. import config
from . import nvrtc, render
from .spec import KernelSpec

logger = logging.getLogger("flashgen")

# Bump when the key's fields, the fixed flags of nvrtc.compile_cubin or the entry format change.
SCHEMA_VERSION = 1

_MAGIC = b"FGCUBIN1"
_FRAME = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)

# Cubin bytes already found or built by this process, by (spec, options).  Options are part of the
# memo key because FLASHGEN_NVRTC_EXTRA_OPTIONS may change while the process runs.
_cubins: dict[tuple[KernelSpec, tuple[str, ...]], bytes] = {}

# Where this process writes new entries, by configured cache folder: decided on the first miss
# (probing the folder once), so a read-only folder costs one warning, not a probe per call.
_write_dirs: dict[Path, Path] = {}
_write_dirs_lock = threading.Lock()

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
            f"FLASHGEN_CACHE_DIR, NVRTC version and FLASHGEN_NVRTC_EXTRA_OPTIONS), or unset "
            f"FLASHGEN_DISABLE_JIT"
        )


class CacheWriteError(OSError):
    """A compiled cubin could not be stored (e.g. the disk is full).  Nothing of the entry is left
    on disk; ``cubin`` holds the compiled binary."""

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
) -> str:
    """sha256 over labelled, length-prefixed fields, so no two different inputs share a byte stream.
    Headers are taken in name order: the dict's insertion order does not decide the binary."""
    digest = hashlib.sha256()

    def field(label: str, value: str) -> None:
        data = value.encode()
        digest.update(f"{label}:{len(data)}:".encode())
        digest.update(data)

    field("schema", str(SCHEMA_VERSION))
    field("nvrtc", "{}.{}".format(*nvrtc_version))
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
    key: str
    directory: Path

    def path(self, suffix: str) -> Path:
        return self.directory / f"{self.key}{suffix}"


def _entry(
    spec: KernelSpec, options: Sequence[str], headers: Mapping[str, str], root: Path | None = None
) -> _Entry:
    """The entry of ``spec`` under ``root`` (default: the configured cache folder)."""
    source = render.render_instance(spec)
    version = nvrtc.nvrtc_version()
    key = cache_key(
        source=source, headers=headers, arch=spec.arch, options=options, nvrtc_version=version
    )
    root = config.cache_dir() if root is None else root
    return _Entry(spec, source, headers, tuple(options), version, key, root / spec.uri)


def unwritable_reason(directory: Path) -> str | None:
    """None when ``directory`` can be created and written, else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return str(exc)


def fallback_cache_dir() -> Path:
    """The per-user temporary cache folder used when the configured one is not writable."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"flashgen-{user}"


def write_dir(configured: Path | None = None) -> Path:
    """The folder new entries are written to: the configured cache folder when it is writable,
    else the fallback (with one warning per process and folder)."""
    configured = config.cache_dir() if configured is None else configured
    directory = _write_dirs.get(configured)
    if directory is not None:
        return directory
    with _write_dirs_lock:
        if configured not in _write_dirs:
            _write_dirs[configured] = _choose_write_dir(configured)
    return _write_dirs[configured]


def _choose_write_dir(configured: Path) -> Path:
    reason = unwritable_reason(configured)
    if reason is None:
        return configured
    fallback = fallback_cache_dir()
    # 0o700: another user must not be able to plant cubins that this user's jobs would run.
    with contextlib.suppress(OSError):
        fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    fallback_reason = unwritable_reason(fallback)
    if fallback_reason is None and hasattr(os, "getuid") and fallback.stat().st_uid != os.getuid():
        fallback_reason = "owned by another user"
    if fallback_reason is not None:
        raise OSError(
            f"the kernel cache {configured} is not writable ({reason}), nor is the fallback "
            f"{fallback} ({fallback_reason}): set FLASHGEN_CACHE_DIR to a writable folder"
        )
    logger.warning(
        "kernel cache %s is not writable (%s); reading it, and writing new kernels to %s "
        "(set FLASHGEN_CACHE_DIR to a writable folder to keep them)", configured, reason, fallback
    )
    return fallback


def _entry_lock(entry: _Entry) -> threading.Lock:
    path = entry.path(".cubin")
    with _entry_locks_guard:
        return _entry_locks.setdefault(path, threading.Lock())


def get_cubin(spec: KernelSpec) -> bytes:
    """The cubin of ``spec``: from this process's memo, else the disk cache, else compiled (and
    stored).  Raises nvrtc.CompileError when NVRTC rejects the instance."""
    options = tuple(compile_options())
    cubin = _cubins.get((spec, options))
    if cubin is None:
        try:
            cubin, _ = _load_or_compile(
                spec, options, render.header_sources(), compile_on_miss=not config.disable_jit()
            )
        except CacheWriteError as exc:
            # A training job or server must not stop because its cache disk filled up: the
            # kernel is compiled, so use it; this process keeps it in memory, the next one
            # recompiles.  (`flashgen build`, whose job is to fill the cache, reports it instead.)
            logger.warning("%s; using the compiled kernel from memory", exc)
            cubin = exc.cubin
        _cubins[(spec, options)] = cubin
    return cubin


def _load_or_compile(
    spec: KernelSpec,
    options: Sequence[str],
    headers: Mapping[str, str],
    compile_on_miss: bool = True,
) -> tuple[bytes, float | None]:
    """(cubin, compile seconds), seconds None when it came from the disk cache.  Raises
    JitDisabledError on a miss when not ``compile_on_miss`` (FLASHGEN_DISABLE_JIT; `flashgen
    build` always compiles), CacheWriteError when the compiled cubin could not be stored."""
    configured = config.cache_dir()
    entry = _entry(spec, options, headers, configured)
    cubin = _read_cubin(entry.path(".cubin"))
    if cubin is not None:
        return cubin, None
    if not compile_on_miss:
        raise JitDisabledError(spec, configured)
    directory = write_dir(configured)
    if directory != configured:
        entry = dataclasses.replace(entry, directory=directory / spec.uri)
        cubin = _read_cubin(entry.path(".cubin"))
        if cubin is not None:
            return cubin, None
    entry.directory.mkdir(parents=True, exist_ok=True)
    with _entry_lock(entry), filelock.FileLock(entry.path(".lock")):
        # Another thread or process may have compiled this entry while we waited for the lock.
        cubin = _read_cubin(entry.path(".cubin"))
        if cubin is not None:
            return cubin, None
        return _compile_and_store(entry)


def _compile_and_store(entry: _Entry) -> tuple[bytes, float]:
    """Compile, then write metadata and cubin (last: an entry exists when its cubin does).  A
    failed write removes the entry's files and raises CacheWriteError carrying the cubin."""
    source_path: Path | None = entry.path(".cu")
    write_error: OSError | None = None
    try:
        _atomic_write(source_path, entry.source.encode())
    except OSError as exc:
        # Compile anyway: without a source path NVRTC saves a failing source to a temp folder.
        write_error, source_path = exc, None
    start = time.perf_counter()
    cubin = nvrtc.compile_cubin(
        entry.source, entry.spec.uri, entry.spec.arch, entry.headers, entry.options, source_path
    )
    seconds = time.perf_counter() - start
    if write_error is None:
        metadata = {
            "uri": entry.spec.uri,
            "spec": entry.spec.to_dict(),
            "options": list(entry.options),
            "nvrtc_version": list(entry.nvrtc_version),
            "compile_seconds": round(seconds, 3),
        }
        frame = _FRAME.pack(_MAGIC, len(cubin), hashlib.sha256(cubin).digest())
        try:
            _atomic_write(entry.path(".json"), (json.dumps(metadata, indent=2) + "\n").encode())
            _atomic_write(entry.path(".cubin"), frame + cubin)
        except OSError as exc:
            write_error = exc
    if write_error is not None:
        for suffix in (".cubin", ".json", ".cu"):  # no half entry (nor a stale corrupt cubin)
            with contextlib.suppress(OSError):
                entry.path(suffix).unlink(missing_ok=True)
        raise CacheWriteError(entry.path(".cubin"), write_error, cubin) from write_error
    logger.info("compiled %s in %.1f s -> %s", entry.spec.uri, seconds, entry.path(".cubin"))
    return cubin, seconds


def _read_cubin(path: Path) -> bytes | None:
    """The payload of a framed cubin file; None when missing or damaged."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # the latter: the cache "folder" is a file
        return None
    except OSError as exc:
        logger.warning("cannot read cache entry %s (%s); recompiling", path, exc)
        return None
    if len(data) >= _FRAME.size:
        magic, length, digest = _FRAME.unpack_from(data)
        payload = data[_FRAME.size:]
        if magic == _MAGIC and length == len(payload) and hashlib.sha256(payload).digest() == digest:
            return payload
    logger.warning("corrupt cache entry %s; recompiling", path)
    return None


def _atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one: write a temp file in the same directory (same
    file system, so the rename is atomic), then os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclasses.dataclass(frozen=True)
class BuildResult:
    spec: KernelSpec
    seconds: float            # compile time; 0.0 when the cubin was already cached
    cached: bool
    error: str | None = None  # the CompileError message (source path, options, NVRTC log)


def build(specs: Iterable[KernelSpec], jobs: int) -> Iterator[BuildResult]:
    """Compile ``specs`` into the cache, ``jobs`` processes at a time, yielding a result per spec
    as it completes (cached entries first).  Failures are results, not exceptions, so one bad
    instance does not stop the rest."""
    options = tuple(compile_options())
    headers = render.header_sources()
    misses = []
    # Look up in this process first: a warm cache then costs no worker start-up.
    for spec in specs:
        if _read_cubin(_entry(spec, options, headers).path(".cubin")) is not None:
            yield BuildResult(spec, 0.0, cached=True)
        else:
            misses.append(spec)
    if jobs <= 1 or len(misses) <= 1:
        for spec in misses:
            yield _build_one(spec, options)
        return
    # spawn: NVRTC and CUDA state do not survive fork safely, and it behaves the same everywhere.
    executor = ProcessPoolExecutor(
        max_workers=min(jobs, len(misses)), mp_context=multiprocessing.get_context("spawn")
    )
    try:
        futures = {executor.submit(_build_one, spec, options): spec for spec in misses}
        for future in as_completed(futures):
            try:
                yield future.result()
            except Exception as exc:  # the worker died (e.g. NVRTC crashed); report and go on
                error = f"{type(exc).__name__}: {exc}"
                yield BuildResult(futures[future], 0.0, cached=False, error=error)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _build_one(spec: KernelSpec, options: tuple[str, ...]) -> BuildResult:
    """Worker: module-level so a spawned process can unpickle it."""
    try:
        _, seconds = _load_or_compile(spec, options, render.header_sources())
    except nvrtc.CompileError as exc:
        return BuildResult(spec, 0.0, cached=False, error=str(exc))
    except Exception as exc:
        return BuildResult(spec, 0.0, cached=False, error=f"{type(exc).__name__}: {exc}")
    return BuildResult(spec, seconds or 0.0, cached=seconds is None)


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    directory: Path
    entries: int   # cubins
    bytes: int     # every file, sources and metadata included


def cache_info(directory: Path | None = None) -> CacheInfo:
    """Entries and bytes of a cache folder (default: the configured one)."""
    directory = config.cache_dir() if directory is None else directory
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    return CacheInfo(
        directory,
        entries=sum(p.suffix == ".cubin" for p in files),
        bytes=sum(p.stat().st_size for p in files),
    )


def clear_cache() -> int:
    """Remove every entry (and this process's memo); returns the number of cubins removed.  Only
    the per-URI folders are removed, so a cache dir pointed at a shared folder loses nothing else.
    Entries in the fallback folder (when the configured one is not writable) are removed too.
    Do not run it while another process is building."""
    configured = config.cache_dir()
    removed = 0
    for directory in dict.fromkeys([write_dir(configured), configured]):
        if directory.is_dir():
            for child in directory.iterdir():
                if child.is_dir() and child.name.startswith("flash_"):
                    removed += sum(1 for _ in child.glob("*.cubin"))
                    shutil.rmtree(child)
    _cubins.clear()
    return removed
