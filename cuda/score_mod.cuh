// The score step between q.k and the mask, in FlashAttention 2's order: scale, softcap, ALiBi
// bias. The NumPy mirror is cupyflash/_numpy_backend.py (_Scores).
//
// The tensor-core kernels keep *held* values in the score fragment: the raw q.k without
// softcap (the scale then folds into the softmax's exp2, softmax.cuh), t = tanh(q.k * scale /
// softcap) with it. `mult` turns a held value into log2 units; the ALiBi bias is added in held
// units; and the gradient of the logit by q.k * scale is read off the held value (1, or
// 1 - t^2), so that the backward keeps no second array of scores.
#pragma once
#include "common.cuh"
#include "mask.cuh"

// tanh.approx: one MUFU operation (relative error below 2^-10.9). On the H200 the exact form
// 1 - 2 / (exp2(2x log2 e) + 1), two MUFU operations beside the softmax's exp2, made the d=128
// forward 25-32% slower than plain attention (benchmarks/NOTES.md); the approximation's error
// on the logits, softcap * t * 2^-11 <= |q.k scale| * 2^-11, is the size of the fp16 rounding of
// the scores, and these kernels take fp16/bf16 inputs (the plain fp32/fp64 kernels use tanh).
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <typename V, typename Params>
struct ScoreMod {
    const Params& p;
    float bias;   // ALiBi: the bias per unit of distance for this (batch, head), in held units
    int b = 0, h = 0;   // the batch entry and query head a user score_mod is asked about
    SeqLens<V::Seq> lens;   // the entry's lengths (ALiBi's diagonal, the user's clamps)
    mutable typename UserGradsOf<V::UserScore>::type grads;   // the thread's running sums to a user score_mod's gradients

    __device__ __forceinline__ explicit ScoreMod(const Params& params) : p(params), bias(0.f) {}

    // The held value -> log2 units factor. A user score_mod's held values are its results, in
    // natural units.
    __device__ __forceinline__ float mult() const {
        return V::UserScore ? LOG2E : V::Softcap ? p.mod.softcap_log2 : p.scale_log2;
    }

    // The held values are at most 1 (softcap's tanh with no bias after it), so the online
    // softmax may keep the fixed base 0 instead of a running max: no max to reduce before the
    // exponentials and no rescaling of O. The host allows it where p = exp2(t * mult) stays
    // well inside the range of the kernel's P (cupyflash/_launch.py, BOUNDED_LOG2).
    __device__ __forceinline__ bool bounded() const {
        return capped_alone() && p.mod.bounded;
    }
    // softcap's tanh is the whole modifier (no bias, no user score_mod).
    static __host__ __device__ constexpr bool capped_alone() { return V::Softcap && !V::Alibi && !V::UserScore; }

    // Select the slopes of (batch b, head h).
    __device__ __forceinline__ void at_head(int batch, int head) {
        b = batch;
        h = head;
        if constexpr (V::Alibi)
            bias = p.mod.alibi[static_cast<index_t>(batch) * p.mod.alibi_stride + head] * p.mod.alibi_unit;
        if constexpr (V::Alibi || V::UserScore) lens.at(p, batch);
    }

    // The user's score_mod of a raw q.k at (query, key), and d loss / d (q.k * scale) from
    // d loss / d its result (adding to the arrays' gradients where `accumulate`). Coordinates
    // are clamped into the sequences as in Mask::user_hides (but by a caller that knows them
    // inside: `inside`).
    template <bool Clamp = true>
    __device__ __forceinline__ float user_score(float raw, int query, int key) const {
        return V::Mods::score(p.user, raw * p.mod.scale, b, h, Clamp ? min(query, lens.q(p) - 1) : query,
                              Clamp ? min(key, lens.k(p) - 1) : key);
    }
    __device__ __forceinline__ float user_grad(float raw, float dscore, int query, int key, bool accumulate) const {
        return V::Mods::grad(p.user, raw * p.mod.scale, dscore, b, h, min(query, lens.q(p) - 1),
                             min(key, lens.k(p) - 1), accumulate, grads);
    }
    // Whether all of a thread's elements of an M x N fragment lie in the sequences: their
    // coordinates then need no clamp (user_score<false>), and their offsets fold into the
    // snippet's arithmetic (benchmarks/NOTES.md).
    template <bool Transposed, int M, int N>
    __device__ __forceinline__ bool inside(const ScoreCoords<Transposed>& at) const {
        using C = ScoreCoords<Transposed>;
        return at.query0() + C::template max_dquery<M, N>() < lens.q(p) && at.key0 + C::template max_dkey<M, N>() < lens.k(p);
    }
    // The running sums to memory, after the thread's last user_grad.
    __device__ __forceinline__ void flush_grads() const {
        if constexpr (V::UserScore) flush_user_grads(p.user, grads);
    }

