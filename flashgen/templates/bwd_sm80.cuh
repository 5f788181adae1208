// The sm80 backward family: dQ, dK, dV of attention from Q, K, V, dO, and the preprocess kernel's
// outputs: D = rowsum(dO ∘ O) and the forward's LSE in log2 units.
//
// One CTA owns kBlockN keys of one KV head (and, for head dims above 128, one slice of the head
// dim for dK/dV/dQ) and loops over the query heads of its group and the query blocks that see its
// keys (the next step's Q, dO, LSE, D are fetched during this step's dQ product):
//
//   load Q(m), dO(m), LSE(m), D(m)   (with two stages: issued a whole step ahead)
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ            (warps 2-D: 32 keys x a share of the queries each)
//   Pᵀ = exp(Sᵀ - LSE); dSᵀ = Pᵀ ∘ (dPᵀ - D)   (softcap: times 1 - tanh²)
//   Pᵀ, dSᵀ -> shared memory
//   dV += Pᵀ·dO, dK += dSᵀ·Q          (warps 2-D: 32 keys x a share of the head-dim slice each)
//   dQ(m) += dS·K, added to an fp32 buffer: on sm_90 through a shared tile and one bulk reduction
//   per row during the next step (kDQTile); otherwise, and in deterministic mode, with atomics from
//   the fragments (deterministic: in key-block order, through a per-row-block semaphore)
//
// Shared-memory reads (ldmatrix) are most of each step's instructions: every warp tile is 32 rows
// wherever the registers allow it, so that each B fragment feeds four MMAs instead of two (1152
// instead of 1472 ldmatrix.x4 per 128 x 64 step at d128, FlashAttention-2's count; +10% measured).
// At 255 registers an SM holds 8 warps (2 per scheduler), so latency decides: the per-step
// integer work is kept small (running pointers for the copies) and, on sm_90, the dQ atomics that
// queued up behind each other (ncu, d128: 9.4 cycles per issued instruction vs FlashAttention-2's
// 7.7 with fewer instructions) go through the copy engine instead.
// Working in the transposed domain keeps the two big accumulators (dK, dV) in registers without
// any register transpose. K, V, Q and dO tiles use the forward's swizzled layout (SwizzledRows:
// whole-line cp.async requests); Pᵀ and dSᵀ padded rows (PaddedRows). Padded query rows are zero (Q, dO, D),
// so they contribute exactly 0; padded key rows are masked, and their dK/dV rows never stored.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "fwd_sm80.cuh"
#include "seq_extent.cuh"

