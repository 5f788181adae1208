"""flashgen as the local kernel of PyTorch's own ring loop (torch 2.13, private API).

``torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention``
(and ``_templated_ring_attention_backward``) run the ring with the local attention passed in as
``op``: the forward calls ``op(q, k, v, is_causal=..., dropout_p=..., scale=...)`` and expects
``(out, logsumexp, ...)``, the backward calls ``op(query=, key=, value=, out=, logsumexp=,
is_causal=, grad_out=, ...)`` and expects ``(dq, dk, dv, ...)``, all in SDPA's (batch, heads,
seqlen, d) layout.  ``FlashgenSDPAOps`` provides both.  The public ``context_parallel()`` does not
reach them: its DTensor handler sends only aten's SDPA overloads to ring wrappers that hard-code
aten's kernels (see flashgen.parallel's docstring), so these are for code that calls the private
loop itself; flashgen.parallel.ring_flash_attn_func is the supported path.
"""
from __future__ import annotations

from .local import FlashgenLocalAttention, LocalAttention


class FlashgenSDPAOps:
    """The forward and backward ``op`` of torch's templated ring attention, by a flashgen.parallel
    local attention (flashgen's kernels by default)."""

    def __init__(self, local_attention: LocalAttention | None = None, deterministic: bool = False) -> None:
        self.local = local_attention or FlashgenLocalAttention(deterministic)

    @staticmethod
    def _scale(scale, query) -> float:
        return float(scale) if scale is not None else query.shape[-1] ** -0.5

    def forward(self, query, key, value, *, is_causal, dropout_p=0.0, scale=None, **unused):
        if dropout_p:
            raise ValueError(f"dropout_p: flashgen's ring op has no dropout; got {dropout_p}")
        out, lse = self.local.forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      causal=bool(is_causal), softmax_scale=self._scale(scale, query), varlen=None)
        return out.transpose(1, 2), lse

    def backward(self, *, grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, scale=None,
                 **unused):
        if dropout_p:
            raise ValueError(f"dropout_p: flashgen's ring op has no dropout; got {dropout_p}")
        dq, dk, dv = self.local.backward(
            grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            out.transpose(1, 2), logsumexp, causal=bool(is_causal), softmax_scale=self._scale(scale, query),
            varlen=None)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
