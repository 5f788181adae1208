"""GPU tier: flash_attn_with_kvcache, flash_attn_combine and split-KV flash_attn_func against the
references in flashgen.testing_kvcache.

Accuracy rule (FlashAttention's test_flash_attn_kvcache): out is finite and max |out - ref| <=
3 x (error of the same computation by PyTorch in the input dtype) + 1e-5, 5 x with ALiBi; lse agrees
on finite entries and is -inf exactly where a row sees no key.  The cache after the call: appended
rows equal the reference's (v bitwise, rotated k within one rounding of the dtype), every other
row is bitwise unchanged.  The caching allocator is poisoned with NaN before each call, so output
the kernels fail to write shows up.

The axes are covered one group at a time around one base case (bf16, d128, GQA 8/2, batch 3, one
query token, one appended token, causal, random cache lengths) rather than as a Cartesian product:
each new kernel instance costs an NVRTC compile (~0.7 s) on first use.
"""
from __future__ import annotations

import dataclasses
import math
import typing
import zlib

import pytest
import torch

import flashgen
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref, generate_alibi_slopes
from flashgen.testing_kvcache import (
    KVCacheRef,
    combine_ref,
    kvcache_ref,
    paged_kv_from_contiguous,
    random_block_table,
    rotary_tables,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
RULE_K, RULE_K_ALIBI = 3.0, 5.0
SPLITS = (0, 1, 3, 1000)  # heuristic, none, forced, more than there are key blocks (clamped)


@pytest.fixture(autouse=True)
def _seed(request):
    # Reproducible, and different for every test and parameter set.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def poison_allocator(large_bytes: int = 256 << 20, small_blocks: int = 16) -> None:
    """Leave only NaN-filled free blocks in the caching allocator, so that buffers the call
    allocates (out, lse, split partials, rotated q) start as NaN rather than as plausible values."""
    torch.cuda.empty_cache()
    # 0xFF bytes are NaN in fp16, bf16 and fp32; 1 MiB is the largest small-pool request.
    blocks = [torch.full((large_bytes,), 0xFF, dtype=torch.uint8, device=DEVICE)]
    blocks += [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=DEVICE) for _ in range(small_blocks)]
    del blocks


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 3
    seqlen_q: int = 1
    seqlen_new: int = 1                    # tokens appended through k, v; 0: none
    capacity: int = 300                    # cache positions per sequence (rounded up to whole pages)
    seqlens: tuple[int, ...] | None = None  # cache_seqlens; None: random per batch element
    nheads: int = 8
    nheads_k: int = 2
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    page_size: int | None = None           # None: contiguous cache
    rotary_fraction: float = 0.0           # rotary_dim / head_dim
    rotary_interleaved: bool = False
    rotary_dtype: torch.dtype = torch.float32
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale_factor: float = 1.0              # softmax_scale * sqrt(head_dim)
    alibi: str | None = None               # "h": (nheads,) slopes; "bh": (batch, nheads)
    batch_idx: bool = False                # cache_batch_idx: a permutation into batch + 2 cache rows
    leftpad: bool = False                  # random cache_leftpad in [0, cache_seqlens]
    empty_element: bool = False            # batch element 0 has no valid key (needs seqlen_new == 0)
    nan_outside_valid: bool = False        # cache positions no batch element may read hold NaN
    num_splits: int = 0
    pack_gqa: bool | None = None
    heads_first: bool = False              # caches in (.., heads, positions, d) memory, passed transposed


def case(case_id: str, **fields):
    return pytest.param(Case(**fields), id=case_id)


