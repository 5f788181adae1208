"""CPU tier: the host side of flash_attn_varlen_func, with the kernels replaced (the device check
switched off so that CPU tensors reach them). tests/gpu/test_odd_head_dims.py and
tests/gpu/test_varlen.py run the same calls on the real kernels."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.runtime import dropout, interface, validate

F16 = torch.float16


@pytest.fixture
def paged_forward(monkeypatch):
    """_varlen_fwd replaced by a differentiable stand-in that records the block table it gets."""
    monkeypatch.setattr(validate, "_on_device", lambda *args: None)
    tables = []

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   block_table, *rest):
        tables.append(block_table)
        out = q * softmax_scale + k.sum() + v.sum()  # depends on all three, so a gradient would reach them
        return out, torch.zeros(q.shape[1], q.shape[0]), dropout.NO_DROPOUT

    monkeypatch.setattr(interface, "_varlen_fwd", varlen_fwd)
    return tables


def paged_call(q, k_cache, v_cache, **kwargs):
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    out = flashgen.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, q.shape[0], 16, block_table=table, **kwargs)
    return out, table


@pytest.mark.parametrize("grad_of", ["q", "k_cache", "none"])
def test_paged_forward_runs_with_grad_and_its_backward_raises(paged_forward, grad_of):
    q, k_cache, v_cache = torch.randn(5, 2, 8, dtype=F16), torch.randn(2, 8, 1, 8, dtype=F16), torch.randn(2, 8, 1, 8,
                                                                                                          dtype=F16)
    leaf = {"q": q, "k_cache": k_cache}.get(grad_of)
    if leaf is not None:
        leaf.requires_grad_()
    out, table = paged_call(q, k_cache, v_cache)
    assert paged_forward == [table]
    assert out.requires_grad == (leaf is not None)
    if leaf is not None:
        with pytest.raises(NotImplementedError, match="^block_table"):
            out.sum().backward()


def test_paged_forward_under_no_grad_needs_no_autograd(paged_forward):
    q = torch.randn(5, 2, 8, dtype=F16, requires_grad=True)
    with torch.no_grad():
        out, _ = paged_call(q, torch.randn(2, 8, 1, 8, dtype=F16), torch.randn(2, 8, 1, 8, dtype=F16))
    assert not out.requires_grad and out.grad_fn is None


def test_backward_clamps_max_seqlens_as_the_forward_does(monkeypatch):
    """A huge max_seqlen_q / max_seqlen_k must not size the backward's buffers (the deterministic
    semaphores are (batch, heads, slices, ceil(max_seqlen_q / block_m))): the varlen backward
    clamps them to the rows of q and k, as _varlen_fwd does."""
    from flashgen.runtime import backward

    seen = {}
    monkeypatch.setattr(backward, "flash_bwd", lambda *args, **kwargs: seen.update(kwargs))
    total_q, total_k = 7, 11
    q, k = torch.zeros(total_q, 2, 8, dtype=F16), torch.zeros(total_k, 1, 8, dtype=F16)
    cu_q, cu_k = torch.tensor([0, 3, total_q], dtype=torch.int32), torch.tensor([0, 5, total_k], dtype=torch.int32)
    for max_q, max_k, expected in [(2**31 - 1, 2**31 - 1, (total_q, total_k)), (4, 6, (4, 6))]:
        interface._varlen_bwd(q, q, k, k, q, torch.zeros(2, total_q), q, k, k, cu_q, cu_k, max_q, max_k, 0.35, True,
                              -1, 0, 0.0, None, None, None, 0.0, torch.zeros(2, dtype=torch.int64), True)
        assert (seen["max_seqlen_q"], seen["max_seqlen_k"]) == expected
