"""A/B of sm90 backward (or, with --direction fwd, forward) variants compiled with NVRTC defines,
in one process, rounds in turn.

    python benchmarks/tune_bwd_sm90.py --variants default FLASHGEN_BWD_SM90_MEASURE_NO_EPILOGUE=1 \
        [--head-dims 64,128] [--seqlens 1024,4096,16384] [--rounds 2] [--deterministic] [--direction fwd] \
        [--dropout P]

A variant is "default" or items joined by "+": NAME=VALUE defines, which go to
FLASHGEN_NVRTC_EXTRA_OPTIONS as -DNAME=VALUE (part of the cache key, so each gets its own cubins),
or tile.D.FIELD=VALUE, which replaces a field of the sm90 backward tile of instance head dim D
(tiles._BWD_SM90; e.g. tile.192.stages=3: its rendered source differs, so its cubin too), or
fwdtile.D.FIELD=VALUE, the same for the sm90 forward's tile (tiles._FWD_SM90; e.g.
fwdtile.256.block_n=80; the wgmma header then carries every variant's widths, default's too), or
opt:OPTION, an NVRTC option as is (e.g. opt:--Ofast-compile=max), or tuning.FIELD=VALUE, a knob of
runtime/tuning.py's Tuning for the variant's calls (e.g. tuning.bwd_causal_chunk_waves=0), or
det=0 / det=1, the backward without or with deterministic=True whatever --deterministic says (a
deterministic variant beside the plain backward in one process); the loaded-kernel memo and the
plan cache are cleared between variants. bf16, 16k tokens, hidden 2048;
TFLOP/s of the backward alone (2.5 x the forward's 4·b·h·s²·d, halved when causal) or of the
forward, medians. --jobs N compiles every variant's instances N at a time first. --graph times
CUDA-graph replays of the backward's three kernels or the forward (no host path:
the 1k-token shapes' eager times vary with it from call to call), the variants in turn for each
shape after the same warm-up, each round starting at the next variant (the clock drifts with the
load, and the first variant after a change of shape measured up to 5% off).
"""
import argparse
import dataclasses
import itertools
import os
import statistics

import torch
from triton.testing import do_bench

import flashgen
from flashgen.generator import cache, tiles, wgmma
from flashgen.runtime import backward, dispatch, interface, launch, tuning

_DEFAULT_TILES = {"tile": dict(tiles._BWD_SM90), "fwdtile": dict(tiles._FWD_SM90)}
_TABLES = {"tile": tiles._BWD_SM90, "fwdtile": tiles._FWD_SM90}


def _parse(kind: type, value: str):
    return value.lower() in ("1", "true") if kind is bool else kind(value)


def variant_deterministic(variant: str, default: bool) -> bool:
    """The variant's det=0 / det=1 item, else ``default``."""
    for item in variant.split("+"):
        if item.startswith("det="):
            return _parse(bool, item[len("det="):])
    return default


def use_variant(variant: str) -> dict:
    """Puts the variant's compile-time parts in force; returns its Tuning changes."""
    items = [] if variant == "default" else [item for item in variant.split("+") if not item.startswith("det=")]
    changes = {}
    for item in items:
        if item.startswith("tuning."):
            field, value = item[len("tuning."):].split("=")
            changes[field] = _parse(type(getattr(tuning.DEFAULT, field)), value)
    items = [item for item in items if not item.startswith("tuning.")]
    options = [item[len("opt:"):] if item.startswith("opt:") else f"-D{item}"
               for item in items if not item.startswith(("tile.", "fwdtile."))]
    for name, table in _TABLES.items():
        table.clear()
        table.update(_DEFAULT_TILES[name])
    for item in items:
        if item.startswith(("tile.", "fwdtile.")):
            name, head_dim, assignment = item.split(".", 2)
            field, value = assignment.split("=")
            table, head_dim = _TABLES[name], int(head_dim)
            table[head_dim] = dataclasses.replace(
                table[head_dim], **{field: _parse(type(getattr(table[head_dim], field)), value)})
    if options:
        os.environ["FLASHGEN_NVRTC_EXTRA_OPTIONS"] = " ".join(options)
    else:
        os.environ.pop("FLASHGEN_NVRTC_EXTRA_OPTIONS", None)
    launch._loaded.clear()  # keyed by spec, which the defines and tile patches are not part of
    cache._cubins.clear()
    dispatch.plan_bwd.cache_clear()
    dispatch.plan_fwd.cache_clear()
    interface._fwd_records.clear()  # a record holds its plan and kernel, keyed by neither
    backward._bwd_records.clear()
    return changes


def render_every_width(variants: list[str]) -> None:
    """Renders the wgmma wrappers of every variant's tiles into the one header all variants share
    (more wrappers change no kernel's code, only every instance's source text, so its cubin)."""
    widths = set(wgmma.N_TILES)
    for variant in variants:
        use_variant(variant)
        widths |= set(tiles.sm90_mma_widths())
    wgmma.N_TILES = tuple(sorted(widths))


def prebuild(variants: list[str], shapes, direction: str, jobs: int, dropout: bool = False) -> None:
    """Compiles the sm90 instances that the shapes run (bf16, not packed), for every variant, jobs
    at a time, before any timing: the timing loop would compile each on first use, one at a time.
    Best effort: an instance it misses compiles when first used."""
    from flashgen.generator import matrix
    from flashgen.runtime.dispatch import sm90_bwd_instance_head_dim

    uris = set()
    for head_dim, _, causal in shapes:
        mask = "_causal" if causal else ""
        drop = "_dropout" if dropout else ""
        uris.add(f"flash_fwd_sm90_hdim{head_dim}_bf16{mask}{drop}_sm90a")
        if direction == "bwd":
            uris.add(f"flash_bwd_sm90_hdim{sm90_bwd_instance_head_dim(head_dim)}_bf16{mask}{drop}_sm90a")
    specs = [spec for spec in matrix.all_specs(archs=["sm_90a"]) if spec.uri in uris]
    for variant in variants:
        use_variant(variant)  # its defines and tiles, which the rendering and the options read
        failed = [result.spec.uri for result in cache.build(specs, jobs) if result.error is not None]
        print(f"prebuilt {variant}: {len(specs) - len(failed)} of {len(specs)} instances"
              + (f", failed: {failed}" if failed else ""), flush=True)