namespace flashgen {

// Rows of kElems 16-bit elements padded by 16 bytes (the Pᵀ and dSᵀ tiles, written by 4-byte
// stores): 8 consecutive rows at one 16-byte chunk fall into 8 different bank groups. Same interface
// as SwizzledRows.
template <int kElems>
struct PaddedRows {
    static constexpr int kRowBytes = (kElems + 8) * 2;
    static __device__ __forceinline__ uint32_t offset(int row, int chunk) { return row * kRowBytes + chunk * 16; }
    static __device__ __forceinline__ uint32_t step(uint32_t base, int chunk) { return base + chunk * 16; }
};

template <typename Element_, int kHeadDim_, int kNWarps_, int kBlockN_, int kBlockM_, int kDSlices_, int kStages_,
          Mask kMask_, bool kSoftcap_, bool kDropout_, bool kDQTile_>
struct BwdTraits {
    using Element = Element_;
    using T = typename Element::storage;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kBlockM = kBlockM_;      // queries per step
    static constexpr int kDSlices = kDSlices_;    // dK/dV/dQ columns are split over CTAs
    static constexpr int kDSlice = kHeadDim / kDSlices;
    static constexpr int kStages = kStages_;      // Q/dO/LSE/D buffers (BwdTile.stages)
    // Warp (warp_n, warp_m) = (warp / kWarpsM, warp % kWarpsM) owns keys 32 warp_n.. of Sᵀ, dPᵀ, dK
    // and dV, and a kWarpsM-th of the step's queries (Sᵀ, dPᵀ) and of the head-dim slice (dK, dV).
    static constexpr int kBlockN = kBlockN_;      // keys
    static constexpr int kWarpsN = kBlockN / 32;
    static constexpr int kWarpsM = kNWarps / kWarpsN;
    static constexpr int kWarpQ = kBlockM / kWarpsM;  // Sᵀ columns (queries) per warp
    static constexpr int kMN = kWarpQ / 8;            // n8 tiles of a warp's Sᵀ
    static constexpr int kWarpD = kDSlice / kWarpsM;  // dK/dV columns per warp
    static constexpr int kDN = kWarpD / 8;            // n8 tiles of a warp's dK, dV
    // dQ(step) = dS · K is split over the warps as kDQRowGroups x kDQColGroups tiles of kDQRows
    // rows: 32 unless the column tiles would then be narrower than 16 (d96).
    static constexpr int kDQRows = kBlockM % 32 == 0 && (kDSlice * (kBlockM / 32) / kNWarps) % 16 == 0 ? 32 : 16;
    static constexpr int kDQRowGroups = kBlockM / kDQRows;
    static constexpr int kDQColGroups = kNWarps / kDQRowGroups;
    static constexpr int kDQCols = kDSlice / kDQColGroups;
    static constexpr Mask kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;
    static constexpr bool kDropout = kDropout_;  // the forward's Philox mask (Dropout in common.cuh)
    using Smem = SwizzledRows<kHeadDim>;  // layout of the K, V, Q and dO tiles
    using PSmem = PaddedRows<kBlockM>;     // layout of the Pᵀ and dSᵀ tiles: [key][query]
    // dQ through shared memory (sm_90, BwdTile.dq_tile): each step's dQ rows in fp32, padded by 8
    // floats so that a warp's 8-byte stores (8 rows x 32 bytes) hit distinct banks, added to
    // dq_accum by one bulk reduction per row at the next step's start. Otherwise (and in
    // deterministic mode) the warps add their fragments with 8-byte atomics, which ncu showed
    // queuing behind each other (lg throttle, and registers waiting for the atomics to read them).
    static constexpr bool kDQTile = kDQTile_;
    static constexpr int kDQPitch = (kDSlice + 8) * int(sizeof(float));  // bytes from one dQ row to the next
#if __CUDA_ARCH__ < 900
    static_assert(!kDQTile, "bulk reductions need sm_90");
#endif
    static_assert(!kDQTile || kDSlices == 1, "a dQ row is one contiguous bulk reduction");
    // K, V, Q and dO per stage, Pᵀ, dSᵀ, LSE and D per stage, the dQ tile; the instance checks it
    // against the host's request (BwdTile.smem_bytes).
    static constexpr int kSmemBytes = (2 * kBlockN + 2 * kStages * kBlockM) * Smem::kRowBytes +
                                      2 * kBlockN * PSmem::kRowBytes + 2 * kStages * kBlockM * int(sizeof(float)) +
                                      (kDQTile ? kBlockM * kDQPitch : 0);
    static_assert(kBlockN % 32 == 0 && kWarpsN * kWarpsM == kNWarps, "warps tile the keys in 32-key groups");
    static_assert(kWarpQ % 16 == 0 && kWarpD % 16 == 0 && kDQCols % 16 == 0, "warp tiles are multiples of 16");
    static_assert(kDQRowGroups * kDQColGroups == kNWarps, "dQ tiles cover the step exactly");
};

// B fragments are loaded this many (kk, n-pair) steps ahead of their MMAs: with two warps per
// scheduler, one step's MMAs are too short to hide an ldmatrix (the "short scoreboard" stall that
// ncu showed dominating this kernel with a ring of 2).
constexpr int kBRing = 4;

// C[kMI m16 tiles][kNTiles n8 tiles] += A · B, both from shared memory. A is m x k: stored [m][k]
// (kTransA false) or [k][m] (true), starting at a_addr. B is k x n: stored [n][k] (kTransB false,
// as Kᵀ in Q·Kᵀ) or [k][n] (true, as V in P·V), from its 16-byte chunk b_chunk (even) on. A is
// loaded one k-step ahead, B kBRing - 1 (k, n-pair) steps ahead.
template <typename Element, typename LayoutA, bool kTransA, typename LayoutB, bool kTransB, int kMI, int kK,
          int kNTiles>
__device__ __forceinline__ void gemm_ss(float (&c)[kMI][kNTiles][4], uint32_t a_addr, uint32_t b_addr,
                                        int b_chunk, int lane) {
    constexpr int kKSteps = kK / 16;
    constexpr int kNPairs = kNTiles / 2;
    constexpr int kSteps = kKSteps * kNPairs;
    static_assert(kNTiles % 2 == 0, "n tiles come in pairs");
    // ldmatrix lane -> (row, chunk) of its 8x8 matrix. A fragments are [m 0-7 | 8-15] x [k 0-7 | 8-15]
    // in the order (m lo, k lo), (m hi, k lo), (m lo, k hi), (m hi, k hi); B pairs two n8 tiles.
    uint32_t const a_base = kTransA ? a_addr + LayoutA::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2)
                                    : a_addr + LayoutA::offset(lane % 16, lane / 16);
    uint32_t const b_base = kTransB ? b_addr + LayoutB::offset(((lane / 8) % 2) * 8 + lane % 8, lane / 16)
                                    : b_addr + LayoutB::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    auto load_a = [&](uint32_t (&a)[kMI][4], int kk) {
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
            if constexpr (kTransA) {
                ldmatrix_x4_trans(a[mi], LayoutA::step(a_base, 2 * mi) + kk * 16 * LayoutA::kRowBytes);
            } else {
                ldmatrix_x4(a[mi], LayoutA::step(a_base, 2 * kk) + mi * 16 * LayoutA::kRowBytes);
            }
        }
    };
    auto load_b = [&](uint32_t (&b)[4], int t) {
        int const kk = t / kNPairs, nj = t % kNPairs;
        if constexpr (kTransB) {
            ldmatrix_x4_trans(b, LayoutB::step(b_base, b_chunk + 2 * nj) + kk * 16 * LayoutB::kRowBytes);
        } else {
            ldmatrix_x4(b, LayoutB::step(b_base, b_chunk + 2 * kk) + nj * 16 * LayoutB::kRowBytes);
        }
    };
    uint32_t a[2][kMI][4], b[kBRing][4];
    load_a(a[0], 0);
