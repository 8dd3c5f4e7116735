// Plain float32/float64 attention: the forward, and the backward's dQ and dK/dV passes.
// No tensor cores and no TF32: every product and sum runs at T's own precision, which makes
// this the path for gradient checks and for users who need full precision.
//
// Work split: one warp per query row (forward, dQ) or per key row (dK/dV); the 8 warps of a
// block share chunks of 32 rows of the other side, staged in dynamic shared memory as two
// tiles of 32 x (HeadDim + 1) elements (the launcher's _generic_smem). A row kept in
// registers is spread over the warp: lane `lane` owns columns lane + 32*i, i < HeadDim/32.
// In a chunk, lane j owns the chunk's row j for dot products.
//
// Math per pass (s = q.k * scale, then the score mods; lse in natural log; D = rowsum(dout * out)):
//   forward: online softmax over key chunks, o = sum_j P_j v_j / l, lse = m + log(l)
//   dQ:      P = exp(s - lse), dS = P * (dout.v - D) * ds/d(q.k scale), dq = scale * sum_j dS_j k_j
//   dK/dV:   dv = sum_i P_i dout_i, dk = scale * sum_i dS_i q_i, summed over the group's heads
// Both backward kernels write every element once: deterministic, no atomics.
//
// Block-sparse masks: with a list (p.kv_blocks for the forward and dQ, p.q_blocks for dK/dV) a
// block stages only the chunks of the tiles listed for its row tile (Chunks below); without one,
// every chunk that some row of the block may see. The element masks (causal, sequence ends) are
// the same either way.
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "dropout.cuh"

namespace generic_impl {

constexpr int kWarps = 8;            // GENERIC_WARPS in cupyflash/_config.py
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;           // GENERIC_CHUNK: one chunk row per lane
constexpr unsigned kFullMask = 0xffffffffu;

// The precision-dependent pieces. float works in base 2 with log2(e) folded into the scale
// (one exp2f per score, as the numeric contract of DESIGN.md says); double works in base e
// with the double scale, so that nothing is rounded to float on the way.
template <typename T>
struct Prec;

template <>
struct Prec<float> {
    static constexpr float kLog2e = LOG2E;
    static constexpr float kLn2 = 0.6931471805599453f;
    static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
    static __device__ __forceinline__ float score_scale(double, float scale_log2) {
        return scale_log2;
    }
    static __device__ __forceinline__ float exp_base(float x) { return exp2f(x); }
    // A natural-log lse in the kernel's base.
    static __device__ __forceinline__ float from_ln(float x) { return x * kLog2e; }
    // The natural-log lse of a row from its base-2 max and its sum.
    static __device__ __forceinline__ float lse_ln(float m, float l) { return m * kLn2 + logf(l); }
};

template <>
struct Prec<double> {
    static __device__ __forceinline__ double inf() {
        return __longlong_as_double(0x7ff0000000000000LL);
    }
    static __device__ __forceinline__ double score_scale(double scale, float) { return scale; }
    static __device__ __forceinline__ double exp_base(double x) { return exp(x); }
    static __device__ __forceinline__ double from_ln(double x) { return x; }
    static __device__ __forceinline__ double lse_ln(double m, double l) { return m + log(l); }
};

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const T y = __shfl_xor_sync(kFullMask, x, offset);
        x = y > x ? y : x;
    }
    return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
    return x;
}

// The lse of a row, in the kernel's base, ready to be subtracted from scores. A row that saw
// no key in the forward has lse = -inf; +inf in its place makes exp(s - lse) exactly 0
// instead of exp(+inf) and then 0 * inf = NaN.
template <typename T>
__device__ __forceinline__ T lse_for_exp(T lse_ln) {
    return lse_ln == -Prec<T>::inf() ? Prec<T>::inf() : Prec<T>::from_ln(lse_ln);
}

// The row helpers take `rows`, a callable giving the address of a row (a SeqInfo lookup).

