"""Forward TFLOP/s of flashgen next to PyTorch SDPA's FlashAttention-2 and cuDNN backends.

All in one process on one GPU, with the ceilings measured in the same run: a dense matmul
(8192^3) and a device-to-device copy.  Shapes follow FlashAttention's benchmark: batch * seqlen =
16384 tokens, hidden 2048 (nheads = 2048 / d), MHA, with and without causal.  FLOPs use
flashgen.testing.attention_flops (FlashAttention's convention: causal counts half).

Before timing, flashgen's output is checked once per config against SDPA's (so a broken kernel is
not reported at a great speed); a config that fails is not timed and the script exits with 1.
A peer that is unavailable or refuses a config is reported as skipped, with the reason.

    python benchmarks/bench_fwd.py [--dtype bf16|fp16] [--seqlens 4096 8192] [--head-dims 64 128 256]
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.testing import attention_flops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Elementwise |flashgen - SDPA| <= ATOL + RTOL * |SDPA|: two correct bf16 kernels differ by a few
# output ulps (bf16's is 2^-8 relative), while a wrong row or block is off by the output's own size.
CHECK_ATOL, CHECK_RTOL = 2e-3, 2e-2


def make_timer():
    """(median milliseconds of fn(), description of the method)."""
    try:
        from triton.testing import do_bench
    except ImportError as exc:
        return cuda_event_median_ms, f"CUDA events, median of 50 runs after 10 warm-up runs (no triton: {exc})"
    return (
        lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median"),
        "triton.testing.do_bench, median, L2 cleared between runs",
    )


def cuda_event_median_ms(fn, warmup: int = 10, runs: int = 50) -> float:
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def nvidia_smi() -> str:
    query = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"
    return result.stdout.strip()


def measure_ceilings(bench, dtype) -> dict:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    matmul_ms = bench(lambda: a @ b)
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB: far beyond L2
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    return {
        "matmul_shape": [n, n, n],
        "matmul_tflops": 2 * n**3 / matmul_ms / 1e9,
        "copy_bytes": src.nbytes,
        "copy_tbps": 2 * src.nbytes / copy_ms / 1e9,  # bytes read + written
    }


def flashgen_call(q, k, v, causal):
    return lambda: flashgen.flash_attn_func(q, k, v, causal=causal)


def sdpa_call(backend):
    def make(q, k, v, causal):
        # SDPA takes (batch, nheads, seqlen, d): transposed views, no copies.
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return call

    return make


IMPLS = {
    "flashgen": flashgen_call,
    "fa2": sdpa_call(SDPBackend.FLASH_ATTENTION),
    "cudnn": sdpa_call(SDPBackend.CUDNN_ATTENTION),
}


def first_line(message) -> str:
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def time_impl(make, q, k, v, causal, flops, bench) -> dict:
    """{"ms", "tflops"}, or {"skipped": reason} when the implementation refuses or fails."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # SDPA explains a refused backend in warnings
        try:
            call = make(q, k, v, causal)
            call()
            torch.cuda.synchronize()
        except Exception as exc:  # any failure of a peer is a skip with its reason, never a number
            reasons = [f"{type(exc).__name__}: {first_line(exc)}"] + [first_line(w.message) for w in caught]
            return {"skipped": "; ".join(dict.fromkeys(reasons))}
    ms = bench(call)
    return {"ms": ms, "tflops": flops / ms / 1e9}


def check_against_sdpa(q, k, v, causal) -> dict:
    """flashgen's output next to SDPA's default choice (seqlen_q == seqlen_k, so causal alignment agrees)."""
    out = flashgen.flash_attn_func(q, k, v, causal=causal).float()
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    ref = ref.transpose(1, 2).float()
    excess = (out - ref).abs() - (CHECK_ATOL + CHECK_RTOL * ref.abs())
    finite = bool(torch.isfinite(out).all())
    worst = tuple(int(i) for i in torch.unravel_index(excess.nan_to_num(float("inf")).argmax(), excess.shape))
    return {
        "ok": finite and excess.max().item() <= 0,
        "finite": finite,
        "max_abs_err": (out - ref).abs().max().item(),
        "worst_index": worst,
        "worst_values": [out[worst].item(), ref[worst].item()],
    }


