"""Where a CTA of the sm90 backward spends its time: the timeline variant
(-DFLASHGEN_BWD_SM90_MEASURE_TIMELINE=1) stamps each CTA's phases with the global timer; this
reads them back after one backward call and prints, per shape, the mean of each phase, the time
an SM sits between one CTA's end and the next one's start, and the fitted cost of a step.

    python benchmarks/bwd_cta_timeline.py [--head-dims 64,128] [--seqlens 1024,16384] [--causal] \
        [--gqa 1] [--defines NAME=V+NAME=V] [--out timeline.json]

bf16, 16k tokens, hidden 2048 (bench_bwd_peers.py's shapes). The stamps cost a few global stores
per CTA, so the kernel is not the shipped one: compare phases with each other, not the totals with
another implementation's.
"""
import argparse
import itertools
import json
import statistics

import torch

import flashgen
from flashgen.runtime import launch
from tune_bwd_sm90 import use_variant

EVENTS = ("start", "kv_landed", "first_stage", "first_step", "loop_done", "stored", "dq_drained")
SLOTS = 8  # per CTA; slot 7 = steps << 32 | SM
MAX_CTAS = 65536  # FLASHGEN_BWD_TIMELINE_CTAS in bwd_sm90.cuh
SYMBOL = b"flashgen_bwd_timeline"


def _timeline_buffer(kernel: launch.LoadedKernel, symbol: bytes):
    driver = launch._import_driver()
    pointer, size = launch.check(driver.cuLibraryGetGlobal(kernel.library, symbol),
                                 f"finding {symbol.decode()} (is the timeline variant compiled in?)")
    return driver, pointer, size


