"""Decode attention: flashgen.flash_attn_with_kvcache next to PyTorch SDPA's cuDNN backend.

One query token, 32 query / 8 KV heads, d128, bf16 (the KV-cache issue's shapes): batch 1 at 8k,
32k and 128k keys, batch 32 at 4k, batch 128 at 2k.  flashgen reads the contiguous cache and paged
copies of it (page sizes 16 and 256, pages in random order); cuDNN reads the same keys in its own
(batch, heads, seqlen, d) layout, with enable_gqa when this torch's cuDNN path takes it, otherwise
with K/V heads repeated outside the timed region (then it reads 4x the bytes; TB/s still counts
the unique bytes).

All in one process, with the device-copy ceiling (1 GiB, bytes read + written) measured in the
same run.  Two timings per implementation and shape, both medians of triton.testing.do_bench:
* graph: one CUDA graph of --calls-per-graph calls, replayed; time / calls (no launch overhead);
* eager: single calls, launch and Python overhead included.
Calls cycle through distinct cache sets, at least --rotate-mb in all, so that no call finds its
K/V in the 60 MB L2 from an earlier one.  TB/s = K+V bytes of the valid keys / time.

Before timing, each flashgen variant's output is checked once per shape against cuDNN's; a variant
that fails is not timed and the script exits with 1.

    python benchmarks/bench_decode.py [--shapes b1-s8k b128-s2k] [--num-splits 0] [--out decode.json]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from bench_fwd import first_line, nvidia_smi
from flashgen.testing import attention_ref
from flashgen.testing_kvcache import paged_kv_from_contiguous, random_block_table

SHAPES = {  # name -> (batch, keys)
    "b1-s8k": (1, 8192),
    "b1-s32k": (1, 32768),
    "b1-s128k": (1, 131072),
    "b32-s4k": (32, 4096),
    "b128-s2k": (128, 2048),
}
NHEADS, NHEADS_K, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
# |flashgen - cuDNN| <= CHECK_REL * max |cuDNN|: a few bf16 ulps of the largest output, while a
# kernel that reads wrong keys is off by the outputs' own size.
CHECK_REL = 2**-6


def copy_ceiling_tbps(bench) -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB: far beyond L2
    dst = torch.empty_like(src)
    return 2 * src.nbytes / bench(lambda: dst.copy_(src)) / 1e9


def make_sets(batch: int, seqlen: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    """(q, k_cache, v_cache) in flash_attn's layout: q (b, 1, h, d), caches (b, seqlen, h_k, d)."""
    return [
        (
            torch.randn(batch, 1, NHEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
            torch.randn(batch, seqlen, NHEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE),
            torch.randn(batch, seqlen, NHEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE),
        )
        for _ in range(count)
    ]


def cudnn_calls(sets):
    """(calls, note): cuDNN SDPA over contiguous (b, h, s, d) copies of each set; out is (b, 1, h, d)."""
    layouts = [tuple(x.transpose(1, 2).contiguous() for x in s) for s in sets]

    def call(q, k, v, **kwargs):
        return F.scaled_dot_product_attention(q, k, v, **kwargs).transpose(1, 2)

    try:
        call(*layouts[0], enable_gqa=True)
        return [functools.partial(call, *s, enable_gqa=True) for s in layouts], "enable_gqa"
    except (RuntimeError, TypeError) as exc:
        groups = NHEADS // NHEADS_K
        expanded = [(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) for q, k, v in layouts]
        return [functools.partial(call, *s) for s in expanded], f"K/V heads repeated (enable_gqa: {first_line(exc)})"


def flashgen_calls(sets, page_size: int | None, num_splits: int):
    calls = []
    for q, k, v in sets:
        batch, seqlen = k.shape[:2]
        seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        kwargs = dict(cache_seqlens=seqlens, num_splits=num_splits)
        if page_size is not None:
            max_pages = -(-seqlen // page_size)
            table = random_block_table(batch, max_pages, batch * max_pages, device="cuda")
            k, v = (paged_kv_from_contiguous(x, table, batch * max_pages, page_size) for x in (k, v))
            kwargs["block_table"] = table
        calls.append(functools.partial(flashgen.flash_attn_with_kvcache, q, k, v, **kwargs))
    return calls, "contiguous" if page_size is None else f"page size {page_size}"


def check(out: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    finite = bool(torch.isfinite(out).all())
    return {"ok": finite and err <= CHECK_REL * scale, "finite": finite, "max_abs_err": err, "max_abs_ref": scale}


def time_graph(calls, calls_per_graph: int, bench) -> float:
    """Microseconds per call, from replays of one graph of calls_per_graph calls cycling the sets."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture: first calls compile and plan
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            calls[i % len(calls)]()
    return bench(graph.replay) * 1e3 / calls_per_graph


def time_eager(calls, bench) -> float:
    cycle = itertools.cycle(calls)
    return bench(lambda: next(cycle)()) * 1e3


def bench_shape(name: str, args, bench, ceiling: float) -> list[dict]:
    batch, seqlen = SHAPES[name]
    kv_bytes = 2 * batch * seqlen * NHEADS_K * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    sets = make_sets(batch, seqlen, max(2, math.ceil(args.rotate_mb * 2**20 / kv_bytes)))
    impls = {"cudnn": cudnn_calls}
    for page_size in [None, *args.page_sizes]:
        name = "flashgen" if page_size is None else f"flashgen-paged{page_size}"
        impls[name] = functools.partial(flashgen_calls, page_size=page_size, num_splits=args.num_splits)
    ref, rows = None, []
    for impl, make in impls.items():
        row = {"shape": name, "batch": batch, "seqlen_k": seqlen, "kv_bytes": kv_bytes, "sets": len(sets), "impl": impl}
        rows.append(row)
        try:
            calls, row["note"] = make(sets)
            out = calls[0]()
            torch.cuda.synchronize()
        except Exception as exc:  # a refused or broken implementation is a skip with its reason, never a number
            row["skipped"] = f"{type(exc).__name__}: {first_line(exc)}"
            continue
        if impl == "cudnn":
            ref = out
        else:
            row["check"] = check(out, ref if ref is not None else attention_ref(*sets[0])[0])
            if not row["check"]["ok"]:
                row["skipped"] = f"output check failed: {row['check']}"
                continue
        timers = {
            "graph": functools.partial(time_graph, calls, args.calls_per_graph, bench),
            "eager": functools.partial(time_eager, calls, bench),
        }
        for mode, timer in timers.items():
            try:
                us = timer()
            except Exception as exc:  # e.g. a call that synchronizes, which graph capture forbids
                row[f"{mode}_skipped"] = f"{type(exc).__name__}: {first_line(exc)}"
                continue
            row[f"{mode}_us"] = us
            row[f"{mode}_tbps"] = kv_bytes / us / 1e6
            row[f"{mode}_of_copy"] = row[f"{mode}_tbps"] / ceiling
        del calls, out, timers  # free this variant's copies before the next one makes its own
    torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    """speed/cuDNN = cuDNN's time / this time (> 1: faster than cuDNN), per timing mode."""
    header = (f"{'shape':<10} {'impl':<18} {'check':>5} {'graph us':>9} {'TB/s':>6} {'of copy':>7} {'speed/cuDNN':>11} "
              f"{'eager us':>9} {'speed/cuDNN':>11}")
    print(header)
    print("-" * len(header))
    cudnn = {r["shape"]: r for r in rows if r["impl"] == "cudnn"}

    def fmt(row, key, spec):
        return format(row[key], spec) if key in row else "-"

    def speed(row, mode):
        key = f"{mode}_us"
        return f"{cudnn[row['shape']][key] / row[key]:.2f}" if key in row and key in cudnn[row["shape"]] else "-"

    for r in rows:
        if "skipped" in r:
            print(f"{r['shape']:<10} {r['impl']:<18} skipped: {r['skipped']}")
            continue
        check = "ok" if "check" in r else "ref"
        print(f"{r['shape']:<10} {r['impl']:<18} {check:>5} {fmt(r, 'graph_us', '.1f'):>9} "
              f"{fmt(r, 'graph_tbps', '.2f'):>6} {fmt(r, 'graph_of_copy', '.0%'):>7} {speed(r, 'graph'):>11} "
              f"{fmt(r, 'eager_us', '.1f'):>9} {speed(r, 'eager'):>11}")
    for r in rows:
        for mode in ("graph", "eager"):
            if f"{mode}_skipped" in r:
                print(f"{r['impl']} at {r['shape']}, {mode} timing skipped: {r[f'{mode}_skipped']}")
        if r["impl"] == "cudnn" and "note" in r:
            print(f"cuDNN at {r['shape']}: {r['note']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--page-sizes", type=int, nargs="*", default=[16, 256])
    parser.add_argument("--num-splits", type=int, default=0, help="flashgen's num_splits (default 0: heuristic)")
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--rotate-mb", type=float, default=256.0,
                        help="distinct K/V cycled through per shape, in MiB (default 256: 4x the H200's L2)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        from triton.testing import do_bench
    except ImportError as exc:
        parser.error(f"needs triton for triton.testing.do_bench: {exc}")
    bench = functools.partial(do_bench, warmup=25, rep=100, return_mode="median")

    gpu = torch.cuda.get_device_name()
    smi_before = nvidia_smi()
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"flashgen {flashgen.__version__}")
    print(f"nvidia-smi:\n{smi_before}")
    ceiling = copy_ceiling_tbps(bench)
    print(f"device copy ceiling: {ceiling:.2f} TB/s (read + write)")
    print(f"decode: 1 query token, {NHEADS}/{NHEADS_K} heads, d{HEAD_DIM}, bf16, "
          f"flashgen num_splits={args.num_splits}; graphs of {args.calls_per_graph} calls\n")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # SDPA may use cuDNN only; flashgen is unaffected
        rows = [row for name in args.shapes for row in bench_shape(name, args, bench, ceiling)]
    print_table(rows)
    smi_after = nvidia_smi()
    print(f"nvidia-smi after:\n{smi_after}")
    if args.out:
        meta = {
            "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "flashgen": flashgen.__version__, "timer": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms)",
            "nheads": NHEADS, "nheads_k": NHEADS_K, "head_dim": HEAD_DIM, "dtype": "bf16",
            "num_splits": args.num_splits, "calls_per_graph": args.calls_per_graph, "rotate_mb": args.rotate_mb,
            "nvidia_smi_before": smi_before, "nvidia_smi_after": smi_after,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "copy_ceiling_tbps": ceiling, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(not r.get("check", {"ok": True})["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
