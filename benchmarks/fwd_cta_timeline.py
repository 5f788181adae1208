"""Where a tile of the sm90 forward spends its time: the timeline variant
(-DFLASHGEN_FWD_SM90_MEASURE_TIMELINE=1) stamps, for each persistent CTA's first tiles, the tile's
start, its last P·V done and its O stored; this reads them back after one forward call and prints
per shape the mean of each phase and the gap between one tile's stores and the next tile's start.

    python benchmarks/fwd_cta_timeline.py [--head-dims 64,128,256] [--seqlens 1024,16384] [--causal] \
        [--defines NAME=V+NAME=V] [--out timeline.json]

bf16, 16k tokens, hidden 2048 (bench_bwd_peers.py's shapes). The stamps are a few global stores a
tile: compare phases with each other, not the totals with another implementation's.
"""
import statistics

import torch

import flashgen
from bwd_cta_timeline import (clear_timeline, finish_timeline, loaded_sm90_kernel, read_timeline, timeline_args,
                              timeline_shapes)

SLOTS = 16  # per CTA: 3 stamps for each of the first TILES tiles; slot 15 = tiles << 32 | SM
TILES = 5   # FLASHGEN_FWD_TIMELINE_TILES in fwd_sm90.cuh
SYMBOL = b"flashgen_fwd_timeline"


def summarize(rows: torch.Tensor) -> dict:
    """Mean µs of a tile's main loop (start to last P·V) and epilogue (to O stored), and of the gap
    from one tile's stores to the next tile's start, over the stamped tiles of every CTA."""
    rows = rows[rows[:, 0] != 0].to(torch.float64)
    loop, epilogue, gap = [], [], []
    for row in rows.tolist():
        tiles = min(int(row[15]) >> 32, TILES)
        for t in range(tiles):
            start, mma_done, stored = row[3 * t:3 * t + 3]
            loop.append((mma_done - start) / 1000.0)
            epilogue.append((stored - mma_done) / 1000.0)
            if t + 1 < tiles:
                gap.append((row[3 * t + 3] - stored) / 1000.0)
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    return {"ctas": int(rows.shape[0]), "tiles_stamped": len(loop), "loop_us": mean(loop),
            "epilogue_us": mean(epilogue), "gap_to_next_tile_us": mean(gap)}


def main() -> None:
    args = timeline_args(__doc__, "64,128,256").parse_args()
    results = {}
    for head_dim, seqlen, causal, batch, nheads in timeline_shapes(args, "FLASHGEN_FWD_SM90_MEASURE_TIMELINE=1"):
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for _ in range(3):
            flashgen.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        kernel = loaded_sm90_kernel("fwd", head_dim, causal)
        clear_timeline(kernel, SYMBOL)
        flashgen.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        label = f"d{head_dim} s{seqlen}{' causal' if causal else ''}"
        results[label] = summary = summarize(read_timeline(kernel, SYMBOL, SLOTS))
        print(f"{label}: {summary['ctas']} CTAs, {summary['tiles_stamped']} tiles stamped; a tile's loop "
              f"{summary['loop_us']:.2f} µs, its epilogue {summary['epilogue_us']:.2f} µs, then "
              f"{summary['gap_to_next_tile_us']:.2f} µs to the next tile's start")
    finish_timeline(args, results)


if __name__ == "__main__":
    main()
