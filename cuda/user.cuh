// User mods: a score_mod and a mask_mod written by the caller as CUDA C++ snippets
// (cupyflash/mods.py). The host splices them into the source, right after this header, as the
// static members of a `struct UserMods` shaped like NoMods below; the kernels take that type
// as the Variant's `Mods` argument and call it from the score step (score_mod.cuh) and the
// mask (mask.cuh). Every other kernel takes NoMods, whose members are never called.
//
// A snippet sees the score (score_mod), the coordinates (b, h, q_idx, kv_idx) and the caller's
// arrays by name, as UserArray views over UserParams; a score_mod's gradient snippet also sees
// dscore (d loss / d modified score) and a GradArray `d_<name>` per array it differentiates.
#pragma once
#include "params.cuh"

// Row-major offsets into a C-contiguous array of the table (shapes in UserParams).
template <int N>
struct UserShape {
    const int* dims;

    template <typename... I>
    __device__ __forceinline__ index_t offset(I... idx) const {
        static_assert(sizeof...(I) == N, "one index per dimension of the array");
        index_t o = 0;
        int d = 0;
        ((o = o * dims[d] + static_cast<index_t>(idx), ++d), ...);
        return o;
    }
    __device__ __forceinline__ int shape(int d) const { return dims[d]; }
};

// A read-only array of the caller's: a[i] reads the flat element i, a(i, j, ...) the element
// at those indices, a.offset(i, j, ...) is its flat index.
template <typename T, int N>
struct UserArray : UserShape<N> {
    const T* data;

    __device__ __forceinline__ UserArray(const UserParams& u, int slot)
        : UserShape<N>{u.shape[slot]}, data(static_cast<const T*>(u.arrays[slot])) {}
    __device__ __forceinline__ T operator[](index_t i) const { return data[i]; }
    template <typename... I>
    __device__ __forceinline__ T operator()(I... idx) const { return data[this->offset(idx...)]; }
};

// The gradient of an array (its shape; float64 in the float64 kernels, float32 in the others):
// d.add(i, v) adds v to flat element i. Only one pass per element adds (the dK/dV pass; `on`
// is false in the dQ pass), and zeros, the masked elements among them, add nothing.
// float32: a thread's adds to one element in a row meet in its registers (GradPending, one per
// array in the score step's UserGrads), and reach memory by one atomic when it moves to another
// element or at the end (flush_user_grads). Most scores of a long sequence add to a
// relative-position table's two clamped buckets: an atomic per score, or one per warp with
// its lanes summed first, made the backward 5-26x slower than without the gradient
// (benchmarks/NOTES.md). The add is branch-free (a predicated atomic): a test per score that
// kept a warp's lanes together for shuffles cost more than the atomics it saved.
struct GradPending {
    index_t idx = -1;   // the element, or -1: none
    float sum = 0.f;
};
struct UserGrads {
    GradPending slot[USER_ARRAYS];
};
// The score step's running sums where a user score_mod runs, else nothing: an unused UserGrads
// member still changed the other kernels' register allocation (spills in four of them).
struct NoUserGrads {};
template <bool UserScore> struct UserGradsOf { using type = UserGrads; };
template <> struct UserGradsOf<false> { using type = NoUserGrads; };

template <int N>
struct GradArray : UserShape<N> {
    void* data;
    GradPending& pending;
    bool on;

    __device__ __forceinline__ GradArray(const UserParams& u, int slot, bool accumulate, UserGrads& g)
        : UserShape<N>{u.shape[slot]}, data(u.grads[slot]), pending(g.slot[slot]), on(accumulate) {}
    template <typename S>
    __device__ __forceinline__ void add(index_t i, S v) const {
        if (!on) return;
        if constexpr (sizeof(S) == 8) {
            if (v != S(0)) atomicAdd(static_cast<double*>(data) + i, static_cast<double>(v));
        } else {
            const float x = static_cast<float>(v);
            const bool same = x == 0.f || pending.idx == i;
            if (!same && pending.idx >= 0) atomicAdd(static_cast<float*>(data) + pending.idx, pending.sum);
            pending.sum = same ? pending.sum + x : x;
            pending.idx = same ? pending.idx : i;
        }
    }
};

// A thread's running sums to memory once its last score has added to them. The threads of a
// block mostly end on the same elements (the clamped buckets): the lanes of one element add
// once, their sum.
__device__ __forceinline__ void flush_user_grads(const UserParams& u, const UserGrads& g) {
    const unsigned active = __activemask();
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int slot = 0; slot < USER_ARRAYS; ++slot) {
        const GradPending pend = g.slot[slot];
        if (!__any_sync(active, pend.idx >= 0)) continue;
        const unsigned peers = __match_any_sync(active, static_cast<unsigned long long>(pend.idx));
        float total = 0.f;
        unsigned rest = peers;
        while (__any_sync(active, rest != 0)) {
            const int src = rest ? __ffs(rest) - 1 : lane;
            const float x = __shfl_sync(active, pend.sum, src);
            if (rest) {
                total += x;
                rest &= rest - 1;
            }
        }
        if (pend.idx >= 0 && lane == __ffs(peers) - 1) atomicAdd(static_cast<float*>(u.grads[slot]) + pend.idx, total);
    }
}

// The mods of a call without user snippets: scores and masks as they are.
struct NoMods {
    static constexpr bool Score = false;   // a score_mod is given
    static constexpr bool Mask = false;    // a mask_mod is given
    static constexpr bool Gathers = false; // the score_mod reads a table per score (mods.gathers)

    template <typename S>
    static __device__ __forceinline__ S score(const UserParams&, S score, int, int, int, int) { return score; }
    template <typename S>
    static __device__ __forceinline__ S grad(const UserParams&, S, S dscore, int, int, int, int, bool, UserGrads&) {
        return dscore;
    }
    static __device__ __forceinline__ bool mask(const UserParams&, int, int, int, int) { return true; }
};
// @user-mods
