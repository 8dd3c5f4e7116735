// Backward pass (FlashAttention 2):
//   1. bwd_preprocess_kernel: D = rowsum(dout * out), one warp per row, any dtype.
//   2. flash_bwd_dkdv_kernel: one thread block per (key block, kv head, batch) keeps dK and dV
//      in registers while it walks every query block of every query head of its group
//      (GQA sums therefore need no atomics). Per query block, with P recomputed from lse:
//        S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T - lse), dS^T = P^T (dP^T - D)
//        dV += P^T dO, dK += dS^T Q, and (AtomicDQ) dQ += dS K added into an fp32 buffer.
//   3. bwd_convert_dq_kernel: the fp32 dQ buffer, times the scale, to the output dtype; or
//      flash_bwd_dq_kernel: dQ in its own query-block-parallel pass, no atomics, so repeated
//      runs give bit-identical dq (deterministic=True).
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "block_iter.cuh"
#include "score_mod.cuh"
#include "dropout.cuh"
#include "epilogue.cuh"
#include "bwd_rows.cuh"

// grid (ceil(seqlen_q / PREPROCESS_ROWS), nheads, batch). Writes D, and for the tensor-core
// passes lse in log2 units (the plain kernels convert lse themselves); where the pass adds dQ
// into the fp32 buffer, zeroes the buffer's tiles of the block's rows (the buffer comes
// uninitialized: its own memset cost a pass over it and a launch; dq_strips: in DQ_STRIPS). Each row's D by a group
// of lanes (the fewest, a power of two, whose 16-byte chunks cover the head dim, at most a
// warp), each lane one 16-byte load of out and of dout per chunk where rows are 16-byte
// aligned (element by element where not, and in a last partial chunk), the block's groups
// walking its rows together: one warp per row with 2-byte loads ran the d=128 pass at ~2.3
// TB/s and the d=64 one at half that (benchmarks/NOTES.md).
// Seq: the rows' layout (seqinfo.cuh), as the passes' Variant::Seq.
template <typename Elem, int Seq = SEQ_DENSE>
__global__ void __launch_bounds__(PREPROCESS_THREADS) bwd_preprocess_kernel(const BwdParams p, int* dq_done,
                                                                             int dq_strips) {
    typedef ElemTraits<Elem> Tr;
    typedef typename Tr::storage S;
    typedef typename Tr::acc Acc;
    constexpr int VEC = 16 / sizeof(S);
    launch_dependents();   // the Hopper pass (bwd_sm90.cu) waits for what it reads
    const SeqInfo<BwdParams, Seq> seq(p, blockIdx.z);
    const int h = blockIdx.y, chunks = (p.headdim + VEC - 1) / VEC;
    int lanes = 1;
    while (lanes < chunks && lanes < 32) lanes *= 2;
    const int groups = PREPROCESS_THREADS / lanes, group = threadIdx.x / lanes, c0 = threadIdx.x % lanes;
    // Every lane of a warp takes the same number of turns (the shuffles need them all).
    for (int r = group; r < PREPROCESS_ROWS; r += groups) {
        const int row = blockIdx.x * PREPROCESS_ROWS + r;
        const bool in = row < seq.seqlen_q();
        // lse read with the row's loads, not after its sum: one memory round trip a turn.
        const float lse = sizeof(S) == 2 && in && c0 == 0 ? *stat_ptr<const float>(p.lse, seq, h, row) : 0.f;
        Acc sum = 0;
        if (in) {
            const S* o = seq.template q_row<const S>(p.o, h, row);
            const S* dout = seq.template q_row<const S>(p.dout, h, row);
            for (int c = c0; c < chunks; c += lanes) {
                const int col = c * VEC;
                if (p.vec_ok && col + VEC <= p.headdim) {
                    const uint4 ov = *reinterpret_cast<const uint4*>(o + col);
                    const uint4 dv = *reinterpret_cast<const uint4*>(dout + col);
                    const S* oe = reinterpret_cast<const S*>(&ov);
                    const S* de = reinterpret_cast<const S*>(&dv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) sum += Tr::load(oe + e) * Tr::load(de + e);
                } else {
                    for (int e = col; e < min(col + VEC, p.headdim); ++e) sum += Tr::load(o + e) * Tr::load(dout + e);
                }
            }
        }
        for (int off = lanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (in && c0 == 0) {
            *stat_ptr<Acc>(p.dsum, seq, h, row) = sum;
            if constexpr (sizeof(S) == 2) *stat_ptr<float>(p.lse_log2, seq, h, row) = lse_log2(lse);
        }
    }
    zero_dq_rows<PREPROCESS_THREADS>(p, seq, h, blockIdx.x, dq_strips, threadIdx.x);
    // The Hopper pass's count of finished dK/dV blocks of this (batch, kv head) starts at 0.
    if (dq_done != nullptr && blockIdx.x == 0 && h % p.group == 0 && threadIdx.x == 0)
        dq_done[blockIdx.z * p.nheads_k + h / p.group] = 0;
}

// grid (ceil(seqlen_q / 16), nheads, batch), up to DQ_CONVERT_THREADS threads: one strip of
// 16 rows. DQ_LANES (the Hopper pass's tiles): a thread takes lane L = 4 r + q of tile ct,
// one 16-byte load holding rows r and r + 8 at columns 8 ct + 2 q and + 1, consecutive
// threads consecutive column pairs of a row (whole 128-byte lines out), and stores each pair
// as one 32-bit word where rows are aligned. Else through 16 x (dq_accum_cols + 1) floats of
// shared memory: the strip read in tile order (DQ_STRIPS: each strip's block, 16 bytes a
// thread), written row by row (DQ_STRIPS: column pairs). Seq: the rows' layout.
template <typename Elem, int Layout, int Seq = SEQ_DENSE>
__global__ void __launch_bounds__(DQ_CONVERT_THREADS) bwd_convert_dq_kernel(const BwdParams p, const int* dq_done,
                                                                             int dq_done_target,
                                                                             const int* ready) {
    extern __shared__ float strip[];   // 16 rows x (cols + 1): the odd stride spreads the banks
    const SeqInfo<BwdParams, Seq> seq(p, blockIdx.z);
    const int h = blockIdx.y, row0 = blockIdx.x * 16;
    if (Seq == SEQ_PACKED && row0 >= seq.seqlen_q()) return;
    const int cols = p.dq_accum_cols, ld = cols + 1;
    const float* src = dq_tile_lane(p, seq, h, blockIdx.x, 0);
    const float scale = static_cast<float>(p.scale);
    // After the Hopper pass, the kernel is launched as its programmatic dependent. With
    // dq_done it may start beside that pass's last blocks: it waits until dq_done_target dK/dV
    // blocks of its (batch, kv head) have finished, and with them every add into its rows.
    // Without, it starts once the pass's blocks have all exited, on the launch's latency, and
    // waits for the pass's writes.
    if (Layout != DQ_MMA && dq_done != nullptr) {
        if (threadIdx.x == 0) {
            const int* done = dq_done + blockIdx.z * p.nheads_k + h / p.group;
            while (ld_acquire(done) < dq_done_target) {
            }
        }
        __syncthreads();
    } else {
        wait_for_primary();
    }
    // With the preprocess beside the pass (`ready`; 64-query steps, whose buffer is DQ_LANES), its
    // rows' zeros too: the pass adds into no tile of rows that no key sees, and may end before
    // the preprocess does.
    if (Layout == DQ_LANES && ready != nullptr) {
        if (threadIdx.x == 0) {
            const int blocks_q = (p.seqlen_q + PREPROCESS_ROWS - 1) / PREPROCESS_ROWS;
            wait_unit(ready + (static_cast<index_t>(blockIdx.z) * p.nheads + h) * blocks_q + row0 / PREPROCESS_ROWS);
        }
        __syncthreads();
    }
    // Columns c and c + 1 (if the head dim has it) of row `row`, one 32-bit word where aligned.
    auto store_pair = [&](int row, int c, float a, float b) {
        u16* dst = seq.template q_row<u16>(p.dq, h, row) + c;
        if (p.vec_ok && c + 1 < p.headdim) {
            *reinterpret_cast<u32*>(dst) = pack2<Elem>(a, b);
        } else {
            ElemTraits<Elem>::store(dst, a);
            if (c + 1 < p.headdim) ElemTraits<Elem>::store(dst + 1, b);
        }
    };
    if constexpr (Layout == DQ_LANES) {
        const int tiles = cols / 8;
        for (int i = threadIdx.x; i < 8 * tiles * 4; i += blockDim.x) {
            const int q = i % 4, ct = i / 4 % tiles, r = i / (4 * tiles), c = ct * 8 + 2 * q;
            if (c >= p.headdim) continue;
            const float4 x = *reinterpret_cast<const float4*>(src + ct * DQ_TILE + (4 * r + q) * 4);
            const float pair[2][2] = {{x.x * scale, x.y * scale}, {x.z * scale, x.w * scale}};
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = row0 + r + 8 * hf;
                if (row < seq.seqlen_q()) store_pair(row, c, pair[hf][0], pair[hf][1]);
            }
        }
        return;
    }
    if constexpr (Layout == DQ_STRIPS) {
        // Lane L's 16 bytes of a block's half: queries 2t and 2t + 1 (t = L % 4) of columns
        // L / 4 and L / 4 + 8; the strips' blocks of this tile are p.dq_accum_rows * 16 floats
        // apart.
        const float* block0 = p.dq_accum + accum_strip_block(seq, h, blockIdx.x, 0);
        for (int i = threadIdx.x; i < 4 * cols; i += blockDim.x) {
            const int lane = i % 32, half = i / 32 % 2, block = i / 64;
            const float4 x = *reinterpret_cast<const float4*>(
                block0 + static_cast<index_t>(block) * p.dq_accum_rows * 16 + (half * 32 + lane) * 4);
            const int r = half * 8 + lane % 4 * 2, c = block * 16 + lane / 4;
            strip[r * ld + c] = x.x;
            strip[(r + 1) * ld + c] = x.y;
            strip[r * ld + c + 8] = x.z;
            strip[(r + 1) * ld + c + 8] = x.w;
        }
        __syncthreads();
        for (int j = threadIdx.x; j < 8 * cols; j += blockDim.x) {   // column pairs, row by row
            const int r = j / (cols / 2), c = 2 * (j % (cols / 2));
            if (row0 + r < seq.seqlen_q() && c < p.headdim)
                store_pair(row0 + r, c, strip[r * ld + c] * scale, strip[r * ld + c + 1] * scale);
        }
        return;
    }
    for (int j = threadIdx.x; j < 16 * cols; j += blockDim.x) {
        const int e = j / 32 % 4, lane = j % 32;
        const int r = lane / 4 + (e >> 1) * 8, c = j / DQ_TILE * 8 + lane % 4 * 2 + (e & 1);
        strip[r * ld + c] = src[j];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < 16 * cols; j += blockDim.x) {
        const int r = j / cols, c = j % cols;
        if (row0 + r < seq.seqlen_q() && c < p.headdim)
            ElemTraits<Elem>::store(seq.template q_row<u16>(p.dq, h, row0 + r) + c, strip[r * ld + c] * scale);
    }
}

