// Row kernels around the backward main kernel, over (batch, query, head) rows:
//   preprocess:  D = rowsum(dO ∘ O) in fp32 (the softmax's backward term), the LSE in log2 units,
//                dq_accum row zeroed;
//   postprocess: dQ = softmax_scale * dq_accum, in the input dtype and the caller's strides.
// Both only move memory (at short sequence lengths they are a fifth of the backward's time), so
// rows go in 16-byte chunks: a row of d columns is d / 8 lanes' work, a warp takes 32 / those
// lanes rows at once (the threads of a row the next power of two, at most 32). Rows whose
// pointers or strides are not whole chunks (or d not a multiple of 8) take the element loop.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "append.cuh"

namespace flashgen {

__device__ __forceinline__ float2 unpack2_float(uint32_t bits, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
__device__ __forceinline__ float2 unpack2_float(uint32_t bits, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
__device__ __forceinline__ uint32_t pack2_storage(float lo, float hi, __half) { return half_t::pack2(lo, hi); }
__device__ __forceinline__ uint32_t pack2_storage(float lo, float hi, __nv_bfloat16) { return bfloat16_t::pack2(lo, hi); }
__device__ __forceinline__ bool chunk_aligned(const void* ptr) { return reinterpret_cast<unsigned long long>(ptr) % 16 == 0; }

// Threads per row: the chunks of a row rounded up to a power of two, at most a warp (the host's
// grid uses the same rule, tiles.bwd_row_threads).
__device__ __forceinline__ int bwd_row_threads(int head_dim) {
    int const chunks = head_dim / 8;
    int threads = 1;
    while (threads < chunks && threads < 32) threads *= 2;
    return threads;
}

template <typename T, int kWarps, bool kPost>
__device__ __forceinline__ void bwd_rows(const BwdRowParams& p) {
    int64_t const rows = int64_t(p.batch) * p.seqlen_q * p.nheads;
    int const head_dim = p.head_dim;
    bool const chunked =
        head_dim % 8 == 0 &&
        (kPost ? (chunk_aligned(p.dq_ptr) && ((p.dq_batch_stride | p.dq_row_stride | p.dq_head_stride) % 8) == 0)
               : (chunk_aligned(p.o_ptr) && chunk_aligned(p.do_ptr) &&
                  ((p.o_batch_stride | p.o_row_stride | p.o_head_stride | p.do_batch_stride | p.do_row_stride |
                    p.do_head_stride) % 8) == 0));
    // Lanes of a row: `threads` consecutive lanes (chunks in 16-byte steps), or a whole warp over
    // elements in the fallback.
    int const threads = chunked ? bwd_row_threads(head_dim) : 32;
    int const rows_per_warp = 32 / threads;
    int const lane = threadIdx.x % 32, lane_in_row = lane % threads;
    int64_t const first = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * rows_per_warp + lane / threads;
    int64_t const stride = int64_t(gridDim.x) * kWarps * rows_per_warp;
    for (int64_t row = first; row - lane / threads < rows; row += stride) {  // whole warps iterate together
        bool const active = row < rows;
        int64_t const r = active ? row : rows - 1;
        int const head = int(r % p.nheads);
        int const i = int((r / p.nheads) % p.seqlen_q);
        int const b = int(r / (int64_t(p.nheads) * p.seqlen_q));
        // dq_accum and D are (batch, nheads, seqlen_q[, head_dim]).
        int64_t const stats_row = (int64_t(b) * p.nheads + head) * p.seqlen_q + i;
        float* dq_accum = reinterpret_cast<float*>(p.dq_accum_ptr) + stats_row * head_dim;
        if constexpr (!kPost) {
            const T* o = reinterpret_cast<const T*>(p.o_ptr) + b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride;
            const T* dout = reinterpret_cast<const T*>(p.do_ptr) + b * p.do_batch_stride + i * p.do_row_stride + head * p.do_head_stride;
            float dot = 0.f;
            if (chunked) {
                for (int j = lane_in_row * 8; active && j < head_dim; j += threads * 8) {
                    uint4 const ov = *reinterpret_cast<const uint4*>(o + j);
                    uint4 const dv = *reinterpret_cast<const uint4*>(dout + j);
                    uint32_t const ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        float2 const of = unpack2_float(ow[w], T()), df = unpack2_float(dw[w], T());
                        dot += of.x * df.x + of.y * df.y;
                    }
                    float4 const zero = make_float4(0.f, 0.f, 0.f, 0.f);
                    reinterpret_cast<float4*>(dq_accum + j)[0] = zero;
                    reinterpret_cast<float4*>(dq_accum + j)[1] = zero;
                }
                for (int offset = threads / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
            } else {
                for (int j = lane; active && j < head_dim; j += 32) {
                    dot += to_float(o[j]) * to_float(dout[j]);
                    dq_accum[j] = 0.f;
                }
#pragma unroll
                for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
            }
            if (active && lane_in_row == 0) {
                reinterpret_cast<float*>(p.dsum_ptr)[stats_row] = dot;
                // The main kernel's exponent is score · scale · log2(e) - this: +inf for a row that saw
                // no key (lse -inf) makes its probabilities exactly 0.
                float const lse = reinterpret_cast<const float*>(p.lse_ptr)[stats_row];
                reinterpret_cast<float*>(p.lse_log2_ptr)[stats_row] = lse == -kInfinity ? kInfinity : lse * 1.4426950408889634f;
            }
        } else {
            T* dq = reinterpret_cast<T*>(p.dq_ptr) + b * p.dq_batch_stride + i * p.dq_row_stride + head * p.dq_head_stride;
            if (chunked) {
                for (int j = lane_in_row * 8; active && j < head_dim; j += threads * 8) {
                    float4 const lo = reinterpret_cast<const float4*>(dq_accum + j)[0];
                    float4 const hi = reinterpret_cast<const float4*>(dq_accum + j)[1];
                    float const s = p.softmax_scale;
                    *reinterpret_cast<uint4*>(dq + j) =
                        make_uint4(pack2_storage(lo.x * s, lo.y * s, T()), pack2_storage(lo.z * s, lo.w * s, T()),
                                   pack2_storage(hi.x * s, hi.y * s, T()), pack2_storage(hi.z * s, hi.w * s, T()));
                }
            } else {
                for (int j = lane; active && j < head_dim; j += 32) dq[j] = from_float<T>(dq_accum[j] * p.softmax_scale);
            }
        }
    }
}

}  // namespace flashgen
