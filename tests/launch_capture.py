"""What the CPU tier's launch-record tests share (test_kvcache_record.py, test_bwd_record.py): the
launches a stand-in launch_kernel saw, and each launch's params with its pointers named."""
from __future__ import annotations

import struct
import typing

from flashgen.generator import params as params_mod
from flashgen.runtime import execute, tma, validate
from flashgen.runtime.device import DeviceInfo

HOPPER = DeviceInfo(capability=(9, 0), num_sms=132, l2_bytes=50 << 20, smem_per_sm=228 << 10)
AMPERE = DeviceInfo(capability=(8, 0), num_sms=108, l2_bytes=40 << 20, smem_per_sm=164 << 10)

LAYOUTS = {"fwd": params_mod.FWD_LAYOUT, "append": params_mod.APPEND_LAYOUT, "combine": params_mod.COMBINE_LAYOUT,
           "bwd_pre": params_mod.BWD_ROW_LAYOUT, "bwd": params_mod.BWD_LAYOUT, "bwd_post": params_mod.BWD_ROW_LAYOUT}
# The tensor maps the sm90 kernels' params start with: Q, K, V (tma.sm90_fwd_params); Q, K, V, dO
# and the dQ buffer (tma.sm90_bwd_params).
SM90_MAPS = {"fwd": 3, "bwd": 5}
POINTER = struct.Struct("<Q")


class Launched(typing.NamedTuple):
    spec: object
    smem_bytes: int
    num_threads: int
    grid: tuple
    params: bytes
    dependent: bool
    cluster: tuple | None


def stand_in_device(monkeypatch, info: DeviceInfo, modules, launches: list) -> None:
    """The GPU replaced on the CPU: ``info`` as every module's device_info (device 0), launches
    appended to ``launches``, tensor maps that name their tensor (so that a reused map of another
    call's tensor shows), the maps' memos emptied, CPU tensors accepted as CUDA ones."""
    for module in modules:
        monkeypatch.setattr(module, "device_info", lambda index: info)
        monkeypatch.setattr(module, "device_index", lambda t: 0)
    monkeypatch.setattr(execute, "launch_kernel", lambda spec, smem, threads, grid, params, index, dependent=False,
                        cluster=None: launches.append(Launched(spec, smem, threads, grid, params, dependent, cluster)))
    monkeypatch.setattr(tma, "tensor_map",
                        lambda t, rows, group=1: struct.pack("<QQQ", t.data_ptr(), rows, group) + bytes(104))
    for memo in ("_quads", "_triples"):
        monkeypatch.setattr(tma, memo, type(getattr(tma, memo))())
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)


def pointer_offsets(spec) -> tuple[int, ...]:
    """Where a launch's params hold pointers: its layout's pointer fields (an sm90 kernel's after
    its stand-in tensor maps, each of which starts with its tensor's address)."""
    maps = SM90_MAPS.get(spec.direction, 0) if spec.family == "sm90" else 0
    base = maps * tma.TMA_MAP_BYTES
    layout = LAYOUTS[spec.direction]
    return (tuple(i * tma.TMA_MAP_BYTES for i in range(maps))
            + tuple(base + offset for field, offset in zip(layout.fields, layout.offsets) if field.kind == "ptr"))


def symbolic(launches: list[Launched], named: dict) -> list[tuple]:
    """The launches with each pointer replaced by its name (named, else "new<n>" by order of
    appearance, 0 "null") and zeroed in the params bytes."""
    fresh: dict = {}
    result = []
    for launch in launches:
        params = bytearray(launch.params)
        pointers = []
        for offset in pointer_offsets(launch.spec):
            (address,) = POINTER.unpack_from(params, offset)
            if address:
                pointers.append(named.get(address) or fresh.setdefault(address, f"new{len(fresh)}"))
            else:
                pointers.append("null")
            POINTER.pack_into(params, offset, 0)
        result.append((launch.spec.uri, launch.smem_bytes, launch.num_threads, launch.grid, launch.dependent,
                       launch.cluster, tuple(pointers), bytes(params)))
    return result
