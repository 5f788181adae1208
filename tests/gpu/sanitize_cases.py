"""GPU cases for compute-sanitizer (scripts/sanitize.sh): small shapes that reach the kernels'
edge paths, each still checked against the reference.

Not named test_*.py, so the normal run does not collect it; pass it to pytest explicitly:

    python -m pytest -q tests/gpu/sanitize_cases.py            # all cases (memcheck runs these)
    python -m pytest -q tests/gpu/sanitize_cases.py -k core    # the racecheck / synccheck subset

What each group reaches (issue 8):
  * odd sizes (seqlen 1, 17, 113, 255, 1023), head dims off the instances (40 on the d64
    instance, 200 on d256: predicated columns);
  * seqlen_k 0 and 1, and rows that see no key (causal with seqlen_q > seqlen_k, local windows);
  * GQA / MQA, PackGQA on and off, the decode tile;
  * split-KV with more splits than a sequence has key blocks (empty splits) and splits that a
    window leaves empty;
  * paged KV with page sizes 1 and 17, append + rotary (GPT-J and GPT-NeoX), leftpad,
    cache_batch_idx, NaN outside the valid cache range;
  * backward (dq, dk, dv), GQA, d256, and deterministic mode;
  * flash_attn_combine, 1 to 256 splits;
  * on Hopper, the sm90 forward (TMA + wgmma): every flash_attn_func case above with head dim
    64/128/256, no mask or causal and more than 32 rows runs it, plus its own edge cases below
    (a row block of one row, one key, key blocks cut by seqlen_k, GQA without packing); and the sm90
    backward: the backward cases above at head dims up to 128 that are not deterministic, plus its own.

Shapes are small (a sanitizer slows kernels 10-100x) and mostly bf16, so that the kernels they need
are few (prebuilt by scripts/sanitize.sh with `flashgen build --filter`). The checks and input
builders are the GPU tier's own (test_fwd, test_bwd, test_kvcache), so a case here fails for the
same reasons the tier would.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref
from test_bwd import check_bwd, check_grads, flash_grads
from test_fwd import _seed, call_poisoned, check_against_ref, check_fwd, make_qkv  # noqa: F401  (_seed: autouse, a seed per test id)
from test_kvcache import Case, check_combine, check_kvcache, make_kwargs, random_partials

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
CAUSAL = {"causal": True}
LOCAL = {"window_size": (33, 7)}
DIAG = {"window_size": (0, 0)}  # each query sees at most its diagonal key
NONE: dict = {}


def _mask_id(mask: dict) -> str:
    if mask.get("causal"):
        return "causal"
    if "window_size" in mask:
        left, right = mask["window_size"]
        return f"local{left}_{right}"
    return "nomask"


def _reference_on_the_cpu(attention_ref):
    """attention_ref computed on the CPU (float64 when upcast), its results moved back: keeps
    cuBLAS out of sanitizer runs that cannot handle it (see scripts/sanitize.sh)."""
    def on_cpu(q, k, v, *args, **kwargs):
        device = q.device
        kwargs = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
        out, lse = attention_ref(q.cpu(), k.cpu(), v.cpu(), *args, **kwargs)
        return out.to(device), lse.to(device)
    return on_cpu


@pytest.fixture(autouse=True)
def _cpu_references(monkeypatch):
    if os.environ.get("FLASHGEN_SANITIZE_CPU_REFERENCE") != "1":
        return
    import flashgen.testing
    import flashgen.testing_kvcache
    import test_bwd
    import test_dropout
    import test_fwd
    import test_varlen

    cpu_ref = _reference_on_the_cpu(flashgen.testing.attention_ref)
    for module in (flashgen.testing_kvcache, test_bwd, test_dropout, test_fwd, test_varlen, sys.modules[__name__]):
        if hasattr(module, "attention_ref"):
            monkeypatch.setattr(module, "attention_ref", cpu_ref)


def _core(param_id: str, core: bool) -> str:
    # "core" cases form the racecheck / synccheck subset (-k core): one launch of each kernel family.
    return f"core-{param_id}" if core else param_id


# ---------------------------------------------------------------------------------------------
# flash_attn_func forward: odd sizes, seqlen_k 0 / 1, rows without keys


def _fwd_case(seqlen_q, seqlen_k, head_dim, mask, core=False):
    pid = f"sq{seqlen_q}-sk{seqlen_k}-d{head_dim}-{_mask_id(mask)}"
    return pytest.param(seqlen_q, seqlen_k, head_dim, mask, id=_core(pid, core))


FWD_CASES = [
    _fwd_case(1, 1, 64, NONE),
    _fwd_case(113, 113, 128, CAUSAL, core=True),
    _fwd_case(1023, 1023, 64, LOCAL),
    _fwd_case(1, 1023, 128, CAUSAL),            # decode tile
    _fwd_case(1023, 17, 40, CAUSAL, core=True),  # sq > sk: rows 0..1005 see no key; d40 on d64
    _fwd_case(113, 1, 200, NONE, core=True),     # one key; d200 on the d256 instance
    _fwd_case(17, 1, 128, CAUSAL),               # one key, only the last row sees it
    _fwd_case(255, 1023, 256, DIAG),
    _fwd_case(1023, 255, 128, DIAG),             # sq > sk with a (0, 0) window: most rows see nothing
    _fwd_case(300, 113, 64, {"window_size": (-1, 16)}),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim, mask", FWD_CASES)
def test_sanitize_fwd(seqlen_q, seqlen_k, head_dim, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 4, head_dim)
    check_fwd(q, k, v, **mask)


@pytest.mark.parametrize("mask", [pytest.param(NONE, id="core-nomask"), pytest.param(CAUSAL, id="causal")])
def test_sanitize_fwd_seqlen_k_zero(mask):
    """No key at all: the kernel still runs (no key block), writes 0 and lse -inf."""
    q, k, v = make_qkv(2, 17, 0, 4, 4, 64)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, **mask)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, 4, 17) and torch.isneginf(lse).all()


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask", [
    pytest.param(129, 1, 4, 4, 64, NONE, id="core-sm90-sq129-sk1-d64"),
    pytest.param(1000, 257, 8, 2, 256, CAUSAL, id="sm90-sq1000-sk257-gqa8_2-d256-causal"),
    pytest.param(33, 1023, 4, 1, 128, CAUSAL, id="sm90-sq33-sk1023-mqa-d128-causal"),
    pytest.param(1023, 300, 4, 2, 128, LOCAL, id="sm90-sq1023-sk300-gqa-d128-local33_7"),
    pytest.param(300, 1023, 4, 4, 64, dict(LOCAL, softcap=5.0), id="sm90-sq300-sk1023-d64-local-softcap"),
    # Head dims below the instance's: O stored for the call's columns only (d40 on d64, d160 on d192).
    pytest.param(300, 257, 4, 2, 40, CAUSAL, id="sm90-sq300-sk257-gqa-d40-causal"),
    pytest.param(257, 300, 2, 2, 160, NONE, id="sm90-sq257-sk300-d160"),
])
def test_sanitize_fwd_sm90(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask):
    """Shapes for the sm90 forward's edges (on other GPUs they run the sm80 family); ALiBi slopes
    read per tile."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    slopes = torch.rand(2, nheads, device=q.device) * 0.3 + 0.01
    check_fwd(q, k, v, pack_gqa=False, alibi_slopes=slopes, **mask)


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, num_splits", [
    pytest.param(300, 1023, 8, 2, 128, CAUSAL, 3, id="sm90-split3-gqa8_2-sq300-sk1023-d128-causal"),
    # Most shares see no key (the window); d96 writes the call's 96 partial columns of the d128 tile.
    pytest.param(129, 1500, 4, 4, 96, LOCAL, 7, id="sm90-split7-sq129-sk1500-d96-local33_7"),
])
def test_sanitize_fwd_sm90_split(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, num_splits):
    """The sm90 forward's split-KV partials (on other GPUs the sm80 family's) and their combine."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, num_splits=num_splits, **mask)
    check_against_ref(out, lse, q, k, v, **mask)


# ---------------------------------------------------------------------------------------------
# GQA / PackGQA, split-KV through flash_attn_func


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, pack_gqa, mask", [
    pytest.param(1, 1023, 8, 1, 128, True, CAUSAL, id="core-mqa8_1-sq1-packed-decode-causal"),
    pytest.param(113, 300, 8, 2, 128, True, LOCAL, id="gqa8_2-sq113-packed-local33_7"),
    pytest.param(113, 300, 8, 2, 128, False, CAUSAL, id="gqa8_2-sq113-unpacked-causal"),
    pytest.param(3, 517, 32, 2, 64, True, NONE, id="gqa32_2-sq3-packed-48rows-nomask"),
    pytest.param(300, 113, 8, 2, 256, True, CAUSAL, id="core-gqa8_2-sq300-sk113-packed-d256-causal"),
])
def test_sanitize_fwd_gqa(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, pack_gqa, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    check_fwd(q, k, v, pack_gqa=pack_gqa, **mask)


@pytest.mark.parametrize("seqlen_q, seqlen_k, num_splits, mask", [
    # Clamped on the host to the key blocks (16 of 64 keys).
    pytest.param(1, 1000, 1000, CAUSAL, id="sq1-sk1000-splits1000-causal"),
    # A 21-key window: of 32 splits, all but one or two see no key of a query block.
    pytest.param(128, 2048, 32, {"window_size": (17, 3)}, id="core-sq128-sk2048-splits32-local17_3"),
    # 5 key blocks in 4 splits of 2 blocks: the last split is empty for every row.
    pytest.param(3, 320, 4, NONE, id="sq3-sk320-splits4-nomask"),
])
def test_sanitize_fwd_num_splits(seqlen_q, seqlen_k, num_splits, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, 128)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, num_splits=num_splits, **mask)
    out_ref, lse_ref = attention_ref(q, k, v, **mask)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **mask)
    assert_close_fa_rule(out, out_ref, out_pt, k=3.0, name=f"out(num_splits={num_splits})")
    assert_lse_close(lse, lse_ref, name=f"lse(num_splits={num_splits})")


# ---------------------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask", [
    pytest.param(113, 255, 4, 4, 128, CAUSAL, id="core-sq113-sk255-d128-causal"),
    pytest.param(1023, 17, 4, 4, 64, CAUSAL, id="sq1023-sk17-d64-causal"),  # rows without keys
    pytest.param(1, 1, 4, 4, 64, NONE, id="sq1-sk1-d64-nomask"),
    pytest.param(255, 1, 4, 4, 200, LOCAL, id="core-sq255-sk1-d200-local33_7"),
    pytest.param(113, 300, 8, 2, 256, LOCAL, id="gqa8_2-sq113-sk300-d256-local33_7"),
    pytest.param(300, 113, 8, 1, 128, DIAG, id="mqa8_1-sq300-sk113-d128-local0_0"),
])
def test_sanitize_bwd(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    check_bwd(q, k, v, **mask)


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask", [
    pytest.param(300, 1023, 8, 2, 64, dict(LOCAL, softcap=5.0), id="sm90-bwd-gqa8_2-sq300-sk1023-d64-local-softcap"),
    pytest.param(1023, 129, 4, 1, 128, CAUSAL, id="sm90-bwd-mqa4_1-sq1023-sk129-d128-causal"),
    pytest.param(1, 300, 4, 4, 128, NONE, id="sm90-bwd-sq1-sk300-d128"),
    # Head dims below the instance's: the TMA's zero columns, dK/dV and dQ cut to the call's width.
    pytest.param(300, 257, 4, 2, 40, CAUSAL, id="sm90-bwd-gqa-sq300-sk257-d40-causal"),
    pytest.param(129, 300, 2, 2, 96, NONE, id="sm90-bwd-sq129-sk300-d96"),
])
def test_sanitize_bwd_sm90(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask):
    """Shapes for the sm90 backward's edges on Hopper (elsewhere the sm80 backward): query blocks of
    one row and cut by seqlen_q, key blocks cut by seqlen_k, GQA/MQA group loops."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    check_bwd(q, k, v, **mask)


