// Forward attention for Hopper (sm_90a): the copy engine brings Q, K and V tiles into
// 128-byte-swizzled shared memory (tensor maps of cupyflash/_tma.py, completing on mbarriers),
// and warpgroup matrix multiplies (wgmma) compute S = Q K^T from shared memory and O += P V
// with P from registers. Everything between the two products is the pipeline's pieces, as in
// fwd.cu: the key-block range, the score modifier, the mask, the online softmax and the
// epilogue; wgmma's accumulators have mma.sync's per-warp layout, so they apply unchanged.
//
// One thread block per (query block of 128 rows, head, batch), three warpgroups:
// - the producer (the last warpgroup, its registers given back to the others): one thread
//   issues the copies of Q once and of K and V block by block into Stages buffers, each
//   buffer reused once both consumers have released it (the `empty` mbarriers);
// - two consumers of 64 rows each. A consumer issues S = Q K^T of block j, then O += P V of
//   block j - 1, and runs the softmax of block j while the second product is still running:
//   the exponentials of one block overlap the tensor cores' work on the other (rescaling O
//   waits for that product). The two consumers take turns issuing their products (named
//   barriers), so that one's softmax runs while the other's products do, not both at once.
// HeadDim is the head dim rounded up to a multiple of 64: the copy engine fills the columns
// past the real one with zeros, and the epilogue stores only the real ones.
#include "common.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"

// FwdParams and the tensor maps of q, k and v (dimensions innermost first: head dim, heads,
// rows, batch; boxes of 64 columns x 64 rows for q, x Bc rows for k and v).
struct FwdSm90Params {
    TmaDesc q, k, v;
    FwdParams base;
};

// Keys per block: S = Q K^T as one m64n128 product per k16 step where its 64 accumulators and
// O's fit the consumers' registers (cupyflash/_launch.py sm90_fwd_keys mirrors this).
template <int HeadDim>
__host__ __device__ constexpr int sm90_fwd_keys() { return HeadDim <= 128 ? 128 : 64; }

