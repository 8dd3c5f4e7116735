// Attention from a KV cache (cupyflash.flash_attention_with_kvcache): a few query rows per
// sequence against its cached keys, a pass bound by reading the cache once.
// - kvcache_append_kernel writes the call's new keys and values into the cache at each entry's
//   length (seqinfo.cuh's cache rows: a slice of the entry, or its pages).
// - flash_decode_kernel: one block per (split of the keys, kv head, 16 packed query rows,
//   entry). The rows are the kv head's query heads times the queries (GQA packing: row g is
//   query g / group of head hk * group + g % group), so that every byte of K and V is read
//   once per kv head. Each of the four warps streams its own 16-key slices of the split (every
//   fourth one) through a ring of shared-memory stages by cp.async, with no barrier between
//   warps, and runs S = Q K^T, the score step, mask and online softmax (the shared pieces) and
//   O += P V by mma.sync on them; the warps' (max, sum, O) are then combined through shared
//   memory. One split writes out and lse; several write fp32 parts that
// - flash_decode_merge_kernel combines by their lse (as cupyflash.merge_attention), launched as
//   the split pass's programmatic dependent on sm_90.
#include "common.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"

// FwdParams (k and v: the caches) and the split-KV workspace.
struct DecodeParams {
    FwdParams base;
    float* o_part;      // splits > 1: (splits, batch, nheads, seqlen_q, HeadDim) fp32 outputs of
                        // the splits, each normalized by its own sum
    float* lse_part;    // (splits, batch, nheads, seqlen_q), natural log; -inf: no key
    int splits;
    int split_keys;     // keys per split, a multiple of DECODE_KEYS
    int row_chunks;     // 16-row chunks of group * seqlen_q packed rows: grid.y = nheads_k * row_chunks
    int stream_keys;    // an entry's key count from which the call's K and V (as if every entry
                        // had as many) outsize the L2: its copies then evict first (l2_evict_first)
};

constexpr int DECODE_WARPS = 4, DECODE_SLICE = 16, DECODE_KEYS = DECODE_WARPS * DECODE_SLICE;

// Stages of each warp's ring (every stage one slice of K and one of V): three up to head dim
// 128, where two blocks then fit an SM's shared memory (measured faster than four stages in
// one block per SM for paged caches, equal for contiguous ones: benchmarks/NOTES.md).
template <int HeadDim>
__host__ __device__ constexpr int decode_stages() { return HeadDim <= 128 ? 3 : 2; }
// Shared memory: Q (16 rows) and the warps' rings, 16-bit elements, rows HeadDim + SMEM_PAD.
template <int HeadDim>
__host__ __device__ constexpr int decode_smem() {
    return (16 + DECODE_WARPS * decode_stages<HeadDim>() * 2 * DECODE_SLICE) * (HeadDim + SMEM_PAD) * 2;
}

