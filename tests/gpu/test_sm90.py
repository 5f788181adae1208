"""GPU tier: the sm90 forward family (wgmma + TMA, fwd_sm90.cuh) on Hopper.

The rest of the suite runs it wherever dispatch picks it (on an H100/H200, every flash_attn_func call
with head dim up to 256 (dropout: unpacked, unsplit, unpaged), paged or not, and the KV-cache calls
with more query rows than the decode tile's); here it is held to FlashAttention's
rule on the sizes that stress its tiles (a row block of 1 row, rows past the sequence end, key blocks
cut by seqlen_k, causal with more queries than keys, GQA), checked to really be the family that ran,
and compared with the sm80 family forced on the same inputs.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.runtime import execute, tuning
from flashgen.runtime.dispatch import sm90_bwd_instance_head_dim
from flashgen.runtime.dispatch import sm90_instance_head_dim
from test_fwd import (  # noqa: F401 (_seed: autouse)
    DTYPE_NAMES, _seed, assert_feature_matters, call_poisoned, check_against_ref, make_qkv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the sm90 family runs on compute capability 9.0"),
]

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k)
    pytest.param(2, 33, 1, 4, 4, id="sq33-sk1"),  # fewer rows take the sm80 decode tile
    pytest.param(1, 113, 1023, 8, 2, id="sq113-sk1023-gqa4"),
    pytest.param(2, 1023, 1023, 4, 4, id="sq1023-sk1023"),
    pytest.param(1, 1023, 113, 4, 1, id="sq1023-sk113-mqa"),
    pytest.param(3, 300, 128, 2, 2, id="sq300-sk128"),
    # More work units than SMs: several per persistent CTA, the K/V ring and Q carried across them.
    pytest.param(4, 2047, 2047, 16, 4, id="sq2047-gqa4-many-units"),
]


@pytest.fixture
def launched(monkeypatch):
    """The URIs of the kernels flashgen launches while the test runs."""
    uris = []
    original = execute.launch_kernel

    def spy(spec, *args, **kwargs):
        uris.append(spec.uri)
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(execute, "launch_kernel", spy)
    return uris


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", SHAPES)
def test_sm90_fwd(monkeypatch, launched, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads, nheads_k):
    _check_sm90_against_sm80(monkeypatch, launched, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads,
                             nheads_k)


# Head dims below an instance's (multiples of 8): the next instance up, the TMA zero-filling the
# columns past the tensor's (a whole panel's worth at d8), O stored into a padded buffer whose
# call's columns are copied out.
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("head_dim", [8, 40, 96, 136, 160, 200, 248], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", [SHAPES[1], SHAPES[2]])
def test_sm90_fwd_head_dim_below_the_instance(monkeypatch, launched, dtype, head_dim, causal, batch, seqlen_q,
                                              seqlen_k, nheads, nheads_k):
    _check_sm90_against_sm80(monkeypatch, launched, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads,
                             nheads_k)


def _check_sm90_against_sm80(monkeypatch, launched, dtype, head_dim, causal, batch, seqlen_q, seqlen_k, nheads,
                             nheads_k):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    mask = "causal" if causal else "none"
    instance = sm90_instance_head_dim(head_dim)
    # Causal GQA calls pack the group (Tuning.sm90_pack_gqa_masked; every group here divides the rows).
    packed = causal and nheads != nheads_k and tuning.current().sm90_pack_gqa_masked
    uri = (f"flash_fwd_sm90_hdim{instance}_{DTYPE_NAMES[dtype]}{'_causal' if causal else ''}"
           f"{'_packgqa' if packed else ''}_sm90a")
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, causal=causal)
    assert launched == [uri], f"the {mask} d{head_dim} call ran {launched}, not the sm90 family"
    checked = check_against_ref(out, lse, q, k, v, causal=causal)

    # The sm80 family on the same inputs: both meet the rule, so they agree to twice its bound.
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    out80, lse80 = call_poisoned(flashgen.flash_attn_func, q, k, v, causal=causal)
    assert launched[1].startswith("flash_fwd_sm80_")
    check_against_ref(out80, lse80, q, k, v, causal=causal, name="sm80 out")
    bound = 2 * checked.rule_k * (checked.out_pt.float() - checked.out_ref.float()).abs().max().item() + 2e-5
    assert (out.float() - out80.float()).abs().max().item() <= bound


@pytest.mark.parametrize("head_dim", [128, 96], ids=lambda d: f"d{d}")
def test_sm90_serves_strided_and_packed_inputs(monkeypatch, launched, head_dim):
    # q, k, v as views into one packed (batch, seqlen, 3, heads, d) tensor: 16-byte strides, so the
    # TMA reads them in place. At d96 on the d128 instance, the zero fill past a row's 96 columns is
    # all that keeps the next head's columns out of the box.
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    qkv = torch.randn(2, 257, 3, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    out, lse = call_poisoned(flashgen.flash_attn_qkvpacked_func, qkv, causal=True)
    assert launched == ["flash_fwd_sm90_hdim128_bf16_causal_sm90a"]
    q, k, v = qkv.unbind(2)
    check_against_ref(out, lse, q, k, v, causal=True)


# (kwargs, mask of the instance): local windows of each shape, softcap, ALiBi, and all three.
FEATURES = [
    pytest.param({"window_size": (16, 0)}, "local", id="local-16-0"),
    pytest.param({"window_size": (33, 7)}, "local", id="local-33-7"),
    pytest.param({"window_size": (-1, 5)}, "local", id="local-inf-5"),
    pytest.param({"softcap": 3.0}, "none", id="softcap"),
    pytest.param({"softcap": 5.0, "causal": True}, "causal", id="softcap-causal"),
    pytest.param({"alibi": True}, "none", id="alibi"),
    pytest.param({"alibi": True, "causal": True}, "causal", id="alibi-causal"),
    pytest.param({"alibi": True, "softcap": 5.0, "window_size": (40, 3)}, "local", id="local-softcap-alibi"),
]


@pytest.mark.parametrize("kwargs, mask", FEATURES)
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", [
    pytest.param(2, 300, 1023, 4, 2, id="sq300-sk1023-gqa2"), pytest.param(1, 1023, 300, 4, 4, id="sq1023-sk300"),
])
def test_sm90_features(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads,
                       nheads_k):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):  # a different slope per batch and head
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3 + 0.01
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    # pack_gqa=False: this test is about the unpacked instances (test_sm90_packgqa: the packed ones).
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, pack_gqa=False, **kwargs)
    uri = (f"flash_fwd_sm90_hdim{head_dim}_{DTYPE_NAMES[dtype]}{'' if mask == 'none' else '_' + mask}"
           f"{'_softcap' if kwargs.get('softcap') else ''}_sm90a")
    assert launched == [uri], f"{kwargs} ran {launched}"
    checked = check_against_ref(out, lse, q, k, v, **kwargs)
    for feature in ("window_size", "softcap", "alibi_slopes"):  # a kernel that ignored one would fail
        if feature in kwargs:
            assert_feature_matters(q, k, v, checked, **{key: val for key, val in kwargs.items() if key != feature})

    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    out80, lse80 = call_poisoned(flashgen.flash_attn_func, q, k, v, pack_gqa=False, **kwargs)
    assert launched[1].startswith("flash_fwd_sm80_")
    bound = 2 * checked.rule_k * (checked.out_pt.float() - checked.out_ref.float()).abs().max().item() + 2e-5
    assert (out.float() - out80.float()).abs().max().item() <= bound
    torch.testing.assert_close(lse, lse80, rtol=0, atol=1e-3)


SPLIT_CASES = [  # (head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, kwargs)
    pytest.param(128, 2, 300, 2047, 8, 2, {}, id="d128-gqa4-packed"),
    pytest.param(64, 1, 1023, 1023, 4, 4, {"causal": True}, id="d64-causal"),
    pytest.param(96, 2, 113, 3000, 4, 1, {"window_size": (700, 60)}, id="d96-mqa-local"),
    pytest.param(192, 1, 129, 1500, 4, 4, {"causal": True, "softcap": 30.0}, id="d192-causal-softcap"),
    pytest.param(256, 1, 200, 900, 2, 2, {"alibi": True}, id="d256-alibi"),
]


@pytest.mark.parametrize("num_splits", [0, 2, 3, 7], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, kwargs", SPLIT_CASES)
def test_sm90_split_kv(monkeypatch, launched, num_splits, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k,
                       kwargs):
    # Split-KV on the sm90 forward: each share of the key blocks writes fp32 partials (the call's
    # columns, for a head dim below the instance's too), merged by the combine kernel; shares that
    # see no key (the local window, causal rows) must add nothing.
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.bfloat16)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3 + 0.01
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, num_splits=num_splits, **kwargs)
    assert launched[0].startswith(f"flash_fwd_sm90_hdim{sm90_instance_head_dim(head_dim)}_"), launched
    # A forced count always splits these shapes; the heuristic (0) may keep one share.
    assert launched[1:] == [] and num_splits == 0 or (
        len(launched) == 2 and launched[1].startswith("flash_combine_")), launched
    checked = check_against_ref(out, lse, q, k, v, **kwargs)
    # The same call unsplit (one sm90 launch) agrees within the rule's tolerance.
    unsplit, lse1 = call_poisoned(flashgen.flash_attn_func, q, k, v, num_splits=1, **kwargs)
    assert launched[-1].startswith("flash_fwd_sm90_"), launched
    bound = 2 * checked.rule_k * (checked.out_pt.float() - checked.out_ref.float()).abs().max().item() + 2e-5
    assert (out.float() - unsplit.float()).abs().max().item() <= bound
    torch.testing.assert_close(lse, lse1, rtol=0, atol=1e-3)


def run_seqused_varlen(num_splits):
    """Four ragged sequences (one empty, one of one query) whose seqused_q/k stop short of them,
    causal, unpacked, bf16 d128: the call's out and lse, and a check of them per sequence."""
    from test_varlen import check_sequences, ragged, run_varlen

    lengths_q, lengths_k = [300, 1, 0, 257], [1000, 300, 5, 2048]
    used_q, used_k = [200, 1, 0, 129], [999, 1, 0, 1500]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16)
    used = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32, device="cuda"),
                seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"))
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True, pack_gqa=False,
                          num_splits=num_splits, **used)
    return lambda: check_sequences(out, lse, q, k, v, lengths_q, lengths_k, used_q, used_k, causal=True)


