"""The public forward API, a drop-in for flash_attn 2.x's ``flash_attn_func`` family."""
from __future__ import annotations

import math
import numbers

import torch

from .. import config
from . import params as params_mod
from .dispatch import FwdPlan, plan_fwd
from .launch import get_kernel

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_GRID_YZ_LIMIT = 65535


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, head_dim), got shape "
                f"{tuple(t.shape)}"
            )
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, _, nheads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch {batch} like q, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have head_dim {head_dim} like q, got {k.shape[3]}")
    if head_dim % 8 != 0 or not 8 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {_MAX_HEAD_DIM}], got {head_dim}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value "
            f"heads ({nheads_k})"
        )
    if batch > _GRID_YZ_LIMIT:
        raise ValueError(f"batch must be at most {_GRID_YZ_LIMIT}, got {batch}")


def _check_options(dropout_p, softmax_scale, window_size, softcap, num_splits) -> None:
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        raise NotImplementedError("dropout_p > 0 is not supported yet (the backward issue adds dropout)")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or not math.isfinite(softmax_scale) or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, numbers.Integral) and w >= -1 for w in window_size)
    ):
        raise ValueError(f"window_size must be a pair of integers >= -1 (-1 = infinite), got {window_size!r}")
    if not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    if not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an integer >= 0 (0 = automatic), got {num_splits!r}")
    if num_splits > 1:
        raise NotImplementedError("num_splits > 1 (split-KV) is not supported yet; use 0 or 1")


def _check_alibi(alibi_slopes, q: torch.Tensor) -> None:
    if alibi_slopes is None:
        return
    batch, _, nheads, _ = q.shape
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on {q.device} like q, got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.stride(-1) != 1:
        raise ValueError("alibi_slopes must have a contiguous last dimension")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Kernels copy 16-byte chunks: the base and every stride but the last must be 8-element aligned."""
    if t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def _fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa):
    """Validated forward: returns (out, softmax_lse)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return out, lse
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    plan: FwdPlan = plan_fwd(
        dtype=q.dtype, head_dim=head_dim, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        nheads=nheads, nheads_k=nheads_k, causal=causal, window_size=tuple(window_size),
        softcap=float(softcap), pack_gqa=pack_gqa,
        device_capability=torch.cuda.get_device_capability(device_index),
        family=config.forced_family(),
    )
    if plan.grid[1] > _GRID_YZ_LIMIT:
        raise ValueError(f"nheads must be at most {_GRID_YZ_LIMIT}, got {plan.grid[1]}")
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    log2e = 1.4426950408889634
    has_softcap = softcap > 0
    if alibi_slopes is not None:
        alibi_ptr = alibi_slopes.data_ptr()
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    else:
        alibi_ptr, alibi_batch_stride = 0, 0
    packed = params_mod.pack_fwd_values(
        q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=out.data_ptr(),
        lse_ptr=lse.data_ptr(), alibi_slopes_ptr=alibi_ptr,
        q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), o_strides=out.stride(),
        alibi_batch_stride=alibi_batch_stride,
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
        head_dim=head_dim, window_left=plan.window_left, window_right=plan.window_right,
        qhead_per_khead=nheads // nheads_k,
        scale_log2=log2e if has_softcap else softmax_scale * log2e,
        softmax_scale=softmax_scale,
        softcap_scale=softmax_scale / softcap if has_softcap else 0.0,
        softcap=float(softcap),
        alibi_scale=1.0 if has_softcap else 1.0 / softmax_scale,
    )
    kernel = get_kernel(plan.spec, plan.smem_bytes, plan.tile.num_threads)
    with torch.cuda.device(device_index):
        kernel.prepare(device_index)
        kernel.launch(plan.grid, torch.cuda.current_stream(device_index).cuda_stream, packed)
    return out, lse


class _FlashAttnForwardOnly(torch.autograd.Function):
    """Autograd node for inputs that require grad, until the backward pass exists."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa):
        out, lse = _fwd(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, pack_gqa)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("flashgen has no backward pass yet (tracked by the backward issue)")


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """Attention over q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d).

    flash_attn 2.x semantics. Returns ``out``, or ``(out, softmax_lse, None)`` when
    ``return_attn_probs`` (softmax_lse: float32 (batch, nheads, seqlen_q), natural log).
    """
    _check_qkv(q, k, v)
    _check_options(dropout_p, softmax_scale, window_size, softcap, num_splits)
    _check_alibi(alibi_slopes, q)
    if pack_gqa not in (None, True, False):
        raise ValueError(f"pack_gqa must be None (automatic), True or False, got {pack_gqa!r}")
    args = (q, k, v, softmax_scale, bool(causal), tuple(window_size), float(softcap), alibi_slopes, pack_gqa)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _FlashAttnForwardOnly.apply(*args)
    else:
        out, lse = _fwd(*args)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """qkv (batch, seqlen, 3, nheads, d)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, head_dim), got {tuple(qkv.shape)}")
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, pack_gqa=None, num_splits=1,
):
    """q (batch, seqlen_q, nheads, d), kv (batch, seqlen_k, 2, nheads_k, d)."""
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, head_dim), got {tuple(kv.shape)}")
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, pack_gqa, num_splits,
    )
