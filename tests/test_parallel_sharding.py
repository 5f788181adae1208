"""CPU tier: flashgen.parallel's arithmetic and the ring's logic, in float64 with a PyTorch local attention.

The sharding and per-step block plan are checked against brute force (global positions and the
causal mask), the lse merge against one softmax over all keys, and the simulated ring (the same
code as the NCCL path, with communication by list rotation) against full attention, forward and
backward.  A two-process gloo run covers the process-group path.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import flashgen.parallel as parallel
from flashgen.parallel import sharding
from flashgen.testing import attention_ref

LOCAL = parallel.TorchLocalAttention()
WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- sharding ---------------------------------------------------------------------------------------

def test_zigzag_shard_holds_chunks_r_and_2n_minus_1_minus_r():
    # 4 ranks, 8 chunks of 2 rows: rank 1 holds chunks 1 and 6.
    assert sharding.shard_positions("zigzag", 4, 1, 16).tolist() == [2, 3, 12, 13]
    assert sharding.shard_positions("zigzag", 4, 3, 16).tolist() == [6, 7, 8, 9]
    assert sharding.shard_positions("contiguous", 4, 1, 16).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shards_partition_the_sequence_and_unshard_inverts(layout, world_size):
    seqlen = 2 * world_size * 3
    positions = torch.cat([sharding.shard_positions(layout, world_size, r, seqlen) for r in range(world_size)])
    assert sorted(positions.tolist()) == list(range(seqlen))
    x = torch.randn(2, seqlen, 3, 4)
    shards = [parallel.shard(x, world_size, r, layout) for r in range(world_size)]
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, sharding.shard_positions(layout, world_size, r, seqlen)])
    assert torch.equal(parallel.unshard(shards, layout), x)


def test_shard_rejects_lengths_that_do_not_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        parallel.shard(torch.randn(1, 6, 1, 8), 2, 0, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        parallel.shard(torch.randn(1, 8, 1, 8), 2, 0, "striped")
    with pytest.raises(ValueError, match="rank"):
        parallel.shard(torch.randn(1, 8, 1, 8), 2, 2)


# --- which blocks a step computes -------------------------------------------------------------------

def _part_range(part: str, rows: int) -> range:
    half = rows // 2
    return {"all": range(rows), "first": range(half), "second": range(half, rows)}[part]


def _planned_mask(block, rows: int) -> torch.Tensor:
    """(rows, rows) bool: the (query row, key row) pairs of the two shards the block computes."""
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    if block is None:
        return mask
    qr, kr = _part_range(block.q_part, rows), _part_range(block.k_part, rows)
    inner = torch.ones(len(qr), len(kr), dtype=torch.bool)
    if block.causal:
        inner = torch.tril(inner, diagonal=len(kr) - len(qr))  # bottom-right aligned, as the kernels
    mask[qr.start:qr.stop, kr.start:kr.stop] = inner
    return mask


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_step_blocks_cover_exactly_the_visible_pairs(layout, world_size, causal):
    seqlen = 2 * world_size * 3
    for rank, source in itertools.product(range(world_size), repeat=2):
        q_pos = sharding.shard_positions(layout, world_size, rank, seqlen)
        k_pos = sharding.shard_positions(layout, world_size, source, seqlen)
        visible = q_pos[:, None] >= k_pos[None, :] if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
        block = sharding.step_block(layout, world_size, rank, source, causal)
        assert torch.equal(_planned_mask(block, len(q_pos)), visible), (rank, source, block)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zigzag_causal_steps_cost_every_rank_the_same(world_size):
    rows = 6
    for step in range(1, world_size):
        areas = set()
        for rank in range(world_size):
            block = sharding.step_block("zigzag", world_size, rank, (rank - step) % world_size, True)
            areas.add(len(_part_range(block.q_part, rows)) * len(_part_range(block.k_part, rows)))
        assert areas == {rows * rows // 2}, step


# --- packed batches -----------------------------------------------------------------------------

def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def test_shard_cu_seqlens_gives_each_rank_a_nth_of_every_sequence():
    cu = _cu([8, 0, 16, 4])
    assert parallel.shard_cu_seqlens(cu, 2, "zigzag").tolist() == [0, 4, 4, 12, 14]
    assert parallel.shard_cu_seqlens(cu, 4, "contiguous").tolist() == [0, 2, 2, 6, 7]
    assert parallel.shard_cu_seqlens(cu, 2, "zigzag").dtype == torch.int32
    with pytest.raises(ValueError, match="multiple of 8"):
        parallel.shard_cu_seqlens(cu, 4, "zigzag")
    with pytest.raises(TypeError, match="int32"):
        parallel.shard_cu_seqlens(cu.long(), 2)


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_varlen_shards_hold_every_sequences_part_and_unshard_inverts(layout, world_size):
    lengths = [2 * world_size * n for n in (2, 0, 5, 1)]
    cu = _cu(lengths)
    x = torch.randn(int(cu[-1]), 3, 4)
    local_cu = parallel.shard_cu_seqlens(cu, world_size, layout).tolist()
    shards = [parallel.shard_varlen(x, cu, world_size, r, layout) for r in range(world_size)]
    for r, s in enumerate(shards):
        for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
            expected = x[start + sharding.shard_positions(layout, world_size, r, n)]
            assert torch.equal(s[local_cu[b]:local_cu[b + 1]], expected)
    assert torch.equal(parallel.unshard_varlen(shards, cu, layout), x)
    lse = torch.randn(3, int(cu[-1]))
    lse_shards = [lse.index_select(1, parallel.varlen_shard_rows(cu, world_size, r, layout)) for r in range(world_size)]
    assert torch.equal(parallel.unshard_varlen(lse_shards, cu, layout, dim=-1), lse)


def test_half_rows_pick_each_sequences_chunk():
    index, cu_half = sharding.half_rows(_cu([4, 0, 6]), "second")
    assert index.tolist() == [2, 3, 7, 8, 9]
    assert cu_half.tolist() == [0, 2, 2, 5]
    assert sharding.half_rows(_cu([4, 6]), "first")[0].tolist() == [0, 1, 4, 5, 6]


# --- the lse merge ----------------------------------------------------------------------------------

def test_merge_of_disjoint_key_blocks_is_the_full_softmax():
    batch, rows, heads, dim, keys = 2, 5, 3, 4, 11
    q, k, v = torch.randn(batch, rows, heads, dim), torch.randn(batch, keys, heads, dim), torch.randn(batch, keys, heads, dim)
    q, k, v = q.double(), k.double(), v.double()
    # Row 0 of the first batch sees no key at all, row 1 sees only the last block.
    hidden = torch.zeros(batch, heads, rows, keys, dtype=torch.bool)
    hidden[0, :, 0] = True
    hidden[0, :, 1, :8] = True
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).masked_fill(hidden, float("-inf"))

    def attend(scores_block, v_block):
        lse = torch.logsumexp(scores_block, -1)
        probs = torch.exp(scores_block - lse.masked_fill(torch.isinf(lse), 0)[..., None])
        return torch.einsum("bhqk,bkhd->bqhd", probs, v_block), lse

    out_acc = torch.zeros(batch, rows, heads, dim, dtype=torch.float64)
    lse_acc = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float64)
    for block in (slice(0, 3), slice(3, 8), slice(8, 11)):
        parallel.merge_partial(out_acc, lse_acc, *attend(scores[..., block], v[:, block]))
    out_full, lse_full = attend(scores, v)
    torch.testing.assert_close(out_acc, out_full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse_acc, lse_full, atol=1e-12, rtol=1e-12)
    assert torch.isneginf(lse_acc[0, :, 0]).all() and (out_acc[0, 0] == 0).all()


# --- the simulated ring against full attention --------------------------------------------------

def _leaves(*shapes):
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _check_ring(out, lse, ref, lse_ref, leaves):
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, dout)
    grads_ref = torch.autograd.grad(ref, leaves, dout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_simulated_ring_matches_full_attention(layout, world_size, causal):
    seqlen = 2 * world_size * 3
    q, k, v = _leaves((2, seqlen, 4, 8), (2, seqlen, 2, 8), (2, seqlen, 2, 8))  # GQA 4:2
    out, lse = parallel.simulate_ring_attention(q, k, v, world_size, causal=causal, layout=layout,
                                                local_attention=LOCAL, softmax_scale=0.3)
    _check_ring(out, lse, *attention_ref(q, k, v, causal=causal, softmax_scale=0.3), [q, k, v])


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_simulated_varlen_ring_matches_full_attention_per_sequence(layout, world_size, causal):
    cu = _cu([2 * world_size * n for n in (2, 0, 5, 1)])
    total = int(cu[-1])
    q, k, v = _leaves((total, 3, 8), (total, 1, 8), (total, 1, 8))  # MQA
    out, lse = parallel.simulate_ring_attention(q, k, v, world_size, causal=causal, layout=layout,
                                                cu_seqlens_q=cu, cu_seqlens_k=cu, local_attention=LOCAL)
    bounds = cu.tolist()
    refs = [attention_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal) for a, b in zip(bounds, bounds[1:])]
    ref = torch.cat([r[0][0] for r in refs])
    lse_ref = torch.cat([r[1][0] for r in refs], dim=-1)
    _check_ring(out, lse, ref, lse_ref, [q, k, v])


def test_ring_under_torch_compile_breaks_the_graph_and_matches_eager():
    q, k, v = _leaves((1, 8, 2, 8), (1, 8, 2, 8), (1, 8, 2, 8))

    def model(q, k, v):
        out, _ = parallel.simulate_ring_attention(q * 2, k, v, 2, causal=True, local_attention=LOCAL)
        return out.sin()

    compiled = torch.compile(model, backend="eager")
    expected = model(q, k, v)
    got = compiled(q, k, v)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    grads = torch.autograd.grad(got.sum(), [q, k, v])
    for g, g_ref in zip(grads, torch.autograd.grad(expected.sum(), [q, k, v])):
        torch.testing.assert_close(g, g_ref, atol=0, rtol=0)


# --- bad input --------------------------------------------------------------------------------------

def test_bad_input_raises_naming_the_argument():
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="multiple of 6"):
        parallel.simulate_ring_attention(q[:, :10], q[:, :10], q[:, :10], 3, layout="zigzag", local_attention=LOCAL)
    with pytest.raises(ValueError, match="rows must be even"):  # checked before the process group
        parallel.ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5], local_attention=LOCAL)
    with pytest.raises(ValueError, match="layout"):
        parallel.simulate_ring_attention(q, q, q, 2, layout="ring", local_attention=LOCAL)
    with pytest.raises(TypeError, match="causal"):
        parallel.simulate_ring_attention(q, q, q, 2, causal=1, local_attention=LOCAL)
    with pytest.raises(TypeError, match="one dtype"):
        parallel.simulate_ring_attention(q, q.float(), q, 2, local_attention=LOCAL)
    with pytest.raises(ValueError, match="world_size"):
        parallel.simulate_ring_attention(q, q, q, 0, local_attention=LOCAL)
    packed = torch.randn(8, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must be equal"):
        parallel.simulate_ring_attention(packed, packed, packed, 2, causal=True, cu_seqlens_q=_cu([8, 0]),
                                         cu_seqlens_k=_cu([4, 4]), local_attention=LOCAL)
    with pytest.raises(ValueError, match="not initialized"):
        parallel.ring_flash_attn_func(q, q, q, local_attention=LOCAL)


# --- the process-group path, over gloo ----------------------------------------------------------

def _gloo_worker(rank: int, world_size: int, init_file: str) -> None:
    """One rank: its shards of a dense and a packed batch through ring_flash_attn(_varlen)_func,
    checked against its shard of full attention (out, lse and the gradients)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)  # the same full tensors on every rank
        seqlen = 2 * world_size * 3
        full = _leaves((2, seqlen, 4, 8), (2, seqlen, 2, 8), (2, seqlen, 2, 8))
        ref, lse_ref = attention_ref(*full, causal=True)
        dout = torch.randn_like(ref)
        grads_ref = torch.autograd.grad(ref, full, dout)
        local = [parallel.shard(t, world_size, rank).detach().requires_grad_() for t in full]
        out, lse, _ = parallel.ring_flash_attn_func(*local, causal=True, return_attn_probs=True, local_attention=LOCAL)
        grads = torch.autograd.grad(out, local, parallel.shard(dout, world_size, rank))
        torch.testing.assert_close(out, parallel.shard(ref, world_size, rank), atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse, parallel.shard(lse_ref, world_size, rank, dim=-1), atol=1e-12, rtol=1e-10)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, parallel.shard(g_ref, world_size, rank), atol=1e-12, rtol=1e-10)

        cu = _cu([2 * world_size * n for n in (2, 1)])
        packed = _leaves((int(cu[-1]), 2, 8), (int(cu[-1]), 1, 8), (int(cu[-1]), 1, 8))
        bounds = cu.tolist()
        ref = torch.cat([attention_ref(*(t[None, a:b] for t in packed), causal=True)[0][0]
                         for a, b in zip(bounds, bounds[1:])])
        dout = torch.randn_like(ref)
        grads_ref = torch.autograd.grad(ref, packed, dout)
        local = [parallel.shard_varlen(t, cu, world_size, rank).detach().requires_grad_() for t in packed]
        local_cu = parallel.shard_cu_seqlens(cu, world_size)
        max_local = int((local_cu[1:] - local_cu[:-1]).max())
        out = parallel.ring_flash_attn_varlen_func(*local, local_cu, local_cu, max_local, max_local, causal=True,
                                                   local_attention=LOCAL)
        grads = torch.autograd.grad(out, local, parallel.shard_varlen(dout, cu, world_size, rank))
        torch.testing.assert_close(out, parallel.shard_varlen(ref, cu, world_size, rank), atol=1e-12, rtol=1e-10)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, parallel.shard_varlen(g_ref, cu, world_size, rank), atol=1e-12, rtol=1e-10)
    finally:
        dist.destroy_process_group()


