// Where the rows of one batch entry live and how many there are. Every kernel reaches q, k, v,
// their gradients and the row statistics (lse, D) through this piece, so that packed
// variable-length batches, paged KV caches and sequence shards change it alone, not the loops.
// The layouts (Variant::Seq, variant.cuh's SeqLayout):
// - SEQ_DENSE, (batch, seqlen, nheads, headdim) tensors: entry b holds seqlen_q query rows and
//   seqlen_k keys at row 0 of its own slice. The lengths are read from the parameters at each
//   use, not copied: ptxas then takes them as constant-bank operands instead of holding
//   registers across the loops.
// - SEQ_PACKED (cupyflash.flash_attention_varlen): the tensors are (total, nheads, headdim),
//   sequence b holds rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1, and the row statistics are
//   (nheads, total_q). p.seqlen_q and p.seqlen_k are the longest sequences' lengths, which size
//   the grids.
// - SEQ_CACHE and SEQ_PAGED (cupyflash.flash_attention_with_kvcache): queries dense; entry b's
//   keys are the first cache.seqlens[b] + cache.new_keys rows of its cache, a (batch, capacity,
//   nheads_k, headdim) slice (SEQ_CACHE) or pages of cache.page_size rows of a (pages,
//   page_size, nheads_k, headdim) tensor listed by its row of cache.block_table (SEQ_PAGED).
//   p.seqlen_k is the longest entry's key count.
#pragma once
#include "params.cuh"
#include "variant.cuh"

// Packed sequences' slices of the fp32 dQ buffer (bwd.cu) start at multiples of this many
// rows, so that each sequence's whole tiles stay inside its own slice (cupyflash/_launch.py
// sizes the buffer by it).
constexpr int ACCUM_ALIGN = 128;

// An entry of a packed call's offsets, read at each use: the asm is volatile so that the
// compiler neither merges nor hoists the loads, and no register holds the value across the
// kernels' loops, whose register files are full already (an L1 hit where it is read).
__device__ __forceinline__ int reread(const int* at) {
    int v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(at));
    return v;
}

// Sequence b's first query and key rows and its lengths.
template <typename Params>
struct PackedRows {
    const Params& p;
    int b;

    __device__ __forceinline__ PackedRows(const Params& params, int batch) : p(params), b(batch) {}
    __device__ __forceinline__ int q0() const { return reread(p.varlen.cu_seqlens_q + b); }
    __device__ __forceinline__ int k0() const { return reread(p.varlen.cu_seqlens_k + b); }
    __device__ __forceinline__ int sq() const { return reread(p.varlen.cu_seqlens_q + b + 1) - q0(); }
    __device__ __forceinline__ int sk() const { return reread(p.varlen.cu_seqlens_k + b + 1) - k0(); }
};

// Entry b's key count in a KV cache.
template <typename Params>
__device__ __forceinline__ int cache_keys(const Params& p, int b) {
    return p.cache.seqlens[b] + p.cache.new_keys;
}

// The lengths of one batch entry, for the pieces that need them without addressing rows (Mask,
// ScoreMod): nothing to hold for dense calls.
template <int Seq>
struct SeqLens {
    template <typename Params>
    __device__ __forceinline__ void at(const Params&, int) {}
    template <typename Params>
    __device__ __forceinline__ int q(const Params& p) const { return p.seqlen_q; }
    template <typename Params>
    __device__ __forceinline__ int k(const Params& p) const { return p.seqlen_k; }
};
// Packed calls hold the two lengths, unlike SeqInfo: the masks read them per tile and per
// element, and reading them at each use there moved spills between kernels instead of
// removing them (benchmarks/NOTES.md).
template <>
struct SeqLens<SEQ_PACKED> {
    int sq = 0, sk = 0;
    template <typename Params>
    __device__ __forceinline__ void at(const Params& p, int b) {
        const PackedRows<Params> rows(p, b);
        sq = rows.sq();
        sk = rows.sk();
    }
    template <typename Params>
    __device__ __forceinline__ int q(const Params&) const { return sq; }
    template <typename Params>
    __device__ __forceinline__ int k(const Params&) const { return sk; }
};
struct CacheLens {
    int sk = 0;
    template <typename Params>
    __device__ __forceinline__ void at(const Params& p, int b) { sk = cache_keys(p, b); }
    template <typename Params>
    __device__ __forceinline__ int q(const Params& p) const { return p.seqlen_q; }
    template <typename Params>
    __device__ __forceinline__ int k(const Params&) const { return sk; }
};
template <>
struct SeqLens<SEQ_CACHE> : CacheLens {};
template <>
struct SeqLens<SEQ_PAGED> : CacheLens {};