def test_sm90_split_kv_varlen(monkeypatch, launched):
    # Varlen with split-KV: per-sequence shares of the keys; rows past seqused_q get 0 and -inf
    # (no share writes them).
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    check = run_seqused_varlen(num_splits=3)
    assert launched[0] == "flash_fwd_sm90_hdim128_bf16_causal_split_sm90a" and launched[1].startswith("flash_combine_"), launched
    check()


@pytest.mark.parametrize("c", [
    "sq100-new100", "sq100-nonew-gqa32_8-splits3", "sq100-new100-rotary-leftpad-batch_idx",
    "sq77-new13-local-nan_outside", "d96-sq64-new64-alibi-splits2",
])
def test_sm90_kvcache(monkeypatch, launched, c):
    # flash_attn_with_kvcache calls with more query rows than the decode tile's, on a contiguous
    # cache, take the sm90 forward: cache_seqlens (+ the appended tokens) as seqused_k, the batch
    # index as the K/V batch, the left pad as the first key; the append (and rotary) kernel first.
    import dataclasses

    from test_kvcache import Case, check_kvcache, make_kwargs

    cases = {
        "sq100-new100": Case(seqlen_q=100, seqlen_new=100, capacity=600),
        "sq100-nonew-gqa32_8-splits3": Case(seqlen_q=100, seqlen_new=0, capacity=3000, nheads=32, nheads_k=8,
                                            num_splits=3),
        "sq100-new100-rotary-leftpad-batch_idx": Case(seqlen_q=100, seqlen_new=100, capacity=600, rotary_fraction=0.5,
                                                      leftpad=True, batch_idx=True),
        "sq77-new13-local-nan_outside": Case(seqlen_q=77, seqlen_new=13, capacity=900, causal=False,
                                             window_size=(300, 20), leftpad=True, nan_outside_valid=True),
        "d96-sq64-new64-alibi-splits2": Case(seqlen_q=64, seqlen_new=64, capacity=1000, head_dim=96, alibi="bh",
                                             num_splits=2),
    }
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    case = dataclasses.replace(cases[c], batch=3)
    checked = check_kvcache(make_kwargs(case))
    assert any(u.startswith("flash_fwd_sm90_") for u in launched), launched
    assert checked.out.isfinite().all()


