"""TMA tensor maps for the sm90 family (fwd_sm90.cuh, bwd_sm90.cuh): Q, K, V (and the backward's
dO and fp32 dQ buffer) as 4-D tensors (head-dim columns, rows, heads, batch; a varlen (total,
heads, d) tensor is a batch of one; PackGQA's Q as 5-D, see tensor_map) read in boxes of 128 bytes
of columns (one 128-byte swizzled panel: 64 fp16/bf16 columns, 32 fp32) by a tile's rows. Encoded with cuTensorMapEncodeTiled and memoized by (address, shape, strides, dtype, box):
a call on tensors seen before costs a dictionary lookup.
"""
from __future__ import annotations

import collections
import ctypes
import threading

import torch

from .launch import CudaError, _error_text, _import_driver, bind_primary_context

TMA_MAP_BYTES = 128  # sizeof(CUtensorMap)
PANEL_BYTES = 128    # a box's columns: the widest the 128-byte swizzle allows
PANEL_COLUMNS = PANEL_BYTES // 2  # of 16-bit elements (Q, K, V, dO); 32 of the backward's fp32 dQ buffer
_MAX_MAPS = 256
_maps: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def compatible(*tensors: torch.Tensor) -> bool:
    """Whether the TMA can read these (batch, rows, heads, d) or varlen (total, heads, d) tensors:
    rows to map, a contiguous last dim, a 16-byte aligned base, strides in 16-byte units (what
    execute.chunk_aligned already ensures for its copies) and not 0 over a dimension it steps (an
    expanded view: a tensor map's strides are positive), sizes within the 32-bit coordinates."""
    # On every Hopper forward call: one stride tuple and one shape tuple per tensor, no generators.
    for t in tensors:
        strides, shape = t.stride(), t.shape
        if len(strides) not in (3, 4) or strides[-1] != 1 or t.data_ptr() % 16:
            return False
        size = t.element_size()
        for stride, n in zip(strides[:-1], shape[:-1]):
            if (stride * size) % 16 or (stride == 0 and n > 1):
                return False
        for n in shape:
            if n == 0 or n >= 2**31:
                return False
    return True


def tensor_map(t: torch.Tensor, box_rows: int, group: int = 1) -> bytes:
    """The CUtensorMap bytes of a (batch, rows, heads, d) fp16/bf16 (or fp32) tensor, boxes of
    PANEL_BYTES of columns x box_rows, 128-byte swizzle, zero fill out of bounds. ``group`` > 1 (PackGQA's
    Q): heads come in groups of `group` that share a KV head, and a box is box_rows / group rows
    of all heads of one group, head fastest: packed row r of the box is row r / group, head r % group."""
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, box_rows, group)
    with _lock:
        blob = _maps.get(key)
        if blob is not None:
            _maps.move_to_end(key)
            return blob
    blob = _encode(t, box_rows, group)
    with _lock:
        _maps[key] = blob
        if len(_maps) > _MAX_MAPS:
            _maps.popitem(last=False)
    return blob


