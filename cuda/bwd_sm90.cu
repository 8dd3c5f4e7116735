// The dK/dV pass of the backward for Hopper (sm_90a), with dQ added atomically (bwd.cu's fp32
// buffer and its convert kernel). It runs as bwd_preprocess_kernel's programmatic dependent: its
// blocks may start beside the preprocess's last ones and copy K, V, Q and dO, and wait for the
// preprocess (D, lse in log2 units, the buffer zeroed) before they use them; at head dim 128 with
// 64-query steps the preprocess runs beside the whole pass instead (bwd_preprocess_beside_kernel),
// and the pass waits per step for the rows it reads. One thread block per
// (key block, kv head, batch) keeps dK and dV in registers while it walks every query block (64
// rows; 128 at head dim 64) of every query head of its group (BwdSteps), as bwd.cu's pass does,
// with Hopper's units. Two kernels share the block's skeleton:
// - a producer warpgroup (bwd_sm90_produce, registers given back): one thread copies K and V
//   once and Q and dO per query block into two stages (tensor maps, mbarriers; a stage is
//   reused once every consumer thread has released it), one warp the rows' lse and D next to
//   them;
// - two consumer warpgroups that multiply by wgmma, with the mask and score modifier of the
//   shared pieces, and add dQ through each warp's fp32 stage in the buffer's tile order by
//   bulk reduce-adds of the copy engine (stage_dq_rows, push_dq_rows), instead of atomics per
//   element; dK and dV leave through K and V's tiles and bulk tensor stores.
// flash_bwd_sm90_kernel (head dims 64 and 128): 128 keys, 64 per warpgroup. S^T = K Q^T and
// dP^T = V dO^T from shared memory; then, in four parts of the queries, P^T = exp2(S^T - lse)
// and dS^T = P^T (dP^T - D) as A fragments, dS^T also to shared memory (two steps' tiles,
// alternating), and dV += P^T dO and dK += dS^T Q from registers, each part's products
// running while the next part is made; once both warpgroups' tiles are there, dQ +=
// dS K over all 128 keys, both operands transposed, for 64 queries x half the head dim (the
// warpgroup's) at d = 128, for the warpgroup's 64 of the 128 queries x the whole head dim at
// d = 64 (the last part's dK product follows dQ's and runs while dQ is staged). A step's dQ is
// staged at its end and pushed to the buffer in the next step, once that step's S^T and dP^T
// are issued: the fence and the add then wait under its products.
// At d = 128 without a band, or causal from 8K query rows (_launch.sm90_bwd_rows), steps of
// 80 queries: S^T and dP^T by m64n80, dS stored with queries as rows (stmatrix.trans), and
// dQ^T = K^T dS^T for the warpgroup's 64 columns x 80 queries, each warp's 16 columns one
// span of the buffer in column strips (bwd.cu's DQ_STRIPS).
// flash_bwd_sm90_wide_kernel (head dim 256): see there.
// A user score_mod (both kernels): P^T and dS^T element by element from the raw S^T once
// dP^T is in (user_probs_t); its arrays' gradients are summed in each consumer thread's
// registers while they add to one element (user.cuh's GradArray), flushed at the end.
// The head dim is the bucket's rounded up (_launch.sm90_bwd_headdim): the copy engine fills
// the columns past the real head dim with zeros, the stores clip them, and dQ is added for the
// bucket's columns only.
#include "common.cuh"
#include "sm90.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"
#include "bwd_rows.cuh"

// BwdParams and the tensor maps of q, k, v, dout, dk and dv (head dim, heads, rows, batch;
// boxes of 64 x 64).
struct BwdSm90Params {
    TmaDesc q, k, v, dout, dk, dv;
    BwdParams base;
    int* dq_order;   // deterministic dQ: one counter per (batch, head, query block); else null
    int* dq_done;    // per (batch, kv head), the blocks that have finished (block_done); or null
    // The preprocess beside the pass (bwd_preprocess_beside_kernel): a flag per (batch, query
    // head, PREPROCESS_ROWS rows), set once their D, lse and zeroed dQ tiles are written; or
    // null (the pass is bwd_preprocess_kernel's dependent and waits for all of it).
    const int* ready;
};

// With tp.ready: until the preprocess has written rows [row0, row0 + rows) of head h of batch
// entry b (rows past seqlen_q not waited for), by the warp's lane 0.
__device__ __forceinline__ void wait_ready(const BwdSm90Params& tp, int b, int h, int row0, int rows, int seqlen_q,
                                           int lane) {
    if (lane == 0) {
        const BwdParams& p = tp.base;
        const int blocks_q = (p.seqlen_q + PREPROCESS_ROWS - 1) / PREPROCESS_ROWS, last = min(row0 + rows, seqlen_q) - 1;
        const int* unit = tp.ready + (static_cast<index_t>(b) * p.nheads + h) * blocks_q;
        for (int x = row0 / PREPROCESS_ROWS; x <= last / PREPROCESS_ROWS; ++x) wait_unit(unit + x);
    }
    __syncwarp();
}

// Whether a pass kernel reads the preprocess beside it (tp.ready, which _launch.preprocess_beside
// sets for head dim 128, 64-query steps and dense rows without ALiBi or a block mask): its
// statistics warp waits per step for the flags, and no thread waits for the preprocess's end.
// Elsewhere that wait, in a warp of 24 registers a thread, made ptxas serialize the consumers'
// wgmma (80 queries) or spill (d = 64, NVRTC 13.0); mask_mods' kernels (whose calls always have
// a block mask) never run beside it and compile without it (+0.3-0.9%); the others compile as
// without it. Kernels that carry the wait but run with tp.ready null: a plain kernel with a
// block mask, and ALiBi's (without the wait its causal 8K backward ran 2.4% slower: the
// schedule's; benchmarks/NOTES.md, forty-ninth session).
template <int HeadDim, int Br, typename V>
__device__ constexpr bool reads_beside() {
    return V::Seq == SEQ_DENSE && HeadDim == 128 && Br == 64 && !V::UserMask;
}

// The preprocess beside the pass (_launch.preprocess_beside): bwd_preprocess_kernel's work
// (bwd_rows.cuh's units of PREPROCESS_ROWS rows of one query head) on a few SMs, one block each,
// while the pass (its programmatic dependent: every block here triggers it first) runs on the
// others and waits per step for its units' flags (wait_ready). The units go in the order the
// pass first reads them: `group_pairs` (batch, kv head) pairs at a time (a causal pass's launch
// group; else the pairs of its first wave), each group's row blocks in order, all its pairs'
// query heads at each. Two roles, so that the reads never wait on the writes:
// - BESIDE_LOADERS warps sum the rows: their first thread has the copy engine bring each unit's
//   O and dO (64-column boxes, the pass's dout map) into `stages` slots on mbarriers, refilled
//   once the role has summed them (4 threads a row); the sums go to a ring of BESIDE_RING rows
//   of D in shared memory;
// - BESIDE_WRITERS groups of BESIDE_ARRIVALS warps take the units in turn and write each one's
//   D (from the ring), lse in log2 units and zeroed dQ tiles; then each warp adds 1 to the
//   unit's flag, a release that waits for its own writes and stalls that warp alone, so that one
//   group's stores run while another's drain. The flag is set at BESIDE_ARRIVALS.
// Measured alone (benchmarks/NOTES.md, forty-sixth session): an SM's stores run at ~63 GB/s and
// its bulk loads at ~114; copies a row at a time (~110 clocks each) and a release per unit in
// the warps that also load held earlier forms of this kernel to 17-33 GB/s an SM.
struct BesideParams {
    TmaDesc o, dout;   // head dim, heads, rows, batch; boxes of 64 x PREPROCESS_ROWS
    BwdParams base;
    int* ready;
    int stages, group_pairs;
};
constexpr int BESIDE_RING = 4;
// Each ring row then serves one writer group's units, in order: a row's mbarriers never have a
// second group waiting on a phase that has not begun.
static_assert(BESIDE_RING % BESIDE_WRITERS == 0, "a ring row per writer group");
constexpr int BESIDE_THREADS = 32 * (BESIDE_LOADERS + BESIDE_WRITERS * BESIDE_ARRIVALS), BESIDE_MAX_STAGES = 8;

