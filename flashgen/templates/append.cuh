// KV-cache append with rotary embedding, run before attention in flash_attn_with_kvcache.
//
// blockIdx.y picks the job: 0 rotates q into a new buffer, 1 rotates the new k and writes it into
// the cache, 2 writes the new v into the cache. One warp per (batch, row, head): lanes walk the
// rotary pairs, then copy the rest of the head dim. Rotary pairs are (j, j + rotary_dim/2)
// (GPT-NeoX) or (2j, 2j + 1) (GPT-J, interleaved), at the row's absolute cache position.
//
// Cache writes are bounds-checked against the cache tensors: a position past the capacity, a
// cache_batch_idx or a block-table entry outside the cache skips the write instead of scribbling.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"

namespace flashgen {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T, int kWarps>
__device__ __forceinline__ void append_rotary(const AppendParams& p) {
    int const job = blockIdx.y;  // 0: q, 1: k, 2: v
    int const lane = threadIdx.x % 32;
    int const nheads = job == 0 ? p.nheads : p.nheads_k;
    int const seqlen = job == 0 ? p.seqlen_q : p.seqlen_new;
    int64_t const row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= int64_t(p.batch) * seqlen * nheads) return;
    int const head = int(row % nheads);
    int const i = int((row / nheads) % seqlen);
    int const b = int(row / (int64_t(nheads) * seqlen));
    int const cache_len = p.cache_seqlens_ptr != nullptr
                              ? reinterpret_cast<const int*>(p.cache_seqlens_ptr)[b] : 0;

    const T* src;
    T* dst;
    int position;  // absolute cache index of this row, for the rotary tables
    if (job == 0) {
        src = reinterpret_cast<const T*>(p.q_ptr) + b * p.q_batch_stride + i * p.q_row_stride + head * p.q_head_stride;
        dst = reinterpret_cast<T*>(p.q_out_ptr) + b * p.q_out_batch_stride + i * p.q_out_row_stride +
              head * p.q_out_head_stride;
        position = cache_len + (p.q_rotary_per_row ? i : 0);
    } else {
        bool const is_k = job == 1;
        position = cache_len + i;
        if (position < 0 || position >= p.cache_capacity) return;
        int64_t row_offset;
        if (p.block_table_ptr != nullptr) {
            int offset;
            int const page_idx = p.page_size.divmod(offset, position);
            int const page = reinterpret_cast<const int*>(p.block_table_ptr)[b * p.block_table_batch_stride + page_idx];
            if (page < 0 || page >= p.cache_batch) return;
            row_offset = page * (is_k ? p.k_cache_batch_stride : p.v_cache_batch_stride) +
                         offset * (is_k ? p.k_cache_row_stride : p.v_cache_row_stride);
        } else {
            int const cache_b = p.cache_batch_idx_ptr != nullptr
                                    ? reinterpret_cast<const int*>(p.cache_batch_idx_ptr)[b] : b;
            if (cache_b < 0 || cache_b >= p.cache_batch) return;
            row_offset = cache_b * (is_k ? p.k_cache_batch_stride : p.v_cache_batch_stride) +
                         position * (is_k ? p.k_cache_row_stride : p.v_cache_row_stride);
        }
        if (is_k) {
            src = reinterpret_cast<const T*>(p.k_new_ptr) + b * p.k_new_batch_stride + i * p.k_new_row_stride +
                  head * p.k_new_head_stride;
            dst = reinterpret_cast<T*>(p.k_cache_ptr) + row_offset + head * p.k_cache_head_stride;
        } else {
            src = reinterpret_cast<const T*>(p.v_new_ptr) + b * p.v_new_batch_stride + i * p.v_new_row_stride +
                  head * p.v_new_head_stride;
            dst = reinterpret_cast<T*>(p.v_cache_ptr) + row_offset + head * p.v_cache_head_stride;
        }
    }

    int const rotary_dim = job == 2 ? 0 : p.rotary_dim;
    int const half_dim = rotary_dim / 2;
    if (half_dim > 0) {
        int const ro_row = min(max(position, 0), p.seqlen_ro - 1);  // host checks; never read outside
        const float* cos_row = reinterpret_cast<const float*>(p.cos_ptr) + int64_t(ro_row) * half_dim;
        const float* sin_row = reinterpret_cast<const float*>(p.sin_ptr) + int64_t(ro_row) * half_dim;
        for (int j = lane; j < half_dim; j += 32) {
            int const a = p.rotary_interleaved ? 2 * j : j;
            int const c = p.rotary_interleaved ? 2 * j + 1 : j + half_dim;
            float const x0 = to_float(src[a]), x1 = to_float(src[c]);
            float const cs = cos_row[j], sn = sin_row[j];
            dst[a] = from_float<T>(x0 * cs - x1 * sn);
            dst[c] = from_float<T>(x0 * sn + x1 * cs);
        }
    }
    for (int j = rotary_dim + lane; j < p.head_dim; j += 32) dst[j] = src[j];
}

}  // namespace flashgen
