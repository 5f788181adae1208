"""TMA tensor maps for the sm90 forward (fwd_sm90.cuh): Q, K and V as 4-D tensors (head-dim
columns, rows, heads, batch; a varlen (total, heads, d) tensor is a batch of one) read in boxes of 64 columns (one 128-byte swizzled panel) by a tile's
rows. Encoded with cuTensorMapEncodeTiled and memoized by (address, shape, strides, dtype, box):
a call on tensors seen before costs a dictionary lookup.
"""
from __future__ import annotations

import collections
import ctypes
import threading

import torch

from .launch import CudaError, _error_text, _import_driver

TMA_MAP_BYTES = 128  # sizeof(CUtensorMap)
PANEL_COLUMNS = 64   # 128 bytes of 16-bit elements: the widest box the 128-byte swizzle allows
_MAX_MAPS = 256
_maps: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def compatible(*tensors: torch.Tensor) -> bool:
    """Whether the TMA can read these (batch, rows, heads, d) or varlen (total, heads, d) tensors:
    rows to map, a contiguous last dim, a 16-byte aligned base, strides in 16-byte units (what
    flashgen's _aligned already ensures for its copies), sizes within the 32-bit coordinates."""
    # On every Hopper forward call: one stride tuple and one shape tuple per tensor, no generators.
    for t in tensors:
        strides, shape = t.stride(), t.shape
        if len(strides) not in (3, 4) or strides[-1] != 1 or t.data_ptr() % 16:
            return False
        size = t.element_size()
        for stride in strides[:-1]:
            if (stride * size) % 16:
                return False
        for n in shape:
            if n == 0 or n >= 2**31:
                return False
    return True


def tensor_map(t: torch.Tensor, box_rows: int) -> bytes:
    """The CUtensorMap bytes of a (batch, rows, heads, d) fp16/bf16 tensor, boxes of
    PANEL_COLUMNS x box_rows, 128-byte swizzle, zero fill out of bounds."""
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, box_rows)
    with _lock:
        blob = _maps.get(key)
        if blob is not None:
            _maps.move_to_end(key)
            return blob
    blob = _encode(t, box_rows)
    with _lock:
        _maps[key] = blob
        if len(_maps) > _MAX_MAPS:
            _maps.popitem(last=False)
    return blob


def _encode(t: torch.Tensor, box_rows: int) -> bytes:
    driver = _import_driver()
    batch, rows, heads, d = t.shape
    size = t.element_size()
    dtype = {
        torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    }[t.dtype]
    # A dimension of size 1 is never stepped over: give it a valid stride whatever the tensor says
    # (an expanded or sliced view may carry 0 or an odd value there).
    strides = [t.stride(1), t.stride(2), t.stride(0)]
    sizes = [rows, heads, batch]
    strides = [s if n > 1 else d for s, n in zip(strides, sizes)]
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        dtype, u32(4), t.data_ptr(),
        [u64(d), u64(rows), u64(heads), u64(batch)],
        [u64(s * size) for s in strides],
        [u32(PANEL_COLUMNS), u32(box_rows), u32(1), u32(1)],
        [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(
            f"cuTensorMapEncodeTiled failed for a tensor of shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
            f"{t.dtype}: {_error_text(driver, err)}"
        )
    return ctypes.string_at(tensor_map.getPtr(), TMA_MAP_BYTES)


_triples: collections.OrderedDict = collections.OrderedDict()


def sm90_fwd_params(q, k, v, block_m: int, block_n: int, fwd_params: bytes) -> bytes:
    """Sm90FwdParams (fwd_sm90.cuh): the Q, K, V maps, then FwdParams, padded to the struct's
    64-byte alignment. The three maps are memoized together: one lookup per call."""
    key = (q.data_ptr(), q.shape, q.stride(), k.data_ptr(), k.shape, k.stride(), v.data_ptr(), v.shape, v.stride(),
           q.dtype, block_m, block_n)
    with _lock:
        maps = _triples.get(key)
        if maps is not None:
            _triples.move_to_end(key)
    if maps is None:
        q4, k4, v4 = (t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v))  # varlen: a batch of one
        maps = tensor_map(q4, block_m) + tensor_map(k4, block_n) + tensor_map(v4, block_n)
        with _lock:
            _triples[key] = maps
            if len(_triples) > _MAX_MAPS:
                _triples.popitem(last=False)
    return maps + fwd_params + bytes(-(len(maps) + len(fwd_params)) % 64)
