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
//   memory. One split writes out and lse; several write fp32 parts, and the last split of a
//   block's rows to finish (a ticket per (entry, kv head, row chunk)) combines them by their
//   lse (as cupyflash.merge_attention), with no second kernel.
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
    unsigned* tickets;  // splits > 1: one per (entry, kv head, row chunk), zero before the launch;
                        // atomicInc wraps each back to zero by the end
    int splits;
    int split_keys;     // keys per split, a multiple of DECODE_KEYS
    int row_chunks;     // 16-row chunks of group * seqlen_q packed rows: grid.y = nheads_k * row_chunks
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

// The splits' parts of packed rows g0..last (head hk of the entry) combined by their lse, by
// the block that finished last (parts just written: in L2, read past L1). sW (splits x 16
// floats of shared memory, free by then) holds each row's weights: first the splits' lse (all
// loads at once), then, per row (a warp's), exp(lse - max) and their total; each thread then
// adds four columns of one row over every split, loads issued eight at a time.
constexpr int DECODE_MAX_SPLITS = 128;

template <typename Elem, int HeadDim, typename Seq>
__device__ __forceinline__ void merge_splits(const DecodeParams& dp, const Seq& seq, int hk, int g0, int last, float* sW) {
    const FwdParams& p = dp.base;
    const int rows = last - g0 + 1, splits = dp.splits, lane = threadIdx.x % 32;
    const index_t stride = static_cast<index_t>(p.batch) * p.nheads * p.seqlen_q;
    auto stat_of = [&](int r) {   // (batch, nheads, seqlen_q) index of packed row g0 + r
        const int g = g0 + r;
        return seq.stat(hk * p.group + g % p.group, g / p.group);
    };
    __shared__ float sBase[16], sTotal[16];
    for (int i = threadIdx.x; i < rows * splits; i += DECODE_WARPS * 32)
        sW[i] = __ldcg(dp.lse_part + (i % splits) * stride + stat_of(i / splits));
    __syncthreads();
    for (int r = threadIdx.x / 32; r < rows; r += DECODE_WARPS) {
        float* w = sW + r * splits;
        float top = neg_inf();
        for (int s = lane; s < splits; s += 32) top = fmaxf(top, w[s]);
        top = lanes_reduce<32>(top, max_op);
        const float base = top == neg_inf() ? 0.f : top;
        float sum = 0.f;
        for (int s = lane; s < splits; s += 32) {
            w[s] = __expf(w[s] - base);
            sum += w[s];
        }
        sum = lanes_reduce<32>(sum, sum_op);
        if (lane == 0) {
            sBase[r] = base;
            sTotal[r] = sum;
        }
    }
    __syncthreads();
    constexpr int Quads = HeadDim / 4;
    for (int i = threadIdx.x; i < rows * Quads; i += DECODE_WARPS * 32) {
        const int r = i / Quads, col = i % Quads * 4, g = g0 + r;
        if (col >= p.headdim) continue;
        const index_t row = stat_of(r);
        const float* w = sW + r * splits;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < splits; ++s) {
            const float4 x = __ldcg(reinterpret_cast<const float4*>(dp.o_part + (s * stride + row) * HeadDim + col));
            o = make_float4(fmaf(w[s], x.x, o.x), fmaf(w[s], x.y, o.y), fmaf(w[s], x.z, o.z), fmaf(w[s], x.w, o.w));
        }
        // Only a total of exactly 0 is a row without keys (a NaN stays NaN), as finalize.
        const float total = sTotal[r];
        const bool empty = total == 0.f;
        const float inv = empty ? 0.f : 1.f / total;
        u16* out = seq.template q_row<u16>(p.o, hk * p.group + g % p.group, g / p.group) + col;
        const float ox[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (col + j < p.headdim) ElemTraits<Elem>::store(out + j, ox[j] * inv);
        if (col == 0) static_cast<float*>(p.lse)[row] = empty ? neg_inf() : sBase[r] + logf(total);
    }
}

