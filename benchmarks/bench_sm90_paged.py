"""Paged KV-cache chunked prefill and dropout on the sm90 forward against the sm80 family, in one
process (H200). Results: benchmarks/results/20261130-nvidia-h200-sm90-paged-dropout/.

Run on the device: `python benchmarks/bench_sm90_paged.py`. Times are triton do_bench medians (us);
TFLOP/s count the forward as 4 * b * h * sq * sk * d (halved when causal) and forward + backward as
3.5 times that.
- Paged chunked prefill (32 query / 8 KV heads, d128, bf16, causal, random page order): pages of
  256 hold whole key blocks (TMA boxes); 1, 16, 17 and 64 and a left pad are gathered row by row
  by the producer warpgroup (the gather instances, fwd_sm90.cuh: kGather); the sm80 family gathers
  with cp.async too.
- Dropout (p = 0.1, bf16, b4 s4096, hidden 2048): the sm90 forward, the sm80 family forced, and
  PyTorch SDPA's FlashAttention-2 backend with dropout.
"""
from __future__ import annotations

import functools

import torch
from bench_sm90_split import microseconds, with_family
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen

DTYPE = torch.bfloat16
# (batch, seqlen_q, cache length, page size, left pad)
PAGED = [(1, 512, 32768, 256, 0), (1, 512, 32768, 16, 0), (1, 512, 32768, 17, 0), (1, 512, 32768, 64, 0),
         (4, 256, 8192, 16, 0), (4, 256, 8192, 256, 100), (8, 64, 4096, 16, 0), (1, 128, 32768, 1, 0)]
DROPOUT = [(64, False), (64, True), (128, False), (128, True)]  # (head dim, causal)


def paged_prefill(nheads: int = 32, nheads_k: int = 8, head_dim: int = 128) -> None:
    print(f"== flash_attn_with_kvcache, paged chunked prefill ({DTYPE}, d{head_dim}, {nheads}/{nheads_k} heads, causal): us")
    for batch, seqlen_q, length, page_size, leftpad in PAGED:
        q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=DTYPE, device="cuda")
        pages_per_seq = -(-length // page_size)
        k_cache, v_cache = (torch.randn(batch * pages_per_seq, page_size, nheads_k, head_dim, dtype=DTYPE, device="cuda")
                            for _ in range(2))
        block_table = torch.randperm(batch * pages_per_seq, device="cuda").view(batch, -1).to(torch.int32)
        kwargs = {"cache_seqlens": torch.full((batch,), length, dtype=torch.int32, device="cuda"),
                  "block_table": block_table, "causal": True}
        if leftpad:
            kwargs["cache_leftpad"] = torch.full((batch,), leftpad, dtype=torch.int32, device="cuda")
        call = functools.partial(flashgen.flash_attn_with_kvcache, q, k_cache, v_cache, **kwargs)
        sm90, sm80 = with_family(None, call), with_family("sm80", call)
        print(f"b{batch} sq{seqlen_q} L{length} page{page_size}{f' leftpad{leftpad}' if leftpad else ''}: "
              f"sm90 {sm90:.1f} sm80 {sm80:.1f} | sm90 speedup {sm80 / sm90:.2f}x")


def forward_backward(attention, inputs, dout) -> None:
    torch.autograd.grad(attention(*inputs), inputs, dout)


def dropout(batch: int = 4, seqlen: int = 4096, hidden: int = 2048, p: float = 0.1) -> None:
    print(f"== flash_attn_func with dropout_p={p} ({DTYPE}, b{batch} s{seqlen}): TFLOP/s")
    for head_dim, causal in DROPOUT:
        nheads = hidden // head_dim
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, dtype=DTYPE, device="cuda", requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        flops = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1)
        flash = functools.partial(flashgen.flash_attn_func, dropout_p=p, causal=causal)
        times = {}
        for name, family in [("sm90", None), ("sm80", "sm80")]:
            times[f"{name} fwd"] = with_family(family, functools.partial(flash, q, k, v))
            times[f"{name} fwd+bwd"] = with_family(family, functools.partial(forward_backward, flash, (q, k, v), dout))
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=p, is_causal=causal)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            times["FA2 fwd"] = microseconds(functools.partial(sdpa, qt, kt, vt))
            times["FA2 fwd+bwd"] = microseconds(
                functools.partial(forward_backward, sdpa, (qt, kt, vt), dout.transpose(1, 2)))
        rates = {name: flops * (3.5 if "bwd" in name else 1) / us / 1e6 for name, us in times.items()}
        print(f"d{head_dim}{' causal' if causal else ''}: " + ", ".join(f"{n} {r:.0f}" for n, r in rates.items())
              + f" | sm90/FA2 fwd {rates['sm90 fwd'] / rates['FA2 fwd']:.2f}x, fwd+bwd "
              f"{rates['sm90 fwd+bwd'] / rates['FA2 fwd+bwd']:.2f}x")


if __name__ == "__main__":
    torch.manual_seed(0)
    paged_prefill()
    dropout()
