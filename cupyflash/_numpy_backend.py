"""The CPU path: the same tiled FlashAttention-2 algorithm as the CUDA kernels, in float64.

This is the reference the GPU results are checked against and the fallback where no GPU is
present; it is exact, not fast. It follows the kernels step by step so that a reader can use
it to understand them:

- scores of a tile (``_Scores.tile``): ``s = q.k * scale``, then the score modifier
  (``softcap * tanh(s / softcap)``, then the ALiBi bias ``-slope * |i + seqlen_k - seqlen_q -
  j|``), then the band mask (causal, sliding window) on tiles that cross the band's edge;
  ``log2(e)`` folded into the multipliers, so that the scores come out in base-2 units.
- forward: query blocks of ``BR`` rows, key blocks of ``BC`` keys, online softmax in base 2,
  the output rescaled lazily and normalized once at the end; ``lse = (m + log2(l)) /
  log2(e)`` stored in natural log.
- dropout (``_Dropout.keep``): after the softmax statistics, the dropped elements of ``P``
  become 0 before ``P V`` and the output is scaled by ``1 / (1 - p)`` with the normalisation
  (p at the generator's 1/256 resolution, ``dropout.effective_p``),
  as FlashAttention 2 does; ``l``, ``m`` and so lse are those of the undropped softmax. The
  keep bits come from ``cupyflash.dropout``'s generator, tile by tile.
- backward: ``D = rowsum(dout * out)`` first, then for each key block a loop over the query
  blocks that see it, recomputing ``P`` from q, k and lse (and the keep bits from the seed);
  ``dV`` takes the dropped, scaled ``P``, ``dP`` is dropped and scaled the same way, ``dS``
  goes back through the softcap (``1 - tanh**2``), the bias has no gradient. Only tile-sized
  pieces of the seqlen_q x seqlen_k matrices ever exist.

Which key blocks a query block visits is decided in one place, ``key_blocks``: those that
meet the band (causal, window) of some row, partial where the band's edge crosses them; a
block-sparse mask replaces it with its own lists of kept blocks (partial blocks apart from
full ones).

Arrays inside are laid out (batch, nheads_k, group, seqlen, headdim), ``group = nheads //
nheads_k``, so that grouped query heads broadcast against their kv head and dk/dv are summed
over the group by the contractions themselves.
"""

from typing import NamedTuple

import numpy as np

from . import _spec, dropout
from ._config import LOG2E, lse_dtype

BR = 64                 # query rows per tile
BC = 64                 # keys per tile


