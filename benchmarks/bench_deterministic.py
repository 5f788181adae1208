"""What deterministic=True costs the backward pass.

In deterministic mode the key blocks that see a query block add their dQ terms to it one after
another, in key order, through a per-query-block semaphore; without it they add with atomics in
whatever order they arrive. Both runs below compute the same gradients; the report is the backward's
TFLOP/s (FlashAttention's count: 2.5 x the forward's 4·b·h·s²·d, halved when causal) with and
without, and their ratio. bf16, batch x seqlen = 16k tokens, hidden 2048, MHA.

    python benchmarks/bench_deterministic.py [--seqlens 1024,4096] [--out results.json]
"""
import argparse
import itertools
import json

import torch
from triton.testing import do_bench

import flashgen


def backward_tflops(head_dim: int, seqlen: int, causal: bool, deterministic: bool) -> float:
    batch, nheads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flashgen.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    dout = torch.randn_like(out)
    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), return_mode="median")
    flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}: backward TFLOP/s, bf16, batch x seqlen = 16k, hidden 2048")
    for head_dim, seqlen, causal in itertools.product((int(d) for d in args.head_dims.split(",")),
                                                      (int(s) for s in args.seqlens.split(",")), (False, True)):
        free = backward_tflops(head_dim, seqlen, causal, deterministic=False)
        fixed = backward_tflops(head_dim, seqlen, causal, deterministic=True)
        rows.append({"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "tflops": free,
                     "tflops_deterministic": fixed, "ratio": fixed / free})
        print(f"d{head_dim} s{seqlen} causal={int(causal)}: {free:6.1f} -> deterministic {fixed:6.1f} "
              f"({fixed / free:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
