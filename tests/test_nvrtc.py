"""CPU tier: NVRTC compiles to cubins without a GPU, and reports failures usefully."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flashgen import config
from flashgen.generator import nvrtc

REPO_ROOT = Path(__file__).resolve().parents[1]

# Uses both a CUDA header (found through the include dir) and an in-memory header.
TINY_KERNEL = """
#include <cuda_bf16.h>
#include "scale.cuh"
extern "C" __global__ void tiny(__nv_bfloat16* x) {
    x[threadIdx.x] = __float2bfloat16(__bfloat162float(x[threadIdx.x]) * kScale);
}
"""
HEADERS = {"scale.cuh": "#pragma once\nconstexpr float kScale = 2.0f;\n"}
ELF_MAGIC = b"\x7fELF"


@pytest.fixture(autouse=True)
def temp_dir_in_tmp_path(monkeypatch, tmp_path):
    """A failed compile without a cache entry saves its source under tempfile's dir: keep it here."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_nvrtc_version():
    major, minor = nvrtc.nvrtc_version()
    assert (major, minor) >= (12, 0)


def test_cuda_include_dir_has_the_fp16_headers():
    include_dir = nvrtc.cuda_include_dir()
    assert include_dir is not None
    assert (include_dir / "cuda_fp16.h").is_file() and (include_dir / "cuda_bf16.h").is_file()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiles_a_cubin(arch):
    cubin = nvrtc.compile_cubin(TINY_KERNEL, "tiny", arch, HEADERS, nvrtc.DEFAULT_OPTIONS)
    assert cubin.startswith(ELF_MAGIC)
    assert b"tiny" in cubin  # the extern "C" symbol, unmangled


def test_compile_with_log_returns_the_cubin_and_nvrtc_log():
    cubin, log = nvrtc.compile_with_log(TINY_KERNEL, "tiny", "sm_90a", HEADERS, [*nvrtc.DEFAULT_OPTIONS, "-Xptxas=-v"])
    assert cubin.startswith(ELF_MAGIC)
    assert "tiny" in log and "registers" in log  # ptxas's -v lines are in NVRTC's log
    assert nvrtc.performance_losses(log) == ()


def test_performance_losses_are_the_lines_that_say_so():
    loss = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to insufficient register resources for the function 'k'")
    log = f"ptxas info    : Used 168 registers\n{loss}\nptxas info    : 72 bytes stack frame\n"
    assert nvrtc.performance_losses(log) == (loss,)
    assert nvrtc.performance_losses("") == ()


def test_compile_phases_reports_where_the_time_went():
    """NVRTC 13's --time report, parsed: the front end, the optimizer and ptxas, each in ms."""
    phases = nvrtc.compile_phases(TINY_KERNEL, "tiny", "sm_90a", HEADERS, nvrtc.DEFAULT_OPTIONS)
    if nvrtc.nvrtc_version()[0] < 13:
        pytest.skip("phase timings checked with NVRTC 13")
    assert {"CUDA C++ Frontend", "NVVM Optimizer", "PTX Translation"} <= set(phases)
    assert all(ms >= 0 for ms in phases.values()) and sum(phases.values()) > 0


def test_syntax_error_raises_compile_error_with_a_reproducible_source(tmp_path):
    source = TINY_KERNEL.replace("kScale);", "kScale)")  # missing semicolon
    assert source != TINY_KERNEL
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cubin(source, "flash_broken", "sm_80", HEADERS, ["-DFOO=1"])
    error = info.value
    assert error.uri == "flash_broken"
    assert "error" in error.log
    assert error.source_path.is_relative_to(tmp_path)
    assert error.source_path.read_text() == source
    assert (error.source_path.with_suffix(".headers") / "scale.cuh").read_text() == HEADERS["scale.cuh"]
    assert "--gpu-architecture=sm_80" in error.options and "-DFOO=1" in error.options
    message = str(error)
    assert "flash_broken" in message and str(error.source_path) in message
    assert "-DFOO=1" in message and error.log.strip().splitlines()[0] in message


def test_compile_error_uses_the_given_source_path(tmp_path):
    saved = tmp_path / "entry.cu"
    saved.write_text("not C++")
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cubin("not C++", "bad", "sm_80", {}, [], source_path=saved)
    assert info.value.source_path == saved


