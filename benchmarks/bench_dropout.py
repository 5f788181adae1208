"""Training with dropout against its peers, in one process: flashgen against FlashAttention-2 and
cuDNN through PyTorch's SDPA (both take dropout_p), forward + backward (issue 31's dropout target is
1.5x FA2's).

TFLOP/s of forward + backward (3.5 x the forward's 4·b·h·s²·d, halved when causal), bf16, batch x
seqlen = 16k tokens, hidden 2048, medians of do_bench; every impl draws a fresh mask per call.

    python benchmarks/bench_dropout.py [--head-dims 64,128] [--seqlens 1024,4096] [--dropout 0.1] \
        [--impls flashgen,fa2,cudnn] [--out results.json]
"""
import argparse
import itertools
import json
import math

import torch
from triton.testing import do_bench

import flashgen
from bench_bwd_peers import HIDDEN, TOKENS, _sdpa, available

IMPLS = {
    "flashgen": lambda: (lambda q, k, v, causal, dropout_p:
                         flashgen.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)),
    "fa2": lambda: _sdpa("FLASH_ATTENTION"),
    "cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    impls, _ = available(args.impls, IMPLS)
    print(f"{torch.cuda.get_device_name()}: forward + backward TFLOP/s with dropout_p={args.dropout}, bf16")
    print(f"{'shape':<20}" + "".join(f"{name:>12}" for name in impls) + "   flashgen / fa2")
    rows, ratios = [], []
    for head_dim, seqlen, causal in itertools.product(
            (int(d) for d in args.head_dims.split(",")), (int(s) for s in args.seqlens.split(",")), (False, True)):
        batch, nheads = TOKENS // seqlen, HIDDEN // head_dim
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 3.5 * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal}
        for name, forward in impls.items():
            def step():
                out = forward(q, k, v, causal, dropout_p=args.dropout)
                torch.autograd.grad(out, (q, k, v), dout)
            try:
                row[name] = flops / do_bench(step, warmup=20, rep=100, return_mode="median") / 1e9
            except Exception as exc:
                row[name] = None
                print(f"  {name} d{head_dim} s{seqlen}: {type(exc).__name__}: {exc}")
        if row.get("flashgen") and row.get("fa2"):
            ratios.append(row["flashgen"] / row["fa2"])
        label = f"d{head_dim} s{seqlen}{' causal' if causal else ''}"
        cells = "".join(f"{row[n]:>12.1f}" if row.get(n) else f"{'-':>12}" for n in impls)
        ratio = f"{row['flashgen'] / row['fa2']:>9.2f}" if row.get("flashgen") and row.get("fa2") else ""
        print(f"{label:<20}{cells}{ratio}")
        rows.append(row)
    if ratios:
        print(f"flashgen / fa2: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dropout_p": args.dropout, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
