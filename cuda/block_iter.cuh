// Which blocks a tile visits, and which of them need element masking: the key blocks of a
// query block (forward, dQ pass) and the query blocks of a key block (dK/dV pass).
// Dense attention visits a contiguous range [first, first + count) and tells masked blocks by
// position: blocks inside the span that every row (key) of the tile sees in full are
// mask-free, those on either side of it are not. A block-sparse mask gives a list per tile
// (BlockList), its partial blocks first.
#pragma once
#include "params.cuh"
#include "mask.cuh"

// Where a thread block works: its tile (query tile of the forward and dQ passes, key tile of
// the dK/dV pass) and its head and batch.
struct BlockCoord { int tile, head, batch; };

// Blocks start in the order of blockIdx.x, then y, then z. With p.launch_group == 0 the grid
// is (tiles, heads, batch): the tiles of a head run together and share its tensors in L2. In a
// causal pass tiles differ in length, and a long one that starts last runs alone at the end;
// so a causal pass launches (launch_group, tiles, groups) where it can: the (head, batch)
// pairs of a group run x-fastest and every long tile of the group starts before its short
// ones. `longest_first` maps launch order to tile index. The last group may be short:
// a block with batch >= p.batch has no work.
template <bool Causal, typename Params, typename LongestFirst>
__device__ __forceinline__ BlockCoord block_coord(const Params& p, int heads, LongestFirst longest_first) {
    if (!Causal || p.launch_group == 0) {
        const int x = blockIdx.x;
        return {Causal ? longest_first(x) : x, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
    }
    const int hb = blockIdx.z * p.launch_group + blockIdx.x;
    return {longest_first(static_cast<int>(blockIdx.y)), hb % heads, hb / heads};
}

// A persistent kernel walks the same grid itself: block (x, y, z) of it. (block_coord reads
// blockIdx where it uses it; passing it in here changed the generic kernels' code.)
template <bool Causal, typename Params, typename LongestFirst>
__device__ __forceinline__ BlockCoord block_coord_at(const Params& p, int heads, LongestFirst longest_first, int x,
                                                     int y, int z) {
    if (!Causal || p.launch_group == 0) return {Causal ? longest_first(x) : x, y, z};
    const int hb = z * p.launch_group + x;
    return {longest_first(y), hb % heads, hb / heads};
}

struct KeyBlocks {
    const int* idx;     // the sparse list, or null
    int first;          // dense: the first key block
    int count;          // blocks to visit
    int n_partial;      // sparse: the first n_partial blocks need masking
    int free_begin;     // dense: keys in [free_begin, free_end) are visible to every row of
    int free_end;       // the query block

    __device__ __forceinline__ int block(int it) const { return idx ? idx[it] : first + it; }
    // The position of the it-th block visited by a walk that starts at position `pivot`, goes
    // to the last, then from pivot - 1 back to the first.
    __device__ __forceinline__ int from_pivot(int it, int pivot) const {
        const int after = count - pivot;
        return it < after ? pivot + it : pivot - 1 - (it - after);
    }
    // How many blocks, from the first, the rows [row0, row0 + rows) of the tile see: a
    // sub-tile of a dense walk in key order may stop early. Rows all past seqlen_q walk one
    // block (nothing of theirs is stored); a block list keeps the tile's count.
    template <typename V, typename Params>
    __device__ __forceinline__ int blocks_seen(const Mask<V, Params>& mask, int row0, int rows, int Bc) const {
        if (idx) return count;
        const int last = min(row0 + rows, mask.seqlen_q()) - 1;
        const int end = last < row0 ? 0 : (mask.key_end(last) + Bc - 1) / Bc - first;
        return min(count, max(end, 1));
    }
    template <typename V>
    __device__ __forceinline__ bool needs_mask(int it, int Bc) const {
        if (idx) return it < n_partial;
        const int j = block(it);
        return (j + 1) * Bc > free_end || (V::Local && j * Bc < free_begin);
    }
};

// The key blocks of query tile `m_tile` (rows row0 .. row0+Br-1, row0 = m_tile Br - lead) of
// head h. A dense walk may take its tiles `lead` rows early, so that they end at the last row.
template <typename V, typename Params>
__device__ __forceinline__ KeyBlocks key_blocks(const BlockList& bl, const Mask<V, Params>& mask, int h,
                                                int m_tile, int Br, int Bc, int lead = 0) {
    const int row0 = m_tile * Br - lead;
    const int row_last = min(row0 + Br, mask.seqlen_q()) - 1;
    KeyBlocks kb;
    kb.free_begin = mask.key_begin(row_last);
    kb.free_end = mask.key_end(row0);
    if (bl.idx) {
        const index_t r = block_row(bl, h, m_tile);
        kb.idx = bl.idx + r * bl.width;
        kb.first = 0;
        kb.count = bl.count[r];
        kb.n_partial = bl.partial[r];
    } else {
        const int begin = mask.key_begin(row0), end = mask.key_end(row_last);
        kb.idx = nullptr;
        kb.first = begin / Bc;
        kb.count = end > begin ? (end + Bc - 1) / Bc - kb.first : 0;
        kb.n_partial = 0;
    }
    return kb;
}

struct QueryBlocks {
    const int* idx;     // the sparse list, or null
    int count;
    int n_partial;
    int first;          // dense: the first query block that sees the key block

    __device__ __forceinline__ int block(int it) const { return idx ? idx[it] : first + it; }
    // Some key of the block (keys col0 .. col0+Bc-1) is hidden from some row of query block
    // `it` (rows row0 .. row0+Br-1): past the end of the band (or of the keys) for its first
    // row, or before the start of the band for its last.
    template <typename V, typename Params>
    __device__ __forceinline__ bool needs_mask(int it, int row0, int Br, int Bc, int col0,
                                               const Mask<V, Params>& mask) const {
        if (idx) return it < n_partial;
        return col0 + Bc > mask.key_end(row0) ||
               (V::Local && col0 < mask.key_begin(min(row0 + Br, mask.seqlen_q()) - 1));
    }
};

// The query blocks that visit key tile `n_tile` (keys col0 .. col0+Bc-1) for query head h.
template <typename V, typename Params>
__device__ __forceinline__ QueryBlocks query_blocks(const BlockList& bl, const Mask<V, Params>& mask, int h,
                                                    int n_tile, int Br, int Bc) {
    QueryBlocks qb;
    if (bl.idx) {
        const index_t r = block_row(bl, h, n_tile);
        qb.idx = bl.idx + r * bl.width;
        qb.count = bl.count[r];
        qb.n_partial = bl.partial[r];
        qb.first = 0;
    } else {
        const int col0 = n_tile * Bc;
        const int begin = mask.query_begin(col0);
        qb.idx = nullptr;
        qb.first = begin / Br;
        if constexpr (V::Local) {
            const int end = mask.query_end(min(col0 + Bc, mask.seqlen_k()) - 1);
            qb.count = end > begin ? (end + Br - 1) / Br - qb.first : 0;
        } else {
            qb.count = (mask.seqlen_q() + Br - 1) / Br - qb.first;
        }
        qb.n_partial = 0;
    }
    return qb;
}