def test_headers_beside_a_given_source_are_shareable_and_follow_no_link(tmp_path):
    """A cache entry's headers: folder 0755, files 0644 whatever the umask; a planted link at a
    header is replaced, its target left alone."""
    saved = tmp_path / "entry.cu"
    saved.write_text("not C++")
    headers_dir = saved.with_suffix(".headers")
    headers_dir.mkdir()
    target = tmp_path / "victim"
    target.write_text("keep me")
    (headers_dir / "scale.cuh").symlink_to(target)
    old_umask = os.umask(0o077)
    try:
        with pytest.raises(nvrtc.CompileError) as info:
            nvrtc.compile_cubin("not C++", "bad", "sm_80", {**HEADERS, "sub/extra.cuh": "// x\n"}, [],
                                source_path=saved)
    finally:
        os.umask(old_umask)
    assert info.value.source_path == saved
    assert target.read_text() == "keep me"
    written = headers_dir / "scale.cuh"
    assert not written.is_symlink() and written.read_text() == HEADERS["scale.cuh"]
    assert (headers_dir / "sub" / "extra.cuh").read_text() == "// x\n"
    for path, mode in ((written, 0o644), (headers_dir / "sub" / "extra.cuh", 0o644), (headers_dir / "sub", 0o755)):
        assert path.stat().st_mode & 0o777 == mode, path
    assert not [p for p in headers_dir.rglob("*.tmp")]


def test_a_linked_headers_folder_is_not_written_through(tmp_path):
    """<source>.headers planted as a link to another folder: the source and headers go to a fresh
    private temporary folder instead, which the error names."""
    saved = tmp_path / "entry.cu"
    saved.write_text("not C++")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved.with_suffix(".headers").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cubin("not C++", "bad", "sm_80", HEADERS, [], source_path=saved)
    assert list(elsewhere.iterdir()) == []
    moved = info.value.source_path
    assert moved != saved and moved.read_text() == "not C++"
    assert moved.parent.stat().st_mode & 0o777 == 0o700  # mkdtemp's: only this user
    assert (moved.with_suffix(".headers") / "scale.cuh").read_text() == HEADERS["scale.cuh"]
    assert str(moved) in str(info.value)


def test_invalid_option_is_a_compile_error():
    with pytest.raises(nvrtc.CompileError, match="--no-such-option"):
        nvrtc.compile_cubin(TINY_KERNEL, "tiny", "sm_80", HEADERS, ["--no-such-option"])


def test_missing_cuda_headers_say_what_to_install(monkeypatch):
    monkeypatch.setattr(nvrtc, "cuda_include_dir", lambda: None)
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-runtime"):
        nvrtc.compile_cubin(TINY_KERNEL, "tiny", "sm_80", HEADERS, [])