# (head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype, extra) of both dropout tests.
DROPOUT_SHAPES = [
    pytest.param(64, 2, 300, 1023, 4, 4, torch.bfloat16, {}, id="d64"),
    pytest.param(128, 1, 1023, 257, 8, 2, torch.bfloat16, {}, id="d128-gqa4"),
    pytest.param(96, 2, 113, 300, 4, 1, torch.float16, {}, id="d96-mqa-fp16"),
    pytest.param(256, 2, 300, 1023, 4, 2, torch.bfloat16, {}, id="d256-gqa2"),
    pytest.param(192, 1, 113, 257, 4, 4, torch.float16, {}, id="d192-fp16"),
]


def dropout_features(mask_kwargs: dict, extra: dict, batch: int, nheads: int) -> dict:
    """The dropout tests' keyword arguments: a mask, plus the softcap and (batch, nheads) ALiBi
    slopes that ``extra`` asks for."""
    features = dict(mask_kwargs)
    if extra.get("softcap"):
        features["softcap"] = extra["softcap"]
    if extra.get("alibi"):
        features["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3 + 0.01
    return features


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype, extra", [
    *DROPOUT_SHAPES,
    pytest.param(256, 1, 129, 700, 2, 2, torch.bfloat16, {}, id="d256"),
    pytest.param(192, 2, 200, 333, 4, 2, torch.bfloat16, {"softcap": 20.0, "alibi": True}, id="d192-softcap-alibi"),
])
def test_sm90_dropout(monkeypatch, launched, mask, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype,
                      extra):
    # The sm90 dropout instance (unpacked, unsplit) draws common.cuh's Philox mask from each
    # element's (batch, head, query, key): the reference with the host's copy of that mask holds
    # it to the rule, and the sm80 family forced with the same RNG state agrees with it.
    from test_dropout import MASKS, mask_for, next_rng_state

    from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    p = 0.3
    features = dropout_features(MASKS[mask], extra, batch, nheads)
    torch.cuda.manual_seed(1234)
    rng_state = next_rng_state()
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, dropout_p=p, **features)
    instance = sm90_instance_head_dim(head_dim)
    suffix = ("" if mask == "none" else "_" + mask) + ("_softcap" if "softcap" in features else "")
    assert launched == [f"flash_fwd_sm90_hdim{instance}_{DTYPE_NAMES[dtype]}{suffix}_dropout_sm90a"], launched
    kwargs = dict(features, dropout_mask=mask_for(rng_state, p, q, k), dropout_p=p)
    out_ref, lse_ref = attention_ref(q, k, v, **kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **kwargs)
    rule_k = 5.0 if "alibi_slopes" in features else 2.0
    assert_close_fa_rule(out, out_ref, out_pt, k=rule_k)
    assert_lse_close(lse, lse_ref)

    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    torch.cuda.manual_seed(1234)
    out80, lse80 = call_poisoned(flashgen.flash_attn_func, q, k, v, dropout_p=p, **features)
    assert launched[1].startswith("flash_fwd_sm80_") and launched[1].endswith("_dropout_sm90a"), launched
    bound = 2 * rule_k * (out_pt.float() - out_ref.float()).abs().max().item() + 2e-5
    assert (out.float() - out80.float()).abs().max().item() <= bound
    torch.testing.assert_close(lse, lse80, rtol=0, atol=1e-3)


@pytest.mark.parametrize("c", [
    "page256-sq100-new100", "page256-sq100-nonew-gqa32_8-splits3", "page512-d64-sq64-new64-rotary",
    "page256-sq77-new13-local-nan_outside", "page128-d96-sq64-new64-alibi-splits2",
    "page64-d256-fp16-softcap-nan_outside", "page192-d192-gqa-splits3-nan_outside",
    # Gathered by the producer warpgroup: pages smaller than or not a multiple of the key block, left pads.
    "gather-page256-leftpad-nan_outside", "gather-page1-sq40-new40", "gather-page16-gqa32_8-splits3-nan_outside",
    "gather-page17-local-rotary-leftpad", "gather-page100-d64-sq64-new64-nan_outside",
    "gather-page64-d96-alibi-splits2", "gather-page48-d256-fp16-softcap-leftpad", "gather-page17-d192-mqa-nan_outside",
])
def test_sm90_kvcache_paged(monkeypatch, launched, c):
    # A paged cache whose pages hold whole key blocks of the sm90 tile: each block is one TMA box
    # at (row in page, head, page). Other page sizes and left pads (which shift blocks across
    # pages): the producer warpgroup gathers each block's rows with cp.async. Pages the table does
    # not name hold NaN (make_kwargs).
    import dataclasses

    from test_kvcache import Case, check_kvcache, make_kwargs

    cases = {
        "page256-sq100-new100": Case(seqlen_q=100, seqlen_new=100, capacity=700, page_size=256),
        "page256-sq100-nonew-gqa32_8-splits3": Case(seqlen_q=100, seqlen_new=0, capacity=3000, nheads=32, nheads_k=8,
                                                    num_splits=3, page_size=256),
        "page512-d64-sq64-new64-rotary": Case(seqlen_q=64, seqlen_new=64, capacity=1500, head_dim=64, page_size=512,
                                              rotary_fraction=1.0),
        "page256-sq77-new13-local-nan_outside": Case(seqlen_q=77, seqlen_new=13, capacity=900, causal=False,
                                                     window_size=(300, 20), nan_outside_valid=True, page_size=256),
        "page128-d96-sq64-new64-alibi-splits2": Case(seqlen_q=64, seqlen_new=64, capacity=1000, head_dim=96, alibi="bh",
                                                     num_splits=2, page_size=128),
        # d256's 64-key and d192's 96-key blocks: several per page, the last one cut by the cache length.
        "page64-d256-fp16-softcap-nan_outside": Case(seqlen_q=40, seqlen_new=40, capacity=500, head_dim=256,
                                                     dtype=torch.float16, softcap=30.0, nan_outside_valid=True,
                                                     page_size=64),
        "page192-d192-gqa-splits3-nan_outside": Case(seqlen_q=50, seqlen_new=7, capacity=1000, head_dim=192, nheads=16,
                                                     nheads_k=4, num_splits=3, nan_outside_valid=True, page_size=192),
        "gather-page256-leftpad-nan_outside": Case(seqlen_q=64, seqlen_new=64, capacity=700, leftpad=True,
                                                   nan_outside_valid=True, page_size=256),
        "gather-page1-sq40-new40": Case(seqlen_q=40, seqlen_new=40, capacity=300, page_size=1),
        "gather-page16-gqa32_8-splits3-nan_outside": Case(seqlen_q=33, seqlen_new=5, capacity=1000, nheads=32,
                                                          nheads_k=8, num_splits=3, nan_outside_valid=True, page_size=16),
        "gather-page17-local-rotary-leftpad": Case(seqlen_q=50, seqlen_new=50, capacity=600, causal=False,
                                                   window_size=(200, 10), rotary_fraction=0.5, leftpad=True,
                                                   page_size=17),
        "gather-page100-d64-sq64-new64-nan_outside": Case(seqlen_q=64, seqlen_new=64, capacity=900, head_dim=64,
                                                          nan_outside_valid=True, page_size=100),
        "gather-page64-d96-alibi-splits2": Case(seqlen_q=64, seqlen_new=64, capacity=1000, head_dim=96, alibi="bh",
                                                num_splits=2, page_size=64),
        "gather-page48-d256-fp16-softcap-leftpad": Case(seqlen_q=40, seqlen_new=40, capacity=500, head_dim=256,
                                                        dtype=torch.float16, softcap=30.0, leftpad=True, page_size=48),
        "gather-page17-d192-mqa-nan_outside": Case(seqlen_q=50, seqlen_new=7, capacity=800, head_dim=192, nheads=8,
                                                   nheads_k=1, nan_outside_valid=True, page_size=17),
    }
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    case = dataclasses.replace(cases[c], batch=3)
    check_kvcache(make_kwargs(case))
    gather = c.startswith("gather-")  # the gather instances; the others the TMA's
    assert any(u.startswith("flash_fwd_sm90_") and "_paged" in u and u.endswith("_gather_sm90a") == gather
               for u in launched), launched


