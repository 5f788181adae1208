// Row kernels around the backward main kernel, one warp per (batch, query, head) row:
//   preprocess:  D = rowsum(dO ∘ O) in fp32 (the softmax's backward term), the LSE in log2 units,
//                dq_accum row zeroed;
//   postprocess: dQ = softmax_scale * dq_accum, in the input dtype and the caller's strides.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "append.cuh"

namespace flashgen {

template <typename T, int kWarps, bool kPost>
__device__ __forceinline__ void bwd_rows(const BwdRowParams& p) {
    int const lane = threadIdx.x % 32;
    int64_t const row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= int64_t(p.batch) * p.seqlen_q * p.nheads) return;
    int const head = int(row % p.nheads);
    int const i = int((row / p.nheads) % p.seqlen_q);
    int const b = int(row / (int64_t(p.nheads) * p.seqlen_q));
    // dq_accum and D are (batch, nheads, seqlen_q[, head_dim]).
    int64_t const stats_row = (int64_t(b) * p.nheads + head) * p.seqlen_q + i;
    float* dq_accum = reinterpret_cast<float*>(p.dq_accum_ptr) + stats_row * p.head_dim;
    if constexpr (!kPost) {
        const T* o = reinterpret_cast<const T*>(p.o_ptr) + b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride;
        const T* dout = reinterpret_cast<const T*>(p.do_ptr) + b * p.do_batch_stride + i * p.do_row_stride + head * p.do_head_stride;
        float dot = 0.f;
        for (int j = lane; j < p.head_dim; j += 32) {
            dot += to_float(o[j]) * to_float(dout[j]);
            dq_accum[j] = 0.f;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
        if (lane == 0) {
            reinterpret_cast<float*>(p.dsum_ptr)[stats_row] = dot;
            // The main kernel's exponent is score · scale · log2(e) - this: +inf for a row that saw
            // no key (lse -inf) makes its probabilities exactly 0.
            float const lse = reinterpret_cast<const float*>(p.lse_ptr)[stats_row];
            reinterpret_cast<float*>(p.lse_log2_ptr)[stats_row] = lse == -kInfinity ? kInfinity : lse * 1.4426950408889634f;
        }
    } else {
        T* dq = reinterpret_cast<T*>(p.dq_ptr) + b * p.dq_batch_stride + i * p.dq_row_stride + head * p.dq_head_stride;
        for (int j = lane; j < p.head_dim; j += 32) dq[j] = from_float<T>(dq_accum[j] * p.softmax_scale);
    }
}

}  // namespace flashgen
