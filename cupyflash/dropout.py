"""Dropout's keep-mask: the exact bits that ``flash_attention(..., dropout_p=p, seed=s,
offset=o)`` uses, from a counter-based generator (nothing of size seqlen_q x seqlen_k is ever
stored; the backward regenerates the same bits).

The generator (cuda/philox.cuh is its CUDA spelling and must match it bit for bit):

- Philox4x32-10 (Salmon et al. 2011, the Random123 constants): multipliers 0xD2511F53 and
  0xCD9E8D57, key bumps 0x9E3779B9 and 0xBB67AE85; key ``(seed & 0xffffffff, seed >> 32)``
  for a uint64 ``seed``.
- Element ``(b, h, i, j)`` (batch entry, query head, query row, key column, 0-based) belongs
  to the group ``gi = (i // 32) * 8 + i % 8``, ``gj = (j // 32) * 8 + j % 8``: the 16
  elements ``i + {0, 8, 16, 24} x j + {0, 8, 16, 24}`` with ``i % 32 < 8``, ``j % 32 < 8``
  share one call, on the counter ``(gj, gi, b * nheads + h, offset)`` (uint32 each).
- The element takes byte ``(j // 8) % 4`` (little-endian: bits ``8 * that`` and up) of word
  ``(i // 8) % 4`` of the call's four, ``u``; it is kept iff ``u >= threshold``,
  ``threshold = round(256 * p)`` clamped to ``[1, 255]`` for ``p > 0`` (Python's ``round``;
  p = 0 keeps everything). So p is used at 1/256 resolution, as FlashAttention 2 does: the
  drop probability is exactly ``threshold / 256`` (``effective_p``), and the kept weights are
  scaled by ``1 / (1 - effective_p(p))``, which keeps every expectation exact.

Why this layout: a tensor-core thread holds rows ``r + 8a`` of its m16 slices and column
``c`` of its n8 tiles of an mma accumulator, in the forward (rows = queries) and in the dK/dV
pass (rows = keys, the tile transposed): one call per group serves both without sharing
between threads, and one call of 128 random bits gives 16 elements, not 4 (the generator was
most of dropout's cost: ~80 integer instructions per call).

Here the generator is vectorized NumPy: the 32 x 32-bit products are exact in uint64.
"""
import numpy as np

from . import _validate

__all__ = ["dropout_mask", "effective_p"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW32 = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)

# Mask elements per generator call in ``dropout_mask``: bounds its uint64 temporaries (about
# 100 MB) on large masks.
_CHUNK = 1 << 20