@pytest.mark.parametrize("page_size", [256, 17])
def test_sm90_varlen_paged(monkeypatch, launched, page_size):
    # flash_attn_varlen_func with a block table: sequence b's keys through its row of the table
    # (pages of 256: TMA boxes; of 17: gathered).
    from test_varlen import check_sequences, cu, gather_pages, run_varlen

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = [100, 1, 300, 0], [700, 5, 1023, 256]
    q = torch.randn(sum(lengths_q), 8, 128, dtype=torch.bfloat16, device="cuda")
    max_pages = -(-max(lengths_k) // page_size)
    k_cache = torch.randn(4 * max_pages + 2, page_size, 2, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(4 * max_pages + 2, device="cuda")[: 4 * max_pages].view(4, max_pages).to(torch.int32)
    out, lse = run_varlen(q, k_cache, v_cache, cu(lengths_q), cu(lengths_k), lengths_q, lengths_k,
                          block_table=table, causal=True)
    assert launched[0].startswith("flash_fwd_sm90_hdim128_bf16_causal_") and "_paged" in launched[0], launched
    assert launched[0].endswith("_gather_sm90a") == (page_size % 128 != 0), launched
    k, v = (gather_pages(cache, table, lengths_k) for cache in (k_cache, v_cache))
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


def test_no_keys_takes_sm80(monkeypatch, launched):
    # seqlen_k = 0 with more than 32 rows: nothing for the TMA to map; the sm80 kernel writes the
    # zeros and the -inf lse.
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    q, k, v = make_qkv(2, 100, 0, 4, 4, 128, torch.bfloat16)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert len(launched) == 1 and launched[0].startswith("flash_fwd_sm80_"), launched


VARLEN_LENGTHS = {  # name -> (query lengths, key lengths): empty, one-row and multi-block sequences
    "ragged": ([113, 0, 1, 257, 64, 300], [200, 17, 1, 257, 1023, 129]),
    "longer-q": ([300, 129], [100, 5]),
    # More work units than SMs (12 row blocks x 4 heads x 16 sequences), most of a short
    # sequence's empty: varlen launches a CTA per unit.
    "many-units": ([1500, 1, 700, 1024, 33, 1200, 0, 900, 1100, 257, 128, 129, 1400, 600, 300, 1023],
                   [1400, 5, 700, 1100, 33, 1300, 9, 800, 1100, 257, 127, 400, 1500, 600, 299, 1023]),
    # All of one length: the persistent grid (132 CTAs for 320 units, 192 under the causal mask).
    "uniform": ([600] * 16, [700] * 16),
}


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS)
def test_sm90_varlen(monkeypatch, launched, lengths, dtype, head_dim, mask):
    # Sequences are rows of one tensor: the TMA reads past a sequence's end into the next one's
    # rows, which the kernel must neither store (queries) nor let count (keys).
    from test_varlen import MASKS, check_sequences, ragged, run_varlen

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = VARLEN_LENGTHS[lengths]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 2, head_dim, dtype)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, pack_gqa=False, **MASKS[mask])
    suffix = "" if mask == "none" else "_" + mask
    assert launched == [f"flash_fwd_sm90_hdim{head_dim}_{DTYPE_NAMES[dtype]}{suffix}_sm90a"], launched
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, **MASKS[mask])


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("head_dim", [40, 96], ids=lambda d: f"d{d}")
def test_sm90_varlen_head_dim_below_the_instance(monkeypatch, launched, head_dim, pack_gqa):
    # The TMA's zero fill past the call's columns, with the next sequence's rows in the box too
    # (varlen) and with Q's 5-D box (PackGQA).
    from test_varlen import check_sequences, ragged, run_varlen

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = VARLEN_LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, pack_gqa=pack_gqa, causal=True)
    instance = sm90_instance_head_dim(head_dim)
    assert launched == [f"flash_fwd_sm90_hdim{instance}_bf16_causal{'_packgqa' if pack_gqa else ''}_sm90a"], launched
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