template <typename Elem>
__global__ void __launch_bounds__(BESIDE_THREADS, 1) bwd_preprocess_beside_kernel(const __grid_constant__ BesideParams bp) {
    typedef ElemTraits<Elem> Tr;
    typedef typename Tr::storage S;
    constexpr int LOADERS = 32 * BESIDE_LOADERS, LANES = LOADERS / PREPROCESS_ROWS, WRITERS = 32 * BESIDE_ARRIVALS;
    constexpr int BOX = 64 * PREPROCESS_ROWS;   // elements of a 64-column box
    static_assert(sizeof(S) == 2 && LANES == 4 && WRITERS >= PREPROCESS_ROWS, "4 threads a row");
    launch_dependents();
    const BwdParams& p = bp.base;
    extern __shared__ unsigned char smem_raw[];
    // Slots of 2 x boxes boxes (O's, then dO's), 1024-byte aligned for the 128-byte swizzle.
    u16* slots = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    __shared__ __align__(8) unsigned long long full[BESIDE_MAX_STAGES], summed[BESIDE_RING], taken[BESIDE_RING];
    __shared__ float ring[BESIDE_RING][PREPROCESS_ROWS];
    const int boxes = (p.headdim + 63) / 64, slot = 2 * boxes * BOX, stages = bp.stages;
    const int blocks_q = (p.seqlen_q + PREPROCESS_ROWS - 1) / PREPROCESS_ROWS, group = p.group;
    const int pairs = p.batch * p.nheads_k, units = pairs * group * blocks_q, gp = bp.group_pairs;
    // Unit i of the order above: its row block, query head and batch entry.
    auto unit_of = [&](int i) {
        const int g = i / (gp * group * blocks_q), rem = i - g * gp * group * blocks_q;
        const int per_x = min(gp, pairs - g * gp) * group, in_x = rem % per_x;
        const int pair = g * gp + in_x / group;
        return make_int3(rem / per_x, pair % p.nheads_k * group + in_x % group, pair / p.nheads_k);
    };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
        for (int j = 0; j < BESIDE_RING; ++j) {
            mbar_init(&summed[j], LOADERS);
            mbar_init(&taken[j], WRITERS);
        }
        mbar_fence_init();
    }
    __syncthreads();
    if (warp >= BESIDE_LOADERS) {
        // The block's k-th unit (k = the writer group mod BESIDE_WRITERS) through ring row k % BESIDE_RING.
        const int wg = (warp - BESIDE_LOADERS) / BESIDE_ARRIVALS, t = threadIdx.x - LOADERS - wg * WRITERS;
        for (int k = wg, i = blockIdx.x + wg * gridDim.x; i < units; k += BESIDE_WRITERS, i += BESIDE_WRITERS * gridDim.x) {
            const int3 at = unit_of(i);
            const SeqInfo<BwdParams, SEQ_DENSE> seq(p, at.z);
            const int row = at.x * PREPROCESS_ROWS + t;
            const bool in = t < PREPROCESS_ROWS && row < seq.seqlen_q();
            const float lse = in ? *stat_ptr<const float>(p.lse, seq, at.y, row) : 0.f;
            mbar_wait(&summed[k % BESIDE_RING], (k / BESIDE_RING) & 1);
            const float d = t < PREPROCESS_ROWS ? ring[k % BESIDE_RING][t] : 0.f;
            mbar_arrive(&taken[k % BESIDE_RING]);
            if (in) {
                *stat_ptr<float>(p.dsum, seq, at.y, row) = d;
                *stat_ptr<float>(p.lse_log2, seq, at.y, row) = lse_log2(lse);
            }
            zero_dq_rows<WRITERS>(p, seq, at.y, at.x, 0, t);
            __syncwarp();
            if (lane == 0) red_release_add(bp.ready + (at.z * p.nheads + at.y) * blocks_q + at.x, 1);
        }
        return;
    }
    // By the first thread: unit i's O and dO into slot s (rows past the tensor arrive as zeros).
    auto fetch = [&](int i, int s) {
        const int3 at = unit_of(i);
        const SeqInfo<BwdParams, SEQ_DENSE> seq(p, at.z);
        mbar_expect_bytes(&full[s], 2 * boxes * BOX * 2);
        const int row = seq.q_map_row(at.x * PREPROCESS_ROWS), batch = seq.map_batch();
        for (int c = 0; c < boxes; ++c) {
            tma_load_4d(slots + s * slot + c * BOX, bp.o, 64 * c, at.y, row, batch, &full[s]);
            tma_load_4d(slots + s * slot + (boxes + c) * BOX, bp.dout, 64 * c, at.y, row, batch, &full[s]);
        }
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < stages && blockIdx.x + s * gridDim.x < units; ++s) fetch(blockIdx.x + s * gridDim.x, s);
    const int r = threadIdx.x / LANES, l = threadIdx.x % LANES;
    for (int k = 0, i = blockIdx.x; i < units; ++k, i += gridDim.x) {
        const int s = k % stages;
        mbar_wait(&full[s], (k / stages) & 1);
        // Row r's 128 bytes of a box: its 16-byte chunks in the swizzle's order, the same in O
        // and dO, so that a row's sum needs no unswizzling. Of a quarter warp's two rows, one
        // reads chunks 0-3 while the other reads 4-7: no bank is read twice.
        const u16* o = slots + s * slot + r * 64;
        float sum = 0.f;
        for (int c = 0; c < boxes; ++c)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int at_chunk = c * BOX + 8 * (l + 4 * ((r + j) & 1));
                const uint4 ov = *reinterpret_cast<const uint4*>(o + at_chunk);
                const uint4 dv = *reinterpret_cast<const uint4*>(o + boxes * BOX + at_chunk);
                const S* oe = reinterpret_cast<const S*>(&ov);
                const S* de = reinterpret_cast<const S*>(&dv);
#pragma unroll
                for (int e = 0; e < 8; ++e) sum += Tr::load(oe + e) * Tr::load(de + e);
            }
#pragma unroll
        for (int off = LANES / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        // Ring row k % BESIDE_RING, once its writers have taken its last unit's sums.
        if (k >= BESIDE_RING) mbar_wait(&taken[k % BESIDE_RING], (k / BESIDE_RING - 1) & 1);
        if (l == 0) ring[k % BESIDE_RING][r] = sum;
        mbar_arrive(&summed[k % BESIDE_RING]);
        named_bar_sync(1, LOADERS);   // slot s read by every loader thread
        if (threadIdx.x == 0 && i + stages * static_cast<int>(gridDim.x) < units) fetch(i + stages * gridDim.x, s);
    }
}

// The steps of a dK/dV block (key tile n_tile of kv head hk, Bc keys): (query head of the
// group, query block of Br rows) pairs in order, heads without blocks skipped. The producer
// and the consumers walk the same steps.
template <typename V>
struct BwdSteps {
    const BwdParams& p;
    const Mask<V, BwdParams>& mask;
    int hk, n_tile, br, bc;
    struct Step { int hq, it; QueryBlocks qb; };

    __device__ __forceinline__ QueryBlocks blocks_of(int hq) const {
        return query_blocks(p.q_blocks, mask, hk * p.group + hq, n_tile, br, bc);
    }
    __device__ __forceinline__ Step settle(Step s) const {   // move past exhausted heads
        while (s.hq < p.group && s.it >= s.qb.count) {
            ++s.hq;
            s.it = 0;
            if (s.hq < p.group) s.qb = blocks_of(s.hq);
        }
        return s;
    }
    __device__ __forceinline__ Step first() const { return settle(Step{0, 0, blocks_of(0)}); }
    __device__ __forceinline__ Step next(Step s) const { return settle(Step{s.hq, s.it + 1, s.qb}); }
    __device__ __forceinline__ bool done(Step s) const { return s.hq >= p.group; }
    __device__ __forceinline__ int head(Step s) const { return hk * p.group + s.hq; }
    __device__ __forceinline__ int row0(Step s) const { return s.qb.block(s.it) * br; }
};

// The barriers of the copy pipeline: K and V once, and Stages buffers of Q, dO and the rows'
// (lse, D).
template <int Stages>
struct BwdSm90Barriers {
    unsigned long long kv_full, qd_full[Stages], qd_empty[Stages];

