"""The inference API: flash_attn_with_kvcache (in-place append, rotary, paged KV, split-KV) and
flash_attn_combine, with flash_attn 2.x semantics."""
from __future__ import annotations

import numbers

import torch

from .. import config
from ..generator import matrix
from ..generator.spec import KernelSpec
from ..generator.tiles import ROW_KERNEL_WARPS
from . import params as params_mod
from .device import device_index, device_info
from .dispatch import plan_fwd
from .interface import (
    _aligned,
    _check_alibi,
    _check_grid,
    _check_options,
    _launch,
    launch_combine,
    run_fwd,
)

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_COMBINE_SPLITS = 256  # kMaxSplits in templates/combine.cuh: split weights live in registers


def _check_int32_vector(name: str, t, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(t.shape)}")


def _check_same_kind(name: str, t, q: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _value_checks(cache_seqlens, seqlen_new, capacity, leftpad, block_table, page_size, num_pages,
                  cache_batch_idx, cache_batch) -> None:
    """FLASHGEN_CHECK_INPUTS=1: checks that read device memory (they synchronize). Without them the
    kernels still clamp every index, so bad values give wrong answers, never stray accesses."""
    lens = cache_seqlens.cpu()
    if (lens < 0).any() or (lens + seqlen_new > capacity).any():
        raise ValueError(
            f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache's capacity), got "
            f"cache_seqlens {lens.tolist()} with seqlen_new {seqlen_new}"
        )
    if leftpad is not None:
        pads = leftpad.cpu()
        if (pads < 0).any() or (pads > lens).any():
            raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens], got {pads.tolist()}")
    if block_table is not None:
        table = block_table.cpu()
        for b, used in enumerate((lens + seqlen_new).tolist()):
            needed = table[b, : -(-used // page_size)]
            if ((needed < 0) | (needed >= num_pages)).any():
                raise ValueError(f"block_table[{b}] holds page indices outside [0, {num_pages}): {needed.tolist()}")
    if cache_batch_idx is not None:
        idx = cache_batch_idx.cpu()
        if ((idx < 0) | (idx >= cache_batch)).any():
            raise ValueError(f"cache_batch_idx must lie in [0, {cache_batch}), got {idx.tolist()}")


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, pack_gqa=None,
):
    """Attention of q against a KV cache, appending new keys/values first (flash_attn 2.x).

    q (batch, seqlen_q, nheads, d); k_cache/v_cache (batch_cache, seqlen_cache, nheads_k, d), or
    with ``block_table`` (batch, max_pages) int32 a paged cache (num_pages, page_size, nheads_k, d)
    with any page size. ``k``/``v`` (batch, seqlen_new, nheads_k, d) are written at positions
    cache_seqlens .. cache_seqlens + seqlen_new (rotated first when rotary tables are given) and
    attended to. Returns ``out`` or ``(out, softmax_lse)``.
    """
    _check_same_kind("q", q, q, 4)
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got one on {q.device}")
    _check_same_kind("k_cache", k_cache, q, 4)
    _check_same_kind("v_cache", v_cache, q, 4)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have head_dim {head_dim} like q, got {k_cache.shape[3]}")
    if head_dim % 8 != 0 or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, 256], got {head_dim}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    _check_options(0.0, softmax_scale, window_size, softcap, num_splits)
    _check_alibi(alibi_slopes, q)
    if pack_gqa not in (None, True, False):
        raise ValueError(f"pack_gqa must be None (automatic), True or False, got {pack_gqa!r}")

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache has no batch rows)")
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be an int32 tensor, got {getattr(block_table, 'dtype', type(block_table))}")
        if block_table.device != q.device or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch={batch}, max_pages) on {q.device}, got {tuple(block_table.shape)} on {block_table.device}")
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if page_size < 1:
            raise ValueError("the paged cache's page size (k_cache.shape[1]) must be >= 1")
        capacity = block_table.shape[1] * page_size
        cache_batch = num_pages
    else:
        page_size = 1
        cache_batch, capacity = k_cache.shape[0], k_cache.shape[1]
        if cache_batch_idx is not None:
            _check_int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
        elif cache_batch < batch:
            raise ValueError(f"k_cache has {cache_batch} rows for a batch of {batch}; pass cache_batch_idx to map them")

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        _check_same_kind("k", k, q, 4)
        _check_same_kind("v", v, q, 4)
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2] != nheads_k or k.shape[3] != head_dim:
            raise ValueError(
                f"k and v must be (batch={batch}, seqlen_new, nheads_k={nheads_k}, head_dim={head_dim}), got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are appended")

    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, numbers.Integral):
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens must be in [0, {capacity - seqlen_new}] (capacity minus seqlen_new), got {cache_seqlens}")
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    else:
        _check_int32_vector("cache_seqlens", cache_seqlens, batch, q.device)
    if cache_leftpad is not None:
        _check_int32_vector("cache_leftpad", cache_leftpad, batch, q.device)

    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together (or neither)")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"{name} must be a float32/float16/bfloat16 tensor")
            if t.device != q.device or t.dim() != 2:
                raise ValueError(f"{name} must be (seqlen_ro, rotary_dim / 2) on {q.device}, got {tuple(t.shape)}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be in (0, head_dim={head_dim}]")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(
                f"rotary tables must cover every cache position: seqlen_ro = {rotary_cos.shape[0]} < the "
                f"cache's capacity {capacity}"
            )
        rotary_cos = rotary_cos.to(torch.float32).contiguous()
        rotary_sin = rotary_sin.to(torch.float32).contiguous()

    if config.check_inputs():
        _value_checks(cache_seqlens, seqlen_new, capacity, cache_leftpad, block_table, page_size,
                      cache_batch, cache_batch_idx, cache_batch)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0:
        return (out, lse) if return_softmax_lse else out
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    index = device_index(q)
    info = device_info(index)
    plan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=capacity,
        nheads=nheads, nheads_k=nheads_k, causal=bool(causal), window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=info, paged=paged, num_splits=int(num_splits),
        family=config.forced_family(),
    )
    _check_grid(plan)

    q_attn = q
    if rotary_dim or seqlen_new:
        q_attn = torch.empty_like(q) if rotary_dim else q
        _append_rotary(
            q, q_attn, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            block_table, rotary_dim=rotary_dim, seqlen_new=seqlen_new, capacity=capacity,
            cache_batch=cache_batch, page_size=page_size, interleaved=bool(rotary_interleaved),
            q_rotary_per_row=plan.spec.mask != "none", arch=plan.spec.arch, family=plan.spec.family,
            index=index,
        )
    run_fwd(
        plan, q=_aligned(q_attn), k=_aligned(k_cache), v=_aligned(v_cache), out=out, lse=lse,
        softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=capacity,
        seqused_k=cache_seqlens, seqlen_k_new=seqlen_new, leftpad_k=cache_leftpad,
        kv_batch_idx=cache_batch_idx, block_table=block_table, page_size=page_size, kv_batch=cache_batch,
    )
    return (out, lse) if return_softmax_lse else out


