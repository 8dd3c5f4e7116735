// Forward attention for Hopper (sm_90a): the copy engine brings Q, K and V tiles into
// 128-byte-swizzled shared memory (tensor maps of cupyflash/_tma.py, completing on mbarriers),
// and warpgroup matrix multiplies (wgmma) compute S = Q K^T from shared memory and O += P V
// with P from registers. Everything between the two products is the pipeline's pieces, as in
// fwd.cu: the key-block range, the score modifier, the mask, the online softmax and the
// epilogue; wgmma's accumulators have mma.sync's per-warp layout, so they apply unchanged.
//
// One thread block per (query block of 128 rows, head, batch): two warpgroups of 64 rows each;
// K and V double-buffered, the next block's copies issued while this one is multiplied.
// HeadDim is the head dim rounded up to a multiple of 64: the copy engine fills the columns
// past the real one with zeros, and the epilogue stores only the real ones.
// First version: no producer warp or register reallocation, and the softmax of a block is not
// overlapped with the products of another (the next steps of issue 16).
#include "common.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"

// FwdParams and the tensor maps of q, k and v (dimensions innermost first: head dim, heads,
// rows, batch; boxes of 64 x 64).
struct FwdSm90Params {
    TmaDesc q, k, v;
    FwdParams base;
};

template <typename Elem, int HeadDim, typename V>
__global__ void __launch_bounds__(256, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params tp) {
    constexpr int Br = 128, Bc = 64, Threads = 256, Stages = 2;
    constexpr int Halves = HeadDim / 64;   // 64-column sub-tiles of a row block (one swizzle atom wide)
    constexpr int Sub = 64 * 64;           // elements of a 64-row sub-tile
    constexpr int NT = Bc / 8, DT = HeadDim / 8;
    static_assert(HeadDim % 64 == 0, "rows of whole 128-byte swizzle atoms");
    // Dropout runs the generic forward (_launch.kernel_family): here its generator took the
    // registers of a second block per SM, and the kernel was slower than the generic one.
    static_assert(!V::Dropout, "no dropout in this kernel");
    static_assert(Br * (HeadDim + SMEM_PAD) <= 2 * Stages * Halves * Sub, "the epilogue stages O in the K and V buffers");
    const FwdParams& p = tp.base;

    // Q (two warpgroups x Halves sub-tiles), then Stages buffers of K and of V; 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    __shared__ unsigned long long q_full, k_full[Stages], v_full[Stages];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sK = sQ + 2 * Halves * Sub;
    u16* sV = sK + Stages * Halves * Sub;

    // Causal: the last query blocks see the most keys.
    const int n_tiles = (p.seqlen_q + Br - 1) / Br;
    const BlockCoord at = block_coord<V::Causal>(p, p.nheads, [&](int i) { return n_tiles - 1 - i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<FwdParams> seq(p, at.batch);
    Mask<V, FwdParams> mask(p);
    const int h = at.head, hk = h / p.group;
    mask.at_head(at.batch, h);
    ScoreMod<V, FwdParams> mod(p);
    mod.at_head(at.batch, h);
    const int row0 = at.tile * Br;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const int wrow = warp * 16;   // warpgroup wg's rows are 64 wg .. 64 wg + 63
    const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, at.tile, Br, Bc);

    if (threadIdx.x == 0) {
        mbar_init(&q_full, 1);
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
        }
        mbar_fence_init();
    }
    __syncthreads();
    // Thread 0 issues the copies of key block `it` into buffer it % Stages.
    auto fetch_kv = [&](int it) {
        const int buf = it % Stages, n0 = kb.block(it) * Bc;
        mbar_expect_bytes(&k_full[buf], Halves * Sub * 2);
        for (int c = 0; c < Halves; ++c)
            tma_load_4d(sK + (buf * Halves + c) * Sub, tp.k, 64 * c, hk, n0, at.batch, &k_full[buf]);
        mbar_expect_bytes(&v_full[buf], Halves * Sub * 2);
        for (int c = 0; c < Halves; ++c)
            tma_load_4d(sV + (buf * Halves + c) * Sub, tp.v, 64 * c, hk, n0, at.batch, &v_full[buf]);
    };
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&q_full, 2 * Halves * Sub * 2);
        for (int w = 0; w < 2; ++w)
            for (int c = 0; c < Halves; ++c)
                tma_load_4d(sQ + (w * Halves + c) * Sub, tp.q, 64 * c, h, row0 + 64 * w, at.batch, &q_full);
        if (kb.count > 0) fetch_kv(0);
    }

    float acc[1][DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;
    OnlineSoftmax<2> softmax;
    softmax.init();
    const u16* myQ = sQ + wg * Halves * Sub;
    mbar_wait(&q_full, 0);

    for (int it = 0; it < kb.count; ++it) {
        const int buf = it % Stages, n0 = kb.block(it) * Bc;
        const unsigned phase = (it / Stages) & 1;
        // Every warp is done with block it - 1, whose buffer the next copies fill.
        __syncthreads();
        if (threadIdx.x == 0 && it + 1 < kb.count) fetch_kv(it + 1);

        // S = Q K^T: the warpgroup's 64 rows x Bc keys, k16 steps over the head dim.
        float s[1][NT][4];
        float(&sflat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(s);
        mbar_wait(&k_full[buf], phase);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_m64n64k16<Elem>(sflat, sw128_desc(myQ + c * Sub, 32 * kk),
                                      sw128_desc(sK + (buf * Halves + c) * Sub, 32 * kk), c + kk > 0);
        wgmma_commit();
        wgmma_wait<0>();

        mod.apply<false>(s, row0 + wrow, n0, lane);
        if (kb.needs_mask<V>(it, Bc)) mask_scores<false>(s, mask, row0 + wrow, n0, lane);
        softmax.update(s, acc, mod.mult());
        // P as A fragments: keys 16kk.. are the n8 tiles 2kk and 2kk + 1.
        u32 pa[Bc / 16][4];
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                pa[kk][r] = pack2<Elem>(s[0][2 * kk + r / 2][2 * (r % 2)], s[0][2 * kk + r / 2][2 * (r % 2) + 1]);

        // O += P V: V's rows are the keys (MN-major B), 16 keys = 2048 bytes of a sub-tile.
        mbar_wait(&v_full[buf], phase);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk)
                wgmma_m64n64k16_rs<Elem>(reinterpret_cast<float(&)[32]>(acc[0][8 * c]), pa[kk],
                                         sw128_desc(sV + (buf * Halves + c) * Sub, 2048 * kk), true);
        wgmma_commit();
        wgmma_wait<0>();
    }

    // The K and V buffers (no longer read: epilogue_begin waits for every warp) stage O.
    fwd_epilogue<Elem, Br, HeadDim, Threads>(p, seq, h, row0, seq.seqlen_q() - row0, wrow, lane, p.vec_ok != 0,
                                             softmax, mod.mult(), 1.f, acc, sK);
}
