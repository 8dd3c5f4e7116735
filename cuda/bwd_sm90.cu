// The dK/dV pass of the backward for Hopper (sm_90a), with dQ added atomically (bwd.cu's
// fp32 buffer and its convert kernel; bwd_preprocess_kernel has written D and lse in log2
// units first). One thread block per (key block of 128 keys, kv head, batch) keeps dK and dV in
// registers while it walks every query block of 64 rows of every query head of its group, as
// bwd.cu's pass does, with Hopper's units:
// - a producer warpgroup (registers given back): one thread copies K and V once and Q and dO
//   per query block into two stages (tensor maps, mbarriers; a stage is reused once every
//   consumer warp has released it);
// - two consumer warpgroups of 64 keys each: S^T = K Q^T and dP^T = V dO^T by wgmma from shared
//   memory; P^T = exp2(S^T - lse) and dS^T = P^T (dP^T - D) through the shared pieces (mask,
//   score modifier); dV += P^T dO and dK += dS^T Q with P^T and dS^T from registers; dS^T to
//   shared memory, and dQ (64 queries x head dim) += dS K over the warpgroup's keys by wgmma
//   with both operands transposed, staged in shared memory in the fp32 buffer's tile order
//   (the accumulators have that layout) and added into the buffer by one bulk reduce-add of
//   the copy engine (the 64 rows are contiguous there) instead of 64 atomics per thread.
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
    constexpr int Halves = HeadDim / 64, Sub = 64 * 64, NT = Br / 8, DT = HeadDim / 8;
    static_assert(HeadDim == 64 || HeadDim == 128, "the dK and dV accumulators fit the registers up to 128");
    static_assert(!V::Dropout && !V::UserScore, "dropout and user score_mods run the generic backward");
    const BwdParams& p = tp.base;

    // K and V (two warpgroups x Halves sub-tiles of 64 rows), Stages buffers of Q and of dO,
    // each warpgroup's dS^T (64 keys x 64 queries), then its fp32 dQ stage (64 x HeadDim in
    // the buffer's tile order); 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    __shared__ unsigned long long kv_full, qd_full[Stages], qd_empty[Stages];
    u16* sK = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sV = sK + 2 * Halves * Sub;
    u16* sQ = sV + 2 * Halves * Sub;
    u16* sdO = sQ + Stages * Halves * Sub;
    u16* sdSt = sdO + Stages * Halves * Sub;
    float* sdQ = reinterpret_cast<float*>(sdSt + 2 * Sub);

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
            mbar_init(&qd_full[s], 1);
            mbar_init(&qd_empty[s], Consumers / 32);   // one arrival per consumer warp
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (threadIdx.x >= Consumers) {
        setmaxnreg_dec<24>();
        if (threadIdx.x != Consumers) return;
        mbar_expect_bytes(&kv_full, 2 * 2 * Halves * Sub * 2);
        for (int half = 0; half < 2; ++half)
            for (int c = 0; c < Halves; ++c) {
                tma_load_4d(sK + (half * Halves + c) * Sub, tp.k, 64 * c, hk, col0 + 64 * half, at.batch, &kv_full);
                tma_load_4d(sV + (half * Halves + c) * Sub, tp.v, 64 * c, hk, col0 + 64 * half, at.batch, &kv_full);
            }
        int g = 0;   // query blocks passed: block g goes through stage g % Stages
        for (Step cur = settle(Step{0, 0, blocks_of(0)}); cur.hq < p.group; cur = settle(Step{cur.hq, cur.it + 1, cur.qb}), ++g) {
            const int buf = g % Stages, h = hk * p.group + cur.hq, m0 = cur.qb.block(cur.it) * Br;
            if (g >= Stages) mbar_wait(&qd_empty[buf], (g / Stages - 1) & 1);
            mbar_expect_bytes(&qd_full[buf], 2 * Halves * Sub * 2);
            for (int c = 0; c < Halves; ++c) {
                tma_load_4d(sQ + (buf * Halves + c) * Sub, tp.q, 64 * c, h, m0, at.batch, &qd_full[buf]);
                tma_load_4d(sdO + (buf * Halves + c) * Sub, tp.dout, 64 * c, h, m0, at.batch, &qd_full[buf]);
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
    u16* mydSt = sdSt + wg * Sub;
    float* mydQ = sdQ + wg * 64 * HeadDim;
    const bool store_thread = threadIdx.x % 128 == 0;   // issues its warpgroup's bulk operations
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

        // lse (log2 units) and D of the thread's query columns; rows past seqlen_q read the
        // last row's (their Q and dO rows are zeros: nothing of theirs reaches dK or dV).
        auto stat_of = [&](const void* base, int nt, int j) {
            const int row = min(m0 + nt * 8 + 2 * t + j, seq.seqlen_q() - 1);
            return static_cast<const float*>(base)[seq.stat(h, row)];
        };
        float lse2[NT][2], dsum[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                lse2[nt][j] = stat_of(p.lse_log2, nt, j);
                dsum[nt][j] = stat_of(p.dsum, nt, j);
            }

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
                pv[e] = fast_exp2(fmaf(x, mod.mult(), -lse2[nt][e & 1]));
                st[0][nt][e] = pv[e] * mod.grad(st[0][nt][e]);
            }
            pa[nt / 2][2 * (nt % 2)] = pack2<Elem>(pv[0], pv[1]);
            pa[nt / 2][2 * (nt % 2) + 1] = pack2<Elem>(pv[2], pv[3]);
        }
        wgmma_wait<0>();
        wgmma_fence_operands(dpt_flat);
        // dS^T = P^T (dP^T - D), as A fragments and, for dQ, into the warpgroup's dS^T tile
        // (128-byte swizzle, keys as rows: the transposed A operand of dS K).
        u32 dsa[Br / 16][4];
        if (store_thread) bulk_wait_read<0>();   // the last block's dQ add has read its stage
        named_bar_sync(4 + wg, 128);   // ... and the last block's dQ products have read dS^T
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[e] = st[0][nt][e] * (dpt[0][nt][e] - dsum[nt][e & 1]);
            const u32 lo = pack2<Elem>(ds[0], ds[1]), hi = pack2<Elem>(ds[2], ds[3]);
            dsa[nt / 2][2 * (nt % 2)] = lo;
            dsa[nt / 2][2 * (nt % 2) + 1] = hi;
            const int r = 16 * wq + lane / 4, c = nt * 8 + 2 * t;
            *reinterpret_cast<u32*>(mydSt + swizzled_offset<64>(r, c)) = lo;
            *reinterpret_cast<u32*>(mydSt + swizzled_offset<64>(r + 8, c)) = hi;
        }
        fence_proxy_async();
        named_bar_sync(4 + wg, 128);

        // dV += P^T dO, dK += dS^T Q (B MN-major: 16 queries = 2048 bytes of a sub-tile).
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < Br / 16; ++kk) {
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dv[0][8 * c]), pa[kk],
                               sw128_desc(bdO + c * Sub, 2048 * kk), true);
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dk[0][8 * c]), dsa[kk],
                               sw128_desc(bQ + c * Sub, 2048 * kk), true);
            }
        wgmma_commit();
        // dQ += dS K over the warpgroup's 64 keys, 64 columns at a time, into the stage: tile
        // (warp's 16 rows, n8 column tile) at (wq * DT + tile) * 128 floats, register e of lane
        // L at e * 32 + L; then the whole stage into the buffer's tiles of rows m0 .. m0 + 63.