// Row `row` of a tensor (or zeros past `nrows`) into registers, lane-owned columns; columns
// past `headdim` are zeros, so sums over the whole bucket need no further masks.
template <typename T, int N, typename Rows>
__device__ __forceinline__ void load_row(T (&dst)[N], Rows&& rows, int row, int nrows, int headdim,
                                         int lane) {
    const bool valid = row < nrows;
    const T* src = valid ? rows(row) : nullptr;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int col = lane + 32 * i;
        dst[i] = (valid && col < headdim) ? src[col] : T(0);
    }
}

template <typename T, int N>
__device__ __forceinline__ void store_row(T* dst, const T (&src)[N], T factor, int headdim, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int col = lane + 32 * i;
        if (col < headdim) dst[col] = src[i] * factor;
    }
}

// Rows [row0, row0 + 32) of a tensor into a shared tile with rows padded by one element.
// Warp w stages rows w, w + 8, ...: each global read is a run of consecutive columns. Rows
// at or past `nrows` and columns at or past `headdim` are stored as zeros.
template <typename T, int HeadDim, typename Rows>
__device__ __forceinline__ void load_chunk(T* tile, Rows&& rows, int row0, int nrows, int headdim,
                                           int warp, int lane) {
    constexpr int kLd = HeadDim + 1;
#pragma unroll
    for (int r = warp; r < kChunk; r += kWarps) {
        const int row = row0 + r;
        const bool valid = row < nrows;
        const T* src = valid ? rows(row) : nullptr;
#pragma unroll
        for (int i = 0; i < HeadDim / 32; ++i) {
            const int col = lane + 32 * i;
            tile[r * kLd + col] = (valid && col < headdim) ? src[col] : T(0);
        }
    }
}

// Lane j gets x . tile[j], x a warp-spread row. x goes out one column at a time by shuffle so
// that each lane walks its own tile row: row j starts j banks further than row 0 (padding),
// so the 32 lanes read 32 different banks. One partial sum per 32 columns for some ILP.
template <typename T, int HeadDim>
__device__ __forceinline__ T dot_with_rows(const T (&x)[HeadDim / 32], const T* tile, int lane) {
    constexpr int N = HeadDim / 32;
    const T* mine = tile + lane * (HeadDim + 1);
    T part[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        part[i] = T(0);
#pragma unroll 8
        for (int c = 0; c < 32; ++c)
            part[i] += __shfl_sync(kFullMask, x[i], c) * mine[32 * i + c];
    }
    T sum = part[0];
#pragma unroll
    for (int i = 1; i < N; ++i) sum += part[i];
    return sum;
}

// acc += sum_j w_j * tile[j], w_j held by lane j; acc a warp-spread row. All lanes read one
// tile row at a time, consecutive columns: no bank conflicts.
template <typename T, int HeadDim>
__device__ __forceinline__ void add_weighted_rows(T (&acc)[HeadDim / 32], T w, const T* tile,
                                                  int lane) {
#pragma unroll 8
    for (int j = 0; j < kChunk; ++j) {
        const T wj = __shfl_sync(kFullMask, w, j);
#pragma unroll
        for (int i = 0; i < HeadDim / 32; ++i)
            acc[i] += wj * tile[j * (HeadDim + 1) + lane + 32 * i];
    }
}

// Blocks per SM that ptxas plans registers for. Without a minimum it spills a few bytes at 32-64
// registers to chase occupancy; 2 (at most 128 registers) keeps 16 warps to hide latency where
// two blocks' shared memory fits an H100 SM. float64 at head dim 256 cannot have two blocks
// and takes the registers instead.
constexpr int kSmemPerSmSm90 = 227 * 1024;
template <typename T, int HeadDim>   // the two padded tiles: _generic_smem in _launch.py
constexpr int kSmemBytes = 2 * kChunk * (HeadDim + 1) * int(sizeof(T));
template <typename T, int HeadDim>
constexpr int kMinBlocks = 2 * kSmemBytes<T, HeadDim> <= kSmemPerSmSm90 ? 2 : 1;

