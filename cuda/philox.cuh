// Dropout's random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), a counter-based generator. A keep bit is a pure function of (seed,
// offset, batch, head, row, col), so the backward regenerates the forward's mask instead of
// storing seqlen_q x seqlen_k bits, and any kernel layout (the forward's query rows, the dK/dV
// pass's transposed key rows) finds the same bit from the element's coordinates alone.
//
// The layout of the counter, mirrored bit for bit by cupyflash/dropout.py (its docstring is the
// spec; tests/test_dropout.py checks the two agree on a GPU):
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (gj, gi, b * nheads + h, offset), gi = (i / 16) * 8 + i % 8 (gj likewise of j)
//   element (i, j) takes word 2 * ((i / 8) % 2) + (j / 8) % 2 of the four;
//   kept iff word >= threshold (threshold = p * 2**32 rounded, at most 2**32 - 1).
// One call serves the four elements {i, i+8} x {j, j+8} that one thread holds in an mma.sync
// m16n8 accumulator fragment (rows r and r + 8; with two n8 tiles, columns c and c + 8): the
// forward and the transposed dK/dV pass each use all four words of a call, no shuffles.
//
// Self-contained (no other header) so that it compiles alone, in tests, and in every family.
// No kernel includes it yet (tests/test_dropout.py does): the dropout step of the kernels
// will, and must keep the layout above.
#pragma once

constexpr unsigned PHILOX_M0 = 0xD2511F53u;   // round multipliers (Random123's constants)
constexpr unsigned PHILOX_M1 = 0xCD9E8D57u;
constexpr unsigned PHILOX_W0 = 0x9E3779B9u;   // key bumps (golden ratio, sqrt(3) - 1)
constexpr unsigned PHILOX_W1 = 0xBB67AE85u;

__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {               // the first round uses the key as given
            key.x += PHILOX_W0;
            key.y += PHILOX_W1;
        }
        // __umulhi is one mul.hi.u32: the high half of the 64-bit product.
        const unsigned hi0 = __umulhi(PHILOX_M0, ctr.x), lo0 = PHILOX_M0 * ctr.x;
        const unsigned hi1 = __umulhi(PHILOX_M1, ctr.z), lo1 = PHILOX_M1 * ctr.z;
        ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    }
    return ctr;
}

__device__ __forceinline__ uint2 philox_key(unsigned long long seed) {
    return make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
}

// The group coordinate of row (or column) i: rows i and i + 8 of a 16-row band share one.
__device__ __forceinline__ unsigned dropout_group(unsigned i) { return (i >> 4) * 8 + (i & 7); }

// The four words of the group (gi, gj) of head `bh` (= b * nheads + h).
__device__ __forceinline__ uint4 dropout_words(unsigned bh, unsigned gi, unsigned gj,
                                               unsigned offset, uint2 key) {
    return philox4x32_10(make_uint4(gj, gi, bh, offset), key);
}

// Keep bits of a group: bit 2 * a + c is element (i + 8a, j + 8c) of the group whose first
// element is (i, j) with i % 16 < 8 and j % 16 < 8 (the word order above).
__device__ __forceinline__ unsigned dropout_keep_bits(uint4 w, unsigned threshold) {
    return unsigned(w.x >= threshold) | unsigned(w.y >= threshold) << 1 |
           unsigned(w.z >= threshold) << 2 | unsigned(w.w >= threshold) << 3;
}
