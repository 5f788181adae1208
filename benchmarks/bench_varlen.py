"""Varlen forward on a ragged batch against the same work padded to the longest sequence.

Lengths drawn uniformly from 1..8192 (fixed seed) until 64k tokens, bf16, d128, 16 query heads /
16 KV heads, causal (issue 6's shape). Three ways to compute the same attention:
  * flashgen.flash_attn_varlen_func on the packed tokens,
  * flashgen.flash_attn_func on the batch padded to max_seqlen (padded keys are never seen by the
    real queries of a causal bottom-right mask only when right-aligned; here queries and keys are
    padded at the end and the padded rows' results are discarded — the cost is what counts),
  * PyTorch SDPA with the cuDNN backend on the padded batch.
Also flashgen varlen forward+backward against flashgen dense padded forward+backward.
Reports milliseconds (triton do_bench medians) and the useful TFLOP/s (FLOPs of the real
sequences only), so the padded runs show what the padding costs.

    python benchmarks/bench_varlen.py [--out benchmarks/results/<run>/varlen_h200.json]
"""
import argparse
import json
import random

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import flashgen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--total", type=int, default=65536)
    parser.add_argument("--max-len", type=int, default=8192)
    args = parser.parse_args()
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < args.total:
        lengths.append(min(rng.randint(1, args.max_len), args.total - sum(lengths)))
    batch, max_len, total = len(lengths), max(lengths), sum(lengths)
    nheads, d, dtype = 16, 128, torch.bfloat16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, nheads, d, device="cuda", dtype=dtype) for _ in range(3))
    padded = [torch.zeros(batch, max_len, nheads, d, device="cuda", dtype=dtype) for _ in range(3)]
    for b, n in enumerate(lengths):
        for dst, src in zip(padded, (q, k, v)):
            dst[b, :n] = src[cu[b]:cu[b] + n]
    qp, kp, vp = padded
    useful_flops = sum(2 * 2 * nheads * d * n * n / 2 for n in lengths)  # causal: half the square
    padding = 1 - total / (batch * max_len)

    def fwd_varlen():
        return flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    def fwd_dense():
        return flashgen.flash_attn_func(qp, kp, vp, causal=True)

    qt, kt, vt = (t.transpose(1, 2) for t in padded)

    def fwd_cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    results = {"batch": batch, "total_tokens": total, "max_seqlen": max_len, "padding_fraction": padding}
    print(f"{torch.cuda.get_device_name()}: {batch} sequences, {total} tokens, max {max_len}, "
          f"padding {padding:.1%} of the padded batch")
    for name, fn in (("flashgen varlen fwd", fwd_varlen), ("flashgen dense padded fwd", fwd_dense),
                     ("sdpa cudnn padded fwd", fwd_cudnn)):
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        results[name] = {"ms": ms, "useful_tflops": useful_flops / ms / 1e9}
        print(f"{name:>28}: {ms:8.3f} ms  {useful_flops / ms / 1e9:6.1f} useful TFLOP/s")

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    leaves_p = [t.detach().requires_grad_() for t in padded]
    dout, dout_p = torch.randn_like(q), torch.randn_like(qp)

    def fb_varlen():
        out = flashgen.flash_attn_varlen_func(*leaves, cu, cu, max_len, max_len, causal=True)
        torch.autograd.grad(out, leaves, dout)

    def fb_dense():
        out = flashgen.flash_attn_func(*leaves_p, causal=True)
        torch.autograd.grad(out, leaves_p, dout_p)

    for name, fn in (("flashgen varlen fwd+bwd", fb_varlen), ("flashgen dense padded fwd+bwd", fb_dense)):
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        results[name] = {"ms": ms, "useful_tflops": 3.5 * useful_flops / ms / 1e9}
        print(f"{name:>28}: {ms:8.3f} ms  {3.5 * useful_flops / ms / 1e9:6.1f} useful TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
