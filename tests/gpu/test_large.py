"""GPU tier, large tensors: 64-bit indexing (issue 8).

Every kernel offset past 2**31 elements must be computed in 64 bits. Each test here puts the data
it checks at element offsets beyond 2**31 - 1 and compares against a float32 reference of just
those rows, so the reference stays small:

* decode with 512k keys (flash_attn_with_kvcache, bf16, d128, 8 query heads, 1 or 2 KV heads),
  contiguous with cache_batch_idx pointing at a cache row that starts past 2**31 elements, and
  paged (page size 256) with half of the block table's pages past 2**31; optionally appending
  (with rotary) at the end of the sequence. Everything outside the attended range is NaN. The
  reference is computed in key chunks merged by logsumexp (float32);
* prefill forward (flash_attn_func, causal) with q, k, v, out of 1 x 66560 x 128 x 256
  = 2**31 + 2**25 elements each: selected query rows of selected heads, including rows whose
  offsets straddle and pass 2**31, against attention_ref on those rows and all the keys they see;
* backward at the same size (dq, dk, dv and the fp32 dq accumulator past 2**31 elements), with a
  local window so that the reference of a few rows needs only a slab of the sequence; plain and
  deterministic.

Names contain "large": select with `-k large`, or deselect with `-k "not large"`. Each test needs
the GPU memory it states (skipped when less is free): about 10 GB (decode), 18 GB (forward),
40 GB (backward). On an H200 the causal forward (2.9e14 FLOP) takes one to two seconds, each other
test well under a second of GPU time, plus the first-use compile of the kernels it needs.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import zlib

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref
from flashgen.testing_kvcache import apply_rotary_ref, rotary_tables

pytestmark = [pytest.mark.gpu, pytest.mark.large]

DEVICE = "cuda"
INT32_LIMIT = 2**31  # first element offset that a 32-bit signed index cannot hold
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _release_memory():
    """Tens of GB per test: hand them back to the driver afterwards, for the tests that follow."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def require_free_memory(nbytes: int) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GIB:.0f} GiB of free GPU memory; {free / GIB:.1f} of {total / GIB:.1f} GiB free")


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# Decode: 512k keys


SEQLEN_K = 512 * 1024
DECODE_NHEADS, DECODE_HEAD_DIM, PAGE_SIZE = 8, 128, 256
REF_CHUNK = 64 * 1024
# Output rule for the decode tests (no PyTorch-in-bf16 run over 512k keys to compare errors with):
# P is rounded to bf16 before P @ V (relative 2**-9 per term, random sign) and out once more, which
# gives well under 1% of max |out|. A kernel that read even 1/16 of the keys from wrong rows would be
# off by about 25% of it (and by NaN where it read outside the attended range).
DECODE_RTOL_OF_MAX = 0.02


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    paged: bool
    nheads_k: int
    seqlen_new: int = 0         # tokens appended at the end (seqlen_q is max(seqlen_new, 1))
    rotary: str | None = None   # "neox" or "gptj": rotary on half of the head dim
    num_splits: int = 0         # 0: the heuristic


DECODE_CASES = [
    pytest.param(DecodeCase(paged=False, nheads_k=1), id="contiguous-mqa8_1"),
    pytest.param(DecodeCase(paged=False, nheads_k=2, seqlen_new=4, rotary="neox", num_splits=1),
                 id="contiguous-gqa8_2-append4-rotary_neox-nosplit"),
    pytest.param(DecodeCase(paged=True, nheads_k=2), id="paged256-gqa8_2"),
    pytest.param(DecodeCase(paged=True, nheads_k=1, seqlen_new=1, rotary="gptj", num_splits=128),
                 id="paged256-mqa8_1-append1-rotary_gptj-splits128"),
]


