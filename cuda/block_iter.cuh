// Which blocks a tile visits, and which of them need element masking: the key blocks of a
// query block (forward, dQ pass) and the query blocks of a key block (dK/dV pass).
// Dense attention visits a contiguous range and tells masked blocks by position; a block-sparse
// mask gives a list per tile (BlockList), its partial blocks first.
#pragma once
#include "params.cuh"
#include "mask.cuh"

// A (query block, key block) pair needs element masking when some key of the key block is
// hidden from the first (most restricted) row of the query block, or lies past the end.
template <bool Causal>
__device__ __forceinline__ bool pair_needs_mask(int row0, int col0, int Bc, int seqlen_q, int seqlen_k) {
    return col0 + Bc > key_end<Causal>(row0, seqlen_q, seqlen_k);
}

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

struct KeyBlocks {
    const int* idx;     // the sparse list, or null
    int count;          // blocks to visit
    int n_partial;      // sparse: the first n_partial blocks need masking
    int mask_free_end;  // dense: keys below this are visible to every row of the query block

    __device__ __forceinline__ int block(int it) const { return idx ? idx[it] : it; }
    __device__ __forceinline__ bool needs_mask(int it, int Bc) const {
        return idx ? it < n_partial : (it + 1) * Bc > mask_free_end;
    }
};

// The key blocks of query tile `m_tile` (rows row0 .. row0+Br-1) of head h.
template <bool Causal>
__device__ __forceinline__ KeyBlocks key_blocks(const BlockList& bl, int h, int m_tile, int Br, int Bc,
                                                int seqlen_q, int seqlen_k) {
    const int row0 = m_tile * Br;
    KeyBlocks kb;
    kb.mask_free_end = key_end<Causal>(row0, seqlen_q, seqlen_k);
    if (bl.idx) {
        const index_t r = block_row(bl, h, m_tile);
        kb.idx = bl.idx + r * bl.width;
        kb.count = bl.count[r];
        kb.n_partial = bl.partial[r];
    } else {
        const int end = key_end<Causal>(min(row0 + Br, seqlen_q) - 1, seqlen_q, seqlen_k);
        kb.idx = nullptr;
        kb.count = end > 0 ? (end + Bc - 1) / Bc : 0;
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
    template <bool Causal>
    __device__ __forceinline__ bool needs_mask(int it, int Br, int Bc, int col0, int seqlen_q, int seqlen_k) const {
        return idx ? it < n_partial : pair_needs_mask<Causal>(block(it) * Br, col0, Bc, seqlen_q, seqlen_k);
    }
};

// The query blocks that visit key tile `n_tile` (keys col0 .. col0+Bc-1) for query head h.
template <bool Causal>
__device__ __forceinline__ QueryBlocks query_blocks(const BlockList& bl, int h, int n_tile, int Br, int Bc,
                                                    int seqlen_q, int seqlen_k) {
    QueryBlocks qb;
    if (bl.idx) {
        const index_t r = block_row(bl, h, n_tile);
        qb.idx = bl.idx + r * bl.width;
        qb.count = bl.count[r];
        qb.n_partial = bl.partial[r];
        qb.first = 0;
    } else {
        qb.idx = nullptr;
        qb.first = query_begin<Causal>(n_tile * Bc, seqlen_q, seqlen_k) / Br;
        qb.count = (seqlen_q + Br - 1) / Br - qb.first;
        qb.n_partial = 0;
    }
    return qb;
}