    // The held value of a raw score.
    __device__ __forceinline__ float held(float s) const {
        if constexpr (V::Softcap)
            return fast_tanh(s * p.mod.softcap_in);
        else
            return s;
    }

    // d logit / d (q.k * scale) from the held value. A masked score held as -inf gets 0
    // (its probability is 0 too; 1 - inf^2 would make 0 * -inf = NaN).
    __device__ __forceinline__ float grad(float t) const {
        if constexpr (V::Softcap)
            return fmaxf(fmaf(-t, t, 1.f), 0.f);
        else
            return 1.f;
    }

    // ALiBi distances |key - query - shift| of a fragment's elements are |dist0 + ddiff| with
    // ddiff a compile-time constant (ScoreCoords): dist0 is the lane's base, exact in float
    // below 2^24.
    template <bool Transposed>
    __device__ __forceinline__ float dist0(const ScoreCoords<Transposed>& at) const {
        return static_cast<float>(at.diff0 - (lens.k(p) - lens.q(p)));
    }
    // The bias of the element at distance offset ddiff from the lane's base.
    __device__ __forceinline__ float bias_at(float dist0, int ddiff, float held_value) const {
        return V::Alibi ? fmaf(bias, fabsf(dist0 + static_cast<float>(ddiff)), held_value) : held_value;
    }

    // The modifier is a bias of the element's position alone (ALiBi without softcap, whose bias
    // follows the tanh): a kernel may write it into S's accumulators before the product is
    // issued onto them (bias_into), off the chain between S's landing and the softmax.
    static __host__ __device__ constexpr bool positional() { return V::Alibi && !V::Softcap; }

    // The user's score_mod over a fragment; its coordinates clamped into the sequences or not.
    template <bool Clamp, bool Transposed, int M, int N>
    __device__ __forceinline__ void user_apply(float (&s)[M][N][4], const ScoreCoords<Transposed>& at) const {
        using C = ScoreCoords<Transposed>;
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[m][n][e] = user_score<Clamp>(s[m][n][e], at.query0() + C::dquery(m, n, e), at.key0 + C::dkey(m, n, e));
    }
    // A snippet that reads a table per score (V::Mods::Gathers) over a fragment (of S, col0 its
    // block's first key) that reaches past a sequence's end: rows past it take the last row
    // (their results are dropped), and each n8 tile of keys goes by a branch its warp takes
    // together: wholly inside, unclamped; wholly past the end, left alone (the mask hides those
    // keys); across the end, its keys clamped. Clamping every element (user_apply<true>) made a
    // fragment's 64 table addresses at once: 300-450 bytes of spills at head dim 64; for a
    // snippet that reads no table the clamps are cheap and these branches cost more (user
    // ALiBi at 8000 keys 3.5% slower; benchmarks/NOTES.md).
    template <int M, int N>
    __device__ __forceinline__ void user_apply_tail(float (&s)[M][N][4], const ScoreCoords<false>& at, int col0) const {
        using C = ScoreCoords<false>;
        const int keys_in = lens.k(p) - col0, last_q = lens.q(p) - 1, last_k = lens.k(p) - 1;
        auto tile = [&](int m, int n, bool clamp_keys) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = at.key0 + C::dkey(m, n, e);
                s[m][n][e] = user_score<false>(s[m][n][e], min(at.query0() + C::dquery(m, n, e), last_q),
                                               clamp_keys ? min(key, last_k) : key);
            }
        };
        // Only rows past the end (the last query tile): one copy without branches, whose
        // loads run together (its tiles through the branches below measured 5.7% slower).
        if (keys_in >= 8 * N) {
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n) tile(m, n, false);
            return;
        }
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; ++n) {
                if (8 * n >= keys_in) continue;
                if (8 * n + 8 <= keys_in)
                    tile(m, n, false);
                else
                    tile(m, n, true);
            }
    }

    // Held values plus bias for a fragment of raw scores (the forward: nothing needs t after),
    // or the user's score_mod of them (unclamped inside the sequences: all but the tiles at
    // their ends).
    template <bool Transposed, int M, int N>
    __device__ __forceinline__ void apply(float (&s)[M][N][4], int row0, int col0, int lane) const {
        if constexpr (V::UserScore) {
            const ScoreCoords<Transposed> at(row0, col0, lane);
            if (inside<Transposed, M, N>(at))
                user_apply<false>(s, at);
            else if constexpr (V::Mods::Gathers && !Transposed)
                user_apply_tail(s, at, col0);
            else
                user_apply<true>(s, at);
        } else if constexpr (V::Softcap || V::Alibi) {
            using C = ScoreCoords<Transposed>;
            const C at(row0, col0, lane);
            const float d0 = dist0(at);
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[m][n][e] = bias_at(d0, C::ddiff(m, n, e), held(s[m][n][e]));
        }
    }

    // The positional bias alone of a fragment's elements, into s.
    template <bool Transposed, int M, int N>
    __device__ __forceinline__ void bias_into(float (&s)[M][N][4], int row0, int col0, int lane) const {
        static_assert(positional(), "a bias of the position alone");
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[m][n][e] = 0.f;
        apply<Transposed>(s, row0, col0, lane);
    }
};

