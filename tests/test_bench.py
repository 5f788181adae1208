"""CPU tier: `flashgen bench` options, the suites' flow with fake implementations and canned times,
and the report (table, ratios, skipped peers, JSON, plots) on canned numbers.  No GPU needed."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from flashgen.bench import peers, report, settings, suites
from flashgen.bench.peers import Impl, Skip
from flashgen.cli import cli
from flashgen.generator import matrix
from flashgen.testing_kvcache import kvcache_ref

NO_BACKWARD = "flashgen has no backward pass yet"


# ---------------------------------------------------------------- settings


def test_resolve_full_quick_and_overrides():
    full = settings.resolve()
    assert full.head_dims == (64, 128, 256) and full.matrix_filter is None and full.suites == settings.SUITES
    quick = settings.resolve(True)
    assert quick.head_dims == (128,) and quick.matrix_filter == "hdim128_bf16"
    mixed = settings.resolve(True, head_dims=(64,), jobs=4, flex_dynamic=None, suites=None)
    assert (mixed.head_dims, mixed.seqlens, mixed.jobs, mixed.flex_dynamic) == ((64,), quick.seqlens, 4, True)


def test_parse_layout_and_heads():
    assert settings.parse_layout("contiguous") is None
    assert settings.parse_layout("paged16") == 16
    assert settings.parse_layout("hnd") is None
    assert settings.parse_heads("64/8") == (64, 8)
    for bad in ("paged0", "paged", "pages16", "blocked"):
        with pytest.raises(ValueError, match="layout"):
            settings.parse_layout(bad)
    for bad in ("32", "30/8", "8/32", "a/b", "32/0"):
        with pytest.raises(ValueError):
            settings.parse_heads(bad)


def test_prefill_configs_follow_flashattention_shapes():
    s = settings.resolve(modes=("fwd",), head_dims=(64, 256), seqlens=(512, 16384), masks=("causal",), gqa=(1, 16))
    configs, notes = settings.prefill_configs(s)
    shapes = {(c["head_dim"], c["seqlen"], c["nheads_k"]): (c["batch"], c["nheads"]) for c in configs}
    assert shapes == {
        (64, 512, 32): (32, 32), (64, 512, 2): (32, 32), (64, 16384, 32): (1, 32), (64, 16384, 2): (1, 32),
        (256, 512, 8): (32, 8), (256, 16384, 8): (1, 8),
    }
    assert all(c["causal"] and c["mode"] == "fwd" for c in configs)
    assert notes == ["prefill d256 gqa 16: hidden 2048 gives 8 heads, not a multiple of 16"]


def test_decode_configs_and_bytes():
    s = settings.resolve(query_lens=(1, 4), contexts=(1000,), batches=(2,), layouts=("contiguous", "paged256"))
    configs = settings.decode_configs(s)
    assert [(c["seqlen_q"], c["page_size"], c["causal"]) for c in configs] == [
        (1, None, False), (1, 256, False), (4, None, True), (4, 256, True)
    ]
    paged = configs[1]
    assert settings.kv_bytes(paged) == 2 * 2 * 1000 * 8 * 128 * 2
    assert settings.cache_bytes(paged) == 2 * 2 * 1024 * 8 * 128 * 2  # whole pages
    assert settings.cache_bytes(configs[0]) == settings.kv_bytes(configs[0])


def test_rotation_copies_outgrow_l2():
    from flashgen.bench import timing

    assert timing.rotation_copies(10 << 20, 60 << 20) == 24
    assert timing.rotation_copies(8 << 30, 60 << 20) == 1
    assert timing.rotation_copies(1, 60 << 20) == timing.MAX_COPIES


# ---------------------------------------------------------------- suites, with fakes


class _NoBackward(torch.autograd.Function):
    """Stands in for flashgen's forward-only autograd node."""

    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(NO_BACKWARD)


def fake_flashgen(broken: bool = False) -> Impl:
    def prefill(x):
        def call():
            q, k, v = peers.bhsd(x.q, x.k, x.v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=x.causal, **peers.gqa_kwargs(x.q, x.k))
            return _NoBackward.apply(out.transpose(1, 2) * (0 if broken else 1))

        return call

    def decode(x):
        return lambda: kvcache_ref(
            x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens, block_table=x.block_table, causal=x.causal
        ).out.to(x.q.dtype)

    return Impl("flashgen", prefill, decode)


def refusing(x):
    raise Skip("does not apply here")


