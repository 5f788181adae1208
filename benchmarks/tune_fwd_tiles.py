"""Try forward tile configurations on the device and print TFLOP/s per candidate.

Used to fill flashgen/generator/tiles.py: each candidate is patched into the tile table for one
measurement (its rendered source differs, so it gets its own cache entry), then the table is
restored. FlashAttention's benchmark shape: batch x seqlen = 16k tokens, hidden 2048, bf16.

    python benchmarks/tune_fwd_tiles.py --head-dims 64,128,256 --seqlen 4096
"""
import argparse
import itertools

import torch
import triton.testing

import flashgen
from flashgen.generator import tiles
from flashgen.generator import cache
from flashgen.runtime import dispatch, interface, launch

CANDIDATES = {
    64: [(128, 64, 4), (128, 128, 4), (64, 64, 4), (128, 128, 8)],
    96: [(128, 64, 4), (64, 64, 4), (128, 64, 8)],
    128: [(128, 64, 4), (64, 64, 4), (128, 128, 8), (128, 32, 4), (64, 128, 4)],
    192: [(128, 64, 8), (64, 64, 4), (128, 32, 8)],
    256: [(128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)],
}


def measure(head_dim: int, causal: bool, seqlen: int, dtype) -> float:
    batch, nheads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    ms = triton.testing.do_bench(lambda: flashgen.flash_attn_func(q, k, v, causal=causal), return_mode="median")
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for (block_m, block_n, warps), causal in itertools.product(CANDIDATES[head_dim], (False, True)):
            table = tiles._FWD_SM80_LARGE_MASKED if causal else tiles._FWD_SM80_LARGE
            original = table[head_dim]
            table[head_dim] = tiles.FwdTile(block_m, block_n, warps)
            launch._loaded.clear()  # these memos are keyed by spec or shape, which the tile is not part of
            cache._cubins.clear()
            dispatch.plan_fwd.cache_clear()
            interface._fwd_records.clear()  # a record holds its plan, keyed without the tile tables
            try:
                tflops = measure(head_dim, causal, args.seqlen, dtype)
                print(f"d{head_dim} causal={int(causal)} tile {block_m}x{block_n} w{warps}: {tflops:6.1f} TFLOP/s", flush=True)
            except Exception as exc:  # a candidate that does not compile or fit is reported, not fatal
                print(f"d{head_dim} causal={int(causal)} tile {block_m}x{block_n} w{warps}: failed: {exc}", flush=True)
            table[head_dim] = original


if __name__ == "__main__":
    main()
