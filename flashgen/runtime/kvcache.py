"""The inference API: flash_attn_with_kvcache (in-place append, rotary, paged KV, split-KV) and
flash_attn_combine, with flash_attn 2.x semantics."""
from __future__ import annotations

import torch

from .. import config
from ..generator import matrix
from ..generator import params as params_mod
from ..generator.spec import KernelSpec
from ..generator.tiles import DECODE_MAX_ROWS, ROW_KERNEL_WARPS
from . import execute, tma, tuning, validate
from .device import device_index, device_info
from .dispatch import dtype_name, plan_fwd
from .execute import HEAD_DIM_MULTIPLE, chunk_aligned, described, launch_combine, pad_head_dim, run_fwd


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
    call = validate.kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse, pack_gqa,
    )
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    args = (rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
            causal, softcap, rotary_interleaved, alibi_slopes, num_splits, pack_gqa, call)
    if head_dim % HEAD_DIM_MULTIPLE == 0:
        out, lse = _kvcache_fwd(q, k_cache, v_cache, k, v, *args)
    else:
        # As flash_attn 2 does (mha_fwd_kvcache): run on padded copies of q, the caches and the new
        # rows, then copy the caches back whole when rows were appended. Slow (the caches are copied
        # twice) but correct; such head dims are rare in inference.
        k_cache_padded, v_cache_padded = pad_head_dim(k_cache), pad_head_dim(v_cache)
        k_padded, v_padded = (pad_head_dim(k), pad_head_dim(v)) if k is not None else (None, None)
        out, lse = _kvcache_fwd(pad_head_dim(q), k_cache_padded, v_cache_padded, k_padded, v_padded, *args)
        out = out[..., :head_dim]
        if k is not None:
            k_cache.copy_(k_cache_padded[..., :head_dim])
            v_cache.copy_(v_cache_padded[..., :head_dim])
    return (out, lse) if return_softmax_lse else out


# Launch records of flash_attn_with_kvcache calls (execute.LaunchRecord), by call description
# (_kvcache_fwd's key): a repeated decode step skips planning and packing.
_kvcache_records = execute.LaunchRecords()


def _kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, softcap, rotary_interleaved, alibi_slopes, num_splits, pack_gqa,
                 call: validate.KVCacheCall):
    """A validated flash_attn_with_kvcache call whose head dim is a multiple of 8: (out, softmax_lse).

    A call of a description seen before launches the record its first call left (the key:
    everything the plan and the launches' params depend on but the tensors' addresses). Both
    paths run the value checks and make the per-call tensors alike (cache_seqlens from an int or
    None, fp32 rotary tables, a contiguous block table, out, lse, the rotated q), and a record is
    taken and made only with q and the caches 16-byte aligned (the kernels read the caches in
    whole chunks, else copies; the plan's TMA check reads q's and their alignment)."""
    paged, page_size, capacity, cache_batch, seqlen_new, rotary_dim, window_size = call
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    check_inputs = config.check_inputs()
    # v_cache has k_cache's shape, and the half tensors q's dtype (validate.kvcache);
    # return_softmax_lse changes no launch.
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.stride(),
           described(k), described(v), described(rotary_cos), described(rotary_sin), described(cache_seqlens),
           described(cache_batch_idx), described(cache_leftpad), described(block_table), described(alibi_slopes),
           softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, pack_gqa, check_inputs,
           tuning.current(), config.forced_family())
    aligned = not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16
    record = _kvcache_records.get(key) if aligned else None

    if paged and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if rotary_dim:
        rotary_cos = rotary_cos.to(torch.float32).contiguous()
        rotary_sin = rotary_sin.to(torch.float32).contiguous()

    if check_inputs:
        validate.kvcache_values(cache_seqlens, seqlen_new, capacity, cache_leftpad, block_table, page_size,
                                cache_batch, cache_batch_idx, cache_batch)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0:
        return out, lse
    q_rotated = torch.empty_like(q) if rotary_dim else None
    # The call's tensors, a record's slots (q first: execute.run_record).
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes, out, lse, q_rotated)
    index = device_index(q)
    if record is not None:
        execute.run_record(record, tensors, index)
        return out, lse
    info = device_info(index)
    plan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=capacity,
        nheads=nheads, nheads_k=nheads_k, causal=bool(causal), window_size=window_size,
        softcap=float(softcap), pack_gqa=pack_gqa, device=info, paged=paged, num_splits=int(num_splits),
        family=config.forced_family(), page_size=page_size if paged else 0, leftpad=cache_leftpad is not None,
        # Calls with more query rows than the decode tile's may take the sm90 forward
        # (cache_seqlens, cache_batch_idx and leftpad are its seqused_k, K/V batch index and key
        # offset; a paged cache by TMA when its pages hold whole key blocks and there is no left
        # pad, else gathered); decode runs the sm80 family. (The TMA checks cost microseconds of
        # Python: not on decode steps, whose rows, even packed, fit the decode tile.)
        sm90=info.capability[0] == 9
        and seqlen_q * (nheads // nheads_k) > DECODE_MAX_ROWS and tma.compatible(q, k_cache, v_cache),
        kv_heads_adjacent=k_cache.stride(2) == head_dim and v_cache.stride(2) == head_dim,
        tuning=tuning.current(),
    )
    validate.grid(plan, "k_cache")

    capture = execute.Capture() if aligned and _kvcache_records.capacity else None
    q_attn = q if q_rotated is None else q_rotated
    if rotary_dim or seqlen_new:
        _append_rotary(
            q, q_attn, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            block_table, rotary_dim=rotary_dim, seqlen_new=seqlen_new, capacity=capacity,
            cache_batch=cache_batch, page_size=page_size, interleaved=bool(rotary_interleaved),
            q_rotary_per_row=plan.spec.mask != "none", arch=plan.spec.arch, family=matrix.BASE_FAMILY,
            index=index, capture=capture,
        )
    run_fwd(
        plan, q=chunk_aligned(q_attn), k=chunk_aligned(k_cache), v=chunk_aligned(v_cache), out=out, lse=lse,
        softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=capacity,
        seqused_k=cache_seqlens, seqlen_k_new=seqlen_new, leftpad_k=cache_leftpad,
        kv_batch_idx=cache_batch_idx, block_table=block_table, page_size=page_size, kv_batch=cache_batch,
        capture=capture,
    )
    if capture is not None:
        # (No record where the call ran on a copy, or passed one tensor as two arguments.)
        _kvcache_records.keep(key, execute.record_launches(capture, tensors))
    return out, lse


