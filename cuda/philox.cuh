// Dropout's random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), a counter-based generator. A keep bit is a pure function of (seed,
// offset, batch, head, row, col), so the backward regenerates the forward's mask instead of
// storing seqlen_q x seqlen_k bits, and any kernel layout (the forward's query rows, the dK/dV
// pass's transposed key rows) finds the same bit from the element's coordinates alone.
//
// The layout of the counter, mirrored bit for bit by cupyflash/dropout.py (its docstring is the
// spec; tests/test_dropout.py checks the two agree on a GPU):
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (gj, gi, b * nheads + h, offset), gi = (i / 32) * 8 + i % 8 (gj likewise of j)
//   element (i, j) takes byte (j / 8) % 4 of word (i / 8) % 4 of the four (16 bytes, 16
//   elements: rows i + {0, 8, 16, 24} x columns j + {0, 8, 16, 24});
//   kept iff byte >= threshold (threshold = round(256 p), 1..255 for p > 0).
// One call serves the 16 elements a thread holds of 32 rows x 32 columns of mma.sync m16n8
// accumulator fragments (rows r + 8a of two m16 slices, column c of four n8 tiles), in the
// forward and in the transposed dK/dV pass alike: no shuffles, and a quarter of the calls of
// one word per element. 8-bit randoms are FlashAttention 2's resolution.
//
// Self-contained (no other header) so that it compiles alone, in tests, and in every family.
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

// The group coordinate of row (or column) i: rows i + {0, 8, 16, 24} of a 32-row band share one.
__device__ __forceinline__ unsigned dropout_group(unsigned i) { return (i >> 5) * 8 + (i & 7); }

// The 16 random bytes of the group (gi, gj) of head `bh` (= b * nheads + h).
__device__ __forceinline__ uint4 dropout_words(unsigned bh, unsigned gi, unsigned gj,
                                               unsigned offset, uint2 key) {
    return philox4x32_10(make_uint4(gj, gi, bh, offset), key);
}

// Whether the element of row part `a` ((i / 8) % 4) and column part `c` ((j / 8) % 4) of a
// group is kept. Constant parts fold the word choice and the shift away.
__device__ __forceinline__ bool dropout_kept(uint4 w, unsigned a, unsigned c, unsigned threshold) {
    const unsigned word = a == 0 ? w.x : a == 1 ? w.y : a == 2 ? w.z : w.w;
    return ((word >> (8 * c)) & 0xffu) >= threshold;
}
