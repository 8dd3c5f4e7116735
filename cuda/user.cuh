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
template <int N>
struct GradArray : UserShape<N> {
    void* data;
    bool on;

    __device__ __forceinline__ GradArray(const UserParams& u, int slot, bool accumulate)
        : UserShape<N>{u.shape[slot]}, data(u.grads[slot]), on(accumulate) {}
    template <typename S>
    __device__ __forceinline__ void add(index_t i, S v) const {
        if (!on || v == S(0)) return;
        if constexpr (sizeof(S) == 8)
            atomicAdd(static_cast<double*>(data) + i, static_cast<double>(v));
        else
            atomicAdd(static_cast<float*>(data) + i, static_cast<float>(v));
    }
};

// The mods of a call without user snippets: scores and masks as they are.
struct NoMods {
    static constexpr bool Score = false;   // a score_mod is given
    static constexpr bool Mask = false;    // a mask_mod is given

    template <typename S>
    static __device__ __forceinline__ S score(const UserParams&, S score, int, int, int, int) { return score; }
    template <typename S>
    static __device__ __forceinline__ S grad(const UserParams&, S, S dscore, int, int, int, int, bool) { return dscore; }
    static __device__ __forceinline__ bool mask(const UserParams&, int, int, int, int) { return true; }
};
// @user-mods
