"""CPU tier: NVRTC compiles to cubins without a GPU, and reports failures usefully."""
from __future__ import annotations

import tempfile

import pytest

from flashgen.generator import nvrtc

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
    (tmp_path / "toolkit" / "include").mkdir(parents=True)
    (tmp_path / "toolkit" / "include" / "cuda_fp16.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert nvrtc.cuda_include_dir() == tmp_path / "toolkit" / "include"


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