def _append_rotary(q, q_out, k, v, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
                   block_table, *, rotary_dim, seqlen_new, capacity, cache_batch, page_size,
                   interleaved, q_rotary_per_row, arch, family, index) -> None:
    """Rotate q into q_out and append (rotated) k and v into the cache, in one launch."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    spec = KernelSpec("append", family, arch, _DTYPE_NAMES[q.dtype])
    rows_q = batch * seqlen_q * nheads if rotary_dim else 0
    rows_kv = batch * seqlen_new * nheads_k
    zero3 = (0, 0, 0)
    values = dict(
        q_ptr=q.data_ptr(), q_out_ptr=q_out.data_ptr(),
        k_new_ptr=k.data_ptr() if k is not None else 0, v_new_ptr=v.data_ptr() if v is not None else 0,
        k_cache_ptr=k_cache.data_ptr(), v_cache_ptr=v_cache.data_ptr(),
        cos_ptr=cos.data_ptr() if cos is not None else 0, sin_ptr=sin.data_ptr() if sin is not None else 0,
        cache_seqlens_ptr=cache_seqlens.data_ptr(),
        cache_batch_idx_ptr=cache_batch_idx.data_ptr() if cache_batch_idx is not None else 0,
        block_table_ptr=block_table.data_ptr() if block_table is not None else 0,
        block_table_batch_stride=block_table.stride(0) if block_table is not None else 0,
        batch=batch, seqlen_q=seqlen_q if rotary_dim else 0, seqlen_new=seqlen_new,
        nheads=nheads, nheads_k=nheads_k, head_dim=head_dim, rotary_dim=rotary_dim,
        seqlen_ro=cos.shape[0] if cos is not None else 0, cache_capacity=capacity, cache_batch=cache_batch,
        rotary_interleaved=int(interleaved), q_rotary_per_row=int(q_rotary_per_row), page_size=page_size,
    )
    for prefix, t in (("q", q), ("q_out", q_out), ("k_new", k), ("v_new", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        strides = t.stride()[:3] if t is not None else zero3
        values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), strides)})
    grid = (max(1, -(-max(rows_q, rows_kv) // ROW_KERNEL_WARPS)), 3, 1)
    _launch(spec, 0, ROW_KERNEL_WARPS * 32, grid, params_mod.pack(params_mod.APPEND_LAYOUT, values), index)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge partial attention results computed over disjoint key ranges (split-KV, context
    parallelism) with LSE weighting.

    out_partial (num_splits, batch, seqlen, nheads, d) float32; lse_partial (num_splits, batch,
    seqlen, nheads) float32. Returns ``(out, softmax_lse)``: out (batch, seqlen, nheads, d) in
    ``out_dtype`` (default float32; float16 and bfloat16 allowed), softmax_lse (batch, seqlen,
    nheads) float32. Splits with lse = -inf contribute nothing.
    """
    for name, t, ndim in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    num_splits, batch, seqlen, nheads, head_dim = out_partial.shape
    if tuple(lse_partial.shape) != (num_splits, batch, seqlen, nheads):
        raise ValueError(f"lse_partial must have shape {(num_splits, batch, seqlen, nheads)}, got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError("out_partial and lse_partial must be on one device")
    if head_dim % 4 != 0:
        raise ValueError(f"head_dim must be a multiple of 4, got {head_dim}")
    if not 1 <= num_splits <= MAX_COMBINE_SPLITS:
        raise ValueError(f"out_partial must hold between 1 and {MAX_COMBINE_SPLITS} splits, got {num_splits}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.float32
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if out is None:
        out = torch.empty((batch, seqlen, nheads, head_dim), dtype=out_dtype, device=out_partial.device)
    elif tuple(out.shape) != (batch, seqlen, nheads, head_dim) or out.dtype != out_dtype or out.device != out_partial.device:
        raise ValueError(f"out must be a {out_dtype} tensor of shape {(batch, seqlen, nheads, head_dim)} on {out_partial.device}")
    if out.stride(-1) != 1 or any(s % 4 for s in out.stride()[:-1]) or out.data_ptr() % 16:
        raise ValueError("out must have a contiguous last dimension and 16-byte aligned rows")
    if out_partial.stride(-1) != 1 or any(s % 4 for s in out_partial.stride()[:-1]) or out_partial.data_ptr() % 16:
        out_partial = out_partial.contiguous()
    lse = torch.empty((batch, nheads, seqlen), dtype=torch.float32, device=out_partial.device).transpose(1, 2)
    if out.numel():
        launch_combine(
            out_partial, lse_partial, out, lse,
            partial_strides=out_partial.stride()[:4], lse_partial_strides=lse_partial.stride(),
            out_strides=out.stride()[:3], lse_strides=lse.stride(),
            num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim,
        )
    return out, lse
