"""CPU tier: flashgen.testing_kvcache's references for the KV-cache API and the split-KV combine.

Each is checked against something that shares no code with it: rotary against numbers worked out
by hand, the paged gather against the contiguous one, the cache append and the position rules against
dense attention on tensors assembled by hand, the combine against one softmax over all the scores.
"""
from __future__ import annotations

import math

import pytest
import torch

from flashgen.testing import attention_ref, generate_alibi_slopes
from flashgen.testing_kvcache import (
    apply_rotary_ref,
    combine_ref,
    kvcache_ref,
    paged_kv_from_contiguous,
    random_block_table,
    rotary_tables,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Table row 0 is the identity; row 1 turns pair 0 by 90 degrees and pair 1 by 180 degrees.
COS = torch.tensor([[1.0, 1.0], [0.0, -1.0]])
SIN = torch.tensor([[0.0, 0.0], [1.0, 0.0]])


@pytest.mark.parametrize(
    "interleaved, rotated",
    [
        # pairs (0,1) and (2,3): (1,2) -> (-2,1); (3,4) -> (-3,-4)
        pytest.param(True, [-2.0, 1.0, -3.0, -4.0], id="gptj"),
        # pairs (0,2) and (1,3): (1,3) -> (-3,1); (2,4) -> (-2,-4)
        pytest.param(False, [-3.0, -2.0, 1.0, -4.0], id="neox"),
    ],
)
def test_apply_rotary_ref_hand_computed(interleaved, rotated):
    # Two rows at positions 1 and 0; dims 4 and 5 lie past rotary_dim 4 and pass through.
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).repeat(1, 2, 1, 1)
    out = apply_rotary_ref(x.to(torch.bfloat16), COS, SIN, torch.tensor([[1, 0]]), interleaved)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0, 0, 0], torch.tensor(rotated + [5.0, 6.0]), rtol=0, atol=0)
    torch.testing.assert_close(out[0, 1, 0], x[0, 1, 0], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_apply_rotary_ref_relative_positions(interleaved):
    """RoPE's defining property: <R(m) q, R(n) k> depends on m - n only."""
    cos, sin = rotary_tables(32, 8)
    q, k = torch.randn(2, 1, 1, 1, 8).unbind(0)

    def score(m, n):
        rq = apply_rotary_ref(q, cos, sin, torch.tensor([[m]]), interleaved)
        rk = apply_rotary_ref(k, cos, sin, torch.tensor([[n]]), interleaved)
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(20, 16), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_apply_rotary_ref_rejects_bad_tables():
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match="exceeds head_dim"):
        apply_rotary_ref(x, torch.ones(4, 3), torch.ones(4, 3), torch.zeros(1, 2, dtype=torch.long), True)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 4\)"):
        apply_rotary_ref(x, torch.ones(4, 2), torch.ones(4, 2), torch.tensor([[0, 4]]), True)


def kvcache_args(batch=3, batch_cache=5, seqlen_cache=24, seqlen_q=3, seqlen_new=3, nheads=4, nheads_k=2,
                 head_dim=16, rotary_dim=8, dtype=torch.float64, **kwargs):
    """Arguments for kvcache_ref on a contiguous cache: leftpad, a cache_batch_idx permutation and
    one batch element with an empty cache."""
    cos, sin = rotary_tables(seqlen_cache + seqlen_q, rotary_dim)
    seqlens = torch.tensor([0, 9, 20], dtype=torch.int32)[:batch]
    args = dict(
        q=torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
        k_cache=torch.randn(batch_cache, seqlen_cache, nheads_k, head_dim, dtype=dtype),
        v_cache=torch.randn(batch_cache, seqlen_cache, nheads_k, head_dim, dtype=dtype),
        k=torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype),
        v=torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype),
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cache_batch_idx=torch.randperm(batch_cache)[:batch].to(torch.int32),
        cache_leftpad=torch.tensor([0, 4, 20], dtype=torch.int32)[:batch],
        rotary_interleaved=False,
    )
    args.update(kwargs)
    return args