    __device__ __forceinline__ void init(int consumers) {
        mbar_init(&kv_full, 1);
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&qd_full[s], 1 + 32);   // the copying thread and the statistics warp
            // Every consumer thread arrives: each has read the stage's statistics itself.
            mbar_init(&qd_empty[s], consumers);
        }
        mbar_fence_init();
    }
};

// The producer warpgroup (the block's last; registers given back first): its first thread has
// the copy engine bring the block's K and V (KeyTiles x Chunks sub-tiles of 64 keys x 64
// columns) once and Q and dO (Chunks sub-tiles of Br rows) per step; its second warp copies
// the steps' row statistics into sstat, so that the consumers hold no registers for them across
// their products. Rows past seqlen_q get lse = +inf: their probabilities are 0. (Their Q and dO
// rows are zeros, the copy engine's fill past the tensor, or in a packed batch the next
// sequence's rows; a neighbour's lse gave a zero score a probability of 2^-lse, which past
// 65504 is inf in fp16's P and made dK and dV NaN through 0 * inf.)
template <int Stages, int Br, int KeyTiles, int Chunks, typename V, typename Seq>
__device__ __forceinline__ void bwd_sm90_produce(const BwdSm90Params& tp, const Seq& seq, const BwdSteps<V>& steps,
                                                 int col0, u16* sK, u16* sV, u16* sQ, u16* sdO, float2 (*sstat)[Br],
                                                 BwdSm90Barriers<Stages>& bar) {
    constexpr int Sub = 64 * 64;
    const BwdParams& p = steps.p;
    const int pw = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    constexpr bool Beside = reads_beside<64 * Chunks, Br, V>();
    if (pw > 1 || (pw == 0 && lane != 0)) return;
    // lse and D (the preprocess's): all of them, or with tp.ready each step's; K, V, Q and dO go first
    if (pw == 1 && (tp.ready == nullptr || !Beside)) wait_for_primary();
    if (pw == 0) {
        mbar_expect_bytes(&bar.kv_full, 2 * KeyTiles * Chunks * Sub * 2);
        for (int kt = 0; kt < KeyTiles; ++kt)
            for (int c = 0; c < Chunks; ++c) {
                const int row = seq.k_map_row(col0 + 64 * kt), batch = seq.map_batch();
                tma_load_4d(sK + (kt * Chunks + c) * Sub, tp.k, 64 * c, steps.hk, row, batch, &bar.kv_full);
                tma_load_4d(sV + (kt * Chunks + c) * Sub, tp.v, 64 * c, steps.hk, row, batch, &bar.kv_full);
            }
    }
    int g = 0;   // query blocks passed: block g goes through stage g % Stages
    for (auto cur = steps.first(); !steps.done(cur); cur = steps.next(cur), ++g) {
        const int buf = g % Stages, h = steps.head(cur), m0 = steps.row0(cur);
        // The step's rows' flags before its stage is free: the wait's round trip runs under the
        // steps before.
        if constexpr (Beside)
            if (pw == 1 && tp.ready != nullptr) wait_ready(tp, seq.b, h, m0, Br, seq.seqlen_q(), lane);
        if (g >= Stages) mbar_wait(&bar.qd_empty[buf], (g / Stages - 1) & 1);
        if (pw == 0) {
            mbar_expect_bytes(&bar.qd_full[buf], 2 * Chunks * Br * 64 * 2);
            const int row = seq.q_map_row(m0), batch = seq.map_batch();
            for (int c = 0; c < Chunks; ++c) {
                tma_load_4d(sQ + (buf * Chunks + c) * Br * 64, tp.q, 64 * c, h, row, batch, &bar.qd_full[buf]);
                tma_load_4d(sdO + (buf * Chunks + c) * Br * 64, tp.dout, 64 * c, h, row, batch, &bar.qd_full[buf]);
            }
        } else {
            for (int i = lane; i < Br; i += 32) {
                const index_t at_row = seq.stat(h, min(m0 + i, seq.seqlen_q() - 1));
                sstat[buf][i] = m0 + i >= seq.seqlen_q()
                                    ? make_float2(__int_as_float(0x7f800000), 0.f)
                                    : make_float2(static_cast<const float*>(p.lse_log2)[at_row],
                                                  static_cast<const float*>(p.dsum)[at_row]);
            }
            mbar_arrive(&bar.qd_full[buf]);
        }
    }
}

// The block's start in both dK/dV kernels: the barriers set, then the producer (threads from
// Consumers on, its registers given back) makes every copy of the block (bwd_sm90_produce) and
// is told to return (true); the consumers take the registers it gave (false).
template <int Stages, int Br, int KeyTiles, int Chunks, int Consumers, typename V, typename Seq>
__device__ __forceinline__ bool bwd_sm90_split(const BwdSm90Params& tp, const Seq& seq, const BwdSteps<V>& steps,
                                               int col0, u16* sK, u16* sV, u16* sQ, u16* sdO, float2 (*sstat)[Br],
                                               BwdSm90Barriers<Stages>& bar) {
    if (threadIdx.x == 0) bar.init(Consumers);
    __syncthreads();
    if (threadIdx.x >= Consumers) {
        setmaxnreg_dec<24>();
        bwd_sm90_produce<Stages, Br, KeyTiles, Chunks>(tp, seq, steps, col0, sK, sV, sQ, sdO, sstat, bar);
        return true;
    }
    setmaxnreg_inc<240>();
    return false;
}

// Returns once the warp's bulk adds but the last Pending have read their shared-memory stages
// (lane 0 issued them; it waits, and the warp goes on together).
template <int Pending>
__device__ __forceinline__ void warp_wait_read(int lane) {
    if (lane == 0) bulk_wait_read<Pending>();
    __syncwarp();
}

// The wide kernel's stage of step g - 1 (its Q and dO tiles, which held that step's dQ stages)
// goes back to the producer once the warp's adds from it have read it.
template <int Stages>
__device__ __forceinline__ void release_step_before(BwdSm90Barriers<Stages>& bar, int g, int lane) {
    warp_wait_read<0>(lane);
    mbar_arrive(&bar.qd_empty[(g - 1) % Stages]);
}

