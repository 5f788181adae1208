"""flashgen: FlashAttention kernels generated from templates, compiled with NVRTC on first use.

The API is imported lazily, so that the CLI's generator commands (and build workers) start
without importing torch.
"""
__version__ = "0.1.0"

_API = {
    "flash_attn_func": "flashgen.runtime.interface",
    "flash_attn_kvpacked_func": "flashgen.runtime.interface",
    "flash_attn_qkvpacked_func": "flashgen.runtime.interface",
    "flash_attn_varlen_func": "flashgen.runtime.interface",
    "flash_attn_varlen_kvpacked_func": "flashgen.runtime.interface",
    "flash_attn_varlen_qkvpacked_func": "flashgen.runtime.interface",
    "flash_attn_with_kvcache": "flashgen.runtime.kvcache",
    "flash_attn_combine": "flashgen.runtime.kvcache",
}

__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
