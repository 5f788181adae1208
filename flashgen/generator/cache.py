"""The on-disk cubin cache: render -> key -> disk -> compile -> store.

Layout under ``config.cache_dir()``::

    <uri>/<key>.cubin   framed cubin: magic, payload length, sha256 of the payload, payload
    <uri>/<key>.cu      the rendered source (what CompileError points at)
    <uri>/<key>.json    metadata: spec, options, NVRTC version, compile seconds
    <uri>/<key>.lock    per-entry file lock

The URI makes the folder readable; the key (a digest of everything that decides the binary) makes
the entry correct.  A corrupt or truncated cubin is a miss, logged and recompiled, never a crash.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import struct
import tempfile
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


def _entry(spec: KernelSpec, options: Sequence[str], headers: Mapping[str, str]) -> _Entry:
    source = render.render_instance(spec)
    version = nvrtc.nvrtc_version()
    key = cache_key(
        source=source, headers=headers, arch=spec.arch, options=options, nvrtc_version=version
    )
    return _Entry(spec, source, headers, tuple(options), version, key, config.cache_dir() / spec.uri)


def get_cubin(spec: KernelSpec) -> bytes:
    """The cubin of ``spec``: from this process's memo, else the disk cache, else compiled (and
    stored).  Raises nvrtc.CompileError when NVRTC rejects the instance."""
    options = tuple(compile_options())
    cubin = _cubins.get((spec, options))
    if cubin is None:
        cubin, _ = _load_or_compile(spec, options, render.header_sources())
        _cubins[(spec, options)] = cubin
    return cubin


def _load_or_compile(
    spec: KernelSpec, options: Sequence[str], headers: Mapping[str, str]
) -> tuple[bytes, float | None]:
    """(cubin, compile seconds), seconds None when it came from the disk cache."""
    entry = _entry(spec, options, headers)
    cubin = _read_cubin(entry.path(".cubin"))
    if cubin is not None:
        return cubin, None
    entry.directory.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(entry.path(".lock")):
        # Another process may have compiled this entry while we waited for the lock.
        cubin = _read_cubin(entry.path(".cubin"))
        if cubin is not None:
            return cubin, None
        return _compile_and_store(entry)


def _compile_and_store(entry: _Entry) -> tuple[bytes, float]:
    source_path = entry.path(".cu")
    _atomic_write(source_path, entry.source.encode())
    start = time.perf_counter()
    cubin = nvrtc.compile_cubin(
        entry.source, entry.spec.uri, entry.spec.arch, entry.headers, entry.options, source_path
    )
    seconds = time.perf_counter() - start
    _atomic_write(
        entry.path(".cubin"), _FRAME.pack(_MAGIC, len(cubin), hashlib.sha256(cubin).digest()) + cubin
    )
    metadata = {
        "uri": entry.spec.uri,
        "spec": entry.spec.to_dict(),
        "options": list(entry.options),
        "nvrtc_version": list(entry.nvrtc_version),
        "compile_seconds": round(seconds, 3),
    }
    _atomic_write(entry.path(".json"), (json.dumps(metadata, indent=2) + "\n").encode())
    logger.info("compiled %s in %.1f s -> %s", entry.spec.uri, seconds, entry.path(".cubin"))
    return cubin, seconds


def _read_cubin(path: Path) -> bytes | None:
    """The payload of a framed cubin file; None when missing or damaged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
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


def cache_info() -> CacheInfo:
    directory = config.cache_dir()
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    return CacheInfo(
        directory,
        entries=sum(p.suffix == ".cubin" for p in files),
        bytes=sum(p.stat().st_size for p in files),
    )


def clear_cache() -> int:
    """Remove every entry (and this process's memo); returns the number of cubins removed.  Only
    the per-URI folders are removed, so a cache dir pointed at a shared folder loses nothing else.
    Do not run it while another process is building."""
    directory = config.cache_dir()
    removed = 0
    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir() and child.name.startswith("flash_"):
                removed += sum(1 for _ in child.glob("*.cubin"))
                shutil.rmtree(child)
    _cubins.clear()
    return removed