#pragma unroll
    for (int t = 0; t < kBRing - 1 && t < kSteps; ++t) load_b(b[t], t);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        if (kk + 1 < kKSteps) load_a(a[(kk + 1) % 2], kk + 1);
#pragma unroll
        for (int nj = 0; nj < kNPairs; ++nj) {
            int const t = kk * kNPairs + nj;
            if (t + kBRing - 1 < kSteps) load_b(b[(t + kBRing - 1) % kBRing], t + kBRing - 1);
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi) {
                mma_16816<Element>(c[mi][2 * nj], a[kk % 2][mi], b[t % kBRing][0], b[t % kBRing][1]);
                mma_16816<Element>(c[mi][2 * nj + 1], a[kk % 2][mi], b[t % kBRing][2], b[t % kBRing][3]);
            }
        }
    }
}

// What softmax_backward needs of the step besides S and dP.
struct SoftmaxBwdArgs {
    const float* lse;  // the warp's LSE (log2 units) and D columns (shared memory; this thread's are + 2 * (lane % 4))
    const float* dsum;
    int key;           // this thread's first key row (tile mi adds 16 mi, the second half 8)
    int query;         // this thread's first query column (tile ni adds 8 ni)
    int diag;          // seqlen_k - seqlen_q
    int seqlen_k;
    float slope;       // ALiBi slope (already scaled), if kAlibi
    uint64_t keep_bits;  // dropout: bit ((mi * kMN + ni) * 2 + column) * 2 + half
};

// Sᵀ -> Pᵀ (what dV takes) and dPᵀ -> dSᵀ, in place, for one warp's 32 keys x kWarpQ queries.
template <typename Tr, bool kNeedMask, bool kAlibi>
__device__ __forceinline__ void softmax_backward(float (&st)[2][Tr::kMN][4], float (&dpt)[2][Tr::kMN][4],
                                                 const SoftmaxBwdArgs& a, const BwdParams& params) {
    constexpr bool kMasked = Tr::kMask != Mask::None;
    int const lane = threadIdx.x % 32;
#pragma unroll
    for (int ni = 0; ni < Tr::kMN; ++ni) {
        // This thread's two query columns of the tile: one 8-byte load each for LSE (log2 units,
        // +inf for a row that saw no key: its probabilities are 0) and D.
        float2 const lse2 = *reinterpret_cast<const float2*>(a.lse + ni * 8 + 2 * (lane % 4));
        float2 const dsum2 = *reinterpret_cast<const float2*>(a.dsum + ni * 8 + 2 * (lane % 4));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int const key = a.key + mi * 16 + 8 * (e / 2);
                int const query = a.query + ni * 8 + (e % 2);
                float const dsum = e % 2 ? dsum2.y : dsum2.x;
                float s = st[mi][ni][e];
                float dtanh = 1.f;
                if constexpr (Tr::kSoftcap) {
                    float const t_ = tanh_accurate(s * params.softcap_scale);
                    s = params.softcap * t_;
                    dtanh = 1.f - t_ * t_;
                }
                if constexpr (kAlibi) {
                    int const rel = query + a.diag - key;
                    s -= a.slope * float(rel < 0 ? -rel : rel);
                }
                float p = exp2_approx(s * params.scale_log2 - (e % 2 ? lse2.y : lse2.x));
                if constexpr (kNeedMask) {
                    // Keys past seqlen_k are zero rows, masked anyway: exp(0 - lse) overflows when
                    // lse is very negative, and inf times a zero K row is NaN.
                    bool masked = key >= a.seqlen_k;
                    if constexpr (kMasked) masked |= key > query + a.diag + params.window_right;
                    if constexpr (Tr::kMask == Mask::Local) masked |= key < query + a.diag - params.window_left;
                    p = masked ? 0.f : p;
                }
                // With dropout, O used P∘Z / (1 - p): dV takes that, and dP is masked and scaled
                // the same way before the softmax's backward.
                if constexpr (Tr::kDropout) {
                    bool const kept = (a.keep_bits >> (((mi * Tr::kMN + ni) * 2 + e % 2) * 2 + e / 2)) & 1ull;
                    float const rp = params.rp_dropout;
                    st[mi][ni][e] = kept ? p * rp : 0.f;
                    // dSᵀ in raw-score units / scale
                    dpt[mi][ni][e] = p * ((kept ? dpt[mi][ni][e] * rp : 0.f) - dsum) * dtanh;
                } else {
                    st[mi][ni][e] = p;
                    dpt[mi][ni][e] = p * (dpt[mi][ni][e] - dsum) * dtanh;
                }
            }
        }
    }
}

