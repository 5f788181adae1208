"""Split-KV and KV-cache chunked prefill on the sm90 forward against the sm80 family and cuDNN SDPA,
in one process (H200). Results: benchmarks/results/20261130-nvidia-h200-sm90-split/.

Run on the device: `python benchmarks/bench_sm90_split.py`. Times are triton do_bench medians (us).
SDPA's is_causal is top-left aligned, so its causal times are not comparable with flashgen's
(bottom-right, flash_attn's rule) when seqlen_q < seqlen_k.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashgen
from flashgen.runtime.device import device_info
from flashgen.runtime.dispatch import plan_fwd

DTYPE = torch.bfloat16
HEAD_DIM = 128
# (batch, seqlen_q, seqlen_k, causal): few tiles and long keys, where split-KV fills the GPU.
LONG_KEYS = [(1, 512, 32768, False), (1, 1024, 131072, False), (1, 256, 65536, False), (2, 2048, 32768, True),
             (1, 128, 16384, False)]
# (batch, seqlen_q, cache length): chunked prefill against a contiguous cache, 32 query / 8 KV heads.
CHUNKED_PREFILL = [(1, 512, 32768), (1, 128, 32768), (4, 256, 8192), (1, 2048, 131072)]


def microseconds(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def with_family(family: str | None, fn) -> float:
    """fn timed with FLASHGEN_FAMILY forced to `family` (None: the automatic choice)."""
    if family is None:
        os.environ.pop("FLASHGEN_FAMILY", None)
    else:
        os.environ["FLASHGEN_FAMILY"] = family
    try:
        return microseconds(fn)
    finally:
        os.environ.pop("FLASHGEN_FAMILY", None)


def long_keys(nheads: int = 16) -> None:
    print(f"== flash_attn_func, long keys ({DTYPE}, d{HEAD_DIM}, {nheads} heads): us / TFLOP/s")
    for batch, seqlen_q, seqlen_k, causal in LONG_KEYS:
        q = torch.randn(batch, seqlen_q, nheads, HEAD_DIM, dtype=DTYPE, device="cuda")
        k, v = (torch.randn(batch, seqlen_k, nheads, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in range(2))
        flops = 4 * batch * nheads * seqlen_q * seqlen_k * HEAD_DIM * (0.5 if causal else 1)
        times = {
            name: with_family(family, functools.partial(flashgen.flash_attn_func, q, k, v, causal=causal,
                                                    num_splits=splits))
            for name, family, splits in [("sm90_nosplit", None, 1), ("sm90_split0", None, 0), ("sm80_split0", "sm80", 0)]
        }
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            times["cudnn"] = microseconds(
                functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=causal))
        unsplit = flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=1)
        split = flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=0)
        plan = plan_fwd(dtype=DTYPE, head_dim=HEAD_DIM, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                        nheads=nheads, nheads_k=nheads, causal=causal, window_size=(-1, -1), softcap=0.0,
                        pack_gqa=None, device=device_info(0), num_splits=0, sm90=True)
        split_us = times["sm90_split0"]
        print(f"b{batch} sq{seqlen_q} sk{seqlen_k}{' causal' if causal else ''} splits={plan.num_splits} "
              + " ".join(f"{name} {us:.1f}us/{flops / us / 1e6:.0f}" for name, us in times.items())
              + f" | split0/nosplit {times['sm90_nosplit'] / split_us:.2f}x, vs sm80 {times['sm80_split0'] / split_us:.2f}x,"
              f" vs cudnn {times['cudnn'] / split_us:.2f}x;"
              f" max|split-nosplit| {(unsplit.float() - split.float()).abs().max().item():.2e}")


def chunked_prefill(nheads: int = 32, nheads_k: int = 8) -> None:
    print(f"== flash_attn_with_kvcache chunked prefill ({DTYPE}, d{HEAD_DIM}, {nheads}/{nheads_k} heads, causal,"
          " contiguous cache): us")
    for batch, seqlen_q, length in CHUNKED_PREFILL:
        q = torch.randn(batch, seqlen_q, nheads, HEAD_DIM, dtype=DTYPE, device="cuda")
        k_cache, v_cache = (torch.randn(batch, length, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
                            for _ in range(2))
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        times = {
            name: with_family(family, functools.partial(
                flashgen.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens, causal=True))
            for name, family in [("sm90", None), ("sm80", "sm80")]
        }
        kv_bytes = batch * length * nheads_k * HEAD_DIM * 2 * 2
        print(f"b{batch} sq{seqlen_q} L{length} " + " ".join(f"{name} {us:.1f}" for name, us in times.items())
              + f" | sm90 vs sm80 {times['sm80'] / times['sm90']:.2f}x,"
              f" K+V TB/s sm90 {kv_bytes / times['sm90'] / 1e6:.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    long_keys()
    chunked_prefill()
