// Split-KV combine: merges num_splits partial outputs of one row with the numerically stable LSE
// weighting  w_s = exp(lse_s - lse_max) / sum_t exp(lse_t - lse_max),  out = sum_s w_s * O_s,
// lse = lse_max + log(sum_t exp(lse_t - lse_max)). A split that saw no key has lse_s = -inf and
// weight 0 (selected away, never multiplied: its partial row may hold NaN); a row no split saw gets
// out = 0 and lse = -inf.
//
// Latency is the point: at decode a few dozen rows are merged, and the kernel must not chain global
// round trips. Every thread first issues all the loads of a batch, the lse of its splits and their
// partial float4 chunks, global -> shared with cp.async (so the compiler can neither sink them below
// the arithmetic nor split them into dependent groups, and they hold no registers while in flight;
// the partial rows do not depend on the weights), then waits once: a batch costs one round trip.
// A thread keeps the running max m and sum of exp(lse - m) of its own splits (rescaling, as in
// online softmax, on a second batch, which only more than 8 splits per thread need), and the split
// groups of a row merge their (m, sum, acc) through shared memory.
//
// Geometry: a CTA of kCombineThreads threads is R rows x G split groups x C column threads, all
// powers of two. C covers the head dim in float4 chunks (each thread kKc chunks, strided by C); the
// splits of a row are dealt round-robin to its G groups (each thread kKs splits per batch). With
// more than 4 splits kKc = 1 and kKs = min(8, next_pow2(ceil(num_splits / G))); few splits (<= 4)
// give a thread kKc = 8 / kKs column chunks of all of them instead (kKs = next_pow2(num_splits)), so
// it still has 8 loads in flight, and only group 0 works. R comes from the grid, the host's only
// knob (see launch_combine in flashgen/runtime/interface.py): a CTA takes ceil(rows / gridDim.x)
// consecutive rows, R = min(next_pow2 of that, threads / C) at a time, and G = threads / (R * C).
// Few rows per CTA -> many split groups per row. Any grid is correct; the host picks R for speed.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"

