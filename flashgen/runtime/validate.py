"""Argument validation for the public API (interface.py, kvcache.py).

Every check that needs no GPU runs first (types, dtypes, ranks, shapes, options, the optional
tensors); "is a CUDA tensor" and "on q's device" run last. So a CPU tensor with otherwise valid
arguments gets exactly the CUDA-tensor error, and every other mistake is reported, and testable,
on a CPU-only machine.

Each error is a TypeError (wrong type or dtype), a ValueError (wrong value or shape) or a
NotImplementedError (dropout under graph capture), and its message starts with the argument's name, then says what is
accepted and what was given.

These run on every call: plain Python, no tensor ops, no device syncs (``kvcache_values``, opted
into with FLASHGEN_CHECK_INPUTS, is the exception; so is a ``window_size`` given as a CUDA tensor,
read once on the host). Exact-type tests come before the ``numbers`` ABCs, whose isinstance costs
about ten times as much.

The attention entry points return ``window_size`` as a tuple of two Python ints, the form the
custom ops take.
"""
from __future__ import annotations

import math
import numbers
import operator
import sys
import typing

import torch

from ..generator.spec import HEAD_DIMS
from .dispatch import GRID_YZ_LIMIT

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = HEAD_DIMS[-1]
MAX_COMBINE_SPLITS = 256  # kMaxSplits in templates/combine.cuh
COMBINE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT64_MAX = 2**63 - 1  # window sizes and num_splits pass through the custom op's int (int64) arguments

_QKV = "(batch, seqlen, nheads, head_dim)"


# ---------------------------------------------------------------------------------------------
# Building blocks


