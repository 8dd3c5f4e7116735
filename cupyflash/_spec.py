"""One frozen description of an attention call, and the one visibility rule.

``CallSpec`` holds what decides which kernel runs and how the NumPy path computes: dtype,
head-dim bucket, the band of visible keys (causal, sliding window), the score modifiers and
whether a block mask is given. From it come the template arguments of every kernel (the C++
``Variant<...>`` of cuda/variant.cuh), the key of the tile table and the NumPy path's
options, so that a new feature is added in one place.

The band rule: query row ``i`` sees key ``j`` when ``i + shift - left <= j <= i + shift +
right``, ``shift = seqlen_k - seqlen_q`` (aligned to the bottom-right corner), a negative
``left`` or ``right`` meaning unbounded on that side. ``causal`` is the band ``(-1, 0)``.
``key_range`` and ``query_range`` are its only spelling in Python (mirrored by cuda/mask.cuh).
"""
from dataclasses import dataclass

import numpy as np

from . import _config

NO_WINDOW = (-1, -1)
CAUSAL = (-1, 0)

# Where a call's rows are (cuda/variant.cuh's SeqLayout, cuda/seqinfo.cuh): dense tensors, a
# packed variable-length batch (flash_attention_varlen), keys in a KV cache, contiguous or paged
# (flash_attention_with_kvcache).
SEQ_DENSE, SEQ_PACKED, SEQ_CACHE, SEQ_PAGED = range(4)


def band(causal, window_size=NO_WINDOW):
    """The call's band ``(left, right)``: ``window_size`` with ``causal`` folded in (causal
    closes the right side at 0, as FlashAttention does)."""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return (left, right)


def key_range(rows, seqlen_q, seqlen_k, window):
    """``(begin, end)`` int64 arrays like ``rows``: row ``i`` sees keys ``begin <= j < end``
    (``begin >= end`` when it sees none). Rows may lie outside ``[0, seqlen_q)``."""
    rows = np.asarray(rows, np.int64)
    left, right = window
    shift = seqlen_k - seqlen_q
    begin = np.zeros(rows.shape, np.int64) if left < 0 else np.maximum(rows + shift - left, 0)
    end = (np.full(rows.shape, seqlen_k, np.int64) if right < 0
           else np.minimum(rows + shift + right + 1, seqlen_k))
    return begin, end


def query_range(cols, seqlen_q, seqlen_k, window):
    """``(begin, end)``: key ``j`` is seen by rows ``begin <= i < end``; the transpose of
    ``key_range``."""
    cols = np.asarray(cols, np.int64)
    left, right = window
    shift = seqlen_k - seqlen_q
    begin = np.zeros(cols.shape, np.int64) if right < 0 else np.maximum(cols - shift - right, 0)
    end = (np.full(cols.shape, seqlen_q, np.int64) if left < 0
           else np.minimum(cols - shift + left + 1, seqlen_q))
    return begin, end


def visible(rows, cols, seqlen_q, seqlen_k, window):
    """Bool ``(len(rows), len(cols))``: the band's element mask over those rows and keys."""
    begin, end = key_range(rows, seqlen_q, seqlen_k, window)
    cols = np.asarray(cols, np.int64)[None, :]
    return (cols >= begin[:, None]) & (cols < end[:, None])


@dataclass(frozen=True)
class CallSpec:
    dtype: str                  # NumPy name of q's dtype
    headdim: int                # head-dim bucket (_config.HEAD_DIM_BUCKETS)
    window: tuple = NO_WINDOW   # band (left, right), causal folded in (see ``band``)
    softcap: float = 0.0        # > 0: scores become softcap * tanh(s / softcap)
    alibi: bool = False         # ALiBi slopes are given (an array beside the spec)
    dropout: float = 0.0        # dropout probability (the seed and offset travel beside it)
    sparse: bool = False        # a BlockMask gives the visited tiles
    score_mod: bool = False     # a user score_mod (cupyflash.mods), beside the spec
    mask_mod: bool = False      # a user mask_mod (it comes with the BlockMask built from it)
    user_mods: str = ""         # the kernels' ``struct UserMods`` of the mods' CUDA snippets
    seq: int = SEQ_DENSE        # the rows' layout (SEQ_*)

    @classmethod
    def of(cls, q, *, causal, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
           dropout_p=0.0, block_mask=None, score_mod=None, mask_mod=None, user_mods="",
           seq=SEQ_DENSE):
        """The spec of a call on ``q`` whose arguments were validated; ``causal`` is already
        ORed with the mask's own; ``user_mods`` is ``mods.prelude`` of the GPU's snippets;
        ``seq``: where its rows are (SEQ_*)."""
        return cls(dtype=np.dtype(q.dtype).name, headdim=_config.head_dim_bucket(q.shape[-1]),
                   window=band(causal, window_size), softcap=float(softcap),
                   alibi=alibi_slopes is not None, dropout=float(dropout_p),
                   sparse=block_mask is not None, score_mod=score_mod is not None,
                   mask_mod=mask_mod is not None, user_mods=user_mods, seq=seq)

    @property
    def causal(self):
        """The band is exactly the causal one (its kernels skip the window arithmetic)."""
        return self.window == CAUSAL

    @property
    def local(self):
        """A band other than none and causal: the kernels take (left, right) at run time."""
        return self.window not in (NO_WINDOW, CAUSAL)

    @property
    def masked_band(self):
        """Some key is hidden from some row by the band (not by sequence ends)."""
        return self.window != NO_WINDOW

    @property
    def extras(self):
        """The features beyond the band that cost the kernels registers (the tile table skips
        tiles that spill with them, _config.tile)."""
        return tuple(name for name, on in (("softcap", self.softcap > 0), ("alibi", self.alibi),
                                           ("dropout", self.dropout > 0),
                                           ("user", self.score_mod or self.mask_mod),
                                           ("varlen", self.seq == SEQ_PACKED)) if on)

    def variant(self, band_at_run_time=False):
        """The C++ spelling of the kernels' Variant template argument (cuda/variant.cuh).
        ``band_at_run_time``: every band (none and causal too) as a window read at run time,
        for the plain float32/float64 kernels (cuda/generic.cu), where the mask's compare per
        score is small beside the score's dot product and one instantiation serves all three,
        and for the deterministic mode's passes of cuda/bwd.cu."""
        causal, local = (False, True) if band_at_run_time else (self.causal, self.local)
        flags = (causal, local, self.softcap > 0, self.alibi, self.dropout > 0)
        args = ["true" if f else "false" for f in flags]
        if self.user_mods or self.seq != SEQ_DENSE:
            args.append("UserMods" if self.user_mods else "NoMods")
        if self.seq != SEQ_DENSE:
            args.append(str(self.seq))
        return "Variant<" + ", ".join(args) + ">"

    @property
    def varlen(self):
        """A packed variable-length batch."""
        return self.seq == SEQ_PACKED