template <typename Elem, int HeadDim, typename V>
__global__ void __launch_bounds__(DECODE_WARPS * 32, 1) flash_decode_kernel(const DecodeParams dp) {
    static_assert(V::Seq == SEQ_CACHE || V::Seq == SEQ_PAGED, "keys in a KV cache");
    static_assert(!V::Dropout && !V::UserScore && !V::UserMask, "no dropout or user mods here");
    constexpr int LD = HeadDim + SMEM_PAD, Stages = decode_stages<HeadDim>(), DT = HeadDim / 8, KS = HeadDim / 16;
    const FwdParams& p = dp.base;
    extern __shared__ __align__(16) unsigned char smem[];
    u16* sQ = reinterpret_cast<u16*>(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16* ring = sQ + 16 * LD + warp * Stages * 2 * DECODE_SLICE * LD;   // stage s: K, then V
    const int split = blockIdx.x, b = blockIdx.z;
    const int hk = blockIdx.y / dp.row_chunks, g0 = blockIdx.y % dp.row_chunks * 16;
    const SeqInfo<FwdParams, V::Seq> seq(p, b);
    Mask<V, FwdParams> mask(p);
    mask.at_batch(b);
    const ScoreMod<V, FwdParams> mod(p);   // softcap's held values (ALiBi's slope is per row, below)
    const int rows = p.group * p.seqlen_q;
    const int last = min(g0 + 16, rows) - 1;
    // The merge kernel, launched as this grid's dependent, may then take its place on the SMs
    // beside this grid's blocks and wait there (it starts on the launch's latency otherwise).
    launch_dependents();

    // Q's 16 packed rows (zeros past the last).
    for (int i = threadIdx.x; i < 16 * DT; i += DECODE_WARPS * 32) {
        const int r = i / DT, col = i % DT * 8, g = g0 + r;
        const bool in = g <= last && col < p.headdim;
        const u16* src = in ? seq.template q_row<const u16>(p.q, hk * p.group + g % p.group, g / p.group) + col
                            : static_cast<const u16*>(p.q.ptr);
        cp_async_16(smem_addr(sQ + r * LD + col), src, in ? 16 : 0);
    }
    cp_async_commit();

    // The thread's rows (lane / 4 and lane / 4 + 8): the keys they see, and ALiBi's slope in
    // held units. A row past the last sees none.
    int key_lo[2], key_hi[2], query[2];
    float slope[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int g = g0 + lane / 4 + 8 * hf;
        query[hf] = min(g, last) / p.group;
        key_lo[hf] = g <= last ? mask.key_begin(query[hf]) : 0;
        key_hi[hf] = g <= last ? mask.key_end(query[hf]) : 0;
        slope[hf] = V::Alibi ? p.mod.alibi[static_cast<index_t>(b) * p.mod.alibi_stride + hk * p.group + min(g, last) % p.group]
                                   * p.mod.alibi_unit
                             : 0.f;
    }
    // The block's keys: its split's, within the band of its first and last rows (the band
    // moves right with the row), from a slice boundary (a split starts at a multiple of
    // DECODE_KEYS: no slice holds keys of two splits).
    static_assert(DECODE_KEYS % DECODE_SLICE == 0, "splits start on slice boundaries");
    const int first = max(split * dp.split_keys, mask.key_begin(g0 / p.group)) / DECODE_SLICE * DECODE_SLICE;
    const int end = min((split + 1) * dp.split_keys, mask.key_end(last / p.group));
    const int slices = end > first ? (end - first + DECODE_SLICE - 1) / DECODE_SLICE : 0;
    const int mine = slices > warp ? (slices - warp + DECODE_WARPS - 1) / DECODE_WARPS : 0;   // every fourth
    const int sk = seq.seqlen_k();

    // Slice t of the warp (the block's slice warp + 4 t) into stage t % Stages: its 16 K rows,
    // then its 16 V rows (zeros past the entry's keys), by the warp's lanes as load_tile moves
    // a block's tiles. A slice starts on a multiple of 16 keys and a page holds a multiple of
    // 16 rows, so the slice's rows lie in one page a row stride apart: one page and one row
    // address a slice, not one a row (the per-row addresses, shuffled between the lanes, were
    // 60% of the loop's instructions: benchmarks/NOTES.md). A paged cache's page is looked up
    // one fetch ahead (`page`), so that its load runs during a slice's math rather than in
    // front of the copies.
    auto key0_of = [&](int t) { return first + (warp + DECODE_WARPS * t) * DECODE_SLICE; };
    auto page_of = [&](int t) { return t < mine ? seq.k_page(key0_of(t)) : 0; };
    int page = page_of(0);
    // K and V that outsize the L2 stream through it evicted first: 1-7.5% faster on the H200
    // from 64 MB; below, where the same copies under any policy ran up to 9% slower than
    // plain ones, plain copies (benchmarks/NOTES.md).
    const bool stream = sk >= dp.stream_keys;
    const unsigned long long evict_first = l2_evict_first();
    auto fetch = [&](int t) {
        if (t < mine) {
            const int key0 = key0_of(t);
            u16* stage = ring + (t % Stages) * 2 * DECODE_SLICE * LD;
            auto copy_slice = [&](auto copy) {
                load_tile<DECODE_SLICE, HeadDim, 32>(stage, seq.template k_row_at<const u16>(p.k, page, hk, key0),
                                                     p.k.row_stride, sk - key0, p.headdim, true, copy);
                load_tile<DECODE_SLICE, HeadDim, 32>(stage + DECODE_SLICE * LD, seq.template k_row_at<const u16>(p.v, page, hk, key0),
                                                     p.v.row_stride, sk - key0, p.headdim, true, copy);
            };
            if (stream)
                copy_slice(PolicyCopy{evict_first});
            else
                copy_slice(PlainCopy{});
            page = page_of(t + 1);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < Stages - 1; ++t) fetch(t);

    cp_async_wait<Stages - 1>();   // Q (the oldest group)
    __syncthreads();
    u32 qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qa[ks], smem_addr(sQ + (lane & 15) * LD + ks * 16 + (lane >> 4) * 8));

    float acc[1][DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;
    OnlineSoftmax<2> softmax;
    softmax.init();
    const int shift = sk - p.seqlen_q;   // ALiBi's diagonal, aligned bottom-right
    for (int t = 0; t < mine; ++t) {
        cp_async_wait<Stages - 2>();
        __syncwarp();   // the slice is in for every lane, and every lane is done with slice t - 1
        fetch(t + Stages - 1);   // into the stage of slice t - 1
        const u32 sK = smem_addr(ring + (t % Stages) * 2 * DECODE_SLICE * LD), sV = sK + DECODE_SLICE * LD * 2;
        const int key0 = first + (warp + DECODE_WARPS * t) * DECODE_SLICE;

        float s[1][2][4] = {};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 bk[4];
            ldmatrix_x4(bk, sK + (((lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
            mma_16816<Elem>(s[0][0], qa[ks], bk[0], bk[1]);
            mma_16816<Elem>(s[0][1], qa[ks], bk[2], bk[3]);
        }
        // The score step (softcap's held value, ALiBi's bias per row) and the rows' bands.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hf = e / 2, key = key0 + nt * 8 + 2 * (lane % 4) + (e & 1);
                float x = mod.held(s[0][nt][e]);
                if constexpr (V::Alibi) x = fmaf(slope[hf], fabsf(static_cast<float>(query[hf] + shift - key)), x);
                s[0][nt][e] = key >= key_lo[hf] && key < key_hi[hf] ? x : neg_inf();
            }
        softmax.update(s, acc, mod.mult());
        const u32 pa[4] = {pack2<Elem>(s[0][0][0], s[0][0][1]), pack2<Elem>(s[0][0][2], s[0][0][3]),
                           pack2<Elem>(s[0][1][0], s[0][1][1]), pack2<Elem>(s[0][1][2], s[0][1][3])};
#pragma unroll
        for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
            u32 bv[4];
            ldmatrix_x4_trans(bv, sV + (((lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp2 * 16 + (lane >> 4) * 8) * 2);
            mma_16816<Elem>(acc[0][2 * dp2], pa, bv[0], bv[1]);
            mma_16816<Elem>(acc[0][2 * dp2 + 1], pa, bv[2], bv[3]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();   // every warp is done with its ring: the combination reuses it

    // The warps' parts through shared memory: each row's max (log2 units) and sum per warp,
    // and O per warp; then each thread weighs the warps' O of its row from them. O's rows are
    // LDO floats apart, 8 more than a row's: a warp's 8-byte stores of its fragments (8 rows x
    // 8 columns) then take two passes of the shared memory, where rows HeadDim apart, all on
    // the same banks, took eight (a block's end after its loop took 2.8 us, now 1.2 on the
    // H200: benchmarks/NOTES.md).
    constexpr int LDO = HeadDim + 8;
    static_assert(DECODE_WARPS * 16 * (LDO + 2) * 4 <= decode_smem<HeadDim>(),
                  "the combination fits in the rings' shared memory");
    float* sO = reinterpret_cast<float*>(smem);             // [warp][16][LDO]
    float* sM = sO + DECODE_WARPS * 16 * LDO;               // [warp][16]
    float* sL = sM + DECODE_WARPS * 16;                     // [warp][16]
    const float mult = mod.mult();
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = lane / 4 + 8 * hf;
        const float l = quad_sum(softmax.l[hf]);
        if (lane % 4 == 0) {
            sM[warp * 16 + r] = softmax.m[hf] == neg_inf() ? neg_inf() : softmax.m[hf] * mult;
            sL[warp * 16 + r] = l;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(sO + (warp * 16 + r) * LDO + dt * 8 + 2 * (lane % 4)) =
                make_float2(acc[0][dt][2 * hf], acc[0][dt][2 * hf + 1]);
    }
    __syncthreads();
    // Four columns a thread (the head dim is a multiple of 8: 16-byte rows); a warp's threads
    // share a row, whose factors each computes (the same loads for all: broadcasts).
    for (int i = threadIdx.x; i < 16 * HeadDim / 4; i += DECODE_WARPS * 32) {
        const int r = i / (HeadDim / 4), col = i % (HeadDim / 4) * 4, g = g0 + r;
        if (g > last || col >= p.headdim) continue;
        float top = neg_inf();
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) top = fmaxf(top, sM[w * 16 + r]);
        const float base = top == neg_inf() ? 0.f : top;
        float f[DECODE_WARPS], total = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            f[w] = fast_exp2(sM[w * 16 + r] - base);   // 0 for a warp whose rows saw no key
            total += f[w] * sL[w * 16 + r];
        }
        // Only a sum of exactly 0 is a row without keys (a NaN sum stays NaN), as finalize.
        const bool empty = total == 0.f;
        float o[4] = {};
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) {
            const float fw = empty ? 0.f : f[w] / total;
            const float4 x = *reinterpret_cast<const float4*>(sO + (w * 16 + r) * LDO + col);
            o[0] = fmaf(fw, x.x, o[0]);
            o[1] = fmaf(fw, x.y, o[1]);
            o[2] = fmaf(fw, x.z, o[2]);
            o[3] = fmaf(fw, x.w, o[3]);
        }
        const float lse = empty ? neg_inf() : (base + log2f(total)) / LOG2E;
        const int h = hk * p.group + g % p.group, q = g / p.group;
        const index_t row = seq.stat(h, q);   // (batch, nheads, seqlen_q)
        if (dp.splits == 1) {
            u16* out = seq.template q_row<u16>(p.o, h, q) + col;
#pragma unroll
            for (int j = 0; j < 4; ++j) ElemTraits<Elem>::store(out + j, o[j]);
            if (col == 0) static_cast<float*>(p.lse)[row] = lse;
        } else {
            const index_t part = static_cast<index_t>(split) * p.batch * p.nheads * p.seqlen_q + row;
            *reinterpret_cast<float4*>(dp.o_part + part * HeadDim + col) = make_float4(o[0], o[1], o[2], o[3]);
            if (col == 0) dp.lse_part[part] = lse;
        }
    }
}

// The splits' parts of each query row combined by their lse: grid (seqlen_q, nheads, batch),
// DECODE_MERGE_GROUPS groups of HeadDim / 4 threads. The parts were just written (they are in
// L2): each pass issues its loads together rather than one split after another (whose
// latencies took 9 of the 22 us of a batch-1 call over 8K keys in 32 splits on the H200:
// benchmarks/NOTES.md). The lse of every split by the first warp, while the others' first
// loads of outputs are in flight; then each group adds every eighth split's outputs, four
// columns a thread, and the groups' sums meet in shared memory.
constexpr int DECODE_MAX_SPLITS = 128, DECODE_MERGE_GROUPS = 8;

template <typename Elem, int HeadDim>
__global__ void __launch_bounds__(DECODE_MERGE_GROUPS * HeadDim / 4) flash_decode_merge_kernel(const DecodeParams dp) {
    constexpr int Lanes = HeadDim / 4, Threads = DECODE_MERGE_GROUPS * Lanes;
    static_assert(Threads % 32 == 0, "whole warps");
    __shared__ float weight[DECODE_MAX_SPLITS], totals[2];   // totals: the lse's base and the weights' sum
    __shared__ __align__(16) float part[DECODE_MERGE_GROUPS][HeadDim];
    const FwdParams& p = dp.base;
    const int q = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
    const int group = t / Lanes, col = t % Lanes * 4;
    wait_for_primary();   // the split pass's parts
    const index_t row = (static_cast<index_t>(b) * p.nheads + h) * p.seqlen_q + q;
    const index_t stride = static_cast<index_t>(p.batch) * p.nheads * p.seqlen_q;
    auto part_of = [&](int s) { return *reinterpret_cast<const float4*>(dp.o_part + (s * stride + row) * HeadDim + col); };
    // The group's first EARLY splits' outputs are loaded with the lse rather than after the
    // weights: one wait on memory before the sums, not two.
    constexpr int EARLY = 4;
    float4 early[EARLY];
#pragma unroll
    for (int k = 0; k < EARLY; ++k) {
        const int s = group + k * DECODE_MERGE_GROUPS;
        early[k] = col < p.headdim && s < dp.splits ? part_of(s) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // The splits' weights, by the first warp alone (shuffles, one barrier for the block).
    if (t < 32) {
        float top = neg_inf();
        for (int s = t; s < dp.splits; s += 32) {
            weight[s] = dp.lse_part[s * stride + row];
            top = fmaxf(top, weight[s]);
        }
#pragma unroll
        for (int lane = 16; lane > 0; lane /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lane));
        const float base = top == neg_inf() ? 0.f : top;
        float sum = 0.f;
        for (int s = t; s < dp.splits; s += 32) {
            weight[s] = __expf(weight[s] - base);
            sum += weight[s];
        }
#pragma unroll
        for (int lane = 16; lane > 0; lane /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, lane);
        if (t == 0) {
            totals[0] = base;
            totals[1] = sum;
        }
    }
    __syncthreads();
    const float base = totals[0], total = totals[1];

    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](int s, float4 x) {
        const float w = weight[s];
        o = make_float4(fmaf(w, x.x, o.x), fmaf(w, x.y, o.y), fmaf(w, x.z, o.z), fmaf(w, x.w, o.w));
    };
    if (col < p.headdim) {
#pragma unroll
        for (int k = 0; k < EARLY; ++k)
            if (group + k * DECODE_MERGE_GROUPS < dp.splits) add(group + k * DECODE_MERGE_GROUPS, early[k]);
#pragma unroll 4
        for (int s = group + EARLY * DECODE_MERGE_GROUPS; s < dp.splits; s += DECODE_MERGE_GROUPS) add(s, part_of(s));
    }
    *reinterpret_cast<float4*>(&part[group][col]) = o;
    __syncthreads();
    const bool empty = total == 0.f;
    if (t < Lanes && col < p.headdim) {
        u16* out = row_ptr<u16>(p.o, b, h, q) + col;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float x = 0.f;
#pragma unroll
            for (int g = 0; g < DECODE_MERGE_GROUPS; ++g) x += part[g][col + j];
            ElemTraits<Elem>::store(out + j, empty ? 0.f : x / total);
        }
    }
    if (t == 0) static_cast<float*>(p.lse)[row] = empty ? neg_inf() : base + logf(total);
}

// The call's new keys and values (p.q: k, p.o: v, (batch, new_keys, nheads_k, headdim)) into the
// caches (p.k, p.v) at rows seqlens[b] .. seqlens[b] + new_keys - 1 of each entry: grid
// (new_keys, nheads_k, batch), T the elements' storage type.
template <typename T, int Seq>
__global__ void __launch_bounds__(128) kvcache_append_kernel(const FwdParams p) {
    const int j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const SeqInfo<FwdParams, Seq> seq(p, b);
    const int row = p.cache.seqlens[b] + j;
    T* k = seq.template k_row<T>(p.k, hk, row);
    T* v = seq.template k_row<T>(p.v, hk, row);
    const T* kn = row_ptr<const T>(p.q, b, hk, j);
    const T* vn = row_ptr<const T>(p.o, b, hk, j);
    for (int c = threadIdx.x; c < p.headdim; c += blockDim.x) {
        k[c] = kn[c];
        v[c] = vn[c];
    }
}