// The plain kernels' score step, at T's own precision, on x = q.k * scale in the kernel's base
// (unit = log2(e) for float, 1 for double; generic.cu): the logit of (query, key), and in `aux`
// what `backprop` needs: d logit / d x (softcap), or the user score_mod's argument.
template <typename V, typename T>
struct PlainScoreMod {
    T cap;     // softcap * unit
    T bias;    // -slope * unit of the selected head
    int b, h, seqlen_q, seqlen_k;   // the selected entry's lengths
    mutable typename UserGradsOf<V::UserScore>::type grads;   // as ScoreMod's

    template <typename Params>
    __device__ __forceinline__ PlainScoreMod(const Params& p)
        : cap(static_cast<T>(p.mod.softcap) * unit()), bias(0), b(0), h(0), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {}

    static __device__ __forceinline__ T unit() { return sizeof(T) == 4 ? T(LOG2E) : T(1); }

    template <typename Params>
    __device__ __forceinline__ void at_head(const Params& p, int batch, int head) {
        b = batch;
        h = head;
        if constexpr (V::Alibi) bias = -static_cast<T>(p.mod.alibi[static_cast<index_t>(batch) * p.mod.alibi_stride + head]) * unit();
        if constexpr (V::Varlen) {
            SeqLens<SEQ_PACKED> lens;
            lens.at(p, batch);
            seqlen_q = lens.sq;
            seqlen_k = lens.sk;
        }
    }

    template <typename Params>
    __device__ __forceinline__ T operator()(const Params& p, T x, int query, int key, T& aux) const {
        aux = T(1);
        if constexpr (V::UserScore) {
            aux = x / unit();
            return V::Mods::score(p.user, aux, b, h, min(query, seqlen_q - 1), min(key, seqlen_k - 1)) * unit();
        }
        if constexpr (V::Softcap) {
            T t;
            if constexpr (sizeof(T) == 4) t = tanhf(x / cap); else t = tanh(x / cap);
            x = cap * t;
            aux = T(1) - t * t;
        }
        if constexpr (V::Alibi) {
            const int dist = query + seqlen_k - seqlen_q - key;
            x += bias * T(dist < 0 ? -dist : dist);
        }
        return x;
    }

    // d loss / d x from d loss / d logit, with the `aux` of the same element.
    template <typename Params>
    __device__ __forceinline__ T backprop(const Params& p, T dlogit, T aux, int query, int key, bool accumulate) const {
        if constexpr (V::UserScore)
            return V::Mods::grad(p.user, aux, dlogit, b, h, min(query, seqlen_q - 1), min(key, seqlen_k - 1), accumulate,
                                 grads);
        else
            return dlogit * aux;
    }
    template <typename Params>
    __device__ __forceinline__ void flush_grads(const Params& p) const {
        if constexpr (V::UserScore) flush_user_grads(p.user, grads);
    }
};
