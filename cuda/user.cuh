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
// A float32 gradient small enough is added up per thread block in shared memory first
// (UserParams::grad_smem, stage_user_grads): the elements of a diagonal all add to one entry of
// a relative-position table, and global atomics on a few addresses serialize.
template <int N>
struct GradArray : UserShape<N> {
    void* data;
    float* staged;
    bool on;

    __device__ __forceinline__ GradArray(const UserParams& u, int slot, bool accumulate)
        : UserShape<N>{u.shape[slot]}, data(u.grads[slot]), staged(nullptr), on(accumulate) {
        extern __shared__ __align__(16) unsigned char user_smem[];
        if (u.grad_smem[slot] > 0) staged = reinterpret_cast<float*>(user_smem + u.grad_smem[slot]);
    }
    template <typename S>
    __device__ __forceinline__ void add(index_t i, S v) const {
        if (!on || v == S(0)) return;
        if constexpr (sizeof(S) == 8) {
            atomicAdd(static_cast<double*>(data) + i, static_cast<double>(v));
        } else {
            float* target = (staged ? staged : static_cast<float*>(data)) + i;
            // Lanes adding to one element add once, their sum: the lanes that hold one
            // diagonal of a fragment hit one entry of a relative-position table.
            const unsigned active = __activemask();
            const unsigned peers = __match_any_sync(active, static_cast<unsigned long long>(i));
            const int lane = threadIdx.x % 32;
            float total = 0.f;
            unsigned rest = peers;
            while (__any_sync(active, rest != 0)) {
                const int src = rest ? __ffs(rest) - 1 : lane;
                const float x = __shfl_sync(active, static_cast<float>(v), src);
                if (rest) {
                    total += x;
                    rest &= rest - 1;
                }
            }
            if (lane == __ffs(peers) - 1) atomicAdd(target, total);
        }
    }
};

// The staged gradients of a thread block: zeroed (Flush false) before its first barrier, added
// to memory (Flush true) after its last step, by `threads` threads (tid: the thread's rank
// among them; the Hopper backward's consumers add and flush, every thread zeroes).
template <bool Flush>
__device__ __forceinline__ void stage_user_grads(const UserParams& u, int tid, int threads) {
    extern __shared__ __align__(16) unsigned char user_smem[];
    for (int slot = 0; slot < USER_ARRAYS; ++slot) {
        if (u.grad_smem[slot] <= 0) continue;
        float* staged = reinterpret_cast<float*>(user_smem + u.grad_smem[slot]);
        const index_t n = static_cast<index_t>(u.shape[slot][0]) * u.shape[slot][1] * u.shape[slot][2] * u.shape[slot][3];
        for (index_t i = tid; i < n; i += threads) {
            if (!Flush)
                staged[i] = 0.f;
            else if (staged[i] != 0.f)
                atomicAdd(static_cast<float*>(u.grads[slot]) + i, staged[i]);
        }
    }
}

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
