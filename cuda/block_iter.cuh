// Which blocks a tile visits: the key blocks of a query block (forward, dQ pass) and the
// query blocks of a key block (dK/dV pass), and which of them need element masking.
// Dense attention visits a contiguous range; block-sparse masks will plug in here as lists
// of kept blocks, partial ones apart from full ones.
#pragma once
#include "mask.cuh"

struct KeyBlocks {
    int count;          // blocks to visit
    int mask_free_end;  // keys below this are visible to every row of the query block

    __device__ __forceinline__ int block(int it) const { return it; }
    __device__ __forceinline__ bool needs_mask(int it, int Bc) const {
        return (block(it) + 1) * Bc > mask_free_end;
    }
};

template <bool Causal>
__device__ __forceinline__ KeyBlocks key_blocks(int row0, int Br, int Bc, int seqlen_q, int seqlen_k) {
    const int last_row = min(row0 + Br, seqlen_q) - 1;
    const int end = key_end<Causal>(last_row, seqlen_q, seqlen_k);
    KeyBlocks kb;
    kb.count = end > 0 ? (end + Bc - 1) / Bc : 0;
    kb.mask_free_end = key_end<Causal>(row0, seqlen_q, seqlen_k);
    return kb;
}

struct QueryBlocks {
    int first, last;    // visit query blocks first .. last-1
    int col0, cols;     // the key block: keys col0 .. col0+cols-1

    __device__ __forceinline__ int count() const { return last - first; }
    __device__ __forceinline__ int block(int it) const { return first + it; }
};

template <bool Causal>
__device__ __forceinline__ QueryBlocks query_blocks(int col0, int Br, int Bc, int seqlen_q, int seqlen_k) {
    QueryBlocks qb;
    qb.col0 = col0;
    qb.cols = min(Bc, seqlen_k - col0);
    qb.first = query_begin<Causal>(col0, seqlen_q, seqlen_k) / Br;
    qb.last = (seqlen_q + Br - 1) / Br;
    return qb;
}

// A (query block, key block) pair needs element masking when some key of the key block is
// hidden from the first (most restricted) row of the query block.
template <bool Causal>
__device__ __forceinline__ bool pair_needs_mask(int row0, int col0, int Bc, int seqlen_q, int seqlen_k) {
    return col0 + Bc > key_end<Causal>(row0, seqlen_q, seqlen_k);
}
