"""Where an eager backward's host time goes, and why it grows in a process with FlashAttention-4
loaded (at 1k tokens the eager backward is host-bound there: 0.51x FA4 at d128 causal, against
0.83x from graph replays).

    PD=128 python benchmarks/bwd_host_probe.py   # needs flash_attn.cute (../shared/peers/README.md)

One shape (bf16, 16k tokens, hidden 2048, seqlen 1024, causal). For each phase (a clean process,
after `import flash_attn.cute`, after FA4 ran the shape, after gc.freeze, with the gc disabled): the
threads, gc state and object count; the autograd engine's cost on an identity Function; a Python
and a torch.empty_like loop; per call host time (enqueue without a sync) and do_bench of flashgen's
backward (and flashgen with set_materialize_grads(True) as before, and FA4's), the time in _fwd_grads and
in flash_bwd alone. Then torch.profiler kernel times of each backward.
"""

import cProfile
import gc
import os
import pstats
import sys
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench
import flashgen
from flashgen.runtime import backward as fg_backward, validate, interface

_inner = [0.0, 0]
_orig = interface._fwd_grads
_backward_profile = []  # a cProfile.Profile to run _fwd_grads under (on the autograd thread)


def _timed(*a):
    t = time.perf_counter()
    if _backward_profile:
        _backward_profile[0].enable()
        r = _orig(*a)
        _backward_profile[0].disable()
    else:
        r = _orig(*a)
    _inner[0] += time.perf_counter() - t
    _inner[1] += 1
    return r


interface._fwd_grads = _timed

D, S, CAUSAL = int(os.environ.get("PD", 128)), 1024, True
B, H = 16384 // S, 2048 // D
g = torch.Generator("cuda").manual_seed(0)
q, k, v = (
    torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    for _ in range(3)
)
dout = torch.randn_like(q)
flops = 2.5 * 4 * B * H * S * S * D / 2


def host_us(fn, n=40, hold_gpu=False):
    """Host µs to enqueue one of n calls without a sync; ``hold_gpu``: behind a sleep kernel longer
    than the enqueueing, so that a call that waits on the GPU (a sync, a full launch queue) shows."""
    fn()
    torch.cuda.synchronize()
    if hold_gpu:
        torch.cuda._sleep(int(2e9))  # about 1 s at 1.98 GHz
    t = time.perf_counter()
    for _ in range(n):
        fn()
    enq = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return enq


def busy_host_us(fn, n=40):
    return host_us(fn, n, hold_gpu=True)


def py_us(n=20000):
    t = time.perf_counter()
    for i in range(n):
        pair = {"a": i, "b": (i, i)}
        del pair
    return (time.perf_counter() - t) / n * 1e9  # ns


def torch_us(n=2000):
    x = torch.empty(8, device="cuda")
    t = time.perf_counter()
    for _ in range(n):
        torch.empty_like(x)
    return (time.perf_counter() - t) / n * 1e6


def state(tag):
    th = [t.name for t in threading.enumerate()]
    print(
        f"[{tag}] threads={th} switch={sys.getswitchinterval()} gc_thr={gc.get_threshold()} gc_count={gc.get_count()} "
        f"objects={len(gc.get_objects())} gc_enabled={gc.isenabled()} frozen={gc.get_freeze_count()}",
        flush=True,
    )


def measure(tag, impls):
    state(tag)
    print(f"  engine identity grad {engine_us():.0f} us/call", flush=True)
    print(f"  py dict loop {py_us():.0f} ns/iter, torch.empty_like {torch_us():.1f} us", flush=True)
    for name, fwd in impls.items():
        out = fwd()
        grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        hs = [host_us(grad) for _ in range(3)]
        busy = busy_host_us(grad)
        ms = do_bench(grad, warmup=30, rep=150, return_mode="median")
        gcs = gc.get_stats()
        _inner[:] = [0.0, 0]
        host_us(grad)
        if name == "flashgen":
            print(f"  flashgen _fwd_grads {_inner[0] / max(_inner[1], 1) * 1e6:.0f} us/call", flush=True)
        print(
            f"  {name}: host {[round(h) for h in hs]} us/call (GPU held: {busy:.0f}), do_bench {flops / ms / 1e9:.0f} TFLOP/s ({ms * 1e3:.0f} us) gc_collections={[s['collections'] for s in gcs]}",
            flush=True,
        )
    # the body alone
    with torch.no_grad():
        out, lse = flashgen.flash_attn_func(q, k, v, causal=CAUSAL, return_attn_probs=True)[:2]
    window = validate.fwd(q, k, v, 0.0, None, CAUSAL, (-1, -1), 0.0, None, False, False, None, 1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    body = lambda: fg_backward.flash_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        softmax_scale=D**-0.5,
        causal=CAUSAL,
        window_size=tuple(window),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
    )
    print(f"  flash_bwd body host {[round(host_us(body)) for _ in range(3)]} us/call (GPU held: {busy_host_us(body):.0f})", flush=True)
    if tag == "clean":  # where flash_bwd's and the engine's host time goes, with the GPU held
        out = impls["flashgen"]()
        grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for label, fn in (("flash_bwd", body), ("autograd.grad's _fwd_grads", grad)):
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))
            prof = cProfile.Profile()
            if fn is body:
                prof.enable()
            else:
                _backward_profile.append(prof)
            for _ in range(40):
                fn()
            prof.disable()
            _backward_profile.clear()
            torch.cuda.synchronize()
            print(f"  cProfile of 40 {label} calls (GPU held), by own time:", flush=True)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)


class Materialize(interface._EagerAttention):  # the zero lse gradient filled in, as before 2026-12-06
    @staticmethod
    def forward(ctx, *inputs):
        result = interface._EagerAttention.forward(ctx, *inputs)
        ctx.set_materialize_grads(True)
        return result


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


_x = torch.randn(8, device="cuda", requires_grad=True)


def engine_us():
    y = Identity.apply(_x)
    gy = torch.ones_like(y)
    return host_us(lambda: torch.autograd.grad(y, _x, gy, retain_graph=True), n=200)


_window = validate.fwd(q, k, v, 0.0, None, CAUSAL, (-1, -1), 0.0, None, False, False, None, 1)
impls = {
    "flashgen": lambda: flashgen.flash_attn_func(q, k, v, causal=CAUSAL),
    "flashgen-materialize": lambda: Materialize.apply(
        q, k, v, D**-0.5, CAUSAL, *_window, 0.0, None, None, 1, 0.0, False
    )[0],
}
measure("clean", impls)
t = time.perf_counter()
import flash_attn.cute as fa4

print(f"import flash_attn.cute {time.perf_counter() - t:.1f} s")
measure("after import", impls)
impls["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=CAUSAL)[0]
measure("after fa4 run", impls)
gc.collect()
gc.freeze()
measure("after gc.freeze", impls)
gc.disable()
measure("gc disabled", impls)
gc.enable()

# Kernel times of each backward (torch.profiler, 10 calls)

for name, fwd in impls.items():
    if name == "flashgen-materialize":
        continue
    out = fwd()
    grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        grad()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            grad()
        torch.cuda.synchronize()
    print(f"== {name} kernels (us per call)")
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count >= 10:
            total = getattr(e, "device_time_total", None) or e.cuda_time_total
            print(f"   {e.key[:90]:<90} n={e.count} {total / 10:.1f}")
