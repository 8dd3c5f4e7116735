// Online softmax (FlashAttention 2 order): running row max m and running sum l, the output
// accumulator rescaled only when the max moves, normalized once at the end.
//
// Convention, written once here: the scores are held values (score_mod.cuh: q.k unscaled, or
// capped by tanh), the kernels work in base 2 with `mult` (ScoreMod::mult: scale * log2(e)
// for raw scores) turning them into log2 units, p = exp2(s * mult - m * mult), and the stored
// log-sum-exp is in natural log: lse = (m * mult + log2(l)) / log2(e) (-inf for a row that
// sees no key).
//
// Where the scores are bounded above (ScoreMod::bounded), P is bf16 and the kernel allows it
// (Fixable), m stays at the fixed base 0: p = exp2(s * mult), with no max reduced before the
// exponentials and no rescaling.
// The row's largest p is then not exactly 1, so its rounding to bf16 no longer cancels in
// O / l (a row with one key would be off by that rounding): O is divided by the sum of the
// rounded p (lr) that multiplied V, and the lse keeps the sum of the exact ones (l). The
// kernel has the tensor cores add the rounded p up (P times a column of ones, beside P V)
// and gives the rows' sums (rounded_sums): rounded and added here, per score, they cost more.
#pragma once
#include "common.cuh"

// op over get(0) .. get(N - 1) in Chains interleaved chains, then the chains combined: a
// dependency chain of about N / Chains + 2 steps instead of N.
template <int Chains, int N, typename Get, typename Op>
__device__ __forceinline__ float chained_reduce(Get&& get, Op&& op) {
    constexpr int C = Chains < N ? Chains : N;
    float acc[C];
#pragma unroll
    for (int i = 0; i < C; ++i) acc[i] = get(i);
#pragma unroll
    for (int i = C; i < N; ++i) acc[i % C] = op(acc[i % C], get(i));
#pragma unroll
    for (int w = 1; w < C; w *= 2)
#pragma unroll
        for (int i = 0; i + w < C; i += 2 * w) acc[i] = op(acc[i], acc[i + w]);
    return acc[0];
}

// Rows = the number of accumulator rows a thread holds (two per m16 tile of mma.sync).
// Chains > 1: a row's max and sum over a block in that many interleaved chains (the Hopper
// forward, where one warp per scheduler runs its softmax while the other's products run and
// the chains' latency shows); 1: element after element (the generic kernels, whose other
// warps hide it).
// P: the 16-bit type the probabilities are rounded to before they multiply V.
// Fixable: the kernel may take the fixed base (its P is bf16, and it gives rounded_sums).
template <int Rows, int Chains = 1, typename P = fp16, bool Fixable = false>
struct OnlineSoftmax {
    static_assert(!Fixable || same_type<P, bf16>, "the fixed base is bf16's");
    float m[Rows];    // running max of the raw scores of the row (0 where fixed)
    float l[Rows];    // this thread's part of the running sum (quad-reduced in finalize)
    float lr[Rows];   // where fixed: the row's sum of the p as rounded to P (rounded_sums)
    bool fixed;       // the base is 0 throughout (Fixable, and the scores bounded at run time)

    __device__ __forceinline__ void init(bool bounded = false) {
        fixed = Fixable && bounded;
#pragma unroll
        for (int r = 0; r < Rows; ++r) { m[r] = fixed ? 0.f : neg_inf(); l[r] = lr[r] = 0.f; }
    }

    // s: scores of one key block as mma accumulators [MT][NT][4] (elements 0,1 belong to
    // row 2*mt, elements 2,3 to row 2*mt+1), replaced by the probabilities p; acc: the output
    // accumulators [MT][DT][4], rescaled to the new max. Once the maxima settle, most blocks
    // move no row max of a warp; the warp then skips the rescale, whose factors would all be 1.
    template <int MT, int NT, int DT>
    __device__ __forceinline__ void update(float (&s)[MT][NT][4], float (&acc)[MT][DT][4],
                                           float mult) {
        float alpha[Rows], base[Rows];
        if (new_max(s, mult, alpha, base)) rescale(acc, alpha);
        exponentiate(s, mult, base);
    }

