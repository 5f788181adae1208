// Device building blocks shared by every kernel family: element types, fast division, and thin
// wrappers over the PTX instructions the kernels use (cp.async, ldmatrix, mma.sync, ex2).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace flashgen {

using int64_t = long long;
using uint32_t = unsigned int;
using uint64_t = unsigned long long;

// NVRTC has no <cmath>: spell infinity by its bit pattern.
#define kInfinity __int_as_float(0x7f800000)

// The attention mask of an instance (spec.py's mask): none, causal, or a local window.
enum class Mask { None, Causal, Local };

// ---------------------------------------------------------------------------------------------
// Element types. Each knows how to pack two floats into the 32-bit register an mma A/B operand
// takes, and which mma.sync variant multiplies it.
struct half_t {
    using storage = __half;
    static constexpr bool kIsBf16 = false;
    static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

struct bfloat16_t {
    using storage = __nv_bfloat16;
    static constexpr bool kIsBf16 = true;
    static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

// ---------------------------------------------------------------------------------------------
// Division by a run-time constant with one multiply-high (round-up method). Host side computes
// {divisor, multiplier, shift} in flashgen/generator/params.py:fast_divmod. Exact for 0 <= n < 2^31.
struct FastDivmod {
    int divisor;
    uint32_t multiplier;
    uint32_t shift;

    __device__ __forceinline__ int div(int n) const {
        return int((__umulhi(uint32_t(n), multiplier) + uint32_t(n)) >> shift);
    }
    __device__ __forceinline__ int divmod(int& remainder, int n) const {
        int q = div(n);
        remainder = n - q * divisor;
        return q;
    }
};

// ---------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies of 16 bytes. With src_bytes = 0 nothing is read and the
// 16 bytes are zero-filled: that is how out-of-range rows and head-dim columns are predicated.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return uint32_t(__cvta_generic_to_shared(ptr));
}

// .L2::128B: the L2 fetches whole 128-byte lines from DRAM (measured 1-2% faster decode on the H200).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
                 "r"(src_bytes));
}

// An L2 policy for data read once (decode's K/V stream): its lines are evicted first, so the lines
// that are read again (Q, the page table, split partials) stay. H200, decode K/V copies, cuDNN /
// flashgen (benchmarks/tune_decode.py --rounds 3, 20261130-nvidia-h200-decode-pairs/g_*): d128 b32 x
// 4k 0.993 -> 1.004, b1 x 32k 1.001 -> 1.016, b1 x 128k 1.010 -> 1.016; d64 b1 x 32k 0.977 -> 0.997.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));  // pure: hoisted
    return policy;
}

// cp_async_16 under an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid, uint64_t policy) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr),
                 "l"(gmem), "r"(src_bytes), "l"(policy));
}

// 4-byte variant (cp.async.ca: only .ca copies fewer than 16 bytes); zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
    int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// addr[0] += a, addr[1] += b (addr 8-byte aligned): one 8-byte reduction on sm_90, two 4-byte ones
// before.
__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_global(addr)), "f"(a), "f"(b)
                 : "memory");
#else
    atomicAdd(addr, a);
    atomicAdd(addr + 1, b);
#endif
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// The next five are sm_90's; on older targets they compile to nothing (the sm80-family backward
// that uses them asserts its target: BwdTraits::kDQTile).
// Orders this thread's view of shared memory written by generic-proxy stores (st.shared, cp.async)
// before its async-proxy reads of it (wgmma operands, TMA and bulk copies).
__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Bulk reduction (sm_90): the `bytes` (a multiple of 16) of fp32 values at shared address src added
// element-wise to global memory at dst (16-byte aligned), by the copy engine. Committed as a bulk
// group per thread; the thread then waits until its groups have read shared memory
// (bulk_wait_read: the source may be reused, or the CTA exit) or have completed (bulk_wait_all:
// their writes are visible, e.g. before a semaphore tells another CTA so).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(__cvta_generic_to_global(dst)), "r"(src), "r"(bytes) : "memory");
#endif
}
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
#else
__device__ __forceinline__ void bulk_commit() {}
__device__ __forceinline__ void bulk_wait_read() {}
__device__ __forceinline__ void bulk_wait_all() {}
#endif

// Programmatic dependent launch (sm_90; nothing on older targets). A kernel that the host
// launches as a dependent (LoadedKernel.launch_dependent) waits for the previous kernel on the
// stream, and for its memory, with grid_dependency_wait; a kernel signals with
// allow_dependent_launch that such a successor's CTAs may already be scheduled.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 b16 matrices; lane l supplies the address of row (l % 8) of matrix (l / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

// ---------------------------------------------------------------------------------------------
// D = A * B + D with A 16x16 (row), B 16x8 (col), fp32 accumulators.
template <typename Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bfloat16_t>(float (&d)[4], const uint32_t (&a)[4],
                                                      uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Fast math with known error: ex2.approx has ~2 ulp relative error, enough for softmax.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): two fast MUFU ops, absolute error ~1e-7 over the whole range
