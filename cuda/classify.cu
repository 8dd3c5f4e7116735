// The blocks of a user mask_mod (user.cuh): for each (head, query block, key block) the number
// of elements inside the sequences that the mask shows, summed over the batch. The host
// (cupyflash/masks.py, from_mask_mod) turns the counts into empty, partial and full blocks, so
// that the attention kernels skip the empty ones and evaluate the rule only in partial ones.
#include "user.cuh"

struct ClassifyParams {
    UserParams user;
    int* counts;          // (heads, nbq, nbk), zeroed
    int seqlen_q, seqlen_k;
    int block_q, block_k;
    int heads;            // 1 when the mask is the same for every head (asked at h = 0)
};

// Grid (key blocks, query blocks, heads x batch).
template <typename Mods>
__global__ void __launch_bounds__(256) classify_blocks_kernel(const ClassifyParams p) {
    const int j = blockIdx.x, i = blockIdx.y;
    const int h = blockIdx.z % p.heads, b = blockIdx.z / p.heads;
    const int r0 = i * p.block_q, c0 = j * p.block_k;
    const int rows = min(p.block_q, p.seqlen_q - r0), cols = min(p.block_k, p.seqlen_k - c0);
    int seen = 0;
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x)
        seen += Mods::mask(p.user, b, h, r0 + e / cols, c0 + e % cols) ? 1 : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) seen += __shfl_xor_sync(0xffffffffu, seen, o);
    if (threadIdx.x % 32 == 0 && seen > 0)
        atomicAdd(p.counts + (static_cast<index_t>(h) * gridDim.y + i) * gridDim.x + j, seen);
}