template <typename Elem, int HeadDim, typename V>
__global__ void __launch_bounds__(384, 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params tp) {
    constexpr int Br = 128, Bc = sm90_fwd_keys<HeadDim>(), Stages = 2;
    constexpr int Consumers = 256, Threads = Consumers + 128;
    constexpr int Halves = HeadDim / 64;   // 64-column sub-tiles of a row block (one swizzle atom wide)
    constexpr int SubQ = 64 * 64, SubKV = Bc * 64;
    constexpr int NT = Bc / 8, DT = HeadDim / 8;
    static_assert(HeadDim % 64 == 0, "rows of whole 128-byte swizzle atoms");
    // Dropout runs the generic forward (_launch.kernel_family): here its generator took the
    // registers of a second block per SM, and the kernel was slower than the generic one.
    static_assert(!V::Dropout, "no dropout in this kernel");
    static_assert(Br * (HeadDim + SMEM_PAD) <= 2 * Stages * Halves * SubKV, "the epilogue stages O in the K and V buffers");
    const FwdParams& p = tp.base;

    // Q (two warpgroups x Halves sub-tiles), then Stages buffers of K and of V; 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    __shared__ unsigned long long q_full, k_full[Stages], v_full[Stages], k_empty[Stages], v_empty[Stages];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sK = sQ + 2 * Halves * SubQ;
    u16* sV = sK + Stages * Halves * SubKV;

    // Causal: the last query blocks see the most keys.
    const int n_tiles = (p.seqlen_q + Br - 1) / Br;
    const BlockCoord at = block_coord<V::Causal>(p, p.nheads, [&](int i) { return n_tiles - 1 - i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<FwdParams> seq(p, at.batch);
    Mask<V, FwdParams> mask(p);
    const int h = at.head, hk = h / p.group;
    mask.at_head(at.batch, h);
    const int row0 = at.tile * Br;
    const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, at.tile, Br, Bc);

    if (threadIdx.x == 0) {
        mbar_init(&q_full, 1);
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            // Released by each consumer warp once its products have read the buffer.
            mbar_init(&k_empty[s], Consumers / 32);
            mbar_init(&v_empty[s], Consumers / 32);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (threadIdx.x >= Consumers) {
        setmaxnreg_dec<40>();
        if (threadIdx.x == Consumers) {
            mbar_expect_bytes(&q_full, 2 * Halves * SubQ * 2);
            for (int w = 0; w < 2; ++w)
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sQ + (w * Halves + c) * SubQ, tp.q, 64 * c, h, row0 + 64 * w, at.batch, &q_full);
            for (int it = 0; it < kb.count; ++it) {
                const int buf = it % Stages, n0 = kb.block(it) * Bc;
                const unsigned reuse = (it / Stages - 1) & 1;   // the phase that freed the buffer
                if (it >= Stages) mbar_wait(&k_empty[buf], reuse);
                mbar_expect_bytes(&k_full[buf], Halves * SubKV * 2);
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sK + (buf * Halves + c) * SubKV, tp.k, 64 * c, hk, n0, at.batch, &k_full[buf]);
                if (it >= Stages) mbar_wait(&v_empty[buf], reuse);
                mbar_expect_bytes(&v_full[buf], Halves * SubKV * 2);
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sV + (buf * Halves + c) * SubKV, tp.v, 64 * c, hk, n0, at.batch, &v_full[buf]);
            }
        }
        return;
    }
    setmaxnreg_inc<232>();

    ScoreMod<V, FwdParams> mod(p);
    mod.at_head(at.batch, h);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const int wrow = warp * 16;   // warpgroup wg's rows are 64 wg .. 64 wg + 63
    const u16* myQ = sQ + wg * Halves * SubQ;

    float acc[1][DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;
    OnlineSoftmax<2> softmax;
    softmax.init();
    float s[1][NT][4];
    float(&sflat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(s);
    u32 pa[Bc / 16][4];   // P of the previous block as A fragments

    auto release = [&](unsigned long long* empty) {
        if (lane == 0) mbar_arrive(empty);
    };
    // S = Q K^T: the warpgroup's 64 rows x Bc keys, k16 steps over the head dim.
    auto issue_qk = [&](int it) {
        const int buf = it % Stages;
        mbar_wait(&k_full[buf], (it / Stages) & 1);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss<Elem>(sflat, sw128_desc(myQ + c * SubQ, 32 * kk),
                               sw128_desc(sK + (buf * Halves + c) * SubKV, 32 * kk), c + kk > 0);
        wgmma_commit();
    };
    // O += P V: V's rows are the keys (MN-major B), 16 keys = 2048 bytes of a sub-tile.
    auto issue_pv = [&](int it) {
        const int buf = it % Stages;
        mbar_wait(&v_full[buf], (it / Stages) & 1);
        // After the wait's loop: a fence the compiler inserted there itself serialized the products.
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk)
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(acc[0][8 * c]), pa[kk],
                               sw128_desc(sV + (buf * Halves + c) * SubKV, 2048 * kk), true);
        wgmma_commit();
    };
    // Scores of block `it` (landed in s) to probabilities; true where O needs rescaling.
    auto softmax_step = [&](int it, float (&alpha)[2]) {
        const int n0 = kb.block(it) * Bc;
        mod.apply<false>(s, row0 + wrow, n0, lane);
        if (kb.needs_mask<V>(it, Bc)) mask_scores<false>(s, mask, row0 + wrow, n0, lane);
        return softmax.step(s, mod.mult(), alpha);
    };
    // P as A fragments: keys 16kk.. are the n8 tiles 2kk and 2kk + 1.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                pa[kk][r] = pack2<Elem>(s[0][2 * kk + r / 2][2 * (r % 2)], s[0][2 * kk + r / 2][2 * (r % 2) + 1]);
    };

    // Turns: warpgroup wg issues its products after bar.sync on barrier 2 + wg, then hands the
    // turn to the other with bar.arrive on that one's barrier; warpgroup 0 goes first. Every
    // sync pairs with one arrival (warpgroup 1 hands on no turn after its last products).
    auto my_turn = [&]() { named_bar_sync(2 + wg, Consumers); };
    auto hand_on = [&](bool last) {
        if (!(last && wg == 1)) named_bar_arrive(3 - wg, Consumers);
    };
    mbar_wait(&q_full, 0);
    if (kb.count > 0) {
        float alpha[2];
        if (wg == 1) named_bar_arrive(2, Consumers);
        my_turn();
        issue_qk(0);
        hand_on(false);
        wgmma_wait<0>();
        wgmma_fence_operands(sflat);
        release(&k_empty[0]);
        softmax_step(0, alpha);   // O is still zero: nothing to rescale
        pack_p();
        for (int it = 1; it < kb.count; ++it) {
            my_turn();
            issue_qk(it);
            issue_pv(it - 1);
            hand_on(false);
            wgmma_wait<1>();
            wgmma_fence_operands(sflat);
            release(&k_empty[it % Stages]);
            const bool moved = softmax_step(it, alpha);
            wgmma_wait<0>();
            wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(acc));
            release(&v_empty[(it - 1) % Stages]);
            if (moved) softmax.rescale(acc, alpha);
            pack_p();
        }
        my_turn();
        issue_pv(kb.count - 1);
        hand_on(true);
        wgmma_wait<0>();
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(acc));
    }

    // The K and V buffers (no longer read: epilogue_begin waits for every consumer) stage O.
    fwd_epilogue<Elem, Br, HeadDim, Consumers, Threads>(p, seq, h, row0, seq.seqlen_q() - row0, wrow, lane,
                                                        p.vec_ok != 0, softmax, mod.mult(), 1.f, acc, sK);
}