def _tensor(name: str, t, dtypes: tuple, ndim: int, layout: str) -> torch.Size:
    """Type, dtype and rank of a tensor argument; returns its shape."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        accepted = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise TypeError(f"{name} must be {accepted}, got {t.dtype}")
    shape = t.shape
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(shape)}")
    return shape


def _half(name: str, t, ndim: int = 4, layout: str = _QKV, q_dtype=None) -> torch.Size:
    """A float16/bfloat16 tensor (of q's dtype when ``q_dtype`` is given) with a contiguous last
    dimension; returns its shape. (_tensor's checks inlined: this runs for q, k and v of every call.)"""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    dtype = t.dtype
    if dtype is not q_dtype:  # dtypes are singletons
        if dtype not in HALF_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {dtype}")
        if q_dtype is not None:
            raise TypeError(f"{name} must have q's dtype {q_dtype}, got {dtype}")
    shape = t.shape
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(shape)}")
    if t.stride()[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")
    return shape


# The shape rules shared by the entry points: each test is written inline where it runs (a call
# per check would cost more than the check), each message here.

def _bad_head_dim(name: str, shape: torch.Size) -> ValueError:
    return ValueError(f"{name} must have a head_dim (last dimension) in [1, {MAX_HEAD_DIM}], got shape {tuple(shape)}")


def _bad_nheads_k(name: str, nheads_k: int, nheads: int, shape: torch.Size) -> ValueError:
    return ValueError(
        f"{name} must have a number of heads that divides q's ({nheads}), got {nheads_k} (shape {tuple(shape)})"
    )


def _bad_batch(name: str, batch: int) -> ValueError:
    return ValueError(f"{name} must have a batch of at most {GRID_YZ_LIMIT} (a CUDA grid dimension), got {batch}")


def _real(name: str, x, accepted: str) -> float:
    """x as a float (an int beyond float's range becomes +-inf); TypeError if not a real number."""
    if type(x) is float:
        return x
    if type(x) is not int and not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {x!r} ({type(x).__name__})")
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _not_integer(name: str, x, accepted: str) -> TypeError:
    return TypeError(f"{name} must be {accepted}, got {x!r} ({type(x).__name__})")


def _flag(name: str, x) -> None:
    """True or False (a numpy.bool_ too): anything else, a string such as "False" included, is an
    error rather than a truthiness."""
    if x is True or x is False:
        return
    numpy = sys.modules.get("numpy")  # imported by whoever made a numpy.bool_
    if numpy is None or not isinstance(x, numpy.bool_):
        raise TypeError(f"{name} must be True or False, got {x!r} ({type(x).__name__})")


_WINDOW_ACCEPTED = (
    "a pair (left, right) of integers in [-1, 2**63) (-1 = infinite): a tuple, a list or a 2-element integer tensor"
)


def _window(window_size) -> tuple[int, int]:
    """window_size as a tuple of two Python ints. A tensor (or numpy array) is read once on the host."""
    if type(window_size) is tuple and len(window_size) == 2:
        left, right = window_size
        if type(left) is int and type(right) is int and -1 <= left <= INT64_MAX and -1 <= right <= INT64_MAX:
            return window_size
    pair = window_size
    numpy = sys.modules.get("numpy")
    if isinstance(window_size, torch.Tensor) or (numpy is not None and isinstance(window_size, numpy.ndarray)):
        dtype = window_size.dtype
        integer = (not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool
                   if isinstance(window_size, torch.Tensor) else dtype.kind in "iu")
        if not integer:
            raise TypeError(f"window_size must be {_WINDOW_ACCEPTED}, got a {type(window_size).__name__} of {dtype}")
        if tuple(window_size.shape) != (2,):
            raise ValueError(f"window_size must be {_WINDOW_ACCEPTED}, got one of shape {tuple(window_size.shape)}")
        pair = window_size.tolist()
    elif not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be {_WINDOW_ACCEPTED}, got {window_size!r} ({type(window_size).__name__})")
    if len(pair) != 2:
        raise ValueError(f"window_size must be {_WINDOW_ACCEPTED}, got {window_size!r}")
    for w in pair:
        # bool is an Integral, but True is no window size; numpy integers are Integral.
        if type(w) is bool or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size must be {_WINDOW_ACCEPTED}, got {window_size!r}")
    left, right = operator.index(pair[0]), operator.index(pair[1])
    if not (-1 <= left <= INT64_MAX and -1 <= right <= INT64_MAX):
        raise ValueError(f"window_size must be {_WINDOW_ACCEPTED}, got {window_size!r}")
    return left, right


def _dropout(dropout_p) -> None:
    accepted = "a number in [0, 1)"
    p = _real("dropout_p", dropout_p, accepted)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be {accepted}, got {dropout_p!r}")
    if p > 0.0 and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            f"dropout_p must be 0 inside CUDA graph capture (the RNG offset is read on the host), got {dropout_p!r}"
        )


def _options(softmax_scale, window_size, softcap, num_splits, pack_gqa) -> tuple[int, int]:
    """The scalar options every attention entry point takes; returns window_size as two ints."""
    if softmax_scale is not None:
        accepted = "a positive finite number or None (1 / sqrt(head_dim))"
        if type(softmax_scale) is bool:  # a Real, but True is no scale
            raise TypeError(f"softmax_scale must be {accepted}, got {softmax_scale!r}")
        scale = _real("softmax_scale", softmax_scale, accepted)
        if not (scale > 0.0 and math.isfinite(scale)):
            raise ValueError(f"softmax_scale must be {accepted}, got {softmax_scale!r}")
    window = _window(window_size)
    accepted = "a finite number >= 0 (0 = off)"
    cap = _real("softcap", softcap, accepted)
    if not (cap >= 0.0 and math.isfinite(cap)):
        raise ValueError(f"softcap must be {accepted}, got {softcap!r}")
    accepted = "an integer in [0, 2**63) (0 = heuristic, 1 = no split)"
    if type(num_splits) is not int and not isinstance(num_splits, numbers.Integral):
        raise _not_integer("num_splits", num_splits, accepted)
    if not 0 <= num_splits <= INT64_MAX:
        raise ValueError(f"num_splits must be {accepted}, got {num_splits!r}")
    if pack_gqa is not None and pack_gqa is not True and pack_gqa is not False:
        raise TypeError(
            f"pack_gqa must be None (automatic), True or False, got {pack_gqa!r} ({type(pack_gqa).__name__})"
        )
    return window


def _alibi(alibi_slopes, batch: int, nheads: int) -> None:
    layout = f"({nheads},) or ({batch}, {nheads}) (per head, or per batch row and head)"
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes must be None or a torch.Tensor of shape {layout}, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype is not torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    shape = alibi_slopes.shape
    if shape != (nheads,) and shape != (batch, nheads):
        raise ValueError(f"alibi_slopes must have shape {layout}, got {tuple(shape)}")
    if alibi_slopes.stride()[-1] != 1 and nheads > 1:
        raise ValueError(f"alibi_slopes must have a contiguous last dimension, got strides {alibi_slopes.stride()}")


def _int32_vector(name: str, t, batch: int) -> None:
    shape = _tensor(name, t, (torch.int32,), 1, f"({batch},)")
    if shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},) (one entry per batch row), got {tuple(shape)}")
    if batch > 1 and t.stride()[0] != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()[0]}; pass {name}.contiguous()")