// lse (log2 units) and D of rows [row0, row0 + Rows) into sStats[0, Rows) and
// sStats[Rows, 2 Rows) by cp.async, so that the loads land under the math. Rows past the end
// read 0: their zero scores then have p = 2^mod(0), at most 1 for the built-in mods. A user
// score_mod can lift it past fp16's range (inf * 0 made dK, dV and the mod's array gradients
// NaN), so with one (Hide) those rows get lse = +inf, probability 0.
template <int Rows, int Threads, bool Hide, typename Seq>
__device__ __forceinline__ void load_row_stats(const BwdParams& p, const Seq& seq, float* sStats, int h, int row0) {
    static_assert(2 * Rows <= Threads, "one value per thread");
    const int r = threadIdx.x % Rows, row = row0 + r;
    const bool in = row < seq.seqlen_q();
    if (Hide && threadIdx.x < Rows && !in) {
        sStats[threadIdx.x] = __int_as_float(0x7f800000);
    } else if (threadIdx.x < 2 * Rows) {
        const float* src = stat_ptr<float>(threadIdx.x < Rows ? p.lse_log2 : p.dsum,
                                            seq, h, in ? row : 0);
        cp_async_4(smem_addr(sStats + threadIdx.x), src, in ? 4 : 0);
    }
}

