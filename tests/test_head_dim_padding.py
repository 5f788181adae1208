"""CPU tier: head dims that are not a multiple of 8 run on zero-padded copies, as in flash_attn 2.

pad_head_dim itself, then each entry point's wiring with the kernels replaced by PyTorch
references (and the device check switched off, so CPU tensors reach them): the kernels see a
multiple of 8, the default softmax_scale is 1/sqrt(the caller's head dim), outputs, lse and
gradients come back in the caller's shapes and equal the reference on the unpadded inputs, and
the KV cache's appended rows land in the caller's caches. tests/gpu/test_odd_head_dims.py holds
the same calls to the real kernels.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.runtime import dropout, execute, interface, kvcache, validate
from flashgen.testing import attention_ref
from flashgen.testing_kvcache import combine_ref, kvcache_ref, rotary_tables

F16 = torch.float16


@pytest.mark.parametrize("head_dim, multiple, padded", [(1, 8, 8), (7, 8, 8), (8, 8, 8), (59, 8, 64), (255, 8, 256),
                                                        (62, 4, 64), (64, 4, 64)])
def test_pad_head_dim_appends_zero_columns(head_dim, multiple, padded):
    x = torch.randn(2, 3, head_dim)
    y = execute.pad_head_dim(x, multiple)
    assert y.shape == (2, 3, padded)
    assert torch.equal(y[..., :head_dim], x) and not y[..., head_dim:].any()
    if padded == head_dim:
        assert y is x  # a multiple already: no copy


def test_gradients_flow_through_pad_and_slice():
    x = torch.randn(4, 59, requires_grad=True)
    g = torch.randn(4, 59)
    (execute.pad_head_dim(x)[..., :59] * g).sum().backward()
    assert torch.equal(x.grad, g)


# ---------------------------------------------------------------------------------------------
# Entry points with the kernels replaced by references


@pytest.fixture
def kernels(monkeypatch):
    """Replaces the kernels behind every entry point by attention_ref (float64, differentiable) and
    records each call's head dim and softmax_scale."""
    seen = []
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)

    def attend(q, k, v, softmax_scale, causal, window_size, batched=True):
        seen.append((q.shape[-1], softmax_scale))
        assert q.shape[-1] % execute.HEAD_DIM_MULTIPLE == 0 and k.shape[-1] == v.shape[-1] == q.shape[-1]
        if not batched:  # varlen, one sequence: (total, heads, d)
            q, k, v = q[None], k[None], v[None]
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window_size, softmax_scale=softmax_scale)
        out, lse = out.to(q.dtype), lse.float()
        return (out, lse) if batched else (out[0], lse[0])

    def fwd(q, k, v, softmax_scale, causal, window_size, *rest):
        return (*attend(q, k, v, softmax_scale, causal, window_size), dropout.NO_DROPOUT)

    def fwd_op(q, k, v, softmax_scale, causal, window_left, window_right, *rest):
        return (*attend(q, k, v, softmax_scale, causal, (window_left, window_right)), torch.zeros(2, dtype=torch.int64))

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, *rest):
        return (*attend(q, k, v, softmax_scale, causal, window_size, batched=False), dropout.NO_DROPOUT)

    def varlen_fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, *rest):
        out, lse = attend(q, k, v, softmax_scale, causal, (window_left, window_right), batched=False)
        return out, lse, torch.zeros(2, dtype=torch.int64)

    class EagerAttention:  # eager calls with gradients: the reference carries them
        apply = staticmethod(lambda *args: fwd_op(*args)[:2])

    class EagerVarlenAttention:
        apply = staticmethod(lambda *args: varlen_fwd_op(*args)[:2])

    monkeypatch.setattr(interface, "_fwd", fwd)
    monkeypatch.setattr(interface, "_fwd_op", fwd_op)
    monkeypatch.setattr(interface, "_EagerAttention", EagerAttention)
    monkeypatch.setattr(interface, "_varlen_fwd", varlen_fwd)
    monkeypatch.setattr(interface, "_varlen_fwd_op", varlen_fwd_op)
    monkeypatch.setattr(interface, "_EagerVarlenAttention", EagerVarlenAttention)
    return seen


def leaves(*shapes):
    return [torch.randn(shape, dtype=F16).requires_grad_() for shape in shapes]


def reference_with_grads(q, k, v, dout, **kwargs):
    """attention_ref's out and the gradients of (out * dout).sum() on the unpadded leaves."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = attention_ref(q, k, v, **kwargs)
    out = out.to(F16)
    return out, lse.float(), torch.autograd.grad(out, (q, k, v), dout)


def assert_close(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("head_dim", [1, 3, 59, 255])
def test_flash_attn_func_inference_and_grad(kernels, head_dim):
    q, k, v = leaves((2, 5, 4, head_dim), (2, 7, 2, head_dim), (2, 7, 2, head_dim))
    dout = torch.randn(2, 5, 4, head_dim, dtype=F16)
    expected, expected_lse, grads = reference_with_grads(q, k, v, dout, causal=True)
    with torch.no_grad():
        out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert_close(out, expected)
    assert_close(lse, expected_lse)
    out = flashgen.flash_attn_func(q, k, v, causal=True)
    assert_close(out, expected)
    for g, g_ref in zip(torch.autograd.grad(out, (q, k, v), dout), grads):
        assert_close(g, g_ref)
    assert kernels == [(-(-head_dim // 8) * 8, head_dim ** -0.5)] * 2


def test_explicit_softmax_scale_is_kept(kernels):
    q, k, v = leaves((1, 3, 2, 20), (1, 3, 2, 20), (1, 3, 2, 20))
    flashgen.flash_attn_func(q, k, v, softmax_scale=0.3)
    assert kernels == [(24, 0.3)]


def test_packed_variants(kernels):
    (qkv,) = leaves((2, 6, 3, 4, 59))
    dout = torch.randn(2, 6, 4, 59, dtype=F16)
    expected, _, grads = reference_with_grads(*qkv.unbind(2), dout, window_size=(2, 1))
    out = flashgen.flash_attn_qkvpacked_func(qkv, window_size=(2, 1))
    assert_close(out, expected)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert_close(dqkv, torch.stack(grads, dim=2))

    q, kv = leaves((2, 6, 4, 13), (2, 9, 2, 2, 13))
    dout = torch.randn(2, 6, 4, 13, dtype=F16)
    expected, _, (dq_ref, dk_ref, dv_ref) = reference_with_grads(q, *kv.unbind(2), dout)
    out = flashgen.flash_attn_kvpacked_func(q, kv)
    assert_close(out, expected)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert_close(dq, dq_ref)
    assert_close(dkv, torch.stack((dk_ref, dv_ref), dim=2))


@pytest.mark.parametrize("packed", ["none", "qkv", "kv"])
def test_varlen(kernels, packed):
    total, head_dim = 9, 111
    cu = torch.tensor([0, total], dtype=torch.int32)
    q, k, v = leaves((total, 4, head_dim), (total, 4, head_dim), (total, 4, head_dim))
    dout = torch.randn(total, 4, head_dim, dtype=F16)
    expected, expected_lse, grads = reference_with_grads(q[None], k[None], v[None], dout[None], causal=True)
    if packed == "qkv":
        qkv = torch.stack((q, k, v), dim=1).detach().requires_grad_()
        out, lse, _ = flashgen.flash_attn_varlen_qkvpacked_func(qkv, cu, total, causal=True, return_attn_probs=True)
        (dqkv,) = torch.autograd.grad(out, qkv, dout)
        dq, dk, dv = dqkv.unbind(1)
    elif packed == "kv":
        kv = torch.stack((k, v), dim=1).detach().requires_grad_()
        out, lse, _ = flashgen.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, total, total, causal=True,
                                                               return_attn_probs=True)
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        dk, dv = dkv.unbind(1)
    else:
        out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True,
                                                      return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert_close(out, expected[0])
    assert_close(lse, expected_lse[0])
    for g, g_ref in zip((dq, dk, dv), grads):
        assert_close(g, g_ref[0])
    assert kernels == [(112, head_dim ** -0.5)]


@pytest.fixture
def cache_kernel(monkeypatch):
    """Replaces flash_attn_with_kvcache's kernels by kvcache_ref, appending into the caches it is
    given as the kernels do; records each call's head dim and softmax_scale."""
    seen = []
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)

    def kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, softmax_scale, causal, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, pack_gqa, call):
        seen.append((q.shape[-1], softmax_scale))
        padded = [x for x in (q, k_cache, v_cache, k, v) if x is not None]
        assert all(x.shape[-1] % execute.HEAD_DIM_MULTIPLE == 0 for x in padded)
        ref = kvcache_ref(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table, softmax_scale, causal, call.window_size, softcap,
                          rotary_interleaved, alibi_slopes)
        k_cache.copy_(ref.k_cache)
        v_cache.copy_(ref.v_cache)
        return ref.out.to(q.dtype), ref.lse.float()

    monkeypatch.setattr(kvcache, "_kvcache_fwd", kvcache_fwd)
    return seen


@pytest.mark.parametrize("head_dim, rotary_dim", [(59, 32), (3, 2), (111, 110)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_appends_into_the_callers_caches(cache_kernel, head_dim, rotary_dim, paged):
    batch, seqlen_q, seqlen_new, nheads, nheads_k, capacity = 2, 2, 2, 4, 2, 16
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=F16)
    rows = (4, 8) if paged else (3, capacity)  # 4 pages of 8, or 3 cache rows
    k_cache = torch.randn(*rows, nheads_k, head_dim, dtype=F16)
    v_cache = torch.randn_like(k_cache)
    k, v = (torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=F16) for _ in range(2))
    cos, sin = rotary_tables(capacity, rotary_dim)
    layout = dict(block_table=torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)) if paged else dict(
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    kwargs = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32),
                  causal=True, rotary_interleaved=False, **layout)
    ref = kvcache_ref(q, k_cache, v_cache, **kwargs)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)
    assert_close(out, ref.out.to(F16))
    assert_close(lse, ref.lse.float())
    assert ref.written.any() and torch.equal(k_cache, ref.k_cache) and torch.equal(v_cache, ref.v_cache)
    assert cache_kernel == [(-(-head_dim // 8) * 8, head_dim ** -0.5)]


def test_kvcache_without_append(cache_kernel):
    q = torch.randn(2, 1, 2, 5, dtype=F16)
    k_cache, v_cache = torch.randn(2, 8, 2, 5, dtype=F16), torch.randn(2, 8, 2, 5, dtype=F16)
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6, window_size=(3, 0))
    assert_close(out, kvcache_ref(q, k_cache, v_cache, cache_seqlens=6, window_size=(3, 0)).out.to(F16))
    assert cache_kernel == [(8, 5 ** -0.5)]


@pytest.mark.parametrize("head_dim", [1, 62])
@pytest.mark.parametrize("given_out", [False, True], ids=["new-out", "given-out"])
def test_combine(monkeypatch, head_dim, given_out):
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)
    merged_dims = []

    def launch_combine(out_partial, lse_partial, out, lse, *, head_dim, **geometry):
        merged_dims.append(head_dim)
        assert out_partial.shape[-1] == out.shape[-1] == head_dim and head_dim % 4 == 0
        merged, merged_lse = combine_ref(out_partial, lse_partial)
        out.copy_(merged)
        lse.copy_(merged_lse)

    monkeypatch.setattr(kvcache, "launch_combine", launch_combine)
    out_partial = torch.randn(3, 2, 5, 4, head_dim)
    lse_partial = torch.randn(3, 2, 5, 4)
    lse_partial[1, 0, 0] = -torch.inf  # a split that saw no key
    expected, expected_lse = combine_ref(out_partial, lse_partial)
    out = torch.empty(2, 5, 4, head_dim, dtype=F16).transpose(1, 2).contiguous().transpose(1, 2) if given_out else None
    result, lse = flashgen.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=F16)
    if given_out:
        assert result is out
    assert_close(result, expected.to(F16))
    torch.testing.assert_close(lse, expected_lse.float())
    assert merged_dims == [-(-head_dim // 4) * 4]
