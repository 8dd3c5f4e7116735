// The dK/dV pass of the backward for Hopper (sm_90a), with dQ added atomically (bwd.cu's
// fp32 buffer and its convert kernel; bwd_preprocess_kernel has written D and lse in log2
// units first). One thread block per (key block of 128 keys, kv head, batch) keeps dK and dV in
// registers while it walks every query block of 64 rows of every query head of its group, as
// bwd.cu's pass does, with Hopper's units:
// - a producer warpgroup (registers given back): one thread copies K and V once and Q and dO
//   per query block into two stages (tensor maps, mbarriers; a stage is reused once every
//   consumer thread has released it), one warp the block's lse and D rows next to them;
// - two consumer warpgroups of 64 keys each: S^T = K Q^T and dP^T = V dO^T by wgmma from shared
//   memory; P^T = exp2(S^T - lse) through the shared pieces (mask, score modifier), and dV +=
//   P^T dO from registers running while dS^T = P^T (dP^T - D) is made; dK += dS^T Q likewise;
//   dS^T to shared memory (two steps' tiles, alternating), and once both warpgroups' tiles are
//   there, dQ (64 queries x half the head dim: the warpgroup's) += dS K over all 128 keys by
//   wgmma with both operands transposed. Each warp stages its 16 rows of that in shared memory
//   in the fp32 buffer's tile order (the accumulators have that layout) and adds them into the
//   buffer by one bulk reduce-add of the copy engine, instead of 64 atomics per thread.
// dK and dV leave through the warpgroup's K and V tiles and bulk tensor stores.
// HeadDim is the head-dim bucket, 64 or 128 (_launch.bwd_family): the copy engine fills the
// columns past the real head dim with zeros, and the stores clip them.
#include "common.cuh"
#include "sm90.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"

// BwdParams and the tensor maps of q, k, v, dout, dk and dv (head dim, heads, rows, batch;
// boxes of 64 x 64).
struct BwdSm90Params {
    TmaDesc q, k, v, dout, dk, dv;
    BwdParams base;
};

// bwd.cu's dQ buffer: tiles of 16 rows x 8 columns, register e of lane L at e * 32 + L.
constexpr int SM90_DQ_TILE = 16 * 8;

