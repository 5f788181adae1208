"""Multi-GPU tier: ring_flash_attn_func / ring_flash_attn_varlen_func over NCCL, one process per GPU.

Run by scripts/run_multigpu_tests.sh (torchrun, NCCL_NVLS_ENABLE=0); skipped under plain pytest
and with fewer than two GPUs.  Every rank draws the same full-sequence inputs, runs the ring on
its shard and holds its shard of out, lse and the gradients to its shard of the float32 full
attention by FlashAttention's rule (the PyTorch-in-bf16 error measured on the same shard).
"""
from __future__ import annotations

import os

import pytest
import torch

import flashgen.parallel as parallel
from flashgen.testing import assert_close_fa_rule, assert_lse_close, attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
        pytest.skip("needs torchrun with >= 2 processes: scripts/run_multigpu_tests.sh")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    yield dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_over_nccl_matches_full_attention(world, layout, causal):
    rank, world_size = world
    torch.manual_seed(1234)  # the same full tensors on every rank
    chunk = 113
    seqlen = chunk * (2 * world_size if layout == "zigzag" else world_size)
    q = torch.randn(2, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def shard(t, dim=1):
        return parallel.shard(t, world_size, rank, layout, dim=dim)

    local = _leaves(shard(q), shard(k), shard(v))
    out, lse, _ = parallel.ring_flash_attn_func(*local, causal=causal, layout=layout, return_attn_probs=True)
    grads = _grads(out, local, shard(dout))

    def reference(upcast):
        leaves = _leaves(*((t.float() if upcast else t) for t in (q, k, v)))
        out_r, lse_r = attention_ref(*leaves, causal=causal, upcast=upcast)
        return out_r, lse_r, _grads(out_r, leaves, dout.to(out_r.dtype))

    out_ref, lse_ref, grads_ref = reference(True)
    out_pt, _, grads_pt = reference(False)
    assert_close_fa_rule(out, shard(out_ref), shard(out_pt), k=2.0)
    assert_lse_close(lse, shard(lse_ref, dim=-1))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        g_ref, g_pt = shard(g_ref), shard(g_pt)
        assert_close_fa_rule(g, g_ref, g_pt, k=3.0, eps=1e-4 * max(1.0, g_ref.abs().max().item()), name=name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_ring_over_nccl_matches_full_attention(world, causal):
    rank, world_size = world
    torch.manual_seed(4321)
    cu = torch.tensor([0, *(2 * world_size * n for n in (113, 7, 64))], device="cuda").cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    rows = parallel.varlen_shard_rows(cu, world_size, rank)
    local_cu = parallel.shard_cu_seqlens(cu, world_size)
    max_local = int((local_cu[1:] - local_cu[:-1]).max())
    local = _leaves(q[rows], k[rows], v[rows])
    out = parallel.ring_flash_attn_varlen_func(*local, local_cu, local_cu, max_local, max_local, causal=causal)
    grads = _grads(out, local, dout[rows])

    def reference(upcast):
        leaves = _leaves(*((t.float() if upcast else t) for t in (q, k, v)))
        bounds = cu.tolist()
        out_r = torch.cat([attention_ref(*(t[None, a:b] for t in leaves), causal=causal, upcast=upcast)[0][0]
                           for a, b in zip(bounds, bounds[1:])])
        return out_r, _grads(out_r, leaves, dout.to(out_r.dtype))

    out_ref, grads_ref = reference(True)
    out_pt, grads_pt = reference(False)
    assert_close_fa_rule(out, out_ref[rows], out_pt[rows], k=2.0)
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        g_ref, g_pt = g_ref[rows], g_pt[rows]
        assert_close_fa_rule(g, g_ref, g_pt, k=3.0, eps=1e-4 * max(1.0, g_ref.abs().max().item()), name=name)