// (tanh.approx.f32 would be one op but has ~5e-4 error, visible after multiplying by softcap).
__device__ __forceinline__ float tanh_accurate(float x) {
    float e = exp2_approx(x * 2.8853900817779268f);  // 2 * log2(e)
    return 1.f - __fdividef(2.f, e + 1.f);
}

// ---------------------------------------------------------------------------------------------
// Score modifiers and masks, shared by the forward families (bottom-right aligned, as
// dispatch.resolve_mask): query position i sees key j < seqlen_k iff
// i + diag - window_left <= j <= i + diag + window_right, diag = seqlen_k - seqlen_q (causal: right 0).

// The scores softcap * tanh(s * softmax_scale / softcap) of raw scores s.
__device__ __forceinline__ float softcap_score(float s, float softcap, float softcap_scale) {
    return softcap * tanh_accurate(s * softcap_scale);
}

// ALiBi: the score minus slope * |i + diag - j| (shifted_row = i + diag), or given that distance as
// a float (exact below 2^24), which lets a caller step it by constants: one add and one FMA a score.
__device__ __forceinline__ float alibi_score(float s, float slope, float distance) { return s - slope * fabsf(distance); }

// A row's logsumexp (natural log) from its running maximum (in score units) and its sum of
// exp2(score * scale_log2 - max * scale_log2); -inf for a row that saw no key (sum 0).
__device__ __forceinline__ float row_lse(float row_max, float sum, float scale_log2) {
    return sum > 0.f ? (row_max * scale_log2 + __log2f(sum)) * 0.6931471805599453f : -kInfinity;
}
__device__ __forceinline__ float alibi_score(float s, float slope, int shifted_row, int key) {
    return alibi_score(s, slope, float(shifted_row - key));
}

// Whether key `key` is hidden from the row at shifted_row = i + diag.
template <Mask kMask>
__device__ __forceinline__ bool key_hidden(int key, int shifted_row, int seqlen_k, int window_left, int window_right) {
    bool hidden = key >= seqlen_k;
    if constexpr (kMask != Mask::None) hidden |= key > shifted_row + window_right;
    if constexpr (kMask == Mask::Local) hidden |= key < shifted_row - window_left;
    return hidden;
}

// The key blocks (of block_n keys) that query positions m_first..m_last visit, [begin, end), and
// those that need the element mask besides the last, partial one: blocks >= mask_right_begin
// cross the right (causal) edge, blocks < mask_left_end the window's left edge.
struct KeyBlocks {
    int begin, end, mask_left_end, mask_right_begin;
};
template <Mask kMask>
__device__ __forceinline__ KeyBlocks key_blocks(int m_first, int m_last, int diag, int seqlen_k, int block_n,
                                                int window_left, int window_right) {
    KeyBlocks blocks;
    blocks.begin = 0;
    blocks.end = (seqlen_k + block_n - 1) / block_n;
    blocks.mask_left_end = 0;
    blocks.mask_right_begin = blocks.end;
    if constexpr (kMask != Mask::None) {
        int const right_end = m_last + diag + window_right + 1;  // exclusive key bound of the last row
        blocks.end = min(blocks.end, right_end <= 0 ? 0 : (right_end + block_n - 1) / block_n);
        int const right_full = m_first + diag + window_right + 1;
        blocks.mask_right_begin = right_full <= 0 ? 0 : right_full / block_n;
        if constexpr (kMask == Mask::Local) {
            int const left_first = m_first + diag - window_left;  // first visible key of the first row
            blocks.begin = left_first <= 0 ? 0 : left_first / block_n;
            int const left_last = m_last + diag - window_left;
            blocks.mask_left_end = left_last <= 0 ? 0 : (left_last + block_n - 1) / block_n;
        }
    }
    return blocks;
}

template <int kWidth>
__device__ __forceinline__ float quad_allreduce_max(float x) {
#pragma unroll
    for (int offset = 1; offset < kWidth; offset *= 2) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
    }
    return x;
}

template <int kWidth>
__device__ __forceinline__ float quad_allreduce_sum(float x) {
#pragma unroll
    for (int offset = 1; offset < kWidth; offset *= 2) {
        x += __shfl_xor_sync(0xffffffff, x, offset);
    }
    return x;
}

