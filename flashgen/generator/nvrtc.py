"""Compiling CUDA C++ to a cubin with NVRTC (cuda.bindings.nvrtc).  Needs no GPU and no driver."""
from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from .. import config

try:
    from cuda.bindings import nvrtc as _nvrtc
except ImportError as exc:  # no cuda-bindings: say so at the first compile, not on import
    _nvrtc = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

logger = logging.getLogger("flashgen")

# The options every flashgen kernel is compiled with, besides the fixed ones compile_cubin adds.
# -lineinfo: source lines in profilers and compute-sanitizer, at no run-time cost.
# No --use_fast_math: the kernels use fast instructions explicitly where their error is known
# (ex2.approx in common.cuh); the flag would also flush denormals and loosen divisions elsewhere.
DEFAULT_OPTIONS: tuple[str, ...] = ("-lineinfo", "-DNDEBUG")

INSTALL_HEADERS_HINT = (
    "NVRTC needs the CUDA headers (cuda_fp16.h, cuda_bf16.h) and has no built-in search path: "
    "`pip install nvidia-cuda-runtime` (matching NVRTC's major version), or set CUDA_HOME to a "
    "CUDA toolkit"
)


INSTALL_NVRTC_HINT = (
    "flashgen compiles its kernels with NVRTC: `pip install nvidia-cuda-nvrtc cuda-bindings` "
    "(for CUDA 12: nvidia-cuda-nvrtc-cu12 and cuda-bindings 12.x), or put a CUDA toolkit's "
    "libnvrtc on the library path"
)


class NvrtcNotFoundError(RuntimeError):
    """NVRTC (libnvrtc or the cuda-bindings package) cannot be loaded."""

    def __init__(self, cause: Exception):
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


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor).  The first call into libnvrtc, so where a missing library shows:
    raises NvrtcNotFoundError saying what to install."""
    if _nvrtc is None:
        raise NvrtcNotFoundError(_IMPORT_ERROR) from _IMPORT_ERROR
    try:
        err, major, minor = _nvrtc.nvrtcVersion()
    # cuda.pathfinder raises its own error types (RuntimeError subclasses) when libnvrtc is absent.
    except (RuntimeError, OSError) as exc:
        raise NvrtcNotFoundError(exc) from exc
    _check(err, "nvrtcVersion")
    return major, minor


def cuda_include_dir() -> Path | None:
    """The first directory holding cuda_fp16.h: the pip wheels' nvidia/cu<N>/include (N = NVRTC's
    major version first, since its headers match that NVRTC), then $CUDA_HOME/include, then
    /usr/local/cuda/include."""
    candidates: list[Path] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels; may span several site dirs
    except ImportError:
        pass
    else:
        major = nvrtc_version()[0]
        subdirs = dict.fromkeys([f"cu{major}", "cu13", "cu12"])
        for root in nvidia.__path__:
            candidates.extend(Path(root) / sub / "include" for sub in subdirs)
            # The older nvidia-cuda-runtime-cu12 wheels use nvidia/cuda_runtime/include.
            candidates.append(Path(root) / "cuda_runtime" / "include")
    cuda_home = config.cuda_home()
    if cuda_home is not None:
        candidates.append(cuda_home / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)


def compile_cubin(
    source: str,
    name: str,
    arch: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    source_path: Path | None = None,
) -> bytes:
    """Compile ``source`` to a cubin for ``arch`` ("sm_80", "sm_90a").

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
        err, size = _nvrtc.nvrtcGetCUBINSize(program)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = _nvrtc.nvrtcGetCUBIN(program, cubin)
        _check(err, "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        # Warn rather than raise: a leaked program must not hide the result or the real error.
        (err,) = _nvrtc.nvrtcDestroyProgram(program)
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            logger.warning("nvrtcDestroyProgram failed for %s: %s", name, _error_string(err))


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
    failing compile can be rerun by hand with ``-I<source>.headers``."""
    if source_path is None:
        source_path = Path(tempfile.mkdtemp(prefix="flashgen-")) / f"{name}.cu"
        source_path.write_text(source)
    for include_name, text in headers.items():
        path = _headers_dir(source_path) / include_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return source_path
