// Which keys a query row may see: the sequence bounds and the band, aligned to the bottom-right
// corner (FlashAttention 2.1+): with shift = seqlen_k - seqlen_q, query i sees key j when
// i + shift - left <= j <= i + shift + right. Causal is the band (-inf, 0]. The Python mirror
// is cupyflash/_spec.py (key_range, query_range); the host clips left to [0, seqlen_k] and
// right to [0, seqlen_q] (unbounded sides included), so no sum here leaves 32 bits.
#pragma once
#include "common.cuh"
#include "variant.cuh"
#include "seqinfo.cuh"

template <typename V, typename Params>
struct Mask {
    const Params& p;   // seqlen_q, seqlen_k, and the band of a local Variant
    int b = 0, h = 0;  // the batch entry and query head a user mask_mod is asked about
    SeqLens<V::Seq> lens;   // the entry's lengths (packed sequences differ)

    __device__ __forceinline__ explicit Mask(const Params& params) : p(params) {}
    __device__ __forceinline__ void at_head(int batch, int head) {
        b = batch;
        h = head;
        lens.at(p, batch);
    }

    // The entry's lengths alone, for a pass that walks several heads (at_head per head).
    __device__ __forceinline__ void at_batch(int batch) { lens.at(p, batch); }

    __device__ __forceinline__ int seqlen_q() const { return lens.q(p); }
    __device__ __forceinline__ int seqlen_k() const { return lens.k(p); }

    // The first key row `row` sees (0 unless a window bounds the left side).
    __device__ __forceinline__ int key_begin(int row) const {
        if constexpr (V::Local) {
            const int begin = row + seqlen_k() - seqlen_q() - p.window_left;
            return begin > 0 ? begin : 0;
        } else {
            return 0;
        }
    }
    // One past the last key row `row` sees (<= key_begin when it sees none).
    __device__ __forceinline__ int key_end(int row) const {
        if constexpr (V::Causal || V::Local) {
            const int end = row + 1 + seqlen_k() - seqlen_q() + (V::Local ? p.window_right : 0);
            return end < seqlen_k() ? end : seqlen_k();
        } else {
            return seqlen_k();
        }
    }
    // The first query row that sees key `col`.
    __device__ __forceinline__ int query_begin(int col) const {
        if constexpr (V::Causal || V::Local) {
            const int begin = col - (seqlen_k() - seqlen_q()) - (V::Local ? p.window_right : 0);
            return begin > 0 ? begin : 0;
        } else {
            return 0;
        }
    }
    // One past the last query row that sees key `col`.
    __device__ __forceinline__ int query_end(int col) const {
        if constexpr (V::Local) {
            const int end = col - (seqlen_k() - seqlen_q()) + p.window_left + 1;
            return end < seqlen_q() ? end : seqlen_q();
        } else {
            return seqlen_q();
        }
    }
    // The user's mask_mod hides key `col` from row `row`. Coordinates past the sequences are
    // clamped into them (their elements are hidden by the bounds anyway), so that the
    // snippet's array reads stay inside arrays sized by the sequences.
    __device__ __forceinline__ bool user_hides(int row, int col) const {
        if constexpr (V::UserMask)
            return !V::Mods::mask(p.user, b, h, min(row, seqlen_q() - 1), min(col, seqlen_k() - 1));
        else
            return false;
    }
    // Key `col` is hidden from row `row` (both inside their sequences or not).
    __device__ __forceinline__ bool hidden(int row, int col) const {
        return col >= key_end(row) || (V::Local && col < key_begin(row)) || user_hides(row, col);
    }
};

// Where the elements of a score fragment lie: mma accumulator tiles s[M][N][4], element e of
// tile (m, n) at row m*16 + lane/4 + 8*(e/2), column n*8 + 2*(lane%4) + e%2 from (row0, col0).
// Rows are queries and columns keys, or, Transposed (the dK/dV pass's S^T), the other way round.
// Every per-element step (mask, ALiBi bias) is written on the key and on key - query, which
// differ from the lane's element 0 by compile-time constants: the steps cost one operation with
// an immediate per element and no register per row or column (a per-row key_end took the
// 255-register dK/dV kernels over).
template <bool Transposed>
struct ScoreCoords {
    int key0, diff0;   // key, and key - query, of the lane's element 0 of tile (0, 0)

    __device__ __forceinline__ ScoreCoords(int row0, int col0, int lane) {
        const int r = row0 + lane / 4, c = col0 + 2 * (lane % 4);
        key0 = Transposed ? r : c;
        diff0 = Transposed ? r - c : c - r;
    }
    // The query of the lane's element 0 of tile (0, 0).
    __device__ __forceinline__ int query0() const { return key0 - diff0; }
    // Offsets of element e of tile (m, n) from element 0 of tile (0, 0).
    static __host__ __device__ constexpr int dkey(int m, int n, int e) { return Transposed ? m * 16 + (e & 2) * 4 : n * 8 + (e & 1); }
    static __host__ __device__ constexpr int dquery(int m, int n, int e) { return dkey(m, n, e) - ddiff(m, n, e); }
    static __host__ __device__ constexpr int ddiff(int m, int n, int e) {
        return Transposed ? m * 16 + (e & 2) * 4 - n * 8 - (e & 1) : n * 8 + (e & 1) - m * 16 - (e & 2) * 4;
    }
    // The largest key and query offsets of an M x N fragment's elements.
    template <int M, int N>
    static __host__ __device__ constexpr int max_dkey() { return dkey(M - 1, N - 1, 3); }
    template <int M, int N>
    static __host__ __device__ constexpr int max_dquery() { return dquery(M - 1, N - 1, 3); }
};