    // update in two steps, for a kernel whose acc is still being written by a matrix multiply
    // while the scores of the next block are exponentiated (the Hopper forward): step turns s
    // into p and returns whether acc needs rescale(acc, alpha) before it is accumulated into
    // again. Settled: the rows' maxima settle (new_max), so that past the first blocks almost
    // no block rescales O, where with exact maxima some row of a warp's 16 moved in most blocks
    // (on random scores a row's max moves at block j about once in j blocks).
    template <bool Settled, int MT, int NT>
    __device__ __forceinline__ bool step(float (&s)[MT][NT][4], float mult, float (&alpha)[Rows]) {
        if constexpr (Fixable)
            if (fixed) {   // p = exp2(s * mult), its exact sum added to l
                const float zero[Rows] = {};
                exponentiate(s, mult, zero);
                return false;
            }
        float base[Rows];
        const bool moved = new_max<Settled>(s, mult, alpha, base);
        exponentiate(s, mult, base);
        return moved;
    }

    template <int MT, int DT>
    __device__ __forceinline__ void rescale(float (&acc)[MT][DT][4], const float (&alpha)[Rows]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[2 * mt + e / 2];
    }

    // The rows' new maxima over s; alpha the factor of the old sums (applied to l here) and
    // base the new max in log2 units. True where some row of the warp moved its max.
    // Settled: a row keeps its max m while the block's stays within 8 of it in log2 units (s *
    // mult), and moves to the block's past that. Every p is then below 2^8, and the key that
    // set m keeps p = 1, so l >= 1 and a key that did not set m weighs at most 256/257. Where
    // a softmax on the exact max gives a weight that rounds to exactly 1 (its p is 1: a row one
    // key dominates), that key set m here too; other weights round as they do there (the same
    // relative rounding of p: 2^8 is far inside fp16's range).
    template <bool Settled = false, int MT, int NT>
    __device__ __forceinline__ bool new_max(const float (&s)[MT][NT][4], float mult, float (&alpha)[Rows],
                                            float (&base)[Rows]) {
        static_assert(2 * MT == Rows, "two accumulator rows per m16 tile");
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = 2 * mt + hf;
                auto pair_max = [&](int nt) { return fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]); };
                float mx = m[r];
                if constexpr (Chains == 1) {
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, pair_max(nt));
                } else {
                    mx = fmaxf(mx, chained_reduce<Chains, NT>(pair_max, [](float a, float b) { return fmaxf(a, b); }));
                }
                mx = quad_max(mx);
                if constexpr (Settled) {
                    constexpr float slack = 8.f;
                    if (m[r] != neg_inf() && __fmul_rn(mx, mult) - __fmul_rn(m[r], mult) <= slack) mx = m[r];
                }
                // A row that has seen no key yet keeps the base at 0, so exp2 gives 0, not NaN.
                base[r] = mx == neg_inf() ? 0.f : mx * mult;
                // Rounded like base: fused into an FMA, the product's rounding residual made
                // alpha 2^residual instead of 1 when the max stays, and l drifted by that
                // factor once per key block (lse off by 2e-3 at 1M keys).
                alpha[r] = fast_exp2(__fmul_rn(m[r], mult) - base[r]);
                moved |= mx != m[r];
                m[r] = mx;
                l[r] *= alpha[r];
            }
        }
        return __any_sync(0xffffffffu, moved);
    }

    // p = exp2(s * mult - base), added to this thread's part of l (or of sum).
    template <int MT, int NT>
    __device__ __forceinline__ void exponentiate(float (&s)[MT][NT][4], float mult, const float (&base)[Rows]) {
        exponentiate(s, mult, base, l);
    }
    template <int MT, int NT>
    __device__ __forceinline__ void exponentiate(float (&s)[MT][NT][4], float mult, const float (&base)[Rows],
                                                 float (&sum)[Rows]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 2 * mt + e / 2;
                    const float p = fast_exp2(fmaf(s[mt][nt][e], mult, -base[r]));
                    s[mt][nt][e] = p;
                    if constexpr (Chains == 1) sum[r] += p;
                }
        if constexpr (Chains > 1) add_row_sums(s, sum);
    }

    // Whether a row of the thread has no max yet (no key seen).
    __device__ __forceinline__ bool fresh() const {
        bool any = false;
#pragma unroll
        for (int r = 0; r < Rows; ++r) any |= m[r] == neg_inf();
        return any;
    }
    // The settled step without the block's max (the Hopper forward, rows that have a max):
    // p on the rows' current bases at once, the thread's part of each row's sum of them into
    // part. True where some part passes 2^8, so that some p may have (or is inf): then the
    // block's p are not to be used, and the caller computes its scores again and takes the
    // exact step (step<false>), whose max moves to the block's; else it adds part (add_sums).
    // So every p used is at most 2^8 and the key that set a row's base keeps p = 1 (l >= 1),
    // which is what new_max<true>'s slack keeps too (see there).
    template <int MT, int NT>
    __device__ __forceinline__ bool speculate(float (&s)[MT][NT][4], float mult, float (&part)[Rows]) {
        float base[Rows];
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
            base[r] = __fmul_rn(m[r], mult);
            part[r] = 0.f;
        }
        exponentiate(s, mult, base, part);
        bool big = false;