def read_timeline(kernel: launch.LoadedKernel, symbol: bytes = SYMBOL, slots: int = SLOTS) -> torch.Tensor:
    """The kernel module's timeline buffer, a row of ``slots`` stamps per CTA."""
    driver, pointer, size = _timeline_buffer(kernel, symbol)
    copy = torch.empty(size // 8, dtype=torch.int64, device="cuda")
    launch.check(driver.cuMemcpyDtoD(copy.data_ptr(), pointer, size), "reading the timeline")
    torch.cuda.synchronize()
    return copy.cpu().view(-1, slots)


def clear_timeline(kernel: launch.LoadedKernel, symbol: bytes = SYMBOL) -> None:
    driver, pointer, size = _timeline_buffer(kernel, symbol)
    launch.check(driver.cuMemsetD8(pointer, 0, size), "clearing the timeline")


def summarize(rows: torch.Tensor) -> dict:
    """Mean phase lengths (µs) over the CTAs that ran steps, SM idle gaps, and a step's cost."""
    rows = rows[rows[:, 0] != 0]
    steps = (rows[:, 7] >> 32).to(torch.float64)
    sm = rows[:, 7] & 0xFFFFFFFF
    busy = rows[steps > 0]
    t = busy[:, :7].to(torch.float64) / 1000.0  # µs
    begin = rows[:, 0].min().item()
    end_of_cta = torch.maximum(rows[:, 5], rows[:, 6])
    phases = {
        "kv_landed - start": (t[:, 1] - t[:, 0]).mean().item(),
        "first_stage - kv_landed": (t[:, 2] - t[:, 1]).mean().item(),
        "first_step - first_stage": (t[:, 3] - t[:, 2]).mean().item(),
        "loop_done - first_step": (t[:, 4] - t[:, 3]).mean().item(),
        "stored - loop_done": (t[:, 5] - t[:, 4]).mean().item(),
        "dq_drained - loop_done": (t[:, 6] - t[:, 4]).mean().item(),
        "cta (start to last stamp)": ((torch.maximum(busy[:, 5], busy[:, 6]) - busy[:, 0]).to(torch.float64)
                                      / 1000.0).mean().item(),
    }
    # A step's cost in the steady loop, and what a CTA costs besides its steps.
    loop_steps = steps[steps > 0] - 1
    long_ctas = loop_steps > 0
    per_step = ((t[long_ctas, 4] - t[long_ctas, 3]) / loop_steps[long_ctas]).mean().item()
    # SM idle between one CTA's last stamp and the next CTA's first on the same SM.
    gaps = []
    for s in sm.unique().tolist():
        on_sm = rows[sm == s]
        order = torch.argsort(on_sm[:, 0])
        starts, ends = on_sm[order, 0], end_of_cta[sm == s][order]
        gaps += ((starts[1:] - ends[:-1]).to(torch.float64) / 1000.0).tolist()
    return {
        "ctas": int(rows.shape[0]), "sms": int(sm.unique().numel()), "mean_steps": steps.mean().item(),
        "kernel_span_us": (end_of_cta.max().item() - begin) / 1000.0,
        "phases_us": phases, "step_us": per_step,
        "overhead_us": phases["cta (start to last stamp)"] - per_step * steps[steps > 0].mean().item(),
        "gap_us_median": statistics.median(gaps) if gaps else 0.0,
        "gap_us_mean": statistics.fmean(gaps) if gaps else 0.0,
    }


def loaded_sm90_kernel(direction: str, head_dim: int, causal: bool) -> launch.LoadedKernel:
    """The sm90 kernel of ``direction`` the calls so far loaded for this head dim and mask."""
    kernels = [kernel for spec, kernel in launch._loaded.items()
               if spec.direction == direction and spec.family == "sm90" and spec.head_dim >= head_dim
               and spec.mask == ("causal" if causal else "none")]
    if not kernels:
        raise SystemExit(f"no sm90 {direction} kernel ran for d{head_dim}{' causal' if causal else ''}")
    return kernels[0]


def timeline_args(description: str, head_dims: str) -> argparse.ArgumentParser:
    """The timeline scripts' options: the shape grid, the variant's other defines, the JSON out."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default=head_dims)
    parser.add_argument("--seqlens", default="1024,16384")
    parser.add_argument("--causal", action="store_true", help="causal shapes as well")
    parser.add_argument("--defines", default="", help="other defines of the variant, joined by +")
    parser.add_argument("--out", default=None)
    return parser


def timeline_shapes(args: argparse.Namespace, timeline_define: str):
    """Compile the timeline variant (its define and --defines), then yield (head_dim, seqlen,
    causal, batch, nheads) of the grid: 16k tokens, hidden 2048."""
    use_variant("+".join([timeline_define, *filter(None, args.defines.split("+"))]))
    for head_dim, seqlen, causal in itertools.product(
            (int(d) for d in args.head_dims.split(",")), (int(s) for s in args.seqlens.split(",")),
            (False, True) if args.causal else (False,)):
        yield head_dim, seqlen, causal, 16384 // seqlen, 2048 // head_dim


def finish_timeline(args: argparse.Namespace, results: dict) -> None:
    """Back to the shipped kernels; the results to --out as JSON."""
    use_variant("default")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


def main() -> None:
    parser = timeline_args(__doc__, "64,128")
    parser.add_argument("--gqa", type=int, default=1)
    args = parser.parse_args()
    results = {}
    for head_dim, seqlen, causal, batch, nheads in timeline_shapes(args, "FLASHGEN_BWD_SM90_MEASURE_TIMELINE=1"):
        q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, seqlen, nheads // args.gqa, head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        out = flashgen.flash_attn_func(q, k, v, causal=causal)
        for _ in range(3):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        kernel = loaded_sm90_kernel("bwd", head_dim, causal)
        clear_timeline(kernel)
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        ctas = (seqlen + 127) // 128 * (nheads // args.gqa) * batch
        if ctas > MAX_CTAS:
            raise SystemExit(f"{ctas} CTAs: the timeline holds {MAX_CTAS}")
        label = f"d{head_dim} s{seqlen}{' causal' if causal else ''}"
        results[label] = summary = summarize(read_timeline(kernel))
        print(f"{label}: {summary['ctas']} CTAs on {summary['sms']} SMs, {summary['mean_steps']:.1f} steps, "
              f"span {summary['kernel_span_us']:.0f} µs; a step {summary['step_us']:.2f} µs, a CTA besides its steps "
              f"{summary['overhead_us']:.2f} µs; SM idle between CTAs median {summary['gap_us_median']:.2f} "
              f"mean {summary['gap_us_mean']:.2f} µs")
        for phase, us in summary["phases_us"].items():
            print(f"    {phase:<28} {us:8.2f} µs")
    finish_timeline(args, results)


if __name__ == "__main__":
    main()
