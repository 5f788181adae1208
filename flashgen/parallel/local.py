"""The local attention a ring step runs: flashgen's kernels, or plain PyTorch (any device, any dtype).

A local attention has two methods:
  forward(q, k, v, *, causal, softmax_scale, varlen) -> (out, lse)
  backward(dout, q, k, v, out, lse, *, causal, softmax_scale, varlen) -> (dq, dk, dv)
with flashgen's layouts: dense q (batch, rows, heads, d), lse (batch, heads, rows); varlen q
(total, heads, d), lse (heads, total) and ``varlen`` a VarlenArgs (None for dense calls).  The
backward takes the *merged* out and lse of the whole ring (not this block's): with them the block's
probabilities exp(s - lse) are its share of the global softmax, so the block gradients sum to the
full gradient (the standard ring-attention backward).
"""
from __future__ import annotations

import math
import typing

import torch


class VarlenArgs(typing.NamedTuple):
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class LocalAttention(typing.Protocol):
    def forward(self, q, k, v, *, causal: bool, softmax_scale: float,
                varlen: VarlenArgs | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float,
                 varlen: VarlenArgs | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class FlashgenLocalAttention:
    """flashgen's forward and backward kernels (CUDA, fp16/bf16)."""

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = bool(deterministic)

    def forward(self, q, k, v, *, causal, softmax_scale, varlen):
        import flashgen

        if varlen is None:
            out, lse, _ = flashgen.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                   return_attn_probs=True)
        else:
            out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, *varlen, softmax_scale=softmax_scale,
                                                          causal=causal, return_attn_probs=True)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale, varlen):
        from flashgen.runtime import dropout, execute, interface

        head_dim = q.shape[-1]
        padded = head_dim % execute.HEAD_DIM_MULTIPLE != 0
        if padded:  # the kernels' instances take head dims in steps of 8, as flash_attn_func pads them
            dout, q, k, v, out = (execute.pad_head_dim(t) for t in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # The backward reads lse as contiguous (batch, heads, rows): a half-shard slice is not.
        lse = lse.contiguous()
        no_dropout = dropout.NO_DROPOUT.rng_state()
        if varlen is None:
            interface._bwd_op(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, -1, -1, 0.0, None,
                              0.0, no_dropout, self.deterministic)
        else:
            interface._varlen_bwd_op(dout, q, k, v, out, lse, dq, dk, dv, *varlen, softmax_scale, causal, -1, -1,
                                     0.0, None, None, None, 0.0, no_dropout, self.deterministic)
        if padded:
            dq, dk, dv = (t[..., :head_dim] for t in (dq, dk, dv))
        return dq, dk, dv


class TorchLocalAttention:
    """The same contract in PyTorch ops, computed in the inputs' dtype promoted to at least float32
    (float64 inputs give a float64 out and lse).  The backward is written out (not autograd) from
    the given out and lse, exactly as a flash backward uses them, so a ring test through it checks
    the ring's use of the global statistics.  Masks are bottom-right aligned, as flashgen's."""

    def forward(self, q, k, v, *, causal, softmax_scale, varlen):
        if varlen is None:
            return self._dense_forward(q, k, v, causal, softmax_scale)
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=self._compute_dtype(q), device=q.device)
        for (q0, q1), (k0, k1) in _segments(varlen):
            o, l = self._dense_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale, varlen):
        if varlen is None:
            return self._dense_backward(dout, q, k, v, out, lse, causal, softmax_scale)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (q0, q1), (k0, k1) in _segments(varlen):
            grads = self._dense_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                         out[None, q0:q1], lse[None, :, q0:q1], causal, softmax_scale)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
        return dq, dk, dv

    @staticmethod
    def _compute_dtype(q):
        return torch.promote_types(q.dtype, torch.float32)

    def _probabilities_setup(self, q, k, causal, softmax_scale):
        dtype = self._compute_dtype(q)
        group = q.shape[2] // k.shape[2]
        qc = q.to(dtype)
        kc = k.to(dtype).repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * softmax_scale
        if causal:
            seqlen_q, seqlen_k = q.shape[1], k.shape[1]
            rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
            hidden = torch.arange(seqlen_k, device=q.device)[None, :] > rows
            scores = scores.masked_fill(hidden, -math.inf)
        return scores, group, dtype

    def _dense_forward(self, q, k, v, causal, softmax_scale):
        scores, group, dtype = self._probabilities_setup(q, k, causal, softmax_scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
        vc = v.to(dtype).repeat_interleave(group, dim=2)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
        return out.to(q.dtype), lse

    def _dense_backward(self, dout, q, k, v, out, lse, causal, softmax_scale):
        scores, group, dtype = self._probabilities_setup(q, k, causal, softmax_scale)
        # Rows that see no key anywhere have lse -inf and no gradient.
        probs = torch.exp(scores - lse.to(dtype).masked_fill(torch.isinf(lse), math.inf)[..., None])
        do, o = dout.to(dtype), out.to(dtype)
        vc = v.to(dtype).repeat_interleave(group, dim=2)
        kc = k.to(dtype).repeat_interleave(group, dim=2)
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, do)
        dprobs = torch.einsum("bqhd,bkhd->bhqk", do, vc)
        row_dot = (do * o).sum(-1).transpose(1, 2)  # (batch, heads, rows): D = rowsum(dO * O)
        dscores = probs * (dprobs - row_dot[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kc) * softmax_scale
        dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q.to(dtype)) * softmax_scale

        def per_kv_head(g):  # the gradient of a shared K/V head sums over its query heads
            batch, rows, _, d = g.shape
            return g.reshape(batch, rows, k.shape[2], group, d).sum(3)

        return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _segments(varlen: VarlenArgs):
    bounds_q, bounds_k = varlen.cu_seqlens_q.tolist(), varlen.cu_seqlens_k.tolist()
    return zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]))
