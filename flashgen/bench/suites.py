"""The suites: build each config's inputs, check flashgen's output once, time every implementation.

Timers and implementations are passed in, so the whole flow (inputs, checks, skips with reasons,
results) runs on a CPU in the tests with fake implementations and canned times.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..testing import attention_flops, attention_ref
from ..testing_kvcache import random_block_table
from . import peers, report, settings, timing
from .peers import DecodeInputs, Impl, PrefillInputs, Skip, describe
from .settings import FLASHGEN, Settings

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# flashgen passes when |out - ref| <= CHECK_RMS * rms(ref) + CHECK_RTOL * |ref| + CHECK_MAX * max|ref|
# everywhere: two correct kernels differ by a few ulps, a wrong block or row by about the outputs'
# own size. The max term covers bf16 gradients of two correct kernels (different accumulation
# orders, seqlen 4096), seen 0.0156 apart where max|g| = 5.8 (half an ulp there).
CHECK_RMS, CHECK_RTOL, CHECK_MAX = 0.05, 2e-2, 5e-3
SEED = 0
# A cached instance loaded by a fresh interpreter, timed apart from the imports.
WARM_SNIPPET = r"""
import time
t0 = time.perf_counter()
import torch, flashgen
from flashgen.generator.cache import get_cubin
from flashgen.generator.spec import KernelSpec
from flashgen.runtime import launch
if torch.cuda.is_available():
    torch.cuda.init()  # context creation is not the cache's cost
t1 = time.perf_counter()
spec = KernelSpec.from_dict({spec!r})
cubin = get_cubin(spec)
if torch.cuda.is_available():
    launch.LoadedKernel(spec, cubin, 0, 128)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


# A causal forward's first call in a fresh interpreter, after imports, CUDA context and inputs:
# flashgen compiles its instance there (on an empty cache the first time), FA4 JIT-compiles its kernel.
FIRST_CALL_SHAPE = (2, 1024, 16, 128)  # batch, seqlen, heads, head dim; bf16
FIRST_CALL_SNIPPET = r"""
import sys, time
t0 = time.perf_counter()
import torch
if sys.argv[1] == "flashgen":
    from flashgen import flash_attn_func
    call = lambda q, k, v: flash_attn_func(q, k, v, causal=True)
else:
    from flash_attn.cute import flash_attn_func
    call = lambda q, k, v: flash_attn_func(q, k, v, causal=True)[0]
torch.cuda.init()
q, k, v = (torch.randn({shape}, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
t1 = time.perf_counter()
call(q, k, v)
torch.cuda.synchronize()
print(t1 - t0, time.perf_counter() - t1)
"""
FIRST_CALL_IMPLS = ("flashgen", "fa4")


@dataclasses.dataclass(frozen=True)
class Timers:
    kernel_ms: Callable[[Callable[[], object]], float]  # median ms of one call (prefill)
    decode_us: Callable[[list, bool], float]           # (calls on rotated copies, graph) -> us per call
    l2_bytes: int


def check_close(out, ref, against: str) -> dict:
    """flashgen's output (a tensor, or a tuple such as gradients) next to a reference."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    result = {"ok": True, "against": against, "max_abs_err": 0.0, "max_abs_ref": 0.0}
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            return {**result, "ok": False, "error": f"shape {tuple(o.shape)}, reference {tuple(r.shape)}"}
        o, r = o.detach().float(), r.detach().float()
        err = (o - r).abs()
        allowed = CHECK_RMS * r.square().mean().sqrt() + CHECK_RTOL * r.abs() + CHECK_MAX * r.abs().max()
        result["ok"] &= bool((err <= allowed).all())  # NaN fails the comparison
        result["max_abs_err"] = max(result["max_abs_err"], err.max().item())
        result["max_abs_ref"] = max(result["max_abs_ref"], r.abs().max().item())
    return result


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _first_call(impl: Impl, factory, inputs):
    """(call, its first result, seconds): the call made and run once, so compiles, plans and
    refusals happen here and not in the timing.  Any failure becomes a Skip with its reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # SDPA explains a refused backend in warnings
        try:
            with impl.context():
                call = factory(inputs)
                start = time.perf_counter()
                out = call()
                _synchronize()
                seconds = time.perf_counter() - start
        except Skip:
            raise
        except Exception as exc:
            reasons = [describe(exc), *(" ".join(str(w.message).split()) for w in caught)]
            raise Skip("; ".join(dict.fromkeys(reasons))) from None
    return call, out, seconds


