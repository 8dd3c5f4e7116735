// Forward attention for Hopper (sm_90a): the copy engine brings Q, K and V tiles into
// 128-byte-swizzled shared memory (tensor maps of cupyflash/_tma.py, completing on mbarriers),
// and warpgroup matrix multiplies (wgmma) compute S = Q K^T from shared memory and O += P V
// with P from registers. Everything between the two products is the pipeline's pieces, as in
// fwd.cu: the key-block range, the score modifier, the mask, the online softmax and the
// epilogue; wgmma's accumulators have mma.sync's per-warp layout, so they apply unchanged.
//
// Tiles are (query block of 64 x Groups rows, head, batch) of the grid of block_coord's order. At
// HeadDim <= 128 the kernel is persistent: one thread block per SM takes tiles from a counter in
// memory (blocks that draw short causal tiles take more of them); above, a block takes every
// gridDim.x-th tile where tiles are alike long (Strided below), else one tile.
// Groups + 1 warpgroups:
// - the producer (the last warpgroup, its registers given back to the others): one thread
//   issues the copies of each tile's Q and of its K and V blocks into Stages buffers, each
//   buffer reused once every consumer has released it (the `empty` mbarriers), so the next
//   tile's copies run while the consumers finish this one;
// - Groups consumers of 64 rows each (two; three at head dim 64 without a block mask, where
//   a warpgroup's softmax per key block takes as long as its products and two left the tensor
//   cores idle half the time). A consumer issues S = Q K^T of block j, then O += P V of
//   block j - 1, and runs the softmax of block j while the second product is still running:
//   the exponentials of one block overlap the tensor cores' work on the other (rescaling O
//   waits for that product). The consumers take turns issuing their products, in a ring of
//   named barriers, so that one's softmax runs while another's products do (not for softcap
//   alone up to head dim 128: Turns below). Under a causal or windowed band a consumer's rows
//   may see fewer of the tile's key blocks than its last row does: it stops its products
//   there and only passes its turns (OwnWalk).
//   O leaves through shared memory and a bulk tensor store: a stage of its own where shared
//   memory allows (HeadDim <= 128, where the next tile's copies are landing); above, in a
//   block that takes several tiles, a V buffer that the tile's products have done with, so
//   that Q's buffer is free after the tile's last S = Q K^T and the next tile's Q lands under
//   its last products; else the warpgroup's Q tile.
// HeadDim is the head dim rounded up to a multiple of 64: the copy engine fills the columns
// past the real one with zeros, and the epilogue stores only the real ones.
#include "common.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "seqinfo.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "block_iter.cuh"
#include "epilogue.cuh"

// FwdParams, the tensor maps of q, k, v and o (dimensions innermost first: head dim, heads,
// rows, batch; boxes of 64 columns x 64 rows for q and o, x Bc rows for k and v), the grid of
// tiles and the counter of tiles handed out (zero at launch).
struct FwdSm90Params {
    TmaDesc q, k, v, o;
    FwdParams base;
    int* counter;
    int grid[3];
};

