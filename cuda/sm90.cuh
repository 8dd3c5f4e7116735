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

// One plain arrival (a consumer releasing a buffer).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
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

// ---- Shared-memory stores by 32-bit shared address (smem_addr): one register per address
// where a generic pointer takes two, for kernels at the register limit.
__device__ __forceinline__ void st_shared(u32 addr, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared(u32 addr, float a, float b, float c, float d) {   // 16-byte aligned
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Orders this thread's accesses to memory of every state space with the copy engine's (the
// async proxy's).
__device__ __forceinline__ void fence_proxy_async_all() { asm volatile("fence.proxy.async;" ::: "memory"); }

// ---- Named barriers (ids 1..15; __syncthreads is 0): `threads` in all, some of which only
// arrive. Two warpgroups take turns with them.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync that also ORs pred over the `threads` taking part: true where any thread's is.
__device__ __forceinline__ bool named_bar_any(int id, int threads, bool pred) {
    u32 any;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(any) : "r"(static_cast<u32>(pred)), "r"(id), "r"(threads) : "memory");
    return any != 0;
}

// ---- Register reallocation between the warpgroups of a block (every thread of the warpgroup
// executes it): a copy-issuing warpgroup gives registers back, the multiplying ones take them.
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs));
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

// A box of shared memory (in the tensor map's swizzled layout) to the tensor at element
// coordinates; elements outside the tensor are not written. Completes in bulk groups.
__device__ __forceinline__ void tma_store_4d(const TmaDesc& map, int c0, int c1, int c2, int c3, const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                 "r"(smem_addr(src))
                 : "memory");
}
// Adds `bytes` (a multiple of 16) of fp32 shared memory at src into global memory at dst
// (16-byte aligned), element by element, as one bulk operation of the copy engine.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(reinterpret_cast<unsigned long long>(dst)), "r"(smem_addr(src)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's bulk groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are incomplete.
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Makes this thread's shared-memory writes visible to the copy engine (a store reading them).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- wgmma: one warpgroup (four consecutive warps, the first a multiple of 4) multiplies.

// The descriptor of a 128-byte-swizzled tile at `tile` (1024-byte aligned) plus `offset` bytes
// (K-major: a k16 step of 16-bit data is 32 bytes inside the rows; MN-major: 16 rows, 2048
// bytes). 1024 bytes from one 8-row group to the next. The leading offset is used only by
// MN-major operands wider than one swizzle atom (N > 64): `atoms_apart` bytes from one atom's 64
// columns to the next's. Operands one atom wide ignore it (16, the minimum).
// Shared addresses stay below 2^18, so the start (16-byte units) fits its 14 bits and is added,
// not masked, and the descriptors of one tile differ by an immediate (masking the start made
// every descriptor a chain of its own: ~5 uniform instructions per wgmma). The low word (start,
// leading offset) and the high word (stride, swizzle) are Joined, not added: from a 64-bit add
// ptxas made a carry from one into the other, three uniform instructions per tile. (The
// forward at head dim 128 adds them: joined, its loop had 13 instructions fewer but ran 1%
// slower; benchmarks/NOTES.md.)
template <bool Joined = true>
__device__ __forceinline__ unsigned long long sw128_desc(const void* tile, unsigned offset, unsigned atoms_apart = 16) {
    constexpr unsigned long long stride = 1024 >> 4, swizzle128 = 1, hi = stride << 32 | swizzle128 << 62;
    if constexpr (Joined) {
        const unsigned lo = ((atoms_apart >> 4) << 16) + (smem_addr(tile) >> 4);
        return (hi | lo) + (offset >> 4);
    }
    return (hi | static_cast<unsigned long long>(atoms_apart >> 4) << 16) + (smem_addr(tile) >> 4) + (offset >> 4);
}

// The descriptor of a tile without swizzle whose 8 x 16-byte core matrices lie 128 bytes
// apart in both directions: for an operand whose every element is the same (all ones), where
// only which bytes are read matters, all of them within its first 256 bytes.
__device__ __forceinline__ unsigned long long plain_desc(const void* tile) {
    constexpr unsigned long long apart = 128 >> 4;
    return apart << 32 | apart << 16 | (smem_addr(tile) >> 4);
}

// Orders this thread's register and shared-memory accesses before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The accumulator registers of m64nNk16 (N / 2 floats per thread), as asm operand lists.
#define CUPYFLASH_WGMMA_D4 "{%0, %1, %2, %3}"
#define CUPYFLASH_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUPYFLASH_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUPYFLASH_WGMMA_D40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define CUPYFLASH_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define CUPYFLASH_WGMMA_D96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define CUPYFLASH_WGMMA_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// Eight accumulators from d[o], then the lists of m64nN's N / 2.
#define CUPYFLASH_WGMMA_OUT8(o) \
    "+f"(d[(o) + 0]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]), \
    "+f"(d[(o) + 5]), "+f"(d[(o) + 6]), "+f"(d[(o) + 7])