def test_sm90_varlen_seqused_and_dense(monkeypatch, launched):
    from test_varlen import ragged

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    check = run_seqused_varlen(num_splits=1)
    assert launched == ["flash_fwd_sm90_hdim128_bf16_causal_sm90a"], launched
    check()

    # One sequence: the varlen call is the dense one, bitwise (same family, same tiles).
    q, k, v, cu_q, cu_k = ragged([777], [1030], 4, 4, 64, torch.float16)
    one = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 777, 1030, causal=True)
    dense = flashgen.flash_attn_func(q[None], k[None], v[None], causal=True)[0]
    assert launched[-2:] == ["flash_fwd_sm90_hdim64_fp16_causal_sm90a"] * 2, launched
    torch.testing.assert_close(one, dense, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_sm90_varlen_ignores_nonfinite_rows_past_a_sequence(monkeypatch, launched, causal):
    # The TMA reads a key block past a sequence's end into the next sequence's rows; there they are
    # NaN and inf (rows no sequence uses): the kernel must not let 0 * NaN into the output.
    from test_varlen import check_sequences, ragged

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k, used_k = [200, 3, 129], [250, 60, 300], [250, 1, 300]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 4, 4, 128, torch.bfloat16)
    k[251:310] = float("nan")
    v[251:280], v[280:310] = float("nan"), float("inf")
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    out, lse = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                               seqused_k=seqused_k, pack_gqa=False, return_attn_probs=True)[:2]
    assert launched == [f"flash_fwd_sm90_hdim128_bf16{'_causal' if causal else ''}_sm90a"], launched
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, used_k=used_k, causal=causal)


@pytest.mark.parametrize("kwargs, mask", [
    pytest.param({}, "none", id="nomask"), pytest.param({"causal": True}, "causal", id="causal"),
    pytest.param({"window_size": (33, 7)}, "local", id="local"),
    pytest.param({"alibi": True, "softcap": 5.0, "causal": True}, "causal", id="causal-softcap-alibi"),
])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", [
    pytest.param(2, 113, 1023, 8, 2, id="g4-sq113-sk1023"), pytest.param(1, 1023, 300, 16, 2, id="g8-sq1023-sk300"),
    pytest.param(2, 45, 500, 32, 1, id="mqa32-sq45"), pytest.param(3, 300, 257, 4, 2, id="g2-sq300"),
    pytest.param(1, 77, 300, 64, 1, id="mqa64-sq77"),  # two queries per tile
    # More work units than SMs: a CTA moves on to other KV heads and batches.
    pytest.param(4, 2047, 2047, 16, 4, id="g4-many-units"),
])
def test_sm90_packgqa(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads,
                      nheads_k):
    # A tile's 128 rows are (query, head) pairs of one KV head, loaded by one 5-D TMA box; masks
    # and ALiBi slopes follow each row's own query position and head.
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3 + 0.01
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    out, lse = call_poisoned(flashgen.flash_attn_func, q, k, v, pack_gqa=True, **kwargs)
    uri = (f"flash_fwd_sm90_hdim{sm90_instance_head_dim(head_dim)}_{DTYPE_NAMES[dtype]}"
           f"{'' if mask == 'none' else '_' + mask}{'_softcap' if kwargs.get('softcap') else ''}_packgqa_sm90a")
    assert launched == [uri], launched
    checked = check_against_ref(out, lse, q, k, v, **kwargs)
    for feature in ("window_size", "softcap", "alibi_slopes"):  # a kernel that ignored one would fail
        if feature in kwargs:
            assert_feature_matters(q, k, v, checked, **{key: val for key, val in kwargs.items() if key != feature})
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    out80, lse80 = call_poisoned(flashgen.flash_attn_func, q, k, v, pack_gqa=True, **kwargs)
    assert launched[1].startswith("flash_fwd_sm80_") and "packgqa" in launched[1], launched
    bound = 2 * checked.rule_k * (checked.out_pt.float() - checked.out_ref.float()).abs().max().item() + 2e-5
    assert (out.float() - out80.float()).abs().max().item() <= bound
    torch.testing.assert_close(lse, lse80, rtol=0, atol=1e-3)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_sm90_varlen_packgqa(monkeypatch, launched, mask):
    from test_varlen import MASKS, check_sequences, ragged, run_varlen

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = VARLEN_LENGTHS["ragged"]
    q, k, v, cu_q, cu_k = ragged(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, pack_gqa=True, **MASKS[mask])
    suffix = "" if mask == "none" else "_" + mask
    assert launched == [f"flash_fwd_sm90_hdim128_bf16{suffix}_packgqa_sm90a"], launched
    check_sequences(out, lse, q, k, v, lengths_q, lengths_k, **MASKS[mask])


# ---- The sm90 backward (bwd_sm90.cuh): dense and varlen calls up to d128, every mask, softcap, ALiBi, GQA.
# The rest of the backward suite (test_bwd.py) runs it too wherever dispatch picks it; here each
# case checks that it really ran, holds dq, dk, dv to FlashAttention's rule and compares them with
# the sm80 backward's on the same inputs and output gradient.

BWD_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k)
    pytest.param(2, 177, 255, 4, 4, id="sq177-sk255"),
    pytest.param(1, 1, 300, 4, 4, id="sq1-sk300"),
    pytest.param(2, 300, 1, 4, 2, id="sq300-sk1-gqa2"),
    pytest.param(1, 113, 1023, 8, 2, id="sq113-sk1023-gqa4"),
    pytest.param(1, 1023, 113, 4, 1, id="sq1023-sk113-mqa"),
    # Several key blocks and query blocks a CTA, the Q/dO ring wrapping many times.
    pytest.param(2, 1023, 1023, 4, 4, id="sq1023-sk1023"),
]
BWD_FEATURES = [
    pytest.param({}, "none", id="plain"),
    pytest.param({"causal": True}, "causal", id="causal"),
    pytest.param({"window_size": (33, 7)}, "local", id="local-33-7"),
    pytest.param({"window_size": (-1, 5)}, "local", id="local-inf-5"),
    pytest.param({"softcap": 5.0, "causal": True}, "causal", id="softcap-causal"),
    pytest.param({"alibi": True, "causal": True}, "causal", id="alibi-causal"),
    pytest.param({"alibi": True, "softcap": 5.0, "window_size": (40, 3)}, "local", id="local-softcap-alibi"),
]


