"""GPU tier: head dims that are not a multiple of 8, in every API, by FlashAttention's rule.

The kernels read whole 16-byte row chunks, so such calls run, as in flash_attn 2, on copies padded
with zero columns up to the next multiple of 8, and their outputs, lse and gradients are sliced
back (flashgen/runtime/execute.py, HEAD_DIM_MULTIPLE). Each test holds the caller-shaped results
to the float32 reference on the unpadded inputs with the default softmax_scale 1/sqrt(d), which a
scale of the padded dim would fail (at d = 59 the logits are 4% off, at d = 1 by sqrt(8)). d = 200
is a multiple of 8 between two instances (the predicated path, no padding): the control.

Also here: a paged varlen forward whose inputs require grad runs, and only a backward through it
raises, naming block_table; a varlen backward given a huge max_seqlen clamps it as the forward does.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashgen
from flashgen.runtime.execute import pad_head_dim
from flashgen.testing_kvcache import rotary_tables
from test_bwd import check_bwd, check_grads, flash_grads
from test_fwd import DEVICE, DTYPE_NAMES, MASKS, call_poisoned, check_against_ref, check_fwd, make_qkv, randn
from test_fwd import _seed  # noqa: F401  (autouse: a seed per test id)
from test_kvcache import Case, assert_feature_matters, check_combine, check_kvcache, make_kwargs, random_partials
from test_varlen import check_sequence_grads, check_sequences, cu, gather_pages, ragged, run_varlen, varlen_grads

pytestmark = pytest.mark.gpu

ODD_DIMS = [1, 3, 59, 111, 200, 255]
DTYPE_LIST = [torch.float16, torch.bfloat16]


def _dim_mask_cases():
    # Every dim meets every mask; the dtype alternates along both axes.
    for i, head_dim in enumerate(ODD_DIMS):
        for j, mask in enumerate(MASKS):
            dtype = DTYPE_LIST[(i + j) % 2]
            yield pytest.param(dtype, head_dim, mask, id=f"{DTYPE_NAMES[dtype]}-d{head_dim}-{mask}")


# --- flash_attn_func and its packed variants -----------------------------------------------------------

@pytest.mark.parametrize("dtype, head_dim, mask", list(_dim_mask_cases()))
def test_dense_fwd_bwd(dtype, head_dim, mask):
    q, k, v = make_qkv(2, 177, 255, 4, 2, head_dim, dtype)
    check_fwd(q, k, v, **MASKS[mask])
    check_bwd(q, k, v, **MASKS[mask])


@pytest.mark.parametrize("head_dim", [3, 59, 111])
def test_dense_softcap_alibi_scale(head_dim):
    q, k, v = make_qkv(2, 100, 130, 4, 4, head_dim, torch.float16)
    kwargs = dict(causal=True, softcap=5.0, softmax_scale=2 / math.sqrt(head_dim),
                  alibi_slopes=torch.rand(4, device=DEVICE) * 0.3)
    check_fwd(q, k, v, **kwargs)
    check_bwd(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim", [1, 59, 255])
def test_qkvpacked(head_dim):
    qkv = randn(2, 130, 3, 4, head_dim)
    q, k, v = qkv.unbind(2)
    out, lse = call_poisoned(flashgen.flash_attn_qkvpacked_func, qkv, causal=True)
    check_against_ref(out, lse, q, k, v, causal=True)
    dout = torch.randn_like(q)
    (dqkv,) = flash_grads(flashgen.flash_attn_qkvpacked_func, (qkv,), dout, causal=True)
    assert dqkv.shape == qkv.shape
    check_grads(q, k, v, dout, dqkv.unbind(2), causal=True)


@pytest.mark.parametrize("head_dim", [3, 111, 200])
def test_kvpacked(head_dim):
    q, kv = randn(2, 100, 8, head_dim, dtype=torch.float16), randn(2, 177, 2, 2, head_dim, dtype=torch.float16)
    k, v = kv.unbind(2)
    out, lse = call_poisoned(flashgen.flash_attn_kvpacked_func, q, kv, window_size=(33, 7))
    check_against_ref(out, lse, q, k, v, window_size=(33, 7))
    dout = torch.randn_like(q)
    dq, dkv = flash_grads(flashgen.flash_attn_kvpacked_func, (q, kv), dout, window_size=(33, 7))
    assert dkv.shape == kv.shape
    check_grads(q, k, v, dout, (dq, *dkv.unbind(2)), window_size=(33, 7))


def test_dropout_matches_the_padded_call():
    """Dropout's mask does not depend on the head dim: a d59 call is, bitwise, the d64 call on the
    zero-padded inputs (with d59's scale) sliced back, forward and backward."""
    q, k, v = make_qkv(2, 97, 130, 4, 2, 59)
    dout = torch.randn_like(q)
    results = []
    for pad in (False, True):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        inputs = [pad_head_dim(x) for x in leaves] if pad else leaves
        torch.manual_seed(7)
        out = flashgen.flash_attn_func(*inputs, dropout_p=0.17, softmax_scale=59 ** -0.5, causal=True,
                                       deterministic=True)
        out = out[..., :59]
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert a.shape == b.shape and torch.equal(a, b), name


def test_torch_compile_fullgraph():
    """The pad and the slice sit outside the custom ops: dynamo traces them without a graph break."""
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 100, 130, 4, 2, 59)

    def block(q, k, v):
        return flashgen.flash_attn_func(q, k, v, causal=True).float().square().sum()

    grads = []
    for fn in (torch.compile(block, fullgraph=True), block):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for got, want, x in zip(*grads, (q, k, v)):
        assert got.shape == x.shape
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_cuda_graph_replay():
    q, k, v = make_qkv(2, 100, 130, 4, 2, 111)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and load outside the capture
            flashgen.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = flashgen.flash_attn_func(q, k, v, causal=True)
    for _ in range(2):  # replays pad the new inputs, not the ones seen at capture
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_static, flashgen.flash_attn_func(q, k, v, causal=True))