// ---------------------------------------------------------------------------------------------
// Dropout: Philox4x32 (Salmon et al., SC'11) of kPhiloxRounds rounds, a counter-based RNG, so the
// backward regenerates the forward's mask from (seed, offset) and each element's coordinates
// alone, in any layout.
// Element (query i, key j) of (batch b, query head h) keeps its probability iff byte 2 n + e of
// word c of philox(counter = {4 g + q, i, b * nheads + h, offset_lo}, key = {seed_lo ^ offset_hi *
// 0x9E3779B9, seed_hi ^ kDropoutDomain}) is below keep_threshold = round((1 - p) * 256), where
// j = 64 g + 16 c + 8 n + 2 q + e (e < 2, q < 4, n < 2, c < 4); kept ones are scaled by 256 /
// keep_threshold (rp_dropout), so the expected output is the undropped one. One Philox block is
// thus the 16 keys of a 64-key group that lane q % 4 of an m16n8 accumulator quad holds for one
// query (keys 2 q, 2 q + 1 of each n8 tile): the forward draws each block once, where a block per
// 16 consecutive keys was drawn by all four lanes of the quad. The key's domain constant keeps these streams
// apart from those PyTorch draws from the same generator. flashgen.testing.dropout_keep_mask is
// the same function in PyTorch, for the tests.
constexpr uint32_t kDropoutDomain = 0x666c6773u;  // "flgs"

// Seven rounds, as FlashAttention 2 and Composable Kernel draw their dropout masks (Random123
// recommends ten for a safety margin; seven cost 0.7x the instructions, and the backward draws
// every mask again). flashgen.testing.DROPOUT_PHILOX_ROUNDS is the same number.
constexpr int kPhiloxRounds = 7;

template <int kRounds>
__device__ __forceinline__ uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
        uint32_t const hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        uint32_t const hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

struct Dropout {
    uint32_t key0, key1, offset, threshold;  // threshold 256: keep everything

    // Key: the seed's two words, the offset's high word mixed into the first (so offsets past
    // 2**32 draw new masks), the second xored with kDropoutDomain.
    template <typename Params>
    __device__ __forceinline__ static Dropout from(const Params& p) {
        uint32_t const offset_hi = uint32_t(uint64_t(p.philox_offset) >> 32);
        return {uint32_t(p.philox_seed) ^ (offset_hi * 0x9E3779B9u),
                uint32_t(uint64_t(p.philox_seed) >> 32) ^ kDropoutDomain, uint32_t(p.philox_offset),
                p.dropout_threshold};
    }
    // The 16 random bytes of (head bh = b * nheads + h, query, 64-key group, quad lane q): word c,
    // byte 2 n + e is key 64 group + 16 c + 8 n + 2 q + e.
    __device__ __forceinline__ uint4 block(uint32_t bh, int query, int group, int quad) const {
        return philox4x32<kPhiloxRounds>(make_uint4(uint32_t(4 * group + quad), uint32_t(query), bh, offset), key0, key1);
    }
    __device__ __forceinline__ static uint32_t word(uint4 bytes, int c) {
        return c == 0 ? bytes.x : c == 1 ? bytes.y : c == 2 ? bytes.z : bytes.w;
    }
    __device__ __forceinline__ bool keep(uint32_t word, int byte) const {
        return ((word >> (8 * byte)) & 0xffu) < threshold;
    }
    // The four keep decisions of a word at once: bit 8 b of the result is byte b's (byte < threshold,
    // i.e. byte <= threshold - 1, compared per byte without borrows between them). below:
    // threshold - 1 in every byte; below_or_h: that OR 0x80808080; low_bits: 0x01010101, or 0 when
    // the threshold is 0 (nothing kept).
    struct KeepBytes {
        uint32_t below, below_or_h, low_bits;
    };
    __device__ __forceinline__ KeepBytes keep_bytes() const {
        uint32_t const below = threshold == 0 ? 0u : (min(threshold, 256u) - 1u) * 0x01010101u;
        return {below, below | 0x80808080u, threshold == 0 ? 0u : 0x01010101u};
    }
    __device__ __forceinline__ static uint32_t kept_bits(uint32_t word, KeepBytes k) {
        // Per byte, bit 7 of (below | 0x80) - (word & 0x7f) is (below & 0x7f) >= (word & 0x7f); with
        // the high bits: below >= word iff below's is set and word's not, or they are equal and the
        // low seven compare so.
        uint32_t const low_ge = k.below_or_h - (word & 0x7f7f7f7fu);
        uint32_t const ge = (k.below & ~word) | (~(k.below ^ word) & low_ge);
        return (ge >> 7) & k.low_bits;
    }
    // One query row's keys as a thread of an m16n8 accumulator quad holds them (lane % 4 = q: keys
    // 16 c + 8 n + 2 q + e of each 16-key chunk c): drop(c, n, e) for each dropped one, over
    // kChunks chunks from chunk first_chunk (kAligned: first_chunk is a multiple of 4).
    template <int kChunks, bool kAligned, typename Drop>
    __device__ __forceinline__ void drop_row(uint32_t bh, int query, int first_chunk, int quad, Drop&& drop) const {
        uint4 bytes = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            int const chunk = first_chunk + c;
            int const c_in_group = kAligned ? c % 4 : chunk % 4;
            if (kAligned ? c % 4 == 0 : (c == 0 || c_in_group == 0)) bytes = block(bh, query, chunk / 4, quad);
            uint32_t const w = word(bytes, c_in_group);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (!keep(w, 2 * n + e)) drop(c, n, e);
        }
    }
};

}  // namespace flashgen
