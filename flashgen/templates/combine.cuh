// Split-KV combine: merges num_splits partial outputs of one row with the numerically stable LSE
// weighting  w_s = exp(lse_s - lse_max) / sum_t exp(lse_t - lse_max),  out = sum_s w_s * O_s,
// lse = lse_max + log(sum_t exp(lse_t - lse_max)). A split that saw no key has lse_s = -inf and
// weight 0; a row no split saw gets out = 0 and lse = -inf.
//
// One warp per row: lanes read the splits' lse values (32 at a time), reduce max and sum with
// shuffles, then stream the partial rows as float4 (lane l owns columns 4l.. of each 128).
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

// Up to kMaxSplits splits. The accumulation loop's only global loads are the partial rows, several
// in flight at once (unrolled, no branch around them).
constexpr int kMaxSplits = 256;

template <typename OutT, int kWarps>
__device__ __forceinline__ void combine_splits(const CombineParams& p) {
    constexpr int kPerLane = kMaxSplits / 32;
    int const lane = threadIdx.x % 32;
    int64_t const row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    int64_t const rows = int64_t(p.batch) * p.seqlen * p.nheads;
    if (row >= rows) return;
    // row enumerates (batch, position, head), head fastest.
    int const head = int(row % p.nheads);
    int const pos = int((row / p.nheads) % p.seqlen);
    int const b = int(row / (int64_t(p.nheads) * p.seqlen));
    int const num_splits = p.num_splits;
    const float* lse_in = reinterpret_cast<const float*>(p.lse_partial_ptr) + b * p.lse_partial_batch_stride +
                          pos * p.lse_partial_row_stride + head * p.lse_partial_head_stride;
    const float* o_in = reinterpret_cast<const float*>(p.out_partial_ptr) + b * p.out_partial_batch_stride +
                        pos * p.out_partial_row_stride + head * p.out_partial_head_stride;

    float weight[kPerLane];
    float lse_max = -kInfinity;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        int const s = lane + 32 * k;
        weight[k] = s < num_splits ? lse_in[s * p.lse_partial_split_stride] : -kInfinity;
        lse_max = fmaxf(lse_max, weight[k]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, offset));
    float const shift = lse_max == -kInfinity ? 0.f : lse_max;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        weight[k] = __expf(weight[k] - shift);  // exp(-inf) = 0: empty splits weigh nothing
        sum += weight[k];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    float const inv_sum = sum > 0.f ? 1.f / sum : 0.f;

    // The weights go to this warp's slice of shared memory: read back as broadcasts, with no
    // run-time indexing of registers.
    __shared__ float smem_weight[kWarps][kMaxSplits];
    float* w_smem = smem_weight[threadIdx.x / 32];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) w_smem[lane + 32 * k] = weight[k] * inv_sum;
    __syncwarp();

    OutT* out = reinterpret_cast<OutT*>(p.out_ptr) + b * p.out_batch_stride + pos * p.out_row_stride +
                head * p.out_head_stride;
    for (int col = lane * 4; col < p.head_dim; col += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < num_splits; ++s) {
            float const w = w_smem[s];
            float4 const o = *reinterpret_cast<const float4*>(o_in + s * p.out_partial_split_stride + col);
            // Select, not multiply: a split that saw no key may hold anything, NaN included.
            acc.x += w != 0.f ? w * o.x : 0.f;
            acc.y += w != 0.f ? w * o.y : 0.f;
            acc.z += w != 0.f ? w * o.z : 0.f;
            acc.w += w != 0.f ? w * o.w : 0.f;
        }
        store4<OutT>(out + col, acc);
    }
    if (lane == 0) {
        float* lse_out = reinterpret_cast<float*>(p.lse_ptr);
        lse_out[b * p.lse_batch_stride + pos * p.lse_row_stride + head * p.lse_head_stride] =
            sum > 0.f ? shift + __logf(sum) : -kInfinity;
    }
}

}  // namespace flashgen
