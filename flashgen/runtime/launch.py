"""Loading cubins and launching kernels through the CUDA driver API.

A kernel is loaded once per process as a context-independent CUlibrary/CUkernel, and launched on
the caller's stream with its Params struct packed into one buffer. The per-call path is a dict
lookup, one ``struct.pack_into`` and one ``cuLaunchKernel``: no rendering, hashing or file access.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable

from ..generator import matrix
from ..generator.spec import KernelSpec

_driver = None
_init_lock = threading.Lock()


class CudaError(RuntimeError):
    pass


class ContextNotCurrent(CudaError):
    """A launch from a thread with no CUDA context current: one where nothing has called the CUDA
    runtime yet (the autograd engine's device thread, a user's thread), since PyTorch makes its
    context current only on a device switch or its own first launch there."""


_primary_contexts: dict[int, object] = {}


def bind_primary_context(device_index: int) -> None:
    """Make the device's primary context (PyTorch's) current on the calling thread."""
    context = _primary_contexts.get(device_index)
    if context is None:
        device = check(_driver.cuDeviceGet(device_index), "cuDeviceGet")
        context = check(_driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        _primary_contexts[device_index] = context
    check(_driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


# cuLibraryLoadData errors meaning "this driver or GPU cannot run this cubin": most often NVRTC is
# newer than the driver, or the cubin was built for another architecture.
_INCOMPATIBLE_IMAGE_ERRORS = (
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    "CUDA_ERROR_NO_BINARY_FOR_GPU",
    "CUDA_ERROR_INVALID_IMAGE",
    "CUDA_ERROR_INVALID_PTX",
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
)


def _import_driver():
    """cuda.bindings.driver, initialized once; a clear error when no NVIDIA driver is installed."""
    global _driver
    if _driver is not None:
        return _driver
    with _init_lock:
        if _driver is None:
            from cuda.bindings import driver

            try:
                (err,) = driver.cuInit(0)
            except Exception as exc:  # cuda.pathfinder raises when libcuda.so is missing
                raise CudaError(
                    "no NVIDIA driver found (libcuda.so could not be loaded): flashgen kernels need "
                    f"an NVIDIA GPU with its driver installed ({type(exc).__name__}: {exc})"
                ) from exc
            if err != driver.CUresult.CUDA_SUCCESS:
                raise CudaError(f"cuInit failed: {_error_text(driver, err)}")
            _driver = driver
    return _driver


def _error_text(driver, err) -> str:
    _, name = driver.cuGetErrorName(err)
    _, text = driver.cuGetErrorString(err)
    name = name.decode() if isinstance(name, bytes) else str(name)
    text = text.decode() if isinstance(text, bytes) else str(text)
    return f"{name} ({text})"


def _is_incompatible_image(driver, err) -> bool:
    return any(err == getattr(driver.CUresult, name, None) for name in _INCOMPATIBLE_IMAGE_ERRORS)


def _version_text(version: tuple[int, int] | None) -> str:
    return "{}.{}".format(*version) if version is not None else "(unknown)"


def _incompatible_cubin_message(driver, spec: KernelSpec, err) -> str:
    """Why the driver refused a cubin and how to fix it: the NVRTC that built it, its arch and the
    CUDA version the driver supports."""
    from ..generator import nvrtc

    try:
        nvrtc_version: tuple[int, int] | None = nvrtc.nvrtc_version()
    except Exception:  # the cubin may come from a prebuilt cache on a machine without NVRTC
        nvrtc_version = None
    driver_err, encoded = driver.cuDriverGetVersion()
    driver_version = (
        (encoded // 1000, encoded % 1000 // 10)
        if driver_err == driver.CUresult.CUDA_SUCCESS else None
    )
    built = (
        f"the cubin was compiled by NVRTC {_version_text(nvrtc_version)} for {spec.arch}; "
        f"the driver supports CUDA {_version_text(driver_version)}"
    )
    # Only majors count: minor-version compatibility loads a cubin of NVRTC 13.5 on a CUDA 13.0
    # driver.  No `flashgen cache clear`: NVRTC's version is in the cache key, so another NVRTC
    # compiles entries of its own.
    if nvrtc_version is not None and driver_version is not None and nvrtc_version[0] <= driver_version[0]:
        cause = f"check that the GPU is a {spec.arch} device (FLASHGEN_FAMILY forces a family)"
    else:
        cause = ("a driver cannot load the cubins of an NVRTC of a newer CUDA major version: update "
                 "the NVIDIA driver")
        install = None if driver_version is None else nvrtc.install_for_driver(driver_version[0])
        if install is not None:
            cause += f", or compile with the NVRTC, headers and cuda-bindings it supports: {install}"
        elif driver_version is not None:
            cause += " (flashgen needs CUDA 12.0 or newer, R525+)"
    return f"loading {spec.uri} failed: {_error_text(driver, err)}; {built}. To fix: {cause}"


def check(result, what: str):
    """Raise CudaError unless a cuda.bindings call succeeded; return its values."""
    driver = _driver
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_error_text(driver, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class LoadedKernel:
    """One kernel instance in this process: its CUkernel, and the devices it was set up for."""

    __slots__ = ("spec", "library", "kernel", "smem_bytes", "num_threads", "_devices", "_dependent_config",
                 "_cluster_config", "_dependent_cluster_config")

    def __init__(self, spec: KernelSpec, cubin: bytes, smem_bytes: int, num_threads: int):
        driver = _import_driver()
        self.spec = spec
        self.smem_bytes = smem_bytes
        self.num_threads = num_threads
        result = driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0)
        if _is_incompatible_image(driver, result[0]):
            raise CudaError(_incompatible_cubin_message(driver, spec, result[0]))
        self.library = check(result, f"loading {spec.uri}")
        self.kernel = check(
            driver.cuLibraryGetKernel(self.library, spec.kernel_name.encode()),
            f"finding kernel {spec.kernel_name}",
        )
        self._devices: set[int] = set()
        # launch_dependent's and launch_cluster's CUlaunchConfig, one per thread (_config).
        self._dependent_config = threading.local()
        self._cluster_config = threading.local()
        self._dependent_cluster_config = threading.local()

    def prepare(self, device_index: int) -> None:
        """Raise the dynamic shared-memory limit on a device (once per device)."""
        if device_index in self._devices:
            return
        driver = _driver
        device = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        if self.smem_bytes > 48 * 1024:
            check(
                driver.cuKernelSetAttribute(
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self.smem_bytes,
                    self.kernel,
                    device,
                ),
                f"raising the shared-memory limit of {self.spec.uri} to {self.smem_bytes} bytes",
            )
        self._devices.add(device_index)

    def launch(self, grid: tuple[int, int, int], stream_handle: int, params: bytes) -> None:
        """Enqueue on a stream. ``params`` is the packed Params struct (the kernel's one argument)."""
        driver = _driver
        buffer = ctypes.create_string_buffer(params, len(params))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        result = driver.cuLaunchKernel(
            self.kernel, grid[0], grid[1], grid[2], self.num_threads, 1, 1,
            self.smem_bytes, stream_handle, ctypes.addressof(argv), 0,
        )
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            self._launch_failed(grid, result[0])

    def launch_dependent(self, grid: tuple[int, int, int], stream_handle: int, params: bytes) -> None:
        """Enqueue as a programmatic dependent launch (sm_90+): the grid may be scheduled while
        the previous kernel on the stream still runs, once all that kernel's CTAs have executed
        griddepcontrol.launch_dependents, and its own griddepcontrol.wait then waits for the
        previous kernel's completion and memory. It hides the launch latency of a short kernel
        that consumes the previous one's output (the split-KV combine). The kernel must execute
        griddepcontrol.wait before reading what the previous kernel wrote."""
        config, _ = self._config(self._dependent_config, _allow_programmatic_serialization)
        self._launch_ex(config, grid, stream_handle, params)

    def launch_cluster(self, grid: tuple[int, int, int], stream_handle: int, params: bytes,
                       cluster: tuple[int, int, int], dependent: bool = False) -> None:
        """Enqueue with thread-block clusters of ``cluster`` CTAs (sm_90+; the grid divisible by it);
        ``dependent``: also as a programmatic dependent launch (launch_dependent)."""
        if dependent:
            config, attributes = self._config(self._dependent_cluster_config, _cluster_dimension,
                                              _allow_programmatic_serialization)
        else:
            config, attributes = self._config(self._cluster_config, _cluster_dimension)
        attributes[0].value.clusterDim.x, attributes[0].value.clusterDim.y, attributes[0].value.clusterDim.z = cluster
        config.attrs = attributes  # the config keeps a copy of its attributes: set them again
        self._launch_ex(config, grid, stream_handle, params)

    def _config(self, local: threading.local, *init_attributes: Callable):
        """This thread's CUlaunchConfig in ``local`` and its attributes (each set up by one of
        ``init_attributes``), made on first use: grid and stream are filled in per call, so threads
        launching this kernel (e.g. one per GPU) must not share one."""
        if getattr(local, "config", None) is None:
            attributes = []
            for init_attribute in init_attributes:
                attributes.append(_driver.CUlaunchAttribute())
                init_attribute(attributes[-1])
            config = _driver.CUlaunchConfig()
            config.attrs = attributes
            config.numAttrs = len(attributes)
            config.blockDimX, config.blockDimY, config.blockDimZ = self.num_threads, 1, 1
            config.sharedMemBytes = self.smem_bytes
            local.config, local.attributes = config, attributes
        return local.config, local.attributes

    def _launch_ex(self, config, grid: tuple[int, int, int], stream_handle: int, params: bytes) -> None:
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.hStream = stream_handle
        buffer = ctypes.create_string_buffer(params, len(params))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        result = _driver.cuLaunchKernelEx(config, self.kernel, ctypes.addressof(argv), 0)
        if result[0] != _driver.CUresult.CUDA_SUCCESS:
            self._launch_failed(grid, result[0])

    def _launch_failed(self, grid: tuple[int, int, int], err) -> None:
        no_context = err == _driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        raise (ContextNotCurrent if no_context else CudaError)(
            f"launching {self.spec.uri} (grid {grid}, {self.num_threads} threads, "
            f"{self.smem_bytes} B shared memory) failed: {_error_text(_driver, err)}"
        )


def _allow_programmatic_serialization(attribute) -> None:
    attribute.id = _driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1


def _cluster_dimension(attribute) -> None:
    attribute.id = _driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


_loaded: dict[KernelSpec, LoadedKernel] = {}
_load_lock = threading.Lock()


def get_kernel(spec: KernelSpec, smem_bytes: int, num_threads: int,
               get_cubin: Callable[[KernelSpec], bytes] | None = None) -> LoadedKernel:
    """The loaded kernel for a spec: the cubin of its compile target (matrix.compile_target: on
    an sm_86 device, the sm_80 cubin where the instance compiles the same), compiled or read from
    the disk cache and loaded once."""
    kernel = _loaded.get(spec)
    if kernel is not None:
        return kernel
    target = matrix.compile_target(spec)
    with _load_lock:
        kernel = _loaded.get(spec) or _loaded.get(target)
        if kernel is None:
            if get_cubin is None:
                from ..generator.cache import get_cubin
            kernel = LoadedKernel(target, get_cubin(target), smem_bytes, num_threads)
        _loaded[spec] = _loaded[target] = kernel
    return kernel
