"""Every public entry point rejects every bad argument with a TypeError / ValueError /
NotImplementedError whose message starts with the argument's name, before anything is launched.

The table runs on CPU tensors (CI): the device checks come last, so a CPU call with one mistake
gets that mistake's error, and a CPU call with none gets exactly the CUDA-tensor error. The GPU
tier runs the same table on CUDA tensors, and the checks only a GPU can reach (a tensor on the
wrong device, tensors on two GPUs).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing

import numpy as np
import pytest
import torch

import flashgen
from flashgen.runtime import validate

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
I32, I64 = torch.int32, torch.int64


# ---------------------------------------------------------------------------------------------
# Tensors are built when a case runs, on the device under test: a case holds recipes.


def z(*shape, dtype=F16):
    """A zero tensor of this shape."""
    return lambda device: torch.zeros(shape, dtype=dtype, device=device)


def strided_last(*shape, dtype=F16):
    """A tensor of this shape whose last dimension has stride 2."""
    return lambda device: torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device)[..., ::2]


def strided_vector(n, dtype=I32):
    """An (n,) tensor with stride 2."""
    return lambda device: torch.zeros(2 * n, dtype=dtype, device=device)[::2]


def misaligned(*shape, dtype=F16):
    """A contiguous tensor whose data starts one element past a 16-byte boundary."""
    return lambda device: torch.zeros(math.prod(shape) + 1, dtype=dtype, device=device)[1:].view(shape)


def tensor(values):
    """torch.tensor(values) on the device under test."""
    return lambda device: torch.tensor(values, device=device)


def build(kwargs: dict, device: str) -> dict:
    return {name: value(device) if callable(value) else value for name, value in kwargs.items()}


# Valid calls, one per entry point (paged KV cache as a second flash_attn_with_kvcache base).
# GQA 4/2, head_dim 64, fp16; the KV cache: 3 cache rows of 32 positions, 1 new token per row.
BASES: dict[str, tuple[typing.Callable, dict]] = {
    "func": (flashgen.flash_attn_func, dict(q=z(2, 16, 4, 64), k=z(2, 24, 2, 64), v=z(2, 24, 2, 64))),
    "qkvpacked": (flashgen.flash_attn_qkvpacked_func, dict(qkv=z(2, 16, 3, 4, 64))),
    "kvpacked": (flashgen.flash_attn_kvpacked_func, dict(q=z(2, 16, 4, 64), kv=z(2, 24, 2, 2, 64))),
    "kvcache": (flashgen.flash_attn_with_kvcache, dict(
        q=z(2, 1, 4, 64), k_cache=z(3, 32, 2, 64), v_cache=z(3, 32, 2, 64), k=z(2, 1, 2, 64), v=z(2, 1, 2, 64),
        rotary_cos=z(32, 16, dtype=F32), rotary_sin=z(32, 16, dtype=F32), cache_seqlens=z(2, dtype=I32),
        cache_batch_idx=z(2, dtype=I32), cache_leftpad=z(2, dtype=I32),
    )),
    "kvcache_paged": (flashgen.flash_attn_with_kvcache, dict(
        q=z(2, 1, 4, 64), k_cache=z(5, 8, 2, 64), v_cache=z(5, 8, 2, 64), k=z(2, 1, 2, 64), v=z(2, 1, 2, 64),
        cache_seqlens=z(2, dtype=I32), block_table=z(2, 4, dtype=I32),
    )),
    # Varlen: 2 sequences in q (10, 4, 64), k/v (12, 2, 64); paged: 5 pages of 8, block_table (2, 4).
    "varlen": (flashgen.flash_attn_varlen_func, dict(
        q=z(10, 4, 64), k=z(12, 2, 64), v=z(12, 2, 64), cu_seqlens_q=z(3, dtype=I32), cu_seqlens_k=z(3, dtype=I32),
        max_seqlen_q=6, max_seqlen_k=8, seqused_q=z(2, dtype=I32), seqused_k=z(2, dtype=I32),
    )),
    "varlen_paged": (flashgen.flash_attn_varlen_func, dict(
        q=z(10, 4, 64), k=z(5, 8, 2, 64), v=z(5, 8, 2, 64), cu_seqlens_q=z(3, dtype=I32),
        cu_seqlens_k=z(3, dtype=I32), max_seqlen_q=6, max_seqlen_k=30, block_table=z(2, 4, dtype=I32),
    )),
    "varlen_qkvpacked": (flashgen.flash_attn_varlen_qkvpacked_func, dict(
        qkv=z(10, 3, 4, 64), cu_seqlens=z(3, dtype=I32), max_seqlen=6)),
    "varlen_kvpacked": (flashgen.flash_attn_varlen_kvpacked_func, dict(
        q=z(10, 4, 64), kv=z(12, 2, 2, 64), cu_seqlens_q=z(3, dtype=I32), cu_seqlens_k=z(3, dtype=I32),
        max_seqlen_q=6, max_seqlen_k=8)),
    "combine": (flashgen.flash_attn_combine, dict(
        out_partial=z(3, 2, 5, 4, 64, dtype=F32), lse_partial=z(3, 2, 5, 4, dtype=F32),
        out=z(2, 5, 4, 64), out_dtype=F16,
    )),
}
# The argument whose device the others must share: the one named by the CUDA-tensor error.
FIRST_TENSOR = {"func": "q", "qkvpacked": "qkv", "kvpacked": "q", "kvcache": "q", "kvcache_paged": "q",
                "combine": "out_partial", "varlen": "q", "varlen_paged": "q", "varlen_qkvpacked": "qkv",
                "varlen_kvpacked": "q"}


@dataclasses.dataclass(frozen=True)
class Bad:
    """One bad call: ``base`` with ``changes`` applied must raise ``error`` naming ``arg``."""

    base: str
    what: str
    error: type
    arg: str
    changes: dict

    @property
    def id(self) -> str:
        return f"{self.base}-{self.what}"


def bad(base, what, error, arg, **changes) -> Bad:
    return Bad(base, what, error, arg, changes)


def option_cases(base: str) -> list[Bad]:
    """The scalar options every attention entry point takes (dropout_p: not the KV cache)."""
    cases = [
        bad(base, "softmax_scale-zero", ValueError, "softmax_scale", softmax_scale=0.0),
        bad(base, "softmax_scale-negative", ValueError, "softmax_scale", softmax_scale=-0.125),
        bad(base, "softmax_scale-inf", ValueError, "softmax_scale", softmax_scale=math.inf),
        bad(base, "softmax_scale-nan", ValueError, "softmax_scale", softmax_scale=math.nan),
        bad(base, "softmax_scale-str", TypeError, "softmax_scale", softmax_scale="0.1"),
        bad(base, "softmax_scale-bool", TypeError, "softmax_scale", softmax_scale=True),
        bad(base, "window-left-below-minus-1", ValueError, "window_size", window_size=(-2, -1)),
        bad(base, "window-right-below-minus-1", ValueError, "window_size", window_size=(16, -5)),
        bad(base, "window-past-int64", ValueError, "window_size", window_size=(2**63, 0)),
        bad(base, "window-one-value", ValueError, "window_size", window_size=(16,)),
        bad(base, "window-three-values", ValueError, "window_size", window_size=(1, 2, 3)),
        bad(base, "window-float", TypeError, "window_size", window_size=(16.0, 0)),
        bad(base, "window-int", TypeError, "window_size", window_size=16),
        bad(base, "window-none", TypeError, "window_size", window_size=None),
        bad(base, "window-str", TypeError, "window_size", window_size="ab"),
        bad(base, "window-bool", TypeError, "window_size", window_size=(True, 0)),
        bad(base, "window-numpy-bool", TypeError, "window_size", window_size=(0, np.bool_(False))),
        bad(base, "window-numpy-float", TypeError, "window_size", window_size=np.array([4.0, 0.0])),
        bad(base, "window-float-tensor", TypeError, "window_size", window_size=tensor([4.0, 0.0])),
        bad(base, "window-bool-tensor", TypeError, "window_size", window_size=tensor([True, False])),
        bad(base, "window-tensor-three-values", ValueError, "window_size", window_size=tensor([1, 2, 3])),
        bad(base, "window-tensor-2d", ValueError, "window_size", window_size=tensor([[1, 2]])),
        bad(base, "window-tensor-below-minus-1", ValueError, "window_size", window_size=tensor([-2, 0])),
        bad(base, "window-tensor-elements", TypeError, "window_size",
            window_size=lambda d: tuple(torch.tensor([3, 0], device=d))),
        bad(base, "softcap-negative", ValueError, "softcap", softcap=-1.0),
        bad(base, "softcap-inf", ValueError, "softcap", softcap=math.inf),
        bad(base, "softcap-nan", ValueError, "softcap", softcap=math.nan),
        bad(base, "softcap-none", TypeError, "softcap", softcap=None),
        bad(base, "num_splits-negative", ValueError, "num_splits", num_splits=-1),
        bad(base, "num_splits-past-int64", ValueError, "num_splits", num_splits=2**63),
        bad(base, "num_splits-float", TypeError, "num_splits", num_splits=2.0),
        bad(base, "num_splits-none", TypeError, "num_splits", num_splits=None),
        bad(base, "pack_gqa-str", TypeError, "pack_gqa", pack_gqa="yes"),
        bad(base, "pack_gqa-int", TypeError, "pack_gqa", pack_gqa=1),
        bad(base, "alibi-fp16", TypeError, "alibi_slopes", alibi_slopes=z(4, dtype=F16)),
        bad(base, "alibi-int32", TypeError, "alibi_slopes", alibi_slopes=z(4, dtype=I32)),
        bad(base, "alibi-list", TypeError, "alibi_slopes", alibi_slopes=[0.5] * 4),
        bad(base, "alibi-too-few-heads", ValueError, "alibi_slopes", alibi_slopes=z(3, dtype=F32)),
        bad(base, "alibi-wrong-batch", ValueError, "alibi_slopes", alibi_slopes=z(3, 4, dtype=F32)),
        bad(base, "alibi-3d", ValueError, "alibi_slopes", alibi_slopes=z(2, 4, 1, dtype=F32)),
        bad(base, "alibi-strided", ValueError, "alibi_slopes", alibi_slopes=strided_last(4, dtype=F32)),
    ]
    flags = ("causal", "rotary_interleaved", "return_softmax_lse") if base == "kvcache" else (
        "causal", "deterministic", "return_attn_probs")
    for flag in flags:
        # Each of these is truthy or falsy: taken as a flag, "False" would turn the option on.
        for what, value in (("str", "False"), ("none", None), ("int", 1), ("float", 0.0), ("tensor", tensor(True))):
            cases.append(bad(base, f"{flag}-{what}", TypeError, flag, **{flag: value}))
    if base in ("varlen_qkvpacked", "varlen_kvpacked"):  # flash_attn's packed varlen API: no FA3 options
        cases = [c for c in cases if c.arg not in ("num_splits", "pack_gqa")]
    if base != "kvcache":
        cases += [
            bad(base, "dropout-one", ValueError, "dropout_p", dropout_p=1.0),
            bad(base, "dropout-negative", ValueError, "dropout_p", dropout_p=-0.1),
            bad(base, "dropout-nan", ValueError, "dropout_p", dropout_p=math.nan),
            bad(base, "dropout-str", TypeError, "dropout_p", dropout_p="0"),
        ]
    return cases


BAD = [
    # flash_attn_func: q (2, 16, 4, 64), k/v (2, 24, 2, 64)
    bad("func", "q-list", TypeError, "q", q=[[0.0]]),
    bad("func", "q-fp32", TypeError, "q", q=z(2, 16, 4, 64, dtype=F32)),
    bad("func", "q-fp64", TypeError, "q", q=z(2, 16, 4, 64, dtype=torch.float64)),
    bad("func", "q-int32", TypeError, "q", q=z(2, 16, 4, 64, dtype=I32)),
    bad("func", "k-fp32", TypeError, "k", k=z(2, 24, 2, 64, dtype=F32)),
    bad("func", "k-bf16-q-fp16", TypeError, "k", k=z(2, 24, 2, 64, dtype=BF16)),
    bad("func", "v-bf16-q-fp16", TypeError, "v", v=z(2, 24, 2, 64, dtype=BF16)),
    bad("func", "v-none", TypeError, "v", v=None),
    bad("func", "q-3d", ValueError, "q", q=z(2, 16, 256)),
    bad("func", "k-5d", ValueError, "k", k=z(2, 24, 2, 1, 64)),
    bad("func", "v-3d", ValueError, "v", v=z(2, 24, 128)),
    bad("func", "head_dim-264", ValueError, "q", q=z(2, 16, 4, 264), k=z(2, 24, 2, 264), v=z(2, 24, 2, 264)),
    bad("func", "head_dim-0", ValueError, "q", q=z(2, 16, 4, 0), k=z(2, 24, 2, 0), v=z(2, 24, 2, 0)),
    bad("func", "nheads-not-multiple", ValueError, "k", k=z(2, 24, 3, 64), v=z(2, 24, 3, 64)),
    bad("func", "nheads_k-zero", ValueError, "k", k=z(2, 24, 0, 64), v=z(2, 24, 0, 64)),
    bad("func", "k-batch", ValueError, "k", k=z(3, 24, 2, 64), v=z(3, 24, 2, 64)),
    bad("func", "k-head_dim", ValueError, "k", k=z(2, 24, 2, 128), v=z(2, 24, 2, 128)),
    bad("func", "v-batch", ValueError, "v", v=z(1, 24, 2, 64)),
    bad("func", "v-seqlen", ValueError, "v", v=z(2, 23, 2, 64)),
    bad("func", "v-heads", ValueError, "v", v=z(2, 24, 1, 64)),
    bad("func", "v-head_dim", ValueError, "v", v=z(2, 24, 2, 128)),
    bad("func", "q-strided-last-dim", ValueError, "q", q=strided_last(2, 16, 4, 64)),
    bad("func", "k-strided-last-dim", ValueError, "k", k=strided_last(2, 24, 2, 64)),
    bad("func", "v-strided-last-dim", ValueError, "v", v=strided_last(2, 24, 2, 64)),
    bad("func", "batch-over-grid-limit", ValueError, "q",
        q=z(65536, 1, 1, 8), k=z(65536, 1, 1, 8), v=z(65536, 1, 1, 8)),
    *option_cases("func"),
    # flash_attn_qkvpacked_func: qkv (2, 16, 3, 4, 64)
    bad("qkvpacked", "qkv-tuple", TypeError, "qkv", qkv=(1, 2, 3)),
    bad("qkvpacked", "qkv-fp32", TypeError, "qkv", qkv=z(2, 16, 3, 4, 64, dtype=F32)),
    bad("qkvpacked", "qkv-int64", TypeError, "qkv", qkv=z(2, 16, 3, 4, 64, dtype=I64)),
    bad("qkvpacked", "qkv-4d", ValueError, "qkv", qkv=z(2, 16, 12, 64)),
    bad("qkvpacked", "qkv-two-parts", ValueError, "qkv", qkv=z(2, 16, 2, 4, 64)),
    bad("qkvpacked", "head_dim-264", ValueError, "qkv", qkv=z(2, 16, 3, 4, 264)),
    bad("qkvpacked", "head_dim-0", ValueError, "qkv", qkv=z(2, 16, 3, 4, 0)),
    bad("qkvpacked", "no-heads", ValueError, "qkv", qkv=z(2, 16, 3, 0, 64)),
    bad("qkvpacked", "qkv-strided-last-dim", ValueError, "qkv", qkv=strided_last(2, 16, 3, 4, 64)),
    bad("qkvpacked", "batch-over-grid-limit", ValueError, "qkv", qkv=z(65536, 1, 3, 1, 8)),
    *option_cases("qkvpacked"),
    # flash_attn_kvpacked_func: q (2, 16, 4, 64), kv (2, 24, 2, 2, 64)
    bad("kvpacked", "q-fp32", TypeError, "q", q=z(2, 16, 4, 64, dtype=F32)),
    bad("kvpacked", "kv-fp32", TypeError, "kv", kv=z(2, 24, 2, 2, 64, dtype=F32)),
    bad("kvpacked", "kv-bf16-q-fp16", TypeError, "kv", kv=z(2, 24, 2, 2, 64, dtype=BF16)),
    bad("kvpacked", "kv-none", TypeError, "kv", kv=None),
    bad("kvpacked", "kv-4d", ValueError, "kv", kv=z(2, 24, 4, 64)),
    bad("kvpacked", "kv-three-parts", ValueError, "kv", kv=z(2, 24, 3, 2, 64)),
    bad("kvpacked", "kv-batch", ValueError, "kv", kv=z(3, 24, 2, 2, 64)),
    bad("kvpacked", "kv-head_dim", ValueError, "kv", kv=z(2, 24, 2, 2, 128)),
    bad("kvpacked", "nheads-not-multiple", ValueError, "kv", kv=z(2, 24, 2, 3, 64)),
    bad("kvpacked", "head_dim-300", ValueError, "q", q=z(2, 16, 4, 300), kv=z(2, 24, 2, 2, 300)),
    bad("kvpacked", "kv-strided-last-dim", ValueError, "kv", kv=strided_last(2, 24, 2, 2, 64)),
    bad("kvpacked", "batch-over-grid-limit", ValueError, "q", q=z(65536, 1, 1, 8), kv=z(65536, 1, 2, 1, 8)),
    *option_cases("kvpacked"),
    # flash_attn_with_kvcache: q (2, 1, 4, 64), cache (3, 32, 2, 64), k/v (2, 1, 2, 64), rotary (32, 16)
    bad("kvcache", "q-fp32", TypeError, "q", q=z(2, 1, 4, 64, dtype=F32)),
    bad("kvcache", "q-int8", TypeError, "q", q=z(2, 1, 4, 64, dtype=torch.int8)),
    bad("kvcache", "q-3d", ValueError, "q", q=z(2, 4, 64)),
    bad("kvcache", "q-strided-last-dim", ValueError, "q", q=strided_last(2, 1, 4, 64)),
    bad("kvcache", "head_dim-264", ValueError, "q", q=z(2, 1, 4, 264), k_cache=z(3, 32, 2, 264),
        v_cache=z(3, 32, 2, 264), k=z(2, 1, 2, 264), v=z(2, 1, 2, 264), rotary_cos=None, rotary_sin=None),
    bad("kvcache", "head_dim-0", ValueError, "q", q=z(2, 1, 4, 0), k_cache=z(3, 32, 2, 0),
        v_cache=z(3, 32, 2, 0), k=z(2, 1, 2, 0), v=z(2, 1, 2, 0), rotary_cos=None, rotary_sin=None),
    bad("kvcache", "q-no-heads", ValueError, "q", q=z(2, 1, 0, 64)),
    bad("kvcache", "k_cache-fp32", TypeError, "k_cache", k_cache=z(3, 32, 2, 64, dtype=F32)),
    bad("kvcache", "k_cache-bf16-q-fp16", TypeError, "k_cache", k_cache=z(3, 32, 2, 64, dtype=BF16)),
    bad("kvcache", "v_cache-bf16-q-fp16", TypeError, "v_cache", v_cache=z(3, 32, 2, 64, dtype=BF16)),
    bad("kvcache", "k_cache-3d", ValueError, "k_cache", k_cache=z(3, 32, 128)),
    bad("kvcache", "k_cache-head_dim", ValueError, "k_cache", k_cache=z(3, 32, 2, 128), v_cache=z(3, 32, 2, 128)),
    bad("kvcache", "nheads-not-multiple", ValueError, "k_cache", k_cache=z(3, 32, 3, 64), v_cache=z(3, 32, 3, 64)),
    bad("kvcache", "v_cache-shape", ValueError, "v_cache", v_cache=z(3, 31, 2, 64)),
    bad("kvcache", "k_cache-strided-last-dim", ValueError, "k_cache", k_cache=strided_last(3, 32, 2, 64)),
    bad("kvcache", "k_cache-fewer-rows-than-batch", ValueError, "k_cache", k_cache=z(1, 32, 2, 64),
        v_cache=z(1, 32, 2, 64), cache_batch_idx=None),
    bad("kvcache", "k-without-v", ValueError, "v", v=None),
    bad("kvcache", "v-without-k", ValueError, "k", k=None),
    bad("kvcache", "k-fp32", TypeError, "k", k=z(2, 1, 2, 64, dtype=F32)),
    bad("kvcache", "v-bf16-q-fp16", TypeError, "v", v=z(2, 1, 2, 64, dtype=BF16)),
    bad("kvcache", "k-batch", ValueError, "k", k=z(3, 1, 2, 64), v=z(3, 1, 2, 64)),
    bad("kvcache", "k-heads", ValueError, "k", k=z(2, 1, 4, 64), v=z(2, 1, 4, 64)),
    bad("kvcache", "k-head_dim", ValueError, "k", k=z(2, 1, 2, 128), v=z(2, 1, 2, 128)),
    bad("kvcache", "v-seqlen", ValueError, "v", v=z(2, 2, 2, 64)),
    bad("kvcache", "k-strided-last-dim", ValueError, "k", k=strided_last(2, 1, 2, 64)),
    bad("kvcache", "k-longer-than-cache", ValueError, "k", k=z(2, 33, 2, 64), v=z(2, 33, 2, 64)),
    bad("kvcache", "k-without-cache_seqlens", ValueError, "cache_seqlens", cache_seqlens=None),
    bad("kvcache", "cache_seqlens-int64", TypeError, "cache_seqlens", cache_seqlens=z(2, dtype=I64)),
    bad("kvcache", "cache_seqlens-fp32", TypeError, "cache_seqlens", cache_seqlens=z(2, dtype=F32)),
    bad("kvcache", "cache_seqlens-batch", ValueError, "cache_seqlens", cache_seqlens=z(3, dtype=I32)),
    bad("kvcache", "cache_seqlens-2d", ValueError, "cache_seqlens", cache_seqlens=z(2, 1, dtype=I32)),
    bad("kvcache", "cache_seqlens-strided", ValueError, "cache_seqlens", cache_seqlens=strided_vector(2)),
    bad("kvcache", "cache_seqlens-int-past-capacity", ValueError, "cache_seqlens", cache_seqlens=32),
    bad("kvcache", "cache_seqlens-int-negative", ValueError, "cache_seqlens", cache_seqlens=-1),
    bad("kvcache", "cache_seqlens-float", TypeError, "cache_seqlens", cache_seqlens=3.0),
    bad("kvcache", "cache_seqlens-list", TypeError, "cache_seqlens", cache_seqlens=[3, 3]),
    bad("kvcache", "cache_batch_idx-int64", TypeError, "cache_batch_idx", cache_batch_idx=z(2, dtype=I64)),
    bad("kvcache", "cache_batch_idx-batch", ValueError, "cache_batch_idx", cache_batch_idx=z(3, dtype=I32)),
    bad("kvcache", "cache_batch_idx-strided", ValueError, "cache_batch_idx", cache_batch_idx=strided_vector(2)),
    bad("kvcache", "cache_leftpad-int64", TypeError, "cache_leftpad", cache_leftpad=z(2, dtype=I64)),
    bad("kvcache", "cache_leftpad-batch", ValueError, "cache_leftpad", cache_leftpad=z(1, dtype=I32)),
    bad("kvcache", "rotary_cos-without-sin", ValueError, "rotary_sin", rotary_sin=None),
    bad("kvcache", "rotary_sin-without-cos", ValueError, "rotary_cos", rotary_cos=None),
    bad("kvcache", "rotary_cos-int32", TypeError, "rotary_cos", rotary_cos=z(32, 16, dtype=I32)),
    bad("kvcache", "rotary_sin-fp64", TypeError, "rotary_sin", rotary_sin=z(32, 16, dtype=torch.float64)),
    bad("kvcache", "rotary_cos-1d", ValueError, "rotary_cos", rotary_cos=z(32, dtype=F32)),
    bad("kvcache", "rotary_sin-shape", ValueError, "rotary_sin", rotary_sin=z(32, 8, dtype=F32)),
    # rotary_dim is 2 * rotary_cos.shape[1]: even by construction, so "odd" cannot be passed.
    bad("kvcache", "rotary_dim-over-head_dim", ValueError, "rotary_cos",
        rotary_cos=z(32, 40, dtype=F32), rotary_sin=z(32, 40, dtype=F32)),
    bad("kvcache", "rotary_dim-zero", ValueError, "rotary_cos",
        rotary_cos=z(32, 0, dtype=F32), rotary_sin=z(32, 0, dtype=F32)),
    bad("kvcache", "rotary-tables-too-short", ValueError, "rotary_cos",
        rotary_cos=z(31, 16, dtype=F32), rotary_sin=z(31, 16, dtype=F32)),
    *option_cases("kvcache"),
    # flash_attn_with_kvcache, paged: 5 pages of 8, block_table (2, 4)
    bad("kvcache_paged", "block_table-int64", TypeError, "block_table", block_table=z(2, 4, dtype=I64)),
    bad("kvcache_paged", "block_table-list", TypeError, "block_table", block_table=[[0, 1, 2, 3]] * 2),
    bad("kvcache_paged", "block_table-1d", ValueError, "block_table", block_table=z(8, dtype=I32)),
    bad("kvcache_paged", "block_table-batch", ValueError, "block_table", block_table=z(3, 4, dtype=I32)),
    bad("kvcache_paged", "with-cache_batch_idx", ValueError, "cache_batch_idx", cache_batch_idx=z(2, dtype=I32)),
    bad("kvcache_paged", "page-size-zero", ValueError, "k_cache", k_cache=z(5, 0, 2, 64), v_cache=z(5, 0, 2, 64)),
    bad("kvcache_paged", "k-longer-than-pages", ValueError, "k", k=z(2, 33, 2, 64), v=z(2, 33, 2, 64)),
    bad("kvcache_paged", "cache_seqlens-int64", TypeError, "cache_seqlens", cache_seqlens=z(2, dtype=I64)),
    # flash_attn_varlen_func: q (10, 4, 64), k/v (12, 2, 64), cu_seqlens (3,)
    bad("varlen", "q-fp32", TypeError, "q", q=z(10, 4, 64, dtype=F32)),
    bad("varlen", "q-4d", ValueError, "q", q=z(2, 5, 4, 64)),
    bad("varlen", "q-strided-last-dim", ValueError, "q", q=strided_last(10, 4, 64)),
    bad("varlen", "head_dim-264", ValueError, "q", q=z(10, 4, 264), k=z(12, 2, 264), v=z(12, 2, 264)),
    bad("varlen", "head_dim-0", ValueError, "q", q=z(10, 4, 0), k=z(12, 2, 0), v=z(12, 2, 0)),
    bad("varlen", "k-bf16-q-fp16", TypeError, "k", k=z(12, 2, 64, dtype=BF16)),
    bad("varlen", "k-4d-without-block_table", ValueError, "k", k=z(2, 6, 2, 64), v=z(2, 6, 2, 64)),
    bad("varlen", "nheads-not-multiple", ValueError, "k", k=z(12, 3, 64), v=z(12, 3, 64)),
    bad("varlen", "k-head_dim", ValueError, "k", k=z(12, 2, 128), v=z(12, 2, 128)),
    bad("varlen", "v-shape", ValueError, "v", v=z(11, 2, 64)),
    bad("varlen", "cu_seqlens_q-int64", TypeError, "cu_seqlens_q", cu_seqlens_q=z(3, dtype=I64)),
    bad("varlen", "cu_seqlens_q-2d", ValueError, "cu_seqlens_q", cu_seqlens_q=z(3, 1, dtype=I32)),
    bad("varlen", "cu_seqlens_q-one-entry", ValueError, "cu_seqlens_q", cu_seqlens_q=z(1, dtype=I32)),
    bad("varlen", "cu_seqlens_q-strided", ValueError, "cu_seqlens_q", cu_seqlens_q=strided_vector(3)),
    bad("varlen", "batch-over-grid-limit", ValueError, "cu_seqlens_q", cu_seqlens_q=z(65537, dtype=I32)),
    bad("varlen", "cu_seqlens_k-int64", TypeError, "cu_seqlens_k", cu_seqlens_k=z(3, dtype=I64)),
    bad("varlen", "cu_seqlens_k-batch", ValueError, "cu_seqlens_k", cu_seqlens_k=z(4, dtype=I32)),
    bad("varlen", "max_seqlen_q-negative", ValueError, "max_seqlen_q", max_seqlen_q=-1),
    bad("varlen", "max_seqlen_q-float", TypeError, "max_seqlen_q", max_seqlen_q=6.0),
    bad("varlen", "max_seqlen_k-none", TypeError, "max_seqlen_k", max_seqlen_k=None),
    bad("varlen", "max_seqlen_k-2**31", ValueError, "max_seqlen_k", max_seqlen_k=2**31),
    bad("varlen", "seqused_q-int64", TypeError, "seqused_q", seqused_q=z(2, dtype=I64)),
    bad("varlen", "seqused_q-batch", ValueError, "seqused_q", seqused_q=z(3, dtype=I32)),
    bad("varlen", "seqused_k-strided", ValueError, "seqused_k", seqused_k=strided_vector(2)),
    bad("varlen", "block_table-int64", TypeError, "block_table", block_table=z(2, 4, dtype=I64),
        k=z(5, 8, 2, 64), v=z(5, 8, 2, 64)),
    *option_cases("varlen"),
    bad("varlen_paged", "k-3d-with-block_table", ValueError, "k", k=z(40, 2, 64), v=z(40, 2, 64)),
    bad("varlen_paged", "block_table-batch", ValueError, "block_table", block_table=z(3, 4, dtype=I32)),
    bad("varlen_paged", "block_table-1d", ValueError, "block_table", block_table=z(8, dtype=I32)),
    bad("varlen_paged", "page-size-zero", ValueError, "k", k=z(5, 0, 2, 64), v=z(5, 0, 2, 64)),
    bad("varlen_paged", "dropout", ValueError, "dropout_p", dropout_p=0.1),
    bad("varlen_qkvpacked", "qkv-list", TypeError, "qkv", qkv=[0.0]),
    bad("varlen_qkvpacked", "qkv-fp32", TypeError, "qkv", qkv=z(10, 3, 4, 64, dtype=F32)),
    bad("varlen_qkvpacked", "qkv-two-parts", ValueError, "qkv", qkv=z(10, 2, 4, 64)),
    bad("varlen_qkvpacked", "qkv-5d", ValueError, "qkv", qkv=z(2, 5, 3, 4, 64)),
    bad("varlen_qkvpacked", "cu_seqlens-int64", TypeError, "cu_seqlens", cu_seqlens=z(3, dtype=I64)),
    bad("varlen_qkvpacked", "max_seqlen-negative", ValueError, "max_seqlen", max_seqlen=-3),
    *option_cases("varlen_qkvpacked"),
    bad("varlen_kvpacked", "kv-fp32", TypeError, "kv", kv=z(12, 2, 2, 64, dtype=F32)),
    bad("varlen_kvpacked", "kv-three-parts", ValueError, "kv", kv=z(12, 3, 2, 64)),
    bad("varlen_kvpacked", "kv-3d", ValueError, "kv", kv=z(12, 2, 64)),
    bad("varlen_kvpacked", "q-3d-ok-kv-heads", ValueError, "k", kv=z(12, 2, 3, 64)),
    bad("varlen_kvpacked", "q-fp32", TypeError, "q", q=z(10, 4, 64, dtype=F32)),
    bad("varlen_kvpacked", "cu_seqlens_q-int64", TypeError, "cu_seqlens_q", cu_seqlens_q=z(3, dtype=I64)),
    bad("varlen_kvpacked", "cu_seqlens_k-batch", ValueError, "cu_seqlens_k", cu_seqlens_k=z(2, dtype=I32)),
    bad("varlen_kvpacked", "max_seqlen_q-str", TypeError, "max_seqlen_q", max_seqlen_q="6"),
    bad("varlen_kvpacked", "max_seqlen_k-negative", ValueError, "max_seqlen_k", max_seqlen_k=-8),
    *option_cases("varlen_kvpacked"),
    # flash_attn_combine: out_partial (3, 2, 5, 4, 64), lse_partial (3, 2, 5, 4), out (2, 5, 4, 64) fp16
    bad("combine", "out_partial-list", TypeError, "out_partial", out_partial=[0.0]),
    bad("combine", "out_partial-fp16", TypeError, "out_partial", out_partial=z(3, 2, 5, 4, 64)),
    bad("combine", "out_partial-4d", ValueError, "out_partial", out_partial=z(3, 10, 4, 64, dtype=F32)),
    bad("combine", "lse_partial-fp16", TypeError, "lse_partial", lse_partial=z(3, 2, 5, 4)),
    bad("combine", "lse_partial-5d", ValueError, "lse_partial", lse_partial=z(3, 2, 5, 4, 1, dtype=F32)),
    bad("combine", "lse_partial-shape", ValueError, "lse_partial", lse_partial=z(2, 2, 5, 4, dtype=F32)),
    bad("combine", "zero-splits", ValueError, "out_partial",
        out_partial=z(0, 2, 5, 4, 64, dtype=F32), lse_partial=z(0, 2, 5, 4, dtype=F32)),
    bad("combine", "too-many-splits", ValueError, "out_partial",
        out_partial=z(validate.MAX_COMBINE_SPLITS + 1, 1, 1, 1, 4, dtype=F32),
        lse_partial=z(validate.MAX_COMBINE_SPLITS + 1, 1, 1, 1, dtype=F32), out=None),
    bad("combine", "out_dtype-fp64", TypeError, "out_dtype", out_dtype=torch.float64, out=None),
    bad("combine", "out_dtype-str", TypeError, "out_dtype", out_dtype="float16", out=None),
    bad("combine", "out-list", TypeError, "out", out=[0.0]),
    bad("combine", "out-fp64", TypeError, "out", out=z(2, 5, 4, 64, dtype=torch.float64), out_dtype=None),
    bad("combine", "out-not-out_dtype", TypeError, "out", out=z(2, 5, 4, 64, dtype=F32)),
    bad("combine", "out-shape", ValueError, "out", out=z(2, 5, 4, 32)),
    bad("combine", "out-strided-last-dim", ValueError, "out", out=strided_last(2, 5, 4, 64)),
    bad("combine", "out-misaligned", ValueError, "out", out=misaligned(2, 5, 4, 64)),
]


# Valid variants: each still reaches exactly the CUDA-tensor error on the CPU.
def good(base: str, what: str, **changes):
    return pytest.param(base, changes, id=f"{base}-{what}")


GOOD = [
    good("func", "base"),
    good("func", "bf16", q=z(2, 16, 4, 64, dtype=BF16), k=z(2, 24, 2, 64, dtype=BF16), v=z(2, 24, 2, 64, dtype=BF16)),
    good("func", "mqa-head_dim-8", q=z(1, 3, 8, 8), k=z(1, 5, 1, 8), v=z(1, 5, 1, 8)),
    good("func", "head_dim-256", q=z(1, 3, 2, 256), k=z(1, 5, 2, 256), v=z(1, 5, 2, 256)),
    good("func", "empty-sequences", q=z(2, 0, 4, 64), k=z(2, 0, 2, 64), v=z(2, 0, 2, 64)),
    good("func", "empty-batch", q=z(0, 16, 4, 64), k=z(0, 24, 2, 64), v=z(0, 24, 2, 64)),
    good("func", "batch-65535", q=z(65535, 1, 1, 8), k=z(65535, 1, 1, 8), v=z(65535, 1, 1, 8)),
    good("func", "k-heads-before-seqlen", k=lambda d: torch.zeros(2, 2, 24, 64, dtype=F16, device=d).transpose(1, 2)),
    good("func", "options", causal=True, window_size=[-1, 0], softcap=30, softmax_scale=1, dropout_p=0,
         num_splits=0, pack_gqa=True, deterministic=True, return_attn_probs=True),
    good("func", "window-tensor", window_size=tensor([3, 0])),
    good("func", "window-int32-tensor-numpy-flags", window_size=lambda d: torch.tensor([-1, 5], dtype=I32, device=d),
         causal=np.bool_(True), deterministic=np.bool_(False), return_attn_probs=np.bool_(True)),
    good("func", "window-numpy-integers", window_size=(np.int64(4), np.int32(-1))),
    good("func", "window-numpy-array", window_size=np.array([2, 2], dtype=np.uint8)),
    good("func", "head_dim-1", q=z(2, 16, 4, 1), k=z(2, 24, 2, 1), v=z(2, 24, 2, 1)),
    good("func", "head_dim-59", q=z(2, 16, 4, 59), k=z(2, 24, 2, 59), v=z(2, 24, 2, 59)),
    good("func", "head_dim-255-bf16", q=z(1, 3, 2, 255, dtype=BF16), k=z(1, 5, 2, 255, dtype=BF16),
         v=z(1, 5, 2, 255, dtype=BF16)),
    good("func", "window-alibi-per-batch", window_size=(128, 5), pack_gqa=False, num_splits=7,
         alibi_slopes=z(2, 4, dtype=F32)),
    good("qkvpacked", "alibi-per-head", alibi_slopes=z(4, dtype=F32), window_size=(0, 0)),
    good("qkvpacked", "head_dim-60", qkv=z(2, 16, 3, 4, 60)),
    good("kvpacked", "alibi-per-batch", softcap=0.0, num_splits=0, alibi_slopes=z(2, 4, dtype=F32)),
    good("kvpacked", "head_dim-3", q=z(2, 16, 4, 3), kv=z(2, 24, 2, 2, 3)),
    good("kvcache", "base"),
    good("kvcache", "rotary_dim-equals-head_dim-bf16-tables", k=None, v=None, cache_seqlens=None,
         rotary_cos=z(32, 32, dtype=BF16), rotary_sin=z(32, 32, dtype=BF16)),
    good("kvcache", "int-cache_seqlens", cache_seqlens=31, cache_batch_idx=None, cache_leftpad=None),
    good("kvcache", "append-fills-the-cache", k=z(2, 32, 2, 64), v=z(2, 32, 2, 64), cache_seqlens=0),
    good("kvcache", "options", alibi_slopes=z(2, 4, dtype=F32), window_size=(8, 0), num_splits=3, pack_gqa=False),
    good("kvcache", "flags", causal=True, rotary_interleaved=np.bool_(False), return_softmax_lse=True,
         window_size=tensor([4, 0])),
    good("kvcache", "head_dim-20-full-rotary", q=z(2, 1, 4, 20), k_cache=z(3, 32, 2, 20), v_cache=z(3, 32, 2, 20),
         k=z(2, 1, 2, 20), v=z(2, 1, 2, 20), rotary_cos=z(32, 10, dtype=F32), rotary_sin=z(32, 10, dtype=F32)),
    good("kvcache_paged", "base"),
    good("kvcache_paged", "block_table-strided-last-dim",
         block_table=lambda d: torch.zeros(4, 2, dtype=I32, device=d).t()),
    good("kvcache_paged", "page-size-1", k_cache=z(5, 1, 2, 64), v_cache=z(5, 1, 2, 64), k=None, v=None),
    good("kvcache_paged", "head_dim-111", q=z(2, 1, 4, 111), k_cache=z(5, 8, 2, 111), v_cache=z(5, 8, 2, 111),
         k=z(2, 1, 2, 111), v=z(2, 1, 2, 111)),
    good("varlen", "base"),
    good("varlen", "dropout-splits-gqa-heuristic", dropout_p=0.3, num_splits=0, pack_gqa=None, seqused_q=None,
         causal=True, alibi_slopes=z(2, 4, dtype=F32)),
    good("varlen", "head_dim-59-window-list", q=z(10, 4, 59), k=z(12, 2, 59), v=z(12, 2, 59), window_size=[3, 3]),
    good("varlen", "empty-total", q=z(0, 4, 64), k=z(0, 2, 64), v=z(0, 2, 64), max_seqlen_q=0, max_seqlen_k=0),
    good("varlen_paged", "base"),
    good("varlen_paged", "page-size-1-seqused_k", k=z(5, 1, 2, 64), v=z(5, 1, 2, 64), seqused_k=z(2, dtype=I32)),
    good("varlen_paged", "head_dim-1", q=z(10, 4, 1), k=z(5, 8, 2, 1), v=z(5, 8, 2, 1)),
    good("varlen_qkvpacked", "base"),
    good("varlen_qkvpacked", "options", dropout_p=0.5, window_size=(4, 4), softcap=2.0, deterministic=True),
    good("varlen_qkvpacked", "head_dim-255", qkv=z(10, 3, 4, 255)),
    good("varlen_kvpacked", "base"),
    good("varlen_kvpacked", "head_dim-7", q=z(10, 4, 7), kv=z(12, 2, 2, 7)),
    good("combine", "base"),
    good("combine", "no-out", out=None, out_dtype=None),
    # A head dim that is not a multiple of 4 goes through a padded buffer: out may have any layout.
    good("combine", "head_dim-62", out_partial=z(3, 2, 5, 4, 62, dtype=F32), out=misaligned(2, 5, 4, 62)),
    good("combine", "head_dim-1-no-out", out_partial=z(3, 2, 5, 4, 1, dtype=F32), out=None, out_dtype=None),
    good("combine", "bf16-out", out=z(2, 5, 4, 64, dtype=BF16), out_dtype=None),
    good("combine", "256-splits", out_partial=z(256, 1, 1, 1, 4, dtype=F32), lse_partial=z(256, 1, 1, 1, dtype=F32),
         out=None),
    good("combine", "strided-partials", out_partial=strided_last(3, 2, 5, 4, 64, dtype=F32),
         lse_partial=lambda d: torch.zeros(2, 5, 4, 3, device=d).permute(3, 0, 1, 2)),
]


def call(base: str, changes: dict, device: str):
    fn, kwargs = BASES[base]
    return fn(**build({**kwargs, **changes}, device))


def names(case: Bad) -> str:
    return rf"^{re.escape(case.arg)}\b"


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_bad_argument_cpu(case: Bad):
    with pytest.raises(case.error, match=names(case)) as error:
        call(case.base, case.changes, "cpu")
    # The CUDA-tensor error names the first tensor too: it would pass for a call that is valid.
    assert "must be a CUDA tensor" not in str(error.value)


@pytest.mark.parametrize("base, changes", GOOD)
def test_valid_cpu_call_gets_exactly_the_cuda_error(base, changes):
    first = FIRST_TENSOR[base]
    with pytest.raises(ValueError, match=rf"^{first} must be a CUDA tensor, got one on cpu$"):
        call(base, changes, "cpu")


def test_every_argument_is_covered():
    """Each entry point's arguments all have bad cases (the flags too: True or False only)."""
    for fn in {fn for fn, _ in BASES.values()}:
        covered = {case.arg for case in BAD if BASES[case.base][0] is fn}
        missing = set(inspect.signature(fn).parameters) - covered
        assert not missing, (fn.__name__, sorted(missing))


