// Dropout of the attention probabilities (FlashAttention 2): each element (b, h, query, key)
// is kept with probability 1 - p and its weight scaled by 1 / (1 - p), p at 1/256 resolution
// (cupyflash/dropout.py); the row sums (l, lse) are those of the undropped softmax. The bits
// come from philox.cuh's generator, a function of the element's coordinates alone, so the
// backward regenerates the forward's mask in its own (transposed) layout.
// cupyflash/dropout.py computes the same bits (dropout_mask).
#pragma once
#include "params.cuh"
#include "philox.cuh"

struct Dropout {
    uint2 key;
    unsigned threshold, offset, bh;
    float scale;

    template <typename Params>
    __device__ __forceinline__ Dropout(const Params& p, int b, int h)
        : key(philox_key(p.drop.seed)), threshold(p.drop.threshold), offset(p.drop.offset),
          bh(static_cast<unsigned>(b) * p.nheads + h), scale(static_cast<float>(p.drop.scale)) {}

    // Select query head h (the dK/dV pass walks the heads of a group).
    template <typename Params>
    __device__ __forceinline__ void at_head(const Params& p, int b, int h) {
        bh = static_cast<unsigned>(b) * p.nheads + h;
    }

    // Calls f(m, n, e, keep) for each element of a score fragment s[M][N][4] laid out as
    // ScoreCoords says (rows from row0, columns from col0; rows are queries, or keys when
    // Transposed). A generator call serves the thread's elements of one group (philox.cuh):
    // rows r + 8a of MB m16 slices times column c of NB n8 tiles, all 16 bytes when the
    // fragment spans 32 x 32 (MB = 2, NB = 4), else the half or quarter of them it holds.
    // row0 is a multiple of 16 * MB and col0 of 8 * NB (the callers' warp offsets), so a
    // group's bytes sit at fixed places when it spans its whole band.
    template <bool Transposed, int M, int N, typename F>
    __device__ __forceinline__ void for_each(int row0, int col0, int lane, F&& f) const {
        constexpr int MB = M >= 2 ? 2 : 1, NB = N >= 4 ? 4 : N;
        constexpr int PerCall = 2 * MB * NB, Calls = (M / MB) * (N / NB) * 2;
        static_assert(M % MB == 0 && N % NB == 0 && Calls * PerCall <= 64, "the keep bits fit 64");
        // The 8-row (8-column) part of the band where the fragment's first slice starts.
        const unsigned row_part = MB == 2 ? 0 : (row0 / 8) & 3, col_part = NB == 4 ? 0 : (col0 / 8) & 3;
        // First the keep bits (a call's four words live briefly, its bits in one 64-bit word),
        // then the fragment's elements in their fixed places. Unrolled: calls overlap each
        // other's latency (one call at a time was 10-15% slower on the H200).
        unsigned long long bits = 0;
#pragma unroll
        for (int call = 0; call < Calls; ++call) {
            const int c = call & 1, nb = (call >> 1) % (N / NB), mb = (call >> 1) / (N / NB);
            const unsigned row = row0 + lane / 4 + 16 * MB * mb, col = col0 + 2 * (lane % 4) + c + 8 * NB * nb;
            const uint4 w = dropout_words(bh, dropout_group(Transposed ? col : row),
                                          dropout_group(Transposed ? row : col), offset, key);
            unsigned mine = 0;
#pragma unroll
            for (int mm = 0; mm < MB; ++mm)
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int nn = 0; nn < NB; ++nn) {
                        const unsigned rp = row_part + 2 * mm + a, cp = col_part + nn;
                        mine |= unsigned(dropout_kept(w, Transposed ? cp : rp, Transposed ? rp : cp, threshold))
                                << ((2 * mm + a) * NB + nn);
                    }
            bits |= static_cast<unsigned long long>(mine) << (call * PerCall);
        }
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int call = ((m / MB) * (N / NB) + n / NB) * 2 + (e & 1);
                    const int bit = call * PerCall + (2 * (m % MB) + e / 2) * NB + n % NB;
                    f(m, n, e, unsigned(bits >> bit) & 1);
                }
    }

    // The keep bit of one element (the plain kernels).
    __device__ __forceinline__ bool keep(unsigned query, unsigned key_) const {
        return dropout_kept(dropout_words(bh, dropout_group(query), dropout_group(key_), offset, key),
                            (query / 8) & 3, (key_ / 8) & 3, threshold);
    }
};
