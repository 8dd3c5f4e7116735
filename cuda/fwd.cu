// Forward pass on tensor cores (fp16/bf16, fp32 accumulation), FlashAttention 2 partitioning:
// one thread block per (query block of Br rows, head, batch); each warp owns MT slices of
// 16 query rows and walks the key blocks of Bc keys:
//   S = Q K^T (mma), score mods, mask, online softmax update, O += P V (P straight from
//   registers).
// Stages = 1: K and V single-buffered in shared memory, their loads overlapped with compute:
// V_j is fetched while S_j = Q K_j^T is computed, K_{j+1} while O += P_j V_j is (two
// barriers per key block). Stages = 2: two buffers of each, K and V of block j+1 fetched at
// the top of step j, under all of its math (one barrier per key block).
#include "common.cuh"
#include "softmax.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "dropout.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"

// Blocks per SM the register allocation must leave room for: three of the double-buffered
// kernel up to head dim 64 (168 registers), where three of its tiles fit in shared memory
// (sm_90's 227 KB, not sm_80's 163 KB). NVRTC 13.0 allocates that unasked; 13.5 gave it 181
// registers, two blocks per SM, 11-12% slower on the H100. 0 asks nothing and leaves ptxas its
// own choice; 1 would let it take up to 255 registers (the d=64 causal kernel then took 225,
// two blocks per SM instead of three, 11-15% slower at seqlen 1K-16K in fp16).
// The score modifiers, user mods and dropout do not fit in 168 (NVRTC 13.5 spilled 8-36
// bytes): the score modifiers leave ptxas its choice; dropout and user mods ask for 1, all 255
// registers, since ptxas's own choice capped some of their 64 x 64 kernels at 128 or 168
// registers and spilled (NVRTC 13.5, d=96 with dropout, d=128 with a T5 bias on sm_80).
template <int HeadDim, int Stages, typename V>
__host__ __device__ constexpr int fwd_min_blocks() {
    constexpr bool own = !V::Dropout && !V::UserScore && !V::UserMask;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    return !own ? 1 : HeadDim <= 64 && Stages == 2 && !V::Softcap && !V::Alibi ? 3 : 0;
#else
    return own ? 0 : 1;
#endif
}

