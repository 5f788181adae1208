"""Weak scaling of ring attention: causal bf16 d128, a fixed number of tokens per GPU.

Every rank holds --tokens-per-gpu rows of one sequence (zigzag), so the sequence grows with the
number of GPUs N.  The ring's time is compared with the time one GPU needs for the same share of
the work done locally: a rank's share of causal attention over N * T tokens is 1/N of the full
causal FLOPs, which equals one causal call over T tokens plus N - 1 non-causal T x T/2 blocks;
the single-GPU baseline times exactly those local calls on one GPU with no communication.
    efficiency = baseline time / ring time       (1.0: communication fully hidden)
Reported for the forward and forward+backward, on rank 0.

    torchrun --nproc-per-node=N benchmarks/bench_ring.py [--tokens-per-gpu 131072] [--out results.json]
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import flashgen
import flashgen.parallel as parallel
from flashgen.bench.timing import cuda_event_median_ms


def time_ms(fn) -> float:
    """Median milliseconds of fn over a fixed number of runs: every rank must make the same number of
    ring calls (an adaptive count such as triton's do_bench could differ between ranks and hang)."""
    return cuda_event_median_ms(fn, warmup=2, runs=5)


def local_share(q, k, v, world_size, backward):
    """One rank's local work without the ring: the diagonal causal call plus N - 1 half blocks."""
    half = q.shape[1] // 2
    calls = [(q, k, v, True)] + [(q, k[:, :half], v[:, :half], False)] * (world_size - 1)

    def run():
        for qq, kk, vv, causal in calls:
            out = flashgen.flash_attn_func(qq, kk, vv, causal=causal)
            if backward:
                out.backward(torch.ones_like(out))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-gpu", type=int, default=131072)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shape = (1, args.tokens_per_gpu, args.nheads, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def ring(backward):
        def run():
            out = parallel.ring_flash_attn_func(q, k, v, causal=True)
            if backward:
                out.backward(torch.ones_like(out))
        return run

    results = {"world_size": world_size, "tokens_per_gpu": args.tokens_per_gpu, "nheads": args.nheads}
    for mode, backward in (("fwd", False), ("fwd_bwd", True)):
        ring_ms = time_ms(ring(backward))
        dist.barrier()
        local_ms = time_ms(local_share(q, k, v, world_size, backward))
        results[mode] = {"ring_ms": ring_ms, "local_ms": local_ms, "efficiency": local_ms / ring_ms}
    if rank == 0:
        for mode in ("fwd", "fwd_bwd"):
            r = results[mode]
            print(f"N={world_size} {mode:8s} ring {r['ring_ms']:9.2f} ms  local share {r['local_ms']:9.2f} ms  "
                  f"efficiency {r['efficiency']:.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
