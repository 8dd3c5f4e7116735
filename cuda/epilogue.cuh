// One epilogue per pass of the tensor-core kernels: a warp's accumulator fragments, scaled per
// row, go as 16-bit pairs to a shared-memory stage (a tile the main loop no longer reads),
// and the block's tile leaves in 16-byte rows (store_tile) through SeqInfo's addressing. The
// forward's also turns the online softmax's statistics into 1/l and lse. Any family whose
// accumulators have mma.sync's per-warp layout (rows g and g + 8 of each m16 slice, columns
// 2t and 2t + 1 of each n8 tile) ends its passes here; a pass that writes elsewhere (partial
// results of a split key range, say) changes these functions, not the kernels.
#pragma once
#include "common.cuh"
#include "seqinfo.cuh"
#include "softmax.cuh"

// Waits until the stage is free: every asynchronous copy has landed (with no key block, the
// first tile may still be landing) and every warp is done reading.
__device__ __forceinline__ void epilogue_begin() {
    cp_async_wait<0>();
    __syncthreads();
}

// acc[M][N][4]: m16 x n8 fragments whose first row is row0, element pairs (0, 1) on row
// 16 m + g and (2, 3) on row 16 m + g + 8, column 8 n + 2 t; each row is multiplied by
// factor(m, half) (half 0 or 1) on its way to the stage, pair (r, c) landing at element
// offset(r, c), then done(m, half, row) runs.
template <typename Elem, int M, int N, typename Offset, typename Factor, typename Done>
__device__ __forceinline__ void stage_pairs(u16* stage, int row0, const float (&acc)[M][N][4], int lane,
                                            Offset&& offset, Factor&& factor, Done&& done) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = row0 + 16 * m + g + 8 * hf;
            const float f = factor(m, hf);
#pragma unroll
            for (int n = 0; n < N; ++n)
                *reinterpret_cast<u32*>(stage + offset(r, 8 * n + 2 * t)) =
                    pack2<Elem>(acc[m][n][2 * hf] * f, acc[m][n][2 * hf + 1] * f);
            done(m, hf, r);
        }
}

// stage_pairs into rows of LD elements, from column col0.
template <typename Elem, int LD, int M, int N, typename Factor, typename Done>
__device__ __forceinline__ void stage_rows(u16* stage, int row0, int col0, const float (&acc)[M][N][4],
                                           int lane, Factor&& factor, Done&& done) {
    stage_pairs<Elem>(stage, row0, acc, lane, [=](int r, int c) { return r * LD + col0 + c; }, factor, done);
}

template <typename Elem, int LD, int M, int N>
__device__ __forceinline__ void stage_rows(u16* stage, int row0, int col0, const float (&acc)[M][N][4],
                                           int lane, float factor) {
    stage_rows<Elem, LD>(stage, row0, col0, acc, lane, [=](int, int) { return factor; }, [](int, int, int) {});
}

// The forward: O = acc / l (times out_scale: dropout's 1 / (1 - p)) of the warp's rows from
// wrow, lse of every valid row, for the query block at row0 of head h. `stage` is the Q tile.
template <typename Elem, int Br, int HeadDim, int Threads, int MT, int DT, typename Seq>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const Seq& seq, int h, int row0,
                                             int rows_valid, int wrow, int lane, bool vec_ok, OnlineSoftmax<2 * MT>& softmax,
                                             float mult, float out_scale, const float (&acc)[MT][DT][4],
                                             u16* stage) {
    float inv_l[2 * MT], lse[2 * MT];
    softmax.finalize(mult, inv_l, lse);
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) inv_l[r] *= out_scale;
    epilogue_begin();
    // Each row's lse goes out right after its O: ptxas scheduled a separate loop of lse stores
    // 5% slower at d=128 (benchmarks/NOTES.md).
    stage_rows<Elem, HeadDim + SMEM_PAD>(
        stage, wrow, 0, acc, lane, [&](int m, int hf) { return inv_l[2 * m + hf]; },
        [&](int m, int hf, int r) {
            if (row0 + r < seq.seqlen_q() && lane % 4 == 0)
                static_cast<float*>(p.lse)[seq.stat(h, row0 + r)] = lse[2 * m + hf];
        });
    __syncthreads();
    store_tile<Br, HeadDim, Threads>(stage, seq.template q_row<u16>(p.o, h, row0), p.o.row_stride, rows_valid,
                                     p.headdim, vec_ok);
}

