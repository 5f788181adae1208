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
