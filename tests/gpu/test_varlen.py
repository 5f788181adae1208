"""GPU tier: flash_attn_varlen_func and its packed variants, forward and backward.

Each sequence of a ragged batch is held to the reference run on that sequence alone (the dense
path's rules: FlashAttention's k * PyTorch-error bound for out and gradients, lse within 1e-3).
Lengths include 0 and 1; outputs and gradients come from a NaN-poisoned allocator, so a row the
kernels fail to write shows up. Paged keys use odd page sizes and shuffled pages.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref, generate_alibi_slopes
from test_bwd import grad_eps, ref_grads
from test_fwd import DEVICE, DTYPE_NAMES, poison_allocator
from test_fwd import _seed  # noqa: F401  (autouse: a seed per test id)

pytestmark = pytest.mark.gpu

MASKS = {"none": {}, "causal": {"causal": True}, "local": {"window_size": (33, 7)}}
LENGTHS = {  # name -> (query lengths, key lengths)
    "ragged": ([113, 0, 1, 257, 64], [200, 17, 1, 257, 1023]),
    "one": ([129], [129]),
    "decode-like": ([1, 1, 3, 0], [300, 1, 77, 5]),
    "longer-q": ([300, 5], [100, 5]),
}


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def ragged(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, nheads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(total_k, nheads_k, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(total_k, nheads_k, head_dim, dtype=dtype, device=DEVICE)
    return q, k, v, cu(lengths_q), cu(lengths_k)


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def check_sequences(out, lse, q, k, v, lengths_q, lengths_k, used_q=None, used_k=None, **kwargs):
    """out (total_q, h, d) and lse (h, total_q) against attention_ref per sequence."""
    assert torch.isfinite(out).all(), "NaN/inf in out (a row was not written)"
    rule_k = 3.0 if kwargs.get("softcap") else 2.0
    if kwargs.get("alibi_slopes") is not None:
        rule_k = 5.0
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(spans(lengths_q), spans(lengths_k))):
        nq = q1 - q0 if used_q is None else used_q[b]
        nk = k1 - k0 if used_k is None else used_k[b]
        per_seq = dict(kwargs)
        if per_seq.get("alibi_slopes") is not None and per_seq["alibi_slopes"].dim() == 2:
            per_seq["alibi_slopes"] = per_seq["alibi_slopes"][b]
        if nq == 0:
            continue
        qb, kb, vb = q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk]
        out_ref, lse_ref = attention_ref(qb, kb, vb, **per_seq)
        out_pt, _ = attention_ref(qb, kb, vb, upcast=False, **per_seq)
        assert_close_fa_rule(out[None, q0:q0 + nq], out_ref, out_pt, k=rule_k, name=f"out of sequence {b}")
        assert_lse_close(lse[None, :, q0:q0 + nq], lse_ref, name=f"lse of sequence {b}")
        if nq < q1 - q0:  # rows past seqused_q
            assert (out[q0 + nq:q1] == 0).all() and torch.isneginf(lse[:, q0 + nq:q1]).all()


def gather_pages(cache, table, lengths):
    """The keys (or values) of each sequence of a paged cache, packed into (total, nheads_k, d)."""
    return torch.cat([cache[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lengths)])


def run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, **kwargs):
    poison_allocator()
    out, lse, probs = flashgen.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_attn_probs=True, **kwargs)
    assert probs is None and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    return out, lse


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("nheads_k", [8, 2, 1], ids=lambda h: f"hk{h}")
def test_varlen_fwd(lengths, mask, nheads_k):
    lengths_q, lengths_k = LENGTHS[lengths]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 8, nheads_k, 128, torch.bfloat16)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, **MASKS[mask])
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, **MASKS[mask])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("head_dim", [64, 96, 192, 256, 72])
def test_varlen_fwd_dtype_dim(dtype, head_dim):
    lengths_q, lengths_k = LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, head_dim, dtype)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


@pytest.mark.parametrize("feature", ["softcap", "alibi", "alibi-batch", "scale"])
def test_varlen_fwd_features(feature):
    lengths_q, lengths_k = LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 128, torch.float16)
    kwargs = {"causal": True}
    if feature == "softcap":
        kwargs["softcap"] = 5.0
    elif feature == "alibi":
        kwargs["alibi_slopes"] = generate_alibi_slopes(4, DEVICE)
    elif feature == "alibi-batch":
        kwargs["alibi_slopes"] = torch.rand(len(lengths_q), 4, device=DEVICE) * 0.3
    else:
        kwargs["softmax_scale"] = 0.3
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, **kwargs)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, **kwargs)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_fwd_splits_seqused(num_splits, seqused):
    lengths_q, lengths_k = [3, 1, 0, 17], [1000, 300, 5, 2048]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16)
    kwargs = {}
    used_q = used_k = None
    if seqused:
        used_q, used_k = [2, 1, 0, 9], [999, 1, 0, 1500]
        kwargs = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEVICE),
                      seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEVICE))
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True, num_splits=num_splits, **kwargs)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, used_q, used_k, causal=True)


@pytest.mark.parametrize("page_size", [1, 17, 64, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_varlen_paged_keys(page_size, mask):
    """Chunked prefill: ragged queries against paged keys, pages shuffled."""
    lengths_q, lengths_k = [5, 64, 1, 0], [40, 300, 1, 9]
    nheads, nheads_k, head_dim = 8, 2, 128
    q = torch.randn(sum(lengths_q), nheads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    max_pages = -(-max(lengths_k) // page_size)
    num_pages = len(lengths_k) * max_pages + 3
    k_cache = torch.randn(num_pages, page_size, nheads_k, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, device=DEVICE)[: len(lengths_k) * max_pages].view(len(lengths_k), max_pages)
    table = table.to(torch.int32)
    out, lse = run_varlen(q, k_cache, v_cache, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k,
                          block_table=table, **MASKS[mask])
    k, v = (gather_pages(cache, table, lengths_k) for cache in (k_cache, v_cache))
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, **MASKS[mask])


def test_varlen_matches_dense_padded(monkeypatch):
    """One sequence: the varlen call equals flash_attn_func on the same tensors (bitwise, so both in
    the family varlen runs: the sm80 one)."""
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    q, k, v, cu_q, cu_k = ragged([77], [130], 4, 4, 64, torch.float16)
    out = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 77, 130, causal=True)
    dense = flashgen.flash_attn_func(q[None], k[None], v[None], causal=True)[0]
    torch.testing.assert_close(out, dense, atol=0, rtol=0)


def test_varlen_max_seqlen_larger_than_any():
    lengths_q, lengths_k = [5, 9], [7, 30]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 1, 128, torch.bfloat16)
    poison_allocator()
    out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1000, 5000, causal=True, return_attn_probs=True)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


def test_varlen_packed_variants():
    lengths = [33, 1, 100]
    qkv = torch.randn(sum(lengths), 3, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    out = flashgen.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths), max(lengths), causal=True)
    ref = flashgen.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu(lengths), cu(lengths), 100, 100,
                                          causal=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    kv = qkv[:, 1:]
    out = flashgen.flash_attn_varlen_kvpacked_func(qkv[:, 0], kv, cu(lengths), cu(lengths), 100, 100)
    ref = flashgen.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu(lengths), cu(lengths), 100, 100)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# --- backward ---------------------------------------------------------------------------------------

def check_sequence_grads(q, k, v, dout, grads, lengths_q, lengths_k, eps_scale: float = 1.0, **kwargs):
    rule_k = 4.0 if kwargs.get("softcap") else 3.0
    seen_k = torch.zeros(k.shape[0], dtype=torch.bool, device=DEVICE)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(spans(lengths_q), spans(lengths_k))):
        seen_k[k0:k1] = True
        qb, kb, vb = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        if q1 == q0:
            for name, g, (a, z) in (("dk", grads[1], (k0, k1)), ("dv", grads[2], (k0, k1))):
                assert (g[a:z] == 0).all(), f"{name} of sequence {b} (no queries) must be 0"
            continue
        refs = ref_grads(qb, kb, vb, dout[None, q0:q1], upcast=True, **kwargs)
        pts = ref_grads(qb, kb, vb, dout[None, q0:q1], upcast=False, **kwargs)
        for name, g, (a, z), g_ref, g_pt in zip(("dq", "dk", "dv"), grads, ((q0, q1), (k0, k1), (k0, k1)), refs, pts):
            assert_close_fa_rule(g[None, a:z], g_ref, g_pt, k=rule_k, eps=eps_scale * grad_eps(g_ref),
                                 name=f"{name} of sequence {b}")


def varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, **kwargs):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, **kwargs)
    poison_allocator()
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lengths", ["ragged", "longer-q", "decode-like"])
@pytest.mark.parametrize("nheads_k", [4, 1], ids=lambda h: f"hk{h}")
def test_varlen_bwd(lengths, mask, nheads_k):
    lengths_q, lengths_k = LENGTHS[lengths]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, nheads_k, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout, **MASKS[mask])
    check_sequence_grads(q, k, v, dout, grads, lengths_q, lengths_k, **MASKS[mask])


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float16), (256, torch.bfloat16), (72, torch.float16)])
def test_varlen_bwd_dims_softcap(head_dim, dtype):
    lengths_q, lengths_k = LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, head_dim, dtype)
    dout = torch.randn_like(q)
    kwargs = {"causal": True, "softcap": 4.0}
    grads = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout, **kwargs)
    check_sequence_grads(q, k, v, dout, grads, lengths_q, lengths_k, **kwargs)


def test_varlen_bwd_deterministic():
    lengths_q, lengths_k = LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    first = varlen_grads(q, k, v, cu_q, cu_k, 257, 1023, dout, causal=True, deterministic=True)
    for _ in range(10):
        again = varlen_grads(q, k, v, cu_q, cu_k, 257, 1023, dout, causal=True, deterministic=True)
        for g0, g1 in zip(first, again):
            assert torch.equal(g0, g1)
    check_sequence_grads(q, k, v, dout, first, lengths_q, lengths_k, causal=True)


def test_varlen_compile_fullgraph():
    lengths = [50, 0, 129]
    q, k, v, cu_q, cu_k = ragged(lengths, lengths, 4, 2, 64, torch.bfloat16)

    def block(q, k, v):
        return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 129, 129, causal=True).float().square().sum()

    compiled = torch.compile(block, fullgraph=True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    compiled(*leaves).backward()
    eager = [x.detach().requires_grad_() for x in (q, k, v)]
    block(*eager).backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


def test_varlen_bwd_seqused():
    """Backward with seqused_q/k: rows past seqused_q get dq = 0, keys past seqused_k dk = dv = 0."""
    lengths_q, lengths_k = [50, 7, 0, 64], [80, 7, 5, 100]
    used_q, used_k = [40, 7, 0, 1], [80, 3, 2, 60]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    kwargs = dict(causal=True, seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEVICE),
                  seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEVICE))
    dq, dk, dv = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout, **kwargs)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(spans(lengths_q), spans(lengths_k))):
        nq, nk = used_q[b], used_k[b]
        assert (dq[q0 + nq:q1] == 0).all() and (dk[k0 + nk:k1] == 0).all() and (dv[k0 + nk:k1] == 0).all()
        if nq == 0:
            assert (dk[k0:k1] == 0).all() and (dv[k0:k1] == 0).all()
            continue
        qb, kb, vb = q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk]
        refs = ref_grads(qb, kb, vb, dout[None, q0:q0 + nq], upcast=True, causal=True)
        pts = ref_grads(qb, kb, vb, dout[None, q0:q0 + nq], upcast=False, causal=True)
        for name, g, (a, z), g_ref, g_pt in zip(("dq", "dk", "dv"), (dq, dk, dv), ((q0, q0 + nq), (k0, k0 + nk),
                                                (k0, k0 + nk)), refs, pts):
            assert_close_fa_rule(g[None, a:z], g_ref, g_pt, k=3.0, eps=grad_eps(g_ref), name=f"{name} of sequence {b}")


def test_varlen_seqused_k_past_length_is_clamped():
    """seqused_k beyond a sequence's cu_seqlens_k length counts as that length, in the forward and
    the backward alike: no key of the next sequence is read, and the gradients match the output."""
    lengths_q, lengths_k = [50, 7, 30], [80, 7, 5]
    used_k = [200, 9, 5]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 64, torch.bfloat16)
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device=DEVICE)
    out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  seqused_k=seqused_k, return_attn_probs=True)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k)
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout, seqused_k=seqused_k)
    expected = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dout)
    for name, g, g_expected in zip(("dq", "dk", "dv"), grads, expected):
        torch.testing.assert_close(g, g_expected, atol=0, rtol=0, msg=f"{name} with seqused_k past the lengths")