template <typename Elem, int HeadDim, typename V>
__global__ void __launch_bounds__(384, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params tp) {
    constexpr int Bc = 128, Br = 64, Stages = 2, Consumers = 256;
    constexpr int Halves = HeadDim / 64, Sub = 64 * 64, NT = Br / 8, DT = HeadDim / 8, DQ_N = HeadDim / 2;
    static_assert(HeadDim == 64 || HeadDim == 128, "the dK and dV accumulators fit the registers up to 128");
    static_assert(!V::Dropout && !V::UserScore, "dropout and user score_mods run the generic backward");
    const BwdParams& p = tp.base;

    // K and V (two warpgroups x Halves sub-tiles of 64 rows), Stages buffers of Q and of dO,
    // two steps' dS^T (128 keys x 64 queries), then each consumer warp's fp32 dQ stage (16 rows
    // x HeadDim / 2 in the buffer's tile order); 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    __shared__ unsigned long long kv_full, qd_full[Stages], qd_empty[Stages];
    __shared__ float2 sstat[Stages][Br];   // (lse in log2 units, D) of each stage's rows
    u16* sK = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sV = sK + 2 * Halves * Sub;
    u16* sQ = sV + 2 * Halves * Sub;
    u16* sdO = sQ + Stages * Halves * Sub;
    u16* sdSt = sdO + Stages * Halves * Sub;
    float* sdQ = reinterpret_cast<float*>(sdSt + 4 * Sub);

    // Causal: the first key blocks are seen by the most queries.
    const BlockCoord at = block_coord<V::Causal>(p, p.nheads_k, [](int i) { return i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<BwdParams> seq(p, at.batch);
    Mask<V, BwdParams> mask(p);
    const int hk = at.head, n_tile = at.tile, col0 = n_tile * Bc;

    // The steps: (query head of the group, query block) pairs, heads without blocks skipped.
    struct Step { int hq, it; QueryBlocks qb; };
    auto blocks_of = [&](int hq) { return query_blocks(p.q_blocks, mask, hk * p.group + hq, n_tile, Br, Bc); };
    auto settle = [&](Step s) {   // move past heads whose list is exhausted
        while (s.hq < p.group && s.it >= s.qb.count) {
            ++s.hq;
            s.it = 0;
            if (s.hq < p.group) s.qb = blocks_of(s.hq);
        }
        return s;
    };

    if (threadIdx.x == 0) {
        mbar_init(&kv_full, 1);
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&qd_full[s], 1 + 32);   // the copying thread and the statistics warp
            // Every consumer thread arrives: each has read the stage's statistics itself.
            mbar_init(&qd_empty[s], Consumers);
        }
        mbar_fence_init();
    }
    __syncthreads();

    // The producer warpgroup: its first thread has the copy engine bring K and V once and Q
    // and dO per step; its second warp copies the steps' row statistics into sstat (rows past
    // seqlen_q take the last row's: their Q and dO rows are zeros, nothing of theirs reaches dK
    // or dV), so that the consumers hold no registers for them across their products.
    if (threadIdx.x >= Consumers) {
        setmaxnreg_dec<24>();
        const int pw = (threadIdx.x - Consumers) / 32, lane = threadIdx.x % 32;
        if (pw > 1 || (pw == 0 && lane != 0)) return;
        if (pw == 0) {
            mbar_expect_bytes(&kv_full, 2 * 2 * Halves * Sub * 2);
            for (int half = 0; half < 2; ++half)
                for (int c = 0; c < Halves; ++c) {
                    tma_load_4d(sK + (half * Halves + c) * Sub, tp.k, 64 * c, hk, col0 + 64 * half, at.batch, &kv_full);
                    tma_load_4d(sV + (half * Halves + c) * Sub, tp.v, 64 * c, hk, col0 + 64 * half, at.batch, &kv_full);
                }
        }
        int g = 0;   // query blocks passed: block g goes through stage g % Stages
        for (Step cur = settle(Step{0, 0, blocks_of(0)}); cur.hq < p.group; cur = settle(Step{cur.hq, cur.it + 1, cur.qb}), ++g) {
            const int buf = g % Stages, h = hk * p.group + cur.hq, m0 = cur.qb.block(cur.it) * Br;
            if (g >= Stages) mbar_wait(&qd_empty[buf], (g / Stages - 1) & 1);
            if (pw == 0) {
                mbar_expect_bytes(&qd_full[buf], 2 * Halves * Sub * 2);
                for (int c = 0; c < Halves; ++c) {
                    tma_load_4d(sQ + (buf * Halves + c) * Sub, tp.q, 64 * c, h, m0, at.batch, &qd_full[buf]);
                    tma_load_4d(sdO + (buf * Halves + c) * Sub, tp.dout, 64 * c, h, m0, at.batch, &qd_full[buf]);
                }
            } else {
                for (int i = lane; i < Br; i += 32) {
                    const index_t at_row = seq.stat(h, min(m0 + i, seq.seqlen_q() - 1));
                    sstat[buf][i] = make_float2(static_cast<const float*>(p.lse_log2)[at_row],
                                                static_cast<const float*>(p.dsum)[at_row]);
                }
                mbar_arrive(&qd_full[buf]);
            }
        }
        return;
    }
    setmaxnreg_inc<240>();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, wq = warp % 4;
    const int t = lane % 4;
    const int key_w = 64 * wg + 16 * wq;   // the warp's first key in the block
    const u16* myK = sK + wg * Halves * Sub;
    const u16* myV = sV + wg * Halves * Sub;
    float* mydQ = sdQ + warp * 16 * DQ_N;
    // The warpgroup's dQ columns: a 64-wide chunk of K at d = 128, half of one at d = 64.
    const int dq_chunk = HeadDim == 128 ? wg : 0, dq_byte0 = HeadDim == 128 ? 0 : 64 * wg;
    ScoreMod<V, BwdParams> mod(p);

    float dk[1][DT][4], dv[1][DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) { dk[0][i][e] = 0.f; dv[0][i][e] = 0.f; }

    mbar_wait(&kv_full, 0);
    int g = 0;
    for (Step cur = settle(Step{0, 0, blocks_of(0)}); cur.hq < p.group; cur = settle(Step{cur.hq, cur.it + 1, cur.qb}), ++g) {
        const int buf = g % Stages, h = hk * p.group + cur.hq, m0 = cur.qb.block(cur.it) * Br;
        const bool masked = cur.qb.needs_mask(cur.it, m0, Br, Bc, col0, mask);
        mod.at_head(seq.b, h);
        mask.at_head(seq.b, h);
        const u16* bQ = sQ + buf * Halves * Sub;
        const u16* bdO = sdO + buf * Halves * Sub;

        // S^T = K Q^T and dP^T = V dO^T: the warpgroup's 64 keys x 64 queries, k16 steps over
        // the head dim.
        float st[1][NT][4], dpt[1][NT][4];
        float(&st_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(st);
        float(&dpt_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(dpt);
        mbar_wait(&qd_full[buf], (g / Stages) & 1);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss<Elem>(st_flat, sw128_desc(myK + c * Sub, 32 * kk), sw128_desc(bQ + c * Sub, 32 * kk), c + kk > 0);
        wgmma_commit();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss<Elem>(dpt_flat, sw128_desc(myV + c * Sub, 32 * kk), sw128_desc(bdO + c * Sub, 32 * kk), c + kk > 0);
        wgmma_commit();

        // The (lse, D) pairs of the thread's query columns nt * 8 + 2t + j.
        auto stat = [&](int nt, int j) { return sstat[buf][nt * 8 + 2 * t + j]; };
        wgmma_wait<1>();
        wgmma_fence_operands(st_flat);
        // P^T, and in st the factor of dS^T: P^T times the softcap's gradient factor.
        if constexpr (V::Softcap) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[0][nt][e] = mod.held(st[0][nt][e]);
        }
        if (masked) mask_scores<true>(st, mask, col0 + key_w, m0, lane);
        using C = ScoreCoords<true>;
        const float dist0 = mod.dist0(C(col0 + key_w, m0, lane));
        u32 pa[Br / 16][4];   // P^T as A fragments (keys x queries)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float pv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = mod.bias_at(dist0, C::ddiff(0, nt, e), st[0][nt][e]);
                pv[e] = fast_exp2(fmaf(x, mod.mult(), -stat(nt, e & 1).x));
                st[0][nt][e] = pv[e] * mod.grad(st[0][nt][e]);
            }
            pa[nt / 2][2 * (nt % 2)] = pack2<Elem>(pv[0], pv[1]);
            pa[nt / 2][2 * (nt % 2) + 1] = pack2<Elem>(pv[2], pv[3]);
        }
        // dV += P^T dO (B MN-major: 16 queries = 2048 bytes of a sub-tile) runs while dS^T is
        // made.
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < Br / 16; ++kk)
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dv[0][8 * c]), pa[kk],
                               sw128_desc(bdO + c * Sub, 2048 * kk), true);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operands(dpt_flat);
        // dS^T = P^T (dP^T - D), as A fragments and, for dQ, into this step's dS^T tile of the
        // warpgroup (128-byte swizzle, keys as rows: the transposed A operand of dS K). The
        // tiles alternate between steps: the other warpgroup may still read the last ones.
        // (Stores here and to the dQ stage by 32-bit shared address: a register each.)
        u16* dSt = sdSt + (g % 2) * 2 * Sub;
        const u32 dSt_s = smem_addr(dSt);
        u32 dsa[Br / 16][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[e] = st[0][nt][e] * (dpt[0][nt][e] - stat(nt, e & 1).y);
            const u32 lo = pack2<Elem>(ds[0], ds[1]), hi = pack2<Elem>(ds[2], ds[3]);
            dsa[nt / 2][2 * (nt % 2)] = lo;
            dsa[nt / 2][2 * (nt % 2) + 1] = hi;
            const int r = 64 * wg + 16 * wq + lane / 4, c = nt * 8 + 2 * t;
            st_shared(dSt_s + 2 * swizzled_offset<64>(r, c), lo);
            st_shared(dSt_s + 2 * swizzled_offset<64>(r + 8, c), hi);
        }
        // dK += dS^T Q.
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < Br / 16; ++kk)
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dk[0][8 * c]), dsa[kk],
                               sw128_desc(bQ + c * Sub, 2048 * kk), true);
        wgmma_commit();
        // dQ (64 queries x the warpgroup's half of the head dim) += dS K over all 128 keys of
        // the block, once both warpgroups' dS^T tiles are in shared memory: half the fp32
        // traffic of each warpgroup adding its own keys' share over the whole head dim.
        fence_proxy_async();
        named_bar_sync(6, Consumers);
        float dq[DQ_N / 2];
        wgmma_fence();