def exploding(x):
    def call():
        import warnings

        warnings.warn("backend refused:\n  head dim too large")
        raise RuntimeError("kernel exploded\nstack trace")

    return call


def impls(broken: bool = False) -> list[Impl]:
    return [
        fake_flashgen(broken),
        peers.sdpa_impl("sdpa-math", "MATH"),
        Impl("flex", prefill=refusing),
        Impl("flash-attn", prefill=exploding, decode=exploding),
    ]


class FakeTimers:
    """Canned times; records the calls each decode timing got."""

    def __init__(self, eager_us=40.0, graph_us=10.0, graph_error=None):
        self.eager_us, self.graph_us, self.graph_error = eager_us, graph_us, graph_error
        self.decode_calls = []

    def timers(self, l2_bytes=1 << 20) -> suites.Timers:
        return suites.Timers(self.kernel_ms, self.decode_us, l2_bytes)

    def kernel_ms(self, fn):
        fn()
        return 0.5

    def decode_us(self, calls, graph):
        self.decode_calls.append(len(calls))
        if graph and self.graph_error:
            raise self.graph_error
        return self.graph_us if graph else self.eager_us


CEILINGS = {"matmul_tflops": {"bf16": 700.0}, "copy_tbps": 4.0}
PREFILL = {"mode": "fwd", "dtype": "bf16", "head_dim": 32, "seqlen": 64, "batch": 2, "nheads": 4, "nheads_k": 2,
           "causal": True}


def test_prefill_row_checks_flashgen_then_times_everyone():
    row = suites.prefill_row(PREFILL, impls(), FakeTimers().timers(), CEILINGS, "cpu")
    assert row["check"]["ok"] and row["check"]["against"].startswith("SDPA")
    flops = 4 * 2 * 4 * 64 * 64 * 32 / 2
    assert row["flops"] == flops
    for name in ("flashgen", "sdpa-math"):
        entry = row["impls"][name]
        assert entry["ms"] == 0.5 and entry["tflops"] == pytest.approx(flops / 0.5 / 1e9)
        assert entry["of_matmul"] == pytest.approx(entry["tflops"] / 700.0)
    assert row["impls"]["flex"] == {"skipped": "does not apply here"}
    assert row["impls"]["flash-attn"]["skipped"] == "RuntimeError: kernel exploded; backend refused: head dim too large"


def test_broken_flashgen_is_not_timed_and_fails_the_run():
    row = suites.prefill_row(PREFILL, impls(broken=True), FakeTimers().timers(), CEILINGS, "cpu")
    assert not row["check"]["ok"] and row["check"]["max_abs_err"] > 0
    assert row["impls"]["flashgen"] == {"skipped": "output check failed, not timed"}
    assert "ms" in row["impls"]["sdpa-math"]
    results = canned_results(prefill=[row])
    assert report.failures(results) == [f"prefill {report.prefill_label(PREFILL)}: output check failed"]
    assert any("flashgen output check FAILED" in n for n in report.notes(results))


def test_fwd_bwd_skips_flashgen_with_its_reason_and_times_the_peers():
    config = {**PREFILL, "mode": "fwd_bwd"}
    row = suites.prefill_row(config, impls(), FakeTimers().timers(), CEILINGS, "cpu")
    assert row["check"] is None
    assert row["impls"]["flashgen"] == {"skipped": f"NotImplementedError: {NO_BACKWARD}"}
    assert row["flops"] == 3.5 * 4 * 2 * 4 * 64 * 64 * 32 / 2
    assert "ms" in row["impls"]["sdpa-math"]
    assert report.failures(canned_results(prefill=[row])) == []  # expected until the backward lands


def test_bwd_mode_times_the_backward_alone_and_checks_the_gradients():
    forwards = []

    def prefill(x):
        def call():
            forwards.append(1)
            q, k, v = peers.bhsd(x.q, x.k, x.v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=x.causal, **peers.gqa_kwargs(x.q, x.k))
            return out.transpose(1, 2)

        return call

    config = {**PREFILL, "mode": "bwd"}
    row = suites.prefill_row(config, [Impl("flashgen", prefill)], FakeTimers().timers(), CEILINGS, "cpu")
    assert row["check"]["ok"]  # dq, dk, dv against SDPA's
    assert row["flops"] == 2.5 * 4 * 2 * 4 * 64 * 64 * 32 / 2
    assert "ms" in row["impls"]["flashgen"]
    assert len(forwards) == 1  # the first call and the timed one ran the backward only