def test_grid_limits():
    """The planned launch grid: heads and batch x splits within gridDim.y/z (checked after planning)."""
    from flashgen.runtime.dispatch import plan_fwd

    def plan(**kw):
        args = dict(dtype="fp16", head_dim=64, batch=1, seqlen_q=128, seqlen_k=1 << 20, nheads=1, nheads_k=1,
                    causal=False, window_size=(-1, -1), softcap=0.0, pack_gqa=None, device=(9, 0))
        return plan_fwd(**{**args, **kw})

    validate.grid(plan(nheads=65535, nheads_k=65535))
    with pytest.raises(ValueError, match=r"^q .*pack_gqa=True"):
        validate.grid(plan(nheads=65536, nheads_k=1, pack_gqa=False))
    validate.grid(plan(nheads=65536 * 2, nheads_k=2, pack_gqa=True))
    with pytest.raises(ValueError, match=r"^k_cache\b"):
        validate.grid(plan(nheads=65536 * 2, nheads_k=65536, pack_gqa=True), "k_cache")
    validate.grid(plan(batch=65535 // 8, num_splits=8))
    with pytest.raises(ValueError, match=r"^num_splits\b.*a batch of 8192"):
        validate.grid(plan(batch=8192, num_splits=8))


def test_value_checks():
    """FLASHGEN_CHECK_INPUTS=1's checks (they read the tensors), on CPU tensors."""
    lens = torch.tensor([3, 5], dtype=I32)
    ok = dict(cache_seqlens=lens, seqlen_new=2, capacity=8, leftpad=None, block_table=None, page_size=1,
              num_pages=0, cache_batch_idx=None, cache_batch=2)
    validate.kvcache_values(**ok)
    # Rows need ceil((3 + 2) / 2) = 3 and ceil((5 + 2) / 2) = 4 pages; the entry past a row's need is ignored.
    table = torch.tensor([[0, 1, 2, 9], [1, 2, 3, 4]], dtype=I32)
    validate.kvcache_values(**ok | dict(block_table=table, page_size=2, num_pages=5))
    for changes, arg in [
        (dict(seqlen_new=4), "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([-1, 0], dtype=I32)), "cache_seqlens"),
        (dict(leftpad=torch.tensor([0, 6], dtype=I32)), "cache_leftpad"),
        (dict(block_table=table, page_size=2, num_pages=4), r"block_table\[1\]"),
        (dict(cache_batch_idx=torch.tensor([0, 2], dtype=I32)), "cache_batch_idx"),
        (dict(cache_batch_idx=torch.tensor([1, 1], dtype=I32)), "cache_batch_idx must not repeat"),
    ]:
        with pytest.raises(ValueError, match=rf"^{arg}"):
            validate.kvcache_values(**ok | changes)
    # Without an append, batch rows may share a cache row: it is only read.
    validate.kvcache_values(**ok | dict(seqlen_new=0, cache_batch_idx=torch.tensor([1, 1], dtype=I32)))


def test_check_inputs_reports_cache_rows_shared_by_an_append(monkeypatch):
    """Through flash_attn_with_kvcache on CPU tensors (the device check off): the duplicate
    cache_batch_idx entries are reported before anything is launched."""
    monkeypatch.setenv("FLASHGEN_CHECK_INPUTS", "1")
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)
    fn, kwargs = BASES["kvcache"]
    rows = lambda device: torch.tensor([2, 2], dtype=I32, device=device)  # noqa: E731
    shared = build({**kwargs, "cache_batch_idx": rows, "cache_seqlens": rows}, "cpu")
    with pytest.raises(ValueError, match=r"^cache_batch_idx must not repeat a cache row when k and v are appended"):
        fn(**shared)


def test_varlen_value_checks():
    """FLASHGEN_CHECK_INPUTS=1's varlen checks (they read cu_seqlens, seqused, block_table)."""
    cu_q, cu_k = torch.tensor([0, 3, 3, 10], dtype=I32), torch.tensor([0, 5, 6, 12], dtype=I32)
    ok = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=6, total_q=10, capacity=12,
              paged=False, block_table=None, page_size=1, num_pages=0, seqused_q=None, seqused_k=None)
    validate.varlen_values(**ok)
    validate.varlen_values(**ok | dict(seqused_q=torch.tensor([3, 0, 5], dtype=I32)))
    table = torch.tensor([[0, 1, 9], [2, 9, 9], [3, 4, 9]], dtype=I32)  # 4-key pages: 2, 1 and 2 needed
    validate.varlen_values(**ok | dict(paged=True, block_table=table, page_size=4, num_pages=5, capacity=12))
    for changes, arg in [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 2, 10], dtype=I32)), "cu_seqlens_q"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 3, 10], dtype=I32)), "cu_seqlens_q"),
        (dict(total_q=11), "cu_seqlens_q"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 6, 13], dtype=I32)), "cu_seqlens_k"),
        (dict(max_seqlen_q=6), "max_seqlen_q"),
        (dict(max_seqlen_k=5), "max_seqlen_k"),
        (dict(seqused_q=torch.tensor([4, 0, 5], dtype=I32)), "seqused_q"),
        (dict(seqused_k=torch.tensor([-1, 0, 5], dtype=I32)), "seqused_k"),
        (dict(paged=True, block_table=table, page_size=4, num_pages=4), r"block_table\[2\]"),
        (dict(paged=True, block_table=table, page_size=1, num_pages=5, capacity=3), "cu_seqlens_k"),
    ]:
        with pytest.raises(ValueError, match=rf"^{arg}"):
            validate.varlen_values(**ok | changes)