// The chunks of kChunk positions of the other side (keys for the forward and dQ, queries for
// dK/dV) that a block stages. Positions outside [lo, hi) are hidden from every row of the block.
// Dense (no list): chunk c starts at lo + c * kChunk, up to hi. Block-sparse: the listed tiles'
// chunks (list_tile % kChunk == 0: tiles hold whole chunks, so a chunk never straddles two tiles
// and each position is staged at most once), those that miss [lo, hi) skipped; the element masks
// in the loop bodies clip the rest. Derived from blockIdx and the head alone: block-uniform, as
// the __syncthreads in the loops need (the plain kernels' blocks of kWarps rows lie inside one
// row tile: row_tile % kWarps == 0).
struct Chunks {
    const int* idx;   // the row tile's list of tiles, or null: dense
    int count;        // chunks to walk, skipped ones included
    int tile;         // list_tile
    int lo, hi;

    __device__ __forceinline__ int start(int c) const {
        if (!idx) return lo + c * kChunk;
        const int per_tile = tile / kChunk;
        return idx[c / per_tile] * tile + c % per_tile * kChunk;
    }
    // Nothing of the chunk at `start` is in [lo, hi) (never so when dense).
    __device__ __forceinline__ bool skip(int start) const {
        return start + kChunk <= lo || start >= hi;
    }
};

// The chunks of the block whose first row is row0, for (query) head h.
__device__ __forceinline__ Chunks visited_chunks(const BlockList& bl, int h, int row0, int lo, int hi) {
    Chunks ch;
    ch.tile = bl.list_tile;
    ch.lo = lo;
    ch.hi = hi;
    if (bl.idx) {
        const index_t r = block_row(bl, h, row0 / bl.row_tile);
        ch.idx = bl.idx + r * bl.width;
        ch.count = bl.count[r] * (bl.list_tile / kChunk);
    } else {
        ch.idx = nullptr;
        ch.count = (hi - lo + kChunk - 1) / kChunk;   // <= 0 when hi <= lo
    }
    return ch;
}

// The chunks in turn: rows c0 .. c0 + kChunk - 1 of two tensors (a_rows, b_rows: row addresses;
// nrows rows) staged into tiles a and b, then body(c0).
template <typename T, int HeadDim, typename ARows, typename BRows, typename Body>
__device__ __forceinline__ void stage_chunks(const Chunks& chunks, T* a, ARows&& a_rows, T* b, BRows&& b_rows,
                                             int nrows, int headdim, int warp, int lane, Body&& body) {
    for (int c = 0; c < chunks.count; ++c) {
        const int c0 = chunks.start(c);
        if (chunks.skip(c0)) continue;   // block-uniform
        __syncthreads();   // no warp still reads the previous chunk
        load_chunk<T, HeadDim>(a, a_rows, c0, nrows, headdim, warp, lane);
        load_chunk<T, HeadDim>(b, b_rows, c0, nrows, headdim, warp, lane);
        __syncthreads();
        body(c0);
    }
}

// The warp's query row in the forward and the dQ pass (one a warp, kWarps rows a block, block
// (row block, head, batch entry)): its head's mask, score modifier and dropout, and the walk
// over the key chunks the block stages.
template <typename T, typename V, typename Params>
struct QueryRow {
    const Params& p;
    const SeqInfo<Params, V::Seq> seq;
    Mask<V, Params> mask;
    PlainScoreMod<V, T> mod;
    const Dropout drop;
    const T drop_scale;
    const int h, row;
    const bool active;   // the row is inside the sequence

