// The rows of one batch element, for the forward families (seq_extent) and the backward families
// (bwd_extent): varlen offsets (cu_seqlens), rows in use (seqused), the KV cache's left pad and
// batch index. Values come from the caller's tensors, so they are clamped to the tensors here
// rather than trusted.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"

namespace flashgen {

struct SeqExtent {
    int q_offset, seqlen_q;  // query rows [q_offset, q_offset + seqlen_q) of q, o and lse
    int k_offset, seqlen_k;  // keys: rows [k_offset, k_offset + seqlen_k) of K/V row kv_b (paged: k_offset 0)
    int kv_b;                // the K/V batch row (or the sequence's block-table row when paged)
};

template <bool kPaged>
__device__ __forceinline__ SeqExtent seq_extent(const FwdParams& params, int bidb) {
    const int* seqused = reinterpret_cast<const int*>(params.seqused_k_ptr);
    const int* leftpad_ptr = reinterpret_cast<const int*>(params.leftpad_k_ptr);
    const int* kv_batch_idx = reinterpret_cast<const int*>(params.kv_batch_idx_ptr);
    const int* cu_seqlens_q = reinterpret_cast<const int*>(params.cu_seqlens_q_ptr);
    const int* cu_seqlens_k = reinterpret_cast<const int*>(params.cu_seqlens_k_ptr);
    const int* seqused_q = reinterpret_cast<const int*>(params.seqused_q_ptr);
    SeqExtent e;
    // Varlen queries: sequence bidb is rows [q_offset, q_offset + seqlen_q) of q, o and lse.
    e.q_offset = 0;
    e.seqlen_q = params.seqlen_q;
    if (cu_seqlens_q != nullptr) {
        e.q_offset = min(max(cu_seqlens_q[bidb], 0), params.seqlen_q);
        e.seqlen_q = min(max(cu_seqlens_q[bidb + 1] - e.q_offset, 0), params.seqlen_q - e.q_offset);
    }
    if (seqused_q != nullptr) e.seqlen_q = min(max(seqused_q[bidb], 0), e.seqlen_q);
    // Keys of this batch element: [leftpad, used) of its K/V row, never past the row's capacity,
    // and an out-of-range K/V batch index reads nothing. Varlen keys are rows [start, start +
    // length) of the one K/V row, i.e. a left pad of start; paged, they start at the sequence's
    // first page.
    int leftpad, used;
    if (cu_seqlens_k != nullptr) {
        int const start = cu_seqlens_k[bidb];
        // seqused_k never reaches past the sequence (as in the backward).
        int length = cu_seqlens_k[bidb + 1] - start;
        if (seqused != nullptr) length = min(seqused[bidb], length);
        leftpad = kPaged ? 0 : min(max(start, 0), params.seqlen_k);
        used = leftpad + min(max(length, 0), params.seqlen_k - leftpad);
    } else {
        leftpad = leftpad_ptr != nullptr ? max(leftpad_ptr[bidb], 0) : 0;
        used = seqused != nullptr ? seqused[bidb] + params.seqlen_k_new : params.seqlen_k;
    }
    e.kv_b = kv_batch_idx != nullptr ? kv_batch_idx[bidb] : bidb;
    bool const kv_b_valid = kPaged || (e.kv_b >= 0 && e.kv_b < params.kv_batch);
    e.k_offset = leftpad;
    e.seqlen_k = kv_b_valid ? max(min(used, params.seqlen_k) - leftpad, 0) : 0;
    return e;
}

// The backward's rows of sequence bidb: varlen rows [q_offset, q_offset + seqlen_q) of q/dO and
// [k_offset, k_offset + seqlen_k) of k/v/dk/dv (offsets and lengths clamped to the tensors), rows in
// use (seqused, kSeqused: the sm90 backward does not take it), the query length clamped to
// max_seqlen_q (the semaphores hold that many blocks).
struct BwdExtent {
    int q_offset, seqlen_q, k_offset, seqlen_k;
};
template <bool kSeqused>
__device__ __forceinline__ BwdExtent bwd_extent(const BwdParams& params, int bidb) {
    const int* cu_seqlens_q = reinterpret_cast<const int*>(params.cu_seqlens_q_ptr);
    const int* cu_seqlens_k = reinterpret_cast<const int*>(params.cu_seqlens_k_ptr);
    const int* seqused_q = reinterpret_cast<const int*>(params.seqused_q_ptr);
    const int* seqused_k = reinterpret_cast<const int*>(params.seqused_k_ptr);
    BwdExtent e{0, params.seqlen_q, 0, params.seqlen_k};
    if (cu_seqlens_q != nullptr) {
        e.q_offset = min(max(cu_seqlens_q[bidb], 0), params.seqlen_q);
        e.seqlen_q = min(max(cu_seqlens_q[bidb + 1] - e.q_offset, 0), params.seqlen_q - e.q_offset);
    }
    if (cu_seqlens_k != nullptr) {
        e.k_offset = min(max(cu_seqlens_k[bidb], 0), params.seqlen_k);
        e.seqlen_k = min(max(cu_seqlens_k[bidb + 1] - e.k_offset, 0), params.seqlen_k - e.k_offset);
    }
    if (kSeqused && seqused_q != nullptr) e.seqlen_q = min(max(seqused_q[bidb], 0), e.seqlen_q);
    if (kSeqused && seqused_k != nullptr) e.seqlen_k = min(max(seqused_k[bidb], 0), e.seqlen_k);
    e.seqlen_q = min(e.seqlen_q, params.max_seqlen_q);
    return e;
}

}  // namespace flashgen