def chunked_attention_ref(q, keys, values, softmax_scale, chunk=REF_CHUNK):
    """float32 causal attention of q (seqlen_q, nheads, d), positioned at the last seqlen_q keys,
    against keys/values (seqlen_k, nheads_k, d), key chunk by key chunk, merged with a running max
    and sum (logsumexp). Returns out (seqlen_q, nheads, d) and lse (nheads, seqlen_q)."""
    seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = keys.shape[:2]
    group = nheads // nheads_k
    qf = q.float().view(seqlen_q, nheads_k, group, head_dim) * softmax_scale
    row_max = torch.full((nheads_k, group, seqlen_q), -math.inf, device=q.device)
    row_sum = torch.zeros((nheads_k, group, seqlen_q), device=q.device)
    acc = torch.zeros((nheads_k, group, seqlen_q, head_dim), device=q.device)
    last_visible = seqlen_k - seqlen_q + torch.arange(seqlen_q, device=q.device)  # causal, bottom-right
    for start in range(0, seqlen_k, chunk):
        stop = min(start + chunk, seqlen_k)
        scores = torch.einsum("shgd,khd->hgsk", qf, keys[start:stop].float())
        positions = torch.arange(start, stop, device=q.device)
        scores = scores.masked_fill(positions[None, :] > last_visible[:, None], -math.inf)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        shift = torch.where(torch.isneginf(new_max), 0.0, new_max)  # rows with no visible key yet
        correction = torch.exp(row_max - shift)  # 0 while row_max is -inf
        probs = torch.exp(scores - shift[..., None])
        row_sum = row_sum * correction + probs.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("hgsk,khd->hgsd", probs, values[start:stop].float())
        row_max = new_max
    out = (acc / row_sum[..., None]).reshape(nheads, seqlen_q, head_dim).transpose(0, 1)
    lse = (row_max + torch.log(row_sum)).reshape(nheads, seqlen_q)
    return out, lse