def _measure(impl: Impl, factory, inputs, row: dict, reference, time_call) -> dict:
    """One implementation on one config: {figures..., first_call_s} or {"skipped": reason}.
    flashgen's first output is checked against ``reference(out) -> (out, ref, against)`` and only
    a correct kernel is timed."""
    try:
        call, out, seconds = _first_call(impl, factory, inputs)
    except Skip as skip:
        return {"skipped": str(skip)}
    if impl.name == FLASHGEN:
        try:
            row["check"] = check_close(*reference(out))
        except Exception as exc:  # unchecked is untimed: a failing reference fails the config too
            row["check"] = {"ok": False, "against": "the reference", "error": f"it failed: {describe(exc)}"}
        if not row["check"]["ok"]:
            return {"skipped": "output check failed, not timed"}
    del out
    try:
        with impl.context():
            entry = time_call(call)
    except Exception as exc:
        return {"skipped": f"timing failed: {describe(exc)}"}
    entry["first_call_s"] = seconds
    if hasattr(call, "note"):  # how the call differs from the others' (see peers.sdpa_impl)
        entry["note"] = call.note
    return entry


def _with_backward(forward_factory, dout: torch.Tensor):
    """A factory whose call runs the forward and the backward and returns (dq, dk, dv)."""
    def factory(x: PrefillInputs):
        forward = forward_factory(x)
        return lambda: torch.autograd.grad(forward(), (x.q, x.k, x.v), dout)

    return factory


def _backward_only(forward_factory, dout: torch.Tensor):
    """A factory whose call runs only the backward (of one forward run when the factory is made)
    and returns (dq, dk, dv)."""
    def factory(x: PrefillInputs):
        out = forward_factory(x)()
        return lambda: torch.autograd.grad(out, (x.q, x.k, x.v), dout, retain_graph=True)

    return factory


def _sdpa_reference(x: PrefillInputs, dout: torch.Tensor | None):
    q, k, v = peers.bhsd(x.q, x.k, x.v)
    with torch.set_grad_enabled(dout is not None):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=x.causal, **peers.gqa_kwargs(x.q, x.k))
        out = out.transpose(1, 2)
    return out if dout is None else torch.autograd.grad(out, (x.q, x.k, x.v), dout)


def prefill_row(config: dict, impls: list[Impl], timers: Timers, ceilings: dict | None, device) -> dict:
    dtype = DTYPES[config["dtype"]]
    batch, seqlen, nheads, nheads_k, head_dim = (
        config[k] for k in ("batch", "seqlen", "nheads", "nheads_k", "head_dim")
    )
    generator = torch.Generator(device).manual_seed(SEED)

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype, generator=generator)

    backward = config["mode"] != "fwd"
    q, k, v = (randn(batch, seqlen, n, head_dim).requires_grad_(backward) for n in (nheads, nheads_k, nheads_k))
    x = PrefillInputs(q, k, v, config["causal"])
    dout = randn(batch, seqlen, nheads, head_dim) if backward else None
    flops = attention_flops(batch, nheads, seqlen, seqlen, head_dim, x.causal, mode=config["mode"])
    ceiling = ((ceilings or {}).get("matmul_tflops") or {}).get(config["dtype"])

    def reference(out):
        return out, _sdpa_reference(x, dout), "SDPA (PyTorch's default backend)"

    def time_call(call):
        ms = timers.kernel_ms(call)
        entry = {"ms": ms, "tflops": flops / ms / 1e9}
        if ceiling:
            entry["of_matmul"] = entry["tflops"] / ceiling
        return entry

    row = {"config": config, "flops": flops, "check": None, "impls": {}}
    wrap = {"fwd": None, "bwd": _backward_only, "fwd_bwd": _with_backward}[config["mode"]]
    for impl in impls:
        if impl.prefill is not None:
            factory = wrap(impl.prefill, dout) if wrap else impl.prefill
            row["impls"][impl.name] = _measure(impl, factory, x, row, reference, time_call)
    return row


