"""Profile the host path of one flashgen call (device tool): where do the microseconds go?"""
import cProfile
import pstats
import time

import torch

import flashgen
from flashgen.runtime import interface

q = torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn_like(q)
kc = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.full((1,), 4000, dtype=torch.int32, device="cuda")


def per_call(fn, n=300):
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


cases = {
    "flash_attn_func": lambda: flashgen.flash_attn_func(q, k, v),
    "_fwd direct": lambda: interface._fwd(q, k, v, 128 ** -0.5, False, (-1, -1), 0.0, None, None, 1),
    "kvcache": lambda: flashgen.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=lens),
    "kvcache splits=1": lambda: flashgen.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=lens, num_splits=1),
    "current_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
    "empty x2": lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty((1, 16, 128), dtype=torch.float32, device=q.device)),
}
for name, fn in cases.items():
    print(f"{name:>18}: {per_call(fn):7.1f} us")
for name in ("flash_attn_func", "kvcache"):
    fn = cases[name]
    pr = cProfile.Profile()
    torch.cuda._sleep(400_000_000)
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"==== {name}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