def test_include_dir_search_falls_back_to_cuda_home(monkeypatch, tmp_path):
    """Without the wheel's headers, CUDA_HOME/include is used."""
    import nvidia

    monkeypatch.setattr(nvidia, "__path__", [str(tmp_path / "no-wheels")])
    include = tmp_path / "toolkit" / "include"
    include.mkdir(parents=True)
    (include / "cuda_fp16.h").write_text("")
    version = 1000 * nvrtc.nvrtc_version()[0]  # a toolkit of NVRTC's major version
    (include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert nvrtc.cuda_include_dir() == include


@pytest.fixture
def fresh_version_memo():
    """nvrtc_version is memoized per process: forget a fake NVRTC's answer, before and after."""
    nvrtc.nvrtc_version.cache_clear()
    yield
    nvrtc.nvrtc_version.cache_clear()


class MissingLibNvrtc:
    """cuda.bindings.nvrtc when libnvrtc is absent: importing works, the first call raises."""

    def __getattr__(self, name):
        def call(*args):
            raise RuntimeError("Failure finding libnvrtc.so")

        return call


@pytest.mark.parametrize("how", ["first-call", "import"])
def test_missing_nvrtc_says_what_to_install(monkeypatch, fresh_version_memo, how):
    if how == "first-call":
        monkeypatch.setattr(nvrtc, "_nvrtc", MissingLibNvrtc())
    else:
        monkeypatch.setattr(nvrtc, "_nvrtc", None)
        monkeypatch.setattr(nvrtc, "_IMPORT_ERROR", ImportError("No module named 'cuda.bindings'"))
    def compile_tiny():
        return nvrtc.compile_cubin(TINY_KERNEL, "tiny", "sm_80", HEADERS, [])

    for attempt in (nvrtc.nvrtc_version, compile_tiny):
        with pytest.raises(nvrtc.NvrtcNotFoundError, match="pip install nvidia-cuda-nvrtc") as info:
            attempt()
        assert isinstance(info.value, RuntimeError)
        assert ("libnvrtc" if how == "first-call" else "cuda.bindings") in str(info.value)


# --- Which NVRTC: CUDA 13's by default, CUDA 12's on a CUDA 12 driver when `flashgen[cu12]` is in.


@pytest.mark.parametrize(
    ("installed", "driver_major", "bindings_major", "requested", "expected"),
    [
        ({13}, 13, 13, None, 13),
        ({12, 13}, 12, 12, None, 12),    # flashgen[cu12] on a CUDA 12 driver
        ({12, 13}, 13, 12, None, 12),    # ... on a CUDA 13 driver: the pair cuda-bindings 12 supports
        ({12, 13}, None, 12, None, 12),  # ... without a driver
        ({12, 13}, 13, 13, None, 13),    # NVRTC 12 added by hand beside cuda-bindings 13
        ({12, 13}, None, 13, None, 13),  # ... without a driver (CI building cubins): as before
        ({12, 13}, 12, 13, None, 12),    # ... on a CUDA 12 driver, which cannot load 13's cubins
        ({12, 13}, 13, None, None, 13),  # cuda-bindings' version unknown: the newest
        ({12}, 13, 13, None, 12),        # a newer driver loads older cubins
        ({13}, 12, 12, None, 13),        # nothing old enough: the load error says what to install
        ({12, 13}, 14, 14, None, 13),
        ({12, 13}, 12, 12, 13, 13),      # FLASHGEN_NVRTC wins
        ((), 12, 12, 12, 12),            # ... also without a wheel (a toolkit's libnvrtc)
        ((), 13, 13, None, None),        # no wheels: cuda.bindings' own search
    ],
)
def test_choose_nvrtc_major(installed, driver_major, bindings_major, requested, expected):
    assert nvrtc.choose_nvrtc_major(installed, driver_major, bindings_major, requested) == expected


def _fake_wheels(root, cuda13: int | None = 13050, cuda12: int | None = 12090):
    """An nvidia/ namespace folder laid out as nvidia-cuda-nvrtc / -runtime (cu13/) and their -cu12
    wheels (cuda_nvrtc/, cuda_runtime/) lay theirs out."""
    for lib, include, version in (
        ("cu13/lib", "cu13/include", cuda13),
        ("cuda_nvrtc/lib", "cuda_runtime/include", cuda12),
    ):
        if version is None:
            continue
        major = version // 1000
        (root / lib).mkdir(parents=True)
        for name in (f"libnvrtc.so.{major}", f"libnvrtc.alt.so.{major}",
                     f"libnvrtc-builtins.so.{major}.{version // 10 % 100}"):
            (root / lib / name).write_bytes(b"")
        (root / include).mkdir(parents=True)
        (root / include / "cuda_fp16.h").write_text("")
        (root / include / "cuda_runtime_api.h").write_text(
            f"#if !defined(CUDART_VERSION)\n#define CUDART_VERSION  {version}\n#endif\n"
        )
    return root


def test_nvrtc_libraries_finds_each_major_of_the_wheels(monkeypatch, tmp_path):
    import nvidia

    root = _fake_wheels(tmp_path / "nvidia")
    monkeypatch.setattr(nvidia, "__path__", [str(root)])
    assert nvrtc.nvrtc_libraries() == {
        13: root / "cu13" / "lib" / "libnvrtc.so.13",
        12: root / "cuda_nvrtc" / "lib" / "libnvrtc.so.12",
    }


@pytest.mark.parametrize(("nvrtc_major", "expected"), [(13, "cu13"), (12, "cuda_runtime")])
def test_include_dir_matches_nvrtc_major_version(monkeypatch, tmp_path, nvrtc_major, expected):
    """Both header wheels installed (flashgen[cu12]): NVRTC 12 compiles with CUDA 12's headers."""
    import nvidia

    root = _fake_wheels(tmp_path / "nvidia")
    monkeypatch.setattr(nvidia, "__path__", [str(root)])
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (nvrtc_major, 0))
    assert nvrtc.cuda_include_dir() == root / expected / "include"
    assert nvrtc.cuda_headers_major(root / expected / "include") == nvrtc_major
    # Those of a given major without loading NVRTC (the cache key of a prebuilt cache's entries).
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: pytest.fail("NVRTC loaded"))
    assert nvrtc.cuda_include_dir(nvrtc_major) == root / expected / "include"