@pytest.mark.parametrize(
    "mask, q_rows_advance",
    [({"causal": True}, True), ({"window_size": (5, 1)}, True), ({}, False)],
    ids=["causal", "local", "none"],
)
def test_kvcache_ref_matches_dense_attention_by_hand(mask, q_rows_advance):
    """Append, gather, leftpad, cache_batch_idx and the rotary position rules against dense tensors
    assembled by hand: query row i rotates at cache_seqlens + i only when causal or local."""
    args = kvcache_args(**mask, alibi_slopes=generate_alibi_slopes(4))
    originals = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    ref = kvcache_ref(**args)
    for name, t in originals.items():
        assert torch.equal(args[name], t), f"kvcache_ref modified {name}"

    cos, sin, interleaved = args["rotary_cos"], args["rotary_sin"], args["rotary_interleaved"]
    expected_k, expected_v = args["k_cache"].clone(), args["v_cache"].clone()
    for b in range(3):
        row, start, lp = int(args["cache_batch_idx"][b]), int(args["cache_seqlens"][b]), int(args["cache_leftpad"][b])
        positions = torch.arange(start, start + 3)[None]
        k_rotated = apply_rotary_ref(args["k"][b : b + 1], cos, sin, positions, interleaved)
        expected_k[row, start : start + 3] = k_rotated[0].double()
        expected_v[row, start : start + 3] = args["v"][b]
        q_positions = positions if q_rows_advance else torch.full_like(positions, start)
        q_b = apply_rotary_ref(args["q"][b : b + 1], cos, sin, q_positions, interleaved).double()
        out, lse = attention_ref(
            q_b, expected_k[row : row + 1, lp : start + 3], expected_v[row : row + 1, lp : start + 3],
            alibi_slopes=args["alibi_slopes"], **mask,
        )
        torch.testing.assert_close(ref.out[b : b + 1], out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ref.lse[b : b + 1], lse, rtol=1e-12, atol=1e-12)
    assert torch.equal(ref.k_cache, expected_k) and torch.equal(ref.v_cache, expected_v)
    assert ref.written.sum() == 9 and ref.written.shape == (5, 24)
    rows_and_starts = zip(args["cache_batch_idx"].tolist(), args["cache_seqlens"].tolist())
    assert all(ref.written[row, start : start + 3].all() for row, start in rows_and_starts)