def make_kwargs(c: Case) -> dict:
    """Fresh random arguments for flash_attn_with_kvcache (and kvcache_ref) from a Case."""
    batch_cache = c.batch + 2 if c.batch_idx else c.batch
    capacity = c.capacity if c.page_size is None else -(-c.capacity // c.page_size) * c.page_size
    k_cache, v_cache = (randn(batch_cache, capacity, c.nheads_k, c.head_dim, dtype=c.dtype) for _ in range(2))
    if c.seqlens is not None:
        seqlens = torch.tensor(c.seqlens)
    else:
        seqlens = torch.randint(0, capacity - c.seqlen_new + 1, (c.batch,))
    if c.empty_element:
        assert c.seqlen_new == 0, "an element with appended tokens always has valid keys"
        seqlens[0] = 0
    leftpad = (torch.rand(c.batch) * (seqlens + 1)).long()  # uniform in [0, cache_seqlens]
    kwargs = dict(
        q=randn(c.batch, c.seqlen_q, c.nheads, c.head_dim, dtype=c.dtype), k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=seqlens.to(DEVICE, torch.int32), softmax_scale=c.scale_factor / math.sqrt(c.head_dim),
        causal=c.causal, window_size=c.window_size, softcap=c.softcap, rotary_interleaved=c.rotary_interleaved,
        num_splits=c.num_splits, pack_gqa=c.pack_gqa, return_softmax_lse=True,
    )
    if c.seqlen_new:
        new_shape = (c.batch, c.seqlen_new, c.nheads_k, c.head_dim)
        kwargs["k"], kwargs["v"] = (randn(*new_shape, dtype=c.dtype) for _ in range(2))
    if c.rotary_fraction:
        # Rows for every q position too: past the cache when causal and seqlen_q > seqlen_new.
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(
            capacity + c.seqlen_q, int(c.head_dim * c.rotary_fraction), dtype=c.rotary_dtype, device=DEVICE
        )
    if c.alibi == "h":
        kwargs["alibi_slopes"] = generate_alibi_slopes(c.nheads, device=DEVICE)
    elif c.alibi == "bh":
        kwargs["alibi_slopes"] = torch.rand(c.batch, c.nheads, device=DEVICE) * 0.3 + 0.01
    rows = torch.randperm(batch_cache)[: c.batch] if c.batch_idx else torch.arange(c.batch)
    if c.batch_idx:
        kwargs["cache_batch_idx"] = rows.to(DEVICE, torch.int32)
    if c.leftpad:
        kwargs["cache_leftpad"] = leftpad.to(DEVICE, torch.int32)
    if c.nan_outside_valid:
        readable = torch.zeros(batch_cache, capacity, dtype=torch.bool)
        for b, row in enumerate(rows.tolist()):
            readable[row, int(leftpad[b]) if c.leftpad else 0 : int(seqlens[b])] = True
        for cache in (k_cache, v_cache):
            cache[~readable.to(DEVICE)] = float("nan")
    if c.page_size is not None:
        max_pages = capacity // c.page_size
        num_blocks = c.batch * max_pages + 3  # pages the table does not name hold NaN
        table = random_block_table(c.batch, max_pages, num_blocks, device=DEVICE)
        kwargs["block_table"] = table
        kwargs["k_cache"], kwargs["v_cache"] = (
            paged_kv_from_contiguous(cache, table, num_blocks, c.page_size) for cache in (k_cache, v_cache)
        )
    if c.heads_first:  # SDPA's memory layout: each head's positions one run, seen through flash_attn's view
        for name in ("k_cache", "v_cache"):
            kwargs[name] = kwargs[name].transpose(1, 2).contiguous().transpose(1, 2)
            assert kwargs[name].stride(1) == c.head_dim
    return kwargs


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 as raw bits: a bitwise comparison in which NaN equals itself."""
    return t.view(torch.int16)


def assert_cache_after_call(after, before, expected, written, exact: bool, name: str) -> None:
    """Rows outside ``written`` bitwise unchanged; written rows equal to ``expected`` bitwise
    (``exact``) or within one rounding of the cache dtype (rotated k: the kernel's fp32 math may
    round differently from the reference's, e.g. by an FMA)."""
    changed = (bits(after) != bits(before)).flatten(2).any(-1) & ~written
    assert not changed.any(), (
        f"{name}: {int(changed.sum())} rows outside the append changed; first (block or batch row, "
        f"position): {changed.nonzero()[:4].tolist()}"
    )
    got, want = after[written], expected[written]
    if exact:
        differs = (bits(got) != bits(want)).flatten(1).any(-1)
        assert not differs.any(), f"{name}: appended rows differ from k/v at {written.nonzero()[differs][:4].tolist()}"
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=1e-5,
                                   msg=lambda m: f"{name}: appended rows: {m}")


class Checked(typing.NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    ref: KVCacheRef
    out_pt: torch.Tensor
    rule_k: float
    bound: float  # the rule's tolerance: rule_k * max |out_pt - ref| + 1e-5


def check_kvcache(kwargs: dict, name: str = "out") -> Checked:
    """One call on a poisoned allocator, held to the reference: out, lse and the cache after it."""
    ref = kvcache_ref(**kwargs)  # before the call: it appends to the caches in place
    out_pt = kvcache_ref(**kwargs, upcast=False).out
    before = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    poison_allocator()
    out, lse = flashgen.flash_attn_with_kvcache(**kwargs)
    q = kwargs["q"]
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    rule_k = RULE_K_ALIBI if kwargs.get("alibi_slopes") is not None else RULE_K
    assert_close_fa_rule(out, ref.out, out_pt, k=rule_k, name=name)
    assert_lse_close(lse, ref.lse, name=f"lse of {name}")
    rotated = kwargs.get("rotary_cos") is not None
    assert_cache_after_call(kwargs["k_cache"], before[0], ref.k_cache, ref.written, exact=not rotated, name="k_cache")
    assert_cache_after_call(kwargs["v_cache"], before[1], ref.v_cache, ref.written, exact=True, name="v_cache")
    bound = rule_k * (out_pt.float() - ref.out).abs().max().item() + 1e-5
    return Checked(out, lse, ref, out_pt, rule_k, bound)


def assert_feature_matters(kwargs: dict, checked: Checked, **without_feature) -> None:
    """The reference without the feature must fail the rule; otherwise a kernel that ignored the
    feature would pass the test."""
    out_without = kvcache_ref(**{**kwargs, **without_feature}).out
    with pytest.raises(AssertionError):
        assert_close_fa_rule(out_without, checked.ref.out, checked.out_pt, k=checked.rule_k)


def assert_agree(a: Checked, b: Checked, name: str) -> None:
    """Two runs of one problem (other num_splits / pack_gqa) agree within the rule's tolerance."""
    diff = (a.out.float() - b.out.float()).abs().max().item()
    assert diff <= max(a.bound, b.bound), f"{name}: max |difference| {diff:.3e} > {max(a.bound, b.bound):.3e}"
    assert_lse_close(a.lse, b.lse, name=f"lse of {name}")


def fresh_caches(kwargs: dict) -> dict:
    """The same arguments on copies of the caches, so runs compared with each other all append
    onto the same starting state."""
    return {**kwargs, "k_cache": kwargs["k_cache"].clone(), "v_cache": kwargs["v_cache"].clone()}


def spy_launches(monkeypatch) -> list:
    """Record (spec, grid) of every kernel the runtime launches from here on."""
    from flashgen.runtime import execute

    launched = []
    original = execute.launch_kernel

    def spy(spec, smem_bytes, num_threads, grid, *args, **kwargs):
        launched.append((spec, grid))
        return original(spec, smem_bytes, num_threads, grid, *args, **kwargs)

    monkeypatch.setattr(execute, "launch_kernel", spy)
    return launched


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: one axis group per test, around the base Case.


@pytest.mark.parametrize("seqlen_new", [0, 1, 5], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("page_size", [None, 1, 16, 17, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
def test_kvcache_page_size_and_append(page_size, seqlen_new):
    """Without new tokens batch element 0 has an empty cache; with them (and as many query rows,
    as in speculative decoding) the new k is rotated, so the paged append path rotates too."""
    c = Case(page_size=page_size, seqlen_new=seqlen_new, seqlen_q=max(seqlen_new, 1),
             empty_element=seqlen_new == 0, rotary_fraction=0.5 if seqlen_new else 0.0)
    check_kvcache(make_kwargs(c))


ROTARY = dict(seqlen_q=3, seqlen_new=3)  # several query rows: their positions differ by mask


@pytest.mark.parametrize("c", [
    case("full-gptj-d64-causal", head_dim=64, rotary_fraction=1.0, rotary_interleaved=True, **ROTARY),
    case("full-neox-d64-nomask", head_dim=64, rotary_fraction=1.0, causal=False, **ROTARY),
    case("full-neox-d128-causal", rotary_fraction=1.0, **ROTARY),
    case("full-gptj-d128-local17_3", rotary_fraction=1.0, rotary_interleaved=True, causal=False,
         window_size=(17, 3), **ROTARY),
    case("half-gptj-d128-nomask", rotary_fraction=0.5, rotary_interleaved=True, causal=False, **ROTARY),
    case("half-neox-d96-fp16-causal", head_dim=96, dtype=torch.float16, rotary_fraction=0.5, **ROTARY),
    case("half-neox-page17", page_size=17, rotary_fraction=0.5, **ROTARY),
    case("half-gptj-cos_bf16", rotary_fraction=0.5, rotary_interleaved=True, rotary_dtype=torch.bfloat16, **ROTARY),
    case("half-neox-leftpad-batch_idx", rotary_fraction=0.5, leftpad=True, batch_idx=True, **ROTARY),
])
def test_kvcache_rotary(c):
    kwargs = make_kwargs(c)
    checked = check_kvcache(kwargs)
    assert_feature_matters(kwargs, checked, rotary_cos=None, rotary_sin=None)


SOFTCAP = dict(softcap=5.0, scale_factor=2.0)  # scores large enough for the cap to matter


@pytest.mark.parametrize("c", [
    case("nomask-sq5", causal=False, seqlen_q=5, seqlen_new=5),
    case("local17_3-sq16", causal=False, window_size=(17, 3), seqlen_q=16, seqlen_new=16),
    case("local17_3-page16", causal=False, window_size=(17, 3), page_size=16),
    case("causal-left8-sq5", window_size=(8, -1), seqlen_q=5, seqlen_new=5),
    case("softcap-causal-sq5", seqlen_q=5, seqlen_new=5, **SOFTCAP),
    case("softcap-nomask-page17", causal=False, page_size=17, **SOFTCAP),
    case("alibi_h-causal-sq5", alibi="h", seqlen_q=5, seqlen_new=5),
    case("alibi_bh-nomask-leftpad", alibi="bh", causal=False, leftpad=True),
    case("alibi_h-local17_3-page16-leftpad", alibi="h", causal=False, window_size=(17, 3), page_size=16, leftpad=True),
    case("alibi_bh-softcap-causal-mqa8_1", alibi="bh", nheads_k=1, **SOFTCAP),
])
def test_kvcache_masks_softcap_alibi(c):
    kwargs = make_kwargs(c)
    checked = check_kvcache(kwargs)
    if c.softcap:
        assert_feature_matters(kwargs, checked, softcap=0.0)
    if c.alibi:
        assert_feature_matters(kwargs, checked, alibi_slopes=None)


@pytest.mark.parametrize("c", [
    case("d64-mha8_8-fp16", head_dim=64, nheads_k=8, dtype=torch.float16),
    case("d96-gqa32_8", head_dim=96, nheads=32, nheads_k=8),
    case("d128-mqa8_1-sq3", nheads_k=1, seqlen_q=3, seqlen_new=3),
    case("d128-gqa32_8-fp16-page256", nheads=32, nheads_k=8, dtype=torch.float16, page_size=256),
    case("d256-gqa32_8-page16", head_dim=256, nheads=32, nheads_k=8, page_size=16),
    case("d256-mha8_8-fp16-sq16-nomask", head_dim=256, nheads_k=8, dtype=torch.float16, seqlen_q=16,
         seqlen_new=16, causal=False),
    case("d72-mqa8_1-rotary_full", head_dim=72, nheads_k=1, rotary_fraction=1.0),
])
def test_kvcache_heads_and_head_dims(c):
    check_kvcache(make_kwargs(c))


@pytest.mark.parametrize("c", [
    case("d96-gqa32_8-new3", head_dim=96, nheads=32, nheads_k=8, seqlen_q=3, seqlen_new=3),
    case("d64-mqa8_1-page16-rotary", head_dim=64, nheads_k=1, page_size=16, rotary_fraction=0.5),
    case("d128-gqa32_8-split3-leftpad", nheads=32, nheads_k=8, num_splits=3, leftpad=True, capacity=1000),
    case("d256-mha8_8-page17-nonew", head_dim=256, nheads_k=8, page_size=17, seqlen_new=0),
])
def test_kvcache_heads_first_cache(c):
    """Caches stored heads-first (SDPA's layout), a strided view in flash_attn's shape: reads and
    the append follow the strides."""
    check_kvcache(make_kwargs(dataclasses.replace(c, heads_first=True)))


@pytest.mark.parametrize("c", [
    case("sq3-nonew-nomask-empty", seqlen_q=3, seqlen_new=0, causal=False, empty_element=True),
    case("sq16-new16", seqlen_q=16, seqlen_new=16),
    # Chunked prefill: many query rows and as many new tokens; without new tokens, cache lengths
    # below 100 leave the first query rows with no visible key.
    case("sq100-new100", seqlen_q=100, seqlen_new=100, capacity=600),
    case("sq100-new100-local17_3-page256", seqlen_q=100, seqlen_new=100, capacity=600, causal=False,
         window_size=(17, 3), page_size=256),
    case("sq100-nonew-gqa32_8", seqlen_q=100, seqlen_new=0, capacity=600, nheads=32, nheads_k=8),
    case("sq100-new100-rotary-leftpad", seqlen_q=100, seqlen_new=100, capacity=600, rotary_fraction=0.5, leftpad=True),
])
def test_kvcache_seqlen_q(c):
    check_kvcache(make_kwargs(c))


@pytest.mark.parametrize("c", [
    case("batch_idx", batch_idx=True),
    case("batch_idx-sq5-nomask", batch_idx=True, seqlen_q=5, seqlen_new=5, causal=False),
    case("batch_idx-nonew-empty", batch_idx=True, seqlen_new=0, empty_element=True),
    case("leftpad", leftpad=True),
    case("leftpad-sq5-local17_3", leftpad=True, seqlen_q=5, seqlen_new=5, causal=False, window_size=(17, 3)),
    case("leftpad-page16", leftpad=True, page_size=16),
    case("leftpad-batch_idx-nonew", leftpad=True, batch_idx=True, seqlen_new=0),
])
def test_kvcache_batch_idx_and_leftpad(c):
    kwargs = make_kwargs(c)
    checked = check_kvcache(kwargs)
    if c.leftpad and c.window_size == (-1, -1):  # a window on the left hides the padding anyway
        assert_feature_matters(kwargs, checked, cache_leftpad=None)


@pytest.mark.parametrize("c", [
    case("contiguous-leftpad-batch_idx", leftpad=True, batch_idx=True),
    case("page16-leftpad-sq5", leftpad=True, page_size=16, seqlen_q=5, seqlen_new=5),
    case("page256-nonew-split3", page_size=256, seqlen_new=0, num_splits=3, capacity=1000),
])
def test_kvcache_nan_outside_valid_range(c):
    """Caches are allocated with torch.empty in servers: positions before leftpad and past
    cache_seqlens may hold NaN.  Masking their scores is not enough (0 * NaN = NaN in P @ V): the
    kernel must not let them in, as FlashAttention zero-fills out-of-range rows."""
    check_kvcache(make_kwargs(dataclasses.replace(c, nan_outside_valid=True)))


@pytest.mark.parametrize("c", [
    case("contiguous-causal-sq1", capacity=2000),
    case("page16-nomask-sq3", capacity=2000, page_size=16, causal=False, seqlen_q=3, seqlen_new=3),
    # A short window: most splits see no key (lse -inf, partials that must not leak in).
    case("page256-local17_3-sq3", capacity=2000, page_size=256, causal=False, window_size=(17, 3),
         seqlen_q=3, seqlen_new=3),
    case("nonew-empty-alibi-mqa8_1", capacity=2000, seqlen_new=0, empty_element=True, alibi="h", nheads_k=1),
    case("sq16-gqa32_8-rotary-leftpad", capacity=2000, seqlen_q=16, seqlen_new=16, nheads=32, nheads_k=8,
         rotary_fraction=0.5, leftpad=True),
])
def test_kvcache_num_splits(c):
    """Each split count meets the rule, and all agree with the unsplit result within its tolerance."""
    kwargs = make_kwargs(c)
    checked = {
        n: check_kvcache(fresh_caches({**kwargs, "num_splits": n}), name=f"out(num_splits={n})") for n in SPLITS
    }
    for n in SPLITS:
        assert_agree(checked[n], checked[1], name=f"num_splits={n} vs 1")


@pytest.mark.parametrize("c", [
    case("gqa32_8-d128-heuristic", nheads=32, nheads_k=8, capacity=3000, seqlen_new=0),
    # Unpacked rows (one head per tile); most splits of the short sequences see no key. 2 heads x 3
    # x 8 splits: few enough CTAs for clusters of 8 long splits (dispatch.clusters_merge).
    case("mha-d64-fp16-page16-split8", nheads=2, nheads_k=2, head_dim=64, dtype=torch.float16, capacity=9000,
         page_size=16, seqlens=(8900, 5, 300), num_splits=8),
    case("gqa8_2-d256-sq3-local-empty-split7", head_dim=256, capacity=2000, seqlen_q=3, seqlen_new=0, causal=False,
         window_size=(40, 0), empty_element=True, num_splits=7),
    case("gqa6_2-d96-sq5-rotary-split2", nheads=6, capacity=1500, seqlen_q=5, seqlen_new=5, head_dim=96,
         rotary_fraction=1.0, num_splits=2),
    case("gqa8_2-d128-split13-combine", capacity=3000, num_splits=13),  # more than a cluster holds
])
def test_kvcache_splits_merged_in_cluster(c, monkeypatch):
    """On sm_90+, decode splits of up to 8 run as one cluster and merge through distributed shared
    memory, without the combine kernel: the result meets the rule, agrees with the combine kernel's
    merge, is bitwise repeatable, and replays in a CUDA graph. More splits take the combine."""
    from flashgen.runtime import execute, tuning

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90+")
    launched = []
    original = execute.launch_kernel

    def spy(spec, *args, cluster=None, **kwargs):
        launched.append((spec.uri, cluster))
        return original(spec, *args, cluster=cluster, **kwargs)

    monkeypatch.setattr(execute, "launch_kernel", spy)
    kwargs = make_kwargs(c)
    merged = check_kvcache(fresh_caches(kwargs), name="out (merged in a cluster)")
    forward = [(u, cl) for u, cl in launched if "_decode_" in u]
    assert len(forward) == 1, launched
    combine = [u for u, _ in launched if u.startswith("flash_combine")]
    if c.num_splits > tuning.DEFAULT.decode_cluster_splits:
        assert forward[0][1] is None and combine, launched
    else:
        assert forward[0][1] is not None and 1 < forward[0][1][2] <= tuning.DEFAULT.decode_cluster_splits, launched
        assert not combine, launched
    for _ in range(2):
        out, lse = flashgen.flash_attn_with_kvcache(**fresh_caches(kwargs))
        assert torch.equal(out, merged.out) and torch.equal(lse, merged.lse)
    launched.clear()
    with tuning.use(merge_in_cluster=False):
        combined = check_kvcache(fresh_caches(kwargs), name="out (combine kernel)")
    assert all(cl is None for _, cl in launched), launched
    assert_agree(merged, combined, name="merged in a cluster vs the combine kernel")

    # A CUDA graph replays the cluster launch with new queries.
    static = fresh_caches(kwargs)
    static.pop("k", None), static.pop("v", None)  # no append: replays must see the same cache
    static["q"] = static["q"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashgen.flash_attn_with_kvcache(**static)  # warm-up off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            graph_out, graph_lse = flashgen.flash_attn_with_kvcache(**static)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        static["q"].copy_(randn(*static["q"].shape, dtype=c.dtype))
        graph.replay()
        torch.cuda.synchronize()
        out, lse = flashgen.flash_attn_with_kvcache(**static)
        assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


@pytest.mark.parametrize("c", [
    case("d96-gqa32_8-heuristic", head_dim=96, nheads=32, nheads_k=8, capacity=3000),
    case("d128-gqa8_2-sq2-page17-leftpad-split3", seqlen_q=2, seqlen_new=2, page_size=17, leftpad=True,
         num_splits=3, capacity=1000),
    case("d64-mha8_8-page16-rotary-nonew", head_dim=64, nheads_k=8, page_size=16, rotary_fraction=1.0,
         rotary_interleaved=True, seqlen_new=0),
    case("d96-gqa32_8-fp16-page256-softcap-alibi", head_dim=96, nheads=32, nheads_k=8, dtype=torch.float16,
         page_size=256, softcap=30.0, alibi="bh", capacity=2000),
    case("d128-gqa16_4-sq2-local17_3-batch_idx", nheads=16, nheads_k=4, seqlen_q=2, seqlen_new=2, causal=False,
         window_size=(17, 3), batch_idx=True),
    case("d64-gqa32_8-nonew-empty-nan-split13", head_dim=64, nheads=32, nheads_k=8, seqlen_new=0,
         empty_element=True, nan_outside_valid=True, num_splits=13, capacity=3000),
    case("d96-gqa8_2-rotary_half-split8", head_dim=96, rotary_fraction=0.5, num_splits=8, capacity=3000),
])
def test_kvcache_paired_kv_heads(c, monkeypatch):
    """Decode over adjacent KV heads, two per CTA (Tuning.decode_paired_head_dims, here at any grid
    size and also at d128): the instance of twice the head dim runs over half the heads, meets the
    rule, and agrees with one head per CTA."""
    from flashgen.runtime import tuning

    launched = spy_launches(monkeypatch)
    kwargs = make_kwargs(c)
    runs = {}
    for paired in (True, False):
        pairs = frozenset({64, 96, 128} if paired else ())
        with tuning.use(decode_paired_head_dims=pairs, decode_pair_min_sm_share=0):  # any grid
            launched.clear()
            runs[paired] = check_kvcache(fresh_caches(kwargs), name=f"out (paired={paired})")
        (spec, grid), = [(s, g) for s, g in launched if s.direction == "fwd"]
        assert spec.head_dim == c.head_dim * (2 if paired else 1), spec.uri
        assert grid[1] == (c.nheads_k // 2 if paired else c.nheads_k if spec.pack_gqa else c.nheads), grid
    assert_agree(runs[True], runs[False], name="two KV heads per CTA vs one")


def test_flash_attn_func_decode_paired_kv_heads(monkeypatch):
    """flash_attn_func's decode (one query token, K/V heads adjacent) pairs heads too: the d192
    instance runs over 2 of the 4 KV heads, and meets the rule."""
    from flashgen.runtime import tuning

    launched = spy_launches(monkeypatch)
    q, k, v = randn(3, 1, 16, 96), randn(3, 777, 4, 96), randn(3, 777, 4, 96)
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    poison_allocator()
    with tuning.use(decode_pair_min_sm_share=0):
        out, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True)
    (spec, grid), = [(s, g) for s, g in launched if s.direction == "fwd"]
    assert spec.head_dim == 192 and spec.decode and grid[1] == 2, (spec.uri, grid)
    assert_close_fa_rule(out, out_ref, out_pt, k=RULE_K)
    assert_lse_close(lse, lse_ref)


@pytest.mark.parametrize("c", [
    case("gqa32_8-sq1", nheads=32, nheads_k=8),
    case("mqa8_1-sq3-nomask", nheads_k=1, seqlen_q=3, seqlen_new=3, causal=False),
    case("gqa32_8-sq5-page16-local17_3", nheads=32, nheads_k=8, seqlen_q=5, seqlen_new=5, page_size=16,
         causal=False, window_size=(17, 3)),
])
def test_kvcache_pack_gqa(c):
    kwargs = make_kwargs(c)
    checked = {
        pack: check_kvcache(fresh_caches({**kwargs, "pack_gqa": pack}), name=f"out(pack_gqa={pack})")
        for pack in (False, True)
    }
    assert_agree(checked[True], checked[False], name="pack_gqa=True vs False")


@pytest.mark.parametrize("page_size", [None, 256], ids=["contiguous", "page256"])
def test_kvcache_128k_keys(page_size):
    """One long sequence, 128k keys after the append, split by the heuristic; the fp32 reference
    (dense over the one sequence) is cheap at batch 1 and 8 heads."""
    check_kvcache(make_kwargs(Case(batch=1, capacity=128 * 1024, seqlens=(128 * 1024 - 1,), page_size=page_size)))


def test_kvcache_int_seqlens_and_out_only():
    """cache_seqlens as a Python int; without return_softmax_lse the result is out alone."""
    kwargs = make_kwargs(Case(seqlens=(57, 57, 57), seqlen_q=3, seqlen_new=3, rotary_fraction=0.5))
    kwargs.update(cache_seqlens=57, return_softmax_lse=False)
    ref, out_pt = kvcache_ref(**kwargs), kvcache_ref(**kwargs, upcast=False).out
    k_cache_before = kwargs["k_cache"].clone()
    poison_allocator()
    out = flashgen.flash_attn_with_kvcache(**kwargs)
    assert isinstance(out, torch.Tensor)
    assert_close_fa_rule(out, ref.out, out_pt, k=RULE_K)
    assert_cache_after_call(kwargs["k_cache"], k_cache_before, ref.k_cache, ref.written, exact=False, name="k_cache")


def test_kvcache_cuda_graph_decode_steps():
    """Decode as servers run it: one captured call, replayed step after step with cache_seqlens and
    the new token updated in place.  Each replay must append at the new position and attend to it:
    nothing about the lengths (e.g. a split count read from cache_seqlens) may be baked in at capture."""
    kwargs = make_kwargs(Case(page_size=16, rotary_fraction=0.5, seqlens=(10, 150, 290)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Outside the capture: compiling and loading modules synchronizes, which capture forbids.
        # Appending the same token at the same position twice leaves the same cache.
        for _ in range(2):
            flashgen.flash_attn_with_kvcache(**kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static, lse_static = flashgen.flash_attn_with_kvcache(**kwargs)
    for step in range(3):
        for name in ("q", "k", "v"):
            kwargs[name].copy_(torch.randn_like(kwargs[name]))
        kwargs["cache_seqlens"].add_(1)
        ref, out_pt = kvcache_ref(**kwargs), kvcache_ref(**kwargs, upcast=False).out
        before = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
        out_static.fill_(float("nan"))
        lse_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_fa_rule(out_static, ref.out, out_pt, k=RULE_K, name=f"out at step {step}")
        assert_lse_close(lse_static, ref.lse, name=f"lse at step {step}")
        assert_cache_after_call(kwargs["k_cache"], before[0], ref.k_cache, ref.written, exact=False, name="k_cache")
        assert_cache_after_call(kwargs["v_cache"], before[1], ref.v_cache, ref.written, exact=True, name="v_cache")


@pytest.mark.parametrize("change, error", [
    pytest.param(lambda kw: kw.update(cache_batch_idx=torch.arange(3, dtype=torch.int32, device=DEVICE)),
                 ValueError, id="batch_idx-with-block_table"),
    pytest.param(lambda kw: kw.update(cache_seqlens=kw["cache_seqlens"].long()), TypeError, id="cache_seqlens-int64"),
    pytest.param(lambda kw: kw.update(block_table=kw["block_table"].long()), TypeError, id="block_table-int64"),
    # rotary_dim is 2 * rotary_cos.shape[1], even by construction; too large is the shape error left.
    pytest.param(lambda kw: kw.update(rotary_cos=torch.ones(400, 72, device=DEVICE),
                                      rotary_sin=torch.ones(400, 72, device=DEVICE)),
                 ValueError, id="rotary_dim-over-head_dim"),
    pytest.param(lambda kw: kw.update(rotary_sin=kw["rotary_sin"][:, :-8]), ValueError,
                 id="rotary_cos-sin-shapes-differ"),
    pytest.param(lambda kw: kw.update(v=None), ValueError, id="k-without-v"),
])
def test_kvcache_bad_arguments(change, error):
    """Rejected before anything is launched: the caches are left as they were."""
    kwargs = make_kwargs(Case(page_size=16, rotary_fraction=0.5))
    change(kwargs)
    before = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    with pytest.raises(error):
        flashgen.flash_attn_with_kvcache(**kwargs)
    torch.cuda.synchronize()
    for name, cache_before in zip(("k_cache", "v_cache"), before):
        assert torch.equal(bits(kwargs[name]), bits(cache_before)), f"{name} changed by a rejected call"


# ---------------------------------------------------------------------------------------------
# flash_attn_combine


def check_combine(out_partial, lse_partial, out_dtype=None, out=None) -> None:
    out_ref, lse_ref = combine_ref(out_partial, lse_partial)
    poison_allocator()
    result_out, lse = flashgen.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)
    dtype = out_dtype or torch.float32
    assert result_out.shape == out_partial.shape[1:] and result_out.dtype == dtype, (result_out.shape, result_out.dtype)
    assert lse.shape == lse_partial.shape[1:] and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    if out is not None:
        assert result_out.data_ptr() == out.data_ptr(), "out= was not written in place"
    # fp32: the kernel's fast exp / log; fp16 / bf16: one rounding of the output on top.
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(result_out.double(), out_ref, rtol=rtol, atol=1e-5)
    assert_lse_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    no_split_saw = torch.isneginf(lse_ref)
    assert (result_out[no_split_saw] == 0).all(), "rows no split saw must be exactly 0"


def random_partials(num_splits, batch=2, seqlen=3, nheads=5, head_dim=128, lse_scale=4.0, empty_fraction=0.3):
    """Partials where some splits saw no key (lse -inf, out NaN), and row (0, 0, 0) none at all."""
    out_partial = randn(num_splits, batch, seqlen, nheads, head_dim, dtype=torch.float32)
    lse_partial = randn(num_splits, batch, seqlen, nheads, dtype=torch.float32) * lse_scale
    empty = torch.rand(lse_partial.shape, device=DEVICE) < empty_fraction
    empty[:, 0, 0, 0] = True
    lse_partial[empty] = -math.inf
    out_partial[empty] = math.nan
    return out_partial, lse_partial


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 17, 64, 128], ids=lambda n: f"splits{n}")
def test_combine(num_splits, out_dtype):
    check_combine(*random_partials(num_splits), out_dtype=out_dtype)


@pytest.mark.parametrize("head_dim, out_dtype, lse_scale", [
    pytest.param(64, torch.float16, 4.0, id="d64-fp16"),
    pytest.param(72, torch.bfloat16, 4.0, id="d72-bf16"),
    pytest.param(256, torch.float32, 100.0, id="d256-fp32-wide_lse"),  # weights that underflow to 0
])
def test_combine_head_dims_and_out_buffer(head_dim, out_dtype, lse_scale):
    out_partial, lse_partial = random_partials(5, head_dim=head_dim, lse_scale=lse_scale)
    out = torch.full(out_partial.shape[1:], math.nan, dtype=out_dtype, device=DEVICE)
    check_combine(out_partial, lse_partial, out_dtype=out_dtype, out=out)


# ---------------------------------------------------------------------------------------------
# flash_attn_func with split-KV


@pytest.mark.parametrize("seqlen_q, seqlen_k, mask", [
    pytest.param(1, 1000, {}, id="sq1-sk1000"),
    pytest.param(3, 1000, {"causal": True}, id="sq3-sk1000-causal"),
    pytest.param(128, 2048, {"window_size": (17, 3)}, id="sq128-sk2048-local17_3"),
])
def test_flash_attn_func_num_splits(seqlen_q, seqlen_k, mask):
    """num_splits=3 against the unsplit call and the reference."""
    q, k, v = randn(2, seqlen_q, 8, 128), randn(2, seqlen_k, 2, 128), randn(2, seqlen_k, 2, 128)
    out_ref, lse_ref = attention_ref(q, k, v, **mask)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **mask)
    bound = RULE_K * (out_pt.float() - out_ref).abs().max().item() + 1e-5
    results = {}
    for num_splits in (1, 3):
        poison_allocator()
        out, lse, _ = flashgen.flash_attn_func(q, k, v, num_splits=num_splits, return_attn_probs=True, **mask)
        assert_close_fa_rule(out, out_ref, out_pt, k=RULE_K, name=f"out(num_splits={num_splits})")
        assert_lse_close(lse, lse_ref, name=f"lse(num_splits={num_splits})")
        results[num_splits] = out, lse
    diff = (results[3][0].float() - results[1][0].float()).abs().max().item()
    assert diff <= bound, f"num_splits=3 vs 1: max |difference| {diff:.3e} > {bound:.3e}"
    assert_lse_close(results[3][1], results[1][1], name="lse(num_splits=3) vs lse(num_splits=1)")