def key_blocks(q_block, seqlen_q, seqlen_k, window, br=BR, bc=BC):
    """The key blocks that query block ``q_block`` visits, as ``[(key_block, partial), ...]``.

    ``window`` is the call's band ``(left, right)`` (``_spec.band``). Only the key blocks
    that intersect the band of some row of the query block are visited. ``partial`` is True
    where some element of the tile is outside the band (it needs the element mask); sequence
    bounds are not masking here, since the NumPy tiles are sliced to the sequence.
    """
    rows = (q_block * br, min((q_block + 1) * br, seqlen_q) - 1)    # first and last row
    (begin_first, begin_last), (end_first, end_last) = _spec.key_range(
        rows, seqlen_q, seqlen_k, window)
    # Both ends of the band grow with the row: the block's rows together see keys
    # [begin_first, end_last) (consecutive rows' ranges overlap or touch).
    if end_last <= begin_first:
        return []
    visited = []
    for j in range(int(begin_first) // bc, -(-int(end_last) // bc)):
        c0, c1 = j * bc, min((j + 1) * bc, seqlen_k)
        # Full iff every row sees every key: the first row reaches the last key and the last
        # row the first key.
        visited.append((j, bool(c1 > end_first or c0 < begin_last)))
    return visited


def query_blocks(seqlen_q, seqlen_k, window, br=BR, bc=BC):
    """The transposed lists, built from ``key_blocks``: for each key block, the query blocks
    that visit it, ``[[(q_block, partial), ...] per key block]`` (what the backward loops over)."""
    lists = [[] for _ in range(-(-seqlen_k // bc))]
    for i in range(-(-seqlen_q // br)):
        for j, partial in key_blocks(i, seqlen_q, seqlen_k, window, br, bc):
            lists[j].append((i, partial))
    return lists


def _grouped(x, nheads_k):
    """(batch, seqlen, nheads, d) -> float64 (batch, nheads_k, group, seqlen, d)."""
    b, s, h, d = x.shape
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(b, s, nheads_k, h // nheads_k, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x, dtype):
    """(batch, nheads_k, group, seqlen, d) -> contiguous (batch, seqlen, nheads, d) of ``dtype``."""
    b, hk, g, s, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2, 4).reshape(b, s, hk * g, d).astype(dtype))


def _kv(x):
    """(batch, seqlen_k, nheads_k, d) -> float64 (batch, nheads_k, 1, seqlen_k, d)."""
    return np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)[:, :, None]


def _mask_visits(block_mask, causal):
    """The mask's lists (tiles = its blocks) as ``kv[head][q_block] = [(key_block, partial)]``
    and ``qv[head][key_block] = [(q_block, partial)]``, partial ones first."""
    t = block_mask.tile_lists(block_mask.block_q, block_mask.block_k, causal, np)

    def unpack(idx, count, n_partial):
        return [[[(int(j), pos < int(n_partial[hm, row]))
                  for pos, j in enumerate(idx[hm, row, :count[hm, row]])]
                 for row in range(idx.shape[1])]
                for hm in range(idx.shape[0])]

    return unpack(t.kv_idx, t.kv_count, t.kv_partial), unpack(t.q_idx, t.q_count, t.q_partial)


def _head_groups(block_mask, nheads, nheads_k):
    """``(mask_head, kv_heads, group_heads)`` slices of the grouped layout that share one list
    of visited blocks: all heads at once, or one query head at a time for per-head masks."""
    if block_mask is None or block_mask.heads == 1:
        yield 0, slice(None), slice(None)
        return
    g = nheads // nheads_k
    for head in range(nheads):              # query head = kv_head * g + index in group
        yield head, slice(head // g, head // g + 1), slice(head % g, head % g + 1)


class _Scores(NamedTuple):
    """The steps of a call that turn ``q k^T`` of a tile into its scores, in the kernels'
    order: the score modifier (scale, softcap, ALiBi bias, or a user score_mod), then the
    masks (the band, and a user mask_mod in partial tiles)."""
    seqlen_q: int
    seqlen_k: int
    scale: float
    window: tuple           # the band (left, right) of _spec.band
    softcap: float          # 0: off
    slopes: object          # ALiBi slopes, float64 (batch or 1, nheads_k, group), or None
    score_mod: object = None   # a mods.ScoreMod (its python rules), or None
    mask_mod: object = None    # a mods.MaskMod (its python rule), or None
    arrays: dict = {}          # NumPy arrays of the mods, by name
    grads: dict = {}           # float64 gradient buffers d_<name> of the score_mod's arrays
    b_idx: object = None       # int64 (batch, 1, 1, 1, 1): the batch entry of each element
    h_idx: object = None       # int64 (1, nheads_k, group, 1, 1): its query head

    def _user(self, fn, *args, rows, cols, names, extra=()):
        kwargs = {n: self.arrays[n] for n in names}
        kwargs.update(extra)
        return fn(*args, self.b_idx, self.h_idx, rows[:, None], cols[None, :], **kwargs)

    def tile(self, q_t, k_t, r0, r1, c0, c1, partial):
        """Scores of rows ``[r0, r1)`` x keys ``[c0, c1)`` in base-2 units, -inf where masked
        in ``partial`` tiles; and what the backward needs to go back through the score step:
        ``tanh`` of the softcap's argument (its derivative is ``1 - tanh**2``), or the score
        ``q.k * scale`` a user score_mod took; None without either."""
        qk = q_t @ k_t.swapaxes(-1, -2)
        rows, cols = np.arange(r0, r1), np.arange(c0, c1)
        if self.score_mod is not None:
            t = qk * self.scale
            s = self._user(self.score_mod.python, t, rows=rows, cols=cols,
                           names=self.score_mod.arrays) * LOG2E
            s = np.broadcast_to(s, t.shape)
        elif self.softcap:
            # As the kernels fold it: scale / softcap before tanh, softcap * log2(e) after.
            t = np.tanh(qk * (self.scale / self.softcap))
            s = t * (self.softcap * LOG2E)
        else:
            t = None
            s = qk * (self.scale * LOG2E)
        if self.slopes is not None:
            # ALiBi: -slope * |i + seqlen_k - seqlen_q - j|, the distance from the diagonal
            # aligned bottom-right like the band.
            dist = np.abs(rows[:, None] + (self.seqlen_k - self.seqlen_q) - cols[None, :])
            s = s - (self.slopes * LOG2E)[..., None, None] * dist
        # Sequence tails are sliced off here, so only the band and the user's rule mask.
        if partial:
            shown = _spec.visible(rows, cols, self.seqlen_q, self.seqlen_k, self.window)
            if self.mask_mod is not None:
                shown = shown & self._user(self.mask_mod.python, rows=rows, cols=cols,
                                           names=self.mask_mod.arrays)
            s = np.where(shown, s, -np.inf)
        return s, t

    def backprop(self, ds, t, r0, r1, c0, c1):
        """d loss / d (q.k * scale) from d loss / d the tile's final scores ``ds`` (natural
        units), through the softcap or the user's score_mod gradient (which may add to the
        ``grads`` buffers); the ALiBi bias passes it on unchanged."""
        if self.score_mod is not None:
            rows, cols = np.arange(r0, r1), np.arange(c0, c1)
            names = self.score_mod.arrays
            extra = {f"d_{n}": self.grads[n] for n in self.score_mod.grad_arrays}
            return np.broadcast_to(self._user(self.score_mod.python_grad, t, ds, rows=rows,
                                              cols=cols, names=names, extra=extra), ds.shape)
        if t is not None:
            return ds * (1.0 - t * t)
        return ds

    def heads(self, kv_heads, group):
        """The same steps for a slice of the heads (per-head block masks)."""
        out = self
        if self.slopes is not None:
            out = out._replace(slopes=self.slopes[:, kv_heads, group])
        if self.h_idx is not None:
            out = out._replace(h_idx=self.h_idx[:, kv_heads, group])
        return out


def _scores(q, k, scale, spec, alibi_slopes, score_mod=None, mask_mod=None, arrays=None,
            grads=None, batch0=0):
    """The call's ``_Scores``; the slopes, (nheads,) or (batch, nheads), go to the grouped
    layout (batch or 1, nheads_k, group); user mods get index arrays in that layout, the
    batch entries numbered from ``batch0``."""
    slopes = None
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        slopes = slopes.reshape(slopes.shape[0] if slopes.ndim == 2 else 1, k.shape[2], -1)
    b, _, h, _ = q.shape
    hk = k.shape[2]
    b_idx = np.arange(batch0, batch0 + b, dtype=np.int64).reshape(b, 1, 1, 1, 1)
    h_idx = np.arange(h, dtype=np.int64).reshape(1, hk, h // hk, 1, 1)
    return _Scores(q.shape[1], k.shape[1], scale, spec.window, spec.softcap, slopes,
                   score_mod, mask_mod, arrays or {}, grads or {}, b_idx, h_idx)


class _Dropout(NamedTuple):
    """Dropout of the attention weights (after the softmax), keyed like the kernels' by
    (batch, query head, row, column), so that forward and backward find the same bits."""
    dropout_p: float
    seed: int
    offset: int
    bh: object              # int64 (batch, nheads_k, group): b * nheads + query head

    @property
    def kept_fraction(self):
        return 1.0 - dropout.effective_p(self.dropout_p)

    @property
    def rescale(self):
        return 1.0 / self.kept_fraction

    def keep(self, r0, r1, c0, c1):
        """Bool (batch, nheads_k, group, r1 - r0, c1 - c0): the kept elements of the tile."""
        return dropout.keep(self.bh, np.arange(r0, r1), np.arange(c0, c1),
                            self.dropout_p, self.seed, self.offset)

    def heads(self, kv_heads, group):
        return self._replace(bh=self.bh[:, kv_heads, group])


def _dropout(q, k, spec, seed, offset, batch0=0):
    """The call's ``_Dropout`` (with p = 0 the loops skip it). Query head ``h = kv_head *
    group + index``: (b, nheads) reshaped to the grouped layout, the batch entries numbered
    from ``batch0``."""
    b, _, h, _ = q.shape
    bh = np.arange(batch0 * h, (batch0 + b) * h, dtype=np.int64).reshape(b, k.shape[2], h // k.shape[2])
    return _Dropout(spec.dropout, seed, offset, bh)


# NaN and infinity in the inputs flow through as the arithmetic gives them (api.py's
# flash_attention docstring): NumPy's warnings about them are not the caller's business.
_IEEE = dict(invalid="ignore", over="ignore", divide="ignore")


@np.errstate(**_IEEE)
def forward(q, k, v, scale, spec, block_mask=None, alibi_slopes=None, seed=None, offset=0,
            score_mod=None, user_arrays=None, batch0=0):
    """Returns ``(out, lse)``: out like q in q's dtype, lse (batch, nheads, seqlen_q) in
    natural log (float64 for float64 q, else float32); ``-inf`` for rows that see no key.

    ``spec`` is the call's ``_spec.CallSpec`` (its band has the mask's own causal folded in);
    ``alibi_slopes`` the validated NumPy slopes when ``spec.alibi``; ``seed`` and ``offset``
    the generator's when ``spec.dropout`` > 0. With ``block_mask`` (a ``BlockMask`` whose
    geometry was checked), the tiles are the mask's blocks and each query block visits only
    its listed key blocks. ``score_mod`` (a ``mods.ScoreMod``) and the block mask's
    ``mask_mod`` run their ``python`` rules on ``user_arrays`` (NumPy, by name). ``batch0``:
    the index of q's first batch entry (a packed batch's sequence, cupyflash.varlen), which
    the user mods and the dropout generator see; the slopes are those of q's entries."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    q64, k64, v64 = _grouped(q, hk), _kv(k), _kv(v)
    scores = _scores(q, k, scale, spec, alibi_slopes, score_mod, _mask_mod(block_mask),
                     user_arrays, batch0=batch0)
    drop = _dropout(q, k, spec, seed, offset, batch0)
    if block_mask is None:
        br, bc = BR, BC
        kv_lists = [[key_blocks(i, sq, sk, spec.window) for i in range(-(-sq // BR))]]
    else:
        br, bc = block_mask.block_q, block_mask.block_k
        kv_lists, _ = _mask_visits(block_mask, spec.causal)
    out = np.zeros(q64.shape, np.float64)
    lse = np.full(q64.shape[:-1], -np.inf)
    for mask_head, kv_heads, group in _head_groups(block_mask, h, hk):
        out[:, kv_heads, group], lse[:, kv_heads, group] = _forward_tiles(
            q64[:, kv_heads, group], k64[:, kv_heads], v64[:, kv_heads],
            scores.heads(kv_heads, group), drop.heads(kv_heads, group),
            kv_lists[mask_head], br, bc)
    return _ungrouped(out, q.dtype), lse.reshape(b, h, sq).astype(lse_dtype(q.dtype))


def _forward_tiles(q64, k64, v64, scores, drop, kv_list, br, bc):
    """The forward loop over query tiles of ``br`` rows, each visiting the key tiles of
    ``bc`` keys in ``kv_list[query_tile]``, with dropout ``drop`` (a ``_Dropout``).
    Grouped float64 layout in, (out, lse) out."""
    sq, sk = scores.seqlen_q, scores.seqlen_k
    out = np.zeros(q64.shape, np.float64)
    lse = np.full(q64.shape[:-1], -np.inf)
    for i, visits in enumerate(kv_list):
        r0, r1 = i * br, min((i + 1) * br, sq)
        q_t = q64[..., r0:r1, :]
        m = np.full(q_t.shape[:-1], -np.inf)          # running max, base-2 units
        l = np.zeros(q_t.shape[:-1])                  # running sum of exp2(s - m)
        acc = np.zeros(q_t.shape)                     # unnormalized output
        for j, partial in visits:
            c0, c1 = j * bc, min((j + 1) * bc, sk)
            k_t, v_t = k64[..., c0:c1, :], v64[..., c0:c1, :]
            s, _ = scores.tile(q_t, k_t, r0, r1, c0, c1, partial)
            m_new = np.maximum(m, s.max(axis=-1))
            # A row with no visible key yet keeps m = -inf; subtract 0 instead so that
            # exp2(-inf - -inf) never happens (its p and alpha are then exactly 0).
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            p = np.exp2(s - m_safe[..., None])
            alpha = np.exp2(m - m_safe)               # rescales what was summed so far
            l = alpha * l + p.sum(axis=-1)
            if drop.dropout_p:
                # Only P V sees the dropout; l keeps the undropped sum (lse is unchanged).
                p = np.where(drop.keep(r0, r1, c0, c1), p, 0.0)
            acc = alpha[..., None] * acc + p @ v_t
            m = m_new
        # Only a sum of exactly 0 means no visible key: a NaN sum (NaN in q or k, or a +inf
        # score) must stay NaN, as the kernels keep it, not turn into an empty row.
        empty = l == 0
        l_safe = np.where(empty, 1.0, l)
        # Dropout's 1 / (1 - p) on the kept weights is folded into the normalisation.
        norm = l_safe * drop.kept_fraction if drop.dropout_p else l_safe
        out[..., r0:r1, :] = np.where(empty[..., None], 0.0, acc / norm[..., None])
        lse[..., r0:r1] = np.where(empty, -np.inf, (m + np.log2(l_safe)) / LOG2E)
    return out, lse


@np.errstate(**_IEEE)
def backward(dout, q, k, v, out, lse, scale, spec, block_mask=None, alibi_slopes=None,
             seed=None, offset=0, score_mod=None, user_arrays=None, batch0=0):
    """Returns ``(dq, dk, dv)`` shaped and typed like q, k and v (dk, dv summed over the
    query heads of each group). ``spec``, ``block_mask``, ``alibi_slopes``, ``seed``,
    ``offset`` and ``batch0`` as in ``forward``: each key block loops over the query blocks that visit it
    (the mask's transposed lists with a mask). With a score_mod whose ``grad_arrays`` are
    given, a fourth result: their gradients, float64, by name."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    q64, k64, v64 = _grouped(q, hk), _kv(k), _kv(v)
    do64, o64 = _grouped(dout, hk), _grouped(out, hk)
    dsum = (do64 * o64).sum(axis=-1)                  # D = rowsum(dO * O), (b, hk, g, sq)
    lse64 = np.asarray(lse, dtype=np.float64).reshape(b, hk, g, sq)
    # Rows that saw no key (lse = -inf) get P = exp2(s - inf) = 0 instead of inf or NaN.
    lse_log2 = np.where(np.isneginf(lse64), np.inf, lse64 * LOG2E)
    grads = {n: np.zeros(np.shape(user_arrays[n])) for n in
             (score_mod.grad_arrays if score_mod is not None else ())}
    scores = _scores(q, k, scale, spec, alibi_slopes, score_mod, _mask_mod(block_mask),
                     user_arrays, grads, batch0)
    drop = _dropout(q, k, spec, seed, offset, batch0)
    if block_mask is None:
        br, bc = BR, BC
        q_lists = [query_blocks(sq, sk, spec.window)]
    else:
        br, bc = block_mask.block_q, block_mask.block_k
        _, q_lists = _mask_visits(block_mask, spec.causal)
    dq = np.zeros(q64.shape)
    dk = np.zeros(k64.shape[:2] + k64.shape[3:])      # (b, hk, sk, d)
    dv = np.zeros(dk.shape)
    for mask_head, kv_heads, group in _head_groups(block_mask, h, hk):
        dq_h, dk_h, dv_h = _backward_tiles(
            q64[:, kv_heads, group], k64[:, kv_heads], v64[:, kv_heads],
            do64[:, kv_heads, group], dsum[:, kv_heads, group], lse_log2[:, kv_heads, group],
            scores.heads(kv_heads, group), drop.heads(kv_heads, group),
            q_lists[mask_head], br, bc)
        dq[:, kv_heads, group] = dq_h
        dk[:, kv_heads] += dk_h                       # per-head masks: summed head by head
        dv[:, kv_heads] += dv_h
    dk = np.ascontiguousarray(dk.transpose(0, 2, 1, 3).astype(k.dtype))
    dv = np.ascontiguousarray(dv.transpose(0, 2, 1, 3).astype(v.dtype))
    if grads:
        return _ungrouped(dq, q.dtype), dk, dv, grads
    return _ungrouped(dq, q.dtype), dk, dv


def _mask_mod(block_mask):
    return block_mask.mask_mod if block_mask is not None else None


def _backward_tiles(q64, k64, v64, do64, dsum, lse_log2, scores, drop, q_list, br, bc):
    """The backward loop: for each key tile ``j`` of ``bc`` keys, the query tiles of ``br``
    rows in ``q_list[j]``, with dropout ``drop`` (a ``_Dropout``). Returns dq
    (grouped) and dk, dv (b, nheads_k, seqlen_k, d), summed over the group."""
    sq, sk, scale = scores.seqlen_q, scores.seqlen_k, scores.scale
    b, hk, _, _, d = q64.shape
    dq = np.zeros(q64.shape)
    dk = np.zeros((b, hk, sk, d))
    dv = np.zeros(dk.shape)
    for j, visitors in enumerate(q_list):
        c0, c1 = j * bc, min((j + 1) * bc, sk)
        k_t, v_t = k64[..., c0:c1, :], v64[..., c0:c1, :]
        dk_t = np.zeros((b, hk, c1 - c0, d))
        dv_t = np.zeros_like(dk_t)
        for i, partial in visitors:
            r0, r1 = i * br, min((i + 1) * br, sq)
            q_t, do_t = q64[..., r0:r1, :], do64[..., r0:r1, :]
            s, t = scores.tile(q_t, k_t, r0, r1, c0, c1, partial)
            p = np.exp2(s - lse_log2[..., r0:r1, None])
            dp = do_t @ v_t.swapaxes(-1, -2)
            p_out = p
            if drop.dropout_p:
                # out = (P * keep / (1 - dropout_p)) V: dV takes that product, and dP its factor
                # (D, from the dropped out, is consistent with it).
                kept = drop.keep(r0, r1, c0, c1)
                p_out = np.where(kept, p * drop.rescale, 0.0)
                dp = np.where(kept, dp * drop.rescale, 0.0)
            dv_t += (p_out.swapaxes(-1, -2) @ do_t).sum(axis=2)     # summed over the group
            ds = p * (dp - dsum[..., r0:r1, None])    # d loss / d score (natural units)
            ds = scores.backprop(ds, t, r0, r1, c0, c1)
            dk_t += (ds.swapaxes(-1, -2) @ q_t).sum(axis=2) * scale
            dq[..., r0:r1, :] += (ds @ k_t) * scale
        dk[..., c0:c1, :] = dk_t
        dv[..., c0:c1, :] = dv_t
    return dq, dk, dv