def test_include_dir_of_another_major_is_the_last_resort(monkeypatch, tmp_path):
    import nvidia

    root = _fake_wheels(tmp_path / "nvidia", cuda12=None)
    monkeypatch.setattr(nvidia, "__path__", [str(root)])
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (12, 9))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert nvrtc.cuda_include_dir() in (root / "cu13" / "include", Path("/usr/local/cuda/include"))


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("12", 12), (" 13 ", 13)])
def test_flashgen_nvrtc_knob(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FLASHGEN_NVRTC", raising=False)
    else:
        monkeypatch.setenv("FLASHGEN_NVRTC", value)
    assert config.nvrtc_major() == expected


@pytest.mark.parametrize("value", ["cu12", "12.8", "twelve"])
def test_flashgen_nvrtc_knob_rejects_what_is_not_a_major_version(monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_NVRTC", value)
    with pytest.raises(ValueError, match="FLASHGEN_NVRTC"):
        config.nvrtc_major()


def test_one_installed_nvrtc_is_left_to_cuda_bindings(monkeypatch):
    """Nothing to choose: no driver query and no load of our own (cuda.bindings' search, as before)."""
    monkeypatch.delenv("FLASHGEN_NVRTC", raising=False)
    monkeypatch.setattr(nvrtc, "nvrtc_libraries", lambda: {13: Path("/nonexistent/libnvrtc.so.13")})
    monkeypatch.setattr(nvrtc, "driver_cuda_version", lambda: pytest.fail("driver queried"))
    assert nvrtc._load_chosen_nvrtc() is None


def test_requested_nvrtc_that_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVRTC", "99")
    with pytest.raises(nvrtc.NvrtcNotFoundError, match=r"libnvrtc\.so\.99.*flashgen\[cu12\]"):
        nvrtc._load_chosen_nvrtc()


def test_driver_cuda_version_without_a_driver_is_none(monkeypatch):
    from cuda.bindings import driver

    def no_libcuda():
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setattr(driver, "cuDriverGetVersion", no_libcuda)
    assert nvrtc.driver_cuda_version() is None
    monkeypatch.setattr(driver, "cuDriverGetVersion", lambda: (driver.CUresult.CUDA_SUCCESS, 12040))
    assert nvrtc.driver_cuda_version() == (12, 4)


# Loading an NVRTC is once per process: these run in a subprocess, where both majors are installed.
CHOSEN_NVRTC_COMPILES = """
import sys
from flashgen import config
from flashgen.generator import nvrtc
driver = None if sys.argv[1] == "none" else int(sys.argv[1])
nvrtc.driver_cuda_version = lambda: None if driver is None else (driver, 0)
chosen = nvrtc.choose_nvrtc_major({12, 13}, driver, nvrtc.bindings_major(), config.nvrtc_major())
major = nvrtc.nvrtc_version()[0]
assert major == chosen, (major, chosen)
assert nvrtc.cuda_headers_major(nvrtc.cuda_include_dir()) == major, nvrtc.cuda_include_dir()
for arch in ("sm_80", "sm_90a"):
    assert nvrtc.compile_cubin(sys.argv[2], "tiny", arch, {"scale.cuh": sys.argv[3]}, []).startswith(b"\\x7fELF")
print(major)
"""


def _bindings_version() -> tuple[int, ...]:
    from cuda.bindings import __version__

    return tuple(int(part) for part in __version__.split(".")[:3] if part.isdigit())


@pytest.mark.skipif(
    not {12, 13} <= set(nvrtc.nvrtc_libraries()),
    reason="needs the NVRTC 12 and 13 wheels side by side (pip install -e '.[cu12]')",
)
@pytest.mark.parametrize(
    ("driver_major", "requested"),
    [("12", ""), ("13", ""), ("none", ""), ("none", "12"), ("none", "13")],
)
def test_chosen_nvrtc_is_loaded_and_compiles(driver_major, requested):
    """The chosen NVRTC is the one cuda.bindings calls, with headers of its major version."""
    if requested and int(requested) != _bindings_version()[0] and (12,) < _bindings_version() < (12, 9, 10):
        pytest.skip("cuda-bindings 12.8.0 and 12.9.0 always open libnvrtc.so.12 (12.9.10 takes ours)")
    env = {**os.environ, "FLASHGEN_NVRTC": requested,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", CHOSEN_NVRTC_COMPILES, driver_major, TINY_KERNEL, HEADERS["scale.cuh"]],
        env=env, capture_output=True, text=True, check=False, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() in (["12"], ["13"])