#pragma unroll
        for (int kh = 0; kh < 2; ++kh)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss_tt<Elem>(dq, sw128_desc(dSt + kh * Sub, 2048 * kk),
                                  sw128_desc(sK + (kh * Halves + dq_chunk) * Sub, 2048 * kk + dq_byte0), kh + kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(dq);
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dk));
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dv));
        mbar_arrive(&qd_empty[buf]);
        // Each warp's 16 rows into its own stage (the buffer's tiles of those rows and the
        // warpgroup's columns: register e of lane L of n8 tile j at j * 128 + e * 32 + L), and
        // from there into the buffer by one bulk reduce-add once the last one has read it.
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
        const u32 mydQ_s = smem_addr(mydQ + lane);
#pragma unroll
        for (int j = 0; j < DQ_N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st_shared(mydQ_s + 4 * (j * SM90_DQ_TILE + e * 32), dq[4 * j + e]);
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
            float* gdq = p.dq_accum + (((static_cast<index_t>(seq.b) * p.nheads + h) * (p.dq_accum_rows / 16) + m0 / 16 + wq)
                                       * (p.dq_accum_cols / 8) + wg * DQ_N / 8) * SM90_DQ_TILE;
            bulk_reduce_add_f32(gdq, mydQ, DQ_N / 8 * SM90_DQ_TILE * 4);
            bulk_commit();
        }
    }
    if (lane == 0) bulk_wait<0>();

    // dK = scale * dk and dV through the warpgroup's K and V tiles (once both warpgroups' dQ
    // products are done with them) to bulk stores; rows past seqlen_k and columns past the
    // head dim are clipped.
    u16* stK = sK + wg * Halves * Sub;
    u16* stV = sV + wg * Halves * Sub;
    named_bar_sync(6, Consumers);
    const float scale = static_cast<float>(p.scale);
    stage_swizzled<Elem, 64>(stK, 16 * wq, lane, dk, [=](int, int) { return scale; });
    stage_swizzled<Elem, 64>(stV, 16 * wq, lane, dv, [](int, int) { return 1.f; });
    fence_proxy_async();
    named_bar_sync(4 + wg, 128);
    if (threadIdx.x % 128 == 0) {
#pragma unroll
        for (int c = 0; c < Halves; ++c) {
            tma_store_4d(tp.dk, 64 * c, hk, col0 + 64 * wg, at.batch, stK + c * Sub);
            tma_store_4d(tp.dv, 64 * c, hk, col0 + 64 * wg, at.batch, stV + c * Sub);
        }
        bulk_commit();
        bulk_wait<0>();
    }
}