def _sm90_bwd_case(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads, nheads_k):
    from test_bwd import check_grads, flash_grads

    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device="cuda") * 0.3 + 0.01
    dout = torch.randn_like(q)
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    grads = flash_grads(flashgen.flash_attn_func, (q, k, v), dout, **kwargs)
    instance = sm90_bwd_instance_head_dim(head_dim)
    uri = (f"flash_bwd_sm90_hdim{instance}_{DTYPE_NAMES[dtype]}{'' if mask == 'none' else '_' + mask}"
           f"{'_softcap' if kwargs.get('softcap') else ''}_sm90a")
    assert uri in launched, f"{kwargs} ran {launched}, not the sm90 backward"
    checked = check_grads(q, k, v, dout, grads, **kwargs)

    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    launched.clear()
    grads80 = flash_grads(flashgen.flash_attn_func, (q, k, v), dout, **kwargs)
    assert any(u.startswith("flash_bwd_sm80_") for u in launched), launched
    # Both meet the rule against the reference, so they agree to twice its bound.
    for name, g, g80, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads80, checked.grads_ref, checked.grads_pt):
        bound = 2 * checked.rule_k * (g_pt.float() - g_ref.float()).abs().max().item() + 2e-4
        assert (g.float() - g80.float()).abs().max().item() <= bound, name


@pytest.mark.parametrize("kwargs, mask", BWD_FEATURES)
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", BWD_SHAPES)
def test_sm90_bwd(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads, nheads_k):
    _sm90_bwd_case(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads, nheads_k)


# Head dims below an instance's (multiples of 8): the next instance up, the TMA zero-filling the
# columns past the tensor's and dropping the dQ tile's (split columns: not adding them), dK/dV
# stored for the call's columns.
@pytest.mark.parametrize("kwargs, mask", [BWD_FEATURES[0], BWD_FEATURES[1], BWD_FEATURES[6]])
@pytest.mark.parametrize("head_dim", [8, 40, 72, 96, 120, 136, 160, 200, 248], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_k", [BWD_SHAPES[0], BWD_SHAPES[3]])
def test_sm90_bwd_head_dim_below_the_instance(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q,
                                              seqlen_k, nheads, nheads_k):
    _sm90_bwd_case(monkeypatch, launched, dtype, head_dim, kwargs, mask, batch, seqlen_q, seqlen_k, nheads, nheads_k)


# Causal CTAs longest first in chunks of (batch, KV head) pairs (bwd_sm90.cuh's bwd_cta): the
# benchmark shapes' chunks hold dozens of pairs, these calls' one unless the tuning asks for small
# ones: 9 pairs in chunks of 3, 2, 2, 2 (or 9 of one, d256's 16 key blocks), every key block
# covered once.
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_sm90_bwd_causal_chunked_order(monkeypatch, launched, head_dim):
    from test_bwd import check_grads, flash_grads

    from flashgen.runtime import dispatch, tuning

    batch, seqlen, nheads, nheads_k = 3, 1023, 6, 3
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_k, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    with tuning.use(bwd_causal_chunk_waves=0.1) as small_chunks:
        grads = flash_grads(flashgen.flash_attn_func, (q, k, v), dout, causal=True)
    plan = dispatch.plan_bwd(dtype=torch.bfloat16, head_dim=head_dim, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen,
                             nheads_k=nheads_k, causal=True, window_size=(-1, -1), softcap=0.0, device=(9, 0),
                             sm90=True, nheads=nheads, tuning=small_chunks)
    assert plan.cta_chunks in (4, 9), plan
    assert any(u.startswith("flash_bwd_sm90_") for u in launched), launched
    check_grads(q, k, v, dout, grads, causal=True)


def test_sm90_bwd_leaves_what_it_lacks_to_sm80(monkeypatch, launched):
    from test_varlen import cu

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 200, 200, 4, 4, 128, torch.bfloat16))
    lengths = cu([200])
    seqused = torch.tensor([150], dtype=torch.int32, device="cuda")
    flashgen.flash_attn_varlen_func(q[0], k[0], v[0], lengths, lengths, 200, 200, causal=True,
                                    seqused_q=seqused, seqused_k=seqused).sum().backward()
    bwd = [u for u in launched if u.startswith("flash_bwd_s")]
    assert len(bwd) == 1 and bwd[0].startswith("flash_bwd_sm80_"), launched


# Deterministic mode on the sm90 backward, in a child process: an ordering bug leaves a CTA spinning
# on a dQ semaphore, and a hung kernel cannot be interrupted in this process. The child returns
# DETERMINISTIC_PASSES backward passes of one forward, and the first batch element's (or sequence's)
# gradients computed alone, which the fixed order makes bitwise equal to its share of the batch's.
DETERMINISTIC_PASSES = 20
_DETERMINISTIC_CHILD = """
import sys, torch, flashgen
from flashgen.runtime import execute, tuning
uris = []
launch = execute.launch_kernel
execute.launch_kernel = lambda spec, *args, **kw: (uris.append(spec.uri), launch(spec, *args, **kw))[1]
data = torch.load(sys.argv[1])
kwargs, lengths = data["kwargs"], data["lengths"]

def cu(ls):
    return torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

def passes(q, k, v, dout, lengths_q, lengths_k, count):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if lengths_q is None:
        out = flashgen.flash_attn_func(*leaves, deterministic=True, pack_gqa=False, **kwargs)
    else:
        out = flashgen.flash_attn_varlen_func(*leaves, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k),
                                              deterministic=True, pack_gqa=False, **kwargs)
    return [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(count)]

q, k, v, dout = (data[n] for n in ("q", "k", "v", "dout"))
with tuning.use(**data["tuning"]):
    batch = passes(q, k, v, dout, *(lengths or (None, None)), int(sys.argv[3]))
    if lengths:
        (lq, *_), (lk, *_) = lengths
        alone = passes(q[:lq], k[:lk], v[:lk], dout[:lq], [lq], [lk], 1)[0]
    else:
        alone = passes(q[:1], k[:1], v[:1], dout[:1], None, None, 1)[0]
torch.cuda.synchronize()
torch.save({"passes": batch, "alone": alone, "uris": uris}, sys.argv[2])
"""


