// Where the rows of one batch entry live and how many there are. Every kernel reaches q, k, v,
// their gradients and the row statistics (lse, D) through this piece, so that packed
// variable-length batches, paged KV caches and sequence shards change it alone, not the loops.
// Today entry b holds seqlen_q query rows and seqlen_k keys at row 0 of its own slice. The
// lengths are read from the parameters at each use, not copied: ptxas then takes them as
// constant-bank operands instead of holding registers across the loops.
#pragma once
#include "params.cuh"

template <typename Params>
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
};
