"""The sm90 backward's deterministic dQ order (bwd_sm90.cuh), modelled on the CPU.

The kernel's key block n visits query blocks [m_block_min, m_block_max) (and the query heads of
its group within each), and in deterministic mode adds to query block m when the block's semaphore
reaches its turn. In ascending turns the query blocks go last first and the turn is n less the
first key block that sees m; in descending turns (causal only, the plan's choice) the grid runs
backwards (blockIdx.x = key blocks - 1 - n), the query blocks first first, and the turn is the last
key block that sees m less n. The model below restates those integer rules (the kernel's, line for
line) and checks what an order needs: at every query block the turns of the visiting key blocks
are exactly 0, 1, ..., so the counter reaches every turn once; a key block only waits for blocks
launched before it (lower blockIdx.x), so the waits end however few CTAs are resident; and a
block's predecessor at a query block reaches it at the same step or sooner, so that blocks running
side by side wait only at the start.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.generator.tiles import bwd_tile
from flashgen.runtime.dispatch import resolve_mask

BLOCK_N = 128


def visited_query_blocks(n, seqlen_q, seqlen_k, block_m, mask, window_left, window_right):
    """range(m_block_min, m_block_max) of key block n (flash_bwd_sm90's producer prologue)."""
    diag = seqlen_k - seqlen_q
    m_blocks = -(-seqlen_q // block_m)
    key0 = n * BLOCK_N
    m_min, m_max = 0, m_blocks
    if mask != "none":
        first_query = key0 - diag - window_right
        m_min = 0 if first_query <= 0 else min(int(first_query / block_m), m_blocks)  # C truncation, >= 0 here
        if mask == "local":
            last_query = key0 + BLOCK_N - 1 - diag + window_left
            m_max = 0 if last_query < 0 else min(int(last_query / block_m) + 1, m_blocks)
    return range(m_min, max(m_max, m_min))


def turn(n, m, seqlen_q, seqlen_k, block_m, mask, window_left, window_right, descending=False):
    """The semaphore value key block n waits for at query block m (the dQ writer)."""
    if descending:
        last_key = min(seqlen_k - 1, m * block_m + block_m - 1 + (seqlen_k - seqlen_q) + window_right)
        return last_key // BLOCK_N - n
    if mask != "local":
        return n
    first_key = m * block_m + (seqlen_k - seqlen_q) - window_left
    return n - (int(first_key / BLOCK_N) if first_key > 0 else 0)


def check_order(seqlen_q, seqlen_k, block_m, causal, window_size, qhpk=1, descending=False):
    mask, window_left, window_right = resolve_mask(causal, window_size, seqlen_q, seqlen_k)
    if descending and mask != "causal":
        return  # the plan picks descending turns only under a causal mask
    n_blocks = -(-seqlen_k // BLOCK_N)
    arrivals: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (m, head) -> (turn, launch, step)
    for n in range(n_blocks):
        blocks = visited_query_blocks(n, seqlen_q, seqlen_k, block_m, mask, window_left, window_right)
        steps = [(m, head) for m in (blocks if descending else reversed(blocks)) for head in range(qhpk)]
        launch = n_blocks - 1 - n if descending else n  # blockIdx.x
        for step, (m, head) in enumerate(steps):
            arrivals.setdefault((m, head), []).append(
                (turn(n, m, seqlen_q, seqlen_k, block_m, mask, window_left, window_right, descending), launch, step))
    for tile, seen in arrivals.items():
        seen.sort()
        assert [t for t, _, _ in seen] == list(range(len(seen))), (tile, seen)
        for (_, before, step_before), (_, after, step_after) in zip(seen, seen[1:]):
            assert before < after, (tile, seen)  # launched earlier
            assert step_before <= step_after, (tile, seen)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (33, 7)),
                                                 (False, (-1, 5)), (False, (300, 0)), (False, (0, 0))])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 1023), (1023, 1), (113, 255), (1023, 1023), (4096, 4096),
                                                (300, 1023), (1023, 300)])
@pytest.mark.parametrize("descending", [False, True])
def test_deterministic_order(head_dim, causal, window_size, seqlen_q, seqlen_k, descending):
    check_order(seqlen_q, seqlen_k, bwd_tile("sm90", "sm_90a", head_dim).block_m, causal, window_size,
                descending=descending)


@settings(max_examples=300, deadline=None)
@given(seqlen_q=st.integers(1, 3000), seqlen_k=st.integers(1, 3000), block_m=st.sampled_from([64, 128]),
       causal=st.booleans(), left=st.integers(-1, 2000), right=st.integers(-1, 2000), qhpk=st.sampled_from([1, 4]),
       descending=st.booleans())
def test_deterministic_order_any_shape(seqlen_q, seqlen_k, block_m, causal, left, right, qhpk, descending):
    check_order(seqlen_q, seqlen_k, block_m, causal, (left, right), qhpk, descending)


def test_plan_picks_descending_turns_for_mha_causal_only():
    from flashgen.runtime.dispatch import plan_bwd

    def descending(**overrides):
        args = dict(dtype="bf16", head_dim=128, batch=2, seqlen_q=1000, seqlen_k=1000, nheads_k=8, causal=True,
                    window_size=(-1, -1), softcap=0.0, device=(9, 0), sm90=True, nheads=8, deterministic=True)
        return plan_bwd(**{**args, **overrides}).dq_turns_descending

    assert descending()
    assert descending(window_size=(-1, 0), causal=False)  # the same mask
    assert not descending(deterministic=False)
    assert not descending(nheads=32)  # GQA
    assert not descending(causal=False)
    assert not descending(causal=False, window_size=(100, 0))


