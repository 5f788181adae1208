"""CPU tier: the dropout RNG's reference implementation (flashgen.testing), which the GPU tests
hold the kernels to: Philox4x32 with 7 and 10 rounds against Random123's known-answer vectors, the
round count the kernels use, and the mask's statistics and reproducibility."""
from __future__ import annotations

import pytest
import torch

from flashgen.runtime.dropout import DropoutState
from flashgen.testing import DROPOUT_PHILOX_ROUNDS, dropout_keep_mask, philox4x32, philox4x32_10

# Random123's kat_vectors for philox4x32 with 7 rounds: (counter, key, output).
KAT_7 = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]
# and with 10 rounds.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expected


@pytest.mark.parametrize("counter,key,expected", KAT_7)
def test_philox_7_rounds_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key, 7)) == expected


def test_kernels_and_reference_draw_the_same_rounds():
    from pathlib import Path
    import re

    import flashgen

    common = (Path(flashgen.__file__).parent / "templates" / "common.cuh").read_text()
    assert int(re.search(r"constexpr int kPhiloxRounds = (\d+);", common).group(1)) == DROPOUT_PHILOX_ROUNDS


def test_philox_vectorized_matches_scalar():
    counters = torch.randint(0, 2**32, (4, 64), dtype=torch.int64)
    key = (0x12345678, 0x9ABCDEF0)
    words = philox4x32_10(tuple(counters), key)
    for n in (0, 17, 63):
        scalar = philox4x32_10(tuple(int(c[n]) for c in counters), key)
        assert [int(w[n]) for w in words] == [int(w) for w in scalar]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_mask_keeps_one_minus_p(p):
    mask = dropout_keep_mask(torch.tensor([1234, 8]), p, 2, 4, 113, 1023)
    assert mask.shape == (2, 4, 113, 1023)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01


def test_dropout_mask_depends_on_seed_offset_and_position():
    base = dropout_keep_mask(torch.tensor([7, 0]), 0.5, 1, 2, 64, 64)
    assert torch.equal(base, dropout_keep_mask(torch.tensor([7, 0]), 0.5, 1, 2, 64, 64))
    assert not torch.equal(base, dropout_keep_mask(torch.tensor([8, 0]), 0.5, 1, 2, 64, 64))
    assert not torch.equal(base, dropout_keep_mask(torch.tensor([7, 4]), 0.5, 1, 2, 64, 64))
    assert not torch.equal(base[0, 0], base[0, 1])  # heads draw different masks
    # The offset's high word counts too: offsets 2**32 apart draw different masks.
    assert not torch.equal(base, dropout_keep_mask(torch.tensor([7, 2**32]), 0.5, 1, 2, 64, 64))
    # Negative seeds (uint64 seeds past 2**63, stored signed) work too.
    assert dropout_keep_mask(torch.tensor([-5, 0]), 0.5, 1, 1, 8, 8).shape == (1, 1, 8, 8)


def test_dropout_mask_element_mapping():
    # Key j = 64 g + 16 c + 8 n + 2 q + e of query i is byte 2 n + e of word c of the Philox block
    # with counter (4 g + q, i, b * nheads + h, offset) (common.cuh's Dropout), checked element by
    # element against the scalar generator, also past 2**32 offsets and in a partial last group.
    seed, offset, p = 0x1234_5678_9ABC, 2**32 + 5, 0.5
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 5, 150
    mask = dropout_keep_mask(torch.tensor([seed, offset]), p, batch, nheads, seqlen_q, seqlen_k)
    key = ((seed & 0xFFFFFFFF) ^ (((offset >> 32) * 0x9E3779B9) & 0xFFFFFFFF), ((seed >> 32) & 0xFFFFFFFF) ^ 0x666C6773)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 149), (0, 1, 3, 77), (1, 0, 2, 130), (0, 2, 1, 63), (1, 1, 0, 64)]:
        g, c, n, q, e = j // 64, j % 64 // 16, j % 16 // 8, j % 8 // 2, j % 2
        words = philox4x32((4 * g + q, i, b * nheads + h, offset & 0xFFFFFFFF), key, DROPOUT_PHILOX_ROUNDS)
        byte = (int(words[c]) >> (8 * (2 * n + e))) & 0xFF
        assert bool(mask[b, h, i, j]) == (byte < 128), (b, h, i, j)


@pytest.mark.parametrize("p,threshold", [(0.0, 256), (0.1, 230), (0.5, 128), (0.999, 0), (1e-4, 256)])
def test_dropout_threshold(p, threshold):
    params = DropoutState(p, 1, 0).params()
    assert params["dropout_threshold"] == threshold
    # Kept with probability threshold / 256 and scaled by its inverse: the expectation is unbiased.
    assert params["rp_dropout"] == (pytest.approx(256 / threshold) if threshold else 0.0)
