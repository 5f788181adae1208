// The sm90 backward family (Hopper, compiled for sm_90a): dQ, dK, dV with the tensor cores'
// warpgroup MMA (wgmma) and the TMA, warp-specialized, from the same inputs as the sm80 backward
// (the forward's LSE, D = rowsum(dO ∘ O) from the preprocess kernel, an fp32 dQ buffer that the
// postprocess kernel converts).
//
// A CTA owns kBlockN keys of one (batch, KV head), loops over the query heads of its group
// and the query blocks that see its keys (kBlockM queries a step), and is three warpgroups:
//   warpgroup 0, the producer: one thread loads K and V once and each step's Q and dO by TMA into
//     a ring of kStages stages; warp 1 writes the step's LSE (in log2 units) and D rows next to
//     them. Both arrive on the stage's "full" mbarrier; the stage is refilled once both consumers
//     have released it ("empty"). It gives its registers away (setmaxnreg) to
//   warpgroups 1 and 2, the consumers: each owns 64 of the keys and, per step, in the transposed
//     domain (keys as the MMAs' M, so dK and dV accumulate in registers with no transpose):
//       Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                 (wgmma, both operands from shared memory)
//       Pᵀ = exp(Sᵀ - LSE), dSᵀ = Pᵀ ∘ (dPᵀ - D)  (softcap: times 1 - tanh²; masks, ALiBi)
//       dV += Pᵀ·dO, dK += dSᵀ·Q                (wgmma, Pᵀ and dSᵀ from registers, dO and Q MN-major)
//       dSᵀ -> shared memory (one of two buffers), then with both consumers' halves there
//       dQ = dS·K for its share of the step's dQ (dS MN-major from shared memory, K MN-major),
//       stored to a shared fp32 tile that a thread of the producer warpgroup adds to the fp32 dQ
//       buffer by TMA reductions;
//     at the end, dK (scaled) and dV through K's and V's tiles (stmatrix) to global in whole rows.
// Above d128 a consumer's dK and dV of 64 keys and every column would not fit its registers: there
// the CTA owns 64 keys, which both consumers share (kSplitColumns), each computing Sᵀ and dPᵀ for
// half of the step's queries and dK, dV and dQ for its share of the head-dim columns, with Pᵀ and dSᵀ
// exchanged through shared memory (the A of dV and dK). No fp32 dQ tile fits beside two Q/dO stages
// there: a consumer stores its dQ share into the step's Q and dO panels that only its own dK and dV
// read (free once those MMAs are done), and the dQ thread releases the stage to the producer once
// its TMA reductions have read them (d256).
// d192 leaves the transposed domain instead (kQueryRows): the CTA owns 96 keys, 48 a consumer,
// which computes S = Q·Kᵀ and dP = dO·Vᵀ with the step's 64 queries as M, stores P and dS
// transposed (stmatrix.trans) into the [key][query] tiles, and accumulates dVᵀ = dOᵀ·P and
// dKᵀ = Qᵀ·dS with the head dim as M (dO and Q MN-major, P and dS K-major as the B); dQ = dS·K is
// each consumer's 96 columns (a panel and half of one), stored into the stage once both
// consumers' dKᵀ and dVᵀ have read it; dKᵀ and dVᵀ leave through K's and V's tiles transposed.
// Tiles are 128-byte swizzled panels of 64 head-dim columns (TMA's SWIZZLE_128B, as in the forward);
// the dSᵀ tile is [key][query] in panels of 64 queries with the same swizzle, written by the
// consumers. Rows past a tensor's end are zero-filled by the TMA, rows past a varlen sequence's
// end zeroed in shared memory (clear_rows); their LSE is +inf (P = 0) and D 0, so they contribute
// exactly 0; keys past seqlen_k are masked and their dK, dV rows not stored.
//
// Head dims below an instance's run on it: the TMA zero-fills Q's, K's, V's and dO's columns past the
// call's, which add nothing; dK and dV are stored for the call's columns, and the dQ buffer's
// tensor map, as wide as the call, drops the tile's extra columns. Not here (the sm80 backward
// serves those calls): seqused_q/k.
//
// Deterministic mode (params.semaphore_ptr set, a counter per (batch, query head, query block)):
// the key blocks that see a query block add their dQ to it in a fixed order, each after the
// previous one's reductions have completed; the consumers go on computing meanwhile (only the dQ
// writer waits). A block waits only for blocks launched before it, so the waits end however few
// CTAs are resident. Two orders (the plan picks, params.dq_turns_descending):
//   ascending key blocks, query blocks last first: every key block reaches a query block at the
//     same step, so block n starts about n reductions late and then never waits; longest blocks
//     still run first under a causal mask;
//   descending (causal only), the grid reversed, query blocks first first: a key block reaches a
//     query block no later than the blocks after it in the order, so none waits for long, but the
//     shortest blocks run first.
//
// Dropout (kDropout): the forward's Philox mask (common.cuh's Dropout) regenerated per step. At
// 64 keys a consumer (kKeepBits) producer warps 1 and 3 draw each Philox block of the step once and
// store the consumers' keep decisions as bits into the stage (a block's four words belong to four
// consumer warps, the warps' 16-key chunks). Split columns draw in the consumers: a thread's keys
// key and key + 8 of a query lie in one block, whose word for the thread's chunk it and its partner
// lane ^ 4 (the same queries, the other key parity) both need; each draws the block of one of the
// pair's two query columns and they swap words. Query rows draw a row's blocks as the forward does.
#pragma once
#include "common.cuh"
#include "flash_params.cuh"
#include "seq_extent.cuh"
#include "sm90_common.cuh"
#include "wgmma.cuh"  // rendered by flashgen/generator/wgmma.py

#if defined(FLASHGEN_BWD_SM90_MEASURE_TIMELINE) && FLASHGEN_BWD_SM90_MEASURE_TIMELINE
// A measurement variant (benchmarks/bwd_cta_timeline.py reads it back): global-timer stamps of
// each CTA's phases, 8 slots per CTA (by linear block index).
#define FLASHGEN_BWD_TIMELINE_CTAS 65536
extern "C" {
__device__ unsigned long long flashgen_bwd_timeline[FLASHGEN_BWD_TIMELINE_CTAS * 8];
}
#endif

// Query rows: dVᵀ issued once the consumer's own P is stored (1), or with dKᵀ once both consumers'
// P and dS are (0); a define for the A/B (benchmarks/tune_bwd_sm90.py).
#ifndef FLASHGEN_BWD_SM90_ROWS_EARLY_DV
#define FLASHGEN_BWD_SM90_ROWS_EARLY_DV 0
#endif

namespace flashgen {

// Phases a timeline variant stamps (slot 7 holds the SM and the CTA's steps).
enum BwdTimelineEvent { kCtaStart, kKVLanded, kFirstStageReady, kFirstStepDone, kLoopDone, kStored, kDQDrained };

__device__ __forceinline__ void bwd_timeline_stamp(int event, int steps = 0) {
#if defined(FLASHGEN_BWD_SM90_MEASURE_TIMELINE) && FLASHGEN_BWD_SM90_MEASURE_TIMELINE
    uint32_t const cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta >= FLASHGEN_BWD_TIMELINE_CTAS) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    flashgen_bwd_timeline[cta * 8 + event] = now;
    if (event == kCtaStart) {
        uint32_t sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        flashgen_bwd_timeline[cta * 8 + 7] = (uint64_t(steps) << 32) | sm;
    }
#endif
}