def test_check_close_rules():
    ref = torch.randn(4, 8)
    assert suites.check_close(ref + 1e-4, ref, "r")["ok"]
    assert not suites.check_close(torch.zeros_like(ref), ref, "r")["ok"]
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert not suites.check_close(nan, ref, "r")["ok"]
    assert "shape" in suites.check_close(ref[:2], ref, "r")["error"]
    assert suites.check_close((ref, 2 * ref), (ref, 2 * ref), "grads")["ok"]


DECODE = {"dtype": "bf16", "batch": 3, "seqlen_q": 2, "context": 100, "nheads": 4, "nheads_k": 2, "head_dim": 32,
          "causal": True}


@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_row_rotates_checks_and_prefers_graphs(page_size):
    config = {**DECODE, "layout": "contiguous" if page_size is None else f"paged{page_size}", "page_size": page_size}
    fake = FakeTimers()
    row = suites.decode_row(config, impls(), fake.timers(l2_bytes=1 << 20), CEILINGS, "cpu", 1 << 30)
    assert row["check"]["ok"]
    assert row["copies"] == -(-4 * (1 << 20) // settings.cache_bytes(config))
    assert fake.decode_calls[0] == row["copies"]  # one call per copy of the inputs
    entry = row["impls"]["flashgen"]
    assert (entry["us"], entry["us_eager"], entry["us_graph"]) == (10.0, 40.0, 10.0)
    assert entry["tbps"] == pytest.approx(settings.kv_bytes(config) / 10.0 / 1e6)
    assert entry["of_copy"] == pytest.approx(entry["tbps"] / 4.0)
    assert "flex" not in row["impls"]  # no decode call: not applicable, not a skip
    assert row["impls"]["flash-attn"]["skipped"].startswith("RuntimeError: kernel exploded")
    sdpa = row["impls"]["sdpa-math"]
    if page_size is None:
        assert sdpa["us"] == 10.0
    else:
        assert sdpa == {"skipped": "SDPA takes no paged KV cache"}


def test_sdpa_decode_without_enable_gqa_repeats_the_heads_and_says_so(monkeypatch):
    real = F.scaled_dot_product_attention

    def no_gqa(*args, enable_gqa=False, **kwargs):
        if enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_gqa)
    # One new token: no causal mask (CausalBias dispatches on the real SDPA, not on this stand-in).
    config = {**DECODE, "seqlen_q": 1, "causal": False, "layout": "contiguous", "page_size": None}
    sdpa = peers.sdpa_impl("sdpa-math", "MATH")
    x = suites.decode_inputs(config, "cpu", torch.Generator().manual_seed(0), torch.Generator())
    out = sdpa.decode(x)()
    ref = kvcache_ref(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens).out
    assert suites.check_close(out, ref, "ref")["ok"]
    row = suites.decode_row(config, [fake_flashgen(), sdpa], FakeTimers().timers(), CEILINGS, "cpu", 1 << 30)
    entry = row["impls"]["sdpa-math"]
    assert entry["us"] == 10.0 and entry["note"].startswith("K/V heads repeated 2x before the call")
    assert f"decode: sdpa-math at {report.decode_label(config)}: K/V heads repeated" in "\n".join(
        report.notes(canned_results(decode=[row])))


def test_decode_hnd_layout_is_sdpas_memory_in_flash_attns_shape():
    config = {**DECODE, "seqlen_q": 1, "causal": False, "layout": "hnd", "page_size": None}
    x = suites.decode_inputs(config, "cpu", torch.Generator().manual_seed(0), torch.Generator())
    batch, context, nheads_k, head_dim = x.k_cache.shape
    assert (batch, context, nheads_k, head_dim) == (config["batch"], config["context"], config["nheads_k"],
                                                    config["head_dim"])
    for cache in (x.k_cache, x.v_cache):  # each head's keys one contiguous run
        assert cache.stride() == (nheads_k * context * head_dim, head_dim, context * head_dim, 1)
        assert cache.transpose(1, 2).is_contiguous()
    sdpa = peers.sdpa_impl("sdpa-math", "MATH")
    ref = kvcache_ref(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens).out
    assert suites.check_close(sdpa.decode(x)(), ref, "ref")["ok"]