def test_sanitize_bwd_seqlen_k_zero():
    q, k, v = make_qkv(2, 17, 0, 4, 4, 64)
    dq, dk, dv = flash_grads(flashgen.flash_attn_func, (q, k, v), torch.randn_like(q), causal=True)
    assert dq.shape == q.shape and (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask", [
    pytest.param(300, 1023, 8, 2, 128, CAUSAL, id="core-gqa8_2-sq300-sk1023-d128-causal"),
    # d256: the dQ semaphores count per head-dim slice; sq > sk leaves the first query blocks empty.
    pytest.param(300, 113, 4, 2, 256, CAUSAL, id="core-gqa4_2-sq300-sk113-d256-causal"),
    pytest.param(1023, 511, 8, 1, 64, LOCAL, id="mqa8_1-sq1023-sk511-d64-local33_7"),
])
def test_sanitize_bwd_deterministic(seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask):
    """Two deterministic backward passes through one forward: bitwise equal, and within the rule.
    (A CTA that waits on a dQ semaphore that never reaches its value hangs here; the sanitizer
    script's per-tool timeout turns that into a failure.)"""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    dout = torch.randn_like(q)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, deterministic=True, **mask)
    passes = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(2)]
    for name, g0, g1 in zip(("dq", "dk", "dv"), *passes):
        assert torch.equal(g0, g1), f"{name} differs between two deterministic passes"
    check_grads(q, k, v, dout, passes[0], **mask)


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: paged (page 1, 17), append + rotary, split-KV with empty splits