#define CUPYFLASH_WGMMA_OUT4 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define CUPYFLASH_WGMMA_OUT16 CUPYFLASH_WGMMA_OUT8(0), CUPYFLASH_WGMMA_OUT8(8)
#define CUPYFLASH_WGMMA_OUT32 CUPYFLASH_WGMMA_OUT16, CUPYFLASH_WGMMA_OUT8(16), CUPYFLASH_WGMMA_OUT8(24)
#define CUPYFLASH_WGMMA_OUT40 CUPYFLASH_WGMMA_OUT32, CUPYFLASH_WGMMA_OUT8(32)
#define CUPYFLASH_WGMMA_OUT64 \
    CUPYFLASH_WGMMA_OUT40, CUPYFLASH_WGMMA_OUT8(40), CUPYFLASH_WGMMA_OUT8(48), CUPYFLASH_WGMMA_OUT8(56)
#define CUPYFLASH_WGMMA_OUT96                                                                      \
    CUPYFLASH_WGMMA_OUT64, CUPYFLASH_WGMMA_OUT8(64), CUPYFLASH_WGMMA_OUT8(72), CUPYFLASH_WGMMA_OUT8(80), \
        CUPYFLASH_WGMMA_OUT8(88)
#define CUPYFLASH_WGMMA_OUT128                                                                      \
    CUPYFLASH_WGMMA_OUT96, CUPYFLASH_WGMMA_OUT8(96), CUPYFLASH_WGMMA_OUT8(104), CUPYFLASH_WGMMA_OUT8(112), \
        CUPYFLASH_WGMMA_OUT8(120)

// After wgmma_wait: the accumulators count as written here, so that the compiler neither
// reads them earlier nor holds them across the asynchronous multiply.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[N / 2] (+)= A (64 x 16, K-major descriptor) B^T (B: N x 16, K-major descriptor), N = 32, 64,
// 80 or 128 by the size of d, bf16 or fp16 operands, fp32 accumulators laid out as mma.sync's over
// N / 8 n8 tiles: warp w of the warpgroup holds rows 16w + g and 16w + g + 8, register 4j +
// (0, 1) row 16w + g, columns 8j + 2t + (0, 1), register 4j + (2, 3) the same columns of row
// 16w + g + 8.
template <typename Elem, int D>
__device__ __forceinline__ void wgmma_ss(float (&d)[D], unsigned long long a, unsigned long long b,
                                         bool accumulate);

// d[D] (+)= A B with A (64 x 16) in registers, in mma.sync's A-fragment layout per warp (warp w
// holds rows 16w..16w+15: a[0] row g, columns 2t, 2t+1; a[1] row g + 8; a[2] and a[3] the same
// rows, columns + 8; 16-bit pairs), and B (16 x 2D) MN-major in shared memory (row k holds the
// N-elements of K index k: the layout the copy engine gives V, 64 columns per atom), `b` its
// descriptor; N = 8, 64, 128, 192 or 256 by the size of d.
template <typename Elem, int D>
__device__ __forceinline__ void wgmma_rs(float (&d)[D], const u32 (&a)[4], unsigned long long b, bool accumulate);