// The largest multiple of 16 that divides W and is at most 64: the column chunk of dQ that
// a warp accumulates at a time, which bounds its registers whatever the head dim.
__host__ __device__ constexpr int dq_chunk(int W) {
    return W % 64 == 0 ? 64 : W % 48 == 0 ? 48 : W % 32 == 0 ? 32 : 16;
}

// dQ (Br x HeadDim) += dS K for one step: the warp's 16*KM rows x CW columns from col_w, CH at
// a time, added into the fp32 buffer (scaled in bwd_convert_dq_kernel). gdq is the thread's
// lane in the tile of the warp's first row and column 0 (dq_tile_lane); whole tiles are
// added, so no element needs a bounds check.
template <typename Elem, int HeadDim, int Bc, int KM, int CW, int CH, int LD, int LDP>
__device__ __forceinline__ void dq_step(u32 sdSta, u32 sKa, int lane, int row_w, int col_w, float* gdq) {
#pragma unroll 1
    for (int c0 = col_w; c0 < col_w + CW; c0 += CH) {
        float acc[KM][CH / 8][4];
#pragma unroll
        for (int km = 0; km < KM; ++km)
#pragma unroll
            for (int i = 0; i < CH / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[km][i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
            u32 a[KM][4];   // dS (queries x keys) read transposed from dS^T
#pragma unroll
            for (int km = 0; km < KM; ++km)
                ldmatrix_x4_trans(a[km], sdSta + ((kk * 16 + (lane & 7) + (lane >> 4) * 8) * LDP + row_w + km * 16 + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll
            for (int dp = 0; dp < CH / 16; ++dp) {
                u32 bk[4];
                ldmatrix_x4_trans(bk, sKa + ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + c0 + dp * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
                for (int km = 0; km < KM; ++km) {
                    mma_16816<Elem>(acc[km][2 * dp], a[km], bk[0], bk[1]);
                    mma_16816<Elem>(acc[km][2 * dp + 1], a[km], bk[2], bk[3]);
                }
            }
        }
        float* dst = gdq + c0 / 8 * DQ_TILE;   // then constant offsets: one address for all
#pragma unroll
        for (int km = 0; km < KM; ++km)
#pragma unroll
            for (int i = 0; i < CH / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    atomicAdd(dst + ((km * (HeadDim / 8) + i) * DQ_TILE + e * 32), acc[km][i][e]);
    }
}

// acc = A B^T - c over HeadDim, for the warp's 16*KM rows of A from row a0 and QW rows of B
// from row b0 (row-major shared-memory tiles of stride LD), c[j] subtracted from column j
// (B row b0 + j; none where c is null): S^T = K Q^T, dP^T - D = V dO^T - D. With Second,
// acc2 = A2 B2^T - c2 in the same loop (the fused pass: S^T and dP^T - D, so c2 is D).
template <typename Elem, int HeadDim, int KM, int QW, int LD, bool Second>
__device__ __forceinline__ void rows_times_rows(float (&acc)[KM][QW / 8][4], u32 sA, u32 sB, const float* c,
                                                float (&acc2)[KM][QW / 8][4], u32 sA2, u32 sB2, const float* c2,
                                                int a0, int b0, int lane) {
    const int t = lane % 4;
#pragma unroll
    for (int km = 0; km < KM; ++km)
#pragma unroll
        for (int i = 0; i < QW / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[km][i][e] = c ? -c[b0 + i * 8 + 2 * t + (e & 1)] : 0.f;
                if constexpr (Second) acc2[km][i][e] = c2 ? -c2[b0 + i * 8 + 2 * t + (e & 1)] : 0.f;
            }
#pragma unroll
    for (int ks = 0; ks < HeadDim / 16; ++ks) {
        u32 a[KM][4], a2[KM][4];
#pragma unroll
        for (int km = 0; km < KM; ++km) {
            const int off = ((a0 + km * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8) * 2;
            ldmatrix_x4(a[km], sA + off);
            if constexpr (Second) ldmatrix_x4(a2[km], sA2 + off);
        }
#pragma unroll
        for (int np = 0; np < QW / 16; ++np) {
            const int off = ((b0 + np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8) * 2;
            u32 bb[4], bb2[4];
            ldmatrix_x4(bb, sB + off);
            if constexpr (Second) ldmatrix_x4(bb2, sB2 + off);
#pragma unroll
            for (int km = 0; km < KM; ++km) {
                mma_16816<Elem>(acc[km][2 * np], a[km], bb[0], bb[1]);
                mma_16816<Elem>(acc[km][2 * np + 1], a[km], bb[2], bb[3]);
                if constexpr (Second) {
                    mma_16816<Elem>(acc2[km][2 * np], a2[km], bb2[0], bb2[1]);
                    mma_16816<Elem>(acc2[km][2 * np + 1], a2[km], bb2[2], bb2[3]);
                }
            }
        }
    }
}

// KM: 16-row slices a warp owns, of keys (S^T, dK, dV) and of queries (dQ). Two slices let a
// warp reuse each B operand it loads from shared memory twice, which this pass is bound by.
// Stages: buffers of Q, dO, lse and D. With two, the next step's are fetched at the top of a
// step and land under all of its math, and dQ (with its atomics) goes before dK/dV; with one,
// the fetch waits for the dK/dV product and lands under the dQ product only.
// The deterministic mode's kernels (AtomicDQ false) read every band at run time, none and
// causal as windows (the host's Variant: CallSpec.variant's band_at_run_time), as its dQ pass
// does: a third of the instantiations CI compiles. (Measured on the H200: the atomic mode's
// causal kernels lost 1-2% so, and keep theirs; the deterministic mode as a run-time skip of
// the dQ product spilled at head dim 128's 128-key tiles. benchmarks/NOTES.md.)
template <typename Elem, int HeadDim, int Bc, int Br, int NWarps, int KM, int Stages, typename V, bool AtomicDQ>
__global__ void __launch_bounds__(NWarps * 32)
flash_bwd_dkdv_kernel(const BwdParams p) {
    constexpr int Threads = NWarps * 32;
    constexpr int LD = HeadDim + SMEM_PAD;
    constexpr int LDP = Br + SMEM_PAD;        // rows of P^T and dS^T
    constexpr int WK = Bc / (16 * KM);        // warps along keys
    constexpr int WQ = NWarps / WK;           // ... along queries (S^T) and head dim (dK, dV)
    constexpr int QW = Br / WQ;               // queries of a warp's S^T slice
    constexpr int DW = HeadDim / WQ;          // head-dim columns of a warp's dK/dV slice
    constexpr int RT = Br / (16 * KM);        // dQ: row tiles of 16*KM rows ...
    constexpr int CS = NWarps / RT;           // ... times column splits
    constexpr int CW = HeadDim / CS;          // dQ columns of a warp
    static_assert(WK * WQ == NWarps && QW % 16 == 0 && DW % 16 == 0, "warp grid over keys x queries");
    static_assert(RT * CS == NWarps && CW % 16 == 0, "warp grid over the dQ tile");
    static_assert(Stages == 1 || Stages == 2, "one or two Q/dO buffers");

    // Shared memory: K, V, P^T, dS^T, then per stage Q, dO, lse and D.
    constexpr int STAGE = 2 * Br * LD * 2 + 2 * Br * 4;   // bytes
    extern __shared__ __align__(16) unsigned char smem[];
    u16* sK = reinterpret_cast<u16*>(smem);
    u16* sV = sK + Bc * LD;
    u16* sPt = sV + Bc * LD;
    u16* sdSt = sPt + Bc * LDP;
    unsigned char* stage0 = reinterpret_cast<unsigned char*>(sdSt + Bc * LDP);
    auto sQ_of = [&](int buf) { return reinterpret_cast<u16*>(stage0 + buf * STAGE); };
    auto stats_of = [&](int buf) { return reinterpret_cast<float*>(stage0 + buf * STAGE + 2 * Br * LD * 2); };

    // Causal: the first key blocks are seen by the most queries (the deterministic kernels
    // read every band at run time, a causal one too, and the host's launch groups with it).
    const BlockCoord at = block_coord<V::Causal || !AtomicDQ>(p, p.nheads_k, [](int i) { return i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<BwdParams, V::Seq> seq(p, at.batch);
    if (V::Varlen && at.tile * Bc >= seq.seqlen_k()) return;   // past a packed sequence's end
    Mask<V, BwdParams> mask(p);
    mask.at_batch(at.batch);
    ScoreMod<V, BwdParams> mod(p);
    Dropout drop(p, at.batch, 0);
    static_assert(!(V::Dropout && (V::Softcap || V::UserScore)), "the early P^T, or dS^T, would skip the dropout");
    const int hk = at.head, n_tile = at.tile;
    const int col0 = n_tile * Bc;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int qw = warp / WK;
    const int key0 = (warp % WK) * 16 * KM;   // the warp's first key in the block
    const bool vec_ok = p.vec_ok != 0;

    const u32 sKa = smem_addr(sK), sVa = smem_addr(sV);
    const u32 sPta = smem_addr(sPt), sdSta = smem_addr(sdSt);

    load_tile<Bc, HeadDim, Threads>(sK, seq.template k_row<const u16>(p.k, hk, col0), p.k.row_stride,
                                    seq.seqlen_k() - col0, p.headdim, vec_ok);
    load_tile<Bc, HeadDim, Threads>(sV, seq.template k_row<const u16>(p.v, hk, col0), p.v.row_stride,
                                    seq.seqlen_k() - col0, p.headdim, vec_ok);

    // The steps: (query head of the group, query block) pairs, heads without blocks skipped.
    struct Step { int hq, it; QueryBlocks qb; };
    auto blocks_of = [&](int hq) {
        return query_blocks(p.q_blocks, mask, hk * p.group + hq, n_tile, Br, Bc);
    };
    auto settle = [&](Step s) {   // move past heads whose list is exhausted
        while (s.hq < p.group && s.it >= s.qb.count) {
            ++s.hq;
            s.it = 0;
            if (s.hq < p.group) s.qb = blocks_of(s.hq);
        }
        return s;
    };
    auto prefetch = [&](const Step& s, int buf) {   // Q, dO, lse and D of step s into stage buf
        const int h = hk * p.group + s.hq;
        const int m0 = s.qb.block(s.it) * Br;
        u16* sQ = sQ_of(buf);
        load_tile<Br, HeadDim, Threads>(sQ, seq.template q_row<const u16>(p.q, h, m0), p.q.row_stride,
                                        seq.seqlen_q() - m0, p.headdim, vec_ok);
        load_tile<Br, HeadDim, Threads>(sQ + Br * LD, seq.template q_row<const u16>(p.dout, h, m0), p.dout.row_stride,
                                        seq.seqlen_q() - m0, p.headdim, vec_ok);
        load_row_stats<Br, Threads, V::UserScore>(p, seq, stats_of(buf), h, m0);
    };
    Step cur = settle(Step{0, 0, blocks_of(0)});
    if (cur.hq < p.group) prefetch(cur, 0);
    cp_async_commit();
    int buf = 0;

    // dQ: the warp's rows and columns.
    const int row_w = (warp % RT) * 16 * KM, col_w = (warp / RT) * CW;

    float dk[KM][DW / 8][4], dv[KM][DW / 8][4];
#pragma unroll
    for (int km = 0; km < KM; ++km)
#pragma unroll
        for (int i = 0; i < DW / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) { dk[km][i][e] = 0.f; dv[km][i][e] = 0.f; }

    // Fused: S^T and dP^T products in one loop, or S^T first, its exponentials issuing under
    // the dP^T products (+5% at d=128 non-causal; causal, with NVRTC 13.5, +3 to +4% at d=64
    // and +0 to +1% at d=128). Band kernels stay fused where split ones spill at the register
    // limit: single-buffered (sm_80's d=128 tile, the deterministic d=64 one) and the d=64
    // two-stage tile (see benchmarks/NOTES.md, Part 1 gate). Softcap kernels too: split, the
    // d=128 two-stage causal one spilled 8-36 bytes (NVRTC 13.5). A user score_mod's gradient
    // needs dP^T beside the raw S^T.
    constexpr bool Fused = (V::Band && (Stages == 1 || HeadDim <= 64)) || V::Softcap || V::UserScore;
    while (cur.hq < p.group) {
        const int m0 = cur.qb.block(cur.it) * Br;
        const bool masked = cur.qb.needs_mask(cur.it, m0, Br, Bc, col0, mask);
        const Step next = settle(Step{cur.hq, cur.it + 1, cur.qb});
        cp_async_wait<0>();
        __syncthreads();   // this step's Q, dO, lse, D have landed; every warp is done with the last step
        if constexpr (Stages == 2) {
            if (next.hq < p.group) prefetch(next, buf ^ 1);   // the stage the last step read
            cp_async_commit();
        }
        const u32 sQa = smem_addr(sQ_of(buf)), sdOa = sQa + Br * LD * 2;
        float* gdq = AtomicDQ ? dq_tile_lane(p, seq, hk * p.group + cur.hq, (m0 + row_w) / 16, lane) : nullptr;
        const float* sLse2 = stats_of(buf);
        const float* sD = sLse2 + Br;
        mod.at_head(seq.b, hk * p.group + cur.hq);
        mask.at_head(seq.b, hk * p.group + cur.hq);
        drop.at_head(p, seq.b, hk * p.group + cur.hq);
        // With dropout, D is subtracted after dP^T is dropped: dS^T = P^T (keep dP^T / (1 - p) - D).
        const float* sDsub = V::Dropout ? nullptr : sD;

        // S^T = K Q^T and dP^T - D = V dO^T - D for the warp's 16*KM keys x QW queries; D starts
        // the dP^T sums, one FADD per element less than subtracting it after (H100, NVRTC 13.5:
        // d=64 +3-4%, d=128 +1-2%).
        float st[KM][QW / 8][4], dpt[KM][QW / 8][4];
        rows_times_rows<Elem, HeadDim, KM, QW, LD, Fused>(st, sKa, sQa, nullptr, dpt, sVa, sdOa, sDsub, key0, qw * QW, lane);
        // Softcap: S^T to held values t (score_mod.cuh) before the mask, as the forward did.
        if constexpr (V::Softcap) {
#pragma unroll
            for (int km = 0; km < KM; ++km)
#pragma unroll
                for (int nt = 0; nt < QW / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[km][nt][e] = mod.held(st[km][nt][e]);
        }
        // Hidden keys. The band test depends on the row, so it runs only in blocks the band
        // cuts, behind a block-uniform branch, setting S = -inf (exp2 then gives exactly 0):
        // inline, it cost the causal pass 10%. The test for keys past seqlen_k is one compare
        // per key and stays inline, where it leaves the exponentials free to overlap the
        // products (behind a branch, before or after the dP^T products, the non-causal pass
        // lost 3-4%).
        // A user score_mod masks below, after its own step.
        if ((V::Band || V::UserMask) && !V::UserScore && masked) mask_scores<true>(st, mask, col0 + key0, m0 + qw * QW, lane);
        // P^T. With a softcap, whose gradient factor is read off t, P^T goes to shared memory
        // here and S^T keeps P^T times that factor, for dS^T: no second array of registers.
        using C = ScoreCoords<true>;
        const C at(col0 + key0, m0 + qw * QW, lane);
        const float dist0 = mod.dist0(at);
        if constexpr (V::UserScore) {
            // The user's score_mod, the mask, P^T and the whole of dS^T element by element:
            // its gradient takes the raw S^T and d loss / d its result, P^T (dP^T - D) (Fused).
#pragma unroll
            for (int km = 0; km < KM; ++km)
#pragma unroll
                for (int nt = 0; nt < QW / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = at.key0 + C::dkey(km, nt, e), query = at.query0() + C::dquery(km, nt, e);
                        const float raw = st[km][nt][e];
                        float pv = fast_exp2(fmaf(mod.user_score(raw, query, key), LOG2E,
                                                  -sLse2[qw * QW + nt * 8 + 2 * t + (e & 1)]));
                        if (masked && mask.hidden(query, key)) pv = 0.f;
                        dpt[km][nt][e] = mod.user_grad(raw, pv * dpt[km][nt][e], query, key, true);
                        st[km][nt][e] = pv;
                    }
        } else {
#pragma unroll
            for (int km = 0; km < KM; ++km)
#pragma unroll
                for (int nt = 0; nt < QW / 8; ++nt) {
                    float pv[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = col0 + key0 + km * 16 + g + (e >= 2 ? 8 : 0);
                        const float x = mod.bias_at(dist0, C::ddiff(km, nt, e), st[km][nt][e]);
                        pv[e] = fast_exp2(fmaf(x, mod.mult(), -sLse2[qw * QW + nt * 8 + 2 * t + (e & 1)]));
                        if (!V::Band && masked && key >= seq.seqlen_k()) pv[e] = 0.f;
                    }
                    if constexpr (V::Softcap)
                        store_acc_pairs<Elem>(sPt, LDP, key0 + km * 16 + g, qw * QW + nt * 8 + 2 * t, pv);
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[km][nt][e] = pv[e] * mod.grad(st[km][nt][e]);
                }
        }
        if constexpr (!Fused)
            rows_times_rows<Elem, HeadDim, KM, QW, LD, false>(dpt, sVa, sdOa, sDsub, dpt, 0, 0, nullptr, key0, qw * QW, lane);
        // Dropout: dS^T complete here, and P^T becomes the dropped, scaled weights of dV.
        if constexpr (V::Dropout)
            drop.for_each<true, KM, QW / 8>(col0 + key0, m0 + qw * QW, lane, [&](int km, int nt, int e, unsigned keep) {
                const float d = sD[qw * QW + nt * 8 + 2 * t + (e & 1)], pv = st[km][nt][e];
                dpt[km][nt][e] = pv * (keep ? fmaf(dpt[km][nt][e], drop.scale, -d) : -d);
                st[km][nt][e] = keep ? pv * drop.scale : 0.f;
            });

        // dS^T = P^T (dP^T - D) (times the softcap's factor, above); P^T and dS^T go through
        // shared memory (keeping P^T in registers spills at head dim 128).
#pragma unroll
        for (int km = 0; km < KM; ++km)
#pragma unroll
        for (int nt = 0; nt < QW / 8; ++nt) {
            if constexpr (!V::Dropout && !V::UserScore)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    dpt[km][nt][e] *= st[km][nt][e];
            const int c = qw * QW + nt * 8 + 2 * t;
            const int r = key0 + km * 16 + g;
            if constexpr (!V::Softcap) store_acc_pairs<Elem>(sPt, LDP, r, c, st[km][nt]);
            store_acc_pairs<Elem>(sdSt, LDP, r, c, dpt[km][nt]);
        }
        // dQ reads dS^T rows other warps wrote; for dK/dV, a warp that holds all Br queries of
        // its keys (WQ == 1) reads back only its own rows, and a warp barrier is enough.
        constexpr bool OwnRows = WQ == 1;
        if constexpr (AtomicDQ && Stages == 2) {
            __syncthreads();
            dq_step<Elem, HeadDim, Bc, KM, CW, dq_chunk(CW), LD, LDP>(sdSta, sKa, lane, row_w, col_w, gdq);
        } else if constexpr (OwnRows) {
            __syncwarp();
        } else {
            __syncthreads();
        }

        // dV += P^T dO and dK += dS^T Q for the warp's 16*KM keys x DW columns.
#pragma unroll
        for (int kk = 0; kk < Br / 16; ++kk) {
            u32 ap[KM][4], ads[KM][4];
#pragma unroll
            for (int km = 0; km < KM; ++km) {
                const int a_off = ((key0 + km * 16 + (lane & 15)) * LDP + kk * 16 + (lane >> 4) * 8) * 2;
                ldmatrix_x4(ap[km], sPta + a_off);
                ldmatrix_x4(ads[km], sdSta + a_off);
            }
#pragma unroll
            for (int dp = 0; dp < DW / 16; ++dp) {
                const int b_off = ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + qw * DW + dp * 16 + (lane >> 4) * 8) * 2;
                u32 bo[4], bq[4];
                ldmatrix_x4_trans(bo, sdOa + b_off);
                ldmatrix_x4_trans(bq, sQa + b_off);
#pragma unroll
                for (int km = 0; km < KM; ++km) {
                    mma_16816<Elem>(dv[km][2 * dp], ap[km], bo[0], bo[1]);
                    mma_16816<Elem>(dv[km][2 * dp + 1], ap[km], bo[2], bo[3]);
                    mma_16816<Elem>(dk[km][2 * dp], ads[km], bq[0], bq[1]);
                    mma_16816<Elem>(dk[km][2 * dp + 1], ads[km], bq[2], bq[3]);
                }
            }
        }

        if constexpr (Stages == 1) {
            __syncthreads();   // every warp is done with Q, dO (and P^T, dS^T): fetch the next step's
            if (next.hq < p.group) prefetch(next, 0);
            cp_async_commit();
            if constexpr (AtomicDQ)
                dq_step<Elem, HeadDim, Bc, KM, CW, dq_chunk(CW), LD, LDP>(sdSta, sKa, lane, row_w, col_w, gdq);
        }
        cur = next;
        buf ^= Stages - 1;
    }

    mod.flush_grads();
    // dK = scale * dS^T Q, staged in sK and dV in sV (neither read any more).
    dkdv_epilogue<Elem, Bc, HeadDim, Threads>(p, seq, hk, col0, key0, qw * DW, lane, vec_ok, dk, dv, sK, sV);
}

// Deterministic dQ: one thread block per (query block, head, batch), warps own 16 query rows,
// dQ stays in registers over the key blocks (the forward's iteration):
//   S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K.
// Every band (none and causal too) is a window read at run time (CallSpec.variant's
// band_at_run_time): a block is masked or not by run-time bounds anyway, and the band's
// compares fall in the masked blocks only.
template <typename Elem, int HeadDim, int Br, int Bc, int NWarps, typename V>
__global__ void __launch_bounds__(NWarps * 32)
flash_bwd_dq_kernel(const BwdParams p) {
    constexpr int Threads = NWarps * 32;
    constexpr int LD = HeadDim + SMEM_PAD;
    constexpr int NT = Bc / 8, DT = HeadDim / 8;
    static_assert(Br == 16 * NWarps && Bc % 16 == 0, "one 16-row slice per warp");

    extern __shared__ __align__(16) unsigned char smem[];
    u16* sQ = reinterpret_cast<u16*>(smem);
    u16* sdO = sQ + Br * LD;
    u16* sK = sdO + Br * LD;
    u16* sV = sK + Bc * LD;

    const int n_tiles = (p.seqlen_q + Br - 1) / Br;   // as in the forward
    // Longest first, in the host's launch groups where it sets them (causal calls).
    const BlockCoord at = block_coord<true>(p, p.nheads, [&](int i) { return n_tiles - 1 - i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<BwdParams, V::Seq> seq(p, at.batch);
    if (V::Varlen && at.tile * Br >= seq.seqlen_q()) return;   // past a packed sequence's end
    Mask<V, BwdParams> mask(p);
    const int h = at.head, hk = h / p.group;
    mask.at_head(at.batch, h);
    ScoreMod<V, BwdParams> mod(p);
    mod.at_head(at.batch, h);
    const Dropout drop(p, at.batch, h);
    const int qblock = at.tile;
    const int row0 = qblock * Br;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const bool vec_ok = p.vec_ok != 0;
    const u32 sQa = smem_addr(sQ), sdOa = smem_addr(sdO), sKa = smem_addr(sK), sVa = smem_addr(sV);

    load_tile<Br, HeadDim, Threads>(sQ, seq.template q_row<const u16>(p.q, h, row0), p.q.row_stride,
                                    seq.seqlen_q() - row0, p.headdim, vec_ok);
    load_tile<Br, HeadDim, Threads>(sdO, seq.template q_row<const u16>(p.dout, h, row0), p.dout.row_stride,
                                    seq.seqlen_q() - row0, p.headdim, vec_ok);
    cp_async_commit();

    // Row statistics of the thread's two rows (g and g+8 of the warp's slice).
    float lse2[2], dsum[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = row0 + warp * 16 + g + 8 * hf;
        lse2[hf] = __int_as_float(0x7f800000);   // rows past the end: probabilities 0
        dsum[hf] = 0.f;
        if (row < seq.seqlen_q()) {
            lse2[hf] = *stat_ptr<float>(p.lse_log2, seq, h, row);
            dsum[hf] = *stat_ptr<float>(p.dsum, seq, h, row);
        }
    }

    float dq[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[i][e] = 0.f;

    const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, qblock, Br, Bc);
    const u16* gK = seq.template k_row<const u16>(p.k, hk, 0);
    const u16* gV = seq.template k_row<const u16>(p.v, hk, 0);
    for (int it = 0; it < kb.count; ++it) {
        const int n0 = kb.block(it) * Bc;
        __syncthreads();   // every warp is done with the previous K and V
        load_tile<Bc, HeadDim, Threads>(sK, gK + n0 * p.k.row_stride, p.k.row_stride, seq.seqlen_k() - n0, p.headdim, vec_ok);
        load_tile<Bc, HeadDim, Threads>(sV, gV + n0 * p.v.row_stride, p.v.row_stride, seq.seqlen_k() - n0, p.headdim, vec_ok);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) { s[i][e] = 0.f; dp[i][e] = 0.f; }
#pragma unroll
        for (int ks = 0; ks < HeadDim / 16; ++ks) {
            u32 aq[4], ao[4];
            const int a_off = ((warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8) * 2;
            ldmatrix_x4(aq, sQa + a_off);
            ldmatrix_x4(ao, sdOa + a_off);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int b_off = ((np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8) * 2;
                u32 bk[4], bv[4];
                ldmatrix_x4(bk, sKa + b_off);
                ldmatrix_x4(bv, sVa + b_off);
                mma_16816<Elem>(s[2 * np], aq, bk[0], bk[1]);
                mma_16816<Elem>(s[2 * np + 1], aq, bk[2], bk[3]);
                mma_16816<Elem>(dp[2 * np], ao, bv[0], bv[1]);
                mma_16816<Elem>(dp[2 * np + 1], ao, bv[2], bv[3]);
            }
        }

        const bool masked = kb.needs_mask<V>(it, Bc);
        using C = ScoreCoords<false>;
        const C at(row0 + warp * 16, n0, lane);
        const float dist0 = mod.dist0(at);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hf = e >= 2;
                const int row = row0 + warp * 16 + g + 8 * hf, col = n0 + nt * 8 + 2 * t + (e & 1);
                const float raw = s[nt][e];
                const float held = V::UserScore ? mod.user_score(raw, row, col) : mod.held(raw);
                float pv = fast_exp2(fmaf(mod.bias_at(dist0, C::ddiff(0, nt, e), held), mod.mult(), -lse2[hf]));
                if (masked && mask.hidden(row, col)) pv = 0.f;
                if constexpr (V::UserScore)   // dS through the user's gradient (the dK/dV pass adds the arrays')
                    s[nt][e] = mod.user_grad(raw, pv * (dp[nt][e] - dsum[hf]), row, col, false);
                else
                    s[nt][e] = V::Dropout ? pv * mod.grad(held) : pv * (dp[nt][e] - dsum[hf]) * mod.grad(held);   // dS
            }
        if constexpr (V::Dropout)   // dS = P (keep dP / (1 - p) - D)
            drop.for_each<false, 1, NT>(row0 + warp * 16, n0, lane, [&](int, int n, int e, unsigned keep) {
                const float d = dsum[e / 2];
                s[n][e] *= keep ? fmaf(dp[n][e], drop.scale, -d) : -d;
            });

        // dQ += dS K, dS converted in registers to the A-operand layout.
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
            u32 a[4];
            a[0] = pack2<Elem>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<Elem>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<Elem>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<Elem>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
                u32 bk[4];
                ldmatrix_x4_trans(bk, sKa + ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp2 * 16 + (lane >> 4) * 8) * 2);
                mma_16816<Elem>(dq[2 * dp2], a, bk[0], bk[1]);
                mma_16816<Elem>(dq[2 * dp2 + 1], a, bk[2], bk[3]);
            }
        }
    }

    dq_epilogue<Elem, Br, HeadDim, Threads>(p, seq, h, row0, warp * 16, lane, vec_ok, dq, sQ);
}