def _on_device(first: str, t, *others) -> None:
    """The device checks, last: ``t`` is a CUDA tensor and each (name, tensor or None) of ``others``
    lies on its device."""
    if not t.is_cuda:
        raise ValueError(f"{first} must be a CUDA tensor, got one on {t.device}")
    device = t.device
    for name, other in others:
        if other is not None and other.device != device:
            raise ValueError(f"{name} must be on {first}'s device {device}, got {other.device}")


# ---------------------------------------------------------------------------------------------
# Entry points


def _fwd_flags(causal, deterministic, return_attn_probs) -> None:
    _flag("causal", causal)
    _flag("deterministic", deterministic)
    _flag("return_attn_probs", return_attn_probs)


def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, pack_gqa, num_splits) -> tuple[int, int]:
    """flash_attn_func: q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d)."""
    q_shape = _half("q", q)
    k_shape = _half("k", k, q_dtype=q.dtype)
    v_shape = _half("v", v, q_dtype=q.dtype)
    batch, _, nheads, head_dim = q_shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _bad_head_dim("q", q_shape)
    if k_shape[0] != batch or k_shape[3] != head_dim:
        raise ValueError(
            f"k must have q's batch {batch} and head_dim {head_dim}: (batch, seqlen_k, nheads_k, head_dim), "
            f"got shape {tuple(k_shape)} for q {tuple(q_shape)}"
        )
    if k_shape[2] == 0 or nheads % k_shape[2]:
        raise _bad_nheads_k("k", k_shape[2], nheads, k_shape)
    if v_shape != k_shape:
        raise ValueError(f"v must have k's shape {tuple(k_shape)}, got {tuple(v_shape)}")
    if batch > GRID_YZ_LIMIT:
        raise _bad_batch("q", batch)
    _dropout(dropout_p)
    _fwd_flags(causal, deterministic, return_attn_probs)
    window = _options(softmax_scale, window_size, softcap, num_splits, pack_gqa)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, batch, nheads)
    _on_device("q", q, ("k", k), ("v", v), ("alibi_slopes", alibi_slopes))
    return window


def qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs, pack_gqa, num_splits) -> tuple[int, int]:
    """flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, nheads, d)."""
    layout = "(batch, seqlen, 3, nheads, head_dim)"
    shape = _half("qkv", qkv, 5, layout)
    if shape[2] != 3:
        raise ValueError(f"qkv must have shape {layout}, got {tuple(shape)}")
    if not 1 <= shape[4] <= MAX_HEAD_DIM:
        raise _bad_head_dim("qkv", shape)
    if shape[3] == 0:
        raise ValueError(f"qkv must have at least one head (shape[3]), got shape {tuple(shape)}")
    if shape[0] > GRID_YZ_LIMIT:
        raise _bad_batch("qkv", shape[0])
    _dropout(dropout_p)
    _fwd_flags(causal, deterministic, return_attn_probs)
    window = _options(softmax_scale, window_size, softcap, num_splits, pack_gqa)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, shape[0], shape[3])
    _on_device("qkv", qkv, ("alibi_slopes", alibi_slopes))
    return window


def kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_attn_probs, pack_gqa, num_splits) -> tuple[int, int]:
    """flash_attn_kvpacked_func: q (batch, seqlen_q, nheads, d), kv (batch, seqlen_k, 2, nheads_k, d)."""
    layout = "(batch, seqlen_k, 2, nheads_k, head_dim)"
    q_shape = _half("q", q)
    kv_shape = _half("kv", kv, 5, layout, q_dtype=q.dtype)
    batch, _, nheads, head_dim = q_shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _bad_head_dim("q", q_shape)
    if kv_shape[2] != 2:
        raise ValueError(f"kv must have shape {layout}, got {tuple(kv_shape)}")
    if kv_shape[0] != batch or kv_shape[4] != head_dim:
        raise ValueError(
            f"kv must have q's batch {batch} and head_dim {head_dim}: {layout}, got shape {tuple(kv_shape)} "
            f"for q {tuple(q_shape)}"
        )
    if kv_shape[3] == 0 or nheads % kv_shape[3]:
        raise _bad_nheads_k("kv", kv_shape[3], nheads, kv_shape)
    if batch > GRID_YZ_LIMIT:
        raise _bad_batch("q", batch)
    _dropout(dropout_p)
    _fwd_flags(causal, deterministic, return_attn_probs)
    window = _options(softmax_scale, window_size, softcap, num_splits, pack_gqa)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, batch, nheads)
    _on_device("q", q, ("kv", kv), ("alibi_slopes", alibi_slopes))
    return window


def _cu_seqlens(name: str, t, batch_plus_one: int | None) -> int:
    """cu_seqlens: int32 (batch + 1,), contiguous; returns batch."""
    layout = "(batch + 1,)" if batch_plus_one is None else f"({batch_plus_one},)"
    shape = _tensor(name, t, (torch.int32,), 1, layout)
    if shape[0] < 2 or (batch_plus_one is not None and shape[0] != batch_plus_one):
        raise ValueError(f"{name} must have shape {layout} with batch >= 1 (cumulative sequence lengths), got {tuple(shape)}")
    if t.stride()[0] != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()[0]}; pass {name}.contiguous()")
    return shape[0] - 1