template <typename Elem, int HeadDim, typename V>
__global__ void __launch_bounds__(DECODE_WARPS * 32, 1) flash_decode_kernel(const DecodeParams dp) {
    static_assert(V::Seq == SEQ_CACHE || V::Seq == SEQ_PAGED, "keys in a KV cache");
    static_assert(16 * DECODE_MAX_SPLITS * 4 <= decode_smem<HeadDim>(), "the merge's weights fit the rings' memory");
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

    // Slice t of the warp (the block's slice warp + 4 t) into stage t % Stages. Lane r < 16
    // finds key row r's K and V rows (null past the entry's keys, whose pages may not exist:
    // zeros are copied); then the 32 lanes copy 16-byte chunks in row order, each instruction
    // 512 consecutive bytes of whole rows. A paged cache's page of the lane's key is looked up
    // one fetch ahead (`page`): its load then runs during a slice's math rather than in front
    // of the copies (page 16 ran 5-6% below a contiguous cache looked up in place, 3% with this).
    auto key_of = [&](int t) { return first + (warp + DECODE_WARPS * t) * DECODE_SLICE + lane % DECODE_SLICE; };
    auto page_of = [&](int t) { return t < mine && key_of(t) < sk ? seq.k_page(key_of(t)) : 0; };
    int page = page_of(0);
    auto fetch = [&](int t) {
        if (t < mine) {
            const int key = key_of(t);
            const bool in = key < sk;
            const u16* k_mine = in ? seq.template k_row_at<const u16>(p.k, page, hk, key) : nullptr;
            const u16* v_mine = in ? seq.template k_row_at<const u16>(p.v, page, hk, key) : nullptr;
            page = page_of(t + 1);
            u16* stage = ring + (t % Stages) * 2 * DECODE_SLICE * LD;
#pragma unroll
            for (int i = lane; i < DECODE_SLICE * DT; i += 32) {
                const int r = i / DT, col = i % DT * 8;
                const u16* k = reinterpret_cast<const u16*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(k_mine), r));
                const u16* v = reinterpret_cast<const u16*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(v_mine), r));
                const bool copy = k != nullptr && col < p.headdim;
                cp_async_16(smem_addr(stage + r * LD + col), copy ? k + col : static_cast<const u16*>(p.k.ptr), copy ? 16 : 0);
                cp_async_16(smem_addr(stage + (DECODE_SLICE + r) * LD + col), copy ? v + col : static_cast<const u16*>(p.v.ptr),
                            copy ? 16 : 0);
            }
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
    // and O per warp; then each row's factors, and O and lse from them.
    float* sO = reinterpret_cast<float*>(smem);             // [warp][16][HeadDim]
    float* sM = sO + DECODE_WARPS * 16 * HeadDim;           // [warp][16]
    float* sL = sM + DECODE_WARPS * 16;                     // [warp][16]
    float* sF = sL + DECODE_WARPS * 16;                     // [16][warp]: the factors / total
    float* sLse = sF + 16 * DECODE_WARPS;                   // [16]
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
#pragma unroll
            for (int j = 0; j < 2; ++j) sO[(warp * 16 + r) * HeadDim + dt * 8 + 2 * (lane % 4) + j] = acc[0][dt][2 * hf + j];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
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
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) sF[r * DECODE_WARPS + w] = empty ? 0.f : f[w] / total;
        sLse[r] = empty ? neg_inf() : (base + log2f(total)) / LOG2E;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * HeadDim; i += DECODE_WARPS * 32) {
        const int r = i / HeadDim, col = i % HeadDim, g = g0 + r;
        if (g > last || col >= p.headdim) continue;
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) o = fmaf(sF[r * DECODE_WARPS + w], sO[(w * 16 + r) * HeadDim + col], o);
        const int h = hk * p.group + g % p.group, q = g / p.group;
        const index_t row = seq.stat(h, q);   // (batch, nheads, seqlen_q)
        if (dp.splits == 1) {
            ElemTraits<Elem>::store(seq.template q_row<u16>(p.o, h, q) + col, o);
            if (col == 0) static_cast<float*>(p.lse)[row] = sLse[r];
        } else {
            const index_t part = static_cast<index_t>(split) * p.batch * p.nheads * p.seqlen_q + row;
            dp.o_part[part * HeadDim + col] = o;
            if (col == 0) dp.lse_part[part] = sLse[r];
        }
    }
    if (dp.splits == 1) return;
    // The last split of these rows to finish merges them all: every block fences its parts
    // before it takes a ticket, and the one that takes the last sees every part after its own
    // fence. (A second kernel cost its graph node and the splits' drain, ~3.5 us per call on
    // the H200: benchmarks/NOTES.md.)
    __shared__ bool merges;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) merges = atomicInc(dp.tickets + blockIdx.z * gridDim.y + blockIdx.y, dp.splits - 1) == dp.splits - 1;
    __syncthreads();
    if (!merges) return;
    __threadfence();
    merge_splits<Elem, HeadDim>(dp, seq, hk, g0, last, reinterpret_cast<float*>(smem));
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
