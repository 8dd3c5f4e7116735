// Element types, and thin wrappers over the PTX instructions the tensor-core kernels use:
// ldmatrix, mma.sync m16n8k16, cp.async, ex2.approx. No CUDA headers are needed, so the
// sources compile through NVRTC with no include path.
#pragma once
#include "params.cuh"

typedef unsigned short u16;
typedef unsigned int u32;

// Tags for the 16-bit element types; tensors of them are handled as raw u16.
struct fp16 {};
struct bf16 {};
template <typename A, typename B> constexpr bool same_type = false;
template <typename A> constexpr bool same_type<A, A> = true;

constexpr float LOG2E = 1.4426950408889634f;
constexpr int SMEM_PAD = 8;   // 16 bytes per smem row: rows start 4 banks apart (mirrors _config.SMEM_PAD)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Two floats to a packed pair of 16-bit values, `lo` in the low half (PTX puts its first
// source operand in the upper half).
template <typename Elem> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<fp16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// An mma accumulator's share of a 16-row tile (v[0], v[1]: row r, columns c and c+1; v[2],
// v[3]: row r + 8), times `scale`, as two 16-bit pairs into a row-major tile of stride ld.
template <typename Elem>
__device__ __forceinline__ void store_acc_pairs(u16* tile, int ld, int r, int c, const float (&v)[4],
                                                float scale = 1.f) {
    *reinterpret_cast<u32*>(tile + r * ld + c) = pack2<Elem>(v[0] * scale, v[1] * scale);
    *reinterpret_cast<u32*>(tile + (r + 8) * ld + c) = pack2<Elem>(v[2] * scale, v[3] * scale);
}

template <typename Elem> __device__ __forceinline__ u16 from_float(float x) {
    return static_cast<u16>(pack2<Elem>(x, 0.f) & 0xffffu);
}

// Loads of one element as float (16-bit types) or in its own precision.
template <typename Elem> struct ElemTraits;
template <> struct ElemTraits<fp16> {
    typedef u16 storage; typedef float acc;
    static __device__ __forceinline__ float load(const u16* p) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p)); return f;
    }
    static __device__ __forceinline__ void store(u16* p, float x) { *p = from_float<fp16>(x); }
};
template <> struct ElemTraits<bf16> {
    typedef u16 storage; typedef float acc;
    static __device__ __forceinline__ float load(const u16* p) {
        return __uint_as_float(static_cast<u32>(*p) << 16);
    }
    static __device__ __forceinline__ void store(u16* p, float x) { *p = from_float<bf16>(x); }
};
template <> struct ElemTraits<float> {
    typedef float storage; typedef float acc;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float x) { *p = x; }
};
template <> struct ElemTraits<double> {
    typedef double storage; typedef double acc;
    static __device__ __forceinline__ double load(const double* p) { return *p; }
    static __device__ __forceinline__ void store(double* p, double x) { *p = x; }
};

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// This thread's warp index, known to the compiler to be the same across the warp (a shuffle
// from lane 0): what is derived from it (wgmma descriptors, stage addresses) can then live in
// uniform registers instead of being moved there before every use.
__device__ __forceinline__ int warp_uniform() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// --- ldmatrix: four (or two) 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses
// of matrix i. Register i then holds, in each lane, row lane/4, columns 2*(lane%4)+{0,1}
// of matrix i (transposed with .trans).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// --- stmatrix (sm_90): the inverse of ldmatrix_x4, register i of each lane into matrix i,
// lanes 8i..8i+7 giving the row addresses of matrix i.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// The same with each matrix stored transposed: lanes 8i..8i+7 give the addresses of matrix i's
// columns, each column's 8 elements (the 8 lanes' rows) 16 contiguous bytes there.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// --- mma.sync m16n8k16, fp32 accumulators: c += a * b.
template <typename Elem> __device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma_16816<fp16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// --- cp.async: 16 bytes global -> shared, bypassing L1 (and asking L2 for the whole 128-byte
// line); src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// The same under an L2 eviction policy (createpolicy's).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;"
                 :: "r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
}
// Every line evicted first: for a stream read once that outsizes the L2 (benchmarks/NOTES.md).
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
// 4 bytes (lse and D rows), through L1; src_bytes 0 writes a zero.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// Quad reductions: the four lanes holding one row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// --- Tiles of a (batch, seq, head, dim) tensor in shared memory: Rows x HeadDim 16-bit
// elements, row stride HeadDim + SMEM_PAD, moved in 16-byte chunks by the Threads threads of
// the block, or (Threads = 32) by one warp's lanes.
template <int Threads>
__device__ __forceinline__ unsigned chunk_thread() { return Threads == 32 ? threadIdx.x % 32 : threadIdx.x; }

// How a tile's chunks are copied: cp.async, plain or under an L2 eviction policy.
struct PlainCopy {
    __device__ __forceinline__ void operator()(u32 dst, const void* src, int bytes) const { cp_async_16(dst, src, bytes); }
};
struct PolicyCopy {
    unsigned long long policy;
    __device__ __forceinline__ void operator()(u32 dst, const void* src, int bytes) const { cp_async_16(dst, src, bytes, policy); }
};