# --- varlen ---------------------------------------------------------------------------------------------

LENGTHS_Q, LENGTHS_K = [113, 0, 1, 257, 64], [200, 17, 1, 257, 1023]


@pytest.mark.parametrize("dtype, head_dim, mask", list(_dim_mask_cases())[::2])
def test_varlen_fwd_bwd(dtype, head_dim, mask):
    q, k, v, cu_q, cu_k = ragged(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, dtype)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, LENGTHS_Q, LENGTHS_K, **MASKS[mask])
    check_sequences(out, lse, q, k, v, LENGTHS_Q, LENGTHS_K, **MASKS[mask])
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), dout, **MASKS[mask])
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    check_sequence_grads(q, k, v, dout, grads, LENGTHS_Q, LENGTHS_K, **MASKS[mask])


@pytest.mark.parametrize("head_dim", [3, 59, 255])
def test_varlen_packed(head_dim):
    lengths = [33, 1, 100]
    qkv = randn(sum(lengths), 3, 4, head_dim)
    q, k, v = qkv.unbind(1)
    out = flashgen.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths), max(lengths), causal=True)
    expected = flashgen.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 100, 100, causal=True)
    assert torch.equal(out, expected)
    dout = torch.randn_like(q)
    leaf = qkv.detach().requires_grad_()
    (dqkv,) = torch.autograd.grad(flashgen.flash_attn_varlen_qkvpacked_func(leaf, cu(lengths), 100, causal=True),
                                  leaf, dout)
    check_sequence_grads(q, k, v, dout, dqkv.unbind(1), lengths, lengths, causal=True)
    kv = qkv[:, 1:]
    out = flashgen.flash_attn_varlen_kvpacked_func(q, kv, cu(lengths), cu(lengths), 100, 100)
    assert torch.equal(out, flashgen.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 100, 100))
    leaves = q.detach().requires_grad_(), kv.detach().requires_grad_()
    dq, dkv = torch.autograd.grad(
        flashgen.flash_attn_varlen_kvpacked_func(*leaves, cu(lengths), cu(lengths), 100, 100), leaves, dout)
    check_sequence_grads(q, k, v, dout, (dq, *dkv.unbind(1)), lengths, lengths)


def paged(lengths_k, page_size, nheads_k, head_dim, dtype=torch.bfloat16):
    """(k_cache, v_cache, block_table): shuffled pages holding keys for lengths_k."""
    max_pages = -(-max(lengths_k) // page_size)
    num_pages = len(lengths_k) * max_pages + 3
    k_cache = torch.randn(num_pages, page_size, nheads_k, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, device=DEVICE)[: len(lengths_k) * max_pages].view(len(lengths_k), max_pages)
    return k_cache, v_cache, table.to(torch.int32)


@pytest.mark.parametrize("head_dim, page_size", [(59, 17), (1, 64), (111, 256)])
def test_varlen_paged_keys(head_dim, page_size):
    lengths_q, lengths_k = [5, 64, 1, 0], [40, 300, 1, 9]
    q = randn(sum(lengths_q), 8, head_dim)
    k_cache, v_cache, table = paged(lengths_k, page_size, 2, head_dim)
    out, lse = run_varlen(q, k_cache, v_cache, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k,
                          block_table=table, causal=True)
    k, v = (gather_pages(cache, table, lengths_k) for cache in (k_cache, v_cache))
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


@pytest.mark.parametrize("head_dim", [64, 59])
@pytest.mark.parametrize("grad_of", ["q", "kv"])
def test_varlen_paged_forward_with_grad(head_dim, grad_of):
    """flash_attn's chunked-prefill tests call the paged forward on inputs that require grad: it
    runs (the output of the call without grad, and the reference's), and only a backward through
    it raises."""
    lengths_q, lengths_k = [5, 64, 1], [40, 300, 9]
    q = randn(sum(lengths_q), 4, head_dim)
    k_cache, v_cache, table = paged(lengths_k, 17, 2, head_dim)
    args = (cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k))
    with torch.no_grad():
        expected, lse, _ = flashgen.flash_attn_varlen_func(q, k_cache, v_cache, *args, block_table=table,
                                                           causal=True, return_attn_probs=True)
    k, v = (gather_pages(cache, table, lengths_k) for cache in (k_cache, v_cache))
    check_sequences(expected, lse, q, k, v, lengths_q, lengths_k, causal=True)
    inputs = [q.requires_grad_()] if grad_of == "q" else [k_cache.requires_grad_(), v_cache.requires_grad_()]
    out = flashgen.flash_attn_varlen_func(q, k_cache, v_cache, *args, block_table=table, causal=True)
    assert out.requires_grad and torch.equal(out, expected)
    with pytest.raises(NotImplementedError, match="^block_table"):
        torch.autograd.grad(out, inputs, torch.randn_like(out))


