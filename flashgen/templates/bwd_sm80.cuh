// The sm80 backward family: dQ, dK, dV of attention from Q, K, V, dO, the forward's LSE and
// D = rowsum(dO ∘ O) (the preprocess kernel's output).
//
// One CTA owns kBlockN keys of one KV head (and, for head dims above 128, one slice of the head
// dim for dK/dV/dQ) and loops over the query heads of its group and the query blocks that see its
// keys (the next step's Q, dO, LSE, D are fetched during this step's dQ product):
//
//   load Q(m), dO(m), LSE(m), D(m)
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ            (each warp: 16 keys x kBlockM queries)
//   Pᵀ = exp(Sᵀ - LSE); dSᵀ = Pᵀ ∘ (dPᵀ - D)   (softcap: times 1 - tanh²)
//   dV += Pᵀ·dO, dK += dSᵀ·Q          (Pᵀ and dSᵀ straight from registers as mma A operands)
//   dSᵀ -> shared memory; dQ(m) += dS·K, added to an fp32 buffer with atomics (in key-block order
//   under deterministic mode, through a per-row-block semaphore)
//
// Working in the transposed domain keeps the two big accumulators (dK, dV) in registers without
// any register transpose; only dS crosses shared memory. Padded query rows are zero (Q, dO, D),
// so they contribute exactly 0; padded key rows are masked, and their dK/dV rows never stored.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "fwd_sm80.cuh"

namespace flashgen {

template <typename Element_, int kHeadDim_, int kNWarps_, int kBlockM_, int kDSlices_, Mask kMask_, bool kSoftcap_,
          bool kDropout_>
struct BwdTraits {
    using Element = Element_;
    using T = typename Element::storage;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kBlockN = 16 * kNWarps;  // keys: 16 per warp for Sᵀ, dPᵀ, dK, dV
    static constexpr int kBlockM = kBlockM_;      // queries per step
    static constexpr int kDSlices = kDSlices_;    // dK/dV/dQ columns are split over CTAs
    static constexpr int kDSlice = kHeadDim / kDSlices;
    // dQ(step) = dS · K is split over the warps as kDQRowGroups x kDQColGroups tiles of 16 rows.
    static constexpr int kDQRowGroups = kBlockM / 16;
    static constexpr int kDQColGroups = kNWarps / kDQRowGroups;
    static constexpr int kDQCols = kDSlice / kDQColGroups;
    static constexpr Mask kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;
    static constexpr bool kDropout = kDropout_;  // the forward's Philox mask (Dropout in common.cuh)
    static constexpr int kStride = kHeadDim + 8;   // padded rows, as in the forward
    static constexpr int kDSStride = kBlockM + 8;
    static constexpr int kMN = kBlockM / 8;        // n8 tiles of Sᵀ (over queries)
    static constexpr int kDN = kDSlice / 8;        // n8 tiles of dK/dV
    static_assert(kDSlice % 16 == 0 && kDQCols % 16 == 0, "column tiles are multiples of 16");
    static_assert(kDQRowGroups * kDQColGroups == kNWarps, "dQ tiles cover the step exactly");
};

// C[16 x kCols] += A(16 rows at a_addr, k = kK) · B where B's rows are the n index (non-transposed
// ldmatrix, as Q·Kᵀ in the forward). Pipelined like the forward's gemm_qk.
template <typename Element, int kK, int kNTiles, int kStrideBytes>
__device__ __forceinline__ void gemm_a_smem_bt(float (&c)[kNTiles][4], uint32_t a_addr, uint32_t b_addr, int lane) {
    constexpr int kKSteps = kK / 16;
    constexpr int kNPairs = kNTiles / 2;
    uint32_t const a_base = a_addr + (lane % 16) * kStrideBytes + (lane / 16) * 16;
    uint32_t const b_base = b_addr + ((lane / 16) * 8 + lane % 8) * kStrideBytes + ((lane / 8) % 2) * 16;
    uint32_t a[2][4], b[2][4];
    ldmatrix_x4(a[0], a_base);
    ldmatrix_x4(b[0], b_base);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        if (kk + 1 < kKSteps) ldmatrix_x4(a[(kk + 1) % 2], a_base + (kk + 1) * 32);
#pragma unroll
        for (int nj = 0; nj < kNPairs; ++nj) {
            int const t = kk * kNPairs + nj;
            if (nj + 1 < kNPairs) {
                ldmatrix_x4(b[(t + 1) % 2], b_base + (nj + 1) * 16 * kStrideBytes + kk * 32);
            } else if (kk + 1 < kKSteps) {
                ldmatrix_x4(b[(t + 1) % 2], b_base + (kk + 1) * 32);
            }
            mma_16816<Element>(c[2 * nj], a[kk % 2], b[t % 2][0], b[t % 2][1]);
            mma_16816<Element>(c[2 * nj + 1], a[kk % 2], b[t % 2][2], b[t % 2][3]);
        }
    }
}

