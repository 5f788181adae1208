"""CPU tier: the split-KV combine's launch geometry, and the combine kernel itself run on the host.

The combine kernel (flashgen/templates/combine.cuh) derives its whole geometry from the params and
the grid: a CTA takes ceil(rows / gridDim.x) rows, R at a time, as R rows x G split groups x C
column threads. launch_combine (flashgen/runtime/execute.py) only picks the grid. These tests
check the contract between the two: the thread count, the grid limits, that a model of the
kernel's index math covers every (row, split, chunk) exactly once, and that the decode and the
large shapes get the geometry they were designed for (one batch of loads per thread).

The last test compiles combine.cuh for the host with g++ (CUDA built-ins replaced by a small shim,
cp.async by a checked synchronous copy, each CTA's threads run as std::threads) and runs it
through launch_combine against the float64 reference: the kernel's arithmetic, strides, masking and
bounds on the CPU. It is skipped where no C++20 compiler is found.
"""
from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flashgen.generator import render
from flashgen.generator.spec import KernelSpec
from flashgen.runtime import execute, validate
from flashgen.runtime.dispatch import DeviceInfo

TEMPLATES = Path(render.TEMPLATES_DIR)
COMBINE_CUH = (TEMPLATES / "combine.cuh").read_text()


def cuh_constant(name: str) -> int:
    match = re.search(rf"constexpr int {name} = (\d+);", COMBINE_CUH)
    assert match, f"{name} not found in combine.cuh"
    return int(match.group(1))


THREADS = cuh_constant("kCombineThreads")
LOADS = cuh_constant("kCombineLoads")
MAX_COL_THREADS = cuh_constant("kCombineMaxColThreads")


def stub_device(monkeypatch, num_sms: int, run=None) -> dict:
    """Stub launch_combine's device calls; returns what its launch saw (and passes it to run)."""
    seen = {}

    def fake_launch(spec, smem_bytes, num_threads, grid, params, index, dependent=False):
        assert spec.direction == "combine" and smem_bytes == 0
        assert dependent, "on sm_90 the combine is a programmatic dependent launch"
        seen.update(threads=num_threads, grid=grid)
        if run is not None:
            run(spec, num_threads, grid, params)

    monkeypatch.setattr(execute, "launch_kernel", fake_launch)
    monkeypatch.setattr(execute, "device_index", lambda t: 0)
    monkeypatch.setattr(execute, "device_info", lambda index: DeviceInfo(capability=(9, 0), num_sms=num_sms))
    return seen


def launch(monkeypatch, *, num_splits, batch, seqlen, nheads, head_dim, num_sms=132):
    """launch_combine's (threads, grid) for a shape (nothing runs)."""
    seen = stub_device(monkeypatch, num_sms)
    dummy = torch.zeros(4)
    execute.launch_combine(
        dummy, dummy, dummy, dummy, partial_strides=(0, 0, 0, 0), lse_partial_strides=(0, 0, 0, 0),
        out_strides=(0, 0, 0), lse_strides=(0, 0, 0), num_splits=num_splits, batch=batch, seqlen=seqlen,
        nheads=nheads, head_dim=head_dim,
    )
    return seen["threads"], seen["grid"]


def log2_ceil(x: int) -> int:
    return 0 if x <= 1 else (x - 1).bit_length()