def _append_rotary(q, q_out, k, v, k_cache, v_cache, cos, sin, cache_seqlens, cache_batch_idx,
                   block_table, *, rotary_dim, seqlen_new, capacity, cache_batch, page_size,
                   interleaved, q_rotary_per_row, arch, family, index, capture=None) -> None:
    """Rotate q into q_out and append (rotated) k and v into the cache, in one launch (kept in
    ``capture`` too, when given: execute.Capture)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    spec = KernelSpec("append", family, arch, dtype_name(q.dtype))
    rows_q = batch * seqlen_q * nheads if rotary_dim else 0
    rows_kv = batch * seqlen_new * nheads_k
    zero3 = (0, 0, 0)
    pointers = dict(
        q_ptr=q, q_out_ptr=q_out, k_new_ptr=k, v_new_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, cos_ptr=cos,
        sin_ptr=sin, cache_seqlens_ptr=cache_seqlens, cache_batch_idx_ptr=cache_batch_idx, block_table_ptr=block_table,
    )
    values = execute.addresses(pointers)
    values.update(
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
    params = params_mod.pack(params_mod.APPEND_LAYOUT, values)
    execute.launch_kernel(spec, 0, ROW_KERNEL_WARPS * 32, grid, params, index)
    if capture is not None:
        capture.add(params_mod.APPEND_LAYOUT, pointers, spec, 0, ROW_KERNEL_WARPS * 32, grid, params)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge partial attention results computed over disjoint key ranges (split-KV, context
    parallelism) with LSE weighting.

    out_partial (num_splits, batch, seqlen, nheads, d) float32; lse_partial (num_splits, batch,
    seqlen, nheads) float32. Returns ``(out, softmax_lse)``: out (batch, seqlen, nheads, d) in
    ``out_dtype`` (default float32; float16 and bfloat16 allowed), softmax_lse (batch, seqlen,
    nheads) float32. Splits with lse = -inf contribute nothing.
    """
    validate.combine(out_partial, lse_partial, out, out_dtype)
    num_splits, batch, seqlen, nheads, head_dim = out_partial.shape
    if head_dim % 4:  # the kernel moves float4 chunks: merge zero-padded rows, keep the call's columns
        dtype = out_dtype or (out.dtype if out is not None else torch.float32)
        merged, lse = flash_attn_combine(pad_head_dim(out_partial, 4), lse_partial, out_dtype=dtype)
        if out is None:
            return merged[..., :head_dim], lse
        out.copy_(merged[..., :head_dim])
        return out, lse
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.float32
    if out is None:
        out = torch.empty((batch, seqlen, nheads, head_dim), dtype=out_dtype, device=out_partial.device)
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