    __device__ __forceinline__ QueryRow(const Params& params, int warp)
        : p(params), seq(params, blockIdx.z), mask(params), mod(params), drop(params, seq.b, blockIdx.y),
          drop_scale(static_cast<T>(params.drop.scale)), h(blockIdx.y), row(blockIdx.x * kWarps + warp),
          active(row < seq.seqlen_q()) {
        mask.at_head(seq.b, h);
        mod.at_head(params, seq.b, h);
    }
    // No row of the block is in its packed sequence.
    __device__ __forceinline__ bool past_end() const {
        return V::Varlen && static_cast<int>(blockIdx.x) * kWarps >= seq.seqlen_q();
    }
    // The row of a query-shaped tensor x (q, dout) into registers.
    template <int N>
    __device__ __forceinline__ void load(T (&dst)[N], const TensorRef& x, int lane) const {
        load_row(dst, [&](int r) { return seq.template q_row<const T>(x, h, r); }, row, seq.seqlen_q(), p.headdim,
                 lane);
    }

    // The key chunks that the block stages into k_tile and v_tile, in turn: body(k0, visible, s,
    // aux) for each chunk that holds keys the row sees (warp-uniform), with s the score of the
    // lane's key k0 + lane after the modifier (aux its backprop state) and `visible` whether the
    // mask lets the row see that key.
    template <int HeadDim, typename Body>
    __device__ __forceinline__ void walk(const T (&q)[HeadDim / 32], T* k_tile, T* v_tile, int warp, int lane,
                                         Body&& body) const {
        const int hk = h / p.group;
        const int kbegin = mask.key_begin(row);
        const int kend = active ? mask.key_end(row) : 0;
        // The band moves right with the row: the block's first and last rows bound the chunks
        // it stages.
        const int first_row = blockIdx.x * kWarps;
        const int last_row = min(first_row + kWarps, seq.seqlen_q()) - 1;
        const T scale = Prec<T>::score_scale(p.scale, p.scale_log2);
        auto k_rows = [&](int r) { return seq.template k_row<const T>(p.k, hk, r); };
        auto v_rows = [&](int r) { return seq.template k_row<const T>(p.v, hk, r); };
        const Chunks chunks = visited_chunks(p.kv_blocks, h, first_row, mask.key_begin(first_row),
                                             mask.key_end(last_row));
        stage_chunks<T, HeadDim>(chunks, k_tile, k_rows, v_tile, v_rows, seq.seqlen_k(), p.headdim, warp, lane,
                                 [&](int k0) {
            if (k0 < kend && (!V::Local || k0 + kChunk > kbegin)) {   // warp-uniform
                const bool visible = k0 + lane < kend && (!V::Local || k0 + lane >= kbegin) &&
                                     !mask.user_hides(row, k0 + lane);
                T aux;
                const T s = mod(p, dot_with_rows<T, HeadDim>(q, k_tile, lane) * scale, row, k0 + lane, aux);
                body(k0, visible, s, aux);
            }
        });
    }
};

}  // namespace generic_impl

