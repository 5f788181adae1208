"""Dispatch is a pure function of the call and the device: every decision checked on the CPU."""
import dataclasses

import pytest

from flashgen.generator.matrix import is_in_matrix
from flashgen.runtime.dispatch import instance_head_dim, plan_fwd, resolve_mask
from flashgen.runtime.tuning import DEFAULT as DEFAULT_TUNING
from flashgen.runtime.tuning import Tuning


def plan(**overrides):
    args = dict(
        dtype="bf16", head_dim=128, batch=2, seqlen_q=512, seqlen_k=512, nheads=16, nheads_k=16,
        causal=False, window_size=(-1, -1), softcap=0.0, pack_gqa=None, device=(9, 0),
    )
    args.update(overrides)
    return plan_fwd(**args)


@pytest.mark.parametrize("d, expected", [(8, 64), (64, 64), (72, 96), (96, 96), (136, 192), (200, 256), (256, 256)])
def test_instance_head_dim(d, expected):
    assert instance_head_dim(d) == expected


def test_instance_head_dim_too_large():
    with pytest.raises(ValueError, match="at most 256"):
        instance_head_dim(264)


@pytest.mark.parametrize(
    "causal, window, sq, sk, expected",
    [
        (False, (-1, -1), 10, 20, ("none", 0, 0)),
        (True, (-1, -1), 10, 20, ("causal", 30, 0)),
        (False, (-1, 0), 10, 20, ("causal", 30, 0)),
        (True, (5, -1), 10, 20, ("local", 5, 0)),        # causal forces right = 0
        (False, (5, 7), 10, 20, ("local", 5, 7)),
        (False, (-1, 3), 10, 20, ("local", 30, 3)),      # infinite left clamped past every key
        (False, (100, 100), 10, 20, ("local", 30, 30)),  # clamping keeps the literal definition
    ],
)
def test_resolve_mask(causal, window, sq, sk, expected):
    assert resolve_mask(causal, window, sq, sk) == expected


def test_plan_picks_a_spec_in_the_matrix():
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0)):
        for d in (40, 64, 128, 256):
            for causal in (False, True):
                p = plan(device=cc, head_dim=d, causal=causal, softcap=1.0, nheads_k=4)
                assert is_in_matrix(p.spec), p.spec


def test_plan_arch_and_family():
    assert plan(device=(8, 0)).spec.arch == "sm_80"
    assert plan(device=(8, 9)).spec.arch == "sm_86"
    assert plan(device=(9, 0)).spec.arch == "sm_90a"
    assert plan().spec.family == "sm80"
    with pytest.raises(RuntimeError, match="8.0"):
        plan(device=(7, 5))