#pragma unroll
        for (int c = 0; c < Halves; ++c) {
            float dq[32];
            wgmma_fence();   // dq's registers may be the last chunk's, just stored
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss_tt<Elem>(dq, sw128_desc(mydSt, 2048 * kk), sw128_desc(myK + c * Sub, 2048 * kk), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands(dq);
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) mydQ[(wq * DT + 8 * c + j) * SM90_DQ_TILE + e * 32 + lane] = dq[4 * j + e];
        }
        fence_proxy_async();
        named_bar_sync(4 + wg, 128);
        if (store_thread) {
            float* gdq = p.dq_accum + ((static_cast<index_t>(seq.b) * p.nheads + h) * (p.dq_accum_rows / 16) + m0 / 16)
                                      * (p.dq_accum_cols / 8) * SM90_DQ_TILE;
            bulk_reduce_add_f32(gdq, mydQ, 64 * HeadDim * 4);
            bulk_commit();
        }
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dk));
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dv));
        if (lane == 0) mbar_arrive(&qd_empty[buf]);
    }

    // dK = scale * dk and dV through the warpgroup's K and V tiles (its products are done with
    // them) to bulk stores; rows past seqlen_k and columns past the head dim are clipped.
    u16* stK = sK + wg * Halves * Sub;
    u16* stV = sV + wg * Halves * Sub;
    named_bar_sync(4 + wg, 128);
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