// Keys: the keys per block (cupyflash/_launch.py sm90_fwd_keys), S = Q K^T as one m64nKeys
// product per k16 step where its accumulators and O's fit the consumers' registers: 128 up to
// head dim 128, 64 above (80 at 256 without user mods or block masks).
template <typename Elem, int HeadDim, typename V, int Groups, int Keys>
__global__ void __launch_bounds__(128 * (Groups + 1), 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdSm90Params tp) {
    static_assert(Groups == 2 || (Groups == 3 && HeadDim == 64), "a third consumer fits at head dim 64");
    static_assert(Keys % 16 == 0 && (HeadDim <= 128 ? Keys == 128 : Keys <= 80), "S and O in the registers");
    constexpr int Br = 64 * Groups, Bc = Keys, Stages = 2;
    constexpr int Consumers = 128 * Groups;
    constexpr int Halves = HeadDim / 64;   // 64-column sub-tiles of a row block (one swizzle atom wide)
    constexpr int SubQ = 64 * 64, SubKV = Bc * 64;
    constexpr int NT = Bc / 8, DT = HeadDim / 8;
    constexpr bool OwnStage = HeadDim <= 128;   // O's stage beside Q, K and V
    // Persistent where the producer's 40 registers leave the consumers enough: at HeadDim > 128
    // (O alone takes 128 of a consumer's registers) each block takes one tile and the producer,
    // with no counter to draw from, fits in 24.
    // Three consumers share 65536 registers with the producer: 160 each, 32 for it.
    constexpr bool Persistent = HeadDim <= 128;
    constexpr int ProducerRegs = Groups == 3 ? 32 : Persistent ? 40 : 24;
    constexpr int ConsumerRegs = Groups == 3 ? 160 : Persistent ? 232 : 240;
    // The softmax's maxima settle (softmax.cuh) where two consumers take turns: plain, capped
    // and ALiBi scores (the last visited from the diagonal, pivot_of below) measured 2-7%
    // faster; with three consumers (head dim 64) and with user score_mods, whose maxima may
    // climb along the keys, 1.5-6% slower, and above head dim 128 with softcap + ALiBi 5%
    // slower (benchmarks/NOTES.md).
    constexpr bool Settled = Groups == 2 && !V::UserScore && (HeadDim <= 128 || !(V::Alibi && V::Softcap));
    // Settled, up to head dim 128 and without softcap, the softmax does not wait for the
    // block's max (softmax_step below): with softcap that measured 5% slower, above head dim
    // 128 1% faster and it spilled.
    constexpr bool Speculate = Settled && HeadDim <= 128 && !V::Softcap;
    // bf16 softcap alone above head dim 128, whose capped scores take the softmax's fixed base
    // where the host allows it (ScoreMod::bounded): the sums of the p as rounded to bf16
    // (softmax.cuh) come from the tensor cores, P times a column of ones (an m64n8k16 product
    // beside each k16 step of P V), instead of being rounded and added per score in the
    // softmax (3.5-3.9% faster). At 64 and 128 the running max stays: there the fixed base
    // with these sums measured 10% slower at 64 and even at 128 (benchmarks/NOTES.md).
    constexpr bool OnesSum = HeadDim > 128 && same_type<Elem, bf16> && ScoreMod<V, FwdParams>::capped_alone();
    // Above 128, kernels whose tiles take about alike long (not causal, no packed rows, no
    // mask_mod) are persistent with a static stride, which takes no register of the
    // producer's 24: block b takes tiles b, b + gridDim.x, ..., so that its next tile's Q lands
    // under this tile's last products and its epilogue, not after a new block's launch (4%
    // faster at 2K; with O staged in Q's buffer, whose next copy then waited for O's store,
    // even; benchmarks/NOTES.md). Not a window with OnesSum: that kernel spilled 12 bytes
    // strided (NVRTC 13.0). The host launches one block per tile where a block mask's lists
    // make tiles unequal, and must launch that many wherever this is false
    // (_launch.sm90_fwd_strided).
    constexpr bool Strided = !Persistent && !V::Causal && !V::Varlen && !V::UserMask && !(V::Local && OnesSum);
    // O is staged in Q's buffer only above 128 in a block of one tile: a strided block stages
    // it in a V buffer (the epilogue's), so that Q's buffer frees after the tile's last S = Q K^T.
    constexpr bool StageInQ = !OwnStage && !Strided;
    // The descriptors' two words joined (sm90.cuh) but at head dim 128.
    constexpr bool JoinedDesc = HeadDim != 128;
    // ALiBi's bias (ScoreMod::positional) is written into S's accumulators before Q K^T is
    // issued onto them, while the consumer waits for its turn, instead of being added to the
    // scores between their landing and the softmax: 2-6% faster at head dims 128 and 256, 1%
    // slower at 64 (benchmarks/NOTES.md).
    constexpr bool BiasFirst = ScoreMod<V, FwdParams>::positional() && HeadDim > 64;
    // Dense tiles visit their key blocks from the diagonal (pivot_of): ALiBi's, and above head
    // dim 64 a user score_mod's, which is often a bias that falls off with the distance to it
    // (at 64 that order measured up to 6.5% slower: a relative-bias table, short causal rows).
    constexpr bool Pivoted = V::Alibi || (V::UserScore && HeadDim > 64);
    // A consumer walks only the key blocks its own rows see where a band cuts the tile's
    // blocks between its consumers: causal or windowed, with three consumers (192 rows on
    // 128-key blocks) or blocks narrower than 128 keys. Elsewhere (non-causal, or 128 rows on
    // 128 keys) only a sequence's tail would skip, and that measured 0.6-0.9% slower
    // (benchmarks/NOTES.md); the pivoted order (pivot_of) and block lists visit every block.
    constexpr bool OwnWalk = V::Band && !Pivoted && (Groups == 3 || Bc != 128);
    // Causal 192-row tiles end at the last row: the tiles start `lead` rows before row 0 (a
    // multiple of 64, under 192), so that the short tile is the first, which sees one key
    // block, not the last, whose idle consumer kept the turns of all its blocks. Where 192
    // does not divide seqlen_q that is one key block fewer every tile or every second tile
    // (5% of the turns at 2K and 4K; benchmarks/NOTES.md). Not with user mods (they would see
    // rows before 0) nor packed rows (a lead per sequence).
    constexpr bool EndAligned = OwnWalk && Groups == 3 && V::Causal && !V::Local && !V::Varlen && !V::UserScore &&
                                !V::UserMask;
    static_assert(HeadDim % 64 == 0, "rows of whole 128-byte swizzle atoms");
    // Dropout runs the generic forward (_launch.kernel_family): here its generator took the
    // registers of a second block per SM, and the kernel was slower than the generic one.
    static_assert(!V::Dropout, "no dropout in this kernel");
    const FwdParams& p = tp.base;

    // QBufs buffers of Q (Groups warpgroups x Halves sub-tiles), Stages buffers of K and of V,
    // O's stage (as Q); 1024-byte aligned.
    extern __shared__ unsigned char smem_raw[];
    // Q: two buffers where the kernel is persistent, so that the next tile's Q lands while this
    // tile runs (with one, a tile waited ~1.5 us for its Q, hidden only behind the epilogue).
    constexpr int QBufs = Persistent ? 2 : 1, QTile = Groups * Halves * SubQ;
    __shared__ unsigned long long q_full[QBufs], q_empty[QBufs], k_full[Stages], v_full[Stages], k_empty[Stages],
        v_empty[Stages];
    // The tile whose Q the producer loads (-1: no more), written before q_full's arrival. Banded
    // (causal, windowed) and mask_mod kernels: with its coordinates, which only the producer
    // decodes, so that a consumer's tile starts lighter (causal 1-2% faster, windows 0.3-0.9%;
    // a mask_mod's launch groups decoded by each consumer cost it more); in the others the
    // consumers' own decoding of w measured faster than reading them (benchmarks/NOTES.md).
    constexpr bool SlotCoord = V::Band || V::UserMask;
    __shared__ int tile_slot[QBufs];
    __shared__ BlockCoord tile_at[QBufs];
    u16* sQ = reinterpret_cast<u16*>(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);
    u16* sK = sQ + QBufs * QTile;
    u16* sV = sK + Stages * Halves * SubKV;
    u16* sO = OwnStage ? sV + Stages * Halves * SubKV : sQ;   // Strided: per tile, in V
    // Strided: o_free[wg][s % 2] completes once warpgroup wg's store of the s-th tile with
    // key blocks has read O from the V buffer it was staged in (a tile without blocks stores
    // O straight from the registers). One barrier per parity, so that no wait can fall a whole
    // phase behind: a warpgroup stores tile s + 2 only after the producer's copies for it,
    // which wait for tile s's.
    __shared__ unsigned long long o_free[2][2];
    auto o_stored = [&](int wg, int s) {
        if (s >= 0) mbar_wait(&o_free[wg][s % 2], (s / 2) & 1);
    };

    // Tile w of the grid; causal, and in the launch groups of a mask_mod's block mask whose later
    // rows see more blocks (_launch.sm90_grouped): the last query blocks see the most keys.
    const int gx = tp.grid[0], gxy = gx * tp.grid[1], n_work = gxy * tp.grid[2];
    const int n_tiles = (p.seqlen_q + Br - 1) / Br;
    const int lead = EndAligned ? (n_tiles * Br - p.seqlen_q) / 64 * 64 : 0;
    auto first_row = [&](const BlockCoord& at) { return at.tile * Br - lead; };   // the tile's row0
    auto tile = [&](int w) {
        auto longest_first = [&](int i) { return n_tiles - 1 - i; };
        return V::Causal || (V::UserMask && p.launch_group > 0)
                   ? block_coord_at<true>(p, p.nheads, longest_first, w % gx, w % gxy / gx, w / gxy)
                   : block_coord_at<false>(p, p.nheads, longest_first, w % gx, w % gxy / gx, w / gxy);
    };
    // No work: past the grid's end (its last group of heads may be short), or past the end of
    // a packed sequence (the grid covers the longest).
    auto idle = [&](int w) {
        const BlockCoord at = tile(w);
        return at.batch >= p.batch || (V::Varlen && at.tile * Br >= PackedRows<FwdParams>(p, at.batch).sq());
    };
    Mask<V, FwdParams> mask(p);
    // ALiBi's bias is largest on a row's diagonal (key = query + seqlen_k - seqlen_q) and falls
    // off on both sides of it, so a dense tile visits the key block of its middle row's
    // diagonal first, then the blocks after it, then those before it backwards: the rows' maxima
    // are set in the first blocks and settle (in key order they climbed block after block,
    // and settled maxima measured slower than exact ones). A user score_mod's tiles take the
    // same order with exact maxima (ALiBi as a snippet 1.3-8.4% faster at head dims 128 and
    // 256, a relative-bias table even; settled maxima lost again: benchmarks/NOTES.md), by
    // our reading because a row's max then moves in fewer blocks, so fewer warps rescale O.
    // Other tiles go in key order.
    auto pivot_of = [&](const KeyBlocks& kb, int seqlen_q, int seqlen_k, int row0) {
        if (!Pivoted || kb.idx) return 0;
        const int diag = max(row0 + Br / 2 + seqlen_k - seqlen_q, 0) / Bc;
        return max(min(diag - kb.first, kb.count - 1), 0);
    };

    if (threadIdx.x == 0) {
        for (int b = 0; b < QBufs; ++b) mbar_init(&q_full[b], 1);
        // K and V: released by each consumer warp once its products have read the buffer; Q by
        // every consumer thread.
        for (int b = 0; b < QBufs; ++b) mbar_init(&q_empty[b], Consumers);
        for (int s = 0; s < Stages; ++s) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], Consumers / 32);
            mbar_init(&v_empty[s], Consumers / 32);
        }
        if (Strided)
            for (int b = 0; b < 4; ++b) mbar_init(&o_free[b / 2][b % 2], 1);
        mbar_fence_init();
    }
    // OnesSum's column of ones: 256 bf16 ones, written before any product may read them.
    unsigned long long ones_desc = 0;
    if constexpr (OnesSum) {
        __shared__ alignas(128) u16 ones[256];
        if (threadIdx.x < 256) {
            ones[threadIdx.x] = 0x3f80;   // bf16 1.0
            fence_proxy_async();
        }
        ones_desc = plain_desc(ones);
    }
    __syncthreads();

    // Both sides count the tiles (t) and the key blocks (g) they have passed: block g goes
    // through buffer g % Stages, in that buffer's use g / Stages.
    if (threadIdx.x >= Consumers) {
        setmaxnreg_dec<ProducerRegs>();
        if (threadIdx.x != Consumers) return;
        auto next_tile = [&](int w) {
            return Persistent ? static_cast<int>(gridDim.x) + atomicAdd(tp.counter, 1)
                   : Strided  ? w + static_cast<int>(gridDim.x)
                              : n_work;
        };
        for (int w = blockIdx.x, t = 0, g = 0, staged = 0;; ++t) {
            while (w < n_work && idle(w)) w = next_tile(w);
            const int qb = t % QBufs;
            if (t >= QBufs) mbar_wait(&q_empty[qb], (t / QBufs - 1) & 1);
            tile_slot[qb] = w < n_work ? w : -1;
            if (w >= n_work) {
                mbar_arrive(&q_full[qb]);   // no copies: the consumers read -1 and stop
                return;
            }
            const BlockCoord at = tile(w);
            if (SlotCoord) tile_at[qb] = at;
            const SeqInfo<FwdParams, V::Seq> seq(p, at.batch);
            const int h = at.head, hk = h / p.group;
            mask.at_head(at.batch, h);
            const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, at.tile, Br, Bc, lead);
            const int pivot = pivot_of(kb, seq.seqlen_q(), seq.seqlen_k(), first_row(at));
            mbar_expect_bytes(&q_full[qb], QTile * 2);
            for (int part = 0; part < Groups; ++part) {
                // Rows before 0 take row 0's Q: every key is masked from them.
                const int row = first_row(at) + 64 * part;
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sQ + qb * QTile + (part * Halves + c) * SubQ, tp.q, 64 * c, h,
                                seq.q_map_row(EndAligned ? max(row, 0) : row), seq.map_batch(), &q_full[qb]);
            }
            w = next_tile(w);
