"""Try decode-tile candidates (tiles.FWD_DECODE_TILE) on decode shapes, next to SDPA's cuDNN backend.

    python benchmarks/tune_decode.py [--shapes b1-s8k b1-s128k b32-s4k b128-s2k] [--tiles ...]

Each candidate is patched into the tile table for its measurements (its rendered source differs,
so it gets its own cache entry).  One query token, 32 query / 8 KV heads, d128, bf16, contiguous
cache, split-KV heuristic; measured as `flashgen bench decode` measures (flashgen.bench.suites:
output checked, K/V rotated past L2, CUDA-graph medians below 100 us).
"""
import argparse

from flashgen.bench import peers, suites, timing
from flashgen.generator import cache, tiles
from flashgen.runtime import dispatch, interface, launch

SHAPES = {  # name -> (batch, keys, query tokens)
    "b1-s2k": (1, 2048, 1),
    "b1-s8k": (1, 8192, 1),
    "b1-s32k": (1, 32768, 1),
    "b1-s128k": (1, 131072, 1),
    "b32-s4k": (32, 4096, 1),
    "b128-s2k": (128, 2048, 1),
    "b8-s8k-q8": (8, 8192, 8),  # speculative decoding: 8 tokens x 4 heads = 32 packed rows
}
# (block_m, block_n, warps, stages, warps_n, options); stages are capped by shared memory
# (tiles.decode_tile). Options: "combine" merges split-KV partials with the combine kernel instead
# of in a cluster (dispatch.MERGE_IN_CLUSTER), "nopdl" launches that combine normally (not as a
# programmatic dependent, sm_90), "nofill" keeps the split heuristic's count (dispatch.DECODE_FILL_WAVE),
# "fill<N>" fills the wave while each split keeps N key blocks (dispatch.DECODE_FILL_MIN_BLOCKS).
CANDIDATES = [(16, 128, 4, 2, 4, ()), (16, 128, 4, 2, 4, ("combine",)), (16, 128, 4, 2, 4, ("nofill",)),
              (16, 128, 4, 2, 4, ("fill2",)), (16, 128, 4, 2, 4, ("fill4",)),
              (16, 64, 4, 4, 4, ()), (16, 64, 4, 3, 4, ()), (32, 64, 2, 3, 1, ()), (16, 128, 8, 2, 8, ())]


def config(shape: str) -> dict:
    batch, context, seqlen_q = SHAPES[shape]
    return {"dtype": "bf16", "batch": batch, "seqlen_q": seqlen_q, "context": context, "nheads": 32, "nheads_k": 8,
            "head_dim": 128, "layout": "contiguous", "page_size": None, "causal": seqlen_q > 1}


def line(label: str, shape: str, entry: dict) -> str:
    if "skipped" in entry:
        return f"{label:>26} {shape:>9}: skipped: {entry['skipped']}"
    return f"{label:>26} {shape:>9}: {entry['us']:7.1f} us {entry['tbps']:5.2f} TB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=list(SHAPES))
    parser.add_argument("--tiles", nargs="+", metavar="MxN/WARPS/WARPS_N/STAGES[/combine][/nopdl][/nofill][/fillN]",
                        help="candidates to try instead of the built-in list, e.g. 16x64/4/4/3/nofill")
    args = parser.parse_args()
    candidates = CANDIDATES
    if args.tiles:
        candidates = []
        for text in args.tiles:
            mn, warps, warps_n, stages, *flags = text.split("/")
            block_m, block_n = mn.split("x")
            candidates.append((int(block_m), int(block_n), int(warps), int(stages), int(warps_n), tuple(flags)))
    kernel_ms, _ = timing.make_timer()
    ceilings = timing.measure_ceilings(kernel_ms, [])
    env = timing.environment()
    timers = suites.Timers(kernel_ms, timing.rotated_us, env["l2_bytes"])
    print(f"{env['gpu']}: copy ceiling {ceilings['copy_tbps']:.2f} TB/s")
    cudnn, flashgen = peers.sdpa_impl("sdpa-cudnn", "CUDNN_ATTENTION"), peers.flashgen_impl()
    for shape in args.shapes:
        row = suites.decode_row(config(shape), [cudnn], timers, ceilings, "cuda", float("inf"))
        print(line("cuDNN", shape, row["impls"]["sdpa-cudnn"]), flush=True)
    original, fill_min_blocks = tiles.FWD_DECODE_TILE, dispatch.DECODE_FILL_MIN_BLOCKS
    for block_m, block_n, warps, stages, warps_n, options in candidates:
        tiles.FWD_DECODE_TILE = tiles.FwdTile(block_m, block_n, warps, stages, warps_n)
        dispatch.MERGE_IN_CLUSTER = "combine" not in options
        interface.DEPENDENT_COMBINE = "nopdl" not in options
        dispatch.DECODE_FILL_WAVE = "nofill" not in options
        dispatch.DECODE_FILL_MIN_BLOCKS = next((int(o[4:]) for o in options if o.startswith("fill")
                                                and o[4:].isdigit()), fill_min_blocks)
        label = " ".join([f"{block_m}x{block_n} w{warps}/{warps_n} s{stages}", *options])
        launch._loaded.clear()  # these memos are keyed by spec or shape, which the tile is not part of
        cache._cubins.clear()
        dispatch.plan_fwd.cache_clear()
        for shape in args.shapes:
            row = suites.decode_row(config(shape), [flashgen], timers, ceilings, "cuda", float("inf"))
            entry = row["impls"]["flashgen"]
            if row["check"] is not None and not row["check"]["ok"]:
                entry = {"skipped": f"output check failed: {row['check']}"}
            print(line(label, shape, entry), flush=True)
    tiles.FWD_DECODE_TILE, dispatch.DECODE_FILL_MIN_BLOCKS = original, fill_min_blocks
    interface.DEPENDENT_COMBINE = dispatch.DECODE_FILL_WAVE = dispatch.MERGE_IN_CLUSTER = True


if __name__ == "__main__":
    main()
