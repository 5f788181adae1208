"""CPU tier: the runtime's errors say how to fix the machine, checked with a fake CUDA driver."""
from __future__ import annotations

import ctypes
import enum

import pytest
import torch
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
    CUDA_ERROR_INVALID_CONTEXT = 201
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
    # The whole extra: cuda-bindings 13 needs a CUDA 13 driver, so an NVRTC 12 wheel is not enough.
    assert message.endswith("cuda-bindings it supports: pip install 'flashgen[cu12]'")
    assert "nvidia-cuda-nvrtc" not in message
    assert "cache clear" not in message  # NVRTC's version is in the cache key


def test_driver_older_than_cuda_12_says_to_update_it(monkeypatch):
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 11080, (12, 9))
    assert str(info.value).endswith("update the NVIDIA driver (flashgen needs CUDA 12.0 or newer, R525+)")


@pytest.mark.parametrize(("driver_version", "nvrtc_version"), [(13000, (12, 9)), (13000, (13, 5)), (12040, (12, 9))])
def test_cubin_for_another_gpu_says_so(monkeypatch, driver_version, nvrtc_version):
    """Only majors are compared: a cubin of NVRTC 13.5 loads on a CUDA 13.0 driver."""
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, driver_version, nvrtc_version)
    message = str(info.value)
    assert "compiled by NVRTC {}.{} for sm_90a".format(*nvrtc_version) in message
    assert message.endswith("check that the GPU is a sm_90a device (FLASHGEN_FAMILY forces a family)")


def test_cubin_from_a_machine_without_nvrtc(monkeypatch):
    missing = nvrtc.NvrtcNotFoundError(RuntimeError("no libnvrtc"))
    with pytest.raises(launch.CudaError) as info:
        load(monkeypatch, CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 13000, missing)
    message = str(info.value)
    assert "NVRTC (unknown)" in message and "update the NVIDIA driver" in message
    assert message.endswith("pip install 'flashgen[cu13]'")


def test_other_load_errors_keep_the_plain_message(monkeypatch):
    expected = f"loading {SPEC.uri} failed: CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(launch.CudaError, match=expected):
        load(monkeypatch, CUresult.CUDA_ERROR_OUT_OF_MEMORY, 13000, (13, 0))
    assert load(monkeypatch, CUresult.CUDA_SUCCESS, 13000, (13, 0)).kernel == "kernel"