template <typename Elem, int HeadDim, int Br, int Bc, int NWarps, int Stages, typename V>
__global__ void __launch_bounds__(NWarps * 32, (fwd_min_blocks<HeadDim, Stages, V>()))
flash_fwd_kernel(const FwdParams p) {
    constexpr int Threads = NWarps * 32;
    constexpr int MT = Br / (16 * NWarps);   // m16 tiles per warp
    constexpr int NT = Bc / 8;               // n8 tiles of S
    constexpr int DT = HeadDim / 8;          // n8 tiles of O
    constexpr int LD = HeadDim + SMEM_PAD;
    static_assert(MT >= 1 && Br == 16 * NWarps * MT, "warps own whole 16-row slices of the query block");
    static_assert(Bc % 16 == 0 && HeadDim % 16 == 0, "tiles are made of 16x16 mma operands");
    static_assert(Stages == 1 || Stages == 2, "one or two K/V buffers");

    extern __shared__ __align__(16) unsigned char smem[];
    u16* sQ = reinterpret_cast<u16*>(smem);
    u16* sK = sQ + Br * LD;           // Stages buffers of K, then of V: block j in buffer j % Stages
    u16* sV = sK + Stages * Bc * LD;

    // Causal: the last query blocks see the most keys.
    const int n_tiles = (p.seqlen_q + Br - 1) / Br;
    const BlockCoord at = block_coord<V::Causal>(p, p.nheads, [&](int i) { return n_tiles - 1 - i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<FwdParams, V::Seq> seq(p, at.batch);
    if (V::Varlen && at.tile * Br >= seq.seqlen_q()) return;   // past a packed sequence's end
    Mask<V, FwdParams> mask(p);
    const int h = at.head, hk = h / p.group;
    mask.at_head(at.batch, h);
    ScoreMod<V, FwdParams> mod(p);
    mod.at_head(at.batch, h);
    const Dropout drop(p, at.batch, h);
    const int qblock = at.tile;
    const int row0 = qblock * Br;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wrow = warp * MT * 16;              // the warp's first row in the block
    const bool vec_ok = p.vec_ok != 0;
    const int rows_valid = seq.seqlen_q() - row0;

    const u16* gQ = seq.template q_row<const u16>(p.q, h, row0);
    const u16* gK = seq.template k_row<const u16>(p.k, hk, 0);
    const u16* gV = seq.template k_row<const u16>(p.v, hk, 0);

    const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, qblock, Br, Bc);

    load_tile<Br, HeadDim, Threads>(sQ, gQ, p.q.row_stride, rows_valid, p.headdim, vec_ok);
    // The first fetch is written two ways (the same arithmetic): each is the spelling its
    // variant was measured with, and ptxas allocates registers differently for the other.
    if constexpr (Stages == 2) {
        if (kb.count > 0) {
            const int n0 = kb.block(0) * Bc;
            load_tile<Bc, HeadDim, Threads>(sK, gK + n0 * p.k.row_stride, p.k.row_stride,
                                            seq.seqlen_k() - n0, p.headdim, vec_ok);
            load_tile<Bc, HeadDim, Threads>(sV, gV + n0 * p.v.row_stride, p.v.row_stride,
                                            seq.seqlen_k() - n0, p.headdim, vec_ok);
        }
    } else if (kb.count > 0) {
        load_tile<Bc, HeadDim, Threads>(sK, gK + kb.block(0) * Bc * p.k.row_stride, p.k.row_stride,
                                        seq.seqlen_k() - kb.block(0) * Bc, p.headdim, vec_ok);
    }
    cp_async_commit();

    float acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
    OnlineSoftmax<2 * MT> softmax;
    softmax.init();

    const u32 sQa = smem_addr(sQ), sK0 = smem_addr(sK), sV0 = smem_addr(sV);

    for (int it = 0; it < kb.count; ++it) {
        const int n0 = kb.block(it) * Bc;
        cp_async_wait<0>();
        // K_j (with two stages, V_j too) has landed, and every warp is done reading V_{j-1}
        // (with two stages, K_{j-1} too, whose buffers the next fetch fills).
        __syncthreads();
        u32 sKa = sK0, sVa = sV0;
        if constexpr (Stages == 2) {
            const int nb = (it + 1) & 1;
            if (it + 1 < kb.count) {
                const int n1 = kb.block(it + 1) * Bc;
                load_tile<Bc, HeadDim, Threads>(sK + nb * Bc * LD, gK + n1 * p.k.row_stride, p.k.row_stride,
                                                seq.seqlen_k() - n1, p.headdim, vec_ok);
                load_tile<Bc, HeadDim, Threads>(sV + nb * Bc * LD, gV + n1 * p.v.row_stride, p.v.row_stride,
                                                seq.seqlen_k() - n1, p.headdim, vec_ok);
            }
            sKa += (nb ^ 1) * Bc * LD * 2;
            sVa += (nb ^ 1) * Bc * LD * 2;
        } else {
            load_tile<Bc, HeadDim, Threads>(sV, gV + n0 * p.v.row_stride, p.v.row_stride,
                                            seq.seqlen_k() - n0, p.headdim, vec_ok);
        }
        cp_async_commit();

        // S = Q K^T
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HeadDim / 16; ++ks) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(a[mt], sQa + ((wrow + mt * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 bk[4];   // b0, b1 of n8 tiles 2np and 2np+1
                ldmatrix_x4(bk, sKa + ((np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<Elem>(s[mt][2 * np], a[mt], bk[0], bk[1]);
                    mma_16816<Elem>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        mod.apply<false>(s, row0 + wrow, n0, lane);
        if (kb.needs_mask<V>(it, Bc)) mask_scores<false>(s, mask, row0 + wrow, n0, lane);
        softmax.update(s, acc, mod.mult());
        // Dropped weights leave O, not l: the softmax's sums are the undropped ones.
        if constexpr (V::Dropout)
            drop.for_each<false, MT, NT>(row0 + wrow, n0, lane, [&](int m, int n, int e, unsigned keep) {
                if (!keep) s[m][n][e] = 0.f;
            });
        // P to 16-bit A operands now, so that S's registers are free across the K load below.
        u32 pa[MT][Bc / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk) {
                pa[mt][kk][0] = pack2<Elem>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = pack2<Elem>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = pack2<Elem>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = pack2<Elem>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }

        if constexpr (Stages == 1) {
            cp_async_wait<0>();
            __syncthreads();   // V_j has landed, and every warp is done reading K_j
            if (it + 1 < kb.count) {
                const int n1 = kb.block(it + 1) * Bc;
                load_tile<Bc, HeadDim, Threads>(sK, gK + n1 * p.k.row_stride, p.k.row_stride,
                                                seq.seqlen_k() - n1, p.headdim, vec_ok);
            }
            cp_async_commit();
        }

        // O += P V
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 bv[4];   // b0, b1 of n8 tiles 2dp and 2dp+1
                ldmatrix_x4_trans(bv, sVa + ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<Elem>(acc[mt][2 * dp], pa[mt][kk], bv[0], bv[1]);
                    mma_16816<Elem>(acc[mt][2 * dp + 1], pa[mt][kk], bv[2], bv[3]);
                }
            }
        }
    }

    fwd_epilogue<Elem, Br, HeadDim, Threads>(p, seq, h, row0, rows_valid, wrow, lane, vec_ok, softmax, mod.mult(),
                                             V::Dropout ? drop.scale : 1.f, acc, sQ);
}