def _kv_case(case_id: str, core: bool = False, **fields):
    return pytest.param(Case(**fields), id=_core(case_id, core))


KVCACHE_CASES = [
    _kv_case("page1-append1-rotary_neox_half", core=True, page_size=1, rotary_fraction=0.5),
    _kv_case("page17-append3-sq3-rotary_gptj_full", core=True, page_size=17, seqlen_q=3, seqlen_new=3,
             rotary_fraction=1.0, rotary_interleaved=True),
    _kv_case("page17-nonew-empty_element-nomask", page_size=17, seqlen_new=0, empty_element=True, causal=False),
    # seqlen_k 1, 1 and 0 (no new tokens).
    _kv_case("contiguous-nonew-seqlens1_1_0", seqlen_new=0, seqlens=(1, 1, 0)),
    _kv_case("contiguous-append3-sq3-leftpad-batch_idx-rotary", seqlen_q=3, seqlen_new=3, rotary_fraction=0.5,
             leftpad=True, batch_idx=True),
    # 32 key blocks of capacity, sequences of 2-71 keys: splits >= 2 see no key (lse -inf partials).
    _kv_case("contiguous-splits1000-short_seqs", core=True, capacity=2000, seqlens=(1, 70, 5), num_splits=1000),
    # Capacity 323 (19 pages of 17) = 6 key blocks in 4 splits of 2: the last split is empty; element 0
    # has no key at all.
    _kv_case("page17-splits4-nonew-seqlens0_150_323", page_size=17, capacity=323, seqlen_new=0,
             seqlens=(0, 150, 323), num_splits=4),
    # 16 query rows, short caches, no new tokens: under causal, the first rows see no key.
    _kv_case("contiguous-sq16-nonew-seqlens3_10_0-causal", core=True, seqlen_q=16, seqlen_new=0, seqlens=(3, 10, 0)),
    _kv_case("page16-gqa32_8-sq5-append5-local0_0-packed", page_size=16, nheads=32, nheads_k=8, seqlen_q=5,
             seqlen_new=5, causal=False, window_size=(0, 0), pack_gqa=True),
    _kv_case("page17-append3-sq3-leftpad-nan_outside", page_size=17, seqlen_q=3, seqlen_new=3, leftpad=True,
             nan_outside_valid=True),
    _kv_case("page1-d256-gqa16_2-append1", page_size=1, head_dim=256, nheads=16, nheads_k=2),
    _kv_case("page17-d40-mqa8_1-append1-rotary_neox_half", page_size=17, head_dim=40, nheads_k=1,
             rotary_fraction=0.5),
    # Chunked prefill on a contiguous cache: the sm90 forward on Hopper (TMA rows past cache_seqlens,
    # the batch index and left pad as map coordinates), split in three.
    _kv_case("sm90-contiguous-sq70-append70-leftpad-batch_idx-nan_outside-splits3", seqlen_q=70, seqlen_new=70,
             capacity=700, leftpad=True, batch_idx=True, nan_outside_valid=True, num_splits=3),
    # A paged cache with pages of whole key blocks: the sm90 forward's TMA at (row in page, head,
    # page); pages the table does not name hold NaN.
    _kv_case("sm90-page256-sq70-append70-nan_outside-splits3", seqlen_q=70, seqlen_new=70, capacity=700,
             page_size=256, nan_outside_valid=True, num_splits=3),
    # Pages the key blocks straddle (17) and a left pad: the sm90 producers' cp.async gather, with
    # keys past the sequence and pages outside the cache zero-filled rather than read.
    _kv_case("sm90-gather-page17-sq70-append70-leftpad-nan_outside-splits2", seqlen_q=70, seqlen_new=70,
             capacity=700, page_size=17, leftpad=True, nan_outside_valid=True, num_splits=2),
    _kv_case("sm90-gather-page1-d64-gqa8_2-sq40-append40", seqlen_q=40, seqlen_new=40, capacity=300, page_size=1,
             head_dim=64),
]