def test_decode_graph_is_the_headline_for_short_calls_and_graph_failures_are_notes():
    config = {**DECODE, "layout": "contiguous", "page_size": None}
    short = suites.decode_row(config, impls()[:1], FakeTimers(eager_us=150.0).timers(), CEILINGS, "cpu", 1 << 30)
    assert short["impls"]["flashgen"]["us_eager"] == 150.0
    assert short["impls"]["flashgen"]["us"] == short["impls"]["flashgen"]["us_graph"] is not None
    long_eager = settings.GRAPH_BELOW_US + 1
    slow = suites.decode_row(config, impls()[:1], FakeTimers(eager_us=long_eager).timers(), CEILINGS, "cpu", 1 << 30)
    assert slow["impls"]["flashgen"]["us"] == long_eager
    failing = FakeTimers(graph_error=RuntimeError("operation not permitted when stream is capturing"))
    row = suites.decode_row(config, impls()[:1], failing.timers(), CEILINGS, "cpu", 1 << 30)
    assert row["impls"]["flashgen"]["us"] == 40.0
    assert row["impls"]["flashgen"]["graph_skipped"].startswith("RuntimeError: operation not permitted")
    assert any("flashgen (CUDA graph) skipped" in n for n in report.notes(canned_results(decode=[row])))


def test_decode_row_over_the_memory_cap_is_not_run():
    config = {**DECODE, "layout": "contiguous", "page_size": None}
    row = suites.decode_row(config, impls(), FakeTimers().timers(), CEILINGS, "cpu", 1000)
    assert row["skipped"].startswith("K+V cache of 0.0 GiB is over --max-kv-gib")
    assert row["impls"] == {}


def test_run_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = suites.run(settings.Settings(suites=("prefill", "decode")))
    assert results["notes"] == ["no CUDA GPU (torch.cuda.is_available() is False): prefill, decode not run"]
    assert results["prefill"] == [] and results["compile"] is None
    assert "no CUDA GPU" in report.render(results)


def test_a_suite_that_crashes_keeps_its_rows_and_fails_the_run(monkeypatch):
    """run()'s GPU path with the GPU parts faked: ceilings, peers, and a decode that dies midway."""
    from flashgen.bench import timing

    env = {**canned_results()["meta"]["env"]}
    monkeypatch.setattr(timing, "environment", lambda: env)
    monkeypatch.setattr(timing, "make_timer", lambda: (None, "canned"))
    monkeypatch.setattr(timing, "measure_ceilings", lambda timer, dtypes: CEILINGS)
    monkeypatch.setattr(peers, "load", lambda names, flex_dynamic: (impls(), {"flashinfer": "ImportError: no"}))
    configs = []

    def decode_row(config, *args):
        configs.append(config)
        if len(configs) > 1:
            raise RuntimeError("an illegal memory access was encountered")
        return {"config": config, "check": None, "impls": {}}

    monkeypatch.setattr(suites, "decode_row", decode_row)
    messages = []
    results = suites.run(settings.resolve(suites=("decode",), batches=(1, 2)), messages.append)
    assert len(results["decode"]) == 1
    assert results["errors"] == ["decode stopped early: RuntimeError: an illegal memory access was encountered"]
    assert results["notes"] == ["flashinfer not run: ImportError: no"]
    assert "Traceback" in messages[-1] and "decode" in results["meta"]["suite_seconds"]
    assert report.failures(results)[0].startswith("decode stopped early")
    assert "ERROR decode stopped early" in report.render(results)


def test_warm_load_failure_is_reported(monkeypatch):
    from flashgen.generator import matrix

    monkeypatch.setattr(suites, "WARM_SNIPPET", "raise SystemExit('cubin unreadable')  # {spec}")
    spec = matrix.all_specs(archs=["sm_90a"])[0]
    warm = suites._warm_load(spec, runs=2)
    assert warm == {"uri": spec.uri, "error": "cubin unreadable"}
    compile_result = {**COMPILE, "warm": warm, "matrix": {**COMPILE["matrix"], "failed": []}}
    assert report.failures(canned_results(compile=compile_result)) == [
        "compile: warm load failed: cubin unreadable"]
    assert f"warm cache load of {spec.uri} FAILED" in "\n".join(report.compile_lines(compile_result))


