"""Try sm80-family backward tile configurations on the device (the backward pass alone).

    FLASHGEN_FAMILY=sm80 python benchmarks/tune_bwd_tiles.py --head-dims 64,128 --seqlen 4096

(on Hopper, without FLASHGEN_FAMILY=sm80, d64 and d128 would measure the sm90 backward)

Each candidate is patched into tiles._BWD_SM80_LARGE for its measurement (its rendered source
differs, so it gets its own cache entry). bf16, batch x seqlen = 16k tokens, hidden 2048; TFLOP/s of
the backward with FlashAttention's count (2.5 x the forward's 4·b·h·s²·d, halved when causal).
"""
import argparse
import itertools

import torch
import triton.testing

import flashgen
from flashgen.generator import cache, matrix, tiles
from flashgen.runtime import backward, dispatch, launch

# (warps, block_m, d_slices, most Q/dO stages, 32-key warp groups or 0 for warps / 2, dQ tile):
# bwd_tile gives each the dQ tile (sm_90 targets) and the most stages that fit next to it.
CANDIDATES = {
    64: [(8, 128, 1, 2, 0, False), (8, 128, 1, 2, 0, True), (8, 64, 1, 2, 0, False), (8, 128, 1, 2, 2, False)],
    128: [(8, 64, 1, 2, 0, False), (8, 64, 1, 2, 0, True), (8, 64, 1, 1, 0, False), (8, 64, 1, 2, 2, False),
          (8, 128, 1, 2, 2, False)],
    192: [(4, 64, 2, 2, 0, False), (8, 64, 1, 2, 2, False), (8, 64, 1, 2, 2, True)],
    256: [(4, 64, 2, 2, 0, False), (8, 64, 1, 2, 2, False), (8, 64, 1, 1, 2, False), (8, 64, 1, 1, 2, True)],
}


def measure(head_dim: int, causal: bool, seqlen: int) -> float:
    batch, nheads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flashgen.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                 return_mode="median")
    flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return flops / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    table, max_stages = tiles._BWD_SM80_LARGE, tiles.BWD_MAX_STAGES
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        original = table[head_dim]
        for (warps, block_m, slices, stages, groups, dq_tile), causal in itertools.product(
                CANDIDATES[head_dim], (False, True)):
            table[head_dim] = tiles.BwdTile(warps, block_m, slices, key_groups=groups, dq_tile=dq_tile)
            tiles.BWD_MAX_STAGES = stages
            launch._loaded.clear()  # the memos are keyed by spec or shape, which the tile is not part of
            cache._cubins.clear()
            dispatch.plan_bwd.cache_clear()
            backward._bwd_records.clear()  # a record holds its plan, keyed without the tile tables
            try:
                tflops = measure(head_dim, causal, args.seqlen)
                chosen = tiles.bwd_tile("sm80", matrix.target_arch(*torch.cuda.get_device_capability()), head_dim)
                print(f"bwd d{head_dim} causal={int(causal)} warps {warps} M{block_m} N{chosen.block_n} "
                      f"slices {slices} stages {chosen.stages} dq_tile {int(chosen.dq_tile)}: {tflops:6.1f} TFLOP/s",
                      flush=True)
            except Exception as exc:  # a candidate that does not compile or fit is reported, not fatal
                print(f"bwd d{head_dim} causal={int(causal)} warps {warps}: failed: {exc}", flush=True)
        table[head_dim] = original
        tiles.BWD_MAX_STAGES = max_stages


if __name__ == "__main__":
    main()
