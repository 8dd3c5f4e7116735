// Which keys a query row may see: the bounds of the sequence and the causal mask.
// Causal attention with seqlen_q != seqlen_k is aligned bottom-right (FlashAttention 2.1+):
// query i sees keys j <= i + seqlen_k - seqlen_q.
#pragma once

// One past the last key that query `row` may see (<= 0 when it sees none).
template <bool Causal>
__device__ __forceinline__ int key_end(int row, int seqlen_q, int seqlen_k) {
    if constexpr (Causal) {
        const int end = row + 1 + seqlen_k - seqlen_q;
        return end < seqlen_k ? end : seqlen_k;
    } else {
        return seqlen_k;
    }
}

// The first query row that sees key `col` (every row when not causal).
template <bool Causal>
__device__ __forceinline__ int query_begin(int col, int seqlen_q, int seqlen_k) {
    if constexpr (Causal) {
        const int begin = col - (seqlen_k - seqlen_q);
        return begin > 0 ? begin : 0;
    } else {
        return 0;
    }
}