def test_first_calls_run_fresh_processes_on_a_scratch_cache(monkeypatch, tmp_path):
    # Each run is a fresh interpreter that sees the scratch cache; the first writes there, later
    # ones find it (as flashgen's cubins are found); a failing implementation is skipped with its error.
    # The real one parses (it needs a GPU to run).
    compile(suites.FIRST_CALL_SNIPPET.format(shape=suites.FIRST_CALL_SHAPE), "first call", "exec")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(suites, "FIRST_CALL_SNIPPET", r"""
import os, pathlib, sys
if sys.argv[1] == "fa4":
    raise SystemExit("ModuleNotFoundError: No module named 'flash_attn'")
marker = pathlib.Path(os.environ["FLASHGEN_CACHE_DIR"]) / "compiled"
print(2.5, 0.01 if marker.exists() else 0.9)
marker.touch()
""")
    result = suites.first_calls(["flashgen", "fa4"], runs=3)
    assert result == {"flashgen": {"first_call_s": [0.9, 0.01, 0.01], "imports_s": 2.5},
                      "fa4": {"skipped": "ModuleNotFoundError: No module named 'flash_attn'"}}
    assert os.environ["FLASHGEN_CACHE_DIR"] == str(tmp_path / "mine")  # restored
    assert not (tmp_path / "mine").exists()  # the user's cache untouched


# ---------------------------------------------------------------- report, on canned numbers


def canned_results(prefill=(), decode=(), compile=None, notes=(), errors=()) -> dict:
    return json.loads(json.dumps({
        "meta": {
            "date": "2026-11-29T08:30:00", "argv": ["flashgen", "bench"], "settings": {}, "timer": "canned",
            "env": {"gpu": "NVIDIA H200", "capability": [9, 0], "sms": 132, "l2_bytes": 60 << 20,
                    "memory_gib": 139.8, "cudnn": 91900, "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
                    "flashgen": "0.1.0", "nvrtc": "13.0"},
            "nvidia_smi_before": "name, clocks.sm [MHz]\nNVIDIA H200, 1980 MHz", "nvidia_smi_after": "",
            "suite_seconds": {"prefill": 61.2},
        },
        "ceilings": CEILINGS, "notes": list(notes), "errors": list(errors), "prefill": list(prefill),
        "decode": list(decode),
        "compile": compile,
    }))


def prefill_entry(tflops):
    return {"ms": 1.0, "tflops": tflops, "of_matmul": tflops / 700.0, "first_call_s": 0.1}


PREFILL_ROWS = [
    {"config": PREFILL, "flops": 1.0, "check": {"ok": True, "against": "SDPA", "max_abs_err": 0, "max_abs_ref": 1},
     "impls": {"flashgen": prefill_entry(400.0), "sdpa-flash": prefill_entry(300.0),
               "sdpa-cudnn": prefill_entry(500.0), "flex": {"skipped": "InductorError: out of shared memory"}}},
    {"config": {**PREFILL, "mode": "fwd_bwd"}, "flops": 1.0, "check": None,
     "impls": {"flashgen": {"skipped": f"NotImplementedError: {NO_BACKWARD}"}, "sdpa-flash": prefill_entry(250.0),
               "sdpa-cudnn": {"skipped": "RuntimeError: No available kernel"}}},
]


def test_prefill_table_ratios_and_skips():
    lines = report.prefill_table(PREFILL_ROWS)
    header = lines[1].split()
    assert header == ["config", "check", "flashgen", "sdpa-flash", "sdpa-cudnn", "flex", "fg/sdpa-flash",
                      "fg/sdpa-cudnn", "fg/flex", "fg/matmul"]
    fwd = lines[3].split()
    assert fwd[-8:] == ["ok", "400", "300", "500", "skip", "1.33", "0.80", "-", "57%"][-8:]
    bwd = lines[4].split()
    assert bwd[-9:] == ["-", "skip", "250", "skip", "-", "-", "-", "-", "-"]