template <typename T, int HeadDim, typename V>
__global__ void __launch_bounds__(generic_impl::kThreads, generic_impl::kMinBlocks<T, HeadDim>)
generic_fwd_kernel(const FwdParams p) {
    using namespace generic_impl;
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256, "head-dim bucket");
    constexpr int N = HeadDim / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);
    T* v_tile = k_tile + kChunk * (HeadDim + 1);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const QueryRow<T, V, FwdParams> qr(p, warp);
    if (qr.past_end()) return;
    const int row = qr.row;

    T q[N], o[N];
    qr.load(q, p.q, lane);
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = T(0);
    T m = -Prec<T>::inf();   // running max of the scores, in the kernel's base
    T l = T(0);              // running sum of exp(s - m); chunks may come in any order

    qr.template walk<HeadDim>(q, k_tile, v_tile, warp, lane, [&](int k0, bool visible, T s, T) {
        const T chunk_max = warp_max(visible ? s : -Prec<T>::inf());
        const T m_new = chunk_max > m ? chunk_max : m;
        // Scores of -inf (from infinite inputs) can leave the max at -inf: subtract 0 then,
        // so that their weights are 0 rather than exp(-inf - -inf) = NaN.
        const T base = m_new == -Prec<T>::inf() ? T(0) : m_new;
        const T pj = visible ? Prec<T>::exp_base(s - base) : T(0);
        const T alpha = Prec<T>::exp_base(m - base);   // 0 on the first chunk: m = -inf
        l = l * alpha + warp_sum(pj);
#pragma unroll
        for (int i = 0; i < N; ++i) o[i] *= alpha;
        // Dropout drops weights from o only: l is the undropped sum.
        const T wj = !V::Dropout ? pj : qr.drop.keep(row, k0 + lane) ? pj * qr.drop_scale : T(0);
        add_weighted_rows<T, HeadDim>(o, wj, v_tile, lane);
        m = m_new;
    });

    if (qr.active) {
        // A row that saw no key (causal, seqlen_q > seqlen_k) has l = 0: output 0, lse -inf.
        // A NaN l (NaN in q or k, a +inf score) is not that: out and lse stay NaN.
        const bool seen = l != T(0);
        store_row(qr.seq.template q_row<T>(p.o, qr.h, row), o, seen ? T(1) / l : T(0), p.headdim, lane);
        if (lane == 0)
            static_cast<T*>(p.lse)[qr.seq.stat(qr.h, row)] = seen ? Prec<T>::lse_ln(m, l) : -Prec<T>::inf();
    }
}

template <typename T, int HeadDim, typename V>
__global__ void __launch_bounds__(generic_impl::kThreads, generic_impl::kMinBlocks<T, HeadDim>)
generic_bwd_dq_kernel(const BwdParams p) {
    using namespace generic_impl;
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256, "head-dim bucket");
    constexpr int N = HeadDim / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);
    T* v_tile = k_tile + kChunk * (HeadDim + 1);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const QueryRow<T, V, BwdParams> qr(p, warp);
    if (qr.past_end()) return;
    const int row = qr.row;

    T q[N], dout[N], dq[N];
    qr.load(q, p.q, lane);
    qr.load(dout, p.dout, lane);
#pragma unroll
    for (int i = 0; i < N; ++i) dq[i] = T(0);
    T lse = Prec<T>::inf(), dsum = T(0);
    if (qr.active) {
        const index_t s = qr.seq.stat(qr.h, row);
        lse = lse_for_exp(static_cast<const T*>(p.lse)[s]);
        dsum = static_cast<const T*>(p.dsum)[s];
    }

    qr.template walk<HeadDim>(q, k_tile, v_tile, warp, lane, [&](int k0, bool visible, T s, T aux) {
        const T dp = dot_with_rows<T, HeadDim>(dout, v_tile, lane);
        const T pj = visible ? Prec<T>::exp_base(s - lse) : T(0);
        // dS = P (keep dP / (1 - p) - D) with dropout.
        const T dpd = !V::Dropout ? dp : qr.drop.keep(row, k0 + lane) ? dp * qr.drop_scale : T(0);
        add_weighted_rows<T, HeadDim>(dq, qr.mod.backprop(p, pj * (dpd - dsum), aux, row, k0 + lane, false),
                                      k_tile, lane);
    });

    // Rows without keys never entered the loop: dq = 0.
    if (qr.active) store_row(qr.seq.template q_row<T>(p.dq, qr.h, row), dq, static_cast<T>(p.scale), p.headdim, lane);
}

