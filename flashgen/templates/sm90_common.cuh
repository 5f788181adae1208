// What the sm90 kernels (Hopper, sm_90a) share: the TMA descriptor as a kernel parameter, mbarriers,
// TMA tensor loads, setmaxnreg, named barriers, and the wgmma fences and shared-memory descriptors.
#pragma once
#include "common.cuh"

namespace flashgen {

// cuda.h's CUtensorMap: 128 opaque bytes, 64-byte aligned, encoded on the host
// (cuTensorMapEncodeTiled) and passed inside the __grid_constant__ parameter.
struct alignas(64) TmaDescriptor {
    unsigned long long opaque[16];
};

// The CTA of both sm90 kernels: a producer warpgroup (warpgroup 0) and kConsumers consumer
// warpgroups (two, or three in a forward tile of 192 rows), and the registers per thread each keeps
// after setmaxnreg (tiles.Sm90FwdTile / Sm90BwdTile): the producer gives registers back to the pool
// the launch allocated (__launch_bounds__(kNThreads, 1)), the consumers take them.
template <int kProducerRegs_, int kConsumerRegs_, int kConsumers_ = 2>
struct Sm90Warpgroups {
    static constexpr int kConsumers = kConsumers_;
    static constexpr int kNThreads = 128 * (kConsumers + 1);
    static constexpr int kConsumerThreads = 128 * kConsumers;
    static constexpr int kProducerRegs = kProducerRegs_, kConsumerRegs = kConsumerRegs_;
    static_assert((kProducerRegs + kConsumers * kConsumerRegs) * 128 <= 65536 / kNThreads / 8 * 8 * kNThreads,
                  "setmaxnreg: the warpgroups' registers exceed what the launch allocated");
};

// ---- mbarriers (shared::cta, 8 bytes each)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives once and expects `bytes` more to land by TMA before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives once all of this thread's earlier cp.async copies have landed, without blocking it
// (.noinc: the arrival counts toward the count the barrier was initialized with).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with this parity has completed.
// (try_wait without a suspend-time hint: CUTLASS's 10 ms hint measured 1.00x in the backward and
// 0.99x in the forward, benchmarks/results/20261207-nvidia-h100-sm90-bwd-dropout-keep-bits.)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    }
}

// mbar_wait, then with kFence a proxy fence: shared memory written by cp.async (generic proxy)
// before the wgmma reads it (async proxy).
template <bool kFence>
__device__ __forceinline__ void mbar_wait_fenced(uint32_t bar, uint32_t parity) {
    mbar_wait(bar, parity);
    if constexpr (kFence) fence_proxy_async();
}

// ---- TMA: a 4-D box (columns, rows, head, batch) of a tensor map into shared memory, completing
// (transaction bytes) on an mbarrier.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TmaDescriptor* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// The same for a 5-D box (PackGQA's Q: columns, heads of the group, rows, KV head, batch). Not one
// 5-D load for every map: its extra coordinate register made the d256 producer (24 registers)
// spill in its per-block loop (NVRTC 13.0, local and softcap instances).
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const TmaDescriptor* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}

// ---- Registers moved between warpgroups (the kernel has a register cap: __launch_bounds__(n, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- Semaphores in global memory between CTAs (deterministic dQ order): an acquiring load and a
// releasing add at GPU scope, with proxy fences so that the TMA reductions ordered by them (async
// proxy) are ordered with the counter (generic proxy) too.
__device__ __forceinline__ void semaphore_wait_eq(const int* counter, int value) {
    int seen;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(__cvta_generic_to_global(counter)) : "memory");
    } while (seen != value);
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void semaphore_release_add(int* counter, int value) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(counter)), "r"(value) : "memory");
}

// ---- stmatrix (sm_90): four 8x8 b16 matrices from the MMA accumulator layout (register r of
// lane l: row l / 4, columns 2 (l % 4) and + 1 of matrix r); lane l supplies the address of row
// l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(smem_addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// The same, each matrix stored transposed: lane l's address takes column l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(smem_addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// ---- Named barriers (ids 1..15; __syncthreads is 0): `threads` in all wait here.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- wgmma: fence before an MMA batch that reads registers written since, commit a batch,
// wait until at most N batches are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across the asynchronous
// MMAs that use them (they are operands of the wgmma asm only while it is issued).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor with the 128-byte swizzle: start address, leading- and
// stride-dimension byte offsets (PTX ISA, "Matrix Descriptor Format"). K-major operands (Q, K):
// rows of 64 elements at 128 bytes, 8-row atoms `sbo` apart; the leading offset is unused.
// MN-major (V as P·V's B): 64 columns per row of 128 bytes, 8-row atoms `sbo` apart along K,
// 64-column panels `lbo` apart along N.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3ffff) >> 4) | (uint64_t((lbo >> 4) & 0x3fff) << 16) |
           (uint64_t((sbo >> 4) & 0x3fff) << 32) | (1ull << 62);
}

// The descriptor of the matrix `byte_offset` (a multiple of 16) past `desc`'s. The start-address
// field is the low 14 bits, addr >> 4 (shared memory is below 256 KB), so adding byte_offset >> 4
// moves it with no carry out of the field: the loops build each operand's descriptor once and move
// it per MMA by a constant. A 64-bit add: ptxas writes the wgmma's register pair with one
// UIADD3.64, where a 32-bit add of the low word also copied the high word into the pair
// (benchmarks/results/20261207-nvidia-h100-sm90-desc-add).
__device__ __forceinline__ uint64_t smem_desc_moved(uint64_t desc, uint32_t byte_offset) {
    return desc + (byte_offset >> 4);
}

}  // namespace flashgen
