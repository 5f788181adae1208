"""Per-device facts the dispatcher needs, read once per device from torch."""
from __future__ import annotations

import torch

from .dispatch import DeviceInfo

_infos: dict[int, DeviceInfo] = {}


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def device_info(index: int) -> DeviceInfo:
    info = _infos.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        info = DeviceInfo(
            capability=(props.major, props.minor),
            num_sms=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", 0) or 50 * 1024 * 1024,
            smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0) or 164 * 1024,
        )
        _infos[index] = info
    return info