def test_decode_table_and_notes():
    entry = {"us": 12.5, "us_eager": 30.0, "us_graph": 12.5, "tbps": 2.0, "of_copy": 0.5}
    rows = [
        {"config": {**DECODE, "layout": "paged16", "page_size": 16}, "kv_bytes": 1, "check": {"ok": True},
         "impls": {"flashgen": entry, "sdpa-cudnn": {"skipped": "SDPA takes no paged KV cache"}}},
        {"config": {**DECODE, "layout": "contiguous", "page_size": None}, "kv_bytes": 1, "check": {"ok": True},
         "impls": {"flashgen": entry, "sdpa-cudnn": {**entry, "us": 25.0, "tbps": 1.0}}},
        {"config": {**DECODE, "batch": 256, "layout": "contiguous", "page_size": None}, "kv_bytes": 1,
         "check": None, "impls": {}, "skipped": "K+V cache of 64.0 GiB is over --max-kv-gib 32"},
    ]
    lines = report.decode_table(rows)
    assert lines[1].split() == ["config", "check", "fg", "us", "fg", "eager", "fg", "TB/s", "fg/copy",
                                "sdpa-cudnn", "us", "fg/sdpa-cudnn"]
    assert lines[3].split()[-7:] == ["ok", "12.5", "30.0", "2.00", "50%", "skip", "-"]
    assert lines[4].split()[-7:] == ["ok", "12.5", "30.0", "2.00", "50%", "25.0", "2.00"]
    assert len(lines) == 5  # the skipped config is a note, not a row
    notes = report.notes(canned_results(decode=rows, notes=["flashinfer not run: ModuleNotFoundError: no flashinfer"]))
    assert notes[0] == "flashinfer not run: ModuleNotFoundError: no flashinfer"
    assert notes[1] == (f"decode: sdpa-cudnn skipped at {report.decode_label(rows[0]['config'])}: "
                        "SDPA takes no paged KV cache")
    assert f"decode config not run at {report.decode_label(rows[2]['config'])}: K+V cache of 64.0 GiB" in notes[2]


COMPILE = {
    "arch": "sm_90a", "nvrtc": "13.0",
    "cold": {"instances": 2, "compiled": 2, "median_s": 1.5, "max_s": 2.0, "total_s": 3.0, "slowest": "uri_b",
             "failed": []},
    "warm": {"uri": "uri_a", "runs": 3, "load_ms": 4.2, "imports_s": 2.5},
    "matrix": {"filter": None, "jobs": 16, "wall_s": 40.0, "instances": 485, "compiled": 484, "median_s": 1.0,
               "max_s": 3.0, "total_s": 600.0, "slowest": "uri_c", "failed": ["uri_d"]},
    "host_overhead_us": {"flashgen.flash_attn_func": {"us": 21.0}, "SDPA": {"skipped": "RuntimeError: no"}},
    "phases": {"fwd sm90": {"instances": 2, "ms": {"CUDA C++ Frontend": 100.0, "NVVM Optimizer": 500.0,
                                                    "PTX Translation": 400.0}}},
    "first_call": {"flashgen": {"first_call_s": [0.95, 0.012], "imports_s": 2.7},
                   "fa4": {"skipped": "ModuleNotFoundError: No module named 'flash_attn'"}},
    "first_call_shape": "b2 s1024 h16 d128",
}


def test_compile_lines_and_failures():
    text = "\n".join(report.compile_lines(COMPILE))
    assert "median 1.50 s, max 2.00 s (uri_b)" in text
    assert "4.2 ms to a loaded kernel" in text
    assert "485 instances (the whole matrix) with -j 16: 40.0 s wall, 600.0 s of compile, 1 failed" in text
    assert "flashgen.flash_attn_func: 21.0 us" in text and "SDPA: skipped: RuntimeError: no" in text
    assert ("fwd sm90 (2): 1000 ms: CUDA C++ Frontend 100 (10%), NVVM Optimizer 500 (50%), "
            "PTX Translation 400 (40%)") in text
    assert "forward (b2 s1024 h16 d128) in fresh processes" in text
    assert "flashgen: 0.950 s, 0.012 s (imports 2.70 s)" in text
    assert "fa4: skipped: ModuleNotFoundError: No module named 'flash_attn'" in text
    assert report.failures(canned_results(compile=COMPILE)) == ["compile: uri_d failed"]


def test_render_and_write_json_report_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    decode_rows = [
        {"config": {**DECODE, "context": context, "layout": "contiguous", "page_size": None}, "kv_bytes": 1,
         "check": {"ok": True}, "impls": {"flashgen": {"us": 10.0, "us_eager": 20.0, "tbps": context / 1e3}}}
        for context in (2048, 8192)
    ]
    results = canned_results(prefill=PREFILL_ROWS, decode=decode_rows, compile=COMPILE)
    text = report.render(results)
    assert text.startswith("flashgen bench, 2026-11-29T08:30:00: NVIDIA H200 (sm_90, 132 SMs, 60 MB L2")
    assert "  NVIDIA H200, 1980 MHz" in text and "bf16 700 TFLOP/s; device copy 4.00 TB/s" in text
    assert "note: suite times: prefill 61 s" in text
    paths, plot_notes = report.write(results, text, tmp_path / "out")
    assert plot_notes == []
    assert sorted(p.name for p in paths) == ["decode.png", "prefill_fwd.png", "prefill_fwd_bwd.png", "report.txt",
                                             "results.json"]
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    assert all(p.stat().st_size > 0 for p in paths)