def _max_seqlen(name: str, x) -> None:
    accepted = "an integer >= 0 (the longest sequence)"
    if type(x) is not int and not isinstance(x, numbers.Integral):
        raise _not_integer(name, x, accepted)
    if not 0 <= x < 2**31:
        raise ValueError(f"{name} must be {accepted}, below 2**31, got {x}")


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_q, seqused_k,
           pack_gqa, num_splits) -> tuple[int, int]:
    """flash_attn_varlen_func: q (total_q, nheads, d); k/v (total_k, nheads_k, d), or with
    ``block_table`` (batch, max_pages) int32 a paged cache (num_pages, page_size, nheads_k, d)."""
    q_shape = _half("q", q, 3, "(total_q, nheads, head_dim)")
    total_q, nheads, head_dim = q_shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _bad_head_dim("q", q_shape)
    batch = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    if batch > GRID_YZ_LIMIT:
        raise _bad_batch("cu_seqlens_q", batch)
    _cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch + 1)
    _max_seqlen("max_seqlen_q", max_seqlen_q)
    _max_seqlen("max_seqlen_k", max_seqlen_k)
    paged = block_table is not None
    kv_layout = "(num_pages, page_size, nheads_k, head_dim)" if paged else "(total_k, nheads_k, head_dim)"
    k_shape = _half("k", k, 4 if paged else 3, kv_layout, q_dtype=q.dtype)
    v_shape = _half("v", v, 4 if paged else 3, kv_layout, q_dtype=q.dtype)
    if k_shape[-1] != head_dim:
        raise ValueError(f"k must have q's head_dim {head_dim}: {kv_layout}, got shape {tuple(k_shape)}")
    if k_shape[-2] == 0 or nheads % k_shape[-2]:
        raise _bad_nheads_k("k", k_shape[-2], nheads, k_shape)
    if v_shape != k_shape:
        raise ValueError(f"v must have k's shape {tuple(k_shape)}, got {tuple(v_shape)}")
    if paged:
        table_shape = _tensor("block_table", block_table, (torch.int32,), 2, f"(batch={batch}, max_pages)")
        if table_shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch={batch}, max_pages), got {tuple(table_shape)}")
        if k_shape[1] < 1:
            raise ValueError(f"k must have a page size (shape[1]) >= 1 with block_table, got shape {tuple(k_shape)}")
    if seqused_q is not None:
        _int32_vector("seqused_q", seqused_q, batch)
    if seqused_k is not None:
        _int32_vector("seqused_k", seqused_k, batch)
    _dropout(dropout_p)
    if paged and dropout_p > 0:
        raise ValueError(f"dropout_p must be 0 with block_table (paged keys are for inference), got {dropout_p!r}")
    _fwd_flags(causal, deterministic, return_attn_probs)
    window = _options(softmax_scale, window_size, softcap, num_splits, pack_gqa)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, batch, nheads)
    _on_device("q", q, ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
               ("block_table", block_table), ("seqused_q", seqused_q), ("seqused_k", seqused_k),
               ("alibi_slopes", alibi_slopes))
    return window


def varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, return_attn_probs) -> tuple[int, int]:
    """flash_attn_varlen_qkvpacked_func: qkv (total, 3, nheads, d), cu_seqlens (batch + 1,)."""
    layout = "(total, 3, nheads, head_dim)"
    shape = _half("qkv", qkv, 4, layout)
    if shape[1] != 3:
        raise ValueError(f"qkv must have shape {layout}, got {tuple(shape)}")
    if not 1 <= shape[3] <= MAX_HEAD_DIM:
        raise _bad_head_dim("qkv", shape)
    batch = _cu_seqlens("cu_seqlens", cu_seqlens, None)
    if batch > GRID_YZ_LIMIT:
        raise _bad_batch("cu_seqlens", batch)
    _max_seqlen("max_seqlen", max_seqlen)
    _dropout(dropout_p)
    _fwd_flags(causal, deterministic, return_attn_probs)
    window = _options(softmax_scale, window_size, softcap, 1, None)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, batch, shape[2])
    _on_device("qkv", qkv, ("cu_seqlens", cu_seqlens), ("alibi_slopes", alibi_slopes))
    return window


def varlen_kvpacked(q, kv) -> None:
    """flash_attn_varlen_kvpacked_func's kv (the rest are flash_attn_varlen_func's)."""
    _half("q", q, 3, "(total_q, nheads, head_dim)")
    layout = "(total_k, 2, nheads_k, head_dim)"
    shape = _half("kv", kv, 4, layout, q_dtype=q.dtype)
    if shape[1] != 2:
        raise ValueError(f"kv must have shape {layout}, got {tuple(shape)}")


def varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, capacity, paged,
                  block_table, page_size, num_pages, seqused_q, seqused_k) -> None:
    """FLASHGEN_CHECK_INPUTS=1: the varlen checks that read device memory (they synchronize).
    Without them the kernels clamp every offset and length to the tensors, so bad values give
    wrong answers, never stray accesses."""
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, None if paged else capacity, max_seqlen_k)):
        values = cu.cpu()
        lengths = values[1:] - values[:-1]
        if values[0] != 0 or (lengths < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease, got {values.tolist()}")
        if total is not None and values[-1] != total:
            raise ValueError(f"{name} must end at the number of rows {total}, got {values[-1].item()}")
        if name == "cu_seqlens_k" and paged:
            continue  # checked with the block table below
        used = seqused_q if name == "cu_seqlens_q" else seqused_k
        if used is not None:
            counts = used.cpu()
            if (counts < 0).any() or (counts > lengths).any():
                raise ValueError(f"{name[3:].replace('seqlens', 'seqused')} must lie in [0, sequence length], got {counts.tolist()}")
            lengths = counts
        if lengths.numel() and lengths.max() > longest:
            raise ValueError(f"max_{name[3:].replace('seqlens', 'seqlen')} must be at least the longest sequence "
                             f"{lengths.max().item()}, got {longest}")
    if paged:
        lengths = (seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]).cpu()
        if (lengths < 0).any() or (lengths > capacity).any() or lengths.max() > max_seqlen_k:
            name = "seqused_k" if seqused_k is not None else "cu_seqlens_k"
            raise ValueError(f"{name} must give key lengths in [0, min(max_seqlen_k={max_seqlen_k}, {capacity})] "
                             f"(block_table's capacity), got {lengths.tolist()}")
        table = block_table.cpu()
        for b, used in enumerate(lengths.tolist()):
            needed = table[b, : -(-used // page_size)]
            if ((needed < 0) | (needed >= num_pages)).any():
                raise ValueError(f"block_table[{b}] holds page indices outside [0, {num_pages}): {needed.tolist()}")


class KVCacheCall(typing.NamedTuple):
    """What validate.kvcache works out about a flash_attn_with_kvcache call."""

    paged: bool
    page_size: int      # 1 without block_table
    capacity: int       # cache positions per batch row
    cache_batch: int    # rows of the cache (pages with block_table)
    seqlen_new: int     # rows appended (0 without k and v)
    rotary_dim: int     # 0 without rotary tables
    window_size: tuple[int, int]


def kvcache(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    return_softmax_lse, pack_gqa,
) -> KVCacheCall:
    """flash_attn_with_kvcache."""
    q_shape = _half("q", q)
    dtype = q.dtype
    cache_layout = (
        "(batch_cache, seqlen_cache, nheads_k, head_dim) or, paged, (num_pages, page_size, nheads_k, head_dim)"
    )
    k_cache_shape = _half("k_cache", k_cache, 4, cache_layout, q_dtype=dtype)
    v_cache_shape = _half("v_cache", v_cache, 4, cache_layout, q_dtype=dtype)
    batch, _, nheads, head_dim = q_shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _bad_head_dim("q", q_shape)
    if k_cache_shape[3] != head_dim:
        raise ValueError(f"k_cache must have q's head_dim {head_dim}, got shape {tuple(k_cache_shape)}")
    if nheads == 0:
        # The planner divides by nheads // nheads_k (and there would be nothing to attend).
        raise ValueError(f"q must have at least one head (shape[2]), got shape {tuple(q_shape)}")
    nheads_k = k_cache_shape[2]
    if nheads_k == 0 or nheads % nheads_k:
        raise _bad_nheads_k("k_cache", nheads_k, nheads, k_cache_shape)
    if v_cache_shape != k_cache_shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache_shape)}, got {tuple(v_cache_shape)}")
    _flag("causal", causal)
    _flag("rotary_interleaved", rotary_interleaved)
    _flag("return_softmax_lse", return_softmax_lse)
    window = _options(softmax_scale, window_size, softcap, num_splits, pack_gqa)
    if alibi_slopes is not None:
        _alibi(alibi_slopes, batch, nheads)

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx must be None with block_table (a paged cache has no batch rows)")
        table_shape = _tensor("block_table", block_table, (torch.int32,), 2, f"(batch={batch}, max_pages)")
        if table_shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch={batch}, max_pages), got {tuple(table_shape)}")
        cache_batch, page_size = k_cache_shape[0], k_cache_shape[1]  # cache_batch: the number of pages
        if page_size < 1:
            raise ValueError(
                f"k_cache must have a page size (shape[1]) >= 1 with block_table, got shape {tuple(k_cache_shape)}"
            )
        capacity = table_shape[1] * page_size
    else:
        page_size = 1
        cache_batch, capacity = k_cache_shape[0], k_cache_shape[1]
        if cache_batch_idx is not None:
            _int32_vector("cache_batch_idx", cache_batch_idx, batch)
        elif cache_batch < batch:
            raise ValueError(
                f"k_cache must have at least batch={batch} rows (shape[0]) without cache_batch_idx, got "
                f"{cache_batch}; pass cache_batch_idx to map batch rows to cache rows"
            )

    seqlen_new = 0
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"{missing} must be given with {given} (new keys and values are appended together), got None")
    if k is not None:
        k_shape = _half("k", k, q_dtype=dtype)
        v_shape = _half("v", v, q_dtype=dtype)
        if k_shape[0] != batch or k_shape[2] != nheads_k or k_shape[3] != head_dim:
            raise ValueError(
                f"k must have shape (batch={batch}, seqlen_new, nheads_k={nheads_k}, head_dim={head_dim}), "
                f"got {tuple(k_shape)}"
            )
        if v_shape != k_shape:
            raise ValueError(f"v must have k's shape {tuple(k_shape)}, got {tuple(v_shape)}")
        seqlen_new = k_shape[1]
        if seqlen_new > capacity:
            raise ValueError(
                f"k must have at most the cache's capacity {capacity} new rows, got shape {tuple(k_shape)}"
            )
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given when k and v are appended (where to write them), got None")

    if cache_seqlens is not None:
        if isinstance(cache_seqlens, torch.Tensor):
            _int32_vector("cache_seqlens", cache_seqlens, batch)
        else:
            accepted = (
                f"an int32 tensor of shape ({batch},) or an integer in [0, {capacity - seqlen_new}] "
                f"(capacity minus seqlen_new)"
            )
            if type(cache_seqlens) is not int and not isinstance(cache_seqlens, numbers.Integral):
                raise _not_integer("cache_seqlens", cache_seqlens, accepted)
            if not 0 <= cache_seqlens <= capacity - seqlen_new:
                raise ValueError(f"cache_seqlens must be {accepted}, got {cache_seqlens}")
    if cache_leftpad is not None:
        _int32_vector("cache_leftpad", cache_leftpad, batch)

    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"{missing} must be given with {given} (the rotary tables come in pairs), got None")
    if rotary_cos is not None:
        layout = "(seqlen_ro, rotary_dim / 2)"
        cos_shape = _tensor("rotary_cos", rotary_cos, ROTARY_DTYPES, 2, layout)
        sin_shape = _tensor("rotary_sin", rotary_sin, ROTARY_DTYPES, 2, layout)
        if sin_shape != cos_shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(cos_shape)}, got {tuple(sin_shape)}")
        rotary_dim = 2 * cos_shape[1]
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_cos must have shape {layout} with rotary_dim in [2, head_dim={head_dim}], got "
                f"{tuple(cos_shape)} (rotary_dim {rotary_dim})"
            )
        if cos_shape[0] < capacity:
            raise ValueError(
                f"rotary_cos must have a row for every cache position: at least {capacity} (the cache's "
                f"capacity), got shape {tuple(cos_shape)}"
            )

    _on_device(
        "q", q, ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
        ("cache_seqlens", cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None),
        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table),
        ("alibi_slopes", alibi_slopes), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
    )
    return KVCacheCall(paged, page_size, capacity, cache_batch, seqlen_new, rotary_dim, window)