@pytest.mark.parametrize("c", KVCACHE_CASES)
def test_sanitize_kvcache(c):
    check_kvcache(make_kwargs(c))


# ---------------------------------------------------------------------------------------------
# flash_attn_combine


@pytest.mark.parametrize("num_splits, head_dim, out_dtype", [
    pytest.param(1, 128, None, id="splits1-d128-fp32"),
    pytest.param(3, 72, BF16, id="core-splits3-d72-bf16"),
    pytest.param(17, 256, None, id="splits17-d256-fp32"),
    pytest.param(256, 64, FP16, id="splits256-d64-fp16"),  # kMaxSplits
])
def test_sanitize_combine(num_splits, head_dim, out_dtype):
    check_combine(*random_partials(num_splits, head_dim=head_dim), out_dtype=out_dtype)


# --- varlen: sequences of length 0 and 1, max_seqlen past every length, paged keys, backward ----
from test_varlen import (  # noqa: E402
    LENGTHS, check_sequence_grads, check_sequences, cu, gather_pages, ragged, run_varlen, varlen_grads,
)


@pytest.mark.parametrize("splits, pack_gqa", [
    pytest.param(1, None, id="core-nosplit"), pytest.param(7, None, id="splits7"),
    pytest.param(1, False, id="sm90-unpacked"),  # the sm90 forward on Hopper: TMA rows past each sequence
])
def test_sanitize_varlen_fwd(splits, pack_gqa):
    lengths_q, lengths_k = LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, [max(lengths_q) + 50], [max(lengths_k) + 9], causal=True,
                          num_splits=splits, pack_gqa=pack_gqa)
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