#pragma unroll
        for (int r = 0; r < Rows; ++r) big |= part[r] > 256.f;
        return big;
    }
    __device__ __forceinline__ void add_sums(const float (&part)[Rows]) {
#pragma unroll
        for (int r = 0; r < Rows; ++r) l[r] += part[r];
    }

    // Each row's sum over s, a pair at a time in Chains interleaved chains, added to sum.
    template <int MT, int NT>
    __device__ __forceinline__ void add_row_sums(const float (&s)[MT][NT][4], float (&sum)[Rows]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                sum[2 * mt + hf] += chained_reduce<Chains, NT>(
                    [&](int nt) { return s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1]; },
                    [](float a, float b) { return a + b; });
    }

    // Where fixed: each row's sum of its p as rounded, from the tensor cores.
    __device__ __forceinline__ void rounded_sums(const float (&sums)[Rows]) {
        static_assert(Fixable, "only a kernel that may fix the base");
#pragma unroll
        for (int r = 0; r < Rows; ++r) lr[r] = sums[r];
    }

    // Sum l over the quad; return 1/l per row (0 for a row without keys) and write the
    // natural-log lse into lse_out. Only a sum of exactly 0 is a row without keys: a NaN sum
    // (NaN in q or k, a +inf score) keeps out and lse NaN rather than passing for empty.
    // Approx: 1 / l and log2(l) by the MUFU's approximations (a few ulp: below the 16-bit
    // outputs' rounding, and 2^-22 absolute on the lse) instead of IEEE division and log2f's
    // sequences, which were a measurable part of the Hopper forward's epilogue.
    template <bool Approx = false>
    __device__ __forceinline__ void finalize(float mult, float (&inv_l)[Rows],
                                             float (&lse_out)[Rows]) {
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
            const float sum = quad_sum(l[r]);
            // Every lane shuffles (quad_sum): a row without keys must not skip it.
            const float norm = Fixable && fixed ? lr[r] : sum;
            const bool empty = sum == 0.f;
            if constexpr (Approx) {
                inv_l[r] = empty ? 0.f : __fdividef(1.f, norm);
                lse_out[r] = empty ? neg_inf() : (m[r] * mult + __log2f(sum)) * (1.f / LOG2E);
            } else {
                inv_l[r] = empty ? 0.f : 1.f / norm;
                lse_out[r] = empty ? neg_inf() : (m[r] * mult + log2f(sum)) / LOG2E;
            }
        }
    }
};