def _accepted_on_cpu(q_shape, k_shape) -> None:
    q = torch.empty_strided(q_shape, (0, 0, 0, 1), dtype=BF16)
    k = torch.empty_strided(k_shape, (0, 0, 0, 1), dtype=BF16)
    with pytest.raises(ValueError, match="^q must be a CUDA tensor"):
        flashgen.flash_attn_func(q, k, k)


@pytest.mark.parametrize("device, d_slices", [((9, 0), 1), ((8, 6), 2)])
def test_backward_grid_holds_65535_kv_heads_at_any_head_dim(device, d_slices):
    """Head-dim slices (d256 on 99 KB targets) share grid.x with the key blocks, so only the KV
    heads sit in gridDim.y."""
    from flashgen.runtime.dispatch import plan_bwd

    _accepted_on_cpu((1, 1, 40000, 256), (1, 1, 40000, 256))
    plan = plan_bwd(dtype="bf16", head_dim=256, batch=1, seqlen_q=1, seqlen_k=1, nheads_k=40000, causal=False,
                    window_size=(-1, -1), softcap=0.0, device=device)
    assert plan.tile.d_slices == d_slices and plan.grid == (d_slices, 40000, 1)


def test_pack_gqa_heuristic_packs_when_unpacked_heads_exceed_the_grid():
    from flashgen.runtime.dispatch import plan_fwd

    _accepted_on_cpu((1, 128, 2 * 65535, 8), (1, 128, 65535, 8))
    plan = plan_fwd(dtype="bf16", head_dim=8, batch=1, seqlen_q=128, seqlen_k=128, nheads=2 * 65535, nheads_k=65535,
                    causal=False, window_size=(-1, -1), softcap=0.0, pack_gqa=None, device=(9, 0))
    assert plan.spec.pack_gqa and plan.grid[1] == 65535
    validate.grid(plan)


def test_split_heuristic_keeps_batch_times_splits_in_the_grid():
    from flashgen.runtime.dispatch import DeviceInfo, plan_fwd

    # On a (hypothetical) GPU with 100k SMs the heuristic picks 21 splits for 8192 one-row sequences
    # when free to: 172032 > 65535 CTAs in gridDim.z. The plan caps it at 65535 // 8192 = 7.
    from flashgen.runtime import heuristics

    assert heuristics.num_splits_heuristic(8192, 200_000, 8192, 1, (1 << 20) * 512, False, 128) * 8192 > 65535
    plan = plan_fwd(dtype="bf16", head_dim=128, batch=8192, seqlen_q=1, seqlen_k=1 << 20, nheads=1, nheads_k=1,
                    causal=False, window_size=(-1, -1), softcap=0.0, pack_gqa=None,
                    device=DeviceInfo((9, 0), num_sms=100_000), num_splits=0)
    assert 1 < plan.num_splits <= 7 and plan.grid[2] == 8192 * plan.num_splits
    validate.grid(plan)


# ---------------------------------------------------------------------------------------------
# GPU tier: the same table on CUDA tensors, and what only a GPU can reach.


@pytest.mark.gpu
@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_bad_argument_cuda(case: Bad):
    with pytest.raises(case.error, match=names(case)):
        call(case.base, case.changes, "cuda")
    torch.cuda.synchronize()  # nothing was launched, and the context is still usable