def decode_inputs(config: dict, device, generator, table_generator) -> DecodeInputs:
    dtype = DTYPES[config["dtype"]]
    batch, context, page_size = config["batch"], config["context"], config["page_size"]
    nheads_k, head_dim = config["nheads_k"], config["head_dim"]

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype, generator=generator)

    def cache(shape):
        if config["layout"] == "hnd":  # SDPA's memory layout, passed as flash_attn's (strided) view
            return randn(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)
        return randn(*shape)

    if page_size is None:
        cache_shape, table = (batch, context, nheads_k, head_dim), None
    else:
        pages = math.ceil(context / page_size)
        cache_shape = (batch * pages, page_size, nheads_k, head_dim)
        # Pages in random order, as a serving engine's allocator leaves them.
        table = random_block_table(batch, pages, batch * pages, generator=table_generator, device=device)
    q = randn(batch, config["seqlen_q"], config["nheads"], head_dim)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return DecodeInputs(q, cache(cache_shape), cache(cache_shape), seqlens, table, config["causal"])


def _decode_reference(out: torch.Tensor, x: DecodeInputs):
    """attention_ref on the first and last sequence (so batch and page indexing are checked too),
    which keeps the float32 reference small at 128k keys."""
    rows = sorted({0, x.q.shape[0] - 1})
    if x.block_table is None:
        k, v = (c[rows, : x.context] for c in (x.k_cache, x.v_cache))
    else:
        pages = x.block_table[rows].long()
        k, v = (c[pages].flatten(1, 2)[:, : x.context] for c in (x.k_cache, x.v_cache))
    ref, _ = attention_ref(x.q[rows], k, v, causal=x.causal)
    return out[rows], ref, "attention_ref (float32), first and last sequence"


def _time_decode(calls: list, timers: Timers, kv_bytes: int) -> dict:
    entry = {"us_eager": timers.decode_us(calls, False), "us_graph": None}
    try:
        entry["us_graph"] = timers.decode_us(calls, True)
    except Exception as exc:  # e.g. a call that synchronizes, which capture forbids
        entry["graph_skipped"] = describe(exc)
    use_graph = entry["us_graph"] is not None and entry["us_eager"] < settings.GRAPH_BELOW_US
    entry["us"] = entry["us_graph"] if use_graph else entry["us_eager"]
    entry["tbps"] = kv_bytes / entry["us"] / 1e6
    return entry


def decode_row(config: dict, impls: list[Impl], timers: Timers, ceilings: dict | None, device,
               max_kv_bytes: float) -> dict:
    element_size = DTYPES[config["dtype"]].itemsize
    row = {"config": config, "kv_bytes": settings.kv_bytes(config, element_size), "check": None, "impls": {}}
    allocated = settings.cache_bytes(config, element_size)
    if allocated > max_kv_bytes:
        row["skipped"] = f"K+V cache of {allocated / 2**30:.1f} GiB is over --max-kv-gib {max_kv_bytes / 2**30:g}"
        return row
    generator = torch.Generator(device).manual_seed(SEED)
    table_generator = torch.Generator().manual_seed(SEED)
    inputs = [
        decode_inputs(config, device, generator, table_generator)
        for _ in range(timing.rotation_copies(allocated, timers.l2_bytes))
    ]
    row["copies"] = len(inputs)
    copy_tbps = (ceilings or {}).get("copy_tbps")

    def reference(out):
        return _decode_reference(out, inputs[0])

    for impl in impls:
        if impl.decode is None:
            continue

        def time_call(call, impl=impl):
            calls = [call, *(impl.decode(x) for x in inputs[1:])]
            entry = _time_decode(calls, timers, row["kv_bytes"])
            if copy_tbps:
                entry["of_copy"] = entry["tbps"] / copy_tbps
            return entry

        row["impls"][impl.name] = _measure(impl, impl.decode, inputs[0], row, reference, time_call)
    return row


