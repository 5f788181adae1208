"""The public API, a drop-in for flash_attn 2.x's ``flash_attn_func`` family: its functions, the custom
ops and autograd. Executing a plan (Params packing, launching, the combine) is execute.py's."""
from __future__ import annotations

import typing

import torch

from .. import config
from . import backward, tma, tuning, validate
from .device import device_index, device_info
from .dispatch import FwdPlan, plan_fwd
from .dropout import NO_DROPOUT, draw_dropout, dropout_from_rng_state
from .execute import (HEAD_DIM_MULTIPLE, Capture, LaunchRecords, chunk_aligned, pad_head_dim, record_launches,
                      run_fwd, run_record)

# Launch records of dense forwards (execute.LaunchRecord), by call description: a repeated call skips
# planning and packing.
_fwd_records = LaunchRecords()


def _fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa, num_splits,
         dropout_p=0.0):
    """Validated dense forward: returns (out, softmax_lse, dropout state)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return out, lse, NO_DROPOUT
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    key = None
    if alibi_slopes is None and dropout_p <= 0:
        # Everything the plan and the packed params depend on but the pointers, whose alignment
        # (16 bytes: the kernels' chunks and the TMA) is checked per call; and which of q, k, v
        # are one tensor (self-attention on one buffer): such a call's record reads it once.
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, softmax_scale,
               causal, window_size, softcap, pack_gqa, num_splits, tuning.current(), config.forced_family(),
               k is q, v is q, v is k)
        record = _fwd_records.get(key)
        if record is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            run_record(record, (q, k, v, out, lse), q.device.index)
            return out, lse, NO_DROPOUT
    index = device_index(q)
    info = device_info(index)
    inputs = q, k, v
    q, k, v = chunk_aligned(q), chunk_aligned(k), chunk_aligned(v)
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=info,
        num_splits=num_splits, family=config.forced_family(), dropout=dropout_p > 0,
        # The TMA checks only where an sm90 instance could run (Hopper), not on every call.
        sm90=info.capability[0] == 9 and tma.compatible(q, k, v),
        kv_heads_adjacent=k.stride(2) == head_dim and v.stride(2) == head_dim, tuning=tuning.current(),
    )
    validate.grid(plan)
    dropout = draw_dropout(dropout_p, index)
    capture = Capture() if key is not None and _fwd_records.capacity else None
    run_fwd(plan, q=q, k=k, v=v, out=out, lse=lse,
            softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=seqlen_k,
            dropout=dropout, capture=capture)
    if capture is not None:
        # The caller's tensors (a copy of one: no record); one passed twice in its first slot only.
        q, k, v = inputs
        tensors = (q, None if k is q else k, None if v is q or v is k else v, out, lse)
        _fwd_records.keep(key, record_launches(capture, tensors))
    return out, lse, dropout


# The forward and backward as torch.library custom ops: autograd connects them, and
# torch.compile(fullgraph=True) traces a model that calls flashgen without a graph break (the fake
# implementations give output shapes without touching a GPU). rng_state (int64 [seed, offset], on
# the CPU) carries a dropout call's Philox state to its backward.
@torch.library.custom_op("flashgen::fwd", mutates_args=(), device_types="cuda")
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    pack_gqa: typing.Optional[bool], num_splits: int, dropout_p: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del deterministic  # a backward option, carried here so that autograd can hand it over
    out, lse, dropout = _fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                             pack_gqa, num_splits, dropout_p)
    return out, lse, dropout.rng_state()


@_fwd_op.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, pack_gqa,
              num_splits, dropout_p, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("flashgen::bwd", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: typing.Optional[torch.Tensor], dropout_p: float, rng_state: torch.Tensor, deterministic: bool,
) -> None:
    _bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right, softcap,
         alibi_slopes, dropout_p, rng_state, deterministic)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right, softcap,
         alibi_slopes, dropout_p, rng_state, deterministic) -> None:
    """The backward op's body: dq, dk, dv written in place."""
    backward.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic, dropout=dropout_from_rng_state(dropout_p, rng_state))


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
              softcap, alibi_slopes, dropout_p, rng_state, deterministic) -> None:
    return None


def _save_fwd(ctx, inputs, out, lse, rng_state) -> None:
    """What the backward needs of a forward (inputs: the forward op's)."""
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _, _, dropout_p, deterministic = inputs
    # Slopes go through save_for_backward too, so an in-place change before backward is caught.
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *([alibi_slopes] if alibi_slopes is not None else []))
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)
    # The autograd engine runs a CUDA backward on a thread of its own, where tuning.use's context
    # is not in force: the backward plans with the tuning of its forward.
    ctx.tuning = tuning.current()