#pragma unroll 1
            for (int it = 0; it < kb.count; ++it, ++g) {
                int pos = it;
                if constexpr (Pivoted) pos = kb.from_pivot(it, pivot);
                const int buf = g % Stages, n0 = kb.block(pos) * Bc;
                const unsigned reuse = (g / Stages - 1) & 1;   // the use that freed the buffer
                if (g >= Stages) mbar_wait(&k_empty[buf], reuse);
                mbar_expect_bytes(&k_full[buf], Halves * SubKV * 2);
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sK + (buf * Halves + c) * SubKV, tp.k, 64 * c, hk, seq.k_map_row(n0),
                                seq.map_batch(), &k_full[buf]);
                if (g >= Stages) mbar_wait(&v_empty[buf], reuse);
                // Strided, counting tiles with key blocks: a tile's first V goes where warpgroup 0
                // of the tile before staged O (and where warpgroup 1 of the one before that did,
                // if that tile had one block), its second where warpgroup 1 of the tile before did.
                if constexpr (Strided) {
                    if (it == 0) {
                        o_stored(0, staged - 1);
                        o_stored(1, staged - 2);
                    } else if (it == 1) {
                        o_stored(1, staged - 1);
                    }
                }
                mbar_expect_bytes(&v_full[buf], Halves * SubKV * 2);
                for (int c = 0; c < Halves; ++c)
                    tma_load_4d(sV + (buf * Halves + c) * SubKV, tp.v, 64 * c, hk, seq.k_map_row(n0),
                                seq.map_batch(), &v_full[buf]);
            }
            staged += kb.count > 0;
        }
    }
    setmaxnreg_inc<ConsumerRegs>();

    ScoreMod<V, FwdParams> mod(p);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const int wrow = warp * 16;   // warpgroup wg's rows are 64 wg .. 64 wg + 63
    const u16* myQ = sQ + wg * Halves * SubQ;   // in the tile's Q buffer
    float acc[1][DT][4];
    float ones_acc[OnesSum ? 4 : 1];   // OnesSum: rows g and g + 8's sums of the rounded p
    float s[1][NT][4];
    float(&sflat)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(s);
    u32 pa[Bc / 16][4];   // P of the previous block as A fragments

    auto release = [&](unsigned long long* empty) {
        if (lane == 0) mbar_arrive(empty);
    };
    // Q's release also lets the producer write tile_slot again, and an arrival releases only
    // its own thread's accesses: every consumer thread, having read it, arrives.
    int qb = 0;   // the tile's Q buffer
    auto release_q = [&]() { mbar_arrive(&q_empty[qb]); };
    // Key block g's buffer, once its K (full = k_full) or V (v_full) copy has landed.
    auto landed = [&](unsigned long long* full, int g) {
        mbar_wait(&full[g % Stages], (g / Stages) & 1);
        return g % Stages;
    };
    // S = Q K^T of key block g: the warpgroup's 64 rows x Bc keys, k16 steps over the head dim
    // (BiasFirst: onto the bias already in s).
    auto issue_qk = [&](int g) {
        const int buf = landed(k_full, g);
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < Halves; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_ss<Elem>(sflat, sw128_desc<JoinedDesc>(myQ + c * SubQ, 32 * kk),
                               sw128_desc<JoinedDesc>(sK + (buf * Halves + c) * SubKV, 32 * kk),
                               BiasFirst || c + kk > 0);
        wgmma_commit();
    };
    // O += P V: V's rows are the keys (MN-major B), 16 keys = 2048 bytes of a sub-tile. One
    // product spans every column (N = HeadDim, its 64-column atoms SubKV apart): the tensor
    // cores read P's registers once per k16 step, not once per 64 columns.
    auto issue_pv = [&](int g) {
        const int buf = landed(v_full, g);
        // After the wait's loop: a fence the compiler inserted there itself serialized the products.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk)
            wgmma_rs<Elem>(reinterpret_cast<float(&)[4 * DT]>(acc), pa[kk],
                           sw128_desc<JoinedDesc>(sV + buf * Halves * SubKV, 2048 * kk, 2 * SubKV), true);
        if constexpr (OnesSum)
#pragma unroll
            for (int kk = 0; kk < Bc / 16; ++kk) wgmma_rs<Elem>(ones_acc, pa[kk], ones_desc, true);
        wgmma_commit();
    };
    // P as A fragments: keys 16kk.. are the n8 tiles 2kk and 2kk + 1.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                pa[kk][r] = pack2<Elem>(s[0][2 * kk + r / 2][2 * (r % 2)], s[0][2 * kk + r / 2][2 * (r % 2) + 1]);
    };
    // Turns: warpgroup wg issues its products after bar.sync on barrier 2 + wg (its 128
    // threads and the 128 of the one before it, which arrive), then hands the turn to the next
    // with bar.arrive on that one's barrier; warpgroup 0 goes first in each tile. The last
    // warpgroup hands the turn on after its last products of a tile too, so that warpgroup 0
    // starts the next tile's products while the others finish this one and store O (else the
    // tensor cores idled through the last warpgroup's epilogue at every tile). Every sync pairs
    // with one arrival: the last warpgroup's first arrival opens the turns, and warpgroup 0
    // takes the final hand-on when there is no tile left.
    // softcap alone up to head dim 128 runs without the turns, measured 0.6-1.3% faster (its
    // softmax, a tanh and an exp2 per score, outlasts the other warpgroup's products either
    // way); without them softcap with ALiBi ran 2% slower, plain d=128 even and three
    // consumers at d=64 8% slower (benchmarks/NOTES.md).
    constexpr bool Turns = !(ScoreMod<V, FwdParams>::capped_alone() && !V::UserMask && HeadDim <= 128);
    auto my_turn = [&]() { if constexpr (Turns) named_bar_sync(2 + wg, 256); };
    auto hand_on = [&]() { if constexpr (Turns) named_bar_arrive(2 + (wg + 1) % Groups, 256); };
    bool turns_started = false;   // the last warpgroup's first arrival has let warpgroup 0 go

    const bool store_thread = threadIdx.x % 128 == 0;   // issues its warpgroup's stores of O
    u16* myO = sO + wg * Halves * SubQ;
    for (int t = 0, g = 0, staged = 0;; ++t) {
        qb = t % QBufs;
        myQ = sQ + qb * QTile + wg * Halves * SubQ;
        mbar_wait(&q_full[qb], (t / QBufs) & 1);
        const int w = *static_cast<volatile int*>(&tile_slot[qb]);
        if (w < 0) {
            if (wg == 0 && turns_started) my_turn();   // the last tile's final hand-on
            break;
        }
        const volatile BlockCoord& slot = tile_at[qb];
        const BlockCoord at = SlotCoord ? BlockCoord{slot.tile, slot.head, slot.batch} : tile(w);
        const SeqInfo<FwdParams, V::Seq> seq(p, at.batch);
        const int h = at.head, row0 = first_row(at);
        mask.at_head(at.batch, h);
        mod.at_head(at.batch, h);
        const KeyBlocks kb = key_blocks(p.kv_blocks, mask, h, at.tile, Br, Bc, lead);
        const int pivot = pivot_of(kb, seq.seqlen_q(), seq.seqlen_k(), row0);
        // The blocks this warpgroup's rows see, from the tile's first. Past them it keeps its
        // turns and releases the buffers, so that the ring and the producer go on as for the
        // others. Its index from lane 0: the count stays in a uniform register (from threadIdx
        // it spilled with three consumers).
        const int own = OwnWalk ? kb.blocks_seen(mask, row0 + 64 * (warp_uniform() / 4), 64, Bc) : kb.count;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;
        if constexpr (OnesSum)
#pragma unroll
            for (int e = 0; e < 4; ++e) ones_acc[e] = 0.f;
        OnlineSoftmax<2, 4, Elem, OnesSum> softmax;
        softmax.init(mod.bounded());   // the fixed base (softmax.cuh) where OnesSum
        // A user mask_mod's verdicts on block `it`, where it needs the mask: made while its
        // S = Q K^T is still running (the snippet's array reads waited for in the chain
        // between S and the softmax made a document mask's partial blocks ~6x the cost of
        // full ones; benchmarks/NOTES.md). Not in the banded kernels with ALiBi at head dim
        // 128, where the bits' two registers spill 4-20 bytes: there the mask runs the snippet
        // inline.
        constexpr bool EarlyVerdicts = V::UserMask && (HeadDim != 128 || !(V::Band && V::Alibi));
        // The position in the tile's list of the it-th block visited (pivoted tiles' from the pivot).
        auto pos_of = [&](int it) {
            if constexpr (Pivoted) return kb.from_pivot(it, pivot);
            else return it;
        };
        HiddenBits<1, NT> hidden;
        auto user_verdicts = [&](int it) {
            if constexpr (EarlyVerdicts) {
                const int pos = pos_of(it);
                if (kb.needs_mask<V>(pos, Bc))
                    hidden = user_hidden_bits<false, 1, NT>(mask, row0 + wrow, kb.block(pos) * Bc, lane);
            }
        };
        // BiasFirst: block `it`'s bias into s, before its Q K^T is issued (the scores of the
        // block before are packed as P by then).
        auto bias_first = [&](int it) {
            if constexpr (BiasFirst) mod.bias_into<false>(s, row0 + wrow, kb.block(pos_of(it)) * Bc, lane);
        };
        // The held scores of block `it` (landed in s): the score modifier and the mask.
        auto hold = [&](int it) {
            const int pos = pos_of(it);
            const int n0 = kb.block(pos) * Bc;
            if constexpr (!BiasFirst) mod.apply<false>(s, row0 + wrow, n0, lane);
            if (kb.needs_mask<V>(pos, Bc)) {
                if constexpr (EarlyVerdicts)
                    mask_scores<false>(s, mask, row0 + wrow, n0, lane, hidden, 0);
                else
                    mask_scores<false>(s, mask, row0 + wrow, n0, lane);
            }
        };
        // S of block `it` is done with: its K buffer is free, and after the last, Q's.
        auto scores_done = [&](int it) {
            release(&k_empty[(g + it) % Stages]);
            if (!StageInQ && it == own - 1) release_q();
        };
        // S of block `it` has landed (where the softmax speculates, K and Q are kept until its
        // step).
        auto scores_landed = [&](int it) {
            wgmma_fence_operands(sflat);
            if (!Speculate) scores_done(it);
        };
        // Scores of block `it` to probabilities; true where O needs rescaling. Speculating,
        // past the first block, a warp whose rows all have a max exponentiates on them at once
        // (OnlineSoftmax::speculate); where some thread of the warpgroup cannot use its p (a
        // vote on barrier 2 + 2 Groups + wg, its 128 threads), the warpgroup computes the
        // block's S again and takes the exact step on it.
        auto softmax_step = [&](int it, float (&alpha)[2]) {
            hold(it);
            if constexpr (Speculate) {
                bool moved = false;
                if (it == 0) {
                    moved = softmax.template step<true>(s, mod.mult(), alpha);
                } else {
                    const float m0[2] = {softmax.m[0], softmax.m[1]}, l0[2] = {softmax.l[0], softmax.l[1]};
                    const bool fresh = __any_sync(0xffffffffu, softmax.fresh());
                    float part[2];
                    bool big = false;
                    if (fresh)
                        moved = softmax.template step<true>(s, mod.mult(), alpha);
                    else
                        big = softmax.speculate(s, mod.mult(), part);
                    if (!named_bar_any(2 + 2 * Groups + wg, 128, big)) {
                        if (!fresh) softmax.add_sums(part);
                    } else {
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            softmax.m[r] = m0[r];
                            softmax.l[r] = l0[r];
                        }
                        bias_first(it);
                        issue_qk(g + it);
                        wgmma_wait<0>();
                        wgmma_fence_operands(sflat);
                        hold(it);
                        moved = softmax.template step<false>(s, mod.mult(), alpha);
                    }
                }
                scores_done(it);
                return moved;
            } else {
                return softmax.template step<Settled>(s, mod.mult(), alpha);
            }
        };

        if (kb.count > 0) {
            float alpha[2];
            if (Turns && wg == Groups - 1 && !turns_started) named_bar_arrive(2, 256);
            turns_started = true;
            bias_first(0);
            my_turn();
            issue_qk(g);
            hand_on();
            user_verdicts(0);
            wgmma_wait<0>();
            scores_landed(0);
            softmax_step(0, alpha);   // O is still zero: nothing to rescale
            pack_p();
            for (int it = 1; it < own; ++it) {
                bias_first(it);
                my_turn();
                issue_qk(g + it);
                issue_pv(g + it - 1);
                hand_on();
                user_verdicts(it);
                wgmma_wait<1>();
                scores_landed(it);
                const bool moved = softmax_step(it, alpha);
                wgmma_wait<0>();
                wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(acc));
                release(&v_empty[(g + it - 1) % Stages]);
                if (moved) softmax.rescale(acc, alpha);
                pack_p();
            }
            my_turn();
            issue_pv(g + own - 1);
            hand_on();
            wgmma_wait<0>();
            wgmma_fence_operands(reinterpret_cast<float(&)[4 * DT]>(acc));
            release(&v_empty[(g + own - 1) % Stages]);
            // A buffer is released once its copy has landed: an earlier arrival could count
            // towards its previous use.
            for (int it = own; it < kb.count; ++it) {
                my_turn();
                hand_on();
                release(&k_empty[landed(k_full, g + it)]);
                release(&v_empty[landed(v_full, g + it)]);
            }
        } else if (!StageInQ) {
            release_q();
        }
        g += kb.count;

        // O through the warpgroup's stage (barrier 2 + Groups + wg: its 128 threads) to a bulk
        // store. Strided, a tile without key blocks (a window's rows that see no key) stores
        // O = 0 and lse = -inf from the registers instead: it has no V buffer of its own.
        const int own_bar = 2 + Groups + wg;
        if (Strided && kb.count == 0) {
            float inv_l[2], lse[2];
            softmax.template finalize<true>(mod.mult(), inv_l, lse);
            fwd_store_rows<Elem>(p, seq, h, row0 + wrow, lane, acc, inv_l, lse);
            continue;
        }
        if constexpr (Strided) {
            // The V buffer of the tile's last block (warpgroup 1, the last to read it) or of the
            // one before (warpgroup 0), once both warpgroups' products have read it. In a tile
            // of one block, the one before is the last block of the tile before with blocks,
            // where warpgroup 1 staged.
            const int x = g - 2 + wg;
            myO = sV + (x + Stages) % Stages * Halves * SubKV;
            if (x >= 0) mbar_wait(&v_empty[x % Stages], (x / Stages) & 1);
            if (wg == 0 && kb.count == 1) o_stored(1, staged - 1);
        }
        if (!StageInQ && store_thread) bulk_wait_read<0>();   // the last tile's store has read it
        named_bar_sync(own_bar, 128);
        // Rows all before row 0 (EndAligned) store nothing.
        const int my_row0 = row0 + 64 * wg;
        const bool stored = !EndAligned || my_row0 >= 0;
        if constexpr (OnesSum) {
            wgmma_fence_operands(ones_acc);
            const float sums[2] = {ones_acc[0], ones_acc[2]};
            softmax.rounded_sums(sums);
        }
        if (stored)
            fwd_stage_swizzled<Elem, 64>(p, seq, h, my_row0, wrow - 64 * wg, lane, softmax, mod.mult(), acc, myO);
        fence_proxy_async();
        named_bar_sync(own_bar, 128);
        if (stored && seq.q_rows_own(my_row0, 64)) {
            if (store_thread) {
#pragma unroll
                for (int c = 0; c < Halves; ++c)
                    tma_store_4d(tp.o, 64 * c, h, seq.q_map_row(my_row0), seq.map_batch(), myO + c * SubQ);
                bulk_commit();
                if (StageInQ) bulk_wait_read<0>();
            }
        } else if (stored) {
            copy_stage_rows<Halves, 128>(myO, seq.template q_row<u16>(p.o, h, my_row0), p.o.row_stride,
                                         seq.seqlen_q() - my_row0, p.headdim, threadIdx.x % 128);
        }
        if (Strided) {   // dense rows: the bulk store is the stage's only reader
            if (store_thread) {
                bulk_wait_read<0>();
                mbar_arrive(&o_free[wg][staged % 2]);
            }
            ++staged;
        } else if (StageInQ) {
            named_bar_sync(own_bar, 128);   // the store has read Q's tile: the next Q may land
            release_q();
        }
    }
    if (store_thread) bulk_wait<0>();
}
