"""The public forward API, a drop-in for flash_attn 2.x's ``flash_attn_func`` family."""
from __future__ import annotations

import functools
import typing

import torch

from .. import config
from ..generator import matrix
from ..generator.spec import KernelSpec
from ..generator.tiles import ROW_KERNEL_WARPS
from . import params as params_mod
from . import validate
from .device import device_index, device_info
from .dispatch import FwdPlan, plan_fwd
from .launch import get_kernel


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Kernels copy 16-byte row chunks: a contiguous last dim, a 16-byte aligned base and strides
    of whole 8-element chunks. Inputs are validated to have a contiguous last dim; dout arrives in
    whatever layout autograd made (expanded from a sum, interleaved from a stack, ...)."""
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


_LOG2E = 1.4426950408889634
_COMBINE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _launch(spec, smem_bytes: int, num_threads: int, grid, params: bytes, index: int) -> None:
    kernel = get_kernel(spec, smem_bytes, num_threads)
    if torch.cuda.current_device() != index:
        with torch.cuda.device(index):
            kernel.prepare(index)
            kernel.launch(grid, torch.cuda.current_stream(index).cuda_stream, params)
    else:
        kernel.prepare(index)
        kernel.launch(grid, torch.cuda.current_stream(index).cuda_stream, params)


@functools.lru_cache(maxsize=64)
def _combine_spec(capability: tuple[int, int], dtype: torch.dtype) -> KernelSpec:
    arch = matrix.target_arch(*capability)
    return KernelSpec("combine", matrix.family_for(arch), arch, _COMBINE_DTYPES[dtype])


def launch_combine(out_partial, lse_partial, out, lse, *, partial_strides, lse_partial_strides,
                   out_strides, lse_strides, num_splits, batch, seqlen, nheads, head_dim) -> None:
    """Merge split-KV partials. Strides are (split, batch, row, head) for partials and
    (batch, row, head) for outputs, in elements."""
    index = device_index(out)
    spec = _combine_spec(device_info(index).capability, out.dtype)
    values = dict(
        out_partial_ptr=out_partial.data_ptr(), lse_partial_ptr=lse_partial.data_ptr(),
        out_ptr=out.data_ptr(), lse_ptr=lse.data_ptr(),
        num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim,
    )
    for prefix, names, strides in (
        ("out_partial", ("split", "batch", "row", "head"), partial_strides),
        ("lse_partial", ("split", "batch", "row", "head"), lse_partial_strides),
        ("out", ("batch", "row", "head"), out_strides),
        ("lse", ("batch", "row", "head"), lse_strides),
    ):
        values.update({f"{prefix}_{n}_stride": st for n, st in zip(names, strides)})
    rows = batch * seqlen * nheads
    grid = (-(-rows // ROW_KERNEL_WARPS), 1, 1)
    _launch(spec, 0, ROW_KERNEL_WARPS * 32, grid, params_mod.pack(params_mod.COMBINE_LAYOUT, values), index)


def run_fwd(
    plan: FwdPlan, *, q, k, v, out, lse, softmax_scale, softcap, alibi_slopes, seqlen_k,
    seqused_k=None, seqlen_k_new=0, leftpad_k=None, kv_batch_idx=None, block_table=None,
    page_size=1, kv_batch=None,
) -> None:
    """Launch a planned forward (and the split-KV combine) writing ``out`` and ``lse``."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k.shape[2]
    has_softcap = softcap > 0
    splits = plan.num_splits
    if splits > 1:
        # One allocation for both partial buffers (an allocation is several microseconds).
        o_elems = splits * batch * seqlen_q * nheads * head_dim
        scratch = torch.empty(o_elems + splits * batch * nheads * seqlen_q, dtype=torch.float32, device=q.device)
        oaccum = scratch[:o_elems].view(splits, batch, seqlen_q, nheads, head_dim)
        lseaccum = scratch[o_elems:].view(splits, batch, nheads, seqlen_q)
    else:
        oaccum = lseaccum = None
    packed = params_mod.pack_fwd_values(
        q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=out.data_ptr(),
        lse_ptr=lse.data_ptr(),
        alibi_slopes_ptr=alibi_slopes.data_ptr() if alibi_slopes is not None else 0,
        seqused_k_ptr=seqused_k.data_ptr() if seqused_k is not None else 0,
        leftpad_k_ptr=leftpad_k.data_ptr() if leftpad_k is not None else 0,
        kv_batch_idx_ptr=kv_batch_idx.data_ptr() if kv_batch_idx is not None else 0,
        block_table_ptr=block_table.data_ptr() if block_table is not None else 0,
        oaccum_ptr=oaccum.data_ptr() if oaccum is not None else 0,
        lseaccum_ptr=lseaccum.data_ptr() if lseaccum is not None else 0,
        q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), o_strides=out.stride(),
        alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
        block_table_batch_stride=block_table.stride(0) if block_table is not None else 0,
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, seqlen_k_new=seqlen_k_new,
        kv_batch=kv_batch if kv_batch is not None else k.shape[0], num_splits=splits,
        nheads=nheads, nheads_k=nheads_k, head_dim=head_dim,
        window_left=plan.window_left, window_right=plan.window_right,
        qhead_per_khead=nheads // nheads_k, page_size=page_size,
        scale_log2=_LOG2E if has_softcap else softmax_scale * _LOG2E,
        softmax_scale=softmax_scale,
        softcap_scale=softmax_scale / softcap if has_softcap else 0.0,
        softcap=float(softcap),
        alibi_scale=1.0 if has_softcap else 1.0 / softmax_scale,
    )
    index = device_index(q)
    _launch(plan.spec, plan.smem_bytes, plan.tile.num_threads, plan.grid, packed, index)
    if splits > 1:
        launch_combine(
            oaccum, lseaccum, out, lse,
            partial_strides=(batch * seqlen_q * nheads * head_dim, seqlen_q * nheads * head_dim, nheads * head_dim, head_dim),
            lse_partial_strides=(batch * nheads * seqlen_q, nheads * seqlen_q, 1, seqlen_q),
            out_strides=out.stride()[:3], lse_strides=(nheads * seqlen_q, 1, seqlen_q),
            num_splits=splits, batch=batch, seqlen=seqlen_q, nheads=nheads, head_dim=head_dim,
        )