namespace flashgen {

template <typename OutT>
__device__ __forceinline__ void store4(OutT* dst, float4 v);

template <>
__device__ __forceinline__ void store4<float>(float* dst, float4 v) {
    *reinterpret_cast<float4*>(dst) = v;
}
template <>
__device__ __forceinline__ void store4<__half>(__half* dst, float4 v) {
    __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    uint2 packed = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
    *reinterpret_cast<uint2*>(dst) = packed;
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
    *reinterpret_cast<uint2*>(dst) = packed;
}

// Up to kMaxSplits splits (MAX_COMBINE_SPLITS in flashgen/runtime/validate.py).
constexpr int kMaxSplits = 256;
// Threads per CTA: launch_combine launches exactly this many (tests/test_combine_geometry.py).
constexpr int kCombineThreads = 256;
// CTAs per SM the register budget is set for (__launch_bounds__): 4 x 256 threads at <= 64 registers,
// which the shared memory allows on Hopper too (4 x 46 KiB; 3 on the A100).
constexpr int kCombineMinBlocks = 4;
// Partial float4 chunks one thread has in flight per batch (kKs splits x kKc column chunks).
constexpr int kCombineLoads = 8;
// Column threads per row at most (256 columns per batch at kKc = 1; wider rows loop).
constexpr int kCombineMaxColThreads = 64;
static_assert((kCombineThreads & (kCombineThreads - 1)) == 0, "kCombineThreads must be a power of two");
static_assert((kCombineMaxColThreads & (kCombineMaxColThreads - 1)) == 0 && kCombineMaxColThreads <= kCombineThreads,
              "a row's column threads must be a power of two that fits in a CTA");

// 46 KiB. The stage slots are per thread (no barrier around them); the merge's are shared.
struct CombineSmem {
    float4 stage_o[kCombineLoads][kCombineThreads];   // each thread's batch of partial chunks,
    float stage_lse[kCombineLoads][kCombineThreads];  // and of its splits' lse
    float4 acc[kCombineThreads];                      // the split-group merge (kKc = 1): each thread's acc,
    float m[kCombineThreads];                         // and per (row, group) the running max
    float sum[kCombineThreads];                       // and sum of exp(lse - max)
};
static_assert(sizeof(CombineSmem) <= 48 * 1024, "static shared memory is limited to 48 KiB");

// cp.async of 16 and 4 bytes and the wait for all of them, with "memory" clobbers so that the
// compiler keeps the shared-memory reads of the staged values after the wait (common.cuh's have none).
__device__ __forceinline__ void combine_cp_async_16(float4* smem, const float* gmem) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void combine_cp_async_4(float* smem, const float* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void combine_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ int log2_ceil(int x) { return x <= 1 ? 0 : 32 - __clz(x - 1); }

// a / b for 0 <= a < 2^63 and 0 < b < 2^32. In 32 bits when a fits, the case of every realistic
// problem; otherwise by long division (no call to the 64-bit division routine, which would set the
// kernel's register count).
using u64 = unsigned long long;

__device__ __forceinline__ int64_t div_nonneg(int64_t a, uint32_t b) {
    if (a <= 0xffffffffll) return int64_t(uint32_t(a) / b);
    uint32_t const hi = uint32_t(u64(a) >> 32), lo = uint32_t(a);
    uint32_t const q_hi = hi / b;
    u64 rem = hi - q_hi * b;  // < b
    uint32_t q_lo = 0;
#pragma unroll 1
    for (int i = 31; i >= 0; --i) {
        rem = (rem << 1) | ((lo >> i) & 1u);
        if (rem >= b) {
            rem -= b;
            q_lo |= 1u << i;
        }
    }
    return int64_t((u64(q_hi) << 32) | q_lo);
}

__device__ __forceinline__ void add_weighted(float4& acc, float w, float4 o) {
    // Select, not multiply: a split that saw no key may hold anything, NaN included.
    acc.x += w != 0.f ? w * o.x : 0.f;
    acc.y += w != 0.f ? w * o.y : 0.f;
    acc.z += w != 0.f ? w * o.z : 0.f;
    acc.w += w != 0.f ? w * o.w : 0.f;
}

__device__ __forceinline__ float4 scale4(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

// One batch: cp.async the lse of the splits s0 + j * split_stride (j < kKs) into this thread's lse
// slots j and their partial chunks first_chunk + k * chunk_stride (k < kKc) into its chunk slots
// j * kKc + k. Nothing waits here: every load of the batch is in flight at once. Slots of
// out-of-range splits or chunks are not written: batch_weights reads such a lse as -inf (weight
// 0, which selects its chunks away), and such chunks are never stored.
template <int kKs, int kKc>
__device__ __forceinline__ void issue_batch(float* stage_lse, float4* stage_o, const CombineParams& p,
                                            const float* lse_in, const float* o_in, int s0, int split_stride,
                                            int first_chunk, int chunk_stride, int chunks) {
    int const num_splits = p.num_splits;
#pragma unroll
    for (int j = 0; j < kKs; ++j) {
        int const s = s0 + j * split_stride;
        if (s < num_splits) combine_cp_async_4(stage_lse + j * kCombineThreads, lse_in + s * p.lse_partial_split_stride);
    }
#pragma unroll
    for (int j = 0; j < kKs; ++j) {
        int const s = s0 + j * split_stride;
        const float* o_split = o_in + s * p.out_partial_split_stride;
#pragma unroll
        for (int k = 0; k < kKc; ++k) {
            int const chunk = first_chunk + k * chunk_stride;
            if (s < num_splits && chunk < chunks) {
                combine_cp_async_16(stage_o + (j * kKc + k) * kCombineThreads, o_split + chunk * 4);
            }
        }
    }
}

// Waits for an issued batch and computes its weights w_j = exp(lse_j - m) against the running max m,
// which it raises to the batch's lse; returns the factor that takes sums relative to the old m to
// the new one (0 while m was -inf, i.e. on a thread's first batch, where those sums are 0).
template <int kKs>
__device__ __forceinline__ float batch_weights(float (&w)[kKs], float& m, const float* stage_lse, int num_splits,
                                               int s0, int split_stride) {
    combine_cp_async_wait_all();
    float lse[kKs];
#pragma unroll
    for (int j = 0; j < kKs; ++j) lse[j] = s0 + j * split_stride < num_splits ? stage_lse[j * kCombineThreads] : -kInfinity;
    float m_new = m;
#pragma unroll
    for (int j = 0; j < kKs; ++j) m_new = fmaxf(m_new, lse[j]);
    float const shift = m_new == -kInfinity ? 0.f : m_new;
#pragma unroll
    for (int j = 0; j < kKs; ++j) w[j] = __expf(lse[j] - shift);  // exp(-inf) = 0: empty splits weigh nothing
    float const rescale = __expf(m - shift);
    m = m_new;
    return rescale;
}

// The CTA's geometry (see the top of the file) for kKc column chunks per thread: uniform over the CTA.
struct CombineGeometry {
    int64_t rows, rows_per_cta;
    int log_c, log_r, log_g;
};

__device__ __forceinline__ CombineGeometry combine_geometry(const CombineParams& p, int kKc) {
    CombineGeometry geo;
    int const chunks = p.head_dim / 4;
    geo.log_c = min(log2_ceil((chunks + kKc - 1) / kKc), log2_ceil(kCombineMaxColThreads));
    geo.rows = int64_t(p.batch) * p.seqlen * p.nheads;
    geo.rows_per_cta = div_nonneg(geo.rows + gridDim.x - 1, gridDim.x);
    geo.log_r = log2_ceil(int(min(geo.rows_per_cta, int64_t(kCombineThreads >> geo.log_c))));
    geo.log_g = log2_ceil(kCombineThreads) - geo.log_c - geo.log_r;
    return geo;
}

template <typename OutT, int kKs, int kKc>
__device__ __forceinline__ void combine_rows(const CombineParams& p, CombineSmem& smem, CombineGeometry const& geo) {
    static_assert(kKs * kKc <= kCombineLoads, "a batch stages at most kCombineLoads chunks a thread");
    int const num_splits = p.num_splits;
    int const chunks = p.head_dim / 4;  // float4 chunks per row
    int const log_c = geo.log_c, log_r = geo.log_r, log_g = geo.log_g;
    int64_t const rows = geo.rows, rows_per_cta = geo.rows_per_cta;
    int const C = 1 << log_c, R = 1 << log_r, G = 1 << log_g;
    int const tid = threadIdx.x;
    int const c = tid & (C - 1);
    int const g = (tid >> log_c) & (G - 1);
    int const r = tid >> (log_c + log_g);
    float4* const stage_o = &smem.stage_o[0][tid];
    float* const stage_lse = &smem.stage_lse[0][tid];
    int64_t const row_begin = int64_t(blockIdx.x) * rows_per_cta;
    int64_t const row_end = min(rows, row_begin + rows_per_cta);

    // The row and column passes are uniform over the CTA (the merge holds __syncthreads); there is
    // one of each unless a CTA has more than R rows or the head dim more than 4 * C * kKc columns.
    for (int64_t row0 = row_begin; row0 < row_end; row0 += R) {
        int64_t const row = row0 + r;
        bool const row_ok = row < row_end;
        // row enumerates (batch, position, head), head fastest.
        int64_t const row_c = row_ok ? row : row0;
        int64_t const bp = div_nonneg(row_c, uint32_t(p.nheads));
        int const head = int(row_c - bp * p.nheads);
        int64_t const b64 = div_nonneg(bp, uint32_t(p.seqlen));
        int const pos = int(bp - b64 * p.seqlen);
        int const b = int(b64);
        const float* lse_in = reinterpret_cast<const float*>(p.lse_partial_ptr) + b * p.lse_partial_batch_stride +
                              pos * p.lse_partial_row_stride + head * p.lse_partial_head_stride;
        const float* o_in = reinterpret_cast<const float*>(p.out_partial_ptr) + b * p.out_partial_batch_stride +
                            pos * p.out_partial_row_stride + head * p.out_partial_head_stride;
        OutT* const out = reinterpret_cast<OutT*>(p.out_ptr) + b * p.out_batch_stride + pos * p.out_row_stride +
                          head * p.out_head_stride;
        float* const lse_out = reinterpret_cast<float*>(p.lse_ptr) + b * p.lse_batch_stride + pos * p.lse_row_stride +
                               head * p.lse_head_stride;

        for (int chunk0 = 0; chunk0 < chunks; chunk0 += C * kKc) {
            float m = -kInfinity;  // running max of this thread's splits' lse
            float sum = 0.f;       // sum of exp(lse - m) over them
            if constexpr (kKc > 1) {
                // num_splits <= kKs <= 4: one batch of all the splits, in group 0; each chunk is
                // stored as soon as it is summed.
                if (row_ok && g == 0) {
                    issue_batch<kKs, kKc>(stage_lse, stage_o, p, lse_in, o_in, 0, 1, chunk0 + c, C, chunks);
                    float w[kKs];
                    batch_weights<kKs>(w, m, stage_lse, num_splits, 0, 1);
#pragma unroll
                    for (int j = 0; j < kKs; ++j) sum += w[j];
                    float const inv_sum = sum > 0.f ? __frcp_rn(sum) : 0.f;
#pragma unroll
                    for (int k = 0; k < kKc; ++k) {
                        int const chunk = chunk0 + c + k * C;
                        if (chunk < chunks) {
                            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                            for (int j = 0; j < kKs; ++j) add_weighted(acc, w[j], stage_o[(j * kKc + k) * kCombineThreads]);
                            store4<OutT>(out + chunk * 4, scale4(acc, inv_sum));
                        }
                    }
                }
            } else {
                // Thread (g, c) takes splits g, g + G, g + 2 * G, ..., kKs per batch: one batch
                // unless num_splits > kKs * G.
                float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
                int const split_end = row_ok ? num_splits : 0;
                for (int s0 = g; s0 < split_end; s0 += G * kKs) {
                    issue_batch<kKs, 1>(stage_lse, stage_o, p, lse_in, o_in, s0, G, chunk0 + c, C, chunks);
                    float w[kKs];
                    float const rescale = batch_weights<kKs>(w, m, stage_lse, num_splits, s0, G);
                    sum *= rescale;
                    acc = scale4(acc, rescale);
#pragma unroll
                    for (int j = 0; j < kKs; ++j) {
                        sum += w[j];
                        add_weighted(acc, w[j], stage_o[j * kCombineThreads]);
                    }
                }
                if (G > 1) {  // merge the row's split groups
                    __syncthreads();  // a previous pass's merge has read smem
                    smem.acc[tid] = acc;
                    if (c == 0) {
                        smem.m[tid >> log_c] = m;
                        smem.sum[tid >> log_c] = sum;
                    }
                    __syncthreads();
                    if (g == 0 && row_ok) {
                        int const base = r << log_g;  // the row's (row, group) slots
                        float m_row = -kInfinity;
#pragma unroll 8
                        for (int i = 0; i < G; ++i) m_row = fmaxf(m_row, smem.m[base + i]);
                        float const shift = m_row == -kInfinity ? 0.f : m_row;
                        acc = make_float4(0.f, 0.f, 0.f, 0.f);
                        sum = 0.f;
#pragma unroll 8
                        for (int i = 0; i < G; ++i) {
                            // A group's acc is finite (empty splits were selected away), and its
                            // scale is 0 when it saw nothing: a plain multiply is safe here.
                            float const scale = __expf(smem.m[base + i] - shift);
                            float4 const a = smem.acc[((base + i) << log_c) + c];
                            sum += scale * smem.sum[base + i];
                            acc.x += scale * a.x;
                            acc.y += scale * a.y;
                            acc.z += scale * a.z;
                            acc.w += scale * a.w;
                        }
                        m = m_row;
                    }
                }
                if (g == 0 && row_ok && chunk0 + c < chunks) {
                    store4<OutT>(out + (chunk0 + c) * 4, scale4(acc, sum > 0.f ? __frcp_rn(sum) : 0.f));
                }
            }
            if (g == 0 && row_ok && chunk0 == 0 && c == 0) *lse_out = sum > 0.f ? m + __logf(sum) : -kInfinity;
        }
    }
}

template <typename OutT>
__device__ __forceinline__ void combine_splits(const CombineParams& p) {
    __shared__ CombineSmem smem;
    // Launched as a programmatic dependent of the forward on sm_90 (launch_combine): wait for it.
    grid_dependency_wait();
    // No early griddepcontrol.launch_dependents: the next decode forward (a programmatic dependent)
    // would then be scheduled while these CTAs hold the SMs, and its grid of one CTA per SM ran
    // slower (H200, b4 x 32k keys: 143 against 123 us; presumably CTAs doubled up on some SMs).
    int const num_splits = p.num_splits;
    if (num_splits > 4) {
        // One column chunk of kKs splits a batch, kKs the fewest slots (a power of two, <= 8) that
        // hold a split group's share: unused slots would still cost their address arithmetic and
        // predicated loads, on the decode step's critical path (d128, 16 splits over 8 groups: 2;
        // H200, 32/8 heads, tune_decode.py: b2 x 16k 38.7 -> 37.8 us, d64 b1 x 32k 22.9 -> 22.2).
        CombineGeometry const geo = combine_geometry(p, 1);
        int const per_group = (num_splits + (1 << geo.log_g) - 1) >> geo.log_g;
        if (per_group > 4) {
            combine_rows<OutT, 8, 1>(p, smem, geo);
        } else if (per_group > 2) {
            combine_rows<OutT, 4, 1>(p, smem, geo);
        } else if (per_group > 1) {
            combine_rows<OutT, 2, 1>(p, smem, geo);
        } else {
            combine_rows<OutT, 1, 1>(p, smem, geo);
        }
    } else if (num_splits > 2) {
        combine_rows<OutT, 4, 2>(p, smem, combine_geometry(p, 2));
    } else if (num_splits > 1) {
        combine_rows<OutT, 2, 4>(p, smem, combine_geometry(p, 4));
    } else {
        combine_rows<OutT, 1, 8>(p, smem, combine_geometry(p, 8));
    }
}

}  // namespace flashgen