def graph_ms(q, k, v, dout, causal, deterministic, changes, direction="bwd", replays=20, warm_ms=150.0,
             dropout_p=0.0) -> float:
    """Median ms of one backward (its three kernels) or forward replayed from a CUDA graph, planned
    with the variant's tuning changes."""
    from flashgen.runtime.dropout import DropoutState

    dropout = DropoutState(dropout_p, 1234, 0) if dropout_p > 0 else None
    with torch.no_grad():
        out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, dropout_p=dropout_p, return_attn_probs=True)
    grads = [torch.empty_like(x) for x in (q, k, v)]

    def run():
        if direction == "fwd":
            with torch.no_grad():
                flashgen.flash_attn_func(q, k, v, causal=causal)
            return
        backward.flash_bwd(dout, q, k, v, out, lse, *grads, softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=deterministic,
                           dropout=dropout)

    with tuning.use(**changes):
        run()  # compiles and loads outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    # As long a warm-up before each variant's replays (the clock settles with the load).
    warm = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    warm[0].record()
    graph.replay()
    warm[1].record()
    torch.cuda.synchronize()
    for _ in range(max(3, int(warm_ms / warm[0].elapsed_time(warm[1])))):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--gqa", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability (the dropout instances)")
    parser.add_argument("--direction", choices=("bwd", "fwd"), default="bwd")
    parser.add_argument("--graph", action="store_true", help="kernels only, from CUDA-graph replays")
    parser.add_argument("--jobs", type=int, default=0,
                        help="compile every variant's instances this many at a time before timing (0: on first use)")
    args = parser.parse_args()
    if args.dropout and args.graph and args.direction == "fwd":
        parser.error("--dropout with --graph times the backward only (a dropout forward is not capturable)")
    shapes = list(itertools.product((int(d) for d in args.head_dims.split(",")),
                                    (int(s) for s in args.seqlens.split(",")), (False, True)))
    inputs = {}
    for head_dim, seqlen, causal in shapes:
        batch, nheads = 16384 // seqlen, 2048 // head_dim
        q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, seqlen, nheads // args.gqa, head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        flops = (2.5 if args.direction == "bwd" else 1.0) * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        inputs[(head_dim, seqlen, causal)] = (q, k, v, torch.randn_like(q), flops)
    render_every_width(args.variants)
    if args.jobs:
        prebuild(args.variants, list(inputs), args.direction, args.jobs, args.dropout > 0)
    results = {}
    if args.graph:
        for round_index in range(args.rounds):
            shift = round_index % len(args.variants)  # each round starts at another variant
            for shape, (q, k, v, dout, flops) in inputs.items():
                for variant in args.variants[shift:] + args.variants[:shift]:
                    ms = graph_ms(q, k, v, dout, shape[2], variant_deterministic(variant, args.deterministic),
                                  use_variant(variant), args.direction, dropout_p=args.dropout)
                    results.setdefault((variant, shape), []).append(flops / ms / 1e9)
                    print(f"  round {round_index} {variant} d{shape[0]} s{shape[1]}{' causal' if shape[2] else ''}: "
                          f"{flops / ms / 1e9:.1f}", flush=True)  # a run cut short still leaves its numbers
    for _ in range(0 if args.graph else args.rounds):
        for variant in args.variants:
            changes = use_variant(variant)
            for shape, (q, k, v, dout, flops) in inputs.items():
                if args.direction == "fwd":
                    with torch.no_grad(), tuning.use(**changes):
                        ms = do_bench(lambda: flashgen.flash_attn_func(q, k, v, causal=shape[2], dropout_p=args.dropout),
                                      warmup=30, rep=150, return_mode="median")
                else:
                    with tuning.use(**changes):  # its backward plans with its forward's tuning
                        out = flashgen.flash_attn_func(q, k, v, causal=shape[2], dropout_p=args.dropout,
                                                       deterministic=variant_deterministic(variant, args.deterministic))
                    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                  warmup=30, rep=150, return_mode="median")
                results.setdefault((variant, shape), []).append(flops / ms / 1e9)
    use_variant("default")
    print(f"{torch.cuda.get_device_name()}: sm90 {'backward' if args.direction == 'bwd' else 'forward'} TFLOP/s (median of {args.rounds} rounds), gqa {args.gqa}, "
          f"deterministic={args.deterministic}" + (f", dropout {args.dropout}" if args.dropout else ""))
    widths = [max(12, len(v) + 2) for v in args.variants]  # long variant names keep a space between them
    print(f"{'shape':<18}" + "".join(f"{v:>{w}}" for v, w in zip(args.variants, widths)))
    for shape in inputs:
        head_dim, seqlen, causal = shape
        label = f"d{head_dim} s{seqlen}{' causal' if causal else ''}"
        print(f"{label:<18}" + "".join(f"{statistics.median(results[(v, shape)]):>{w}.1f}"
                                       for v, w in zip(args.variants, widths)))
    base = args.variants[0]
    for variant in args.variants[1:]:
        ratios = [statistics.median(results[(variant, shape)]) / statistics.median(results[(base, shape)])
                  for shape in inputs]
        print(f"{variant} / {base}: geomean {statistics.geometric_mean(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
