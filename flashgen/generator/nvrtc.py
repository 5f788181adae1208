"""Compiling CUDA C++ to a cubin with NVRTC (cuda.bindings.nvrtc).  Needs no GPU and no driver."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Collection, Mapping, Sequence

from .. import config
from . import files

try:
    from cuda.bindings import nvrtc as _nvrtc
except ImportError as exc:  # no cuda-bindings: say so at the first compile, not on import
    _nvrtc = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

logger = logging.getLogger("flashgen")

# The options every flashgen kernel is compiled with, besides the fixed ones compile_with_log adds.
# -lineinfo: source lines in profilers and compute-sanitizer, at no run-time cost.
# No --use_fast_math: the kernels use fast instructions explicitly where their error is known
# (ex2.approx in common.cuh); the flag would also flush denormals and loosen divisions elsewhere.
DEFAULT_OPTIONS: tuple[str, ...] = ("-lineinfo", "-DNDEBUG")

INSTALL_HEADERS_HINT = (
    "NVRTC needs the CUDA headers (cuda_fp16.h, cuda_bf16.h) of its major version and has no "
    "built-in search path: `pip install nvidia-cuda-runtime` (CUDA 13; for NVRTC 12: "
    "`pip install 'flashgen[cu12]'`), or set CUDA_HOME to a CUDA toolkit"
)


INSTALL_NVRTC_HINT = (
    "flashgen compiles its kernels with NVRTC: `pip install nvidia-cuda-nvrtc cuda-bindings` "
    "(for a CUDA 12 driver: `pip install 'flashgen[cu12]'`), or put a CUDA toolkit's libnvrtc on "
    "the library path"
)


class NvrtcNotFoundError(RuntimeError):
    """NVRTC (libnvrtc or the cuda-bindings package) cannot be loaded."""

    def __init__(self, cause: Exception):
        self.cause = cause
        super().__init__(
            f"NVRTC is not usable ({type(cause).__name__}: {cause}): {INSTALL_NVRTC_HINT}"
        )


class CompileError(Exception):
    """NVRTC rejected a program.  Carries what is needed to reproduce: the saved source (headers
    beside it in ``<source>.headers/``), the options and the log."""

    def __init__(self, uri: str, log: str, source_path: Path, options: Sequence[str]):
        self.uri = uri
        self.log = log
        self.source_path = source_path
        self.options = list(options)
        super().__init__(
            f"NVRTC could not compile {uri}\n"
            f"source:  {source_path} (headers in {_headers_dir(source_path)})\n"
            f"options: {' '.join(self.options)}\n"
            f"log:\n{log.rstrip()}"
        )


def choose_nvrtc_major(
    installed: Collection[int],
    driver_major: int | None,
    bindings_major: int | None = None,
    requested: int | None = None,
) -> int | None:
    """Which NVRTC major version to compile with.

    A cubin loads only on a driver of its NVRTC's major version or newer (within a major,
    minor-version compatibility covers cubins), so: the one asked for (FLASHGEN_NVRTC); else, of
    those installed that the driver supports (all of them without a driver, e.g. building a cache
    on a CPU machine, or when none is old enough: the load error then says what to install), the
    one of cuda-bindings' major version (the pairing cuda-bindings supports: `flashgen[cu12]`
    brings cuda-bindings 12), else the newest.  None when no wheel is installed: cuda.bindings
    searches for libnvrtc itself."""
    if requested is not None:
        return requested
    if not installed:
        return None
    supported = [major for major in installed if driver_major is None or major <= driver_major]
    candidates = supported or list(installed)
    return bindings_major if bindings_major in candidates else max(candidates)


def nvrtc_libraries() -> dict[int, Path]:
    """libnvrtc of each major version the nvidia wheels installed, e.g. {13: .../nvidia/cu13/lib/
    libnvrtc.so.13, 12: .../nvidia/cuda_nvrtc/lib/libnvrtc.so.12}; the first site dir wins."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels; may span several site dirs
    except ImportError:
        return {}
    found: dict[int, Path] = {}
    for root in nvidia.__path__:
        for library in sorted(Path(root).glob("*/lib/libnvrtc.so.*")):
            suffix = library.name.removeprefix("libnvrtc.so.")
            if suffix.isdigit():
                found.setdefault(int(suffix), library)
    return found


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports (cuDriverGetVersion, which needs no cuInit), or
    None without a driver: compiling needs none."""
    try:
        from cuda.bindings import driver

        err, encoded = driver.cuDriverGetVersion()
    # No cuda-bindings, or no libcuda (cuda.pathfinder's DynamicLibNotFoundError, a RuntimeError).
    except (ImportError, RuntimeError, OSError):
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return encoded // 1000, encoded % 1000 // 10


def install_for_driver(driver_major: int) -> str | None:
    """The pip command that brings an NVRTC, CUDA headers and cuda-bindings a driver of CUDA
    ``driver_major`` supports; None below CUDA 12, which flashgen does not support.  For CUDA 12 the
    whole extra, not an NVRTC 12 wheel alone: cuda-bindings 13 needs a CUDA 13 driver (R580)."""
    if driver_major < 12:
        return None
    return "pip install 'flashgen[cu12]'" if driver_major == 12 else "pip install 'flashgen[cu13]'"


def bindings_major() -> int | None:
    """The major version of the installed cuda-bindings, None without it."""
    try:
        from cuda.bindings import __version__
    except ImportError:
        return None
    major = __version__.split(".")[0]
    return int(major) if major.isdigit() else None


def _load_chosen_nvrtc() -> int | None:
    """Load the chosen libnvrtc into the process before cuda.bindings' first NVRTC call, and return
    its major version (None: nothing to choose, cuda.bindings' own search decides).

    cuda.bindings 12.9.10 and 13.x use a libnvrtc that is already loaded (they look the symbols up
    globally first, and cuda.pathfinder checks what is loaded); their own search takes the first
    wheel it finds, CUDA 13's, even where `flashgen[cu12]` installed NVRTC 12 for a CUDA 12
    driver.  (cuda-bindings 12.8.0 and 12.9.0 always open libnvrtc.so.12.)"""
    installed = nvrtc_libraries()
    requested = config.nvrtc_major()
    if requested is None and len(installed) < 2:
        return None
    driver_version = driver_cuda_version() if requested is None else None
    major = choose_nvrtc_major(
        installed, driver_version and driver_version[0], bindings_major(), requested
    )
    # A major without a wheel: a CUDA toolkit's libnvrtc on the library path.
    library = installed.get(major)
    try:
        ctypes.CDLL(str(library or f"libnvrtc.so.{major}"), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        if library is not None:
            # Some wheels' libnvrtc does not find its builtins beside it (cuda.pathfinder preloads
            # them for NVRTC 13.0); this load replaces cuda.pathfinder's, so it preloads them too.
            for builtins in library.parent.glob(f"libnvrtc-builtins.so.{major}.*"):
                ctypes.CDLL(str(builtins), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as exc:
        raise NvrtcNotFoundError(exc) from exc
    logger.debug(
        "NVRTC %d chosen (installed: %s; driver: CUDA %s; cuda-bindings %s; FLASHGEN_NVRTC=%s)",
        major, sorted(installed), driver_version, bindings_major(), requested,
    )
    return major


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor).  The first call into libnvrtc, so where a missing library shows:
    raises NvrtcNotFoundError saying what to install."""
    if _nvrtc is None:
        raise NvrtcNotFoundError(_IMPORT_ERROR) from _IMPORT_ERROR
    chosen = _load_chosen_nvrtc()
    try:
        err, major, minor = _nvrtc.nvrtcVersion()
    # cuda.pathfinder raises its own error types (RuntimeError subclasses) when libnvrtc is absent.
    except (RuntimeError, OSError) as exc:
        raise NvrtcNotFoundError(exc) from exc
    _check(err, "nvrtcVersion")
    if chosen is not None and major != chosen:
        # cuda.bindings loaded an NVRTC before this process's first nvrtc_version(), or opens its
        # own (12.8.0 and 12.9.0: libnvrtc.so.12).
        message = f"NVRTC {chosen} was chosen, but cuda.bindings uses NVRTC {major}.{minor}"
        if config.nvrtc_major() is not None:
            raise NvrtcNotFoundError(RuntimeError(message + " (FLASHGEN_NVRTC)"))
        logger.warning("%s: compiling with that one", message)
    return major, minor


@functools.lru_cache(maxsize=None)
def cuda_headers_major(include_dir: Path) -> int | None:
    """The CUDA major version of a folder of CUDA headers (CUDART_VERSION in cuda_runtime_api.h),
    or None when it does not say."""
    try:
        text = (include_dir / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"^#define\s+CUDART_VERSION\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) // 1000 if match else None


def cuda_include_dir(nvrtc_major: int | None = None) -> Path | None:
    """The CUDA headers NVRTC compiles with: among the folders holding cuda_fp16.h, the first of
    NVRTC's major version (CUDA 13's cuda_fp16.h is not CUDA 12's), else the first.  Searched: the
    nvidia wheels' nvidia/cu13/include (nvidia-cuda-runtime) and nvidia/cuda_runtime/include
    (nvidia-cuda-runtime-cu12), then $CUDA_HOME/include, then /usr/local/cuda/include.
    ``nvrtc_major``: those an NVRTC of that major version would use (without loading NVRTC)."""
    candidates: list[Path] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels; may span several site dirs
    except ImportError:
        pass
    else:
        for root in nvidia.__path__:
            candidates.extend(Path(root) / sub / "include" for sub in ("cu13", "cu12", "cuda_runtime"))
    cuda_home = config.cuda_home()
    if cuda_home is not None:
        candidates.append(cuda_home / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    found = [c for c in candidates if (c / "cuda_fp16.h").is_file()]
    if len(found) < 2:
        return found[0] if found else None
    major = nvrtc_version()[0] if nvrtc_major is None else nvrtc_major
    return next((c for c in found if cuda_headers_major(c) == major), found[0])


# ptxas's word for code it made slower than the program asks, e.g. (C7512) every wgmma serialized
# for want of registers: the kernel still runs, several times slower, so the matrix test fails on it.
PERFORMANCE_LOSS = "Potential Performance Loss"


def performance_losses(log: str) -> tuple[str, ...]:
    """The lines of an NVRTC log in which ptxas reports a performance loss."""
    return tuple(line.strip() for line in log.splitlines() if PERFORMANCE_LOSS in line)


def compile_with_log(
    source: str,
    name: str,
    arch: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    source_path: Path | None = None,
) -> tuple[bytes, str]:
    """Compile ``source`` to a cubin for ``arch`` ("sm_80", "sm_90a"); returns the cubin and
    NVRTC's log of the compile (its warnings and ptxas's notes).

    ``headers`` maps include names to their text; NVRTC resolves ``#include "name"`` from them.
    ``source_path`` is where the source already lies (the cache saves it); without one, a failed
    compile saves it to a temporary directory.  Raises CompileError when NVRTC rejects the program.
    """
    nvrtc_version()  # a missing NVRTC fails here, with its fix, before anything else
    include_dir = cuda_include_dir()
    if include_dir is None:
        raise RuntimeError(INSTALL_HEADERS_HINT)
    # A real architecture (sm_XX) makes NVRTC emit SASS, so nothing is JIT-compiled at load time.
    all_options = [f"--gpu-architecture={arch}", "-std=c++17", f"-I{include_dir}", *options]
    names = list(headers)
    err, program = _nvrtc.nvrtcCreateProgram(
        source.encode(),
        name.encode(),
        len(names),
        [headers[n].encode() for n in names],
        [n.encode() for n in names],
    )
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = _nvrtc.nvrtcCompileProgram(
            program, len(all_options), [o.encode() for o in all_options]
        )
        log = _program_log(program)
        # Any failure here (a compile error, an invalid option) is explained in the log.
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            saved = _save_for_reproduction(source, name, headers, source_path)
            raise CompileError(name, log, saved, all_options)
        if log.strip():
            logger.info("NVRTC log for %s:\n%s", name, log.rstrip())
        for loss in performance_losses(log):
            logger.warning("%s: %s", name, loss)
        err, size = _nvrtc.nvrtcGetCUBINSize(program)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = _nvrtc.nvrtcGetCUBIN(program, cubin)
        _check(err, "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        # Warn rather than raise: a leaked program must not hide the result or the real error.
        (err,) = _nvrtc.nvrtcDestroyProgram(program)
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            logger.warning("nvrtcDestroyProgram failed for %s: %s", name, _error_string(err))


def compile_cubin(*args, **kwargs) -> bytes:
    """compile_with_log's cubin alone (the same arguments)."""
    return compile_with_log(*args, **kwargs)[0]


def compile_phases(
    source: str, name: str, arch: str, headers: Mapping[str, str], options: Sequence[str]
) -> dict[str, float]:
    """Compile as compile_cubin does and return NVRTC's own timing of each phase, in ms, in the
    order it reports them (NVRTC 13.0: the CUDA C++ front end, the NVVM optimizer, and PTX
    translation, which is ptxas). Empty when this NVRTC reports none (its --time option)."""
    with tempfile.TemporaryDirectory(prefix="flashgen-nvrtc-time-") as directory:
        report = Path(directory) / "time.csv"
        compile_cubin(source, name, arch, headers, [*options, f"--time={report}"])
        try:
            lines = report.read_text().splitlines()
        except OSError:
            return {}
    phases: dict[str, float] = {}
    for line in lines[1:]:  # header: File name, phase name, metric, unit
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 4 and fields[3] == "ms":
            try:
                phases[fields[1]] = phases.get(fields[1], 0.0) + float(fields[2])
            except ValueError:
                continue
    return phases


def _check(err, call: str) -> None:
    if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {_error_string(err)}")


def _error_string(err) -> str:
    _, text = _nvrtc.nvrtcGetErrorString(err)
    return text.decode()


def _program_log(program) -> str:
    err, size = _nvrtc.nvrtcGetProgramLogSize(program)
    _check(err, "nvrtcGetProgramLogSize")
    log = bytearray(size)
    (err,) = _nvrtc.nvrtcGetProgramLog(program, log)
    _check(err, "nvrtcGetProgramLog")
    return log.rstrip(b"\0").decode(errors="replace")


def _headers_dir(source_path: Path) -> Path:
    return source_path.with_suffix(".headers")


def _save_for_reproduction(
    source: str, name: str, headers: Mapping[str, str], source_path: Path | None
) -> Path:
    """Write the source (unless already saved) and the in-memory headers to files, so that the
    failing compile can be rerun by hand with ``-I<source>.headers``.  Beside a given source (a
    cache entry, which other users read) with the cache's rules: folders 0755 that are real and
    this user's, files 0644 by atomic replace, so a planted link is never written through.  When
    that fails, or without a source path: a fresh private temporary folder."""
    if source_path is not None:
        try:
            _write_headers(_headers_dir(source_path), headers)
            return source_path
        except OSError as exc:
            logger.warning("cannot save the headers of %s beside %s (%s); saving source and headers "
                           "in a temporary folder", name, source_path, exc)
    source_path = Path(tempfile.mkdtemp(prefix="flashgen-")) / f"{name}.cu"
    files.atomic_write(source_path, source.encode())
    _write_headers(_headers_dir(source_path), headers)
    return source_path


def _write_headers(directory: Path, headers: Mapping[str, str]) -> None:
    files.make_dir(directory)
    files.check_dir(directory)
    for include_name, text in headers.items():
        folder = directory
        for part in Path(include_name).parent.parts:  # an include name may have folders
            folder = folder / part
            files.make_dir(folder)
            files.check_dir(folder)
        files.atomic_write(directory / include_name, text.encode())
