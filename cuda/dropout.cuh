// Dropout of the attention probabilities (FlashAttention 2): each element (b, h, query, key)
// is kept with probability 1 - p and its weight scaled by 1 / (1 - p); the row sums (l, lse)
// are those of the undropped softmax. The bits come from philox.cuh's generator, a function of
// the element's coordinates alone, so the backward regenerates the forward's mask in its own
// (transposed) layout. cupyflash/dropout.py computes the same bits (dropout_mask).
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
    // ScoreCoords says (rows from row0, columns from col0, both multiples of 16; rows are
    // queries, or keys when Transposed). One generator call per group: the elements
    // (m, n, c), (m, n, c + 2), (m, n + 1, c), (m, n + 1, c + 2) of an even n are rows r, r + 8
    // and columns k, k + 8 of one thread.
    template <bool Transposed, int M, int N, typename F>
    __device__ __forceinline__ void for_each(int row0, int col0, int lane, F&& f) const {
        static_assert(N % 2 == 0, "groups span two n8 tiles");
        const unsigned r0 = row0 + lane / 4, c0 = col0 + 2 * (lane % 4);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; n += 2)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const unsigned row = r0 + m * 16, col = c0 + n * 8 + c;
                    const unsigned query = Transposed ? col : row, key_ = Transposed ? row : col;
                    const unsigned bits = dropout_keep_bits(
                        dropout_words(bh, dropout_group(query), dropout_group(key_), offset, key),
                        threshold);
                    // Bit 2a + b: query + 8a, key + 8b; the fragment's row half is e / 2, its
                    // column half the second n8 tile.
                    f(m, n, c, bits & 1);
                    f(m, n, c + 2, (bits >> (Transposed ? 1 : 2)) & 1);
                    f(m, n + 1, c, (bits >> (Transposed ? 2 : 1)) & 1);
                    f(m, n + 1, c + 2, (bits >> 3) & 1);
                }
    }

    // The keep bit of one element (the plain kernels).
    __device__ __forceinline__ bool keep(unsigned query, unsigned key_) const {
        const uint4 w = dropout_words(bh, dropout_group(query), dropout_group(key_), offset, key);
        const unsigned word = ((query >> 3) & 1) * 2 + ((key_ >> 3) & 1);
        return (word == 0 ? w.x : word == 1 ? w.y : word == 2 ? w.z : w.w) >= threshold;
    }
};