def _fwd_setup_context(ctx, inputs, output):
    out, lse, rng_state = output
    _save_fwd(ctx, inputs, out, lse, rng_state)
    ctx.mark_non_differentiable(lse, rng_state)


def _fwd_grads(ctx, dout, bwd):
    """dq, dk, dv of a forward saved by _save_fwd, by ``bwd``: the backward op, or its body."""
    q, k, v, out, lse, rng_state, *alibi = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic = ctx.options
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with tuning.use(ctx.tuning):
        bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_left, window_right,
            softcap, alibi[0] if alibi else None, dropout_p, rng_state, deterministic)
    return dq, dk, dv


def _fwd_backward(ctx, dout, dlse, drng):
    del dlse, drng  # lse and rng_state are not differentiable
    return (*_fwd_grads(ctx, dout, _bwd_op), *(None,) * 10)


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _EagerAttention(torch.autograd.Function):
    """An eager call that needs gradients: the forward and backward ops' bodies under a plain
    autograd.Function, without the custom-op dispatch, which costs about as much host time per call
    as the bodies themselves (benchmarks/results/20261203-nvidia-h200-sm90-bwd-host-and-dq-banks).
    torch.compile traces the custom ops instead."""

    @staticmethod
    def forward(ctx, *inputs):  # the forward op's inputs
        q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, pack_gqa, num_splits, dropout_p, _ = inputs
        out, lse, dropout = _fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap,
                                 alibi_slopes, pack_gqa, num_splits, dropout_p)
        _save_fwd(ctx, inputs, out, lse, dropout.rng_state())
        ctx.mark_non_differentiable(lse)
        # No zero gradient filled in for lse (a kernel launch and an allocation per backward).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        del dlse  # lse is not differentiable
        if dout is None:  # out's gradient never materialized: nothing flows back
            return (None,) * 13
        # (Compiled autograd traces this backward: the op then.)
        return (*_fwd_grads(ctx, dout, _bwd_op if torch.compiler.is_compiling() else _bwd), *(None,) * 10)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """Attention over q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d).

    flash_attn 2.x semantics. ``dropout_p`` drops attention probabilities with a Philox mask drawn
    from PyTorch's CUDA generator (reproducible under torch.manual_seed; not inside CUDA graph
    capture). Returns ``out``, or ``(out, softmax_lse, None)`` when ``return_attn_probs``
    (softmax_lse: float32 (batch, nheads, seqlen_q), natural log; flashgen does not materialize
    the probabilities or the dropout pattern: flashgen.testing.dropout_keep_mask recomputes the
    pattern from the rng state).
    """
    window_size = validate.fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, pack_gqa, num_splits)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if head_dim % HEAD_DIM_MULTIPLE:
        q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
    args = (q, k, v, float(softmax_scale), bool(causal), *window_size, float(softcap), alibi_slopes, pack_gqa,
            int(num_splits))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # Eager calls skip the custom-op dispatch (its host time is about that of the call itself).
    if torch.compiler.is_compiling():
        out, lse, _ = _fwd_op(*args, float(dropout_p), bool(deterministic))
    elif needs_grad:
        out, lse = _EagerAttention.apply(*args, float(dropout_p), bool(deterministic))
    else:
        out, lse, _ = _fwd(*args[:5], window_size, *args[7:], float(dropout_p))
    if head_dim % HEAD_DIM_MULTIPLE:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """qkv (batch, seqlen, 3, nheads, d)."""
    window_size = validate.qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                     deterministic, return_attn_probs, pack_gqa, num_splits)
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """q (batch, seqlen_q, nheads, d), kv (batch, seqlen_k, 2, nheads_k, d)."""
    window_size = validate.kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, pack_gqa, num_splits)
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


# ---------------------------------------------------------------------------------------------
# Variable-length batches: sequences packed along one row dimension, delimited by cu_seqlens.


def _clamp_max_seqlens(max_seqlen_q: int, max_seqlen_k: int, total_q: int, capacity: int) -> tuple[int, int]:
    """No sequence has more rows than its tensor (the kernels clamp each one to it): a larger
    max_seqlen would only size the grid, the sm90 schedule or the backward's buffers for rows that
    do not exist. ``capacity``: the key rows (or the paged capacity)."""
    return min(max_seqlen_q, total_q), min(max_seqlen_k, capacity)