// Element offset of (row r, column c) in a stage of 64-column sub-tiles of Rows rows in the
// 128-byte-swizzled layout that wgmma descriptors and tensor maps with that swizzle read
// (16-byte chunk j of row r at chunk j ^ (r % 8)): a warp's 4-byte stores of an accumulator
// row pair hit every bank once.
template <int Rows>
__device__ __forceinline__ int swizzled_offset(int r, int c) {
    return (c / 64 * Rows + r) * 64 + ((c % 64 / 8) ^ (r % 8)) * 8 + c % 8;
}

// Rows [0, rows) of a stage of Chunks swizzled sub-tiles of 64 rows x 64 columns
// (swizzled_offset<64>) to the rows from `dst` (row_stride elements apart), the columns below
// `cols` (a multiple of 8) only, 16 bytes per thread and step, by Threads threads (tid: the
// thread's index among them). For a tile the copy engine may not store whole: the last tile of
// a packed sequence, whose rows past the sequence's end are the next sequence's.
template <int Chunks, int Threads>
__device__ __forceinline__ void copy_stage_rows(const u16* stage, u16* dst, index_t row_stride, int rows, int cols,
                                                int tid) {
    for (int i = tid; i < 64 * Chunks * 8; i += Threads) {
        const int r = i / (Chunks * 8), c = i % (Chunks * 8) * 8;
        if (r < rows && c < cols)
            *reinterpret_cast<uint4*>(dst + r * row_stride + c) =
                *reinterpret_cast<const uint4*>(stage + swizzled_offset<64>(r, c));
    }
}

// stage_pairs into a swizzled stage of Rows rows (swizzled_offset), rows from wrow.
template <typename Elem, int Rows, int M, int N, typename Factor>
__device__ __forceinline__ void stage_swizzled(u16* stage, int wrow, int lane, const float (&acc)[M][N][4],
                                               Factor&& factor) {
    stage_pairs<Elem>(stage, wrow, acc, lane, [](int r, int c) { return swizzled_offset<Rows>(r, c); }, factor,
                      [](int, int, int) {});
}

// The forward for a kernel that stores O with the copy engine (the Hopper forward): O = acc /
// l of the warp's 16 rows from wrow into a swizzled stage of Rows rows, lse of the valid rows
// straight to memory. row0 is the stage's first row in the sequence. Stores by stmatrix (sm_90):
// two n8 tiles of the warp's 16 rows, 16-byte rows of four 8 x 8 matrices, per instruction.
template <typename Elem, int Rows, int MT, int DT, int Chains, bool Fixable, typename Seq>
__device__ __forceinline__ void fwd_stage_swizzled(const FwdParams& p, const Seq& seq, int h, int row0,
                                                   int wrow, int lane, OnlineSoftmax<2 * MT, Chains, Elem, Fixable>& softmax, float mult,
                                                   const float (&acc)[MT][DT][4], u16* stage) {
    static_assert(MT == 1 && DT % 2 == 0, "a warp's 16 rows, tiles in pairs");
    float inv_l[2], lse[2];
    softmax.template finalize<true>(mult, inv_l, lse);
    // Lane L gives row L % 8 of matrix L / 8: rows + 8 for the odd matrices, the second tile's
    // columns for the last two.
    const int r = wrow + lane % 8 + 8 * (lane / 8 % 2), c = 8 * (lane / 16);
    const u32 base = smem_addr(stage);
#pragma unroll
    for (int n = 0; n < DT; n += 2)
        stmatrix_x4(base + 2 * swizzled_offset<Rows>(r, 8 * n + c),
                    pack2<Elem>(acc[0][n][0] * inv_l[0], acc[0][n][1] * inv_l[0]),
                    pack2<Elem>(acc[0][n][2] * inv_l[1], acc[0][n][3] * inv_l[1]),
                    pack2<Elem>(acc[0][n + 1][0] * inv_l[0], acc[0][n + 1][1] * inv_l[0]),
                    pack2<Elem>(acc[0][n + 1][2] * inv_l[1], acc[0][n + 1][3] * inv_l[1]));
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = wrow + 16 * m + lane / 4 + 8 * hf;
            if (lane % 4 == 0 && row0 + r < seq.seqlen_q())
                static_cast<float*>(p.lse)[seq.stat(h, row0 + r)] = lse[2 * m + hf];
        }
}

