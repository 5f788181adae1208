"""Try decode-tile candidates (tiles.FWD_DECODE_TILE) on decode shapes, next to SDPA's cuDNN backend.

    python benchmarks/tune_decode.py [--shapes b1-s8k b1-s128k b32-s4k b128-s2k] [--tiles ...]
                                     [--page-size 16] [--rounds 2]

Each candidate is patched into the tile table for its measurements (its rendered source differs,
so it gets its own cache entry).  One query token, 32 query / 8 KV heads, d128 (or --head-dim),
bf16, contiguous cache (or paged), split-KV heuristic; measured as `flashgen bench decode` measures
(flashgen.bench.suites: output checked, K/V rotated past L2, CUDA-graph medians below 100 us).
With --rounds N every candidate is measured N times in turn (cuDNN before and after each round)
and the summary gives medians.
"""
import argparse
import dataclasses
import os
import statistics

from flashgen.bench import peers, suites, timing
from flashgen.generator import cache, tiles
from flashgen.runtime import dispatch, interface, kvcache, launch, tuning

SHAPES = {  # name -> (batch, keys, query tokens)
    "b1-s2k": (1, 2048, 1),
    "b2-s8k": (2, 8192, 1),
    "b4-s2k": (4, 2048, 1),
    "b4-s4k": (4, 4096, 1),
    "b4-s8k": (4, 8192, 1),
    "b16-s2k": (16, 2048, 1),
    "b4-s32k": (4, 32768, 1),
    "b8-s32k": (8, 32768, 1),
    "b8-s128k": (8, 131072, 1),
    "b16-s4k": (16, 4096, 1),
    "b16-s32k": (16, 32768, 1),
    "b16-s128k": (16, 131072, 1),
    "b1-s8k": (1, 8192, 1),
    "b1-s16k": (1, 16384, 1),
    "b1-s32k": (1, 32768, 1),
    "b2-s16k": (2, 16384, 1),
    "b2-s32k": (2, 32768, 1),
    "b1-s128k": (1, 131072, 1),
    "b2-s128k": (2, 131072, 1),
    "b8-s8k": (8, 8192, 1),
    "b4-s128k": (4, 131072, 1),
    "b32-s4k": (32, 4096, 1),
    "b32-s8k": (32, 8192, 1),
    "b32-s32k": (32, 32768, 1),
    "b128-s8k": (128, 8192, 1),
    "b128-s2k": (128, 2048, 1),
    "b8-s8k-q8": (8, 8192, 8),  # speculative decoding: 8 tokens x 4 heads = 32 packed rows
}
# (block_m, block_n, warps, kv_buffers, warps_n, options); tiles.decode_tile takes the deepest ring
# that two CTAs per SM hold, up to max(kv_buffers, tiles.DECODE_MAX_SHARED_RING), else the deepest
# ring of up to kv_buffers that one CTA holds. Options:
#   solo        the deepest ring one CTA holds, not two CTAs per SM (tiles.DECODE_MIN_SHARED_RING)
#   shared<N>   two CTAs per SM take rings of up to N buffers (tiles.DECODE_MAX_SHARED_RING)
#   pagedring   paged caches take the contiguous tile's ring; an odd ring takes K and V blocks in
#               turn, an even one keeps them in pairs (tiles.DECODE_PAGED_SHARED_RING)
#   combine     split-KV partials merged by the combine kernel, not in a cluster (Tuning.merge_in_cluster)
#   nopdl       that combine launched normally, not as a programmatic dependent (Tuning.dependent_combine)
#   nopdlfwd    the forward launched normally, not as a programmatic dependent (Tuning.decode_dependent_launch)
#   pdlany      the forward a programmatic dependent at any grid size (Tuning.decode_dependent_max_sm_share)
#   slots<N>    split counts for up to N decode CTAs per SM (Tuning.decode_split_ctas_per_sm)
#   cluster<N>  splits cut to a cluster's up to N key blocks (Tuning.decode_cluster_max_blocks)
#   long<N>     clusters of more than two splits for splits of up to N key blocks
#               (Tuning.decode_cluster_max_split_blocks)
#   nofill      the split heuristic's count as is (Tuning.decode_fill_wave)
#   fill<N>     the wave filled while each split keeps N key blocks (Tuning.decode_fill_min_blocks)
#   pairs       two adjacent KV heads per CTA at d64/d96/d128 and any grid (Tuning.decode_paired_head_dims,
#               decode_pair_min_sm_share); heads-first memory never pairs
#   nopairs     one KV head per CTA
#   pairs<P>    pairs (at the default head dims) where the paired grid has at least P% of the SMs'
#               count in tiles (Tuning.decode_pair_min_sm_share)
#   -D<NAME>=<V> an NVRTC define for the candidate's kernels (FLASHGEN_NVRTC_EXTRA_OPTIONS)
# The tile table's knobs the options set (module globals of generator/tiles.py), restored before
# every candidate and at the end; the plan's knobs are a Tuning value (runtime/tuning.py).
KNOBS = [(tiles, "FWD_DECODE_TILE"), (tiles, "DECODE_MIN_SHARED_RING"), (tiles, "DECODE_MAX_SHARED_RING"),
         (tiles, "DECODE_PAGED_SHARED_RING")]


