"""CPU tier: the runtime's errors say how to fix the machine, checked with a fake CUDA driver."""
from __future__ import annotations

import enum

import pytest
from click.testing import CliRunner

from flashgen.cli import cli
from flashgen.generator import nvrtc
from flashgen.generator.spec import KernelSpec
from flashgen.runtime import launch

SPEC = KernelSpec("fwd", "sm80", "sm_90a", "bf16", 128)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222


class FakeDriver:
    """The parts of cuda.bindings.driver that loading a library touches."""

    CUresult = CUresult

    def __init__(self, load_error: CUresult, driver_version: int):
        self.load_error = load_error
        self.driver_version = driver_version  # encoded like cuDriverGetVersion: 12080 is 12.8

    def cuLibraryLoadData(self, *args):
        return self.load_error, "library"

    def cuLibraryGetKernel(self, library, name):
        return CUresult.CUDA_SUCCESS, "kernel"

    def cuDriverGetVersion(self):
        return CUresult.CUDA_SUCCESS, self.driver_version

    def cuGetErrorName(self, err):
        return CUresult.CUDA_SUCCESS, err.name.encode()

    def cuGetErrorString(self, err):
        return CUresult.CUDA_SUCCESS, b"explained"


def load(monkeypatch, load_error: CUresult, driver_version: int, nvrtc_version):
    monkeypatch.setattr(launch, "_driver", FakeDriver(load_error, driver_version))
    if isinstance(nvrtc_version, Exception):
        def missing():
            raise nvrtc_version
        monkeypatch.setattr(nvrtc, "nvrtc_version", missing)
    else:
        monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: nvrtc_version)
    return launch.LoadedKernel(SPEC, b"\x7fELF", smem_bytes=0, num_threads=128)


@pytest.mark.parametrize("error", ["UNSUPPORTED_PTX_VERSION", "INVALID_IMAGE", "NO_BINARY_FOR_GPU"])
def test_driver_older_than_nvrtc_says_how_to_fix(monkeypatch, error):
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult[f"CUDA_ERROR_{error}"], 12080, (13, 1))
    message = str(info.value)
    assert SPEC.uri in message and f"CUDA_ERROR_{error}" in message
    assert "compiled by NVRTC 13.1 for sm_90a" in message and "driver supports CUDA 12.8" in message
    assert "update the NVIDIA driver" in message
    assert "pip install 'nvidia-cuda-nvrtc-cu12==12.8.*'" in message
    assert "flashgen cache clear" in message


def test_cubin_for_another_gpu_says_so(monkeypatch):
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, 13000, (12, 9))
    message = str(info.value)
    assert "compiled by NVRTC 12.9 for sm_90a" in message and "driver supports CUDA 13.0" in message
    assert "sm_90a device" in message and "flashgen cache clear" in message


def test_cubin_from_a_machine_without_nvrtc(monkeypatch):
    missing = nvrtc.NvrtcNotFoundError(RuntimeError("no libnvrtc"))
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 13000, missing)
    message = str(info.value)
    assert "NVRTC (unknown)" in message and "pip install 'nvidia-cuda-nvrtc==13.0.*'" in message


def test_other_load_errors_keep_the_plain_message(monkeypatch):
    expected = f"loading {SPEC.uri} failed: CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(launch.CudaError, match=expected):
        load(monkeypatch, CUresult.CUDA_ERROR_OUT_OF_MEMORY, 13000, (13, 0))
    assert load(monkeypatch, CUresult.CUDA_SUCCESS, 13000, (13, 0)).kernel == "kernel"


def test_doctor_reports_disable_jit(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "FLASHGEN_DISABLE_JIT=1" in result.output
    assert "cache" in result.output and "`flashgen build`" in result.output