def _fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa, num_splits):
    """Validated dense forward: returns (out, softmax_lse)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return out, lse
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=device_info(device_index(q)),
        num_splits=num_splits, family=config.forced_family(),
    )
    validate.grid(plan)
    run_fwd(plan, q=_aligned(q), k=_aligned(k), v=_aligned(v), out=out, lse=lse,
            softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=seqlen_k)
    return out, lse


# The forward and backward as torch.library custom ops: autograd connects them, and
# torch.compile(fullgraph=True) traces a model that calls flashgen without a graph break (the fake
# implementations give output shapes without touching a GPU).
@torch.library.custom_op("flashgen::fwd", mutates_args=(), device_types="cuda")
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    pack_gqa: typing.Optional[bool], num_splits: int, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    del deterministic  # a backward option, carried here so that autograd can hand it over
    return _fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes, pack_gqa, num_splits)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, pack_gqa,
              num_splits, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashgen::bwd", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: typing.Optional[torch.Tensor], deterministic: bool,
) -> None:
    from .backward import flash_bwd

    flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic)


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
              softcap, alibi_slopes, deterministic) -> None:
    return None


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _, _, deterministic = inputs
    out, lse = output
    # Slopes go through save_for_backward too, so an in-place change before backward is caught.
    ctx.save_for_backward(q, k, v, out, lse, *([alibi_slopes] if alibi_slopes is not None else []))
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse):
    del dlse  # lse is not differentiable
    q, k, v, out, lse, *alibi = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap, deterministic = ctx.options
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _bwd_op(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
            softcap, alibi[0] if alibi else None, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """Attention over q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d).

    flash_attn 2.x semantics. Returns ``out``, or ``(out, softmax_lse, None)`` when
    ``return_attn_probs`` (softmax_lse: float32 (batch, nheads, seqlen_q), natural log).
    """
    validate.fwd(q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, pack_gqa, num_splits)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    args = (q, k, v, float(softmax_scale), bool(causal), int(window_size[0]), int(window_size[1]),
            float(softcap), alibi_slopes, pack_gqa, int(num_splits))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad or torch.compiler.is_compiling():
        out, lse = _fwd_op(*args, bool(deterministic))
    else:
        # Eager inference skips the custom-op dispatch (tens of microseconds per call).
        out, lse = _fwd(*args[:5], args[5:7], *args[7:])
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """qkv (batch, seqlen, 3, nheads, d)."""
    validate.qkvpacked(qkv, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, pack_gqa, num_splits)
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """q (batch, seqlen_q, nheads, d), kv (batch, seqlen_k, 2, nheads_k, d)."""
    validate.kvpacked(q, kv, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, pack_gqa, num_splits)
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )
