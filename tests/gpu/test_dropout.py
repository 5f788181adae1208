"""GPU tier: dropout in the forward and backward of flash_attn_func and flash_attn_varlen_func.

The kernels' pattern is recomputed on the host from the call's rng_state (flashgen.testing.
dropout_keep_mask, a PyTorch Philox held to Random123's known answers on the CPU tier); out and
the gradients must match attention_ref applying that same mask by the dense path's rules, and a
reference with a different mask must fail them (so the mask is really the kernels').
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.runtime.dropout import dropout_threshold_and_scale
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref, dropout_keep_mask
from test_bwd import grad_eps
from test_fwd import DEVICE, make_qkv, poison_allocator
from test_fwd import _seed  # noqa: F401  (autouse: a seed per test id)

pytestmark = pytest.mark.gpu

MASKS = {"none": {}, "causal": {"causal": True}, "local": {"window_size": (33, 7)}}


def next_rng_state() -> torch.Tensor:
    """The [seed, offset] the next dropout call will draw (flashgen.runtime.dropout.draw_dropout)."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    seed = generator.initial_seed()
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed, generator.get_offset()])


def mask_for(rng_state, p, q, k):
    batch, seqlen_q, nheads, _ = q.shape
    return dropout_keep_mask(rng_state, p, batch, nheads, seqlen_q, k.shape[1], device=DEVICE)


def ref_with_grads(q, k, v, dout, upcast, **kwargs):
    leaves = [(x.float() if upcast else x).detach().requires_grad_() for x in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=upcast, **kwargs)
    return (out, lse, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", [(2, 113, 257, 4, 4, 128), (1, 1023, 1023, 8, 2, 64), (3, 1, 300, 8, 1, 256),
                                   (2, 65, 33, 4, 2, 96)], ids=lambda s: "b{}-sq{}-sk{}-h{}/{}-d{}".format(*s))
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_fwd_bwd(shape, mask, p):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    rng_state = next_rng_state()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse, _ = flashgen.flash_attn_func(*leaves, dropout_p=p, return_attn_probs=True, **MASKS[mask])
    poison_allocator()
    grads = torch.autograd.grad(out, leaves, dout)
    keep = mask_for(rng_state, p, q, k)
    kwargs = dict(MASKS[mask], dropout_mask=keep, dropout_p=p)
    out_ref, lse_ref, *grads_ref = ref_with_grads(q, k, v, dout, True, **kwargs)
    out_pt, _, *grads_pt = ref_with_grads(q, k, v, dout, False, **kwargs)
    assert_close_fa_rule(out, out_ref, out_pt, k=2.0)
    assert_lse_close(lse, lse_ref)
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_close_fa_rule(g, g_ref, g_pt, k=3.0, eps=grad_eps(g_ref), name=name)
    # The kernels' kept fraction is the mask's, which keeps 1 - p within 1%.
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01 or keep.numel() < 20000
    # Another mask (the next offset's) fails the rule: the test sees the kernels' mask.
    other = mask_for(rng_state + torch.tensor([0, 4]), p, q, k)
    out_other, _ = attention_ref(q, k, v, **dict(kwargs, dropout_mask=other))
    with pytest.raises(AssertionError):
        assert_close_fa_rule(out_other, out_ref, out_pt, k=2.0)


def test_dropout_kept_fraction_large():
    """Kept fraction from the kernel's own output: with v = 1 and q = 0 every probability is
    1 / seqlen_k, so out / scale is the kept fraction of each row, and out itself averages 1
    (dropout leaves the expected output unchanged)."""
    batch, seqlen, nheads, d, p = 2, 2048, 8, 64, 0.3
    q = torch.zeros(batch, 1, nheads, d, dtype=torch.float16, device=DEVICE)
    k = torch.randn(batch, seqlen, nheads, d, dtype=torch.float16, device=DEVICE)
    v = torch.ones(batch, seqlen, nheads, d, dtype=torch.float16, device=DEVICE)
    out = flashgen.flash_attn_func(q, k, v, dropout_p=p)
    scale = dropout_threshold_and_scale(p)[1]
    kept = (out[..., 0].float() / scale).mean().item()
    assert abs(kept - (1 - p)) < 0.01
    assert abs(out[..., 0].float().mean().item() - 1.0) < 0.02


