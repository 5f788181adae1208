"""The backward pass against its peers, in one process: flashgen (deterministic or not),
FlashAttention-4 (flash_attn.cute, when importable; deterministic or not), cuDNN and
FlashAttention-2 through PyTorch's SDPA.

TFLOP/s of the backward alone (FlashAttention's count: 2.5 x the forward's 4·b·h·sq·sk·d, halved
when causal), bf16, batch x seqlen = 16k tokens, hidden 2048 (nheads = 2048 / d; GQA g: nheads / g
KV heads). Each backward runs through one untimed forward; medians of do_bench. --graph times
replays of a CUDA graph of each backward instead: the kernels alone, without the host path (at 1k
tokens an eager backward's host time is about its GPU time).

    python benchmarks/bench_bwd_peers.py [--head-dims 64,128] [--seqlens 1024,4096,16384] \
        [--gqa 1,4] [--impls flashgen,flashgen-det,flashgen-sm80,fa4,fa4-det,cudnn,fa2] [--graph] [--out results.json]
"""
import argparse
import contextlib
import itertools
import json
import math
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import flashgen

TOKENS, HIDDEN = 16384, 2048


def _flashgen(deterministic):
    return lambda q, k, v, causal: flashgen.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)


def _flashgen_family(family):
    """flashgen with FLASHGEN_FAMILY set while it runs (sm80: the sm80 backward on Hopper too)."""
    call = _flashgen(False)
    call.env = {"FLASHGEN_FAMILY": family}
    return call


@contextlib.contextmanager
def _environment(env):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fa4(deterministic):
    from flash_attn.cute import flash_attn_func as fa4_func

    return lambda q, k, v, causal: fa4_func(q, k, v, causal=causal, deterministic=deterministic)[0]


def _sdpa(backend_name):
    """SDPA on one backend, on flash_attn's (batch, seqlen, heads, d) layout; extra keywords
    (dropout_p) go to scaled_dot_product_attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v, causal, **kwargs):
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, **gqa, **kwargs).transpose(1, 2)

    return call


def available(names: str, table: dict) -> tuple[dict, dict]:
    """The implementations named (comma-separated) that load, and {name: why} of those that do
    not (printed, and left out)."""
    impls, missing = {}, {}
    for name in names.split(","):
        try:
            impls[name] = table[name]()
        except Exception as exc:  # a peer that is not installed is left out, with the reason
            missing[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} not run: {missing[name]}")
    return impls, missing


IMPLS = {
    "flashgen": lambda: _flashgen(False),
    "flashgen-det": lambda: _flashgen(True),
    "flashgen-sm80": lambda: _flashgen_family("sm80"),
    "fa4": lambda: _fa4(False),
    "fa4-det": lambda: _fa4(True),
    "cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "fa2": lambda: _sdpa("FLASH_ATTENTION"),
}


def backward_ms(forward, q, k, v, dout, causal, graph=False) -> float:
    with _environment(getattr(forward, "env", {})):
        if not graph:
            out = forward(q, k, v, causal)
            return do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                            warmup=30, rep=150, return_mode="median")
        # Autograd runs a backward on its forward's stream: both on the capture stream, the forward
        # (and warm-up backwards, which compile and fill the allocator) outside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = forward(q, k, v, causal)
            for _ in range(3):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured, stream=stream):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return do_bench(captured.replay, warmup=30, rep=150, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--gqa", default="1,4")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernels only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    impls, missing = available(args.impls, IMPLS)
    rows = []
    names = list(impls)
    print(f"{torch.cuda.get_device_name()}: backward TFLOP/s, bf16, 16k tokens, hidden 2048"
          + (", CUDA-graph replays" if args.graph else ", eager"))
    print(f"{'shape':<22}" + "".join(f"{n:>14}" for n in names), flush=True)
    for head_dim, seqlen, gqa, causal in itertools.product(
            (int(d) for d in args.head_dims.split(",")), (int(s) for s in args.seqlens.split(",")),
            (int(g) for g in args.gqa.split(",")), (False, True)):
        batch, nheads = TOKENS // seqlen, HIDDEN // head_dim
        if nheads % gqa:
            continue
        shape = dict(head_dim=head_dim, seqlen=seqlen, gqa=gqa, causal=causal, batch=batch, nheads=nheads)
        gen = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(batch, seqlen, nheads // gqa, head_dim, device="cuda", dtype=torch.bfloat16,
                            generator=gen) for _ in range(2))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(q)
        flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        tflops = {}
        for name, forward in impls.items():
            try:
                tflops[name] = flops / backward_ms(forward, q, k, v, dout, causal, args.graph) / 1e9
            except Exception as exc:  # a config the peer does not take: reported, never faked
                tflops[name] = None
                print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        rows.append({**shape, "tflops": tflops})
        label = f"d{head_dim} s{seqlen}{f' gqa{gqa}' if gqa > 1 else ''}{' causal' if causal else ''}"
        print(f"{label:<22}" + "".join(f"{t:>14.1f}" if t else f"{'-':>14}" for t in tflops.values()), flush=True)
    summary = {}
    for name in names:
        for peer in names:
            ratios = [r["tflops"][name] / r["tflops"][peer] for r in rows if r["tflops"][name] and r["tflops"][peer]]
            if name != peer and ratios:
                summary[f"{name}/{peer}"] = {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                                             "min": min(ratios), "shapes": len(ratios)}
    for key in ("flashgen/fa4", "flashgen/cudnn", "flashgen/flashgen-sm80", "flashgen-det/flashgen",
                "flashgen-det/fa4-det"):
        if key in summary:
            s = summary[key]
            print(f"{key}: geomean {s['geomean']:.3f}, min {s['min']:.3f} over {s['shapes']} shapes")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "graph": args.graph, "rows": rows,
                       "summary": summary, "missing": missing}, f, indent=1)


if __name__ == "__main__":
    main()