def philox4x32_10(ctr, key):
    """Philox4x32-10 of counters ``ctr`` (four uint32 values or arrays, broadcast together)
    under ``key`` (two uint32 values or arrays). Returns the four uint32 output words as
    arrays of the broadcast shape."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, np.uint64) for c in ctr))
    k0, k1 = (np.asarray(k, np.uint64) for k in key)
    for r in range(10):
        if r:                          # the first round uses the key as given
            k0, k1 = (k0 + _W0) & _LOW32, (k1 + _W1) & _LOW32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _LOW32, (p0 >> _32) ^ c3 ^ k1, p0 & _LOW32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def threshold(dropout_p):
    """The byte bound below which a random byte drops its element."""
    dropout_p = float(dropout_p)
    return 0 if dropout_p == 0 else min(max(round(dropout_p * 256), 1), 255)


def effective_p(dropout_p):
    """The drop probability the kernels use for ``dropout_p``: a multiple of 1/256 (see the
    module's docstring); kept weights are scaled by ``1 / (1 - effective_p(dropout_p))``."""
    return threshold(dropout_p) / 256


def _group(i):
    return (i // 32) * 8 + i % 8


def keep(bh, rows, cols, dropout_p, seed, offset):
    """Keep bits, bool ``(*bh.shape, len(rows), len(cols))``, of the given heads ``bh``
    (int array of ``b * nheads + h``), query rows and key columns (int arrays). Each group the
    rows and columns touch is generated once. Arguments are not checked (``dropout_mask``
    checks them)."""
    bh = np.asarray(bh, np.int64)
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    gi, row_group = np.unique(_group(rows), return_inverse=True)
    gj, col_group = np.unique(_group(cols), return_inverse=True)
    words = philox4x32_10((gj, gi[:, None], bh[..., None, None], offset),
                          (seed & 0xFFFFFFFF, seed >> 32))
    words = np.stack(words, axis=-3)                            # (*bh, 4, groups_i, groups_j)
    byte_shift = (8 * ((cols // 8) % 4)).astype(np.uint32)[None, :]
    u = words[..., ((rows // 8) % 4)[:, None], row_group[:, None], col_group[None, :]]
    return ((u >> byte_shift) & np.uint32(0xFF)) >= threshold(dropout_p)


def dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, offset=0, xp=np):
    """The keep-mask of ``flash_attention(..., dropout_p=dropout_p, seed=seed,
    offset=offset)`` on inputs with these sizes: True where the attention weight of query
    ``i`` on key ``j`` in head ``h`` of batch entry ``b`` is kept (and scaled by ``1 / (1 -
    effective_p(dropout_p))``), False where it is dropped (with probability
    ``effective_p(dropout_p)``, ``dropout_p`` rounded to a multiple of 1/256).

    Parameters
    ----------
    batch, nheads, seqlen_q, seqlen_k : int
        q's batch, (query) heads and sequence lengths. The bit of ``(b, h, i, j)`` depends on
        nheads (through ``b * nheads + h``) but not on batch or the sequence lengths: the
        mask of longer sequences or more batch entries extends this one.
    dropout_p : float
        Probability of dropping, in ``[0, 1)``.
    seed : int
        In ``[0, 2**64)``, the generator's key.
    offset : int
        In ``[0, 2**32)``: another stream of bits under the same seed (e.g. one per step or
        per layer).
    xp : module
        Array module of the result (``numpy``, ``cupy``, ...: anything with ``asarray``). The
        bits are computed on the CPU by this module's NumPy generator and copied: the mask is
        for tests and inspection, and one spelling of the generator in Python (checked
        against the CUDA one) is easier to trust than two.

    Returns
    -------
    keep : bool array, (batch, nheads, seqlen_q, seqlen_k)
    """
    sizes = [_validate.check_int(name, n, 0) for name, n in
             (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q),
              ("seqlen_k", seqlen_k))]
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset,
                                                      seed_required=True)
    batch, nheads, seqlen_q, seqlen_k = sizes
    if batch * nheads > 2**32:
        raise ValueError(f"batch * nheads must be <= 2**32 (a 32-bit counter), got "
                         f"{batch} * {nheads}")
    for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if n > 2**33:
            raise ValueError(f"{name} must be <= 2**33 (32-bit group counters), got {n}")
    mask = np.empty((batch * nheads, seqlen_q, seqlen_k), bool)
    if dropout_p == 0:
        mask[...] = True
    elif mask.size:
        # Whole heads per call while they fit the chunk, else bands of 32-row groups.
        per_head = seqlen_q * seqlen_k
        heads_per = max(1, _CHUNK // per_head)
        rows_per = seqlen_q if heads_per > 1 else max(32, _CHUNK // seqlen_k // 32 * 32)
        cols = np.arange(seqlen_k)
        for h0 in range(0, batch * nheads, heads_per):
            bh = np.arange(h0, min(h0 + heads_per, batch * nheads))
            for r0 in range(0, seqlen_q, rows_per):
                r1 = min(r0 + rows_per, seqlen_q)
                mask[bh[0]:bh[-1] + 1, r0:r1] = keep(bh, np.arange(r0, r1), cols, dropout_p,
                                                     seed, offset)
    mask = mask.reshape(batch, nheads, seqlen_q, seqlen_k)
    return mask if xp is np else xp.asarray(mask)