def _free(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def prefill_rows(s: Settings, impls, timers, ceilings, device, progress) -> Iterator[dict]:
    configs, _ = settings.prefill_configs(s)
    for i, config in enumerate(configs, 1):
        progress(f"prefill {i}/{len(configs)}: {report.prefill_label(config)}")
        yield prefill_row(config, impls, timers, ceilings, device)
        _free(device)


def decode_rows(s: Settings, impls, timers, ceilings, device, progress) -> Iterator[dict]:
    configs = settings.decode_configs(s)
    for i, config in enumerate(configs, 1):
        progress(f"decode {i}/{len(configs)}: {report.decode_label(config)}")
        yield decode_row(config, impls, timers, ceilings, device, s.max_kv_gib * 2**30)
        _free(device)


@contextlib.contextmanager
def _scratch_cache():
    """An empty FLASHGEN_CACHE_DIR while the block runs; spawned build workers inherit it."""
    previous = os.environ.get("FLASHGEN_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="flashgen-bench-") as directory:
        os.environ["FLASHGEN_CACHE_DIR"] = directory
        try:
            yield directory
        finally:
            if previous is None:
                del os.environ["FLASHGEN_CACHE_DIR"]
            else:
                os.environ["FLASHGEN_CACHE_DIR"] = previous


def _build_summary(results) -> dict:
    compiled = [r for r in results if r.error is None and not r.cached]
    seconds = [r.seconds for r in compiled]
    return {
        "instances": len(results),
        "compiled": len(compiled),
        "median_s": statistics.median(seconds) if seconds else None,
        "max_s": max(seconds, default=None),
        "total_s": sum(seconds),
        "slowest": max(compiled, key=lambda r: r.seconds).spec.uri if compiled else None,
        "failed": [r.spec.uri for r in results if r.error is not None],
    }


def _fresh_process(snippet: str, *args: str) -> tuple[float, float] | str:
    """``snippet`` run by a fresh interpreter with this environment: the two numbers its output ends
    with, or the last line of its error."""
    done = subprocess.run([sys.executable, "-c", snippet, *args], capture_output=True, text=True, check=False,
                          env=dict(os.environ))
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["no output"])[-1]
    first, second = (float(x) for x in done.stdout.split()[-2:])
    return first, second


def _warm_load(spec, runs: int) -> dict:
    """A cached instance loaded by a fresh interpreter: the cache's cost next to the imports'."""
    samples = []
    for _ in range(runs):
        sample = _fresh_process(WARM_SNIPPET.format(spec=spec.to_dict()))
        if isinstance(sample, str):
            return {"uri": spec.uri, "error": sample}
        samples.append(sample)
    return {
        "uri": spec.uri, "runs": runs,
        "load_ms": statistics.median(load for _, load in samples) * 1e3,
        "imports_s": statistics.median(imports for imports, _ in samples),
    }


def first_calls(impls: Sequence[str], runs: int) -> dict:
    """Each implementation's first call (FIRST_CALL_SNIPPET) in ``runs`` fresh interpreters one after
    the other, on a scratch flashgen cache: the first run is the cold start, later ones find what it
    left on disk (flashgen's cubin cache; FA4's own cache, if it keeps one)."""
    result = {}
    with _scratch_cache():
        for impl in impls:
            samples = []
            for _ in range(runs):
                sample = _fresh_process(FIRST_CALL_SNIPPET.format(shape=FIRST_CALL_SHAPE), impl)
                if isinstance(sample, str):
                    result[impl] = {"skipped": sample}
                    break
                samples.append(sample)
            else:
                result[impl] = {"first_call_s": [call for _, call in samples], "imports_s": samples[0][0]}
    return result


def host_overheads() -> dict:
    """Host microseconds to enqueue one call on shapes whose kernels are shorter than that work."""
    import flashgen

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(1, 128, 16, 128), randn(1, 128, 16, 128), randn(1, 128, 16, 128)
    q_new, k_cache, v_cache = randn(1, 1, 32, 128), randn(1, 4096, 8, 128), randn(1, 4096, 8, 128)
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    prefill_bhsd, decode_bhsd = peers.bhsd(q, k, v), peers.bhsd(q_new, k_cache, v_cache)
    calls = {
        "flashgen.flash_attn_func, b1 s128 h16 d128": lambda: flashgen.flash_attn_func(q, k, v),
        "SDPA (default backend), same shape": lambda: F.scaled_dot_product_attention(*prefill_bhsd),
        "flashgen.flash_attn_with_kvcache, b1 q1 L4096 32/8 heads d128": lambda: flashgen.flash_attn_with_kvcache(
            q_new, k_cache, v_cache, cache_seqlens=seqlens, num_splits=0
        ),
        "SDPA (default backend, enable_gqa), same shape": lambda: F.scaled_dot_product_attention(
            *decode_bhsd, enable_gqa=True
        ),
    }
    result = {}
    for name, call in calls.items():
        try:
            result[name] = {"us": timing.enqueue_us(call)}
        except Exception as exc:  # a peer that refuses the shape is a note, not a number
            result[name] = {"skipped": describe(exc)}
    # The backward (autograd.grad of a kept graph: preprocess, main kernel, postprocess), next to
    # SDPA's; 50 calls a sample, so that the launches stay within the launch queue.
    forwards = {
        "flashgen backward (autograd.grad), b1 s128 h16 d128": flashgen.flash_attn_func,
        "SDPA backward (default backend), same shape":
            lambda q, k, v: F.scaled_dot_product_attention(*peers.bhsd(q, k, v)),
    }
    for name, forward in forwards.items():
        try:
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = forward(*leaves)
            dout = torch.randn_like(out)
            result[name] = {"us": timing.enqueue_us(
                lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), calls=50)}
        except Exception as exc:
            result[name] = {"skipped": describe(exc)}
    return result