// A warp's 16 rows x 8 * Tiles columns of dQ (fragments of n8 tiles) into its stage in the
// buffer's tile order (register e of lane L of tile j at j * 128 + L * 4 + e); lane 0 first
// waits until the warp's adds but the last Pending have read their stages (the stage's last
// add is older than those).
template <int Tiles, int Pending>
__device__ __forceinline__ void stage_dq_rows(float* stage, const float (&dq)[4 * Tiles], int lane) {
    warp_wait_read<Pending>(lane);
    const u32 at = smem_addr(stage + 4 * lane);
#pragma unroll
    for (int j = 0; j < Tiles; ++j)
        st_shared(at + 4 * j * DQ_TILE, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
}
// The stage then added into the buffer at the warp's first tile `gdq` by one bulk reduce-add
// of `valid` tiles.
__device__ __forceinline__ void push_dq_rows(float* gdq, const float* stage, int valid, int lane) {
    fence_proxy_async();
    __syncwarp();
    if (lane == 0 && valid > 0) {
        bulk_reduce_add_f32(gdq, stage, valid * DQ_TILE * 4);
        bulk_commit();
    }
}
template <int Tiles, int Pending>
__device__ __forceinline__ void add_dq_rows(float* gdq, float* stage, const float (&dq)[4 * Tiles], int valid,
                                            int lane) {
    stage_dq_rows<Tiles, Pending>(stage, dq, lane);
    push_dq_rows(gdq, stage, valid, lane);
}

// Deterministic dQ (tp.dq_order set; dense or causal calls): the key blocks add into a query
// block's rows one after another, in key order. Key block n is then the n-th to visit every
// query block it visits, and it waits until n have added there (one thread polls the
// counter), so the fp32 sums come out the same at every run. The blocks of a head start in
// key order (block_coord), so the one waited for has started. Every consumer thread of the
// block takes part (barrier 6).
__device__ __forceinline__ void dq_turn_wait(const int* counter, int n) {
    if (threadIdx.x == 0) {
        while (ld_acquire(counter) != n) {
        }
        fence_proxy_async_all();   // the adds before, seen by this block's bulk adds
    }
    named_bar_sync(6, 256);
}
// After the block's adds into the query block: each warp waits until its own are written,
// then the counter moves on.
__device__ __forceinline__ void dq_turn_end(int* counter, int lane) {
    if (lane == 0) {
        bulk_wait<0>();
        fence_proxy_async_all();
    }
    named_bar_sync(6, 256);
    if (threadIdx.x == 0) red_release_add(counter, 1);
}

// S^T = K Q^T and dP^T = V dO^T for a warpgroup's 64 keys (its K and V sub-tiles from k and
// v) and N queries (the accumulators' size: 2 N floats each; from q_row0 of the Q and dO
// chunks at q and dout, QChunk elements apart), k16 steps over Chunks chunks of 64 columns;
// two groups committed, S^T's first. StOnto: S^T is added onto what st holds (the bias).
template <typename Elem, int Chunks, int QChunk, bool StOnto = false, int N>
__device__ __forceinline__ void issue_scores_t(float (&st)[N], float (&dpt)[N], const u16* k, const u16* v,
                                               const u16* q, const u16* dout, int q_row0) {
    constexpr int Sub = 64 * 64;
    auto issue = [&](float (&acc)[N], const u16* a, const u16* b, bool onto) {
#pragma unroll
        for (int c = 0; c < Chunks; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss<Elem>(acc, sw128_desc(a, 2 * c * Sub + 32 * kk), sw128_desc(b + 64 * q_row0, 2 * c * QChunk + 32 * kk),
                               onto || c + kk > 0);
        wgmma_commit();
    };
    wgmma_fence();
    issue(st, k, q, StOnto);
    issue(dpt, v, dout, false);
}

// P^T = exp2(S^T * mult - lse) of a warp's S^T fragment (n8 tiles of queries; keys from key0,
// queries from q0), through the score modifier (ALiBi's bias already in st where BiasIn)
// and, where `masked`, the mask; each tile's four probabilities go to sink(nt, pv), and st
// becomes dS^T's factor: P^T times the modifier's gradient. lse_of(nt, j): lse (log2 units)
// of the thread's query column nt * 8 + 2t + j.
// verdicts: a user mask_mod's verdicts on the step (HiddenBits from its first n8 tile), or null
// (the mask runs the snippet itself); bit0: this fragment's first element there.
template <bool BiasIn = false, typename V, int NT, typename LseOf, typename Sink, typename Verdicts = HiddenBits<1, 1>>
__device__ __forceinline__ void probs_t(float (&st)[1][NT][4], const ScoreMod<V, BwdParams>& mod,
                                        const Mask<V, BwdParams>& mask, bool masked, int key0, int q0, int lane,
                                        LseOf&& lse_of, Sink&& sink, const Verdicts* verdicts = nullptr, int bit0 = 0) {
    if constexpr (V::Softcap) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[0][nt][e] = mod.held(st[0][nt][e]);
    }
    if (masked) {
        if (verdicts)
            mask_scores<true>(st, mask, key0, q0, lane, *verdicts, bit0);
        else
            mask_scores<true>(st, mask, key0, q0, lane);
    }
    using C = ScoreCoords<true>;
    const float dist0 = mod.dist0(C(key0, q0, lane));
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float x = BiasIn ? st[0][nt][e] : mod.bias_at(dist0, C::ddiff(0, nt, e), st[0][nt][e]);
            pv[e] = fast_exp2(fmaf(x, mod.mult(), -lse_of(nt, e & 1)));
            st[0][nt][e] = pv[e] * mod.grad(st[0][nt][e]);
        }
        sink(nt, pv);
    }
}

// dS^T = st (dP^T - D) of n8 tile nt of a warp's fragment (st from probs_t); its four values
// go to sink(nt, ds). d_of(nt, j) as lse_of above.
template <int NT, typename DOf, typename Sink>
__device__ __forceinline__ void dscores_t(const float (&st)[1][NT][4], const float (&dpt)[1][NT][4], int nt,
                                          DOf&& d_of, Sink&& sink) {
    float ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) ds[e] = st[0][nt][e] * (dpt[0][nt][e] - d_of(nt, e & 1));
    sink(nt, ds);
}

// With a user score_mod, P^T and dS^T together, element by element: its gradient takes the raw
// S^T and d loss / d its result, P^T (dP^T - D), so st stays raw and dP^T must be in (no part
// of P^T is made under dP^T's product). Each tile's four probabilities go to psink(nt, pv), its
// dS^T to dssink(nt, ds); the arrays' gradients are added here (this pass is the only one).
// verdicts: a user mask_mod's verdicts on the step (as probs_t's), or null.
template <typename V, int NT, typename LseOf, typename DOf, typename PSink, typename DsSink,
          typename Verdicts = HiddenBits<1, 1>>
__device__ __forceinline__ void user_probs_t(const float (&st)[1][NT][4], const float (&dpt)[1][NT][4],
                                             const ScoreMod<V, BwdParams>& mod, const Mask<V, BwdParams>& mask,
                                             bool masked, int key0, int q0, int lane, LseOf&& lse_of, DOf&& d_of,
                                             PSink&& psink, DsSink&& dssink, const Verdicts* verdicts = nullptr,
                                             int bit0 = 0) {
    using C = ScoreCoords<true>;
    const C at(key0, q0, lane);
    const FragmentBand<true, V, BwdParams> band(mask, at);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float pv[4], ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = at.key0 + C::dkey(0, nt, e), query = at.query0() + C::dquery(0, nt, e);
            const float raw = st[0][nt][e];
            pv[e] = fast_exp2(fmaf(mod.user_score(raw, query, key), LOG2E, -lse_of(nt, e & 1)));
            // A snippet that reads a table per score keeps the test of the row and key (beside
            // its loads the band's registers made ptxas serialize the 80-query kernel).
            if (masked && (verdicts   ? band.hides(0, nt, e) || (*verdicts)(bit0 + 4 * nt + e)
                           : V::Mods::Gathers ? mask.hidden(query, key)
                                              : band.hides(0, nt, e) || mask.user_hides(query, key)))
                pv[e] = 0.f;
            ds[e] = mod.user_grad(raw, pv[e] * (dpt[0][nt][e] - d_of(nt, e & 1)), query, key, true);
        }
        psink(nt, pv);
        dssink(nt, ds);
    }
}

// The fp32 dQ buffer's tile of rows row0.. (a multiple of 16) and column col (of 8) of head h.
template <typename Seq>
__device__ __forceinline__ float* dq_tile(const BwdParams& p, const Seq& seq, int h, int row0, int col) {
    return p.dq_accum + (seq.accum_tile(h, row0 / 16) * (p.dq_accum_cols / 8) + col / 8) * DQ_TILE;
}

// Where the host sets tp.dq_done (_launch.convert_overlaps: not causal, head dims above 64), the dQ
// convert kernel runs as this pass's programmatic dependent (launch_dependents in every block once
// the preprocess is done) and waits per (batch, kv head) until all of its blocks have counted
// themselves there. A block counts once all its writes are complete, the dQ adds and dK, dV alike,
// so that the convert's end also means the pass's. count_block_done by one thread; block_done by
// every consumer thread at the end (each warp's lane 0 has waited for its bulk adds and the storing
// threads for their bulk stores). Without tp.dq_done block_done costs nothing (its fence and
// barrier measured 1.5-2% at d = 64 causal 2K). The causal kernels compile neither the trigger nor
// block_done: the d = 256 one ran 2.5% slower with them (A/B, H200).
template <bool Beside = false>
__device__ __forceinline__ void count_block_done(const BwdSm90Params& tp, const BlockCoord& at) {
    if (tp.dq_done == nullptr) return;
    // The preprocess zeroes the counts; the one beside the pass has them zeroed by the host.
    if (!Beside || tp.ready == nullptr) wait_for_primary();
    red_release_add(tp.dq_done + at.batch * tp.base.nheads_k + at.head, 1);
}
template <bool Beside = false>
__device__ __forceinline__ void block_done(const BwdSm90Params& tp, const BlockCoord& at) {
    if (tp.dq_done == nullptr) return;
    fence_proxy_async_all();
    named_bar_sync(6, 256);
    if (threadIdx.x == 0) count_block_done<Beside>(tp, at);
}

// The counter of the query block from row 64 m of head h (tp.dq_order: batch, nheads, 64-row
// blocks).
__device__ __forceinline__ index_t dq_order_at(const BwdParams& p, int b, int h, int m) {
    return (static_cast<index_t>(b) * p.nheads + h) * ((p.seqlen_q + 63) / 64) + m;
}