// The user's mask_mod over a fragment's elements (ScoreCoords), one bit each (element e of tile
// (m, n) at bit (m N + n) 4 + e): set where it hides the element. Made apart from the scores, so
// that a kernel can run the snippet (and wait for its array reads) while the tensor cores still
// make them.
template <int M, int N>
struct HiddenBits {
    u32 w[(M * N * 4 + 31) / 32];
    __device__ __forceinline__ bool operator()(int i) const { return (w[i / 32] >> (i % 32)) & 1u; }
};
template <bool Transposed, int M, int N, typename V, typename Params>
__device__ __forceinline__ HiddenBits<M, N> user_hidden_bits(const Mask<V, Params>& mask, int row0, int col0, int lane) {
    using C = ScoreCoords<Transposed>;
    const C at(row0, col0, lane);
    HiddenBits<M, N> bits{};
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = (m * N + n) * 4 + e;
                if (mask.user_hides(at.query0() + C::dquery(m, n, e), at.key0 + C::dkey(m, n, e)))
                    bits.w[i / 32] |= 1u << (i % 32);
            }
    return bits;
}

// The bounds' and the band's test of a fragment's elements (ScoreCoords): on the element's
// constant offsets from the lane's element 0, one compare each.
template <bool Transposed, typename V, typename Params>
struct FragmentBand {
    using C = ScoreCoords<Transposed>;
    int diff_hi, diff_lo, key_hi;

    __device__ __forceinline__ FragmentBand(const Mask<V, Params>& mask, const C& at) {
        const int shift = mask.seqlen_k() - mask.seqlen_q();
        diff_hi = shift + (V::Local ? mask.p.window_right : 0) - at.diff0;
        diff_lo = shift - (V::Local ? mask.p.window_left : 0) - at.diff0;
        key_hi = mask.seqlen_k() - at.key0;
    }
    // Element e of tile (m, n) lies past the keys or outside the band.
    __device__ __forceinline__ bool hides(int m, int n, int e) const {
        const int ddiff = C::ddiff(m, n, e);
        return (V::Band && ddiff > diff_hi) || C::dkey(m, n, e) >= key_hi || (V::Local && ddiff < diff_lo);
    }
};

// Sets to -inf the scores of a fragment (ScoreCoords) that the mask hides (the user's
// mask_mod too: user_hides(element index, query, key), by default the snippet itself).
// exp2 of -inf is exactly 0, so the softmax and the gradients need nothing else.
template <bool Transposed, typename V, typename Params, int M, int N, typename UserHides>
__device__ __forceinline__ void mask_scores(float (&s)[M][N][4], const Mask<V, Params>& mask, int row0, int col0,
                                            int lane, const UserHides& user_hides) {
    using C = ScoreCoords<Transposed>;
    const C at(row0, col0, lane);
    const FragmentBand<Transposed, V, Params> band(mask, at);
    // band.hides' test, written out: through the call ptxas canonicalized the window kernels'
    // compares differently (the same count), and these kernels were measured as they are.
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ddiff = C::ddiff(m, n, e);
                if ((V::Band && ddiff > band.diff_hi) || C::dkey(m, n, e) >= band.key_hi ||
                    (V::Local && ddiff < band.diff_lo) ||
                    user_hides((m * N + n) * 4 + e, at.query0() + C::dquery(m, n, e), at.key0 + C::dkey(m, n, e)))
                    s[m][n][e] = neg_inf();
            }
}
template <bool Transposed, typename V, typename Params, int M, int N>
__device__ __forceinline__ void mask_scores(float (&s)[M][N][4], const Mask<V, Params>& mask, int row0, int col0,
                                            int lane) {
    mask_scores<Transposed>(s, mask, row0, col0, lane,
                            [&](int, int query, int key) { return mask.user_hides(query, key); });
}
// The same with the user mask_mod's verdicts read from `verdicts` (user_hidden_bits of a fragment
// whose element `bit0` is this fragment's first) instead of running the snippet.
template <bool Transposed, typename V, typename Params, int M, int N, int VM, int VN>
__device__ __forceinline__ void mask_scores(float (&s)[M][N][4], const Mask<V, Params>& mask, int row0, int col0,
                                            int lane, const HiddenBits<VM, VN>& verdicts, int bit0) {
    mask_scores<Transposed>(s, mask, row0, col0, lane, [&](int i, int, int) { return verdicts(bit0 + i); });
}