def bench_config(dtype, seqlen, head_dim, causal, args, bench) -> dict:
    batch, nheads = args.tokens // seqlen, args.hidden // head_dim
    config = {"dtype": args.dtype, "batch": batch, "seqlen": seqlen, "nheads": nheads, "head_dim": head_dim, "causal": causal}
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    flops = attention_flops(batch, nheads, seqlen, seqlen, head_dim, causal)
    result = {"config": config, "flops": flops, "check": None}
    if not args.no_check:
        try:
            result["check"] = check_against_sdpa(q, k, v, causal)
        except Exception as exc:
            result["check"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    for name, make in IMPLS.items():
        if name == "flashgen" and result["check"] is not None and not result["check"]["ok"]:
            result[name] = {"skipped": f"output check against SDPA failed: {result['check']}"}
        else:
            result[name] = time_impl(make, q, k, v, causal, flops, bench)
    return result


def fmt_tflops(entry: dict) -> str:
    return f"{entry['tflops']:.1f}" if "tflops" in entry else "skip"


def fmt_ratio(a: dict, b: dict | float) -> str:
    b_tflops = b if isinstance(b, float) else b.get("tflops")
    return f"{a['tflops'] / b_tflops:.2f}" if "tflops" in a and b_tflops else "-"


def print_table(results: list[dict], ceilings: dict) -> None:
    header = f"{'config':<34} {'check':>5} {'flashgen':>9} {'FA2':>7} {'cuDNN':>7} {'fg/FA2':>7} {'fg/cuDNN':>8} {'fg/matmul':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        c = r["config"]
        name = f"{c['dtype']} d{c['head_dim']} s{c['seqlen']} b{c['batch']} h{c['nheads']}{' causal' if c['causal'] else ''}"
        check = "-" if r["check"] is None else ("ok" if r["check"]["ok"] else "FAIL")
        fg = r["flashgen"]
        print(
            f"{name:<34} {check:>5} {fmt_tflops(fg):>9} {fmt_tflops(r['fa2']):>7} {fmt_tflops(r['cudnn']):>7} "
            f"{fmt_ratio(fg, r['fa2']):>7} {fmt_ratio(fg, r['cudnn']):>8} {fmt_ratio(fg, ceilings['matmul_tflops']):>9}"
        )
    skips = [(r["config"], name, r[name]["skipped"]) for r in results for name in IMPLS if "skipped" in r[name]]
    for c, name, reason in skips:
        print(f"skipped {name} at d{c['head_dim']} s{c['seqlen']}{' causal' if c['causal'] else ''}: {reason}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim (default 2048)")
    parser.add_argument("--no-check", action="store_true", help="skip the output check against SDPA")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default benchmarks/results/fwd_<gpu>_<date>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")

    dtype = DTYPES[args.dtype]
    bench, timer = make_timer()
    gpu = torch.cuda.get_device_name()
    smi_before = nvidia_smi()
    print(f"{gpu} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, flashgen {flashgen.__version__}")
    print(f"nvidia-smi:\n{smi_before}")
    print(f"timing: {timer}")
    ceilings = measure_ceilings(bench, dtype)
    print(f"ceilings: {args.dtype} matmul 8192^3 {ceilings['matmul_tflops']:.1f} TFLOP/s, "
          f"device copy {ceilings['copy_tbps']:.2f} TB/s (read + write)\n")

    results = [
        bench_config(dtype, seqlen, head_dim, causal, args, bench)
        for seqlen in args.seqlens
        for head_dim in args.head_dims
        for causal in (False, True)
    ]
    print_table(results, ceilings)
    smi_after = nvidia_smi()
    print(f"nvidia-smi after:\n{smi_after}")

    out = args.out or RESULTS_DIR / (
        f"fwd_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}_{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": gpu, "capability": list(torch.cuda.get_device_capability()), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "flashgen": flashgen.__version__,
        "timer": timer, "nvidia_smi_before": smi_before, "nvidia_smi_after": smi_after,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
    }
    out.write_text(json.dumps({"meta": meta, "ceilings": ceilings, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if any(r["check"] is not None and not r["check"]["ok"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