def apply_options(options: tuple[str, ...]) -> tuning.Tuning:
    """Set the tile table's knobs of the options; return the plan's Tuning of them."""
    def number(prefix: str):
        return next((int(o[len(prefix):]) for o in options if o.startswith(prefix) and o[len(prefix):].isdigit()), None)

    tiles.DECODE_PAGED_SHARED_RING |= "pagedring" in options
    if number("shared") is not None:
        tiles.DECODE_MAX_SHARED_RING = number("shared")
    if "solo" in options:  # no shared ring qualifies
        tiles.DECODE_MIN_SHARED_RING = max(tiles.FWD_DECODE_TILE.kv_buffers, tiles.DECODE_MAX_SHARED_RING) + 1
    defines = [o for o in options if o.startswith("-D")]
    if defines:
        os.environ["FLASHGEN_NVRTC_EXTRA_OPTIONS"] = " ".join(defines)
    changes = {}
    if "combine" in options:
        changes["merge_in_cluster"] = False
    if "nopdl" in options:
        changes["dependent_combine"] = False
    if "nopdlfwd" in options:
        changes["decode_dependent_launch"] = False
    if "pdlany" in options:
        changes["decode_dependent_max_sm_share"] = float("inf")
    if "nofill" in options:
        changes["decode_fill_wave"] = False
    if "pairs" in options:
        changes.update(decode_paired_head_dims=frozenset({64, 96, 128}), decode_pair_min_sm_share=0)
    if number("pairs") is not None:
        changes["decode_pair_min_sm_share"] = number("pairs") / 100
    if "nopairs" in options:
        changes["decode_paired_head_dims"] = frozenset()
    for prefix, field in (("slots", "decode_split_ctas_per_sm"), ("cluster", "decode_cluster_max_blocks"),
                          ("fill", "decode_fill_min_blocks")):
        if number(prefix) is not None:
            changes[field] = number(prefix)
    if number("long") is not None:
        changes["decode_cluster_max_split_blocks"] = tuple(
            (head_dim, number("long")) for head_dim, _ in tuning.DEFAULT.decode_cluster_max_split_blocks)
    return dataclasses.replace(tuning.DEFAULT, **changes)


CANDIDATES = [(16, 128, 4, 4, 4, ()), (16, 128, 4, 4, 4, ("solo",)), (16, 128, 4, 2, 4, ()),
              (16, 128, 4, 4, 4, ("combine",)), (16, 128, 4, 4, 4, ("nofill",)),
              (16, 64, 4, 8, 4, ()), (16, 64, 4, 6, 4, ()), (32, 64, 2, 6, 1, ()), (16, 128, 8, 4, 8, ())]


def config(shape: str, page_size: int | None, head_dim: int, hnd: bool = False) -> dict:
    batch, context, seqlen_q = SHAPES[shape]
    layout = f"paged{page_size}" if page_size else "hnd" if hnd else "contiguous"
    return {"dtype": "bf16", "batch": batch, "seqlen_q": seqlen_q, "context": context, "nheads": 32, "nheads_k": 8,
            "head_dim": head_dim, "layout": layout, "page_size": page_size,
            "causal": seqlen_q > 1}


