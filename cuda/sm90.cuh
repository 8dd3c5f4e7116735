// Hopper's own units, for the sm_90a kernel family: the bulk tensor copy engine (TMA) landing
// tiles in shared memory and signalling an mbarrier, and warpgroup matrix multiplies (wgmma)
// reading their operands from shared memory through matrix descriptors. PTX wrappers only: the
// kernels compose them with the pipeline's pieces (seqinfo, mask, score_mod, softmax, epilogue).
//
// Shared-memory tiles here are K-major with the 128-byte swizzle: rows of 64 16-bit elements
// (128 bytes), whose eight 16-byte chunks are permuted by the row's index mod 8, eight rows to a
// 1024-byte atom. The copy engine writes that layout when its tensor map asks for
// CU_TENSOR_MAP_SWIZZLE_128B (cupyflash/_tma.py), and a descriptor with swizzle mode 1, stride
// 1024 bytes between 8-row groups, reads it. Tiles start at 1024-byte boundaries.
#pragma once
#include "common.cuh"

// The driver's CUtensorMap: 128 opaque bytes, made on the host (cupyflash/_tma.py) and passed
// in a __grid_constant__ kernel parameter so that its address lies in parameter space.
struct alignas(64) TmaDesc {
    unsigned long long words[16];
};

// ---- mbarriers: a transaction count of bytes, and a phase bit that flips when it completes.

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals));
}

// Makes initialised mbarriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` more to come from the copy engine.
__device__ __forceinline__ void mbar_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Waits until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned phase) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "wait_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra wait_%=;\n\t}" ::"r"(smem_addr(bar)),
        "r"(phase)
        : "memory");
}

// ---- TMA: a box of the tensor map's tensor at element coordinates (innermost first) to
// shared memory, completing on `bar`. Elements outside the tensor arrive as zeros.

__device__ __forceinline__ void tma_load_4d(void* dst, const TmaDesc& map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(smem_addr(bar))
        : "memory");
}

// ---- wgmma: one warpgroup (four consecutive warps, the first a multiple of 4) multiplies.

// The descriptor of a 128-byte-swizzled tile at `tile` (1024-byte aligned) plus `offset` bytes
// (K-major: a k16 step of 16-bit data is 32 bytes inside the rows; MN-major: 16 rows, 2048
// bytes). 1024 bytes from one 8-row group to the next; the leading offset is unused by
// operands one swizzle atom wide (every n64 / k16 operand here), so it is the minimum, 16.
__device__ __forceinline__ unsigned long long sw128_desc(const void* tile, unsigned offset) {
    const unsigned long long start = (smem_addr(tile) + offset) >> 4;
    constexpr unsigned long long lead = 16 >> 4, stride = 1024 >> 4, swizzle128 = 1;
    return (start & 0x3FFF) | lead << 16 | stride << 32 | swizzle128 << 62;
}

// Orders this thread's register and shared-memory accesses before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// d[32] (+)= A (64 x 16, K-major descriptor) B^T (B: 64 x 16, K-major descriptor), bf16 or fp16
// operands, fp32 accumulators laid out as mma.sync's over eight n8 tiles: warp w of the
// warpgroup holds rows 16w + g and 16w + g + 8, register 4j + (0, 1) row 16w + g, columns 8j +
// 2t + (0, 1), register 4j + (2, 3) the same columns of row 16w + g + 8.
template <typename Elem>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long a, unsigned long long b,
                                                bool accumulate);

#define CUPYFLASH_WGMMA_M64N64K16(TYPE)                                                                          \
    asm volatile("{\n\t.reg .pred acc;\n\tsetp.ne.b32 acc, %34, 0;\n\t"                                      \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                               \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "            \
                 "%32, %33, acc, 1, 1, 0, 0;\n\t}"                                                               \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),          \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),      \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),   \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),   \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                           \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))

template <>
__device__ __forceinline__ void wgmma_m64n64k16<bf16>(float (&d)[32], unsigned long long a, unsigned long long b,
                                                      bool accumulate) {
    CUPYFLASH_WGMMA_M64N64K16("bf16");
}
template <>
__device__ __forceinline__ void wgmma_m64n64k16<fp16>(float (&d)[32], unsigned long long a, unsigned long long b,
                                                      bool accumulate) {
    CUPYFLASH_WGMMA_M64N64K16("f16");
}
#undef CUPYFLASH_WGMMA_M64N64K16

// d[32] (+)= A B with A (64 x 16) in registers, in mma.sync's A-fragment layout per warp (warp w
// holds rows 16w..16w+15: a[0] row g, columns 2t, 2t+1; a[1] row g + 8; a[2] and a[3] the same
// rows, columns + 8; 16-bit pairs), and B (16 x 64) MN-major in shared memory (row k holds the
// 64 N-elements of K index k: the layout the copy engine gives V), `b` its descriptor.
template <typename Elem>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], unsigned long long b,
                                                   bool accumulate);

#define CUPYFLASH_WGMMA_M64N64K16_RS(TYPE)                                                                       \
    asm volatile("{\n\t.reg .pred acc;\n\tsetp.ne.b32 acc, %37, 0;\n\t"                                      \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                               \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "            \
                 "{%32, %33, %34, %35}, %36, acc, 1, 1, 1;\n\t}"                                                \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),          \
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),      \
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),   \
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),   \
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))

template <>
__device__ __forceinline__ void wgmma_m64n64k16_rs<bf16>(float (&d)[32], const u32 (&a)[4], unsigned long long b,
                                                         bool accumulate) {
    CUPYFLASH_WGMMA_M64N64K16_RS("bf16");
}
template <>
__device__ __forceinline__ void wgmma_m64n64k16_rs<fp16>(float (&d)[32], const u32 (&a)[4], unsigned long long b,
                                                         bool accumulate) {
    CUPYFLASH_WGMMA_M64N64K16_RS("f16");
}
#undef CUPYFLASH_WGMMA_M64N64K16_RS
