"""The backward pass: plan and launch the preprocess, main and postprocess kernels; a repeated call
of one description replays its first call's launches (execute.LaunchRecord)."""
from __future__ import annotations

import torch

from .. import config
from ..generator import params as params_mod
from ..generator.spec import KernelSpec
from ..generator.tiles import ROW_KERNEL_WARPS, bwd_row_grid
from . import execute, tma, tuning
from .device import device_index, device_info
from .dispatch import plan_bwd
from .dropout import NO_DROPOUT_PARAMS
from .execute import LOG2E, chunk_aligned, described, row_strides, whole_chunks

# Launch records of backwards (execute.LaunchRecord), by call description (flash_bwd's key): a
# repeated backward skips planning and packing.
_bwd_records = execute.LaunchRecords()


def flash_bwd(
    dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
    window_size: tuple[int, int], softcap: float, alibi_slopes, deterministic: bool,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
    seqused_q=None, seqused_k=None, dropout=None,
) -> None:
    """Write dq, dk, dv (preallocated, shaped like q, k, v) for attention's output gradient dout.

    dk and dv come out already summed over the query heads of each KV head (GQA/MQA): one CTA
    loops over the group, so no expanded buffer is needed. Varlen (cu_seqlens_q/k): q, k, v are
    (total, heads, d), lse is (nheads, total_q).

    A call of a description seen before launches the record its first call left (the key:
    everything the plan and the params depend on but the tensors' addresses, whose 16-byte
    alignment is checked per call). Not recorded: dropout (its params hold the call's RNG seed
    and offset), and calls that ran on a copy (inputs off whole 16-byte chunks, dk or dv off them:
    copied back after the kernels) or passed one tensor as two arguments other than q, k, v.
    """
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0]
        stats_batch, stats_rows = 1, seqlen_q  # lse, dsum, dq_accum: (nheads, total_q)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        max_seqlen_q, max_seqlen_k = seqlen_q, seqlen_k
        stats_batch, stats_rows = batch, seqlen_q
    if 0 in (batch, seqlen_q, nheads, max_seqlen_q, seqlen_k, max_seqlen_k):
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    # The main kernels store dK and dV rows in 16-byte chunks: a caller's dk or dv off them gets a
    # dense buffer, copied back at the end.
    dk_out = dk if whole_chunks(dk) else torch.empty_like(dk, memory_format=torch.contiguous_format)
    dv_out = dv if whole_chunks(dv) else torch.empty_like(dv, memory_format=torch.contiguous_format)
    if varlen:  # rows outside every sequence (or past seqused_k) get no gradient from the kernel
        dk_out.zero_()
        dv_out.zero_()
    index = device_index(q)
    # The call's tensors, a record's slots.
    tensors = (q, k, v, dout, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    dropping = dropout is not None and dropout.p > 0
    key = None
    if not dropping:
        # (And which of q, k, v are one tensor, self-attention on one buffer: such a call's record
        # reads it from q's slot.)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), dout.stride(), out.stride(), dq.stride(),
               dk.stride(), dv.stride(), q.dtype, q.device, softmax_scale, causal, window_size, softcap, deterministic,
               max_seqlen_q, max_seqlen_k, described(alibi_slopes), described(cu_seqlens_q),
               seqused_q is None, seqused_k is None, tuning.current(), config.forced_family(), k is q, v is q, v is k)
        record = _bwd_records.get(key)
        # (dk and dv: whole chunks above; q, k, v, dout: read as they are, by the TMA too, when aligned.)
        if (record is not None and dk_out is dk and dv_out is dv
                and not (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr()) % 16):
            execute.run_record(record, tensors, index)
            return
    info = device_info(index)
    q, k, v, dout = chunk_aligned(q), chunk_aligned(k), chunk_aligned(v), chunk_aligned(dout)
    plan = plan_bwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        nheads_k=nheads_k, causal=causal, window_size=window_size, softcap=softcap, device=info,
        family=config.forced_family(), dropout=dropping, nheads=nheads,
        deterministic=deterministic, tuning=tuning.current(),
        # The TMA checks only on Hopper; the sm90 backward takes dense and varlen calls (deterministic
        # or not), without seqused.
        sm90=info.capability[0] == 9 and seqused_q is None and seqused_k is None and tma.compatible(q, k, v, dout),
    )
    semaphores_shape = None
    if deterministic:
        # One counter per (query block, head-dim slice): each slice's CTAs add in key order.
        semaphores_shape = (batch, nheads, plan.tile.d_slices, -(-max_seqlen_q // plan.tile.block_m))
    scratch = execute.Scratch(bwd_buffers, (stats_batch, nheads, stats_rows, head_dim, semaphores_shape))
    dsum, lse_log2, dq_accum, semaphores = buffers = scratch.make(q.device)

    row_pointers = dict(o_ptr=out, do_ptr=dout, lse_ptr=lse, lse_log2_ptr=lse_log2, dsum_ptr=dsum,
                        dq_accum_ptr=dq_accum, dq_ptr=dq)
    row_values = execute.addresses(row_pointers)
    row_values.update(batch=stats_batch, seqlen_q=stats_rows, nheads=nheads, head_dim=head_dim,
                      softmax_scale=softmax_scale)
    for prefix, t in (("o", out), ("do", dout), ("dq", dq)):
        row_values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), row_strides(t))})
    row_params = params_mod.pack(params_mod.BWD_ROW_LAYOUT, row_values)
    row_grid = bwd_row_grid(stats_batch * stats_rows * nheads, head_dim)
    spec = plan.spec
    pre = KernelSpec("bwd_pre", spec.family, spec.arch, spec.dtype)
    post = KernelSpec("bwd_post", spec.family, spec.arch, spec.dtype)

    has_softcap = softcap > 0
    pointers = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=dout, lse_log2_ptr=lse_log2, dsum_ptr=dsum, dq_accum_ptr=dq_accum,
        dk_ptr=dk_out, dv_ptr=dv_out, alibi_slopes_ptr=alibi_slopes, semaphore_ptr=semaphores,
        cu_seqlens_q_ptr=cu_seqlens_q, cu_seqlens_k_ptr=cu_seqlens_k, seqused_q_ptr=seqused_q, seqused_k_ptr=seqused_k,
    )
    values = execute.addresses(pointers)
    values.update(
        alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        stats_batch_stride=0 if varlen else nheads * seqlen_q, stats_head_stride=stats_rows,
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, max_seqlen_q=max_seqlen_q,
        nheads=nheads, nheads_k=nheads_k,
        head_dim=head_dim, window_left=plan.window_left, window_right=plan.window_right,
        scale_log2=LOG2E if has_softcap else softmax_scale * LOG2E,
        softmax_scale=softmax_scale,
        softcap_scale=softmax_scale / softcap if has_softcap else 0.0,
        softcap=float(softcap),
        alibi_scale=1.0 if has_softcap else 1.0 / softmax_scale,
        **(dropout.params() if dropping else NO_DROPOUT_PARAMS),
        dq_turns_descending=int(plan.dq_turns_descending), cta_chunks=plan.cta_chunks,
    )
    for prefix, t in (("q", q), ("k", k), ("v", v), ("do", dout), ("dk", dk_out), ("dv", dv_out)):
        values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), row_strides(t))})
    bwd_params = params_mod.pack(params_mod.BWD_LAYOUT, values)
    packed, maps = bwd_params, None
    if spec.family == "sm90":  # the TMA maps of Q, K, V, dO and the dQ buffer before the BwdParams
        block_m, block_n = plan.tile.block_m, plan.tile.block_n
        maps = execute.TensorMaps(lambda q, k, v, dout, dq_accum, params: tma.sm90_bwd_params(
            q, k, v, dout, dq_accum, block_m, block_n, params), (q, k, v, dout, dq_accum))
        packed = maps.prepend(q, k, v, dout, dq_accum, bwd_params)
    # Everything packed first: the three kernels are enqueued back to back, so the GPU does not
    # idle between them while the host packs.
    threads = ROW_KERNEL_WARPS * 32
    execute.launch_kernel(pre, 0, threads, row_grid, row_params, index)
    # Keys that no query sees still get dK = dV = 0: the main kernel writes every key row it owns.
    execute.launch_kernel(spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index)
    execute.launch_kernel(post, 0, threads, row_grid, row_params, index)
    if key is not None and _bwd_records.capacity:
        capture = execute.Capture()
        capture.add(params_mod.BWD_ROW_LAYOUT, row_pointers, pre, 0, threads, row_grid, row_params)
        capture.add(params_mod.BWD_LAYOUT, pointers, spec, plan.smem_bytes, plan.tile.num_threads, plan.grid,
                    bwd_params, maps=maps)
        capture.add(params_mod.BWD_ROW_LAYOUT, row_pointers, post, 0, threads, row_grid, row_params)
        capture.scratch = (scratch, buffers)
        # The caller's tensors (a copy of one, or a dense dk or dv: no record); one passed as two of
        # q, k, v in its first slot only.
        q, k, v = tensors[:3]
        distinct = (q, None if k is q else k, None if v is q or v is k else v, *tensors[3:])
        _bwd_records.keep(key, execute.record_launches(capture, distinct))
    if dk_out is not dk:
        dk.copy_(dk_out)
    if dv_out is not dv:
        dv.copy_(dv_out)


def bwd_buffers(stats_batch: int, nheads: int, stats_rows: int, head_dim: int, semaphores_shape, device) -> tuple:
    """The backward's per-call buffers (an execute.Scratch: made by the full path and by a record):
    D and the LSE in log2 units, both written by the preprocess, in one allocation; the fp32 dQ
    accumulator; and the deterministic dQ's semaphores, zeroed (None when ``semaphores_shape`` is)."""
    dsum, lse_log2 = torch.empty((2, stats_batch, nheads, stats_rows), dtype=torch.float32, device=device)
    dq_accum = torch.empty((stats_batch, nheads, stats_rows, head_dim), dtype=torch.float32, device=device)
    semaphores = None
    if semaphores_shape is not None:
        semaphores = torch.zeros(semaphores_shape, dtype=torch.int32, device=device)
    return dsum, lse_log2, dq_accum, semaphores