def line(label: str, shape: str, entry: dict) -> str:
    if "skipped" in entry:
        return f"{label:>26} {shape:>9}: skipped: {entry['skipped']}"
    return f"{label:>26} {shape:>9}: {entry['us']:7.1f} us {entry['tbps']:5.2f} TB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=list(SHAPES))
    parser.add_argument("--tiles", nargs="+", metavar="MxN/WARPS/WARPS_N/BUFFERS[/OPTION...]",
                        help="candidates to try instead of the built-in list, e.g. 16x64/4/4/6/nofill")
    parser.add_argument("--page-size", type=int, default=None, help="a paged cache of this page size")
    parser.add_argument("--hnd", action="store_true",
                        help="a contiguous cache in heads-first memory (bench layout hnd)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="measure every candidate this many times, in turn")
    args = parser.parse_args()
    candidates = CANDIDATES
    if args.tiles:
        candidates = []
        for text in args.tiles:
            mn, warps, warps_n, buffers, *flags = text.split("/")
            block_m, block_n = mn.split("x")
            candidates.append((int(block_m), int(block_n), int(warps), int(buffers), int(warps_n), tuple(flags)))
    kernel_ms, _ = timing.make_timer()
    ceilings = timing.measure_ceilings(kernel_ms, [])
    env = timing.environment()
    timers = suites.Timers(kernel_ms, timing.rotated_us, env["l2_bytes"])
    print(f"{env['gpu']}: copy ceiling {ceilings['copy_tbps']:.2f} TB/s")
    cudnn, flashgen = peers.sdpa_impl("sdpa-cudnn", "CUDNN_ATTENTION"), peers.flashgen_impl()
    saved = {(module, name): getattr(module, name) for module, name in KNOBS}
    saved_extra_options = os.environ.get("FLASHGEN_NVRTC_EXTRA_OPTIONS")

    def restore() -> None:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        if saved_extra_options is None:
            os.environ.pop("FLASHGEN_NVRTC_EXTRA_OPTIONS", None)
        else:
            os.environ["FLASHGEN_NVRTC_EXTRA_OPTIONS"] = saved_extra_options
        launch._loaded.clear()  # these memos are keyed by spec or shape, which the tile is not part of
        cache._cubins.clear()
        dispatch.plan_fwd.cache_clear()
        interface._fwd_records.clear()  # records hold their plans, keyed without the tile tables
        kvcache._kvcache_records.clear()

    results: dict[tuple[str, str], list[float]] = {}  # (label, shape) -> us of each round

    def measure(label: str, impl) -> None:
        for shape in args.shapes:
            shape_config = config(shape, args.page_size, args.head_dim, args.hnd)
            row = suites.decode_row(shape_config, [impl], timers, ceilings, "cuda", float("inf"))
            entry = row["impls"][impl.name]
            if row["check"] is not None and not row["check"]["ok"]:
                entry = {"skipped": f"output check failed: {row['check']}"}
            results.setdefault((label, shape), []).append(entry.get("us", float("nan")))
            print(line(label, shape, entry), flush=True)

    for _ in range(args.rounds):
        measure("cuDNN", cudnn)
        for block_m, block_n, warps, buffers, warps_n, options in candidates:
            restore()
            tiles.FWD_DECODE_TILE = tiles.FwdTile(block_m, block_n, warps, buffers, warps_n)
            with tuning.use(apply_options(options)):
                measure(" ".join([f"{block_m}x{block_n} w{warps}/{warps_n} b{buffers}", *options]), flashgen)
        measure("cuDNN", cudnn)  # again: drift over the run shows as a difference between the two
    restore()

    print("\nmedians (us), and cuDNN / candidate:")
    cudnn_us = {shape: statistics.median(results[("cuDNN", shape)]) for shape in args.shapes}
    for (label, shape), times in results.items():
        us = statistics.median(times)
        print(f"{label:>26} {shape:>9}: {us:7.1f} us  {cudnn_us[shape] / us:5.3f}x")

if __name__ == "__main__":
    main()