def _other_device_cases():
    """(base, argument) for every optional or required tensor that must share q's device."""
    cases = [("func", "k"), ("func", "v"), ("func", "alibi_slopes"), ("qkvpacked", "alibi_slopes"),
             ("kvpacked", "kv"), ("kvpacked", "alibi_slopes"), ("combine", "lse_partial"), ("combine", "out")]
    cases += [("kvcache", a) for a in ("k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                        "cache_batch_idx", "cache_leftpad", "alibi_slopes")]
    cases += [("kvcache_paged", "block_table")]
    return cases


def _kwargs_with(base: str, arg: str, device: str, other: str) -> dict:
    kwargs = BASES[base][1]
    if arg == "alibi_slopes":
        kwargs = {**kwargs, "alibi_slopes": z(4, dtype=F32)}
    built = build(kwargs, device)
    built[arg] = kwargs[arg](other)
    return built


@pytest.mark.gpu
@pytest.mark.parametrize("base, arg", _other_device_cases(), ids=lambda x: x)
def test_tensor_on_the_cpu_with_cuda_q(base, arg):
    fn, _ = BASES[base]
    with pytest.raises(ValueError, match=rf"^{arg} must be on {FIRST_TENSOR[base]}'s device cuda"):
        fn(**_kwargs_with(base, arg, "cuda", "cpu"))
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("base, arg", _other_device_cases(), ids=lambda x: x)
def test_tensors_on_two_gpus(base, arg):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    fn, _ = BASES[base]
    with pytest.raises(ValueError, match=rf"^{arg} must be on {FIRST_TENSOR[base]}'s device cuda:0, got cuda:1"):
        fn(**_kwargs_with(base, arg, "cuda:0", "cuda:1"))
    torch.cuda.synchronize()