def _encode(t: torch.Tensor, box_rows: int, group: int = 1) -> bytes:
    driver = _import_driver()
    batch, rows, heads, d = t.shape
    size = t.element_size()
    dtype = {
        torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        torch.float32: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    }[t.dtype]
    # Dimensions after the contiguous columns, innermost first: (size, stride, box).
    if group == 1:
        dims = [(rows, t.stride(1), box_rows), (heads, t.stride(2), 1), (batch, t.stride(0), 1)]
    else:
        if heads % group or box_rows % group:
            raise ValueError(f"a PackGQA map needs the group ({group}) to divide heads ({heads}) and box rows ({box_rows})")
        dims = [(group, t.stride(2), group), (rows, t.stride(1), box_rows // group),
                (heads // group, group * t.stride(2), 1), (batch, t.stride(0), 1)]
    # A dimension of size 1 is never stepped over: give it a valid stride whatever the tensor says
    # (an expanded or sliced view may carry 0 or an odd value there).
    dims = [(n, stride if n > 1 else d, box) for n, stride, box in dims]
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    arguments = (
        dtype, u32(1 + len(dims)), t.data_ptr(),
        [u64(d)] + [u64(n) for n, _, _ in dims],
        [u64(stride * size) for _, stride, _ in dims],
        [u32(PANEL_BYTES // size)] + [u32(box) for _, _, box in dims],
        [u32(1)] * (1 + len(dims)),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    err, tensor_map = driver.cuTensorMapEncodeTiled(*arguments)
    if err != driver.CUresult.CUDA_SUCCESS and err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread where nothing called CUDA yet (the autograd engine's, before any allocation
        # there): bind PyTorch's context, as a launch does (execute._prepare_and_launch).
        bind_primary_context(t.device.index)
        err, tensor_map = driver.cuTensorMapEncodeTiled(*arguments)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(
            f"cuTensorMapEncodeTiled failed for a tensor of shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
            f"{t.dtype}, group {group}: {_error_text(driver, err)}"
        )
    return ctypes.string_at(tensor_map.getPtr(), TMA_MAP_BYTES)


_triples: collections.OrderedDict = collections.OrderedDict()


def sm90_fwd_params(q, k, v, block_m: int, block_n: int, fwd_params: bytes, group: int = 1) -> bytes:
    """Sm90FwdParams (fwd_sm90.cuh): the Q, K, V maps, then FwdParams, padded to the struct's
    64-byte alignment. The three maps are memoized together: one lookup per call. ``group`` > 1:
    PackGQA's Q map (tensor_map)."""
    key = (q.data_ptr(), q.shape, q.stride(), k.data_ptr(), k.shape, k.stride(), v.data_ptr(), v.shape, v.stride(),
           q.dtype, block_m, block_n, group)
    with _lock:
        maps = _triples.get(key)
        if maps is not None:
            _triples.move_to_end(key)
    if maps is None:
        q4, k4, v4 = (t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v))  # varlen: a batch of one
        maps = tensor_map(q4, block_m, group) + tensor_map(k4, block_n) + tensor_map(v4, block_n)
        with _lock:
            _triples[key] = maps
            if len(_triples) > _MAX_MAPS:
                _triples.popitem(last=False)
    return maps + fwd_params + bytes(-(len(maps) + len(fwd_params)) % 64)


_quads: collections.OrderedDict = collections.OrderedDict()


def sm90_bwd_params(q, k, v, dout, dq_accum, block_m: int, block_n: int, bwd_params: bytes) -> bytes:
    """Sm90BwdParams (bwd_sm90.cuh): the Q, K, V and dO maps ((batch, rows, heads, d) tensors, or
    varlen (total, heads, d) as a batch of one; Q and dO in boxes of block_m rows, K and V of
    block_n), the fp32 dQ buffer's ((batch, heads, rows, d), boxes of 32 columns by block_m rows),
    then BwdParams, padded to the struct's 64-byte alignment. Memoized together, as
    sm90_fwd_params (the dQ buffer is allocated per call; the caching allocator mostly hands back
    the same address)."""
    key = tuple((t.data_ptr(), t.shape, t.stride()) for t in (q, k, v, dout, dq_accum)) + (q.dtype, block_m, block_n)
    with _lock:
        maps = _quads.get(key)
        if maps is not None:
            _quads.move_to_end(key)
    if maps is None:
        q4, k4, v4, do4 = (t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v, dout))
        maps = (tensor_map(q4, block_m) + tensor_map(k4, block_n) + tensor_map(v4, block_n) + tensor_map(do4, block_m)
                + tensor_map(dq_accum.permute(0, 2, 1, 3), block_m))
        with _lock:
            _quads[key] = maps
            if len(_quads) > _MAX_MAPS:
                _quads.popitem(last=False)
    return maps + bwd_params + bytes(-(len(maps) + len(bwd_params)) % 64)