def _run_gloo_workers(tmp_path, worker: str, world_size: int) -> None:
    import pathlib
    import subprocess
    import sys

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    tests_dir = pathlib.Path(__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_parallel_sharding as t; "
            f"t.{worker}(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])")
    workers = [subprocess.Popen([sys.executable, "-c", code, str(tests_dir), str(rank), str(world_size),
                                 str(tmp_path / "rendezvous")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for rank in range(world_size)]
    try:
        outputs = [w.communicate(timeout=120)[0].decode(errors="replace") for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for rank, (w, output) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0, f"rank {rank} exited with {w.returncode}:\n{output[-3000:]}"


def test_process_group_ring_over_gloo_matches_full_attention(tmp_path):
    _run_gloo_workers(tmp_path, "_gloo_worker", 3)


def _torch_cp_worker(rank: int, world_size: int, init_file: str) -> None:
    """One rank of PyTorch's private templated ring loop with FlashgenSDPAOps as its local op (here
    over the PyTorch local attention), on zigzag shards in SDPA's (batch, heads, seqlen, d) layout."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from flashgen.parallel.torch_cp import FlashgenSDPAOps

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        full = _leaves((2, 4 * world_size, 3, 8), (2, 4 * world_size, 3, 8), (2, 4 * world_size, 3, 8))
        ref, lse_ref = attention_ref(*full, causal=True)
        dout = torch.randn_like(ref)
        grads_ref = torch.autograd.grad(ref, full, dout)

        def sdpa_shard(t, dim=1):  # flashgen layout -> this rank's zigzag shard, heads before rows
            return parallel.shard(t, world_size, rank, dim=dim).transpose(1, 2)

        ops = FlashgenSDPAOps(LOCAL)
        q, k, v = (sdpa_shard(t.detach()) for t in full)
        group = dist.group.WORLD
        assert cp._cp_options.enable_load_balance  # torch's default: the head-tail (zigzag) chunks
        out, lse = cp._templated_ring_attention(group, 2, ops.forward, q, k, v, is_causal=True)[:2]
        tolerance = dict(atol=1e-6, rtol=1e-5)  # torch's loop merges and accumulates in float32
        torch.testing.assert_close(out, sdpa_shard(ref), **tolerance)
        torch.testing.assert_close(lse, parallel.shard(lse_ref, world_size, rank, dim=-1), **tolerance)
        grads = cp._templated_ring_attention_backward(
            group, 2, ops.backward, grad_out=sdpa_shard(dout), grad_out_name="grad_out", query=q, key=k, value=v,
            out=out.to(q.dtype), logsumexp=lse, is_causal=True)[:3]
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, sdpa_shard(g_ref), **tolerance)
    finally:
        dist.destroy_process_group()


def test_flashgen_ops_in_torchs_private_ring_loop_over_gloo(tmp_path):
    _run_gloo_workers(tmp_path, "_torch_cp_worker", 2)