template <typename Elem, int HeadDim, int Br, typename V>
__global__ void __launch_bounds__(384, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdSm90Params tp) {
    // Br: queries per step (_launch.sm90_bwd_rows). At d = 64, 128 (S^T and dP^T by m64n128:
    // fewer shared-memory bytes per FLOP, half the steps); at 128, S^T and dP^T of 128 queries
    // would not fit beside dK and dV, so 64, or 80 (DqT) where nothing else needs the
    // registers: m64n80 products read 12% fewer shared-memory bytes per FLOP than m64n64, but
    // 80 queries are not a multiple of wgmma's 64 rows, so dQ is made transposed, dQ^T = K^T
    // dS^T for the warpgroup's 64 columns x 80 queries, with dS stored back untransposed.
    // QSplit (Br = 128): each warpgroup's dQ is 64 of the queries x the whole head dim, else
    // all the queries x half the head dim.
    constexpr int Bc = 128, Stages = 2, Consumers = 256;
    constexpr bool QSplit = Br == 128, DqT = Br == 80;
    // A user mask_mod runs on a step's elements while its products run, not between S^T's
    // landing and the probabilities.
    constexpr bool EarlyVerdicts = V::UserMask;
    constexpr int Halves = HeadDim / 64, Sub = 64 * 64, QChunk = Br * 64, NT = Br / 8, DT = HeadDim / 8;
    constexpr int DQ_N = QSplit ? HeadDim : HeadDim / 2;   // the warpgroup's dQ columns
    // A warp's dQ stage (floats): 16 rows x DQ_N, or DqT 16 columns x Br queries, n8 tiles of
    // 8 queries pairing into the 16 x 16 blocks of the buffer's strips (bwd.cu's DQ_STRIPS).
    constexpr int STAGE = 16 * (DqT ? Br : DQ_N);
    static_assert(HeadDim == 64 ? Br == 128 : HeadDim == 128 && (Br == 64 || Br == 80),
                  "the dK and dV accumulators fit the registers up to 128");
    static_assert(!V::Dropout, "dropout runs the generic backward");
    const BwdParams& p = tp.base;

    // K and V (two warpgroups x Halves sub-tiles of 64 rows), Stages buffers of Q and of dO
    // (Halves chunks of Br rows x 64), two steps' dS^T (128 keys x Br queries: sub-tiles of 64
    // x 64, the keys' halves of each 64 queries together; DqT dS, two sub-tiles of Br queries
    // x 64 keys, one per warpgroup), then each consumer warp's fp32 dQ stage (STAGE floats in
    // the buffer's tile order); 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    __shared__ BwdSm90Barriers<Stages> bar;
    __shared__ float2 sstat[Stages][Br];   // (lse in log2 units, D) of each stage's rows
    u16* sK = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sV = sK + 2 * Halves * Sub;
    u16* sQ = sV + 2 * Halves * Sub;
    u16* sdO = sQ + Stages * Halves * QChunk;
    u16* sdSt = sdO + Stages * Halves * QChunk;
    float* sdQ = reinterpret_cast<float*>(sdSt + 2 * 2 * Br * 64);

    // Causal, and in the launch groups of a mask_mod's block mask whose later key blocks are
    // seen by fewer rows (_launch.sm90_grouped): the first key blocks are seen by the most
    // queries.
    const BlockCoord at = block_coord<V::Causal || V::UserMask>(p, p.nheads_k, [](int i) { return i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<BwdParams, V::Seq> seq(p, at.batch);
    const int n_tile = at.tile, col0 = n_tile * Bc;
    if (V::Varlen && col0 >= seq.seqlen_k()) {   // past a packed sequence's end
        if (threadIdx.x == 0) count_block_done(tp, at);
        return;
    }
    Mask<V, BwdParams> mask(p);
    mask.at_batch(at.batch);
    const BwdSteps<V> steps{p, mask, at.head, n_tile, Br, Bc};

    if (bwd_sm90_split<Stages, Br, 2, Halves, Consumers>(tp, seq, steps, col0, sK, sV, sQ, sdO, sstat, bar)) return;

    // The warp index from lane 0 (warp_uniform) keeps the addresses derived from it in uniform
    // registers (with the added descriptors, 971 -> 691 instructions a step at d = 128); beside
    // a user score_mod's snippet that made ptxas spill (a table lookup per score: 24-96 bytes),
    // so those kernels take it plainly.
    const int warp = V::UserScore ? static_cast<int>(threadIdx.x) / 32 : warp_uniform();
    const int lane = threadIdx.x % 32, wg = warp / 4, wq = warp % 4;
    const int t = lane % 4;
    const int key_w = 64 * wg + 16 * wq;   // the warp's first key in the block
    const u16* myK = sK + wg * Halves * Sub;
    const u16* myV = sV + wg * Halves * Sub;
    float* mydQ = sdQ + warp * STAGE;
    // The warpgroup's dQ: its 64 queries (QSplit), or its columns, a 64-wide chunk of K at
    // d = 128.
    const int dq_q = QSplit ? wg : 0, dq_chunk = QSplit ? 0 : wg;
    ScoreMod<V, BwdParams> mod(p);

    float dk[1][DT][4], dv[1][DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) { dk[0][i][e] = 0.f; dv[0][i][e] = 0.f; }

    // The dQ of the step before, staged: its stage, where it goes and its turn
    // (deterministic). (Holding the stage's address here, not recomputing it, measured 2%
    // faster at d = 128.)
    float *stage = nullptr, *gdq = nullptr;
    int* order = nullptr;
    // The stage's tiles that the buffer has (the bucket's columns; DqT also the 16-row
    // blocks that begin before seqlen_q).
    int dq_valid = min(DQ_N / 8, p.dq_accum_cols / 8 - dq_chunk * DQ_N / 8);
    auto push_dq = [&]() {
        if (order) dq_turn_wait(order, n_tile);   // never DqT (_launch.sm90_bwd_rows)
        push_dq_rows(gdq, stage, dq_valid, lane);
        if (order) dq_turn_end(order, lane);
    };
    // The dQ buffer's tiles zeroed (the preprocess); beside the pass, each step's rows, behind
    // the statistics warp's wait for them.
    constexpr bool Beside = reads_beside<HeadDim, Br, V>();
    if (!Beside || tp.ready == nullptr) wait_for_primary();
    // The convert may start once every block has got here: the preprocess is done (it zeroes
    // the counts the convert waits for).
    if constexpr (!V::Causal) launch_dependents();
    mbar_wait(&bar.kv_full, 0);
    int g = 0;
    for (auto cur = steps.first(); !steps.done(cur); cur = steps.next(cur), ++g) {
        const int buf = g % Stages, h = steps.head(cur), m0 = steps.row0(cur);
        const bool masked = cur.qb.needs_mask(cur.it, m0, Br, Bc, col0, mask);
        mod.at_head(seq.b, h);
        mask.at_head(seq.b, h);
        const u16* bQ = sQ + buf * Halves * QChunk;
        const u16* bdO = sdO + buf * Halves * QChunk;

        // S^T = K Q^T and dP^T = V dO^T: the warpgroup's 64 keys x Br queries, k16 steps over
        // the head dim.
        float st[1][NT][4], dpt[1][NT][4];
        float(&st_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(st);
        float(&dpt_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(dpt);
        mbar_wait(&bar.qd_full[buf], (g / Stages) & 1);
        issue_scores_t<Elem, Halves, QChunk>(st_flat, dpt_flat, myK, myV, bQ, bdO, 0);
        if (g > 0) push_dq();   // the step before's, behind this step's products
        // A user mask_mod's verdicts on the step, made while its products run (as the forward's).
        HiddenBits<1, NT> hidden;
        if constexpr (EarlyVerdicts)
            if (masked) hidden = user_hidden_bits<true, 1, NT>(mask, col0 + key_w, m0, lane);

        // The (lse, D) pairs of the thread's query columns nt * 8 + 2t + j.
        auto stat = [&](int nt, int j) { return sstat[buf][nt * 8 + 2 * t + j]; };
        // P^T and dS^T = P^T (dP^T - D) as A fragments (keys x queries); dS^T also into this
        // step's dS^T tile of the warpgroup (128-byte swizzle, keys as rows: the transposed A
        // operand of dS K). The tiles alternate between steps: the other warpgroup may still
        // read the last ones. (Stores here and to the dQ stage by 32-bit shared address: a
        // register each.)
        u32 pa[Br / 16][4], dsa[Br / 16][4];
        u16* dSt = sdSt + (g % 2) * 2 * Br * 64;
        const u32 dSt_s = smem_addr(dSt);
        auto d_of = [&](int nt, int j) { return stat(nt, j).y; };
        auto to_ds = [&](int nt, const float (&ds)[4]) {
            const u32 lo = pack2<Elem>(ds[0], ds[1]), hi = pack2<Elem>(ds[2], ds[3]);
            dsa[nt / 2][2 * (nt % 2)] = lo;
            dsa[nt / 2][2 * (nt % 2) + 1] = hi;
            if constexpr (DqT) {
                // Each pair of n8 tiles as four 8 x 8 matrices (dsa[nt / 2]: keys 0-7 and 8-15
                // of tile nt - 1, then of tile nt), stored transposed into the warpgroup's
                // sub-tile: queries as rows, the warp's 16 keys along them.
                if (nt % 2 == 1) {
                    const int i = lane / 8, q = 8 * (nt - 1 + i / 2) + lane % 8, key = 16 * wq + 8 * (i % 2);
                    stmatrix_x4_trans(dSt_s + 2 * (wg * Br * 64 + swizzled_offset<Br>(q, key)), dsa[nt / 2]);
                }
            } else {
                const int r = 64 * wg + 16 * wq + lane / 4, c = nt % 8 * 8 + 2 * t;
                const u32 tile = dSt_s + nt / 8 * 2 * 2 * Sub;   // the 64 queries' two sub-tiles
                st_shared(tile + 2 * swizzled_offset<64>(r, c), lo);
                st_shared(tile + 2 * swizzled_offset<64>(r + 8, c), hi);
            }
        };
        // Tile by tile once both products are in, each tile's accumulators dying as its fragments
        // are made (at d = 64, 128 queries, P^T made while dP^T ran, beside both accumulators,
        // spilled), in four parts of the queries: dV and dK of a part run while the next part's
        // fragments are made, so that the tensor cores do not wait for the whole tile's.
        wgmma_wait<1>();
        wgmma_fence_operands(st_flat);
        constexpr int Parts = DqT ? 5 : 4, PT = NT / Parts;   // n8 tiles per part
#pragma unroll
        for (int part = 0; part < Parts; ++part) {
            const int nt0 = PT * part;
            auto& st_p = reinterpret_cast<float(&)[1][PT][4]>(st[0][nt0]);
            const auto& dpt_p = reinterpret_cast<const float(&)[1][PT][4]>(dpt[0][nt0]);
            auto ds_of = [&](int nt) {
                dscores_t(st_p, dpt_p, nt, [&](int nt, int j) { return d_of(nt0 + nt, j); },
                          [&](int nt, const float (&ds)[4]) { to_ds(nt0 + nt, ds); });
            };
            auto lse_of = [&](int nt, int j) { return stat(nt0 + nt, j).x; };
            auto to_pa = [&](int nt, const float (&pv)[4]) {
                const int n = nt0 + nt;
                pa[n / 2][2 * (n % 2)] = pack2<Elem>(pv[0], pv[1]);
                pa[n / 2][2 * (n % 2) + 1] = pack2<Elem>(pv[2], pv[3]);
            };
            if constexpr (V::UserScore) {
                if (part == 0) {
                    wgmma_wait<0>();
                    wgmma_fence_operands(dpt_flat);
                }
                user_probs_t(st_p, dpt_p, mod, mask, masked, col0 + key_w, m0 + 8 * nt0, lane, lse_of,
                             [&](int nt, int j) { return d_of(nt0 + nt, j); }, to_pa,
                             [&](int nt, const float (&ds)[4]) { to_ds(nt0 + nt, ds); },
                             EarlyVerdicts ? &hidden : nullptr, 4 * nt0);
            } else {
                probs_t(st_p, mod, mask, masked, col0 + key_w, m0 + 8 * nt0, lane, lse_of,
                        [&](int nt, const float (&pv)[4]) {
                            to_pa(nt, pv);
                            if (part > 0) ds_of(nt);
                        },
                        EarlyVerdicts ? &hidden : nullptr, 4 * nt0);
                if (part == 0) {   // the first part's P^T made while dP^T ran
                    wgmma_wait<0>();
                    wgmma_fence_operands(dpt_flat);
#pragma unroll
                    for (int nt = 0; nt < PT; ++nt) ds_of(nt);
                }
            }
            // dV += P^T dO and dK += dS^T Q over the part's queries (B MN-major: 16 queries =
            // 2048 bytes of a chunk).
            wgmma_fence();
#pragma unroll
            for (int c = 0; c < Halves; ++c)
#pragma unroll
                for (int kk = nt0 / 2; kk < (nt0 + PT) / 2; ++kk) {
                    wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dv[0][8 * c]), pa[kk],
                                   sw128_desc(bdO, 2 * c * QChunk + 2048 * kk), true);
                    if (part < Parts - 1)   // the last part's dK: after dQ's product, below
                        wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dk[0][8 * c]), dsa[kk],
                                       sw128_desc(bQ, 2 * c * QChunk + 2048 * kk), true);
                }
            wgmma_commit();
        }
        // dQ (64 queries x DQ_N columns) += dS K over all 128 keys of the block, once both
        // warpgroups' dS^T tiles are in shared memory: half the fp32 traffic of each warpgroup
        // adding its own keys' share over the whole head dim. DqT: dQ^T (the warpgroup's 64
        // columns x Br queries) = K^T dS^T.
        fence_proxy_async();
        named_bar_sync(6, Consumers);
        float dq[DqT ? Br / 2 : DQ_N / 2];
        wgmma_fence();
#pragma unroll
        for (int kh = 0; kh < 2; ++kh)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const auto k_desc = sw128_desc(sK + dq_chunk * Sub, 2 * kh * Halves * Sub + 2048 * kk);
                if constexpr (DqT)
                    wgmma_ss_tn<Elem>(dq, k_desc, sw128_desc(dSt, 2 * kh * Br * 64 + 32 * kk), kh + kk > 0);
                else
                    wgmma_ss_tt<Elem>(dq, sw128_desc(dSt + 2 * dq_q * Sub, 2 * kh * Sub + 2048 * kk), k_desc, kh + kk > 0);
            }
        wgmma_commit();
        // The last part's dK product runs while dQ is staged (the tensor cores idled through
        // the stores of the stage before): at d = 64 1-2% faster, at d = 128 within 1%; the
        // dK of more parts there measured no better (benchmarks/NOTES.md).
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = (Parts - 1) * PT / 2; kk < NT / 2; ++kk)
                wgmma_rs<Elem>(reinterpret_cast<float(&)[32]>(dk[0][8 * c]), dsa[kk],
                               sw128_desc(bQ, 2 * c * QChunk + 2048 * kk), true);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operands(dq);
        // Each warp's 16 rows into its own stage, added to the buffer in the next step, behind
        // its products (push_dq): the warpgroup's columns, those of them the buffer has (the
        // bucket's: 96 in the 128 kernel, 32 in the 64 one).
        stage = mydQ;
        if constexpr (DqT) {
            const int col = dq_chunk * DQ_N + 16 * wq;
            gdq = p.dq_accum + accum_strip_block(seq, h, static_cast<unsigned>(m0) / 16, col / 16);
            dq_valid = col < p.dq_accum_cols ? 2 * min(Br / 16, (seq.seqlen_q() - m0 + 15) / 16) : 0;
        } else {
            gdq = dq_tile(p, seq, h, m0 + 64 * dq_q + 16 * wq, dq_chunk * DQ_N);
            order = tp.dq_order ? tp.dq_order + dq_order_at(p, seq.b, h, m0 / 64) : nullptr;
        }
        stage_dq_rows<DqT ? Br / 8 : DQ_N / 8, 0>(stage, dq, lane);
        wgmma_wait<0>();
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dk));
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dv));
        mbar_arrive(&bar.qd_empty[buf]);
    }
    if (g > 0) push_dq();
    if (lane == 0) bulk_wait<0>();

    // dK = scale * dk and dV through the warpgroup's K and V tiles (once both warpgroups' dQ
    // products are done with them) to bulk stores; rows past seqlen_k and columns past the
    // head dim are clipped.
    u16* stK = sK + wg * Halves * Sub;
    u16* stV = sV + wg * Halves * Sub;
    mod.flush_grads();
    named_bar_sync(6, Consumers);
    const float scale = static_cast<float>(p.scale);
    stage_swizzled<Elem, 64>(stK, 16 * wq, lane, dk, [=](int, int) { return scale; });
    stage_swizzled<Elem, 64>(stV, 16 * wq, lane, dv, [](int, int) { return 1.f; });
    fence_proxy_async();
    named_bar_sync(4 + wg, 128);
    const int my_col0 = col0 + 64 * wg;
    if (seq.k_rows_own(my_col0, 64)) {
        if (threadIdx.x % 128 == 0) {
#pragma unroll
            for (int c = 0; c < Halves; ++c) {
                tma_store_4d(tp.dk, 64 * c, at.head, seq.k_map_row(my_col0), seq.map_batch(), stK + c * Sub);
                tma_store_4d(tp.dv, 64 * c, at.head, seq.k_map_row(my_col0), seq.map_batch(), stV + c * Sub);
            }
            bulk_commit();
            bulk_wait<0>();
        }
    } else {
        const int rows = seq.seqlen_k() - my_col0, tid = threadIdx.x % 128;
        copy_stage_rows<Halves, 128>(stK, seq.template k_row<u16>(p.dk, at.head, my_col0), p.dk.row_stride, rows,
                                     p.headdim, tid);
        copy_stage_rows<Halves, 128>(stV, seq.template k_row<u16>(p.dv, at.head, my_col0), p.dv.row_stride, rows,
                                     p.headdim, tid);
    }
    if constexpr (!V::Causal) block_done<Beside>(tp, at);
}

