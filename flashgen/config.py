"""The one place flashgen reads environment variables.

Each knob is a function, read at call time, so tests can monkeypatch the environment and a long
process sees a change without re-importing.  A knob that changes the compiled binary
(``FLASHGEN_NVRTC_EXTRA_OPTIONS``) reaches the cache key through the options list.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from .generator.spec import FAMILIES

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env(name: str) -> str | None:
    """The variable's value, or None when unset or empty (an empty value means 'use the default')."""
    value = os.environ.get(name, "").strip()
    return value or None


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}, got {value!r}")


def cache_dir() -> Path:
    """Where compiled cubins live: FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen, else
    ~/.cache/flashgen.  Not created here."""
    explicit = _env("FLASHGEN_CACHE_DIR")
    if explicit is not None:
        return Path(explicit).expanduser()
    xdg = _env("XDG_CACHE_HOME")
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    if xdg is not None and Path(xdg).is_absolute():
        return Path(xdg) / "flashgen"
    return Path.home() / ".cache" / "flashgen"


def disable_jit() -> bool:
    """FLASHGEN_DISABLE_JIT (default off): never compile at run time; a kernel missing from the
    cache is an error naming the `flashgen build` command that makes it.  For deployments that
    prebuild their kernels (and may keep the cache read-only)."""
    return _env_bool("FLASHGEN_DISABLE_JIT", default=False)


def cuda_home() -> Path | None:
    """CUDA_HOME (or CUDA_PATH, the Windows installer's name): a toolkit whose include/ may hold
    the CUDA headers NVRTC needs."""
    value = _env("CUDA_HOME") or _env("CUDA_PATH")
    return Path(value).expanduser() if value is not None else None


def forced_family() -> str | None:
    """FLASHGEN_FAMILY (testing and comparison): sm80 runs every kernel in the sm80 family, also on
    Hopper; sm90 asks for the sm90 forward and backward where they have an instance (the default on
    sm_90a), the sm80 family elsewhere. Unset: the choice made for the device and the call."""
    family = _env("FLASHGEN_FAMILY")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"FLASHGEN_FAMILY must be one of {FAMILIES}, got {family!r}")
    return family


def check_inputs() -> bool:
    """FLASHGEN_CHECK_INPUTS (default off): value-dependent input checks that read device memory
    (cache_seqlens, block tables, cu_seqlens) and so synchronize. Shape, dtype and device checks
    always run."""
    return _env_bool("FLASHGEN_CHECK_INPUTS", default=False)


def nvrtc_extra_options() -> list[str]:
    """FLASHGEN_NVRTC_EXTRA_OPTIONS, split like a shell command line: extra NVRTC flags appended to
    the defaults, e.g. "-G" to debug under compute-sanitizer or "--ptxas-options=-v" to see register
    use.  They change the binary, so they are part of the cache key."""
    value = _env("FLASHGEN_NVRTC_EXTRA_OPTIONS")
    return shlex.split(value) if value is not None else []


def nvrtc_major() -> int | None:
    """FLASHGEN_NVRTC: the major version of the NVRTC to compile with ("12" or "13"), when several
    are installed (`pip install 'flashgen[cu12]'` keeps CUDA 13's too).  Unset: one the driver can
    load cubins of, that of cuda-bindings' major version first (nvrtc.choose_nvrtc_major).  NVRTC's
    version is part of the cache key."""
    value = _env("FLASHGEN_NVRTC")
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"FLASHGEN_NVRTC must be an NVRTC major version such as 12 or 13, got {value!r}")
    return int(value)
