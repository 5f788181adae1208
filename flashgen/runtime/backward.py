"""The backward pass: plan and launch the preprocess, main and postprocess kernels."""
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
from .execute import LOG2E, chunk_aligned, ptr_or_null, row_strides, whole_chunks


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
    info = device_info(index)
    q, k, v, dout = chunk_aligned(q), chunk_aligned(k), chunk_aligned(v), chunk_aligned(dout)
    plan = plan_bwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        nheads_k=nheads_k, causal=causal, window_size=window_size, softcap=softcap, device=info,
        family=config.forced_family(), dropout=dropout is not None and dropout.p > 0, nheads=nheads,
        deterministic=deterministic, tuning=tuning.current(),
        # The TMA checks only on Hopper; the sm90 backward takes dense and varlen calls (deterministic
        # or not), without seqused.
        sm90=info.capability[0] == 9 and seqused_q is None and seqused_k is None and tma.compatible(q, k, v, dout),
    )
    # D and the LSE in log2 units, both written by the preprocess: one allocation.
    dsum, lse_log2 = torch.empty((2, stats_batch, nheads, stats_rows), dtype=torch.float32, device=q.device)
    dq_accum = torch.empty((stats_batch, nheads, stats_rows, head_dim), dtype=torch.float32, device=q.device)
    semaphores = None
    if deterministic:
        m_blocks = -(-max_seqlen_q // plan.tile.block_m)
        # One counter per (query block, head-dim slice): each slice's CTAs add in key order.
        semaphores = torch.zeros((batch, nheads, plan.tile.d_slices, m_blocks), dtype=torch.int32, device=q.device)

    row_values = dict(
        o_ptr=out.data_ptr(), do_ptr=dout.data_ptr(), lse_ptr=lse.data_ptr(), lse_log2_ptr=lse_log2.data_ptr(),
        dsum_ptr=dsum.data_ptr(),
        dq_accum_ptr=dq_accum.data_ptr(), dq_ptr=dq.data_ptr(),
        batch=stats_batch, seqlen_q=stats_rows, nheads=nheads, head_dim=head_dim, softmax_scale=softmax_scale,
    )
    for prefix, t in (("o", out), ("do", dout), ("dq", dq)):
        row_values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), row_strides(t))})
    row_params = params_mod.pack(params_mod.BWD_ROW_LAYOUT, row_values)
    row_grid = bwd_row_grid(stats_batch * stats_rows * nheads, head_dim)
    spec = plan.spec
    pre = KernelSpec("bwd_pre", spec.family, spec.arch, spec.dtype)
    post = KernelSpec("bwd_post", spec.family, spec.arch, spec.dtype)

    has_softcap = softcap > 0
    values = dict(
        q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), do_ptr=dout.data_ptr(),
        lse_log2_ptr=lse_log2.data_ptr(), dsum_ptr=dsum.data_ptr(), dq_accum_ptr=dq_accum.data_ptr(),
        dk_ptr=dk_out.data_ptr(), dv_ptr=dv_out.data_ptr(), alibi_slopes_ptr=ptr_or_null(alibi_slopes),
        semaphore_ptr=ptr_or_null(semaphores), cu_seqlens_q_ptr=ptr_or_null(cu_seqlens_q), cu_seqlens_k_ptr=ptr_or_null(cu_seqlens_k),
        seqused_q_ptr=ptr_or_null(seqused_q), seqused_k_ptr=ptr_or_null(seqused_k),
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
        **(dropout.params() if dropout is not None and dropout.p > 0 else NO_DROPOUT_PARAMS),
        dq_turns_descending=int(plan.dq_turns_descending), cta_chunks=plan.cta_chunks,
    )
    for prefix, t in (("q", q), ("k", k), ("v", v), ("do", dout), ("dk", dk_out), ("dv", dv_out)):
        values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), row_strides(t))})
    packed = params_mod.pack(params_mod.BWD_LAYOUT, values)
    if spec.family == "sm90":  # the TMA maps of Q, K, V, dO and the dQ buffer before the BwdParams
        packed = tma.sm90_bwd_params(q, k, v, dout, dq_accum, plan.tile.block_m, plan.tile.block_n, packed)
    # Everything packed first: the three kernels are enqueued back to back, so the GPU does not
    # idle between them while the host packs.
    threads = ROW_KERNEL_WARPS * 32
    execute.launch_kernel(pre, 0, threads, row_grid, row_params, index)
    # Keys that no query sees still get dK = dV = 0: the main kernel writes every key row it owns.
    execute.launch_kernel(spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index)
    execute.launch_kernel(post, 0, threads, row_grid, row_params, index)
    if dk_out is not dk:
        dk.copy_(dk_out)
    if dv_out is not dv:
        dv.copy_(dv_out)
