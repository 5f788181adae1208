"""The backward pass: plan and launch the preprocess, main and postprocess kernels."""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import config
from ..generator import matrix
from ..generator import params as params_mod
from ..generator.spec import KernelSpec
from ..generator.tiles import ROW_KERNEL_WARPS, BwdTile, Sm90BwdTile, bwd_row_grid, bwd_tile
from . import execute, tma
from .device import device_index, device_info
from .dispatch import DeviceInfo, dtype_name, instance_head_dim, resolve_mask
from .dropout import NO_DROPOUT_PARAMS
from .execute import LOG2E, chunk_aligned, ptr_or_null, row_strides, whole_chunks


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    spec: KernelSpec
    tile: BwdTile | Sm90BwdTile
    grid: tuple[int, int, int]  # (key blocks x head-dim slices, KV heads, batch)
    window_left: int
    window_right: int
    # Deterministic sm90 dQ order (bwd_sm90.cuh): key blocks add to a query block last first when
    # every query head has its own KV head under a causal mask, first first otherwise (MHA causal
    # gains with the former, GQA causal with the latter: benchmarks/results/
    # 20261202-nvidia-h200-sm90-bwd-rows-order and 20261201-nvidia-h200-sm90-bwd-det).
    dq_turns_descending: bool = False

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes(self.spec.head_dim)


@functools.lru_cache(maxsize=1024)
def plan_bwd(
    *, dtype: str, head_dim: int, batch: int, seqlen_q: int, seqlen_k: int, nheads_k: int,
    causal: bool, window_size: tuple[int, int], softcap: float, device: DeviceInfo | tuple[int, int],
    family: str | None = None, dropout: bool = False, sm90: bool = False, nheads: int | None = None,
    deterministic: bool = False,
) -> BwdPlan:
    """The backward instance and grid for a call (a pure function, like plan_fwd). ``sm90``: the
    caller's inputs allow the sm90 backward (tensors the TMA can read, no seqused);
    on sm_90a such a call takes it when it has an instance (sm90_bwd_covers), unless ``family``
    forces sm80. ``nheads`` (None: as many as ``nheads_k``) and ``deterministic`` choose the
    deterministic dQ order."""
    if not isinstance(device, DeviceInfo):
        device = DeviceInfo(tuple(device))
    dtype = dtype_name(dtype)
    arch = matrix.target_arch(*device.capability)
    allow_sm90 = sm90 and family in (None, "sm90") and "sm90" in matrix.families(arch)
    family = matrix.family_for(arch) if family in (None, "sm90") else family
    mask, window_left, window_right = resolve_mask(causal, window_size, seqlen_q, seqlen_k)
    if allow_sm90 and sm90_bwd_covers(head_dim=head_dim):
        sm90_head_dim = sm90_bwd_instance_head_dim(head_dim)
        tile = bwd_tile("sm90", arch, sm90_head_dim)
        spec = KernelSpec("bwd", "sm90", arch, dtype, sm90_head_dim, mask, softcap > 0, dropout=dropout)
        descending = deterministic and mask == "causal" and (nheads or nheads_k) == nheads_k
        return BwdPlan(spec, tile, (max(1, -(-seqlen_k // tile.block_n)), nheads_k, batch), window_left, window_right,
                       dq_turns_descending=descending)
    d_instance = instance_head_dim(head_dim)
    tile = bwd_tile(family, arch, d_instance)
    spec = KernelSpec("bwd", family, arch, dtype, d_instance, mask, softcap > 0, dropout=dropout)
    grid = (max(1, -(-seqlen_k // tile.block_n)) * tile.d_slices, nheads_k, batch)
    return BwdPlan(spec, tile, grid, window_left, window_right)


def sm90_bwd_instance_head_dim(head_dim: int) -> int | None:
    """The sm90 backward instance that serves ``head_dim``: the smallest of
    matrix.SM90_BWD_HEAD_DIMS that holds it (bwd_sm90.cuh: the TMA zero-fills the columns past the
    call's and drops the dQ tile's), None above the largest."""
    return next((d for d in matrix.SM90_BWD_HEAD_DIMS if head_dim <= d), None)


def sm90_bwd_covers(*, head_dim: int) -> bool:
    """Whether the sm90 backward has an instance for a call the TMA can read: any head dim up to
    the largest of matrix.SM90_BWD_HEAD_DIMS, any mask, softcap or not, ALiBi, GQA, dropout."""
    return sm90_bwd_instance_head_dim(head_dim) is not None


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
        deterministic=deterministic,
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
        dq_turns_descending=int(plan.dq_turns_descending),
    )
    for prefix, t in (("q", q), ("k", k), ("v", v), ("do", dout), ("dk", dk_out), ("dv", dv_out)):
        values.update({f"{prefix}_{n}_stride": s for n, s in zip(("batch", "row", "head"), row_strides(t))})
    threads = ROW_KERNEL_WARPS * 32
    execute.launch_kernel(pre, 0, threads, row_grid, row_params, index)
    # Keys that no query sees still get dK = dV = 0: the main kernel writes every key row it owns.
    packed = params_mod.pack(params_mod.BWD_LAYOUT, values)
    if spec.family == "sm90":  # the TMA maps of Q, K, V, dO and the dQ buffer before the BwdParams
        packed = tma.sm90_bwd_params(q, k, v, dout, dq_accum, plan.tile.block_m, plan.tile.block_n, packed)
    execute.launch_kernel(spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index)
    execute.launch_kernel(post, 0, threads, row_grid, row_params, index)
    if dk_out is not dk:
        dk.copy_(dk_out)
    if dv_out is not dv:
        dv.copy_(dv_out)