def test_kvcache_ref_empty_cache_row():
    """A batch element with no valid key (no new k, cache_seqlens 0) has out 0 and lse -inf."""
    args = kvcache_args(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_leftpad=None)
    ref = kvcache_ref(**args)
    assert (ref.out[0] == 0).all() and torch.isneginf(ref.lse[0]).all()
    assert torch.isfinite(ref.lse[1:]).all() and not ref.written.any()


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kvcache_ref_paged_equals_contiguous(page_size):
    args = kvcache_args(cache_batch_idx=None, batch_cache=3, causal=True)
    max_pages = -(-args["k_cache"].shape[1] // page_size)
    num_blocks = 3 * max_pages + 2  # two pages the table does not name
    table = random_block_table(3, max_pages, num_blocks, torch.Generator().manual_seed(1))
    paged = {
        name: paged_kv_from_contiguous(args[name], table, num_blocks, page_size) for name in ("k_cache", "v_cache")
    }
    ref = kvcache_ref(**args)
    ref_paged = kvcache_ref(**{**args, **paged, "block_table": table})
    torch.testing.assert_close(ref_paged.out, ref.out, rtol=0, atol=0)
    torch.testing.assert_close(ref_paged.lse, ref.lse, rtol=0, atol=0)
    expected_k = paged_kv_from_contiguous(ref.k_cache, table, num_blocks, page_size)
    torch.testing.assert_close(ref_paged.k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    expected_written = paged_kv_from_contiguous(ref.written, table, num_blocks, page_size, fill=False)
    assert torch.equal(ref_paged.written, expected_written)


def test_kvcache_ref_upcast_false_is_input_dtype():
    args = kvcache_args(dtype=torch.bfloat16, cache_batch_idx=None, batch_cache=3)
    ref, ref_pt = kvcache_ref(**args), kvcache_ref(**args, upcast=False)
    assert ref.out.dtype == torch.float64 and ref_pt.out.dtype == torch.bfloat16
    assert ref_pt.k_cache.dtype == torch.bfloat16 and torch.equal(ref_pt.k_cache, ref.k_cache)
    assert (ref_pt.out.double() - ref.out).abs().max() < 0.05


@pytest.mark.parametrize(
    "change, match",
    [
        ({"v": None}, "k and v must be given together"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, "cannot be combined with block_table"),
        ({"cache_seqlens": torch.tensor([0, 9, 22], dtype=torch.int32)}, "cache capacity"),
        ({"cache_leftpad": torch.tensor([1, 0, 0], dtype=torch.int32)}, "leftpad"),
    ],
    ids=["k-without-v", "batch_idx-with-block_table", "past-capacity", "leftpad-past-seqlens"],
)
def test_kvcache_ref_rejects_bad_arguments(change, match):
    with pytest.raises(ValueError, match=match):
        kvcache_ref(**kvcache_args(**change))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_combine_ref_matches_softmax_over_concatenated_scores(num_splits):
    """Rows of random scores cut into splits, some of which see no key (lse -inf, partial NaN);
    combining the per-split results must give one softmax over the concatenation."""
    rows, head_dim = 6, 5
    lengths = torch.randint(1, 7, (num_splits,)).tolist()
    scores = [torch.randn(rows, n, dtype=torch.float64) * 3 for n in lengths]
    values = [torch.randn(n, head_dim, dtype=torch.float64) for n in lengths]
    for s in scores:
        s[torch.rand(rows) < 0.3] = -math.inf  # some rows see no key in this split
    scores[0][0] = -math.inf  # row 0 sees no key at all ...
    for s in scores[1:]:
        s[0] = -math.inf
    out_partial = torch.stack([torch.softmax(s, dim=-1) @ v for s, v in zip(scores, values)])  # NaN for empty
    lse_partial = torch.stack([torch.logsumexp(s, dim=-1) for s in scores])
    assert torch.isneginf(lse_partial).any() and out_partial.isnan().any()

    out, lse = combine_ref(out_partial.float(), lse_partial.float())
    all_scores, all_values = torch.cat(scores, dim=1), torch.cat(values)
    expected = torch.softmax(all_scores, dim=-1).nan_to_num(0.0) @ all_values
    assert lse.dtype == out.dtype == torch.float64 and out.shape == (rows, head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(all_scores, dim=-1), rtol=1e-6, atol=1e-6)
    assert (out[0] == 0).all() and torch.isneginf(lse[0])  # ... so its out is 0 and its lse -inf


def test_random_block_table():
    table = random_block_table(4, 5, 23, torch.Generator().manual_seed(3))
    assert table.shape == (4, 5) and table.dtype == torch.int32
    assert table.unique().numel() == 20 and 0 <= table.min() and table.max() < 23
    assert torch.equal(table, random_block_table(4, 5, 23, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="num_blocks"):
        random_block_table(4, 5, 19)


def test_paged_kv_from_contiguous_layout():
    cache = torch.arange(2 * 5, dtype=torch.float32).view(2, 5, 1, 1)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    paged = paged_kv_from_contiguous(cache, table, num_blocks=6, page_size=3)
    for b in range(2):
        for p in range(5):
            assert paged[table[b, p // 3], p % 3].item() == cache[b, p].item()
    assert paged[2].isnan().all() and paged[5].isnan().all() and paged[0, 2].isnan().all()