def compile_phase_split(specs, per_family: int = 2) -> dict:
    """Where an NVRTC compile's time goes, per (direction, family): NVRTC's own phase timings
    (nvrtc.compile_phases), mean ms over ``per_family`` instances of each, spread over it."""
    from ..generator import cache, nvrtc, render

    groups: dict[str, list] = {}
    for spec in specs:
        groups.setdefault(f"{spec.direction} {spec.family}", []).append(spec)
    headers, options = render.header_sources(), cache.compile_options()
    split = {}
    for group, members in groups.items():
        members = members[:: max(1, len(members) // per_family)][:per_family]  # spread over the group
        runs = [nvrtc.compile_phases(render.render_instance(spec), spec.uri + ".cu", spec.arch, headers, options)
                for spec in members]
        runs = [run for run in runs if run]
        if runs:
            split[group] = {"instances": len(runs),
                            "ms": {phase: statistics.fmean(run.get(phase, 0.0) for run in runs) for phase in runs[0]}}
    return split


def run_compile(s: Settings, arch: str, on_gpu: bool, progress) -> dict:
    from ..generator import cache, matrix, nvrtc

    specs = matrix.all_specs(archs=[arch])
    # Spread over the matrix, so the sample has every direction, dtype, head dim and flag.
    sample = specs[:: max(1, len(specs) // s.cold_count)][: s.cold_count]
    result = {"arch": arch, "nvrtc": "{}.{}".format(*nvrtc.nvrtc_version())}
    with _scratch_cache():
        progress(f"compile: {len(sample)} instances cold, one at a time")
        cold = list(cache.build(sample, 1))
        result["cold"] = _build_summary(cold)
        loadable = [r.spec for r in cold if r.error is None]
        progress("compile: NVRTC's phase timings, per direction and family")
        result["phases"] = compile_phase_split(specs)
        if loadable:
            progress(f"compile: warm load in {s.warm_runs} fresh processes")
            result["warm"] = _warm_load(loadable[0], s.warm_runs)
    selected = [spec for spec in specs if not s.matrix_filter or s.matrix_filter in spec.uri]
    with _scratch_cache():
        progress(f"compile: {len(selected)} instances with -j {s.jobs}")
        start = time.perf_counter()
        built = list(cache.build(selected, s.jobs))
        wall = time.perf_counter() - start
    result["matrix"] = {"filter": s.matrix_filter, "jobs": s.jobs, "wall_s": wall, **_build_summary(built)}
    if on_gpu:
        progress("compile: host overhead per call")
        result["host_overhead_us"] = host_overheads()
        first = [impl for impl in FIRST_CALL_IMPLS if impl == "flashgen" or impl in s.peers]
        progress(f"compile: first call in {s.warm_runs} fresh processes each: {', '.join(first)}")
        result["first_call"] = first_calls(first, s.warm_runs)
        result["first_call_shape"] = "b{} s{} h{} d{}".format(*FIRST_CALL_SHAPE)
    return result


def run(s: Settings, progress: Callable[[str], None] = lambda message: None) -> dict:
    """Every suite in ``s``, with the header facts and ceilings: the results dict the report reads."""
    env = timing.environment()
    on_gpu = env["gpu"] is not None
    results = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
            "settings": dataclasses.asdict(s), "env": env, "timer": None,
            "nvidia_smi_before": timing.nvidia_smi(), "suite_seconds": {},
        },
        "ceilings": None, "notes": [], "errors": [], "prefill": [], "decode": [], "compile": None,
    }
    meta, notes = results["meta"], results["notes"]

    @contextlib.contextmanager
    def suite_timer(suite: str):
        """The suite's wall time; a crash keeps what was measured and becomes an error of the run."""
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            progress(traceback.format_exc())
            results["errors"].append(f"{suite} stopped early: {describe(exc)}")
        meta["suite_seconds"][suite] = time.perf_counter() - start

    gpu_suites = [suite for suite in s.suites if suite in ("prefill", "decode")]
    if gpu_suites and not on_gpu:
        notes.append(f"no CUDA GPU (torch.cuda.is_available() is False): {', '.join(gpu_suites)} not run")
    elif gpu_suites:
        kernel_ms, meta["timer"] = timing.make_timer()
        timers = Timers(kernel_ms, timing.rotated_us, env["l2_bytes"])
        progress("ceilings: matmul and device copy")
        results["ceilings"] = timing.measure_ceilings(kernel_ms, sorted({*s.dtypes, "bf16"}))
        impls, missing = peers.load(s.peers, s.flex_dynamic)
        notes.extend(f"{name} not run: {reason}" for name, reason in missing.items())
        if "prefill" in gpu_suites:
            notes.extend(settings.prefill_configs(s)[1])
        for suite in gpu_suites:
            rows = (prefill_rows if suite == "prefill" else decode_rows)(
                s, impls, timers, results["ceilings"], "cuda", progress
            )
            with suite_timer(suite):
                for row in rows:
                    results[suite].append(row)
    if "compile" in s.suites:
        from ..generator import matrix

        arch = matrix.target_arch(*env["capability"]) if on_gpu else "sm_90a"
        with suite_timer("compile"):
            results["compile"] = run_compile(s, arch, on_gpu, progress)
    meta["nvidia_smi_after"] = timing.nvidia_smi()
    # Round-trip through JSON now, so the report reads exactly what results.json will hold.
    return json.loads(json.dumps(results))