template <typename Params, int Seq = SEQ_DENSE>
struct SeqInfo {
    const Params& p;
    int b;

    __device__ __forceinline__ SeqInfo(const Params& params, int batch) : p(params), b(batch) {}

    __device__ __forceinline__ int seqlen_q() const { return p.seqlen_q; }
    __device__ __forceinline__ int seqlen_k() const { return p.seqlen_k; }

    // Row `row` of head h of a query-side tensor (q, o, dout, dq) or key-side one (k, v, dk, dv).
    template <typename T>
    __device__ __forceinline__ T* q_row(const TensorRef& t, int h, index_t row) const {
        return row_ptr<T>(t, b, h, row);
    }
    template <typename T>
    __device__ __forceinline__ T* k_row(const TensorRef& t, int h, index_t row) const {
        return row_ptr<T>(t, b, h, row);
    }
    // Index of query row `row` of head h in the (batch, nheads, seqlen_q) row statistics.
    __device__ __forceinline__ index_t stat(int h, int row) const {
        return (static_cast<index_t>(b) * p.nheads + h) * p.seqlen_q + row;
    }
    // Tile `tile` (query rows 16 tile ..) of head h in the fp32 dQ buffer, of p.dq_accum_rows
    // rows per (batch, head); the same as tile accum_slab_tile(tile) of slab accum_slab(h)
    // (accum_tile written through those two changed the code of the kernels that use it).
    __device__ __forceinline__ index_t accum_tile(int h, int tile) const {
        return (static_cast<index_t>(b) * p.nheads + h) * (p.dq_accum_rows / 16) + tile;
    }
    __device__ __forceinline__ index_t accum_slab(int h) const { return static_cast<index_t>(b) * p.nheads + h; }
    __device__ __forceinline__ int accum_slab_tile(int tile) const { return tile; }
    // The row and batch coordinates of query row `row` (key row) in the Hopper kernels' tensor
    // maps (head dim, heads, rows, batch).
    __device__ __forceinline__ int q_map_row(int row) const { return row; }
    __device__ __forceinline__ int k_map_row(int row) const { return row; }
    __device__ __forceinline__ int map_batch() const { return b; }
    // Rows row0 .. row0 + n - 1 hold no row of another sequence: the copy engine may store them
    // whole (it clips rows past the tensor's end).
    __device__ __forceinline__ bool q_rows_own(int, int) const { return true; }
    __device__ __forceinline__ bool k_rows_own(int, int) const { return true; }
};

template <typename Params>
struct SeqInfo<Params, SEQ_PACKED> {
    const Params& p;
    int b;
    PackedRows<Params> rows;

    __device__ __forceinline__ SeqInfo(const Params& params, int batch) : p(params), b(batch), rows(params, batch) {}

    __device__ __forceinline__ int seqlen_q() const { return rows.sq(); }
    __device__ __forceinline__ int seqlen_k() const { return rows.sk(); }