@pytest.mark.parametrize("head_dim", [64, 59])
def test_varlen_backward_clamps_huge_max_seqlen(head_dim):
    """max_seqlen_q = max_seqlen_k = 2**31 - 1 passes validation but must not size the backward's
    buffers: deterministic mode allocates a semaphore per query block of max_seqlen_q (over a
    gigabyte of them here, unclamped; the call needs well under a megabyte)."""
    q, k, v, cu_q, cu_k = ragged(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, 2**31 - 1, 2**31 - 1, causal=True, deterministic=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    backward_bytes = torch.cuda.max_memory_allocated() - before
    assert backward_bytes < 64 << 20, f"the backward allocated {backward_bytes} bytes"
    check_sequence_grads(q, k, v, dout, grads, LENGTHS_Q, LENGTHS_K, causal=True)


# --- flash_attn_with_kvcache and flash_attn_combine -----------------------------------------------------

def kvcache_kwargs(c: Case, rotary_dim: int = 0) -> dict:
    """make_kwargs with the default softmax_scale (the call's and the reference's: 1/sqrt(d)) and
    rotary tables of exactly rotary_dim (even, <= d) rather than a fraction of d."""
    kwargs = make_kwargs(c)
    del kwargs["softmax_scale"]
    if rotary_dim:
        if c.page_size is None:
            capacity = kwargs["k_cache"].shape[1]
        else:
            capacity = kwargs["block_table"].shape[1] * c.page_size
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(capacity + c.seqlen_q, rotary_dim, device=DEVICE)
    return kwargs


@pytest.mark.parametrize("c, rotary_dim", [
    pytest.param(Case(head_dim=59), 30, id="d59-rotary30-neox"),
    pytest.param(Case(head_dim=3, page_size=16, seqlen_q=3, seqlen_new=3, rotary_interleaved=True), 2,
                 id="d3-page16-new3-rotary2-gptj"),
    pytest.param(Case(head_dim=111, batch_idx=True, leftpad=True, seqlen_new=2, seqlen_q=2, causal=False), 110,
                 id="d111-batch_idx-leftpad-new2-nomask-rotary110"),
    pytest.param(Case(head_dim=255, page_size=17, seqlen_new=0, empty_element=True, dtype=torch.float16), 0,
                 id="d255-page17-nonew-empty-fp16"),
    pytest.param(Case(head_dim=1, nheads_k=1, seqlen_q=5, seqlen_new=5, capacity=1000, num_splits=3), 0,
                 id="d1-mqa8_1-new5-split3"),
    pytest.param(Case(head_dim=59, nheads=32, nheads_k=8, seqlen_q=100, seqlen_new=100, capacity=600), 58,
                 id="d59-gqa32_8-chunked_prefill-rotary58"),
    pytest.param(Case(head_dim=200, page_size=16, seqlen_new=3, seqlen_q=3), 100, id="d200-page16-rotary100"),
])
def test_kvcache_append_rotary(c, rotary_dim):
    """The cache check (check_kvcache) holds every row outside the append bitwise unchanged and the
    appended ones equal to the reference's: the rows appended to the padded copies came back."""
    kwargs = kvcache_kwargs(c, rotary_dim)
    checked = check_kvcache(kwargs)
    if rotary_dim:
        assert_feature_matters(kwargs, checked, rotary_cos=None, rotary_sin=None)


@pytest.mark.parametrize("head_dim, out_dtype, given_out", [
    (1, None, False), (3, torch.bfloat16, True), (62, torch.float16, True), (255, torch.float32, False),
])
def test_combine(head_dim, out_dtype, given_out):
    out_partial, lse_partial = random_partials(5, head_dim=head_dim)
    out = None
    if given_out:
        out = torch.full(out_partial.shape[1:], math.nan, dtype=out_dtype, device=DEVICE)
    check_combine(out_partial, lse_partial, out_dtype=out_dtype, out=out)