@pytest.mark.parametrize("head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, kwargs, lengths", [
    pytest.param(128, 2, 300, 1023, 4, 4, {}, None, id="d128-none-sq300-sk1023"),
    pytest.param(64, 2, 1023, 300, 8, 2, {"causal": True}, None, id="d64-gqa4-causal-sq1023-sk300"),
    pytest.param(128, 2, 1023, 511, 8, 1, {"window_size": (100, 7), "softcap": 5.0}, None,
                 id="d128-mqa-local-softcap-sq1023-sk511"),
    pytest.param(96, 2, 255, 1023, 4, 4, {"causal": True, "alibi": True}, None, id="d96-causal-alibi-sq255-sk1023"),
    # More CTAs than SMs: the ordering must not wait on blocks that are not resident yet.
    pytest.param(128, 4, 2047, 2047, 16, 4, {"causal": True}, None, id="d128-gqa4-causal-many-ctas"),
    pytest.param(64, 2, 4095, 4095, 16, 16, {}, None, id="d64-none-many-ctas"),
    # Chunked launch order (Tuning.bwd_det_chunk_l2_share): 32 pairs in 6 chunks (two of 6, four of
    # 5), one pair a chunk, and 16 GQA pairs in 5 chunks (one of 4) under a causal mask; MHA causal
    # (descending turns, the grid reversed) in 12 chunks.
    pytest.param(64, 2, 4095, 4095, 16, 16, {"tuning": {"bwd_det_chunk_l2_share": 0.21}}, None,
                 id="d64-none-many-ctas-6-chunks"),
    pytest.param(64, 2, 4095, 4095, 16, 16, {"tuning": {"bwd_det_chunk_l2_share": 1e-4}}, None,
                 id="d64-none-many-ctas-pair-chunks"),
    pytest.param(128, 4, 2047, 2047, 16, 4, {"causal": True, "tuning": {"bwd_det_chunk_l2_share": 0.5}}, None,
                 id="d128-gqa4-causal-5-chunks"),
    pytest.param(64, 4, 2047, 2047, 16, 16, {"causal": True, "tuning": {"bwd_det_chunk_l2_share": 0.1}}, None,
                 id="d64-mha-causal-12-chunks"),
    # MHA causal: descending turns, the grid reversed (more CTAs than SMs, and query rows past the
    # keys' diagonal in a partial last query block).
    pytest.param(64, 4, 2047, 2047, 16, 16, {"causal": True}, None, id="d64-mha-causal-many-ctas"),
    pytest.param(128, 2, 1023, 300, 4, 4, {"causal": True}, None, id="d128-mha-causal-sq1023-sk300"),
    pytest.param(128, 2, 300, 1023, 4, 4, {"causal": True}, None, id="d128-mha-causal-sq300-sk1023"),
    pytest.param(128, 0, 0, 0, 4, 4, {"causal": True}, ([300, 1, 700, 129], [500, 77, 700, 1]),
                 id="varlen-mha-causal"),
    pytest.param(128, 0, 0, 0, 4, 2, {"causal": True}, ([300, 1, 700, 129], [500, 77, 700, 1]), id="varlen-causal"),
    pytest.param(64, 0, 0, 0, 4, 4, {}, ([255, 1023, 64], [1023, 300, 2]), id="varlen-none"),
    # Split columns (d256) and query rows (d192): dQ through the step's Q and dO panels.
    pytest.param(256, 2, 300, 1023, 4, 4, {}, None, id="d256-none-sq300-sk1023"),
    pytest.param(256, 4, 1023, 1023, 16, 4, {"causal": True}, None, id="d256-gqa4-causal-many-ctas"),
    pytest.param(192, 2, 1023, 300, 4, 4, {"causal": True}, None, id="d192-mha-causal-sq1023-sk300"),
    pytest.param(160, 2, 1023, 511, 8, 1, {"window_size": (100, 7), "softcap": 5.0}, None,
                 id="d160-mqa-local-softcap-sq1023-sk511"),
    pytest.param(192, 0, 0, 0, 4, 2, {"causal": True}, ([300, 1, 700, 129], [500, 77, 700, 1]),
                 id="d192-varlen-causal"),
])
def test_sm90_bwd_deterministic(tmp_path, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, kwargs, lengths):
    import os
    import pathlib
    import subprocess
    import sys

    from test_bwd import check_grads
    from test_varlen import check_sequence_grads

    kwargs = dict(kwargs)
    tuning_changes = kwargs.pop("tuning", {})
    if lengths is None:
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.bfloat16)
        if kwargs.pop("alibi", False):  # per head, so that the first batch element alone takes them too
            kwargs["alibi_slopes"] = torch.rand(nheads, device="cuda") * 0.3 + 0.01
    else:
        q, k, v = (torch.randn(sum(n), h, head_dim, dtype=torch.bfloat16, device="cuda")
                   for n, h in ((lengths[0], nheads), (lengths[1], nheads_k), (lengths[1], nheads_k)))
    dout = torch.randn_like(q)
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save({"q": q, "k": k, "v": v, "dout": dout, "kwargs": kwargs, "lengths": lengths, "tuning": tuning_changes},
               inputs)
    repo = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    try:
        child = subprocess.run([sys.executable, "-c", _DETERMINISTIC_CHILD, str(inputs), str(outputs),
                                str(DETERMINISTIC_PASSES)], cwd=repo, env=env, capture_output=True, text=True,
                               timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("deterministic sm90 backward still running after 120 s: a CTA waits on a dQ semaphore "
                    "that never reaches its turn")
    assert child.returncode == 0, child.stderr[-4000:]
    result = torch.load(outputs)
    assert any(u.startswith(f"flash_bwd_sm90_hdim{sm90_bwd_instance_head_dim(head_dim)}_") for u in result["uris"]), \
        result["uris"]
    first = result["passes"][0]
    for i, grads in enumerate(result["passes"][1:], 1):
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, first):
            assert torch.equal(g, g0), f"{name} of deterministic pass {i} differs from pass 0"
    rows = (lengths[0][0], lengths[1][0]) if lengths else (1, 1)
    for name, g, g_alone, r in zip(("dq", "dk", "dv"), first, result["alone"], (rows[0], rows[1], rows[1])):
        assert torch.equal(g[:r], g_alone), f"{name} of the first element differs when computed alone"
    if lengths is None:
        check_grads(q, k, v, dout, first, **kwargs)
    else:
        check_sequence_grads(q, k, v, dout, first, *lengths, **kwargs)


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.float16), (128, torch.bfloat16), (96, torch.bfloat16),
                                             (256, torch.float16), (192, torch.bfloat16)],
                         ids=["d64-fp16", "d128-bf16", "d96-bf16", "d256-fp16", "d192-bf16"])