def test_doctor_reports_disable_jit(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 1, result.output  # it lists a fix: the cache is empty
    assert "FLASHGEN_DISABLE_JIT=1" in result.output
    assert "cache" in result.output and "`flashgen build`" in result.output


class LaunchDriver(FakeDriver):
    """Adds what the cuLaunchKernelEx paths touch; a config keeps copies of its attributes, as
    cuda.bindings' CUlaunchConfig does, and every launch is recorded."""

    class CUlaunchAttributeID(enum.Enum):
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1
        CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 2

    class CUlaunchAttribute:
        def __init__(self):
            import types
            self.id = None
            self.value = types.SimpleNamespace(programmaticStreamSerializationAllowed=0,
                                               clusterDim=types.SimpleNamespace(x=0, y=0, z=0))

    class CUlaunchConfig:
        def __init__(self):
            self._attrs = []

        @property
        def attrs(self):
            return self._attrs

        @attrs.setter
        def attrs(self, attributes):
            import copy
            self._attrs = [copy.deepcopy(a) for a in attributes]

    def __init__(self, launch_error: CUresult = CUresult.CUDA_SUCCESS):
        super().__init__(CUresult.CUDA_SUCCESS, 13000)
        self.launch_error = launch_error
        self.launches = []

    def cuLaunchKernelEx(self, config, kernel, args, extra):
        attrs = []
        for a in config.attrs[:config.numAttrs]:
            d = a.value.clusterDim
            attrs.append((a.id.name, a.value.programmaticStreamSerializationAllowed, (d.x, d.y, d.z)))
        self.launches.append(dict(grid=(config.gridDimX, config.gridDimY, config.gridDimZ),
                                  block=(config.blockDimX, config.blockDimY, config.blockDimZ),
                                  smem=config.sharedMemBytes, stream=config.hStream, attrs=attrs))
        return (self.launch_error,)


def test_launch_ex_paths_set_their_attribute_per_call(monkeypatch):
    driver = LaunchDriver()
    monkeypatch.setattr(launch, "_driver", driver)
    kernel = launch.LoadedKernel(SPEC, b"\x7fELF", smem_bytes=1000, num_threads=128)
    kernel.launch_cluster((1, 8, 16), 7, b"params", (1, 1, 8))
    kernel.launch_cluster((1, 8, 6), 9, b"params", (1, 1, 3))  # another split count: other dims
    kernel.launch_dependent((32, 1, 1), 7, b"params")
    kernel.launch_dependent((64, 1, 1), 7, b"params")
    kernel.launch_cluster((1, 8, 4), 7, b"params", (1, 1, 4), dependent=True)
    kernel.launch_cluster((1, 8, 2), 7, b"params", (1, 1, 2))  # the plain cluster config is its own
    cluster = ("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", 0)
    pdl = ("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION", 1, (0, 0, 0))
    assert [(x["grid"], x["stream"], x["attrs"]) for x in driver.launches] == [
        ((1, 8, 16), 7, [(*cluster, (1, 1, 8))]),
        ((1, 8, 6), 9, [(*cluster, (1, 1, 3))]),
        ((32, 1, 1), 7, [pdl]),
        ((64, 1, 1), 7, [pdl]),
        ((1, 8, 4), 7, [(*cluster, (1, 1, 4)), pdl]),
        ((1, 8, 2), 7, [(*cluster, (1, 1, 2))]),
    ]
    assert all(x["block"] == (128, 1, 1) and x["smem"] == 1000 for x in driver.launches)


def test_launch_ex_failure_names_the_kernel_and_grid(monkeypatch):
    monkeypatch.setattr(launch, "_driver", LaunchDriver(CUresult.CUDA_ERROR_OUT_OF_MEMORY))
    kernel = launch.LoadedKernel(SPEC, b"\x7fELF", smem_bytes=1000, num_threads=128)
    with pytest.raises(launch.CudaError, match=r"launching flash_fwd_sm80_hdim128_bf16_sm90a \(grid \(1, 8, 16\)"):
        kernel.launch_cluster((1, 8, 16), 7, b"params", (1, 1, 8))


class ContextDriver(LaunchDriver):
    """A thread with no context current (``current`` None): cuLaunchKernel fails as the driver does
    there, until a context is made current."""

    def __init__(self, launch_error: CUresult = CUresult.CUDA_SUCCESS):
        super().__init__(launch_error)
        self.current, self.retained = None, []

    def cuDeviceGet(self, index):
        return CUresult.CUDA_SUCCESS, f"device {index}"

    def cuDevicePrimaryCtxRetain(self, device):
        self.retained.append(device)
        return CUresult.CUDA_SUCCESS, f"primary context of {device}"

    def cuCtxSetCurrent(self, context):
        self.current = context
        return (CUresult.CUDA_SUCCESS,)

    def cuLaunchKernel(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        if self.current is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self.launch_error != CUresult.CUDA_SUCCESS:
            return (self.launch_error,)
        self.launches.append(dict(grid=(gx, gy, gz), stream=stream, context=self.current))
        return (CUresult.CUDA_SUCCESS,)


def test_a_threads_first_launch_binds_the_primary_context_and_retries(monkeypatch):
    from flashgen.runtime import execute

    driver = ContextDriver()
    monkeypatch.setattr(launch, "_driver", driver)
    monkeypatch.setattr(launch, "_primary_contexts", {})
    monkeypatch.setattr(execute, "stream_handle", lambda index: 7)
    kernel = launch.LoadedKernel(SPEC, b"\x7fELF", smem_bytes=1000, num_threads=128)
    for grid in ((3, 1, 1), (4, 1, 1)):
        execute._prepare_and_launch(kernel, kernel.launch, grid, b"params", 1)
    assert [(x["grid"], x["context"]) for x in driver.launches] == [
        ((3, 1, 1), "primary context of device 1"), ((4, 1, 1), "primary context of device 1")]
    assert driver.retained == ["device 1"]  # once per device
    driver.current = None  # another thread: bound again, from the retained context
    execute._prepare_and_launch(kernel, kernel.launch, (5, 1, 1), b"params", 1)
    assert driver.retained == ["device 1"] and driver.launches[-1]["grid"] == (5, 1, 1)


def test_other_launch_errors_are_not_retried(monkeypatch):
    from flashgen.runtime import execute

    driver = ContextDriver(CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    driver.current = "a context"
    monkeypatch.setattr(launch, "_driver", driver)
    monkeypatch.setattr(execute, "stream_handle", lambda index: 7)
    kernel = launch.LoadedKernel(SPEC, b"\x7fELF", smem_bytes=1000, num_threads=128)
    with pytest.raises(launch.CudaError, match="CUDA_ERROR_OUT_OF_MEMORY") as info:
        execute._prepare_and_launch(kernel, kernel.launch, (3, 1, 1), b"params", 0)
    assert not isinstance(info.value, launch.ContextNotCurrent) and driver.retained == []


class TensorMapDriver(ContextDriver):
    """cuTensorMapEncodeTiled as the driver has it on a thread with no context current."""

    class CUtensorMapDataType(enum.IntEnum):
        CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
        CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7
        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9

    CUtensorMapInterleave = enum.IntEnum("CUtensorMapInterleave", {"CU_TENSOR_MAP_INTERLEAVE_NONE": 0})
    CUtensorMapSwizzle = enum.IntEnum("CUtensorMapSwizzle", {"CU_TENSOR_MAP_SWIZZLE_128B": 3})
    CUtensorMapL2promotion = enum.IntEnum("CUtensorMapL2promotion", {"CU_TENSOR_MAP_L2_PROMOTION_L2_256B": 3})
    CUtensorMapFloatOOBfill = enum.IntEnum("CUtensorMapFloatOOBfill", {"CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE": 0})
    cuuint64_t = cuuint32_t = int

    def __init__(self):
        super().__init__()
        self.encoded = []

    def cuTensorMapEncodeTiled(self, dtype, rank, address, *rest):
        if self.current is None:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        self.encoded.append((dtype, rank, self.current))
        return CUresult.CUDA_SUCCESS, self.TensorMap()

    class TensorMap:
        """A CUtensorMap: its 128 bytes behind getPtr."""

        def __init__(self):
            self.storage = ctypes.create_string_buffer(b"\x01" * 128, 128)

        def getPtr(self):
            return ctypes.addressof(self.storage)


def test_a_tensor_map_on_a_thread_without_a_context_binds_the_primary_context(monkeypatch):
    """The autograd engine's thread may encode the backward's tensor maps before anything there
    made a context current: the encode binds PyTorch's context and retries, as a launch does."""
    from flashgen.runtime import tma

    driver = TensorMapDriver()
    monkeypatch.setattr(launch, "_driver", driver)
    monkeypatch.setattr(launch, "_primary_contexts", {})
    bound = []
    monkeypatch.setattr(tma, "bind_primary_context", lambda index: bound.append(index) or driver.cuCtxSetCurrent("ctx"))
    q = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16)
    assert tma._encode(q, 64) == b"\x01" * 128
    assert bound == [q.device.index] and driver.encoded == [(driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, "ctx")]
    assert tma._encode(q, 64) == b"\x01" * 128 and len(bound) == 1  # bound once: the thread keeps it


def test_other_tensor_map_errors_are_not_retried(monkeypatch):
    from flashgen.runtime import tma

    class Refusing(TensorMapDriver):
        def cuTensorMapEncodeTiled(self, *args):
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None

    monkeypatch.setattr(launch, "_driver", Refusing())
    monkeypatch.setattr(tma, "bind_primary_context", lambda index: pytest.fail("bound a context"))
    with pytest.raises(launch.CudaError, match="cuTensorMapEncodeTiled failed .* CUDA_ERROR_OUT_OF_MEMORY"):
        tma._encode(torch.empty(2, 64, 4, 128, dtype=torch.bfloat16), 64)