// The forward's O = acc / l and lse of the warp's two rows from row (row pairs of the
// accumulators' layout, 4-byte stores; columns past p.headdim and rows past the sequence's end
// skipped) straight to memory, without a stage: for a tile without key blocks in the Hopper
// forward above head dim 128, whose stages are its blocks' V buffers.
template <typename Elem, int DT, typename Seq>
__device__ __forceinline__ void fwd_store_rows(const FwdParams& p, const Seq& seq, int h, int row, int lane,
                                               const float (&acc)[1][DT][4], const float (&inv_l)[2],
                                               const float (&lse)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = row + lane / 4 + 8 * hf;
        if (r < 0 || r >= seq.seqlen_q()) continue;
        u16* out = seq.template q_row<u16>(p.o, h, r);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const int c = 8 * dt + 2 * (lane % 4);
            if (c < p.headdim)
                *reinterpret_cast<u32*>(out + c) = pack2<Elem>(acc[0][dt][2 * hf] * inv_l[hf], acc[0][dt][2 * hf + 1] * inv_l[hf]);
        }
        if (lane % 4 == 0) static_cast<float*>(p.lse)[seq.stat(h, r)] = lse[hf];
    }
}

// The dK/dV pass: dK = scale * dk and dV = dv of the warp's keys from key0 and head-dim
// columns from col, for the key block at col0 of kv head hk, staged in sK and sV.
template <typename Elem, int Bc, int HeadDim, int Threads, int KM, int DN, typename Seq>
__device__ __forceinline__ void dkdv_epilogue(const BwdParams& p, const Seq& seq, int hk, int col0,
                                              int key0, int col, int lane, bool vec_ok,
                                              const float (&dk)[KM][DN][4], const float (&dv)[KM][DN][4],
                                              u16* sK, u16* sV) {
    epilogue_begin();
    const float scale = static_cast<float>(p.scale);
    stage_rows<Elem, HeadDim + SMEM_PAD>(sK, key0, col, dk, lane, scale);
    stage_rows<Elem, HeadDim + SMEM_PAD>(sV, key0, col, dv, lane, 1.f);
    __syncthreads();
    store_tile<Bc, HeadDim, Threads>(sK, seq.template k_row<u16>(p.dk, hk, col0), p.dk.row_stride, seq.seqlen_k() - col0,
                                     p.headdim, vec_ok);
    store_tile<Bc, HeadDim, Threads>(sV, seq.template k_row<u16>(p.dv, hk, col0), p.dv.row_stride, seq.seqlen_k() - col0,
                                     p.headdim, vec_ok);
}

// The deterministic dQ pass: dQ = scale * dq of the warp's 16 rows from wrow, for the query
// block at row0 of head h, staged in `stage` (the Q tile).
template <typename Elem, int Br, int HeadDim, int Threads, int DT, typename Seq>
__device__ __forceinline__ void dq_epilogue(const BwdParams& p, const Seq& seq, int h, int row0,
                                            int wrow, int lane, bool vec_ok, const float (&dq)[DT][4], u16* stage) {
    epilogue_begin();
    const float scale = static_cast<float>(p.scale);
    stage_rows<Elem, HeadDim + SMEM_PAD>(stage, wrow, 0, reinterpret_cast<const float(&)[1][DT][4]>(dq), lane, scale);
    __syncthreads();
    store_tile<Br, HeadDim, Threads>(stage, seq.template q_row<u16>(p.dq, h, row0), p.dq.row_stride, seq.seqlen_q() - row0,
                                     p.headdim, vec_ok);
}
