"""Where a backward's device time goes: each kernel of one backward call (flashgen's preprocess,
main kernel and postprocess; a peer's own kernels), per implementation and shape, from
torch.profiler over a few calls.

    python benchmarks/bwd_kernel_breakdown.py [--impls flashgen,fa4,cudnn] [--head-dims 64,128] \
        [--seqlens 1024,4096,16384] [--gqa 1,4] [--out breakdown.json]

bf16, batch x seqlen = 16k tokens, hidden 2048, as bench_bwd_peers.py (whose implementations it
uses). Kernels under 1% of the call are summed as "other".
"""
import argparse
import itertools
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_bwd_peers import HIDDEN, IMPLS, TOKENS, available

CALLS = 5


def breakdown(forward, q, k, v, dout, causal) -> dict[str, float]:
    out = forward(q, k, v, causal)
    for _ in range(3):  # compiles and warms up outside the profile
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key and not event.key.startswith("cuda"):  # kernels and memsets, not API rows
            times[event.key] = times.get(event.key, 0.0) + device_us / CALLS
    total = sum(times.values())
    kept = {name[:80]: t for name, t in sorted(times.items(), key=lambda kv: -kv[1]) if t >= 0.01 * total}
    kept["other"] = total - sum(kept.values())
    kept["total"] = total
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="flashgen,fa4,cudnn")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--gqa", default="1,4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    impls, _ = available(args.impls, IMPLS)
    results = []
    for head_dim, seqlen, gqa, causal in itertools.product(
            (int(d) for d in args.head_dims.split(",")), (int(s) for s in args.seqlens.split(",")),
            (int(g) for g in args.gqa.split(",")), (False, True)):
        batch, nheads = TOKENS // seqlen, HIDDEN // head_dim
        q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, seqlen, nheads // gqa, head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        for name, forward in impls.items():
            kernels = breakdown(forward, q, k, v, dout, causal)
            shape = f"d{head_dim} s{seqlen}{' gqa' + str(gqa) if gqa > 1 else ''}{' causal' if causal else ''}"
            print(f"{shape:24} {name:10} total {kernels['total']:9.1f} us: " +
                  "; ".join(f"{n} {t:.1f}" for n, t in kernels.items() if n != "total"), flush=True)
            results.append(dict(shape=shape, impl=name, kernels_us=kernels))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
