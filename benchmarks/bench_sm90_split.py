"""Split-KV and KV-cache chunked prefill on the sm90 forward vs the sm80 family and cuDNN SDPA, same process (H200).

Run on the device: `python benchmarks/bench_sm90_split.py`. Times are triton do_bench medians (us)."""
import os, sys
import torch
from triton.testing import do_bench
import flashgen
from flashgen.runtime.dispatch import plan_fwd

torch.manual_seed(0)
dt = torch.bfloat16
def t(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us

def fam(f):
    if f is None: os.environ.pop("FLASHGEN_FAMILY", None)
    else: os.environ["FLASHGEN_FAMILY"] = f

print("== flash_attn_func long keys (bf16 d128 MHA h16, non-causal unless noted): us; TFLOP/s")
for b, sq, sk, causal in [(1, 512, 32768, False), (1, 1024, 131072, False), (1, 256, 65536, False), (2, 2048, 32768, True), (1, 128, 16384, False)]:
    h = 16
    q = torch.randn(b, sq, h, 128, dtype=dt, device="cuda"); k = torch.randn(b, sk, h, 128, dtype=dt, device="cuda"); v = torch.randn_like(k)
    flops = 4 * b * h * sq * sk * 128 * (0.5 if causal else 1)
    res = {}
    for name, f, ns in [("sm90_nosplit", None, 1), ("sm90_split0", None, 0), ("sm80_split0", "sm80", 0)]:
        fam(f); res[name] = t(lambda: flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=ns))
    fam(None)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn"] = t(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    o1 = flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=1); o0 = flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=0)
    from flashgen.runtime.device import device_info
    p = plan_fwd(dtype="bf16", head_dim=128, batch=b, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=h, causal=causal, window_size=(-1, -1), softcap=0.0, pack_gqa=None, device=device_info(0), num_splits=0, sm90=True)
    print(f"b{b} sq{sq} sk{sk}{' causal' if causal else ''} splits={p.num_splits} " + " ".join(f"{n} {us:.1f}us/{flops/us/1e6:.0f}" for n, us in res.items())
          + f" | split0/nosplit {res['sm90_nosplit']/res['sm90_split0']:.2f}x, vs sm80 {res['sm80_split0']/res['sm90_split0']:.2f}x, vs cudnn {res['cudnn']/res['sm90_split0']:.2f}x; max|split-nosplit| {(o1.float()-o0.float()).abs().max().item():.2e}")

print("== flash_attn_with_kvcache chunked prefill (bf16 d128, 32/8 heads, causal, contiguous cache): us")
for b, sq, L in [(1, 512, 32768), (1, 128, 32768), (4, 256, 8192), (1, 2048, 131072)]:
    q = torch.randn(b, sq, 32, 128, dtype=dt, device="cuda")
    kc = torch.randn(b, L, 8, 128, dtype=dt, device="cuda"); vc = torch.randn_like(kc)
    seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    res = {}
    for name, f in [("sm90", None), ("sm80", "sm80")]:
        fam(f); res[name] = t(lambda: flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True))
    fam(None)
    print(f"b{b} sq{sq} L{L} " + " ".join(f"{n} {us:.1f}" for n, us in res.items()) + f" | sm90 vs sm80 {res['sm80']/res['sm90']:.2f}x, K+V TB/s sm90 {b*L*8*128*2*2/res['sm90']/1e6:.2f}")