def test_write_without_matplotlib_says_how_to_get_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    paths, plot_notes = report.write(canned_results(prefill=PREFILL_ROWS), "text", tmp_path)
    assert [p.name for p in paths] == ["results.json", "report.txt"]
    assert "pip install 'flashgen[bench]'" in plot_notes[0]


def test_default_out_dir():
    assert str(report.default_out_dir(canned_results())) == "benchmarks/results/20261129-0830-nvidia-h200"


# ---------------------------------------------------------------- the command


def invoke(*args: str, expect: int = 0):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == expect, (result.output, result.exception)
    return result


def test_help_documents_the_suites():
    text = invoke("--help").output
    for word in ("prefill", "decode", "compile", "--quick", "--seqlens", "--contexts", "--layouts", "--out"):
        assert word in text


@pytest.mark.parametrize("args, message", [
    (["--layouts", "paged0"], "layout"),
    (["--heads", "30/8"], "multiple"),
    (["--dtypes", "fp8"], "fp8"),
    (["--peers", "cutlass"], "cutlass"),
    (["--seqlens", "0"], "positive"),
    (["--batches", ","], "at least one"),
    (["train"], "train"),
])
def test_bad_arguments_are_usage_errors(args, message):
    assert message in invoke(*args, expect=2).output


@pytest.fixture
def captured_run(monkeypatch):
    """suites.run replaced by canned results; records the settings it got."""
    seen = {}

    def fake_run(s, progress):
        seen["settings"] = s
        progress("fake progress")
        return seen.pop("results", canned_results(prefill=PREFILL_ROWS))

    monkeypatch.setattr(suites, "run", fake_run)
    return seen


def test_options_reach_the_settings_and_files_are_written(captured_run, tmp_path):
    out = tmp_path / "results"
    result = invoke("prefill", "decode", "--quick", "--seqlens", "1024, 2048", "--heads", "64/8,32/8",
                    "--layouts", "paged16", "--flex-static", "--matrix-filter", "", "--out", str(out), "--no-plots")
    s = captured_run["settings"]
    assert s.suites == ("prefill", "decode") and s.seqlens == (1024, 2048) and s.head_dims == (128,)
    assert s.heads == ((64, 8), (32, 8)) and s.layouts == ("paged16",) and s.flex_dynamic is False
    assert s.matrix_filter == ""
    assert "fg/sdpa-flash" in result.output and "wrote" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["report.txt", "results.json"]


def test_a_failed_check_fails_the_command(captured_run, tmp_path):
    row = {**PREFILL_ROWS[0], "check": {"ok": False, "against": "SDPA", "max_abs_err": 1.0, "max_abs_ref": 1.0}}
    captured_run["results"] = canned_results(prefill=[row])
    result = invoke("--out", str(tmp_path), "--no-plots", expect=1)
    assert "FAILED prefill" in result.output


def test_compile_suite_end_to_end_on_a_cpu(fake_nvrtc, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    result = invoke("compile", "--cold-count", "2", "--warm-runs", "1", "-j", "1",
                    "--matrix-filter", "hdim64_fp16_causal_paged", "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    c = results["compile"]
    assert c["arch"] == "sm_90a" and c["cold"]["compiled"] == 2 and c["warm"]["runs"] == 1
    assert c["matrix"]["instances"] == c["matrix"]["compiled"] > 0 and c["matrix"]["failed"] == []
    assert "host_overhead_us" not in c  # needs a GPU
    assert c["phases"] == {}  # the fake NVRTC writes no timing report
    group_sizes = collections.Counter((spec.direction, spec.family) for spec in matrix.all_specs(archs=["sm_90a"]))
    phase_compiles = sum(min(2, size) for size in group_sizes.values())
    # Every instance compiled cold, in scratch caches, besides the phase timings' compiles.
    assert len(fake_nvrtc.calls) == 2 + phase_compiles + c["matrix"]["instances"]
    assert "cold compile, 2 instances" in result.output


def test_cli_help_imports_no_torch():
    code = "import sys, flashgen.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
