"""GPU tier: flashgen.parallel's single-process ring simulation with flashgen's kernels.

simulate_ring_attention shards full-sequence inputs over N simulated ranks and runs every rank's
ring loop (the code of ring_flash_attn_func, communication by list rotation) with flashgen's
forward and backward as the local attention.  Its out, lse and gradients are held to the float32
reference of full attention by FlashAttention's rule, as in test_fwd.py and test_bwd.py: the
ring's error may be at most k times that of PyTorch doing the whole attention in the input dtype.
Shard chunks of odd length (113 rows), world sizes 2-4, GQA, both layouts, dense and packed.
"""
from __future__ import annotations

import pytest
import torch

import flashgen.parallel as parallel
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref
from test_bwd import check_grads
from test_fwd import DTYPE_NAMES, poison_allocator, randn
from test_fwd import _seed  # noqa: F401  (autouse: a seed per test id)

pytestmark = pytest.mark.gpu


def ring_and_grads(q, k, v, world_size, **kwargs):
    """(out, lse) of the simulated ring and its (dq, dk, dv) for a fixed random dout, the backward run
    on a poisoned allocator."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    poison_allocator()
    out, lse = parallel.simulate_ring_attention(*leaves, world_size, **kwargs)
    dout = torch.randn_like(out)
    poison_allocator()
    grads = torch.autograd.grad(out, leaves, dout)
    return out, lse, dout, grads


CASES = [  # (world_size, layout, causal, dtype, head_dim, nheads, nheads_k)
    (2, "zigzag", True, torch.bfloat16, 128, 4, 4),
    (3, "zigzag", True, torch.float16, 64, 6, 2),
    (4, "zigzag", True, torch.bfloat16, 64, 4, 1),
    (2, "zigzag", False, torch.float16, 128, 4, 2),
    (3, "contiguous", True, torch.bfloat16, 128, 4, 2),
    (4, "contiguous", False, torch.bfloat16, 96, 2, 2),
]


@pytest.mark.parametrize(
    "world_size, layout, causal, dtype, head_dim, nheads, nheads_k",
    [pytest.param(*case, id=f"n{case[0]}-{case[1]}-{'causal' if case[2] else 'full'}-{DTYPE_NAMES[case[3]]}-"
                  f"d{case[4]}-h{case[5]}k{case[6]}") for case in CASES],
)
def test_simulated_ring_matches_full_attention(world_size, layout, causal, dtype, head_dim, nheads, nheads_k):
    chunk = 113  # odd: neither the shard halves nor the blocks fall on tile boundaries
    seqlen = chunk * (2 * world_size if layout == "zigzag" else world_size)
    q = randn(2, seqlen, nheads, head_dim, dtype=dtype)
    k, v = randn(2, seqlen, nheads_k, head_dim, dtype=dtype), randn(2, seqlen, nheads_k, head_dim, dtype=dtype)
    out, lse, dout, grads = ring_and_grads(q, k, v, world_size, causal=causal, layout=layout)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_fa_rule(out, out_ref, out_pt, k=2.0)
    assert_lse_close(lse, lse_ref)
    check_grads(q, k, v, dout, grads, causal=causal)


def _per_sequence(fn, cu_seqlens, *packed):
    """fn over each sequence of packed (total, heads, d) tensors, concatenated back."""
    bounds = cu_seqlens.tolist()
    parts = [fn(*(t[None, a:b] for t in packed)) for a, b in zip(bounds, bounds[1:])]
    return torch.cat([p[0][0] for p in parts]), torch.cat([p[1][0] for p in parts], dim=-1)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_simulated_varlen_ring_matches_full_attention(world_size, causal):
    lengths = [2 * world_size * n for n in (113, 7, 64, 1)]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v = randn(total, 4, 128), randn(total, 2, 128), randn(total, 2, 128)
    out, lse, dout, grads = ring_and_grads(q, k, v, world_size, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)

    def reference(upcast):
        leaves = [(x.float() if upcast else x).detach().requires_grad_() for x in (q, k, v)]
        out_r, lse_r = _per_sequence(lambda *t: attention_ref(*t, causal=causal, upcast=upcast), cu, *leaves)
        return out_r, lse_r, torch.autograd.grad(out_r, leaves, dout.to(out_r.dtype))

    out_ref, lse_ref, grads_ref = reference(True)
    out_pt, _, grads_pt = reference(False)
    assert_close_fa_rule(out, out_ref, out_pt, k=2.0)
    assert_lse_close(lse, lse_ref)
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_close_fa_rule(g, g_ref, g_pt, k=3.0, eps=1e-4 * max(1.0, g_ref.abs().max().item()), name=name)


def test_simulated_ring_under_torch_compile():
    q, k, v = (randn(1, 4 * 64, 4, 64).requires_grad_() for _ in range(3))

    def model(q, k, v):
        out, _ = parallel.simulate_ring_attention(q * 0.5, k, v, 2, causal=True)
        return out.float().square().sum()

    expected = model(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v))
    got = torch.compile(model)(q, k, v)
    torch.testing.assert_close(got, expected)
    for g, g_ref in zip(torch.autograd.grad(got, (q, k, v)), expected_grads):
        torch.testing.assert_close(g, g_ref)