    // Every packed tensor is one (1, total, nheads, headdim) slice.
    template <typename T>
    __device__ __forceinline__ T* q_row(const TensorRef& t, int h, index_t row) const {
        return row_ptr<T>(t, 0, h, rows.q0() + row);
    }
    template <typename T>
    __device__ __forceinline__ T* k_row(const TensorRef& t, int h, index_t row) const {
        return row_ptr<T>(t, 0, h, rows.k0() + row);
    }
    // (nheads, total_q) statistics.
    __device__ __forceinline__ index_t stat(int h, int row) const {
        return static_cast<index_t>(h) * p.varlen.total_q + rows.q0() + row;
    }
    // The buffer is (nheads, p.dq_accum_rows), sequence b's slice from row (q0 / ACCUM_ALIGN + b)
    // ACCUM_ALIGN: past the previous sequence's last whole tile. A head's rows are its slab.
    __device__ __forceinline__ index_t accum_tile(int h, int tile) const {
        const index_t first = (static_cast<index_t>(rows.q0() / ACCUM_ALIGN) + b) * (ACCUM_ALIGN / 16);
        return static_cast<index_t>(h) * (p.dq_accum_rows / 16) + first + tile;
    }
    __device__ __forceinline__ index_t accum_slab(int h) const { return h; }
    __device__ __forceinline__ int accum_slab_tile(int tile) const {
        return (rows.q0() / ACCUM_ALIGN + b) * (ACCUM_ALIGN / 16) + tile;
    }
    __device__ __forceinline__ int q_map_row(int row) const { return rows.q0() + row; }
    __device__ __forceinline__ int k_map_row(int row) const { return rows.k0() + row; }
    __device__ __forceinline__ int map_batch() const { return 0; }
    // A tile that reaches past the sequence's end would write the next sequence's rows.
    __device__ __forceinline__ bool q_rows_own(int row0, int n) const { return row0 + n <= rows.sq(); }
    __device__ __forceinline__ bool k_rows_own(int row0, int n) const { return row0 + n <= rows.sk(); }
};

// The fp32 dQ buffer in column strips (bwd.cu's DQ_STRIPS, for the 80-query Hopper pass): each
// slab of p.dq_accum_rows rows (a (batch, head), or a head of a packed batch) as strips of 16
// columns, each strip the 16 x 16 blocks of its 16-row tiles one after another, so that 16
// columns of a run of tiles are one span. The float offset of tile `tile`'s block in strip
// `strip` (strips of a slab are dq_accum_rows * 16 floats apart).
template <typename Seq>
__device__ __forceinline__ index_t accum_strip_block(const Seq& seq, int h, int tile, int strip) {
    const unsigned strips = seq.p.dq_accum_cols, tiles = seq.p.dq_accum_rows;   // >= 0: shifts
    return ((seq.accum_slab(h) * (strips / 16) + strip) * (tiles / 16) + seq.accum_slab_tile(tile)) * 256;
}

// A KV cache's entry: dense queries, keys at rows of the entry's cache slice or pages.
template <typename Params, bool Paged>
struct CacheSeqInfo {
    const Params& p;
    int b;
    int sk;

    __device__ __forceinline__ CacheSeqInfo(const Params& params, int batch)
        : p(params), b(batch), sk(cache_keys(params, batch)) {}

    __device__ __forceinline__ int seqlen_q() const { return p.seqlen_q; }
    __device__ __forceinline__ int seqlen_k() const { return sk; }

    template <typename T>
    __device__ __forceinline__ T* q_row(const TensorRef& t, int h, index_t row) const {
        return row_ptr<T>(t, b, h, row);
    }
    // Key row `row` of the cache: in a page (the page's index is the tensor's batch index).
    // k_page looks the page up (the entry itself in a contiguous cache), k_row_at finds the row
    // there: apart, a kernel can issue the table's load ahead of the copy that needs it.
    __device__ __forceinline__ int k_page(index_t row) const {
        if constexpr (Paged) {
            return p.cache.block_table[static_cast<index_t>(b) * p.cache.pages_per_seq + row / p.cache.page_size];
        } else {
            return b;
        }
    }
    template <typename T>
    __device__ __forceinline__ T* k_row_at(const TensorRef& t, int page, int h, index_t row) const {
        return row_ptr<T>(t, page, h, Paged ? row % p.cache.page_size : row);
    }
    template <typename T>
    __device__ __forceinline__ T* k_row(const TensorRef& t, int h, index_t row) const {
        return k_row_at<T>(t, k_page(row), h, row);
    }
    __device__ __forceinline__ index_t stat(int h, int row) const {
        return (static_cast<index_t>(b) * p.nheads + h) * p.seqlen_q + row;
    }
};
template <typename Params>
struct SeqInfo<Params, SEQ_CACHE> : CacheSeqInfo<Params, false> {
    using CacheSeqInfo<Params, false>::CacheSeqInfo;
};
template <typename Params>
struct SeqInfo<Params, SEQ_PAGED> : CacheSeqInfo<Params, true> {
    using CacheSeqInfo<Params, true>::CacheSeqInfo;
};