template <typename T, int HeadDim, typename V>
__global__ void __launch_bounds__(generic_impl::kThreads, generic_impl::kMinBlocks<T, HeadDim>)
generic_bwd_dkdv_kernel(const BwdParams p) {
    using namespace generic_impl;
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256, "head-dim bucket");
    constexpr int N = HeadDim / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    T* q_tile = reinterpret_cast<T*>(smem);
    T* dout_tile = q_tile + kChunk * (HeadDim + 1);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const SeqInfo<BwdParams, V::Seq> seq(p, blockIdx.z);
    if (V::Varlen && static_cast<int>(blockIdx.x) * kWarps >= seq.seqlen_k()) return;   // past a packed sequence
    Mask<V, decltype(p)> mask(p);
    mask.at_batch(seq.b);
    const int hk = blockIdx.y;
    const int key = blockIdx.x * kWarps + warp;
    const bool active = key < seq.seqlen_k();
    const int qbegin = active ? mask.query_begin(key) : seq.seqlen_q();
    const int qend = mask.query_end(key);
    // The rows that see a key move down with it: the block's first and last keys bound the
    // chunks it stages.
    const int first_key = blockIdx.x * kWarps;
    const int last_key = min(first_key + kWarps, seq.seqlen_k()) - 1;
    const T scale = Prec<T>::score_scale(p.scale, p.scale_log2);
    PlainScoreMod<V, T> mod(p);
    Dropout drop(p, seq.b, 0);
    const T drop_scale = static_cast<T>(p.drop.scale);
    auto k_rows = [&](int r) { return seq.template k_row<const T>(p.k, hk, r); };
    auto v_rows = [&](int r) { return seq.template k_row<const T>(p.v, hk, r); };

    T k[N], v[N], dk[N], dv[N];
    load_row(k, k_rows, key, seq.seqlen_k(), p.headdim, lane);
    load_row(v, v_rows, key, seq.seqlen_k(), p.headdim, lane);
#pragma unroll
    for (int i = 0; i < N; ++i) dk[i] = dv[i] = T(0);

    for (int g = 0; g < p.group; ++g) {
        const int h = hk * p.group + g;
        const index_t stat0 = seq.stat(h, 0);
        mod.at_head(p, seq.b, h);
        mask.at_head(seq.b, h);
        drop.at_head(p, seq.b, h);
        auto q_rows = [&](int r) { return seq.template q_row<const T>(p.q, h, r); };
        auto dout_rows = [&](int r) { return seq.template q_row<const T>(p.dout, h, r); };
        // Each query head its own list (one shared list when the mask has one head).
        const Chunks chunks = visited_chunks(p.q_blocks, h, first_key, mask.query_begin(first_key),
                                             mask.query_end(last_key));
        stage_chunks<T, HeadDim>(chunks, q_tile, q_rows, dout_tile, dout_rows, seq.seqlen_q(), p.headdim, warp, lane,
                                 [&](int q0) {
            if (active && q0 + kChunk > qbegin && (!V::Local || q0 < qend)) {   // warp-uniform
                const int qi = q0 + lane;
                const bool visible = qi >= qbegin && qi < qend && !mask.user_hides(qi, key);
                T lse = Prec<T>::inf(), dsum = T(0);
                if (visible) {
                    lse = lse_for_exp(static_cast<const T*>(p.lse)[stat0 + qi]);
                    dsum = static_cast<const T*>(p.dsum)[stat0 + qi];
                }
                T aux;
                const T s = mod(p, dot_with_rows<T, HeadDim>(k, q_tile, lane) * scale, qi, key, aux);
                const T dp = dot_with_rows<T, HeadDim>(v, dout_tile, lane);
                const T pj = visible ? Prec<T>::exp_base(s - lse) : T(0);
                const bool kept = !V::Dropout || drop.keep(qi, key);
                const T dpd = !V::Dropout ? dp : kept ? dp * drop_scale : T(0);
                add_weighted_rows<T, HeadDim>(dv, !V::Dropout ? pj : kept ? pj * drop_scale : T(0), dout_tile, lane);
                add_weighted_rows<T, HeadDim>(dk, mod.backprop(p, pj * (dpd - dsum), aux, qi, key, true), q_tile, lane);
            }
        });
    }

    mod.flush_grads(p);
    if (active) {
        store_row(seq.template k_row<T>(p.dk, hk, key), dk, static_cast<T>(p.scale), p.headdim, lane);
        store_row(seq.template k_row<T>(p.dv, hk, key), dv, T(1), p.headdim, lane);
    }
}