@pytest.mark.parametrize("page_size", [pytest.param(1, id="core-page1"), pytest.param(17, id="page17")])
def test_sanitize_varlen_paged(page_size):
    lengths_q, lengths_k = [3, 0, 1], [40, 5, 1]
    q = torch.randn(sum(lengths_q), 4, 64, dtype=torch.float16, device="cuda")
    max_pages = -(-max(lengths_k) // page_size)
    k_cache = torch.randn(3 * max_pages, page_size, 2, 64, dtype=torch.float16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(3 * max_pages, device="cuda").view(3, max_pages).to(torch.int32)
    out, lse = run_varlen(q, k_cache, v_cache, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k,
                          block_table=table, causal=True)
    k, v = (gather_pages(cache, table, lengths_k) for cache in (k_cache, v_cache))
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


@pytest.mark.parametrize("deterministic", [pytest.param(False, id="core-bwd"), pytest.param(True, id="deterministic")])
def test_sanitize_varlen_bwd(deterministic):
    lengths_q, lengths_k = LENGTHS["decode-like"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu_q, cu_k, max(lengths_q) + 3, max(lengths_k), dout, causal=True,
                         deterministic=deterministic)
    check_sequence_grads(q, k, v, dout, grads, lengths_q, lengths_k, causal=True)


# --- dropout: forward and backward with the Philox mask -----------------------------------------
from test_dropout import test_dropout_fwd_bwd as _dropout_fwd_bwd  # noqa: E402


@pytest.mark.parametrize("shape", [pytest.param((2, 113, 257, 4, 2, 128), id="core-dropout-gqa"),
                                   pytest.param((1, 1, 300, 8, 1, 256), id="dropout-d256-sq1")])
def test_sanitize_dropout(shape):
    _dropout_fwd_bwd(shape, "causal", 0.3)


@pytest.mark.parametrize("splits", [pytest.param(1, id="core-bad-cu_seqlens"), pytest.param(4, id="bad-cu_seqlens-splits4")])
def test_sanitize_varlen_bad_cu_seqlens(splits):
    """Garbage cu_seqlens / seqused (decreasing, negative, past the totals) without
    FLASHGEN_CHECK_INPUTS: wrong rows are allowed, accesses outside the tensors are not (memcheck)."""
    q = torch.randn(40, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(30, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 35, 20, 90, -7], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([5, 2, 60, -3, 31], dtype=torch.int32, device="cuda")
    used = torch.tensor([100, -1, 3, 7], dtype=torch.int32, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, 64, 64, causal=True, num_splits=splits,
                                          seqused_k=used)
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, seqused_q=used, seqused_k=used, num_splits=splits)
    torch.cuda.synchronize()
