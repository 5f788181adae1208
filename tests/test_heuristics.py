"""PackGQA heuristics against cases worked out by hand from their formulas."""
import pytest

from flashgen.runtime.heuristics import get_pack_gqa, should_pack_gqa


# (varlen_q, seqlen_q, qhead_per_khead, block_m) -> expected, with the two efficiencies:
# unpacked seqlen_q / round_up(seqlen_q, block_m); packed the same with seqlen_q * qhead_per_khead.
@pytest.mark.parametrize(
    "varlen_q, seqlen_q, qhpk, block_m, expected",
    [
        (True, 4096, 8, 128, True),      # varlen: always
        (False, 1, 8, 128, True),        # 1/128 vs 8/128
        (False, 4, 4, 128, True),        # 4/128 vs 16/128
        (False, 128, 8, 128, False),     # 1.0 vs 1.0
        (False, 113, 4, 128, False),     # 0.883 vs 452/512 = 0.883: not below 0.9x
        (False, 100, 4, 128, False),     # 0.781 vs 400/512 = 0.781
        (False, 64, 2, 128, True),       # 0.5 vs 1.0
        (False, 1000, 8, 128, False),    # 1000/1024 = 0.977 vs 8000/8064 = 0.992
        (False, 3, 16, 64, True),        # 3/64 vs 48/64
        (False, 16, 1, 128, False),      # one head per group: identical efficiencies
    ],
)
def test_should_pack_gqa_table(varlen_q, seqlen_q, qhpk, block_m, expected):
    assert should_pack_gqa(varlen_q, seqlen_q, qhpk, block_m) is expected


def test_should_pack_gqa_matches_formula_everywhere():
    def round_up(x, m):
        return -(-x // m) * m

    for seqlen_q in range(1, 300, 7):
        for qhpk in (1, 2, 4, 8, 16, 32):
            for block_m in (64, 128):
                nopack = seqlen_q / round_up(seqlen_q, block_m)
                pack = seqlen_q * qhpk / round_up(seqlen_q * qhpk, block_m)
                assert should_pack_gqa(False, seqlen_q, qhpk, block_m) == (nopack < 0.9 * pack)


@pytest.mark.parametrize(
    "arch, nheads, nheads_k, seqlen_q, paged_no_tma, num_splits, expected",
    [
        (90, 32, 32, 1, False, 1, False),    # MHA: never
        (80, 32, 32, 1, False, 1, False),    # MHA on sm80: packing one head changes nothing
        (80, 32, 8, 4096, False, 1, True),   # arch < 90: forced
        (86, 32, 8, 4096, False, 1, True),
        (90, 32, 8, 4096, True, 1, True),    # paged KV without TMA: forced
        (90, 32, 8, 4096, False, 4, True),   # split-KV: forced
        (90, 32, 8, 4096, False, 1, False),  # heuristic: full tiles either way
        (90, 32, 8, 1, False, 1, True),      # heuristic: decode
        (90, 32, 4, 113, False, 1, False),   # heuristic: 0.883 vs 0.883
    ],
)
def test_get_pack_gqa(arch, nheads, nheads_k, seqlen_q, paged_no_tma, num_splits, expected):
    assert get_pack_gqa(arch, nheads, nheads_k, seqlen_q, 128, False, paged_no_tma, num_splits) is expected


def _num_splits_formula(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head, max_splits, l2):
    """The split-KV rule of the design notes, restated independently for the table below."""
    import math

    if total_mblocks >= 0.8 * num_sms:
        if size_one_kv_head > l2 and num_m_blocks >= num_sms * 2:
            return min(math.ceil(size_one_kv_head / l2), max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    cap = min(max_splits, num_sms, num_n_blocks)
    eff = [(total_mblocks * s / num_sms) / math.ceil(total_mblocks * s / num_sms) for s in range(1, cap + 1)]
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * max(eff))


# (total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head, max_splits) -> splits
SPLIT_CASES = [
    ((8, 132, 2048, 1, 64 << 20, 128), 15),     # b1 decode, 8 KV heads: 8*15/132 = 0.91 of a wave
    ((8, 660, 2048, 1, 64 << 20, 128), 70),     # one-warp decode CTAs, 5 per SM
    ((32, 132, 128, 1, 1 << 20, 128), 4),       # 32*4/132 = 0.97
    ((1024, 132, 32, 1, 1 << 20, 128), 1),      # enough CTAs
    ((200, 132, 4096, 400, 200 << 20, 128), 4), # enough CTAs, but K/V of a head overflows L2
    ((8, 132, 4, 1, 1 << 20, 128), 1),          # too few key blocks
    ((8, 132, 2048, 1, 1 << 20, 3), 3),         # capped by max_splits
    ((1, 132, 10, 1, 1 << 20, 128), 9),         # capped by the key blocks (10); 9 is within 85% of it
]


@pytest.mark.parametrize("args, expected", SPLIT_CASES)
def test_num_splits_heuristic_table(args, expected):
    from flashgen.runtime.heuristics import num_splits_heuristic

    total, sms, n_blocks, m_blocks, kv_bytes, max_splits = args
    l2 = 50 << 20
    assert _num_splits_formula(total, sms, n_blocks, m_blocks, kv_bytes, max_splits, l2) == expected
    assert num_splits_heuristic(total, sms, n_blocks, m_blocks, kv_bytes, False, max_splits, l2_bytes=l2) == expected


def test_num_splits_heuristic_matches_formula_on_a_grid():
    from flashgen.runtime.heuristics import num_splits_heuristic

    for total in (1, 3, 8, 17, 64, 100, 105, 131):
        for n_blocks in (1, 5, 16, 200):
            for sms in (108, 132):
                got = num_splits_heuristic(total, sms, n_blocks, 1, 1 << 20, True, 128, l2_bytes=50 << 20)
                assert got == _num_splits_formula(total, sms, n_blocks, 1, 1 << 20, 128, 50 << 20)
