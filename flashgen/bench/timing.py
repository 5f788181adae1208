"""Timers, the measured ceilings and what the header says about the machine.

Every figure is a median over repeated runs after warm-up.  Kernels that take longer than launch
overhead are timed with ``triton.testing.do_bench`` (it clears L2 between runs) or, without
triton, CUDA events; decode calls with :func:`rotated_us`, which cycles through copies of the
inputs so that no call finds its K/V in L2, eagerly or replayed from a CUDA graph.
"""
from __future__ import annotations

import math
import statistics
import subprocess
import time
from typing import Callable, Sequence

import torch

# Decode calls cycle through at least this many bytes of K/V per round, a multiple of the L2 size
# (60 MB on the H200), so each call reads its keys from HBM as a real decode step would.
ROTATE_L2_MULTIPLE = 4
MAX_COPIES = 64
# A CUDA graph replays at least this many calls, so its own launch is amortised.
MIN_CALLS_PER_GRAPH = 20
ROUND_TARGET_MS = 50.0
MIN_ROUNDS, MAX_ROUNDS = 5, 200
# Calls queued behind a sleeping kernel to time enqueueing alone; far below the launch queue's depth.
ENQUEUE_CALLS = 200


def make_timer() -> tuple[Callable[[Callable[[], object]], float], str]:
    """(median milliseconds of fn(), how it is measured)."""
    try:
        from triton.testing import do_bench
    except ImportError as exc:
        return cuda_event_median_ms, f"CUDA events, median of 50 runs after 10 warm-up runs (no triton: {exc})"
    return (
        lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median"),
        "triton.testing.do_bench (warm-up 25 ms, 100 ms of runs, L2 cleared before each), median",
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


def rotation_copies(bytes_per_copy: int, l2_bytes: int) -> int:
    """How many copies of a decode call's inputs to cycle through so their K/V outgrow L2."""
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_L2_MULTIPLE * l2_bytes / max(bytes_per_copy, 1))))


def rotated_us(calls: Sequence[Callable[[], object]], graph: bool) -> float:
    """Median microseconds per call over rounds of ``calls`` run back to back, each call on its own
    copy of the inputs.  Eager rounds include the host's launch cost whenever the host is slower
    than the GPU, as in a real eager decode loop; graph rounds replay one capture of the calls."""
    calls = list(calls) * (math.ceil(MIN_CALLS_PER_GRAPH / len(calls)) if graph else 1)

    def run_all():
        for call in calls:
            call()

    run = run_all
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
            run_all()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run_all()
        run = cuda_graph.replay
    run()
    torch.cuda.synchronize()
    first = cuda_event_median_ms(run, warmup=1, runs=3)
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(ROUND_TARGET_MS / max(first, 1e-3))))
    return cuda_event_median_ms(run, warmup=2, runs=rounds) * 1e3 / len(calls)


def enqueue_us(fn: Callable[[], object], repeats: int = 5, calls: int = ENQUEUE_CALLS) -> float:
    """Host time to enqueue one call, without synchronizing: median over repeats of the mean over
    ``calls`` calls queued behind a sleeping kernel, so the GPU never waits for the host and never
    makes the host wait. (Calls of several launches take fewer, to stay within the launch queue.)"""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda._sleep(200_000_000)  # ~0.1 s at 2 GHz: longer than the enqueueing below
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def nvidia_smi() -> str:
    query = "name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"
    return result.stdout.strip()


def environment() -> dict:
    """The GPU and software versions, for the header and the JSON."""
    import flashgen
    from flashgen.generator import nvrtc

    env = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "flashgen": flashgen.__version__,
        "nvrtc": "{}.{}".format(*nvrtc.nvrtc_version()),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if not torch.cuda.is_available():
        return {"gpu": None, **env}
    from flashgen.runtime.device import device_info

    index = torch.cuda.current_device()
    props, info = torch.cuda.get_device_properties(index), device_info(index)
    return {
        "gpu": props.name, "capability": list(info.capability), "sms": info.num_sms, "l2_bytes": info.l2_bytes,
        "memory_gib": round(props.total_memory / 2**30, 1), "cudnn": torch.backends.cudnn.version(), **env,
    }


def measure_ceilings(timer, dtypes: Sequence[str]) -> dict:
    """A dense 8192^3 matmul per dtype and a 1 GiB device copy (bytes read + written), the limits
    every figure is read against."""
    n = 8192
    matmul = {}
    for name in dtypes:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        matmul[name] = 2 * n**3 / timer(lambda: a @ b) / 1e9
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB: far beyond L2
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.nbytes / timer(lambda: dst.copy_(src)) / 1e9
    return {"matmul_tflops": matmul, "matmul_shape": [n, n, n], "copy_tbps": copy_tbps, "copy_bytes": src.nbytes}