@pytest.mark.parametrize("lengths", ["ragged", "longer-q", "many-units"])
def test_sm90_bwd_varlen(monkeypatch, launched, lengths, head_dim, dtype, mask):
    # Sequences are rows of one tensor: a block's rows past its sequence are the next sequence's,
    # which must add nothing to this one's gradients. The tensors carry NaN rows past the last
    # sequence (a buffer longer than cu_seqlens says), which must not leak into any gradient.
    from test_varlen import MASKS, check_sequence_grads, cu, varlen_grads

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = VARLEN_LENGTHS[lengths]
    extra = 37
    q, k, v = (torch.randn(sum(n) + extra, h, head_dim, dtype=dtype, device="cuda")
               for n, h in ((lengths_q, 4), (lengths_k, 2), (lengths_k, 2)))
    for t in (q, k, v):
        t[-extra:] = float("nan")
    dout = torch.randn_like(q)
    dout[-extra:] = float("nan")
    grads = varlen_grads(q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k), dout, **MASKS[mask])
    instance = sm90_bwd_instance_head_dim(head_dim)
    assert any(u.startswith(f"flash_bwd_sm90_hdim{instance}_") for u in launched), launched
    check_sequence_grads(q, k, v, dout, [g[:-extra] for g in grads], lengths_q, lengths_k, **MASKS[mask])


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_sm90_bwd_varlen_masks_keys_past_each_sequence(monkeypatch, launched, head_dim, causal):
    # One key per sequence, and large scores (flash_attn's test_flash_attn_bwd_varlen_overflow): the
    # keys of the next sequences in a block must be masked by this sequence's length, not the
    # tensor's, or their zeroed rows score 0, far above the row's LSE, and exp overflows to inf.
    from test_varlen import check_sequence_grads, cu, varlen_grads

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    lengths_q, lengths_k = [76, 34, 146], [1, 1, 1]
    q, k, v = (torch.randn(sum(n), 5, head_dim, dtype=torch.float16, device="cuda") * 3
               for n in (lengths_q, lengths_k, lengths_k))
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k), dout, causal=causal)
    assert any(u.startswith(f"flash_bwd_sm90_hdim{sm90_bwd_instance_head_dim(head_dim)}_") for u in launched), launched
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), name
    # With one key P is 1 and dS = dP - D is 0 exactly, but both are fp32 sums over the head dim
    # (D = rowsum(dO ∘ O) by the preprocess): what dK keeps of their rounding grows with it.
    check_sequence_grads(q, k, v, dout, grads, lengths_q, lengths_k, eps_scale=max(1.0, head_dim / 128),
                         causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256], ids=lambda d: f"d{d}")
def test_sm90_bwd_varlen_nonfinite_stays_in_its_sequence(monkeypatch, launched, head_dim):
    from test_varlen import cu, varlen_grads

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    # Query blocks of 128 (d64) or 64 (d128 and up): either way sequence 0's last block holds 28 rows of sequence 1.
    lengths_q, lengths_k = [100, 200], [150, 200]
    q, k, v = (torch.randn(sum(n), 4, head_dim, dtype=torch.bfloat16, device="cuda")
               for n in (lengths_q, lengths_k, lengths_k))
    v[5] = float("nan")  # sequence 0's gradients are NaN; sequence 1's must not be
    dout = torch.randn_like(q)
    grads = varlen_grads(q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k), dout)
    assert any(u.startswith(f"flash_bwd_sm90_hdim{head_dim}_") for u in launched), launched
    for name, g, (start, end) in zip(("dq", "dk", "dv"), grads, ((100, 300), (150, 350), (150, 350))):
        assert torch.isfinite(g[start:end]).all(), f"{name} of sequence 1 is not finite"


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype, extra", [
    *DROPOUT_SHAPES,
    pytest.param(128, 2, 177, 255, 4, 4, torch.bfloat16, {"softcap": 5.0, "alibi": True}, id="d128-softcap-alibi"),
])
def test_sm90_bwd_dropout(monkeypatch, launched, mask, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype,
                          extra):
    # The sm90 backward's dropout instance regenerates the forward's Philox mask (each lane drawing
    # one query column of a pair and swapping words with lane ^ 4): dq, dk, dv against the
    # reference that applies the host's copy of that mask, and against the sm80 backward.
    from test_bwd import grad_eps
    from test_dropout import MASKS, mask_for, next_rng_state, ref_with_grads

    from flashgen.testing import assert_close_fa_rule

    monkeypatch.delenv("FLASHGEN_FAMILY", raising=False)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    features = dropout_features(MASKS[mask], extra, batch, nheads)
    dout = torch.randn_like(q)
    p = 0.3

    def run():
        torch.cuda.manual_seed(4321)
        rng_state = next_rng_state()
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = flashgen.flash_attn_func(*leaves, dropout_p=p, **features)
        return rng_state, torch.autograd.grad(out, leaves, dout)

    rng_state, grads = run()
    instance = sm90_bwd_instance_head_dim(head_dim)
    assert any(u.startswith(f"flash_bwd_sm90_hdim{instance}_") and u.endswith("_dropout_sm90a") for u in launched), launched
    kwargs = dict(features, dropout_mask=mask_for(rng_state, p, q, k), dropout_p=p)
    _, _, *grads_ref = ref_with_grads(q, k, v, dout, True, **kwargs)
    _, _, *grads_pt = ref_with_grads(q, k, v, dout, False, **kwargs)
    rule_k = 5.0 if "alibi_slopes" in features or "softcap" in features else 3.0
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_close_fa_rule(g, g_ref, g_pt, k=rule_k, eps=grad_eps(g_ref), name=name)

    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")
    launched.clear()
    _, grads80 = run()
    assert any(u.startswith("flash_bwd_sm80_") and "_dropout_" in u for u in launched), launched
    for name, g, g80, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads80, grads_ref, grads_pt):
        bound = 2 * rule_k * (g_pt.float() - g_ref.float()).abs().max().item() + 2e-4
        assert (g.float() - g80.float()).abs().max().item() <= bound, name
