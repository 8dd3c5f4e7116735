// The compile-time description of an attention call that the kernels are templated on, one
// type for every kernel family. cupyflash/_spec.py (CallSpec.variant) spells it for NVRTC, so
// a new feature adds a flag here and there and nowhere in between.
#pragma once
#include "user.cuh"

// Where a call's rows are (seqinfo.cuh): dense (batch, seqlen, nheads, headdim) tensors, a
// packed variable-length batch, or keys in a KV cache, contiguous or in pages.
enum SeqLayout : int { SEQ_DENSE = 0, SEQ_PACKED = 1, SEQ_CACHE = 2, SEQ_PAGED = 3 };

template <bool Causal_, bool Local_, bool Softcap_, bool Alibi_, bool Dropout_, typename Mods_ = NoMods,
          int Seq_ = SEQ_DENSE>
struct Variant {
    static constexpr bool Causal = Causal_;   // the band (-inf, 0]: causal, bottom-right aligned
    static constexpr bool Local = Local_;     // a band (left, right) read at run time (Mask)
    static constexpr bool Band = Causal || Local;   // the band hides some keys from some rows
    static constexpr bool Softcap = Softcap_; // scores capped by tanh (ScoreMod)
    static constexpr bool Alibi = Alibi_;     // ALiBi bias from per-head slopes (ScoreMod)
    static constexpr bool Dropout = Dropout_; // dropout of the probabilities (dropout.cuh)
    using Mods = Mods_;                       // the user's score_mod and mask_mod (user.cuh)
    static constexpr int Seq = Seq_;          // the rows' layout (SeqLayout)
    static constexpr bool Varlen = Seq == SEQ_PACKED;
    static constexpr bool UserScore = Mods::Score;
    static constexpr bool UserMask = Mods::Mask;
};
