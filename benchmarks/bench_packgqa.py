"""PackGQA on vs off on decode-like shapes, in one process on the device.

batch 4, seqlen_q 1..16, 32 query heads / 4 KV heads, d128, seqlen_k 8192 (the PackGQA issue's
shape). Reports median microseconds (CUDA-graph replays, so launch overhead does not hide the
kernel) and the K+V bytes read per second against the measured copy bandwidth.

    python benchmarks/bench_packgqa.py [--out benchmarks/results/packgqa_h200.json]
"""
import argparse
import json

import torch
import triton.testing

import flashgen


def graph_time_us(fn) -> float:
    """Median time of one call, replayed from a CUDA graph of 20 calls."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / 20


def copy_bandwidth() -> float:
    x = torch.randn(1 << 30 >> 1, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 2 / ms / 1e9  # TB/s, bytes read + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--seqlen-k", type=int, default=8192)
    args = parser.parse_args()
    batch, nheads, nheads_k, d = 4, 32, 4, 128
    ceiling = copy_bandwidth()
    rows = []
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.2f} TB/s")
    print(f"{'seqlen_q':>8} {'causal':>6} {'packed us':>10} {'unpacked us':>12} {'speedup':>8} {'packed TB/s':>12}")
    for causal in (False, True):
        for seqlen_q in (1, 2, 4, 8, 16):
            q = torch.randn(batch, seqlen_q, nheads, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(batch, args.seqlen_k, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            times = {}
            for pack in (True, False):
                times[pack] = graph_time_us(lambda: flashgen.flash_attn_func(q, k, v, causal=causal, pack_gqa=pack))
            out_p = flashgen.flash_attn_func(q, k, v, causal=causal, pack_gqa=True)
            out_u = flashgen.flash_attn_func(q, k, v, causal=causal, pack_gqa=False)
            assert (out_p.float() - out_u.float()).abs().max().item() < 1e-2, "packed and unpacked disagree"
            kv_bytes = 2 * k.numel() * k.element_size()
            row = dict(seqlen_q=seqlen_q, causal=causal, packed_us=times[True], unpacked_us=times[False],
                       speedup=times[False] / times[True], packed_tbps=kv_bytes / times[True] / 1e6)
            rows.append(row)
            print(f"{seqlen_q:>8} {int(causal):>6} {times[True]:>10.1f} {times[False]:>12.1f} {row['speedup']:>7.2f}x {row['packed_tbps']:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_tbps=ceiling, batch=batch, nheads=nheads,
                           nheads_k=nheads_k, head_dim=d, seqlen_k=args.seqlen_k, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