def _first_row_past_limit(row_elems: int) -> int:
    """The smallest index i with i * row_elems >= 2**31."""
    return -(-INT32_LIMIT // row_elems)


@pytest.mark.parametrize("c", DECODE_CASES)
def test_large_decode_512k_keys(c: DecodeCase):
    hk, d = c.nheads_k, DECODE_HEAD_DIM
    seqlen_q = max(c.seqlen_new, 1)
    # Both layouts put (at least half of) the keys past 2**31 elements: ~4.3 GiB per cache.
    require_free_memory(12 * GIB)
    keys_new = values_new = None
    kwargs = {}
    if not c.paged:
        # The sequence is cache row `row` of a (row + 1, 512k, hk, d) cache, selected with
        # cache_batch_idx: its first element is at row * 512k * hk * d >= 2**31.
        row = _first_row_past_limit(SEQLEN_K * hk * d)
        k_cache, v_cache = (torch.full((row + 1, SEQLEN_K, hk, d), math.nan, dtype=torch.bfloat16, device=DEVICE)
                            for _ in range(2))
        keys, values = k_cache[row], v_cache[row]  # views: what the kernel reads (and appends to)
        keys.copy_(randn(SEQLEN_K, hk, d))
        values.copy_(randn(SEQLEN_K, hk, d))
        kwargs["cache_batch_idx"] = torch.tensor([row], dtype=torch.int32, device=DEVICE)

        def cache_rows(cache, positions):
            return cache[row, positions]
    else:
        # Pool pages [0, half) and [high, high + half), high the first page that starts past 2**31
        # elements; the block table is a random permutation of them, with the last logical page (where
        # the append writes) a high one. Pages the table does not name hold NaN.
        page_elems = PAGE_SIZE * hk * d
        num_pages = SEQLEN_K // PAGE_SIZE
        half = num_pages // 2
        high = _first_row_past_limit(page_elems)
        pages = torch.cat([torch.arange(half), high + torch.arange(num_pages - half)])
        pages = pages[torch.randperm(num_pages)]
        last_high = int((pages >= high).nonzero()[0, 0])
        pages[[last_high, num_pages - 1]] = pages[[num_pages - 1, last_high]]
        table = pages.to(device=DEVICE, dtype=torch.int32)[None]
        pool_pages = high + num_pages - half
        k_cache, v_cache = (torch.full((pool_pages, PAGE_SIZE, hk, d), math.nan, dtype=torch.bfloat16, device=DEVICE)
                            for _ in range(2))
        keys, values = randn(SEQLEN_K, hk, d), randn(SEQLEN_K, hk, d)
        k_cache[table[0].long()] = keys.view(num_pages, PAGE_SIZE, hk, d)
        v_cache[table[0].long()] = values.view(num_pages, PAGE_SIZE, hk, d)
        kwargs["block_table"] = table

        def cache_rows(cache, positions):
            return cache[table[0].long()[positions // PAGE_SIZE], positions % PAGE_SIZE]

    q = randn(1, seqlen_q, DECODE_NHEADS, d)
    softmax_scale = d ** -0.5
    cache_len = SEQLEN_K - c.seqlen_new
    new_positions = torch.arange(cache_len, SEQLEN_K, device=DEVICE)
    ref_keys, ref_values = keys, values
    q_ref = q
    if c.seqlen_new:
        keys_new, values_new = randn(1, c.seqlen_new, hk, d), randn(1, c.seqlen_new, hk, d)
        kwargs.update(k=keys_new, v=values_new)
        if c.rotary:
            cos, sin = rotary_tables(SEQLEN_K + seqlen_q, d // 2, device=DEVICE)
            interleaved = c.rotary == "gptj"
            kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
            # causal: query row i sits at cache_len + i, as do the new keys.
            positions = new_positions[None]
            q_ref = apply_rotary_ref(q, cos, sin, positions, interleaved).to(q.dtype)
            keys_new_ref = apply_rotary_ref(keys_new, cos, sin, positions, interleaved).to(torch.bfloat16)
        else:
            keys_new_ref = keys_new
        ref_keys, ref_values = keys.clone(), values.clone()
        ref_keys[cache_len:] = keys_new_ref[0]
        ref_values[cache_len:] = values_new[0]
    before_append = (cache_rows(k_cache, new_positions - c.seqlen_new).clone(),
                     cache_rows(v_cache, new_positions - c.seqlen_new).clone())

    out, lse = flashgen.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([cache_len], dtype=torch.int32, device=DEVICE),
        softmax_scale=softmax_scale, causal=True, num_splits=c.num_splits, return_softmax_lse=True, **kwargs,
    )
    torch.cuda.synchronize()

    out_ref, lse_ref = chunked_attention_ref(q_ref[0], ref_keys, ref_values, softmax_scale)
    assert out.shape == q.shape and lse.shape == (1, DECODE_NHEADS, seqlen_q)
    assert torch.isfinite(out).all(), "out has NaN/inf: a key or value was read from outside the attended range"
    err = (out[0].float() - out_ref).abs().max().item()
    bound = DECODE_RTOL_OF_MAX * out_ref.abs().max().item() + 1e-5
    assert err <= bound, f"max |out - ref| = {err:.3e} > {bound:.3e} ({DECODE_RTOL_OF_MAX} x max |ref|)"
    assert_lse_close(lse, lse_ref[None])

    if c.seqlen_new:
        # The appended rows (past 2**31 elements) hold the new k (rotated: within one bf16 rounding)
        # and v (bitwise); the rows before them are unchanged.
        got_k, got_v = cache_rows(k_cache, new_positions), cache_rows(v_cache, new_positions)
        eps = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(got_k.float(), ref_keys[cache_len:].float(), rtol=eps, atol=1e-5)
        assert torch.equal(got_v.view(torch.int16), values_new[0].view(torch.int16)), "appended v differs"
        if cache_len >= c.seqlen_new:
            after = (cache_rows(k_cache, new_positions - c.seqlen_new), cache_rows(v_cache, new_positions - c.seqlen_new))
            for name, b, a in zip(("k_cache", "v_cache"), before_append, after):
                assert torch.equal(b.view(torch.int16), a.view(torch.int16)), f"{name} rows before the append changed"


# ---------------------------------------------------------------------------------------------
# Prefill: q, k, v (and dq, dk, dv) of more than 2**31 elements


PREFILL_SEQLEN, PREFILL_NHEADS, PREFILL_HEAD_DIM = 66560, 128, 256
PREFILL_ELEMS = PREFILL_SEQLEN * PREFILL_NHEADS * PREFILL_HEAD_DIM  # 2**31 + 2**25
PREFILL_BYTES = PREFILL_ELEMS * 2
ROW_PAST_LIMIT = _first_row_past_limit(PREFILL_NHEADS * PREFILL_HEAD_DIM)  # 65536: row offsets >= 2**31
# (head, first row, end row): the last rows (largest offsets), rows straddling 2**31, early rows.
PREFILL_ROWS = [
    (PREFILL_NHEADS - 1, PREFILL_SEQLEN - 64, PREFILL_SEQLEN),
    (PREFILL_NHEADS - 1, ROW_PAST_LIMIT - 32, ROW_PAST_LIMIT + 32),
    (0, PREFILL_SEQLEN - 48, PREFILL_SEQLEN - 16),
    (PREFILL_NHEADS // 2, 1000, 1064),
]


def prefill_qkv():
    assert PREFILL_ELEMS > INT32_LIMIT
    shape = (1, PREFILL_SEQLEN, PREFILL_NHEADS, PREFILL_HEAD_DIM)
    return randn(*shape), randn(*shape), randn(*shape)


def test_large_prefill_fwd_causal():
    require_free_memory(4 * PREFILL_BYTES + 2 * GIB)  # q, k, v, out: ~17.5 GB
    q, k, v = prefill_qkv()
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.cuda.synchronize()
    for head, r0, r1 in PREFILL_ROWS:
        # Rows r0..r1 of one head see keys 0..r1 - 1: with seqlen_k - seqlen_q = r0 the reference's
        # bottom-right causal diagonal is the full problem's.
        sl = (slice(None), slice(r0, r1), slice(head, head + 1))
        keys = (slice(None), slice(0, r1), slice(head, head + 1))
        out_ref, lse_ref = attention_ref(q[sl], k[keys], v[keys], causal=True)
        out_pt, _ = attention_ref(q[sl], k[keys], v[keys], causal=True, upcast=False)
        name = f"out[head {head}, rows {r0}:{r1}]"
        assert_close_fa_rule(out[sl], out_ref, out_pt, k=2.0, name=name)
        assert_lse_close(lse[:, head : head + 1, r0:r1], lse_ref, name=f"lse[head {head}, rows {r0}:{r1}]")


WINDOW = 200  # window_size = (WINDOW, 0): query i sees keys i - WINDOW .. i


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_large_prefill_bwd_local(deterministic):
    """dq, dk, dv of 2**31 + 2**25 elements (and the fp32 dq accumulator of twice the bytes).

    With a (WINDOW, 0) window the rows r0..r1 of a head depend on a slab of the sequence only:
    their dq on keys r0 - WINDOW .. r1, their dk / dv on queries r0 .. r1 + WINDOW, whose softmax
    needs keys r0 - WINDOW .. r1 + WINDOW. On that slab (queries r0 .. e, keys r0 - WINDOW .. e,
    e = min(r1 + WINDOW, seqlen)) the reference's bottom-right aligned window (WINDOW, 0) is the full
    problem's, since the slab has WINDOW more keys than queries and starts WINDOW keys earlier.
    dout is q itself (any tensor of out's shape will do): one 4.4 GB buffer fewer."""
    # q, k, v, out, dq, dk, dv and dq_accum (fp32): 9 x 4.4 GB.
    require_free_memory(9 * PREFILL_BYTES + 3 * GIB)
    q, k, v = prefill_qkv()
    mask = {"window_size": (WINDOW, 0)}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, deterministic=deterministic, **mask)
    dout = q
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    del leaves
    for head, r0, r1 in PREFILL_ROWS:
        assert r0 >= WINDOW, "the slab must not be clipped at the start"
        end = min(r1 + WINDOW, PREFILL_SEQLEN)
        hs = slice(head, head + 1)
        slab = [q[:, r0:end, hs], k[:, r0 - WINDOW : end, hs], v[:, r0 - WINDOW : end, hs]]
        slab_dout = dout[:, r0:end, hs]
        out_ref, _ = attention_ref(*slab, **mask)
        out_pt, _ = attention_ref(*slab, upcast=False, **mask)
        rows = r1 - r0
        assert_close_fa_rule(out[:, r0:r1, hs], out_ref[:, :rows], out_pt[:, :rows], k=2.0,
                             name=f"out[head {head}, rows {r0}:{r1}]")
        grads = {}
        for upcast in (True, False):
            slab_leaves = [(x.float() if upcast else x).detach().requires_grad_() for x in slab]
            slab_out, _ = attention_ref(*slab_leaves, upcast=upcast, **mask)
            grads[upcast] = torch.autograd.grad(slab_out, slab_leaves, slab_dout.to(slab_out.dtype))
        checks = (
            ("dq", dq[:, r0:r1, hs], slice(0, rows), 0),
            ("dk", dk[:, r0:r1, hs], slice(WINDOW, WINDOW + rows), 1),
            ("dv", dv[:, r0:r1, hs], slice(WINDOW, WINDOW + rows), 2),
        )
        for name, got, slab_rows, i in checks:
            g_ref, g_pt = grads[True][i][:, slab_rows], grads[False][i][:, slab_rows]
            eps = 1e-4 * max(1.0, g_ref.abs().max().item())
            assert_close_fa_rule(got, g_ref, g_pt, k=3.0, eps=eps, name=f"{name}[head {head}, rows {r0}:{r1}]")


def test_large_varlen_two_million_tokens():
    """flash_attn_varlen_func on 2.1M packed tokens (q, out: 2.1M x 16 x 128 > 2**31 elements),
    sequences of 1M, 0, 17 and 1.1M tokens, a causal local window of 128 keys (so the kernel and
    the reference stay cheap): rows at the start, the end and past 2**31 elements of each sequence
    against attention_ref on just the keys they see."""
    lengths = [1_000_000, 0, 17, 1_100_017]
    nheads, nheads_k, head_dim, window = 16, 4, 128, (128, 0)
    total = sum(lengths)
    require_free_memory(2 * total * (nheads + 2 * nheads_k) * head_dim * 2 + 4 * GIB)
    assert total * nheads * head_dim > INT32_LIMIT
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(total, nheads, head_dim)
    k, v = randn(total, nheads_k, head_dim), randn(total, nheads_k, head_dim)
    out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), window_size=window,
                                                  return_attn_probs=True)
    starts = cu.tolist()
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        first = _first_row_past_limit(nheads * head_dim) - starts[b]
        spans = [(0, min(n, 5)), (max(0, n - 3), n)]
        if 0 < first < n - 3:
            spans.append((first - 2, first + 2))  # rows on both sides of element 2**31 of q
        for r0, r1 in spans:
            k0 = max(0, r0 - window[0])
            g0 = starts[b]
            rows = slice(g0 + r0, g0 + r1)
            keys = slice(g0 + k0, g0 + r1)
            out_ref, lse_ref = attention_ref(q[None, rows], k[None, keys], v[None, keys], window_size=window)
            out_pt, _ = attention_ref(q[None, rows], k[None, keys], v[None, keys], window_size=window, upcast=False)
            assert_close_fa_rule(out[None, rows], out_ref, out_pt, k=2.0, name=f"out rows {r0}..{r1} of sequence {b}")
            assert_lse_close(lse[None, :, rows], lse_ref, name=f"lse rows {r0}..{r1} of sequence {b}")