def device_geometry(rows: int, num_splits: int, head_dim: int, grid_x: int) -> dict:
    """combine_rows' geometry, written out in Python (keep in step with combine.cuh)."""
    few = 4 if num_splits > 2 else 2 if num_splits > 1 else 1  # num_splits <= 4: all of them, kc chunks
    kc = 1 if num_splits > 4 else LOADS // few
    chunks = head_dim // 4
    log_c = min(log2_ceil(-(-chunks // kc)), log2_ceil(MAX_COL_THREADS))
    rows_per_cta = -(-rows // grid_x)
    log_r = log2_ceil(min(rows_per_cta, THREADS >> log_c))
    log_g = log2_ceil(THREADS) - log_c - log_r
    # More splits: the fewest power-of-two slots (<= 8) that hold a split group's share.
    ks = min(LOADS, 1 << log2_ceil(-(-num_splits >> log_g))) if num_splits > 4 else few
    return dict(ks=ks, kc=kc, chunks=chunks, C=1 << log_c, R=1 << log_r, G=1 << log_g, rows_per_cta=rows_per_cta)


def thread_work(geo: dict, num_splits: int, block: int, tid: int, rows: int):
    """What thread tid of CTA block loads and stores, pass by pass, in combine_rows: yields
    (row, loads, stores, writes_lse, batches) per (row pass, column pass) where the thread works."""
    C, R, G, ks, kc, chunks = geo["C"], geo["R"], geo["G"], geo["ks"], geo["kc"], geo["chunks"]
    c, g, r = tid % C, (tid // C) % G, tid // (C * G)
    row_begin = block * geo["rows_per_cta"]
    row_end = min(rows, row_begin + geo["rows_per_cta"])
    for row0 in range(row_begin, row_end, R):
        row = row0 + r
        if row >= row_end:
            continue
        for chunk0 in range(0, chunks, C * kc):
            my_chunks = [chunk0 + c + k * C for k in range(kc) if chunk0 + c + k * C < chunks]
            if kc > 1:  # one batch of all splits, group 0 only
                splits = list(range(num_splits)) if g == 0 else []
                batches = 1 if g == 0 else 0
            else:
                splits = list(range(g, num_splits, G))
                batches = -(-len(splits) // ks)
            loads = [(row, s, ch) for s in splits for ch in my_chunks]
            stores = [(row, ch) for ch in my_chunks] if g == 0 else []
            yield row, loads, stores, g == 0 and chunk0 == 0 and c == 0, batches


GEOMETRY_CASES = [
    # (num_splits, batch, seqlen, nheads, head_dim, num_sms)
    (29, 1, 1, 32, 128, 132),   # decode: 32 rows to merge
    (8, 128, 1, 32, 128, 132),  # large: 4096 rows
    (2, 8, 64, 8, 128, 132),    # many rows, few splits
    (1, 2, 3, 5, 64, 132),
    (3, 2, 3, 5, 72, 132),
    (4, 1, 1, 1, 4, 132),
    (5, 1, 1, 1, 8, 1),
    (17, 2, 3, 5, 256, 132),
    (64, 2, 3, 5, 128, 132),
    (128, 2, 3, 5, 128, 132),
    (256, 1, 1, 3, 256, 132),
    (12, 4, 5, 30, 128, 132),   # two split groups per row
    (9, 3, 7, 11, 1028, 8),     # column passes
    (6, 5, 7, 9, 12, 2),        # row passes
]


@pytest.mark.parametrize("num_splits, batch, seqlen, nheads, head_dim, num_sms", GEOMETRY_CASES,
                         ids=lambda v: str(v))
def test_grid_covers_every_row_split_and_chunk_once(monkeypatch, num_splits, batch, seqlen, nheads, head_dim,
                                                     num_sms):
    threads, grid = launch(monkeypatch, num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads,
                           head_dim=head_dim, num_sms=num_sms)
    assert threads == THREADS
    assert grid[1] == grid[2] == 1 and 1 <= grid[0] <= 2**31 - 1
    rows = batch * seqlen * nheads
    geo = device_geometry(rows, num_splits, head_dim, grid[0])
    assert geo["R"] * geo["G"] * geo["C"] == THREADS
    loads, stores, lse_rows = [], [], []
    for block in range(grid[0]):
        for tid in range(THREADS):
            for row, thread_loads, thread_stores, writes_lse, _ in thread_work(geo, num_splits, block, tid, rows):
                loads += thread_loads
                stores += thread_stores
                lse_rows += [row] if writes_lse else []
    chunks = head_dim // 4
    assert sorted(loads) == [(r, s, c) for r in range(rows) for s in range(num_splits) for c in range(chunks)]
    assert sorted(stores) == [(r, c) for r in range(rows) for c in range(chunks)]
    assert sorted(lse_rows) == list(range(rows))


@pytest.mark.parametrize("num_splits, batch, nheads, head_dim, expect", [
    # decode (batch 1, 32 heads, 29 splits): a CTA per row, 8 split groups, <= 4 splits per thread
    # in as many load slots (ks; 16 splits: 2 over 8 groups at d128, 1 over 16 at d64)
    (29, 1, 32, 128, dict(grid=32, R=1, G=8, C=32, ks=4)),
    (29, 1, 32, 256, dict(grid=32, R=1, G=4, C=64, ks=8)),
    (16, 1, 32, 128, dict(grid=32, R=1, G=8, C=32, ks=2)),
    (16, 1, 32, 64, dict(grid=32, R=1, G=16, C=16, ks=1)),
    (64, 1, 32, 128, dict(grid=32, R=1, G=8, C=32, ks=8)),
    # large (batch 128 x 32 heads x 8 splits): one split group per row, 8 rows per CTA
    (8, 128, 32, 128, dict(grid=512, R=8, G=1, C=32, ks=8)),
    (8, 128, 32, 256, dict(grid=1024, R=4, G=1, C=64, ks=8)),
    # few splits: each thread takes 4 column chunks of both splits; rows spread over all SMs
    # (group 1 idles: 256 CTAs of 16 rows rather than 128 of 32)
    (2, 128, 32, 128, dict(grid=256, R=16, G=2, C=8, ks=2)),
    (2, 256, 32, 128, dict(grid=256, R=32, G=1, C=8, ks=2)),
])
def test_decode_and_large_shapes_take_one_batch_of_loads(monkeypatch, num_splits, batch, nheads, head_dim, expect):
    """One batch per thread is one global round trip: every load of it is in flight at once."""
    _, grid = launch(monkeypatch, num_splits=num_splits, batch=batch, seqlen=1, nheads=nheads, head_dim=head_dim)
    rows = batch * nheads
    geo = device_geometry(rows, num_splits, head_dim, grid[0])
    assert dict(grid=grid[0], R=geo["R"], G=geo["G"], C=geo["C"], ks=geo["ks"]) == expect
    for tid in range(THREADS):
        for *_, batches in thread_work(geo, num_splits, 0, tid, rows):
            assert batches <= 1


def test_kernel_and_launcher_agree_on_threads_and_splits(monkeypatch):
    threads, _ = launch(monkeypatch, num_splits=3, batch=1, seqlen=1, nheads=1, head_dim=64)
    assert threads == THREADS
    assert cuh_constant("kMaxSplits") == validate.MAX_COMBINE_SPLITS
    source = render.render_instance(KernelSpec("combine", "sm80", "sm_90a", "bf16"))
    assert "__launch_bounds__(flashgen::kCombineThreads" in source
    assert "combine_splits<__nv_bfloat16>" in source


# ---------------------------------------------------------------------------------------------
# The kernel on the host

_SHIM = r"""
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __grid_constant__

struct Dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 gridDim, blockDim;
inline std::barrier<>* g_barrier = nullptr;
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline void grid_dependency_wait() {}  // the host runs one kernel at a time
using std::max;
using std::min;

struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct __half { uint16_t bits; };
struct __nv_bfloat16 { uint16_t bits; };
struct __half2 { uint16_t lo, hi; };
struct __nv_bfloat162 { uint16_t lo, hi; };
inline uint16_t to_half(float f) {  // round to nearest even, as __floats2half2_rn
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) return uint16_t(sign | 0x7e00u);
    if (mag >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (mag < 0x38800000u) {  // half subnormal (or zero)
        float a; memcpy(&a, &mag, 4);
        return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f)));
    }
    uint32_t r = mag - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
}
inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
inline __half2 __floats2half2_rn(float a, float b) { return {to_half(a), to_half(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {to_bf16(a), to_bf16(b)}; }

// Every global read must lie inside the partial tensors and be aligned; the others are counted
// (and not performed).
struct Range { const char* lo; const char* hi; };
inline Range g_read_ranges[2];
inline std::atomic<int> g_bad_reads{0};
inline bool check_read(const void* p, int bytes) {
    const char* c = static_cast<const char*>(p);
    for (const Range& r : g_read_ranges) {
        if (c >= r.lo && c + bytes <= r.hi && reinterpret_cast<uintptr_t>(c) % bytes == 0) return true;
    }
    ++g_bad_reads;
    return false;
}

namespace flashgen {
using int64_t = long long;
using uint32_t = unsigned int;
#define kInfinity (std::numeric_limits<float>::infinity())
struct FastDivmod { int divisor; uint32_t multiplier; uint32_t shift; };
inline uint32_t smem_u32(const void*) { return 0; }
}  // namespace flashgen
"""

_MAIN = r"""
#include "combine.cuh"
#include <thread>
#include <vector>
using namespace flashgen;
template <typename OutT>
static void run(const CombineParams* p, unsigned grid, unsigned threads) {
    gridDim.x = grid;
    blockDim.x = threads;
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(threads);
        g_barrier = &bar;
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t)
            pool.emplace_back([=] { blockIdx.x = b; threadIdx.x = t; combine_splits<OutT>(*p); });
        for (auto& t : pool) t.join();
    }
}
extern "C" int host_combine(const void* params, int dtype, unsigned grid, unsigned threads,
                            const char* o_lo, const char* o_hi, const char* l_lo, const char* l_hi) {
    g_bad_reads = 0;
    g_read_ranges[0] = {o_lo, o_hi};
    g_read_ranges[1] = {l_lo, l_hi};
    auto p = static_cast<const CombineParams*>(params);
    if (dtype == 0) run<float>(p, grid, threads);
    else if (dtype == 1) run<__half>(p, grid, threads);
    else run<__nv_bfloat16>(p, grid, threads);
    return g_bad_reads;
}
"""

# The device-only helpers of combine.cuh and their host stand-ins.
_HOST_HELPERS = {
    r"void combine_cp_async_16\(float4\* smem, const float\* gmem\) \{.*?\n\}":
        "void combine_cp_async_16(float4* smem, const float* gmem) { if (check_read(gmem, 16)) memcpy(smem, gmem, 16); }",
    r"void combine_cp_async_4\(float\* smem, const float\* gmem\) \{.*?\n\}":
        "void combine_cp_async_4(float* smem, const float* gmem) { if (check_read(gmem, 4)) memcpy(smem, gmem, 4); }",
    r"void combine_cp_async_wait_all\(\) \{.*?\}\n": "void combine_cp_async_wait_all() {}\n",
}


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    work = tmp_path_factory.mktemp("combine-host")
    probe = work / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    if subprocess.run([compiler, "-std=c++20", "-pthread", str(probe), "-o", str(work / "probe")],
                      capture_output=True).returncode:
        pytest.skip(f"{compiler} has no C++20 <barrier>")
    source = COMBINE_CUH
    for pattern, replacement in _HOST_HELPERS.items():
        source, count = re.subn(pattern, replacement, source, flags=re.S)
        assert count == 1, f"combine.cuh changed: update the host stand-in for {pattern!r}"
    assert "asm" not in source, "combine.cuh has inline assembly the host build cannot run"
    (work / "combine.cuh").write_text(source)
    (work / "common.cuh").write_text(_SHIM)
    (work / render.PARAMS_HEADER).write_text(render.render_params_header())
    (work / "main.cpp").write_text(_MAIN)
    library = work / "libcombine.so"
    result = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{work}", str(work / "main.cpp"),
         "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    lib = ctypes.CDLL(str(library))
    lib.host_combine.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p] * 4
    lib.host_combine.restype = ctypes.c_int
    return lib


def _extent(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


HOST_CASES = [
    # (num_splits, batch, seqlen, nheads, head_dim, out dtype, strided, num_sms, forced grid)
    (29, 1, 1, 32, 128, torch.bfloat16, False, 132, None),  # decode: 4 splits per group
    (16, 1, 1, 32, 128, torch.bfloat16, False, 132, None),  # decode: 2 splits per group
    (16, 1, 1, 32, 64, torch.float16, True, 132, None),     # decode: 1 split per group
    (1, 2, 3, 5, 64, torch.float32, False, 132, None),
    (2, 2, 3, 5, 72, torch.float16, True, 132, None),
    (3, 2, 3, 5, 12, torch.bfloat16, True, 2, None),
    (5, 2, 3, 5, 256, torch.float32, False, 132, None),
    (12, 4, 5, 3, 128, torch.float32, False, 8, None),     # two split groups per row
    (130, 1, 2, 3, 128, torch.float32, True, 132, None),   # three batches per thread
    (256, 1, 1, 2, 260, torch.float16, False, 132, None),  # column passes, kMaxSplits
    (8, 2, 3, 5, 128, torch.float32, False, 132, 1),       # row passes (any grid is correct)
    (40, 2, 3, 5, 64, torch.bfloat16, True, 132, 7),
    (6, 2, 3, 5, 8, torch.float32, False, 132, 40),        # more CTAs than rows
]


@pytest.mark.parametrize("num_splits, batch, seqlen, nheads, head_dim, dtype, strided, num_sms, forced_grid",
                         HOST_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_kernel_on_host_matches_reference(monkeypatch, host_kernel, num_splits, batch, seqlen, nheads, head_dim,
                                          dtype, strided, num_sms, forced_grid):
    from flashgen.testing import assert_lse_close
    from flashgen.testing_kvcache import combine_ref

    gen = torch.Generator().manual_seed(num_splits * 1000 + head_dim)
    shape = (num_splits, batch, seqlen, nheads)
    if strided:  # padded views with odd strides everywhere
        out_partial = torch.randn(num_splits + 1, batch, seqlen + 1, nheads + 2, head_dim + 8, generator=gen)
        out_partial = out_partial[1:, :, 1:, 1:-1, 4:4 + head_dim]
        lse_partial = torch.randn(num_splits, 2 * batch, nheads + 1, 3 * seqlen, generator=gen)
        lse_partial = lse_partial[:, ::2, 1:, ::3].permute(0, 1, 3, 2)
    else:
        out_partial = torch.randn(*shape, head_dim, generator=gen)
        lse_partial = torch.randn(*shape, generator=gen)
    lse_partial.mul_(4.0)
    empty = torch.rand(shape, generator=gen) < 0.3  # splits that saw no key: lse -inf, O NaN
    empty[:, 0, 0, 0] = True                         # and a row no split saw
    lse_partial[empty] = -math.inf
    out_partial[empty] = math.nan
    # out and lse inside sentinel-filled buffers: nothing around them may be written.
    out_buffer = torch.full((batch, seqlen + 1, 2 * nheads, head_dim + 4), 77.0, dtype=dtype)
    out = out_buffer[:, :seqlen, ::2, :head_dim] if strided else out_buffer[:, :seqlen, :nheads, :head_dim]
    lse_buffer = torch.full((batch, nheads + 1, 2 * seqlen), 99.0)
    lse = lse_buffer[:, :nheads, ::2].transpose(1, 2)
    out_before, lse_before = out_buffer.clone(), lse_buffer.clone()

    def run(spec, threads, grid, params):
        o_lo, o_hi = _extent(out_partial)
        l_lo, l_hi = _extent(lse_partial)
        code = {"fp32": 0, "fp16": 1, "bf16": 2}[spec.dtype]
        bad_reads = host_kernel.host_combine(params, code, forced_grid or grid[0], threads, o_lo, o_hi, l_lo, l_hi)
        assert bad_reads == 0, f"{bad_reads} out-of-bounds or misaligned reads"

    stub_device(monkeypatch, num_sms, run)
    execute.launch_combine(
        out_partial, lse_partial, out, lse, partial_strides=out_partial.stride()[:4],
        lse_partial_strides=lse_partial.stride(), out_strides=out.stride()[:3], lse_strides=lse.stride(),
        num_splits=num_splits, batch=batch, seqlen=seqlen, nheads=nheads, head_dim=head_dim,
    )

    out_ref, lse_ref = combine_ref(out_partial, lse_partial)
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), out_ref, rtol=rtol, atol=1e-5)
    assert_lse_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    assert (out[torch.isneginf(lse_ref)] == 0).all(), "rows no split saw must be exactly 0"
    written = torch.zeros(out_buffer.shape, dtype=torch.bool)
    (written[:, :seqlen, ::2, :head_dim] if strided else written[:, :seqlen, :nheads, :head_dim]).fill_(True)
    assert torch.equal(out_buffer[~written], out_before[~written]), "written outside out"
    lse_written = torch.zeros(lse_buffer.shape, dtype=torch.bool)
    lse_written[:, :nheads, ::2] = True
    assert torch.equal(lse_buffer[~lse_written], lse_before[~lse_written]), "written outside lse"

def test_cluster_merge_size_matches_the_dispatcher():
    """fwd_sm80.cuh's cluster merge reads at most kMaxClusterSplits splits: the dispatcher merges
    no more in a cluster."""
    from flashgen.runtime import tuning

    source = (TEMPLATES / "fwd_sm80.cuh").read_text()
    match = re.search(r"constexpr int kMaxClusterSplits = (\d+);", source)
    assert match and int(match.group(1)) == tuning.DEFAULT.decode_cluster_splits <= 8  # the portable cluster size
