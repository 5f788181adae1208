// The sm80 forward family: mma.sync m16n8k16, ldmatrix, cp.async, online softmax.
//
// One CTA computes kBlockM query rows of one (batch, head) — or, with PackGQA, kBlockM packed rows
// of the qhead_per_khead query heads that share one KV head — against all visible keys:
//
//   for each visible key block n (last to first):
//     wait K(n); refill the buffer V(n+1) freed;  S = Q·Kᵀ;  softcap, ALiBi, mask;  online softmax -> P
//     wait V(n); refill K(n)'s buffer;            O += P·V
//
// K and V blocks take kKVBuffers shared-memory buffers in turn (a ring; each copy kKVBuffers - 1
// copies ahead of its use). Two buffers: V(n) loads during Q·Kᵀ and K(n-1) during P·V, enough when
// the math is long (prefill); decode, whose math is short, keeps more copies in flight. Paged decode
// instances instead keep K and V of a block in a pair of buffers (kStageRing): wait for block n's
// pair, S, softmax, O, then refill the pair with block n - kKVBuffers / 2.
//
// Each warp owns kWarpM (16 or 32) query rows and all kBlockN key columns, so the softmax row
// reductions stay inside a quad of lanes. Shared-memory tiles are unpadded rows with XOR-swizzled
// 16-byte chunks (SwizzledRows below): every ldmatrix phase is conflict-free, and each cp.async
// row copy fills whole aligned runs of shared memory, so the L2 gets whole-line requests.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "seq_extent.cuh"

namespace flashgen {


// Shared-memory layout of tiles whose rows hold kHeadDim 16-bit elements (the forward's Q/K/V and
// the backward's K/V/Q/dO): offset(row, chunk) is the byte offset of a row's 16-byte chunk.
// step(base, chunk) moves a lane's address of (row, c) to (row, c + chunk) for a chunk whose bits c
// does not use (c < 2 and chunk even, as in the mma loops).
//
// Rows are unpadded and their chunks XOR-permuted within aligned groups of kGroup chunks (128 bytes;
// 64 for d96, whose 192-byte rows hold no whole 128-byte group). The key of a row makes the 8
// consecutive rows an ldmatrix phase reads at one chunk hit 8 different 16-byte bank groups (d96:
// rows alternate between the halves of a 128-byte run, so the key is row / 2). A row's cp.async
// copy fills whole aligned groups. Rows padded by 16 bytes would also avoid bank conflicts, but
// then a row's copy straddles two 128-byte runs of shared memory and cp.async splits its global
// request there: ncu on the H200 measured 1.5x the L2 sectors of the tile (24 per 512-byte warp
// copy instead of 16; benchmarks/results/exploration/decode.md). Tiles start at multiples of 128 bytes.
template <int kHeadDim>
struct SwizzledRows {
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kGroup = kChunks % 8 == 0 ? 8 : 4;
    static_assert(kChunks % kGroup == 0, "swizzled rows need a head dim that is a multiple of 32");
    static __device__ __forceinline__ int key(int row) { return kGroup == 8 ? row % 8 : (row / 2) % 4; }
    static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
        return row * kRowBytes + ((chunk & ~(kGroup - 1)) | ((chunk ^ key(row)) & (kGroup - 1))) * 16;
    }
    static __device__ __forceinline__ uint32_t step(uint32_t base, int chunk) {
        return (base ^ uint32_t((chunk & (kGroup - 1)) * 16)) + uint32_t((chunk & ~(kGroup - 1)) * 16);
    }
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsN_,
          int kKVBuffers_, Mask kMask_, bool kSoftcap_, bool kPackGQA_, bool kPaged_, bool kDropout_, bool kDecode_>
struct FwdTraits {
    using Element = Element_;
    using T = typename Element::storage;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    // Key-block buffers in shared memory, which K and V blocks take in turn (FwdTile.kv_buffers).
    static constexpr int kKVBuffers = kKVBuffers_;
    static constexpr Mask kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;
    static constexpr bool kPackGQA = kPackGQA_;
    static constexpr bool kPaged = kPaged_;  // K/V rows through a page table
    static constexpr bool kDropout = kDropout_;  // Philox mask on the probabilities (common.cuh)
    // The decode tile (few rows, FWD_DECODE_TILE): on sm_90+ its splits may merge in a cluster
    // instead of through the combine kernel (merge_splits_in_cluster).
    static constexpr bool kDecode = kDecode_;
    // Paged decode keeps each block's K and V in a pair of buffers (a ring of kKVBuffers / 2 K+V
    // stages): one page-table preparation serves both copies, issued back to back. H200, b1 x 128k
    // keys, page 16: 129 us against 167 us with three buffers taken in turn (tiles.py,
    // DECODE_PAGED_SHARED_RING).
    static constexpr bool kStageRing = kPaged && kDecode && kKVBuffers > 2 && kKVBuffers % 2 == 0;
    static constexpr int kStages = kKVBuffers / 2;  // K+V pairs (kStageRing only)
    static_assert(kKVBuffers >= 2, "K and V need a buffer each");

    // Warps split the query rows kWarpsM ways and each key block kWarpsN ways. kWarpsN > 1 is for
    // decode, where a 16-row tile is already mostly padding: more warps then share the key blocks
    // (each keeps its own softmax state) instead of computing padding rows, and merge at the end.
    static constexpr int kWarpsN = kWarpsN_;
    static constexpr int kWarpsM = kNWarps / kWarpsN;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kWarpM = kBlockM / kWarpsM;  // query rows per warp
    static constexpr int kWarpN = kBlockN / kWarpsN;  // keys per warp per block
    static constexpr int kMI = kWarpM / 16;           // m16 tiles per warp
    static constexpr int kNI = kWarpN / 8;            // n8 tiles of a warp's S
    static constexpr int kDI = kHeadDim / 8;          // n8 tiles of O
    using Smem = SwizzledRows<kHeadDim>;  // layout of the Q, K and V tiles in shared memory
    // [Q | buffer 0 | buffer 1 | ...]; the instance checks it against the host's request (FwdTile.smem_bytes).
    static constexpr int kSmemBytes = (kBlockM + kKVBuffers * kBlockN) * Smem::kRowBytes;

    static_assert(kWarpM == 16 || kWarpM == 32, "a warp owns 16 or 32 query rows");
    static_assert(kWarpsM * kWarpsN == kNWarps, "warps tile the block");
    static_assert(kWarpN % 16 == 0 && kHeadDim % 16 == 0, "tiles are multiples of 16");
};

// How a tile of rows x kHeadDim elements is split over the CTA's threads for 16-byte copies:
// each row is cut into chunks of the largest of 128/64/32 bytes that divides it, and one chunk is
// kThreadsPerRow consecutive lanes. A thread always touches the same rows, so it can work out
// their global addresses once.
template <int kRows_, int kHeadDim, int kNThreads>
struct RowCopy {
    static constexpr int kRows = kRows_;
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunkElems =
        (kRowBytes % 128 == 0 ? 128 : (kRowBytes % 64 == 0 ? 64 : 32)) / 2;
    static constexpr int kThreadsPerRow = kChunkElems / 8;
    static constexpr int kRowsPerPass = kNThreads / kThreadsPerRow;
    static constexpr int kRowIters = (kRows_ + kRowsPerPass - 1) / kRowsPerPass;
    static constexpr int kColIters = kHeadDim / kChunkElems;
    static constexpr bool kRowsExact = kRows_ % kRowsPerPass == 0;
    // Row pointers each thread computes; the others are fetched from the lanes sharing the row.
    static constexpr int kPtrsPerThread = (kRowIters + kThreadsPerRow - 1) / kThreadsPerRow;
    static_assert(32 % kThreadsPerRow == 0, "a row's lanes must sit in one warp");
};

// The global row addresses one thread computes for a tile copy (see RowCopy).
template <typename Copy, typename T>
struct RowPtrs {
    const T* ptr[Copy::kPtrsPerThread];
};

// row_ptr(r) gives the global address of tile row r, or nullptr for rows outside the tensor. Each
// row's address is computed by one of the lanes that share the row (not by all of them), which
// matters when computing it costs a division and a table load (PackGQA, paged KV).
template <typename Copy, typename T, typename RowPtr>
__device__ __forceinline__ RowPtrs<Copy, T> row_ptrs(int tid, RowPtr row_ptr) {
    int const lane_in_row = tid % Copy::kThreadsPerRow;
    int const row0 = tid / Copy::kThreadsPerRow;
    RowPtrs<Copy, T> ptrs;
#pragma unroll
    for (int p = 0; p < Copy::kPtrsPerThread; ++p) {
        int const i = p * Copy::kThreadsPerRow + lane_in_row;
        int const row = row0 + i * Copy::kRowsPerPass;
        ptrs.ptr[p] = (i < Copy::kRowIters && row < Copy::kRows) ? row_ptr(row) : nullptr;
    }
    return ptrs;
}

// Every row's columns start at 0 (copy_rows_async's default).
struct ColumnsFromZero {
    static constexpr bool kShifted = false;
    __device__ __forceinline__ int operator()(int) const { return 0; }
};

// The first column of a packed query row's q when a decode CTA reads kv_head_group adjacent KV
// heads (flash_fwd_sm80): the g-th head's rows hold their q in columns [g * head_dim, (g + 1) *
// head_dim). Row r of the tile is packed row row_start + r.
struct GroupedHeadColumns {
    static constexpr bool kShifted = true;
    FastDivmod qhpk;  // query heads per CTA head index
    int row_start, qheads_per_kv, head_dim;
    __device__ __forceinline__ int operator()(int r) const {
        int h_in_group;
        qhpk.divmod(h_in_group, row_start + r);
        return h_in_group / qheads_per_kv * head_dim;
    }
};

// Copies rows [0, kRows) of a tile into shared memory (at shared address smem, in Layout), each row's
// address broadcast from the lane that computed it. Rows with a null address, and columns outside
// [first_col(row), first_col(row) + head_dim), are zero-filled (the first column a row's data
// starts at is 0 unless a FirstCol with kShifted is given). kReadOnce: rows no other copy reads
// again, copied under the L2 evict-first policy.
template <typename Copy, typename Layout, bool kReadOnce = false, typename T, typename FirstCol = ColumnsFromZero>
__device__ __forceinline__ void copy_rows_async(uint32_t smem, int head_dim, int tid,
                                                const RowPtrs<Copy, T>& ptrs, FirstCol first_col = {}) {
    int const lane_in_row = tid % Copy::kThreadsPerRow;
    int const row0 = tid / Copy::kThreadsPerRow;
    uint64_t const policy = kReadOnce ? l2_evict_first_policy() : 0;
#pragma unroll
    for (int i = 0; i < Copy::kRowIters; ++i) {
        const T* gptr = reinterpret_cast<const T*>(__shfl_sync(
            0xffffffff, reinterpret_cast<unsigned long long>(ptrs.ptr[i / Copy::kThreadsPerRow]),
            i % Copy::kThreadsPerRow, Copy::kThreadsPerRow));
        int const row = row0 + i * Copy::kRowsPerPass;
        if (Copy::kRowsExact || row < Copy::kRows) {
            int const col_begin = FirstCol::kShifted ? first_col(row) : 0;
#pragma unroll
            for (int j = 0; j < Copy::kColIters; ++j) {
                int const col = lane_in_row * 8 + j * Copy::kChunkElems;
                bool const valid = gptr != nullptr && col < col_begin + head_dim &&
                                   (!FirstCol::kShifted || col >= col_begin);
                if constexpr (kReadOnce) {
                    cp_async_16(smem + Layout::offset(row, col / 8), valid ? gptr + col : gptr, valid, policy);
                } else {
                    cp_async_16(smem + Layout::offset(row, col / 8), valid ? gptr + col : gptr, valid);
                }
            }
        }
    }
}

// Same partition, for a tile whose rows are row_stride elements apart from first_row: rows at or
// past rows_left and columns at or past head_dim are zero-filled. No per-row address table or
// shuffles: one 64-bit add per pass of rows, for tiles copied every step of a hot loop (the
// backward's Q and dO; the per-row version cost ~150 instructions per warp and step there).
template <typename Copy, typename Layout, typename T>
__device__ __forceinline__ void copy_strided_rows_async(uint32_t smem, const T* first_row, int64_t row_stride,
                                                        int rows_left, int head_dim, int tid) {
    // A pass moves whole swizzle periods of rows (8) and a column step whole swizzle groups, so
    // every chunk's shared address is the first one's plus a constant.
    static_assert(Copy::kRowsPerPass % 8 == 0 && (Copy::kChunkElems / 8) % Layout::kGroup == 0,
                  "passes and column steps keep the swizzle phase");
    int const lane_in_row = tid % Copy::kThreadsPerRow;
    int const row0 = tid / Copy::kThreadsPerRow;
    const T* gptr = first_row + row0 * row_stride + lane_in_row * 8;
    uint32_t const sfirst = smem + Layout::offset(row0, lane_in_row);
#pragma unroll
    for (int i = 0; i < Copy::kRowIters; ++i) {
        int const row = row0 + i * Copy::kRowsPerPass;
        if (Copy::kRowsExact || row < Copy::kRows) {
#pragma unroll
            for (int j = 0; j < Copy::kColIters; ++j) {
                int const col = lane_in_row * 8 + j * Copy::kChunkElems;
                cp_async_16(sfirst + (i * Copy::kRowsPerPass * Layout::kRowBytes + j * Copy::kChunkElems * 2),
                            gptr + j * Copy::kChunkElems, row < rows_left && col < head_dim);
            }
        }
        gptr += Copy::kRowsPerPass * row_stride;
    }
}

// Same partition, shared (the tile at smem, in Layout) -> global, 16-byte stores; rows with a null
// address are skipped.
template <typename Copy, typename Layout, typename T, typename RowPtr>
__device__ __forceinline__ void store_rows(const T* smem, int head_dim, int tid, RowPtr row_ptr) {
    int const lane_in_row = tid % Copy::kThreadsPerRow;
    int const row0 = tid / Copy::kThreadsPerRow;
    T* ptrs[Copy::kPtrsPerThread];
#pragma unroll
    for (int p = 0; p < Copy::kPtrsPerThread; ++p) {
        int const i = p * Copy::kThreadsPerRow + lane_in_row;
        int const row = row0 + i * Copy::kRowsPerPass;
        ptrs[p] = (i < Copy::kRowIters && row < Copy::kRows) ? row_ptr(row) : nullptr;
    }
#pragma unroll
    for (int i = 0; i < Copy::kRowIters; ++i) {
        T* gptr = reinterpret_cast<T*>(__shfl_sync(
            0xffffffff, reinterpret_cast<unsigned long long>(ptrs[i / Copy::kThreadsPerRow]),
            i % Copy::kThreadsPerRow, Copy::kThreadsPerRow));
        int const row = row0 + i * Copy::kRowsPerPass;
        if (gptr != nullptr && (Copy::kRowsExact || row < Copy::kRows)) {
#pragma unroll
            for (int j = 0; j < Copy::kColIters; ++j) {
                int const col = lane_in_row * 8 + j * Copy::kChunkElems;
                if (col < head_dim) {
                    *reinterpret_cast<uint4*>(gptr + col) = *reinterpret_cast<const uint4*>(
                        reinterpret_cast<const unsigned char*>(smem) + Layout::offset(row, col / 8));
                }
            }
        }
    }
}

// S[kMI][kNI] += Q(warp rows) · K(block)ᵀ, both operands from shared memory.
// Software-pipelined: the ldmatrix of step t+1 is issued before the mma of step t, so shared-memory
// latency hides behind tensor-core work (the asm statements keep their order).
template <typename Tr>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kMI][Tr::kNI][4], uint32_t sQ_warp,
                                        uint32_t sK_addr, int lane) {
    using Smem = typename Tr::Smem;
    constexpr int kKSteps = Tr::kHeadDim / 16;
    constexpr int kNPairs = Tr::kNI / 2;
    // ldmatrix lane -> (row, chunk) of its 8x8 matrix: A tiles are [rows 0-15] x [k 0-7 | 8-15];
    // B tiles (K rows are the n index) pair two n8 tiles: [n 0-7 | 8-15] x [k 0-7 | 8-15]. Row
    // offsets of 16 keep a row's swizzle key, so they are plain additions.
    uint32_t const a_base = sQ_warp + Smem::offset(lane % 16, lane / 16);
    uint32_t const b_base = sK_addr + Smem::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    auto load_a = [&](uint32_t (&a)[Tr::kMI][4], int kk) {
#pragma unroll
        for (int mi = 0; mi < Tr::kMI; ++mi)
            ldmatrix_x4(a[mi], Smem::step(a_base, 2 * kk) + mi * 16 * Smem::kRowBytes);
    };
    auto load_b = [&](uint32_t (&b)[4], int kk, int nj) {
        ldmatrix_x4(b, Smem::step(b_base, 2 * kk) + nj * 16 * Smem::kRowBytes);
    };
    uint32_t a[2][Tr::kMI][4];
    uint32_t b[2][4];
    load_a(a[0], 0);
    load_b(b[0], 0, 0);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        if (kk + 1 < kKSteps) load_a(a[(kk + 1) % 2], kk + 1);
#pragma unroll
        for (int nj = 0; nj < kNPairs; ++nj) {
            int const t = kk * kNPairs + nj;
            if (nj + 1 < kNPairs) {
                load_b(b[(t + 1) % 2], kk, nj + 1);
            } else if (kk + 1 < kKSteps) {
                load_b(b[(t + 1) % 2], kk + 1, 0);
            }
#pragma unroll
            for (int mi = 0; mi < Tr::kMI; ++mi) {
                mma_16816<typename Tr::Element>(s[mi][2 * nj], a[kk % 2][mi], b[t % 2][0], b[t % 2][1]);
                mma_16816<typename Tr::Element>(s[mi][2 * nj + 1], a[kk % 2][mi], b[t % 2][2], b[t % 2][3]);
            }
        }
    }
}

// O[kMI][kDI] += P · V(block), P from registers (A layout), V from shared memory (transposed),
// pipelined like gemm_qk.
template <typename Tr>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kMI][Tr::kDI][4],
                                        const uint32_t (&p)[Tr::kMI][Tr::kWarpN / 16][4],
                                        uint32_t sV_addr, int lane) {
    using Smem = typename Tr::Smem;
    constexpr int kKSteps = Tr::kWarpN / 16;
    constexpr int kDPairs = Tr::kDI / 2;
    // Transposed B tiles: [keys 0-7 | 8-15] x [d 0-7 | 8-15], one 8x8 matrix per lane octet.
    uint32_t const b_base = sV_addr + Smem::offset(((lane / 8) % 2) * 8 + lane % 8, lane / 16);
    auto load_b = [&](uint32_t (&b)[4], int kk, int dj) {
        ldmatrix_x4_trans(b, Smem::step(b_base, 2 * dj) + kk * 16 * Smem::kRowBytes);
    };
    uint32_t b[2][4];
    load_b(b[0], 0, 0);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
        for (int dj = 0; dj < kDPairs; ++dj) {
            int const t = kk * kDPairs + dj;
            if (dj + 1 < kDPairs) {
                load_b(b[(t + 1) % 2], kk, dj + 1);
            } else if (kk + 1 < kKSteps) {
                load_b(b[(t + 1) % 2], kk + 1, 0);
            }
#pragma unroll
            for (int mi = 0; mi < Tr::kMI; ++mi) {
                mma_16816<typename Tr::Element>(o[mi][2 * dj], p[mi][kk], b[t % 2][0], b[t % 2][1]);
                mma_16816<typename Tr::Element>(o[mi][2 * dj + 1], p[mi][kk], b[t % 2][2], b[t % 2][3]);
            }
        }
    }
}

// Split-KV merged without the combine kernel (decode on sm_90+, where a second kernel's launch and
// the global round trips of the partials are a large share of a step): the num_splits CTAs of a
// tile are one thread-block cluster (the host launches clusters of (1, 1, num_splits), splits
// being consecutive in blockIdx.z). Each split leaves its normalized fp32 O rows and their lse in
// its own shared memory; after a cluster barrier the split of rank 0 reads every split's rows
// through distributed shared memory, merges them with combine.cuh's weighting,
// w_s = exp(lse_s - max) / sum_t exp(lse_t - max) (a split without keys, lse -inf, selected away),
// and stores O and lse; a second barrier keeps the others' shared memory alive until it has read.
constexpr int kMaxClusterSplits = 8;  // the portable cluster size; Tuning.decode_cluster_splits

template <typename Tr>
struct ClusterMergeSmem {  // at the end of the forward's shared memory
    static constexpr int kBytes = Tr::kBlockM * (Tr::kHeadDim + 1) * 4;
    static constexpr int kOffset = Tr::kSmemBytes - kBytes;
    // [kBlockM][kHeadDim] O, then [kBlockM] lse. Past the warps' merge exchange (from buffer 0).
    static constexpr bool kFits = kOffset >= Tr::kBlockM * Tr::Smem::kRowBytes +
                                                 (Tr::kNWarps - Tr::kWarpsM) * (Tr::kMI * 4 + Tr::kMI * Tr::kDI * 4) * 32 * 4;
};

template <typename Tr>
__device__ __forceinline__ void merge_splits_in_cluster(const FwdParams& params, unsigned char* smem, int rows,
                                                        int row_start, int bidb, int bidh, int q_offset) {
#if __CUDA_ARCH__ >= 900
    using T = typename Tr::T;
    using Merge = ClusterMergeSmem<Tr>;
    static_assert(Merge::kFits, "the cluster merge's rows do not overlap the warps' merge exchange");
    uint32_t const o_rows = smem_u32(smem + Merge::kOffset);
    uint32_t const lse_rows = o_rows + Tr::kBlockM * Tr::kHeadDim * 4;
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    if (rank == 0) {
        int const num_splits = params.num_splits;
        int const chunks = params.head_dim / 4;  // float4 column chunks of a row
        FastDivmod const qhpk = params.qhead_per_khead;
        T* const o_base = reinterpret_cast<T*>(params.o_ptr) + bidb * params.o_batch_stride;
        for (int item = threadIdx.x; item < rows * chunks; item += Tr::kNThreads) {
            int const r = item / chunks, c = item - r * chunks;
            uint32_t const lse_addr = lse_rows + r * 4, o_addr = o_rows + (r * Tr::kHeadDim + c * 4) * 4;
            // One round trip: every split's lse and chunk in flight at once.
            float lse[kMaxClusterSplits];
            float4 o[kMaxClusterSplits];
#pragma unroll
            for (int s = 0; s < kMaxClusterSplits; ++s) {
                lse[s] = -kInfinity;
                o[s] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (s < num_splits) {
                    uint32_t remote_lse, remote_o;
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_lse) : "r"(lse_addr), "r"(s));
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_o) : "r"(o_addr), "r"(s));
                    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(lse[s]) : "r"(remote_lse) : "memory");
                    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=f"(o[s].x), "=f"(o[s].y), "=f"(o[s].z), "=f"(o[s].w) : "r"(remote_o) : "memory");
                }
            }
            float m = -kInfinity;
#pragma unroll
            for (int s = 0; s < kMaxClusterSplits; ++s) m = fmaxf(m, lse[s]);
            float const shift = m == -kInfinity ? 0.f : m;
            float sum = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < kMaxClusterSplits; ++s) {
                float const w = __expf(lse[s] - shift);  // exp(-inf) = 0: splits without keys weigh nothing
                sum += w;
                // Select, not multiply: a split without keys weighs 0 and may hold anything.
                acc.x += w != 0.f ? w * o[s].x : 0.f;
                acc.y += w != 0.f ? w * o[s].y : 0.f;
                acc.z += w != 0.f ? w * o[s].z : 0.f;
                acc.w += w != 0.f ? w * o[s].w : 0.f;
            }
            float const inv_sum = sum > 0.f ? __frcp_rn(sum) : 0.f;
            int const row = row_start + r;
            int const mq = Tr::kPackGQA ? qhpk.div(row) : row;
            int const head = Tr::kPackGQA ? bidh * qhpk.divisor + (row - mq * qhpk.divisor) : bidh;
            T* const dst = o_base + (q_offset + mq) * params.o_row_stride + head * params.o_head_stride + c * 4;
            *reinterpret_cast<uint2*>(dst) = make_uint2(Tr::Element::pack2(acc.x * inv_sum, acc.y * inv_sum),
                                                        Tr::Element::pack2(acc.z * inv_sum, acc.w * inv_sum));
            if (c == 0) {
                reinterpret_cast<float*>(params.lse_ptr)[bidb * params.lse_batch_stride +
                                                         head * params.lse_head_stride + q_offset + mq] =
                    sum > 0.f ? m + __logf(sum) : -kInfinity;
            }
        }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

template <typename Tr>
__device__ __forceinline__ void flash_fwd_sm80(const FwdParams& params) {
    using T = typename Tr::T;
    using Element = typename Tr::Element;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kMI = Tr::kMI, kNI = Tr::kNI,
                  kDI = Tr::kDI, kWarpN = Tr::kWarpN;
    using Smem = typename Tr::Smem;
    constexpr int kStride = Smem::kRowBytes / 2;  // elements from one tile row to the next
    constexpr bool kMasked = Tr::kMask != Mask::None;
    using QCopy = RowCopy<kBlockM, Tr::kHeadDim, Tr::kNThreads>;
    using KVCopy = RowCopy<kBlockN, Tr::kHeadDim, Tr::kNThreads>;

    // Decode instances are launched as programmatic dependents on sm_90+ (FwdPlan.dependent_launch):
    // nothing may be read before the previous kernel on the stream has finished.
    if constexpr (Tr::kDecode) grid_dependency_wait();
    extern __shared__ __align__(128) unsigned char smem_raw[];  // swizzled tiles start at 128 bytes
    // [Q | buffer 0 | buffer 1 | ...]: kKVBuffers key blocks of K or V.
    T* sQ = reinterpret_cast<T*>(smem_raw);
    auto kv_buffer = [&](int buffer) { return sQ + (kBlockM + buffer * kBlockN) * kStride; };

    int const tid = threadIdx.x;
    int const warp = tid / 32;
    int const lane = tid % 32;
    int const warp_m = warp % Tr::kWarpsM;  // which rows of the block this warp owns
    int const warp_n = warp / Tr::kWarpsM;  // which keys of each key block
    // Under a causal/local mask the last query blocks see the most keys: start them first.
    int const m_block = kMasked ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    int const bidh = blockIdx.y;  // query head, or KV head under PackGQA
    // blockIdx.z enumerates (batch, split) pairs; without split-KV num_splits is 1.
    int const num_splits = params.num_splits;
    int const bidb = int(blockIdx.z) / num_splits;
    int const split = int(blockIdx.z) - bidb * num_splits;
    FastDivmod const qhpk = params.qhead_per_khead;
    int const head_dim = params.head_dim;
    // Decode over adjacent KV heads may give a CTA kv_head_group = 2 of them (FwdPlan.kv_head_group;
    // the host takes it only when head_dim is half the instance's). A key's rows of both heads are
    // then one contiguous row of 2 * head_dim elements, whose 128-byte lines no other CTA reads (two
    // heads' CTAs each fetched the line d96's 192-byte rows share). The packed query rows are those
    // of both heads, and a row of the g-th one holds its q in columns [g * head_dim, (g + 1) *
    // head_dim), zeros elsewhere: it scores against its own head's half of the row, and its O is
    // that half of P·V, moved to the first head_dim columns before the epilogue.
    constexpr bool kGroupable = Tr::kDecode && Tr::kPackGQA;
    int const kv_group = kGroupable ? params.kv_head_group : 1;
    int const qheads_per_kv = qhpk.divisor / kv_group;
    int const kv_cols = head_dim * kv_group;  // columns of a K/V row copy
    int const bidh_kv = Tr::kPackGQA ? bidh * kv_group : qhpk.div(bidh);

    const int* block_table = reinterpret_cast<const int*>(params.block_table_ptr);
    const int* cu_seqlens_q = reinterpret_cast<const int*>(params.cu_seqlens_q_ptr);
    SeqExtent const extent = seq_extent<Tr::kPaged>(params, bidb);
    int const q_offset = extent.q_offset, seqlen_q = extent.seqlen_q;
    int const leftpad = extent.k_offset, seqlen_k = extent.seqlen_k, kv_b = extent.kv_b;
    // Packed rows: row r is query position r / qhpk of head bidh * qhpk + r % qhpk.
    int const rows_total = Tr::kPackGQA ? seqlen_q * qhpk.divisor : seqlen_q;
    int const row_start = m_block * kBlockM;
    if (row_start >= rows_total) return;  // a varlen sequence shorter than the longest
    // Key j is visible from query i iff i + diag - window_left <= j <= i + diag + window_right.
    int const diag = seqlen_k - seqlen_q;

    auto query_pos = [&](int row) { return Tr::kPackGQA ? qhpk.div(row) : row; };

    KeyBlocks const blocks = key_blocks<Tr::kMask>(query_pos(row_start), query_pos(min(row_start + kBlockM, rows_total) - 1),
                                                   diag, seqlen_k, kBlockN, params.window_left, params.window_right);
    int n_block_min = blocks.begin, n_block_max = blocks.end;
    int const n_block_mask_right = blocks.mask_right_begin, n_block_mask_left = blocks.mask_left_end;
    if (num_splits > 1) {  // this split's share of the key blocks
        int const per_split = ((seqlen_k + kBlockN - 1) / kBlockN + num_splits - 1) / num_splits;
        n_block_min = max(n_block_min, split * per_split);
        n_block_max = min(n_block_max, (split + 1) * per_split);
    }

    // ---- Prologue: Q and the first K/V copies of the ring in flight.
    const T* q_base = reinterpret_cast<const T*>(params.q_ptr) + bidb * params.q_batch_stride +
                      q_offset * params.q_row_stride;
    auto const q_ptrs = row_ptrs<QCopy, T>(tid, [&](int r) -> const T* {
        int const row = row_start + r;
        if (row >= rows_total) return nullptr;
        if constexpr (Tr::kPackGQA) {
            int h_in_group;
            int const m = qhpk.divmod(h_in_group, row);
            // (Grouped: offset by the row's first column, so that column c reads q[c - first].)
            return q_base + m * params.q_row_stride +
                   (bidh * qhpk.divisor + h_in_group) * params.q_head_stride -
                   (kGroupable ? h_in_group / qheads_per_kv * head_dim : 0);
        } else {
            return q_base + row * params.q_row_stride + bidh * params.q_head_stride;
        }
    });
    if constexpr (kGroupable) {
        copy_rows_async<QCopy, Smem>(smem_u32(sQ), head_dim, tid, q_ptrs,
                                     GroupedHeadColumns{qhpk, row_start, qheads_per_kv, head_dim});
    } else {
        copy_rows_async<QCopy, Smem>(smem_u32(sQ), head_dim, tid, q_ptrs);
    }
    // K/V rows: key j of this batch element is row leftpad + j of its K/V row, or, when paged,
    // row (leftpad + j) % page_size of page block_table[b][(leftpad + j) / page_size].
    int64_t const kv_row0 = Tr::kPaged ? 0 : int64_t(kv_b) * params.k_batch_stride + leftpad * params.k_row_stride;
    int64_t const v_row0 = Tr::kPaged ? 0 : int64_t(kv_b) * params.v_batch_stride + leftpad * params.v_row_stride;
    const T* k_base = reinterpret_cast<const T*>(params.k_ptr) + kv_row0 + bidh_kv * params.k_head_stride;
    const T* v_base = reinterpret_cast<const T*>(params.v_ptr) + v_row0 + bidh_kv * params.v_head_stride;
    const int* pages = block_table + bidb * params.block_table_batch_stride;
    // The K and V rows of a key block. Contiguous, a row's address is one multiply-add, computed
    // when the copy is issued. Paged, each row costs a page-table load; prepare_kv issues those of a
    // block ahead of its copies (in the ring, as soon as the previous block's V copy is out) and
    // keeps their results in registers, so the copies that use them rarely wait for the table.
    using KVPtrs = RowPtrs<KVCopy, T>;
    KVPtrs k_ptrs, v_ptrs;  // paged only
    auto kv_row_ptrs = [&](int n_block, const T* base, int64_t page_stride, int64_t row_stride) {
        int const first = n_block * kBlockN;
        return row_ptrs<KVCopy, T>(tid, [&](int r) -> const T* {
            int const key = first + r;
            if (key >= seqlen_k) return nullptr;
            if constexpr (!Tr::kPaged) {
                return base + key * row_stride;
            } else {
                int offset;
                int const page = pages[params.page_size.divmod(offset, leftpad + key)];
                if (page < 0 || page >= params.kv_batch) return nullptr;
                return base + page * page_stride + offset * row_stride;
            }
        });
    };
    auto prepare_kv = [&](int n_block) {
        if constexpr (Tr::kPaged) {
            k_ptrs = kv_row_ptrs(n_block, k_base, params.k_batch_stride, params.k_row_stride);
            v_ptrs = kv_row_ptrs(n_block, v_base, params.v_batch_stride, params.v_row_stride);
        }
    };
    // Decode reads each K/V row once (a second row block, when there is one, reads it at the same
    // time): under the L2 evict-first policy. Prefill row blocks re-read K/V from L2.
    auto load_k = [&](int buffer, int n_block) {  // paged: block n_block must be the one prepared
        copy_rows_async<KVCopy, Smem, Tr::kDecode>(smem_u32(kv_buffer(buffer)), kv_cols, tid,
                                      Tr::kPaged ? k_ptrs : kv_row_ptrs(n_block, k_base, 0, params.k_row_stride));
    };
    auto load_v = [&](int buffer, int n_block) {
        copy_rows_async<KVCopy, Smem, Tr::kDecode>(smem_u32(kv_buffer(buffer)), kv_cols, tid,
                                      Tr::kPaged ? v_ptrs : kv_row_ptrs(n_block, v_base, 0, params.v_row_stride));
    };
    // Copy 2j + is_v of the ring: K (is_v false) or V of key block n_block_max - 1 - j, into
    // `buffer`. One commit group per copy, empty past the last block, so that waits count copies.
    auto issue_copy = [&](int j, bool is_v, int buffer) {
        int const n_block = n_block_max - 1 - j;
        if (n_block >= n_block_min) {
            if (!is_v) {
                load_k(buffer, n_block);
            } else {
                load_v(buffer, n_block);
                if (n_block > n_block_min) prepare_kv(n_block - 1);
            }
        }
        cp_async_commit();
    };
    if (n_block_max > n_block_min) prepare_kv(n_block_max - 1);
    if constexpr (Tr::kStageRing) {  // stage s holds block n_block_max - 1 - s; one commit group per stage
#pragma unroll
        for (int stage = 0; stage < Tr::kStages; ++stage) {
            int const n_block = n_block_max - 1 - stage;
            if (n_block >= n_block_min) {
                if (stage > 0) prepare_kv(n_block);
                load_k(2 * stage, n_block);
                load_v(2 * stage + 1, n_block);
            }
            cp_async_commit();
        }
    } else {  // the first kKVBuffers - 1 copies
#pragma unroll
        for (int copy = 0; copy < Tr::kKVBuffers - 1; ++copy) issue_copy(copy / 2, copy % 2 == 1, copy);
    }

    // ---- Per-row state. Thread owns rows (warp, mi, half): lane / 4 + 8 * half of each m16 tile.
    int const warp_row0 = warp_m * Tr::kWarpM;
    int row_pos[kMI][2];      // query position of the row (for masks and ALiBi)
    float row_slope[kMI][2];  // ALiBi slope in score units, 0 when off
    uint32_t row_bh[kMI][2];  // batch * nheads + query head of the row (dropout's counter)
    float acc_o[kMI][kDI][4];
    float row_max[kMI][2], row_sum[kMI][2];
    const float* slopes = reinterpret_cast<const float*>(params.alibi_slopes_ptr);
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int const row = row_start + warp_row0 + mi * 16 + lane / 4 + half * 8;
            int head = bidh;
            if constexpr (Tr::kPackGQA) {
                int h_in_group;
                row_pos[mi][half] = qhpk.divmod(h_in_group, row);
                head = bidh * qhpk.divisor + h_in_group;
            } else {
                row_pos[mi][half] = row;
            }
            row_bh[mi][half] = uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(head);
            row_slope[mi][half] =
                slopes != nullptr && row < rows_total
                    ? slopes[bidb * params.alibi_batch_stride + head] * params.alibi_scale
                    : 0.f;
            row_max[mi][half] = -kInfinity;
            row_sum[mi][half] = 0.f;
        }
#pragma unroll
        for (int di = 0; di < kDI; ++di) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mi][di][e] = 0.f;
        }
    }

    uint32_t const sQ_warp = smem_u32(sQ + warp_row0 * kStride);
    uint32_t const kv_warp_offset = warp_n * kWarpN * kStride * 2;  // bytes
    float const scale_log2 = params.scale_log2;
    Dropout const dropout = Dropout::from(params);

    // Scores of key block n_block (in s) -> softcap, ALiBi, masks, online softmax -> P (in p).
    auto softmax_block = [&](int n_block, float (&s)[kMI][kNI][4], uint32_t (&p)[kMI][kWarpN / 16][4]) {
        int const col_block = n_block * kBlockN + warp_n * kWarpN + 2 * (lane % 4);
        if constexpr (Tr::kSoftcap) {
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[mi][ni][e] = softcap_score(s[mi][ni][e], params.softcap, params.softcap_scale);
        }
        if (slopes != nullptr) {
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int const col = col_block + ni * 8 + (e % 2);
                        s[mi][ni][e] = alibi_score(s[mi][ni][e], row_slope[mi][e / 2], row_pos[mi][e / 2] + diag, col);
                    }
        }
        bool const need_mask = (n_block + 1) * kBlockN > seqlen_k ||
                               (kMasked && n_block >= n_block_mask_right) ||
                               (Tr::kMask == Mask::Local && n_block < n_block_mask_left);
        if (need_mask) {
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int const col = col_block + ni * 8 + (e % 2);
                        if (key_hidden<Tr::kMask>(col, row_pos[mi][e / 2] + diag, seqlen_k, params.window_left,
                                                  params.window_right))
                            s[mi][ni][e] = -kInfinity;
                    }
        }

        // Online softmax: rescale what was accumulated when a row's running max grows.
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float block_max = row_max[mi][half];
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni) {
                    block_max = fmaxf(block_max, fmaxf(s[mi][ni][2 * half], s[mi][ni][2 * half + 1]));
                }
                block_max = quad_allreduce_max<4>(block_max);
                // A row with no visible key so far keeps max -inf; subtract 0 so exp2 gives 0.
                float const max_scaled = block_max == -kInfinity ? 0.f : block_max * scale_log2;
                float const correction = exp2_approx(row_max[mi][half] * scale_log2 - max_scaled);
                row_max[mi][half] = block_max;
                row_sum[mi][half] *= correction;
#pragma unroll
                for (int di = 0; di < kDI; ++di) {
                    acc_o[mi][di][2 * half] *= correction;
                    acc_o[mi][di][2 * half + 1] *= correction;
                }
#pragma unroll
                for (int ni = 0; ni < kNI; ++ni) {
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        s[mi][ni][e] = exp2_approx(s[mi][ni][e] * scale_log2 - max_scaled);
                        row_sum[mi][half] += s[mi][ni][e];
                    }
                }
            }
            // Dropout after the row sums (the softmax normalizes over every key): a dropped
            // probability becomes 0; the kept ones are scaled by 1 / (1 - p) in the epilogue.
            if constexpr (Tr::kDropout) {
                int const chunk0 = (n_block * kBlockN + warp_n * kWarpN) / 16;
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    dropout.drop_row<kWarpN / 16, kWarpN % 64 == 0>(
                        row_bh[mi][half], row_pos[mi][half], chunk0, lane % 4,
                        [&](int c, int n, int e) { s[mi][2 * c + n][2 * half + e] = 0.f; });
            }
            // The m16n8 accumulator layout of two adjacent n8 tiles is the m16k16 A layout.
#pragma unroll
            for (int kk = 0; kk < kWarpN / 16; ++kk) {
                p[mi][kk][0] = Element::pack2(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                p[mi][kk][1] = Element::pack2(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                p[mi][kk][2] = Element::pack2(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                p[mi][kk][3] = Element::pack2(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
            }
        }
    };
    auto zero_scores = [&](float (&s)[kMI][kNI][4]) {
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;
    };

    // ---- Main loop over key blocks, last to first (the masked blocks come first).
    // A split-KV combine launched after this kernel may have its CTAs scheduled once every CTA of
    // this grid is on its last key block (or done): they wait for this grid to finish, so its
    // launch overlaps this kernel's tail (allow_dependent_launch). Triggered at the start, the
    // waiting CTAs slowed long splits (b1 32k: 40.0 vs 38.4 us without the early launch).
    if constexpr (!Tr::kStageRing) {
        constexpr int kBuffers = Tr::kKVBuffers;
        int k_buffer = 0;  // where K(n_block) is: copy 2j's buffer, j = n_block_max - 1 - n_block
        for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
            if (n_block == n_block_min) allow_dependent_launch();
            int const j = n_block_max - 1 - n_block;
            // (With two buffers K is always in buffer 0 and V in 1: constants for the compiler.)
            int const v_buffer = k_buffer + 1 == kBuffers ? 0 : k_buffer + 1;
            int const freed_buffer = k_buffer == 0 ? kBuffers - 1 : k_buffer - 1;  // V(n + 1)'s
            cp_async_wait<kBuffers - 2>();
            __syncthreads();  // K(n) landed; every warp finished P·V of block n + 1
            issue_copy(j + (kBuffers - 1) / 2, (kBuffers - 1) % 2 == 1, freed_buffer);
            float s[kMI][kNI][4];
            uint32_t p[kMI][kWarpN / 16][4];
            zero_scores(s);
            gemm_qk<Tr>(s, sQ_warp, smem_u32(kv_buffer(k_buffer)) + kv_warp_offset, lane);
            softmax_block(n_block, s, p);
            cp_async_wait<kBuffers - 2>();
            __syncthreads();  // V(n) landed; every warp finished Q·Kᵀ, so K(n)'s buffer may be refilled
            issue_copy(j + kBuffers / 2, kBuffers % 2 == 1, k_buffer);
            gemm_pv<Tr>(acc_o, p, smem_u32(kv_buffer(v_buffer)) + kv_warp_offset, lane);
            if constexpr (kBuffers > 2) k_buffer = v_buffer + 1 == kBuffers ? 0 : v_buffer + 1;
        }
    } else {
        int stage = 0;
        for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
            if (n_block == n_block_min) allow_dependent_launch();
            cp_async_wait<Tr::kStages - 1>();
            __syncthreads();  // this stage's K and V landed
            float s[kMI][kNI][4];
            uint32_t p[kMI][kWarpN / 16][4];
            zero_scores(s);
            gemm_qk<Tr>(s, sQ_warp, smem_u32(kv_buffer(2 * stage)) + kv_warp_offset, lane);
            softmax_block(n_block, s, p);
            gemm_pv<Tr>(acc_o, p, smem_u32(kv_buffer(2 * stage + 1)) + kv_warp_offset, lane);
            __syncthreads();  // every warp is done with this stage: refill it kStages blocks ahead
            int const refill = n_block - Tr::kStages;
            if (refill >= n_block_min) {
                prepare_kv(refill);
                load_k(2 * stage, refill);
                load_v(2 * stage + 1, refill);
            }
            cp_async_commit();
            stage = stage + 1 == Tr::kStages ? 0 : stage + 1;
        }
    }

    // ---- Epilogue. Rows are normalized; a row that saw no key gets 0 and lse -inf, never NaN.
    // Without split-KV, O is staged through shared memory for 16-byte stores. With it, each split
    // writes fp32 partials and its lse straight from registers, for the combine kernel.
    cp_async_wait<0>();
    __syncthreads();  // no copy in flight, no warp still reading Q or a K/V buffer
    if constexpr (Tr::kWarpsN > 1) {
        // Warps that shared the key blocks merge into warp_n 0, through the K/V buffers: each
        // thread's row max, partial row sum and O fragment, stored lane-minor (conflict-free).
        // Thread (warp_n, lane) holds the same rows and columns for every warp_n.
        constexpr int kFrag = kMI * 4 + kMI * kDI * 4;  // floats per thread
        static_assert((Tr::kNWarps - Tr::kWarpsM) * kFrag * 32 * 4 <=
                          Tr::kKVBuffers * kBlockN * kStride * int(sizeof(T)),
                      "the merge fits in the K/V buffers");
        float* exchange = reinterpret_cast<float*>(kv_buffer(0));
        auto slot = [&](int from_warp_n) {
            return exchange + ((from_warp_n - 1) * Tr::kWarpsM + warp_m) * kFrag * 32 + lane;
        };
        if (warp_n > 0) {
            float* mine = slot(warp_n);
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    mine[((mi * 2 + half) * 2) * 32] = row_max[mi][half];
                    mine[((mi * 2 + half) * 2 + 1) * 32] = row_sum[mi][half];
                }
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int di = 0; di < kDI; ++di)
#pragma unroll
                    for (int e = 0; e < 4; ++e) mine[(kMI * 4 + (mi * kDI + di) * 4 + e) * 32] = acc_o[mi][di][e];
        }
        __syncthreads();
        if (warp_n == 0) {
#pragma unroll 1
            for (int w = 1; w < Tr::kWarpsN; ++w) {
                const float* theirs = slot(w);
#pragma unroll
                for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        float const max_other = theirs[((mi * 2 + half) * 2) * 32];
                        float const sum_other = theirs[((mi * 2 + half) * 2 + 1) * 32];
                        float const max_new = fmaxf(row_max[mi][half], max_other);
                        float const ref = max_new == -kInfinity ? 0.f : max_new * scale_log2;
                        float const c_mine = exp2_approx(row_max[mi][half] * scale_log2 - ref);
                        float const c_other = exp2_approx(max_other * scale_log2 - ref);
                        row_max[mi][half] = max_new;
                        row_sum[mi][half] = row_sum[mi][half] * c_mine + sum_other * c_other;
#pragma unroll
                        for (int di = 0; di < kDI; ++di)
#pragma unroll
                            for (int e = 2 * half; e < 2 * half + 2; ++e)
                                acc_o[mi][di][e] = acc_o[mi][di][e] * c_mine +
                                                   theirs[(kMI * 4 + (mi * kDI + di) * 4 + e) * 32] * c_other;
                    }
            }
        }
    }
    if constexpr (kGroupable && kDI % 2 == 0) {
        if (kv_group == 2) {  // the second head's rows: their O is columns [kHeadDim / 2, kHeadDim)
#pragma unroll
            for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    int h_in_group;
                    qhpk.divmod(h_in_group, row_start + warp_row0 + mi * 16 + lane / 4 + half * 8);
                    if (h_in_group >= qheads_per_kv) {
#pragma unroll
                        for (int di = 0; di < kDI / 2; ++di) {
                            acc_o[mi][di][2 * half] = acc_o[mi][di + kDI / 2][2 * half];
                            acc_o[mi][di][2 * half + 1] = acc_o[mi][di + kDI / 2][2 * half + 1];
                        }
                    }
                }
        }
    }
    bool const write_partial = num_splits > 1;
    float* lse_out = reinterpret_cast<float*>(params.lse_ptr);
    float* oaccum = reinterpret_cast<float*>(params.oaccum_ptr);
    float* lseaccum = reinterpret_cast<float*>(params.lseaccum_ptr);
    // Partials are (split, row, head) with rows numbered across the batch.
    int64_t const partial_row0 =
        split * params.partial_rows + (cu_seqlens_q != nullptr ? q_offset : int64_t(bidb) * params.seqlen_q);
    bool const owns_rows = Tr::kWarpsN == 1 || warp_n == 0;  // holds the merged rows
#pragma unroll
    for (int mi = 0; mi < kMI && owns_rows; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float const sum = quad_allreduce_sum<4>(row_sum[mi][half]);
            float const inv_sum = sum > 0.f ? __frcp_rn(sum) * (Tr::kDropout ? params.rp_dropout : 1.f) : 0.f;
            float const lse = sum > 0.f
                ? (row_max[mi][half] * scale_log2 + __log2f(sum)) * 0.6931471805599453f
                : -kInfinity;
            int const r = warp_row0 + mi * 16 + lane / 4 + half * 8;
            int const row = row_start + r;
            int const m = row_pos[mi][half];
            int const head = Tr::kPackGQA ? bidh * qhpk.divisor + (row - m * qhpk.divisor) : bidh;
            if (write_partial) {
                if (Tr::kDecode && params.merge_in_cluster && row < rows_total) {
                    float* const merge = reinterpret_cast<float*>(smem_raw + ClusterMergeSmem<Tr>::kOffset);
                    float* const o_row = merge + r * Tr::kHeadDim;
#pragma unroll
                    for (int di = 0; di < kDI; ++di) {
                        int const col = di * 8 + 2 * (lane % 4);
                        *reinterpret_cast<float2*>(o_row + col) = make_float2(
                            acc_o[mi][di][2 * half] * inv_sum, acc_o[mi][di][2 * half + 1] * inv_sum);
                    }
                    if (lane % 4 == 0) merge[kBlockM * Tr::kHeadDim + r] = lse;
                } else if (row < rows_total) {
                    float* o_row = oaccum + ((partial_row0 + m) * params.nheads + head) * head_dim;
#pragma unroll
                    for (int di = 0; di < kDI; ++di) {
                        int const col = di * 8 + 2 * (lane % 4);
                        if (col < head_dim) {
                            *reinterpret_cast<float2*>(o_row + col) = make_float2(
                                acc_o[mi][di][2 * half] * inv_sum, acc_o[mi][di][2 * half + 1] * inv_sum);
                        }
                    }
                    if (lane % 4 == 0) {
                        lseaccum[(partial_row0 + m) * params.nheads + head] = lse;
                    }
                }
            } else {
#pragma unroll
                for (int di = 0; di < kDI; ++di) {
                    *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(sQ) +
                                                 Smem::offset(r, di) + 4 * (lane % 4)) =
                        Element::pack2(acc_o[mi][di][2 * half] * inv_sum,
                                       acc_o[mi][di][2 * half + 1] * inv_sum);
                }
                if (lane % 4 == 0 && row < rows_total) {
                    lse_out[bidb * params.lse_batch_stride + head * params.lse_head_stride + q_offset + m] = lse;
                }
            }
        }
    }
    if (write_partial) {
        if constexpr (Tr::kDecode) {
            if (params.merge_in_cluster) {
                merge_splits_in_cluster<Tr>(params, smem_raw, min(kBlockM, rows_total - row_start), row_start, bidb,
                                            bidh, q_offset);
            }
        }
        return;
    }
    __syncthreads();
    T* o_base = reinterpret_cast<T*>(params.o_ptr) + bidb * params.o_batch_stride + q_offset * params.o_row_stride;
    store_rows<QCopy, Smem>(sQ, head_dim, tid, [&](int r) -> T* {
        int const row = row_start + r;
        if (row >= rows_total) return nullptr;
        if constexpr (Tr::kPackGQA) {
            int h_in_group;
            int const m = qhpk.divmod(h_in_group, row);
            return o_base + m * params.o_row_stride +
                   (bidh * qhpk.divisor + h_in_group) * params.o_head_stride;
        } else {
            return o_base + row * params.o_row_stride + bidh * params.o_head_stride;
        }
    });
}

}  // namespace flashgen