def _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size, softcap, alibi_slopes, block_table, seqused_q, seqused_k, pack_gqa, num_splits,
                dropout_p=0.0):
    """Validated varlen forward: returns (out (total_q, nheads, d), softmax_lse (nheads, total_q),
    dropout state)."""
    total_q, nheads, head_dim = q.shape
    nheads_k = k.shape[-2]
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    paged = block_table is not None
    if paged:
        page_size, capacity, kv_batch = k.shape[1], block_table.shape[1] * k.shape[1], k.shape[0]
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
    else:
        page_size, capacity, kv_batch = 1, k.shape[0], batch
    if config.check_inputs():
        validate.varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, capacity, paged,
                               block_table, page_size, k.shape[0], seqused_q, seqused_k)
    if total_q == 0 or nheads == 0 or max_seqlen_q == 0:
        lse.fill_(-float("inf"))
        out.zero_()
        return out, lse, NO_DROPOUT
    max_seqlen_q, max_seqlen_k = _clamp_max_seqlens(max_seqlen_q, max_seqlen_k, total_q, capacity)
    index = device_index(q)
    info = device_info(index)
    q, k, v = chunk_aligned(q), chunk_aligned(k), chunk_aligned(v)
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa, device=info, paged=paged,
        num_splits=num_splits, family=config.forced_family(), varlen=True, dropout=dropout_p > 0,
        varlen_uniform=seqused_q is None and seqused_k is None and not paged
        and total_q == batch * max_seqlen_q and capacity == batch * max_seqlen_k,
        sm90=info.capability[0] == 9 and tma.compatible(q, k, v), page_size=page_size if paged else 0,
        tuning=tuning.current(),
    )
    validate.grid(plan)
    dropout = draw_dropout(dropout_p, index)
    if seqused_q is not None and plan.num_splits == 1:
        # Rows past seqused_q belong to no sequence: the kernel does not write them.
        out.zero_()
        lse.fill_(-float("inf"))
    run_fwd(plan, q=q, k=k, v=v, out=out, lse=lse,
            softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, seqlen_k=capacity,
            seqused_k=seqused_k, block_table=block_table, page_size=page_size, kv_batch=kv_batch,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, dropout=dropout,
            max_seqlen_q=max_seqlen_q)
    return out, lse, dropout


@torch.library.custom_op("flashgen::varlen_fwd", mutates_args=(), device_types="cuda")
def _varlen_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    seqused_q: typing.Optional[torch.Tensor], seqused_k: typing.Optional[torch.Tensor],
    pack_gqa: typing.Optional[bool], num_splits: int, dropout_p: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del deterministic  # a backward option, carried for autograd
    out, lse, dropout = _varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        (window_left, window_right), softcap, alibi_slopes, None, seqused_q, seqused_k, pack_gqa, num_splits,
        dropout_p)
    return out, lse, dropout.rng_state()


@_varlen_fwd_op.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k, pack_gqa, num_splits,
                     dropout_p, deterministic):
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("flashgen::varlen_bwd", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _varlen_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: typing.Optional[torch.Tensor],
    seqused_q: typing.Optional[torch.Tensor], seqused_k: typing.Optional[torch.Tensor], dropout_p: float,
    rng_state: torch.Tensor, deterministic: bool,
) -> None:
    _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                dropout_p, rng_state, deterministic)


def _varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                dropout_p, rng_state, deterministic) -> None:
    """The varlen backward op's body: dq, dk, dv (total rows, heads, d) written in place."""
    max_seqlen_q, max_seqlen_k = _clamp_max_seqlens(max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    backward.flash_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
              dropout=dropout_from_rng_state(dropout_p, rng_state))


@_varlen_bwd_op.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, seqused_q, seqused_k,
                     dropout_p, rng_state, deterministic) -> None:
    return None


def _save_varlen_fwd(ctx, inputs, out, lse, rng_state) -> None:
    """What the backward needs of a varlen forward (inputs: the varlen forward op's)."""
    (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
     seqused_q, seqused_k, _, _, dropout_p, deterministic) = inputs
    optional = [t for t in (alibi_slopes, seqused_q, seqused_k) if t is not None]
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_q, cu_k, *optional)
    ctx.present = (alibi_slopes is not None, seqused_q is not None, seqused_k is not None)
    ctx.options = (max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic)
    ctx.tuning = tuning.current()  # as _save_fwd's


def _varlen_setup_context(ctx, inputs, output):
    out, lse, rng_state = output
    _save_varlen_fwd(ctx, inputs, out, lse, rng_state)
    ctx.mark_non_differentiable(lse, rng_state)


def _varlen_grads(ctx, dout, bwd):
    """dq, dk, dv of a varlen forward saved by _save_varlen_fwd, by ``bwd`` (as _fwd_grads)."""
    q, k, v, out, lse, rng_state, cu_q, cu_k, *optional = ctx.saved_tensors
    alibi_slopes, seqused_q, seqused_k = (optional.pop(0) if present else None for present in ctx.present)
    max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic = ctx.options
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with tuning.use(ctx.tuning):
        bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, seqused_q, seqused_k, dropout_p, rng_state, deterministic)
    return dq, dk, dv


