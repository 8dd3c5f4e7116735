// The backward's row pieces that the generic passes (bwd.cu) and the Hopper family
// (bwd_sm90.cu) share: the row statistics, the fp32 dQ buffer's tile order, and the
// preprocess's units of rows (its D, lse in log2 units and the buffer's zeroed tiles), which
// bwd.cu's bwd_preprocess_kernel writes a block a unit before the passes and bwd_sm90.cu's
// bwd_preprocess_beside_kernel writes beside its pass.
#pragma once
#include "common.cuh"
#include "seqinfo.cuh"

// Row `row` of head h of a row statistic (lse, D, lse in log2 units).
template <typename Acc, typename Seq>
__device__ __forceinline__ Acc* stat_ptr(const void* base, const Seq& seq, int h, int row) {
    return static_cast<Acc*>(const_cast<void*>(base)) + seq.stat(h, row);
}

// lse in log2 units for exp2(s * mult - lse2); a row that saw no key (lse = -inf) gets
// +inf, so that its probabilities are exactly 0.
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == neg_inf() ? __int_as_float(0x7f800000) : lse * LOG2E;
}

// The fp32 dQ buffer: dQ of each (batch, head) in tiles of 16 rows x 8 columns, row-major,
// each tile in the order of an mma accumulator (register e of lane L at e * 32 + L), so that
// the 32 lanes adding one register write 128 contiguous bytes, one memory line, where a
// row-major buffer spreads them over 8 rows. Tile (rt, ct) of (b, h) starts at float
// (((b * nheads + h) * (dq_accum_rows / 16) + rt) * (dq_accum_cols / 8) + ct) * DQ_TILE.
// The Hopper pass (bwd_sm90.cu) adds whole tiles by the copy engine from a stage that each
// thread fills with one 16-byte store per tile: its tiles are lane-major (register e of lane
// L at L * 4 + e). Its 80-query kernel makes dQ^T, whose fragments hold 2 queries x 2
// columns 8 apart, and adds a warp's 16 columns x 80 queries at once: its buffer is in column
// strips (seqinfo.cuh's accum_strip_block) of 16 x 16 blocks, each its queries 0-7 and then
// 8-15 as 16 columns x 8 queries lane-major (DQ_STRIPS).
constexpr int DQ_TILE = 16 * 8;
enum DqLayout { DQ_MMA = 0, DQ_LANES = 1, DQ_STRIPS = 2 };

// The thread's lane in tile `tile` (rows 16 tile ..), column 0, of head h of seq's entry.
template <typename Seq>
__device__ __forceinline__ float* dq_tile_lane(const BwdParams& p, const Seq& seq, int h, int tile, int lane) {
    return p.dq_accum + seq.accum_tile(h, tile) * (p.dq_accum_cols / 8) * DQ_TILE + lane;
}

// Rows and threads per block of bwd_preprocess_kernel, and the largest block of
// bwd_convert_dq_kernel (its loops stride by blockDim): the host launches them with
// _launch.PREPROCESS_ROWS, PREPROCESS_THREADS and DQ_CONVERT_THREADS (tests/test_params.py).
constexpr int PREPROCESS_ROWS = 64, PREPROCESS_THREADS = 256;
constexpr int DQ_CONVERT_THREADS = 256;

// The fp32 dQ buffer's 16-row tiles of row block x (PREPROCESS_ROWS rows) of head h zeroed, one
// contiguous span of whole tiles in either tile order; the block with the last row also zeroes
// the tiles after it up to a multiple of ACCUM_ALIGN rows, into which the passes' whole query
// blocks (up to 128 rows) add too. Thread tid of Threads.
template <int Threads, typename Seq>
__device__ __forceinline__ void zero_dq_rows(const BwdParams& p, const Seq& seq, int h, int x, int dq_strips, int tid) {
    if (p.dq_accum != nullptr) {
        constexpr int TILES = PREPROCESS_ROWS / 16;
        const int sq = seq.seqlen_q(), tile0 = x * TILES;
        const int end = x == (sq - 1) / PREPROCESS_ROWS ? (sq + ACCUM_ALIGN - 1) / ACCUM_ALIGN * (ACCUM_ALIGN / 16)
                                                         : tile0 + TILES;
        const int tiles = tile0 * 16 < sq ? end - tile0 : 0;
        // In strips: one span per strip.
        const int spans = dq_strips ? p.dq_accum_cols / 16 : 1, n = tiles * 16 * p.dq_accum_cols / 4 / spans;
        for (int s = 0; tiles > 0 && s < spans; ++s) {
            float4* span = reinterpret_cast<float4*>(dq_strips ? p.dq_accum + accum_strip_block(seq, h, tile0, s)
                                                               : dq_tile_lane(p, seq, h, tile0, 0));
            for (int i = tid; i < n; i += Threads) span[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
}


// bwd_sm90.cu's bwd_preprocess_beside_kernel: the warps that sum rows, the groups that write
// units, and the warps in each, every one of which adds 1 to a unit's flag once it is written.
constexpr int BESIDE_LOADERS = 8, BESIDE_WRITERS = 4, BESIDE_ARRIVALS = 4;

// Until a unit's flag is set (that kernel's flags: batch, query head, PREPROCESS_ROWS-row
// block): every warp that writes the unit has released its writes.
__device__ __forceinline__ void wait_unit(const int* flag) {
    while (ld_acquire(flag) < BESIDE_ARRIVALS) {
    }
}