def test_dropout_offset_past_2_32():
    """A generator offset past 2**32: the kernels use its high word (the mask differs from the
    one of the same low word) and still match the reference mask."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.set_offset(2**32 + 8)
    q, k, v = make_qkv(2, 113, 257, 4, 2, 64, dtype=torch.bfloat16)
    rng_state = next_rng_state()
    out, lse, _ = flashgen.flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert int(rng_state[1]) >= 2**32
    keep = mask_for(rng_state, 0.5, q, k)
    out_ref, _ = attention_ref(q, k, v, dropout_mask=keep, dropout_p=0.5, upcast=True)
    out_pt, _ = attention_ref(q, k, v, dropout_mask=keep, dropout_p=0.5, upcast=False)
    assert_close_fa_rule(out, out_ref, out_pt, k=2.0)
    low_word_only = mask_for(torch.tensor([int(rng_state[0]), int(rng_state[1]) % 2**32]), 0.5, q, k)
    assert not torch.equal(keep, low_word_only)


def test_dropout_reproducible_with_manual_seed():
    q, k, v = make_qkv(2, 77, 129, 4, 2, 64)
    torch.manual_seed(123)
    first = flashgen.flash_attn_func(q, k, v, dropout_p=0.2)
    second = flashgen.flash_attn_func(q, k, v, dropout_p=0.2)  # next offset: another mask
    torch.manual_seed(123)
    again = flashgen.flash_attn_func(q, k, v, dropout_p=0.2)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dropout_deterministic_backward():
    q, k, v = make_qkv(2, 300, 300, 4, 2, 128)
    dout = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, dropout_p=0.25, causal=True, deterministic=True)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(out, leaves, dout, retain_graph=True)))


def test_dropout_varlen():
    # No sequence with a single visible key: there dS is exactly 0, and the kernels' D = rowsum(dO * O)
    # from the rounded O = V / (1 - p) leaves ~1e-3 in dq where PyTorch's error is exactly 0
    # (FlashAttention's D has the same rounding); dense tests meet that row inside larger tensors.
    lengths_q, lengths_k = [113, 0, 2, 64], [200, 17, 3, 300]
    nheads, nheads_k, d, p = 4, 2, 64, 0.3
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lengths_q), nheads, d, dtype=torch.float16, device=DEVICE)
    k = torch.randn(sum(lengths_k), nheads_k, d, dtype=torch.float16, device=DEVICE)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    rng_state = next_rng_state()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=p,
                                          causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    keep_all = dropout_keep_mask(rng_state, p, len(lengths_q), nheads, max(lengths_q), max(lengths_k), device=DEVICE)
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        if nq:
            qb, kb, vb = q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk]
            kwargs = dict(causal=True, dropout_mask=keep_all[b:b + 1, :, :nq, :nk], dropout_p=p)
            out_ref, _, *g_ref = ref_with_grads(qb, kb, vb, dout[None, q0:q0 + nq], True, **kwargs)
            out_pt, _, *g_pt = ref_with_grads(qb, kb, vb, dout[None, q0:q0 + nq], False, **kwargs)
            assert_close_fa_rule(out[None, q0:q0 + nq], out_ref, out_pt, k=2.0, name=f"out of sequence {b}")
            for name, g, (a, z), gr, gp in zip(("dq", "dk", "dv"), grads, ((q0, q0 + nq), (k0, k0 + nk), (k0, k0 + nk)),
                                               g_ref, g_pt):
                assert_close_fa_rule(g[None, a:z], gr, gp, k=3.0, eps=grad_eps(gr), name=f"{name} of sequence {b}")
        q0, k0 = q0 + nq, k0 + nk
