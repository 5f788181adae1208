"""PackGQA on vs off on decode-like shapes: an ablation of flashgen alone (flashgen next to its
peers is `flashgen bench decode`).

batch 4, seqlen_q 1..16, 32 query heads / 4 KV heads, d128, seqlen_k 8192 (the PackGQA issue's
shape). Median microseconds per call replayed from a CUDA graph, each call on its own copy of K/V
so that none is read from L2 (flashgen.bench.timing.rotated_us), and the K+V bytes read per second
against the copy bandwidth measured in the same run.

    python benchmarks/bench_packgqa.py [--out benchmarks/results/<run>/packgqa_h200.json]
"""
import argparse
import json

import torch

import flashgen
from flashgen.bench import timing
from flashgen.runtime.device import device_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--seqlen-k", type=int, default=8192)
    args = parser.parse_args()
    batch, nheads, nheads_k, d = 4, 32, 4, 128
    kernel_ms, _ = timing.make_timer()
    ceiling = timing.measure_ceilings(kernel_ms, [])["copy_tbps"]
    kv_bytes = 2 * batch * args.seqlen_k * nheads_k * d * 2
    copies = timing.rotation_copies(kv_bytes, device_info(torch.cuda.current_device()).l2_bytes)
    rows = []
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.2f} TB/s, K/V rotated over {copies} copies")
    print(f"{'seqlen_q':>8} {'causal':>6} {'packed us':>10} {'unpacked us':>12} {'speedup':>8} {'packed TB/s':>12}")
    for causal in (False, True):
        for seqlen_q in (1, 2, 4, 8, 16):
            def randn(*shape):
                return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

            sets = [(randn(batch, seqlen_q, nheads, d), randn(batch, args.seqlen_k, nheads_k, d),
                     randn(batch, args.seqlen_k, nheads_k, d)) for _ in range(copies)]
            times = {}
            for pack in (True, False):
                # num_splits=0: a decode-shaped call gets split-KV either way, so the comparison
                # is of the packing, not of 16 CTAs against 128 on a 132-SM GPU.
                calls = [lambda q=q, k=k, v=v, causal=causal, pack=pack: flashgen.flash_attn_func(
                    q, k, v, causal=causal, pack_gqa=pack, num_splits=0) for q, k, v in sets]
                times[pack] = timing.rotated_us(calls, graph=True)
            out_p, out_u = (flashgen.flash_attn_func(*sets[0], causal=causal, pack_gqa=pack, num_splits=0)
                            for pack in (True, False))
            assert (out_p.float() - out_u.float()).abs().max().item() < 1e-2, "packed and unpacked disagree"
            row = dict(seqlen_q=seqlen_q, causal=causal, packed_us=times[True], unpacked_us=times[False],
                       speedup=times[False] / times[True], packed_tbps=kv_bytes / times[True] / 1e6)
            rows.append(row)
            print(f"{seqlen_q:>8} {int(causal):>6} {times[True]:>10.1f} {times[False]:>12.1f} {row['speedup']:>7.2f}x "
                  f"{row['packed_tbps']:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_tbps=ceiling, batch=batch, nheads=nheads,
                           nheads_k=nheads_k, head_dim=d, seqlen_k=args.seqlen_k, copies=copies, rows=rows),
                      f, indent=2)


if __name__ == "__main__":
    main()