// The sm90 backward's one parameter: five tensor maps (Q, K, V, dO as (d, rows, heads, batch); the
// fp32 dQ buffer the same way, in boxes of 32 columns) and the BwdParams the sm80 backward takes.
struct Sm90BwdParams {
    TmaDescriptor tma_q;
    TmaDescriptor tma_k;
    TmaDescriptor tma_v;
    TmaDescriptor tma_do;
    TmaDescriptor tma_dq;
    BwdParams p;
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, Mask kMask_, bool kSoftcap_,
          bool kDropout_, int kProducerRegs_, int kConsumerRegs_>
struct Sm90BwdTraits : Sm90Warpgroups<kProducerRegs_, kConsumerRegs_> {
    using Element = Element_;
    using T = typename Element::storage;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;  // queries per step
    static constexpr int kBlockN = kBlockN_;  // keys of the CTA
    static constexpr int kStages = kStages_;  // Q/dO (and LSE/D) stages
    static constexpr Mask kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;
    static constexpr bool kDropout = kDropout_;  // the forward's Philox mask on P (and dP)
    // How the consumers share a step. kBlockN 128: 64 keys each, all head-dim columns. kBlockN 64
    // (kSplitColumns; above d128, where one consumer's dK and dV of every column would not fit its
    // registers): all 64 keys each, Sᵀ and dPᵀ for half the step's queries, dK, dV and dQ for its
    // share of the 64-column panels (consumer 0 the first half, rounded up: d192 128 and 64); Pᵀ
    // joins dSᵀ in shared memory, the A of dV = Pᵀ·dO and dK = dSᵀ·Q.
    // kBlockN 96 (kQueryRows; d192): 48 keys each, in the queries' domain (the step's 64 queries as
    // the MMAs' M): S = Q·Kᵀ and dP = dO·Vᵀ of its keys, P and dS to shared memory (transposed, as
    // the split columns' Pᵀ and dSᵀ), dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS with the head dim as M (dO and Q
    // MN-major), dQ of its share of the panels as in split columns. Every Q and dO column feeds both
    // consumers' dKᵀ and dVᵀ, and 96 keys are 1.5x the split columns' per Q/dO load and dQ
    // reduction (FlashAttention-4's d192 block).
    static constexpr bool kSplitColumns = kBlockN == 64;
    static constexpr bool kQueryRows = kBlockN == 96;
    static constexpr int kPanels = kHeadDim / 64;
    static constexpr int kConsumerKeys = kQueryRows ? kBlockN / 2 : kSplitColumns ? kBlockN : 64;
    static constexpr int kSQueries = kSplitColumns ? kBlockM / 2 : kBlockM;  // N of a consumer's Sᵀ and dPᵀ
    // Accumulator registers a thread holds of a consumer's S and dP (Sᵀ and dPᵀ).
    static constexpr int kSRegs = kQueryRows ? kBlockM * kConsumerKeys / 128 : kSQueries / 2;
    // N of its dK and dV: consumer 0's (the arrays' size), consumer 1's. Query rows: N is the keys,
    // the head dim the M of kPanels MMAs.
    static constexpr int kDKVWidth = kSplitColumns ? (kPanels + 1) / 2 * 64 : kQueryRows ? kConsumerKeys : kHeadDim;
    static constexpr int kDKVWidth1 = kSplitColumns ? kHeadDim - kDKVWidth : kDKVWidth;
    static constexpr int kDKVRegs = kQueryRows ? kPanels * kDKVWidth / 2 : kDKVWidth / 2;
    static constexpr int kPanelKBytes = kBlockN * 128;
    static constexpr int kKBytes = kPanels * kPanelKBytes;  // K or V
    static constexpr int kPanelQBytes = kBlockM * 128;
    static constexpr int kQBytes = kPanels * kPanelQBytes;  // Q or dO, one stage
    // dSᵀ (and Pᵀ, split columns and query rows): [key][query], panels of 64 queries by kBlockN keys
    // (K-major, the A of dK and dV or the B of dKᵀ and dVᵀ; MN-major, the A of dQ = dS·K).
    static constexpr int kPanelDSBytes = kBlockN * 128;
    static constexpr int kDSBytes = kBlockM / 64 * kPanelDSBytes;
    static constexpr int kPBytes = kSplitColumns || kQueryRows ? kDSBytes : 0;
    // Each consumer's share of a step's dQ: 64 queries by all columns (kBlockM 128), or all 64
    // queries by half the columns (kBlockM 64; split columns: the first half of the 64-column
    // panels, rounded up, and the rest). Its N, kDQWidth (consumer 1: kDQWidth1), is whole
    // 64-column panels of K, but with query rows: there each consumer's 96 columns are a panel
    // (N 64) and half of the middle one (N 32; consumer 0 panels 0 and 1's first half, consumer 1
    // panel 2 and 1's second half), so that both hold 48 registers.
    static constexpr bool kDQSplitColumns = kBlockM == 64;
    static constexpr int kDQWidth = kSplitColumns ? (kPanels + 1) / 2 * 64 : kDQSplitColumns ? kHeadDim / 2 : kHeadDim;
    static constexpr int kDQWidth1 = kSplitColumns ? kHeadDim - kDQWidth : kDQWidth;
    static constexpr bool kUnevenSplit = kDQWidth1 != kDQWidth;
    static constexpr int kStatsBytes = 2 * kBlockM * 4;  // LSE and D rows, one stage
    // Dropout at kBlockN 128 (kKeepBits): the step's keep decisions as bits that producer warps 1
    // and 3 draw into the stage, kKeepWords words per consumer thread (word j: its n8 tiles
    // 8 j .. 8 j + 7), since a Philox block's four words belong to four consumer warps (the
    // warps' 16-key chunks): drawn in the consumers, each block was drawn four times. Word j of
    // consumer thread c lies at (j * 256 + c) * 4; tile i's element e (key + 8 n, n = e / 2;
    // query + e % 2) is bit 8 (2 h + n) + 2 (i % 4) + e % 2 of it, h = (i % 8) / 4.
    static constexpr bool kKeepBits = kDropout && kBlockN == 128;
    static constexpr int kKeepWords = kKeepBits ? kBlockM / 64 : 0;
    static constexpr int kKeepBytes = kKeepWords * Sm90Warpgroups<kProducerRegs_, kConsumerRegs_>::kConsumerThreads * 4;
    // A step's dQ in fp32: kHeadDim / 32 boxes of kBlockM rows x 32 columns (128 bytes), 128-byte
    // swizzled (the consumers' 8-byte stores of 8 rows at a column take two wavefronts, the least
    // for 256 bytes), added to the dQ buffer by TMA reductions, one per box. Split columns leave no
    // room for a tile of its own, nor do query rows (kDQInStage): box b is the step's Q panel b / 2
    // (b even) or dO panel b / 2 (b odd), as large as a box at 64 queries; a consumer's boxes are
    // then exactly the panels its dK and dV read, so it overwrites them once its own MMAs (query
    // rows: both consumers') are done.
    static constexpr bool kDQInStage = kSplitColumns || kQueryRows;
    // The consumers' dQ stores in row pairs (store_dq), but for d192's uneven split, where they
    // measured 0.95-0.98x (benchmarks/results/20261203-nvidia-h200-sm90-bwd-host-and-dq-banks).
#if defined(FLASHGEN_BWD_SM90_DQ_ROW_PAIRS_ALL) && FLASHGEN_BWD_SM90_DQ_ROW_PAIRS_ALL
    static constexpr bool kDQRowPairs = true;
#else
    static constexpr bool kDQRowPairs = !kUnevenSplit;
#endif
    static constexpr int kDQBoxBytes = kBlockM * 128;
    static constexpr int kDQBytes = kDQInStage ? 0 : kHeadDim / 32 * kDQBoxBytes;
    // Of box b from the tile's first byte (the stage's Q, or the tile of its own); additive over
    // b = 2 k + j, so a consumer's n8 tile i is its first box's + dq_box_offset(i / 4).
    __device__ static constexpr int dq_box_offset(int box) {
        return kDQInStage ? (box % 2) * (kStages * kQBytes) + (box / 2) * kPanelQBytes : box * kDQBoxBytes;
    }
    // K/V; dQ full and empty (a tile of its own); per stage full, empty and (dQ in the stage) dQ full.
    static constexpr int kBarriers = 3 + (kDQInStage ? 3 : 2) * kStages;
    // The instance checks it against the host's request (Sm90BwdTile.smem_bytes).
    static constexpr int kSmemBytes = 1024 + 2 * kKBytes + 2 * kStages * kQBytes + 2 * (kDSBytes + kPBytes) +
                                      kDQBytes + kStages * (kStatsBytes + kKeepBytes) + 8 * kBarriers;
    static_assert(kBlockN == 128 || kBlockN == 64 || kBlockN == 96, "two consumers of 64 keys each, sharing 64, or 48 each");
    static_assert(kHeadDim % 64 == 0 && (kQueryRows || (kDKVWidth % 64 == 0 && kDKVWidth1 % 64 == 0)) &&
                      kDKVRegs <= 72,
                  "head dims of whole 64-column panels, a consumer's dK and dV in registers");
    static_assert(!kQueryRows || (kBlockM == 64 && kConsumerKeys % 16 == 0 && kPanels == 3),
                  "query rows: one 64-query M, a consumer's keys whole stmatrix pairs of n8 tiles");
    static_assert((kBlockM == 64 || kBlockM == 128) && (kDQWidth % 64 == 0 || (kQueryRows && kPanels == 3)),
                  "dQ shares of whole panels (query rows: a panel and a half, at d192)");
    static_assert(!kSplitColumns || kBlockM == 64, "split columns: one dSᵀ panel, each consumer's queries in half of it");
    static_assert(!kDQInStage || (kDQBoxBytes == kPanelQBytes && (kDQWidth % 64 == 0 || kQueryRows)),
                  "dQ in the stage: a box per Q or dO panel, a consumer's share whole panels (query rows: "
                  "read by both consumers' dKᵀ and dVᵀ first)");
};

__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(static_cast<unsigned short>(v)) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}
// TMA reduction: the fp32 box at `src` added to a tensor map's box (columns, rows, head, batch);
// committed as a bulk group per thread (bulk_commit), which then waits until its groups have read
// shared memory, or (at exit) have completed (common.cuh).
__device__ __forceinline__ void tma_reduce_add_4d(const TmaDescriptor* map, uint32_t src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}
// Keeps registers that an in-flight wgmma reads (A fragments) alive up to this point.
template <int N>
__device__ __forceinline__ void keep_fragments(const uint32_t (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" ::"r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]) : "memory");
}

// kSteps k16 wgmmas of width N, A and B from shared memory, into the first N / 2 registers of acc
// (a narrower share on the same registers); step kk moves A by a_offset(kk) bytes and B by kk
// rows of 128 bytes. The first step overwrites acc unless accumulate_first.
template <typename Element, int N, int kTransB, int kTransA, int kSteps, int M, typename AOffset>
__device__ __forceinline__ void wgmma_ss_steps(float (&acc)[M], uint64_t desc_a, AOffset a_offset, uint64_t desc_b,
                                               bool accumulate_first) {
    static_assert(N / 2 <= M, "a prefix of the accumulators");
    float (&d)[N / 2] = *reinterpret_cast<float (*)[N / 2]>(&acc[0]);
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk)
        wgmma_ss<Element, N, kTransB, kTransA>(d, smem_desc_moved(desc_a, a_offset(kk)),
                                               smem_desc_moved(desc_b, kk * 16 * 128), accumulate_first || kk > 0);
}

