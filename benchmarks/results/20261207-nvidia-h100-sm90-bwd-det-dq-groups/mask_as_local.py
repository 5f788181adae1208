"""Issue 34's plan, priced: causal and no-mask calls on the local instances (window_size past every
key), against their own instances; forward and backward kernels from CUDA-graph replays, bf16, 16k
tokens, hidden 2048. Run as it was: PYTHONPATH=<checkout> python mask_as_local.py"""
import statistics

import torch

import flashgen
from flashgen.runtime import backward
def graph_ms(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(5): g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev: a.record(); g.replay(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)
print("mask A/B: causal vs local(h, 0); none vs local(h, h); fwd and bwd, graph ms")
for d in (64, 128, 256):
    for s in (1024, 4096):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q); hz = 2 * s
        row = []
        for causal, win in ((True, (-1, -1)), (False, (hz, 0)), (False, (-1, -1)), (False, (hz, hz))):
            with torch.no_grad():
                out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=win, return_attn_probs=True)
            fwd = graph_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal, window_size=win))
            grads = [torch.empty_like(x) for x in (q, k, v)]
            bwd = graph_ms(lambda: backward.flash_bwd(dout, q, k, v, out, lse, *grads, softmax_scale=d ** -0.5, causal=causal,
                           window_size=win, softcap=0.0, alibi_slopes=None, deterministic=False))
            row += [fwd, bwd]
        print(f"d{d} s{s}: causal fwd {row[0]:.3f} local {row[2]:.3f} ({row[0]/row[2]:.3f}x) | bwd {row[1]:.3f} local {row[3]:.3f} ({row[1]/row[3]:.3f}x)"
              f" || none fwd {row[4]:.3f} local {row[6]:.3f} ({row[4]/row[6]:.3f}x) | bwd {row[5]:.3f} local {row[7]:.3f} ({row[5]/row[7]:.3f}x)", flush=True)