def cta_of_launch(cta, n_blocks, heads, batch, chunks):
    """(n_block, KV head, batch) of the CTA launched cta-th (bwd_sm90.cuh's bwd_cta, line for line)."""
    if chunks <= 0:
        return cta % n_blocks, cta // n_blocks % heads, cta // (n_blocks * heads)
    pairs = heads * batch
    small, larger = pairs // chunks, pairs % chunks
    larger_ctas = larger * (small + 1) * n_blocks
    if cta < larger_ctas:
        chunk_pairs = small + 1
        first_pair = cta // (chunk_pairs * n_blocks) * chunk_pairs
    else:
        chunk_pairs = small
        first_pair = larger * (small + 1) + (cta - larger_ctas) // (small * n_blocks) * small
    in_chunk = cta - first_pair * n_blocks
    pair = first_pair + in_chunk % chunk_pairs
    return in_chunk // chunk_pairs, pair % heads, pair // heads


@settings(max_examples=300, deadline=None)
@given(n_blocks=st.integers(1, 40), heads=st.integers(1, 12), batch=st.integers(1, 9), data=st.data())
def test_chunked_cta_order_covers_the_grid_longest_first(n_blocks, heads, batch, data):
    pairs = heads * batch
    chunks = data.draw(st.integers(0, pairs))
    order = [cta_of_launch(c, n_blocks, heads, batch, chunks) for c in range(n_blocks * heads * batch)]
    assert sorted(order) == [(n, h, b) for n in range(n_blocks) for h in range(heads) for b in range(batch)]
    launched = {coords: c for c, coords in enumerate(order)}
    for h in range(heads):
        for b in range(batch):  # a pair's key blocks launch in ascending order (the dQ turns' premise)
            assert all(launched[(n, h, b)] < launched[(n + 1, h, b)] for n in range(n_blocks - 1))
    if chunks == 0:
        return
    # The specification: consecutive pairs (heads fastest) in chunks whose sizes differ by at most
    # one, larger first; within a chunk key blocks slowest.
    pair_list = [(h, b) for b in range(batch) for h in range(heads)]
    sizes = [pairs // chunks + (i < pairs % chunks) for i in range(chunks)]
    expected, first = [], 0
    for size in sizes:
        expected += [(n, h, b) for n in range(n_blocks) for h, b in pair_list[first:first + size]]
        first += size
    assert order == expected


def test_plan_orders_causal_ctas_longest_first_in_chunks_of_waves():
    from flashgen.runtime.dispatch import plan_bwd
    from flashgen.runtime.tuning import Tuning

    def chunks(**overrides):
        args = dict(dtype="bf16", head_dim=128, batch=16, seqlen_q=1024, seqlen_k=1024, nheads_k=16, causal=True,
                    window_size=(-1, -1), softcap=0.0, device=(9, 0), sm90=True, nheads=16)
        return plan_bwd(**{**args, **overrides}).cta_chunks

    # 8 key blocks: chunks of at least ceil(1.5 x 132 / 8) = 25 of the 256 pairs.
    assert chunks() == 256 // 25
    assert chunks(seqlen_q=16384, seqlen_k=16384, batch=1) == 16 // 2  # 128 key blocks: 2 pairs a chunk
    assert chunks(tuning=Tuning(bwd_causal_chunk_waves=3.0)) == 256 // 50
    assert chunks(batch=1, nheads_k=2, nheads=8) == 1  # fewer pairs than a chunk: one
    assert chunks(tuning=Tuning(bwd_causal_chunk_waves=0.0)) == 0
    assert chunks(causal=False) == 0  # CTAs of equal length
    assert chunks(causal=False, window_size=(100, 0)) == 0
    assert chunks(sm90=False) == 0  # the sm80 family


def test_plan_chunks_deterministic_pairs_by_their_share_of_the_l2():
    from flashgen.runtime.dispatch import plan_bwd
    from flashgen.runtime.tuning import Tuning

    def chunks(share, **overrides):
        args = dict(dtype="bf16", head_dim=128, batch=4, seqlen_q=4096, seqlen_k=4096, nheads_k=16, causal=False,
                    window_size=(-1, -1), softcap=0.0, device=(9, 0), sm90=True, nheads=16, deterministic=True)
        return plan_bwd(**{**args, **overrides}, tuning=Tuning(bwd_det_chunk_l2_share=share)).cta_chunks

    # A pair's Q, dO and fp32 dQ: 4096 x 128 x 8 bytes = 4 MiB, 12 of them in 50 MiB: 64 pairs in 5 chunks.
    assert chunks(1.0) == 5
    assert chunks(1.0, causal=True) == 5
    assert chunks(1.0, nheads=64) == 64 // 3  # GQA 4: a pair holds its 4 query heads' rows, 16 MiB
    assert chunks(0.5) == 64 // 6
    assert chunks(1e-4) == 64  # one pair a chunk
    assert chunks(100.0) == 1  # all pairs fastest
    assert chunks(0.0) == 0  # launch order
    # The GPU tier's chunked deterministic cases (tests/gpu/test_sm90.py) take the chunks they name.
    assert chunks(0.21, head_dim=64, batch=2, seqlen_q=4095, seqlen_k=4095) == 6
    assert chunks(1e-4, head_dim=64, batch=2, seqlen_q=4095, seqlen_k=4095) == 32
    assert chunks(0.5, batch=4, seqlen_q=2047, seqlen_k=2047, nheads_k=4, causal=True) == 5
    assert chunks(0.1, head_dim=64, batch=4, seqlen_q=2047, seqlen_k=2047, causal=True) == 12
