// Kernel parameters. Each struct is mirrored field for field by a NumPy dtype in
// cupyflash/_launch.py (FWD_PARAMS / BWD_PARAMS); tests/test_params.py checks that
// size and offsets agree with what NVRTC computes for these structs.
#pragma once

typedef long long index_t;  // 64-bit: batch x seqlen x nheads x headdim passes 2**31

// A (batch, seqlen, nheads, headdim) tensor whose last dimension is contiguous.
// Strides are in elements.
struct TensorRef {
    void* ptr;
    index_t batch_stride;
    index_t row_stride;
    index_t head_stride;
};

// Block-sparse iteration lists, in units of the kernel's tiles (null idx: dense). For each
// (mask head, tile on one side) the tiles of the other side to visit, the `partial` ones that
// need element masking first: idx (heads, rows, width), count and partial (heads, rows), int32.
struct BlockList {
    const int* idx;
    const int* count;
    const int* partial;
    int width;           // padded list length: the number of tiles on the listed side
    int rows;            // the number of tiles on the other side
    int heads;           // 1 (one mask for all heads) or nheads
    int row_tile;        // tile sizes (rows and listed side), which the tensor-core kernels
    int list_tile;       // know as template constants and the plain kernels read from here
};

// The score modifiers of a Variant with Softcap or Alibi (score_mod.cuh); the host derives the
// float constants, which the kernels then read as operands instead of holding registers.
struct ScoreParams {
    double softcap;          // > 0 with Softcap: scores s become softcap * tanh(s / softcap)
    float softcap_in;        // scale / softcap: the argument of tanh per unit of q.k
    float softcap_log2;      // softcap * log2(e): a tanh to log2 units
    const float* alibi;      // ALiBi slopes, float32 (batch, nheads) with batch stride
    int alibi_stride;        // nheads, or 0 for one row of slopes shared by the batch
    float alibi_unit;        // -log2(e) / ScoreMod::mult: a slope to a bias in held units
    float scale;             // the softmax scale in float: a user score_mod's score is q.k * scale
    int bounded;             // softcap alone, within range: the softmax's base is fixed (ScoreMod::bounded)
};

// Dropout of a Variant with Dropout (dropout.cuh, philox.cuh).
struct DropoutParams {
    unsigned long long seed;   // the Philox key
    unsigned offset;           // the counter's last word
    unsigned threshold;        // a random byte below it drops its element
    double scale;              // 1 / (1 - p), p = threshold / 256: kept weights are scaled by it
};

// The read-only arrays of a call's user mods (score_mod, mask_mod; user.cuh), in the order the
// mods declare them, C-contiguous: pointers and shapes (unused dimensions 1). `grads` are the
// gradient buffers of the arrays a score_mod differentiates (null for the others): float64
// for float64 inputs, else float32.
constexpr int USER_ARRAYS = 8, USER_NDIM = 4;
struct UserParams {
    const void* arrays[USER_ARRAYS];
    void* grads[USER_ARRAYS];
    int shape[USER_ARRAYS][USER_NDIM];
};

// A packed variable-length batch (Variant::Varlen, seqinfo.cuh): sequence b's query rows are
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of the (total_q, nheads, headdim) tensors, its keys
// likewise; int32, batch + 1 entries each. Unused by dense calls.
struct VarlenParams {
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;         // the row statistics are (nheads, total_q)
};

// The KV cache of a decoding call (SEQ_CACHE, SEQ_PAGED: seqinfo.cuh). Unused by other calls.
struct CacheParams {
    const int* seqlens;       // (batch,) keys in each entry's cache before this call's append
    const int* block_table;   // SEQ_PAGED: (batch, pages_per_seq) page indices
    int new_keys;             // keys this call appended to every entry
    int page_size;            // SEQ_PAGED: rows per page
    int pages_per_seq;
};

struct FwdParams {
    TensorRef q, k, v, o;
    void* lse;           // (batch, nheads, seqlen_q), contiguous, natural log; float32,
                         // or float64 for float64 inputs (see acc_t in common.cuh)
    int batch, nheads, nheads_k, group;   // group = nheads / nheads_k (GQA)
    int seqlen_q, seqlen_k, headdim;
    int vec_ok;          // every row start is 16-byte aligned: 16-byte vector loads allowed
    int launch_group;    // causal tensor-core passes: (head, batch) pairs per launch group
                         // (block_coord in block_iter.cuh)
    double scale;        // softmax scale applied to q.k (double for the float64 path)
    float scale_log2;    // scale * log2(e): the fp16/bf16/fp32 kernels work in base 2
    int window_left, window_right;   // the band of a local Variant (mask.cuh)
    ScoreParams mod;     // softcap and ALiBi (score_mod.cuh)
    DropoutParams drop;
    BlockList kv_blocks; // per query tile, the key tiles to visit
    UserParams user;
    VarlenParams varlen;
    CacheParams cache;
};

struct BwdParams {
    TensorRef q, k, v, o, dout, dq, dk, dv;
    const void* lse;     // (batch, nheads, seqlen_q), natural log, from the forward
    void* dsum;          // D = rowsum(dout * out), (batch, nheads, seqlen_q); lse's dtype
    void* lse_log2;      // lse * log2(e), +inf for a row without keys (its probabilities are
                         // then exactly 0); lse's shape and dtype. Written with D by
                         // bwd_preprocess_kernel, so that the passes exponentiate with one FMA
    float* dq_accum;     // fp32 dQ in mma-ordered tiles (bwd.cu, DQ_TILE), (batch, nheads,
                         // dq_accum_rows, dq_accum_cols) floats; rows and columns padded to
                         // whole tiles so that the atomics need no bounds checks; null when dQ
                         // has its own query-block-parallel pass
    int dq_accum_rows, dq_accum_cols;
    int batch, nheads, nheads_k, group;
    int seqlen_q, seqlen_k, headdim;
    int vec_ok;
    int launch_group;
    double scale;
    float scale_log2;
    int window_left, window_right;
    ScoreParams mod;
    DropoutParams drop;
    BlockList kv_blocks; // per query tile, the key tiles to visit (dQ pass)
    BlockList q_blocks;  // per key tile, the query tiles that visit it (dK/dV pass)
    UserParams user;
    VarlenParams varlen;
};

// The list of one (head, tile) row of a BlockList.
__device__ __forceinline__ index_t block_row(const BlockList& bl, int h, int tile) {
    return static_cast<index_t>(bl.heads == 1 ? 0 : h) * bl.rows + tile;
}

// Row i of a (batch, seqlen, nheads, headdim) tensor, for one batch and head.
template <typename T>
__device__ __forceinline__ T* row_ptr(const TensorRef& t, int b, int h, index_t row) {
    return reinterpret_cast<T*>(t.ptr) + b * t.batch_stride + h * t.head_stride
           + row * t.row_stride;
}