def test_plan_grid_unpacked_and_packed():
    p = plan(nheads=32, nheads_k=4, seqlen_q=300, pack_gqa=False)
    assert not p.spec.pack_gqa
    assert p.grid == (-(-300 // p.tile.block_m), 32, 2)
    p = plan(nheads=32, nheads_k=4, seqlen_q=300, pack_gqa=True)
    assert p.spec.pack_gqa
    assert p.grid == (-(-300 * 8 // p.tile.block_m), 4, 2)


def test_plan_pack_gqa_choices():
    assert plan(nheads=32, nheads_k=4, seqlen_q=1).spec.pack_gqa            # heuristic: decode
    assert not plan(nheads=32, nheads_k=4, seqlen_q=4096).spec.pack_gqa     # heuristic: full tiles
    assert plan(nheads=32, nheads_k=4, seqlen_q=4096, device=(8, 0)).spec.pack_gqa
    assert not plan(nheads=16, nheads_k=16, pack_gqa=True).spec.pack_gqa    # MHA: same kernel


def test_pack_gqa_rule():
    from flashgen.runtime.dispatch import pack_gqa_for

    rule = dict(nheads=32, nheads_k=8, pack_gqa=None, cc=90, seqlen_q=4096, block_m=128, varlen=False, paged=False,
                num_splits=1)
    assert not pack_gqa_for(**rule)  # full tiles unpacked: the heuristic keeps them
    assert pack_gqa_for(**{**rule, "num_splits": 3})  # split-KV packs
    assert not pack_gqa_for(**{**rule, "num_splits": 0})  # the heuristic's count, not chosen yet
    for change in (dict(cc=80), dict(paged=True), dict(varlen=True), dict(seqlen_q=1)):
        assert pack_gqa_for(**{**rule, **change}), change
    assert pack_gqa_for(**{**rule, "nheads": 2 * 65535, "nheads_k": 65535})  # unpacked heads past gridDim.y
    assert pack_gqa_for(**{**rule, "pack_gqa": True})
    assert not pack_gqa_for(**{**rule, "pack_gqa": False, "num_splits": 3})  # explicit wins
    assert not pack_gqa_for(**{**rule, "nheads": 8, "pack_gqa": True, "cc": 80})  # MHA never packs
    # The sm90 family: the heuristic's packing for groups that divide its tile's rows, without dropout.
    sm90 = {**rule, "seqlen_q": 1, "sm90_rows": 128}
    assert pack_gqa_for(**sm90) and not pack_gqa_for(**sm90, dropout=True)
    six = {**sm90, "nheads": 12, "nheads_k": 2}
    assert not pack_gqa_for(**six) and pack_gqa_for(**{**six, "sm90_rows": 0})
    assert pack_gqa_for(**{**six, "pack_gqa": True})  # explicit: the sm80 family serves it (sm90_covers)
    groups128 = {**sm90, "nheads": 128, "nheads_k": 1}
    assert pack_gqa_for(**groups128) and not pack_gqa_for(**{**groups128, "sm90_rows": 192})  # 192 rows: 1.5 queries


def test_sm90_packs_masked_gqa_under_its_tuning():
    """Tuning.sm90_pack_gqa_masked (on by default): causal and local GQA calls of the sm90 forward pack
    their group (full tiles, which the fill heuristic alone keeps unpacked); no-mask calls, MHA,
    dropout, groups that do not divide the tile's rows and an explicit pack_gqa=False keep the
    heuristic's choice."""
    packing = DEFAULT_TUNING
    assert packing.sm90_pack_gqa_masked  # the default
    unpacking = dataclasses.replace(DEFAULT_TUNING, sm90_pack_gqa_masked=False)
    gqa = dict(sm90=True, head_dim=64, batch=16, seqlen_q=1024, seqlen_k=1024, nheads=32, nheads_k=8)
    unpacked, packed = plan(**gqa, causal=True, tuning=unpacking), plan(**gqa, causal=True, tuning=packing)
    assert unpacked.spec.family == packed.spec.family == "sm90"
    assert not unpacked.spec.pack_gqa and packed.spec.pack_gqa
    assert plan(**gqa, window_size=(256, 0), tuning=packing).spec.pack_gqa  # local
    assert not plan(**gqa, tuning=packing).spec.pack_gqa  # no mask: the heuristic's choice
    assert not plan(**gqa, causal=True, pack_gqa=False, tuning=packing).spec.pack_gqa  # explicit wins
    assert not plan(**{**gqa, "nheads": 8}, causal=True, tuning=packing).spec.pack_gqa  # MHA
    assert not plan(**gqa, causal=True, dropout=True, tuning=packing).spec.pack_gqa  # no packed dropout
    five = plan(**{**gqa, "nheads": 40}, causal=True, tuning=packing)  # 192 rows hold no whole group of 5
    assert not (five.spec.family == "sm90" and five.spec.pack_gqa)


def test_plan_split_heuristic_packs_gqa():
    # Unpacked full tiles (the heuristic does not pack them) but few CTAs: the split heuristic's count,
    # chosen for the unpacked grid, then the packed geometry with it.
    call = dict(batch=1, nheads=32, nheads_k=8, seqlen_q=128, seqlen_k=65536)
    assert not plan(**call).spec.pack_gqa
    p = plan(**call, num_splits=0)
    assert p.spec.pack_gqa and p.num_splits > 1 and p.grid == (4, 8, p.num_splits)
    assert p.num_splits == plan(**call, num_splits=0, pack_gqa=False).num_splits  # 32 CTAs either way


def test_plan_softcap_and_mask_switches():
    assert plan(softcap=30.0).spec.softcap
    assert not plan(softcap=0.0).spec.softcap
    assert plan(causal=True).spec.mask == "causal"
    assert plan(window_size=(64, 0)).spec.mask == "local"
    assert plan(dtype="fp16").spec.dtype == "fp16"


def test_plan_decode_tile_for_few_rows():
    from flashgen.generator.tiles import DECODE_MAX_ROWS, decode_tile

    p = plan(nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=8192)
    assert p.spec.pack_gqa and p.spec.decode and p.tile == decode_tile("sm_90a", 128)
    assert p.grid[:2] == (1, 8)
    paged = plan(nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=8192, paged=True, page_size=16)
    assert paged.spec.paged and paged.tile == decode_tile("sm_90a", 128, paged=True)
    assert plan(seqlen_q=DECODE_MAX_ROWS).spec.decode
    assert not plan(seqlen_q=DECODE_MAX_ROWS + 1).spec.decode  # the regular tile


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90a", "sm_120"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_decode_tile_ring_for_the_targets_shared_memory(arch, head_dim):
    from flashgen.generator import tiles

    base, limit = tiles.FWD_DECODE_TILE, tiles.smem_limit(arch)
    reserved = tiles.SMEM_PER_CTA_RESERVED
    contiguous, paged = tiles.decode_tile(arch, head_dim), tiles.decode_tile(arch, head_dim, paged=True)
    deepest_shared = max(base.kv_buffers, tiles.DECODE_MAX_SHARED_RING)
    for tile in (contiguous, paged):
        assert tile.smem_bytes(head_dim) <= limit and 2 <= tile.kv_buffers <= deepest_shared
        assert (tile.block_m, tile.num_warps, tile.warps_n) == (base.block_m, base.num_warps, base.warps_n)
    assert paged.kv_buffers <= base.kv_buffers  # one CTA per SM: FWD_DECODE_TILE's ring at most
    # Paged instances keep K and V of a block in a pair of buffers.
    assert paged.kv_buffers % 2 == 0
    twice = 2 * (contiguous.smem_bytes(head_dim) + reserved) <= limit + reserved
    if contiguous.kv_buffers >= tiles.DECODE_MIN_SHARED_RING and twice:
        # The deepest ring with which two CTAs share an SM, at the full key block.
        assert contiguous.block_n == base.block_n
        deeper = dataclasses.replace(contiguous, kv_buffers=contiguous.kv_buffers + 1)
        assert contiguous.kv_buffers == deepest_shared or \
            2 * (deeper.smem_bytes(head_dim) + reserved) > limit + reserved
    else:
        # No such ring: the deepest one CTA holds, as deep as the paged one (or one deeper).
        assert not any(2 * (dataclasses.replace(base, kv_buffers=b).smem_bytes(head_dim) + reserved) <= limit + reserved
                       for b in range(tiles.DECODE_MIN_SHARED_RING, deepest_shared + 1))
        assert contiguous.block_n >= paged.block_n and base.kv_buffers >= contiguous.kv_buffers >= paged.kv_buffers
    # H200 at d128: three buffers (100 KB), two CTAs per SM; paged: four (one CTA).
    if (arch, head_dim) == ("sm_90a", 128):
        assert contiguous.kv_buffers == 3 and contiguous.ctas_per_sm(head_dim, 228 * 1024) == 2
        assert paged.kv_buffers == 4 and paged.ctas_per_sm(head_dim, 228 * 1024) == 1
    # H200 at d64: six buffers of 16 KB, two CTAs per SM (DECODE_MAX_SHARED_RING).
    if (arch, head_dim) == ("sm_90a", 64):
        assert contiguous.kv_buffers == 6 and contiguous.ctas_per_sm(head_dim, 228 * 1024) == 2


def test_plan_splits():
    from flashgen.runtime.dispatch import MAX_SPLITS, DeviceInfo

    h200 = DeviceInfo((9, 0), num_sms=132, l2_bytes=60 * 2**20, smem_per_sm=228 * 1024)
    # Decode at batch 1: far fewer CTAs than the GPU holds -> the heuristic splits the keys.
    p = plan(batch=1, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=131072, num_splits=0, device=h200)
    assert 1 < p.num_splits <= MAX_SPLITS and p.grid[2] == p.num_splits
    # Large batch: enough CTAs already.
    assert plan(batch=128, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=2048, num_splits=0, device=h200).num_splits == 1
    # Forced counts are clamped to the key blocks and to MAX_SPLITS.
    assert plan(seqlen_k=100, num_splits=50).num_splits == 2
    assert plan(seqlen_k=1 << 20, num_splits=1000).num_splits == MAX_SPLITS
    # Split-KV packs GQA heads when the caller left the choice open.
    p = plan(batch=1, nheads=32, nheads_k=8, seqlen_q=1024, seqlen_k=65536, num_splits=4, device=h200)
    assert p.spec.pack_gqa and p.num_splits == 4


def test_plan_splits_drop_empty_splits_fill_the_decode_wave_and_merge_in_clusters():
    from flashgen.runtime import heuristics
    from flashgen.runtime.dispatch import DeviceInfo

    h200 = DeviceInfo((9, 0), num_sms=132, l2_bytes=60 * 2**20, smem_per_sm=228 * 1024)
    decode = dict(batch=1, nheads=32, nheads_k=8, seqlen_q=1, num_splits=0, device=h200)
    # 2k keys are 16 blocks of 128: the heuristic's 14 splits would take 2 blocks each and leave
    # 6 splits empty; only the 8 with keys are launched.
    assert heuristics.num_splits_heuristic(8, 132, 16, 1, 2048 * 128 * 4, False, 128) == 14
    p = plan(seqlen_k=2048, **decode)
    assert p.num_splits == 8 and p.merge_in_cluster  # one cluster of 8 per tile: no combine kernel
    # 32k keys: 8 CTAs x 15 splits would leave 12 SMs idle; 16 splits fill the wave and keep 16
    # blocks each (more than a cluster merges: the combine kernel).
    p = plan(seqlen_k=32768, **decode)
    assert p.num_splits == 16 and p.grid == (1, 8, 16) and not p.merge_in_cluster
    # 8k keys (64 blocks, at most DECODE_CLUSTER_MAX_BLOCKS): the heuristic's 13 splits give way
    # to 8 merged in a cluster; without clusters (the A100, or the switch off) they stay.
    p = plan(seqlen_k=8192, **decode)
    assert p.num_splits == 8 and p.merge_in_cluster
    a100 = DeviceInfo((8, 0), num_sms=108, l2_bytes=40 * 2**20, smem_per_sm=164 * 1024)
    assert not plan(seqlen_k=2048, **{**decode, "device": a100}).merge_in_cluster
    assert not plan(seqlen_k=8192, num_splits=13, **{k: v for k, v in decode.items() if k != "num_splits"}).merge_in_cluster
    assert plan(seqlen_k=8192, num_splits=3, **{k: v for k, v in decode.items() if k != "num_splits"}).merge_in_cluster
    assert not plan(seqlen_k=8192, varlen=True, **decode).merge_in_cluster  # the combine zeroes rows past seqused_q
    # Clusters only while the grid takes at most half the CTA slots: batch 4 x 2k keys (32 tiles x 4
    # splits) merges in clusters with two decode CTAs per SM (contiguous), not with one (paged);
    # batch 1 (8 tiles x 8 splits) with either.
    b4 = {**decode, "batch": 4}
    p = plan(seqlen_k=2048, **b4)
    assert p.num_splits == 4 and p.merge_in_cluster
    p = plan(seqlen_k=2048, paged=True, page_size=16, **b4)
    assert p.tile.ctas_per_sm(128, h200.smem_per_sm) == 1 and p.num_splits == 4 and not p.merge_in_cluster
    assert plan(seqlen_k=8192, paged=True, page_size=16, **decode).merge_in_cluster
    # Clusters of more than two splits only for short splits (DECODE_CLUSTER_MAX_SPLIT_BLOCKS of the
    # instance head dim) or grids of at most half the SMs: b4 x 8k (4 splits of 16 blocks, 128 CTAs)
    # merges in clusters at d128 and d64, through the combine kernel at d96 (as b4 x 4k, 4 splits of
    # 8 blocks, does there), and with 32k keys (64 blocks a split) at d128 too; b8 x 128k (2 of 512)
    # in clusters.
    assert dict(DEFAULT_TUNING.decode_cluster_max_split_blocks) == {64: 16, 96: 2, 128: 16, 192: 8, 256: 8}
    assert plan(seqlen_k=4096, **b4).merge_in_cluster and not plan(seqlen_k=4096, head_dim=96, **b4).merge_in_cluster
    p = plan(seqlen_k=8192, **b4)
    assert p.num_splits == 4 and p.merge_in_cluster
    assert plan(seqlen_k=8192, head_dim=64, **b4).merge_in_cluster
    p = plan(seqlen_k=8192, head_dim=96, **b4)
    assert p.num_splits == 4 and not p.merge_in_cluster
    assert not plan(seqlen_k=32768, **b4).merge_in_cluster
    # 16k keys (128 blocks, more than DECODE_CLUSTER_MAX_BLOCKS): 16 splits and the combine kernel,
    # not 8 in a cluster.
    p = plan(seqlen_k=16384, **decode)
    assert p.num_splits == 16 and not p.merge_in_cluster
    p = plan(seqlen_k=131072, **{**decode, "batch": 8})
    assert p.num_splits == 2 and p.merge_in_cluster
    # Decode splits count one CTA per SM even where two fit.
    assert p.tile.ctas_per_sm(128, h200.smem_per_sm) == 2 and plan(seqlen_k=131072, **b4).num_splits == 4
    prefill = dict(batch=1, nheads=8, nheads_k=8, seqlen_q=128, seqlen_k=32768, num_splits=0, device=h200)
    prefill_splits = plan(**prefill).num_splits
    assert not plan(**prefill).merge_in_cluster
    plain = Tuning(decode_fill_wave=False, merge_in_cluster=False)
    assert plan(seqlen_k=32768, tuning=plain, **decode).num_splits == 15
    p = plan(seqlen_k=8192, tuning=plain, **decode)  # 15 splits of 5 blocks: 13 with keys
    assert p.num_splits == 13 and not p.merge_in_cluster
    assert plan(tuning=plain, **prefill).num_splits == prefill_splits  # prefill tiles keep the heuristic's count
    assert plan(seqlen_k=8192, **decode).merge_in_cluster  # the memo keys on the tuning


def test_plan_decode_is_a_dependent_launch_on_sm90_only():
    from flashgen.runtime.dispatch import DeviceInfo

    h200 = DeviceInfo((9, 0), num_sms=132, l2_bytes=60 * 2**20, smem_per_sm=228 * 1024)
    a100 = DeviceInfo((8, 0), num_sms=108, l2_bytes=40 * 2**20, smem_per_sm=164 * 1024)
    decode = dict(batch=1, nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=8192, num_splits=0)
    # b1 x 8k: 64 CTAs (8 tiles x 8 splits), at most half the SMs; b128 x 2k: 1024 CTAs, several
    # waves of the 264 slots; both dependent. b4 x 4k: 128 CTAs (32 x 4 splits), about one per SM: not.
    p = plan(device=h200, **decode)
    assert p.grid == (1, 8, 8) and p.dependent_launch
    assert plan(device=h200, paged=True, page_size=16, **decode).dependent_launch
    p = plan(device=h200, **{**decode, "batch": 128, "seqlen_k": 2048})
    assert p.grid == (1, 8, 128) and p.dependent_launch
    p = plan(device=h200, **{**decode, "batch": 4, "seqlen_k": 4096})
    assert p.grid == (1, 8, 16) and not p.dependent_launch
    assert not plan(device=a100, **decode).dependent_launch  # griddepcontrol is sm_90+
    # Prefill tiles keep the plain launch.
    assert not plan(device=h200, **{**decode, "seqlen_q": 512}).dependent_launch
    assert not plan(device=h200, tuning=Tuning(decode_dependent_launch=False), **decode).dependent_launch
    any_grid = Tuning(decode_dependent_max_sm_share=float("inf"))
    assert plan(device=h200, tuning=any_grid, **{**decode, "batch": 4, "seqlen_k": 4096}).dependent_launch


def test_plan_decode_pairs_adjacent_kv_heads():
    """Decode over adjacent KV heads at the head dims of Tuning.decode_paired_head_dims reads two heads
    per CTA on the instance of twice the head dim (half the grid's heads, packed rows of both), for
    grids of decode_pair_min_sm_share of the SMs; every condition it needs is checked."""
    # The default: d64 and d96, from 66 paired tiles on 132 SMs (32 x 8 KV heads, not 16 x 8).
    assert DEFAULT_TUNING.decode_paired_head_dims == {64, 96} and DEFAULT_TUNING.decode_pair_min_sm_share == 0.5
    large = dict(nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=8192, num_splits=0, kv_heads_adjacent=True)
    assert plan(head_dim=96, **{**large, "batch": 32}).kv_head_group == 2
    assert plan(head_dim=64, **{**large, "batch": 32}).kv_head_group == 2
    assert plan(head_dim=128, **{**large, "batch": 32}).kv_head_group == 1
    assert plan(head_dim=96, **{**large, "batch": 16}).kv_head_group == 1
    any_grid = Tuning(decode_paired_head_dims=frozenset({64, 96, 128}), decode_pair_min_sm_share=0)
    decode = dict(nheads=32, nheads_k=8, seqlen_q=1, seqlen_k=8192, num_splits=0, kv_heads_adjacent=True,
                  tuning=any_grid)
    for head_dim in (64, 96, 128):
        p = plan(head_dim=head_dim, **decode)
        single = plan(head_dim=head_dim, **{**decode, "kv_heads_adjacent": False})
        assert p.kv_head_group == 2 and single.kv_head_group == 1
        assert p.spec.head_dim == 2 * head_dim and p.spec.decode and p.spec.pack_gqa and is_in_matrix(p.spec)
        assert p.grid[1] == 4 and single.grid[1] == 8
    paged = plan(head_dim=96, paged=True, page_size=16, **decode)
    assert paged.kv_head_group == 2 and paged.spec.paged and paged.spec.head_dim == 192
    # MHA packs its pairs (two rows per tile); causal rows of two query tokens still fit a block.
    mha = plan(head_dim=96, **{**decode, "nheads": 8, "nheads_k": 8})
    assert mha.kv_head_group == 2 and mha.spec.pack_gqa and mha.grid[1] == 4
    assert plan(head_dim=128, causal=True, **{**decode, "seqlen_q": 2}).kv_head_group == 2
    # Not: another head dim, an odd KV head count, rows of two heads past one decode row block,
    # pack_gqa=False, heads-first memory, prefill.
    assert plan(head_dim=80, **decode).kv_head_group == 1
    assert plan(head_dim=256, **decode).kv_head_group == 1
    assert plan(head_dim=96, **{**decode, "nheads": 24, "nheads_k": 3}).kv_head_group == 1
    assert plan(head_dim=96, **{**decode, "seqlen_q": 3}).kv_head_group == 1  # 24 rows
    assert plan(head_dim=96, pack_gqa=False, **decode).kv_head_group == 1
    assert plan(head_dim=96, **{**decode, "seqlen_q": 512}).kv_head_group == 1
    never = dataclasses.replace(any_grid, decode_paired_head_dims=frozenset())
    assert plan(head_dim=96, **{**decode, "tuning": never}).kv_head_group == 1


def test_plan_paged_forces_packing():
    assert plan(nheads=32, nheads_k=8, seqlen_q=4096, paged=True).spec.pack_gqa
    assert plan(nheads=32, nheads_k=8, seqlen_q=4096, paged=True).spec.paged


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90a"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_bwd_tile_fits_and_takes_the_most_stages_that_fit(arch, head_dim):
    from flashgen.generator import tiles
    from flashgen.runtime.dispatch import plan_bwd

    tile = tiles.bwd_tile("sm80", arch, head_dim)
    limit = tiles.smem_limit(arch)
    assert 1 <= tile.stages <= tiles.BWD_MAX_STAGES and tile.smem_bytes(head_dim) <= limit
    if tile.stages < tiles.BWD_MAX_STAGES:  # one more stage would not fit
        assert dataclasses.replace(tile, stages=tile.stages + 1).smem_bytes(head_dim) > limit
    # BwdTraits' static_asserts: 32-key warp groups whose warps split the queries (Sᵀ, dPᵀ) and the
    # head-dim slice (dK, dV) into multiples of 16; dropout's keep bits (8 per n8 tile of a warp's
    # queries) fit 64 bits; the dQ tiles (32 or 16 rows, >= 16 columns) cover a step exactly.
    assert tile.block_n == 32 * tile.key_groups
    warps_per_group = tile.num_warps // tile.key_groups
    warp_queries, warp_columns = tile.block_m // warps_per_group, head_dim // tile.d_slices // warps_per_group
    assert warp_queries % 16 == 0 and warp_columns % 16 == 0 and warp_queries // 8 <= 8
    dq_row_groups = [tile.block_m // rows for rows in (32, 16) if tile.block_m % rows == 0
                     and tile.num_warps % (tile.block_m // rows) == 0
                     and (head_dim // tile.d_slices) % (tile.num_warps // (tile.block_m // rows) * 16) == 0]
    assert dq_row_groups, "no dQ tiling covers the step"
    # dQ through the shared tile and bulk reductions wherever the target has them (every head dim
    # fits it on sm_90a, d256 with one Q/dO stage), atomics elsewhere; a tile row is one contiguous
    # dq_accum row and starts 16-byte aligned (kDQPitch).
    assert tile.dq_tile == (arch in tiles.BULK_REDUCTION_ARCHS)
    if tile.dq_tile:
        assert tile.d_slices == 1 and (head_dim // tile.d_slices + 8) * 4 % 16 == 0
        no_tile = dataclasses.replace(tile, dq_tile=False)
        assert tile.smem_bytes(head_dim) == no_tile.smem_bytes(head_dim) + tile.block_m * (head_dim + 8) * 4

    # The plan launches that tile: one CTA per key block and head-dim slice, per KV head and batch.
    capability = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_90a": (9, 0)}[arch]
    p = plan_bwd(dtype="bf16", head_dim=head_dim, batch=3, seqlen_q=300, seqlen_k=1000, nheads_k=4, causal=False,
                 window_size=(-1, -1), softcap=0.0, device=capability)
    assert p.tile == tile and p.smem_bytes == tile.smem_bytes(head_dim)
    assert p.grid == (-(-1000 // tile.block_n) * tile.d_slices, 4, 3)


def test_bwd_tile_rejects_warps_that_do_not_split_the_keys():
    from flashgen.generator import tiles

    assert tiles.BwdTile(8, 64, 1).block_n == 128 and tiles.BwdTile(8, 64, 1, key_groups=2).block_n == 64
    with pytest.raises(ValueError, match="32-key group"):
        tiles.BwdTile(8, 64, 1, key_groups=3)
    with pytest.raises(ValueError, match="32-key group"):
        tiles.BwdTile(8, 32, 1, key_groups=2)  # four warps per group would own 8 queries each


def test_sm90_forward_is_chosen_on_hopper_where_it_has_an_instance():
    hopper = plan(sm90=True)
    assert (hopper.spec.family, hopper.spec.arch) == ("sm90", "sm_90a") and is_in_matrix(hopper.spec)
    assert hopper.grid == (128, 1, 1) and hopper.tile.num_threads == 384 and hopper.num_splits == 1  # 4 x 16 x 2 tiles
    assert plan(sm90=True, batch=8).grid == (132, 1, 1)  # one persistent CTA per SM
    # Fewer work units than SMs: one CTA per unit, a tile, or under the causal mask a pair of row
    # blocks (m, last - m), a lone middle block of an odd count its own unit.
    assert plan(sm90=True, batch=1, seqlen_q=640, seqlen_k=640).grid == (5 * 16, 1, 1)
    assert plan(sm90=True, batch=1, seqlen_q=640, seqlen_k=640, causal=True).grid == (3 * 16, 1, 1)
    assert plan(sm90=True, batch=1, seqlen_q=512, seqlen_k=512, causal=True).grid == (2 * 16, 1, 1)
    assert plan(sm90=True, causal=True).spec.mask == "causal"
    assert plan(sm90=True, window_size=(16, 0)).spec.mask == "local"
    assert plan(sm90=True, varlen=True).spec.family == "sm90"
    # The sm90 kernel counts rows and work units in 32-bit ints: past that, sm80 (review finding:
    # 65535 sequences of up to 64k rows x 128 heads, or PackGQA rows of an absurd max_seqlen_q).
    huge = dict(sm90=True, varlen=True, head_dim=64, nheads=128, nheads_k=128, batch=65535, seqlen_q=65536)
    assert plan(**huge).spec.family == "sm80" and plan(**dict(huge, batch=4096)).spec.family == "sm90"
    # Varlen launches a CTA per unit, whose next unit (slot 1) is its own + the grid: under 2^31 too.
    assert plan(**dict(huge, batch=32767)).spec.family == "sm80"  # 512 x 128 x 32767 units: 2^31 - 2^16
    assert plan(**dict(huge, batch=32767, varlen=False)).spec.family == "sm90"
    packed = dict(sm90=True, nheads=8, nheads_k=1, pack_gqa=True, batch=1, seqlen_k=64)
    assert plan(**packed, seqlen_q=2**27).spec.family == "sm90"
    assert plan(**packed, seqlen_q=2**28).spec.family == "sm80"
    # Varlen (lengths on the device): one CTA per unit, not one per SM.
    assert plan(sm90=True, varlen=True, batch=8).grid == (4 * 16 * 8, 1, 1)  # 512 > 132 SMs
    # ... unless every sequence is known to be the longest: then the persistent grid.
    assert plan(sm90=True, varlen=True, varlen_uniform=True, batch=8).grid == (132, 1, 1)
    assert plan(sm90=True, softcap=30.0, causal=True).spec.uri == "flash_fwd_sm90_hdim128_bf16_causal_softcap_sm90a"
    assert plan(sm90=True, nheads_k=4).spec.family == "sm90"  # GQA without packing
    packed = plan(sm90=True, nheads_k=4, pack_gqa=True, batch=1, seqlen_q=100, seqlen_k=100)
    assert packed.spec.uri == "flash_fwd_sm90_hdim128_bf16_packgqa_sm90a"
    assert packed.grid == (-(-100 * 4 // 128) * 4, 1, 1)  # packed row blocks x KV heads
    # A group of 6 does not divide 128 rows: the heuristic's packing gives way to unpacked sm90;
    # packing the caller asks for stays, on sm80.
    six = dict(sm90=True, nheads=12, nheads_k=2, batch=2, seqlen_q=64, seqlen_k=4096)
    assert plan(**six).spec.uri == "flash_fwd_sm90_hdim128_bf16_sm90a"
    assert plan(**six, pack_gqa=True).spec.uri == "flash_fwd_sm80_hdim128_bf16_packgqa_sm90a"
    assert plan(**dict(six, nheads=16)).spec.uri == "flash_fwd_sm90_hdim128_bf16_packgqa_sm90a"
    assert plan(sm90=True, head_dim=256).tile.block_n == 64
    # Head dims below an instance's run the next one up (the TMA zero-fills the extra columns).
    for head_dim, instance in ((8, 64), (40, 64), (96, 128), (136, 192), (192, 192), (200, 256), (256, 256)):
        chosen = plan(sm90=True, head_dim=head_dim)
        assert chosen.spec.family == "sm90" and chosen.spec.head_dim == instance, (head_dim, chosen.spec.uri)
    # The caller says no (tensors the TMA cannot read), the knob forces sm80, or the device
    # is not Hopper: the sm80 family.
    assert plan().spec.family == "sm80"
    assert plan(sm90=True, family="sm80").spec.family == "sm80"
    assert plan(sm90=True, family="sm90").spec.family == "sm90"
    assert plan(sm90=True, device=(8, 0)).spec.family == "sm80"
    assert plan(sm90=True, device=(8, 9), family="sm90").spec.family == "sm80"


@pytest.mark.parametrize("change", [
    dict(pack_gqa=True, nheads=12, nheads_k=2),  # a group of 6: 128 % 6
    dict(nheads_k=4, seqlen_q=3), dict(seqlen_q=1), dict(seqlen_q=1, num_splits=0), dict(paged=True, seqlen_q=1),
    dict(dropout=True, pack_gqa=True, nheads_k=4), dict(dropout=True, num_splits=3), dict(seqlen_k=0),
])
def test_sm90_forward_leaves_what_it_lacks_to_sm80(change):
    chosen = plan(sm90=True, **change)
    assert chosen.spec.family == "sm80" and is_in_matrix(chosen.spec), chosen.spec


def test_sm90_forward_dropout():
    # Training with dropout on Hopper: the unpacked, unsplit sm90 dropout instance; the heuristic's
    # packing gives way (no packed dropout instance).
    chosen = plan(sm90=True, dropout=True, causal=True)
    assert chosen.spec.uri == "flash_fwd_sm90_hdim128_bf16_causal_dropout_sm90a" and chosen.num_splits == 1
    gqa = plan(sm90=True, dropout=True, nheads=16, nheads_k=2, seqlen_q=64, seqlen_k=4096)
    assert gqa.spec.uri == "flash_fwd_sm90_hdim128_bf16_dropout_sm90a", gqa.spec.uri
    # The split heuristic (num_splits=0) stays unsplit on sm90; a forced split goes to sm80.
    few_tiles = dict(sm90=True, dropout=True, batch=1, nheads=4, nheads_k=4, seqlen_q=300, seqlen_k=16384)
    assert plan(**few_tiles, num_splits=0).spec.uri == "flash_fwd_sm90_hdim128_bf16_dropout_sm90a"
    assert plan(**few_tiles, num_splits=3).spec.family == "sm80"


def test_sm90_forward_paged():
    # Paged K/V of any page size (the kernel takes TMA boxes or gathers rows, fwd_sm90.cuh): the
    # paged sm90 instances, packed as the heuristic packs paged calls, split where asked.
    from flashgen.generator.tiles import fwd_tile

    block_n = {d: fwd_tile("sm90", "sm_90a", d).block_n for d in (64, 128)}
    paged = plan(sm90=True, paged=True, page_size=256, nheads_k=4, seqlen_q=100, seqlen_k=4096)
    assert paged.spec.uri == "flash_fwd_sm90_hdim128_bf16_packgqa_paged_sm90a", paged.spec.uri
    assert plan(sm90=True, paged=True, page_size=block_n[128], num_splits=3).spec.uri == (
        "flash_fwd_sm90_hdim128_bf16_paged_split_sm90a")
    # Pages that split the key blocks, a left pad or no page size: the gather instance.
    for page_size, leftpad in [(1, False), (16, False), (block_n[128] + 16, False), (256, True), (0, False)]:
        chosen = plan(sm90=True, paged=True, page_size=page_size, leftpad=leftpad)
        assert chosen.spec.uri == "flash_fwd_sm90_hdim128_bf16_paged_gather_sm90a", (page_size, leftpad, chosen.spec.uri)
    # d64's 256-key blocks: pages of 128 split them.
    assert plan(sm90=True, paged=True, head_dim=64, page_size=block_n[64] // 2).spec.gather
    assert not plan(sm90=True, paged=True, head_dim=64, page_size=block_n[64]).spec.gather
    # A group that does not divide the tile's 128 rows: unpacked; decode rows: the sm80 decode tile.
    odd_group = plan(sm90=True, paged=True, page_size=256, nheads=12, nheads_k=4, seqlen_q=100)
    assert odd_group.spec.uri == "flash_fwd_sm90_hdim128_bf16_paged_sm90a", odd_group.spec.uri
    assert plan(sm90=True, paged=True, seqlen_q=1, nheads_k=4).spec.family == "sm80"


def test_sm90_forward_split_kv():
    from flashgen.generator.tiles import fwd_tile
    from flashgen.runtime import heuristics
    from flashgen.runtime.dispatch import MAX_SPLITS

    block_n = fwd_tile("sm90", "sm_90a", 128).block_n
    n_blocks = -(-8192 // block_n)
    # Forced: N units per tile (one per share of the key blocks) on the persistent grid.
    forced = plan(sm90=True, batch=1, nheads=4, nheads_k=4, seqlen_q=300, seqlen_k=8192, num_splits=3)
    assert forced.spec.family == "sm90" and forced.num_splits == 3
    assert forced.grid == (3 * 4 * 3, 1, 1)  # row blocks x heads x splits, below the 132 SMs
    # Clamped to the sm90 tile's key blocks, and to counts that leave no share empty.
    few_keys = plan(sm90=True, seqlen_k=3 * block_n - 1, num_splits=16)
    assert few_keys.spec.family == "sm90" and few_keys.num_splits == 3
    assert plan(sm90=True, seqlen_k=5 * block_n, num_splits=4).num_splits == 3  # shares of 2, 2, 1 blocks
    # 1000 -> MAX_SPLITS (128) shares of ceil(300 / 128) = 3 blocks -> 100 shares that all get keys.
    assert plan(sm90=True, seqlen_k=300 * block_n, num_splits=1000).num_splits == 100
    # The heuristic, with the sm90 geometry: one CTA per SM, the sm90 tile's rows and key blocks.
    chosen = plan(sm90=True, batch=1, nheads=4, nheads_k=4, seqlen_q=300, seqlen_k=8192, num_splits=0)
    expected = heuristics.num_splits_heuristic(3 * 4, 132, n_blocks, 3, 8192 * 128 * 4, False, MAX_SPLITS,
                                               l2_bytes=50 * 2**20)
    assert chosen.spec.family == "sm90" and chosen.num_splits == -(-n_blocks // -(-n_blocks // expected)) > 1
    # Causal pairs row blocks; the split count multiplies the units.
    causal = plan(sm90=True, batch=1, nheads=2, nheads_k=2, seqlen_q=1024, seqlen_k=1024, causal=True, num_splits=2)
    assert causal.spec.uri == "flash_fwd_sm90_hdim128_bf16_causal_split_sm90a" and causal.grid == (4 * 2 * 2, 1, 1)
    assert plan(sm90=True, num_splits=1).spec.uri == "flash_fwd_sm90_hdim128_bf16_sm90a"  # no split: its own instance


def test_sm90_tiles_fit_and_match_the_kernel_layout():
    from flashgen.generator import render
    from flashgen.generator.matrix import SM90_FWD_HEAD_DIMS
    from flashgen.generator.tiles import Sm90FwdTile, fwd_tile, smem_limit

    for head_dim in SM90_FWD_HEAD_DIMS:
        tile = fwd_tile("sm90", "sm_90a", head_dim)
        assert tile.smem_bytes(head_dim) <= smem_limit("sm_90a")
        assert tile.block_m == 64 * tile.consumers and tile.num_threads == 128 * (tile.consumers + 1)
        assert tile.consumers in (2, 3) and tile.stages >= 2
        # setmaxnreg: multiples of 8, and the warpgroups within what the launch allocates (168 x 384,
        # 128 x 512).
        regs = (tile.producer_registers, tile.consumer_registers)
        cap = 65536 // tile.num_threads // 8 * 8
        assert all(r % 8 == 0 for r in regs) and 24 <= regs[0]
        assert (regs[0] + tile.consumers * regs[1]) * 128 <= cap * tile.num_threads
    # The instance asserts the host's request against the kernel's own layout (kSmemBytes).
    source = render.render_instance(plan(sm90=True, head_dim=128).spec)
    assert f"Traits::kSmemBytes == {fwd_tile('sm90', 'sm_90a', 128).smem_bytes(128)}" in source
    with pytest.raises(ValueError, match="sm90"):
        fwd_tile("sm90", "sm_90a", 96)  # served by the d128 instance (dispatch.sm90_instance_head_dim)
    tile = fwd_tile("sm90", "sm_90a", 128)
    assert (f"/*kProducerRegs=*/{tile.producer_registers}, /*kConsumerRegs=*/{tile.consumer_registers},\n"
            f"        /*kConsumers=*/{tile.consumers}>") in source
    assert (Sm90FwdTile(128).producer_registers, Sm90FwdTile(128).consumer_registers) == (24, 240)
    assert Sm90FwdTile(128, producer_registers=40).consumer_registers == 232
    # Three consumers (192 rows): 512 threads of 128 registers, 160 each for the consumers.
    three = Sm90FwdTile(128, block_m=192)
    assert (three.consumers, three.num_threads, three.consumer_registers) == (3, 512, 160)
    with pytest.raises(ValueError, match="64 rows"):
        Sm90FwdTile(128, block_m=256)
    with pytest.raises(ValueError, match="setmaxnreg"):
        Sm90FwdTile(128, producer_registers=36)
    # O staged in the tile's last K/V stage (kStageO): the tile's choice reaches the kernel, and a
    # stage too small for O's rows is refused.
    assert "/*kStageO=*/true" in source and tile.stage_o
    assert "/*kStageO=*/false" in render.render_instance(plan(sm90=True, head_dim=64).spec)
    with pytest.raises(ValueError, match="staged"):
        Sm90FwdTile(48)


def test_sm90_wgmma_wrappers_cover_the_tiles():
    # S = Q·Kᵀ is a wgmma with N = block_n, O += P·V one with N = head_dim: both must be rendered.
    from flashgen.generator import render, wgmma
    from flashgen.generator.matrix import SM90_FWD_HEAD_DIMS
    from flashgen.generator.tiles import fwd_tile

    header = render.header_sources()[wgmma.HEADER]
    for head_dim in SM90_FWD_HEAD_DIMS:
        for n in (fwd_tile("sm90", "sm_90a", head_dim).block_n, head_dim):
            assert n in wgmma.N_TILES
            for kind in ("ss", "rs"):
                assert f"void wgmma_{kind}_m64n{n}k16(float (&d)[{n // 2}]" in header
                assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in header


def _plan_bwd(**overrides):
    from flashgen.runtime.dispatch import plan_bwd

    kwargs = dict(dtype="bf16", head_dim=128, batch=2, seqlen_q=300, seqlen_k=1000, nheads_k=4, causal=False,
                  window_size=(-1, -1), softcap=0.0, device=(9, 0))
    return plan_bwd(**{**kwargs, **overrides})


@pytest.mark.parametrize("head_dim, key_blocks", [(64, 8), (128, 8), (192, 11), (256, 16)])
@pytest.mark.parametrize("causal, window_size, mask", [(False, (-1, -1), "none"), (True, (-1, -1), "causal"),
                                                       (False, (16, 4), "local")])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_sm90_backward_is_chosen_on_hopper_where_it_has_an_instance(head_dim, key_blocks, causal, window_size, mask,
                                                                     softcap):
    from flashgen.generator import tiles

    chosen = _plan_bwd(head_dim=head_dim, causal=causal, window_size=window_size, softcap=softcap, sm90=True)
    assert (chosen.spec.family, chosen.spec.arch, chosen.spec.mask, chosen.spec.softcap) == (
        "sm90", "sm_90a", mask, softcap > 0)
    assert is_in_matrix(chosen.spec) and chosen.tile == tiles.bwd_tile("sm90", "sm_90a", head_dim)
    # One CTA per 128 keys (d192: 96, the query rows; d256: 64, the split columns), per KV head and
    # batch; 384 threads;
    # within the target's shared memory.
    assert chosen.grid == (key_blocks, 4, 2) and chosen.tile.num_threads == 384
    assert chosen.smem_bytes == chosen.tile.smem_bytes(head_dim) <= tiles.smem_limit("sm_90a")


@pytest.mark.parametrize("overrides", [
    dict(sm90=False),                    # inputs the TMA cannot read, or seqused (flash_bwd)
    dict(sm90=True, family="sm80"),      # the sm80 family forced
    dict(sm90=True, device=(8, 0)),      # not Hopper
])
def test_sm90_backward_leaves_the_rest_to_sm80(overrides):
    chosen = _plan_bwd(**overrides)
    assert chosen.spec.family == "sm80" and is_in_matrix(chosen.spec)


@pytest.mark.parametrize("head_dim, instance", [(64, 64), (128, 128), (136, 192), (192, 192), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_backward_is_deterministic_at_every_head_dim(head_dim, instance, causal):
    # Every instance's dQ goes through a tile and TMA reductions, which the semaphores order; MHA
    # causal takes descending turns.
    chosen = _plan_bwd(head_dim=head_dim, causal=causal, sm90=True, deterministic=True, nheads=4)
    assert (chosen.spec.family, chosen.spec.head_dim) == ("sm90", instance) and is_in_matrix(chosen.spec)
    assert chosen.dq_turns_descending == causal


def test_sm90_backward_with_dropout():
    # Dropout has its sm90 backward instances (the forward's Philox mask regenerated, bwd_sm90.cuh).
    chosen = _plan_bwd(sm90=True, dropout=True)
    assert chosen.spec.family == "sm90" and chosen.spec.dropout and is_in_matrix(chosen.spec), chosen.spec


@pytest.mark.parametrize("head_dim, instance", [(8, 64), (40, 64), (64, 64), (72, 128), (96, 128), (128, 128),
                                               (136, 192), (192, 192), (200, 256), (256, 256)])
def test_sm90_backward_serves_head_dims_below_an_instance_on_it(head_dim, instance):
    chosen = _plan_bwd(head_dim=head_dim, sm90=True)
    assert (chosen.spec.family, chosen.spec.head_dim) == ("sm90", instance) and is_in_matrix(chosen.spec)


def test_sm90_backward_tiles_and_widths():
    from flashgen.generator import matrix, tiles

    for head_dim in matrix.SM90_BWD_HEAD_DIMS:
        tile = tiles.bwd_tile("sm90", "sm_90a", head_dim)
        # Sm90BwdTraits' asserts: two consumers of 64 keys each, sharing 64 keys with the columns
        # split (d256; a consumer's dK and dV in registers), or 48 keys each in the queries' domain
        # (d192); each dQ share whole 64-column panels, but for the query rows' panel and a half.
        assert tile.split_columns == (head_dim == 256) and tile.query_rows == (head_dim == 192)
        assert tile.block_n == {192: 96, 256: 64}.get(head_dim, 128)
        dkv, dq = tile.dkv_mma_widths(head_dim), tile.dq_mma_widths(head_dim)
        assert tile.block_m in (64, 128) and max(dkv) <= 128
        if tile.query_rows:
            # dKᵀ and dVᵀ: N is each consumer's 48 keys; dQ a 64- and a 32-column MMA each.
            assert dkv == (48, 48) and dq == (64, 32) and tile.s_mma_width == 48
        else:
            assert all(n % 64 == 0 for n in dkv + dq)
        # Split columns: the two consumers' dK and dV columns are all of the head dim's.
        assert sum(dkv) == head_dim if tile.split_columns else tile.query_rows or dkv == (head_dim, head_dim)
        # Split columns and query rows leave no room for a dQ tile of its own: it lies in the step's
        # Q and dO panels.
        assert tile.dq_in_stage == (tile.split_columns or tile.query_rows)
        assert tile.consumer_registers * 2 + tile.producer_registers <= 3 * tiles.sm90_launch_registers()
        # Every wgmma N the kernel issues has a rendered wrapper.
        assert tile.mma_widths(head_dim) <= set(tiles.sm90_mma_widths())
    with pytest.raises(ValueError, match="sm90 family has no backward tile"):
        tiles.bwd_tile("sm90", "sm_90a", 96)
    with pytest.raises(ValueError, match="dQ"):
        tiles.Sm90BwdTile(96)
    with pytest.raises(ValueError, match="split columns"):
        tiles.Sm90BwdTile(128, block_n=64)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_sm90_backward_dropout_keep_bits_tile(head_dim):
    # At 64 keys a consumer the producer warps draw dropout's keep bits into the stage (a word per
    # consumer thread per 64 queries) with 32 registers; the plan asks for the same tile as the
    # instance renders (its static_assert holds the kernel's layout to smem_bytes).
    from flashgen.generator import render, tiles

    plain, dropped = tiles.bwd_tile("sm90", "sm_90a", head_dim), tiles.bwd_tile("sm90", "sm_90a", head_dim, True)
    chosen = _plan_bwd(head_dim=head_dim, sm90=True, dropout=True)
    assert chosen.tile == dropped and chosen.spec.dropout
    assert f"Traits::kSmemBytes == {dropped.smem_bytes(head_dim)}," in render.render_instance(chosen.spec)
    if plain.block_n == 128:
        assert dropped.keep_bits and dropped.producer_registers == 32 and dropped.consumer_registers == 232
        keep_bytes = dropped.stages * (dropped.block_m // 64) * 256 * 4
        assert dropped.smem_bytes(head_dim) == plain.smem_bytes(head_dim) + keep_bytes
        assert dropped.smem_bytes(head_dim) <= tiles.smem_limit("sm_90a")
    else:
        assert dropped == plain
    with pytest.raises(ValueError, match="keep bits"):
        tiles.Sm90BwdTile(64, block_n=64, keep_bits=True)


def test_tma_compatible_inputs():
    import torch

    from flashgen.runtime import tma

    q = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16)
    assert tma.compatible(q, q[:, :, :2], q.transpose(1, 2).contiguous().transpose(1, 2))
    assert tma.compatible(q.view(2, 64, 4, 2, 64)[..., 0, :])                   # a strided view, 16-byte steps
    assert not tma.compatible(torch.empty(2, 64, 4, 130, dtype=torch.bfloat16)[..., :128])  # 260-byte steps
    assert not tma.compatible(torch.empty(2, 64, 4, 136, dtype=torch.bfloat16)[..., 4:])  # misaligned base
    assert not tma.compatible(q.transpose(-1, -2))                              # columns not contiguous
    assert tma.compatible(q[0])                                                 # varlen (total, heads, d)
    assert not tma.compatible(q[0, 0]) and not tma.compatible(q[:, :0])         # not 3-/4-D; no rows
    assert not tma.compatible(q[:1].expand(2, -1, -1, -1))                      # stride 0 over 2 batch rows
    assert tma.compatible(q[:1], q[:, :1].expand(-1, 1, -1, -1))                # stride 0 over one row: never stepped


@pytest.fixture
def encoded_maps(monkeypatch):
    """No GPU here: the tensor-map encoder is replaced by one that records the tensor and box it was
    asked for and returns bytes numbered by call; the memo caches start empty."""
    from flashgen.runtime import tma

    calls = []

    def fake_encode(t, box_rows, group=1):
        calls.append((t.data_ptr(), box_rows))
        return bytes([len(calls)]) * tma.TMA_MAP_BYTES

    monkeypatch.setattr(tma, "_encode", fake_encode)
    for cache in ("_maps", "_triples", "_quads"):
        monkeypatch.setattr(tma, cache, type(getattr(tma, cache))())
    return calls


def test_sm90_params_memoize_the_three_maps(encoded_maps):
    import torch

    from flashgen.runtime import tma

    calls = encoded_maps
    q, k, v = (torch.empty(2, 64, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    fwd = bytes(range(100))
    blob = tma.sm90_fwd_params(q, k, v, 128, 64, fwd)
    assert calls == [(q.data_ptr(), 128), (k.data_ptr(), 64), (v.data_ptr(), 64)]
    assert blob[:384] == bytes([1]) * 128 + bytes([2]) * 128 + bytes([3]) * 128
    assert blob[384:484] == fwd and len(blob) % 64 == 0 and not any(blob[484:])
    assert tma.sm90_fwd_params(q, k, v, 128, 64, fwd) == blob and len(calls) == 3  # memoized
    tma.sm90_fwd_params(q, v, k, 128, 64, fwd)  # K and V swapped: a new triple from the cached maps
    assert len(calls) == 3
    tma.sm90_fwd_params(q, k, v[:, :32], 128, 64, fwd)  # another V geometry: one new map
    assert calls[3:] == [(v.data_ptr(), 64)]


def test_sm90_bwd_params_memoize_the_five_maps(encoded_maps):
    import torch

    from flashgen.runtime import tma

    calls = encoded_maps
    q, k, v, dout = (torch.empty(2, 64, 4, 128, dtype=torch.bfloat16) for _ in range(4))
    dq_accum = torch.empty(2, 4, 64, 128, dtype=torch.float32)  # (batch, heads, rows, d)
    bwd = bytes(range(1, 101))
    blob = tma.sm90_bwd_params(q, k, v, dout, dq_accum, 64, 128, bwd)
    assert calls == [(q.data_ptr(), 64), (k.data_ptr(), 128), (v.data_ptr(), 128), (dout.data_ptr(), 64),
                     (dq_accum.data_ptr(), 64)]
    assert blob[:640] == b"".join(bytes([i]) * 128 for i in (1, 2, 3, 4, 5))
    assert blob[640:740] == bwd and len(blob) % 64 == 0 and not any(blob[740:])
    assert tma.sm90_bwd_params(q, k, v, dout, dq_accum, 64, 128, bwd) == blob and len(calls) == 5  # memoized


@pytest.mark.parametrize("group", [1, 4])
def test_tma_map_geometry(monkeypatch, group):
    # The arguments cuTensorMapEncodeTiled gets (no GPU here: a stand-in driver records them), for
    # Q as a strided view of a packed qkv. Dimension 0 (columns) is innermost; strides in bytes for
    # dims 1...; PackGQA (group > 1): (columns, heads of a group, rows, KV heads, batch), a box of
    # 128 / group rows of all the group's heads, head fastest.
    import ctypes
    import types

    import torch

    from flashgen.runtime import tma

    seen = {}
    buffer = ctypes.create_string_buffer(tma.TMA_MAP_BYTES)

    def encode(dtype, rank, ptr, dims, strides, box, elem_strides, *modes):
        seen.update(rank=rank, dims=dims, strides=strides, box=box)
        return 0, types.SimpleNamespace(getPtr=lambda: ctypes.addressof(buffer))

    enum = type("Enum", (), {"__getattr__": lambda self, name: name})()
    driver = types.SimpleNamespace(
        cuTensorMapEncodeTiled=encode, cuuint64_t=int, cuuint32_t=int, CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        CUtensorMapDataType=enum, CUtensorMapInterleave=enum, CUtensorMapSwizzle=enum, CUtensorMapL2promotion=enum,
        CUtensorMapFloatOOBfill=enum,
    )
    monkeypatch.setattr(tma, "_import_driver", lambda: driver)
    q = torch.empty(2, 13, 3, 8, 64, dtype=torch.bfloat16)[:, :, 1]  # (batch, rows, heads, d)
    row, head, batch = 3 * 8 * 64 * 2, 64 * 2, 13 * 3 * 8 * 64 * 2  # byte strides
    assert len(tma._encode(q, 128, group)) == tma.TMA_MAP_BYTES
    if group == 1:
        assert (seen["rank"], seen["dims"], seen["strides"], seen["box"]) == (
            4, [64, 13, 8, 2], [row, head, batch], [64, 128, 1, 1])
    else:
        assert (seen["rank"], seen["dims"], seen["strides"], seen["box"]) == (
            5, [64, 4, 13, 2, 2], [head, row, 4 * head, batch], [64, 4, 32, 1, 1])
    with pytest.raises(ValueError, match="group"):
        tma._encode(q, 128, 3)  # 3 divides neither 8 heads nor 128 rows
    if group == 1:
        # The backward's fp32 dQ buffer (batch, heads, rows, d) seen as (batch, rows, heads, d):
        # boxes of 128 bytes = 32 columns.
        dq_accum = torch.empty(2, 8, 13, 128, dtype=torch.float32)
        tma._encode(dq_accum.permute(0, 2, 1, 3), 64)
        assert (seen["rank"], seen["dims"], seen["strides"], seen["box"]) == (
            4, [128, 13, 8, 2], [128 * 4, 13 * 128 * 4, 8 * 13 * 128 * 4], [32, 64, 1, 1])


@pytest.mark.parametrize("head_dim, threads", [(8, 1), (16, 2), (40, 8), (64, 8), (72, 16), (128, 16), (136, 32),
                                               (256, 32)])
def test_bwd_row_threads_and_grid(head_dim, threads):
    """bwd_pre/bwd_post give a row one lane per 16-byte chunk (a power of two, at most a warp), and
    the grid holds every row: ROW_KERNEL_WARPS warps of 32 / threads rows per CTA."""
    from flashgen.generator.tiles import ROW_KERNEL_WARPS, bwd_row_grid, bwd_row_threads

    assert bwd_row_threads(head_dim) == threads
    rows_per_cta = ROW_KERNEL_WARPS * 32 // threads
    for rows in (1, rows_per_cta - 1, rows_per_cta, rows_per_cta + 1, 16 * 1024 * 32):
        blocks = bwd_row_grid(rows, head_dim)[0]
        assert (blocks - 1) * rows_per_cta < rows <= blocks * rows_per_cta


def test_tuning_use_changes_the_current_tuning_for_a_block():
    from flashgen.runtime import tuning

    assert tuning.current() is DEFAULT_TUNING
    with tuning.use(merge_in_cluster=False) as outer:
        assert tuning.current() is outer and not outer.merge_in_cluster
        with tuning.use(decode_fill_wave=False) as inner:  # on top of the current one
            assert not inner.merge_in_cluster and not inner.decode_fill_wave
        assert tuning.current() is outer
    assert tuning.current() is DEFAULT_TUNING
    with pytest.raises(TypeError):
        with tuning.use(no_such_knob=1):
            pass
    assert tuning.current() is DEFAULT_TUNING
    assert hash(Tuning(decode_paired_head_dims=frozenset({64}))) != hash(DEFAULT_TUNING)  # a memo key


def test_chunk_aligned_copies_a_contiguous_view_off_a_16_byte_boundary():
    # contiguous() would return such a view as it is, and the kernels' 16-byte loads would fault.
    import torch

    from flashgen.runtime.execute import chunk_aligned, whole_chunks

    base = torch.randn(2 * 64 * 4 * 64 + 1, dtype=torch.bfloat16)
    view = base[1:].view(2, 64, 4, 64)
    assert view.is_contiguous() and not whole_chunks(view)
    copy = chunk_aligned(view)
    assert copy.data_ptr() != view.data_ptr() and whole_chunks(copy) and torch.equal(copy, view)
    aligned = base[:-1].view(2, 64, 4, 64)  # the allocation's start: aligned
    assert whole_chunks(aligned) and chunk_aligned(aligned) is aligned


def test_sm90_pack_gqa_group_divides_the_tiles_rows(monkeypatch):
    """A packed tile's Q is one TMA box of block_m / G queries of G heads: a 192-row tile takes
    groups up to 64 packed; a group of 128 divides 128-row tiles only, so there the sm80 family
    serves it."""
    from flashgen.generator import tiles
    from flashgen.runtime import dispatch

    monkeypatch.setitem(tiles._FWD_SM90, 64, tiles.Sm90FwdTile(128, stage_o=False, block_m=192))
    dispatch.plan_fwd.cache_clear()
    try:
        packed64 = plan(sm90=True, head_dim=64, nheads=64, nheads_k=1, pack_gqa=True)
        assert packed64.spec.family == "sm90" and packed64.spec.pack_gqa and packed64.tile.block_m == 192
        d128 = plan(sm90=True, head_dim=128, nheads=128, nheads_k=1, pack_gqa=True)
        assert d128.spec.family == "sm90" and d128.tile.block_m == 128
        d64 = plan(sm90=True, head_dim=64, nheads=128, nheads_k=1, pack_gqa=True)
        assert d64.spec.family == "sm80" and d64.spec.pack_gqa
    finally:
        dispatch.plan_fwd.cache_clear()