// A key block's step: its query block and query head of the group (flash_bwd_sm90's step order:
// the heads fastest, query blocks by m_step, -1 from the last or +1 from the first). The direction
// is an argument, not a member: held in the loop it costs each role a register and spills.
struct BwdStep {
    int m_block, head;
    __device__ __forceinline__ void advance(int qhpk, int m_step) {
        if (++head == qhpk) {
            head = 0;
            m_block += m_step;
        }
    }
};

// What the per-element backward of the softmax needs besides Sᵀ and dPᵀ.
struct Sm90BwdStep {
    uint32_t lse, dsum;  // shared addresses of the step's LSE (log2 units) and D rows
    int key;             // this thread's first key (the second is + 8)
    int query;           // this thread's first query (n8 tile i adds 8 i, the odd element 1)
    int diag;            // seqlen_k - seqlen_q
    int seqlen_k;        // the sequence's keys (varlen: not the tensor's rows)
    float slope;         // ALiBi slope (scaled), if kAlibi
    uint32_t bh;         // dropout: batch * nheads + query head
    int key_group;       // dropout: the 64-key group of this thread's keys
    uint32_t keep;       // dropout with kKeepBits: shared address of this thread's keep word 0
};

// Producer warps 1 and 3 under kKeepBits: the step's keep bits (Sm90BwdTraits' layout). Worker w
// (0 .. 63) is (consumer w / 32, quad lane q = (w / 8) % 4, query pair r = (w / 2) % 4, half
// h = w % 2): for each word j it draws the blocks of queries q0 + 8 i + 2 r (+ 1) of tiles
// i = 8 j + 4 h .. + 3 in the consumer's 64-key group for quad lane q, eight blocks whose words
// c hold the keep bytes of consumer warp c's lanes 8 q + 4 e + r (e = 0, 1), and stores each of
// those eight lanes' half h of word j.
template <typename Tr>
__device__ __forceinline__ void draw_keep_bits(uint32_t keep, const Dropout& dropout, uint32_t bh, int q0, int key0,
                                               int worker) {
    Dropout::KeepBytes const bytes = dropout.keep_bytes();
    int const consumer = worker / 32, quad = (worker / 8) % 4, pair = (worker / 2) % 4, half = worker % 2;
    int const group = key0 / 64 + consumer;
#pragma unroll 1
    for (int j = 0; j < Tr::kKeepWords; ++j) {
        // chunk[c]: byte 2 n + e of its words' bits, bit b for block b (tile 8 j + 4 h + b / 2, query b % 2).
        uint32_t chunk[4] = {0u, 0u, 0u, 0u};
#pragma unroll 2
        for (int b = 0; b < 8; ++b) {
            int const i = 8 * j + 4 * half + b / 2;
            uint4 const words = dropout.block(bh, q0 + 8 * i + 2 * pair + b % 2, group, quad);
            chunk[0] |= Dropout::kept_bits(words.x, bytes) << b;
            chunk[1] |= Dropout::kept_bits(words.y, bytes) << b;
            chunk[2] |= Dropout::kept_bits(words.z, bytes) << b;
            chunk[3] |= Dropout::kept_bits(words.w, bytes) << b;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int const thread = consumer * 128 + c * 32 + 8 * quad + 4 * e + pair;
                // Its bytes 2 h (n = 0) and 2 h + 1 (n = 1): chunk bytes e and 2 + e.
                st_shared_u16(keep + (j * Tr::kConsumerThreads + thread) * 4 + 2 * half,
                              __byte_perm(chunk[c], 0u, uint32_t(e | ((2 + e) << 4))));
            }
    }
}

// Sᵀ -> Pᵀ and dPᵀ -> dSᵀ in place, for one consumer's 64 keys x kSQueries queries (accumulator
// layout: element i * 4 + e is key `key + 8 (e / 2)`, query `query + 8 i + e % 2`). dSᵀ is in
// raw-score units over the softmax scale (the scale is applied to dK here and dQ in the
// postprocess kernel). Masked elements are 0 in both.
template <typename Tr, bool kNeedMask, bool kAlibi>
__device__ __forceinline__ void softmax_backward_sm90(float (&s)[Tr::kSRegs], float (&dp)[Tr::kSRegs],
                                                      const Sm90BwdStep& a, const BwdParams& params,
                                                      const Dropout& dropout) {
    int const lane = threadIdx.x % 32;
    int const chunk_in_group = (threadIdx.x / 32) % 4;  // the warp's 16 keys within the consumer's 64
    uint32_t keep_bits = 0;  // kKeepBits: word i / 8
#pragma unroll
    for (int i = 0; i < Tr::kSQueries / 8; ++i) {
        float2 const lse2 = ld_shared_f32x2(a.lse + (i * 8 + 2 * (lane % 4)) * 4);
        float2 const dsum2 = ld_shared_f32x2(a.dsum + (i * 8 + 2 * (lane % 4)) * 4);
        // Dropout: the producer's keep bits (kKeepBits), or the Philox words of the n8 tile's two
        // query columns for this thread's chunk.
        uint32_t word0 = 0, word1 = 0;
        if constexpr (Tr::kKeepBits) {
            if (i % 8 == 0) keep_bits = ld_shared_u32(a.keep + (i / 8) * Tr::kConsumerThreads * 4);
        } else if constexpr (Tr::kDropout) {
            int const mine = (lane / 4) % 2;  // the column this lane draws; lane ^ 4 draws the other
            uint32_t const w = Dropout::word(dropout.block(a.bh, a.query + i * 8 + mine, a.key_group, lane / 8),
                                             chunk_in_group);
            uint32_t const other = __shfl_xor_sync(0xffffffffu, w, 4);
            word0 = mine ? other : w;
            word1 = mine ? w : other;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int const key = a.key + 8 * (e / 2);
            int const query = a.query + i * 8 + (e % 2);
            float score = s[i * 4 + e];
            float dtanh = 1.f;
            if constexpr (Tr::kSoftcap) {
                float const t = tanh_accurate(score * params.softcap_scale);
                score = params.softcap * t;
                dtanh = 1.f - t * t;
            }
            if constexpr (kAlibi) score = alibi_score(score, a.slope, float(query + a.diag - key));
            float p = exp2_approx(score * params.scale_log2 - (e % 2 ? lse2.y : lse2.x));
            float ds;
            if constexpr (Tr::kDropout) {
                // O used P∘Z / (1 - p): dV takes that, and dP is masked and scaled the same way
                // before the softmax's backward (key + 8 (e / 2) is byte 2 (e / 2) + (lane / 4) % 2).
                bool const kept =
                    Tr::kKeepBits ? (keep_bits >> (8 * (2 * ((i % 8) / 4) + e / 2) + 2 * (i % 4) + e % 2)) & 1u
                                  : dropout.keep(e % 2 ? word1 : word0, 2 * (e / 2) + (lane / 4) % 2);
                ds = p * ((kept ? dp[i * 4 + e] * params.rp_dropout : 0.f) - (e % 2 ? dsum2.y : dsum2.x)) * dtanh;
                p = kept ? p * params.rp_dropout : 0.f;
            } else {
                ds = p * (dp[i * 4 + e] - (e % 2 ? dsum2.y : dsum2.x)) * dtanh;
            }
            if constexpr (kNeedMask) {
                bool const hidden =
                    key_hidden<Tr::kMask>(key, query + a.diag, a.seqlen_k, params.window_left, params.window_right);
                p = hidden ? 0.f : p;
                ds = hidden ? 0.f : ds;
            }
            s[i * 4 + e] = p;
            dp[i * 4 + e] = ds;
        }
    }
}

// The same in the queries' domain (query rows): one consumer's 64 queries x kConsumerKeys keys,
// element 4 i + e of S and dP query `query + 8 (e / 2)`, key `key + 8 i + e % 2` (the accumulator
// layout of S = Q·Kᵀ, as in the forward). a.lse and a.dsum are this thread's first query's.
template <typename Tr, bool kNeedMask, bool kAlibi>
__device__ __forceinline__ void softmax_backward_rows_sm90(float (&s)[Tr::kSRegs], float (&dp)[Tr::kSRegs],
                                                           const Sm90BwdStep& a, const BwdParams& params,
                                                           const Dropout& dropout) {
    constexpr int kTiles = Tr::kConsumerKeys / 8;
    float const lse[2] = {ld_shared_f32(a.lse), ld_shared_f32(a.lse + 8 * 4)};
    float const dsum[2] = {ld_shared_f32(a.dsum), ld_shared_f32(a.dsum + 8 * 4)};
    // Dropout: the forward's bytes of the thread's two queries over its keys' 16-key chunks.
    bool kept[Tr::kSRegs];
#pragma unroll
    for (int r = 0; r < Tr::kSRegs; ++r) kept[r] = true;
    if constexpr (Tr::kDropout) {
        int const lane = threadIdx.x % 32;
#pragma unroll
        for (int row = 0; row < 2; ++row)
            dropout.template drop_row<Tr::kConsumerKeys / 16, false>(
                a.bh, a.query + 8 * row, (a.key - 2 * (lane % 4)) / 16, lane % 4,
                [&](int c, int n, int e) { kept[(2 * c + n) * 4 + 2 * row + e] = false; });
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int const r = i * 4 + e, query = a.query + 8 * (e / 2), key = a.key + 8 * i + e % 2;
            float score = s[r];
            float dtanh = 1.f;
            if constexpr (Tr::kSoftcap) {
                float const t = tanh_accurate(score * params.softcap_scale);
                score = params.softcap * t;
                dtanh = 1.f - t * t;
            }
            if constexpr (kAlibi) score = alibi_score(score, a.slope, float(query + a.diag - key));
            float p = exp2_approx(score * params.scale_log2 - lse[e / 2]);
            float ds;
            if constexpr (Tr::kDropout) {
                ds = p * ((kept[r] ? dp[r] * params.rp_dropout : 0.f) - dsum[e / 2]) * dtanh;
                p = kept[r] ? p * params.rp_dropout : 0.f;
            } else {
                ds = p * (dp[r] - dsum[e / 2]) * dtanh;
            }
            if constexpr (kNeedMask) {
                bool const hidden =
                    key_hidden<Tr::kMask>(key, query + a.diag, a.seqlen_k, params.window_left, params.window_right);
                p = hidden ? 0.f : p;
                ds = hidden ? 0.f : ds;
            }
            s[r] = p;
            dp[r] = ds;
        }
}

