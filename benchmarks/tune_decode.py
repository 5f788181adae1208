"""Try decode-tile candidates (tiles.FWD_DECODE_TILE) on the decode benchmark's shapes.

    python benchmarks/tune_decode.py [--shapes b1-s8k b1-s128k b128-s2k]

Each candidate is patched into the tile table for its measurements (its rendered source differs,
so it gets its own cache entry); flashgen's contiguous-cache path only, CUDA-graph medians.
"""
import argparse
import functools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402

from flashgen.generator import cache, tiles  # noqa: E402
from flashgen.runtime import launch  # noqa: E402

CANDIDATES = [(16, 64, 1), (16, 128, 1), (16, 32, 1), (32, 64, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["b1-s8k", "b1-s128k", "b32-s4k", "b128-s2k"])
    args = parser.parse_args()
    bench = functools.partial(triton.testing.do_bench, return_mode="median")
    options = argparse.Namespace(page_sizes=[], num_splits=0, calls_per_graph=20, rotate_mb=256.0)
    ceiling = bench_decode.copy_ceiling_tbps(bench)
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.2f} TB/s")
    original = tiles.FWD_DECODE_TILE
    for block_m, block_n, warps in CANDIDATES:
        tiles.FWD_DECODE_TILE = tiles.FwdTile(block_m, block_n, warps)
        launch._loaded.clear()  # both memos are keyed by spec, which the tile is not part of
        cache._cubins.clear()
        for shape in args.shapes:
            rows = bench_decode.bench_shape(shape, options, bench, ceiling)
            for row in rows:
                if row["impl"] in ("flashgen", "cudnn") and "graph_us" in row:
                    print(f"tile {block_m}x{block_n} w{warps} {shape:>9} {row['impl']:>8}: "
                          f"{row['graph_us']:7.1f} us {row['graph_tbps']:5.2f} TB/s", flush=True)
    tiles.FWD_DECODE_TILE = original


if __name__ == "__main__":
    main()