// C[16 x kNTiles*8] += A · B with A from registers (kK/16 fragments) and B's rows the k index
// (transposed ldmatrix, as P·V in the forward), B starting at b_addr (its column offset included).
template <typename Element, int kK, int kNTiles, int kStrideBytes>
__device__ __forceinline__ void gemm_a_reg_b(float (&c)[kNTiles][4], const uint32_t (&a)[kK / 16][4],
                                             uint32_t b_addr, int lane) {
    constexpr int kKSteps = kK / 16;
    constexpr int kNPairs = kNTiles / 2;
    uint32_t const b_base = b_addr + (((lane / 8) % 2) * 8 + lane % 8) * kStrideBytes + (lane / 16) * 16;
    uint32_t b[2][4];
    ldmatrix_x4_trans(b[0], b_base);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
        for (int nj = 0; nj < kNPairs; ++nj) {
            int const t = kk * kNPairs + nj;
            if (nj + 1 < kNPairs) {
                ldmatrix_x4_trans(b[(t + 1) % 2], b_base + kk * 16 * kStrideBytes + (nj + 1) * 32);
            } else if (kk + 1 < kKSteps) {
                ldmatrix_x4_trans(b[(t + 1) % 2], b_base + (kk + 1) * 16 * kStrideBytes);
            }
            mma_16816<Element>(c[2 * nj], a[kk], b[t % 2][0], b[t % 2][1]);
            mma_16816<Element>(c[2 * nj + 1], a[kk], b[t % 2][2], b[t % 2][3]);
        }
    }
}

// The m16n8 accumulators of 2*kK/16 adjacent n8 tiles as m16k16 A fragments (see the forward).
template <typename Element, int kTiles>
__device__ __forceinline__ void to_a_fragments(uint32_t (&a)[kTiles / 2][4], const float (&c)[kTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kTiles / 2; ++kk) {
        a[kk][0] = Element::pack2(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = Element::pack2(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = Element::pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = Element::pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

template <typename Tr>
__device__ __forceinline__ void flash_bwd_sm80(const BwdParams& params) {
    using T = typename Tr::T;
    using Element = typename Tr::Element;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
    constexpr int kStrideBytes = kStride * 2;
    constexpr bool kMasked = Tr::kMask != Mask::None;
    using MCopy = RowCopy<kBlockM, Tr::kHeadDim, Tr::kNThreads>;
    using NCopy = RowCopy<kBlockN, Tr::kHeadDim, Tr::kNThreads>;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + kBlockN * kStride;
    T* sQ = sV + kBlockN * kStride;
    T* sdO = sQ + kBlockM * kStride;
    T* sdS = sdO + kBlockM * kStride;  // dSᵀ: [key][query]
    float* sLSE = reinterpret_cast<float*>(sdS + kBlockN * Tr::kDSStride);
    float* sD = sLSE + kBlockM;

    int const tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // blockIdx.x enumerates (key block, head-dim slice), slices fastest: the grid's y holds only
    // the KV heads (within CUDA's 65535), and lower key blocks still launch first.
    int const n_block = int(blockIdx.x) / Tr::kDSlices;
    int const slice = int(blockIdx.x) - n_block * Tr::kDSlices;
    int const bidh_kv = blockIdx.y;
    int const col0 = slice * Tr::kDSlice;  // first head-dim column of this CTA's dK/dV/dQ
    int const bidb = blockIdx.z;
    int const head_dim = params.head_dim;
    // Varlen: sequence bidb is rows [q_offset, q_offset + seqlen_q) of q/dO and [k_offset,
    // k_offset + seqlen_k) of k/v/dk/dv. Offsets and lengths are clamped to the tensors, and the
    // query length to max_seqlen_q (the semaphores hold that many query blocks).
    const int* cu_seqlens_q = reinterpret_cast<const int*>(params.cu_seqlens_q_ptr);
    const int* cu_seqlens_k = reinterpret_cast<const int*>(params.cu_seqlens_k_ptr);
    const int* seqused_q = reinterpret_cast<const int*>(params.seqused_q_ptr);
    const int* seqused_k = reinterpret_cast<const int*>(params.seqused_k_ptr);
    int q_offset = 0, k_offset = 0, seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    if (cu_seqlens_q != nullptr) {
        q_offset = min(max(cu_seqlens_q[bidb], 0), params.seqlen_q);
        seqlen_q = min(max(cu_seqlens_q[bidb + 1] - q_offset, 0), params.seqlen_q - q_offset);
    }
    if (cu_seqlens_k != nullptr) {
        k_offset = min(max(cu_seqlens_k[bidb], 0), params.seqlen_k);
        seqlen_k = min(max(cu_seqlens_k[bidb + 1] - k_offset, 0), params.seqlen_k - k_offset);
    }
    if (seqused_q != nullptr) seqlen_q = min(max(seqused_q[bidb], 0), seqlen_q);
    if (seqused_k != nullptr) seqlen_k = min(max(seqused_k[bidb], 0), seqlen_k);
    seqlen_q = min(seqlen_q, params.max_seqlen_q);
    int const m_blocks_stride = (params.max_seqlen_q + kBlockM - 1) / kBlockM;
    int const diag = seqlen_k - seqlen_q;
    int const qhpk = params.nheads / params.nheads_k;
    int const key0 = n_block * kBlockN;
    if (key0 >= seqlen_k) return;

    // Query blocks that see any key of this block: i + diag - wl <= j <= i + diag + wr.
    int const m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
    int m_block_min = 0, m_block_max = m_blocks;
    if constexpr (kMasked) {
        int const first_query = key0 - diag - params.window_right;
        m_block_min = first_query <= 0 ? 0 : min(first_query / kBlockM, m_blocks);
        if constexpr (Tr::kMask == Mask::Local) {
            int const last_query = key0 + kBlockN - 1 - diag + params.window_left;
            m_block_max = last_query < 0 ? 0 : min(last_query / kBlockM + 1, m_blocks);
        }
    }

    // K and V tiles, loaded once.
    const T* k_base = reinterpret_cast<const T*>(params.k_ptr) + bidb * params.k_batch_stride +
                      k_offset * params.k_row_stride + bidh_kv * params.k_head_stride;
    const T* v_base = reinterpret_cast<const T*>(params.v_ptr) + bidb * params.v_batch_stride +
                      k_offset * params.v_row_stride + bidh_kv * params.v_head_stride;
    copy_rows_async<NCopy>(sK, kStride, head_dim, tid, row_ptrs<NCopy, T>(tid, [&](int r) -> const T* {
        return key0 + r < seqlen_k ? k_base + (key0 + r) * params.k_row_stride : nullptr;
    }));
    copy_rows_async<NCopy>(sV, kStride, head_dim, tid, row_ptrs<NCopy, T>(tid, [&](int r) -> const T* {
        return key0 + r < seqlen_k ? v_base + (key0 + r) * params.v_row_stride : nullptr;
    }));
    cp_async_commit();

    float acc_dk[Tr::kDN][4], acc_dv[Tr::kDN][4];
#pragma unroll
    for (int i = 0; i < Tr::kDN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

    // This thread's Sᵀ rows (keys); its query columns are 2 * (lane % 4) + {0, 1} of each n8 tile.
    int const key_row[2] = {key0 + warp * 16 + lane / 4, key0 + warp * 16 + lane / 4 + 8};
    uint32_t const sK_warp = smem_u32(sK + warp * 16 * kStride);
    uint32_t const sV_warp = smem_u32(sV + warp * 16 * kStride);
    uint32_t const sQ_addr = smem_u32(sQ), sdO_addr = smem_u32(sdO);
    const float* slopes = reinterpret_cast<const float*>(params.alibi_slopes_ptr);
    Dropout const dropout = Dropout::from(params);
    float* dq_accum = reinterpret_cast<float*>(params.dq_accum_ptr);
    int* semaphores = reinterpret_cast<int*>(params.semaphore_ptr);
    // dQ tile of this warp: 16 query rows, kDQCols head-dim columns.
    int const dq_row0 = (warp % Tr::kDQRowGroups) * 16;
    int const dq_col0 = col0 + (warp / Tr::kDQRowGroups) * Tr::kDQCols;

    // Steps enumerate (query head of the group, query block); the Q, dO, LSE and D rows of step
    // t + 1 are fetched while step t finishes (its dQ product and atomics).
    int const m_count = max(m_block_max - m_block_min, 0);
    int const steps = qhpk * m_count;
    auto issue_step = [&](int t) {
        int const bidh = bidh_kv * qhpk + t / m_count;
        int const q0 = (m_block_min + t % m_count) * kBlockM;
        const T* q_base = reinterpret_cast<const T*>(params.q_ptr) + bidb * params.q_batch_stride +
                          q_offset * params.q_row_stride + bidh * params.q_head_stride;
        const T* do_base = reinterpret_cast<const T*>(params.do_ptr) + bidb * params.do_batch_stride +
                           q_offset * params.do_row_stride + bidh * params.do_head_stride;
        copy_rows_async<MCopy>(sQ, kStride, head_dim, tid, row_ptrs<MCopy, T>(tid, [&](int r) -> const T* {
            return q0 + r < seqlen_q ? q_base + (q0 + r) * params.q_row_stride : nullptr;
        }));
        copy_rows_async<MCopy>(sdO, kStride, head_dim, tid, row_ptrs<MCopy, T>(tid, [&](int r) -> const T* {
            return q0 + r < seqlen_q ? do_base + (q0 + r) * params.do_row_stride : nullptr;
        }));
        // LSE and D rows as asynchronous copies too, so no thread waits for them here. Padded
        // rows read 0 for both: their Q and dO rows are 0, so they still contribute exactly 0.
        int64_t const row_stats = bidb * params.stats_batch_stride + bidh * params.stats_head_stride + q_offset;
        for (int r = tid; r < kBlockM; r += Tr::kNThreads) {
            bool const valid = q0 + r < seqlen_q;
            cp_async_4(smem_u32(sLSE + r), reinterpret_cast<const float*>(params.lse_ptr) + row_stats + q0 + r, valid);
            cp_async_4(smem_u32(sD + r), reinterpret_cast<const float*>(params.dsum_ptr) + row_stats + q0 + r, valid);
        }
        cp_async_commit();
    };
    if (steps > 0) issue_step(0);

    for (int t = 0; t < steps; ++t) {
        int const bidh = bidh_kv * qhpk + t / m_count;
        int const m_block = m_block_min + t % m_count;
        int const q0 = m_block * kBlockM;
        float const slope = slopes != nullptr
            ? slopes[bidb * params.alibi_batch_stride + bidh] * params.alibi_scale : 0.f;
        cp_async_wait<0>();
        __syncthreads();  // Q, dO (and K, V) landed; LSE, D written; the last step's dS reads done

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warp's 16 keys.
        float st[Tr::kMN][4], dpt[Tr::kMN][4];
#pragma unroll
        for (int i = 0; i < Tr::kMN; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
        gemm_a_smem_bt<Element, Tr::kHeadDim, Tr::kMN, kStrideBytes>(st, sK_warp, sQ_addr, lane);
        gemm_a_smem_bt<Element, Tr::kHeadDim, Tr::kMN, kStrideBytes>(dpt, sV_warp, sdO_addr, lane);

        // Keys past seqlen_k are zero rows; masked anyway, since exp(0 - lse) overflows when lse
        // is very negative, and inf times a zero K row is NaN.
        // Dropout: the forward's keep bits for this thread's keys (lane / 4 and + 8 of the warp's
        // 16, one 16-key chunk) and query columns; bit (mi * 2 + column) * 2 + half.
        uint32_t keep_bits = 0xffffffffu;
        static_assert(Tr::kMN <= 8, "keep bits: 4 per n8 tile of queries fit 32 bits");
        if constexpr (Tr::kDropout) {
            keep_bits = 0;
            uint32_t const bh = uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(bidh);
#pragma unroll
            for (int mi = 0; mi < Tr::kMN; ++mi)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    uint4 const bytes = dropout.chunk(bh, q0 + mi * 8 + 2 * (lane % 4) + c, (key0 + warp * 16) / 16);
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        keep_bits |= uint32_t(dropout.keep(bytes, lane / 4 + 8 * half)) << ((mi * 2 + c) * 2 + half);
                }
        }
        bool const need_mask = key0 + kBlockN > seqlen_k || (kMasked && (
            q0 + diag + params.window_right < key0 + kBlockN - 1 ||
            (Tr::kMask == Mask::Local && q0 + kBlockM - 1 + diag - params.window_left > key0)));
#pragma unroll
        for (int mi = 0; mi < Tr::kMN; ++mi) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int const key = key_row[e / 2];
                int const qcol = mi * 8 + 2 * (lane % 4) + (e % 2);
                int const query = q0 + qcol;
                float s = st[mi][e];
                float dtanh = 1.f;
                if constexpr (Tr::kSoftcap) {
                    float const t_ = tanh_accurate(s * params.softcap_scale);
                    s = params.softcap * t_;
                    dtanh = 1.f - t_ * t_;
                }
                if (slopes != nullptr) {
                    int const rel = query + diag - key;
                    s -= slope * float(rel < 0 ? -rel : rel);
                }
                bool masked = false;
                if (need_mask) {
                    masked = key >= seqlen_k;
                    if constexpr (kMasked) masked |= key > query + diag + params.window_right;
                    if constexpr (Tr::kMask == Mask::Local) masked |= key < query + diag - params.window_left;
                }
                // A row that saw no key has lse -inf and probabilities 0 (not exp(+inf)).
                float const lse = sLSE[qcol];
                float const p = masked || lse == -kInfinity
                    ? 0.f : exp2_approx(s * params.scale_log2 - lse * 1.4426950408889634f);
                // With dropout, O used P∘Z / (1 - p): dV takes that, and dP is masked and scaled
                // the same way before the softmax's backward.
                bool const kept = (keep_bits >> ((mi * 2 + e % 2) * 2 + e / 2)) & 1u;
                if constexpr (Tr::kDropout) {
                    float const rp = params.rp_dropout;
                    st[mi][e] = kept ? p * rp : 0.f;
                    dpt[mi][e] = p * ((kept ? dpt[mi][e] * rp : 0.f) - sD[qcol]) * dtanh;  // dSᵀ in raw-score units / scale
                } else {
                    st[mi][e] = p;
                    dpt[mi][e] = p * (dpt[mi][e] - sD[qcol]) * dtanh;
                }
            }
        }

        uint32_t pt[Tr::kMN / 2][4], dst[Tr::kMN / 2][4];
        to_a_fragments<Element, Tr::kMN>(pt, st);
        to_a_fragments<Element, Tr::kMN>(dst, dpt);
        gemm_a_reg_b<Element, kBlockM, Tr::kDN, kStrideBytes>(acc_dv, pt, sdO_addr + col0 * 2, lane);
        gemm_a_reg_b<Element, kBlockM, Tr::kDN, kStrideBytes>(acc_dk, dst, sQ_addr + col0 * 2, lane);
#pragma unroll
        for (int mi = 0; mi < Tr::kMN; ++mi) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                int const r = warp * 16 + lane / 4 + half * 8;
                *reinterpret_cast<uint32_t*>(sdS + r * Tr::kDSStride + mi * 8 + 2 * (lane % 4)) =
                    Element::pack2(dpt[mi][2 * half], dpt[mi][2 * half + 1]);
            }
        }
        __syncthreads();  // every warp is done with sQ, sdO, sLSE, sD; all of dSᵀ is written
        if (t + 1 < steps) issue_step(t + 1);

        // dQ tile of this warp = dS (its 16 queries x all keys) · K (all keys x its columns).
        float acc_dq[Tr::kDQCols / 8][4];
#pragma unroll
        for (int i = 0; i < Tr::kDQCols / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dq[i][e] = 0.f;
        {
            // A = dS read transposed from dSᵀ: octet j of the lanes addresses key rows (j / 2) * 8..
            // and query columns (j % 2) * 8.. of each 16 x 16 step.
            uint32_t a[kBlockN / 16][4];
            uint32_t const a_base = smem_u32(sdS) +
                (((lane / 16) * 8 + lane % 8) * Tr::kDSStride + dq_row0 + ((lane / 8) % 2) * 8) * 2;
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                ldmatrix_x4_trans(a[kk], a_base + kk * 16 * Tr::kDSStride * 2);
            }
            gemm_a_reg_b<Element, kBlockN, Tr::kDQCols / 8, kStrideBytes>(acc_dq, a, smem_u32(sK) + dq_col0 * 2, lane);
        }
        // Add to the fp32 dQ buffer (bidb, bidh, query, head_dim).
        int64_t const row_stats = bidb * params.stats_batch_stride + bidh * params.stats_head_stride + q_offset;
        int* sem = semaphores + ((int64_t(bidb) * params.nheads + bidh) * Tr::kDSlices + slice) * m_blocks_stride + m_block;
        if (semaphores != nullptr) {
            // Deterministic: the key blocks that see this query block add to it one after another,
            // in key order. They are n_first.. (a local window's left edge skips the first ones);
            // lower blocks are launched first, so the wait always ends.
            int const n_first = Tr::kMask == Mask::Local ? max(0, (q0 + diag - params.window_left) / kBlockN) : 0;
            if (tid == 0) {
                while (atomicAdd(sem, 0) != n_block - n_first) {
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int const query = q0 + dq_row0 + lane / 4 + half * 8;
            if (query < seqlen_q) {
                float* dq_row = dq_accum + (row_stats + query) * head_dim;
#pragma unroll
                for (int di = 0; di < Tr::kDQCols / 8; ++di) {
                    int const col = dq_col0 + di * 8 + 2 * (lane % 4);
                    if (col < head_dim) {
                        atomicAdd(dq_row + col, acc_dq[di][2 * half]);
                        atomicAdd(dq_row + col + 1, acc_dq[di][2 * half + 1]);
                    }
                }
            }
        }
        if (semaphores != nullptr) {
            __threadfence();
            __syncthreads();
            if (tid == 0) atomicAdd(sem, 1);
        }
    }

    // dK (scaled) and dV for this CTA's keys and head-dim slice.
    T* dk_base = reinterpret_cast<T*>(params.dk_ptr) + bidb * params.dk_batch_stride +
                 k_offset * params.dk_row_stride + bidh_kv * params.dk_head_stride;
    T* dv_base = reinterpret_cast<T*>(params.dv_ptr) + bidb * params.dv_batch_stride +
                 k_offset * params.dv_row_stride + bidh_kv * params.dv_head_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        int const key = key_row[half];
        if (key < seqlen_k) {
#pragma unroll
            for (int di = 0; di < Tr::kDN; ++di) {
                int const col = col0 + di * 8 + 2 * (lane % 4);
                if (col < head_dim) {
                    *reinterpret_cast<uint32_t*>(dk_base + key * params.dk_row_stride + col) = Element::pack2(
                        acc_dk[di][2 * half] * params.softmax_scale, acc_dk[di][2 * half + 1] * params.softmax_scale);
                    *reinterpret_cast<uint32_t*>(dv_base + key * params.dv_row_stride + col) =
                        Element::pack2(acc_dv[di][2 * half], acc_dv[di][2 * half + 1]);
                }
            }
        }
    }
}

}  // namespace flashgen