// Adds a warp's dQ tile (kMI m16 x kNTiles n8 fragments) to the fp32 buffer whose rows are row_stride
// floats apart, from this thread's first element dq_first (row lane / 4, column 2 (lane % 4) of
// the tile): straight from the fragments, one 8-byte reduction per row and n8 tile (two 4-byte
// ones before sm_90), no shuffles to form wider vectors. kPredicated: only rows below rows_left
// and tiles whose bit is set in cols_ok; otherwise every reduction is unconditional, with no
// branches around them. (ncu, d128: this kernel executed 1.20x FlashAttention-2's instructions
// for the same HMMA and LDSM counts; the 16-byte reductions' shuffles, selects and branches were
// a fifth of the excess. Without them: +1-3% at d64/d128.)
template <bool kPredicated, int kMI, int kNTiles>
__device__ __forceinline__ void add_dq_fragments(const float (&acc)[kMI][kNTiles][4], float* dq_first, int row_stride,
                                                 int rows_left, uint32_t cols_ok) {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int const row = mi * 16 + half * 8;
            float* const dq_row = dq_first + row * row_stride;
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni) {
                if (!kPredicated || (row < rows_left && ((cols_ok >> ni) & 1u))) {
                    red_add_f32x2(dq_row + ni * 8, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
                }
            }
        }
}

template <typename Tr>
__device__ __forceinline__ void flash_bwd_sm80(const BwdParams& params) {
    using T = typename Tr::T;
    using Element = typename Tr::Element;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
    using Smem = typename Tr::Smem;
    constexpr int kStride = Smem::kRowBytes / 2;  // elements from one tile row to the next
    constexpr bool kMasked = Tr::kMask != Mask::None;
    using MCopy = RowCopy<kBlockM, Tr::kHeadDim, Tr::kNThreads>;
    using NCopy = RowCopy<kBlockN, Tr::kHeadDim, Tr::kNThreads>;

    extern __shared__ __align__(128) unsigned char smem_raw[];  // swizzled tiles start at 128 bytes
    constexpr int kStages = Tr::kStages;
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + kBlockN * kStride;
    T* sQ0 = sV + kBlockN * kStride;        // stage s: sQ0 + s * kBlockM * kStride
    T* sdO0 = sQ0 + kStages * kBlockM * kStride;
    using PSmem = typename Tr::PSmem;
    unsigned char* sPt = reinterpret_cast<unsigned char*>(sdO0 + kStages * kBlockM * kStride);  // Pᵀ: [key][query]
    unsigned char* sdSt = sPt + kBlockN * PSmem::kRowBytes;                                      // dSᵀ: [key][query]
    float* sLSE0 = reinterpret_cast<float*>(sdSt + kBlockN * PSmem::kRowBytes);  // stage s: + s * kBlockM
    float* sD0 = sLSE0 + kStages * kBlockM;
    uint32_t const sdQ = smem_u32(sD0 + kStages * kBlockM);  // the dQ tile (kDQTile): [query][column]

    int const tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int const warp_n = warp / Tr::kWarpsM, warp_m = warp % Tr::kWarpsM;  // see BwdTraits
    // blockIdx.x enumerates (key block, head-dim slice), slices fastest: the grid's y holds only
    // the KV heads (within CUDA's 65535), and lower key blocks still launch first.
    int const n_block = int(blockIdx.x) / Tr::kDSlices;
    int const slice = int(blockIdx.x) - n_block * Tr::kDSlices;
    int const bidh_kv = blockIdx.y;
    int const col0 = slice * Tr::kDSlice;  // first head-dim column of this CTA's dK/dV/dQ
    int const bidb = blockIdx.z;
    int const head_dim = params.head_dim;
    // Varlen: sequence bidb is rows [q_offset, q_offset + seqlen_q) of q/dO and [k_offset,
    // k_offset + seqlen_k) of k/v/dk/dv (seq_extent.cuh).
    BwdExtent const seq = bwd_extent</*kSeqused=*/true>(params, bidb);
    int const q_offset = seq.q_offset, k_offset = seq.k_offset, seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
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
    copy_rows_async<NCopy, Smem>(smem_u32(sK), head_dim, tid, row_ptrs<NCopy, T>(tid, [&](int r) -> const T* {
        return key0 + r < seqlen_k ? k_base + (key0 + r) * params.k_row_stride : nullptr;
    }));
    copy_rows_async<NCopy, Smem>(smem_u32(sV), head_dim, tid, row_ptrs<NCopy, T>(tid, [&](int r) -> const T* {
        return key0 + r < seqlen_k ? v_base + (key0 + r) * params.v_row_stride : nullptr;
    }));
    cp_async_commit();

    float acc_dk[2][Tr::kDN][4], acc_dv[2][Tr::kDN][4];  // this warp's 32 keys x kWarpD columns
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int i = 0; i < Tr::kDN; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[mi][i][e] = acc_dv[mi][i][e] = 0.f;

    // This thread's first Sᵀ row (key; tile mi adds 16 mi, the second half 8); its query columns are
    // 2 * (lane % 4) + {0, 1} of each n8 tile.
    int const key_row = key0 + warp_n * 32 + lane / 4;
    uint32_t const sK_warp = smem_u32(sK + warp_n * 32 * kStride);
    uint32_t const sV_warp = smem_u32(sV + warp_n * 32 * kStride);
    uint32_t const sPt_warp = smem_u32(sPt) + warp_n * 32 * PSmem::kRowBytes;
    uint32_t const sdSt_warp = smem_u32(sdSt) + warp_n * 32 * PSmem::kRowBytes;
    int const dkv_chunk = (col0 + warp_m * Tr::kWarpD) / 8;  // first 16-byte chunk of this warp's dK/dV columns
    constexpr uint32_t kRowStageBytes = kBlockM * Smem::kRowBytes;
    const float* slopes = reinterpret_cast<const float*>(params.alibi_slopes_ptr);
    Dropout const dropout = Dropout::from(params);
    float* dq_accum = reinterpret_cast<float*>(params.dq_accum_ptr);
    int* semaphores = reinterpret_cast<int*>(params.semaphore_ptr);
    // dQ tile of this warp: kDQRows query rows, kDQCols head-dim columns.
    int const dq_row0 = (warp % Tr::kDQRowGroups) * Tr::kDQRows;
    int const dq_col0 = col0 + (warp / Tr::kDQRowGroups) * Tr::kDQCols;
    bool const dq_cols_all = dq_col0 + Tr::kDQCols <= head_dim;  // this warp's dQ columns all exist
    // This thread's first dQ element in a step's block of dq_accum rows (row lane / 4, column
    // 2 (lane % 4) of its tile).
    int const dq_thread_offset = (dq_row0 + lane / 4) * head_dim + dq_col0 + 2 * (lane % 4);

    // Steps enumerate (query head of the group, query block). Step t's Q, dO, LSE and D rows go
    // to stage t % kStages, fetched kStages - 1 steps ahead plus the dQ tail of the step before:
    // one commit group per step (empty past the last), so waiting for all but the newest
    // kStages - 1 groups means step t's rows (and K, V) have landed.
    int const m_count = max(m_block_max - m_block_min, 0);
    int const steps = qhpk * m_count;
    // Step t is (query head t / m_count, query block t % m_count), both advanced by counters: the
    // issued steps and the computed ones each go up by one per call/iteration (no division).
    // The issued step's first Q and dO rows and LSE/D entries: advanced by one query block per step
    // and to the next head's first block at a head's end, with no 64-bit multiplies per step.
    int const q0_first = m_block_min * kBlockM;
    int64_t const stats_first = bidb * params.stats_batch_stride + int64_t(bidh_kv) * qhpk * params.stats_head_stride +
                                q_offset + q0_first;
    const T* issue_q = reinterpret_cast<const T*>(params.q_ptr) + bidb * params.q_batch_stride +
                       (q_offset + q0_first) * params.q_row_stride + int64_t(bidh_kv) * qhpk * params.q_head_stride;
    const T* issue_do = reinterpret_cast<const T*>(params.do_ptr) + bidb * params.do_batch_stride +
                        (q_offset + q0_first) * params.do_row_stride + int64_t(bidh_kv) * qhpk * params.do_head_stride;
    int64_t issue_stats = stats_first;
    int issue_q0 = q0_first, issue_m = 0;
    auto issue_step = [&](int t) {
        if (t >= steps) {
            cp_async_commit();
            return;
        }
        int const stage = t % kStages;
        copy_strided_rows_async<MCopy, Smem>(smem_u32(sQ0 + stage * kBlockM * kStride), issue_q, params.q_row_stride,
                                             seqlen_q - issue_q0, head_dim, tid);
        copy_strided_rows_async<MCopy, Smem>(smem_u32(sdO0 + stage * kBlockM * kStride), issue_do,
                                             params.do_row_stride, seqlen_q - issue_q0, head_dim, tid);
        // LSE and D rows as asynchronous copies too, so no thread waits for them here. Padded
        // rows read 0 for both: their Q and dO rows are 0, so they still contribute exactly 0.
        static_assert(kBlockM <= Tr::kNThreads, "one LSE and one D value per thread at most");
        if (tid < kBlockM) {
            bool const valid = issue_q0 + tid < seqlen_q;
            cp_async_4(smem_u32(sLSE0 + stage * kBlockM + tid),
                       reinterpret_cast<const float*>(params.lse_log2_ptr) + issue_stats + tid, valid);
            cp_async_4(smem_u32(sD0 + stage * kBlockM + tid),
                       reinterpret_cast<const float*>(params.dsum_ptr) + issue_stats + tid, valid);
        }
        cp_async_commit();
        issue_q += kBlockM * params.q_row_stride;
        issue_do += kBlockM * params.do_row_stride;
        issue_stats += kBlockM;
        issue_q0 += kBlockM;
        if (++issue_m == m_count) {  // next head of the group, back to its first query block
            issue_m = 0;
            issue_q += params.q_head_stride - m_count * kBlockM * params.q_row_stride;
            issue_do += params.do_head_stride - m_count * kBlockM * params.do_row_stride;
            issue_stats += params.stats_head_stride - m_count * kBlockM;
            issue_q0 = q0_first;
        }
    };
#pragma unroll
    for (int t = 0; t < kStages; ++t) issue_step(t);

    int step_head = 0, step_m = 0;  // step t's (t / m_count, t % m_count)
    int64_t step_stats = stats_first;  // step t's first LSE / D / dq_accum row
    float slope = 0.f;                 // ALiBi slope of step t's head (loaded when the head starts)
    // dQ through the shared tile (not in deterministic mode, which orders the atomics): the rows
    // the tile holds, added to dq_accum at the next step's start.
    bool const dq_by_tile = Tr::kDQTile && semaphores == nullptr;
    float* tile_dq_rows = dq_accum;  // their first dq_accum row
    int tile_rows = 0;               // how many of them exist
    auto reduce_dq_tile = [&] {      // after a barrier that follows the tile's writes and fences
        if (tid < kBlockM && tid < tile_rows) {
            bulk_reduce_add_f32(tile_dq_rows + tid * head_dim, sdQ + tid * Tr::kDQPitch, head_dim * 4);
            bulk_commit();
        }
    };
    for (int t = 0; t < steps; ++t) {
        int const bidh = bidh_kv * qhpk + step_head;
        int const m_block = m_block_min + step_m;
        if (step_m == 0 && slopes != nullptr)
            slope = slopes[bidb * params.alibi_batch_stride + bidh] * params.alibi_scale;
        if (++step_m == m_count) {
            step_m = 0;
            ++step_head;
        }
        int const q0 = m_block * kBlockM;
        int const stage = t % kStages;
        uint32_t const sQ_addr = smem_u32(sQ0) + stage * kRowStageBytes;
        uint32_t const sdO_addr = smem_u32(sdO0) + stage * kRowStageBytes;
        const float* sLSE = sLSE0 + stage * kBlockM;
        const float* sD = sD0 + stage * kBlockM;
        cp_async_wait<kStages - 1>();
        __syncthreads();  // Q, dO (and K, V) landed; LSE, D written; the last step's dS reads done
        if (dq_by_tile && t > 0) reduce_dq_tile();  // the last step's dQ

        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warp's 16 keys.
        float st[2][Tr::kMN][4], dpt[2][Tr::kMN][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int i = 0; i < Tr::kMN; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[mi][i][e] = dpt[mi][i][e] = 0.f;
        uint32_t const q_rows = warp_m * Tr::kWarpQ * Smem::kRowBytes;  // this warp's queries
        gemm_ss<Element, Smem, false, Smem, false, 2, Tr::kHeadDim, Tr::kMN>(st, sK_warp, sQ_addr + q_rows, 0, lane);
        gemm_ss<Element, Smem, false, Smem, false, 2, Tr::kHeadDim, Tr::kMN>(dpt, sV_warp, sdO_addr + q_rows, 0, lane);

        // Dropout: the forward's keep bits for this thread's keys (lane / 4 and + 8 of each of the
        // warp's two 16-key chunks) and query columns; bit ((mi * kMN + ni) * 2 + column) * 2 + half.
        // The warp's 32 keys lie in one 64-key group (they start at a multiple of 32), and this
        // thread's are quad lane (lane / 4) / 2's of it (common.cuh): one Philox block per query.
        int const query_col = q0 + warp_m * Tr::kWarpQ + 2 * (lane % 4);  // this thread's first query
        uint64_t keep_bits = ~0ull;
        static_assert(Tr::kMN <= 8, "keep bits: 8 per n8 tile of queries fit 64 bits");
        if constexpr (Tr::kDropout) {
            keep_bits = 0;
            uint32_t const bh = uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(bidh);
            int const chunk0 = (key0 + warp_n * 32) / 16;  // even: chunks chunk0, chunk0 + 1 of one group
#pragma unroll
            for (int ni = 0; ni < Tr::kMN; ++ni)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    uint4 const bytes = dropout.block(bh, query_col + ni * 8 + c, chunk0 / 4, lane / 8);
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        uint32_t const word = Dropout::word(bytes, (chunk0 + mi) % 4);
#pragma unroll
                        for (int half = 0; half < 2; ++half)
                            keep_bits |= uint64_t(dropout.keep(word, 2 * half + lane / 4 % 2))
                                         << (((mi * Tr::kMN + ni) * 2 + c) * 2 + half);
                    }
                }
        }
        bool const need_mask = key0 + kBlockN > seqlen_k || (kMasked && (
            q0 + diag + params.window_right < key0 + kBlockN - 1 ||
            (Tr::kMask == Mask::Local && q0 + kBlockM - 1 + diag - params.window_left > key0)));
        // P and dS from S and dP, instantiated per (mask needed, ALiBi): a block without either
        // issues none of their instructions (predicated-off code still takes issue slots).
        auto const ctx = SoftmaxBwdArgs{sLSE + warp_m * Tr::kWarpQ, sD + warp_m * Tr::kWarpQ, key_row, query_col,
                                        diag, seqlen_k, slope, keep_bits};
        if (need_mask) {
            if (slopes != nullptr) softmax_backward<Tr, true, true>(st, dpt, ctx, params);
            else softmax_backward<Tr, true, false>(st, dpt, ctx, params);
        } else {
            if (slopes != nullptr) softmax_backward<Tr, false, true>(st, dpt, ctx, params);
            else softmax_backward<Tr, false, false>(st, dpt, ctx, params);
        }

        // Pᵀ and dSᵀ to shared memory, [key][query]: element (row lane / 4 + 8 half of tile mi,
        // columns 2 (lane % 4) + {0, 1} of tile ni) of this warp's block.
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int ni = 0; ni < Tr::kMN; ++ni) {
                    uint32_t const at = PSmem::offset(warp_n * 32 + mi * 16 + lane / 4 + 8 * half,
                                                      (warp_m * Tr::kWarpQ) / 8 + ni) + 4 * (lane % 4);
                    *reinterpret_cast<uint32_t*>(sPt + at) =
                        Element::pack2(st[mi][ni][2 * half], st[mi][ni][2 * half + 1]);
                    *reinterpret_cast<uint32_t*>(sdSt + at) =
                        Element::pack2(dpt[mi][ni][2 * half], dpt[mi][ni][2 * half + 1]);
                }
        __syncthreads();  // all of Pᵀ and dSᵀ written
        // dV += Pᵀ·dO and dK += dSᵀ·Q over all the step's queries, for this warp's keys and columns.
        gemm_ss<Element, PSmem, false, Smem, true, 2, kBlockM, Tr::kDN>(acc_dv, sPt_warp, sdO_addr, dkv_chunk, lane);
        gemm_ss<Element, PSmem, false, Smem, true, 2, kBlockM, Tr::kDN>(acc_dk, sdSt_warp, sQ_addr, dkv_chunk, lane);
        if (dq_by_tile && tid < kBlockM) bulk_wait_read();  // the last step's dQ left the tile
        __syncthreads();  // every warp is done with this stage's Q, dO, LSE, D (and the dQ tile is free)
        issue_step(t + kStages);

        // dQ tile of this warp = dS (its kDQRows queries x all keys, read transposed from dSᵀ) · K
        // (all keys x its columns).
        constexpr int kDQMI = Tr::kDQRows / 16;
        float acc_dq[kDQMI][Tr::kDQCols / 8][4];
#pragma unroll
        for (int mi = 0; mi < kDQMI; ++mi)
#pragma unroll
            for (int i = 0; i < Tr::kDQCols / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dq[mi][i][e] = 0.f;
        gemm_ss<Element, PSmem, true, Smem, true, kDQMI, kBlockN, Tr::kDQCols / 8>(
            acc_dq, smem_u32(sdSt) + dq_row0 * 2, smem_u32(sK), dq_col0 / 8, lane);
        if (dq_by_tile) {
            // Into the tile; the bulk reductions after the next barrier add it to dq_accum.
#pragma unroll
            for (int mi = 0; mi < kDQMI; ++mi)
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int ni = 0; ni < Tr::kDQCols / 8; ++ni)
                        st_shared_f32x2(sdQ + (dq_row0 + mi * 16 + half * 8 + lane / 4) * Tr::kDQPitch +
                                            (dq_col0 + ni * 8 + 2 * (lane % 4)) * 4,
                                        acc_dq[mi][ni][2 * half], acc_dq[mi][ni][2 * half + 1]);
            fence_proxy_async();  // visible to the bulk copies (async proxy)
            tile_dq_rows = dq_accum + step_stats * head_dim;
            tile_rows = seqlen_q - q0;
        } else {
            // Add to the fp32 dQ buffer (bidb, bidh, query, head_dim) with atomics.
            auto semaphore = [&] {
                return semaphores + ((int64_t(bidb) * params.nheads + bidh) * Tr::kDSlices + slice) * m_blocks_stride + m_block;
            };
            if (semaphores != nullptr) {
                // Deterministic: the key blocks that see this query block add to it one after another,
                // in key order. They are n_first.. (a local window's left edge skips the first ones);
                // lower blocks are launched first, so the wait always ends.
                int const n_first = Tr::kMask == Mask::Local ? max(0, (q0 + diag - params.window_left) / kBlockN) : 0;
                if (tid == 0) {
                    int* const sem = semaphore();
                    while (atomicAdd(sem, 0) != n_block - n_first) {
                    }
                }
                __syncthreads();
            }
            // Only a sequence's last query block (or a head dim below the instance's) needs predicates.
            float* const dq_first = dq_accum + step_stats * head_dim + dq_thread_offset;
            if (q0 + kBlockM <= seqlen_q && dq_cols_all) {
                add_dq_fragments<false>(acc_dq, dq_first, head_dim, 0, 0);
            } else {
                // Bit di: this thread's columns of dQ tile di are inside head_dim.
                static_assert(Tr::kDQCols / 8 <= 32, "one bit per n8 tile");
                uint32_t dq_cols_ok = 0;
#pragma unroll
                for (int di = 0; di < Tr::kDQCols / 8; ++di)
                    dq_cols_ok |= uint32_t(dq_col0 + di * 8 + 2 * (lane % 4) < head_dim) << di;
                add_dq_fragments<true>(acc_dq, dq_first, head_dim, seqlen_q - (q0 + dq_row0 + lane / 4), dq_cols_ok);
            }
            if (semaphores != nullptr) {
                __threadfence();
                __syncthreads();
                if (tid == 0) atomicAdd(semaphore(), 1);
            }
        }
        step_stats += kBlockM;
        if (step_m == 0) step_stats += params.stats_head_stride - m_count * kBlockM;  // the next head's first block
    }
    if (dq_by_tile && steps > 0) {
        __syncthreads();  // the last step's dQ tile written
        reduce_dq_tile();
    }
    if (Tr::kDQTile && tid < kBlockM) bulk_wait_all();  // the reductions read shared memory until they complete

    // dK (scaled) and dV for this CTA's keys and head-dim slice.
    T* dk_base = reinterpret_cast<T*>(params.dk_ptr) + bidb * params.dk_batch_stride +
                 k_offset * params.dk_row_stride + bidh_kv * params.dk_head_stride;
    T* dv_base = reinterpret_cast<T*>(params.dv_ptr) + bidb * params.dv_batch_stride +
                 k_offset * params.dv_row_stride + bidh_kv * params.dv_head_stride;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int const key = key_row + mi * 16 + 8 * half;
            if (key < seqlen_k) {
#pragma unroll
                for (int di = 0; di < Tr::kDN; ++di) {
                    int const col = dkv_chunk * 8 + di * 8 + 2 * (lane % 4);
                    if (col < head_dim) {
                        *reinterpret_cast<uint32_t*>(dk_base + key * params.dk_row_stride + col) =
                            Element::pack2(acc_dk[mi][di][2 * half] * params.softmax_scale,
                                           acc_dk[mi][di][2 * half + 1] * params.softmax_scale);
                        *reinterpret_cast<uint32_t*>(dv_base + key * params.dv_row_stride + col) =
                            Element::pack2(acc_dv[mi][di][2 * half], acc_dv[mi][di][2 * half + 1]);
                    }
                }
            }
        }
}

}  // namespace flashgen