def kvcache_values(cache_seqlens, seqlen_new, capacity, leftpad, block_table, page_size, num_pages,
                   cache_batch_idx, cache_batch) -> None:
    """FLASHGEN_CHECK_INPUTS=1: the KV cache's checks that read device memory (they synchronize).
    Without them the kernels still clamp every index, so bad values give wrong answers, never stray
    accesses."""
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
        # Two batch rows appending to one cache row write the same positions (a race); reading one
        # row for several batch rows is fine.
        if seqlen_new and idx.unique().numel() < idx.numel():
            raise ValueError(
                f"cache_batch_idx must not repeat a cache row when k and v are appended, got {idx.tolist()}"
            )


def combine(out_partial, lse_partial, out, out_dtype) -> None:
    """flash_attn_combine: out_partial (num_splits, batch, seqlen, nheads, d) and lse_partial
    (num_splits, batch, seqlen, nheads), both float32, any d; ``out`` and ``out_dtype`` optional."""
    layout = "(num_splits, batch, seqlen, nheads, head_dim)"
    shape = _tensor("out_partial", out_partial, (torch.float32,), 5, layout)
    lse_shape = _tensor("lse_partial", lse_partial, (torch.float32,), 4, "(num_splits, batch, seqlen, nheads)")
    num_splits, batch, seqlen, nheads, head_dim = shape
    if lse_shape != shape[:4]:
        raise ValueError(
            f"lse_partial must have shape {tuple(shape[:4])} (out_partial's without head_dim), got {tuple(lse_shape)}"
        )
    if not 1 <= num_splits <= MAX_COMBINE_SPLITS:
        raise ValueError(
            f"out_partial must hold between 1 and {MAX_COMBINE_SPLITS} splits (shape[0]), got shape {tuple(shape)}"
        )
    accepted = "float32, float16 or bfloat16"
    if out_dtype is not None and (not isinstance(out_dtype, torch.dtype) or out_dtype not in COMBINE_OUT_DTYPES):
        raise TypeError(f"out_dtype must be None or torch.{accepted}, got {out_dtype!r}")
    if out is not None:
        out_shape = _tensor("out", out, COMBINE_OUT_DTYPES, 4, "(batch, seqlen, nheads, head_dim)")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out must have out_dtype {out_dtype}, got {out.dtype}")
        if out_shape != (batch, seqlen, nheads, head_dim):
            raise ValueError(f"out must have shape {(batch, seqlen, nheads, head_dim)}, got {tuple(out_shape)}")
        strides = out.stride()
        # The kernel stores whole float4 chunks into out; a head dim that is not a multiple of 4
        # goes through a padded buffer copied into out (any layout).
        if head_dim % 4 == 0 and (strides[-1] != 1 or any(s % 4 for s in strides[:-1]) or out.data_ptr() % 16):
            raise ValueError(
                f"out must have a contiguous last dimension, other strides that are multiples of 4 and a "
                f"16-byte aligned start, got strides {strides} at address {out.data_ptr():#x}"
            )
    _on_device("out_partial", out_partial, ("lse_partial", lse_partial), ("out", out))


def grid(plan, k_name: str = "k") -> None:
    """The launch grid of a planned forward fits CUDA's limits (heads and batch x splits)."""
    heads, batch_splits = plan.grid[1], plan.grid[2]
    if heads > GRID_YZ_LIMIT:
        if plan.spec.pack_gqa:
            raise ValueError(f"{k_name} must have at most {GRID_YZ_LIMIT} heads (a CUDA grid dimension), got {heads}")
        raise ValueError(
            f"q must have at most {GRID_YZ_LIMIT} heads without PackGQA (a CUDA grid dimension), got {heads}; "
            f"with GQA, pass pack_gqa=True to launch one CTA row per KV head"
        )
    if batch_splits > GRID_YZ_LIMIT:
        raise ValueError(
            f"num_splits must keep batch * num_splits at most {GRID_YZ_LIMIT} (a CUDA grid dimension), got "
            f"{plan.num_splits} splits for a batch of {batch_splits // plan.num_splits}; pass a smaller num_splits"
        )