def _varlen_backward(ctx, dout, dlse, drng):
    del dlse, drng  # lse and rng_state are not differentiable
    return (*_varlen_grads(ctx, dout, _varlen_bwd_op), *(None,) * 16)


_varlen_fwd_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _EagerVarlenAttention(torch.autograd.Function):
    """_EagerAttention's varlen counterpart."""

    @staticmethod
    def forward(ctx, *inputs):  # the varlen forward op's inputs
        (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
         seqused_q, seqused_k, pack_gqa, num_splits, dropout_p, _) = inputs
        out, lse, dropout = _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                        (window_left, window_right), softcap, alibi_slopes, None, seqused_q,
                                        seqused_k, pack_gqa, num_splits, dropout_p)
        _save_varlen_fwd(ctx, inputs, out, lse, dropout.rng_state())
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # as _EagerAttention's
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        del dlse  # lse is not differentiable
        if dout is None:
            return (None,) * 19
        bwd = _varlen_bwd_op if torch.compiler.is_compiling() else _varlen_bwd
        return (*_varlen_grads(ctx, dout, bwd), *(None,) * 16)


class _PagedVarlenFwd(torch.autograd.Function):
    """A paged varlen forward (block_table) whose inputs require grad: the forward runs, a backward
    through it raises (flash_attn 2 has no backward for paged keys either)."""

    @staticmethod
    def forward(ctx, *args):
        out, lse, _ = _varlen_fwd(*args)  # no dropout state: validation refuses dropout with block_table
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "block_table: a paged varlen call has no backward (paged keys are for inference); pass k/v as "
            "(total_k, nheads_k, head_dim) to train through it"
        )


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, seqused_q=None, seqused_k=None, pack_gqa=None, num_splits=1,
):
    """Attention over a batch of sequences packed without padding (flash_attn 2.x semantics, plus
    FA3's ``seqused_q/k``, ``pack_gqa`` and ``num_splits``).

    q (total_q, nheads, d); k/v (total_k, nheads_k, d), or with ``block_table`` (batch, max_pages)
    int32 a paged cache (num_pages, page_size, nheads_k, d) whose sequence b has the keys counted
    by cu_seqlens_k (or seqused_k). cu_seqlens_q/k: int32 (batch + 1,) cumulative lengths;
    max_seqlen_q/k: the longest sequences. Returns ``out`` (total_q, nheads, d), or
    ``(out, softmax_lse, None)`` with softmax_lse float32 (nheads, total_q). Rows past seqused_q
    come out as 0 with lse -inf. With cu_seqlens that do not end at total_q, or a max_seqlen below
    a real length, rows are left unwritten (wrong answers, never stray accesses);
    FLASHGEN_CHECK_INPUTS=1 reports such values.
    """
    window_size = validate.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
        pack_gqa, num_splits)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if head_dim % HEAD_DIM_MULTIPLE:  # paged: the pages are copied too, as flash_attn 2 does
        q, k, v = pad_head_dim(q), pad_head_dim(k), pad_head_dim(v)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if block_table is not None:
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "block_table: paged varlen calls are not traceable by torch.compile yet (no custom op takes a "
                "block table); call them outside the compiled region"
            )
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), bool(causal),
                window_size, float(softcap), alibi_slopes, block_table, seqused_q, seqused_k, pack_gqa,
                int(num_splits), float(dropout_p))
        if needs_grad:
            out, lse = _PagedVarlenFwd.apply(*args)
        else:
            out, lse, _ = _varlen_fwd(*args)
    else:
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale),
                bool(causal), *window_size, float(softcap), alibi_slopes, seqused_q, seqused_k, pack_gqa,
                int(num_splits))
        if torch.compiler.is_compiling():
            out, lse, _ = _varlen_fwd_op(*args, float(dropout_p), bool(deterministic))
        elif needs_grad:
            out, lse = _EagerVarlenAttention.apply(*args, float(dropout_p), bool(deterministic))
        else:
            out, lse, _ = _varlen_fwd(*args[:9], window_size, args[11], args[12], None, *args[13:], float(dropout_p))
    if head_dim % HEAD_DIM_MULTIPLE:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(
    qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """qkv (total, 3, nheads, d); cu_seqlens int32 (batch + 1,)."""
    window_size = validate.varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                            window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return flash_attn_varlen_func(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, nheads, d), kv (total_k, 2, nheads_k, d)."""
    validate.varlen_kvpacked(q, kv)
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )
