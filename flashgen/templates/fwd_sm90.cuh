// The sm90 forward family (Hopper, compiled for sm_90a): FlashAttention's forward with the tensor
// cores' warpgroup MMA (wgmma) and the TMA copy engine, warp-specialized.
//
// A CTA is persistent (one per SM): it loops over tiles of kBlockM = 64 x kConsumers query rows
// (128, or 192 with three consumers: the tile table's block_m) of one (batch, head), or under
// PackGQA of one (batch, KV head), on a static, cost-balanced schedule (below), and is 1 +
// kConsumers warpgroups:
//   warpgroup 0, the producer: one thread issues TMA loads of each tile's Q and of the K and V
//     blocks into a ring of kStages stages, each completing on its own mbarrier ("full"); it
//     refills a stage once every consumer has released it (the "empty" mbarriers). The ring runs
//     on across tiles: a tile's first K/V block is loaded before its Q, and its Q as soon as the
//     consumers have finished the previous tile's last Q·Kᵀ, so the next tile's loads overlap
//     this tile's last P·V and epilogue. It gives its registers away (setmaxnreg) to
//   warpgroups 1 .. kConsumers, the consumers: each owns 64 query rows and, per key block,
//     S = Q·Kᵀ (wgmma, both operands from shared memory), the online softmax on S in registers,
//     O += P·V (wgmma, P from registers, V from shared memory, MN-major); with kOverlap, block j's
//     P·V is issued with block j + 1's Q·Kᵀ and runs during block j + 1's softmax (the wait for it
//     sits after the loop's back edge, where ptxas cannot hoist it above the exponentials).
// Tiles are 128-byte swizzled panels of 64 head-dim columns (TMA's SWIZZLE_128B; the wgmma
// descriptors' 128-byte swizzle mode): row r of a panel is 128 bytes at r * 128, its 16-byte
// chunks permuted by r % 8, 8-row atoms 1024 bytes apart. No load is predicated: rows past a
// tensor's end are zero-filled by the TMA; rows past a sequence's end inside it (varlen) are the
// next sequence's: its queries are never stored, its keys are masked, and its V rows are zeroed
// in shared memory (clear_v_tail) so that P = 0 times them stays 0.
//
// Masks (causal, local), softcap and ALiBi come from common.cuh and the sequences' rows (varlen,
// seqused) from seq_extent.cuh, as in the sm80 family; PackGQA for groups that divide kBlockM; head dims
// 64/128/192/256, and those between on the next one up (TMA zero fill; run_fwd pads O). Split-KV:
// a work unit is also one of num_splits equal shares of the key blocks, and writes fp32 partial O
// and lse (as the sm80 family's, merged by combine.cuh); a share with no keys writes 0 and -inf.
// Paged K/V (kPaged), any page size: by TMA where pages hold whole key blocks, otherwise gathered
// by the producer warpgroup's cp.async (kGather instances). Dropout (unpacked, unsplit, unpaged
// instances): common.cuh's Philox mask on P after the row sums. O goes out through shared memory
// where the tile table says so (stage_o): the tile's last K and V stage holds it (below). Not
// here: FlashAttention-3's ping-pong scheduling of the two consumers (tried on branch
// sm90-pingpong: 0.95x), and the TMA store of O (varlen's and PackGQA's rows need per-row stores).
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "seq_extent.cuh"
#include "sm90_common.cuh"
#include "wgmma.cuh"  // rendered by flashgen/generator/wgmma.py

#if defined(FLASHGEN_FWD_SM90_MEASURE_TIMELINE) && FLASHGEN_FWD_SM90_MEASURE_TIMELINE
// A measurement variant (benchmarks/fwd_cta_timeline.py reads it back): global-timer stamps of a
// CTA's first FLASHGEN_FWD_TIMELINE_TILES tiles (its start, its last P·V done, O stored), and in
// the last slot the SM and the tiles the CTA ran.
#define FLASHGEN_FWD_TIMELINE_CTAS 65536
#define FLASHGEN_FWD_TIMELINE_TILES 5
extern "C" {
__device__ unsigned long long flashgen_fwd_timeline[FLASHGEN_FWD_TIMELINE_CTAS * 16];
}
#endif

namespace flashgen {

enum FwdTimelineEvent { kTileStart, kTileMmaDone, kTileStored };

__device__ __forceinline__ void fwd_timeline_stamp(int tile, int event) {
#if defined(FLASHGEN_FWD_SM90_MEASURE_TIMELINE) && FLASHGEN_FWD_SM90_MEASURE_TIMELINE
    if (blockIdx.x >= FLASHGEN_FWD_TIMELINE_CTAS) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (tile < FLASHGEN_FWD_TIMELINE_TILES) flashgen_fwd_timeline[blockIdx.x * 16 + tile * 3 + event] = now;
    if (event == kTileStored) {
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        flashgen_fwd_timeline[blockIdx.x * 16 + 15] = (uint64_t(tile + 1) << 32) | sm;
    }
#endif
}

// The sm90 forward's one parameter: three tensor maps (Q, K, V as (d, rows, heads, batch); Q
// packed as (d, heads of a group, rows, KV heads, batch)) and the FwdParams every forward takes.
struct Sm90FwdParams {
    TmaDescriptor tma_q;
    TmaDescriptor tma_k;
    TmaDescriptor tma_v;
    FwdParams p;
};

template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_, bool kOverlap_, bool kStageO_, Mask kMask_, bool kSoftcap_,
          bool kPackGQA_, bool kSplit_, bool kPaged_, bool kGather_, bool kDropout_, int kProducerRegs_,
          int kConsumerRegs_, int kConsumers_>
struct Sm90FwdTraits : Sm90Warpgroups<kProducerRegs_, kConsumerRegs_, kConsumers_> {
    using Element = Element_;
    using T = typename Element::storage;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = 64 * kConsumers_;  // a consumer warpgroup's 64 rows each
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kStages = kStages_;
    static constexpr Mask kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;  // scores through softcap * tanh(s / softcap)
    // A tile's rows are (query, head) pairs of one KV head's G = nheads / nheads_k query heads,
    // head fastest: packed row r is query r / G of head kv_head * G + r % G. Q arrives by one 5-D
    // TMA box (64 columns, G heads, kBlockM / G queries), so G divides kBlockM (dispatch.sm90_covers).
    static constexpr bool kPackGQA = kPackGQA_;
    // Split-KV: a work unit is also one share of the key blocks, and writes fp32 partials. An
    // instance switch rather than a run-time one: each of two run-time forms cost calls without
    // splits on the H200 (a branch per tile: 4-6% under the causal mask; two copies of the body in
    // one kernel: 20-30% on few, long tiles).
    static constexpr bool kSplit = kSplit_;
    // Paged K/V ((pages, page_size, heads, d) caches, a block table per sequence): a block that
    // lies within one page (page sizes that are multiples of kBlockN, no left pad) is one TMA box
    // at (row in page, head, page); otherwise (kGather, the host's choice) the producers gather
    // its rows. Separate instances, so that the TMA-paged consumers carry no proxy fence (behind a
    // run-time branch it cost them 8-10% on the H200).
    static constexpr bool kPaged = kPaged_;
    static constexpr bool kGather = kGather_;
    static_assert(kPaged || !kGather, "gather instances are paged");
    // Dropout: common.cuh's Philox mask, a function of (batch, head, query, key) alone, so either
    // backward family regenerates what this kernel drew.
    static constexpr bool kDropout = kDropout_;
    static_assert(!(kDropout && (kSplit || kPackGQA || kPaged)), "dropout instances are unpacked, unsplit and unpaged");
    // Block j's P·V issued with block j + 1's Q·Kᵀ, so that the softmax overlaps an MMA (below).
    static constexpr bool kOverlap = kOverlap_;
    static constexpr int kPanels = kHeadDim / 64;  // 64-column, 128-byte swizzled panels
    static constexpr int kPanelQBytes = kBlockM * 128;
    static constexpr int kPanelKVBytes = kBlockN * 128;
    static constexpr int kQBytes = kPanels * kPanelQBytes;
    static constexpr int kKVBytes = kPanels * kPanelKVBytes;  // one K or V block
    static constexpr int kBarriers = 2 + 4 * kStages;         // Q full and empty; full and empty, K and V, per stage
    // O (bf16/fp16, kBlockM rows, Q's panel layout) staged in the tile's last K and V stage, which the
    // consumers release only after the epilogue (the tile table's choice, Sm90FwdTile.stage_o);
    // otherwise, and always for split's fp32 partials, stored straight from the accumulators.
    static constexpr bool kStageO = kStageO_ && !kSplit;
    static_assert(!kStageO || kPanels * kPanelQBytes <= 2 * kKVBytes, "O fits one stage's K and V tiles");
    // 1024 bytes of slack to align the swizzle atoms, Q, the K/V ring, the mbarriers. The
    // instance checks it against the host's request (Sm90FwdTile.smem_bytes).
    static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers;
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dims of whole 64-column panels");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256 && kBlockN * 128 % 1024 == 0, "key block");
};

// Paged K/V gathered by the producer warpgroup (kGather instances), a template of its own so
// that only those instances carry its code. Key j is row (leftpad + j) % page_size of page
// pages[(leftpad + j) / page_size] (as in the sm80 family). Thread t copies 16-byte chunk t % 8 of
// rows t / 8 + 16 i of each 64-column panel, to the swizzled place the TMA would have written. A
// block's rows are looked up once, before its copies, one row per lane of each warp (kLookups
// rounds): the K and V element offsets of its page row, -1 for keys past the sequence and pages
// outside the cache; the copying lanes take them by shuffles, so no copy waits on a table load and
// the eight lanes of a row do not each redo its multiplies. Unreadable rows and columns past the
// call's head dim are zero-filled (cp.async's source size 0). (Each lane looking up its own rows,
// one after another, ran 0.61-0.80x the sm80 family's gather on the H200; this, 1.04-1.10x.)
template <typename Tr>
struct Sm90PagedGather {
    using T = typename Tr::T;
    static constexpr int kBlockN = Tr::kBlockN;
    static constexpr int kWarpRows = kBlockN / 4;  // a warp's rows of a block: 4 per 16-row pass
    static constexpr int kLookups = (kWarpRows + 31) / 32;
    static_assert(kBlockN % 16 == 0 && kLookups <= 2, "16-row passes; lookup rounds picked by a select");

    // Lane l of producer warp w, round j: the warp's row index 32 j + l, i.e. row 4 w + its % 4 +
    // 16 (its / 4) of the block.
    __device__ __forceinline__ static void lookup_rows(const FwdParams& params, const int* pages, const SeqExtent& seq,
                                                       int n_block, int tid, int64_t (&k_offset)[kLookups],
                                                       int64_t (&v_offset)[kLookups]) {
        int const warp = tid / 32, lane = tid % 32;
#pragma unroll
        for (int j = 0; j < kLookups; ++j) {
            int const warp_row = 32 * j + lane;
            int const key = n_block * kBlockN + 4 * warp + warp_row % 4 + 16 * (warp_row / 4);
            k_offset[j] = v_offset[j] = -1;
            if (warp_row < kWarpRows && key < seq.seqlen_k) {
                int row_in_page;
                int const page = pages[params.page_size.divmod(row_in_page, seq.k_offset + key)];
                if (page >= 0 && page < params.kv_batch) {
                    k_offset[j] = page * params.k_batch_stride + row_in_page * params.k_row_stride;
                    v_offset[j] = page * params.v_batch_stride + row_in_page * params.v_row_stride;
                }
            }
        }
    }

    // One K or V block into the stage at `dst`; `base`: the head's first element plus this thread's
    // chunk of columns.
    __device__ __forceinline__ static void copy_block(uint32_t dst, const T* base, const int64_t (&row_offset)[kLookups],
                                                      int tid, int head_dim) {
        int const lane = tid % 32, chunk = lane % 8;
        uint32_t const dst_row = dst + (tid / 8) * 128 + ((chunk ^ (tid / 8 % 8)) * 16);  // row t / 8
        // Not unrolled: the producer has 24 registers, and each copy in flight holds an address.
#pragma unroll 1
        for (int i = 0; i < kBlockN / 16; ++i) {
            int const warp_row = lane / 8 + 4 * i;  // this thread's row t / 8 + 16 i
            bool const second = kLookups > 1 && warp_row >= 32;
            int64_t const offset = __shfl_sync(0xffffffffu, second ? row_offset[kLookups - 1] : row_offset[0],
                                               warp_row % 32);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) {
                bool const valid = offset >= 0 && p * 64 + chunk * 8 < head_dim;
                cp_async_16(dst_row + i * 16 * 128 + p * Tr::kPanelKVBytes, base + (valid ? offset + p * 64 : 0), valid);
            }
        }
    }
};

template <typename Tr>
__device__ __forceinline__ void flash_fwd_sm90(const Sm90FwdParams& args) {
    using Element = typename Tr::Element;
    using T = typename Tr::T;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
    constexpr Mask kMask = Tr::kMask;
    constexpr bool kCausal = kMask == Mask::Causal;
    constexpr bool kSplit = Tr::kSplit;
    FwdParams const& params = args.p;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    uint32_t const smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint32_t const sQ = smem;
    auto sK = [&](int stage) { return sQ + Tr::kQBytes + stage * 2 * Tr::kKVBytes; };
    auto sV = [&](int stage) { return sK(stage) + Tr::kKVBytes; };
    uint32_t const bars = sQ + Tr::kQBytes + 2 * kStages * Tr::kKVBytes;
    uint32_t const bar_q = bars, bar_q_empty = bars + 8;
    auto full_k = [&](int stage) { return bars + 8 * (2 + stage); };
    auto full_v = [&](int stage) { return bars + 8 * (2 + kStages + stage); };
    auto empty_k = [&](int stage) { return bars + 8 * (2 + 2 * kStages + stage); };
    auto empty_v = [&](int stage) { return bars + 8 * (2 + 3 * kStages + stage); };

    int const tid = threadIdx.x;
    int const warp = tid / 32, lane = tid % 32;
    int const warpgroup = warp / 4;
    // Query i of a sequence sees keys i + diag - window_left .. i + diag + window_right, diag =
    // seqlen_k - seqlen_q of that sequence (common.cuh: key_blocks).
    int const window_left = params.window_left, window_right = params.window_right;
    // Varlen: sequences are rows of one (total, heads, d) tensor, mapped as a batch of one.
    bool const varlen_q = params.cu_seqlens_q_ptr != nullptr, varlen_k = params.cu_seqlens_k_ptr != nullptr;
    // Persistent CTAs on a static schedule: CTA b takes work units b, b + gridDim.x, ... Without
    // a mask or under a local one a unit is one tile (batch, head, row block), row blocks fastest,
    // so that the CTAs working at once share a head's K/V in L2. Under the causal mask the row blocks' costs grow
    // linearly, so a unit is a pair of row blocks m and m_blocks - 1 - m of one head, the costlier
    // first: every unit sees about the same number of key blocks, and the CTAs end together
    // without an atomic tile counter (the middle row block of an odd count is a unit alone).
    FastDivmod const qhpk = params.qhead_per_khead;  // G, query heads per KV head
    int const group = Tr::kPackGQA ? qhpk.divisor : 1;     // query heads in a tile's rows
    int const tile_heads = Tr::kPackGQA ? params.nheads_k : params.nheads;
    int const m_blocks = (params.max_seqlen_q * group + kBlockM - 1) / kBlockM;
    int const pairs = kCausal ? (m_blocks + 1) / 2 : m_blocks;  // units per (batch, head, split)
    int const num_splits = kSplit ? params.num_splits : 1;
    int const units = pairs * num_splits * tile_heads * params.batch;
    // Packed row -> query position (its head is the rest); the identity without PackGQA.
    auto query_pos = [&](int row) { return Tr::kPackGQA ? qhpk.div(row) : row; };
    struct Tile {
        int m0, bidh, bidb, split, n_block_min, n_block_max;  // bidh: the KV head under PackGQA
        SeqExtent seq;  // the sequence's rows (seq_extent.cuh)
    };
    // Slot i of this CTA: 1 and its tile, 0 for the missing second half of a lone middle row
    // block or a row block past a shorter sequence's end (varlen), -1 once the units have run out.
    auto tile_of_slot = [&](int slot, Tile& tile) {
        int const half = kCausal ? slot & 1 : 0;
        int const unit = (kCausal ? slot >> 1 : slot) * int(gridDim.x) + int(blockIdx.x);
        if (unit >= units) return -1;
        // Row blocks fastest, then splits: the CTAs at work together share a split's K/V in L2.
        int const bhs = unit / pairs;
        int const p = unit - bhs * pairs;
        int const bh = kSplit ? bhs / num_splits : bhs;
        tile.split = bhs - bh * num_splits;
        int const m_block = kCausal ? (half ? p : m_blocks - 1 - p) : p;
        if (kCausal && half && m_block == m_blocks - 1 - p) return 0;
        tile.bidb = bh / tile_heads;
        tile.bidh = bh - tile.bidb * tile_heads;
        tile.m0 = m_block * kBlockM;
        tile.seq = seq_extent<Tr::kPaged>(params, tile.bidb);
        int const rows = tile.seq.seqlen_q * group;
        if (tile.m0 >= rows) return 0;
        KeyBlocks const blocks =
            key_blocks<kMask>(query_pos(tile.m0), query_pos(min(tile.m0 + kBlockM, rows) - 1),
                              tile.seq.seqlen_k - tile.seq.seqlen_q, tile.seq.seqlen_k, kBlockN, window_left, window_right);
        tile.n_block_min = blocks.begin;
        tile.n_block_max = blocks.end;
        if constexpr (kSplit) {  // this split's share of the sequence's key blocks
            int const per_split = ((tile.seq.seqlen_k + kBlockN - 1) / kBlockN + num_splits - 1) / num_splits;
            tile.n_block_min = max(tile.n_block_min, tile.split * per_split);
            tile.n_block_max = min(tile.n_block_max, (tile.split + 1) * per_split);
        }
        tile.n_block_max = max(tile.n_block_max, tile.n_block_min);  // no blocks: rows that see no key
        return 1;
    };

    // Paged K/V whose key blocks straddle pages (kGather: a page size that is not a multiple of
    // kBlockN, or a left pad shifting the keys): the producer warpgroup gathers each block's rows
    // with cp.async, and every one of its threads arrives on the block's full barriers once its
    // copies have landed. Otherwise one thread's TMA loads (one arrival, the bytes as the
    // transaction count).
    constexpr bool kv_gather = Tr::kGather;
    int const kv_arrivals = kv_gather ? Tr::kNThreads - Tr::kConsumerThreads : 1;
    if (tid == 0) {
        mbar_init(bar_q, 1);
        mbar_init(bar_q_empty, Tr::kConsumerThreads);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), kv_arrivals);
            mbar_init(full_v(s), kv_arrivals);
            mbar_init(empty_k(s), Tr::kConsumerThreads);
            mbar_init(empty_v(s), Tr::kConsumerThreads);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---- Producer. Key blocks go from the last to the first (the causal diagonal first). The
        // K/V ring runs on across tiles (block `used` counts every block this CTA loaded).
        setmaxnreg_dec<Tr::kProducerRegs>();
        if ((warp == 0 && lane == 0) || kv_gather) {
            int used = 0, tile_count = 0;
            for (int slot = 0;; ++slot) {
                Tile tile;
                int const found = tile_of_slot(slot, tile);
                if (found < 0) break;
                if (found == 0) continue;
                int const bidh_kv = Tr::kPackGQA ? tile.bidh : qhpk.div(tile.bidh);
                // Map coordinates: rows from the sequence's first, batch 0 for a varlen tensor. Rows
                // past a sequence's end are the next one's (or the TMA's zero fill past the
                // tensor): its queries are not stored, its keys masked (softmax), their V rows
                // zeroed (clear_v_tail).
                int const q_row0 = tile.seq.q_offset + tile.m0, q_batch = varlen_q ? 0 : tile.bidb;
                int const k_row0 = tile.seq.k_offset, k_batch = varlen_k ? 0 : tile.seq.kv_b;
                // Paged by TMA (no left pad, pages of whole blocks): block n is row n * kBlockN %
                // page_size of page pages[n * kBlockN / page_size]; an entry past the cache's pages
                // gets the TMA's zero fill, not another tensor's rows.
                const int* pages = reinterpret_cast<const int*>(params.block_table_ptr) +
                                   int64_t(tile.bidb) * params.block_table_batch_stride;
                int const n_blocks = tile.n_block_max - tile.n_block_min;
                // Block `it` of the tile into the ring's next stage, once both consumers have
                // released that stage's previous block.
                auto load_kv = [&](int it) {
                    int const n_block = tile.n_block_max - 1 - it;
                    int const stage = used % kStages;
                    uint32_t const parity = ((used / kStages) & 1) ^ 1;  // the previous use's phase
                    if constexpr (Tr::kGather) {
                        using Gather = Sm90PagedGather<Tr>;
                        int64_t k_offset[Gather::kLookups], v_offset[Gather::kLookups];
                        Gather::lookup_rows(params, pages, tile.seq, n_block, tid, k_offset, v_offset);
                        int const column = lane % 8 * 8;
                        if (used >= kStages) mbar_wait(empty_k(stage), parity);
                        Gather::copy_block(sK(stage), reinterpret_cast<const T*>(params.k_ptr) +
                                                          bidh_kv * params.k_head_stride + column,
                                           k_offset, tid, params.head_dim);
                        cp_async_mbar_arrive(full_k(stage));  // once this thread's copies have landed
                        if (used >= kStages) mbar_wait(empty_v(stage), parity);
                        Gather::copy_block(sV(stage), reinterpret_cast<const T*>(params.v_ptr) +
                                                          bidh_kv * params.v_head_stride + column,
                                           v_offset, tid, params.head_dim);
                        cp_async_mbar_arrive(full_v(stage));
                        ++used;
                        return;
                    }
                    int kv_row = k_row0 + n_block * kBlockN, kv_batch = k_batch;
                    if constexpr (Tr::kPaged) {
                        int row_in_page;
                        int const page_index = params.page_size.divmod(row_in_page, n_block * kBlockN);
                        kv_batch = pages[page_index];
                        kv_row = row_in_page;
                    }
                    if (used >= kStages) mbar_wait(empty_k(stage), parity);
                    mbar_arrive_expect_tx(full_k(stage), Tr::kKVBytes);
#pragma unroll
                    for (int p = 0; p < Tr::kPanels; ++p) {
                        tma_load_4d(sK(stage) + p * Tr::kPanelKVBytes, &args.tma_k, full_k(stage), p * 64,
                                    kv_row, bidh_kv, kv_batch);
                    }
                    if (used >= kStages) mbar_wait(empty_v(stage), parity);
                    mbar_arrive_expect_tx(full_v(stage), Tr::kKVBytes);
#pragma unroll
                    for (int p = 0; p < Tr::kPanels; ++p) {
                        tma_load_4d(sV(stage) + p * Tr::kPanelKVBytes, &args.tma_v, full_v(stage), p * 64,
                                    kv_row, bidh_kv, kv_batch);
                    }
                    ++used;
                };
                // The tile's first K/V block goes out before its Q, which waits until the consumers
                // have finished the previous tile's last Q·Kᵀ: the ring runs ahead across tiles.
                if (n_blocks > 0) load_kv(0);
                if (!kv_gather || tid == 0) {  // (gathering, the whole warpgroup runs this loop; Q is thread 0's)
                    if (tile_count > 0) mbar_wait(bar_q_empty, (tile_count - 1) & 1);  // the last tile's Q is free
                    mbar_arrive_expect_tx(bar_q, Tr::kQBytes);
#pragma unroll
                    for (int p = 0; p < Tr::kPanels; ++p) {
                        if constexpr (Tr::kPackGQA) {  // queries m0 / G .. of all G heads of KV head bidh
                            tma_load_5d(sQ + p * Tr::kPanelQBytes, &args.tma_q, bar_q, p * 64, 0,
                                        tile.seq.q_offset + tile.m0 / group, tile.bidh, q_batch);
                        } else {
                            tma_load_4d(sQ + p * Tr::kPanelQBytes, &args.tma_q, bar_q, p * 64, q_row0, tile.bidh,
                                        q_batch);
                        }
                    }
                }
                for (int it = 1; it < n_blocks; ++it) load_kv(it);
                ++tile_count;
            }
            if constexpr (kv_gather) cp_async_wait<0>();  // no thread exits with copies in flight
        }
        return;
    }

    // ---- Consumers: warpgroup c (0 or 1) owns rows 64 c .. 64 c + 63 of the block; thread (warp w
    // of the warpgroup, lane) holds rows 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4), + 1
    // of each n8 slab of S and O (the wgmma accumulator layout).
    setmaxnreg_inc<Tr::kConsumerRegs>();
    // Warp-uniform for the compiler (a shuffle from lane 0), so that the descriptors derived from it
    // live in uniform registers.
    int const consumer = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    int const row_in_block = consumer * 64 + (warp % 4) * 16 + lane / 4;
    float const scale_log2 = params.scale_log2;
    constexpr int kSRegs = kBlockN / 2, kORegs = kHeadDim / 2;
    // Descriptors of this consumer's Q rows and of stage 0's K (K-major) and V (MN-major, 64-column
    // panels kPanelKVBytes apart), moved per stage and per MMA by offsets.
    uint64_t const desc_q = smem_desc_sw128(sQ + consumer * 64 * 128, 16, 1024);
    uint64_t const desc_k0 = smem_desc_sw128(sK(0), 16, 1024);
    uint64_t const desc_v0 = smem_desc_sw128(sV(0), Tr::kPanelKVBytes, 1024);
    // The current tile (the lambdas below read these) and its running state.
    int m0 = 0, row0 = 0, n_block_max = 0;
    int seqlen_q = 0, seqlen_k = 0, diag = 0;  // the tile's sequence
    int row_pos[2], row_head[2];  // the thread's two rows (row0, row0 + 8): query position, query head
    uint32_t row_bh[2];           // and batch * nheads + head: dropout's counter
    Dropout const dropout = Dropout::from(params);
    float alibi_slope[2];         // their ALiBi slopes in score units; 0 without ALiBi
    const float* alibi_slopes = reinterpret_cast<const float*>(params.alibi_slopes_ptr);
    float acc_o[kORegs];
    float row_max[2], row_sum[2];

    // S = Q·Kᵀ of a stage into s, issued (the caller commits and waits).
    auto issue_qk = [&](int stage, float (&s)[kSRegs]) {
        uint64_t const desc_k = smem_desc_moved(desc_k0, stage * 2 * Tr::kKVBytes);
#pragma unroll
        for (int k = 0; k < kHeadDim / 16; ++k) {
            uint32_t const col = (k % 4) * 32;  // 16 columns = 32 bytes within the 128-byte panel rows
            wgmma_ss<Element, kBlockN, 0>(s, smem_desc_moved(desc_q, (k / 4) * Tr::kPanelQBytes + col),
                                          smem_desc_moved(desc_k, (k / 4) * Tr::kPanelKVBytes + col), k > 0);
        }
    };
    // O += P·V of a stage, issued: V rows kk * 16.. are the K of MMA kk, all head-dim columns its N
    // (MN-major, 64-column panels kPanelKVBytes apart).
    auto issue_pv = [&](int stage, const uint32_t (&p)[kBlockN / 16][4]) {
        uint64_t const desc_v = smem_desc_moved(desc_v0, stage * 2 * Tr::kKVBytes);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
            wgmma_rs<Element, kHeadDim, 1>(acc_o, p[kk], smem_desc_moved(desc_v, kk * 16 * 128), 1);
    };
    // The online softmax of block n_block: softcap and ALiBi (common.cuh), masks (keys past
    // seqlen_k, whatever the TMA read there, and those outside the causal or local window; only on the
    // blocks that cross an edge for this warpgroup's 64 rows), the new row maxima, s -> P in place,
    // row sums; returns in `correction` the factor for O, which the caller applies once no MMA
    // still adds to O.
    auto softmax = [&](int n_block, float (&s)[kSRegs], float (&correction)[2]) {
        int const key0 = n_block * kBlockN;
        auto key_of = [&](int i, int e) { return key0 + i * 8 + 2 * (lane % 4) + (e & 1); };
        auto shifted_row_of = [&](int e) { return row_pos[e >> 1] + diag; };
        if constexpr (Tr::kSoftcap) {
#pragma unroll
            for (int i = 0; i < kSRegs; ++i) s[i] = softcap_score(s[i], params.softcap, params.softcap_scale);
        }
        if (alibi_slopes != nullptr) {
            // i + diag - j at the thread's first key; the others are constants away. (Half the
            // instructions of integer distances: with them this never-taken branch made the block
            // loop about 100 instructions longer than without PackGQA's per-row positions.)
            float const distance0[2] = {float(shifted_row_of(0) - key_of(0, 0)), float(shifted_row_of(2) - key_of(0, 0))};
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[i * 4 + e] = alibi_score(s[i * 4 + e], alibi_slope[e >> 1], distance0[e >> 1] - float(i * 8 + (e & 1)));
        }
        // This warpgroup's first and last query positions (rows past the sequence only widen them).
        int const first_row = query_pos(m0 + consumer * 64), last_row = query_pos(m0 + consumer * 64 + 63);
        bool const need_mask = key0 + kBlockN > seqlen_k ||
                               (kMask != Mask::None && key0 + kBlockN - 1 > first_row + diag + window_right) ||
                               (kMask == Mask::Local && key0 < last_row + diag - window_left);
        if (need_mask) {
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (key_hidden<kMask>(key_of(i, e), shifted_row_of(e), seqlen_k, window_left, window_right))
                        s[i * 4 + e] = -kInfinity;
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float block_max = -kInfinity;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i)
                block_max = fmaxf(block_max, fmaxf(s[i * 4 + 2 * half], s[i * 4 + 2 * half + 1]));
            block_max = quad_allreduce_max<4>(block_max);
            float const new_max = fmaxf(row_max[half], block_max);
            float const ref = new_max == -kInfinity ? 0.f : new_max * scale_log2;
            correction[half] = exp2_approx(row_max[half] * scale_log2 - ref);  // 0 while row_max is -inf
            row_max[half] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    float const p = exp2_approx(s[i * 4 + e] * scale_log2 - ref);
                    s[i * 4 + e] = p;
                    sum += p;
                }
            row_sum[half] = row_sum[half] * correction[half] + sum;
        }
        // Dropout after the row sums (the softmax normalizes over every key): a dropped
        // probability becomes 0, the kept ones are scaled by 1 / (1 - p) in the epilogue. Slabs
        // 2c and 2c + 1 are the thread's keys of 16-key chunk c.
        if constexpr (Tr::kDropout) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                dropout.drop_row<kBlockN / 16, kBlockN % 64 == 0>(
                    row_bh[half], row_pos[half], key0 / 16, lane % 4,
                    [&](int c, int n, int e) { s[(2 * c + n) * 4 + 2 * half + e] = 0.f; });
        }
    };
    // The consumers wait on a K or V block's full barrier with mbar_wait_fenced: gathered blocks
    // (kGather) were written by the producers' cp.async, in the generic proxy, which the wgmma
    // reads (async proxy) only after a proxy fence. (Announcing them from the producers instead,
    // each thread fencing once its copies had landed, kept the fence out of these loops but ran
    // the gather 0.87-0.92x the sm80 family's where this runs 1.04-1.07x.)
    // The rows of a tile's first key block (the last in key order) past the sequence's keys: the
    // next sequence's under varlen, or rows a shorter seqused_k leaves unused (the TMA stops only
    // at the tensor's end). P is 0 there, but 0 times an inf or NaN value is NaN, so those V rows
    // are zeroed in shared memory before any P·V reads them: both consumers at once, once per tile
    // before its block loop (so that the loops carry no barrier), after the block's V has landed;
    // the fence orders the stores before the wgmma's reads. Dense rows past the tensor are zero
    // already: clearing them again costs one pass over a block.
    auto clear_v_tail = [&](int stage, uint32_t parity) {
        int const valid = seqlen_k - (n_block_max - 1) * kBlockN;  // keys of the block, 1 .. kBlockN - 1
        constexpr int kChunks = Tr::kPanels * kBlockN * 8;           // 16-byte chunks of one V block
        int const consumer_tid = tid - (Tr::kNThreads - Tr::kConsumerThreads);  // after the producer warpgroup
        mbar_wait(full_v(stage), parity);
        for (int c = consumer_tid; c < kChunks; c += Tr::kConsumerThreads) {
            int const row = c / 8 % kBlockN;
            if (row >= valid) {
                uint32_t const addr = sV(stage) + (c / (8 * kBlockN)) * Tr::kPanelKVBytes + row * 128 + (c % 8) * 16;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
            }
        }
        fence_proxy_async();
        named_barrier_sync(1, Tr::kConsumerThreads);
    };
    auto rescale_o = [&](const float (&correction)[2]) {
#pragma unroll
        for (int i = 0; i < kHeadDim / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i * 4 + e] *= correction[e >> 1];
    };
    // P as the A operand of P·V: the k16 slice kk is S's n8 slabs 2 kk and 2 kk + 1.
    auto pack_p = [&](const float (&s)[kSRegs], uint32_t (&p)[kBlockN / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            p[kk][0] = Element::pack2(s[8 * kk + 0], s[8 * kk + 1]);
            p[kk][1] = Element::pack2(s[8 * kk + 2], s[8 * kk + 3]);
            p[kk][2] = Element::pack2(s[8 * kk + 4], s[8 * kk + 5]);
            p[kk][3] = Element::pack2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    int used = 0, tile_count = 0;  // K/V blocks consumed by this CTA so far (the ring's position); tiles done
    for (int slot = 0;; ++slot) {
        Tile tile;
        int const found = tile_of_slot(slot, tile);
        if (found < 0) break;
        if (found == 0) continue;
        m0 = tile.m0;
        row0 = m0 + row_in_block;  // rows row0 and row0 + 8
        seqlen_q = tile.seq.seqlen_q;
        seqlen_k = tile.seq.seqlen_k;
        diag = seqlen_k - seqlen_q;
        n_block_max = tile.n_block_max;
        int const n_blocks = n_block_max - tile.n_block_min;
        int const bidh = tile.bidh, bidb = tile.bidb, split = tile.split;
        int const rows = seqlen_q * group;  // the tile's rows past this are not stored
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int const row = row0 + 8 * half;
            if constexpr (Tr::kPackGQA) {
                int in_group;
                row_pos[half] = qhpk.divmod(in_group, row);
                row_head[half] = bidh * group + in_group;
            } else {
                row_pos[half] = row;
                row_head[half] = bidh;
            }
            row_bh[half] = uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(row_head[half]);
            alibi_slope[half] = alibi_slopes != nullptr && row < rows
                                    ? alibi_slopes[bidb * params.alibi_batch_stride + row_head[half]] * params.alibi_scale
                                    : 0.f;
        }
#pragma unroll
        for (int i = 0; i < kORegs; ++i) acc_o[i] = 0.f;
        row_max[0] = row_max[1] = -kInfinity;
        row_sum[0] = row_sum[1] = 0.f;
        // Ring position of the tile's block it.
        auto stage_of = [&](int it) { return (used + it) % kStages; };
        auto parity_of = [&](int it) { return uint32_t(((used + it) / kStages) & 1); };

        // Key blocks go from the last to the first. kOverlap: block it's P·V is issued with block
        // it + 1's Q·Kᵀ, so that the softmax of block it + 1 runs while the tensor cores add block it
        // to O (FlashAttention-3's intra-warpgroup overlap); O is rescaled once that MMA has finished.
        // Otherwise each block's two MMAs and its softmax follow one another.
        bool const stamps = tid == Tr::kNThreads - Tr::kConsumerThreads;  // the first consumer thread
        if (stamps) fwd_timeline_stamp(tile_count, kTileStart);
        mbar_wait(bar_q, tile_count & 1);
        if (n_blocks == 0) mbar_arrive(bar_q_empty);  // rows that see no key: Q is not read
        if (n_blocks > 0 && n_block_max * kBlockN > seqlen_k) clear_v_tail(stage_of(0), parity_of(0));
        uint32_t p[kBlockN / 16][4];
        if constexpr (!Tr::kOverlap) {
            for (int it = 0; it < n_blocks; ++it) {
                int const stage = stage_of(it);
                uint32_t const parity = parity_of(it);
                float s[kSRegs];
                float correction[2];
                mbar_wait_fenced<Tr::kGather>(full_k(stage), parity);
                wgmma_fence();
                issue_qk(stage, s);
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers(s);
                if (!Tr::kStageO || it < n_blocks - 1) mbar_arrive(empty_k(stage));
                if (it == n_blocks - 1) mbar_arrive(bar_q_empty);  // the tile's last Q·Kᵀ is done
                softmax(n_block_max - 1 - it, s, correction);
                rescale_o(correction);
                pack_p(s, p);
                mbar_wait_fenced<Tr::kGather>(full_v(stage), parity);
                fence_registers(acc_o);
                wgmma_fence();
                issue_pv(stage, p);
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers(acc_o);
                if (!Tr::kStageO || it < n_blocks - 1) mbar_arrive(empty_v(stage));
            }
        }
        if (Tr::kOverlap && n_blocks > 0) {
            float s[kSRegs];
            float correction[2];
            mbar_wait_fenced<Tr::kGather>(full_k(stage_of(0)), parity_of(0));
            wgmma_fence();
            issue_qk(stage_of(0), s);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(s);
            if (!Tr::kStageO || n_blocks > 1) mbar_arrive(empty_k(stage_of(0)));
            if (n_blocks == 1) mbar_arrive(bar_q_empty);  // the tile's last Q·Kᵀ is done
            softmax(n_block_max - 1, s, correction);  // O is still 0: nothing to rescale
            pack_p(s, p);
            // Block it's Q·Kᵀ and block it - 1's P·V go out together, and block it's softmax runs
            // while that P·V does; the wait for it comes after the loop's back edge (finish), since
            // ptxas schedules within a basic block and, in the same one, issues the wait (and
            // stalls) ahead of the softmax. Then O is rescaled and block it's P packed.
            auto start_block = [&](int it) {
                int const stage = stage_of(it), prev = stage_of(it - 1);
                mbar_wait_fenced<Tr::kGather>(full_k(stage), parity_of(it));
                mbar_wait_fenced<Tr::kGather>(full_v(prev), parity_of(it - 1));
                fence_registers(acc_o);
                wgmma_fence();
                issue_qk(stage, s);
                wgmma_commit();
                issue_pv(prev, p);
                wgmma_commit();
                wgmma_wait<1>();  // Q·Kᵀ done; P·V may still run
                fence_registers(s);
                if (!Tr::kStageO || it < n_blocks - 1) mbar_arrive(empty_k(stage));
                if (it == n_blocks - 1) mbar_arrive(bar_q_empty);  // the tile's last Q·Kᵀ is done
                softmax(n_block_max - 1 - it, s, correction);
            };
            auto finish_block = [&](int it) {
                wgmma_wait<0>();
                fence_registers(acc_o);
                mbar_arrive(empty_v(stage_of(it - 1)));
                rescale_o(correction);
                pack_p(s, p);
            };
            if (n_blocks > 1) start_block(1);
            for (int it = 2; it < n_blocks; ++it) {
                finish_block(it - 1);
                start_block(it);
            }
            if (n_blocks > 1) finish_block(n_blocks - 1);
            int const last = stage_of(n_blocks - 1);
            mbar_wait_fenced<Tr::kGather>(full_v(last), parity_of(n_blocks - 1));
            fence_registers(acc_o);
            wgmma_fence();
            issue_pv(last, p);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers(acc_o);
            if (!Tr::kStageO) mbar_arrive(empty_v(last));
        }

        used += n_blocks;
        if (stamps) fwd_timeline_stamp(tile_count, kTileMmaDone);

        // ---- Epilogue: O normalized (a row that saw no key gets 0 and lse -inf); the sequence's
        // rows start at q_offset (varlen); a packed row is (query, head).
        int const q_offset = tile.seq.q_offset;
        if constexpr (kSplit) {
            // fp32 partials (split, row, head, d) with rows numbered across the batch, the call's
            // head_dim columns: the layout the combine reads (run_fwd), shared with the sm80 family.
            int64_t const partial_row0 =
                split * params.partial_rows + (varlen_q ? q_offset : int64_t(bidb) * params.seqlen_q);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float const sum = quad_allreduce_sum<4>(row_sum[half]);
                float const inv_sum = sum > 0.f ? __frcp_rn(sum) : 0.f;
                if (row0 + 8 * half < rows) {
                    int64_t const index = (partial_row0 + row_pos[half]) * params.nheads + row_head[half];
                    float* o_row = reinterpret_cast<float*>(params.oaccum_ptr) + index * params.head_dim;
#pragma unroll
                    for (int i = 0; i < kHeadDim / 8; ++i) {
                        int const col = i * 8 + 2 * (lane % 4);
                        if (col < params.head_dim) {
                            *reinterpret_cast<float2*>(o_row + col) =
                                make_float2(acc_o[i * 4 + 2 * half] * inv_sum, acc_o[i * 4 + 2 * half + 1] * inv_sum);
                        }
                    }
                    if (lane % 4 == 0) {
                        reinterpret_cast<float*>(params.lseaccum_ptr)[index] = row_lse(row_max[half], sum, scale_log2);
                    }
                }
            }
            if (stamps) fwd_timeline_stamp(tile_count, kTileStored);
            ++tile_count;
            continue;
        }
        if constexpr (!Tr::kStageO) {  // straight from the accumulators: 8 rows of 16 bytes a warp store
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float const sum = quad_allreduce_sum<4>(row_sum[half]);
                float const inv_sum = sum > 0.f ? __frcp_rn(sum) * (Tr::kDropout ? params.rp_dropout : 1.f) : 0.f;
                if (row0 + 8 * half < rows) {
                    int const pos = q_offset + row_pos[half], head = row_head[half];
                    T* o_row = reinterpret_cast<T*>(params.o_ptr) + bidb * params.o_batch_stride +
                               head * params.o_head_stride + pos * params.o_row_stride;
                    float* lse_out = reinterpret_cast<float*>(params.lse_ptr) + bidb * params.lse_batch_stride +
                                     head * params.lse_head_stride + pos;
#pragma unroll
                    for (int i = 0; i < kHeadDim / 8; ++i) {
                        *reinterpret_cast<uint32_t*>(o_row + i * 8 + 2 * (lane % 4)) =
                            Element::pack2(acc_o[i * 4 + 2 * half] * inv_sum, acc_o[i * 4 + 2 * half + 1] * inv_sum);
                    }
                    if (lane % 4 == 0) {
                        *lse_out = row_lse(row_max[half], sum, scale_log2);
                    }
                }
            }
            if (stamps) fwd_timeline_stamp(tile_count, kTileStored);
            ++tile_count;
            continue;
        }
        // O (bf16/fp16) through shared memory in whole rows: the accumulators by stmatrix into the
        // tile's last K and V stage (once both consumers' last MMAs have read it), then each warp's
        // 16 rows out in 16-byte chunks, and the stage back to the producer. (The direct stores took
        // 2.6 µs a tile at d128 and 5.6 at d256: benchmarks/results/20261202-nvidia-h200-sm90-fwd-epilogue.)
        // A tile with no key block holds no stage and stores zeros.
        float inv_sum[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float const sum = quad_allreduce_sum<4>(row_sum[half]);
            inv_sum[half] = sum > 0.f ? __frcp_rn(sum) * (Tr::kDropout ? params.rp_dropout : 1.f) : 0.f;
            if (lane % 4 == 0 && row0 + 8 * half < rows) {
                reinterpret_cast<float*>(params.lse_ptr)[bidb * params.lse_batch_stride +
                                                         row_head[half] * params.lse_head_stride + q_offset + row_pos[half]] =
                    row_lse(row_max[half], sum, scale_log2);
            }
        }
        int const warp_row0 = consumer * 64 + (warp % 4) * 16;  // this warp's 16 rows of the tile
        int const last_stage = (used + kStages - 1) % kStages;  // the tile's last block (used counts it already)
        uint32_t const sO = sK(last_stage);
        if (n_blocks > 0) {
            named_barrier_sync(1, Tr::kConsumerThreads);
            // stmatrix: lane l gives row stage_row of matrix l / 8 (n8 slabs 2 j + l / 16, rows + 8 at
            // (l / 8) % 2). Every term but the swizzled chunk is a multiple of 128, so slab pair j's
            // chunk, 2 j XOR the lane's, is one base XOR 32 (j % 4): one address register.
            int const stage_row = warp_row0 + ((lane / 8) % 2) * 8 + lane % 8;
            uint32_t const stage_lane = sO + stage_row * 128 + (((lane / 16) ^ (stage_row % 8)) * 16);
#pragma unroll
            for (int j = 0; j < kHeadDim / 16; ++j)
                stmatrix_x4((stage_lane ^ ((j % 4) * 32)) + (j / 4) * Tr::kPanelQBytes,
                            Element::pack2(acc_o[8 * j] * inv_sum[0], acc_o[8 * j + 1] * inv_sum[0]),
                            Element::pack2(acc_o[8 * j + 2] * inv_sum[1], acc_o[8 * j + 3] * inv_sum[1]),
                            Element::pack2(acc_o[8 * j + 4] * inv_sum[0], acc_o[8 * j + 5] * inv_sum[0]),
                            Element::pack2(acc_o[8 * j + 6] * inv_sum[1], acc_o[8 * j + 7] * inv_sum[1]));
            __syncwarp();  // a warp reads back only its own rows
        }
        // All kHeadDim columns: a call with fewer gets an O padded to kHeadDim (run_fwd); the
        // TMA's zero fill of Q, K, V past its columns makes the extra ones zero. O is dense with
        // 16-byte aligned rows (run_fwd allocates it). Lane l takes chunk l % 8 of each panel of
        // the warp's rows l / 8 + 4 i: a warp store is four whole 128-byte row segments, and the
        // swizzle is the lane's base XOR 16 ((4 i) % 8), as above.
        T* const o_batch = reinterpret_cast<T*>(params.o_ptr) + bidb * params.o_batch_stride;
        int const lane_row = lane / 8, lane_chunk = lane % 8;
        uint32_t const read_lane = sO + (warp_row0 + lane_row) * 128 + ((lane_chunk ^ lane_row) * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int const row = m0 + warp_row0 + lane_row + 4 * i;
            if (row < rows) {
                int pos = row, head = bidh;
                if constexpr (Tr::kPackGQA) {
                    int in_group;
                    pos = qhpk.divmod(in_group, row);
                    head = bidh * group + in_group;
                }
                T* const o_row = o_batch + head * params.o_head_stride + (q_offset + pos) * params.o_row_stride + lane_chunk * 8;
#pragma unroll
                for (int p = 0; p < Tr::kPanels; ++p) {
                    uint4 value = make_uint4(0u, 0u, 0u, 0u);
                    if (n_blocks > 0) value = ld_shared_v4((read_lane ^ (((4 * i) % 8) * 16)) + 4 * i * 128 + p * Tr::kPanelQBytes);
                    *reinterpret_cast<uint4*>(o_row + p * 64) = value;
                }
            }
        }
        if (n_blocks > 0) {
            fence_proxy_async();  // these reads before the producer's TMA refills the stage
            mbar_arrive(empty_k(last_stage));
            mbar_arrive(empty_v(last_stage));
        }
        if (stamps) fwd_timeline_stamp(tile_count, kTileStored);
        ++tile_count;
    }
}

}  // namespace flashgen