// One wgmma m64nNk16 with both operands in shared memory; TRANS: the transpose flags of A and
// B (0: K-major, 1: MN-major).
#define CUPYFLASH_WGMMA_SS(N, TYPE, D, OUT, A, B, ACC, TRANS)                                                   \
    asm volatile("{\n\t.reg .pred acc;\n\tsetp.ne.b32 acc, %" ACC ", 0;\n\t"                                  \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D ", %" A ", %" B         \
                 ", acc, 1, 1, " TRANS ";\n\t}"                                                               \
                 : OUT                                                                                           \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
// FN's bf16 and fp16 specializations for accumulators of DN floats (m64nN); A, B and ACC: the
// asm operand numbers of a, b and accumulate (DN, DN + 1, DN + 2).
#define CUPYFLASH_WGMMA_SS_PAIR(FN, DN, N, A, B, ACC, TRANS)                                                    \
    template <>                                                                                                  \
    __device__ __forceinline__ void FN<bf16, DN>(float (&d)[DN], unsigned long long a, unsigned long long b,    \
                                                 bool accumulate) {                                              \
        CUPYFLASH_WGMMA_SS(N, "bf16", CUPYFLASH_WGMMA_D##DN, CUPYFLASH_WGMMA_OUT##DN, A, B, ACC, TRANS);        \
    }                                                                                                            \
    template <>                                                                                                  \
    __device__ __forceinline__ void FN<fp16, DN>(float (&d)[DN], unsigned long long a, unsigned long long b,    \
                                                 bool accumulate) {                                              \
        CUPYFLASH_WGMMA_SS(N, "f16", CUPYFLASH_WGMMA_D##DN, CUPYFLASH_WGMMA_OUT##DN, A, B, ACC, TRANS);         \
    }
// One wgmma m64nNk16 with A from registers (operands A0..A3 after the DN accumulators), B
// MN-major.
#define CUPYFLASH_WGMMA_RS(N, TYPE, D, OUT, A0, A1, A2, A3, B, ACC)                                             \
    asm volatile("{\n\t.reg .pred acc;\n\tsetp.ne.b32 acc, %" ACC ", 0;\n\t"                                  \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " D ", {%" A0 ", %" A1      \
                 ", %" A2 ", %" A3 "}, %" B ", acc, 1, 1, 1;\n\t}"                                              \
                 : OUT                                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
#define CUPYFLASH_WGMMA_RS_PAIR(DN, N, A0, A1, A2, A3, B, ACC)                                                  \
    template <>                                                                                                  \
    __device__ __forceinline__ void wgmma_rs<bf16, DN>(float (&d)[DN], const u32 (&a)[4], unsigned long long b, \
                                                       bool accumulate) {                                        \
        CUPYFLASH_WGMMA_RS(N, "bf16", CUPYFLASH_WGMMA_D##DN, CUPYFLASH_WGMMA_OUT##DN, A0, A1, A2, A3, B, ACC);  \
    }                                                                                                            \
    template <>                                                                                                  \
    __device__ __forceinline__ void wgmma_rs<fp16, DN>(float (&d)[DN], const u32 (&a)[4], unsigned long long b, \
                                                       bool accumulate) {                                        \
        CUPYFLASH_WGMMA_RS(N, "f16", CUPYFLASH_WGMMA_D##DN, CUPYFLASH_WGMMA_OUT##DN, A0, A1, A2, A3, B, ACC);   \
    }

CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss, 16, 32, "16", "17", "18", "0, 0")
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss, 32, 64, "32", "33", "34", "0, 0")
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss, 40, 80, "40", "41", "42", "0, 0")
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss, 64, 128, "64", "65", "66", "0, 0")
// d[32] (+)= A B with both operands MN-major in shared memory (128-byte swizzle, 16 K-rows =
// 2048 bytes): A (64 x 16) stored as rows of K holding the 64 M-elements (a transposed tile:
// dS^T for dQ = dS K), B (16 x 64) as for wgmma_rs.
template <typename Elem, int D>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[D], unsigned long long a, unsigned long long b,
                                            bool accumulate);
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss_tt, 32, 64, "32", "33", "34", "1, 1")
// d[40] (+)= A B with A (64 x 16) MN-major, as for wgmma_ss_tt, and B (16 x 80) K-major, as for
// wgmma_ss: dQ^T = K^T dS^T from K's tile and dS stored with the keys along its rows.
template <typename Elem, int D>
__device__ __forceinline__ void wgmma_ss_tn(float (&d)[D], unsigned long long a, unsigned long long b,
                                            bool accumulate);
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss_tn, 40, 80, "40", "41", "42", "1, 0")
// d[64] (+)= A B with A (64 x 16) K-major in shared memory, as for wgmma_ss, and B (16 x 128)
// MN-major, as for wgmma_rs: P^T dO and dS^T Q from shared memory, for a warpgroup that holds
// neither operand in registers.
template <typename Elem, int D>
__device__ __forceinline__ void wgmma_ss_bt(float (&d)[D], unsigned long long a, unsigned long long b,
                                            bool accumulate);
CUPYFLASH_WGMMA_SS_PAIR(wgmma_ss_bt, 64, 128, "64", "65", "66", "0, 1")

CUPYFLASH_WGMMA_RS_PAIR(4, 8, "4", "5", "6", "7", "8", "9")
CUPYFLASH_WGMMA_RS_PAIR(32, 64, "32", "33", "34", "35", "36", "37")
CUPYFLASH_WGMMA_RS_PAIR(64, 128, "64", "65", "66", "67", "68", "69")
CUPYFLASH_WGMMA_RS_PAIR(96, 192, "96", "97", "98", "99", "100", "101")
CUPYFLASH_WGMMA_RS_PAIR(128, 256, "128", "129", "130", "131", "132", "133")
#undef CUPYFLASH_WGMMA_SS
#undef CUPYFLASH_WGMMA_SS_PAIR
#undef CUPYFLASH_WGMMA_RS
#undef CUPYFLASH_WGMMA_RS_PAIR
#undef CUPYFLASH_WGMMA_D4
#undef CUPYFLASH_WGMMA_D16
#undef CUPYFLASH_WGMMA_D32
#undef CUPYFLASH_WGMMA_D40
#undef CUPYFLASH_WGMMA_D64
#undef CUPYFLASH_WGMMA_D96
#undef CUPYFLASH_WGMMA_D128
#undef CUPYFLASH_WGMMA_OUT4
#undef CUPYFLASH_WGMMA_OUT8
#undef CUPYFLASH_WGMMA_OUT16
#undef CUPYFLASH_WGMMA_OUT32
#undef CUPYFLASH_WGMMA_OUT40
#undef CUPYFLASH_WGMMA_OUT64
#undef CUPYFLASH_WGMMA_OUT96
#undef CUPYFLASH_WGMMA_OUT128