// Calls f(r, col) for each chunk (row r, first column col) this thread moves. Where the
// block's threads cover whole rows, the loop is unrolled with the thread's column fixed and
// its rows a constant apart: a few instructions per chunk, not a division and a loop.
template <int Rows, int HeadDim, int Threads, typename F>
__device__ __forceinline__ void for_each_chunk(F&& f) {
    constexpr int CHUNKS = HeadDim / 8;
    if constexpr (Threads % CHUNKS == 0) {
        constexpr int STEP = Threads / CHUNKS;   // rows covered by one pass of the block
        const int r0 = chunk_thread<Threads>() / CHUNKS, col = chunk_thread<Threads>() % CHUNKS * 8;
#pragma unroll
        for (int i = 0; i < (Rows + STEP - 1) / STEP; ++i)
            if (Rows % STEP == 0 || r0 + i * STEP < Rows) f(r0 + i * STEP, col);
    } else {
        // Head dims whose chunk count does not divide the block (96, 160, 192, 224): a plain
        // loop, since unrolling it costs registers the big head dims do not have.
#pragma unroll 1
        for (int c = chunk_thread<Threads>(); c < Rows * CHUNKS; c += Threads) f(c / CHUNKS, c % CHUNKS * 8);
    }
}

// Row r of the tile is tensor row row0 + r (gbase points at it); rows at or past `rows_valid`
// and columns at or past `d` are zero-filled, so the math on them is harmless.
template <int Rows, int HeadDim, int Threads, typename Copy = PlainCopy>
__device__ __forceinline__ void load_tile(u16* tile, const u16* gbase, index_t row_stride,
                                          int rows_valid, int d, bool vec_ok, Copy copy = {}) {
    constexpr int LD = HeadDim + SMEM_PAD;
    constexpr int CHUNKS = HeadDim / 8;
    if (vec_ok) {
        // d is a multiple of 8 here, so a chunk is either wholly in or wholly out. A chunk
        // outside is zero-filled (source size 0: nothing is read from `src`).
        const u32 stile = smem_addr(tile);
        if constexpr (Threads % CHUNKS == 0) {
            // The thread's column is fixed and its rows STEP apart: one pointer bump per chunk.
            constexpr int STEP = Threads / CHUNKS;
            // A warp's lanes at head dim 256 (one chunk a row): by four rows, since the whole
            // tile's row addresses, worked out ahead, spilled the d=256 decode kernels.
            constexpr int UNROLL = Threads == 32 && STEP == 1 ? 4 : (Rows + STEP - 1) / STEP;
            const int r0 = chunk_thread<Threads>() / CHUNKS, col = chunk_thread<Threads>() % CHUNKS * 8;
            const bool col_in = col < d;
            const u16* src = gbase + r0 * row_stride + col;
#pragma unroll UNROLL
            for (int i = 0; i < (Rows + STEP - 1) / STEP; ++i) {
                const int r = r0 + i * STEP;
                if (Rows % STEP == 0 || r < Rows)
                    copy(stile + (r * LD + col) * 2, src, col_in && r < rows_valid ? 16 : 0);
                src += STEP * row_stride;
            }
        } else {
            for_each_chunk<Rows, HeadDim, Threads>([&](int r, int col) {
                const bool in = r < rows_valid && col < d;
                copy(stile + (r * LD + col) * 2, in ? gbase + r * row_stride + col : gbase, in ? 16 : 0);
            });
        }
    } else {
        // Unaligned or odd-strided tensors: element loads in a plain loop (a rare path, kept
        // small so that it does not cost the fast path registers).
#pragma unroll 1
        for (int c = chunk_thread<Threads>(); c < Rows * CHUNKS; c += Threads) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
            const u16* src = gbase + r * row_stride + col;
            u16 v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = (r < rows_valid && col + e < d) ? src[e] : u16(0);
            u32 w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) w[e] = v[2 * e] | (static_cast<u32>(v[2 * e + 1]) << 16);
            *reinterpret_cast<uint4*>(tile + r * LD + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// The reverse for outputs: rows < rows_valid and columns < d of the tile go to global memory.
template <int Rows, int HeadDim, int Threads>
__device__ __forceinline__ void store_tile(const u16* tile, u16* gbase, index_t row_stride,
                                           int rows_valid, int d, bool vec_ok) {
    constexpr int LD = HeadDim + SMEM_PAD;
    for_each_chunk<Rows, HeadDim, Threads>([&](int r, int col) {
        if (r >= rows_valid || col >= d) return;
        const u16* src = tile + r * LD + col;
        u16* dst = gbase + r * row_stride + col;
        if (vec_ok) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (col + e < d) dst[e] = src[e];
        }
    });
}

// ---- Counters in global memory between blocks, at GPU scope.
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- Programmatic dependent launch (sm_90; _launch's `dependent`); no-ops on older GPUs and
// between grids launched the ordinary way.
// Lets the grid launched after this one as its programmatic dependent start once every block
// of this grid has executed it (or exited).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// In a dependent grid: waits until the grid before it has completed and its writes are
// visible.
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
