"""The sm90 forward against the sm80 family on the calls the sm90 family newly serves: varlen
(16 ragged sequences of 256..1791 tokens, fixed seed, or 16 of 1024; hidden 2048, bf16,
d64/128/256, MHA and GQA 4:1, causal or not) and few queries per sequence against a long context with GQA (PackGQA's shape).
Each call runs twice in one process, with the default family choice (sm90 on Hopper) and with
FLASHGEN_FAMILY=sm80; triton do_bench medians; max|diff| between the two outputs.

    python benchmarks/varlen_sm90_vs_sm80.py    (an H200; results/20261129-nvidia-h200-sm90-d64-headdims/)
"""
import os, torch, flashgen, math
from triton.testing import do_bench
torch.manual_seed(0)
dev = "cuda"
def tflops(flops, ms): return flops / ms / 1e9
rows = []
for d, h in ((64, 32), (128, 16), (256, 8)):
    for causal in (False, True):
        for g, pattern in ((1, "ragged"), (4, "ragged"), (1, "equal")):
            # ~16k tokens: ragged, or 16 sequences of 1024 (where a persistent schedule balances)
            lens = torch.randint(256, 1792, (16,)).tolist() if pattern == "ragged" else [1024] * 16
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
            tot = int(cu[-1]); hk = h // g
            q = torch.randn(tot, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(tot, hk, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
            flops = sum(4 * h * L * L * d / (2 if causal else 1) for L in lens)
            res = {}
            for fam in ("sm90", "sm80"):
                os.environ["FLASHGEN_FAMILY"] = fam
                f = lambda: flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
                out = f(); torch.cuda.synchronize()
                res[fam] = (tflops(flops, do_bench(f, warmup=25, rep=100)), out)
            err = (res["sm90"][1].float() - res["sm80"][1].float()).abs().max().item()
            print(f"varlen {pattern} bf16 d{d} h{h}/{hk} {'causal' if causal else 'full  '} tokens {tot}: sm90 {res['sm90'][0]:.0f} sm80 {res['sm80'][0]:.0f} TFLOP/s, x{res['sm90'][0]/res['sm80'][0]:.2f}, max|diff| {err:.1e}", flush=True)
# PackGQA: few queries per sequence against a long context (speculative decoding / chunked prefill)
for d, h, hk in ((128, 32, 8), (128, 64, 8)):
    for sq in (16, 64):
        b, sk = 16, 8192
        q = torch.randn(b, sq, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
        flops = 4 * b * h * sq * sk * d
        res = {}
        for fam in ("sm90", "sm80"):
            os.environ["FLASHGEN_FAMILY"] = fam
            f = lambda: flashgen.flash_attn_func(q, k, v, causal=True)
            out = f(); torch.cuda.synchronize()
            ms = do_bench(f, warmup=25, rep=100)
            res[fam] = (ms, out)
        err = (res["sm90"][1].float() - res["sm80"][1].float()).abs().max().item()
        kv_bytes = 2 * b * sk * hk * d * 2
        print(f"gqa bf16 d{d} h{h}/{hk} b{b} sq{sq} sk{sk} causal: sm90 {res['sm90'][0]*1e3:.0f} us ({kv_bytes/res['sm90'][0]/1e9:.2f} TB/s of K+V) sm80 {res['sm80'][0]*1e3:.0f} us, x{res['sm80'][0]/res['sm90'][0]:.2f}, max|diff| {err:.1e}", flush=True)