// Accumulator (64 rows x 16 k of S-like layout) -> the m64k16 A fragments of the next wgmma: the
// k16 slice kk is n8 tiles 2 kk and 2 kk + 1.
// The CTA's key block, KV head and batch. Launch order (chunks = 0): key blocks fastest (the
// grid's x), so the CTAs of a (batch, KV head) run side by side and share its Q, dO and dQ in the
// L2. Under a causal mask a key block's CTA visits fewer query blocks the later its keys, and in
// that order the last heads' longest CTAs start last, at the grid's tail. chunks = C > 0 (the
// plan's, under a causal mask or in deterministic mode): the (batch, KV head) pairs in C chunks of
// even size (the first pairs % C one larger), each run key blocks slowest, the pairs of the chunk
// fastest: every pair's longest CTAs first. Within a pair, key blocks still launch in ascending
// order, so a deterministic block's dQ turn still waits only for blocks launched before it.
struct BwdCta {
    int n_block, bidh_kv, bidb;
};

__device__ __forceinline__ BwdCta bwd_cta(int chunks) {
    int const n_blocks = gridDim.x, heads = gridDim.y;
    if (chunks <= 0) return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
    int const cta = blockIdx.x + n_blocks * (blockIdx.y + heads * blockIdx.z);
    int const pairs = heads * gridDim.z, small = pairs / chunks, larger = pairs % chunks;
    int const larger_ctas = larger * (small + 1) * n_blocks;
    int chunk_pairs, first_pair;
    if (cta < larger_ctas) {
        chunk_pairs = small + 1;
        first_pair = cta / (chunk_pairs * n_blocks) * chunk_pairs;
    } else {
        chunk_pairs = small;
        first_pair = larger * (small + 1) + (cta - larger_ctas) / (small * n_blocks) * small;
    }
    int const in_chunk = cta - first_pair * n_blocks;  // the CTAs of the chunks before hold first_pair pairs
    int const pair = first_pair + in_chunk % chunk_pairs;
    return {in_chunk / chunk_pairs, pair % heads, pair / heads};
}