// The dK/dV pass at head dim 256 (buckets 160 to 256), where one warpgroup's dK and dV for 64
// keys would take all its registers: both consumer warpgroups work on the same 64 keys, and
// each keeps dK and dV for its half of the head dim (128 columns, 64 + 64 registers). Per
// query block of 64 rows:
// - S^T = K Q^T and dP^T = V dO^T over the whole head dim, each warpgroup for 32 of the
//   queries (wgmma m64n32);
// - P^T and dS^T of those queries through the shared pieces into shared memory (one tile of
//   64 keys x 64 queries each, both warpgroups' halves; two steps' tiles, alternating, so that
//   a warpgroup may start the next step while the other is still adding this one's dQ), then,
//   with both halves there:
// - dV += P^T dO and dK += dS^T Q for the warpgroup's columns, both operands from shared
//   memory; dQ (all 64 rows x the warpgroup's columns) = dS K, 64 columns at a time (m64n64:
//   dS is read from shared memory once per chunk), the second chunk's product running while
//   the first is added (through a stage and a bulk reduce-add, as in the kernel above). The
//   stages are the step's own Q and dO sub-tiles of the warpgroup's columns, free once its dK
//   and dV products have read them; the step's Q and dO go back to the producer once the adds
//   have read them.
// Shared memory: K and V (64 keys x 256), two stages of Q and dO (64 rows x 256) and two
// steps' P^T and dS^T tiles: 225 KB with the alignment.
template <typename Elem, typename V>
__global__ void __launch_bounds__(384, 1)
flash_bwd_sm90_wide_kernel(const __grid_constant__ BwdSm90Params tp) {
    constexpr int HeadDim = 256, Bc = 64, Br = 64, Stages = 2, Consumers = 256, Chunks = HeadDim / 64;
    constexpr int Sub = 64 * 64, QW = Br / 2, NT = QW / 8, DT = HeadDim / 2 / 8, DQ_COLS = 64;
    // ALiBi's bias (ScoreMod::positional) goes into S^T's accumulators before K Q^T is issued
    // onto them, as in the forward (fwd_sm90.cu), instead of being added between S^T's landing
    // and the probabilities: 1.4-3.2% faster here; in the kernel above 2.4% slower to 1.2%
    // faster (benchmarks/NOTES.md).
    constexpr bool BiasFirst = ScoreMod<V, BwdParams>::positional();
    // A user mask_mod's verdicts on the step made while its products run, as in the kernel above.
    constexpr bool EarlyVerdicts = V::UserMask;
    // The step before's Q and dO are released after this step's probabilities, not right
    // behind its S^T and dP^T products: the wait there for the last dQ add's read of its stage
    // (issued at that step's end) outlasted the products (9% of the kernel's stall samples,
    // ncu), where later the read is done and the producer's copies still land in time: 5-6%
    // faster, causal 3-5%. Not in windows, 1.6% slower so (benchmarks/NOTES.md).
    constexpr bool LateRelease = !V::Local;
    static_assert(!V::Dropout, "dropout runs the generic backward");
    const BwdParams& p = tp.base;

    extern __shared__ unsigned char smem_raw[];
    __shared__ BwdSm90Barriers<Stages> bar;
    __shared__ float2 sstat[Stages][Br];
    u16* sK = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sV = sK + Chunks * Sub;
    u16* sQ = sV + Chunks * Sub;
    u16* sdO = sQ + Stages * Chunks * Sub;
    u16* sTiles = sdO + Stages * Chunks * Sub;   // step g's P^T and dS^T: tiles 2 t and 2 t + 1, t = g % 2

    const BlockCoord at = block_coord<V::Causal || V::UserMask>(p, p.nheads_k, [](int i) { return i; });
    if (at.batch >= p.batch) return;
    const SeqInfo<BwdParams, V::Seq> seq(p, at.batch);
    const int n_tile = at.tile, col0 = n_tile * Bc;
    if (V::Varlen && col0 >= seq.seqlen_k()) {   // past a packed sequence's end
        if (threadIdx.x == 0) count_block_done(tp, at);
        return;
    }
    Mask<V, BwdParams> mask(p);
    mask.at_batch(at.batch);
    const BwdSteps<V> steps{p, mask, at.head, n_tile, Br, Bc};

    if (bwd_sm90_split<Stages, Br, 1, Chunks, Consumers>(tp, seq, steps, col0, sK, sV, sQ, sdO, sstat, bar)) return;

    const int warp = warp_uniform(), lane = threadIdx.x % 32, wg = warp / 4, wq = warp % 4;
    const int t = lane % 4, key_w = 16 * wq, q_w = QW * wg;   // the warp's first key, the warpgroup's first query
    ScoreMod<V, BwdParams> mod(p);

    float dk[1][DT][4], dv[1][DT][4];   // the warpgroup's 128 columns
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) { dk[0][i][e] = 0.f; dv[0][i][e] = 0.f; }

    wait_for_primary();   // the dQ buffer's tiles zeroed (the preprocess)
    // The convert may start once every block has got here: the preprocess is done (it zeroes
    // the counts the convert waits for).
    if constexpr (!V::Causal) launch_dependents();
    mbar_wait(&bar.kv_full, 0);
    int g = 0;
    for (auto cur = steps.first(); !steps.done(cur); cur = steps.next(cur), ++g) {
        const int buf = g % Stages, h = steps.head(cur), m0 = steps.row0(cur);
        const bool masked = cur.qb.needs_mask(cur.it, m0, Br, Bc, col0, mask);
        mod.at_head(seq.b, h);
        mask.at_head(seq.b, h);
        u16* bQ = sQ + buf * Chunks * Sub;   // its sub-tiles 2 wg and 2 wg + 1 also stage dQ (below),
        u16* bdO = sdO + buf * Chunks * Sub;   // and so do dO's
        u16* sPt = sTiles + 2 * (g % 2) * Sub;
        u16* sdSt = sPt + Sub;
        const u32 sPt_s = smem_addr(sPt), sdSt_s = smem_addr(sdSt);

        // S^T and dP^T for the warpgroup's 32 queries (rows q_w.. of the Q and dO sub-tiles:
        // 32 rows = 4096 bytes), over the head dim's four sub-tiles.
        float st[1][NT][4], dpt[1][NT][4];
        float(&st_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(st);
        float(&dpt_flat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(dpt);
        if constexpr (BiasFirst) mod.bias_into<true>(st, col0 + key_w, m0 + q_w, lane);
        mbar_wait(&bar.qd_full[buf], (g / Stages) & 1);
        issue_scores_t<Elem, Chunks, Sub, BiasFirst>(st_flat, dpt_flat, sK, sV, bQ, bdO, q_w);
        HiddenBits<1, NT> hidden;
        if constexpr (EarlyVerdicts)
            if (masked) hidden = user_hidden_bits<true, 1, NT>(mask, col0 + key_w, m0 + q_w, lane);
        // The step before's Q and dO go back to the producer once the warp's adds from them
        // (the dQ stages) have read them: here behind this step's products, or (LateRelease)
        // after its probabilities.
        if (!LateRelease && g > 0) release_step_before(bar, g, lane);

        // P^T into its tile (keys as rows, K-major for dV's A operand), and in st the factor
        // of dS^T; the tiles are free: with one step's tiles, both warpgroups passed the end
        // of the last step; with two, the other warpgroup passed the last step's barrier 6
        // below only once done with the step before, which used them.
        auto stat = [&](int nt, int j) { return sstat[buf][q_w + nt * 8 + 2 * t + j]; };
        wgmma_wait<1>();
        wgmma_fence_operands(st_flat);
        const int r = key_w + lane / 4;
        // A tile's four values of the thread into a 64 x 64 tile (keys as rows).
        auto to_tile = [&](u32 tile, int nt, const float (&x)[4]) {
            const int c = q_w + nt * 8 + 2 * t;
            st_shared(tile + 2 * swizzled_offset<64>(r, c), pack2<Elem>(x[0], x[1]));
            st_shared(tile + 2 * swizzled_offset<64>(r + 8, c), pack2<Elem>(x[2], x[3]));
        };
        auto lse_of = [&](int nt, int j) { return stat(nt, j).x; };
        auto d_of = [&](int nt, int j) { return stat(nt, j).y; };
        auto to_pt = [&](int nt, const float (&pv)[4]) { to_tile(sPt_s, nt, pv); };
        auto to_dst = [&](int nt, const float (&ds)[4]) { to_tile(sdSt_s, nt, ds); };
        if constexpr (V::UserScore) {
            wgmma_wait<0>();
            wgmma_fence_operands(dpt_flat);
            user_probs_t(st, dpt, mod, mask, masked, col0 + key_w, m0 + q_w, lane, lse_of, d_of, to_pt, to_dst,
                         EarlyVerdicts ? &hidden : nullptr);
        } else {
            probs_t<BiasFirst>(st, mod, mask, masked, col0 + key_w, m0 + q_w, lane, lse_of, to_pt,
                               EarlyVerdicts ? &hidden : nullptr);
            wgmma_wait<0>();
            wgmma_fence_operands(dpt_flat);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) dscores_t(st, dpt, nt, d_of, to_dst);
        }
        if (LateRelease && g > 0) release_step_before(bar, g, lane);
        // dV += P^T dO and dK += dS^T Q for the warpgroup's columns (sub-tiles 2 wg and 2 wg + 1,
        // one m64n128 product: P^T and dS^T read once per k16 step), over the queries of half
        // `half` of the tiles (that warpgroup's): its own half first, while the other warpgroup
        // may still be making its half.
        auto issue_dkdv = [&](int half) {
            wgmma_fence();
#pragma unroll
            for (int kk = QW / 16 * half; kk < QW / 16 * (half + 1); ++kk) {
                wgmma_ss_bt<Elem>(reinterpret_cast<float(&)[4 * DT]>(dv), sw128_desc(sPt, 32 * kk),
                                  sw128_desc(bdO + 2 * wg * Sub, 2048 * kk, 2 * Sub), true);
                wgmma_ss_bt<Elem>(reinterpret_cast<float(&)[4 * DT]>(dk), sw128_desc(sdSt, 32 * kk),
                                  sw128_desc(bQ + 2 * wg * Sub, 2048 * kk, 2 * Sub), true);
            }
            wgmma_commit();
        };
        fence_proxy_async();
        named_bar_sync(4 + wg, 128);   // the warpgroup's half of P^T and dS^T is in
        issue_dkdv(wg);
        named_bar_sync(6, Consumers);   // and the other's
        issue_dkdv(1 - wg);
        // dQ for the warpgroup's columns, DQ_COLS at a time: dS (queries x keys, from the dS^T
        // tile) K (keys x columns: sub-tile 2 wg + cc).
        constexpr int NC = HeadDim / 2 / DQ_COLS;
        const int valid_chunks = min(NC, (p.dq_accum_cols - HeadDim / 2 * wg + DQ_COLS - 1) / DQ_COLS);
        float dq[2][DQ_COLS / 2];
        auto issue_dq = [&](int cc) {
            const int col = HeadDim / 2 * wg + DQ_COLS * cc;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk)
                wgmma_ss_tt<Elem>(dq[cc % 2], sw128_desc(sdSt, 2048 * kk),
                                  sw128_desc(sK + col / 64 * Sub, 2048 * kk), kk > 0);
            wgmma_commit();
        };
        // Chunk 0 stages in the warp's part of the warpgroup's Q sub-tiles (2 wg and 2 wg + 1:
        // after the barrier above only its own dK product reads them), chunk 1 in its dO ones.
        float* stage[NC] = {reinterpret_cast<float*>(bQ + 2 * wg * Sub) + wq * 16 * DQ_COLS,
                            reinterpret_cast<float*>(bdO + 2 * wg * Sub) + wq * 16 * DQ_COLS};
        int* order = tp.dq_order ? tp.dq_order + dq_order_at(p, seq.b, h, m0 / Br) : nullptr;
        if (order) dq_turn_wait(order, n_tile);
        issue_dq(0);
#pragma unroll
        for (int cc = 0; cc < NC; ++cc) {
            // The next chunk's product runs while this one is added; the first wait also has dV
            // and dK done (the stages free).
            if (cc + 1 < NC) {
                issue_dq(cc + 1);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            wgmma_fence_operands(dq[cc % 2]);
            // Only chunks with columns in the buffer (the first valid_chunks) add. The stages
            // are the step's own: no add of the steps before reads them.
            const int col = HeadDim / 2 * wg + DQ_COLS * cc;
            if (cc < valid_chunks)
                add_dq_rows<DQ_COLS / 8, NC>(dq_tile(p, seq, h, m0 + 16 * wq, col), stage[cc], dq[cc % 2],
                                             min(DQ_COLS / 8, p.dq_accum_cols / 8 - col / 8), lane);
        }
        if (order) dq_turn_end(order, lane);
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dk));
        wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(dv));
    }
    if (lane == 0) bulk_wait<0>();
    mod.flush_grads();
    // Both warpgroups' products are done with K and V.
    named_bar_sync(6, Consumers);

    // dK = scale * dk and dV of the warpgroup's columns through K and V's sub-tiles 2 wg and
    // 2 wg + 1 to bulk stores.
    u16* stK = sK + 2 * wg * Sub;
    u16* stV = sV + 2 * wg * Sub;
    const float scale = static_cast<float>(p.scale);
    stage_swizzled<Elem, 64>(stK, 16 * wq, lane, dk, [=](int, int) { return scale; });
    stage_swizzled<Elem, 64>(stV, 16 * wq, lane, dv, [](int, int) { return 1.f; });
    fence_proxy_async();
    named_bar_sync(4 + wg, 128);
    if (seq.k_rows_own(col0, Bc)) {
        if (threadIdx.x % 128 == 0) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                tma_store_4d(tp.dk, 64 * (2 * wg + hf), at.head, seq.k_map_row(col0), seq.map_batch(), stK + hf * Sub);
                tma_store_4d(tp.dv, 64 * (2 * wg + hf), at.head, seq.k_map_row(col0), seq.map_batch(), stV + hf * Sub);
            }
            bulk_commit();
            bulk_wait<0>();
        }
    } else {
        const int rows = seq.seqlen_k() - col0, tid = threadIdx.x % 128, cols = p.headdim - HeadDim / 2 * wg;
        copy_stage_rows<2, 128>(stK, seq.template k_row<u16>(p.dk, at.head, col0) + HeadDim / 2 * wg,
                                p.dk.row_stride, rows, cols, tid);
        copy_stage_rows<2, 128>(stV, seq.template k_row<u16>(p.dv, at.head, col0) + HeadDim / 2 * wg,
                                p.dv.row_stride, rows, cols, tid);
    }
    if constexpr (!V::Causal) block_done(tp, at);
}