template <typename Element, int kRegs>
__device__ __forceinline__ void pack_fragments(const float (&acc)[kRegs], uint32_t (&a)[kRegs / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < kRegs / 8; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[kk][j] = Element::pack2(acc[8 * kk + 2 * j], acc[8 * kk + 2 * j + 1]);
}

template <typename Tr>
__device__ __forceinline__ void flash_bwd_sm90(const Sm90BwdParams& args) {
    using Element = typename Tr::Element;
    using T = typename Tr::T;
    constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
    constexpr bool kMasked = Tr::kMask != Mask::None;
    BwdParams const& params = args.p;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    uint32_t const smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint32_t const sK = smem, sV = smem + Tr::kKBytes;
    uint32_t const sQ0 = sV + Tr::kKBytes, sdO0 = sQ0 + kStages * Tr::kQBytes;
    uint32_t const sdS0 = sdO0 + kStages * Tr::kQBytes;
    uint32_t const sP0 = sdS0 + 2 * Tr::kDSBytes;  // split columns
    uint32_t const sdQ = sP0 + 2 * Tr::kPBytes;
    uint32_t const sStats0 = sdQ + Tr::kDQBytes;
    auto sQ = [&](int stage) { return sQ0 + stage * Tr::kQBytes; };
    auto sdO = [&](int stage) { return sdO0 + stage * Tr::kQBytes; };
    auto sLSE = [&](int stage) { return sStats0 + stage * Tr::kStatsBytes; };
    auto sD = [&](int stage) { return sLSE(stage) + kBlockM * 4; };
    uint32_t const sKeep0 = sStats0 + kStages * Tr::kStatsBytes;  // dropout keep bits (kKeepBits)
    auto sKeep = [&](int stage) { return sKeep0 + stage * Tr::kKeepBytes; };
    uint32_t const bars = sKeep0 + kStages * Tr::kKeepBytes;
    uint32_t const bar_kv = bars, dq_full = bars + 8, dq_empty = bars + 16;
    auto full = [&](int stage) { return bars + 8 * (3 + stage); };
    auto empty = [&](int stage) { return bars + 8 * (3 + kStages + stage); };
    auto dq_full_at = [&](int stage) { return bars + 8 * (3 + 2 * kStages + stage); };  // dQ in the stage
    // The step's dQ tile: a tile of its own, or (kDQInStage) box b in Q (b even) or dO (b odd) panel b / 2.
    auto dq_box = [&](int stage, int box) { return (Tr::kDQInStage ? sQ(stage) : sdQ) + Tr::dq_box_offset(box); };

    int const tid = threadIdx.x, warp = tid / 32, lane = tid % 32, warpgroup = warp / 4;
    int* const semaphores = reinterpret_cast<int*>(params.semaphore_ptr);  // deterministic mode
    // Deterministic dQ in descending turns runs the grid backwards (see the step order).
    bool const descending = Tr::kMask == Mask::Causal && params.dq_turns_descending != 0;  // the plan: causal only
    // (Without a causal mask only deterministic calls take chunks: otherwise the coordinates stay
    // blockIdx, which the compiler re-reads where a computed value would stay live or spill.)
    BwdCta const cta = bwd_cta(Tr::kMask == Mask::Causal || semaphores != nullptr ? params.cta_chunks : 0);
    int const n_block = descending ? gridDim.x - 1 - cta.n_block : cta.n_block, bidh_kv = cta.bidh_kv, bidb = cta.bidb;
    // Varlen: sequence bidb is rows [q_offset, q_offset + seqlen_q) of q/dO and [k_offset, k_offset +
    // seqlen_k) of k/v/dk/dv (seq_extent.cuh), each tensor mapped as a batch of one.
    bool const varlen_q = params.cu_seqlens_q_ptr != nullptr, varlen_k = params.cu_seqlens_k_ptr != nullptr;
    BwdExtent const seq = bwd_extent</*kSeqused=*/false>(params, bidb);
    int const q_offset = seq.q_offset, k_offset = seq.k_offset, seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    int const q_batch = varlen_q ? 0 : bidb, k_batch = varlen_k ? 0 : bidb;  // map coordinates
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
    // Steps enumerate (query block, query head of the group), the group's heads fastest, advanced
    // by counters on every side (no division). Query blocks go from the last that sees these keys
    // down to the first: every key block reaches a query block at the same step, or (a local
    // window's) later for later key blocks, which suits the deterministic mode's ascending turns.
    // In descending turns (causal only) they go from the first up: a key block reaches a query
    // block no later than the blocks before it, which add to it after it.
    int const steps = qhpk * max(m_block_max - m_block_min, 0);
    // Built in each role, after its register reallocation: one value live across the split spills.
    auto first_step = [&]() { return BwdStep{descending ? m_block_min : m_block_max - 1, 0}; };
    int const m_step = descending ? 1 : -1;

    if (tid == 0) {
        bwd_timeline_stamp(kCtaStart, steps);
        mbar_init(bar_kv, 1);
        if constexpr (!Tr::kDQInStage) {
            mbar_init(dq_full, Tr::kConsumerThreads);
            mbar_init(dq_empty, 1);  // the dQ thread, once its reductions have read the tile
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            // The TMA thread's arrival with its bytes, warp 1's 32 lanes (and warp 3's: keep bits).
            mbar_init(full(s), 1 + 32 * (Tr::kKeepBits ? 2 : 1));
            // The consumers, or (dQ in the stage) the dQ thread once its reductions have read it.
            mbar_init(empty(s), Tr::kDQInStage ? 1 : Tr::kConsumerThreads);
            if constexpr (Tr::kDQInStage) mbar_init(dq_full_at(s), Tr::kConsumerThreads);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---- Producer.
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (steps == 0) return;  // no query sees these keys: the consumers store dK = dV = 0
        if (warp == 0 && lane == 0) {
            mbar_arrive_expect_tx(bar_kv, 2 * Tr::kKBytes);
#pragma unroll
            for (int p = 0; p < Tr::kPanels; ++p) {
                tma_load_4d(sK + p * Tr::kPanelKBytes, &args.tma_k, bar_kv, p * 64, k_offset + key0, bidh_kv, k_batch);
                tma_load_4d(sV + p * Tr::kPanelKBytes, &args.tma_v, bar_kv, p * 64, k_offset + key0, bidh_kv, k_batch);
            }
            BwdStep step_at = first_step();
            for (int t = 0; t < steps; ++t) {
                int const stage = t % kStages;
                if (t >= kStages) mbar_wait(empty(stage), ((t / kStages) & 1) ^ 1);  // its previous use is done
                int const bidh = bidh_kv * qhpk + step_at.head, q0 = step_at.m_block * kBlockM;
                step_at.advance(qhpk, m_step);
                mbar_arrive_expect_tx(full(stage), 2 * Tr::kQBytes);
#pragma unroll
                for (int p = 0; p < Tr::kPanels; ++p) {
                    tma_load_4d(sQ(stage) + p * Tr::kPanelQBytes, &args.tma_q, full(stage), p * 64, q_offset + q0, bidh,
                                q_batch);
                    tma_load_4d(sdO(stage) + p * Tr::kPanelQBytes, &args.tma_do, full(stage), p * 64, q_offset + q0, bidh,
                                q_batch);
                }
            }
        } else if (warp == 1 || (Tr::kKeepBits && warp == 3)) {
            // Warp 1: the step's LSE in log2 units (the preprocess's: +inf for rows that saw no key,
            // so P = 0 there) and D; +inf and 0 for rows past seqlen_q (their Q and dO are the TMA's
            // zeros, or under varlen zeroed by clear_rows). Warps 1 and 3 under kKeepBits: the
            // step's dropout keep bits.
            const float* lse_log2_rows = reinterpret_cast<const float*>(params.lse_log2_ptr);
            const float* dsum = reinterpret_cast<const float*>(params.dsum_ptr);
            BwdStep step_at = first_step();
            for (int t = 0; t < steps; ++t) {
                int const stage = t % kStages;
                if (t >= kStages) mbar_wait(empty(stage), ((t / kStages) & 1) ^ 1);
                int const bidh = bidh_kv * qhpk + step_at.head, q0 = step_at.m_block * kBlockM;
                step_at.advance(qhpk, m_step);
                if (warp == 1) {
                    int64_t const row_stats = bidb * params.stats_batch_stride + bidh * params.stats_head_stride + q_offset;
#pragma unroll
                    for (int r = lane; r < kBlockM; r += 32) {
                        float lse_log2 = kInfinity, d = 0.f;
                        if (q0 + r < seqlen_q) {
                            lse_log2 = lse_log2_rows[row_stats + q0 + r];
                            d = dsum[row_stats + q0 + r];
                        }
                        st_shared_f32(sLSE(stage) + r * 4, lse_log2);
                        st_shared_f32(sD(stage) + r * 4, d);
                    }
                }
                if constexpr (Tr::kKeepBits) {
                    draw_keep_bits<Tr>(sKeep(stage), Dropout::from(params), uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(bidh),
                                       q0, key0, (warp == 1 ? 0 : 32) + lane);
                }
                mbar_arrive(full(stage));
            }
        } else if (warp == 2) {
            // dQ: once both consumers have stored a step's tile, lane 0 adds it to the fp32 dQ
            // buffer by TMA reductions (rows past the tensor are dropped) and releases the tile (or
            // the stage it lies in) when the reductions have read it. (Off the consumers' path, and
            // whole lines for the L2 instead of 8-byte atomics.) Under varlen, a sequence's last
            // tile also covers the next sequence's first rows: the warp zeroes them first, whatever
            // this sequence's K and V held (0 times inf is NaN). Here rather than in the consumers,
            // whose loop spills when it keeps the sequence's end live.
            int const m_blocks_stride = (params.max_seqlen_q + kBlockM - 1) / kBlockM;  // of the semaphores
            BwdStep step_at = first_step();
            for (int t = 0; t < steps; ++t) {
                int const bidh = bidh_kv * qhpk + step_at.head, m_block = step_at.m_block, q0 = m_block * kBlockM;
                step_at.advance(qhpk, m_step);
                int* semaphore = nullptr;
                if (semaphores != nullptr) {
                    // This block's turn at the query block: ascending from the first key block that
                    // sees it (a local window's left edge skips the first ones: key blocks n with
                    // n * kBlockN > q0 + diag - window_left - kBlockN, the m_block_max rule read the
                    // other way), or descending from the last (causal: the block of key
                    // min(seqlen_k - 1, q0 + kBlockM - 1 + diag + window_right), the m_block_min
                    // rule read the other way, so with the query block's rows past seqlen_q).
                    semaphore = semaphores + (int64_t(bidb) * params.nheads + bidh) * m_blocks_stride + m_block;
                    int turn = n_block;
                    if constexpr (Tr::kMask == Mask::Local) {
                        int const first_key = q0 + diag - params.window_left;
                        turn -= first_key > 0 ? first_key / kBlockN : 0;
                    }
                    if (descending) {
                        int const last_key = min(seqlen_k - 1, q0 + kBlockM - 1 + diag + params.window_right);
                        turn = last_key / kBlockN - n_block;
                    }
#if !(defined(FLASHGEN_BWD_SM90_MEASURE_NO_TURN_WAIT) && FLASHGEN_BWD_SM90_MEASURE_NO_TURN_WAIT)
                    // (Measurement variants, tune_bwd_sm90.py: without the wait, or without the drain
                    // below, the order of the additions is not fixed.)
                    if (lane == 0) semaphore_wait_eq(semaphore, turn);
#endif
                    __syncwarp();
                }
                int const stage = t % kStages;
                if constexpr (Tr::kDQInStage) mbar_wait(dq_full_at(stage), (t / kStages) & 1);
                else mbar_wait(dq_full, t & 1);
                if (varlen_q && q0 + kBlockM > seqlen_q) {
                    // Whole 128-byte rows of each 32-column box (the swizzle only permutes chunks within a row).
                    int const first_past = max(seqlen_q - q0, 0);
                    for (int chunk = first_past * 8 + lane; chunk < kBlockM * 8; chunk += 32) {
#pragma unroll
                        for (int box = 0; box < kHeadDim / 32; ++box) st_shared_zero16(dq_box(stage, box) + chunk * 16);
                    }
                    fence_proxy_async();  // visible to the TMA (async proxy)
                    __syncwarp();
                }
                if (lane == 0) {
#if !(defined(FLASHGEN_BWD_SM90_MEASURE_NO_DQ_ADD) && FLASHGEN_BWD_SM90_MEASURE_NO_DQ_ADD)
                    // (A measurement variant, tune_bwd_sm90.py, leaves the reductions out: wrong dQ.)
#pragma unroll
                    for (int box = 0; box < kHeadDim / 32; ++box) {
                        tma_reduce_add_4d(&args.tma_dq, dq_box(stage, box), box * 32, q_offset + q0, bidh, q_batch);
                    }
#endif
                    bulk_commit();
                    bulk_wait_read();
                    mbar_arrive(Tr::kDQInStage ? empty(stage) : dq_empty);
                    if (semaphore != nullptr) {
#if !(defined(FLASHGEN_BWD_SM90_MEASURE_NO_DQ_DRAIN) && FLASHGEN_BWD_SM90_MEASURE_NO_DQ_DRAIN)
                        bulk_wait_all();  // the additions are done, not just read from the tile
#endif
                        semaphore_release_add(semaphore, 1);
                    }
                }
                __syncwarp();
            }
            // The tile must outlive the reductions' reads of it; their writes to the dQ buffer
            // complete before the kernel does.
            if (lane == 0) {
                bulk_wait_read();
                bwd_timeline_stamp(kDQDrained);
            }
        }
        return;
    }

    // ---- Consumers: warpgroup c (0 or 1) owns keys 64 c .. 64 c + 63 of the block (split columns:
    // all 64, and queries 32 c .. of a step, columns kDKVWidth c .. of dK and dV); thread (warp w of
    // the warpgroup, lane) holds keys 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4), + 1 of
    // each n8 tile of Sᵀ, dPᵀ, dK and dV (the wgmma accumulator layout).
    setmaxnreg_inc<Tr::kConsumerRegs>();
    // Warp-uniform for the compiler (a shuffle from lane 0), so that the descriptors derived from it
    // live in uniform registers.
    int const consumer = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    // This consumer's keys of the block and queries of the step (Sᵀ, dPᵀ), and its dK and dV columns.
    int const keys0 = Tr::kSplitColumns ? 0 : consumer * Tr::kConsumerKeys;
    int const queries0 = Tr::kSplitColumns ? consumer * Tr::kSQueries : 0;
    int const dkv_col0 = Tr::kSplitColumns ? consumer * Tr::kDKVWidth : 0;
    int const key_in_block = keys0 + (warp % 4) * 16 + lane / 4;  // transposed: its first key
    constexpr int kSRegs = Tr::kSRegs, kDKRegs = Tr::kDKVRegs;
    // Descriptors of this consumer's K and V rows (K-major: the A of Sᵀ and dPᵀ, or with query rows
    // the B of S and dP) and of K MN-major from dQ's first column (the B of dQ = dS·K), moved per
    // MMA by constants.
    uint64_t const desc_k = smem_desc_sw128(sK + keys0 * 128, 16, 1024);
    uint64_t const desc_v = smem_desc_sw128(sV + keys0 * 128, 16, 1024);
    // This consumer's share of dQ: queries dq_q0 .. + 63, columns dq_col0 .. + kDQWidth - 1.
    int const dq_q0 = Tr::kDQSplitColumns ? 0 : consumer * 64;
    int const dq_col0 = Tr::kDQSplitColumns ? consumer * Tr::kDQWidth : 0;
    uint64_t const desc_kt = smem_desc_sw128(sK + (dq_col0 / 64) * Tr::kPanelKBytes, Tr::kPanelKBytes, 1024);
    // Query rows: its dQ panel (N 64) and half panel (N 32, 64 bytes into panel 1's rows for
    // consumer 1), and where their 32-column boxes of the dQ tile lie: registers' box k (n8 tiles
    // 4 k ..) is box k (consumer 0) or 4, 5, 3.
    uint64_t const desc_kt_panel = smem_desc_sw128(sK + consumer * 2 * Tr::kPanelKBytes, Tr::kPanelKBytes, 1024);
    uint64_t const desc_kt_half = smem_desc_sw128(sK + Tr::kPanelKBytes + consumer * 64, Tr::kPanelKBytes, 1024);
    int const dq_first_box = Tr::kQueryRows ? consumer * 4 : dq_col0 / 32;
    // Stage 0's Q and dO (K-major from this consumer's queries; MN-major from its dK and dV
    // columns) and dSᵀ buffer 0 from its dQ queries (MN-major: the A of dQ); each step moves them to
    // its stage and buffer. Split columns: Pᵀ and dSᵀ K-major (the A of dV and dK); query rows: from
    // this consumer's key rows (the B of dVᵀ and dKᵀ).
    uint64_t const desc_q0 = smem_desc_sw128(sQ(0) + queries0 * 128, 16, 1024);
    uint64_t const desc_do0 = smem_desc_sw128(sdO(0) + queries0 * 128, 16, 1024);
    uint64_t const desc_q0_mn = smem_desc_sw128(sQ(0) + (dkv_col0 / 64) * Tr::kPanelQBytes, Tr::kPanelQBytes, 1024);
    uint64_t const desc_do0_mn = smem_desc_sw128(sdO(0) + (dkv_col0 / 64) * Tr::kPanelQBytes, Tr::kPanelQBytes, 1024);
    uint64_t const desc_ds0 = smem_desc_sw128(sdS0 + (dq_q0 / 64) * Tr::kPanelDSBytes, Tr::kPanelDSBytes, 1024);
    uint32_t const transposed_rows = Tr::kQueryRows ? keys0 * 128 : 0;
    uint64_t const desc_p0_k = smem_desc_sw128(sP0 + transposed_rows, 16, 1024);
    uint64_t const desc_ds0_k = smem_desc_sw128(sdS0 + transposed_rows, 16, 1024);
    const float* slopes = reinterpret_cast<const float*>(params.alibi_slopes_ptr);
    Dropout const dropout = Dropout::from(params);

    float acc_dk[kDKRegs], acc_dv[kDKRegs];
#pragma unroll
    for (int i = 0; i < kDKRegs; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    // Varlen: rows of a block past its sequence's end are the next sequence's (or, past the last
    // one, whatever the tensor holds there). Masked P and dS are 0 by selection, but 0 times an inf
    // or NaN row is NaN, so the K and V rows past seqlen_k, and in a step's block the Q and dO rows
    // past seqlen_q, are zeroed in shared memory before any MMA reads them (both consumers, then a
    // barrier; once per CTA for K/V, on a sequence's last query block for Q/dO). Dense rows past a
    // tensor are the TMA's zeros.
    auto clear_rows = [&](uint32_t tile, int rows, int first_row, int panel_bytes) {
        int const consumer_tid = tid - (Tr::kNThreads - Tr::kConsumerThreads);  // after the producer warpgroup
        for (int c = consumer_tid; c < Tr::kPanels * rows * 8; c += Tr::kConsumerThreads) {
            int const row = c / 8 % rows;
            if (row >= first_row) st_shared_zero16(tile + (c / (8 * rows)) * panel_bytes + row * 128 + (c % 8) * 16);
        }
    };
    auto publish_cleared = [&]() {
        fence_proxy_async();
        named_barrier_sync(2, Tr::kConsumerThreads);
    };
    bool const stamps = tid == Tr::kNThreads - Tr::kConsumerThreads;  // the first consumer thread
    if (steps > 0) {
        mbar_wait(bar_kv, 0);
        if (stamps) bwd_timeline_stamp(kKVLanded);
        if (varlen_k && key0 + kBlockN > seqlen_k) {
            clear_rows(sK, kBlockN, seqlen_k - key0, Tr::kPanelKBytes);
            clear_rows(sV, kBlockN, seqlen_k - key0, Tr::kPanelKBytes);
            publish_cleared();
        }
    }

    BwdStep step_at = first_step();
    for (int t = 0; t < steps; ++t) {
        int const stage = t % kStages;
        uint32_t const parity = (t / kStages) & 1;
        int const bidh = bidh_kv * qhpk + step_at.head, q0 = step_at.m_block * kBlockM;
        step_at.advance(qhpk, m_step);
        float s[kSRegs], dp[kSRegs];
        mbar_wait(full(stage), parity);
        if (stamps && t == 0) bwd_timeline_stamp(kFirstStageReady);
        if (varlen_q && q0 + kBlockM > seqlen_q) {
            clear_rows(sQ(stage), kBlockM, seqlen_q - q0, Tr::kPanelQBytes);
            clear_rows(sdO(stage), kBlockM, seqlen_q - q0, Tr::kPanelQBytes);
            publish_cleared();
        }
        // This step's Q and dO: K-major (Sᵀ's and dPᵀ's B) and MN-major (dK's and dV's B, 64-column
        // panels kPanelQBytes apart), moved from stage 0's.
        uint64_t const desc_q = smem_desc_moved(desc_q0, stage * Tr::kQBytes);
        uint64_t const desc_do = smem_desc_moved(desc_do0, stage * Tr::kQBytes);
        uint64_t const desc_q_mn = smem_desc_moved(desc_q0_mn, stage * Tr::kQBytes);
        uint64_t const desc_do_mn = smem_desc_moved(desc_do0_mn, stage * Tr::kQBytes);
        // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (query rows: S = Q·Kᵀ and dP = dO·Vᵀ), the head dim their K.
        auto issue_scores = [&](float (&acc)[kSRegs], uint64_t desc_keys, uint64_t desc_queries) {
#pragma unroll
            for (int k = 0; k < kHeadDim / 16; ++k) {
                // 16 columns = 32 bytes within the 128-byte panel rows.
                uint64_t const keys = smem_desc_moved(desc_keys, (k / 4) * Tr::kPanelKBytes + (k % 4) * 32);
                uint64_t const queries = smem_desc_moved(desc_queries, (k / 4) * Tr::kPanelQBytes + (k % 4) * 32);
                if constexpr (Tr::kQueryRows) wgmma_ss<Element, Tr::kConsumerKeys, 0>(acc, queries, keys, k > 0);
                else wgmma_ss<Element, Tr::kSQueries, 0>(acc, keys, queries, k > 0);
            }
        };
        wgmma_fence();
        issue_scores(s, desc_k, desc_q);
        issue_scores(dp, desc_v, desc_do);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(s);
        fence_registers(dp);

        // Pᵀ and dSᵀ, instantiated per (mask needed, ALiBi): a block without either issues none of
        // their instructions. The mask: keys past seqlen_k, or a window edge crossing this
        // consumer's keys x the step's queries.
        int const wg_key0 = key0 + keys0;
        bool const need_mask = wg_key0 + Tr::kConsumerKeys > seqlen_k ||
                               (kMasked && (q0 + diag + params.window_right < wg_key0 + Tr::kConsumerKeys - 1 ||
                                            (Tr::kMask == Mask::Local && q0 + kBlockM - 1 + diag - params.window_left > wg_key0)));
        // Evaluated in each branch's step (as one value ahead of the branches they took the d128
        // softcap instances' step from 14 to 19 spill instructions).
        auto slope = [&]() {
            return slopes != nullptr ? slopes[bidb * params.alibi_batch_stride + bidh] * params.alibi_scale : 0.f;
        };
        auto bh = [&]() { return uint32_t(bidb) * uint32_t(params.nheads) + uint32_t(bidh); };
        if constexpr (Tr::kQueryRows) {
            int const row = (warp % 4) * 16 + lane / 4;  // this thread's first query of the step
            Sm90BwdStep const step{sLSE(stage) + row * 4, sD(stage) + row * 4, wg_key0 + 2 * (lane % 4), q0 + row,
                                   diag, seqlen_k, slope(), bh(), 0, 0};
            if (need_mask) {
                if (slopes != nullptr) softmax_backward_rows_sm90<Tr, true, true>(s, dp, step, params, dropout);
                else softmax_backward_rows_sm90<Tr, true, false>(s, dp, step, params, dropout);
            } else {
                if (slopes != nullptr) softmax_backward_rows_sm90<Tr, false, true>(s, dp, step, params, dropout);
                else softmax_backward_rows_sm90<Tr, false, false>(s, dp, step, params, dropout);
            }
        } else {
            Sm90BwdStep const step{sLSE(stage) + queries0 * 4, sD(stage) + queries0 * 4, key0 + key_in_block,
                                   q0 + queries0 + 2 * (lane % 4), diag, seqlen_k, slope(), bh(), (key0 + keys0) / 64,
                                   sKeep(stage) + (tid - (Tr::kNThreads - Tr::kConsumerThreads)) * 4};
            if (need_mask) {
                if (slopes != nullptr) softmax_backward_sm90<Tr, true, true>(s, dp, step, params, dropout);
                else softmax_backward_sm90<Tr, true, false>(s, dp, step, params, dropout);
            } else {
                if (slopes != nullptr) softmax_backward_sm90<Tr, false, true>(s, dp, step, params, dropout);
                else softmax_backward_sm90<Tr, false, false>(s, dp, step, params, dropout);
            }
        }
        uint32_t p_frag[kSRegs / 8][4], ds_frag[kSRegs / 8][4];
        // dV += Pᵀ·dO and dK += dSᵀ·Q: query rows kk * 16.. of dO and Q are the K of MMA kk, this
        // consumer's dK and dV columns its N (MN-major, panels kPanelQBytes apart). Pᵀ and dSᵀ from
        // registers, or (split columns) the whole step's from shared memory, 16 queries = 32 bytes
        // of a row a MMA.
        uint64_t const desc_p_k = smem_desc_moved(desc_p0_k, (t & 1) * Tr::kPBytes);
        uint64_t const desc_ds_k = smem_desc_moved(desc_ds0_k, (t & 1) * Tr::kDSBytes);
        auto issue_dkv = [&](float (&acc)[kDKRegs], const uint32_t (&frag)[kSRegs / 8][4], uint64_t desc_a,
                             uint64_t desc_b) {
            if constexpr (Tr::kQueryRows) {
                // dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS: M the head dim (panel j of dO or Q MN-major, desc_b),
                // K the step's queries (16 rows of the panel, 32 bytes of P's or dS's rows, desc_a
                // from this consumer's keys), N its keys.
#pragma unroll
                for (int j = 0; j < Tr::kPanels; ++j)
#pragma unroll
                    for (int kk = 0; kk < kBlockM / 16; ++kk)
                        wgmma_ss<Element, Tr::kDKVWidth, 0, 1>(
                            *reinterpret_cast<float (*)[Tr::kDKVWidth / 2]>(&acc[j * Tr::kDKVWidth / 2]),
                            smem_desc_moved(desc_b, j * Tr::kPanelQBytes + kk * 16 * 128),
                            smem_desc_moved(desc_a, kk * 32), 1);
            } else if constexpr (Tr::kSplitColumns) {
                auto a_offset = [](int kk) { return (kk / 4) * Tr::kPanelDSBytes + (kk % 4) * 32; };
                if (Tr::kUnevenSplit && consumer == 1)
                    wgmma_ss_steps<Element, Tr::kDKVWidth1, 1, 0, kBlockM / 16>(acc, desc_a, a_offset, desc_b, true);
                else
                    wgmma_ss_steps<Element, Tr::kDKVWidth, 1, 0, kBlockM / 16>(acc, desc_a, a_offset, desc_b, true);
            } else {
#pragma unroll
                for (int kk = 0; kk < kBlockM / 16; ++kk)
                    wgmma_rs<Element, kHeadDim, 1>(acc, frag[kk], smem_desc_moved(desc_b, kk * 16 * 128), 1);
            }
        };
        auto issue_dv = [&]() { issue_dkv(acc_dv, p_frag, desc_p_k, desc_do_mn); };
        auto issue_dk = [&]() { issue_dkv(acc_dk, ds_frag, desc_ds_k, desc_q_mn); };
        // dSᵀ (or Pᵀ) to buffer t % 2: element (key, query) at panel query / 64, row key, 16-byte
        // chunk (query % 64) / 8 XOR key % 8 (the 128-byte swizzle).
        uint32_t const ds_buffer = sdS0 + (t & 1) * Tr::kDSBytes;
        auto store_transposed = [&](uint32_t buffer, const uint32_t (&frag)[kSRegs / 8][4]) {
            // frag[kk] is the four 8x8 matrices of n8 tiles 2 kk and 2 kk + 1, keys + 0 and + 8:
            // one stmatrix, lane l the row of key row + 8 ((l / 8) % 2) + l % 8, chunk
            // queries0 / 8 + 2 kk + l / 16 (split columns: queries0 / 8 is 0 or 4, and 2 kk + 1 < 4,
            // so the sum is an XOR and stays in the first panel).
            int const row = keys0 + (warp % 4) * 16 + ((lane / 8) % 2) * 8 + lane % 8;
            uint32_t const lane_row = buffer + row * 128;
            int const chunk = (lane / 16) ^ (lane % 8) ^ (queries0 / 8);  // XOR 2 kk, then the panel of 2 kk
#pragma unroll
            for (int kk = 0; kk < Tr::kSQueries / 16; ++kk)
                stmatrix_x4(lane_row + ((2 * kk) / 8) * Tr::kPanelDSBytes + ((chunk ^ ((2 * kk) % 8)) * 16),
                            frag[kk][0], frag[kk][1], frag[kk][2], frag[kk][3]);
            fence_proxy_async();  // visible to the wgmma (async proxy)
        };
        // Query rows: P (or dS) transposed to its keys' rows of buffer t % 2. frag[kk] is n8 tiles
        // 2 kk and 2 kk + 1 of the thread's queries + 0 and + 8: one stmatrix.trans, lane l the
        // row of key keys0 + 16 kk + 8 ((l / 8) / 2) + l % 8 (column l % 8 of its matrix), its
        // 8 queries' chunk 2 (warp % 4) + (l / 8) % 2 XOR the key's row % 8.
        auto store_rows_transposed = [&](uint32_t buffer, const uint32_t (&frag)[kSRegs / 8][4]) {
            uint32_t const lane_row =
                buffer + (keys0 + (lane / 16) * 8 + lane % 8) * 128 + (((2 * (warp % 4) + (lane / 8) % 2) ^ (lane % 8)) * 16);
#pragma unroll
            for (int kk = 0; kk < kSRegs / 8; ++kk)
                stmatrix_x4_trans(lane_row + kk * 16 * 128, frag[kk][0], frag[kk][1], frag[kk][2], frag[kk][3]);
            fence_proxy_async();  // visible to the wgmma (async proxy)
        };
        // dQ share = dS·K once both consumers' dSᵀ halves are in the buffer: dS MN-major from its
        // panel dq_q0 / 64, K rows kk * 16.. the K of MMA kk, K's columns dq_col0.. its N.
        // acc_dq: this consumer's share; `narrow` (a constant at each call): an uneven split's
        // consumer 1, whose registers past kDQWidth1 / 2 are neither written nor read.
        using DQShare = float[Tr::kDQWidth / 2];
        uint64_t const desc_ds = smem_desc_moved(desc_ds0, (t & 1) * Tr::kDSBytes);
        auto issue_dq = [&](DQShare& acc_dq, bool narrow) {
            auto a_offset = [](int kk) { return kk * 16 * 128; };
            if constexpr (Tr::kQueryRows) {
                static_assert(Tr::kDQWidth == 96, "a panel and a half");
                wgmma_ss_steps<Element, 64, 1, 1, kBlockN / 16>(acc_dq, desc_ds, a_offset, desc_kt_panel, false);
                wgmma_ss_steps<Element, 32, 1, 1, kBlockN / 16>(*reinterpret_cast<float (*)[16]>(&acc_dq[32]), desc_ds,
                                                                 a_offset, desc_kt_half, false);
            } else if (narrow)
                wgmma_ss_steps<Element, Tr::kDQWidth1, 1, 1, kBlockN / 16>(acc_dq, desc_ds, a_offset, desc_kt, false);
            else
                wgmma_ss_steps<Element, Tr::kDQWidth, 1, 1, kBlockN / 16>(acc_dq, desc_ds, a_offset, desc_kt, false);
        };
        // This consumer's share of dQ into the tile, once the dQ thread's reductions have read
        // the previous step's (dQ in the stage: the stage is this step's until the dQ thread
        // releases it). Element (row, col): box col / 32, 16-byte chunk (col % 32) / 4 XOR row % 8
        // (= lane / 4 here).
        auto store_dq = [&](const DQShare& acc_dq, bool narrow) {
            if (!Tr::kDQInStage && t > 0) mbar_wait(dq_empty, (t - 1) & 1);
            int const dq_row = dq_q0 + (warp % 4) * 16 + lane / 4;
            // One per-lane base: its bits 4-6 are the lane's swizzled chunk (every other term is a
            // multiple of 128), so n8 tile i's chunk, 2 (i % 4) XOR that, is the base XOR 32 (i % 4);
            // one register instead of one per tile (fewer spills in the loop). dq_col0 / 32 is even,
            // so tile i's box is the first's + dq_box_offset(i / 4), a constant (query rows: one of
            // two, the consumer's).
            auto box_offset = [&](int k) {
                if constexpr (Tr::kQueryRows) {
                    int const box = consumer == 0 ? k : k == 2 ? 3 : 4 + k;
                    return Tr::dq_box_offset(box) - Tr::dq_box_offset(dq_first_box);
                } else {
                    return Tr::dq_box_offset(k);
                }
            };
            uint32_t dq_lane = dq_box(stage, dq_first_box) + dq_row * 128 +
                               ((((lane % 4) / 2) ^ (lane / 4)) * 16) + (lane % 2) * 8;
            // A 64-bit store goes out a half-warp (4 rows) at a time, and rows r and r ^ 1 of the
            // swizzle put a tile's chunks in the same banks: two wavefronts where one would do. Odd
            // rows store tile i ^ 2 (same box) when even rows store tile i, whose chunks are the even
            // rows' XOR 4: one wavefront per half-warp, for a select per register.
            bool const odd_row = Tr::kDQRowPairs && (lane / 4) % 2;  // dq_q0 and the warp's 16 rows are even
            dq_lane ^= odd_row ? 2 * 32 : 0;
            auto dq_value = [&](int i, int r) { return odd_row ? acc_dq[(i ^ 2) * 4 + r] : acc_dq[i * 4 + r]; };
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int i = 0; i < Tr::kDQWidth / 8; ++i) {
                    if (narrow && i >= Tr::kDQWidth1 / 8) break;  // its narrower share
                    st_shared_f32x2((dq_lane ^ ((i % 4) * 32)) + box_offset(i / 4) + half * 8 * 128,
                                    dq_value(i, 2 * half), dq_value(i, 2 * half + 1));
                }
            fence_proxy_async();  // visible to the TMA (async proxy)
            mbar_arrive(Tr::kDQInStage ? dq_full_at(stage) : dq_full);
        };
        // Split columns and query rows run the dQ phase, dq_tail(narrow), from one of two calls: an
        // uneven split's consumer 1 gets code of its own that touches its share's registers only
        // (with a run-time width in one code path, the register allocator keeps the registers it
        // leaves unwritten live across steps, and ptxas serializes the wgmma when they are zeroed).
        if constexpr (Tr::kQueryRows) {
            // Both consumers' P and dS into the buffers, then dVᵀ, dKᵀ and dQ; dQ into the stage
            // once both consumers' dVᵀ and dKᵀ (every Q and dO column) are done.
            pack_fragments<Element>(s, p_frag);
            store_rows_transposed(sP0 + (t & 1) * Tr::kPBytes, p_frag);
#if FLASHGEN_BWD_SM90_ROWS_EARLY_DV
            // dVᵀ reads this consumer's P only: to the tensor cores once its warpgroup has stored it,
            // while dS is packed and stored and the consumers meet.
            named_barrier_sync(3 + consumer, 128);
            fence_registers(acc_dv);
            wgmma_fence();
            issue_dv();
            wgmma_commit();
            pack_fragments<Element>(dp, ds_frag);
            store_rows_transposed(ds_buffer, ds_frag);
            named_barrier_sync(1, Tr::kConsumerThreads);
            fence_registers(acc_dk);
            wgmma_fence();
            issue_dk();
            wgmma_commit();
#else
            pack_fragments<Element>(dp, ds_frag);
            store_rows_transposed(ds_buffer, ds_frag);
            named_barrier_sync(1, Tr::kConsumerThreads);
            fence_registers(acc_dv);
            fence_registers(acc_dk);
            wgmma_fence();
            issue_dv();
            issue_dk();
            wgmma_commit();
#endif
            auto dq_tail = [&](bool narrow) {
                DQShare acc_dq;
                issue_dq(acc_dq, narrow);
                wgmma_commit();
                wgmma_wait<1>();  // dVᵀ and dKᵀ done
                fence_registers(acc_dv);
                fence_registers(acc_dk);
                named_barrier_sync(1, Tr::kConsumerThreads);  // the stage's Q and dO are read
                wgmma_wait<0>();
                fence_registers(acc_dq);
                store_dq(acc_dq, narrow);  // the dQ thread releases the stage
            };
            if (Tr::kUnevenSplit && consumer == 1) dq_tail(true);
            else dq_tail(false);
        } else if constexpr (Tr::kSplitColumns) {
            // Both consumers' halves of Pᵀ and dSᵀ into their buffers, then dQ, dV and dK; dQ into
            // the stage once this consumer's dV and dK have read its panels there.
            pack_fragments<Element>(s, p_frag);
            store_transposed(sP0 + (t & 1) * Tr::kPBytes, p_frag);
            pack_fragments<Element>(dp, ds_frag);
            store_transposed(ds_buffer, ds_frag);
            named_barrier_sync(1, Tr::kConsumerThreads);
            fence_registers(acc_dv);
            fence_registers(acc_dk);
            wgmma_fence();
            auto dq_tail = [&](bool narrow) {
                DQShare acc_dq;
                issue_dq(acc_dq, narrow);
                wgmma_commit();
                issue_dv();
                issue_dk();
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers(acc_dq);
                fence_registers(acc_dv);
                fence_registers(acc_dk);
                store_dq(acc_dq, narrow);  // the dQ thread releases the stage
            };
            if (Tr::kUnevenSplit && consumer == 1) dq_tail(true);
            else dq_tail(false);
        } else {
            // dV goes to the tensor cores while dSᵀ is packed and stored and the consumers meet; dQ
            // before dK, so that dQ's tile store overlaps dK.
            pack_fragments<Element>(s, p_frag);
            fence_registers(acc_dv);
            wgmma_fence();
            issue_dv();
            wgmma_commit();
            pack_fragments<Element>(dp, ds_frag);
            store_transposed(ds_buffer, ds_frag);
            named_barrier_sync(1, Tr::kConsumerThreads);
            fence_registers(acc_dk);
            wgmma_fence();
            DQShare acc_dq;
            issue_dq(acc_dq, false);
            wgmma_commit();
            issue_dk();
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ done
            fence_registers(acc_dq);
            store_dq(acc_dq, false);
            wgmma_wait<0>();  // dK done: the stage's Q, dO, LSE and D are free
            fence_registers(acc_dv);
            fence_registers(acc_dk);
            keep_fragments(p_frag);
            keep_fragments(ds_frag);
            mbar_arrive(empty(stage));
        }
        if (stamps && t == 0) bwd_timeline_stamp(kFirstStepDone);
    }
    if (stamps) bwd_timeline_stamp(kLoopDone);

    // ---- dK (scaled) and dV of this consumer's keys, through shared memory in whole rows: the
    // accumulators into K's and V's tiles by stmatrix (free once both consumers' last MMAs have read
    // them; dQ reads the other consumer's K rows), then the rows out in 16-byte chunks, a row's on
    // consecutive lanes (flash_bwd gives the kernel dk and dv in whole chunks). Stores straight from
    // the accumulators (8 rows of 16 bytes a warp store) took about as long as three steps.
#if defined(FLASHGEN_BWD_SM90_MEASURE_NO_EPILOGUE) && FLASHGEN_BWD_SM90_MEASURE_NO_EPILOGUE
    // A measurement variant (tune_bwd_sm90.py; wrong dK, dV): no stores, behind a condition the
    // compiler cannot decide, so that dK and dV stay live (an unconditional return lets ptxas drop
    // their MMAs).
    if (params.head_dim > 0) return;
#endif
    named_barrier_sync(1, Tr::kConsumerThreads);
    int const matrix = lane / 8;  // stmatrix: n8 tiles 2 j + matrix / 2, rows + 8 (matrix % 2)
    int const stage_row = keys0 + (warp % 4) * 16 + (matrix % 2) * 8 + lane % 8;
    auto stage = [&](uint32_t tile, const float (&acc)[kDKRegs], float scale) {
        if constexpr (Tr::kQueryRows) {
            // dKᵀ and dVᵀ transposed (stmatrix.trans): panel j's n8 tiles 2 kk and 2 kk + 1, head-dim
            // rows + 0 and + 8, lane l the row of key keys0 + 16 kk + 8 (matrix / 2) + l % 8, its 8
            // columns' chunk 2 (warp % 4) + matrix % 2 of panel j XOR the key's row % 8.
            uint32_t const lane_row =
                tile + (keys0 + (matrix / 2) * 8 + lane % 8) * 128 + (((2 * (warp % 4) + matrix % 2) ^ (lane % 8)) * 16);
#pragma unroll
            for (int j = 0; j < Tr::kPanels; ++j)
#pragma unroll
                for (int kk = 0; kk < Tr::kDKVWidth / 16; ++kk) {
                    float const* a = &acc[j * Tr::kDKVWidth / 2 + 8 * kk];
                    stmatrix_x4_trans(lane_row + j * Tr::kPanelKBytes + kk * 16 * 128,
                                      Element::pack2(a[0] * scale, a[1] * scale), Element::pack2(a[2] * scale, a[3] * scale),
                                      Element::pack2(a[4] * scale, a[5] * scale), Element::pack2(a[6] * scale, a[7] * scale));
                }
            return;
        }
#pragma unroll
        for (int j = 0; j < Tr::kDKVWidth / 16; ++j) {
            if (Tr::kUnevenSplit && consumer == 1 && j >= Tr::kDKVWidth1 / 16) break;  // its narrower share
            int const chunk = dkv_col0 / 8 + 2 * j + matrix / 2;  // 8 columns
            stmatrix_x4(tile + (chunk / 8) * Tr::kPanelKBytes + stage_row * 128 + (((chunk % 8) ^ (stage_row % 8)) * 16),
                        Element::pack2(acc[8 * j] * scale, acc[8 * j + 1] * scale),
                        Element::pack2(acc[8 * j + 2] * scale, acc[8 * j + 3] * scale),
                        Element::pack2(acc[8 * j + 4] * scale, acc[8 * j + 5] * scale),
                        Element::pack2(acc[8 * j + 6] * scale, acc[8 * j + 7] * scale));
        }
    };
    stage(sK, acc_dk, params.softmax_scale);
    stage(sV, acc_dv, 1.f);
    named_barrier_sync(1, Tr::kConsumerThreads);  // the rows are in place
    T* dk_base = reinterpret_cast<T*>(params.dk_ptr) + bidb * params.dk_batch_stride + k_offset * params.dk_row_stride +
                 bidh_kv * params.dk_head_stride;
    T* dv_base = reinterpret_cast<T*>(params.dv_ptr) + bidb * params.dv_batch_stride + k_offset * params.dv_row_stride +
                 bidh_kv * params.dv_head_stride;
    // Of a row's columns this consumer holds (an uneven split's consumer 1: the chunks past its
    // share are past the instance's head dim, which the store's column check leaves out).
    constexpr int kChunks = (Tr::kQueryRows ? kHeadDim : Tr::kDKVWidth) / 8;
#pragma unroll
    for (int c = tid % 128; c < Tr::kConsumerKeys * kChunks; c += 128) {
        int const row = keys0 + c / kChunks, chunk = dkv_col0 / 8 + c % kChunks, key = key0 + row;
        // Columns past a call narrower than the instance are the TMA's zeros: not stored.
        if (key < seqlen_k && chunk * 8 < params.head_dim) {
            uint32_t const offset = (chunk / 8) * Tr::kPanelKBytes + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
            *reinterpret_cast<uint4*>(dk_base + key * params.dk_row_stride + chunk * 8) = ld_shared_v4(sK + offset);
            *reinterpret_cast<uint4*>(dv_base + key * params.dv_row_stride + chunk * 8) = ld_shared_v4(sV + offset);
        }
    }
    if (stamps) bwd_timeline_stamp(kStored);
}

}  // namespace flashgen
